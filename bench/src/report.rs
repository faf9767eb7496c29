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
    /// `1`..`6`, `4s`, `5s`, `4f`, `4w`, `4l`, `5h`, `5t`, `1u`, `5u`, `3n`, `4n`, `5n`.
    pub id: String,
    pub title: String,
    pub runs: Vec<Run>,
    pub envoy_peak_rss: Option<u64>,
    pub limiter_peak_rss: Option<u64>,
    /// Filter counters at the end (e.g. requests decided by the failure mode), for the notes.
    pub counters: Vec<(String, u64)>,
}

/// One instance's part of an over-limit run, as its load generator and its filter saw it.
#[derive(Debug, Clone, Default)]
pub struct InstanceRun {
    pub offered: u64,
    /// Answered 200 / 429 / anything else (other statuses, transport errors).
    pub admitted: u64,
    pub denied: u64,
    pub other: u64,
    /// Offered and admitted after the warm-up (the split between instances is judged on these).
    pub offered_steady: u64,
    pub admitted_steady: u64,
    /// The filter's lease calls during the run, and from one second into it.
    pub lease_calls: u64,
    pub lease_calls_after_1s: u64,
    /// Limiter answers carrying a share of the rate (assignments) during the run.
    pub assignments: u64,
    /// Offered, answered 200 and answered 429 per second of the run, by the second each
    /// request was sent in (the load generator's count).
    pub per_second: Vec<crate::paced::Second>,
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
    fn cell(&self) -> String {
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

/// One variant of the over-limit run (scenario 7) in one round: two Envoys, one global
/// policy, `tenants` fresh keys, paced demand `multiple` × the rate per key split `split`
/// (A:B) between the instances.
#[derive(Debug, Clone, Default)]
pub struct OverLimitRun {
    pub round: u32,
    /// E.g. `10× 3:1`.
    pub variant: String,
    /// Nominal demand per key, as a multiple of the rate, and its split between A and B.
    pub multiple: f64,
    pub split: (u32, u32),
    pub seconds: f64,
    /// Warm-up excluded from the split, seconds.
    pub warmup_s: f64,
    pub tenants: u32,
    pub rate: u64,
    pub burst: u64,
    /// Requests sent to both instances.
    pub demanded: u64,
    /// Requests that reached the upstream, per tenant.
    pub admitted: Vec<(String, u64)>,
    /// Requests decided by the failure mode instead of the limiter (both Envoys).
    pub undecided: u64,
    /// Instances A and B.
    pub instances: [InstanceRun; 2],
    /// Lease requests the filters sent again after no answer (both Envoys).
    pub retries: u64,
    /// Redis calls during the run: `(FCALL transitions, all commands)`.
    pub redis: Option<(u64, u64)>,
    /// Latency of the 200 and of the 429 answers, both instances.
    pub admitted_latency: Latency,
    pub denied_latency: Latency,
}

fn ratio(numerator: f64, denominator: f64) -> Option<f64> {
    (denominator > 0.0).then(|| numerator / denominator)
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
        ratio(self.demanded as f64, rate).unwrap_or(0.0)
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

    /// Lease calls of both instances.
    pub fn lease_calls(&self) -> u64 {
        self.instances.iter().map(|i| i.lease_calls).sum()
    }

    pub fn lease_calls_per_s(&self) -> Option<f64> {
        ratio(self.lease_calls() as f64, self.seconds)
    }

    pub fn lease_calls_per_offered(&self) -> Option<f64> {
        ratio(self.lease_calls() as f64, self.demanded as f64)
    }

    /// Lease calls per key per second after the first second, instance A and B (the first
    /// second holds the start-up: leases, then the first assignment).
    pub fn lease_calls_per_key_instance_s(&self) -> [Option<f64>; 2] {
        let key_seconds = f64::from(self.tenants) * (self.seconds - 1.0);
        self.instances
            .clone()
            .map(|i| ratio(i.lease_calls_after_1s as f64, key_seconds))
    }

    /// The larger of A's and B's [`Self::lease_calls_per_key_instance_s`].
    pub fn worst_lease_calls_per_key_instance_s(&self) -> Option<f64> {
        let [a, b] = self.lease_calls_per_key_instance_s();
        match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn fcalls_per_s(&self) -> Option<f64> {
        ratio(self.redis?.0 as f64, self.seconds)
    }

    pub fn fcalls_per_offered(&self) -> Option<f64> {
        ratio(self.redis?.0 as f64, self.demanded as f64)
    }

    /// Admitted by A over admitted by B, after the warm-up.
    pub fn admitted_split(&self) -> Option<f64> {
        let [a, b] = &self.instances;
        ratio(a.admitted_steady as f64, b.admitted_steady as f64)
    }

    /// Offered to A over offered to B, after the warm-up (the demand split, as measured).
    pub fn demand_split(&self) -> Option<f64> {
        let [a, b] = &self.instances;
        ratio(a.offered_steady as f64, b.offered_steady as f64)
    }

    /// How far the admitted split is from the demand split, in % of the demand split.
    pub fn split_error_pct(&self) -> Option<f64> {
        Some((self.admitted_split()? / self.demand_split()? - 1.0) * 100.0)
    }

    /// Answers that were neither 200 nor 429 (both instances).
    pub fn other(&self) -> u64 {
        self.instances.iter().map(|i| i.other).sum()
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

/// Scenario 5t (the limiter behind mutual TLS) next to 5 (h2c) and 4, each ratio the median
/// of per-round ratios of runs made in the same rounds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MtlsComparison {
    /// Rounds in which both 5 and 5t ran.
    pub rounds: usize,
    pub rps: Option<f64>,
    /// 5t's req/s over 5's in each of those rounds (how far the noise goes).
    pub rps_per_round: Vec<f64>,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    /// CPU per request: Envoy's, and the limiter's plus Redis'.
    pub envoy_cpu: Option<f64>,
    pub backend_cpu: Option<f64>,
    /// req/s over S4's, for 5t and for 5 (`S5 ≥ 0.95 × S4` is a target).
    pub s5t_to_s4: Option<f64>,
    pub s5_to_s4: Option<f64>,
    /// Envoy's TLS handshakes with the limiter and connections to it, whole run (warm-up
    /// included).
    pub handshakes: u64,
    pub connections: u64,
}

/// Scenario 8 (Envoy's own ratelimit filter calling the limiter's RateLimitService, one gRPC
/// call per request) next to 5 (tollgate's filter with leases) and 6 (batching off: one lease
/// call per request), each ratio the median of per-round ratios of runs made in the same
/// rounds; and what Envoy's filter was answered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RlsComparison {
    /// Rounds in which 8 and 5 ran (for the S5 / S8 ratios), and 8 and 6.
    pub rounds_with_s5: usize,
    pub rounds_with_s6: usize,
    /// S5's req/s over S8's: what moving from Envoy's ratelimit filter and the
    /// RateLimitService to tollgate's filter with leases gains in throughput.
    pub s5_to_s8: Option<f64>,
    /// The same in each round both ran.
    pub s5_to_s8_per_round: Vec<f64>,
    /// S8's Envoy CPU per request over S5's.
    pub envoy_cpu_to_s5: Option<f64>,
    /// S8's limiter + Redis CPU per request (per decision: one call each) over S6's (one lease
    /// call per request); and S8's and S6's own, µs per request over all rounds.
    pub backend_cpu_to_s6: Option<f64>,
    pub backend_us: Option<f64>,
    pub s6_backend_us: Option<f64>,
    /// S8's p99 over S6's.
    pub p99_to_s6: Option<f64>,
    /// Envoy's ratelimit filter over the whole run (warm-up included): answers OK, over the
    /// limit, calls that failed and were let through undecided (`failure_mode_deny: false`);
    /// the calls the limiter answered; Envoy's connections to it.
    pub ok: u64,
    pub over_limit: u64,
    pub errors: u64,
    /// Of `errors`, those before the measured rounds (in the warm-up).
    pub errors_before_rounds: u64,
    pub limiter_calls: u64,
    pub connections: u64,
}

/// The scenarios that add settlement, each with the one it adds it to.
pub const SETTLING: [(&str, &str); 2] = [("4s", "4"), ("5s", "5")];

/// A settling scenario (4s, 5s: the route's cost reserved, the actual cost settled from a
/// response header) next to the one without settlement (4, 5), each ratio the median of
/// per-round ratios of runs made in the same rounds; and what the filter settled.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SettleComparison {
    /// `4s` or `5s`, and `4` or `5`.
    pub id: String,
    pub base: String,
    /// Rounds in which both ran.
    pub rounds: usize,
    pub rps: Option<f64>,
    /// The settling scenario's req/s over the base's in each of those rounds.
    pub rps_per_round: Vec<f64>,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    /// CPU per request: Envoy's, and the limiter's plus Redis' (global only).
    pub envoy_cpu: Option<f64>,
    pub backend_cpu: Option<f64>,
    /// The filter's counters over the whole run (warm-up included): requests decided, units
    /// reserved at admission, settled (the actual cost), refunded, charged beyond the
    /// reservation, streams that ended without a usable actual cost.
    pub decided: u64,
    pub reserved: u64,
    pub settled: u64,
    pub refunded: u64,
    pub debt: u64,
    pub missing: u64,
    /// Global only: the settled units the limiter was told of (on the lease calls).
    pub limiter_settled: Option<u64>,
}

impl SettleComparison {
    /// Whether settlement happened at all (`tollgate_units_settled` above 0).
    pub fn settled_any(&self) -> bool {
        self.settled > 0
    }
}

/// The scenarios that count S4's policy by a windowed algorithm (4f, 4w, 4l), each with its
/// algorithm; each is compared with S4 (the token bucket).
pub use crate::config::ALGORITHMS;

/// A windowed scenario (4f, 4w, 4l: S4's policy with `algorithm` set, no burst) next to S4,
/// each ratio the median of per-round ratios of runs made in the same rounds; and what was
/// denied (nothing should be: the policies are sized never to deny).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AlgorithmComparison {
    /// `4f`, `4w` or `4l`, and its `algorithm`.
    pub id: String,
    pub algorithm: String,
    /// Rounds in which both it and S4 ran.
    pub rounds: usize,
    pub rps: Option<f64>,
    /// Its req/s over S4's in each of those rounds.
    pub rps_per_round: Vec<f64>,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    /// Envoy CPU per request over S4's.
    pub envoy_cpu: Option<f64>,
    /// The filter's counters over the whole run (warm-up included): requests decided, and
    /// refused (429).
    pub decided: u64,
    pub denied: u64,
    /// Responses other than 200 in the measured runs (wrk).
    pub non_2xx: u64,
    /// Sliding log only: the hottest tenant's share of the requests, and what it sent per
    /// log window at the scenario's median req/s (to set against `MAX_LOG_LIMIT`).
    pub hottest_share: Option<f64>,
    pub hottest_per_window: Option<f64>,
}

impl AlgorithmComparison {
    /// Whether anything was denied (by the filter's count or by wrk's).
    pub fn denied_any(&self) -> bool {
        self.denied > 0 || self.non_2xx > 0
    }
}

/// The native build's ratios reported beside its targets, `(scenario, baseline)`: the module
/// with no policy matching (its own floor) against Envoy without a filter and against the wasm
/// filter's floor, and one local policy against that floor.
pub const NATIVE_PAIRS: [(&str, &str); 3] = [("3n", "1"), ("3n", "3"), ("4n", "3n")];

/// One of [`NATIVE_PAIRS`] as measured: medians of per-round ratios of runs made in the same
/// rounds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NativeRatio {
    pub id: String,
    pub base: String,
    pub rps: Option<f64>,
    /// Envoy CPU per request over the baseline's.
    pub envoy_cpu: Option<f64>,
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
        median(self.per_round(a, b, metric))
    }

    /// `metric(a) / metric(b)` of every round both ran, in `a`'s order of rounds.
    fn per_round(&self, a: &str, b: &str, metric: impl Fn(&Measured) -> f64) -> Vec<f64> {
        let (Some(a), Some(b)) = (self.scenario(a), self.scenario(b)) else {
            return Vec::new();
        };
        a.runs
            .iter()
            .filter_map(|ra| {
                let rb = b.runs.iter().find(|rb| rb.round == ra.round)?;
                let denominator = metric(&rb.measured);
                (denominator > 0.0).then(|| metric(&ra.measured) / denominator)
            })
            .collect()
    }

    /// Throughput of `a` relative to `b` (median of per-round ratios).
    pub fn rps_ratio(&self, a: &str, b: &str) -> Option<f64> {
        self.paired(a, b, Measured::rps)
    }

    /// Envoy CPU per request of `a` relative to `b` (median of per-round ratios).
    pub fn cpu_ratio(&self, a: &str, b: &str) -> Option<f64> {
        self.cpu_ratio_of(a, b, |r| r.envoy_cpu_s)
    }

    /// Limiter plus Redis CPU per request of `a` relative to `b` (median of per-round ratios).
    pub fn backend_cpu_ratio(&self, a: &str, b: &str) -> Option<f64> {
        self.cpu_ratio_of(a, b, |r| r.backend_cpu_s)
    }

    fn cpu_ratio_of(&self, a: &str, b: &str, cpu: fn(&Run) -> Option<f64>) -> Option<f64> {
        let (sa, sb) = (self.scenario(a)?, self.scenario(b)?);
        let per_request = |r: &Run| cpu(r).map(|c| c / r.measured.requests.max(1) as f64);
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

    /// p50 latency of `a` relative to `b` (median of per-round ratios).
    pub fn p50_ratio(&self, a: &str, b: &str) -> Option<f64> {
        self.paired(a, b, |m| m.p50_us as f64)
    }

    /// Scenario 8 next to 5 and 6; `None` unless 8 and one of them ran.
    pub fn rls(&self) -> Option<RlsComparison> {
        let s8 = self.scenario("8")?;
        if self.scenario("5").is_none() && self.scenario("6").is_none() {
            return None;
        }
        let rps = |m: &Measured| m.rps();
        Some(RlsComparison {
            rounds_with_s5: self.per_round("5", "8", rps).len(),
            rounds_with_s6: self.per_round("8", "6", rps).len(),
            s5_to_s8: self.rps_ratio("5", "8"),
            s5_to_s8_per_round: self.per_round("5", "8", rps),
            envoy_cpu_to_s5: self.cpu_ratio("8", "5"),
            backend_cpu_to_s6: self.backend_cpu_ratio("8", "6"),
            backend_us: s8.cpu_us_per_request().1,
            s6_backend_us: self.scenario("6").and_then(|s6| s6.cpu_us_per_request().1),
            p99_to_s6: self.p99_ratio("8", "6"),
            ok: s8.counter("allowed"),
            over_limit: s8.counter("denied"),
            errors: s8.counter("rls_errors"),
            errors_before_rounds: s8.counter("rls_errors_before_rounds"),
            limiter_calls: s8.counter("limiter_rls_calls"),
            connections: s8.counter("limiter_connections"),
        })
    }

    /// Scenario 5t next to 5 and 4; `None` unless both 5 and 5t ran.
    pub fn mtls(&self) -> Option<MtlsComparison> {
        let (s5, s5t) = (self.scenario("5")?, self.scenario("5t")?);
        let rounds = s5t
            .runs
            .iter()
            .filter(|t| s5.runs.iter().any(|p| p.round == t.round))
            .count();
        Some(MtlsComparison {
            rounds,
            rps: self.rps_ratio("5t", "5"),
            rps_per_round: self.per_round("5t", "5", Measured::rps),
            p50: self.p50_ratio("5t", "5"),
            p99: self.p99_ratio("5t", "5"),
            envoy_cpu: self.cpu_ratio("5t", "5"),
            backend_cpu: self.backend_cpu_ratio("5t", "5"),
            s5t_to_s4: self.rps_ratio("5t", "4"),
            s5_to_s4: self.rps_ratio("5", "4"),
            handshakes: s5t.counter("limiter_tls_handshakes"),
            connections: s5t.counter("limiter_connections"),
        })
    }

    /// Scenario `id` (4s, 5s) next to `base` (4, 5); `None` unless both ran.
    pub fn settlement(&self, id: &str, base: &str) -> Option<SettleComparison> {
        let (sb, ss) = (self.scenario(base)?, self.scenario(id)?);
        let rounds = ss
            .runs
            .iter()
            .filter(|r| sb.runs.iter().any(|b| b.round == r.round))
            .count();
        Some(SettleComparison {
            id: id.into(),
            base: base.into(),
            rounds,
            rps: self.rps_ratio(id, base),
            rps_per_round: self.per_round(id, base, Measured::rps),
            p50: self.p50_ratio(id, base),
            p99: self.p99_ratio(id, base),
            envoy_cpu: self.cpu_ratio(id, base),
            backend_cpu: self.backend_cpu_ratio(id, base),
            decided: ss.counter("decided"),
            reserved: ss.counter("units_reserved"),
            settled: ss.counter("units_settled"),
            refunded: ss.counter("units_refunded"),
            debt: ss.counter("units_debt"),
            missing: ss.counter("usage_missing"),
            limiter_settled: ss
                .redis_per_1k()
                .map(|_| ss.counter("limiter_units_settled")),
        })
    }

    /// Every settling scenario that ran next to its base, in [`SETTLING`] order.
    pub fn settlements(&self) -> Vec<SettleComparison> {
        SETTLING
            .iter()
            .filter_map(|(id, base)| self.settlement(id, base))
            .collect()
    }

    /// Scenario `id` (4f, 4w, 4l), counted by `algorithm`, next to S4; `None` unless both ran.
    pub fn algorithm(&self, id: &str, algorithm: &str) -> Option<AlgorithmComparison> {
        let (s4, sa) = (self.scenario("4")?, self.scenario(id)?);
        let rounds = sa
            .runs
            .iter()
            .filter(|r| s4.runs.iter().any(|b| b.round == r.round))
            .count();
        let hottest_share = (algorithm == "sliding_log").then(|| {
            let zipf = self.setup.distribution != "uniform";
            crate::config::hottest_tenant_share(self.setup.tenants, zipf)
        });
        let window_s = crate::config::LOG_WINDOW_MS as f64 / 1e3;
        Some(AlgorithmComparison {
            id: id.into(),
            algorithm: algorithm.into(),
            rounds,
            rps: self.rps_ratio(id, "4"),
            rps_per_round: self.per_round(id, "4", Measured::rps),
            p50: self.p50_ratio(id, "4"),
            p99: self.p99_ratio(id, "4"),
            envoy_cpu: self.cpu_ratio(id, "4"),
            decided: sa.counter("decided"),
            denied: sa.counter("denied"),
            non_2xx: sa.non_2xx(),
            hottest_share,
            hottest_per_window: hottest_share
                .zip(sa.rps())
                .map(|(share, rps)| share * rps * window_s),
        })
    }

    /// Every windowed scenario that ran next to S4, in [`ALGORITHMS`] order.
    pub fn algorithms(&self) -> Vec<AlgorithmComparison> {
        ALGORITHMS
            .iter()
            .filter_map(|(id, algorithm)| self.algorithm(id, algorithm))
            .collect()
    }

    /// Every pair of [`NATIVE_PAIRS`] whose two scenarios ran.
    pub fn native_ratios(&self) -> Vec<NativeRatio> {
        NATIVE_PAIRS
            .iter()
            .filter(|(id, base)| self.scenario(id).is_some() && self.scenario(base).is_some())
            .map(|&(id, base)| NativeRatio {
                id: id.into(),
                base: base.into(),
                rps: self.rps_ratio(id, base),
                envoy_cpu: self.cpu_ratio(id, base),
            })
            .collect()
    }

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

    /// Scenario 7's variants, in the order they first ran, each with its rounds.
    pub fn over_limit_variants(&self) -> Vec<(&str, Vec<&OverLimitRun>)> {
        let mut out: Vec<(&str, Vec<&OverLimitRun>)> = Vec::new();
        for run in &self.over_limit {
            match out.iter_mut().find(|(v, _)| *v == run.variant) {
                Some((_, runs)) => runs.push(run),
                None => out.push((&run.variant, vec![run])),
            }
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
        // Only scenario 7 ran (`--only 7`): no table of the others.
        if !self.scenarios.is_empty() {
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
            let more: String = ["4s", "4f", "4w", "4l", "5s", "5t", "6", "8"]
                .iter()
                .filter_map(|id| self.cpu_ratio(id, "3").map(|r| format!(", S{id} {r:.2}")))
                .collect();
            md.push_str(&format!(
                "- Envoy CPU per request relative to S3 (less sensitive to the load generator's share of the cores than req/s): S4 {cpu4:.2}, S5 {cpu5:.2}{more}.\n"
            ));
        }
        let native = self.native_ratios();
        if !native.is_empty() {
            let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.2}"));
            let pairs: Vec<String> = native
                .iter()
                .map(|r| {
                    format!(
                        "S{} × S{} {} · {}",
                        r.id,
                        r.base,
                        num(r.rps),
                        num(r.envoy_cpu)
                    )
                })
                .collect();
            md.push_str(&format!(
                "- The native build (dynamic module), req/s · Envoy CPU per request, each the \
                 median of per-round ratios: {}. S3n (no policy matches) is the module's own \
                 floor: what loading it costs before any policy decides.\n",
                pairs.join(", ")
            ));
        }
        if let Some(r) = self.rls() {
            let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.2}"));
            let per_round: Vec<String> = r
                .s5_to_s8_per_round
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect();
            let us = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1} µs"));
            let rounds = |n: usize| format!("{n} round{}", if n == 1 { "" } else { "s" });
            let measured_errors = r.errors.saturating_sub(r.errors_before_rounds);
            let errors = if measured_errors > 0 {
                format!(
                    " **{measured_errors} calls in the measured rounds failed and were let \
                     through undecided (`failure_mode_deny: false`): S8's figures include \
                     requests no limit decided.**"
                )
            } else if r.errors > 0 {
                format!(
                    " The {} failed calls were all in the warm-up, none in the measured rounds.",
                    r.errors
                )
            } else {
                String::new()
            };
            md.push_str(&format!(
                "- S5 / S8 = {rps} in req/s (per round: {per_round}; {n5}): tollgate's \
                 filter with leases over Envoy's `ratelimit` filter calling this limiter's \
                 RateLimitService once per request, what moving from the one to the other \
                 gains in throughput. S8's limiter + Redis CPU per decision {b8} against S6's \
                 {b6} (one lease call per request; {cpu6} × S6, {n6}), Envoy CPU per \
                 request {cpu5} × S5, p99 {p99} × S6. Envoy's filter was answered {ok} OK and \
                 {over} over the limit, {errs} calls failed; the limiter answered {calls} calls \
                 on {conns} (warm-up included).{errors}\n",
                rps = num(r.s5_to_s8),
                per_round = if per_round.is_empty() {
                    "–".into()
                } else {
                    per_round.join(", ")
                },
                n5 = rounds(r.rounds_with_s5),
                b8 = us(r.backend_us),
                b6 = us(r.s6_backend_us),
                cpu6 = num(r.backend_cpu_to_s6),
                n6 = rounds(r.rounds_with_s6),
                cpu5 = num(r.envoy_cpu_to_s5),
                p99 = num(r.p99_to_s6),
                ok = r.ok,
                over = r.over_limit,
                errs = r.errors,
                calls = r.limiter_calls,
                conns = if r.connections == 1 {
                    "1 connection".to_string()
                } else {
                    format!("{} connections", r.connections)
                },
            ));
        }
        if let Some(m) = self.mtls() {
            let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.2}"));
            let s4 = match (m.s5t_to_s4, m.s5_to_s4) {
                (None, None) => String::new(),
                (t, p) => format!(" Relative to S4 (req/s): S5t {}, S5 {}.", num(t), num(p)),
            };
            let per_round: Vec<String> =
                m.rps_per_round.iter().map(|r| format!("{r:.2}")).collect();
            let plural =
                |n: u64, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
            md.push_str(&format!(
                "- S5t (the limiter behind mutual TLS, `envoy/global-mtls.yaml`) relative to S5 \
                 (h2c), measured in the same {rounds} rounds: req/s {rps} (per round: \
                 {per_round}), p50 {p50}, p99 {p99}, Envoy CPU per request {cpu}, limiter + Redis \
                 CPU per request {backend}.{s4} Envoy made {handshakes} with the limiter over the \
                 whole run ({connections}, warm-up included): the connections are long-lived, so \
                 no handshake is on the per-request path.\n",
                rounds = m.rounds,
                rps = num(m.rps),
                per_round = per_round.join(", "),
                p50 = num(m.p50),
                p99 = num(m.p99),
                cpu = num(m.envoy_cpu),
                backend = num(m.backend_cpu),
                handshakes = plural(m.handshakes, "TLS handshake", "TLS handshakes"),
                connections = plural(m.connections, "connection", "connections"),
            ));
        }
        for c in self.settlements() {
            let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.2}"));
            let per_round: Vec<String> =
                c.rps_per_round.iter().map(|r| format!("{r:.2}")).collect();
            let backend = c.backend_cpu.map_or(String::new(), |r| {
                format!(", limiter + Redis CPU per request {r:.2}")
            });
            let per_request = |units: u64| {
                ratio(units as f64, c.decided as f64).map_or("–".into(), |u| format!("{u:.1}"))
            };
            let limiter = c.limiter_settled.map_or(String::new(), |n| {
                format!(
                    "; the limiter was told of {n} settled units (on the existing lease calls; \
                     the last ones of the run may still have been on their way)"
                )
            });
            let verdict = if c.settled_any() {
                String::new()
            } else {
                " **No units settled (`tollgate_units_settled` is 0): settlement did not \
                 happen, so these ratios measure a policy that never settles; the run failed.**"
                    .into()
            };
            md.push_str(&format!(
                "- S{id} (S{base} + settlement: the route's cost reserved, the actual cost settled \
                 from the response header) relative to S{base}, measured in the same {rounds} \
                 rounds: req/s {rps} (per round: {per_round}), p50 {p50}, p99 {p99}, Envoy CPU \
                 per request {cpu}{backend}. The filter settled {settled} units for {decided} \
                 decided requests (warm-up included; per request {reserved_pr} reserved, \
                 {settled_pr} settled, {refunded_pr} refunded; {debt} units charged beyond the \
                 reservation, {missing} responses without usage){limiter}.{verdict}\n",
                id = c.id,
                base = c.base,
                rounds = c.rounds,
                rps = num(c.rps),
                per_round = per_round.join(", "),
                p50 = num(c.p50),
                p99 = num(c.p99),
                cpu = num(c.envoy_cpu),
                settled = c.settled,
                decided = c.decided,
                reserved_pr = per_request(c.reserved),
                settled_pr = per_request(c.settled),
                refunded_pr = per_request(c.refunded),
                debt = c.debt,
                missing = c.missing,
            ));
        }
        for c in self.algorithms() {
            let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.2}"));
            let per_round: Vec<String> =
                c.rps_per_round.iter().map(|r| format!("{r:.2}")).collect();
            let window = crate::config::LOG_WINDOW;
            let limit = crate::config::MAX_LOG_LIMIT;
            // The sliding log's window against the hottest tenant's traffic.
            let log = match (c.hottest_share, c.hottest_per_window) {
                (Some(share), Some(sent)) => format!(
                    " The log keeps at most {limit} entries per {window} window: the hottest \
                     tenant ({pct:.1} % of the requests) sent about {sent:.0} per window at \
                     S{id}'s median req/s, and would fill it only past {full:.0} req/s in all.",
                    pct = share * 100.0,
                    id = c.id,
                    full = limit as f64 * 1e3 / crate::config::LOG_WINDOW_MS as f64 / share,
                ),
                _ => String::new(),
            };
            let denials = format!(
                "the filter denied {} of {} decided requests (warm-up included), {} measured \
                 responses were not 200",
                c.denied, c.decided, c.non_2xx
            );
            let verdict = if !c.denied_any() {
                format!(" Nothing was denied: {denials}.")
            } else if c.algorithm == "sliding_log" {
                format!(
                    " **Denials: {denials}. At this load the hottest tenant sent more than \
                     {limit} per {window} (the most a sliding log holds), so these ratios are of \
                     a run that denied, not of a never-denying one.**"
                )
            } else {
                format!(
                    " **Denials: {denials}, though the policy admits 10⁹ per 1 s window: these \
                     ratios are of a run that denied.**"
                )
            };
            md.push_str(&format!(
                "- S{id} (S4 counted by `{algorithm}` instead of the token bucket, no burst) \
                 relative to S4, measured in the same {rounds} rounds: req/s {rps} (per round: \
                 {per_round}), p50 {p50}, p99 {p99}, Envoy CPU per request {cpu}.{log}{verdict}\n",
                id = c.id,
                algorithm = c.algorithm,
                rounds = c.rounds,
                rps = num(c.rps),
                per_round = per_round.join(", "),
                p50 = num(c.p50),
                p99 = num(c.p99),
                cpu = num(c.envoy_cpu),
            ));
        }
        if let Some(first) = self.over_limit.first() {
            md.push_str(&format!(
                "\n## Scenario 7: over the limit\n\n\
                 Two Envoys (`--concurrency {conc}`) share one global policy ({rate}/s, burst \
                 {burst}, `on_unavailable: closed`); each variant loads {tenants} fresh keys with \
                 paced demand (a Rust client, new connection per request, sends every {tick} ms \
                 what the demand owes) for {secs:.0} s, variants one after another in each round. \
                 Admitted = requests that reached the upstream; allowed = rate × time + burst per \
                 key (each bucket starts full). Lease calls are the filters' (both Envoys); per \
                 key per instance they count from one second in. The split is A's admitted over \
                 B's after a {warmup:.0} s warm-up, next to the demand split measured the same \
                 way. Latencies are the load generator's, per answer.\n\n\
                 | round | variant | s | demand × rate | admitted / allowed | overshoot (worst key) | under-use | lease calls /s · /req | lease calls /key/instance/s (A · B) | Redis FCALL /s · /req | admitted A · B | split A:B (demand) | 429 p50 · p99 ms | 200 p50 · p99 ms | undecided · other |\n\
                 |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
                conc = s.concurrency,
                rate = first.rate,
                burst = first.burst,
                tenants = first.tenants,
                tick = crate::paced::TICK.as_millis(),
                secs = first.seconds,
                warmup = first.warmup_s,
            ));
            let num = |v: Option<f64>, digits: usize| {
                v.map_or("–".to_string(), |v| format!("{v:.digits$}"))
            };
            for r in &self.over_limit {
                let [la, lb] = r.lease_calls_per_key_instance_s();
                let [a, b] = &r.instances;
                md.push_str(&format!(
                    "| {round} | {variant} | {secs:.2} | {demand:.2} | {admitted} / {allowed:.0} | {over:.2} % | {under:.2} % | {lps} · {lpr} | {la} · {lb} | {fps} · {fpr} | {aa} · {ab} | {split} ({dsplit}) | {denied} | {ok} | {undecided} · {other} |\n",
                    round = r.round,
                    variant = r.variant,
                    secs = r.seconds,
                    demand = r.demand_ratio(),
                    admitted = r.admitted_total(),
                    allowed = r.allowed_total(),
                    over = r.overshoot_pct(),
                    under = r.underuse_pct(),
                    lps = num(r.lease_calls_per_s(), 1),
                    lpr = num(r.lease_calls_per_offered(), 4),
                    la = num(la, 2),
                    lb = num(lb, 2),
                    fps = num(r.fcalls_per_s(), 1),
                    fpr = num(r.fcalls_per_offered(), 4),
                    aa = a.admitted,
                    ab = b.admitted,
                    split = num(r.admitted_split(), 2),
                    dsplit = num(r.demand_split(), 2),
                    denied = r.denied_latency.cell(),
                    ok = r.admitted_latency.cell(),
                    undecided = r.undecided,
                    other = r.other(),
                ));
            }
            let retries: u64 = self.over_limit.iter().map(|r| r.retries).sum();
            let assignments: u64 = self
                .over_limit
                .iter()
                .flat_map(|r| r.instances.iter().map(|i| i.assignments))
                .sum();
            md.push_str(&format!(
                "\nOver all variants and rounds: {assignments} limiter answers carried a share \
                 of the rate (assignments), {retries} lease requests were sent again after no answer.\n"
            ));
        }
        md.push_str("\n## Targets\n\n| target | measured | |\n|---|---:|---|\n");
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
                    "ratio_to_s4": if sc.id.ends_with('u') { None } else { self.rps_ratio(&sc.id, "4") },
                    "ratio_to_s5": if sc.id == "5t" || sc.id == "5s" { self.rps_ratio(&sc.id, "5") } else { None },
                    "ratio_to_s8": if sc.id == "5" { self.rps_ratio("5", "8") } else { None },
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
        let latency =
            |l: &Latency| json!({"count": l.count, "p50_us": l.p50_us, "p99_us": l.p99_us});
        let over_limit: Vec<Value> = self
            .over_limit
            .iter()
            .map(|r| {
                let per_key = r.lease_calls_per_key_instance_s();
                let instances: Vec<Value> = r
                    .instances
                    .iter()
                    .zip(["a", "b"])
                    .map(|(i, name)| {
                        json!({
                            "name": name,
                            "offered": i.offered,
                            "admitted": i.admitted,
                            "denied": i.denied,
                            "other": i.other,
                            "offered_after_warmup": i.offered_steady,
                            "admitted_after_warmup": i.admitted_steady,
                            "lease_calls": i.lease_calls,
                            "lease_calls_after_1s": i.lease_calls_after_1s,
                            "assignments": i.assignments,
                            "per_second": i.per_second.iter().map(|s| json!({
                                "offered": s.offered,
                                "admitted": s.admitted,
                                "denied": s.denied,
                            })).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                json!({
                    "round": r.round,
                    "variant": r.variant,
                    "demand_multiple": r.multiple,
                    "demand_split": [r.split.0, r.split.1],
                    "tenants": r.tenants,
                    "rate_per_s": r.rate,
                    "burst": r.burst,
                    "seconds": r.seconds,
                    "warmup_s": r.warmup_s,
                    "demanded": r.demanded,
                    "demand_ratio": r.demand_ratio(),
                    "admitted": r.admitted_total(),
                    "allowed": r.allowed_total(),
                    "overshoot_pct_worst_tenant": r.overshoot_pct(),
                    "underuse_pct": r.underuse_pct(),
                    "lease_calls": r.lease_calls(),
                    "lease_calls_per_s": r.lease_calls_per_s(),
                    "lease_calls_per_offered": r.lease_calls_per_offered(),
                    "lease_calls_per_key_per_instance_s_after_1s": per_key,
                    "redis_fcall": r.redis.map(|x| x.0),
                    "redis_all": r.redis.map(|x| x.1),
                    "redis_fcall_per_s": r.fcalls_per_s(),
                    "redis_fcall_per_offered": r.fcalls_per_offered(),
                    "admitted_split": r.admitted_split(),
                    "demand_split_measured": r.demand_split(),
                    "split_error_pct": r.split_error_pct(),
                    "latency_429": latency(&r.denied_latency),
                    "latency_200": latency(&r.admitted_latency),
                    "undecided": r.undecided,
                    "other": r.other(),
                    "callout_retries": r.retries,
                    "instances": instances,
                    "admitted_per_tenant": r.admitted.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
                })
            })
            .collect();
        let targets: Vec<Value> = self
            .targets()
            .into_iter()
            .map(|(what, measured, met)| json!({"target": what, "measured": measured, "met": met}))
            .collect();
        let mtls = self.mtls().map(|m| {
            json!({
                "rounds": m.rounds,
                "rps_ratio_to_s5": m.rps,
                "rps_ratio_to_s5_per_round": m.rps_per_round,
                "p50_ratio_to_s5": m.p50,
                "p99_ratio_to_s5": m.p99,
                "envoy_cpu_ratio_to_s5": m.envoy_cpu,
                "limiter_and_redis_cpu_ratio_to_s5": m.backend_cpu,
                "s5t_rps_ratio_to_s4": m.s5t_to_s4,
                "s5_rps_ratio_to_s4": m.s5_to_s4,
                "limiter_tls_handshakes": m.handshakes,
                "limiter_connections": m.connections,
            })
        });
        let rls = self.rls().map(|r| {
            json!({
                "rounds_with_s5": r.rounds_with_s5,
                "rounds_with_s6": r.rounds_with_s6,
                "s5_rps_ratio_to_s8": r.s5_to_s8,
                "s5_rps_ratio_to_s8_per_round": r.s5_to_s8_per_round,
                "envoy_cpu_ratio_to_s5": r.envoy_cpu_to_s5,
                "limiter_and_redis_cpu_ratio_to_s6": r.backend_cpu_to_s6,
                "limiter_and_redis_cpu_us_per_decision": r.backend_us,
                "s6_limiter_and_redis_cpu_us_per_decision": r.s6_backend_us,
                "p99_ratio_to_s6": r.p99_to_s6,
                "ratelimit_ok": r.ok,
                "ratelimit_over_limit": r.over_limit,
                "ratelimit_errors": r.errors,
                "ratelimit_errors_before_rounds": r.errors_before_rounds,
                "limiter_rls_calls": r.limiter_calls,
                "limiter_connections": r.connections,
            })
        });
        let settlement: Vec<Value> = self
            .settlements()
            .iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "base": c.base,
                    "rounds": c.rounds,
                    "rps_ratio_to_base": c.rps,
                    "rps_ratio_to_base_per_round": c.rps_per_round,
                    "p50_ratio_to_base": c.p50,
                    "p99_ratio_to_base": c.p99,
                    "envoy_cpu_ratio_to_base": c.envoy_cpu,
                    "limiter_and_redis_cpu_ratio_to_base": c.backend_cpu,
                    "decided": c.decided,
                    "units_reserved": c.reserved,
                    "units_settled": c.settled,
                    "units_refunded": c.refunded,
                    "units_debt": c.debt,
                    "usage_missing": c.missing,
                    "limiter_units_settled": c.limiter_settled,
                    "settled_any": c.settled_any(),
                })
            })
            .collect();
        let algorithms: Vec<Value> = self
            .algorithms()
            .iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "base": "4",
                    "algorithm": c.algorithm,
                    "rounds": c.rounds,
                    "rps_ratio_to_s4": c.rps,
                    "rps_ratio_to_s4_per_round": c.rps_per_round,
                    "p50_ratio_to_s4": c.p50,
                    "p99_ratio_to_s4": c.p99,
                    "envoy_cpu_ratio_to_s4": c.envoy_cpu,
                    "decided": c.decided,
                    "denied": c.denied,
                    "non_2xx": c.non_2xx,
                    "denied_any": c.denied_any(),
                    "hottest_tenant_share": c.hottest_share,
                    "hottest_tenant_per_log_window": c.hottest_per_window,
                })
            })
            .collect();
        let native: Vec<Value> = self
            .native_ratios()
            .iter()
            .map(|r| {
                json!({
                    "id": r.id,
                    "base": r.base,
                    "rps_ratio": r.rps,
                    "envoy_cpu_ratio": r.envoy_cpu,
                })
            })
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
            "mtls": mtls,
            "rls": rls,
            "settlement": settlement,
            "algorithms": algorithms,
            "native": native,
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
        assert!(
            md.contains("| S4 ≥ 0.90 × S3 (req/s) | 0.950 | met |"),
            "{md}"
        );
        // The settling scenarios did not run: their targets are listed, not measured.
        assert!(
            md.contains("| S4s ≥ 0.9 × S4 (req/s) | n/a | not measured |"),
            "{md}"
        );
        assert!(
            md.contains("| S5s ≥ 0.9 × S5 (req/s) | n/a | not measured |"),
            "{md}"
        );
        assert!(!md.contains("+ settlement"), "{md}");
        assert_eq!(report.settlements(), Vec::new());
        // Nor did the windowed ones: no line, no target.
        assert!(!md.contains("counted by"), "{md}");
        assert_eq!(report.algorithms(), Vec::new());
        assert_eq!(report.json()["algorithms"], serde_json::json!([]));
        // Nor did the native ones: their targets are listed, not measured, and no ratio line.
        assert!(
            md.contains("| S4n ≥ 0.90 × S1 (req/s) | n/a | not measured |"),
            "{md}"
        );
        assert!(
            md.contains("| S4n Envoy CPU per request ≤ 1.15 × S1's | n/a | not measured |"),
            "{md}"
        );
        assert!(!md.contains("native build"), "{md}");
        assert_eq!(report.json()["native"], serde_json::json!([]));
    }

    #[test]
    fn targets_judge_both_builds() {
        // Envoy CPU per request: `cpu` µs for each request of the run.
        let at = |round: u32, requests: u64, cpu_us: f64| Run {
            envoy_cpu_s: Some(requests as f64 * cpu_us * 1e-6),
            ..run(round, requests, 100)
        };
        let scenario = |id: &str, runs: Vec<Run>| Scenario {
            id: id.into(),
            runs,
            ..Scenario::default()
        };
        let mut report = Report {
            scenarios: vec![
                scenario("1", vec![at(0, 1000, 10.0), at(1, 1000, 10.0)]),
                scenario("3", vec![at(0, 800, 13.0), at(1, 800, 13.0)]),
                // 0.90 × S3 exactly: the wasm target is met on the line.
                scenario("4", vec![at(0, 720, 15.0), at(1, 720, 15.0)]),
                scenario("5", vec![at(0, 700, 16.0), at(1, 700, 16.0)]),
                scenario("3n", vec![at(0, 960, 10.5), at(1, 940, 10.5)]),
                // 0.92 × S1 in req/s, but 1.2 × S1's CPU per request.
                scenario("4n", vec![at(0, 920, 12.0), at(1, 920, 12.0)]),
                scenario("5n", vec![at(0, 900, 12.5), at(1, 850, 12.5)]),
            ],
            ..Report::default()
        };
        let find = |report: &Report, what: &str| {
            report
                .targets()
                .into_iter()
                .find(|t| t.0 == what)
                .unwrap_or_default()
        };
        assert_eq!(
            find(&report, "S4 ≥ 0.90 × S3 (req/s)"),
            ("S4 ≥ 0.90 × S3 (req/s)".into(), "0.900".into(), Some(true))
        );
        // 700 / 720 = 0.972.
        assert_eq!(find(&report, "S5 ≥ 0.95 × S4 (req/s)").2, Some(true));
        assert_eq!(
            find(&report, "S4n ≥ 0.90 × S1 (req/s)").1,
            "0.920".to_string()
        );
        assert_eq!(find(&report, "S4n ≥ 0.90 × S1 (req/s)").2, Some(true));
        let cpu = find(&report, "S4n Envoy CPU per request ≤ 1.15 × S1's");
        assert_eq!((cpu.1.as_str(), cpu.2), ("1.200", Some(false)));
        // Per round 900 / 920 and 850 / 920: the median is 0.951.
        assert_eq!(find(&report, "S5n ≥ 0.95 × S4n (req/s)").2, Some(true));
        // The old targets are gone.
        assert!(report
            .targets()
            .iter()
            .all(|t| !t.0.contains("0.95 × S3") && !t.0.contains("0.9 × S1")));

        let native = report.native_ratios();
        let pairs: Vec<(&str, &str)> = native
            .iter()
            .map(|r| (r.id.as_str(), r.base.as_str()))
            .collect();
        assert_eq!(pairs, vec![("3n", "1"), ("3n", "3"), ("4n", "3n")]);
        // Per round 0.96 and 0.94.
        assert!(
            (native[0].rps.unwrap_or(0.0) - 0.95).abs() < 1e-9,
            "{native:?}"
        );
        assert!(
            (native[0].envoy_cpu.unwrap_or(0.0) - 1.05).abs() < 1e-9,
            "{native:?}"
        );
        // Per round 920 / 960 and 920 / 940.
        let s4n = (920.0 / 960.0 + 920.0 / 940.0) / 2.0;
        assert!(
            (native[2].rps.unwrap_or(0.0) - s4n).abs() < 1e-9,
            "{native:?}"
        );
        let md = report.markdown();
        assert!(md.contains("| 3n |"), "{md}");
        assert!(
            md.contains(
                "- The native build (dynamic module), req/s · Envoy CPU per request, each the \
                 median of per-round ratios: S3n × S1 0.95 · 1.05, S3n × S3 1.19 · 0.81, \
                 S4n × S3n 0.97 · 1.14. S3n (no policy matches) is the module's own floor"
            ),
            "{md}"
        );
        assert!(
            md.contains("| S4n Envoy CPU per request ≤ 1.15 × S1's | 1.200 | **missed** |"),
            "{md}"
        );
        assert!(
            md.contains("| S4 ≥ 0.90 × S3 (req/s) | 0.900 | met |"),
            "{md}"
        );
        let json = report.json();
        assert_eq!(json["native"].as_array().map(Vec::len), Some(3));
        assert_eq!(json["native"][2]["id"], "4n");
        assert_eq!(json["native"][2]["base"], "3n");
        assert_eq!(
            json["native"][0]["rps_ratio"],
            json["scenarios"][4]["ratio_to_s1"]
        );
        assert_eq!(json["scenarios"][4]["id"], "3n");
        let targets = json["targets"].as_array().cloned().unwrap_or_default();
        assert!(
            targets
                .iter()
                .any(|t| t["target"] == "S4n Envoy CPU per request ≤ 1.15 × S1's"
                    && t["met"] == false)
        );

        // Without S3n, no ratio line; the targets of 4n and 5n stand on their own.
        report.scenarios.retain(|s| s.id != "3n");
        assert_eq!(report.native_ratios(), Vec::new());
        assert!(!report.markdown().contains("native build"));
        assert_eq!(find(&report, "S4n ≥ 0.90 × S1 (req/s)").2, Some(true));
    }

    #[test]
    fn windowed_algorithms_are_compared_with_s4_in_the_same_rounds() {
        let scenario = |id: &str, runs: Vec<Run>| Scenario {
            id: id.into(),
            runs,
            counters: vec![("decided".into(), 2000), ("denied".into(), 0)],
            ..Scenario::default()
        };
        // 4l's Envoy spends a fifth more CPU per request than 4's.
        let costlier = |mut r: Run| {
            r.envoy_cpu_s = Some(r.measured.requests as f64 * 1.2e-5);
            r
        };
        let mut report = Report {
            setup: Setup {
                tenants: 100,
                distribution: "Zipf-like, weight 1/rank".into(),
                ..Setup::default()
            },
            scenarios: vec![
                scenario("3", vec![run(0, 1000, 100), run(1, 1000, 100)]),
                scenario("4", vec![run(0, 1000, 100), run(1, 1000, 100)]),
                scenario("4f", vec![run(0, 990, 100), run(1, 1010, 100)]),
                scenario("4w", vec![run(0, 950, 110), run(1, 970, 100)]),
                scenario(
                    "4l",
                    vec![costlier(run(0, 900, 120)), costlier(run(1, 880, 120))],
                ),
                scenario("5", vec![run(0, 900, 100), run(1, 900, 100)]),
            ],
            ..Report::default()
        };
        let c = report.algorithms();
        let ids: Vec<(&str, &str, usize)> = c
            .iter()
            .map(|c| (c.id.as_str(), c.algorithm.as_str(), c.rounds))
            .collect();
        assert_eq!(
            ids,
            vec![
                ("4f", "fixed_window", 2),
                ("4w", "sliding_window", 2),
                ("4l", "sliding_log", 2)
            ]
        );
        let (f, w, l) = (&c[0], &c[1], &c[2]);
        // Per-round ratios 0.99 and 1.01; 0.95 and 0.97; 0.90 and 0.88.
        assert!((f.rps.unwrap_or(0.0) - 1.0).abs() < 1e-9, "{f:?}");
        assert!((w.rps.unwrap_or(0.0) - 0.96).abs() < 1e-9, "{w:?}");
        assert!((l.rps.unwrap_or(0.0) - 0.89).abs() < 1e-9, "{l:?}");
        assert_eq!(l.rps_per_round.len(), 2);
        assert!((w.p99.unwrap_or(0.0) - 1.05).abs() < 1e-9, "{w:?}");
        assert_eq!(f.envoy_cpu, Some(1.0));
        assert!((l.envoy_cpu.unwrap_or(0.0) - 1.2).abs() < 1e-9, "{l:?}");
        assert!(!c.iter().any(AlgorithmComparison::denied_any));
        // Only the log is set against the hottest tenant: 1 / H(100) of 890 req/s, per 50 ms.
        assert_eq!((f.hottest_share, w.hottest_per_window), (None, None));
        let share = l.hottest_share.unwrap_or(0.0);
        assert!((share - 0.1928).abs() < 1e-3, "{share}");
        let sent = l.hottest_per_window.unwrap_or(0.0);
        assert!((sent - share * 890.0 * 0.05).abs() < 1e-9, "{sent}");

        let md = report.markdown();
        assert!(
            md.contains("| 4f |") && md.contains("| 4w |") && md.contains("| 4l |"),
            "{md}"
        );
        assert!(
            md.contains(
                "- S4f (S4 counted by `fixed_window` instead of the token bucket, no burst) \
                 relative to S4, measured in the same 2 rounds: req/s 1.00 (per round: 0.99, \
                 1.01), p50 –, p99 1.00, Envoy CPU per request 1.00. Nothing was denied: the \
                 filter denied 0 of 2000 decided requests (warm-up included), 0 measured \
                 responses were not 200.\n"
            ),
            "{md}"
        );
        assert!(
            md.contains("- S4w (S4 counted by `sliding_window` instead of the token bucket"),
            "{md}"
        );
        assert!(
            md.contains(
                "req/s 0.89 (per round: 0.90, 0.88), p50 –, p99 1.20, Envoy CPU per request \
                 1.20. The log keeps at most 256 entries per 50ms window: the hottest tenant \
                 (19.3 % of the requests) sent about 9 per window at S4l's median req/s, and \
                 would fill it only past 26559 req/s in all. Nothing was denied"
            ),
            "{md}"
        );
        // Envoy CPU next to S3's lists them too.
        assert!(
            md.contains("S4 1.00, S5 1.00, S4f 1.00, S4w 1.00, S4l 1.20."),
            "{md}"
        );
        // No target of their own: the ratios are reported, not judged.
        assert!(!report.targets().iter().any(|t| t.0.contains("S4f")));
        let json = report.json();
        assert_eq!(json["algorithms"].as_array().map(Vec::len), Some(3));
        assert_eq!(json["algorithms"][0]["id"], "4f");
        assert_eq!(json["algorithms"][2]["algorithm"], "sliding_log");
        assert_eq!(json["algorithms"][2]["denied_any"], false);
        assert_eq!(json["algorithms"][2]["envoy_cpu_ratio_to_s4"], 1.2);
        assert_eq!(
            json["scenarios"][3]["ratio_to_s4"],
            json["algorithms"][1]["rps_ratio_to_s4"]
        );
        assert!(json["algorithms"][0]["hottest_tenant_share"].is_null());

        // A log that denied says so in its line (the filter's count and wrk's), and so does a
        // window that should never have.
        for sc in report.scenarios.iter_mut() {
            match sc.id.as_str() {
                "4l" => sc.counters = vec![("decided".into(), 2000), ("denied".into(), 5)],
                "4f" => sc.runs[1].measured.non_2xx = 3,
                _ => {}
            }
        }
        let md = report.markdown();
        assert!(
            md.contains(
                "**Denials: the filter denied 5 of 2000 decided requests (warm-up included), 0 \
                 measured responses were not 200. At this load the hottest tenant sent more than \
                 256 per 50ms (the most a sliding log holds), so these ratios are of a run that \
                 denied, not of a never-denying one.**"
            ),
            "{md}"
        );
        assert!(
            md.contains(
                "**Denials: the filter denied 0 of 2000 decided requests (warm-up included), 3 \
                 measured responses were not 200, though the policy admits 10⁹ per 1 s window"
            ),
            "{md}"
        );
        // 4w denied nothing: its line is unchanged.
        assert!(
            md.contains(
                "Envoy CPU per request 1.00. Nothing was denied: the filter denied 0 of 2000 \
                 decided requests (warm-up included), 0 measured responses were not 200.\n- S4l"
            ),
            "{md}"
        );
        assert_eq!(report.json()["algorithms"][2]["denied"], 5);
        report.scenarios.retain(|s| s.id != "4");
        assert_eq!(report.algorithms(), Vec::new());
    }

    #[test]
    fn settlement_is_compared_with_its_base_in_the_same_rounds() {
        let counters = |settled: u64, limiter: u64| {
            vec![
                ("decided".into(), 1000),
                ("units_reserved".into(), 10_000),
                ("units_settled".into(), settled),
                ("units_refunded".into(), 9000),
                ("units_debt".into(), 0),
                ("usage_missing".into(), 0),
                ("limiter_units_settled".into(), limiter),
            ]
        };
        let scenario = |id: &str, runs: Vec<Run>, counters: Vec<(String, u64)>| Scenario {
            id: id.into(),
            runs,
            counters,
            ..Scenario::default()
        };
        // 5 and 5s have a limiter and Redis (Redis calls, backend CPU); 4 and 4s do not.
        let global = |mut r: Run| {
            r.redis = Some((10, 80));
            r.backend_cpu_s = Some(r.measured.requests as f64 * 1e-6);
            r
        };
        let mut report = Report {
            scenarios: vec![
                scenario("3", vec![run(0, 1000, 100), run(1, 1000, 100)], vec![]),
                scenario("4", vec![run(0, 1000, 100), run(1, 1000, 100)], vec![]),
                scenario(
                    "4s",
                    vec![run(0, 950, 110), run(1, 970, 100)],
                    counters(1000, 0),
                ),
                scenario(
                    "5",
                    vec![global(run(0, 1000, 100)), global(run(1, 800, 100))],
                    vec![],
                ),
                scenario(
                    "5s",
                    vec![global(run(0, 800, 120)), global(run(1, 680, 120))],
                    counters(1000, 990),
                ),
            ],
            ..Report::default()
        };
        let c = report.settlements();
        assert_eq!(c.len(), 2);
        let (s4, s5) = (&c[0], &c[1]);
        assert_eq!(
            (s4.id.as_str(), s4.base.as_str(), s4.rounds),
            ("4s", "4", 2)
        );
        // Per-round ratios 0.95 and 0.97: the median of two is their mean.
        assert!((s4.rps.unwrap_or(0.0) - 0.96).abs() < 1e-9, "{s4:?}");
        assert_eq!(s4.rps_per_round.len(), 2);
        assert!((s4.p99.unwrap_or(0.0) - 1.05).abs() < 1e-9, "{s4:?}");
        assert_eq!(s4.envoy_cpu, Some(1.0));
        assert_eq!(s4.backend_cpu, None);
        assert_eq!(s4.limiter_settled, None);
        assert!(s4.settled_any());
        // 0.8 and 0.85.
        assert!((s5.rps.unwrap_or(0.0) - 0.825).abs() < 1e-9, "{s5:?}");
        assert_eq!(s5.backend_cpu, Some(1.0));
        assert_eq!(s5.limiter_settled, Some(990));
        let md = report.markdown();
        assert!(md.contains("| 4s |") && md.contains("| 5s |"), "{md}");
        assert!(
            md.contains("- S4s (S4 + settlement: the route's cost reserved"),
            "{md}"
        );
        assert!(
            md.contains(
                "relative to S4, measured in the same 2 rounds: req/s 0.96 (per round: 0.95, 0.97)"
            ),
            "{md}"
        );
        assert!(
            md.contains("The filter settled 1000 units for 1000 decided requests"),
            "{md}"
        );
        assert!(
            md.contains("per request 10.0 reserved, 1.0 settled, 9.0 refunded"),
            "{md}"
        );
        assert!(
            md.contains("limiter + Redis CPU per request 1.00. The filter settled"),
            "{md}"
        );
        assert!(
            md.contains("the limiter was told of 990 settled units"),
            "{md}"
        );
        assert!(md.contains("S5 1.00, S4s 1.00, S5s 1.00."), "{md}");
        assert!(
            md.contains("| S4s ≥ 0.9 × S4 (req/s) | 0.960 | met |"),
            "{md}"
        );
        assert!(
            md.contains("| S5s ≥ 0.9 × S5 (req/s) | 0.825 | **missed** |"),
            "{md}"
        );
        assert!(!md.contains("No units settled"), "{md}");
        let json = report.json();
        assert_eq!(json["settlement"][0]["id"], "4s");
        assert_eq!(json["settlement"][1]["units_settled"], 1000);
        assert_eq!(json["settlement"][1]["limiter_units_settled"], 990);
        assert_eq!(
            json["scenarios"][4]["ratio_to_s5"],
            json["settlement"][1]["rps_ratio_to_base"]
        );

        // A run whose filter settled nothing says so, and its target is not met.
        if let Some(sc) = report.scenarios.iter_mut().find(|s| s.id == "4s") {
            sc.counters = counters(0, 0);
        }
        let md = report.markdown();
        assert!(
            md.contains(
                "**No units settled (`tollgate_units_settled` is 0): settlement did not happen"
            ),
            "{md}"
        );
        assert!(
            md.contains("| S4s ≥ 0.9 × S4 (req/s) | 0.960 (no units settled: settlement did not happen) | not measured |"),
            "{md}"
        );
        assert_eq!(report.json()["settlement"][0]["settled_any"], false);
        report.scenarios.retain(|s| s.id != "5");
        assert_eq!(report.settlements().len(), 1);
    }

    #[test]
    fn the_ratelimit_service_is_compared_with_s5_and_s6_in_the_same_rounds() {
        // `backend_us` µs of limiter + Redis CPU and `fcalls` Redis calls per request.
        let at = |round: u32, requests: u64, p99_us: u64, backend_us: f64| Run {
            backend_cpu_s: Some(requests as f64 * backend_us * 1e-6),
            redis: Some((requests, requests * 4)),
            ..run(round, requests, p99_us)
        };
        let scenario = |id: &str, runs: Vec<Run>| Scenario {
            id: id.into(),
            title: format!("scenario {id}"),
            runs,
            ..Scenario::default()
        };
        let s8 = Scenario {
            counters: vec![
                ("allowed".into(), 5_000),
                ("denied".into(), 0),
                ("rls_errors".into(), 0),
                ("decided".into(), 5_000),
                ("limiter_rls_calls".into(), 5_000),
                ("limiter_connections".into(), 1),
            ],
            ..scenario("8", vec![at(0, 400, 2_000, 45.0), at(1, 500, 2_000, 45.0)])
        };
        let mut report = Report {
            scenarios: vec![
                scenario("5", vec![at(0, 1000, 1_000, 1.0), at(1, 1200, 1_000, 1.0)]),
                scenario("6", vec![at(0, 500, 1_600, 50.0), at(1, 500, 2_000, 50.0)]),
                s8,
            ],
            ..Report::default()
        };
        let r = report.rls().unwrap_or_default();
        assert_eq!((r.rounds_with_s5, r.rounds_with_s6), (2, 2));
        // S5 / S8 per round: 2.5 and 2.4; the median of two is their mean.
        assert!((r.s5_to_s8.unwrap_or(0.0) - 2.45).abs() < 1e-9, "{r:?}");
        assert_eq!(r.s5_to_s8_per_round.len(), 2);
        assert!(
            (r.backend_cpu_to_s6.unwrap_or(0.0) - 0.9).abs() < 1e-9,
            "{r:?}"
        );
        assert!((r.backend_us.unwrap_or(0.0) - 45.0).abs() < 1e-9, "{r:?}");
        assert!(
            (r.s6_backend_us.unwrap_or(0.0) - 50.0).abs() < 1e-9,
            "{r:?}"
        );
        assert_eq!((r.ok, r.errors, r.limiter_calls), (5_000, 0, 5_000));
        let md = report.markdown();
        // A row in the table, beside 5 and 6, with its Redis calls and backend CPU.
        assert!(
            md.contains("| 8 | scenario 8 | 450 | – | – | 0.00 | 2.00 | "),
            "{md}"
        );
        assert!(md.contains(" | 45.0 | 1000.0 · 4000.0 | "), "{md}");
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| ")).collect();
        let row = |id: &str| {
            rows.iter()
                .position(|l| l.starts_with(&format!("| {id} |")))
        };
        assert!(row("6") < row("8"), "{md}");
        assert!(
            md.contains("- S5 / S8 = 2.45 in req/s (per round: 2.50, 2.40; 2 rounds)"),
            "{md}"
        );
        assert!(
            md.contains("S8's limiter + Redis CPU per decision 45.0 µs against S6's 50.0 µs"),
            "{md}"
        );
        assert!(!md.contains("let through undecided"), "{md}");
        assert!(
            md.contains(
                "| S8 limiter + Redis CPU per decision ≤ S6's | 0.900 (S8 45.0 µs, S6 50.0 µs) | met |"
            ),
            "{md}"
        );
        let json = report.json();
        assert_eq!(json["rls"]["rounds_with_s5"], 2);
        assert_eq!(
            json["rls"]["s5_rps_ratio_to_s8"],
            json["scenarios"][0]["ratio_to_s8"]
        );
        assert_eq!(json["scenarios"][2]["id"], "8");
        assert_eq!(json["scenarios"][2]["redis_fcall_per_1k"], 1000.0);
        let backend = json["scenarios"][2]["limiter_and_redis_cpu_us_per_request"].as_f64();
        assert!((backend.unwrap_or(0.0) - 45.0).abs() < 1e-9, "{backend:?}");
        let target = json["targets"]
            .as_array()
            .and_then(|t| {
                t.iter()
                    .find(|t| t["target"] == "S8 limiter + Redis CPU per decision ≤ S6's")
            })
            .cloned()
            .unwrap_or_default();
        assert_eq!(target["met"], true, "{target}");

        // Costlier than S6 per decision: missed; failed calls are called out.
        if let Some(s8) = report.scenarios.iter_mut().find(|s| s.id == "8") {
            for r in &mut s8.runs {
                r.backend_cpu_s = Some(r.measured.requests as f64 * 60e-6);
            }
            s8.counters.push(("rls_errors".into(), 7));
            s8.counters.retain(|(n, v)| n != "rls_errors" || *v == 7);
            s8.counters.push(("rls_errors_before_rounds".into(), 4));
        }
        let md = report.markdown();
        assert!(
            md.contains(
                "| S8 limiter + Redis CPU per decision ≤ S6's | 1.200 (S8 60.0 µs, S6 50.0 µs) | **missed** |"
            ),
            "{md}"
        );
        assert!(
            md.contains("7 calls failed; the limiter answered 5000 calls"),
            "{md}"
        );
        assert!(
            md.contains("**3 calls in the measured rounds failed and were let through undecided"),
            "{md}"
        );
        // All of them in the warm-up: said, not flagged.
        if let Some(s8) = report.scenarios.iter_mut().find(|s| s.id == "8") {
            s8.counters.retain(|(n, _)| n != "rls_errors_before_rounds");
            s8.counters.push(("rls_errors_before_rounds".into(), 7));
        }
        let md = report.markdown();
        assert!(
            md.contains("The 7 failed calls were all in the warm-up, none in the measured rounds."),
            "{md}"
        );
        assert!(!md.contains("let through undecided"), "{md}");

        // Without S6 the target is not measured; without 5 and 6 there is no comparison.
        report.scenarios.retain(|s| s.id != "6");
        let md = report.markdown();
        assert!(
            md.contains("| S8 limiter + Redis CPU per decision ≤ S6's | n/a | not measured |"),
            "{md}"
        );
        assert!(md.contains("- S5 / S8 = "), "{md}");
        report.scenarios.retain(|s| s.id != "5");
        assert_eq!(report.rls(), None);
        assert!(report.json()["rls"].is_null());
        assert!(!report.markdown().contains("- S5 / S8"));
    }

    #[test]
    fn mutual_tls_is_compared_with_s5_in_the_same_rounds() {
        let scenario = |id: &str, runs: Vec<Run>| Scenario {
            id: id.into(),
            runs,
            counters: vec![
                ("limiter_tls_handshakes".into(), 2),
                ("limiter_connections".into(), 2),
            ],
            ..Scenario::default()
        };
        let mut report = Report {
            scenarios: vec![
                scenario("4", vec![run(0, 1000, 100), run(1, 1000, 100)]),
                scenario("5", vec![run(0, 1000, 100), run(1, 800, 100)]),
                scenario("5t", vec![run(0, 900, 110), run(1, 780, 120)]),
            ],
            ..Report::default()
        };
        let m = report.mtls().unwrap_or_default();
        assert_eq!(m.rounds, 2);
        // Per-round ratios 0.9 and 0.975: the median of two is their mean.
        assert!((m.rps.unwrap_or(0.0) - 0.9375).abs() < 1e-9, "{m:?}");
        assert_eq!(m.rps_per_round.len(), 2);
        assert!((m.p99.unwrap_or(0.0) - 1.15).abs() < 1e-9, "{m:?}");
        assert_eq!(m.envoy_cpu, Some(1.0));
        assert_eq!(m.backend_cpu, None);
        assert!((m.s5t_to_s4.unwrap_or(0.0) - 0.84).abs() < 1e-9, "{m:?}");
        assert_eq!(m.handshakes, 2);
        let md = report.markdown();
        assert!(md.contains("| 5t |"), "{md}");
        assert!(md.contains("S5t (the limiter behind mutual TLS"), "{md}");
        assert!(md.contains("req/s 0.94 (per round: 0.90, 0.97)"), "{md}");
        assert!(md.contains("2 TLS handshakes"), "{md}");
        let json = report.json();
        assert_eq!(json["mtls"]["rounds"], 2);
        assert_eq!(
            json["scenarios"][2]["ratio_to_s5"],
            json["mtls"]["rps_ratio_to_s5"]
        );
        assert!(json["scenarios"][1]["ratio_to_s5"].is_null());
        report.scenarios.retain(|s| s.id != "5t");
        assert_eq!(report.mtls(), None);
        assert!(report.json()["mtls"].is_null());
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

    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[7], 0.99), Some(7));
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.50), Some(50));
        assert_eq!(percentile(&v, 0.99), Some(99));
        assert_eq!(percentile(&v, 1.0), Some(100));
        assert_eq!(percentile(&v, 0.0), Some(1));
        let l = Latency::of(vec![300, 100, 200]);
        assert_eq!((l.count, l.p50_us, l.p99_us), (3, Some(200), Some(300)));
        assert_eq!(l.cell(), "0.20 · 0.30");
        assert_eq!(Latency::of(Vec::new()).cell(), "–");
    }

    fn variant(
        round: u32,
        name: &str,
        calls_after_1s: (u64, u64),
        admitted: (u64, u64),
    ) -> OverLimitRun {
        OverLimitRun {
            round,
            variant: name.into(),
            seconds: 9.0,
            tenants: 4,
            rate: 50,
            burst: 10,
            demanded: 18_000,
            // 4 keys × (50 × 9 + 10) = 1840 allowed; 1800 admitted.
            admitted: (0..4).map(|k| (format!("k{k}"), 450)).collect(),
            instances: [
                InstanceRun {
                    offered_steady: 10_500,
                    admitted_steady: admitted.0,
                    lease_calls: calls_after_1s.0 + 30,
                    lease_calls_after_1s: calls_after_1s.0,
                    ..InstanceRun::default()
                },
                InstanceRun {
                    offered_steady: 3_500,
                    admitted_steady: admitted.1,
                    lease_calls: calls_after_1s.1 + 20,
                    lease_calls_after_1s: calls_after_1s.1,
                    ..InstanceRun::default()
                },
            ],
            redis: Some((450, 4000)),
            ..OverLimitRun::default()
        }
    }

    #[test]
    fn over_limit_rates_per_key_and_split() {
        let r = variant(0, "10× 3:1", (64, 32), (1050, 330));
        // 4 keys × 8 s after the first second.
        let [a, b] = r.lease_calls_per_key_instance_s();
        assert!((a.unwrap_or(0.0) - 2.0).abs() < 1e-9);
        assert!((b.unwrap_or(0.0) - 1.0).abs() < 1e-9);
        assert_eq!(r.worst_lease_calls_per_key_instance_s(), a);
        assert_eq!(r.lease_calls(), 146);
        assert!((r.lease_calls_per_s().unwrap_or(0.0) - 146.0 / 9.0).abs() < 1e-9);
        assert!((r.lease_calls_per_offered().unwrap_or(0.0) - 146.0 / 18_000.0).abs() < 1e-12);
        assert!((r.fcalls_per_s().unwrap_or(0.0) - 50.0).abs() < 1e-9);
        assert!((r.fcalls_per_offered().unwrap_or(0.0) - 0.025).abs() < 1e-12);
        assert!((r.demand_split().unwrap_or(0.0) - 3.0).abs() < 1e-9);
        assert!((r.admitted_split().unwrap_or(0.0) - 1050.0 / 330.0).abs() < 1e-9);
        let err = r.split_error_pct().unwrap_or(0.0);
        assert!(
            (err - (1050.0 / 330.0 / 3.0 - 1.0) * 100.0).abs() < 1e-9,
            "{err}"
        );
        // Nothing admitted by B: no split, no per-key rate for a run of one second.
        let none = OverLimitRun {
            seconds: 1.0,
            ..variant(0, "x", (1, 1), (10, 0))
        };
        assert_eq!(none.admitted_split(), None);
        assert_eq!(none.split_error_pct(), None);
        assert_eq!(none.lease_calls_per_key_instance_s(), [None, None]);
        assert_eq!(none.worst_lease_calls_per_key_instance_s(), None);
        assert_eq!(OverLimitRun::default().fcalls_per_s(), None);
    }

    #[test]
    fn over_limit_targets_judge_every_variant_on_its_worst_round() {
        let report = Report {
            over_limit: vec![
                variant(0, "3× even", (32, 32), (700, 700)),
                variant(0, "10× 3:1", (64, 32), (1050, 350)),
                // Round 1 of 10× 3:1: 4 calls per key per second on A and a split of 2.5.
                variant(1, "10× 3:1", (128, 32), (1000, 400)),
                variant(1, "3× even", (32, 32), (700, 700)),
            ],
            ..Report::default()
        };
        let names: Vec<&str> = report.over_limit_variants().iter().map(|v| v.0).collect();
        assert_eq!(names, vec!["3× even", "10× 3:1"]);
        let targets = report.targets();
        let find = |prefix: &str| {
            targets
                .iter()
                .find(|t| t.0.starts_with(prefix))
                .cloned()
                .unwrap_or_default()
        };
        let calls = find("S7 ≤ 3 lease calls");
        assert_eq!(calls.1, "3× even: 1.00 · 10× 3:1: 4.00");
        assert_eq!(calls.2, Some(false));
        let overshoot = find("S7 no overshoot");
        assert_eq!(overshoot.2, Some(true));
        let underuse = find("S7 under-use");
        // 1 − 1800 / 1840.
        assert_eq!(underuse.1, "3× even: 2.17 % · 10× 3:1: 2.17 %");
        assert_eq!(underuse.2, Some(true));
        let split = find("S7 admitted split");
        // Demand split 3; admitted 1.00 (−66.7 %) for 3× even, 2.5 (−16.7 %) in round 1.
        assert_eq!(split.1, "3× even: -66.7 % · 10× 3:1: -16.7 %");
        assert_eq!(split.2, Some(false));
        let md = report.markdown();
        assert!(md.contains("## Scenario 7: over the limit"), "{md}");
        assert!(md.contains("| 1 | 10× 3:1 |"), "{md}");
        assert!(
            !md.contains("| # | scenario"),
            "no table without scenarios 1–6: {md}"
        );
        let json = report.json();
        assert_eq!(json["over_limit"].as_array().map(Vec::len), Some(4));
        assert_eq!(
            json["over_limit"][1]["lease_calls_per_key_per_instance_s_after_1s"][0],
            2.0
        );
    }

    /// A value that varies with `seed` and `salt` (a fixed stream, no randomness).
    fn mix(seed: u64, salt: u64) -> u64 {
        let mut x = seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(salt.wrapping_mul(0xBF58_476D_1CE4_E5B9));
        x ^= x >> 31;
        x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 29)
    }

    /// A scenario of `rounds` runs whose numbers follow from `seed`; `cpu` and `redis` say
    /// whether those were measured.
    fn fixed_scenario(id: &str, seed: u64, rounds: u32, cpu: bool, redis: bool) -> Scenario {
        let runs = (0..rounds)
            .map(|round| {
                let m = |salt: u64| mix(seed, u64::from(round) * 100 + salt);
                let requests = 50_000 + m(1) % 20_000;
                Run {
                    round,
                    measured: Measured {
                        requests,
                        seconds: 5.0 + (m(2) % 100) as f64 / 1000.0,
                        non_2xx: if seed % 7 == 3 { m(3) % 5 } else { 0 },
                        socket_errors: if seed % 11 == 4 { m(4) % 3 } else { 0 },
                        p50_us: 900 + m(5) % 400,
                        p90_us: 1500 + m(6) % 500,
                        p99_us: 2500 + m(7) % 1500,
                        mean_us: 1000.0 + (m(8) % 1000) as f64 / 7.0,
                    },
                    redis: redis.then(|| (requests / 60 + m(9) % 50, requests / 20 + m(10) % 90)),
                    envoy_cpu_s: cpu
                        .then(|| requests as f64 * (12.0 + (m(11) % 80) as f64 / 10.0) * 1e-6),
                    backend_cpu_s: (cpu && redis)
                        .then(|| requests as f64 * (3.0 + (m(12) % 40) as f64 / 10.0) * 1e-6),
                }
            })
            .collect();
        Scenario {
            id: id.into(),
            title: format!("scenario {id}"),
            runs,
            envoy_peak_rss: cpu.then(|| 40 * 1024 * 1024 + mix(seed, 13) % (8 * 1024 * 1024)),
            limiter_peak_rss: redis.then(|| 12 * 1024 * 1024 + mix(seed, 14) % (4 * 1024 * 1024)),
            counters: Vec::new(),
        }
    }

    fn with_counters(mut sc: Scenario, counters: &[(&str, u64)]) -> Scenario {
        sc.counters = counters.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        sc
    }

    fn fixed_over_limit(round: u32, name: &str, seed: u64) -> OverLimitRun {
        let m = |salt: u64| mix(seed, u64::from(round) * 100 + salt);
        let instance = |salt: u64| InstanceRun {
            offered: 9_000 + m(salt) % 900,
            admitted: 900 + m(salt + 1) % 90,
            denied: 8_000 + m(salt + 2) % 800,
            other: m(salt + 3) % 3,
            offered_steady: 7_000 + m(salt + 4) % 700,
            admitted_steady: 700 + m(salt + 5) % 70,
            lease_calls: 200 + m(salt + 6) % 40,
            lease_calls_after_1s: 150 + m(salt + 7) % 40,
            assignments: m(salt + 8) % 20,
            per_second: (0..3)
                .map(|s| crate::paced::Second {
                    offered: 3_000 + m(salt + 10 + s) % 300,
                    admitted: 300 + m(salt + 20 + s) % 30,
                    denied: 2_700 + m(salt + 30 + s) % 270,
                })
                .collect(),
        };
        let samples = |salt: u64| (0..40).map(|i| 500 + m(salt + i) % 4_000).collect();
        OverLimitRun {
            round,
            variant: name.into(),
            multiple: 10.0,
            split: (3, 1),
            seconds: 8.0 + (m(1) % 50) as f64 / 1000.0,
            warmup_s: 2.0,
            tenants: 4,
            rate: 50,
            burst: 10,
            demanded: 18_000 + m(2) % 1_000,
            admitted: (0..4)
                .map(|k| (format!("k{k}"), 400 + m(3 + k) % 80))
                .collect(),
            undecided: m(8) % 4,
            instances: [instance(100), instance(200)],
            retries: m(9) % 6,
            redis: (seed % 2 == 0).then(|| (400 + m(10) % 90, 3_000 + m(11) % 900)),
            admitted_latency: Latency::of(samples(300)),
            denied_latency: Latency::of(if seed % 3 == 0 {
                Vec::new()
            } else {
                samples(400)
            }),
        }
    }

    fn fixed_setup(distribution: &str) -> Setup {
        Setup {
            date: "2026-01-02 03:04 UTC".into(),
            commit: "abc1234".into(),
            machine: "2 cores, test machine".into(),
            envoy: "envoy 1.2.3".into(),
            concurrency: 1,
            wrk_threads: 1,
            connections: 64,
            seconds: 5.0,
            rounds: 3,
            tenants: 100,
            distribution: distribution.into(),
        }
    }

    /// Reports that reach every table and note, each in the forms it can take.
    fn fixed_reports() -> Vec<(&'static str, Report)> {
        let full = Report {
            setup: fixed_setup("zipf"),
            scenarios: vec![
                fixed_scenario("1", 1, 3, true, false),
                fixed_scenario("2", 2, 3, true, false),
                fixed_scenario("3", 3, 3, true, false),
                with_counters(
                    fixed_scenario("4", 4, 3, true, false),
                    &[("decided", 150_000), ("denied", 0)],
                ),
                with_counters(
                    fixed_scenario("5", 5, 3, true, true),
                    &[
                        ("lease_requests", 2_100),
                        ("decided", 160_000),
                        ("denied", 3),
                        ("undecided", 2),
                    ],
                ),
                with_counters(
                    fixed_scenario("6", 6, 3, true, true),
                    &[("lease_requests", 150_000), ("decided", 150_000)],
                ),
                with_counters(
                    fixed_scenario("4s", 7, 3, true, false),
                    &[
                        ("decided", 140_000),
                        ("units_reserved", 700_000),
                        ("units_settled", 420_000),
                        ("units_refunded", 280_000),
                        ("units_debt", 12),
                        ("usage_missing", 1),
                    ],
                ),
                with_counters(
                    fixed_scenario("5s", 8, 2, true, true),
                    &[
                        ("decided", 120_000),
                        ("units_reserved", 600_000),
                        ("limiter_units_settled", 5),
                    ],
                ),
                with_counters(
                    fixed_scenario("5t", 9, 3, true, true),
                    &[("limiter_tls_handshakes", 2), ("limiter_connections", 2)],
                ),
                with_counters(
                    fixed_scenario("4f", 10, 3, true, false),
                    &[("decided", 150_000)],
                ),
                with_counters(
                    fixed_scenario("4w", 11, 3, true, false),
                    &[("decided", 150_000), ("denied", 4)],
                ),
                with_counters(
                    fixed_scenario("4l", 12, 3, true, false),
                    &[("decided", 150_000), ("denied", 40)],
                ),
                with_counters(
                    fixed_scenario("8", 13, 3, true, true),
                    &[
                        ("allowed", 140_000),
                        ("denied", 1_000),
                        ("rls_errors", 7),
                        ("rls_errors_before_rounds", 2),
                        ("limiter_rls_calls", 141_000),
                        ("limiter_connections", 1),
                    ],
                ),
                fixed_scenario("1u", 14, 3, true, false),
                fixed_scenario("5u", 15, 3, true, true),
                fixed_scenario("3n", 16, 3, true, false),
                fixed_scenario("4n", 17, 3, true, false),
                fixed_scenario("5n", 18, 2, true, true),
            ],
            over_limit: vec![
                fixed_over_limit(0, "3× even", 20),
                fixed_over_limit(0, "10× 3:1", 21),
                fixed_over_limit(1, "3× even", 22),
                fixed_over_limit(1, "10× 3:1", 23),
            ],
        };
        let sparse = Report {
            setup: fixed_setup("uniform"),
            scenarios: vec![
                fixed_scenario("1", 31, 2, true, false),
                fixed_scenario("3", 33, 2, false, false),
                fixed_scenario("5", 35, 2, false, true),
                with_counters(
                    fixed_scenario("8", 38, 1, true, true),
                    &[
                        ("rls_errors", 3),
                        ("rls_errors_before_rounds", 3),
                        ("limiter_connections", 4),
                    ],
                ),
                with_counters(
                    fixed_scenario("5t", 39, 1, true, true),
                    &[("limiter_tls_handshakes", 1), ("limiter_connections", 1)],
                ),
                fixed_scenario("4", 34, 2, true, false),
                with_counters(fixed_scenario("4l", 40, 2, true, false), &[("decided", 9)]),
                fixed_scenario("3n", 41, 2, false, false),
            ],
            over_limit: Vec::new(),
        };
        let only_over_limit = Report {
            setup: fixed_setup("zipf"),
            scenarios: Vec::new(),
            over_limit: vec![
                fixed_over_limit(0, "30× 1:1", 51),
                fixed_over_limit(0, "3× 9:1", 54),
            ],
        };
        vec![
            ("full", full),
            ("sparse", sparse),
            ("only_over_limit", only_over_limit),
        ]
    }

    /// The markdown and JSON of fixed reports are those stored in `report/testdata/`: a change
    /// of the report's code that changes its output shows here. `TOLLGATE_BENCH_BLESS=1` writes
    /// the files anew (after a change meant to change the output).
    #[test]
    fn rendering_of_fixed_reports_is_unchanged() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/report/testdata");
        let bless = std::env::var_os("TOLLGATE_BENCH_BLESS").is_some();
        for (name, report) in fixed_reports() {
            let rendered = [
                (format!("{name}.md"), report.markdown()),
                (
                    format!("{name}.json"),
                    serde_json::to_string_pretty(&report.json()).unwrap_or_default() + "\n",
                ),
            ];
            for (file, text) in rendered {
                let path = dir.join(&file);
                if bless {
                    std::fs::create_dir_all(&dir).unwrap();
                    std::fs::write(&path, &text).unwrap();
                }
                let stored = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert!(stored == text, "{file} differs from the stored rendering");
            }
        }
    }
}
