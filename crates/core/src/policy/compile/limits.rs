//! `limits`: a rate per value of one trusted identity fact, a default, and overrides per key;
//! each entry compiles to the policy at the entry's rate.

use super::key::jwt_claim_path;
use super::rate::compile_rate;
use super::{is_header_name, Cx};
use crate::key;
use crate::policy::model::{KeyPart, LimitsBy, Policy, Settle};
use crate::policy::spec::{KeyPartSpec, LimitSpec, LimitsSpec, OnMissingKey};

/// Most entries of one policy's `limits` (values and overrides together).
pub const MAX_LIMIT_ENTRIES: usize = 1024;

/// The entries of a `limits`, each the compiled `base` policy with the entry's rate.
pub(super) fn compile_limits(
    cx: &mut Cx<'_>,
    limits: &LimitsSpec,
    base: &Policy,
) -> Option<LimitsBy> {
    let spec = cx.spec;
    let before = cx.mark();
    let by = compile_by(cx, &limits.by);
    if limits.values.len() + limits.overrides.len() > MAX_LIMIT_ENTRIES {
        cx.push(
            "limits",
            format!("at most {MAX_LIMIT_ENTRIES} entries in `values` and `overrides` together"),
        );
        return None;
    }
    if base.key.len() >= key::MAX_PARTS {
        cx.push(
            "key",
            format!(
                "at most {} parts with `limits` (the entry is a part of the bucket's key)",
                key::MAX_PARTS - 1
            ),
        );
    }
    if spec.on_missing_key == OnMissingKey::Anonymous && limits.default.is_none() {
        cx.push(
            "limits.default",
            "required with `on_missing_key: anonymous` (the shared bucket needs a rate)",
        );
    }
    let mut values = Vec::new();
    for (value, written) in &limits.values {
        let field = format!("limits.values.{value}");
        let escaped = key::escape_part(value.as_bytes());
        if value.is_empty()
            || escaped.starts_with('#')
            || escaped.len() > key::MAX_ENTRY_VALUE_BYTES
        {
            cx.push(
                &field,
                format!(
                    "a value must be 1 to {} bytes once escaped (as a key part)",
                    key::MAX_ENTRY_VALUE_BYTES
                ),
            );
            continue;
        }
        if let Some(policy) = compile_entry(&mut cx.under(&format!("{field}.")), written, base) {
            values.push((format!("{}{escaped}", key::VALUE_ENTRY_PREFIX), policy));
        }
    }
    let mut overrides = Vec::new();
    for (tenant, written) in &limits.overrides {
        let field = format!("limits.overrides.{tenant}");
        let parts = tenant.split(':').count();
        if key::validate_key(tenant).is_err()
            || key::split_entry(tenant).1.is_some()
            || parts != base.key.len()
        {
            cx.push(
                &field,
                format!(
                    "names a key as tollgate builds it: {} escaped part(s) joined by `:` \
                     (e.g. a tenant id)",
                    base.key.len()
                ),
            );
            continue;
        }
        if let Some(policy) = compile_entry(&mut cx.under(&format!("{field}.")), written, base) {
            overrides.push((tenant.clone(), policy));
        }
    }
    let default = limits
        .default
        .as_ref()
        .and_then(|d| compile_entry(&mut cx.under("limits.default."), d, base));
    if cx.failed_since(before) {
        return None;
    }
    values.sort_by(|a, b| a.0.cmp(&b.0));
    overrides.sort_by(|a, b| a.0.cmp(&b.0));
    Some(LimitsBy {
        by: by?,
        values,
        overrides,
        default,
    })
}

/// `limits.by`: a trusted header or a verified claim.
fn compile_by(cx: &mut Cx<'_>, by: &KeyPartSpec) -> Option<KeyPart> {
    match by {
        KeyPartSpec::Header(h) if is_header_name(h) => Some(KeyPart::Header(h.clone())),
        KeyPartSpec::Header(h) => {
            cx.push(
                "limits.by.header",
                format!("`{h}` is not a lower-case header name"),
            );
            None
        }
        KeyPartSpec::JwtClaim(claim) => match jwt_claim_path(claim) {
            Ok(path) => Some(KeyPart::JwtClaim { path }),
            Err((suffix, reason)) => {
                cx.push(&format!("limits.by{suffix}"), reason);
                None
            }
        },
        _ => {
            cx.push(
                "limits.by",
                "a plan is read from a trusted `header` or a verified `jwt_claim`",
            );
            None
        }
    }
}

/// One `limits` entry: the base policy with the entry's rate, checked against what the base
/// policy's costs, reservation and settlement need of a burst. `cx` names the entry's fields.
fn compile_entry(cx: &mut Cx<'_>, written: &LimitSpec, base: &Policy) -> Option<Policy> {
    let rated = compile_rate(cx, &written.rate, written.burst)?;
    let most = base.reserve.as_ref().map_or_else(
        || base.route_costs.iter().copied().max().unwrap_or(1),
        |r| r.max,
    );
    if most > rated.burst {
        cx.push(
            "burst",
            format!(
                "{} is less than the policy's largest cost or `reserve.max` ({most}): such a \
                 request could never pass",
                rated.burst
            ),
        );
        return None;
    }
    let settle = match (&base.settle, &cx.spec.settle) {
        (Some(settle), Some(written)) => Some(Settle {
            max_debt: written.max_debt.unwrap_or(rated.burst),
            ..settle.clone()
        }),
        (settle, _) => settle.clone(),
    };
    Some(Policy {
        units: rated.units,
        per_ms: rated.per_ms,
        burst: rated.burst,
        limits: rated.limits,
        algorithm: rated.algorithm,
        settle,
        limits_by: None,
        ..base.clone()
    })
}
