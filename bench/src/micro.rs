//! Summary of the criterion microbenchmarks (`just bench-micro`): reads criterion's
//! `target/criterion/<group>/<bench>/new/estimates.json` and writes one table of ns per operation,
//! followed by the bytes of shared state per key ([`crate::footprint`], measured as the summary
//! is written: bytes, not time).

use std::path::Path;

use serde_json::{json, Value};

use crate::footprint::{self, Footprint};

/// One benchmark's estimates, in ns per iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub group: String,
    pub bench: String,
    pub median_ns: f64,
    pub mean_ns: f64,
}

/// Every `<group>/<bench>/new/estimates.json` under `criterion_dir`, sorted by name.
pub fn read(criterion_dir: &Path) -> Vec<Estimate> {
    let mut out = Vec::new();
    let Ok(groups) = std::fs::read_dir(criterion_dir) else {
        return out;
    };
    for group in groups.flatten() {
        let Ok(benches) = std::fs::read_dir(group.path()) else {
            continue;
        };
        for bench in benches.flatten() {
            let file = bench.path().join("new").join("estimates.json");
            let Some(v) = std::fs::read_to_string(&file)
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            else {
                continue;
            };
            let point = |k: &str| v.get(k)?.get("point_estimate")?.as_f64();
            if let (Some(median_ns), Some(mean_ns)) = (point("median"), point("mean")) {
                out.push(Estimate {
                    group: group.file_name().to_string_lossy().into_owned(),
                    bench: bench.file_name().to_string_lossy().into_owned(),
                    median_ns,
                    mean_ns,
                });
            }
        }
    }
    out.sort_by(|a, b| (&a.group, &a.bench).cmp(&(&b.group, &b.bench)));
    out
}

/// The anchor of the request path: `governor`'s keyed check, measured in the same run.
pub const ANCHOR: (&str, &str) = ("request_path", "governor_keyed_check");

/// Each other `request_path` benchmark's median as a multiple of the anchor's.
pub fn anchor_ratios(estimates: &[Estimate]) -> Vec<(String, f64)> {
    let Some(anchor) = estimates
        .iter()
        .find(|e| (e.group.as_str(), e.bench.as_str()) == ANCHOR)
        .filter(|e| e.median_ns > 0.0)
    else {
        return Vec::new();
    };
    estimates
        .iter()
        .filter(|e| e.group == ANCHOR.0 && e.bench != ANCHOR.1)
        .map(|e| (e.bench.clone(), e.median_ns / anchor.median_ns))
        .collect()
}

pub fn markdown(estimates: &[Estimate], footprints: &[Footprint], header: &str) -> String {
    let mut md = format!(
        "# tollgate microbenchmarks (`just bench-micro`)\n\n{header}\n\n\
         | group | benchmark | median ns/op | mean ns/op |\n|---|---|---:|---:|\n"
    );
    for e in estimates {
        md.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} |\n",
            e.group, e.bench, e.median_ns, e.mean_ns
        ));
    }
    let ratios = anchor_ratios(estimates);
    if !ratios.is_empty() {
        md.push_str(&format!(
            "\nAgainst the anchor (`{}`, a keyed check in the `governor` crate, same run), \
             median over median:\n\n",
            ANCHOR.1
        ));
        for (bench, ratio) in ratios {
            md.push_str(&format!("- {bench}: {ratio:.1}x\n"));
        }
    }
    if !footprints.is_empty() {
        md.push('\n');
        md.push_str(&footprint::markdown(footprints));
    }
    md
}

pub fn json(estimates: &[Estimate], footprints: &[Footprint], header: &str) -> Value {
    json!({
        "setup": header,
        "benchmarks": estimates.iter().map(|e| json!({
            "group": e.group,
            "benchmark": e.bench,
            "median_ns": e.median_ns,
            "mean_ns": e.mean_ns,
        })).collect::<Vec<_>>(),
        "anchor": ANCHOR.1,
        "ratio_to_anchor": anchor_ratios(estimates).into_iter()
            .map(|(bench, ratio)| (bench, json!(ratio)))
            .collect::<serde_json::Map<String, Value>>(),
        "shared_state_bytes_per_key": footprint::json(footprints),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_criterion_estimates() {
        let dir = tollgate_e2e::paths::new_log_dir("", "criterion");
        let bench = dir.join("bucket").join("try_take").join("new");
        std::fs::create_dir_all(&bench).unwrap_or_default();
        std::fs::write(
            bench.join("estimates.json"),
            r#"{"mean":{"point_estimate":7.7},"median":{"point_estimate":7.5}}"#,
        )
        .unwrap_or_default();
        std::fs::create_dir_all(dir.join("report")).unwrap_or_default();
        let got = read(&dir);
        assert_eq!(
            got,
            vec![Estimate {
                group: "bucket".into(),
                bench: "try_take".into(),
                median_ns: 7.5,
                mean_ns: 7.7
            }]
        );
        let md = markdown(&got, &[], "setup");
        assert!(md.contains("| bucket | try_take | 7.5 | 7.7 |"), "{md}");
        assert!(!md.contains("anchor"), "no anchor measured: {md}");
        assert!(!md.contains("shared state"), "none measured: {md}");
        // The bytes per key follow the timings, in the table and in the JSON.
        let bytes = footprint::measure(10).unwrap_or_default();
        let md = markdown(&got, &bytes, "setup");
        assert!(
            md.contains("| bucket | try_take | 7.5 | 7.7 |\n\n## Bytes of shared state per key"),
            "{md}"
        );
        let value = json(&got, &bytes, "setup");
        assert_eq!(
            value["shared_state_bytes_per_key"][0]["policy"],
            "token_bucket (local)"
        );
        assert_eq!(value["shared_state_bytes_per_key"][0]["keys"], 10);
        let estimate = |bench: &str, median_ns| Estimate {
            group: "request_path".into(),
            bench: bench.into(),
            median_ns,
            mean_ns: median_ns,
        };
        let with_anchor = [
            estimate("governor_keyed_check", 50.0),
            estimate("local", 400.0),
        ];
        assert_eq!(
            anchor_ratios(&with_anchor),
            vec![("local".to_string(), 8.0)]
        );
        assert!(markdown(&with_anchor, &[], "setup").contains("- local: 8.0x"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
