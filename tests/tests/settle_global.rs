#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end test of settlement on the global stage: two real Envoys (shipped
//! `envoy/global.yaml`, two workers each) with the built filter, the real limiter on a real
//! `redis-server`, a metered upstream whose answers report varying actual costs. Refunds go
//! back to the instance's lease, excesses become debt on the key, and the fleet's settled
//! units stay within the global budget at a few lease calls per second.

use std::time::{Duration, Instant};

use tollgate_e2e::tollgate::{
    envoy_config, policy_metric, prometheus_value, start_ingress, Limiter, Store,
};
use tollgate_e2e::{process, send, MeteredRequest, MeteredUpstream, RedisServer, RequestSpec};

const POLICY: &str = "tokens";
/// 100 units per second, burst 50; a request reserves 10 and really costs 5 to 15.
const RATE: u64 = 100;
const BURST: u64 = 50;
const ESTIMATE: u64 = 10;
const MOST_EXCESS: u64 = 5;
const SECONDS: u64 = 6;
/// Each instance offers 15 requests a second, one at a time: 300 units/s, 3× the rate.
const PERIOD: Duration = Duration::from_micros(1_000_000 / 15);

fn policy() -> String {
    format!(
        r#"{{
  "policies": [{{
    "name": "{POLICY}",
    "match": {{ "routes": ["POST /v1/chat/completions"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "rate": {{ "units": {RATE}, "per": "1s" }},
    "burst": {BURST},
    "reserve": {{ "from": {{ "header": "x-estimated-units" }}, "default": {ESTIMATE}, "max": {BURST} }},
    "settle": {{ "from": {{ "header": "x-usage-units" }}, "max_debt": {BURST} }},
    "scope": "global",
    "on_unavailable": {{ "mode": "closed" }}
  }}],
  "limiter": {{ "cluster": "tollgate_limiter", "timeout": "200ms" }}
}}"#
    )
}

/// What one instance's client saw.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    offered: u64,
    admitted: u64,
    /// The actual units of the admitted requests.
    used: u64,
    denied: u64,
    other: u64,
}

/// One request at a time to `port` every [`PERIOD`] for [`SECONDS`], each really costing
/// 5..=15 units (an even spread around the estimate of 10).
async fn client(port: u16, seed: u64) -> Seen {
    let start = Instant::now();
    let mut seen = Seen::default();
    let mut i = 0u64;
    while start.elapsed() < Duration::from_secs(SECONDS) {
        let due = start + PERIOD * i as u32;
        tokio::time::sleep_until(due.into()).await;
        let used = ESTIMATE - MOST_EXCESS + (i * 7 + seed) % (2 * MOST_EXCESS + 1);
        let r = send(
            port,
            RequestSpec::post("/v1/chat/completions", "{}")
                .header("x-tenant-id", "acme")
                .header("x-estimated-units", ESTIMATE.to_string())
                .usage(used),
        )
        .await;
        seen.offered += 1;
        match r.status {
            200 => {
                seen.admitted += 1;
                seen.used += used;
            }
            429 => seen.denied += 1,
            _ => seen.other += 1,
        }
        i += 1;
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_units_stay_within_the_global_budget_under_three_times_the_demand() {
    let policy = policy();
    let redis = RedisServer::start();
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = MeteredUpstream::start();
    let envoy = |_| {
        let config = envoy_config(
            "envoy/global.yaml",
            &policy,
            upstream.port(),
            Some(limiter.port()),
        );
        start_ingress(config, 2)
    };
    let ((a, port_a), (b, port_b)) = (envoy(0), envoy(1));
    let start = Instant::now();
    let (sa, sb) = tokio::join!(client(port_a, 0), client(port_b, 3));
    let elapsed = start.elapsed().as_secs_f64();
    let used = sa.used + sb.used;
    let offered = sa.offered + sb.offered;
    let both = |what: &str| policy_metric(&a, what, POLICY) + policy_metric(&b, what, POLICY);
    let calls = both("lease_requests");
    // Each instance runs one request at a time, so at most one request's excess per instance
    // is still unpaid debt when the run ends.
    let upper = RATE as f64 * elapsed + BURST as f64 + 2.0 * MOST_EXCESS as f64;
    let lower = 0.95 * RATE as f64 * elapsed;
    println!(
        "settled {used} units in {elapsed:.2} s (allowed [{lower:.0}, {upper:.0}]); A {sa:?}, \
         B {sb:?}; {calls} lease calls for {offered} requests; refunded {} + {}, debt {} + {}",
        policy_metric(&a, "units_refunded", POLICY),
        policy_metric(&b, "units_refunded", POLICY),
        policy_metric(&a, "units_debt", POLICY),
        policy_metric(&b, "units_debt", POLICY),
    );
    assert_eq!(sa.other + sb.other, 0, "only 200 and 429 answers");
    assert!(
        sa.denied > 0 && sb.denied > 0,
        "both instances were over the limit"
    );
    assert!(used as f64 <= upper, "overshoot: {used} > {upper:.0}");
    assert!(used as f64 >= lower, "under-use: {used} < {lower:.0}");
    assert!(
        calls * 4 < offered,
        "{calls} lease calls for {offered} requests"
    );
    // Both ways happened, and nothing went past the debt bound.
    assert!(both("units_refunded") > 0);
    assert!(both("units_debt") > 0);
    assert_eq!(both("units_uncharged"), 0);
    // The filters settled exactly what the clients were charged...
    assert_eq!(both("units_settled"), used);
    // ...and the limiter has been told, on the callouts the filters make anyway. Units settled
    // after a worker's last callout wait for its next one: new tenants (one lease callout
    // each, on fresh connections spread over both workers) bring them.
    const PROBES: u64 = 16;
    for i in 0..PROBES {
        for port in [port_a, port_b] {
            let r = send(
                port,
                RequestSpec::post("/v1/chat/completions", "{}")
                    .header("x-tenant-id", format!("probe-{i}"))
                    .usage(1),
            )
            .await;
            assert_eq!(r.status, 200);
        }
    }
    let series = format!("tollgate_limiter_units_settled_total{{policy=\"{POLICY}\"}}");
    let reported = process::wait_for(
        "settled units at the limiter",
        Duration::from_secs(5),
        || {
            let reported = prometheus_value(&limiter.metrics(), &series) as u64;
            (reported >= used).then_some(reported)
        },
    )
    .unwrap_or_else(|e| panic!("{e}: {}", limiter.metrics()));
    assert!(
        reported <= used + 2 * PROBES,
        "{reported} reported, {used} settled"
    );
}

/// A global policy that reserves from the request body: the decision comes in a body callback,
/// may wait there for a lease, and the rest of the body is held until it is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_estimate_waits_for_its_lease_and_the_whole_body_follows() {
    let policy = r#"{
  "policies": [{
    "name": "by-body",
    "match": { "routes": ["POST /v1/chat/completions"] },
    "key": [{ "header": "x-tenant-id" }],
    "rate": { "units": 1, "per": "1h" },
    "burst": 1000,
    "reserve": { "from": { "body": { "field": "max_tokens", "max_bytes": 1024 } },
                 "default": 100, "max": 1000 },
    "scope": "global",
    "on_unavailable": { "mode": "closed" }
  }],
  "limiter": { "cluster": "tollgate_limiter", "timeout": "500ms" }
}"#;
    let mut limiter = Limiter::start(policy, Store::Memory, &[]);
    let upstream = tollgate_e2e::Upstream::start();
    let config = envoy_config(
        "envoy/global.yaml",
        policy,
        upstream.port(),
        Some(limiter.port()),
    );
    let (envoy, port) = start_ingress(config, 2);
    let chat = |tenant: &str, body: String| {
        RequestSpec::post("/v1/chat/completions", body).header("x-tenant-id", tenant)
    };
    // A small body: read whole, 40 reserved (a lease is asked for and waited on first).
    let r = send(port, chat("acme", r#"{"max_tokens":40}"#.into())).await;
    assert_eq!(r.status, 200);
    // A body far past max_bytes: decided on its first chunks with the default (100), the rest
    // held while the new tenant's lease is asked for, then all of it reaches the upstream.
    let big = format!(r#"{{"max_tokens":5,"pad":"{}"}}"#, "p".repeat(300_000));
    for tenant in ["big-1", "big-2"] {
        let r = send(port, chat(tenant, big.clone())).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let seen = upstream.last_request().unwrap();
        assert_eq!(seen.body.len(), big.len());
        assert!(seen.body == big, "the body arrived changed");
    }
    let reserved = prometheus_value(
        &envoy.stats_prometheus(),
        "tollgate_units_reserved{policy=\"by-body\"}",
    ) as u64;
    assert_eq!(reserved, 40 + 2 * 100);
    // The limiter gone: refused (closed) in the body callback. The upstream saw the headers
    // (they go on while the body is read) but none of the body: its stream was reset.
    limiter.kill();
    let before = upstream.requests();
    let r = send(port, chat("big-3", big.clone())).await;
    assert_eq!(r.status, 503, "{}", r.body);
    if upstream.requests() > before {
        let seen = upstream.last_request().unwrap();
        assert_eq!(seen.header("x-tenant-id"), Some("big-3"));
        assert!(
            seen.body.is_empty(),
            "{} bytes of the body reached the upstream",
            seen.body.len()
        );
    }
}
