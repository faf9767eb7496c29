//! An in-process HTTP/1.1 upstream (hyper 1) on 127.0.0.1:0: answers every request, counts
//! requests and remembers the last one, so tests can prove what Envoy let through.
//!
//! It runs on its own thread with its own tokio runtime, so it keeps serving no matter what
//! the test's runtime is doing (blocking admin calls, `current_thread` tests) and it is shut
//! down deterministically on `Drop`. [`Upstream::with_handler`] turns it into a scriptable
//! fake (e.g. a limiter that answers 503 or too slowly).

use std::convert::Infallible;
use std::net::{Ipv4Addr, TcpListener as StdTcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

use crate::process;

/// What the upstream saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordedRequest {
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Lowercased names, in arrival order (repeated headers appear repeatedly).
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl RecordedRequest {
    /// First value of a header (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What a [`Upstream::with_handler`] handler answers.
#[derive(Debug, Clone)]
pub struct MockResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// Wait this long before answering (to provoke timeouts).
    pub delay: Duration,
}

impl MockResponse {
    pub fn new(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.into(),
            delay: Duration::ZERO,
        }
    }

    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// The body [`Upstream::start`] answers with.
pub const UPSTREAM_BODY: &str = "upstream ok";

type Handler = dyn Fn(&RecordedRequest) -> MockResponse + Send + Sync;

struct State {
    requests: AtomicU64,
    last: Mutex<Option<RecordedRequest>>,
    handler: Box<Handler>,
}

/// A running upstream; stops on `Drop`.
pub struct Upstream {
    port: u16,
    state: Arc<State>,
    shutdown: Option<oneshot::Sender<()>>,
    done: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("port", &self.port)
            .field("requests", &self.requests())
            .finish()
    }
}

impl Upstream {
    /// Answer 200 `upstream ok` (`content-type: text/plain`, `x-upstream: tollgate-e2e`).
    pub fn start() -> Upstream {
        Self::with_handler(|_| {
            MockResponse::new(200, UPSTREAM_BODY)
                .header("content-type", "text/plain")
                .header("x-upstream", "tollgate-e2e")
        })
    }

    /// Answer every request with whatever `handler` returns.
    pub fn with_handler(
        handler: impl Fn(&RecordedRequest) -> MockResponse + Send + Sync + 'static,
    ) -> Upstream {
        let listener = StdTcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("upstream: cannot bind 127.0.0.1:0: {e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        listener
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("upstream: set_nonblocking: {e}"));
        let state = Arc::new(State {
            requests: AtomicU64::new(0),
            last: Mutex::new(None),
            handler: Box::new(handler),
        });
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let thread_state = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name(format!("e2e-upstream-{port}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("upstream runtime");
                rt.block_on(serve(listener, thread_state, shutdown_rx));
                // Dropping the runtime drops in-flight connections.
                drop(rt);
                let _ = done_tx.send(());
            })
            .expect("spawn upstream thread");
        Upstream {
            port,
            state,
            shutdown: Some(shutdown_tx),
            done: done_rx,
            thread: Some(thread),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Requests answered (or being answered) so far.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// The most recent request.
    pub fn last_request(&self) -> Option<RecordedRequest> {
        self.state
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Headers of the most recent request (lowercased names); empty if none yet.
    pub fn last_headers(&self) -> Vec<(String, String)> {
        self.last_request().map(|r| r.headers).unwrap_or_default()
    }

    /// Wait (bounded) until at least `n` requests arrived; returns the count seen.
    pub fn wait_requests(&self, n: u64, timeout: Duration) -> u64 {
        process::wait_for(&format!("{n} upstream requests"), timeout, || {
            let seen = self.requests();
            (seen >= n).then_some(seen)
        })
        .unwrap_or_else(|e| panic!("{e} (seen {})", self.requests()))
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if self.done.recv_timeout(Duration::from_secs(5)).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        } else {
            eprintln!("e2e: upstream on port {} did not stop within 5s", self.port);
        }
    }
}

async fn serve(listener: StdTcpListener, state: Arc<State>, mut shutdown: oneshot::Receiver<()>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("e2e: upstream: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let state = Arc::clone(&state);
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(req, Arc::clone(&state)));
                    // HTTP/1.1 and h2c (prior knowledge) on one port, so it can also stand in
                    // for the limiter, which Envoy reaches over h2c.
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
                });
            }
        }
    }
}

async fn handle(
    req: hyper::Request<Incoming>,
    state: Arc<State>,
) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let recorded = RecordedRequest {
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_else(|| "/".into()),
        headers: parts
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    let answer = (state.handler)(&recorded);
    *state.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(recorded);
    state.requests.fetch_add(1, Ordering::SeqCst);
    if !answer.delay.is_zero() {
        tokio::time::sleep(answer.delay).await;
    }
    let mut resp = hyper::Response::builder().status(answer.status);
    for (k, v) in &answer.headers {
        resp = resp.header(k.as_str(), v.as_str());
    }
    Ok(resp
        .body(Full::new(Bytes::from(answer.body)))
        .unwrap_or_else(|e| {
            let mut r =
                hyper::Response::new(Full::new(Bytes::from(format!("bad mock response: {e}"))));
            *r.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
            r
        }))
}
