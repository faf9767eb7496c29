//! Validation of a parsed document into [`Policies`]: the document's own sections here, and one
//! policy part by part (a module per part), every problem collected with its field path.

mod cost;
mod key;
mod limits;
mod matcher;
mod outcome;
mod rate;
mod shape;
mod when;

pub use cost::MAX_BODY_READ;
pub use limits::MAX_LIMIT_ENTRIES;

use super::error::{PolicyError, PolicyErrors};
use super::model::{Policies, Policy};
use super::spec::{LimiterSpec, LocalTableSpec, PolicyDocument, PolicySpec};
use crate::key::{digest_hex, is_valid_policy_name};
use serde_json::Value;
use std::collections::HashSet;

const MAX_POLICIES: usize = 1024;
const MAX_UNITS: u64 = 1_000_000_000_000;
const MAX_BURST: u64 = 1_000_000_000;

impl Policies {
    /// Parses and validates a document; all problems are reported at once.
    pub fn from_json(bytes: &[u8]) -> Result<Self, PolicyErrors> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| {
            PolicyErrors(vec![PolicyError {
                policy: None,
                field: "(document)".into(),
                reason: format!("not valid JSON: {e}"),
            }])
        })?;
        let version = digest_hex(value.to_string().as_bytes(), 6);
        let document: PolicyDocument = serde_path_to_error::deserialize(&value).map_err(|e| {
            let field = e.path().to_string();
            PolicyErrors(vec![PolicyError {
                policy: policy_name_at(&value, &field),
                field,
                reason: e.into_inner().to_string(),
            }])
        })?;
        compile(document, version)
    }
}

/// The `name` of the policy a field path (`policies[3].rate`) points into, if any.
fn policy_name_at(value: &Value, field: &str) -> Option<String> {
    let index: usize = field
        .strip_prefix("policies[")?
        .split(']')
        .next()?
        .parse()
        .ok()?;
    value
        .get("policies")?
        .get(index)?
        .get("name")?
        .as_str()
        .map(str::to_string)
}

/// The problems found so far in a document.
struct Collector {
    errors: Vec<PolicyError>,
}

impl Collector {
    fn push(&mut self, policy: Option<&str>, field: String, reason: impl Into<String>) {
        self.errors.push(PolicyError {
            policy: policy.map(str::to_string),
            field,
            reason: reason.into(),
        });
    }
}

/// One policy under compilation: its spec, where the fields of the part being compiled are
/// written, and the document's problems. Every part's function takes this one value instead of
/// the spec, a field-naming closure, the policy's name and the collector.
struct Cx<'a> {
    spec: &'a PolicySpec,
    index: usize,
    /// Between `policies[i].` and a field: empty for the policy itself, `limits.default.` (and
    /// the like) for a `limits` entry's rate.
    prefix: String,
    errors: &'a mut Collector,
}

impl<'a> Cx<'a> {
    fn new(index: usize, spec: &'a PolicySpec, errors: &'a mut Collector) -> Self {
        Cx {
            spec,
            index,
            prefix: String::new(),
            errors,
        }
    }

    /// The path of `field` of the part being compiled.
    fn at(&self, field: &str) -> String {
        format!("policies[{}].{}{field}", self.index, self.prefix)
    }

    /// A problem with `field` of the part being compiled.
    fn push(&mut self, field: &str, reason: impl Into<String>) {
        let field = self.at(field);
        self.errors.push(Some(&self.spec.name), field, reason);
    }

    /// A mark to tell, with [`Cx::failed_since`], whether a part added problems.
    fn mark(&self) -> usize {
        self.errors.errors.len()
    }

    fn failed_since(&self, mark: usize) -> bool {
        self.errors.errors.len() > mark
    }

    /// The same policy, its fields written under `prefix` (e.g. `limits.default.`).
    fn under(&mut self, prefix: &str) -> Cx<'_> {
        Cx {
            spec: self.spec,
            index: self.index,
            prefix: format!("{}{prefix}", self.prefix),
            errors: self.errors,
        }
    }
}

fn compile(document: PolicyDocument, version: String) -> Result<Policies, PolicyErrors> {
    let mut errors = Collector { errors: Vec::new() };
    let policies = compile_policies(&document, &mut errors);
    if errors.errors.is_empty() {
        // Indices of `policies` are the document's only when every policy compiled.
        outcome::check_tag_headers(&policies, &mut errors);
    }
    let has_global = policies.iter().any(|p| p.scope.uses_limiter());
    match &document.limiter {
        Some(limiter) => check_limiter(limiter, &mut errors),
        None if has_global => errors.push(
            None,
            "limiter".into(),
            "required when a policy has scope `global` or `regional` (the Envoy cluster of the limiter)",
        ),
        None => {}
    }
    check_local_table(&document.local_table, &mut errors);
    if !errors.errors.is_empty() {
        return Err(PolicyErrors(errors.errors));
    }
    Ok(Policies {
        version,
        reads_host: policies.iter().any(|p| !p.hosts.is_empty()),
        policies,
        limiter: document.limiter,
        local_table: document.local_table,
        response: document.response,
    })
}

/// Each policy of the document that compiles, with the document's response default applied.
fn compile_policies(document: &PolicyDocument, errors: &mut Collector) -> Vec<Policy> {
    if document.policies.len() > MAX_POLICIES {
        errors.push(
            None,
            "policies".into(),
            format!("more than {MAX_POLICIES} policies"),
        );
    }
    let mut names = HashSet::new();
    let mut policies = Vec::new();
    for (index, spec) in document.policies.iter().enumerate() {
        if !names.insert(spec.name.as_str()) {
            errors.push(
                Some(&spec.name),
                format!("policies[{index}].name"),
                "duplicate policy name",
            );
        }
        if let Some(mut policy) = compile_policy(&mut Cx::new(index, spec, errors)) {
            policy.headers_on_allow = spec
                .ratelimit_headers_on_allow
                .unwrap_or(document.response.ratelimit_headers_on_allow);
            // Each `limits` entry is the policy at another rate: the same answer.
            if let Some(by) = policy.limits_by.as_mut() {
                let on = policy.headers_on_allow;
                by.values
                    .iter_mut()
                    .chain(by.overrides.iter_mut())
                    .map(|(_, p)| p)
                    .chain(by.default.iter_mut())
                    .for_each(|p| p.headers_on_allow = on);
            }
            policies.push(policy);
        }
    }
    policies
}

fn check_limiter(limiter: &LimiterSpec, errors: &mut Collector) {
    if limiter.cluster.trim().is_empty() {
        errors.push(
            None,
            "limiter.cluster".into(),
            "must name the Envoy cluster of the limiter",
        );
    }
    if limiter.timeout.0 == 0 || limiter.timeout.0 > 10_000 {
        errors.push(
            None,
            "limiter.timeout".into(),
            "must be between 1ms and 10s (requests wait for the limiter up to this long)",
        );
    }
    if limiter.authority.trim().is_empty() {
        errors.push(None, "limiter.authority".into(), "must not be empty");
    }
    if limiter.lease_horizon.0 == 0 {
        errors.push(
            None,
            "limiter.lease_horizon".into(),
            "must be longer than 0ms",
        );
    }
    if limiter.lease_max == 0 || limiter.lease_max > MAX_BURST {
        errors.push(
            None,
            "limiter.lease_max".into(),
            format!("must be between 1 and {MAX_BURST}"),
        );
    }
    if !(0.0..1.0).contains(&limiter.low_water) {
        errors.push(None, "limiter.low_water".into(), "must be in [0, 1)");
    }
    if limiter.unavailable_backoff.0 == 0 || limiter.unavailable_backoff.0 > 60_000 {
        errors.push(
            None,
            "limiter.unavailable_backoff".into(),
            "must be between 1ms and 60s",
        );
    }
}

fn check_local_table(local_table: &LocalTableSpec, errors: &mut Collector) {
    if !(16..=1 << 20).contains(&local_table.slots) {
        errors.push(
            None,
            "local_table.slots".into(),
            "must be between 16 and 1048576",
        );
    }
}

/// One policy, part by part; `None` when any part has a problem (all of them reported).
fn compile_policy(cx: &mut Cx<'_>) -> Option<Policy> {
    let spec = cx.spec;
    let before = cx.mark();
    if !is_valid_policy_name(&spec.name) {
        cx.push("name", "must be 1-64 characters of a-z, 0-9, `-`, `_`");
    }
    let matcher = matcher::compile_match(cx);
    let when = when::compile_when(cx, &matcher.routes);
    let key = key::compile_key(cx);

    // The rate: `rate` and `burst`, or those of the `limits` entry that stands for the policy.
    let rated = rate::written_rate(cx)
        .and_then(|(rate, burst, prefix)| rate::compile_rate(&mut cx.under(&prefix), rate, burst));
    let burst = rated.map_or(MAX_BURST, |r| r.burst);
    rate::check_settled_algorithm(cx);
    let shape = shape::compile_shape(cx);

    let route_costs = cost::compile_costs(cx, &matcher.routes, burst);
    let reserve = spec
        .reserve
        .as_ref()
        .and_then(|r| cost::compile_reserve(cx, r, burst));
    let settle = spec
        .settle
        .as_ref()
        .and_then(|s| cost::compile_settle(cx, s, burst));
    let in_flight = shape::compile_in_flight(cx);

    let failure = match outcome::compile_failure(&spec.on_unavailable) {
        Ok(f) => Some(f),
        Err((field, reason)) => {
            cx.push(&format!("on_unavailable.{field}"), reason);
            None
        }
    };

    let tag = outcome::compile_on_over_limit(cx);
    if cx.failed_since(before) {
        return None;
    }
    let rated = rated?;
    let mut policy = Policy {
        name: spec.name.clone(),
        hosts: matcher.hosts,
        routes: matcher.routes,
        route_costs,
        methods: matcher.methods,
        when,
        key,
        on_missing_key: spec.on_missing_key,
        units: rated.units,
        per_ms: rated.per_ms,
        burst: rated.burst,
        limits: rated.limits,
        scope: spec.scope,
        failure: failure?,
        enforce: spec.enforce,
        reserve,
        settle,
        in_flight,
        algorithm: rated.algorithm,
        shape,
        tag,
        // Resolved against the document's `response` by `compile_policies`.
        headers_on_allow: false,
        limits_by: None,
    };
    if let Some(limits) = &spec.limits {
        policy.limits_by = Some(Box::new(limits::compile_limits(cx, limits, &policy)?));
    }
    Some(policy)
}

/// A header name a policy document accepts: 1 to 128 bytes of lower-case `[a-z0-9._-]`.
pub fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
        })
}
