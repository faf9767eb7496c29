use super::*;
use crate::shared::MemorySharedData;
use tollgate_core::bucket::{give_back, try_take, Limits};

/// One bucket to charge (what the engine does for `local` policies).
#[derive(Clone, Copy)]
struct Charge<'a> {
    bucket_id: &'a str,
    limits: &'a Limits,
    cost: u64,
}

#[derive(Debug, PartialEq)]
struct Charged {
    allowed: bool,
    retry_ms: Vec<u64>,
    evictions: u32,
}

fn full_at(record: &Record, limits: &Limits) -> u64 {
    record.bucket.map_or(0, |b| b.full_at_ms(limits))
}

impl SlotTable {
    /// All-or-nothing token-bucket charge through `transact`.
    fn charge(
        &self,
        store: &MemorySharedData,
        charges: &[Charge<'_>],
        now: u64,
    ) -> Result<Charged, TableError> {
        let ids: Vec<&str> = charges.iter().map(|c| c.bucket_id).collect();
        let done = self.transact(
            store,
            &ids,
            now,
            |records| {
                let decided: Vec<_> = charges
                    .iter()
                    .zip(records.iter())
                    .map(|(c, r)| try_take(c.limits, r.bucket, now, c.cost))
                    .collect();
                let allowed = decided.iter().all(|(_, d)| d.is_allowed());
                let retry_ms = decided
                    .iter()
                    .map(|(_, d)| match d {
                        tollgate_core::bucket::Decision::Denied { retry_after_ms, .. } => {
                            *retry_after_ms
                        }
                        _ => 0,
                    })
                    .collect();
                if !allowed {
                    return Txn::Abort((false, retry_ms));
                }
                for ((c, r), (state, _)) in charges.iter().zip(records.iter_mut()).zip(&decided) {
                    r.bucket = Some(*state);
                    r.evictable_at_ms = full_at(r, c.limits);
                }
                Txn::Commit((true, retry_ms))
            },
            |i, _, _, current| {
                let c = charges[i];
                current.bucket = Some(give_back(c.limits, current.bucket, now, c.cost));
            },
        )?;
        Ok(Charged {
            allowed: done.value.0,
            retry_ms: done.value.1,
            evictions: done.evictions,
        })
    }
}

fn limits(burst: u64) -> Limits {
    // Negligible refill: 1 unit per hour.
    Limits::new(1, 3_600_000, burst).unwrap()
}

fn open(store: &MemorySharedData, slots: u32) -> SlotTable {
    SlotTable::open(store, "tollgate/test/", slots, 7).unwrap()
}

#[test]
fn open_creates_every_slot_once_and_never_overwrites() {
    let store = MemorySharedData::default();
    let table = open(&store, 64);
    assert_eq!(store.entries(), 17); // 16 groups of 4 slots + salt
    let l = limits(5);
    let charge = [Charge {
        bucket_id: "p:a",
        limits: &l,
        cost: 3,
    }];
    assert!(table.charge(&store, &charge, 0).unwrap().allowed);
    // A second worker opening the same table keeps the live bucket.
    let again = open(&store, 64);
    assert_eq!(store.entries(), 17);
    let charged = again.charge(&store, &charge, 0).unwrap();
    assert!(!charged.allowed, "the bucket was reset by a second open");
}

#[test]
fn exact_capacity_and_retry_after() {
    let store = MemorySharedData::default();
    let table = open(&store, 64);
    let l = Limits::new(100, 1_000, 20).unwrap();
    let charge = [Charge {
        bucket_id: "p:tenant",
        limits: &l,
        cost: 5,
    }];
    for i in 0..4 {
        let c = table.charge(&store, &charge, 1_000).unwrap();
        assert!(c.allowed, "charge {i}");
    }
    let denied = table.charge(&store, &charge, 1_000).unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.retry_ms[0], 50);
    // Time passes: 50 ms later the next transfer fits again.
    assert!(table.charge(&store, &charge, 1_050).unwrap().allowed);
}

#[test]
fn all_or_nothing_across_buckets() {
    let store = MemorySharedData::default();
    let table = open(&store, 64);
    let wide = limits(10);
    let narrow = limits(2);
    let both = [
        Charge {
            bucket_id: "tenant-wide:acme",
            limits: &wide,
            cost: 1,
        },
        Charge {
            bucket_id: "route:acme",
            limits: &narrow,
            cost: 1,
        },
    ];
    assert!(table.charge(&store, &both, 0).unwrap().allowed);
    assert!(table.charge(&store, &both, 0).unwrap().allowed);
    let denied = table.charge(&store, &both, 0).unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.retry_ms[0], 0);
    assert!(denied.retry_ms[1] > 0);
    // The denial took nothing from the tenant-wide bucket: 8 left.
    let only_wide = [both[0]];
    for _ in 0..8 {
        assert!(table.charge(&store, &only_wide, 0).unwrap().allowed);
    }
    assert!(!table.charge(&store, &only_wide, 0).unwrap().allowed);
}

#[test]
fn lost_race_is_retried_and_refunds_partial_writes() {
    let store = MemorySharedData::default();
    let table = open(&store, 64);
    let l = limits(10);
    // Two buckets in different groups, so the first one's write has to be refunded.
    let second = (0..)
        .map(|n| format!("b:{n}"))
        .find(|id| table.group_of(id) != table.group_of("a:x"))
        .unwrap();
    let both = [
        Charge {
            bucket_id: "a:x",
            limits: &l,
            cost: 1,
        },
        Charge {
            bucket_id: &second,
            limits: &l,
            cost: 1,
        },
    ];
    assert!(table.charge(&store, &both, 0).unwrap().allowed);
    // Make the write of the second bucket lose one race.
    let holding = |id: &str| {
        (0..table.groups)
            .map(|g| table.group_key(g))
            .find(|k| {
                let (v, _) = store.get(k).unwrap();
                decode_group(&v.unwrap())
                    .iter()
                    .flatten()
                    .any(|r| r.id == id)
            })
            .unwrap()
    };
    store.interfere_once.replace(Some(holding(&second)));
    assert!(table.charge(&store, &both, 0).unwrap().allowed);
    // Each bucket was charged exactly twice (the first attempt's write to `a:x` was refunded).
    for id in ["a:x", second.as_str()] {
        let one = [Charge {
            bucket_id: id,
            limits: &l,
            cost: 8,
        }];
        assert!(table.charge(&store, &one, 0).unwrap().allowed, "{id}");
        let more = [Charge {
            bucket_id: id,
            limits: &l,
            cost: 1,
        }];
        assert!(!table.charge(&store, &more, 0).unwrap().allowed, "{id}");
    }
}

#[test]
fn keys_never_share_a_slot_and_memory_is_bounded() {
    let store = MemorySharedData::default();
    let table = open(&store, 16);
    let bytes_before = store.bytes();
    let l = limits(3);
    let mut full = 0;
    let mut allowed = 0;
    for tenant in 0..10_000 {
        let id = format!("p:{tenant}");
        let charge = [Charge {
            bucket_id: &id,
            limits: &l,
            cost: 1,
        }];
        match table.charge(&store, &charge, 0) {
            Ok(c) if c.allowed => allowed += 1,
            Ok(_) => panic!("a fresh tenant was denied: it shares state"),
            Err(TableError::Full) => full += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    // 16 slots hold 16 live buckets; every other tenant finds the table full.
    assert_eq!(allowed, 16);
    assert_eq!(full, 10_000 - 16);
    assert_eq!(store.entries(), 5); // 4 groups + salt
    let per_slot = 2 + 1 + 2 + "p:9999".len() + FIXED_BYTES;
    assert!(
        store.bytes() <= bytes_before + 16 * per_slot,
        "{}",
        store.bytes()
    );
}

#[test]
fn full_buckets_are_evicted_without_loss() {
    let store = MemorySharedData::default();
    let table = open(&store, 16);
    // 1 unit per ms: a bucket of 2 is full again 1 ms after taking 1.
    let l = Limits::new(1, 1, 2).unwrap();
    let charge = |id: &str, now: u64| {
        table.charge(
            &store,
            &[Charge {
                bucket_id: id,
                limits: &l,
                cost: 1,
            }],
            now,
        )
    };
    // Fill the table with live buckets (4 groups of 4).
    let mut tenant = 0;
    while (0..table.groups).any(|g| {
        let (v, _) = store.get(&table.group_key(g)).unwrap();
        decode_group(&v.unwrap()).iter().any(Option::is_none)
    }) {
        match charge(&format!("p:{tenant}"), 0) {
            Ok(charged) => assert!(charged.allowed),
            Err(TableError::Full) => {} // its group is full already; another tenant fills the rest
            Err(e) => panic!("{e:?}"),
        }
        tenant += 1;
    }
    assert_eq!(charge("p:new", 0), Err(TableError::Full));
    // 1 ms later the buckets (1 of 2 units taken) are full again, and one gives way.
    let later = charge("p:new", 5).unwrap();
    assert!(later.allowed);
    assert_eq!(later.evictions, 1);
    // The newcomer now has its own slot: charging it again evicts nothing.
    assert_eq!(charge("p:new", 5).unwrap().evictions, 0);
}

#[test]
fn hostile_ids_are_stored_and_compared_exactly() {
    let store = MemorySharedData::default();
    let table = open(&store, 64);
    let l = limits(1);
    let a = "p:%7bx%7d%3ay";
    let b = "p:%7bx%7d%3az";
    assert!(
        table
            .charge(
                &store,
                &[Charge {
                    bucket_id: a,
                    limits: &l,
                    cost: 1
                }],
                0
            )
            .unwrap()
            .allowed
    );
    assert!(
        table
            .charge(
                &store,
                &[Charge {
                    bucket_id: b,
                    limits: &l,
                    cost: 1
                }],
                0
            )
            .unwrap()
            .allowed
    );
    assert!(
        !table
            .charge(
                &store,
                &[Charge {
                    bucket_id: a,
                    limits: &l,
                    cost: 1
                }],
                0
            )
            .unwrap()
            .allowed
    );
}

#[test]
fn corrupt_slots_read_as_empty() {
    assert_eq!(decode(&[]), None);
    assert_eq!(decode(&[0]), None);
    assert_eq!(decode(&[TAG_RECORD, 200, 0, b'x']), None);
    // A record of an older layout (tag 1) reads as empty, never as garbage state.
    assert_eq!(decode(&[1, 1, 0, b'x', 0, 0, 0, 0, 0, 0, 0, 0]), None);
    let record = Record {
        id: "p:k".into(),
        bucket: Some(BucketState {
            tokens: 1.5,
            updated_ms: 9,
        }),
        lease: Lease {
            tokens: 7,
            expires_ms: 11,
            seq: 12,
            granted: 13,
            pending_until_ms: 14,
            denied_until_ms: 15,
            unavailable_since_ms: 16,
            unavailable_until_ms: 17,
            window_start_ms: 18,
            window_units: 19,
            rate_per_s: 20.5,
            drip_per_ms: 21.25,
            drip_from_ms: 22,
            drip_until_ms: 23,
            drip_carry: 0.75,
            assigned_until_ms: 24,
            renew_at_ms: 25,
            assigned_at_ms: 26,
            asked_demand_per_s: 27.5,
        },
        evictable_at_ms: 10,
    };
    assert_eq!(decode(&encode(&record)), Some(record.clone()));
    let fresh = Record::fresh("q:k");
    assert_eq!(decode(&encode(&fresh)), Some(fresh));
    // Groups round-trip, and garbage reads as empty slots.
    let group = vec![Some(record.clone()), None, Some(Record::fresh("x")), None];
    assert_eq!(decode_group(&encode_group(&group)), group);
    assert_eq!(decode_group(b"garbage"), vec![None; GROUP_SLOTS]);
    assert_eq!(decode_group(&[TAG_GROUP, 200, 0]), vec![None; GROUP_SLOTS]);
    // Truncated or extended encodings are rejected.
    let bytes = encode(&record);
    assert_eq!(decode(&bytes[..bytes.len() - 1]), None);
    assert_eq!(decode(&[bytes.as_slice(), &[0]].concat()), None);
}
