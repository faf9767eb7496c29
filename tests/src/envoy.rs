//! A real Envoy process per test: start from a YAML string, find its admin and listener
//! ports, read its stats/memory/logs, kill it on `Drop`.
//!
//! Parallel safety: Envoy's hot-restart machinery binds an abstract domain socket and
//! shared memory keyed by `--base-id` (default 0), so a second Envoy on the machine fails
//! with "unable to bind domain socket with base_id=0". Every Envoy here runs with
//! `--disable-hot-restart` (no socket, no shared memory), admin and listeners on port 0
//! (the kernel picks, no races), and its own `--admin-address-path` and log in a private
//! log directory; the actual ports are read back from the admin API.
//!
//! The log is Envoy's stderr redirected to `<log dir>/envoy.stderr.log`, not `--log-path`:
//! `--log-path` goes through Envoy's buffered file writer (flushed by a background thread,
//! measured ~200 ms behind at startup), so a test reading `logs()` right after an event, or
//! the tail after a crash, would miss lines. stderr is written line by line.

use std::collections::HashMap;
use std::fmt::Display;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::error::{HarnessError, Result};
use crate::http_blocking::{self, BlockingResponse, DEFAULT_TIMEOUT};
use crate::paths;
use crate::process::{self, ChildProcess};

/// How to start an Envoy. `EnvoyOptions::new(yaml)` gives the defaults.
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// The bootstrap YAML. Its `admin` must listen on 127.0.0.1 port 0 (or a free port);
    /// listeners should use port 0 and be looked up with [`Envoy::listener_port`].
    pub yaml: String,
    /// `--concurrency` (worker threads). Default 1.
    pub concurrency: u32,
    /// Label for the log directory; empty means the current test's name.
    pub name: String,
    /// `-l` log level. Default `info`.
    pub log_level: String,
    /// More command-line arguments (e.g. `--component-log-level wasm:debug`).
    pub extra_args: Vec<String>,
    /// How long to wait for admin `/ready` to say LIVE. Default 20 s.
    pub startup_timeout: Duration,
    /// More environment, e.g. [`crate::clock::offset_env`] for a shifted wall clock.
    pub env: Vec<(String, String)>,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        Self {
            yaml: String::new(),
            concurrency: 1,
            name: String::new(),
            log_level: "info".into(),
            extra_args: Vec::new(),
            startup_timeout: process::STARTUP_DEADLINE,
            env: Vec::new(),
        }
    }
}

impl EnvoyOptions {
    pub fn new(yaml: impl Into<String>) -> Self {
        Self {
            yaml: yaml.into(),
            ..Self::default()
        }
    }

    pub fn concurrency(mut self, n: u32) -> Self {
        self.concurrency = n;
        self
    }

    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    pub fn log_level(mut self, level: impl Into<String>) -> Self {
        self.log_level = level.into();
        self
    }

    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Runs Envoy with more environment (e.g. a shifted clock: [`crate::clock::offset_env`]).
    pub fn envs(mut self, env: Vec<(String, String)>) -> Self {
        self.env.extend(env);
        self
    }
}

/// A running Envoy. Killed (SIGKILL) and reaped on `Drop`; logs stay in [`Envoy::log_dir`].
#[derive(Debug)]
pub struct Envoy {
    process: ChildProcess,
    admin_port: u16,
    listeners: HashMap<String, u16>,
    config_path: PathBuf,
}

impl Envoy {
    /// Start Envoy and wait until it is LIVE; panics with the log tail if it is not.
    pub fn start(opts: EnvoyOptions) -> Envoy {
        Self::try_start(opts).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Start Envoy and wait until it is LIVE. The error carries the tail of Envoy's log
    /// (useful for tests that expect a configuration to be rejected).
    pub fn try_start(opts: EnvoyOptions) -> Result<Envoy> {
        if !opts.yaml.contains("admin:") {
            return Err(HarnessError::new(
                "Envoy YAML has no `admin:` section; the harness needs admin on \
                 127.0.0.1 port 0 to find ports and readiness",
            ));
        }
        let dir = paths::new_log_dir(&opts.name, "envoy");
        let config_path = dir.join("envoy.yaml");
        let admin_path = dir.join("admin-address.txt");
        fs::write(&config_path, &opts.yaml)?;

        let mut cmd = Command::new(paths::envoy_bin());
        cmd.current_dir(&dir)
            .arg("--config-path")
            .arg(&config_path)
            .arg("--concurrency")
            .arg(opts.concurrency.to_string())
            .arg("--disable-hot-restart")
            .arg("--admin-address-path")
            .arg(&admin_path)
            // File access logs (if a test configures them) appear quickly.
            .arg("--file-flush-interval-msec")
            .arg("50")
            .arg("-l")
            .arg(&opts.log_level)
            .args(&opts.extra_args)
            .envs(opts.env.iter().map(|(k, v)| (k, v)));
        if opts.yaml.contains("envoy.filters.http.dynamic_modules") {
            // Where Envoy finds `lib<name>.so` of a dynamic module.
            cmd.env(
                "ENVOY_DYNAMIC_MODULES_SEARCH_PATH",
                crate::build::native_dir(),
            );
        }
        let process = ChildProcess::spawn("envoy", cmd, &dir)?;
        let mut envoy = Envoy {
            process,
            admin_port: 0,
            listeners: HashMap::new(),
            config_path,
        };
        match envoy.wait_live(&admin_path, opts.startup_timeout) {
            Ok(()) => Ok(envoy),
            Err(e) => {
                envoy.kill();
                Err(HarnessError::new(format!(
                    "{e}\nEnvoy log dir: {}\n--- last lines of Envoy's log ---\n{}",
                    envoy.log_dir().display(),
                    process::tail(&envoy.logs(), 40)
                )))
            }
        }
    }

    fn wait_live(&mut self, admin_path: &Path, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(5);
        loop {
            if let Some(status) = self.process.exit_status() {
                return Err(HarnessError::new(format!(
                    "Envoy exited during startup ({status})"
                )));
            }
            if self.admin_port == 0 {
                if let Some(port) = fs::read_to_string(admin_path)
                    .ok()
                    .and_then(|s| s.trim().rsplit(':').next()?.parse::<u16>().ok())
                {
                    self.admin_port = port;
                }
            }
            if self.admin_port != 0 {
                let ready = http_blocking::get(self.admin_port, "/ready", DEFAULT_TIMEOUT);
                if matches!(&ready, Ok(r) if r.status == 200 && r.body.trim() == "LIVE") {
                    self.listeners = self.read_listener_ports()?;
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(HarnessError::new(format!(
                    "Envoy not LIVE within {timeout:?} (admin port {})",
                    self.admin_port
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    fn read_listener_ports(&self) -> Result<HashMap<String, u16>> {
        let body = self.try_admin("/listeners?format=json")?;
        let json: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| HarnessError::new(format!("bad /listeners JSON: {e}: {body}")))?;
        let mut ports = HashMap::new();
        for l in json["listener_statuses"].as_array().into_iter().flatten() {
            let name = l["name"].as_str().unwrap_or_default().to_owned();
            let port = l["local_address"]["socket_address"]["port_value"]
                .as_u64()
                .and_then(|p| u16::try_from(p).ok());
            if let Some(port) = port {
                ports.insert(name, port);
            }
        }
        Ok(ports)
    }

    /// `http://127.0.0.1:<admin port>`.
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    pub fn admin_port(&self) -> u16 {
        self.admin_port
    }

    /// The bound port of the listener called `name` in the YAML.
    pub fn listener_port(&self, name: &str) -> u16 {
        match self.listeners.get(name) {
            Some(p) => *p,
            None => {
                let mut known: Vec<&String> = self.listeners.keys().collect();
                known.sort();
                panic!("Envoy has no listener named {name:?}; listeners: {known:?}")
            }
        }
    }

    /// All listeners by name.
    pub fn listener_ports(&self) -> &HashMap<String, u16> {
        &self.listeners
    }

    /// Any admin request; the full response.
    pub fn admin_request(&self, method: &str, path: &str) -> Result<BlockingResponse> {
        http_blocking::request(self.admin_port, method, path, &[], "", DEFAULT_TIMEOUT)
    }

    /// `GET <admin><path>`, body if 200.
    pub fn try_admin(&self, path: &str) -> Result<String> {
        let r = self.admin_request("GET", path)?;
        if r.status == 200 {
            Ok(r.body)
        } else {
            Err(HarnessError::new(format!(
                "admin GET {path}: HTTP {}: {}",
                r.status, r.body
            )))
        }
    }

    /// `GET <admin><path>`, body; panics unless 200.
    pub fn admin(&self, path: &str) -> String {
        self.try_admin(path).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `POST <admin><path>` (e.g. `/reset_counters`, `/logging?wasm=debug`); panics unless 200.
    pub fn admin_post(&self, path: &str) -> String {
        let r = self
            .admin_request("POST", path)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.status, 200, "admin POST {path}: {}", r.body);
        r.body
    }

    /// `/stats/prometheus`.
    pub fn stats_prometheus(&self) -> String {
        self.admin("/stats/prometheus")
    }

    /// `/stats` (text, `name: value` lines).
    pub fn stats_text(&self) -> String {
        self.admin("/stats")
    }

    /// `/stats?format=json`, parsed.
    pub fn stats_json(&self) -> serde_json::Value {
        let body = self.admin("/stats?format=json");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("bad /stats JSON: {e}"))
    }

    /// The value of a counter or gauge by its full name (e.g.
    /// `http.ingress.downstream_rq_total`, `wasmcustom.tollgate_allowed`); `None` if unknown.
    pub fn counter(&self, name: &str) -> Option<u64> {
        let json = self.stats_json();
        json["stats"]
            .as_array()?
            .iter()
            .find(|s| s["name"].as_str() == Some(name))
            .and_then(|s| s["value"].as_u64())
    }

    /// Wait (bounded) until `counter(name) >= at_least`; returns the value seen.
    pub fn wait_counter(&self, name: &str, at_least: u64, timeout: Duration) -> u64 {
        let mut last = None;
        process::wait_for(&format!("Envoy stat {name} >= {at_least}"), timeout, || {
            last = self.counter(name);
            last.filter(|v| *v >= at_least)
        })
        .unwrap_or_else(|e| panic!("{e} (last value: {last:?})"))
    }

    /// Bytes allocated by Envoy's heap (admin `/memory` `allocated`).
    pub fn memory_allocated(&self) -> u64 {
        let body = self.admin("/memory");
        let json: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("bad /memory JSON: {e}"));
        let v = &json["allocated"];
        v.as_u64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .unwrap_or_else(|| panic!("/memory has no numeric `allocated`: {body}"))
    }

    /// Resident set size from `/proc/<pid>/status` (`VmRSS`), in bytes.
    pub fn rss_bytes(&self) -> u64 {
        self.process
            .rss_bytes()
            .unwrap_or_else(|| panic!("cannot read VmRSS of Envoy pid {}", self.pid()))
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Envoy's log so far (its stderr), followed by its stdout if it wrote any.
    pub fn logs(&self) -> String {
        let mut text = self.process.stderr();
        let stdout = self.process.stdout();
        if !stdout.trim().is_empty() {
            text.push_str(&format!("\n--- stdout ---\n{stdout}"));
        }
        text
    }

    /// Path of the log file (`<log dir>/envoy.stderr.log`).
    pub fn log_path(&self) -> &Path {
        self.process.stderr_path()
    }

    pub fn log_dir(&self) -> &Path {
        self.process.log_dir()
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    pub fn is_running(&mut self) -> bool {
        self.process.is_running()
    }

    /// SIGKILL and reap. Idempotent; also done on `Drop`.
    pub fn kill(&mut self) {
        self.process.kill();
    }
}

/// Replace every `{{NAME}}` in `template` with its value; panics if a `{{...}}` placeholder
/// is left without a value (unused values are fine, so one set can serve many templates).
///
/// ```
/// use tollgate_e2e::render_template;
/// let yaml = render_template("port_value: {{PORT}}", &[("PORT", &8080)]);
/// assert_eq!(yaml, "port_value: 8080");
/// ```
pub fn render_template(template: &str, vars: &[(&str, &dyn Display)]) -> String {
    let mut out = template.to_owned();
    for (name, value) in vars {
        out = out.replace(&format!("{{{{{name}}}}}"), &value.to_string());
    }
    let leftover: Vec<&str> = out
        .match_indices("{{")
        .filter_map(|(i, _)| {
            let rest = out.get(i + 2..)?;
            let end = rest.find("}}")?;
            let name = rest.get(..end)?;
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
                .then_some(name)
        })
        .collect();
    assert!(
        leftover.is_empty(),
        "template placeholders without a value: {leftover:?}"
    );
    out
}

/// Read a template relative to the workspace root (e.g. `envoy/local.yaml`) and render it.
pub fn render_file(relative: &str, vars: &[(&str, &dyn Display)]) -> String {
    let path = paths::workspace_root().join(relative);
    let text = fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read template {}: {e}", path.display()));
    render_template(&text, vars)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_replaces_all_occurrences() {
        let s = render_template(
            "{{A}}-{{B}}-{{A}}",
            &[("A", &1), ("B", &"x"), ("UNUSED", &2)],
        );
        assert_eq!(s, "1-x-1");
    }

    #[test]
    #[should_panic(expected = "MISSING")]
    fn render_rejects_leftovers() {
        render_template("{{MISSING}}", &[]);
    }
}
