#![allow(clippy::unwrap_used)]
//! Property tests of the token bucket's invariants, over random operation
//! sequences with clocks that jump forwards and backwards.

use proptest::prelude::*;
use std::collections::HashMap;
use tollgate_core::bucket::{give_back, lease, try_take, BucketState, Decision, Limits};

#[derive(Debug, Clone)]
enum Op {
    Take { cost: u64 },
    Lease { min: u64, want: u64 },
    GiveBack { unused: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u64..30).prop_map(|cost| Op::Take { cost }),
        (1u64..10, 0u64..60).prop_map(|(min, want)| Op::Lease { min, want }),
        (0u64..40).prop_map(|unused| Op::GiveBack { unused }),
    ]
}

fn limits() -> impl Strategy<Value = Limits> {
    (1u64..1_000, 1u64..10_000, 1u64..100)
        .prop_map(|(units, per, burst)| Limits::new(units, per, burst).unwrap())
}

/// Clock steps: mostly forward, sometimes backwards (failover to a host with another clock).
fn step() -> impl Strategy<Value = i64> {
    prop_oneof![4 => 0i64..500, 1 => -5_000i64..0]
}

fn advance(now: u64, step: i64) -> u64 {
    now.saturating_add_signed(step)
}

proptest! {
    #[test]
    fn tokens_stay_within_zero_and_capacity(
        limits in limits(),
        ops in prop::collection::vec((op(), step()), 1..200),
    ) {
        let mut now = 1_000_000u64;
        let mut state: Option<BucketState> = None;
        for (op, dt) in ops {
            now = advance(now, dt);
            let next = match op {
                Op::Take { cost } => try_take(&limits, state, now, cost).0,
                Op::Lease { min, want } => lease(&limits, state, now, min, want).0,
                Op::GiveBack { unused } => give_back(&limits, state, now, unused),
            };
            prop_assert!(next.tokens >= 0.0, "negative: {next:?}");
            prop_assert!(next.tokens <= limits.capacity(), "above capacity: {next:?}");
            if let Some(prev) = state {
                prop_assert!(next.updated_ms >= prev.updated_ms, "clock moved back in state");
            }
            state = Some(next);
        }
    }

    #[test]
    fn idle_refill_is_capped_at_capacity(
        limits in limits(),
        cost in 1u64..100,
        idle in 0u64..10_000_000,
    ) {
        let (state, _) = try_take(&limits, None, 0, cost);
        let later = state.refilled(&limits, idle);
        prop_assert!(later.tokens <= limits.capacity());
        let forever = state.refilled(&limits, state.full_at_ms(&limits));
        prop_assert_eq!(forever.tokens, limits.capacity());
    }

    #[test]
    fn backward_time_creates_nothing(
        limits in limits(),
        cost in 1u64..100,
        back in 1u64..1_000_000,
    ) {
        let t = 2_000_000u64;
        let (state, _) = try_take(&limits, None, t, cost);
        let earlier = state.refilled(&limits, t - back);
        prop_assert_eq!(earlier.tokens, state.tokens);
        prop_assert_eq!(earlier.updated_ms, t);
        // And returning to `t` afterwards credits nothing either.
        prop_assert_eq!(earlier.refilled(&limits, t).tokens, state.tokens);
    }

    #[test]
    fn admitted_cost_is_taken_exactly_once_and_denial_takes_nothing(
        limits in limits(),
        first in 0u64..100,
        cost in 1u64..100,
        dt in 0u64..1_000,
    ) {
        let (state, _) = try_take(&limits, None, 0, first);
        let before = state.refilled(&limits, dt).tokens;
        let (after, decision) = try_take(&limits, Some(state), dt, cost);
        match decision {
            Decision::Allowed { remaining } => {
                prop_assert!((before - cost as f64 - after.tokens).abs() < 1e-6 || after.tokens == 0.0);
                prop_assert_eq!(remaining, after.tokens);
            }
            Decision::Denied { retry_after_ms, .. } => {
                prop_assert_eq!(after.tokens, before);
                prop_assert!(retry_after_ms > 0);
                // Waiting the advertised time is enough.
                let (_, retry) = try_take(&limits, Some(after), dt + retry_after_ms, cost);
                if cost as f64 <= limits.capacity() {
                    prop_assert!(retry.is_allowed(), "retry_after too short");
                }
            }
        }
    }

    #[test]
    fn admitted_units_never_exceed_burst_plus_refill(
        limits in limits(),
        costs in prop::collection::vec((1u64..20, 0u64..50), 1..300),
    ) {
        let mut now = 0u64;
        let mut state = None;
        let mut admitted = 0u64;
        for (cost, dt) in costs {
            now += dt;
            let (next, decision) = try_take(&limits, state, now, cost);
            if decision.is_allowed() {
                admitted += cost;
            }
            state = Some(next);
        }
        let bound = limits.capacity() + limits.refill_per_ms() * now as f64;
        prop_assert!(admitted as f64 <= bound + 1e-6, "{admitted} > {bound}");
    }

    #[test]
    fn leases_grant_zero_or_between_min_and_want(
        limits in limits(),
        taken in 0u64..100,
        min in 1u64..50,
        want in 0u64..200,
    ) {
        let (state, _) = try_take(&limits, None, 0, taken);
        let (after, grant) = lease(&limits, Some(state), 0, min, want);
        let want = want.max(min);
        prop_assert!(grant.granted == 0 || (min..=want).contains(&grant.granted), "{grant:?}");
        prop_assert!(grant.granted as f64 <= state.tokens + 1e-9);
        prop_assert!((state.tokens - grant.granted as f64 - after.tokens).abs() < 1e-9);
        if grant.granted == 0 {
            prop_assert!(state.tokens < min as f64 + 1e-9);
            prop_assert!(grant.retry_after_ms > 0);
        }
    }

    #[test]
    fn keys_never_share_state(
        limits in limits(),
        ops in prop::collection::vec((0usize..4, 1u64..10, 0u64..100), 1..200),
    ) {
        // Interleaved operations on four keys decide exactly as each key's operations alone.
        let mut shared: HashMap<usize, BucketState> = HashMap::new();
        let mut interleaved = Vec::new();
        let mut now = 0u64;
        let mut timeline = Vec::new();
        for (key, cost, dt) in &ops {
            now += dt;
            timeline.push((*key, *cost, now));
            let (next, decision) = try_take(&limits, shared.get(key).copied(), now, *cost);
            shared.insert(*key, next);
            interleaved.push((*key, decision));
        }
        for key in 0..4 {
            let mut state = None;
            let alone: Vec<Decision> = timeline
                .iter()
                .filter(|(k, _, _)| *k == key)
                .map(|(_, cost, at)| {
                    let (next, d) = try_take(&limits, state, *at, *cost);
                    state = Some(next);
                    d
                })
                .collect();
            let mixed: Vec<Decision> =
                interleaved.iter().filter(|(k, _)| *k == key).map(|(_, d)| *d).collect();
            prop_assert_eq!(alone, mixed);
        }
    }
}
