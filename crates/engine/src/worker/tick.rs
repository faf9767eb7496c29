//! The root tick (the filter's own deadline for waiting requests, shaped turns, another
//! worker's answers, expired leases) and the tick period the worker needs.

use super::{Ctx, Host, Worker, MAX_POLLED_PER_TICK, RETURN_TICK_MS, TICK_MS};
use crate::shared::SharedData;

impl Worker {
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

    /// The tick the worker needs: fast while requests wait or sleep or refills linger, slow
    /// while leases it credited may still expire with tokens left, else none.
    pub(super) fn update_tick(&mut self, host: &impl Host) {
        let want =
            if !self.waiters.is_empty() || !self.sleepers.is_empty() || !self.queued.is_empty() {
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
