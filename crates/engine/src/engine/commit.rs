//! Commit: the steps of every enforced policy combined into the request's verdict, applied to
//! the records all-or-nothing in one table transaction (an aborted or refused request consumes
//! nothing; a lost CAS race refunds what was written), and shadow policies decided each on its
//! own.

use super::step::{ask_in_background, bucket_limits, Moment, Scratch, Spend, Step};
use super::{
    Admission, Attempt, Decision, Engine, LeaseNeed, Matched, Outcome, Outcomes, Plan, Spent,
    Verdict,
};
use crate::global::DEADLINE_MARGIN_MS;
use crate::shared::{SharedData, StoreAt};
use crate::table::{Record, Txn};
use std::cell::{Cell, RefCell};
use tollgate_core::bucket::BucketState;
use tollgate_core::policy::{Algorithm, FailureMode, Policy, Terminal};
use tollgate_core::response::{self, PolicyStatus};

impl Engine {
    pub(super) fn decide_enforced(
        &self,
        plan: &Plan,
        at: StoreAt<'_, impl SharedData>,
        attempt: Attempt,
        decision: &mut Decision,
    ) {
        let now_ms = at.now_ms;
        // One enforced policy (the common case) takes no list on the heap.
        let (one_item, one_id);
        let (many_items, many_ids): (Vec<_>, Vec<&str>);
        let (items, ids): (&[(&Matched, &Policy)], &[&str]) = match plan.enforced.as_slice() {
            [] => return,
            [m] => {
                // `rated`: a `limits` policy decides at its key's entry's rate.
                let Some(policy) = self
                    .policies
                    .policies
                    .get(m.index)
                    .map(|p| p.rated(m.key()))
                else {
                    return;
                };
                if self.decide_lone(m, policy, at, attempt, decision) {
                    return;
                }
                one_item = [(m, policy)];
                one_id = [m.bucket_id.as_str()];
                (&one_item, &one_id)
            }
            all => {
                let Some(items) = self.items(all) else {
                    return;
                };
                many_items = items;
                many_ids = all.iter().map(|m| m.bucket_id.as_str()).collect();
                (&many_items, &many_ids)
            }
        };
        let scratch = RefCell::new(Scratch::default());
        let attempts = Cell::new(0u32);
        // The steps of the latest attempt, and whether it admitted the request: what a refund
        // undoes (the spends of an admission, and the in-flight slots it took).
        let steps: RefCell<Vec<Step>> = RefCell::new(take_steps());
        let admitted = Cell::new(false);
        let result =
            self.table.transact(
                at,
                ids,
                |records| {
                    let mut scratch = scratch.borrow_mut();
                    if attempts.replace(attempts.get() + 1) > 0 {
                        // A lost race decides again: only the last attempt's work counts.
                        *scratch = Scratch::default();
                    }
                    let moment = Moment {
                        now_ms,
                        attempt,
                        limiter: self.policies.limiter.as_ref(),
                    };
                    let mut steps = steps.borrow_mut();
                    steps.clear();
                    steps.extend(items.iter().zip(records.iter_mut()).map(
                        |((m, policy), record)| self.step(policy, m, record, moment, &mut scratch),
                    ));
                    let verdict = self.combine(
                        items,
                        &steps,
                        records,
                        now_ms,
                        !plan.after_headers,
                        &mut scratch,
                    );
                    admitted.set(matches!(verdict.0, Verdict::Continue));
                    for ((_, policy), record) in items.iter().zip(records.iter_mut()) {
                        mark_evictable(record, policy, now_ms);
                    }
                    Txn::Commit(verdict)
                },
                |index, before, after, current| {
                    // Undo the consumption only; housekeeping (flags, expiry) stays.
                    let Some((m, policy)) = items.get(index) else {
                        return;
                    };
                    let slot = scratch
                        .borrow()
                        .admissions
                        .iter()
                        .find(|a| a.bucket_id == m.bucket_id)
                        .and_then(|a| a.slot);
                    if let (Some(epoch), Some(limit)) = (slot, policy.in_flight) {
                        current.in_flight.release(epoch, limit.timeout_ms, now_ms);
                    }
                    let steps = steps.borrow();
                    if let Some(Step::Allow { spend, .. }) =
                        steps.get(index).filter(|_| admitted.get())
                    {
                        undo_spend(spend, policy, before, after, current, now_ms);
                    }
                },
            );
        give_back_steps(steps.into_inner());
        match result {
            Ok(done) => {
                decision.evictions += done.evictions;
                let (verdict, outcomes, headers) = done.value;
                decision.verdict = verdict;
                if decision.outcomes.is_empty() {
                    decision.outcomes = outcomes;
                } else {
                    decision.outcomes.extend(outcomes);
                }
                decision.response_headers = headers;
                scratch.borrow_mut().drain_into(decision);
            }
            Err(error) => {
                decision.table_error = Some(error);
                for (m, policy) in items {
                    let outcome = when_table_fails(policy);
                    decision.outcomes.push((m.index, outcome));
                    if outcome == Outcome::FailClosed && decision.verdict == Verdict::Continue {
                        decision.verdict =
                            Verdict::Reply(response::limiter_unavailable(&policy.name));
                    }
                }
            }
        }
    }

    fn items<'a>(&'a self, matched: &'a [Matched]) -> Option<Vec<(&'a Matched, &'a Policy)>> {
        matched
            .iter()
            .map(|m| {
                self.policies
                    .policies
                    .get(m.index)
                    .map(|p| (m, p.rated(m.key())))
            })
            .collect()
    }

    /// Combines the steps of all enforced policies into the request's verdict; applies the
    /// spends to the records when the request is admitted.
    ///
    /// `reject` policies decide all-or-nothing: one over its limit refuses the request and
    /// nothing is taken from any policy. A `tag` policy over its limit (its rate, or its
    /// `max_in_flight`) refuses nothing: for this request it is "allowed without taking" —
    /// nothing taken from it, no slot held — and the request goes on with its tag header
    /// (`tags` false: the route is chosen already, so it refuses like `reject`).
    #[allow(clippy::type_complexity)]
    fn combine(
        &self,
        items: &[(&Matched, &Policy)],
        steps: &[Step],
        records: &mut [Record],
        now_ms: u64,
        tags: bool,
        scratch: &mut Scratch,
    ) -> (Verdict, Outcomes, Vec<(String, String)>) {
        let tagging = |policy: &Policy| tags && policy.tag.is_some();
        // The common case, every step admits: nothing to refuse, wait for or tag.
        if !steps.iter().all(|s| matches!(s, Step::Allow { .. })) {
            let denials: Vec<PolicyStatus<'_>> = items
                .iter()
                .zip(steps)
                .filter_map(|((_, policy), step)| match step {
                    Step::Deny {
                        remaining,
                        retry_ms,
                        ..
                    } if !tagging(policy) => Some(status(policy, *remaining, *retry_ms, now_ms)),
                    _ => None,
                })
                .collect();
            if !denials.is_empty() {
                let outcomes = items
                    .iter()
                    .zip(steps)
                    .filter_map(|((m, policy), step)| match step {
                        Step::Deny { outcome, .. } if !tagging(policy) => Some((m.index, *outcome)),
                        _ => None,
                    })
                    .collect();
                return (
                    Verdict::Reply(response::too_many_requests(&denials)),
                    outcomes,
                    Vec::new(),
                );
            }
            let busy = |(&(_, policy), step): (&(&Matched, &Policy), &Step)| {
                matches!(step, Step::Busy) && !tagging(policy)
            };
            if let Some(((_, policy), _)) = items.iter().zip(steps).find(|&pair| busy(pair)) {
                let outcomes = items
                    .iter()
                    .zip(steps)
                    .filter(|&pair| busy(pair))
                    .map(|((m, _), _)| (m.index, Outcome::InFlightDenied))
                    .collect();
                let reply = if policy.in_flight.is_some_and(|limit| limit.max == 0) {
                    response::refused_always(&policy.name)
                } else {
                    response::too_many_in_flight(&policy.name)
                };
                return (Verdict::Reply(reply), outcomes, Vec::new());
            }
            if let Some(((_, policy), _)) = items
                .iter()
                .zip(steps)
                .find(|(_, s)| matches!(s, Step::Refuse))
            {
                let outcomes = items
                    .iter()
                    .zip(steps)
                    .filter(|(_, s)| matches!(s, Step::Refuse))
                    .map(|((m, _), _)| (m.index, Outcome::FailClosed))
                    .collect();
                return (
                    Verdict::Reply(response::limiter_unavailable(&policy.name)),
                    outcomes,
                    Vec::new(),
                );
            }
            if steps.iter().any(|s| matches!(s, Step::Need { .. })) {
                for (((m, _), step), record) in items.iter().zip(steps).zip(records.iter_mut()) {
                    let Step::Need {
                        min,
                        want,
                        demand_per_s,
                        ask,
                    } = step
                    else {
                        continue;
                    };
                    scratch.waiting_for.push(m.bucket_id.clone());
                    if !*ask {
                        // Another request of this instance is asking for this key: its answer
                        // serves this one too.
                        continue;
                    }
                    if let Some(settings) = self.policies.limiter.as_ref() {
                        record.lease.pending_until_ms =
                            now_ms + settings.timeout.0 + DEADLINE_MARGIN_MS;
                    }
                    record.lease.asked_demand_per_s = *demand_per_s;
                    scratch.needs.push(LeaseNeed {
                        policy: m.index,
                        key: m.key().to_owned(),
                        bucket_id: m.bucket_id.clone(),
                        min: *min,
                        want: *want,
                        demand_per_s: *demand_per_s,
                        blocking: true,
                        may_linger: false,
                        asked_ms: now_ms,
                    });
                }
                return (Verdict::Wait, Outcomes::new(), Vec::new());
            }
        }
        let mut outcomes = Outcomes::new();
        // Statuses only feed the headers on an admitted response, of the policies that send
        // them.
        let with_headers = items.iter().filter(|(_, p)| p.headers_on_allow).count();
        let mut statuses = Vec::with_capacity(with_headers);
        for (((m, policy), step), record) in items.iter().zip(steps).zip(records.iter_mut()) {
            if let (Some(header), Step::Deny { .. } | Step::Busy) = (&policy.tag, step) {
                // Over the limit of a tag policy (the only denials left): nothing taken.
                outcomes.push((m.index, Outcome::Tagged));
                tag(&mut scratch.request_headers, header, &policy.name);
                if let (
                    true,
                    Step::Deny {
                        remaining,
                        retry_ms,
                        ..
                    },
                ) = (policy.headers_on_allow, step)
                {
                    statuses.push(status(policy, *remaining, *retry_ms, now_ms));
                }
                continue;
            }
            if let Step::Allow {
                spend,
                outcome,
                remaining,
                reset_ms,
                delay_ms,
            } = step
            {
                apply_spend(spend, record);
                if matches!(spend, Spend::Lease(_) | Spend::LeaseAhead(..)) {
                    scratch
                        .needs
                        .extend(self.refill_if_low(m, policy, record, now_ms));
                }
                admit(m, policy, spend, record, now_ms, scratch);
                if *delay_ms > 0 {
                    scratch.delay_ms = scratch.delay_ms.max(*delay_ms);
                    scratch.delayed.push(m.index);
                }
                outcomes.push((m.index, *outcome));
                if policy.headers_on_allow {
                    statuses.push(status(policy, *remaining, *reset_ms, now_ms));
                }
            }
        }
        let headers = if statuses.is_empty() {
            Vec::new()
        } else {
            response::allowed_headers(&statuses)
        };
        (Verdict::Continue, outcomes, headers)
    }

    pub(super) fn decide_shadow(
        &self,
        matched: &Matched,
        at: StoreAt<'_, impl SharedData>,
        decision: &mut Decision,
    ) {
        let now_ms = at.now_ms;
        let Some(policy) = self
            .policies
            .policies
            .get(matched.index)
            .map(|p| p.rated(matched.key()))
        else {
            return;
        };
        let scratch = RefCell::new(Scratch::default());
        let result = self.table.transact(
            at,
            &[matched.bucket_id.as_str()],
            |records| {
                let mut scratch = scratch.borrow_mut();
                *scratch = Scratch::default();
                let Some(record) = records.first_mut() else {
                    return Txn::Abort(Outcome::FailOpen);
                };
                let moment = Moment {
                    now_ms,
                    attempt: Attempt::default(),
                    limiter: self.policies.limiter.as_ref(),
                };
                let step = self.step(policy, matched, record, moment, &mut scratch);
                let outcome = match step {
                    Step::Allow { spend, outcome, .. } => {
                        apply_spend(&spend, record);
                        if matches!(spend, Spend::Lease(_)) {
                            let refill = self.refill_if_low(matched, policy, record, now_ms);
                            scratch.needs.extend(refill);
                        }
                        admit(matched, policy, &spend, record, now_ms, &mut scratch);
                        // Shadow never delays: a shaped shadow policy only counts.
                        scratch.delay_ms = 0;
                        outcome
                    }
                    Step::Deny { .. } | Step::Busy => Outcome::ShadowDenied,
                    Step::Refuse => Outcome::FailClosed,
                    Step::Need { ask, .. } => {
                        // Shadow never waits: ask in the background, count the request as allowed.
                        if let (true, Some(settings)) = (ask, self.policies.limiter.as_ref()) {
                            ask_in_background(
                                matched,
                                &mut record.lease,
                                settings,
                                now_ms,
                                &mut scratch,
                            );
                        }
                        Outcome::Allowed
                    }
                };
                mark_evictable(record, policy, now_ms);
                Txn::Commit(outcome)
            },
            |_, _, _, _| {},
        );
        match result {
            Ok(done) => {
                decision.evictions += done.evictions;
                decision.outcomes.push((matched.index, done.value));
                scratch.borrow_mut().drain_into(decision);
            }
            Err(error) => {
                decision.table_error = Some(error);
                decision.outcomes.push((matched.index, Outcome::FailOpen));
            }
        }
    }
}

thread_local! {
    /// The steps list of a decision, kept per thread between requests so its capacity is
    /// reused (bounded by the most policies one request matched).
    static STEPS: RefCell<Vec<Step>> = const { RefCell::new(Vec::new()) };
}

/// The thread's steps list (a fresh one if it is in use).
fn take_steps() -> Vec<Step> {
    STEPS
        .try_with(|s| s.try_borrow_mut().map(|mut s| std::mem::take(&mut *s)))
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default()
}

fn give_back_steps(mut steps: Vec<Step>) {
    steps.clear();
    let _ = STEPS.try_with(|s| {
        if let Ok(mut s) = s.try_borrow_mut() {
            *s = steps;
        }
    });
}

/// Adds a policy's name to its tag header: one header per name, the names of the policies over
/// their limit comma-separated in the document's order.
fn tag(headers: &mut Vec<(String, String)>, header: &str, policy: &str) {
    match headers.iter_mut().find(|(name, _)| name == header) {
        Some((_, value)) => {
            value.push(',');
            value.push_str(policy);
        }
        None => headers.push((header.to_string(), policy.to_string())),
    }
}

/// Undoes an admission's spend on the record's current value (a later write of the
/// transaction lost a race): `before` and `after` are the record as the decision read and
/// left it.
pub(super) fn undo_spend(
    spend: &Spend,
    policy: &Policy,
    before: &Record,
    after: &Record,
    current: &mut Record,
    now_ms: u64,
) {
    match spend {
        Spend::Lease(cost) => current.lease.tokens = current.lease.tokens.saturating_add(*cost),
        Spend::Bucket(_) => {
            let limits = bucket_limits(policy);
            let taken = before
                .bucket
                .map_or(limits.capacity(), |b| b.refilled(&limits, now_ms).tokens)
                - after.bucket.map_or(limits.capacity(), |b| b.tokens);
            let state = current
                .bucket
                .unwrap_or_else(|| BucketState::full(&limits, now_ms));
            current.bucket = Some(BucketState {
                tokens: (state.tokens + taken.max(0.0)).min(limits.capacity()),
                ..state
            });
        }
        Spend::LeaseAhead(from_tokens, ahead) => {
            current.lease.tokens = current.lease.tokens.saturating_add(*from_tokens);
            current.lease.debt = current.lease.debt.saturating_sub(*ahead);
        }
        Spend::Counters(counted, cost) => {
            if let Some(c) = current.counters.as_mut() {
                if c.window == counted.window {
                    c.count = c.count.saturating_sub(*cost);
                }
            }
        }
        Spend::Log(logged, cost) => {
            if let Some(log) = current.log.as_mut() {
                for _ in 0..*cost {
                    if log.times.last() == Some(&logged.seen_ms) {
                        log.times.pop();
                    }
                }
            }
        }
        Spend::Nothing => {}
    }
}

pub(super) fn apply_spend(spend: &Spend, record: &mut Record) {
    match spend {
        Spend::Bucket(state) => record.bucket = Some(*state),
        Spend::Lease(cost) => record.lease.tokens = record.lease.tokens.saturating_sub(*cost),
        Spend::LeaseAhead(from_tokens, ahead) => {
            record.lease.tokens = record.lease.tokens.saturating_sub(*from_tokens);
            record.lease.debt = record.lease.debt.saturating_add(*ahead);
        }
        Spend::Counters(counters, _) => record.counters = Some(*counters),
        Spend::Log(log, _) => record.log = Some(log.clone()),
        Spend::Nothing => {}
    }
}

/// An admitted request takes its in-flight slot, and keeps what its stream end must settle or
/// release (only for policies that have either).
fn admit(
    matched: &Matched,
    policy: &Policy,
    spend: &Spend,
    record: &mut Record,
    now_ms: u64,
    scratch: &mut Scratch,
) {
    if policy.settle.is_none() && policy.reserve.is_none() && policy.in_flight.is_none() {
        return;
    }
    let slot = policy
        .in_flight
        .and_then(|limit| record.in_flight.take(limit.max, limit.timeout_ms, now_ms));
    scratch.admissions.push(Admission {
        policy: matched.index,
        bucket_id: matched.bucket_id.clone(),
        reserved: matched.cost,
        spent: match spend {
            Spend::Bucket(_) => Spent::Bucket,
            Spend::Lease(_) | Spend::LeaseAhead(..) => Spent::Lease,
            // Windows do not settle (validation refuses `settle` with them).
            Spend::Nothing | Spend::Counters(..) | Spend::Log(..) => Spent::Nothing,
        },
        slot,
    });
}

/// Sets when a record becomes the same as a fresh one (its slot may then be reused): a full
/// bucket (one in debt refills past it first), no live lease, no slot in flight. A debt on the
/// lease keeps the record as long as the policy's rate takes to make up for it.
pub(super) fn mark_evictable(record: &mut Record, policy: &Policy, now_ms: u64) {
    let limits = bucket_limits(policy);
    let bucket_full_at = record.bucket.map_or(0, |b| b.full_at_ms(&limits));
    let lease = &record.lease;
    let lease_live = if lease.tokens > 0 {
        lease.expires_ms
    } else {
        0
    };
    let debt_until = if lease.debt > 0 {
        now_ms.saturating_add(policy.limits.millis_to_refill(lease.debt as f64))
    } else {
        0
    };
    let slots_until = policy
        .in_flight
        .map_or(0, |limit| record.in_flight.busy_until_ms(limit.timeout_ms));
    let window = policy.algorithm.window();
    let sliding = matches!(policy.algorithm, Algorithm::SlidingWindow(_));
    let counters_until = record
        .counters
        .zip(window)
        .map_or(0, |(c, w)| c.idle_at_ms(w, sliding));
    let log_until = record
        .log
        .as_ref()
        .zip(window)
        .map_or(0, |(log, w)| log.idle_at_ms(w));
    record.evictable_at_ms = bucket_full_at
        .max(debt_until)
        .max(slots_until)
        .max(counters_until)
        .max(log_until)
        .max(lease_live)
        .max(lease.pending_until_ms)
        .max(lease.denied_until_ms)
        .max(lease.unavailable_until_ms)
        .max(lease.assigned_until_ms)
        .max(lease.drip_until_ms);
}

/// The failure mode when the local table itself cannot decide (full, contended, host error).
/// There is no better local budget to fall back to, so `local` goes straight to its `then`.
pub fn when_table_fails(policy: &Policy) -> Outcome {
    let admit = match policy.failure {
        FailureMode::Open => true,
        FailureMode::Closed => false,
        FailureMode::Local { then, .. } => then == Terminal::Open,
    };
    if admit || !policy.enforce {
        Outcome::FailOpen
    } else {
        Outcome::FailClosed
    }
}

/// What the rate-limit headers say of `policy` at `now_ms` (a calendar window's `w` is its own
/// length: a month of 28 to 31 days).
pub(super) fn status(
    policy: &Policy,
    remaining: f64,
    reset_ms: u64,
    now_ms: u64,
) -> PolicyStatus<'_> {
    PolicyStatus {
        policy: &policy.name,
        units: policy.units,
        per_ms: policy.window_ms_at(now_ms),
        remaining,
        reset_ms,
    }
}
