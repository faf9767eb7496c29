#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of the algorithms besides the token bucket, and of shaping: a real Envoy
//! (`--concurrency 4`) loads the built filter with the shipped `envoy/local.yaml` in front of a
//! real upstream on loopback.

use std::time::{Duration, Instant};

use tollgate_e2e::build::Build;
use tollgate_e2e::tollgate::{envoy_config, policy_metric, start_ingress};
use tollgate_e2e::{burst, send, Envoy, RequestSpec, Upstream};

const WORKERS: u32 = 4;

fn start(build: Build, policy: &str, upstream: &Upstream) -> (Envoy, u16) {
    let config = build.config(envoy_config(
        "envoy/local.yaml",
        policy,
        upstream.port(),
        None,
    ));
    start_ingress(config, WORKERS)
}

/// One policy per algorithm, each on its own route: 20 units per hour (no window ends, no
/// refill during a burst).
const ALGORITHMS: &str = r#"{
  "policies": [
    { "name": "bucket", "match": { "routes": ["GET /bucket"] }, "key": [{ "header": "x-tenant-id" }],
      "rate": { "units": 20, "per": "1h" }, "burst": 20 },
    { "name": "fixed", "match": { "routes": ["GET /fixed"] }, "key": [{ "header": "x-tenant-id" }],
      "algorithm": "fixed_window", "rate": { "units": 20, "per": "1h" } },
    { "name": "sliding", "match": { "routes": ["GET /sliding"] }, "key": [{ "header": "x-tenant-id" }],
      "algorithm": "sliding_window", "rate": { "units": 20, "per": "1h" } },
    { "name": "log", "match": { "routes": ["GET /log"] }, "key": [{ "header": "x-tenant-id" }],
      "algorithm": "sliding_log", "rate": { "units": 20, "per": "1h" } }
  ]
}"#;

async fn a_concurrent_burst_admits_exactly_the_limit_of_each_algorithm(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(build, ALGORITHMS, &upstream);
    for route in ["bucket", "fixed", "sliding", "log"] {
        for tenant in ["acme", "globex"] {
            let responses = burst(port, 300, 50, |_| {
                RequestSpec::get(format!("/{route}")).header("x-tenant-id", tenant)
            })
            .await;
            let ok = responses.iter().filter(|r| r.status == 200).count();
            let limited = responses.iter().filter(|r| r.status == 429).count();
            assert_eq!((ok, limited), (20, 280), "{route} for {tenant}");
            let denied = responses.iter().find(|r| r.status == 429).unwrap();
            assert!(
                denied.body.contains(&format!(r#""policy":"{route}""#)),
                "{}",
                denied.body
            );
            // 20 per hour: the bucket's next unit is 180 s away; a fixed window or a log frees
            // room within the hour; a full sliding window's 20 must first weigh 19, which
            // can take the rest of this hour and 5 % of the next (3,600 + 180 s).
            let retry: u64 = denied.header("retry-after").unwrap().parse().unwrap();
            let most = match route {
                "bucket" => 180,
                "sliding" => 3_780,
                _ => 3_600,
            };
            let least = if route == "bucket" { 180 } else { 1 };
            assert!(
                (least..=most).contains(&retry),
                "{route}: Retry-After {retry}"
            );
        }
        assert_eq!(policy_metric(&envoy, "allowed", route), 40, "{route}");
    }
    assert_eq!(upstream.requests(), 4 * 2 * 20);
}

/// 10 per second, burst 1, requests over the rate wait up to 500 ms for their turn.
const SHAPED: &str = r#"{
  "policies": [{
    "name": "shaped",
    "match": { "routes": ["GET /steady"] },
    "key": [{ "header": "x-tenant-id" }],
    "rate": { "units": 10, "per": "1s" },
    "burst": 1,
    "shape": { "max_delay": "500ms", "max_waiting": 8 }
  }]
}"#;

async fn shaping_spaces_requests_at_the_rate_and_refuses_past_max_delay(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(build, SHAPED, &upstream);
    let memory_before = envoy.memory_allocated();
    // 2 × the rate for 5 s: one request every 50 ms, each on its own connection.
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..100u32 {
        let due = start + Duration::from_millis(50) * i;
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(due.into()).await;
            let sent = Instant::now();
            let r = send(
                port,
                RequestSpec::get("/steady").header("x-tenant-id", "acme"),
            )
            .await;
            (r.status, sent.duration_since(start), sent.elapsed())
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    let admitted: Vec<_> = answers.iter().filter(|(s, _, _)| *s == 200).collect();
    let refused = answers.iter().filter(|(s, _, _)| *s == 429).count();
    assert_eq!(admitted.len() + refused, 100, "only 200 and 429");
    // When the admitted requests were let through (sent + waited): one per 100 ms.
    let mut passed: Vec<Duration> = admitted
        .iter()
        .map(|(_, at, waited)| *at + *waited)
        .collect();
    passed.sort();
    let gaps: Vec<f64> = passed
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1_000.0)
        .collect();
    let mean_gap =
        (passed[passed.len() - 1] - passed[0]).as_secs_f64() * 1_000.0 / (passed.len() - 1) as f64;
    println!(
        "admitted {}, refused {refused}; mean gap {mean_gap:.1} ms; gaps {gaps:.0?}",
        admitted.len()
    );
    assert!(
        (90.0..=110.0).contains(&mean_gap),
        "admissions {mean_gap:.1} ms apart, not 100 ± 10 %"
    );
    // In 5 s at 10/s plus the burst and what fits the delay bound at the end: about 55.
    assert!(
        (48..=60).contains(&admitted.len()),
        "{} admitted",
        admitted.len()
    );
    assert!(refused >= 40, "{refused} refused");
    for (_, _, waited) in &admitted {
        assert!(
            *waited <= Duration::from_millis(500 + 150),
            "a request waited {waited:?}, past max_delay"
        );
    }
    let delayed = policy_metric(&envoy, "delayed", "shaped") as usize;
    assert!(delayed + 1 >= admitted.len() - 2, "{delayed} delayed");
    assert!(envoy.memory_allocated() < memory_before + 8 * 1024 * 1024);
    assert_eq!(upstream.requests() as usize, admitted.len());
}

tollgate_e2e::both_builds!(
    async: [
        a_concurrent_burst_admits_exactly_the_limit_of_each_algorithm,
        shaping_spaces_requests_at_the_rate_and_refuses_past_max_delay,
    ],
    sync: [],
);
