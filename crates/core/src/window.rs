//! The windowed algorithms, beside the token bucket (`bucket`): a fixed window, a sliding
//! window counter and a sliding log, each `limit` units per `window_ms`. Shared by the filter's
//! local stage, the limiter's in-memory store and (mirrored line by line) its Redis Function.
//!
//! * **Fixed window**: one counter per window `⌊now / window⌋`, or per window of a calendar
//!   period (weeks, months, years: `calendar`); a new window starts from zero. Constant
//!   state. Its boundary double burst: `limit` units at the end of one window and `limit` more
//!   at the start of the next pass within a few milliseconds, so any rolling window of length
//!   `window_ms` can hold up to `2 × limit`.
//! * **Sliding window counter**: the current window's counter plus the previous window's,
//!   weighted by the share of the previous window still inside the rolling window
//!   (`count + previous × (1 − elapsed / window)`). Constant state (two counters). It is exact
//!   when the previous window's units were spread evenly; its error bound: a rolling window can
//!   hold at most `limit + previous × elapsed / window` units, below `2 × limit`, reached only
//!   when the previous window's units all came at its very end.
//! * **Sliding log**: the time of every admitted unit in the last window; exact for any rolling
//!   window, state proportional to the limit (bounded by [`MAX_LOG_LIMIT`]).
//!
//! **Leases** (the global stage: an instance is granted units now and spends them until the
//! lease expires, on its own). A leased unit must count for as long as it may be spent, not
//! from the grant, or a unit granted at `g` and spent just before its expiry escapes every
//! rolling window that the log checked at `g`.
//!
//! * Fixed window and sliding window counter: a lease expires at the end of the window it was
//!   counted in, so every leased unit is spent in its own window and the bounds above hold as
//!   they are (at most `limit` per fixed window, at most `2 × limit` in any rolling one; the
//!   counter's `limit + previous × elapsed / window`). The instance must measure the expiry
//!   from when it asked, not from when the answer came, so it never spends into the next
//!   window.
//! * Sliding log: a lease expires at the end of the current slot of the window's grid
//!   (`⌊now / window⌋`, like a fixed window) and its units are entered in the log at that
//!   time, so each stays in the log from the grant until a window after its lease expired:
//!   whenever it is spent, every rolling window holding its spending also holds its entry, and
//!   any rolling window holds at most `limit` units spent. The grid (rather than a lease
//!   length counted from each grant) keeps the expiries of two leases of one slot equal, so an
//!   instance adding a new lease's units to an unspent rest never lets the older units outlive
//!   their own entries. The price is throughput: a leased unit holds budget for between one
//!   and two windows (its lease's rest of the slot, plus a window), so a fully leased log
//!   admits between `limit` per two windows and `limit` per window, and units an instance
//!   leaves unspent are stranded until a window after their slot ended (a lease granted late
//!   in a slot is short).
//!
//! Invariants (property-tested in `tests/window_props.rs`): counts never negative and never
//! above the limit, time that moves backwards counts in the newest window seen (it neither
//! starts a new window nor expires anything), an admitted cost is counted once, a denial
//! counts nothing and says how long to wait, and state idle for two windows equals a fresh one.

use crate::bucket::Decision;
use crate::calendar::Calendar;

/// Largest limit a sliding log may have: its state holds one timestamp per unit.
pub const MAX_LOG_LIMIT: u64 = 256;

/// `limit` units per `window_ms` milliseconds, or per window of a calendar period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub limit: u64,
    /// The window's length; a calendar window's longest ([`Calendar::longest_ms`]).
    pub window_ms: u64,
    /// Windows of a calendar period (weeks, months, years: fixed windows only) instead of the
    /// grid `⌊now / window_ms⌋`.
    pub calendar: Option<Calendar>,
}

impl Window {
    /// `None` when either is zero.
    pub fn new(limit: u64, window_ms: u64) -> Option<Self> {
        (limit > 0 && window_ms > 0).then_some(Self {
            limit,
            window_ms,
            calendar: None,
        })
    }

    /// `limit` units per window of `calendar`; `None` when `limit` is zero.
    pub fn calendar(limit: u64, calendar: Calendar) -> Option<Self> {
        (limit > 0).then_some(Self {
            limit,
            window_ms: calendar.longest_ms(),
            calendar: Some(calendar),
        })
    }

    /// The window `now_ms` falls in.
    pub fn index(&self, now_ms: u64) -> u64 {
        match self.calendar {
            None => now_ms / self.window_ms,
            Some(c) => c.index(now_ms),
        }
    }

    /// When window `index` starts.
    pub fn start_ms(&self, index: u64) -> u64 {
        match self.calendar {
            None => index.saturating_mul(self.window_ms),
            Some(c) => c.start_ms(index),
        }
    }

    /// When window `index` ends (where the next one starts).
    pub fn end_ms(&self, index: u64) -> u64 {
        match self.calendar {
            None => index.saturating_add(1).saturating_mul(self.window_ms),
            Some(c) => c.end_ms(index),
        }
    }

    /// How long the window `now_ms` falls in is (a calendar month: 28 to 31 days).
    pub fn length_ms_at(&self, now_ms: u64) -> u64 {
        match self.calendar {
            None => self.window_ms,
            Some(c) => {
                let index = c.index(now_ms);
                c.end_ms(index).saturating_sub(c.start_ms(index))
            }
        }
    }
}

/// State of a fixed window or a sliding window counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// The newest window seen.
    pub window: u64,
    /// Units counted in it.
    pub count: u64,
    /// Units counted in the window before it (sliding window counter only).
    pub previous: u64,
}

impl Counters {
    /// The counters as of `now_ms`: moved to its window when that is newer (the previous
    /// window's count is kept only when it is the one just before). A clock that went
    /// backwards counts in the newest window seen.
    pub fn at(self, w: &Window, now_ms: u64) -> Self {
        let index = w.index(now_ms);
        if index <= self.window {
            return self;
        }
        Self {
            window: index,
            count: 0,
            previous: if index == self.window + 1 {
                self.count
            } else {
                0
            },
        }
    }

    /// When these counters equal fresh ones (nothing counted that still matters).
    pub fn idle_at_ms(&self, w: &Window, sliding: bool) -> u64 {
        let last = if sliding {
            self.window.saturating_add(1)
        } else {
            self.window
        };
        w.end_ms(last)
    }
}

/// What a windowed lease grants: `granted` is 0 or within `[min, want]`; the lease may be spent
/// until `expires_ms` from now (the end of the current window).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowGrant {
    pub granted: u64,
    pub remaining: f64,
    pub retry_after_ms: u64,
    pub expires_ms: u64,
}

/// Which counter algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterKind {
    Fixed,
    Sliding,
}

/// Units counted against the limit at `now_ms` (the sliding estimate for [`CounterKind::Sliding`]).
pub fn counted(kind: CounterKind, w: &Window, c: &Counters, now_ms: u64) -> f64 {
    match kind {
        CounterKind::Fixed => c.count as f64,
        CounterKind::Sliding => {
            let start = w.start_ms(c.window);
            let elapsed = now_ms.saturating_sub(start).min(w.window_ms) as f64;
            let weight = 1.0 - elapsed / w.window_ms as f64;
            c.count as f64 + c.previous as f64 * weight
        }
    }
}

/// Milliseconds from `now_ms` until `cost` more units fit (at least 1).
fn wait_ms(kind: CounterKind, w: &Window, c: &Counters, now_ms: u64, cost: u64) -> u64 {
    let window_start = w.start_ms(c.window);
    let next = w.end_ms(c.window);
    let at = match kind {
        CounterKind::Fixed => next,
        CounterKind::Sliding => {
            let wm = w.window_ms as f64;
            let room = w.limit as f64 - cost as f64;
            if (c.count + cost) as f64 <= w.limit as f64 && c.previous > 0 {
                // This window: the previous one's weight must fall to `room - count`.
                let x = 1.0 - (room - c.count as f64) / c.previous as f64;
                window_start + fraction_ms(x, wm)
            } else if c.count == 0 {
                next
            } else {
                // The next window, where this window's count is the weighted one.
                let x = 1.0 - room / c.count as f64;
                next + fraction_ms(x, wm)
            }
        }
    };
    at.saturating_sub(now_ms).max(1)
}

/// `x` of a window of `wm` ms, rounded up (float noise of a whole millisecond is not rounded
/// up to the next one).
fn fraction_ms(x: f64, wm: f64) -> u64 {
    (x.clamp(0.0, 1.0) * wm - 1e-6).ceil().max(0.0) as u64
}

/// Counts `cost` units if they fit.
pub fn take(
    kind: CounterKind,
    w: &Window,
    state: Option<Counters>,
    now_ms: u64,
    cost: u64,
) -> (Counters, Decision) {
    let c = state.unwrap_or_default().at(w, now_ms);
    let used = counted(kind, w, &c, now_ms);
    if used + cost as f64 <= w.limit as f64 + 1e-9 {
        let next = Counters {
            count: c.count + cost,
            ..c
        };
        let remaining = (w.limit as f64 - counted(kind, w, &next, now_ms)).max(0.0);
        (next, Decision::Allowed { remaining })
    } else {
        let retry_after_ms = wait_ms(kind, w, &c, now_ms, cost);
        let remaining = (w.limit as f64 - used).max(0.0);
        (
            c,
            Decision::Denied {
                retry_after_ms,
                remaining,
            },
        )
    }
}

/// Leases at least `min` and at most `want` units of the current window (what fits), spendable
/// until its end.
pub fn lease(
    kind: CounterKind,
    w: &Window,
    state: Option<Counters>,
    now_ms: u64,
    min: u64,
    want: u64,
) -> (Counters, WindowGrant) {
    let c = state.unwrap_or_default().at(w, now_ms);
    let min = min.max(1);
    let room = (w.limit as f64 - counted(kind, w, &c, now_ms) + 1e-9)
        .floor()
        .max(0.0) as u64;
    let expires_ms = w.end_ms(c.window).saturating_sub(now_ms).max(1);
    if room < min {
        let remaining = room as f64;
        let retry_after_ms = wait_ms(kind, w, &c, now_ms, min);
        let grant = WindowGrant {
            granted: 0,
            remaining,
            retry_after_ms,
            expires_ms,
        };
        return (c, grant);
    }
    let granted = want.max(min).min(room);
    let next = Counters {
        count: c.count + granted,
        ..c
    };
    let grant = WindowGrant {
        granted,
        remaining: (room - granted) as f64,
        retry_after_ms: 0,
        expires_ms,
    };
    (next, grant)
}

/// A sliding log: the times of the admitted units of the last window, oldest first, on the
/// log's own clock: the newest time it has seen (`seen_ms`), so a clock that went backwards
/// neither drops units early nor logs a unit before one it saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Log {
    pub times: Vec<u64>,
    pub seen_ms: u64,
}

impl Log {
    /// Moves the log's clock to `now_ms` (never back) and drops the units that left the rolling
    /// window ending then (a unit counted at `t` counts until `t + window_ms`).
    pub fn trim(&mut self, w: &Window, now_ms: u64) {
        self.seen_ms = self.seen_ms.max(now_ms);
        let now_ms = self.seen_ms;
        let keep_from = self
            .times
            .partition_point(|t| t.saturating_add(w.window_ms) <= now_ms);
        self.times.drain(..keep_from);
    }

    /// When the log is empty again (0 when it is).
    pub fn idle_at_ms(&self, w: &Window) -> u64 {
        self.times
            .last()
            .map_or(0, |t| t.saturating_add(w.window_ms))
    }

    /// Milliseconds until `cost` more units fit (the log is trimmed at `now_ms`).
    fn wait_ms(&self, w: &Window, now_ms: u64, cost: u64) -> u64 {
        let now_ms = now_ms.max(self.seen_ms);
        let keep = usize::try_from(w.limit.saturating_sub(cost)).unwrap_or(usize::MAX);
        let must_leave = self.times.len().saturating_sub(keep);
        match must_leave.checked_sub(1).and_then(|i| self.times.get(i)) {
            Some(t) => t.saturating_add(w.window_ms).saturating_sub(now_ms).max(1),
            None => 1,
        }
    }

    /// Enters `units` units at `at_ms`, keeping the log in time order (a lease's units are
    /// entered at its expiry, later than units taken since).
    fn record(&mut self, units: u64, at_ms: u64) {
        let at = self.times.partition_point(|t| *t <= at_ms);
        let units = usize::try_from(units).unwrap_or(usize::MAX);
        self.times
            .splice(at..at, std::iter::repeat(at_ms).take(units));
    }

    /// When a lease granted now expires and its units are entered: the end of the window-grid
    /// slot the log's clock is in (see the module's notes on leases).
    pub fn lease_end_ms(&self, w: &Window) -> u64 {
        w.end_ms(w.index(self.seen_ms))
    }

    /// Counts `cost` units at `now_ms` if they fit in the rolling window.
    pub fn take(&mut self, w: &Window, now_ms: u64, cost: u64) -> Decision {
        self.trim(w, now_ms);
        let used = self.times.len() as u64;
        if used.saturating_add(cost) <= w.limit {
            self.record(cost, self.seen_ms);
            Decision::Allowed {
                remaining: (w.limit - used - cost) as f64,
            }
        } else {
            Decision::Denied {
                retry_after_ms: self.wait_ms(w, now_ms, cost),
                remaining: w.limit.saturating_sub(used) as f64,
            }
        }
    }

    /// Leases at least `min`, at most `want` units. The lease expires at the end of the current
    /// slot of the window's grid ([`Log::lease_end_ms`]: `expires_ms` from `now_ms`) and its
    /// units are entered in the log at that time: they count from the grant until a window
    /// after the lease expired, whenever the instance spends them.
    pub fn lease(&mut self, w: &Window, now_ms: u64, min: u64, want: u64) -> WindowGrant {
        self.trim(w, now_ms);
        let min = min.max(1);
        let room = w.limit.saturating_sub(self.times.len() as u64);
        let ends_ms = self.lease_end_ms(w);
        // After `seen_ms` >= `now_ms`, so at least 1.
        let expires_ms = ends_ms.saturating_sub(now_ms).max(1);
        if room < min {
            return WindowGrant {
                granted: 0,
                remaining: room as f64,
                retry_after_ms: self.wait_ms(w, now_ms, min),
                expires_ms,
            };
        }
        let granted = want.max(min).min(room);
        self.record(granted, ends_ms);
        WindowGrant {
            granted,
            remaining: (room - granted) as f64,
            retry_after_ms: 0,
            expires_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w() -> Window {
        Window::new(10, 1_000).unwrap()
    }

    #[test]
    fn fixed_window_resets_at_its_boundary_and_allows_the_double_burst() {
        let (mut c, mut admitted) = (None, 0);
        for _ in 0..15 {
            let (next, d) = take(CounterKind::Fixed, &w(), c, 999, 1);
            admitted += u64::from(d.is_allowed());
            c = Some(next);
        }
        assert_eq!(admitted, 10);
        let (_, d) = take(CounterKind::Fixed, &w(), c, 999, 1);
        assert_eq!(
            d,
            Decision::Denied {
                retry_after_ms: 1,
                remaining: 0.0
            }
        );
        // 1 ms later a new window: 10 more, 20 within 2 ms (the documented double burst).
        for _ in 0..10 {
            let (next, d) = take(CounterKind::Fixed, &w(), c, 1_000, 1);
            assert!(d.is_allowed());
            c = Some(next);
        }
        assert!(!take(CounterKind::Fixed, &w(), c, 1_001, 1).1.is_allowed());
        // A clock that went back counts in the newest window: nothing new to spend.
        assert!(!take(CounterKind::Fixed, &w(), c, 500, 1).1.is_allowed());
    }

    #[test]
    fn a_monthly_quota_resets_at_the_first_of_the_month() {
        use crate::calendar::DAY_MS;
        // 2028-02-29 00:00 UTC (a leap day) and 2028-03-01 00:00 UTC.
        let feb29 = crate::calendar::days_from_civil(2028, 2, 29) * DAY_MS;
        let mar1 = feb29 + DAY_MS;
        let w = Window::calendar(3, Calendar::Months(1)).unwrap();
        assert_eq!(w.length_ms_at(feb29), 29 * DAY_MS);
        assert_eq!(w.length_ms_at(mar1), 31 * DAY_MS);
        let mut c = None;
        for _ in 0..3 {
            let (next, d) = take(CounterKind::Fixed, &w, c, feb29, 1);
            assert!(d.is_allowed());
            c = Some(next);
        }
        // Spent: a denial until the first of March, not 31 days after the window started.
        let noon = feb29 + DAY_MS / 2;
        let (_, d) = take(CounterKind::Fixed, &w, c, noon, 1);
        assert_eq!(
            d,
            Decision::Denied {
                retry_after_ms: mar1 - noon,
                remaining: 0.0
            }
        );
        let (_, d) = take(CounterKind::Fixed, &w, c, mar1 - 1, 1);
        assert!(!d.is_allowed());
        // March: a fresh window; idle state ends with February.
        assert_eq!(c.unwrap().idle_at_ms(&w, false), mar1);
        let (c2, d) = take(CounterKind::Fixed, &w, c, mar1, 3);
        assert_eq!(d, Decision::Allowed { remaining: 0.0 });
        assert_eq!(c2.window, c.unwrap().window + 1);
        // A lease of February ends at its end.
        let (_, g) = lease(CounterKind::Fixed, &w, None, noon, 1, 2);
        assert_eq!((g.granted, g.expires_ms), (2, mar1 - noon));
    }

    #[test]
    fn sliding_window_weighs_the_previous_window() {
        let mut c = None;
        for _ in 0..10 {
            c = Some(take(CounterKind::Sliding, &w(), c, 900, 1).0);
        }
        // At 1,250 the previous 10 weigh 7.5: 2 fit, the third does not.
        let (c2, d) = take(CounterKind::Sliding, &w(), c, 1_250, 2);
        assert!(d.is_allowed(), "{d:?}");
        let (_, d) = take(CounterKind::Sliding, &w(), Some(c2), 1_250, 1);
        let Decision::Denied { retry_after_ms, .. } = d else {
            panic!("admitted over the estimate");
        };
        // One more fits once the previous weighs 7: at 1,300.
        assert_eq!(retry_after_ms, 50);
        assert!(take(CounterKind::Sliding, &w(), Some(c2), 1_300, 1)
            .1
            .is_allowed());
        // Two windows later nothing is left.
        let idle = c2.idle_at_ms(&w(), true);
        assert_eq!(idle, 3_000);
        assert_eq!(
            counted(CounterKind::Sliding, &w(), &c2.at(&w(), idle), idle),
            0.0
        );
    }

    #[test]
    fn sliding_log_is_exact_over_any_rolling_window() {
        let mut log = Log::default();
        for t in [0u64, 100, 200, 300, 400, 500, 600, 700, 800, 900] {
            assert!(log.take(&w(), t, 1).is_allowed());
        }
        let d = log.take(&w(), 950, 1);
        // A unit counts for one window: the unit of t=0 leaves at t = 1000.
        assert_eq!(
            d,
            Decision::Denied {
                retry_after_ms: 50,
                remaining: 0.0
            }
        );
        assert!(log.take(&w(), 1_000, 1).is_allowed());
        assert!(!log.take(&w(), 1_000, 1).is_allowed());
        // Two units wait for the two oldest (100 and 200) to leave.
        assert_eq!(
            log.take(&w(), 1_050, 2),
            Decision::Denied {
                retry_after_ms: 150,
                remaining: 0.0
            }
        );
        assert_eq!(log.idle_at_ms(&w()), 2_000);
    }

    #[test]
    fn window_leases_take_what_fits_and_expire_at_the_window_end() {
        let (c, g) = lease(CounterKind::Fixed, &w(), None, 250, 3, 8);
        assert_eq!((g.granted, g.expires_ms), (8, 750));
        let (c, g) = lease(CounterKind::Fixed, &w(), Some(c), 260, 1, 8);
        assert_eq!(g.granted, 2);
        let (_, g) = lease(CounterKind::Fixed, &w(), Some(c), 270, 1, 8);
        assert_eq!((g.granted, g.retry_after_ms), (0, 730));
        let mut log = Log::default();
        assert_eq!(log.lease(&w(), 0, 4, 6).granted, 6);
        assert_eq!(log.lease(&w(), 10, 5, 6).granted, 0);
        assert_eq!(log.lease(&w(), 10, 4, 6).granted, 4);
    }

    #[test]
    fn a_leased_unit_counts_until_a_window_after_its_lease_expires() {
        let mut log = Log::default();
        // Granted at 250: the lease ends with the grid slot, at 1,000, where its units are
        // entered; they leave the log at 2,000, a window after the last moment they may be
        // spent (a unit spent at 999 counts against every window up to 1,998).
        let g = log.lease(&w(), 250, 1, 6);
        assert_eq!((g.granted, g.expires_ms), (6, 750));
        assert_eq!(log.times, vec![1_000; 6]);
        // A unit taken meanwhile is entered before them (the log stays in time order).
        assert!(log.take(&w(), 400, 1).is_allowed());
        assert_eq!(log.times.first(), Some(&400));
        // Another lease of the slot ends with the first one.
        assert_eq!(log.lease(&w(), 900, 1, 3).expires_ms, 100);
        assert_eq!(log.times.len(), 10);
        // Full until the unit of 400 leaves (1,400), then until the leased ones leave at 2,000.
        let d = log.lease(&w(), 1_000, 1, 1);
        assert_eq!((d.granted, d.retry_after_ms), (0, 400));
        assert_eq!(log.lease(&w(), 1_400, 1, 5).granted, 1);
        let d = log.lease(&w(), 1_999, 1, 1);
        assert_eq!((d.granted, d.retry_after_ms), (0, 1));
        // At 2,000 the nine entered at 1,000 leave; what was leased at 1,400 stays until 3,000.
        let g = log.lease(&w(), 2_000, 1, 20);
        assert_eq!((g.granted, g.expires_ms), (9, 1_000));
        assert_eq!(log.idle_at_ms(&w()), 4_000);
    }
}
