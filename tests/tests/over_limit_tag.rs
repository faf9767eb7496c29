#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! `on_over_limit: tag` in a real Envoy, both builds: over its limit a request is not refused
//! but goes on with the policy's tag header, and Envoy chooses its route again with it. The
//! route table sends requests carrying `x-tollgate-over-limit: bulk` to a second ("degraded")
//! upstream cluster; the filter sets that header only after it decided, so the route can only
//! have been chosen again. A client's own copy of the header is removed: it never picks the
//! degraded route, nor keeps a request over the limit on the normal one.

use tollgate_e2e::build::Build;
use tollgate_e2e::tollgate::{self, envoy_config, Limiter, Store};
use tollgate_e2e::{send, Envoy, EnvoyOptions, RequestSpec, Upstream};

const TAG: &str = "x-tollgate-over-limit";

/// One tag policy per tenant: 3 units, refilled at 1 per hour.
const POLICY: &str = r#"{
  "policies": [{
    "name": "bulk",
    "match": { "hosts": ["api.example.com"] },
    "key": [{ "header": "x-tenant-id" }],
    "rate": { "units": 1, "per": "1h" },
    "burst": 3,
    "on_over_limit": { "action": "tag" }
  }]
}"#;

const SHIPPED_ROUTE: &str = "              - match: { prefix: \"/\" }
                route: { cluster: demo_upstream }";

/// The degraded route first: a request tagged by `bulk` goes to the second cluster.
const TAGGED_ROUTES: &str = "              - match:
                  prefix: \"/\"
                  headers:
                  - name: x-tollgate-over-limit
                    string_match: { exact: bulk }
                route: { cluster: degraded_upstream }
              - match: { prefix: \"/\" }
                route: { cluster: demo_upstream }";

/// The same policy on the global stage: one lease per request (`lease_max: 1`), so a request
/// waits for the limiter and is let go on (tagged) by the worker that received the answer.
const GLOBAL_POLICY: &str = r#"{
  "policies": [{
    "name": "bulk",
    "match": { "hosts": ["api.example.com"] },
    "key": [{ "header": "x-tenant-id" }],
    "rate": { "units": 1, "per": "1h" },
    "burst": 3,
    "scope": "global",
    "on_unavailable": { "mode": "closed" },
    "on_over_limit": { "action": "tag" }
  }],
  "limiter": { "cluster": "tollgate_limiter", "timeout": "2s", "lease_max": 1 }
}"#;

/// A shipped config with `policy`, the two routes and a second cluster for `degraded`.
fn config(
    build: Build,
    shipped: &str,
    policy: &str,
    upstream: &Upstream,
    degraded: &Upstream,
    limiter_port: Option<u16>,
) -> String {
    let rendered = envoy_config(shipped, policy, upstream.port(), limiter_port);
    assert!(
        rendered.contains(SHIPPED_ROUTE),
        "{shipped}'s route changed"
    );
    let degraded_cluster = format!(
        "
  - name: degraded_upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: degraded_upstream
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: 127.0.0.1, port_value: {} }}
",
        degraded.port()
    );
    let with_routes = rendered.replacen(SHIPPED_ROUTE, TAGGED_ROUTES, 1);
    build.config(format!("{}{degraded_cluster}", with_routes.trim_end()))
}

fn request(tenant: &str) -> RequestSpec {
    RequestSpec::get("/reports/daily")
        .host("api.example.com")
        .header("x-tenant-id", tenant)
}

fn tag_values(headers: &[(String, String)]) -> Vec<&str> {
    headers
        .iter()
        .filter(|(name, _)| name == TAG)
        .map(|(_, value)| value.as_str())
        .collect()
}

async fn over_the_limit_requests_take_the_degraded_route(build: Build) {
    let upstream = Upstream::start();
    let degraded = Upstream::start();
    let envoy = Envoy::start(
        EnvoyOptions::new(config(
            build,
            "envoy/local.yaml",
            POLICY,
            &upstream,
            &degraded,
            None,
        ))
        .concurrency(2)
        .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");

    // Within the limit: the normal route.
    for _ in 0..3 {
        assert_eq!(send(port, request("acme")).await.status, 200);
    }
    assert_eq!((upstream.requests(), degraded.requests()), (3, 0));
    assert!(tag_values(&upstream.last_headers()).is_empty());

    // Over the limit: never refused, every request reaches the degraded cluster, tagged with
    // the policy's name.
    for _ in 0..7 {
        let response = send(port, request("acme")).await;
        assert_eq!(response.status, 200, "{}", response.body);
        assert!(response.header("retry-after").is_none());
    }
    assert_eq!((upstream.requests(), degraded.requests()), (3, 7));
    assert_eq!(tag_values(&degraded.last_headers()), vec!["bulk"]);

    // A client's own tag header is replaced over the limit (a forged value does not keep the
    // request on the normal route) ...
    let forged = send(port, request("acme").header(TAG, "none")).await;
    assert_eq!(forged.status, 200);
    assert_eq!((upstream.requests(), degraded.requests()), (3, 8));
    assert_eq!(tag_values(&degraded.last_headers()), vec!["bulk"]);

    // ... and removed within it: it never picks the degraded route.
    let posing = send(port, request("bob").header(TAG, "bulk")).await;
    assert_eq!(posing.status, 200);
    assert_eq!((upstream.requests(), degraded.requests()), (4, 8));
    assert!(tag_values(&upstream.last_headers()).is_empty());

    let text = envoy.stats_prometheus();
    assert_eq!(
        tollgate::prometheus_value(&text, "tollgate_tagged{policy=\"bulk\"}"),
        8.0
    );
    assert_eq!(
        tollgate::prometheus_value(&text, "tollgate_allowed{policy=\"bulk\"}"),
        4.0
    );
    assert_eq!(
        tollgate::prometheus_value(&text, "tollgate_denied{policy=\"bulk\"}"),
        0.0
    );
}

async fn a_request_that_waited_for_the_limiter_is_tagged_when_resumed(build: Build) {
    let upstream = Upstream::start();
    let degraded = Upstream::start();
    let limiter = Limiter::start(GLOBAL_POLICY, Store::Memory, &[]);
    limiter.wait_ready();
    let envoy = Envoy::start(
        EnvoyOptions::new(config(
            build,
            "envoy/global.yaml",
            GLOBAL_POLICY,
            &upstream,
            &degraded,
            Some(limiter.port()),
        ))
        .concurrency(2)
        .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    for _ in 0..3 {
        assert_eq!(send(port, request("acme")).await.status, 200);
    }
    assert_eq!((upstream.requests(), degraded.requests()), (3, 0));
    // The fourth asks the limiter, which grants nothing: the request is tagged when the
    // answer lets it go on, and takes the degraded route; so do the ones after it.
    for _ in 0..4 {
        let response = send(port, request("acme").header(TAG, "none")).await;
        assert_eq!(response.status, 200, "{}", response.body);
    }
    assert_eq!((upstream.requests(), degraded.requests()), (3, 4));
    assert_eq!(tag_values(&degraded.last_headers()), vec!["bulk"]);
    let text = envoy.stats_prometheus();
    assert_eq!(
        tollgate::prometheus_value(&text, "tollgate_tagged{policy=\"bulk\"}"),
        4.0
    );
    assert!(tollgate::prometheus_value(&text, "tollgate_lease_requests{policy=\"bulk\"}") >= 4.0);
}

tollgate_e2e::both_builds!(
    async: [
        over_the_limit_requests_take_the_degraded_route,
        a_request_that_waited_for_the_limiter_is_tagged_when_resumed,
    ],
    sync: [],
);
