//! How a policy matches a request: host patterns (`api.example.com`, `*.example.com`), the
//! request's host from `:authority`, and the policy's hosts, methods and routes together.

use super::model::{Policy, RouteMatch};
use std::borrow::Cow;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum HostPattern {
    Any,
    Exact(String),
    /// `*.example.com` stored as `.example.com`.
    Suffix(String),
}

impl HostPattern {
    pub(super) fn parse(text: &str) -> Result<Self, String> {
        let lower = text.trim().to_ascii_lowercase();
        if lower == "*" {
            return Ok(HostPattern::Any);
        }
        let (pattern, name) = match lower.strip_prefix("*.") {
            Some(rest) => (HostPattern::Suffix(format!(".{rest}")), rest.to_string()),
            None => (HostPattern::Exact(lower.clone()), lower.clone()),
        };
        let valid = !name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
        if valid {
            Ok(pattern)
        } else {
            Err(format!(
                "`{text}` is not a host name or `*.domain` pattern (no ports, schemes or paths)"
            ))
        }
    }

    fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Any => true,
            HostPattern::Exact(name) => host == name,
            HostPattern::Suffix(suffix) => {
                host.len() > suffix.len() && host.ends_with(suffix.as_str())
            }
        }
    }
}

/// Lower-cased host of an `:authority` value, without port.
pub fn authority_host(authority: &str) -> Cow<'_, str> {
    let authority = authority.trim();
    // Searched as bytes (`[`, `]` and `:` are ASCII, so every position found is a char
    // boundary): this runs on every request.
    let bytes = authority.as_bytes();
    let host = if bytes.first() == Some(&b'[') {
        let end = bytes.iter().position(|b| *b == b']').unwrap_or(bytes.len());
        authority.get(1..end).unwrap_or_default()
    } else {
        match bytes.iter().rposition(|b| *b == b':') {
            Some(colon)
                if bytes
                    .get(colon + 1..)
                    .is_some_and(|port| port.iter().all(u8::is_ascii_digit)) =>
            {
                authority.get(..colon).unwrap_or(authority)
            }
            _ => authority,
        }
    };
    // Borrowed as it is when already lower-case (what clients send): no copy per request.
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

impl Policy {
    /// Whether the policy applies to a request, and at what cost. `host` is already lower-case
    /// without port ([`authority_host`]).
    pub fn match_request(&self, host: &str, method: &str, path: &str) -> Option<RouteMatch<'_>> {
        if !self.hosts.is_empty() && !self.hosts.iter().any(|h| h.matches(host)) {
            return None;
        }
        if !self.methods.is_empty() && !self.methods.iter().any(|m| m == method) {
            return None;
        }
        if self.routes.is_empty() {
            return Some(RouteMatch {
                route: None,
                template: None,
                cost: if self.reserve.is_some() { 0 } else { 1 },
            });
        }
        self.routes
            .iter()
            .zip(&self.route_costs)
            .enumerate()
            .find(|(_, (route, _))| route.matches(method, path))
            .map(|(i, (route, cost))| RouteMatch {
                route: Some(route.as_str()),
                template: Some(i),
                cost: *cost,
            })
    }
}
