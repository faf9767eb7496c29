#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of the windowed algorithms on the global stage: two real Envoys (shipped
//! `envoy/global.yaml`, two workers each) with the built filter, the real limiter on a real
//! `redis-server` and on a local Redis Cluster. A concurrent burst over both Envoys admits
//! exactly the window's limit, whatever the algorithm.

use tollgate_e2e::tollgate::{envoy_config, policy_metric, start_ingress, Limiter, Store};
use tollgate_e2e::{burst, Envoy, RedisCluster, RedisServer, RequestSpec, Response, Upstream};

const ALGORITHMS: [&str; 3] = ["fixed_window", "sliding_window", "sliding_log"];

/// One global policy per algorithm on its own route: 20 per hour (the burst lies in one
/// window). The limiter's deadline is far above any answer time, even while the parallel test
/// starts its own Envoys and Redis on the same two cores: this test is about exact admission,
/// and a request decided by the failure mode (`closed`: a 503) would only say the machine was
/// busy. Deadlines and failure modes have tests of their own.
fn policies() -> String {
    let policies: Vec<String> = ALGORITHMS
        .iter()
        .map(|a| {
            format!(
                r#"{{ "name": "{a}", "match": {{ "routes": ["GET /{a}"] }},
      "key": [{{ "header": "x-tenant-id" }}], "algorithm": "{a}",
      "rate": {{ "units": 20, "per": "1h" }}, "scope": "global",
      "on_unavailable": {{ "mode": "closed" }} }}"#
            )
        })
        .collect();
    format!(
        r#"{{ "policies": [{}],
  "limiter": {{ "cluster": "tollgate_limiter", "timeout": "10s" }} }}"#,
        policies.join(",\n")
    )
}

fn ok(responses: &[Response]) -> usize {
    responses.iter().filter(|r| r.status == 200).count()
}

async fn each_algorithm_admits_its_limit_over_two_envoys(store: Store) {
    let policy = policies();
    let limiter = Limiter::start(&policy, store, &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let start = || {
        let config = envoy_config(
            "envoy/global.yaml",
            &policy,
            upstream.port(),
            Some(limiter.port()),
        );
        start_ingress(config, 2)
    };
    let ((a, port_a), (b, port_b)) = (start(), start());
    for algorithm in ALGORITHMS {
        for tenant in ["acme", "globex"] {
            let request =
                |_| RequestSpec::get(format!("/{algorithm}")).header("x-tenant-id", tenant);
            let (ra, rb) = tokio::join!(
                burst(port_a, 150, 30, request),
                burst(port_b, 150, 30, request)
            );
            let others: Vec<u16> = ra
                .iter()
                .chain(&rb)
                .map(|r| r.status)
                .filter(|s| *s != 200 && *s != 429)
                .collect();
            assert!(
                others.is_empty(),
                "{algorithm} for {tenant}: answers neither 200 nor 429: {others:?}"
            );
            let statuses = |r: &[Response]| r.iter().filter(|r| r.status == 429).count();
            assert_eq!(
                ok(&ra) + ok(&rb),
                20,
                "{algorithm} for {tenant}: {} + {} admitted",
                ok(&ra),
                ok(&rb)
            );
            assert_eq!(
                statuses(&ra) + statuses(&rb),
                280,
                "{algorithm} for {tenant}"
            );
        }
        let allowed = |e: &Envoy| policy_metric(e, "allowed", algorithm);
        assert_eq!(allowed(&a) + allowed(&b), 40, "{algorithm}");
    }
    assert_eq!(upstream.requests(), 3 * 2 * 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_hold_across_two_envoys_on_redis() {
    let redis = RedisServer::start();
    each_algorithm_admits_its_limit_over_two_envoys(Store::Redis(redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_hold_across_two_envoys_on_a_redis_cluster() {
    let cluster = RedisCluster::start(3, 0);
    each_algorithm_admits_its_limit_over_two_envoys(Store::Cluster(cluster.urls())).await;
}
