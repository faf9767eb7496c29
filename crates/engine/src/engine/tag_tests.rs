//! `on_over_limit: tag` and per-policy RateLimit fields, decided against an in-memory table.

use super::*;
use crate::request::{RequestFacts, RequestSource};
use crate::shared::MemorySharedData;
use crate::table::SlotTable;

struct Tenant(&'static str);

impl RequestSource for Tenant {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        (name == "x-tenant-id").then(|| self.0.as_bytes().to_vec())
    }
    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

fn facts() -> RequestFacts<'static> {
    RequestFacts {
        method: "GET".into(),
        path: "/reports".into(),
        host: "api.example.com".into(),
    }
}

fn engine(policies: &str, response: &str) -> (Engine, MemorySharedData) {
    let doc = format!(r#"{{"policies":[{policies}]{response}}}"#);
    let policies = Policies::from_json(doc.as_bytes()).unwrap();
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, 256, 1).unwrap();
    (Engine::new(policies, table), store)
}

/// A policy per tenant: `burst` units, refilled at one per `per`.
fn policy(name: &str, burst: u64, per: &str, extra: &str) -> String {
    format!(
        r#"{{"name":"{name}","key":[{{"header":"x-tenant-id"}}],"rate":{{"units":1,"per":"{per}"}},"burst":{burst}{extra}}}"#
    )
}

const TAG: &str = r#","on_over_limit":{"action":"tag"}"#;

fn decide(e: &Engine, store: &MemorySharedData, tenant: &'static str, now: u64) -> Decision {
    e.decide(
        &e.plan(&facts(), &Tenant(tenant)),
        StoreAt::new(store, now),
        Attempt::default(),
    )
}

fn ratelimit(d: &Decision) -> Option<&str> {
    d.response_headers
        .iter()
        .find(|(k, _)| k == "ratelimit")
        .map(|(_, v)| v.as_str())
}

#[test]
fn over_the_limit_a_tag_policy_lets_the_request_on_tagged_and_takes_nothing() {
    let (e, store) = engine(&policy("bulk", 2, "1s", TAG), "");
    for _ in 0..2 {
        let d = decide(&e, &store, "acme", 0);
        assert_eq!(d.verdict, Verdict::Continue);
        assert_eq!(d.outcomes.to_vec(), vec![(0, Outcome::Allowed)]);
        assert!(d.request_headers.is_empty());
    }
    // Over the limit, again and again: never refused, always tagged.
    for _ in 0..20 {
        let d = decide(&e, &store, "acme", 10);
        assert_eq!(d.verdict, Verdict::Continue);
        assert_eq!(d.outcomes.to_vec(), vec![(0, Outcome::Tagged)]);
        assert_eq!(
            d.request_headers,
            vec![("x-tollgate-over-limit".to_string(), "bulk".to_string())]
        );
        assert!(d.admissions.is_empty());
    }
    // The tagged requests took nothing: one second refills exactly one unit, and the next
    // request is admitted on it (had the 20 taken anything, it would still be tagged).
    let d = decide(&e, &store, "acme", 1_000);
    assert_eq!(d.outcomes.to_vec(), vec![(0, Outcome::Allowed)]);
    assert!(d.request_headers.is_empty());
    assert_eq!(
        decide(&e, &store, "acme", 1_000).outcomes.to_vec(),
        vec![(0, Outcome::Tagged)]
    );
    // Another tenant has its own budget.
    assert_eq!(
        decide(&e, &store, "other", 1_000).outcomes.to_vec(),
        vec![(0, Outcome::Allowed)]
    );
}

#[test]
fn reject_policies_stay_all_or_nothing_beside_a_tag_policy() {
    // `strict` rejects, `bulk` tags; both match every request of a tenant.
    let (e, store) = engine(
        &[policy("strict", 2, "1h", ""), policy("bulk", 1, "1h", TAG)].join(","),
        "",
    );
    let d = decide(&e, &store, "acme", 0);
    assert_eq!(
        d.outcomes.to_vec(),
        vec![(0, Outcome::Allowed), (1, Outcome::Allowed)]
    );
    assert!(d.request_headers.is_empty());
    // `bulk` is over: tagged, and `strict` still takes its unit.
    let d = decide(&e, &store, "acme", 0);
    assert_eq!(d.verdict, Verdict::Continue);
    assert_eq!(
        d.outcomes.to_vec(),
        vec![(0, Outcome::Allowed), (1, Outcome::Tagged)]
    );
    assert_eq!(
        d.request_headers,
        vec![("x-tollgate-over-limit".to_string(), "bulk".to_string())]
    );
    // `strict` is over: 429, whatever `bulk` says; nothing is tagged.
    let d = decide(&e, &store, "acme", 0);
    let Verdict::Reply(reply) = &d.verdict else {
        panic!("{:?}", d.verdict)
    };
    assert_eq!(reply.status, 429);
    assert!(reply.body.contains("\"policy\":\"strict\""));
    assert_eq!(d.outcomes.to_vec(), vec![(0, Outcome::Denied)]);
    assert!(d.request_headers.is_empty());
}

#[test]
fn a_request_refused_by_a_reject_policy_takes_nothing_from_a_tag_policy() {
    let (e, store) = engine(
        &[
            policy("strict", 1, "1h", ""),
            policy(
                "bulk",
                3,
                "1h",
                &format!("{TAG},\"ratelimit_headers_on_allow\":true"),
            ),
        ]
        .join(","),
        "",
    );
    let d = decide(&e, &store, "acme", 0);
    // Only `bulk` sends its fields: 2 of 3 left.
    assert_eq!(ratelimit(&d), Some("\"bulk\";r=2;t=3601"));
    for _ in 0..5 {
        assert!(matches!(
            decide(&e, &store, "acme", 0).verdict,
            Verdict::Reply(_)
        ));
    }
    // An hour refills `strict`; `bulk` had 2 left (the refused requests took none of it),
    // refilled to 3 and this request takes one.
    let d = decide(&e, &store, "acme", 3_600_000);
    assert_eq!(
        d.outcomes.to_vec(),
        vec![(0, Outcome::Allowed), (1, Outcome::Allowed)]
    );
    assert_eq!(ratelimit(&d), Some("\"bulk\";r=2;t=3601"));
}

#[test]
fn several_tag_policies_over_share_one_header_per_name() {
    let (e, store) = engine(
        &[
            policy("a", 1, "1h", TAG),
            policy("b", 1, "1h", TAG),
            policy(
                "c",
                1,
                "1h",
                r#","on_over_limit":{"action":"tag","header":"x-other"}"#,
            ),
            policy("d", 5, "1h", TAG),
        ]
        .join(","),
        "",
    );
    assert!(decide(&e, &store, "acme", 0).request_headers.is_empty());
    let d = decide(&e, &store, "acme", 0);
    assert_eq!(d.verdict, Verdict::Continue);
    assert_eq!(
        d.request_headers,
        vec![
            ("x-tollgate-over-limit".to_string(), "a,b".to_string()),
            ("x-other".to_string(), "c".to_string()),
        ]
    );
    assert_eq!(
        d.outcomes.to_vec(),
        vec![
            (0, Outcome::Tagged),
            (1, Outcome::Tagged),
            (2, Outcome::Tagged),
            (3, Outcome::Allowed)
        ]
    );
    // Every tag header a matched policy may set is listed once, for the glue to remove a
    // client's copy.
    let plan = e.plan(&facts(), &Tenant("acme"));
    assert_eq!(plan.tag_headers, vec!["x-tollgate-over-limit", "x-other"]);
}

#[test]
fn a_tag_header_is_removed_even_when_the_policy_skips_the_request() {
    struct Anonymous;
    impl RequestSource for Anonymous {
        fn header(&self, _name: &str) -> Option<Vec<u8>> {
            None
        }
        fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
            None
        }
    }
    let (e, _) = engine(&policy("bulk", 1, "1h", TAG), "");
    let plan = e.plan(&facts(), &Anonymous);
    assert!(plan.is_empty());
    assert_eq!(plan.tag_headers, vec!["x-tollgate-over-limit"]);
}

#[test]
fn decided_after_the_headers_went_on_a_tag_policy_refuses() {
    let (e, store) = engine(&policy("bulk", 1, "1h", TAG), "");
    assert_eq!(decide(&e, &store, "acme", 0).verdict, Verdict::Continue);
    let mut plan = e.plan(&facts(), &Tenant("acme"));
    plan.after_headers = true;
    let d = e.decide(&plan, StoreAt::new(&store, 0), Attempt::default());
    assert!(matches!(&d.verdict, Verdict::Reply(r) if r.status == 429));
    assert_eq!(d.outcomes.to_vec(), vec![(0, Outcome::Denied)]);
    assert!(d.request_headers.is_empty());
}

#[test]
fn a_tag_policy_over_max_in_flight_tags_and_holds_no_slot() {
    let (e, store) = engine(
        &policy("bulk", 100, "1s", &format!("{TAG},\"max_in_flight\":1")),
        "",
    );
    let first = decide(&e, &store, "acme", 0);
    assert_eq!(first.outcomes.to_vec(), vec![(0, Outcome::Allowed)]);
    assert_eq!(first.admissions.len(), 1);
    let second = decide(&e, &store, "acme", 0);
    assert_eq!(second.verdict, Verdict::Continue);
    assert_eq!(second.outcomes.to_vec(), vec![(0, Outcome::Tagged)]);
    assert!(second.admissions.is_empty());
    assert_eq!(second.request_headers.len(), 1);
}

#[test]
fn ratelimit_fields_on_allowed_answers_come_from_the_policies_that_enable_them() {
    let policies = [
        policy("quiet", 5, "1s", r#","ratelimit_headers_on_allow":false"#),
        policy("loud", 5, "1s", ""),
    ]
    .join(",");
    // The document enables them; `quiet` opts out.
    let (e, store) = engine(
        &policies,
        r#","response":{"ratelimit_headers_on_allow":true}"#,
    );
    let d = decide(&e, &store, "acme", 0);
    assert_eq!(ratelimit(&d), Some("\"loud\";r=4;t=1"));
    let policy_field = d
        .response_headers
        .iter()
        .find(|(k, _)| k == "ratelimit-policy")
        .map(|(_, v)| v.as_str());
    assert_eq!(policy_field, Some("\"loud\";q=1;w=1"));
    // The document leaves them off and no policy enables them: no fields at all.
    let (e, store) = engine(&policy("loud", 5, "1s", ""), "");
    assert!(decide(&e, &store, "acme", 0).response_headers.is_empty());
    // A tag policy over its limit that enables them shows it has nothing left.
    let (e, store) = engine(
        &policy(
            "bulk",
            1,
            "1s",
            &format!("{TAG},\"ratelimit_headers_on_allow\":true"),
        ),
        "",
    );
    decide(&e, &store, "acme", 0);
    let d = decide(&e, &store, "acme", 0);
    assert_eq!(d.outcomes.to_vec(), vec![(0, Outcome::Tagged)]);
    assert_eq!(ratelimit(&d), Some("\"bulk\";r=0;t=1"));
}
