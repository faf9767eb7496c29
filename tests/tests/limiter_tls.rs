#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The limiter behind mutual TLS: real Envoys running the shipped `envoy/global-mtls.yaml`
//! (client certificate and limiter CA by SDS from files) lease from the real limiter serving
//! `--tls-cert/--tls-key/--tls-client-ca`; callers without a trusted certificate are refused in
//! the handshake and spend nothing; the limiter's certificate is replaced under traffic.
//! Every certificate is made here, at test time.

use std::time::{Duration, Instant};

use tollgate_e2e::mtls::MtlsSetup;
use tollgate_e2e::pki::{CertFiles, TestCa};
use tollgate_e2e::tls_client::TlsClient;
use tollgate_e2e::tollgate::{
    envoy_config, item, per_tenant_items_policy, prometheus_value, Limiter, Store,
};
use tollgate_e2e::{burst, http_blocking, paths, Envoy, EnvoyOptions, Upstream};

const TIMEOUT: Duration = Duration::from_secs(5);

/// The limiter is patient (exactness, not deadlines, is what these tests check).
fn policy(units: u64, per: &str, burst: u64) -> String {
    per_tenant_items_policy("per-tenant", units, per, burst, "2s")
}

/// The limiter's TLS flags (reloading every 100 ms), only callers naming `allow`.
fn limiter_flags(pki: &MtlsSetup, allow: &str) -> Vec<String> {
    let mut flags = pki.limiter_flags(allow);
    flags.extend(["--tls-reload-every".into(), "100ms".into()]);
    flags
}

/// A client of the limiter's port that trusts the limiter CA.
fn client(pki: &MtlsSetup, identity: Option<&CertFiles>) -> TlsClient {
    TlsClient::new(pki.limiter_ca.cert_pem(), identity)
}

fn new_pki() -> MtlsSetup {
    MtlsSetup::new(&paths::new_log_dir("", "pki"), GATEWAY_ID).unwrap()
}

/// The gateway's identity in its client certificate (a URI SAN).
const GATEWAY_ID: &str = "spiffe://test/ns/edge/sa/gateway";

fn start_limiter(pki: &MtlsSetup, policy: &str, allow: &str) -> Limiter {
    let flags = limiter_flags(pki, allow);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Limiter::start(policy, Store::Memory, &flags)
}

/// The shipped mTLS config, test-ready, reading the shipped SDS files pointed at this test's
/// certificates.
fn mtls_envoy(pki: &MtlsSetup, policy: &str, upstream: &Upstream, limiter_port: u16) -> Envoy {
    let config = envoy_config(
        "envoy/global-mtls.yaml",
        policy,
        upstream.port(),
        Some(limiter_port),
    );
    let config = pki.localize(&config).unwrap();
    Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("warn"))
}

fn limiter_metric(limiter: &Limiter, series: &str) -> f64 {
    prometheus_value(&limiter.metrics(), series)
}

fn lease_body(id: &str, tenant: &str, want: u64) -> String {
    format!(
        r#"{{"leases":[{{"id":"{id}","policy":"per-tenant","key":"{tenant}","min":1,"want":{want}}}]}}"#
    )
}

fn granted(body: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    v["leases"][0]["granted"].as_u64().unwrap()
}

/// The shipped production config is the shipped global config plus TLS on the limiter
/// cluster: nothing else may drift between the two.
#[test]
fn the_mtls_config_is_the_global_config_with_tls_to_the_limiter() {
    let read = |f: &str| std::fs::read_to_string(paths::workspace_root().join(f)).unwrap();
    let plain = read("envoy/global.yaml");
    let mtls = read("envoy/global-mtls.yaml");
    // Without comments, and without the transport socket and node blocks (the additions).
    let strip = |text: &str| -> Vec<String> {
        let mut out = Vec::new();
        let mut skip_deeper_than: Option<usize> = None;
        for line in text.lines() {
            let indent = line.len() - line.trim_start().len();
            if let Some(depth) = skip_deeper_than {
                if line.trim().is_empty() || indent > depth {
                    continue;
                }
                skip_deeper_than = None;
            }
            if line.trim_start().starts_with('#') || line.trim().is_empty() {
                continue;
            }
            if line.trim_start().starts_with("transport_socket:") || line == "node:" {
                skip_deeper_than = Some(indent);
                continue;
            }
            out.push(line.to_string());
        }
        out
    };
    assert_eq!(strip(&plain), strip(&mtls));
    assert!(mtls.contains("UpstreamTlsContext"));
    assert!(mtls.contains("alpn_protocols: [\"h2\"]"));
    let ca = read("envoy/tls/limiter-ca-sds.yaml");
    assert!(ca.contains("match_typed_subject_alt_names"), "{ca}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_lease_over_mutual_tls_and_hold_the_global_budget() {
    let pki = new_pki();
    let budget = 60;
    let policy = policy(1, "1h", budget);
    let limiter = start_limiter(&pki, &policy, GATEWAY_ID);
    let upstream = Upstream::start();
    let a = mtls_envoy(&pki, &policy, &upstream, limiter.port());
    let b = mtls_envoy(&pki, &policy, &upstream, limiter.port());
    let (port_a, port_b) = (a.listener_port("ingress"), b.listener_port("ingress"));
    let (ra, rb) = tokio::join!(
        burst(port_a, 300, 30, |i| item("acme", i)),
        burst(port_b, 300, 30, |i| item("acme", i)),
    );
    let all: Vec<_> = ra.into_iter().chain(rb).collect();
    let admitted = all.iter().filter(|r| r.status == 200).count() as u64;
    let statuses: std::collections::BTreeSet<u16> = all.iter().map(|r| r.status).collect();
    println!("admitted {admitted} of 600 against a global budget of {budget}: {statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
    assert!(admitted <= budget, "overshoot: {admitted}");
    // What h2c admits in the same shape (`global_limit.rs`): at most 5 % stranded in leases.
    assert!(admitted >= budget * 95 / 100, "only {admitted} admitted");
    assert_eq!(upstream.requests(), admitted);
    // Both Envoys did handshakes and the limiter accepted them.
    for envoy in [&a, &b] {
        let handshakes = envoy
            .counter("cluster.tollgate_limiter.ssl.handshake")
            .unwrap_or(0);
        assert!(handshakes >= 1, "no TLS handshake to the limiter");
    }
    let accepted = limiter_metric(
        &limiter,
        "tollgate_limiter_tls_connections_total{result=\"accepted\"}",
    );
    assert!(accepted >= 2.0, "accepted {accepted}");
    // The admin listener serves probes in plaintext; it has no lease endpoint.
    let admin = limiter.admin_port();
    assert_eq!(
        http_blocking::get(admin, "/readyz", TIMEOUT)
            .unwrap()
            .status,
        200
    );
    let post =
        http_blocking::post(admin, "/v1/leases", &lease_body("x", "acme", 1), TIMEOUT).unwrap();
    assert_eq!(post.status, 404, "{}", post.body);
}

#[test]
fn callers_without_a_trusted_allowed_certificate_spend_nothing() {
    let pki = new_pki();
    let budget = 10;
    let limiter = start_limiter(&pki, &policy(1, "1h", budget), "gateway");
    let port = limiter.port();
    let elsewhere = TestCa::new("someone else's CA");
    let foreign = elsewhere.client(&pki.dir, "foreign", None);
    let expired = pki.gateway_ca.expired_client(&pki.dir, "expired");
    let intruder = pki.gateway_ca.client(&pki.dir, "intruder", None);
    let attempts: [(&str, Option<&CertFiles>, &str); 4] = [
        ("no certificate", None, "no_client_certificate"),
        ("another CA", Some(&foreign), "untrusted_client"),
        ("expired", Some(&expired), "expired_client"),
        ("not allowed", Some(&intruder), "client_not_allowed"),
    ];
    for (what, identity, result) in attempts {
        for round in 0..3 {
            let answer = client(&pki, identity).request(
                port,
                "POST",
                "/v1/leases",
                &lease_body(&format!("{result}-{round}"), "acme", budget),
                TIMEOUT,
            );
            assert!(answer.is_err(), "{what}: leased anyway: {answer:?}");
        }
        let counted = limiter_metric(
            &limiter,
            &format!("tollgate_limiter_tls_connections_total{{result=\"{result}\"}}"),
        );
        assert_eq!(counted, 3.0, "{what}: {result} counted {counted}");
    }
    // Plaintext to the TLS port is no way in either.
    let plain = http_blocking::post(
        port,
        "/v1/leases",
        &lease_body("p", "acme", budget),
        TIMEOUT,
    );
    assert!(plain.map(|r| r.status != 200).unwrap_or(true));
    // No lease logic ran: no decision of any kind was counted...
    let metrics = limiter.metrics();
    assert!(
        !metrics.contains("tollgate_limiter_decisions_total{"),
        "a refused caller reached the lease logic:\n{metrics}"
    );
    // ...and the whole budget is still there for the gateway.
    let gateway = client(&pki, Some(&pki.gateway))
        .request(
            port,
            "POST",
            "/v1/leases",
            &lease_body("g", "acme", budget),
            TIMEOUT,
        )
        .unwrap();
    assert_eq!(gateway.status, 200, "{}", gateway.body);
    assert_eq!(granted(&gateway.body), budget, "{}", gateway.body);
    // Key material never reaches the logs.
    let logs = limiter.logs();
    for key in [&pki.limiter.key_pem, &pki.gateway.key_pem] {
        for line in key.lines().filter(|l| !l.starts_with("-----")) {
            assert!(!logs.contains(line), "key material in the limiter's logs");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limiter_certificate_is_replaced_under_traffic_without_a_failed_request() {
    let pki = new_pki();
    // Far more budget than the traffic needs: every request must pass.
    let policy = policy(100_000, "1s", 100_000);
    let limiter = start_limiter(&pki, &policy, GATEWAY_ID);
    let upstream = Upstream::start();
    let envoy = mtls_envoy(&pki, &policy, &upstream, limiter.port());
    let port = envoy.listener_port("ingress");
    let before = client(&pki, Some(&pki.gateway))
        .request(limiter.port(), "GET", "/healthz", "", TIMEOUT)
        .unwrap();
    assert_eq!(before.server_cert, pem_der(&pki.limiter.cert_pem));

    let traffic = tokio::spawn(async move {
        let mut responses = Vec::new();
        let started = Instant::now();
        let mut round = 0;
        // Each round asks for new tenants, so callouts go on all the time.
        while started.elapsed() < Duration::from_secs(4) {
            let tenant = format!("t{round}");
            responses.extend(burst(port, 20, 4, |i| item(&tenant, i)).await);
            round += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        responses
    });
    // A second into the traffic, a renewal: new key, new certificate, same names. Each file is
    // replaced by a rename, as a secret volume or cert-manager would.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let renewed_dir = pki.dir.join("renewed");
    std::fs::create_dir_all(&renewed_dir).unwrap();
    let renewed =
        pki.limiter_ca
            .server(&renewed_dir, "limiter", &["tollgate-limiter", "localhost"]);
    std::fs::rename(&renewed.key, &pki.limiter.key).unwrap();
    std::fs::rename(&renewed.cert, &pki.limiter.cert).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while limiter_metric(
        &limiter,
        "tollgate_limiter_tls_reloads_total{result=\"ok\"}",
    ) < 1.0
    {
        assert!(
            Instant::now() < deadline,
            "the new certificate was not loaded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let responses = traffic.await.unwrap();
    let failed: Vec<_> = responses.iter().filter(|r| r.status != 200).collect();
    println!(
        "{} requests across the renewal, {} not 200",
        responses.len(),
        failed.len()
    );
    assert!(
        responses.len() >= 200,
        "too little traffic: {}",
        responses.len()
    );
    assert!(failed.is_empty(), "failed: {:?}", failed.first());
    // New connections get the new certificate; Envoy keeps leasing.
    let after = client(&pki, Some(&pki.gateway))
        .request(limiter.port(), "GET", "/healthz", "", TIMEOUT)
        .unwrap();
    assert_eq!(after.server_cert, pem_der(&renewed.cert_pem));
    assert_ne!(after.server_cert, before.server_cert);
    let last = burst(port, 10, 2, |i| item("after-renewal", i)).await;
    assert!(last.iter().all(|r| r.status == 200));
}

fn pem_der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .as_ref()
        .to_vec()
}
