//! Shaped requests admitted with a delay: paused until their turn (at most the policy's
//! `max_waiting` per key and [`MAX_WAITERS`] in all on one worker) and resumed by the tick,
//! earliest first; refused when there is no room to pause them.

use super::{Admitted, Host, Sleeper, Worker, MAX_WAITERS};
use crate::engine::{Engine, Plan};
use tollgate_core::response::LocalReply;

impl Worker {
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
    pub(super) fn wake_sleepers(&mut self, host: &impl Host, now_ms: u64) {
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
