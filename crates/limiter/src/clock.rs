//! The in-memory store's clock, injected so tests can drive it.
//!
//! Redis stores use Redis `TIME`; the memory store has no server, so it reads this process's
//! clock: wall-clock milliseconds sampled once at start, advanced by a monotonic `Instant`, so
//! it never moves backwards however the system clock is adjusted.

#[cfg(test)]
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(test)]
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of milliseconds for bucket math.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> u64;
}

/// Wall-clock milliseconds at start plus monotonic elapsed time.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin_ms: u64,
    start: Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        let origin_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self {
            origin_ms,
            start: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u64 {
        let elapsed = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.origin_ms.saturating_add(elapsed)
    }
}

/// A clock that moves only when told to (the memory store's unit tests).
#[cfg(test)]
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

#[cfg(test)]
impl ManualClock {
    pub fn new(now_ms: u64) -> Self {
        Self(Arc::new(AtomicU64::new(now_ms)))
    }

    pub fn set(&self, now_ms: u64) {
        self.0.store(now_ms, Ordering::SeqCst);
    }

    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

#[cfg(test)]
impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_never_goes_back() {
        let c = MonotonicClock::new();
        let a = c.now_ms();
        let b = c.now_ms();
        assert!(b >= a);
        assert!(a > 1_600_000_000_000, "wall-clock based: {a}");
    }

    #[test]
    fn manual_clock_moves_when_told() {
        let c = ManualClock::new(10);
        let shared = c.clone();
        c.advance(5);
        assert_eq!(shared.now_ms(), 15);
        c.set(3);
        assert_eq!(shared.now_ms(), 3);
    }
}
