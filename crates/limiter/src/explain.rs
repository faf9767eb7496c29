//! `check-policies FILE --explain --method GET --path /x --header 'x-plan: pro'`: which policies
//! a sample request hits and why the others are skipped, decided by the filter's own engine
//! (`tollgate_engine::engine::Engine::plan`: `match`, `when`, the key, the `limits` entry, the cost)
//! over a request made of the command line's facts. Nothing is counted: the plan is printed,
//! never decided.

use std::fmt::Write as _;

use tollgate_core::key;
use tollgate_core::policy::{authority_host, OnMissingKey, Policies, Policy};
use tollgate_engine::engine::{Engine, Outcome, SHARED_PREFIX};
use tollgate_engine::request::{
    build_key, conditions_hold, PolicyKey, RequestFacts, RequestSource,
};
use tollgate_engine::shared::MemorySharedData;
use tollgate_engine::table::SlotTable;

/// The request to explain, as the command line gives it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SampleRequest {
    pub method: String,
    pub path: String,
    /// `:authority` (empty: matches only policies without `match.hosts`).
    pub host: String,
    /// `name: value`, names lower-cased; the first of a name is its value.
    pub headers: Vec<(String, String)>,
    /// Envoy's client address.
    pub client_ip: Option<String>,
    /// Verified JWT claims (`name` or `a.b` for a nested claim) and their values.
    pub claims: Vec<(String, String)>,
}

/// Why `--explain` cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error("--header `{0}` is not `name: value`")]
    Header(String),
    #[error("--claim `{0}` is not `name=value`")]
    Claim(String),
    #[error("cannot plan: {0}")]
    Engine(String),
}

/// `--header 'name: value'`.
pub fn parse_header(text: &str) -> Result<(String, String), ExplainError> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| ExplainError::Header(text.to_string()))?;
    let name = name.trim().to_ascii_lowercase();
    if name.is_empty() {
        return Err(ExplainError::Header(text.to_string()));
    }
    Ok((name, value.trim().to_string()))
}

/// `--claim name=value`.
pub fn parse_claim(text: &str) -> Result<(String, String), ExplainError> {
    match text.split_once('=') {
        Some((name, value)) if !name.is_empty() => Ok((name.to_string(), value.to_string())),
        _ => Err(ExplainError::Claim(text.to_string())),
    }
}

/// The sample request as the engine reads a request.
struct Sample<'a>(&'a SampleRequest);

impl RequestSource for Sample<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.0
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone().into_bytes())
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        if path == ["source", "address"] {
            let ip = self.0.client_ip.as_deref()?;
            return Some(if ip.contains(':') {
                format!("[{ip}]:0").into_bytes()
            } else {
                format!("{ip}:0").into_bytes()
            });
        }
        // jwt_authn metadata: metadata.filter_metadata.<namespace>.<payload>.<claim path>.
        let claim = path.get(4..)?.join(".");
        self.0
            .claims
            .iter()
            .find(|(n, _)| *n == claim)
            .map(|(_, v)| v.clone().into_bytes())
    }
}

/// What the plan says for each policy of `policies`, one line each.
pub fn explain(policies: &Policies, request: &SampleRequest) -> Result<String, ExplainError> {
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, policies.local_table.slots, 1)
        .map_err(|e| ExplainError::Engine(format!("{e:?}")))?;
    let engine = Engine::new(policies.clone(), table);
    let facts = RequestFacts {
        method: request.method.as_str().into(),
        path: request.path.as_str().into(),
        host: authority_host(&request.host),
    };
    let source = Sample(request);
    let plan = engine.plan(&facts, &source);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "request: {} {} host `{}`",
        request.method, request.path, facts.host
    );
    for (index, policy) in policies.policies.iter().enumerate() {
        let name = &policy.name;
        if let Some(m) = plan.matched().find(|m| m.index == index) {
            let rated = policy.rated(m.key());
            let route = policy
                .match_request(&facts.host, &facts.method, &facts.path)
                .and_then(|r| r.route)
                .map_or(String::new(), |r| format!("route `{r}`, "));
            let entry = match (&policy.limits_by, key::split_entry(m.key()).1) {
                (Some(by), Some(_)) => by
                    .entries()
                    .find(|(_, p)| std::ptr::eq(*p, rated))
                    .map_or(String::new(), |(entry, _)| {
                        format!("limits entry `{entry}`, ")
                    }),
                _ => String::new(),
            };
            let enforced = if policy.enforce { "enforced" } else { "shadow" };
            let _ = writeln!(
                out,
                "policy `{name}`: applies: {route}key `{}`, {entry}cost {}, rate {} per {}ms, \
                 burst {}, {}, scope {}, {enforced}",
                m.key(),
                m.cost,
                rated.units,
                rated.per_ms,
                rated.burst,
                rated.algorithm.name(),
                format!("{:?}", policy.scope).to_ascii_lowercase(),
            );
            continue;
        }
        if let Some((_, outcome)) = plan.early_outcomes.iter().find(|(i, _)| *i == index) {
            let what = match outcome {
                Outcome::IdentityMissing => {
                    "refused 403: its key or limits entry is missing and \
                                             on_missing_key is deny"
                }
                _ => {
                    "would be refused (shadow): its key or limits entry is missing and \
                      on_missing_key is deny"
                }
            };
            let _ = writeln!(out, "policy `{name}`: {what}");
            continue;
        }
        let _ = writeln!(
            out,
            "policy `{name}`: skipped: {}",
            skipped_because(policy, &facts, &source)
        );
    }
    Ok(out)
}

/// Why the plan left out a policy, asked of the same functions the plan uses.
fn skipped_because(policy: &Policy, facts: &RequestFacts<'_>, source: &Sample<'_>) -> String {
    let Some(route) = policy.match_request(&facts.host, &facts.method, &facts.path) else {
        return "`match` does not match (host, method or route)".into();
    };
    if !conditions_hold(policy, &route, facts, source) {
        return "a `when` condition does not hold".into();
    }
    let anonymous = policy.on_missing_key == OnMissingKey::Anonymous;
    match build_key(policy, route.route, facts, source, anonymous) {
        PolicyKey::Missing => {
            "an identity part of its `key` is absent (on_missing_key skip)".into()
        }
        PolicyKey::Key(_) if policy.limits_by.is_some() => {
            "no `limits` entry applies (no override, no value entry, no default) and \
             on_missing_key is skip"
                .into()
        }
        PolicyKey::Key(_) => "not planned".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = r#"{"policies":[
      {"name":"plans","match":{"routes":["GET /items/{id}"]},"key":[{"header":"x-tenant-id"}],
       "limits":{"by":{"header":"x-plan"},
         "values":{"pro":{"rate":{"units":5,"per":"1m"},"burst":5}},
         "overrides":{"acme":{"rate":{"units":7,"per":"1m"},"burst":7}}}},
      {"name":"free-only","when":[{"header":"x-plan","equals":"free"}],
       "key":[{"constant":"all"}],"rate":{"units":1,"per":"1s"},"burst":1},
      {"name":"posts","match":{"methods":["POST"]},"key":[{"constant":"all"}],
       "rate":{"units":1,"per":"1s"},"burst":1},
      {"name":"per-claim","key":[{"jwt_claim":{"claim":"sub"}}],"on_missing_key":"deny",
       "rate":{"units":1,"per":"1s"},"burst":3}
    ]}"#;

    fn request(headers: &[&str], claims: &[&str]) -> SampleRequest {
        SampleRequest {
            method: "GET".into(),
            path: "/items/1".into(),
            host: String::new(),
            headers: headers.iter().map(|h| parse_header(h).unwrap()).collect(),
            client_ip: None,
            claims: claims.iter().map(|c| parse_claim(c).unwrap()).collect(),
        }
    }

    #[test]
    fn explains_hits_entries_and_skips() {
        let policies = Policies::from_json(DOC.as_bytes()).unwrap();
        let out = explain(
            &policies,
            &request(&["X-Tenant-Id: t1", "x-plan: pro"], &["sub=alice"]),
        )
        .unwrap();
        assert!(
            out.contains(
                "policy `plans`: applies: route `GET /items/{id}`, key `t1:!vpro`, limits entry \
                 `values.pro`, cost 1, rate 5 per 60000ms, burst 5, token_bucket"
            ),
            "{out}"
        );
        assert!(
            out.contains("policy `free-only`: skipped: a `when` condition"),
            "{out}"
        );
        assert!(
            out.contains("policy `posts`: skipped: `match` does not match"),
            "{out}"
        );
        assert!(
            out.contains("policy `per-claim`: applies: key `alice`"),
            "{out}"
        );
        // The override, whatever the plan; no entry and no default: skipped; deny: refused.
        let out = explain(&policies, &request(&["x-tenant-id: acme"], &[])).unwrap();
        assert!(
            out.contains("key `acme:!o`, limits entry `overrides.acme`"),
            "{out}"
        );
        assert!(out.contains("policy `per-claim`: refused 403"), "{out}");
        let out = explain(
            &policies,
            &request(&["x-tenant-id: t2", "x-plan: gold"], &[]),
        )
        .unwrap();
        assert!(
            out.contains("policy `plans`: skipped: no `limits` entry applies"),
            "{out}"
        );
        let out = explain(&policies, &request(&[], &[])).unwrap();
        assert!(
            out.contains("policy `plans`: skipped: an identity part"),
            "{out}"
        );
        assert!(parse_header("no colon").is_err() && parse_claim("=x").is_err());
    }
}
