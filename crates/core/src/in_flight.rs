//! Requests in flight per key: the slots a policy's `max_in_flight` hands out, released when
//! the stream ends, and expiring on their own so a lost release (a VM that restarted, a host
//! that never called back) cannot hold capacity forever.
//!
//! A slot is counted in the epoch it was taken in; an epoch lasts a quarter of the policy's
//! `in_flight_timeout`, and the counts of the last [`EPOCHS`] epochs are kept. A slot taken in
//! epoch `e` lives until epoch `e + EPOCHS` begins: between `timeout` and `1.25 × timeout`
//! after it was taken. Constant state (five counters and an epoch number) whatever the number
//! of slots, so it fits the filter's fixed-size table records.

/// Epochs whose counts are kept (the current one and the four before it).
pub const EPOCHS: usize = 5;

/// The slots of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Slots {
    /// The newest epoch seen.
    pub epoch: u64,
    /// `counts[i]`: slots taken in epoch `epoch - i` and not released yet.
    pub counts: [u32; EPOCHS],
}

/// Length of one epoch for a timeout: a quarter of it, at least 1 ms.
pub fn epoch_ms(timeout_ms: u64) -> u64 {
    timeout_ms.div_ceil((EPOCHS - 1) as u64).max(1)
}

impl Slots {
    /// Slots held now.
    pub fn held(&self) -> u64 {
        self.counts.iter().map(|c| u64::from(*c)).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.held() == 0
    }

    /// Moves to the epoch of `now_ms`, dropping the slots that expired; returns how many did.
    /// A clock that went backwards moves nothing.
    pub fn advance(&mut self, timeout_ms: u64, now_ms: u64) -> u64 {
        let current = now_ms / epoch_ms(timeout_ms);
        if current <= self.epoch {
            return 0;
        }
        let shift = current - self.epoch;
        let mut expired = 0;
        let mut next = [0u32; EPOCHS];
        for (age, count) in self.counts.iter().enumerate() {
            let moved = (age as u64).saturating_add(shift);
            match usize::try_from(moved).ok().and_then(|i| next.get_mut(i)) {
                Some(slot) => *slot = *count,
                None => expired += u64::from(*count),
            }
        }
        self.counts = next;
        self.epoch = current;
        expired
    }

    /// Takes a slot if fewer than `max` are held; returns the epoch to release it under.
    pub fn take(&mut self, max: u32, timeout_ms: u64, now_ms: u64) -> Option<u64> {
        self.advance(timeout_ms, now_ms);
        if self.held() >= u64::from(max) {
            return None;
        }
        let newest = self.counts.first_mut()?;
        *newest = newest.saturating_add(1);
        Some(self.epoch)
    }

    /// Releases a slot taken in `epoch`: `false` when it had expired already (or was never
    /// taken), so nothing is released twice.
    pub fn release(&mut self, epoch: u64, timeout_ms: u64, now_ms: u64) -> bool {
        self.advance(timeout_ms, now_ms);
        let Some(age) = self.epoch.checked_sub(epoch) else {
            return false;
        };
        match usize::try_from(age)
            .ok()
            .and_then(|i| self.counts.get_mut(i))
        {
            Some(count) if *count > 0 => {
                *count -= 1;
                true
            }
            _ => false,
        }
    }

    /// When the oldest held slot expires (0 when none is held): until then the record holding
    /// these slots must not be evicted.
    pub fn busy_until_ms(&self, timeout_ms: u64) -> u64 {
        let oldest = self
            .counts
            .iter()
            .enumerate()
            .rev()
            .find(|(_, count)| **count > 0)
            .map(|(age, _)| age as u64);
        match oldest {
            Some(age) => {
                let taken_in = self.epoch.saturating_sub(age);
                taken_in
                    .saturating_add(EPOCHS as u64)
                    .saturating_mul(epoch_ms(timeout_ms))
            }
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_released_once_and_expire_after_the_timeout() {
        let timeout = 4_000;
        let mut s = Slots::default();
        let mut taken = Vec::new();
        for _ in 0..3 {
            taken.push(s.take(3, timeout, 10_000).unwrap());
        }
        assert_eq!(s.take(3, timeout, 10_000), None);
        assert!(s.release(taken[0], timeout, 10_500));
        assert!(!s.release(taken[0] + 1, timeout, 10_500));
        assert_eq!(s.held(), 2);
        let late = s.take(3, timeout, 12_000).unwrap();
        assert_eq!(s.held(), 3);
        // The first two live at least the timeout...
        assert_eq!(s.advance(timeout, 13_999), 0);
        assert_eq!(s.held(), 3);
        // ...and are gone a quarter of it later at most.
        assert_eq!(s.advance(timeout, 15_000), 2);
        assert_eq!(s.held(), 1);
        assert!(!s.release(taken[1], timeout, 15_000));
        assert_eq!(s.busy_until_ms(timeout), (12_000 / 1_000 + 5) * 1_000);
        assert!(s.release(late, timeout, 15_000));
        assert!(s.is_empty());
        assert_eq!(s.busy_until_ms(timeout), 0);
    }

    #[test]
    fn time_going_backwards_expires_nothing() {
        let mut s = Slots::default();
        let e = s.take(1, 1_000, 50_000).unwrap();
        assert_eq!(s.advance(1_000, 10_000), 0);
        assert_eq!(s.held(), 1);
        assert!(s.release(e, 1_000, 10_000));
    }

    #[test]
    fn a_long_gap_expires_everything() {
        let mut s = Slots::default();
        s.take(5, 1_000, 0).unwrap();
        s.take(5, 1_000, 0).unwrap();
        assert_eq!(s.advance(1_000, u64::MAX), 2);
        assert!(s.is_empty());
    }
}
