//! Counters read around a run: a process's CPU time and peak RSS (Redis calls come from
//! `tollgate_e2e::redis::commandstats_calls`).

/// CPU time a process has used so far (user + system), in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start at field 3 (state).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / clock_ticks())
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 on Linux almost everywhere).
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .filter(|t: &f64| *t > 0.0)
            .unwrap_or(100.0)
    })
}

/// Peak resident set size (`VmHWM` in `/proc/<pid>/status`), bytes.
pub fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_our_own_cpu_time() {
        let start = cpu_seconds(std::process::id()).unwrap_or(-1.0);
        let mut x = 0u64;
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(50) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let end = cpu_seconds(std::process::id()).unwrap_or(-1.0);
        assert!(start >= 0.0 && end >= start, "{start} {end}");
    }

    #[test]
    fn reads_our_own_peak_rss() {
        let rss = peak_rss(std::process::id()).unwrap_or(0);
        assert!(rss > 1024 * 1024, "{rss}");
    }
}
