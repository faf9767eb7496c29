//! Step: what one policy's record says about a request, without committing anything.
//!
//! First the key's in-flight slots (`max_in_flight`): a key with all of them held refuses the
//! request before any budget is looked at.
//! The local stage is a token bucket in the record. The global stage spends this instance's
//! lease, or decides against its assignment (a share of the global refill rate that drips into
//! the record: admissions *and denials* are local, and one renewal per period goes out in the
//! background). Only a key with neither asks the limiter and waits; and only one request per
//! key and instance asks at a time (the record's `pending_until_ms`), the others wait for its
//! answer. [`Engine::undecided`] is the failure-mode wrapper around everything that needs the
//! limiter.

use super::{Admission, Attempt, Decision, Engine, LeaseNeed, Matched, Outcome, ReturnNeed};
use crate::global::{self, DEADLINE_MARGIN_MS};
use crate::table::{Lease, Record};
use tollgate_core::bucket::{
    self, try_take, BucketState, Decision as BucketDecision, Limits, Shaped,
};
use tollgate_core::policy::{Algorithm, FailureMode, LimiterSpec, Policy, Scope, Terminal};
use tollgate_core::window::{self, CounterKind, Counters, Log};

/// What one policy's record says about the request.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Step {
    Allow {
        spend: Spend,
        outcome: Outcome,
        remaining: f64,
        reset_ms: u64,
        /// A shaped request's wait for its turn (0: go on now).
        delay_ms: u64,
    },
    Deny {
        outcome: Outcome,
        remaining: f64,
        retry_ms: u64,
    },
    /// Fail closed.
    Refuse,
    /// The key has `max_in_flight` requests in flight.
    Busy,
    /// Nothing local covers the cost: wait for a lease. `ask`: no other request of this
    /// instance is asking for this key, so this one asks.
    Need {
        min: u64,
        want: u64,
        demand_per_s: f64,
        ask: bool,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Spend {
    Nothing,
    Bucket(BucketState),
    Lease(u64),
    /// A shaped request over the rate: what the lease holds, and the rest taken ahead from the
    /// assignment's drip (as debt the drip pays before anything else).
    LeaseAhead(u64, u64),
    /// A fixed or sliding window's counters after the cost was counted.
    Counters(Counters, u64),
    /// A sliding log after the cost was logged.
    Log(Log, u64),
}

/// Housekeeping collected while deciding (kept only from the decision that committed).
#[derive(Debug, Default)]
pub(super) struct Scratch {
    pub needs: Vec<LeaseNeed>,
    pub returns: Vec<ReturnNeed>,
    pub expired: Vec<(usize, u64)>,
    pub waiting_for: Vec<String>,
    pub admissions: Vec<Admission>,
    pub slots_expired: Vec<(usize, u64)>,
    /// The longest wait of a shaped admission, and the policies that delayed it.
    pub delay_ms: u64,
    pub delayed: Vec<usize>,
    /// Tag headers to set on the request (see [`Decision::request_headers`]).
    pub request_headers: Vec<(String, String)>,
}

impl Scratch {
    /// Hands what the committed decision collected to the request's `decision` (by moving
    /// the lists, not copying them: most are empty).
    pub fn drain_into(&mut self, decision: &mut Decision) {
        decision.delay_ms = decision.delay_ms.max(self.delay_ms);
        if !self.request_headers.is_empty() {
            move_all(&mut decision.request_headers, &mut self.request_headers);
        }
        if self.needs.is_empty()
            && self.returns.is_empty()
            && self.expired.is_empty()
            && self.waiting_for.is_empty()
            && self.admissions.is_empty()
            && self.slots_expired.is_empty()
            && self.delayed.is_empty()
        {
            // The common case: nothing to hand over.
            return;
        }
        move_all(&mut decision.needs, &mut self.needs);
        move_all(&mut decision.returns, &mut self.returns);
        move_all(&mut decision.expired, &mut self.expired);
        move_all(&mut decision.waiting_for, &mut self.waiting_for);
        move_all(&mut decision.admissions, &mut self.admissions);
        move_all(&mut decision.slots_expired, &mut self.slots_expired);
        move_all(&mut decision.delayed, &mut self.delayed);
    }
}

/// Moves `from`'s items to the end of `to`: the list itself when `to` is empty.
fn move_all<T>(to: &mut Vec<T>, from: &mut Vec<T>) {
    if to.is_empty() {
        std::mem::swap(to, from);
    } else {
        to.append(from);
    }
}

/// What every step of one decision shares.
#[derive(Debug, Clone, Copy)]
pub(super) struct Moment<'a> {
    pub now_ms: u64,
    pub attempt: Attempt,
    pub limiter: Option<&'a LimiterSpec>,
}

/// What a global policy's step decides against, besides the record.
#[derive(Clone, Copy)]
struct Global<'a> {
    policy: &'a Policy,
    matched: &'a Matched,
    settings: &'a LimiterSpec,
    at: Moment<'a>,
}

impl Engine {
    /// What one policy's record says. May change the record's housekeeping (expired leases,
    /// the demand estimate, drips, renewals); consumption is applied only if the request passes.
    pub(super) fn step(
        &self,
        policy: &Policy,
        matched: &Matched,
        record: &mut Record,
        at: Moment<'_>,
        scratch: &mut Scratch,
    ) -> Step {
        if let Some(limit) = policy.in_flight {
            let expired = record.in_flight.advance(limit.timeout_ms, at.now_ms);
            if expired > 0 {
                scratch.slots_expired.push((matched.index, expired));
            }
            if record.in_flight.held() >= u64::from(limit.max) {
                return Step::Busy;
            }
        }
        match (policy.scope, at.limiter) {
            (Scope::Global | Scope::Regional, Some(settings)) => {
                let global = Global {
                    policy,
                    matched,
                    settings,
                    at,
                };
                self.global_step(global, record, scratch)
            }
            _ => local_step(policy, matched, record, at.now_ms),
        }
    }

    fn global_step(&self, global: Global<'_>, record: &mut Record, scratch: &mut Scratch) -> Step {
        let Global {
            policy,
            matched,
            settings,
            at,
        } = global;
        let (cost, now_ms) = (matched.cost, at.now_ms);
        let lease = &mut record.lease;
        keep_lease(matched, lease, settings, at, scratch);
        if let Some(step) = shaped_against_assignment(policy, matched, lease, now_ms) {
            return step;
        }
        if lease.debt > 0 {
            return self.in_debt(global, record, scratch);
        }
        let lease = &mut record.lease;
        if let Some(step) = decided_by_lease(policy, cost, lease, now_ms) {
            return step;
        }
        if at.attempt.deadline_passed || lease.unavailable_until_ms > now_ms {
            if lease.unavailable_until_ms > now_ms && lease.pending_until_ms <= now_ms {
                // One probe per instance finds out when the limiter is back.
                ask_in_background(matched, lease, settings, now_ms, scratch);
            }
            return self.undecided(policy, record, now_ms, cost);
        }
        let want = global::want(lease, cost, settings, now_ms);
        Step::Need {
            min: cost,
            want,
            demand_per_s: global::reported_demand(lease, want, settings, now_ms),
            ask: lease.pending_until_ms <= now_ms,
        }
    }

    /// A key whose requests used more than they reserved: refused until what this instance
    /// receives next has paid the debt (an assignment's drip pays it; else a lease for it is
    /// asked for in the background), and `Retry-After` covers it. Nothing waits: a debt may be
    /// larger than one lease can be.
    fn in_debt(&self, global: Global<'_>, record: &mut Record, scratch: &mut Scratch) -> Step {
        let Global {
            policy,
            matched,
            settings,
            at,
        } = global;
        let now_ms = at.now_ms;
        let lease = &mut record.lease;
        if at.attempt.deadline_passed || lease.unavailable_until_ms > now_ms {
            return self.undecided(policy, record, now_ms, matched.cost);
        }
        let owed = lease.debt.saturating_add(matched.cost);
        let retry_ms = if global::assigned(lease, now_ms) {
            global::assignment_retry_ms(lease, owed, now_ms)
        } else {
            if lease.pending_until_ms <= now_ms && lease.denied_until_ms <= now_ms {
                let mut repay = matched.clone();
                repay.cost = owed.min(policy.burst);
                ask_in_background(&repay, lease, settings, now_ms, scratch);
            }
            policy
                .limits
                .millis_to_refill(owed as f64)
                .max(lease.denied_until_ms.saturating_sub(now_ms))
        };
        Step::Deny {
            outcome: Outcome::Denied,
            remaining: 0.0,
            retry_ms,
        }
    }

    /// The failure-mode wrapper: the one place that says what a policy does when the limiter
    /// cannot decide for it.
    pub(super) fn undecided(
        &self,
        policy: &Policy,
        record: &Record,
        now_ms: u64,
        cost: u64,
    ) -> Step {
        let admit = Step::Allow {
            spend: Spend::Nothing,
            outcome: Outcome::FailOpen,
            remaining: 0.0,
            reset_ms: 0,
            delay_ms: 0,
        };
        match policy.failure {
            FailureMode::Open => admit,
            FailureMode::Closed => Step::Refuse,
            FailureMode::Local {
                share,
                stale_ttl_ms,
                then,
            } => {
                let since = match record.lease.unavailable_since_ms {
                    0 => now_ms,
                    since => since,
                };
                if now_ms.saturating_sub(since) <= stale_ttl_ms {
                    let limits = policy.limits.scaled(share);
                    bucket_step(
                        &limits,
                        record.bucket,
                        now_ms,
                        cost,
                        Outcome::FallbackAllowed,
                        Outcome::FallbackDenied,
                    )
                } else if then == Terminal::Open {
                    admit
                } else {
                    Step::Refuse
                }
            }
        }
    }

    /// After an admitted spend of a lease: the background refill to ask for when it runs
    /// low (an assignment renews on its own schedule instead).
    pub(super) fn refill_if_low(
        &self,
        matched: &Matched,
        policy: &Policy,
        record: &mut Record,
        now_ms: u64,
    ) -> Option<LeaseNeed> {
        let settings = self.policies.limiter.as_ref()?;
        let lease = &mut record.lease;
        if policy.scope.uses_limiter()
            && !global::assigned(lease, now_ms)
            && lease.pending_until_ms <= now_ms
            && global::below_low_water(lease, settings)
        {
            // A quarter of the grant is left: the refill may wait a little for company.
            let may_linger = lease.tokens > 0;
            return Some(ask_ahead(matched, lease, settings, now_ms, may_linger));
        }
        None
    }
}

/// A lone global policy's step (see the `lone` module) when its lease decides it with no
/// housekeeping to report: the step `Engine::step` takes, or `None` when the key's lease
/// expires or its assignment is due for renewal, it has a debt its tokens cannot pay, a
/// shaped request takes its turn ahead, or the limiter is needed. The record is only read:
/// the lease's housekeeping is [`keep_lone_lease`], for the write to make. The common global
/// request: a key spending from its lease, or refused by its assignment or by the limiter's
/// last answer.
#[cfg(not(target_family = "wasm"))]
pub(super) fn lone_global_step(
    policy: &Policy,
    matched: &Matched,
    record: &Record,
    at: Moment<'_>,
) -> Option<Step> {
    at.limiter.filter(|_| policy.scope.uses_limiter())?;
    let now_ms = at.now_ms;
    let mut lease = record.lease;
    tend_lease(&mut lease, matched.cost, at);
    if global::expiry_due(&lease, now_ms) || global::renewal_due(&lease, now_ms) {
        return None;
    }
    global::pay_debt(&mut lease);
    if lease.debt > 0 || shaped_against_assignment(policy, matched, &lease, now_ms).is_some() {
        return None;
    }
    decided_by_lease(policy, matched.cost, &lease, now_ms)
}

/// A lone global step's housekeeping (`keep_lease` when nothing expires or renews): the
/// demand estimate, the drip, the debt paid.
#[cfg(not(target_family = "wasm"))]
pub(super) fn keep_lone_lease(lease: &mut Lease, cost: u64, at: Moment<'_>) {
    tend_lease(lease, cost, at);
    global::pay_debt(lease);
}

/// The housekeeping that reports nothing: the demand estimate (once per request) and the
/// assignment's drip.
fn tend_lease(lease: &mut Lease, cost: u64, at: Moment<'_>) {
    if at.attempt.round == 0 {
        global::observe_demand(lease, cost, at.now_ms);
    }
    global::accrue(lease, at.now_ms);
}

/// A global key's housekeeping before its lease decides: the demand estimate (once per
/// request), the assignment's drip, an expired lease's return, a due renewal, the debt paid
/// from what arrived.
fn keep_lease(
    matched: &Matched,
    lease: &mut Lease,
    settings: &LimiterSpec,
    at: Moment<'_>,
    scratch: &mut Scratch,
) {
    let now_ms = at.now_ms;
    tend_lease(lease, matched.cost, at);
    if let Some(expiry) = global::expire(lease, now_ms) {
        scratch
            .returns
            .extend(ReturnNeed::of_expiry(matched.index, matched.key(), &expiry));
        if expiry.expired > 0 {
            scratch.expired.push((matched.index, expiry.expired));
        }
    }
    if global::renewal_due(lease, now_ms) {
        // Nothing may drip after the renewal is asked for (the limiter gives the rest of
        // the running assignment back when it decides); decisions stay local meanwhile.
        global::stop_drip(lease, now_ms);
        ask_in_background(matched, lease, settings, now_ms, scratch);
        lease.assigned_until_ms = lease.assigned_until_ms.max(lease.pending_until_ms);
    }
    global::pay_debt(lease);
}

/// What the lease decides by itself for a key without debt: its tokens cover the cost, or
/// the assignment refuses (its drip has not covered it), or the limiter's last answer
/// refuses until a time still ahead. `None`: the limiter must be asked (or is away).
fn decided_by_lease(policy: &Policy, cost: u64, lease: &Lease, now_ms: u64) -> Option<Step> {
    if lease.tokens >= cost {
        let left = (lease.tokens - cost) as f64;
        let reset_ms = match policy.algorithm {
            // A fixed window is whole again when it ends, and its lease ends with it (a
            // calendar month's at the first of the next month).
            Algorithm::FixedWindow(_) => lease.expires_ms.saturating_sub(now_ms),
            _ => policy
                .limits
                .millis_to_refill(policy.limits.capacity() - left),
        };
        return Some(Step::Allow {
            spend: Spend::Lease(cost),
            outcome: Outcome::Allowed,
            remaining: left,
            reset_ms,
            delay_ms: 0,
        });
    }
    if global::assigned(lease, now_ms) {
        return Some(Step::Deny {
            outcome: Outcome::Denied,
            remaining: lease.tokens as f64,
            retry_ms: global::assignment_retry_ms(lease, cost, now_ms),
        });
    }
    if lease.denied_until_ms > now_ms {
        return Some(Step::Deny {
            outcome: Outcome::Denied,
            remaining: 0.0,
            retry_ms: lease.denied_until_ms - now_ms,
        });
    }
    None
}

/// A shaped global policy over its limit: the instance holds an assignment (a share of the
/// rate that drips into its lease), so a request that the drip covers within `max_delay`
/// takes its cost ahead, as debt the drip pays first, and waits for its turn; later turns are
/// refused. No callout per request: the wait is spent against the assignment. `None` when the
/// policy is not shaped, may not wait now, or no assignment runs (then leases decide).
fn shaped_against_assignment(
    policy: &Policy,
    matched: &Matched,
    lease: &Lease,
    now_ms: u64,
) -> Option<Step> {
    let shape = policy.shape.filter(|_| matched.may_wait)?;
    let cost = matched.cost;
    let over = lease.debt > 0 || lease.tokens < cost;
    if !over || !global::assigned(lease, now_ms) || lease.drip_per_ms <= 0.0 {
        return None;
    }
    let owed = lease.debt.saturating_add(cost);
    let delay_ms = global::assignment_retry_ms(lease, owed, now_ms);
    if delay_ms > shape.max_delay_ms {
        return Some(Step::Deny {
            outcome: Outcome::Denied,
            remaining: 0.0,
            retry_ms: delay_ms - shape.max_delay_ms,
        });
    }
    let from_tokens = lease.tokens.min(cost);
    Some(Step::Allow {
        spend: Spend::LeaseAhead(from_tokens, cost - from_tokens),
        outcome: Outcome::Allowed,
        remaining: 0.0,
        reset_ms: delay_ms,
        delay_ms,
    })
}

/// Queues a lease request nobody waits for (refill, renewal, probe) and marks the key as
/// asking, so no other request of this instance asks for it meanwhile.
pub(super) fn ask_in_background(
    matched: &Matched,
    lease: &mut Lease,
    settings: &LimiterSpec,
    now_ms: u64,
    scratch: &mut Scratch,
) {
    let need = ask_ahead(matched, lease, settings, now_ms, false);
    scratch.needs.push(need);
}

/// The lease request of [`ask_in_background`], with the key marked as asking; `may_linger`:
/// a refill that may wait for company ([`LeaseNeed::may_linger`]), so the key counts as
/// asking for that much longer.
fn ask_ahead(
    matched: &Matched,
    lease: &mut Lease,
    settings: &LimiterSpec,
    now_ms: u64,
    may_linger: bool,
) -> LeaseNeed {
    let linger_ms = if may_linger {
        global::REFILL_LINGER_MS
    } else {
        0
    };
    lease.pending_until_ms = now_ms + linger_ms + settings.timeout.0 + DEADLINE_MARGIN_MS;
    let want = global::want(lease, matched.cost, settings, now_ms);
    let demand_per_s = global::reported_demand(lease, want, settings, now_ms);
    lease.asked_demand_per_s = demand_per_s;
    LeaseNeed {
        policy: matched.index,
        key: matched.key().to_owned(),
        bucket_id: matched.bucket_id.clone(),
        min: matched.cost,
        want,
        demand_per_s,
        blocking: false,
        may_linger,
        asked_ms: now_ms,
    }
}

pub(super) fn bucket_step(
    limits: &Limits,
    bucket: Option<BucketState>,
    now_ms: u64,
    cost: u64,
    allowed: Outcome,
    denied: Outcome,
) -> Step {
    let (state, decision) = try_take(limits, bucket, now_ms, cost);
    match decision {
        BucketDecision::Allowed { remaining } => Step::Allow {
            spend: Spend::Bucket(state),
            outcome: allowed,
            remaining,
            reset_ms: state.full_at_ms(limits).saturating_sub(now_ms),
            delay_ms: 0,
        },
        BucketDecision::Denied {
            retry_after_ms,
            remaining,
        } => Step::Deny {
            outcome: denied,
            remaining,
            retry_ms: retry_after_ms,
        },
    }
}

/// The local stage by the policy's algorithm: a token bucket (shaped: a request over the rate
/// waits for its turn, up to `max_delay`, while the worker has room for one more waiting
/// request of the key), a fixed or sliding window, a sliding log.
pub(super) fn local_step(policy: &Policy, matched: &Matched, record: &Record, now_ms: u64) -> Step {
    let cost = matched.cost;
    let deny = |decision: BucketDecision| match decision {
        BucketDecision::Denied {
            retry_after_ms,
            remaining,
        } => Some(Step::Deny {
            outcome: Outcome::Denied,
            remaining,
            retry_ms: retry_after_ms,
        }),
        BucketDecision::Allowed { .. } => None,
    };
    let allow = |spend: Spend, remaining: f64, reset_ms: u64| Step::Allow {
        spend,
        outcome: Outcome::Allowed,
        remaining,
        reset_ms,
        delay_ms: 0,
    };
    match policy.algorithm {
        Algorithm::TokenBucket => match policy.shape {
            Some(shape) if matched.may_wait => {
                let limits = &policy.limits;
                match bucket::shape(limits, record.bucket, now_ms, cost, shape.max_delay_ms) {
                    (state, Shaped::Now { remaining }) => allow(
                        Spend::Bucket(state),
                        remaining,
                        state.full_at_ms(limits).saturating_sub(now_ms),
                    ),
                    (state, Shaped::After { delay_ms }) => Step::Allow {
                        spend: Spend::Bucket(state),
                        outcome: Outcome::Allowed,
                        remaining: 0.0,
                        reset_ms: state.full_at_ms(limits).saturating_sub(now_ms),
                        delay_ms,
                    },
                    (_, Shaped::Denied { retry_after_ms }) => Step::Deny {
                        outcome: Outcome::Denied,
                        remaining: 0.0,
                        retry_ms: retry_after_ms,
                    },
                }
            }
            _ => bucket_step(
                &policy.limits,
                record.bucket,
                now_ms,
                cost,
                Outcome::Allowed,
                Outcome::Denied,
            ),
        },
        Algorithm::FixedWindow(w) | Algorithm::SlidingWindow(w) => {
            let kind = match policy.algorithm {
                Algorithm::SlidingWindow(_) => CounterKind::Sliding,
                _ => CounterKind::Fixed,
            };
            let (counters, decision) = window::take(kind, &w, record.counters, now_ms, cost);
            match (deny(decision), decision) {
                (Some(step), _) => step,
                (None, BucketDecision::Allowed { remaining }) => allow(
                    Spend::Counters(counters, cost),
                    remaining,
                    w.end_ms(counters.window).saturating_sub(now_ms),
                ),
                (None, _) => Step::Refuse,
            }
        }
        Algorithm::SlidingLog(w) => {
            let mut log = record.log.clone().unwrap_or_default();
            let decision = log.take(&w, now_ms, cost);
            match (deny(decision), decision) {
                (Some(step), _) => step,
                (None, BucketDecision::Allowed { remaining }) => {
                    let oldest = log.times.first().copied().unwrap_or(now_ms);
                    let reset_ms = oldest.saturating_add(w.window_ms).saturating_sub(now_ms);
                    allow(Spend::Log(log, cost), remaining, reset_ms)
                }
                (None, _) => Step::Refuse,
            }
        }
    }
}

/// The limits of a record's token bucket: the policy's own for `local` policies; for `global`
/// ones the bucket is the fallback budget (`share` of the rate) used while the limiter is away.
pub(super) fn bucket_limits(policy: &Policy) -> Limits {
    match (policy.scope, policy.failure) {
        (Scope::Global | Scope::Regional, FailureMode::Local { share, .. }) => {
            policy.limits.scaled(share)
        }
        _ => policy.limits,
    }
}
