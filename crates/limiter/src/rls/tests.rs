//! The RateLimitService over the memory store: resolution, costs, statuses, shadow mode,
//! groups, headers and hostile input (the same service runs over Redis in the e2e tier).
#![allow(clippy::unwrap_used)]

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::google::protobuf::UInt64Value;

use super::*;
use crate::store::{MemoryStore, StoreSettings};

const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: tenant
    rate_limit: { unit: hour, requests_per_unit: 5 }
    descriptors:
      - key: path
        rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: tenant
    value: vip
    rate_limit: { unit: hour, requests_per_unit: 10 }
  - key: health
    rate_limit: { unlimited: true }
  - key: shadow
    shadow_mode: true
    rate_limit: { unit: hour, requests_per_unit: 1 }
  - key: zero
    rate_limit: { unit: hour, requests_per_unit: 0 }
  - key: old
    rate_limit: { unit: hour, requests_per_unit: 1, name: old }
  - key: new
    rate_limit: { unit: hour, requests_per_unit: 3, name: new, replaces: [{ name: old }] }
"#;

fn service(headers: bool) -> RlsService<MemoryStore> {
    let store = MemoryStore::new(StoreSettings {
        dedup_ttl_ms: 1_000,
        assignment_period_ms: 1_000,
        lease_ttl_ms: 1_000,
    });
    let config = RlsConfig::parse(&[("edge.yaml".into(), CONFIG.into())]).unwrap();
    let metrics = Metrics::new().unwrap();
    RlsService::new(
        Arc::new(store),
        Arc::new(Current::new(config)),
        RlsMetrics::new(metrics.registry()).unwrap(),
        metrics.clone(),
        RlsSettings {
            store_timeout: Duration::from_secs(1),
            bounds: Bounds::default(),
            headers: headers.then(HeaderNames::default),
        },
    )
}

fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

fn req(domain: &str, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: hits,
    }
}

fn codes(r: &RateLimitResponse) -> Vec<i32> {
    r.statuses.iter().map(|s| s.code).collect()
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

async fn admitted(s: &RlsService<MemoryStore>, r: &RateLimitRequest, n: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..n {
        if s.answer(r.clone()).await.unwrap().overall_code == OK {
            admitted += 1;
        }
    }
    admitted
}

#[tokio::test]
async fn exact_counts_per_descriptor_default_and_value_specific() {
    let s = service(false);
    let acme = req("edge", vec![desc(&[("tenant", "acme")])], 0);
    assert_eq!(admitted(&s, &acme, 8).await, 5);
    // Another value of the default key has its own bucket; the value-specific rate is 10.
    let other = req("edge", vec![desc(&[("tenant", "other")])], 0);
    assert_eq!(admitted(&s, &other, 8).await, 5);
    let vip = req("edge", vec![desc(&[("tenant", "vip")])], 0);
    assert_eq!(admitted(&s, &vip, 12).await, 10);
    // Nested: its own bucket and rate.
    let nested = req("edge", vec![desc(&[("tenant", "t2"), ("path", "/a")])], 0);
    assert_eq!(admitted(&s, &nested, 5).await, 2);
    let r = s.answer(nested).await.unwrap();
    let status = &r.statuses[0];
    assert_eq!(status.code, OVER);
    let limit = status.current_limit.as_ref().unwrap();
    assert_eq!(limit.requests_per_unit, 2);
    assert_eq!(limit.unit, PbUnit::Hour as i32);
    assert_eq!(status.limit_remaining, 0);
    let reset = status.duration_until_reset.unwrap();
    assert!(
        reset.seconds <= 3_600 && (reset.seconds > 0 || reset.nanos > 0),
        "{reset:?}"
    );
}

#[tokio::test]
async fn hits_addend_is_the_cost_and_zero_counts_one() {
    let s = service(false);
    let r = s
        .answer(req("edge", vec![desc(&[("tenant", "a")])], 3))
        .await
        .unwrap();
    assert_eq!(codes(&r), [OK]);
    assert_eq!(r.statuses[0].limit_remaining, 2);
    // 3 more do not fit in the 2 left: refused, nothing taken.
    let r = s
        .answer(req("edge", vec![desc(&[("tenant", "a")])], 3))
        .await
        .unwrap();
    assert_eq!(codes(&r), [OVER]);
    // A descriptor's own hits_addend wins over the request's.
    let mut d = desc(&[("tenant", "a")]);
    d.hits_addend = Some(UInt64Value { value: 2 });
    let r = s.answer(req("edge", vec![d], 3)).await.unwrap();
    assert_eq!(codes(&r), [OK]);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    // A cost above the limit never fits.
    let r = s
        .answer(req("edge", vec![desc(&[("tenant", "b")])], 6))
        .await
        .unwrap();
    assert_eq!(codes(&r), [OVER]);
}

#[tokio::test]
async fn shadow_unlimited_unknown_and_replaced_answer_ok() {
    let s = service(false);
    let shadow = req("edge", vec![desc(&[("shadow", "x")])], 0);
    for _ in 0..3 {
        let r = s.answer(shadow.clone()).await.unwrap();
        assert_eq!(r.overall_code, OK);
        assert!(r.statuses[0].current_limit.is_some());
    }
    let text = s
        .metrics
        .descriptors
        .with_label_values(&["edge", outcome::SHADOW_OVER_LIMIT])
        .get();
    assert_eq!(text, 2);
    let health = req("edge", vec![desc(&[("health", "x")])], 0);
    assert_eq!(admitted(&s, &health, 20).await, 20);
    assert_eq!(
        s.metrics
            .descriptors
            .with_label_values(&["edge", outcome::NOT_COUNTED])
            .get(),
        20
    );
    let none = req("edge", vec![desc(&[("no-such-key", "x")])], 0);
    assert_eq!(admitted(&s, &none, 1).await, 1);
    assert_eq!(
        s.metrics
            .descriptors
            .with_label_values(&["edge", outcome::NO_RULE])
            .get(),
        1
    );
    let unknown = req("nope", vec![desc(&[("tenant", "x")])], 0);
    let r = s.answer(unknown).await.unwrap();
    assert_eq!(r.overall_code, OK);
    assert!(r.statuses[0].current_limit.is_none());
    assert_eq!(
        s.metrics
            .descriptors
            .with_label_values(&["(unknown)", outcome::UNKNOWN_DOMAIN])
            .get(),
        1
    );
    // `new` replaces `old` in the same request: old's limit of 1 does not apply.
    let both = req(
        "edge",
        vec![desc(&[("old", "x")]), desc(&[("new", "x")])],
        0,
    );
    assert_eq!(admitted(&s, &both, 5).await, 3);
    // A rate of 0 refuses everything.
    let zero = req("edge", vec![desc(&[("zero", "x")])], 0);
    assert_eq!(admitted(&s, &zero, 2).await, 0);
}

#[tokio::test]
async fn a_group_sharing_a_hash_tag_is_all_or_nothing_others_are_independent() {
    let s = service(false);
    // Same first entry: one group. The nested bucket (2/h) runs out first; then the pair
    // is refused and the tenant bucket (5/h) stops being charged.
    let pair = req(
        "edge",
        vec![
            desc(&[("tenant", "g")]),
            desc(&[("tenant", "g"), ("path", "/p")]),
        ],
        0,
    );
    assert_eq!(admitted(&s, &pair, 4).await, 2);
    let alone = req("edge", vec![desc(&[("tenant", "g")])], 0);
    assert_eq!(admitted(&s, &alone, 5).await, 3);
    // Different first entries: charged independently, as ratelimit does.
    let split = req(
        "edge",
        vec![desc(&[("tenant", "h")]), desc(&[("tenant", "vip2")])],
        0,
    );
    for _ in 0..5 {
        s.answer(split.clone()).await.unwrap();
    }
    let r = s.answer(split).await.unwrap();
    assert_eq!(codes(&r), [OVER, OVER]);
}

#[tokio::test]
async fn request_limit_overrides_are_applied() {
    let s = service(false);
    let mut d = desc(&[("anything", "x")]);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: PbUnit::Hour as i32,
    });
    let r = req("edge", vec![d.clone()], 0);
    assert_eq!(admitted(&s, &r, 4).await, 2);
    d.limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: 99,
    });
    let e = s.answer(req("edge", vec![d.clone()], 0)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    // An unknown domain limits nothing, override or not (as ratelimit).
    let r = s.answer(req("nope", vec![d], 0)).await.unwrap();
    assert_eq!(codes(&r), [OK]);
    assert!(r.statuses[0].current_limit.is_none());
}

#[tokio::test]
async fn headers_describe_the_tightest_descriptor() {
    let s = service(true);
    let r = s
        .answer(req(
            "edge",
            vec![desc(&[("tenant", "vip")]), desc(&[("new", "k")])],
            0,
        ))
        .await
        .unwrap();
    let h: Vec<(String, String)> = r
        .response_headers_to_add
        .iter()
        .map(|h| (h.key.clone(), h.value.clone()))
        .collect();
    let get = |k: &str| h.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("RateLimit-Limit"), Some("3"));
    assert_eq!(get("RateLimit-Remaining"), Some("2"));
    let reset: u64 = get("RateLimit-Reset").unwrap().parse().unwrap();
    assert!((1..=3_600).contains(&reset));
    assert_eq!(get("RateLimit-Policy"), Some("\"new\";q=3;w=3600"));
    assert_eq!(
        get("RateLimit"),
        Some(format!("\"new\";r=2;t={reset}").as_str())
    );
    // Off by default; and nothing to describe without a counted descriptor.
    let r = service(false)
        .answer(req("edge", vec![desc(&[("tenant", "a")])], 0))
        .await
        .unwrap();
    assert!(r.response_headers_to_add.is_empty());
    let r = s
        .answer(req("edge", vec![desc(&[("health", "a")])], 0))
        .await
        .unwrap();
    assert!(r.response_headers_to_add.is_empty());
}

#[tokio::test]
async fn hostile_requests_are_invalid_arguments_naming_the_field() {
    let s = service(false);
    let b = Bounds::default();
    let cases: Vec<(RateLimitRequest, &str)> = vec![
        (req("", vec![desc(&[("a", "b")])], 0), "domain: empty"),
        (
            req(&"d".repeat(b.text_bytes + 1), vec![desc(&[("a", "b")])], 0),
            "domain: longer",
        ),
        (req("edge", vec![], 0), "descriptors: none"),
        (
            req("edge", vec![desc(&[("a", "b")]); b.descriptors + 1], 0),
            "descriptors: 65 of them",
        ),
        (
            req("edge", vec![desc(&[])], 0),
            "descriptors[0].entries: none",
        ),
        (
            req("edge", vec![desc(&vec![("a", "b"); b.entries + 1])], 0),
            "descriptors[0].entries: 33 of them",
        ),
        (
            req("edge", vec![desc(&[("", "b")])], 0),
            "descriptors[0].entries[0].key: empty",
        ),
        (
            req("edge", vec![desc(&[("tenant", &"v".repeat(65_536))])], 0),
            "descriptors[0].entries[0].value: longer than 4096 bytes",
        ),
    ];
    for (r, message) in cases {
        let e = s.answer(r).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{message}");
        assert!(
            e.message().contains(message),
            "{} vs {message}",
            e.message()
        );
    }
    // Served as before.
    let r = s
        .answer(req("edge", vec![desc(&[("tenant", "a")])], 0))
        .await
        .unwrap();
    assert_eq!(r.overall_code, OK);
}

#[test]
fn groups_follow_the_hash_tag_and_keep_shadow_rules_alone() {
    let c = |key: &str, shadow: bool| Counted {
        index: 0,
        rate: Rate {
            requests_per_unit: 1,
            unit: Unit::Second,
        },
        name: None,
        shadow,
        key: key.into(),
        cost: 1,
    };
    let a = c(&rls_key("d", &[("t", "a")]), false);
    let a2 = c(&rls_key("d", &[("t", "a"), ("p", "x")]), false);
    let b = c(&rls_key("d", &[("t", "b")]), false);
    let sh = c(&rls_key("d", &[("t", "a"), ("q", "y")]), true);
    assert_eq!(
        groups(&[&a, &b, &a2, &sh]),
        vec![vec![0, 2], vec![1], vec![3]]
    );
}
