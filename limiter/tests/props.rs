//! The Redis Function mirrors tollgate-core's bucket and assignment math exactly.
//!
//! Random sequences of leases (single and grouped, with repeated ids, with and without
//! holders and their demands), returns and short pauses run against a real Redis; after each
//! step the in-memory store (which runs tollgate-core's Rust code) replays the same step at
//! the very millisecond Redis reported (`TIME` inside the function), so refill, fill-ratio
//! sizing, EPSILON, clamping, debt, shares by demand, holdings (ordered by holder id, ended,
//! bounded), group atomicity, dedup and returns must agree bit for bit — `remaining` and
//! `share_per_ms` are compared as `f64` equality, not with a tolerance. After each step the
//! buckets it touched must also be stored identically: content, holdings and TTL.
//!
//! The `e2e` tier (it needs `redis-server`): built only with the feature.

// Test code: failing loudly is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::*;
use tollgate_limiter::store::{
    LeaseItem, MemoryStore, RedisSecurity, RedisStore, Store, StoreSettings,
};

/// Policies with rates fast enough that the milliseconds between steps matter.
const POLICIES: [&str; 5] = ["tenant", "fast", "tenth", "slowish", "route"];

/// Holder ids whose byte order differs from a locale's collation (case, `_`, `-`, digits),
/// so a store sorting holdings any other way than Rust does sums shares in another order.
const HOLDERS: [&str; 5] = ["a", "B", "_x", "-9", "Zz"];

/// Short assignments and leases, so holdings end between steps of one case.
fn prop_settings() -> StoreSettings {
    StoreSettings {
        dedup_ttl_ms: 60_000,
        assignment_period_ms: 12,
        lease_ttl_ms: 7,
    }
}

/// One lease item: policy index, tenant index, min, want, holder index (none: leases only),
/// demand in tenths of a unit per second.
type ItemOp = (usize, usize, u64, u64, Option<usize>, u32);

#[derive(Debug, Clone)]
enum Op {
    /// Items; several items form a group.
    Lease {
        id: u8,
        items: Vec<ItemOp>,
    },
    Return {
        id: u8,
        policy: usize,
        tenant: usize,
        unused: u64,
    },
    Pause {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let holder = prop_oneof![1 => Just(None), 3 => (0..HOLDERS.len()).prop_map(Some)];
    let demand = prop_oneof![1 => Just(0u32), 4 => 0..40_000u32];
    let item = (
        0..POLICIES.len(),
        0..2usize,
        1..=6u64,
        1..=12u64,
        holder,
        demand,
    );
    prop_oneof![
        6 => (0..12u8, prop::collection::vec(item, 1..=3)).prop_map(|(id, items)| Op::Lease { id, items }),
        2 => (0..12u8, 0..POLICIES.len(), 0..2usize, 0..=80u64)
            .prop_map(|(id, policy, tenant, unused)| Op::Return { id, policy, tenant, unused }),
        1 => prop_oneof![3 => 0..=4u64, 1 => 5..=15u64].prop_map(|ms| Op::Pause { ms }),
    ]
}

struct World {
    case: u64,
}

impl World {
    fn tenant(&self, t: usize) -> String {
        format!("pp{}-{}-{t}", std::process::id(), self.case)
    }

    /// Keys: the tenant itself, or `<tenant>:r` for the two-part route policy (same tag).
    fn key(&self, policy: usize, t: usize) -> String {
        if POLICIES.get(policy) == Some(&"route") {
            format!("{}:r", self.tenant(t))
        } else {
            self.tenant(t)
        }
    }

    /// Items as the service would pass them: `min` within the burst, `want` in `[min, burst]`.
    fn items(&self, id: u8, items: &[ItemOp]) -> Vec<LeaseItem> {
        // A group shares one hash tag: every item uses the first item's tenant.
        let tenant = items.first().map(|i| i.1).unwrap_or(0);
        items
            .iter()
            .enumerate()
            .map(|(n, &(policy, _, min, want, holder, demand))| {
                let name = POLICIES.get(policy).copied().unwrap_or("tenant");
                let burst = limits(name).capacity() as u64;
                let min = min.min(burst);
                LeaseItem {
                    holder: holder.and_then(|h| HOLDERS.get(h)).map(|h| (*h).to_owned()),
                    demand_per_ms: f64::from(demand) / 10.0 / 1_000.0,
                    ..lease(
                        &format!("i{id}-{n}"),
                        name,
                        &self.key(policy, tenant),
                        min,
                        want.clamp(min, burst),
                    )
                }
            })
            .collect()
    }
}

/// What the random steps exercised, over all cases (checked at the end, so the test cannot
/// silently stop reaching assignments).
struct Seen {
    shares: AtomicU64,
    waits: AtomicU64,
    debts: AtomicU64,
    renewals: AtomicU64,
}

static SEEN: Seen = Seen {
    shares: AtomicU64::new(0),
    waits: AtomicU64::new(0),
    debts: AtomicU64::new(0),
    renewals: AtomicU64::new(0),
};

fn count(items: &[LeaseItem], grants: &[tollgate_limiter::store::Grant]) {
    for (item, g) in items.iter().zip(grants) {
        if g.replayed {
            continue;
        }
        if g.share_per_ms > 0.0 {
            SEEN.shares.fetch_add(1, Ordering::Relaxed);
        } else if item.holder.is_some() && g.granted < item.want {
            SEEN.waits.fetch_add(1, Ordering::Relaxed);
        }
        if g.remaining < 0.0 {
            SEEN.debts.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Counts items whose holder has a running share on the item's bucket (a renewal gives its
/// undripped rest back).
fn count_renewals(items: &[LeaseItem], memory: &MemoryStore, now_ms: u64) {
    for item in items {
        let Some(holder) = &item.holder else {
            continue;
        };
        let running = peek_memory(memory, &item.bucket_key(), Some(now_ms))
            .and_then(|p| p.holding(holder).map(|h| h.share_per_ms > 0.0))
            .unwrap_or(false);
        if running {
            SEEN.renewals.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The buckets `keys` must be stored alike: content, live holdings, and a TTL Redis counts
/// down from the memory store's (since the call that started at `called`).
fn same_buckets(
    memory: &MemoryStore,
    keys: &[String],
    now_ms: u64,
    called: Instant,
) -> Result<(), TestCaseError> {
    for key in keys {
        let from_memory = peek_memory(memory, key, Some(now_ms));
        let from_redis = peek_redis(shared_redis(), key).map(|p| p.live_at(now_ms));
        let waited_ms = called.elapsed().as_millis() as u64 + 1;
        match (from_memory, from_redis) {
            (None, None) => {}
            (Some(m), Some(r)) => {
                prop_assert_eq!(m.state, r.state, "{} content", key);
                prop_assert_eq!(&m.holdings, &r.holdings, "{} holdings", key);
                match (m.ttl_ms, r.ttl_ms) {
                    (None, None) => {}
                    (Some(m_ttl), Some(r_ttl)) => prop_assert!(
                        r_ttl <= m_ttl + 1 && r_ttl + waited_ms + 1 >= m_ttl,
                        "{}: PTTL {} vs memory TTL {} ({} ms later)",
                        key,
                        r_ttl,
                        m_ttl,
                        waited_ms
                    ),
                    (m_ttl, r_ttl) => {
                        prop_assert!(false, "{}: TTL {:?} vs PTTL {:?}", key, m_ttl, r_ttl)
                    }
                }
            }
            (m, r) => prop_assert!(false, "{}: memory {:?}, Redis {:?}", key, m, r),
        }
    }
    Ok(())
}

async fn run(redis: &RedisStore, case: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let world = World { case };
    let memory = MemoryStore::new(prop_settings());
    for (step, op) in ops.iter().enumerate() {
        let called = Instant::now();
        match op {
            Op::Lease { id, items } => {
                let items = world.items(*id, items);
                let from_redis = redis
                    .lease(&items)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("redis: {e}")))?;
                count_renewals(&items, &memory, from_redis.now_ms);
                let from_memory = memory
                    .lease_at(&items, from_redis.now_ms)
                    .map_err(|e| TestCaseError::fail(format!("memory: {e}")))?;
                prop_assert_eq!(
                    &from_redis,
                    &from_memory,
                    "step {} {:?}: Redis and core disagree",
                    step,
                    op
                );
                count(&items, &from_redis.grants);
                // The buckets this step wrote (replays write nothing).
                let keys: Vec<String> = items
                    .iter()
                    .zip(&from_redis.grants)
                    .filter(|(_, g)| !g.replayed)
                    .map(|(item, _)| item.bucket_key())
                    .collect();
                same_buckets(&memory, &keys, from_redis.now_ms, called)
                    .map_err(|e| TestCaseError::fail(format!("step {step} {op:?}: {e}")))?;
            }
            Op::Return {
                id,
                policy,
                tenant,
                unused,
            } => {
                let name = POLICIES.get(*policy).copied().unwrap_or("tenant");
                let item = give_back(
                    &format!("i{id}-0"),
                    name,
                    &world.key(*policy, *tenant),
                    *unused,
                );
                let from_redis = redis
                    .give_back(&item)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("redis: {e}")))?;
                let from_memory = memory.give_back_at(&item, from_redis.now_ms);
                prop_assert_eq!(from_redis, from_memory, "step {} {:?}", step, op);
                if from_redis.returned > 0 {
                    same_buckets(&memory, &[item.bucket_key()], from_redis.now_ms, called)
                        .map_err(|e| TestCaseError::fail(format!("step {step} {op:?}: {e}")))?;
                }
            }
            Op::Pause { ms } => tokio::time::sleep(Duration::from_millis(*ms)).await,
        }
    }
    Ok(())
}

#[test]
fn redis_function_matches_core_bucket_math() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let url = shared_redis().url();
    let redis = rt.block_on(async {
        let s =
            RedisStore::new(&url, &RedisSecurity::default(), prop_settings()).expect("redis store");
        s.ready().await.expect("redis ready");
        s
    });
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(96);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let case = AtomicU64::new(0);
    let result = runner.run(&prop::collection::vec(op(), 1..40), |ops| {
        rt.block_on(run(&redis, case.fetch_add(1, Ordering::Relaxed), ops))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let seen = [
        ("shares", SEEN.shares.load(Ordering::Relaxed)),
        ("waits", SEEN.waits.load(Ordering::Relaxed)),
        ("debts", SEEN.debts.load(Ordering::Relaxed)),
        ("renewals", SEEN.renewals.load(Ordering::Relaxed)),
    ];
    println!("{cases} cases exercised {seen:?}");
    for (what, n) in seen {
        assert!(n > 0, "no {what} in {cases} cases: {seen:?}");
    }
}
