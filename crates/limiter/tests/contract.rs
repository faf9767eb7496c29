//! One contract, three stores: every case below runs against the in-memory store, a real
//! redis-server and a real 3-primary/3-replica Redis Cluster, and must give the same answers.
//! The Redis and Cluster runs are repeated over TLS (`redis_tls`, `cluster_tls`: client
//! certificates required, an ACL user's password, a 3-primary cluster with a TLS bus).
//! The Redis and Cluster runs (and the Redis-specific cases) are the `e2e` tier: they need
//! `redis-server`, so they are built only with the feature; the memory runs always are.
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
use std::time::{Duration, Instant};

use support::*;
use tollgate_core::assign::{self, Allotment, MAX_HOLDERS};
use tollgate_core::policy::Algorithm;
use tollgate_core::window::{self, CounterKind, Counters, Log, Window, WindowGrant};
use tollgate_limiter::store::{
    bucket_ttl_ms, fixed_count_key, rls_key, CountItem, CountOutcome, Grant, LeaseItem,
    MemoryStore, RedisClusterStore, RedisSecurity, RedisStore, ReturnItem, Store, StoreError,
    WINDOW_TTL_MARGIN_MS,
};

/// Reads a store's bucket behind its back: the memory store's own view, or the hash and
/// PTTL of the Redis node that holds it.
trait Peek {
    fn peek(&self, bucket_key: &str) -> Option<Peeked>;

    /// A window count of `Store::count` (its count key) and the ms until it expires.
    fn peek_count(&self, count_key: &str) -> Option<(u64, u64)>;
}

impl Peek for MemoryStore {
    fn peek(&self, bucket_key: &str) -> Option<Peeked> {
        peek_memory(self, bucket_key, None)
    }

    fn peek_count(&self, count_key: &str) -> Option<(u64, u64)> {
        self.count_view(count_key)
    }
}

/// A count key's value and `PTTL` on the Redis node that holds it.
fn peek_count_redis(server: &tollgate_e2e::RedisServer, count_key: &str) -> Option<(u64, u64)> {
    let count = server.cmd(&["GET", count_key]);
    let count = count.as_str()?.parse::<u64>().expect("a count");
    let ttl = server.cmd(&["PTTL", count_key]).as_int().expect("PTTL");
    Some((count, u64::try_from(ttl).expect("an expiry")))
}

/// The shared server or cluster a store talks to is the one with the store's node among its
/// ports (the plain one, or the TLS one).
impl Peek for RedisStore {
    fn peek(&self, bucket_key: &str) -> Option<Peeked> {
        peek_redis(redis_serving(&self.node_for("")), bucket_key)
    }

    fn peek_count(&self, count_key: &str) -> Option<(u64, u64)> {
        peek_count_redis(redis_serving(&self.node_for("")), count_key)
    }
}

impl Peek for RedisClusterStore {
    fn peek(&self, bucket_key: &str) -> Option<Peeked> {
        peek_cluster(cluster_serving(&self.node_for("any")), bucket_key)
    }

    fn peek_count(&self, count_key: &str) -> Option<(u64, u64)> {
        let cluster = cluster_serving(&self.node_for("any"));
        let owner = cluster.primary_for_key(count_key);
        peek_count_redis(cluster.node(owner.port), count_key)
    }
}

fn bucket(policy: &str, key: &str) -> String {
    lease("-", policy, key, 1, 1).bucket_key()
}

/// What an answer took from its bucket (`Allotment::taken`).
fn taken(g: &Grant) -> u64 {
    Allotment {
        granted: g.granted,
        remaining: g.remaining,
        retry_after_ms: g.retry_after_ms,
        share_per_ms: g.share_per_ms,
        period_ms: g.period_ms,
    }
    .taken()
}

/// Drains bucket (`policy`, `key`) and has `holder` ask (min 1, want 5) with `demand_per_s`
/// until it gets a share: a machine that stalls long enough between the two calls lets the
/// bucket refill enough for a plain lease, then the next ask is the assignment. Returns the
/// lease id and the answer.
async fn assigned(
    s: &impl Store,
    policy: &str,
    key: &str,
    holder: &str,
    demand_per_s: f64,
) -> (String, Grant) {
    let burst = limits(policy).capacity() as u64;
    assert_eq!(
        one(s, lease("drain", policy, key, burst, burst))
            .await
            .granted,
        burst
    );
    for n in 0..10 {
        let id = format!("{holder}-{n}");
        let g = one(s, ask(&id, policy, key, (1, 5), holder, demand_per_s)).await;
        if g.share_per_ms > 0.0 {
            return (id, g);
        }
    }
    panic!("{holder} never got a share of {policy}/{key}");
}

/// Floats from the stores may differ from a hand computation in the last bits.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

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

/// One item decided: the store's clock when it decided, and its answer.
async fn decide(store: &impl Store, item: LeaseItem) -> (u64, Grant) {
    let outcome = store.lease(&[item]).await.expect("store answers");
    assert_eq!(outcome.grants.len(), 1);
    (outcome.now_ms, outcome.grants[0])
}

fn window_of(policy: &str) -> Window {
    *algorithm(policy).window().expect("a windowed test policy")
}

/// tollgate-core's decisions for one window, fed the store's clock: what every store must
/// answer, to the bit.
struct Model {
    algorithm: Algorithm,
    counters: Option<Counters>,
    log: Log,
}

impl Model {
    fn of(policy: &str) -> Self {
        Self {
            algorithm: algorithm(policy),
            counters: None,
            log: Log::default(),
        }
    }

    fn lease(&mut self, now: u64, min: u64, want: u64) -> WindowGrant {
        let kind = match self.algorithm {
            Algorithm::SlidingLog(w) => return self.log.lease(&w, now, min, want),
            Algorithm::FixedWindow(_) => CounterKind::Fixed,
            Algorithm::SlidingWindow(_) => CounterKind::Sliding,
            Algorithm::TokenBucket => panic!("not a window"),
        };
        let w = *self.algorithm.window().expect("a window");
        let (next, grant) = window::lease(kind, &w, self.counters, now, min, want);
        self.counters = Some(next);
        grant
    }
}

/// Leases from a window and checks the answer is core's at the store's clock.
async fn window_lease(s: &impl Store, model: &mut Model, item: LeaseItem) -> (u64, Grant) {
    let (now, g) = decide(s, item.clone()).await;
    let core = model.lease(now, item.min, item.want);
    let expected = Grant {
        granted: core.granted,
        remaining: core.remaining,
        retry_after_ms: core.retry_after_ms,
        replayed: false,
        share_per_ms: 0.0,
        period_ms: 0,
        expires_ms: Some(core.expires_ms),
    };
    assert_eq!(
        g, expected,
        "{} at {now}: the store and core disagree",
        item.id
    );
    (now, g)
}

/// Waits, if need be, until the store's clock is early in a window of `policy` (a lease of a
/// throwaway key says how much of the window is left), so the steps a case needs inside one
/// window get at least three quarters of one. Returns the window.
async fn early_in_a_window(s: &impl Store, policy: &str) -> Window {
    let w = window_of(policy);
    let (_, probe) = decide(s, lease("probe", policy, &unique("probe"), 1, 1)).await;
    let left = probe
        .expires_ms
        .expect("a window's lease ends with its window");
    assert!(left <= w.window_ms, "{probe:?}");
    if left < w.window_ms * 3 / 4 {
        tokio::time::sleep(Duration::from_millis(left + 2)).await;
    }
    w
}

/// Sleeps past the end of the window an answer was drawn from: its `expires_ms`, plus 3 ms.
async fn past_the_window(g: &Grant, w: &Window) {
    let left = g.expires_ms.expect("a window's answer");
    assert!(left <= w.window_ms, "{g:?}");
    tokio::time::sleep(Duration::from_millis(left + 3)).await;
}

const HOUR_MS: u64 = 3_600_000;

fn count_item(key: &str, limit: u64, window_ms: u64, cost: u64) -> CountItem {
    CountItem {
        key: key.to_owned(),
        limit,
        window_ms,
        cost,
    }
}

async fn count(store: &impl Store, items: &[CountItem]) -> CountOutcome {
    let outcome = store.count(items).await.expect("store answers");
    assert_eq!(outcome.remaining.len(), items.len(), "{outcome:?}");
    outcome
}

/// Whether every answer was decided in one window of `window_ms` (a case whose calls
/// straddle a boundary is run again with fresh keys).
fn in_one_window(outcomes: &[CountOutcome], window_ms: u64) -> bool {
    outcomes
        .windows(2)
        .all(|w| w[0].now_ms / window_ms == w[1].now_ms / window_ms)
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

    /// A bucket that cannot give a named holder its `want` assigns it a share of the rate for
    /// the period (taken at once: the bucket goes into debt); a holder-less ask on the same
    /// bucket gets only what a lease can give.
    pub async fn a_drained_bucket_assigns_a_share(s: &(impl Store + Peek)) {
        let k = unique("assign");
        let rate = limits("tenant").refill_per_ms();
        assert_eq!(one(s, lease("d", "tenant", &k, 10, 10)).await.granted, 10);
        let plain = one(s, lease("p", "tenant", &k, 1, 5)).await;
        assert_eq!(
            (plain.granted, plain.share_per_ms, plain.period_ms),
            (0, 0.0, 0)
        );
        assert!(plain.retry_after_ms > 3_000_000, "{plain:?}");

        let a = one(s, ask("a", "tenant", &k, (1, 5), "ia", 100.0)).await;
        assert_eq!(a.granted, 0, "{a:?}");
        // Demand 100/s against 1/h: the whole rate.
        assert!(close(a.share_per_ms, rate), "{a:?}");
        assert_eq!((a.period_ms, a.retry_after_ms), (PERIOD_MS, 0));
        assert!(a.remaining < 0.0, "share x period taken at once: {a:?}");
        let peeked = s.peek(&bucket("tenant", &k)).expect("bucket");
        let h = peeked.holding("ia").expect("holding");
        assert_eq!(h.share_per_ms, a.share_per_ms);
        assert_eq!(h.ends_ms, peeked.state.updated_ms + PERIOD_MS);
        assert_eq!(h.demand_per_ms, 0.1);
        assert_eq!(peeked.state.tokens, a.remaining);
        // Still holder-less: a denial, whatever the holdings.
        let plain = one(s, lease("q", "tenant", &k, 1, 5)).await;
        assert_eq!((plain.granted, plain.share_per_ms), (0, 0.0));
    }

    /// Shares follow reported demand: equal demand ends in equal shares, 3:1 in 3:1, once
    /// each holder has renewed; the newcomer waits (share 0) until the first renews.
    pub async fn shares_follow_demand(s: &impl Store) {
        let rate = limits("tenant").refill_per_ms();
        for (demand_a, demand_b) in [(100.0, 100.0), (300.0, 100.0)] {
            let k = unique("demand");
            assert_eq!(one(s, lease("d", "tenant", &k, 10, 10)).await.granted, 10);
            let a = one(s, ask("a1", "tenant", &k, (1, 5), "ia", demand_a)).await;
            assert!(close(a.share_per_ms, rate), "{a:?}");
            let b = one(s, ask("b1", "tenant", &k, (1, 5), "ib", demand_b)).await;
            assert!(
                b.granted == 0 && b.share_per_ms == 0.0,
                "the rate is held: {b:?}"
            );
            assert!(
                b.retry_after_ms > 0 && b.retry_after_ms <= PERIOD_MS,
                "ask again when a's holding ends: {b:?}"
            );
            let a = one(s, ask("a2", "tenant", &k, (1, 5), "ia", demand_a)).await;
            let b = one(s, ask("b2", "tenant", &k, (1, 5), "ib", demand_b)).await;
            let total = demand_a + demand_b;
            assert!(close(a.share_per_ms, rate * demand_a / total), "{a:?}");
            assert!(close(b.share_per_ms, rate * demand_b / total), "{b:?}");
            assert!(
                close(a.share_per_ms / b.share_per_ms, demand_a / demand_b),
                "{a:?} {b:?}"
            );
            assert!(a.share_per_ms + b.share_per_ms <= rate * (1.0 + 1e-12));
        }
    }

    /// However holders come and renew, the shares of live holdings never add up to more than
    /// the rate.
    pub async fn live_shares_never_exceed_the_rate(s: &(impl Store + Peek)) {
        let k = unique("sum");
        let rate = limits("tenant").refill_per_ms();
        assert_eq!(one(s, lease("d", "tenant", &k, 10, 10)).await.granted, 10);
        // Units per second around the rate of 1/h (2.8e-4/s): some below it, all above it.
        let demands = [0.5e-4, 1e-4, 2e-4, 7e-4, 0.25e-4, 3e-4];
        let mut last = vec![0.0; demands.len()];
        for round in 0..3 {
            for (h, demand) in demands.iter().enumerate() {
                let id = format!("{round}-{h}");
                let g = one(s, ask(&id, "tenant", &k, (1, 5), &format!("h{h}"), *demand)).await;
                last[h] = g.share_per_ms;
                let sum: f64 = last.iter().sum();
                assert!(sum <= rate * (1.0 + 1e-9), "round {round}: {last:?}");
            }
        }
        let peeked = s.peek(&bucket("tenant", &k)).expect("bucket");
        let stored: f64 = peeked.holdings.iter().map(|h| h.share_per_ms).sum();
        assert!(stored <= rate * (1.0 + 1e-9), "{peeked:?}");
        assert_eq!(peeked.holdings.len(), demands.len());
        // Total demand is above the rate: after the renewals every holder has a part of it.
        assert!(last.iter().all(|&x| x > 0.0), "{last:?}");
    }

    /// A bucket keeps at most `MAX_HOLDERS` holdings: one more holder gets leases only.
    pub async fn holders_beyond_the_bound_get_leases_only(s: &(impl Store + Peek)) {
        let k = unique("bound");
        assert_eq!(one(s, lease("d", "tenant", &k, 10, 10)).await.granted, 10);
        for h in 0..MAX_HOLDERS {
            let g = one(
                s,
                ask(
                    &format!("i{h}"),
                    "tenant",
                    &k,
                    (1, 5),
                    &format!("h{h}"),
                    1.0,
                ),
            )
            .await;
            assert_eq!(g.granted, 0, "{g:?}");
        }
        let key = bucket("tenant", &k);
        assert_eq!(s.peek(&key).expect("bucket").holdings.len(), MAX_HOLDERS);
        // Three tokens back: a lease is possible again, an assignment is not (no room).
        assert_eq!(returned(s, "d", "tenant", &k, 3).await, 3);
        let extra = one(s, ask("x", "tenant", &k, (1, 5), "extra", 100.0)).await;
        assert!(extra.granted >= 1 && extra.granted < 5, "{extra:?}");
        assert_eq!((extra.share_per_ms, extra.period_ms), (0.0, 0), "{extra:?}");
        let peeked = s.peek(&key).expect("bucket");
        assert_eq!(peeked.holdings.len(), MAX_HOLDERS);
        assert!(peeked.holding("extra").is_none());
        // A known holder still renews.
        let known = one(s, ask("h0-again", "tenant", &k, (1, 5), "h0", 1.0)).await;
        assert!(!known.replayed);
        assert!(s.peek(&key).expect("bucket").holding("h0").is_some());
    }

    /// A replayed lease id answers the very same assignment and changes nothing.
    pub async fn a_replayed_assignment_is_identical(s: &(impl Store + Peek)) {
        let k = unique("replay-assign");
        assert_eq!(one(s, lease("d", "tenant", &k, 10, 10)).await.granted, 10);
        let first = one(s, ask("a", "tenant", &k, (1, 5), "ia", 50.0)).await;
        assert!(first.share_per_ms > 0.0, "{first:?}");
        let key = bucket("tenant", &k);
        let before = s.peek(&key).expect("bucket");
        let again = one(s, ask("a", "tenant", &k, (1, 5), "ia", 50.0)).await;
        assert_eq!(
            again,
            Grant {
                replayed: true,
                ..first
            }
        );
        let after = s.peek(&key).expect("bucket");
        assert_eq!(
            (after.state, &after.holdings),
            (before.state, &before.holdings)
        );
    }

    /// A return into a bucket in debt gives back at most what the lease took (grant plus the
    /// whole tokens of its share), added to the debt: never first lifted to zero.
    pub async fn returns_into_debt_add_to_it(s: &(impl Store + Peek)) {
        let k = unique("ret-debt");
        let l = limits("slowish");
        let started = Instant::now();
        let (id, a) = assigned(s, "slowish", &k, "ia", 10.0).await;
        // The whole rate, 3/s, for 20 s: 60 tokens of debt.
        assert!(close(a.share_per_ms, l.refill_per_ms()), "{a:?}");
        assert!(a.remaining < -55.0, "{a:?}");
        let took = taken(&a);
        assert_eq!(took, a.granted + 60);
        assert_eq!(returned(s, &id, "slowish", &k, 1_000).await, took);
        assert_eq!(returned(s, &id, "slowish", &k, 1_000).await, 0);
        let after = s.peek(&bucket("slowish", &k)).expect("bucket");
        let elapsed = started.elapsed().as_millis() as f64 + 2.0;
        // Lifted to zero first, the content would be `took` (capped at the burst): far more.
        let most = a.remaining + took as f64 + l.refill_per_ms() * elapsed;
        assert!(
            after.state.tokens >= a.remaining + took as f64 - 1e-9 && after.state.tokens <= most,
            "debt {} + return {took} (+ refill) is at most {most}: {after:?}",
            a.remaining
        );
    }

    /// A bucket in debt is kept until it has refilled from it, and while its holdings run.
    pub async fn debt_outlives_its_refill(s: &(impl Store + Peek)) {
        let k = unique("ttl-debt");
        let l = limits("slowish");
        // Taken before the call: the bucket is written after it, so its TTL has run for at most
        // this long when it is read (taken after the answer, a slow reply would hide time).
        let written = Instant::now();
        let (_, a) = assigned(s, "slowish", &k, "ia", 10.0).await;
        assert!(a.remaining < -55.0, "{a:?}");
        let peeked = s.peek(&bucket("slowish", &k)).expect("bucket");
        let elapsed = written.elapsed().as_millis() as u64 + 2;
        let now = peeked.state.updated_ms;
        let expected = bucket_ttl_ms(&l, &peeked.state, &peeked.holdings, now);
        // At least a full refill from the debt (about 21.7 s here), plus the margin.
        let refill = assign::refill_from_ms(&l, &peeked.state);
        assert!(refill > 21_000, "{refill}");
        assert!(expected >= refill + 1_000, "{expected} {refill}");
        assert!(
            expected > l.full_refill_ms() + 10_000,
            "beyond the debt-free TTL"
        );
        let ttl = peeked.ttl_ms.expect("a TTL");
        assert!(
            ttl <= expected + 2 && ttl + elapsed >= expected,
            "TTL {ttl} ms, expected {expected} ms (answered {elapsed} ms before)"
        );
    }

    /// A group where one item gets nothing changes no bucket and no holding.
    pub async fn a_failed_group_changes_nothing(s: &(impl Store + Peek)) {
        let t = unique("grp-assign");
        let route = format!("{t}:post");
        assert_eq!(one(s, lease("d", "tenant", &t, 10, 10)).await.granted, 10);
        assert_eq!(one(s, lease("r", "route", &route, 3, 3)).await.granted, 3);
        // A small share (demand below the rate), so the rest of the rate is free.
        let a = one(s, ask("a", "tenant", &t, (1, 5), "ia", 0.0001)).await;
        assert!(a.share_per_ms > 0.0, "{a:?}");
        let (tk, rk) = (bucket("tenant", &t), bucket("route", &route));
        let (tenant_before, route_before) = (s.peek(&tk).expect("t"), s.peek(&rk).expect("r"));
        let o = s
            .lease(&[
                ask("b", "tenant", &t, (1, 5), "ib", 0.0001),
                lease("r2", "route", &route, 1, 1),
            ])
            .await
            .expect("store answers");
        for g in &o.grants {
            assert_eq!(
                (g.granted, g.share_per_ms, g.period_ms),
                (0, 0.0, 0),
                "{o:?}"
            );
        }
        assert_eq!(o.grants[0].retry_after_ms, 0, "alone it got a share");
        let (tenant_after, route_after) = (s.peek(&tk).expect("t"), s.peek(&rk).expect("r"));
        assert_eq!(tenant_after.holdings, tenant_before.holdings);
        assert!((tenant_after.state.tokens - tenant_before.state.tokens).abs() < 1e-3);
        assert!((route_after.state.tokens - route_before.state.tokens).abs() < 1e-3);
        assert!(route_after.holdings.is_empty());
        // Alone, b gets its share.
        let b = one(s, ask("b2", "tenant", &t, (1, 5), "ib", 0.0001)).await;
        assert!(b.share_per_ms > 0.0, "{b:?}");
    }

    /// Windows: concurrent callers on one key of each algorithm get exactly the limit of the
    /// window (a day long: no boundary while the test runs).
    pub async fn windows_are_exact_under_contention(s: Arc<impl Store>) {
        let policies = ["fixed-day", "sliding-day", "log-day"];
        let keys: Vec<String> = policies.iter().map(|p| unique(p)).collect();
        let mut tasks = Vec::new();
        for (policy, key) in policies.iter().zip(&keys) {
            for c in 0..16u64 {
                let s = Arc::clone(&s);
                let (policy, key) = (policy.to_string(), key.clone());
                tasks.push(tokio::spawn(async move {
                    let mut total = 0;
                    for n in 0.. {
                        let id = format!("{c}-{n}");
                        let g = one(&*s, lease(&id, &policy, &key, 1, 1 + c % 3)).await;
                        if g.granted == 0 {
                            assert!(g.retry_after_ms > 0, "{g:?}");
                            break;
                        }
                        assert!(g.granted <= 1 + c % 3, "{g:?}");
                        total += g.granted;
                    }
                    (policy, total)
                }));
            }
        }
        let mut totals = std::collections::BTreeMap::<String, u64>::new();
        for t in tasks {
            let (policy, total) = t.await.expect("task");
            *totals.entry(policy).or_default() += total;
        }
        for policy in policies {
            assert_eq!(totals[policy], 100, "{policy}: {totals:?}");
        }
        // The limit is spent: a denial until the window ends (a fixed window: its end).
        let (now, d) = decide(&*s, lease("after", "fixed-day", &keys[0], 1, 1)).await;
        assert_eq!(d.granted, 0);
        let day = window_of("fixed-day").window_ms;
        assert_eq!(d.retry_after_ms, day - now % day, "{d:?}");
        assert_eq!((d.share_per_ms, d.period_ms), (0.0, 0));
    }

    /// A fixed window: the limit, then denials until the window's end (the lease and the
    /// denial both say when), then a new window starts from zero — the documented double
    /// burst at the boundary.
    pub async fn a_fixed_window_resets_at_its_boundary(s: &impl Store) {
        let w = early_in_a_window(s, "fixed").await;
        let k = unique("fixed");
        let mut model = Model::of("fixed");
        let (t1, g) = window_lease(s, &mut model, lease("a", "fixed", &k, 4, 100)).await;
        assert_eq!(
            g.granted, 10,
            "want clamped to the limit by the service; here: the room"
        );
        let end = w.end_ms(w.index(t1));
        assert_eq!(
            g.expires_ms,
            Some(end - t1),
            "the lease ends with its window"
        );
        let (t2, d) = window_lease(s, &mut model, lease("b", "fixed", &k, 1, 1)).await;
        assert_eq!(w.index(t2), w.index(t1), "stalled past the window");
        assert_eq!((d.granted, d.remaining), (0, 0.0));
        assert_eq!(
            d.retry_after_ms,
            end - t2,
            "a denial waits for the window's end"
        );
        past_the_window(&d, &w).await;
        let (t3, g) = window_lease(s, &mut model, lease("c", "fixed", &k, 1, 10)).await;
        assert!(t3 >= end, "{t3} {end}");
        assert_eq!(
            g.granted,
            10,
            "a new window: 20 units within {} ms",
            t3 - t1
        );
    }

    /// A sliding window counter weighs the previous window's count by the share of it still
    /// inside the rolling window: just past the boundary a full previous window leaves
    /// (almost) nothing, and a denial says when `min` fits.
    pub async fn a_sliding_window_weighs_the_previous_window(s: &impl Store) {
        let w = early_in_a_window(s, "sliding").await;
        let k = unique("sliding");
        let mut model = Model::of("sliding");
        let (t1, g) = window_lease(s, &mut model, lease("a", "sliding", &k, 10, 10)).await;
        assert_eq!(g.granted, 10);
        assert_eq!(g.expires_ms, Some(w.end_ms(w.index(t1)) - t1));
        past_the_window(&g, &w).await;
        let (t2, g) = window_lease(s, &mut model, lease("b", "sliding", &k, 1, 10)).await;
        assert_eq!(w.index(t2), w.index(t1) + 1, "stalled past the next window");
        // 10 × (1 − elapsed / 200) still counts: at most elapsed / 20 units fit.
        let elapsed = t2 % w.window_ms;
        assert!(
            g.granted <= elapsed / 20,
            "{g:?} {elapsed} ms into the window"
        );
        if g.granted == 0 {
            // The previous window's weight falls by one unit every 20 ms: `min` fits then.
            assert!(g.retry_after_ms <= 20, "{g:?}");
            tokio::time::sleep(Duration::from_millis(g.retry_after_ms)).await;
            let (_, g) = window_lease(s, &mut model, lease("c", "sliding", &k, 1, 1)).await;
            assert_eq!(g.granted, 1, "the denial's retry_after was enough");
        }
    }

    /// A sliding log's lease ends with the window-grid slot it was granted in, and its units
    /// count until a window after that (the instance may spend them until the lease ends), not
    /// a window after the grant: a denial waits for them, then they are freed at once.
    pub async fn a_sliding_log_frees_units_a_window_after_them(s: &impl Store) {
        let w = early_in_a_window(s, "log").await;
        let k = unique("log");
        let mut model = Model::of("log");
        let (t1, g) = window_lease(s, &mut model, lease("a", "log", &k, 4, 4)).await;
        let ends = w.end_ms(w.index(t1));
        assert_eq!((g.granted, g.expires_ms), (4, Some(ends - t1)));
        tokio::time::sleep(Duration::from_millis(40)).await;
        let (t2, g) = window_lease(s, &mut model, lease("b", "log", &k, 6, 6)).await;
        assert!(t2 < ends, "stalled past the slot");
        assert_eq!((g.granted, g.expires_ms), (6, Some(ends - t2)), "same end");
        past_the_window(&g, &w).await;
        let (t3, d) = window_lease(s, &mut model, lease("c", "log", &k, 1, 1)).await;
        assert!(
            t3 >= ends && t3 < ends + w.window_ms,
            "stalled past the window"
        );
        assert_eq!(
            d.granted, 0,
            "leased units count a window after their lease: {d:?}"
        );
        assert_eq!(d.retry_after_ms, ends + w.window_ms - t3, "{d:?}");
        tokio::time::sleep(Duration::from_millis(d.retry_after_ms)).await;
        let (t4, g) = window_lease(s, &mut model, lease("d", "log", &k, 10, 10)).await;
        assert_eq!(
            g.granted,
            10,
            "freed at {}, asked at {t4}",
            ends + w.window_ms
        );
    }

    /// A window's lease id is applied once: a repeat answers the original grant with what is
    /// left of its window, and takes nothing. Nothing of a window's lease comes back, under
    /// the window or under a token bucket the policy was switched to.
    pub async fn window_leases_are_replayed_and_give_nothing_back(s: &impl Store) {
        for policy in ["fixed-day", "sliding-day", "log-day"] {
            let k = unique(policy);
            let (t1, g) = decide(s, lease("a", policy, &k, 3, 5)).await;
            assert_eq!((g.granted, g.replayed), (5, false), "{policy}");
            let ends = t1 + g.expires_ms.expect("window");
            let (t2, again) = decide(s, lease("a", policy, &k, 3, 5)).await;
            assert_eq!(
                again,
                Grant {
                    replayed: true,
                    expires_ms: Some(ends - t2),
                    ..g
                },
                "{policy}"
            );
            assert_eq!(returned(s, "a", policy, &k, 5).await, 0, "{policy}");
            assert_eq!(returned(s, "unknown", policy, &k, 5).await, 0, "{policy}");
            let switched = ReturnItem {
                algorithm: Algorithm::TokenBucket,
                ..give_back("a", policy, &k, 5)
            };
            let back = s.give_back(&switched).await.expect("store answers");
            assert_eq!(back.returned, 0, "{policy}: drawn from a window");
            // The replay took nothing, the returns gave nothing back.
            assert_eq!(
                one(s, lease("b", policy, &k, 1, 100)).await.granted,
                95,
                "{policy}"
            );
            assert_eq!(
                one(s, lease("c", policy, &k, 1, 1)).await.granted,
                0,
                "{policy}"
            );
        }
    }

    /// Windows of different keys never share state, and a policy switched from one algorithm
    /// (or window length) to another starts from fresh state of its own in both directions.
    pub async fn window_state_is_per_key_and_per_algorithm(s: &impl Store) {
        let (a, b) = (unique("wiso-a"), unique("wiso-b"));
        assert_eq!(
            one(s, lease("1", "fixed-day", &a, 100, 100)).await.granted,
            100
        );
        assert_eq!(one(s, lease("2", "fixed-day", &a, 1, 1)).await.granted, 0);
        assert_eq!(
            one(s, lease("3", "fixed-day", &b, 100, 100)).await.granted,
            100
        );
        let day = window_of("fixed-day");
        let half = Window::new(100, day.window_ms / 2).expect("window");
        let as_bucket = |id: &str| LeaseItem {
            algorithm: Algorithm::TokenBucket,
            limits: limits("hundred"),
            ..lease(id, "fixed-day", &a, 1, 100)
        };
        for (id, switched) in [
            ("log", Algorithm::SlidingLog(day)),
            ("sliding", Algorithm::SlidingWindow(day)),
            ("half", Algorithm::FixedWindow(half)),
        ] {
            let item = LeaseItem {
                algorithm: switched,
                ..lease(id, "fixed-day", &a, 1, 100)
            };
            assert_eq!(one(s, item).await.granted, 100, "fixed_window → {id}");
        }
        assert_eq!(
            one(s, as_bucket("bucket")).await.granted,
            100,
            "→ token bucket"
        );
        assert_eq!(
            one(s, lease("4", "fixed-day", &a, 1, 1)).await.granted,
            0,
            "untouched"
        );
        // And from a drained token bucket to a window and back.
        let c = unique("wiso-c");
        assert_eq!(one(s, lease("5", "tenant", &c, 10, 10)).await.granted, 10);
        let windowed = LeaseItem {
            algorithm: Algorithm::FixedWindow(Window::new(10, day.window_ms).expect("w")),
            ..lease("6", "tenant", &c, 1, 10)
        };
        assert_eq!(
            one(s, windowed).await.granted,
            10,
            "token bucket → fixed_window"
        );
        assert_eq!(
            one(s, lease("7", "tenant", &c, 1, 1)).await.granted,
            0,
            "still drained"
        );
    }

    /// A group may mix windows and token buckets (one hash tag): all or nothing, whichever
    /// runs out; the others are not charged.
    pub async fn groups_mix_windows_and_buckets(s: &impl Store) {
        let t = unique("wgrp");
        let route = format!("{t}:post");
        let group = |n: u32| {
            vec![
                lease(&format!("t{n}"), "tenant", &t, 1, 1),
                lease(&format!("r{n}"), "route-fixed", &route, 1, 1),
            ]
        };
        for n in 0..3 {
            let o = s.lease(&group(n)).await.expect("store answers");
            assert_eq!((o.grants[0].granted, o.grants[1].granted), (1, 1), "{o:?}");
            assert_eq!(
                (o.grants[0].expires_ms, o.grants[1].expires_ms.is_some()),
                (None, true)
            );
        }
        let o = s.lease(&group(3)).await.expect("store answers");
        assert_eq!((o.grants[0].granted, o.grants[1].granted), (0, 0), "{o:?}");
        assert_eq!(
            o.grants[0].retry_after_ms, 0,
            "the bucket item alone was fine"
        );
        assert!(o.grants[1].retry_after_ms > 0, "{o:?}");
        assert!((o.grants[0].remaining - 7.0).abs() < 0.01, "{o:?}");
        assert_eq!(one(s, lease("t4", "tenant", &t, 7, 7)).await.granted, 7);

        // The bucket runs out: the windows of the group are not charged.
        let u = unique("wgrp-b");
        assert_eq!(one(s, lease("d", "tenant", &u, 10, 10)).await.granted, 10);
        let o = s
            .lease(&[
                lease("f", "fixed-day", &u, 5, 5),
                lease("l", "log-day", &u, 5, 5),
                lease("w", "sliding-day", &u, 5, 5),
                lease("b", "tenant", &u, 1, 1),
            ])
            .await
            .expect("store answers");
        for (i, g) in o.grants.iter().enumerate() {
            assert_eq!(g.granted, 0, "{i}: {o:?}");
        }
        for g in &o.grants[..3] {
            assert_eq!(
                (g.retry_after_ms, g.remaining),
                (0, 100.0),
                "alone it fit: {o:?}"
            );
        }
        for policy in ["fixed-day", "log-day", "sliding-day"] {
            let g = one(s, lease("all", policy, &u, 100, 100)).await;
            assert_eq!(g.granted, 100, "{policy} untouched");
        }
    }

    /// Calendar windows (a week from Monday, a month, a quarter, a year, UTC) on the store's
    /// clock: a lease ends, and a denial waits, until the next calendar boundary (computed
    /// here the slow way), exactly as core decides; the state is the calendar window's own,
    /// apart from a fixed window of the same longest length (`31d` beside `1mo`).
    pub async fn calendar_windows_end_at_calendar_boundaries(s: &impl Store) {
        for policy in ["weekly", "monthly", "quarterly", "yearly"] {
            let k = unique(policy);
            let mut model = Model::of(policy);
            let (t1, g) = window_lease(s, &mut model, lease("a", policy, &k, 2, 3)).await;
            assert_eq!(g.granted, 3, "{policy}");
            let ends = next_utc_boundary(policy, t1);
            assert_eq!(
                g.expires_ms,
                Some(ends - t1),
                "{policy}: the lease ends with it"
            );
            let (t2, g) = window_lease(s, &mut model, lease("b", policy, &k, 2, 9)).await;
            assert_eq!(g.granted, 2, "{policy}");
            let (t3, d) = window_lease(s, &mut model, lease("c", policy, &k, 1, 1)).await;
            assert_eq!(
                next_utc_boundary(policy, t3),
                ends,
                "{policy}: a calendar boundary passed while the case ran ({t1}, {t2}, {t3})"
            );
            assert_eq!((d.granted, d.remaining), (0, 0.0), "{policy}");
            assert_eq!(d.retry_after_ms, ends - t3, "{policy}: until the boundary");
        }
        // A month and 31 days (the month's longest length) keep separate state.
        let k = unique("month-vs-31d");
        assert_eq!(one(s, lease("m", "monthly", &k, 5, 5)).await.granted, 5);
        let days = LeaseItem {
            algorithm: Algorithm::FixedWindow(
                Window::new(5, window_of("monthly").window_ms).expect("window"),
            ),
            ..lease("d", "monthly", &k, 5, 5)
        };
        assert_eq!(one(s, days).await.granted, 5, "31d has a window of its own");
        assert_eq!(one(s, lease("m2", "monthly", &k, 1, 1)).await.granted, 0);
    }

    /// Malformed calls are refused as errors, never as decisions.
    pub async fn store_rejects_nothing_valid(s: &impl Store) {
        s.ready().await.expect("ready");
        let keys = s.active_keys().await.expect("active keys");
        assert!(!keys.is_empty());
        assert!(!s.node_for("acme").is_empty());
        // The decision code's execution statistics, per node, count the lease just made.
        let u = unique("exec");
        assert_eq!(one(s, lease("e", "tenant", &u, 1, 1)).await.granted, 1);
        let stats = s.exec_stats().await.expect("execution statistics");
        assert!(!stats.is_empty());
        assert!(
            stats
                .iter()
                .all(|(node, e)| !node.is_empty() && e.usec >= 0.0),
            "{stats:?}"
        );
        assert!(
            stats.iter().map(|(_, e)| e.calls).sum::<u64>() >= 1,
            "{stats:?}"
        );
    }

    /// `Store::count`: exact admission at the limit with costs above 1; a refused hit takes
    /// nothing (a smaller one still fits after it) and answers what was left before it.
    pub async fn count_is_exact_at_the_limit(s: &(impl Store + Peek)) {
        let (limit, window_ms) = (5, HOUR_MS);
        for _ in 0..3 {
            let k = rls_key(&unique("count"), &[("tenant", "t")]);
            let mut outcomes = Vec::new();
            for cost in [2, 3, 1, 4] {
                outcomes.push(count(s, &[count_item(&k, limit, window_ms, cost)]).await);
            }
            let other = rls_key(&unique("count"), &[("tenant", "u")]);
            for cost in [4, 2, 1, 1] {
                outcomes.push(count(s, &[count_item(&other, limit, window_ms, cost)]).await);
            }
            if !in_one_window(&outcomes, window_ms) {
                continue;
            }
            let answers: Vec<(bool, Vec<u64>)> = outcomes
                .iter()
                .map(|o| (o.admitted, o.remaining.clone()))
                .collect();
            assert_eq!(
                answers,
                [
                    (true, vec![3]),
                    (true, vec![0]),
                    (false, vec![0]),
                    (false, vec![0]),
                    (true, vec![1]),
                    (false, vec![1]),
                    (true, vec![0]),
                    (false, vec![0]),
                ]
            );
            // The counts as stored: the limit exactly, expiring with the window (plus the
            // margin), on the store's clock.
            let last = outcomes.last().expect("outcomes");
            let index = last.now_ms / window_ms;
            let ends = (index + 1) * window_ms;
            for key in [&k, &other] {
                let count_key =
                    fixed_count_key(&count_item(key, limit, window_ms, 1).window_key(), index);
                let (stored, ttl) = s.peek_count(&count_key).expect("a stored count");
                assert_eq!(stored, limit, "{count_key}");
                let expected = ends - last.now_ms + WINDOW_TTL_MARGIN_MS;
                assert!(
                    ttl <= expected && ttl + 2_000 >= expected,
                    "{count_key}: {ttl} ms, not {expected}"
                );
            }
            return;
        }
        panic!("three attempts crossed a window boundary");
    }

    /// `Store::count` decides a same-tag group all or nothing: one item over its limit holds
    /// back every other, which keeps what it had; items of one window add up in order.
    pub async fn count_groups_are_all_or_nothing(s: &impl Store) {
        let window_ms = HOUR_MS;
        for _ in 0..3 {
            let domain = unique("count-group");
            let tenant = rls_key(&domain, &[("tenant", "t")]);
            let path = rls_key(&domain, &[("tenant", "t"), ("path", "/a")]);
            let other = rls_key(&domain, &[("tenant", "t"), ("path", "/b")]);
            let pair = [
                count_item(&tenant, 3, window_ms, 1),
                count_item(&path, 1, window_ms, 1),
            ];
            let outcomes = vec![
                count(s, &pair).await,
                // The path's window is full: the pair is refused, the tenant's untouched.
                count(s, &pair).await,
                count(s, &[count_item(&tenant, 3, window_ms, 2)]).await,
                count(s, &[count_item(&tenant, 3, window_ms, 1)]).await,
                // Two items of one window: 2 + 2 > 3 refuses both, 1 + 2 fits.
                count(
                    s,
                    &[
                        count_item(&other, 3, window_ms, 2),
                        count_item(&other, 3, window_ms, 2),
                    ],
                )
                .await,
                count(
                    s,
                    &[
                        count_item(&other, 3, window_ms, 1),
                        count_item(&other, 3, window_ms, 2),
                    ],
                )
                .await,
            ];
            if !in_one_window(&outcomes, window_ms) {
                continue;
            }
            let answers: Vec<(bool, Vec<u64>)> = outcomes
                .iter()
                .map(|o| (o.admitted, o.remaining.clone()))
                .collect();
            assert_eq!(
                answers,
                [
                    (true, vec![2, 0]),
                    (false, vec![2, 0]),
                    (true, vec![0]),
                    (false, vec![0]),
                    (false, vec![3, 3]),
                    (true, vec![2, 0]),
                ]
            );
            return;
        }
        panic!("three attempts crossed a window boundary");
    }

    /// `Store::count`'s windows follow the store's clock: a full window admits again once
    /// the next one starts, with its whole limit, and windows are aligned to the epoch.
    pub async fn count_windows_reset_on_the_store_clock(s: &impl Store) {
        let window_ms = 1_000;
        for _ in 0..3 {
            let k = rls_key(&unique("count-reset"), &[("tenant", "t")]);
            let item = |cost| count_item(&k, 2, window_ms, cost);
            let full = count(s, &[item(2)]).await;
            let refused = count(s, &[item(1)]).await;
            if !in_one_window(&[full.clone(), refused.clone()], window_ms) {
                continue;
            }
            assert_eq!((full.admitted, full.remaining.as_slice()), (true, &[0][..]));
            assert_eq!(
                (refused.admitted, refused.remaining.as_slice()),
                (false, &[0][..])
            );
            // Past the end of the window on the store's clock (the same host's clock).
            let ends = (refused.now_ms / window_ms + 1) * window_ms;
            tokio::time::sleep(Duration::from_millis(ends - refused.now_ms + 3)).await;
            let next = count(s, &[item(2)]).await;
            assert!(next.now_ms >= ends, "{next:?}, the window ended at {ends}");
            assert_eq!((next.admitted, next.remaining.as_slice()), (true, &[0][..]));
            return;
        }
        panic!("three attempts crossed a window boundary");
    }

    /// Every store answers `Store::count` as a plain model of epoch-aligned windows fed the
    /// store's clock: a random sequence of groups over three keys of one tag, windows of
    /// 200 ms so the sequence crosses several, costs 1 to 3, limits 3 to 5. The memory store
    /// and the Redis Function are held to the same model, so to each other.
    pub async fn count_agrees_with_the_model(s: &impl Store) {
        use std::collections::HashMap;
        let window_ms = 200;
        let domain = unique("count-model");
        let keys: Vec<String> = ["a", "b", "c"]
            .iter()
            .map(|p| rls_key(&domain, &[("tenant", "t"), ("p", p)]))
            .collect();
        let mut model: HashMap<(usize, u64), u64> = HashMap::new();
        let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for step in 0..150 {
            let len = 1 + next(3) as usize;
            // (key, its limit: one per key, as a rule gives it, cost)
            let picks: Vec<(usize, u64, u64)> = (0..len)
                .map(|_| {
                    let key = next(3) as usize;
                    (key, 3 + key as u64, 1 + next(3))
                })
                .collect();
            let items: Vec<CountItem> = picks
                .iter()
                .map(|&(key, limit, cost)| count_item(&keys[key], limit, window_ms, cost))
                .collect();
            let o = count(s, &items).await;
            let index = o.now_ms / window_ms;
            let mut after: HashMap<usize, u64> = HashMap::new();
            let mut fits = true;
            let mut remaining = Vec::new();
            for &(key, limit, cost) in &picks {
                let c = after
                    .entry(key)
                    .or_insert_with(|| model.get(&(key, index)).copied().unwrap_or(0));
                *c += cost;
                fits &= *c <= limit;
                remaining.push(limit.saturating_sub(*c));
            }
            if fits {
                for (key, c) in after {
                    model.insert((key, index), c);
                }
            } else {
                remaining = picks
                    .iter()
                    .map(|&(key, limit, _)| {
                        limit.saturating_sub(model.get(&(key, index)).copied().unwrap_or(0))
                    })
                    .collect();
            }
            assert_eq!(
                (o.admitted, o.remaining.clone()),
                (fits, remaining),
                "step {step}: {picks:?} at {}",
                o.now_ms
            );
            if step % 10 == 9 {
                tokio::time::sleep(Duration::from_millis(37)).await;
            }
        }
    }

    /// The RateLimitService's items (`tollgate_limiter::rls`): fixed windows under the
    /// reserved policy, keyed by domain and descriptor entries (`store::rls_key`), `min` =
    /// `want` = the hit's cost. Descriptors sharing their first entry share a hash tag, so one
    /// call decides them all or nothing (on a Cluster too: one slot); the others are
    /// independent.
    pub async fn rls_descriptors_share_a_window_by_hash_tag(s: &impl Store) {
        use tollgate_limiter::store::{rls_key, RLS_POLICY};
        let domain = unique("rls");
        let item = |id: &str, entries: &[(&str, &str)], limit: u64, cost: u64| {
            let window = Window::new(limit, 3_600_000).unwrap();
            LeaseItem {
                id: unique(id),
                policy: RLS_POLICY.into(),
                key: rls_key(&domain, entries),
                limits: tollgate_core::bucket::Limits::new(limit, 3_600_000, limit).unwrap(),
                algorithm: Algorithm::FixedWindow(window),
                min: cost,
                want: cost,
                holder: None,
                demand_per_ms: 0.0,
            }
        };
        let tenant = [("tenant", "t")];
        let path = [("tenant", "t"), ("path", "/a")];
        let granted = |o: &tollgate_limiter::store::LeaseOutcome| {
            o.grants.iter().map(|g| g.granted).collect::<Vec<_>>()
        };
        // One call, one slot: both counted.
        let o = s
            .lease(&[item("a", &tenant, 3, 1), item("b", &path, 1, 1)])
            .await
            .expect("a same-tag group is one call");
        assert_eq!(granted(&o), [1, 1]);
        // The nested window is full: the pair is refused and the tenant's window untouched.
        let o = s
            .lease(&[item("a", &tenant, 3, 1), item("b", &path, 1, 1)])
            .await
            .unwrap();
        assert_eq!(granted(&o), [0, 0]);
        // Its cost of 2 still fits the tenant's window alone (3 - 1), then nothing does.
        let (_, g) = decide(s, item("c", &tenant, 3, 2)).await;
        assert_eq!((g.granted, g.remaining), (2, 0.0));
        let (_, g) = decide(s, item("d", &tenant, 3, 1)).await;
        assert_eq!(g.granted, 0);
        assert!(
            g.retry_after_ms > 0 && g.retry_after_ms <= 3_600_000,
            "{g:?}"
        );
        // Another first entry (another tag) and another domain: windows of their own.
        let (_, g) = decide(s, item("e", &[("tenant", "u")], 3, 3)).await;
        assert_eq!(g.granted, 3);
        let other = LeaseItem {
            key: rls_key(&unique("rls"), &tenant),
            ..item("f", &tenant, 3, 3)
        };
        assert_eq!(decide(s, other).await.1.granted, 3);
        // Hostile values stay in their key's slot and bounded.
        let long = "v".repeat(65_536);
        let (_, g) = decide(s, item("g", &[("tenant", "{t}"), ("p", &long)], 1, 1)).await;
        assert_eq!(g.granted, 1);
    }
}

macro_rules! contract {
    ($store:ident, $make:expr) => {
        mod $store {
            use super::*;

            async fn store() -> impl Store + Peek {
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
            async fn a_drained_bucket_assigns_a_share() {
                cases::a_drained_bucket_assigns_a_share(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shares_follow_demand() {
                cases::shares_follow_demand(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn live_shares_never_exceed_the_rate() {
                cases::live_shares_never_exceed_the_rate(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn holders_beyond_the_bound_get_leases_only() {
                cases::holders_beyond_the_bound_get_leases_only(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_replayed_assignment_is_identical() {
                cases::a_replayed_assignment_is_identical(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn returns_into_debt_add_to_it() {
                cases::returns_into_debt_add_to_it(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn debt_outlives_its_refill() {
                cases::debt_outlives_its_refill(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_failed_group_changes_nothing() {
                cases::a_failed_group_changes_nothing(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn windows_are_exact_under_contention() {
                cases::windows_are_exact_under_contention(Arc::new(store().await)).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_fixed_window_resets_at_its_boundary() {
                cases::a_fixed_window_resets_at_its_boundary(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_sliding_window_weighs_the_previous_window() {
                cases::a_sliding_window_weighs_the_previous_window(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_sliding_log_frees_units_a_window_after_them() {
                cases::a_sliding_log_frees_units_a_window_after_them(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn window_leases_are_replayed_and_give_nothing_back() {
                cases::window_leases_are_replayed_and_give_nothing_back(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn window_state_is_per_key_and_per_algorithm() {
                cases::window_state_is_per_key_and_per_algorithm(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn groups_mix_windows_and_buckets() {
                cases::groups_mix_windows_and_buckets(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn calendar_windows_end_at_calendar_boundaries() {
                cases::calendar_windows_end_at_calendar_boundaries(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rls_descriptors_share_a_window_by_hash_tag() {
                cases::rls_descriptors_share_a_window_by_hash_tag(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn count_is_exact_at_the_limit() {
                cases::count_is_exact_at_the_limit(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn count_groups_are_all_or_nothing() {
                cases::count_groups_are_all_or_nothing(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn count_windows_reset_on_the_store_clock() {
                cases::count_windows_reset_on_the_store_clock(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn count_agrees_with_the_model() {
                cases::count_agrees_with_the_model(&store().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ready_and_observable() {
                cases::store_rejects_nothing_valid(&store().await).await;
            }
        }
    };
}

contract!(memory, MemoryStore::new(settings()));
#[cfg(feature = "e2e")]
contract!(redis, {
    let s = RedisStore::new(&shared_redis().url(), &RedisSecurity::default(), settings())
        .expect("redis store");
    until_ready(&s, "redis store ready").await;
    s
});
#[cfg(feature = "e2e")]
contract!(cluster, {
    let s = RedisClusterStore::new(
        &shared_cluster().urls(),
        &RedisSecurity::default(),
        settings(),
    )
    .expect("cluster store");
    until_ready(&s, "cluster ready").await;
    eventually("slot map", || s.refresh_slot_map()).await;
    s
});
// The same contract over TLS, with a client certificate and an ACL user's password: the
// store only ever reaches the TLS port.
#[cfg(feature = "e2e")]
contract!(redis_tls, {
    let s = RedisStore::new(
        &shared_tls_redis().server.tls_url(),
        &shared_tls_redis().security,
        settings(),
    )
    .expect("TLS redis store");
    until_ready(&s, "TLS redis store ready").await;
    s
});
#[cfg(feature = "e2e")]
contract!(cluster_tls, {
    let tls = shared_tls_cluster();
    // One start-up node is enough: the others come from CLUSTER SLOTS, at their TLS ports.
    let s = RedisClusterStore::new(&tls.cluster.tls_urls()[..1], &tls.security, settings())
        .expect("TLS cluster store");
    // Connecting means a TLS handshake with every node, which a loaded machine can take
    // longer than the client's connection deadline for: the store is ready when it says so.
    until_ready(&s, "TLS cluster ready").await;
    eventually("slot map", || s.refresh_slot_map()).await;
    s
});

/// Redis-specific: bucket keys expire after a full refill plus margin, lease records after
/// the dedup TTL; and both live in the tenant's slot.
#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_carry_ttls_and_share_a_slot() {
    let redis = shared_redis();
    let s =
        RedisStore::new(&redis.url(), &RedisSecurity::default(), settings()).expect("redis store");
    until_ready(&s, "redis store ready").await;
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

/// `PTTL` of `key` is `expected` ms, less at most the time since the call that set it.
#[cfg(feature = "e2e")]
fn assert_pttl(redis: &tollgate_e2e::RedisServer, key: &str, expected: u64, since: Instant) {
    let pttl = redis.cmd(&["PTTL", key]).as_int().expect("pttl");
    let pttl = u64::try_from(pttl).unwrap_or_else(|_| panic!("{key}: PTTL {pttl}"));
    let waited = since.elapsed().as_millis() as u64 + 2;
    assert!(
        pttl <= expected && pttl + waited >= expected,
        "{key}: PTTL {pttl}, expected {expected} ({waited} ms later)"
    );
}

/// Redis-specific: where each window keeps its state (keys of `store::keys`, derived keys in
/// the same slot), how long (`window_ttl_ms`: until the state equals a fresh one, plus the
/// margin), and the lease record of a window (nothing returnable, the window's end).
#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_windows_keep_their_state_under_their_own_keys() {
    use tollgate_limiter::store::{fixed_count_key, log_seen_key, WINDOW_TTL_MARGIN_MS};
    let redis = shared_redis();
    let s =
        RedisStore::new(&redis.url(), &RedisSecurity::default(), settings()).expect("redis store");
    until_ready(&s, "redis store ready").await;
    let day = window_of("fixed-day").window_ms;
    let k = unique("wkeys");

    let item = lease("f", "fixed-day", &k, 1, 5);
    let (state, record) = (item.state_key(), item.lease_key());
    let called = Instant::now();
    let (now, g) = decide(&s, item).await;
    assert_eq!(g.granted, 5);
    let (index, end) = (now / day, (now / day + 1) * day);
    assert_eq!(redis.cmd(&["GET", &state]).as_int(), Some(index as i64));
    let count = fixed_count_key(&state, index);
    assert_eq!(redis.cmd(&["GET", &count]).as_int(), Some(5));
    for key in [&state, &count] {
        assert_pttl(redis, key, end - now + WINDOW_TTL_MARGIN_MS, called);
    }
    let fields = redis.cmd(&["HGETALL", &record]).to_text();
    let fields: Vec<&str> = fields.lines().collect();
    let field = |name: &str| {
        let at = fields.iter().position(|f| *f == name).expect(name);
        fields[at + 1].to_owned()
    };
    assert_eq!(
        (field("g"), field("n")),
        ("0".into(), "5".into()),
        "nothing returnable"
    );
    assert_eq!(field("b"), state);
    assert_eq!(
        field("e"),
        end.to_string(),
        "the lease ends with the window"
    );

    let item = lease("s", "sliding-day", &k, 1, 5);
    let state = item.state_key();
    let called = Instant::now();
    let (now, _) = decide(&s, item).await;
    let hash = redis.cmd(&["HMGET", &state, "w", "c", "p"]).to_text();
    assert_eq!(hash, format!("{}\n5\n0", now / day));
    // Two windows: the previous one weighs on the next.
    assert_pttl(
        redis,
        &state,
        (now / day + 2) * day - now + WINDOW_TTL_MARGIN_MS,
        called,
    );

    let item = lease("l", "log-day", &k, 1, 5);
    let state = item.state_key();
    let called = Instant::now();
    let (now, _) = decide(&s, item).await;
    let units = redis
        .cmd(&["ZRANGE", &state, "0", "-1", "WITHSCORES"])
        .to_text();
    let units: Vec<&str> = units.lines().collect();
    assert_eq!(units.len(), 10, "{units:?}");
    let members: std::collections::HashSet<&str> = units.iter().step_by(2).copied().collect();
    assert_eq!(members.len(), 5, "unique members: {units:?}");
    // Leased units are entered when their lease ends (the end of the day), and count a
    // window after that.
    let end = (now / day + 1) * day;
    assert!(
        units
            .iter()
            .skip(1)
            .step_by(2)
            .all(|t| *t == end.to_string()),
        "{units:?}"
    );
    let seen = log_seen_key(&state);
    assert_eq!(redis.cmd(&["GET", &seen]).as_int(), Some(now as i64));
    for key in [&state, &seen] {
        assert_pttl(redis, key, end + day - now + WINDOW_TTL_MARGIN_MS, called);
    }
}

/// Redis-specific: a clock that went back (a failover to a node whose clock is behind the
/// one that wrote the state) creates no capacity. State written "in the future" is planted
/// behind the store's back; the Function counts in the newest window, on the newest time,
/// it has seen — exactly what core answers for that state.
#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_windows_count_on_the_newest_time_seen() {
    use tollgate_limiter::store::{fixed_count_key, log_seen_key};
    let redis = shared_redis();
    let s =
        RedisStore::new(&redis.url(), &RedisSecurity::default(), settings()).expect("redis store");
    until_ready(&s, "redis store ready").await;
    let k = unique("wback");
    let w = window_of("fixed");
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as u64
    };
    // Three windows (600 ms) ahead of this clock.
    let ahead = w.index(now()) + 3;
    let planted = Counters {
        window: ahead,
        count: 10,
        previous: 0,
    };

    let item = lease("f", "fixed", &k, 1, 1);
    let state = item.state_key();
    redis.cmd(&["SET", &state, &ahead.to_string(), "PX", "60000"]);
    redis.cmd(&["SET", &fixed_count_key(&state, ahead), "10", "PX", "60000"]);
    let (t, g) = decide(&s, item).await;
    assert!(
        w.index(t) < ahead,
        "the planted window is ahead of Redis' clock"
    );
    let (_, core) = window::lease(CounterKind::Fixed, &w, Some(planted), t, 1, 1);
    assert_eq!(
        (g.granted, g.retry_after_ms),
        (0, core.retry_after_ms),
        "{g:?}"
    );
    assert_eq!(
        g.retry_after_ms,
        w.end_ms(ahead) - t,
        "until the newest window ends"
    );

    let item = lease("s", "sliding", &k, 1, 1);
    let state = item.state_key();
    redis.cmd(&["HSET", &state, "w", &ahead.to_string(), "c", "10", "p", "0"]);
    redis.cmd(&["PEXPIRE", &state, "60000"]);
    let (t, g) = decide(&s, item).await;
    let (_, core) = window::lease(CounterKind::Sliding, &w, Some(planted), t, 1, 1);
    assert_eq!((g.granted, g.remaining), (0, 0.0), "{g:?}");
    assert_eq!(g.retry_after_ms, core.retry_after_ms, "{g:?}");

    // A log that has seen 5 s ahead: a unit 5.1 s old by it has left (by this clock it would
    // not have), a unit leased now is leased at the time it has seen (and entered at the end
    // of that time's slot), and units still in its window count.
    let item = lease("l", "log", &k, 1, 10);
    let state = item.state_key();
    let seen = now() + 5_000;
    let gone = seen - w.window_ms - 100;
    let mut zadd = vec!["ZADD".to_owned(), state.clone()];
    zadd.extend([gone.to_string(), format!("{gone}:x")]);
    for n in 0..7 {
        zadd.extend([seen.to_string(), format!("{seen}:{n}")]);
    }
    let zadd: Vec<&str> = zadd.iter().map(String::as_str).collect();
    redis.cmd(&zadd);
    redis.cmd(&["PEXPIRE", &state, "60000"]);
    redis.cmd(&[
        "SET",
        &log_seen_key(&state),
        &seen.to_string(),
        "PX",
        "60000",
    ]);
    let (t, g) = decide(&s, item).await;
    assert!(
        t < gone + w.window_ms,
        "by Redis' clock the old unit is still in"
    );
    let mut log = Log {
        times: std::iter::once(gone).chain([seen; 7]).collect(),
        seen_ms: seen,
    };
    let core = log.lease(&w, t, 1, 10);
    assert_eq!((g.granted, g.remaining), (3, 0.0), "{g:?}");
    assert_eq!(
        (g.granted, g.retry_after_ms),
        (core.granted, core.retry_after_ms)
    );
    let scores = redis
        .cmd(&["ZRANGE", &state, "0", "-1", "WITHSCORES"])
        .to_text();
    let scores: Vec<u64> = scores
        .lines()
        .skip(1)
        .step_by(2)
        .map(|t| t.parse().unwrap())
        .collect();
    let ends = log.lease_end_ms(&w);
    assert_eq!(
        scores,
        [vec![seen; 7], vec![ends; 3]].concat(),
        "leased at the time it has seen, entered when that lease ends, not before"
    );
    let (_, d) = decide(&s, lease("l2", "log", &k, 1, 1)).await;
    assert_eq!(
        (d.granted, d.retry_after_ms),
        (0, w.window_ms),
        "a window after `seen`"
    );
}

/// Redis-specific: calendar windows across a real boundary, on a `redis-server` whose clock
/// is set seconds before 1 January 2029 00:00 UTC (a Monday: a week, a month, a quarter and a
/// year end at that instant). Each window's limit is spent in 2028 and a denial waits for the
/// boundary; past it each gives its limit again, until its next boundary (7, 31, 90 and 365
/// days on), and every answer is core's at Redis' clock.
#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_calendar_windows_cross_the_new_year() {
    use tollgate_e2e::{RedisOptions, RedisServer};
    use tollgate_limiter::store::{fixed_count_key, WINDOW_TTL_MARGIN_MS};
    const DAY: u64 = 86_400_000;
    const NEW_YEAR_2029: u64 = 21_550 * DAY;
    /// How far before the boundary Redis' clock starts: room to start it and load the library
    /// on a loaded machine.
    const LEAD_MS: u64 = 8_000;
    let host_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let offset = (NEW_YEAR_2029 - LEAD_MS) as i64 - host_now as i64;
    let redis = tokio::task::block_in_place(|| {
        RedisServer::start_with(RedisOptions {
            env: tollgate_e2e::clock::offset_env(offset),
            ..RedisOptions::default()
        })
    });
    let s =
        RedisStore::new(&redis.url(), &RedisSecurity::default(), settings()).expect("redis store");
    until_ready(&s, "skewed redis store ready").await;
    let policies = ["weekly", "monthly", "quarterly", "yearly"];
    // One key for all four (lease ids carry the policy: a lease record is per key and id).
    let k = unique("new-year");
    let mut models: Vec<Model> = policies.iter().map(|p| Model::of(p)).collect();
    let mut last = 0;
    for (policy, model) in policies.iter().zip(&mut models) {
        let (t, g) = window_lease(&s, model, lease(&format!("{policy}-a"), policy, &k, 5, 5)).await;
        assert!(
            t < NEW_YEAR_2029 - 500,
            "Redis' clock passed the new year before the test could use it ({t})"
        );
        assert_eq!(next_utc_boundary(policy, t), NEW_YEAR_2029, "{policy}");
        assert_eq!(
            (g.granted, g.expires_ms),
            (5, Some(NEW_YEAR_2029 - t)),
            "{policy}"
        );
        let (t, d) = window_lease(&s, model, lease(&format!("{policy}-b"), policy, &k, 1, 1)).await;
        assert_eq!(
            (d.granted, d.retry_after_ms),
            (0, NEW_YEAR_2029 - t),
            "{policy}: until the new year"
        );
        last = t;
    }
    tokio::time::sleep(Duration::from_millis(NEW_YEAR_2029 - last + 5)).await;
    for ((policy, model), days) in policies.iter().zip(&mut models).zip([7, 31, 90, 365]) {
        let (t, g) = window_lease(&s, model, lease(&format!("{policy}-c"), policy, &k, 1, 9)).await;
        assert!(t >= NEW_YEAR_2029, "{t}");
        let ends = NEW_YEAR_2029 + days * DAY;
        assert_eq!(next_utc_boundary(policy, t), ends, "{policy}");
        assert_eq!(
            (g.granted, g.expires_ms),
            (5, Some(ends - t)),
            "{policy}: a new window, to its own next boundary"
        );
    }
    // The 2028 windows' state expires with 2028 (plus the margin) on Redis' clock; 2029's
    // lives until its own end.
    let state = lease("-", "monthly", &k, 1, 1).state_key();
    assert!(state.ends_with("|fixed:1mo"), "{state}");
    let pttl = |key: &str| redis.cmd(&["PTTL", key]).as_int().expect("PTTL");
    let index_2029 = window_of("monthly").index(NEW_YEAR_2029);
    let count_2029 = pttl(&fixed_count_key(&state, index_2029));
    assert!(
        count_2029 > (31 * DAY - 60_000) as i64 && count_2029 <= (31 * DAY + 1_000) as i64,
        "{count_2029}"
    );
    let december = pttl(&fixed_count_key(&state, index_2029 - 1));
    assert!(
        december <= WINDOW_TTL_MARGIN_MS as i64,
        "December's count expires with December, plus the margin: {december}"
    );
}

/// A Redis the store cannot reach is an error, never an answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_redis_is_an_error() {
    let port = tollgate_e2e::free_port();
    let s = RedisStore::new(
        &format!("redis://127.0.0.1:{port}"),
        &RedisSecurity::default(),
        settings(),
    )
    .expect("store");
    let e = s
        .lease(&[lease("a", "tenant", "nobody", 1, 1)])
        .await
        .expect_err("no server");
    assert!(matches!(e, StoreError::Connection(_)), "{e:?}");
    assert!(e.is_transient());
    assert!(s.ready().await.is_err());
}

/// `calls` of `cmdstat_<command>` in `INFO commandstats` (0 when never called).
#[cfg(feature = "e2e")]
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
#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_lives_on_one_shard_and_tenants_spread() {
    let cluster = shared_cluster();
    let store = RedisClusterStore::new(&cluster.urls(), &RedisSecurity::default(), settings())
        .expect("cluster store");
    until_ready(&store, "cluster ready").await;
    eventually("slot map", || store.refresh_slot_map()).await;

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
