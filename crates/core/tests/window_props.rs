#![allow(clippy::unwrap_used)]
//! Property tests of the windowed algorithms (fixed window, sliding window counter, sliding
//! log) over random sequences of takes and leases, with clocks that mostly move forwards and
//! sometimes jump back: what any rolling window admits, what a denial costs, what time going
//! backwards and idle state do.

use proptest::prelude::*;
use tollgate_core::bucket::Decision;
use tollgate_core::window::{counted, lease, take, CounterKind, Counters, Log, Window};

#[derive(Debug, Clone, Copy)]
enum Op {
    Take(u64),
    Lease(u64, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u64..6).prop_map(Op::Take),
        1 => (1u64..4, 0u64..12).prop_map(|(min, want)| Op::Lease(min, want)),
    ]
}

fn window() -> impl Strategy<Value = Window> {
    (1u64..40, 10u64..2_000).prop_map(|(limit, ms)| Window::new(limit, ms).unwrap())
}

/// Clock steps: mostly forward, sometimes backwards (failover to a host with another clock).
fn step() -> impl Strategy<Value = i64> {
    prop_oneof![6 => 0i64..300, 1 => -3_000i64..0]
}

/// Every admission as (time, units), the time being the newest clock reading so far (what the
/// state counts in when the clock went back).
fn run(w: &Window, mut apply: impl FnMut(u64, Op) -> u64, ops: &[(i64, Op)]) -> Vec<(u64, u64)> {
    let mut now = 10_000u64;
    // The newest time the state has seen (it counts in it when the clock goes back).
    let mut newest = 0;
    let mut admitted = Vec::new();
    for (dt, op) in ops {
        now = now.saturating_add_signed(*dt);
        newest = newest.max(now);
        let units = apply(now, *op);
        if units > 0 {
            admitted.push((newest, units));
        }
    }
    let _ = w;
    admitted
}

/// Most units admitted in any rolling window of `w.window_ms` (ending at an admission).
fn busiest(w: &Window, admitted: &[(u64, u64)]) -> u64 {
    admitted
        .iter()
        .map(|(end, _)| {
            admitted
                .iter()
                .filter(|(t, _)| *t <= *end && t + w.window_ms > *end)
                .map(|(_, u)| u)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0)
}

fn counters_run(kind: CounterKind, w: &Window, ops: &[(i64, Op)]) -> Vec<(u64, u64)> {
    let mut state: Option<Counters> = None;
    run(
        w,
        |now, op| {
            let before = state.unwrap_or_default().at(w, now);
            let units = match op {
                Op::Take(cost) => {
                    let (next, d) = take(kind, w, state, now, cost);
                    match d {
                        Decision::Allowed { .. } => assert_eq!(next.count, before.count + cost),
                        Decision::Denied { retry_after_ms, .. } => {
                            assert_eq!(next, before, "a denial counted something");
                            assert!(retry_after_ms >= 1);
                        }
                    }
                    state = Some(next);
                    if d.is_allowed() {
                        cost
                    } else {
                        0
                    }
                }
                Op::Lease(min, want) => {
                    let (next, g) = lease(kind, w, state, now, min, want);
                    assert!(g.granted == 0 || (g.granted >= min && g.granted <= want.max(min)));
                    assert_eq!(next.count, before.count + g.granted);
                    assert!(g.expires_ms >= 1);
                    state = Some(next);
                    g.granted
                }
            };
            let after = state.unwrap_or_default();
            assert!(after.count <= w.limit, "counted above the limit");
            if units > 0 {
                assert!(counted(kind, w, &after, now) <= w.limit as f64 + 1e-6);
            }
            units
        },
        ops,
    )
}

proptest! {
    #[test]
    fn fixed_window_admits_the_limit_per_window_and_at_most_twice_it_rolling(
        w in window(),
        ops in prop::collection::vec((step(), op()), 1..200),
    ) {
        let admitted = counters_run(CounterKind::Fixed, &w, &ops);
        for (t, _) in &admitted {
            let index = t / w.window_ms;
            let in_window: u64 = admitted.iter().filter(|(s, _)| s / w.window_ms == index).map(|(_, u)| u).sum();
            prop_assert!(in_window <= w.limit);
        }
        prop_assert!(busiest(&w, &admitted) <= 2 * w.limit);
    }

    #[test]
    fn sliding_window_stays_within_its_error_bound(
        w in window(),
        ops in prop::collection::vec((step(), op()), 1..200),
    ) {
        let admitted = counters_run(CounterKind::Sliding, &w, &ops);
        prop_assert!(busiest(&w, &admitted) <= 2 * w.limit);
    }

    #[test]
    fn sliding_log_is_exact(
        w in window(),
        ops in prop::collection::vec((step(), op()), 1..200),
    ) {
        let mut log = Log::default();
        let admitted = run(&w, |now, op| {
            let before = log.times.len();
            let units = match op {
                Op::Take(cost) => match log.take(&w, now, cost) {
                    Decision::Allowed { .. } => cost,
                    Decision::Denied { .. } => 0,
                },
                Op::Lease(min, want) => log.lease(&w, now, min, want).granted,
            };
            assert!(log.times.len() as u64 <= w.limit);
            assert!(log.times.windows(2).all(|p| p[0] <= p[1]), "log out of order");
            if units == 0 {
                assert!(log.times.len() <= before, "a denial logged something");
            }
            units
        }, &ops);
        prop_assert!(busiest(&w, &admitted) <= w.limit);
    }

    /// A fixed window's or sliding window counter's lease ends with its window: units spent
    /// up to its last millisecond stay in the window they were counted in, so the documented
    /// bounds hold for spending as they do for counting (at most the limit per fixed window,
    /// at most twice it in any rolling window).
    #[test]
    fn counter_leases_spent_late_keep_their_bounds(
        w in window(),
        kind in prop_oneof![Just(CounterKind::Fixed), Just(CounterKind::Sliding)],
        ops in prop::collection::vec(
            (0u64..300, op(), prop::collection::vec(0u64..=1_000, 12)),
            1..150,
        ),
    ) {
        let mut state: Option<Counters> = None;
        let mut now = 10_000u64;
        let mut spent: Vec<(u64, u64)> = Vec::new();
        for (dt, op, when) in &ops {
            now += dt;
            match *op {
                Op::Take(cost) => {
                    let (next, d) = take(kind, &w, state, now, cost);
                    state = Some(next);
                    if d.is_allowed() {
                        spent.push((now, cost));
                    }
                }
                Op::Lease(min, want) => {
                    let (next, g) = lease(kind, &w, state, now, min, want);
                    state = Some(next);
                    prop_assert!(now + g.expires_ms <= w.end_ms(w.index(now)));
                    for unit in 0..g.granted {
                        let share = when[usize::try_from(unit).unwrap() % when.len()];
                        spent.push((now + (g.expires_ms - 1) * share / 1_000, 1));
                    }
                }
            }
        }
        if kind == CounterKind::Fixed {
            for (t, _) in &spent {
                let index = t / w.window_ms;
                let in_window: u64 = spent.iter().filter(|(s, _)| s / w.window_ms == index).map(|(_, u)| u).sum();
                prop_assert!(in_window <= w.limit);
            }
        }
        prop_assert!(busiest(&w, &spent) <= 2 * w.limit);
    }

    /// Leased units are spent when the instance likes, up to the lease's last millisecond,
    /// mixed with units taken directly: every rolling window still holds at most the limit.
    #[test]
    fn sliding_log_leases_spent_late_stay_exact(
        w in window(),
        ops in prop::collection::vec(
            (0u64..300, op(), prop::collection::vec(0u64..=1_000, 12)),
            1..150,
        ),
    ) {
        let mut log = Log::default();
        let mut now = 10_000u64;
        let mut spent: Vec<(u64, u64)> = Vec::new();
        for (dt, op, when) in &ops {
            now += dt;
            match *op {
                Op::Take(cost) => {
                    if log.take(&w, now, cost).is_allowed() {
                        spent.push((now, cost));
                    }
                }
                Op::Lease(min, want) => {
                    let g = log.lease(&w, now, min, want);
                    prop_assert!(g.expires_ms >= 1);
                    prop_assert!(now + g.expires_ms <= log.lease_end_ms(&w));
                    // Each unit at its own moment of the lease, the last millisecond included.
                    for unit in 0..g.granted {
                        let share = when[usize::try_from(unit).unwrap() % when.len()];
                        spent.push((now + (g.expires_ms - 1) * share / 1_000, 1));
                    }
                }
            }
            prop_assert!(log.times.len() as u64 <= w.limit);
            prop_assert!(log.times.windows(2).all(|p| p[0] <= p[1]), "log out of order");
        }
        prop_assert!(busiest(&w, &spent) <= w.limit, "{} in a window of {:?}", busiest(&w, &spent), w);
    }

    #[test]
    fn idle_state_equals_a_fresh_one(
        w in window(),
        kind in prop_oneof![Just(CounterKind::Fixed), Just(CounterKind::Sliding)],
        used in 0u64..40,
        cost in 1u64..10,
        at in 0u64..100_000,
    ) {
        let c = Counters { window: at / w.window_ms, count: used.min(w.limit), previous: 0 };
        let idle = c.idle_at_ms(&w, kind == CounterKind::Sliding);
        let (a, da) = take(kind, &w, Some(c), idle, cost);
        let (b, db) = take(kind, &w, None, idle, cost);
        prop_assert_eq!(a.count, b.count);
        prop_assert_eq!(da.is_allowed(), db.is_allowed());
    }

    #[test]
    fn backward_time_creates_nothing(
        w in window(),
        kind in prop_oneof![Just(CounterKind::Fixed), Just(CounterKind::Sliding)],
        back in 1u64..5_000,
    ) {
        let now = 50_000u64;
        let mut state = None;
        loop {
            let (next, d) = take(kind, &w, state, now, 1);
            state = Some(next);
            if !d.is_allowed() {
                break;
            }
        }
        prop_assert!(!take(kind, &w, state, now - back, 1).1.is_allowed());
        let mut log = Log::default();
        while log.take(&w, now, 1).is_allowed() {}
        prop_assert!(!log.take(&w, now - back, 1).is_allowed());
    }
}
