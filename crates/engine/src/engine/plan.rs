//! Plan: which policies apply to a request (`match`, then `when`), with their keys and costs. Computed once per
//! request; the same plan is decided again after each wait for the limiter.
//!
//! A cost is the route's constant, or a reserved estimate: read from a request header here,
//! or from the request body once it has arrived ([`Engine::read_body`]); clamped by the
//! policy, so no client can reserve more than `reserve.max` or less than `reserve.min`.

use super::{Engine, Matched, Outcome, Plan};
use crate::request::{choose_entry, conditions_hold, write_key, RequestFacts, RequestSource};
use tollgate_core::policy::{OnMissingKey, Policy, UnitsSource};
use tollgate_core::response;
use tollgate_core::usage::{units_from_json, units_from_text};

impl Engine {
    /// Matches policies and builds keys.
    pub fn plan(&self, facts: &RequestFacts<'_>, source: &impl RequestSource) -> Plan {
        let mut plan = Plan::default();
        for (index, policy) in self.policies.policies.iter().enumerate() {
            let Some(route) = policy.match_request(&facts.host, &facts.method, &facts.path) else {
                continue;
            };
            // A policy whose conditions do not hold is skipped as one whose `match` does not.
            if !policy.when.is_empty() && !conditions_hold(policy, &route, facts, source) {
                continue;
            }
            if let Some(tag) = &policy.tag {
                // Removed from every request the policy matches, whatever it decides.
                if !plan.tag_headers.contains(tag) {
                    plan.tag_headers.push(tag.clone());
                }
            }
            let anonymous = policy.on_missing_key == OnMissingKey::Anonymous;
            let Some(mut matched) = Matched::new(index, &policy.name, |key| {
                let from = key.len();
                write_key(key, policy, route.route, facts, source, anonymous)
                    // `limits`: the entry that rates the request is the key's last part (none
                    // applies: the request is one without its identity).
                    && match policy.limits_by.as_deref() {
                        Some(by) => choose_entry(by, key, from, source),
                        None => true,
                    }
            }) else {
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
            };
            (matched.cost, matched.from_body) = estimate(policy, route.cost, source);
            if policy.enforce {
                plan.enforced.push(matched);
            } else {
                plan.shadow.push(matched);
            }
        }
        plan
    }

    /// Most request body bytes the plan's estimates read (0: none waits for the body).
    pub fn body_bytes_wanted(&self, plan: &Plan) -> usize {
        plan.matched()
            .filter(|m| m.from_body.is_some())
            .filter_map(|m| match &self.policies.policies.get(m.index)?.reserve {
                Some(reserve) => match &reserve.source {
                    UnitsSource::Body { max_bytes, .. } => Some(*max_bytes),
                    _ => None,
                },
                None => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Estimates the costs that wait for the request body. `body`: the whole body, or `None`
    /// when there is none or it is longer than the filter reads; a body past a policy's
    /// `max_bytes`, not JSON or without the field takes that policy's default.
    pub fn read_body(&self, plan: &mut Plan, body: Option<&[u8]>) {
        for matched in plan.enforced.iter_mut().chain(plan.shadow.iter_mut()) {
            let Some(plus) = matched.from_body.take() else {
                continue;
            };
            let Some(reserve) = self
                .policies
                .policies
                .get(matched.index)
                .and_then(|p| p.reserve.as_ref())
            else {
                continue;
            };
            let value = match (&reserve.source, body) {
                (UnitsSource::Body { path, max_bytes }, Some(body)) if body.len() <= *max_bytes => {
                    units_from_json(body, path)
                }
                _ => None,
            };
            matched.cost = reserve.units(plus, value);
        }
    }
}

/// A matched policy's cost: the route's constant, or the estimate it reserves (with the
/// route's constant part, when the estimate waits for the body).
fn estimate(policy: &Policy, constant: u64, source: &impl RequestSource) -> (u64, Option<u64>) {
    let Some(reserve) = &policy.reserve else {
        return (constant, None);
    };
    match &reserve.source {
        UnitsSource::Header(name) => {
            let value = source.with_header(name, |v| v.and_then(units_from_text));
            (reserve.units(constant, value), None)
        }
        UnitsSource::Body { .. } => (reserve.units(constant, None), Some(constant)),
        UnitsSource::Trailer(_) => (reserve.units(constant, None), None),
    }
}
