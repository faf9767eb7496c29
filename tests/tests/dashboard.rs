#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! dashboards/tollgate.json: valid Grafana JSON, exactly what tools/gen-dashboard writes, and
//! every query names only metrics (and labels) tollgate defines. Queries are parsed with a
//! real PromQL parser (tools/promql-metrics, the promql-parser wheel); the metric list below
//! is checked against the sources that define the metrics (src/metrics.rs for the filter,
//! crates/limiter/src/metrics.rs for the limiter), so a rename on either side fails here.

mod ops;

use std::collections::{BTreeMap, BTreeSet};

use ops::{json_file, root, scratch};
use serde_json::Value;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Where a metric comes from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Source {
    /// The filter, through Envoy's /stats/prometheus (policy label from the stats tag).
    Filter,
    /// The limiter's /metrics.
    Limiter,
    /// A regional limiter's /metrics (`crates/limiter/src/region/metrics.rs`).
    Region,
}

/// Every metric the dashboard may use: name (as Prometheus sees it), kind, labels, source.
const METRICS: &[(&str, Kind, &[&str], Source)] = &[
    (
        "tollgate_units_reserved",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_units_settled",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_units_refunded",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_units_debt",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_units_uncharged",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_usage_missing",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_in_flight",
        Kind::Gauge,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_in_flight_denied",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_in_flight_expired",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_limiter_units_settled_total",
        Kind::Counter,
        &["policy"],
        Source::Limiter,
    ),
    (
        "tollgate_allowed",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_denied",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_shadow_denied",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_tagged",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_identity_missing",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_fail_open",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_fail_closed",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_fallback_allowed",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_fallback_denied",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_lease_requests",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_tokens_granted",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_tokens_returned",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_tokens_expired",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_lease_unavailable",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_invalid_policy",
        Kind::Counter,
        &["policy"],
        Source::Filter,
    ),
    (
        "tollgate_local_table_full",
        Kind::Counter,
        &[],
        Source::Filter,
    ),
    (
        "tollgate_local_table_contended",
        Kind::Counter,
        &[],
        Source::Filter,
    ),
    (
        "tollgate_local_table_host_error",
        Kind::Counter,
        &[],
        Source::Filter,
    ),
    (
        "tollgate_local_table_evictions",
        Kind::Counter,
        &[],
        Source::Filter,
    ),
    ("tollgate_callouts", Kind::Counter, &[], Source::Filter),
    (
        "tollgate_callouts_failed",
        Kind::Counter,
        &[],
        Source::Filter,
    ),
    (
        "tollgate_policy_version_mismatch",
        Kind::Counter,
        &[],
        Source::Filter,
    ),
    (
        "tollgate_wait_deadline_passed",
        Kind::Counter,
        &[],
        Source::Filter,
    ),
    ("tollgate_callout_ms", Kind::Histogram, &[], Source::Filter),
    (
        "tollgate_limiter_decisions_total",
        Kind::Counter,
        &["policy", "outcome"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_returns_total",
        Kind::Counter,
        &["policy", "outcome"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_tokens_granted_total",
        Kind::Counter,
        &["policy"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_tokens_returned_total",
        Kind::Counter,
        &["policy"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_store_call_duration_seconds",
        Kind::Histogram,
        &["node", "op"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_store_errors_total",
        Kind::Counter,
        &["node", "kind"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_store_keys",
        Kind::Gauge,
        &["node"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_active_keys",
        Kind::Gauge,
        &["policy"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_remaining_ratio",
        Kind::Histogram,
        &["policy"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_store_exec_microseconds_total",
        Kind::Counter,
        &["node"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_store_exec_calls_total",
        Kind::Counter,
        &["node"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_policy_info",
        Kind::Gauge,
        &["version"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_policy_reloads_total",
        Kind::Counter,
        &["result"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_http_responses_total",
        Kind::Counter,
        &["endpoint", "status"],
        Source::Limiter,
    ),
    (
        "tollgate_limiter_parent_reachable",
        Kind::Gauge,
        &[],
        Source::Region,
    ),
    (
        "tollgate_limiter_partition_seconds",
        Kind::Gauge,
        &[],
        Source::Region,
    ),
    (
        "tollgate_limiter_parent_calls_total",
        Kind::Counter,
        &["op", "outcome"],
        Source::Region,
    ),
    (
        "tollgate_limiter_parent_call_duration_seconds",
        Kind::Histogram,
        &["op"],
        Source::Region,
    ),
    (
        "tollgate_limiter_regional_tokens_total",
        Kind::Counter,
        &["policy", "event"],
        Source::Region,
    ),
    (
        "tollgate_limiter_regional_held_tokens",
        Kind::Gauge,
        &["policy"],
        Source::Region,
    ),
    (
        "tollgate_limiter_regional_keys",
        Kind::Gauge,
        &[],
        Source::Region,
    ),
];

/// What the issue asks the dashboard to show, at least.
const REQUIRED: &[&str] = &[
    "tollgate_allowed",
    "tollgate_denied",
    "tollgate_shadow_denied",
    "tollgate_fail_open",
    "tollgate_fail_closed",
    "tollgate_tokens_granted",
    "tollgate_tokens_returned",
    "tollgate_tokens_expired",
    "tollgate_callout_ms",
    "tollgate_limiter_decisions_total",
    "tollgate_limiter_store_call_duration_seconds",
    "tollgate_limiter_store_errors_total",
    "tollgate_limiter_active_keys",
    "tollgate_limiter_remaining_ratio",
    "tollgate_limiter_store_exec_microseconds_total",
    "tollgate_limiter_store_exec_calls_total",
];

/// Every series name Prometheus can hold for the known metrics → (metric, labels).
fn series() -> BTreeMap<String, (&'static str, BTreeSet<String>)> {
    let mut out = BTreeMap::new();
    for (name, kind, labels, _) in METRICS {
        let labels: BTreeSet<String> = labels.iter().map(|l| l.to_string()).collect();
        if *kind == Kind::Histogram {
            let mut with_le = labels.clone();
            with_le.insert("le".into());
            out.insert(format!("{name}_bucket"), (*name, with_le));
            out.insert(format!("{name}_sum"), (*name, labels.clone()));
            out.insert(format!("{name}_count"), (*name, labels));
        } else {
            out.insert(name.to_string(), (*name, labels));
        }
    }
    out
}

fn dashboard() -> Value {
    json_file(&root().join("dashboards/tollgate.json"))
}

fn all_panels(panels: &Value, out: &mut Vec<Value>) {
    for p in panels.as_array().into_iter().flatten() {
        out.push(p.clone());
        all_panels(&p["panels"], out);
    }
}

#[test]
fn dashboard_is_what_the_generator_writes() {
    let out = scratch("dashboard").join("tollgate.json");
    let mut cmd = ops::py_tool("gen-dashboard", &[]);
    cmd.arg("--out").arg(&out);
    ops::run_ok(cmd);
    let generated = std::fs::read_to_string(&out).unwrap();
    let committed = std::fs::read_to_string(root().join("dashboards/tollgate.json")).unwrap();
    let first_difference = generated
        .lines()
        .zip(committed.lines())
        .position(|(a, b)| a != b);
    assert!(
        generated == committed,
        "dashboards/tollgate.json differs from tools/gen-dashboard's output (first at line {:?}): \
         run `just dashboard`",
        first_difference.map(|i| i + 1)
    );
}

#[test]
fn dashboard_is_well_formed_grafana_json() {
    let d = dashboard();
    assert_eq!(d["uid"], "tollgate");
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vars, ["datasource", "policy"]);

    let mut panels = Vec::new();
    all_panels(&d["panels"], &mut panels);
    assert!(panels.len() >= 20, "{} panels", panels.len());
    let mut ids = BTreeSet::new();
    let mut cells: BTreeSet<(u64, u64)> = BTreeSet::new();
    for p in &panels {
        let title = p["title"].as_str().unwrap();
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "duplicate id at {title}"
        );
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap(),
            g["y"].as_u64().unwrap(),
            g["w"].as_u64().unwrap(),
            g["h"].as_u64().unwrap(),
        );
        assert!(x + w <= 24, "{title} is wider than the dashboard");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(cells.insert((cx, cy)), "{title} overlaps another panel");
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        assert!(
            p["description"].as_str().is_some_and(|s| s.len() > 20),
            "{title} needs a description"
        );
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title} has no query");
        let refs: BTreeSet<&str> = targets
            .iter()
            .map(|t| t["refId"].as_str().unwrap())
            .collect();
        assert_eq!(refs.len(), targets.len(), "{title}: refIds repeat");
        for t in targets {
            assert!(
                t["expr"].as_str().is_some_and(|e| !e.is_empty()),
                "{title}: empty query"
            );
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
        }
    }
}

#[test]
fn every_query_names_a_metric_tollgate_defines() {
    let known = series();
    let mut cmd = ops::py_tool("promql-metrics", &[]);
    cmd.arg(root().join("dashboards/tollgate.json"));
    let parsed: Value = serde_json::from_str(&ops::run_ok(cmd)).unwrap();
    let queries = parsed.as_array().unwrap();
    assert!(queries.len() >= 30, "{} queries", queries.len());

    let mut used = BTreeSet::new();
    for q in queries {
        let at = format!("panel `{}` query {}: {}", q["panel"], q["ref"], q["expr"]);
        assert!(q["error"].is_null(), "{at}: does not parse: {}", q["error"]);
        let selectors = q["selectors"].as_array().unwrap();
        assert!(!selectors.is_empty(), "{at}: selects no metric");
        let mut available = BTreeSet::new();
        for s in selectors {
            let name = s["name"].as_str().unwrap();
            let (metric, labels) = known
                .get(name)
                .unwrap_or_else(|| panic!("{at}: `{name}` is not a metric tollgate defines"));
            used.insert(*metric);
            for l in s["labels"].as_array().unwrap() {
                let l = l.as_str().unwrap();
                assert!(labels.contains(l), "{at}: `{name}` has no label `{l}`");
            }
            available.extend(labels.iter().cloned());
        }
        for l in q["grouping"].as_array().unwrap() {
            let l = l.as_str().unwrap();
            assert!(
                available.contains(l),
                "{at}: groups by `{l}`, which none of its metrics has"
            );
        }
    }

    // The `policy` variable's query.
    let d = dashboard();
    let policy_var = &d["templating"]["list"][1];
    assert_eq!(
        policy_var["definition"],
        "label_values(tollgate_allowed, policy)"
    );
    assert!(known["tollgate_allowed"].1.contains("policy"));

    for r in REQUIRED {
        assert!(used.contains(r), "no panel shows {r}");
    }
}

/// Labels listed right after a metric's name in crates/limiter/src/metrics.rs (`&["a", "b"]`).
fn labels_after(source: &str, name: &str) -> Option<BTreeSet<String>> {
    let at = source.find(&format!("\"{name}\""))?;
    let rest = &source[at..];
    let open = rest.find("&[")?;
    let close = open + rest[open..].find(']')?;
    Some(
        rest[open + 2..close]
            .split(',')
            .map(|l| l.trim().trim_matches('"').to_string())
            .filter(|l| !l.is_empty())
            .collect(),
    )
}

#[test]
fn the_metric_list_matches_the_sources() {
    let filter = std::fs::read_to_string(root().join("crates/engine/src/metrics.rs")).unwrap();
    let limiter = std::fs::read_to_string(root().join("crates/limiter/src/metrics.rs")).unwrap();
    let region =
        std::fs::read_to_string(root().join("crates/limiter/src/region/metrics.rs")).unwrap();
    for (name, kind, labels, source) in METRICS {
        let labels: BTreeSet<String> = labels.iter().map(|l| l.to_string()).collect();
        match source {
            Source::Limiter => {
                let found = labels_after(&limiter, name).unwrap_or_else(|| {
                    panic!("crates/limiter/src/metrics.rs does not define {name} (with its labels)")
                });
                assert_eq!(found, labels, "labels of {name}");
            }
            Source::Region => {
                let found = labels_after(&region, name).unwrap_or_else(|| {
                    panic!("crates/limiter/src/region/metrics.rs does not define {name} (with its labels)")
                });
                assert_eq!(found, labels, "labels of {name}");
            }
            Source::Filter => {
                let short = name.strip_prefix("tollgate_").unwrap();
                let defined = if labels.contains("policy") && *kind == Kind::Gauge {
                    filter.contains(&format!("per_gauge(\"{short}\""))
                } else if labels.contains("policy") {
                    // per-policy counters: tollgate_<what>.policy.<policy> → {policy}
                    filter.contains(&format!("per(\"{short}\""))
                } else if *kind == Kind::Histogram {
                    filter.contains(&format!("MetricType::Histogram, \"{name}\""))
                } else {
                    filter.contains(&format!("counter(\"{name}\")"))
                };
                assert!(
                    defined,
                    "crates/engine/src/metrics.rs does not define {name} as a {kind:?} with labels {labels:?}"
                );
            }
        }
    }
}
