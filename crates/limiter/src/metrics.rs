//! Prometheus metrics of the limiter (`GET /metrics`), in one place so their names, labels
//! and label values stay consistent.
//!
//! Label values are policy names from the validated policy document (an unknown name a client
//! sent is counted as `(unknown)`), node addresses, fixed outcome and error names: never a
//! tenant id or a key, so the number of series is bounded by configuration, not by traffic.

use std::time::Duration;

use prometheus::{
    CounterVec, Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Policy label for a name the document does not define.
pub const UNKNOWN_POLICY: &str = "(unknown)";

/// Outcome label values of decisions (API error codes verbatim, so they read the same in the
/// API, logs and metrics).
pub mod outcome {
    /// Tokens were granted (possibly with a share besides).
    pub const GRANTED: &str = "GRANTED";
    /// No tokens now, but a share of the bucket's rate.
    pub const ASSIGNED: &str = "ASSIGNED";
    /// An assignment was asked for (a named holder the bucket could not give `want`) and the
    /// share is 0: the rate is held by others; the holder's demand is recorded.
    pub const WAITING: &str = "WAITING";
    pub const OVER_LIMIT: &str = "OVER_LIMIT";
    pub const REPLAYED: &str = "REPLAYED";
    pub const RETURNED: &str = "RETURNED";
    pub const NOTHING_RETURNED: &str = "NOTHING_RETURNED";
}

/// Every metric the limiter exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    decisions: IntCounterVec,
    returns: IntCounterVec,
    tokens_granted: IntCounterVec,
    tokens_returned: IntCounterVec,
    assignments: IntCounterVec,
    tokens_assigned: IntCounterVec,
    units_settled: IntCounterVec,
    store_latency: HistogramVec,
    store_errors: IntCounterVec,
    store_keys: IntGaugeVec,
    active_keys: IntGaugeVec,
    remaining_ratio: HistogramVec,
    exec_calls: IntCounterVec,
    exec_usec: CounterVec,
    policy_info: IntGaugeVec,
    policy_reloads: IntCounterVec,
    responses: IntCounterVec,
    tls_connections: IntCounterVec,
    tls_reloads: IntCounterVec,
    tls_not_after: IntGaugeVec,
}

fn counter(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(g.clone()))?;
    Ok(g)
}

impl Metrics {
    /// Fails only on an invalid or duplicate metric definition (a bug the unit tests catch).
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let decisions = counter(
            &registry,
            "tollgate_limiter_decisions_total",
            "Lease decisions by policy and outcome (GRANTED, ASSIGNED, OVER_LIMIT, REPLAYED, UNAVAILABLE, INVALID_POLICY, INVALID_REQUEST).",
            &["policy", "outcome"],
       )?;
        let returns = counter(
            &registry,
            "tollgate_limiter_returns_total",
            "Lease returns by policy and outcome (RETURNED, NOTHING_RETURNED, UNAVAILABLE, INVALID_POLICY, INVALID_REQUEST).",
            &["policy", "outcome"],
       )?;
        let tokens_granted = counter(
            &registry,
            "tollgate_limiter_tokens_granted_total",
            "Tokens taken from global buckets into leases (replays not counted).",
            &["policy"],
        )?;
        let tokens_returned = counter(
            &registry,
            "tollgate_limiter_tokens_returned_total",
            "Unused lease tokens given back to global buckets.",
            &["policy"],
        )?;
        let assignments = counter(
            &registry,
            "tollgate_limiter_assignments_total",
            "Answers to named holders the bucket could not give what they wanted, by policy and outcome (ASSIGNED: a share of the rate; WAITING: share 0, demand recorded). Replays not counted.",
            &["policy", "outcome"],
        )?;
        let tokens_assigned = counter(
            &registry,
            "tollgate_limiter_tokens_assigned_total",
            "Whole tokens taken from global buckets into assignments (share x period; replays not counted).",
            &["policy"],
        )?;
        let units_settled = counter(
            &registry,
            "tollgate_limiter_units_settled_total",
            "Units (actual cost) of finished requests, as the filters report them on lease and return callouts answered 200, by policy (a name the policy document does not define is (unknown)).",
            &["policy"],
        )?;
        let store_latency = {
            let opts = HistogramOpts::new(
                "tollgate_limiter_store_call_duration_seconds",
                "Duration of one store call (one atomic unit), by node and operation.",
            )
            .buckets(vec![
                0.000_1, 0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
            ]);
            let h = HistogramVec::new(opts, &["node", "op"])?;
            registry.register(Box::new(h.clone()))?;
            h
        };
        let store_errors = counter(
            &registry,
            "tollgate_limiter_store_errors_total",
            "Store calls that produced no answer, by node and error kind.",
            &["node", "kind"],
        )?;
        let store_keys = gauge(
            &registry,
            "tollgate_limiter_store_keys",
            "Keys held by the store (buckets, windows and lease records), sampled per node (DBSIZE; memory: entries).",
            &["node"],
        )?;
        let active_keys = gauge(
            &registry,
            "tollgate_limiter_active_keys",
            "Distinct keys leased from per policy over the last minute (HyperLogLog estimate, ~1.6 % standard error).",
            &["policy"],
        )?;
        let remaining_ratio = {
            let opts = HistogramOpts::new(
                "tollgate_limiter_remaining_ratio",
                "What the store reported left in the bucket (window) after each fresh lease decision, as a fraction of the policy's burst (window limit); debt counts as 0.",
            )
            .buckets((0..=10).map(|i| f64::from(i) / 10.0).collect());
            let h = HistogramVec::new(opts, &["policy"])?;
            registry.register(Box::new(h.clone()))?;
            h
        };
        let exec_calls = counter(
            &registry,
            "tollgate_limiter_store_exec_calls_total",
            "Decisions the store's code ran, per node: Redis FCALLs from INFO commandstats (every client of the node), or the memory store's decisions.",
            &["node"],
        )?;
        let exec_usec = {
            let c = CounterVec::new(
                Opts::new(
                    "tollgate_limiter_store_exec_microseconds_total",
                    "Time the store's code ran, per node, in microseconds, without the network round trip: Redis FCALL usec from INFO commandstats, or the memory store's in-process decision time. Divide its rate by tollgate_limiter_store_exec_calls_total's for the mean.",
                ),
                &["node"],
            )?;
            registry.register(Box::new(c.clone()))?;
            c
        };
        let policy_info = gauge(
            &registry,
            "tollgate_limiter_policy_info",
            "1 for the policy document version in force.",
            &["version"],
        )?;
        let policy_reloads = counter(
            &registry,
            "tollgate_limiter_policy_reloads_total",
            "Policy document reloads by result (ok, invalid, unreadable).",
            &["result"],
        )?;
        let responses = counter(
            &registry,
            "tollgate_limiter_http_responses_total",
            "HTTP responses by endpoint and status code.",
            &["endpoint", "status"],
        )?;
        let tls_connections = counter(
            &registry,
            "tollgate_limiter_tls_connections_total",
            "TLS handshakes on the lease listener by result (accepted, no_client_certificate, untrusted_client, expired_client, client_not_allowed, handshake_timeout, handshake_failed); refused ones never reach the lease logic.",
            &["result"],
        )?;
        let tls_reloads = counter(
            &registry,
            "tollgate_limiter_tls_reloads_total",
            "Changed TLS certificate files by result (ok: in force now; invalid, unreadable: the previous ones stay).",
            &["result"],
        )?;
        let tls_not_after = gauge(
            &registry,
            "tollgate_limiter_tls_certificate_not_after_seconds",
            "Expiry (notAfter, Unix seconds) of the lease listener's certificate in force.",
            &[],
        )?;
        Ok(Self {
            registry,
            decisions,
            returns,
            tokens_granted,
            tokens_returned,
            assignments,
            tokens_assigned,
            units_settled,
            store_latency,
            store_errors,
            store_keys,
            active_keys,
            remaining_ratio,
            exec_calls,
            exec_usec,
            policy_info,
            policy_reloads,
            responses,
            tls_connections,
            tls_reloads,
            tls_not_after,
        })
    }

    pub fn decision(&self, policy: &str, outcome: &str) {
        self.decisions.with_label_values(&[policy, outcome]).inc();
    }

    pub fn returned(&self, policy: &str, outcome: &str) {
        self.returns.with_label_values(&[policy, outcome]).inc();
    }

    pub fn tokens_granted(&self, policy: &str, tokens: u64) {
        self.tokens_granted
            .with_label_values(&[policy])
            .inc_by(tokens);
    }

    pub fn tokens_returned(&self, policy: &str, tokens: u64) {
        self.tokens_returned
            .with_label_values(&[policy])
            .inc_by(tokens);
    }

    pub fn assignment(&self, policy: &str, outcome: &str) {
        self.assignments.with_label_values(&[policy, outcome]).inc();
    }

    pub fn tokens_assigned(&self, policy: &str, tokens: u64) {
        self.tokens_assigned
            .with_label_values(&[policy])
            .inc_by(tokens);
    }

    pub fn units_settled(&self, policy: &str, units: u64) {
        self.units_settled
            .with_label_values(&[policy])
            .inc_by(units);
    }

    pub fn store_call(&self, node: &str, op: &str, took: Duration) {
        self.store_latency
            .with_label_values(&[node, op])
            .observe(took.as_secs_f64());
    }

    pub fn store_error(&self, node: &str, kind: &str) {
        self.store_errors.with_label_values(&[node, kind]).inc();
    }

    /// Replaces the store-keys samples.
    pub fn set_store_keys(&self, samples: &[(String, u64)]) {
        self.store_keys.reset();
        for (node, count) in samples {
            self.store_keys
                .with_label_values(&[node.as_str()])
                .set(i64::try_from(*count).unwrap_or(i64::MAX));
        }
    }

    /// Replaces the per-policy active-key estimates.
    pub fn set_active_keys_by_policy(&self, counts: &[(String, u64)]) {
        self.active_keys.reset();
        for (policy, count) in counts {
            self.active_keys
                .with_label_values(&[policy.as_str()])
                .set(i64::try_from(*count).unwrap_or(i64::MAX));
        }
    }

    pub fn remaining_ratio(&self, policy: &str, ratio: f64) {
        self.remaining_ratio
            .with_label_values(&[policy])
            .observe(ratio);
    }

    /// Adds `calls` decisions that ran `usec` microseconds on `node`.
    pub fn store_exec(&self, node: &str, calls: u64, usec: f64) {
        self.exec_calls.with_label_values(&[node]).inc_by(calls);
        self.exec_usec.with_label_values(&[node]).inc_by(usec);
    }

    pub fn set_policy_version(&self, version: &str) {
        self.policy_info.reset();
        self.policy_info.with_label_values(&[version]).set(1);
    }

    pub fn policy_reload(&self, result: &str) {
        self.policy_reloads.with_label_values(&[result]).inc();
    }

    pub fn response(&self, endpoint: &str, status: u16) {
        self.responses
            .with_label_values(&[endpoint, &status.to_string()])
            .inc();
    }

    pub fn tls_connection(&self, result: &str) {
        self.tls_connections.with_label_values(&[result]).inc();
    }

    pub fn tls_reload(&self, result: &str) {
        self.tls_reloads.with_label_values(&[result]).inc();
    }

    pub fn set_tls_not_after(&self, unix_seconds: i64) {
        self.tls_not_after
            .with_label_values(&[] as &[&str])
            .set(unix_seconds);
    }

    /// The registry, for metric families defined beside the code that feeds them
    /// (`region::metrics`).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_once_used() {
        let m = Metrics::new().unwrap();
        m.decision("p", outcome::GRANTED);
        m.returned("p", outcome::RETURNED);
        m.tokens_granted("p", 5);
        m.tokens_returned("p", 2);
        m.assignment("p", outcome::ASSIGNED);
        m.assignment("p", outcome::WAITING);
        m.tokens_assigned("p", 50);
        m.units_settled("p", 9);
        m.store_call("127.0.0.1:6379", "lease", Duration::from_micros(300));
        m.store_error("127.0.0.1:6379", "timeout");
        m.set_store_keys(&[("127.0.0.1:6379".into(), 7)]);
        m.set_active_keys_by_policy(&[("p".into(), 3)]);
        m.remaining_ratio("p", 0.45);
        m.store_exec("127.0.0.1:6379", 4, 150.5);
        m.set_policy_version("abc");
        m.set_policy_version("def");
        m.policy_reload("ok");
        m.response("leases", 200);
        m.tls_connection("untrusted_client");
        m.tls_reload("ok");
        m.set_tls_not_after(4_102_444_800);
        let text = m.render();
        for needle in [
            "tollgate_limiter_decisions_total{outcome=\"GRANTED\",policy=\"p\"} 1",
            "tollgate_limiter_returns_total{outcome=\"RETURNED\",policy=\"p\"} 1",
            "tollgate_limiter_tokens_granted_total{policy=\"p\"} 5",
            "tollgate_limiter_tokens_returned_total{policy=\"p\"} 2",
            "tollgate_limiter_assignments_total{outcome=\"ASSIGNED\",policy=\"p\"} 1",
            "tollgate_limiter_assignments_total{outcome=\"WAITING\",policy=\"p\"} 1",
            "tollgate_limiter_tokens_assigned_total{policy=\"p\"} 50",
            "tollgate_limiter_units_settled_total{policy=\"p\"} 9",
            "tollgate_limiter_store_call_duration_seconds_bucket{node=\"127.0.0.1:6379\",op=\"lease\",le=\"0.0005\"} 1",
            "tollgate_limiter_store_errors_total{kind=\"timeout\",node=\"127.0.0.1:6379\"} 1",
            "tollgate_limiter_store_keys{node=\"127.0.0.1:6379\"} 7",
            "tollgate_limiter_active_keys{policy=\"p\"} 3",
            "tollgate_limiter_remaining_ratio_bucket{policy=\"p\",le=\"0.4\"} 0",
            "tollgate_limiter_remaining_ratio_bucket{policy=\"p\",le=\"0.5\"} 1",
            "tollgate_limiter_store_exec_calls_total{node=\"127.0.0.1:6379\"} 4",
            "tollgate_limiter_store_exec_microseconds_total{node=\"127.0.0.1:6379\"} 150.5",
            "tollgate_limiter_policy_info{version=\"def\"} 1",
            "tollgate_limiter_policy_reloads_total{result=\"ok\"} 1",
            "tollgate_limiter_http_responses_total{endpoint=\"leases\",status=\"200\"} 1",
            "tollgate_limiter_tls_connections_total{result=\"untrusted_client\"} 1",
            "tollgate_limiter_tls_reloads_total{result=\"ok\"} 1",
            "tollgate_limiter_tls_certificate_not_after_seconds 4102444800",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
        assert!(!text.contains("version=\"abc\""));
    }
}
