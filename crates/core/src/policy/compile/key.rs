//! `key`: the identity parts of a policy's bucket key, and the metadata path of a verified
//! JWT claim (also read by `limits.by` and `when`).

use super::{is_header_name, Cx};
use crate::key;
use crate::policy::model::KeyPart;
use crate::policy::spec::{JwtClaimSpec, KeyPartSpec};

pub(super) fn compile_key(cx: &mut Cx<'_>) -> Vec<KeyPart> {
    let spec = cx.spec;
    if spec.key.is_empty() {
        cx.push(
            "key",
            "needs at least one part (use {\"constant\": \"all\"} for one shared bucket)",
        );
    }
    if spec.key.len() > key::MAX_PARTS {
        cx.push("key", format!("at most {} parts", key::MAX_PARTS));
    }
    let mut key = Vec::new();
    for (i, part) in spec.key.iter().enumerate() {
        let field = format!("key[{i}]");
        match part {
            KeyPartSpec::Header(h) | KeyPartSpec::ApiKey(h) => {
                if !is_header_name(h) {
                    cx.push(&field, format!("`{h}` is not a lower-case header name"));
                } else if matches!(part, KeyPartSpec::Header(_)) {
                    key.push(KeyPart::Header(h.clone()));
                } else {
                    key.push(KeyPart::ApiKey(h.clone()));
                }
            }
            KeyPartSpec::JwtClaim(claim) => match jwt_claim_path(claim) {
                Ok(path) => key.push(KeyPart::JwtClaim { path }),
                Err((suffix, reason)) => cx.push(&format!("{field}{suffix}"), reason),
            },
            KeyPartSpec::ClientIp(ip) => {
                if ip.trusted_hops > crate::identity::MAX_TRUSTED_HOPS {
                    cx.push(
                        &format!("{field}.client_ip.trusted_hops"),
                        format!("at most {}", crate::identity::MAX_TRUSTED_HOPS),
                    );
                } else {
                    key.push(KeyPart::ClientIp {
                        trusted_hops: ip.trusted_hops,
                    });
                }
            }
            KeyPartSpec::Constant(value) => {
                if value.is_empty() {
                    cx.push(&field, "constant must not be empty");
                } else {
                    key.push(KeyPart::Constant(key::escape_part(value.as_bytes())));
                }
            }
            KeyPartSpec::Route => {
                if spec.matcher.routes.is_empty() {
                    cx.push(
                        &field,
                        "`route` needs `match.routes` (unmatched paths never become keys)",
                    );
                } else {
                    key.push(KeyPart::Route);
                }
            }
            KeyPartSpec::Method => key.push(KeyPart::Method),
        }
    }
    key
}

/// The dynamic-metadata property path of a jwt_authn claim, or the problem (a field under the
/// `jwt_claim`'s parent and the reason).
pub(super) fn jwt_claim_path(claim: &JwtClaimSpec) -> Result<Vec<String>, (String, String)> {
    let segments = claim.claim.segments();
    if segments.is_empty() || segments.iter().any(|s| s.is_empty()) {
        return Err((".jwt_claim.claim".into(), "must name a claim".into()));
    }
    if claim.payload.is_empty() || claim.namespace.is_empty() {
        return Err((
            ".jwt_claim".into(),
            "payload and namespace must not be empty".into(),
        ));
    }
    let mut path = vec![
        "metadata".to_string(),
        "filter_metadata".to_string(),
        claim.namespace.clone(),
        claim.payload.clone(),
    ];
    path.extend(segments.iter().map(|s| s.to_string()));
    Ok(path)
}
