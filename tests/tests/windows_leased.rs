#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end test of a global sliding log whose leased units are spent late: two real Envoys
//! (shipped `envoy/global.yaml`, two workers each) with the built filter (both builds), the
//! real limiter on its memory store. Envoy A leases the whole budget early in a window, spends
//! a few units, and spends the rest shortly before its lease ends; then Envoy B bursts just
//! after a window has passed since the grant. A leased unit counts in the limiter's log until
//! a window after the instance may last spend it, so every rolling window of admissions holds
//! at most the limit (if it counted from the grant, B would get the whole limit again while
//! A's late units are still inside the rolling window).
//!
//! Admission times are what the client saw: a request was admitted somewhere between sending
//! it and receiving its answer. A rolling window counts only the admissions it certainly holds
//! (both ends inside), so no scheduling delay makes an exact log look over its limit; the
//! overshoot the check exists for is the whole limit again within a fraction of a window,
//! far more than any delay hides.

use std::time::{Duration, Instant};

use serde_json::Value;
use tollgate_e2e::build::Build;
use tollgate_e2e::client::try_send_timeout;
use tollgate_e2e::tollgate::{envoy_config, item, policy_metric, start_ingress, Limiter, Store};
use tollgate_e2e::{send, RequestSpec, Upstream};

const LIMIT: usize = 20;
const WINDOW_MS: u64 = 3_000;

/// 20 per 3 s as a global sliding log; leases sized for ten seconds of demand, at most the
/// limit, so Envoy A's second lease takes all that is left.
fn policy() -> String {
    format!(
        r#"{{ "policies": [{{ "name": "log", "match": {{ "routes": ["GET /items/{{id}}"] }},
      "key": [{{ "header": "x-tenant-id" }}], "algorithm": "sliding_log",
      "rate": {{ "units": {LIMIT}, "per": "{WINDOW_MS}ms" }}, "scope": "global",
      "on_unavailable": {{ "mode": "closed" }} }}],
  "limiter": {{ "cluster": "tollgate_limiter", "timeout": "2s", "lease_horizon": "10s",
    "lease_max": {LIMIT} }} }}"#
    )
}

/// One request as the client saw it: sent, answered, status.
#[derive(Debug, Clone, Copy)]
struct Seen {
    sent: Instant,
    answered: Instant,
    status: u16,
}

async fn one(port: u16, spec: RequestSpec) -> Seen {
    let sent = Instant::now();
    let response = try_send_timeout(port, spec, Duration::from_secs(15))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    Seen {
        sent,
        answered: Instant::now(),
        status: response.status,
    }
}

/// `n` requests at once, each on its own connection.
async fn burst(port: u16, n: usize) -> Vec<Seen> {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        tasks.spawn(one(port, item("acme", i)));
    }
    let mut seen = Vec::with_capacity(n);
    while let Some(s) = tasks.join_next().await {
        seen.push(s.unwrap());
    }
    seen
}

fn admitted(seen: &[Seen]) -> usize {
    seen.iter().filter(|s| s.status == 200).count()
}

/// The most admissions any rolling window of `WINDOW_MS` certainly holds (windows starting at
/// each admission's send time), with that window's start.
fn busiest(admissions: &[Seen]) -> (usize, Option<Instant>) {
    let window = Duration::from_millis(WINDOW_MS);
    admissions
        .iter()
        .map(|a| {
            let start = a.sent;
            let inside = admissions
                .iter()
                .filter(|s| s.sent >= start && s.answered < start + window)
                .count();
            (inside, Some(start))
        })
        .max_by_key(|(n, _)| *n)
        .unwrap_or((0, None))
}

/// Until the limiter's clock is early in a slot of the log's window grid: a lease of a
/// throwaway key says how long its slot has left. Returns when the slot ends, at the latest.
async fn early_in_a_slot(limiter: &Limiter) -> Instant {
    let mut probe = 0;
    loop {
        probe += 1;
        let body = format!(
            r#"{{"leases":[{{"id":"probe-{probe}","policy":"log","key":"probe-{probe}","min":1,"want":1}}]}}"#
        );
        let asked = Instant::now();
        let r = send(
            limiter.port(),
            RequestSpec::post("/v1/leases", body).header("content-type", "application/json"),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        let left = v["leases"][0]["expires_ms"].as_u64().expect("a lease");
        assert!(left <= WINDOW_MS, "{v}");
        let ends = Instant::now() + Duration::from_millis(left);
        if left >= WINDOW_MS - 300 && asked.elapsed() < Duration::from_millis(100) {
            return ends;
        }
        assert!(probe < 5, "the limiter never answered a probe in time");
        tokio::time::sleep_until((ends + Duration::from_millis(20)).into()).await;
    }
}

async fn leased_units_spent_late_stay_within_every_rolling_window(build: Build) {
    let policy = policy();
    let limiter = Limiter::start(&policy, Store::Memory, &[]);
    let upstream = Upstream::start();
    let start = || {
        let config = build.config(envoy_config(
            "envoy/global.yaml",
            &policy,
            upstream.port(),
            Some(limiter.port()),
        ));
        start_ingress(config, 2)
    };
    let ((a, port_a), (_b, port_b)) = (start(), start());

    let slot_ends = early_in_a_slot(&limiter).await;
    let t0 = Instant::now();
    // A: six requests 20 ms apart. Its first lease is small (no demand seen yet); the refill
    // asked when it runs out is sized for ten seconds of this demand: all that is left.
    let mut early = Vec::new();
    for _ in 0..6 {
        early.push(one(port_a, item("acme", 0)).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let granted_a = policy_metric(&a, "tokens_granted", "log");
    // A spends what it holds 1.8 s after the grant, 1.2 s before its lease ends at the latest
    // (the slot's end); B bursts 3.4 s after the grant: past a window after it, before a
    // window after A's lease ends.
    tokio::time::sleep_until((t0 + Duration::from_millis(1_800)).into()).await;
    let late = burst(port_a, 30).await;
    tokio::time::sleep_until((t0 + Duration::from_millis(3_400)).into()).await;
    let on_b = burst(port_b, 30).await;

    let all: Vec<Seen> = early.iter().chain(&late).chain(&on_b).copied().collect();
    for s in &all {
        assert!(s.status == 200 || s.status == 429, "{s:?}");
    }
    let at = |i: Instant| i.saturating_duration_since(t0).as_millis();
    let times: Vec<(u128, u128)> = all
        .iter()
        .filter(|s| s.status == 200)
        .map(|s| (at(s.sent), at(s.answered)))
        .collect();
    let admissions: Vec<Seen> = all.iter().filter(|s| s.status == 200).copied().collect();
    let (most, from) = busiest(&admissions);
    println!(
        "{build:?}: A early {} (granted {granted_a}), A late {}, B {}; busiest rolling window \
         holds {most} from {:?} ms (slot ended {} ms); admissions (sent, answered) ms: {times:?}",
        admitted(&early),
        admitted(&late),
        admitted(&on_b),
        from.map(at),
        at(slot_ends),
    );
    assert_eq!(admitted(&early), 6, "the budget was untouched");
    assert!(
        admitted(&late) >= 1,
        "A spent none of its leased units late (the case this test is about)"
    );
    assert!(
        most <= LIMIT,
        "{most} admitted within one rolling window of {WINDOW_MS} ms against a limit of {LIMIT}"
    );
}

tollgate_e2e::both_builds!(
    async: [leased_units_spent_late_stay_within_every_rolling_window],
    sync: [],
);
