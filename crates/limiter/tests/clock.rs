//! Clock movement between Redis owners. The Function decides on its own node's `TIME`, so a
//! failover can move a bucket to a node whose clock is behind or ahead. Here a replica whose
//! wall clock runs 30 s behind (and, separately, 30 s ahead: `tollgate_e2e::clock`, checked on
//! its `TIME`) takes over a drained bucket: the old primary dies, the replica is promoted
//! (`REPLICAOF NO ONE`) and the stateless limiter is started again on the new primary's
//! address, as clients of a Sentinel-managed deployment would reconnect. A greedy client asks
//! for tokens throughout, and the test measures what was admitted against the ideal
//! `burst + rate × t` over the whole run (real time):
//!
//! * behind: no token appears — the bucket stays as drained as the old primary left it until
//!   the new clock passes the bucket's last update (the Function never moves it back), then it
//!   refills at the policy's rate: under-use, never overshoot;
//! * ahead: the jump refills at most to capacity, so the overshoot is at most one burst;
//! * lease dedup records survive either jump (they expire on absolute Redis time, 60 s after
//!   their write), and an assignment's holding ends 30 s later (behind) or at once (ahead) on
//!   the new clock.
//!
//! The `e2e` tier (it needs `redis-server` and a C compiler for the clock shim).

// Test code: failing loudly is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::*;
use tollgate_e2e::RedisServer;
use tollgate_limiter::store::LeaseItem;
use tollgate_limiter::{Running, StoreConfig};

/// 10 units/s, burst 100: a 30 s jump is worth 300 units, three times the capacity.
const DOC_CLOCK: &str = r#"{
  "policies": [
    {"name": "clock", "key": [{"header": "x-tenant"}], "rate": {"units": 10, "per": "1s"},
     "burst": 100, "scope": "global"}
  ],
  "limiter": {"cluster": "tollgate_limiter"}
}"#;
const RATE_PER_S: f64 = 10.0;
const BURST: f64 = 100.0;
const SKEW_MS: i64 = 30_000;

async fn limiter_on(server: &RedisServer) -> Running {
    let mut c = config(StoreConfig::Redis(server.url()));
    c.policies = policy_file(DOC_CLOCK);
    start_with(c).await
}

/// One lease of up to 5 units with a fresh id: `(id, granted)`; never UNAVAILABLE.
async fn ask(addr: SocketAddr, key: &str) -> (String, u64) {
    let id = unique("g");
    let (status, v) = post(addr, "/v1/leases", &lease_body(&id, "clock", key, 1, 5)).await;
    assert_eq!(status, 200, "{v}");
    (id, granted(&v))
}

/// A greedy client for `dur`: asks again at once after a grant, 5 ms after a denial.
/// Returns what it was granted and the last granted id with its grant.
async fn greedy(addr: SocketAddr, key: &str, dur: Duration) -> (u64, Option<(String, u64)>) {
    let started = Instant::now();
    let mut total = 0;
    let mut last = None;
    while started.elapsed() < dur {
        let (id, g) = ask(addr, key).await;
        total += g;
        if g > 0 {
            last = Some((id, g));
        } else {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    (total, last)
}

fn bucket(key: &str) -> String {
    LeaseItem {
        policy: "clock".into(),
        ..lease("x", "hundred", key, 1, 1)
    }
    .bucket_key()
}

struct Run {
    primary: RedisServer,
    replica: RedisServer,
    /// When the first lease was asked (the bucket is created full then).
    started: Instant,
    /// Admitted on the old primary.
    before: u64,
    /// The last granted id on the old primary and its grant (for the replay).
    last: (String, u64),
    /// The key holding an assignment.
    assigned: String,
}

/// Old primary with a replica at `skew_ms`; the greedy client drains `key` for 1 s, a second
/// key gets an assignment; then the primary's limiter stops and the replica has everything.
async fn drained_before_failover(skew_ms: i64, key: &str) -> Run {
    let primary = RedisServer::start();
    let env = tollgate_e2e::clock::offset_env(skew_ms);
    let replica = tokio::task::block_in_place(|| replica_with(&primary, &[], env));
    let skew = time_ms(&replica) as i64 - time_ms(&primary) as i64;
    println!("replica's TIME is {skew:+} ms off the primary's");
    assert!(
        (skew - skew_ms).abs() < 1_000,
        "the replica's clock is shifted by {skew_ms} ms (measured {skew} ms)"
    );

    let limiter = limiter_on(&primary).await;
    let addr = limiter.addr();
    let started = Instant::now();
    let (before, last) = greedy(addr, key, Duration::from_secs(1)).await;
    let last = last.expect("the greedy client got something on the old primary");

    // An assignment on another key: drained, then a holder whose demand exceeds the rate.
    let assigned = unique("assigned");
    let (status, v) = post(
        addr,
        "/v1/leases",
        &lease_body(&unique("d"), "clock", &assigned, 1, 100),
    )
    .await;
    assert_eq!((status, granted(&v)), (200, 100), "{v}");
    let (status, v) = post(
        addr,
        "/v1/leases",
        &holder_body(&unique("h"), "clock", &assigned, (1, 5), "i-1", 100.0),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert!(
        v["leases"][0]["share_per_s"].as_f64().unwrap_or(0.0) > 0.0,
        "an assignment: {v}"
    );
    limiter.shutdown().await;
    tokio::task::block_in_place(|| caught_up(&primary, &replica));
    Run {
        primary,
        replica,
        started,
        before,
        last,
        assigned,
    }
}

/// The failover: the old primary dies, the replica is promoted, a limiter starts on it.
/// Checks the replayed id, and returns the limiter and the new clock's view of the buckets:
/// ms from now to the drained bucket's last update, and to the assignment's holding end
/// (`None`: the state has expired on the new clock), as of the returned instant.
async fn fail_over(run: &Run, key: &str) -> (Running, Option<i64>, Option<i64>, Instant) {
    run.primary.kill();
    assert_eq!(run.replica.cli(&["REPLICAOF", "NO", "ONE"]), "OK");
    let limiter = limiter_on(&run.replica).await;
    let now = time_ms(&run.replica) as i64;
    let measured = Instant::now();
    let state = peek_redis(&run.replica, &bucket(key));
    let to_update = state.as_ref().map(|p| p.state.updated_ms as i64 - now);
    let to_holding_end = peek_redis(&run.replica, &bucket(&run.assigned))
        .map(|p| p.holding("i-1").expect("holding replicated").ends_ms as i64 - now);

    // The lease id decided last on the old primary is answered from its record, and takes
    // nothing.
    let (id, was) = &run.last;
    let (status, v) = post(
        limiter.addr(),
        "/v1/leases",
        &lease_body(id, "clock", key, 1, 5),
    )
    .await;
    assert_eq!((status, granted(&v)), (200, *was), "replay of {id}: {v}");
    let after = peek_redis(&run.replica, &bucket(key));
    assert_eq!(
        after.map(|p| p.state),
        state.map(|p| p.state),
        "the replay took nothing"
    );
    (limiter, to_update, to_holding_end, measured)
}

/// Admitted beyond `burst + rate × t` for everything admitted since `started`.
fn overshoot(admitted: u64, started: Instant) -> (f64, f64) {
    let t = started.elapsed().as_secs_f64();
    let ideal = BURST + RATE_PER_S * t;
    (admitted as f64 - ideal, t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_30s_behind_creates_no_capacity() {
    let key = unique("behind");
    let run = drained_before_failover(-SKEW_MS, &key).await;
    let (limiter, behind_update, holding, promoted) = fail_over(&run, &key).await;
    let behind_update = behind_update.expect("the bucket lives longer on a clock behind");
    let holding = holding.expect("the holding lives longer on a clock behind");
    println!(
        "behind: {} admitted on the old primary; the bucket's last update is {behind_update} ms \
         ahead of the new clock; the assignment's holding ends in {holding} ms",
        run.before
    );
    assert!(
        behind_update > 25_000,
        "the new clock is ~30 s behind the bucket's last update"
    );
    assert!(
        holding > 25_000,
        "a holding ends ~30 s later on a clock 30 s behind: {holding} ms"
    );

    // Not a token until the new clock passes the last update; probed every 100 ms.
    let mut probes = 0;
    let first = loop {
        let (_, g) = ask(limiter.addr(), &key).await;
        if g > 0 {
            break (promoted.elapsed(), g);
        }
        probes += 1;
        assert!(
            promoted.elapsed() < Duration::from_secs(45),
            "no token 45 s after the promotion"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "behind: first grant {:?} after the promotion ({probes} denials before it; the new \
         clock was {behind_update} ms behind the last update)",
        first.0
    );
    let stall_ms = first.0.as_millis() as i64;
    assert!(
        stall_ms >= behind_update - 500,
        "a token appeared before the new clock reached the bucket's last update: \
         {stall_ms} ms < {behind_update} ms"
    );
    assert!(
        stall_ms <= behind_update + 3_000,
        "refill resumed late: {stall_ms} ms"
    );

    // From there on it refills at the rate on the new clock: 2 s give about 20.
    let refilled_from = Instant::now();
    let (after, _) = greedy(limiter.addr(), &key, Duration::from_secs(2)).await;
    let window = refilled_from.elapsed().as_secs_f64() + 0.2;
    let total = run.before + first.1 + after;
    let (over, t) = overshoot(total, run.started);
    println!(
        "behind: {after} admitted in the 2 s after the refill resumed (rate × t = {:.1}); \
         {total} admitted in {t:.1} s, ideal {:.0}: overshoot {over:+.1}",
        RATE_PER_S * window,
        BURST + RATE_PER_S * t
    );
    assert!(
        (first.1 + after) as f64 <= RATE_PER_S * window + 5.0,
        "refill faster than the rate after the clock went back"
    );
    assert!(
        over <= 0.0,
        "a clock going back created capacity: {over:+.1}"
    );
    limiter.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_30s_ahead_refills_at_most_one_burst() {
    let key = unique("ahead");
    let run = drained_before_failover(SKEW_MS, &key).await;
    let (limiter, behind_update, holding, _) = fail_over(&run, &key).await;
    // The bucket's TTL (a full refill plus a margin, 11 s here) is an absolute time: on a
    // clock 30 s ahead it has run out, and the bucket starts full, like a capped refill.
    println!(
        "ahead: {} admitted on the old primary; on the new clock the drained bucket {} and the \
         assignment's holding {}",
        run.before,
        behind_update.map_or("has expired".into(), |ms| format!(
            "was updated {} ms ago",
            -ms
        )),
        holding.map_or("has expired with its bucket".into(), |ms| format!(
            "ended {} ms ago",
            -ms
        )),
    );
    assert!(
        behind_update.is_none_or(|ms| ms < -25_000),
        "the new clock is ~30 s past the last update"
    );
    assert!(
        holding.is_none_or(|ms| ms < 0),
        "the holding has ended on the new clock"
    );

    // The first answers after the jump: a full bucket at most, never the 300 units the
    // 30 s would be worth.
    let jumped = Instant::now();
    let (burst, _) = greedy(limiter.addr(), &key, Duration::from_millis(300)).await;
    let first_window = jumped.elapsed().as_secs_f64();
    let (after, _) = greedy(limiter.addr(), &key, Duration::from_secs(2)).await;
    let total = run.before + burst + after;
    let (over, t) = overshoot(total, run.started);
    println!(
        "ahead: {burst} admitted in the first {first_window:.2} s after the jump, {after} in the \
         next 2 s; {total} admitted in {t:.1} s, ideal {:.0}: overshoot {over:+.1} (bound: one \
         burst, {BURST})",
        BURST + RATE_PER_S * t
    );
    assert!(
        burst as f64 <= BURST + RATE_PER_S * first_window + 1.0,
        "the jump refilled beyond capacity: {burst}"
    );
    // Near empty, grants shrink with the bucket's fill (so a few fractional units stay).
    assert!(
        burst as f64 >= BURST * 0.9,
        "the jump refilled the bucket: {burst}"
    );
    assert!(over <= BURST, "overshoot beyond one burst: {over:+.1}");
    limiter.shutdown().await;
}
