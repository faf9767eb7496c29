//! The global stage end to end inside one worker, against a fake host and a fake limiter
//! (core bucket math in a map): callouts shared per key, leases credited and spent, denials
//! remembered, failure modes, deadlines, background refills and returns.

use super::*;
use crate::engine::SHARED_PREFIX;
use crate::metrics::sink;
use crate::request::{RequestFacts, RequestSource};
use crate::shared::MemorySharedData;
use crate::table::SlotTable;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use tollgate_core::assign::{allot, Ask, Holding, Terms};
use tollgate_core::bucket::{lease, BucketState, Limits};
use tollgate_core::policy::Policies;
use tollgate_core::protocol::{LeaseBatch, LeaseBatchResponse, LeaseGranted, LeaseResult};

/// A dispatched callout: token, path, body, timeout.
type Sent = (u32, String, Vec<u8>, u64);

#[derive(Default)]
struct FakeHost {
    next_token: Cell<u32>,
    sent: RefCell<Vec<Sent>>,
    resumed: RefCell<Vec<u32>>,
    replied: RefCell<Vec<(u32, u32)>>,
    tick: Cell<u64>,
    refuse_dispatch: Cell<bool>,
}

impl Host for FakeHost {
    fn dispatch(&self, path: &str, body: &[u8], timeout_ms: u64) -> Result<u32, String> {
        if self.refuse_dispatch.get() {
            return Err("no such cluster".into());
        }
        let token = self.next_token.get() + 1;
        self.next_token.set(token);
        self.sent
            .borrow_mut()
            .push((token, path.to_string(), body.to_vec(), timeout_ms));
        Ok(token)
    }
    fn resume(&self, context_id: u32, _request_headers: &[(String, String)]) -> bool {
        self.resumed.borrow_mut().push(context_id);
        true
    }
    fn reply(&self, context_id: u32, reply: &LocalReply) -> bool {
        self.replied.borrow_mut().push((context_id, reply.status));
        true
    }
    fn set_tick(&self, period_ms: u64) {
        self.tick.set(period_ms);
    }
}

/// The limiter's bucket math over an in-test map.
struct FakeLimiter {
    buckets: RefCell<HashMap<String, BucketState>>,
    capacity: u64,
    /// With terms: the limiter's real rule (`assign::allot`, leases or assignments) at
    /// `limits`, instead of plain leases of 1 unit per hour.
    assigning: Option<(Limits, Terms)>,
    holdings: RefCell<HashMap<String, Vec<Holding>>>,
    /// Lease ids already decided: a repeated id answers the same, taking nothing (dedup).
    seen: RefCell<HashMap<String, LeaseResult>>,
}

impl FakeLimiter {
    fn answer(&self, body: &[u8], now: u64) -> Vec<u8> {
        let batch: LeaseBatch = serde_json::from_slice(body).unwrap();
        let limits = tollgate_core::bucket::Limits::new(1, 3_600_000, self.capacity).unwrap();
        let leases = batch
            .leases
            .iter()
            .map(|r| {
                if let Some(result) = self.seen.borrow().get(&r.id) {
                    return result.clone();
                }
                let k = format!("{}:{}", r.policy, r.key);
                let state = self.buckets.borrow().get(&k).copied();
                let result = if let Some((limits, terms)) = self.assigning {
                    let mut holdings = self.holdings.borrow_mut();
                    let held = holdings.entry(k.clone()).or_default();
                    let ask = Ask {
                        min: r.min,
                        want: r.want.min(limits.capacity() as u64),
                        holder: r.holder.as_deref(),
                        demand_per_ms: r.demand_per_s.unwrap_or(0.0) / 1_000.0,
                    };
                    let (next, a) = allot(&limits, state, held, now, ask, terms);
                    self.buckets.borrow_mut().insert(k, next);
                    LeaseResult::Granted(LeaseGranted {
                        id: r.id.clone(),
                        granted: a.granted,
                        remaining: a.remaining,
                        retry_after_ms: a.retry_after_ms,
                        expires_ms: 2_000 + a.period_ms,
                        share_per_s: a.share_per_ms * 1_000.0,
                        period_ms: a.period_ms,
                    })
                } else {
                    let (next, grant) = lease(&limits, state, now, r.min, r.want);
                    self.buckets.borrow_mut().insert(k, next);
                    LeaseResult::Granted(LeaseGranted {
                        id: r.id.clone(),
                        granted: grant.granted,
                        remaining: grant.remaining,
                        retry_after_ms: grant.retry_after_ms,
                        expires_ms: 2_000,
                        share_per_s: 0.0,
                        period_ms: 0,
                    })
                };
                self.seen.borrow_mut().insert(r.id.clone(), result.clone());
                result
            })
            .collect();
        serde_json::to_vec(&LeaseBatchResponse {
            leases,
            policy_version: "v".into(),
        })
        .unwrap()
    }
}

struct Req(&'static str);

impl RequestSource for Req {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        (name == "x-tenant-id").then(|| self.0.as_bytes().to_vec())
    }
    fn property(&self, _: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

fn policy(failure: &str, lease_max: u64) -> String {
    format!(
        r#"{{"policies":[{{"name":"g","key":[{{"header":"x-tenant-id"}}],"rate":{{"units":1,"per":"1h"}},"burst":100,
        "scope":"global","on_unavailable":{failure}}}],
        "limiter":{{"cluster":"limiter","timeout":"25ms","lease_max":{lease_max}}}}}"#
    )
}

struct Rig {
    engine: Engine,
    store: MemorySharedData,
    metrics: Metrics,
    host: FakeHost,
    worker: Worker,
    limiter: FakeLimiter,
}

impl Rig {
    fn ctx(&self, now_ms: u64) -> Ctx<'_, MemorySharedData, FakeHost> {
        Ctx {
            engine: &self.engine,
            store: &self.store,
            metrics: &self.metrics,
            host: &self.host,
            now_ms,
        }
    }

    fn complete(&mut self, token: u32, status: Option<u32>, body: &[u8], now: u64) {
        let mut worker = std::mem::replace(&mut self.worker, Worker::new(0, 0));
        worker.complete(token, status, body, &self.ctx(now));
        self.worker = worker;
    }

    fn tick(&mut self, now: u64) {
        let mut worker = std::mem::replace(&mut self.worker, Worker::new(0, 0));
        worker.tick(&self.ctx(now));
        self.worker = worker;
    }

    fn flush(&mut self, now: u64) {
        let mut worker = std::mem::replace(&mut self.worker, Worker::new(0, 0));
        worker.flush(&self.ctx(now));
        self.worker = worker;
    }

    fn new(doc: &str) -> Self {
        let store = MemorySharedData::default();
        let policies = Policies::from_json(doc.as_bytes()).unwrap();
        let table = SlotTable::open(&store, SHARED_PREFIX, 64, 3).unwrap();
        let metrics = Metrics::define(&policies);
        Rig {
            engine: Engine::new(policies, table),
            store,
            metrics,
            host: FakeHost::default(),
            worker: Worker::new(0xabc, 1),
            limiter: FakeLimiter {
                buckets: RefCell::new(HashMap::new()),
                capacity: 100,
                assigning: None,
                holdings: RefCell::new(HashMap::new()),
                seen: RefCell::new(HashMap::new()),
            },
        }
    }

    /// The plan of a request of `tenant` to the test route.
    fn plan(&self, tenant: &'static str) -> Plan {
        let facts = RequestFacts {
            method: "GET".into(),
            path: "/x".into(),
            host: "h".into(),
        };
        self.engine.plan(&facts, &Req(tenant))
    }

    /// What the HTTP context does for a new request; returns the verdict.
    fn request(&mut self, context: u32, tenant: &'static str, now: u64) -> Verdict {
        let plan = self.plan(tenant);
        let decision =
            self.engine
                .decide(&plan, StoreAt::new(&self.store, now), Attempt::default());
        if decision.verdict == Verdict::Wait {
            assert!(self
                .worker
                .wait(context, plan, &decision, now + 35, Default::default()));
        } else {
            self.metrics.record(&decision);
        }
        if self.worker.queue(&decision) {
            self.flush(now);
        }
        decision.verdict
    }

    /// The limiter answers every callout in flight.
    fn answer_all(&mut self, now: u64) {
        let sent = std::mem::take(&mut *self.host.sent.borrow_mut());
        for (token, path, body, _) in sent {
            let reply = if path == LEASES_PATH {
                self.limiter.answer(&body, now)
            } else {
                let batch: tollgate_core::protocol::ReturnBatch =
                    serde_json::from_slice(&body).unwrap();
                let returns: Vec<_> = batch
                    .returns
                    .iter()
                    .map(|r| format!(r#"{{"id":"{}","returned":{}}}"#, r.id, r.unused))
                    .collect();
                format!(r#"{{"returns":[{}]}}"#, returns.join(",")).into_bytes()
            };
            self.complete(token, Some(200), &reply, now);
        }
    }

    /// Every callout in flight fails once (their retries are then in flight).
    fn fail_once(&mut self, status: Option<u32>, body: &[u8], now: u64) {
        let sent = std::mem::take(&mut *self.host.sent.borrow_mut());
        for (token, ..) in sent {
            self.complete(token, status, body, now);
        }
    }

    /// Every callout in flight fails, and so does its retry.
    fn fail_all(&mut self, status: Option<u32>, body: &[u8], now: u64) {
        self.fail_once(status, body, now);
        self.fail_once(status, body, now);
    }
}

#[test]
fn waiters_of_one_key_share_one_callout_and_spend_the_lease() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    assert_eq!(rig.request(10, "acme", 1_000), Verdict::Wait);
    assert_eq!(rig.request(11, "acme", 1_000), Verdict::Wait);
    assert_eq!(
        rig.host.sent.borrow().len(),
        1,
        "one callout per key per worker"
    );
    assert_eq!(rig.host.tick.get(), TICK_MS);
    let body: LeaseBatch = serde_json::from_slice(&rig.host.sent.borrow()[0].2).unwrap();
    assert_eq!(body.leases[0].policy, "g");
    assert_eq!(body.leases[0].key, "acme");
    assert_eq!((body.leases[0].min, body.leases[0].want), (1, 4));
    rig.answer_all(1_001);
    assert_eq!(*rig.host.resumed.borrow(), {
        let mut v = rig.host.resumed.borrow().clone();
        v.sort();
        assert_eq!(v, vec![10, 11]);
        rig.host.resumed.borrow().clone()
    });
    assert_eq!(rig.worker.waiting(), 0);
    assert_eq!(
        rig.host.tick.get(),
        RETURN_TICK_MS,
        "slow tick when nobody waits but a lease may expire with tokens left"
    );
    // The lease (4 tokens, 2 spent) covers the next requests without a callout... until the
    // low-water mark asks for a refill in the background.
    assert_eq!(rig.request(12, "acme", 1_002), Verdict::Continue);
    assert_eq!(sink::value("tollgate_tokens_granted.policy.g"), 4);
    assert_eq!(sink::value("tollgate_allowed.policy.g"), 3);
}

#[test]
fn background_refill_keeps_requests_from_waiting() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    rig.answer_all(0);
    let mut waited = 0;
    let mut callouts = 1;
    for i in 0..60u32 {
        let now = 10 + u64::from(i) * 10;
        if rig.request(100 + i, "t", now) == Verdict::Wait {
            waited += 1;
        }
        callouts += rig.host.sent.borrow().len();
        rig.answer_all(now + 1);
    }
    assert!(waited <= 1, "{waited} requests waited for a lease");
    assert!(callouts < 20, "{callouts} callouts for 61 requests");
}

#[test]
fn over_limit_is_remembered_exactly_as_long_as_the_limiter_said() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    rig.limiter.capacity = 1;
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    rig.answer_all(0);
    assert_eq!(rig.host.resumed.borrow().as_slice(), &[1]);
    // Bucket empty: the limiter grants 0 with retry 3600 s; the waiter gets 429.
    assert_eq!(rig.request(2, "t", 10), Verdict::Wait);
    rig.answer_all(10);
    assert_eq!(rig.host.replied.borrow().as_slice(), &[(2, 429)]);
    // Within the retry time: 429 at once, no callout.
    match rig.request(3, "t", 20) {
        Verdict::Reply(reply) => {
            assert_eq!(reply.status, 429);
            assert!(reply
                .headers
                .contains(&("retry-after".into(), "3600".into())));
        }
        other => panic!("{other:?}"),
    }
    assert!(rig.host.sent.borrow().is_empty());
    // After it: ask again.
    assert_eq!(rig.request(4, "t", 10 + 3_600_000), Verdict::Wait);
}

#[test]
fn failure_modes_when_the_limiter_is_unavailable() {
    for (failure, expect_status) in [
        (r#"{"mode":"open"}"#, None),
        (r#"{"mode":"closed"}"#, Some(503)),
    ] {
        for (status, body) in [
            (Some(503), &b"{\"error\":\"UNAVAILABLE\"}"[..]),
            (Some(504), &b""[..]),
            (None, &b""[..]),
            (Some(200), &b"garbage"[..]),
        ] {
            let mut rig = Rig::new(&policy(failure, 100));
            assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
            rig.fail_all(status, body, 5);
            match expect_status {
                None => assert_eq!(
                    rig.host.resumed.borrow().as_slice(),
                    &[1],
                    "{failure} {status:?}"
                ),
                Some(code) => assert_eq!(
                    rig.host.replied.borrow().as_slice(),
                    &[(1, code)],
                    "{failure} {status:?}"
                ),
            }
            // During the backoff, requests are decided at once; one probe goes out.
            let verdict = rig.request(2, "t", 10);
            assert_ne!(verdict, Verdict::Wait);
            assert_eq!(rig.host.sent.borrow().len(), 1, "probe");
            assert_ne!(rig.request(3, "t", 11), Verdict::Wait);
            assert_eq!(rig.host.sent.borrow().len(), 1, "only one probe in flight");
            // The limiter is back: the probe's answer ends the outage.
            rig.answer_all(20);
            assert_eq!(rig.request(4, "t", 30), Verdict::Continue);
        }
    }
}

#[test]
fn local_mode_falls_back_to_a_share_of_the_rate_then_closes() {
    let failure = r#"{"mode":"local","share":0.1,"stale_ttl":"1s","then":"closed"}"#;
    let mut rig = Rig::new(&policy(failure, 100));
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    rig.fail_all(Some(503), b"", 1);
    // burst 100 × 0.1 = 10 fallback tokens, the waiter took one.
    assert_eq!(rig.host.resumed.borrow().as_slice(), &[1]);
    let mut allowed = 1;
    for i in 0..20 {
        if rig.request(10 + i, "t", 2) == Verdict::Continue {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 10);
    assert_eq!(sink::value("tollgate_fallback_allowed.policy.g"), 10);
    // The probe fails too; after the backoff a request asks again and waits, and when that
    // fails past stale_ttl (1 s since the outage began), `then: closed` answers 503.
    rig.fail_all(Some(503), b"", 3);
    assert_eq!(rig.request(50, "t", 1_200), Verdict::Wait);
    rig.fail_all(Some(503), b"", 1_201);
    assert_eq!(rig.host.replied.borrow().last(), Some(&(50, 503)));
}

#[test]
fn the_filters_own_deadline_answers_waiters() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    let timeout = rig.host.sent.borrow()[0].3;
    assert!(timeout <= 25, "callout timeout {timeout}");
    rig.tick(20);
    assert!(rig.host.replied.borrow().is_empty());
    rig.tick(35);
    assert_eq!(rig.host.replied.borrow().as_slice(), &[(1, 503)]);
    assert_eq!(rig.worker.waiting(), 0);
    // A late answer still credits the lease for later requests.
    rig.answer_all(40);
    assert_eq!(rig.request(2, "t", 41), Verdict::Continue);
}

#[test]
fn batching_off_asks_for_exactly_the_cost() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 1));
    for i in 0..5 {
        assert_eq!(rig.request(i, "t", u64::from(i) * 10), Verdict::Wait);
        let body: LeaseBatch = serde_json::from_slice(&rig.host.sent.borrow()[0].2).unwrap();
        assert_eq!((body.leases[0].min, body.leases[0].want), (1, 1));
        rig.answer_all(u64::from(i) * 10 + 1);
    }
    assert_eq!(rig.host.resumed.borrow().len(), 5);
}

#[test]
fn expired_leases_are_returned() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    rig.answer_all(0);
    // 4 granted, 1 spent; the lease expires after 2 s.
    assert_eq!(rig.request(2, "t", 2_500), Verdict::Wait);
    let sent = rig.host.sent.borrow().clone();
    let returns: Vec<_> = sent
        .iter()
        .filter(|(_, p, _, _)| p == RETURNS_PATH)
        .collect();
    assert_eq!(returns.len(), 1);
    let body: tollgate_core::protocol::ReturnBatch = serde_json::from_slice(&returns[0].2).unwrap();
    assert_eq!(body.returns[0].unused, 3);
    assert_eq!(body.returns[0].key, "t");
    rig.answer_all(2_501);
    assert_eq!(sink::value("tollgate_tokens_returned.policy.g"), 3);
}

/// The lease callouts in flight, as sent.
fn leases_sent(rig: &Rig) -> Vec<LeaseBatch> {
    rig.host
        .sent
        .borrow()
        .iter()
        .filter(|(_, p, _, _)| p == LEASES_PATH)
        .map(|(_, _, body, _)| serde_json::from_slice(body).unwrap())
        .collect()
}

/// The return callouts in flight, as sent.
fn returns_sent(rig: &Rig) -> Vec<tollgate_core::protocol::ReturnBatch> {
    rig.host
        .sent
        .borrow()
        .iter()
        .filter(|(_, p, _, _)| p == RETURNS_PATH)
        .map(|(_, _, body, _)| serde_json::from_slice(body).unwrap())
        .collect()
}

#[test]
fn the_tick_returns_an_expired_lease_without_another_request() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    rig.answer_all(0);
    assert_eq!(rig.worker.watching(), 1);
    // 4 granted, 1 spent, expiring at 2 s: nothing goes back before then.
    rig.tick(1_999);
    assert!(returns_sent(&rig).is_empty());
    assert_eq!(rig.host.tick.get(), RETURN_TICK_MS);
    // The key gets no more requests: the tick alone returns the 3 unspent tokens.
    rig.tick(2_050);
    let returns = returns_sent(&rig);
    assert_eq!(returns.len(), 1);
    assert_eq!(returns[0].returns[0].unused, 3);
    assert_eq!(returns[0].returns[0].key, "t");
    assert_eq!(returns[0].returns[0].policy, "g");
    rig.answer_all(2_051);
    assert_eq!(sink::value("tollgate_tokens_returned.policy.g"), 3);
    assert_eq!(sink::value("tollgate_tokens_expired.policy.g"), 0);
    assert_eq!(rig.worker.watching(), 0);
    assert_eq!(rig.host.tick.get(), 0, "tick off once nothing is held");
    // The tokens left the record: a later request asks afresh, returning nothing twice.
    assert_eq!(rig.request(2, "t", 2_100), Verdict::Wait);
    assert!(returns_sent(&rig).is_empty());
}

#[test]
fn a_lease_is_returned_once_whoever_finds_it_expired() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    rig.answer_all(0);
    // Another worker of the instance watches the same key (as if it had credited it).
    let mut other = Worker::new(0xabc, 2);
    let plan = rig.plan("t");
    let m = &plan.enforced[0];
    other.watch(m.index, m.key(), &m.bucket_id, 2_000);
    other.tick(&rig.ctx(2_010));
    rig.tick(2_020);
    // A request of the key after both: its lease is gone, it returns nothing either.
    assert_eq!(rig.request(2, "t", 2_030), Verdict::Wait);
    let returns = returns_sent(&rig);
    assert_eq!(returns.len(), 1, "one return of the lease in all");
    assert_eq!(returns[0].returns[0].unused, 3);
    assert_eq!(rig.worker.watching(), 0);
    assert_eq!(other.watching(), 0);
}

#[test]
fn a_renewed_lease_is_watched_until_its_new_expiry() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    rig.answer_all(0);
    let plan = rig.plan("t");
    let m = plan.enforced[0].clone();
    let first = rig
        .engine
        .table()
        .update(StoreAt::new(&rig.store, 1_000), &m.bucket_id, |record| {
            record.lease.seq
        })
        .unwrap();
    // Another worker's answer renews the lease at 1.5 s (5 more tokens, expiring at 3.5 s):
    // the first lease's 3 unspent tokens merge with them.
    let need = need_of(&m, false, 1_500);
    let grant = LeaseGranted {
        id: global::lease_id(0xabc, 77),
        granted: 5,
        remaining: 0.0,
        retry_after_ms: 0,
        expires_ms: 2_000,
        share_per_s: 0.0,
        period_ms: 0,
    };
    let displaced = rig
        .engine
        .credit(StoreAt::new(&rig.store, 1_500), &need, &grant, 77, true)
        .unwrap();
    assert_eq!(displaced, None);
    // The watch at 2 s finds the first lease expired: its 3 tokens go back under its id, and
    // the renewed lease stays until its own expiry.
    rig.tick(2_050);
    let returns = returns_sent(&rig);
    assert_eq!(returns.len(), 1);
    assert_eq!(returns[0].returns.len(), 1);
    assert_eq!(returns[0].returns[0].unused, 3);
    assert_eq!(returns[0].returns[0].id, global::lease_id(0xabc, first));
    assert_eq!(rig.worker.watching(), 1, "a live lease stays watched");
    rig.answer_all(2_051);
    rig.tick(3_550);
    let returns = returns_sent(&rig);
    assert_eq!(returns.len(), 1);
    // Then what the latest lease granted goes back under its id; nothing expires.
    assert_eq!(returns[0].returns.len(), 1);
    assert_eq!(returns[0].returns[0].unused, 5);
    assert_eq!(returns[0].returns[0].id, global::lease_id(0xabc, 77));
    rig.answer_all(3_551);
    assert_eq!(sink::value("tollgate_tokens_returned.policy.g"), 8);
    assert_eq!(sink::value("tollgate_tokens_expired.policy.g"), 0);
    assert_eq!(rig.worker.watching(), 0);
}

#[test]
fn refills_merged_into_a_lease_return_every_unspent_token_under_its_lease_id() {
    let rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    let plan = rig.plan("t");
    let m = plan.enforced[0].clone();
    let need = need_of(&m, false, 0);
    let grant = |granted| LeaseGranted {
        id: String::new(),
        granted,
        remaining: 0.0,
        retry_after_ms: 0,
        expires_ms: 2_000,
        share_per_s: 0.0,
        period_ms: 0,
    };
    let spend = |rig: &Rig, units: u64, now: u64| {
        rig.engine
            .table()
            .update(StoreAt::new(&rig.store, now), &m.bucket_id, |record| {
                record.lease.tokens -= units;
            })
            .unwrap();
    };
    // A big lease, mostly unspent when a small refill merges into it.
    rig.engine
        .credit(StoreAt::new(&rig.store, 0), &need, &grant(10), 1, true)
        .unwrap();
    spend(&rig, 3, 10);
    let displaced = rig
        .engine
        .credit(StoreAt::new(&rig.store, 100), &need, &grant(2), 2, true)
        .unwrap();
    assert_eq!(displaced, None, "two lease ids are kept");
    // The oldest tokens are spent first: 4 of lease 1's 7.
    spend(&rig, 4, 200);
    // Lease 2 expires at 2.1 s, lease 1 at 2 s: a request after both takes everything.
    let d = rig
        .engine
        .decide(&plan, StoreAt::new(&rig.store, 2_200), Attempt::default());
    let mut returned: Vec<_> = d.returns.iter().map(|r| (r.seq, r.unused)).collect();
    returned.sort_unstable();
    assert_eq!(returned, vec![(1, 3), (2, 2)]);
    assert!(d.expired.is_empty(), "nothing expires: {:?}", d.expired);
    // A third lease while two are unspent: the oldest one's part goes back at once.
    rig.engine
        .credit(StoreAt::new(&rig.store, 3_000), &need, &grant(10), 3, true)
        .unwrap();
    rig.engine
        .credit(StoreAt::new(&rig.store, 3_100), &need, &grant(1), 4, true)
        .unwrap();
    let displaced = rig
        .engine
        .credit(StoreAt::new(&rig.store, 3_200), &need, &grant(1), 5, true)
        .unwrap()
        .map(|r| (r.seq, r.unused));
    assert_eq!(displaced, Some((3, 10)));
}

#[test]
fn one_tick_takes_back_a_bounded_number_of_leases() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    let total = MAX_RETURNS_PER_TICK + 4;
    for i in 0..total {
        rig.worker
            .watch(0, &format!("k{i}"), &format!("g:k{i}"), 10);
    }
    rig.tick(20);
    assert_eq!(rig.worker.watching(), 4, "the rest wait for the next tick");
    rig.tick(120);
    assert_eq!(rig.worker.watching(), 0);
    // None of these keys holds a lease: nothing to return.
    assert!(returns_sent(&rig).is_empty());
}

#[test]
fn an_unknown_cluster_is_unavailable_not_a_hang() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    rig.host.refuse_dispatch.set(true);
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    assert_eq!(rig.host.replied.borrow().as_slice(), &[(1, 503)]);
    assert_eq!(rig.worker.waiting(), 0);
}

#[test]
fn requests_waiting_for_a_key_are_served_in_few_callouts_and_never_refused() {
    // Batching off (lease_max 1). Five requests arrive while the first callout is in flight;
    // it brings one token. The other four wait for one more callout that asks for all of them —
    // not a 429 each, and not four callouts.
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 1));
    for context in 1..=5 {
        assert_eq!(rig.request(context, "t", 0), Verdict::Wait);
    }
    assert_eq!(rig.host.sent.borrow().len(), 1);
    rig.answer_all(1);
    assert_eq!(rig.host.resumed.borrow().len(), 1);
    let second: LeaseBatch = serde_json::from_slice(&rig.host.sent.borrow()[0].2).unwrap();
    assert_eq!((second.leases[0].min, second.leases[0].want), (1, 4));
    rig.answer_all(2);
    let mut resumed = rig.host.resumed.borrow().clone();
    resumed.sort();
    assert_eq!(resumed, vec![1, 2, 3, 4, 5]);
    assert!(rig.host.replied.borrow().is_empty());
}

#[test]
fn a_lease_whose_answer_was_lost_is_asked_again_under_its_id() {
    // The limiter applies the lease but the answer never arrives (Envoy times the callout out).
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    rig.limiter.capacity = 10;
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    let (token, _, body, _) = rig.host.sent.borrow_mut().remove(0);
    let first: LeaseBatch = serde_json::from_slice(&body).unwrap();
    let _applied_but_lost = rig.limiter.answer(&body, 0);
    rig.complete(token, Some(504), b"", 30);
    // Retried once at once under the same id; that answer is lost too.
    let (token, _, body, _) = rig.host.sent.borrow_mut().remove(0);
    let retried: LeaseBatch = serde_json::from_slice(&body).unwrap();
    assert_eq!(retried.leases[0].id, first.leases[0].id);
    assert_eq!(sink::value("tollgate_callout_retries"), 1);
    rig.complete(token, Some(504), b"", 31);
    assert_eq!(rig.host.replied.borrow().as_slice(), &[(1, 503)]);
    // After the backoff, the next request for the key asks again with the same id, and the
    // limiter's dedup record hands over what it granted the first time.
    assert_eq!(rig.request(2, "t", 600), Verdict::Wait);
    let again: LeaseBatch = serde_json::from_slice(&rig.host.sent.borrow()[0].2).unwrap();
    assert_eq!(again.leases[0].id, first.leases[0].id);
    rig.answer_all(601);
    assert_eq!(rig.host.resumed.borrow().as_slice(), &[2]);
    assert_eq!(sink::value("tollgate_tokens_granted.policy.g"), 4);
    // Settled: the next lease has a new id.
    for i in 0..4 {
        let _ = rig.request(10 + i, "t", 602);
        rig.answer_all(603);
    }
    let ids: Vec<String> = rig.limiter.seen.borrow().keys().cloned().collect();
    assert!(ids.len() >= 2, "{ids:?}");
}

/// 50 units/s, burst 15, a lease of up to a second of demand.
const FIFTY_PER_S: &str = r#"{"policies":[{"name":"g","key":[{"header":"x-tenant-id"}],"rate":{"units":50,"per":"1s"},"burst":15,
    "scope":"global","on_unavailable":{"mode":"closed"}}],
    "limiter":{"cluster":"limiter","timeout":"25ms"}}"#;

fn assigning_rig() -> Rig {
    let mut rig = Rig::new(FIFTY_PER_S);
    rig.limiter.assigning = Some((
        Limits::new(50, 1_000, 15).unwrap(),
        Terms {
            period_ms: 1_000,
            lease_ttl_ms: 2_000,
        },
    ));
    rig
}

fn lease_callouts(rig: &Rig) -> usize {
    leases_sent(rig).len()
}

#[test]
fn overload_is_decided_locally_against_an_assignment() {
    // 200 requests/s (4x the rate) for 4 s, answered at once: admitted within the global
    // bound, denials local (no callout), one renewal per period after the first second.
    let mut rig = assigning_rig();
    let (mut admitted, mut denied) = (0u64, 0u64);
    let mut callouts_after_first_second = 0;
    let mut retry_after = Vec::new();
    for i in 0..800u32 {
        let now = 1_000 + u64::from(i) * 5;
        match rig.request(i + 1, "t", now) {
            Verdict::Continue => admitted += 1,
            Verdict::Reply(reply) => {
                assert_eq!(reply.status, 429);
                denied += 1;
                let (_, v) = reply
                    .headers
                    .iter()
                    .find(|(k, _)| k == "retry-after")
                    .unwrap();
                retry_after.push(v.parse::<u64>().unwrap());
            }
            Verdict::Wait => {}
        }
        if now >= 2_000 {
            callouts_after_first_second += lease_callouts(&rig);
        }
        rig.answer_all(now);
    }
    admitted += rig.host.resumed.borrow().len() as u64;
    denied += rig
        .host
        .replied
        .borrow()
        .iter()
        .filter(|(_, s)| *s == 429)
        .count() as u64;
    // Over 4 s: at most burst + rate·t = 15 + 200; at least 95 % of rate·t.
    assert!(admitted <= 215, "admitted {admitted}");
    assert!(admitted >= 190, "admitted {admitted}");
    assert_eq!(admitted + denied, 800);
    // One renewal per period (and a little): about 1.33/s over 3 s.
    assert!(
        callouts_after_first_second <= 3 * 3,
        "{callouts_after_first_second} lease callouts in 3 s"
    );
    assert!(sink::value("tollgate_assignments.policy.g") >= 3);
    // Retry-After is this instance's next chance at its share (a token every 20 ms).
    assert!(retry_after.iter().all(|s| *s <= 1), "{retry_after:?}");
}

#[test]
fn a_slow_callout_is_retried_once_and_the_key_stays_healthy() {
    let mut rig = assigning_rig();
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    // The limiter answers too late: Envoy times the callout out; the filter asks again with
    // the same id at once, with the full timeout.
    let (token, _, body, _) = rig.host.sent.borrow_mut().remove(0);
    let first: LeaseBatch = serde_json::from_slice(&body).unwrap();
    rig.complete(token, Some(504), b"", 25);
    let (_, _, retry, timeout) = rig.host.sent.borrow()[0].clone();
    let retry: LeaseBatch = serde_json::from_slice(&retry).unwrap();
    assert_eq!(retry.leases[0].id, first.leases[0].id);
    assert_eq!(timeout, 25);
    // The first request's own deadline passes: it alone takes the failure mode.
    rig.tick(35);
    assert_eq!(rig.host.replied.borrow().as_slice(), &[(1, 503)]);
    // Requests arriving meanwhile wait for the retry instead of failing or asking again.
    assert_eq!(rig.request(2, "t", 36), Verdict::Wait);
    assert_eq!(rig.request(3, "t", 37), Verdict::Wait);
    assert_eq!(lease_callouts(&rig), 1);
    rig.answer_all(40);
    let mut resumed = rig.host.resumed.borrow().clone();
    resumed.sort();
    assert_eq!(resumed, vec![2, 3]);
    assert_eq!(sink::value("tollgate_fail_closed.policy.g"), 1);
    assert_eq!(sink::value("tollgate_lease_unavailable.policy.g"), 0);
}

#[test]
fn one_request_per_instance_asks_for_a_key_and_other_workers_wait_for_it() {
    let mut rig = assigning_rig();
    let mut other = Worker::new(0xabc, 2);
    assert_eq!(rig.request(1, "t", 0), Verdict::Wait);
    assert_eq!(lease_callouts(&rig), 1);
    // The second worker's request finds the key being asked for: it waits, asking nothing.
    let plan = rig.plan("t");
    let decision = rig
        .engine
        .decide(&plan, StoreAt::new(&rig.store, 1), Attempt::default());
    assert_eq!(decision.verdict, Verdict::Wait);
    assert!(decision.needs.is_empty());
    assert!(other.wait(9, plan, &decision, 36, Default::default()));
    rig.answer_all(2);
    assert_eq!(rig.host.resumed.borrow().as_slice(), &[1]);
    // Its tick looks at the shared record again and finds the lease.
    other.tick(&rig.ctx(7));
    assert_eq!(rig.host.resumed.borrow().as_slice(), &[1, 9]);
    assert_eq!(other.waiting(), 0);
}

#[test]
fn a_late_denial_never_hides_tokens_the_instance_holds() {
    let rig = assigning_rig();
    let plan = rig.plan("t");
    let m = &plan.enforced[0];
    let need = need_of(m, true, 0);
    let grant = LeaseGranted {
        id: "a".into(),
        granted: 1,
        remaining: 0.0,
        retry_after_ms: 0,
        expires_ms: 2_000,
        share_per_s: 0.0,
        period_ms: 0,
    };
    rig.engine
        .credit(StoreAt::new(&rig.store, 0), &need, &grant, 1, true)
        .unwrap();
    let denial = LeaseGranted {
        id: "b".into(),
        granted: 0,
        retry_after_ms: 720_000,
        ..grant
    };
    rig.engine
        .credit(StoreAt::new(&rig.store, 1), &need, &denial, 2, true)
        .unwrap();
    let d = rig
        .engine
        .decide(&plan, StoreAt::new(&rig.store, 2), Attempt::default());
    assert_eq!(d.verdict, Verdict::Continue);
}

#[test]
fn settled_units_ride_on_the_next_callout_of_global_policies_only() {
    let mut rig = Rig::new(&policy(r#"{"mode":"open"}"#, 100));
    rig.worker.note_settled(0, 30);
    rig.worker.note_settled(0, 12);
    // A local policy index (none here) or an unknown one is never reported.
    rig.worker.note_settled(7, 5);
    assert_eq!(rig.request(1, "acme", 0), Verdict::Wait);
    let sent = rig.host.sent.borrow().clone();
    let batch: LeaseBatch = serde_json::from_slice(&sent[0].2).unwrap();
    assert_eq!(
        batch.settled.into_iter().collect::<Vec<_>>(),
        vec![("g".to_string(), 42)]
    );
    // Reported once: the next callout carries nothing until more is settled.
    rig.answer_all(1);
    assert_eq!(rig.request(2, "other", 2), Verdict::Wait);
    let sent = rig.host.sent.borrow().clone();
    let batch: LeaseBatch = serde_json::from_slice(&sent[0].2).unwrap();
    assert!(batch.settled.is_empty());
    // A callout that cannot be sent keeps the count for the next one.
    rig.answer_all(3);
    rig.worker.note_settled(0, 8);
    rig.host.refuse_dispatch.set(true);
    rig.request(3, "third", 4);
    rig.host.refuse_dispatch.set(false);
    rig.request(4, "fourth", 600);
    let sent = rig.host.sent.borrow().clone();
    let batch: LeaseBatch = serde_json::from_slice(&sent[0].2).unwrap();
    assert_eq!(batch.settled.get("g"), Some(&8));
}

#[test]
fn shaped_requests_sleep_until_their_turn_and_wake_in_order() {
    let mut rig = Rig::new(&policy(r#"{"mode":"open"}"#, 100));
    let host = FakeHost::default();
    for (context, wake) in [(7, 300), (5, 100), (6, 200)] {
        assert!(rig
            .worker
            .sleep(context, wake, vec!["g:a".into()], Default::default(), &host));
    }
    assert_eq!(
        host.tick.get(),
        TICK_MS,
        "the tick runs while someone sleeps"
    );
    assert_eq!(rig.worker.sleeping("g:a"), 3);
    assert_eq!(rig.worker.sleeping("g:b"), 0);
    rig.tick(150);
    assert_eq!(*rig.host.resumed.borrow(), vec![5]);
    rig.tick(1_000);
    assert_eq!(*rig.host.resumed.borrow(), vec![5, 6, 7]);
    assert_eq!(rig.worker.sleeping("g:a"), 0);
    // A request gone before its turn is forgotten, never resumed.
    assert!(rig
        .worker
        .sleep(9, 2_000, vec!["g:a".into()], Default::default(), &host));
    rig.worker.forget(9);
    rig.tick(3_000);
    assert_eq!(*rig.host.resumed.borrow(), vec![5, 6, 7]);
    // The worker pauses at most MAX_WAITERS requests.
    for context in 0..MAX_WAITERS as u32 {
        assert!(rig
            .worker
            .sleep(100 + context, 9_000, vec![], Default::default(), &host));
    }
    assert!(!rig
        .worker
        .sleep(1, 9_000, vec![], Default::default(), &host));
}

/// A lease ask of `m`'s key (at least 1, up to 5 tokens, at 1 per second of demand).
fn need_of(m: &crate::engine::Matched, blocking: bool, asked_ms: u64) -> LeaseNeed {
    LeaseNeed {
        policy: m.index,
        key: m.key().to_owned(),
        bucket_id: m.bucket_id.clone(),
        min: 1,
        want: 5,
        demand_per_s: 1.0,
        blocking,
        may_linger: false,
        asked_ms,
    }
}

/// A background refill of `m`'s key asked at `asked_ms`, free to linger.
fn refill_of(m: &crate::engine::Matched, asked_ms: u64) -> LeaseNeed {
    LeaseNeed {
        may_linger: true,
        ..need_of(m, false, asked_ms)
    }
}

/// The keys of every lease callout in flight, callout by callout.
fn lease_keys(rig: &Rig) -> Vec<Vec<String>> {
    leases_sent(rig)
        .into_iter()
        .map(|batch| batch.leases.into_iter().map(|l| l.key).collect())
        .collect()
}

#[test]
fn refills_linger_for_company_then_share_one_callout() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    let a = rig.plan("a").enforced[0].clone();
    let b = rig.plan("b").enforced[0].clone();
    rig.worker.queued.push(refill_of(&a, 1_000));
    rig.flush(1_000);
    assert!(lease_keys(&rig).is_empty(), "a refill waits for company");
    assert_eq!(rig.host.tick.get(), TICK_MS, "the tick sends it later");
    rig.worker.queued.push(refill_of(&b, 1_004));
    rig.tick(1_000 + REFILL_LINGER_MS - 1);
    assert!(lease_keys(&rig).is_empty(), "still lingering");
    rig.tick(1_000 + REFILL_LINGER_MS);
    assert_eq!(
        lease_keys(&rig),
        vec![vec!["a".to_string(), "b".to_string()]]
    );
    rig.answer_all(1_000 + REFILL_LINGER_MS + 1);
    assert_eq!(
        rig.host.tick.get(),
        RETURN_TICK_MS,
        "nothing queued: the slow tick"
    );
    assert_eq!(sink::value("tollgate_tokens_granted.policy.g"), 10);
}

#[test]
fn a_request_that_waits_takes_lingering_refills_along() {
    let mut rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    let a = rig.plan("a").enforced[0].clone();
    rig.worker.queued.push(refill_of(&a, 2_000));
    rig.flush(2_000);
    assert!(lease_keys(&rig).is_empty());
    // Key c has no lease: its request waits, and its callout carries a's refill at once.
    assert_eq!(rig.request(20, "c", 2_001), Verdict::Wait);
    assert_eq!(
        lease_keys(&rig),
        vec![vec!["a".to_string(), "c".to_string()]]
    );
    rig.answer_all(2_002);
    assert_eq!(*rig.host.resumed.borrow(), vec![20]);
}

#[test]
fn only_a_refill_with_tokens_left_lingers_and_the_key_asks_once_meanwhile() {
    let rig = Rig::new(&policy(r#"{"mode":"closed"}"#, 100));
    let plan = rig.plan("t");
    let m = plan.enforced[0].clone();
    let grant = LeaseGranted {
        id: String::new(),
        granted: 100,
        remaining: 0.0,
        retry_after_ms: 0,
        expires_ms: 60_000,
        share_per_s: 0.0,
        period_ms: 0,
    };
    let at = |now| StoreAt::new(&rig.store, now);
    rig.engine
        .credit(at(0), &need_of(&m, true, 0), &grant, 1, true)
        .unwrap();
    let set_tokens = |tokens: u64, now: u64| {
        rig.engine
            .table()
            .update(at(now), &m.bucket_id, |record| record.lease.tokens = tokens)
            .unwrap();
    };
    let pending_until = |now: u64| {
        let mut until = 0;
        rig.engine
            .table()
            .update(at(now), &m.bucket_id, |record| {
                until = record.lease.pending_until_ms
            })
            .unwrap();
        until
    };
    // 25 of 100 left: this request spends one and falls below the low-water mark.
    set_tokens(25, 10);
    let d = rig.engine.decide(&plan, at(20), Attempt::default());
    assert_eq!(d.verdict, Verdict::Continue);
    assert_eq!(d.needs.len(), 1);
    assert!(d.needs[0].may_linger && !d.needs[0].blocking);
    // The key counts as asking for the linger and the callout's whole deadline.
    assert_eq!(
        pending_until(21),
        20 + REFILL_LINGER_MS + 25 + DEADLINE_MARGIN_MS
    );
    let d = rig.engine.decide(&plan, at(22), Attempt::default());
    assert!(
        d.needs.is_empty(),
        "one ask per key at a time: {:?}",
        d.needs
    );
    // The last token spent: the next request would wait, so its refill goes at once.
    set_tokens(1, pending_until(23));
    let now = pending_until(23);
    let d = rig.engine.decide(&plan, at(now), Attempt::default());
    assert_eq!(d.verdict, Verdict::Continue);
    assert_eq!(d.needs.len(), 1);
    assert!(
        !d.needs[0].may_linger,
        "an empty lease's refill does not linger"
    );
    assert_eq!(pending_until(now), now + 25 + DEADLINE_MARGIN_MS);
}
