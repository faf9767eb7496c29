//! `shape` and `max_in_flight`: how a policy holds requests besides counting them (delayed to
//! the rate, or capped in number at once).

use super::Cx;
use crate::duration::Millis;
use crate::policy::model::{InFlightLimit, Shape};
use crate::policy::spec::AlgorithmName;

const MAX_SHAPE_DELAY_MS: u64 = 30_000;
const DEFAULT_MAX_WAITING: u32 = 64;
const MAX_WAITING: u32 = 10_000;
const MAX_IN_FLIGHT: u32 = 1_000_000;
const DEFAULT_IN_FLIGHT_TIMEOUT: Millis = Millis(60_000);
const MAX_IN_FLIGHT_TIMEOUT_MS: u64 = 24 * 3_600_000;

pub(super) fn compile_shape(cx: &mut Cx<'_>) -> Option<Shape> {
    let spec = cx.spec;
    let shape = spec.shape.as_ref()?;
    if spec.algorithm != AlgorithmName::TokenBucket {
        cx.push(
            "shape",
            "only the token bucket shapes (delays requests to its rate)",
        );
        return None;
    }
    if spec.settle.is_some() || spec.reserve.is_some() {
        cx.push(
            "shape",
            "a shaped policy spaces requests by their cost at admission: not with reserve or settle",
        );
        return None;
    }
    if shape.max_delay.0 == 0 || shape.max_delay.0 > MAX_SHAPE_DELAY_MS {
        cx.push(
            "shape.max_delay",
            "must be between 1ms and 30s (requests wait paused in Envoy)",
        );
        return None;
    }
    let max_waiting = shape.max_waiting.unwrap_or(DEFAULT_MAX_WAITING);
    if max_waiting == 0 || max_waiting > MAX_WAITING {
        cx.push(
            "shape.max_waiting",
            format!("must be between 1 and {MAX_WAITING}"),
        );
        return None;
    }
    Some(Shape {
        max_delay_ms: shape.max_delay.0,
        max_waiting,
    })
}

pub(super) fn compile_in_flight(cx: &mut Cx<'_>) -> Option<InFlightLimit> {
    let spec = cx.spec;
    let Some(max) = spec.max_in_flight else {
        if spec.in_flight_timeout.is_some() {
            cx.push("in_flight_timeout", "belongs to `max_in_flight`");
        }
        return None;
    };
    // 0: no request may be in flight, so every request the policy applies to is refused.
    if max > MAX_IN_FLIGHT {
        cx.push(
            "max_in_flight",
            format!("must be between 0 (refuse every request) and {MAX_IN_FLIGHT}"),
        );
        return None;
    }
    let timeout = spec.in_flight_timeout.unwrap_or(DEFAULT_IN_FLIGHT_TIMEOUT);
    if timeout.0 < 1_000 || timeout.0 > MAX_IN_FLIGHT_TIMEOUT_MS {
        cx.push("in_flight_timeout", "must be between 1s and 24h");
        return None;
    }
    Some(InFlightLimit {
        max,
        timeout_ms: timeout.0,
    })
}
