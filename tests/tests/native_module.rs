#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The native build as a module: the pinned Envoy loads `libtollgate_native.so` and reports the
//! ABI version matched, the names of the module's callbacks and hooks are ones that Envoy
//! exports and looks up, the module's start check finds every callback it uses, a host without
//! them is refused at start with a line naming them, and what the native build cannot do (jwt
//! claims from nested metadata, as a key part or a condition) is refused at load, never
//! half-done.

use std::ffi::{c_char, c_void, CStr, CString};
use std::process::Command;

use tollgate_e2e::build::{native_dir, Build};
use tollgate_e2e::tollgate::envoy_config;
use tollgate_e2e::{send, Envoy, EnvoyOptions, RequestSpec, Upstream};

/// The ABI version the module is built for (`crates/native/src/abi.rs`), which the pinned Envoy 1.40
/// expects.
const ABI_VERSION: &str = "v0.2.0";

fn policy(key: &str) -> String {
    format!(
        r#"{{
  "policies": [{{
    "name": "per-tenant",
    "match": {{ "routes": ["GET /items/{{id}}"] }},
    "key": [{key}],
    "rate": {{ "units": 1, "per": "1h" }},
    "burst": 3
  }}]
}}"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pinned_envoy_loads_the_module_and_the_abi_version_matches() {
    let upstream = Upstream::start();
    let config = Build::Native.config(envoy_config(
        "envoy/local.yaml",
        &policy(r#"{ "header": "x-tenant-id" }"#),
        upstream.port(),
        None,
    ));
    let envoy = Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("info"));
    let logs = envoy.logs();
    assert!(
        logs.contains(&format!(
            "Dynamic module ABI version {ABI_VERSION} matched."
        )),
        "{logs}"
    );
    assert!(
        !logs.contains("is deprecated"),
        "Envoy warned about the ABI version: {logs}"
    );
    // The start check looked every callback up in this Envoy and found it.
    assert!(logs.contains("native module initialised:"), "{logs}");
    assert!(
        logs.contains(&format!("host callbacks present (ABI {ABI_VERSION})")),
        "{logs}"
    );
    assert!(!logs.contains("refusing to initialise"), "{logs}");
    let port = envoy.listener_port("ingress");
    let item = |i: usize| RequestSpec::get(format!("/items/{i}")).header("x-tenant-id", "acme");
    let mut statuses = Vec::new();
    for i in 0..5 {
        statuses.push(send(port, item(i)).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
}

/// The client address comes from Envoy's `source.address` attribute, as the wasm filter's
/// property does: a key of it limits, and a request without one would be refused
/// (`on_missing_key` is `deny` here), not admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ip_keys_read_the_client_address() {
    let upstream = Upstream::start();
    let policy = policy(r#"{ "client_ip": { "trusted_hops": 0 } }"#)
        .replace(r#""burst": 3"#, r#""burst": 3, "on_missing_key": "deny""#);
    let config = Build::Native.config(envoy_config(
        "envoy/local.yaml",
        &policy,
        upstream.port(),
        None,
    ));
    let envoy = Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("warn"));
    let port = envoy.listener_port("ingress");
    let mut statuses = Vec::new();
    for i in 0..5 {
        // Each request on its own connection (another source port): the key is 127.0.0.1.
        let request = RequestSpec::get(format!("/items/{i}"));
        statuses.push(send(port, request).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
}

#[test]
fn jwt_claim_keys_are_refused_by_the_native_build_naming_the_policy() {
    let upstream = Upstream::start();
    let config = Build::Native.config(envoy_config(
        "envoy/local.yaml",
        &policy(r#"{ "jwt_claim": { "claim": "tenant" } }"#),
        upstream.port(),
        None,
    ));
    let error = Envoy::try_start(EnvoyOptions::new(config).concurrency(1).log_level("warn"))
        .expect_err("the native build took a jwt_claim key");
    let message = error.to_string();
    assert!(
        message.contains("invalid plugin configuration"),
        "{message}"
    );
    assert!(
        message.contains("policy `per-tenant`: key.jwt_claim is not supported by the native build"),
        "{message}"
    );
}

#[test]
fn jwt_claim_conditions_are_refused_by_the_native_build_naming_the_field() {
    let upstream = Upstream::start();
    let policy = policy(r#"{ "header": "x-tenant-id" }"#).replace(
        r#""burst": 3"#,
        r#""burst": 3,
    "when": [{ "header": "x-plan", "equals": "pro" }, { "jwt_claim": { "claim": "plan" }, "equals": "pro" }]"#,
    );
    assert!(policy.contains("jwt_claim"));
    let config = Build::Native.config(envoy_config(
        "envoy/local.yaml",
        &policy,
        upstream.port(),
        None,
    ));
    let error = Envoy::try_start(EnvoyOptions::new(config).concurrency(1).log_level("warn"))
        .expect_err("the native build took a jwt_claim condition");
    let message = error.to_string();
    assert!(
        message.contains("invalid plugin configuration"),
        "{message}"
    );
    assert!(
        message.contains(
            "policy `per-tenant`: policies[0].when[1].jwt_claim is not supported by the native build"
        ),
        "{message}"
    );
}

/// Run by [`a_host_without_the_callbacks_is_refused_at_start`] in a child process: this test
/// binary is a host that exports none of Envoy's callbacks.
#[test]
#[ignore = "run in a child process by a_host_without_the_callbacks_is_refused_at_start"]
fn host_without_callbacks_probe() {
    let path = CString::new(
        native_dir()
            .join("libtollgate_native.so")
            .to_string_lossy()
            .into_owned(),
    )
    .unwrap();
    // SAFETY: `path` is a NUL-terminated file name; loading the module runs no code of ours
    // but its initialisers, which touch nothing of this process.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_LAZY) };
    if handle.is_null() {
        // SAFETY: right after a failed dlopen, dlerror returns a NUL-terminated message.
        let why = unsafe { CStr::from_ptr(libc::dlerror()) };
        panic!("dlopen: {why:?}");
    }
    // SAFETY: `handle` is the live handle dlopen returned; the name is NUL-terminated.
    let init = unsafe { libc::dlsym(handle, c"envoy_dynamic_module_on_program_init".as_ptr()) };
    assert!(!init.is_null());
    // SAFETY: abi.h declares `envoy_dynamic_module_on_program_init` as a C function of no
    // arguments returning a C string, which is what the module exports under that name.
    let init =
        unsafe { std::mem::transmute::<*mut c_void, extern "C" fn() -> *const c_char>(init) };
    let version = init();
    println!("init returned null: {}", version.is_null());
}

#[test]
fn a_host_without_the_callbacks_is_refused_at_start() {
    native_dir();
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "host_without_callbacks_probe",
            "--ignored",
            "--nocapture",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    // Envoy unloads a module whose init returns null, and rejects its configuration.
    assert!(
        stdout.contains("init returned null: true"),
        "{stdout}\n{stderr}"
    );
    assert!(stderr.contains("refusing to initialise"), "{stderr}");
    assert!(
        stderr.contains("envoy_dynamic_module_callback_http_filter_config_http_callout"),
        "the refusal names what is missing: {stderr}"
    );
}

/// A binary's bytes.
fn read_binary(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The names `envoy_dynamic_module_*` a binary holds as NUL-terminated strings: the symbols it
/// exports (its dynamic string table) and the C string literals it looks symbols up by.
fn abi_names(bytes: &[u8]) -> std::collections::BTreeSet<String> {
    const PREFIX: &[u8] = b"envoy_dynamic_module_";
    bytes
        .split(|b| *b == 0)
        .filter_map(|s| {
            let start = s.windows(PREFIX.len()).position(|w| w == PREFIX)?;
            let name = &s[start..];
            name.iter()
                .all(|b| b.is_ascii_alphanumeric() || *b == b'_')
                .then(|| String::from_utf8_lossy(name).into_owned())
        })
        .collect()
}

/// The callbacks the module calls, as `crates/native/src/abi.rs` declares them (they are looked
/// up by name when the module starts, so the built module holds them only as unterminated
/// string constants).
fn declared_callbacks() -> Vec<String> {
    const MARK: &str = "fn envoy_dynamic_module_callback_";
    let path = tollgate_e2e::paths::workspace_root().join("crates/native/src/abi.rs");
    let source = std::fs::read_to_string(&path).unwrap();
    source
        .match_indices(MARK)
        .map(|(at, _)| {
            let name = &source[at + "fn ".len()..];
            let end = name
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(name.len());
            name[..end].to_string()
        })
        .collect()
}

/// Checks the hand-written ABI against the pinned Envoy binary itself: every callback
/// `abi.rs` declares is a function that Envoy exports, and every event hook the built module
/// exports is a name Envoy looks up (a hook renamed in a new ABI would otherwise never be
/// called, and nothing would say so). The argument lists cannot be read from a binary: the
/// end-to-end suites exercise them.
#[test]
fn every_callback_and_hook_name_is_one_the_pinned_envoy_knows() {
    let binary = read_binary(&tollgate_e2e::paths::envoy_bin());
    let envoy = abi_names(&binary);
    let module = abi_names(&read_binary(&native_dir().join("libtollgate_native.so")));
    let hooks: Vec<&String> = module
        .iter()
        .filter(|n| n.starts_with("envoy_dynamic_module_on_"))
        .collect();
    let callbacks = declared_callbacks();
    // The module exports its program init and the HTTP filter's hooks, and calls dozens of
    // callbacks: finding few means the scan is broken, not that the ABI is fine.
    assert!(hooks.len() >= 10, "module hooks found: {hooks:?}");
    assert!(callbacks.len() >= 20, "declared callbacks: {callbacks:?}");
    assert!(envoy.len() >= 100, "names in Envoy: {}", envoy.len());
    assert!(
        !envoy.contains("envoy_dynamic_module_on_http_filter_no_such_hook"),
        "the scan must tell names apart"
    );
    let unknown_hooks: Vec<&&String> = hooks.iter().filter(|n| !envoy.contains(**n)).collect();
    assert!(
        unknown_hooks.is_empty(),
        "hooks the module exports that this Envoy never looks up: {unknown_hooks:?}"
    );
    let missing: Vec<&String> = callbacks.iter().filter(|n| !envoy.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "callbacks abi.rs declares that this Envoy does not export: {missing:?}"
    );
    // The ABI version the module reports is the one this Envoy carries.
    let version = format!("\0{ABI_VERSION}\0");
    assert!(
        binary
            .windows(version.len())
            .any(|w| w == version.as_bytes()),
        "{ABI_VERSION} is not a string of this Envoy"
    );
}
