//! The filter's decision for one request, free of proxy-wasm so it is tested natively.
//!
//! [`Engine::plan`] matches policies and builds keys once per request; [`Engine::decide`] runs
//! the plan against the shared table: the local stage (token buckets of `local` policies) and
//! the global stage (spending this instance's leases of `global` policies) all-or-nothing,
//! with the failure-mode wrapper ([`Engine::undecided`]) around everything that needs the
//! limiter. A request whose lease is empty gets [`Verdict::Wait`] plus the leases to ask for;
//! the glue decides the same plan again when the limiter has answered.

use crate::global::{self, DEADLINE_MARGIN_MS};
use crate::request::{build_key, PolicyKey, RequestFacts, RequestSource};
use crate::shared::SharedData;
use crate::table::{Record, SlotTable, TableError, Txn};
use std::cell::RefCell;
use tollgate_core::bucket::{try_take, BucketState, Decision as BucketDecision, Limits};
use tollgate_core::key::local_bucket_id;
use tollgate_core::policy::{
    FailureMode, LimiterSpec, OnMissingKey, Policies, Policy, Scope, Terminal,
};
use tollgate_core::response::{self, LocalReply, PolicyStatus};

/// Prefix of every shared-data key the filter writes (Istio shares the empty `vm_id` between
/// plugins, so ours must not collide with theirs).
pub const SHARED_PREFIX: &str = "tollgate/v1/";

/// What one policy decided for a request (one metric each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Allowed,
    /// Over limit, enforced.
    Denied,
    /// Over limit in shadow mode: admitted, counted.
    ShadowDenied,
    /// The identity the key needs is absent and the policy says `deny`.
    IdentityMissing,
    /// Could not decide; admitted by the failure mode.
    FailOpen,
    /// Could not decide; refused by the failure mode.
    FailClosed,
    /// Could not decide; admitted by the local fallback budget (`mode: local`).
    FallbackAllowed,
    /// Could not decide; refused by the local fallback budget (over it).
    FallbackDenied,
}

/// A policy that applies to the request, with its bucket and cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    pub index: usize,
    pub key: String,
    pub bucket_id: String,
    pub cost: u64,
}

/// What a request needs decided; computed once, decided again after each wait.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub enforced: Vec<Matched>,
    pub shadow: Vec<Matched>,
    /// Refused before any bucket (identity missing): a refused request consumes nothing.
    pub refused: Option<LocalReply>,
    pub early_outcomes: Vec<(usize, Outcome)>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.enforced.is_empty()
            && self.shadow.is_empty()
            && self.refused.is_none()
            && self.early_outcomes.is_empty()
    }
}

/// A lease to ask the limiter for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseNeed {
    pub policy: usize,
    pub key: String,
    pub bucket_id: String,
    pub min: u64,
    pub want: u64,
    /// A request waits for it (else it is a background refill or a recovery probe).
    pub blocking: bool,
}

/// Unspent tokens of an expired lease to give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReturnNeed {
    pub policy: usize,
    pub key: String,
    pub seq: u64,
    pub unused: u64,
}

/// What to do with the request.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Continue,
    Reply(LocalReply),
    /// Pause until the blocking leases in [`Decision::needs`] are answered.
    Wait,
}

/// The decision for one request, with the work it leaves for the glue.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    /// Headers to add to the upstream's response (`ratelimit_headers_on_allow`).
    pub response_headers: Vec<(String, String)>,
    /// Per policy (index into `Policies::policies`): what it decided.
    pub outcomes: Vec<(usize, Outcome)>,
    /// Set when the local table could not decide.
    pub table_error: Option<TableError>,
    pub evictions: u32,
    pub needs: Vec<LeaseNeed>,
    pub returns: Vec<ReturnNeed>,
    /// Tokens of expired leases that cannot be returned, per policy.
    pub expired: Vec<(usize, u64)>,
}

impl Decision {
    fn new() -> Self {
        Self {
            verdict: Verdict::Continue,
            response_headers: Vec::new(),
            outcomes: Vec::new(),
            table_error: None,
            evictions: 0,
            needs: Vec::new(),
            returns: Vec::new(),
            expired: Vec::new(),
        }
    }
}

/// How this decision of a plan comes about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Attempt {
    /// How many times the request has already waited for leases.
    pub round: u32,
    /// The filter's own deadline passed: what still needs the limiter is undecided.
    pub deadline_passed: bool,
}

impl Attempt {
    /// A first decision that may not wait (the request cannot be paused for a callout).
    pub const NO_WAIT: Attempt = Attempt {
        round: 0,
        deadline_passed: true,
    };
}

/// What one policy's record says about the request.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    Allow {
        spend: Spend,
        outcome: Outcome,
        remaining: f64,
        reset_ms: u64,
    },
    Deny {
        outcome: Outcome,
        remaining: f64,
        retry_ms: u64,
    },
    /// Fail closed.
    Refuse,
    /// The lease does not cover the cost: ask for one and wait.
    Need { min: u64, want: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Spend {
    Nothing,
    Bucket(BucketState),
    Lease(u64),
}

/// Housekeeping collected while deciding (kept only from the decision that committed).
#[derive(Debug, Default)]
struct Scratch {
    needs: Vec<LeaseNeed>,
    returns: Vec<ReturnNeed>,
    expired: Vec<(usize, u64)>,
}

impl Scratch {
    fn drain_into(self, decision: &mut Decision) {
        decision.needs.extend(self.needs);
        decision.returns.extend(self.returns);
        decision.expired.extend(self.expired);
    }
}

/// The configured filter: validated policies plus the shared table.
#[derive(Debug, Clone)]
pub struct Engine {
    pub policies: Policies,
    table: SlotTable,
}

impl Engine {
    pub fn new(policies: Policies, table: SlotTable) -> Self {
        Self { policies, table }
    }

    pub fn table(&self) -> &SlotTable {
        &self.table
    }

    pub fn limiter(&self) -> Option<&LimiterSpec> {
        self.policies.limiter.as_ref()
    }

    pub fn policy(&self, index: usize) -> Option<&Policy> {
        self.policies.policies.get(index)
    }

    /// Matches policies and builds keys.
    pub fn plan(&self, facts: &RequestFacts, source: &impl RequestSource) -> Plan {
        let mut plan = Plan::default();
        for (index, policy) in self.policies.policies.iter().enumerate() {
            let Some(route) = policy.match_request(&facts.host, &facts.method, &facts.path) else {
                continue;
            };
            let anonymous = policy.on_missing_key == OnMissingKey::Anonymous;
            let key = match build_key(policy, route.route, facts, source, anonymous) {
                PolicyKey::Key(key) => key,
                PolicyKey::Missing => {
                    if policy.on_missing_key == OnMissingKey::Deny {
                        if policy.enforce {
                            plan.early_outcomes.push((index, Outcome::IdentityMissing));
                            if plan.refused.is_none() {
                                plan.refused = Some(response::identity_missing(&policy.name));
                            }
                        } else {
                            plan.early_outcomes.push((index, Outcome::ShadowDenied));
                        }
                    }
                    continue;
                }
            };
            let matched = Matched {
                index,
                bucket_id: local_bucket_id(&policy.name, &key),
                key,
                cost: route.cost,
            };
            if policy.enforce {
                plan.enforced.push(matched);
            } else {
                plan.shadow.push(matched);
            }
        }
        plan
    }

    /// Decides a plan against the shared table at `now_ms`.
    pub fn decide(
        &self,
        plan: &Plan,
        store: &impl SharedData,
        now_ms: u64,
        attempt: Attempt,
    ) -> Decision {
        let mut decision = Decision::new();
        if attempt.round == 0 {
            // Counted once, by the first decision of the request.
            decision
                .outcomes
                .extend(plan.early_outcomes.iter().copied());
        }
        if let Some(reply) = &plan.refused {
            decision.verdict = Verdict::Reply(reply.clone());
            return decision;
        }
        self.decide_enforced(plan, store, now_ms, attempt, &mut decision);
        if decision.verdict == Verdict::Continue {
            // Shadow policies see the traffic that is admitted, each on its own.
            for matched in &plan.shadow {
                self.decide_shadow(matched, store, now_ms, &mut decision);
            }
        }
        decision
    }

    fn decide_enforced(
        &self,
        plan: &Plan,
        store: &impl SharedData,
        now_ms: u64,
        attempt: Attempt,
        decision: &mut Decision,
    ) {
        let Some(items) = self.items(&plan.enforced) else {
            return;
        };
        if items.is_empty() {
            return;
        }
        let ids: Vec<&str> = plan.enforced.iter().map(|m| m.bucket_id.as_str()).collect();
        let scratch = RefCell::new(Scratch::default());
        let spends: RefCell<Vec<Spend>> = RefCell::new(Vec::new());
        let result = self.table.transact(
            store,
            &ids,
            now_ms,
            |records| {
                let mut scratch = scratch.borrow_mut();
                *scratch = Scratch::default();
                let steps: Vec<Step> = items
                    .iter()
                    .zip(records.iter_mut())
                    .map(|((m, policy), record)| {
                        self.step(policy, m, record, now_ms, attempt, &mut scratch)
                    })
                    .collect();
                let verdict = self.combine(&items, &steps, records, now_ms, &mut scratch);
                *spends.borrow_mut() = steps
                    .iter()
                    .map(|s| match s {
                        Step::Allow { spend, .. } if matches!(verdict.0, Verdict::Continue) => {
                            *spend
                        }
                        _ => Spend::Nothing,
                    })
                    .collect();
                for ((_, policy), record) in items.iter().zip(records.iter_mut()) {
                    settle(record, policy);
                }
                Txn::Commit(verdict)
            },
            |index, before, after, current| {
                // Undo the consumption only; housekeeping (flags, expiry) stays.
                if let Some(((_, policy), spend)) = items.get(index).zip(spends.borrow().get(index))
                {
                    match spend {
                        Spend::Lease(cost) => {
                            current.lease.tokens = current.lease.tokens.saturating_add(*cost)
                        }
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
                        Spend::Nothing => {}
                    }
                }
            },
        );
        match result {
            Ok(done) => {
                decision.evictions += done.evictions;
                let (verdict, outcomes, headers) = done.value;
                decision.verdict = verdict;
                decision.outcomes.extend(outcomes);
                decision.response_headers = headers;
                scratch.into_inner().drain_into(decision);
            }
            Err(error) => {
                decision.table_error = Some(error);
                for (m, policy) in &items {
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
            .map(|m| self.policies.policies.get(m.index).map(|p| (m, p)))
            .collect()
    }

    /// Combines the steps of all enforced policies into the request's verdict; applies the
    /// spends to the records when the request is admitted.
    #[allow(clippy::type_complexity)]
    fn combine(
        &self,
        items: &[(&Matched, &Policy)],
        steps: &[Step],
        records: &mut [Record],
        now_ms: u64,
        scratch: &mut Scratch,
    ) -> (Verdict, Vec<(usize, Outcome)>, Vec<(String, String)>) {
        let denials: Vec<PolicyStatus<'_>> = items
            .iter()
            .zip(steps)
            .filter_map(|((_, policy), step)| match step {
                Step::Deny {
                    remaining,
                    retry_ms,
                    ..
                } => Some(status(policy, *remaining, *retry_ms)),
                _ => None,
            })
            .collect();
        if !denials.is_empty() {
            let outcomes = items
                .iter()
                .zip(steps)
                .filter_map(|((m, _), step)| match step {
                    Step::Deny { outcome, .. } => Some((m.index, *outcome)),
                    _ => None,
                })
                .collect();
            return (
                Verdict::Reply(response::too_many_requests(&denials)),
                outcomes,
                Vec::new(),
            );
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
            for ((m, _), step) in items.iter().zip(steps) {
                if let Step::Need { min, want } = step {
                    scratch.needs.push(LeaseNeed {
                        policy: m.index,
                        key: m.key.clone(),
                        bucket_id: m.bucket_id.clone(),
                        min: *min,
                        want: *want,
                        blocking: true,
                    });
                }
            }
            return (Verdict::Wait, Vec::new(), Vec::new());
        }
        let mut outcomes = Vec::with_capacity(items.len());
        let mut statuses = Vec::with_capacity(items.len());
        for (((m, policy), step), record) in items.iter().zip(steps).zip(records.iter_mut()) {
            if let Step::Allow {
                spend,
                outcome,
                remaining,
                reset_ms,
            } = step
            {
                match spend {
                    Spend::Bucket(state) => record.bucket = Some(*state),
                    Spend::Lease(cost) => {
                        record.lease.tokens = record.lease.tokens.saturating_sub(*cost);
                        global::observe_spend(&mut record.lease, *cost, now_ms);
                        self.refill_if_low(m, policy, record, now_ms, scratch);
                    }
                    Spend::Nothing => {}
                }
                outcomes.push((m.index, *outcome));
                statuses.push(status(policy, *remaining, *reset_ms));
            }
        }
        let headers = if self.policies.response.ratelimit_headers_on_allow {
            response::allowed_headers(&statuses)
        } else {
            Vec::new()
        };
        (Verdict::Continue, outcomes, headers)
    }

    /// What one policy's record says. May change the record's housekeeping (expired leases,
    /// probe flags); consumption is applied by [`Engine::combine`] only if the request passes.
    fn step(
        &self,
        policy: &Policy,
        matched: &Matched,
        record: &mut Record,
        now_ms: u64,
        attempt: Attempt,
        scratch: &mut Scratch,
    ) -> Step {
        let cost = matched.cost;
        let settings = match (policy.scope, self.policies.limiter.as_ref()) {
            (Scope::Global, Some(settings)) => settings,
            _ => {
                return bucket_step(
                    &policy.limits,
                    record.bucket,
                    now_ms,
                    cost,
                    Outcome::Allowed,
                    Outcome::Denied,
                )
            }
        };
        let lease = &mut record.lease;
        let seq = lease.seq;
        if let Some((returnable, expired)) = global::expire(lease, now_ms) {
            if returnable > 0 {
                scratch.returns.push(ReturnNeed {
                    policy: matched.index,
                    key: matched.key.clone(),
                    seq,
                    unused: returnable,
                });
            }
            if expired > 0 {
                scratch.expired.push((matched.index, expired));
            }
        }
        if lease.denied_until_ms > now_ms {
            return Step::Deny {
                outcome: Outcome::Denied,
                remaining: 0.0,
                retry_ms: lease.denied_until_ms - now_ms,
            };
        }
        if lease.tokens >= cost {
            return Step::Allow {
                spend: Spend::Lease(cost),
                outcome: Outcome::Allowed,
                remaining: (lease.tokens - cost) as f64,
                reset_ms: policy
                    .limits
                    .millis_to_refill(policy.limits.capacity() - (lease.tokens - cost) as f64),
            };
        }
        if attempt.deadline_passed || lease.unavailable_until_ms > now_ms {
            if lease.unavailable_until_ms > now_ms && lease.pending_until_ms <= now_ms {
                // One probe per instance finds out when the limiter is back.
                lease.pending_until_ms = now_ms + settings.timeout.0 + DEADLINE_MARGIN_MS;
                scratch.needs.push(LeaseNeed {
                    policy: matched.index,
                    key: matched.key.clone(),
                    bucket_id: matched.bucket_id.clone(),
                    min: cost,
                    want: global::want(lease, cost, settings, now_ms),
                    blocking: false,
                });
            }
            return self.undecided(policy, record, now_ms, cost);
        }
        Step::Need {
            min: cost,
            want: global::want(lease, cost, settings, now_ms),
        }
    }

    /// The failure-mode wrapper: the one place that says what a policy does when the limiter
    /// cannot decide for it.
    fn undecided(&self, policy: &Policy, record: &Record, now_ms: u64, cost: u64) -> Step {
        let admit = Step::Allow {
            spend: Spend::Nothing,
            outcome: Outcome::FailOpen,
            remaining: 0.0,
            reset_ms: 0,
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

    fn refill_if_low(
        &self,
        m: &Matched,
        policy: &Policy,
        record: &mut Record,
        now_ms: u64,
        scratch: &mut Scratch,
    ) {
        let Some(settings) = self.policies.limiter.as_ref() else {
            return;
        };
        let lease = &mut record.lease;
        if policy.scope == Scope::Global
            && lease.pending_until_ms <= now_ms
            && global::below_low_water(lease, settings)
        {
            lease.pending_until_ms = now_ms + settings.timeout.0 + DEADLINE_MARGIN_MS;
            scratch.needs.push(LeaseNeed {
                policy: m.index,
                key: m.key.clone(),
                bucket_id: m.bucket_id.clone(),
                min: m.cost,
                want: global::want(lease, m.cost, settings, now_ms),
                blocking: false,
            });
        }
    }

    fn decide_shadow(
        &self,
        matched: &Matched,
        store: &impl SharedData,
        now_ms: u64,
        decision: &mut Decision,
    ) {
        let Some(policy) = self.policies.policies.get(matched.index) else {
            return;
        };
        let scratch = RefCell::new(Scratch::default());
        let result = self.table.transact(
            store,
            &[matched.bucket_id.as_str()],
            now_ms,
            |records| {
                let mut scratch = scratch.borrow_mut();
                *scratch = Scratch::default();
                let Some(record) = records.first_mut() else {
                    return Txn::Abort(Outcome::FailOpen);
                };
                let step = self.step(
                    policy,
                    matched,
                    record,
                    now_ms,
                    Attempt::default(),
                    &mut scratch,
                );
                let outcome = match step {
                    Step::Allow { spend, outcome, .. } => {
                        match spend {
                            Spend::Bucket(state) => record.bucket = Some(state),
                            Spend::Lease(cost) => {
                                record.lease.tokens = record.lease.tokens.saturating_sub(cost);
                                global::observe_spend(&mut record.lease, cost, now_ms);
                                self.refill_if_low(matched, policy, record, now_ms, &mut scratch);
                            }
                            Spend::Nothing => {}
                        }
                        outcome
                    }
                    Step::Deny { .. } => Outcome::ShadowDenied,
                    Step::Refuse => Outcome::FailClosed,
                    Step::Need { min, want } => {
                        // Shadow never waits: ask in the background, count the request as allowed.
                        if let Some(settings) = self.policies.limiter.as_ref() {
                            if record.lease.pending_until_ms <= now_ms {
                                record.lease.pending_until_ms =
                                    now_ms + settings.timeout.0 + DEADLINE_MARGIN_MS;
                                scratch.needs.push(LeaseNeed {
                                    policy: matched.index,
                                    key: matched.key.clone(),
                                    bucket_id: matched.bucket_id.clone(),
                                    min,
                                    want,
                                    blocking: false,
                                });
                            }
                        }
                        Outcome::Allowed
                    }
                };
                settle(record, policy);
                Txn::Commit(outcome)
            },
            |_, _, _, _| {},
        );
        match result {
            Ok(done) => {
                decision.evictions += done.evictions;
                decision.outcomes.push((matched.index, done.value));
                scratch.into_inner().drain_into(decision);
            }
            Err(error) => {
                decision.table_error = Some(error);
                decision.outcomes.push((matched.index, Outcome::FailOpen));
            }
        }
    }

    /// Credits a limiter answer to a key's record.
    pub fn credit(
        &self,
        store: &impl SharedData,
        need: &LeaseNeed,
        grant: &tollgate_core::protocol::LeaseGranted,
        seq: u64,
        now_ms: u64,
    ) -> Result<(), TableError> {
        let policy = self.policies.policies.get(need.policy);
        self.table.update(store, &need.bucket_id, now_ms, |record| {
            global::apply_grant(record, grant, seq, now_ms);
            if let Some(policy) = policy {
                settle(record, policy);
            }
        })
    }

    /// Records that the limiter could not decide for a key.
    pub fn mark_unavailable(
        &self,
        store: &impl SharedData,
        need: &LeaseNeed,
        now_ms: u64,
    ) -> Result<(), TableError> {
        let (Some(settings), Some(policy)) = (
            self.policies.limiter.as_ref(),
            self.policies.policies.get(need.policy),
        ) else {
            return Ok(());
        };
        self.table.update(store, &need.bucket_id, now_ms, |record| {
            global::apply_unavailable(record, settings, now_ms);
            settle(record, policy);
        })
    }
}

fn bucket_step(
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

/// The limits of a record's token bucket: the policy's own for `local` policies; for `global`
/// ones the bucket is the fallback budget (`share` of the rate) used while the limiter is away.
fn bucket_limits(policy: &Policy) -> Limits {
    match (policy.scope, policy.failure) {
        (Scope::Global, FailureMode::Local { share, .. }) => policy.limits.scaled(share),
        _ => policy.limits,
    }
}

/// Sets when a record becomes the same as a fresh one (its slot may then be reused).
fn settle(record: &mut Record, policy: &Policy) {
    let limits = bucket_limits(policy);
    let bucket_full_at = record.bucket.map_or(0, |b| b.full_at_ms(&limits));
    let lease = &record.lease;
    let lease_live = if lease.tokens > 0 {
        lease.expires_ms
    } else {
        0
    };
    record.evictable_at_ms = bucket_full_at
        .max(lease_live)
        .max(lease.pending_until_ms)
        .max(lease.denied_until_ms)
        .max(lease.unavailable_until_ms);
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

fn status(policy: &Policy, remaining: f64, reset_ms: u64) -> PolicyStatus<'_> {
    PolicyStatus {
        policy: &policy.name,
        units: policy.units,
        per_ms: policy.per_ms,
        remaining,
        reset_ms,
    }
}

#[cfg(test)]
mod tests;
