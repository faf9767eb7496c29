//! The Redis Function mirrors tollgate-core's bucket math exactly.
//!
//! Random sequences of leases (single and grouped, with repeated ids), returns and short
//! pauses run against a real Redis; after each step the in-memory store (which runs
//! tollgate-core's Rust code) replays the same step at the very millisecond Redis reported
//! (`TIME` inside the function), so refill, fill-ratio sizing, EPSILON, clamping, group
//! atomicity, dedup and returns must agree bit for bit — `remaining` is compared as `f64`
//! equality, not with a tolerance.

// Test code: failing loudly is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::*;
use tollgate_limiter::store::{LeaseItem, MemoryStore, RedisStore, Store};

/// Policies with rates fast enough that the milliseconds between steps matter.
const POLICIES: [&str; 5] = ["tenant", "fast", "tenth", "slowish", "route"];

#[derive(Debug, Clone)]
enum Op {
    /// Items: (policy index, tenant index, min, want); several items form a group.
    Lease {
        id: u8,
        items: Vec<(usize, usize, u64, u64)>,
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
    let item = (0..POLICIES.len(), 0..2usize, 1..=6u64, 1..=12u64);
    prop_oneof![
        5 => (0..6u8, prop::collection::vec(item, 1..=3)).prop_map(|(id, items)| Op::Lease { id, items }),
        2 => (0..6u8, 0..POLICIES.len(), 0..2usize, 0..=12u64)
            .prop_map(|(id, policy, tenant, unused)| Op::Return { id, policy, tenant, unused }),
        1 => (0..=4u64).prop_map(|ms| Op::Pause { ms }),
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
    fn items(&self, id: u8, items: &[(usize, usize, u64, u64)]) -> Vec<LeaseItem> {
        // A group shares one hash tag: every item uses the first item's tenant.
        let tenant = items.first().map(|i| i.1).unwrap_or(0);
        items
            .iter()
            .enumerate()
            .map(|(n, &(policy, _, min, want))| {
                let name = POLICIES.get(policy).copied().unwrap_or("tenant");
                let burst = limits(name).capacity() as u64;
                let min = min.min(burst);
                lease(
                    &format!("i{id}-{n}"),
                    name,
                    &self.key(policy, tenant),
                    min,
                    want.clamp(min, burst),
                )
            })
            .collect()
    }
}

async fn run(redis: &RedisStore, case: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let world = World { case };
    let memory = MemoryStore::new(settings());
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Lease { id, items } => {
                let items = world.items(*id, items);
                let from_redis = redis
                    .lease(&items)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("redis: {e}")))?;
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
        let s = RedisStore::new(&url, settings()).expect("redis store");
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
}
