//! Scenario 7, over the limit: one variant's run in one round (two instances, paced demand
//! per key) and what is judged of it (admitted against allowed, lease and Redis calls, the
//! split between the instances).

use super::measure::{ratio, Latency};
use super::Report;

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

impl Report {
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
}
