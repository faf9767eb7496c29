use super::*;
use crate::request::{RequestFacts, RequestSource};
use crate::shared::MemorySharedData;
use crate::table::SlotTable;
use std::collections::HashMap;
use tollgate_core::response::LocalReply;

#[derive(Default)]
struct Req {
    headers: HashMap<String, Vec<u8>>,
}

impl RequestSource for Req {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.headers.get(name).cloned()
    }
    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

fn tenant(id: &str) -> Req {
    let mut req = Req::default();
    req.headers
        .insert("x-tenant-id".into(), id.as_bytes().to_vec());
    req
}

fn facts(method: &str, path: &str) -> RequestFacts<'static> {
    RequestFacts {
        method: method.to_string().into(),
        path: path.to_string().into(),
        host: "api.example.com".into(),
    }
}

/// Decides a fresh request (first attempt).
fn eval(
    e: &Engine,
    facts: &RequestFacts<'_>,
    req: &Req,
    store: &MemorySharedData,
    now: u64,
) -> Evaluated {
    let d = e.decide(
        &e.plan(facts, req),
        StoreAt::new(store, now),
        Attempt::default(),
    );
    Evaluated {
        reply: match &d.verdict {
            Verdict::Reply(r) => Some(r.clone()),
            _ => None,
        },
        response_headers: d.response_headers.clone(),
        outcomes: d.outcomes.to_vec(),
        table_error: d.table_error,
        decision: d,
    }
}

struct Evaluated {
    reply: Option<LocalReply>,
    response_headers: Vec<(String, String)>,
    outcomes: Vec<(usize, Outcome)>,
    table_error: Option<TableError>,
    #[allow(dead_code)]
    decision: Decision,
}

fn engine(doc: &str, store: &MemorySharedData, slots: u32) -> Engine {
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    let table = SlotTable::open(store, SHARED_PREFIX, slots, 1).unwrap();
    Engine::new(policies, table)
}

const PAYMENTS: &str = include_str!("../../../../policies/payments.json");

fn header<'a>(reply: &'a LocalReply, name: &str) -> &'a str {
    reply
        .headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap()
}

#[test]
fn payments_transfers_cost_five_and_the_429_is_complete() {
    let store = MemorySharedData::default();
    let e = engine(PAYMENTS, &store, 64);
    let transfer = facts("POST", "/payments/transfers");
    for _ in 0..4 {
        let ev = eval(&e, &transfer, &tenant("acme"), &store, 1_000);
        assert_eq!(ev.reply, None);
        assert_eq!(ev.outcomes.to_vec(), vec![(0, Outcome::Allowed)]);
        assert!(
            header_of(&ev.response_headers, "ratelimit").starts_with("\"payments-per-tenant\";r=")
        );
    }
    let ev = eval(&e, &transfer, &tenant("acme"), &store, 1_000);
    let reply = ev.reply.unwrap();
    assert_eq!(reply.status, 429);
    assert_eq!(header(&reply, "retry-after"), "1");
    assert_eq!(
        header(&reply, "ratelimit-policy"),
        "\"payments-per-tenant\";q=100;w=1"
    );
    assert_eq!(
        header(&reply, "ratelimit"),
        "\"payments-per-tenant\";r=0;t=1"
    );
    assert_eq!(
        reply.body,
        r#"{"error":"rate limit exceeded","policy":"payments-per-tenant","retry_after_seconds":1}"#
    );
    assert!(!reply.body.contains("acme"));
    assert_eq!(ev.outcomes.to_vec(), vec![(0, Outcome::Denied)]);
    // A status lookup (1 unit) is also refused until tokens refill (10 ms per unit).
    let lookup = facts("GET", "/payments/transfers/tx-9");
    assert!(eval(&e, &lookup, &tenant("acme"), &store, 1_000)
        .reply
        .is_some());
    assert!(eval(&e, &lookup, &tenant("acme"), &store, 1_010)
        .reply
        .is_none());
}

fn header_of<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap()
}

#[test]
fn tenants_never_share_state_and_unmatched_requests_create_nothing() {
    let store = MemorySharedData::default();
    let e = engine(PAYMENTS, &store, 64);
    let transfer = facts("POST", "/payments/transfers");
    for _ in 0..4 {
        assert!(eval(&e, &transfer, &tenant("a"), &store, 0).reply.is_none());
    }
    assert!(eval(&e, &transfer, &tenant("a"), &store, 0).reply.is_some());
    assert!(eval(&e, &transfer, &tenant("b"), &store, 0).reply.is_none());
    let before = store.bytes();
    for path in ["/payments/other", "/payments/transfers/1/x", "/"] {
        let ev = eval(&e, &facts("POST", path), &tenant("c"), &store, 0);
        assert!(ev.outcomes.is_empty() && ev.reply.is_none());
    }
    let other_host = RequestFacts {
        host: "evil.example.com".into(),
        ..transfer
    };
    assert!(eval(&e, &other_host, &tenant("c"), &store, 0)
        .outcomes
        .is_empty());
    assert_eq!(store.bytes(), before);
}

#[test]
fn missing_identity_denies_with_403_skips_or_goes_anonymous() {
    let store = MemorySharedData::default();
    let e = engine(PAYMENTS, &store, 64);
    let ev = eval(
        &e,
        &facts("POST", "/payments/transfers"),
        &Req::default(),
        &store,
        0,
    );
    assert_eq!(ev.reply.unwrap().status, 403);
    assert_eq!(ev.outcomes.to_vec(), vec![(0, Outcome::IdentityMissing)]);

    let skip = PAYMENTS.replace("\"deny\"", "\"skip\"");
    let e = engine(&skip, &store, 64);
    let ev = eval(
        &e,
        &facts("POST", "/payments/transfers"),
        &Req::default(),
        &store,
        0,
    );
    assert!(ev.reply.is_none() && ev.outcomes.is_empty());

    let anonymous = PAYMENTS.replace("\"deny\"", "\"anonymous\"");
    let store = MemorySharedData::default();
    let e = engine(&anonymous, &store, 64);
    for _ in 0..4 {
        assert!(eval(
            &e,
            &facts("POST", "/payments/transfers"),
            &Req::default(),
            &store,
            0
        )
        .reply
        .is_none());
    }
    // All anonymous requests share one bucket...
    assert!(eval(
        &e,
        &facts("POST", "/payments/transfers"),
        &Req::default(),
        &store,
        0
    )
    .reply
    .is_some());
    // ...which no tenant can name.
    assert!(eval(
        &e,
        &facts("POST", "/payments/transfers"),
        &tenant("!anonymous"),
        &store,
        0
    )
    .reply
    .is_none());
}

#[test]
fn shadow_mode_admits_and_counts() {
    let store = MemorySharedData::default();
    let shadow = PAYMENTS.replace("\"enforce\": true", "\"enforce\": false");
    let e = engine(&shadow, &store, 64);
    let mut shadow_denied = 0;
    for _ in 0..10 {
        let ev = eval(
            &e,
            &facts("POST", "/payments/transfers"),
            &tenant("a"),
            &store,
            0,
        );
        assert!(ev.reply.is_none());
        if ev.outcomes == vec![(0, Outcome::ShadowDenied)] {
            shadow_denied += 1;
        }
    }
    assert_eq!(shadow_denied, 6);
}

const TWO_POLICIES: &str = r#"{"policies":[
  {"name":"tenant-wide","key":[{"header":"x-tenant-id"}],"rate":{"units":1,"per":"1h"},"burst":10},
  {"name":"exports","match":{"routes":["POST /exports"]},"key":[{"header":"x-tenant-id"},"route"],
   "rate":{"units":1,"per":"1h"},"burst":2}
]}"#;

#[test]
fn two_policies_are_all_or_nothing() {
    let store = MemorySharedData::default();
    let e = engine(TWO_POLICIES, &store, 64);
    let export = facts("POST", "/exports");
    assert!(eval(&e, &export, &tenant("a"), &store, 0).reply.is_none());
    assert!(eval(&e, &export, &tenant("a"), &store, 0).reply.is_none());
    let ev = eval(&e, &export, &tenant("a"), &store, 0);
    let reply = ev.reply.unwrap();
    assert_eq!(reply.status, 429);
    assert!(reply.body.contains("\"policy\":\"exports\""));
    assert_eq!(ev.outcomes.to_vec(), vec![(1, Outcome::Denied)]);
    // Denied exports took nothing tenant-wide: 8 more other requests pass.
    for _ in 0..8 {
        assert!(eval(&e, &facts("GET", "/x"), &tenant("a"), &store, 0)
            .reply
            .is_none());
    }
    assert!(eval(&e, &facts("GET", "/x"), &tenant("a"), &store, 0)
        .reply
        .is_some());
}

#[test]
fn a_full_table_applies_the_failure_mode() {
    let closed = PAYMENTS.to_string();
    let open = PAYMENTS.replace("{ \"mode\": \"closed\" }", "{ \"mode\": \"open\" }");
    assert_ne!(closed, open);
    for (doc, expect_closed) in [(closed, true), (open, false)] {
        let store = MemorySharedData::default();
        let e = engine(&doc, &store, 16);
        let transfer = facts("POST", "/payments/transfers");
        let mut undecided = 0;
        for t in 0..200 {
            let ev = eval(&e, &transfer, &tenant(&t.to_string()), &store, 0);
            if ev.table_error.is_some() {
                undecided += 1;
                assert_eq!(ev.table_error, Some(TableError::Full));
                if expect_closed {
                    assert_eq!(ev.reply.as_ref().unwrap().status, 503);
                    assert_eq!(ev.outcomes.to_vec(), vec![(0, Outcome::FailClosed)]);
                } else {
                    assert!(ev.reply.is_none());
                    assert_eq!(ev.outcomes.to_vec(), vec![(0, Outcome::FailOpen)]);
                }
            }
        }
        assert_eq!(undecided, 200 - 16);
    }
}

/// Two plans on one route, told apart by a header condition; the key's own header decides
/// nothing about which policy applies.
const PLANS: &str = r#"{"policies":[
    {"name":"free","match":{"routes":["GET /items/{id}"]},
     "when":[{"header":"x-plan","equals":"free"}],
     "key":[{"header":"x-tenant-id"}],"on_missing_key":"deny",
     "rate":{"units":1,"per":"1h"},"burst":2},
    {"name":"pro","match":{"routes":["GET /items/{id}"]},
     "when":[{"header":"x-plan","in":["pro","team"]}],
     "key":[{"header":"x-tenant-id"}],"on_missing_key":"deny",
     "rate":{"units":1,"per":"1h"},"burst":5}
]}"#;

fn on_plan(tenant_id: &str, plan: Option<&str>) -> Req {
    let mut req = tenant(tenant_id);
    if let Some(plan) = plan {
        req.headers
            .insert("x-plan".into(), plan.as_bytes().to_vec());
    }
    req
}

#[test]
fn conditions_choose_the_policy_and_a_request_matching_none_is_not_limited_by_them() {
    let store = MemorySharedData::default();
    let e = engine(PLANS, &store, 64);
    let item = facts("GET", "/items/1");
    let admitted = |req: &Req| {
        (0..10)
            .filter(|_| eval(&e, &item, req, &store, 1_000).reply.is_none())
            .count()
    };
    assert_eq!(admitted(&on_plan("a", Some("free"))), 2);
    assert_eq!(admitted(&on_plan("b", Some("pro"))), 5);
    assert_eq!(admitted(&on_plan("c", Some("team"))), 5);
    // No condition holds: neither policy applies (no bucket, no outcome, no 403 for a
    // missing key either: a skipped policy reads no key).
    for req in [
        on_plan("d", Some("enterprise")),
        on_plan("e", None),
        Req::default(),
    ] {
        let plan = e.plan(&item, &req);
        assert!(plan.is_empty(), "{plan:?}");
        assert_eq!(admitted(&req), 10);
    }
    // A condition is tested only where `match` holds: another route plans nothing.
    assert!(e
        .plan(&facts("GET", "/other"), &on_plan("a", Some("free")))
        .is_empty());
}

#[test]
fn a_policy_whose_conditions_hold_is_planned_with_its_key_and_cost() {
    let store = MemorySharedData::default();
    let e = engine(PLANS, &store, 64);
    let plan = e.plan(&facts("GET", "/items/9"), &on_plan("acme", Some("pro")));
    assert_eq!(plan.enforced.len(), 1);
    assert_eq!(plan.enforced[0].index, 1);
    assert_eq!(plan.enforced[0].key(), "acme");
    assert_eq!(plan.enforced[0].cost, 1);
    // The condition holds but the key is missing: `on_missing_key` decides, as without `when`.
    let plan = e.plan(&facts("GET", "/items/9"), &{
        let mut req = Req::default();
        req.headers.insert("x-plan".into(), b"pro".to_vec());
        req
    });
    assert_eq!(plan.early_outcomes, vec![(1, Outcome::IdentityMissing)]);
    assert_eq!(plan.refused.map(|r| r.status), Some(403));
}

/// One policy with `limits`: plans by `x-plan`, acme's override at `acme_burst`; 1 per hour.
fn plans_doc(acme_burst: u64) -> String {
    let entry =
        |burst: u64| format!(r#"{{"rate":{{"units":{burst},"per":"1h"}},"burst":{burst}}}"#);
    format!(
        r#"{{"policies":[{{"name":"plans","key":[{{"header":"x-tenant-id"}}],"limits":{{
          "by":{{"header":"x-plan"}},"values":{{"free":{},"pro":{}}},"default":{},
          "overrides":{{"acme":{}}}}},"ratelimit_headers_on_allow":true}}]}}"#,
        entry(2),
        entry(5),
        entry(1),
        entry(acme_burst)
    )
}

fn admitted(e: &Engine, req: &Req, store: &MemorySharedData, n: usize) -> usize {
    let items = facts("GET", "/items/1");
    (0..n)
        .filter(|_| eval(e, &items, req, store, 1_000).reply.is_none())
        .count()
}

#[test]
fn limits_rate_each_entry_in_a_bucket_of_its_own() {
    let store = MemorySharedData::default();
    let e = engine(&plans_doc(4), &store, 64);
    let plan = e.plan(&facts("GET", "/items/1"), &on_plan("t1", Some("pro")));
    assert_eq!(plan.enforced[0].bucket_id, "plans:t1:!vpro");
    assert_eq!(admitted(&e, &on_plan("t1", Some("free")), &store, 5), 2);
    // The same tenant on another plan: another bucket.
    assert_eq!(admitted(&e, &on_plan("t1", Some("pro")), &store, 8), 5);
    assert_eq!(admitted(&e, &tenant("t2"), &store, 3), 1);
    assert_eq!(admitted(&e, &on_plan("acme", Some("free")), &store, 8), 4);
    // The RateLimit fields state the entry's own quota.
    let ev = eval(
        &e,
        &facts("GET", "/items/1"),
        &on_plan("t3", Some("pro")),
        &store,
        1_000,
    );
    assert!(
        header_of(&ev.response_headers, "ratelimit-policy").contains("q=5;w=3600"),
        "{:?}",
        ev.response_headers
    );
}

#[test]
fn a_reloaded_override_keeps_the_local_bucket_and_its_tokens() {
    let store = MemorySharedData::default();
    // acme spends 3 of 10.
    let e = engine(&plans_doc(10), &store, 64);
    assert_eq!(admitted(&e, &on_plan("acme", Some("free")), &store, 3), 3);
    // The filter reloads with the override lowered to 2: same table, same bucket, clamped.
    let lowered = engine(&plans_doc(2), &store, 64);
    assert_eq!(
        admitted(&lowered, &on_plan("acme", Some("free")), &store, 5),
        2
    );
    // Raised to 10: the empty bucket stays empty (refills at the rate, 1 per hour).
    let raised = engine(&plans_doc(10), &store, 64);
    assert_eq!(
        admitted(&raised, &on_plan("acme", Some("free")), &store, 5),
        0
    );
}
