#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of regional budgets: two regions, each a real Envoy (`envoy/global.yaml`,
//! two workers) talking only to its regional limiter (`--parent`) on the region's own
//! `redis-server`, and a global limiter on its own Redis that both regional limiters lease
//! from. Global policies' tokens leave the global limiter before a region spends them, so the
//! fleet holds the budget exactly; a region cut off from the parent (a TCP proxy that stops
//! forwarding) spends what it holds, then fails as its policy says, and rejoins after the
//! heal.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tollgate_e2e::client::burst_detailed;
use tollgate_e2e::tollgate::{envoy_config, item, prometheus_value, Limiter, Store};
use tollgate_e2e::{Envoy, EnvoyOptions, RedisServer, RequestSpec, Upstream};

const FLEET: &str = "fleet";
const PER_REGION: &str = "per-region";
/// Pacing of the sustained runs.
const TICK_MS: u64 = 40;

/// A global policy `fleet` per tenant on `GET /items/{id}` and a regional one `per-region`
/// on `GET /regional/{id}`, both failing `closed`.
fn policies(units: u64, per: &str, burst: u64) -> String {
    format!(
        r#"{{
  "policies": [
    {{
      "name": "{FLEET}",
      "match": {{ "routes": ["GET /items/{{id}}"] }},
      "key": [{{ "header": "x-tenant-id" }}],
      "rate": {{ "units": {units}, "per": "{per}" }},
      "burst": {burst},
      "scope": "global",
      "on_unavailable": {{ "mode": "closed" }}
    }},
    {{
      "name": "{PER_REGION}",
      "match": {{ "routes": ["GET /regional/{{id}}"] }},
      "key": [{{ "header": "x-tenant-id" }}],
      "rate": {{ "units": 1, "per": "1h" }},
      "burst": 50,
      "scope": "regional",
      "on_unavailable": {{ "mode": "closed" }}
    }}
  ],
  "limiter": {{ "cluster": "tollgate_limiter", "timeout": "1s" }}
}}"#
    )
}

/// A TCP proxy that forwards until it is cut: then it stops reading and writing (the bytes
/// wait, as on a partitioned link) and holds new connections without connecting them; healed,
/// everything flows again.
struct Link {
    port: u16,
    cut: watch::Sender<bool>,
}

impl Link {
    async fn start(target: u16) -> Link {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (cut, cut_rx) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                tokio::spawn(Self::pipe(inbound, target, cut_rx.clone()));
            }
        });
        Link { port, cut }
    }

    fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }

    async fn pipe(inbound: TcpStream, target: u16, mut cut: watch::Receiver<bool>) {
        if cut.wait_for(|c| !*c).await.is_err() {
            return;
        }
        let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)).await else {
            return;
        };
        let _ = inbound.set_nodelay(true);
        let _ = outbound.set_nodelay(true);
        let (in_read, in_write) = inbound.into_split();
        let (out_read, out_write) = outbound.into_split();
        tokio::join!(
            Self::copy(in_read, out_write, cut.clone()),
            Self::copy(out_read, in_write, cut),
        );
    }

    async fn copy(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut cut: watch::Receiver<bool>,
    ) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            if cut.wait_for(|c| !*c).await.is_err() {
                return;
            }
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if cut.wait_for(|c| !*c).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }
}

/// One region: its Redis, its regional limiter, its Envoy.
struct Region {
    _redis: RedisServer,
    limiter: Limiter,
    envoy: Envoy,
    port: u16,
}

impl Region {
    fn start(name: &str, policy: &str, parent_port: u16, upstream: &Upstream) -> Region {
        let redis = RedisServer::start();
        let parent = format!("http://127.0.0.1:{parent_port}");
        let limiter = Limiter::start(
            policy,
            Store::Redis(redis.url()),
            &[
                "--parent",
                &parent,
                "--region",
                name,
                "--parent-timeout",
                "400ms",
            ],
        );
        // Ready: its Redis answers and it has reached the parent.
        limiter.wait_ready();
        let envoy = Envoy::start(
            EnvoyOptions::new(envoy_config(
                "envoy/global.yaml",
                policy,
                upstream.port(),
                Some(limiter.port()),
            ))
            .concurrency(2)
            .log_level("warn"),
        );
        let port = envoy.listener_port("ingress");
        Region {
            _redis: redis,
            limiter,
            envoy,
            port,
        }
    }

    fn limiter_metric(&self, series: &str) -> f64 {
        prometheus_value(&self.limiter.metrics(), series)
    }

    fn parent_lease_calls(&self) -> f64 {
        ["ok", "unreachable", "refused"]
            .iter()
            .map(|o| {
                self.limiter_metric(&format!(
                    "tollgate_limiter_parent_calls_total{{op=\"lease\",outcome=\"{o}\"}}"
                ))
            })
            .sum()
    }
}

/// The global limiter on its Redis, and two regions: B's regional limiter reaches it through
/// a [`Link`] that can be cut.
struct Fleet {
    _parent_redis: RedisServer,
    parent: Limiter,
    a: Region,
    b: Region,
    link_b: Link,
    upstream: Upstream,
}

impl Fleet {
    async fn start(policy: &str) -> Fleet {
        let parent_redis = RedisServer::start();
        let parent = Limiter::start(policy, Store::Redis(parent_redis.url()), &[]);
        parent.wait_ready();
        let upstream = Upstream::start();
        let link_b = Link::start(parent.port()).await;
        let a = Region::start("region-a", policy, parent.port(), &upstream);
        let b = Region::start("region-b", policy, link_b.port, &upstream);
        Fleet {
            _parent_redis: parent_redis,
            parent,
            a,
            b,
            link_b,
            upstream,
        }
    }
}

/// Statuses of `n` concurrent requests (`make`: the i-th request) on 20 connections.
async fn burst_statuses(port: u16, n: usize, make: impl FnMut(usize) -> RequestSpec) -> Vec<u16> {
    burst_detailed(port, n, 20, Duration::from_secs(10), make)
        .await
        .into_iter()
        .map(|t| t.response.map(|r| r.status).unwrap_or(0))
        .collect()
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|&&s| s == status).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_across_two_regions_admits_the_budget_and_no_more() {
    // Negligible refill: the budget is the burst, 200.
    let policy = policies(1, "1h", 200);
    let fleet = Fleet::start(&policy).await;
    let (a, b) = tokio::join!(
        burst_statuses(fleet.a.port, 300, |i| item("burst", i)),
        burst_statuses(fleet.b.port, 300, |i| item("burst", 1_000 + i)),
    );
    let (admitted_a, admitted_b) = (count(&a, 200), count(&b, 200));
    let admitted = admitted_a + admitted_b;
    println!("burst of 300 + 300 against 200: A {admitted_a}, B {admitted_b}");
    assert_eq!(count(&a, 429) + admitted_a, 300, "only 200 and 429: {a:?}");
    assert_eq!(count(&b, 429) + admitted_b, 300, "only 200 and 429: {b:?}");
    assert!(admitted <= 200, "overshoot: {admitted} > 200");
    assert!(admitted >= 190, "under-use: {admitted} < 95 % of 200");
    assert_eq!(fleet.upstream.requests(), admitted as u64);

    // A regional budget is the region's own: each region admits its 50, and the parent never
    // hears of the policy.
    let (a, b) = tokio::join!(
        burst_statuses(fleet.a.port, 80, |i| RequestSpec::get(format!(
            "/regional/{i}"
        ))
        .header("x-tenant-id", "r")),
        burst_statuses(fleet.b.port, 80, |i| RequestSpec::get(format!(
            "/regional/{i}"
        ))
        .header("x-tenant-id", "r")),
    );
    assert_eq!((count(&a, 200), count(&b, 200)), (50, 50), "{a:?} {b:?}");
    let parent_metrics = fleet.parent.metrics();
    assert!(
        !parent_metrics.contains(&format!("policy=\"{PER_REGION}\"")),
        "the parent decided a regional policy:\n{parent_metrics}"
    );
    assert!(
        fleet.a.limiter_metric(&format!(
            "tollgate_limiter_decisions_total{{outcome=\"GRANTED\",policy=\"{PER_REGION}\"}}"
        )) > 0.0
    );
}

/// What one region saw of a paced run: per request, when it was sent (s from the start),
/// its status and latency.
#[derive(Debug, Default)]
struct Seen {
    requests: Vec<(f64, u16, Duration)>,
}

impl Seen {
    fn admitted(&self) -> usize {
        self.requests.iter().filter(|r| r.1 == 200).count()
    }

    fn admitted_between(&self, from: f64, to: f64) -> usize {
        self.requests
            .iter()
            .filter(|r| r.1 == 200 && r.0 >= from && r.0 < to)
            .count()
    }

    /// Admitted per whole second of the run.
    fn per_second(&self, seconds: u64) -> Vec<usize> {
        (0..seconds)
            .map(|t| self.admitted_between(t as f64, (t + 1) as f64))
            .collect()
    }

    fn statuses_other_than(&self, allowed: &[u16]) -> Vec<u16> {
        self.requests
            .iter()
            .map(|r| r.1)
            .filter(|s| !allowed.contains(s))
            .collect()
    }
}

/// Paced demand: every 40 ms, `per_tick.0` requests to region A and `per_tick.1` to B (one
/// tenant), for `seconds`. `at(t)` is called once each whole second `t` (1, 2, ...).
async fn paced(
    fleet: &Fleet,
    per_tick: (usize, usize),
    seconds: u64,
    tenant: &'static str,
    mut at: impl FnMut(u64),
) -> (Seen, Seen, f64) {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
    let mut rounds = Vec::new();
    let mut next_second = 1;
    let ports = (fleet.a.port, fleet.b.port);
    for round in 0..(seconds * 1_000 / TICK_MS) as usize {
        tick.tick().await;
        let sent = start.elapsed().as_secs_f64();
        if sent >= next_second as f64 {
            at(next_second);
            next_second += 1;
        }
        rounds.push(tokio::spawn(async move {
            let (ra, rb) = tokio::join!(
                burst_detailed(
                    ports.0,
                    per_tick.0,
                    per_tick.0,
                    Duration::from_secs(5),
                    |i| { item(tenant, round * 100 + i) }
                ),
                burst_detailed(
                    ports.1,
                    per_tick.1,
                    per_tick.1,
                    Duration::from_secs(5),
                    |i| { item(tenant, round * 100 + 50 + i) }
                ),
            );
            let seen = |results: Vec<tollgate_e2e::client::Timed<_>>| {
                results
                    .into_iter()
                    .map(
                        |t: tollgate_e2e::client::Timed<Result<tollgate_e2e::Response, _>>| {
                            (sent, t.response.map(|r| r.status).unwrap_or(0), t.latency)
                        },
                    )
                    .collect::<Vec<_>>()
            };
            (seen(ra), seen(rb))
        }));
    }
    let (mut a, mut b) = (Seen::default(), Seen::default());
    for round in rounds {
        let (ra, rb) = round.await.unwrap();
        a.requests.extend(ra);
        b.requests.extend(rb);
    }
    (a, b, start.elapsed().as_secs_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uneven_demand_nine_to_one_goes_to_the_busy_region() {
    // A budget of 400 with negligible refill; 225/s to A and 25/s to B.
    let policy = policies(1, "1h", 400);
    let fleet = Fleet::start(&policy).await;
    let (a, b, _) = paced(&fleet, (9, 1), 3, "uneven", |_| {}).await;
    let (admitted_a, admitted_b) = (a.admitted(), b.admitted());
    println!("9:1 demand against 400: A {admitted_a}, B {admitted_b}");
    assert!(a.statuses_other_than(&[200, 429]).is_empty());
    assert!(b.statuses_other_than(&[200, 429]).is_empty());
    assert!(admitted_a + admitted_b <= 400);
    assert!(
        admitted_a >= 340,
        "the busy region admitted {admitted_a} < 85 % of 400 (B {admitted_b})"
    );
}

/// Sustained demand over both regions (`per_tick` per 40 ms): the fleet admits within
/// [0.95·rate·T, rate·T + burst], and each regional limiter calls its parent a bounded number
/// of times per second whatever the load.
async fn sustained(per_tick: (usize, usize), tenant: &'static str) {
    let (rate, burst, seconds) = (40u64, 20u64, 8u64);
    let policy = policies(rate, "1s", burst);
    let fleet = Fleet::start(&policy).await;
    let mut calls_at_one_second = (0.0, 0.0);
    let (a, b, elapsed) = paced(&fleet, per_tick, seconds, tenant, |t| {
        if t == 1 {
            calls_at_one_second = (fleet.a.parent_lease_calls(), fleet.b.parent_lease_calls());
        }
    })
    .await;
    let admitted = a.admitted() + b.admitted();
    let offered = a.requests.len() + b.requests.len();
    let upper = rate as f64 * elapsed + burst as f64;
    let lower = 0.95 * rate as f64 * seconds as f64;
    let calls_per_s = (
        (fleet.a.parent_lease_calls() - calls_at_one_second.0) / (elapsed - 1.0),
        (fleet.b.parent_lease_calls() - calls_at_one_second.1) / (elapsed - 1.0),
    );
    println!(
        "offered {offered} ({:.1}x the rate) in {elapsed:.2} s: admitted {admitted} (A {}, B {}; \
         allowed [{lower:.0}, {upper:.0}]); parent lease calls per second after the first: \
         A {:.2}, B {:.2}; Envoy lease calls A {}, B {}",
        offered as f64 / elapsed / rate as f64,
        a.admitted(),
        b.admitted(),
        calls_per_s.0,
        calls_per_s.1,
        tollgate_e2e::tollgate::policy_metric(&fleet.a.envoy, "lease_requests", FLEET),
        tollgate_e2e::tollgate::policy_metric(&fleet.b.envoy, "lease_requests", FLEET),
    );
    assert!(a.statuses_other_than(&[200, 429]).is_empty());
    assert!(b.statuses_other_than(&[200, 429]).is_empty());
    assert!(admitted as f64 <= upper, "overshoot: {admitted} > {upper}");
    assert!(admitted as f64 >= lower, "under-use: {admitted} < {lower}");
    assert_eq!(fleet.upstream.requests(), admitted as u64);
    for (name, per_s) in [("A", calls_per_s.0), ("B", calls_per_s.1)] {
        assert!(
            per_s <= 4.0,
            "region {name}: {per_s:.2} parent calls per second for one key"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_times_the_rate_over_two_regions_holds_the_budget() {
    // 75/s to A and 50/s to B against 40/s.
    sustained((3, 2), "three-x").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_times_the_rate_costs_the_parent_no_more_calls() {
    // 200/s to A and 125/s to B against 40/s.
    sustained((8, 5), "eight-x").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_region_spends_what_it_holds_then_fails_closed_and_rejoins() {
    let (rate, burst) = (40u64, 20u64);
    let policy = policies(rate, "1s", burst);
    let fleet = Fleet::start(&policy).await;
    let (cut_at, heal_at, seconds) = (3u64, 8u64, 12u64);
    let mut held_at_cut = 0.0;
    let mut during = (0.0, 0.0);
    let (a, b, elapsed) = paced(&fleet, (2, 2), seconds, "partition", |t| {
        if t == cut_at {
            held_at_cut = fleet.b.limiter_metric(&format!(
                "tollgate_limiter_regional_held_tokens{{policy=\"{FLEET}\"}}"
            ));
            fleet.link_b.set_cut(true);
        }
        if t == cut_at + 3 {
            during = (
                fleet.b.limiter_metric("tollgate_limiter_parent_reachable"),
                fleet.b.limiter_metric("tollgate_limiter_partition_seconds"),
            );
        }
        if t == heal_at {
            fleet.link_b.set_cut(false);
        }
    })
    .await;
    let (cut, heal) = (cut_at as f64, heal_at as f64);
    let b_last_before_heal = b
        .requests
        .iter()
        .filter(|r| r.1 == 200 && r.0 < heal)
        .map(|r| r.0)
        .fold(0.0, f64::max);
    let b_first_after_heal = b
        .requests
        .iter()
        .filter(|r| r.1 == 200 && r.0 >= heal)
        .map(|r| r.0)
        .fold(f64::MAX, f64::min);
    let admitted = a.admitted() + b.admitted();
    let allowed = rate as f64 * elapsed + burst as f64;
    let overshoot = (admitted as f64 - allowed).max(0.0);
    let slowest = a
        .requests
        .iter()
        .chain(&b.requests)
        .map(|r| r.2)
        .max()
        .unwrap();
    let a_partitioned = a.admitted_between(cut + 2.0, heal);
    let b_503 = b.requests.iter().filter(|r| r.1 == 503).count();
    println!(
        "partition of B from {cut} s to {heal} s: B held {held_at_cut} at the cut, admitted last \
         at {b_last_before_heal:.2} s, again at {b_first_after_heal:.2} s, 503 ×{b_503}; \
         parent reachable {} (partition {} s) during; A admitted {a_partitioned} in \
         [{:.0}, {heal}) s; fleet admitted {admitted} (allowed {allowed:.0}, overshoot \
         {overshoot}); slowest answer {slowest:?}; admitted per second: A {:?}, B {:?}",
        during.0,
        during.1,
        cut + 2.0,
        a.per_second(seconds),
        b.per_second(seconds),
    );
    let odd: Vec<_> = a
        .requests
        .iter()
        .filter(|r| r.1 != 200 && r.1 != 429)
        .collect();
    assert!(odd.is_empty(), "A answered other than 200/429: {odd:?}");
    assert!(b.statuses_other_than(&[200, 429, 503]).is_empty());
    assert!(b.admitted_between(0.0, cut) > 0);
    // B spends what it holds until the parent's lease (2 s) and its assignment (1 s) end,
    // then fails closed: 503, each within the filter's 1 s callout deadline plus margin.
    assert!(
        b_last_before_heal <= cut + 3.5,
        "B admitted until {b_last_before_heal:.2} s after a cut at {cut} s"
    );
    assert!(b_503 > 0);
    assert!(slowest <= Duration::from_millis(2_000), "{slowest:?}");
    assert_eq!(during.0, 0.0, "parent_reachable during the partition");
    assert!(during.1 >= 1.0, "partition_seconds {}", during.1);
    // The fleet stays within the budget: B only spent what had left the parent already.
    assert!(
        overshoot <= held_at_cut,
        "fleet overshoot {overshoot} > what B held at the cut ({held_at_cut})"
    );
    // Meanwhile A gets the whole rate (its demand, 50/s, is above it).
    let a_floor = 0.8 * rate as f64 * (heal - cut - 2.0);
    assert!(
        a_partitioned as f64 >= a_floor,
        "A admitted {a_partitioned} < {a_floor} while B was cut off"
    );
    // After the heal B is back within a period (plus the parent backoff and a sweep), and
    // gets a share again.
    assert!(
        b_first_after_heal <= heal + 1.5,
        "B admitted again only at {b_first_after_heal:.2} s after a heal at {heal} s"
    );
    let b_back = b.admitted_between(heal + 1.5, seconds as f64);
    assert!(
        b_back as f64 >= 0.3 * rate as f64 * (seconds as f64 - heal - 1.5),
        "B admitted {b_back} after rejoining"
    );
    assert_eq!(
        fleet.b.limiter_metric("tollgate_limiter_parent_reachable"),
        1.0
    );
}

/// A lease of `fleet` for `key` asked directly of a (regional) limiter: status and granted.
fn lease_from(limiter: &Limiter, key: &str) -> (u16, u64) {
    let body = format!(
        r#"{{"leases":[{{"id":"{key}","policy":"{FLEET}","key":"{key}","min":1,"want":3,"holder":"probe","demand_per_s":1}}]}}"#
    );
    match tollgate_e2e::http_blocking::post(
        limiter.port(),
        "/v1/leases",
        &body,
        Duration::from_secs(5),
    ) {
        Ok(r) => {
            let granted = serde_json::from_str::<serde_json::Value>(&r.body)
                .ok()
                .and_then(|v| v["leases"][0]["granted"].as_u64())
                .unwrap_or(0);
            (r.status, granted)
        }
        Err(_) => (0, 0),
    }
}

/// A regional limiter that cannot reach its parent is not ready, and `/readyz` says why.
fn assert_unready_for_the_parent(limiter: &Limiter) {
    let r =
        tollgate_e2e::http_blocking::get(limiter.admin_port(), "/readyz", Duration::from_secs(5))
            .expect("/readyz answers");
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("has not been reached"), "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_leases_from_its_parent_over_mutual_tls() {
    use tollgate_e2e::mtls::MtlsSetup;
    const REGION_ID: &str = "spiffe://test/ns/region-a/sa/limiter";
    let pki = MtlsSetup::new(&tollgate_e2e::paths::new_log_dir("", "pki"), REGION_ID).unwrap();
    let policy = policies(1, "1h", 100);
    let flags = pki.limiter_flags(REGION_ID);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let parent = Limiter::start(&policy, Store::Memory, &flags);
    let url = format!("https://localhost:{}", parent.port());
    let ca = pki.limiter_ca_file.display().to_string();
    let (cert, key) = (
        pki.gateway.cert.display().to_string(),
        pki.gateway.key.display().to_string(),
    );
    let region = |extra: &[&str]| {
        let mut args = vec!["--parent", &url, "--region", "tls", "--parent-ca", &ca];
        args.extend_from_slice(extra);
        Limiter::start(&policy, Store::Memory, &args)
    };

    // With its client certificate: ready once it has reached the parent (the connection is
    // made at start, off any lease's deadline), then leases come from the parent.
    let trusted = region(&["--parent-cert", &cert, "--parent-key", &key]);
    trusted.wait_ready();
    assert_eq!(lease_from(&trusted, "t1"), (200, 3));
    assert!(
        prometheus_value(
            &trusted.metrics(),
            "tollgate_limiter_parent_calls_total{op=\"lease\",outcome=\"ok\"}"
        ) >= 1.0
    );

    // Without one, the parent refuses the handshake: the key is UNAVAILABLE (its failure
    // mode in an Envoy), within the parent deadline, and the parent counts the refusal.
    let anonymous = region(&[]);
    assert_unready_for_the_parent(&anonymous);
    let started = Instant::now();
    let (status, _) = lease_from(&anonymous, "t2");
    assert_eq!(status, 503);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(
        prometheus_value(
            &parent.metrics(),
            "tollgate_limiter_tls_connections_total{result=\"no_client_certificate\"}"
        ) >= 1.0
    );

    // A parent whose certificate the region does not trust is never asked.
    let elsewhere = tollgate_e2e::pki::TestCa::new("another CA");
    let other_ca = elsewhere.write_cert(&pki.dir, "other-ca.crt");
    let other_ca = other_ca.display().to_string();
    let mut args = vec![
        "--parent",
        &url,
        "--region",
        "tls",
        "--parent-ca",
        &other_ca,
    ];
    args.extend_from_slice(&["--parent-cert", &cert, "--parent-key", &key]);
    let untrusting = Limiter::start(&policy, Store::Memory, &args);
    assert_unready_for_the_parent(&untrusting);
    assert_eq!(lease_from(&untrusting, "t3").0, 503);
    assert!(
        prometheus_value(
            &untrusting.metrics(),
            "tollgate_limiter_parent_calls_total{op=\"lease\",outcome=\"unreachable\"}"
        ) >= 1.0
    );

    // An https:// parent without --parent-ca does not start.
    let started = Limiter::try_start(
        &policy,
        Store::Memory,
        &["--parent", &url, "--region", "tls"],
    );
    let Err(err) = started else {
        panic!("started without --parent-ca");
    };
    assert!(err.to_string().contains("--parent-ca"), "{err}");
}
