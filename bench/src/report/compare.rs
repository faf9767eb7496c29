//! Scenarios compared with each other: ratios of runs made in the same rounds (medians of
//! per-round ratios), and the comparisons the notes and the JSON report (mutual TLS, the
//! RateLimitService, settlement, windowed algorithms, the native build).

use super::measure::{median, Run};
use super::Report;
use crate::wrk::Measured;

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

impl Report {
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
}
