//! Runs `wrk` (Debian's package) with `bench/wrk/tenants.lua` and reads the JSON line its
//! `done()` prints: requests, duration, socket and status errors, latency percentiles.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tollgate_e2e::paths;
use tollgate_e2e::process::output_with_timeout;

/// How wrk loads one Envoy.
#[derive(Debug, Clone)]
pub struct Load {
    pub threads: u32,
    pub connections: u32,
    pub duration: Duration,
    pub tenants: u32,
    /// `zipf` or `uniform`.
    pub distribution: String,
    pub seed: u64,
    /// Tenant name prefix (fresh prefix: fresh buckets).
    pub prefix: String,
}

/// What one wrk run measured.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Measured {
    pub requests: u64,
    pub seconds: f64,
    /// Responses with status ≥ 400 (wrk's `errors.status`).
    pub non_2xx: u64,
    /// connect + read + write + timeout errors.
    pub socket_errors: u64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub mean_us: f64,
}

impl Measured {
    pub fn rps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.requests as f64 / self.seconds
        } else {
            0.0
        }
    }
}

pub fn script() -> PathBuf {
    paths::workspace_root().join("bench/wrk/tenants.lua")
}

/// Runs wrk against `127.0.0.1:port` and waits for it (bounded by the run's duration plus 30 s).
pub fn run(port: u16, load: &Load) -> Result<Measured, String> {
    let mut cmd = Command::new("wrk");
    cmd.arg("-t")
        .arg(load.threads.to_string())
        .arg("-c")
        .arg(load.connections.to_string())
        .arg("-d")
        // wrk takes whole seconds.
        .arg(format!("{}s", load.duration.as_secs().max(1)))
        .arg("--timeout")
        .arg("5s")
        .arg("-s")
        .arg(script())
        .arg(format!("http://127.0.0.1:{port}/"))
        .arg("--")
        .arg(load.tenants.to_string())
        .arg(&load.distribution)
        .arg(load.seed.to_string())
        .arg(&load.prefix);
    let out = output_with_timeout(cmd, load.duration + Duration::from_secs(30))
        .map_err(|e| format!("wrk: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "wrk exited with {}: {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    parse(&stdout)
}

/// Reads the `TOLLGATE_BENCH {json}` line of the script's `done()`.
pub fn parse(stdout: &str) -> Result<Measured, String> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("TOLLGATE_BENCH "))
        .ok_or_else(|| format!("no TOLLGATE_BENCH line in wrk's output:\n{stdout}"))?;
    let v: Value = serde_json::from_str(line).map_err(|e| format!("{e}: {line}"))?;
    let u = |path: &[&str]| -> u64 {
        path.iter()
            .try_fold(&v, |v, k| v.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    let errors = ["connect", "read", "write", "timeout"]
        .iter()
        .map(|k| u(&["errors", k]))
        .sum();
    Ok(Measured {
        requests: u(&["requests"]),
        seconds: u(&["duration_us"]) as f64 / 1e6,
        non_2xx: u(&["errors", "status"]),
        socket_errors: errors,
        p50_us: u(&["latency_us", "p50"]),
        p90_us: u(&["latency_us", "p90"]),
        p99_us: u(&["latency_us", "p99"]),
        mean_us: v
            .get("latency_us")
            .and_then(|l| l.get("mean"))
            .and_then(Value::as_f64)
            .unwrap_or(0.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_done_line() {
        let out = "Running 1s test\nTOLLGATE_BENCH {\"requests\":1200,\"duration_us\":2000000,\"bytes\":5,\
                   \"errors\":{\"connect\":1,\"read\":2,\"write\":0,\"status\":7,\"timeout\":3},\
                   \"latency_us\":{\"p50\":400,\"p90\":800,\"p99\":1500,\"mean\":450.5,\"max\":9000}}\n";
        let m = parse(out).unwrap_or_default();
        assert_eq!(m.requests, 1200);
        assert_eq!(m.non_2xx, 7);
        assert_eq!(m.socket_errors, 6);
        assert_eq!((m.p50_us, m.p90_us, m.p99_us), (400, 800, 1500));
        assert!((m.rps() - 600.0).abs() < 1e-9);
        assert!(parse("no line").is_err());
    }
}
