#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of the filter's shared table under pressure: a real Envoy
//! (`--concurrency 4`) with the shipped `envoy/local.yaml` and the freshly built
//! `tollgate.wasm`. A stream of new tenants at a bounded occupancy never meets a full table,
//! and a flood of new ids on one policy never refuses another policy's new tenants.
//!
//! Occupancy is bounded by counts, not speed: a tenant's record is live only until its bucket
//! has refilled, and each wave of new tenants starts only after the previous wave's buckets
//! are full again, so at most one wave is live at a time however fast Envoy runs.

use std::collections::BTreeMap;
use std::time::Duration;

use tollgate_e2e::tollgate::{self, envoy_config};
use tollgate_e2e::{burst, Envoy, EnvoyOptions, RequestSpec, Response, Upstream};

const WORKERS: u32 = 4;

fn start(policy: &str, upstream: &Upstream) -> (Envoy, u16) {
    let envoy = Envoy::start(
        EnvoyOptions::new(envoy_config(
            "envoy/local.yaml",
            policy,
            upstream.port(),
            None,
        ))
        .concurrency(WORKERS)
        .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

/// A counter from `/stats/prometheus` (it must exist: every tollgate counter is defined when
/// the configuration loads).
fn counter(envoy: &Envoy, series: &str) -> u64 {
    let text = envoy.stats_prometheus();
    let name = series.split('{').next().unwrap_or(series);
    assert!(
        text.lines().any(|l| l.starts_with(name)),
        "no {series} in /stats/prometheus:\n{text}"
    );
    tollgate::prometheus_value(&text, series) as u64
}

fn statuses<'a>(responses: impl IntoIterator<Item = &'a Response>) -> BTreeMap<u16, usize> {
    let mut counts = BTreeMap::new();
    for r in responses {
        *counts.entry(r.status).or_default() += 1;
    }
    counts
}

fn tenant(host: &str, id: &str) -> RequestSpec {
    RequestSpec::get("/items/1")
        .host(host)
        .header("x-tenant-id", id)
}

/// A local policy on `host`, keyed by tenant, with failure mode `mode`.
fn policy(name: &str, host: &str, rate: &str, burst: u64, mode: &str) -> String {
    format!(
        r#"{{ "name": "{name}", "match": {{ "hosts": ["{host}"] }},
      "key": [{{ "header": "x-tenant-id" }}], "rate": {rate}, "burst": {burst},
      "on_unavailable": {{ "mode": "{mode}" }} }}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_tenants_at_half_occupancy_never_find_the_table_full() {
    // 1,024 slots, one policy. A tenant's one request takes the bucket's only unit, which is
    // back after 1 s: the record is live for 1 s, then idle (evictable). Waves of 512 new
    // tenants (half the table) 1.2 s apart: at most one wave is live at a time, so occupancy
    // never exceeds 50 %, and from the third wave on every new tenant evicts an idle record.
    let upstream = Upstream::start();
    let slots = 1024;
    let wave = 512;
    let waves = 4;
    let doc = format!(
        r#"{{ "local_table": {{ "slots": {slots} }}, "policies": [{}] }}"#,
        policy(
            "churn",
            "api.example.com",
            r#"{ "units": 1, "per": "1s" }"#,
            1,
            "closed"
        )
    );
    let (envoy, port) = start(&doc, &upstream);
    let mut all = Vec::new();
    for w in 0..waves {
        if w > 0 {
            tokio::time::sleep(Duration::from_millis(1_200)).await;
        }
        let responses = burst(port, wave, 8, |i| {
            tenant("api.example.com", &format!("w{w}-tenant-{i:04}"))
        })
        .await;
        all.extend(responses);
    }
    let sent = wave * waves;
    let full = counter(&envoy, "tollgate_local_table_full");
    let evictions = counter(&envoy, "tollgate_local_table_evictions");
    let closed = counter(&envoy, "tollgate_fail_closed{policy=\"churn\"}");
    let allowed = counter(&envoy, "tollgate_allowed{policy=\"churn\"}");
    println!(
        "{sent} new tenants in {waves} waves of {wave} on {slots} slots: \
         table full {full}, evictions {evictions}, statuses {:?}",
        statuses(&all)
    );
    assert_eq!(full, 0, "new tenants found the table full");
    assert_eq!(closed, 0);
    assert!(all.iter().all(|r| r.status == 200), "{:?}", statuses(&all));
    assert_eq!(allowed, sent as u64);
    // Only `slots` records fit without evicting: every other new tenant replaced an idle one.
    assert!(
        evictions >= (sent - slots) as u64,
        "evictions {evictions} of {sent} inserts into {slots} slots"
    );
    assert_eq!(counter(&envoy, "tollgate_local_table_contended"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_on_one_policy_never_refuses_another_policys_new_tenants() {
    // 2,048 slots, two policies: a region of 1,024 each. `flood` (fail open) gets 4,000 new
    // ids whose buckets refill in hours, so every record it holds stays live and most of its
    // ids find its region full. `steady` (fail closed) gets 500 new tenants, half of them
    // before the flood starts and half interleaved with it: every one gets a record and a 200.
    let upstream = Upstream::start();
    let hourly = r#"{ "units": 1, "per": "1h" }"#;
    let doc = format!(
        r#"{{ "local_table": {{ "slots": 2048 }}, "policies": [{}, {}] }}"#,
        policy("flood", "flood.example.com", hourly, 20, "open"),
        policy("steady", "steady.example.com", hourly, 20, "closed"),
    );
    let (envoy, port) = start(&doc, &upstream);
    let before = burst(port, 250, 8, |i| {
        tenant("steady.example.com", &format!("early-{i:04}"))
    })
    .await;
    let flood = burst(port, 3_000, 8, |i| {
        tenant("flood.example.com", &format!("flood-{i:05}"))
    })
    .await;
    // One request in five is a new steady tenant, the rest more flood.
    let mixed = burst(port, 1_250, 8, |i| {
        if i % 5 == 0 {
            tenant("steady.example.com", &format!("late-{i:04}"))
        } else {
            tenant("flood.example.com", &format!("flood-more-{i:05}"))
        }
    })
    .await;
    let steady: Vec<&Response> = before.iter().chain(mixed.iter().step_by(5)).collect();
    assert_eq!(steady.len(), 500);
    let steady_statuses = statuses(steady.iter().copied());
    let full = counter(&envoy, "tollgate_local_table_full");
    let flood_open = counter(&envoy, "tollgate_fail_open{policy=\"flood\"}");
    let flood_allowed = counter(&envoy, "tollgate_allowed{policy=\"flood\"}");
    let steady_closed = counter(&envoy, "tollgate_fail_closed{policy=\"steady\"}");
    let steady_allowed = counter(&envoy, "tollgate_allowed{policy=\"steady\"}");
    println!(
        "flood: {flood_allowed} held, {flood_open} failed open; steady: {steady_allowed} \
         allowed, {steady_closed} failed closed, statuses {steady_statuses:?}; table full {full}"
    );
    // The flood met its own region's limit...
    assert!(flood_allowed <= 1024, "flood held {flood_allowed}");
    assert!(flood_open >= 4_000 - 1024, "flood failed open {flood_open}");
    assert!(flood.iter().chain(mixed.iter()).all(|r| r.status == 200));
    // ...and only the flood: every table-full decision was one of its requests.
    assert_eq!(full, flood_open);
    assert_eq!(steady_closed, 0, "steady tenants were refused");
    assert!(
        steady.iter().all(|r| r.status == 200),
        "steady statuses {steady_statuses:?}"
    );
    assert_eq!(steady_allowed, 500);
}
