//! The report as JSON: the same data as the markdown (every run of every scenario, the
//! comparisons, scenario 7's runs, the targets), one function per section.

use super::compare::{
    AlgorithmComparison, MtlsComparison, NativeRatio, RlsComparison, SettleComparison,
};
use super::measure::{Latency, Scenario};
use super::over_limit::{InstanceRun, OverLimitRun};
use super::Report;
use serde_json::{json, Value};

impl Report {
    pub fn json(&self) -> Value {
        let s = &self.setup;
        let scenarios: Vec<Value> = self
            .scenarios
            .iter()
            .map(|sc| self.scenario_json(sc))
            .collect();
        let over_limit: Vec<Value> = self.over_limit.iter().map(over_limit_json).collect();
        let targets: Vec<Value> = self
            .targets()
            .into_iter()
            .map(|(what, measured, met)| json!({"target": what, "measured": measured, "met": met}))
            .collect();
        let mtls = self.mtls().map(|m| mtls_json(&m));
        let rls = self.rls().map(|r| rls_json(&r));
        let settlement: Vec<Value> = self.settlements().iter().map(settlement_json).collect();
        let algorithms: Vec<Value> = self.algorithms().iter().map(algorithm_json).collect();
        let native: Vec<Value> = self.native_ratios().iter().map(native_json).collect();
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

    /// One scenario: its medians, ratios, counters and every run.
    fn scenario_json(&self, sc: &Scenario) -> Value {
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
    }
}

fn latency_json(l: &Latency) -> Value {
    json!({"count": l.count, "p50_us": l.p50_us, "p99_us": l.p99_us})
}

/// One variant of scenario 7 in one round.
fn over_limit_json(r: &OverLimitRun) -> Value {
    let per_key = r.lease_calls_per_key_instance_s();
    let instances: Vec<Value> = r
        .instances
        .iter()
        .zip(["a", "b"])
        .map(|(i, name)| instance_json(i, name))
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
        "latency_429": latency_json(&r.denied_latency),
        "latency_200": latency_json(&r.admitted_latency),
        "undecided": r.undecided,
        "other": r.other(),
        "callout_retries": r.retries,
        "instances": instances,
        "admitted_per_tenant": r.admitted.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
    })
}

/// One instance's part of a scenario 7 run.
fn instance_json(i: &InstanceRun, name: &str) -> Value {
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
}

fn mtls_json(m: &MtlsComparison) -> Value {
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
}

fn rls_json(r: &RlsComparison) -> Value {
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
}

fn settlement_json(c: &SettleComparison) -> Value {
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
}

fn algorithm_json(c: &AlgorithmComparison) -> Value {
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
}

fn native_json(r: &NativeRatio) -> Value {
    json!({
        "id": r.id,
        "base": r.base,
        "rps_ratio": r.rps,
        "envoy_cpu_ratio": r.envoy_cpu,
    })
}
