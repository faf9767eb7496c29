//! `just bench` driver: starts every scenario's processes on loopback (real Envoys with the
//! built filter, real limiters and redis-servers, an in-process HTTP upstream), loads each with
//! wrk in interleaved rounds, then writes `bench/results/latest.{md,json}` and prints the table.
//!
//! Scenarios (same Envoy binary, same wrk script, same route, 100 tenants in x-tenant-id):
//!   1  Envoy, no rate-limit filter (ceiling)       2  Envoy's local_ratelimit filter
//!   3  tollgate, no policy matches                 4  tollgate, one local policy
//!   5  tollgate, one global policy (leases)        6  the same, batching off (lease_max 1)
//!   5t 5 with the limiter behind mutual TLS: Envoy runs `envoy/global-mtls.yaml` (client
//!      certificate and limiter CA by SDS from files), the limiter `--tls-cert/--tls-key/
//!      --tls-client-ca/--tls-allow`; certificates made for the run (`tollgate_e2e::pki`).
//!      Envoy's connections to the limiter are long-lived: handshakes are counted, not timed
//!   5h 5 with leases sized for 1 s of demand instead of 250 ms (`limiter.lease_horizon`)
//!   4s, 5s: 4 and 5 with settlement: the route's cost (10) is the reservation and the
//!      actual cost is settled from the `x-usage-units` response header (1, added to every
//!      answer by the route), so every request is refunded 9; reported next to 4 and 5 from
//!      the same rounds, and the run fails when the filter settled no units
//!   4f, 4w, 4l: 4 counted by `fixed_window`, `sliding_window` and `sliding_log` instead of the
//!      token bucket (`burst` left out, as windowed policies require); reported next to 4 from
//!      the same rounds with what the filter denied. The windows keep 4's rate (a billion per
//!      1 s); the log, at most 256 per window, counts over 50 ms (`config::LOG_WINDOW`: the
//!      hottest of 100 Zipf tenants fills it only past ~26,500 req/s in all)
//!   1u, 5u: 1 and 5 against a real HTTP upstream instead of a direct response
//!   3n, 4n, 5n: 3, 4 and 5 with the native build of the filter (the dynamic module
//!      `libtollgate_native.so`, `envoy.filters.http.dynamic_modules`) instead of the .wasm;
//!      3n (no policy matches) is the module's own floor, reported as S3n × S1 and S4n × S3n
//!   8  Envoy's own `envoy.filters.http.ratelimit` filter (no tollgate filter) calling the
//!      limiter's RateLimitService over gRPC (h2c on loopback), counting in Redis: one call per
//!      request, the tenant (`x-tenant-id`) as the descriptor, a limit that never denies,
//!      `failure_mode_deny: false`, S6's callout deadline (`envoy/ratelimit-service.yaml`,
//!      `config::ratelimit_service`). Measured like 5 and 6 in the same rounds; the report
//!      gives S5 / S8 in req/s and S8's limiter + Redis CPU per decision against S6's
//!   7  over limit: two Envoys, one global policy, paced demand per key at 3 × the rate split
//!      evenly, 10 × split evenly and 10 × split 3:1, by a Rust load generator (`paced.rs`:
//!      per-answer status and latency, which wrk cannot give)
//! 1–6, 8, 4s, 5s, 4f, 4w, 4l, 5t and the native ones never deny (4l's report line says so if it did). Every
//! process is killed when the driver exits (the harness ties children to it), also on Ctrl-C.
//!
//! Flags: [`USAGE`] (`tollgate-bench --help`). Scenario 7 runs `--s7-seconds` per variant and
//! round: 3 rounds take about 80 s.
//!
//! Besides latest.{md,json} a run writes `ratios.svg` (when it has ratios to S3) and
//! `overload.svg` (when it ran scenario 7) into --out. `tollgate-bench chart [--out DIR]
//! FILE...` draws them again from stored results, each chart from the first FILE that has its
//! data (`just bench-charts`). `tollgate-bench shared-state [KEYS]` prints the bytes of shared
//! state per key of each algorithm (`footprint.rs`; `micro-summary` adds the same table to
//! micro.md), measured against in-memory shared data, in well under a second.

#![forbid(unsafe_code)]
#![allow(clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tollgate_bench::chart;
use tollgate_bench::config::{
    self, PolicyDoc, ALGORITHMS, CLOSED, LOG_WINDOW, MAX_LOG_LIMIT, NO_MATCH_ROUTE, ROUTE,
    SETTLE_ACTUAL, SETTLE_HEADER, SETTLE_RESERVED,
};
use tollgate_bench::footprint;
use tollgate_bench::micro;
use tollgate_bench::paced;
use tollgate_bench::report::{InstanceRun, Latency, OverLimitRun, Report, Run, Scenario, Setup};
use tollgate_bench::stats::{cpu_seconds, peak_rss};
use tollgate_bench::wrk::{self, Load};
use tollgate_e2e::build::Build;
use tollgate_e2e::mtls::MtlsSetup;
use tollgate_e2e::redis::commandstats_calls as redis_calls;
use tollgate_e2e::redis::RedisOptions;
use tollgate_e2e::tollgate::{envoy_config, prometheus_value, Limiter, Store};
use tollgate_e2e::upstream::MockResponse;
use tollgate_e2e::{free_port, paths, Envoy, EnvoyOptions, RedisServer, Upstream};

struct Args {
    rounds: u32,
    seconds: f64,
    warmup: f64,
    connections: u32,
    threads: u32,
    concurrency: u32,
    tenants: u32,
    distribution: String,
    only: Option<Vec<String>>,
    s7_seconds: f64,
    out: PathBuf,
    write: bool,
}

/// What `--help` prints (the flags; the scenarios are described at the top of this file).
const USAGE: &str = "\
usage: tollgate-bench [FLAGS]                 (or `just bench [FLAGS]`)
       tollgate-bench chart [--out DIR] FILE...
       tollgate-bench shared-state [KEYS]

Runs the scenarios in interleaved rounds and writes bench/results/latest.{md,json}.
  --rounds N         rounds (3)               --seconds S      seconds per run (5)
  --warmup S         warm-up seconds (2)      --connections N  wrk connections (64)
  --threads N        wrk threads (1)          --concurrency N  Envoy workers (1)
  --tenants N        tenants (100)            --distribution zipf|uniform (zipf)
  --only IDS         scenario ids, e.g. 1,3,4,4n or 5,6,8 (7: the over-limit run)
  --s7-seconds S     scenario 7 per variant and round (8)
  --out DIR          where results go (bench/results)
  --no-write         print only
Scenario ids: 1 2 3 4 4s 4f 4w 4l 5 5s 5t 5h 6 8 1u 5u 3n 4n 5n 7 (see bench/src/main.rs).";

fn args() -> Args {
    args_from(std::env::args().skip(1).collect())
}

fn args_from(argv: Vec<String>) -> Args {
    let mut a = Args {
        rounds: 3,
        seconds: 5.0,
        warmup: 2.0,
        connections: 64,
        threads: 1,
        concurrency: 1,
        tenants: 100,
        distribution: "zipf".into(),
        only: None,
        s7_seconds: 8.0,
        out: paths::workspace_root().join("bench/results"),
        write: true,
    };
    let mut it = argv.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| panic!("{flag} needs a value (see bench/src/main.rs)"))
        };
        let number = |v: String| -> f64 {
            v.parse()
                .unwrap_or_else(|_| panic!("{flag}: `{v}` is not a number"))
        };
        match flag.as_str() {
            "--rounds" => a.rounds = number(value()) as u32,
            "--seconds" => a.seconds = number(value()),
            "--warmup" => a.warmup = number(value()),
            "--connections" => a.connections = number(value()) as u32,
            "--threads" => a.threads = number(value()) as u32,
            "--concurrency" => a.concurrency = number(value()) as u32,
            "--tenants" => a.tenants = number(value()) as u32,
            "--distribution" => a.distribution = value(),
            "--only" => a.only = Some(value().split(',').map(str::to_string).collect()),
            "--s7-seconds" => a.s7_seconds = number(value()),
            "--out" => a.out = PathBuf::from(value()),
            "--no-write" => a.write = false,
            "--bench" => {} // passed by `cargo bench`
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => {
                eprintln!("unknown flag {other}\n\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
    assert!(
        a.rounds >= 1 && a.seconds > 0.0 && a.connections >= 1 && a.threads >= 1,
        "rounds, seconds, connections and threads must be positive"
    );
    assert!(
        matches!(a.distribution.as_str(), "zipf" | "uniform"),
        "--distribution is zipf or uniform"
    );
    a
}

/// One scenario's processes.
struct Env {
    id: &'static str,
    title: String,
    envoy: Envoy,
    port: u16,
    redis: Option<RedisServer>,
    limiter: Option<Limiter>,
    /// Its policy settles the actual cost (4s, 5s): the run checks that units were settled.
    settles: bool,
    /// Its policy names a windowed algorithm (4f, 4w, 4l): the filter's denials are reported.
    algorithm: Option<&'static str>,
    /// Envoy's ratelimit filter calls the limiter's RateLimitService (8): its counters are
    /// that filter's and the limiter's RLS ones.
    rls: bool,
}

#[derive(Clone, Copy)]
enum Filter {
    None,
    Native,
    Tollgate,
    /// Envoy's `envoy.filters.http.ratelimit` calling the limiter's RateLimitService (8).
    RateLimitService,
}

struct Spec {
    id: &'static str,
    title: String,
    filter: Filter,
    /// Policy document for tollgate; global ones get a limiter and Redis.
    policy: Option<PolicyDoc<'static>>,
    upstream: bool,
    /// Global only: the limiter behind mutual TLS (`envoy/global-mtls.yaml`).
    mtls: bool,
    /// Which build of tollgate Envoy loads.
    build: Build,
}

fn specs() -> Vec<Spec> {
    let default_ms = config::default_lease_horizon_ms().expect("the test policy is valid");
    let horizon = config::contrasting_horizon(default_ms);
    let settling = |base: &str| {
        format!(
            "{base} + settlement (reserve {SETTLE_RESERVED}, `{SETTLE_HEADER}: {SETTLE_ACTUAL}` \
             refunds {})",
            SETTLE_RESERVED - SETTLE_ACTUAL
        )
    };
    let spec_of = |id: &'static str, algorithm: &'static str| Spec {
        id,
        title: if algorithm == "sliding_log" {
            format!("4 counted by `{algorithm}` ({MAX_LOG_LIMIT} per {LOG_WINDOW}, no burst)")
        } else {
            format!("4 counted by `{algorithm}` (10⁹ per 1 s window, no burst)")
        },
        filter: Filter::Tollgate,
        policy: Some(PolicyDoc::local(ROUTE).counted_by(algorithm)),
        upstream: false,
        mtls: false,
        build: Build::Wasm,
    };
    let mut specs = vec![
        Spec {
            id: "1",
            title: "Envoy, no rate-limit filter (ceiling)".into(),
            filter: Filter::None,
            policy: None,
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "2",
            title: "Envoy `local_ratelimit` (never denying)".into(),
            filter: Filter::Native,
            policy: None,
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "3",
            title: "tollgate, no policy matches".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::local(NO_MATCH_ROUTE)),
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "4",
            title: "tollgate, one local policy".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::local(ROUTE)),
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "4s",
            title: settling("4"),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::local(ROUTE).settling()),
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "5",
            title: "tollgate, one global policy, leases (limiter + Redis)".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::global(None)),
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "5s",
            title: settling("5"),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::global(None).settling()),
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "6",
            title: "tollgate, global, batching off (`lease_max: 1`)".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::global(Some(1))),
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "8",
            title: "Envoy `ratelimit` filter → limiter RateLimitService (gRPC, Redis), one call \
                    per request"
                .into(),
            filter: Filter::RateLimitService,
            policy: None,
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "5t",
            title: "5 with the limiter behind mutual TLS (`global-mtls.yaml`)".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::global(None)),
            upstream: false,
            mtls: true,
            build: Build::Wasm,
        },
        Spec {
            id: "5h",
            title: format!("5 with `lease_horizon: {horizon}` (default {default_ms} ms)"),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc {
                lease_horizon: Some(horizon),
                ..PolicyDoc::global(None)
            }),
            upstream: false,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "1u",
            title: "1 against a real HTTP upstream".into(),
            filter: Filter::None,
            policy: None,
            upstream: true,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "5u",
            title: "5 against a real HTTP upstream".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::global(None)),
            upstream: true,
            mtls: false,
            build: Build::Wasm,
        },
        Spec {
            id: "3n",
            title: "3 with the native build (dynamic module): no policy matches".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::local(NO_MATCH_ROUTE)),
            upstream: false,
            mtls: false,
            build: Build::Native,
        },
        Spec {
            id: "4n",
            title: "4 with the native build (dynamic module)".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::local(ROUTE)),
            upstream: false,
            mtls: false,
            build: Build::Native,
        },
        Spec {
            id: "5n",
            title: "5 with the native build (dynamic module)".into(),
            filter: Filter::Tollgate,
            policy: Some(PolicyDoc::global(None)),
            upstream: false,
            mtls: false,
            build: Build::Native,
        },
    ];
    // 4f, 4w and 4l go beside 4 and 4s.
    let after_4s = specs
        .iter()
        .position(|s| s.id == "4s")
        .map_or(specs.len(), |i| i + 1);
    specs.splice(
        after_4s..after_4s,
        ALGORITHMS
            .iter()
            .map(|&(id, algorithm)| spec_of(id, algorithm)),
    );
    specs
}

fn start_redis(label: &str) -> RedisServer {
    RedisServer::start_with(RedisOptions {
        name: format!("bench-{label}"),
        ..RedisOptions::default()
    })
}

/// The identity in the gateway's client certificate, the one the limiter's `--tls-allow` lists.
const GATEWAY_ID: &str = "spiffe://bench/ns/edge/sa/gateway";

fn start_env(spec: &Spec, upstream: &Upstream, concurrency: u32) -> Env {
    if let Filter::RateLimitService = spec.filter {
        return start_rls_env(spec, upstream, concurrency);
    }
    let global = spec.policy.as_ref().is_some_and(|p| p.scope == "global");
    let policy = spec
        .policy
        .as_ref()
        .map_or_else(|| PolicyDoc::local(ROUTE).json(), PolicyDoc::json);
    let edit = |r: Result<String, String>| r.unwrap_or_else(|e| panic!("S{}: {e}", spec.id));
    // Scenario 5t's certificates, made for the run, as `envoy/global-mtls.yaml` expects them.
    let pki = (global && spec.mtls).then(|| {
        let dir = paths::new_log_dir("bench", &format!("s{}-pki", spec.id));
        MtlsSetup::new(&dir, GATEWAY_ID).unwrap_or_else(|e| panic!("S{}: {e}", spec.id))
    });
    let (redis, limiter) = if global {
        let redis = start_redis(spec.id);
        let flags = pki
            .as_ref()
            .map(|pki| pki.limiter_flags(GATEWAY_ID))
            .unwrap_or_default();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &flags);
        (Some(redis), Some(limiter))
    } else {
        (None, None)
    };
    let shipped = match (global, &pki) {
        (true, Some(_)) => "envoy/global-mtls.yaml",
        (true, None) => "envoy/global.yaml",
        (false, _) => "envoy/local.yaml",
    };
    let mut yaml = envoy_config(
        shipped,
        &policy,
        upstream.port(),
        limiter.as_ref().map(Limiter::port),
    );
    if let Some(pki) = &pki {
        yaml = edit(pki.localize(&yaml).map_err(|e| e.to_string()));
    }
    yaml = match spec.filter {
        Filter::None => edit(config::without_wasm(&yaml)),
        Filter::Native => edit(config::with_native_local_ratelimit(&yaml)),
        // (8 has its own config: `start_rls_env`.)
        Filter::Tollgate | Filter::RateLimitService => spec.build.config(yaml),
    };
    if !spec.upstream {
        yaml = edit(config::direct_response(&yaml));
    }
    // Every answer carries the actual cost the settling policy reads (below the reservation:
    // a refund per request).
    let settle_header = spec.policy.as_ref().and_then(|p| p.settle_header);
    if let Some(header) = settle_header {
        yaml = edit(config::with_response_header(
            &yaml,
            header,
            &SETTLE_ACTUAL.to_string(),
        ));
    }
    let envoy = Envoy::start(
        EnvoyOptions::new(yaml)
            .concurrency(concurrency)
            .log_level("warn")
            .name(format!("bench-s{}", spec.id)),
    );
    let port = envoy.listener_port("ingress");
    Env {
        id: spec.id,
        title: spec.title.clone(),
        envoy,
        port,
        redis,
        limiter,
        settles: settle_header.is_some(),
        algorithm: spec.policy.as_ref().and_then(|p| p.algorithm),
        rls: false,
    }
}

/// No lease policies: S8's limiter serves the RateLimitService only.
const NO_POLICIES: &str = r#"{"policies":[]}"#;

/// Scenario 8: Redis, the limiter serving the RateLimitService (`--rls-listen` on a free
/// loopback port, plaintext: h2c) from [`config::rls_limits`], and Envoy running the shipped
/// `envoy/ratelimit-service.yaml` made ready by [`config::ratelimit_service`].
fn start_rls_env(spec: &Spec, upstream: &Upstream, concurrency: u32) -> Env {
    let fail = |e: String| -> ! { panic!("S{}: {e}", spec.id) };
    let redis = start_redis(spec.id);
    let dir = paths::new_log_dir("bench", &format!("s{}-rls", spec.id));
    let limits = dir.join("limits.yaml");
    std::fs::write(&limits, config::rls_limits())
        .unwrap_or_else(|e| fail(format!("write {}: {e}", limits.display())));
    let limits = limits.display().to_string();
    // The RateLimitService's port is free when picked, not when the limiter binds it: a
    // limiter that did not start, or whose log does not say it serves *that* port, is tried
    // again on another.
    let mut last = String::new();
    let mut started = None;
    for _ in 0..8 {
        let rls_port = free_port();
        let listen = format!("127.0.0.1:{rls_port}");
        let flags = ["--rls-listen", &listen, "--rls-config", &limits];
        match Limiter::try_start(NO_POLICIES, Store::Redis(redis.url()), &flags) {
            Ok(limiter)
                if limiter.logs().lines().any(|l| {
                    l.contains("RateLimitService (gRPC) listening") && l.contains(&listen)
                }) =>
            {
                started = Some((limiter, rls_port));
                break;
            }
            Ok(limiter) => last = format!("no RateLimitService on {listen}:\n{}", limiter.logs()),
            Err(e) => last = e.to_string(),
        }
    }
    let (limiter, rls_port) =
        started.unwrap_or_else(|| fail(format!("the limiter did not start: {last}")));
    // Its store answers before the first request is timed.
    limiter.wait_ready();
    let shipped = paths::workspace_root().join("envoy/ratelimit-service.yaml");
    let shipped = std::fs::read_to_string(&shipped)
        .unwrap_or_else(|e| fail(format!("read {}: {e}", shipped.display())));
    let yaml =
        config::ratelimit_service(&shipped, upstream.port(), rls_port).unwrap_or_else(|e| fail(e));
    let envoy = Envoy::start(
        EnvoyOptions::new(yaml)
            .concurrency(concurrency)
            .log_level("warn")
            .name(format!("bench-s{}", spec.id)),
    );
    let port = envoy.listener_port("ingress");
    Env {
        id: spec.id,
        title: spec.title.clone(),
        envoy,
        port,
        redis: Some(redis),
        limiter: Some(limiter),
        settles: false,
        algorithm: None,
        rls: true,
    }
}

fn load(a: &Args, seconds: f64, seed: u64) -> Load {
    Load {
        threads: a.threads,
        connections: a.connections,
        duration: Duration::from_secs_f64(seconds),
        tenants: a.tenants,
        distribution: a.distribution.clone(),
        seed,
        prefix: "tenant-".into(),
    }
}

fn filter_counters(envoy: &Envoy, limiter: Option<&Limiter>) -> Vec<(String, u64)> {
    let text = envoy.stats_prometheus();
    let get = |name: &str| {
        prometheus_value(&text, &format!("tollgate_{name}{{policy=\"per-tenant\"}}")) as u64
    };
    let undecided = [
        "fail_open",
        "fail_closed",
        "fallback_allowed",
        "fallback_denied",
    ]
    .iter()
    .map(|n| get(n))
    .sum::<u64>();
    let allowed = get("allowed");
    vec![
        ("allowed".into(), allowed),
        ("denied".into(), get("denied")),
        ("undecided".into(), undecided),
        ("decided".into(), allowed + get("denied") + undecided),
        ("lease_requests".into(), get("lease_requests")),
        ("tokens_granted".into(), get("tokens_granted")),
        (
            "callouts_failed".into(),
            prometheus_value(&text, "tollgate_callouts_failed") as u64,
        ),
        (
            "wait_deadline_passed".into(),
            prometheus_value(&text, "tollgate_wait_deadline_passed") as u64,
        ),
        // Envoy's connections to the limiter, and the TLS handshakes on them (none over h2c):
        // long-lived, so a handful for the whole run, none per request.
        (
            "limiter_connections".into(),
            envoy
                .counter("cluster.tollgate_limiter.upstream_cx_total")
                .unwrap_or(0),
        ),
        (
            "limiter_tls_handshakes".into(),
            envoy
                .counter("cluster.tollgate_limiter.ssl.handshake")
                .unwrap_or(0),
        ),
        // Settlement (4s, 5s): units reserved at admission, the actual units settled when the
        // response ended, what went back, what was charged beyond the reservation, and the
        // streams that ended without a usable actual cost.
        ("units_reserved".into(), get("units_reserved")),
        ("units_settled".into(), get("units_settled")),
        ("units_refunded".into(), get("units_refunded")),
        ("units_debt".into(), get("units_debt")),
        ("usage_missing".into(), get("usage_missing")),
        // Global policies: the settled units the limiter was told of (they ride on the lease
        // and return calls, so the last ones of the run may still be on their way).
        (
            "limiter_units_settled".into(),
            limiter.map_or(0, |l| {
                prometheus_value(
                    &l.metrics(),
                    "tollgate_limiter_units_settled_total{policy=\"per-tenant\"}",
                ) as u64
            }),
        ),
    ]
}

/// Scenario 8's counters, whole run (warm-up included): Envoy's ratelimit filter's answers
/// (`cluster.demo_upstream.ratelimit.*`: the route's cluster), the calls that failed and were
/// let through undecided (`failure_mode_deny: false`), Envoy's connections to the
/// RateLimitService, and the calls the limiter answered.
/// Scenario 8's calls that failed so far (let through undecided).
fn rls_errors(envoy: &Envoy) -> u64 {
    envoy
        .counter("cluster.demo_upstream.ratelimit.error")
        .unwrap_or(0)
}

fn rls_counters(envoy: &Envoy, limiter: Option<&Limiter>) -> Vec<(String, u64)> {
    let stat = |name: &str| {
        envoy
            .counter(&format!("cluster.demo_upstream.ratelimit.{name}"))
            .unwrap_or(0)
    };
    let (ok, over_limit, error) = (stat("ok"), stat("over_limit"), stat("error"));
    let limiter_calls = limiter.map_or(0, |l| {
        let text = l.metrics();
        text.lines()
            .filter(|line| line.starts_with("tollgate_limiter_rls_calls_total{"))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    });
    vec![
        ("allowed".into(), ok),
        ("denied".into(), over_limit),
        ("rls_errors".into(), error),
        (
            "rls_failure_mode_allowed".into(),
            stat("failure_mode_allowed"),
        ),
        ("decided".into(), ok + over_limit),
        ("limiter_rls_calls".into(), limiter_calls),
        (
            "limiter_connections".into(),
            envoy
                .counter("cluster.tollgate_rls.upstream_cx_total")
                .unwrap_or(0),
        ),
    ]
}

fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn setup(a: &Args) -> Setup {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_default();
    let envoy = command_line(&paths::envoy_bin().to_string_lossy(), &["--version"]);
    let envoy = envoy
        .split("version: ")
        .nth(1)
        .and_then(|v| v.split('/').nth(1))
        .map_or("Envoy".to_string(), |v| format!("Envoy {v}"));
    // Results written by an earlier run do not make the measured code "changed".
    let dirty = !command_line(
        "git",
        &[
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":!bench/results",
        ],
    )
    .is_empty();
    Setup {
        date: command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        commit: format!(
            "{}{}",
            command_line("git", &["rev-parse", "--short", "HEAD"]),
            if dirty { "+changes" } else { "" }
        ),
        machine: format!(
            "{cpus} CPUs ({model}), shared by load generator, Envoy, limiter and Redis"
        ),
        envoy,
        concurrency: a.concurrency,
        wrk_threads: a.threads,
        connections: a.connections,
        seconds: a.seconds,
        rounds: a.rounds,
        tenants: a.tenants,
        distribution: match a.distribution.as_str() {
            "zipf" => "Zipf-like, weight 1/rank".into(),
            other => other.into(),
        },
    }
}

/// Per-tenant request counts at the upstream, for scenario 7.
type Counts = Arc<Mutex<HashMap<String, u64>>>;

fn counting_upstream() -> (Upstream, Counts) {
    let counts: Counts = Arc::default();
    let seen = Arc::clone(&counts);
    let upstream = Upstream::with_handler(move |req| {
        let tenant = req.header("x-tenant-id").unwrap_or("").to_string();
        *seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tenant)
            .or_insert(0) += 1;
        MockResponse::new(200, "ok")
    });
    (upstream, counts)
}

/// Scenario 7: keys per variant, the policy's rate per key and burst, the warm-up left out
/// of the instance split.
const S7_TENANTS: u32 = 4;
const S7_RATE: u64 = 40;
const S7_BURST: u64 = 10;
const S7_WARMUP: Duration = Duration::from_secs(2);
/// Quiet time after each variant before its counters are read, so the answers to its last
/// lease calls are counted with it and not with the next variant.
const S7_SETTLE: Duration = Duration::from_millis(500);

/// One kind of overload: demand per key as a multiple of the rate, split A:B.
struct Variant {
    name: &'static str,
    /// Tenant name part (fresh keys per variant and round).
    slug: &'static str,
    multiple: f64,
    split: (u32, u32),
}

const S7_VARIANTS: [Variant; 3] = [
    Variant {
        name: "3× even",
        slug: "3x11",
        multiple: 3.0,
        split: (1, 1),
    },
    Variant {
        name: "10× even",
        slug: "10x11",
        multiple: 10.0,
        split: (1, 1),
    },
    Variant {
        name: "10× 3:1",
        slug: "10x31",
        multiple: 10.0,
        split: (3, 1),
    },
];

/// Counters of one Envoy that scenario 7 takes differences of.
#[derive(Debug, Clone, Copy, Default)]
struct S7Counters {
    lease_calls: u64,
    assignments: u64,
    retries: u64,
    undecided: u64,
}

fn s7_counters(envoy: &Envoy) -> S7Counters {
    let text = envoy.stats_prometheus();
    let get = |name: &str| {
        prometheus_value(&text, &format!("tollgate_{name}{{policy=\"per-tenant\"}}")) as u64
    };
    S7Counters {
        lease_calls: get("lease_requests"),
        assignments: get("assignments"),
        retries: prometheus_value(&text, "tollgate_callout_retries") as u64,
        undecided: [
            "fail_open",
            "fail_closed",
            "fallback_allowed",
            "fallback_denied",
        ]
        .iter()
        .map(|n| get(n))
        .sum(),
    }
}

/// Scenario 7: two Envoys share one global policy (S7_RATE/s per key, burst S7_BURST); every
/// round runs each variant in turn on S7_TENANTS fresh keys, paced by the harness client.
fn over_limit(a: &Args) -> Vec<OverLimitRun> {
    let (upstream, counts) = counting_upstream();
    let policy = PolicyDoc {
        rate: (S7_RATE, S7_BURST),
        on_unavailable: CLOSED,
        ..PolicyDoc::global(None)
    }
    .json();
    let redis = start_redis("s7");
    let limiter = Limiter::start(&policy, Store::Redis(redis.url()), &[]);
    let envoys: Vec<(Envoy, u16)> = ["a", "b"]
        .iter()
        .map(|name| {
            let yaml = envoy_config(
                "envoy/global.yaml",
                &policy,
                upstream.port(),
                Some(limiter.port()),
            );
            let envoy = Envoy::start(
                EnvoyOptions::new(yaml)
                    .concurrency(a.concurrency)
                    .log_level("warn")
                    .name(format!("bench-s7{name}")),
            );
            let port = envoy.listener_port("ingress");
            eprintln!("  S7 Envoy {} up on :{port}", name.to_uppercase());
            (envoy, port)
        })
        .collect();
    let (Some((envoy_a, port_a)), Some((envoy_b, port_b))) = (envoys.first(), envoys.get(1)) else {
        panic!("S7 needs two Envoys");
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime for the load generator");
    let counters = || [s7_counters(envoy_a), s7_counters(envoy_b)];
    let mut runs = Vec::new();
    for round in 0..a.rounds {
        // Rotate the order each round so no variant always runs first.
        for k in 0..S7_VARIANTS.len() {
            let Some(v) = S7_VARIANTS.get((k + round as usize) % S7_VARIANTS.len()) else {
                continue;
            };
            let tenants: Vec<String> = (0..S7_TENANTS)
                .map(|t| format!("s7r{round}-{}-k{t}", v.slug))
                .collect();
            let per_key = v.multiple * S7_RATE as f64;
            let parts = f64::from(v.split.0 + v.split.1);
            let demand = [
                paced::Demand {
                    port: *port_a,
                    per_key_per_s: per_key * f64::from(v.split.0) / parts,
                },
                paced::Demand {
                    port: *port_b,
                    per_key_per_s: per_key * f64::from(v.split.1) / parts,
                },
            ];
            let before = counters();
            let redis_before = redis_calls(&redis.info("commandstats"));
            let mut at_one_second = [S7Counters::default(); 2];
            let (tallies, seconds) = runtime.block_on(paced::run(
                demand,
                &tenants,
                a.s7_seconds,
                S7_WARMUP,
                || at_one_second = counters(),
            ));
            std::thread::sleep(S7_SETTLE);
            let after = counters();
            let redis_after = redis_calls(&redis.info("commandstats"));
            let admitted: Vec<(String, u64)> = {
                let counts = counts.lock().unwrap_or_else(|p| p.into_inner());
                tenants
                    .iter()
                    .map(|t| (t.clone(), counts.get(t).copied().unwrap_or(0)))
                    .collect()
            };
            let mut admitted_us = Vec::new();
            let mut denied_us = Vec::new();
            let mut instances: [InstanceRun; 2] = Default::default();
            for (i, t) in tallies.into_iter().enumerate() {
                let (Some(b), Some(one), Some(af), Some(slot)) = (
                    before.get(i),
                    at_one_second.get(i),
                    after.get(i),
                    instances.get_mut(i),
                ) else {
                    continue;
                };
                *slot = InstanceRun {
                    offered: t.offered,
                    admitted: t.admitted,
                    denied: t.denied,
                    other: t.other,
                    offered_steady: t.offered_steady,
                    admitted_steady: t.admitted_steady,
                    lease_calls: af.lease_calls - b.lease_calls,
                    lease_calls_after_1s: af.lease_calls - one.lease_calls,
                    assignments: af.assignments - b.assignments,
                    per_second: t.per_second,
                };
                admitted_us.extend(t.admitted_us);
                denied_us.extend(t.denied_us);
            }
            let delta = |f: fn(&S7Counters) -> u64| -> u64 {
                after.iter().map(f).sum::<u64>() - before.iter().map(f).sum::<u64>()
            };
            let run = OverLimitRun {
                round,
                variant: v.name.into(),
                multiple: v.multiple,
                split: v.split,
                seconds,
                warmup_s: S7_WARMUP.as_secs_f64(),
                tenants: S7_TENANTS,
                rate: S7_RATE,
                burst: S7_BURST,
                demanded: instances.iter().map(|i| i.offered).sum(),
                admitted,
                undecided: delta(|c| c.undecided),
                retries: delta(|c| c.retries),
                instances,
                redis: Some((
                    redis_after.0 - redis_before.0,
                    redis_after.1 - redis_before.1,
                )),
                admitted_latency: Latency::of(admitted_us),
                denied_latency: Latency::of(denied_us),
            };
            let [la, lb] = run.lease_calls_per_key_instance_s();
            let client_admitted: u64 = run.instances.iter().map(|i| i.admitted).sum();
            eprintln!(
                "  S7 round {round} {:<8} {:.2} s, demand {:.2} × rate, admitted {} of {:.0} \
                 (overshoot {:.2} %, under-use {:.2} %), lease calls/key/instance/s A {:.2} B {:.2}, \
                 {:.1} FCALL/s, split {:.2} for {:.2}, 429 p99 {:.2} ms{}",
                v.name,
                run.seconds,
                run.demand_ratio(),
                run.admitted_total(),
                run.allowed_total(),
                run.overshoot_pct(),
                run.underuse_pct(),
                la.unwrap_or(f64::NAN),
                lb.unwrap_or(f64::NAN),
                run.fcalls_per_s().unwrap_or(f64::NAN),
                run.admitted_split().unwrap_or(f64::NAN),
                run.demand_split().unwrap_or(f64::NAN),
                run.denied_latency.p99_us.map_or(f64::NAN, |us| us as f64 / 1e3),
                if client_admitted == run.admitted_total() && run.other() == 0 {
                    String::new()
                } else {
                    format!(
                        "  [{} answered 200 but {} reached the upstream; {} neither 200 nor 429]",
                        client_admitted,
                        run.admitted_total(),
                        run.other()
                    )
                }
            );
            runs.push(run);
        }
    }
    drop(runtime);
    drop(envoys);
    drop(limiter);
    drop(redis);
    runs
}

/// CPU seconds so far: `(Envoy, limiter + Redis)`.
fn cpu_of(env: &Env) -> (Option<f64>, Option<f64>) {
    let envoy = cpu_seconds(env.envoy.pid());
    let backend = match (&env.limiter, &env.redis) {
        (Some(l), Some(r)) => cpu_seconds(l.pid())
            .zip(cpu_seconds(r.pid()))
            .map(|(a, b)| a + b),
        _ => None,
    };
    (envoy, backend)
}

/// `tollgate-bench micro-summary`: the criterion results as bench/results/micro.{md,json}.
fn micro_summary(out: &std::path::Path) {
    let estimates = micro::read(&paths::target_dir().join("criterion"));
    assert!(
        !estimates.is_empty(),
        "no criterion results in target/criterion: run `just bench-micro`"
    );
    let header = {
        let s = setup(&args_from(Vec::new()));
        format!(
            "{}, commit `{}`, {}; native code (profile `server`), criterion medians. The filter \
             runs the same code as wasm32 in V8, several times slower: see docs/src/benchmarks/index.md.",
            s.date, s.commit, s.machine
        )
    };
    let footprints = footprint::measure(footprint::KEYS)
        .unwrap_or_else(|e| panic!("bytes of shared state per key: {e}"));
    let md = micro::markdown(&estimates, &footprints, &header);
    println!("{md}");
    std::fs::create_dir_all(out).expect("create the results directory");
    std::fs::write(out.join("micro.md"), &md).expect("write micro.md");
    let json =
        serde_json::to_string_pretty(&micro::json(&estimates, &footprints, &header)).expect("JSON");
    std::fs::write(out.join("micro.json"), json + "\n").expect("write micro.json");
}

/// `tollgate-bench shared-state [KEYS]`: the bytes of shared state per key (the table
/// `micro-summary` adds to micro.md), printed only; nothing is timed or written.
fn shared_state(argv: Vec<String>) {
    let keys = match argv.first().map(|k| k.parse::<usize>()) {
        None => footprint::KEYS,
        Some(Ok(keys)) if keys > 0 => keys,
        Some(_) => {
            eprintln!("shared-state: KEYS is a positive number");
            std::process::exit(2)
        }
    };
    match footprint::measure(keys) {
        Ok(footprints) => println!("{}", footprint::markdown(&footprints)),
        Err(e) => {
            eprintln!("shared-state: {e}");
            std::process::exit(1);
        }
    }
}

/// `tollgate-bench chart [--out DIR] FILE...`: the SVG charts of stored results.
fn chart_command(argv: Vec<String>) {
    let mut out = paths::workspace_root().join("bench/results");
    let mut files = Vec::new();
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        if arg == "--out" {
            out = PathBuf::from(it.next().unwrap_or_else(|| {
                eprintln!("chart: --out needs a directory");
                std::process::exit(2)
            }));
        } else {
            files.push(PathBuf::from(arg));
        }
    }
    match chart::write_charts(&files, &out) {
        Ok(written) => {
            for f in &written.files {
                eprintln!("wrote {}", f.display());
            }
            for s in &written.skipped {
                eprintln!("{s}");
            }
        }
        Err(e) => {
            eprintln!("chart: {e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("micro-summary") => {
            micro_summary(&paths::workspace_root().join("bench/results"));
            return;
        }
        Some("chart") => {
            chart_command(std::env::args().skip(2).collect());
            return;
        }
        Some("shared-state") => {
            shared_state(std::env::args().skip(2).collect());
            return;
        }
        _ => {}
    }
    let a = args();
    let wanted = |id: &str| a.only.as_ref().map_or(true, |o| o.iter().any(|x| x == id));
    if std::env::var_os("TOLLGATE_LIMITER_BIN").is_none() {
        let server = paths::target_dir().join("server/tollgate-limiter");
        assert!(
            server.exists(),
            "no limiter at {}: build it with `just build-limiter-server` \
             (or set TOLLGATE_LIMITER_BIN)",
            server.display()
        );
        // No other thread has been started yet.
        std::env::set_var("TOLLGATE_LIMITER_BIN", server);
    }
    // Scenario 7 has its own load generator; the others run wrk.
    assert!(
        specs().iter().all(|s| !wanted(s.id)) || paths::which("wrk").is_some(),
        "wrk not found: run tools/setup (Debian package wrk)"
    );
    let _ = paths::wasm_path();
    let setup = setup(&a);
    eprintln!(
        "tollgate bench: {} rounds × {} s, wrk -t{} -c{}, Envoy --concurrency {}, {} tenants ({})",
        a.rounds, a.seconds, a.threads, a.connections, a.concurrency, a.tenants, a.distribution
    );

    let upstream = Upstream::start();
    let envs: Vec<Env> = specs()
        .iter()
        .filter(|s| wanted(s.id))
        .map(|s| {
            let env = start_env(s, &upstream, a.concurrency);
            eprintln!("  S{} up on :{} — {}", env.id, env.port, env.title);
            env
        })
        .collect();

    if a.warmup > 0.0 {
        for env in &envs {
            wrk::run(env.port, &load(&a, a.warmup, 1))
                .unwrap_or_else(|e| panic!("S{} warm-up: {e}", env.id));
        }
    }
    // Scenario 8's failed calls so far (warm-up): the report tells them from the measured ones.
    let rls_errors_before: Vec<u64> = envs
        .iter()
        .map(|env| if env.rls { rls_errors(&env.envoy) } else { 0 })
        .collect();

    let mut scenarios: Vec<Scenario> = envs
        .iter()
        .map(|e| Scenario {
            id: e.id.into(),
            title: e.title.clone(),
            ..Scenario::default()
        })
        .collect();
    for round in 0..a.rounds {
        // Rotate the order each round so no scenario always runs first (or after the same one).
        let n = envs.len().max(1);
        for k in 0..envs.len() {
            let i = (k + round as usize) % n;
            let (Some(env), Some(sc)) = (envs.get(i), scenarios.get_mut(i)) else {
                continue;
            };
            let before = env
                .redis
                .as_ref()
                .map(|r| redis_calls(&r.info("commandstats")));
            let cpu_before = cpu_of(env);
            let measured = wrk::run(env.port, &load(&a, a.seconds, 100 + u64::from(round)))
                .unwrap_or_else(|e| panic!("S{}: {e}", env.id));
            let cpu_after = cpu_of(env);
            let redis = env.redis.as_ref().zip(before).map(|(r, b)| {
                let after = redis_calls(&r.info("commandstats"));
                (after.0 - b.0, after.1 - b.1)
            });
            let envoy_cpu_s = cpu_after.0.zip(cpu_before.0).map(|(a, b)| a - b);
            let backend_cpu_s = cpu_after.1.zip(cpu_before.1).map(|(a, b)| a - b);
            eprintln!(
                "  round {round} S{:<2} {:>8.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  Envoy {:>5.1} µs/req{}{}",
                env.id,
                measured.rps(),
                measured.p50_us as f64 / 1e3,
                measured.p99_us as f64 / 1e3,
                envoy_cpu_s.unwrap_or(0.0) * 1e6 / measured.requests.max(1) as f64,
                redis.map_or(String::new(), |(l, all)| format!(
                    "  Redis {:.1} FCALL/1k ({:.1} all)",
                    l as f64 * 1e3 / measured.requests.max(1) as f64,
                    all as f64 * 1e3 / measured.requests.max(1) as f64
                )),
                if measured.non_2xx + measured.socket_errors > 0 {
                    format!(
                        "  [{} non-2xx, {} socket errors]",
                        measured.non_2xx, measured.socket_errors
                    )
                } else {
                    String::new()
                }
            );
            sc.runs.push(Run {
                round,
                measured,
                redis,
                envoy_cpu_s,
                backend_cpu_s,
            });
        }
    }
    for ((env, sc), before) in envs
        .iter()
        .zip(scenarios.iter_mut())
        .zip(&rls_errors_before)
    {
        sc.envoy_peak_rss = peak_rss(env.envoy.pid());
        sc.limiter_peak_rss = env.limiter.as_ref().and_then(|l| peak_rss(l.pid()));
        if env.rls {
            sc.counters = rls_counters(&env.envoy, env.limiter.as_ref());
            sc.counters
                .push(("rls_errors_before_rounds".into(), *before));
        } else if env.redis.is_some() || env.settles || env.algorithm.is_some() {
            sc.counters = filter_counters(&env.envoy, env.limiter.as_ref());
        }
    }
    // A settling scenario whose filter settled nothing measured a policy that never settles:
    // the report says so, and the run fails once the results are written.
    let unsettled: Vec<String> = envs
        .iter()
        .zip(&scenarios)
        .filter(|(env, sc)| env.settles && sc.counter("units_settled") == 0)
        .map(|(env, _)| format!("S{}", env.id))
        .collect();
    for (env, sc) in envs.iter().zip(&scenarios).filter(|(e, _)| e.settles) {
        eprintln!(
            "  S{}: {} units reserved, {} settled, {} refunded, {} charged as debt, {} without usage \
             (filter); {} settled units reported to the limiter",
            env.id,
            sc.counter("units_reserved"),
            sc.counter("units_settled"),
            sc.counter("units_refunded"),
            sc.counter("units_debt"),
            sc.counter("usage_missing"),
            sc.counter("limiter_units_settled"),
        );
    }
    // The windowed policies must not deny either (the log's window is sized for that): what
    // the filter refused, warm-up included, and what wrk saw in the measured runs.
    for (env, sc) in envs.iter().zip(&scenarios) {
        let Some(algorithm) = env.algorithm else {
            continue;
        };
        eprintln!(
            "  S{} ({algorithm}): {} of {} decided requests denied by the filter (warm-up \
             included), {} responses ≥ 400 in the measured runs{}",
            env.id,
            sc.counter("denied"),
            sc.counter("decided"),
            sc.non_2xx(),
            if sc.counter("denied") + sc.non_2xx() > 0 {
                "  [DENIED: see the report line]"
            } else {
                ""
            }
        );
    }
    drop(envs);
    drop(upstream);

    let over_limit = if wanted("7") {
        eprintln!(
            "  S7: two Envoys, {S7_TENANTS} keys per variant at {S7_RATE}/s (burst {S7_BURST}); \
             demand 3× even, 10× even, 10× 3:1, {} s each",
            a.s7_seconds
        );
        over_limit(&a)
    } else {
        Vec::new()
    };

    let report = Report {
        setup,
        scenarios,
        over_limit,
    };
    let md = report.markdown();
    println!("{md}");
    if a.write {
        std::fs::create_dir_all(&a.out).expect("create the results directory");
        let value = report.json();
        let json = serde_json::to_string_pretty(&value).expect("JSON");
        std::fs::write(a.out.join("latest.md"), &md).expect("write latest.md");
        std::fs::write(a.out.join("latest.json"), json + "\n").expect("write latest.json");
        eprintln!(
            "wrote {} and latest.json",
            a.out.join("latest.md").display()
        );
        let rendered = chart::render(&value);
        for (svg, name) in [
            (rendered.ratios, "ratios.svg"),
            (rendered.overload, "overload.svg"),
        ] {
            match svg {
                Ok(svg) => {
                    std::fs::write(a.out.join(name), svg).expect("write the chart");
                    eprintln!("wrote {}", a.out.join(name).display());
                }
                Err(e) => eprintln!("{name} not written: {e}"),
            }
        }
    }
    if !unsettled.is_empty() {
        eprintln!(
            "FAILED: {} settled no units (tollgate_units_settled is 0): settlement did not happen",
            unsettled.join(", ")
        );
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scenario_8_is_listed_beside_5_and_6_and_chosen_by_only() {
        let ids: Vec<&str> = specs().iter().map(|s| s.id).collect();
        let at = |id: &str| ids.iter().position(|i| *i == id);
        assert!(at("8").is_some(), "{ids:?}");
        assert_eq!(at("8"), at("6").map(|i| i + 1), "{ids:?}");
        let spec = specs().into_iter().find(|s| s.id == "8");
        assert!(
            spec.is_some_and(|s| matches!(s.filter, Filter::RateLimitService)
                && s.policy.is_none()
                && !s.upstream)
        );
        let a = args_from(
            ["--only", "5,6,8", "--rounds", "1", "--no-write"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        );
        let only = a.only.unwrap_or_default();
        let chosen: Vec<&str> = ids
            .iter()
            .copied()
            .filter(|id| only.iter().any(|o| o == id))
            .collect();
        assert_eq!(chosen, ["5", "6", "8"]);
        assert!(!a.write);
    }
}
