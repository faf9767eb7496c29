//! A limiter pointed at a Redis replica by mistake (`--redis redis://replica`) decides
//! nothing: `/readyz` answers 503 naming the node a replica and its primary, every lease is
//! `UNAVAILABLE` within the store timeout — for a read-only replica and for one with
//! `replica-read-only no`, which would otherwise take the Function's writes on stale state —
//! and the replica runs no Function call at all. Once it is promoted (`REPLICAOF NO ONE`, what
//! Sentinel does), the same limiter decides on it, from the state replicated from the old
//! primary. A Redis Cluster seeded only with replica addresses still decides on the primaries.
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

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::*;
use tollgate_e2e::redis::RedisOptions;
use tollgate_e2e::{RedisCluster, RedisServer};
use tollgate_limiter::StoreConfig;

/// The store timeout of these tests; every refusal must come within it (plus scheduling slack
/// on a loaded machine).
const STORE_TIMEOUT: Duration = Duration::from_millis(200);
const SLACK: Duration = Duration::from_millis(300);

/// `FCALL`/`FCALL_RO` the server ran or rejected, from `INFO commandstats`.
fn fcalls(server: &RedisServer) -> u64 {
    let count = |line: &str, field: &str| -> u64 {
        line.split(&format!("{field}="))
            .nth(1)
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    server
        .info("commandstats")
        .lines()
        .filter(|l| l.starts_with("cmdstat_fcall:") || l.starts_with("cmdstat_fcall_ro:"))
        .map(|l| count(l, "calls") + count(l, "rejected_calls"))
        .sum()
}

/// `/readyz` of a limiter on a replica: 503, not ready, the reason naming the replica and its
/// primary, answered within the store timeout.
async fn assert_not_ready_as_replica(addr: SocketAddr, primary_port: u16) {
    let started = Instant::now();
    let (status, body) = get(addr, "/readyz").await;
    let took = started.elapsed();
    assert_eq!(status, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ready"], false, "{body}");
    let reason = v["reason"].as_str().unwrap();
    assert!(
        reason.contains("is a replica of 127.0.0.1:") && reason.contains(&primary_port.to_string()),
        "reason must say the node is a replica of the primary: {reason}"
    );
    assert!(took < STORE_TIMEOUT + SLACK, "/readyz took {took:?}");
    println!("/readyz on the replica ({took:?}): {reason}");
}

/// Every lease on the replica is UNAVAILABLE, each within the store timeout.
async fn assert_leases_refused(addr: SocketAddr, key: &str) {
    for i in 0..20 {
        let started = Instant::now();
        let (status, v) = post(
            addr,
            "/v1/leases",
            &lease_body(&unique("r"), "hundred", key, 1, 5),
        )
        .await;
        let took = started.elapsed();
        assert_eq!(status, 503, "lease {i} on a replica: {v}");
        assert_eq!(v["error"], "UNAVAILABLE", "{v}");
        assert!(took < STORE_TIMEOUT + SLACK, "lease {i} took {took:?}");
    }
}

/// The bucket as the Function left it on `server`: tokens (fractional).
fn tokens(server: &RedisServer, key: &str) -> f64 {
    peek_redis(server, &lease("x", "hundred", key, 1, 1).bucket_key())
        .expect("bucket exists")
        .state
        .tokens
}

async fn replica_is_refused(extra: &[&str]) {
    let primary = RedisServer::start();
    let replica = tokio::task::block_in_place(|| replica_of(&primary, extra));
    assert_eq!(
        replica.info_field("replication", "role").as_deref(),
        Some("slave")
    );

    // A limiter on the primary drains 60 of the bucket's 100; the replica gets that state.
    let on_primary = start(StoreConfig::Redis(primary.url())).await;
    let key = unique("rep");
    let mut taken = 0;
    while taken < 60 {
        let (status, v) = post(
            on_primary.addr(),
            "/v1/leases",
            &lease_body(&unique("p"), "hundred", &key, 5, 5),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        taken += granted(&v);
    }
    tokio::task::block_in_place(|| caught_up(&primary, &replica));
    let before = tokens(&replica, &key);
    assert!((before - 40.0).abs() < 0.1, "replica holds {before}");

    // The mistake: a limiter pointed at the replica.
    let mut c = config(StoreConfig::Redis(replica.url()));
    c.store_timeout = STORE_TIMEOUT;
    let on_replica = start_unready(c).await;
    let fcalls_before = fcalls(&replica);
    assert_not_ready_as_replica(on_replica.addr(), primary.port()).await;
    assert_leases_refused(on_replica.addr(), &key).await;
    // A fresh key too: a replica would have created it full.
    assert_leases_refused(on_replica.addr(), &unique("fresh")).await;
    let metrics = get(on_replica.addr(), "/metrics").await.1;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("tollgate_limiter_store_errors_total{kind=\"read_only\"")),
        "store errors are counted as read_only"
    );
    assert_eq!(
        fcalls(&replica),
        fcalls_before,
        "the replica ran no Function call"
    );
    assert!(
        (tokens(&replica, &key) - before).abs() < 1e-9,
        "the replica's state is untouched"
    );

    // Promotion (what Sentinel does): the same limiter decides on the promoted node, from
    // the replicated state: 40 left, not a fresh 100.
    on_primary.shutdown().await;
    assert_eq!(replica.cli(&["REPLICAOF", "NO", "ONE"]), "OK");
    let deadline = Instant::now() + WAIT_LIMIT;
    loop {
        let (status, _) = get(on_replica.addr(), "/readyz").await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "not ready after the promotion");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut after = 0;
    loop {
        let (status, v) = post(
            on_replica.addr(),
            "/v1/leases",
            &lease_body(&unique("n"), "hundred", &key, 1, 7),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        match granted(&v) {
            0 => break,
            g => after += g,
        }
    }
    println!("after the promotion: {after} granted on top of the 60 taken on the old primary");
    assert_eq!(
        after, 40,
        "the promoted node decides on the replicated bucket"
    );
    on_replica.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_replica_is_refused() {
    replica_is_refused(&[]).await;
}

/// A writable replica would run the Function and take tokens from its own copy of the state:
/// it must be refused just the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_replica_is_refused() {
    replica_is_refused(&["--replica-read-only", "no"]).await;
}

/// A primary demoted under a running limiter (`REPLICAOF` another node): the next calls are
/// refused, never decided on the demoted node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_stops_deciding() {
    let other = RedisServer::start();
    let node = RedisServer::start_with(RedisOptions {
        extra_args: vec!["--replica-read-only".into(), "no".into()],
        ..RedisOptions::default()
    });
    let mut c = config(StoreConfig::Redis(node.url()));
    c.store_timeout = STORE_TIMEOUT;
    let limiter = start_with(c).await;
    let key = unique("demote");
    let (status, v) = post(
        limiter.addr(),
        "/v1/leases",
        &lease_body(&unique("d"), "hundred", &key, 1, 1),
    )
    .await;
    assert_eq!((status, granted(&v)), (200, 1), "{v}");
    assert_eq!(
        node.cli(&["REPLICAOF", "127.0.0.1", &other.port().to_string()]),
        "OK"
    );
    // The first call after the demotion finds out (in the same round trip); all are refused.
    assert_leases_refused(limiter.addr(), &key).await;
    assert_not_ready_as_replica(limiter.addr(), other.port()).await;
    limiter.shutdown().await;
}

/// A Redis Cluster reached through replica addresses only: the client learns the topology
/// and sends every decision to the owning primary; no replica runs a Function call, and a
/// key's decisions are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_seeded_with_replicas_decides_on_primaries() {
    let cluster = tokio::task::block_in_place(|| RedisCluster::start(3, 1));
    let replica_urls: Vec<String> = cluster
        .replicas()
        .iter()
        .map(|n| format!("redis://127.0.0.1:{}", n.port))
        .collect();
    assert_eq!(replica_urls.len(), 3);
    let mut c = config(StoreConfig::Cluster(replica_urls));
    c.store_timeout = Duration::from_millis(500);
    let limiter = start_with(c).await;
    let replica_calls: Vec<u64> = cluster
        .replicas()
        .iter()
        .map(|n| fcalls(cluster.node(n.port)))
        .collect();
    for t in 0..10 {
        let key = unique(&format!("cl{t}"));
        let mut total = 0;
        loop {
            let (status, v) = post(
                limiter.addr(),
                "/v1/leases",
                &lease_body(&unique("c"), "tenant", &key, 1, 3),
            )
            .await;
            assert_eq!(status, 200, "{v}");
            match granted(&v) {
                0 => break,
                g => total += g,
            }
        }
        assert_eq!(total, 10, "tenant {t}: exactly the burst");
    }
    for (n, before) in cluster.replicas().iter().zip(replica_calls) {
        assert_eq!(
            fcalls(cluster.node(n.port)),
            before,
            "replica {} ran a Function call",
            n.port
        );
    }
    limiter.shutdown().await;
}

/// A Redis user whose ACL lacks `ROLE` (it is in `@admin`/`@dangerous`): the limiter cannot
/// tell a primary from a replica, so it decides nothing and `/readyz` says what to grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_role_is_told_to_grant_it() {
    let redis = RedisServer::start();
    assert_eq!(redis.cli(&["ACL", "SETUSER", "default", "-role"]), "OK");
    let mut c = config(StoreConfig::Redis(redis.url()));
    c.store_timeout = STORE_TIMEOUT;
    let limiter = start_unready(c).await;
    let (status, body) = get(limiter.addr(), "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("grant it `+role`"), "{body}");
    assert_leases_refused(limiter.addr(), &unique("acl")).await;
    assert_eq!(redis.cli(&["ACL", "SETUSER", "default", "+role"]), "OK");
    let deadline = Instant::now() + WAIT_LIMIT;
    while get(limiter.addr(), "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "not ready once ROLE is granted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    limiter.shutdown().await;
}
