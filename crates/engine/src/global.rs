//! The global stage's pure rules: how big a lease to ask for, how a limiter answer or a
//! failure changes a key's record, and the callout messages. No proxy-wasm here.

use crate::table::{Lease, Record};
use std::collections::BTreeMap;
use tollgate_core::policy::LimiterSpec;
use tollgate_core::protocol::{
    ErrorCode, LeaseBatch, LeaseBatchResponse, LeaseGranted, LeaseRequest, LeaseReturn,
    ReturnBatch, ReturnBatchResponse,
};

/// Extra time a waiting request is given beyond the callout timeout before the filter's own
/// deadline answers it with the failure mode.
pub const DEADLINE_MARGIN_MS: u64 = 10;

/// How long a background refill may wait for other needs to share its callout (see
/// `LeaseNeed::may_linger`). Refills start with a quarter of the grant left, about a quarter of
/// `lease_horizon` of demand (250 ms by default), so the wait costs nothing at a steady rate;
/// under many keys it makes one callout of several refills.
pub const REFILL_LINGER_MS: u64 = 10;

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

/// Records one offered request (admitted or denied) in the demand estimate (a smoothed rate
/// per second): the limiter sizes assignments by it, so it must count what is denied too.
pub fn observe_demand(lease: &mut Lease, units: u64, now_ms: u64) {
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

/// The demand estimate, units per second: the smoothed rate, or the current window's when it
/// is higher (demand that just rose).
pub fn demand_per_s(lease: &Lease, now_ms: u64) -> f64 {
    let elapsed = now_ms.saturating_sub(lease.window_start_ms);
    let current = if lease.window_start_ms > 0 && elapsed >= 50 {
        lease.window_units as f64 * 1000.0 / elapsed as f64
    } else {
        0.0
    };
    lease.rate_per_s.max(current)
}

/// How many tokens to ask for: enough for `lease_horizon` of the recent local demand, at least
/// `min`, at most `lease_max` (so `lease_max: 1` means one callout per request).
pub fn want(lease: &Lease, min: u64, settings: &LimiterSpec, now_ms: u64) -> u64 {
    let rate = demand_per_s(lease, now_ms);
    let horizon = settings.lease_horizon.0 as f64 / 1000.0;
    let estimate = if rate > 0.0 {
        (rate * horizon).ceil() as u64
    } else {
        min.saturating_mul(4)
    };
    estimate.max(min).min(settings.lease_max.max(min))
}

/// The demand to report with a lease request: the estimate, and at least what `want` asks
/// for over the horizon (a first request has no estimate yet).
pub fn reported_demand(lease: &Lease, want: u64, settings: &LimiterSpec, now_ms: u64) -> f64 {
    let horizon_s = (settings.lease_horizon.0 as f64 / 1000.0).max(0.001);
    demand_per_s(lease, now_ms).max(want as f64 / horizon_s)
}

/// Credits what the assignment has dripped since it was last credited (whole tokens; the
/// fraction is carried).
pub fn accrue(lease: &mut Lease, now_ms: u64) {
    let end = now_ms.min(lease.drip_until_ms);
    if lease.drip_per_ms <= 0.0 || end <= lease.drip_from_ms {
        return;
    }
    let dripped = lease.drip_carry + lease.drip_per_ms * (end - lease.drip_from_ms) as f64;
    let whole = (dripped + 1e-9).floor().max(0.0);
    lease.tokens = lease.tokens.saturating_add(whole as u64);
    lease.drip_carry = (dripped - whole).max(0.0);
    lease.drip_from_ms = end;
}

/// Stops the running drip now (before asking to renew: the limiter gives back the rest of the
/// running assignment when it decides the renewal, so nothing may drip after the ask).
pub fn stop_drip(lease: &mut Lease, now_ms: u64) {
    accrue(lease, now_ms);
    lease.drip_until_ms = lease.drip_until_ms.min(now_ms);
}

/// Whether requests are decided against an assignment (no callout on their path).
pub fn assigned(lease: &Lease, now_ms: u64) -> bool {
    lease.assigned_until_ms > now_ms
}

/// Milliseconds until the assignment has dripped enough for `cost` (what a denied request's
/// `Retry-After` says: this instance's own next chance, at its current share).
pub fn assignment_retry_ms(lease: &Lease, cost: u64, now_ms: u64) -> u64 {
    let missing = cost as f64 - lease.tokens as f64 - lease.drip_carry;
    if missing <= 0.0 {
        return 1;
    }
    if lease.drip_per_ms <= 0.0 {
        return lease.assigned_until_ms.saturating_sub(now_ms).max(1);
    }
    let ms = (missing / lease.drip_per_ms).ceil();
    if ms >= u64::MAX as f64 {
        u64::MAX
    } else {
        (ms as u64).max(1)
    }
}

/// Pays the key's debt (units used beyond reservations) from the lease's tokens, as far as
/// they go.
pub fn pay_debt(lease: &mut Lease) {
    let paid = lease.tokens.min(lease.debt);
    lease.tokens -= paid;
    lease.debt -= paid;
}

/// Whether the assignment is due for renewal: three quarters through its period; or, a
/// quarter through, when the demand has grown to more than twice what the last request
/// reported (a share sized from a young demand estimate grows within a period, not after it).
pub fn renewal_due(lease: &Lease, now_ms: u64) -> bool {
    if !assigned(lease, now_ms) || lease.pending_until_ms > now_ms {
        return false;
    }
    if now_ms >= lease.renew_at_ms {
        return true;
    }
    let quarter = lease.renew_at_ms.saturating_sub(lease.assigned_at_ms) / 3;
    now_ms >= lease.assigned_at_ms.saturating_add(quarter)
        && demand_per_s(lease, now_ms) > 2.0 * lease.asked_demand_per_s
}

/// Whether the lease has fallen below its low-water mark (time for a background refill).
pub fn below_low_water(lease: &Lease, settings: &LimiterSpec) -> bool {
    (lease.tokens as f64) < settings.low_water * lease.granted as f64 || lease.tokens == 0
}

/// Unspent tokens taken out of a lease: what to give back under which lease id, and what
/// can be given back under none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Expiry {
    /// `(seq, unused)`: the previous lease's part, then the latest lease's (`unused` 0: none).
    pub returns: [(u64, u64); 2],
    /// Leftovers of leases older than the previous one, or beyond what a lease granted.
    pub expired: u64,
}

/// Splits the lease's unspent tokens by the lease they are from: `(latest, previous,
/// unattributed)`. Tokens are spent oldest first, so the latest lease keeps up to what it
/// granted, the previous one up to its `prev_tokens` of the rest, and what is left over is
/// from older leases (or beyond a grant) and can be returned under no id.
fn split(lease: &Lease) -> (u64, u64, u64) {
    let latest = lease.tokens.min(lease.granted);
    let previous = (lease.tokens - latest).min(lease.prev_tokens);
    (latest, previous, lease.tokens - latest - previous)
}

fn forget_previous(lease: &mut Lease) {
    lease.prev_seq = 0;
    lease.prev_tokens = 0;
    lease.prev_expires_ms = 0;
}

/// Whether [`expire`] has anything to do: the latest lease expired with tokens left, or the
/// previous one expired.
pub fn expiry_due(lease: &Lease, now_ms: u64) -> bool {
    latest_expired(lease, now_ms) || previous_expired(lease, now_ms)
}

fn latest_expired(lease: &Lease, now_ms: u64) -> bool {
    lease.tokens > 0 && lease.expires_ms <= now_ms
}

fn previous_expired(lease: &Lease, now_ms: u64) -> bool {
    lease.prev_seq != 0 && lease.prev_expires_ms <= now_ms
}

/// Takes the unspent tokens of expired leases out of the lease. When the latest lease has
/// expired, everything is taken: each lease's part to give back under its own id, at most
/// what that lease granted, and the rest as expired; the lease is emptied. When only the
/// previous lease has expired (a token bucket's earlier lease), its part is taken (the
/// limiter remembers a lease id for a bounded time after it can no longer be spent) and the
/// latest lease runs on. `None` when nothing is to be given back.
pub fn expire(lease: &mut Lease, now_ms: u64) -> Option<Expiry> {
    let (latest, previous, unattributed) = split(lease);
    if latest_expired(lease, now_ms) {
        let out = Expiry {
            returns: [(lease.prev_seq, previous), (lease.seq, latest)],
            expired: unattributed,
        };
        lease.tokens = 0;
        lease.granted = 0;
        forget_previous(lease);
        return Some(out);
    }
    if previous_expired(lease, now_ms) {
        let seq = lease.prev_seq;
        lease.tokens -= previous;
        forget_previous(lease);
        if previous > 0 {
            return Some(Expiry {
                returns: [(seq, previous), (0, 0)],
                expired: 0,
            });
        }
    }
    None
}

/// Applies a limiter answer for this key to its record. `fresh` is false for an answer that
/// replays a lease id asked long ago: its tokens are credited, but its share is not started
/// (the limiter may have replaced that assignment since, and dripping it could overspend).
///
/// `windowed` (a fixed window, sliding window counter or sliding log): the limiter counts the
/// lease's units only until a time it states as `expires_ms` from when it decided, so the
/// lease expires `expires_ms` after `asked_ms`, when this instance asked (before the limiter
/// decided: the answer's trip back is not added), and never outlives the expiry of units
/// still unspent from an earlier lease (the limiter gives two leases of one window, or of one
/// slot of a log's grid, the same end; tokens of a lease already expired are dropped, not
/// carried into the new one). A token bucket's lease runs `expires_ms` from the answer (its
/// units were taken from the bucket when granted; the expiry only bounds how long they may
/// be stranded).
///
/// A grant under a new lease id makes the lease so far the previous one (see
/// [`Lease::prev_seq`]). The record keeps two lease ids: the part of the one before, if
/// any is unspent, is taken out and comes back as `(seq, unused)`, to give back now (a
/// token bucket's only: the limiter takes back nothing of a windowed lease).
pub fn apply_grant(
    record: &mut Record,
    grant: &LeaseGranted,
    lease_seq: u64,
    at: GrantTimes,
    fresh: bool,
) -> Option<(u64, u64)> {
    let GrantTimes {
        now_ms,
        asked_ms,
        windowed,
    } = at;
    let lease = &mut record.lease;
    let mut displaced = None;
    stop_drip(lease, now_ms);
    lease.pending_until_ms = 0;
    lease.unavailable_since_ms = 0;
    lease.unavailable_until_ms = 0;
    let share = if fresh && grant.share_per_s.is_finite() && grant.share_per_s > 0.0 {
        grant.share_per_s / 1000.0
    } else {
        0.0
    };
    if grant.granted > 0 || share > 0.0 {
        let drip_total = (share * grant.period_ms as f64 + 1e-9).floor();
        let expires_ms = if windowed {
            let ends = asked_ms.min(now_ms).saturating_add(grant.expires_ms);
            if lease.tokens > 0 && lease.expires_ms <= now_ms {
                // Units of a window that ended: the limiter no longer counts them.
                lease.tokens = 0;
            }
            if lease.tokens > 0 {
                ends.min(lease.expires_ms)
            } else {
                ends
            }
        } else {
            now_ms.saturating_add(grant.expires_ms)
        };
        if lease_seq != lease.seq {
            // The lease so far becomes the previous one, with its unspent part; the part of
            // the one before it is given back now. A windowed lease's units are not taken
            // back by the limiter (it counts them until the window's end): they stay to be
            // spent, first.
            let (latest, previous, _) = split(lease);
            if previous > 0 && !windowed {
                lease.tokens -= previous;
                displaced = Some((lease.prev_seq, previous));
            }
            if latest > 0 {
                lease.prev_seq = lease.seq;
                lease.prev_tokens = latest;
                lease.prev_expires_ms = lease.expires_ms;
            } else {
                forget_previous(lease);
            }
        }
        lease.tokens = lease.tokens.saturating_add(grant.granted);
        lease.granted = grant.granted.saturating_add(drip_total as u64);
        lease.seq = lease_seq;
        lease.expires_ms = expires_ms;
        lease.denied_until_ms = 0;
    } else {
        // Over limit: remember it exactly as long as the limiter said, never longer.
        lease.denied_until_ms = now_ms.saturating_add(grant.retry_after_ms.max(1));
    }
    if share > 0.0 {
        let period = grant.period_ms;
        lease.drip_per_ms = share;
        lease.drip_from_ms = now_ms;
        lease.drip_until_ms = now_ms.saturating_add(period);
        lease.assigned_until_ms = now_ms.saturating_add(period);
        lease.assigned_at_ms = now_ms;
        lease.renew_at_ms = now_ms.saturating_add(period - period / 4);
    } else {
        lease.drip_per_ms = 0.0;
        lease.drip_carry = 0.0;
        lease.assigned_until_ms = 0;
        lease.renew_at_ms = 0;
    }
    displaced
}

/// When a limiter answer is credited: now, when the key's lease was asked for (no later than
/// the callout was sent), and whether the policy is windowed (see [`apply_grant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantTimes {
    pub now_ms: u64,
    pub asked_ms: u64,
    pub windowed: bool,
}

impl GrantTimes {
    /// A token bucket's answer credited at `now_ms`.
    pub fn bucket(now_ms: u64) -> Self {
        Self {
            now_ms,
            asked_ms: now_ms,
            windowed: false,
        }
    }
}

/// Applies "the limiter could not decide" to a key's lease bookkeeping.
pub fn apply_unavailable(lease: &mut Lease, settings: &LimiterSpec, now_ms: u64) {
    lease.pending_until_ms = 0;
    if lease.unavailable_since_ms == 0 {
        lease.unavailable_since_ms = now_ms;
    }
    lease.unavailable_until_ms = now_ms.saturating_add(settings.unavailable_backoff.0);
    // What the limiter now holds for us is unknown: decide no more against an assignment.
    stop_drip(lease, now_ms);
    lease.assigned_until_ms = 0;
}

/// A lease id, unique per Envoy instance (`instance`), worker and lease (`seq`).
pub fn lease_id(instance: u64, seq: u64) -> String {
    format!("{instance:016x}-{seq:x}")
}

/// `POST /v1/leases` body, with the units settled per policy since the last report.
pub fn lease_body(requests: Vec<LeaseRequest>, settled: BTreeMap<String, u64>) -> Vec<u8> {
    serde_json::to_vec(&LeaseBatch {
        leases: requests,
        settled,
    })
    .unwrap_or_default()
}

/// `POST /v1/leases/return` body, with the units settled per policy since the last report.
pub fn return_body(returns: Vec<LeaseReturn>, settled: BTreeMap<String, u64>) -> Vec<u8> {
    serde_json::to_vec(&ReturnBatch { returns, settled }).unwrap_or_default()
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
            observe_demand(&mut lease, 4, 1_000 + t * 10);
        }
        // 400 units/s over 250 ms ≈ 100, capped at lease_max.
        assert_eq!(want(&lease, 1, &settings(80), 2_000), 80);
        let w = want(&lease, 1, &settings(1_000), 2_000);
        assert!((90..=110).contains(&w), "{w}");
        // Batching off: exactly the request's cost.
        assert_eq!(want(&lease, 5, &settings(1), 2_000), 5);
    }

    #[test]
    fn by_default_a_lease_covers_a_second_of_demand_up_to_a_thousand() {
        let settings: LimiterSpec =
            serde_json::from_str(r#"{"cluster":"l"}"#).unwrap_or_else(|e| panic!("{e}"));
        let at_rate = |per_10ms: u64| {
            let mut lease = Lease::default();
            for t in 0..200u64 {
                observe_demand(&mut lease, per_10ms, 1_000 + t * 10);
            }
            want(&lease, 1, &settings, 3_000)
        };
        // 300 units/s: one second's worth, not cut to a hundred.
        let w = at_rate(3);
        assert!((290..=310).contains(&w), "{w}");
        // 5,000 units/s: capped at lease_max.
        assert_eq!(at_rate(50), 1_000);
        assert_eq!(settings.lease_max, 1_000);
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
        apply_grant(&mut record, &grant, 7, GrantTimes::bucket(1_000), true);
        assert_eq!(record.lease.tokens, 30);
        assert_eq!(record.lease.expires_ms, 3_000);
        assert_eq!(record.lease.pending_until_ms, 0);
        let denied = LeaseGranted {
            granted: 0,
            retry_after_ms: 1_234,
            ..grant
        };
        apply_grant(&mut record, &denied, 8, GrantTimes::bucket(1_000), true);
        assert_eq!(record.lease.denied_until_ms, 2_234);
        assert_eq!(record.lease.tokens, 30);
    }

    #[test]
    fn a_window_lease_expires_from_the_ask_and_never_outlives_unspent_units() {
        let mut record = Record::fresh("p:k");
        let grant = LeaseGranted {
            id: "x".into(),
            granted: 4,
            remaining: 0.0,
            retry_after_ms: 0,
            expires_ms: 500,
            share_per_s: 0.0,
            period_ms: 0,
        };
        let at = |now_ms, asked_ms| GrantTimes {
            now_ms,
            asked_ms,
            windowed: true,
        };
        // Asked at 900, answered at 1,000: the limiter decided in between, so its 500 ms end
        // by 1,400 at the latest.
        apply_grant(&mut record, &grant, 1, at(1_000, 900), true);
        assert_eq!((record.lease.tokens, record.lease.expires_ms), (4, 1_400));
        // A second lease of the same window ends no later than the units still unspent.
        let second = LeaseGranted {
            expires_ms: 300,
            ..grant.clone()
        };
        apply_grant(&mut record, &second, 2, at(1_200, 1_150), true);
        assert_eq!((record.lease.tokens, record.lease.expires_ms), (8, 1_400));
        // A lease of the next window: what is left of the last one's window is not carried.
        apply_grant(&mut record, &grant, 3, at(1_450, 1_420), true);
        assert_eq!((record.lease.tokens, record.lease.expires_ms), (4, 1_920));
        // A token bucket's lease runs from the answer and keeps what is left.
        apply_grant(&mut record, &grant, 4, GrantTimes::bucket(1_500), true);
        assert_eq!((record.lease.tokens, record.lease.expires_ms), (8, 2_000));
    }

    #[test]
    fn expiry_returns_at_most_the_latest_grant() {
        let mut lease = Lease {
            tokens: 50,
            granted: 20,
            seq: 3,
            expires_ms: 100,
            ..Lease::default()
        };
        assert_eq!(expire(&mut lease, 99), None);
        assert_eq!(
            expire(&mut lease, 100),
            Some(Expiry {
                returns: [(0, 0), (3, 20)],
                expired: 30,
            })
        );
        assert_eq!(lease.tokens, 0);
        assert_eq!(expire(&mut lease, 200), None);
    }

    fn grant(granted: u64, expires_ms: u64) -> LeaseGranted {
        LeaseGranted {
            id: "x".into(),
            granted,
            remaining: 0.0,
            retry_after_ms: 0,
            expires_ms,
            share_per_s: 0.0,
            period_ms: 0,
        }
    }

    /// Credits a token bucket's lease of `granted` (expiring 1 s after `now_ms`) as `seq`.
    fn credit(record: &mut Record, granted: u64, seq: u64, now_ms: u64) -> Option<(u64, u64)> {
        apply_grant(
            record,
            &grant(granted, 1_000),
            seq,
            GrantTimes::bucket(now_ms),
            true,
        )
    }

    #[test]
    fn a_refill_merged_into_a_lease_returns_each_lease_its_unspent_part() {
        let mut record = Record::fresh("p:k");
        assert_eq!(credit(&mut record, 10, 1, 0), None);
        record.lease.tokens -= 3;
        // A small refill while 7 of the first lease are unspent.
        assert_eq!(credit(&mut record, 2, 2, 50), None);
        let l = &record.lease;
        assert_eq!((l.tokens, l.granted, l.seq), (9, 2, 2));
        assert_eq!(
            (l.prev_seq, l.prev_tokens, l.prev_expires_ms),
            (1, 7, 1_000)
        );
        // Spent oldest first: 4 of the first lease's 7.
        record.lease.tokens -= 4;
        let mut lease = record.lease;
        assert_eq!(
            expire(&mut lease, 1_050),
            Some(Expiry {
                returns: [(1, 3), (2, 2)],
                expired: 0,
            })
        );
        assert_eq!((lease.tokens, lease.prev_seq, lease.prev_tokens), (0, 0, 0));
        // Spent into the latest lease: the first one has nothing left, the latest keeps the
        // rest (never more than it granted).
        let mut lease = Lease {
            tokens: 1,
            ..record.lease
        };
        assert_eq!(
            expire(&mut lease, 1_050),
            Some(Expiry {
                returns: [(1, 0), (2, 1)],
                expired: 0,
            })
        );
    }

    #[test]
    fn the_previous_lease_is_returned_at_its_own_expiry_and_the_latest_runs_on() {
        let mut record = Record::fresh("p:k");
        credit(&mut record, 10, 1, 0);
        credit(&mut record, 5, 2, 500);
        record.lease.tokens -= 2;
        let mut lease = record.lease;
        assert_eq!(expire(&mut lease, 999), None);
        assert_eq!(
            expire(&mut lease, 1_000),
            Some(Expiry {
                returns: [(1, 8), (0, 0)],
                expired: 0,
            })
        );
        assert_eq!((lease.tokens, lease.granted, lease.prev_seq), (5, 5, 0));
        assert_eq!(expire(&mut lease, 1_400), None);
        assert_eq!(
            expire(&mut lease, 1_500),
            Some(Expiry {
                returns: [(0, 0), (2, 5)],
                expired: 0,
            })
        );
        // A previous lease spent to nothing is forgotten at its expiry without a return.
        credit(&mut record, 5, 3, 900);
        let mut lease = Lease {
            tokens: 5,
            ..record.lease
        };
        assert_eq!(lease.prev_seq, 2);
        assert_eq!(expire(&mut lease, 1_500), None);
        assert_eq!((lease.tokens, lease.prev_seq), (5, 0));
    }

    #[test]
    fn a_third_lease_gives_back_the_oldest_part_at_once() {
        let mut record = Record::fresh("p:k");
        credit(&mut record, 10, 1, 0);
        credit(&mut record, 3, 2, 100);
        record.lease.tokens -= 4;
        // 9 unspent: 3 of lease 2 (spent last), 6 of lease 1.
        assert_eq!(credit(&mut record, 2, 3, 200), Some((1, 6)));
        let l = &record.lease;
        assert_eq!((l.tokens, l.seq, l.granted), (5, 3, 2));
        assert_eq!((l.prev_seq, l.prev_tokens), (2, 3));
        // The same id answered again (a replay) keeps the previous lease as it is.
        assert_eq!(credit(&mut record, 2, 3, 300), None);
        assert_eq!((record.lease.prev_seq, record.lease.prev_tokens), (2, 3));
        // A windowed lease whose window ended drops its tokens: no previous lease is kept.
        let windowed = |now_ms| GrantTimes {
            now_ms,
            asked_ms: now_ms,
            windowed: true,
        };
        apply_grant(&mut record, &grant(2, 1_000), 4, windowed(5_000), true);
        assert_eq!((record.lease.tokens, record.lease.prev_seq), (2, 0));
        // Windowed units are never taken back: a third lease leaves the oldest part to spend.
        apply_grant(&mut record, &grant(1, 1_000), 5, windowed(5_100), true);
        let displaced = apply_grant(&mut record, &grant(1, 1_000), 6, windowed(5_200), true);
        assert_eq!(displaced, None);
        let l = &record.lease;
        assert_eq!((l.tokens, l.prev_seq, l.prev_tokens), (4, 5, 1));
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
