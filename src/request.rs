//! What the filter reads from a request, and how a policy's key is built from it.
//!
//! Only trusted data becomes a key: the configured header, the verified JWT claim from
//! `jwt_authn` metadata, the socket peer (or the configured hop of `X-Forwarded-For`), a digest
//! of the API key, the matched route *template*. Every part is escaped or digested by
//! `tollgate_core::key`, so no byte sequence can reach another tenant's bucket, and a key's size
//! is bounded whatever the request carries.

use std::borrow::Cow;
use tollgate_core::identity::{api_key_digest, ip_from_forwarded_for, ip_from_socket_address};
use tollgate_core::key::{escape_part_into, ANONYMOUS_PART};
use tollgate_core::policy::{KeyPart, Policy};

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
    // One buffer for the whole key: each part escaped into it, `:` between parts (the form
    // `join_parts` gives).
    let mut key = String::with_capacity(64);
    for (i, part) in policy.key.iter().enumerate() {
        if i > 0 {
            key.push(':');
        }
        let present = match part {
            KeyPart::Header(name) => source.with_header(name, |value| escaped(&mut key, value)),
            KeyPart::ApiKey(name) => {
                let digest = source.with_header(name, |value| {
                    value.filter(|v| !v.is_empty()).map(api_key_digest)
                });
                escaped(&mut key, digest.as_ref().map(|d| d.as_bytes()))
            }
            KeyPart::JwtClaim { path } => {
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                escaped(&mut key, source.property(&path).as_deref())
            }
            // Envoy's client address (`source.address`): the connection's peer with
            // `use_remote_address: true`, or what its `xff_num_trusted_hops` picked.
            KeyPart::ClientIp { trusted_hops: 0 } => escaped(
                &mut key,
                client_address(source)
                    .map(|ip| ip.to_string().into_bytes())
                    .as_deref(),
            ),
            // The entry Envoy's `xff_num_trusted_hops: N` would pick; when there is none (too
            // few entries, or not an IP), Envoy's client address, as Envoy falls back to the
            // connection's. A client never chooses its key by sending a short or garbled header.
            KeyPart::ClientIp { trusted_hops } => escaped(
                &mut key,
                source
                    .with_header("x-forwarded-for", |xff| {
                        xff.and_then(|xff| {
                            ip_from_forwarded_for(&String::from_utf8_lossy(xff), *trusted_hops)
                        })
                    })
                    .or_else(|| client_address(source))
                    .map(|ip| ip.to_string().into_bytes())
                    .as_deref(),
            ),
            KeyPart::Constant(escaped) => {
                key.push_str(escaped);
                true
            }
            KeyPart::Route => match route {
                Some(r) => {
                    escape_part_into(&mut key, r.as_bytes());
                    true
                }
                None => false,
            },
            KeyPart::Method => {
                escape_part_into(&mut key, facts.method.as_bytes());
                true
            }
        };
        if !present {
            if !anonymous {
                return PolicyKey::Missing;
            }
            key.push_str(ANONYMOUS_PART);
        }
    }
    PolicyKey::Key(key)
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

/// Envoy's client address of the request (`source.address`).
fn client_address(source: &impl RequestSource) -> Option<std::net::IpAddr> {
    source
        .property(&["source", "address"])
        .and_then(|a| ip_from_socket_address(&String::from_utf8_lossy(&a)))
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
}
