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
//! The windows get the same treatment (`redis_functions_match_core_window_math`): short fixed,
//! sliding and log windows, alone and grouped with token buckets, against tollgate-core's
//! `window` math at Redis' millisecond: answers (`remaining`, `retry_after_ms`, the window's
//! `expires_ms`) and stored state (counts, windows, logged times, the time a log has seen, TTLs).
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
use tollgate_core::policy::Algorithm;
use tollgate_core::window::{Counters, Log, Window};
use tollgate_limiter::store::{
    fixed_count_key, log_seen_key, LeaseItem, MemoryStore, RedisSecurity, RedisStore, Store,
    StoreSettings, WindowState,
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
        until_ready(&s, "redis ready").await;
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

/// Windows for the window property test: short, so sequences of a few dozen steps cross their
/// boundaries (limits: fixed 5, sliding 7, log 6 units).
fn prop_windows() -> [(&'static str, Algorithm); 3] {
    let w = |limit, ms| Window::new(limit, ms).expect("window");
    [
        ("pw-fixed", Algorithm::FixedWindow(w(5, 20))),
        ("pw-sliding", Algorithm::SlidingWindow(w(7, 30))),
        ("pw-log", Algorithm::SlidingLog(w(6, 25))),
    ]
}

/// Policies of the window property test: the three windows, then two token buckets (groups
/// mix them).
const WINDOW_POLICIES: usize = 5;

/// One lease item of the window test: policy index, min, want.
type WindowItemOp = (usize, u64, u64);

#[derive(Debug, Clone)]
enum WindowOp {
    /// Items of one tenant; several items form a group.
    Lease {
        id: u8,
        tenant: usize,
        items: Vec<WindowItemOp>,
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

fn window_op() -> impl Strategy<Value = WindowOp> {
    let item = (0..WINDOW_POLICIES, 1..=7u64, 1..=9u64);
    prop_oneof![
        6 => (0..10u8, 0..2usize, prop::collection::vec(item, 1..=3))
            .prop_map(|(id, tenant, items)| WindowOp::Lease { id, tenant, items }),
        1 => (0..10u8, 0..WINDOW_POLICIES, 0..2usize, 0..=9u64)
            .prop_map(|(id, policy, tenant, unused)| WindowOp::Return { id, policy, tenant, unused }),
        2 => prop_oneof![2 => 0..=4u64, 1 => 5..=25u64].prop_map(|ms| WindowOp::Pause { ms }),
    ]
}

/// Item `policy` of the window test for `key`, as the service would pass it (`min` within the
/// limit or burst, `want` in `[min, it]`).
fn window_item(id: &str, policy: usize, key: &str, min: u64, want: u64) -> LeaseItem {
    let (name, algorithm) = match prop_windows().get(policy) {
        Some((name, algorithm)) => (*name, Some(*algorithm)),
        None => (if policy == 3 { "fast" } else { "slowish" }, None),
    };
    let most = match algorithm.as_ref().and_then(Algorithm::window) {
        Some(w) => w.limit,
        None => limits(name).capacity() as u64,
    };
    let min = min.min(most);
    match algorithm {
        // The windows are not in the test document: their items carry their algorithm.
        Some(algorithm) => LeaseItem {
            policy: name.into(),
            algorithm,
            ..lease(id, "tenant", key, min, want.clamp(min, most))
        },
        None => lease(id, name, key, min, want.clamp(min, most)),
    }
}

/// A window's state in Redis, in the memory store's terms (`None`: no state): the fixed
/// window's newest index and its count, the sliding counter's hash, the log's units and the
/// time it has seen; with the PTTL of its state key.
fn redis_window(item: &LeaseItem) -> Option<(WindowState, u64)> {
    let redis = shared_redis();
    let key = item.state_key();
    let pttl = |k: &str| u64::try_from(redis.cmd(&["PTTL", k]).as_int().unwrap_or(-2)).ok();
    let int = |k: &str| redis.cmd(&["GET", k]).as_int().map(|i| i as u64);
    let state = match item.algorithm {
        Algorithm::FixedWindow(_) => {
            let window = int(&key)?;
            let count = int(&fixed_count_key(&key, window)).unwrap_or(0);
            WindowState::Counters(Counters {
                window,
                count,
                previous: 0,
            })
        }
        Algorithm::SlidingWindow(_) => {
            let f = redis.cmd(&["HMGET", &key, "w", "c", "p"]);
            let f: Vec<Option<u64>> = f
                .as_array()?
                .iter()
                .map(|v| v.as_int().map(|i| i as u64))
                .collect();
            WindowState::Counters(Counters {
                window: f[0]?,
                count: f[1]?,
                previous: f[2]?,
            })
        }
        Algorithm::SlidingLog(_) => {
            let seen_ms = int(&log_seen_key(&key))?;
            let units = redis
                .cmd(&["ZRANGE", &key, "0", "-1", "WITHSCORES"])
                .to_text();
            let times = units
                .lines()
                .skip(1)
                .step_by(2)
                .map(|t| t.parse().unwrap())
                .collect();
            // Both expire at the very same millisecond.
            let expires_at = |k: &str| redis.cmd(&["PEXPIRETIME", k]).as_int();
            assert_eq!(
                expires_at(&key),
                expires_at(&log_seen_key(&key)),
                "{key}: one expiry for the log"
            );
            WindowState::Log(Log { times, seen_ms })
        }
        Algorithm::TokenBucket => return None,
    };
    Some((state, pttl(&key)?))
}

/// The windows `items` touched must be stored alike (a fixed window's `previous` is not
/// stored in Redis: it never counts), with a TTL Redis counts down from the memory store's.
fn same_windows(
    memory: &MemoryStore,
    items: &[LeaseItem],
    now_ms: u64,
    called: Instant,
) -> Result<(), TestCaseError> {
    for item in items
        .iter()
        .filter(|i| i.algorithm != Algorithm::TokenBucket)
    {
        let key = item.state_key();
        let fixed = matches!(item.algorithm, Algorithm::FixedWindow(_));
        let from_memory = memory
            .window_view_at(&key, now_ms)
            .map(|(state, ttl)| match state {
                WindowState::Counters(c) if fixed => {
                    (WindowState::Counters(Counters { previous: 0, ..c }), ttl)
                }
                other => (other, ttl),
            });
        let from_redis = redis_window(item);
        let waited_ms = called.elapsed().as_millis() as u64 + 1;
        match (from_memory, from_redis) {
            (None, None) => {}
            (Some((m, m_ttl)), Some((r, r_ttl))) => {
                prop_assert_eq!(&m, &r, "{} state", key);
                prop_assert!(
                    r_ttl <= m_ttl + 1 && r_ttl + waited_ms + 1 >= m_ttl,
                    "{}: PTTL {} vs memory TTL {} ({} ms later)",
                    key,
                    r_ttl,
                    m_ttl,
                    waited_ms
                );
            }
            (m, r) => prop_assert!(false, "{}: memory {:?}, Redis {:?}", key, m, r),
        }
    }
    Ok(())
}

/// What the window steps exercised (checked at the end).
static WINDOW_SEEN: [AtomicU64; 4] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

async fn run_windows(
    redis: &RedisStore,
    case: u64,
    ops: Vec<WindowOp>,
) -> Result<(), TestCaseError> {
    let tenant = |t: usize| format!("pw{}-{case}-{t}", std::process::id());
    let memory = MemoryStore::new(prop_settings());
    for (step, op) in ops.iter().enumerate() {
        let called = Instant::now();
        match op {
            WindowOp::Lease {
                id,
                tenant: t,
                items,
            } => {
                let items: Vec<LeaseItem> = items
                    .iter()
                    .enumerate()
                    .map(|(n, &(policy, min, want))| {
                        window_item(&format!("w{id}-{n}"), policy, &tenant(*t), min, want)
                    })
                    .collect();
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
                for (item, g) in items.iter().zip(&from_redis.grants) {
                    if item.algorithm == Algorithm::TokenBucket || g.replayed {
                        continue;
                    }
                    let seen = if g.granted > 0 {
                        0
                    } else if g.retry_after_ms > 0 {
                        1
                    } else {
                        2
                    };
                    WINDOW_SEEN[seen].fetch_add(1, Ordering::Relaxed);
                    if items.len() > 1 {
                        WINDOW_SEEN[3].fetch_add(1, Ordering::Relaxed);
                    }
                }
                same_windows(&memory, &items, from_redis.now_ms, called)
                    .map_err(|e| TestCaseError::fail(format!("step {step} {op:?}: {e}")))?;
            }
            WindowOp::Return {
                id,
                policy,
                tenant: t,
                unused,
            } => {
                let lease = window_item(&format!("w{id}-0"), *policy, &tenant(*t), 1, 1);
                let item = tollgate_limiter::store::ReturnItem {
                    id: lease.id,
                    policy: lease.policy,
                    key: lease.key,
                    limits: lease.limits,
                    algorithm: lease.algorithm,
                    unused: *unused,
                };
                let from_redis = redis
                    .give_back(&item)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("redis: {e}")))?;
                let from_memory = memory.give_back_at(&item, from_redis.now_ms);
                prop_assert_eq!(
                    from_redis.returned,
                    from_memory.returned,
                    "step {} {:?}",
                    step,
                    op
                );
                if item.algorithm != Algorithm::TokenBucket {
                    prop_assert_eq!(from_redis.returned, 0, "a window gives nothing back");
                }
            }
            WindowOp::Pause { ms } => tokio::time::sleep(Duration::from_millis(*ms)).await,
        }
    }
    Ok(())
}

#[test]
fn redis_functions_match_core_window_math() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let url = shared_redis().url();
    let redis = rt.block_on(async {
        let s =
            RedisStore::new(&url, &RedisSecurity::default(), prop_settings()).expect("redis store");
        until_ready(&s, "redis ready").await;
        s
    });
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(48);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let case = AtomicU64::new(0);
    let result = runner.run(&prop::collection::vec(window_op(), 1..40), |ops| {
        rt.block_on(run_windows(
            &redis,
            case.fetch_add(1, Ordering::Relaxed),
            ops,
        ))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let seen: Vec<(&str, u64)> = ["grants", "denials", "undone in a group", "in groups"]
        .into_iter()
        .zip(WINDOW_SEEN.iter().map(|n| n.load(Ordering::Relaxed)))
        .collect();
    println!("{cases} cases exercised {seen:?}");
    for (what, n) in &seen {
        assert!(*n > 0, "no {what} in {cases} cases: {seen:?}");
    }
}

/// The Redis Function's calendar arithmetic (`days_from_civil`, `civil_from_days`, and a
/// calendar grid's window index, start and end) run by Redis' own Lua, against core's
/// `Calendar`, for every period and thousands of times from 1970 to 2500: random ones, and
/// the last and first millisecond of every month from 1970 to 2110 (leap years, 2100 that is
/// not one, week and year ends among them). The functions are cut from `tollgate.lua` as they
/// are and called from a small driver script.
#[test]
fn redis_calendar_arithmetic_matches_core() {
    use tollgate_core::calendar::{days_from_civil, Calendar, DAY_MS};
    const LIBRARY: &str = include_str!("../src/store/tollgate.lua");
    let from = LIBRARY.find("local DAY_MS = ").expect("the calendar part");
    let to = LIBRARY
        .find("-- core: Counters::at")
        .expect("the end of the grid functions");
    let driver = format!(
        "{}\nlocal out = {{}}\nfor i = 2, #ARGV do\n  local t = tonumber(ARGV[i])\n  \
         local g = parse_grid(ARGV[1])\n  local index = grid_index(g, t)\n  \
         out[#out + 1] = string.format('%d %d %d', index, grid_start(g, index), \
         grid_end(g, index))\nend\nreturn out\n",
        &LIBRARY[from..to]
    );
    let mut times: Vec<u64> = Vec::new();
    for year in 1970..2110u64 {
        for month in 1..=12u32 {
            let first = days_from_civil(year, month, 1) * DAY_MS;
            times.extend([first, first + 1, first + DAY_MS / 2]);
            times.extend(first.checked_sub(1));
        }
    }
    // A fixed sequence of pseudo-random times up to the year 2500 (xorshift).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let end = days_from_civil(2500, 1, 1) * DAY_MS;
    for _ in 0..3_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        times.push(x % end);
    }
    let redis = shared_redis();
    let mut checked = 0;
    for (grid, calendar) in [
        ("1w", Calendar::Weeks(1)),
        ("2w", Calendar::Weeks(2)),
        ("5w", Calendar::Weeks(5)),
        ("52w", Calendar::Weeks(52)),
        ("1mo", Calendar::Months(1)),
        ("2mo", Calendar::Months(2)),
        ("3mo", Calendar::Months(3)),
        ("4mo", Calendar::Months(4)),
        ("6mo", Calendar::Months(6)),
        ("12mo", Calendar::Months(12)),
    ] {
        for chunk in times.chunks(1_000) {
            let texts: Vec<String> = chunk.iter().map(u64::to_string).collect();
            let mut args = vec!["EVAL", driver.as_str(), "0", grid];
            args.extend(texts.iter().map(String::as_str));
            let reply = redis.cmd(&args);
            let rows = reply
                .as_array()
                .unwrap_or_else(|| panic!("{grid}: {reply:?}"));
            assert_eq!(rows.len(), chunk.len(), "{grid}");
            for (t, row) in chunk.iter().zip(rows) {
                let index = calendar.index(*t);
                let expected = format!(
                    "{index} {} {}",
                    calendar.start_ms(index),
                    calendar.end_ms(index)
                );
                assert_eq!(row.as_str(), Some(expected.as_str()), "{grid} at {t}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, times.len() * 10);
}
