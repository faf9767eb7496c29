//! What a request costs: the constant per route (`cost`, or `reserve.plus`), the estimate
//! reserved at admission (`reserve`) and the actual cost settled at the end (`settle`).

use super::{is_header_name, Cx, MAX_BURST};
use crate::policy::model::{Reserve, Settle, UnitsSource};
use crate::policy::spec::{ReserveSpec, SettleSpec, UnitsSourceSpec};
use crate::route::RouteTemplate;
use crate::usage::FieldPath;

/// Longest body `reserve` or `settle` may read.
pub const MAX_BODY_READ: u64 = 1024 * 1024;
const DEFAULT_REQUEST_BODY_READ: u64 = 64 * 1024;
const DEFAULT_RESPONSE_BODY_READ: u64 = 256 * 1024;

/// The constant cost of each route of `routes` (in their order): `cost`, or with `reserve`
/// the constant part of the estimate, `reserve.plus`.
pub(super) fn compile_costs(cx: &mut Cx<'_>, routes: &[RouteTemplate], burst: u64) -> Vec<u64> {
    let spec = cx.spec;
    let (constants, constants_field, default_constant) = match &spec.reserve {
        Some(reserve) => {
            if !spec.cost.is_empty() {
                cx.push(
                    "cost",
                    "with `reserve`, a route's constant goes in `reserve.plus`",
                );
            }
            (&reserve.plus, "reserve.plus", 0)
        }
        None => (&spec.cost, "cost", 1),
    };
    let most = spec.reserve.as_ref().map_or(burst, |r| r.max);
    let mut route_costs = vec![default_constant; routes.len()];
    for (template, cost) in constants {
        let field = format!("{constants_field}[\"{template}\"]");
        let canonical = RouteTemplate::parse(template).map(|t| t.as_str().to_string());
        let position = canonical
            .as_ref()
            .ok()
            .and_then(|c| routes.iter().position(|r| r.as_str() == c));
        match position {
            None => cx.push(&field, "names no route of `match.routes`"),
            Some(_) if *cost < default_constant => cx.push(&field, "must be at least 1"),
            Some(_) if *cost > most => cx.push(
                &field,
                if spec.reserve.is_some() {
                    format!("{cost} is more than `reserve.max` ({most})")
                } else {
                    format!(
                        "{cost} is more than the burst ({burst}): such a request could never pass"
                    )
                },
            ),
            Some(i) => {
                if let Some(slot) = route_costs.get_mut(i) {
                    *slot = *cost;
                }
            }
        }
    }
    route_costs
}

/// Where units are read from; `field` is where the source is written (`reserve.from`).
fn compile_source(
    cx: &mut Cx<'_>,
    source: &UnitsSourceSpec,
    field: &str,
    default_bytes: u64,
) -> Option<UnitsSource> {
    match source {
        UnitsSourceSpec::Header(h) | UnitsSourceSpec::Trailer(h) => {
            if !is_header_name(h) || h.starts_with(':') {
                cx.push(field, format!("`{h}` is not a lower-case header name"));
                return None;
            }
            Some(match source {
                UnitsSourceSpec::Trailer(_) => UnitsSource::Trailer(h.clone()),
                _ => UnitsSource::Header(h.clone()),
            })
        }
        UnitsSourceSpec::Body(body) => {
            let path = match FieldPath::parse(&body.field) {
                Ok(path) => path,
                Err(reason) => {
                    cx.push(&format!("{field}.body.field"), reason);
                    return None;
                }
            };
            let max_bytes = body.max_bytes.unwrap_or(default_bytes);
            if max_bytes == 0 || max_bytes > MAX_BODY_READ {
                cx.push(
                    &format!("{field}.body.max_bytes"),
                    format!("must be between 1 and {MAX_BODY_READ}"),
                );
                return None;
            }
            Some(UnitsSource::Body {
                path,
                max_bytes: usize::try_from(max_bytes).ok()?,
            })
        }
    }
}

pub(super) fn compile_reserve(
    cx: &mut Cx<'_>,
    reserve: &ReserveSpec,
    burst: u64,
) -> Option<Reserve> {
    let before = cx.mark();
    if matches!(reserve.from, UnitsSourceSpec::Trailer(_)) {
        cx.push(
            "reserve.from",
            "a trailer arrives after admission: reserve from a `header` or the request `body`",
        );
    }
    let source = compile_source(cx, &reserve.from, "reserve.from", DEFAULT_REQUEST_BODY_READ);
    if reserve.min == 0 {
        cx.push("reserve.min", "must be at least 1");
    }
    if reserve.max < reserve.min {
        cx.push(
            "reserve.max",
            format!(
                "{} is less than `reserve.min` ({})",
                reserve.max, reserve.min
            ),
        );
    }
    if reserve.max > burst {
        cx.push(
            "reserve.max",
            format!(
                "{} is more than the burst ({burst}): such a reservation could never pass",
                reserve.max
            ),
        );
    }
    if reserve.default < reserve.min || reserve.default > reserve.max {
        cx.push(
            "reserve.default",
            format!("{} is not within [min, max]", reserve.default),
        );
    }
    if cx.failed_since(before) {
        return None;
    }
    Some(Reserve {
        source: source?,
        default: reserve.default,
        min: reserve.min,
        max: reserve.max,
    })
}

pub(super) fn compile_settle(cx: &mut Cx<'_>, settle: &SettleSpec, burst: u64) -> Option<Settle> {
    let source = compile_source(cx, &settle.from, "settle.from", DEFAULT_RESPONSE_BODY_READ)?;
    let max_debt = settle.max_debt.unwrap_or(burst);
    if max_debt > MAX_BURST {
        cx.push("settle.max_debt", format!("must be at most {MAX_BURST}"));
        return None;
    }
    Some(Settle {
        source,
        on_missing: settle.on_missing,
        max_debt,
    })
}
