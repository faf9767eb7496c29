//! A sliding minute as a ring of six 10-second buckets: what the hot-key counters, the
//! distinct-key sketches and the call totals of [`super`] are kept in.
//!
//! A bucket belongs to one 10-second epoch (`now_s / 10`); writing in a new epoch reuses the
//! oldest slot, cleared first. Reading merges the buckets of the current epoch and the five
//! before it, so "the last minute" is the last 50 to 60 seconds. Memory is six `T`s, fixed.

/// Seconds one bucket covers.
pub const BUCKET_S: u64 = 10;
/// Buckets in the ring: 6 × 10 s, one minute.
pub const BUCKETS: u64 = 6;
/// The window the ring covers, in seconds.
pub const WINDOW_S: u64 = BUCKET_S * BUCKETS;

#[derive(Debug, Clone)]
struct Slot<T> {
    /// The epoch the slot's content belongs to (`None`: never written).
    epoch: Option<u64>,
    value: T,
}

/// Six buckets of `T`, each cleared by `clear` before it is reused.
#[derive(Debug, Clone)]
pub struct Ring<T> {
    slots: Vec<Slot<T>>,
}

fn epoch(now_s: u64) -> u64 {
    now_s / BUCKET_S
}

impl<T> Ring<T> {
    /// A ring of six copies of `empty`.
    pub fn new(empty: impl Fn() -> T) -> Self {
        Self {
            slots: (0..BUCKETS)
                .map(|_| Slot {
                    epoch: None,
                    value: empty(),
                })
                .collect(),
        }
    }

    /// The bucket of `now_s`'s epoch, cleared with `clear` if it held an older one.
    pub fn current(&mut self, now_s: u64, clear: impl FnOnce(&mut T)) -> &mut T {
        let now = epoch(now_s);
        // `now % BUCKETS` < BUCKETS = `slots.len()`.
        let slot = &mut self.slots[(now % BUCKETS) as usize];
        if slot.epoch != Some(now) {
            clear(&mut slot.value);
            slot.epoch = Some(now);
        }
        &mut slot.value
    }

    /// The buckets of the last minute as of `now_s` (the current epoch and the five before).
    pub fn live(&self, now_s: u64) -> impl Iterator<Item = &T> {
        let now = epoch(now_s);
        self.slots
            .iter()
            .filter(move |slot| slot.epoch.is_some_and(|e| e <= now && now - e < BUCKETS))
            .map(|slot| &slot.value)
    }

    /// Every bucket, live or not (for tests of memory bounds).
    #[cfg(test)]
    pub fn all(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().map(|slot| &slot.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_lives_one_minute_then_is_reused_cleared() {
        let mut ring = Ring::new(|| 0u64);
        *ring.current(0, |v| *v = 0) += 5;
        *ring.current(9, |v| *v = 0) += 1;
        *ring.current(10, |v| *v = 0) += 2;
        assert_eq!(ring.live(10).sum::<u64>(), 8);
        // Epoch 0 is live until second 59, gone at 60.
        assert_eq!(ring.live(59).sum::<u64>(), 8);
        assert_eq!(ring.live(60).sum::<u64>(), 2);
        assert_eq!(ring.live(70).sum::<u64>(), 0);
        // Epoch 6 reuses epoch 0's slot, cleared.
        *ring.current(61, |v| *v = 0) += 1;
        assert_eq!(ring.live(61).sum::<u64>(), 3);
        // A reader behind the writer's clock sees nothing from its future.
        assert_eq!(ring.live(5).sum::<u64>(), 0);
    }
}
