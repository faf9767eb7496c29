//! The local stage by algorithm (windows, sliding log, shaping), decided against an in-memory
//! shared table.

use super::*;
use crate::request::{RequestFacts, RequestSource};
use crate::shared::MemorySharedData;
use crate::table::SlotTable;

struct Tenant(&'static str);

impl RequestSource for Tenant {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        (name == "x-tenant").then(|| self.0.as_bytes().to_vec())
    }
    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

fn engine(extra: &str) -> (Engine, MemorySharedData) {
    let doc = format!(
        r#"{{"policies":[{{"name":"p","key":[{{"header":"x-tenant"}}],"rate":{{"units":5,"per":"1s"}}{extra}}}]}}"#
    );
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, 64, 1).unwrap();
    (
        Engine::new(Policies::from_json(doc.as_bytes()).unwrap(), table),
        store,
    )
}

fn facts() -> RequestFacts<'static> {
    RequestFacts {
        method: "GET".into(),
        path: "/".into(),
        host: "h".into(),
    }
}

fn admitted(e: &Engine, store: &MemorySharedData, tenant: &'static str, now: u64) -> bool {
    let d = e.decide(
        &e.plan(&facts(), &Tenant(tenant)),
        StoreAt::new(store, now),
        Attempt::default(),
    );
    d.verdict == Verdict::Continue
}

fn count(e: &Engine, store: &MemorySharedData, tenant: &'static str, now: u64, n: usize) -> usize {
    (0..n).filter(|_| admitted(e, store, tenant, now)).count()
}

#[test]
fn each_algorithm_admits_its_limit_and_keys_never_share_state() {
    for algorithm in ["fixed_window", "sliding_window", "sliding_log"] {
        let (e, store) = engine(&format!(r#","algorithm":"{algorithm}""#));
        assert_eq!(count(&e, &store, "a", 10_100, 20), 5, "{algorithm}");
        assert_eq!(count(&e, &store, "b", 10_100, 20), 5, "{algorithm}");
    }
}

#[test]
fn windows_differ_at_their_boundary() {
    // Fixed: 5 at the end of a window, 5 more right after (the double burst).
    let (e, store) = engine(r#","algorithm":"fixed_window""#);
    assert_eq!(count(&e, &store, "a", 10_999, 10), 5);
    assert_eq!(count(&e, &store, "a", 11_000, 10), 5);
    // Sliding counter: 1 ms into the next window the previous 5 still weigh ~5.
    let (e, store) = engine(r#","algorithm":"sliding_window""#);
    assert_eq!(count(&e, &store, "a", 10_999, 10), 5);
    assert_eq!(count(&e, &store, "a", 11_000, 10), 0);
    assert_eq!(count(&e, &store, "a", 11_600, 10), 3);
    // Log: exact, units leave one window after they were counted.
    let (e, store) = engine(r#","algorithm":"sliding_log""#);
    assert_eq!(count(&e, &store, "a", 10_999, 10), 5);
    assert_eq!(count(&e, &store, "a", 11_998, 10), 0);
    assert_eq!(count(&e, &store, "a", 11_999, 10), 5);
}

#[test]
fn a_denial_says_when_the_window_lets_it_pass() {
    let (e, store) = engine(r#","algorithm":"fixed_window""#);
    count(&e, &store, "a", 10_250, 5);
    let d = e.decide(
        &e.plan(&facts(), &Tenant("a")),
        StoreAt::new(&store, 10_250),
        Attempt::default(),
    );
    let Verdict::Reply(reply) = d.verdict else {
        panic!("admitted over the window");
    };
    assert!(
        reply.body.contains(r#""retry_after_seconds":1"#),
        "{}",
        reply.body
    );
}

#[test]
fn shaping_spaces_admissions_and_refuses_past_max_delay_or_a_full_queue() {
    // 5/s (one per 200 ms), burst 1, at most 700 ms of delay.
    let (e, store) = engine(r#","burst":1,"shape":{"max_delay":"700ms","max_waiting":10}"#);
    let plan = e.plan(&facts(), &Tenant("a"));
    let delays: Vec<Option<u64>> = (0..6)
        .map(|_| {
            let d = e.decide(&plan, StoreAt::new(&store, 50_000), Attempt::default());
            (d.verdict == Verdict::Continue).then_some(d.delay_ms)
        })
        .collect();
    assert_eq!(
        delays,
        vec![Some(0), Some(200), Some(400), Some(600), None, None]
    );
    // A worker without room for another waiting request of the key: no delay, refused.
    let mut full = plan.clone();
    full.enforced[0].may_wait = false;
    let d = e.decide(&full, StoreAt::new(&store, 50_300), Attempt::default());
    assert!(matches!(d.verdict, Verdict::Reply(_)));
    // When the queue has drained, admissions are immediate again.
    let d = e.decide(&plan, StoreAt::new(&store, 51_000), Attempt::default());
    assert_eq!(
        (d.verdict, d.delay_ms, d.delayed.len()),
        (Verdict::Continue, 0, 0)
    );
}

#[test]
fn invalid_combinations_name_the_field() {
    for (extra, field) in [
        (
            r#","algorithm":"sliding_log","shape":{"max_delay":"1s"}"#,
            "policies[0].shape",
        ),
        (
            r#","algorithm":"fixed_window","burst":5"#,
            "policies[0].burst",
        ),
        (
            r#","burst":5,"shape":{"max_delay":"0ms"}"#,
            "policies[0].shape.max_delay",
        ),
        (
            r#","burst":5,"shape":{"max_delay":"1s","max_waiting":0}"#,
            "policies[0].shape.max_waiting",
        ),
        (
            r#","algorithm":"fixed_window","settle":{"from":{"header":"x"}}"#,
            "policies[0].settle",
        ),
    ] {
        let doc = format!(
            r#"{{"policies":[{{"name":"p","key":[{{"header":"x-tenant"}}],"rate":{{"units":5,"per":"1s"}}{extra}}}]}}"#
        );
        let errors = Policies::from_json(doc.as_bytes()).unwrap_err().0;
        assert!(
            errors.iter().any(|e| e.field == field),
            "{extra}: {errors:?}"
        );
    }
    let doc = r#"{"policies":[{"name":"p","key":[{"header":"x"}],"algorithm":"sliding_log","rate":{"units":1000,"per":"1s"}}]}"#;
    let errors = Policies::from_json(doc.as_bytes()).unwrap_err().0;
    assert!(
        errors.iter().any(|e| e.field == "policies[0].rate.units"),
        "{errors:?}"
    );
}

#[test]
fn a_shaped_global_policy_waits_against_its_assignment_not_a_callout() {
    let doc = r#"{"policies":[{"name":"p","key":[{"header":"x-tenant"}],"rate":{"units":20,"per":"1s"},
        "burst":1,"scope":"global","shape":{"max_delay":"500ms"}}],
        "limiter":{"cluster":"l","timeout":"25ms"}}"#;
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, 64, 1).unwrap();
    let e = Engine::new(Policies::from_json(doc.as_bytes()).unwrap(), table);
    let plan = e.plan(&facts(), &Tenant("a"));
    let first = e.decide(&plan, StoreAt::new(&store, 1_000), Attempt::default());
    assert_eq!(first.verdict, Verdict::Wait);
    // Over the limit: an assignment of 10 units/s for 10 s, nothing granted at once.
    let grant = tollgate_core::protocol::LeaseGranted {
        id: "x".into(),
        granted: 0,
        remaining: 0.0,
        retry_after_ms: 0,
        expires_ms: 12_000,
        share_per_s: 10.0,
        period_ms: 10_000,
    };
    e.credit(
        StoreAt::new(&store, 1_000),
        &first.needs[0],
        &grant,
        1,
        true,
    )
    .unwrap();
    let delays: Vec<Option<u64>> = (0..7)
        .map(|_| {
            let d = e.decide(&plan, StoreAt::new(&store, 1_000), Attempt::default());
            assert!(
                d.needs.iter().all(|n| !n.blocking),
                "no request waits for a callout"
            );
            (d.verdict == Verdict::Continue).then_some(d.delay_ms)
        })
        .collect();
    // One per 100 ms of the drip, up to 500 ms; then 429.
    assert_eq!(
        delays,
        vec![
            Some(100),
            Some(200),
            Some(300),
            Some(400),
            Some(500),
            None,
            None
        ]
    );
    // The drip pays the 5 units taken ahead: 600 ms later 6 dripped, one is free at once,
    // the next is 100 ms away.
    let d = e.decide(&plan, StoreAt::new(&store, 1_600), Attempt::default());
    assert_eq!((d.verdict, d.delay_ms), (Verdict::Continue, 0));
    let d = e.decide(&plan, StoreAt::new(&store, 1_600), Attempt::default());
    assert_eq!((d.verdict, d.delay_ms), (Verdict::Continue, 100));
}

/// Milliseconds of `year-month-day` 00:00 UTC.
fn midnight(year: u64, month: u32, day: u32) -> u64 {
    tollgate_core::calendar::days_from_civil(year, month, day) * tollgate_core::calendar::DAY_MS
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map_or("", |(_, v)| v.as_str())
}

/// The request's verdict at `now`: `Ok(headers on the admitted response)` or `Err(the 429)`.
fn ask(
    e: &Engine,
    store: &MemorySharedData,
    now: u64,
) -> Result<Vec<(String, String)>, tollgate_core::response::LocalReply> {
    let d = e.decide(
        &e.plan(&facts(), &Tenant("acme")),
        StoreAt::new(store, now),
        Attempt::default(),
    );
    match d.verdict {
        Verdict::Continue => Ok(d.response_headers),
        Verdict::Reply(reply) => Err(reply),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_monthly_quota_resets_at_the_first_of_the_month_and_says_so() {
    let doc = r#"{"policies":[{"name":"monthly","key":[{"header":"x-tenant"}],
        "algorithm":"fixed_window","rate":{"units":3,"per":"1mo"}}],
        "response":{"ratelimit_headers_on_allow":true}}"#;
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, 64, 1).unwrap();
    let e = Engine::new(Policies::from_json(doc.as_bytes()).unwrap(), table);
    let (jan1, feb1, mar1) = (
        midnight(2027, 1, 1),
        midnight(2027, 2, 1),
        midnight(2027, 3, 1),
    );
    // 2 January: the first unit; January has 31 days, 30 of them left.
    let headers = ask(&e, &store, jan1 + 86_400_000).unwrap();
    assert_eq!(
        header(&headers, "ratelimit-policy"),
        r#""monthly";q=3;w=2678400"#
    );
    assert_eq!(header(&headers, "ratelimit"), r#""monthly";r=2;t=2592000"#);
    ask(&e, &store, jan1 + 86_400_000).unwrap();
    ask(&e, &store, feb1 - 10_000).unwrap();
    // Spent, 10 s before February: Retry-After counts to the first of February.
    let reply = ask(&e, &store, feb1 - 10_000).unwrap_err();
    assert_eq!(reply.status, 429);
    assert_eq!(header(&reply.headers, "retry-after"), "10");
    assert_eq!(header(&reply.headers, "ratelimit"), r#""monthly";r=0;t=10"#);
    assert!(
        ask(&e, &store, feb1 - 1).is_err(),
        "the last millisecond of January"
    );
    // February: 3 more, then a denial until the first of March, 28 days (2027 is not a leap
    // year) after the first of February.
    for _ in 0..3 {
        let headers = ask(&e, &store, feb1).unwrap();
        assert!(
            header(&headers, "ratelimit-policy").ends_with(";w=2419200"),
            "{headers:?}"
        );
    }
    let reply = ask(&e, &store, feb1).unwrap_err();
    assert_eq!(header(&reply.headers, "retry-after"), "2419200");
    assert_eq!((mar1 - feb1) / 1_000, 2_419_200);
    assert!(ask(&e, &store, mar1).is_ok());
}

/// The recipe: a monthly quota and a per-second rate on the same key, as two policies. A
/// request is admitted only when both admit it, and a denial by one takes nothing from the
/// other.
#[test]
fn a_quota_and_a_per_second_rate_on_one_key_are_all_or_nothing() {
    let doc = r#"{"policies":[
        {"name":"monthly","key":[{"header":"x-tenant"}],
         "algorithm":"fixed_window","rate":{"units":3,"per":"1mo"}},
        {"name":"per-second","key":[{"header":"x-tenant"}],
         "rate":{"units":2,"per":"1s"},"burst":2}]}"#;
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, 64, 1).unwrap();
    let e = Engine::new(Policies::from_json(doc.as_bytes()).unwrap(), table);
    let feb1 = midnight(2027, 2, 1);
    let denied_by = |now: u64| {
        let reply = ask(&e, &store, now).unwrap_err();
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        (
            body["policy"].as_str().unwrap().to_string(),
            header(&reply.headers, "retry-after").to_string(),
        )
    };
    // 10 s before February: the per-second rate admits 2 and denies the third...
    let t0 = feb1 - 10_000;
    assert!(ask(&e, &store, t0).is_ok() && ask(&e, &store, t0).is_ok());
    assert_eq!(denied_by(t0), ("per-second".into(), "1".into()));
    // ...which took nothing from the quota: a second later its third unit is still there.
    assert!(ask(&e, &store, t0 + 1_000).is_ok());
    assert_eq!(denied_by(t0 + 1_000), ("monthly".into(), "9".into()));
    // At the end of January the per-second bucket is full again; the quota denies, five
    // times, and takes nothing from the per-second bucket: 1 ms later, in February, both of
    // its units are there (at 2 per second, 1 ms refills nothing).
    for _ in 0..5 {
        assert_eq!(denied_by(feb1 - 1), ("monthly".into(), "1".into()));
    }
    assert!(ask(&e, &store, feb1).is_ok() && ask(&e, &store, feb1).is_ok());
    assert_eq!(denied_by(feb1), ("per-second".into(), "1".into()));
    // February's quota counted the two admitted only.
    assert!(ask(&e, &store, feb1 + 1_000).is_ok());
    assert_eq!(denied_by(feb1 + 1_000).0, "monthly");
}

/// A global quota's admitted response says its units come back when the lease's window ends
/// (the limiter's `expires_ms`: the first of next month), not at a token bucket's refill.
#[test]
fn a_global_quota_resets_when_its_window_lease_ends() {
    let doc = r#"{"policies":[{"name":"monthly","key":[{"header":"x-tenant"}],
        "algorithm":"fixed_window","rate":{"units":1000,"per":"1mo"},"scope":"global"}],
        "limiter":{"cluster":"l","timeout":"25ms"},
        "response":{"ratelimit_headers_on_allow":true}}"#;
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, 64, 1).unwrap();
    let e = Engine::new(Policies::from_json(doc.as_bytes()).unwrap(), table);
    let plan = e.plan(&facts(), &Tenant("a"));
    let now = midnight(2027, 1, 31);
    let first = e.decide(&plan, StoreAt::new(&store, now), Attempt::default());
    assert_eq!(first.verdict, Verdict::Wait);
    // The limiter's answer: 10 units, spendable until the first of February (a day away).
    let grant = tollgate_core::protocol::LeaseGranted {
        id: "x".into(),
        granted: 10,
        remaining: 990.0,
        retry_after_ms: 0,
        expires_ms: 86_400_000,
        share_per_s: 0.0,
        period_ms: 0,
    };
    e.credit(StoreAt::new(&store, now), &first.needs[0], &grant, 1, true)
        .unwrap();
    let d = e.decide(&plan, StoreAt::new(&store, now + 1_000), Attempt::default());
    assert_eq!(d.verdict, Verdict::Continue);
    assert_eq!(
        header(&d.response_headers, "ratelimit"),
        r#""monthly";r=9;t=86399"#
    );
    assert_eq!(
        header(&d.response_headers, "ratelimit-policy"),
        r#""monthly";q=1000;w=2678400"#
    );
}
