//! Transactions over several records, all or nothing (see the table's **Transactions**): read
//! and decide, then write, retrying a lost race within [`MAX_ATTEMPTS`].

use super::*;

impl SlotTable {
    /// Reads the records of `ids` (distinct; fresh records for keys without a slot) from the
    /// store at `at.now_ms`, lets `decide` change them, and writes the changed ones
    /// all-or-nothing. `decide` may run more than once (after a lost race), always on fresh
    /// reads. `refund(i, before, after, current)` undoes item `i`'s change on its current value
    /// when a later write lost a race.
    pub fn transact<T>(
        &self,
        at: StoreAt<'_, impl SharedData>,
        ids: &[&str],
        decide: impl FnMut(&mut [Record]) -> Txn<T>,
        refund: impl Fn(usize, &Record, &Record, &mut Record),
    ) -> Result<Transacted<T>, TableError> {
        #[cfg(not(target_family = "wasm"))]
        if let Some(cells) = &self.cells {
            return self.transact_cells(cells, ids, at.now_ms, decide);
        }
        let mut buffers = Buffers::take();
        let result = self.transact_in(&mut buffers, at, ids, decide, refund);
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
        at: StoreAt<'_, impl SharedData>,
        id: &str,
        mut decide: impl FnMut(&Record) -> T,
        write: impl Fn(&T, &mut Record),
        refund: impl Fn(&T, &Record, &Record, &mut Record),
    ) -> Result<Transacted<T>, TableError> {
        // A decision that never passes always gives a value.
        self.try_transact_read(at, id, |record| Some(decide(record)), write, refund)?
            .ok_or(TableError::Host)
    }

    /// [`SlotTable::transact_read`] for a decision that may pass: `decide` returning `None`
    /// writes nothing (the record stays as it was read) and gives `Ok(None)`, for the caller
    /// to decide the request another way.
    #[inline]
    pub fn try_transact_read<T>(
        &self,
        at: StoreAt<'_, impl SharedData>,
        id: &str,
        mut decide: impl FnMut(&Record) -> Option<T>,
        write: impl Fn(&T, &mut Record),
        refund: impl Fn(&T, &Record, &Record, &mut Record),
    ) -> Result<Option<Transacted<T>>, TableError> {
        #[cfg(not(target_family = "wasm"))]
        if let Some(cells) = &self.cells {
            match self.transact_cell_in_place(cells, id, &mut decide, &write)? {
                InPlace::Done(done) => return Ok(Some(done)),
                InPlace::Passed => return Ok(None),
                InPlace::Elsewhere => {}
            }
        }
        // The decision of the latest attempt: what the caller gets, and what a refund undoes.
        let last: std::cell::RefCell<Option<T>> = std::cell::RefCell::new(None);
        let done = self.transact(
            at,
            &[id],
            |records| {
                let decided = records.first_mut().and_then(|record| {
                    let value = decide(record)?;
                    write(&value, record);
                    Some(value)
                });
                let commit = decided.is_some();
                *last.borrow_mut() = decided;
                if commit {
                    Txn::Commit(())
                } else {
                    Txn::Abort(())
                }
            },
            |_, before, after, current| {
                if let Some(value) = &*last.borrow() {
                    refund(value, before, after, current);
                }
            },
        )?;
        if !done.committed {
            return Ok(None);
        }
        Ok(last.into_inner().map(|value| Transacted {
            value,
            committed: true,
            evictions: done.evictions,
        }))
    }

    pub(super) fn transact_in<T>(
        &self,
        buffers: &mut Buffers,
        at: StoreAt<'_, impl SharedData>,
        ids: &[&str],
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
        let StoreAt { store, now_ms } = at;
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

    /// Changes one key's record (creating it fresh if it has none), e.g. to credit a lease
    /// from a callout response.
    pub fn update<T>(
        &self,
        at: StoreAt<'_, impl SharedData>,
        id: &str,
        mut update: impl FnMut(&mut Record) -> T,
    ) -> Result<T, TableError> {
        let result = self.transact(
            at,
            &[id],
            |records| match records.first_mut() {
                Some(record) => Txn::Commit(Some(update(record))),
                None => Txn::Abort(None),
            },
            |_, _, _, _| {},
        )?;
        result.value.ok_or(TableError::Host)
    }
}
