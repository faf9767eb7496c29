//! Results: medians over interleaved rounds, ratios measured in the same run, the issue's
//! targets, as a markdown table and the same data as JSON.

use serde_json::{json, Value};

use crate::wrk::Measured;

/// One wrk run of one scenario in one round.
#[derive(Debug, Clone)]
pub struct Run {
    pub round: u32,
    pub measured: Measured,
    /// Redis calls during the run: `(from the limiter, all)`.
    pub redis: Option<(u64, u64)>,
    /// CPU seconds used during the run by Envoy, and by the limiter plus Redis.
    pub envoy_cpu_s: Option<f64>,
    pub backend_cpu_s: Option<f64>,
}

/// Everything measured for one scenario.
#[derive(Debug, Clone, Default)]
pub struct Scenario {
    /// `1`..`6`, `1u`, `5u`.
    pub id: String,
    pub title: String,
    pub runs: Vec<Run>,
    pub envoy_peak_rss: Option<u64>,
    pub limiter_peak_rss: Option<u64>,
    /// Filter counters at the end (e.g. requests decided by the failure mode), for the notes.
    pub counters: Vec<(String, u64)>,
}

/// One over-limit run (scenario 7).
#[derive(Debug, Clone, Default)]
pub struct OverLimitRun {
    pub round: u32,
    pub seconds: f64,
    pub tenants: u32,
    pub rate: u64,
    pub burst: u64,
    /// Requests sent by both load generators.
    pub demanded: u64,
    /// Requests that reached the upstream, per tenant.
    pub admitted: Vec<(String, u64)>,
    /// Requests decided by the failure mode instead of the limiter (both Envoys).
    pub undecided: u64,
    pub socket_errors: u64,
}

impl OverLimitRun {
    /// Most a tenant may be admitted: its bucket starts full (`burst`) and refills at `rate`.
    pub fn allowed_per_tenant(&self) -> f64 {
        self.rate as f64 * self.seconds + self.burst as f64
    }

    pub fn admitted_total(&self) -> u64 {
        self.admitted.iter().map(|(_, n)| n).sum()
    }

    pub fn allowed_total(&self) -> f64 {
        self.allowed_per_tenant() * f64::from(self.tenants)
    }

    /// Demand as a multiple of the policy's rate (all tenants).
    pub fn demand_ratio(&self) -> f64 {
        let rate = self.rate as f64 * self.seconds * f64::from(self.tenants);
        if rate > 0.0 {
            self.demanded as f64 / rate
        } else {
            0.0
        }
    }

    /// Worst tenant's admissions beyond rate × time + burst, in % of that (0 when none).
    pub fn overshoot_pct(&self) -> f64 {
        let allowed = self.allowed_per_tenant();
        // Tenants never seen by the upstream were admitted nothing.
        self.admitted
            .iter()
            .map(|(_, n)| (*n as f64 - allowed).max(0.0) * 100.0 / allowed)
            .fold(0.0, f64::max)
    }

    /// Budget left unused: 1 − admitted / (rate × time + burst), over all tenants, in %.
    pub fn underuse_pct(&self) -> f64 {
        let allowed = self.allowed_total();
        if allowed <= 0.0 {
            return 0.0;
        }
        ((allowed - self.admitted_total() as f64) * 100.0 / allowed).max(0.0)
    }
}

/// How the run was set up (printed above the table).
#[derive(Debug, Clone, Default)]
pub struct Setup {
    pub date: String,
    pub commit: String,
    pub machine: String,
    pub envoy: String,
    pub concurrency: u32,
    pub wrk_threads: u32,
    pub connections: u32,
    pub seconds: f64,
    pub rounds: u32,
    pub tenants: u32,
    pub distribution: String,
}

#[derive(Debug, Clone, Default)]
pub struct Report {
    pub setup: Setup,
    pub scenarios: Vec<Scenario>,
    pub over_limit: Vec<OverLimitRun>,
}

pub fn median(mut values: Vec<f64>) -> Option<f64> {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    let upper = *values.get(mid)?;
    if values.len() % 2 == 1 {
        Some(upper)
    } else {
        Some((values.get(mid - 1)? + upper) / 2.0)
    }
}

impl Scenario {
    pub fn rps(&self) -> Option<f64> {
        median(self.runs.iter().map(|r| r.measured.rps()).collect())
    }

    pub fn p50_ms(&self) -> Option<f64> {
        median(
            self.runs
                .iter()
                .map(|r| r.measured.p50_us as f64 / 1e3)
                .collect(),
        )
    }

    pub fn p99_ms(&self) -> Option<f64> {
        median(
            self.runs
                .iter()
                .map(|r| r.measured.p99_us as f64 / 1e3)
                .collect(),
        )
    }

    pub fn requests(&self) -> u64 {
        self.runs.iter().map(|r| r.measured.requests).sum()
    }

    pub fn non_2xx(&self) -> u64 {
        self.runs.iter().map(|r| r.measured.non_2xx).sum()
    }

    pub fn socket_errors(&self) -> u64 {
        self.runs.iter().map(|r| r.measured.socket_errors).sum()
    }

    /// Redis calls per 1,000 requests over all rounds: `(from the limiter, all)`.
    pub fn redis_per_1k(&self) -> Option<(f64, f64)> {
        let mut limiter = 0;
        let mut all = 0;
        let mut any = false;
        for run in &self.runs {
            if let Some((l, a)) = run.redis {
                limiter += l;
                all += a;
                any = true;
            }
        }
        let requests = self.requests();
        (any && requests > 0).then(|| {
            (
                limiter as f64 * 1000.0 / requests as f64,
                all as f64 * 1000.0 / requests as f64,
            )
        })
    }

    /// CPU time per request over all rounds, µs: `(Envoy, limiter + Redis)`.
    pub fn cpu_us_per_request(&self) -> (Option<f64>, Option<f64>) {
        let requests = self.requests() as f64;
        let total = |f: fn(&Run) -> Option<f64>| -> Option<f64> {
            let values: Option<Vec<f64>> = self.runs.iter().map(f).collect();
            let sum: f64 = values?.iter().sum();
            (requests > 0.0).then(|| sum * 1e6 / requests)
        };
        (total(|r| r.envoy_cpu_s), total(|r| r.backend_cpu_s))
    }

    pub fn counter(&self, name: &str) -> u64 {
        self.counters
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, v)| *v)
    }
}

impl Report {
    pub fn scenario(&self, id: &str) -> Option<&Scenario> {
        self.scenarios.iter().find(|s| s.id == id)
    }

    /// Median over rounds of `metric(a) / metric(b)` measured in the same round.
    fn paired(&self, a: &str, b: &str, metric: impl Fn(&Measured) -> f64) -> Option<f64> {
        let (a, b) = (self.scenario(a)?, self.scenario(b)?);
        let ratios = a
            .runs
            .iter()
            .filter_map(|ra| {
                let rb = b.runs.iter().find(|rb| rb.round == ra.round)?;
                let denominator = metric(&rb.measured);
                (denominator > 0.0).then(|| metric(&ra.measured) / denominator)
            })
            .collect();
        median(ratios)
    }

    /// Throughput of `a` relative to `b` (median of per-round ratios).
    pub fn rps_ratio(&self, a: &str, b: &str) -> Option<f64> {
        self.paired(a, b, Measured::rps)
    }

    /// Envoy CPU per request of `a` relative to `b` (median of per-round ratios).
    pub fn cpu_ratio(&self, a: &str, b: &str) -> Option<f64> {
        let (sa, sb) = (self.scenario(a)?, self.scenario(b)?);
        let per_request = |r: &Run| r.envoy_cpu_s.map(|c| c / r.measured.requests.max(1) as f64);
        let ratios = sa
            .runs
            .iter()
            .filter_map(|ra| {
                let rb = sb.runs.iter().find(|rb| rb.round == ra.round)?;
                let denominator = per_request(rb)?;
                let numerator = per_request(ra)?;
                (denominator > 0.0).then(|| numerator / denominator)
            })
            .collect();
        median(ratios)
    }

    /// p99 latency of `a` relative to `b` (median of per-round ratios).
    pub fn p99_ratio(&self, a: &str, b: &str) -> Option<f64> {
        self.paired(a, b, |m| m.p99_us as f64)
    }

    /// The targets: `(what, measured, met)`.
    pub fn targets(&self) -> Vec<(String, String, Option<bool>)> {
        let mut out = Vec::new();
        let ratio = |r: Option<f64>| r.map_or("n/a".to_string(), |r| format!("{r:.3}"));
        let s4 = self.rps_ratio("4", "3");
        out.push((
            "S4 ≥ 0.95 × S3 (req/s)".to_string(),
            ratio(s4),
            s4.map(|r| r >= 0.95),
        ));
        let s5 = self.rps_ratio("5", "4");
        out.push((
            "S5 ≥ 0.95 × S4 (req/s)".to_string(),
            ratio(s5),
            s5.map(|r| r >= 0.95),
        ));
        let p99 = self.p99_ratio("5", "3");
        out.push((
            "S5 p99 ≤ 1.1 × S3 p99".to_string(),
            ratio(p99),
            p99.map(|r| r <= 1.1),
        ));
        let calls = self.scenario("5").and_then(Scenario::redis_per_1k);
        out.push((
            "S5 ≤ 20 Redis calls per 1,000 requests".to_string(),
            calls.map_or("n/a".into(), |(l, a)| {
                format!("{l:.1} FCALL ({a:.1} commands in all)")
            }),
            calls.map(|(l, _)| l <= 20.0),
        ));
        if !self.over_limit.is_empty() {
            let overshoot = self
                .over_limit
                .iter()
                .map(OverLimitRun::overshoot_pct)
                .fold(0.0, f64::max);
            out.push((
                "S7 no overshoot beyond rate × time + burst (worst tenant, worst round)"
                    .to_string(),
                format!("{overshoot:.2} %"),
                Some(overshoot <= 0.0),
            ));
            let underuse = median(
                self.over_limit
                    .iter()
                    .map(OverLimitRun::underuse_pct)
                    .collect(),
            );
            out.push((
                "S7 under-use ≤ 5 % (median round)".to_string(),
                underuse.map_or("n/a".into(), |u| format!("{u:.2} %")),
                underuse.map(|u| u <= 5.0),
            ));
        }
        out
    }

    pub fn markdown(&self) -> String {
        let s = &self.setup;
        let mut md = String::new();
        md.push_str("# tollgate benchmark (`just bench`)\n\n");
        md.push_str(&format!(
            "{date}, commit `{commit}`, {machine}; {envoy}. Envoy `--concurrency {conc}`; \
             wrk `-t{threads} -c{conns}`, {secs:.0} s per run, {rounds} interleaved rounds \
             (medians; ratios are medians of per-round ratios); {tenants} tenants ({dist}) \
             on `GET /items/{{id}}`.\n\n",
            date = s.date,
            commit = s.commit,
            machine = s.machine,
            envoy = s.envoy,
            conc = s.concurrency,
            threads = s.wrk_threads,
            conns = s.connections,
            secs = s.seconds,
            rounds = s.rounds,
            tenants = s.tenants,
            dist = s.distribution,
        ));
        md.push_str(
            "| # | scenario | req/s | × S1 | × S3 | p50 ms | p99 ms | Envoy CPU µs/req | limiter + Redis CPU µs/req | Redis / 1k req (FCALL · all) | Envoy peak RSS | limiter peak RSS |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for sc in &self.scenarios {
            let num = |v: Option<f64>, digits: usize| {
                v.map_or("–".to_string(), |v| format!("{v:.digits$}"))
            };
            let ratio = |b: &str| {
                if self.scenario(b).is_some() {
                    num(self.rps_ratio(&sc.id, b), 2)
                } else {
                    "–".into()
                }
            };
            let redis = sc
                .redis_per_1k()
                .map_or("–".to_string(), |(l, a)| format!("{l:.1} · {a:.1}"));
            let (cpu, backend) = sc.cpu_us_per_request();
            md.push_str(&format!(
                "| {id} | {title} | {rps} | {r1} | {r3} | {p50} | {p99} | {cpu} | {backend} | {redis} | {envoy} | {limiter} |\n",
                id = sc.id,
                title = sc.title,
                rps = num(sc.rps(), 0),
                r1 = ratio(if sc.id.ends_with('u') { "1u" } else { "1" }),
                r3 = if sc.id.ends_with('u') { "–".into() } else { ratio("3") },
                p50 = num(sc.p50_ms(), 2),
                p99 = num(sc.p99_ms(), 2),
                cpu = num(cpu, 1),
                backend = num(backend, 1),
                envoy = mib(sc.envoy_peak_rss),
                limiter = mib(sc.limiter_peak_rss),
            ));
        }
        let problems: Vec<String> = self
            .scenarios
            .iter()
            .filter(|sc| sc.non_2xx() > 0 || sc.socket_errors() > 0)
            .map(|sc| {
                format!(
                    "S{}: {} responses ≥ 400, {} socket errors",
                    sc.id,
                    sc.non_2xx(),
                    sc.socket_errors()
                )
            })
            .collect();
        md.push('\n');
        if problems.is_empty() {
            md.push_str("Every response was a 200 (no limit denied, no socket error).\n");
        } else {
            md.push_str(&format!(
                "Responses other than 200 (the policies never deny on rate): {}.\n",
                problems.join("; ")
            ));
        }
        md.push('\n');
        for sc in &self.scenarios {
            let undecided = sc.counter("undecided");
            let leases = sc.counter("lease_requests");
            if leases > 0 || undecided > 0 {
                md.push_str(&format!(
                    "- S{}: {} lease requests for {} decided requests (warm-up included); {} refused by the filter (429), {} decided by the failure mode.\n",
                    sc.id,
                    leases,
                    sc.counter("decided"),
                    sc.counter("denied"),
                    undecided
                ));
            }
        }
        if let (Some(cpu4), Some(cpu5)) = (self.cpu_ratio("4", "3"), self.cpu_ratio("5", "3")) {
            md.push_str(&format!(
                "- Envoy CPU per request relative to S3 (less sensitive to the load generator's share of the cores than req/s): S4 {cpu4:.2}, S5 {cpu5:.2}.\n"
            ));
        }
        if !self.over_limit.is_empty() {
            md.push_str(
                "\n## Scenario 7: over the limit\n\n\
                 Two Envoys, one global policy per tenant, paced demand at about 3 × the rate \
                 (split over both). Admitted = requests that reached the upstream; allowed = \
                 rate × time + burst per tenant (each bucket starts full).\n\n\
                 | round | tenants × (rate, burst) | seconds | demand (× rate) | admitted | allowed | overshoot (worst tenant) | under-use | undecided |\n\
                 |---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
            );
            for r in &self.over_limit {
                md.push_str(&format!(
                    "| {} | {} × ({}/s, {}) | {:.2} | {:.2} | {} | {:.0} | {:.2} % | {:.2} % | {} |\n",
                    r.round,
                    r.tenants,
                    r.rate,
                    r.burst,
                    r.seconds,
                    r.demand_ratio(),
                    r.admitted_total(),
                    r.allowed_total(),
                    r.overshoot_pct(),
                    r.underuse_pct(),
                    r.undecided,
                ));
            }
        }
        md.push_str("\n## Targets (issue 5)\n\n| target | measured | |\n|---|---:|---|\n");
        for (what, measured, met) in self.targets() {
            let verdict = match met {
                Some(true) => "met",
                Some(false) => "**missed**",
                None => "not measured",
            };
            md.push_str(&format!("| {what} | {measured} | {verdict} |\n"));
        }
        md
    }

    pub fn json(&self) -> Value {
        let s = &self.setup;
        let scenarios: Vec<Value> = self
            .scenarios
            .iter()
            .map(|sc| {
                json!({
                    "id": sc.id,
                    "title": sc.title,
                    "rps_median": sc.rps(),
                    "ratio_to_s1": self.rps_ratio(&sc.id, if sc.id.ends_with('u') { "1u" } else { "1" }),
                    "ratio_to_s3": if sc.id.ends_with('u') { None } else { self.rps_ratio(&sc.id, "3") },
                    "p50_ms_median": sc.p50_ms(),
                    "p99_ms_median": sc.p99_ms(),
                    "envoy_cpu_us_per_request": sc.cpu_us_per_request().0,
                    "limiter_and_redis_cpu_us_per_request": sc.cpu_us_per_request().1,
                    "envoy_cpu_ratio_to_s3": if sc.id.ends_with('u') { None } else { self.cpu_ratio(&sc.id, "3") },
                    "redis_fcall_per_1k": sc.redis_per_1k().map(|r| r.0),
                    "redis_all_per_1k": sc.redis_per_1k().map(|r| r.1),
                    "envoy_peak_rss_bytes": sc.envoy_peak_rss,
                    "limiter_peak_rss_bytes": sc.limiter_peak_rss,
                    "non_2xx": sc.non_2xx(),
                    "socket_errors": sc.socket_errors(),
                    "counters": sc.counters.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
                    "runs": sc.runs.iter().map(|r| json!({
                        "round": r.round,
                        "requests": r.measured.requests,
                        "seconds": r.measured.seconds,
                        "rps": r.measured.rps(),
                        "p50_us": r.measured.p50_us,
                        "p90_us": r.measured.p90_us,
                        "p99_us": r.measured.p99_us,
                        "mean_us": r.measured.mean_us,
                        "non_2xx": r.measured.non_2xx,
                        "socket_errors": r.measured.socket_errors,
                        "envoy_cpu_s": r.envoy_cpu_s,
                        "limiter_and_redis_cpu_s": r.backend_cpu_s,
                        "redis_fcall": r.redis.map(|x| x.0),
                        "redis_all": r.redis.map(|x| x.1),
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let over_limit: Vec<Value> = self
            .over_limit
            .iter()
            .map(|r| {
                json!({
                    "round": r.round,
                    "tenants": r.tenants,
                    "rate_per_s": r.rate,
                    "burst": r.burst,
                    "seconds": r.seconds,
                    "demanded": r.demanded,
                    "demand_ratio": r.demand_ratio(),
                    "admitted": r.admitted_total(),
                    "allowed": r.allowed_total(),
                    "overshoot_pct_worst_tenant": r.overshoot_pct(),
                    "underuse_pct": r.underuse_pct(),
                    "undecided": r.undecided,
                    "socket_errors": r.socket_errors,
                    "admitted_per_tenant": r.admitted.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
                })
            })
            .collect();
        let targets: Vec<Value> = self
            .targets()
            .into_iter()
            .map(|(what, measured, met)| json!({"target": what, "measured": measured, "met": met}))
            .collect();
        json!({
            "setup": {
                "date": s.date,
                "commit": s.commit,
                "machine": s.machine,
                "envoy": s.envoy,
                "envoy_concurrency": s.concurrency,
                "wrk_threads": s.wrk_threads,
                "connections": s.connections,
                "seconds_per_run": s.seconds,
                "rounds": s.rounds,
                "tenants": s.tenants,
                "distribution": s.distribution,
            },
            "scenarios": scenarios,
            "over_limit": over_limit,
            "targets": targets,
        })
    }
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("–".to_string(), |b| {
        format!("{:.0} MiB", b as f64 / (1024.0 * 1024.0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(round: u32, requests: u64, p99_us: u64) -> Run {
        Run {
            round,
            measured: Measured {
                requests,
                seconds: 1.0,
                p99_us,
                ..Measured::default()
            },
            redis: None,
            envoy_cpu_s: Some(requests as f64 * 1e-5),
            backend_cpu_s: None,
        }
    }

    #[test]
    fn medians_and_paired_ratios() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
        let report = Report {
            scenarios: vec![
                Scenario {
                    id: "3".into(),
                    runs: vec![run(0, 1000, 100), run(1, 2000, 100), run(2, 1000, 100)],
                    ..Scenario::default()
                },
                Scenario {
                    id: "4".into(),
                    runs: vec![run(0, 900, 120), run(1, 1900, 100), run(2, 990, 100)],
                    ..Scenario::default()
                },
            ],
            ..Report::default()
        };
        // Per-round ratios 0.9, 0.95, 0.99: the median is 0.95, where the ratio of medians
        // (990 / 1000) would hide the slow round.
        let r = report.rps_ratio("4", "3").unwrap_or(0.0);
        assert!((r - 0.95).abs() < 1e-9, "{r}");
        assert_eq!(report.p99_ratio("4", "3"), Some(1.0));
        assert_eq!(report.rps_ratio("4", "9"), None);
        let md = report.markdown();
        assert!(md.contains("| 4 |"), "{md}");
        assert!(md.contains("S4 ≥ 0.95 × S3 (req/s) | 0.950 | met"), "{md}");
    }

    #[test]
    fn over_limit_accounting() {
        assert_eq!(OverLimitRun::default().underuse_pct(), 0.0);
        let r = OverLimitRun {
            seconds: 10.0,
            tenants: 2,
            rate: 100,
            burst: 20,
            demanded: 6000,
            admitted: vec![("a".into(), 1030), ("b".into(), 900)],
            ..OverLimitRun::default()
        };
        assert!((r.allowed_per_tenant() - 1020.0).abs() < 1e-9);
        assert!((r.demand_ratio() - 3.0).abs() < 1e-9);
        assert!((r.overshoot_pct() - 10.0 * 100.0 / 1020.0).abs() < 1e-9);
        assert!((r.underuse_pct() - (2040.0 - 1930.0) * 100.0 / 2040.0).abs() < 1e-9);
    }
}
