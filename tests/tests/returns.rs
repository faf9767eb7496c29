#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of late returns: an Envoy that leased more than it spent and then goes
//! idle gives the rest back from its own tick when the lease expires, whatever the traffic, and
//! the limiter takes the return however long the idleness lasts, so a burst through either
//! Envoy afterwards finds the whole budget. Two real Envoys (`envoy/global.yaml`, two workers)
//! on real limiters, in both topologies: on one plain limiter (its Redis), and each on its own
//! regional limiter under a parent limiter (each on its Redis). Every test runs against both
//! builds of the filter.
//!
//! The limiters run short terms (`--lease-ttl 1s`, `--assignment-period 500ms`, `--dedup-ttl
//! 2500ms`, the shortest the dedup check accepts), so an idle gap past the dedup TTL stays
//! short.

use std::time::{Duration, Instant};

use tollgate_e2e::build::Build;
use tollgate_e2e::client::burst_detailed;
use tollgate_e2e::tollgate::{envoy_config, item, prometheus_value, Limiter, Store};
use tollgate_e2e::{send, Envoy, EnvoyOptions, RedisServer, Upstream};

const POLICY: &str = "fleet";
/// The budget: 149 per hour, all of it in the burst (the refill is negligible over a test).
const BUDGET: usize = 149;
/// Short terms: leases expire after 1 s and their ids are remembered 2.5 s.
const TERMS: [&str; 6] = [
    "--lease-ttl",
    "1s",
    "--assignment-period",
    "500ms",
    "--dedup-ttl",
    "2500ms",
];
const DEDUP_TTL: Duration = Duration::from_millis(2_500);
/// How long a condition that must come true is awaited (a loaded 2-core machine).
const DEADLINE: Duration = Duration::from_secs(30);

fn policy() -> String {
    format!(
        r#"{{
  "policies": [{{
    "name": "{POLICY}",
    "match": {{ "routes": ["GET /items/{{id}}"] }},
    "key": [{{ "header": "x-tenant-id" }}],
    "rate": {{ "units": {BUDGET}, "per": "1h" }},
    "burst": {BUDGET},
    "scope": "global",
    "on_unavailable": {{ "mode": "closed" }}
  }}],
  "limiter": {{ "cluster": "tollgate_limiter", "timeout": "1s" }}
}}"#
    )
}

fn start_envoy(build: Build, upstream: &Upstream, limiter_port: u16) -> (Envoy, u16) {
    let envoy = Envoy::start(
        EnvoyOptions::new(build.config(envoy_config(
            "envoy/global.yaml",
            &policy(),
            upstream.port(),
            Some(limiter_port),
        )))
        .concurrency(2)
        .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

fn metric(envoy: &Envoy, what: &str) -> u64 {
    prometheus_value(
        &envoy.stats_prometheus(),
        &format!("tollgate_{what}{{policy=\"{POLICY}\"}}"),
    ) as u64
}

/// Awaits `check` (polled every 50 ms) for up to [`DEADLINE`].
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < DEADLINE,
            "not within {DEADLINE:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Where the two Envoys lease from.
enum Topology {
    /// Both on one plain limiter.
    Plain {
        _redis: RedisServer,
        limiter: Limiter,
    },
    /// Each on its own regional limiter, both under one parent.
    Regions {
        _redis: Vec<RedisServer>,
        _parent: Limiter,
        a: Limiter,
        b: Limiter,
    },
}

impl Topology {
    fn plain() -> Topology {
        let redis = RedisServer::start();
        let limiter = Limiter::start(&policy(), Store::Redis(redis.url()), &TERMS);
        limiter.wait_ready();
        Topology::Plain {
            _redis: redis,
            limiter,
        }
    }

    fn regions() -> Topology {
        let parent_redis = RedisServer::start();
        let parent = Limiter::start(&policy(), Store::Redis(parent_redis.url()), &TERMS);
        parent.wait_ready();
        let url = format!("http://127.0.0.1:{}", parent.port());
        let region = |name: &str| {
            let redis = RedisServer::start();
            let mut flags = TERMS.to_vec();
            flags.extend([
                "--parent",
                &url,
                "--region",
                name,
                "--parent-timeout",
                "400ms",
            ]);
            let limiter = Limiter::start(&policy(), Store::Redis(redis.url()), &flags);
            limiter.wait_ready();
            (redis, limiter)
        };
        let (redis_a, a) = region("region-a");
        let (redis_b, b) = region("region-b");
        Topology::Regions {
            _redis: vec![parent_redis, redis_a, redis_b],
            _parent: parent,
            a,
            b,
        }
    }

    /// The limiter ports Envoy A and Envoy B lease from.
    fn ports(&self) -> (u16, u16) {
        match self {
            Topology::Plain { limiter, .. } => (limiter.port(), limiter.port()),
            Topology::Regions { a, b, .. } => (a.port(), b.port()),
        }
    }

    /// With regions: each regional limiter's token counts, for the log.
    fn describe(&self) -> String {
        let Topology::Regions { a, b, .. } = self else {
            return String::new();
        };
        let lines = |l: &Limiter| {
            l.metrics()
                .lines()
                .filter(|line| line.starts_with("tollgate_limiter_regional_tokens_total"))
                .map(|line| line.replace("tollgate_limiter_regional_tokens_total", ""))
                .collect::<Vec<_>>()
                .join(" ")
        };
        format!("region A: {}; region B: {}", lines(a), lines(b))
    }

    /// Whether A's regional limiter (if any) holds nothing of the policy any more.
    fn region_a_settled(&self) -> bool {
        let Topology::Regions { a, .. } = self else {
            return true;
        };
        let held = format!("tollgate_limiter_regional_held_tokens{{policy=\"{POLICY}\"}}");
        prometheus_value(&a.metrics(), &held) == 0.0
    }
}

/// Admitted of `n` concurrent requests for `tenant` through `port`.
async fn drain(port: u16, tenant: &str, n: usize) -> usize {
    burst_detailed(port, n, 20, Duration::from_secs(10), |i| item(tenant, i))
        .await
        .into_iter()
        .filter(|t| t.response.as_ref().is_ok_and(|r| r.status == 200))
        .count()
}

/// Which Envoys the burst after the idle gap goes through.
#[derive(Debug, Clone, Copy)]
enum Drain {
    /// Both at once.
    Both,
    /// Only the Envoy that did not lease before the gap.
    Other,
}

/// One episode on a fresh key: 60 requests through A at 40/s (A leases more than it spends),
/// idle for `gap`, then a burst through `drain`. The fleet must admit the whole budget, and A
/// must have returned what it did not spend, losing nothing.
#[allow(clippy::too_many_arguments)]
async fn episode(
    topology: &Topology,
    (a, port_a): (&Envoy, u16),
    (b, port_b): (&Envoy, u16),
    tenant: &str,
    gap: Duration,
    how: Drain,
) -> usize {
    // What A's region held for earlier episodes has gone back to the parent: its counts
    // below are this episode's.
    eventually(&format!("{tenant}: A's region starts empty"), || {
        topology.region_a_settled()
    })
    .await;
    let returned_before = metric(a, "tokens_returned");
    let expired_before = metric(a, "tokens_expired");
    let granted_before = metric(a, "tokens_granted");
    let mut admitted = 0;
    for i in 0..60 {
        if send(port_a, item(tenant, i)).await.status == 200 {
            admitted += 1;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(admitted, 60, "{tenant}: the first 60 are within the budget");
    let granted = metric(a, "tokens_granted") - granted_before;
    // Idleness is the point here: nothing reaches either Envoy.
    tokio::time::sleep(gap).await;
    let returned_in_gap = metric(a, "tokens_returned") - returned_before;
    match how {
        Drain::Both => {
            let (x, y) = tokio::join!(drain(port_a, tenant, 400), drain(port_b, tenant, 400));
            admitted += x + y;
        }
        Drain::Other => {
            // Nothing goes to A: its own tick must return what it holds.
            eventually(&format!("{tenant}: A returns its unspent tokens"), || {
                metric(a, "tokens_returned") > returned_before
            })
            .await;
            // With regions: A's region has given everything it holds back to the parent.
            eventually(&format!("{tenant}: A's region gives the rest back"), || {
                topology.region_a_settled()
            })
            .await;
            admitted += drain(port_b, tenant, 400).await;
        }
    }
    let returned = metric(a, "tokens_returned") - returned_before;
    let expired = metric(a, "tokens_expired") - expired_before;
    println!(
        "{tenant}: gap {gap:?}, drain {how:?}: admitted {admitted} of {BUDGET}; A granted \
         {granted}, returned {returned} ({returned_in_gap} during the gap), expired {expired}; \
         B granted {}",
        metric(b, "tokens_granted")
    );
    println!("{}", topology.describe());
    assert!(admitted <= BUDGET, "{tenant}: overshoot");
    assert_eq!(
        admitted, BUDGET,
        "{tenant}: the fleet admits the whole budget, no more, no less"
    );
    // A key's record keeps its latest two lease ids, so the leftovers of an earlier, larger
    // lease (a regional reservoir running low grants little) go back under their own id
    // when a small refill merged into them.
    assert_eq!(expired, 0, "{tenant}: A loses nothing it leased");
    // No return is refused: the regional limiters expire nothing either.
    assert!(
        !topology.describe().contains("expired"),
        "{tenant}: a regional limiter expired tokens: {}",
        topology.describe()
    );
    if gap > Duration::from_millis(1_500) {
        // The lease (1 s) expired during the gap: A's tick returned it with no request.
        assert!(
            returned_in_gap > 0,
            "{tenant}: A returned nothing during a gap of {gap:?}"
        );
    }
    admitted
}

async fn returns(build: Build, topology: Topology) {
    let upstream = Upstream::start();
    let (port_to_a, port_to_b) = topology.ports();
    let (a, port_a) = start_envoy(build, &upstream, port_to_a);
    let (b, port_b) = start_envoy(build, &upstream, port_to_b);
    let (ea, eb) = ((&a, port_a), (&b, port_b));
    // The lease is still live after the gap: a burst through both spends it.
    let mut admitted = episode(
        &topology,
        ea,
        eb,
        "live",
        Duration::from_millis(500),
        Drain::Both,
    )
    .await;
    // Past the lease's expiry: drained through the other Envoy only.
    admitted += episode(
        &topology,
        ea,
        eb,
        "expired",
        Duration::from_secs(2),
        Drain::Other,
    )
    .await;
    // Past the limiter's dedup TTL: the return came long before, so nothing is refused.
    let past_dedup = DEDUP_TTL + Duration::from_secs(1);
    admitted += episode(&topology, ea, eb, "past-dedup", past_dedup, Drain::Both).await;
    admitted += episode(&topology, ea, eb, "past-dedup-b", past_dedup, Drain::Other).await;
    assert!(metric(&a, "tokens_returned") > 0);
    assert_eq!(upstream.requests() as usize, admitted);
}

async fn returns_on_a_plain_limiter(build: Build) {
    returns(build, Topology::plain()).await;
}

async fn returns_through_regional_limiters(build: Build) {
    returns(build, Topology::regions()).await;
}

tollgate_e2e::both_builds!(
    async: [returns_on_a_plain_limiter, returns_through_regional_limiters],
    sync: [],
);
