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
//! hash keyed by a per-process salt (SipHash-1-3, `table/hash.rs`: clients that do not know the salt
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
mod codec;
mod hash;
mod placement;
mod record;
mod transact;
mod write;

use codec::*;
pub use record::{Lease, Record};

#[cfg(not(target_family = "wasm"))]
pub use cells::Cells;
#[cfg(not(target_family = "wasm"))]
use cells::InPlace;

use crate::shared::{SharedData, StoreAt, WriteError};
use std::collections::BTreeMap;
#[cfg(not(target_family = "wasm"))]
use std::sync::Arc;
use tollgate_core::bucket::BucketState;
use tollgate_core::in_flight::{Slots, EPOCHS};
use tollgate_core::window::{Counters, Log};

/// Slots per group: the slots under one CAS stamp.
pub const GROUP_SLOTS: usize = 4;
/// Candidate groups of a key (fewer in a region of fewer groups), each from a word of the
/// id's keyed hash (`table/hash.rs`).
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
    /// [`SlotTable::groups_needed`]) instead of the shared-data store: see `table/cells.rs`. The
    /// store still holds the salt. Cells with fewer groups than the table spans are refused.
    #[cfg(not(target_family = "wasm"))]
    pub fn in_cells(mut self, cells: Arc<Cells>) -> Result<Self, TableError> {
        if cells.groups() < self.groups_needed() {
            return Err(TableError::Host);
        }
        self.cells = Some(cells);
        Ok(self)
    }

    /// Whether the records are kept typed in cells (the native build) rather than in the
    /// shared-data store.
    #[cfg(not(target_family = "wasm"))]
    pub fn keeps_cells(&self) -> bool {
        self.cells.is_some()
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
