//! Plan: which policies apply to a request, with their keys and costs. Computed once per
//! request; the same plan is decided again after each wait for the limiter.

use super::{Engine, Matched, Outcome, Plan};
use crate::request::{build_key, PolicyKey, RequestFacts, RequestSource};
use tollgate_core::key::local_bucket_id;
use tollgate_core::policy::OnMissingKey;
use tollgate_core::response;

impl Engine {
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
}
