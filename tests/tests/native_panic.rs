#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! A caught panic in the native build, in a real Envoy: the module built with the test-only
//! feature `panic-injection` (its own target directory) panics in the hook a request's
//! `x-tollgate-panic` header names. The request takes the failure mode of the policies it
//! matches (`closed`: 503 with the unavailable body; `open`: on to the upstream), never
//! "unlimited"; `tollgate_panics` and the policies' fail counters count it; Envoy goes on
//! serving. And what Envoy 1.40 does with a module reporting an ABI version that is not its
//! own: it loads it, warning, rather than refusing it.

use std::process::Command;
use std::time::Duration;

use tollgate_core::response::limiter_unavailable;
use tollgate_e2e::build::{panic_injection_module, with_module_file, Build};
use tollgate_e2e::process::wait_for;
use tollgate_e2e::tollgate::{envoy_config, policy_metric, prometheus_value};
use tollgate_e2e::{send, Envoy, EnvoyOptions, RequestSpec, Upstream};

const POLICY: &str = r#"{
  "policies": [
    {
      "name": "strict",
      "match": { "routes": ["GET /closed/{id}"] },
      "key": [{ "header": "x-tenant-id" }],
      "rate": { "units": 1, "per": "1h" },
      "burst": 3,
      "on_unavailable": { "mode": "closed" }
    },
    {
      "name": "lenient",
      "match": { "routes": ["GET /open/{id}"] },
      "key": [{ "header": "x-tenant-id" }],
      "rate": { "units": 1, "per": "1h" },
      "burst": 3,
      "on_unavailable": { "mode": "open" }
    },
    {
      "name": "uploads",
      "match": { "routes": ["POST /upload/{id}"] },
      "key": [{ "header": "x-tenant-id" }],
      "rate": { "units": 1, "per": "1h" },
      "burst": 3,
      "on_unavailable": { "mode": "local", "share": 0.5, "stale_ttl": "30s", "then": "closed" }
    }
  ]
}"#;

/// Shaped policies (2 per second, burst 1, a request over the rate waits for its turn): the
/// second request of a key is held, and resumed or answered from the scheduled hook.
const SHAPED: &str = r#"{
  "policies": [
    {
      "name": "paced-closed",
      "match": { "routes": ["GET /paced-closed/{id}"] },
      "key": [{ "header": "x-tenant-id" }],
      "rate": { "units": 2, "per": "1s" },
      "burst": 1,
      "shape": { "max_delay": "5s", "max_waiting": 8 },
      "on_unavailable": { "mode": "closed" }
    },
    {
      "name": "paced-open",
      "match": { "routes": ["GET /paced-open/{id}"] },
      "key": [{ "header": "x-tenant-id" }],
      "rate": { "units": 2, "per": "1s" },
      "burst": 1,
      "shape": { "max_delay": "5s", "max_waiting": 8 },
      "on_unavailable": { "mode": "open" }
    }
  ]
}"#;

fn start(upstream: &Upstream) -> Envoy {
    start_with(upstream, POLICY)
}

fn start_with(upstream: &Upstream, policy: &str) -> Envoy {
    let module = panic_injection_module();
    let config = Build::Native.config(envoy_config(
        "envoy/local.yaml",
        policy,
        upstream.port(),
        None,
    ));
    let config = with_module_file(&config, &module);
    Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("warn"))
}

fn item(path: &str) -> RequestSpec {
    RequestSpec::get(path).header("x-tenant-id", "acme")
}

fn panics(envoy: &Envoy) -> u64 {
    prometheus_value(&envoy.stats_prometheus(), "tollgate_panics") as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caught_panic_takes_the_policys_failure_mode() {
    let upstream = Upstream::start();
    let mut envoy = start(&upstream);
    let port = envoy.listener_port("ingress");
    assert_eq!(panics(&envoy), 0);

    // `closed`: refused as when the limiter is unavailable, the same body.
    let refused = send(
        port,
        item("/closed/1").header("x-tollgate-panic", "request_headers"),
    )
    .await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.body, limiter_unavailable("strict").body);
    assert_eq!(
        refused.header("content-type"),
        Some("application/json"),
        "{:?}",
        refused.headers
    );

    // `open`: on to the upstream.
    let passed = send(
        port,
        item("/open/1").header("x-tollgate-panic", "request_headers"),
    )
    .await;
    assert_eq!(passed.status, 200, "{}", passed.body);

    // No policy matches: nothing to limit, on to the upstream.
    let unmatched = send(
        port,
        item("/elsewhere").header("x-tollgate-panic", "request_headers"),
    )
    .await;
    assert_eq!(unmatched.status, 200, "{}", unmatched.body);

    // A panic at the request body (the headers went on): `local` then `closed` refuses, as
    // `closed` does (the fallback budget is the panicked engine's).
    let upload = send(
        port,
        RequestSpec::post("/upload/1", "x".repeat(4096))
            .header("x-tenant-id", "acme")
            .header("x-tollgate-panic", "request_body"),
    )
    .await;
    assert_eq!(upload.status, 503, "{}", upload.body);
    assert_eq!(upload.body, limiter_unavailable("uploads").body);

    wait_for("the panics counted", Duration::from_secs(30), || {
        (panics(&envoy) >= 4).then_some(())
    })
    .unwrap();
    assert_eq!(panics(&envoy), 4);
    assert_eq!(policy_metric(&envoy, "fail_closed", "uploads"), 1);
    assert_eq!(policy_metric(&envoy, "fail_closed", "strict"), 1);
    assert_eq!(policy_metric(&envoy, "fail_open", "lenient"), 1);
    assert_eq!(policy_metric(&envoy, "fail_open", "strict"), 0);
    assert_eq!(policy_metric(&envoy, "fail_closed", "lenient"), 0);
    let logs = envoy.logs();
    assert!(logs.contains("panic injected in request_headers"), "{logs}");
    assert!(logs.contains("panic injected in request_body"), "{logs}");
    assert!(
        logs.contains("the tollgate request_headers hook panicked"),
        "{logs}"
    );

    // Envoy goes on serving, and the policies go on limiting (a panicked request consumed
    // nothing: the burst of 3 is whole).
    let mut statuses = Vec::new();
    for i in 0..5 {
        statuses.push(send(port, item(&format!("/closed/{i}"))).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    assert_eq!(panics(&envoy), 4);
    assert!(envoy.is_running());
}

/// A panic in the scheduled hook, which resumes or answers a held request: the request still
/// held takes its policy's failure mode (it is not left held until Envoy's timeout), once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_while_a_request_is_held_takes_the_policys_failure_mode() {
    let upstream = Upstream::start();
    let mut envoy = start_with(&upstream, SHAPED);
    let port = envoy.listener_port("ingress");
    let paced = |path: &str| item(path).header("x-tollgate-panic", "scheduled");

    // The first request takes the burst and is never held; the second waits for its turn
    // (about 500 ms), and its scheduled hook panics.
    let first = send(port, paced("/paced-closed/1")).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let held = send(port, paced("/paced-closed/2")).await;
    assert_eq!(held.status, 503, "{}", held.body);
    assert_eq!(held.body, limiter_unavailable("paced-closed").body);

    let first = send(port, paced("/paced-open/1")).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let held = send(port, paced("/paced-open/2")).await;
    assert_eq!(held.status, 200, "{}", held.body);

    wait_for("the panics counted", Duration::from_secs(30), || {
        (panics(&envoy) >= 2).then_some(())
    })
    .unwrap();
    assert_eq!(panics(&envoy), 2);
    assert_eq!(policy_metric(&envoy, "fail_closed", "paced-closed"), 1);
    assert_eq!(policy_metric(&envoy, "fail_open", "paced-open"), 1);
    let logs = envoy.logs();
    assert!(logs.contains("panic injected in scheduled"), "{logs}");
    assert!(
        logs.contains("the tollgate scheduled hook panicked"),
        "{logs}"
    );

    // Without a panic, a held request is resumed at its turn: shaping goes on.
    let other = |path: &str| RequestSpec::get(path).header("x-tenant-id", "globex");
    let first = send(port, other("/paced-closed/3")).await;
    let second = send(port, other("/paced-closed/4")).await;
    assert_eq!((first.status, second.status), (200, 200), "{}", second.body);
    assert_eq!(panics(&envoy), 2);
    assert!(envoy.is_running());
}

/// Run by [`envoy_loads_a_module_of_another_abi_version_with_a_warning`] in a child process
/// whose environment names the ABI version the module reports (Envoy inherits it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run in a child process by envoy_loads_a_module_of_another_abi_version_with_a_warning"]
async fn other_abi_version_probe() {
    let reported = std::env::var("TOLLGATE_TEST_ABI_VERSION").unwrap();
    let upstream = Upstream::start();
    let envoy = start(&upstream);
    let logs = envoy.logs();
    assert!(
        logs.contains(&format!(
            "Dynamic module ABI version {reported} is deprecated"
        )),
        "{logs}"
    );
    let port = envoy.listener_port("ingress");
    let mut statuses = Vec::new();
    for i in 0..5 {
        statuses.push(send(port, item(&format!("/closed/{i}"))).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    println!("served under ABI version {reported}");
}

/// Envoy 1.40 (`source/extensions/dynamic_modules/dynamic_modules.cc`) refuses a module only
/// when `envoy_dynamic_module_on_program_init` returns null; any other version string loads,
/// with a warning when it is not Envoy's own (`v0.2.0`). What the module does on such a host
/// is up to the ABI's promise, not a check: a version Envoy does not know is no refusal.
#[test]
fn envoy_loads_a_module_of_another_abi_version_with_a_warning() {
    panic_injection_module();
    for version in ["v0.1.0", "v9.0.0"] {
        let output = Command::new(std::env::current_exe().unwrap())
            .env("TOLLGATE_TEST_ABI_VERSION", version)
            .args([
                "--exact",
                "other_abi_version_probe",
                "--ignored",
                "--nocapture",
            ])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("served under ABI version {version}")),
            "{stdout}\n{stderr}"
        );
    }
}
