//! proxy-wasm's shared data in process memory, for the engine's few shared keys (the table's
//! salt, worker counters): what proxy-wasm shared data is to the wasm build, with the same
//! semantics (see `tollgate_engine::shared`): a read returns the value and its CAS stamp (never 0), a
//! write with a stamp to a present key fails unless the stamps match, a write to a missing key
//! succeeds. Every worker thread of the Envoy process sees one map. The table's records are not
//! here: the native build keeps them typed (`tollgate_engine::table::Cells`).
//!
//! The map holds only keys the engine names itself, never one per client key: its memory is
//! bounded by configuration. Keys are spread over [`SHARDS`] mutexes so that workers touching
//! different keys do not wait for each other.
//! A key is hashed once per call (foldhash, seeded per process: the keys are the engine's own
//! names, which no client chooses, so a fast hash is enough): one part of the
//! hash picks the shard, and the shard's map is keyed by the hash itself, each hash holding
//! the keys that have it (almost always one), compared in full.

use crate::config::lock;
use foldhash::quality::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use tollgate_engine::shared::{ReadError, SharedData, WriteError};

/// Mutexes the keys are spread over.
pub const SHARDS: usize = 64;

/// A key, its value and its stamp.
struct Entry {
    key: String,
    value: Vec<u8>,
    stamp: u32,
}

/// The entries of a shard by their keys' hash.
type Shard = Mutex<HashMap<u64, Vec<Entry>, BuildHasherDefault<Prehashed>>>;

/// The hasher of a map keyed by a hash already taken: the word is its own hash.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed (`write_u64`); any other input is still mixed in.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = word;
    }
}

pub struct ProcessSharedData {
    shards: Vec<Shard>,
    hasher: RandomState,
    next_stamp: AtomicU32,
}

impl Default for ProcessSharedData {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::default(),
            next_stamp: AtomicU32::new(0),
        }
    }
}

impl ProcessSharedData {
    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard of a hash: from its upper half (the shard's map places a hash by its low
    /// bits and tags it with its top bits, so neither is the same within a shard).
    fn shard(&self, hash: u64) -> Option<&Shard> {
        self.shards.get((hash >> 32) as usize % SHARDS)
    }

    fn get_hashed(
        &self,
        key: &str,
        hash: u64,
    ) -> Result<(Option<Vec<u8>>, Option<u32>), ReadError> {
        let map = lock(self.shard(hash).ok_or(ReadError)?);
        Ok(
            match map
                .get(&hash)
                .and_then(|entries| entries.iter().find(|e| e.key == key))
            {
                Some(entry) => (Some(entry.value.clone()), Some(entry.stamp)),
                None => (None, None),
            },
        )
    }

    fn set_hashed(
        &self,
        key: &str,
        hash: u64,
        value: &[u8],
        cas: Option<u32>,
    ) -> Result<(), WriteError> {
        let shard = self.shard(hash).ok_or(WriteError::Host)?;
        let stamp = self.stamp();
        let mut map = lock(shard);
        let entries = map.entry(hash).or_default();
        match entries.iter_mut().find(|e| e.key == key) {
            Some(entry) => {
                if let Some(cas) = cas.filter(|c| *c != 0) {
                    if cas != entry.stamp {
                        return Err(WriteError::CasMismatch);
                    }
                }
                entry.value.clear();
                entry.value.extend_from_slice(value);
                entry.stamp = stamp;
            }
            None => entries.push(Entry {
                key: key.to_string(),
                value: value.to_vec(),
                stamp,
            }),
        }
        Ok(())
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
        self.shards
            .iter()
            .map(|s| lock(s).values().map(Vec::len).sum::<usize>())
            .sum()
    }
}

impl SharedData for ProcessSharedData {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), ReadError> {
        self.get_hashed(key, self.hash(key))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), WriteError> {
        self.set_hashed(key, self.hash(key), value, cas)
    }

    fn get_into(&self, key: &str, value: &mut Vec<u8>) -> Result<Option<u32>, ReadError> {
        let hash = self.hash(key);
        let map = lock(self.shard(hash).ok_or(ReadError)?);
        value.clear();
        Ok(map
            .get(&hash)
            .and_then(|entries| entries.iter().find(|e| e.key == key))
            .map(|entry| {
                value.extend_from_slice(&entry.value);
                entry.stamp
            }))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tollgate_engine::shared::MemorySharedData;

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
    fn keys_of_one_hash_keep_their_own_values_and_stamps() {
        let store = ProcessSharedData::default();
        let hash = 42;
        store.set_hashed("a", hash, b"1", None).unwrap();
        store.set_hashed("b", hash, b"2", None).unwrap();
        let (a, stamp_a) = store.get_hashed("a", hash).unwrap();
        let (b, stamp_b) = store.get_hashed("b", hash).unwrap();
        assert_eq!(
            (a.as_deref(), b.as_deref()),
            (Some(&b"1"[..]), Some(&b"2"[..]))
        );
        assert_ne!(stamp_a, stamp_b);
        // A's stamp does not write b, b's does.
        assert_eq!(
            store.set_hashed("b", hash, b"3", stamp_a),
            Err(WriteError::CasMismatch)
        );
        store.set_hashed("b", hash, b"3", stamp_b).unwrap();
        assert_eq!(
            store.get_hashed("a", hash).unwrap().0.as_deref(),
            Some(&b"1"[..])
        );
        assert_eq!(
            store.get_hashed("b", hash).unwrap().0.as_deref(),
            Some(&b"3"[..])
        );
        assert_eq!(store.get_hashed("c", hash).unwrap(), (None, None));
        let mut kept = b"leftover".to_vec();
        assert_eq!(store.get_into("missing", &mut kept).unwrap(), None);
        assert!(kept.is_empty());
        assert_eq!(store.len(), 2);
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
            // A read into a kept buffer gives the same value and stamp.
            let mut kept = b"leftover".to_vec();
            let (value, stamp) = ours.get(key).unwrap();
            assert_eq!(ours.get_into(key, &mut kept).unwrap(), stamp);
            assert_eq!(Some(kept), value);
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
