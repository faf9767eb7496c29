//! One request's life in [`Stream`] against a fake host: a real engine compiled from a policy
//! document over an in-memory shared table, real metrics, a real worker (its callouts and
//! resumes recorded), a settable clock; the request's headers, bodies, local replies and
//! response recorded in a fake [`StreamHost`]. Every policy of a test has a name of its own,
//! so the per-thread metric counters it reads are its own too.

use super::*;
use crate::engine::SHARED_PREFIX;
use crate::metrics::sink;
use crate::shared::MemorySharedData;
use crate::table::SlotTable;
use crate::worker::{Ctx, TICK_MS};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use tollgate_core::policy::Policies;
use tollgate_core::protocol::{
    LeaseBatch, LeaseBatchResponse, LeaseGranted, LeaseResult, LEASES_PATH,
};

/// Request headers the worker sets on a request it resumes.
type SetHeaders = Vec<(String, String)>;

/// What the worker did through its host: callouts sent, requests resumed or answered, the tick.
#[derive(Default)]
struct RootLog {
    next_token: Cell<u32>,
    /// Callouts in flight: token, path, body.
    sent: RefCell<Vec<(u32, String, Vec<u8>)>>,
    /// Requests resumed, with the request headers set on them first.
    resumed: RefCell<Vec<(u32, SetHeaders)>>,
    /// Requests answered: id and status.
    replied: RefCell<Vec<(u32, u32)>>,
    tick_ms: Cell<u64>,
}

/// The worker's host (the root context in the wasm build), shared with the test.
#[derive(Clone, Default)]
struct Root(Rc<RootLog>);

impl Host for Root {
    fn dispatch(&self, path: &str, body: &[u8], _timeout_ms: u64) -> Result<u32, String> {
        let token = self.0.next_token.get() + 1;
        self.0.next_token.set(token);
        self.0
            .sent
            .borrow_mut()
            .push((token, path.to_string(), body.to_vec()));
        Ok(token)
    }
    fn resume(&self, context_id: u32, request_headers: &[(String, String)]) -> bool {
        self.0
            .resumed
            .borrow_mut()
            .push((context_id, request_headers.to_vec()));
        true
    }
    fn reply(&self, context_id: u32, reply: &LocalReply) -> bool {
        self.0.replied.borrow_mut().push((context_id, reply.status));
        true
    }
    fn set_tick(&self, period_ms: u64) {
        self.0.tick_ms.set(period_ms);
    }
}

/// The per-instance side: engine, table, metrics, the worker, wakes and the clock.
struct Rig {
    engine: Engine,
    store: MemorySharedData,
    metrics: Metrics,
    worker: RefCell<Worker>,
    root: Root,
    /// Whether a wake reaches the root (`false`: nobody can send the callouts).
    can_wake: Cell<bool>,
    wakes: Cell<u32>,
    now: Cell<u64>,
}

impl Instance for Rig {
    type Store = MemorySharedData;
    type WorkerHost = Root;

    fn engine(&self) -> &Engine {
        &self.engine
    }
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
    fn store(&self) -> &MemorySharedData {
        &self.store
    }
    fn with_worker<R>(&self, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
        // As the wasm root: busy while it runs an event of its own.
        self.worker
            .try_borrow_mut()
            .ok()
            .map(|mut worker| f(&mut worker))
    }
    fn wake(&self) -> bool {
        self.wakes.set(self.wakes.get() + 1);
        self.can_wake.get()
    }
    fn worker_host(&self) -> Root {
        self.root.clone()
    }
    fn now_ms(&self) -> u64 {
        self.now.get()
    }
}

impl Rig {
    fn new(doc: &str) -> Self {
        let policies = match Policies::from_json(doc.as_bytes()) {
            Ok(policies) => policies,
            Err(error) => panic!("{error:?} in {doc}"),
        };
        let store = MemorySharedData::default();
        let table = SlotTable::open(&store, SHARED_PREFIX, 64, 7).unwrap();
        let metrics = Metrics::define(&policies);
        Rig {
            engine: Engine::new(policies, table),
            store,
            metrics,
            worker: RefCell::new(Worker::new(0x5ca1e, 1)),
            root: Root::default(),
            can_wake: Cell::new(true),
            wakes: Cell::new(0),
            now: Cell::new(1_000),
        }
    }

    /// Runs a root-context event on the worker at the current time.
    fn root_event(&self, event: impl FnOnce(&mut Worker, &Ctx<'_, MemorySharedData, Root>)) {
        let ctx = Ctx {
            engine: &self.engine,
            store: &self.store,
            metrics: &self.metrics,
            host: &self.root,
            now_ms: self.now.get(),
        };
        event(&mut self.worker.borrow_mut(), &ctx);
    }

    /// The root woke up: it sends what the requests queued.
    fn flush(&self) {
        self.root_event(|worker, ctx| worker.flush(ctx));
    }

    fn tick(&self) {
        self.root_event(|worker, ctx| worker.tick(ctx));
    }

    /// The limiter answers every lease callout in flight: `granted` tokens per key (0: over
    /// the limit, retry after `retry_after_ms`).
    fn answer_leases(&self, granted: u64, retry_after_ms: u64) {
        let sent = std::mem::take(&mut *self.root.0.sent.borrow_mut());
        for (token, path, body) in sent {
            assert_eq!(path, LEASES_PATH);
            let batch: LeaseBatch = serde_json::from_slice(&body).unwrap();
            let leases = batch
                .leases
                .iter()
                .map(|lease| {
                    LeaseResult::Granted(LeaseGranted {
                        id: lease.id.clone(),
                        granted,
                        remaining: 0.0,
                        retry_after_ms,
                        expires_ms: 60_000,
                        share_per_s: 0.0,
                        period_ms: 0,
                    })
                })
                .collect();
            let answer = serde_json::to_vec(&LeaseBatchResponse {
                leases,
                policy_version: self.engine.policies.version.clone(),
            })
            .unwrap();
            self.root_event(|worker, ctx| worker.complete(token, Some(200), &answer, ctx));
        }
    }

    /// The lease callouts in flight, as sent.
    fn lease_batches(&self) -> Vec<LeaseBatch> {
        self.root
            .0
            .sent
            .borrow()
            .iter()
            .map(|(_, _, body)| serde_json::from_slice(body).unwrap())
            .collect()
    }

    fn holds(&self, id: u32) -> bool {
        self.worker.borrow().holds(id)
    }
}

/// One request as the host shows it to the filter, and what the filter did to it.
#[derive(Default)]
struct Request {
    headers: RefCell<Vec<(String, Vec<u8>)>>,
    body: Vec<u8>,
    /// Local replies the host accepts (`false`: it refuses them).
    refuse_replies: bool,
    replies: RefCell<Vec<LocalReply>>,
    /// Request headers set (`None`: removed), in order.
    set_headers: RefCell<Vec<(String, Option<String>)>>,
    response_headers: Vec<(String, Vec<u8>)>,
    /// The response body chunk of the current callback.
    response_chunk: RefCell<Vec<u8>>,
    trailers: Vec<(String, Vec<u8>)>,
    /// Response headers the filter added.
    added: RefCell<Vec<(String, String)>>,
}

fn pairs(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect()
}

fn find(pairs: &[(String, Vec<u8>)], name: &str) -> Option<Vec<u8>> {
    pairs
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.clone())
}

impl Request {
    /// `POST /v1/chat` of `tenant` (`x-tenant-id`), with more request headers.
    fn new(tenant: &str, more: &[(&str, &str)]) -> Self {
        let mut headers = pairs(&[
            (":method", "POST"),
            (":path", "/v1/chat"),
            (":authority", "api.example.com"),
            ("x-tenant-id", tenant),
        ]);
        headers.extend(pairs(more));
        Request {
            headers: RefCell::new(headers),
            ..Request::default()
        }
    }

    fn with_body(mut self, body: &str) -> Self {
        self.body = body.as_bytes().to_vec();
        self
    }

    fn with_response(mut self, headers: &[(&str, &str)]) -> Self {
        self.response_headers = pairs(headers);
        self
    }

    fn with_trailers(mut self, trailers: &[(&str, &str)]) -> Self {
        self.trailers = pairs(trailers);
        self
    }

    fn statuses(&self) -> Vec<u32> {
        self.replies.borrow().iter().map(|r| r.status).collect()
    }

    fn added(&self, name: &str) -> Option<String> {
        self.added
            .borrow()
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }

    /// The response body passes one chunk.
    fn response_body(&self, stream: &mut Stream, rig: &Rig, chunk: &str, end_of_stream: bool) {
        *self.response_chunk.borrow_mut() = chunk.as_bytes().to_vec();
        stream.on_response_body(rig, self, chunk.len(), end_of_stream);
    }
}

impl RequestSource for Request {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        find(&self.headers.borrow(), name)
    }
    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

impl StreamHost for Request {
    fn send_reply(&self, reply: &LocalReply) -> bool {
        if self.refuse_replies {
            return false;
        }
        self.replies.borrow_mut().push(reply.clone());
        true
    }
    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        self.body.get(..size).map(<[u8]>::to_vec)
    }
    fn add_response_header(&self, name: &str, value: &str) {
        self.added
            .borrow_mut()
            .push((name.to_string(), value.to_string()));
    }
    fn set_request_header(&self, name: &str, value: Option<&str>) {
        self.set_headers
            .borrow_mut()
            .push((name.to_string(), value.map(str::to_string)));
        let mut headers = self.headers.borrow_mut();
        headers.retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        if let Some(value) = value {
            headers.push((name.to_string(), value.as_bytes().to_vec()));
        }
    }
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        find(&self.response_headers, name)
    }
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        self.response_chunk.borrow().get(..size).map(<[u8]>::to_vec)
    }
    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        find(&self.trailers, name)
    }
}

/// A policy document of one policy keyed on `x-tenant-id`: `name`, `rate` per `per`, `burst`,
/// then `extra` fields; `tail` after the policy list (a limiter, response settings).
fn doc(name: &str, rate: &str, burst: u64, extra: &str, tail: &str) -> String {
    format!(
        r#"{{"policies":[{{"name":"{name}","key":[{{"header":"x-tenant-id"}}],"rate":{rate},"burst":{burst}{extra}}}]{tail}}}"#
    )
}

const PER_HOUR: &str = r#"{"units":1,"per":"1h"}"#;
const LIMITER: &str = r#","limiter":{"cluster":"limiter","timeout":"25ms"}"#;
const GLOBAL: &str = r#","scope":"global","on_unavailable":{"mode":"closed"}"#;

/// Reserves `x-estimate` (default 100, at most 500) and settles `from`; `max_in_flight: 1`.
fn reserving(from: &str, on_missing: &str) -> String {
    format!(
        r#","reserve":{{"from":{{"header":"x-estimate"}},"default":100,"max":500}},"settle":{{"from":{from},"on_missing":"{on_missing}"}},"max_in_flight":1"#
    )
}

fn metric(what: &str, policy: &str) -> u64 {
    sink::value(&format!("tollgate_{what}.policy.{policy}"))
}

#[test]
fn an_allowed_request_goes_on_and_its_response_gets_the_ratelimit_headers() {
    let rig = Rig::new(&doc(
        "allow-headers",
        PER_HOUR,
        5,
        "",
        r#","response":{"ratelimit_headers_on_allow":true}"#,
    ));
    let request = Request::new("acme", &[]);
    let mut stream = Stream::new(1);
    assert_eq!(
        stream.on_request_headers(&rig, &request, true),
        Flow::Continue
    );
    assert!(request.replies.borrow().is_empty());
    assert!(!stream.was_held());
    assert_eq!(metric("allowed", "allow-headers"), 1);
    // Nothing is added to the request; the headers wait for the response.
    assert!(request.added.borrow().is_empty());
    stream.on_response_headers(&rig, &request, false);
    let ratelimit = request.added("ratelimit").unwrap_or_default();
    assert!(ratelimit.contains("r=4"), "{ratelimit}");
    assert!(request.added("ratelimit-policy").is_some());
    // Added once, whatever the host calls again.
    let count = request.added.borrow().len();
    stream.on_response_headers(&rig, &request, false);
    assert_eq!(request.added.borrow().len(), count);
    stream.finish(&rig);
    assert_eq!(rig.wakes.get(), 0, "a local policy never wakes the root");
}

#[test]
fn a_request_no_policy_matches_goes_on_untouched() {
    let rig = Rig::new(&doc(
        "other-route",
        PER_HOUR,
        1,
        r#","match":{"routes":["GET /elsewhere"]}"#,
        "",
    ));
    // Burst 1: the second request would be refused if the policy were decided.
    for id in 1..=2 {
        let request = Request::new("acme", &[]);
        let mut stream = Stream::new(id);
        assert_eq!(
            stream.on_request_headers(&rig, &request, true),
            Flow::Continue
        );
        assert!(request.replies.borrow().is_empty());
        stream.finish(&rig);
    }
    assert_eq!(metric("allowed", "other-route"), 0);
    assert_eq!(metric("denied", "other-route"), 0);
}

#[test]
fn a_denied_request_gets_a_429_with_retry_after_and_stays_held() {
    let rig = Rig::new(&doc("deny", r#"{"units":1,"per":"1m"}"#, 1, "", ""));
    let first = Request::new("acme", &[]);
    assert_eq!(
        Stream::new(1).on_request_headers(&rig, &first, true),
        Flow::Continue
    );
    let second = Request::new("acme", &[]);
    let mut stream = Stream::new(2);
    assert_eq!(stream.on_request_headers(&rig, &second, false), Flow::Pause);
    assert_eq!(second.statuses(), vec![429]);
    let reply = second.replies.borrow()[0].clone();
    assert!(
        reply.headers.contains(&("retry-after".into(), "60".into())),
        "{:?}",
        reply.headers
    );
    assert!(stream.was_held());
    assert_eq!(metric("denied", "deny"), 1);
    // Answered: its body never goes upstream.
    assert_eq!(
        stream.on_request_body(&rig, &second, 10, false),
        Flow::Pause
    );
    assert_eq!(stream.on_request_trailers(&rig, &second), Flow::Pause);
    // The local reply's own response carries nothing of the filter's; nothing to settle.
    stream.on_response_headers(&rig, &second, true);
    assert!(second.added.borrow().is_empty());
    stream.finish(&rig);
    assert!(!rig.holds(2));
    // Another tenant has its own bucket.
    assert_eq!(
        Stream::new(3).on_request_headers(&rig, &Request::new("other", &[]), true),
        Flow::Continue
    );
}

#[test]
fn a_local_reply_the_host_refuses_lets_the_request_go_on() {
    let rig = Rig::new(&doc("refused-reply", PER_HOUR, 1, "", ""));
    Stream::new(1).on_request_headers(&rig, &Request::new("acme", &[]), true);
    assert_eq!(metric("allowed", "refused-reply"), 1);
    let request = Request {
        refuse_replies: true,
        ..Request::new("acme", &[])
    };
    let mut stream = Stream::new(2);
    assert_eq!(
        stream.on_request_headers(&rig, &request, false),
        Flow::Continue
    );
    assert_eq!(metric("denied", "refused-reply"), 1);
    assert!(!stream.was_held());
    assert_eq!(
        stream.on_request_body(&rig, &request, 4, true),
        Flow::Continue
    );
}

#[test]
fn a_request_waits_for_its_lease_and_the_worker_resumes_it() {
    let rig = Rig::new(&doc(
        "lease",
        PER_HOUR,
        100,
        &format!(r#"{GLOBAL},"ratelimit_headers_on_allow":true"#),
        LIMITER,
    ));
    let request = Request::new("acme", &[]);
    let mut stream = Stream::new(7);
    assert_eq!(
        stream.on_request_headers(&rig, &request, false),
        Flow::Pause
    );
    assert!(stream.was_held());
    assert!(rig.holds(7));
    assert_eq!(rig.wakes.get(), 1, "the root is woken to send the callout");
    assert!(rig.root.0.sent.borrow().is_empty(), "sent by the root only");
    // Counted when it is decided, not while it waits.
    assert_eq!(metric("allowed", "lease"), 0);
    // Its body is held meanwhile.
    assert_eq!(
        stream.on_request_body(&rig, &request, 3, false),
        Flow::Pause
    );
    rig.flush();
    let batches = rig.lease_batches();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].leases[0].policy, "lease");
    assert_eq!(batches[0].leases[0].key, "acme");
    rig.answer_leases(5, 0);
    assert_eq!(rig.root.0.resumed.borrow().len(), 1);
    assert_eq!(rig.root.0.resumed.borrow()[0].0, 7);
    assert!(rig.root.0.replied.borrow().is_empty());
    assert!(!rig.holds(7));
    assert_eq!(metric("allowed", "lease"), 1);
    // Resumed: the rest of the body goes on.
    assert_eq!(
        stream.on_request_body(&rig, &request, 3, true),
        Flow::Continue
    );
    // The worker's decision carries the response headers to the stream.
    stream.on_response_headers(&rig, &request, true);
    assert!(request.added("ratelimit").is_some(), "{:?}", request.added);
    stream.finish(&rig);
    assert!(!rig.holds(7));
}

#[test]
fn a_request_the_limiter_refuses_is_answered_by_the_worker_and_its_body_held() {
    let rig = Rig::new(&doc("refuse", PER_HOUR, 100, GLOBAL, LIMITER));
    let request = Request::new("acme", &[]);
    let mut stream = Stream::new(8);
    assert_eq!(
        stream.on_request_headers(&rig, &request, false),
        Flow::Pause
    );
    rig.flush();
    rig.answer_leases(0, 30_000);
    assert_eq!(rig.root.0.replied.borrow().as_slice(), &[(8, 429)]);
    assert!(rig.root.0.resumed.borrow().is_empty());
    assert_eq!(metric("denied", "refuse"), 1);
    // Answered, never resumed: whatever of the body arrives stays held.
    assert_eq!(stream.on_request_body(&rig, &request, 3, true), Flow::Pause);
    assert_eq!(stream.on_request_trailers(&rig, &request), Flow::Pause);
    stream.finish(&rig);
    assert!(!rig.holds(8));
    // The denial is remembered: the next request is answered at once, without a callout.
    let next = Request::new("acme", &[]);
    let mut stream = Stream::new(9);
    assert_eq!(stream.on_request_headers(&rig, &next, true), Flow::Pause);
    assert_eq!(next.statuses(), vec![429]);
    assert!(!rig.holds(9));
    rig.flush();
    assert!(rig.root.0.sent.borrow().is_empty());
}

#[test]
fn a_request_nobody_can_wake_the_root_for_takes_the_failure_mode_at_once() {
    let rig = Rig::new(&doc("no-wake", PER_HOUR, 100, GLOBAL, LIMITER));
    rig.can_wake.set(false);
    let request = Request::new("acme", &[]);
    let mut stream = Stream::new(4);
    // Closed: 503 now rather than a wait nobody ends.
    assert_eq!(stream.on_request_headers(&rig, &request, true), Flow::Pause);
    assert_eq!(request.statuses(), vec![503]);
    assert!(!rig.holds(4), "the worker forgot it");
    assert_eq!(rig.worker.borrow().waiting(), 0);
    assert_eq!(metric("fail_closed", "no-wake"), 1);
}

#[test]
fn a_request_decided_while_the_worker_is_busy_takes_the_failure_mode() {
    let rig = Rig::new(&doc("busy", PER_HOUR, 100, GLOBAL, LIMITER));
    let request = Request::new("acme", &[]);
    let mut stream = Stream::new(5);
    // The root is in the middle of an event of its own: the request cannot wait.
    let flow = {
        let _busy = rig.worker.borrow_mut();
        stream.on_request_headers(&rig, &request, true)
    };
    assert_eq!(flow, Flow::Pause);
    assert_eq!(request.statuses(), vec![503]);
    assert!(!rig.holds(5));
    assert_eq!(rig.wakes.get(), 0);
}

/// Reserves the request body's `max_tokens` (default 100, at most 500), reading 64 bytes.
const BODY_RESERVE: &str =
    r#","reserve":{"from":{"body":{"field":"max_tokens","max_bytes":64}},"default":100,"max":500}"#;

#[test]
fn a_cost_in_the_body_is_decided_when_the_body_is_complete() {
    let rig = Rig::new(&doc("body-cost", PER_HOUR, 1_000, BODY_RESERVE, ""));
    let request = Request::new("acme", &[]).with_body(r#"{"max_tokens":42}"#);
    let mut stream = Stream::new(1);
    // The headers go on; the body is held until the estimate in it can be read.
    assert_eq!(
        stream.on_request_headers(&rig, &request, false),
        Flow::Continue
    );
    assert_eq!(metric("units_reserved", "body-cost"), 0, "not decided yet");
    assert_eq!(
        stream.on_request_body(&rig, &request, 8, false),
        Flow::Pause
    );
    assert_eq!(metric("units_reserved", "body-cost"), 0);
    let size = request.body.len();
    assert_eq!(
        stream.on_request_body(&rig, &request, size, true),
        Flow::Continue
    );
    assert_eq!(metric("units_reserved", "body-cost"), 42);
    assert_eq!(metric("allowed", "body-cost"), 1);
    assert!(!stream.was_held());
}

#[test]
fn a_body_longer_than_what_is_read_takes_the_default_estimate_at_once() {
    let rig = Rig::new(&doc("body-long", PER_HOUR, 1_000, BODY_RESERVE, ""));
    let request = Request::new("acme", &[]).with_body(r#"{"max_tokens":42}"#);
    let mut stream = Stream::new(1);
    stream.on_request_headers(&rig, &request, false);
    // More than the 64 bytes read, and not the end yet: decided now on the default.
    assert_eq!(
        stream.on_request_body(&rig, &request, 65, false),
        Flow::Continue
    );
    assert_eq!(metric("units_reserved", "body-long"), 100);
    // Decided once: the rest of the body passes.
    assert_eq!(
        stream.on_request_body(&rig, &request, 200, true),
        Flow::Continue
    );
    assert_eq!(metric("units_reserved", "body-long"), 100);
}

#[test]
fn a_request_decided_at_its_body_and_waiting_holds_the_rest_of_the_body_until_resumed() {
    let rig = Rig::new(&doc(
        "body-wait",
        PER_HOUR,
        1_000,
        &format!("{BODY_RESERVE}{GLOBAL}"),
        LIMITER,
    ));
    let request = Request::new("acme", &[]).with_body(r#"{"max_tokens":42}"#);
    let mut stream = Stream::new(3);
    assert_eq!(
        stream.on_request_headers(&rig, &request, false),
        Flow::Continue
    );
    assert!(!rig.holds(3));
    // The body is longer than what is read: decided now, and it waits for its lease.
    assert_eq!(
        stream.on_request_body(&rig, &request, 65, false),
        Flow::Pause
    );
    assert!(rig.holds(3));
    // Each later body callback and the trailers are held too (continuing one would let the
    // whole request go on).
    assert_eq!(
        stream.on_request_body(&rig, &request, 80, false),
        Flow::Pause
    );
    assert_eq!(stream.on_request_trailers(&rig, &request), Flow::Pause);
    rig.flush();
    let asked = rig.lease_batches()[0].leases[0].min;
    assert_eq!(asked, 100, "the default estimate");
    rig.answer_leases(100, 0);
    assert_eq!(rig.root.0.resumed.borrow()[0].0, 3);
    assert_eq!(
        stream.on_request_body(&rig, &request, 90, false),
        Flow::Continue
    );
    assert_eq!(stream.on_request_trailers(&rig, &request), Flow::Continue);
}

#[test]
fn a_request_refused_at_its_body_holds_the_rest_of_the_body() {
    let rig = Rig::new(&doc("body-refused", PER_HOUR, 500, BODY_RESERVE, ""));
    let first = Request::new("acme", &[]).with_body(r#"{"max_tokens":450}"#);
    let mut stream = Stream::new(1);
    stream.on_request_headers(&rig, &first, false);
    let size = first.body.len();
    assert_eq!(
        stream.on_request_body(&rig, &first, size, true),
        Flow::Continue
    );
    let request = Request::new("acme", &[]).with_body(r#"{"max_tokens":80}"#);
    let mut stream = Stream::new(2);
    assert_eq!(
        stream.on_request_headers(&rig, &request, false),
        Flow::Continue
    );
    let size = request.body.len();
    // 80 units, 50 left in the bucket.
    assert_eq!(
        stream.on_request_body(&rig, &request, size, true),
        Flow::Pause
    );
    assert_eq!(request.statuses(), vec![429]);
    assert!(stream.was_held());
    assert_eq!(
        stream.on_request_body(&rig, &request, size, true),
        Flow::Pause
    );
    assert_eq!(stream.on_request_trailers(&rig, &request), Flow::Pause);
    assert_eq!(request.statuses(), vec![429], "answered once");
}

#[test]
fn finishing_twice_settles_and_releases_once() {
    // The wasm build finishes at `on_log` and again when the context is dropped.
    let rig = Rig::new(&doc(
        "twice",
        PER_HOUR,
        1_000,
        &reserving(r#"{"header":"x-usage"}"#, "keep"),
        "",
    ));
    let request = Request::new("acme", &[]);
    let mut stream = Stream::new(1);
    assert_eq!(
        stream.on_request_headers(&rig, &request, true),
        Flow::Continue
    );
    assert_eq!(metric("in_flight", "twice"), 1);
    // One in flight at most: the next request of the key is refused while this one runs.
    let next = Request::new("acme", &[]);
    assert_eq!(
        Stream::new(2).on_request_headers(&rig, &next, true),
        Flow::Pause
    );
    assert_eq!(next.statuses(), vec![429]);
    stream.finish(&rig);
    // No response said what it cost: `keep` settles the reservation.
    assert_eq!(metric("usage_missing", "twice"), 1);
    assert_eq!(metric("units_settled", "twice"), 100);
    assert_eq!(metric("in_flight", "twice"), 0);
    stream.finish(&rig);
    assert_eq!(metric("usage_missing", "twice"), 1);
    assert_eq!(metric("units_settled", "twice"), 100);
    // Its slot is free: the next request of the key is admitted.
    assert_eq!(
        Stream::new(3).on_request_headers(&rig, &Request::new("acme", &[]), true),
        Flow::Continue
    );
    assert_eq!(metric("in_flight", "twice"), 1);
    assert_eq!(metric("units_reserved", "twice"), 200);
}

#[test]
fn a_stream_destroyed_after_its_usage_was_settled_only_releases_its_slot() {
    // The native build's `destroy` of a stream that never completed (a reset after the
    // response headers).
    let rig = Rig::new(&doc(
        "destroyed",
        PER_HOUR,
        1_000,
        &reserving(r#"{"header":"x-usage"}"#, "keep"),
        "",
    ));
    let request = Request::new("acme", &[]).with_response(&[("x-usage", "30")]);
    let mut stream = Stream::new(1);
    assert_eq!(
        stream.on_request_headers(&rig, &request, true),
        Flow::Continue
    );
    stream.on_response_headers(&rig, &request, false);
    assert_eq!(metric("units_settled", "destroyed"), 30);
    assert_eq!(metric("units_refunded", "destroyed"), 70);
    // Settled, but still in flight until the stream ends.
    assert_eq!(metric("in_flight", "destroyed"), 1);
    let next = Request::new("acme", &[]);
    Stream::new(2).on_request_headers(&rig, &next, true);
    assert_eq!(next.statuses(), vec![429]);
    stream.finish(&rig);
    assert_eq!(metric("in_flight", "destroyed"), 0);
    assert_eq!(
        metric("units_settled", "destroyed"),
        30,
        "not settled again"
    );
    assert_eq!(metric("usage_missing", "destroyed"), 0);
    assert_eq!(
        Stream::new(3).on_request_headers(&rig, &Request::new("acme", &[]), true),
        Flow::Continue
    );
}

#[test]
fn a_stream_destroyed_before_any_response_releases_its_slot_and_refunds() {
    let rig = Rig::new(&doc(
        "reset",
        PER_HOUR,
        1_000,
        &reserving(r#"{"header":"x-usage"}"#, "refund"),
        "",
    ));
    let mut stream = Stream::new(1);
    let request = Request::new("acme", &[("x-estimate", "40")]);
    assert_eq!(
        stream.on_request_headers(&rig, &request, true),
        Flow::Continue
    );
    stream.finish(&rig);
    assert_eq!(metric("usage_missing", "reset"), 1);
    assert_eq!(metric("units_refunded", "reset"), 40);
    assert_eq!(metric("units_settled", "reset"), 0);
    assert_eq!(metric("in_flight", "reset"), 0);
}

#[test]
fn usage_in_the_response_headers_is_settled_with_them() {
    let rig = Rig::new(&doc(
        "by-header",
        PER_HOUR,
        1_000,
        &reserving(r#"{"header":"x-usage"}"#, "keep"),
        "",
    ));
    let request =
        Request::new("acme", &[("x-estimate", "200")]).with_response(&[("x-usage", "250")]);
    let mut stream = Stream::new(1);
    stream.on_request_headers(&rig, &request, true);
    assert_eq!(metric("units_reserved", "by-header"), 200);
    stream.on_response_headers(&rig, &request, false);
    // 50 over the reservation: charged as debt.
    assert_eq!(metric("units_settled", "by-header"), 250);
    assert_eq!(metric("units_debt", "by-header"), 50);
    request.response_body(&mut stream, &rig, "ok", true);
    stream.finish(&rig);
    assert_eq!(metric("units_settled", "by-header"), 250);
    assert_eq!(metric("usage_missing", "by-header"), 0);
}

#[test]
fn usage_in_the_response_body_is_settled_at_its_end() {
    let rig = Rig::new(&doc(
        "by-body",
        PER_HOUR,
        1_000,
        &reserving(
            r#"{"body":{"field":"usage.total_tokens","max_bytes":1024}}"#,
            "keep",
        ),
        "",
    ));
    let request = Request::new("acme", &[("x-estimate", "100")])
        .with_response(&[("content-type", "application/json")]);
    let mut stream = Stream::new(1);
    stream.on_request_headers(&rig, &request, true);
    stream.on_response_headers(&rig, &request, false);
    assert_eq!(metric("units_settled", "by-body"), 0);
    request.response_body(&mut stream, &rig, r#"{"usage":{"total_"#, false);
    assert_eq!(metric("units_settled", "by-body"), 0, "not before the end");
    request.response_body(&mut stream, &rig, r#"tokens":37}}"#, true);
    assert_eq!(metric("units_settled", "by-body"), 37);
    assert_eq!(metric("units_refunded", "by-body"), 63);
    assert_eq!(metric("in_flight", "by-body"), 1);
    stream.finish(&rig);
    assert_eq!(metric("units_settled", "by-body"), 37);
    assert_eq!(metric("in_flight", "by-body"), 0);
}

#[test]
fn usage_in_the_response_trailers_is_settled_with_them() {
    let rig = Rig::new(&doc(
        "by-trailer",
        PER_HOUR,
        1_000,
        &reserving(r#"{"trailer":"x-usage"}"#, "keep"),
        "",
    ));
    let request = Request::new("acme", &[("x-estimate", "100")])
        .with_response(&[("x-usage", "1")])
        .with_trailers(&[("x-usage", "12")]);
    let mut stream = Stream::new(1);
    stream.on_request_headers(&rig, &request, true);
    // A header of the same name is not the trailer.
    stream.on_response_headers(&rig, &request, false);
    request.response_body(&mut stream, &rig, "data", false);
    assert_eq!(metric("units_settled", "by-trailer"), 0);
    stream.on_response_trailers(&rig, &request);
    assert_eq!(metric("units_settled", "by-trailer"), 12);
    assert_eq!(metric("units_refunded", "by-trailer"), 88);
    stream.finish(&rig);
    assert_eq!(metric("units_settled", "by-trailer"), 12);
    assert_eq!(metric("usage_missing", "by-trailer"), 0);
}

#[test]
fn a_stream_reset_mid_body_settles_its_reservation_as_missing_once() {
    let rig = Rig::new(&doc(
        "mid-body",
        PER_HOUR,
        1_000,
        &reserving(
            r#"{"body":{"field":"usage.total_tokens","max_bytes":1024}}"#,
            "keep",
        ),
        "",
    ));
    let request = Request::new("acme", &[("x-estimate", "80")])
        .with_response(&[("content-type", "application/json")]);
    let mut stream = Stream::new(1);
    stream.on_request_headers(&rig, &request, true);
    stream.on_response_headers(&rig, &request, false);
    request.response_body(&mut stream, &rig, r#"{"usage":"#, false);
    stream.finish(&rig);
    assert_eq!(metric("usage_missing", "mid-body"), 1);
    assert_eq!(metric("units_settled", "mid-body"), 80, "kept");
    assert_eq!(metric("in_flight", "mid-body"), 0);
    // Callbacks after the end settle nothing more.
    request.response_body(&mut stream, &rig, r#"{"total_tokens":5}}"#, true);
    stream.finish(&rig);
    assert_eq!(metric("usage_missing", "mid-body"), 1);
    assert_eq!(metric("units_settled", "mid-body"), 80);
}

#[test]
fn a_global_policy_reports_what_its_requests_settled_with_the_next_callout() {
    let rig = Rig::new(&doc(
        "reported",
        PER_HOUR,
        100,
        &format!(r#"{GLOBAL},"settle":{{"from":{{"header":"x-usage"}}}}"#),
        LIMITER,
    ));
    let request = Request::new("acme", &[]).with_response(&[("x-usage", "3")]);
    let mut stream = Stream::new(1);
    assert_eq!(stream.on_request_headers(&rig, &request, true), Flow::Pause);
    rig.flush();
    assert!(rig.lease_batches()[0].settled.is_empty());
    rig.answer_leases(5, 0);
    stream.on_response_headers(&rig, &request, true);
    stream.finish(&rig);
    assert_eq!(metric("units_settled", "reported"), 3);
    // Another key's lease callout carries the 3 units.
    let mut other = Stream::new(2);
    assert_eq!(
        other.on_request_headers(&rig, &Request::new("other", &[]), true),
        Flow::Pause
    );
    rig.flush();
    let batches = rig.lease_batches();
    assert_eq!(batches[0].settled.get("reported"), Some(&3));
}

#[test]
fn a_shaped_request_sleeps_until_its_turn_and_the_tick_resumes_it() {
    // 10 per second, burst 1: a second request at once waits 100 ms for its turn.
    let rig = Rig::new(&doc(
        "shaped",
        r#"{"units":10,"per":"1s"}"#,
        1,
        r#","shape":{"max_delay":"1s","max_waiting":1}"#,
        "",
    ));
    assert_eq!(
        Stream::new(1).on_request_headers(&rig, &Request::new("acme", &[]), true),
        Flow::Continue
    );
    let mut stream = Stream::new(2);
    let request = Request::new("acme", &[]);
    assert_eq!(stream.on_request_headers(&rig, &request, true), Flow::Pause);
    assert!(request.replies.borrow().is_empty());
    assert!(rig.holds(2));
    assert_eq!(
        rig.root.0.tick_ms.get(),
        TICK_MS,
        "the tick runs while it sleeps"
    );
    assert_eq!(metric("delayed", "shaped"), 1);
    // No room for a third to wait on this worker (max_waiting 1): refused.
    let third = Request::new("acme", &[]);
    assert_eq!(
        Stream::new(3).on_request_headers(&rig, &third, true),
        Flow::Pause
    );
    assert_eq!(third.statuses(), vec![429]);
    rig.now.set(1_050);
    rig.tick();
    assert!(rig.root.0.resumed.borrow().is_empty(), "not its turn yet");
    rig.now.set(1_100);
    rig.tick();
    assert_eq!(rig.root.0.resumed.borrow().len(), 1);
    assert_eq!(rig.root.0.resumed.borrow()[0].0, 2);
    assert!(!rig.holds(2));
    stream.finish(&rig);
}

#[test]
fn a_shaped_request_that_ends_before_its_turn_is_never_resumed() {
    let rig = Rig::new(&doc(
        "shaped-gone",
        r#"{"units":10,"per":"1s"}"#,
        1,
        r#","shape":{"max_delay":"1s"}"#,
        "",
    ));
    Stream::new(1).on_request_headers(&rig, &Request::new("acme", &[]), true);
    let mut stream = Stream::new(2);
    assert_eq!(
        stream.on_request_headers(&rig, &Request::new("acme", &[]), true),
        Flow::Pause
    );
    assert!(rig.holds(2));
    stream.finish(&rig);
    assert!(!rig.holds(2));
    rig.now.set(5_000);
    rig.tick();
    assert!(rig.root.0.resumed.borrow().is_empty());
}

#[test]
fn a_client_copy_of_a_tag_header_is_removed_and_over_the_limit_the_filter_sets_it() {
    let rig = Rig::new(&doc(
        "bulk",
        PER_HOUR,
        1,
        r#","on_over_limit":{"action":"tag"}"#,
        "",
    ));
    let forged = Request::new("acme", &[("x-tollgate-over-limit", "forged")]);
    assert_eq!(
        Stream::new(1).on_request_headers(&rig, &forged, true),
        Flow::Continue
    );
    assert_eq!(
        forged.set_headers.borrow().as_slice(),
        &[("x-tollgate-over-limit".to_string(), None)]
    );
    assert_eq!(forged.header("x-tollgate-over-limit"), None);
    // Over the limit: let on, tagged by the filter.
    let over = Request::new("acme", &[]);
    assert_eq!(
        Stream::new(2).on_request_headers(&rig, &over, true),
        Flow::Continue
    );
    assert_eq!(over.header("x-tollgate-over-limit"), Some(b"bulk".to_vec()));
    assert!(over.replies.borrow().is_empty());
}
