//! The filter's metrics, as proxy-wasm metrics (Envoy shows them as `wasmcustom.<name>`) or, in
//! the native build, as the dynamic module's Envoy stats. Names
//! follow `tollgate_<what>.policy.<policy name>` so the bootstrap's `stats_tags` entry
//! (see `envoy/*.yaml`) turns the policy into a Prometheus label:
//! `tollgate_allowed{policy="payments-per-tenant"}`. Label values are policy names, never
//! tenants.

use crate::engine::{Decision, Outcome, Settlement};
use crate::table::TableError;
use tollgate_core::policy::Policies;

/// What kind of stat a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

/// Where metrics go: the sink the host installed (the proxy-wasm host's metrics, or the dynamic
/// module's Envoy stats), else a per-thread registry that unit tests read.
pub mod sink {
    use super::MetricType;
    use std::cell::RefCell;
    use std::sync::OnceLock;

    /// A host's stats: ids come from `define` and are the host's own.
    pub trait Sink: Send + Sync {
        fn define(&self, kind: MetricType, name: &str) -> Result<u32, String>;
        /// Adds `by` to a counter or gauge (negative: a gauge goes down).
        fn increment(&self, id: u32, by: i64);
        fn record(&self, id: u32, value: u64);
    }

    static HOST: OnceLock<&'static dyn Sink> = OnceLock::new();

    /// Sends every metric of this process to `sink` from now on; `false` if one is set already.
    pub fn install(sink: &'static dyn Sink) -> bool {
        HOST.set(sink).is_ok()
    }

    thread_local! {
        static METRICS: RefCell<Vec<(String, u64)>> = const { RefCell::new(Vec::new()) };
    }

    pub fn define(kind: MetricType, name: &str) -> Result<u32, String> {
        if let Some(host) = HOST.get() {
            return host.define(kind, name);
        }
        METRICS.with(|m| {
            let mut m = m.borrow_mut();
            let id = match m.iter().position(|(n, _)| n == name) {
                Some(id) => id,
                None => {
                    m.push((name.to_string(), 0));
                    m.len() - 1
                }
            };
            u32::try_from(id).map_err(|e| e.to_string())
        })
    }

    pub fn increment(id: u32, by: i64) {
        if let Some(host) = HOST.get() {
            return host.increment(id, by);
        }
        METRICS.with(|m| {
            if let Some((_, v)) = m.borrow_mut().get_mut(id as usize) {
                *v = if by >= 0 {
                    v.saturating_add(by.unsigned_abs())
                } else {
                    v.saturating_sub(by.unsigned_abs())
                };
            }
        });
    }

    pub fn record(id: u32, value: u64) {
        if let Some(host) = HOST.get() {
            return host.record(id, value);
        }
        METRICS.with(|m| {
            if let Some((_, v)) = m.borrow_mut().get_mut(id as usize) {
                *v = v.saturating_add(value);
            }
        });
    }

    /// The value of a metric on this thread (0 if never defined).
    pub fn value(name: &str) -> u64 {
        METRICS.with(|m| {
            m.borrow()
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0, |(_, v)| *v)
        })
    }
}

#[derive(Debug, Clone, Default)]
struct PolicyMetrics {
    allowed: Option<u32>,
    denied: Option<u32>,
    shadow_denied: Option<u32>,
    identity_missing: Option<u32>,
    fail_open: Option<u32>,
    fail_closed: Option<u32>,
    fallback_allowed: Option<u32>,
    fallback_denied: Option<u32>,
    lease_requests: Option<u32>,
    tokens_granted: Option<u32>,
    tokens_returned: Option<u32>,
    tokens_expired: Option<u32>,
    lease_unavailable: Option<u32>,
    invalid_policy: Option<u32>,
    assignments: Option<u32>,
    in_flight_denied: Option<u32>,
    /// Gauge: slots held on this instance.
    in_flight: Option<u32>,
    in_flight_expired: Option<u32>,
    units_reserved: Option<u32>,
    units_settled: Option<u32>,
    units_refunded: Option<u32>,
    units_debt: Option<u32>,
    units_uncharged: Option<u32>,
    usage_missing: Option<u32>,
    delayed: Option<u32>,
    tagged: Option<u32>,
}

/// Metric ids of one VM (ids are per VM; the stats they name are shared by all workers).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    policies: Vec<PolicyMetrics>,
    table_full: Option<u32>,
    table_contended: Option<u32>,
    table_host_error: Option<u32>,
    table_evictions: Option<u32>,
    callouts: Option<u32>,
    callouts_failed: Option<u32>,
    callout_ms: Option<u32>,
    version_mismatch: Option<u32>,
    waiting_deadline: Option<u32>,
    callouts_retried: Option<u32>,
    /// Hooks of the native build that panicked (caught; the request took its policies'
    /// failure mode). A panic in the wasm build ends the VM instead, so it stays 0 there.
    panics: Option<u32>,
}

fn define(kind: MetricType, name: &str) -> Option<u32> {
    match sink::define(kind, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("cannot define metric {name}: {status:?}");
            None
        }
    }
}

fn counter(name: &str) -> Option<u32> {
    define(MetricType::Counter, name)
}

/// Adds `by` to a counter. Hosts take an `i64`: an amount past `i64::MAX` (a usage value the
/// engine capped at `u64::MAX`) adds `i64::MAX`, never nothing.
fn bump(id: Option<u32>, by: u64) {
    if let Some(id) = id.filter(|_| by > 0) {
        sink::increment(id, saturating_i64(by));
    }
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn gauge(id: Option<u32>, delta: i64) {
    if let Some(id) = id {
        sink::increment(id, delta);
    }
}

/// Per-policy counters of the global stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEvent {
    Requested,
    Granted(u64),
    Returned(u64),
    Expired(u64),
    Unavailable,
    InvalidPolicy,
    /// An answer carried an assignment (a share of the rate): the key is over its limit.
    Assigned,
}

impl Metrics {
    /// Defines every metric (idempotent by name across VMs).
    pub fn define(policies: &Policies) -> Self {
        let per = |what: &str, policy: &str| counter(&format!("tollgate_{what}.policy.{policy}"));
        let per_gauge = |what: &str, policy: &str| {
            define(
                MetricType::Gauge,
                &format!("tollgate_{what}.policy.{policy}"),
            )
        };
        Self {
            policies: policies
                .policies
                .iter()
                .map(|p| PolicyMetrics {
                    allowed: per("allowed", &p.name),
                    denied: per("denied", &p.name),
                    shadow_denied: per("shadow_denied", &p.name),
                    identity_missing: per("identity_missing", &p.name),
                    fail_open: per("fail_open", &p.name),
                    fail_closed: per("fail_closed", &p.name),
                    fallback_allowed: per("fallback_allowed", &p.name),
                    fallback_denied: per("fallback_denied", &p.name),
                    lease_requests: per("lease_requests", &p.name),
                    tokens_granted: per("tokens_granted", &p.name),
                    tokens_returned: per("tokens_returned", &p.name),
                    tokens_expired: per("tokens_expired", &p.name),
                    lease_unavailable: per("lease_unavailable", &p.name),
                    invalid_policy: per("invalid_policy", &p.name),
                    assignments: per("assignments", &p.name),
                    in_flight_denied: per("in_flight_denied", &p.name),
                    in_flight: per_gauge("in_flight", &p.name),
                    in_flight_expired: per("in_flight_expired", &p.name),
                    units_reserved: per("units_reserved", &p.name),
                    units_settled: per("units_settled", &p.name),
                    units_refunded: per("units_refunded", &p.name),
                    units_debt: per("units_debt", &p.name),
                    units_uncharged: per("units_uncharged", &p.name),
                    usage_missing: per("usage_missing", &p.name),
                    delayed: per("delayed", &p.name),
                    // Defined only for the policies that can tag (a stat per policy costs
                    // Envoy memory).
                    tagged: if p.tag.is_some() {
                        per("tagged", &p.name)
                    } else {
                        None
                    },
                })
                .collect(),
            table_full: counter("tollgate_local_table_full"),
            table_contended: counter("tollgate_local_table_contended"),
            table_host_error: counter("tollgate_local_table_host_error"),
            table_evictions: counter("tollgate_local_table_evictions"),
            callouts: counter("tollgate_callouts"),
            callouts_failed: counter("tollgate_callouts_failed"),
            callout_ms: define(MetricType::Histogram, "tollgate_callout_ms"),
            version_mismatch: counter("tollgate_policy_version_mismatch"),
            waiting_deadline: counter("tollgate_wait_deadline_passed"),
            callouts_retried: counter("tollgate_callout_retries"),
            panics: counter("tollgate_panics"),
        }
    }

    /// Counts what a decision decided (not for `Wait`: the request is counted when it ends).
    pub fn record(&self, decision: &Decision) {
        for (index, outcome) in &decision.outcomes {
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
                Outcome::FallbackAllowed => c.fallback_allowed,
                Outcome::FallbackDenied => c.fallback_denied,
                Outcome::InFlightDenied => c.in_flight_denied,
                Outcome::Tagged => c.tagged,
            };
            bump(id, 1);
        }
        for admission in &decision.admissions {
            let Some(c) = self.policies.get(admission.policy) else {
                continue;
            };
            bump(c.units_reserved, admission.reserved);
            if admission.slot.is_some() {
                gauge(c.in_flight, 1);
            }
        }
        for index in &decision.delayed {
            if let Some(c) = self.policies.get(*index) {
                bump(c.delayed, 1);
            }
        }
        for (index, expired) in &decision.slots_expired {
            self.slots_expired(*index, *expired);
        }
        for (index, tokens) in &decision.expired {
            self.lease(*index, LeaseEvent::Expired(*tokens));
        }
        match decision.table_error {
            Some(TableError::Full) => bump(self.table_full, 1),
            Some(TableError::Contended) => bump(self.table_contended, 1),
            Some(TableError::Host) => bump(self.table_host_error, 1),
            None => {}
        }
        bump(self.table_evictions, u64::from(decision.evictions));
    }

    pub fn lease(&self, policy: usize, event: LeaseEvent) {
        let Some(c) = self.policies.get(policy) else {
            return;
        };
        match event {
            LeaseEvent::Requested => bump(c.lease_requests, 1),
            LeaseEvent::Granted(n) => bump(c.tokens_granted, n),
            LeaseEvent::Returned(n) => bump(c.tokens_returned, n),
            LeaseEvent::Expired(n) => bump(c.tokens_expired, n),
            LeaseEvent::Unavailable => bump(c.lease_unavailable, 1),
            LeaseEvent::InvalidPolicy => bump(c.invalid_policy, 1),
            LeaseEvent::Assigned => bump(c.assignments, 1),
        }
    }

    /// What finishing one admission did (settlement, slot release).
    pub fn finished(&self, policy: usize, done: &Settlement) {
        let Some(c) = self.policies.get(policy) else {
            return;
        };
        if let Some(units) = done.settled {
            bump(c.units_settled, units);
        }
        bump(c.units_refunded, done.refunded);
        bump(c.units_debt, done.charged);
        bump(c.units_uncharged, done.uncharged);
        if done.missing {
            bump(c.usage_missing, 1);
        }
        if done.released {
            gauge(c.in_flight, -1);
        }
        self.slots_expired(policy, done.slots_expired);
    }

    /// In-flight slots whose release never came, dropped when they expired.
    fn slots_expired(&self, policy: usize, expired: u64) {
        let Some(c) = self.policies.get(policy) else {
            return;
        };
        bump(c.in_flight_expired, expired);
        if expired > 0 {
            gauge(c.in_flight, -saturating_i64(expired));
        }
    }

    pub fn callout(&self, elapsed_ms: u64, failed: bool) {
        bump(self.callouts, 1);
        if failed {
            bump(self.callouts_failed, 1);
        }
        if let Some(id) = self.callout_ms {
            sink::record(id, elapsed_ms);
        }
    }

    pub fn version_mismatch(&self) {
        bump(self.version_mismatch, 1);
    }

    /// Lease requests asked again under the same ids after their callout got no answer.
    pub fn callout_retried(&self, items: usize) {
        bump(self.callouts_retried, items as u64);
    }

    pub fn deadline_passed(&self) {
        bump(self.waiting_deadline, 1);
    }

    /// A caught panic, and what the failure modes of the policies the request matched made of
    /// it (`FailOpen` / `FailClosed` each).
    pub fn panicked(&self, outcomes: &[(usize, Outcome)]) {
        bump(self.panics, 1);
        for (index, outcome) in outcomes {
            if let Some(c) = self.policies.get(*index) {
                bump(
                    match outcome {
                        Outcome::FailClosed => c.fail_closed,
                        _ => c.fail_open,
                    },
                    1,
                );
            }
        }
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;

    /// A settlement of a usage the engine capped at `u64::MAX` (a header of 10^32, a JSON
    /// 1e30) counts `i64::MAX`, the most a host's counter takes in one increment.
    #[test]
    fn amounts_past_i64_max_saturate() {
        let doc = include_str!("../../../policies/payments.json");
        let policies = Policies::from_json(doc.as_bytes()).unwrap();
        let metrics = Metrics::define(&policies);
        let name = &policies.policies[0].name;
        let done = Settlement {
            settled: Some(u64::MAX),
            uncharged: u64::MAX - 5,
            refunded: 1 << 63,
            charged: 7,
            ..Settlement::default()
        };
        metrics.finished(0, &done);
        let value = |what: &str| sink::value(&format!("tollgate_{what}.policy.{name}"));
        assert_eq!(value("units_settled"), i64::MAX as u64);
        assert_eq!(value("units_uncharged"), i64::MAX as u64);
        assert_eq!(value("units_refunded"), i64::MAX as u64);
        assert_eq!(value("units_debt"), 7);
        metrics.lease(0, LeaseEvent::Granted(u64::MAX));
        assert_eq!(value("tokens_granted"), i64::MAX as u64);
    }
}
