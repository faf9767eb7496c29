//! The filter's decision for one request, free of proxy-wasm so it is tested natively:
//! match policies, build keys, charge the local buckets all-or-nothing, apply failure modes and
//! shadow mode, and say what to answer.

use crate::request::{build_key, PolicyKey, RequestFacts, RequestSource};
use crate::shared::SharedData;
use crate::table::{BucketView, Charge, SlotTable, TableError};
use tollgate_core::key::local_bucket_id;
use tollgate_core::policy::{FailureMode, OnMissingKey, Policies, Policy, Scope, Terminal};
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
}

/// The decision for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// `Some`: answer with this instead of forwarding.
    pub reply: Option<LocalReply>,
    /// Headers to add to the upstream's response (`ratelimit_headers_on_allow`).
    pub response_headers: Vec<(String, String)>,
    /// Per matched policy (index into `Policies::policies`): what it decided.
    pub outcomes: Vec<(usize, Outcome)>,
    /// Set when the local table could not decide.
    pub table_error: Option<TableError>,
    pub evictions: u32,
}

/// A policy that applies to the request, with its bucket and cost.
struct Matched<'a> {
    index: usize,
    policy: &'a Policy,
    bucket_id: String,
    cost: u64,
}

/// The configured filter: validated policies plus the shared bucket table.
#[derive(Debug, Clone)]
pub struct Engine {
    pub policies: Policies,
    table: SlotTable,
}

/// Problems that make a valid policy document unusable by this filter build.
pub fn check_supported(policies: &Policies) -> Result<(), String> {
    for (index, policy) in policies.policies.iter().enumerate() {
        if policy.scope == Scope::Global {
            return Err(format!(
                "policy `{}`: policies[{index}].scope: `global` needs the limiter integration, \
                 which this filter build does not have yet; use `local`",
                policy.name
            ));
        }
    }
    Ok(())
}

impl Engine {
    pub fn new(policies: Policies, table: SlotTable) -> Self {
        Self { policies, table }
    }

    pub fn evaluate(
        &self,
        facts: &RequestFacts,
        source: &impl RequestSource,
        store: &impl SharedData,
        now_ms: u64,
    ) -> Evaluation {
        let mut evaluation = Evaluation {
            reply: None,
            response_headers: Vec::new(),
            outcomes: Vec::new(),
            table_error: None,
            evictions: 0,
        };
        let mut enforced = Vec::new();
        let mut shadow = Vec::new();
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
                            evaluation.outcomes.push((index, Outcome::IdentityMissing));
                            if evaluation.reply.is_none() {
                                evaluation.reply = Some(response::identity_missing(&policy.name));
                            }
                        } else {
                            evaluation.outcomes.push((index, Outcome::ShadowDenied));
                        }
                    }
                    continue;
                }
            };
            let matched = Matched {
                index,
                policy,
                bucket_id: local_bucket_id(&policy.name, &key),
                cost: route.cost,
            };
            if policy.enforce {
                enforced.push(matched);
            } else {
                shadow.push(matched);
            }
        }
        if evaluation.reply.is_some() {
            // Refused before any bucket: a refused request consumes nothing.
            return evaluation;
        }
        self.enforce(&enforced, store, now_ms, &mut evaluation);
        if evaluation.reply.is_none() {
            // Shadow policies see the traffic that is admitted, each on its own.
            for matched in &shadow {
                self.shadow(matched, store, now_ms, &mut evaluation);
            }
        }
        evaluation
    }

    fn enforce(
        &self,
        enforced: &[Matched<'_>],
        store: &impl SharedData,
        now_ms: u64,
        evaluation: &mut Evaluation,
    ) {
        if enforced.is_empty() {
            return;
        }
        let charges: Vec<Charge<'_>> = enforced
            .iter()
            .map(|m| Charge {
                bucket_id: &m.bucket_id,
                limits: &m.policy.limits,
                cost: m.cost,
            })
            .collect();
        match self.table.charge(store, &charges, now_ms) {
            Ok(charged) => {
                evaluation.evictions += charged.evictions;
                let statuses: Vec<PolicyStatus<'_>> = enforced
                    .iter()
                    .zip(&charged.views)
                    .filter(|(_, view)| charged.allowed || !view.allowed)
                    .map(|(m, view)| status(m.policy, view))
                    .collect();
                if charged.allowed {
                    evaluation
                        .outcomes
                        .extend(enforced.iter().map(|m| (m.index, Outcome::Allowed)));
                    if self.policies.response.ratelimit_headers_on_allow {
                        evaluation.response_headers = response::allowed_headers(&statuses);
                    }
                } else {
                    evaluation.outcomes.extend(
                        enforced
                            .iter()
                            .zip(&charged.views)
                            .filter(|(_, view)| !view.allowed)
                            .map(|(m, _)| (m.index, Outcome::Denied)),
                    );
                    evaluation.reply = Some(response::too_many_requests(&statuses));
                }
            }
            Err(error) => {
                evaluation.table_error = Some(error);
                for m in enforced {
                    let outcome = when_undecided(m.policy);
                    evaluation.outcomes.push((m.index, outcome));
                    if outcome == Outcome::FailClosed && evaluation.reply.is_none() {
                        evaluation.reply = Some(response::limiter_unavailable(&m.policy.name));
                    }
                }
            }
        }
    }

    fn shadow(
        &self,
        matched: &Matched<'_>,
        store: &impl SharedData,
        now_ms: u64,
        evaluation: &mut Evaluation,
    ) {
        let charge = [Charge {
            bucket_id: &matched.bucket_id,
            limits: &matched.policy.limits,
            cost: matched.cost,
        }];
        let outcome = match self.table.charge(store, &charge, now_ms) {
            Ok(charged) => {
                evaluation.evictions += charged.evictions;
                if charged.allowed {
                    Outcome::Allowed
                } else {
                    Outcome::ShadowDenied
                }
            }
            Err(error) => {
                evaluation.table_error = Some(error);
                Outcome::FailOpen
            }
        };
        evaluation.outcomes.push((matched.index, outcome));
    }
}

/// The failure-mode wrapper: what a policy's outcome is when its bucket cannot be decided.
/// For the local stage, `local` mode has no better local budget to fall back to, so it goes
/// straight to its `then`.
pub fn when_undecided(policy: &Policy) -> Outcome {
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

fn status<'a>(policy: &'a Policy, view: &BucketView) -> PolicyStatus<'a> {
    PolicyStatus {
        policy: &policy.name,
        units: policy.units,
        per_ms: policy.per_ms,
        remaining: view.remaining,
        reset_ms: view.reset_ms,
    }
}

#[cfg(test)]
mod tests;
