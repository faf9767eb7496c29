//! A transaction's writes: every candidate group CAS-written in the order that keeps a key
//! from being created twice, and the refund of what a lost race had already written.

use super::*;

impl SlotTable {
    /// Writes, each with the stamp it was read with: every group with a changed record, and
    /// every candidate of a key that is inserted (unchanged ones as read). Groups receiving a
    /// new key go last, in rank order, so an insert is visible only once its other candidates
    /// are known not to have changed since they were read.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write_all(
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
    pub(super) fn refund_group(
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
}
