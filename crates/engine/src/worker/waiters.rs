//! Requests waiting for a lease: registered by their stream, decided again when an answer (or
//! a failure) comes in for a key they wait for, then resumed, answered, put to sleep until
//! their shaped turn, or left waiting another round.

use super::{no_room_reply, shaped_ids, Admitted, Ctx, Host, Waiter, Worker, MAX_WAITERS};
use crate::engine::{Attempt, Decision, Plan, Verdict};
use crate::shared::SharedData;

impl Worker {
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

    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// Decides again every request waiting for one of `affected` (what they queue is sent by
    /// the caller's flush).
    pub(super) fn resolve<S: SharedData, H: Host>(
        &mut self,
        ctx: &Ctx<'_, S, H>,
        affected: &[String],
    ) {
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
    pub(super) fn decide_waiter<S: SharedData, H: Host>(
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
        let decision = ctx.engine.decide(&waiter.plan, ctx.at(), attempt);
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

    /// Total cost of the requests on this worker waiting for `bucket_id`'s lease.
    pub(super) fn waiting_demand(&self, bucket_id: &str) -> u64 {
        self.waiters
            .values()
            .filter(|w| w.waiting_for.iter().any(|b| b == bucket_id))
            .flat_map(|w| w.plan.enforced.iter().filter(|m| m.bucket_id == bucket_id))
            .map(|m| m.cost)
            .sum()
    }
}
