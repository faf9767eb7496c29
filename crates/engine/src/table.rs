//! The table of per-key state: a fixed number of slots in proxy-wasm shared data, created up
//! front, so shared-data memory is bounded by configuration whatever the key cardinality.
//!
//! **Layout.** Slots come in groups of [`GROUP_SLOTS`], one shared-data value (one CAS stamp)
//! per group. [`SlotTable::partitioned`] splits the groups into equal, disjoint regions, one per
//! policy (the engine passes its policy names); a record's id is `<policy>:<key>` and the record
//! lives only in its policy's region, so one policy's keys can never take, evict or fill the
//! slots of another policy, whatever their number. Ids of no region (every id, in a table
//! without regions) use the whole table.
//!
//! **Placement.** A key has [`PROBE_GROUPS`] distinct candidate groups in its region, chosen by a
//! hash keyed by a per-process salt (SipHash-1-3, [`hash`]: clients that do not know the salt
//! cannot aim at each other's slots; the tests `hostile_id_sets_cannot_concentrate_keys` and
//! `ids_aimed_with_a_guessed_salt_do_not_concentrate` bound any group's share), always probed
//! in the same order, and it lives in one slot of one of them. A lookup reads the candidates in
//! order and stops at the group holding the id; it compares ids in the group's bytes and
//! decodes only the record it finds, and a write re-encodes only the changed slots, copying
//! the other slots' bytes as read. A new key goes to the first candidate with at
//! least two free slots, else to the candidate with the most; a slot is free when it is empty or
//! its record is evictable (`evictable_at_ms` has passed: an idle record equals a fresh one, so
//! eviction loses nothing). In that group it takes an empty slot, else the one idle longest. A
//! live record is never evicted: when every slot of every candidate is live, the table is full
//! for that key and the caller applies the policy's failure mode. Choosing among four groups
//! instead of hashing to one keeps a region's groups evenly filled: with one group, a key was
//! refused as soon as four live keys shared its group (0.5 % of new keys at 17 % occupancy);
//! with four candidates, none in 10^6 at 50 % and 8 in 10^6 at 60 % (the test
//! `fallback_rate_by_occupancy` measures it). Preferring the first candidate while it has room
//! keeps most lookups at one read.
//!
//! **A key is never created twice.** An insert reads every candidate of the key and then
//! CAS-writes every candidate, each with the stamp it read (a candidate without change is
//! written back unchanged), the group receiving the key last; a mismatch anywhere sends the
//! transaction back to fresh reads, and before the last write nothing of the key is visible.
//! Suppose workers A and B both insert key K, A into group `a` and B into `b`. A CAS write
//! with the stamp read at time `r` succeeds only if nothing was written to the group since `r`.
//! If `a == b`, the second writer read after the first wrote, so it saw K and did not insert.
//! Else on `b`: A did not see K there, so B's write of `b` came after A's read, and A's write of
//! `b` then must precede B's read of `b`. Likewise on `a`, B's write of `a` precedes A's read of
//! `a`. Every worker finishes its reads before it writes, so B's write of `a` < A's read of `a`
//! < A's write of `b` < B's read of `b` < B's write of `a`: a contradiction. When one
//! transaction inserts several keys whose candidates overlap (several keys of one region; the
//! engine's transactions hold one key per policy), placement skips any group whose choice would
//! make a receiving group precede another candidate of a key it receives.
//!
//! **Transactions.** Several records (several policies on one request) change all-or-nothing
//! in one [`SlotTable::transact`]: all are read and decided first, an aborted decision writes
//! nothing, and a lost race while writing refunds what was already written before trying
//! again, within [`MAX_ATTEMPTS`].
//!
//! Changing `local_table.slots` or the number of policies (or a filter build whose placement
//! hash differs, as with the move from SHA-256 to SipHash) moves keys to other groups: their
//! local state starts fresh, and the records left behind are idle after one refill and evicted
//! like any other. A record is only ever found by its exact id, so a moved key never reads
//! another's state.
//!
//! A slot holds one [`Record`]: the local token bucket of a (policy, key) and, for global
//! policies, this instance's lease of the global budget with its bookkeeping.

// Typed records in process memory: only a host whose workers are threads (the native build);
// the .wasm does not carry it.
#[cfg(not(target_family = "wasm"))]
mod cells;
mod hash;

#[cfg(not(target_family = "wasm"))]
pub use cells::Cells;

use crate::shared::{SharedData, WriteError};
use std::collections::BTreeMap;
#[cfg(not(target_family = "wasm"))]
use std::sync::Arc;
use tollgate_core::bucket::BucketState;
use tollgate_core::in_flight::{Slots, EPOCHS};
use tollgate_core::window::{Counters, Log};

/// Slots per group: the slots under one CAS stamp.
pub const GROUP_SLOTS: usize = 4;
/// Candidate groups of a key (fewer in a region of fewer groups), each from a word of the
/// id's keyed hash ([`hash`]).
pub const PROBE_GROUPS: usize = 4;
/// Attempts at a CAS transaction before giving up with [`TableError::Contended`].
pub const MAX_ATTEMPTS: u32 = 8;
/// Version tag of the record encoding; other tags read as empty (8: the lease keeps the
/// previous lease's id, unspent tokens and expiry).
const TAG_RECORD: u8 = 8;
/// Version tag of a group of slots.
const TAG_GROUP: u8 = 3;

/// Why the table could not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableError {
    /// Every slot of every candidate group of a new key holds another live record.
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
    /// The lease before the latest, while tokens it granted may be unspent: its sequence
    /// number, its unspent tokens when the latest was credited (at most what it granted; part
    /// of `tokens`), and its expiry. Tokens are spent oldest first, so at expiry the latest
    /// lease keeps up to what it granted, the previous one up to `prev_tokens` of the rest,
    /// and each is returned under its own id (see `global::expire`).
    pub prev_seq: u64,
    pub prev_tokens: u64,
    pub prev_expires_ms: u64,
    /// A background refill is in flight on this instance until this time.
    pub pending_until_ms: u64,
    /// The limiter said "over limit" until this time: deny without asking again.
    pub denied_until_ms: u64,
    /// Start of the current limiter outage for this key (0: none).
    pub unavailable_since_ms: u64,
    /// Until this time requests do not wait for a callout but take the failure mode.
    pub unavailable_until_ms: u64,
    /// Demand estimate: units offered (admitted or denied) since `window_start_ms`, and the
    /// smoothed rate per second.
    pub window_start_ms: u64,
    pub window_units: u64,
    pub rate_per_s: f64,
    /// The assignment's share of the global refill rate (units per ms; kept after the drip
    /// stops, to tell a denied request when its turn comes).
    pub drip_per_ms: f64,
    /// The drip has been credited to `tokens` up to this time...
    pub drip_from_ms: u64,
    /// ...and runs until this time (stopped early when a renewal is asked for).
    pub drip_until_ms: u64,
    /// Fraction of a token dripped but not yet credited.
    pub drip_carry: f64,
    /// Requests are decided against the assignment (never waiting for a callout) until this
    /// time; covers a renewal in flight.
    pub assigned_until_ms: u64,
    /// From this time the next request asks to renew the assignment.
    pub renew_at_ms: u64,
    /// When the running assignment was received.
    pub assigned_at_ms: u64,
    /// The demand (units per second) the latest lease request reported: a demand that has
    /// since grown far beyond it renews the assignment early.
    pub asked_demand_per_s: f64,
    /// Units requests used beyond what they reserved, paid from the next tokens this instance
    /// receives; while it is not paid, the key's requests are refused.
    pub debt: u64,
}

/// The state of one (policy, key) on this Envoy instance.
#[derive(Debug, PartialEq)]
pub struct Record {
    pub id: String,
    /// Local token bucket; `None` means full (never used, or refilled).
    pub bucket: Option<BucketState>,
    pub lease: Lease,
    /// The key's requests in flight on this instance (`max_in_flight`).
    pub in_flight: Slots,
    /// Fixed window / sliding window counters (local windowed policies).
    pub counters: Option<Counters>,
    /// Sliding log (local `sliding_log` policies; at most `MAX_LOG_LIMIT` entries).
    pub log: Option<Log>,
    /// From this time the record equals a fresh one, so its slot may go to another key.
    pub evictable_at_ms: u64,
}

impl Clone for Record {
    fn clone(&self) -> Self {
        Self {
            id: self.id.clone(),
            bucket: self.bucket,
            lease: self.lease,
            in_flight: self.in_flight,
            counters: self.counters,
            log: self.log.clone(),
            evictable_at_ms: self.evictable_at_ms,
        }
    }

    /// Reuses the id's and the log's buffers (a transaction copies its records into a list
    /// kept per thread).
    fn clone_from(&mut self, source: &Self) {
        // Every field by name: a field added to `Record` fails to compile here until it is
        // copied too.
        let Record {
            id,
            bucket,
            lease,
            in_flight,
            counters,
            log,
            evictable_at_ms,
        } = source;
        self.id.clone_from(id);
        self.bucket = *bucket;
        self.lease = *lease;
        self.in_flight = *in_flight;
        self.counters = *counters;
        self.log.clone_from(log);
        self.evictable_at_ms = *evictable_at_ms;
    }
}

impl Record {
    /// Becomes `Record::fresh(id)`, keeping the id's buffer.
    fn reset(&mut self, id: &str) {
        let mut fresh = Record::fresh("");
        std::mem::swap(&mut fresh.id, &mut self.id);
        fresh.id.clear();
        fresh.id.push_str(id);
        *self = fresh;
    }

    pub fn fresh(id: &str) -> Self {
        Self {
            id: id.to_string(),
            bucket: None,
            lease: Lease::default(),
            in_flight: Slots::default(),
            counters: None,
            log: None,
            evictable_at_ms: 0,
        }
    }
}

/// Words of a lease.
const LEASE_FIELDS: usize = 23;
/// Bytes of in-flight slots: the epoch and a count per epoch.
const SLOTS_BYTES: usize = 8 + 4 * EPOCHS;
/// After the id, at most: flags, the bucket (2 words), the lease, the slots, `evictable_at_ms`.
const FIXED_BYTES: usize = 1 + 16 + LEASE_FIELDS * 8 + SLOTS_BYTES + 8;
/// Flags: the record has a bucket / a lease other than the default / slots in flight. A local
/// policy's record has no lease, so it takes 1 + 16 + 8 bytes after its id instead of
/// `FIXED_BYTES`.
const HAS_BUCKET: u8 = 1;
const HAS_LEASE: u8 = 2;
const HAS_SLOTS: u8 = 4;
const HAS_COUNTERS: u8 = 8;
const HAS_LOG: u8 = 16;
/// Bytes of window counters.
const COUNTERS_BYTES: usize = 24;

#[cfg(test)]
fn encode(record: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 2 + record.id.len() + FIXED_BYTES);
    encode_into(record, &mut out);
    out
}

/// Appends the record's encoding to `out` (a group is written in one buffer).
fn encode_into(record: &Record, out: &mut Vec<u8>) {
    let id = record.id.as_bytes();
    let len = u16::try_from(id.len()).unwrap_or(u16::MAX);
    let id = id.get(..usize::from(len)).unwrap_or(id);
    out.reserve(1 + 2 + id.len() + FIXED_BYTES);
    out.push(TAG_RECORD);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(id);
    let l = &record.lease;
    let has_lease = *l != Lease::default();
    let mut flags = 0;
    if record.bucket.is_some() {
        flags |= HAS_BUCKET;
    }
    if has_lease {
        flags |= HAS_LEASE;
    }
    let has_slots = record.in_flight != Slots::default();
    if has_slots {
        flags |= HAS_SLOTS;
    }
    if record.counters.is_some() {
        flags |= HAS_COUNTERS;
    }
    if record.log.is_some() {
        flags |= HAS_LOG;
    }
    out.push(flags);
    if let Some(bucket) = record.bucket {
        out.extend_from_slice(&bucket.tokens.to_le_bytes());
        out.extend_from_slice(&bucket.updated_ms.to_le_bytes());
    }
    if has_lease {
        encode_lease(l, out);
    }
    if has_slots {
        out.extend_from_slice(&record.in_flight.epoch.to_le_bytes());
        for count in record.in_flight.counts {
            out.extend_from_slice(&count.to_le_bytes());
        }
    }
    if let Some(c) = record.counters {
        for value in [c.window, c.count, c.previous] {
            out.extend_from_slice(&value.to_le_bytes());
        }
    }
    if let Some(log) = &record.log {
        // At most MAX_LOG_LIMIT entries (the policy's limit bounds it).
        let len = u16::try_from(log.times.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&log.seen_ms.to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        for t in log.times.iter().take(usize::from(len)) {
            out.extend_from_slice(&t.to_le_bytes());
        }
    }
    out.extend_from_slice(&record.evictable_at_ms.to_le_bytes());
}

fn encode_lease(l: &Lease, out: &mut Vec<u8>) {
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
        l.drip_from_ms,
        l.drip_until_ms,
        l.assigned_until_ms,
        l.renew_at_ms,
        l.assigned_at_ms,
        l.prev_seq,
        l.prev_tokens,
        l.prev_expires_ms,
    ] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    for value in [
        l.rate_per_s,
        l.drip_per_ms,
        l.drip_carry,
        l.asked_demand_per_s,
    ] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    out.extend_from_slice(&l.debt.to_le_bytes());
}

/// `None` for an empty slot, or bytes that are not a record of this version (treated as empty).
fn decode(bytes: &[u8]) -> Option<Record> {
    let mut record = Record::fresh("");
    decode_into(bytes, None, &mut record)?;
    Some(record)
}

/// Decodes into `out`, reusing its id's buffer (a transaction's records are kept per thread).
/// `known_id`: the id the caller has already compared with the record's bytes, copied without
/// checking its UTF-8 again. On `None` (not a record of this version) `out` is left partly
/// written: the caller discards it.
fn decode_into(bytes: &[u8], known_id: Option<&str>, out: &mut Record) -> Option<()> {
    let (&tag, rest) = bytes.split_first()?;
    if tag != TAG_RECORD {
        return None;
    }
    let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
    let rest = rest.get(2..)?;
    let id_bytes = rest.get(..len)?;
    let id = match known_id {
        Some(known) if known.as_bytes() == id_bytes => known,
        _ => std::str::from_utf8(id_bytes).ok()?,
    };
    let (&flags, fixed) = rest.get(len..)?.split_first()?;
    let bucket_words = if flags & HAS_BUCKET != 0 { 2 } else { 0 };
    let lease_words = if flags & HAS_LEASE != 0 {
        LEASE_FIELDS
    } else {
        0
    };
    let slots_bytes = if flags & HAS_SLOTS != 0 {
        SLOTS_BYTES
    } else {
        0
    };
    let counters_bytes = if flags & HAS_COUNTERS != 0 {
        COUNTERS_BYTES
    } else {
        0
    };
    let head = (bucket_words + lease_words) * 8 + slots_bytes + counters_bytes;
    let log_bytes = if flags & HAS_LOG != 0 {
        let at = head + 8;
        let len = u16::from_le_bytes(fixed.get(at..at + 2)?.try_into().ok()?);
        10 + usize::from(len) * 8
    } else {
        0
    };
    if flags & !(HAS_BUCKET | HAS_LEASE | HAS_SLOTS | HAS_COUNTERS | HAS_LOG) != 0
        || fixed.len() != head + log_bytes + 8
    {
        return None;
    }
    let word = |i: usize| -> Option<[u8; 8]> { fixed.get(i * 8..i * 8 + 8)?.try_into().ok() };
    let u = |i: usize| word(i).map(u64::from_le_bytes);
    let bucket = if bucket_words > 0 {
        Some(BucketState {
            tokens: f64::from_le_bytes(word(0)?),
            updated_ms: u(1)?,
        })
    } else {
        None
    };
    let lease = if lease_words > 0 {
        decode_lease(fixed.get(bucket_words * 8..)?)?
    } else {
        Lease::default()
    };
    let slots_at = (bucket_words + lease_words) * 8;
    let in_flight = if slots_bytes > 0 {
        decode_slots(fixed.get(slots_at..slots_at + SLOTS_BYTES)?)?
    } else {
        Slots::default()
    };
    let counters_at = slots_at + slots_bytes;
    let counters = if counters_bytes > 0 {
        let word = |i: usize| -> Option<u64> {
            let at = counters_at + i * 8;
            Some(u64::from_le_bytes(fixed.get(at..at + 8)?.try_into().ok()?))
        };
        Some(Counters {
            window: word(0)?,
            count: word(1)?,
            previous: word(2)?,
        })
    } else {
        None
    };
    let log_at = counters_at + counters_bytes;
    let log = if log_bytes > 0 {
        let bytes = fixed.get(log_at..log_at + log_bytes)?;
        let seen_ms = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let times = bytes
            .get(10..)?
            .chunks_exact(8)
            .map(|c| <[u8; 8]>::try_from(c).map(u64::from_le_bytes))
            .collect::<Result<Vec<u64>, _>>()
            .ok()?;
        Some(Log { times, seen_ms })
    } else {
        None
    };
    let last = fixed.get(log_at + log_bytes..)?;
    let evictable_at_ms = u64::from_le_bytes(last.try_into().ok()?);
    // Every field by name: a field added to `Record` fails to compile here until it is decoded.
    let Record {
        id: out_id,
        bucket: out_bucket,
        lease: out_lease,
        in_flight: out_in_flight,
        counters: out_counters,
        log: out_log,
        evictable_at_ms: out_evictable_at_ms,
    } = out;
    out_id.clear();
    out_id.push_str(id);
    *out_bucket = bucket;
    *out_lease = lease;
    *out_in_flight = in_flight;
    *out_counters = counters;
    *out_log = log;
    *out_evictable_at_ms = evictable_at_ms;
    Some(())
}

fn decode_slots(bytes: &[u8]) -> Option<Slots> {
    let mut slots = Slots {
        epoch: u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?),
        counts: [0; EPOCHS],
    };
    for (i, count) in slots.counts.iter_mut().enumerate() {
        let at = 8 + i * 4;
        *count = u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?);
    }
    Some(slots)
}

/// A lease from its [`LEASE_FIELDS`] words at the start of `words`.
fn decode_lease(words: &[u8]) -> Option<Lease> {
    let word = |i: usize| -> Option<[u8; 8]> { words.get(i * 8..i * 8 + 8)?.try_into().ok() };
    let u = |i: usize| word(i).map(u64::from_le_bytes);
    Some(Lease {
        tokens: u(0)?,
        expires_ms: u(1)?,
        seq: u(2)?,
        granted: u(3)?,
        pending_until_ms: u(4)?,
        denied_until_ms: u(5)?,
        unavailable_since_ms: u(6)?,
        unavailable_until_ms: u(7)?,
        window_start_ms: u(8)?,
        window_units: u(9)?,
        drip_from_ms: u(10)?,
        drip_until_ms: u(11)?,
        assigned_until_ms: u(12)?,
        renew_at_ms: u(13)?,
        assigned_at_ms: u(14)?,
        prev_seq: u(15)?,
        prev_tokens: u(16)?,
        prev_expires_ms: u(17)?,
        rate_per_s: f64::from_le_bytes(word(18)?),
        drip_per_ms: f64::from_le_bytes(word(19)?),
        drip_carry: f64::from_le_bytes(word(20)?),
        asked_demand_per_s: f64::from_le_bytes(word(21)?),
        debt: u(22)?,
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

/// One group of slots as read, with its CAS stamp.
#[derive(Debug, Clone, Default)]
struct Group {
    index: u32,
    /// Its shared-data key.
    name: String,
    cas: u32,
    /// The value as read: what a confirming write puts back, and what a write changes only
    /// the slots of (the other slots' bytes are copied, never decoded).
    raw: Vec<u8>,
    /// Every slot decoded: only when a new key is placed in the group (a lookup decodes just
    /// the record it finds).
    slots: Option<Vec<Option<Record>>>,
    /// Receives a new key of this transaction: written after the groups without one, in the
    /// order of this rank.
    rank: Option<usize>,
    /// A candidate of a new key of this transaction.
    candidate: bool,
}

/// Where a transaction's key lives: group (index into the transaction's groups) and slot.
#[derive(Debug, Clone)]
struct Place {
    group: usize,
    slot: usize,
    evicts: bool,
    /// For a new key: all its candidate groups (indices into the transaction's groups), which
    /// its insert writes; empty for a key that has a record.
    candidates: Vec<usize>,
}

impl Group {
    /// The decoded slots (empty until [`Group::decode_slots`]).
    fn slots(&self) -> &[Option<Record>] {
        self.slots.as_deref().unwrap_or(&[])
    }

    fn decode_slots(&mut self) {
        if self.slots.is_none() {
            self.slots = Some(decode_group(&self.raw));
        }
    }

    /// The slot holding `id`'s record, with the record pushed onto `out`, decoding only that
    /// one (the first slot whose record has the id, as in the decoded slots).
    fn find_into(&self, id: &str, out: &mut RecordList) -> Option<usize> {
        slot_spans(&self.raw)
            .iter()
            .enumerate()
            .find_map(|(slot, span)| {
                let entry = self.raw.get(span.clone()?)?;
                if entry_id(entry)? != id.as_bytes() {
                    return None;
                }
                if out
                    .push()
                    .and_then(|record| decode_into(entry, Some(id), record))
                    .is_none()
                {
                    out.pop();
                    return None;
                }
                Some(slot)
            })
    }
}

/// A slot's entry: its length, then the record's bytes (a length of 0 for an empty slot, or
/// a record too long to encode).
fn push_entry(out: &mut Vec<u8>, record: Option<&Record>) {
    let at = out.len();
    out.extend_from_slice(&0u16.to_le_bytes());
    let Some(record) = record else {
        return;
    };
    encode_into(record, out);
    match u16::try_from(out.len() - at - 2) {
        Ok(len) => {
            if let Some(prefix) = out.get_mut(at..at + 2) {
                prefix.copy_from_slice(&len.to_le_bytes());
            }
        }
        Err(_) => out.truncate(at + 2),
    }
}

fn encode_group(slots: &[Option<Record>]) -> Vec<u8> {
    let mut out = vec![TAG_GROUP];
    for slot in slots {
        push_entry(&mut out, slot.as_ref());
    }
    out
}

/// The group `raw` with the slots `replace` gives a record for re-encoded, and every other
/// slot's entry copied as it was read (an unreadable group's other slots become empty, as
/// they read).
fn splice_group<'a>(out: &mut Vec<u8>, raw: &[u8], replace: impl Fn(usize) -> Option<&'a Record>) {
    let spans = slot_spans(raw);
    out.clear();
    out.reserve(raw.len() + 64);
    out.push(TAG_GROUP);
    for (slot, span) in spans.iter().enumerate() {
        match replace(slot) {
            Some(record) => push_entry(out, Some(record)),
            None => match span.clone().and_then(|span| raw.get(span)) {
                Some(entry) => {
                    let len = u16::try_from(entry.len()).unwrap_or(0);
                    out.extend_from_slice(&len.to_le_bytes());
                    if len > 0 {
                        out.extend_from_slice(entry);
                    }
                }
                None => out.extend_from_slice(&0u16.to_le_bytes()),
            },
        }
    }
}

/// Where each slot's record bytes are in a group's value, as [`decode_group`] reads them:
/// `None` for an empty slot, and for every slot from the first one that is cut short (or
/// all of them, in a value that is no group).
fn slot_spans(bytes: &[u8]) -> [Option<std::ops::Range<usize>>; GROUP_SLOTS] {
    let mut spans: [Option<std::ops::Range<usize>>; GROUP_SLOTS] = Default::default();
    if bytes.first() != Some(&TAG_GROUP) {
        return spans;
    }
    let mut at = 1;
    for span in spans.iter_mut() {
        let Some(len) = bytes
            .get(at..at + 2)
            .and_then(|l| <[u8; 2]>::try_from(l).ok())
        else {
            break;
        };
        let len = usize::from(u16::from_le_bytes(len));
        if bytes.get(at + 2..at + 2 + len).is_none() {
            break;
        }
        if len > 0 {
            *span = Some(at + 2..at + 2 + len);
        }
        at += 2 + len;
    }
    spans
}

/// The id of a record's bytes, without decoding the rest (`None`: not a record of this
/// version).
fn entry_id(entry: &[u8]) -> Option<&[u8]> {
    let (&tag, rest) = entry.split_first()?;
    if tag != TAG_RECORD {
        return None;
    }
    let len = usize::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?));
    rest.get(2..2 + len)
}

/// The slots of a group; anything unreadable reads as empty slots.
fn decode_group(bytes: &[u8]) -> Vec<Option<Record>> {
    let mut slots = vec![None; GROUP_SLOTS];
    let Some((&TAG_GROUP, mut rest)) = bytes.split_first() else {
        return slots;
    };
    for slot in slots.iter_mut() {
        let Some(len) = rest.get(..2).and_then(|l| <[u8; 2]>::try_from(l).ok()) else {
            break;
        };
        let len = usize::from(u16::from_le_bytes(len));
        let Some(entry) = rest.get(2..2 + len) else {
            break;
        };
        *slot = decode(entry);
        rest = rest.get(2 + len..).unwrap_or_default();
    }
    slots
}

/// The working lists of a transaction, kept per thread between transactions: a worker's
/// requests reuse their capacity instead of allocating them each time (bounded by the largest
/// transaction the thread has made: a few records).
#[derive(Default)]
struct Buffers {
    groups: GroupList,
    places: Vec<Place>,
    before: RecordList,
    records: RecordList,
    write: WriteScratch,
}

/// A list that keeps the items it drops (up to the most it held), so the next items written
/// into it reuse their buffers and are read in place instead of built and moved: the groups a
/// transaction read (their value's and name's buffers) and its records (their ids' buffers).
struct KeptList<T> {
    items: Vec<T>,
    len: usize,
}

/// The groups a transaction read.
type GroupList = KeptList<Group>;
/// The records of a transaction.
type RecordList = KeptList<Record>;

/// An item a [`KeptList`] adds when it keeps none to reuse.
trait Blank {
    fn blank() -> Self;
}

impl Blank for Group {
    fn blank() -> Self {
        Group::default()
    }
}

impl Blank for Record {
    fn blank() -> Self {
        Record::fresh("")
    }
}

impl<T> Default for KeptList<T> {
    fn default() -> Self {
        Self {
            items: Vec::new(),
            len: 0,
        }
    }
}

impl<T: Blank> KeptList<T> {
    fn clear(&mut self) {
        self.len = 0;
    }

    fn as_slice(&self) -> &[T] {
        self.items.get(..self.len).unwrap_or_default()
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        self.items.get_mut(..self.len).unwrap_or_default()
    }

    /// A new last item holding a dropped one's buffers and stale fields: the caller sets or
    /// reads into every field. (Always `Some`: an item is added when none is kept.)
    fn push(&mut self) -> Option<&mut T> {
        if self.len >= self.items.len() {
            self.items.push(T::blank());
        }
        let item = self.items.get_mut(self.len)?;
        self.len += 1;
        Some(item)
    }

    /// Drops the last item.
    fn pop(&mut self) {
        self.len = self.len.saturating_sub(1);
    }
}

impl RecordList {
    /// Becomes a copy of `source`, reusing its records' buffers.
    fn copy_from(&mut self, source: &[Record]) {
        self.len = 0;
        for record in source {
            if let Some(copy) = self.push() {
                copy.clone_from(record);
            }
        }
    }
}

/// What writing a transaction's groups works in: the groups in write order, which items
/// changed, the group value being written.
#[derive(Default)]
struct WriteScratch {
    order: Vec<usize>,
    changed: Vec<bool>,
    out: Vec<u8>,
}

thread_local! {
    static BUFFERS: std::cell::RefCell<Option<Box<Buffers>>> =
        const { std::cell::RefCell::new(None) };
}

impl Buffers {
    /// The thread's buffers (fresh ones on first use, or if a transaction of this thread holds
    /// them).
    fn take() -> Box<Self> {
        BUFFERS
            .try_with(|b| b.try_borrow_mut().ok().and_then(|mut b| b.take()))
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Empties the lists (dropping the records and groups they hold) and keeps their capacity
    /// for the thread's next transaction.
    fn give_back(mut self: Box<Self>) {
        self.groups.clear();
        self.places.clear();
        self.before.clear();
        // `records` keeps its records: the next transaction copies into their buffers. At
        // most as many as the thread's largest transaction had.
        // The value buffer keeps at most a group's worth of bytes.
        self.write.out.clear();
        let _ = BUFFERS.try_with(|b| {
            if let Ok(mut b) = b.try_borrow_mut() {
                *b = Some(self);
            }
        });
    }
}

/// A key's candidate groups (at most [`PROBE_GROUPS`]), without a heap allocation.
#[derive(Debug, Clone, Copy)]
struct Candidates {
    groups: [u32; PROBE_GROUPS],
    len: usize,
}

impl Candidates {
    fn as_slice(&self) -> &[u32] {
        self.groups.get(..self.len).unwrap_or(&[])
    }
}

/// A contiguous range of groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Region {
    start: u32,
    groups: u32,
}

/// The table, as configured. Cheap to clone; holds no shared-data state itself.
#[derive(Debug, Clone)]
pub struct SlotTable {
    prefix: String,
    /// Groups created by [`SlotTable::open`].
    groups: u32,
    salt: Vec<u8>,
    /// The placement hash's key, from the salt.
    hash_key: hash::Key,
    /// Region of each policy name; empty: the whole table is one region.
    regions: BTreeMap<String, Region>,
    /// Where the records live when not in the shared-data store: typed, in process memory
    /// (a host whose workers are threads of one process).
    #[cfg(not(target_family = "wasm"))]
    cells: Option<Arc<Cells>>,
}

/// A salt seed no client can work out: `mix` (the clock, an instance's own number) hashed with
/// the keys of std's `RandomState`, which come from the operating system's randomness (in the
/// wasm VM, WASI's `random_get`, which Envoy serves). The clock alone would leave only the
/// Envoy's start time to guess, and with the salt a client could aim its keys at one group.
pub fn unguessable_seed(mix: u64) -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(mix)
}

impl SlotTable {
    /// Opens the table under `prefix` with room for `slots` records (rounded up to whole
    /// groups), creating the salt and every group that does not exist yet. Creation never
    /// overwrites: it writes with a CAS stamp no live key carries at start-up, so a group another
    /// worker created (and maybe used) in the meantime is left alone.
    pub fn open(
        store: &impl SharedData,
        prefix: &str,
        slots: u32,
        seed: u64,
    ) -> Result<Self, TableError> {
        let table = Self::open_salted(store, prefix, slots, seed)?;
        let empty = encode_group(&vec![None; GROUP_SLOTS]);
        for group in 0..table.groups {
            create_if_absent(store, &table.group_key(group), &empty)?;
        }
        Ok(table)
    }

    /// The table's layout under `prefix` with the store's salt (created from `seed` if the
    /// store has none), creating no group: for a table whose records live in [`Cells`].
    pub fn open_salted(
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
        let per_group = GROUP_SLOTS as u32;
        Ok(Self {
            prefix: prefix.to_string(),
            groups: slots.max(1).div_ceil(per_group),
            hash_key: hash::Key::from_salt(&salt),
            salt,
            regions: BTreeMap::new(),
            #[cfg(not(target_family = "wasm"))]
            cells: None,
        })
    }

    /// The same table split into one region per distinct name (in order of first appearance),
    /// of equal size give or take a group: the records of ids `<name>:...` live only in the
    /// region of `name`. Every region has at least one group; only when there are more names
    /// than groups does that add groups (created on first use, one per extra name).
    pub fn partitioned<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        let mut distinct: Vec<&str> = Vec::new();
        for name in names {
            if !distinct.contains(&name) {
                distinct.push(name);
            }
        }
        self.regions.clear();
        let Ok(count) = u32::try_from(distinct.len()) else {
            return self;
        };
        if count == 0 {
            return self;
        }
        let base = (self.groups / count).max(1);
        let extra = if self.groups > count {
            self.groups % count
        } else {
            0
        };
        let mut start = 0;
        for (i, name) in (0u32..).zip(distinct) {
            let groups = base + u32::from(i < extra);
            self.regions
                .insert(name.to_string(), Region { start, groups });
            start += groups;
        }
        self
    }

    /// The same table with its records kept typed in `cells` (sized by
    /// [`SlotTable::groups_needed`]) instead of the shared-data store: see [`cells`]. The
    /// store still holds the salt. Cells with fewer groups than the table spans are refused.
    #[cfg(not(target_family = "wasm"))]
    pub fn in_cells(mut self, cells: Arc<Cells>) -> Result<Self, TableError> {
        if cells.groups() < self.groups_needed() {
            return Err(TableError::Host);
        }
        self.cells = Some(cells);
        Ok(self)
    }

    /// Groups the table's regions span (more than it was opened with only when it has more
    /// regions than groups).
    pub fn groups_needed(&self) -> u32 {
        self.regions
            .values()
            .map(|r| r.start + r.groups)
            .max()
            .unwrap_or(0)
            .max(self.groups)
    }

    /// Records the table can hold (all regions together).
    pub fn slots(&self) -> u32 {
        let groups = if self.regions.is_empty() {
            self.groups
        } else {
            self.regions.values().map(|r| r.groups).sum()
        };
        groups * GROUP_SLOTS as u32
    }

    /// Records the region of `policy` can hold (the whole table's, without regions).
    pub fn region_slots(&self, policy: &str) -> u32 {
        self.region_of(&format!("{policy}:")).groups * GROUP_SLOTS as u32
    }

    /// The per-process salt (also a source of uniqueness for ids this instance makes).
    pub fn salt(&self) -> &[u8] {
        &self.salt
    }

    /// This Envoy instance's number, from the table's salt (the same for every worker of the
    /// instance): lease ids and the holder name towards the limiter are built from it.
    pub fn instance(&self) -> u64 {
        let mut instance = [0u8; 8];
        for (dst, src) in instance.iter_mut().zip(&self.salt) {
            *dst = *src;
        }
        u64::from_le_bytes(instance)
    }

    fn group_key(&self, group: u32) -> String {
        format!("{}group/{group}", self.prefix)
    }

    /// [`SlotTable::group_key`] into `out` (a kept buffer: a lookup allocates no key name).
    fn group_name_into(&self, group: u32, out: &mut String) {
        out.clear();
        out.push_str(&self.prefix);
        out.push_str("group/");
        // The group number's decimal digits, filled from the end.
        let mut digits = [0u8; 10];
        let mut start = digits.len();
        let mut n = group;
        for digit in digits.iter_mut().rev() {
            *digit = b'0' + (n % 10) as u8;
            start -= 1;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        // ASCII digits, pushed as chars (cheaper than checking them as UTF-8).
        for digit in digits.get(start..).unwrap_or_default() {
            out.push(char::from(*digit));
        }
    }

    fn region_of(&self, id: &str) -> Region {
        // The policy's name ends at the first `:` (names have none); found inline, as ids are
        // short and this runs for every key of every request.
        id.as_bytes()
            .iter()
            .position(|b| *b == b':')
            .and_then(|end| id.get(..end))
            .and_then(|policy| self.regions.get(policy))
            .copied()
            .unwrap_or(Region {
                start: 0,
                groups: self.groups.max(1),
            })
    }

    /// The candidate groups of `id`, in probe order: distinct, in its region.
    #[cfg(test)]
    fn candidates(&self, id: &str) -> Vec<u32> {
        self.probe(id).groups(PROBE_GROUPS).as_slice().to_vec()
    }

    /// What `id`'s candidates are computed from: its region and its keyed hash (one hash of
    /// the id; each candidate is a word mixed from it).
    fn probe(&self, id: &str) -> Probe {
        Probe {
            region: self.region_of(id),
            hash: hash::sip13(self.hash_key, id.as_bytes()),
        }
    }

    /// Reads `indices` in order until a group holds `id`'s record, which is pushed onto
    /// `before`: the group's position in `groups` and the slot.
    fn find_in(
        &self,
        store: &impl SharedData,
        groups: &mut GroupList,
        indices: &[u32],
        id: &str,
        before: &mut RecordList,
    ) -> Result<Option<(usize, usize)>, TableError> {
        for &index in indices {
            let group = self.group_at(store, groups, index)?;
            if let Some(slot) = groups
                .as_slice()
                .get(group)
                .and_then(|g| g.find_into(id, before))
            {
                return Ok(Some((group, slot)));
            }
        }
        Ok(None)
    }
}

/// A key's region and keyed hash, from which its candidate groups come.
struct Probe {
    region: Region,
    hash: u64,
}

impl Probe {
    /// The first `limit` candidate groups, in probe order: distinct, in the region (the first
    /// ones are the same whatever the limit).
    fn groups(&self, limit: usize) -> Candidates {
        let Probe { region, hash } = *self;
        let count = limit
            .min(PROBE_GROUPS)
            .min(usize::try_from(region.groups).unwrap_or(PROBE_GROUPS));
        let mut out = Candidates {
            groups: [0; PROBE_GROUPS],
            len: 0,
        };
        for i in (0u32..).take(count) {
            let word = hash::candidate_word(hash, i);
            let mut offset = (word % u64::from(region.groups)) as u32;
            // Taken by an earlier candidate: the next group of the region (there are at least
            // `count` of them, so this ends).
            while out.as_slice().contains(&(region.start + offset)) {
                offset = (offset + 1) % region.groups;
            }
            if let Some(group) = out.groups.get_mut(out.len) {
                *group = region.start + offset;
                out.len += 1;
            }
        }
        out
    }
}

impl SlotTable {
    fn read(&self, store: &impl SharedData, index: u32) -> Result<Group, TableError> {
        let mut group = Group::default();
        self.read_into(store, index, &mut group)?;
        Ok(group)
    }

    /// Reads group `index` into `group`, reusing its value's and name's buffers.
    fn read_into(
        &self,
        store: &impl SharedData,
        index: u32,
        group: &mut Group,
    ) -> Result<(), TableError> {
        self.group_name_into(index, &mut group.name);
        if Self::try_read_into(store, index, group)? {
            return Ok(());
        }
        // Created at open (or, past the opened groups, on first use); recreate, then re-read.
        create_if_absent(store, &group.name, &encode_group(&vec![None; GROUP_SLOTS]))?;
        if Self::try_read_into(store, index, group)? {
            Ok(())
        } else {
            Err(TableError::Host)
        }
    }

    /// Reads the group named `group.name`; `false` when its key is missing.
    fn try_read_into(
        store: &impl SharedData,
        index: u32,
        group: &mut Group,
    ) -> Result<bool, TableError> {
        let Some(cas) = store
            .get_into(&group.name, &mut group.raw)
            .map_err(|_| TableError::Host)?
        else {
            return Ok(false);
        };
        if group.raw.is_empty() {
            // A present key with an empty value (what a shared-data "remove" leaves).
            group.raw = encode_group(&vec![None; GROUP_SLOTS]);
        }
        group.index = index;
        group.cas = cas;
        group.slots = None;
        group.rank = None;
        group.candidate = false;
        Ok(true)
    }

    /// Position of group `index` among the transaction's groups, reading it on first use (into
    /// a kept group's buffers).
    fn group_at(
        &self,
        store: &impl SharedData,
        groups: &mut GroupList,
        index: u32,
    ) -> Result<usize, TableError> {
        if let Some(position) = groups.as_slice().iter().position(|g| g.index == index) {
            return Ok(position);
        }
        let group = groups.push().ok_or(TableError::Host)?;
        if let Err(error) = self.read_into(store, index, group) {
            groups.pop();
            return Err(error);
        }
        Ok(groups.as_slice().len() - 1)
    }

    /// Where a new key goes among its `candidates` (indices into `groups`): group, slot and
    /// whether it evicts an idle record. Slots already given to earlier keys of the
    /// transaction, and records of the transaction's own ids, are not free.
    fn choose(
        groups: &[Group],
        candidates: &[usize],
        places: &[Place],
        ids: &[&str],
        now_ms: u64,
    ) -> Result<(usize, usize, bool), TableError> {
        let free_slots = |group: usize| -> Vec<usize> {
            let Some(g) = groups.get(group) else {
                return Vec::new();
            };
            (0..g.slots().len())
                .filter(|slot| !places.iter().any(|p| p.group == group && p.slot == *slot))
                .filter(|slot| match g.slots().get(*slot) {
                    Some(None) => true,
                    Some(Some(record)) => {
                        record.evictable_at_ms <= now_ms && !ids.contains(&record.id.as_str())
                    }
                    None => false,
                })
                .collect()
        };
        // Keeps the receiving group after every other candidate of each key it receives.
        let allowed = |target: usize| -> bool {
            let Some(group) = groups.get(target) else {
                return false;
            };
            match group.rank {
                Some(rank) => candidates.iter().filter(|c| **c != target).all(|c| {
                    groups
                        .get(*c)
                        .and_then(|g| g.rank)
                        .map_or(true, |other| other < rank)
                }),
                None => !group.candidate,
            }
        };
        let mut best: Option<(usize, Vec<usize>)> = None;
        for &group in candidates {
            if !allowed(group) {
                continue;
            }
            let free = free_slots(group);
            if free.len() >= 2 {
                best = Some((group, free));
                break;
            }
            if !free.is_empty() && best.as_ref().map_or(true, |(_, b)| free.len() > b.len()) {
                best = Some((group, free));
            }
        }
        let (group, free) = best.ok_or(TableError::Full)?;
        let slots = groups.get(group).map(Group::slots).unwrap_or(&[]);
        if let Some(&slot) = free
            .iter()
            .find(|s| slots.get(**s).is_some_and(Option::is_none))
        {
            return Ok((group, slot, false));
        }
        free.iter()
            .filter_map(|s| Some((*s, slots.get(*s)?.as_ref()?.evictable_at_ms)))
            .min_by_key(|(_, at)| *at)
            .map(|(slot, _)| (group, slot, true))
            .ok_or(TableError::Full)
    }

    /// Reads the records of `ids` (distinct; fresh records for keys without a slot), lets
    /// `decide` change them, and writes the changed ones all-or-nothing. `decide` may run more
    /// than once (after a lost race), always on fresh reads. `refund(i, before, after, current)`
    /// undoes item `i`'s change on its current value when a later write lost a race.
    pub fn transact<T>(
        &self,
        store: &impl SharedData,
        ids: &[&str],
        now_ms: u64,
        decide: impl FnMut(&mut [Record]) -> Txn<T>,
        refund: impl Fn(usize, &Record, &Record, &mut Record),
    ) -> Result<Transacted<T>, TableError> {
        #[cfg(not(target_family = "wasm"))]
        if let Some(cells) = &self.cells {
            return self.transact_cells(cells, ids, now_ms, decide);
        }
        let mut buffers = Buffers::take();
        let result = self.transact_in(&mut buffers, store, ids, now_ms, decide, refund);
        buffers.give_back();
        result
    }

    /// One key's record decided where it lies, for a decision that reads the record and
    /// then makes plain writes to it: `decide` reads the record (a fresh one for a new key)
    /// and returns the decision, `write` applies it (assignments and arithmetic, nothing that
    /// can panic). In the native cells a found record is neither copied out nor back: it is
    /// read and written in place under its group's lock, and a panic in `decide` leaves it
    /// as it was (`decide` cannot change it). Elsewhere (shared data, or a new key) it is
    /// [`SlotTable::transact`] on a copy; `refund(value, before, after, current)` undoes the
    /// decision's write when a later write of its transaction lost a race.
    pub fn transact_read<T>(
        &self,
        store: &impl SharedData,
        id: &str,
        now_ms: u64,
        mut decide: impl FnMut(&Record) -> T,
        write: impl Fn(&T, &mut Record),
        refund: impl Fn(&T, &Record, &Record, &mut Record),
    ) -> Result<Transacted<T>, TableError> {
        #[cfg(not(target_family = "wasm"))]
        if let Some(cells) = &self.cells {
            if let Some(done) = self.transact_cell_in_place(cells, id, &mut decide, &write)? {
                return Ok(done);
            }
        }
        // The decision of the latest attempt: what the caller gets, and what a refund undoes.
        let last: std::cell::RefCell<Option<T>> = std::cell::RefCell::new(None);
        let done = self.transact(
            store,
            &[id],
            now_ms,
            |records| {
                let Some(record) = records.first_mut() else {
                    *last.borrow_mut() = None;
                    return Txn::Abort(());
                };
                let value = decide(record);
                write(&value, record);
                *last.borrow_mut() = Some(value);
                Txn::Commit(())
            },
            |_, before, after, current| {
                if let Some(value) = &*last.borrow() {
                    refund(value, before, after, current);
                }
            },
        )?;
        // One id always gives the decision one record: an abort cannot happen.
        let value = last.into_inner().ok_or(TableError::Host)?;
        Ok(Transacted {
            value,
            committed: done.committed,
            evictions: done.evictions,
        })
    }

    fn transact_in<T>(
        &self,
        buffers: &mut Buffers,
        store: &impl SharedData,
        ids: &[&str],
        now_ms: u64,
        mut decide: impl FnMut(&mut [Record]) -> Txn<T>,
        refund: impl Fn(usize, &Record, &Record, &mut Record),
    ) -> Result<Transacted<T>, TableError> {
        let Buffers {
            groups,
            places,
            before,
            records,
            write,
        } = buffers;
        for _ in 0..MAX_ATTEMPTS {
            groups.clear();
            places.clear();
            before.clear();
            let mut next_rank = 0;
            for id in ids {
                // Most keys live in their first candidate: the others are computed only when
                // it does not hold the key.
                let probe = self.probe(id);
                let first = probe.groups(1);
                let mut found = self.find_in(store, groups, first.as_slice(), id, before)?;
                let probe = if found.is_none() {
                    let all = probe.groups(PROBE_GROUPS);
                    let rest = all.as_slice().get(1..).unwrap_or_default();
                    found = self.find_in(store, groups, rest, id, before)?;
                    all
                } else {
                    first
                };
                if let Some((group, slot)) = found {
                    places.push(Place {
                        group,
                        slot,
                        evicts: false,
                        candidates: Vec::new(),
                    });
                    continue;
                }
                // A new key: every candidate was read; placing it looks at all their slots.
                let mut candidates = Vec::with_capacity(PROBE_GROUPS);
                for &index in probe.as_slice() {
                    let group = self.group_at(store, groups, index)?;
                    if let Some(g) = groups.as_mut_slice().get_mut(group) {
                        g.decode_slots();
                    }
                    candidates.push(group);
                }
                let (group, slot, evicts) =
                    Self::choose(groups.as_slice(), &candidates, places, ids, now_ms)?;
                if let Some(g) = groups.as_mut_slice().get_mut(group) {
                    if g.rank.is_none() {
                        g.rank = Some(next_rank);
                        next_rank += 1;
                    }
                }
                for &c in &candidates {
                    if let Some(g) = groups.as_mut_slice().get_mut(c) {
                        g.candidate = true;
                    }
                }
                places.push(Place {
                    group,
                    slot,
                    evicts,
                    candidates,
                });
                if let Some(record) = before.push() {
                    record.reset(id);
                }
            }
            records.copy_from(before.as_slice());
            let value = match decide(records.as_mut_slice()) {
                Txn::Abort(value) => {
                    return Ok(Transacted {
                        value,
                        committed: false,
                        evictions: 0,
                    })
                }
                Txn::Commit(value) => value,
            };
            match self.write_all(
                store,
                groups.as_slice(),
                places,
                before.as_slice(),
                records.as_slice(),
                write,
                &refund,
            ) {
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

    /// Writes, each with the stamp it was read with: every group with a changed record, and
    /// every candidate of a key that is inserted (unchanged ones as read). Groups receiving a
    /// new key go last, in rank order, so an insert is visible only once its other candidates
    /// are known not to have changed since they were read.
    #[allow(clippy::too_many_arguments)]
    fn write_all(
        &self,
        store: &impl SharedData,
        groups: &[Group],
        places: &[Place],
        before: &[Record],
        records: &[Record],
        scratch: &mut WriteScratch,
        refund: &impl Fn(usize, &Record, &Record, &mut Record),
    ) -> Result<u32, WriteError> {
        let WriteScratch {
            order,
            changed,
            out,
        } = scratch;
        // Which items changed, compared once.
        changed.clear();
        changed.extend(before.iter().zip(records).map(|(old, new)| old != new));
        let changes = || {
            places
                .iter()
                .zip(records)
                .zip(changed.iter())
                .filter(|(_, changed)| **changed)
                .map(|(item, _)| item)
        };
        order.clear();
        order.extend((0..groups.len()).filter(|index| {
            changes().any(|(place, _)| place.group == *index || place.candidates.contains(index))
        }));
        order.sort_by_key(|index| {
            groups
                .get(*index)
                .and_then(|g| g.rank)
                .map_or((0, 0), |r| (1, r))
        });
        // Whether the transaction changes a record of the group (else its write only confirms
        // that nothing changed since it was read).
        let changes_group = |index: usize| {
            changes().any(|(place, _)| place.group == index && place.slot < GROUP_SLOTS)
        };
        let mut evictions = 0;
        for (position, &index) in order.iter().enumerate() {
            let Some(group) = groups.get(index) else {
                continue;
            };
            let changed = changes_group(index);
            evictions += changes()
                .filter(|(place, _)| {
                    place.group == index && place.slot < GROUP_SLOTS && place.evicts
                })
                .count() as u32;
            let value = if changed {
                splice_group(out, &group.raw, |slot| {
                    changes()
                        .find(|(place, _)| place.group == index && place.slot == slot)
                        .map(|(_, new)| new)
                });
                out.as_slice()
            } else {
                group.raw.as_slice()
            };
            if let Err(error) = store.set(group.name.as_str(), value, Some(group.cas)) {
                // Undo what the groups written before this one changed.
                for &undo in order.iter().take(position) {
                    if changes_group(undo) {
                        self.refund_group(store, groups, undo, places, before, records, refund);
                    }
                }
                return Err(error);
            }
        }
        Ok(evictions)
    }

    /// Undoes, on the current value of an already written group, the changes of the items that
    /// live in it (within the attempt bound: records that moved on keep their state).
    #[allow(clippy::too_many_arguments)]
    fn refund_group(
        &self,
        store: &impl SharedData,
        groups: &[Group],
        group: usize,
        places: &[Place],
        before: &[Record],
        records: &[Record],
        refund: &impl Fn(usize, &Record, &Record, &mut Record),
    ) {
        let Some(index) = groups.get(group).map(|g| g.index) else {
            return;
        };
        for _ in 0..MAX_ATTEMPTS {
            let Ok(current) = self.read(store, index) else {
                return;
            };
            let mut slots = decode_group(&current.raw);
            for (item, ((place, old), new)) in places.iter().zip(before).zip(records).enumerate() {
                if place.group != group || old == new {
                    continue;
                }
                if let Some(Some(record)) = slots.get_mut(place.slot) {
                    if record.id == new.id {
                        refund(item, old, new, record);
                    }
                }
            }
            match store.set(
                current.name.as_str(),
                &encode_group(&slots),
                Some(current.cas),
            ) {
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
