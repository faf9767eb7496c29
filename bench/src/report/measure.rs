//! What was measured of a scenario: its wrk runs, their medians over rounds, CPU and Redis
//! calls per request, the filter's counters; and the statistics they are made of.

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
    /// `1`..`6`, `4s`, `5s`, `4f`, `4w`, `4l`, `5h`, `5t`, `1u`, `5u`, `3n`, `4n`, `5n`.
    pub id: String,
    pub title: String,
    pub runs: Vec<Run>,
    pub envoy_peak_rss: Option<u64>,
    pub limiter_peak_rss: Option<u64>,
    /// Filter counters at the end (e.g. requests decided by the failure mode), for the notes.
    pub counters: Vec<(String, u64)>,
}

/// Latency of one kind of answer: how many, median and 99th percentile.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Latency {
    pub count: u64,
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
}

impl Latency {
    pub fn of(mut samples_us: Vec<u64>) -> Latency {
        samples_us.sort_unstable();
        Latency {
            count: samples_us.len() as u64,
            p50_us: percentile(&samples_us, 0.50),
            p99_us: percentile(&samples_us, 0.99),
        }
    }

    /// `p50 · p99` in ms, `–` when there were no such answers.
    pub(super) fn cell(&self) -> String {
        match (self.p50_us, self.p99_us) {
            (Some(p50), Some(p99)) => format!("{:.2} · {:.2}", p50 as f64 / 1e3, p99 as f64 / 1e3),
            _ => "–".into(),
        }
    }
}

/// Nearest-rank percentile (`q` in 0..=1) of ascending `sorted` values.
pub fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted.get(rank.min(sorted.len()) - 1).copied()
}

/// `numerator / denominator`; `None` unless the denominator is above 0.
pub(super) fn ratio(numerator: f64, denominator: f64) -> Option<f64> {
    (denominator > 0.0).then(|| numerator / denominator)
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
