#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of rates by value (`limits`): real Envoys with the freshly built filter
//! (both builds), a real limiter and redis-server for the global policy, on loopback. One
//! policy on one route with three plans read from a header, a default and one tenant's
//! override admits per plan exactly its burst, the overridden tenant its own, a caller without
//! the header the default; the same holds fleet-wide over two Envoys and the limiter, which
//! refuses an entry its document does not have; behind the shipped trust model (the plan
//! header removed at the edge, then set from a verified token) a caller cannot pick a better
//! plan by sending the header; a limiter reload that raises one tenant's override keeps the
//! budget it used, one that lowers it admits no more than the new burst.

use std::path::Path;
use std::time::Duration;

use tollgate_e2e::build::Build;
use tollgate_e2e::tollgate::{envoy_config, prometheus_value, Limiter, Store};
use tollgate_e2e::{
    burst, http_blocking, process, send, Envoy, EnvoyOptions, RedisServer, RequestSpec, Response,
    Upstream,
};

/// Bursts per entry; 1 unit per hour, so a burst meets exactly the bucket's capacity.
const FREE: usize = 2;
const PRO: usize = 5;
const ENTERPRISE: usize = 8;
const ACME: usize = 4;
const DEFAULT: usize = 1;

/// The plans policy: `scope`, the override's burst, and the document's tail (`limiter`).
fn plans(scope: &str, acme: usize, tail: &str) -> String {
    plans_counted(false, scope, acme, tail)
}

/// [`plans`], counted by the token bucket (1 unit per hour), or with `yearly` by fixed
/// windows of a calendar year (each entry's burst per year).
fn plans_counted(yearly: bool, scope: &str, acme: usize, tail: &str) -> String {
    let entry = |burst: usize| {
        if yearly {
            format!(r#"{{ "rate": {{ "units": {burst}, "per": "1y" }} }}"#)
        } else {
            format!(r#"{{ "rate": {{ "units": 1, "per": "1h" }}, "burst": {burst} }}"#)
        }
    };
    let algorithm = if yearly {
        "fixed_window"
    } else {
        "token_bucket"
    };
    format!(
        r#"{{
  "policies": [{{
    "name": "plans",
    "match": {{ "routes": ["GET /items/{{id}}"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "algorithm": "{algorithm}",
    "limits": {{
      "by": {{ "header": "x-plan" }},
      "values": {{ "free": {}, "pro": {}, "enterprise": {} }},
      "default": {},
      "overrides": {{ "acme": {} }}
    }},
    "scope": "{scope}",
    "on_unavailable": {{ "mode": "closed" }}
  }}]{tail}
}}"#,
        entry(FREE),
        entry(PRO),
        entry(ENTERPRISE),
        entry(DEFAULT),
        entry(acme),
    )
}

/// The global documents' limiter: exactness is what the tests check, so one token per lease
/// (no tokens held by one Envoy while the other is refused) and a patient deadline.
const LIMITER: &str =
    r#", "limiter": { "cluster": "tollgate_limiter", "timeout": "2s", "lease_max": 1 }"#;

fn item(tenant: &str, plan: Option<&str>, i: usize) -> RequestSpec {
    let request = RequestSpec::get(format!("/items/{i}")).header("x-tenant-id", tenant);
    match plan {
        Some(plan) => request.header("x-plan", plan),
        None => request,
    }
}

fn admitted(responses: &[Response]) -> usize {
    let ok = responses.iter().filter(|r| r.status == 200).count();
    let limited = responses.iter().filter(|r| r.status == 429).count();
    assert_eq!(
        ok + limited,
        responses.len(),
        "only 200s and 429s: {responses:?}"
    );
    ok
}

fn metric(envoy: &Envoy, what: &str) -> u64 {
    prometheus_value(
        &envoy.stats_prometheus(),
        &format!("tollgate_{what}{{policy=\"plans\"}}"),
    ) as u64
}

fn start(
    build: Build,
    shipped: &str,
    policy: &str,
    upstream: &Upstream,
    limiter: Option<u16>,
) -> (Envoy, u16) {
    let config = build.config(envoy_config(shipped, policy, upstream.port(), limiter));
    start_config(config)
}

fn start_config(config: String) -> (Envoy, u16) {
    let envoy = Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("warn"));
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

/// Who asks, on which plan, and the burst that plan (or override) admits.
const CALLERS: &[(&str, Option<&str>, usize)] = &[
    ("t1", Some("free"), FREE),
    // The same tenant on another plan: the entry is part of the bucket, a fresh budget.
    ("t1", Some("pro"), PRO),
    ("t2", Some("enterprise"), ENTERPRISE),
    // The override, whatever the plan header says.
    ("acme", Some("enterprise"), ACME),
    // No header, a plan no entry names, one that differs in case: the default.
    ("t3", None, DEFAULT),
    ("t4", Some("gold"), DEFAULT),
    ("t5", Some("FREE"), DEFAULT),
];

async fn each_plan_admits_its_burst_the_override_its_own_and_no_plan_the_default(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(
        build,
        "envoy/local.yaml",
        &plans("local", ACME, ""),
        &upstream,
        None,
    );
    for (tenant, plan, expected) in CALLERS {
        let answers = burst(port, 12, 6, |i| item(tenant, *plan, i)).await;
        assert_eq!(admitted(&answers), *expected, "{tenant} on {plan:?}");
    }
    let total: usize = CALLERS.iter().map(|c| c.2).sum();
    assert_eq!(upstream.requests() as usize, total);
    assert_eq!(metric(&envoy, "allowed") as usize, total);
    assert_eq!(
        metric(&envoy, "denied") as usize,
        12 * CALLERS.len() - total
    );
    let limited = send(port, item("t1", Some("free"), 99)).await;
    assert_eq!(limited.status, 429);
    assert!(
        limited.body.contains("\"policy\":\"plans\""),
        "{}",
        limited.body
    );
}

async fn fleet_wide_each_plan_admits_exactly_its_burst(build: Build) {
    let redis = RedisServer::start();
    let policy = plans("global", ACME, LIMITER);
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (a, port_a) = start(
        build,
        "envoy/global.yaml",
        &policy,
        &upstream,
        Some(limiter.port()),
    );
    let (b, port_b) = start(
        build,
        "envoy/global.yaml",
        &policy,
        &upstream,
        Some(limiter.port()),
    );
    for (tenant, plan, expected) in CALLERS {
        let (ra, rb) = tokio::join!(
            burst(port_a, 10, 5, |i| item(tenant, *plan, i)),
            burst(port_b, 10, 5, |i| item(tenant, *plan, i)),
        );
        let all: Vec<Response> = ra.into_iter().chain(rb).collect();
        assert_eq!(
            admitted(&all),
            *expected,
            "{tenant} on {plan:?}, two Envoys"
        );
    }
    let total: usize = CALLERS.iter().map(|c| c.2).sum();
    assert_eq!(upstream.requests() as usize, total);
    assert_eq!(
        (metric(&a, "allowed") + metric(&b, "allowed")) as usize,
        total
    );
    // The limiter rates an entry from its own document: a filter naming an entry it does not
    // have (or a rate it would like) is refused.
    for key in ["t9:!vplatinum", "t9:!o", "t9"] {
        let body = format!(
            r#"{{"leases":[{{"id":"forged-{key}","policy":"plans","key":"{key}","min":1,"want":1}}]}}"#
        );
        let answer =
            http_blocking::post(limiter.port(), "/v1/leases", &body, Duration::from_secs(5))
                .unwrap();
        assert!(
            answer.body.contains("INVALID_POLICY"),
            "{key}: {} {}",
            answer.status,
            answer.body
        );
    }
}

/// The shipped trust model for a header: a component at the edge removes any client copy of
/// it, a trusted one sets it. Here Envoy's header_mutation removes `x-plan`, then jwt_authn
/// verifies the token and writes its `plan` claim to `x-plan` (`claim_to_headers`).
fn trusted_plan(config: String) -> String {
    let jwks = tollgate_e2e::jwt::jwks();
    let filters = format!(
        r#"          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
              mutations:
                request_mutations:
                - remove: x-plan
          - name: envoy.filters.http.jwt_authn
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
              providers:
                plans:
                  issuer: tollgate-e2e
                  local_jwks:
                    inline_string: '{jwks}'
                  claim_to_headers:
                  - header_name: x-plan
                    claim_name: plan
              rules:
              - match: {{ prefix: "/" }}
                requires: {{ provider_name: plans }}
"#
    );
    assert!(config.contains("          http_filters:\n"));
    config.replacen(
        "          http_filters:\n",
        &format!("          http_filters:\n{filters}"),
        1,
    )
}

async fn a_caller_cannot_pick_a_better_plan_with_a_header(build: Build) {
    let upstream = Upstream::start();
    let config = trusted_plan(build.config(envoy_config(
        "envoy/local.yaml",
        &plans("local", ACME, ""),
        upstream.port(),
        None,
    )));
    let (_envoy, port) = start_config(config);
    let free = tollgate_e2e::jwt::token(r#""sub":"t1","plan":"free""#);
    let no_plan = tollgate_e2e::jwt::token(r#""sub":"t3""#);
    let forging = |token: &str, tenant: &str, i: usize| {
        item(tenant, Some("enterprise"), i).header("authorization", format!("Bearer {token}"))
    };
    // A free token sending `x-plan: enterprise` gets free's burst.
    let answers = burst(port, 12, 6, |i| forging(&free, "t1", i)).await;
    assert_eq!(admitted(&answers), FREE, "free token, forged header");
    // A token without a plan sending the header gets the default.
    let answers = burst(port, 12, 6, |i| forging(&no_plan, "t3", i)).await;
    assert_eq!(admitted(&answers), DEFAULT, "no plan claim, forged header");
    // Without a token, no request reaches tollgate at all.
    assert_eq!(
        send(port, item("t6", Some("enterprise"), 0)).await.status,
        401
    );
    assert_eq!(upstream.requests() as usize, FREE + DEFAULT);
}

/// Writes `text` to `path` atomically: a temporary file in the same directory, renamed.
fn replace_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A limiter with `policy`, polling its file every 100 ms, and one Envoy of `build` using it.
fn reloadable(build: Build, policy: &str) -> (RedisServer, Limiter, Upstream, Envoy, u16) {
    let redis = RedisServer::start();
    let limiter = Limiter::start(
        policy,
        Store::Redis(redis.url()),
        &["--policy-poll", "100ms"],
    );
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (envoy, port) = start(
        build,
        "envoy/global.yaml",
        policy,
        &upstream,
        Some(limiter.port()),
    );
    (redis, limiter, upstream, envoy, port)
}

/// Replaces the limiter's document and waits until it logs its `reloads`-th reload.
fn reload(limiter: &Limiter, policy: &str, reloads: usize) {
    replace_file(limiter.policies_path(), policy);
    process::wait_for("the limiter's reload", Duration::from_secs(5), || {
        (limiter.logs().matches("policy document reloaded").count() >= reloads).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: {}", limiter.logs()));
}

/// A yearly quota: the count of what a tenant used is kept across reloads of its override.
async fn reloading_an_override_keeps_the_tenants_used_budget(build: Build) {
    let doc = |acme| plans_counted(true, "global", acme, LIMITER);
    let (_redis, limiter, upstream, _envoy, port) = reloadable(build, &doc(ACME));
    // acme uses 3 of its 4.
    let spent = burst(port, 3, 1, |i| item("acme", Some("free"), i)).await;
    assert_eq!(admitted(&spent), 3);
    // Raised to 10: the bucket is the same (the entry's name, not its numbers, is in its key),
    // so acme has 7 more, neither a fresh 10 nor the 1 the old quota left.
    reload(&limiter, &doc(10), 1);
    let raised = burst(port, 20, 5, |i| item("acme", Some("free"), 100 + i)).await;
    assert_eq!(admitted(&raised), 10 - 3, "raised to 10 after using 3");
    // Another tenant's plan is untouched by the override.
    let pro = burst(port, 10, 5, |i| item("t7", Some("pro"), i)).await;
    assert_eq!(admitted(&pro), PRO);
    // Lowered to 2 with 10 used: nothing more.
    reload(&limiter, &doc(2), 2);
    let lowered = burst(port, 10, 5, |i| item("acme", Some("free"), 200 + i)).await;
    assert_eq!(admitted(&lowered), 0, "lowered to 2 with 10 used");
    assert_eq!(upstream.requests() as usize, 3 + 7 + PRO);
}

/// A token bucket: lowering an override below what the tenant has left admits no more than
/// the new burst (plus one refill, which at 1 per hour is none here); raising it keeps the
/// tokens left (the bucket refills to the new burst at the new rate).
async fn lowering_an_override_admits_no_more_than_the_new_burst(build: Build) {
    let doc = |acme| plans("global", acme, LIMITER);
    let (_redis, limiter, upstream, _envoy, port) = reloadable(build, &doc(10));
    let granted = || {
        prometheus_value(
            &limiter.metrics(),
            "tollgate_limiter_tokens_granted_total{policy=\"plans\"}",
        ) as usize
    };
    // 3 of 10 spent: 7 left in the limiter, less what the filter leased ahead (a background
    // refill of one token, `lease_max: 1`), which it may spend as leased.
    let spent = burst(port, 3, 1, |i| item("acme", None, i)).await;
    assert_eq!(admitted(&spent), 3);
    reload(&limiter, &doc(2), 1);
    // What was granted before the reload took effect beyond the 3 spent: held by the filter
    // (its background refill may still be answered meanwhile).
    let before = granted();
    let held = before - 3;
    assert!(held <= 1, "{held} tokens leased ahead");
    let lowered = burst(port, 10, 5, |i| item("acme", None, 100 + i)).await;
    // The limiter grants at most the new burst; the filter admits that and what it held, and
    // never more than the new burst plus one lease of `lease_max` (1).
    let after = granted() - before;
    assert!(
        after <= 2,
        "the limiter granted {after} after lowering to 2"
    );
    let lowered = admitted(&lowered);
    assert!(
        lowered <= after + held,
        "{lowered} admitted, {after} + {held} granted"
    );
    assert!(
        (2..=3).contains(&lowered),
        "lowered to 2 with 7 left: {lowered}"
    );
    // Raised again with the bucket empty: it stays empty (no fresh burst for a changed
    // number).
    reload(&limiter, &doc(10), 2);
    let before = granted();
    let raised = burst(port, 10, 5, |i| item("acme", None, 200 + i)).await;
    assert_eq!(granted() - before, 0);
    assert_eq!(admitted(&raised), 0, "raised to 10 with none left");
    assert_eq!(upstream.requests() as usize, 3 + lowered);
}

tollgate_e2e::both_builds!(
    async: [
        each_plan_admits_its_burst_the_override_its_own_and_no_plan_the_default,
        fleet_wide_each_plan_admits_exactly_its_burst,
        a_caller_cannot_pick_a_better_plan_with_a_header,
        reloading_an_override_keeps_the_tenants_used_budget,
        lowering_an_override_admits_no_more_than_the_new_burst,
    ],
    sync: [],
);
