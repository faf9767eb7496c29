//! The callout protocol between the filter and the limiter (JSON over HTTP).
//!
//! `POST /v1/leases` takes a batch of lease requests and answers one result per item;
//! `POST /v1/leases/return` gives back unused tokens of leases, once per lease id.
//! A store the limiter cannot reach makes the whole batch `503 {"error":"UNAVAILABLE"}`.
//!
//! Either body may also carry `settled`: per policy name, the units (actual cost) of the
//! requests that finished on the sending worker since its last report, piggybacked on a
//! callout the filter makes anyway. The limiter only counts them (a metric per policy); they
//! change no bucket. Absent or empty means nothing to report, and an empty map is not sent,
//! so a body without settlements is byte for byte what it was before the field existed.
//! The limiter counts a batch's `settled` when it answers it `200` (a `400` or `503` counts
//! nothing), except a lease batch whose every decided item is a replay of an earlier decision
//! of its id: that is taken as the retry of a batch already counted. So a retry carries the
//! same map as the first attempt, and new totals go in a batch with a lease id asked for the
//! first time (or in a return batch).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Path of the lease call.
pub const LEASES_PATH: &str = "/v1/leases";
/// Path of the return call.
pub const RETURNS_PATH: &str = "/v1/leases/return";
/// Most items in one batch.
pub const MAX_BATCH: usize = 256;
/// Largest request body the limiter reads.
pub const MAX_BODY_BYTES: usize = 256 * 1024;
/// Longest lease id.
pub const MAX_LEASE_ID_BYTES: usize = 128;
/// Most entries in one batch's `settled` map (as many as a policy document may define
/// policies): a batch with more is refused whole.
pub const MAX_SETTLED_POLICIES: usize = 1024;

/// Outcome classes, distinct everywhere (metrics, logs, API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// The limiter could not decide (store unreachable, timeout).
    Unavailable,
    /// The policy is unknown to the limiter, or the descriptor does not fit it.
    InvalidPolicy,
    /// The request itself is malformed (bad amounts, bad key, bad id).
    InvalidRequest,
}

impl ErrorCode {
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::InvalidPolicy => "INVALID_POLICY",
            ErrorCode::InvalidRequest => "INVALID_REQUEST",
        }
    }
}

/// `POST /v1/leases` body: the lease requests, and optionally the units settled since the
/// worker's last report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseBatch {
    pub leases: Vec<LeaseRequest>,
    /// Policy name → units (the actual cost) of the requests that finished since the worker's
    /// last report; at most [`MAX_SETTLED_POLICIES`] entries. Absent: none (not serialized
    /// when empty).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settled: BTreeMap<String, u64>,
}

/// Ask for `granted ∈ {0} ∪ [min, want]` tokens of bucket (`policy`, `key`), or, when the
/// bucket cannot give `want` and the asker names itself (`holder`), an assignment: a share of
/// the bucket's refill rate for a period, sized by `demand_per_s` (see [`crate::assign`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Unique per logical request; a retry with the same id is applied once.
    pub id: String,
    pub policy: String,
    /// Escaped key as built by [`crate::key`]; for a policy with `limits`, its last part names
    /// the entry whose rate the limiter applies, from its own document.
    pub key: String,
    pub min: u64,
    pub want: u64,
    /// Items of one batch with the same `group` are granted all-or-nothing (each at least its
    /// `min`) in one atomic step; their keys must share a hash tag (the first key part), so a
    /// tenant-wide and a route limit of one tenant are decided together even on a cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// The asking instance (stable for its lifetime, `[0-9A-Za-z_-]`, at most
    /// [`crate::assign::MAX_HOLDER_BYTES`]): only a named holder can receive an assignment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// The holder's offered demand for this key, units per second (admitted and denied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand_per_s: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseBatchResponse {
    pub leases: Vec<LeaseResult>,
    pub policy_version: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LeaseResult {
    Granted(LeaseGranted),
    Error(LeaseError),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseGranted {
    pub id: String,
    /// `0` (denied) or within `[min, want]`.
    pub granted: u64,
    /// Tokens left in the global bucket after this grant (fractional).
    pub remaining: f64,
    /// When `granted == 0`: how long until `min` tokens are there.
    pub retry_after_ms: u64,
    /// How long the lease may be spent before its tokens count as expired.
    pub expires_ms: u64,
    /// An assignment: besides `granted`, the holder may spend this many units per second,
    /// accruing from when it receives the answer, for `period_ms` (absent: none).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub share_per_s: f64,
    /// Length of the assignment (absent without one).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub period_ms: u64,
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

fn is_zero_u64(x: &u64) -> bool {
    *x == 0
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseError {
    pub id: String,
    pub error: ErrorCode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `POST /v1/leases/return` body: the returns, and optionally the units settled since the
/// worker's last report (as in [`LeaseBatch::settled`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReturnBatch {
    pub returns: Vec<LeaseReturn>,
    /// Policy name → units (the actual cost) of the requests that finished since the worker's
    /// last report; at most [`MAX_SETTLED_POLICIES`] entries. Absent: none (not serialized
    /// when empty).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub settled: BTreeMap<String, u64>,
}

/// Give back `unused` tokens of lease `id` (which was drawn from bucket `policy`/`key`:
/// needed to find the lease's dedup record in the bucket's slot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseReturn {
    pub id: String,
    pub policy: String,
    pub key: String,
    pub unused: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReturnBatchResponse {
    pub returns: Vec<ReturnResult>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ReturnResult {
    /// `returned` tokens went back (0 when the lease was already returned or unknown).
    Returned {
        id: String,
        returned: u64,
    },
    Error(LeaseError),
}

/// Body of a batch-level error (`503 UNAVAILABLE`, `400` with a reason).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchError {
    pub error: ErrorCode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_results_round_trip() {
        let json = r#"{"leases":[{"id":"a","granted":5,"remaining":12.5,"retry_after_ms":0,"expires_ms":2000},{"id":"b","error":"INVALID_POLICY"}],"policy_version":"abc"}"#;
        let parsed: LeaseBatchResponse = serde_json::from_str(json).unwrap();
        assert!(matches!(
            parsed.leases[0],
            LeaseResult::Granted(LeaseGranted { granted: 5, .. })
        ));
        assert!(matches!(
            parsed.leases[1],
            LeaseResult::Error(LeaseError {
                error: ErrorCode::InvalidPolicy,
                ..
            })
        ));
        let again: LeaseBatchResponse =
            serde_json::from_str(&serde_json::to_string(&parsed).unwrap()).unwrap();
        assert_eq!(again, parsed);
    }

    #[test]
    fn requests_reject_unknown_fields_and_negative_amounts() {
        assert!(serde_json::from_str::<LeaseBatch>(
            r#"{"leases":[{"id":"a","policy":"p","key":"k","min":1,"want":2,"x":1}]}"#
        )
        .is_err());
        assert!(serde_json::from_str::<LeaseBatch>(
            r#"{"leases":[{"id":"a","policy":"p","key":"k","min":-1,"want":2}]}"#
        )
        .is_err());
        assert!(serde_json::from_str::<LeaseBatch>(
            r#"{"leases":[{"id":"a","policy":"p","key":"k","min":1.5,"want":2}]}"#
        )
        .is_err());
    }

    #[test]
    fn settled_is_optional_and_absent_when_empty() {
        // Bodies from before the field parse, with nothing settled.
        let lease: LeaseBatch = serde_json::from_str(
            r#"{"leases":[{"id":"a","policy":"p","key":"k","min":1,"want":2}]}"#,
        )
        .unwrap();
        assert!(lease.settled.is_empty());
        let ret: ReturnBatch =
            serde_json::from_str(r#"{"returns":[{"id":"a","policy":"p","key":"k","unused":1}]}"#)
                .unwrap();
        assert!(ret.settled.is_empty());
        // Nothing settled: the body is what it was before the field existed.
        assert_eq!(
            serde_json::to_string(&LeaseBatch::default()).unwrap(),
            r#"{"leases":[]}"#
        );
        assert_eq!(
            serde_json::to_string(&ReturnBatch::default()).unwrap(),
            r#"{"returns":[]}"#
        );
        // An explicit empty map parses too.
        let empty: LeaseBatch = serde_json::from_str(r#"{"leases":[],"settled":{}}"#).unwrap();
        assert_eq!(empty, LeaseBatch::default());
    }

    #[test]
    fn settled_round_trips() {
        let lease = LeaseBatch {
            leases: Vec::new(),
            settled: BTreeMap::from([("a".to_owned(), 7), ("b".to_owned(), u64::MAX)]),
        };
        let json = serde_json::to_string(&lease).unwrap();
        assert_eq!(
            json,
            r#"{"leases":[],"settled":{"a":7,"b":18446744073709551615}}"#
        );
        assert_eq!(serde_json::from_str::<LeaseBatch>(&json).unwrap(), lease);
        let ret = ReturnBatch {
            returns: vec![LeaseReturn {
                id: "i".into(),
                policy: "a".into(),
                key: "k".into(),
                unused: 1,
            }],
            settled: BTreeMap::from([("a".to_owned(), 3)]),
        };
        let json = serde_json::to_string(&ret).unwrap();
        assert!(json.ends_with(r#","settled":{"a":3}}"#), "{json}");
        assert_eq!(serde_json::from_str::<ReturnBatch>(&json).unwrap(), ret);
    }

    #[test]
    fn settled_amounts_are_whole_non_negative_numbers() {
        for settled in [
            r#"{"a":-1}"#,
            r#"{"a":1.5}"#,
            r#"{"a":1e3}"#,
            r#"{"a":18446744073709551616}"#,
            r#"{"a":"1"}"#,
            r#"{"a":null}"#,
            r#"["a",1]"#,
        ] {
            assert!(
                serde_json::from_str::<LeaseBatch>(&format!(
                    r#"{{"leases":[],"settled":{settled}}}"#
                ))
                .is_err(),
                "{settled}"
            );
            assert!(
                serde_json::from_str::<ReturnBatch>(&format!(
                    r#"{{"returns":[],"settled":{settled}}}"#
                ))
                .is_err(),
                "{settled}"
            );
        }
        // Still no unknown fields next to it.
        assert!(
            serde_json::from_str::<LeaseBatch>(r#"{"leases":[],"settled":{},"settle":{}}"#)
                .is_err()
        );
    }
}
