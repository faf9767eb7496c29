#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of global limiting: real Envoys (shipped `envoy/global.yaml`) loading the
//! built filter, the real `tollgate-limiter` binary, a real `redis-server`, on loopback. Every
//! test runs against both builds (`wasm::…` loads `tollgate.wasm`, `native::…` the dynamic
//! module `libtollgate_native.so`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use tollgate_e2e::build::Build;
use tollgate_e2e::client::{burst_detailed, try_send_timeout};
use tollgate_e2e::redis::commandstats_calls;
use tollgate_e2e::tollgate::{envoy_config, item, policy_block, prometheus_value, Limiter, Store};
use tollgate_e2e::upstream::MockResponse;
use tollgate_e2e::{
    burst, paths, send, Envoy, EnvoyOptions, RedisServer, RequestSpec, Response, Upstream,
};

/// The shipped global config embeds policies/payments-global.json.
#[test]
fn shipped_global_config_embeds_the_global_policy() {
    let shipped =
        std::fs::read_to_string(paths::workspace_root().join("envoy/global.yaml")).unwrap();
    let (_, block, _) = policy_block(&shipped);
    let embedded: Value = serde_json::from_str(&block).unwrap();
    let file: Value = serde_json::from_str(
        &std::fs::read_to_string(paths::workspace_root().join("policies/payments-global.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(embedded, file);
}

/// One global policy per tenant on `GET /items/{id}` (cost 1) and `POST /exports` (cost 5).
fn global_policy(units: u64, per: &str, burst: u64, failure: &str, limiter: &str) -> String {
    format!(
        r#"{{
  "policies": [{{
    "name": "per-tenant",
    "match": {{ "routes": ["GET /items/{{id}}", "POST /exports"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "rate": {{ "units": {units}, "per": "{per}" }},
    "burst": {burst},
    "cost": {{ "POST /exports": 5 }},
    "scope": "global",
    "on_unavailable": {failure}
  }}],
  "limiter": {limiter}
}}"#
    )
}

/// The fault tests' limiter settings: a callout deadline of 100 ms (see `TIMEOUT_MS`).
const LIMITER: &str = r#"{ "cluster": "tollgate_limiter", "timeout": "100ms" }"#;
/// The accounting tests' limiter settings: exactness is what they check, so a loaded machine
/// must not turn a slow callout into a failure-mode decision.
const PATIENT: &str = r#"{ "cluster": "tollgate_limiter", "timeout": "2s" }"#;
const CLOSED: &str = r#"{ "mode": "closed" }"#;

fn start_envoy(
    build: Build,
    policy: &str,
    upstream: &Upstream,
    limiter_port: u16,
    workers: u32,
) -> (Envoy, u16) {
    let envoy = Envoy::start(
        EnvoyOptions::new(build.config(envoy_config(
            "envoy/global.yaml",
            policy,
            upstream.port(),
            Some(limiter_port),
        )))
        .concurrency(workers)
        .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

fn metric(envoy: &Envoy, series: &str) -> u64 {
    prometheus_value(&envoy.stats_prometheus(), series) as u64
}

fn statuses(responses: &[Response]) -> BTreeMap<u16, usize> {
    let mut counts = BTreeMap::new();
    for r in responses {
        *counts.entry(r.status).or_default() += 1;
    }
    counts
}

async fn a_burst_across_two_instances_stays_within_the_global_budget(build: Build) {
    let redis = RedisServer::start();
    let policy = global_policy(1, "1h", 100, CLOSED, PATIENT);
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (a, port_a) = start_envoy(build, &policy, &upstream, limiter.port(), 2);
    let (b, port_b) = start_envoy(build, &policy, &upstream, limiter.port(), 2);
    let (ra, rb) = tokio::join!(
        burst(port_a, 500, 40, |i| item("acme", i)),
        burst(port_b, 500, 40, |i| item("acme", i)),
    );
    let all: Vec<Response> = ra.into_iter().chain(rb).collect();
    let admitted = all.iter().filter(|r| r.status == 200).count();
    println!(
        "admitted {admitted} of 1000 against a global budget of 100: {:?}",
        statuses(&all)
    );
    assert!(admitted <= 100, "overshoot: {admitted} admitted");
    assert!(admitted >= 95, "stranded tokens: only {admitted} admitted");
    for r in all.iter().filter(|r| r.status != 200) {
        assert_eq!(r.status, 429, "{r:?}");
        let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert!(retry >= 1);
        assert!(r.body.contains("\"policy\":\"per-tenant\""));
    }
    assert_eq!(upstream.requests() as usize, admitted);
    // Denials are remembered: most of the 900 refused requests cost no callout.
    let callouts = metric(&a, "tollgate_lease_requests{policy=\"per-tenant\"}")
        + metric(&b, "tollgate_lease_requests{policy=\"per-tenant\"}");
    println!("lease requests for 1000 requests: {callouts}");
    assert!(callouts < 200, "{callouts} lease requests");
}

async fn sustained_demand_at_five_times_the_rate_is_held_to_the_rate(build: Build) {
    let redis = RedisServer::start();
    let rate = 100;
    let burst_size = 20;
    let policy = global_policy(rate, "1s", burst_size, CLOSED, PATIENT);
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (_a, port_a) = start_envoy(build, &policy, &upstream, limiter.port(), 2);
    let (_b, port_b) = start_envoy(build, &policy, &upstream, limiter.port(), 2);
    // 500 requests/s (5 × the rate) for 10 s: every 20 ms, 5 requests to each instance.
    let seconds = 10;
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let mut rounds = Vec::new();
    for round in 0..(seconds * 50) {
        tick.tick().await;
        rounds.push(tokio::spawn(async move {
            let (ra, rb) = tokio::join!(
                burst_detailed(port_a, 5, 5, Duration::from_secs(5), |i| item(
                    "steady",
                    round * 10 + i
                )),
                burst_detailed(port_b, 5, 5, Duration::from_secs(5), |i| item(
                    "steady",
                    round * 10 + 5 + i
                )),
            );
            ra.into_iter()
                .chain(rb)
                .filter(|t| matches!(&t.response, Ok(r) if r.status == 200))
                .count()
        }));
    }
    let mut admitted = 0;
    for round in rounds {
        admitted += round.await.unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    let upper = rate as f64 * elapsed + burst_size as f64;
    let lower = 0.95 * rate as f64 * seconds as f64;
    println!(
        "sustained: admitted {admitted} units in {elapsed:.2} s; allowed [{lower:.0}, {upper:.0}]"
    );
    assert!(admitted as f64 <= upper, "overshoot: {admitted} > {upper}");
    assert!(admitted as f64 >= lower, "under-use: {admitted} < {lower}");
}

async fn two_policies_and_weighted_cost_are_all_or_nothing(build: Build) {
    let redis = RedisServer::start();
    let policy = format!(
        r#"{{
  "policies": [
    {{ "name": "tenant-wide", "key": [{{ "header": "x-tenant-id" }}],
       "match": {{ "routes": ["GET /items/{{id}}", "POST /exports"] }},
       "rate": {{ "units": 1, "per": "1h" }}, "burst": 30, "cost": {{ "POST /exports": 5 }},
       "scope": "global", "on_unavailable": {CLOSED} }},
    {{ "name": "exports", "key": [{{ "header": "x-tenant-id" }}, "route"],
       "match": {{ "routes": ["POST /exports"] }},
       "rate": {{ "units": 1, "per": "1h" }}, "burst": 10, "cost": {{ "POST /exports": 5 }},
       "scope": "global", "on_unavailable": {CLOSED} }}
  ],
  "limiter": {PATIENT}
}}"#
    );
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (_envoy, port) = start_envoy(build, &policy, &upstream, limiter.port(), 2);
    let export = || RequestSpec::post("/exports", "{}").header("x-tenant-id", "acme");
    let mut export_statuses = Vec::new();
    for _ in 0..4 {
        export_statuses.push(send(port, export()).await);
    }
    // Two exports (5 units each) fill the exports budget of 10; the next are refused by it.
    assert_eq!(
        export_statuses.iter().map(|r| r.status).collect::<Vec<_>>(),
        vec![200, 200, 429, 429]
    );
    assert!(export_statuses[2].body.contains("\"policy\":\"exports\""));
    // The refused exports took nothing tenant-wide: 30 − 10 = 20 lookups still pass, not one more.
    let lookups = burst(port, 40, 8, |i| item("acme", i)).await;
    assert_eq!(
        lookups.iter().filter(|r| r.status == 200).count(),
        20,
        "{:?}",
        statuses(&lookups)
    );
    let denied = lookups.iter().find(|r| r.status == 429).unwrap();
    assert!(denied.body.contains("\"policy\":\"tenant-wide\""));
}

async fn shadow_global_policy_admits_all_and_counts(build: Build) {
    let redis = RedisServer::start();
    let policy = global_policy(1, "1h", 10, CLOSED, PATIENT).replace(
        "\"scope\": \"global\",",
        "\"scope\": \"global\", \"enforce\": false,",
    );
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (envoy, port) = start_envoy(build, &policy, &upstream, limiter.port(), 1);
    let mut all = Vec::new();
    for i in 0..40 {
        all.push(send(port, item("acme", i)).await.status);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(all.iter().all(|s| *s == 200));
    let shadow = metric(&envoy, "tollgate_shadow_denied{policy=\"per-tenant\"}");
    let allowed = metric(&envoy, "tollgate_allowed{policy=\"per-tenant\"}");
    let granted = metric(&envoy, "tollgate_tokens_granted{policy=\"per-tenant\"}");
    println!("shadow: allowed {allowed}, would have denied {shadow}, tokens granted {granted}");
    // Every request is counted once. Shadow never waits: while a lease is being fetched a
    // request counts as allowed, so `allowed` may exceed the budget by a few; the limiter
    // itself never grants more than the budget.
    assert_eq!(allowed + shadow, 40);
    assert!(granted <= 10, "{granted}");
    assert!(shadow >= 20, "{shadow}");
}

/// `(bucket transitions, all commands)` so far, from INFO commandstats.
fn redis_calls(redis: &RedisServer) -> (u64, u64) {
    commandstats_calls(&redis.info("commandstats"))
}

async fn batching_keeps_redis_commands_far_below_requests(build: Build) {
    let redis = RedisServer::start();
    let policy = global_policy(1_000, "1s", 1_000, CLOSED, PATIENT);
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (_envoy, port) = start_envoy(build, &policy, &upstream, limiter.port(), 2);
    // Warm up the lease, then measure 3 s at ~400 requests/s.
    burst(port, 50, 5, |i| item("steady", i)).await;
    let before = redis_calls(&redis);
    let mut admitted = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(25));
    for round in 0..120 {
        tick.tick().await;
        let responses = burst(port, 10, 5, |i| item("steady", round * 10 + i)).await;
        admitted += responses.iter().filter(|r| r.status == 200).count();
    }
    let (transitions, all) = redis_calls(&redis);
    let (transitions, all) = (transitions - before.0, all - before.1);
    let per_thousand = transitions as f64 * 1000.0 / admitted as f64;
    let all_per_thousand = all as f64 * 1000.0 / admitted as f64;
    println!(
        "Redis per 1,000 admitted requests: {per_thousand:.1} calls from the limiter \
         ({all_per_thousand:.1} commands counting those run inside the Function); {admitted} admitted"
    );
    assert_eq!(admitted, 1_200);
    // A per-request design makes at least 1,000 calls per 1,000 requests.
    assert!(
        per_thousand < 100.0,
        "{per_thousand} Redis calls per 1,000 requests"
    );
}

/// How a fault shows up for each failure mode.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Open,
    Closed,
    Local,
}

impl Mode {
    fn json(self) -> &'static str {
        match self {
            Mode::Open => r#"{ "mode": "open" }"#,
            Mode::Closed => r#"{ "mode": "closed" }"#,
            // burst 20 × 0.5: 10 requests per tenant on the local budget during an outage.
            Mode::Local => {
                r#"{ "mode": "local", "share": 0.5, "stale_ttl": "30s", "then": "closed" }"#
            }
        }
    }
}

const TIMEOUT_MS: u64 = 100;
/// What a request may take beyond the callout timeout: the filter's deadline tick (5 ms) plus
/// scheduling on a shared 2-core machine running two Envoys, the limiter, Redis and the client.
const MARGIN_MS: u64 = 150;

/// Sends 20 requests for a fresh tenant during a fault and checks the failure mode's outcome
/// and that none waited longer than the timeout plus the margin.
async fn during_fault(envoy: &Envoy, port: u16, mode: Mode, tenant: &str, fault: &str) {
    let allowed = "tollgate_allowed{policy=\"per-tenant\"}";
    let allowed_before = metric(envoy, allowed);
    let results = burst_detailed(port, 20, 4, Duration::from_secs(10), |i| item(tenant, i)).await;
    let mut counts = BTreeMap::new();
    for t in &results {
        let r = t
            .response
            .as_ref()
            .unwrap_or_else(|e| panic!("{fault}: {e}"));
        *counts.entry(r.status).or_insert(0) += 1;
        assert!(
            t.latency < Duration::from_millis(TIMEOUT_MS + MARGIN_MS),
            "{mode:?}/{fault}: a request took {:?}",
            t.latency
        );
        if r.status == 503 {
            assert!(r.body.contains("rate limiter unavailable"), "{}", r.body);
        }
    }
    // Requests the limiter itself decided (a lease answered during the fault, e.g. one that
    // was already on its way when the limiter stopped) are admitted by that lease; every other
    // request takes the failure mode, whose own budget stays exact.
    let leased = (metric(envoy, allowed) - allowed_before) as usize;
    if leased > 0 {
        println!("{mode:?}/{fault}: {leased} requests admitted by a lease the limiter answered");
    }
    let expected: BTreeMap<u16, usize> = match mode {
        Mode::Open => [(200, 20)].into(),
        Mode::Closed => [(200, leased), (503, 20 - leased)].into(),
        Mode::Local => {
            let admitted = leased + (20 - leased).min(10);
            [(200, admitted), (429, 20 - admitted)].into()
        }
    };
    let expected: BTreeMap<u16, usize> = expected.into_iter().filter(|(_, n)| *n > 0).collect();
    if counts != expected {
        let stats = envoy.stats_prometheus();
        let ours: Vec<&str> = stats
            .lines()
            .filter(|l| l.starts_with("tollgate_"))
            .collect();
        panic!(
            "{mode:?} during {fault}: {counts:?}, expected {expected:?}\n{}",
            ours.join("\n")
        );
    }
}

/// After a fault clears (and the filter's outage backoff of 500 ms passes), requests are
/// decided by the limiter again.
async fn recovers(envoy: &Envoy, port: u16, tenant: &str, fault: &str) {
    let granted_before = metric(envoy, "tollgate_tokens_granted{policy=\"per-tenant\"}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let r = try_send_timeout(port, item(tenant, 0), Duration::from_secs(5)).await;
        let granted = metric(envoy, "tollgate_tokens_granted{policy=\"per-tenant\"}");
        if matches!(&r, Ok(r) if r.status == 200) && granted > granted_before {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no recovery after {fault}: {r:?}"
        );
    }
}

fn counted(envoy: &Envoy, mode: Mode) -> u64 {
    let series = match mode {
        Mode::Open => "tollgate_fail_open{policy=\"per-tenant\"}",
        Mode::Closed => "tollgate_fail_closed{policy=\"per-tenant\"}",
        Mode::Local => "tollgate_fallback_allowed{policy=\"per-tenant\"}",
    };
    metric(envoy, series)
}

async fn faults(build: Build, mode: Mode) {
    let redis = RedisServer::start();
    // Negligible refill, so the local budget during an outage is exactly burst × share.
    let policy = global_policy(1, "1h", 20, mode.json(), LIMITER);
    let mut limiter = Limiter::start(
        &policy,
        Store::Redis(redis.url()),
        &["--store-timeout", "30ms"],
    );
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (envoy, port) = start_envoy(build, &policy, &upstream, limiter.port(), 2);
    assert_eq!(send(port, item("warm", 0)).await.status, 200);

    // 1. The limiter is stopped.
    limiter.kill();
    let before = counted(&envoy, mode);
    during_fault(&envoy, port, mode, "t-stopped", "limiter stopped").await;
    assert!(
        counted(&envoy, mode) > before,
        "{mode:?}: outcome not counted"
    );
    limiter.restart();
    recovers(&envoy, port, "t-stopped", "limiter stopped").await;

    // 2. Redis is paused: the limiter answers 503 UNAVAILABLE within its store timeout.
    redis.pause();
    during_fault(&envoy, port, mode, "t-redis", "redis paused").await;
    redis.resume();
    recovers(&envoy, port, "t-redis", "redis paused").await;

    // 3. The limiter is too slow (paused: it accepts nothing, answers nothing).
    limiter.pause();
    during_fault(&envoy, port, mode, "t-slow", "limiter slow").await;
    limiter.resume();
    recovers(&envoy, port, "t-slow", "limiter slow").await;
    assert!(metric(&envoy, "tollgate_lease_unavailable{policy=\"per-tenant\"}") >= 3);

    // 4. The limiter answers garbage (a stand-in HTTP server on the limiter's cluster).
    let garbage = Upstream::with_handler(|_| MockResponse::new(200, "<html>not a lease</html>"));
    let (envoy2, port2) = start_envoy(build, &policy, &upstream, garbage.port(), 1);
    during_fault(
        &envoy2,
        port2,
        mode,
        "t-garbage",
        "limiter answering garbage",
    )
    .await;
    assert!(garbage.requests() >= 1);
    assert!(metric(&envoy2, "tollgate_callouts_failed") >= 1);
}

async fn faults_fail_open(build: Build) {
    faults(build, Mode::Open).await;
}

async fn faults_fail_closed(build: Build) {
    faults(build, Mode::Closed).await;
}

async fn faults_fall_back_to_the_local_budget(build: Build) {
    faults(build, Mode::Local).await;
}

tollgate_e2e::both_builds!(
    async: [
        a_burst_across_two_instances_stays_within_the_global_budget,
        sustained_demand_at_five_times_the_rate_is_held_to_the_rate,
        two_policies_and_weighted_cost_are_all_or_nothing,
        shadow_global_policy_admits_all_and_counts,
        batching_keeps_redis_commands_far_below_requests,
        faults_fail_open,
        faults_fail_closed,
        faults_fall_back_to_the_local_budget,
    ],
    sync: [],
);
