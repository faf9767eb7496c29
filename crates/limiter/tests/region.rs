//! A regional limiter (`--parent`) in front of a parent limiter, both in-process on memory
//! stores: a global budget taken through the region is exact, a retried lease id is replayed
//! without taking anything, returns go back at most once, and the parent sees the region as
//! one holder. (The fleet end to end, partitions and TLS: `tests/tests/regions.rs`.)

// Test code: failing loudly is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::time::Duration;

use support::*;
use tollgate_limiter::region::RegionConfig;
use tollgate_limiter::StoreConfig;

fn regional_config(parent: std::net::SocketAddr) -> tollgate_limiter::ServerConfig {
    let mut c = config(StoreConfig::Memory);
    c.region = Some(RegionConfig {
        parent_url: format!("http://{parent}"),
        region: "test".into(),
        parent_timeout: Duration::from_secs(1),
        max_keys: 1_000,
        tls: None,
    });
    c
}

/// A regional limiter in front of `parent`, once ready (it has reached the parent).
async fn regional(parent: std::net::SocketAddr) -> tollgate_limiter::Running {
    start_with(regional_config(parent)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_through_the_region_is_exact_replays_take_nothing_returns_count_once() {
    let parent = start(StoreConfig::Memory).await;
    let region = regional(parent.addr()).await;
    let key = unique("through");

    // Asks of 1..=4 against a budget of 100 with negligible refill, until the region has
    // nothing left: exactly 100.
    let mut total = 0;
    let mut asks = 0;
    for i in 0..200u64 {
        let body = holder_body(
            &format!("r{i}"),
            "hundred",
            &key,
            (1, 1 + i % 4),
            "envoy-1",
            10.0,
        );
        let (status, v) = post(region.addr(), "/v1/leases", &body).await;
        assert_eq!(status, 200, "{v}");
        let g = granted(&v);
        total += g;
        asks += 1;
        if g == 0 {
            break;
        }
    }
    assert_eq!(total, 100, "over {asks} asks");

    // The same id again is the same answer, and takes nothing more.
    let first = holder_body("r0", "hundred", &key, (1, 1), "envoy-1", 10.0);
    let (_, again) = post(region.addr(), "/v1/leases", &first).await;
    assert_eq!(granted(&again), 1, "{again}");

    // A return gives back at most what the lease took, once; the tokens are spendable again.
    let (status, v) = post(
        region.addr(),
        "/v1/leases/return",
        &return_body("r3", "hundred", &key, 50),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["returns"][0]["returned"], 4, "{v}");
    let (_, v) = post(
        region.addr(),
        "/v1/leases/return",
        &return_body("r3", "hundred", &key, 50),
    )
    .await;
    assert_eq!(v["returns"][0]["returned"], 0, "{v}");
    let (_, v) = post(
        region.addr(),
        "/v1/leases",
        &holder_body("after", "hundred", &key, (1, 10), "envoy-1", 10.0),
    )
    .await;
    assert_eq!(granted(&v), 4, "{v}");

    // Unknown ids return nothing.
    let (_, v) = post(
        region.addr(),
        "/v1/leases/return",
        &return_body("never", "hundred", &key, 5),
    )
    .await;
    assert_eq!(v["returns"][0]["returned"], 0);

    // The parent granted the region, as one holder, exactly the budget (plus nothing for
    // the replay), in a few calls rather than one per ask.
    let (_, metrics) = get(parent.addr(), "/metrics").await;
    let granted_by_parent: f64 = metrics
        .lines()
        .find(|l| l.starts_with("tollgate_limiter_tokens_granted_total{policy=\"hundred\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap();
    assert!(granted_by_parent <= 100.0 + 4.0, "{granted_by_parent}");
    let (_, regional_metrics) = get(region.addr(), "/metrics").await;
    let calls: f64 = regional_metrics
        .lines()
        .filter(|l| l.starts_with("tollgate_limiter_parent_calls_total{op=\"lease\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        (1.0..asks as f64).contains(&calls),
        "{calls} parent calls for {asks} asks"
    );
    region.shutdown().await;
    parent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regional_limiter_without_its_parent_answers_unavailable_quickly() {
    // A parent address nobody listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = listener.local_addr().unwrap();
    drop(listener);
    let region = start_unready(regional_config(gone)).await;
    let started = std::time::Instant::now();
    let body = holder_body("x1", "hundred", &unique("gone"), (1, 1), "envoy-1", 1.0);
    let (status, v) = post(region.addr(), "/v1/leases", &body).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"], "UNAVAILABLE", "{v}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // A region that has never reached its parent is not ready, and says why.
    let (status, body) = get(region.addr(), "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("has not been reached"), "{body}");
    assert!(body.contains(&gone.to_string()), "{body}");
    region.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_connects_in_the_background_and_is_ready_once_its_parent_is_up() {
    // The region starts first, towards an address nobody listens on yet.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = listener.local_addr().unwrap();
    drop(listener);
    let region = start_unready(regional_config(at)).await;
    let (status, body) = get(region.addr(), "/readyz").await;
    assert_eq!(status, 503, "{body}");

    // The parent comes up there: the region connects by itself (no lease asked it to) and
    // becomes ready, then leases come from the parent.
    let mut c = config(StoreConfig::Memory);
    c.listen = at;
    let parent = start_with(c).await;
    until_serving(&region).await;
    let body = holder_body("late-1", "hundred", &unique("late"), (1, 3), "envoy-1", 1.0);
    let (status, v) = post(region.addr(), "/v1/leases", &body).await;
    assert_eq!((status, granted(&v)), (200, 3), "{v}");

    // A partition after that does not make it unready: it spends what it holds, and its
    // regional policies are its own.
    parent.shutdown().await;
    let (status, body) = get(region.addr(), "/readyz").await;
    assert_eq!(status, 200, "{body}");
    region.shutdown().await;
}
