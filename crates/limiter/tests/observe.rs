//! What the limiter shows of its traffic: one hot tenant among many cold ones is at the top
//! of `GET /v1/hot-keys` (lease and admin listeners) under its salted hash, never its id; the
//! per-policy active-keys gauge is near the true count; the remaining-ratio histogram fills;
//! the store's execution counters grow (the memory store's in-process time here, Redis'
//! `INFO commandstats` in the `e2e` tier, through the real binary, whose log names the hot
//! key by its hash).

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

use serde_json::Value;
use support::*;
use tollgate_limiter::{HotKeySettings, StoreConfig};

/// Cold tenants driven, one call each.
const COLD: usize = 300;
/// Calls of the hot tenant.
const HOT_CALLS: usize = 400;
/// The policy driven (burst 1,000, so every call is granted).
const POLICY: &str = "thousand";
/// Keys reported per policy: 80 counters per 10 s, more than the 50 cold tenants of one
/// batch, so even in a bucket that starts with a cold batch the hot tenant finds a free
/// counter and is counted exactly.
const TOP: usize = 20;

/// A batch of leases of `POLICY`, one per key.
fn batch(ids: &str, keys: &[String]) -> String {
    let items: Vec<String> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            format!(r#"{{"id":"{ids}-{i}","policy":"{POLICY}","key":"{key}","min":1,"want":1}}"#)
        })
        .collect();
    format!(r#"{{"leases":[{}]}}"#, items.join(","))
}

/// `COLD` cold tenants once each and the hot tenant `HOT_CALLS` times, in batches of 50
/// interleaved; every item granted.
async fn drive(addr: SocketAddr, hot: &str, cold_prefix: &str) {
    let cold: Vec<String> = (0..COLD).map(|i| format!("{cold_prefix}-{i}")).collect();
    let hots = vec![hot.to_owned(); 50];
    let mut cold_batches = cold.chunks(50);
    for round in 0..HOT_CALLS / 50 {
        for (ids, keys) in [
            (format!("h{round}"), Some(&hots[..])),
            (format!("c{round}"), cold_batches.next()),
        ] {
            let Some(keys) = keys else { continue };
            let (status, v) = post(addr, "/v1/leases", &batch(&unique(&ids), keys)).await;
            assert_eq!(status, 200, "{v}");
            for lease in v["leases"].as_array().unwrap() {
                assert_eq!(lease["granted"], 1, "{lease}");
            }
        }
    }
    assert!(cold_batches.next().is_none(), "every cold tenant driven");
}

/// The first 12 hex digits of SHA-256(salt ‖ key), as the limiter shows keys.
fn shown(salt: &[u8], key: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(salt)
        .chain_update(key.as_bytes())
        .finalize();
    digest[..6].iter().map(|b| format!("{b:02x}")).collect()
}

/// The hot-key report of `POLICY`, asserting what every listener must show.
fn check_report(body: &str, hot_hash: &str, secret: &str) -> Value {
    assert!(!body.contains(secret), "a tenant id in the report: {body}");
    let v: Value = serde_json::from_str(body).unwrap();
    let p = v["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy"] == POLICY)
        .unwrap_or_else(|| panic!("no {POLICY} in {v}"))
        .clone();
    let top = &p["hot_keys"][0];
    assert_eq!(top["key"], hot_hash, "{p}");
    for exact in ["calls", "calls_min", "calls_max"] {
        assert_eq!(top[exact], HOT_CALLS as u64, "{p}");
    }
    assert_eq!(top["units_granted"], HOT_CALLS as u64, "{p}");
    assert_eq!(p["calls"], (HOT_CALLS + COLD) as u64, "{p}");
    let share = top["share_of_node"].as_f64().unwrap();
    let expected = HOT_CALLS as f64 / (HOT_CALLS + COLD) as f64;
    assert!((share - expected).abs() < 1e-9, "{p}");
    // The cold tenants: each certainly called once at most (their `calls` may include what
    // their counters inherited).
    let reported = p["hot_keys"].as_array().unwrap();
    assert_eq!(reported.len(), TOP, "{p}");
    for cold in reported.iter().skip(1) {
        assert!(cold["calls_min"].as_u64().unwrap() <= 1, "{cold}");
    }
    p
}

/// Scrapes `/metrics` until `ready` holds (bounded), naming what it waited for.
async fn metrics_until(addr: SocketAddr, what: &str, ready: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + WAIT_LIMIT;
    loop {
        let (status, text) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        if ready(&text) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no {what} within {WAIT_LIMIT:?}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The gauge, the histogram and the report's cardinality near the truth.
fn check_metrics(text: &str, secret: &str) {
    assert!(!text.contains(secret), "a tenant id in /metrics:\n{text}");
    let distinct = (COLD + 1) as f64;
    let gauge = sample::<f64>(
        text,
        &format!(r#"tollgate_limiter_active_keys{{policy="{POLICY}"}}"#),
    )
    .unwrap_or_else(|| panic!("no active keys gauge:\n{text}"));
    // Linear counting's standard error at 301 keys is ~1.1 %: 6 % is over 5 of them.
    assert!(
        (gauge - distinct).abs() <= distinct * 0.06,
        "{gauge} active keys for {distinct}"
    );
    let count = sample::<f64>(
        text,
        &format!(r#"tollgate_limiter_remaining_ratio_count{{policy="{POLICY}"}}"#),
    );
    assert_eq!(count, Some((HOT_CALLS + COLD) as f64), "{text}");
    // Every bucket of `thousand` stays above 60 % full (the hot one gives 400 of 1,000).
    let below = sample::<f64>(
        text,
        &format!(r#"tollgate_limiter_remaining_ratio_bucket{{policy="{POLICY}",le="0.5"}}"#),
    );
    assert_eq!(below, Some(0.0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hot_tenant_tops_the_report_memory() {
    let mut c = config(StoreConfig::Memory);
    c.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let dir = tollgate_e2e::paths::new_log_dir("", "observe-salt");
    let salt_file = dir.join("salt");
    std::fs::write(&salt_file, "memory-salt\n").unwrap();
    c.hot_keys = HotKeySettings {
        top: TOP,
        salt_file: Some(salt_file),
        ..HotKeySettings::default()
    };
    let limiter = start_with(c).await;
    let secret = unique("observed");
    let hot = format!("{secret}-hot");
    drive(limiter.addr(), &hot, &format!("{secret}-cold")).await;

    let hot_hash = shown(b"memory-salt", &hot);
    let admin = limiter.admin_addr().unwrap();
    for addr in [limiter.addr(), admin] {
        let (status, body) = get(addr, "/v1/hot-keys").await;
        assert_eq!(status, 200, "{body}");
        let p = check_report(&body, &hot_hash, &secret);
        let active = p["active_keys"].as_f64().unwrap();
        assert!(
            (active - (COLD + 1) as f64).abs() <= (COLD + 1) as f64 * 0.06,
            "{p}"
        );
    }
    let text = get(limiter.addr(), "/metrics").await.1;
    check_metrics(&text, &secret);
    // The in-process decision time, sampled every 5 s after a baseline.
    let calls = r#"tollgate_limiter_store_exec_calls_total{node="memory"}"#;
    let usec = r#"tollgate_limiter_store_exec_microseconds_total{node="memory"}"#;
    let text = metrics_until(limiter.addr(), "memory execution sample", |t| {
        sample::<f64>(t, calls).is_some_and(|c| c > 0.0)
    })
    .await;
    assert!(
        sample::<f64>(&text, usec).is_some_and(|u| u > 0.0),
        "{text}"
    );
    assert!(
        text.contains(
            r#"tollgate_limiter_http_responses_total{endpoint="hot_keys",status="200"} 2"#
        ),
        "{text}"
    );
    limiter.shutdown().await;
}

/// The real binary on Redis: flags by environment and command line, the report on both
/// listeners, the gauge and histogram, `FCALL` execution counters from `INFO commandstats`,
/// and the hot-key warning in its log — all without the tenant ids.
#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hot_tenant_tops_the_report_and_is_logged_redis() {
    let redis = shared_redis();
    let bin = env!("CARGO_BIN_EXE_tollgate-limiter");
    let dir = tollgate_e2e::paths::new_log_dir("", "observe-redis");
    let salt_file = dir.join("salt");
    std::fs::write(&salt_file, "redis-salt").unwrap();
    let (port, admin_port) = (tollgate_e2e::free_port(), tollgate_e2e::free_port());
    let mut cmd = std::process::Command::new(bin);
    cmd.args([
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--admin-listen",
        &format!("127.0.0.1:{admin_port}"),
        "--hot-key-share",
        "0.3",
        "--hot-keys",
        &TOP.to_string(),
        "--log-format",
        "json",
    ])
    .env("TOLLGATE_POLICIES", policy_file(DOC))
    .env("TOLLGATE_REDIS", redis.url())
    .env("TOLLGATE_STORE_TIMEOUT", "500ms")
    .env("TOLLGATE_HOT_KEY_MIN_CALLS", "100")
    .env("TOLLGATE_HOT_KEY_SALT_FILE", &salt_file);
    let child = tollgate_e2e::process::ChildProcess::spawn("limiter", cmd, &dir).unwrap();
    let ready = tollgate_e2e::process::wait_for("the limiter binary ready", WAIT_LIMIT, || {
        tollgate_e2e::http_blocking::get(port, "/readyz", Duration::from_millis(500))
            .ok()
            .filter(|r| r.status == 200)
    });
    assert!(ready.is_ok(), "{ready:?}\n{}", child.stderr());
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
    let node = format!("127.0.0.1:{}", redis.port());
    let calls = format!(r#"tollgate_limiter_store_exec_calls_total{{node="{node}"}}"#);
    let usec = format!(r#"tollgate_limiter_store_exec_microseconds_total{{node="{node}"}}"#);
    // The baseline sample (the series at 0) comes first.
    metrics_until(addr, "execution baseline", |t| {
        sample::<f64>(t, &calls).is_some()
    })
    .await;

    let secret = unique("observed");
    let hot = format!("{secret}-hot");
    drive(addr, &hot, &format!("{secret}-cold")).await;
    let hot_hash = shown(b"redis-salt", &hot);
    for at in [addr, admin] {
        let (status, body) = get(at, "/v1/hot-keys").await;
        assert_eq!(status, 200, "{body}");
        let p = check_report(&body, &hot_hash, &secret);
        assert_eq!(p["hot_keys"][0]["node"], node.as_str(), "{p}");
    }
    let text = get(admin, "/metrics").await.1;
    check_metrics(&text, &secret);
    // Redis ran at least the 700 FCALLs; each took a few microseconds at least.
    let text = metrics_until(admin, "FCALL execution counters", |t| {
        sample::<f64>(t, &calls).is_some_and(|c| c >= (HOT_CALLS + COLD) as f64)
    })
    .await;
    let (c, u) = (
        sample::<f64>(&text, &calls).unwrap(),
        sample::<f64>(&text, &usec).unwrap(),
    );
    let round_trip = |part: &str| {
        sample::<f64>(
            &text,
            &format!(
                r#"tollgate_limiter_store_call_duration_seconds_{part}{{node="{node}",op="lease"}}"#
            ),
        )
        .unwrap()
    };
    println!(
        "Redis FCALL: {c} calls, {u} µs, {:.1} µs per call executing; {:.1} µs per lease call round trip",
        u / c,
        round_trip("sum") / round_trip("count") * 1e6
    );
    assert!(u >= c, "{u} µs for {c} calls");
    assert!(
        text.contains(&format!(r#"tollgate_limiter_store_keys{{node="{node}"}}"#)),
        "{text}"
    );

    // The warning: checked every second, once per key and minute.
    let line = tollgate_e2e::process::wait_for("the hot-key warning", WAIT_LIMIT, || {
        child
            .stderr()
            .lines()
            .find(|l| l.contains("hot key:"))
            .map(str::to_owned)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", child.stderr()));
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["level"], "WARN", "{line}");
    assert_eq!(v["key"], hot_hash.as_str(), "{line}");
    assert_eq!(v["policy"], POLICY, "{line}");
    assert_eq!(v["node"], node.as_str(), "{line}");
    // The check runs every second, so it may have caught the drive halfway.
    let logged = v["calls"].as_u64().unwrap();
    assert!((100..=HOT_CALLS as u64).contains(&logged), "{line}");
    let log = child.stderr();
    assert!(!log.contains(&secret), "a tenant id in the log:\n{log}");
    assert_eq!(log.matches("hot key:").count(), 1, "{log}");
}
