//! The limiter's request logic, independent of HTTP: validate a batch, split it into atomic
//! units (single leases and all-or-nothing groups), run the units against the store
//! concurrently with a deadline each, and assemble one answer per item.
//!
//! The rules it enforces:
//! * a malformed batch (bad JSON, unknown fields, negative or fractional amounts, more than
//!   `MAX_BATCH` items) is refused whole with 400 and a reason;
//! * a batch repeating a lease id is refused whole with 400 naming the id (two items sharing
//!   one lease record could not both be decided once);
//! * per item: an unknown or non-global policy is `INVALID_POLICY`; a bad key, a bad id,
//!   `min == 0`, `min > burst`, a bad `holder` or a bad `demand_per_s` is `INVALID_REQUEST`;
//!   `want` is clamped to `[min, burst]`;
//! * an answer carries the store's assignment as `share_per_s` and `period_ms`; its
//!   `expires_ms` is the lease TTL, plus the period when there is a share (tokens that
//!   accrue late in the period stay spendable a little);
//! * a group is decided in one store call, so its keys must share a hash tag; one invalid
//!   member makes the whole group invalid (it cannot be decided all-or-nothing any more);
//! * a unit the store could not decide in time answers `UNAVAILABLE` for its items; when every
//!   item is `UNAVAILABLE` the whole answer is `503 {"error":"UNAVAILABLE"}`. Nothing is ever
//!   granted or denied that the store did not decide.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use serde::Serialize;
use tollgate_core::assign::{Allotment, MAX_HOLDER_BYTES};
use tollgate_core::key;
use tollgate_core::policy::{Policies, Scope};
use tollgate_core::protocol::{
    BatchError, ErrorCode, LeaseBatch, LeaseBatchResponse, LeaseError, LeaseGranted, LeaseRequest,
    LeaseResult, LeaseReturn, ReturnBatch, ReturnBatchResponse, ReturnResult, MAX_BATCH,
    MAX_LEASE_ID_BYTES,
};

use crate::metrics::{outcome, Metrics, UNKNOWN_POLICY};
use crate::policies::PolicyHandle;
use crate::store::{Grant, LeaseItem, LeaseOutcome, ReturnItem, Store, StoreError};

/// Largest `demand_per_s` a holder may report.
pub const MAX_DEMAND_PER_S: f64 = 1e9;

/// Settings of the request logic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceSettings {
    /// `expires_ms` of every granted lease (plus the period of an assignment).
    pub lease_ttl: Duration,
    /// Deadline of one store call (one unit).
    pub store_timeout: Duration,
}

/// An HTTP-agnostic answer: status code and JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub body: String,
}

impl Reply {
    fn json<T: Serialize>(status: u16, body: &T) -> Self {
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

    pub fn bad_request(reason: impl Into<String>) -> Self {
        Self::json(
            400,
            &BatchError {
                error: ErrorCode::InvalidRequest,
                reason: Some(reason.into()),
            },
        )
    }

    fn unavailable(reason: String) -> Self {
        Self::json(
            503,
            &BatchError {
                error: ErrorCode::Unavailable,
                reason: Some(reason),
            },
        )
    }
}

/// Logs at most one line per second for a repeated condition (a store outage would otherwise
/// log once per call).
#[derive(Debug, Default)]
struct LogThrottle {
    last_second: AtomicU64,
}

impl LogThrottle {
    fn allow(&self) -> bool {
        let second = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.last_second.swap(second, Ordering::Relaxed) != second
    }
}

/// A per-item failure before or instead of a store answer.
#[derive(Debug, Clone)]
struct ItemError {
    code: ErrorCode,
    reason: String,
}

impl ItemError {
    fn request(reason: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::InvalidRequest,
            reason: reason.into(),
        }
    }

    fn policy(reason: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::InvalidPolicy,
            reason: reason.into(),
        }
    }

    fn unavailable(e: &StoreError) -> Self {
        Self {
            code: ErrorCode::Unavailable,
            reason: e.to_string(),
        }
    }
}

/// The request logic over a store `S`.
pub struct Service<S> {
    store: Arc<S>,
    policies: Arc<PolicyHandle>,
    metrics: Metrics,
    settings: ServiceSettings,
    store_log: LogThrottle,
}

impl<S: Store> Service<S> {
    pub fn new(
        store: Arc<S>,
        policies: Arc<PolicyHandle>,
        metrics: Metrics,
        settings: ServiceSettings,
    ) -> Self {
        Self {
            store,
            policies,
            metrics,
            settings,
            store_log: LogThrottle::default(),
        }
    }

    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn policies(&self) -> &Arc<PolicyHandle> {
        &self.policies
    }

    fn policy_label<'a>(policies: &'a Policies, name: &'a str) -> &'a str {
        if policies.get(name).is_some() {
            name
        } else {
            UNKNOWN_POLICY
        }
    }

    fn store_failed(&self, node: &str, op: &str, e: &StoreError) {
        self.metrics.store_error(node, e.kind());
        if self.store_log.allow() {
            if e.is_transient() {
                tracing::warn!(%node, op, kind = e.kind(), error = %e, "store call failed");
            } else {
                tracing::error!(%node, op, kind = e.kind(), error = %e, "store call failed");
            }
        }
    }

    /// Runs one store call under the store timeout, with latency and error metrics.
    async fn timed<T, F>(&self, node: &str, op: &str, call: F) -> Result<T, StoreError>
    where
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        let start = Instant::now();
        let result = match tokio::time::timeout(self.settings.store_timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.settings.store_timeout)),
        };
        self.metrics.store_call(node, op, start.elapsed());
        if let Err(e) = &result {
            self.store_failed(node, op, e);
        }
        result
    }

    /// `POST /v1/leases`.
    pub async fn lease_batch(&self, body: &[u8]) -> Reply {
        let batch: LeaseBatch = match serde_json::from_slice(body) {
            Ok(batch) => batch,
            Err(e) => return Reply::bad_request(format!("invalid lease batch: {e}")),
        };
        if batch.leases.len() > MAX_BATCH {
            return Reply::bad_request(format!(
                "{} leases in one batch; at most {MAX_BATCH}",
                batch.leases.len()
            ));
        }
        if let Some(reason) = repeated_id(&batch.leases) {
            return Reply::bad_request(reason);
        }
        let policies = self.policies.current();
        let requests = batch.leases;

        let mut items: Vec<Result<LeaseItem, ItemError>> = requests
            .iter()
            .map(|r| validate_lease(&policies, r))
            .collect();
        let units = form_units(&requests, &mut items);

        let outcomes = join_all(units.iter().map(|unit| {
            let unit_items: Vec<LeaseItem> = unit
                .iter()
                .filter_map(|&i| items.get(i).and_then(|r| r.as_ref().ok()).cloned())
                .collect();
            async move {
                let node = unit_items
                    .first()
                    .map(|item| self.store.node_for(&item.key))
                    .unwrap_or_default();
                let result = self
                    .timed(&node, "lease", self.store.lease(&unit_items))
                    .await;
                match result {
                    Ok(outcome) if outcome.grants.len() == unit_items.len() => Ok(outcome),
                    Ok(outcome) => Err(StoreError::Protocol(format!(
                        "{} answers for {} items",
                        outcome.grants.len(),
                        unit_items.len()
                    ))),
                    Err(e) => Err(e),
                }
            }
        }))
        .await;

        let mut answers: Vec<Option<Result<LeaseGranted, ItemError>>> = vec![None; requests.len()];
        for (unit, outcome) in units.iter().zip(outcomes) {
            match outcome {
                Ok(LeaseOutcome { grants, .. }) => {
                    for (&i, grant) in unit.iter().zip(grants) {
                        let Some(request) = requests.get(i) else {
                            continue;
                        };
                        let label = Self::policy_label(&policies, &request.policy);
                        let item = items.get(i).and_then(|r| r.as_ref().ok());
                        self.count(label, item, &grant);
                        if let Some(slot) = answers.get_mut(i) {
                            *slot = Some(Ok(LeaseGranted {
                                id: request.id.clone(),
                                granted: grant.granted,
                                remaining: grant.remaining,
                                retry_after_ms: grant.retry_after_ms,
                                expires_ms: self.expires_ms(&grant),
                                share_per_s: grant.share_per_ms * 1_000.0,
                                period_ms: grant.period_ms,
                            }));
                        }
                    }
                }
                Err(e) => {
                    for &i in unit {
                        if let Some(slot) = answers.get_mut(i) {
                            *slot = Some(Err(ItemError::unavailable(&e)));
                        }
                    }
                }
            }
        }

        let mut unavailable = 0;
        let mut first_unavailable = None;
        let results: Vec<LeaseResult> = requests
            .iter()
            .zip(items)
            .zip(answers)
            .map(|((request, item), answer)| {
                let answer = match (item, answer) {
                    (Err(e), _) => Err(e),
                    (Ok(_), Some(answer)) => answer,
                    (Ok(_), None) => Err(ItemError::unavailable(&StoreError::Protocol(
                        "no answer for item".into(),
                    ))),
                };
                match answer {
                    Ok(granted) => LeaseResult::Granted(granted),
                    Err(e) => {
                        if e.code == ErrorCode::Unavailable {
                            unavailable += 1;
                            first_unavailable.get_or_insert_with(|| e.reason.clone());
                        }
                        self.metrics.decision(
                            Self::policy_label(&policies, &request.policy),
                            e.code.as_str(),
                        );
                        LeaseResult::Error(LeaseError {
                            id: request.id.clone(),
                            error: e.code,
                            reason: Some(e.reason),
                        })
                    }
                }
            })
            .collect();

        if !results.is_empty() && unavailable == results.len() {
            return Reply::unavailable(first_unavailable.unwrap_or_default());
        }
        Reply::json(
            200,
            &LeaseBatchResponse {
                leases: results,
                policy_version: policies.version.clone(),
            },
        )
    }

    /// Decision metrics of one store answer.
    fn count(&self, label: &str, item: Option<&LeaseItem>, grant: &Grant) {
        if grant.replayed {
            self.metrics.decision(label, outcome::REPLAYED);
            return;
        }
        let share = grant.share_per_ms > 0.0;
        let result = if grant.granted > 0 {
            self.metrics.tokens_granted(label, grant.granted);
            outcome::GRANTED
        } else if share {
            outcome::ASSIGNED
        } else {
            outcome::OVER_LIMIT
        };
        self.metrics.decision(label, result);
        // The assignment regime: a named holder the bucket could not give its `want`.
        if item.is_some_and(|item| item.holder.is_some() && grant.granted < item.want) {
            if share {
                self.metrics.assignment(label, outcome::ASSIGNED);
                // What the share took from the bucket, in whole tokens (core's own rounding).
                let drip = Allotment {
                    granted: 0,
                    remaining: grant.remaining,
                    retry_after_ms: 0,
                    share_per_ms: grant.share_per_ms,
                    period_ms: grant.period_ms,
                }
                .taken();
                self.metrics.tokens_assigned(label, drip);
            } else {
                self.metrics.assignment(label, outcome::WAITING);
            }
        }
    }

    /// `expires_ms` of an answer: the lease TTL when something may be spent, plus the period
    /// when there is a share (its drip accrues until the period ends).
    fn expires_ms(&self, grant: &Grant) -> u64 {
        let ttl = u64::try_from(self.settings.lease_ttl.as_millis()).unwrap_or(u64::MAX);
        if grant.share_per_ms > 0.0 {
            ttl.saturating_add(grant.period_ms)
        } else if grant.granted > 0 {
            ttl
        } else {
            0
        }
    }

    /// `POST /v1/leases/return`.
    pub async fn return_batch(&self, body: &[u8]) -> Reply {
        let batch: ReturnBatch = match serde_json::from_slice(body) {
            Ok(batch) => batch,
            Err(e) => return Reply::bad_request(format!("invalid return batch: {e}")),
        };
        if batch.returns.len() > MAX_BATCH {
            return Reply::bad_request(format!(
                "{} returns in one batch; at most {MAX_BATCH}",
                batch.returns.len()
            ));
        }
        let policies = self.policies.current();
        let results = join_all(batch.returns.iter().map(|r| {
            let policies = &policies;
            async move {
                let item = match validate_return(policies, r) {
                    Ok(item) => item,
                    Err(e) => return (r, Err(e)),
                };
                if item.unused == 0 {
                    return (r, Ok(0));
                }
                let node = self.store.node_for(&item.key);
                let result = self
                    .timed(&node, "return", self.store.give_back(&item))
                    .await;
                (
                    r,
                    result
                        .map(|o| o.returned)
                        .map_err(|e| ItemError::unavailable(&e)),
                )
            }
        }))
        .await;

        let mut unavailable = 0;
        let mut first_unavailable = None;
        let returns: Vec<ReturnResult> = results
            .into_iter()
            .map(|(request, result)| {
                let label = Self::policy_label(&policies, &request.policy);
                match result {
                    Ok(returned) => {
                        if returned > 0 {
                            self.metrics.tokens_returned(label, returned);
                            self.metrics.returned(label, outcome::RETURNED);
                        } else {
                            self.metrics.returned(label, outcome::NOTHING_RETURNED);
                        }
                        ReturnResult::Returned {
                            id: request.id.clone(),
                            returned,
                        }
                    }
                    Err(e) => {
                        if e.code == ErrorCode::Unavailable {
                            unavailable += 1;
                            first_unavailable.get_or_insert_with(|| e.reason.clone());
                        }
                        self.metrics.returned(label, e.code.as_str());
                        ReturnResult::Error(LeaseError {
                            id: request.id.clone(),
                            error: e.code,
                            reason: Some(e.reason),
                        })
                    }
                }
            })
            .collect();
        if !returns.is_empty() && unavailable == returns.len() {
            return Reply::unavailable(first_unavailable.unwrap_or_default());
        }
        Reply::json(200, &ReturnBatchResponse { returns })
    }

    /// `GET /readyz`: the store answers and has its functions (loading them if needed).
    pub async fn readiness(&self) -> Reply {
        let node = self.store.kind();
        let deadline = self.settings.store_timeout.max(Duration::from_secs(1));
        let start = Instant::now();
        let result = match tokio::time::timeout(deadline, self.store.ready()).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(deadline)),
        };
        let version = self.policies.current().version.clone();
        match result {
            Ok(()) => Reply::json(
                200,
                &serde_json::json!({
                    "ready": true,
                    "store": node,
                    "policy_version": version,
                    "took_ms": start.elapsed().as_millis(),
                }),
            ),
            Err(e) => Reply::json(
                503,
                &serde_json::json!({
                    "ready": false,
                    "store": node,
                    "policy_version": version,
                    "reason": e.to_string(),
                }),
            ),
        }
    }

    /// Installs the store's server-side code, retrying with backoff until it succeeds (a store
    /// that is down at start gets the current code as soon as it is back, not only when a
    /// call finds the functions missing).
    pub async fn prepare_store(&self) {
        let mut pause = Duration::from_millis(100);
        let mut warned = false;
        loop {
            let deadline = self.settings.store_timeout.max(Duration::from_secs(2));
            let result = match tokio::time::timeout(deadline, self.store.prepare()).await {
                Ok(result) => result,
                Err(_) => Err(StoreError::Timeout(deadline)),
            };
            match result {
                Ok(()) => {
                    tracing::info!(
                        store = self.store.kind(),
                        "store prepared (functions loaded)"
                    );
                    return;
                }
                Err(e) => {
                    if !warned {
                        tracing::warn!(store = self.store.kind(), error = %e,
                            "cannot prepare the store yet; retrying in the background");
                        warned = true;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Samples the store's key counts into the active-keys gauge.
    pub async fn sample_active_keys(&self) {
        let deadline = self.settings.store_timeout.max(Duration::from_secs(2));
        match tokio::time::timeout(deadline, self.store.active_keys()).await {
            Ok(Ok(samples)) => self.metrics.set_active_keys(&samples),
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot sample active keys"),
            Err(_) => tracing::debug!("active keys sample timed out"),
        }
    }
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

/// The policy named `name` if it exists and is global.
fn global_policy<'a>(
    policies: &'a Policies,
    name: &str,
) -> Result<&'a tollgate_core::policy::Policy, ItemError> {
    let policy = policies
        .get(name)
        .ok_or_else(|| ItemError::policy(format!("unknown policy `{}`", truncate(name, 64))))?;
    if policy.scope != Scope::Global {
        return Err(ItemError::policy(format!(
            "policy `{name}` has scope `local`: the limiter only owns global buckets"
        )));
    }
    Ok(policy)
}

fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.get(..end).unwrap_or_default()
}

fn validate_lease(policies: &Policies, r: &LeaseRequest) -> Result<LeaseItem, ItemError> {
    validate_id(&r.id)?;
    let policy = global_policy(policies, &r.policy)?;
    key::validate_key(&r.key).map_err(ItemError::request)?;
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

fn validate_return(policies: &Policies, r: &LeaseReturn) -> Result<ReturnItem, ItemError> {
    validate_id(&r.id)?;
    let policy = global_policy(policies, &r.policy)?;
    key::validate_key(&r.key).map_err(ItemError::request)?;
    Ok(ReturnItem {
        id: r.id.clone(),
        policy: policy.name.clone(),
        key: r.key.clone(),
        limits: policy.limits,
        unused: r.unused,
    })
}

/// Why a batch repeating a lease id is refused, naming the id: a lease id names one lease
/// record in the store, so two items with one id could not both be decided once each —
/// whichever ran second would replay the first. Rather than answer such a batch half (one
/// copy decided, the other refused, which one depending on the order of the store calls),
/// the whole batch is refused.
fn repeated_id(requests: &[LeaseRequest]) -> Option<String> {
    let mut first_at: HashMap<&str, usize> = HashMap::with_capacity(requests.len());
    for (i, request) in requests.iter().enumerate() {
        if let Some(first) = first_at.insert(request.id.as_str(), i) {
            return Some(format!(
                "lease id `{}` appears more than once in this batch (items {first} and {i}); \
                 ids must be unique per logical request",
                truncate(&request.id, 64)
            ));
        }
    }
    None
}

/// Splits the valid items into units (indices into the batch): each ungrouped item alone,
/// each group together. Invalidates whole groups that cannot be decided atomically.
fn form_units(
    requests: &[LeaseRequest],
    items: &mut [Result<LeaseItem, ItemError>],
) -> Vec<Vec<usize>> {
    let mut units: Vec<Vec<usize>> = Vec::new();
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        match &request.group {
            None => {
                if items.get(i).is_some_and(|r| r.is_ok()) {
                    units.push(vec![i]);
                }
            }
            Some(group) => match groups.iter_mut().find(|(g, _)| g == group) {
                Some((_, members)) => members.push(i),
                None => groups.push((group.as_str(), vec![i])),
            },
        }
    }
    for (group, members) in groups {
        let invalid = members
            .iter()
            .find(|&&i| items.get(i).is_some_and(|r| r.is_err()))
            .and_then(|&i| requests.get(i).map(|r| r.id.clone()));
        let tags: HashSet<&str> = members
            .iter()
            .filter_map(|&i| requests.get(i).map(|r| key::hash_tag(&r.key)))
            .collect();
        let reason = if let Some(id) = invalid {
            Some(format!(
                "item `{}` of group `{}` is invalid, so the group cannot be decided",
                truncate(&id, 64),
                truncate(group, 64)
            ))
        } else if tags.len() > 1 {
            Some(format!(
                "keys of group `{}` do not share a hash tag (their first part), so they cannot be decided in one atomic step",
                truncate(group, 64)
            ))
        } else {
            None
        };
        match reason {
            Some(reason) => {
                for &i in &members {
                    if let Some(item) = items.get_mut(i) {
                        if item.is_ok() {
                            *item = Err(ItemError::request(reason.clone()));
                        }
                    }
                }
            }
            None => units.push(members),
        }
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemoryStore, StoreSettings};

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

    fn service() -> Service<MemoryStore> {
        let policies = Policies::from_json(DOC.as_bytes()).unwrap();
        Service::new(
            Arc::new(MemoryStore::new(StoreSettings {
                dedup_ttl_ms: 60_000,
                assignment_period_ms: 1_000,
                lease_ttl_ms: 2_000,
            })),
            Arc::new(PolicyHandle::new(policies)),
            Metrics::new().unwrap(),
            ServiceSettings {
                lease_ttl: Duration::from_secs(2),
                store_timeout: Duration::from_millis(50),
            },
        )
    }

    fn parse(reply: &Reply) -> serde_json::Value {
        serde_json::from_str(&reply.body).unwrap()
    }

    #[tokio::test]
    async fn batch_level_errors_are_400_with_a_reason() {
        let s = service();
        for body in [
            "not json",
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":2,"extra":1}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":-1,"want":2}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1.5,"want":2}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":1e400}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":18446744073709551616}]}"#,
            r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":NaN}]}"#,
        ] {
            let r = s.lease_batch(body.as_bytes()).await;
            assert_eq!(r.status, 400, "{body}: {}", r.body);
            let v = parse(&r);
            assert_eq!(v["error"], "INVALID_REQUEST");
            assert!(v["reason"].as_str().unwrap().len() > 5);
        }
        let many: Vec<String> = (0..=MAX_BATCH)
            .map(|i| format!(r#"{{"id":"{i}","policy":"g","key":"t","min":1,"want":1}}"#))
            .collect();
        let r = s
            .lease_batch(format!(r#"{{"leases":[{}]}}"#, many.join(",")).as_bytes())
            .await;
        assert_eq!(r.status, 400);
    }

    #[tokio::test]
    async fn per_item_errors_and_clamping() {
        let s = service();
        let body = r#"{"leases":[
            {"id":"ok","policy":"g","key":"t1","min":2,"want":1000},
            {"id":"unknown","policy":"nope","key":"t1","min":1,"want":1},
            {"id":"local","policy":"l","key":"t1","min":1,"want":1},
            {"id":"badkey","policy":"g","key":"a{b}","min":1,"want":1},
            {"id":"","policy":"g","key":"t1","min":1,"want":1},
            {"id":"zero","policy":"g","key":"t1","min":0,"want":1},
            {"id":"big","policy":"g","key":"t1","min":11,"want":11},
            {"id":"nogroup","policy":"g","key":"t2","min":1,"want":1,"group":""},
            {"id":"low","policy":"g","key":"t3","min":3,"want":1}
        ]}"#;
        let r = s.lease_batch(body.as_bytes()).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = parse(&r);
        let l = v["leases"].as_array().unwrap();
        // Full bucket of 10: fill ratio 1, want clamped to 10.
        assert_eq!(l[0]["granted"], 10);
        assert_eq!(l[0]["expires_ms"], 2000);
        assert_eq!(l[1]["error"], "INVALID_POLICY");
        assert_eq!(l[2]["error"], "INVALID_POLICY");
        for (i, item) in l.iter().enumerate().take(8).skip(3) {
            assert_eq!(item["error"], "INVALID_REQUEST", "{i}: {item}");
        }
        // want < min is treated as min.
        assert_eq!(l[8]["granted"], 3);
        assert_eq!(v["policy_version"], s.policies().current().version);
        let metrics = s.metrics().render();
        assert!(metrics.contains(r#"policy="(unknown)""#));
        assert!(!metrics.contains(r#"policy="nope""#));
    }

    #[tokio::test]
    async fn groups_are_all_or_nothing_and_share_a_hash_tag() {
        let s = service();
        // Route bucket (burst 3) runs out before the tenant bucket (burst 10).
        let group = |n: usize| {
            format!(
                r#"{{"leases":[
                {{"id":"t{n}","policy":"g","key":"acme","min":1,"want":1,"group":"x"}},
                {{"id":"r{n}","policy":"route","key":"acme:post","min":1,"want":1,"group":"x"}}]}}"#
            )
        };
        for n in 0..3 {
            let v = parse(&s.lease_batch(group(n).as_bytes()).await);
            assert_eq!(v["leases"][0]["granted"], 1);
            assert_eq!(v["leases"][1]["granted"], 1);
        }
        let v = parse(&s.lease_batch(group(3).as_bytes()).await);
        assert_eq!(v["leases"][0]["granted"], 0, "{v}");
        assert_eq!(v["leases"][1]["granted"], 0);
        let remaining = v["leases"][0]["remaining"].as_f64().unwrap();
        assert!(
            (7.0..7.01).contains(&remaining),
            "tenant bucket untouched: {remaining}"
        );

        let split = r#"{"leases":[
            {"id":"a","policy":"g","key":"acme","min":1,"want":1,"group":"y"},
            {"id":"b","policy":"g","key":"other","min":1,"want":1,"group":"y"},
            {"id":"c","policy":"g","key":"acme","min":1,"want":1,"group":"z"},
            {"id":"d","policy":"nope","key":"acme","min":1,"want":1,"group":"z"}]}"#;
        let v = parse(&s.lease_batch(split.as_bytes()).await);
        for i in 0..3 {
            assert_eq!(
                v["leases"][i]["error"], "INVALID_REQUEST",
                "{}",
                v["leases"][i]
            );
        }
        assert_eq!(v["leases"][3]["error"], "INVALID_POLICY");
    }

    #[tokio::test]
    async fn a_repeated_id_refuses_the_whole_batch_naming_it() {
        let s = service();
        let body = r#"{"leases":[
            {"id":"a","policy":"g","key":"t","min":1,"want":1},
            {"id":"b","policy":"g","key":"t","min":1,"want":1},
            {"id":"a","policy":"g","key":"u","min":1,"want":1}]}"#;
        let r = s.lease_batch(body.as_bytes()).await;
        assert_eq!(r.status, 400, "{}", r.body);
        let v = parse(&r);
        assert_eq!(v["error"], "INVALID_REQUEST");
        let reason = v["reason"].as_str().unwrap();
        assert!(
            reason.contains("`a`") && reason.contains("items 0 and 2"),
            "{reason}"
        );
        // Nothing of it was decided: the whole burst is still there.
        let all = r#"{"leases":[{"id":"c","policy":"g","key":"t","min":10,"want":10}]}"#;
        assert_eq!(
            parse(&s.lease_batch(all.as_bytes()).await)["leases"][0]["granted"],
            10
        );
        // A long id is quoted shortened.
        let long = "i".repeat(120);
        let body = format!(
            r#"{{"leases":[{{"id":"{long}","policy":"g","key":"t","min":1,"want":1}},
            {{"id":"{long}","policy":"g","key":"t","min":1,"want":1}}]}}"#
        );
        let reason = parse(&s.lease_batch(body.as_bytes()).await)["reason"].to_string();
        assert!(
            !reason.contains(&long) && reason.contains(&long[..64]),
            "{reason}"
        );
    }

    #[tokio::test]
    async fn returns_are_validated_and_bounded() {
        let s = service();
        let lease = r#"{"leases":[{"id":"a","policy":"g","key":"t","min":4,"want":4}]}"#;
        let v = parse(&s.lease_batch(lease.as_bytes()).await);
        assert_eq!(v["leases"][0]["granted"], 4);
        let ret = r#"{"returns":[
            {"id":"a","policy":"g","key":"t","unused":3},
            {"id":"a","policy":"nope","key":"t","unused":3},
            {"id":"a","policy":"g","key":"t{","unused":3},
            {"id":"zero","policy":"g","key":"t","unused":0}]}"#;
        let r = s.return_batch(ret.as_bytes()).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = parse(&r);
        assert_eq!(v["returns"][0]["returned"], 3);
        assert_eq!(v["returns"][1]["error"], "INVALID_POLICY");
        assert_eq!(v["returns"][2]["error"], "INVALID_REQUEST");
        assert_eq!(v["returns"][3]["returned"], 0);
        let again = r#"{"returns":[{"id":"a","policy":"g","key":"t","unused":3}]}"#;
        let v = parse(&s.return_batch(again.as_bytes()).await);
        assert_eq!(
            v["returns"][0]["returned"], 1,
            "only 1 of the 4 left to return"
        );
        assert_eq!(s.return_batch(b"{}").await.status, 400);
    }

    #[tokio::test]
    async fn holders_and_demands_are_validated_per_item() {
        let s = service();
        let long = "h".repeat(MAX_HOLDER_BYTES + 1);
        let body = format!(
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
        ]}}"#,
            max = "h".repeat(MAX_HOLDER_BYTES)
        );
        let r = s.lease_batch(body.as_bytes()).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let v = parse(&r);
        let l = v["leases"].as_array().unwrap();
        assert_eq!(l[0]["granted"], 1, "{}", l[0]);
        for item in &l[1..5] {
            assert_eq!(item["error"], "INVALID_REQUEST", "{item}");
            assert!(
                item["reason"].as_str().unwrap().contains("holder"),
                "{item}"
            );
        }
        for item in &l[5..7] {
            assert_eq!(item["error"], "INVALID_REQUEST", "{item}");
            assert!(
                item["reason"].as_str().unwrap().contains("demand_per_s"),
                "{item}"
            );
        }
        assert_eq!(l[7]["granted"], 1, "{}", l[7]);
        assert_eq!(l[8]["granted"], 1, "{}", l[8]);
    }

    #[tokio::test]
    async fn an_assignment_is_answered_with_its_share_and_a_longer_expiry() {
        let s = service();
        let drain = r#"{"leases":[{"id":"d","policy":"g","key":"t","min":10,"want":10}]}"#;
        assert_eq!(
            parse(&s.lease_batch(drain.as_bytes()).await)["leases"][0]["granted"],
            10
        );
        // Holder-less: a plain denial, no assignment fields.
        let plain = r#"{"leases":[{"id":"p","policy":"g","key":"t","min":1,"want":5}]}"#;
        let v = parse(&s.lease_batch(plain.as_bytes()).await);
        let p = &v["leases"][0];
        assert_eq!(p["granted"], 0);
        assert_eq!(p["expires_ms"], 0);
        assert!(
            p.get("share_per_s").is_none() && p.get("period_ms").is_none(),
            "{p}"
        );
        // Named, demand 10/s against a rate of 1/h: the whole rate, for the 1 s period.
        let named = r#"{"leases":[{"id":"a","policy":"g","key":"t","min":1,"want":5,
            "holder":"i-1","demand_per_s":10}]}"#;
        let first = parse(&s.lease_batch(named.as_bytes()).await);
        let a = &first["leases"][0];
        assert_eq!(a["granted"], 0, "{a}");
        let share = a["share_per_s"].as_f64().unwrap();
        assert!((share - 1.0 / 3_600.0).abs() < 1e-12, "{a}");
        assert_eq!(a["period_ms"], 1_000);
        assert_eq!(a["expires_ms"], 3_000);
        assert_eq!(a["retry_after_ms"], 0);
        // A second holder waits: the rate is held.
        let other = r#"{"leases":[{"id":"b","policy":"g","key":"t","min":1,"want":5,
            "holder":"i-2","demand_per_s":10}]}"#;
        let v = parse(&s.lease_batch(other.as_bytes()).await);
        let b = &v["leases"][0];
        assert!(b.get("share_per_s").is_none(), "{b}");
        assert!(b["retry_after_ms"].as_u64().unwrap() <= 1_000, "{b}");
        // The replay answers the same assignment.
        let again = parse(&s.lease_batch(named.as_bytes()).await);
        assert_eq!(again["leases"][0], *a);
        let metrics = s.metrics().render();
        for needle in [
            r#"tollgate_limiter_decisions_total{outcome="ASSIGNED",policy="g"} 1"#,
            r#"tollgate_limiter_assignments_total{outcome="ASSIGNED",policy="g"} 1"#,
            r#"tollgate_limiter_assignments_total{outcome="WAITING",policy="g"} 1"#,
            r#"tollgate_limiter_decisions_total{outcome="OVER_LIMIT",policy="g"} 2"#,
            r#"tollgate_limiter_decisions_total{outcome="REPLAYED",policy="g"} 1"#,
        ] {
            assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
        }
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
