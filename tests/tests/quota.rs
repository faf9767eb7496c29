#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of calendar quotas: a real Envoy (`--concurrency 4`, the shipped
//! `envoy/local.yaml`) loads the built filter with a monthly quota and a per-second rate on the
//! same key (the recipe of docs/src/policies/quotas.md, `policies/quota.json` with small numbers). The quota admits
//! its count, a denial's `Retry-After` and `RateLimit` count to the first of next month
//! (computed here by adding up month lengths, not by tollgate's arithmetic), and a request one
//! policy denies takes nothing from the other. A second Envoy runs on a wall clock shifted to
//! seconds before 1 January 2029 00:00 UTC (the preload shim of `tollgate_e2e::clock`), so a
//! real month boundary passes during the test.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tollgate_e2e::build::Build;
use tollgate_e2e::tollgate::{envoy_config, policy_metric};
use tollgate_e2e::{burst, send, Envoy, EnvoyOptions, RequestSpec, Response, Upstream};

const WORKERS: u32 = 4;
const DAY_MS: u64 = 86_400_000;

/// The recipe with small numbers: `quota` units a month and 1 unit a second (`burst` at once)
/// per tenant.
fn recipe(quota: u64, burst: u64) -> String {
    format!(
        r#"{{
  "policies": [
    {{ "name": "monthly-quota", "key": [{{ "header": "x-tenant-id" }}],
      "algorithm": "fixed_window", "rate": {{ "units": {quota}, "per": "1mo" }} }},
    {{ "name": "per-second", "key": [{{ "header": "x-tenant-id" }}],
      "rate": {{ "units": 1, "per": "1s" }}, "burst": {burst} }}
  ],
  "response": {{ "ratelimit_headers_on_allow": true }}
}}"#
    )
}

fn start(
    build: Build,
    policy: &str,
    upstream: &Upstream,
    env: Vec<(String, String)>,
) -> (Envoy, u16) {
    let config = build.config(envoy_config(
        "envoy/local.yaml",
        policy,
        upstream.port(),
        None,
    ));
    let envoy = Envoy::start(
        EnvoyOptions::new(config)
            .concurrency(WORKERS)
            .log_level("warn")
            .envs(env),
    );
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

fn host_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The first of the month after the one holding `t_ms`, 00:00 UTC, and the first of the
/// month holding it: found by adding up the lengths of years and months from 1970.
fn month_around(t_ms: u64) -> (u64, u64) {
    let leap = |y: u64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let (mut year, mut month, mut start) = (1970u64, 1u64, 0u64);
    loop {
        let days = match month {
            2 if leap(year) => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        };
        let next = start + days * DAY_MS;
        if next > t_ms {
            return (start, next);
        }
        start = next;
        month += 1;
        if month == 13 {
            (year, month) = (year + 1, 1);
        }
    }
}

fn tenant(path: &str) -> RequestSpec {
    RequestSpec::get(path).header("x-tenant-id", "acme")
}

fn denied_by(r: &Response) -> String {
    assert_eq!(r.status, 429, "{r:?}");
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    body["policy"].as_str().unwrap().to_string()
}

fn retry_after(r: &Response) -> u64 {
    r.header("retry-after").unwrap().parse().unwrap()
}

/// The `t` (or `w`) of `policy` in a `RateLimit` (`RateLimit-Policy`) header value.
fn field(value: &str, policy: &str, name: &str) -> u64 {
    let item = value
        .split(", ")
        .find(|i| i.starts_with(&format!("\"{policy}\"")))
        .unwrap_or_else(|| panic!("{policy} in {value}"));
    item.split(';')
        .find_map(|p| p.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("{name} in {item}"))
        .parse()
        .unwrap()
}

/// Asserts a whole-second wait counted on a clock read between `before` and `after` (ms)
/// ends at `boundary` (ms): ⌈(boundary − t) / 1000⌉ for some t in between, give or take 1.
fn assert_counts_to(seconds: u64, boundary: u64, before: u64, after: u64, what: &str) {
    let least = (boundary - after) / 1_000;
    let most = (boundary - before).div_ceil(1_000);
    assert!(
        seconds + 1 >= least && seconds <= most + 1,
        "{what}: {seconds} s, the boundary is {least}..={most} s away"
    );
}

/// The quota admits its count and no more; requests the per-second rate denies take nothing
/// from it; once it is spent, `Retry-After` and `RateLimit`'s `t` count to the first of next
/// month, and `RateLimit-Policy`'s `w` is this month's length.
async fn a_monthly_quota_admits_its_count_and_waits_for_the_first_of_next_month(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(build, &recipe(4, 2), &upstream, Vec::new());
    // 10 at once: the per-second rate admits its burst of 2 (3 on a machine that takes a
    // second to send them) and denies the rest.
    let first = burst(port, 10, 10, |_| tenant("/a")).await;
    let admitted = first.iter().filter(|r| r.status == 200).count();
    assert!((2..=3).contains(&admitted), "{admitted} admitted");
    for r in first.iter().filter(|r| r.status != 200) {
        assert_eq!(denied_by(r), "per-second");
        assert_eq!(retry_after(r), 1);
    }
    let allowed = first.iter().find(|r| r.status == 200).unwrap();
    let (month_start, next_month) = month_around(host_now_ms());
    let policy_header = allowed.header("ratelimit-policy").unwrap();
    assert_eq!(
        field(policy_header, "monthly-quota", "w"),
        (next_month - month_start) / 1_000,
        "{policy_header}"
    );
    assert_eq!(field(policy_header, "monthly-quota", "q"), 4);
    assert_eq!(field(policy_header, "per-second", "w"), 1);
    // The denials took nothing from the quota: one request a second, it admits exactly its 4.
    let mut total = admitted;
    let refused = loop {
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let before = host_now_ms();
        let r = send(port, tenant("/b")).await;
        let after = host_now_ms();
        if r.status == 200 {
            total += 1;
            assert!(total <= 4, "admitted past the quota");
            let t = field(r.header("ratelimit").unwrap(), "monthly-quota", "t");
            assert_counts_to(t, next_month, before, after, "RateLimit t");
            continue;
        }
        break (r, before, after);
    };
    let (r, before, after) = refused;
    assert_eq!(total, 4, "the quota's count");
    assert_eq!(denied_by(&r), "monthly-quota");
    assert_counts_to(retry_after(&r), next_month, before, after, "Retry-After");
    let ratelimit = r.header("ratelimit").unwrap();
    assert_eq!(field(ratelimit, "monthly-quota", "r"), 0);
    assert_counts_to(
        field(ratelimit, "monthly-quota", "t"),
        next_month,
        before,
        after,
        "RateLimit t",
    );
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        body["retry_after_seconds"].as_u64(),
        Some(retry_after(&r)),
        "{}",
        r.body
    );
    // More of them, all refused by the quota.
    let more = burst(port, 20, 10, |_| tenant("/c")).await;
    assert!(more.iter().all(|r| denied_by(r) == "monthly-quota"));
    assert_eq!(upstream.requests(), 4);
    assert_eq!(policy_metric(&envoy, "allowed", "monthly-quota"), 4);
}

/// 1 January 2029 00:00 UTC: a Monday, so a week, a month, a quarter and a year end then.
const NEW_YEAR_2029: u64 = 21_550 * DAY_MS;

/// An Envoy whose wall clock is seconds before the new year: December's quota is spent, the
/// quota's denials just before midnight take nothing from the per-second bucket (right after
/// midnight it still holds what it held), and January starts a new count that lasts 31 days.
async fn a_quota_resets_at_midnight_utc_on_the_first(build: Build) {
    /// How far before midnight Envoy's clock starts: room to start it on a loaded machine.
    const LEAD_MS: u64 = 12_000;
    let offset = NEW_YEAR_2029 as i64 - LEAD_MS as i64 - host_now_ms() as i64;
    let envoy_now = || (host_now_ms() as i64 + offset) as u64;
    let until = |at: u64| async move {
        let now = envoy_now();
        if at > now {
            tokio::time::sleep(Duration::from_millis(at - now)).await;
        }
    };
    let upstream = Upstream::start();
    let (_envoy, port) = start(
        build,
        &recipe(3, 10),
        &upstream,
        tollgate_e2e::clock::offset_env(offset),
    );
    assert!(
        envoy_now() < NEW_YEAR_2029 - 5_000,
        "Envoy took too long to start: its clock is past 2028-12-31 23:59:55"
    );
    // December: the quota's 3 (the per-second bucket keeps 7 of its 10), then its denial,
    // counted to midnight on Envoy's clock.
    for _ in 0..3 {
        let r = send(port, tenant("/dec")).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(
            r.header("ratelimit-policy")
                .map(|h| field(h, "monthly-quota", "w")),
            Some(31 * 86_400),
            "December has 31 days"
        );
    }
    let before = envoy_now();
    let r = send(port, tenant("/dec")).await;
    assert_eq!(denied_by(&r), "monthly-quota");
    assert_counts_to(
        retry_after(&r),
        NEW_YEAR_2029,
        before,
        envoy_now(),
        "Retry-After",
    );
    // 2.5 s before midnight, 30 more, all refused by the quota. Had they taken units of the
    // per-second bucket, it would hold about 2 at midnight, not 3.
    until(NEW_YEAR_2029 - 2_500).await;
    let late = burst(port, 30, 10, |_| tenant("/late")).await;
    assert!(
        envoy_now() < NEW_YEAR_2029,
        "the burst ran past midnight on this machine"
    );
    assert!(late.iter().all(|r| denied_by(r) == "monthly-quota"));
    // Midnight: a new month, 3 admitted at once, then a wait of all of January (31 days).
    until(NEW_YEAR_2029 + 50).await;
    for _ in 0..3 {
        let r = send(port, tenant("/jan")).await;
        assert_eq!(r.status, 200, "{r:?}");
        let ratelimit = r.header("ratelimit").unwrap();
        assert_counts_to(
            field(ratelimit, "monthly-quota", "t"),
            NEW_YEAR_2029 + 31 * DAY_MS,
            NEW_YEAR_2029,
            envoy_now(),
            "January's reset",
        );
    }
    let before = envoy_now();
    let r = send(port, tenant("/jan")).await;
    assert_eq!(denied_by(&r), "monthly-quota");
    assert_counts_to(
        retry_after(&r),
        NEW_YEAR_2029 + 31 * DAY_MS,
        before,
        envoy_now(),
        "Retry-After in January",
    );
    assert_eq!(upstream.requests(), 6);
}

/// A global quota: the limiter decides it in the Redis Function, on Redis' clock (here the
/// host's), with the same calendar: two Envoys together get its count, and a denial's
/// `Retry-After` counts to the first of next month.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_monthly_quota_holds_across_two_envoys_until_the_first_of_next_month() {
    use tollgate_e2e::tollgate::{start_ingress, Limiter, Store};
    use tollgate_e2e::RedisServer;
    let policy = r#"{
  "policies": [
    { "name": "monthly-quota", "key": [{ "header": "x-tenant-id" }],
      "algorithm": "fixed_window", "rate": { "units": 12, "per": "1mo" },
      "scope": "global", "on_unavailable": { "mode": "closed" } }
  ],
  "limiter": { "cluster": "tollgate_limiter", "timeout": "2s" }
}"#;
    let redis = RedisServer::start();
    let limiter = Limiter::start(policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let start = || {
        let config = envoy_config(
            "envoy/global.yaml",
            policy,
            upstream.port(),
            Some(limiter.port()),
        );
        start_ingress(config, 2)
    };
    let ((_a, port_a), (_b, port_b)) = (start(), start());
    let before = host_now_ms();
    let (ra, rb) = tokio::join!(
        burst(port_a, 30, 10, |_| tenant("/a")),
        burst(port_b, 30, 10, |_| tenant("/b"))
    );
    let after = host_now_ms();
    let all: Vec<&Response> = ra.iter().chain(&rb).collect();
    assert_eq!(all.iter().filter(|r| r.status == 200).count(), 12);
    let (_, next_month) = month_around(after);
    for r in all.iter().filter(|r| r.status != 200) {
        assert_eq!(denied_by(r), "monthly-quota");
        assert_counts_to(retry_after(r), next_month, before, after, "Retry-After");
    }
    assert_eq!(upstream.requests(), 12);
}

tollgate_e2e::both_builds!(
    async: [
        a_monthly_quota_admits_its_count_and_waits_for_the_first_of_next_month,
        a_quota_resets_at_midnight_utc_on_the_first,
    ],
    sync: [],
);
