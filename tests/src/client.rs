//! Async HTTP/1.1 clients for driving traffic through Envoy: one request, or a burst of
//! many requests fired at once over several keep-alive connections, optionally timed.
//!
//! Uses hyper 1's low-level connection API (one TCP connection per handshake) so a test
//! controls exactly how many connections exist, which is what a rate limiter with one VM
//! per Envoy worker cares about. A request is never retried: a retry could be counted twice
//! by the limiter. Everything is bounded by a timeout.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::sync::Barrier;

use crate::error::{HarnessError, Result};

/// Default timeout for [`send`].
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// Default total timeout for a burst.
pub const BURST_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A request to send. `RequestSpec::get("/x").host("api.example.com").header("k", "v")`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSpec {
    pub method: String,
    /// Origin-form target: path and query.
    pub path: String,
    /// The `Host` header (`:authority`), which Envoy routes on.
    pub host: String,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Default for RequestSpec {
    fn default() -> Self {
        Self {
            method: "GET".into(),
            path: "/".into(),
            host: "localhost".into(),
            headers: Vec::new(),
            body: String::new(),
        }
    }
}

impl RequestSpec {
    pub fn new(method: impl Into<String>, path: impl Into<String>) -> Self {
        Self {
            method: method.into(),
            path: path.into(),
            ..Self::default()
        }
    }

    pub fn get(path: impl Into<String>) -> Self {
        Self::new("GET", path)
    }

    pub fn post(path: impl Into<String>, body: impl Into<String>) -> Self {
        Self::new("POST", path).body(body)
    }

    pub fn host(mut self, host: impl Into<String>) -> Self {
        self.host = host.into();
        self
    }

    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    pub fn body(mut self, body: impl Into<String>) -> Self {
        self.body = body.into();
        self
    }
}

/// A response: status, headers (lowercased names; repeated headers appear repeatedly), body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    /// First value of a header (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_all(name).into_iter().next()
    }

    /// All values of a header, in order.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// One request of a burst with where and how long it took.
#[derive(Debug, Clone)]
pub struct Timed<T = Response> {
    /// The index passed to `make_request`.
    pub index: usize,
    /// Which of the burst's connections carried it (0-based).
    pub connection: usize,
    /// From just before sending the request to the end of the response body.
    pub latency: Duration,
    pub response: T,
}

type TimedResult = Timed<Result<Response>>;

/// Send one request to 127.0.0.1:`port` on a fresh connection; panics on transport errors
/// or after [`SEND_TIMEOUT`].
pub async fn send(port: u16, spec: RequestSpec) -> Response {
    try_send(port, spec).await.unwrap_or_else(|e| panic!("{e}"))
}

/// Send one request; transport errors (reset, refused, timeout) are `Err`.
pub async fn try_send(port: u16, spec: RequestSpec) -> Result<Response> {
    try_send_timeout(port, spec, SEND_TIMEOUT).await
}

/// [`try_send`] with an explicit timeout.
pub async fn try_send_timeout(port: u16, spec: RequestSpec, timeout: Duration) -> Result<Response> {
    let what = format!("{} {} (port {port})", spec.method, spec.path);
    let fut = async {
        let mut sender = connect(port).await?;
        send_on(&mut sender, &spec).await
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r.map_err(|e| HarnessError::new(format!("{what}: {e}"))),
        Err(_) => Err(HarnessError::new(format!(
            "{what}: no response within {timeout:?}"
        ))),
    }
}

/// Fire `n_requests` requests (`make_request(i)` for i in 0..n) at once over `n_connections`
/// keep-alive connections: all connections are opened first, then every connection sends
/// its share (i ≡ c mod n_connections) back to back. Results are ordered by index.
/// Panics if any request fails at the transport level or after [`BURST_TIMEOUT`].
pub async fn burst(
    port: u16,
    n_requests: usize,
    n_connections: usize,
    make_request: impl FnMut(usize) -> RequestSpec,
) -> Vec<Response> {
    burst_timed(port, n_requests, n_connections, make_request)
        .await
        .into_iter()
        .map(|t| t.response)
        .collect()
}

/// [`burst`] where transport errors are returned per request instead of panicking.
pub async fn try_burst(
    port: u16,
    n_requests: usize,
    n_connections: usize,
    make_request: impl FnMut(usize) -> RequestSpec,
) -> Vec<Result<Response>> {
    burst_detailed(port, n_requests, n_connections, BURST_TIMEOUT, make_request)
        .await
        .into_iter()
        .map(|t| t.response)
        .collect()
}

/// [`burst`] with per-request latency and connection. Panics on transport errors.
pub async fn burst_timed(
    port: u16,
    n_requests: usize,
    n_connections: usize,
    make_request: impl FnMut(usize) -> RequestSpec,
) -> Vec<Timed> {
    burst_detailed(port, n_requests, n_connections, BURST_TIMEOUT, make_request)
        .await
        .into_iter()
        .map(|t| Timed {
            index: t.index,
            connection: t.connection,
            latency: t.latency,
            response: t
                .response
                .unwrap_or_else(|e| panic!("burst request {}: {e}", t.index)),
        })
        .collect()
}

/// The general burst: explicit total `timeout`, every request's result, latency and
/// connection. Requests not finished when the timeout hits are `Err`.
pub async fn burst_detailed(
    port: u16,
    n_requests: usize,
    n_connections: usize,
    timeout: Duration,
    make_request: impl FnMut(usize) -> RequestSpec,
) -> Vec<Timed<Result<Response>>> {
    let specs: Arc<Vec<RequestSpec>> = Arc::new((0..n_requests).map(make_request).collect());
    let n_connections = n_connections.clamp(1, n_requests.max(1));
    let results: Arc<Mutex<Vec<Option<TimedResult>>>> =
        Arc::new(Mutex::new(vec![None; n_requests]));
    let barrier = Arc::new(Barrier::new(n_connections));
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..n_connections {
        let specs = Arc::clone(&specs);
        let results = Arc::clone(&results);
        let barrier = Arc::clone(&barrier);
        tasks.spawn(async move {
            let mut sender = connect(port).await;
            // Everyone waits here, connected or not, so the requests start together.
            barrier.wait().await;
            for (i, spec) in specs.iter().enumerate().skip(c).step_by(n_connections) {
                let start = Instant::now();
                let result = async {
                    let reusable = matches!(&sender, Ok(s) if !s.is_closed());
                    if !reusable {
                        sender = connect(port).await;
                    }
                    match &mut sender {
                        Ok(s) => send_on(s, spec).await,
                        Err(e) => Err(e.clone()),
                    }
                }
                .await;
                let timed = Timed {
                    index: i,
                    connection: c,
                    latency: start.elapsed(),
                    response: result,
                };
                if let Some(slot) = results.lock().unwrap_or_else(|p| p.into_inner()).get_mut(i) {
                    *slot = Some(timed);
                }
            }
        });
    }
    let all_done = async { while tasks.join_next().await.is_some() {} };
    let timed_out = tokio::time::timeout(timeout, all_done).await.is_err();
    if timed_out {
        tasks.abort_all();
    }
    let mut results = results.lock().unwrap_or_else(|p| p.into_inner());
    results
        .iter_mut()
        .enumerate()
        .map(|(i, slot)| {
            slot.take().unwrap_or_else(|| Timed {
                index: i,
                connection: i % n_connections,
                latency: timeout,
                response: Err(HarnessError::new(format!(
                    "request {i} did not complete: burst timed out after {timeout:?}"
                ))),
            })
        })
        .collect()
}

async fn connect(port: u16) -> Result<SendRequest<Full<Bytes>>> {
    let stream = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await
    .map_err(|_| HarnessError::new(format!("connect to 127.0.0.1:{port} timed out")))?
    .map_err(|e| HarnessError::new(format!("connect to 127.0.0.1:{port}: {e}")))?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| HarnessError::new(format!("HTTP/1.1 handshake: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

async fn send_on(sender: &mut SendRequest<Full<Bytes>>, spec: &RequestSpec) -> Result<Response> {
    sender
        .ready()
        .await
        .map_err(|e| HarnessError::new(format!("connection not usable: {e}")))?;
    let mut req = hyper::Request::builder()
        .method(spec.method.as_str())
        .uri(spec.path.as_str())
        .header(hyper::header::HOST, spec.host.as_str());
    for (k, v) in &spec.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = req
        .body(Full::new(Bytes::from(spec.body.clone())))
        .map_err(|e| HarnessError::new(format!("bad request {spec:?}: {e}")))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| HarnessError::new(format!("request failed: {e}")))?;
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| HarnessError::new(format!("reading response body: {e}")))?
        .to_bytes();
    Ok(Response {
        status: parts.status.as_u16(),
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
    })
}
