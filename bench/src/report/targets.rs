//! The targets the run is judged by: `(what, measured, met)` for scenarios 3 to 8, the native
//! build's, and scenario 7's (each judged on every variant's worst round).

use super::compare::SETTLING;
use super::over_limit::OverLimitRun;
use super::{Report, Scenario};

impl Report {
    /// The targets: `(what, measured, met)`.
    pub fn targets(&self) -> Vec<(String, String, Option<bool>)> {
        let mut out = Vec::new();
        let ratio = |r: Option<f64>| r.map_or("n/a".to_string(), |r| format!("{r:.3}"));
        let s4 = self.rps_ratio("4", "3");
        out.push((
            "S4 ≥ 0.90 × S3 (req/s)".to_string(),
            ratio(s4),
            s4.map(|r| r >= 0.90),
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
        // Envoy's ratelimit filter calling the RateLimitService once per request costs the
        // limiter and Redis no more per decision than one lease call per request (S6).
        let s8 = self.backend_cpu_ratio("8", "6");
        let us = |id: &str| {
            self.scenario(id)
                .and_then(|s| s.cpu_us_per_request().1)
                .map_or("–".to_string(), |us| format!("{us:.1}"))
        };
        out.push((
            "S8 limiter + Redis CPU per decision ≤ S6's".to_string(),
            s8.map_or("n/a".into(), |r| {
                format!("{r:.3} (S8 {} µs, S6 {} µs)", us("8"), us("6"))
            }),
            s8.map(|r| r <= 1.0),
        ));
        // Settlement costs at most a tenth of the throughput; a run that settled nothing did
        // not measure it.
        for (id, base) in SETTLING {
            let r = self.rps_ratio(id, base);
            let unsettled = self.settlement(id, base).is_some_and(|c| !c.settled_any());
            out.push((
                format!("S{id} ≥ 0.9 × S{base} (req/s)"),
                if unsettled {
                    format!("{} (no units settled: settlement did not happen)", ratio(r))
                } else {
                    ratio(r)
                },
                r.filter(|_| !unsettled).map(|r| r >= 0.9),
            ));
        }
        // The native build (dynamic module): local limiting at about the cost of no filter,
        // in throughput and in Envoy's CPU per request, and global limiting at about the cost
        // of local.
        let s4n = self.rps_ratio("4n", "1");
        out.push((
            "S4n ≥ 0.90 × S1 (req/s)".to_string(),
            ratio(s4n),
            s4n.map(|r| r >= 0.90),
        ));
        let s4n_cpu = self.cpu_ratio("4n", "1");
        out.push((
            "S4n Envoy CPU per request ≤ 1.15 × S1's".to_string(),
            ratio(s4n_cpu),
            s4n_cpu.map(|r| r <= 1.15),
        ));
        let s5n = self.rps_ratio("5n", "4n");
        out.push((
            "S5n ≥ 0.95 × S4n (req/s)".to_string(),
            ratio(s5n),
            s5n.map(|r| r >= 0.95),
        ));
        if !self.over_limit.is_empty() {
            out.extend(self.over_limit_targets());
        }
        out
    }

    /// Scenario 7's targets, each judged on every variant's worst round.
    fn over_limit_targets(&self) -> Vec<(String, String, Option<bool>)> {
        let variants = self.over_limit_variants();
        // Per variant: the worst round's value (`None` when a round could not be measured).
        let judge = |what: &str,
                     metric: &dyn Fn(&OverLimitRun) -> Option<f64>,
                     worse: fn(f64, f64) -> f64,
                     fmt: &dyn Fn(f64) -> String,
                     ok: &dyn Fn(f64) -> bool| {
            let mut cells = Vec::new();
            let mut met = Some(true);
            for (variant, runs) in &variants {
                let worst = runs
                    .iter()
                    .map(|r| metric(r))
                    .try_fold(None::<f64>, |acc, v| {
                        v.map(|v| Some(acc.map_or(v, |a| worse(a, v))))
                    })
                    .flatten();
                match worst {
                    Some(v) => {
                        cells.push(format!("{variant}: {}", fmt(v)));
                        met = met.map(|m| m && ok(v));
                    }
                    None => {
                        cells.push(format!("{variant}: n/a"));
                        met = None;
                    }
                }
            }
            (what.to_string(), cells.join(" · "), met)
        };
        let worse_abs = |a: f64, b: f64| if b.abs() > a.abs() { b } else { a };
        vec![
            judge(
                "S7 ≤ 3 lease calls per key per instance per second after the first second (worse instance, worst round)",
                &OverLimitRun::worst_lease_calls_per_key_instance_s,
                f64::max,
                &|v| format!("{v:.2}"),
                &|v| v <= 3.0,
            ),
            judge(
                "S7 no overshoot beyond rate × time + burst (worst key, worst round)",
                &|r| Some(r.overshoot_pct()),
                f64::max,
                &|v| format!("{v:.2} %"),
                &|v| v <= 0.0,
            ),
            judge(
                "S7 under-use ≤ 5 % (worst round)",
                &|r| Some(r.underuse_pct()),
                f64::max,
                &|v| format!("{v:.2} %"),
                &|v| v <= 5.0,
            ),
            judge(
                "S7 admitted split A:B within ±10 % of the demand split, after the warm-up (worst round)",
                &OverLimitRun::split_error_pct,
                worse_abs,
                &|v| format!("{v:+.1} %"),
                &|v| v.abs() <= 10.0,
            ),
        ]
    }
}
