#![cfg(feature = "e2e")]
//! Smoke tests for the e2e harness itself: each helper does what it promises against the
//! real programs (Envoy, redis-server), so failures in feature tests are about tollgate.

use std::time::{Duration, Instant};

use tollgate_e2e::client::try_send_timeout;
use tollgate_e2e::redis::Role;
use tollgate_e2e::upstream::{MockResponse, UPSTREAM_BODY};
use tollgate_e2e::{
    burst_timed, free_port, render_template, send, try_burst, Envoy, EnvoyOptions, RedisCluster,
    RedisServer, RequestSpec, Resp, Upstream,
};

const DIRECT_YAML: &str = r#"
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
static_resources:
  listeners:
  - name: ingress
    address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                direct_response: { status: 200, body: { inline_string: "{{BODY}}" } }
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
"#;

const PROXY_YAML: &str = r#"
admin:
  address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
static_resources:
  listeners:
  - name: ingress
    address: { socket_address: { address: 127.0.0.1, port_value: 0 } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                route: { cluster: backend }
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: backend
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: {{UPSTREAM_PORT}} } } }
"#;

fn direct_envoy(body: &str, concurrency: u32) -> Envoy {
    Envoy::start(
        EnvoyOptions::new(render_template(DIRECT_YAML, &[("BODY", &body)]))
            .concurrency(concurrency),
    )
}

#[tokio::test]
async fn envoy_direct_response_and_admin() {
    let envoy = direct_envoy("hello from envoy", 1);
    let port = envoy.listener_port("ingress");
    assert_ne!(port, 0);

    let resp = send(port, RequestSpec::get("/anything").host("api.example.com")).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.body, "hello from envoy");
    assert_eq!(resp.header("content-length"), Some("16"));

    assert_eq!(
        envoy.wait_counter("http.ingress.downstream_rq_2xx", 1, Duration::from_secs(5)),
        1
    );
    assert_eq!(envoy.counter("http.ingress.no_such_stat"), None);
    assert!(envoy
        .stats_prometheus()
        .contains("envoy_http_downstream_rq_xx{envoy_response_code_class=\"2\",envoy_http_conn_manager_prefix=\"ingress\"} 1"));
    assert!(envoy
        .stats_text()
        .contains("http.ingress.downstream_rq_total: 1"));
    assert!(envoy.memory_allocated() > 1_000_000);
    assert!(envoy.rss_bytes() > 10_000_000);
    assert!(envoy.admin_url().starts_with("http://127.0.0.1:"));
    assert!(envoy.logs().contains("starting main dispatch loop"));
    assert!(envoy.log_dir().join("envoy.yaml").is_file());
}

#[test]
fn two_envoys_run_at_the_same_time() {
    let started = Instant::now();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| direct_envoy("from a", 2));
        let b = s.spawn(|| direct_envoy("from b", 2));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_ne!(a.pid(), b.pid());
    assert_ne!(a.admin_port(), b.admin_port());
    assert_ne!(a.listener_port("ingress"), b.listener_port("ingress"));

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ra = send(a.listener_port("ingress"), RequestSpec::get("/")).await;
        let rb = send(b.listener_port("ingress"), RequestSpec::get("/")).await;
        assert_eq!((ra.status, ra.body.as_str()), (200, "from a"));
        assert_eq!((rb.status, rb.body.as_str()), (200, "from b"));
    });
}

#[test]
fn envoy_that_exits_early_reports_its_log() {
    let started = Instant::now();
    let yaml = DIRECT_YAML
        .replace("{{BODY}}", "x")
        .replace("stat_prefix: ingress", "stat_prefix: [");
    let err = Envoy::try_start(EnvoyOptions::new(yaml))
        .unwrap_err()
        .to_string();
    assert!(err.contains("exited during startup"), "{err}");
    assert!(
        err.contains("end of sequence flow not found"),
        "no log tail in: {err}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn upstream_proxied_through_envoy_counts_requests() {
    let upstream = Upstream::start();
    let yaml = render_template(PROXY_YAML, &[("UPSTREAM_PORT", &upstream.port())]);
    let envoy = Envoy::start(EnvoyOptions::new(yaml));

    let resp = send(
        envoy.listener_port("ingress"),
        RequestSpec::post("/payments/transfers", "{}")
            .host("api.example.com")
            .header("x-tenant-id", "t-1"),
    )
    .await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.body, UPSTREAM_BODY);
    assert_eq!(resp.header("x-upstream"), Some("tollgate-e2e"));
    assert_eq!(upstream.requests(), 1);

    let last = upstream.last_request().unwrap();
    assert_eq!(last.method, "POST");
    assert_eq!(last.path, "/payments/transfers");
    assert_eq!(last.body, "{}");
    assert_eq!(last.header("x-tenant-id"), Some("t-1"));
    assert_eq!(last.header("host"), Some("api.example.com"));
    assert!(upstream
        .last_headers()
        .iter()
        .any(|(k, _)| k == "x-request-id"));
    assert_eq!(
        envoy.wait_counter(
            "cluster.backend.upstream_rq_total",
            1,
            Duration::from_secs(5)
        ),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_uses_the_requested_connections() {
    let envoy = direct_envoy("burst", 2);
    let port = envoy.listener_port("ingress");
    let results = burst_timed(port, 40, 4, |i| RequestSpec::get(format!("/r/{i}"))).await;

    assert_eq!(results.len(), 40);
    for (i, t) in results.iter().enumerate() {
        assert_eq!(t.index, i);
        assert_eq!(t.connection, i % 4);
        assert_eq!(
            (t.response.status, t.response.body.as_str()),
            (200, "burst")
        );
        assert!(t.latency < Duration::from_secs(5));
    }
    assert_eq!(
        envoy.wait_counter(
            "http.ingress.downstream_rq_total",
            40,
            Duration::from_secs(5)
        ),
        40
    );
    assert_eq!(envoy.counter("http.ingress.downstream_cx_total"), Some(4));
}

#[test]
fn redis_set_get_pause_resume_restart() {
    let redis = RedisServer::start();
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{}", redis.port()));
    assert_eq!(redis.cli(&["SET", "k", "v"]), "OK");
    assert_eq!(redis.cli(&["GET", "k"]), "v");
    assert_eq!(redis.cmd(&["INCRBY", "n", "5"]), Resp::Int(5));
    assert!(redis.cmd(&["NOSUCHCOMMAND"]).is_error());
    assert_eq!(
        redis.info_field("server", "redis_mode").as_deref(),
        Some("standalone")
    );

    redis.pause();
    let started = Instant::now();
    let err = redis
        .try_cmd(&["PING"], Duration::from_millis(300))
        .unwrap_err();
    assert!(err.to_string().contains("no reply"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(!redis.ping(Duration::from_millis(100)));

    redis.resume();
    assert!(redis.ping(Duration::from_secs(2)));
    assert_eq!(redis.cli(&["GET", "k"]), "v");

    let (port, pid) = (redis.port(), redis.pid());
    redis.restart();
    assert_eq!(redis.port(), port);
    assert_ne!(redis.pid(), pid);
    assert_eq!(redis.cmd(&["GET", "k"]), Resp::Nil);
    assert_eq!(redis.cli(&["FUNCTION", "LIST"]), "");
}

#[test]
fn redis_cluster_spreads_hash_tags_over_primaries() {
    let cluster = RedisCluster::start(3, 1);
    let nodes = cluster.nodes();
    assert_eq!(nodes.len(), 6);
    assert_eq!(cluster.urls().len(), 6);
    let primaries = cluster.primaries();
    let replicas = cluster.replicas();
    assert_eq!(primaries.len(), 3);
    assert_eq!(replicas.len(), 3);
    let slots: usize = primaries
        .iter()
        .flat_map(|p| &p.slots)
        .map(|(a, b)| usize::from(*b) - usize::from(*a) + 1)
        .sum();
    assert_eq!(slots, 16384);
    for r in &replicas {
        let primary = r.primary_id.as_deref().unwrap();
        assert!(primaries.iter().any(|p| p.id == primary));
    }
    for s in cluster.servers() {
        assert_eq!(
            s.cli(&["CLUSTER", "INFO"]).lines().next(),
            Some("cluster_state:ok")
        );
    }

    // Keys with different hash tags land on different primaries, and each is served there.
    let mut owners = std::collections::BTreeMap::new();
    for tag in [
        "tenant-a", "tenant-b", "tenant-c", "tenant-d", "tenant-e", "tenant-f",
    ] {
        let key = format!("tollgate:{{{tag}}}:policy:k");
        let slot = cluster.key_slot(&key);
        assert_eq!(cluster.key_slot(&format!("other:{{{tag}}}")), slot);
        let owner = cluster.primary_for_key(&key);
        assert!(owner.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)));
        let server = cluster.node(owner.port);
        assert_eq!(server.cli(&["SET", &key, tag]), "OK");
        assert_eq!(server.cli(&["GET", &key]), tag);
        owners.entry(owner.port).or_insert_with(Vec::new).push(key);
    }
    assert!(owners.len() >= 2, "all tags on one primary: {owners:?}");

    // A node that does not own the slot redirects.
    let (port, keys) = owners.iter().next().unwrap();
    let other = primaries.iter().find(|p| p.port != *port).unwrap();
    let moved = cluster.node(other.port).cli(&["GET", &keys[0]]);
    assert!(moved.starts_with("(error) MOVED"), "{moved}");
}

#[test]
fn redis_cluster_failover_swaps_roles() {
    let cluster = RedisCluster::start(3, 1);
    let key = "tollgate:{failover}:p:k";
    let old = cluster.primary_for_key(key);
    assert_eq!(cluster.node(old.port).cli(&["SET", key, "kept"]), "OK");

    let new_port = cluster.failover(old.port);
    assert_ne!(new_port, old.port);
    let nodes = cluster.nodes();
    let new = nodes.iter().find(|n| n.port == new_port).unwrap();
    let demoted = nodes.iter().find(|n| n.port == old.port).unwrap();
    assert_eq!(new.role, Role::Primary);
    assert_eq!(demoted.role, Role::Replica);
    assert_eq!(demoted.primary_id.as_deref(), Some(new.id.as_str()));
    assert_eq!(cluster.primary_for_key(key).port, new_port);
    assert_eq!(cluster.node(new_port).cli(&["GET", key]), "kept");
}

#[test]
fn redis_cluster_survives_a_killed_primary() {
    let cluster = RedisCluster::start(3, 1);
    let victim = cluster.primaries()[0].clone();
    let replica = cluster
        .replicas()
        .into_iter()
        .find(|r| r.primary_id.as_deref() == Some(victim.id.as_str()))
        .unwrap();
    cluster.kill_node(victim.port);
    cluster.wait_healthy(Duration::from_secs(20)).unwrap();

    let promoted = cluster
        .nodes()
        .into_iter()
        .find(|n| n.port == replica.port)
        .unwrap();
    assert_eq!(promoted.role, Role::Primary);
    assert_eq!(promoted.slots, victim.slots);
    let dead = cluster
        .nodes()
        .into_iter()
        .find(|n| n.port == victim.port)
        .unwrap();
    assert!(!dead.alive);
}

#[tokio::test]
async fn scripted_upstream_and_client_timeouts() {
    let fake = Upstream::with_handler(|req| {
        if req.path == "/slow" {
            MockResponse::new(200, "late").delay(Duration::from_secs(3))
        } else {
            MockResponse::new(503, r#"{"error":"UNAVAILABLE"}"#)
                .header("content-type", "application/json")
        }
    });
    let resp = send(fake.port(), RequestSpec::post("/v1/leases", "{}")).await;
    assert_eq!(resp.status, 503);
    assert_eq!(resp.body, r#"{"error":"UNAVAILABLE"}"#);

    let started = Instant::now();
    let err = try_send_timeout(
        fake.port(),
        RequestSpec::get("/slow"),
        Duration::from_millis(200),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("no response within"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(fake.wait_requests(2, Duration::from_secs(2)), 2);

    // Nobody listens on a port we just freed: every request fails, quickly, none retried.
    let closed = free_port();
    let results = try_burst(closed, 6, 3, |_| RequestSpec::get("/")).await;
    assert_eq!(results.len(), 6);
    assert!(results.iter().all(|r| r.is_err()));
}
