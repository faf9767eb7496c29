use super::*;
use crate::wrk::Measured;

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
    assert!(targets
        .iter()
        .any(|t| t["target"] == "S4n Envoy CPU per request ≤ 1.15 × S1's" && t["met"] == false));

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
