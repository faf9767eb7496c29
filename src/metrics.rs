//! The filter's counters, as proxy-wasm metrics. Envoy shows them as `wasmcustom.<name>`; names
//! follow `tollgate_<what>.policy.<policy name>` so the bootstrap's `stats_tags` entry
//! (see `envoy/*.yaml`) turns the policy into a Prometheus label:
//! `tollgate_allowed{policy="payments-per-tenant"}`. Label values are policy names, never
//! tenants.

use crate::engine::{Evaluation, Outcome};
use crate::table::TableError;
use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use tollgate_core::policy::Policies;

#[derive(Debug, Clone, Default)]
struct PolicyCounters {
    allowed: Option<u32>,
    denied: Option<u32>,
    shadow_denied: Option<u32>,
    identity_missing: Option<u32>,
    fail_open: Option<u32>,
    fail_closed: Option<u32>,
}

/// Metric ids of one VM (ids are per VM; the stats they name are shared by all workers).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    policies: Vec<PolicyCounters>,
    table_full: Option<u32>,
    table_contended: Option<u32>,
    table_host_error: Option<u32>,
    table_evictions: Option<u32>,
}

fn counter(name: &str) -> Option<u32> {
    match hostcalls::define_metric(MetricType::Counter, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("tollgate: cannot define metric {name}: {status:?}");
            None
        }
    }
}

fn bump(id: Option<u32>, by: u32) {
    if let (Some(id), true) = (id, by > 0) {
        let _ = hostcalls::increment_metric(id, i64::from(by));
    }
}

impl Metrics {
    /// Defines every counter (idempotent by name across VMs).
    pub fn define(policies: &Policies) -> Self {
        let per = |what: &str, policy: &str| counter(&format!("tollgate_{what}.policy.{policy}"));
        Self {
            policies: policies
                .policies
                .iter()
                .map(|p| PolicyCounters {
                    allowed: per("allowed", &p.name),
                    denied: per("denied", &p.name),
                    shadow_denied: per("shadow_denied", &p.name),
                    identity_missing: per("identity_missing", &p.name),
                    fail_open: per("fail_open", &p.name),
                    fail_closed: per("fail_closed", &p.name),
                })
                .collect(),
            table_full: counter("tollgate_local_table_full"),
            table_contended: counter("tollgate_local_table_contended"),
            table_host_error: counter("tollgate_local_table_host_error"),
            table_evictions: counter("tollgate_local_table_evictions"),
        }
    }

    pub fn record(&self, evaluation: &Evaluation) {
        for (index, outcome) in &evaluation.outcomes {
            let Some(c) = self.policies.get(*index) else {
                continue;
            };
            let id = match outcome {
                Outcome::Allowed => c.allowed,
                Outcome::Denied => c.denied,
                Outcome::ShadowDenied => c.shadow_denied,
                Outcome::IdentityMissing => c.identity_missing,
                Outcome::FailOpen => c.fail_open,
                Outcome::FailClosed => c.fail_closed,
            };
            bump(id, 1);
        }
        match evaluation.table_error {
            Some(TableError::Full) => bump(self.table_full, 1),
            Some(TableError::Contended) => bump(self.table_contended, 1),
            Some(TableError::Host) => bump(self.table_host_error, 1),
            None => {}
        }
        bump(self.table_evictions, evaluation.evictions);
    }
}
