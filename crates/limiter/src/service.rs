//! The limiter's request logic, independent of HTTP: validate a batch, split it into atomic
//! units (single leases and all-or-nothing groups), run the units against the store
//! concurrently with a deadline each, and assemble one answer per item.
//!
//! The rules live in two pure modules, unit-tested without a store: [`validate`] (what is
//! refused, what the store is asked, in which units) and [`answer`] (what is answered and
//! counted for what the store said). This module only orchestrates: the store calls under
//! their deadline, the metrics, and the lifecycle loops (store preparation, key sampling).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use tollgate_core::policy::Policies;

use crate::metrics::{Metrics, UNKNOWN_POLICY};
use crate::observe::Observer;
use crate::policies::PolicyHandle;
use crate::store::{Store, StoreError};

mod answer;
mod validate;

pub use answer::Reply;
use validate::{BatchRefused, ItemError};

/// Settings of the request logic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceSettings {
    /// `expires_ms` of every granted lease (plus the period of an assignment).
    pub lease_ttl: Duration,
    /// Deadline of one store call (one unit).
    pub store_timeout: Duration,
}

/// Logs at most one line per second for a repeated condition (a store outage would otherwise
/// log once per call).
#[derive(Debug, Default)]
pub(crate) struct LogThrottle {
    last_second: AtomicU64,
}

impl LogThrottle {
    pub(crate) fn allow(&self) -> bool {
        let second = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.last_second.swap(second, Ordering::Relaxed) != second
    }
}

/// The request logic over a store `S`.
pub struct Service<S> {
    store: Arc<S>,
    policies: Arc<PolicyHandle>,
    metrics: Metrics,
    settings: ServiceSettings,
    store_log: LogThrottle,
    observer: Observer,
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
            observer: Observer::with_defaults(metrics.clone()),
            metrics,
            settings,
            store_log: LogThrottle::default(),
        }
    }

    /// The same service recording its traffic into `observer` (hot keys, active keys).
    pub fn with_observer(mut self, observer: Observer) -> Self {
        self.observer = observer;
        self
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn observer(&self) -> &Observer {
        &self.observer
    }

    fn policy_label<'a>(policies: &'a Policies, name: &'a str) -> &'a str {
        if policies.get(name).is_some() {
            name
        } else {
            UNKNOWN_POLICY
        }
    }

    /// Adds a batch's `settled` units to `units_settled_total`, under the policy's name when
    /// the document in force defines it, else under `(unknown)`: label values come from the
    /// document, never from the body. (At most `MAX_SETTLED_POLICIES` entries: checked when
    /// the batch was parsed.)
    fn count_settled(&self, policies: &Policies, settled: &BTreeMap<String, u64>) {
        for (name, &units) in settled {
            if units > 0 {
                self.metrics
                    .units_settled(Self::policy_label(policies, name), units);
            }
        }
    }

    fn lease_ttl_ms(&self) -> u64 {
        u64::try_from(self.settings.lease_ttl.as_millis()).unwrap_or(u64::MAX)
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
        let (requests, settled) = match validate::parse_leases(body) {
            Ok(batch) => (batch.leases, batch.settled),
            Err(BatchRefused(reason)) => return Reply::bad_request(reason),
        };
        let policies = self.policies.current();
        let plan = validate::plan_leases(&policies, &requests);

        let outcomes = join_all(plan.units.iter().map(|unit| {
            let items = &unit.items;
            async move {
                let node = items
                    .first()
                    .map(|item| self.store.node_for(&item.key))
                    .unwrap_or_default();
                let result = self.timed(&node, "lease", self.store.lease(items)).await;
                answer::unit_grants(items.len(), result)
            }
        }))
        .await;
        let answers = answer::per_item(&plan, outcomes);

        for ((request, item), answer) in requests.iter().zip(&plan.items).zip(&answers) {
            let label = Self::policy_label(&policies, &request.policy);
            let t = answer::tally(item.as_ref().ok(), answer);
            if let Ok(item) = item {
                let node = self.store.node_for(&item.key);
                self.observer
                    .lease_decided(item, answer.as_ref().ok(), &node);
            }
            self.metrics.decision(label, t.decision);
            if t.tokens_granted > 0 {
                self.metrics.tokens_granted(label, t.tokens_granted);
            }
            if let Some(assignment) = t.assignment {
                self.metrics.assignment(label, assignment);
                if assignment == crate::metrics::outcome::ASSIGNED {
                    self.metrics.tokens_assigned(label, t.tokens_assigned);
                }
            }
        }
        let reply =
            answer::lease_reply(&requests, &answers, self.lease_ttl_ms(), &policies.version);
        // Counted only with a 200, and not for a retry of a batch already counted (every
        // decided item a replay): see `answer::settled_counts` for what that leaves.
        if answer::settled_counts(reply.status, Some(&answers)) {
            self.count_settled(&policies, &settled);
        }
        reply
    }

    /// `POST /v1/leases/return`.
    pub async fn return_batch(&self, body: &[u8]) -> Reply {
        let (returns, settled) = match validate::parse_returns(body) {
            Ok(batch) => (batch.returns, batch.settled),
            Err(BatchRefused(reason)) => return Reply::bad_request(reason),
        };
        let policies = self.policies.current();
        let results: Vec<Result<u64, ItemError>> = join_all(returns.iter().map(|r| {
            let policies = &policies;
            async move {
                let item = validate::validate_return(policies, r)?;
                // A window takes nothing back (its leased units count as used in their
                // window): no store call for what would return 0.
                if item.unused == 0 || !item.takes_back() {
                    return Ok(0);
                }
                let node = self.store.node_for(&item.key);
                self.timed(&node, "return", self.store.give_back(&item))
                    .await
                    .map(|o| o.returned)
                    .map_err(|e| ItemError::unavailable(e.to_string()))
            }
        }))
        .await;
        for (request, result) in returns.iter().zip(&results) {
            let label = Self::policy_label(&policies, &request.policy);
            let (outcome, returned) = answer::return_tally(result);
            if returned > 0 {
                self.metrics.tokens_returned(label, returned);
            }
            self.metrics.returned(label, outcome);
        }
        let reply = answer::return_reply(&returns, &results);
        // Counted with a 200 (returns carry no replay signal; see `answer::settled_counts`).
        if answer::settled_counts(reply.status, None) {
            self.count_settled(&policies, &settled);
        }
        reply
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

    /// Samples the store's key counts into the store-keys gauge.
    pub async fn sample_active_keys(&self) {
        let deadline = self.settings.store_timeout.max(Duration::from_secs(2));
        match tokio::time::timeout(deadline, self.store.active_keys()).await {
            Ok(Ok(samples)) => self.metrics.set_store_keys(&samples),
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot sample active keys"),
            Err(_) => tracing::debug!("active keys sample timed out"),
        }
    }
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
         "burst": 10},
        {"name": "win", "key": [{"header": "x-tenant"}], "algorithm": "fixed_window",
         "rate": {"units": 5, "per": "1d"}, "scope": "global"}
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
        assert_eq!(
            v["policy_version"],
            Policies::from_json(DOC.as_bytes()).unwrap().version
        );
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

    #[tokio::test]
    async fn a_window_leases_until_its_end_assigns_nothing_and_takes_nothing_back() {
        let s = service();
        let day = 86_400_000;
        let named = |id: &str, want: u64| {
            format!(
                r#"{{"leases":[{{"id":"{id}","policy":"win","key":"t","min":1,"want":{want},
                "holder":"i-1","demand_per_s":100}}]}}"#
            )
        };
        let v = parse(&s.lease_batch(named("a", 100).as_bytes()).await);
        let a = &v["leases"][0];
        // `want` clamped to the limit; the lease lasts until the day's window ends, not the
        // lease TTL (2 s).
        assert_eq!(a["granted"], 5, "{a}");
        let expires = a["expires_ms"].as_u64().unwrap();
        assert!(expires > 0 && expires <= day, "{a}");
        assert!(
            a.get("share_per_s").is_none() && a.get("period_ms").is_none(),
            "{a}"
        );
        // Over the limit a named holder gets a denial to remember, never a share.
        let v = parse(&s.lease_batch(named("b", 1).as_bytes()).await);
        let b = &v["leases"][0];
        assert_eq!(
            (b["granted"].as_u64(), b["expires_ms"].as_u64()),
            (Some(0), Some(0))
        );
        let retry = b["retry_after_ms"].as_u64().unwrap();
        assert!(retry > 0 && retry <= expires, "until the window ends: {b}");
        assert!(b.get("share_per_s").is_none(), "{b}");
        // A return gives nothing back: the units count as used in their window.
        let ret = r#"{"returns":[{"id":"a","policy":"win","key":"t","unused":5}]}"#;
        let v = parse(&s.return_batch(ret.as_bytes()).await);
        assert_eq!(v["returns"][0]["returned"], 0);
        let v = parse(&s.lease_batch(named("c", 1).as_bytes()).await);
        assert_eq!(v["leases"][0]["granted"], 0, "nothing came back");
        let metrics = s.metrics().render();
        for needle in [
            r#"tollgate_limiter_decisions_total{outcome="GRANTED",policy="win"} 1"#,
            r#"tollgate_limiter_decisions_total{outcome="OVER_LIMIT",policy="win"} 2"#,
            r#"tollgate_limiter_tokens_granted_total{policy="win"} 5"#,
            r#"tollgate_limiter_returns_total{outcome="NOTHING_RETURNED",policy="win"} 1"#,
        ] {
            assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
        }
        assert!(
            !metrics
                .contains(r#"tollgate_limiter_assignments_total{outcome="WAITING",policy="win"}"#),
            "a window has no assignment regime:\n{metrics}"
        );
    }
}
