#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end tests of global limiting under sustained overload: real Envoys (shipped
//! `envoy/global.yaml`, two workers each) loading the built filter, the real limiter on a real
//! `redis-server`. Above the limit each instance holds an assignment (a share of the global
//! refill rate by its demand) and decides admissions and denials locally: the budget holds,
//! the lease calls stay at about one renewal per period whatever the demand, and the budget
//! splits by demand between the instances.

use std::time::{Duration, Instant};

use tollgate_e2e::client::{burst_detailed, Timed};
use tollgate_e2e::tollgate::{
    envoy_config, item, per_tenant_items_policy, policy_metric, prometheus_value, Limiter, Store,
};
use tollgate_e2e::{send, Envoy, EnvoyOptions, HarnessError, RedisServer, Response, Upstream};

const POLICY_NAME: &str = "per-tenant";
/// Pacing of the overload runs.
const TICK_MS: u64 = 40;

fn policy(units: u64, per: &str, burst: u64, timeout: &str) -> String {
    per_tenant_items_policy(POLICY_NAME, units, per, burst, timeout)
}

fn counter(envoy: &Envoy, what: &str) -> u64 {
    policy_metric(envoy, what, POLICY_NAME)
}

fn start_envoy(policy: &str, upstream: &Upstream, limiter_port: u16, workers: u32) -> (Envoy, u16) {
    let envoy = Envoy::start(
        EnvoyOptions::new(envoy_config(
            "envoy/global.yaml",
            policy,
            upstream.port(),
            Some(limiter_port),
        ))
        .concurrency(workers)
        .log_level("warn"),
    );
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

/// One answered request: when its answer came (since the start of the run) and its status
/// (0: no answer).
#[derive(Debug, Clone, Copy)]
struct Answer {
    at: Duration,
    status: u16,
}

/// What one instance saw during a paced run.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    offered: u64,
    admitted: u64,
    /// Answered once the shares had settled (the split between instances is judged on these).
    offered_steady: u64,
    admitted_steady: u64,
    denied: u64,
    other: u64,
}

impl Tally {
    /// Counts `answers`; those answered at or after `steady_from` count as steady too.
    fn of(answers: &[Answer], steady_from: Option<Duration>) -> Self {
        let mut t = Tally::default();
        for a in answers {
            let steady = steady_from.is_some_and(|from| a.at >= from);
            t.offered += 1;
            t.offered_steady += u64::from(steady);
            match a.status {
                200 => {
                    t.admitted += 1;
                    t.admitted_steady += u64::from(steady);
                }
                429 => t.denied += 1,
                _ => t.other += 1,
            }
        }
        t
    }
}

/// A paced run: what each instance answered, how long it took, and when `settled` first held.
struct Run {
    a: Vec<Answer>,
    b: Vec<Answer>,
    elapsed: f64,
    settled_at: Option<Duration>,
}

impl Run {
    fn tallies(&self) -> (Tally, Tally) {
        (
            Tally::of(&self.a, self.settled_at),
            Tally::of(&self.b, self.settled_at),
        )
    }
}

/// Paced demand on two instances for `seconds`: every 40 ms, `per_tick.0` requests to `a` and
/// `per_tick.1` to `b`, one tenant (a tick the client could not keep is sent late, with the
/// next: the offered total stays the same). `settled` is asked every 200 ms, with the time
/// since the start, until it says yes (the run records when); `at_one_second` is called once,
/// one second in (to read counters after the start-up).
async fn paced(
    ports: (u16, u16),
    per_tick: (usize, usize),
    seconds: u64,
    tenant: &'static str,
    mut settled: impl FnMut(Duration) -> bool,
    mut at_one_second: impl FnMut(),
) -> Run {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
    let mut rounds = Vec::new();
    let mut read = false;
    let mut settled_at = None;
    for round in 0..(seconds * 1_000 / TICK_MS) as usize {
        tick.tick().await;
        if !read && start.elapsed() >= Duration::from_secs(1) {
            at_one_second();
            read = true;
        }
        if settled_at.is_none() && round % 5 == 0 && settled(start.elapsed()) {
            settled_at = Some(start.elapsed());
        }
        rounds.push(tokio::spawn(async move {
            // One request per connection, all sent together once every connection is open:
            // each was answered its latency after the start of the slowest one.
            let answers = |results: Vec<Timed<Result<Response, HarnessError>>>| {
                let returned = start.elapsed();
                let slowest = results.iter().map(|r| r.latency).max().unwrap_or_default();
                results
                    .into_iter()
                    .map(|r| Answer {
                        at: returned.saturating_sub(slowest) + r.latency,
                        status: r.response.map_or(0, |resp| resp.status),
                    })
                    .collect::<Vec<_>>()
            };
            tokio::join!(
                async {
                    let results = burst_detailed(
                        ports.0,
                        per_tick.0,
                        per_tick.0,
                        Duration::from_secs(5),
                        |i| item(tenant, round * 100 + i),
                    )
                    .await;
                    answers(results)
                },
                async {
                    let results = burst_detailed(
                        ports.1,
                        per_tick.1,
                        per_tick.1,
                        Duration::from_secs(5),
                        |i| item(tenant, round * 100 + 50 + i),
                    )
                    .await;
                    answers(results)
                },
            )
        }));
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in rounds {
        let (ra, rb) = round.await.unwrap();
        a.extend(ra);
        b.extend(rb);
    }
    Run {
        a,
        b,
        elapsed: start.elapsed().as_secs_f64(),
        settled_at,
    }
}

/// One overload run: bounds on admitted units, lease calls per instance per second after the
/// first second, and the split of the admitted budget between the instances once the shares
/// have settled.
///
/// When the overload starts, the instance whose lease runs dry first is assigned a share
/// against the other's demand as it was reported with its last lease (a few units per second
/// from a cold start), so it gets nearly the whole rate for a period, and the other's first
/// share is what is left; if the other renews before it, that renewal is capped again. The
/// split follows the demand from each instance's third assignment on (both have been
/// assigned since both reported their real demand), which is when the judged window starts
/// (and not before 2 s). It is judged against the split of what was offered in that window
/// (what each Envoy saw, however late the client sent it).
async fn overload_run(per_tick: (usize, usize), tenant: &'static str) {
    let (rate, burst, seconds) = (50u64, 15u64, 8u64);
    let redis = RedisServer::start();
    let policy = policy(rate, "1s", burst, "2s");
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (a, port_a) = start_envoy(&policy, &upstream, limiter.port(), 2);
    let (b, port_b) = start_envoy(&policy, &upstream, limiter.port(), 2);
    let mut calls_at_one_second = (0, 0);
    let run = paced(
        (port_a, port_b),
        per_tick,
        seconds,
        tenant,
        |since_start| {
            since_start >= Duration::from_secs(2)
                && counter(&a, "assignments") >= 3
                && counter(&b, "assignments") >= 3
        },
        || calls_at_one_second = (counter(&a, "lease_requests"), counter(&b, "lease_requests")),
    )
    .await;
    let ((ta, tb), elapsed) = (run.tallies(), run.elapsed);
    let calls = (
        counter(&a, "lease_requests") - calls_at_one_second.0,
        counter(&b, "lease_requests") - calls_at_one_second.1,
    );
    let admitted = ta.admitted + tb.admitted;
    let demand = (ta.offered + tb.offered) as f64 / elapsed;
    let upper = rate as f64 * elapsed + burst as f64;
    let lower = 0.95 * rate as f64 * seconds as f64;
    let per_instance_per_s = (
        calls.0 as f64 / (elapsed - 1.0),
        calls.1 as f64 / (elapsed - 1.0),
    );
    // NaN: never.
    let settled = run.settled_at.map_or(f64::NAN, |at| at.as_secs_f64());
    println!(
        "demand {demand:.0}/s ({:.1}x the rate), split {}:{}: admitted {admitted} in {elapsed:.2} s \
         (allowed [{lower:.0}, {upper:.0}]), instance A {:?}, B {:?}; lease calls per second \
         after the first: A {:.2}, B {:.2}; assignments A {}, B {}; shares settled at {settled:.2} s",
        demand / rate as f64,
        per_tick.0,
        per_tick.1,
        ta,
        tb,
        per_instance_per_s.0,
        per_instance_per_s.1,
        counter(&a, "assignments"),
        counter(&b, "assignments"),
    );
    assert_eq!(ta.other + tb.other, 0, "only 200 and 429 answers");
    assert!(admitted as f64 <= upper, "overshoot: {admitted} > {upper}");
    assert!(admitted as f64 >= lower, "under-use: {admitted} < {lower}");
    assert_eq!(upstream.requests(), admitted);
    for (name, per_s) in [("A", per_instance_per_s.0), ("B", per_instance_per_s.1)] {
        assert!(
            per_s <= 3.0,
            "instance {name}: {per_s:.2} lease calls per second for one key"
        );
    }
    // Three assignments each come within a few periods (1 s), leaving seconds to judge.
    assert!(
        settled <= 5.0,
        "three assignments each not within 5 s: at {settled:.2} s"
    );
    // The admitted split once the shares settled follows the offered split, within ±10 %.
    let want = ta.offered_steady as f64 / tb.offered_steady.max(1) as f64;
    let got = ta.admitted_steady as f64 / tb.admitted_steady.max(1) as f64;
    assert!(
        (got - want).abs() <= 0.1 * want,
        "admitted split {got:.2} for an offered split of {want:.2} ({} vs {} admitted, {} vs {} \
         offered)",
        ta.admitted_steady,
        tb.admitted_steady,
        ta.offered_steady,
        tb.offered_steady
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_times_the_rate_split_evenly_holds_the_budget_with_few_lease_calls() {
    // 3 × 50/s: 75 requests/s to each instance (3 per 40 ms).
    overload_run((3, 3), "even").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_times_the_rate_split_three_to_one_follows_the_demand() {
    // 10 × 50/s = 500/s: 375/s to A and 125/s to B (15 and 5 per 40 ms).
    overload_run((15, 5), "uneven").await;
}

/// The sequential client: 5 per hour, burst 5; 7 requests one after another per tenant, a new
/// connection each, 30 tenants at once, one Envoy. Every tenant gets exactly its burst: 5 × 200
/// then 2 × 429, whatever worker each request lands on.
async fn sequential_clients_get_exactly_their_burst(workers: u32) {
    let policy = policy(5, "1h", 5, "2s");
    let limiter = Limiter::start(&policy, Store::Memory, &[]);
    let upstream = Upstream::start();
    let (envoy, port) = start_envoy(&policy, &upstream, limiter.port(), workers);
    let mut tenants = Vec::new();
    for t in 0..30 {
        tenants.push(tokio::spawn(async move {
            let tenant = format!("seq-{t}");
            let mut statuses = Vec::new();
            for i in 0..7 {
                statuses.push(send(port, item(&tenant, i)).await.status);
            }
            (tenant, statuses)
        }));
    }
    for t in tenants {
        let (tenant, statuses) = t.await.unwrap();
        assert_eq!(
            statuses,
            vec![200, 200, 200, 200, 200, 429, 429],
            "tenant {tenant} with --concurrency {workers}"
        );
    }
    assert_eq!(upstream.requests(), 150);
    println!(
        "--concurrency {workers}: 30 tenants × exactly 5 admitted; {} lease calls",
        counter(&envoy, "lease_requests")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_clients_get_exactly_their_burst_on_two_workers() {
    sequential_clients_get_exactly_their_burst(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_clients_get_exactly_their_burst_on_four_workers() {
    sequential_clients_get_exactly_their_burst(4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denials_under_overload_cost_no_callout() {
    let redis = RedisServer::start();
    let policy = policy(20, "1s", 5, "2s");
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (envoy, port) = start_envoy(&policy, &upstream, limiter.port(), 2);
    // Overload until the instance holds an assignment.
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut round = 0;
    while counter(&envoy, "assignments") == 0 {
        assert!(Instant::now() < deadline, "no assignment within 10 s");
        tick.tick().await;
        burst_detailed(port, 4, 4, Duration::from_secs(5), |i| {
            item("hot", round * 10 + i)
        })
        .await;
        round += 1;
    }
    // Then 600 requests in 1.2 s (25x the rate): hundreds of denials, a renewal or two.
    let before = (counter(&envoy, "lease_requests"), counter(&envoy, "denied"));
    for r in 0..60 {
        tick.tick().await;
        burst_detailed(port, 10, 10, Duration::from_secs(5), |i| {
            item("hot", 10_000 + r * 10 + i)
        })
        .await;
    }
    let calls = counter(&envoy, "lease_requests") - before.0;
    let denied = counter(&envoy, "denied") - before.1;
    println!("overload: {denied} denials answered with {calls} lease calls");
    assert!(denied >= 500, "{denied} denials");
    assert!(calls <= 6, "{calls} lease calls for {denied} denials");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_answer_is_retried_and_sends_no_run_of_failure_mode_answers() {
    // A closed policy with a 200 ms callout deadline. The limiter stops answering for 250 ms
    // while a cold burst starts (the first callout misses its deadline; its retry, sent at
    // once under the same id, is answered when the limiter is back), then answers normally:
    // only requests that waited their whole deadline fail, none sent after the limiter is back.
    let redis = RedisServer::start();
    let policy = policy(1_000, "1s", 1_000, "200ms");
    let mut limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (envoy, port) = start_envoy(&policy, &upstream, limiter.port(), 2);
    // Warm the connection to the limiter with another tenant.
    assert_eq!(send(port, item("warm", 0)).await.status, 200);
    limiter.pause();
    let paused_at = Instant::now();
    let mut resumed_at = None;
    let mut sent = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for i in 0..80 {
        tick.tick().await;
        if resumed_at.is_none() && paused_at.elapsed() >= Duration::from_millis(250) {
            limiter.resume();
            resumed_at = Some(Instant::now());
        }
        let at = Instant::now();
        sent.push(tokio::spawn(async move {
            let r = send(port, item("cold", i)).await;
            (at, r.status)
        }));
    }
    let resumed_at = resumed_at.unwrap();
    let mut failed_after_resume = 0;
    let mut failed = 0;
    for s in sent {
        let (at, status) = s.await.unwrap();
        assert!(status == 200 || status == 503, "{status}");
        if status == 503 {
            failed += 1;
            if at >= resumed_at {
                failed_after_resume += 1;
            }
        }
    }
    let retries = prometheus_value(&envoy.stats_prometheus(), "tollgate_callout_retries");
    println!("slow answer: {failed} of 80 answered 503, {retries} lease requests retried");
    assert!(retries >= 1.0, "the slow callout was retried");
    assert_eq!(
        failed_after_resume, 0,
        "503 after the limiter answered again"
    );
    assert_eq!(counter(&envoy, "lease_unavailable"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_demand_stops_leaves_its_share_to_the_other() {
    // Both instances over the limit for 3 s, then only B for 4 s: from one period (1 s) after
    // A stopped, B admits at the whole rate.
    let (rate, burst) = (50u64, 15u64);
    let redis = RedisServer::start();
    let policy = policy(rate, "1s", burst, "2s");
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    limiter.wait_ready();
    let upstream = Upstream::start();
    let (_a, port_a) = start_envoy(&policy, &upstream, limiter.port(), 2);
    let (_b, port_b) = start_envoy(&policy, &upstream, limiter.port(), 2);
    let began = Instant::now();
    let run = paced((port_a, port_b), (6, 6), 3, "handover", |_| false, || {}).await;
    let (ta, tb) = run.tallies();
    assert!(ta.admitted > 0 && tb.admitted > 0);
    // B alone.
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
    let (mut late, mut alone) = (0u64, 0u64);
    let mut rounds = Vec::new();
    for round in 0..(4_000 / TICK_MS) as usize {
        tick.tick().await;
        let counted = start.elapsed() >= Duration::from_millis(1_200);
        rounds.push(tokio::spawn(async move {
            let results = burst_detailed(port_b, 6, 6, Duration::from_secs(5), |i| {
                item("handover", 1_000_000 + round * 100 + i)
            })
            .await;
            let admitted = results
                .iter()
                .filter(|r| matches!(&r.response, Ok(resp) if resp.status == 200))
                .count() as u64;
            (counted, admitted)
        }));
    }
    for r in rounds {
        let (counted, admitted) = r.await.unwrap();
        alone += admitted;
        if counted {
            late += admitted;
        }
    }
    // The whole run stays within burst + rate × t (A's unspent tokens come back to the
    // bucket when its lease expires, so B's last seconds may run a little above the rate).
    let total = ta.admitted + tb.admitted + alone;
    let bound = burst as f64 + rate as f64 * began.elapsed().as_secs_f64();
    assert!(total as f64 <= bound, "overshoot: {total} > {bound:.0}");
    let span = start.elapsed().as_secs_f64() - 1.2;
    let per_s = late as f64 / span;
    println!("after A stopped: B admitted {per_s:.1}/s (rate {rate}/s)");
    assert!(per_s >= 0.9 * rate as f64, "B admits {per_s:.1}/s");
}
