//! Tollgate's own pieces for end-to-end tests: the limiter binary as a real process, and the
//! shipped Envoy configs (`envoy/*.yaml`) made test-ready (free ports, absolute wasm path, the
//! test's policy document).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::error::{HarnessError, Result};
use crate::http_blocking;
use crate::paths;
use crate::ports::free_port;
use crate::process::{self, ChildProcess};

/// The `tollgate-limiter` binary: `TOLLGATE_LIMITER_BIN`, else the workspace's debug build,
/// built first if it is missing or older than the sources (never a stale binary picked by
/// its timestamp).
pub fn limiter_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("TOLLGATE_LIMITER_BIN") {
        return PathBuf::from(bin);
    }
    paths::cargo_build(&["-p", "tollgate-limiter"]);
    paths::target_dir().join("debug").join("tollgate-limiter")
}

/// Where the limiter keeps its state.
#[derive(Debug, Clone)]
pub enum Store {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
}

/// A running `tollgate-limiter` process on a free loopback port; killed on `Drop`.
#[derive(Debug)]
pub struct Limiter {
    process: ChildProcess,
    port: u16,
    /// With `--tls-cert` among the flags: the plaintext admin listener (health, readiness,
    /// metrics) the harness adds, since the lease port then needs a client certificate.
    admin_port: Option<u16>,
    policies: PathBuf,
    store: Store,
    extra: Vec<String>,
    /// Environment variables set for the process (besides the test's own).
    env: Vec<(String, String)>,
}

impl Limiter {
    /// Starts the limiter with `policy` (written to a file in the log dir) and waits for
    /// `/healthz`. `extra` are more flags (e.g. `--store-timeout 50ms`).
    pub fn start(policy: &str, store: Store, extra: &[&str]) -> Limiter {
        Self::try_start(policy, store, extra).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_start(policy: &str, store: Store, extra: &[&str]) -> Result<Limiter> {
        Self::try_start_with_env(policy, store, extra, &[])
    }

    /// [`Limiter::try_start`] with environment variables `env` set for the process (e.g. a
    /// secret that must not be a flag).
    pub fn try_start_with_env(
        policy: &str,
        store: Store,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Limiter> {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let dir = paths::new_log_dir("", "limiter");
        let policies = dir.join("policies.json");
        std::fs::write(&policies, policy)?;
        let mut last = HarnessError::new("no attempt");
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        for _ in 0..8 {
            let port = free_port();
            match Self::spawn(&dir, &policies, port, &store, &extra, &env) {
                Ok(limiter) => return Ok(limiter),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn spawn(
        dir: &Path,
        policies: &Path,
        port: u16,
        store: &Store,
        extra: &[String],
        env: &[(String, String)],
    ) -> Result<Limiter> {
        let admin_port = extra
            .iter()
            .any(|flag| flag == "--tls-cert")
            .then(free_port);
        let mut cmd = Command::new(limiter_bin());
        if let Some(admin) = admin_port {
            cmd.arg("--admin-listen").arg(format!("127.0.0.1:{admin}"));
        }
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--policies")
            .arg(policies)
            .args(extra)
            .env("TOLLGATE_LOG", "info")
            .envs(env.iter().map(|(k, v)| (k, v)));
        match store {
            Store::Memory => {}
            Store::Redis(url) => {
                cmd.arg("--redis").arg(url);
            }
            Store::Cluster(urls) => {
                cmd.arg("--redis-cluster").arg(urls.join(","));
            }
        }
        let mut process = ChildProcess::spawn("limiter", cmd, dir)?;
        // Ready when *this* process says it listens on the port and /healthz answers: a
        // /healthz alone could come from whatever else took the port (an Envoy listener of
        // another test, which proxies anything to its upstream), and callouts would go there.
        let listening = format!("127.0.0.1:{port}");
        let ready = process::wait_for("limiter /healthz", process::STARTUP_DEADLINE, || {
            if !process.is_running() {
                return Some(false);
            }
            let logs = process.stderr() + &process.stdout();
            if !logs
                .lines()
                .any(|l| l.contains("tollgate limiter listening") && l.contains(&listening))
            {
                return None;
            }
            http_blocking::get(
                admin_port.unwrap_or(port),
                "/healthz",
                Duration::from_millis(500),
            )
            .ok()
            .filter(|r| r.status == 200)
            .map(|_| process.is_running())
        });
        match ready {
            Ok(true) => Ok(Limiter {
                process,
                port,
                admin_port,
                policies: policies.to_path_buf(),
                store: store.clone(),
                extra: extra.to_vec(),
                env: env.to_vec(),
            }),
            _ => Err(HarnessError::new(format!(
                "limiter did not start on port {port}:\n{}",
                process::tail(&process.stderr(), 30)
            ))),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where `/healthz`, `/readyz` and `/metrics` answer in plaintext: the admin listener of a
    /// TLS limiter, else the lease port.
    pub fn admin_port(&self) -> u16 {
        self.admin_port.unwrap_or(self.port)
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn policies_path(&self) -> &Path {
        &self.policies
    }

    pub fn pause(&mut self) {
        self.process.signal(libc::SIGSTOP).unwrap();
    }

    pub fn resume(&mut self) {
        self.process.signal(libc::SIGCONT).unwrap();
    }

    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Starts a stopped (killed) limiter again on the same port, same flags.
    pub fn restart(&mut self) {
        self.process.kill();
        let dir = self.process.log_dir().to_path_buf();
        let mut last = String::new();
        for _ in 0..20 {
            match Self::spawn(
                &dir,
                &self.policies,
                self.port,
                &self.store,
                &self.extra,
                &self.env,
            ) {
                Ok(fresh) => {
                    *self = fresh;
                    return;
                }
                Err(e) => {
                    last = e.to_string();
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        panic!("limiter did not restart on port {}: {last}", self.port);
    }

    pub fn logs(&self) -> String {
        format!("{}{}", self.process.stdout(), self.process.stderr())
    }

    /// Waits until `/readyz` answers 200 (its store answers; a regional limiter has reached
    /// its parent), at most [`process::STARTUP_DEADLINE`]; panics with the last answer and
    /// the log's tail.
    pub fn wait_ready(&self) {
        let mut last = String::new();
        let ready = process::wait_for("limiter /readyz", process::STARTUP_DEADLINE, || {
            match http_blocking::get(self.admin_port(), "/readyz", Duration::from_secs(5)) {
                Ok(r) if r.status == 200 => Some(()),
                Ok(r) => {
                    last = format!("{} {}", r.status, r.body);
                    None
                }
                Err(e) => {
                    last = e.to_string();
                    None
                }
            }
        });
        if let Err(e) = ready {
            panic!(
                "limiter on port {} not ready: {e}; last /readyz: {last}\n{}",
                self.port,
                process::tail(&self.logs(), 30)
            );
        }
    }

    /// `GET /metrics` text.
    pub fn metrics(&self) -> String {
        http_blocking::get(self.admin_port(), "/metrics", Duration::from_secs(5))
            .map(|r| r.body)
            .unwrap_or_default()
    }
}

/// A shipped Envoy config made test-ready: every listener and the admin on port 0, the wasm
/// path absolute, clusters `demo_upstream` and `tollgate_limiter` pointed at the given ports,
/// and `policy` as the plugin configuration (the block after `value: |`).
pub fn envoy_config(
    shipped: &str,
    policy: &str,
    upstream_port: u16,
    limiter_port: Option<u16>,
) -> String {
    let text = std::fs::read_to_string(paths::workspace_root().join(shipped)).unwrap();
    let (listeners, clusters) = text.split_once("\n  clusters:\n").unwrap();
    let listeners = listeners
        .replace("port_value: 10000", "port_value: 0")
        .replace("port_value: 10001", "port_value: 0")
        .replace("port_value: 9901", "port_value: 0")
        .replace(
            "filename: target/wasm32-wasip1/wasm/tollgate.wasm",
            &format!("filename: {}", paths::wasm_path().display()),
        );
    let mut clusters =
        clusters.replace("port_value: 10001", &format!("port_value: {upstream_port}"));
    if let Some(port) = limiter_port {
        clusters = clusters.replace("port_value: 8081", &format!("port_value: {port}"));
    }
    let (head, block, tail) = policy_block(&listeners);
    assert!(!block.is_empty(), "{shipped} has no policy block");
    let indent = " ".repeat(block.len() - block.trim_start().len());
    let indented: String = policy.lines().map(|l| format!("{indent}{l}\n")).collect();
    format!("{head}{indented}{tail}\n  clusters:\n{clusters}")
}

/// One global policy `name` per tenant (`x-tenant-id`) on `GET /items/{id}`, failing
/// `closed` (a callout that fails shows as a 503), with the limiter's callout `timeout`.
pub fn per_tenant_items_policy(
    name: &str,
    units: u64,
    per: &str,
    burst: u64,
    timeout: &str,
) -> String {
    format!(
        r#"{{
  "policies": [{{
    "name": "{name}",
    "match": {{ "routes": ["GET /items/{{id}}"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "rate": {{ "units": {units}, "per": "{per}" }},
    "burst": {burst},
    "scope": "global",
    "on_unavailable": {{ "mode": "closed" }}
  }}],
  "limiter": {{ "cluster": "tollgate_limiter", "timeout": "{timeout}" }}
}}"#
    )
}

/// `GET /items/<i>` for `tenant` (the route of [`per_tenant_items_policy`]).
pub fn item(tenant: &str, i: usize) -> crate::RequestSpec {
    crate::RequestSpec::get(format!("/items/{i}")).header("x-tenant-id", tenant)
}

/// A per-policy filter metric of `envoy`: `tollgate_<what>{policy="<policy>"}` (0 if absent).
pub fn policy_metric(envoy: &crate::Envoy, what: &str, policy: &str) -> u64 {
    prometheus_value(
        &envoy.stats_prometheus(),
        &format!("tollgate_{what}{{policy=\"{policy}\"}}"),
    ) as u64
}

/// Starts Envoy on a rendered config (`envoy_config`) with `workers` workers, logging
/// warnings; returns it with the port of its `ingress` listener.
pub fn start_ingress(config: String, workers: u32) -> (crate::Envoy, u16) {
    let envoy = crate::Envoy::start(
        crate::EnvoyOptions::new(config)
            .concurrency(workers)
            .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

/// Asserts that the shipped Envoy config `config` (a path from the workspace root) embeds the
/// policy document `policy_file` as its plugin configuration (the same JSON value).
pub fn assert_embeds_policy(config: &str, policy_file: &str) {
    let read = |path: &str| std::fs::read_to_string(paths::workspace_root().join(path)).unwrap();
    let (_, block, _) = policy_block(&read(config));
    let embedded: serde_json::Value = serde_json::from_str(&block)
        .unwrap_or_else(|e| panic!("{config}: the policy block is not JSON: {e}"));
    let file: serde_json::Value = serde_json::from_str(&read(policy_file)).unwrap();
    assert_eq!(embedded, file, "{config} and {policy_file} differ");
}

/// Splits a config around the policy JSON block: the lines after `value: |` that are
/// indented deeper than it.
pub fn policy_block(config: &str) -> (String, String, String) {
    let marker = "value: |\n";
    let start = config.find(marker).expect("no `value: |` block") + marker.len();
    let line_start = config[..start - marker.len()]
        .rfind('\n')
        .map_or(0, |i| i + 1);
    let marker_indent = start - marker.len() - line_start;
    let rest = &config[start..];
    let mut end = 0;
    for line in rest.split_inclusive('\n') {
        let indent = line.len() - line.trim_start().len();
        if !line.trim().is_empty() && indent <= marker_indent {
            break;
        }
        end += line.len();
    }
    (
        config[..start].to_string(),
        rest[..end].to_string(),
        rest[end..].to_string(),
    )
}

/// Value of a Prometheus series (`name{labels}` exactly as printed, or a bare name, which also
/// matches `name{}`); 0 when absent. The native build's series carry Envoy's
/// `envoy_dynamicmodulescustom_` prefix (the wasm build's custom stats have none): it is
/// dropped before matching, so one name finds a filter metric of either build.
pub fn prometheus_value(text: &str, series: &str) -> f64 {
    let bare = format!("{series}{{}}");
    text.lines()
        .map(|l| l.strip_prefix("envoy_dynamicmodulescustom_").unwrap_or(l))
        .find(|l| {
            [series, bare.as_str()]
                .iter()
                .any(|m| l.starts_with(m) && l[m.len()..].starts_with(' '))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}
