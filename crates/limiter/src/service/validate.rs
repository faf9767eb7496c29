//! Validation of lease and return batches: pure functions from a request body and the policy
//! document to what the store is asked (no store, no clock, no I/O), so every rule below is
//! unit-tested directly.
//!
//! * A malformed batch (bad JSON, unknown fields, negative or fractional amounts, more than
//!   `MAX_BATCH` items, more than `MAX_SETTLED_POLICIES` entries in `settled`) is refused
//!   whole ([`BatchRefused`], answered 400 with the reason).
//! * Per item: an unknown or non-global policy is `INVALID_POLICY`, and so is a key naming a
//!   `limits` entry this document does not have (the rate is always this document's); a bad key, a bad id,
//!   `min == 0`, `min > burst`, a bad `holder` or a bad `demand_per_s` is `INVALID_REQUEST`;
//!   `want` is clamped to `[min, burst]`.
//! * A group is decided in one store call, so its keys must share a hash tag; one invalid
//!   member makes the whole group invalid (it cannot be decided all-or-nothing any more).

use std::collections::{BTreeMap, HashMap, HashSet};

use tollgate_core::assign::MAX_HOLDER_BYTES;
use tollgate_core::key;
use tollgate_core::policy::{Policies, Policy};
use tollgate_core::protocol::{
    ErrorCode, LeaseBatch, LeaseRequest, LeaseReturn, ReturnBatch, MAX_BATCH, MAX_LEASE_ID_BYTES,
    MAX_SETTLED_POLICIES,
};

use crate::store::{LeaseItem, ReturnItem};

/// Largest `demand_per_s` a holder may report.
pub const MAX_DEMAND_PER_S: f64 = 1e9;

/// Longest piece of client input quoted back in a reason.
const QUOTE_BYTES: usize = 64;

/// Why a whole batch is refused (answered `400 INVALID_REQUEST` with this reason).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRefused(pub String);

/// A per-item failure before or instead of a store answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemError {
    pub code: ErrorCode,
    pub reason: String,
}

impl ItemError {
    pub fn request(reason: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::InvalidRequest,
            reason: reason.into(),
        }
    }

    pub fn policy(reason: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::InvalidPolicy,
            reason: reason.into(),
        }
    }

    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::Unavailable,
            reason: reason.into(),
        }
    }
}

/// A lease batch as the store will be asked it: per request (same order) its validated item
/// or why it is not asked, and the units, each decided in one store call.
#[derive(Debug, Clone, PartialEq)]
pub struct LeasePlan {
    pub items: Vec<Result<LeaseItem, ItemError>>,
    /// Each ungrouped valid item alone, each valid group together (in batch order within it).
    pub units: Vec<Unit>,
}

/// Items decided in one store call.
#[derive(Debug, Clone, PartialEq)]
pub struct Unit {
    /// Their positions in the batch.
    pub members: Vec<usize>,
    /// The items, in the order of `members`.
    pub items: Vec<LeaseItem>,
}

/// Parses `POST /v1/leases`: the JSON shape, the batch size, the size of `settled`, and ids
/// unique in the batch.
///
/// A lease id names one lease record in the store, so two items with one id could not both
/// be decided once each: whichever ran second would replay the first. Rather than answer
/// such a batch half (one result decided, the other refused, and which is which depending on
/// the order of the store calls), the whole batch is refused, naming the id.
pub fn parse_leases(body: &[u8]) -> Result<LeaseBatch, BatchRefused> {
    let batch: LeaseBatch = serde_json::from_slice(body)
        .map_err(|e| BatchRefused(format!("invalid lease batch: {e}")))?;
    if batch.leases.len() > MAX_BATCH {
        return Err(BatchRefused(format!(
            "{} leases in one batch; at most {MAX_BATCH}",
            batch.leases.len()
        )));
    }
    check_settled(&batch.settled)?;
    let mut first_at: HashMap<&str, usize> = HashMap::with_capacity(batch.leases.len());
    for (i, request) in batch.leases.iter().enumerate() {
        if let Some(first) = first_at.insert(request.id.as_str(), i) {
            return Err(BatchRefused(format!(
                "lease id `{}` appears more than once in this batch (items {first} and {i}); \
                 ids must be unique per logical request",
                truncate(&request.id, QUOTE_BYTES)
            )));
        }
    }
    Ok(batch)
}

/// Parses `POST /v1/leases/return`: the JSON shape, the batch size and the size of
/// `settled`.
pub fn parse_returns(body: &[u8]) -> Result<ReturnBatch, BatchRefused> {
    let batch: ReturnBatch = serde_json::from_slice(body)
        .map_err(|e| BatchRefused(format!("invalid return batch: {e}")))?;
    if batch.returns.len() > MAX_BATCH {
        return Err(BatchRefused(format!(
            "{} returns in one batch; at most {MAX_BATCH}",
            batch.returns.len()
        )));
    }
    check_settled(&batch.settled)?;
    Ok(batch)
}

/// A batch's `settled` map names at most `MAX_SETTLED_POLICIES` policies (as many as a
/// policy document may define): the work of counting it stays bounded whatever the body.
/// Names are not checked here: one the document does not know is counted as unknown.
fn check_settled(settled: &BTreeMap<String, u64>) -> Result<(), BatchRefused> {
    if settled.len() > MAX_SETTLED_POLICIES {
        return Err(BatchRefused(format!(
            "{} policies in `settled`; at most {MAX_SETTLED_POLICIES}",
            settled.len()
        )));
    }
    Ok(())
}

/// Validates every request of a parsed lease batch and splits the valid ones into units.
pub fn plan_leases(policies: &Policies, requests: &[LeaseRequest]) -> LeasePlan {
    let mut items: Vec<Result<LeaseItem, ItemError>> = requests
        .iter()
        .map(|r| validate_lease(policies, r))
        .collect();
    let units = form_units(requests, &mut items);
    LeasePlan { items, units }
}

fn validate_id(id: &str) -> Result<(), ItemError> {
    if id.is_empty() {
        return Err(ItemError::request("lease id is empty"));
    }
    if id.len() > MAX_LEASE_ID_BYTES {
        return Err(ItemError::request(format!(
            "lease id is longer than {MAX_LEASE_ID_BYTES} bytes"
        )));
    }
    Ok(())
}

/// The policy named `name` if it exists and the limiter owns it (`global` or `regional`).
fn global_policy<'a>(policies: &'a Policies, name: &str) -> Result<&'a Policy, ItemError> {
    let policy = policies.get(name).ok_or_else(|| {
        ItemError::policy(format!("unknown policy `{}`", truncate(name, QUOTE_BYTES)))
    })?;
    if !policy.scope.uses_limiter() {
        return Err(ItemError::policy(format!(
            "policy `{name}` has scope `local`: the limiter only owns global and regional buckets"
        )));
    }
    Ok(policy)
}

/// The policy as it rates `key`, from this limiter's own document: with `limits`, the entry
/// the key's last part names (the filter names an entry, never a rate); an entry this document
/// does not have, or an entry part on a policy without `limits`, is `INVALID_POLICY`.
fn entry_of<'a>(policy: &'a Policy, key: &str) -> Result<&'a Policy, ItemError> {
    policy.entry_for(key).ok_or_else(|| {
        let entry = key::split_entry(key).1.unwrap_or("(none)");
        ItemError::policy(if policy.limits_by.is_some() {
            format!(
                "policy `{}` has no limits entry `{}` for this key",
                policy.name,
                truncate(entry, QUOTE_BYTES)
            )
        } else {
            format!(
                "policy `{}` has no `limits`: its keys name no entry (`{}`)",
                policy.name,
                truncate(entry, QUOTE_BYTES)
            )
        })
    })
}

/// The first `max` bytes of `s`, cut back to a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    // `end` is a char boundary within `s` (0 always is).
    &s[..end]
}

/// One lease request against the policy document.
pub fn validate_lease(policies: &Policies, r: &LeaseRequest) -> Result<LeaseItem, ItemError> {
    validate_id(&r.id)?;
    let policy = global_policy(policies, &r.policy)?;
    key::validate_key(&r.key).map_err(ItemError::request)?;
    let policy = entry_of(policy, &r.key)?;
    if let Some(group) = &r.group {
        if group.is_empty() || group.len() > MAX_LEASE_ID_BYTES {
            return Err(ItemError::request(format!(
                "group name must be 1 to {MAX_LEASE_ID_BYTES} bytes"
            )));
        }
    }
    if r.min == 0 {
        return Err(ItemError::request("min must be at least 1"));
    }
    if r.min > policy.burst {
        return Err(ItemError::request(format!(
            "min {} is more than the burst {} of policy `{}`: it could never be granted",
            r.min, policy.burst, policy.name
        )));
    }
    if let Some(holder) = &r.holder {
        validate_holder(holder)?;
    }
    let demand_per_s = r.demand_per_s.unwrap_or(0.0);
    if !demand_per_s.is_finite() || !(0.0..=MAX_DEMAND_PER_S).contains(&demand_per_s) {
        return Err(ItemError::request(format!(
            "demand_per_s must be a number from 0 to {MAX_DEMAND_PER_S:e} (units per second)"
        )));
    }
    // `-0` is `0`: one spelling of "no demand" for every store.
    let demand_per_ms = if demand_per_s == 0.0 {
        0.0
    } else {
        demand_per_s / 1_000.0
    };
    Ok(LeaseItem {
        id: r.id.clone(),
        policy: policy.name.clone(),
        key: r.key.clone(),
        limits: policy.limits,
        algorithm: policy.algorithm,
        min: r.min,
        want: r.want.clamp(r.min, policy.burst),
        holder: r.holder.clone(),
        demand_per_ms,
    })
}

/// A holder id: 1 to `MAX_HOLDER_BYTES` bytes of `[0-9A-Za-z_-]` (it becomes part of a
/// Redis hash field name).
fn validate_holder(holder: &str) -> Result<(), ItemError> {
    let ok = !holder.is_empty()
        && holder.len() <= MAX_HOLDER_BYTES
        && holder
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ItemError::request(format!(
            "holder must be 1 to {MAX_HOLDER_BYTES} bytes of [0-9A-Za-z_-]"
        )))
    }
}

/// One return against the policy document.
pub fn validate_return(policies: &Policies, r: &LeaseReturn) -> Result<ReturnItem, ItemError> {
    validate_id(&r.id)?;
    let policy = global_policy(policies, &r.policy)?;
    key::validate_key(&r.key).map_err(ItemError::request)?;
    let policy = entry_of(policy, &r.key)?;
    Ok(ReturnItem {
        id: r.id.clone(),
        policy: policy.name.clone(),
        key: r.key.clone(),
        limits: policy.limits,
        algorithm: policy.algorithm,
        unused: r.unused,
    })
}

/// Splits the valid items into units: each ungrouped item alone, each group together.
/// Invalidates whole groups that cannot be decided atomically. `items[i]` is `requests[i]`
/// validated (same length), so the positions below index both.
fn form_units(requests: &[LeaseRequest], items: &mut [Result<LeaseItem, ItemError>]) -> Vec<Unit> {
    let mut units = Vec::new();
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, (request, item)) in requests.iter().zip(items.iter()).enumerate() {
        match &request.group {
            None => {
                if let Ok(item) = item {
                    units.push(Unit {
                        members: vec![i],
                        items: vec![item.clone()],
                    });
                }
            }
            Some(group) => match groups.iter_mut().find(|(g, _)| g == group) {
                Some((_, members)) => members.push(i),
                None => groups.push((group.as_str(), vec![i])),
            },
        }
    }
    for (group, members) in groups {
        let valid: Result<Vec<LeaseItem>, usize> = members
            .iter()
            .map(|&i| items[i].as_ref().cloned().map_err(|_| i))
            .collect();
        let reason = match valid {
            Err(invalid) => format!(
                "item `{}` of group `{}` is invalid, so the group cannot be decided",
                truncate(&requests[invalid].id, QUOTE_BYTES),
                truncate(group, QUOTE_BYTES)
            ),
            Ok(group_items) => {
                let tags: HashSet<&str> = group_items
                    .iter()
                    .map(|item| key::hash_tag(&item.key))
                    .collect();
                if tags.len() <= 1 {
                    units.push(Unit {
                        members,
                        items: group_items,
                    });
                    continue;
                }
                format!(
                    "keys of group `{}` do not share a hash tag (their first part), so they cannot be decided in one atomic step",
                    truncate(group, QUOTE_BYTES)
                )
            }
        };
        for &i in &members {
            if items[i].is_ok() {
                items[i] = Err(ItemError::request(reason.clone()));
            }
        }
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = r#"{
      "policies": [
        {"name": "g", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "1h"},
         "burst": 10, "scope": "global"},
        {"name": "route", "key": [{"header": "x-tenant"}, {"header": "x-route"}],
         "rate": {"units": 1, "per": "1h"}, "burst": 3, "scope": "global"},
        {"name": "l", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "1s"},
         "burst": 10}
      ],
      "limiter": {"cluster": "tollgate_limiter"}
    }"#;

    fn policies() -> Policies {
        Policies::from_json(DOC.as_bytes()).unwrap()
    }

    fn plan(body: &str) -> LeasePlan {
        let requests = parse_leases(body.as_bytes()).unwrap().leases;
        plan_leases(&policies(), &requests)
    }

    fn members(plan: &LeasePlan) -> Vec<Vec<usize>> {
        plan.units.iter().map(|u| u.members.clone()).collect()
    }

    fn error(plan: &LeasePlan, i: usize) -> &ItemError {
        plan.items[i].as_ref().unwrap_err()
    }

    #[test]
    fn a_limits_entry_is_resolved_from_the_limiters_own_document() {
        let policies = Policies::from_json(
            br#"{"policies":[{"name":"plans","key":[{"header":"x-tenant"}],"scope":"global",
              "limits":{"by":{"header":"x-plan"},
                "values":{"pro":{"rate":{"units":5,"per":"1m"},"burst":5}},
                "default":{"rate":{"units":1,"per":"1m"},"burst":1},
                "overrides":{"acme":{"rate":{"units":7,"per":"1m"},"burst":7}}}},
              {"name":"g","key":[{"header":"x-tenant"}],"rate":{"units":1,"per":"1h"},
               "burst":10,"scope":"global"}],
              "limiter":{"cluster":"tollgate_limiter"}}"#,
        )
        .unwrap();
        let lease = |policy: &str, key: &str, want: u64| {
            validate_lease(
                &policies,
                &LeaseRequest {
                    id: "i".into(),
                    policy: policy.into(),
                    key: key.into(),
                    min: 1,
                    want,
                    group: None,
                    holder: None,
                    demand_per_s: None,
                },
            )
        };
        // The want is clamped to the entry's burst, the limits are the entry's.
        let pro = lease("plans", "t:!vpro", 100).unwrap();
        assert_eq!((pro.want, pro.limits.capacity()), (5, 5.0));
        assert_eq!(pro.key, "t:!vpro");
        assert_eq!(lease("plans", "t:!d", 100).unwrap().want, 1);
        assert_eq!(lease("plans", "acme:!o", 100).unwrap().want, 7);
        // An entry the limiter does not have, an override of another key, no entry at all.
        for key in ["t:!vgold", "t:!o", "t"] {
            let e = lease("plans", key, 1).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidPolicy, "{key}: {e:?}");
        }
        // A policy without limits takes no entry part.
        assert_eq!(
            lease("g", "t:!vpro", 1).unwrap_err().code,
            ErrorCode::InvalidPolicy
        );
        let ret = validate_return(
            &policies,
            &LeaseReturn {
                id: "i".into(),
                policy: "plans".into(),
                key: "acme:!o".into(),
                unused: 1,
            },
        )
        .unwrap();
        assert_eq!(ret.limits.capacity(), 7.0);
    }

    #[test]
    fn malformed_batches_are_refused_with_a_reason() {
        for body in [
            "not json",
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":2,"extra":1}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":-1,"want":2}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1.5,"want":2}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":1e400}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":18446744073709551616}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":NaN}]}"#,
            r#"{"returns":[]}"#,
        ] {
            let BatchRefused(reason) = parse_leases(body.as_bytes()).unwrap_err();
            assert!(
                reason.starts_with("invalid lease batch"),
                "{body}: {reason}"
            );
        }
        let many: Vec<String> = (0..=MAX_BATCH)
            .map(|i| format!(r#"{{"id":"{i}","policy":"g","key":"t","min":1,"want":1}}"#))
            .collect();
        let BatchRefused(reason) =
            parse_leases(format!(r#"{{"leases":[{}]}}"#, many.join(",")).as_bytes()).unwrap_err();
        assert!(reason.contains("at most 256"), "{reason}");
        assert!(parse_returns(b"{}").is_err());
        assert!(parse_returns(br#"{"returns":[{"id":"a"}]}"#).is_err());
    }

    #[test]
    fn settled_is_parsed_and_bounded() {
        let settled = |n: usize| {
            let entries: Vec<String> = (0..n).map(|i| format!(r#""p{i}":{i}"#)).collect();
            format!("{{{}}}", entries.join(","))
        };
        let lease = |n: usize| format!(r#"{{"leases":[],"settled":{}}}"#, settled(n));
        let ret = |n: usize| format!(r#"{{"returns":[],"settled":{}}}"#, settled(n));
        let batch = parse_leases(lease(3).as_bytes()).unwrap();
        assert_eq!(batch.settled.get("p2"), Some(&2));
        assert_eq!(
            parse_leases(lease(MAX_SETTLED_POLICIES).as_bytes())
                .unwrap()
                .settled
                .len(),
            MAX_SETTLED_POLICIES
        );
        assert_eq!(
            parse_returns(ret(MAX_SETTLED_POLICIES).as_bytes())
                .unwrap()
                .settled
                .len(),
            MAX_SETTLED_POLICIES
        );
        for reason in [
            parse_leases(lease(MAX_SETTLED_POLICIES + 1).as_bytes()).unwrap_err(),
            parse_returns(ret(MAX_SETTLED_POLICIES + 1).as_bytes()).unwrap_err(),
        ] {
            assert!(
                reason
                    .0
                    .contains("1025 policies in `settled`; at most 1024"),
                "{reason:?}"
            );
        }
        for body in [
            r#"{"leases":[],"settled":{"g":-1}}"#,
            r#"{"leases":[],"settled":{"g":2.5}}"#,
            r#"{"leases":[],"settled":[["g",1]]}"#,
        ] {
            let BatchRefused(reason) = parse_leases(body.as_bytes()).unwrap_err();
            assert!(
                reason.starts_with("invalid lease batch"),
                "{body}: {reason}"
            );
        }
        assert!(parse_returns(br#"{"returns":[],"settled":{"g":-1}}"#).is_err());
        // Absent: nothing settled (bodies from filters that do not report).
        assert!(parse_returns(br#"{"returns":[]}"#)
            .unwrap()
            .settled
            .is_empty());
    }

    #[test]
    fn a_repeated_id_refuses_the_whole_batch_naming_it() {
        let body = r#"{"leases":[
            {"id":"a","policy":"g","key":"t","min":1,"want":1},
            {"id":"b","policy":"g","key":"t","min":1,"want":1},
            {"id":"a","policy":"g","key":"u","min":1,"want":1}]}"#;
        let BatchRefused(reason) = parse_leases(body.as_bytes()).unwrap_err();
        assert!(reason.contains("`a`"), "{reason}");
        assert!(reason.contains("items 0 and 2"), "{reason}");
        // Even when the copies are invalid themselves: the batch is ambiguous either way.
        let body = r#"{"leases":[
            {"id":"x","policy":"nope","key":"t","min":1,"want":1},
            {"id":"x","policy":"nope","key":"t","min":1,"want":1}]}"#;
        assert!(parse_leases(body.as_bytes()).is_err());
        // A long id is quoted shortened.
        let long = "i".repeat(120);
        let body = format!(
            r#"{{"leases":[{{"id":"{long}","policy":"g","key":"t","min":1,"want":1}},
            {{"id":"{long}","policy":"g","key":"t","min":1,"want":1}}]}}"#
        );
        let BatchRefused(reason) = parse_leases(body.as_bytes()).unwrap_err();
        assert!(
            !reason.contains(&long) && reason.contains(&long[..64]),
            "{reason}"
        );
    }

    #[test]
    fn per_item_errors_and_clamping() {
        let p = plan(
            r#"{"leases":[
            {"id":"ok","policy":"g","key":"t1","min":2,"want":1000},
            {"id":"unknown","policy":"nope","key":"t1","min":1,"want":1},
            {"id":"local","policy":"l","key":"t1","min":1,"want":1},
            {"id":"badkey","policy":"g","key":"a{b}","min":1,"want":1},
            {"id":"","policy":"g","key":"t1","min":1,"want":1},
            {"id":"zero","policy":"g","key":"t1","min":0,"want":1},
            {"id":"big","policy":"g","key":"t1","min":11,"want":11},
            {"id":"longgroup","policy":"g","key":"t1","min":1,"want":1,"group":"%LONG%"},
            {"id":"low","policy":"g","key":"t3","min":3,"want":1}
        ]}"#
            .replace("%LONG%", &"g".repeat(MAX_LEASE_ID_BYTES + 1))
            .as_str(),
        );
        let ok = p.items[0].as_ref().unwrap();
        assert_eq!((ok.min, ok.want), (2, 10), "want clamped to the burst");
        assert_eq!(error(&p, 1).code, ErrorCode::InvalidPolicy);
        assert!(error(&p, 1).reason.contains("unknown policy `nope`"));
        assert_eq!(error(&p, 2).code, ErrorCode::InvalidPolicy);
        assert!(error(&p, 2).reason.contains("local"));
        for i in 3..8 {
            assert_eq!(error(&p, i).code, ErrorCode::InvalidRequest, "{i}");
        }
        assert!(error(&p, 6).reason.contains("burst 10"));
        let low = p.items[8].as_ref().unwrap();
        assert_eq!((low.min, low.want), (3, 3), "want below min is min");
        assert_eq!(members(&p), [vec![0], vec![8]]);
        let over = "x".repeat(MAX_LEASE_ID_BYTES + 1);
        let long_id = LeaseRequest {
            id: over,
            policy: "g".into(),
            key: "t".into(),
            min: 1,
            want: 1,
            group: None,
            holder: None,
            demand_per_s: None,
        };
        assert!(validate_lease(&policies(), &long_id).is_err());
    }

    #[test]
    fn groups_need_valid_members_sharing_a_hash_tag() {
        let p = plan(
            r#"{"leases":[
            {"id":"t","policy":"g","key":"acme","min":1,"want":1,"group":"x"},
            {"id":"solo","policy":"g","key":"acme","min":1,"want":1},
            {"id":"r","policy":"route","key":"acme:post","min":1,"want":1,"group":"x"},
            {"id":"a","policy":"g","key":"acme","min":1,"want":1,"group":"y"},
            {"id":"b","policy":"g","key":"other","min":1,"want":1,"group":"y"},
            {"id":"c","policy":"g","key":"acme","min":1,"want":1,"group":"z"},
            {"id":"d","policy":"nope","key":"acme","min":1,"want":1,"group":"z"}]}"#,
        );
        assert_eq!(members(&p), [vec![1], vec![0, 2]]);
        let ids: Vec<&str> = p.units[1].items.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["t", "r"], "a group's items in batch order");
        for i in [3, 4] {
            assert!(error(&p, i).reason.contains("hash tag"), "{i}");
        }
        assert!(error(&p, 5).reason.contains("item `d` of group `z`"));
        assert_eq!(error(&p, 6).code, ErrorCode::InvalidPolicy, "keeps its own");
    }

    #[test]
    fn holders_and_demands() {
        let long = "h".repeat(MAX_HOLDER_BYTES + 1);
        let max = "h".repeat(MAX_HOLDER_BYTES);
        let p = plan(&format!(
            r#"{{"leases":[
            {{"id":"ok","policy":"g","key":"t","min":1,"want":1,"holder":"Az09_-","demand_per_s":2.5}},
            {{"id":"empty","policy":"g","key":"t","min":1,"want":1,"holder":""}},
            {{"id":"long","policy":"g","key":"t","min":1,"want":1,"holder":"{long}"}},
            {{"id":"colon","policy":"g","key":"t","min":1,"want":1,"holder":"a:b"}},
            {{"id":"pipe","policy":"g","key":"t","min":1,"want":1,"holder":"a|b"}},
            {{"id":"neg","policy":"g","key":"t","min":1,"want":1,"holder":"a","demand_per_s":-1}},
            {{"id":"huge","policy":"g","key":"t","min":1,"want":1,"holder":"a","demand_per_s":1e10}},
            {{"id":"max","policy":"g","key":"t","min":1,"want":1,"holder":"{max}","demand_per_s":1e9}},
            {{"id":"nodemand","policy":"g","key":"t","min":1,"want":1,"demand_per_s":-0.0}}
        ]}}"#
        ));
        let ok = p.items[0].as_ref().unwrap();
        assert_eq!(ok.holder.as_deref(), Some("Az09_-"));
        assert_eq!(ok.demand_per_ms, 0.0025);
        for i in 1..5 {
            assert!(error(&p, i).reason.contains("holder"), "{i}");
        }
        for i in 5..7 {
            assert!(error(&p, i).reason.contains("demand_per_s"), "{i}");
        }
        assert_eq!(p.items[7].as_ref().unwrap().demand_per_ms, 1e6);
        let none = p.items[8].as_ref().unwrap();
        assert!(none.demand_per_ms == 0.0 && none.demand_per_ms.is_sign_positive());
    }

    #[test]
    fn returns_are_validated_per_item() {
        let policies = policies();
        let returns = parse_returns(
            br#"{"returns":[
            {"id":"a","policy":"g","key":"t","unused":3},
            {"id":"a","policy":"nope","key":"t","unused":3},
            {"id":"a","policy":"g","key":"t{","unused":3},
            {"id":"","policy":"g","key":"t","unused":3}]}"#,
        )
        .unwrap()
        .returns;
        let checked: Vec<_> = returns
            .iter()
            .map(|r| validate_return(&policies, r))
            .collect();
        assert_eq!(checked[0].as_ref().unwrap().unused, 3);
        assert_eq!(
            checked[1].as_ref().unwrap_err().code,
            ErrorCode::InvalidPolicy
        );
        for c in &checked[2..] {
            assert_eq!(c.as_ref().unwrap_err().code, ErrorCode::InvalidRequest);
        }
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
