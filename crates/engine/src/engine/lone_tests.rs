//! The lone local policy's own path (`Engine::decide_lone_local`) decides as the general path
//! does: the same policy with `ratelimit_headers_on_allow` (which only adds headers, and takes
//! the general path) must admit, refuse, delay and report exactly alike, request by request,
//! for every algorithm, over random traffic of several tenants and costs.

use super::*;
use crate::request::{RequestFacts, RequestSource};
use crate::shared::MemorySharedData;
use crate::table::{Cells, SlotTable};
use proptest::prelude::*;
use std::sync::Arc;

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
            let facts = RequestFacts {
                method: if post { "POST" } else { "GET" }.into(),
                path: if post { "/b" } else { "/a" }.into(),
                host: "h".into(),
            };
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
