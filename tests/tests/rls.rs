#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The limiter as Envoy's RateLimitService: real Envoys running the shipped
//! `envoy/ratelimit-service.yaml` (Envoy's own `envoy.filters.http.ratelimit` filter, no Wasm)
//! call the real limiter serving the shipped `deploy/ratelimit/config/edge.yaml` (envoyproxy/
//! ratelimit's format) over gRPC, counting in a real redis-server. Exact admitted counts per
//! descriptor kind (request_headers, remote_address, generic_key, header_value_match, nested,
//! value-specific, hits_addend), one budget shared by two Envoys, shadow mode, unlimited,
//! response headers, reload, Redis killed (fail closed and open), hostile gRPC input from a
//! tonic client, and the listener behind mutual TLS.
//!
//! Every limit is per hour, so a test never straddles a window unless it starts in the last
//! seconds of an hour ([`away_from_the_hour`] waits those out).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use tollgate_e2e::mtls::MtlsSetup;
use tollgate_e2e::process::wait_for;
use tollgate_e2e::tollgate::{prometheus_value, Limiter, Store};
use tollgate_e2e::{
    burst, free_port, paths, send, Envoy, EnvoyOptions, RedisServer, RequestSpec, Upstream,
};

/// No lease policies: the limiter serves the RateLimitService only.
const NO_POLICIES: &str = r#"{"policies":[]}"#;

/// Waits out the last 15 seconds of an hour, so the hourly windows of a test are one window.
fn away_from_the_hour() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let left = 3_600 - now % 3_600;
    if left < 15 {
        std::thread::sleep(Duration::from_secs(left + 1));
    }
}

/// A limiter serving the RateLimitService on a free port from a copy of the shipped
/// ratelimit configuration (in a directory of its own, which tests may edit); returns it with
/// the RateLimitService's port and the configuration directory.
fn start_limiter(store: Store, extra: &[&str]) -> (Limiter, u16, PathBuf) {
    let dir = paths::new_log_dir("", "rls-config");
    std::fs::copy(
        paths::workspace_root().join("deploy/ratelimit/config/edge.yaml"),
        dir.join("config.yaml"),
    )
    .unwrap();
    let rls_port = free_port();
    let listen = format!("127.0.0.1:{rls_port}");
    let dir_flag = dir.display().to_string();
    let mut flags = vec![
        "--rls-listen",
        &listen,
        "--rls-config",
        &dir_flag,
        "--rls-config-poll",
        "100ms",
    ];
    flags.extend_from_slice(extra);
    let limiter = Limiter::start(NO_POLICIES, store, &flags);
    limiter.wait_ready();
    (limiter, rls_port, dir)
}

/// The shipped Envoy config on free ports, calling the RateLimitService on `rls_port`,
/// changed by `edit`.
fn rls_envoy(upstream: &Upstream, rls_port: u16, edit: impl Fn(String) -> String) -> (Envoy, u16) {
    let shipped =
        std::fs::read_to_string(paths::workspace_root().join("envoy/ratelimit-service.yaml"))
            .unwrap();
    let config = shipped
        .replace("port_value: 10000", "port_value: 0")
        .replace("port_value: 9901", "port_value: 0")
        .replace(
            "port_value: 10001",
            &format!("port_value: {}", upstream.port()),
        )
        .replace("port_value: 8082", &format!("port_value: {rls_port}"));
    let envoy = Envoy::start(
        EnvoyOptions::new(edit(config))
            .concurrency(2)
            .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

fn tenant(path: &str, tenant: &str) -> RequestSpec {
    RequestSpec::get(path).header("x-tenant-id", tenant)
}

/// Sends `n` requests one after another; the number answered 200 (every other answer must
/// be `refused`).
async fn admitted(port: u16, n: usize, refused: u16, spec: impl Fn() -> RequestSpec) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        let r = send(port, spec()).await;
        match r.status {
            200 => ok += 1,
            s => assert_eq!(s, refused, "{r:?}"),
        }
    }
    ok
}

fn limiter_metric(limiter: &Limiter, series: &str) -> f64 {
    prometheus_value(&limiter.metrics(), series)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_admits_exactly_each_descriptors_budget() {
    away_from_the_hour();
    let redis = RedisServer::start();
    let (limiter, rls_port, _) =
        start_limiter(Store::Redis(redis.url()), &["--rls-response-headers"]);
    let upstream = Upstream::start();
    let (_envoy, port) = rls_envoy(&upstream, rls_port, |c| c);

    // request_headers → tenant: the default rate (5), and a value-specific one (20).
    assert_eq!(
        admitted(port, 8, 429, || tenant("/items/1", "acme")).await,
        5
    );
    assert_eq!(
        admitted(port, 8, 429, || tenant("/items/1", "globex")).await,
        5
    );
    assert_eq!(
        admitted(port, 24, 429, || tenant("/items/1", "vip")).await,
        20
    );
    // remote_address: every request comes from 127.0.0.1.
    assert_eq!(admitted(port, 5, 429, || RequestSpec::get("/ip")).await, 3);
    // Nested (tenant + header_value_match, 2) with the tenant's own descriptor (5) in the same
    // request: the bulk calls stop at 2, having spent 2 of the tenant's 5.
    assert_eq!(
        admitted(port, 4, 429, || tenant("/bulk/run", "initech")).await,
        2
    );
    assert_eq!(
        admitted(port, 5, 429, || tenant("/items/1", "initech")).await,
        3
    );
    // generic_key, unlimited.
    assert_eq!(
        admitted(port, 30, 429, || RequestSpec::get("/health")).await,
        30
    );
    // generic_key, shadow mode: a limit of 1, all admitted, the rest counted.
    assert_eq!(
        admitted(port, 4, 429, || RequestSpec::get("/reports")).await,
        4
    );
    assert_eq!(
        limiter_metric(
            &limiter,
            "tollgate_limiter_rls_descriptors_total{domain=\"edge\",outcome=\"shadow_over_limit\"}"
        ),
        3.0
    );
    // hits_addend from `x-cost`: 2 + 2 of 5, then a third 2 does not fit but a 1 does.
    let cost = |c: &'static str| move || tenant("/cost", "umbrella").header("x-cost", c);
    assert_eq!(admitted(port, 3, 429, cost("2")).await, 2);
    assert_eq!(admitted(port, 2, 429, cost("1")).await, 1);
    assert_eq!(upstream.requests(), 5 + 5 + 20 + 3 + 2 + 3 + 30 + 4 + 2 + 1);

    // Response headers: the tightest descriptor's, on admitted and refused answers.
    let r = send(port, tenant("/items/1", "hooli")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("ratelimit-limit"), Some("5"), "{r:?}");
    assert_eq!(r.header("ratelimit-remaining"), Some("4"), "{r:?}");
    let reset: u64 = r.header("ratelimit-reset").unwrap().parse().unwrap();
    assert!((1..=3_600).contains(&reset), "{reset}");
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"default\";q=5;w=3600"),
        "{r:?}"
    );
    let r = send(port, tenant("/items/1", "acme")).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-remaining"), Some("0"), "{r:?}");

    let over = limiter_metric(
        &limiter,
        "tollgate_limiter_rls_descriptors_total{domain=\"edge\",outcome=\"over_limit\"}",
    );
    assert!(over >= 3.0 + 3.0 + 4.0 + 2.0, "{over}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_envoys_share_one_budget_exactly() {
    away_from_the_hour();
    let redis = RedisServer::start();
    let (_limiter, rls_port, _) = start_limiter(Store::Redis(redis.url()), &[]);
    let upstream = Upstream::start();
    let (_a, port_a) = rls_envoy(&upstream, rls_port, |c| c);
    let (_b, port_b) = rls_envoy(&upstream, rls_port, |c| c);
    let (ra, rb) = tokio::join!(
        burst(port_a, 40, 8, |_| tenant("/items/1", "vip")),
        burst(port_b, 40, 8, |_| tenant("/items/1", "vip")),
    );
    let all: Vec<_> = ra.into_iter().chain(rb).collect();
    let ok = all.iter().filter(|r| r.status == 200).count();
    assert_eq!(ok, 20, "the vip budget is 20 an hour");
    assert!(all.iter().all(|r| r.status == 200 || r.status == 429));
    assert_eq!(upstream.requests(), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_unavailable_and_envoy_s_failure_mode_decides() {
    away_from_the_hour();
    let redis = RedisServer::start();
    let (limiter, rls_port, _) = start_limiter(Store::Redis(redis.url()), &[]);
    let upstream = Upstream::start();
    let (_closed, closed) = rls_envoy(&upstream, rls_port, |c| c);
    let (_open, open) = rls_envoy(&upstream, rls_port, |c| {
        c.replace("failure_mode_deny: true", "failure_mode_deny: false")
    });
    assert_eq!(send(closed, tenant("/items/1", "a")).await.status, 200);
    redis.kill();
    let unavailable =
        "tollgate_limiter_rls_descriptors_total{domain=\"edge\",outcome=\"unavailable\"}";
    let before = limiter_metric(&limiter, unavailable);
    for _ in 0..3 {
        let started = Instant::now();
        let r = send(closed, tenant("/items/1", "a")).await;
        assert_eq!(
            r.status, 500,
            "failure_mode_deny: true → status_on_error: {r:?}"
        );
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        let started = Instant::now();
        let r = send(open, tenant("/items/1", "a")).await;
        assert_eq!(
            r.status, 200,
            "failure_mode_deny: false lets it through: {r:?}"
        );
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
    }
    let after = limiter_metric(&limiter, unavailable);
    assert!(after >= before + 6.0, "{before} → {after}");
    // In the limiter's store metrics too: calls before, errors after.
    let text = limiter.metrics();
    assert!(
        text.lines().any(
            |l| l.starts_with("tollgate_limiter_store_call_duration_seconds_count")
                && l.contains("op=\"rls\"")
        ),
        "{text}"
    );
    assert!(
        text.contains("tollgate_limiter_store_errors_total{"),
        "{text}"
    );
    // Never counted as over limit.
    assert_eq!(
        limiter_metric(
            &limiter,
            "tollgate_limiter_rls_descriptors_total{domain=\"edge\",outcome=\"over_limit\"}"
        ),
        0.0
    );
}

fn request(domain: &str, descriptors: Vec<Vec<(&str, String)>>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: descriptors
            .into_iter()
            .map(|entries| RateLimitDescriptor {
                entries: entries
                    .into_iter()
                    .map(|(key, value)| Entry {
                        key: key.into(),
                        value,
                    })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        hits_addend: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_grpc_input_gets_clear_statuses_and_service_goes_on() {
    let (limiter, rls_port, _) = start_limiter(Store::Memory, &[]);
    let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{rls_port}"))
        .await
        .unwrap();
    let fine = |i: usize| request("edge", vec![vec![("tenant", format!("fine-{i}"))]]);
    let cases: Vec<(RateLimitRequest, tonic::Code, &str)> = vec![
        (
            request("edge", vec![vec![("tenant", "t".to_string())]; 10_000]),
            tonic::Code::InvalidArgument,
            "descriptors: 10000 of them, at most 64",
        ),
        (
            request("edge", vec![vec![("tenant", "v".repeat(64 * 1024))]]),
            tonic::Code::InvalidArgument,
            "descriptors[0].entries[0].value: longer than 4096 bytes",
        ),
        (
            request("edge", vec![vec![]]),
            tonic::Code::InvalidArgument,
            "descriptors[0].entries: none",
        ),
        (
            request("", vec![vec![("tenant", "t".to_string())]]),
            tonic::Code::InvalidArgument,
            "domain: empty",
        ),
        (
            request("edge", vec![vec![("tenant", "v".repeat(1 << 20))]]),
            tonic::Code::OutOfRange,
            "message length too large",
        ),
    ];
    for (i, (req, code, message)) in cases.into_iter().enumerate() {
        let status = client.should_rate_limit(req).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(message), "{status:?}");
        // The service goes on.
        let ok = client
            .should_rate_limit(fine(i))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ok.overall_code, Code::Ok as i32);
    }
    // An unknown domain: OK without a limit (as envoyproxy/ratelimit), counted.
    let r = client
        .should_rate_limit(request("nope", vec![vec![("tenant", "t".into())]]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses.len(), 1);
    assert!(r.statuses[0].current_limit.is_none());
    assert_eq!(
        limiter_metric(
            &limiter,
            "tollgate_limiter_rls_descriptors_total{domain=\"(unknown)\",outcome=\"unknown_domain\"}"
        ),
        1.0
    );
    assert_eq!(
        limiter_metric(
            &limiter,
            "tollgate_limiter_rls_calls_total{answer=\"none\",grpc_code=\"INVALID_ARGUMENT\"}"
        ),
        4.0
    );
    // The statuses of a counted descriptor.
    let r = client
        .should_rate_limit(fine(0))
        .await
        .unwrap()
        .into_inner();
    let s = &r.statuses[0];
    assert_eq!(s.code, Code::Ok as i32);
    assert_eq!(s.current_limit.as_ref().unwrap().requests_per_unit, 5);
    assert_eq!(s.limit_remaining, 3);
    let reset = s.duration_until_reset.unwrap();
    assert!((0..=3_600).contains(&reset.seconds), "{reset:?}");
}

/// A ratelimit configuration with the tenant's default rate set to `rate`.
fn with_tenant_rate(rate: u32) -> String {
    std::fs::read_to_string(paths::workspace_root().join("deploy/ratelimit/config/edge.yaml"))
        .unwrap()
        .replacen(
            "rate_limit: { unit: hour, requests_per_unit: 5 }",
            &format!("rate_limit: {{ unit: hour, requests_per_unit: {rate} }}"),
            1,
        )
}

fn write_atomically(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_configuration_is_reloaded_and_a_bad_one_ignored() {
    away_from_the_hour();
    let (limiter, rls_port, dir) = start_limiter(Store::Memory, &[]);
    let upstream = Upstream::start();
    let (_envoy, port) = rls_envoy(&upstream, rls_port, |c| c);
    let reloads = |result: &str| {
        limiter_metric(
            &limiter,
            &format!("tollgate_limiter_rls_config_reloads_total{{result=\"{result}\"}}"),
        )
    };
    write_atomically(&dir, "config.yaml", &with_tenant_rate(2));
    wait_for("reload", Duration::from_secs(10), || {
        (reloads("ok") >= 1.0).then_some(())
    })
    .unwrap();
    assert_eq!(admitted(port, 4, 429, || tenant("/items/1", "r1")).await, 2);
    // An invalid file (an unknown unit) is refused; the configuration in force stays.
    write_atomically(
        &dir,
        "config.yaml",
        &with_tenant_rate(7).replace(
            "unit: hour, requests_per_unit: 7",
            "unit: fortnight, requests_per_unit: 7",
        ),
    );
    wait_for("refusal", Duration::from_secs(10), || {
        (reloads("invalid") >= 1.0).then_some(())
    })
    .unwrap();
    assert_eq!(admitted(port, 4, 429, || tenant("/items/1", "r2")).await, 2);
    assert!(limiter.logs().contains("fortnight"), "the reason is logged");
}

/// The RateLimitService cluster of the shipped config over TLS to the limiter, with the
/// gateway's client certificate or without one.
fn tls_cluster(config: String, pki: &MtlsSetup, with_client_cert: bool) -> String {
    let certificate = if with_client_cert {
        format!(
            "
          tls_certificates:
          - certificate_chain: {{ filename: {} }}
            private_key: {{ filename: {} }}",
            pki.gateway.cert.display(),
            pki.gateway.key.display()
        )
    } else {
        String::new()
    };
    let socket = format!(
        "    connect_timeout: 0.25s
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: tollgate-limiter
        common_tls_context:
          alpn_protocols: [\"h2\"]{certificate}
          validation_context:
            trusted_ca: {{ filename: {} }}
            match_typed_subject_alt_names:
            - san_type: DNS
              matcher: {{ exact: tollgate-limiter }}
",
        pki.limiter_ca_file.display()
    );
    let (head, cluster) = config.split_once("  - name: tollgate_rls\n").unwrap();
    let cluster = cluster.replacen("    connect_timeout: 0.25s\n", &socket, 1);
    format!("{head}  - name: tollgate_rls\n{cluster}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_mutual_tls_a_client_certificate_is_required() {
    away_from_the_hour();
    let pki = MtlsSetup::new(&paths::new_log_dir("", "pki"), "spiffe://test/gateway").unwrap();
    let flags = pki.limiter_flags("spiffe://test/gateway");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let (limiter, rls_port, _) = start_limiter(Store::Memory, &flags);
    let upstream = Upstream::start();
    let (_trusted, trusted) = rls_envoy(&upstream, rls_port, |c| tls_cluster(c, &pki, true));
    let (_anonymous, anonymous) = rls_envoy(&upstream, rls_port, |c| tls_cluster(c, &pki, false));
    assert_eq!(
        admitted(trusted, 7, 429, || tenant("/items/1", "tls")).await,
        5
    );
    // Refused in the handshake: the RateLimitService never answers, Envoy fails closed.
    let r = send(anonymous, tenant("/items/1", "other")).await;
    assert_eq!(r.status, 500, "{r:?}");
    let refused = limiter_metric(
        &limiter,
        "tollgate_limiter_tls_connections_total{result=\"no_client_certificate\"}",
    );
    assert!(refused >= 1.0, "{refused}");
    assert_eq!(upstream.requests(), 5);
}

#[test]
fn plaintext_off_loopback_is_refused_unless_said_so() {
    let port = free_port();
    let listen = format!("0.0.0.0:{port}");
    let config = paths::workspace_root().join("deploy/ratelimit/config");
    let config = config.display().to_string();
    let e = Limiter::try_start(
        NO_POLICIES,
        Store::Memory,
        &["--rls-listen", &listen, "--rls-config", &config],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--rls-listen") && e.contains("not a loopback"),
        "{e}"
    );
    let port = free_port();
    let listen = format!("0.0.0.0:{port}");
    let limiter = Limiter::start(
        NO_POLICIES,
        Store::Memory,
        &[
            "--rls-listen",
            &listen,
            "--rls-config",
            &config,
            "--insecure-plaintext",
        ],
    );
    assert!(limiter.logs().contains("RateLimitService (gRPC) listening"));
}

mod ops;

/// deploy/ratelimit/istio-envoyfilter.yaml passes Istio's EnvoyFilter schema, names the
/// cluster Istio builds for the limiter's Service on the RateLimitService port, and its two
/// patches (the filter, the virtual host's `rate_limits`) do what they say in a real Envoy:
/// assembled into a bootstrap as Istio would insert them, against the limiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_istio_envoyfilter_example_is_valid_and_limits_in_envoy() {
    use serde_json::{json, Value};
    let file = ops::root().join("deploy/ratelimit/istio-envoyfilter.yaml");
    let mut cmd = std::process::Command::new(ops::tool("node"));
    cmd.arg(ops::root().join("tools/istio-schema/validate.mjs"));
    cmd.arg(&file);
    let out = ops::run(cmd);
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        report.contains("1 Istio resource(s) checked, 0 invalid"),
        "{report}"
    );

    let filter = ops::yaml_doc(&file);
    let patches = ops::field(&filter, "spec.configPatches")
        .as_array()
        .unwrap()
        .clone();
    let http_filter = ops::field(&patches[0], "patch.value").clone();
    let vhost_patch = ops::field(&patches[1], "patch.value").clone();
    let service = ops::yaml_doc(&ops::root().join("deploy/k8s/base/service.yaml"));
    let cluster = format!(
        "outbound|8082||{}.{}.svc.cluster.local",
        ops::str_field(&service, "metadata.name"),
        ops::str_field(&service, "metadata.namespace")
    );
    assert_eq!(
        ops::str_field(
            &http_filter,
            "typed_config.rate_limit_service.grpc_service.envoy_grpc.cluster_name"
        ),
        cluster
    );

    away_from_the_hour();
    let (_limiter, rls_port, _) = start_limiter(Store::Memory, &[]);
    let upstream = Upstream::start();
    let address =
        |port: u16| json!({ "socket_address": { "address": "127.0.0.1", "port_value": port } });
    let cluster_of = |name: &str, port: u16, h2: bool| {
        let mut c = json!({
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": { "cluster_name": name, "endpoints": [{ "lb_endpoints": [
                { "endpoint": { "address": address(port) } }] }] }
        });
        if h2 {
            c["typed_extension_protocol_options"] = json!({
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": { "http2_protocol_options": {} } } });
        }
        c
    };
    let mut vhost = json!({
        "name": "all", "domains": ["*"],
        "routes": [{ "match": { "prefix": "/" }, "route": { "cluster": "demo_upstream" } }]
    });
    for (k, v) in vhost_patch.as_object().unwrap() {
        vhost[k] = v.clone();
    }
    let static_resources: Value = json!({
            "listeners": [{ "name": "ingress", "address": address(0), "filter_chains": [{ "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "ingress",
                    "route_config": { "virtual_hosts": [vhost] },
                    "http_filters": [http_filter, {
                        "name": "envoy.filters.http.router",
                        "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" } }]
                } }] }] }],
            "clusters": [cluster_of("demo_upstream", upstream.port(), false), cluster_of(&cluster, rls_port, true)]
    });
    let envoy = Envoy::start(
        // YAML, JSON inside: the harness reads the `admin:` block as written.
        EnvoyOptions::new(format!(
            "admin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: 0 }}\n\
             static_resources: {static_resources}\n"
        ))
        .concurrency(1)
        .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    assert_eq!(admitted(port, 7, 429, || tenant("/any", "mesh")).await, 5);
}
