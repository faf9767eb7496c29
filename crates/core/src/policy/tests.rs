use super::*;

const PAYMENTS: &str = include_str!("../../../../policies/payments.json");

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
    // The request's host is read only for documents with a policy that matches on it.
    assert!(policies.reads_host());
    assert!(!Policies::from_json(policy("").as_bytes())
        .unwrap()
        .reads_host());
    // The host without a numeric port, lower-cased; anything else after `:` is kept.
    for (authority, host) in [
        ("[::1]", "::1"),
        ("[::1", "::1"),
        ("[", ""),
        ("a.com:", "a.com"),
        ("a.com:8x", "a.com:8x"),
        (" A.Com:80 ", "a.com"),
        ("a:b:80", "a:b"),
        ("", ""),
        ("é.com:1", "é.com"),
    ] {
        assert_eq!(authority_host(authority), host, "{authority:?}");
    }
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

#[test]
fn reserve_settle_and_in_flight_compile() {
    let doc = r#"{"policies":[{"name":"llm","match":{"routes":["POST /v1/chat"]},
      "key":[{"header":"x-tenant-id"}],"rate":{"units":1000,"per":"1m"},"burst":4000,
      "reserve":{"from":{"body":{"field":"max_tokens"}},"plus":{"POST /v1/chat":200},
                 "default":1000,"max":4000},
      "settle":{"from":{"body":{"field":"usage.total_tokens"}},"on_missing":"refund"},
      "max_in_flight":8,"in_flight_timeout":"5m"}]}"#;
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    let p = policies.get("llm").unwrap();
    let reserve = p.reserve.as_ref().unwrap();
    assert_eq!((reserve.default, reserve.min, reserve.max), (1000, 1, 4000));
    assert!(
        matches!(&reserve.source, UnitsSource::Body { max_bytes: 65_536, path } if path.as_str() == "max_tokens")
    );
    assert_eq!(p.match_request("", "POST", "/v1/chat").unwrap().cost, 200);
    assert_eq!(reserve.units(200, Some(50)), 250);
    assert_eq!(reserve.units(200, Some(u64::MAX)), 4000);
    assert_eq!(reserve.units(200, None), 1200);
    let settle = p.settle.as_ref().unwrap();
    assert_eq!(
        (settle.on_missing, settle.max_debt),
        (OnMissingUsage::Refund, 4000)
    );
    assert!(matches!(
        &settle.source,
        UnitsSource::Body {
            max_bytes: 262_144,
            ..
        }
    ));
    assert_eq!(
        p.in_flight,
        Some(InFlightLimit {
            max: 8,
            timeout_ms: 300_000
        })
    );
    // Without routes a reservation has no constant part.
    let p = Policies::from_json(
        policy(r#","reserve":{"from":{"header":"x-units"},"default":2,"max":5}"#).as_bytes(),
    )
    .unwrap();
    assert_eq!(p.policies[0].match_request("", "GET", "/").unwrap().cost, 0);
}

#[test]
fn reserve_settle_and_in_flight_errors_name_the_field() {
    let routes = r#","match":{"routes":["POST /a"]}"#;
    for (extra, field, reason) in [
        (
            r#","reserve":{"from":{"trailer":"x"},"default":1,"max":5}"#,
            "policies[0].reserve.from",
            "trailer",
        ),
        (
            r#","reserve":{"from":{"header":"X-Units"},"default":1,"max":5}"#,
            "policies[0].reserve.from",
            "header name",
        ),
        (
            r#","reserve":{"from":{"header":"x"},"default":1,"max":6}"#,
            "policies[0].reserve.max",
            "burst",
        ),
        (
            r#","reserve":{"from":{"header":"x"},"default":1,"min":3,"max":2}"#,
            "policies[0].reserve.max",
            "less than",
        ),
        (
            r#","reserve":{"from":{"header":"x"},"default":9,"max":5}"#,
            "policies[0].reserve.default",
            "within",
        ),
        (
            r#","reserve":{"from":{"header":"x"},"default":1,"min":0,"max":5}"#,
            "policies[0].reserve.min",
            "at least 1",
        ),
        (
            r#","reserve":{"from":{"body":{"field":"a..b"}},"default":1,"max":5}"#,
            "policies[0].reserve.from.body.field",
            "",
        ),
        (
            r#","settle":{"from":{"body":{"field":"u","max_bytes":0}}}"#,
            "policies[0].settle.from.body.max_bytes",
            "between",
        ),
        (
            r#","settle":{"from":{"body":{"field":"u","max_bytes":2000000}}}"#,
            "policies[0].settle.from.body.max_bytes",
            "between",
        ),
        (
            r#","max_in_flight":1000001"#,
            "policies[0].max_in_flight",
            "between",
        ),
        (
            r#","in_flight_timeout":"10s""#,
            "policies[0].in_flight_timeout",
            "max_in_flight",
        ),
        (
            r#","max_in_flight":2,"in_flight_timeout":"10ms""#,
            "policies[0].in_flight_timeout",
            "between",
        ),
        (
            r#","settle":{"from":{"header":"x"},"max_debt":1,"extra":1}"#,
            "policies[0].settle",
            "unknown field",
        ),
    ] {
        let errors = errors_of(&policy(extra));
        assert!(
            errors
                .iter()
                .any(|e| e.field.starts_with(field) && e.reason.contains(reason)),
            "{extra}: {errors:?}"
        );
    }
    // With `reserve`, route constants go in `reserve.plus`, and must name routes.
    let errors = errors_of(&policy(&format!(
        r#"{routes},"cost":{{"POST /a":2}},"reserve":{{"from":{{"header":"x"}},"plus":{{"POST /b":1}},"default":1,"max":5}}"#
    )));
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert!(fields.contains(&"policies[0].cost"), "{errors:?}");
    assert!(
        fields.contains(&"policies[0].reserve.plus[\"POST /b\"]"),
        "{errors:?}"
    );
}

fn windowed(algorithm: &str, per: &str) -> String {
    format!(
        r#"{{"policies":[{{"name":"quota","key":[{{"header":"x-tenant-id"}}],"rate":{{"units":1000,"per":"{per}"}},"algorithm":"{algorithm}"}}]}}"#
    )
}

#[test]
fn fixed_windows_take_calendar_periods() {
    use crate::calendar::{days_from_civil, Calendar, DAY_MS};
    for (per, calendar) in [
        ("1w", Calendar::Weeks(1)),
        ("2w", Calendar::Weeks(2)),
        ("1mo", Calendar::Months(1)),
        ("3mo", Calendar::Months(3)),
        ("1y", Calendar::Months(12)),
    ] {
        let policies = Policies::from_json(windowed("fixed_window", per).as_bytes())
            .unwrap_or_else(|e| panic!("{per}: {e}"));
        let p = &policies.policies[0];
        let Algorithm::FixedWindow(w) = p.algorithm else {
            panic!("{per}: {:?}", p.algorithm);
        };
        assert_eq!(w.calendar, Some(calendar), "{per}");
        assert_eq!((w.limit, p.per_ms), (1000, calendar.longest_ms()), "{per}");
    }
    // `RateLimit-Policy`'s window is the current window's real length.
    let monthly = Policies::from_json(windowed("fixed_window", "1mo").as_bytes()).unwrap();
    let feb = days_from_civil(2027, 2, 10) * DAY_MS;
    assert_eq!(monthly.policies[0].window_ms_at(feb), 28 * DAY_MS);
    let daily = Policies::from_json(windowed("fixed_window", "1d").as_bytes()).unwrap();
    assert_eq!(daily.policies[0].window_ms_at(feb), DAY_MS);
}

#[test]
fn calendar_periods_are_refused_off_fixed_windows_naming_the_field() {
    for algorithm in ["sliding_window", "sliding_log"] {
        let errors = errors_of(&windowed(algorithm, "1mo"));
        assert!(
            errors.iter().any(|e| e.field == "policies[0].rate.per"
                && e.reason.contains("fixed_window")
                && e.policy.as_deref() == Some("quota")),
            "{algorithm}: {errors:?}"
        );
    }
    let errors = errors_of(&policy("").replace(r#""per":"1s""#, r#""per":"1w""#));
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].field, "policies[0].rate.per");
    assert!(errors[0].reason.contains("`1w`"), "{errors:?}");
    // Periods that are not calendar windows, named with the field.
    for (per, reason) in [
        ("5mo", "divides 12"),
        ("2y", "one at a time"),
        ("53w", "1w to 52w"),
        ("0mo", "divides 12"),
        ("1fortnight", "unknown unit"),
    ] {
        let errors = errors_of(&windowed("fixed_window", per));
        assert_eq!(errors.len(), 1, "{per}: {errors:?}");
        assert_eq!(errors[0].field, "policies[0].rate.per", "{per}");
        assert!(errors[0].reason.contains(reason), "{per}: {errors:?}");
    }
}

#[test]
fn on_over_limit_tag_compiles_with_its_default_header() {
    let policies =
        Policies::from_json(policy(r#","on_over_limit":{"action":"tag"}"#).as_bytes()).unwrap();
    assert_eq!(
        policies.policies[0].tag.as_deref(),
        Some(DEFAULT_TAG_HEADER)
    );
    assert_eq!(DEFAULT_TAG_HEADER, "x-tollgate-over-limit");
    let named = policy(r#","on_over_limit":{"action":"tag","header":"x-degraded"}"#);
    let policies = Policies::from_json(named.as_bytes()).unwrap();
    assert_eq!(policies.policies[0].tag.as_deref(), Some("x-degraded"));
    let reject = policy(r#","on_over_limit":{"action":"reject"}"#);
    assert_eq!(
        Policies::from_json(reject.as_bytes()).unwrap().policies[0].tag,
        None
    );
    assert_eq!(
        Policies::from_json(policy("").as_bytes()).unwrap().policies[0].tag,
        None
    );
}

#[test]
fn on_over_limit_errors_name_the_field() {
    let cases = [
        (
            r#","on_over_limit":{"action":"degrade"}"#,
            "policies[0].on_over_limit.action",
            "unknown variant `degrade`",
        ),
        (
            r#","on_over_limit":{"action":"tag","colour":"red"}"#,
            "policies[0].on_over_limit.colour",
            "unknown field `colour`",
        ),
        (
            r#","on_over_limit":{"action":"tag","header":"X-Over"}"#,
            "policies[0].on_over_limit.header",
            "not a lower-case header name",
        ),
        (
            r#","on_over_limit":{"action":"tag","header":"x over"}"#,
            "policies[0].on_over_limit.header",
            "not a lower-case header name",
        ),
        (
            r#","on_over_limit":{"action":"tag","header":"host"}"#,
            "policies[0].on_over_limit.header",
            "not a lower-case header name a tag may set",
        ),
        (
            r#","on_over_limit":{"action":"reject","header":"x-over"}"#,
            "policies[0].on_over_limit.header",
            "belongs to action `tag`",
        ),
        (
            r#","on_over_limit":{"action":"tag"},"enforce":false"#,
            "policies[0].on_over_limit.action",
            "shadow",
        ),
        (
            r#","on_over_limit":{"action":"tag","header":"x-tenant-id"}"#,
            "policies[0].on_over_limit.header",
            "is read by policy `p`",
        ),
        (
            r#","on_over_limit":{"action":"tag"},"reserve":{"from":{"body":{"field":"n"}},"default":1,"max":5}"#,
            "policies[0].on_over_limit.action",
            "request body",
        ),
        (
            r#","ratelimit_headers_on_allow":"yes""#,
            "policies[0].ratelimit_headers_on_allow",
            "invalid type",
        ),
    ];
    for (extra, field, reason) in cases {
        let errors = errors_of(&policy(extra));
        assert_eq!(errors.len(), 1, "{extra}: {errors:?}");
        assert_eq!(errors[0].field, field, "{extra}: {errors:?}");
        assert_eq!(errors[0].policy.as_deref(), Some("p"), "{extra}");
        assert!(
            errors[0].reason.contains(reason),
            "{extra}: {}",
            errors[0].reason
        );
    }
}

#[test]
fn ratelimit_headers_on_allow_per_policy_overrides_the_document() {
    let doc = |document: bool| {
        format!(
            r#"{{"policies":[
            {{"name":"a","key":[{{"constant":"all"}}],"rate":{{"units":1,"per":"1s"}},"burst":1}},
            {{"name":"b","key":[{{"constant":"all"}}],"rate":{{"units":1,"per":"1s"}},"burst":1,"ratelimit_headers_on_allow":true}},
            {{"name":"c","key":[{{"constant":"all"}}],"rate":{{"units":1,"per":"1s"}},"burst":1,"ratelimit_headers_on_allow":false}}
            ],"response":{{"ratelimit_headers_on_allow":{document}}}}}"#
        )
    };
    let on = |document: bool| -> Vec<bool> {
        Policies::from_json(doc(document).as_bytes())
            .unwrap()
            .policies
            .iter()
            .map(|p| p.headers_on_allow)
            .collect()
    };
    assert_eq!(on(false), vec![false, true, false]);
    assert_eq!(on(true), vec![true, true, false]);
}

fn by_value(limits: &str, extra: &str) -> String {
    format!(
        r#"{{"policies":[{{"name":"plans","key":[{{"header":"x-tenant-id"}}],"limits":{limits}{extra}}}]}}"#
    )
}

const PLANS: &str = r#"{"by":{"header":"x-plan"},
    "values":{"free":{"rate":{"units":2,"per":"1m"},"burst":2},"pro":{"rate":{"units":5,"per":"1m"},"burst":5},"Gold Plan":{"rate":{"units":9,"per":"1m"},"burst":9}},
    "default":{"rate":{"units":1,"per":"1m"},"burst":1},
    "overrides":{"acme":{"rate":{"units":7,"per":"1m"},"burst":7}}}"#;

#[test]
fn limits_by_value_compile_one_policy_per_entry() {
    let policies = Policies::from_json(by_value(PLANS, "").as_bytes()).unwrap();
    let p = policies.get("plans").unwrap();
    // The policy's own numbers are the default entry's.
    assert_eq!((p.units, p.burst), (1, 1));
    let by = p.limits_by.as_ref().unwrap();
    assert_eq!(by.by, KeyPart::Header("x-plan".into()));
    assert!(by.has_value("!vfree") && by.has_value("!vGold%20Plan"));
    assert!(!by.has_value("!vgold") && by.has_default());
    assert!(by.has_override("acme") && !by.has_override("acme2"));
    let burst = |key: &str| p.entry_for(key).map(|e| e.burst);
    assert_eq!(burst("t:!vfree"), Some(2));
    assert_eq!(burst("t:!vpro"), Some(5));
    assert_eq!(burst("t:!vGold%20Plan"), Some(9));
    assert_eq!(burst("t:!d"), Some(1));
    assert_eq!(burst("acme:!o"), Some(7));
    // Names no entry: an unknown value, an override of another key, no entry part.
    assert_eq!(burst("t:!vgold"), None);
    assert_eq!(burst("t:!o"), None);
    assert_eq!(burst("t"), None);
    // The filter's lenient form falls back to the policy's numbers.
    assert_eq!(p.rated("t:!vgold").burst, 1);
    assert_eq!(p.rated_bucket("plans:acme:!o").burst, 7);
    let names: Vec<String> = by.entries().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "values.Gold%20Plan",
            "values.free",
            "values.pro",
            "default",
            "overrides.acme"
        ]
    );
    // A policy without limits refuses a key with an entry part.
    let plain = Policies::from_json(policy("").as_bytes()).unwrap();
    let plain = plain.get("p").unwrap();
    assert!(plain.entry_for("t").is_some() && plain.entry_for("t:!d").is_none());
}

#[test]
fn limits_errors_name_the_field() {
    let cases: &[(&str, &str, &str)] = &[
        // A values entry without its rate: serde names the entry.
        (
            r#"{"by":{"header":"x-plan"},"values":{"pro":{"burst":5}}}"#,
            "",
            "policies[0].limits.values.pro",
        ),
        (
            r#"{"by":{"header":"x-plan"},"values":{"pro":{"rate":{"units":5,"per":"1m"},"burst":5,"algorithm":"x"}}}"#,
            "",
            "policies[0].limits.values.pro.algorithm",
        ),
        (
            PLANS,
            r#","rate":{"units":1,"per":"1s"}"#,
            "policies[0].rate",
        ),
        (PLANS, r#","burst":3"#, "policies[0].burst"),
        (r#"{"by":{"header":"x-plan"}}"#, "", "policies[0].limits"),
        (
            r#"{"by":{"header":"X-Plan"},"default":{"rate":{"units":1,"per":"1s"},"burst":1}}"#,
            "",
            "policies[0].limits.by.header",
        ),
        (
            r#"{"by":{"client_ip":{}},"default":{"rate":{"units":1,"per":"1s"},"burst":1}}"#,
            "",
            "policies[0].limits.by",
        ),
        (
            r#"{"by":{"header":"x-plan"},"values":{"pro":{"rate":{"units":0,"per":"1s"},"burst":1}}}"#,
            "",
            "policies[0].limits.values.pro.rate.units",
        ),
        (
            r#"{"by":{"header":"x-plan"},"default":{"rate":{"units":1,"per":"1s"},"burst":1},"values":{"pro":{"rate":{"units":5,"per":"1s"}}}}"#,
            "",
            "policies[0].limits.values.pro.burst",
        ),
        // A calendar period without a fixed window: an unknown combination.
        (
            r#"{"by":{"header":"x-plan"},"default":{"rate":{"units":1,"per":"1s"},"burst":1},"overrides":{"acme":{"rate":{"units":5,"per":"1mo"},"burst":5}}}"#,
            "",
            "policies[0].limits.overrides.acme.rate.per",
        ),
        (
            r#"{"by":{"header":"x-plan"},"default":{"rate":{"units":1,"per":"1s"},"burst":1},"overrides":{"a:b":{"rate":{"units":5,"per":"1s"},"burst":5}}}"#,
            "",
            "policies[0].limits.overrides.a:b",
        ),
        (
            &format!(
                r#"{{"by":{{"header":"x-plan"}},"values":{{"{}":{{"rate":{{"units":5,"per":"1s"}},"burst":5}}}}}}"#,
                "v".repeat(63)
            ),
            "",
            &format!("policies[0].limits.values.{}", "v".repeat(63)),
        ),
        (
            r#"{"by":{"header":"x-plan"},"values":{"pro":{"rate":{"units":5,"per":"1s"},"burst":5}}}"#,
            r#","on_missing_key":"anonymous""#,
            "policies[0].limits.default",
        ),
        // Every entry's burst must admit the policy's dearest route.
        (
            r#"{"by":{"header":"x-plan"},"default":{"rate":{"units":5,"per":"1s"},"burst":5},"values":{"free":{"rate":{"units":1,"per":"1s"},"burst":1}}}"#,
            r#","match":{"routes":["/a"]},"cost":{"/a":3}"#,
            "policies[0].limits.values.free.burst",
        ),
    ];
    for (limits, extra, field) in cases {
        let errors = errors_of(&by_value(limits, extra));
        assert!(
            errors.iter().any(|e| e.field == *field),
            "{field}: {errors:?}"
        );
        assert!(
            errors.iter().all(|e| e.policy.as_deref() == Some("plans")),
            "{errors:?}"
        );
    }
    // Too many entries.
    let values: Vec<String> = (0..=MAX_LIMIT_ENTRIES)
        .map(|i| format!(r#""v{i}":{{"rate":{{"units":1,"per":"1s"}},"burst":1}}"#))
        .collect();
    let errors = errors_of(&by_value(
        &format!(
            r#"{{"by":{{"header":"x-plan"}},"values":{{{}}}}}"#,
            values.join(",")
        ),
        "",
    ));
    assert_eq!(errors[0].field, "policies[0].limits", "{errors:?}");
    // Neither rate nor limits.
    let errors = errors_of(r#"{"policies":[{"name":"p","key":[{"header":"x"}],"burst":5}]}"#);
    assert_eq!(errors[0].field, "policies[0].rate", "{errors:?}");
}

#[test]
fn limits_entries_take_the_policy_algorithm() {
    let doc = by_value(
        r#"{"by":{"jwt_claim":{"claim":"plan"}},"values":{"free":{"rate":{"units":3,"per":"1mo"}}},"default":{"rate":{"units":10,"per":"1w"}}}"#,
        r#","algorithm":"fixed_window""#,
    );
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    let p = policies.get("plans").unwrap();
    let free = p.entry_for("t:!vfree").unwrap();
    assert_eq!((free.units, free.burst), (3, 3));
    assert!(free
        .algorithm
        .window()
        .is_some_and(|w| w.calendar.is_some()));
    assert!(matches!(
        &p.limits_by.as_ref().unwrap().by,
        KeyPart::JwtClaim { path } if path.last().map(String::as_str) == Some("plan")
    ));
}

#[test]
fn max_in_flight_zero_is_a_refusing_rule() {
    let policies = Policies::from_json(policy(r#","max_in_flight":0"#).as_bytes()).unwrap();
    let limit = policies.get("p").unwrap().in_flight.unwrap();
    assert_eq!(limit.max, 0);
    // No slot can be taken: every request is refused.
    let mut slots = crate::in_flight::Slots::default();
    assert_eq!(slots.take(limit.max, limit.timeout_ms, 1_000), None);
}

#[test]
fn a_tag_header_is_never_a_limits_by_header() {
    let errors = errors_of(&by_value(
        PLANS,
        r#","on_over_limit":{"action":"tag","header":"x-plan"}"#,
    ));
    assert!(
        errors
            .iter()
            .any(|e| e.field == "policies[0].on_over_limit.header" && e.reason.contains("x-plan")),
        "{errors:?}"
    );
}
