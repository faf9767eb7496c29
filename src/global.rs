//! The global stage's pure rules: how big a lease to ask for, how a limiter answer or a
//! failure changes a key's record, and the callout messages. No proxy-wasm here.

use crate::table::{Lease, Record};
use tollgate_core::policy::LimiterSpec;
use tollgate_core::protocol::{
    ErrorCode, LeaseBatch, LeaseBatchResponse, LeaseGranted, LeaseRequest, LeaseReturn,
    ReturnBatch, ReturnBatchResponse,
};

/// Extra time a waiting request is given beyond the callout timeout before the filter's own
/// deadline answers it with the failure mode.
pub const DEADLINE_MARGIN_MS: u64 = 10;

/// Demand estimate window.
const WINDOW_MS: u64 = 1_000;

/// Why a callout gave no usable answer: all of them mean UNAVAILABLE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutError {
    /// The stream was reset or the connection failed (no response at all).
    NoResponse,
    /// A status other than 200 (503 from the limiter, 504 timeout from Envoy, ...).
    Status(u32),
    /// 200 with a body that is not a lease answer.
    Malformed(String),
}

/// Records one admitted spend in the demand estimate (a smoothed rate per second).
pub fn observe_spend(lease: &mut Lease, units: u64, now_ms: u64) {
    if lease.window_start_ms == 0 || now_ms < lease.window_start_ms {
        lease.window_start_ms = now_ms;
        lease.window_units = 0;
    }
    lease.window_units = lease.window_units.saturating_add(units);
    let elapsed = now_ms - lease.window_start_ms;
    if elapsed >= WINDOW_MS {
        let current = lease.window_units as f64 * 1000.0 / elapsed as f64;
        lease.rate_per_s = if lease.rate_per_s > 0.0 {
            0.5 * lease.rate_per_s + 0.5 * current
        } else {
            current
        };
        lease.window_start_ms = now_ms;
        lease.window_units = 0;
    }
}

/// How many tokens to ask for: enough for `lease_horizon` of the recent local demand, at least
/// `min`, at most `lease_max` (so `lease_max: 1` means one callout per request).
pub fn want(lease: &Lease, min: u64, settings: &LimiterSpec, now_ms: u64) -> u64 {
    let elapsed = now_ms.saturating_sub(lease.window_start_ms);
    let current = if lease.window_start_ms > 0 && elapsed >= 50 {
        lease.window_units as f64 * 1000.0 / elapsed as f64
    } else {
        0.0
    };
    let rate = lease.rate_per_s.max(current);
    let horizon = settings.lease_horizon.0 as f64 / 1000.0;
    let estimate = if rate > 0.0 {
        (rate * horizon).ceil() as u64
    } else {
        min.saturating_mul(4)
    };
    estimate.max(min).min(settings.lease_max.max(min))
}

/// Whether the lease has fallen below its low-water mark (time for a background refill).
pub fn below_low_water(lease: &Lease, settings: &LimiterSpec) -> bool {
    (lease.tokens as f64) < settings.low_water * lease.granted as f64 || lease.tokens == 0
}

/// Unspent tokens of an expired lease: `(returnable, expired)`; the lease is emptied.
/// Only what the latest lease granted can be returned under its id; older leftovers expire.
pub fn expire(lease: &mut Lease, now_ms: u64) -> Option<(u64, u64)> {
    if lease.tokens == 0 || lease.expires_ms > now_ms {
        return None;
    }
    let returnable = lease.tokens.min(lease.granted);
    let expired = lease.tokens - returnable;
    lease.tokens = 0;
    lease.granted = 0;
    Some((returnable, expired))
}

/// Applies a limiter answer for this key to its record.
pub fn apply_grant(record: &mut Record, grant: &LeaseGranted, lease_seq: u64, now_ms: u64) {
    let lease = &mut record.lease;
    lease.pending_until_ms = 0;
    lease.unavailable_since_ms = 0;
    lease.unavailable_until_ms = 0;
    if grant.granted > 0 {
        lease.tokens = lease.tokens.saturating_add(grant.granted);
        lease.granted = grant.granted;
        lease.seq = lease_seq;
        lease.expires_ms = now_ms.saturating_add(grant.expires_ms);
        lease.denied_until_ms = 0;
    } else {
        // Over limit: remember it exactly as long as the limiter said, never longer.
        lease.denied_until_ms = now_ms.saturating_add(grant.retry_after_ms.max(1));
    }
}

/// Applies "the limiter could not decide" to a key's record.
pub fn apply_unavailable(record: &mut Record, settings: &LimiterSpec, now_ms: u64) {
    let lease = &mut record.lease;
    lease.pending_until_ms = 0;
    if lease.unavailable_since_ms == 0 {
        lease.unavailable_since_ms = now_ms;
    }
    lease.unavailable_until_ms = now_ms.saturating_add(settings.unavailable_backoff.0);
}

/// A lease id, unique per Envoy instance (`instance`), worker and lease (`seq`).
pub fn lease_id(instance: u64, seq: u64) -> String {
    format!("{instance:016x}-{seq:x}")
}

/// `POST /v1/leases` body.
pub fn lease_body(requests: Vec<LeaseRequest>) -> Vec<u8> {
    serde_json::to_vec(&LeaseBatch { leases: requests }).unwrap_or_default()
}

/// `POST /v1/leases/return` body.
pub fn return_body(returns: Vec<LeaseReturn>) -> Vec<u8> {
    serde_json::to_vec(&ReturnBatch { returns }).unwrap_or_default()
}

/// Reads a lease answer: anything but a 200 with a well-formed body is UNAVAILABLE.
pub fn parse_lease_response(
    status: Option<u32>,
    body: &[u8],
) -> Result<LeaseBatchResponse, CalloutError> {
    match status {
        None => Err(CalloutError::NoResponse),
        Some(200) => {
            serde_json::from_slice(body).map_err(|e| CalloutError::Malformed(e.to_string()))
        }
        Some(other) => Err(CalloutError::Status(other)),
    }
}

/// Reads a return answer.
pub fn parse_return_response(
    status: Option<u32>,
    body: &[u8],
) -> Result<ReturnBatchResponse, CalloutError> {
    match status {
        None => Err(CalloutError::NoResponse),
        Some(200) => {
            serde_json::from_slice(body).map_err(|e| CalloutError::Malformed(e.to_string()))
        }
        Some(other) => Err(CalloutError::Status(other)),
    }
}

/// Per-item errors that mean "could not decide" rather than a configuration problem.
pub fn is_unavailable(code: ErrorCode) -> bool {
    code == ErrorCode::Unavailable
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::duration::Millis;

    fn settings(lease_max: u64) -> LimiterSpec {
        LimiterSpec {
            cluster: "l".into(),
            timeout: Millis(25),
            authority: "a".into(),
            lease_horizon: Millis(250),
            lease_max,
            low_water: 0.25,
            unavailable_backoff: Millis(500),
        }
    }

    #[test]
    fn want_follows_demand_within_bounds() {
        let mut lease = Lease::default();
        assert_eq!(want(&lease, 5, &settings(100), 0), 20);
        for t in 0..100u64 {
            observe_spend(&mut lease, 4, 1_000 + t * 10);
        }
        // 400 units/s over 250 ms ≈ 100, capped at lease_max.
        assert_eq!(want(&lease, 1, &settings(80), 2_000), 80);
        let w = want(&lease, 1, &settings(1_000), 2_000);
        assert!((90..=110).contains(&w), "{w}");
        // Batching off: exactly the request's cost.
        assert_eq!(want(&lease, 5, &settings(1), 2_000), 5);
    }

    #[test]
    fn grants_credit_and_denials_remember_exactly_the_retry() {
        let mut record = Record::fresh("p:k");
        record.lease.pending_until_ms = 99;
        let grant = LeaseGranted {
            id: "x".into(),
            granted: 30,
            remaining: 10.0,
            retry_after_ms: 0,
            expires_ms: 2_000,
            share_per_s: 0.0,
            period_ms: 0,
        };
        apply_grant(&mut record, &grant, 7, 1_000);
        assert_eq!(record.lease.tokens, 30);
        assert_eq!(record.lease.expires_ms, 3_000);
        assert_eq!(record.lease.pending_until_ms, 0);
        let denied = LeaseGranted {
            granted: 0,
            retry_after_ms: 1_234,
            ..grant
        };
        apply_grant(&mut record, &denied, 8, 1_000);
        assert_eq!(record.lease.denied_until_ms, 2_234);
        assert_eq!(record.lease.tokens, 30);
    }

    #[test]
    fn expiry_returns_at_most_the_latest_grant() {
        let mut lease = Lease {
            tokens: 50,
            granted: 20,
            expires_ms: 100,
            ..Lease::default()
        };
        assert_eq!(expire(&mut lease, 99), None);
        assert_eq!(expire(&mut lease, 100), Some((20, 30)));
        assert_eq!(lease.tokens, 0);
        assert_eq!(expire(&mut lease, 200), None);
    }

    #[test]
    fn responses_other_than_200_json_are_unavailable() {
        assert_eq!(
            parse_lease_response(None, b""),
            Err(CalloutError::NoResponse)
        );
        assert_eq!(
            parse_lease_response(Some(503), b"{}"),
            Err(CalloutError::Status(503))
        );
        assert!(matches!(
            parse_lease_response(Some(200), b"garbage"),
            Err(CalloutError::Malformed(_))
        ));
        let ok = parse_lease_response(
            Some(200),
            br#"{"leases":[{"id":"a","granted":3,"remaining":1.5,"retry_after_ms":0,"expires_ms":10}],"policy_version":"v"}"#,
        )
        .unwrap();
        assert_eq!(ok.leases.len(), 1);
    }
}
