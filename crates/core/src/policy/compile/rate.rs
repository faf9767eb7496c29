//! `rate`, `burst` and `algorithm`: the numbers a policy (or one `limits` entry) decides with.

use super::{Cx, MAX_BURST, MAX_UNITS};
use crate::bucket::Limits;
use crate::calendar::RatePeriod;
use crate::policy::model::Algorithm;
use crate::policy::spec::{AlgorithmName, RateSpec};
use crate::window::{Window, MAX_LOG_LIMIT};

/// A rate as compiled: the numbers a policy (or one `limits` entry) decides with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rated {
    pub(super) units: u64,
    pub(super) per_ms: u64,
    pub(super) burst: u64,
    pub(super) limits: Limits,
    pub(super) algorithm: Algorithm,
}

/// The rate that stands for the policy: `rate` and `burst`, or those of the `limits` entry
/// that does (the default, else the first value, else the first override), with the prefix of
/// its fields.
pub(super) fn written_rate<'s>(cx: &mut Cx<'s>) -> Option<(&'s RateSpec, u64, String)> {
    let spec = cx.spec;
    match (&spec.rate, &spec.limits) {
        (Some(rate), None) => Some((rate, spec.burst, String::new())),
        (None, Some(limits)) => {
            if spec.burst != 0 {
                cx.push("burst", "with `limits`, each entry carries its own `burst`");
            }
            let first = limits
                .default
                .as_ref()
                .map(|d| (d, "limits.default.".to_string()))
                .or_else(|| {
                    limits
                        .values
                        .iter()
                        .next()
                        .map(|(v, d)| (d, format!("limits.values.{v}.")))
                })
                .or_else(|| {
                    limits
                        .overrides
                        .iter()
                        .next()
                        .map(|(k, d)| (d, format!("limits.overrides.{k}.")))
                });
            match first {
                Some((entry, prefix)) => Some((&entry.rate, entry.burst, prefix)),
                None => {
                    cx.push(
                        "limits",
                        "needs at least one entry (`values`, `default` or `overrides`)",
                    );
                    None
                }
            }
        }
        (Some(_), Some(_)) => {
            cx.push(
                "rate",
                "`rate` and `limits` exclude each other: with `limits`, each entry has its rate",
            );
            None
        }
        (None, None) => {
            cx.push(
                "rate",
                "required (or `limits`: a rate per value of an identity fact)",
            );
            None
        }
    }
}

/// A rate and burst under the policy's algorithm; `cx` names the fields (`rate.units`,
/// `burst`) where they are written.
pub(super) fn compile_rate(cx: &mut Cx<'_>, rate: &RateSpec, written_burst: u64) -> Option<Rated> {
    let spec = cx.spec;
    let before = cx.mark();
    if rate.units == 0 || rate.units > MAX_UNITS {
        cx.push("rate.units", format!("must be between 1 and {MAX_UNITS}"));
    }
    let per_ms = rate.per.nominal_ms();
    if per_ms == 0 {
        cx.push("rate.per", "must be longer than 0ms");
    }
    if let (Some(calendar), false) = (
        rate.per.calendar(),
        spec.algorithm == AlgorithmName::FixedWindow,
    ) {
        cx.push(
            "rate.per",
            format!(
                "a calendar period (`{calendar}`) counts fixed windows: set `algorithm: \
                 fixed_window`, or state a duration (e.g. `30d`)"
            ),
        );
    }
    let windowed = spec.algorithm != AlgorithmName::TokenBucket;
    if windowed {
        if written_burst != 0 {
            cx.push(
                "burst",
                "a windowed algorithm admits `rate.units` per `rate.per`: leave `burst` out",
            );
        }
    } else if written_burst == 0 || written_burst > MAX_BURST {
        cx.push("burst", format!("must be between 1 and {MAX_BURST}"));
    }
    // A window's limit is its burst: what may pass at once.
    let burst = if windowed {
        rate.units.min(MAX_BURST)
    } else {
        written_burst
    };
    let algorithm = compile_algorithm(cx, rate);
    if cx.failed_since(before) {
        return None;
    }
    Some(Rated {
        units: rate.units,
        per_ms,
        burst,
        limits: Limits::new(rate.units, per_ms, burst)?,
        algorithm: algorithm?,
    })
}

fn compile_algorithm(cx: &mut Cx<'_>, rate: &RateSpec) -> Option<Algorithm> {
    let window = match rate.per {
        RatePeriod::Duration(ms) => Window::new(rate.units, ms.0),
        RatePeriod::Calendar(c) => Window::calendar(rate.units, c),
    };
    let algorithm = match cx.spec.algorithm {
        AlgorithmName::TokenBucket => return Some(Algorithm::TokenBucket),
        AlgorithmName::FixedWindow => Algorithm::FixedWindow(window?),
        AlgorithmName::SlidingWindow => Algorithm::SlidingWindow(window?),
        AlgorithmName::SlidingLog => {
            if rate.units > MAX_LOG_LIMIT {
                cx.push(
                    "rate.units",
                    format!(
                        "a sliding log keeps one entry per unit: at most {MAX_LOG_LIMIT} per window \
                         (use sliding_window for more)"
                    ),
                );
                return None;
            }
            Algorithm::SlidingLog(window?)
        }
    };
    Some(algorithm)
}

/// `reserve` and `settle` need the token bucket (whatever the rate, or rates, of the policy).
pub(super) fn check_settled_algorithm(cx: &mut Cx<'_>) {
    let spec = cx.spec;
    let algorithm = match spec.algorithm {
        AlgorithmName::TokenBucket => return,
        AlgorithmName::FixedWindow => "fixed_window",
        AlgorithmName::SlidingWindow => "sliding_window",
        AlgorithmName::SlidingLog => "sliding_log",
    };
    for (field, set) in [
        ("reserve", spec.reserve.is_some()),
        ("settle", spec.settle.is_some()),
    ] {
        if set {
            cx.push(
                field,
                format!("costs settled after the response need the token bucket, not {algorithm}"),
            );
        }
    }
}
