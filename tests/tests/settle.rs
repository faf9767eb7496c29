#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of costs known only after the response, and of in-flight limits: a real
//! Envoy (`--concurrency 4`) loads the built filter with the shipped `envoy/llm.yaml` in front
//! of a metered upstream that reports usage in a header, a trailer, a JSON body or an SSE
//! stream, resets mid-stream on request, and counts what is in flight.

use std::time::{Duration, Instant};

use serde_json::Value;
use tollgate_e2e::build::Build;
use tollgate_e2e::tollgate::{assert_embeds_policy, envoy_config, policy_metric, start_ingress};
use tollgate_e2e::{
    burst, paths, process, send, try_burst, try_send_streamed, Envoy, EnvoyOptions, MeteredRequest,
    MeteredUpstream, RequestSpec, Response, UsageIn, Wire,
};

const WORKERS: u32 = 4;
const WAIT: Duration = Duration::from_secs(10);

fn start(
    build: Build,
    policy: &str,
    upstream: &MeteredUpstream,
    route_timeout: &str,
) -> (Envoy, u16) {
    let config = build
        .config(envoy_config(
            "envoy/llm.yaml",
            policy,
            upstream.port(),
            None,
        ))
        .replace("timeout: 300s", &format!("timeout: {route_timeout}"));
    start_ingress(config, WORKERS)
}

/// Waits (bounded) until a metric reaches `value` (stream ends are handled after the client
/// has its answer).
fn wait_metric(envoy: &Envoy, what: &str, policy: &str, value: u64) {
    process::wait_for(
        &format!("tollgate_{what} of {policy} = {value}"),
        WAIT,
        || (policy_metric(envoy, what, policy) == value).then_some(()),
    )
    .unwrap_or_else(|e| panic!("{e}: it is {}", policy_metric(envoy, what, policy)));
}

fn statuses(responses: &[Response]) -> std::collections::BTreeMap<u16, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for r in responses {
        *counts.entry(r.status).or_default() += 1;
    }
    counts
}

/// The book's page that shows `policies/llm.json` and what the shipped example answers.
const COSTS_PAGE: &str = "docs/src/policies/costs.md";

fn chat(tenant: &str) -> RequestSpec {
    RequestSpec::post("/v1/chat/completions", "{}").header("x-tenant-id", tenant)
}

#[test]
fn shipped_config_embeds_the_llm_policy() {
    assert_embeds_policy("envoy/llm.yaml", "policies/llm.json");
    let text = std::fs::read_to_string(paths::workspace_root().join("policies/llm.json")).unwrap();
    let page = std::fs::read_to_string(paths::workspace_root().join(COSTS_PAGE)).unwrap();
    assert!(
        page.contains(text.trim()),
        "{COSTS_PAGE} does not show policies/llm.json as it is"
    );
}

/// The book's example (*Costs known after the response*), as shipped: `envoy/llm.yaml` with its
/// stand-in model server (a `direct_response` answering 42 tokens). What the page shows is
/// what a client gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_llm_example_is_what_the_book_shows() {
    let model_port = tollgate_e2e::free_port();
    let config = std::fs::read_to_string(paths::workspace_root().join("envoy/llm.yaml"))
        .unwrap()
        .replace("port_value: 10000", "port_value: 0")
        .replace("port_value: 9901", "port_value: 0")
        .replace("port_value: 10001", &format!("port_value: {model_port}"))
        .replace(
            "filename: target/wasm32-wasip1/wasm/tollgate.wasm",
            &format!("filename: {}", paths::wasm_path().display()),
        );
    let envoy = Envoy::start(
        EnvoyOptions::new(config)
            .concurrency(WORKERS)
            .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    let r = send(
        port,
        chat("acme")
            .header("content-type", "application/json")
            .body(r#"{"model":"m","max_tokens":300}"#),
    )
    .await;
    let page = std::fs::read_to_string(paths::workspace_root().join(COSTS_PAGE)).unwrap();
    let shown = [
        format!("HTTP/1.1 {} OK", r.status),
        format!(
            "ratelimit-policy: {}",
            r.header("ratelimit-policy").unwrap()
        ),
        format!("ratelimit: {}", r.header("ratelimit").unwrap()),
        r.body.trim_end().to_string(),
    ];
    let metrics = envoy.stats_prometheus();
    let lines: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            ["reserved", "settled", "refunded"]
                .iter()
                .any(|w| l.starts_with(&format!("tollgate_units_{w}{{")))
        })
        .collect();
    assert_eq!(lines.len(), 3, "{metrics}");
    for line in shown.iter().map(String::as_str).chain(lines) {
        assert!(page.contains(line), "{COSTS_PAGE} does not show `{line}`");
    }
}

/// Rate 1 unit per hour (nothing refills during the test), burst 300; the reservation comes
/// from `x-estimated-units` (default 100, at most 300), the actual cost from the response
/// header `x-usage-units`.
fn by_header(max_debt: u64, rate: &str) -> String {
    format!(
        r#"{{
  "policies": [{{
    "name": "tokens",
    "match": {{ "routes": ["POST /v1/chat/completions"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "rate": {rate},
    "burst": 300,
    "reserve": {{ "from": {{ "header": "x-estimated-units" }}, "default": 100, "max": 300 }},
    "settle": {{ "from": {{ "header": "x-usage-units" }}, "max_debt": {max_debt} }}
  }}]
}}"#
    )
}

async fn unused_reservations_come_back_to_the_bucket(build: Build) {
    let upstream = MeteredUpstream::start();
    let (envoy, port) = start(
        build,
        &by_header(300, r#"{"units":1,"per":"1h"}"#),
        &upstream,
        "5s",
    );
    // Each request reserves 100 and uses 30: 70 come back. 300 - 30·i ≥ 100 admits exactly 7;
    // without settlement only 3 would pass.
    let mut admitted = 0;
    for i in 0..10 {
        let r = send(
            port,
            chat("acme")
                .header("x-estimated-units", "100")
                .usage(30)
                .tag(i.to_string()),
        )
        .await;
        match r.status {
            200 => admitted += 1,
            429 => assert!(i >= 7, "request {i} refused"),
            other => panic!("status {other}: {}", r.body),
        }
    }
    assert_eq!(admitted, 7);
    assert_eq!(upstream.requests(), 7);
    assert_eq!(policy_metric(&envoy, "units_reserved", "tokens"), 700);
    assert_eq!(policy_metric(&envoy, "units_settled", "tokens"), 210);
    assert_eq!(policy_metric(&envoy, "units_refunded", "tokens"), 490);
    // 90 left: a request that says it needs 90 passes, one that needs 91 does not.
    let r = send(
        port,
        chat("acme").header("x-estimated-units", "91").usage(91),
    )
    .await;
    assert_eq!(r.status, 429);
    let r = send(
        port,
        chat("acme").header("x-estimated-units", "90").usage(90),
    )
    .await;
    assert_eq!(r.status, 200);
    // A client cannot reserve beyond the policy's max or below its min: 5000 reserves 300.
    let r = send(
        port,
        chat("fresh").header("x-estimated-units", "5000").usage(300),
    )
    .await;
    assert_eq!(r.status, 200);
    let r = send(
        port,
        chat("fresh").header("x-estimated-units", "-5").usage(1),
    )
    .await;
    assert_eq!(r.status, 429, "the bucket of `fresh` is empty");
    assert_eq!(
        policy_metric(&envoy, "units_reserved", "tokens"),
        700 + 90 + 300
    );
}

async fn an_excess_is_debt_that_refuses_until_repaid(build: Build) {
    let upstream = MeteredUpstream::start();
    // 200 units per second, burst 300, debt at most 200.
    let (envoy, port) = start(
        build,
        &by_header(200, r#"{"units":200,"per":"1s"}"#),
        &upstream,
        "5s",
    );
    // Reserved 100, used 600: 500 over. The bucket (300 - 100 = 200) may go down to -200, so
    // 400 are charged and 100 are not.
    let r = send(
        port,
        chat("acme").header("x-estimated-units", "100").usage(600),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let in_debt = Instant::now();
    // (What refilled between admission and settlement, at 200/s, lets a little more be
    // charged.)
    let (debt, uncharged) = (
        policy_metric(&envoy, "units_debt", "tokens"),
        policy_metric(&envoy, "units_uncharged", "tokens"),
    );
    assert_eq!(debt + uncharged, 500);
    assert!((400..450).contains(&debt), "{debt} charged");
    // Refused, with a Retry-After that covers the debt: 200 + 100 for the request at 200/s is
    // 1.5 s, said as 2.
    let r = send(
        port,
        chat("acme").header("x-estimated-units", "100").usage(1),
    )
    .await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("2"), "{:?}", r.headers);
    let body: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["retry_after_seconds"], 2);
    assert_eq!(body["error"], "rate limit exceeded");
    // Another tenant is in nobody's debt.
    let r = send(
        port,
        chat("other").header("x-estimated-units", "300").usage(300),
    )
    .await;
    assert_eq!(r.status, 200);
    // Admitted again once repaid, and not before: 1.5 s after the debt was charged (the
    // answer that charged it reached the client a little later; without the debt the next
    // request would pass at once).
    let admitted_after = loop {
        let r = send(
            port,
            chat("acme").header("x-estimated-units", "100").usage(100),
        )
        .await;
        if r.status == 200 {
            break in_debt.elapsed();
        }
        assert_eq!(r.status, 429);
        assert!(in_debt.elapsed() < WAIT, "still refused after {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        admitted_after >= Duration::from_millis(1_200),
        "admitted {admitted_after:?} after going 200 into debt"
    );
}

/// Three policies, one per route, each settled from another place: a trailer, a JSON body
/// (reserving from the request's JSON body), an SSE stream (refunding on a missing usage).
const BY_PLACE: &str = r#"{
  "policies": [
    { "name": "by-trailer", "match": { "routes": ["POST /v1/trailer"] },
      "key": [{ "header": "x-tenant-id" }], "rate": { "units": 1, "per": "1h" }, "burst": 10000,
      "cost": { "POST /v1/trailer": 100 },
      "settle": { "from": { "trailer": "x-usage-units" } } },
    { "name": "by-json", "match": { "routes": ["POST /v1/json"] },
      "key": [{ "header": "x-tenant-id" }], "rate": { "units": 1, "per": "1h" }, "burst": 10000,
      "reserve": { "from": { "body": { "field": "max_tokens", "max_bytes": 1024 } },
                   "plus": { "POST /v1/json": 20 }, "default": 500, "max": 1000 },
      "settle": { "from": { "body": { "field": "usage.total_tokens" } } } },
    { "name": "by-sse", "match": { "routes": ["POST /v1/sse"] },
      "key": [{ "header": "x-tenant-id" }], "rate": { "units": 1, "per": "1h" }, "burst": 10000,
      "reserve": { "from": { "header": "x-estimated-units" }, "default": 300, "max": 1000 },
      "settle": { "from": { "body": { "field": "usage.total_tokens", "max_bytes": 512 } },
                  "on_missing": "refund" } }
  ]
}"#;

fn post(path: &str, body: impl Into<String>) -> RequestSpec {
    RequestSpec::post(path, body).header("x-tenant-id", "acme")
}

async fn usage_from_a_trailer_a_json_body_and_an_event_stream(build: Build) {
    let upstream = MeteredUpstream::start();
    let (envoy, port) = start(build, BY_PLACE, &upstream, "5s");
    // A trailer: reserved the route's 100, used 37. The client gets the trailer too (h2c).
    let r = try_send_streamed(
        port,
        post("/v1/trailer", "{}")
            .usage(37)
            .usage_in(UsageIn::Trailer),
        Wire::H2c,
        WAIT,
    )
    .await
    .unwrap();
    assert_eq!((r.status, r.trailer("x-usage-units")), (200, Some("37")));
    assert_eq!(policy_metric(&envoy, "units_settled", "by-trailer"), 37);
    assert_eq!(policy_metric(&envoy, "units_refunded", "by-trailer"), 63);
    // No trailer at all: the reservation stands (`keep`).
    let r = send(port, post("/v1/trailer", "{}").usage_in(UsageIn::None)).await;
    assert_eq!(r.status, 200);
    wait_metric(&envoy, "usage_missing", "by-trailer", 1);
    assert_eq!(policy_metric(&envoy, "units_settled", "by-trailer"), 137);

    // A JSON body both ways: reserved 80 + 20 from `max_tokens`, used 45.
    let r = send(
        port,
        post("/v1/json", r#"{"model":"m","max_tokens":80}"#)
            .usage(45)
            .usage_in(UsageIn::Json),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(r.body.contains(r#""total_tokens":45"#), "{}", r.body);
    assert_eq!(policy_metric(&envoy, "units_reserved", "by-json"), 100);
    assert_eq!(policy_metric(&envoy, "units_refunded", "by-json"), 55);

    // An event stream: reserved 200 from the header, the usage event says 61.
    let r = try_send_streamed(
        port,
        post("/v1/sse", "{}")
            .header("x-estimated-units", "200")
            .usage(61)
            .usage_in(UsageIn::Sse)
            .sse_event_count(5)
            .body_delay_ms(20),
        Wire::Http1,
        WAIT,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    assert!(r.body.ends_with("data: [DONE]\n\n"), "{}", r.body);
    assert!(
        r.chunks.len() >= 2,
        "streamed, not buffered: {:?}",
        r.chunks
    );
    assert_eq!(policy_metric(&envoy, "units_settled", "by-sse"), 61);
    assert_eq!(policy_metric(&envoy, "units_refunded", "by-sse"), 139);
}

async fn hostile_bodies_take_the_default_and_resets_follow_the_policy(build: Build) {
    let upstream = MeteredUpstream::start();
    let (envoy, port) = start(build, BY_PLACE, &upstream, "5s");
    let nested = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let oversized = format!(r#"{{"max_tokens":10,"pad":"{}"}}"#, "x".repeat(200_000));
    let bodies = [
        "not json".to_string(),
        r#"{"max_tokens":"lots"}"#.to_string(),
        r#"{"max_tokens":-7}"#.to_string(),
        r#"{"other":1}"#.to_string(),
        String::new(),
        nested,
        oversized,
        "\u{0}\u{ffff}{{{{".to_string(),
    ];
    for body in &bodies {
        let r = send(
            port,
            post("/v1/json", body.clone())
                .usage(1)
                .usage_in(UsageIn::Json),
        )
        .await;
        assert_eq!(r.status, 200, "{}", &body[..body.len().min(40)]);
    }
    // Every one reserved the default 500 plus the route's 20, and was settled at 1.
    assert_eq!(
        policy_metric(&envoy, "units_reserved", "by-json"),
        520 * bodies.len() as u64
    );
    assert_eq!(
        policy_metric(&envoy, "units_settled", "by-json"),
        bodies.len() as u64
    );
    // Answers without a usable usage: a JSON route answered `ok`, an SSE route answered `ok`.
    let r = send(
        port,
        post("/v1/json", r#"{"max_tokens":30}"#).usage_in(UsageIn::None),
    )
    .await;
    assert_eq!(r.status, 200);
    let r = send(
        port,
        post("/v1/sse", "{}")
            .header("x-estimated-units", "50")
            .usage_in(UsageIn::None),
    )
    .await;
    assert_eq!(r.status, 200);
    wait_metric(&envoy, "usage_missing", "by-json", 1);
    wait_metric(&envoy, "usage_missing", "by-sse", 1);

    // An upstream reset mid-stream: `by-json` keeps its reservation, `by-sse` refunds it.
    let reset = try_send_streamed(
        port,
        post("/v1/json", r#"{"max_tokens":100}"#)
            .usage(10)
            .usage_in(UsageIn::Json)
            .reset_after_headers(),
        Wire::H2c,
        WAIT,
    )
    .await;
    assert!(reset.is_err(), "{reset:?}");
    wait_metric(&envoy, "usage_missing", "by-json", 2);
    let reset = try_send_streamed(
        port,
        post("/v1/sse", "{}")
            .header("x-estimated-units", "70")
            .usage(10)
            .usage_in(UsageIn::Sse)
            .reset_after_headers(),
        Wire::H2c,
        WAIT,
    )
    .await;
    assert!(reset.is_err(), "{reset:?}");
    wait_metric(&envoy, "usage_missing", "by-sse", 2);
    assert_eq!(policy_metric(&envoy, "units_refunded", "by-sse"), 50 + 70);
    // `keep`: the 50 and the 120 reserved stand as settled.
    assert_eq!(
        policy_metric(&envoy, "units_settled", "by-json"),
        bodies.len() as u64 + 50 + 120
    );
    assert_eq!(
        policy_metric(&envoy, "units_refunded", "by-json"),
        519 * bodies.len() as u64
    );
    // The filter is alive and still exact after all that.
    let r = send(
        port,
        post("/v1/json", r#"{"max_tokens":1}"#)
            .usage(2)
            .usage_in(UsageIn::Json),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(!envoy.logs().contains("panicked"), "{}", envoy.logs());
}

/// At most 8 requests of a tenant in flight on the instance; slots expire after 10 s.
const IN_FLIGHT: &str = r#"{
  "policies": [{
    "name": "concurrency",
    "match": { "routes": ["POST /v1/chat/completions"] },
    "key": [{ "header": "x-tenant-id" }],
    "rate": { "units": 1000000, "per": "1s" },
    "burst": 1000000,
    "max_in_flight": 8,
    "in_flight_timeout": "10s"
  }]
}"#;

async fn in_flight_limits_hold_across_workers_and_every_end_releases(build: Build) {
    let upstream = MeteredUpstream::start();
    let (envoy, port) = start(build, IN_FLIGHT, &upstream, "3s");
    // 60 slow requests at once over 60 connections (spread over the 4 workers): 8 reach the
    // upstream, the other 52 are refused at once.
    let responses = burst(port, 60, 60, |_| chat("acme").delay_ms(2_000)).await;
    assert_eq!(upstream.max_in_flight(), 8, "{:?}", statuses(&responses));
    assert_eq!(statuses(&responses).get(&200), Some(&8));
    let refused: Vec<_> = responses.iter().filter(|r| r.status == 429).collect();
    assert_eq!(refused.len(), 52);
    for r in refused {
        let body: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(body["error"], "too many requests in flight");
        assert_eq!(body["policy"], "concurrency");
        assert_eq!(r.header("retry-after"), Some("1"));
    }
    assert_eq!(policy_metric(&envoy, "in_flight_denied", "concurrency"), 52);
    wait_metric(&envoy, "in_flight", "concurrency", 0);

    // Clients that give up: 8 slow requests, their connections dropped mid-wait.
    let clients =
        tokio::spawn(async move { try_burst(port, 8, 8, |_| chat("acme").delay_ms(30_000)).await });
    upstream.wait_in_flight_at_least(8, WAIT);
    assert_eq!(policy_metric(&envoy, "in_flight", "concurrency"), 8);
    clients.abort();
    let _ = clients.await;
    upstream.wait_in_flight(0, WAIT);
    wait_metric(&envoy, "in_flight", "concurrency", 0);

    // Upstream timeouts (the route's 3 s): 504, and the slots come back.
    let timed_out = burst(port, 8, 8, |_| chat("acme").delay_ms(30_000)).await;
    assert_eq!(statuses(&timed_out).get(&504), Some(&8));
    wait_metric(&envoy, "in_flight", "concurrency", 0);

    // Everything released: 8 fit again.
    upstream.reset_max_in_flight();
    let again = burst(port, 12, 12, |_| chat("acme").delay_ms(1_500)).await;
    assert_eq!(
        statuses(&again).get(&200),
        Some(&8),
        "{:?}",
        statuses(&again)
    );
    assert_eq!(upstream.max_in_flight(), 8);
    wait_metric(&envoy, "in_flight", "concurrency", 0);
    assert_eq!(policy_metric(&envoy, "in_flight_expired", "concurrency"), 0);
}

tollgate_e2e::both_builds!(
    async: [
        unused_reservations_come_back_to_the_bucket,
        an_excess_is_debt_that_refuses_until_repaid,
        usage_from_a_trailer_a_json_body_and_an_event_stream,
        hostile_bodies_take_the_default_and_resets_follow_the_policy,
        in_flight_limits_hold_across_workers_and_every_end_releases,
    ],
    sync: [],
);
