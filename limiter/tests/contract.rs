//! One contract, three stores: every case below runs against the in-memory store, a real
//! redis-server and a real 3-primary/3-replica Redis Cluster, and must give the same answers.
//! Each case uses keys of its own, so cases share one Redis / one cluster per test binary and
//! run in parallel.

// Test code: failing loudly is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::*;
use tollgate_limiter::store::{
    LeaseItem, MemoryStore, RedisClusterStore, RedisStore, Store, StoreError,
};

async fn one(store: &impl Store, item: LeaseItem) -> tollgate_limiter::store::Grant {
    let outcome = store.lease(&[item]).await.expect("store answers");
    assert_eq!(outcome.grants.len(), 1);
    outcome.grants[0]
}

async fn returned(store: &impl Store, id: &str, policy: &str, key: &str, unused: u64) -> u64 {
    store
        .give_back(&give_back(id, policy, key, unused))
        .await
        .expect("store answers")
        .returned
}

/// The contract, one async fn per rule.
mod cases {
    use super::*;

    /// A new bucket is full; leases shrink with the fill ratio; near empty a lease is just
    /// `min`; an empty bucket denies with a retry time and takes nothing.
    pub async fn lease_sizing(s: &impl Store) {
        let k = unique("sizing");
        let g = one(s, lease("a", "hundred", &k, 1, 40)).await;
        assert_eq!((g.granted, g.replayed), (40, false));
        assert!((g.remaining - 60.0).abs() < 0.01, "{g:?}");
        // 60 left, fill 0.6: at most 36.
        assert_eq!(one(s, lease("b", "hundred", &k, 1, 40)).await.granted, 36);
        // 24 left, fill 0.24: 5.76 → 5, and min 5 wins.
        assert_eq!(one(s, lease("c", "hundred", &k, 5, 40)).await.granted, 5);
        assert_eq!(one(s, lease("d", "hundred", &k, 19, 40)).await.granted, 19);
        let denied = one(s, lease("e", "hundred", &k, 1, 40)).await;
        assert_eq!(denied.granted, 0);
        // 1 unit per hour: about an hour until one token is back.
        assert!(denied.retry_after_ms > 3_500_000, "{denied:?}");
        assert!(denied.remaining < 0.01);
    }

    /// A denial (weighted `min` above what is left) takes nothing.
    pub async fn denial_takes_nothing(s: &impl Store) {
        let k = unique("deny");
        assert_eq!(one(s, lease("a", "tenant", &k, 8, 8)).await.granted, 8);
        let d = one(s, lease("b", "tenant", &k, 3, 3)).await;
        assert_eq!(d.granted, 0);
        assert!(d.retry_after_ms > 0);
        assert!((d.remaining - 2.0).abs() < 0.01, "{d:?}");
        assert_eq!(one(s, lease("c", "tenant", &k, 2, 2)).await.granted, 2);
    }

    /// Idle time refills at most to capacity.
    pub async fn refill_is_capped(s: &impl Store) {
        let k = unique("refill");
        let drained = std::time::Instant::now();
        assert_eq!(one(s, lease("a", "fast", &k, 10, 10)).await.granted, 10);
        let b = one(s, lease("b", "fast", &k, 10, 10)).await;
        // At 1 token/ms the bucket is full again after 10 ms (a slow machine may get there).
        assert!(
            b.granted == 0 || drained.elapsed() >= Duration::from_millis(9),
            "{b:?}"
        );
        tokio::time::sleep(Duration::from_millis(60)).await;
        // 60+ ms at 1/ms would be 60 tokens; the bucket holds 10.
        let g = one(s, lease("c", "fast", &k, 1, 100)).await;
        assert_eq!(g.granted, 10, "{g:?}");
    }

    /// A lease id is applied once: a repeat answers the original grant and takes nothing.
    pub async fn lease_ids_are_applied_once(s: &impl Store) {
        let k = unique("dedup");
        let first = one(s, lease("same", "tenant", &k, 4, 4)).await;
        assert_eq!((first.granted, first.replayed), (4, false));
        let again = one(s, lease("same", "tenant", &k, 4, 4)).await;
        assert!(again.replayed);
        assert_eq!(again.granted, first.granted);
        assert_eq!(again.remaining, first.remaining);
        // 6 left: the repeat took nothing.
        assert_eq!(one(s, lease("other", "tenant", &k, 6, 6)).await.granted, 6);
        // A denial is remembered too.
        let denied = one(s, lease("denied", "tenant", &k, 1, 1)).await;
        assert_eq!(denied.granted, 0);
        assert_eq!(returned(s, "other", "tenant", &k, 6).await, 6);
        let replay = one(s, lease("denied", "tenant", &k, 1, 1)).await;
        assert_eq!((replay.granted, replay.replayed), (0, true));
    }

    /// The same id sent by many callers at once is granted once.
    pub async fn concurrent_repeats_are_granted_once(s: Arc<impl Store>) {
        let k = unique("dedup-conc");
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let s = Arc::clone(&s);
                let k = k.clone();
                tokio::spawn(async move { one(&*s, lease("twin", "tenant", &k, 3, 3)).await })
            })
            .collect();
        let mut fresh = 0;
        for t in tasks {
            let g = t.await.expect("task");
            assert_eq!(g.granted, 3);
            if !g.replayed {
                fresh += 1;
            }
        }
        assert_eq!(fresh, 1, "exactly one caller's request was applied");
        assert_eq!(one(&*s, lease("rest", "tenant", &k, 7, 7)).await.granted, 7);
        assert_eq!(one(&*s, lease("none", "tenant", &k, 1, 1)).await.granted, 0);
    }

    /// Returns give back at most what was granted, once, never above capacity; unknown ids
    /// and ids drawn from another bucket give back nothing.
    pub async fn returns_are_bounded(s: &impl Store) {
        let k = unique("ret");
        assert_eq!(one(s, lease("l", "tenant", &k, 10, 10)).await.granted, 10);
        assert_eq!(returned(s, "l", "tenant", &k, 4).await, 4);
        assert_eq!(returned(s, "l", "tenant", &k, 10).await, 6);
        assert_eq!(returned(s, "l", "tenant", &k, 10).await, 0);
        assert_eq!(returned(s, "unknown", "tenant", &k, 5).await, 0);
        // Same slot, other bucket: the record says where the tokens came from.
        assert_eq!(one(s, lease("m", "tenant", &k, 5, 5)).await.granted, 5);
        assert_eq!(returned(s, "m", "hundred", &k, 5).await, 0);
        assert_eq!(returned(s, "m", "tenant", &k, 5).await, 5);
        assert_eq!(one(s, lease("all", "tenant", &k, 10, 10)).await.granted, 10);

        // Refilled to full while the lease was out: giving back cannot exceed capacity.
        let f = unique("ret-cap");
        assert_eq!(one(s, lease("x", "fast", &f, 10, 10)).await.granted, 10);
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(returned(s, "x", "fast", &f, 10).await, 10);
        assert_eq!(one(s, lease("y", "fast", &f, 1, 100)).await.granted, 10);
        let after = one(s, lease("z", "fast", &f, 10, 10)).await;
        assert!(after.granted == 0 || after.remaining < 1.0, "{after:?}");
    }

    /// A group is all-or-nothing: when the route bucket runs out, the tenant bucket of the
    /// same group is not charged.
    pub async fn groups_are_all_or_nothing(s: &impl Store) {
        let t = unique("grp");
        let route = format!("{t}:post");
        for n in 0..3 {
            let o = s
                .lease(&[
                    lease(&format!("t{n}"), "tenant", &t, 1, 1),
                    lease(&format!("r{n}"), "route", &route, 1, 1),
                ])
                .await
                .expect("store answers");
            assert_eq!((o.grants[0].granted, o.grants[1].granted), (1, 1));
        }
        let o = s
            .lease(&[
                lease("t3", "tenant", &t, 1, 1),
                lease("r3", "route", &route, 1, 1),
            ])
            .await
            .expect("store answers");
        assert_eq!((o.grants[0].granted, o.grants[1].granted), (0, 0), "{o:?}");
        assert!(o.grants[1].retry_after_ms > 0);
        assert_eq!(
            o.grants[0].retry_after_ms, 0,
            "the tenant item alone was fine"
        );
        assert!((o.grants[0].remaining - 7.0).abs() < 0.01, "{o:?}");
        // The tenant bucket still has its 7.
        assert_eq!(one(s, lease("t4", "tenant", &t, 7, 7)).await.granted, 7);
        // A group whose items hit one bucket twice sees its own takings.
        let u = unique("grp-same");
        let o = s
            .lease(&[
                lease("a", "tenant", &u, 6, 6),
                lease("b", "tenant", &u, 5, 5),
            ])
            .await
            .expect("store answers");
        assert_eq!((o.grants[0].granted, o.grants[1].granted), (0, 0), "{o:?}");
        assert_eq!(one(s, lease("c", "tenant", &u, 10, 10)).await.granted, 10);
    }

    /// Different keys never share state.
    pub async fn keys_are_isolated(s: &impl Store) {
        let a = unique("iso-a");
        let b = unique("iso-b");
        assert_eq!(one(s, lease("1", "tenant", &a, 10, 10)).await.granted, 10);
        assert_eq!(one(s, lease("2", "tenant", &a, 1, 1)).await.granted, 0);
        assert_eq!(one(s, lease("3", "tenant", &b, 10, 10)).await.granted, 10);
        // Same key, other policy: another bucket.
        assert_eq!(one(s, lease("4", "hundred", &a, 1, 1)).await.granted, 1);
    }

    /// State idle past its TTL is gone, and comes back as a full bucket.
    pub async fn idle_state_expires_full(s: &impl Store) {
        let k = unique("exp");
        // "tenth": 1 per 10 ms, burst 10: full refill 100 ms, TTL 1.1 s.
        assert_eq!(one(s, lease("a", "tenth", &k, 10, 10)).await.granted, 10);
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let g = one(s, lease("b", "tenth", &k, 1, 100)).await;
        assert_eq!(g.granted, 10);
    }

    /// 64 concurrent callers on one key of capacity 100: exactly 100 granted.
    pub async fn exact_under_contention(s: Arc<impl Store>) {
        let k = unique("race");
        let tasks: Vec<_> = (0..64)
            .map(|c| {
                let s = Arc::clone(&s);
                let k = k.clone();
                tokio::spawn(async move {
                    let mut total = 0;
                    for n in 0.. {
                        let g =
                            one(&*s, lease(&format!("{c}-{n}"), "hundred", &k, 1, 1 + c % 3)).await;
                        if g.granted == 0 {
                            break;
                        }
                        total += g.granted;
                    }
                    total
                })
            })
            .collect();
        let mut total = 0;
        for t in tasks {
            total += t.await.expect("task");
        }
        assert_eq!(total, 100);
    }

    /// Malformed calls are refused as errors, never as decisions.
    pub async fn store_rejects_nothing_valid(s: &impl Store) {
        s.ready().await.expect("ready");
        let keys = s.active_keys().await.expect("active keys");
        assert!(!keys.is_empty());
        assert!(!s.node_for("acme").is_empty());
    }
}

macro_rules! contract {
    ($store:ident, $make:expr) => {
        mod $store {
            use super::*;

            async fn store() -> impl Store {
                $make
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lease_sizing() {
                cases::lease_sizing(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn denial_takes_nothing() {
                cases::denial_takes_nothing(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn refill_is_capped() {
                cases::refill_is_capped(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lease_ids_are_applied_once() {
                cases::lease_ids_are_applied_once(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_repeats_are_granted_once() {
                cases::concurrent_repeats_are_granted_once(Arc::new(store().await)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn returns_are_bounded() {
                cases::returns_are_bounded(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn groups_are_all_or_nothing() {
                cases::groups_are_all_or_nothing(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn keys_are_isolated() {
                cases::keys_are_isolated(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn idle_state_expires_full() {
                cases::idle_state_expires_full(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn exact_under_contention() {
                cases::exact_under_contention(Arc::new(store().await)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ready_and_observable() {
                cases::store_rejects_nothing_valid(&store().await).await;
            }
        }
    };
}

contract!(memory, MemoryStore::new(settings()));
contract!(
    redis,
    RedisStore::new(&shared_redis().url(), settings()).expect("redis store")
);
contract!(cluster, {
    let s = RedisClusterStore::new(&shared_cluster().urls(), settings()).expect("cluster store");
    s.ready().await.expect("cluster ready");
    s.refresh_slot_map().await.expect("slot map");
    s
});

/// Redis-specific: bucket keys expire after a full refill plus margin, lease records after
/// the dedup TTL; and both live in the tenant's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_carry_ttls_and_share_a_slot() {
    let redis = shared_redis();
    let s = RedisStore::new(&redis.url(), settings()).expect("redis store");
    let k = unique("ttl");
    let item = lease("ttl-id", "tenant", &k, 1, 1);
    assert_eq!(one(&s, item.clone()).await.granted, 1);
    let bucket_ttl = redis
        .cmd(&["PTTL", &item.bucket_key()])
        .as_int()
        .expect("pttl");
    // 10 tokens at 1/h: a full refill is 10 h; TTL is that plus 10%.
    assert!(
        bucket_ttl > 10 * 3_600_000 && bucket_ttl <= 11 * 3_600_000,
        "{bucket_ttl}"
    );
    let record_ttl = redis
        .cmd(&["PTTL", &item.lease_key()])
        .as_int()
        .expect("pttl");
    assert!(record_ttl > 50_000 && record_ttl <= 60_000, "{record_ttl}");
    let fields = redis.cmd(&["HGETALL", &item.lease_key()]).to_text();
    assert!(fields.contains(&item.bucket_key()), "{fields}");

    // "tenth" refills fully in 100 ms: its state is dropped 1.1 s after the last write.
    let fast = lease("fast-id", "tenth", &k, 1, 1);
    assert_eq!(one(&s, fast.clone()).await.granted, 1);
    assert_eq!(redis.cmd(&["EXISTS", &fast.bucket_key()]).as_int(), Some(1));
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    assert_eq!(redis.cmd(&["EXISTS", &fast.bucket_key()]).as_int(), Some(0));
}

/// A Redis the store cannot reach is an error, never an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_is_an_error() {
    let port = tollgate_e2e::free_port();
    let s = RedisStore::new(&format!("redis://127.0.0.1:{port}"), settings()).expect("store");
    let e = s
        .lease(&[lease("a", "tenant", "nobody", 1, 1)])
        .await
        .expect_err("no server");
    assert!(matches!(e, StoreError::Connection(_)), "{e:?}");
    assert!(e.is_transient());
    assert!(s.ready().await.is_err());
}

/// `calls` of `cmdstat_<command>` in `INFO commandstats` (0 when never called).
fn command_calls(server: &tollgate_e2e::RedisServer, command: &str) -> u64 {
    let info = server.info("commandstats");
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Hot keys: sharding spreads tenants, never one key. Every decision about one key runs on
/// the one primary owning its slot (its lease records too); different tenants land on every
/// primary; replicas never run a decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_lives_on_one_shard_and_tenants_spread() {
    let cluster = shared_cluster();
    let store = RedisClusterStore::new(&cluster.urls(), settings()).expect("cluster store");
    store.ready().await.expect("ready");
    store.refresh_slot_map().await.expect("slot map");

    let hot = unique("hot");
    let item = lease("hot-0", "thousand", &hot, 1, 1);
    let slot = cluster.key_slot(&item.bucket_key());
    assert_eq!(
        slot,
        cluster.key_slot(&item.lease_key()),
        "record shares the slot"
    );
    let owner = cluster.primary_for_slot(slot);
    assert_eq!(store.node_for(&hot), format!("127.0.0.1:{}", owner.port));
    let owner_server = cluster.node(owner.port);
    let before = command_calls(owner_server, "fcall");
    for n in 0..200 {
        let g = one(&store, lease(&format!("hot-{n}"), "thousand", &hot, 1, 1)).await;
        assert_eq!(g.granted, 1);
    }
    let after = command_calls(owner_server, "fcall");
    assert!(after - before >= 200, "owner ran {} calls", after - before);
    for primary in cluster.primaries() {
        let reply = cluster
            .node(primary.port)
            .cmd(&["EXISTS", &item.bucket_key()]);
        if primary.port == owner.port {
            assert_eq!(reply.as_int(), Some(1));
        } else {
            // Any other primary refuses the key outright: it cannot hold it.
            let text = reply.to_text();
            assert!(
                text.contains(&format!("MOVED {slot} 127.0.0.1:{}", owner.port)),
                "{}: {text}",
                primary.port
            );
        }
    }

    let mut per_node = std::collections::BTreeMap::<String, u32>::new();
    for t in 0..300 {
        let tenant = unique("spread");
        let item = lease(&format!("s{t}"), "tenant", &tenant, 1, 1);
        assert_eq!(one(&store, item.clone()).await.granted, 1);
        let node = store.node_for(&tenant);
        let port: u16 = node.rsplit(':').next().unwrap().parse().unwrap();
        assert_eq!(
            cluster
                .node(port)
                .cmd(&["EXISTS", &item.bucket_key()])
                .as_int(),
            Some(1),
            "{tenant} is where the slot map says"
        );
        *per_node.entry(node).or_default() += 1;
    }
    println!("300 tenants over primaries: {per_node:?}");
    assert_eq!(per_node.len(), 3, "{per_node:?}");
    for count in per_node.values() {
        assert!((60..=140).contains(count), "uneven spread: {per_node:?}");
    }
    for replica in cluster.replicas() {
        let server = cluster.node(replica.port);
        assert_eq!(
            command_calls(server, "fcall"),
            0,
            "replica {} decided",
            replica.port
        );
        assert_eq!(
            command_calls(server, "fcall_ro"),
            0,
            "replica {} was read",
            replica.port
        );
    }
}
