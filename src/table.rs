//! The local stage's bucket table: a fixed number of slots in proxy-wasm shared data, created
//! up front, so shared-data memory is bounded by configuration whatever the key cardinality.
//!
//! A bucket id hashes (keyed by a per-process salt, so clients cannot aim at each other's slots)
//! to a run of [`PROBES`] slots; the bucket lives in the first slot holding its id, else it takes
//! the first slot that is empty or whose bucket is full again (a full bucket is the same as no
//! bucket, so that eviction loses nothing). When every probe holds a live bucket the table is
//! full and the caller applies the policy's failure mode; another tenant's slot is never shared.
//!
//! Updates are compare-and-swap per slot with a bounded number of attempts. Several records
//! (several policies on one request) change all-or-nothing in one [`SlotTable::transact`]: all
//! are read and decided first, an aborted decision writes nothing, and a lost race while writing
//! refunds what was already written before trying again.
//!
//! A slot holds one [`Record`]: the local token bucket of a (policy, key) and, for global
//! policies, this instance's lease of the global budget with its bookkeeping.

use crate::shared::{SharedData, WriteError};
use sha2::{Digest, Sha256};
use tollgate_core::bucket::BucketState;

/// Slots examined per bucket id.
pub const PROBES: u32 = 4;
/// Attempts at a CAS transaction before giving up with [`TableError::Contended`].
pub const MAX_ATTEMPTS: u32 = 8;

const TAG_EMPTY: u8 = 0;
/// Version tag of the record encoding; other tags read as empty.
const TAG_RECORD: u8 = 2;

/// Why the table could not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableError {
    /// Every probe slot of a key holds another live record.
    Full,
    /// Other workers kept winning the CAS race.
    Contended,
    /// The host refused a shared-data call.
    Host,
}

/// This instance's share of a global bucket, and what it knows about the limiter.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Lease {
    /// Leased tokens not yet spent.
    pub tokens: u64,
    /// After this, unspent tokens are no longer spent (they are returned or count as expired).
    pub expires_ms: u64,
    /// Sequence number of the latest lease of this key (its id is built from it).
    pub seq: u64,
    /// What the latest lease granted: a return never gives back more.
    pub granted: u64,
    /// A background refill is in flight on this instance until this time.
    pub pending_until_ms: u64,
    /// The limiter said "over limit" until this time: deny without asking again.
    pub denied_until_ms: u64,
    /// Start of the current limiter outage for this key (0: none).
    pub unavailable_since_ms: u64,
    /// Until this time requests do not wait for a callout but take the failure mode.
    pub unavailable_until_ms: u64,
    /// Demand estimate: units spent since `window_start_ms`, and the smoothed rate.
    pub window_start_ms: u64,
    pub window_units: u64,
    pub rate_per_s: f64,
}

/// The state of one (policy, key) on this Envoy instance.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub id: String,
    /// Local token bucket; `None` means full (never used, or refilled).
    pub bucket: Option<BucketState>,
    pub lease: Lease,
    /// From this time the record equals a fresh one, so its slot may go to another key.
    pub evictable_at_ms: u64,
}

impl Record {
    pub fn fresh(id: &str) -> Self {
        Self {
            id: id.to_string(),
            bucket: None,
            lease: Lease::default(),
            evictable_at_ms: 0,
        }
    }
}

const LEASE_FIELDS: usize = 11;
const FIXED_BYTES: usize = 1 + 16 + LEASE_FIELDS * 8 + 8;

fn encode(record: &Record) -> Vec<u8> {
    let id = record.id.as_bytes();
    let len = u16::try_from(id.len()).unwrap_or(u16::MAX);
    let id = id.get(..usize::from(len)).unwrap_or(id);
    let mut out = Vec::with_capacity(1 + 2 + id.len() + FIXED_BYTES);
    out.push(TAG_RECORD);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(id);
    let (present, bucket) = match record.bucket {
        Some(b) => (1u8, b),
        None => (
            0u8,
            BucketState {
                tokens: 0.0,
                updated_ms: 0,
            },
        ),
    };
    out.push(present);
    out.extend_from_slice(&bucket.tokens.to_le_bytes());
    out.extend_from_slice(&bucket.updated_ms.to_le_bytes());
    let l = &record.lease;
    for value in [
        l.tokens,
        l.expires_ms,
        l.seq,
        l.granted,
        l.pending_until_ms,
        l.denied_until_ms,
        l.unavailable_since_ms,
        l.unavailable_until_ms,
        l.window_start_ms,
        l.window_units,
    ] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    out.extend_from_slice(&l.rate_per_s.to_le_bytes());
    out.extend_from_slice(&record.evictable_at_ms.to_le_bytes());
    out
}

/// `None` for an empty slot, or bytes that are not a record of this version (treated as empty).
fn decode(bytes: &[u8]) -> Option<Record> {
    let (&tag, rest) = bytes.split_first()?;
    if tag != TAG_RECORD {
        return None;
    }
    let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
    let rest = rest.get(2..)?;
    let id = std::str::from_utf8(rest.get(..len)?).ok()?.to_string();
    let fixed = rest.get(len..)?;
    if fixed.len() != FIXED_BYTES {
        return None;
    }
    let (&present, fixed) = fixed.split_first()?;
    let word = |i: usize| -> Option<[u8; 8]> { fixed.get(i * 8..i * 8 + 8)?.try_into().ok() };
    let u = |i: usize| word(i).map(u64::from_le_bytes);
    let bucket = BucketState {
        tokens: f64::from_le_bytes(word(0)?),
        updated_ms: u(1)?,
    };
    let lease = Lease {
        tokens: u(2)?,
        expires_ms: u(3)?,
        seq: u(4)?,
        granted: u(5)?,
        pending_until_ms: u(6)?,
        denied_until_ms: u(7)?,
        unavailable_since_ms: u(8)?,
        unavailable_until_ms: u(9)?,
        window_start_ms: u(10)?,
        window_units: u(11)?,
        rate_per_s: f64::from_le_bytes(word(12)?),
    };
    Some(Record {
        id,
        bucket: (present == 1).then_some(bucket),
        lease,
        evictable_at_ms: u(13)?,
    })
}

/// What a transaction's decision does with the records it was shown.
#[derive(Debug, Clone, PartialEq)]
pub enum Txn<T> {
    /// Write every record that changed.
    Commit(T),
    /// Write nothing.
    Abort(T),
}

/// Result of a transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Transacted<T> {
    pub value: T,
    pub committed: bool,
    /// Slots whose (idle) record was replaced by a new key's.
    pub evictions: u32,
}

/// A slot chosen for one key within a transaction.
#[derive(Debug, Clone)]
struct Choice {
    slot: u32,
    cas: u32,
    record: Record,
    evicts: bool,
}

/// The table, as configured. Cheap to clone; holds no shared-data state itself.
#[derive(Debug, Clone)]
pub struct SlotTable {
    prefix: String,
    slots: u32,
    salt: Vec<u8>,
}

impl SlotTable {
    /// Opens the table under `prefix`, creating the salt and every slot that does not exist yet.
    /// Creation never overwrites: it writes with a CAS stamp no live key carries at start-up, so
    /// a slot another worker created (and maybe used) in the meantime is left alone.
    pub fn open(
        store: &impl SharedData,
        prefix: &str,
        slots: u32,
        seed: u64,
    ) -> Result<Self, TableError> {
        let salt_key = format!("{prefix}salt");
        create_if_absent(store, &salt_key, &seed.to_le_bytes())?;
        let salt = match store.get(&salt_key) {
            Ok((Some(salt), _)) => salt,
            _ => return Err(TableError::Host),
        };
        let table = Self {
            prefix: prefix.to_string(),
            slots: slots.max(1),
            salt,
        };
        for slot in 0..table.slots {
            create_if_absent(store, &table.slot_key(slot), &[TAG_EMPTY])?;
        }
        Ok(table)
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The per-process salt (also a source of uniqueness for ids this instance makes).
    pub fn salt(&self) -> &[u8] {
        &self.salt
    }

    fn slot_key(&self, slot: u32) -> String {
        format!("{}slot/{slot}", self.prefix)
    }

    fn home(&self, id: &str) -> u32 {
        let mut hasher = Sha256::new();
        hasher.update(&self.salt);
        hasher.update(id.as_bytes());
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        for (dst, src) in first.iter_mut().zip(digest.iter()) {
            *dst = *src;
        }
        (u64::from_le_bytes(first) % u64::from(self.slots)) as u32
    }

    fn read(
        &self,
        store: &impl SharedData,
        slot: u32,
    ) -> Result<(Option<Record>, u32), TableError> {
        let key = self.slot_key(slot);
        let (value, cas) = store.get(&key).map_err(|_| TableError::Host)?;
        match (value, cas) {
            (Some(bytes), Some(cas)) => Ok((decode(&bytes), cas)),
            // A present key with an empty value (what a shared-data "remove" leaves): empty slot.
            (None, Some(cas)) => Ok((None, cas)),
            (_, None) => {
                // Created at open; only a host that lost it gets here. Recreate, then re-read.
                create_if_absent(store, &key, &[TAG_EMPTY])?;
                match store.get(&key).map_err(|_| TableError::Host)? {
                    (Some(bytes), Some(cas)) => Ok((decode(&bytes), cas)),
                    (None, Some(cas)) => Ok((None, cas)),
                    _ => Err(TableError::Host),
                }
            }
        }
    }

    fn choose(
        &self,
        store: &impl SharedData,
        id: &str,
        taken: &[Choice],
        now_ms: u64,
    ) -> Result<Choice, TableError> {
        let home = self.home(id);
        let mut candidate: Option<Choice> = None;
        for probe in 0..PROBES.min(self.slots) {
            let slot = (home + probe) % self.slots;
            if taken.iter().any(|c| c.slot == slot) {
                continue;
            }
            let (record, cas) = self.read(store, slot)?;
            match record {
                Some(record) if record.id == id => {
                    return Ok(Choice {
                        slot,
                        cas,
                        record,
                        evicts: false,
                    });
                }
                Some(record) if record.evictable_at_ms > now_ms => {}
                other => {
                    if candidate.is_none() {
                        candidate = Some(Choice {
                            slot,
                            cas,
                            record: Record::fresh(id),
                            evicts: other.is_some(),
                        });
                    }
                }
            }
        }
        candidate.ok_or(TableError::Full)
    }

    /// Reads the records of `ids` (fresh ones for keys without a slot), lets `decide` change
    /// them, and writes the changed ones all-or-nothing. `decide` may run more than once (after
    /// a lost race), always on fresh reads. `refund(i, before, after, current)` undoes item
    /// `i`'s change on its current value when a later write lost a race.
    pub fn transact<T>(
        &self,
        store: &impl SharedData,
        ids: &[&str],
        now_ms: u64,
        mut decide: impl FnMut(&mut [Record]) -> Txn<T>,
        refund: impl Fn(usize, &Record, &Record, &mut Record),
    ) -> Result<Transacted<T>, TableError> {
        for _ in 0..MAX_ATTEMPTS {
            let mut choices: Vec<Choice> = Vec::with_capacity(ids.len());
            for id in ids {
                let choice = self.choose(store, id, &choices, now_ms)?;
                choices.push(choice);
            }
            let mut records: Vec<Record> = choices.iter().map(|c| c.record.clone()).collect();
            let value = match decide(&mut records) {
                Txn::Abort(value) => {
                    return Ok(Transacted {
                        value,
                        committed: false,
                        evictions: 0,
                    })
                }
                Txn::Commit(value) => value,
            };
            match self.write_all(store, &choices, &records, &refund) {
                Ok(evictions) => {
                    return Ok(Transacted {
                        value,
                        committed: true,
                        evictions,
                    })
                }
                Err(WriteError::CasMismatch) => continue,
                Err(WriteError::Host) => return Err(TableError::Host),
            }
        }
        Err(TableError::Contended)
    }

    fn write_all(
        &self,
        store: &impl SharedData,
        choices: &[Choice],
        records: &[Record],
        refund: &impl Fn(usize, &Record, &Record, &mut Record),
    ) -> Result<u32, WriteError> {
        let mut evictions = 0;
        let mut written: Vec<usize> = Vec::new();
        for (index, (choice, record)) in choices.iter().zip(records).enumerate() {
            if *record == choice.record {
                continue;
            }
            if let Err(error) = store.set(
                &self.slot_key(choice.slot),
                &encode(record),
                Some(choice.cas),
            ) {
                for &undo in &written {
                    if let (Some(choice), Some(after)) = (choices.get(undo), records.get(undo)) {
                        self.refund_one(store, choice, after, |current| {
                            refund(undo, &choice.record, after, current)
                        });
                    }
                }
                return Err(error);
            }
            written.push(index);
            if choice.evicts {
                evictions += 1;
            }
        }
        Ok(evictions)
    }

    /// Applies `undo` to the slot's current record (if it still holds the same key), within the
    /// attempt bound: a record that moved on keeps its state.
    fn refund_one(
        &self,
        store: &impl SharedData,
        choice: &Choice,
        after: &Record,
        undo: impl Fn(&mut Record),
    ) {
        for _ in 0..MAX_ATTEMPTS {
            let Ok((Some(mut current), cas)) = self.read(store, choice.slot) else {
                return;
            };
            if current.id != after.id {
                return;
            }
            undo(&mut current);
            match store.set(&self.slot_key(choice.slot), &encode(&current), Some(cas)) {
                Err(WriteError::CasMismatch) => continue,
                _ => return,
            }
        }
    }

    /// Changes one key's record (creating it fresh if it has none), e.g. to credit a lease
    /// from a callout response.
    pub fn update<T>(
        &self,
        store: &impl SharedData,
        id: &str,
        now_ms: u64,
        mut update: impl FnMut(&mut Record) -> T,
    ) -> Result<T, TableError> {
        let result = self.transact(
            store,
            &[id],
            now_ms,
            |records| match records.first_mut() {
                Some(record) => Txn::Commit(Some(update(record))),
                None => Txn::Abort(None),
            },
            |_, _, _, _| {},
        )?;
        result.value.ok_or(TableError::Host)
    }
}

/// Writes `value` only if `key` does not exist. Envoy accepts any CAS for a missing key and
/// rejects a mismatching one for a present key; `u32::MAX` is a stamp no key carries this early
/// (stamps count up from 1), so a concurrent creator's value is never overwritten.
fn create_if_absent(store: &impl SharedData, key: &str, value: &[u8]) -> Result<(), TableError> {
    match store.get(key) {
        Ok((Some(_), _)) => Ok(()),
        Ok((None, _)) => match store.set(key, value, Some(u32::MAX)) {
            Ok(()) | Err(WriteError::CasMismatch) => Ok(()),
            Err(WriteError::Host) => Err(TableError::Host),
        },
        Err(_) => Err(TableError::Host),
    }
}

#[cfg(test)]
mod tests;
