//! Token bucket math with weighted cost, shared by the filter's local stage, the limiter's
//! in-memory store and (mirrored line by line) the limiter's Redis Function.
//!
//! Invariants (property-tested in `tests/bucket_props.rs`):
//! `0 ≤ tokens ≤ capacity` for everything [`try_take`], [`lease`] and [`give_back`] do; only
//! [`settle`] charges an excess below zero (debt, bounded by the caller), which refills like
//! any deficit; idle time refills at most to capacity; time that moves backwards
//! creates nothing (and never moves `updated_ms` back, so the same span is never credited twice);
//! an admitted cost is taken exactly once; a denial takes nothing and says how long to wait.

/// Float slack when comparing tokens to a cost: refill arithmetic (`elapsed × rate`) may land a
/// hair under a whole number that is really there.
pub(crate) const EPSILON: f64 = 1e-9;

/// Rate and capacity of one bucket: `capacity` tokens at most, refilled at `refill_per_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    capacity: f64,
    refill_per_ms: f64,
}

impl Limits {
    /// `units` per `per_ms` milliseconds, at most `burst` at once. `None` when any is zero.
    pub fn new(units: u64, per_ms: u64, burst: u64) -> Option<Self> {
        if units == 0 || per_ms == 0 || burst == 0 {
            return None;
        }
        Some(Self {
            capacity: burst as f64,
            refill_per_ms: units as f64 / per_ms as f64,
        })
    }

    /// The same bucket at `share` of its rate and capacity (capacity at least 1): an
    /// instance's own budget while the global owner cannot be reached.
    pub fn scaled(&self, share: f64) -> Self {
        let share = if share.is_finite() {
            share.clamp(0.0, 1.0)
        } else {
            0.0
        };
        Self {
            capacity: (self.capacity * share).max(1.0),
            refill_per_ms: self.refill_per_ms * share,
        }
    }

    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    pub fn refill_per_ms(&self) -> f64 {
        self.refill_per_ms
    }

    /// Milliseconds until `deficit` tokens have been refilled, rounded up (at least 1 when there
    /// is a deficit), saturating instead of overflowing.
    pub fn millis_to_refill(&self, deficit: f64) -> u64 {
        if deficit <= EPSILON {
            return 0;
        }
        let ms = (deficit / self.refill_per_ms).ceil();
        if ms >= u64::MAX as f64 {
            u64::MAX
        } else {
            (ms as u64).max(1)
        }
    }

    /// Time for an empty bucket to become full; state may be dropped once idle this long,
    /// because recreating it full yields the same logical state.
    pub fn full_refill_ms(&self) -> u64 {
        self.millis_to_refill(self.capacity)
    }
}

/// Stored state of one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketState {
    pub tokens: f64,
    pub updated_ms: u64,
}

impl BucketState {
    /// A bucket seen for the first time is full.
    pub fn full(limits: &Limits, now_ms: u64) -> Self {
        Self {
            tokens: limits.capacity,
            updated_ms: now_ms,
        }
    }

    /// The state as of `now_ms`: refilled for the elapsed time, at most to capacity (a debt
    /// [`settle`] charged stays below zero until refilled). A clock that went backwards refills
    /// nothing and leaves `updated_ms` where it was.
    pub fn refilled(self, limits: &Limits, now_ms: u64) -> Self {
        let tokens = if self.tokens.is_finite() {
            self.tokens
        } else {
            0.0
        };
        let elapsed = now_ms.saturating_sub(self.updated_ms);
        let tokens = tokens + elapsed as f64 * limits.refill_per_ms;
        // Within EPSILON of capacity is full: at `full_at_ms` the product of a whole number of
        // milliseconds and the rate may land a hair under it.
        let tokens = if tokens + EPSILON >= limits.capacity {
            limits.capacity
        } else {
            tokens
        };
        Self {
            tokens,
            updated_ms: self.updated_ms.max(now_ms),
        }
    }

    /// When this bucket will be full again if nothing takes from it.
    pub fn full_at_ms(&self, limits: &Limits) -> u64 {
        self.updated_ms
            .saturating_add(limits.millis_to_refill(limits.capacity - self.tokens))
    }
}

/// Outcome of asking a bucket for `cost` tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// The cost was taken; `remaining` tokens are left.
    Allowed { remaining: f64 },
    /// Nothing was taken; enough tokens will be there after `retry_after_ms`.
    Denied { retry_after_ms: u64, remaining: f64 },
}

impl Decision {
    pub fn is_allowed(&self) -> bool {
        matches!(self, Decision::Allowed { .. })
    }
}

/// Takes `cost` tokens if they are there. `state` is `None` for a bucket never seen (or expired).
pub fn try_take(
    limits: &Limits,
    state: Option<BucketState>,
    now_ms: u64,
    cost: u64,
) -> (BucketState, Decision) {
    let current = current(limits, state, now_ms);
    let cost = cost as f64;
    if current.tokens + EPSILON >= cost {
        let next = BucketState {
            tokens: (current.tokens - cost).max(0.0),
            ..current
        };
        (
            next,
            Decision::Allowed {
                remaining: next.tokens,
            },
        )
    } else {
        (
            current,
            Decision::Denied {
                retry_after_ms: limits.millis_to_refill(cost - current.tokens),
                remaining: current.tokens,
            },
        )
    }
}

/// Outcome of a lease: `granted` is `0` or within `[min, want]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseGrant {
    pub granted: u64,
    pub remaining: f64,
    /// When `granted == 0`: how long until `min` tokens are there.
    pub retry_after_ms: u64,
}

/// Takes a batch of tokens for a lease: at least `min` (the waiting request's cost) and at most
/// `want`. The fuller the bucket, the larger the batch: a bucket at fill ratio `f` grants at most
/// `f × available` (never less than `min`), so near the limit a lease shrinks to the request's
/// cost and few tokens sit stranded in other instances' leases.
pub fn lease(
    limits: &Limits,
    state: Option<BucketState>,
    now_ms: u64,
    min: u64,
    want: u64,
) -> (BucketState, LeaseGrant) {
    let current = current(limits, state, now_ms);
    let min = min.max(1);
    let want = want.max(min);
    let available = (current.tokens + EPSILON).floor();
    if available < min as f64 {
        let needed = min as f64;
        return (
            current,
            LeaseGrant {
                granted: 0,
                remaining: current.tokens,
                retry_after_ms: limits.millis_to_refill(needed - current.tokens),
            },
        );
    }
    let fill = (current.tokens / limits.capacity).clamp(0.0, 1.0);
    let scaled = (available * fill).floor() as u64;
    let granted = scaled.max(min).min(want).min(available as u64);
    let next = BucketState {
        tokens: (current.tokens - granted as f64).max(0.0),
        ..current
    };
    (
        next,
        LeaseGrant {
            granted,
            remaining: next.tokens,
            retry_after_ms: 0,
        },
    )
}

/// Gives `unused` tokens back to a bucket, never above capacity.
pub fn give_back(
    limits: &Limits,
    state: Option<BucketState>,
    now_ms: u64,
    unused: u64,
) -> BucketState {
    let current = current(limits, state, now_ms);
    BucketState {
        tokens: (current.tokens + unused as f64).min(limits.capacity),
        ..current
    }
}

/// Outcome of a shaped take ([`shape`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shaped {
    /// Taken; the request may go on now.
    Now { remaining: f64 },
    /// Taken from the tokens still to come: the request goes on after `delay_ms`.
    After { delay_ms: u64 },
    /// More than `max_delay` away: nothing taken; enough room comes after `retry_after_ms`.
    Denied { retry_after_ms: u64 },
}

/// A token bucket that delays instead of refusing (a leaky-bucket queue, as GCRA): a request
/// over the rate takes its cost from tokens yet to be refilled, down to `-max_delay × rate`,
/// and waits until they are there. Requests are thus spaced at `cost / rate`, none waits
/// longer than `max_delay_ms`, and what would wait longer is refused, taking nothing.
pub fn shape(
    limits: &Limits,
    state: Option<BucketState>,
    now_ms: u64,
    cost: u64,
    max_delay_ms: u64,
) -> (BucketState, Shaped) {
    let current = current(limits, state, now_ms);
    let cost_f = cost as f64;
    if current.tokens + EPSILON >= cost_f {
        let next = BucketState {
            tokens: current.tokens - cost_f,
            ..current
        };
        return (
            next,
            Shaped::Now {
                remaining: next.tokens,
            },
        );
    }
    let delay_ms = limits.millis_to_refill(cost_f - current.tokens);
    if delay_ms <= max_delay_ms {
        let next = BucketState {
            tokens: current.tokens - cost_f,
            ..current
        };
        return (next, Shaped::After { delay_ms });
    }
    (
        current,
        Shaped::Denied {
            retry_after_ms: delay_ms - max_delay_ms,
        },
    )
}

/// What settling a reserved cost against the actual one did to a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settled {
    /// Reserved but not used: given back (at most up to capacity).
    pub refunded: u64,
    /// Used beyond the reservation and charged: the bucket went below what it held.
    pub charged: u64,
    /// Used beyond the reservation but past the debt bound: not charged.
    pub uncharged: u64,
}

/// Settles a request that reserved `reserved` and used `actual`: the difference goes back to
/// the bucket, or the excess is taken from it, down to `-max_debt` at most (a bucket in debt
/// refuses every request until refilled past it, so its `Retry-After` covers the debt).
pub fn settle(
    limits: &Limits,
    state: Option<BucketState>,
    now_ms: u64,
    reserved: u64,
    actual: u64,
    max_debt: u64,
) -> (BucketState, Settled) {
    let current = current(limits, state, now_ms);
    if actual <= reserved {
        let unused = (reserved - actual) as f64;
        let tokens = (current.tokens + unused).min(limits.capacity);
        let refunded = (tokens - current.tokens).max(0.0).round() as u64;
        let settled = Settled {
            refunded,
            ..Settled::default()
        };
        return (BucketState { tokens, ..current }, settled);
    }
    let excess = actual - reserved;
    let floor = -(max_debt as f64);
    let room = (current.tokens - floor).max(0.0).floor() as u64;
    let charged = excess.min(room);
    let settled = Settled {
        refunded: 0,
        charged,
        uncharged: excess - charged,
    };
    let tokens = (current.tokens - charged as f64).max(floor.min(current.tokens));
    (BucketState { tokens, ..current }, settled)
}

fn current(limits: &Limits, state: Option<BucketState>, now_ms: u64) -> BucketState {
    match state {
        Some(state) => state.refilled(limits, now_ms),
        None => BucketState::full(limits, now_ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        // 100 units/s, burst 20: the payments policy of policies/payments.json.
        Limits::new(100, 1_000, 20).unwrap()
    }

    #[test]
    fn new_bucket_is_full_and_weighted_cost_drains_it() {
        let l = limits();
        let mut state = None;
        for i in 0..4 {
            let (next, d) = try_take(&l, state, 0, 5);
            assert_eq!(
                d,
                Decision::Allowed {
                    remaining: (15 - 5 * i) as f64
                }
            );
            state = Some(next);
        }
        let (_, d) = try_take(&l, state, 0, 5);
        // 5 tokens at 0.1/ms: 50 ms.
        assert_eq!(
            d,
            Decision::Denied {
                retry_after_ms: 50,
                remaining: 0.0
            }
        );
    }

    #[test]
    fn refill_is_capped_and_backward_time_creates_nothing() {
        let l = limits();
        let (s, _) = try_take(&l, None, 10_000, 20);
        assert_eq!(s.tokens, 0.0);
        let back = s.refilled(&l, 5_000);
        assert_eq!(back.tokens, 0.0);
        assert_eq!(back.updated_ms, 10_000);
        assert_eq!(s.refilled(&l, 10_100).tokens, 10.0);
        assert_eq!(s.refilled(&l, 99_999_999).tokens, 20.0);
        assert_eq!(s.full_at_ms(&l), 10_200);
    }

    #[test]
    fn a_bucket_is_full_at_its_full_at_time_whatever_the_float_rounding() {
        // 1 unit per 691 ms, burst 26: 24 tokens take 16,584 ms, and 16,584 × (1/691) is a
        // hair under 24 in floats.
        let l = Limits::new(1, 691, 26).unwrap();
        let (s, _) = try_take(&l, None, 0, 24);
        assert_eq!(s.refilled(&l, s.full_at_ms(&l)).tokens, 26.0);
        assert!(s.refilled(&l, s.full_at_ms(&l) - 1).tokens < 26.0);
        let (again, _) = try_take(&l, Some(s), s.full_at_ms(&l), 26);
        assert_eq!(again.tokens, 0.0);
    }

    #[test]
    fn denial_takes_nothing() {
        let l = limits();
        let (s, _) = try_take(&l, None, 0, 18);
        let (after, d) = try_take(&l, Some(s), 0, 5);
        assert!(!d.is_allowed());
        assert_eq!(after.tokens, 2.0);
    }

    #[test]
    fn lease_shrinks_as_the_bucket_runs_low() {
        let l = Limits::new(1, 3_600_000, 100).unwrap();
        let (s, g) = lease(&l, None, 0, 1, 40);
        assert_eq!(g.granted, 40);
        let (s, g) = lease(&l, Some(s), 0, 1, 40);
        // 60 left, fill 0.6: at most 36.
        assert_eq!(g.granted, 36);
        let (s, g) = lease(&l, Some(s), 0, 5, 40);
        // 24 left, fill 0.24: 5 (min wins over 5.76→5).
        assert_eq!(g.granted, 5);
        let (s, g) = lease(&l, Some(s), 0, 19, 40);
        assert_eq!(g.granted, 19);
        let (_, g) = lease(&l, Some(s), 0, 1, 40);
        assert_eq!(g.granted, 0);
        assert!(g.retry_after_ms > 0);
    }

    #[test]
    fn give_back_never_exceeds_capacity() {
        let l = limits();
        let (s, _) = try_take(&l, None, 0, 3);
        assert_eq!(give_back(&l, Some(s), 0, 10).tokens, 20.0);
        assert_eq!(give_back(&l, Some(s), 0, 2).tokens, 19.0);
    }

    #[test]
    fn settle_refunds_unused_and_charges_excess_as_bounded_debt() {
        // 1 unit/s, burst 100: refill is negligible within a test.
        let l = Limits::new(1, 1_000, 100).unwrap();
        let (s, _) = try_take(&l, None, 0, 100);
        // Reserved 100, used 30: 70 back.
        let (s, d) = settle(&l, Some(s), 0, 100, 30, 50);
        assert_eq!((s.tokens, d.refunded, d.charged), (70.0, 70, 0));
        let (s, _) = try_take(&l, Some(s), 0, 70);
        // Reserved 70, used 300: 230 excess, 50 of it fits the debt bound.
        let (s, d) = settle(&l, Some(s), 0, 70, 300, 50);
        assert_eq!((s.tokens, d.charged, d.uncharged), (-50.0, 50, 180));
        // In debt: a cost of 1 waits for 51 tokens, 51 s at 1/s.
        let (s, d) = try_take(&l, Some(s), 0, 1);
        assert_eq!(
            d,
            Decision::Denied {
                retry_after_ms: 51_000,
                remaining: -50.0
            }
        );
        // Repaid by refill, then admitted again.
        let (_, d) = try_take(&l, Some(s), 51_000, 1);
        assert!(d.is_allowed());
        // A refund never lifts a bucket above capacity.
        let (s, d) = settle(&l, None, 0, 10, 0, 0);
        assert_eq!((s.tokens, d.refunded), (100.0, 0));
        // No debt allowed: the whole excess is uncharged, the bucket stays at 0.
        let (s, _) = try_take(&l, None, 0, 100);
        let (s, d) = settle(&l, Some(s), 0, 100, 120, 0);
        assert_eq!((s.tokens, d.charged, d.uncharged), (0.0, 0, 20));
    }

    #[test]
    fn shaping_spaces_requests_at_the_rate_and_bounds_the_wait() {
        // 10/s, burst 2, at most 350 ms of delay.
        let l = Limits::new(10, 1_000, 2).unwrap();
        let mut state = None;
        let mut delays = Vec::new();
        for _ in 0..7 {
            let (next, d) = shape(&l, state, 0, 1, 350);
            state = Some(next);
            delays.push(d);
        }
        assert!(matches!(delays[0], Shaped::Now { .. }));
        assert!(matches!(delays[1], Shaped::Now { .. }));
        let waits: Vec<_> = delays[2..]
            .iter()
            .map(|d| match d {
                Shaped::After { delay_ms } => *delay_ms as i64,
                Shaped::Denied { retry_after_ms } => -(*retry_after_ms as i64),
                Shaped::Now { .. } => 0,
            })
            .collect();
        // One every 100 ms up to 350 ms; the next would wait 400 ms: refused, 50 ms too early.
        assert_eq!(waits, vec![100, 200, 300, -50, -50]);
        // The refused ones took nothing: 50 ms later one more fits the delay bound.
        let (_, d) = shape(&l, state, 50, 1, 350);
        assert_eq!(d, Shaped::After { delay_ms: 350 });
    }

    #[test]
    fn scaled_limits_keep_at_least_one_token() {
        let l = limits().scaled(0.34);
        assert!((l.capacity() - 6.8).abs() < 1e-9);
        assert!((l.refill_per_ms() - 0.034).abs() < 1e-12);
        assert_eq!(limits().scaled(0.0001).capacity(), 1.0);
    }

    #[test]
    fn retry_after_rounds_up() {
        let l = Limits::new(3, 1_000, 1).unwrap();
        assert_eq!(l.millis_to_refill(1.0), 334);
        assert_eq!(l.millis_to_refill(0.0), 0);
        assert_eq!(l.full_refill_ms(), 334);
    }
}
