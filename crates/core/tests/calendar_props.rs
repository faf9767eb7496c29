#![allow(clippy::unwrap_used)]
//! Property tests of the calendar periods: every time lies in exactly one window, consecutive
//! windows tile time, a window starts where its calendar says (a Monday, the first of a month
//! of the period's grid) and lasts as long as its months really are; and a fixed window over
//! a calendar period admits at most its limit in each calendar window.

use proptest::prelude::*;
use tollgate_core::bucket::Decision;
use tollgate_core::calendar::{civil_from_days, days_from_civil, days_in_month, Calendar, DAY_MS};
use tollgate_core::window::{take, CounterKind, Counters, Window};

fn calendar() -> impl Strategy<Value = Calendar> {
    prop_oneof![
        (1u32..=52).prop_map(Calendar::Weeks),
        prop::sample::select(vec![1u32, 2, 3, 4, 6, 12]).prop_map(Calendar::Months),
    ]
}

/// Times from the epoch to the year 2500, and a few near the end of `u64` milliseconds.
fn time() -> impl Strategy<Value = u64> {
    prop_oneof![
        20 => 0u64..16_725_225_600_000,
        1 => (u64::MAX - 400 * 366 * DAY_MS)..=u64::MAX,
    ]
}

proptest! {
    #[test]
    fn every_time_lies_in_exactly_one_window(c in calendar(), t in time()) {
        let i = c.index(t);
        let (start, end) = (c.start_ms(i), c.end_ms(i));
        prop_assert!(start <= t, "{c} at {t}: window {i} starts at {start}");
        prop_assert!(t < end || end == u64::MAX, "{c} at {t}: window {i} ends at {end}");
        // Its neighbours do not hold it.
        if i > 0 {
            prop_assert!(c.end_ms(i - 1) <= t);
        }
        prop_assert!(c.start_ms(i + 1) > t || end == u64::MAX);
    }

    #[test]
    fn consecutive_windows_tile(c in calendar(), t in 0u64..16_725_225_600_000) {
        let i = c.index(t);
        let (start, end) = (c.start_ms(i), c.end_ms(i));
        prop_assert_eq!(end, c.start_ms(i + 1));
        prop_assert!(end > start);
        prop_assert_eq!(c.index(end), i + 1);
        prop_assert_eq!(c.index(end - 1), i);
        if i > 0 {
            prop_assert_eq!(c.index(start), i);
            prop_assert_eq!(c.index(start - 1), i - 1);
        }
    }

    #[test]
    fn windows_start_where_the_calendar_says(c in calendar(), t in 0u64..16_725_225_600_000) {
        let i = c.index(t);
        let (start, end) = (c.start_ms(i), c.end_ms(i));
        prop_assert_eq!(start % DAY_MS, 0);
        prop_assert_eq!(end % DAY_MS, 0);
        match c {
            Calendar::Weeks(n) => {
                // Days since Monday 1969-12-29 (the epoch is a Thursday).
                prop_assert_eq!((end / DAY_MS + 3) % (7 * u64::from(n)), 0);
                if start > 0 {
                    prop_assert_eq!(end - start, 7 * u64::from(n) * DAY_MS);
                }
            }
            Calendar::Months(n) => {
                let (year, month, day) = civil_from_days(start / DAY_MS);
                prop_assert_eq!(day, 1);
                prop_assert_eq!((month - 1) % n, 0, "{} starts in month {}", c, month);
                let days: u64 = (0..n).map(|k| {
                    let m = month - 1 + k;
                    u64::from(days_in_month(year + u64::from(m / 12), m % 12 + 1))
                }).sum();
                prop_assert_eq!(end - start, days * DAY_MS);
                // The date of `t` is inside the window's months.
                let (ty, tm, _) = civil_from_days(t / DAY_MS);
                let months_in = (ty - year) * 12 + u64::from(tm) - u64::from(month);
                prop_assert!(months_in < u64::from(n));
            }
        }
    }

    #[test]
    fn civil_dates_round_trip(days in 0u64..200_000_000) {
        let (y, m, d) = civil_from_days(days);
        prop_assert!((1..=12).contains(&m) && d >= 1 && d <= days_in_month(y, m));
        prop_assert_eq!(days_from_civil(y, m, d), days);
        // The next day is the next date.
        let (ny, nm, nd) = civil_from_days(days + 1);
        if d < days_in_month(y, m) {
            prop_assert_eq!((ny, nm, nd), (y, m, d + 1));
        } else if m < 12 {
            prop_assert_eq!((ny, nm, nd), (y, m + 1, 1));
        } else {
            prop_assert_eq!((ny, nm, nd), (y + 1, 1, 1));
        }
    }

    /// Takes at random steps of up to four days (and sometimes back): each calendar window
    /// admits at most the limit, and a denial waits exactly until the window's end.
    #[test]
    fn a_calendar_fixed_window_admits_its_limit_per_calendar_window(
        c in calendar(),
        limit in 1u64..30,
        start in 0u64..16_725_225_600_000,
        ops in prop::collection::vec((prop_oneof![8 => 0u64..4 * DAY_MS, 1 => Just(0)], any::<bool>(), 1u64..5), 1..150),
    ) {
        let w = Window::calendar(limit, c).unwrap();
        let mut state: Option<Counters> = None;
        let mut now = start;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (dt, back, cost) in ops {
            now = if back { now.saturating_sub(dt / 8) } else { now + dt };
            let (next, d) = take(CounterKind::Fixed, &w, state, now, cost);
            match d {
                Decision::Allowed { .. } => admitted.push((next.window, cost)),
                Decision::Denied { retry_after_ms, .. } => {
                    prop_assert_eq!(next, state.unwrap_or_default().at(&w, now));
                    prop_assert_eq!(now + retry_after_ms, w.end_ms(next.window).max(now + 1));
                }
            }
            state = Some(next);
        }
        for (index, _) in &admitted {
            let units: u64 = admitted.iter().filter(|(i, _)| i == index).map(|(_, u)| u).sum();
            prop_assert!(units <= limit, "{} units in window {} of {}", units, index, c);
        }
    }
}
