//! One request's life in the filter, whichever host runs it (the proxy-wasm filter or the
//! native dynamic module): plan at the request headers (or at the body a `reserve` reads),
//! decide, pause for a lease or a shaped turn, answer locally, add the response headers, settle
//! what the response says the request cost, release at the stream end.
//!
//! The host glue hands each callback to [`Stream`] with two views: the [`Instance`] (engine,
//! table, metrics, the worker's global-stage state, how to wake whoever sends callouts) and
//! the [`StreamHost`] (this request's headers, bodies and local reply).

use crate::engine::{Admission, Attempt, Decision, Engine, Plan, Usage, Verdict};
use crate::global::DEADLINE_MARGIN_MS;
use crate::metrics::Metrics;
use crate::request::{RequestFacts, RequestSource};
use crate::response_usage::ResponseUsage;
use crate::shared::{SharedData, StoreAt};
use crate::worker::{no_room_reply, shaped_ids, Admitted, Host, Worker};
use std::borrow::Cow;
use tollgate_core::policy::authority_host;
use tollgate_core::response::LocalReply;

/// What a callback tells the host to do with the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Hold the request (its headers, or its body) until the worker resumes or answers it.
    Pause,
}

/// The per-instance side of the filter, as one request sees it.
pub trait Instance {
    type Store: SharedData;
    type WorkerHost: Host;
    fn engine(&self) -> &Engine;
    fn metrics(&self) -> &Metrics;
    fn store(&self) -> &Self::Store;
    /// Runs `f` on the worker's global-stage state; `None` when it is busy (the wasm root is
    /// in the middle of an event) or gone.
    fn with_worker<R>(&self, f: impl FnOnce(&mut Worker) -> R) -> Option<R>;
    /// Has whoever sends the worker's callouts send what was queued; `false` if nobody can be
    /// woken.
    fn wake(&self) -> bool;
    /// The host the worker uses to set its tick (a shaped request asks for one).
    fn worker_host(&self) -> Self::WorkerHost;
    /// The host's current time.
    fn now_ms(&self) -> u64;
}

/// The request being decided, as the host exposes it during a callback.
pub trait StreamHost: RequestSource {
    /// Answers the request locally; `false` if the host refused.
    fn send_reply(&self, reply: &LocalReply) -> bool;
    /// The request body received so far (at most `max` bytes are wanted).
    fn request_body(&self, size: usize) -> Option<Vec<u8>>;
    fn add_response_header(&self, name: &str, value: &str);
    /// Sets a request header (`None`: removes it) while the request headers are held, so
    /// that Envoy chooses the route again with it.
    fn set_request_header(&self, name: &str, value: Option<&str>);
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// The response body chunk of this callback.
    fn response_body(&self, size: usize) -> Option<Vec<u8>>;
    fn response_trailer(&self, name: &str) -> Option<Vec<u8>>;
}

/// One request's state between callbacks.
pub struct Stream {
    /// The host's id of the request (the worker resumes or answers it by this id).
    pub id: u32,
    /// What the request shares with the worker (its settlements, response headers, whether
    /// it was resumed); `None` until one of them is needed.
    admitted: Option<Admitted>,
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

impl Stream {
    pub fn new(id: u32) -> Self {
        Self {
            id,
            admitted: None,
            body_wait: None,
            usage: None,
            held: false,
            finished: false,
        }
    }

    pub fn on_request_headers(
        &mut self,
        instance: &impl Instance,
        host: &impl StreamHost,
        end_of_stream: bool,
    ) -> Flow {
        // The request line read in place from the host's headers (only invalid UTF-8 or an
        // upper-case host costs a copy).
        let engine = instance.engine();
        let mut plan = host.with_header(":method", |method| {
            host.with_header(":path", |path| {
                let plan_for = |authority: Option<&[u8]>| {
                    let authority = request_text(authority);
                    let facts = RequestFacts {
                        method: request_text(method),
                        path: request_text(path),
                        host: authority_host(&authority),
                    };
                    engine.plan(&facts, host)
                };
                // The host is read only when some policy matches on it (none other looks).
                if engine.policies.reads_host() {
                    host.with_header(":authority", plan_for)
                } else {
                    plan_for(None)
                }
            })
        });
        for name in &plan.tag_headers {
            // Only the filter sets a tag: a client's copy never reaches the route table.
            if host.with_header(name, |value| value.is_some()) {
                host.set_request_header(name, None);
            }
        }
        if plan.is_empty() {
            return Flow::Continue;
        }
        if plan.needs_body() {
            if !end_of_stream {
                // The estimate is in the body. Proxy-Wasm cannot hold the headers and still see
                // the body (a paused header callback stops the body callbacks too), so the
                // headers go on and the body is held (buffered by Envoy) until it is complete or
                // longer than what is read; a refusal then resets the upstream stream before
                // any of the body reached it. The native build does the same.
                let max = engine.body_bytes_wanted(&plan);
                self.body_wait = Some((plan, max));
                return Flow::Continue;
            }
            engine.read_body(&mut plan, None);
        }
        self.admit(instance, host, plan)
    }

    pub fn on_request_body(
        &mut self,
        instance: &impl Instance,
        host: &impl StreamHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Flow {
        if self.still_held() {
            return Flow::Pause;
        }
        let Some((mut plan, max)) = self.body_wait.take() else {
            return Flow::Continue;
        };
        if !end_of_stream && body_size <= max {
            self.body_wait = Some((plan, max));
            return Flow::Pause;
        }
        let body = if end_of_stream && body_size <= max {
            host.request_body(body_size)
        } else {
            None
        };
        instance.engine().read_body(&mut plan, body.as_deref());
        plan.after_headers = true;
        self.admit(instance, host, plan)
    }

    pub fn on_request_trailers(
        &mut self,
        instance: &impl Instance,
        host: &impl StreamHost,
    ) -> Flow {
        if self.still_held() {
            return Flow::Pause;
        }
        // A body followed by trailers: the estimate takes its default.
        let Some((mut plan, _)) = self.body_wait.take() else {
            return Flow::Continue;
        };
        instance.engine().read_body(&mut plan, None);
        plan.after_headers = true;
        self.admit(instance, host, plan)
    }

    pub fn on_response_headers(
        &mut self,
        instance: &impl Instance,
        host: &impl StreamHost,
        end_of_stream: bool,
    ) {
        let (headers, admissions) = match &self.admitted {
            Some(admitted) => {
                let mut admitted = admitted.lock();
                (
                    std::mem::take(&mut admitted.response_headers),
                    std::mem::take(&mut admitted.admissions),
                )
            }
            None => (Vec::new(), Vec::new()),
        };
        for (name, value) in headers {
            host.add_response_header(&name, &value);
        }
        if admissions.is_empty() {
            return;
        }
        let engine = instance.engine();
        let mut usage = ResponseUsage::new(engine, admissions);
        let known = usage.on_headers(engine, |name| host.response_header(name), end_of_stream);
        settle(instance, known);
        self.usage = Some(usage);
    }

    pub fn on_response_body(
        &mut self,
        instance: &impl Instance,
        host: &impl StreamHost,
        body_size: usize,
        end_of_stream: bool,
    ) {
        let Some(usage) = self.usage.as_mut() else {
            return;
        };
        if usage.wants_body() {
            // This chunk only, as it passes: the response is never held up.
            let chunk = match body_size {
                0 => None,
                size => host.response_body(size),
            };
            let known = usage.on_body(chunk.as_deref().unwrap_or_default(), end_of_stream);
            settle(instance, known);
        }
    }

    pub fn on_response_trailers(&mut self, instance: &impl Instance, host: &impl StreamHost) {
        let Some(usage) = self.usage.as_mut() else {
            return;
        };
        let known = usage.on_trailers(|name| host.response_trailer(name));
        settle(instance, known);
    }

    /// The stream ended, however it ended: what is not settled yet had no usable actual cost,
    /// and every in-flight slot is released. Once per request; the worker forgets it.
    pub fn finish(&mut self, instance: &impl Instance) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        if self.held {
            // Only a held request can be the worker's (it waited or slept): the others end
            // without touching the worker (in the native build, a lock shared by every thread).
            let id = self.id;
            instance.with_worker(|worker| worker.forget(id));
        }
        let mut usage = match self.usage.take() {
            Some(usage) => usage,
            None => {
                let admissions = self
                    .admitted
                    .as_ref()
                    .map(|a| std::mem::take(&mut a.lock().admissions))
                    .unwrap_or_default();
                if admissions.is_empty() {
                    return;
                }
                ResponseUsage::new(instance.engine(), admissions)
            }
        };
        let now = instance.now_ms();
        for (admission, pending) in usage.on_end() {
            apply(instance, admission, pending, true, now);
        }
    }

    /// The state this request shares with the worker, made when first needed: a request
    /// admitted with nothing to settle, release or add to its response never allocates it.
    fn shared(&mut self) -> &Admitted {
        self.admitted.get_or_insert_with(Admitted::default)
    }

    /// Whether the response body can tell this request anything (its actual cost): a host
    /// may skip measuring the body's chunks for [`Stream::on_response_body`] when not.
    pub fn reads_response_body(&self) -> bool {
        self.usage.is_some()
    }

    /// Whether the request was ever paused (for a lease, a shaped turn or a local answer).
    pub fn was_held(&self) -> bool {
        self.held
    }

    /// Whether the request still waits for its decision (or was answered locally).
    fn still_held(&self) -> bool {
        self.held && !self.admitted.as_ref().is_some_and(|a| a.lock().resumed)
    }

    /// Registers this request as waiting for the leases `decision` asks for and wakes the
    /// sender; `false` (and nothing registered) when that is not possible.
    fn start_waiting(
        &mut self,
        instance: &impl Instance,
        plan: &Plan,
        decision: &Decision,
        now: u64,
    ) -> bool {
        let timeout = instance.engine().limiter().map_or(0, |l| l.timeout.0);
        let deadline = now + timeout + DEADLINE_MARGIN_MS;
        let admitted = self.shared().clone();
        let id = self.id;
        let registered = instance.with_worker(|worker| {
            let waits = worker.wait(id, plan.clone(), decision, deadline, admitted);
            if waits {
                worker.queue(decision);
            }
            waits
        });
        if registered != Some(true) {
            return false;
        }
        if instance.wake() {
            true
        } else {
            instance.with_worker(|worker| worker.forget(self.id));
            false
        }
    }

    /// Decides a plan whose costs are known, and acts on the verdict.
    fn admit(&mut self, instance: &impl Instance, host: &impl StreamHost, mut plan: Plan) -> Flow {
        let engine = instance.engine();
        let now = instance.now_ms();
        let at = StoreAt::new(instance.store(), now);
        if plan
            .enforced
            .iter()
            .any(|m| engine.policy(m.index).is_some_and(|p| p.shape.is_some()))
        {
            instance.with_worker(|worker| worker.mark_room(engine, &mut plan));
        }
        let mut decision = engine.decide(&plan, at, Attempt::default());
        if decision.verdict == Verdict::Wait && !self.start_waiting(instance, &plan, &decision, now)
        {
            // Too many requests wait already, or nobody could be woken to send the callout:
            // decide now, as if the limiter were unavailable.
            decision = engine.decide(&plan, at, Attempt::NO_WAIT);
        }
        if decision.verdict != Verdict::Wait
            && (!decision.needs.is_empty() || !decision.returns.is_empty())
        {
            // Background refills, probes and returns this decision asks for.
            if instance.with_worker(|worker| worker.queue(&decision)) == Some(true) {
                instance.wake();
            }
        }
        // A waiting request's outcomes are counted when it ends; its first decision's
        // housekeeping (expired leases) now.
        instance.metrics().record(&decision);
        match decision.verdict {
            Verdict::Wait => {
                self.held = true;
                Flow::Pause
            }
            Verdict::Reply(reply) => self.reply(host, &reply),
            Verdict::Continue => {
                for (name, value) in &decision.request_headers {
                    host.set_request_header(name, Some(value));
                }
                if self.admitted.is_some()
                    || !decision.response_headers.is_empty()
                    || !decision.admissions.is_empty()
                {
                    let mut admitted = self.shared().lock();
                    admitted.response_headers = decision.response_headers;
                    admitted.admissions = decision.admissions;
                }
                if decision.delay_ms > 0 {
                    // A shaped request: its turn comes later; the worker's tick resumes it.
                    let shaped = shaped_ids(engine, &plan);
                    let worker_host = instance.worker_host();
                    let admitted = self.shared().clone();
                    let id = self.id;
                    let slept = instance.with_worker(|worker| {
                        worker.sleep(id, now + decision.delay_ms, shaped, admitted, &worker_host)
                    });
                    if slept == Some(true) {
                        self.held = true;
                        return Flow::Pause;
                    }
                    // No room to pause it: refused rather than sent before its turn (its cost
                    // stays taken: under-use, never a burst past the rate).
                    let reply = no_room_reply(engine, &decision.delayed, decision.delay_ms);
                    return self.reply(host, &reply);
                }
                Flow::Continue
            }
        }
    }

    fn reply(&mut self, host: &impl StreamHost, reply: &LocalReply) -> Flow {
        if host.send_reply(reply) {
            self.held = true;
            Flow::Pause
        } else {
            Flow::Continue
        }
    }
}

/// Applies what the response said about some admissions.
fn settle(instance: &impl Instance, known: Vec<(&Admission, Usage)>) {
    let now = instance.now_ms();
    for (admission, usage) in known {
        apply(instance, admission, Some(usage), false, now);
    }
}

fn apply(
    instance: &impl Instance,
    admission: &Admission,
    usage: Option<Usage>,
    release: bool,
    now: u64,
) {
    let engine = instance.engine();
    match engine.finish(
        StoreAt::new(instance.store(), now),
        admission,
        usage,
        release,
    ) {
        Ok(done) => {
            instance.metrics().finished(admission.policy, &done);
            let global = engine
                .policy(admission.policy)
                .is_some_and(|p| p.scope.uses_limiter());
            if let (Some(units), true) = (done.settled, global) {
                instance.with_worker(|worker| worker.note_settled(admission.policy, units));
            }
        }
        Err(error) => log::warn!("cannot settle a request (table {error:?})"),
    }
}

/// A header value as text, borrowed when it is valid UTF-8 (absent: empty).
fn request_text(value: Option<&[u8]>) -> Cow<'_, str> {
    let value = value.unwrap_or_default();
    // Valid text (every request line a client can route with) is checked once and borrowed;
    // the lossy copy is only for what is not.
    match std::str::from_utf8(value) {
        Ok(text) => Cow::Borrowed(text),
        Err(_) => String::from_utf8_lossy(value),
    }
}

#[cfg(test)]
mod tests;
