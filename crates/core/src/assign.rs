//! Leases and assignments of one global bucket: what the limiter hands an instance that asks.
//!
//! Below the limit an instance gets a **lease**: `granted` tokens taken from the bucket now
//! (as [`crate::bucket::lease`] sizes it). When the bucket cannot give an instance what its
//! demand asks for, the instance gets an **assignment** instead: a *share* of the bucket's
//! refill rate for one *period*. The whole `share × period` is taken from the bucket at once,
//! so the bucket may go below zero (debt), but the instance may only spend it as it drips in —
//! `share × elapsed` — and the bucket keeps the *holdings* of every instance (share, end,
//! reported demand), so the shares of live assignments never add up to more than the rate.
//!
//! Why no instance set can overshoot (`admitted(t) ≤ burst + rate·t`): let `B` be the bucket's
//! content and `U` the sum over live assignments of what has not dripped yet. Everything ever
//! taken from the bucket is `burst + rate·t − clamp losses − B`, and what instances may have
//! spent is at most that minus `U`; so spending stays within `burst + rate·t` while
//! `V = B + U ≥ 0`. Each transition keeps `V ≥ 0`: a lease takes at most the positive part of
//! `B` (`V` drops by at most `B ≤ V`); an assignment moves `share × period` from `B` to `U`
//! (`V` unchanged); giving back an assignment's undripped rest moves it from `U` to `B`
//! (unchanged, or lower where `B` clamps at capacity); and as time passes `V` grows at
//! `rate − Σ shares ≥ 0` while `B < capacity` (at capacity, `V ≥ capacity > 0`). An instance
//! that starts its drip when the answer arrives, and stops it when it asks to renew, spends no
//! sooner than the bucket assumed, which is conservative. `tests/assign_props.rs` checks it
//! for random interleavings against a model of the filter.
//!
//! Shares follow reported demand: with total demand `D` above the rate each holder gets
//! `rate × demand / D` (equal demand, equal shares; 3:1, 3:1); below it, its demand. A holder
//! that was asked to wait (share 0) still records its demand, so the others' next renewals
//! make room for it. A holding ends with its period, so an instance whose demand stops frees
//! its share within one period. Work is bounded by [`MAX_HOLDERS`] per bucket.
//!
//! The Redis Function (`tollgate_v4_lease`) mirrors [`allot`] line by line; the limiter's
//! property test replays random calls on both and demands identical answers.

use crate::bucket::{BucketState, Limits};

/// Float slack when comparing tokens to a cost (as in `bucket.rs`).
const EPSILON: f64 = 1e-9;

/// Most holdings one bucket keeps; an instance beyond them gets leases only.
pub const MAX_HOLDERS: usize = 64;

/// Longest holder id (an instance id).
pub const MAX_HOLDER_BYTES: usize = 64;

/// One instance's standing on a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct Holding {
    pub holder: String,
    /// Share of the refill rate assigned until `ends_ms` (0: none, only the demand is known).
    pub share_per_ms: f64,
    /// The holding is gone from this time on (exclusive: live while `now < ends_ms`).
    pub ends_ms: u64,
    /// The holder's reported demand, units per ms.
    pub demand_per_ms: f64,
}

/// What one instance asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask<'a> {
    /// Tokens the waiting request needs (`1 ≤ min ≤ capacity`).
    pub min: u64,
    /// Tokens its demand would like now (`min ≤ want ≤ capacity`).
    pub want: u64,
    /// The asking instance; without one only leases are given (older filters, tools).
    pub holder: Option<&'a str>,
    /// The instance's offered demand for this bucket, units per ms (finite, `≥ 0`).
    pub demand_per_ms: f64,
}

/// The limiter's terms for assignments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    /// Length of one assignment.
    pub period_ms: u64,
    /// How long a lease's tokens may be spent (its holding lasts as long: the tokens may come
    /// back within it).
    pub lease_ttl_ms: u64,
}

/// The answer to one ask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allotment {
    /// Tokens spendable now: `0` or within `[min, want]`.
    pub granted: u64,
    /// The bucket's content after this answer (negative while assignments run ahead of it).
    pub remaining: f64,
    /// When nothing was given (`granted == 0` and `share_per_ms == 0`): how long until asking
    /// again may give something (`min` tokens refilled, or another holding ending first).
    pub retry_after_ms: u64,
    /// Assigned share of the refill rate, units per ms (0: a plain lease or a denial).
    pub share_per_ms: f64,
    /// How long the share may be spent (0 without a share).
    pub period_ms: u64,
}

impl Allotment {
    /// Whether the ask got nothing at all.
    pub fn is_empty(&self) -> bool {
        self.granted == 0 && self.share_per_ms <= 0.0
    }

    /// Everything this answer took from the bucket, in whole tokens (what a later return of
    /// unused tokens may give back at most).
    pub fn taken(&self) -> u64 {
        let drip = (self.share_per_ms * self.period_ms as f64 + EPSILON).floor();
        let drip = if drip.is_finite() && drip > 0.0 {
            drip as u64
        } else {
            0
        };
        self.granted.saturating_add(drip)
    }
}

/// The bucket's content at `now_ms`: refilled up to capacity, never clamped at zero (debt of
/// running assignments stays). A bucket never seen is full; backward time refills nothing.
pub fn current(limits: &Limits, state: Option<BucketState>, now_ms: u64) -> BucketState {
    // `refilled` never clamps at zero either: the filter's buckets and assignments refill alike.
    state.map_or_else(
        || BucketState::full(limits, now_ms),
        |state| state.refilled(limits, now_ms),
    )
}

/// Decides one ask against a bucket and its holdings (mutated in place: expired holdings are
/// dropped, the rest sorted by holder id, the asker's moved to the end with its new terms).
/// Returns the bucket's next state and the answer.
pub fn allot(
    limits: &Limits,
    state: Option<BucketState>,
    holdings: &mut Vec<Holding>,
    now_ms: u64,
    ask: Ask<'_>,
    terms: Terms,
) -> (BucketState, Allotment) {
    let mut bucket = current(limits, state, now_ms);
    let cap = limits.capacity();
    let rate = limits.refill_per_ms();
    holdings.retain(|h| h.ends_ms > now_ms);
    // One order for every store (sums of floats depend on it): by holder id.
    holdings.sort_by(|a, b| a.holder.cmp(&b.holder));

    // The asker's running assignment ends now: its undripped rest goes back to the bucket.
    let mut had_holding = false;
    if let Some(holder) = ask.holder {
        if let Some(pos) = holdings.iter().position(|h| h.holder == holder) {
            let own = holdings.remove(pos);
            had_holding = true;
            if own.share_per_ms > 0.0 {
                let rest = own.share_per_ms * (own.ends_ms - now_ms) as f64;
                bucket.tokens = (bucket.tokens + rest).min(cap);
            }
        }
    }

    let min = ask.min.max(1);
    let want = ask.want.max(min);
    let tokens = bucket.tokens;
    let available = (tokens + EPSILON).floor();
    let mut granted = 0u64;
    let mut retry_after_ms = 0;
    if available < min as f64 {
        retry_after_ms = limits.millis_to_refill(min as f64 - tokens);
    } else {
        let fill = (tokens / cap).clamp(0.0, 1.0);
        let scaled = (available * fill).floor() as u64;
        granted = scaled.max(min).min(want).min(available as u64);
        bucket.tokens = (tokens - granted as f64).max(0.0);
    }

    let Some(holder) = ask.holder else {
        return (
            bucket,
            answer(bucket.tokens, granted, retry_after_ms, 0.0, 0),
        );
    };
    let room = had_holding || holdings.len() < MAX_HOLDERS;
    if available >= want as f64 || !room {
        // The bucket holds what the demand asks for: below the limit, a lease (sized by the
        // fill ratio) is the answer (also when there is no room to assign). Remember the
        // holder while its tokens may still come back, so others' denials know budget is
        // parked here.
        if room && granted > 0 {
            holdings.push(Holding {
                holder: holder.to_owned(),
                share_per_ms: 0.0,
                ends_ms: now_ms.saturating_add(terms.lease_ttl_ms),
                demand_per_ms: ask.demand_per_ms,
            });
        }
        return (
            bucket,
            answer(bucket.tokens, granted, retry_after_ms, 0.0, 0),
        );
    }

    // An assignment. The bucket cannot give what the demand asks, so its whole content goes
    // out now (fill scaling keeps leases small below the limit; over it, what stayed in the
    // bucket while shares run would go unused)...
    if available >= min as f64 {
        granted = available as u64;
        bucket.tokens = (tokens - granted as f64).max(0.0);
    }
    // ...and a share of the rate by demand, within what other holders leave free.
    let mut others_share = 0.0;
    let mut total_demand = ask.demand_per_ms;
    let mut first_end = u64::MAX;
    for h in holdings.iter() {
        others_share += h.share_per_ms;
        total_demand += h.demand_per_ms;
        first_end = first_end.min(h.ends_ms);
    }
    let target = if total_demand <= rate {
        ask.demand_per_ms
    } else {
        rate * ask.demand_per_ms / total_demand
    };
    let mut share = target.min(rate - others_share);
    if share.is_nan() || share <= rate * 1e-6 {
        share = 0.0;
    }
    let period_ms = if share > 0.0 { terms.period_ms } else { 0 };
    bucket.tokens -= share * period_ms as f64;
    holdings.push(Holding {
        holder: holder.to_owned(),
        share_per_ms: share,
        ends_ms: now_ms.saturating_add(terms.period_ms),
        demand_per_ms: ask.demand_per_ms,
    });
    if granted == 0 && share == 0.0 && first_end != u64::MAX {
        // Budget is held elsewhere: ask again when the first other holding ends, if that is
        // sooner than the refill.
        retry_after_ms = retry_after_ms.min((first_end - now_ms).max(1));
    }
    if granted > 0 || share > 0.0 {
        retry_after_ms = 0;
    }
    (
        bucket,
        answer(bucket.tokens, granted, retry_after_ms, share, period_ms),
    )
}

fn answer(
    remaining: f64,
    granted: u64,
    retry_after_ms: u64,
    share_per_ms: f64,
    period_ms: u64,
) -> Allotment {
    Allotment {
        granted,
        remaining,
        retry_after_ms,
        share_per_ms,
        period_ms,
    }
}

/// Gives `unused` tokens back to a bucket that may be in debt, never above capacity.
pub fn give_back(
    limits: &Limits,
    state: Option<BucketState>,
    now_ms: u64,
    unused: u64,
) -> BucketState {
    let current = current(limits, state, now_ms);
    BucketState {
        tokens: (current.tokens + unused as f64).min(limits.capacity()),
        ..current
    }
}

/// How long a bucket's state must outlive its last write: a full refill from its content
/// (debt included), so that dropping it and recreating it full loses nothing.
pub fn refill_from_ms(limits: &Limits, state: &BucketState) -> u64 {
    limits.millis_to_refill(limits.capacity() - state.tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        // 50 units/s, burst 15.
        Limits::new(50, 1_000, 15).unwrap()
    }

    const TERMS: Terms = Terms {
        period_ms: 1_000,
        lease_ttl_ms: 2_000,
    };

    fn ask(holder: &str, min: u64, want: u64, demand_per_s: f64) -> Ask<'_> {
        Ask {
            min,
            want,
            holder: Some(holder),
            demand_per_ms: demand_per_s / 1_000.0,
        }
    }

    #[test]
    fn a_full_bucket_gives_a_lease_and_remembers_the_holder() {
        let mut h = Vec::new();
        let (s, a) = allot(&limits(), None, &mut h, 0, ask("a", 1, 10, 10.0), TERMS);
        assert_eq!(a.granted, 10);
        assert_eq!(a.share_per_ms, 0.0);
        assert_eq!(s.tokens, 5.0);
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].ends_ms, 2_000);
    }

    #[test]
    fn a_drained_bucket_assigns_shares_by_demand() {
        let l = limits();
        let mut h = Vec::new();
        let drained = Some(BucketState {
            tokens: 0.0,
            updated_ms: 0,
        });
        // a alone, demand 150/s > rate 50/s: the whole rate.
        let (s, a) = allot(&l, drained, &mut h, 0, ask("a", 1, 15, 150.0), TERMS);
        assert_eq!(a.granted, 0);
        assert!((a.share_per_ms - 0.05).abs() < 1e-12);
        assert_eq!(a.period_ms, 1_000);
        assert!((s.tokens + 50.0).abs() < 1e-9);
        // b arrives: nothing free until a renews; told to come back when a's holding ends.
        let (s, b) = allot(&l, Some(s), &mut h, 100, ask("b", 1, 15, 150.0), TERMS);
        assert!(b.is_empty());
        assert_eq!(b.retry_after_ms, 900);
        // a renews at 750 ms: half the rate now (equal demand), its undripped rest comes back.
        let (s, a) = allot(&l, Some(s), &mut h, 750, ask("a", 1, 15, 150.0), TERMS);
        assert!((a.share_per_ms - 0.025).abs() < 1e-12, "{a:?}");
        // b asks again: the other half.
        let (_, b) = allot(&l, Some(s), &mut h, 1_000, ask("b", 1, 15, 150.0), TERMS);
        assert!((b.share_per_ms - 0.025).abs() < 1e-12, "{b:?}");
        let total: f64 = h.iter().map(|x| x.share_per_ms).sum();
        assert!(total <= l.refill_per_ms() + 1e-12);
    }

    #[test]
    fn shares_follow_a_three_to_one_demand() {
        let l = limits();
        let mut h = vec![Holding {
            holder: "b".into(),
            share_per_ms: 0.0125,
            ends_ms: 1_500,
            demand_per_ms: 0.05,
        }];
        let debt = Some(BucketState {
            tokens: -30.0,
            updated_ms: 1_000,
        });
        let (_, a) = allot(&l, debt, &mut h, 1_000, ask("a", 1, 15, 150.0), TERMS);
        assert!((a.share_per_ms - 0.0375).abs() < 1e-12, "{a:?}");
    }

    #[test]
    fn below_the_rate_a_share_is_the_demand_and_expired_holdings_go() {
        let l = limits();
        let mut h = vec![Holding {
            holder: "gone".into(),
            share_per_ms: 0.05,
            ends_ms: 500,
            demand_per_ms: 1.0,
        }];
        let low = Some(BucketState {
            tokens: 2.0,
            updated_ms: 600,
        });
        let (s, a) = allot(&l, low, &mut h, 600, ask("a", 1, 15, 20.0), TERMS);
        // Over the limit the bucket's whole content goes out, plus the share.
        assert_eq!(a.granted, 2);
        assert!((s.tokens + 20.0).abs() < 1e-9);
        assert!((a.share_per_ms - 0.02).abs() < 1e-12);
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].holder, "a");
    }

    #[test]
    fn without_a_holder_only_leases() {
        let l = limits();
        let mut h = Vec::new();
        let empty = Some(BucketState {
            tokens: 0.0,
            updated_ms: 0,
        });
        let a = Ask {
            min: 5,
            want: 5,
            holder: None,
            demand_per_ms: 1.0,
        };
        let (_, g) = allot(&l, empty, &mut h, 0, a, TERMS);
        assert!(g.is_empty());
        assert_eq!(g.retry_after_ms, 100);
        assert!(h.is_empty());
    }

    #[test]
    fn holdings_are_bounded() {
        let l = limits();
        let mut h: Vec<Holding> = (0..MAX_HOLDERS)
            .map(|i| Holding {
                holder: format!("h{i}"),
                share_per_ms: 0.0,
                ends_ms: 10_000,
                demand_per_ms: 0.001,
            })
            .collect();
        let empty = Some(BucketState {
            tokens: 0.0,
            updated_ms: 0,
        });
        let (_, g) = allot(&l, empty, &mut h, 0, ask("new", 1, 15, 10.0), TERMS);
        assert!(g.is_empty());
        assert_eq!(h.len(), MAX_HOLDERS);
        assert!(h.iter().all(|x| x.holder != "new"));
    }

    #[test]
    fn debt_refills_and_ttl_covers_it() {
        let l = limits();
        let s = current(
            &l,
            Some(BucketState {
                tokens: -50.0,
                updated_ms: 0,
            }),
            500,
        );
        assert!((s.tokens + 25.0).abs() < 1e-9);
        assert_eq!(refill_from_ms(&l, &s), 800);
        let s = current(&l, Some(s), 1_000_000);
        assert_eq!(s.tokens, 15.0);
    }
}
