#![cfg(feature = "e2e")]
//! Smoke tests for the e2e harness itself: each helper does what it promises against the
//! real programs (Envoy, redis-server), so failures in feature tests are about tollgate.

use std::time::{Duration, Instant};

use tollgate_e2e::client::try_send_timeout;
use tollgate_e2e::metered;
use tollgate_e2e::redis::Role;
use tollgate_e2e::upstream::{MockResponse, UPSTREAM_BODY};
use tollgate_e2e::{
    burst_timed, free_port, render_template, send, try_burst, try_send_streamed, Envoy,
    EnvoyOptions, HarnessError, MeteredRequest, MeteredUpstream, RedisCluster, RedisServer,
    RequestSpec, Resp, Upstream, UsageIn, Wire,
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

// ---- The metered upstream (tests/src/metered.rs), directly and through a plain Envoy ----

/// A plain Envoy (no tollgate filter) in front of one [`MeteredUpstream`], reached over two
/// clusters: `/h1/...` over HTTP/1.1 (trailers enabled), `/h2/...` over h2c. `.../timeout/...`
/// routes give up after 300 ms. Trailers go on to HTTP/1.1 clients (`enable_trailers`), and
/// every request is logged to `access.log` in Envoy's log directory (its working directory).
const METERED_YAML: &str = r#"
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
          http_protocol_options: { enable_trailers: true }
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: access.log
              log_format:
                text_format_source:
                  inline_string: "tag=%REQ(x-request-tag)% status=%RESPONSE_CODE% flags=%RESPONSE_FLAGS% upstream=%UPSTREAM_PROTOCOL% trailer=%TRAILER(x-usage-units)%\n"
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/h1/timeout/" }
                route: { cluster: backend_h1, timeout: 0.3s }
              - match: { prefix: "/h2/timeout/" }
                route: { cluster: backend_h2, timeout: 0.3s }
              - match: { prefix: "/h1/" }
                route: { cluster: backend_h1 }
              - match: { prefix: "/h2/" }
                route: { cluster: backend_h2 }
          http_filters:
          - name: envoy.filters.http.router
            typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
  clusters:
  - name: backend_h1
    connect_timeout: 1s
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: { enable_trailers: true }
    load_assignment:
      cluster_name: backend_h1
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: {{UPSTREAM_PORT}} } } }
  - name: backend_h2
    connect_timeout: 1s
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {}
    load_assignment:
      cluster_name: backend_h2
      endpoints:
      - lb_endpoints:
        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: {{UPSTREAM_PORT}} } } }
"#;

const T: Duration = Duration::from_secs(10);

fn metered_envoy(upstream: &MeteredUpstream) -> Envoy {
    Envoy::start(EnvoyOptions::new(render_template(
        METERED_YAML,
        &[("UPSTREAM_PORT", &upstream.port())],
    )))
}

/// The access log line of the request tagged `tag` (waits for the file writer's flush).
fn access_log_line(envoy: &Envoy, tag: &str) -> Result<String, HarnessError> {
    let path = envoy.log_dir().join("access.log");
    let needle = format!("tag={tag} ");
    let read = || std::fs::read_to_string(&path).unwrap_or_default();
    tollgate_e2e::process::wait_for(&format!("access log line {needle:?}"), T, || {
        read()
            .lines()
            .find(|l| l.starts_with(&needle))
            .map(str::to_owned)
    })
    .map_err(|e| HarnessError::new(format!("{e}; access.log:\n{}", read())))
}

#[tokio::test]
async fn metered_upstream_answers_directly() {
    let up = MeteredUpstream::start();
    let port = up.port();
    let get = |path: &str| RequestSpec::get(path);

    let r = send(port, get("/").usage(7).tag("a")).await;
    assert_eq!((r.status, r.body.as_str()), (200, metered::OK_BODY));
    assert_eq!(r.header(metered::USAGE_UNITS), Some("7"));
    assert_eq!(r.header(metered::REQUEST_TAG), Some("a"));

    let r = send(port, get("/").usage(7).usage_in(UsageIn::None).status(429)).await;
    assert_eq!((r.status, r.body.as_str()), (429, metered::OK_BODY));
    assert_eq!(r.header(metered::USAGE_UNITS), None);

    // A directive that does not parse is a 400 that names it.
    let r = send(port, get("/").header("x-usage-in", "body")).await;
    assert_eq!(r.status, 400);
    assert!(r.body.contains("x-usage-in"), "{}", r.body);

    // Trailers: always over h2; over HTTP/1.1 only when the request says `te: trailers`.
    let trailer = || get("/").usage(5).usage_in(UsageIn::Trailer).tag("t");
    let h2 = try_send_streamed(port, trailer(), Wire::H2c, T)
        .await
        .unwrap();
    assert_eq!((h2.status, h2.body.as_str()), (200, metered::OK_BODY));
    assert_eq!(h2.trailer(metered::USAGE_UNITS), Some("5"));
    let h1 = try_send_streamed(port, trailer().header("te", "trailers"), Wire::Http1, T)
        .await
        .unwrap();
    assert_eq!(h1.header("transfer-encoding"), Some("chunked"));
    assert_eq!(h1.trailer(metered::USAGE_UNITS), Some("5"));
    let h1 = try_send_streamed(port, trailer(), Wire::Http1, T)
        .await
        .unwrap();
    assert_eq!(h1.body, metered::OK_BODY);
    assert_eq!(h1.trailers, vec![]);

    up.wait_in_flight(0, T);
    assert_eq!(up.requests(), 6);
    assert_eq!((up.completed(), up.aborted()), (6, 0));
    assert_eq!(up.max_in_flight(), 1);
    assert_eq!(up.tags(), ["a", "t", "t", "t"]);
}

#[tokio::test]
async fn metered_shapes_arrive_whole_through_envoy() {
    let up = MeteredUpstream::start();
    let envoy = metered_envoy(&up);
    let port = envoy.listener_port("ingress");

    for proto in ["h1", "h2"] {
        let path = format!("/{proto}/v1/chat");
        let spec = || RequestSpec::post(path.as_str(), "{\"model\":\"m\"}");

        let r = send(port, spec().usage(11).tag(format!("{proto}-header"))).await;
        assert_eq!((r.status, r.body.as_str()), (200, metered::OK_BODY));
        assert_eq!(r.header(metered::USAGE_UNITS), Some("11"));

        let r = send(port, spec().usage(11).usage_in(UsageIn::None).status(503)).await;
        assert_eq!((r.status, r.body.as_str()), (503, metered::OK_BODY));
        assert_eq!(r.header(metered::USAGE_UNITS), None);

        let r = send(
            port,
            spec().usage(11).usage_in(UsageIn::Json).body_delay_ms(20),
        )
        .await;
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.body, metered::json_body(Some(11)));
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["usage"]["total_tokens"], 11);

        // SSE: every event, in order, streamed (100 ms between events: they cannot all
        // arrive as one chunk unless Envoy stalled for 400 ms).
        let r = try_send_streamed(
            port,
            spec()
                .usage(11)
                .usage_in(UsageIn::Sse)
                .sse_event_count(3)
                .body_delay_ms(100),
            Wire::Http1,
            T,
        )
        .await
        .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
        assert_eq!(r.body, metered::sse_events(3, Some(11)).concat());
        assert!(r.body.ends_with("data: [DONE]\n\n"));
        assert!(
            r.chunks.len() >= 2,
            "SSE arrived in one piece: {:?}",
            r.chunks
        );
    }

    up.wait_in_flight(0, T);
    assert_eq!(up.requests(), 8);
    assert_eq!((up.completed(), up.aborted()), (8, 0));
    assert_eq!(up.tags(), ["h1-header", "h2-header"]);
}

#[tokio::test]
async fn metered_trailer_reaches_envoy_and_clients() {
    let up = MeteredUpstream::start();
    let envoy = metered_envoy(&up);
    let port = envoy.listener_port("ingress");
    let spec = |proto: &str, tag: &str| {
        RequestSpec::get(format!("/{proto}/v1/chat"))
            .usage(42)
            .usage_in(UsageIn::Trailer)
            .body_delay_ms(30)
            .tag(tag)
    };

    // h2 towards the upstream: the trailer reaches Envoy, an h2c client, and (with the
    // listener's `enable_trailers`) an HTTP/1.1 client.
    let r = try_send_streamed(port, spec("h2", "h2-to-h2c"), Wire::H2c, T)
        .await
        .unwrap();
    assert_eq!((r.status, r.body.as_str()), (200, metered::OK_BODY));
    assert_eq!(r.trailer(metered::USAGE_UNITS), Some("42"), "{r:?}");
    let r = try_send_streamed(port, spec("h2", "h2-to-h1"), Wire::Http1, T)
        .await
        .unwrap();
    assert_eq!(r.body, metered::OK_BODY);
    assert_eq!(r.trailer(metered::USAGE_UNITS), Some("42"), "{r:?}");
    for tag in ["h2-to-h2c", "h2-to-h1"] {
        let line = access_log_line(&envoy, tag).unwrap();
        assert!(line.contains("upstream=HTTP/2 trailer=42"), "{line}");
    }

    // HTTP/1.1 towards the upstream, even with the cluster's `enable_trailers`: hyper sends
    // HTTP/1.1 trailers only to a request with `te: trailers`, which Envoy does not add but
    // forwards from the client. (Without `enable_trailers` on the cluster, Envoy drops them
    // even then.) Hence h2 towards an upstream whose usage comes in a trailer.
    for (tag, wire, te, expected) in [
        ("h1-to-h2c", Wire::H2c, false, None),
        ("h1-to-h1", Wire::Http1, false, None),
        ("h1-to-h2c-te", Wire::H2c, true, Some("42")),
        ("h1-to-h1-te", Wire::Http1, true, Some("42")),
    ] {
        let mut s = spec("h1", tag);
        if te {
            s = s.header("te", "trailers");
        }
        let r = try_send_streamed(port, s, wire, T).await.unwrap();
        assert_eq!(r.body, metered::OK_BODY, "{tag}");
        assert_eq!(r.trailer(metered::USAGE_UNITS), expected, "{tag}: {r:?}");
        let line = access_log_line(&envoy, tag).unwrap();
        let logged = format!("upstream=HTTP/1.1 trailer={}", expected.unwrap_or("-"));
        assert!(line.contains(&logged), "{tag}: {line}");
    }
    up.wait_in_flight(0, T);
    assert_eq!((up.completed(), up.aborted()), (6, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metered_burst_overlaps_and_drains() {
    const N: usize = 60;
    const DELAY_MS: u64 = 300;
    let up = MeteredUpstream::start();
    let envoy = metered_envoy(&up);
    let port = envoy.listener_port("ingress");

    let started = Instant::now();
    let results = burst_timed(port, N, N, |i| {
        let proto = if i % 2 == 0 { "h1" } else { "h2" };
        RequestSpec::get(format!("/{proto}/v1/chat"))
            .usage(1)
            .delay_ms(DELAY_MS)
            .tag(format!("r{i}"))
    })
    .await;
    let elapsed = started.elapsed();
    assert!(results.iter().all(|t| t.response.status == 200));
    up.wait_in_flight(0, T);

    // Every answer was in flight for at least DELAY_MS, all inside `elapsed`, so on average
    // N * DELAY_MS / elapsed were in flight at once: the maximum is at least that (however
    // slowly the machine sent them), and at most N.
    let elapsed_ms = u64::try_from(elapsed.as_millis()).unwrap().max(1);
    let lower_bound = N as u64 * DELAY_MS / elapsed_ms;
    let max = up.max_in_flight();
    eprintln!("burst of {N}: {elapsed:?}, max_in_flight {max} (lower bound {lower_bound})");
    assert!(
        (lower_bound.max(2)..=N as u64).contains(&max),
        "max_in_flight {max}, burst took {elapsed:?}"
    );
    assert_eq!(up.requests(), N as u64);
    assert_eq!((up.completed(), up.aborted()), (N as u64, 0));
    let mut tags = up.tags();
    tags.sort();
    let mut expected: Vec<String> = (0..N).map(|i| format!("r{i}")).collect();
    expected.sort();
    assert_eq!(tags, expected);

    up.reset_max_in_flight();
    assert_eq!(up.max_in_flight(), 0);
    let r = send(port, RequestSpec::get("/h2/one")).await;
    assert_eq!(r.status, 200);
    up.wait_in_flight(0, T);
    assert_eq!(up.max_in_flight(), 1);
}

#[tokio::test]
async fn metered_reset_after_headers_reaches_the_client() {
    let up = MeteredUpstream::start();
    let envoy = metered_envoy(&up);
    let port = envoy.listener_port("ingress");

    // Concurrently: an HTTP/1.1 client learns of the reset when Envoy closes the connection,
    // which it does after its `delayed_close_timeout` (1 s by default); h2c gets RST_STREAM.
    let mut cases = tokio::task::JoinSet::new();
    for proto in ["h1", "h2"] {
        for (place, wire) in [
            (UsageIn::Header, Wire::Http1),
            (UsageIn::Sse, Wire::Http1),
            (UsageIn::Header, Wire::H2c),
        ] {
            let tag = format!("{proto}-{}-{wire:?}", place.as_str());
            let spec = RequestSpec::get(format!("/{proto}/v1/chat"))
                .usage(3)
                .usage_in(place)
                .reset_after_headers()
                .tag(tag.as_str());
            cases.spawn(async move {
                let result = try_send_streamed(port, spec, wire, T).await;
                (tag, wire, result)
            });
        }
    }
    while let Some(case) = cases.join_next().await {
        let (tag, wire, result) = case.unwrap();
        let err = result.unwrap_err().to_string();
        if wire == Wire::Http1 {
            // The headers made it through, then the body was cut.
            assert!(
                err.contains("reading response body (status 200"),
                "{tag}: {err}"
            );
        }
        let line = access_log_line(&envoy, &tag).unwrap();
        assert!(line.contains("status=200 flags=U"), "{tag}: {line}");
    }
    up.wait_in_flight(0, T);
    assert_eq!(up.requests(), 6);
    assert_eq!((up.completed(), up.aborted()), (0, 6));
    // HTTP/1.1: the upstream closed the connection mid-response; h2: it reset the stream.
    for (stat, n) in [
        (
            "cluster.backend_h1.upstream_cx_destroy_remote_with_active_rq",
            3,
        ),
        ("cluster.backend_h2.upstream_rq_rx_reset", 3),
        ("http.ingress.downstream_rq_tx_reset", 6),
    ] {
        assert_eq!(envoy.wait_counter(stat, n, T), n, "{stat}");
    }
}

#[tokio::test]
async fn metered_route_timeout_releases_the_upstream() {
    const DELAY_MS: u64 = 30_000;
    let up = MeteredUpstream::start();
    let envoy = metered_envoy(&up);
    let port = envoy.listener_port("ingress");

    for (n, proto) in (1..).zip(["h1", "h2"]) {
        let tag = format!("{proto}-timeout");
        let started = Instant::now();
        let r = send(
            port,
            RequestSpec::get(format!("/{proto}/timeout/v1/chat"))
                .usage(3)
                .delay_ms(DELAY_MS)
                .tag(tag.as_str()),
        )
        .await;
        assert_eq!(
            (r.status, r.body.as_str()),
            (504, "upstream request timeout")
        );
        // Envoy closed the connection (HTTP/1.1) or reset the stream (h2): the upstream drops
        // the answer it was delaying, long before the delay is over.
        up.wait_in_flight(0, T);
        let released = started.elapsed();
        assert!(released < Duration::from_millis(DELAY_MS), "{released:?}");
        assert_eq!((up.requests(), up.completed(), up.aborted()), (n, 0, n));
        eprintln!("{tag}: 504 and upstream released after {released:?}");
        let line = access_log_line(&envoy, &tag).unwrap();
        assert!(line.contains("status=504 flags=UT"), "{line}");
        let stat = format!("cluster.backend_{proto}.upstream_rq_timeout");
        assert_eq!(envoy.wait_counter(&stat, 1, T), 1);
    }
}
