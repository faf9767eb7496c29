//! The responses tollgate sends instead of the upstream's: 429 over limit, 503 limiter
//! unavailable (fail closed), 403 identity missing; and the IETF `RateLimit-Policy` /
//! `RateLimit` header values (draft-ietf-httpapi-ratelimit-headers).
//!
//! Bodies name the policy and never an internal key or tenant.

use crate::bucket::EPSILON;
use serde::Serialize;

/// What a policy's bucket looks like for the rate-limit headers.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyStatus<'a> {
    pub policy: &'a str,
    pub units: u64,
    pub per_ms: u64,
    /// Tokens left (fractional; floored in headers).
    pub remaining: f64,
    /// Milliseconds until the quota is restored (denied: until the request would pass).
    pub reset_ms: u64,
}

/// A local reply: status, headers, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

#[derive(Serialize)]
struct Body<'a> {
    error: &'a str,
    policy: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_seconds: Option<u64>,
}

fn json_body(error: &str, policy: &str, retry_after_seconds: Option<u64>) -> String {
    serde_json::to_string(&Body {
        error,
        policy,
        retry_after_seconds,
    })
    .unwrap_or_else(|_| format!("{{\"error\":\"{error}\"}}"))
}

/// Whole seconds, rounded up, at least 1 for any positive wait.
pub fn seconds_ceil(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// `RateLimit-Policy` value: `"<name>";q=<units>;w=<window seconds>` for each policy.
pub fn ratelimit_policy_header(statuses: &[PolicyStatus<'_>]) -> String {
    statuses
        .iter()
        .map(|s| {
            format!(
                "\"{}\";q={};w={}",
                s.policy,
                s.units,
                seconds_ceil(s.per_ms).max(1)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `RateLimit` value: `"<name>";r=<remaining>;t=<seconds until reset>` for each policy.
pub fn ratelimit_header(statuses: &[PolicyStatus<'_>]) -> String {
    statuses
        .iter()
        .map(|s| {
            // Whole tokens as the decisions count them (with the same float slack), so a
            // bucket refilled to a hair under a whole number shows that number.
            let remaining = if s.remaining.is_finite() && s.remaining > 0.0 {
                (s.remaining + EPSILON).floor() as u64
            } else {
                0
            };
            format!(
                "\"{}\";r={};t={}",
                s.policy,
                remaining,
                seconds_ceil(s.reset_ms)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Headers for an allowed response (optional, by configuration).
pub fn allowed_headers(statuses: &[PolicyStatus<'_>]) -> Vec<(String, String)> {
    if statuses.is_empty() {
        return Vec::new();
    }
    vec![
        ("ratelimit-policy".into(), ratelimit_policy_header(statuses)),
        ("ratelimit".into(), ratelimit_header(statuses)),
    ]
}

/// The 429 for a request denied by one or more policies: `Retry-After` is the longest wait,
/// and the body names the policy that demands it.
pub fn too_many_requests(denials: &[PolicyStatus<'_>]) -> LocalReply {
    let longest = denials
        .iter()
        .max_by_key(|s| s.reset_ms)
        .map(|s| (s.policy, seconds_ceil(s.reset_ms).max(1)));
    let (policy, retry_after) = longest.unwrap_or(("", 1));
    let mut headers = vec![
        ("retry-after".to_string(), retry_after.to_string()),
        ("content-type".to_string(), "application/json".to_string()),
    ];
    headers.extend(allowed_headers(denials));
    LocalReply {
        status: 429,
        headers,
        body: json_body("rate limit exceeded", policy, Some(retry_after)),
    }
}

/// The 503 of a `closed` failure mode: the limiter could not decide (not an over-limit).
pub fn limiter_unavailable(policy: &str) -> LocalReply {
    LocalReply {
        status: 503,
        headers: vec![("content-type".into(), "application/json".into())],
        body: json_body("rate limiter unavailable", policy, None),
    }
}

/// The 429 of a shaped request that could not be paused for its turn (the worker holds as many
/// paused requests as it may): its turn was `wait_ms` away.
pub fn no_room_to_wait(policy: &str, wait_ms: u64) -> LocalReply {
    let retry_after = seconds_ceil(wait_ms).max(1);
    LocalReply {
        status: 429,
        headers: vec![
            ("retry-after".into(), retry_after.to_string()),
            ("content-type".into(), "application/json".into()),
        ],
        body: json_body("rate limit exceeded", policy, Some(retry_after)),
    }
}

/// The 429 of `max_in_flight`: the key has as many requests in flight as the policy allows.
/// When one ends is unknown, so `Retry-After` says one second.
pub fn too_many_in_flight(policy: &str) -> LocalReply {
    LocalReply {
        status: 429,
        headers: vec![
            ("retry-after".into(), "1".into()),
            ("content-type".into(), "application/json".into()),
        ],
        body: json_body("too many requests in flight", policy, Some(1)),
    }
}

/// The 429 of a policy with `max_in_flight: 0`, which refuses every request it matches (what
/// envoyproxy/ratelimit's `requests_per_unit: 0` converts to): no `Retry-After`, as no later
/// attempt passes either.
pub fn refused_always(policy: &str) -> LocalReply {
    LocalReply {
        status: 429,
        headers: vec![("content-type".into(), "application/json".into())],
        body: json_body("the policy refuses every request", policy, None),
    }
}

/// The 403 of `on_missing_key: deny`: the request lacks the identity the policy keys on.
pub fn identity_missing(policy: &str) -> LocalReply {
    LocalReply {
        status: 403,
        headers: vec![("content-type".into(), "application/json".into())],
        body: json_body("request identity missing", policy, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(policy: &str, reset_ms: u64) -> PolicyStatus<'_> {
        PolicyStatus {
            policy,
            units: 100,
            per_ms: 1_000,
            remaining: 0.4,
            reset_ms,
        }
    }

    #[test]
    fn retry_after_is_the_longest_wait_rounded_up() {
        let reply = too_many_requests(&[status("a", 50), status("b", 1_001)]);
        assert_eq!(reply.status, 429);
        assert!(reply.headers.contains(&("retry-after".into(), "2".into())));
        assert_eq!(
            reply.body,
            r#"{"error":"rate limit exceeded","policy":"b","retry_after_seconds":2}"#
        );
        assert!(reply.headers.contains(&(
            "ratelimit-policy".into(),
            r#""a";q=100;w=1, "b";q=100;w=1"#.into()
        )));
        assert!(reply
            .headers
            .contains(&("ratelimit".into(), r#""a";r=0;t=1, "b";r=0;t=2"#.into())));
    }

    #[test]
    fn remaining_counts_whole_tokens_with_the_decisions_float_slack() {
        let at = |remaining| PolicyStatus {
            remaining,
            ..status("a", 1_000)
        };
        let header = |s| ratelimit_header(&[s]);
        assert_eq!(header(at(25.999_999_999_999_996)), r#""a";r=26;t=1"#);
        assert_eq!(header(at(25.9)), r#""a";r=25;t=1"#);
        assert_eq!(header(at(-3.0)), r#""a";r=0;t=1"#);
        assert_eq!(header(at(f64::NAN)), r#""a";r=0;t=1"#);
    }

    #[test]
    fn short_waits_still_say_one_second() {
        let reply = too_many_requests(&[status("a", 1)]);
        assert!(reply.headers.contains(&("retry-after".into(), "1".into())));
    }

    #[test]
    fn failure_replies_are_not_429() {
        assert_eq!(limiter_unavailable("p").status, 503);
        assert!(limiter_unavailable("p").body.contains("unavailable"));
        assert_eq!(identity_missing("p").status, 403);
    }

    #[test]
    fn in_flight_refusals_say_so() {
        let reply = too_many_in_flight("p");
        assert_eq!(reply.status, 429);
        assert_eq!(
            reply.body,
            r#"{"error":"too many requests in flight","policy":"p","retry_after_seconds":1}"#
        );
    }
}
