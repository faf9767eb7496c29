//! The proxy-wasm glue: reads the plugin configuration, opens the shared table, and for each
//! request hands the engine what it reads through `proxy_wasm::hostcalls` (the calls that
//! return `Result`; the SDK's trait helpers unwrap, and a panic would kill the worker's VM).
//! The root context owns the worker's callouts (see `worker`).

use crate::engine::{Admission, Attempt, Decision, Engine, Plan, Usage, Verdict, SHARED_PREFIX};
use crate::global::DEADLINE_MARGIN_MS;
use crate::metrics::Metrics;
use crate::request::{RequestFacts, RequestSource};
use crate::response_usage::ResponseUsage;
use crate::shared::{HostSharedData, SharedData, WriteError};
use crate::table::SlotTable;
use crate::worker::{no_room_reply, shaped_ids, Admitted, Ctx, Host, Worker};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};
use tollgate_core::policy::{authority_host, Policies};
use tollgate_core::protocol::MAX_BODY_BYTES;
use tollgate_core::response::LocalReply;

/// Largest plugin configuration read.
const MAX_CONFIG_BYTES: usize = 4 * 1024 * 1024;

struct Configured {
    engine: Engine,
    metrics: Metrics,
    worker: RefCell<Worker>,
    queue: Option<u32>,
    /// The root context of this VM (whose tick wakes shaped requests).
    root_id: u32,
}

impl Configured {
    /// The worker's view of one root-context event, at the host's current time.
    fn ctx<'a>(&'a self, host: &'a RootHost) -> Ctx<'a, HostSharedData, RootHost> {
        Ctx {
            engine: &self.engine,
            store: &HostSharedData,
            metrics: &self.metrics,
            host,
            now_ms: now_ms(),
        }
    }
}

/// One per VM (per worker): owns the configuration and the worker's callouts.
pub struct Root {
    context_id: u32,
    configured: Option<Rc<Configured>>,
}

impl Root {
    pub fn new(context_id: u32) -> Self {
        Self {
            context_id,
            configured: None,
        }
    }

    fn configure(&self) -> Result<Configured, String> {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, MAX_CONFIG_BYTES)
            .map_err(|status| format!("cannot read plugin configuration: {status:?}"))?
            .ok_or("plugin configuration is empty: pass the policy document as `configuration`")?;
        let policies = Policies::from_json(&bytes).map_err(|errors| errors.to_string())?;
        let seed = now_nanos() ^ u64::from(self.context_id).rotate_left(32);
        let table = SlotTable::open(
            &HostSharedData,
            SHARED_PREFIX,
            policies.local_table.slots,
            seed,
        )
        .map_err(|error| format!("cannot create the shared table: {error:?}"))?;
        let mut instance = [0u8; 8];
        for (dst, src) in instance.iter_mut().zip(table.salt()) {
            *dst = *src;
        }
        let instance = u64::from_le_bytes(instance);
        let worker_index = next_worker_index(&HostSharedData);
        let queue = if policies.limiter.is_some() {
            let name = format!("{SHARED_PREFIX}queue/{instance:016x}/{worker_index}");
            Some(
                hostcalls::register_shared_queue(&name)
                    .map_err(|status| format!("cannot register the worker queue: {status:?}"))?,
            )
        } else {
            None
        };
        let metrics = Metrics::define(&policies);
        Ok(Configured {
            engine: Engine::new(policies, table),
            metrics,
            worker: RefCell::new(Worker::new(instance, worker_index)),
            queue,
            root_id: self.context_id,
        })
    }

    fn host(&self, configured: &Configured) -> RootHost {
        configured.root_host()
    }
}

impl Configured {
    fn root_host(&self) -> RootHost {
        let configured = self;
        RootHost {
            root_id: configured.root_id,
            cluster: configured
                .engine
                .limiter()
                .map(|l| l.cluster.clone())
                .unwrap_or_default(),
            authority: configured
                .engine
                .limiter()
                .map(|l| l.authority.clone())
                .unwrap_or_default(),
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(configured) = self.configured.clone() else {
            return;
        };
        // A reset or failed callout has no headers; reading one header then would panic in the SDK.
        let status = if num_headers == 0 {
            None
        } else {
            hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders)
                .ok()
                .and_then(|headers| {
                    headers
                        .into_iter()
                        .find(|(name, _)| name == ":status")
                        .and_then(|(_, value)| std::str::from_utf8(&value).ok()?.parse().ok())
                })
        };
        let body = if body_size > 0 && body_size <= MAX_BODY_BYTES {
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let host = self.host(&configured);
        if let Ok(mut worker) = configured.worker.try_borrow_mut() {
            worker.complete(token_id, status, &body, &configured.ctx(&host));
        };
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        match self.configure() {
            Ok(configured) => {
                log::info!(
                    "{} policies loaded (version {}), shared table of {} slots",
                    configured.engine.policies.policies.len(),
                    configured.engine.policies.version,
                    configured.engine.policies.local_table.slots
                );
                self.configured = Some(Rc::new(configured));
                true
            }
            Err(reason) => {
                log::error!("invalid plugin configuration: {reason}");
                false
            }
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(configured) = self.configured.clone() else {
            return;
        };
        // Wake-ups carry no data; drain them all, then dispatch what the requests queued.
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        let host = self.host(&configured);
        if let Ok(mut worker) = configured.worker.try_borrow_mut() {
            worker.flush(&configured.ctx(&host));
        };
    }

    fn on_tick(&mut self) {
        let Some(configured) = self.configured.clone() else {
            return;
        };
        let host = self.host(&configured);
        if let Ok(mut worker) = configured.worker.try_borrow_mut() {
            worker.tick(&configured.ctx(&host));
        };
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http {
            context_id,
            configured: self.configured.clone(),
            admitted: Admitted::default(),
            body_wait: None,
            usage: None,
            held: false,
            finished: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The host as the root context sees it: callouts are the root's (they outlive requests), and
/// after touching a request the effective context goes back to the root.
struct RootHost {
    root_id: u32,
    cluster: String,
    authority: String,
}

impl Host for RootHost {
    fn dispatch(&self, path: &str, body: &[u8], timeout_ms: u64) -> Result<u32, String> {
        let headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", self.authority.as_str()),
            ("content-type", "application/json"),
        ];
        hostcalls::dispatch_http_call(
            &self.cluster,
            headers,
            Some(body),
            vec![],
            Duration::from_millis(timeout_ms.max(1)),
        )
        .map_err(|status| format!("dispatch to cluster `{}` refused: {status:?}", self.cluster))
    }

    fn resume(&self, context_id: u32) -> bool {
        let done = hostcalls::set_effective_context(context_id).is_ok()
            && hostcalls::resume_http_request().is_ok();
        let _ = hostcalls::set_effective_context(self.root_id);
        done
    }

    fn reply(&self, context_id: u32, reply: &LocalReply) -> bool {
        let done = hostcalls::set_effective_context(context_id).is_ok() && send_reply(reply);
        let _ = hostcalls::set_effective_context(self.root_id);
        done
    }

    fn set_tick(&self, period_ms: u64) {
        let _ = hostcalls::set_tick_period(Duration::from_millis(period_ms));
    }
}

fn send_reply(reply: &LocalReply) -> bool {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    match hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes())) {
        Ok(()) => true,
        Err(status) => {
            log::warn!("cannot send local reply: {status:?}");
            false
        }
    }
}

/// One per request.
struct Http {
    context_id: u32,
    configured: Option<Rc<Configured>>,
    admitted: Admitted,
    /// The plan waits for the request body (a `reserve` reads it), reading at most this much.
    body_wait: Option<(Plan, usize)>,
    /// What the response says the request cost, once its headers arrived.
    usage: Option<ResponseUsage>,
    /// The request was decided in a body callback and paused for a lease, or answered
    /// locally: the rest of its body must be held (a body callback that continues lets the
    /// whole request go on) until the worker resumes it.
    held: bool,
    /// The stream end was handled (settlements done, slots released).
    finished: bool,
}

impl Context for Http {}

impl Drop for Http {
    fn drop(&mut self) {
        // A stream Envoy never logged (a VM shutting down) still frees its slots.
        self.finish();
        if let Some(configured) = &self.configured {
            if let Ok(mut worker) = configured.worker.try_borrow_mut() {
                worker.forget(self.context_id);
            }
        }
    }
}

impl Http {
    /// Registers this request as waiting for the leases `decision` asks for and wakes the root
    /// to send them; `false` (and nothing registered) when that is not possible.
    fn start_waiting(
        &self,
        configured: &Configured,
        plan: &Plan,
        decision: &Decision,
        now: u64,
    ) -> bool {
        let Ok(mut worker) = configured.worker.try_borrow_mut() else {
            return false;
        };
        let timeout = configured.engine.limiter().map_or(0, |l| l.timeout.0);
        let deadline = now + timeout + DEADLINE_MARGIN_MS;
        if !worker.wait(
            self.context_id,
            plan.clone(),
            decision,
            deadline,
            self.admitted.clone(),
        ) {
            return false;
        }
        worker.queue(decision);
        if wake(configured) {
            true
        } else {
            worker.forget(self.context_id);
            false
        }
    }

    /// Decides a plan whose costs are known, and acts on the verdict.
    fn admit(&mut self, configured: &Configured, mut plan: Plan) -> Action {
        let engine = &configured.engine;
        let now = now_ms();
        if let Ok(worker) = configured.worker.try_borrow() {
            worker.mark_room(engine, &mut plan);
        }
        let mut decision = engine.decide(&plan, &HostSharedData, now, Attempt::default());
        if decision.verdict == Verdict::Wait
            && !self.start_waiting(configured, &plan, &decision, now)
        {
            // Too many requests wait already, or nobody could be woken to send the callout:
            // decide now, as if the limiter were unavailable.
            decision = engine.decide(&plan, &HostSharedData, now, Attempt::NO_WAIT);
        }
        if decision.verdict != Verdict::Wait {
            // Background refills, probes and returns this decision asks for.
            let queued = configured
                .worker
                .try_borrow_mut()
                .is_ok_and(|mut worker| worker.queue(&decision));
            if queued {
                wake(configured);
            }
        }
        // A waiting request's outcomes are counted when it ends; its first decision's
        // housekeeping (expired leases) now.
        configured.metrics.record(&decision);
        match decision.verdict {
            Verdict::Wait => {
                self.held = true;
                Action::Pause
            }
            Verdict::Reply(reply) => {
                if send_reply(&reply) {
                    self.held = true;
                    Action::Pause
                } else {
                    Action::Continue
                }
            }
            Verdict::Continue => {
                {
                    let mut admitted = self.admitted.borrow_mut();
                    admitted.response_headers = decision.response_headers;
                    admitted.admissions = decision.admissions;
                }
                if decision.delay_ms > 0 {
                    // A shaped request: its turn comes later; the root's tick resumes it.
                    let host = configured.root_host();
                    let slept = configured.worker.try_borrow_mut().is_ok_and(|mut worker| {
                        let shaped = shaped_ids(engine, &plan);
                        let admitted = self.admitted.clone();
                        worker.sleep(
                            self.context_id,
                            now + decision.delay_ms,
                            shaped,
                            admitted,
                            &host,
                        )
                    });
                    if slept {
                        self.held = true;
                        return Action::Pause;
                    }
                    // No room to pause it: refused rather than sent before its turn (its cost
                    // stays taken: under-use, never a burst past the rate).
                    let reply = no_room_reply(engine, &decision.delayed, decision.delay_ms);
                    if send_reply(&reply) {
                        self.held = true;
                        return Action::Pause;
                    }
                }
                Action::Continue
            }
        }
    }

    /// Whether the request still waits for its decision (or was answered locally).
    fn still_held(&self) -> bool {
        self.held && !self.admitted.borrow().resumed
    }

    /// Applies what the response said about some admissions.
    fn settle(configured: &Configured, known: Vec<(&Admission, Usage)>) {
        let now = now_ms();
        for (admission, usage) in known {
            Self::apply(configured, admission, Some(usage), false, now);
        }
    }

    fn apply(
        configured: &Configured,
        admission: &Admission,
        usage: Option<Usage>,
        release: bool,
        now: u64,
    ) {
        match configured
            .engine
            .finish(&HostSharedData, admission, usage, release, now)
        {
            Ok(done) => {
                configured.metrics.finished(admission.policy, &done);
                let global = configured
                    .engine
                    .policy(admission.policy)
                    .is_some_and(|p| p.scope.uses_limiter());
                if let (Some(units), true) = (done.settled, global) {
                    if let Ok(mut worker) = configured.worker.try_borrow_mut() {
                        worker.note_settled(admission.policy, units);
                    }
                }
            }
            Err(error) => log::warn!("cannot settle a request (table {error:?})"),
        }
    }

    /// The stream ended, however it ended: what is not settled yet had no usable actual cost,
    /// and every in-flight slot is released. Once per request.
    fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let Some(configured) = self.configured.clone() else {
            return;
        };
        let mut usage = match self.usage.take() {
            Some(usage) => usage,
            None => {
                let admissions = std::mem::take(&mut self.admitted.borrow_mut().admissions);
                if admissions.is_empty() {
                    return;
                }
                ResponseUsage::new(&configured.engine, admissions)
            }
        };
        let now = now_ms();
        for (admission, pending) in usage.on_end() {
            Self::apply(&configured, admission, pending, true, now);
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(configured) = self.configured.clone() else {
            return Action::Continue;
        };
        let source = HostRequest;
        let facts = RequestFacts {
            method: source.header_text(":method"),
            path: source.header_text(":path"),
            host: authority_host(&source.header_text(":authority")),
        };
        let engine = &configured.engine;
        let mut plan = engine.plan(&facts, &source);
        if plan.is_empty() {
            return Action::Continue;
        }
        if plan.needs_body() {
            if !end_of_stream {
                // The estimate is in the body. Proxy-Wasm cannot hold the headers and still see
                // the body (a paused header callback stops the body callbacks too), so the
                // headers go on and the body is held (buffered by Envoy) until it is complete or
                // longer than what is read; a refusal then resets the upstream stream before
                // any of the body reached it.
                let max = engine.body_bytes_wanted(&plan);
                self.body_wait = Some((plan, max));
                return Action::Continue;
            }
            engine.read_body(&mut plan, None);
        }
        self.admit(&configured, plan)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.still_held() {
            return Action::Pause;
        }
        let (Some(configured), Some((mut plan, max))) =
            (self.configured.clone(), self.body_wait.take())
        else {
            return Action::Continue;
        };
        if !end_of_stream && body_size <= max {
            self.body_wait = Some((plan, max));
            return Action::Pause;
        }
        let body = if end_of_stream && body_size <= max {
            hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
                .ok()
                .map(Option::unwrap_or_default)
        } else {
            None
        };
        configured.engine.read_body(&mut plan, body.as_deref());
        self.admit(&configured, plan)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.still_held() {
            return Action::Pause;
        }
        // A body followed by trailers: the estimate takes its default.
        let (Some(configured), Some((mut plan, _))) =
            (self.configured.clone(), self.body_wait.take())
        else {
            return Action::Continue;
        };
        configured.engine.read_body(&mut plan, None);
        self.admit(&configured, plan)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let (headers, admissions) = {
            let mut admitted = self.admitted.borrow_mut();
            (
                std::mem::take(&mut admitted.response_headers),
                std::mem::take(&mut admitted.admissions),
            )
        };
        for (name, value) in headers {
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, &name, &value);
        }
        let Some(configured) = self.configured.clone() else {
            return Action::Continue;
        };
        if admissions.is_empty() {
            return Action::Continue;
        }
        let mut usage = ResponseUsage::new(&configured.engine, admissions);
        let known = usage.on_headers(&configured.engine, response_header, end_of_stream);
        Self::settle(&configured, known);
        self.usage = Some(usage);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (Some(configured), Some(usage)) = (self.configured.clone(), self.usage.as_mut()) else {
            return Action::Continue;
        };
        if usage.wants_body() {
            // This chunk only, as it passes: the response is never held up.
            let chunk = match body_size {
                0 => None,
                size => hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
                    .ok()
                    .flatten(),
            };
            let known = usage.on_body(chunk.as_deref().unwrap_or_default(), end_of_stream);
            Self::settle(&configured, known);
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        let (Some(configured), Some(usage)) = (self.configured.clone(), self.usage.as_mut()) else {
            return Action::Continue;
        };
        let known = usage.on_trailers(|name| {
            hostcalls::get_map_value_bytes(MapType::HttpResponseTrailers, name)
                .ok()
                .flatten()
        });
        Self::settle(&configured, known);
        Action::Continue
    }

    fn on_log(&mut self) {
        self.finish();
    }
}

/// Wakes this worker's root context (through its shared queue) to send what was queued.
fn wake(configured: &Configured) -> bool {
    configured
        .queue
        .is_some_and(|queue| hostcalls::enqueue_shared_queue(queue, Some(b"w")).is_ok())
}

fn response_header(name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
        .ok()
        .flatten()
}

/// The current request, read with hostcalls that cannot panic on hostile bytes (the `_bytes`
/// variants: the string ones unwrap UTF-8).
struct HostRequest;

impl HostRequest {
    fn header_text(&self, name: &str) -> String {
        self.header(name)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default()
    }
}

impl RequestSource for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }
}

/// A number unique to this worker among the VMs sharing the vm_id (CAS-incremented counter).
fn next_worker_index(store: &impl SharedData) -> u64 {
    let key = format!("{SHARED_PREFIX}workers");
    for _ in 0..64 {
        let (value, cas) = match store.get(&key) {
            Ok(read) => read,
            Err(_) => break,
        };
        let current = value
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map_or(0, u64::from_le_bytes);
        let next = current.wrapping_add(1);
        // A missing key is created whatever CAS is given; a present one must match.
        match store.set(&key, &next.to_le_bytes(), Some(cas.unwrap_or(u32::MAX))) {
            Ok(()) => return next,
            Err(WriteError::CasMismatch) => continue,
            Err(WriteError::Host) => break,
        }
    }
    now_nanos() & 0xffff
}

fn now_nanos() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn now_ms() -> u64 {
    now_nanos() / 1_000_000
}
