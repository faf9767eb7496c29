//! Answers: pure functions from what the store said (or could not say) to the HTTP reply
//! and to what the metrics count (no store, no clock, no I/O), so the answer rules are
//! unit-tested directly.
//!
//! * an answer carries the store's assignment as `share_per_s` and `period_ms`; its
//!   `expires_ms` is the lease TTL, plus the period when there is a share (tokens that accrue
//!   late in the period stay spendable a little), `0` when nothing may be spent; a windowed
//!   policy's lease expires when the store said (the end of its window), and assigns nothing;
//! * a unit the store could not decide (error, timeout, or a reply with the wrong number of
//!   answers) answers `UNAVAILABLE` for its items; when every item is `UNAVAILABLE` the whole
//!   answer is `503 {"error":"UNAVAILABLE"}`. Nothing is ever granted or denied that the
//!   store did not decide.
//! * a batch's `settled` units are counted when its answer is a 200, except a lease batch
//!   whose every decided item is a replay: that is a retry of a batch already counted
//!   ([`settled_counts`]).

use serde::Serialize;
use tollgate_core::assign::Allotment;
use tollgate_core::policy::Algorithm;
use tollgate_core::protocol::{
    BatchError, ErrorCode, LeaseBatchResponse, LeaseError, LeaseGranted, LeaseRequest, LeaseResult,
    LeaseReturn, ReturnBatchResponse, ReturnResult,
};

use super::validate::{ItemError, LeasePlan};
use crate::metrics::outcome;
use crate::store::{Grant, LeaseItem, LeaseOutcome, StoreError};

/// An HTTP-agnostic answer: status code and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub body: String,
}

impl Reply {
    /// `body` as JSON with `status` (a 500 if it cannot be encoded, which no type here does).
    pub fn json<T: Serialize>(status: u16, body: &T) -> Self {
        match serde_json::to_string(body) {
            Ok(body) => Self { status, body },
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a response");
                Self {
                    status: 500,
                    body: r#"{"error":"INTERNAL"}"#.to_owned(),
                }
            }
        }
    }

    /// A whole-batch refusal: `status` (400 or 413) with `INVALID_REQUEST` and the reason.
    pub fn refused(status: u16, reason: impl Into<String>) -> Self {
        Self::json(
            status,
            &BatchError {
                error: ErrorCode::InvalidRequest,
                reason: Some(reason.into()),
            },
        )
    }

    /// `400 INVALID_REQUEST` with the reason.
    pub fn bad_request(reason: impl Into<String>) -> Self {
        Self::refused(400, reason)
    }

    /// `503 UNAVAILABLE` with the reason.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::json(
            503,
            &BatchError {
                error: ErrorCode::Unavailable,
                reason: Some(reason.into()),
            },
        )
    }
}

/// `expires_ms` of an answer: the lease TTL when something may be spent, plus the period
/// when there is a share (its drip accrues until the period ends), `0` for nothing. A
/// windowed policy's lease lasts what the store said: until the end of its window.
pub fn expires_ms(lease_ttl_ms: u64, grant: &Grant) -> u64 {
    if let Some(limit_ms) = grant.expires_ms {
        // A window's lease, or a regional limiter's (bounded by what it drew from).
        return if grant.granted > 0 || grant.share_per_ms > 0.0 {
            limit_ms
        } else {
            0
        };
    }
    if grant.share_per_ms > 0.0 {
        lease_ttl_ms.saturating_add(grant.period_ms)
    } else if grant.granted > 0 {
        lease_ttl_ms
    } else {
        0
    }
}

/// The wire answer to item `id` the store decided as `grant`.
pub fn granted(id: &str, grant: &Grant, lease_ttl_ms: u64) -> LeaseGranted {
    LeaseGranted {
        id: id.to_owned(),
        granted: grant.granted,
        remaining: grant.remaining,
        retry_after_ms: grant.retry_after_ms,
        expires_ms: expires_ms(lease_ttl_ms, grant),
        share_per_s: grant.share_per_ms * 1_000.0,
        period_ms: grant.period_ms,
    }
}

/// The grants of a unit of `items` items, if the store answered it with exactly one per item
/// (anything else is a store fault, answered `UNAVAILABLE`, never guessed at).
pub fn unit_grants(
    items: usize,
    result: Result<LeaseOutcome, StoreError>,
) -> Result<Vec<Grant>, StoreError> {
    match result {
        Ok(outcome) if outcome.grants.len() == items => Ok(outcome.grants),
        Ok(outcome) => Err(StoreError::Protocol(format!(
            "{} answers for {items} items",
            outcome.grants.len()
        ))),
        Err(e) => Err(e),
    }
}

/// The answer to every item of a batch, in batch order: its validation error, or its unit's
/// grant, or `UNAVAILABLE` when its unit failed. `outcomes` are the units' results, in the
/// order of `plan.units`.
pub fn per_item(
    plan: &LeasePlan,
    outcomes: Vec<Result<Vec<Grant>, StoreError>>,
) -> Vec<Result<Grant, ItemError>> {
    // Unit members are positions in the batch, so they index `answers` (one per item).
    let mut answers: Vec<Option<Result<Grant, ItemError>>> = vec![None; plan.items.len()];
    for (unit, outcome) in plan.units.iter().zip(outcomes) {
        match outcome {
            Ok(grants) => {
                for (&i, grant) in unit.members.iter().zip(grants) {
                    answers[i] = Some(Ok(grant));
                }
            }
            Err(e) => {
                for &i in &unit.members {
                    answers[i] = Some(Err(ItemError::unavailable(e.to_string())));
                }
            }
        }
    }
    plan.items
        .iter()
        .zip(answers)
        .map(|(item, answer)| match (item, answer) {
            (Err(e), _) => Err(e.clone()),
            (Ok(_), Some(answer)) => answer,
            // A valid item always belongs to a unit; if it somehow did not, it was not
            // decided, and that is what the answer says.
            (Ok(_), None) => Err(ItemError::unavailable(
                StoreError::Protocol("no answer for item".into()).to_string(),
            )),
        })
        .collect()
}

/// The first `UNAVAILABLE` reason when every answer is `UNAVAILABLE` (and there is one).
fn all_unavailable<'a, T: 'a>(
    answers: impl IntoIterator<Item = &'a Result<T, ItemError>>,
) -> Option<String> {
    let mut first = None;
    for answer in answers {
        match answer {
            Err(e) if e.code == ErrorCode::Unavailable => {
                first.get_or_insert_with(|| e.reason.clone());
            }
            _ => return None,
        }
    }
    first
}

fn error(id: &str, e: &ItemError) -> LeaseError {
    LeaseError {
        id: id.to_owned(),
        error: e.code,
        reason: Some(e.reason.clone()),
    }
}

/// `POST /v1/leases`'s reply: one result per request, in order, or 503 when every item is
/// `UNAVAILABLE`.
pub fn lease_reply(
    requests: &[LeaseRequest],
    answers: &[Result<Grant, ItemError>],
    lease_ttl_ms: u64,
    policy_version: &str,
) -> Reply {
    if let Some(reason) = all_unavailable(answers) {
        return Reply::unavailable(reason);
    }
    let leases = requests
        .iter()
        .zip(answers)
        .map(|(request, answer)| match answer {
            Ok(grant) => LeaseResult::Granted(granted(&request.id, grant, lease_ttl_ms)),
            Err(e) => LeaseResult::Error(error(&request.id, e)),
        })
        .collect();
    Reply::json(
        200,
        &LeaseBatchResponse {
            leases,
            policy_version: policy_version.to_owned(),
        },
    )
}

/// `POST /v1/leases/return`'s reply: one result per return, in order, or 503 when every
/// return is `UNAVAILABLE`.
pub fn return_reply(returns: &[LeaseReturn], results: &[Result<u64, ItemError>]) -> Reply {
    if let Some(reason) = all_unavailable(results) {
        return Reply::unavailable(reason);
    }
    let returns = returns
        .iter()
        .zip(results)
        .map(|(request, result)| match result {
            Ok(returned) => ReturnResult::Returned {
                id: request.id.clone(),
                returned: *returned,
            },
            Err(e) => ReturnResult::Error(error(&request.id, e)),
        })
        .collect();
    Reply::json(200, &ReturnBatchResponse { returns })
}

/// What the metrics count for one lease answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// `decisions_total` outcome: GRANTED, ASSIGNED, OVER_LIMIT, REPLAYED or the error code.
    pub decision: &'static str,
    /// Tokens granted now (`tokens_granted_total`).
    pub tokens_granted: u64,
    /// `assignments_total` outcome for a named holder the bucket could not give its `want`
    /// (ASSIGNED or WAITING); replays and errors are not counted.
    pub assignment: Option<&'static str>,
    /// Whole tokens the share took from the bucket (`tokens_assigned_total`, core's rounding).
    pub tokens_assigned: u64,
}

/// The tally of one answer (`item`: the validated request, when it was valid).
pub fn tally(item: Option<&LeaseItem>, answer: &Result<Grant, ItemError>) -> Tally {
    let mut t = Tally {
        decision: outcome::OVER_LIMIT,
        tokens_granted: 0,
        assignment: None,
        tokens_assigned: 0,
    };
    let grant = match answer {
        Err(e) => {
            t.decision = e.code.as_str();
            return t;
        }
        Ok(grant) if grant.replayed => {
            t.decision = outcome::REPLAYED;
            return t;
        }
        Ok(grant) => grant,
    };
    let share = grant.share_per_ms > 0.0;
    if grant.granted > 0 {
        t.decision = outcome::GRANTED;
        t.tokens_granted = grant.granted;
    } else if share {
        t.decision = outcome::ASSIGNED;
    }
    // The assignment regime: a named holder the bucket could not give its `want` (a window
    // assigns nothing: its holders are not in it).
    if item.is_some_and(|item| {
        item.holder.is_some()
            && grant.granted < item.want
            && item.algorithm == Algorithm::TokenBucket
    }) {
        if share {
            t.assignment = Some(outcome::ASSIGNED);
            t.tokens_assigned = Allotment {
                granted: 0,
                remaining: grant.remaining,
                retry_after_ms: 0,
                share_per_ms: grant.share_per_ms,
                period_ms: grant.period_ms,
            }
            .taken();
        } else {
            t.assignment = Some(outcome::WAITING);
        }
    }
    t
}

/// Whether the `settled` units a batch carries are counted, given its reply's `status` and,
/// for a lease batch, its answers (`None` for a return batch).
///
/// Counted once the batch is answered: a 200. A 503 (the store decided nothing the limiter
/// saw) and a 400 count nothing, so the filter may send the same totals again. Every counted
/// batch was answered, but an answer may still be lost on its way (Envoy's callout timeout,
/// a reset), and the filter then retries the batch once under the same lease ids with the
/// same `settled` map. The store says which ids it had decided before (`replayed`), across
/// limiter replicas, so a lease batch whose every decided item is a replay is taken as such a
/// retry and not counted again; a batch with at least one item decided now, or with no item
/// decided at all (only per-item errors, or no items), is counted. What this cannot tell
/// apart, both rare and bounded by one batch's totals:
/// * a retry of a batch answered 200 in which some units were `UNAVAILABLE`: its fresh items
///   make it count again (double counted);
/// * a batch answered 503 whose store calls were applied after their deadline: its retry is
///   all replays and is not counted (undercounted);
/// * returns carry no replay signal (an already returned lease and an unknown one both return
///   0): a return batch is counted on every 200. The filter does not retry return callouts.
pub fn settled_counts(status: u16, answers: Option<&[Result<Grant, ItemError>]>) -> bool {
    if status != 200 {
        return false;
    }
    let Some(answers) = answers else {
        return true;
    };
    let mut decided = answers.iter().filter_map(|a| a.as_ref().ok()).peekable();
    decided.peek().is_none() || decided.any(|grant| !grant.replayed)
}

/// `returns_total` outcome and tokens returned of one return's result.
pub fn return_tally(result: &Result<u64, ItemError>) -> (&'static str, u64) {
    match result {
        Ok(0) => (outcome::NOTHING_RETURNED, 0),
        Ok(returned) => (outcome::RETURNED, *returned),
        Err(e) => (e.code.as_str(), 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::validate::{parse_leases, plan_leases};
    use tollgate_core::policy::Policies;

    const DOC: &str = r#"{
      "policies": [
        {"name": "g", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "1h"},
         "burst": 10, "scope": "global"}
      ],
      "limiter": {"cluster": "tollgate_limiter"}
    }"#;

    fn grant(granted: u64, share_per_ms: f64, period_ms: u64) -> Grant {
        Grant {
            granted,
            remaining: 1.5,
            retry_after_ms: if granted == 0 { 700 } else { 0 },
            replayed: false,
            share_per_ms,
            period_ms,
            expires_ms: None,
        }
    }

    fn requests(body: &str) -> (Vec<LeaseRequest>, LeasePlan) {
        let policies = Policies::from_json(DOC.as_bytes()).unwrap();
        let requests = parse_leases(body.as_bytes()).unwrap().leases;
        let plan = plan_leases(&policies, &requests);
        (requests, plan)
    }

    fn json(reply: &Reply) -> serde_json::Value {
        serde_json::from_str(&reply.body).unwrap()
    }

    #[test]
    fn expiry_covers_what_may_be_spent() {
        assert_eq!(expires_ms(2_000, &grant(3, 0.0, 0)), 2_000);
        assert_eq!(expires_ms(2_000, &grant(0, 0.001, 1_000)), 3_000);
        assert_eq!(expires_ms(2_000, &grant(2, 0.001, 1_000)), 3_000);
        assert_eq!(expires_ms(2_000, &grant(0, 0.0, 0)), 0);
        assert_eq!(expires_ms(u64::MAX, &grant(0, 0.1, 5)), u64::MAX);
        // A window's lease ends with its window, whatever the lease TTL; a denial is 0.
        let window = |granted, ms| Grant {
            expires_ms: Some(ms),
            ..grant(granted, 0.0, 0)
        };
        assert_eq!(expires_ms(2_000, &window(3, 250)), 250);
        assert_eq!(
            expires_ms(2_000, &window(3, 0)),
            0,
            "a replay after its window"
        );
        assert_eq!(expires_ms(2_000, &window(0, 250)), 0);
    }

    #[test]
    fn a_share_is_answered_per_second_with_its_period() {
        let g = granted("a", &grant(0, 0.25, 1_000), 2_000);
        assert_eq!(
            (g.share_per_s, g.period_ms, g.expires_ms),
            (250.0, 1_000, 3_000)
        );
        let v = serde_json::to_value(granted("b", &grant(4, 0.0, 0), 2_000)).unwrap();
        assert!(
            v.get("share_per_s").is_none() && v.get("period_ms").is_none(),
            "{v}"
        );
        assert_eq!(v["granted"], 4);
    }

    #[test]
    fn a_wrong_number_of_answers_is_a_store_fault() {
        let outcome = |n: usize| LeaseOutcome {
            now_ms: 1,
            grants: vec![grant(1, 0.0, 0); n],
        };
        assert_eq!(unit_grants(2, Ok(outcome(2))).unwrap().len(), 2);
        let e = unit_grants(2, Ok(outcome(1))).unwrap_err();
        assert!(
            matches!(&e, StoreError::Protocol(m) if m == "1 answers for 2 items"),
            "{e:?}"
        );
        let timeout = StoreError::Timeout(std::time::Duration::from_millis(50));
        assert_eq!(unit_grants(1, Err(timeout.clone())), Err(timeout));
    }

    #[test]
    fn answers_follow_the_batch_order_and_failed_units_are_unavailable() {
        let (requests, plan) = requests(
            r#"{"leases":[
            {"id":"grouped-1","policy":"g","key":"acme","min":1,"want":1,"group":"x"},
            {"id":"solo","policy":"g","key":"acme","min":1,"want":1},
            {"id":"bad","policy":"nope","key":"acme","min":1,"want":1},
            {"id":"grouped-2","policy":"g","key":"acme","min":1,"want":1,"group":"x"}]}"#,
        );
        let members: Vec<&[usize]> = plan.units.iter().map(|u| u.members.as_slice()).collect();
        assert_eq!(members, [&[1][..], &[0, 3][..]]);
        let answers = per_item(
            &plan,
            vec![
                Err(StoreError::Connection("refused".into())),
                Ok(vec![grant(1, 0.0, 0), grant(0, 0.0, 0)]),
            ],
        );
        assert_eq!(answers[0].as_ref().unwrap().granted, 1);
        assert_eq!(
            answers[1].as_ref().unwrap_err().code,
            ErrorCode::Unavailable
        );
        assert_eq!(
            answers[2].as_ref().unwrap_err().code,
            ErrorCode::InvalidPolicy
        );
        assert_eq!(answers[3].as_ref().unwrap().granted, 0);
        let reply = lease_reply(&requests, &answers, 2_000, "v1");
        assert_eq!(reply.status, 200);
        let v = json(&reply);
        let ids: Vec<&str> = v["leases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["grouped-1", "solo", "bad", "grouped-2"]);
        assert_eq!(v["leases"][1]["error"], "UNAVAILABLE");
        assert!(
            v["leases"][1].get("granted").is_none(),
            "never a guessed answer"
        );
        assert_eq!(v["leases"][1]["reason"], "cannot reach the store: refused");
        assert_eq!(v["policy_version"], "v1");
    }

    #[test]
    fn all_unavailable_is_503_and_an_empty_batch_is_not() {
        let (requests, plan) = requests(
            r#"{"leases":[
            {"id":"a","policy":"g","key":"t","min":1,"want":1},
            {"id":"b","policy":"g","key":"u","min":1,"want":1}]}"#,
        );
        let down = || Err(StoreError::Timeout(std::time::Duration::from_millis(50)));
        let answers = per_item(&plan, vec![down(), down()]);
        let reply = lease_reply(&requests, &answers, 2_000, "v1");
        assert_eq!(reply.status, 503);
        let v = json(&reply);
        assert_eq!(v["error"], "UNAVAILABLE");
        assert!(v["reason"].as_str().unwrap().contains("timed out"), "{v}");
        // One decided item next to an unavailable one: a 200 with per-item answers.
        let answers = per_item(&plan, vec![down(), Ok(vec![grant(0, 0.0, 0)])]);
        assert_eq!(lease_reply(&requests, &answers, 2_000, "v1").status, 200);
        let empty = lease_reply(&[], &[], 2_000, "v1");
        assert_eq!(empty.status, 200, "{}", empty.body);
        assert_eq!(return_reply(&[], &[]).status, 200);
    }

    #[test]
    fn returns_answer_per_item_or_503() {
        let r = |id: &str| LeaseReturn {
            id: id.into(),
            policy: "g".into(),
            key: "t".into(),
            unused: 3,
        };
        let down = ItemError::unavailable("cannot reach the store: refused");
        let reply = return_reply(&[r("a"), r("b")], &[Ok(2), Err(down.clone())]);
        assert_eq!(reply.status, 200);
        let v = json(&reply);
        assert_eq!(v["returns"][0]["returned"], 2);
        assert_eq!(v["returns"][1]["error"], "UNAVAILABLE");
        let reply = return_reply(&[r("a")], &[Err(down)]);
        assert_eq!(reply.status, 503);
        assert_eq!(return_tally(&Ok(0)), (outcome::NOTHING_RETURNED, 0));
        assert_eq!(return_tally(&Ok(4)), (outcome::RETURNED, 4));
        let invalid = ItemError::policy("unknown policy `x`");
        assert_eq!(return_tally(&Err(invalid)), ("INVALID_POLICY", 0));
    }

    #[test]
    fn settled_counts_on_an_answer_but_not_on_a_replayed_retry() {
        let fresh = Ok(grant(1, 0.0, 0));
        let denied = Ok(grant(0, 0.0, 0));
        let replayed = Ok(Grant {
            replayed: true,
            ..grant(1, 0.0, 0)
        });
        let invalid = Err(ItemError::policy("unknown policy `x`"));
        let unavailable = Err(ItemError::unavailable("timeout"));
        for answers in [
            vec![fresh.clone()],
            vec![denied.clone()],
            vec![replayed.clone(), denied.clone()],
            vec![replayed.clone(), unavailable.clone(), fresh.clone()],
            vec![invalid.clone()],
            vec![invalid.clone(), unavailable.clone()],
            vec![],
        ] {
            assert!(settled_counts(200, Some(&answers)), "{answers:?}");
            assert!(!settled_counts(503, Some(&answers)), "{answers:?}");
            assert!(!settled_counts(400, Some(&answers)), "{answers:?}");
        }
        for answers in [
            vec![replayed.clone()],
            vec![replayed.clone(), replayed.clone()],
            vec![replayed.clone(), invalid.clone(), unavailable.clone()],
        ] {
            assert!(!settled_counts(200, Some(&answers)), "{answers:?}");
        }
        assert!(settled_counts(200, None));
        assert!(!settled_counts(503, None));
        assert!(!settled_counts(400, None));
    }

    #[test]
    fn tallies_name_the_outcome_and_the_assignment_regime() {
        let (_, plan) = requests(
            r#"{"leases":[
            {"id":"a","policy":"g","key":"t","min":1,"want":5},
            {"id":"h","policy":"g","key":"t","min":1,"want":5,"holder":"i-1","demand_per_s":3}]}"#,
        );
        let plain = plan.items[0].as_ref().ok();
        let named = plan.items[1].as_ref().ok();
        let t = tally(plain, &Ok(grant(3, 0.0, 0)));
        assert_eq!(
            (t.decision, t.tokens_granted, t.assignment),
            ("GRANTED", 3, None)
        );
        assert_eq!(tally(plain, &Ok(grant(0, 0.0, 0))).decision, "OVER_LIMIT");
        // A named holder given less than its want: the assignment regime.
        let t = tally(named, &Ok(grant(2, 0.0, 0)));
        assert_eq!((t.decision, t.assignment), ("GRANTED", Some("WAITING")));
        let t = tally(named, &Ok(grant(0, 0.01, 1_000)));
        assert_eq!((t.decision, t.assignment), ("ASSIGNED", Some("ASSIGNED")));
        assert_eq!(t.tokens_assigned, 10, "0.01/ms for 1 s: 10 whole tokens");
        let t = tally(named, &Ok(grant(5, 0.0, 0)));
        assert_eq!(t.assignment, None, "its whole want: no assignment");
        let replay = Grant {
            replayed: true,
            ..grant(0, 0.01, 1_000)
        };
        assert_eq!(
            tally(named, &Ok(replay)),
            Tally {
                decision: "REPLAYED",
                tokens_granted: 0,
                assignment: None,
                tokens_assigned: 0,
            }
        );
        let e = ItemError::request("min must be at least 1");
        assert_eq!(tally(None, &Err(e)).decision, "INVALID_REQUEST");
    }
}
