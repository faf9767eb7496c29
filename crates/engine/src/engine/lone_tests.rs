//! The lone paths (`lone`) decide as the general path does: the same policy with
//! `ratelimit_headers_on_allow` (which only adds headers, and takes the general path) must
//! admit, refuse, delay and report exactly alike, request by request, for every algorithm of
//! a local policy over random traffic of several tenants and costs, and for a global policy
//! through every turn of its lease.

use super::*;
use crate::request::{RequestFacts, RequestSource};
use crate::shared::MemorySharedData;
use crate::table::{Cells, SlotTable};
use proptest::prelude::*;
use std::sync::Arc;
use tollgate_core::protocol::LeaseGranted;

struct Tenant(String);

impl RequestSource for Tenant {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        (name == "x-tenant").then(|| self.0.as_bytes().to_vec())
    }
    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

/// Each algorithm as a policy: a small limit that traffic crosses often, costs 1 and 3.
const ALGORITHMS: [&str; 6] = [
    r#""burst":4"#,
    r#""burst":3,"shape":{"max_delay":"300ms","max_waiting":5}"#,
    r#""algorithm":"fixed_window""#,
    r#""algorithm":"sliding_window""#,
    r#""algorithm":"sliding_log""#,
    r#""algorithm":"fixed_window","rate":{"units":7,"per":"1mo"}"#,
];

fn engine(algorithm: &str, general: bool, typed: bool) -> (Engine, MemorySharedData) {
    let headers = if general {
        r#","ratelimit_headers_on_allow":true"#
    } else {
        ""
    };
    let rate = if algorithm.contains(r#""rate""#) {
        ""
    } else {
        r#","rate":{"units":5,"per":"1s"}"#
    };
    let doc = format!(
        r#"{{"policies":[{{"name":"p","match":{{"routes":["GET /a","POST /b"]}},"cost":{{"POST /b":3}},
            "key":[{{"header":"x-tenant"}}]{rate},{algorithm}{headers}}}]}}"#
    );
    let store = MemorySharedData::default();
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    let engine = if typed {
        let engine = Engine::new(
            policies,
            SlotTable::open_salted(&store, SHARED_PREFIX, 64, 1).unwrap(),
        );
        let cells = Arc::new(Cells::new(engine.table().groups_needed()));
        engine.keeping_records_in(cells).unwrap()
    } else {
        Engine::new(
            policies,
            SlotTable::open(&store, SHARED_PREFIX, 64, 1).unwrap(),
        )
    };
    (engine, store)
}

/// A request of the policies' routes: `GET /a` (cost 1), or `POST /b` (cost 3).
fn route(post: bool) -> RequestFacts<'static> {
    RequestFacts {
        method: if post { "POST" } else { "GET" }.into(),
        path: if post { "/b" } else { "/a" }.into(),
        host: "h".into(),
    }
}

/// What a decision says, but the headers only the general engine's policy adds.
fn seen(d: &Decision) -> (Verdict, Vec<(usize, Outcome)>, u64, Vec<usize>, u32) {
    (
        d.verdict.clone(),
        d.outcomes.to_vec(),
        d.delay_ms,
        d.delayed.clone(),
        d.evictions,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_lone_local_path_decides_as_the_general_one(
        algorithm in 0..ALGORITHMS.len(),
        typed in any::<bool>(),
        traffic in prop::collection::vec((0..3u8, 0..250u64, any::<bool>(), any::<bool>()), 1..80),
    ) {
        let algorithm = ALGORITHMS[algorithm];
        let (lone, lone_store) = engine(algorithm, false, typed);
        let (general, general_store) = engine(algorithm, true, typed);
        let mut now = 1_000_000u64;
        for (tenant, step_ms, post, may_wait) in traffic {
            now += step_ms;
            let tenant = Tenant(format!("t{tenant}"));
            let facts = route(post);
            let mut decided = Vec::new();
            for (e, store) in [(&lone, &lone_store), (&general, &general_store)] {
                let mut plan = e.plan(&facts, &tenant);
                for m in plan.enforced.iter_mut() {
                    m.may_wait = may_wait;
                }
                decided.push(e.decide(&plan, StoreAt::new(store, now), Attempt::default()));
            }
            prop_assert_eq!(seen(&decided[0]), seen(&decided[1]), "{} at {}", algorithm, now);
            prop_assert!(decided[0].response_headers.is_empty());
            if decided[0].verdict == Verdict::Continue {
                prop_assert!(!decided[1].response_headers.is_empty(), "the general path was taken");
            }
        }
    }
}

/// Global policies: a token bucket, a shaped one (it waits against an assignment), a fixed
/// window, and a bucket with a local failure mode; costs 1 and 3, small leases (refills,
/// expiries and renewals come often).
const GLOBAL: [&str; 4] = [
    r#""burst":4"#,
    r#""burst":3,"shape":{"max_delay":"300ms","max_waiting":5}"#,
    r#""algorithm":"fixed_window""#,
    r#""burst":4,"on_unavailable":{"mode":"local","share":0.5,"stale_ttl":"1s","then":"closed"}"#,
];

/// `general`: the policy sends headers on allowed answers (the general path); both engines
/// keep their records in cells, as the native build does (the lone global path's only table).
fn global_engine(algorithm: &str, general: bool) -> (Engine, MemorySharedData) {
    let headers = if general {
        r#","ratelimit_headers_on_allow":true"#
    } else {
        ""
    };
    let doc = format!(
        r#"{{"policies":[{{"name":"p","match":{{"routes":["GET /a","POST /b"]}},"cost":{{"POST /b":3}},
            "key":[{{"header":"x-tenant"}}],"rate":{{"units":20,"per":"1s"}},"scope":"global",
            {algorithm}{headers}}}],
            "limiter":{{"cluster":"l","timeout":"25ms","lease_horizon":"250ms","lease_max":12}}}}"#
    );
    let store = MemorySharedData::default();
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    let engine = Engine::new(
        policies,
        SlotTable::open_salted(&store, SHARED_PREFIX, 64, 1).unwrap(),
    );
    let cells = Arc::new(Cells::new(engine.table().groups_needed()));
    (engine.keeping_records_in(cells).unwrap(), store)
}

/// What one step of the global traffic does.
#[derive(Debug, Clone)]
enum Event {
    /// A request of tenant `t{0}`, after `1` ms; `2`: the costly route; `3`: it may wait.
    Request(u8, u64, bool, bool),
    /// After `0` ms the limiter answers every need asked so far: `1` picks a lease of some
    /// of what was wanted, a denial, an assignment, or no answer (the limiter is away);
    /// then the requests that wait decide again (`2`: past their deadline).
    Answer(u64, u8, bool),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        3 => (0..3u8, 0..120u64, any::<bool>(), any::<bool>())
            .prop_map(|(t, ms, post, wait)| Event::Request(t, ms, post, wait)),
        1 => (0..400u64, 0..4u8, any::<bool>()).prop_map(|(ms, kind, late)| Event::Answer(ms, kind, late)),
    ]
}

/// One engine's traffic: the needs it asked for and the plans of its waiting requests.
struct Driven {
    engine: Engine,
    store: MemorySharedData,
    asked: Vec<LeaseNeed>,
    waiting: Vec<Plan>,
}

impl Driven {
    /// Takes `d`'s needs; keeps its plan while it waits.
    fn decided(&mut self, plan: Plan, d: &Decision) {
        self.asked.extend(d.needs.iter().cloned());
        if d.verdict == Verdict::Wait {
            self.waiting.push(plan);
        }
    }

    /// The limiter's answer (`kind`) to every need asked so far, at `now`.
    fn answer(&mut self, kind: u8, seq: &mut u64, now: u64) {
        for need in std::mem::take(&mut self.asked) {
            let at = StoreAt::new(&self.store, now);
            if kind == 3 {
                self.engine.mark_unavailable(at, &need).unwrap();
                continue;
            }
            *seq += 1;
            let grant = LeaseGranted {
                id: format!("l{seq}"),
                granted: if kind == 0 {
                    need.want.max(need.min)
                } else {
                    0
                },
                remaining: 0.0,
                retry_after_ms: if kind == 1 { 150 } else { 0 },
                expires_ms: 300,
                share_per_s: if kind == 2 { 10.0 } else { 0.0 },
                period_ms: if kind == 2 { 500 } else { 0 },
            };
            self.engine.credit(at, &need, &grant, *seq, true).unwrap();
        }
    }
}

/// Everything a decision says, but the headers only the general engine's policy adds.
type Said = (
    (Verdict, Vec<(usize, Outcome)>, u64, Vec<usize>, u32),
    Vec<LeaseNeed>,
    Vec<ReturnNeed>,
    Vec<(usize, u64)>,
    Vec<String>,
);

fn said(d: &Decision) -> Said {
    (
        seen(d),
        d.needs.clone(),
        d.returns.clone(),
        d.expired.clone(),
        d.waiting_for.clone(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A global policy's requests decide alike on the lone path (in the native cells) and on
    /// the general one,
    /// through leases granted, spent, refilled, expired and returned, denials, assignments
    /// (shaped turns against their drip), outages (the failure mode), and requests that wait
    /// and decide again, with or without their deadline passed.
    #[test]
    fn the_lone_global_path_decides_as_the_general_one(
        algorithm in 0..GLOBAL.len(),
        traffic in prop::collection::vec(event(), 1..120),
    ) {
        let algorithm = GLOBAL[algorithm];
        let mut engines = [false, true].map(|general| {
            let (engine, store) = global_engine(algorithm, general);
            Driven { engine, store, asked: Vec::new(), waiting: Vec::new() }
        });
        let mut now = 1_000_000u64;
        let mut seqs = [0u64; 2];
        for event in traffic {
            let mut decided: Vec<Vec<Said>> = vec![Vec::new(), Vec::new()];
            match event {
                Event::Request(tenant, step_ms, post, may_wait) => {
                    now += step_ms;
                    let tenant = Tenant(format!("t{tenant}"));
                    let facts = route(post);
                    for (e, seen) in engines.iter_mut().zip(decided.iter_mut()) {
                        let mut plan = e.engine.plan(&facts, &tenant);
                        for m in plan.enforced.iter_mut() {
                            m.may_wait = may_wait;
                        }
                        let attempt = if may_wait { Attempt::default() } else { Attempt::NO_WAIT };
                        let d = e.engine.decide(&plan, StoreAt::new(&e.store, now), attempt);
                        seen.push(said(&d));
                        e.decided(plan, &d);
                    }
                }
                Event::Answer(step_ms, kind, late) => {
                    now += step_ms;
                    let attempt = Attempt { round: 1, deadline_passed: late };
                    for ((e, seen), seq) in engines.iter_mut().zip(decided.iter_mut()).zip(seqs.iter_mut()) {
                        e.answer(kind, seq, now);
                        for plan in std::mem::take(&mut e.waiting) {
                            let d = e.engine.decide(&plan, StoreAt::new(&e.store, now), attempt);
                            seen.push(said(&d));
                            e.decided(plan, &d);
                        }
                    }
                }
            }
            prop_assert_eq!(&decided[0], &decided[1], "{} at {}", algorithm, now);
        }
    }
}

/// The lone global step takes what the lease decides by itself, and passes everything else
/// to the general path (the record is only read).
#[test]
fn the_lone_global_step_takes_what_the_lease_decides_alone() {
    use super::step::{keep_lone_lease, lone_global_step, Moment, Spend, Step};
    use crate::table::Record;
    let (engine, _store) = global_engine(GLOBAL[0], false);
    let plan = engine.plan(&route(true), &Tenant("t".into()));
    let (m, policy) = (&plan.enforced[0], engine.policy(0).unwrap());
    let now = 1_000_000;
    let at = Moment {
        now_ms: now,
        attempt: Attempt::default(),
        limiter: engine.limiter(),
    };
    let mut record = Record::fresh(&m.bucket_id);
    record.lease.seq = 1;
    record.lease.granted = 10;
    record.lease.expires_ms = now + 200;
    let step = |record: &Record| lone_global_step(policy, m, record, at);

    // Tokens for the cost (3): spent from the lease; the housekeeping the write makes counts
    // the request in the demand estimate.
    record.lease.tokens = 10;
    let before = record.lease;
    let read = step(&record);
    assert_eq!(record.lease, before, "the step only reads");
    assert!(
        matches!(
            read,
            Some(Step::Allow {
                spend: Spend::Lease(3),
                ..
            })
        ),
        "{read:?}"
    );
    keep_lone_lease(&mut record.lease, m.cost, at);
    assert_eq!(record.lease.window_units, before.window_units + 3);
    // Too few tokens and nothing said: the limiter is asked (the general path's `Need`).
    record.lease.tokens = 2;
    assert_eq!(step(&record), None);
    // Too few, and the limiter refused until a time ahead: refused here, for that long.
    record.lease.denied_until_ms = now + 70;
    assert!(matches!(
        step(&record),
        Some(Step::Deny { retry_ms: 70, .. })
    ));
    // An expired lease is returned (housekeeping the general path reports): passed.
    record.lease.tokens = 10;
    record.lease.expires_ms = now - 1;
    assert_eq!(step(&record), None);
    // So is the previous lease's expiry.
    record.lease.expires_ms = now + 200;
    record.lease.prev_seq = 1;
    record.lease.prev_expires_ms = now;
    assert_eq!(step(&record), None);
    // A debt is paid from the tokens first (the step sees what is left); one they cannot
    // pay passes.
    record.lease.prev_seq = 0;
    record.lease.denied_until_ms = 0;
    record.lease.debt = 8;
    assert_eq!(step(&record), None, "2 tokens left for a cost of 3");
    record.lease.debt = 7;
    assert!(matches!(step(&record), Some(Step::Allow { remaining, .. }) if remaining == 0.0));
    record.lease.debt = 11;
    assert_eq!(step(&record), None);
    // Without a limiter the policy is decided by its local stage, not here.
    record.lease.debt = 0;
    let local = Moment {
        limiter: None,
        ..at
    };
    assert_eq!(lone_global_step(policy, m, &record, local), None);
}
