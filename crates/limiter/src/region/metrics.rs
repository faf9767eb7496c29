//! Metrics of a regional limiter: the parent's reachability and calls, and what the region
//! received, handed out, gave back and lost per policy. Labels are policy names of the
//! validated document and fixed words, never keys. (Every family states its labels, `&[]`
//! for none: `tests/tests/dashboard.rs` reads them from here.)

use std::collections::HashMap;

use prometheus::{GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts};

/// Every metric of the regional ledger.
#[derive(Debug, Clone)]
pub struct RegionMetrics {
    parent_reachable: IntGaugeVec,
    partition_seconds: GaugeVec,
    parent_calls: IntCounterVec,
    parent_latency: HistogramVec,
    tokens: IntCounterVec,
    held: IntGaugeVec,
    keys: IntGaugeVec,
}

impl RegionMetrics {
    /// Registers the families in `registry` (fails only on a duplicate definition).
    pub fn new(registry: &prometheus::Registry) -> prometheus::Result<Self> {
        let parent_reachable = IntGaugeVec::new(
            Opts::new(
                "tollgate_limiter_parent_reachable",
                "1 while the last call to the parent limiter got an answer, 0 during a partition.",
            ),
            &[],
        )?;
        let partition_seconds = GaugeVec::new(
            Opts::new(
                "tollgate_limiter_partition_seconds",
                "How long the parent limiter has been unreachable (0 while it answers).",
            ),
            &[],
        )?;
        let parent_calls = IntCounterVec::new(
            Opts::new(
                "tollgate_limiter_parent_calls_total",
                "Calls to the parent limiter by operation (lease, return) and outcome (ok, unreachable, refused).",
            ),
            &["op", "outcome"],
        )?;
        let parent_latency = HistogramVec::new(
            HistogramOpts::new(
                "tollgate_limiter_parent_call_duration_seconds",
                "Duration of one call to the parent limiter, retries included, by operation.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
            &["op"],
        )?;
        let tokens = IntCounterVec::new(
            Opts::new(
                "tollgate_limiter_regional_tokens_total",
                "Tokens of global policies by what happened to them in the region: received (leased from the parent), assigned (whole tokens of the parent's share x period), spent (handed out as leases to the region's instances), returned (given back to the parent), expired (lost at expiry).",
            ),
            &["policy", "event"],
        )?;
        let held = IntGaugeVec::new(
            Opts::new(
                "tollgate_limiter_regional_held_tokens",
                "Tokens of global policies the region still holds from the parent, by policy: leased, dripped and not handed out, and the rest of its share until its assignment ends.",
            ),
            &["policy"],
        )?;
        let keys = IntGaugeVec::new(
            Opts::new(
                "tollgate_limiter_regional_keys",
                "Keys of global policies the region holds a reservoir for.",
            ),
            &[],
        )?;
        registry.register(Box::new(parent_reachable.clone()))?;
        registry.register(Box::new(partition_seconds.clone()))?;
        registry.register(Box::new(parent_calls.clone()))?;
        registry.register(Box::new(parent_latency.clone()))?;
        registry.register(Box::new(tokens.clone()))?;
        registry.register(Box::new(held.clone()))?;
        registry.register(Box::new(keys.clone()))?;
        Ok(Self {
            parent_reachable,
            partition_seconds,
            parent_calls,
            parent_latency,
            tokens,
            held,
            keys,
        })
    }

    pub fn set_parent_reachable(&self, reachable: bool, partition_seconds: f64) {
        self.parent_reachable
            .with_label_values(&[] as &[&str])
            .set(i64::from(reachable));
        self.partition_seconds
            .with_label_values(&[] as &[&str])
            .set(partition_seconds);
    }

    pub fn parent_call(&self, op: &str, outcome: &str, took_ms: u64) {
        self.parent_calls.with_label_values(&[op, outcome]).inc();
        self.parent_latency
            .with_label_values(&[op])
            .observe(took_ms as f64 / 1_000.0);
    }

    pub fn regional_tokens(&self, policy: &str, event: &str, tokens: u64) {
        if tokens > 0 {
            self.tokens
                .with_label_values(&[policy, event])
                .inc_by(tokens);
        }
    }

    /// Held tokens per policy; policies not in `held` hold none.
    pub fn set_regional_held(&self, held: &HashMap<String, u64>) {
        self.held.reset();
        for (policy, tokens) in held {
            self.held
                .with_label_values(&[policy.as_str()])
                .set(i64::try_from(*tokens).unwrap_or(i64::MAX));
        }
    }

    pub fn set_regional_keys(&self, keys: usize) {
        self.keys
            .with_label_values(&[] as &[&str])
            .set(i64::try_from(keys).unwrap_or(i64::MAX));
    }
}
