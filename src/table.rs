//! The local stage's bucket table: a fixed number of slots in proxy-wasm shared data, created
//! up front, so shared-data memory is bounded by configuration whatever the key cardinality.
//!
//! A bucket id hashes (keyed by a per-process salt, so clients cannot aim at each other's slots)
//! to a run of [`PROBES`] slots; the bucket lives in the first slot holding its id, else it takes
//! the first slot that is empty or whose bucket is full again (a full bucket is the same as no
//! bucket, so that eviction loses nothing). When every probe holds a live bucket the table is
//! full and the caller applies the policy's failure mode; another tenant's slot is never shared.
//!
//! Updates are compare-and-swap per slot with a bounded number of attempts. Several buckets
//! (several policies on one request) are charged all-or-nothing: all are read and decided first,
//! a denial writes nothing, and a lost race while writing refunds what was already written
//! before trying again.

use crate::shared::{SharedData, WriteError};
use sha2::{Digest, Sha256};
use tollgate_core::bucket::{try_take, BucketState, Decision, Limits};

/// Slots examined per bucket id.
pub const PROBES: u32 = 4;
/// Attempts at a CAS transaction before giving up with [`TableError::Contended`].
pub const MAX_ATTEMPTS: u32 = 8;

const TAG_EMPTY: u8 = 0;
const TAG_BUCKET: u8 = 1;

/// Why the table could not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableError {
    /// Every probe slot of a bucket holds another live bucket.
    Full,
    /// Other workers kept winning the CAS race.
    Contended,
    /// The host refused a shared-data call.
    Host,
}

/// One bucket to charge.
#[derive(Debug, Clone, Copy)]
pub struct Charge<'a> {
    pub bucket_id: &'a str,
    pub limits: &'a Limits,
    pub cost: u64,
}

/// What a bucket looks like after a charge (or a denial).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BucketView {
    pub allowed: bool,
    pub remaining: f64,
    /// Allowed: ms until the bucket is full again. Denied: ms until the cost would pass.
    pub reset_ms: u64,
}

/// Outcome of an all-or-nothing charge: one view per charge, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Charged {
    pub allowed: bool,
    pub views: Vec<BucketView>,
    /// Slots whose (full) bucket was replaced by a new one.
    pub evictions: u32,
}

#[derive(Debug, Clone, PartialEq)]
struct Record {
    id: String,
    state: BucketState,
    full_at_ms: u64,
}

fn encode(record: &Record) -> Vec<u8> {
    let id = record.id.as_bytes();
    let len = u16::try_from(id.len()).unwrap_or(u16::MAX);
    let id = id.get(..usize::from(len)).unwrap_or(id);
    let mut out = Vec::with_capacity(1 + 2 + id.len() + 24);
    out.push(TAG_BUCKET);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(id);
    out.extend_from_slice(&record.state.tokens.to_le_bytes());
    out.extend_from_slice(&record.state.updated_ms.to_le_bytes());
    out.extend_from_slice(&record.full_at_ms.to_le_bytes());
    out
}

/// `None` for an empty slot, or bytes that are not a record of this version (treated as empty).
fn decode(bytes: &[u8]) -> Option<Record> {
    let (&tag, rest) = bytes.split_first()?;
    if tag != TAG_BUCKET {
        return None;
    }
    let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
    let rest = rest.get(2..)?;
    let id = std::str::from_utf8(rest.get(..len)?).ok()?.to_string();
    let nums = rest.get(len..)?;
    if nums.len() != 24 {
        return None;
    }
    let tokens = f64::from_le_bytes(nums.get(0..8)?.try_into().ok()?);
    let updated_ms = u64::from_le_bytes(nums.get(8..16)?.try_into().ok()?);
    let full_at_ms = u64::from_le_bytes(nums.get(16..24)?.try_into().ok()?);
    Some(Record {
        id,
        state: BucketState { tokens, updated_ms },
        full_at_ms,
    })
}

/// A slot chosen for one charge within a transaction.
#[derive(Debug, Clone, Copy)]
struct Choice {
    slot: u32,
    cas: u32,
    state: Option<BucketState>,
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

    fn slot_key(&self, slot: u32) -> String {
        format!("{}slot/{slot}", self.prefix)
    }

    fn home(&self, bucket_id: &str) -> u32 {
        let mut hasher = Sha256::new();
        hasher.update(&self.salt);
        hasher.update(bucket_id.as_bytes());
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
        charge: &Charge<'_>,
        taken: &[Choice],
        now_ms: u64,
    ) -> Result<Choice, TableError> {
        let home = self.home(charge.bucket_id);
        let mut candidate: Option<Choice> = None;
        for probe in 0..PROBES.min(self.slots) {
            let slot = (home + probe) % self.slots;
            if taken.iter().any(|c| c.slot == slot) {
                continue;
            }
            let (record, cas) = self.read(store, slot)?;
            match record {
                Some(record) if record.id == charge.bucket_id => {
                    return Ok(Choice {
                        slot,
                        cas,
                        state: Some(record.state),
                        evicts: false,
                    });
                }
                Some(record) if record.full_at_ms > now_ms => {}
                other => {
                    if candidate.is_none() {
                        candidate = Some(Choice {
                            slot,
                            cas,
                            state: None,
                            evicts: other.is_some(),
                        });
                    }
                }
            }
        }
        candidate.ok_or(TableError::Full)
    }

    /// Charges every bucket its cost, or none of them.
    pub fn charge(
        &self,
        store: &impl SharedData,
        charges: &[Charge<'_>],
        now_ms: u64,
    ) -> Result<Charged, TableError> {
        for _ in 0..MAX_ATTEMPTS {
            let mut choices: Vec<Choice> = Vec::with_capacity(charges.len());
            for charge in charges {
                let choice = self.choose(store, charge, &choices, now_ms)?;
                choices.push(choice);
            }
            let decided: Vec<(BucketState, Decision)> = charges
                .iter()
                .zip(&choices)
                .map(|(charge, choice)| try_take(charge.limits, choice.state, now_ms, charge.cost))
                .collect();
            let allowed = decided.iter().all(|(_, d)| d.is_allowed());
            let views = charges
                .iter()
                .zip(&decided)
                .map(|(charge, (state, decision))| view(charge.limits, state, decision, now_ms))
                .collect();
            if !allowed {
                return Ok(Charged {
                    allowed: false,
                    views,
                    evictions: 0,
                });
            }
            match self.write_all(store, charges, &choices, &decided, now_ms) {
                Ok(()) => {
                    return Ok(Charged {
                        allowed: true,
                        views,
                        evictions: choices.iter().filter(|c| c.evicts).count() as u32,
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
        charges: &[Charge<'_>],
        choices: &[Choice],
        decided: &[(BucketState, Decision)],
        now_ms: u64,
    ) -> Result<(), WriteError> {
        for (written, ((charge, choice), (state, _))) in
            charges.iter().zip(choices).zip(decided).enumerate()
        {
            let record = Record {
                id: charge.bucket_id.to_string(),
                state: *state,
                full_at_ms: state.full_at_ms(charge.limits),
            };
            if let Err(error) = store.set(
                &self.slot_key(choice.slot),
                &encode(&record),
                Some(choice.cas),
            ) {
                for (undo, choice) in charges.iter().zip(choices).take(written) {
                    self.refund(store, undo, choice.slot, now_ms);
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Gives a charge back (after a partial write lost a race). Best effort within the attempt
    /// bound: a bucket that moved on keeps its state.
    fn refund(&self, store: &impl SharedData, charge: &Charge<'_>, slot: u32, now_ms: u64) {
        for _ in 0..MAX_ATTEMPTS {
            let Ok((Some(record), cas)) = self.read(store, slot) else {
                return;
            };
            if record.id != charge.bucket_id {
                return;
            }
            let state = tollgate_core::bucket::give_back(
                charge.limits,
                Some(record.state),
                now_ms,
                charge.cost,
            );
            let record = Record {
                full_at_ms: state.full_at_ms(charge.limits),
                state,
                ..record
            };
            match store.set(&self.slot_key(slot), &encode(&record), Some(cas)) {
                Err(WriteError::CasMismatch) => continue,
                _ => return,
            }
        }
    }
}

fn view(limits: &Limits, state: &BucketState, decision: &Decision, now_ms: u64) -> BucketView {
    match decision {
        Decision::Allowed { remaining } => BucketView {
            allowed: true,
            remaining: *remaining,
            reset_ms: state.full_at_ms(limits).saturating_sub(now_ms),
        },
        Decision::Denied {
            retry_after_ms,
            remaining,
        } => BucketView {
            allowed: false,
            remaining: *remaining,
            reset_ms: *retry_after_ms,
        },
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
