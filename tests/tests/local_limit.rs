#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of local (per-Envoy-instance) limiting: a real Envoy (`--concurrency 4`)
//! loads the freshly built filter with the shipped `envoy/local.yaml`, in front of a real HTTP
//! upstream, on loopback. Every test runs against both builds (`wasm::…` loads
//! `tollgate.wasm`, `native::…` the dynamic module `libtollgate_native.so`).

use tollgate_e2e::http_blocking::raw_status;

use serde_json::Value;
use std::time::Duration;
use tollgate_e2e::build::Build;
use tollgate_e2e::process;
use tollgate_e2e::tollgate::{self, envoy_config};
use tollgate_e2e::{burst, send, Envoy, EnvoyOptions, RequestSpec, Upstream};

const WORKERS: u32 = 4;

/// `envoy/local.yaml`, test-ready for `build`, with `policy` as the plugin configuration.
fn local_config(build: Build, policy: &str, upstream_port: u16) -> String {
    build.config(envoy_config(
        "envoy/local.yaml",
        policy,
        upstream_port,
        None,
    ))
}

fn start(build: Build, policy: &str, upstream: &Upstream) -> (Envoy, u16) {
    let envoy = Envoy::start(
        EnvoyOptions::new(local_config(build, policy, upstream.port()))
            .concurrency(WORKERS)
            .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

/// The payments policy with negligible refill (1 unit per hour), so a burst meets exactly the
/// bucket's capacity.
fn payments(enforce: bool, on_missing: &str) -> String {
    format!(
        r#"{{
  "policies": [{{
    "name": "payments-per-tenant",
    "match": {{ "hosts": ["api.example.com"],
               "routes": ["POST /payments/transfers", "GET /payments/transfers/{{id}}"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "on_missing_key": "{on_missing}",
    "rate": {{ "units": 1, "per": "1h" }},
    "burst": 20,
    "cost": {{ "POST /payments/transfers": 5 }},
    "on_unavailable": {{ "mode": "closed" }},
    "enforce": {enforce}
  }}]
}}"#
    )
}

fn lookup(tenant: &str, i: usize) -> RequestSpec {
    RequestSpec::get(format!("/payments/transfers/tx-{i}?expand=true"))
        .host("api.example.com")
        .header("x-tenant-id", tenant)
}

fn transfer(tenant: &str) -> RequestSpec {
    RequestSpec::post("/payments/transfers", "{}")
        .host("api.example.com")
        .header("x-tenant-id", tenant)
}

fn prometheus_value(envoy: &Envoy, metric: &str) -> u64 {
    let text = envoy.stats_prometheus();
    let name = metric.split('{').next().unwrap_or(metric);
    assert!(
        text.lines().any(|l| l
            .strip_prefix("envoy_dynamicmodulescustom_")
            .unwrap_or(l)
            .starts_with(name)),
        "no {metric} in /stats/prometheus:\n{text}"
    );
    tollgate::prometheus_value(&text, metric) as u64
}

#[test]
fn shipped_config_embeds_the_payments_policy() {
    tollgate::assert_embeds_policy("envoy/local.yaml", "policies/payments.json");
}

async fn a_burst_for_one_tenant_admits_exactly_the_burst(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(build, &payments(true, "deny"), &upstream);
    let responses = burst(port, 600, 60, |i| lookup("acme", i)).await;
    let ok = responses.iter().filter(|r| r.status == 200).count();
    let limited: Vec<_> = responses.iter().filter(|r| r.status == 429).collect();
    assert_eq!(ok, 20, "admitted");
    assert_eq!(limited.len(), 580, "statuses: {:?}", statuses(&responses));
    assert_eq!(upstream.requests(), 20);
    for r in &limited {
        // 1 unit per hour: the next unit is 3600 s away.
        assert_eq!(r.header("retry-after"), Some("3600"));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            r.header("ratelimit-policy"),
            Some("\"payments-per-tenant\";q=1;w=3600")
        );
        assert_eq!(
            r.header("ratelimit"),
            Some("\"payments-per-tenant\";r=0;t=3600")
        );
        let body: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"error": "rate limit exceeded", "policy": "payments-per-tenant", "retry_after_seconds": 3600})
        );
        assert!(!r.body.contains("acme"));
    }
    assert_eq!(
        prometheus_value(&envoy, "tollgate_allowed{policy=\"payments-per-tenant\"}"),
        20
    );
    assert_eq!(
        prometheus_value(&envoy, "tollgate_denied{policy=\"payments-per-tenant\"}"),
        580
    );
}

fn statuses(responses: &[tollgate_e2e::Response]) -> std::collections::BTreeMap<u16, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for r in responses {
        *counts.entry(r.status).or_default() += 1;
    }
    counts
}

async fn transfers_drain_five_units_and_lookups_one(build: Build) {
    let upstream = Upstream::start();
    let (_envoy, port) = start(build, &payments(true, "deny"), &upstream);
    let transfers = burst(port, 100, 20, |_| transfer("acme")).await;
    assert_eq!(transfers.iter().filter(|r| r.status == 200).count(), 4);
    // The bucket is empty: not even a 1-unit lookup passes.
    assert_eq!(send(port, lookup("acme", 1)).await.status, 429);
    // 3 transfers (15 units) then 5 lookups fill another tenant's 20 exactly.
    let mut admitted = Vec::new();
    for _ in 0..3 {
        admitted.push(send(port, transfer("bob")).await.status);
    }
    for i in 0..6 {
        admitted.push(send(port, lookup("bob", i)).await.status);
    }
    assert_eq!(admitted, vec![200, 200, 200, 200, 200, 200, 200, 200, 429]);
}

async fn tenants_never_share_state(build: Build) {
    let upstream = Upstream::start();
    let (_envoy, port) = start(build, &payments(true, "deny"), &upstream);
    // Tenant ids that an escaping bug would merge: separators, hash-tag braces, escapes.
    let tenants = ["a:b", "a%3ab", "{a}:b", "a", "A", "a b"];
    let responses = burst(port, tenants.len() * 60, 48, |i| {
        lookup(tenants[i % tenants.len()], i)
    })
    .await;
    for (t, tenant) in tenants.iter().enumerate() {
        let ok = responses
            .iter()
            .enumerate()
            .filter(|(i, r)| i % tenants.len() == t && r.status == 200)
            .count();
        assert_eq!(ok, 20, "tenant {tenant:?}");
    }
    // No identity: 403, and nothing is charged.
    let anonymous = send(
        port,
        RequestSpec::get("/payments/transfers/1").host("api.example.com"),
    )
    .await;
    assert_eq!(anonymous.status, 403);
    assert!(anonymous
        .body
        .contains("\"policy\":\"payments-per-tenant\""));
}

async fn shadow_mode_admits_all_and_counts_would_be_denials(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(build, &payments(false, "skip"), &upstream);
    let responses = burst(port, 200, 20, |i| lookup("acme", i)).await;
    assert!(
        responses.iter().all(|r| r.status == 200),
        "{:?}",
        statuses(&responses)
    );
    assert_eq!(upstream.requests(), 200);
    assert_eq!(
        prometheus_value(
            &envoy,
            "tollgate_shadow_denied{policy=\"payments-per-tenant\"}"
        ),
        180
    );
    assert_eq!(
        prometheus_value(&envoy, "tollgate_allowed{policy=\"payments-per-tenant\"}"),
        20
    );
    assert_eq!(
        prometheus_value(&envoy, "tollgate_denied{policy=\"payments-per-tenant\"}"),
        0
    );
}

fn a_bad_policy_is_refused_with_the_field_named(build: Build) {
    let upstream = Upstream::start();
    let bad = payments(true, "deny").replace("\"per\": \"1h\"", "\"per\": \"1 fortnight\"");
    let error = Envoy::try_start(
        EnvoyOptions::new(local_config(build, &bad, upstream.port()))
            .concurrency(1)
            .log_level("warn"),
    )
    .expect_err("Envoy started with an invalid policy");
    let message = error.to_string();
    assert!(
        message.contains("policy `payments-per-tenant`: policies[0].rate.per"),
        "{message}"
    );
    assert!(
        message.contains("invalid plugin configuration"),
        "{message}"
    );

    let unknown = payments(true, "deny").replace("\"burst\": 20", "\"burst\": 20, \"brust\": 1");
    let error = Envoy::try_start(
        EnvoyOptions::new(local_config(build, &unknown, upstream.port()))
            .concurrency(1)
            .log_level("warn"),
    )
    .expect_err("Envoy started with an unknown field");
    assert!(error.to_string().contains("brust"), "{error}");
}

async fn hostile_identities_neither_crash_the_filter_nor_merge_tenants(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(build, &payments(true, "deny"), &upstream);
    let huge = "x".repeat(50_000);
    let mut hostile: Vec<Vec<u8>> = vec![
        huge.clone().into_bytes(),
        vec![0xff, 0xfe, 0x80, b'{', b'}', b':'],
        b"{acme}".to_vec(),
        b"acme:GET".to_vec(),
        b"%7bacme%7d".to_vec(),
    ];
    hostile.push([huge.as_bytes(), b"y"].concat());
    for (n, id) in hostile.iter().enumerate() {
        for attempt in 0..21 {
            let mut request = format!(
                "GET /payments/transfers/{n} HTTP/1.1\r\nhost: api.example.com\r\nconnection: close\r\nx-tenant-id: "
            )
            .into_bytes();
            request.extend_from_slice(id);
            request.extend_from_slice(b"\r\n\r\n");
            let status = raw_status(port, &request);
            let expected = if attempt < 20 { 200 } else { 429 };
            assert_eq!(status, expected, "identity #{n}, request {attempt}");
        }
    }
    // `acme` itself is untouched by all of the above.
    assert_eq!(send(port, lookup("acme", 0)).await.status, 200);
    if build == Build::Wasm {
        assert_eq!(prometheus_value(&envoy, "envoy_wasm_tollgate_vm_reload"), 0);
    }
    assert!(!envoy.logs().contains("panicked"), "{}", envoy.logs());
}

async fn ten_thousand_tenants_stay_inside_the_slot_table(build: Build) {
    let upstream = Upstream::start();
    let slots = 1024;
    let policy = payments(true, "deny")
        .replace(
            "\"on_unavailable\": { \"mode\": \"closed\" }",
            "\"on_unavailable\": { \"mode\": \"open\" }",
        )
        .replace(
            "\"policies\": [{",
            &format!("\"local_table\": {{ \"slots\": {slots} }},\n  \"policies\": [{{"),
        );
    let (envoy, port) = start(build, &policy, &upstream);
    // Warm up connections, V8 and allocator pools, and fill the table: twice its slots in
    // tenants, so it holds all the records it can before the measurement (the native build's
    // table grows a group by one record per new key, up to its bound).
    let warmed = 2 * slots;
    let warm = burst(port, warmed, 8, |i| lookup(&format!("warm-{i}"), i)).await;
    assert!(warm.iter().all(|r| r.status == 200));
    let before = envoy.memory_allocated();
    let tenants = 10_000;
    let responses = burst(port, tenants, 8, |i| {
        lookup(&format!("tenant-{i:05}-{}", "p".repeat(40)), i)
    })
    .await;
    assert!(
        responses.iter().all(|r| r.status == 200),
        "{:?}",
        statuses(&responses)
    );
    // Every tenant beyond the table's capacity was decided by the failure mode (open).
    let full = prometheus_value(&envoy, "tollgate_local_table_full");
    let fail_open = prometheus_value(&envoy, "tollgate_fail_open{policy=\"payments-per-tenant\"}");
    assert_eq!(full, fail_open);
    assert!(
        full >= (tenants + warmed - slots) as u64,
        "table_full {full}"
    );
    // Unbounded keys would hold 10,000 × (key ≈ 60 B + value ≈ 100 B + map node) ≈ 2 MB for
    // good. The table is at its bound before the measurement, so growth is noise from
    // connections and stats (a few KB), or work still in flight when the burst ends (V8
    // compiling hot functions in the background on a loaded machine: once ~0.5 MB for a moment).
    // What stays is what counts: the growth must fall under the bound, awaited, not sampled once.
    let bound = 512 * 1024;
    let mut after = 0;
    let settled = process::wait_for(
        "Envoy's allocations to settle",
        Duration::from_secs(15),
        || {
            after = envoy.memory_allocated();
            (after.saturating_sub(before) < bound).then_some(())
        },
    );
    let growth = after.saturating_sub(before);
    println!("Envoy allocated before {before} B, after {after} B, growth {growth} B for {tenants} tenants");
    assert!(
        settled.is_ok(),
        "memory grew by {growth} bytes for {tenants} tenants and stayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_from_verified_jwt_claims() {
    let upstream = Upstream::start();
    let policy = payments(true, "deny").replace(
        r#""key": [{ "header": "x-tenant-id" }]"#,
        r#""key": [{ "jwt_claim": { "claim": "tenant" } }]"#,
    );
    assert!(policy.contains("jwt_claim"));
    let jwks = tollgate_e2e::jwt::jwks();
    // Envoy's jwt_authn verifies the token and puts its claims in dynamic metadata, where the
    // filter reads them; an unverified token never reaches tollgate.
    let jwt_filter = format!(
        r#"          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                tenants:
                  issuer: tollgate-e2e
                  local_jwks:
                    inline_string: '{jwks}'
                  payload_in_metadata: jwt_payload
              rules:
              - match: {{ prefix: "/" }}
                requires: {{ provider_name: tenants }}
"#
    );
    let config = local_config(Build::Wasm, &policy, upstream.port()).replacen(
        "          http_filters:\n",
        &format!("          http_filters:\n{jwt_filter}"),
        1,
    );
    let envoy = Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("warn"));
    let port = envoy.listener_port("ingress");
    let acme_alice = tollgate_e2e::jwt::token(r#""sub":"alice","tenant":"acme""#);
    let acme_bob = tollgate_e2e::jwt::token(r#""sub":"bob","tenant":"acme""#);
    let globex = tollgate_e2e::jwt::token(r#""sub":"carol","tenant":"globex""#);
    let with_token = |token: &str, i: usize| {
        RequestSpec::get(format!("/payments/transfers/{i}"))
            .host("api.example.com")
            .header("authorization", format!("Bearer {token}"))
            // A forged tenant header changes nothing: the key is the verified claim.
            .header("x-tenant-id", format!("forged-{i}"))
    };
    // Two users of tenant acme share acme's 20 units.
    let mut acme = Vec::new();
    for i in 0..15 {
        acme.push(send(port, with_token(&acme_alice, i)).await.status);
    }
    for i in 0..10 {
        acme.push(send(port, with_token(&acme_bob, i)).await.status);
    }
    assert_eq!(acme.iter().filter(|s| **s == 200).count(), 20, "{acme:?}");
    assert_eq!(acme.iter().filter(|s| **s == 429).count(), 5, "{acme:?}");
    assert_eq!(send(port, with_token(&globex, 0)).await.status, 200);
    // A token with a bad signature is refused by jwt_authn before tollgate sees it.
    // The first signature character is changed: all six of its bits are signature bits (the
    // last character may carry padding bits that decode to the same bytes).
    let (signed, signature) = globex.rsplit_once('.').expect("a JWT has three parts");
    let first = if signature.starts_with('A') { 'B' } else { 'A' };
    let forged = format!("{signed}.{first}{}", &signature[1..]);
    assert_ne!(forged, globex);
    assert_eq!(send(port, with_token(&forged, 0)).await.status, 401);
}

tollgate_e2e::both_builds!(
    async: [
        a_burst_for_one_tenant_admits_exactly_the_burst,
        transfers_drain_five_units_and_lookups_one,
        tenants_never_share_state,
        shadow_mode_admits_all_and_counts_would_be_denials,
        hostile_identities_neither_crash_the_filter_nor_merge_tenants,
        ten_thousand_tenants_stay_inside_the_slot_table,
    ],
    sync: [a_bad_policy_is_refused_with_the_field_named],
);
