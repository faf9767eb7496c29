//! A metered upstream: an in-process HTTP upstream (hyper 1, HTTP/1.1 and h2c prior knowledge
//! on one 127.0.0.1:0 port) that is told by *request headers* how to answer, so one upstream
//! serves every response shape a usage-metering test needs, and that counts what reached it:
//! requests, requests being answered right now (`in_flight`), the most ever answered at once,
//! and how each answer ended (sent whole, or aborted).
//!
//! # Directives (request headers)
//!
//! | header | meaning |
//! |---|---|
//! | `x-usage: N` | the units the response reports (absent: none reported) |
//! | `x-usage-in: header\|trailer\|json\|sse\|none` | where (default `header`, see below) |
//! | `x-sse-events: K` | `sse` only: content events before the usage event (default 3) |
//! | `x-delay-ms: D` | wait D ms before sending the response headers |
//! | `x-body-delay-ms: D` | wait D ms between body frames (data chunks and the trailers) |
//! | `x-reset-after-headers: 1` | send the headers and the first body chunk, then abort |
//! | `x-status: S` | response status (default 200) |
//! | `x-request-tag: T` | recorded in arrival order ([`MeteredUpstream::tags`]), echoed back |
//!
//! Where the usage goes (`x-usage-in`):
//! * `header`: response header `x-usage-units: N`, body `ok` (content-length);
//! * `trailer`: body `ok`, then the trailer `x-usage-units: N` (response header
//!   `trailer: x-usage-units`; chunked on HTTP/1.1, see *Trailers through Envoy*);
//! * `json`: `content-type: application/json`, body
//!   `{"id":"x","usage":{"prompt_tokens":P,"completion_tokens":C,"total_tokens":N}}` with
//!   `P = N / 2`, `C = N - P` (content-length, sent in three chunks); without `x-usage` the
//!   body is `{"id":"x"}`;
//! * `sse`: `content-type: text/event-stream`, K chunks
//!   `data: {"choices":[{"delta":{"content":"t"}}]}\n\n`, then (with `x-usage`)
//!   `data: {"choices":[],"usage":{"total_tokens":N}}\n\n`, then `data: [DONE]\n\n`, each
//!   event its own chunk (chunked on HTTP/1.1);
//! * `none`: body `ok`, no usage anywhere.
//!
//! A directive that does not parse is answered `400` with a body that names it, so a typo in
//! a test shows up as a failing status rather than as a silently different shape.
//!
//! # Counting
//!
//! A request is counted ([`MeteredUpstream::requests`]) and enters
//! [`MeteredUpstream::in_flight`] when its head arrives. It leaves `in_flight` exactly once,
//! through a drop guard, on every path: its last body frame was handed to hyper
//! ([`MeteredUpstream::completed`]), or the answer ended early
//! ([`MeteredUpstream::aborted`]): `x-reset-after-headers`, or the client went away. hyper
//! drops the service future and the response body when the connection closes (HTTP/1.1:
//! hyper watches for EOF while the response is pending) or when the stream is reset (h2:
//! `RST_STREAM`), so an Envoy route timeout shows up here as soon as Envoy gives up on the
//! request, not when the delay ends. The outcome counter is bumped before `in_flight` drops,
//! so after `wait_in_flight(0, ..)` the outcome counters are final.
//!
//! # Trailers through Envoy
//!
//! hyper 1 sends HTTP/1.1 trailers only if the request carried `te: trailers` (and the
//! response declares them in `trailer:`, which this upstream does); otherwise it ends the
//! chunked body without them. Envoy's HTTP/1.1 upstream codec does not add `te: trailers` by
//! itself, so with an HTTP/1.1 cluster the trailer reaches Envoy only when the downstream
//! client sent `te: trailers` (Envoy forwards that one `te` value) *and* the cluster has
//! `explicit_http_config: { http_protocol_options: { enable_trailers: true } }` (without it
//! Envoy drops HTTP/1.1 trailers even then). The reliable choice, whatever the client sends,
//! is h2 towards the upstream, where trailers are part of every stream (Envoy 1.40, proven by
//! `metered_trailer_reaches_envoy_and_clients` in `tests/tests/harness.rs`):
//!
//! ```yaml
//!   clusters:
//!   - name: backend
//!     type: STATIC
//!     typed_extension_protocol_options:
//!       envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
//!         "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
//!         explicit_http_config:
//!           http2_protocol_options: {}
//! ```
//!
//! To hand the trailer on to an HTTP/1.1 *downstream* client, the listener's
//! `HttpConnectionManager` also needs `http_protocol_options: { enable_trailers: true }` (an
//! h2 downstream gets trailers without it). [`try_send_streamed`] reads trailers over either.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::StatusCode;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::client::RequestSpec;
use crate::error::{HarnessError, Result};
use crate::process;
use crate::upstream::HttpServer;

/// Request header: the units the response reports.
pub const USAGE: &str = "x-usage";
/// Request header: where the response reports them ([`UsageIn`]).
pub const USAGE_IN: &str = "x-usage-in";
/// Request header: `sse` content events before the usage event.
pub const SSE_EVENTS: &str = "x-sse-events";
/// Request header: milliseconds to wait before the response headers.
pub const DELAY_MS: &str = "x-delay-ms";
/// Request header: milliseconds to wait between body frames.
pub const BODY_DELAY_MS: &str = "x-body-delay-ms";
/// Request header: `1` aborts the response after the headers and the first body chunk.
pub const RESET_AFTER_HEADERS: &str = "x-reset-after-headers";
/// Request header: the response status.
pub const STATUS: &str = "x-status";
/// Request header recorded by [`MeteredUpstream::tags`] and echoed in the response.
pub const REQUEST_TAG: &str = "x-request-tag";
/// Response header (`header`) or trailer (`trailer`) carrying the units.
pub const USAGE_UNITS: &str = "x-usage-units";

/// `sse` content events when `x-sse-events` is absent.
pub const DEFAULT_SSE_EVENTS: usize = 3;
/// One `sse` content event.
pub const SSE_CONTENT_EVENT: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"t\"}}]}\n\n";
/// The last `sse` event.
pub const SSE_DONE_EVENT: &str = "data: [DONE]\n\n";
/// The body of `header`, `trailer` and `none` answers.
pub const OK_BODY: &str = "ok";
/// The pause between the first chunk and the abort of `x-reset-after-headers` when no
/// `x-body-delay-ms` is given: long enough for hyper to flush what came before.
const RESET_PAUSE: Duration = Duration::from_millis(20);

/// Where a response reports its usage (`x-usage-in`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UsageIn {
    #[default]
    Header,
    Trailer,
    Json,
    Sse,
    None,
}

impl UsageIn {
    pub fn as_str(self) -> &'static str {
        match self {
            UsageIn::Header => "header",
            UsageIn::Trailer => "trailer",
            UsageIn::Json => "json",
            UsageIn::Sse => "sse",
            UsageIn::None => "none",
        }
    }

    pub fn parse(s: &str) -> Option<UsageIn> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "header" => UsageIn::Header,
            "trailer" => UsageIn::Trailer,
            "json" => UsageIn::Json,
            "sse" => UsageIn::Sse,
            "none" => UsageIn::None,
            _ => return None,
        })
    }
}

/// The `json` body for `usage` units (`{"id":"x"}` without).
pub fn json_body(usage: Option<u64>) -> String {
    match usage {
        Some(n) => {
            let prompt = n / 2;
            let completion = n - prompt;
            format!(
                "{{\"id\":\"x\",\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{n}}}}}"
            )
        }
        None => "{\"id\":\"x\"}".to_owned(),
    }
}

/// The `sse` events (each one chunk) for `events` content events and `usage` units.
pub fn sse_events(events: usize, usage: Option<u64>) -> Vec<String> {
    let mut out = vec![SSE_CONTENT_EVENT.to_owned(); events];
    if let Some(n) = usage {
        out.push(format!(
            "data: {{\"choices\":[],\"usage\":{{\"total_tokens\":{n}}}}}\n\n"
        ));
    }
    out.push(SSE_DONE_EVENT.to_owned());
    out
}

/// Builder methods for the directives, on the harness' [`RequestSpec`]:
/// `RequestSpec::get("/").usage(7).usage_in(UsageIn::Sse).body_delay_ms(20).tag("a")`.
pub trait MeteredRequest: Sized {
    fn usage(self, units: u64) -> Self;
    fn usage_in(self, place: UsageIn) -> Self;
    fn sse_event_count(self, events: usize) -> Self;
    fn delay_ms(self, ms: u64) -> Self;
    fn body_delay_ms(self, ms: u64) -> Self;
    fn reset_after_headers(self) -> Self;
    fn status(self, status: u16) -> Self;
    fn tag(self, tag: impl Into<String>) -> Self;
}

impl MeteredRequest for RequestSpec {
    fn usage(self, units: u64) -> Self {
        self.header(USAGE, units.to_string())
    }
    fn usage_in(self, place: UsageIn) -> Self {
        self.header(USAGE_IN, place.as_str())
    }
    fn sse_event_count(self, events: usize) -> Self {
        self.header(SSE_EVENTS, events.to_string())
    }
    fn delay_ms(self, ms: u64) -> Self {
        self.header(DELAY_MS, ms.to_string())
    }
    fn body_delay_ms(self, ms: u64) -> Self {
        self.header(BODY_DELAY_MS, ms.to_string())
    }
    fn reset_after_headers(self) -> Self {
        self.header(RESET_AFTER_HEADERS, "1")
    }
    fn status(self, status: u16) -> Self {
        self.header(STATUS, status.to_string())
    }
    fn tag(self, tag: impl Into<String>) -> Self {
        self.header(REQUEST_TAG, tag)
    }
}

#[derive(Default)]
struct State {
    requests: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    completed: AtomicU64,
    aborted: AtomicU64,
    tags: Mutex<Vec<String>>,
}

/// A running metered upstream; stops on `Drop` (answers still in flight count as aborted).
pub struct MeteredUpstream {
    server: HttpServer,
    state: Arc<State>,
}

impl std::fmt::Debug for MeteredUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeteredUpstream")
            .field("port", &self.port())
            .field("requests", &self.requests())
            .field("in_flight", &self.in_flight())
            .field("max_in_flight", &self.max_in_flight())
            .field("completed", &self.completed())
            .field("aborted", &self.aborted())
            .finish()
    }
}

impl MeteredUpstream {
    /// Bind 127.0.0.1:0 and serve on a thread of its own (HTTP/1.1 and h2c prior knowledge).
    pub fn start() -> MeteredUpstream {
        let state = Arc::new(State::default());
        let served = Arc::clone(&state);
        let server = HttpServer::start("metered upstream", move |req| {
            handle(req, Arc::clone(&served))
        });
        MeteredUpstream { server, state }
    }

    pub fn port(&self) -> u16 {
        self.server.port()
    }

    /// Requests whose head arrived so far.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// Requests being answered right now.
    pub fn in_flight(&self) -> u64 {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// The highest [`in_flight`](Self::in_flight) seen since the start or the last
    /// [`reset_max_in_flight`](Self::reset_max_in_flight).
    pub fn max_in_flight(&self) -> u64 {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// Start a new maximum from the current `in_flight`.
    pub fn reset_max_in_flight(&self) {
        self.state
            .max_in_flight
            .store(self.in_flight(), Ordering::SeqCst);
    }

    /// Answers whose last body frame (data or trailers) was handed to hyper.
    pub fn completed(&self) -> u64 {
        self.state.completed.load(Ordering::SeqCst)
    }

    /// Answers that ended early: `x-reset-after-headers`, or the client (Envoy) went away
    /// (connection closed, stream reset) before the answer was sent whole.
    pub fn aborted(&self) -> u64 {
        self.state.aborted.load(Ordering::SeqCst)
    }

    /// The `x-request-tag` of every request that carried one, in arrival order.
    pub fn tags(&self) -> Vec<String> {
        self.state
            .tags
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Wait (bounded) until at least `n` requests arrived; returns the count seen.
    pub fn wait_requests(&self, n: u64, timeout: Duration) -> u64 {
        process::wait_for(
            &format!("{n} requests at the metered upstream"),
            timeout,
            || {
                let seen = self.requests();
                (seen >= n).then_some(seen)
            },
        )
        .unwrap_or_else(|e| panic!("{e} ({self:?})"))
    }

    /// Wait (bounded) until exactly `n` requests are in flight (`0`: everything answered or
    /// aborted; the outcome counters are then final).
    pub fn wait_in_flight(&self, n: u64, timeout: Duration) {
        process::wait_for(
            &format!("{n} requests in flight at the metered upstream"),
            timeout,
            || (self.in_flight() == n).then_some(()),
        )
        .unwrap_or_else(|e| panic!("{e} ({self:?})"))
    }

    /// Wait (bounded) until at least `n` requests are in flight; returns the count seen.
    pub fn wait_in_flight_at_least(&self, n: u64, timeout: Duration) -> u64 {
        process::wait_for(
            &format!("at least {n} requests in flight at the metered upstream"),
            timeout,
            || {
                let now = self.in_flight();
                (now >= n).then_some(now)
            },
        )
        .unwrap_or_else(|e| panic!("{e} ({self:?})"))
    }
}

/// One request's place in `in_flight`: counted on creation, released exactly once on drop,
/// with the outcome counted first.
struct Admission {
    state: Arc<State>,
    completed: bool,
}

impl Admission {
    fn enter(state: &Arc<State>, tag: Option<String>) -> Admission {
        if let Some(tag) = tag {
            state
                .tags
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(tag);
        }
        state.requests.fetch_add(1, Ordering::SeqCst);
        let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        state.max_in_flight.fetch_max(now, Ordering::SeqCst);
        Admission {
            state: Arc::clone(state),
            completed: false,
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let outcome = if self.completed {
            &self.state.completed
        } else {
            &self.state.aborted
        };
        outcome.fetch_add(1, Ordering::SeqCst);
        self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The response body: frames handed out one per poll, with an optional pause between them,
/// and an optional abort after the first data frame. Holds the request's [`Admission`], so
/// however hyper ends the body (sent whole, connection closed, stream reset), it is released.
struct MeteredBody {
    frames: VecDeque<Frame<Bytes>>,
    gap: Duration,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
    abort_after_first_data: bool,
    sent_data: bool,
    exact_len: Option<u64>,
    admission: Option<Admission>,
}

impl MeteredBody {
    fn new(frames: Vec<Frame<Bytes>>, gap: Duration, admission: Admission) -> MeteredBody {
        MeteredBody {
            frames: frames.into(),
            gap,
            pause: None,
            abort_after_first_data: false,
            sent_data: false,
            exact_len: None,
            admission: Some(admission),
        }
    }

    fn finished(&self) -> bool {
        self.frames.is_empty() && !self.abort_after_first_data
    }
}

impl Body for MeteredBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        if let Some(pause) = this.pause.as_mut() {
            if pause.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.pause = None;
        }
        if this.abort_after_first_data && this.sent_data {
            // Release first: the abort is this answer's outcome.
            this.admission = None;
            this.frames.clear();
            return Poll::Ready(Some(Err(io::Error::other(
                "x-reset-after-headers: aborting the response",
            ))));
        }
        match this.frames.pop_front() {
            Some(frame) => {
                this.sent_data |= frame.is_data();
                let pause = if this.abort_after_first_data && this.sent_data {
                    // Let hyper flush the headers and the chunk before the abort.
                    Some(if this.gap.is_zero() {
                        RESET_PAUSE
                    } else {
                        this.gap
                    })
                } else if !this.frames.is_empty() && !this.gap.is_zero() {
                    Some(this.gap)
                } else {
                    None
                };
                this.pause = pause.map(|d| Box::pin(tokio::time::sleep(d)));
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                if let Some(mut admission) = this.admission.take() {
                    admission.completed = true;
                }
                Poll::Ready(None)
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact_len {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

impl Drop for MeteredBody {
    fn drop(&mut self) {
        // hyper may stop polling after the last frame; everything handed out means sent.
        let finished = self.finished();
        if let Some(admission) = self.admission.as_mut() {
            admission.completed = finished;
        }
    }
}

/// The directives of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Plan {
    status: StatusCode,
    usage: Option<u64>,
    usage_in: UsageIn,
    sse_events: usize,
    delay: Duration,
    body_delay: Duration,
    reset_after_headers: bool,
    tag: Option<String>,
}

impl Plan {
    fn from_headers(headers: &HeaderMap) -> std::result::Result<Plan, String> {
        fn text<'a>(
            headers: &'a HeaderMap,
            name: &str,
        ) -> std::result::Result<Option<&'a str>, String> {
            headers
                .get(name)
                .map(|v| {
                    v.to_str()
                        .map(str::trim)
                        .map_err(|_| format!("{name}: not text"))
                })
                .transpose()
        }
        fn number(headers: &HeaderMap, name: &str) -> std::result::Result<Option<u64>, String> {
            text(headers, name)?
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| format!("{name}: {v:?} is not a non-negative integer"))
                })
                .transpose()
        }
        let usage_in = match text(headers, USAGE_IN)? {
            None => UsageIn::Header,
            Some(v) => UsageIn::parse(v).ok_or_else(|| {
                format!("{USAGE_IN}: {v:?} is not one of header, trailer, json, sse, none")
            })?,
        };
        let status = match number(headers, STATUS)? {
            None => StatusCode::OK,
            Some(s) => u16::try_from(s)
                .ok()
                .and_then(|s| StatusCode::from_u16(s).ok())
                .ok_or_else(|| format!("{STATUS}: {s} is not an HTTP status"))?,
        };
        let reset_after_headers = match text(headers, RESET_AFTER_HEADERS)? {
            None | Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            Some(v) => return Err(format!("{RESET_AFTER_HEADERS}: {v:?} is not 1 or 0")),
        };
        let sse_events = number(headers, SSE_EVENTS)?
            .map(|k| usize::try_from(k).unwrap_or(usize::MAX).min(10_000))
            .unwrap_or(DEFAULT_SSE_EVENTS);
        Ok(Plan {
            status,
            usage: number(headers, USAGE)?,
            usage_in,
            sse_events,
            delay: Duration::from_millis(number(headers, DELAY_MS)?.unwrap_or(0)),
            body_delay: Duration::from_millis(number(headers, BODY_DELAY_MS)?.unwrap_or(0)),
            reset_after_headers,
            tag: text(headers, REQUEST_TAG)?.map(str::to_owned),
        })
    }

    /// What to send once the delay is over.
    fn answer(&self) -> Answer {
        let data = |s: String| Frame::data(Bytes::from(s));
        let mut headers = Vec::new();
        if let Some(tag) = &self.tag {
            headers.push((REQUEST_TAG, tag.clone()));
        }
        let (frames, exact) = match self.usage_in {
            UsageIn::Header | UsageIn::None => {
                headers.push(("content-type", "text/plain".to_owned()));
                if let (UsageIn::Header, Some(n)) = (self.usage_in, self.usage) {
                    headers.push((USAGE_UNITS, n.to_string()));
                }
                (vec![data(OK_BODY.to_owned())], true)
            }
            UsageIn::Trailer => {
                headers.push(("content-type", "text/plain".to_owned()));
                let mut frames = vec![data(OK_BODY.to_owned())];
                if let Some(n) = self.usage {
                    // hyper's HTTP/1.1 encoder sends only the trailers declared here.
                    headers.push(("trailer", USAGE_UNITS.to_owned()));
                    let mut trailers = HeaderMap::new();
                    trailers.insert(HeaderName::from_static(USAGE_UNITS), HeaderValue::from(n));
                    frames.push(Frame::trailers(trailers));
                }
                (frames, false)
            }
            UsageIn::Json => {
                headers.push(("content-type", "application/json".to_owned()));
                let body = json_body(self.usage);
                (thirds(&body).into_iter().map(data).collect(), true)
            }
            UsageIn::Sse => {
                headers.push(("content-type", "text/event-stream".to_owned()));
                headers.push(("cache-control", "no-cache".to_owned()));
                let events = sse_events(self.sse_events, self.usage);
                (events.into_iter().map(data).collect(), false)
            }
        };
        Answer {
            headers,
            frames,
            // An aborted answer must not look complete: no length up front.
            announce_length: exact && !self.reset_after_headers,
        }
    }
}

/// Response headers, body frames, and whether the body length is announced up front
/// (`content-length` on HTTP/1.1) rather than chunked.
struct Answer {
    headers: Vec<(&'static str, String)>,
    frames: Vec<Frame<Bytes>>,
    announce_length: bool,
}

/// `s` in three chunks (fewer if it is shorter than three bytes); ASCII only.
fn thirds(s: &str) -> Vec<String> {
    let step = s.len().div_ceil(3).max(1);
    s.as_bytes()
        .chunks(step)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect()
}

async fn handle(
    req: hyper::Request<Incoming>,
    state: Arc<State>,
) -> std::result::Result<hyper::Response<MeteredBody>, Infallible> {
    let tag = req
        .headers()
        .get(REQUEST_TAG)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).trim().to_owned());
    // From here on, every way out of this future (answered, dropped by hyper because the
    // client went away, the upstream shutting down) releases the admission.
    let admission = Admission::enter(&state, tag);
    let plan = Plan::from_headers(req.headers());
    // Read the request body whole, so an HTTP/1.1 connection is idle-reading and hyper
    // notices the client closing it while the answer is delayed.
    let _ = req.into_body().collect().await;
    let plan = match plan {
        Ok(plan) => plan,
        Err(msg) => {
            let body = MeteredBody::new(
                vec![Frame::data(Bytes::from(format!(
                    "metered upstream: {msg}\n"
                )))],
                Duration::ZERO,
                admission,
            );
            let mut resp = hyper::Response::new(body);
            *resp.status_mut() = StatusCode::BAD_REQUEST;
            return Ok(resp);
        }
    };
    if !plan.delay.is_zero() {
        tokio::time::sleep(plan.delay).await;
    }
    let Answer {
        headers,
        frames,
        announce_length,
    } = plan.answer();
    let len: u64 = frames
        .iter()
        .filter_map(|f| f.data_ref())
        .map(|d| d.len() as u64)
        .sum();
    let mut body = MeteredBody::new(frames, plan.body_delay, admission);
    body.abort_after_first_data = plan.reset_after_headers;
    body.exact_len = announce_length.then_some(len);
    let mut resp = hyper::Response::new(body);
    *resp.status_mut() = plan.status;
    for (name, value) in headers {
        if let Ok(value) = HeaderValue::from_str(&value) {
            resp.headers_mut()
                .append(HeaderName::from_static(name), value);
        }
    }
    Ok(resp)
}

/// Which protocol [`try_send_streamed`] speaks to the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    Http1,
    /// HTTP/2 over cleartext with prior knowledge (Envoy's `AUTO` codec accepts it).
    H2c,
}

/// A body chunk as the client received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Since the response headers arrived.
    pub at: Duration,
    pub data: String,
}

/// A response read frame by frame: the body, its chunks with arrival times, and trailers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamedResponse {
    pub status: u16,
    /// Lowercased names.
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub chunks: Vec<Chunk>,
    /// Lowercased names; empty if none arrived.
    pub trailers: Vec<(String, String)>,
}

impl StreamedResponse {
    /// First value of a header (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        find(&self.headers, name)
    }

    /// First value of a trailer (name case-insensitive).
    pub fn trailer(&self, name: &str) -> Option<&str> {
        find(&self.trailers, name)
    }
}

fn find<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    let name = name.to_ascii_lowercase();
    pairs
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.as_str())
}

fn pairs(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// Send one request to 127.0.0.1:`port` on a fresh connection over `wire` and read the
/// response frame by frame, trailers included. Transport errors (a reset mid-body included)
/// and `timeout` are `Err`. For HTTP/1.1 trailers, pass `te: trailers` in `spec`.
pub async fn try_send_streamed(
    port: u16,
    spec: RequestSpec,
    wire: Wire,
    timeout: Duration,
) -> Result<StreamedResponse> {
    let what = format!("{} {} ({wire:?}, port {port})", spec.method, spec.path);
    match tokio::time::timeout(timeout, streamed(port, &spec, wire)).await {
        Ok(r) => r.map_err(|e| HarnessError::new(format!("{what}: {e}"))),
        Err(_) => Err(HarnessError::new(format!(
            "{what}: no complete response within {timeout:?}"
        ))),
    }
}

async fn streamed(port: u16, spec: &RequestSpec, wire: Wire) -> Result<StreamedResponse> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| HarnessError::new(format!("connect to 127.0.0.1:{port}: {e}")))?;
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(stream);
    let mut req = hyper::Request::builder().method(spec.method.as_str());
    req = match wire {
        Wire::Http1 => req
            .uri(spec.path.as_str())
            .header(hyper::header::HOST, spec.host.as_str()),
        Wire::H2c => req.uri(format!("http://{}{}", spec.host, spec.path)),
    };
    for (k, v) in &spec.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let req = req
        .body(Full::new(Bytes::from(spec.body.clone())))
        .map_err(|e| HarnessError::new(format!("bad request {spec:?}: {e}")))?;
    let resp = match wire {
        Wire::Http1 => {
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| HarnessError::new(format!("HTTP/1.1 handshake: {e}")))?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            sender.send_request(req).await
        }
        Wire::H2c => {
            let (mut sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                    .await
                    .map_err(|e| HarnessError::new(format!("h2 handshake: {e}")))?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            sender.send_request(req).await
        }
    }
    .map_err(|e| HarnessError::new(format!("request failed: {e}")))?;
    let headers_at = Instant::now();
    let (parts, mut body) = resp.into_parts();
    let mut out = StreamedResponse {
        status: parts.status.as_u16(),
        headers: pairs(&parts.headers),
        body: String::new(),
        chunks: Vec::new(),
        trailers: Vec::new(),
    };
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            HarnessError::new(format!(
                "reading response body (status {}, {} bytes so far): {e}",
                out.status,
                out.body.len()
            ))
        })?;
        match frame.into_data() {
            Ok(data) => {
                let text = String::from_utf8_lossy(&data).into_owned();
                out.body.push_str(&text);
                out.chunks.push(Chunk {
                    at: headers_at.elapsed(),
                    data: text,
                });
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    out.trailers.extend(pairs(&trailers));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(headers: &[(&str, &str)]) -> std::result::Result<Plan, String> {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        Plan::from_headers(&map)
    }

    #[test]
    fn directives_parse_with_defaults() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.status, StatusCode::OK);
        assert_eq!(p.usage, None);
        assert_eq!(p.usage_in, UsageIn::Header);
        assert_eq!(p.sse_events, DEFAULT_SSE_EVENTS);
        assert_eq!(p.delay, Duration::ZERO);
        assert!(!p.reset_after_headers);

        let p = plan(&[
            ("x-usage", "12"),
            ("x-usage-in", "SSE"),
            ("x-sse-events", "5"),
            ("x-delay-ms", "30"),
            ("x-body-delay-ms", "7"),
            ("x-reset-after-headers", "1"),
            ("x-status", "429"),
            ("x-request-tag", "t-1"),
        ])
        .unwrap();
        assert_eq!(p.usage, Some(12));
        assert_eq!(p.usage_in, UsageIn::Sse);
        assert_eq!(p.sse_events, 5);
        assert_eq!(p.delay, Duration::from_millis(30));
        assert_eq!(p.body_delay, Duration::from_millis(7));
        assert!(p.reset_after_headers);
        assert_eq!(p.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(p.tag.as_deref(), Some("t-1"));
    }

    #[test]
    fn bad_directives_are_named() {
        assert!(plan(&[("x-usage", "-1")]).unwrap_err().contains("x-usage"));
        assert!(plan(&[("x-usage-in", "body")])
            .unwrap_err()
            .contains("x-usage-in"));
        assert!(plan(&[("x-status", "99")])
            .unwrap_err()
            .contains("x-status"));
        assert!(plan(&[("x-reset-after-headers", "yes")])
            .unwrap_err()
            .contains("x-reset-after-headers"));
    }

    #[test]
    fn usage_bodies_add_up() {
        for n in [0, 1, 7, 1000] {
            let v: serde_json::Value = serde_json::from_str(&json_body(Some(n))).unwrap();
            let u = &v["usage"];
            assert_eq!(u["total_tokens"], n);
            assert_eq!(
                u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap(),
                n
            );
        }
        assert_eq!(json_body(None), "{\"id\":\"x\"}");
        let events = sse_events(2, Some(9));
        assert_eq!(events.len(), 4);
        assert_eq!(
            events[2],
            "data: {\"choices\":[],\"usage\":{\"total_tokens\":9}}\n\n"
        );
        assert_eq!(events[3], SSE_DONE_EVENT);
        assert_eq!(sse_events(0, None), vec![SSE_DONE_EVENT.to_owned()]);
        assert_eq!(thirds(&json_body(Some(5))).concat(), json_body(Some(5)));
        assert_eq!(thirds("ab"), vec!["a", "b"]);
    }
}
