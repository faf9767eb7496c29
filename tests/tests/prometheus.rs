#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The dashboard and the shipped rules against a real Prometheus (Debian's `prometheus`,
//! with `promtool`): Envoy (shipped `envoy/global.yaml`, its `stats_tags`) with the built
//! filter, the real limiter on a real `redis-server`, a metered upstream, and Prometheus
//! scraping Envoy's `/stats/prometheus` and the limiter's `/metrics` every second.
//!
//! Traffic is driven (allowed, denied, shadow-denied, identity missing, settled with refunds
//! and debt, lease returns), then faults one after the other, each followed by the alerts of
//! deploy/prometheus/tollgate-rules.yaml it must raise, which must not fire before it: the
//! limiter's policy file changed (policy version drift); the limiter killed (callouts failing,
//! leases undecided, a fail-open policy admitting unchecked, a fail-closed one refusing), then
//! restarted; more live keys than the shared table holds (table full); Redis killed (store
//! errors). Then every query of dashboards/tollgate.json (parsed by tools/promql-metrics) and
//! every recording rule must evaluate without error and return at least one series.
//!
//! The rules are loaded as shipped except their `for:` durations, which a copy shortens to 1s
//! (a page after minutes is the point in production, not in a test).

mod ops;

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ops::{root, run, run_ok, scratch};
use serde_json::Value;
use tollgate_e2e::process::{self, ChildProcess};
use tollgate_e2e::tollgate::{envoy_config, policy_metric, prometheus_value, start_ingress};
use tollgate_e2e::tollgate::{Limiter, Store};
use tollgate_e2e::{burst, free_port, http_blocking, send, MeteredRequest, UsageIn};
use tollgate_e2e::{Envoy, MeteredUpstream, RedisServer, RequestSpec};

const RULES: &str = "deploy/prometheus/tollgate-rules.yaml";
const DASHBOARD: &str = "dashboards/tollgate.json";
/// How long any one alert may take to fire once its fault is there (scrape 1 s, evaluation
/// 1 s, `for: 1s`: a few seconds; the rest is slack for a loaded machine).
const ALERT_WAIT: Duration = Duration::from_secs(60);
/// How long a target may take to be scraped, or a scraped value to reach what the traffic
/// made it (scrape every second; the rest is slack for a loaded machine).
const SCRAPE_WAIT: Duration = Duration::from_secs(60);
/// How long a dashboard query or recording rule may take to have series once the traffic it
/// is about goes on (a rate over 1m needs two samples of a counter that moved; the store's
/// execution statistics are sampled every 5 s): a few seconds; the rest is slack.
const QUERY_WAIT: Duration = Duration::from_secs(90);

/// Slots of the shared table: split between the six policies, about 40 each, so `crowded`'s
/// 160 hour-long tenants cannot all get one.
const SLOTS: u64 = 256;

/// Six policies, one per condition the dashboard and the rules watch.
fn policy_document(marker: &str) -> String {
    format!(
        r#"{{
  "local_table": {{ "slots": {SLOTS} }},
  "policies": [
    {{ "name": "tokens", "match": {{ "routes": ["POST /v1/chat/completions"] }},
      "key": [{{ "header": "x-tenant-id" }}], "rate": {{ "units": 1000, "per": "1s" }}, "burst": 200,
      "reserve": {{ "from": {{ "header": "x-estimated-units" }}, "default": 10, "max": 100 }},
      "settle": {{ "from": {{ "header": "x-usage-units" }}, "max_debt": 100 }},
      "scope": "global", "on_unavailable": {{ "mode": "closed" }} }},
    {{ "name": "items", "match": {{ "routes": ["GET /items/{{id}}"] }},
      "key": [{{ "header": "x-tenant-id" }}], "on_missing_key": "deny",
      "rate": {{ "units": 1, "per": "1m" }}, "burst": 5,
      "scope": "global", "on_unavailable": {{ "mode": "closed" }} }},
    {{ "name": "open", "match": {{ "routes": ["GET /open/{{id}}"] }},
      "key": [{{ "header": "x-tenant-id" }}], "rate": {{ "units": 100, "per": "1s" }}, "burst": 100,
      "scope": "global", "on_unavailable": {{ "mode": "open" }} }},
    {{ "name": "fallback", "match": {{ "routes": ["GET /fallback/{{id}}"] }},
      "key": [{{ "header": "x-tenant-id" }}], "rate": {{ "units": 1, "per": "1m" }}, "burst": 4,
      "scope": "global",
      "on_unavailable": {{ "mode": "local", "share": 0.5, "stale_ttl": "30s", "then": "closed" }} }},
    {{ "name": "shadow", "match": {{ "routes": ["GET /shadow/{{id}}"] }},
      "key": [{{ "header": "x-tenant-id" }}], "rate": {{ "units": 1, "per": "1h" }}, "burst": 1,
      "enforce": false }},
    {{ "name": "{marker}", "match": {{ "routes": ["GET /crowded/{{id}}"] }},
      "key": [{{ "header": "x-tenant-id" }}], "rate": {{ "units": 1, "per": "1h" }}, "burst": 20,
      "on_unavailable": {{ "mode": "open" }} }}
  ],
  "limiter": {{ "cluster": "tollgate_limiter", "timeout": "1s" }}
}}"#
    )
}

// --- Prometheus -------------------------------------------------------------------------------

fn tool(name: &str) -> PathBuf {
    tollgate_e2e::paths::which(name).unwrap_or_else(|| {
        panic!("{name} not found on PATH: run tools/setup (Debian package `prometheus`)")
    })
}

/// A real Prometheus on a free loopback port, its TSDB in the test's scratch directory.
struct Prometheus {
    process: ChildProcess,
    port: u16,
}

impl Prometheus {
    /// Writes `prometheus.yml` (scrape and evaluate every second; `targets` are (job, port,
    /// metrics path) on 127.0.0.1; `rules` loaded), checks it with `promtool check config` and
    /// starts Prometheus on it. Ready when `/-/ready` answers 200.
    fn start(dir: &Path, targets: &[(&str, u16, &str)], rules: &Path) -> Prometheus {
        let mut config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}\nscrape_configs:\n",
            rules.display()
        );
        for (job, port, path) in targets {
            config.push_str(&format!(
                "  - job_name: {job}\n    metrics_path: {path}\n    static_configs:\n      \
                 - targets: ['127.0.0.1:{port}']\n"
            ));
        }
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, &config).unwrap();
        let mut check = Command::new(tool("promtool"));
        check.args(["check", "config"]).arg(&file);
        run_ok(check);

        let mut last = String::new();
        for attempt in 0..5 {
            let port = free_port();
            let data = dir.join(format!("tsdb-{attempt}"));
            let mut cmd = Command::new(tool("prometheus"));
            cmd.arg(format!("--config.file={}", file.display()))
                .arg(format!("--storage.tsdb.path={}", data.display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--log.level=warn");
            let mut process = ChildProcess::spawn("prometheus", cmd, dir).unwrap();
            let ready = process::wait_for("prometheus /-/ready", process::STARTUP_DEADLINE, || {
                if !process.is_running() {
                    return Some(false);
                }
                http_blocking::get(port, "/-/ready", Duration::from_secs(1))
                    .ok()
                    .filter(|r| r.status == 200)
                    .map(|_| true)
            });
            if ready == Ok(true) {
                return Prometheus { process, port };
            }
            last = process::tail(&process.stderr(), 20);
            process.kill();
        }
        panic!("prometheus did not start:\n{last}");
    }

    /// `GET /api/v1/<path>`: the `data` of a `success` answer, else the error it gave.
    fn api(&self, path: &str) -> Result<Value, String> {
        let r = http_blocking::get(
            self.port,
            &format!("/api/v1/{path}"),
            Duration::from_secs(5),
        )
        .map_err(|e| e.to_string())?;
        let v: Value = serde_json::from_str(&r.body)
            .map_err(|e| format!("HTTP {}: not JSON ({e}): {}", r.status, r.body))?;
        if v["status"] != "success" {
            return Err(format!(
                "HTTP {}: {} {}",
                r.status, v["errorType"], v["error"]
            ));
        }
        Ok(v["data"].clone())
    }

    /// An instant query: its result vector (an error for anything else).
    fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let data = self.api(&format!("query?query={}", url_encode(expr)))?;
        match (&data["resultType"], &data["result"]) {
            (t, Value::Array(series)) if t == "vector" => Ok(series.clone()),
            (t, _) => Err(format!("result type {t}, not a vector: {data}")),
        }
    }

    /// The value of a query that returns one series.
    fn scalar(&self, expr: &str) -> Option<f64> {
        let series = self.query(expr).ok()?;
        series.first()?["value"][1].as_str()?.parse().ok()
    }

    /// Names of the alerts in state `firing`.
    fn firing(&self) -> BTreeSet<String> {
        let data = self
            .api("alerts")
            .unwrap_or_else(|e| panic!("/api/v1/alerts: {e}"));
        data["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["state"] == "firing")
            .map(|a| a["labels"]["alertname"].as_str().unwrap().to_string())
            .collect()
    }

    /// Waits until `job`'s target has been scraped successfully (`up == 1`).
    fn wait_up(&self, job: &str) {
        let expr = format!("up{{job=\"{job}\"}}");
        process::wait_for(&format!("Prometheus to scrape {job}"), SCRAPE_WAIT, || {
            (self.scalar(&expr) == Some(1.0)).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}; targets: {:?}", self.api("targets")));
    }

    /// Waits until `expr` (one series) is at least `at_least`: the traffic has been scraped.
    fn wait_value(&self, expr: &str, at_least: f64) {
        process::wait_for(
            &format!("Prometheus to see {expr} >= {at_least}"),
            SCRAPE_WAIT,
            || self.scalar(expr).filter(|v| *v >= at_least),
        )
        .unwrap_or_else(|e| panic!("{e}; last {:?}", self.scalar(expr)));
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        self.process.kill();
    }
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Runs `traffic` until `alert` is firing, at most [`ALERT_WAIT`]; returns how long it took.
async fn fire<F, Fut>(prom: &Prometheus, alert: &str, mut traffic: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let start = Instant::now();
    loop {
        if prom.firing().contains(alert) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < ALERT_WAIT,
            "{alert} did not fire within {ALERT_WAIT:?}; firing: {:?}; alerts: {:?}",
            prom.firing(),
            prom.api("alerts")
        );
        traffic().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Asserts that none of `alerts` fires before the fault that should raise them.
fn not_firing_yet(prom: &Prometheus, alerts: &[&str]) {
    let firing = prom.firing();
    let early: Vec<&&str> = alerts.iter().filter(|a| firing.contains(**a)).collect();
    assert!(
        early.is_empty(),
        "{early:?} fire before their fault; firing: {firing:?}"
    );
}

// --- the rules --------------------------------------------------------------------------------

/// `promtool check rules` on the shipped file: it must pass and name its rule count.
fn check_rules(path: &Path) -> String {
    let mut cmd = Command::new(tool("promtool"));
    cmd.args(["check", "rules"]).arg(path);
    let out = run(cmd);
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "promtool check rules {}: {text}",
        path.display()
    );
    text
}

/// The shipped rules with every `for:` shortened to 1s, and nothing else changed.
fn rules_for_the_test(dir: &Path) -> PathBuf {
    let shipped = std::fs::read_to_string(root().join(RULES)).unwrap();
    let mut changed = 0;
    let text: String = shipped
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            if trimmed.starts_with("for: ") {
                changed += 1;
                format!("{}for: 1s\n", &line[..line.len() - trimmed.len()])
            } else {
                format!("{line}\n")
            }
        })
        .collect();
    assert!(changed > 0, "{RULES} has no `for:` to shorten");
    let path = dir.join("tollgate-rules.yaml");
    std::fs::write(&path, text).unwrap();
    check_rules(&path);
    path
}

/// (alert names, recording rule names) of the shipped rules.
fn rule_names() -> (BTreeSet<String>, Vec<String>) {
    let doc = ops::yaml_doc(&root().join(RULES));
    let mut alerts = BTreeSet::new();
    let mut records = Vec::new();
    for group in doc["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            if let Some(a) = rule["alert"].as_str() {
                alerts.insert(a.to_string());
            }
            if let Some(r) = rule["record"].as_str() {
                records.push(r.to_string());
            }
        }
    }
    (alerts, records)
}

/// Asks the regional limiter for a lease of `items` for `key` (as an Envoy would); the status.
fn regional_lease(regional: &Limiter, key: &str) -> u16 {
    let body = format!(
        r#"{{"leases":[{{"id":"{key}","policy":"items","key":"{key}","min":1,"want":2,"holder":"probe","demand_per_s":1}}]}}"#
    );
    tollgate_e2e::http_blocking::post(regional.port(), "/v1/leases", &body, Duration::from_secs(5))
        .map(|r| r.status)
        .unwrap_or(0)
}

/// Every query of the dashboard, with Grafana's variables as a user sees them with
/// "All" selected: `$policy` is its `allValue` `.*`, `$__rate_interval` 1m.
fn dashboard_queries() -> Vec<(String, String)> {
    let out = run_ok(ops::py_tool(
        "promql-metrics",
        &[root().join(DASHBOARD).to_str().unwrap()],
    ));
    let parsed: Value = serde_json::from_str(&out).unwrap();
    parsed
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            assert!(q["error"].is_null(), "{q}");
            let expr = q["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "1m")
                .replace("$policy", ".*");
            (
                format!("{} ({})", q["panel"].as_str().unwrap(), q["ref"]),
                expr,
            )
        })
        .collect()
}

// --- traffic ----------------------------------------------------------------------------------

fn tenant(path: &str, tenant: &str) -> RequestSpec {
    RequestSpec::get(path).header("x-tenant-id", tenant)
}

fn chat(tenant: &str, used: u64) -> RequestSpec {
    RequestSpec::post("/v1/chat/completions", "{}")
        .header("x-tenant-id", tenant)
        .header("x-estimated-units", "10")
        .usage(used)
}

fn counter(envoy: &Envoy, series: &str) -> f64 {
    prometheus_value(&envoy.stats_prometheus(), series)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_and_alerts_against_a_real_prometheus() {
    let started = Instant::now();
    let dir = scratch("prometheus");
    let checked = check_rules(&root().join(RULES));
    let rules = rules_for_the_test(&dir);
    let (alerts, records) = rule_names();

    let doc = policy_document("crowded");
    let redis = RedisServer::start();
    // Deadlines generous enough that a loaded machine causes no failures of its own: only the
    // faults below may raise alerts.
    let mut limiter = Limiter::start(
        &doc,
        Store::Redis(redis.url()),
        &["--lease-ttl", "1s", "--store-timeout", "1s"],
    );
    // A regional limiter leasing the global policies from `limiter` (the regions row of the
    // dashboard, the parent alert).
    let parent_url = format!("http://127.0.0.1:{}", limiter.port());
    let regional = Limiter::start(
        &doc,
        Store::Memory,
        &[
            "--parent",
            &parent_url,
            "--region",
            "prom",
            "--parent-timeout",
            "500ms",
        ],
    );
    limiter.wait_ready();
    regional.wait_ready();
    let upstream = MeteredUpstream::start();
    let config = envoy_config(
        "envoy/global.yaml",
        &doc,
        upstream.port(),
        Some(limiter.port()),
    );
    assert!(
        config.contains("stats_tags"),
        "the shipped stats tags are gone"
    );
    let (envoy, port) = start_ingress(config, 2);
    let prom = Prometheus::start(
        &dir,
        &[
            ("envoy", envoy.admin_port(), "/stats/prometheus"),
            ("tollgate-limiter", limiter.admin_port(), "/metrics"),
            ("tollgate-regional", regional.admin_port(), "/metrics"),
        ],
        &rules,
    );
    prom.wait_up("envoy");
    prom.wait_up("tollgate-limiter");
    prom.wait_up("tollgate-regional");

    // --- Traffic: allowed and denied, settlement, shadow, identity missing --------------------
    let items = burst(port, 10, 1, |_| tenant("/items/1", "acme")).await;
    let ok = items.iter().filter(|r| r.status == 200).count();
    let denied = items.iter().filter(|r| r.status == 429).count();
    assert_eq!((ok, denied), (5, 5), "burst 5 of 10 requests");
    assert_eq!(send(port, RequestSpec::get("/items/1")).await.status, 403);
    for used in [5, 15, 10, 2, 30] {
        let r = send(port, chat("acme", used)).await;
        assert_eq!(r.status, 200, "reserve 10, use {used}: {}", r.body);
    }
    let missing = chat("acme", 1).usage_in(UsageIn::None);
    assert_eq!(send(port, missing).await.status, 200);
    for _ in 0..2 {
        assert_eq!(send(port, tenant("/shadow/1", "acme")).await.status, 200);
    }
    for path in ["/open/1", "/fallback/1"] {
        assert_eq!(send(port, tenant(path, "acme")).await.status, 200);
    }
    assert_eq!(policy_metric(&envoy, "shadow_denied", "shadow"), 1);
    assert!(policy_metric(&envoy, "units_refunded", "tokens") > 0);
    assert!(policy_metric(&envoy, "units_debt", "tokens") > 0);
    // A lease's unspent tokens go back to the limiter when a request of its key finds it
    // expired (--lease-ttl 1s), together with the settled units.
    let start = Instant::now();
    while !limiter
        .metrics()
        .contains("tollgate_limiter_returns_total{")
    {
        assert!(
            start.elapsed() < SCRAPE_WAIT,
            "no lease returned within {SCRAPE_WAIT:?}:\n{}",
            limiter.metrics()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        send(port, chat("acme", 5)).await;
    }
    assert_eq!(regional_lease(&regional, "regional-1"), 200);
    prom.wait_value(
        "sum(tollgate_limiter_regional_tokens_total{event=\"received\"})",
        1.0,
    );
    prom.wait_value("sum(tollgate_limiter_tokens_returned_total)", 1.0);
    prom.wait_value("sum(tollgate_limiter_units_settled_total)", 1.0);
    prom.wait_value("sum(tollgate_denied{policy=\"items\"})", 5.0);
    prom.wait_value("sum(tollgate_identity_missing)", 1.0);
    let quiet = prom.firing();
    assert!(
        quiet.is_empty(),
        "alerts firing before any fault: {quiet:?}"
    );

    let mut fired = Vec::new();
    // --- Fault: the limiter's policy file changes, the filter's does not ----------------------
    // Written beside it and renamed over it: the limiter never reads half a document.
    let changed = dir.join("policies-changed.json");
    std::fs::write(&changed, policy_document("crowded2")).unwrap();
    std::fs::rename(&changed, limiter.policies_path()).unwrap();
    let mut n = 0;
    let t = fire(&prom, "TollgatePolicyVersionDrift", || {
        n += 1;
        let spec = chat(&format!("drift-{n}"), 10);
        async move {
            send(port, spec).await;
        }
    })
    .await;
    assert!(counter(&envoy, "tollgate_policy_version_mismatch") > 0.0);
    fired.push(("TollgatePolicyVersionDrift", t));

    // --- Fault: the limiter is gone ------------------------------------------------------------
    let limiter_gone = [
        "TollgateFailingOpen",
        "TollgateLimiterCalloutsFailing",
        "TollgateFailingClosed",
        "TollgateLeasesUnavailable",
        "TollgateParentUnreachable",
    ];
    not_firing_yet(&prom, &limiter_gone);
    limiter.kill();
    // `fallback` decides on its local share (half of burst 4) meanwhile: 2 of 6 admitted.
    let fallback = burst(port, 6, 1, |_| tenant("/fallback/1", "acme")).await;
    let admitted = fallback.iter().filter(|r| r.status == 200).count();
    assert_eq!(
        admitted,
        2,
        "{:?}",
        fallback.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    assert_eq!(policy_metric(&envoy, "fallback_denied", "fallback"), 4);
    let mut n = 0;
    let mut next = || {
        n += 1;
        n
    };
    let t = fire(&prom, "TollgateFailingOpen", || {
        let spec = tenant("/open/1", &format!("gone-{}", next()));
        async move {
            assert_eq!(send(port, spec).await.status, 200, "open fails open");
        }
    })
    .await;
    fired.push(("TollgateFailingOpen", t));
    let t = fire(&prom, "TollgateLimiterCalloutsFailing", || {
        let spec = tenant("/open/1", &format!("gone-{}", next()));
        async move {
            send(port, spec).await;
        }
    })
    .await;
    fired.push(("TollgateLimiterCalloutsFailing", t));
    let t = fire(&prom, "TollgateFailingClosed", || {
        let spec = tenant("/items/1", &format!("gone-{}", next()));
        async move {
            assert_eq!(send(port, spec).await.status, 503, "items fails closed");
        }
    })
    .await;
    fired.push(("TollgateFailingClosed", t));
    let t = fire(&prom, "TollgateLeasesUnavailable", || {
        let spec = tenant("/items/1", &format!("gone-{}", next()));
        async move {
            send(port, spec).await;
        }
    })
    .await;
    fired.push(("TollgateLeasesUnavailable", t));
    // The regional limiter's parent is gone too: a new key finds its reservoir dry and the
    // parent unanswering (UNAVAILABLE, the item's failure mode in an Envoy).
    let t = fire(&prom, "TollgateParentUnreachable", || {
        let status = regional_lease(&regional, &format!("regional-gone-{}", next()));
        async move {
            assert_eq!(status, 503, "a dry key without its parent");
        }
    })
    .await;
    fired.push(("TollgateParentUnreachable", t));
    limiter.restart();
    limiter.wait_ready();
    prom.wait_up("tollgate-limiter");
    // The drift is mended: the restarted limiter reloads the filter's document (its reload
    // counter, like all its series, starts again with this process).
    std::fs::write(&changed, policy_document("crowded")).unwrap();
    std::fs::rename(&changed, limiter.policies_path()).unwrap();

    // --- Fault: more live keys than the shared table holds -----------------------------------
    not_firing_yet(&prom, &["TollgateSharedTableFull"]);
    let t = fire(&prom, "TollgateSharedTableFull", || async move {
        burst(port, 160, 4, |i| {
            tenant("/crowded/1", &format!("crowd-{i}"))
        })
        .await;
    })
    .await;
    assert!(counter(&envoy, "tollgate_local_table_full") > 0.0);
    fired.push(("TollgateSharedTableFull", t));

    // --- Fault: Redis is gone ------------------------------------------------------------------
    not_firing_yet(&prom, &["TollgateRedisErrors"]);
    redis.kill();
    let mut n = 0;
    let t = fire(&prom, "TollgateRedisErrors", || {
        n += 1;
        let spec = chat(&format!("no-redis-{n}"), 10);
        async move {
            send(port, spec).await;
        }
    })
    .await;
    fired.push(("TollgateRedisErrors", t));

    // --- Every dashboard query and recording rule, with all of the above scraped --------------
    // Redis is back and traffic goes on, so the queries about normal operation have samples in
    // their window too (the restarted limiter's series start with it; a rate needs two samples
    // with calls between them, and the store's execution time is sampled every 5 s): one
    // tenant's leases (granted, expired and returned with settled units), and a regional
    // lease. Each query must answer with series at least once; one that has none yet is asked
    // again, with more traffic, until QUERY_WAIT.
    redis.restart();
    let queries = dashboard_queries();
    let mut pending: Vec<(String, String)> = queries.clone();
    pending.extend(records.iter().map(|r| (r.clone(), r.clone())));
    let mut failures = Vec::new();
    let mut zero = Vec::new();
    let waiting = Instant::now();
    let mut n = 0;
    loop {
        n += 1;
        send(port, chat("acme", 5)).await;
        regional_lease(&regional, &format!("regional-after-{n}"));
        failures.clear();
        let mut still = Vec::new();
        for (what, expr) in pending {
            match prom.query(&expr) {
                Ok(series) if series.is_empty() => {
                    failures.push(format!("{what}: no series within {QUERY_WAIT:?}: {expr}"));
                    still.push((what, expr));
                }
                Ok(series) => {
                    let all_zero = series
                        .iter()
                        .all(|s| matches!(s["value"][1].as_str(), Some("0") | Some("NaN")));
                    if all_zero && what != expr {
                        zero.push(what.clone());
                    }
                }
                // A query Prometheus refuses will not get better by waiting.
                Err(e) => panic!("{what}: {e}: {expr}"),
            }
        }
        pending = still;
        if pending.is_empty() || waiting.elapsed() >= QUERY_WAIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        failures.is_empty(),
        "{} of {} dashboard queries and {} recording rules failed:\n{}",
        failures.len(),
        queries.len(),
        records.len(),
        failures.join("\n")
    );

    let tested: BTreeSet<String> = fired.iter().map(|(a, _)| a.to_string()).collect();
    assert_eq!(
        tested, alerts,
        "every shipped alert is driven here, and only those"
    );
    println!(
        "{} ({} rules); {} dashboard queries and {} recording rules answered with series \
         (all zero: {zero:?}); alerts fired after {:?}; {:.1} s in all",
        checked.trim().replace('\n', " "),
        records.len() + alerts.len(),
        queries.len(),
        records.len(),
        fired,
        started.elapsed().as_secs_f64()
    );
}
