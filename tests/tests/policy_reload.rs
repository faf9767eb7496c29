#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Policy changes under load, with no restart: a real Envoy (two workers) with the built
//! filter takes sustained traffic at several times the limit while
//!
//! * the limiter's policy file is replaced (it polls and reloads): a global policy's rate goes
//!   from 20/s to 60/s and back, and
//! * the filter's configuration is replaced through a file-based dynamic listener (LDS from a
//!   path: the new listener with the new plugin configuration is renamed into place): a local
//!   policy's rate goes from 20/s to 60/s and back.
//!
//! Every request is answered 200 or 429 (no 5xx, no reset), the filter's allowed + denied
//! counters equal the requests sent (no lost or doubled decision), the admission rate reaches
//! the new rate within a lease TTL plus the poll interval of the change, and the total
//! admitted stays within `burst + ∫ rate` of the rates in force.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use tollgate_e2e::tollgate::{envoy_config, policy_metric, Limiter, Store};
use tollgate_e2e::{
    free_port, process, try_send, Envoy, EnvoyOptions, RedisServer, RequestSpec, Upstream,
};

const LOW: u64 = 20;
const HIGH: u64 = 60;
const BURST: u64 = 10;
/// Concurrent clients, each sending one request at a time on a fresh connection, paced at
/// [`CLIENT_RATE`] (skipping the slots it is late for): 160 requests/s in all, 8× the low
/// rate and 2.7× the high one, so the limit binds throughout without flooding a loaded
/// machine (or its ephemeral ports) with connections.
const CLIENTS: usize = 4;
const CLIENT_RATE: u64 = 40;
/// How long each rate is kept.
const PHASE: Duration = Duration::from_secs(5);
/// The limiter's `--policy-poll` in these tests.
const POLL: Duration = Duration::from_millis(200);
/// The limiter's lease TTL (its default): tokens leased under the old document may be spent
/// that long.
const LEASE_TTL: Duration = Duration::from_secs(2);

fn policy(name: &str, scope: &str, units: u64) -> String {
    format!(
        r#"{{
  "policies": [{{
    "name": "{name}",
    "match": {{ "routes": ["GET /items/{{id}}"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "rate": {{ "units": {units}, "per": "1s" }},
    "burst": {BURST},
    "scope": "{scope}",
    "on_unavailable": {{ "mode": "closed" }}
  }}],
  "limiter": {{ "cluster": "tollgate_limiter", "timeout": "200ms" }}
}}"#
    )
}

/// Writes `text` to `path` atomically: a temporary file in the same directory, renamed.
fn replace_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// What the clients saw: when each request was answered and with what.
#[derive(Debug, Default)]
struct Seen {
    answers: Vec<(Instant, u16)>,
    errors: Vec<String>,
}

/// [`CLIENTS`] clients sending `GET /items/<i>` for one tenant to `port` until `stop`.
fn load(port: u16, stop: Arc<std::sync::atomic::AtomicBool>) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    for c in 0..CLIENTS {
        let seen = Arc::clone(&seen);
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let period = Duration::from_micros(1_000_000 / CLIENT_RATE);
            let mut next = Instant::now();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tokio::time::sleep_until(next.into()).await;
                next += period;
                let now = Instant::now();
                while next < now {
                    next += period;
                }
                let spec =
                    RequestSpec::get(format!("/items/{c}-{i}")).header("x-tenant-id", "acme");
                let r = try_send(port, spec).await;
                let mut s = seen.lock().await;
                match r {
                    Ok(r) => s.answers.push((Instant::now(), r.status)),
                    Err(e) => s.errors.push(e.to_string()),
                }
                i += 1;
            }
        });
    }
    seen
}

/// Admitted per second in `[from, to)`.
fn admitted_rate(seen: &Seen, from: Instant, to: Instant) -> f64 {
    let n = seen
        .answers
        .iter()
        .filter(|(at, s)| *s == 200 && *at >= from && *at < to)
        .count();
    n as f64 / (to - from).as_secs_f64()
}

/// The run: `LOW` for a phase, `change(HIGH)`, a phase, `change(LOW)`, a phase. `change`
/// returns once the component has taken the change; `settle` is how long the new rate may then
/// take to show. Checks the answers and prints the figures.
async fn run_with_changes(
    envoy: &Envoy,
    port: u16,
    policy_name: &str,
    settle: Duration,
    mut change: impl FnMut(u64),
) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Instant::now();
    let seen = load(port, Arc::clone(&stop));
    tokio::time::sleep(PHASE).await;
    // `raised`/`lowered`: when the change was written; `*_applied`: when the component said
    // it took it (a loaded machine may take a while to build a new listener).
    let raised = Instant::now();
    tokio::task::block_in_place(|| change(HIGH));
    let raise_applied = Instant::now();
    tokio::time::sleep(PHASE).await;
    let lowered = Instant::now();
    tokio::task::block_in_place(|| change(LOW));
    let lower_applied = Instant::now();
    tokio::time::sleep(PHASE).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // Let the clients' last requests finish (each is bounded by the client's timeout).
    let ended = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = seen.lock().await;

    let sent = seen.answers.len() as u64 + seen.errors.len() as u64;
    let admitted = seen.answers.iter().filter(|(_, s)| *s == 200).count() as u64;
    let denied = seen.answers.iter().filter(|(_, s)| *s == 429).count() as u64;
    let other: Vec<u16> = seen
        .answers
        .iter()
        .map(|(_, s)| *s)
        .filter(|s| *s != 200 && *s != 429)
        .collect();
    let allowed_metric = policy_metric(envoy, "allowed", policy_name);
    let denied_metric = policy_metric(envoy, "denied", policy_name);

    let before = admitted_rate(&seen, started + Duration::from_secs(1), raised);
    let high = admitted_rate(&seen, raise_applied + settle, lowered);
    let low = admitted_rate(&seen, lower_applied + settle, ended);
    // When the new rate first showed: the first full second after the raise at ≥ 80 % of it.
    let steps = |from: Instant, to: Instant| 0..((to - from).as_millis() / 100) as u64;
    let took = steps(raised, lowered)
        .map(|tenth| raised + Duration::from_millis(100 * tenth))
        .find(|from| {
            admitted_rate(&seen, *from, *from + Duration::from_secs(1)) >= 0.8 * HIGH as f64
        })
        .map(|from| from - raised);
    let took_down = steps(lowered, ended - Duration::from_secs(1))
        .map(|tenth| lowered + Duration::from_millis(100 * tenth))
        .find(|from| {
            admitted_rate(&seen, *from, *from + Duration::from_secs(1)) <= 1.2 * LOW as f64
        })
        .map(|from| from - lowered);
    // Upper bound: the high rate from the raise until the lowering is in force.
    let t = |a: Instant, b: Instant| (b - a).as_secs_f64();
    let upper = BURST as f64
        + LOW as f64 * t(started, raised)
        + HIGH as f64 * t(raised, lower_applied + settle)
        + LOW as f64 * t(lower_applied + settle, ended)
        // Requests in flight when the clients stopped.
        + CLIENTS as f64;
    println!(
        "{policy_name}: {sent} requests, {admitted} admitted ({allowed_metric} allowed, \
         {denied_metric} denied in the filter), {} errors, other statuses {other:?}; admitted/s \
         {before:.1} at {LOW}/s, {high:.1} after raising to {HIGH}/s (at 80 % after {took:?}), \
         {low:.1} after lowering to {LOW}/s (at most 120 % after {took_down:?}); taken by the \
         component {:?} and {:?} after the writes; total {admitted} ≤ {upper:.0}",
        seen.errors.len(),
        raise_applied - raised,
        lower_applied - lowered
    );
    assert!(
        seen.errors.is_empty(),
        "transport errors: {:?}",
        seen.errors
    );
    assert!(other.is_empty(), "statuses other than 200/429: {other:?}");
    assert_eq!(
        allowed_metric + denied_metric,
        sent,
        "every request decided exactly once"
    );
    assert_eq!((allowed_metric, denied_metric), (admitted, denied));
    assert!(
        before <= LOW as f64 * 1.2 + BURST as f64 / 4.0 && before >= LOW as f64 * 0.8,
        "before the change: {before:.1}/s at {LOW}/s"
    );
    assert!(
        high >= HIGH as f64 * 0.8 && high <= HIGH as f64 * 1.2,
        "after raising: {high:.1}/s at {HIGH}/s"
    );
    assert!(
        low <= LOW as f64 * 1.2 && low >= LOW as f64 * 0.8,
        "after lowering: {low:.1}/s at {LOW}/s"
    );
    let allowed_up = (raise_applied - raised) + settle;
    let allowed_down = (lower_applied - lowered) + settle;
    assert!(
        took.is_some_and(|d| d <= allowed_up),
        "the raise took {took:?} (allowed {allowed_up:?})"
    );
    assert!(
        took_down.is_some_and(|d| d <= allowed_down),
        "the lowering took {took_down:?} (allowed {allowed_down:?})"
    );
    assert!(admitted as f64 <= upper, "{admitted} admitted > {upper:.0}");
}

/// (a) The limiter's policy file changes under load: a global policy's new rate is in force
/// within the poll interval plus a lease TTL (tokens leased under the old rate are spent
/// first) plus an assignment period (the share of the old rate runs out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_rate_change_in_the_limiter_takes_effect_without_errors() {
    const NAME: &str = "reload-global";
    let redis = RedisServer::start();
    let limiter = Limiter::start(
        &policy(NAME, "global", LOW),
        Store::Redis(redis.url()),
        &["--policy-poll", "200ms"],
    );
    limiter.wait_ready();
    let upstream = Upstream::start();
    let config = envoy_config(
        "envoy/global.yaml",
        &policy(NAME, "global", LOW),
        upstream.port(),
        Some(limiter.port()),
    );
    let envoy = Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("warn"));
    let port = envoy.listener_port("ingress");
    let path = limiter.policies_path().to_path_buf();
    let settle = POLL + LEASE_TTL + Duration::from_secs(1);
    let mut reloads = 0;
    run_with_changes(&envoy, port, NAME, settle, |units| {
        replace_file(&path, &policy(NAME, "global", units));
        // The reload is logged; wait for it so the figures start from the change in force.
        reloads += 1;
        process::wait_for("the limiter's reload", Duration::from_secs(5), || {
            (limiter.logs().matches("policy document reloaded").count() >= reloads).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}: {}", limiter.logs()));
    })
    .await;
}

/// The rendered `ingress` listener of `config` as an LDS resource file on `port`.
fn lds_file(config: &str, port: u16) -> String {
    let (_, rest) = config.split_once("  - name: ingress\n").unwrap();
    let (listener, _) = rest.split_once("  - name: demo_upstream\n").unwrap();
    let body: String = listener
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    let body = body.replacen("port_value: 0", &format!("port_value: {port}"), 1);
    format!(
        "resources:\n- \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n  \
         name: ingress\n{body}"
    )
}

/// `config` with its listeners replaced by LDS from `lds_path`.
fn bootstrap_with_lds(config: &str, lds_path: &Path) -> String {
    let (head, rest) = config.split_once("static_resources:\n").unwrap();
    let (_, clusters) = rest.split_once("\n  clusters:\n").unwrap();
    format!(
        "{head}node:\n  id: policy-reload\n  cluster: tollgate\ndynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    \
         path_config_source:\n      path: {}\nstatic_resources:\n  clusters:\n{clusters}",
        lds_path.display()
    )
}

/// (b) The filter's configuration changes under load, delivered to Envoy by a file-based LDS
/// (the listener with the new plugin configuration renamed into place): the wasm plugin is
/// reconfigured in place and a local policy's new rate is in force within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_configuration_change_over_lds_takes_effect_without_errors() {
    const NAME: &str = "reload-local";
    let upstream = Upstream::start();
    let render = |units| {
        envoy_config(
            "envoy/global.yaml",
            &policy(NAME, "local", units),
            upstream.port(),
            None,
        )
    };
    let dir = tollgate_e2e::paths::new_log_dir("", "lds");
    let lds = dir.join("lds.yaml");
    let port = free_port();
    std::fs::write(&lds, lds_file(&render(LOW), port)).unwrap();
    let envoy = Envoy::start(
        EnvoyOptions::new(bootstrap_with_lds(&render(LOW), &lds))
            .concurrency(2)
            .log_level("warn"),
    );
    assert_eq!(envoy.listener_port("ingress"), port);
    let updates = |e: &Envoy| {
        e.counter("listener_manager.lds.update_success")
            .unwrap_or(0)
    };
    let mut seen_updates = updates(&envoy);
    let settle = Duration::from_secs(1);
    run_with_changes(&envoy, port, NAME, settle, |units| {
        replace_file(&lds, &lds_file(&render(units), port));
        seen_updates = envoy.wait_counter(
            "listener_manager.lds.update_success",
            seen_updates + 1,
            Duration::from_secs(10),
        );
    })
    .await;
    assert_eq!(
        envoy
            .counter("listener_manager.lds.update_rejected")
            .unwrap_or(0),
        0,
        "every new listener was accepted"
    );
    assert_eq!(
        envoy
            .counter("listener_manager.listener_create_failure")
            .unwrap_or(0),
        0
    );
}
