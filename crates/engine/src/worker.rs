//! Per-worker bookkeeping of the global stage, owned by the root context (callouts must
//! outlive the request that caused them: Envoy cancels a request's own callouts when its
//! stream ends, which would lose granted tokens).
//!
//! HTTP contexts queue lease needs and register themselves as waiters, then wake the root
//! through the worker's shared queue; the root dispatches the needs of a wake-up in one batch
//! (one request per key: the shared record lets only one request of the instance ask for a key
//! at a time), credits answers to the shared table, and decides every waiter again — resuming
//! it, answering it, or letting it wait for another round. A callout that gets no answer is
//! retried once under the same lease ids before its keys take the failure mode. A tick
//! enforces the filter's own deadline, so no request waits longer than the limiter timeout plus
//! a small margin whatever the network does, and looks again at requests waiting for an answer
//! another worker asked for.
//!
//! Leases this worker credited are watched for expiry: the tick takes an expired lease's
//! unspent tokens out of its record and returns them, whatever the traffic (a key that gets no
//! more requests would otherwise keep them until its record is evicted). Taking them out is
//! one CAS transaction on the record, so exactly one taker (this tick, another worker's, or a
//! request of the key that finds the lease expired) returns a given lease.

use crate::engine::{Admission, Attempt, Decision, Engine, LeaseNeed, Plan, ReturnNeed, Verdict};
use crate::global::{self, CalloutError, DEADLINE_MARGIN_MS};
use crate::metrics::{LeaseEvent, Metrics};
use crate::shared::SharedData;
use crate::table::{TableError, Txn};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tollgate_core::protocol::{
    ErrorCode, LeaseRequest, LeaseResult, LeaseReturn, ReturnResult, LEASES_PATH, MAX_BATCH,
    RETURNS_PATH,
};
use tollgate_core::response::LocalReply;

/// Tick period while requests wait (the deadline's resolution).
pub const TICK_MS: u64 = 5;
/// Most requests one worker keeps waiting; beyond it a request is decided as if the limiter
/// were unavailable (bounded memory whatever the load).
pub const MAX_WAITERS: usize = 10_000;
/// Most requests waiting for another worker's answer that one tick decides again.
pub const MAX_POLLED_PER_TICK: usize = 512;
/// Tick period while nobody waits but leases this worker credited are outstanding: an
/// expired lease's unspent tokens go back to the limiter within about this long of its expiry
/// (plus the return callout), whether or not its key gets another request.
pub const RETURN_TICK_MS: u64 = 100;
/// Most expired leases one tick takes back (bounded work per tick; the rest go next tick).
pub const MAX_RETURNS_PER_TICK: usize = 256;
/// Most keys one worker watches for lease expiry (bounded memory); beyond it, a key's expired
/// lease is returned by its next request, as before.
pub const MAX_WATCHED: usize = 65_536;
/// Rounds of dispatching in one flush (a failed dispatch decides its waiters, which may queue
/// a probe: bounded, never a loop without end).
const MAX_FLUSH_ROUNDS: usize = 4;

/// What the worker needs from the host (proxy-wasm in production, a fake in unit tests).
pub trait Host {
    /// Sends `body` to the limiter; returns the callout token.
    fn dispatch(&self, path: &str, body: &[u8], timeout_ms: u64) -> Result<u32, String>;
    /// Lets a paused request go on to the upstream, with `request_headers` set on it first
    /// (tag headers: the route is chosen again); `false` if it is gone.
    fn resume(&self, context_id: u32, request_headers: &[(String, String)]) -> bool;
    /// Answers a paused request; `false` if it is gone.
    fn reply(&self, context_id: u32, reply: &LocalReply) -> bool;
    /// Sets the root's tick period (0: off).
    fn set_tick(&self, period_ms: u64);
}

/// Everything a root-context event hands the worker: the engine, the shared table, metrics,
/// the host and the time of the event.
pub struct Ctx<'a, S: SharedData, H: Host> {
    pub engine: &'a Engine,
    pub store: &'a S,
    pub metrics: &'a Metrics,
    pub host: &'a H,
    pub now_ms: u64,
}

/// What an admitted request carries to its response: headers to add, and the admissions its
/// stream end settles and releases. Filled in when the request is admitted (by the worker, for
/// a request that waited).
#[derive(Debug, Default)]
pub struct AdmittedState {
    pub response_headers: Vec<(String, String)>,
    /// Request headers to set when a request the worker holds is resumed (tags).
    pub request_headers: Vec<(String, String)>,
    pub admissions: Vec<Admission>,
    /// A request that waited was let go on (so its body may follow it now).
    pub resumed: bool,
}

/// The state an admitted request shares with the worker that may resume it. A mutex, not a
/// `RefCell`: the native build's worker is shared by Envoy's threads (in the wasm build the lock
/// is never contended).
#[derive(Debug, Clone, Default)]
pub struct Admitted(Arc<Mutex<AdmittedState>>);

impl Admitted {
    /// The state (a lock poisoned by a panic elsewhere still holds usable data).
    pub fn lock(&self) -> MutexGuard<'_, AdmittedState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A shaped request waiting for its turn.
struct Sleeper {
    wake_at_ms: u64,
    /// The shaped policies' bucket ids (the per-key bound counts these).
    bucket_ids: Vec<String>,
    admitted: Admitted,
}

struct Waiter {
    plan: Plan,
    deadline_ms: u64,
    round: u32,
    waiting_for: Vec<String>,
    admitted: Admitted,
}

/// One lease request of a callout.
#[derive(Debug, Clone)]
struct Asked {
    need: LeaseNeed,
    seq: u64,
    id: String,
    /// This is already the retry under the same id.
    retried: bool,
    /// The id is asked for the first time, or retried at once; `false` for an id reused long
    /// after its answer was lost (its share, if any, is not started: see `apply_grant`).
    fresh: bool,
}

/// A key whose lease this worker credited: when it expires, and what its return names.
struct Watched {
    at_ms: u64,
    policy: usize,
    key: String,
}

enum Callout {
    Leases {
        items: Vec<Asked>,
        sent_ms: u64,
    },
    Returns {
        items: Vec<ReturnNeed>,
        sent_ms: u64,
    },
}

/// One worker's global-stage state.
pub struct Worker {
    instance: u64,
    /// This instance's name towards the limiter (assignments are per holder).
    holder: String,
    next_seq: u64,
    queued: Vec<LeaseNeed>,
    queued_returns: Vec<ReturnNeed>,
    /// Bucket ids with a callout in flight on this worker.
    inflight: HashSet<String>,
    /// Lease requests whose outcome is unknown (no answer even after the retry: the limiter
    /// may have applied them), by bucket id: the next request for that key reuses the id, so
    /// the limiter's dedup record hands over what it granted then and no grant is lost.
    unsettled: HashMap<String, (u64, String)>,
    callouts: HashMap<u32, Callout>,
    waiters: HashMap<u32, Waiter>,
    /// Shaped requests paused until their turn, by context.
    sleepers: HashMap<u32, Sleeper>,
    /// Keys whose lease this worker credited, by expiry (`watched` says when each is due).
    expiring: BTreeSet<(u64, String)>,
    watched: HashMap<String, Watched>,
    /// The tick period asked of the host (0: off).
    tick_ms: u64,
    /// Units of finished requests per policy (index), not yet reported to the limiter: they
    /// go with the next lease or return callout.
    settled: Vec<u64>,
}

impl Worker {
    /// `instance` makes lease ids unique across Envoy instances, `worker` across workers.
    pub fn new(instance: u64, worker: u64) -> Self {
        Self {
            instance,
            holder: format!("{instance:016x}"),
            next_seq: worker << 40,
            queued: Vec::new(),
            queued_returns: Vec::new(),
            inflight: HashSet::new(),
            unsettled: HashMap::new(),
            callouts: HashMap::new(),
            waiters: HashMap::new(),
            sleepers: HashMap::new(),
            expiring: BTreeSet::new(),
            watched: HashMap::new(),
            tick_ms: 0,
            settled: Vec::new(),
        }
    }

    /// The settled units to report with a callout, by policy name (global policies only: the
    /// limiter owns their budgets); the counts start again from zero.
    fn take_settled(&mut self, engine: &Engine) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for (index, units) in self.settled.iter_mut().enumerate() {
            if let (Some(policy), 1..) = (engine.policy(index), *units) {
                if policy.scope.uses_limiter() {
                    out.insert(policy.name.clone(), std::mem::take(units));
                }
            }
        }
        out
    }

    /// Settled units a callout that could not be sent did not report: they go with the next.
    fn restore_settled(&mut self, engine: &Engine, settled: BTreeMap<String, u64>) {
        for (name, units) in settled {
            if let Some(index) = engine.policies.policies.iter().position(|p| p.name == name) {
                self.note_settled(index, units);
            }
        }
    }

    /// Counts the settled units of a finished request, to be reported to the limiter.
    pub fn note_settled(&mut self, policy: usize, units: u64) {
        if self.settled.len() <= policy {
            self.settled.resize(policy + 1, 0);
        }
        if let Some(total) = self.settled.get_mut(policy) {
            *total = total.saturating_add(units);
        }
    }

    /// Queues the lease needs and returns of a decision; `true` when the root must be woken.
    pub fn queue(&mut self, decision: &Decision) -> bool {
        self.queued.extend(decision.needs.iter().cloned());
        self.queued_returns.extend(decision.returns.iter().cloned());
        !decision.needs.is_empty() || !decision.returns.is_empty()
    }

    /// Registers a request that waits for its leases. `false` when too many already wait.
    pub fn wait(
        &mut self,
        context_id: u32,
        plan: Plan,
        decision: &Decision,
        deadline_ms: u64,
        admitted: Admitted,
    ) -> bool {
        if self.waiters.len() >= MAX_WAITERS {
            return false;
        }
        self.waiters.insert(
            context_id,
            Waiter {
                plan,
                deadline_ms,
                round: 0,
                waiting_for: decision.waiting_for.clone(),
                admitted,
            },
        );
        true
    }

    /// A request ended (answered, reset or done): forget it.
    pub fn forget(&mut self, context_id: u32) {
        self.waiters.remove(&context_id);
        self.sleepers.remove(&context_id);
    }

    /// Whether the worker will resume or answer this request (it waits or sleeps).
    pub fn holds(&self, context_id: u32) -> bool {
        self.waiters.contains_key(&context_id) || self.sleepers.contains_key(&context_id)
    }

    /// Shaped requests of `bucket_id` waiting for their turn on this worker.
    pub fn sleeping(&self, bucket_id: &str) -> usize {
        self.sleepers
            .values()
            .filter(|s| s.bucket_ids.iter().any(|b| b == bucket_id))
            .count()
    }

    /// Pauses an admitted, shaped request until `wake_at_ms` (the root's tick resumes it);
    /// `false` when too many requests are paused already.
    pub fn sleep(
        &mut self,
        context_id: u32,
        wake_at_ms: u64,
        bucket_ids: Vec<String>,
        admitted: Admitted,
        host: &impl Host,
    ) -> bool {
        if self.sleepers.len() + self.waiters.len() >= MAX_WAITERS {
            return false;
        }
        self.sleepers.insert(
            context_id,
            Sleeper {
                wake_at_ms,
                bucket_ids,
                admitted,
            },
        );
        self.update_tick(host);
        true
    }

    /// The plan's shaped policies may delay only while the worker has room for one more
    /// waiting request of their key.
    pub fn mark_room(&self, engine: &Engine, plan: &mut Plan) {
        for m in plan.enforced.iter_mut() {
            if let Some(shape) = engine.policy(m.index).and_then(|p| p.shape) {
                m.may_wait = self.sleeping(&m.bucket_id) < shape.max_waiting as usize;
            }
        }
    }

    /// Resumes the shaped requests whose turn has come, earliest first.
    fn wake_sleepers(&mut self, host: &impl Host, now_ms: u64) {
        let mut due: Vec<(u64, u32)> = self
            .sleepers
            .iter()
            .filter(|(_, s)| s.wake_at_ms <= now_ms)
            .map(|(id, s)| (s.wake_at_ms, *id))
            .collect();
        due.sort_unstable();
        for (_, context_id) in due {
            if let Some(sleeper) = self.sleepers.remove(&context_id) {
                let request_headers = {
                    let mut admitted = sleeper.admitted.lock();
                    admitted.resumed = true;
                    std::mem::take(&mut admitted.request_headers)
                };
                host.resume(context_id, &request_headers);
            }
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    pub fn in_flight(&self) -> usize {
        self.callouts.len()
    }

    /// Dispatches what was queued (root context). A dispatch that fails decides its waiters
    /// again, which may queue more (a probe): dispatched in the next round, a bounded number.
    pub fn flush<S: SharedData, H: Host>(&mut self, ctx: &Ctx<'_, S, H>) {
        if ctx.engine.limiter().is_none() {
            self.queued.clear();
            self.queued_returns.clear();
            return;
        }
        for _ in 0..MAX_FLUSH_ROUNDS {
            let batch = self.take_queued();
            let mut failed = Vec::new();
            for chunk in chunks(batch) {
                failed.extend(self.send_leases(chunk, ctx, true));
            }
            self.send_returns(ctx);
            if failed.is_empty() {
                break;
            }
            self.resolve(ctx, &failed);
            if self.queued.is_empty() {
                break;
            }
        }
        self.update_tick(ctx.host);
    }

    /// The queued needs as lease requests: one per key (covering the biggest single request and
    /// everyone waiting on this worker), none for a key already in flight here.
    fn take_queued(&mut self) -> Vec<Asked> {
        let mut batch: Vec<Asked> = Vec::new();
        for need in std::mem::take(&mut self.queued) {
            if self.inflight.contains(&need.bucket_id) {
                continue;
            }
            if let Some(queued) = batch
                .iter_mut()
                .find(|a| a.need.bucket_id == need.bucket_id)
            {
                queued.need.min = queued.need.min.max(need.min);
                queued.need.want = queued.need.want.max(need.want);
                queued.need.demand_per_s = queued.need.demand_per_s.max(need.demand_per_s);
                queued.need.blocking |= need.blocking;
                continue;
            }
            let (seq, id, fresh) = match self.unsettled.get(&need.bucket_id) {
                Some((seq, id)) => (*seq, id.clone(), false),
                None => {
                    self.next_seq += 1;
                    (
                        self.next_seq,
                        global::lease_id(self.instance, self.next_seq),
                        true,
                    )
                }
            };
            batch.push(Asked {
                need,
                seq,
                id,
                retried: false,
                fresh,
            });
        }
        for asked in batch.iter_mut() {
            // Every request waiting for this key on this worker is served by this one callout,
            // so it asks for at least their total cost (real demand, not a speculative batch:
            // `lease_max` does not cap it; the limiter caps it at the burst).
            let need = &mut asked.need;
            need.want = need
                .want
                .max(self.waiting_demand(&need.bucket_id))
                .max(need.min);
        }
        batch
    }

    /// Sends one batch of lease requests; returns the bucket ids whose callout could not even
    /// be sent (already marked unavailable). `for_waiters`: the callout may not outlive the
    /// requests waiting for it (a retry, made for the key's sake, takes the full timeout).
    fn send_leases<S: SharedData, H: Host>(
        &mut self,
        chunk: Vec<Asked>,
        ctx: &Ctx<'_, S, H>,
        for_waiters: bool,
    ) -> Vec<String> {
        if chunk.is_empty() {
            return Vec::new();
        }
        let Some(settings) = ctx.engine.limiter() else {
            return Vec::new();
        };
        let requests: Vec<LeaseRequest> = chunk
            .iter()
            .filter_map(|a| {
                let policy = ctx.engine.policy(a.need.policy)?;
                let demand = a.need.demand_per_s;
                Some(LeaseRequest {
                    id: a.id.clone(),
                    policy: policy.name.clone(),
                    key: a.need.key.clone(),
                    min: a.need.min,
                    want: a.need.want,
                    group: None,
                    holder: Some(self.holder.clone()),
                    demand_per_s: (demand.is_finite() && demand >= 0.0).then_some(demand),
                })
            })
            .collect();
        for a in &chunk {
            ctx.metrics.lease(a.need.policy, LeaseEvent::Requested);
        }
        let timeout = if for_waiters {
            self.callout_timeout(&chunk, settings.timeout.0, ctx.now_ms)
        } else {
            settings.timeout.0
        };
        // Only a batch of first-time ids carries settled units: the limiter does not count a
        // batch it has answered before (a retry), so new units must not ride on one.
        let settled = if chunk.iter().all(|a| a.fresh && !a.retried) {
            self.take_settled(ctx.engine)
        } else {
            BTreeMap::new()
        };
        match ctx.host.dispatch(
            LEASES_PATH,
            &global::lease_body(requests, settled.clone()),
            timeout,
        ) {
            Ok(token) => {
                for a in &chunk {
                    self.inflight.insert(a.need.bucket_id.clone());
                }
                self.callouts.insert(
                    token,
                    Callout::Leases {
                        items: chunk,
                        sent_ms: ctx.now_ms,
                    },
                );
                Vec::new()
            }
            Err(reason) => {
                log::warn!("lease callout not sent: {reason}");
                self.restore_settled(ctx.engine, settled);
                ctx.metrics.callout(0, true);
                self.fail_leases(ctx, &chunk);
                chunk.into_iter().map(|a| a.need.bucket_id).collect()
            }
        }
    }

    fn send_returns<S: SharedData, H: Host>(&mut self, ctx: &Ctx<'_, S, H>) {
        let Some(settings) = ctx.engine.limiter() else {
            return;
        };
        let returns = std::mem::take(&mut self.queued_returns);
        for chunk in returns.chunks(MAX_BATCH) {
            let items: Vec<LeaseReturn> = chunk
                .iter()
                .filter_map(|r| {
                    let policy = ctx.engine.policy(r.policy)?;
                    Some(LeaseReturn {
                        id: global::lease_id(self.instance, r.seq),
                        policy: policy.name.clone(),
                        key: r.key.clone(),
                        unused: r.unused,
                    })
                })
                .collect();
            let settled = self.take_settled(ctx.engine);
            match ctx.host.dispatch(
                RETURNS_PATH,
                &global::return_body(items, settled.clone()),
                settings.timeout.0,
            ) {
                Ok(token) => {
                    self.callouts.insert(
                        token,
                        Callout::Returns {
                            items: chunk.to_vec(),
                            sent_ms: ctx.now_ms,
                        },
                    );
                }
                Err(_) => {
                    self.restore_settled(ctx.engine, settled);
                    for r in chunk {
                        ctx.metrics.lease(r.policy, LeaseEvent::Expired(r.unused));
                    }
                }
            }
        }
    }

    /// Total cost of the requests on this worker waiting for `bucket_id`'s lease.
    fn waiting_demand(&self, bucket_id: &str) -> u64 {
        self.waiters
            .values()
            .filter(|w| w.waiting_for.iter().any(|b| b == bucket_id))
            .flat_map(|w| w.plan.enforced.iter().filter(|m| m.bucket_id == bucket_id))
            .map(|m| m.cost)
            .sum()
    }

    /// A blocking callout may not outlive the earliest deadline of the requests waiting for it.
    fn callout_timeout(&self, chunk: &[Asked], timeout_ms: u64, now_ms: u64) -> u64 {
        let earliest = self
            .waiters
            .values()
            .filter(|w| {
                w.waiting_for
                    .iter()
                    .any(|b| chunk.iter().any(|a| &a.need.bucket_id == b))
            })
            .map(|w| w.deadline_ms.saturating_sub(DEADLINE_MARGIN_MS))
            .min();
        match earliest {
            Some(deadline) => deadline.saturating_sub(now_ms).clamp(1, timeout_ms),
            None => timeout_ms,
        }
    }

    fn fail_leases<S: SharedData, H: Host>(&mut self, ctx: &Ctx<'_, S, H>, items: &[Asked]) {
        for a in items {
            ctx.metrics.lease(a.need.policy, LeaseEvent::Unavailable);
            if let Err(error) = ctx.engine.mark_unavailable(ctx.store, &a.need, ctx.now_ms) {
                log::warn!("cannot record limiter outage for a key: {error:?}");
            }
            self.inflight.remove(&a.need.bucket_id);
        }
    }

    /// A callout answered (`status` None: reset / no response).
    pub fn complete<S: SharedData, H: Host>(
        &mut self,
        token: u32,
        status: Option<u32>,
        body: &[u8],
        ctx: &Ctx<'_, S, H>,
    ) {
        match self.callouts.remove(&token) {
            Some(Callout::Leases { items, sent_ms }) => {
                let elapsed = ctx.now_ms.saturating_sub(sent_ms);
                // Keys answered (or given up) this time: their waiters are decided again.
                let (mut affected, unanswered) = match global::parse_lease_response(status, body) {
                    Ok(answer) => {
                        ctx.metrics.callout(elapsed, false);
                        if answer.policy_version != ctx.engine.policies.version {
                            ctx.metrics.version_mismatch();
                        }
                        self.credit(ctx, items, &answer.leases)
                    }
                    Err(error) => {
                        ctx.metrics.callout(elapsed, true);
                        log_failure(&error);
                        (Vec::new(), items)
                    }
                };
                let (retry, give_up): (Vec<Asked>, Vec<Asked>) =
                    unanswered.into_iter().partition(|a| !a.retried);
                if !give_up.is_empty() {
                    self.unsettle(&give_up);
                    self.fail_leases(ctx, &give_up);
                    affected.extend(give_up.into_iter().map(|a| a.need.bucket_id));
                }
                affected.extend(self.retry(ctx, retry));
                self.resolve(ctx, &affected);
                self.flush(ctx);
            }
            Some(Callout::Returns { items, sent_ms }) => {
                let elapsed = ctx.now_ms.saturating_sub(sent_ms);
                match global::parse_return_response(status, body) {
                    Ok(answer) => {
                        ctx.metrics.callout(elapsed, false);
                        for (item, result) in items.iter().zip(&answer.returns) {
                            let returned = match result {
                                ReturnResult::Returned { returned, .. } => *returned,
                                ReturnResult::Error(_) => 0,
                            };
                            ctx.metrics
                                .lease(item.policy, LeaseEvent::Returned(returned));
                            ctx.metrics.lease(
                                item.policy,
                                LeaseEvent::Expired(item.unused.saturating_sub(returned)),
                            );
                        }
                    }
                    Err(error) => {
                        ctx.metrics.callout(elapsed, true);
                        log_failure(&error);
                        for item in &items {
                            ctx.metrics
                                .lease(item.policy, LeaseEvent::Expired(item.unused));
                        }
                    }
                }
            }
            None => {}
        }
        self.update_tick(ctx.host);
    }

    /// Asks once more, under the same ids, for what got no answer (the key stays marked as
    /// asking, so no other request of this instance asks meanwhile). Returns the bucket ids
    /// that could not be retried (sent to the failure mode).
    fn retry<S: SharedData, H: Host>(
        &mut self,
        ctx: &Ctx<'_, S, H>,
        items: Vec<Asked>,
    ) -> Vec<String> {
        if items.is_empty() {
            return Vec::new();
        }
        let items: Vec<Asked> = items
            .into_iter()
            .map(|mut a| {
                a.retried = true;
                self.inflight.remove(&a.need.bucket_id);
                if let Err(error) = ctx.engine.refresh_pending(ctx.store, &a.need, ctx.now_ms) {
                    log::debug!("cannot mark a key as asking: {error:?}");
                }
                a
            })
            .collect();
        ctx.metrics.callout_retried(items.len());
        let mut failed = Vec::new();
        for chunk in chunks(items) {
            failed.extend(self.send_leases(chunk, ctx, false));
        }
        failed
    }

    /// Credits the answers of one callout; returns the bucket ids answered and the items that
    /// got no usable answer.
    fn credit<S: SharedData, H: Host>(
        &mut self,
        ctx: &Ctx<'_, S, H>,
        items: Vec<Asked>,
        results: &[LeaseResult],
    ) -> (Vec<String>, Vec<Asked>) {
        let mut answered = Vec::new();
        let mut unanswered = Vec::new();
        for a in items {
            let result = results.iter().find(|r| match r {
                LeaseResult::Granted(g) => g.id == a.id,
                LeaseResult::Error(e) => e.id == a.id,
            });
            let need = &a.need;
            match result {
                Some(LeaseResult::Granted(grant)) => {
                    self.inflight.remove(&need.bucket_id);
                    self.unsettled.remove(&need.bucket_id);
                    answered.push(need.bucket_id.clone());
                    ctx.metrics
                        .lease(need.policy, LeaseEvent::Granted(grant.granted));
                    if a.fresh && grant.share_per_s > 0.0 {
                        ctx.metrics.lease(need.policy, LeaseEvent::Assigned);
                    }
                    match ctx
                        .engine
                        .credit(ctx.store, need, grant, a.seq, ctx.now_ms, a.fresh)
                    {
                        Ok(displaced) if grant.granted > 0 || grant.share_per_s > 0.0 => {
                            self.queued_returns.extend(displaced);
                            let at_ms = ctx.now_ms.saturating_add(grant.expires_ms);
                            self.watch(need.policy, &need.key, &need.bucket_id, at_ms);
                        }
                        Ok(displaced) => self.queued_returns.extend(displaced),
                        Err(error) => {
                            log::warn!("granted tokens lost (table {error:?})");
                            ctx.metrics
                                .lease(need.policy, LeaseEvent::Expired(grant.granted));
                        }
                    }
                }
                Some(LeaseResult::Error(error)) if error.error != ErrorCode::Unavailable => {
                    self.inflight.remove(&need.bucket_id);
                    self.unsettled.remove(&need.bucket_id);
                    answered.push(need.bucket_id.clone());
                    if error.error == ErrorCode::InvalidPolicy {
                        ctx.metrics.lease(need.policy, LeaseEvent::InvalidPolicy);
                        log::warn!(
                            "limiter refused policy: {} ({})",
                            error.error.as_str(),
                            error.reason.as_deref().unwrap_or("")
                        );
                    }
                    ctx.metrics.lease(need.policy, LeaseEvent::Unavailable);
                    let _ = ctx.engine.mark_unavailable(ctx.store, need, ctx.now_ms);
                }
                _ => unanswered.push(a),
            }
        }
        (answered, unanswered)
    }

    /// Remembers lease requests whose outcome is unknown, to be asked again under the same id.
    fn unsettle(&mut self, items: &[Asked]) {
        for a in items {
            if self.unsettled.len() < MAX_WAITERS || self.unsettled.contains_key(&a.need.bucket_id)
            {
                self.unsettled
                    .insert(a.need.bucket_id.clone(), (a.seq, a.id.clone()));
            }
        }
    }

    /// Decides again every request waiting for one of `affected` (what they queue is sent by
    /// the caller's flush).
    fn resolve<S: SharedData, H: Host>(&mut self, ctx: &Ctx<'_, S, H>, affected: &[String]) {
        if affected.is_empty() {
            return;
        }
        let ready: Vec<u32> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.waiting_for.iter().any(|b| affected.contains(b)))
            .map(|(id, _)| *id)
            .collect();
        for context_id in ready {
            self.decide_waiter(context_id, ctx, false);
        }
    }

    /// Decides a waiting request again.
    fn decide_waiter<S: SharedData, H: Host>(
        &mut self,
        context_id: u32,
        ctx: &Ctx<'_, S, H>,
        deadline_passed: bool,
    ) {
        let Some(mut waiter) = self.waiters.remove(&context_id) else {
            return;
        };
        let attempt = Attempt {
            round: waiter.round + 1,
            deadline_passed,
        };
        let decision = ctx
            .engine
            .decide(&waiter.plan, ctx.store, ctx.now_ms, attempt);
        self.queue(&decision);
        match &decision.verdict {
            Verdict::Wait => {
                waiter.round += 1;
                waiter.waiting_for = decision.waiting_for.clone();
                self.waiters.insert(context_id, waiter);
            }
            Verdict::Continue => {
                ctx.metrics.record(&decision);
                {
                    let mut admitted = waiter.admitted.lock();
                    admitted.response_headers = decision.response_headers.clone();
                    admitted.admissions = decision.admissions.clone();
                    admitted.resumed = true;
                    if decision.delay_ms > 0 {
                        // Set when its turn comes.
                        admitted.request_headers = decision.request_headers.clone();
                    }
                }
                let shaped = shaped_ids(ctx.engine, &waiter.plan);
                if decision.delay_ms == 0 {
                    ctx.host.resume(context_id, &decision.request_headers);
                } else if !self.sleep(
                    context_id,
                    ctx.now_ms + decision.delay_ms,
                    shaped,
                    waiter.admitted.clone(),
                    ctx.host,
                ) {
                    // No room to pause it: refused rather than sent before its turn.
                    let reply = no_room_reply(ctx.engine, &decision.delayed, decision.delay_ms);
                    ctx.host.reply(context_id, &reply);
                }
            }
            Verdict::Reply(reply) => {
                ctx.metrics.record(&decision);
                ctx.host.reply(context_id, reply);
            }
        }
    }

    /// The root tick: waiting requests past the filter's own deadline take the failure mode;
    /// requests waiting for an answer another worker asked for are decided again (that answer
    /// lands in the shared table, not on this worker).
    pub fn tick<S: SharedData, H: Host>(&mut self, ctx: &Ctx<'_, S, H>) {
        self.wake_sleepers(ctx.host, ctx.now_ms);
        let late: Vec<u32> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.deadline_ms <= ctx.now_ms)
            .map(|(id, _)| *id)
            .collect();
        for context_id in late {
            ctx.metrics.deadline_passed();
            self.decide_waiter(context_id, ctx, true);
        }
        let elsewhere: Vec<u32> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.waiting_for.iter().any(|b| !self.inflight.contains(b)))
            .map(|(id, _)| *id)
            .take(MAX_POLLED_PER_TICK)
            .collect();
        for context_id in elsewhere {
            self.decide_waiter(context_id, ctx, false);
        }
        self.take_expired(ctx);
        self.flush(ctx);
        self.update_tick(ctx.host);
    }

    /// Watches `bucket_id`'s lease, credited here, for its expiry at `at_ms` (a later credit
    /// of the key moves it: the record's lease expires with its latest grant).
    fn watch(&mut self, policy: usize, key: &str, bucket_id: &str, at_ms: u64) {
        let room = self.watched.len() < MAX_WATCHED;
        match self.watched.get_mut(bucket_id) {
            Some(watched) => {
                self.expiring
                    .remove(&(watched.at_ms, bucket_id.to_string()));
                // The earlier time: a lease found live then is watched again until the
                // expiry its record says (a windowed lease may end before `at_ms`).
                watched.at_ms = watched.at_ms.min(at_ms);
                watched.policy = policy;
            }
            None if room => {
                self.watched.insert(
                    bucket_id.to_string(),
                    Watched {
                        at_ms,
                        policy,
                        key: key.to_string(),
                    },
                );
            }
            None => return,
        }
        if let Some(watched) = self.watched.get(bucket_id) {
            self.expiring.insert((watched.at_ms, bucket_id.to_string()));
        }
    }

    /// Keys whose lease this worker watches for expiry.
    pub fn watching(&self) -> usize {
        self.watched.len()
    }

    /// Takes the unspent tokens of watched leases that have expired out of their records and
    /// queues their return (at most [`MAX_RETURNS_PER_TICK`] keys; the rest next tick). A
    /// lease that another answer has renewed meanwhile is watched again until its new expiry.
    fn take_expired<S: SharedData, H: Host>(&mut self, ctx: &Ctx<'_, S, H>) {
        for _ in 0..MAX_RETURNS_PER_TICK {
            let Some((at_ms, bucket_id)) = self.expiring.first().cloned() else {
                break;
            };
            if at_ms > ctx.now_ms {
                break;
            }
            self.expiring.remove(&(at_ms, bucket_id.clone()));
            let Some(watched) = self.watched.remove(&bucket_id) else {
                continue;
            };
            match take_expired(ctx.engine, ctx.store, &bucket_id, ctx.now_ms) {
                Ok(LeaseExpiry::Taken { expiry, live_until }) => {
                    self.queued_returns.extend(ReturnNeed::of_expiry(
                        watched.policy,
                        &watched.key,
                        &expiry,
                    ));
                    if expiry.expired > 0 {
                        ctx.metrics
                            .lease(watched.policy, LeaseEvent::Expired(expiry.expired));
                    }
                    if let Some(until_ms) = live_until {
                        self.watch(watched.policy, &watched.key, &bucket_id, until_ms);
                    }
                }
                Ok(LeaseExpiry::Live(until_ms)) => {
                    self.watch(watched.policy, &watched.key, &bucket_id, until_ms);
                }
                Ok(LeaseExpiry::Empty) => {}
                Err(TableError::Contended) => {
                    // Requests of the key keep winning the record: look again next tick.
                    let again = ctx.now_ms.saturating_add(RETURN_TICK_MS);
                    self.watch(watched.policy, &watched.key, &bucket_id, again);
                }
                Err(error) => log::debug!("cannot look at an expired lease: {error:?}"),
            }
        }
    }

    /// The tick the worker needs: fast while requests wait or sleep, slow while leases it
    /// credited may still expire with tokens left, else none.
    fn update_tick(&mut self, host: &impl Host) {
        let want = if !self.waiters.is_empty() || !self.sleepers.is_empty() {
            TICK_MS
        } else if !self.expiring.is_empty() {
            RETURN_TICK_MS
        } else {
            0
        };
        if want != self.tick_ms {
            host.set_tick(want);
            self.tick_ms = want;
        }
    }
}

/// What a key's record held when the worker looked at its lease for expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseExpiry {
    /// A lease had expired: its unspent tokens were taken out of the record (to give back
    /// under their lease ids, or counted expired). `live_until`: the latest lease runs on
    /// until then (only the previous lease had expired).
    Taken {
        expiry: global::Expiry,
        live_until: Option<u64>,
    },
    /// The lease runs until then (a later answer renewed it).
    Live(u64),
    /// Nothing left to return (spent, or taken already by a request or another worker).
    Empty,
}

/// Takes the unspent tokens of `bucket_id`'s lease out of its record if the lease has expired:
/// one CAS transaction, so of every worker and request that finds the lease expired exactly
/// one gets its tokens to return. Writes nothing otherwise (never creates a record). The
/// record's eviction time is left as it was: taking tokens out never makes it later.
fn take_expired(
    engine: &Engine,
    store: &impl SharedData,
    bucket_id: &str,
    now_ms: u64,
) -> Result<LeaseExpiry, TableError> {
    let result = engine.table().transact(
        store,
        &[bucket_id],
        now_ms,
        |records| {
            let Some(lease) = records.first_mut().map(|r| &mut r.lease) else {
                return Txn::Abort(LeaseExpiry::Empty);
            };
            global::accrue(lease, now_ms);
            let expiry = global::expire(lease, now_ms);
            let live =
                lease.expires_ms > now_ms && (lease.tokens > 0 || lease.drip_until_ms > now_ms);
            // The previous lease's expiry comes first, if it still has tokens to give back.
            let until_ms = if lease.prev_seq != 0 {
                lease.prev_expires_ms.min(lease.expires_ms)
            } else {
                lease.expires_ms
            };
            match expiry {
                Some(expiry) => Txn::Commit(LeaseExpiry::Taken {
                    expiry,
                    live_until: live.then_some(until_ms),
                }),
                None if live => Txn::Abort(LeaseExpiry::Live(until_ms)),
                None => Txn::Abort(LeaseExpiry::Empty),
            }
        },
        |_, _, _, _| {},
    )?;
    Ok(result.value)
}

/// The 429 of a shaped request the worker has no room to pause (its cost stays taken:
/// under-use, never a burst past the rate).
pub fn no_room_reply(engine: &Engine, delayed: &[usize], delay_ms: u64) -> LocalReply {
    let policy = delayed
        .first()
        .and_then(|i| engine.policy(*i))
        .map_or("", |p| p.name.as_str());
    tollgate_core::response::no_room_to_wait(policy, delay_ms)
}

/// The bucket ids of a plan's shaped policies.
pub fn shaped_ids(engine: &Engine, plan: &Plan) -> Vec<String> {
    plan.enforced
        .iter()
        .filter(|m| engine.policy(m.index).is_some_and(|p| p.shape.is_some()))
        .map(|m| m.bucket_id.clone())
        .collect()
}

/// Lease requests in batches the limiter accepts.
fn chunks(mut items: Vec<Asked>) -> Vec<Vec<Asked>> {
    let mut out = Vec::new();
    while !items.is_empty() {
        let rest = items.split_off(items.len().min(MAX_BATCH));
        out.push(std::mem::replace(&mut items, rest));
    }
    out
}

fn log_failure(error: &CalloutError) {
    log::debug!("limiter callout failed: {error:?}");
}

#[cfg(test)]
mod tests;
