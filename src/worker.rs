//! Per-worker bookkeeping of the global stage, owned by the root context (callouts must
//! outlive the request that caused them: Envoy cancels a request's own callouts when its
//! stream ends, which would lose granted tokens).
//!
//! HTTP contexts queue lease needs and register themselves as waiters, then wake the root
//! through the worker's shared queue; the root dispatches one callout per key per worker (all
//! needs of a wake-up in one batch), credits answers to the shared table, and decides every
//! waiter again — resuming it, answering it, or letting it wait for another round. A tick
//! enforces the filter's own deadline, so no request waits longer than the limiter timeout plus
//! a small margin whatever the network does.

use crate::engine::{Attempt, Decision, Engine, LeaseNeed, Plan, ReturnNeed, Verdict};
use crate::global::{self, CalloutError, DEADLINE_MARGIN_MS};
use crate::metrics::{LeaseEvent, Metrics};
use crate::shared::SharedData;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
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

/// What the worker needs from the host (proxy-wasm in production, a fake in unit tests).
pub trait Host {
    /// Sends `body` to the limiter; returns the callout token.
    fn dispatch(&self, path: &str, body: &[u8], timeout_ms: u64) -> Result<u32, String>;
    /// Lets a paused request go on to the upstream; `false` if it is gone.
    fn resume(&self, context_id: u32) -> bool;
    /// Answers a paused request; `false` if it is gone.
    fn reply(&self, context_id: u32, reply: &LocalReply) -> bool;
    /// Sets the root's tick period (0: off).
    fn set_tick(&self, period_ms: u64);
}

/// Headers an admitted request adds to its response, filled in when it is resumed.
pub type ResponseHeaders = Rc<RefCell<Vec<(String, String)>>>;

struct Waiter {
    plan: Plan,
    deadline_ms: u64,
    round: u32,
    waiting_for: Vec<String>,
    response_headers: ResponseHeaders,
}

enum Callout {
    Leases {
        items: Vec<(LeaseNeed, u64, String)>,
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
    next_seq: u64,
    queued: Vec<LeaseNeed>,
    queued_returns: Vec<ReturnNeed>,
    /// Bucket ids with a callout in flight on this worker.
    inflight: HashSet<String>,
    /// Lease requests whose outcome is unknown (timed out, reset, 503: the limiter may have
    /// applied them), by bucket id: the next request for that key reuses the id, so the
    /// limiter's dedup record answers with what it granted then and no grant is lost.
    unsettled: HashMap<String, (u64, String)>,
    callouts: HashMap<u32, Callout>,
    waiters: HashMap<u32, Waiter>,
    ticking: bool,
}

impl Worker {
    /// `instance` makes lease ids unique across Envoy instances, `worker` across workers.
    pub fn new(instance: u64, worker: u64) -> Self {
        Self {
            instance,
            next_seq: worker << 40,
            queued: Vec::new(),
            queued_returns: Vec::new(),
            inflight: HashSet::new(),
            unsettled: HashMap::new(),
            callouts: HashMap::new(),
            waiters: HashMap::new(),
            ticking: false,
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
        response_headers: ResponseHeaders,
    ) -> bool {
        if self.waiters.len() >= MAX_WAITERS {
            return false;
        }
        let waiting_for = decision
            .needs
            .iter()
            .filter(|n| n.blocking)
            .map(|n| n.bucket_id.clone())
            .collect();
        self.waiters.insert(
            context_id,
            Waiter {
                plan,
                deadline_ms,
                round: 0,
                waiting_for,
                response_headers,
            },
        );
        true
    }

    /// A request ended (answered, reset or done): forget it.
    pub fn forget(&mut self, context_id: u32) {
        self.waiters.remove(&context_id);
    }

    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    pub fn in_flight(&self) -> usize {
        self.callouts.len()
    }

    /// Dispatches what was queued (root context).
    pub fn flush(
        &mut self,
        engine: &Engine,
        store: &impl SharedData,
        metrics: &Metrics,
        host: &impl Host,
        now_ms: u64,
    ) {
        let Some(settings) = engine.limiter().cloned() else {
            self.queued.clear();
            self.queued_returns.clear();
            return;
        };
        let mut batch: Vec<(LeaseNeed, u64, String)> = Vec::new();
        for need in std::mem::take(&mut self.queued) {
            if self.inflight.contains(&need.bucket_id) {
                continue;
            }
            if let Some((queued, _, _)) = batch
                .iter_mut()
                .find(|(n, _, _)| n.bucket_id == need.bucket_id)
            {
                // One callout per key: it must cover the biggest single request.
                queued.min = queued.min.max(need.min);
                queued.want = queued.want.max(need.want);
                queued.blocking |= need.blocking;
                continue;
            }
            let (seq, id) = match self.unsettled.get(&need.bucket_id) {
                Some(unsettled) => unsettled.clone(),
                None => {
                    self.next_seq += 1;
                    (
                        self.next_seq,
                        global::lease_id(self.instance, self.next_seq),
                    )
                }
            };
            batch.push((need, seq, id));
        }
        for (need, _, _) in batch.iter_mut() {
            // Every request waiting for this key on this worker is served by this one callout,
            // so it asks for at least their total cost (real demand, not a speculative batch:
            // `lease_max` does not cap it; the limiter caps it at the burst).
            need.want = need
                .want
                .max(self.waiting_demand(&need.bucket_id))
                .max(need.min);
        }
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(MAX_BATCH));
            let chunk = std::mem::replace(&mut batch, rest);
            let requests: Vec<LeaseRequest> = chunk
                .iter()
                .filter_map(|(need, _, id)| {
                    let policy = engine.policy(need.policy)?;
                    Some(LeaseRequest {
                        id: id.clone(),
                        policy: policy.name.clone(),
                        key: need.key.clone(),
                        min: need.min,
                        want: need.want,
                        group: None,
                        holder: None,
                        demand_per_s: None,
                    })
                })
                .collect();
            for (need, _, _) in &chunk {
                metrics.lease(need.policy, LeaseEvent::Requested);
            }
            let timeout = self.callout_timeout(&chunk, settings.timeout.0, now_ms);
            match host.dispatch(LEASES_PATH, &global::lease_body(requests), timeout) {
                Ok(token) => {
                    for (need, _, _) in &chunk {
                        self.inflight.insert(need.bucket_id.clone());
                    }
                    self.callouts.insert(
                        token,
                        Callout::Leases {
                            items: chunk,
                            sent_ms: now_ms,
                        },
                    );
                }
                Err(reason) => {
                    log::warn!("tollgate: lease callout not sent: {reason}");
                    metrics.callout(0, true);
                    self.fail_leases(engine, store, metrics, &chunk, now_ms);
                    let affected: Vec<String> =
                        chunk.iter().map(|(n, _, _)| n.bucket_id.clone()).collect();
                    self.resolve(engine, store, metrics, host, &affected, now_ms);
                }
            }
        }
        let returns = std::mem::take(&mut self.queued_returns);
        for chunk in returns.chunks(MAX_BATCH) {
            let items: Vec<LeaseReturn> = chunk
                .iter()
                .filter_map(|r| {
                    let policy = engine.policy(r.policy)?;
                    Some(LeaseReturn {
                        id: global::lease_id(self.instance, r.seq),
                        policy: policy.name.clone(),
                        key: r.key.clone(),
                        unused: r.unused,
                    })
                })
                .collect();
            match host.dispatch(
                RETURNS_PATH,
                &global::return_body(items),
                settings.timeout.0,
            ) {
                Ok(token) => {
                    self.callouts.insert(
                        token,
                        Callout::Returns {
                            items: chunk.to_vec(),
                            sent_ms: now_ms,
                        },
                    );
                }
                Err(_) => {
                    for r in chunk {
                        metrics.lease(r.policy, LeaseEvent::Expired(r.unused));
                    }
                }
            }
        }
        self.update_tick(host);
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
    fn callout_timeout(
        &self,
        chunk: &[(LeaseNeed, u64, String)],
        timeout_ms: u64,
        now_ms: u64,
    ) -> u64 {
        let earliest = self
            .waiters
            .values()
            .filter(|w| {
                w.waiting_for
                    .iter()
                    .any(|b| chunk.iter().any(|(n, _, _)| &n.bucket_id == b))
            })
            .map(|w| w.deadline_ms.saturating_sub(DEADLINE_MARGIN_MS))
            .min();
        match earliest {
            Some(deadline) => deadline.saturating_sub(now_ms).clamp(1, timeout_ms),
            None => timeout_ms,
        }
    }

    fn fail_leases(
        &mut self,
        engine: &Engine,
        store: &impl SharedData,
        metrics: &Metrics,
        items: &[(LeaseNeed, u64, String)],
        now_ms: u64,
    ) {
        for (need, _, _) in items {
            metrics.lease(need.policy, LeaseEvent::Unavailable);
            if let Err(error) = engine.mark_unavailable(store, need, now_ms) {
                log::warn!("tollgate: cannot record limiter outage for a key: {error:?}");
            }
            self.inflight.remove(&need.bucket_id);
        }
    }

    /// A callout answered (`status` None: reset / no response).
    #[allow(clippy::too_many_arguments)]
    pub fn complete(
        &mut self,
        token: u32,
        status: Option<u32>,
        body: &[u8],
        engine: &Engine,
        store: &impl SharedData,
        metrics: &Metrics,
        host: &impl Host,
        now_ms: u64,
    ) {
        match self.callouts.remove(&token) {
            Some(Callout::Leases { items, sent_ms }) => {
                let affected: Vec<String> =
                    items.iter().map(|(n, _, _)| n.bucket_id.clone()).collect();
                match global::parse_lease_response(status, body) {
                    Ok(answer) => {
                        metrics.callout(now_ms.saturating_sub(sent_ms), false);
                        if answer.policy_version != engine.policies.version {
                            metrics.version_mismatch();
                        }
                        self.credit(engine, store, metrics, &items, &answer.leases, now_ms);
                    }
                    Err(error) => {
                        metrics.callout(now_ms.saturating_sub(sent_ms), true);
                        log_failure(&error);
                        self.unsettle(&items);
                        self.fail_leases(engine, store, metrics, &items, now_ms);
                    }
                }
                self.resolve(engine, store, metrics, host, &affected, now_ms);
            }
            Some(Callout::Returns { items, sent_ms }) => {
                match global::parse_return_response(status, body) {
                    Ok(answer) => {
                        metrics.callout(now_ms.saturating_sub(sent_ms), false);
                        for (item, result) in items.iter().zip(&answer.returns) {
                            match result {
                                ReturnResult::Returned { returned, .. } => {
                                    metrics.lease(item.policy, LeaseEvent::Returned(*returned));
                                    metrics.lease(
                                        item.policy,
                                        LeaseEvent::Expired(item.unused.saturating_sub(*returned)),
                                    );
                                }
                                ReturnResult::Error(_) => {
                                    metrics.lease(item.policy, LeaseEvent::Expired(item.unused))
                                }
                            }
                        }
                    }
                    Err(error) => {
                        metrics.callout(now_ms.saturating_sub(sent_ms), true);
                        log_failure(&error);
                        for item in &items {
                            metrics.lease(item.policy, LeaseEvent::Expired(item.unused));
                        }
                    }
                }
            }
            None => {}
        }
        self.update_tick(host);
    }

    fn credit(
        &mut self,
        engine: &Engine,
        store: &impl SharedData,
        metrics: &Metrics,
        items: &[(LeaseNeed, u64, String)],
        results: &[LeaseResult],
        now_ms: u64,
    ) {
        for (need, seq, id) in items {
            self.inflight.remove(&need.bucket_id);
            let result = results.iter().find(|r| match r {
                LeaseResult::Granted(g) => &g.id == id,
                LeaseResult::Error(e) => &e.id == id,
            });
            match result {
                Some(LeaseResult::Granted(_)) => {
                    self.unsettled.remove(&need.bucket_id);
                }
                Some(LeaseResult::Error(e)) if e.error != ErrorCode::Unavailable => {
                    self.unsettled.remove(&need.bucket_id);
                }
                _ => self.unsettle(std::slice::from_ref(&(need.clone(), *seq, id.clone()))),
            }
            match result {
                Some(LeaseResult::Granted(grant)) => {
                    metrics.lease(need.policy, LeaseEvent::Granted(grant.granted));
                    if let Err(error) = engine.credit(store, need, grant, *seq, now_ms) {
                        log::warn!("tollgate: granted tokens lost (table {error:?})");
                        metrics.lease(need.policy, LeaseEvent::Expired(grant.granted));
                    }
                }
                Some(LeaseResult::Error(error)) => {
                    if error.error == ErrorCode::InvalidPolicy {
                        metrics.lease(need.policy, LeaseEvent::InvalidPolicy);
                        log::warn!(
                            "tollgate: limiter refused policy: {} ({})",
                            error.error.as_str(),
                            error.reason.as_deref().unwrap_or("")
                        );
                    }
                    metrics.lease(need.policy, LeaseEvent::Unavailable);
                    let _ = engine.mark_unavailable(store, need, now_ms);
                }
                None => {
                    metrics.lease(need.policy, LeaseEvent::Unavailable);
                    let _ = engine.mark_unavailable(store, need, now_ms);
                }
            }
        }
    }

    /// Remembers lease requests whose outcome is unknown, to be asked again under the same id.
    fn unsettle(&mut self, items: &[(LeaseNeed, u64, String)]) {
        for (need, seq, id) in items {
            if self.unsettled.len() < MAX_WAITERS || self.unsettled.contains_key(&need.bucket_id) {
                self.unsettled
                    .insert(need.bucket_id.clone(), (*seq, id.clone()));
            }
        }
    }

    /// Decides again every request waiting for one of `affected`.
    fn resolve(
        &mut self,
        engine: &Engine,
        store: &impl SharedData,
        metrics: &Metrics,
        host: &impl Host,
        affected: &[String],
        now_ms: u64,
    ) {
        let ready: Vec<u32> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.waiting_for.iter().any(|b| affected.contains(b)))
            .map(|(id, _)| *id)
            .collect();
        let mut wake = false;
        for context_id in ready {
            wake |= self.decide_waiter(context_id, engine, store, metrics, host, now_ms, false);
        }
        if wake {
            self.flush(engine, store, metrics, host, now_ms);
        }
    }

    /// Decides a waiting request again; returns whether new needs were queued.
    #[allow(clippy::too_many_arguments)]
    fn decide_waiter(
        &mut self,
        context_id: u32,
        engine: &Engine,
        store: &impl SharedData,
        metrics: &Metrics,
        host: &impl Host,
        now_ms: u64,
        deadline_passed: bool,
    ) -> bool {
        let Some(mut waiter) = self.waiters.remove(&context_id) else {
            return false;
        };
        let attempt = Attempt {
            round: waiter.round + 1,
            deadline_passed,
        };
        let decision = engine.decide(&waiter.plan, store, now_ms, attempt);
        let queued = self.queue(&decision);
        match &decision.verdict {
            Verdict::Wait => {
                waiter.round += 1;
                waiter.waiting_for = decision
                    .needs
                    .iter()
                    .filter(|n| n.blocking)
                    .map(|n| n.bucket_id.clone())
                    .collect();
                self.waiters.insert(context_id, waiter);
            }
            Verdict::Continue => {
                metrics.record(&decision);
                *waiter.response_headers.borrow_mut() = decision.response_headers.clone();
                host.resume(context_id);
            }
            Verdict::Reply(reply) => {
                metrics.record(&decision);
                host.reply(context_id, reply);
            }
        }
        queued
    }

    /// The filter's own deadline (root tick): waiting requests past it take the failure mode.
    pub fn tick(
        &mut self,
        engine: &Engine,
        store: &impl SharedData,
        metrics: &Metrics,
        host: &impl Host,
        now_ms: u64,
    ) {
        let late: Vec<u32> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.deadline_ms <= now_ms)
            .map(|(id, _)| *id)
            .collect();
        let mut wake = false;
        for context_id in late {
            metrics.deadline_passed();
            wake |= self.decide_waiter(context_id, engine, store, metrics, host, now_ms, true);
        }
        if wake {
            self.flush(engine, store, metrics, host, now_ms);
        }
        self.update_tick(host);
    }

    fn update_tick(&mut self, host: &impl Host) {
        let want = !self.waiters.is_empty();
        if want != self.ticking {
            host.set_tick(if want { TICK_MS } else { 0 });
            self.ticking = want;
        }
    }
}

fn log_failure(error: &CalloutError) {
    log::debug!("tollgate: limiter callout failed: {error:?}");
}

#[cfg(test)]
mod tests;
