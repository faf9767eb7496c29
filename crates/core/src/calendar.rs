//! Calendar periods for fixed windows (`"per": "1w"`, `"1mo"`, `"3mo"`, `"1y"`): quotas that
//! reset when a customer's calendar does, not every `30d` counted from 1970.
//!
//! Everything is UTC and plain integer arithmetic on milliseconds since the epoch (no date
//! library: the filter's `.wasm` stays small, and the limiter's Redis Function repeats the
//! same few lines in Lua). A period's windows tile time: each millisecond lies in exactly one
//! window, numbered by an index that grows with time, and a window ends where the next starts.
//!
//! * **Weeks** (`Nw`): Monday 00:00 UTC to Monday 00:00 UTC; `N` weeks count on a grid of
//!   `N`-week windows starting Monday 1969-12-29 (the Monday before the epoch).
//! * **Months** (`Nmo`, `N` dividing 12): from the first of a month, 00:00 UTC, with the real
//!   month lengths (28 to 31 days); `N` months count from January (`3mo`: quarters, `6mo`:
//!   halves).
//! * **Years** (`1y`): from January 1st, 00:00 UTC, 365 or 366 days; the same as `12mo`.
//!
//! The first window of a week grid starts 3 days before the epoch; its start reads as 0.

use crate::duration::Millis;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Milliseconds in a day (UTC has no leap seconds in Unix time).
pub const DAY_MS: u64 = 86_400_000;

/// Most weeks in one window (a year's worth).
pub const MAX_WEEKS: u32 = 52;

/// Days from Monday 1969-12-29, where the week grid starts, to the epoch (a Thursday).
const WEEK_GRID_OFFSET_DAYS: u64 = 3;

/// A bound on the years a window start is computed for, far past the last representable
/// millisecond (in the year 584,556,019): later starts read as `u64::MAX` without their day
/// count overflowing.
const LAST_YEAR: u64 = 1_000_000_000_000;

/// A calendar period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Calendar {
    /// `n` weeks (1 to [`MAX_WEEKS`]), from Monday 00:00 UTC.
    Weeks(u32),
    /// `n` months (1, 2, 3, 4, 6 or 12: a divisor of 12), from the first of a month 00:00 UTC;
    /// `Months(12)` is a year.
    Months(u32),
}

/// Days since 1970-01-01 of the proleptic Gregorian date `year-month-day` (month 1 to 12),
/// for dates from the epoch on (`days_from_civil` of H. Hinnant's date algorithms, unsigned).
pub fn days_from_civil(year: u64, month: u32, day: u32) -> u64 {
    let (month, day) = (u64::from(month), u64::from(day));
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).saturating_sub(719_468)
}

/// The date (year, month 1 to 12, day 1 to 31) of `days` days after 1970-01-01
/// (`civil_from_days`, unsigned).
pub fn civil_from_days(days: u64) -> (u64, u32, u32) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    // Both fit: day ≤ 31, month ≤ 12.
    (year, month as u32, day as u32)
}

/// Whether `year` has a February 29th.
pub fn is_leap_year(year: u64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

/// Days in `month` (1 to 12) of `year`.
pub fn days_in_month(year: u64, month: u32) -> u32 {
    match month {
        2 if is_leap_year(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

impl Calendar {
    /// `n` weeks, if 1 ≤ n ≤ [`MAX_WEEKS`].
    pub fn weeks(n: u32) -> Option<Self> {
        (1..=MAX_WEEKS).contains(&n).then_some(Calendar::Weeks(n))
    }

    /// `n` months, if `n` divides 12.
    pub fn months(n: u32) -> Option<Self> {
        (n > 0 && 12 % n == 0).then_some(Calendar::Months(n))
    }

    /// The window `now_ms` falls in. (Not inlined, nor `start_ms`: the windows' callers are
    /// many and the calendar path rare, so one copy keeps the `.wasm` small.)
    #[inline(never)]
    pub fn index(self, now_ms: u64) -> u64 {
        let days = now_ms / DAY_MS;
        match self {
            Calendar::Weeks(n) => (days + WEEK_GRID_OFFSET_DAYS) / (7 * u64::from(n)),
            Calendar::Months(n) => {
                let (year, month, _) = civil_from_days(days);
                ((year - 1970) * 12 + u64::from(month) - 1) / u64::from(n)
            }
        }
    }

    /// When window `index` starts (0 for the week grid's first window, which starts before
    /// the epoch; `u64::MAX` past the last representable millisecond).
    #[inline(never)]
    pub fn start_ms(self, index: u64) -> u64 {
        let days = match self {
            Calendar::Weeks(n) => index
                .checked_mul(7 * u64::from(n))
                .map(|d| d.saturating_sub(WEEK_GRID_OFFSET_DAYS)),
            Calendar::Months(n) => index.checked_mul(u64::from(n)).and_then(|months| {
                let year = 1970 + months / 12;
                // `month` is 1 to 12; up to LAST_YEAR the day count cannot overflow.
                (year <= LAST_YEAR).then(|| days_from_civil(year, (months % 12) as u32 + 1, 1))
            }),
        };
        days.and_then(|d| d.checked_mul(DAY_MS)).unwrap_or(u64::MAX)
    }

    /// When window `index` ends: where window `index + 1` starts.
    pub fn end_ms(self, index: u64) -> u64 {
        self.start_ms(index.saturating_add(1))
    }

    /// The longest a window of this period can be (`1mo`: 31 days, `1y`: 366): the length a
    /// policy's rate is stated over where one length is needed (the fallback bucket of
    /// `on_unavailable: local`).
    pub fn longest_ms(self) -> u64 {
        match self {
            Calendar::Weeks(n) => 7 * u64::from(n) * DAY_MS,
            Calendar::Months(n) => {
                // The longest window of a leap year's grid: January (1mo), July and August
                // (2mo), July to September (3mo), May to August (4mo), July to December (6mo).
                let days = match n {
                    1 => 31,
                    2 => 62,
                    3 => 92,
                    4 => 123,
                    6 => 184,
                    _ => 366,
                };
                days * DAY_MS
            }
        }
    }

    /// Parses `<n>w`, `<n>mo` or `1y`; `None` when `unit` is not a calendar unit.
    pub fn parse(value: u64, unit: &str) -> Option<Result<Self, String>> {
        let n = u32::try_from(value).unwrap_or(u32::MAX);
        Some(match unit {
            "w" => Calendar::weeks(n)
                .ok_or_else(|| format!("`{value}w`: a window of weeks is 1w to {MAX_WEEKS}w")),
            "mo" => Calendar::months(n).ok_or_else(|| {
                format!(
                    "`{value}mo`: months count from January, so N of `Nmo` divides 12 \
                     (1mo, 2mo, 3mo, 4mo, 6mo or 12mo)"
                )
            }),
            "y" if value == 1 => Ok(Calendar::Months(12)),
            "y" => Err(format!(
                "`{value}y`: years count one at a time (1y, from January 1st)"
            )),
            _ => return None,
        })
    }
}

impl fmt::Display for Calendar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Calendar::Weeks(n) => write!(f, "{n}w"),
            Calendar::Months(12) => f.write_str("1y"),
            Calendar::Months(n) => write!(f, "{n}mo"),
        }
    }
}

/// A rate's `per`: a duration (`"1s"`, `"30d"`) or, for a fixed window, a calendar period
/// (`"1w"`, `"1mo"`, `"1y"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RatePeriod {
    Duration(Millis),
    Calendar(Calendar),
}

impl RatePeriod {
    /// Parses `<integer><unit>`: a duration's unit (`ms`, `s`, `m`, `h`, `d`) or a calendar
    /// period's (`w`, `mo`, `y`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let trimmed = text.trim();
        let split = trimmed.find(|c: char| !c.is_ascii_digit());
        if let Some((digits, unit)) = split.map(|at| trimmed.split_at(at)) {
            if let Ok(value) = digits.parse::<u64>() {
                if let Some(calendar) = Calendar::parse(value, unit) {
                    return calendar.map(RatePeriod::Calendar);
                }
                if !matches!(unit, "ms" | "s" | "m" | "h" | "d") && !unit.starts_with(' ') {
                    return Err(format!(
                        "`{trimmed}` has unknown unit `{unit}` (use ms, s, m, h or d; for a \
                         fixed window also w, mo or y)"
                    ));
                }
            }
        }
        Millis::parse(text).map(RatePeriod::Duration)
    }

    /// A duration's milliseconds; a calendar period's longest window ([`Calendar::longest_ms`]).
    pub fn nominal_ms(self) -> u64 {
        match self {
            RatePeriod::Duration(ms) => ms.0,
            RatePeriod::Calendar(c) => c.longest_ms(),
        }
    }

    pub fn calendar(self) -> Option<Calendar> {
        match self {
            RatePeriod::Duration(_) => None,
            RatePeriod::Calendar(c) => Some(c),
        }
    }
}

impl From<Millis> for RatePeriod {
    fn from(ms: Millis) -> Self {
        RatePeriod::Duration(ms)
    }
}

impl fmt::Display for RatePeriod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RatePeriod::Duration(ms) => ms.fmt(f),
            RatePeriod::Calendar(c) => c.fmt(f),
        }
    }
}

impl<'de> Deserialize<'de> for RatePeriod {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        RatePeriod::parse(&text).map_err(serde::de::Error::custom)
    }
}

impl Serialize for RatePeriod {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Milliseconds of `year-month-day hh:mm:ss` UTC, by counting days one year and one month
    /// at a time from 1970 (slow and obviously right: the oracle for the fast arithmetic).
    pub(crate) fn utc(year: u64, month: u32, day: u32, hms: (u64, u64, u64)) -> u64 {
        let mut days = 0u64;
        for y in 1970..year {
            days += if is_leap_year(y) { 366 } else { 365 };
        }
        for m in 1..month {
            days += u64::from(days_in_month(year, m));
        }
        days += u64::from(day) - 1;
        ((days * 24 + hms.0) * 60 + hms.1) * 60_000 + hms.2 * 1_000
    }

    fn midnight(year: u64, month: u32, day: u32) -> u64 {
        utc(year, month, day, (0, 0, 0))
    }

    /// The window of `c` holding `t`: (start, end).
    fn window(c: Calendar, t: u64) -> (u64, u64) {
        let i = c.index(t);
        (c.start_ms(i), c.end_ms(i))
    }

    const MONTH: Calendar = Calendar::Months(1);
    const YEAR: Calendar = Calendar::Months(12);
    const WEEK: Calendar = Calendar::Weeks(1);

    #[test]
    fn civil_dates_round_trip_against_counting_days() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        for (y, m, d) in [
            (1970, 12, 31),
            (2000, 2, 29),
            (2024, 2, 29),
            (2028, 2, 29),
            (2028, 3, 1),
            (2099, 12, 31),
            (2100, 2, 28),
            (2100, 3, 1),
            (2400, 2, 29),
        ] {
            let days = midnight(y, m, d) / DAY_MS;
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
            assert_eq!(civil_from_days(days), (y, m, d), "{y}-{m}-{d}");
        }
        assert!(is_leap_year(2028) && is_leap_year(2000) && is_leap_year(2400));
        assert!(!is_leap_year(2100) && !is_leap_year(2027));
    }

    #[test]
    fn a_month_runs_from_its_first_to_the_next_first_with_its_real_length() {
        // 31 January 2027, 23:59:59: January's window, ending at February's first.
        let t = utc(2027, 1, 31, (23, 59, 59));
        assert_eq!(
            window(MONTH, t),
            (midnight(2027, 1, 1), midnight(2027, 2, 1))
        );
        assert_eq!(
            MONTH.index(t) + 1,
            MONTH.index(t + 1_000),
            "the next second"
        );
        // February: 28 days in 2027, 29 in 2028 (a leap year), 28 in 2100 (not one).
        for (year, days) in [(2027, 28), (2028, 29), (2100, 28), (2000, 29)] {
            let (start, end) = window(MONTH, midnight(year, 2, 14));
            assert_eq!(start, midnight(year, 2, 1));
            assert_eq!(end, midnight(year, 3, 1));
            assert_eq!(end - start, days * DAY_MS, "February {year}");
        }
        // 29 February 2028 is February's last day, its last millisecond still February.
        let feb29 = utc(2028, 2, 29, (23, 59, 59)) + 999;
        assert_eq!(window(MONTH, feb29).1, feb29 + 1);
        assert_eq!(window(MONTH, feb29 + 1).0, midnight(2028, 3, 1));
        // April has 30 days, December 31 and ends the year.
        assert_eq!(
            window(MONTH, midnight(2027, 4, 30)),
            (midnight(2027, 4, 1), midnight(2027, 5, 1))
        );
        assert_eq!(
            window(MONTH, utc(2027, 12, 31, (12, 0, 0))),
            (midnight(2027, 12, 1), midnight(2028, 1, 1))
        );
    }

    #[test]
    fn months_group_from_january_and_a_year_is_twelve_of_them() {
        let q = Calendar::Months(3);
        // Quarters: 1 Jan, 1 Apr, 1 Jul, 1 Oct.
        assert_eq!(
            window(q, midnight(2028, 3, 31)),
            (midnight(2028, 1, 1), midnight(2028, 4, 1))
        );
        assert_eq!(
            window(q, midnight(2028, 11, 15)),
            (midnight(2028, 10, 1), midnight(2029, 1, 1))
        );
        assert_eq!(
            window(Calendar::Months(6), midnight(2028, 7, 1)),
            (midnight(2028, 7, 1), midnight(2029, 1, 1))
        );
        assert_eq!(
            window(Calendar::Months(4), midnight(2028, 8, 31)),
            (midnight(2028, 5, 1), midnight(2028, 9, 1))
        );
        // Years: 366 days in 2028, 365 in 2029; the last millisecond of a year is still it.
        let (start, end) = window(YEAR, midnight(2028, 6, 1));
        assert_eq!((start, end), (midnight(2028, 1, 1), midnight(2029, 1, 1)));
        assert_eq!(end - start, 366 * DAY_MS);
        assert_eq!(window(YEAR, end - 1), (start, end));
        assert_eq!(window(YEAR, end).1 - end, 365 * DAY_MS);
        assert_eq!(YEAR.index(midnight(1970, 1, 1)), 0);
        assert_eq!(YEAR.index(midnight(2029, 1, 1)), 59);
    }

    #[test]
    fn weeks_run_monday_to_monday() {
        // 1 January 2029 is a Monday; 31 December 2028 a Sunday.
        let monday = midnight(2029, 1, 1);
        assert_eq!(window(WEEK, monday - 1), (monday - 7 * DAY_MS, monday));
        assert_eq!(window(WEEK, monday), (monday, monday + 7 * DAY_MS));
        // The epoch, a Thursday, lies in the week of Monday 29 December 1969 (read as 0).
        assert_eq!(window(WEEK, 0), (0, 4 * DAY_MS));
        assert_eq!(WEEK.start_ms(1), midnight(1970, 1, 5));
        // Two-week windows on the grid from Monday 29 December 1969: 8 January 2029 is 3,080
        // weeks after it (an even number), so it starts one; 1 January 2029 does not.
        let two = Calendar::Weeks(2);
        let jan8 = midnight(2029, 1, 8);
        assert_eq!((jan8 - midnight(1970, 1, 5)) / (7 * DAY_MS) + 1, 3_080);
        assert_eq!(window(two, jan8 + 9 * DAY_MS), (jan8, jan8 + 14 * DAY_MS));
        assert_eq!(window(two, jan8 - 1), (jan8 - 14 * DAY_MS, jan8));
        assert_eq!(window(two, monday), (jan8 - 14 * DAY_MS, jan8));
    }

    #[test]
    fn the_far_future_saturates() {
        let last = MONTH.index(u64::MAX);
        assert_eq!(MONTH.end_ms(last), u64::MAX);
        assert_eq!(MONTH.end_ms(u64::MAX), u64::MAX);
        assert_eq!(WEEK.end_ms(u64::MAX), u64::MAX);
        let start = MONTH.start_ms(last);
        assert!(
            start < u64::MAX && u64::MAX - start < 31 * DAY_MS,
            "{start}"
        );
        assert_eq!(MONTH.index(start), last);
        assert_eq!(MONTH.index(start - 1), last - 1);
        assert_eq!(YEAR.start_ms(u64::MAX / 12), u64::MAX);
    }

    #[test]
    fn parses_calendar_units_only() {
        assert_eq!(Calendar::parse(1, "w"), Some(Ok(Calendar::Weeks(1))));
        assert_eq!(Calendar::parse(52, "w"), Some(Ok(Calendar::Weeks(52))));
        assert_eq!(Calendar::parse(3, "mo"), Some(Ok(Calendar::Months(3))));
        assert_eq!(Calendar::parse(1, "y"), Some(Ok(YEAR)));
        assert_eq!(Calendar::parse(12, "mo"), Some(Ok(YEAR)));
        for (n, unit) in [
            (0, "w"),
            (53, "w"),
            (0, "mo"),
            (5, "mo"),
            (24, "mo"),
            (2, "y"),
        ] {
            assert!(
                matches!(Calendar::parse(n, unit), Some(Err(_))),
                "{n}{unit}"
            );
        }
        assert_eq!(Calendar::parse(1, "d"), None);
        assert_eq!(Calendar::parse(1, "m"), None);
        for c in [WEEK, Calendar::Weeks(4), MONTH, Calendar::Months(6), YEAR] {
            assert_eq!(c.to_string(), format!("{c}"));
        }
        assert_eq!(YEAR.to_string(), "1y");
        assert_eq!(Calendar::Months(3).to_string(), "3mo");
        assert_eq!(Calendar::Weeks(2).to_string(), "2w");
    }

    #[test]
    fn a_rate_period_is_a_duration_or_a_calendar_period() {
        let parse = RatePeriod::parse;
        assert_eq!(parse("1s"), Ok(RatePeriod::Duration(Millis(1_000))));
        assert_eq!(parse("30d"), Ok(RatePeriod::Duration(Millis(30 * DAY_MS))));
        assert_eq!(parse("1m"), Ok(RatePeriod::Duration(Millis(60_000))));
        assert_eq!(parse("1mo"), Ok(RatePeriod::Calendar(MONTH)));
        assert_eq!(parse(" 2w "), Ok(RatePeriod::Calendar(Calendar::Weeks(2))));
        assert_eq!(parse("1y"), Ok(RatePeriod::Calendar(YEAR)));
        assert!(parse("5mo").unwrap_err().contains("divides 12"));
        assert_eq!(
            parse("1fortnight"),
            Err(
                "`1fortnight` has unknown unit `fortnight` (use ms, s, m, h or d; for a fixed \
                 window also w, mo or y)"
                    .into()
            )
        );
        assert_eq!(
            parse("5 mo"),
            Err("`5 mo` has a space before its unit (write `5mo`)".into())
        );
        assert!(parse("mo").is_err());
        assert!(parse("366d").is_err());
        for text in ["1s", "90s", "1d", "1w", "3mo", "1y"] {
            let period = parse(text).unwrap();
            assert_eq!(period.to_string(), text);
            assert_eq!(parse(&period.to_string()), Ok(period));
        }
        assert_eq!(parse("12mo").unwrap().to_string(), "1y");
        assert_eq!(parse("1mo").unwrap().nominal_ms(), 31 * DAY_MS);
        assert_eq!(parse("1h").unwrap().nominal_ms(), 3_600_000);
    }

    #[test]
    fn the_longest_window_of_each_period() {
        // Every window of the grid in a leap year and the year after, measured.
        for n in [1u32, 2, 3, 4, 6, 12] {
            let c = Calendar::Months(n);
            let from = c.index(midnight(2028, 1, 1));
            let longest = (from..from + 24 / u64::from(n))
                .map(|i| c.end_ms(i) - c.start_ms(i))
                .max();
            assert_eq!(longest, Some(c.longest_ms()), "{c}");
        }
        assert_eq!(WEEK.longest_ms(), 7 * DAY_MS);
        assert_eq!(MONTH.longest_ms(), 31 * DAY_MS);
        // July and August.
        assert_eq!(Calendar::Months(2).longest_ms(), 62 * DAY_MS);
        assert_eq!(Calendar::Months(3).longest_ms(), 92 * DAY_MS);
        assert_eq!(Calendar::Months(6).longest_ms(), 184 * DAY_MS);
        assert_eq!(YEAR.longest_ms(), 366 * DAY_MS);
    }
}
