//! The per-instance table's storage in process memory: what proxy-wasm shared data is to the
//! wasm build, with the same semantics (see `tollgate::shared`): a read returns the value and
//! its CAS stamp (never 0), a write with a stamp to a present key fails unless the stamps match,
//! a write to a missing key succeeds. Every worker thread of the Envoy process sees one map.
//!
//! The map holds only the keys the slot table creates up front (its groups, a worker counter):
//! its memory is bounded by configuration, as in the wasm build. Keys are spread over
//! [`SHARDS`] mutexes so that workers touching different groups do not wait for each other.

use crate::config::lock;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use tollgate::shared::{ReadError, SharedData, WriteError};

/// Mutexes the keys are spread over.
pub const SHARDS: usize = 64;

type Shard = Mutex<HashMap<String, (Vec<u8>, u32)>>;

pub struct ProcessSharedData {
    shards: Vec<Shard>,
    hasher: RandomState,
    next_stamp: AtomicU32,
}

impl Default for ProcessSharedData {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            next_stamp: AtomicU32::new(0),
        }
    }
}

impl ProcessSharedData {
    fn shard(&self, key: &str) -> Option<&Shard> {
        let index = self.hasher.hash_one(key) as usize % SHARDS;
        self.shards.get(index)
    }

    /// A fresh, non-zero stamp.
    fn stamp(&self) -> u32 {
        loop {
            let stamp = self
                .next_stamp
                .fetch_add(1, Ordering::Relaxed)
                .wrapping_add(1);
            if stamp != 0 {
                return stamp;
            }
        }
    }

    /// Keys held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }
}

impl SharedData for ProcessSharedData {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), ReadError> {
        let shard = self.shard(key).ok_or(ReadError)?;
        let map = lock(shard);
        Ok(match map.get(key) {
            Some((value, stamp)) => (Some(value.clone()), Some(*stamp)),
            None => (None, None),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), WriteError> {
        let shard = self.shard(key).ok_or(WriteError::Host)?;
        let stamp = self.stamp();
        let mut map = lock(shard);
        match map.get_mut(key) {
            Some(entry) => {
                if let Some(cas) = cas.filter(|c| *c != 0) {
                    if cas != entry.1 {
                        return Err(WriteError::CasMismatch);
                    }
                }
                entry.0.clear();
                entry.0.extend_from_slice(value);
                entry.1 = stamp;
            }
            None => {
                map.insert(key.to_string(), (value.to_vec(), stamp));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tollgate::shared::MemorySharedData;

    #[test]
    fn semantics_match_envoy_shared_data() {
        let store = ProcessSharedData::default();
        assert_eq!(store.get("k").unwrap(), (None, None));
        // A missing key is written whatever stamp is passed.
        store.set("k", b"a", Some(12345)).unwrap();
        let (value, stamp) = store.get("k").unwrap();
        assert_eq!(value.as_deref(), Some(&b"a"[..]));
        let stamp = stamp.unwrap();
        assert_ne!(stamp, 0);
        // A stale stamp loses; the right one wins and changes the stamp.
        assert_eq!(
            store.set("k", b"b", Some(stamp.wrapping_add(1))),
            Err(WriteError::CasMismatch)
        );
        store.set("k", b"b", Some(stamp)).unwrap();
        assert_eq!(
            store.set("k", b"c", Some(stamp)),
            Err(WriteError::CasMismatch)
        );
        // No stamp (or 0): unconditional.
        store.set("k", b"d", None).unwrap();
        store.set("k", b"e", Some(0)).unwrap();
        assert_eq!(store.get("k").unwrap().0.as_deref(), Some(&b"e"[..]));
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn same_answers_as_the_reference_on_one_thread() {
        let ours = ProcessSharedData::default();
        let reference = MemorySharedData::default();
        let keys = ["a", "b", "c"];
        let mut stamps_ours = std::collections::HashMap::new();
        let mut stamps_ref = std::collections::HashMap::new();
        for round in 0..300usize {
            let key = keys[round % 3];
            let value = round.to_le_bytes();
            // Alternate between the stamp just read, a stale stamp and none.
            let (_, s1) = ours.get(key).unwrap();
            let (_, s2) = reference.get(key).unwrap();
            let (c1, c2) = match round % 3 {
                0 => (s1, s2),
                1 => (
                    stamps_ours.get(key).copied().flatten(),
                    stamps_ref.get(key).copied().flatten(),
                ),
                _ => (None, None),
            };
            assert_eq!(
                ours.set(key, &value, c1).is_ok(),
                reference.set(key, &value, c2).is_ok(),
                "round {round}"
            );
            stamps_ours.insert(key, s1);
            stamps_ref.insert(key, s2);
            assert_eq!(ours.get(key).unwrap().0, reference.get(key).unwrap().0);
        }
    }

    #[test]
    fn concurrent_cas_increments_lose_nothing() {
        let store = Arc::new(ProcessSharedData::default());
        // Created first: two writers of a missing key would both succeed (Envoy's semantics).
        store.set("counter", &0u64.to_le_bytes(), None).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut done = 0;
                    while done < 2_000 {
                        let (value, stamp) = store.get("counter").unwrap();
                        let n = u64::from_le_bytes(value.unwrap().try_into().unwrap());
                        if store.set("counter", &(n + 1).to_le_bytes(), stamp).is_ok() {
                            done += 1;
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (value, _) = store.get("counter").unwrap();
        assert_eq!(
            u64::from_le_bytes(value.unwrap().try_into().unwrap()),
            8_000
        );
    }
}
