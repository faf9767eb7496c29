//! The table's records kept typed in process memory, for a host whose workers are threads of
//! one process (the native build): each group of [`GROUP_SLOTS`] records sits behind its own
//! mutex, and a transaction locks the groups it needs instead of reading encoded bytes and
//! writing them back under a CAS stamp. Nothing is encoded, decoded or copied between a
//! byte store and the records; a lookup hashes the id once, locks one group and compares ids.
//!
//! **Same table, other storage.** Layout, regions, placement (the keyed hash, the candidate
//! groups in probe order, the choice of a new key's slot, eviction of idle records only) are
//! [`SlotTable`]'s: only where a group's records live differs. So the guarantees carry over:
//! one policy's keys never reach another's region, hostile ids cannot aim at slots they do not
//! know the salt of, a live record is never evicted, memory is bounded by `local_table.slots`
//! (a group holds at most [`GROUP_SLOTS`] records, allocated as keys arrive).
//!
//! **Transactions.** The groups a transaction reads are locked in ascending index order, all
//! before any is changed, and released after the last write: two transactions never wait for
//! each other in a cycle, no other thread sees a half-written transaction, and a key is never
//! created twice (whoever inserts holds every candidate group of the key). Nothing races, so
//! nothing is refunded. A lookup first locks only each key's first candidate, where most keys
//! live; when a key is not there, it releases them and locks every candidate of every key.
//!
//! **Lifetime.** The cells belong to the process, not to a configuration: a reload that keeps
//! the table's size finds every key's state where it was (records are found by their exact id,
//! so a key that moves to another group under a new layout starts fresh, never reads another's
//! state); a reload that changes the size starts every key fresh in new cells.

use super::{Record, SlotTable, TableError, Transacted, Txn, GROUP_SLOTS, PROBE_GROUPS};
use std::cell::RefCell;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The records of one group: at most [`GROUP_SLOTS`], a record's slot is its position.
type Slots = Vec<Record>;

/// Every group's records, each group behind its own lock.
#[derive(Debug)]
pub struct Cells {
    groups: Box<[Mutex<Slots>]>,
}

impl Cells {
    /// Room for `groups` groups (a table's [`SlotTable::groups_needed`]); no record is
    /// allocated until its key arrives.
    pub fn new(groups: u32) -> Self {
        Self {
            groups: (0..groups).map(|_| Mutex::new(Vec::new())).collect(),
        }
    }

    /// Groups the cells have room for.
    pub fn groups(&self) -> u32 {
        u32::try_from(self.groups.len()).unwrap_or(u32::MAX)
    }

    /// Bytes of the groups themselves (their locks and lists), before any record.
    pub fn fixed_bytes(&self) -> usize {
        self.groups.len() * std::mem::size_of::<Mutex<Slots>>()
    }

    /// Records held, and their bytes in memory (the room the groups hold for records, plus the
    /// records' heap parts).
    pub fn footprint(&self) -> (usize, usize) {
        let mut records = 0;
        let mut bytes = 0;
        for group in self.groups.iter() {
            let slots = lock(group);
            records += slots.len();
            bytes += slots.capacity() * std::mem::size_of::<Record>();
            bytes += slots.iter().map(heap_bytes).sum::<usize>();
        }
        (records, bytes)
    }

    fn lock(&self, index: u32) -> Result<MutexGuard<'_, Slots>, TableError> {
        let group = self
            .groups
            .get(usize::try_from(index).map_err(|_| TableError::Host)?)
            .ok_or(TableError::Host)?;
        Ok(lock(group))
    }
}

/// Bytes a record holds on the heap: its id and its log, by their length (a buffer's spare
/// room depends on the records it was copied from before, not on the key).
fn heap_bytes(record: &Record) -> usize {
    record.id.len()
        + record
            .log
            .as_ref()
            .map_or(0, |log| log.times.len() * std::mem::size_of::<u64>())
}

/// Locks a group whatever a panic elsewhere left: a transaction changes a group's records only
/// after its decision returned (a panic in a decision leaves them as they were).
fn lock(group: &Mutex<Slots>) -> MutexGuard<'_, Slots> {
    group.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where a transaction's key is: a record it found, or the slot a new key takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spot {
    /// The key's record, at this position of the group.
    Found(usize),
    /// A new key appended to the group (it has fewer than [`GROUP_SLOTS`] records).
    Append,
    /// A new key in place of the idle record at this position.
    Evict(usize),
}

/// What deciding a record in place came to.
pub(super) enum InPlace<T> {
    /// Decided and written.
    Done(Transacted<T>),
    /// The decision passed: nothing written.
    Passed,
    /// The key is not in its first candidate.
    Elsewhere,
}

/// A key's group (its position among the locked groups) and spot.
#[derive(Debug, Clone, Copy)]
struct Place {
    locked: usize,
    spot: Spot,
}

thread_local! {
    /// The records a transaction shows its decision, kept per thread: the next transaction
    /// copies into their buffers instead of allocating.
    static RECORDS: RefCell<Vec<Record>> = const { RefCell::new(Vec::new()) };
}

impl SlotTable {
    /// [`SlotTable::transact`] on typed cells: see the module's header.
    pub(super) fn transact_cells<T>(
        &self,
        cells: &Cells,
        ids: &[&str],
        now_ms: u64,
        decide: impl FnMut(&mut [Record]) -> Txn<T>,
    ) -> Result<Transacted<T>, TableError> {
        let mut records = RECORDS
            .try_with(|r| r.try_borrow_mut().map(|mut r| std::mem::take(&mut *r)))
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let result = match ids {
            [id] => self.transact_one(cells, id, now_ms, &mut records, decide),
            _ => self.transact_many(cells, ids, now_ms, &mut records, decide),
        };
        let _ = RECORDS.try_with(|r| {
            if let Ok(mut r) = r.try_borrow_mut() {
                *r = records;
            }
        });
        result
    }

    /// [`SlotTable::try_transact_read`] on a record found in its key's first candidate:
    /// decided and written in place under that group's lock. [`InPlace::Elsewhere`] when the
    /// key is not there (it is new, or lives in another candidate): the caller runs the
    /// general transaction.
    #[inline(always)]
    pub(super) fn transact_cell_in_place<T>(
        &self,
        cells: &Cells,
        id: &str,
        decide: &mut impl FnMut(&Record) -> Option<T>,
        write: &impl Fn(&T, &mut Record),
    ) -> Result<InPlace<T>, TableError> {
        let probe = self.probe(id);
        let first = probe.groups(1);
        let Some(&index) = first.as_slice().first() else {
            return Ok(InPlace::Elsewhere);
        };
        let mut group = cells.lock(index)?;
        let Some(record) = group.iter_mut().find(|r| r.id == id) else {
            return Ok(InPlace::Elsewhere);
        };
        let Some(value) = decide(record) else {
            return Ok(InPlace::Passed);
        };
        write(&value, record);
        Ok(InPlace::Done(Transacted {
            value,
            committed: true,
            evictions: 0,
        }))
    }

    /// One key (a request matching one enforced policy, a credit, a lease's expiry): its first
    /// candidate alone is locked when the key lives there.
    fn transact_one<T>(
        &self,
        cells: &Cells,
        id: &str,
        now_ms: u64,
        records: &mut Vec<Record>,
        mut decide: impl FnMut(&mut [Record]) -> Txn<T>,
    ) -> Result<Transacted<T>, TableError> {
        let probe = self.probe(id);
        let first = probe.groups(1);
        if let Some(&index) = first.as_slice().first() {
            let mut group = cells.lock(index)?;
            if let Some(position) = group.iter().position(|r| r.id == id) {
                load(records, group.get(position));
                let value = match decide(records) {
                    Txn::Abort(value) => return Ok(aborted(value)),
                    Txn::Commit(value) => value,
                };
                if let (Some(slot), Some(record)) = (group.get_mut(position), records.first_mut()) {
                    std::mem::swap(slot, record);
                }
                return Ok(Transacted {
                    value,
                    committed: true,
                    evictions: 0,
                });
            }
        }
        self.transact_many(cells, &[id], now_ms, records, decide)
    }

    /// Any number of keys: every candidate group of every key locked, in ascending order.
    fn transact_many<T>(
        &self,
        cells: &Cells,
        ids: &[&str],
        now_ms: u64,
        records: &mut Vec<Record>,
        mut decide: impl FnMut(&mut [Record]) -> Txn<T>,
    ) -> Result<Transacted<T>, TableError> {
        let candidates: Vec<_> = ids
            .iter()
            .map(|id| self.probe(id).groups(PROBE_GROUPS))
            .collect();
        let mut order: Vec<u32> = candidates
            .iter()
            .flat_map(|c| c.as_slice().iter().copied())
            .collect();
        order.sort_unstable();
        order.dedup();
        let mut locked = Vec::with_capacity(order.len());
        for &index in &order {
            locked.push(cells.lock(index)?);
        }
        let at = |index: u32| order.binary_search(&index).ok();

        // Keys that have a record.
        let mut places: Vec<Option<Place>> = ids
            .iter()
            .zip(&candidates)
            .map(|(id, c)| {
                c.as_slice().iter().find_map(|&index| {
                    let position = at(index)?;
                    let slot = locked.get(position)?.iter().position(|r| r.id == *id)?;
                    Some(Place {
                        locked: position,
                        spot: Spot::Found(slot),
                    })
                })
            })
            .collect();
        // New keys, in order: a slot given to an earlier key is not free for a later one, nor
        // is a record of one of the transaction's own keys.
        let mut evictions = 0;
        for item in 0..ids.len() {
            if places.get(item).is_some_and(Option::is_some) {
                continue;
            }
            let keys = candidates.get(item).map(|c| c.as_slice()).unwrap_or(&[]);
            let place = choose(&locked, keys, &at, &places, ids, now_ms)?;
            if matches!(place.spot, Spot::Evict(_)) {
                evictions += 1;
            }
            if let Some(p) = places.get_mut(item) {
                *p = Some(place);
            }
        }

        records.truncate(ids.len());
        for (item, (id, place)) in ids.iter().zip(&places).enumerate() {
            let found = match place {
                Some(Place {
                    locked: position,
                    spot: Spot::Found(slot),
                }) => locked.get(*position).and_then(|g| g.get(*slot)),
                _ => None,
            };
            match (records.get_mut(item), found) {
                (Some(record), Some(source)) => record.clone_from(source),
                (Some(record), None) => record.reset(id),
                (None, Some(source)) => records.push(source.clone()),
                (None, None) => records.push(Record::fresh(id)),
            }
        }
        let value = match decide(records) {
            Txn::Abort(value) => return Ok(aborted(value)),
            Txn::Commit(value) => value,
        };
        for (place, record) in places.iter().zip(records.iter_mut()) {
            let Some(Place {
                locked: position,
                spot,
            }) = *place
            else {
                continue;
            };
            let Some(group) = locked.get_mut(position) else {
                continue;
            };
            match spot {
                Spot::Found(slot) | Spot::Evict(slot) => {
                    if let Some(slot) = group.get_mut(slot) {
                        std::mem::swap(slot, record);
                    }
                }
                Spot::Append => {
                    // A group holds what its keys need: one record's room more, not the four
                    // a growing list would take at once.
                    group.reserve_exact(1);
                    group.push(record.clone());
                }
            }
        }
        Ok(Transacted {
            value,
            committed: true,
            evictions,
        })
    }
}

/// The transaction's single record, copied into the kept list's first buffer.
fn load(records: &mut Vec<Record>, source: Option<&Record>) {
    let Some(source) = source else {
        return;
    };
    records.truncate(1);
    match records.first_mut() {
        Some(record) => record.clone_from(source),
        None => records.push(source.clone()),
    }
}

fn aborted<T>(value: T) -> Transacted<T> {
    Transacted {
        value,
        committed: false,
        evictions: 0,
    }
}

/// Where a new key goes among its candidate groups (`keys`, group indices in probe order,
/// each locked at `at(index)`): the first candidate with at least two free slots, else the one
/// with the most; in it an unused slot, else the record idle longest. A slot is free when it
/// is unused or its record is evictable, and neither a record of the transaction's own ids
/// nor a slot already given to an earlier key.
fn choose(
    locked: &[MutexGuard<'_, Slots>],
    keys: &[u32],
    at: &impl Fn(u32) -> Option<usize>,
    places: &[Option<Place>],
    ids: &[&str],
    now_ms: u64,
) -> Result<Place, TableError> {
    let taken = |position: usize, spot: Spot| {
        places
            .iter()
            .flatten()
            .any(|p| p.locked == position && p.spot == spot)
    };
    let appended = |position: usize| {
        places
            .iter()
            .flatten()
            .filter(|p| p.locked == position && p.spot == Spot::Append)
            .count()
    };
    let evictable = |position: usize| -> Vec<usize> {
        locked.get(position).map_or_else(Vec::new, |group| {
            group
                .iter()
                .enumerate()
                .filter(|(slot, record)| {
                    record.evictable_at_ms <= now_ms
                        && !ids.contains(&record.id.as_str())
                        && !taken(position, Spot::Evict(*slot))
                })
                .map(|(slot, _)| slot)
                .collect()
        })
    };
    let unused = |position: usize| {
        locked.get(position).map_or(0, |group| {
            GROUP_SLOTS.saturating_sub(group.len() + appended(position))
        })
    };
    let mut best: Option<(usize, usize)> = None;
    for &index in keys {
        let Some(position) = at(index) else {
            continue;
        };
        let free = unused(position) + evictable(position).len();
        if free >= 2 {
            best = Some((position, free));
            break;
        }
        if free > 0 && best.map_or(true, |(_, most)| free > most) {
            best = Some((position, free));
        }
    }
    let (position, _) = best.ok_or(TableError::Full)?;
    if unused(position) > 0 {
        return Ok(Place {
            locked: position,
            spot: Spot::Append,
        });
    }
    let group = locked.get(position).ok_or(TableError::Host)?;
    evictable(position)
        .into_iter()
        .filter_map(|slot| Some((slot, group.get(slot)?.evictable_at_ms)))
        .min_by_key(|(_, at)| *at)
        .map(|(slot, _)| Place {
            locked: position,
            spot: Spot::Evict(slot),
        })
        .ok_or(TableError::Full)
}

#[cfg(test)]
impl Cells {
    /// Every record held, with its group.
    pub(super) fn records(&self) -> Vec<(u32, Record)> {
        (0u32..)
            .zip(self.groups.iter())
            .flat_map(|(g, group)| {
                lock(group)
                    .iter()
                    .map(|r| (g, r.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}
