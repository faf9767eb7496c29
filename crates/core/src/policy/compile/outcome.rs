//! What a policy does with a request it cannot admit: over the limit (`on_over_limit`: refuse
//! or tag, and which headers a tag may set) and when the limiter is out of reach
//! (`on_unavailable`).

use super::{is_header_name, Collector, Cx};
use crate::policy::model::{FailureMode, KeyPart, Policy, UnitsSource};
use crate::policy::spec::{
    FailureModeName, FailureSpec, OverLimitAction, UnitsSourceSpec, DEFAULT_TAG_HEADER,
};

/// Headers a tag may not be: Envoy's own framing and routing inputs.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "upgrade",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-request-id",
];

/// The header a `tag` policy sets; `None` for a policy that refuses (or has a problem).
pub(super) fn compile_on_over_limit(cx: &mut Cx<'_>) -> Option<String> {
    let spec = cx.spec;
    let on_over_limit = spec.on_over_limit.as_ref()?;
    match on_over_limit.action {
        OverLimitAction::Reject => {
            if on_over_limit.header.is_some() {
                cx.push(
                    "on_over_limit.header",
                    "belongs to action `tag` (a rejected request is answered 429)",
                );
            }
            None
        }
        OverLimitAction::Tag => {
            let header = on_over_limit
                .header
                .clone()
                .unwrap_or_else(|| DEFAULT_TAG_HEADER.to_string());
            if !is_header_name(&header) || RESERVED_HEADERS.contains(&header.as_str()) {
                cx.push(
                    "on_over_limit.header",
                    format!(
                        "`{header}` is not a lower-case header name a tag may set \
                         ([a-z0-9._-], not {})",
                        RESERVED_HEADERS.join(", ")
                    ),
                );
                return None;
            }
            if !spec.enforce {
                cx.push(
                    "on_over_limit.action",
                    "a shadow policy (`enforce: false`) never acts on a request: `tag` needs an \
                     enforced policy (a tag policy refuses nothing; route tagged requests as \
                     before to observe it)",
                );
                return None;
            }
            let from_body = matches!(
                spec.reserve.as_ref().map(|r| &r.from),
                Some(UnitsSourceSpec::Body(_))
            );
            if from_body {
                cx.push(
                    "on_over_limit.action",
                    "a cost read from the request body is known after Envoy chose the route: \
                     `tag` needs a cost known at the request headers",
                );
                return None;
            }
            Some(header)
        }
    }
}

/// A tag header must not be one a policy reads: the filter removes a client's copy of it from
/// every request its policy matches, and sets it on requests over the limit.
pub(super) fn check_tag_headers(policies: &[Policy], errors: &mut Collector) {
    for (index, policy) in policies.iter().enumerate() {
        let Some(tag) = &policy.tag else {
            continue;
        };
        let read_by = policies.iter().find(|other| {
            let reserve_header = other
                .reserve
                .as_ref()
                .is_some_and(|r| matches!(&r.source, UnitsSource::Header(h) if h == tag));
            let plan_header = other
                .limits_by
                .as_ref()
                .is_some_and(|by| matches!(&by.by, KeyPart::Header(h) if h == tag));
            reserve_header
                || plan_header
                || other
                    .key
                    .iter()
                    .any(|part| matches!(part, KeyPart::Header(h) | KeyPart::ApiKey(h) if h == tag))
        });
        if let Some(other) = read_by {
            errors.push(
                Some(&policy.name),
                format!("policies[{index}].on_over_limit.header"),
                format!(
                    "`{tag}` is read by policy `{}`: a tag header is set by the filter, \
                     never an identity or a cost",
                    other.name
                ),
            );
        }
    }
}

/// `on_unavailable`, or the problem: the field under `on_unavailable` and the reason.
pub(super) fn compile_failure(spec: &FailureSpec) -> Result<FailureMode, (&'static str, String)> {
    match spec.mode {
        FailureModeName::Open | FailureModeName::Closed => {
            if spec.share.is_some() || spec.stale_ttl.is_some() || spec.then.is_some() {
                return Err((
                    "mode",
                    "`share`, `stale_ttl` and `then` belong to mode `local`".into(),
                ));
            }
            Ok(if spec.mode == FailureModeName::Open {
                FailureMode::Open
            } else {
                FailureMode::Closed
            })
        }
        FailureModeName::Local => {
            let share = spec.share.ok_or((
                "share",
                "mode `local` needs `share` (0 < share ≤ 1)".to_string(),
            ))?;
            if !(share > 0.0 && share <= 1.0) {
                return Err(("share", format!("{share} is not in (0, 1]")));
            }
            let ttl = spec.stale_ttl.ok_or((
                "stale_ttl",
                "mode `local` needs `stale_ttl`, e.g. \"30s\"".to_string(),
            ))?;
            if ttl.0 == 0 {
                return Err(("stale_ttl", "must be longer than 0ms".into()));
            }
            let then = spec.then.ok_or((
                "then",
                "mode `local` needs `then`: `open` or `closed`".to_string(),
            ))?;
            Ok(FailureMode::Local {
                share,
                stale_ttl_ms: ttl.0,
                then,
            })
        }
    }
}
