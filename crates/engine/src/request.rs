//! What the filter reads from a request, how a policy's key is built from it, and whether the
//! policy's `when` conditions hold.
//!
//! Only trusted data becomes a key or decides a condition: the configured header, the verified
//! JWT claim from `jwt_authn` metadata, the socket peer (or the configured hop of
//! `X-Forwarded-For`), a digest of the API key, the matched route *template* (and, for a
//! condition, the value of one of its parameters). Every part is escaped or digested by
//! `tollgate_core::key`, so no byte sequence can reach another tenant's bucket, and a key's size
//! is bounded whatever the request carries.

use std::borrow::Cow;
use std::net::IpAddr;
use tollgate_core::condition::Fact;
use tollgate_core::identity::{api_key_digest, ip_from_forwarded_for, ip_from_socket_address};
use tollgate_core::key::{
    escape_part_into, ANONYMOUS_PART, DEFAULT_ENTRY_PART, OVERRIDE_ENTRY_PART, VALUE_ENTRY_PREFIX,
};
use tollgate_core::policy::{KeyPart, LimitsBy, Policy, RouteMatch};
use tollgate_core::route::path_segment;

/// Read access to the request being decided.
pub trait RequestSource {
    /// First value of a request header (lower-case name), raw bytes.
    fn header(&self, name: &str) -> Option<Vec<u8>>;
    /// `f` of the first value of a request header: where the host lets the filter read the
    /// value in place, without copying it (by default, a copy from [`RequestSource::header`]).
    fn with_header<R>(&self, name: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        f(self.header(name).as_deref())
    }
    /// A host property (`["source", "address"]`, jwt_authn metadata, ...), raw bytes.
    fn property(&self, path: &[&str]) -> Option<Vec<u8>>;
}

/// The request line facts every policy matches on, borrowed from the host's headers where
/// it lets the filter read them in place (no copy per request).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestFacts<'a> {
    pub method: Cow<'a, str>,
    /// Raw `:path` (query included; matching cuts it).
    pub path: Cow<'a, str>,
    /// `:authority` host, lower-case, without port.
    pub host: Cow<'a, str>,
}

/// The key of a policy for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyKey {
    Key(String),
    /// An identity part is absent (or unusable, like an X-Forwarded-For entry that is no IP).
    Missing,
}

/// Builds the policy's key. With `anonymous`, absent identity parts become the shared
/// anonymous part instead of making the key [`PolicyKey::Missing`].
pub fn build_key(
    policy: &Policy,
    route: Option<&str>,
    facts: &RequestFacts<'_>,
    source: &impl RequestSource,
    anonymous: bool,
) -> PolicyKey {
    let mut key = String::with_capacity(64);
    if write_key(&mut key, policy, route, facts, source, anonymous) {
        PolicyKey::Key(key)
    } else {
        PolicyKey::Missing
    }
}

/// [`build_key`] appended to `key` (the plan writes it after the policy's name, so a request's
/// bucket id takes one buffer); `false`: the key is missing, and `key` holds part of it.
pub fn write_key(
    key: &mut String,
    policy: &Policy,
    route: Option<&str>,
    facts: &RequestFacts<'_>,
    source: &impl RequestSource,
    anonymous: bool,
) -> bool {
    // Each part escaped into the one buffer, `:` between parts (the form `join_parts` gives).
    for (i, part) in policy.key.iter().enumerate() {
        if i > 0 {
            key.push(':');
        }
        let present = match part {
            KeyPart::Header(name) => source.with_header(name, |value| escaped(key, value)),
            KeyPart::ApiKey(name) => {
                let digest = source.with_header(name, |value| {
                    value.filter(|v| !v.is_empty()).map(api_key_digest)
                });
                escaped(key, digest.as_ref().map(|d| d.as_bytes()))
            }
            KeyPart::JwtClaim { path } => {
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                escaped(key, source.property(&path).as_deref())
            }
            KeyPart::ClientIp { trusted_hops } => escaped(
                key,
                client_ip(source, *trusted_hops)
                    .map(|ip| ip.to_string().into_bytes())
                    .as_deref(),
            ),
            KeyPart::Constant(escaped) => {
                key.push_str(escaped);
                true
            }
            KeyPart::Route => match route {
                Some(r) => {
                    escape_part_into(key, r.as_bytes());
                    true
                }
                None => false,
            },
            KeyPart::Method => {
                escape_part_into(key, facts.method.as_bytes());
                true
            }
        };
        if !present {
            if !anonymous {
                return false;
            }
            key.push_str(ANONYMOUS_PART);
        }
    }
    true
}

/// Appends to a built key (in `key` from `from`: the plan's buffer holds the policy's name
/// before it) the part naming its `limits` entry: the key's override, else the `values` entry
/// of the `by` fact's value, else the default. `false` (the key left as it was): none
/// applies, and the request is one without its identity.
pub fn choose_entry(
    by: &LimitsBy,
    key: &mut String,
    from: usize,
    source: &impl RequestSource,
) -> bool {
    if key
        .get(from..)
        .is_some_and(|identity| by.has_override(identity))
    {
        key.push(':');
        key.push_str(OVERRIDE_ENTRY_PART);
        return true;
    }
    let identity = key.len();
    key.push(':');
    key.push_str(VALUE_ENTRY_PREFIX);
    let present = match &by.by {
        KeyPart::Header(name) => source.with_header(name, |value| escaped(key, value)),
        KeyPart::JwtClaim { path } => {
            let path: Vec<&str> = path.iter().map(String::as_str).collect();
            escaped(key, source.property(&path).as_deref())
        }
        _ => false,
    };
    if present
        && key
            .get(identity + 1..)
            .is_some_and(|part| by.has_value(part))
    {
        return true;
    }
    key.truncate(identity);
    if by.has_default() {
        key.push(':');
        key.push_str(DEFAULT_ENTRY_PART);
        return true;
    }
    false
}

/// Escapes a non-empty value into the key; `false` when it is absent or empty.
fn escaped(key: &mut String, value: Option<&[u8]>) -> bool {
    match value {
        Some(value) if !value.is_empty() => {
            escape_part_into(key, value);
            true
        }
        _ => false,
    }
}

/// The client IP a `client_ip` key part or condition reads. `trusted_hops` 0: Envoy's client
/// address (`source.address`): the connection's peer with `use_remote_address: true`, or what
/// its `xff_num_trusted_hops` picked. Otherwise the entry Envoy's `xff_num_trusted_hops: N`
/// would pick; when there is none (too few entries, or not an IP), Envoy's client address, as
/// Envoy falls back to the connection's. A client never chooses its address by sending a short
/// or garbled header.
pub fn client_ip(source: &impl RequestSource, trusted_hops: u32) -> Option<IpAddr> {
    if trusted_hops > 0 {
        let forwarded = source.with_header("x-forwarded-for", |xff| {
            xff.and_then(|xff| ip_from_forwarded_for(&String::from_utf8_lossy(xff), trusted_hops))
        });
        if forwarded.is_some() {
            return forwarded;
        }
    }
    client_address(source)
}

/// Envoy's client address of the request (`source.address`).
fn client_address(source: &impl RequestSource) -> Option<IpAddr> {
    source
        .property(&["source", "address"])
        .and_then(|a| ip_from_socket_address(&String::from_utf8_lossy(&a)))
}

/// Whether all of a policy's `when` conditions hold for a request its `match` matched
/// (`route`). Values are read in place where the host lends them (headers), tested without a
/// copy: a header is its first value, the one a key part reads (Envoy's `request_headers`
/// rate-limit action reads the same); the method and a route parameter are borrowed from the
/// request line; a claim and the client address are what the host hands over.
pub fn conditions_hold(
    policy: &Policy,
    route: &RouteMatch<'_>,
    facts: &RequestFacts<'_>,
    source: &impl RequestSource,
) -> bool {
    policy.when.iter().all(|condition| {
        let test = &condition.test;
        match &condition.fact {
            Fact::Header(name) => source.with_header(name, |value| test.holds(value)),
            Fact::Method => test.holds(Some(facts.method.as_bytes())),
            Fact::PathParam { positions, .. } => test.holds(
                route
                    .template
                    .and_then(|t| positions.get(t).copied().flatten())
                    .and_then(|segment| path_segment(&facts.path, segment)),
            ),
            Fact::JwtClaim { path } => {
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                test.holds(source.property(&path).as_deref())
            }
            Fact::ClientIp { trusted_hops } => test.holds_ip(client_ip(source, *trusted_hops)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use tollgate_core::key::validate_key;
    use tollgate_core::policy::Policies;

    #[derive(Default)]
    struct Fake {
        headers: HashMap<String, Vec<u8>>,
        properties: HashMap<String, Vec<u8>>,
    }

    impl RequestSource for Fake {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.headers.get(name).cloned()
        }
        fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
            self.properties.get(&path.join("/")).cloned()
        }
    }

    fn policy(key: &str) -> Policies {
        Policies::from_json(
            format!(
                r#"{{"policies":[{{"name":"p","match":{{"routes":["GET /items/{{id}}"]}},"key":{key},"rate":{{"units":1,"per":"1s"}},"burst":1}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn facts() -> RequestFacts<'static> {
        RequestFacts {
            method: "GET".into(),
            path: "/items/42?x=1".into(),
            host: "api".into(),
        }
    }

    #[test]
    fn header_route_and_method_parts() {
        let p = policy(r#"[{"header":"x-tenant-id"},"route","method"]"#);
        let mut src = Fake::default();
        src.headers.insert("x-tenant-id".into(), b"acme".to_vec());
        let key = build_key(
            &p.policies[0],
            Some("GET /items/{id}"),
            &facts(),
            &src,
            false,
        );
        assert_eq!(
            key,
            PolicyKey::Key("acme:GET%20%2fitems%2f%7bid%7d:GET".into())
        );
    }

    #[test]
    fn a_limits_entry_is_the_last_key_part() {
        let p = Policies::from_json(
            br#"{"policies":[{"name":"p","key":[{"header":"x-tenant-id"}],"limits":{
              "by":{"header":"x-plan"},
              "values":{"pro":{"rate":{"units":5,"per":"1m"},"burst":5},"a b":{"rate":{"units":3,"per":"1m"},"burst":3}},
              "default":{"rate":{"units":1,"per":"1m"},"burst":1},
              "overrides":{"acme":{"rate":{"units":7,"per":"1m"},"burst":7}}}}]}"#,
        )
        .unwrap();
        let policy = &p.policies[0];
        let Some(by) = policy.limits_by.as_deref() else {
            panic!("limits compiled")
        };
        let entry = |tenant: &str, plan: Option<&[u8]>| {
            let mut src = Fake::default();
            if let Some(plan) = plan {
                src.headers.insert("x-plan".into(), plan.to_vec());
            }
            let mut key = tenant.to_string();
            assert!(choose_entry(by, &mut key, 0, &src));
            (key.clone(), policy.rated(&key).burst)
        };
        assert_eq!(entry("t", Some(b"pro")), ("t:!vpro".into(), 5));
        assert_eq!(entry("t", Some(b"a b")), ("t:!va%20b".into(), 3));
        // An unknown, empty, absent or oversized value takes the default.
        assert_eq!(entry("t", Some(b"gold")), ("t:!d".into(), 1));
        assert_eq!(entry("t", Some(b"")), ("t:!d".into(), 1));
        assert_eq!(entry("t", None), ("t:!d".into(), 1));
        assert_eq!(entry("t", Some(&[b'p'; 500])), ("t:!d".into(), 1));
        // The tenant's override, whatever its plan says.
        assert_eq!(entry("acme", Some(b"pro")), ("acme:!o".into(), 7));
        assert!(validate_key("acme:!o").is_ok() && validate_key("t:!va%20b").is_ok());
    }

    /// A host that lends header values in place: `header` (a copy) is never asked.
    struct Lending(Fake);

    impl RequestSource for Lending {
        fn header(&self, _name: &str) -> Option<Vec<u8>> {
            None
        }
        fn with_header<R>(&self, name: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
            f(self.0.headers.get(name).map(Vec::as_slice))
        }
        fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
            self.0.property(path)
        }
    }

    #[test]
    fn header_parts_are_read_in_place_where_the_host_lends_them() {
        let mut src = Fake::default();
        src.headers.insert("x-tenant-id".into(), b"a:b".to_vec());
        src.headers.insert("x-api-key".into(), b"secret".to_vec());
        src.headers
            .insert("x-forwarded-for".into(), b"203.0.113.7, 10.0.0.1".to_vec());
        for key in [
            r#"[{"header":"x-tenant-id"}]"#,
            r#"[{"api_key":"x-api-key"}]"#,
            r#"[{"client_ip":{"trusted_hops":1}}]"#,
        ] {
            let p = policy(key);
            let copied = build_key(&p.policies[0], None, &facts(), &src, false);
            assert!(matches!(copied, PolicyKey::Key(_)), "{key}: {copied:?}");
            let src = Lending(Fake {
                headers: src.headers.clone(),
                properties: src.properties.clone(),
            });
            assert_eq!(
                build_key(&p.policies[0], None, &facts(), &src, false),
                copied,
                "{key}"
            );
        }
    }

    #[test]
    fn hostile_headers_become_bounded_valid_keys() {
        let p = policy(r#"[{"header":"x-tenant-id"}]"#);
        for hostile in [
            b"{tenant-b}:x".to_vec(),
            vec![0xff, 0x00, b':', b'{'],
            vec![b'a'; 65_536],
            b"!anonymous".to_vec(),
            b"#0123456789abcdef0123456789abcdef".to_vec(),
        ] {
            let mut src = Fake::default();
            src.headers.insert("x-tenant-id".into(), hostile.clone());
            let PolicyKey::Key(key) = build_key(&p.policies[0], None, &facts(), &src, false) else {
                panic!("missing");
            };
            assert!(validate_key(&key).is_ok(), "{key}");
            assert!(key.len() <= 64);
            assert!(!key.contains(['{', '}', ':']));
            assert_ne!(key, ANONYMOUS_PART);
        }
    }

    #[test]
    fn missing_identity_is_missing_or_anonymous() {
        let p = policy(r#"[{"header":"x-tenant-id"},"route"]"#);
        let src = Fake::default();
        let policy = &p.policies[0];
        assert_eq!(
            build_key(policy, Some("GET /items/{id}"), &facts(), &src, false),
            PolicyKey::Missing
        );
        assert_eq!(
            build_key(policy, Some("GET /items/{id}"), &facts(), &src, true),
            PolicyKey::Key("!anonymous:GET%20%2fitems%2f%7bid%7d".into())
        );
        let mut empty = Fake::default();
        empty.headers.insert("x-tenant-id".into(), Vec::new());
        assert_eq!(
            build_key(policy, Some("GET /items/{id}"), &facts(), &empty, false),
            PolicyKey::Missing
        );
    }

    #[test]
    fn client_ip_from_socket_and_forwarded_for() {
        let p = policy(r#"[{"client_ip":{}}]"#);
        let mut src = Fake::default();
        src.properties
            .insert("source/address".into(), b"[::1]:5555".to_vec());
        assert_eq!(
            build_key(&p.policies[0], None, &facts(), &src, false),
            PolicyKey::Key("%3a%3a1".into())
        );
        // One trusted proxy (10.9.9.9, appended by Envoy) that appended its client, 10.1.2.3.
        let p = policy(r#"[{"client_ip":{"trusted_hops":1}}]"#);
        src.headers.insert(
            "x-forwarded-for".into(),
            b"6.6.6.6, 10.1.2.3, 10.9.9.9".to_vec(),
        );
        assert_eq!(
            build_key(&p.policies[0], None, &facts(), &src, false),
            PolicyKey::Key("10.1.2.3".into())
        );
        // A garbled entry or too short a header: Envoy's client address, as Envoy does.
        for xff in ["6.6.6.6, not-an-ip, 10.9.9.9", "10.9.9.9", ""] {
            src.headers
                .insert("x-forwarded-for".into(), xff.as_bytes().to_vec());
            assert_eq!(
                build_key(&p.policies[0], None, &facts(), &src, false),
                PolicyKey::Key("%3a%3a1".into()),
                "{xff}"
            );
        }
        src.headers.clear();
        assert_eq!(
            build_key(&p.policies[0], None, &facts(), &src, false),
            PolicyKey::Key("%3a%3a1".into())
        );
        // Without any address at all the key is missing.
        src.properties.clear();
        assert_eq!(
            build_key(&p.policies[0], None, &facts(), &src, false),
            PolicyKey::Missing
        );
    }

    #[test]
    fn api_keys_and_jwt_claims() {
        let p = policy(r#"[{"api_key":"x-api-key"},{"jwt_claim":{"claim":"tenant"}}]"#);
        let mut src = Fake::default();
        src.headers
            .insert("x-api-key".into(), b"sk_live_secret".to_vec());
        src.properties.insert(
            "metadata/filter_metadata/envoy.filters.http.jwt_authn/jwt_payload/tenant".into(),
            b"acme".to_vec(),
        );
        let PolicyKey::Key(key) = build_key(&p.policies[0], None, &facts(), &src, false) else {
            panic!("missing");
        };
        assert!(
            key.starts_with("sha256-") && key.ends_with(":acme"),
            "{key}"
        );
        assert!(!key.contains("secret"));
    }

    /// The one policy of a document with `match.routes` and `when`.
    fn conditional(routes: &str, when: &str) -> Policies {
        Policies::from_json(
            format!(
                r#"{{"policies":[{{"name":"p","match":{{"routes":{routes}}},"when":{when},"key":[{{"constant":"all"}}],"rate":{{"units":1,"per":"1s"}},"burst":1}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    /// Whether `when` holds for `src` on `facts` (the policy's `match` must match them).
    fn holds(p: &Policies, facts: &RequestFacts<'_>, src: &impl RequestSource) -> bool {
        let policy = &p.policies[0];
        let route = policy
            .match_request(&facts.host, &facts.method, &facts.path)
            .expect("match");
        conditions_hold(policy, &route, facts, src)
    }

    fn with_header(name: &str, value: &[u8]) -> Fake {
        let mut src = Fake::default();
        src.headers.insert(name.into(), value.to_vec());
        src
    }

    #[test]
    fn header_conditions_read_the_value_a_key_part_reads_in_place() {
        let p = conditional(
            r#"["GET /items/{id}"]"#,
            r#"[{"header":"x-plan","in":["pro","team"]}]"#,
        );
        assert!(holds(&p, &facts(), &with_header("x-plan", b"pro")));
        assert!(!holds(&p, &facts(), &with_header("x-plan", b"free")));
        assert!(!holds(&p, &facts(), &Fake::default()));
        // Lent in place: `header` (a copy) is never asked.
        let lending = Lending(with_header("x-plan", b"team"));
        assert!(holds(&p, &facts(), &lending));
    }

    #[test]
    fn all_conditions_must_hold() {
        let p = conditional(
            r#"["GET /items/{id}"]"#,
            r#"[{"header":"x-plan","equals":"pro"},{"header":"x-region","prefix":"eu-"}]"#,
        );
        let mut src = with_header("x-plan", b"pro");
        assert!(!holds(&p, &facts(), &src));
        src.headers.insert("x-region".into(), b"eu-west".to_vec());
        assert!(holds(&p, &facts(), &src));
        src.headers.insert("x-plan".into(), b"free".to_vec());
        assert!(!holds(&p, &facts(), &src));
    }

    #[test]
    fn method_and_path_parameter_conditions_read_the_request_line() {
        let p = conditional(
            r#"["/items/{id}", "/users/{user}/items/{id}", "/health"]"#,
            r#"[{"header":":method","in":["GET","HEAD"]},{"path_param":"id","regex":"[0-9]{1,6}"}]"#,
        );
        fn at<'a>(method: &'a str, path: &'a str) -> RequestFacts<'a> {
            RequestFacts {
                method: method.into(),
                path: path.into(),
                host: "api".into(),
            }
        }
        let src = Fake::default();
        assert!(holds(&p, &at("GET", "/items/42?id=x"), &src));
        assert!(holds(&p, &at("HEAD", "/users/ann/items/7/"), &src));
        assert!(!holds(&p, &at("POST", "/items/42"), &src));
        assert!(!holds(&p, &at("GET", "/items/abc"), &src));
        assert!(!holds(&p, &at("GET", "/users/42/items/x"), &src));
        // `/health` has no `{id}`: the parameter is absent there, so the regex does not hold.
        assert!(!holds(&p, &at("GET", "/health"), &src));
        let absent = conditional(
            r#"["/items/{id}", "/health"]"#,
            r#"[{"path_param":"id","absent":true}]"#,
        );
        assert!(holds(&absent, &at("GET", "/health"), &src));
        assert!(!holds(&absent, &at("GET", "/items/1"), &src));
    }

    #[test]
    fn client_ip_conditions_read_the_address_a_key_part_reads() {
        let mut src = Fake::default();
        src.properties
            .insert("source/address".into(), b"10.9.9.9:5555".to_vec());
        src.headers.insert(
            "x-forwarded-for".into(),
            b"6.6.6.6, 203.0.113.7, 10.9.9.9".to_vec(),
        );
        let internal = conditional("[]", r#"[{"client_ip":{},"cidr":["10.0.0.0/8"]}]"#);
        assert!(holds(&internal, &facts(), &src));
        // Behind one trusted proxy: the client it appended, not the proxy, not a forged entry.
        let hop = |cidr: &str| {
            conditional(
                "[]",
                &format!(r#"[{{"client_ip":{{"trusted_hops":1}},"cidr":["{cidr}"]}}]"#),
            )
        };
        assert!(holds(&hop("203.0.113.0/24"), &facts(), &src));
        assert!(!holds(&hop("10.0.0.0/8"), &facts(), &src));
        assert!(!holds(&hop("6.6.6.6"), &facts(), &src));
        // A garbled header falls back to Envoy's client address, as the key part does.
        src.headers
            .insert("x-forwarded-for".into(), b"not-an-ip, 10.9.9.9".to_vec());
        assert!(holds(&hop("10.9.9.9/32"), &facts(), &src));
        // No address at all: only `absent` holds.
        src.properties.clear();
        src.headers.clear();
        assert!(!holds(&internal, &facts(), &src));
        let absent = conditional("[]", r#"[{"client_ip":{},"absent":true}]"#);
        assert!(holds(&absent, &facts(), &src));
    }

    #[test]
    fn claim_conditions_read_jwt_authn_metadata() {
        let p = conditional(
            "[]",
            r#"[{"jwt_claim":{"claim":["org","plan"]},"equals":"pro"}]"#,
        );
        let mut src = Fake::default();
        assert!(!holds(&p, &facts(), &src));
        src.properties.insert(
            "metadata/filter_metadata/envoy.filters.http.jwt_authn/jwt_payload/org/plan".into(),
            b"pro".to_vec(),
        );
        assert!(holds(&p, &facts(), &src));
    }

    #[test]
    fn hostile_header_values_are_tested_without_panic() {
        let p = conditional(
            "[]",
            r#"[{"header":"x-plan","regex":"(?:.*-){1,20}z"},{"header":"x-plan","prefix":"pro"}]"#,
        );
        for hostile in [
            vec![b'-'; 60 * 1024],
            (0..=255u8).cycle().take(60 * 1024).collect(),
            vec![0xff; 3],
        ] {
            assert!(!holds(&p, &facts(), &with_header("x-plan", &hostile)));
            let lent = Lending(with_header("x-plan", &hostile));
            assert!(!holds(&p, &facts(), &lent));
        }
    }
}
