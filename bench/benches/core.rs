//! `just bench-micro`: criterion microbenchmarks of the core and of the filter's decision path,
//! natively (the filter runs the same code compiled to wasm32 under V8, typically a few times
//! slower; these numbers rank costs, they are not the in-Envoy cost).
//!
//! - bucket: `try_take` on a live bucket, `lease` from a full one, `give_back`;
//! - algorithm: one admitting local decision of each `algorithm` from a live state, as the
//!   local stage makes it per request: the token bucket's `try_take`, its `shape` (within the
//!   rate, and over it: a turn `max_delay` allows), `window::take` of a fixed window and of a
//!   sliding window counter, and `Log::take` of a sliding log holding 200 entries (limit 256:
//!   at each decision one leaves and one is logged, as at a steady rate);
//! - policy match over 100 policies (none matches / the last one matches), and the filter's
//!   `Engine::plan` over the same 100 (match + key of the matching policy);
//! - keys: escaping a plain, a hostile and an over-long identity, joining parts, bucket ids;
//! - the request path: `Engine::plan` + `Engine::decide` for one local policy and for one global
//!   policy spending from a granted lease, against an in-memory shared-data map with Envoy's
//!   CAS semantics (the common case: one read and one CAS write per policy);
//! - the anchor, in the same group: the `governor` crate's keyed limiter (GCRA in a concurrent
//!   map) checking one of the same 100 keys, what a well-made in-process Rust limiter costs
//!   per decision (`tollgate-bench micro-summary` reports the request path's ratio to it).
//!
//! The bytes of shared state per key of each algorithm are not a timing and are not measured
//! here: `micro-summary` measures them on the same engine and in-memory shared data as it
//! writes micro.md (`bench/src/footprint.rs`; `tollgate-bench shared-state` alone).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use std::sync::Arc;
use tollgate_core::bucket::{give_back, lease, shape, try_take, BucketState, Limits, Shaped};
use tollgate_core::key::{escape_part, join_parts, local_bucket_id};
use tollgate_core::policy::Policies;
use tollgate_core::protocol::LeaseGranted;
use tollgate_core::window::{self, CounterKind, Counters, Log, Window, MAX_LOG_LIMIT};
use tollgate_engine::engine::{Attempt, Engine, LeaseNeed, Verdict, SHARED_PREFIX};
use tollgate_engine::request::{RequestFacts, RequestSource};
use tollgate_engine::shared::{MemorySharedData, StoreAt};
use tollgate_engine::table::{Cells, SlotTable};

/// The request's headers as the host hands them over: a list searched by name, as Envoy's
/// header map finds a header that is not one of its inline ones (a hash map here would add
/// a SipHash of the name per lookup, a cost of the fake host, not of the filter).
struct Request {
    headers: Vec<(&'static str, Vec<u8>)>,
}

impl Request {
    fn get(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_slice())
    }
}

impl RequestSource for Request {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.get(name).map(<[u8]>::to_vec)
    }

    fn with_header<R>(&self, name: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        f(self.get(name))
    }

    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

fn request(tenant: &str) -> Request {
    Request {
        headers: vec![("x-tenant-id", tenant.as_bytes().to_vec())],
    }
}

fn facts(path: &str) -> RequestFacts<'static> {
    RequestFacts {
        method: "GET".into(),
        path: path.to_string().into(),
        host: "api.example.com".into(),
    }
}

fn one_policy(scope: &str) -> Policies {
    let limiter = if scope == "global" {
        r#", "limiter": { "cluster": "tollgate_limiter" }"#
    } else {
        ""
    };
    Policies::from_json(
        format!(
            r#"{{"policies": [{{"name": "per-tenant", "match": {{"routes": ["GET /items/{{id}}"]}},
                "key": [{{"header": "x-tenant-id"}}], "rate": {{"units": 1000000000, "per": "1s"}},
                "burst": 1000000000, "scope": "{scope}"}}]{limiter}}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

/// 100 policies on distinct hosts and routes, as a gateway with many APIs would have.
fn hundred_policies() -> Policies {
    let policies: Vec<String> = (0..100)
        .map(|i| {
            format!(
                r#"{{"name": "api-{i}", "match": {{"hosts": ["api{i}.example.com"],
                    "routes": ["GET /v1/svc{i}/items/{{id}}", "POST /v1/svc{i}/items"]}},
                    "key": [{{"header": "x-tenant-id"}}, "route"],
                    "rate": {{"units": 100, "per": "1s"}}, "burst": 20}}"#
            )
        })
        .collect();
    Policies::from_json(format!(r#"{{"policies": [{}]}}"#, policies.join(",")).as_bytes()).unwrap()
}

fn bucket(c: &mut Criterion) {
    let limits = Limits::new(1_000, 1_000, 100).unwrap();
    let mut g = c.benchmark_group("bucket");
    let state = Some(BucketState {
        tokens: 50.0,
        updated_ms: 1_000,
    });
    let mut now = 1_000u64;
    g.bench_function("try_take", |b| {
        b.iter(|| {
            now += 1;
            black_box(try_take(&limits, black_box(state), now, 1))
        })
    });
    g.bench_function("lease", |b| {
        b.iter(|| black_box(lease(&limits, black_box(None), 2_000, 1, 25)))
    });
    g.bench_function("give_back", |b| {
        b.iter(|| black_box(give_back(&limits, black_box(state), 2_000, 10)))
    });
    g.finish();
}

/// One admitting decision per algorithm, each from the state a key at a steady rate has
/// (1,000 units per 1,000 ms; the bucket's burst 100, shaping's `max_delay` 500 ms), so the
/// names match the policy document's `algorithm` values.
fn algorithms(c: &mut Criterion) {
    let mut g = c.benchmark_group("algorithm");
    let limits = Limits::new(1_000, 1_000, 100).unwrap();
    let live = Some(BucketState {
        tokens: 50.0,
        updated_ms: 1_000,
    });
    const MAX_DELAY_MS: u64 = 500;
    // Each bench checks its path once, untimed: every one measures an admission.
    assert!(try_take(&limits, live, 1_001, 1).1.is_allowed());
    assert!(matches!(
        shape(&limits, live, 1_001, 1, MAX_DELAY_MS).1,
        Shaped::Now { .. }
    ));
    let mut now = 1_000u64;
    g.bench_function("token_bucket_try_take", |b| {
        b.iter(|| {
            now += 1;
            black_box(try_take(&limits, black_box(live), now, 1))
        })
    });
    g.bench_function("token_bucket_shape_now", |b| {
        b.iter(|| {
            now += 1;
            black_box(shape(&limits, black_box(live), now, 1, MAX_DELAY_MS))
        })
    });
    // Over the rate: 100 units already taken ahead (100 ms of refill), so the request's turn
    // comes 101 ms from now, within `max_delay`.
    let ahead = Some(BucketState {
        tokens: -100.0,
        updated_ms: 2_000,
    });
    assert_eq!(
        shape(&limits, ahead, 2_000, 1, MAX_DELAY_MS).1,
        Shaped::After { delay_ms: 101 }
    );
    g.bench_function("token_bucket_shape_delayed", |b| {
        b.iter(|| {
            black_box(shape(
                &limits,
                black_box(ahead),
                black_box(2_000),
                1,
                MAX_DELAY_MS,
            ))
        })
    });
    // Half way through window 1 (1,000..2,000 ms): 300 counted in it, 400 in the one before
    // (the sliding estimate: 300 + 400 × 0.5 = 500).
    let w = Window::new(1_000, 1_000).unwrap();
    let counters = Some(Counters {
        window: 1,
        count: 300,
        previous: 400,
    });
    for (name, kind) in [
        ("fixed_window_take", CounterKind::Fixed),
        ("sliding_window_take", CounterKind::Sliding),
    ] {
        assert!(window::take(kind, &w, counters, 1_500, 1).1.is_allowed());
        g.bench_function(name, |b| {
            b.iter(|| {
                black_box(window::take(
                    kind,
                    &w,
                    black_box(counters),
                    black_box(1_500),
                    1,
                ))
            })
        });
    }
    // 200 entries 5 ms apart and a decision every 5 ms: at each the oldest entry leaves the
    // window and the new one is logged, so the log stays at 200 of its 256 (a steady rate of
    // 200 per window; no copy, no allocation).
    let w = Window::new(MAX_LOG_LIMIT, 1_000).unwrap();
    let mut log = Log {
        times: (0..200).map(|i| 800 + 5 * i).collect(),
        seen_ms: 1_795,
    };
    let mut now = 1_795u64;
    for _ in 0..3 {
        now += 5;
        assert!(log.take(&w, now, 1).is_allowed());
        assert_eq!(log.times.len(), 200);
    }
    g.bench_function("sliding_log_take_200_of_256", |b| {
        b.iter(|| {
            now += 5;
            black_box(log.take(&w, now, 1))
        })
    });
    g.finish();
}

fn matching(c: &mut Criterion) {
    let policies = hundred_policies();
    let mut g = c.benchmark_group("match_100_policies");
    let none = facts("/v1/other/items/42");
    let last = RequestFacts {
        host: "api99.example.com".into(),
        ..facts("/v1/svc99/items/42")
    };
    for (name, f) in [("none_matches", &none), ("last_matches", &last)] {
        g.bench_function(name, |b| {
            b.iter(|| {
                black_box(&policies)
                    .policies
                    .iter()
                    .filter_map(|p| p.match_request(&f.host, &f.method, &f.path))
                    .count()
            })
        });
    }
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, 4096, 7).unwrap();
    let engine = Engine::new(policies, table);
    let req = request("tenant-42");
    g.bench_function("engine_plan_last_matches", |b| {
        b.iter(|| black_box(engine.plan(black_box(&last), &req)))
    });
    g.finish();
}

fn keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    g.bench_function("escape_plain", |b| {
        b.iter(|| escape_part(black_box(b"tenant-42")))
    });
    g.bench_function("escape_hostile", |b| {
        b.iter(|| escape_part(black_box(b"{tenant}:b/../\xff")))
    });
    let long = [b'x'; 200];
    g.bench_function("escape_long_digest", |b| {
        b.iter(|| escape_part(black_box(&long)))
    });
    let parts = [
        "tenant-42".to_string(),
        "GET%20%2fitems%2f%7bid%7d".to_string(),
    ];
    g.bench_function("join_2_parts", |b| b.iter(|| join_parts(black_box(&parts))));
    g.bench_function("local_bucket_id", |b| {
        b.iter(|| local_bucket_id(black_box("per-tenant"), black_box("tenant-42")))
    });
    g.finish();
}

/// An engine on a table of 4096 slots: records as shared-data bytes (the wasm build), or typed
/// in process memory (`native`).
fn engine(store: &MemorySharedData, policies: Policies, native: bool) -> Engine {
    if !native {
        return Engine::new(
            policies,
            SlotTable::open(store, SHARED_PREFIX, 4096, 7).unwrap(),
        );
    }
    let engine = Engine::new(
        policies,
        SlotTable::open_salted(store, SHARED_PREFIX, 4096, 7).unwrap(),
    );
    let cells = Arc::new(Cells::new(engine.table().groups_needed()));
    engine.keeping_records_in(cells).unwrap()
}

fn request_path(c: &mut Criterion) {
    let mut g = c.benchmark_group("request_path");
    let f = facts("/items/42");
    let tenants: Vec<Request> = (0..100).map(|t| request(&format!("tenant-{t}"))).collect();

    // Each policy decided on the wasm build's table (records as bytes in shared data, here
    // in-memory shared data with Envoy's CAS semantics) and on the native build's (`_native`:
    // the same table with its records typed in process memory).
    let mut i = 0usize;
    for (name, native) in [
        ("local_policy_plan_decide", false),
        ("local_policy_plan_decide_native", true),
    ] {
        let store = MemorySharedData::default();
        let local = engine(&store, one_policy("local"), native);
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % tenants.len();
                let plan = local.plan(&f, &tenants[i]);
                let d = local.decide(&plan, StoreAt::new(&store, 10_000), Attempt::default());
                assert_eq!(d.verdict, Verdict::Continue);
                black_box(d)
            })
        });
    }

    for (name, native) in [
        ("global_policy_lease_plan_decide", false),
        ("global_policy_lease_plan_decide_native", true),
    ] {
        let store = MemorySharedData::default();
        let global = engine(&store, one_policy("global"), native);
        for req in &tenants {
            let plan = global.plan(&f, req);
            let m = &plan.enforced[0];
            let need = LeaseNeed {
                policy: m.index,
                key: m.key().to_owned(),
                bucket_id: m.bucket_id.clone(),
                min: 1,
                want: 100,
                demand_per_s: 100.0,
                blocking: true,
                may_linger: false,
                asked_ms: 10_000,
            };
            let grant = LeaseGranted {
                id: "bench".into(),
                granted: 1_000_000_000,
                remaining: 0.0,
                retry_after_ms: 0,
                expires_ms: 1_000_000_000,
                share_per_s: 0.0,
                period_ms: 0,
            };
            global
                .credit(StoreAt::new(&store, 10_000), &need, &grant, 1, true)
                .unwrap();
        }
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % tenants.len();
                let plan = global.plan(&f, &tenants[i]);
                let d = global.decide(&plan, StoreAt::new(&store, 10_000), Attempt::default());
                assert_eq!(d.verdict, Verdict::Continue);
                black_box(d)
            })
        });
    }
    // The anchor: a keyed check in `governor` over the same 100 tenants, always admitted (the
    // policies above are too: a billion units per second).
    let quota = governor::Quota::per_second(std::num::NonZeroU32::new(1_000_000_000).unwrap());
    let limiter = governor::RateLimiter::keyed(quota);
    let keys: Vec<String> = (0..100).map(|t| format!("tenant-{t}")).collect();
    g.bench_function("governor_keyed_check", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            let allowed = limiter.check_key(&keys[i]).is_ok();
            assert!(allowed);
            black_box(allowed)
        })
    });
    let miss = facts("/orders/42");
    let store = MemorySharedData::default();
    let global = engine(&store, one_policy("global"), false);
    g.bench_function("no_policy_matches_plan", |b| {
        b.iter(|| black_box(global.plan(black_box(&miss), &tenants[0])))
    });
    g.finish();
}

criterion_group!(benches, bucket, algorithms, matching, keys, request_path);
criterion_main!(benches);
