//! `just bench-limiter`: how close the limiter's HTTP API gets to Redis' own limit.
//!
//! For each store (one local Redis, a local 3-primary/3-replica Redis Cluster, the in-memory
//! store) it starts the limiter in-process, drives `POST /v1/leases` (one lease per request,
//! 10 000 tenants, fresh lease ids, want 10) over many keep-alive HTTP/1.1 connections for a
//! few seconds, and prints leases/s with p50/p99 latency. Next to it, `redis-benchmark` runs
//! the very `FCALL tollgate_v2_lease` the limiter issues (same library, same argument shapes)
//! with the same concurrency, and the ratio shows what the HTTP hop, JSON and validation cost.
//! Everything (load generator, limiter, Redis) shares this machine's cores: read the figures
//! as relative, not as a capacity plan.
//!
//! Flags: `--seconds N` (default 5), `--connections N` (default 64), `--only memory|redis|cluster`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tollgate_e2e::{RedisCluster, RedisServer};
use tollgate_limiter::{serve, ServerConfig, StoreConfig};

const POLICY: &str = r#"{
  "policies": [{"name": "bench", "key": [{"header": "x-tenant"}],
                "rate": {"units": 1000000000, "per": "1s"}, "burst": 1000000,
                "scope": "global"}],
  "limiter": {"cluster": "tollgate_limiter"}
}"#;
const TENANTS: u64 = 10_000;
const WANT: u64 = 10;

struct Args {
    seconds: u64,
    connections: usize,
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 5,
        connections: 64,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--seconds" => a.seconds = it.next().and_then(|v| v.parse().ok()).unwrap_or(5),
            "--connections" => a.connections = it.next().and_then(|v| v.parse().ok()).unwrap_or(64),
            "--only" => a.only = it.next(),
            // cargo bench passes --bench; ignore anything else.
            _ => {}
        }
    }
    a
}

struct HttpResult {
    leases_per_s: f64,
    p50: Duration,
    p99: Duration,
    errors: u64,
}

/// Drives `POST /v1/leases` over `connections` keep-alive connections for `duration`.
async fn drive(addr: SocketAddr, connections: usize, duration: Duration) -> HttpResult {
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..connections {
        let stop = Arc::clone(&stop);
        let errors = Arc::clone(&errors);
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            stream.set_nodelay(true).unwrap();
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let mut latencies: Vec<u32> = Vec::with_capacity(1 << 16);
            let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ (c as u64 + 1);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                n += 1;
                let body = format!(
                    r#"{{"leases":[{{"id":"b{c}-{n}","policy":"bench","key":"t{}","min":1,"want":{WANT}}}]}}"#,
                    rng % TENANTS
                );
                let req = hyper::Request::post("/v1/leases")
                    .header("host", "limiter")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap();
                let start = Instant::now();
                sender.ready().await.unwrap();
                let resp = sender.send_request(req).await.unwrap();
                let ok = resp.status() == 200;
                let _ = resp.into_body().collect().await.unwrap();
                latencies.push(u32::try_from(start.elapsed().as_micros()).unwrap_or(u32::MAX));
                if !ok {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            latencies
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed();
    all.sort_unstable();
    let at = |q: f64| {
        let i = ((all.len() as f64 - 1.0) * q).round() as usize;
        Duration::from_micros(u64::from(all.get(i).copied().unwrap_or(0)))
    };
    HttpResult {
        leases_per_s: all.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
        errors: errors.load(Ordering::Relaxed),
    }
}

/// `redis-benchmark` running the limiter's own FCALL; returns requests/s.
fn redis_benchmark(port: u16, cluster: bool, clients: usize, seconds: u64) -> Option<f64> {
    // `{tag}` is redis-benchmark's cluster placeholder: it becomes a hash tag of the node the
    // client talks to, so every call stays in one slot like the limiter's calls.
    let tag = if cluster { "{tag}" } else { "{t__rand_int__}" };
    let bucket = format!("tollgate:{tag}:bench:t__rand_int__");
    let record = format!("tollgate:{tag}:lease:b__rand_int__");
    // About `seconds` worth of calls at ~25k/s; redis-benchmark stops by count, not time.
    let requests = (seconds * 25_000).to_string();
    let mut cmd = Command::new("redis-benchmark");
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args([
            "-c",
            &clients.to_string(),
            "-n",
            &requests,
            "-r",
            "100000000",
            "--csv",
        ]);
    if cluster {
        cmd.arg("--cluster");
    }
    // Record TTL, assignment period, lease TTL; capacity, refill/ms, min, want, no holder
    // (the benchmark's requests name none), demand 0.
    cmd.args([
        "FCALL",
        "tollgate_v2_lease",
        "2",
        &bucket,
        &record,
        "60000",
        "1000",
        "2000",
        "1000000.0",
        "1000000.0",
        "1",
        &WANT.to_string(),
        "",
        "0.0",
    ]);
    let out =
        tollgate_e2e::process::output_with_timeout(cmd, Duration::from_secs(seconds * 6 + 30))
            .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("\"FCALL"))?;
    let rps = line.split("\",\"").nth(1)?.trim_matches('"');
    rps.parse().ok()
}

fn report(store: &str, http: &HttpResult, redis: Option<f64>) {
    let ratio = match redis {
        Some(r) if r > 0.0 => format!("{:.0}%", 100.0 * http.leases_per_s / r),
        _ => "n/a".into(),
    };
    let redis = redis.map_or_else(|| "n/a".to_owned(), |r| format!("{r:.0}/s"));
    println!(
        "{store:<8} HTTP {:>8.0} leases/s  p50 {:>7.2} ms  p99 {:>7.2} ms  errors {:<4}  redis-benchmark FCALL {redis:>10}  HTTP/FCALL {ratio}",
        http.leases_per_s,
        http.p50.as_secs_f64() * 1e3,
        http.p99.as_secs_f64() * 1e3,
        http.errors,
    );
}

async fn run(store: &str, config: StoreConfig, a: &Args) -> HttpResult {
    let dir = tollgate_e2e::paths::new_log_dir("bench-limiter", store);
    let policies = dir.join("policies.json");
    std::fs::write(&policies, POLICY).unwrap();
    let mut c = ServerConfig::new(policies);
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.store = config;
    c.store_timeout = Duration::from_secs(1);
    let limiter = serve(c).await.unwrap();
    let addr = limiter.addr();
    let deadline = Instant::now() + Duration::from_secs(15);
    while tollgate_e2e::http_blocking::get(addr.port(), "/readyz", Duration::from_secs(2))
        .map(|r| r.status)
        .unwrap_or(0)
        != 200
    {
        assert!(Instant::now() < deadline, "{store}: limiter not ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Warm up connections, caches and the allocator.
    drive(addr, a.connections, Duration::from_millis(500)).await;
    let result = drive(addr, a.connections, Duration::from_secs(a.seconds)).await;
    limiter.shutdown().await;
    result
}

fn main() {
    let a = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let wanted = |s: &str| a.only.as_deref().map_or(true, |o| o == s);
    println!(
        "tollgate limiter: POST /v1/leases, 1 lease/request, {TENANTS} tenants, want {WANT}, {} connections, {} s per run, {} cores",
        a.connections,
        a.seconds,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    if wanted("redis") {
        let redis = RedisServer::start_with(tollgate_e2e::redis::RedisOptions {
            name: "bench-limiter".into(),
            ..Default::default()
        });
        let http = rt.block_on(run("redis", StoreConfig::Redis(redis.url()), &a));
        let fcall = redis_benchmark(redis.port(), false, a.connections, a.seconds);
        report("redis", &http, fcall);
    }
    if wanted("cluster") {
        let cluster = RedisCluster::start(3, 1);
        let http = rt.block_on(run("cluster", StoreConfig::Cluster(cluster.urls()), &a));
        let port = cluster.primaries().first().map(|n| n.port).unwrap();
        let fcall = redis_benchmark(port, true, a.connections, a.seconds);
        report("cluster", &http, fcall);
    }
    if wanted("memory") {
        let http = rt.block_on(run("memory", StoreConfig::Memory, &a));
        report("memory", &http, None);
    }
}
