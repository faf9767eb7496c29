//! An in-process HTTP/1.1 upstream (hyper 1) on 127.0.0.1:0: answers every request, counts
//! requests and remembers the last one, so tests can prove what Envoy let through.
//!
//! It runs on its own thread with its own tokio runtime, so it keeps serving no matter what
//! the test's runtime is doing (blocking admin calls, `current_thread` tests) and it is shut
//! down deterministically on `Drop`. [`Upstream::with_handler`] turns it into a scriptable
//! fake (e.g. a limiter that answers 503 or too slowly).
//!
//! That server skeleton ([`HttpServer`]: bind, accept loop, shutdown) is also the one under
//! [`crate::metered::MeteredUpstream`].

use std::convert::Infallible;
use std::future::Future;
use std::net::{Ipv4Addr, TcpListener as StdTcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
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
    server: HttpServer,
    state: Arc<State>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("port", &self.port())
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
        let state = Arc::new(State {
            requests: AtomicU64::new(0),
            last: Mutex::new(None),
            handler: Box::new(handler),
        });
        let served = Arc::clone(&state);
        let server = HttpServer::start("upstream", move |req| handle(req, Arc::clone(&served)));
        Upstream { server, state }
    }

    pub fn port(&self) -> u16 {
        self.server.port()
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

/// An HTTP server on 127.0.0.1:0 that answers every request with a handler, on a thread of
/// its own with its own current-thread tokio runtime (HTTP/1.1 and h2c prior knowledge on one
/// port, so it can also stand in for the limiter, which Envoy reaches over h2c). Stopped on
/// `Drop`: the accept loop ends, the runtime and with it every connection is dropped, and the
/// thread is joined (bounded).
pub(crate) struct HttpServer {
    name: &'static str,
    port: u16,
    shutdown: Option<oneshot::Sender<()>>,
    done: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Bind and serve with `handler`; `name` labels the thread and the messages. Panics if it
    /// cannot bind or start its thread.
    pub(crate) fn start<H, F, B>(name: &'static str, handler: H) -> HttpServer
    where
        H: Fn(hyper::Request<Incoming>) -> F + Send + Sync + 'static,
        F: Future<Output = Result<hyper::Response<B>, Infallible>> + Send + 'static,
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let listener = StdTcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("{name}: cannot bind 127.0.0.1:0: {e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        listener
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("{name}: set_nonblocking: {e}"));
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let handler = Arc::new(handler);
        let thread = std::thread::Builder::new()
            .name(format!("e2e-{}-{port}", name.replace(' ', "-")))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap_or_else(|e| panic!("{name} runtime: {e}"));
                rt.block_on(serve(name, listener, handler, shutdown_rx));
                // Dropping the runtime drops the connections and their answers in flight.
                drop(rt);
                let _ = done_tx.send(());
            })
            .unwrap_or_else(|e| panic!("spawn {name} thread: {e}"));
        HttpServer {
            name,
            port,
            shutdown: Some(shutdown_tx),
            done: done_rx,
            thread: Some(thread),
        }
    }

    pub(crate) fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if self.done.recv_timeout(Duration::from_secs(5)).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        } else {
            eprintln!(
                "e2e: {} on port {} did not stop within 5s",
                self.name, self.port
            );
        }
    }
}

async fn serve<H, F, B>(
    name: &str,
    listener: StdTcpListener,
    handler: Arc<H>,
    mut shutdown: oneshot::Receiver<()>,
) where
    H: Fn(hyper::Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Result<hyper::Response<B>, Infallible>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("e2e: {name}: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let handler = Arc::clone(&handler);
                tokio::spawn(async move {
                    let svc = service_fn(move |req| (*handler)(req));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
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
