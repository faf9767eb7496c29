//! Reservation, settlement and in-flight slots, decided against an in-memory shared table.

use super::*;
use crate::request::{RequestFacts, RequestSource};
use crate::shared::MemorySharedData;
use crate::table::SlotTable;
use std::collections::HashMap;
use tollgate_core::protocol::LeaseGranted;

#[derive(Default)]
struct Req(HashMap<String, Vec<u8>>);

impl RequestSource for Req {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.0.get(name).cloned()
    }
    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

fn req(headers: &[(&str, &str)]) -> Req {
    Req(headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
        .collect())
}

fn facts() -> RequestFacts<'static> {
    RequestFacts {
        method: "POST".into(),
        path: "/v1/chat".into(),
        host: "api".into(),
    }
}

fn engine(policy: &str, limiter: bool) -> (Engine, MemorySharedData) {
    let limiter = if limiter {
        r#","limiter":{"cluster":"l","timeout":"25ms"}"#
    } else {
        ""
    };
    let doc = format!(r#"{{"policies":[{policy}]{limiter}}}"#);
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, 64, 1).unwrap();
    (Engine::new(policies, table), store)
}

/// 1 unit per hour (no refill within a test), burst 1000; reserves `x-estimate` (default 100,
/// within [1, 500]) and settles `x-usage`, debt at most 300.
const LOCAL: &str = r#"{"name":"llm","match":{"routes":["POST /v1/chat"]},
  "key":[{"header":"x-tenant"}],"rate":{"units":1,"per":"1h"},"burst":1000,
  "reserve":{"from":{"header":"x-estimate"},"default":100,"max":500},
  "settle":{"from":{"header":"x-usage"},"max_debt":300}}"#;

fn admit(e: &Engine, store: &MemorySharedData, r: &Req, now: u64) -> Decision {
    e.decide(
        &e.plan(&facts(), r),
        StoreAt::new(store, now),
        Attempt::default(),
    )
}

fn tokens(e: &Engine, store: &MemorySharedData, now: u64) -> f64 {
    e.table()
        .update(StoreAt::new(store, now), "llm:acme", |r| {
            r.bucket.map_or(1000.0, |b| b.tokens)
        })
        .unwrap()
}

#[test]
fn estimates_come_from_the_header_clamped_to_the_policy() {
    let (e, _) = engine(LOCAL, false);
    for (value, reserved) in [
        (Some("40"), 40),
        (Some("12.5"), 13),
        (Some("9999999"), 500),
        (Some("0"), 1),
        (Some("-5"), 100),
        (Some("lots"), 100),
        (None, 100),
    ] {
        let mut headers = vec![("x-tenant", "acme")];
        if let Some(v) = value {
            headers.push(("x-estimate", v));
        }
        let plan = e.plan(&facts(), &req(&headers));
        assert_eq!(plan.enforced[0].cost, reserved, "{value:?}");
        assert!(!plan.needs_body());
    }
}

#[test]
fn unused_units_come_back_and_excess_is_debt_until_repaid() {
    let (e, store) = engine(LOCAL, false);
    let r = req(&[("x-tenant", "acme"), ("x-estimate", "100")]);
    let d = admit(&e, &store, &r, 0);
    assert_eq!(d.verdict, Verdict::Continue);
    let admission = d.admissions[0].clone();
    assert_eq!((admission.reserved, admission.spent), (100, Spent::Bucket));
    assert_eq!(tokens(&e, &store, 0), 900.0);
    // Reserved 100, used 30: 70 come back.
    let done = e
        .finish(
            StoreAt::new(&store, 0),
            &admission,
            Some(Usage::Known(30)),
            true,
        )
        .unwrap();
    assert_eq!((done.settled, done.refunded), (Some(30), 70));
    assert_eq!(tokens(&e, &store, 0), 970.0);
    // Exactly 9 more reservations of 100 fit (970 → 70), the 10th does not.
    let mut last = None;
    for _ in 0..9 {
        let d = admit(&e, &store, &r, 0);
        assert_eq!(d.verdict, Verdict::Continue);
        last = d.admissions.into_iter().next();
    }
    assert!(matches!(
        admit(&e, &store, &r, 0).verdict,
        Verdict::Reply(_)
    ));
    // One of them used 400 (300 over): the bucket goes to 70 - 300 = -230.
    let done = e
        .finish(
            StoreAt::new(&store, 0),
            &last.unwrap(),
            Some(Usage::Known(400)),
            true,
        )
        .unwrap();
    assert_eq!((done.charged, done.uncharged), (300, 0));
    assert_eq!(tokens(&e, &store, 0), -230.0);
    // Refused with a Retry-After that covers the debt: 230 + 100 at 1 unit/hour.
    let Verdict::Reply(reply) = admit(&e, &store, &r, 0).verdict else {
        panic!("admitted in debt");
    };
    assert_eq!(reply.status, 429);
    let retry: u64 = reply
        .headers
        .iter()
        .find(|(k, _)| k == "retry-after")
        .unwrap()
        .1
        .parse()
        .unwrap();
    assert_eq!(retry, 330 * 3_600);
    // Admitted again once refilled past it.
    assert_eq!(
        admit(&e, &store, &r, 330 * 3_600_000).verdict,
        Verdict::Continue
    );
}

#[test]
fn debt_is_bounded_and_a_missing_usage_follows_the_policy() {
    let (e, store) = engine(LOCAL, false);
    let r = req(&[("x-tenant", "acme"), ("x-estimate", "500")]);
    let a = admit(&e, &store, &r, 0).admissions.remove(0);
    let b = admit(&e, &store, &r, 0).admissions.remove(0);
    // 0 tokens left; 1000 over the reservation, 300 charged, 700 uncharged.
    let done = e
        .finish(StoreAt::new(&store, 0), &a, Some(Usage::Known(1_500)), true)
        .unwrap();
    assert_eq!((done.charged, done.uncharged), (300, 700));
    assert_eq!(tokens(&e, &store, 0), -300.0);
    // `keep` (the default): the reservation stands.
    let done = e
        .finish(StoreAt::new(&store, 0), &b, Some(Usage::Missing), true)
        .unwrap();
    assert_eq!(
        (done.settled, done.refunded, done.missing),
        (Some(500), 0, true)
    );
    assert_eq!(tokens(&e, &store, 0), -300.0);

    let refund = LOCAL.replace(
        r#""max_debt":300"#,
        r#""max_debt":300,"on_missing":"refund""#,
    );
    let (e, store) = engine(&refund, false);
    let a = admit(&e, &store, &r, 0).admissions.remove(0);
    let done = e
        .finish(StoreAt::new(&store, 0), &a, Some(Usage::Missing), true)
        .unwrap();
    assert_eq!((done.settled, done.refunded), (Some(0), 500));
    assert_eq!(tokens(&e, &store, 0), 1000.0);
}

#[test]
fn estimates_from_the_body_take_the_default_when_unusable() {
    let policy = r#"{"name":"llm","match":{"routes":["POST /v1/chat"]},
      "key":[{"header":"x-tenant"}],"rate":{"units":1,"per":"1h"},"burst":1000,
      "reserve":{"from":{"body":{"field":"max_tokens","max_bytes":64}},
                 "plus":{"POST /v1/chat":20},"default":300,"min":5,"max":800}}"#;
    let (e, _) = engine(policy, false);
    let r = req(&[("x-tenant", "acme")]);
    let long = format!(r#"{{"max_tokens":40,"pad":"{}"}}"#, "x".repeat(100));
    for (body, cost) in [
        (Some(&br#"{"max_tokens":40}"#[..]), 60),
        (Some(br#"{"max_tokens":4000}"#), 800),
        (Some(br#"{"max_tokens":-1}"#), 320),
        (Some(b"not json"), 320),
        (Some(br#"{"other":1}"#), 320),
        (Some(long.as_bytes()), 320),
        (Some(b""), 320),
        (None, 320),
    ] {
        let mut plan = e.plan(&facts(), &r);
        assert!(plan.needs_body());
        assert_eq!(e.body_bytes_wanted(&plan), 64);
        e.read_body(&mut plan, body);
        assert!(!plan.needs_body());
        assert_eq!(
            plan.enforced[0].cost,
            cost,
            "{:?}",
            body.map(String::from_utf8_lossy)
        );
    }
}

/// At most 2 in flight per tenant, slots expire after 10 s.
const IN_FLIGHT: &str = r#"{"name":"llm","match":{"routes":["POST /v1/chat"]},
  "key":[{"header":"x-tenant"}],"rate":{"units":1000,"per":"1s"},"burst":1000,
  "max_in_flight":2,"in_flight_timeout":"10s"}"#;

#[test]
fn max_in_flight_zero_refuses_every_request() {
    let (e, store) = engine(
        &IN_FLIGHT.replace("\"max_in_flight\":2", "\"max_in_flight\":0"),
        false,
    );
    for now in [1_000, 60_000, 3_600_000] {
        let refused = admit(&e, &store, &req(&[("x-tenant", "acme")]), now);
        let Verdict::Reply(reply) = &refused.verdict else {
            panic!("admitted at {now}");
        };
        assert_eq!(reply.status, 429);
        // No later attempt passes: no Retry-After, and the reason says so.
        assert!(reply.headers.iter().all(|(name, _)| name != "retry-after"));
        assert!(
            reply.body.contains("the policy refuses every request"),
            "{}",
            reply.body
        );
        assert_eq!(
            refused.outcomes.to_vec(),
            vec![(0, Outcome::InFlightDenied)]
        );
    }
}

#[test]
fn in_flight_slots_refuse_release_and_expire() {
    let (e, store) = engine(IN_FLIGHT, false);
    let acme = req(&[("x-tenant", "acme")]);
    let a = admit(&e, &store, &acme, 1_000).admissions.remove(0);
    let b = admit(&e, &store, &acme, 1_000).admissions.remove(0);
    let refused = admit(&e, &store, &acme, 1_000);
    let Verdict::Reply(reply) = &refused.verdict else {
        panic!("third admitted");
    };
    assert_eq!(reply.status, 429);
    assert!(
        reply.body.contains("too many requests in flight"),
        "{}",
        reply.body
    );
    assert_eq!(
        refused.outcomes.to_vec(),
        vec![(0, Outcome::InFlightDenied)]
    );
    // Another tenant has its own slots.
    assert_eq!(
        admit(&e, &store, &req(&[("x-tenant", "b")]), 1_000).verdict,
        Verdict::Continue
    );
    // A release frees one slot (the glue releases each admission once).
    assert!(
        e.finish(StoreAt::new(&store, 2_000), &a, None, true)
            .unwrap()
            .released
    );
    let c = admit(&e, &store, &acme, 2_000).admissions.remove(0);
    assert!(matches!(
        admit(&e, &store, &acme, 2_000).verdict,
        Verdict::Reply(_)
    ));
    // The releases of `b` and `c` (taken at 1 s and 2 s) are late: both still hold their slots
    // at 11 s, 10 s after `b` was taken...
    assert!(matches!(
        admit(&e, &store, &acme, 11_000).verdict,
        Verdict::Reply(_)
    ));
    // ...and have expired by 12.5 s, at most 12.5 s after; the count says so.
    let later = admit(&e, &store, &acme, 12_500);
    assert_eq!(later.verdict, Verdict::Continue);
    assert_eq!(later.slots_expired, vec![(0, 2)]);
    // A release after expiry frees nothing.
    for late in [&b, &c] {
        let done = e
            .finish(StoreAt::new(&store, 12_600), late, None, true)
            .unwrap();
        assert!(!done.released);
        assert_eq!(done.slots_expired, 0);
    }
}

#[test]
fn a_global_lease_takes_refunds_and_pays_debts_first() {
    let policy = LOCAL.replace(r#""burst":1000"#, r#""burst":1000,"scope":"global""#);
    let (e, store) = engine(&policy, true);
    let r = req(&[("x-tenant", "acme"), ("x-estimate", "100")]);
    let plan = e.plan(&facts(), &r);
    let d = admit(&e, &store, &r, 0);
    assert_eq!(d.verdict, Verdict::Wait);
    let grant = |granted| LeaseGranted {
        id: "x".into(),
        granted,
        remaining: 0.0,
        retry_after_ms: 0,
        expires_ms: 60_000,
        share_per_s: 0.0,
        period_ms: 0,
    };
    e.credit(StoreAt::new(&store, 0), &d.needs[0], &grant(150), 1, true)
        .unwrap();
    let d = e.decide(
        &plan,
        StoreAt::new(&store, 1),
        Attempt {
            round: 1,
            deadline_passed: false,
        },
    );
    assert_eq!(d.verdict, Verdict::Continue);
    assert_eq!(d.admissions[0].spent, Spent::Lease);
    let lease = |now| {
        e.table()
            .update(StoreAt::new(&store, now), "llm:acme", |rec| {
                (rec.lease.tokens, rec.lease.debt)
            })
            .unwrap()
    };
    assert_eq!(lease(1), (50, 0));
    // Used 20: 80 back to this instance's lease.
    let done = e
        .finish(
            StoreAt::new(&store, 2),
            &d.admissions[0],
            Some(Usage::Known(20)),
            true,
        )
        .unwrap();
    assert_eq!(done.refunded, 80);
    assert_eq!(lease(2), (130, 0));
    // Another used 400 (300 over): the lease pays 30 of it, 270 stay as debt.
    let d = admit(&e, &store, &r, 3);
    let done = e
        .finish(
            StoreAt::new(&store, 3),
            &d.admissions[0],
            Some(Usage::Known(400)),
            true,
        )
        .unwrap();
    assert_eq!(done.charged, 300);
    assert_eq!(lease(3), (0, 270));
    // In debt: refused at once, and a lease for the debt plus the cost is asked in the
    // background (once the refill the last admission asked for is no longer pending).
    let d = admit(&e, &store, &r, 100);
    assert!(matches!(d.verdict, Verdict::Reply(ref reply) if reply.status == 429));
    assert_eq!(d.needs.len(), 1);
    assert!(!d.needs[0].blocking);
    assert_eq!(d.needs[0].min, 370);
    // The grant pays the debt first; what is left is spent.
    e.credit(StoreAt::new(&store, 101), &d.needs[0], &grant(400), 2, true)
        .unwrap();
    assert_eq!(lease(101), (130, 0));
    assert_eq!(admit(&e, &store, &r, 102).verdict, Verdict::Continue);
}
