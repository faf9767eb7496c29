//! Human-written durations in policy documents (`"25ms"`, `"1s"`, `"30s"`, `"1m"`, `"1h"`, `"1d"`).
//!
//! Stored as whole milliseconds: every clock in tollgate (host clock, Redis `TIME`) is read at
//! millisecond resolution for bucket math.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A non-negative duration with millisecond resolution, written with a unit suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Millis(pub u64);

/// Largest duration a document may state: 365 days. Keeps every derived product finite.
pub const MAX_MILLIS: u64 = 365 * 24 * 3600 * 1000;

impl Millis {
    pub fn as_millis(self) -> u64 {
        self.0
    }

    /// Parses `<integer><unit>` with unit one of `ms`, `s`, `m`, `h`, `d`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let split = text
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| format!("`{text}` has no unit (use ms, s, m, h or d)"))?;
        let (digits, unit) = text.split_at(split);
        if unit.starts_with(char::is_whitespace) {
            return Err(format!(
                "`{text}` has a space before its unit (write `{digits}{}`)",
                unit.trim_start()
            ));
        }
        if digits.is_empty() {
            return Err(format!("`{text}` must start with a whole number"));
        }
        let value: u64 = digits
            .parse()
            .map_err(|_| format!("`{text}` is too large"))?;
        let scale: u64 = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            other => {
                return Err(format!(
                    "`{text}` has unknown unit `{other}` (use ms, s, m, h or d)"
                ))
            }
        };
        let millis = value
            .checked_mul(scale)
            .filter(|ms| *ms <= MAX_MILLIS)
            .ok_or_else(|| format!("`{text}` is longer than 365d"))?;
        Ok(Millis(millis))
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0;
        if ms != 0 && ms % 86_400_000 == 0 {
            write!(f, "{}d", ms / 86_400_000)
        } else if ms != 0 && ms % 3_600_000 == 0 {
            write!(f, "{}h", ms / 3_600_000)
        } else if ms != 0 && ms % 60_000 == 0 {
            write!(f, "{}m", ms / 60_000)
        } else if ms % 1_000 == 0 {
            write!(f, "{}s", ms / 1_000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Millis::parse(&text).map_err(serde::de::Error::custom)
    }
}

impl Serialize for Millis {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(Millis::parse("25ms"), Ok(Millis(25)));
        assert_eq!(Millis::parse("1s"), Ok(Millis(1_000)));
        assert_eq!(Millis::parse("30s"), Ok(Millis(30_000)));
        assert_eq!(Millis::parse("2m"), Ok(Millis(120_000)));
        assert_eq!(Millis::parse("1h"), Ok(Millis(3_600_000)));
        assert_eq!(Millis::parse("1d"), Ok(Millis(86_400_000)));
    }

    #[test]
    fn rejects_garbage() {
        assert!(Millis::parse("1").is_err());
        assert!(Millis::parse("s").is_err());
        assert!(Millis::parse("1.5s").is_err());
        assert!(Millis::parse("-1s").is_err());
        assert!(Millis::parse("1w").is_err());
        assert!(Millis::parse("99999999999999999999s").is_err());
        assert!(Millis::parse("366d").is_err());
        assert_eq!(
            Millis::parse("5 s"),
            Err("`5 s` has a space before its unit (write `5s`)".into())
        );
        assert_eq!(
            Millis::parse(" 5x"),
            Err("`5x` has unknown unit `x` (use ms, s, m, h or d)".into())
        );
    }

    #[test]
    fn displays_round_trip() {
        for text in ["25ms", "1s", "90s", "2m", "1h", "1d", "0s"] {
            let parsed = Millis::parse(text).unwrap();
            assert_eq!(Millis::parse(&parsed.to_string()), Ok(parsed));
        }
        assert_eq!(Millis(1_500).to_string(), "1500ms");
    }
}
