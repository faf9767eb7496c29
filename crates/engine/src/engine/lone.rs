//! Lone: the common request, whose only enforced policy needs neither the combination of
//! several policies nor anything kept past the decision (it does not tag, send headers on
//! allowed answers, hold in-flight slots or settle). It is decided on its record where the
//! record lies (in place in the native cells: nothing copied out and back) by the same steps
//! and the same spend, refusal and housekeeping as the general path (`commit`), without the
//! steps list, the scratch lists and the combination of verdicts.
//!
//! A local policy always takes it. A global one takes it in the native build when its lease
//! decides by itself (`step::lone_global_step`: a key spending from its lease, or refused by
//! its assignment or by the limiter's last answer); anything else (an expiry or a renewal to
//! report, a debt, a shaped turn, a key that needs the limiter) passes without writing, and
//! the request takes the general path.

use super::commit::{apply_spend, mark_evictable, status, undo_spend};
#[cfg(not(target_family = "wasm"))]
use super::step::{keep_lone_lease, lone_global_step, Moment};
use super::step::{local_step, Step};
use super::{Attempt, Decision, Engine, Matched, Verdict};
use crate::shared::{SharedData, StoreAt};
#[cfg(not(target_family = "wasm"))]
use std::cell::Cell;
use tollgate_core::policy::Policy;
use tollgate_core::response;

impl Engine {
    /// Decides a request whose only enforced policy is `policy` (rated for its key) on a lone
    /// path, if one takes it: `false` when the general path is to decide (nothing written).
    pub(super) fn decide_lone(
        &self,
        m: &Matched,
        policy: &Policy,
        at: StoreAt<'_, impl SharedData>,
        attempt: Attempt,
        decision: &mut Decision,
    ) -> bool {
        let lone = policy.tag.is_none()
            && !policy.headers_on_allow
            && policy.in_flight.is_none()
            && policy.reserve.is_none()
            && policy.settle.is_none();
        if !lone {
            return false;
        }
        // A global policy without a limiter to ask decides by its local stage.
        if !policy.scope.uses_limiter() || self.policies.limiter.is_none() {
            self.decide_lone_local(m, policy, at, decision);
            return true;
        }
        self.decide_lone_global(m, policy, at, attempt, decision)
    }

    /// A local policy: its record's local stage ([`local_step`]) decides.
    fn decide_lone_local(
        &self,
        m: &Matched,
        policy: &Policy,
        at: StoreAt<'_, impl SharedData>,
        decision: &mut Decision,
    ) {
        let now_ms = at.now_ms;
        // The step reads the record; its spend and housekeeping are the only writes, made
        // after it returned.
        let result = self.table.transact_read(
            at,
            m.bucket_id.as_str(),
            |record| local_step(policy, m, record, now_ms),
            |step, record| {
                if let Step::Allow { spend, .. } = step {
                    apply_spend(spend, record);
                }
                mark_evictable(record, policy, now_ms);
            },
            // The key's group is written before its other candidates are confirmed, and a
            // lost confirmation refunds it.
            |step, before, after, current| {
                if let Step::Allow { spend, .. } = step {
                    undo_spend(spend, policy, before, after, current, now_ms);
                }
            },
        );
        let step = match result {
            Ok(done) => {
                decision.evictions += done.evictions;
                Some(done.value)
            }
            Err(error) => {
                decision.table_error = Some(error);
                None
            }
        };
        conclude(m, policy, step.as_ref(), now_ms, decision);
    }

    /// A global policy in the wasm build: the general path. Its table is shared data, where
    /// the lone path saves little next to the host calls of the read and the write, and its
    /// code (another instance of the table's transaction) would add to the module every worker
    /// compiles. (A native table in shared data, as tests and benchmarks open, decides as the
    /// wasm build does.)
    #[cfg(target_family = "wasm")]
    fn decide_lone_global(
        &self,
        _: &Matched,
        _: &Policy,
        _: StoreAt<'_, impl SharedData>,
        _: Attempt,
        _: &mut Decision,
    ) -> bool {
        false
    }

    /// A global policy whose lease decides by itself, in the native cells: the step is read
    /// from the record, then the lease's housekeeping, the spend and, when the lease runs low,
    /// a background refill (as the general path asks for it) are written. `false`: the table
    /// is shared data, or the step passed; nothing was written.
    #[cfg(not(target_family = "wasm"))]
    fn decide_lone_global(
        &self,
        m: &Matched,
        policy: &Policy,
        at: StoreAt<'_, impl SharedData>,
        attempt: Attempt,
        decision: &mut Decision,
    ) -> bool {
        if !self.table.keeps_cells() {
            return false;
        }
        let now_ms = at.now_ms;
        let moment = Moment {
            now_ms,
            attempt,
            limiter: self.policies.limiter.as_ref(),
        };
        // The refill the written lease asks for (the last write's, after a lost race).
        let refill = Cell::new(None);
        let result = self.table.try_transact_read(
            at,
            m.bucket_id.as_str(),
            |record| lone_global_step(policy, m, record, moment),
            |step, record| {
                keep_lone_lease(&mut record.lease, m.cost, moment);
                if let Step::Allow { spend, .. } = step {
                    apply_spend(spend, record);
                    refill.set(self.refill_if_low(m, policy, record, now_ms));
                }
                mark_evictable(record, policy, now_ms);
            },
            |step, before, after, current| {
                if let Step::Allow { spend, .. } = step {
                    undo_spend(spend, policy, before, after, current, now_ms);
                }
            },
        );
        let step = match result {
            Ok(None) => return false,
            Ok(Some(done)) => {
                decision.evictions += done.evictions;
                decision.needs.extend(refill.into_inner());
                Some(done.value)
            }
            Err(error) => {
                decision.table_error = Some(error);
                None
            }
        };
        conclude(m, policy, step.as_ref(), now_ms, decision);
        true
    }
}

/// A lone step's verdict and outcome, as the general path's combination gives them for one
/// policy; `None`: the table could not decide (the policy's failure mode for it).
#[inline(always)]
fn conclude(
    m: &Matched,
    policy: &Policy,
    step: Option<&Step>,
    now_ms: u64,
    decision: &mut Decision,
) {
    match step {
        Some(Step::Allow {
            outcome, delay_ms, ..
        }) => {
            decision.outcomes.push((m.index, *outcome));
            if *delay_ms > 0 {
                decision.delay_ms = decision.delay_ms.max(*delay_ms);
                decision.delayed.push(m.index);
            }
        }
        Some(Step::Deny {
            outcome,
            remaining,
            retry_ms,
        }) => {
            decision.outcomes.push((m.index, *outcome));
            decision.verdict = Verdict::Reply(response::too_many_requests(&[status(
                policy, *remaining, *retry_ms, now_ms,
            )]));
        }
        // Not a lone step's answer (neither stage refuses, holds slots or waits here).
        Some(Step::Refuse | Step::Busy | Step::Need { .. }) | None => {
            let outcome = super::when_table_fails(policy);
            decision.outcomes.push((m.index, outcome));
            if outcome == super::Outcome::FailClosed {
                decision.verdict = Verdict::Reply(response::limiter_unavailable(&policy.name));
            }
        }
    }
}
