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
        store: &impl SharedData,
        charges: &[Charge<'_>],
        now: u64,
    ) -> Result<Charged, TableError> {
        let ids: Vec<&str> = charges.iter().map(|c| c.bucket_id).collect();
        let done = self.transact(
            StoreAt::new(store, now),
            &ids,
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
    exact_capacity_and_retry_after_on(&open(&store, 64), &store);
}

/// A bucket of 20 at 100 per s admits four transfers of 5, then says when the next fits.
fn exact_capacity_and_retry_after_on(table: &SlotTable, store: &MemorySharedData) {
    let l = Limits::new(100, 1_000, 20).unwrap();
    let charge = [Charge {
        bucket_id: "p:tenant",
        limits: &l,
        cost: 5,
    }];
    for i in 0..4 {
        let c = table.charge(store, &charge, 1_000).unwrap();
        assert!(c.allowed, "charge {i}");
    }
    let denied = table.charge(store, &charge, 1_000).unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.retry_ms[0], 50);
    // Time passes: 50 ms later the next transfer fits again.
    assert!(table.charge(store, &charge, 1_050).unwrap().allowed);
}

#[test]
fn all_or_nothing_across_buckets() {
    let store = MemorySharedData::default();
    all_or_nothing_on(&open(&store, 64), &store);
}

/// Two buckets charged together: a denial by the narrow one takes nothing from the wide one.
fn all_or_nothing_on(table: &SlotTable, store: &MemorySharedData) {
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
    assert!(table.charge(store, &both, 0).unwrap().allowed);
    assert!(table.charge(store, &both, 0).unwrap().allowed);
    let denied = table.charge(store, &both, 0).unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.retry_ms[0], 0);
    assert!(denied.retry_ms[1] > 0);
    // The denial took nothing from the tenant-wide bucket: 8 left.
    let only_wide = [both[0]];
    for _ in 0..8 {
        assert!(table.charge(store, &only_wide, 0).unwrap().allowed);
    }
    assert!(!table.charge(store, &only_wide, 0).unwrap().allowed);
}

/// Charges 10,000 fresh tenants once each in a table of 16 slots: (admitted, refused as
/// full). A fresh tenant denied would share another's state.
fn fill_with_fresh_tenants(table: &SlotTable, store: &MemorySharedData) -> (usize, usize) {
    let l = limits(3);
    let (mut allowed, mut full) = (0, 0);
    for tenant in 0..10_000 {
        let id = format!("p:{tenant}");
        let charge = [Charge {
            bucket_id: &id,
            limits: &l,
            cost: 1,
        }];
        match table.charge(store, &charge, 0) {
            Ok(c) if c.allowed => allowed += 1,
            Ok(_) => panic!("a fresh tenant was denied: it shares state"),
            Err(TableError::Full) => full += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    (allowed, full)
}

#[test]
fn lost_race_is_retried_and_refunds_partial_writes() {
    let store = MemorySharedData::default();
    let table = open(&store, 64);
    let l = limits(10);
    // Two buckets without a common candidate group, so the first one's write has to be
    // refunded.
    let second = (0..)
        .map(|n| format!("b:{n}"))
        .find(|id| {
            let theirs = table.candidates(id);
            table.candidates("a:x").iter().all(|g| !theirs.contains(g))
        })
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
    let (allowed, full) = fill_with_fresh_tenants(&table, &store);
    // 16 slots hold 16 live buckets; every other tenant finds the table full.
    assert_eq!(allowed, 16);
    assert_eq!(full, 10_000 - 16);
    assert_eq!(store.entries(), 5); // 4 groups + salt
                                    // A local record: length, tag, id length, id, flags, bucket, `evictable_at_ms`.
    let per_slot = 2 + 1 + 2 + "p:9999".len() + 1 + 16 + 8;
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
            debt: 28,
            prev_seq: 40,
            prev_tokens: 41,
            prev_expires_ms: 42,
        },
        in_flight: tollgate_core::in_flight::Slots {
            epoch: 29,
            counts: [30, 0, 31, 0, 32],
        },
        counters: Some(tollgate_core::window::Counters {
            window: 33,
            count: 34,
            previous: 35,
        }),
        log: Some(tollgate_core::window::Log {
            times: vec![36, 37, 37, 38],
            seen_ms: 39,
        }),
        evictable_at_ms: 10,
    };
    // Every part on its own round-trips too (each has its own flag).
    for part in [
        Record {
            in_flight: Default::default(),
            ..record.clone()
        },
        Record {
            lease: Default::default(),
            ..record.clone()
        },
        Record {
            bucket: None,
            lease: Default::default(),
            ..record.clone()
        },
        Record {
            counters: None,
            ..record.clone()
        },
        Record {
            log: Some(Default::default()),
            in_flight: Default::default(),
            ..record.clone()
        },
        Record {
            log: None,
            ..record.clone()
        },
    ] {
        assert_eq!(decode(&encode(&part)), Some(part.clone()));
    }
    assert_eq!(decode(&encode(&record)), Some(record.clone()));
    let fresh = Record::fresh("q:k");
    assert_eq!(decode(&encode(&fresh)), Some(fresh));
    // Groups round-trip, and garbage reads as empty slots.
    let group = vec![Some(record.clone()), None, Some(Record::fresh("x")), None];
    assert_eq!(decode_group(&encode_group(&group)), group);
    assert_eq!(decode_group(b"garbage"), vec![None; GROUP_SLOTS]);
    assert_eq!(decode_group(&[TAG_GROUP, 200, 0]), vec![None; GROUP_SLOTS]);
    // A record without a lease (every local policy's) leaves the lease out.
    let mut local = Record::fresh("p:k");
    local.bucket = record.bucket;
    assert_eq!(encode(&local).len(), 3 + 3 + 1 + 16 + 8);
    // The fixed parts, the counters, and the log's clock, length and four entries.
    assert_eq!(
        encode(&record).len(),
        3 + 3 + FIXED_BYTES + COUNTERS_BYTES + 10 + 4 * 8
    );
    assert_eq!(decode(&encode(&local)), Some(local.clone()));
    // Unknown flags are rejected.
    let mut flagged = encode(&local);
    flagged[6] |= 32;
    assert_eq!(decode(&flagged), None);
    // Truncated or extended encodings are rejected.
    let bytes = encode(&record);
    assert_eq!(decode(&bytes[..bytes.len() - 1]), None);
    assert_eq!(decode(&[bytes.as_slice(), &[0]].concat()), None);
    // A record of the layout before the previous lease was kept (tag 7, a lease of 20
    // words) reads as empty: its lease would otherwise be read with the wrong words.
    let mut old = encode(&Record {
        log: None,
        counters: None,
        in_flight: Default::default(),
        ..record.clone()
    });
    old[0] = 7;
    old.drain(7 + 16 + 20 * 8..7 + 16 + 23 * 8);
    assert_eq!(decode(&old), None);
}

/// Every record of the table, with its group.
fn all_records(store: &MemorySharedData, table: &SlotTable) -> Vec<(u32, Record)> {
    let groups = table.slots() / GROUP_SLOTS as u32;
    (0..groups.max(table.groups))
        .flat_map(|g| {
            let (value, _) = store.get(&table.group_key(g)).unwrap();
            decode_group(&value.unwrap_or_default())
                .into_iter()
                .flatten()
                .map(move |r| (g, r))
        })
        .collect()
}

/// splitmix64: reproducible random ids without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Inserts a new key whose record stays live until `live_until` (what `settle` sets for a
/// bucket that refills then); `Err(Full)` is the failure mode.
fn insert(
    table: &SlotTable,
    store: &impl SharedData,
    id: &str,
    now: u64,
    live_until: u64,
) -> Result<Transacted<()>, TableError> {
    table.transact(
        StoreAt::new(store, now),
        &[id],
        |records| {
            for r in records.iter_mut() {
                r.bucket = Some(BucketState {
                    tokens: 0.0,
                    updated_ms: now,
                });
                r.evictable_at_ms = live_until;
            }
            Txn::Commit(())
        },
        |_, _, _, _| {},
    )
}

/// Up to this occupancy (live records / slots) of a region, at most 1 new key in 10^4 may find
/// every candidate slot live (the sizing rule of docs/src/operating/capacity.md).
const DOCUMENTED_OCCUPANCY: f64 = 0.5;

#[test]
fn fallback_rate_by_occupancy() {
    // One new tenant per millisecond, each live for `hold` ms after its request (a bucket that
    // took a unit and refills in `hold`), so `hold` records are live at any time: occupancy is
    // hold / slots. After a warm-up of two holds (every slot has held a record, most idle
    // now), count the new keys that find the table full.
    // TOLLGATE_FALLBACK_SAMPLES=1000000 (with --release) for finer rates.
    let slots = 4096;
    let measured: u64 = std::env::var("TOLLGATE_FALLBACK_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40_000);
    println!("slots {slots}, {measured} new keys per row after warm-up");
    println!("occupancy | live keys | fallbacks | rate");
    let mut rows = Vec::new();
    for occupancy in [0.10, 0.25, 0.50, 0.60, 0.70, 0.75] {
        let store = MemorySharedData::default();
        let table = open(&store, slots).partitioned(["p"]);
        let hold = (occupancy * f64::from(slots)) as u64;
        let mut rng = Rng(occupancy.to_bits());
        let mut full = 0u64;
        let warm_up = 2 * hold;
        for now in 0..warm_up + measured {
            let id = format!("p:{:016x}", rng.next());
            match insert(&table, &store, &id, now, now + hold) {
                Ok(_) => {}
                Err(TableError::Full) if now >= warm_up => full += 1,
                Err(TableError::Full) => {}
                Err(e) => panic!("{e:?}"),
            }
        }
        let rate = full as f64 / measured as f64;
        println!(
            "{:>8.0} % | {hold:>9} | {full:>9} | {:.4} %",
            occupancy * 100.0,
            rate * 100.0
        );
        rows.push((occupancy, rate));
    }
    for (occupancy, rate) in rows {
        if occupancy <= DOCUMENTED_OCCUPANCY {
            assert!(
                rate <= 1e-4,
                "{rate} of new keys fell back at {occupancy} occupancy"
            );
        }
    }
}

#[test]
fn a_flood_on_one_policy_never_takes_another_policys_slots() {
    let hour = 3_600_000;
    for partitioned in [true, false] {
        let store = MemorySharedData::default();
        let table = open(&store, 2048);
        let table = if partitioned {
            table.partitioned(["flood", "steady"])
        } else {
            table
        };
        if partitioned {
            assert_eq!(table.region_slots("flood"), 1024);
            assert_eq!(table.region_slots("steady"), 1024);
        }
        // `flood` sends 5,000 new ids that stay live for an hour (five times its region);
        // every tenth request is a new tenant of `steady`, 500 in all (49 % of its region).
        let (mut flood_ok, mut flood_full, mut steady_ok, mut steady_full) = (0, 0, 0, 0);
        for n in 0..5_500u64 {
            let now = n;
            let (id, ok, full) = if n % 11 == 10 {
                (format!("steady:{n}"), &mut steady_ok, &mut steady_full)
            } else {
                (format!("flood:{n}"), &mut flood_ok, &mut flood_full)
            };
            match insert(&table, &store, &id, now, now + hour) {
                Ok(done) => {
                    assert_eq!(done.evictions, 0, "a live record was evicted");
                    *ok += 1;
                }
                Err(TableError::Full) => *full += 1,
                Err(e) => panic!("{e:?}"),
            }
        }
        let records = all_records(&store, &table);
        let count = |prefix: &str| {
            records
                .iter()
                .filter(|(_, r)| r.id.starts_with(prefix))
                .count()
        };
        // No record was lost: every insert that succeeded is still there, exactly once.
        assert_eq!(count("flood:"), flood_ok);
        assert_eq!(count("steady:"), steady_ok);
        if partitioned {
            println!("flood: {flood_ok} held, {flood_full} full; steady: {steady_ok} held");
            assert_eq!(steady_ok, 500, "steady tenants found the table full");
            assert_eq!(steady_full, 0);
            assert!(flood_ok <= 1024 && flood_full >= 5_000 - 1024);
            // Each policy's records sit in its own half of the table.
            assert!(records
                .iter()
                .all(|(g, r)| (*g < 256) == r.id.starts_with("flood:")));
        } else {
            // The defect this layout fixes: without regions the flood starves `steady`.
            assert!(steady_full > 100, "steady full {steady_full}");
        }
    }
}

#[test]
fn regions_are_disjoint_and_candidates_stay_inside() {
    let store = MemorySharedData::default();
    let table = open(&store, 64).partitioned(["a", "b", "c", "a"]);
    // 16 groups over 3 distinct names: 6 + 5 + 5.
    assert_eq!(table.region_slots("a"), 24);
    assert_eq!(table.region_slots("b"), 20);
    assert_eq!(table.region_slots("c"), 20);
    assert_eq!(table.slots(), 64);
    let ranges = [("a", 0..6), ("b", 6..11), ("c", 11..16)];
    for (name, range) in ranges {
        for n in 0..200 {
            let candidates = table.candidates(&format!("{name}:{n}"));
            assert_eq!(candidates.len(), PROBE_GROUPS);
            assert!(candidates.iter().all(|g| range.contains(g)), "{name}");
            let mut distinct = candidates.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), candidates.len());
        }
    }
    // Unknown policies, and ids without one, use the whole table.
    for id in ["zzz:1", "plain"] {
        assert!(table.candidates(id).iter().all(|g| *g < 16));
    }
    // A region smaller than the probe width: every group of it is a candidate.
    let small = open(&store, 16).partitioned(["x", "y"]);
    assert_eq!(small.candidates("x:k").len(), 2);
    // More names than groups: one group each; the extra groups are created on first use.
    let store = MemorySharedData::default();
    let crowded = open(&store, 16).partitioned(["p0", "p1", "p2", "p3", "p4", "p5"]);
    assert_eq!(crowded.slots(), 24);
    assert_eq!(store.entries(), 5);
    for p in 0..6 {
        insert(&crowded, &store, &format!("p{p}:k"), 0, 10).unwrap();
    }
    assert_eq!(store.entries(), 7);
    let records = all_records(&store, &crowded);
    assert_eq!(records.len(), 6);
    assert!(records.iter().all(|(g, r)| r.id == format!("p{g}:k")));
}

#[test]
fn new_keys_with_shared_candidates_in_one_transaction_are_each_created_once() {
    // One region of two groups: every key has both as candidates.
    let store = MemorySharedData::default();
    let table = open(&store, 8);
    let l = limits(5);
    let ids = ["p:a", "p:b", "p:c", "p:d", "p:e"];
    let charges: Vec<Charge<'_>> = ids
        .iter()
        .map(|id| Charge {
            bucket_id: id,
            limits: &l,
            cost: 1,
        })
        .collect();
    // Placement keeps every receiving group after the other candidates of the keys it
    // receives; with both groups shared, one transaction can place keys in one group only.
    let first = table.charge(&store, &charges[..3], 0).unwrap();
    assert!(first.allowed);
    let again = table.charge(&store, &charges, 0);
    assert!(
        matches!(again, Ok(Charged { allowed: true, .. })),
        "{again:?}"
    );
    let records = all_records(&store, &table);
    for id in ids {
        let held: Vec<_> = records.iter().filter(|(_, r)| r.id == id).collect();
        assert_eq!(held.len(), 1, "{id}: {held:?}");
    }
    // Interfering with every write in turn never leaves a key twice.
    for victim in 0..2 {
        store.interfere_once.replace(Some(table.group_key(victim)));
        let more: Vec<String> = (0..2).map(|n| format!("p:new-{victim}-{n}")).collect();
        let more_charges: Vec<Charge<'_>> = more
            .iter()
            .map(|id| Charge {
                bucket_id: id,
                limits: &l,
                cost: 1,
            })
            .collect();
        let _ = table.charge(&store, &more_charges, 0);
        let records = all_records(&store, &table);
        for id in ids.iter().copied().chain(more.iter().map(String::as_str)) {
            assert!(
                records.iter().filter(|(_, r)| r.id == id).count() <= 1,
                "{id}"
            );
        }
    }
}

/// Two workers on one store, each operation granted in turn by a scheduler, so a test can run
/// every interleaving of their shared-data calls.
mod interleave {
    use super::*;
    use std::sync::{Arc, Condvar, Mutex};

    #[derive(Default)]
    struct Turns {
        turn: Option<usize>,
        waiting: [bool; 2],
        done: [bool; 2],
        /// (worker, is a write) of every operation, in order.
        log: Vec<(usize, bool)>,
    }

    pub struct Shared {
        store: Mutex<(MemorySharedData, Turns)>,
        changed: Condvar,
    }

    pub struct Gate {
        shared: Arc<Shared>,
        me: usize,
    }

    impl Gate {
        fn op<R>(&self, write: bool, f: impl FnOnce(&MemorySharedData) -> R) -> R {
            let mut state = self.shared.store.lock().unwrap();
            state.1.waiting[self.me] = true;
            self.shared.changed.notify_all();
            while state.1.turn != Some(self.me) {
                state = self.shared.changed.wait(state).unwrap();
            }
            let result = f(&state.0);
            state.1.log.push((self.me, write));
            state.1.turn = None;
            state.1.waiting[self.me] = false;
            self.shared.changed.notify_all();
            result
        }
    }

    impl SharedData for Gate {
        fn get(
            &self,
            key: &str,
        ) -> Result<(Option<Vec<u8>>, Option<u32>), crate::shared::ReadError> {
            self.op(false, |s| s.get(key))
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), WriteError> {
            self.op(true, |s| s.set(key, value, cas))
        }
    }

    pub struct Run<T> {
        /// Per operation: the worker that ran it and the workers that could have.
        pub choices: Vec<(usize, Vec<usize>)>,
        pub log: Vec<(usize, bool)>,
        pub results: [T; 2],
        pub store: MemorySharedData,
    }

    /// Runs `work(gate, worker)` on two threads over `store`, choosing who goes next by
    /// `prefix`, then the worker that ran last while it can.
    pub fn run<T: Send + 'static>(
        store: MemorySharedData,
        prefix: &[usize],
        work: impl Fn(&Gate, usize) -> T + Send + Sync + 'static,
    ) -> Run<T> {
        let shared = Arc::new(Shared {
            store: Mutex::new((store, Turns::default())),
            changed: Condvar::new(),
        });
        let work = Arc::new(work);
        let handles: Vec<_> = (0..2)
            .map(|me| {
                let shared = Arc::clone(&shared);
                let work = Arc::clone(&work);
                std::thread::spawn(move || {
                    let gate = Gate {
                        shared: Arc::clone(&shared),
                        me,
                    };
                    let result = work(&gate, me);
                    let mut state = shared.store.lock().unwrap();
                    state.1.done[me] = true;
                    shared.changed.notify_all();
                    result
                })
            })
            .collect();
        let mut choices = Vec::new();
        loop {
            let mut state = shared.store.lock().unwrap();
            while !(state.1.turn.is_none() && (0..2).all(|w| state.1.waiting[w] || state.1.done[w]))
            {
                state = shared.changed.wait(state).unwrap();
            }
            let runnable: Vec<usize> = (0..2).filter(|w| state.1.waiting[*w]).collect();
            let Some(&first) = runnable.first() else {
                break;
            };
            // Past the prefix, the worker that ran last goes on while it can (no preemption).
            let last = choices.last().map(|c: &(usize, Vec<usize>)| c.0);
            let keep = last.filter(|w| runnable.contains(w)).unwrap_or(first);
            let chosen = prefix.get(choices.len()).copied().unwrap_or(keep);
            assert!(runnable.contains(&chosen), "a replay diverged");
            choices.push((chosen, runnable));
            state.1.turn = Some(chosen);
            shared.changed.notify_all();
        }
        let mut results = handles.into_iter().map(|h| h.join().unwrap());
        let results = [results.next().unwrap(), results.next().unwrap()];
        let (store, turns) = Arc::try_unwrap(shared)
            .ok()
            .unwrap()
            .store
            .into_inner()
            .unwrap();
        Run {
            choices,
            log: turns.log,
            results,
            store,
        }
    }

    /// Every interleaving of the two workers with at most `preemptions` switches away from a
    /// worker that could have gone on (depth-first over the scheduler's choices; bounding
    /// preemptions keeps the search finite while covering every overlap of two transactions:
    /// both reading before either writes takes two). Calls `check` on each run and returns how
    /// many there were.
    pub fn explore<T: Send + 'static>(
        setup: impl Fn() -> MemorySharedData,
        work: impl Fn(&Gate, usize) -> T + Send + Sync + Clone + 'static,
        preemptions: usize,
        mut check: impl FnMut(&Run<T>),
    ) -> usize {
        let mut pending: Vec<Vec<usize>> = vec![Vec::new()];
        let mut runs = 0;
        while let Some(prefix) = pending.pop() {
            let run = run(setup(), &prefix, work.clone());
            runs += 1;
            let mut used = 0;
            for (step, (chosen, runnable)) in run.choices.iter().enumerate() {
                let last = step.checked_sub(1).map(|s| run.choices[s].0);
                let preempts = |w: usize| last.is_some_and(|l| l != w && runnable.contains(&l));
                if step >= prefix.len() && used + usize::from(preempts(1 - chosen)) <= preemptions {
                    for other in runnable.iter().filter(|w| *w != chosen) {
                        let mut next: Vec<usize> =
                            run.choices[..step].iter().map(|c| c.0).collect();
                        next.push(*other);
                        pending.push(next);
                    }
                }
                used += usize::from(preempts(*chosen));
            }
            check(&run);
        }
        runs
    }
}

#[test]
fn two_workers_inserting_one_new_key_create_it_once_in_every_interleaving() {
    // A region of four groups: every key has all four as candidates. The new key's candidates
    // are prepared so that the two workers, deciding at different times, choose different
    // groups: the first (at 100 ms) sees its first candidate with one free slot and takes the
    // second, which has two; the second (at 200 ms) sees the first candidate's records
    // evictable and takes it. Only the confirming writes keep them from inserting it twice.
    let seed_store = MemorySharedData::default();
    let table = open(&seed_store, 16);
    let key = "p:new";
    let order = table.candidates(key);
    assert_eq!(order.len(), 4);
    let filler = |name: &str, until: u64| {
        let mut r = Record::fresh(name);
        r.evictable_at_ms = until;
        Some(r)
    };
    let prepared: Vec<(u32, Vec<Option<Record>>)> = vec![
        (
            order[0],
            vec![
                filler("p:f0", 150),
                filler("p:f1", 150),
                filler("p:f2", 150),
                None,
            ],
        ),
        (
            order[1],
            vec![
                filler("p:f3", u64::MAX),
                None,
                filler("p:f4", u64::MAX),
                None,
            ],
        ),
        (
            order[2],
            (0..4)
                .map(|i| filler(&format!("p:g{i}"), u64::MAX))
                .collect(),
        ),
        (
            order[3],
            (0..4)
                .map(|i| filler(&format!("p:h{i}"), u64::MAX))
                .collect(),
        ),
    ];
    let setup = {
        let table = table.clone();
        move || {
            let store = MemorySharedData::default();
            let _ = SlotTable::open(&store, "tollgate/test/", 16, 7).unwrap();
            for (group, slots) in &prepared {
                store
                    .set(&table.group_key(*group), &encode_group(slots), None)
                    .unwrap();
            }
            store
        }
    };
    for times in [[100, 200], [200, 100], [100, 100]] {
        let work = {
            let table = table.clone();
            move |gate: &interleave::Gate, worker: usize| {
                let l = limits(10);
                let charge = [Charge {
                    bucket_id: key,
                    limits: &l,
                    cost: 1,
                }];
                table.charge(gate, &charge, times[worker])
            }
        };
        let mut overlapping = 0;
        let runs = interleave::explore(setup.clone(), work, 3, |run| {
            for result in &run.results {
                assert!(
                    matches!(result, Ok(Charged { allowed: true, .. })),
                    "{result:?}"
                );
            }
            let records = all_records(&run.store, &table);
            let held: Vec<_> = records.iter().filter(|(_, r)| r.id == key).collect();
            assert_eq!(held.len(), 1, "{times:?} {:?}: {held:?}", run.log);
            // Both charges landed on the one record.
            let tokens = held[0].1.bucket.unwrap().tokens;
            assert!((tokens - 8.0).abs() < 0.01, "tokens {tokens}");
            // No live filler was evicted.
            for (_, r) in &records {
                if r.id != key {
                    assert!(r.evictable_at_ms == 150 || r.evictable_at_ms == u64::MAX);
                }
            }
            let live = records
                .iter()
                .filter(|(_, r)| r.evictable_at_ms == u64::MAX)
                .count();
            assert_eq!(live, 10);
            // The dangerous case: both read every candidate before either wrote.
            let first_write = run.log.iter().position(|(_, w)| *w).unwrap_or(0);
            let reads = |w| {
                run.log[..first_write]
                    .iter()
                    .filter(|(who, _)| *who == w)
                    .count()
            };
            if reads(0) >= 4 && reads(1) >= 4 {
                overlapping += 1;
            }
        });
        println!("{times:?}: {runs} interleavings, {overlapping} with both reads before any write");
        assert!(overlapping > 0);
    }
}

/// Groups of the table the placement tests fill, and ids they place.
const SPREAD_GROUPS: u32 = 64;
const SPREAD_IDS: usize = 2048;

/// The most ids any group receives as a first candidate, and as any candidate.
fn most_per_group(table: &SlotTable, ids: &[String]) -> (usize, usize) {
    let mut first = vec![0usize; SPREAD_GROUPS as usize];
    let mut any = vec![0usize; SPREAD_GROUPS as usize];
    for id in ids {
        let candidates = table.candidates(id);
        first[candidates[0] as usize] += 1;
        for g in candidates {
            any[g as usize] += 1;
        }
    }
    (
        first.into_iter().max().unwrap_or(0),
        any.into_iter().max().unwrap_or(0),
    )
}

/// The bound a group's load stays within, whatever ids a client chose without the salt:
/// twice its fair share plus 8 (the fair share of 2048 ids over 64 groups is 32 as first
/// candidate, 128 as any of four; the binomial spread around it is 5.6 and 11, so the bound
/// is over 5 standard deviations away).
fn spread_bound(fair: usize) -> usize {
    2 * fair + 8
}

fn spread_table(seed: u64) -> SlotTable {
    let store = MemorySharedData::default();
    SlotTable::open(&store, "t/", SPREAD_GROUPS * GROUP_SLOTS as u32, seed)
        .unwrap()
        .partitioned(["p"])
}

#[test]
fn ids_aimed_with_a_guessed_salt_do_not_concentrate() {
    // A client that computes placement under a salt it guessed (here: it knows the algorithm
    // and picks ids whose first candidate is group 0 under that salt) aims at nothing under
    // the instance's real salt.
    let guessed = spread_table(1);
    let real = spread_table(2);
    let aimed: Vec<String> = (0u64..)
        .map(|i| format!("p:tenant-{i}"))
        .filter(|id| guessed.candidates(id)[0] == 0)
        .take(SPREAD_IDS / 2)
        .collect();
    let (first, _) = most_per_group(&guessed, &aimed);
    assert_eq!(first, aimed.len(), "the aim works under the guessed salt");
    let fair_first = aimed.len() / SPREAD_GROUPS as usize;
    let (first, any) = most_per_group(&real, &aimed);
    assert!(first <= spread_bound(fair_first), "first {first}");
    assert!(any <= spread_bound(4 * fair_first), "any {any}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Whatever family of ids a client sends (a common prefix, counters, a fixed suffix, ids
    /// one byte apart), under any salt no group receives more than [`spread_bound`] of them.
    #[test]
    fn hostile_id_sets_cannot_concentrate_keys(
        seed in proptest::prelude::any::<u64>(),
        prefix in "[a-z%:!#]{0,40}",
        suffix in "[a-z0-9]{0,8}",
        stride in 1u64..1_000_000,
    ) {
        let table = spread_table(seed);
        let ids: Vec<String> = (0..SPREAD_IDS as u64)
            .map(|i| format!("p:{prefix}{}{suffix}", i * stride))
            .collect();
        let fair = SPREAD_IDS / SPREAD_GROUPS as usize;
        let (first, any) = most_per_group(&table, &ids);
        proptest::prop_assert!(first <= spread_bound(fair), "first {}", first);
        proptest::prop_assert!(any <= spread_bound(4 * fair), "any {}", any);
    }
}

#[test]
fn a_write_changes_only_its_slot_and_copies_the_others_as_read() {
    // A group holding the key's record, a record of an older layout (tag 1, reads as empty)
    // and another key's record: charging the key re-encodes its slot only; the other slots'
    // bytes are written back exactly as read.
    let store = MemorySharedData::default();
    let table = open(&store, 16);
    let key = "p:k";
    let group = table.candidates(key)[0];
    let l = limits(10);
    let mut other = Record::fresh("p:other");
    other.bucket = Some(BucketState {
        tokens: 3.0,
        updated_ms: 5,
    });
    other.evictable_at_ms = u64::MAX;
    let old_layout: &[u8] = &[1, 1, 0, b'x', 0, 0, 0, 0, 0, 0, 0, 0];
    let mut before = vec![TAG_GROUP];
    push_entry(&mut before, Some(&Record::fresh(key)));
    before.extend_from_slice(&(old_layout.len() as u16).to_le_bytes());
    before.extend_from_slice(old_layout);
    push_entry(&mut before, Some(&other));
    push_entry(&mut before, None);
    store.set(&table.group_key(group), &before, None).unwrap();
    let charge = [Charge {
        bucket_id: key,
        limits: &l,
        cost: 1,
    }];
    assert!(table.charge(&store, &charge, 1_000).unwrap().allowed);
    let (after, _) = store.get(&table.group_key(group)).unwrap();
    let after = after.unwrap();
    let spans = (slot_spans(&before), slot_spans(&after));
    for slot in 1..GROUP_SLOTS {
        let bytes = |raw: &[u8], spans: &[Option<std::ops::Range<usize>>; GROUP_SLOTS]| {
            spans[slot].clone().map(|s| raw[s].to_vec())
        };
        assert_eq!(bytes(&before, &spans.0), bytes(&after, &spans.1), "{slot}");
    }
    let slots = decode_group(&after);
    assert_eq!(slots[0].as_ref().unwrap().bucket.unwrap().tokens, 9.0);
    assert_eq!(slots[1], None);
    assert_eq!(slots[2], Some(other));
    assert_eq!(slots[3], None);
}

#[test]
fn a_reload_that_moves_keys_keeps_or_restarts_each_keys_state_never_mixes_it() {
    // The same shared data under the table of a new configuration (one more policy: `p`'s
    // region moves), while workers of the old configuration still run: each table finds a key
    // by its exact id, so a key either keeps its record or starts a fresh one, and every unit
    // charged is in exactly one record of that key.
    let store = MemorySharedData::default();
    let old = open(&store, 256).partitioned(["p"]);
    let new = open(&store, 256).partitioned(["q", "p"]);
    let l = limits(100);
    let keys: Vec<String> = (0..40).map(|i| format!("p:t{i}")).collect();
    let cost = |i: usize| (i % 7) as u64 + 1;
    let mut charged = vec![0u64; keys.len()];
    let charge = |table: &SlotTable, i: usize, now| {
        let c = [Charge {
            bucket_id: &keys[i],
            limits: &l,
            cost: cost(i),
        }];
        assert!(table.charge(&store, &c, now).unwrap().allowed);
    };
    for (i, total) in charged.iter_mut().enumerate() {
        charge(&old, i, 1_000);
        *total += cost(i);
    }
    let (mut kept, mut fresh) = (0, 0);
    for (round, now) in [2_000u64, 3_000, 4_000].into_iter().enumerate() {
        for (i, total) in charged.iter_mut().enumerate() {
            // Live traffic on both configurations, in turn.
            let table = if (i + round) % 2 == 0 { &new } else { &old };
            if round == 0 {
                let found = table
                    .transact(
                        StoreAt::new(&store, now),
                        &[keys[i].as_str()],
                        |r| Txn::Abort(r[0].bucket.is_some()),
                        |_, _, _, _| {},
                    )
                    .unwrap()
                    .value;
                if found {
                    kept += 1;
                } else {
                    fresh += 1;
                }
            }
            charge(table, i, now);
            *total += cost(i);
        }
    }
    assert!(kept > 0 && fresh > 0, "kept {kept}, fresh {fresh}");
    each_key_holds_what_it_was_charged(&all_records(&store, &new), &keys, &charged);
}

/// After a reload with live traffic on both layouts: every key has one or two records (kept,
/// or left behind and started fresh), whose units spent (of a bucket of 100) add up to what
/// the key was charged. Returns how many keys hold two (moved by the new layout).
fn each_key_holds_what_it_was_charged(
    records: &[(u32, Record)],
    keys: &[String],
    charged: &[u64],
) -> usize {
    let mut moved = 0;
    for (key, charged) in keys.iter().zip(charged) {
        let held: Vec<_> = records.iter().filter(|(_, r)| r.id == *key).collect();
        assert!(!held.is_empty() && held.len() <= 2, "{key}: {held:?}");
        moved += usize::from(held.len() == 2);
        let spent: f64 = held
            .iter()
            .map(|(_, r)| 100.0 - r.bucket.unwrap().tokens)
            .sum();
        assert!((spent - *charged as f64).abs() < 0.01, "{key}: {spent}");
    }
    moved
}

/// A record with every part set (bucket, lease, in-flight slots, counters, log).
fn record_with_every_part(id: &str) -> Record {
    let mut record = Record::fresh(id);
    record.bucket = Some(BucketState {
        tokens: 2.5,
        updated_ms: 9,
    });
    record.lease.tokens = 7;
    record.lease.prev_seq = 4;
    record.lease.debt = 3;
    record.in_flight.counts[0] = 2;
    record.counters = Some(Counters {
        window: 4,
        count: 5,
        previous: 6,
    });
    record.log = Some(Log {
        times: vec![1, 2, 3],
        seen_ms: 3,
    });
    record.evictable_at_ms = 11;
    record
}

#[test]
fn clone_from_copies_every_field() {
    let source = record_with_every_part("p:source");
    let mut target = Record::fresh("p:a-longer-id-whose-buffer-is-reused");
    target.log = Some(Log {
        times: vec![9; 10],
        seen_ms: 9,
    });
    target.clone_from(&source);
    assert_eq!(target, source);
    assert_eq!(source.clone(), source);
}

#[test]
fn decoding_into_a_kept_record_overwrites_every_field() {
    let full = record_with_every_part("p:full");
    let mut plain = Record::fresh("p:plain");
    plain.bucket = Some(BucketState {
        tokens: 1.0,
        updated_ms: 2,
    });
    // A kept record holding every part takes a record with few parts, and back.
    let mut kept = full.clone();
    assert_eq!(
        decode_into(&encode(&plain), Some("p:plain"), &mut kept),
        Some(())
    );
    assert_eq!(kept, plain);
    assert_eq!(decode_into(&encode(&full), None, &mut kept), Some(()));
    assert_eq!(kept, full);
    // A known id that differs from the bytes' is not taken: the bytes' id is.
    assert_eq!(
        decode_into(&encode(&plain), Some("p:other"), &mut kept),
        Some(())
    );
    assert_eq!(kept, plain);
    // Bytes of no record of this version are refused.
    let mut older = encode(&plain);
    older[0] = TAG_RECORD - 1;
    assert_eq!(decode_into(&older, Some("p:plain"), &mut kept), None);
    // A list reuses its dropped records: what it holds is what was pushed since `clear`.
    let mut list = RecordList::default();
    list.copy_from(&[full.clone(), plain.clone()]);
    assert_eq!(list.as_slice(), [full.clone(), plain.clone()]);
    list.clear();
    list.copy_from(std::slice::from_ref(&plain));
    assert_eq!(list.as_slice(), std::slice::from_ref(&plain));
    list.pop();
    assert!(list.as_slice().is_empty());
}

#[test]
fn group_names_built_in_a_kept_buffer_are_the_group_keys() {
    let store = MemorySharedData::default();
    let table = open(&store, 64);
    let mut name = String::from("a longer leftover name");
    for group in [0, 1, 9, 10, 15, 99, 100, 12345, u32::MAX] {
        table.group_name_into(group, &mut name);
        assert_eq!(name, table.group_key(group));
    }
}

#[test]
fn seeds_from_the_same_clock_differ() {
    // Two instances started at the same nanosecond with the same number still get different
    // salts: the seed's randomness is the operating system's, not the clock's.
    let seeds: std::collections::BTreeSet<u64> = (0..64).map(|_| unguessable_seed(42)).collect();
    assert_eq!(seeds.len(), 64);
    assert!(!seeds.contains(&42));
}

// The same table with its records typed in process memory (`Cells`): the shared-data store
// holds only the salt; the semantics above hold unchanged.

fn open_in_cells(
    store: &MemorySharedData,
    slots: u32,
    policies: &[&str],
) -> (SlotTable, Arc<Cells>) {
    let table = SlotTable::open_salted(store, "tollgate/test/", slots, 7)
        .unwrap()
        .partitioned(policies.iter().copied());
    let cells = Arc::new(Cells::new(table.groups_needed()));
    (table.in_cells(cells.clone()).unwrap(), cells)
}

#[test]
fn cells_hold_exact_capacity_and_decide_all_or_nothing() {
    let store = MemorySharedData::default();
    let (table, cells) = open_in_cells(&store, 64, &[]);
    assert_eq!(store.entries(), 1, "the store holds only the salt");
    exact_capacity_and_retry_after_on(&table, &store);
    all_or_nothing_on(&table, &store);
    assert_eq!(cells.records().len(), 3);
    assert_eq!(store.entries(), 1, "a record reached the store");
}

#[test]
fn cells_never_share_a_slot_and_hold_at_most_the_configured_records() {
    let store = MemorySharedData::default();
    let (table, cells) = open_in_cells(&store, 16, &[]);
    let (allowed, full) = fill_with_fresh_tenants(&table, &store);
    assert_eq!(allowed, 16);
    assert_eq!(full, 10_000 - 16);
    let records = cells.records();
    assert_eq!(records.len(), 16);
    let mut ids: Vec<_> = records.iter().map(|(_, r)| r.id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 16, "a key was created twice");
    // Each record is one typed value plus its id: no more than the slots' worth.
    let (held, bytes) = cells.footprint();
    assert_eq!(held, 16);
    assert!(
        bytes <= 16 * (std::mem::size_of::<Record>() + 16),
        "{bytes} bytes"
    );
}

#[test]
fn cells_evict_only_idle_records() {
    let store = MemorySharedData::default();
    let (table, _cells) = open_in_cells(&store, 16, &[]);
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
    let mut live = 0;
    for tenant in 0..1_000 {
        if charge(&format!("p:{tenant}"), 0).is_ok() {
            live += 1;
        }
    }
    assert_eq!(live, 16);
    assert_eq!(charge("p:new", 0), Err(TableError::Full));
    // 1 ms later the buckets are full again (idle), and one gives way.
    let later = charge("p:new", 5).unwrap();
    assert!(later.allowed);
    assert_eq!(later.evictions, 1);
    assert_eq!(charge("p:new", 5).unwrap().evictions, 0);
}

#[test]
fn cells_place_new_keys_of_one_transaction_each_once() {
    // 2 groups of 4: eight new keys in one transaction share every candidate.
    let store = MemorySharedData::default();
    let (table, cells) = open_in_cells(&store, 8, &[]);
    let ids: Vec<String> = (0..8).map(|i| format!("p:k{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let done = insert(&table, &store, "unused:warm", 0, 0).unwrap();
    assert!(done.committed);
    // The warm record is idle: one of the eight takes its slot.
    let done = table
        .transact(
            StoreAt::new(&store, 0),
            &refs,
            |records| {
                for r in records.iter_mut() {
                    r.evictable_at_ms = 1_000;
                }
                Txn::Commit(())
            },
            |_, _, _, _| {},
        )
        .unwrap();
    assert_eq!(done.evictions, 1);
    let mut held: Vec<_> = cells.records().into_iter().map(|(_, r)| r.id).collect();
    held.sort();
    assert_eq!(held, ids);
    // A ninth live key finds no room; an aborted transaction writes nothing.
    assert_eq!(
        insert(&table, &store, "p:k8", 0, 1_000).map(|t| t.committed),
        Err(TableError::Full)
    );
    let aborted = table
        .transact(
            StoreAt::new(&store, 0),
            &refs,
            |_| Txn::Abort(()),
            |_, _, _, _| {},
        )
        .unwrap();
    assert!(!aborted.committed);
    assert_eq!(cells.records().len(), 8);
}

#[test]
fn cells_keep_workers_exact_and_never_deadlock() {
    // Four threads charge overlapping pairs of keys in opposite orders (locks are taken in
    // group order, whatever the order of the ids): every key admits exactly its burst.
    let store = MemorySharedData::default();
    let (table, cells) = open_in_cells(&store, 64, &["a", "b"]);
    let l = limits(300);
    let admitted: Vec<u64> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let (table, l) = (&table, &l);
                scope.spawn(move || {
                    // The cells hold the records; each worker has its own store handle.
                    let store = MemorySharedData::default();
                    let mut admitted = 0;
                    for i in 0..400 {
                        let (x, y) = (format!("a:k{}", i % 3), format!("b:k{}", (i + t) % 3));
                        let pair = [(x.as_str(), l), (y.as_str(), l)];
                        let order: Vec<_> = if t % 2 == 0 {
                            pair.to_vec()
                        } else {
                            pair.iter().rev().copied().collect()
                        };
                        let charges: Vec<_> = order
                            .iter()
                            .map(|(id, limits)| Charge {
                                bucket_id: id,
                                limits,
                                cost: 1,
                            })
                            .collect();
                        if table.charge(&store, &charges, 0).unwrap().allowed {
                            admitted += 1;
                        }
                    }
                    admitted
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Each pair takes one unit from an `a` key and one from a `b` key; 6 keys of 300 units.
    let total: u64 = admitted.iter().sum();
    let records = cells.records();
    assert_eq!(records.len(), 6);
    let spent: f64 = records
        .iter()
        .map(|(_, r)| 300.0 - r.bucket.unwrap().tokens)
        .sum();
    assert!(
        (spent - 2.0 * total as f64).abs() < 0.01,
        "{spent} vs {total}"
    );
    assert!(total <= 900, "{total}");
}

#[test]
fn a_panicking_decision_leaves_the_cells_as_they_were() {
    let store = MemorySharedData::default();
    let (table, cells) = open_in_cells(&store, 16, &[]);
    let l = limits(5);
    let charge = [Charge {
        bucket_id: "p:a",
        limits: &l,
        cost: 2,
    }];
    assert!(table.charge(&store, &charge, 0).unwrap().allowed);
    let before = cells.records();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        table.transact(
            StoreAt::new(&store, 0),
            &["p:a"],
            |records| -> Txn<()> {
                records[0].bucket = None;
                panic!("a decision's bug");
            },
            |_, _, _, _| {},
        )
    }));
    assert!(panicked.is_err());
    assert_eq!(cells.records(), before);
    assert!(table.charge(&store, &charge, 0).unwrap().allowed);
    assert!(
        !table.charge(&store, &charge, 0).unwrap().allowed,
        "3 of 5 taken, 2 left"
    );
}

#[test]
fn a_read_decision_writes_in_place_and_a_panicking_one_leaves_the_cells_as_they_were() {
    let store = MemorySharedData::default();
    let (table, cells) = open_in_cells(&store, 16, &[]);
    let take = |tokens: f64| {
        move |record: &mut Record| {
            record.bucket = Some(BucketState {
                tokens,
                updated_ms: 7,
            });
            record.evictable_at_ms = 9;
        }
    };
    // A new key goes through the general transaction; a found one is written in place.
    for tokens in [3.0, 1.0] {
        let done = table
            .transact_read(
                StoreAt::new(&store, 0),
                "p:a",
                |record| record.bucket.map(|b| b.tokens),
                |_, record| take(tokens)(record),
                |_, _, _, _| {},
            )
            .unwrap();
        assert!(done.committed);
        let (_, record) = &cells.records()[0];
        assert_eq!(record.bucket.map(|b| b.tokens), Some(tokens));
        assert_eq!(record.evictable_at_ms, 9);
    }
    let before = cells.records();
    assert_eq!(before.len(), 1, "one key, one record");
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        table.transact_read(
            StoreAt::new(&store, 0),
            "p:a",
            |_| -> () { panic!("a decision's bug") },
            |_, record| take(0.0)(record),
            |_, _, _, _| {},
        )
    }));
    assert!(panicked.is_err());
    assert_eq!(cells.records(), before);
    // The group's lock is usable after the panic.
    let read = table
        .transact_read(
            StoreAt::new(&store, 0),
            "p:a",
            |r| r.bucket,
            |_, _| {},
            |_, _, _, _| {},
        )
        .unwrap();
    assert_eq!(read.value.map(|b| b.tokens), Some(1.0));
}

#[test]
fn cells_shared_by_a_reload_keep_or_restart_each_keys_state_never_mix_it() {
    // An old and a new configuration (one more policy: `p`'s region moves) on the same cells,
    // both serving: each key keeps its record or starts fresh, and every unit charged is in
    // exactly one record of that key.
    let store = MemorySharedData::default();
    let (old, cells) = open_in_cells(&store, 256, &["p"]);
    let new = SlotTable::open_salted(&store, "tollgate/test/", 256, 99)
        .unwrap()
        .partitioned(["q", "p"])
        .in_cells(cells.clone())
        .unwrap();
    let l = limits(100);
    let keys: Vec<String> = (0..40).map(|i| format!("p:t{i}")).collect();
    let cost = |i: usize| (i % 7) as u64 + 1;
    let mut charged = vec![0u64; keys.len()];
    let charge = |table: &SlotTable, i: usize, now| {
        let c = [Charge {
            bucket_id: &keys[i],
            limits: &l,
            cost: cost(i),
        }];
        assert!(table.charge(&store, &c, now).unwrap().allowed);
    };
    for (i, total) in charged.iter_mut().enumerate() {
        charge(&old, i, 1_000);
        *total += cost(i);
    }
    for (round, now) in [2_000u64, 3_000].into_iter().enumerate() {
        for (i, total) in charged.iter_mut().enumerate() {
            let table = if (i + round) % 2 == 0 { &new } else { &old };
            charge(table, i, now);
            *total += cost(i);
        }
    }
    let moved = each_key_holds_what_it_was_charged(&cells.records(), &keys, &charged);
    assert!(
        moved > 0,
        "the new layout moved no key: the test shows nothing"
    );
    // Cells smaller than the table spans are refused.
    assert_eq!(
        open(&store, 256).in_cells(Arc::new(Cells::new(8))).err(),
        Some(TableError::Host)
    );
}
