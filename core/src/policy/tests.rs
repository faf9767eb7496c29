use super::*;

const PAYMENTS: &str = include_str!("../../../policies/payments.json");

fn errors_of(doc: &str) -> Vec<PolicyError> {
    Policies::from_json(doc.as_bytes()).unwrap_err().0
}

fn policy(extra: &str) -> String {
    format!(
        r#"{{"policies":[{{"name":"p","key":[{{"header":"x-tenant-id"}}],"rate":{{"units":10,"per":"1s"}},"burst":5{extra}}}]}}"#
    )
}

#[test]
fn the_seed_example_is_expressed_exactly() {
    let policies = Policies::from_json(PAYMENTS.as_bytes()).unwrap();
    let p = policies.get("payments-per-tenant").unwrap();
    assert_eq!((p.units, p.per_ms, p.burst), (100, 1_000, 20));
    assert_eq!(p.key, vec![KeyPart::Header("x-tenant-id".into())]);
    let transfer = p
        .match_request("api.example.com", "POST", "/payments/transfers")
        .unwrap();
    assert_eq!(transfer.cost, 5);
    assert_eq!(transfer.route, Some("POST /payments/transfers"));
    let status = p
        .match_request("api.example.com", "GET", "/payments/transfers/tx-1?x=1")
        .unwrap();
    assert_eq!(status.cost, 1);
    assert_eq!(status.route, Some("GET /payments/transfers/{id}"));
    assert!(p
        .match_request("other.example.com", "POST", "/payments/transfers")
        .is_none());
    assert!(p
        .match_request("api.example.com", "DELETE", "/payments/transfers")
        .is_none());
    assert_eq!(policies.version.len(), 12);
}

#[test]
fn unknown_fields_are_named() {
    let errors = errors_of(&policy(r#","burts":3"#));
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].policy.as_deref(), Some("p"));
    assert!(
        errors[0].field.starts_with("policies[0]"),
        "{:?}",
        errors[0]
    );
    assert!(errors[0].reason.contains("burts"), "{:?}", errors[0]);
}

#[test]
fn bad_values_name_policy_field_and_reason() {
    let doc = r#"{"policies":[{"name":"p","key":[{"header":"x"}],"rate":{"units":10,"per":"1parsec"},"burst":5}]}"#;
    let errors = errors_of(doc);
    assert_eq!(errors[0].field, "policies[0].rate.per");
    assert!(errors[0].reason.contains("unknown unit"));
    assert_eq!(
        errors[0].to_string(),
        format!("policy `p`: policies[0].rate.per: {}", errors[0].reason)
    );
}

#[test]
fn semantic_errors_are_all_reported() {
    let doc = r#"{"policies":[
        {"name":"Bad Name","key":[],"rate":{"units":0,"per":"0s"},"burst":0},
        {"name":"q","match":{"routes":["POST /a"]},"key":[{"header":"X-Up"}],"rate":{"units":1,"per":"1s"},"burst":2,
         "cost":{"POST /a":3,"GET /b":1},"on_unavailable":{"mode":"local","share":2.0,"stale_ttl":"1s","then":"open"}}
    ]}"#;
    let errors = errors_of(doc);
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    for expected in [
        "policies[0].name",
        "policies[0].key",
        "policies[0].rate.units",
        "policies[0].rate.per",
        "policies[0].burst",
        "policies[1].key[0]",
        "policies[1].cost[\"POST /a\"]",
        "policies[1].cost[\"GET /b\"]",
        "policies[1].on_unavailable.share",
    ] {
        assert!(
            fields.contains(&expected),
            "missing {expected} in {fields:?}"
        );
    }
    assert!(errors.iter().any(|e| e.policy.as_deref() == Some("q")));
}

#[test]
fn duplicate_names_and_global_without_limiter() {
    let doc = r#"{"policies":[
        {"name":"p","key":[{"constant":"all"}],"rate":{"units":1,"per":"1s"},"burst":1,"scope":"global"},
        {"name":"p","key":[{"constant":"all"}],"rate":{"units":1,"per":"1s"},"burst":1}
    ]}"#;
    let errors = errors_of(doc);
    assert!(errors
        .iter()
        .any(|e| e.field == "policies[1].name" && e.reason.contains("duplicate")));
    assert!(errors.iter().any(|e| e.field == "limiter"));
}

#[test]
fn failure_modes_compile() {
    let local = Policies::from_json(
        policy(
            r#","on_unavailable":{"mode":"local","share":0.34,"stale_ttl":"30s","then":"closed"}"#,
        )
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(
        local.policies[0].failure,
        FailureMode::Local {
            share: 0.34,
            stale_ttl_ms: 30_000,
            then: Terminal::Closed
        }
    );
    let errors = errors_of(&policy(r#","on_unavailable":{"mode":"local","share":0.5}"#));
    assert_eq!(errors[0].field, "policies[0].on_unavailable.stale_ttl");
    let errors = errors_of(&policy(r#","on_unavailable":{"mode":"open","share":0.5}"#));
    assert_eq!(errors[0].field, "policies[0].on_unavailable.mode");
    let errors = errors_of(&policy(r#","on_unavailable":{"mode":"sideways"}"#));
    assert!(errors[0].field.starts_with("policies[0].on_unavailable"));
}

#[test]
fn key_parts_parse() {
    let doc = policy(
        r#","match":{"routes":["GET /items/{id}"]},"key":[{"header":"x-tenant-id"},{"jwt_claim":{"claim":"sub"}},{"jwt_claim":{"payload":"jp","claim":["org","id"]}},{"client_ip":{"trusted_hops":2}},{"api_key":"x-api-key"},{"constant":"a:b"},"route","method"]"#,
    )
    .replace(r#""key":[{"header":"x-tenant-id"}],"#, "");
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    assert_eq!(
        policies.policies[0].key,
        vec![
            KeyPart::Header("x-tenant-id".into()),
            KeyPart::JwtClaim {
                path: [
                    "metadata",
                    "filter_metadata",
                    "envoy.filters.http.jwt_authn",
                    "jwt_payload",
                    "sub"
                ]
                .map(String::from)
                .to_vec()
            },
            KeyPart::JwtClaim {
                path: [
                    "metadata",
                    "filter_metadata",
                    "envoy.filters.http.jwt_authn",
                    "jp",
                    "org",
                    "id"
                ]
                .map(String::from)
                .to_vec()
            },
            KeyPart::ClientIp { trusted_hops: 2 },
            KeyPart::ApiKey("x-api-key".into()),
            KeyPart::Constant("a%3ab".into()),
            KeyPart::Route,
            KeyPart::Method,
        ]
    );
}

#[test]
fn route_key_part_needs_routes() {
    let doc = policy("").replace(r#"{"header":"x-tenant-id"}"#, r#""route""#);
    let errors = errors_of(&doc);
    assert_eq!(errors[0].field, "policies[0].key[0]");
}

#[test]
fn hosts_match_with_wildcards_and_ports() {
    let doc = policy(r#","match":{"hosts":["*.example.com","API.other.org"]}"#);
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    let p = &policies.policies[0];
    assert!(p
        .match_request(&authority_host("a.example.com:8080"), "GET", "/")
        .is_some());
    assert!(p
        .match_request(&authority_host("example.com"), "GET", "/")
        .is_none());
    assert!(p
        .match_request(&authority_host("api.OTHER.org"), "GET", "/x")
        .is_some());
    assert_eq!(authority_host("[::1]:80"), "::1");
    assert!(errors_of(&policy(r#","match":{"hosts":["http://x"]}"#))[0]
        .field
        .contains("match.hosts[0]"));
}

#[test]
fn invalid_json_is_reported() {
    let errors = errors_of("{not json");
    assert_eq!(errors[0].field, "(document)");
    assert!(errors[0].reason.contains("not valid JSON"));
}
