//! The lease listener without TLS: anyone who reaches a plaintext lease port can lease from
//! (and drain) any budget, so plaintext is served on loopback only, unless the operator says
//! `--insecure-plaintext` (a port something else guards, e.g. a mesh sidecar with strict
//! mutual TLS). The binary and the library refuse such a start with an error naming the flag.

// Test code: failing loudly is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use tollgate_e2e::process::{output_with_timeout, wait_for, ChildProcess};
use tollgate_limiter::{serve, ServerConfig};

const BIN: &str = env!("CARGO_BIN_EXE_tollgate-limiter");

const DOC: &str = r#"{"policies": [{"name": "p", "key": [{"header": "x-tenant-id"}],
  "rate": {"units": 10, "per": "1s"}, "burst": 10, "scope": "global"}],
  "limiter": {"cluster": "tollgate_limiter"}}"#;

fn policy_file(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("policies.json");
    std::fs::write(&path, DOC).unwrap();
    path
}

/// Runs the binary to completion (bounded): it must refuse, saying why and which flag.
fn assert_refused(args: &[&str], env: &[(&str, &str)]) {
    let dir = tollgate_e2e::paths::new_log_dir("", "plaintext-refused");
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("TOLLGATE_POLICIES", policy_file(&dir));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = output_with_timeout(cmd, Duration::from_secs(30)).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} started:\n{err}");
    assert!(err.contains("--insecure-plaintext"), "{err}");
    assert!(err.contains("--tls-cert"), "{err}");
    assert!(err.contains("not a loopback address"), "{err}");
}

/// Starts the binary with `args` and waits (bounded) for `/readyz` on the loopback port.
fn assert_serves(name: &str, args: &[&str], env: &[(&str, &str)], port: u16) -> String {
    let dir = tollgate_e2e::paths::new_log_dir("", name);
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .args(["--log-format", "json"])
        .env("TOLLGATE_POLICIES", policy_file(&dir));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = ChildProcess::spawn("limiter", cmd, &dir).unwrap();
    let ready = wait_for("the limiter's /readyz", Duration::from_secs(20), || {
        if !child.is_running() {
            return Some(false);
        }
        tollgate_e2e::http_blocking::get(port, "/readyz", Duration::from_millis(500))
            .ok()
            .filter(|r| r.status == 200)
            .map(|_| true)
    });
    assert_eq!(ready.ok(), Some(true), "{}", child.stderr());
    child.kill();
    child.stderr()
}

#[test]
fn plaintext_on_a_non_loopback_address_is_refused_without_the_flag() {
    assert_refused(&["--listen", "0.0.0.0:0"], &[]);
    assert_refused(&["--listen", "[::]:0"], &[]);
    // An explicit "no" is no consent either.
    assert_refused(
        &["--listen", "0.0.0.0:0"],
        &[("TOLLGATE_INSECURE_PLAINTEXT", "false")],
    );
}

#[test]
fn plaintext_on_a_non_loopback_address_starts_with_the_flag_and_warns() {
    let port = tollgate_e2e::free_port();
    let listen = format!("0.0.0.0:{port}");
    let log = assert_serves(
        "plaintext-flag",
        &["--listen", &listen, "--insecure-plaintext"],
        &[],
        port,
    );
    assert!(log.contains("--insecure-plaintext"), "no warning:\n{log}");
    // The same consent by environment, as the Istio deploy path gives it.
    let port = tollgate_e2e::free_port();
    let listen = format!("0.0.0.0:{port}");
    assert_serves(
        "plaintext-env",
        &["--listen", &listen],
        &[("TOLLGATE_INSECURE_PLAINTEXT", "true")],
        port,
    );
}

#[test]
fn plaintext_on_loopback_needs_no_flag() {
    let port = tollgate_e2e::free_port();
    let listen = format!("127.0.0.1:{port}");
    let log = assert_serves("plaintext-loopback", &["--listen", &listen], &[], port);
    assert!(!log.contains("--insecure-plaintext"), "{log}");
}

/// The library refuses the same start (embedders get the check too), with the flag named.
#[tokio::test]
async fn the_library_refuses_unless_told() {
    let dir = tollgate_e2e::paths::new_log_dir("", "plaintext-lib");
    let mut config = ServerConfig::new(policy_file(&dir));
    config.listen = SocketAddr::from(([0, 0, 0, 0], 0));
    let refused = serve(config.clone()).await;
    match refused {
        Err(e) => assert!(e.to_string().contains("--insecure-plaintext"), "{e}"),
        Ok(running) => panic!("started on {} in plaintext", running.addr()),
    }
    config.insecure_plaintext = true;
    let running = serve(config.clone()).await.unwrap();
    assert!(running.addr().ip().is_unspecified(), "{}", running.addr());
    drop(running);
    config.insecure_plaintext = false;
    config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    let running = serve(config).await.unwrap();
    assert!(running.addr().ip().is_loopback());
}
