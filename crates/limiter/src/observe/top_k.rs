//! The busiest keys of one policy over the last minute, in fixed memory: a Space-Saving
//! heavy-hitters summary (Metwally, Agrawal, El Abbadi, 2005) per 10-second bucket of a
//! [`Ring`], merged when read.
//!
//! A summary holds at most `capacity` counters. A key already counted is incremented; a new
//! one takes a free counter, or replaces the smallest, inheriting its count as possible
//! over-count (`error`). So a count is never below the truth and at most `error` above it,
//! and every key with more than `calls / capacity` calls in a bucket is in that bucket's
//! summary: a hot key is never lost among cold ones however many there are. Keys are 64-bit
//! keyed hashes (`super::KeyHasher`), never the keys themselves.

use std::collections::HashMap;

use super::minute::Ring;

/// What was counted for one key (or for a whole policy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Lease items decided (or attempted) for the key.
    pub calls: u64,
    /// Units asked (`want`).
    pub asked: u64,
    /// Units granted (replays not counted).
    pub granted: u64,
}

impl Tally {
    pub fn add(&mut self, other: &Tally) {
        self.calls = self.calls.saturating_add(other.calls);
        self.asked = self.asked.saturating_add(other.asked);
        self.granted = self.granted.saturating_add(other.granted);
    }
}

/// One counter of a summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counter {
    key: u64,
    /// The node (an index of `super::Nodes`) the key's last call went to.
    node: u16,
    tally: Tally,
    /// How much of `tally.calls` may belong to keys this counter replaced.
    error: u64,
}

/// A Space-Saving summary of at most `capacity` keys.
#[derive(Debug, Clone)]
pub struct SpaceSaving {
    capacity: usize,
    counters: Vec<Counter>,
    /// Key → position in `counters`.
    index: HashMap<u64, usize>,
}

impl SpaceSaving {
    /// A summary of at most `capacity` (at least 1) counters; its memory is allocated now.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            capacity,
            counters: Vec::with_capacity(capacity),
            index: HashMap::with_capacity(capacity),
        }
    }

    pub fn clear(&mut self) {
        self.counters.clear();
        self.index.clear();
    }

    /// Counts one call of `key` (on `node`) asking `asked` units, granted `granted`.
    pub fn record(&mut self, key: u64, node: u16, asked: u64, granted: u64) {
        let add = Tally {
            calls: 1,
            asked,
            granted,
        };
        if let Some(&i) = self.index.get(&key) {
            // `index` holds positions in `counters`.
            let counter = &mut self.counters[i];
            counter.tally.add(&add);
            counter.node = node;
            return;
        }
        let fresh = Counter {
            key,
            node,
            tally: add,
            error: 0,
        };
        if self.counters.len() < self.capacity {
            self.index.insert(key, self.counters.len());
            self.counters.push(fresh);
            return;
        }
        let Some((i, smallest)) = self
            .counters
            .iter()
            .enumerate()
            .min_by_key(|(_, c)| c.tally.calls)
            .map(|(i, c)| (i, *c))
        else {
            return;
        };
        self.index.remove(&smallest.key);
        self.index.insert(key, i);
        // `i` comes from enumerating `counters`.
        self.counters[i] = Counter {
            tally: Tally {
                calls: smallest.tally.calls.saturating_add(1),
                ..add
            },
            error: smallest.tally.calls,
            ..fresh
        };
    }

    /// The most calls a key absent from the summary can have had: the smallest count once
    /// the summary is full, else 0.
    fn absent_bound(&self) -> u64 {
        if self.counters.len() < self.capacity {
            0
        } else {
            self.counters
                .iter()
                .map(|c| c.tally.calls)
                .min()
                .unwrap_or(0)
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.counters.len()
    }
}

/// One of the busiest keys of the last minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotKey {
    pub key: u64,
    /// The node its latest counted call went to.
    pub node: u16,
    /// What was counted for it in the buckets where it had a counter.
    pub tally: Tally,
    /// How much of `tally.calls` may belong to keys its counters replaced: it certainly had
    /// `tally.calls − over` calls.
    pub over: u64,
    /// How many calls it may have had in buckets where it had no counter (each such full
    /// bucket's smallest count): it had at most `tally.calls + missed`.
    pub missed: u64,
}

/// The busiest keys of one policy over the last minute.
#[derive(Debug, Clone)]
pub struct WindowedTopK {
    ring: Ring<SpaceSaving>,
}

impl WindowedTopK {
    /// `capacity` counters per 10-second bucket.
    pub fn new(capacity: usize) -> Self {
        Self {
            ring: Ring::new(|| SpaceSaving::new(capacity)),
        }
    }

    pub fn record(&mut self, now_s: u64, key: u64, node: u16, asked: u64, granted: u64) {
        self.ring
            .current(now_s, SpaceSaving::clear)
            .record(key, node, asked, granted);
    }

    /// The `n` keys with the most calls in the last minute as of `now_s`, busiest first
    /// (ties: smaller hash first). A key's calls are summed over the buckets; in a bucket
    /// where it was not counted it may have had up to that bucket's smallest count, which
    /// goes into its `missed`.
    pub fn top(&self, now_s: u64, n: usize) -> Vec<HotKey> {
        let mut merged: HashMap<u64, (HotKey, u64)> = HashMap::new();
        let mut absent_total = 0u64;
        for bucket in self.ring.live(now_s) {
            let absent = bucket.absent_bound();
            absent_total = absent_total.saturating_add(absent);
            for c in &bucket.counters {
                let (hot, absent_where_present) = merged.entry(c.key).or_insert((
                    HotKey {
                        key: c.key,
                        node: c.node,
                        tally: Tally::default(),
                        over: 0,
                        missed: 0,
                    },
                    0,
                ));
                hot.tally.add(&c.tally);
                hot.over = hot.over.saturating_add(c.error);
                hot.node = c.node;
                *absent_where_present = absent_where_present.saturating_add(absent);
            }
        }
        let mut keys: Vec<HotKey> = merged
            .into_values()
            .map(|(mut hot, absent_where_present)| {
                hot.missed = absent_total.saturating_sub(absent_where_present);
                hot
            })
            .collect();
        keys.sort_by(|a, b| b.tally.calls.cmp(&a.tally.calls).then(a.key.cmp(&b.key)));
        keys.truncate(n);
        keys
    }

    /// Counters held across the ring (for the memory bound's test).
    #[cfg(test)]
    fn counters(&self) -> usize {
        self.ring.all().map(SpaceSaving::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stream of distinct "cold" keys.
    fn cold(i: u64) -> u64 {
        i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
    }

    #[test]
    fn a_summary_never_grows_past_its_capacity() {
        let mut s = SpaceSaving::new(16);
        for i in 0..100_000 {
            s.record(cold(i), 0, 1, 1);
        }
        assert_eq!(s.len(), 16);
        assert_eq!(s.index.len(), 16);
        assert!(s.counters.capacity() <= 16 * 2, "{}", s.counters.capacity());
    }

    #[test]
    fn the_hot_key_is_found_among_a_flood_of_cold_ones() {
        let mut top = WindowedTopK::new(40);
        let hot = 42u64 << 32;
        let mut i = 0;
        // 5 % of the calls to one key, the rest to 50,000 distinct keys, over 30 seconds.
        for second in 0..30 {
            for n in 0..2_000 {
                if n % 20 == 0 {
                    top.record(second, hot, 1, 5, 5);
                } else {
                    top.record(second, cold(i), 0, 1, 1);
                    i += 1;
                }
            }
        }
        let found = top.top(29, 10);
        assert_eq!(found.len(), 10);
        let first = found[0];
        assert_eq!(first.key, hot, "{found:?}");
        assert_eq!(first.node, 1);
        // Exactly 100 calls a second for 30 s, within the bounds.
        assert!(first.tally.calls - first.over <= 3_000, "{first:?}");
        assert!(first.tally.calls + first.missed >= 3_000, "{first:?}");
        assert_eq!((first.tally.calls, first.over, first.missed), (3_000, 0, 0));
        assert_eq!(first.tally.asked, first.tally.granted);
        // A cold key's count is inflated by what it inherited (`over`), but far behind, and
        // its certain part is its one call.
        assert!(found[1].tally.calls < first.tally.calls / 2, "{found:?}");
        assert!(found[1].tally.calls - found[1].over <= 1, "{found:?}");
        // Memory: 40 counters in each of the 3 buckets written, whatever the traffic.
        assert!(top.counters() <= 6 * 40);
    }

    #[test]
    fn counts_are_exact_while_the_summary_has_room() {
        let mut top = WindowedTopK::new(8);
        for k in 1..=4u64 {
            for _ in 0..k * 10 {
                top.record(5, k, 0, 2, 1);
            }
        }
        let found = top.top(5, 10);
        assert_eq!(
            found
                .iter()
                .map(|h| (h.key, h.tally.calls))
                .collect::<Vec<_>>(),
            [(4, 40), (3, 30), (2, 20), (1, 10)]
        );
        assert!(found.iter().all(|h| h.over == 0 && h.missed == 0));
        assert_eq!(
            found[0].tally,
            Tally {
                calls: 40,
                asked: 80,
                granted: 40
            }
        );
    }

    #[test]
    fn the_sliding_minute_forgets() {
        let mut top = WindowedTopK::new(8);
        for _ in 0..100 {
            top.record(0, 7, 0, 1, 1);
        }
        for _ in 0..10 {
            top.record(30, 8, 0, 1, 1);
        }
        assert_eq!(top.top(30, 10)[0].key, 7);
        assert_eq!(top.top(59, 10)[0].tally.calls, 100);
        // Second 60: the bucket of seconds 0-9 is out of the window.
        let later = top.top(60, 10);
        assert_eq!(later.len(), 1);
        assert_eq!((later[0].key, later[0].tally.calls), (8, 10));
        assert!(top.top(90, 10).is_empty());
    }

    #[test]
    fn a_key_missing_from_a_full_bucket_carries_that_bucket_s_bound() {
        let mut top = WindowedTopK::new(2);
        // Bucket 0: keys 1 and 2 fill the summary (5 calls each); key 3 is not counted there
        // until it replaces one.
        for _ in 0..5 {
            top.record(0, 1, 0, 1, 1);
            top.record(0, 2, 0, 1, 1);
        }
        // Bucket 1: key 3 alone.
        for _ in 0..20 {
            top.record(10, 3, 0, 1, 1);
        }
        let found = top.top(10, 3);
        assert_eq!(found[0].key, 3);
        // It may have had up to 5 calls in bucket 0, where it was not counted.
        assert_eq!(
            (found[0].tally.calls, found[0].over, found[0].missed),
            (20, 0, 5)
        );
        // Keys 1 and 2 were counted wherever the summary was full.
        assert_eq!((found[1].tally.calls, found[1].missed), (5, 0));
    }
}
