//! Helpers shared by the deployment tests (oci, istio, k8s, dashboard, func_e): they check
//! files the project ships for platform tools, by running the project's own tools/ scripts and
//! *independent* checkers (skopeo, umoci, kubernetes-validate, Istio's CRD schemas, Envoy's
//! validation mode, a PromQL parser) that tools/setup installs.
//!
//! Every tool runs with a timeout and a failure prints its command, exit status and output.
//! Scratch files go to a fresh directory under target/e2e-logs (kept for inspection).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use tollgate_e2e::paths;
use tollgate_e2e::process::output_with_timeout;

pub fn root() -> PathBuf {
    paths::workspace_root()
}

/// A fresh scratch directory for this test.
pub fn scratch(label: &str) -> PathBuf {
    paths::new_log_dir("", label)
}

/// A program from `.venv/bin` (tools/setup installs the pinned wheels there), else `PATH`.
pub fn tool(name: &str) -> PathBuf {
    let venv = root().join(".venv").join("bin").join(name);
    if venv.is_file() {
        return venv;
    }
    paths::which(name).unwrap_or_else(|| {
        panic!("{name} not found in .venv/bin or on PATH: run tools/setup (or ./dev test)")
    })
}

/// The Python that has the pinned wheels (PyYAML, promql-parser, kubernetes-validate).
pub fn python() -> PathBuf {
    tool("python3")
}

/// Runs `cmd` (cwd: the workspace root unless set), at most 120 s.
pub fn run(mut cmd: Command) -> Output {
    if cmd.get_current_dir().is_none() {
        cmd.current_dir(root());
    }
    let what = format!("{cmd:?}");
    output_with_timeout(cmd, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"))
}

/// Runs `cmd`, panics unless it exits 0, returns its stdout.
pub fn run_ok(cmd: Command) -> String {
    let what = format!("{cmd:?}");
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a script of tools/ with the venv's Python.
pub fn py_tool(script: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(python());
    cmd.arg(root().join("tools").join(script)).args(args);
    cmd
}

/// Every YAML document of a file, as JSON values (parsed by PyYAML: independent of the
/// renderers, which write YAML by hand).
pub fn yaml_docs(path: &Path) -> Vec<Value> {
    let mut cmd = Command::new(python());
    cmd.args([
        "-c",
        "import json, sys, yaml\n\
         docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]\n\
         json.dump(docs, sys.stdout)",
    ])
    .arg(path);
    let out = run_ok(cmd);
    match serde_json::from_str(&out).expect("yaml → json") {
        Value::Array(docs) => docs,
        other => panic!("expected a list of documents, got {other}"),
    }
}

/// The one YAML document of a file.
pub fn yaml_doc(path: &Path) -> Value {
    let mut docs = yaml_docs(path);
    assert_eq!(docs.len(), 1, "{} must hold one document", path.display());
    docs.remove(0)
}

pub fn json_file(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// Writes `value` as JSON (which is YAML too) to `path`.
pub fn write_json(path: &Path, value: &Value) {
    std::fs::write(path, serde_json::to_string_pretty(value).expect("json")).expect("write");
}

/// Hex SHA-256 of bytes, by coreutils' sha256sum (the tests crate has no hash dependency).
pub fn sha256_hex(bytes: &[u8]) -> String {
    let dir = scratch("sha256");
    let file = dir.join("data");
    std::fs::write(&file, bytes).expect("write");
    let mut cmd = Command::new("sha256sum");
    cmd.arg(&file);
    let out = run_ok(cmd);
    let hex = out
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    assert_eq!(hex.len(), 64, "sha256sum printed {out:?}");
    hex
}

/// The filter's version (crates/wasm/Cargo.toml, `[package]`), the default image tag.
pub fn filter_version() -> String {
    let toml = std::fs::read_to_string(root().join("crates/wasm/Cargo.toml"))
        .expect("crates/wasm/Cargo.toml");
    let package = toml.split("[package]").nth(1).expect("[package] section");
    package
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|rest| rest.split('"').next())
        .expect("package version")
        .to_string()
}

/// Builds the OCI image of `wasm` into `out` with tools/oci-build; returns the manifest
/// digest it printed (`sha256:<hex>`).
pub fn build_oci(wasm: &Path, out: &Path) -> String {
    let mut cmd = py_tool("oci-build", &[]);
    cmd.arg("--wasm").arg(wasm).arg("--out").arg(out);
    run_ok(cmd).trim().to_string()
}

/// A JSON object field, with a message that says which.
pub fn field<'a>(v: &'a Value, path: &str) -> &'a Value {
    let pointer = format!("/{}", path.replace('.', "/"));
    v.pointer(&pointer)
        .unwrap_or_else(|| panic!("missing `{path}` in {v}"))
}

pub fn str_field<'a>(v: &'a Value, path: &str) -> &'a str {
    field(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("`{path}` is not a string in {v}"))
}
