//! Reading a key's candidate groups and choosing where a new key goes (see the table's
//! **Placement**).

use super::*;

impl SlotTable {
    pub(super) fn read(&self, store: &impl SharedData, index: u32) -> Result<Group, TableError> {
        let mut group = Group::default();
        self.read_into(store, index, &mut group)?;
        Ok(group)
    }

    /// Reads group `index` into `group`, reusing its value's and name's buffers.
    pub(super) fn read_into(
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
    pub(super) fn try_read_into(
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
    pub(super) fn group_at(
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
    pub(super) fn choose(
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
}
