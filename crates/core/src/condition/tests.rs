use super::*;
use crate::policy::{Policies, PolicyError};

/// A document of one policy with these `when` conditions (and `match.routes`).
fn doc(routes: &str, when: &str) -> String {
    format!(
        r#"{{"policies":[{{"name":"p","match":{{"routes":{routes}}},"when":{when},"key":[{{"constant":"all"}}],"rate":{{"units":1,"per":"1s"}},"burst":1}}]}}"#
    )
}

fn compiled(when: &str) -> Vec<Condition> {
    compiled_with_routes(r#"["GET /items/{id}"]"#, when)
}

fn compiled_with_routes(routes: &str, when: &str) -> Vec<Condition> {
    match Policies::from_json(doc(routes, when).as_bytes()) {
        Ok(mut p) => p.policies.remove(0).when,
        Err(e) => panic!("{when}: {e}"),
    }
}

/// The one test of a one-condition `when`.
fn test_of(condition: &str) -> Test {
    compiled(&format!("[{condition}]")).remove(0).test
}

fn errors(routes: &str, when: &str) -> Vec<PolicyError> {
    match Policies::from_json(doc(routes, when).as_bytes()) {
        Ok(_) => panic!("accepted: {when}"),
        Err(e) => e.0,
    }
}

/// The single error of a `when` on `GET /items/{id}`: its field and reason.
fn error_of(when: &str) -> (String, String) {
    let mut all = errors(r#"["GET /items/{id}"]"#, when);
    assert_eq!(all.len(), 1, "{all:?}");
    let e = all.remove(0);
    assert_eq!(e.policy.as_deref(), Some("p"));
    (e.field, e.reason)
}

#[test]
fn equals_compares_whole_bytes_case_sensitively() {
    let t = test_of(r#"{"header":"x-plan","equals":"free"}"#);
    assert!(t.holds(Some(b"free")));
    for other in [&b"Free"[..], b"free ", b" free", b"fre", b"freemium", b""] {
        assert!(!t.holds(Some(other)), "{other:?}");
    }
    assert!(!t.holds(None));
}

#[test]
fn in_is_one_of_a_set() {
    let t = test_of(r#"{"header":"x-plan","in":["pro","team","pro","enterprise"]}"#);
    for yes in ["pro", "team", "enterprise"] {
        assert!(t.holds(Some(yes.as_bytes())), "{yes}");
    }
    for no in ["free", "pr", "teams", ""] {
        assert!(!t.holds(Some(no.as_bytes())), "{no}");
    }
    assert!(!t.holds(None));
    let Test::In(set) = t else { panic!() };
    assert_eq!(set.len(), 3, "duplicates are dropped");
}

#[test]
fn prefix_present_and_absent() {
    let t = test_of(r#"{"header":"x-client","prefix":"svc-"}"#);
    assert!(t.holds(Some(b"svc-billing")));
    assert!(t.holds(Some(b"svc-")));
    assert!(!t.holds(Some(b"svc")));
    assert!(!t.holds(Some(b"user-svc-x")));
    assert!(!t.holds(None));

    let present = test_of(r#"{"header":"x-debug","present":true}"#);
    assert!(present.holds(Some(b"1")));
    assert!(present.holds(Some(b"")), "an empty header is present");
    assert!(!present.holds(None));
    let absent = test_of(r#"{"header":"x-debug","absent":true}"#);
    assert!(absent.holds(None));
    assert!(!absent.holds(Some(b"")));
}

#[test]
fn regex_matches_the_whole_value() {
    let t = test_of(r#"{"header":"x-user","regex":"user-[0-9]{1,6}"}"#);
    assert!(t.holds(Some(b"user-42")));
    assert!(!t.holds(Some(b"user-42x")), "anchored at the end");
    assert!(!t.holds(Some(b"xuser-42")), "anchored at the start");
    assert!(!t.holds(Some(b"user-1234567")));
    assert!(!t.holds(None));
    // Alternations stay inside the anchors.
    let t = test_of(r#"{"header":"x-plan","regex":"free|trial"}"#);
    assert!(t.holds(Some(b"trial")));
    assert!(!t.holds(Some(b"free-ish")));
    assert!(!t.holds(Some(b"my-trial")));
    // Flags apply to the pattern.
    let t = test_of(r#"{"header":"x-plan","regex":"(?i)pro"}"#);
    assert!(t.holds(Some(b"PRO")));
}

#[test]
fn cidr_holds_for_addresses_in_the_networks() {
    let t = test_of(r#"{"client_ip":{},"cidr":["10.0.0.0/8","192.0.2.7","2001:db8::/32"]}"#);
    let ip = |text: &str| Some(text.parse::<IpAddr>().unwrap());
    for yes in [
        "10.1.2.3",
        "10.255.255.255",
        "192.0.2.7",
        "2001:db8::1",
        "2001:db8:ffff::",
        "::ffff:10.9.9.9",
    ] {
        assert!(t.holds_ip(ip(yes)), "{yes}");
    }
    for no in [
        "11.0.0.1",
        "192.0.2.8",
        "2001:db9::1",
        "::1",
        "::ffff:11.0.0.1",
    ] {
        assert!(!t.holds_ip(ip(no)), "{no}");
    }
    assert!(!t.holds_ip(None));
    // Bytes are never an address.
    assert!(!t.holds(Some(b"10.1.2.3")));
    let all = test_of(r#"{"client_ip":{},"cidr":["0.0.0.0/0","::/0"]}"#);
    assert!(all.holds_ip(ip("203.0.113.9")) && all.holds_ip(ip("2001:db8::9")));
    let present = test_of(r#"{"client_ip":{"trusted_hops":1},"present":true}"#);
    assert!(present.holds_ip(ip("127.0.0.1")) && !present.holds_ip(None));
}

#[test]
fn cidrs_parse_strictly() {
    assert_eq!(
        Cidr::parse("10.0.0.0/8"),
        Ok(Cidr::V4 {
            network: 0x0a00_0000,
            mask: 0xff00_0000
        })
    );
    assert_eq!(
        Cidr::parse("0.0.0.0/0"),
        Ok(Cidr::V4 {
            network: 0,
            mask: 0
        })
    );
    assert!(Cidr::parse("::/0").is_ok());
    assert!(Cidr::parse("2001:db8::/128").is_ok());
    for bad in [
        "10.0.0.1/8",
        "10.0.0.0/33",
        "10.0.0.0/-1",
        "10.0.0.0/+8",
        "10.0.0.0/",
        "10.0.0/8",
        "2001:db8::/129",
        "2001:db8::1/32",
        "example.com",
        "",
        "10.0.0.0/8/8",
    ] {
        assert!(Cidr::parse(bad).is_err(), "{bad}");
    }
    assert!(Cidr::parse("10.0.0.1/8")
        .unwrap_err()
        .contains("the network is 10.0.0.0/8"));
}

#[test]
fn method_and_path_parameters_are_facts() {
    let when = compiled(
        r#"[{"header":"x-plan","equals":"pro"},{"path_param":"id","regex":"[0-9]+"},{"header":":method","in":["GET","HEAD"]}]"#,
    );
    // Tested cheapest first; each keeps its place in the document for messages.
    let order: Vec<usize> = when.iter().map(|c| c.index).collect();
    assert_eq!(order, [1, 2, 0]);
    assert!(
        matches!(&when[0].fact, Fact::PathParam { name, positions } if name == "id" && positions == &[Some(1)])
    );
    assert_eq!(when[1].fact, Fact::Method);
    assert_eq!(when[2].fact, Fact::Header("x-plan".into()));
}

#[test]
fn a_path_parameter_may_be_missing_from_some_routes() {
    let when = compiled_with_routes(
        r#"["GET /items/{id}", "/health", "PUT /users/{user}/items/{id}"]"#,
        r#"[{"path_param":"id","absent":true}]"#,
    );
    let Fact::PathParam { positions, .. } = &when[0].fact else {
        panic!()
    };
    assert_eq!(positions, &[Some(1), None, Some(3)]);
}

#[test]
fn hostile_values_neither_panic_nor_match_by_accident() {
    let huge = vec![b'a'; 60 * 1024];
    let binary: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
    let invalid_utf8 = vec![0xff, 0xfe, b'p', b'r', b'o'];
    for condition in [
        r#"{"header":"x","equals":"pro"}"#,
        r#"{"header":"x","in":["pro","free"]}"#,
        r#"{"header":"x","prefix":"pro"}"#,
        r#"{"header":"x","regex":"(a|aa)*b"}"#,
        r#"{"header":"x","regex":".*pro"}"#,
        r#"{"header":"x","regex":"(?:.*a){1,10}"}"#,
    ] {
        let t = test_of(condition);
        for value in [&huge[..], &binary, &invalid_utf8, b"\0", b""] {
            assert!(!t.holds(Some(value)), "{condition} held on a hostile value");
        }
    }
    // A regex runs on at most MAX_REGEX_INPUT bytes: past it, no match (not a slow one).
    let t = test_of(r#"{"header":"x","regex":"a*"}"#);
    assert!(t.holds(Some(&huge[..MAX_REGEX_INPUT])));
    assert!(!t.holds(Some(&huge[..=MAX_REGEX_INPUT])));
    // Present holds on anything, hostile or not.
    let present = test_of(r#"{"header":"x","present":true}"#);
    assert!(present.holds(Some(&huge)) && present.holds(Some(&binary)));
}

#[test]
fn a_slow_regex_runs_on_a_bounded_value() {
    // Among the slowest programs that fit the size limit (every `.*` stays alive), on the
    // longest value a regex reads, and on a 60 KB one (which it does not read).
    let t = test_of(r#"{"header":"x","regex":"(?:.*-){1,20}z"}"#);
    let value = "ab-".repeat(MAX_REGEX_INPUT / 3);
    let huge = "ab-".repeat(20_000);
    let started = std::time::Instant::now();
    assert!(!t.holds(Some(value.as_bytes())));
    let bounded = started.elapsed();
    let started = std::time::Instant::now();
    assert!(!t.holds(Some(huge.as_bytes())));
    let refused = started.elapsed();
    println!("{} bytes: {bounded:?}; 60 KB: {refused:?}", value.len());
    // Generous bounds (an unoptimized build on a loaded machine): what they guard against is
    // time growing with the value, which would take seconds here.
    assert!(
        bounded < std::time::Duration::from_millis(500),
        "{bounded:?}"
    );
    assert!(refused < std::time::Duration::from_millis(5), "{refused:?}");
    // One more repetition of that shape no longer compiles.
    let (field, reason) = error_of(r#"[{"header":"x","regex":"(?:.*-){1,40}z"}]"#);
    assert_eq!(field, "policies[0].when[0].regex");
    assert!(reason.contains("more than"), "{reason}");
}

#[test]
fn unknown_operators_and_facts_are_named() {
    let e = errors(
        r#"["GET /items/{id}"]"#,
        r#"[{"header":"x-plan","startswith":"p"}]"#,
    );
    assert_eq!(e.len(), 1);
    assert!(e[0].field.starts_with("policies[0].when[0]"), "{e:?}");
    assert!(e[0].reason.contains("unknown field `startswith`"), "{e:?}");
    assert!(e[0].reason.contains("equals"), "lists what is known: {e:?}");
}

#[test]
fn each_condition_has_one_fact_and_one_operator() {
    let (field, reason) = error_of(r#"[{"equals":"pro"}]"#);
    assert_eq!(field, "policies[0].when[0]");
    assert!(reason.contains("exactly one fact"), "{reason}");
    let (field, reason) = error_of(r#"[{"header":"a","path_param":"id","equals":"x"}]"#);
    assert_eq!(field, "policies[0].when[0]");
    assert!(reason.contains("(has 2)"), "{reason}");
    let (field, reason) = error_of(r#"[{"header":"x-plan"}]"#);
    assert_eq!(field, "policies[0].when[0]");
    assert!(reason.contains("exactly one operator"), "{reason}");
    let (_, reason) = error_of(r#"[{"header":"x-plan","equals":"a","prefix":"b"}]"#);
    assert!(reason.contains("exactly one operator"), "{reason}");
}

#[test]
fn bad_operands_name_their_field() {
    for (when, field, says) in [
        (r#"[{"header":"x","in":[]}]"#, "when[0].in", "at least one"),
        (
            r#"[{"header":"x","prefix":""}]"#,
            "when[0].prefix",
            "present",
        ),
        (
            r#"[{"header":"x","present":false}]"#,
            "when[0].present",
            "absent",
        ),
        (
            r#"[{"header":"x","absent":false}]"#,
            "when[0].absent",
            "present",
        ),
        (
            r#"[{"header":"x","regex":"(unclosed"}]"#,
            "when[0].regex",
            "not a valid",
        ),
        (
            r#"[{"header":"x","regex":"a)|(b"}]"#,
            "when[0].regex",
            "not a valid",
        ),
        (
            r#"[{"header":"x","regex":"(?x)a # comment"}]"#,
            "when[0].regex",
            "not a valid",
        ),
        (
            r#"[{"header":"x","regex":"\\w{1000}"}]"#,
            "when[0].regex",
            "more than",
        ),
        (
            r#"[{"header":"x","regex":"((((((((((((((((((((((((((((((((((a))))))))))))))))))))))))))))))))))"}]"#,
            "when[0].regex",
            "not a valid",
        ),
        (
            r#"[{"client_ip":{},"cidr":["10.0.0.0/8","10.0.0.1/8"]}]"#,
            "when[0].cidr[1]",
            "past its prefix",
        ),
        (
            r#"[{"client_ip":{},"cidr":["fe80::/129"]}]"#,
            "when[0].cidr[0]",
            "0 to 128",
        ),
        (
            r#"[{"client_ip":{},"cidr":["localhost"]}]"#,
            "when[0].cidr[0]",
            "not an IPv4",
        ),
        (
            r#"[{"client_ip":{},"cidr":[]}]"#,
            "when[0].cidr",
            "at least one",
        ),
        (
            r#"[{"client_ip":{},"equals":"10.0.0.1"}]"#,
            "when[0].equals",
            "`cidr`",
        ),
        (
            r#"[{"client_ip":{"trusted_hops":99},"cidr":["::/0"]}]"#,
            "when[0].client_ip.trusted_hops",
            "at most",
        ),
        (
            r#"[{"header":"x","cidr":["10.0.0.0/8"]}]"#,
            "when[0].cidr",
            "`client_ip` only",
        ),
        (
            r#"[{"header":"X-Plan","equals":"a"}]"#,
            "when[0].header",
            "lower-case",
        ),
        (
            r#"[{"header":":path","prefix":"/a"}]"#,
            "when[0].header",
            "`:method`",
        ),
        (
            r#"[{"header":":method","present":true}]"#,
            "when[0].present",
            "every request",
        ),
        (
            r#"[{"path_param":"user","equals":"a"}]"#,
            "when[0].path_param",
            "they have id",
        ),
        (
            r#"[{"jwt_claim":{"claim":""},"equals":"a"}]"#,
            "when[0].jwt_claim.claim",
            "must name",
        ),
    ] {
        let (got, reason) = error_of(when);
        assert_eq!(got, format!("policies[0].{field}"), "{when}: {reason}");
        assert!(reason.contains(says), "{when}: {reason}");
    }
    let long = "v".repeat(MAX_VALUE_BYTES + 1);
    let (field, _) = error_of(&format!(r#"[{{"header":"x","in":["a","{long}"]}}]"#));
    assert_eq!(field, "policies[0].when[0].in[1]");
    let long = "a".repeat(MAX_PATTERN_BYTES + 1);
    let (field, reason) = error_of(&format!(r#"[{{"header":"x","regex":"{long}"}}]"#));
    assert_eq!(field, "policies[0].when[0].regex");
    assert!(reason.contains("longer than"), "{reason}");
}

#[test]
fn a_path_parameter_must_be_one_of_the_routes() {
    let e = errors("[]", r#"[{"path_param":"id","equals":"a"}]"#);
    assert_eq!(e[0].field, "policies[0].when[0].path_param");
    assert!(e[0].reason.contains("needs `match.routes`"), "{e:?}");
    let e = errors(r#"["/health"]"#, r#"[{"path_param":"id","equals":"a"}]"#);
    assert!(e[0].reason.contains("they have none"), "{e:?}");
}

#[test]
fn every_bad_condition_is_reported_and_their_number_is_bounded() {
    let e = errors(
        r#"["GET /items/{id}"]"#,
        r#"[{"header":"x","in":[]},{"header":"ok","equals":"a"},{"client_ip":{},"cidr":["x"]}]"#,
    );
    let fields: Vec<&str> = e.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        ["policies[0].when[0].in", "policies[0].when[2].cidr[0]"]
    );
    let many = vec![r#"{"header":"x","present":true}"#; MAX_CONDITIONS + 1].join(",");
    let (field, _) = error_of(&format!("[{many}]"));
    assert_eq!(field, "policies[0].when");
}

#[test]
fn the_book_example_loads_and_decides_as_it_says() {
    let page = include_str!("../../../../docs/src/policies/conditions.md");
    let section = page
        .split("# Conditions (`when`)")
        .nth(1)
        .expect("docs/src/policies/conditions.md is the Conditions page");
    let json = section
        .split("```json\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the section opens with a JSON example");
    let policies = Policies::from_json(json.as_bytes()).unwrap();
    let [free, pro] = &policies.policies[..] else {
        panic!("two policies")
    };
    assert_eq!((free.burst, pro.burst), (2, 5));
    assert!(free.when[0].test.holds(Some(b"free")));
    // Tested cheapest first: the route parameter, the header, then the address.
    let facts: Vec<&Fact> = pro.when.iter().map(|c| &c.fact).collect();
    assert!(matches!(
        facts[..],
        [
            Fact::PathParam { .. },
            Fact::Header(_),
            Fact::ClientIp { .. }
        ]
    ));
    assert!(pro.when[0].test.holds(Some(b"123456789012")));
    assert!(!pro.when[0].test.holds(Some(b"1234567890123")));
    assert!(pro.when[1].test.holds(Some(b"team")));
    assert!(pro.when[2].test.holds_ip(Some("10.2.3.4".parse().unwrap())));
    assert!(!pro.when[2]
        .test
        .holds_ip(Some("192.0.2.1".parse().unwrap())));
}
