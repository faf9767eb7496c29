#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of policy conditions (`when`): a real Envoy loads the freshly built filter
//! with the shipped `envoy/local.yaml`, in front of a real HTTP upstream, on loopback; every
//! test runs against both builds (`wasm::…` and `native::…`). Two policies on one route told
//! apart by a header admit exactly their own bursts and leave a request that meets neither
//! unlimited; a route parameter's regex and the client address's CIDR decide as written,
//! whatever `X-Forwarded-For` claims; a header repeated many times or 50 KB long neither
//! crashes the filter nor changes which value decides; a bad condition stops the load with its
//! field named.

use tollgate_e2e::http_blocking::raw_status;

use tollgate_e2e::build::Build;
use tollgate_e2e::tollgate::{self, envoy_config};
use tollgate_e2e::{burst, send, Envoy, EnvoyOptions, RequestSpec, Upstream};

fn start(build: Build, policy: &str, upstream: &Upstream) -> (Envoy, u16) {
    let config = build.config(envoy_config(
        "envoy/local.yaml",
        policy,
        upstream.port(),
        None,
    ));
    let envoy = Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("warn"));
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

/// Two plans on one route; 1 unit per hour, so a burst meets exactly the bucket's capacity.
const PLANS: &str = r#"{
  "policies": [
    {
      "name": "plan-free",
      "match": { "routes": ["GET /items/{id}"] },
      "when": [{ "header": "x-plan", "equals": "free" }],
      "key": [{ "header": "x-tenant-id" }],
      "rate": { "units": 1, "per": "1h" },
      "burst": 2
    },
    {
      "name": "plan-pro",
      "match": { "routes": ["GET /items/{id}"] },
      "when": [{ "header": "x-plan", "in": ["pro", "team"] }],
      "key": [{ "header": "x-tenant-id" }],
      "rate": { "units": 1, "per": "1h" },
      "burst": 5
    }
  ]
}"#;

fn item(tenant: &str, plan: Option<&str>, i: usize) -> RequestSpec {
    let request = RequestSpec::get(format!("/items/{i}")).header("x-tenant-id", tenant);
    match plan {
        Some(plan) => request.header("x-plan", plan),
        None => request,
    }
}

fn metric(envoy: &Envoy, what: &str, policy: &str) -> u64 {
    tollgate::prometheus_value(
        &envoy.stats_prometheus(),
        &format!("tollgate_{what}{{policy=\"{policy}\"}}"),
    ) as u64
}

fn admitted(responses: &[tollgate_e2e::Response]) -> usize {
    let ok = responses.iter().filter(|r| r.status == 200).count();
    let limited = responses.iter().filter(|r| r.status == 429).count();
    assert_eq!(ok + limited, responses.len(), "only 200s and 429s");
    ok
}

async fn each_plan_admits_its_own_burst_and_no_plan_is_not_limited(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(build, PLANS, &upstream);
    let free = burst(port, 20, 10, |i| item("acme", Some("free"), i)).await;
    assert_eq!(admitted(&free), 2, "free");
    // The same tenant on another plan is another policy's bucket.
    let pro = burst(port, 20, 10, |i| item("acme", Some("pro"), i)).await;
    assert_eq!(admitted(&pro), 5, "pro");
    let team = burst(port, 20, 10, |i| item("globex", Some("team"), i)).await;
    assert_eq!(admitted(&team), 5, "team");
    // A plan neither policy names, no plan at all, a plan that differs only in case: no
    // condition holds, so neither policy applies and nothing is limited.
    for plan in [Some("enterprise"), None, Some("FREE")] {
        let other = burst(port, 20, 10, |i| item("acme", plan, i)).await;
        assert_eq!(admitted(&other), 20, "{plan:?}");
    }
    assert_eq!(upstream.requests(), 2 + 5 + 5 + 60);
    assert_eq!(metric(&envoy, "allowed", "plan-free"), 2);
    assert_eq!(metric(&envoy, "denied", "plan-free"), 18);
    assert_eq!(metric(&envoy, "allowed", "plan-pro"), 10);
    assert_eq!(metric(&envoy, "denied", "plan-pro"), 30);
    let limited = send(port, item("acme", Some("free"), 99)).await;
    assert_eq!(limited.status, 429);
    assert!(
        limited.body.contains("\"policy\":\"plan-free\""),
        "{}",
        limited.body
    );
}

/// A numeric `{id}` (by regex) is limited, another is not; requests from loopback are limited
/// by the policy whose CIDRs hold it and never by the one whose do not, whatever
/// `X-Forwarded-For` says (the shipped config sets `use_remote_address: true`).
const REGEX_AND_CIDR: &str = r#"{
  "policies": [
    {
      "name": "numeric-items",
      "match": { "routes": ["GET /items/{id}"] },
      "when": [{ "path_param": "id", "regex": "[0-9]{1,6}" }],
      "key": [{ "constant": "all" }],
      "rate": { "units": 1, "per": "1h" },
      "burst": 3
    },
    {
      "name": "from-loopback",
      "match": { "routes": ["GET /local/{x}"] },
      "when": [{ "client_ip": {}, "cidr": ["127.0.0.0/8", "::1"] }],
      "key": [{ "constant": "all" }],
      "rate": { "units": 1, "per": "1h" },
      "burst": 4
    },
    {
      "name": "from-private",
      "match": { "routes": ["GET /local/{x}"] },
      "when": [{ "client_ip": {}, "cidr": ["10.0.0.0/8", "192.168.0.0/16", "2001:db8::/32"] }],
      "key": [{ "constant": "all" }],
      "rate": { "units": 1, "per": "1h" },
      "burst": 1
    }
  ]
}"#;

async fn a_route_parameter_regex_and_a_client_cidr_decide_as_written(build: Build) {
    let upstream = Upstream::start();
    let (envoy, port) = start(build, REGEX_AND_CIDR, &upstream);
    let numeric = burst(port, 12, 6, |i| {
        RequestSpec::get(format!("/items/{}", 100 + i))
    })
    .await;
    assert_eq!(admitted(&numeric), 3, "numeric ids");
    // Not all digits, too many digits, digits then more: the whole value must match.
    for id in ["abc", "1234567", "12a", "a12"] {
        let other = burst(port, 6, 3, |_| RequestSpec::get(format!("/items/{id}"))).await;
        assert_eq!(admitted(&other), 6, "{id}");
    }
    // Loopback holds for `from-loopback` only; a forged X-Forwarded-For changes nothing.
    let local = burst(port, 12, 6, |i| {
        RequestSpec::get(format!("/local/{i}")).header("x-forwarded-for", "10.1.2.3")
    })
    .await;
    assert_eq!(admitted(&local), 4, "loopback");
    assert_eq!(metric(&envoy, "allowed", "from-loopback"), 4);
    assert_eq!(metric(&envoy, "denied", "from-loopback"), 8);
    assert_eq!(metric(&envoy, "allowed", "from-private"), 0);
    assert_eq!(metric(&envoy, "denied", "from-private"), 0);
}

/// A request for `/items/{n}` of tenant `acme` with these extra header lines.
fn raw_item(n: usize, headers: &[(&str, &[u8])]) -> Vec<u8> {
    let mut request = format!(
        "GET /items/{n} HTTP/1.1\r\nhost: api.example.com\r\nconnection: close\r\nx-tenant-id: acme\r\n"
    )
    .into_bytes();
    for (name, value) in headers {
        request.extend_from_slice(name.as_bytes());
        request.extend_from_slice(b": ");
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n");
    request
}

async fn repeated_and_hostile_header_values_neither_crash_nor_change_which_value_decides(
    build: Build,
) {
    let upstream = Upstream::start();
    let policies = PLANS.replace(
        r#""in": ["pro", "team"] }"#,
        r#""in": ["pro", "team"] }, { "header": "x-region", "regex": "(?:.*-){1,20}z" }"#,
    );
    assert_ne!(policies, PLANS);
    let (envoy, port) = start(build, &policies, &upstream);
    // 80 values of `x-plan`, the first `free`: the first decides, as for a key part.
    let mut repeated: Vec<(&str, &[u8])> = vec![("x-plan", b"free")];
    repeated.extend(std::iter::repeat(("x-plan", &b"pro"[..])).take(79));
    let statuses: Vec<u16> = (0..4)
        .map(|n| raw_status(port, &raw_item(n, &repeated)))
        .collect();
    assert_eq!(statuses, [200, 200, 429, 429], "the free plan's burst of 2");
    assert_eq!(metric(&envoy, "allowed", "plan-pro"), 0);
    // Hostile values of a header a condition tests: 50 KB (Envoy refuses more than 60 KiB of
    // headers itself), binary, and a 50 KB value for the slow regex (it reads at most 1 KiB):
    // no condition holds, nothing is limited, nothing crashes.
    let huge = vec![b'-'; 50_000];
    let binary: Vec<u8> = (0x80..=0xffu8).cycle().take(4096).collect();
    let mut hostile_region = huge.clone();
    hostile_region.push(b'z');
    for (n, headers) in [
        vec![("x-plan", &huge[..])],
        vec![("x-plan", &binary[..])],
        vec![("x-plan", &b"pro"[..]), ("x-region", &hostile_region[..])],
    ]
    .iter()
    .enumerate()
    {
        for attempt in 0..8 {
            let status = raw_status(port, &raw_item(10 + n, headers));
            assert_eq!(status, 200, "hostile case {n}, request {attempt}");
        }
    }
    // A region that matches the regex, on the pro plan: the pro policy applies.
    let region: &[u8] = b"eu-west-z";
    let statuses: Vec<u16> = (0..7)
        .map(|n| {
            raw_status(
                port,
                &raw_item(n, &[("x-plan", b"pro"), ("x-region", region)]),
            )
        })
        .collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
    if build == Build::Wasm {
        let text = envoy.stats_prometheus();
        assert_eq!(
            tollgate::prometheus_value(&text, "envoy_wasm_tollgate_vm_reload"),
            0.0
        );
    }
    assert!(!envoy.logs().contains("panicked"), "{}", envoy.logs());
}

fn a_bad_condition_is_refused_at_load_naming_its_field(build: Build) {
    let upstream = Upstream::start();
    for (bad, field) in [
        (
            PLANS.replace(r#""equals": "free""#, r#""regex": "(free""#),
            "policy `plan-free`: policies[0].when[0].regex: not a valid regular expression",
        ),
        (
            PLANS.replace(r#""in": ["pro", "team"]"#, r#""in": []"#),
            "policy `plan-pro`: policies[1].when[0].in: must list at least one value",
        ),
        (
            PLANS.replace(r#""equals": "free""#, r#""startswith": "free""#),
            "unknown field `startswith`",
        ),
    ] {
        let config = build.config(envoy_config(
            "envoy/local.yaml",
            &bad,
            upstream.port(),
            None,
        ));
        let error = Envoy::try_start(EnvoyOptions::new(config).concurrency(1).log_level("warn"))
            .expect_err("Envoy started with a bad condition");
        let message = error.to_string();
        assert!(
            message.contains("invalid plugin configuration"),
            "{message}"
        );
        assert!(message.contains(field), "{field} not in: {message}");
    }
}

tollgate_e2e::both_builds!(
    async: [
        each_plan_admits_its_own_burst_and_no_plan_is_not_limited,
        a_route_parameter_regex_and_a_client_cidr_decide_as_written,
        repeated_and_hostile_header_values_neither_crash_nor_change_which_value_decides,
    ],
    sync: [a_bad_condition_is_refused_at_load_naming_its_field],
);
