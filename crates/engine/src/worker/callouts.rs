//! Sending what the requests queued: lease needs merged into one request per key (asking for
//! every waiter of the key, under the earlier id when an answer was lost), in batches the
//! limiter accepts, with a timeout no later than the waiters' deadlines; and the returns of
//! unspent tokens. Settled units ride along. Refills of leases that still hold a quarter of
//! their grant wait up to `REFILL_LINGER_MS` for company: under many keys, one callout carries
//! the refills of several instead of one each.

use super::{Asked, Callout, Ctx, Host, Worker, MAX_FLUSH_ROUNDS};
use crate::global::{self, DEADLINE_MARGIN_MS, REFILL_LINGER_MS};
use crate::metrics::LeaseEvent;
use crate::shared::SharedData;
use std::collections::BTreeMap;
use tollgate_core::protocol::{LeaseRequest, LeaseReturn, LEASES_PATH, MAX_BATCH, RETURNS_PATH};

impl Worker {
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
            let batch = if self.needs_due(ctx.now_ms) {
                self.take_queued()
            } else {
                Vec::new()
            };
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

    /// Whether the queued needs go now: when a request waits (for one of them or for anything:
    /// a key whose refill lingers may have run dry meanwhile), when one may not linger, or
    /// when the oldest has lingered long enough. They all go together.
    pub(super) fn needs_due(&self, now_ms: u64) -> bool {
        !self.waiters.is_empty()
            || self.queued.iter().any(|need| {
                !need.may_linger || need.asked_ms.saturating_add(REFILL_LINGER_MS) <= now_ms
            })
    }

    /// The queued needs as lease requests: one per key (covering the biggest single request and
    /// everyone waiting on this worker), none for a key already in flight here.
    pub(super) fn take_queued(&mut self) -> Vec<Asked> {
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
                queued.need.may_linger &= need.may_linger;
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
    pub(super) fn send_leases<S: SharedData, H: Host>(
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

    pub(super) fn send_returns<S: SharedData, H: Host>(&mut self, ctx: &Ctx<'_, S, H>) {
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

    /// A blocking callout may not outlive the earliest deadline of the requests waiting for it.
    pub(super) fn callout_timeout(&self, chunk: &[Asked], timeout_ms: u64, now_ms: u64) -> u64 {
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
}

/// Lease requests in batches the limiter accepts.
pub(super) fn chunks(mut items: Vec<Asked>) -> Vec<Vec<Asked>> {
    let mut out = Vec::new();
    while !items.is_empty() {
        let rest = items.split_off(items.len().min(MAX_BATCH));
        out.push(std::mem::replace(&mut items, rest));
    }
    out
}
