#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The native build as a module: the pinned Envoy loads `libtollgate_native.so` and reports the
//! ABI version matched, the module's start check finds every callback it uses, a host without
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
