//! `just bench-limiter`: how close the limiter's HTTP API gets to Redis' own limit, and what
//! mutual TLS on the lease listener costs.
//!
//! For each store (one local Redis, a local 3-primary/3-replica Redis Cluster, the in-memory
//! store) it starts the limiter in-process, drives `POST /v1/leases` (one lease per request,
//! 10 000 tenants, fresh lease ids, want 10) over many keep-alive HTTP/1.1 connections for a
//! few seconds, and prints leases/s with p50/p99 latency. Next to it, `redis-benchmark` runs
//! the very `FCALL tollgate_v4_lease` the limiter issues (same library, same argument shapes)
//! with the same concurrency, and the ratio shows what the HTTP hop, JSON and validation cost.
//!
//! Then the transport Envoy uses, twice on the same store in the same run: HTTP/2 in plaintext
//! (h2c, `envoy/global.yaml`) and HTTP/2 over mutual TLS with a client certificate (ALPN `h2`,
//! `envoy/global-mtls.yaml`; the limiter with `--tls-cert/--tls-key/--tls-client-ca
//! --tls-allow`, certificates made here by `tollgate_e2e::pki`). Two limiters on the same store
//! (the memory store: one each) stay up side by side, and the two transports run in alternating
//! rounds (h2c first in even rounds, TLS first in odd ones) with the same streams over the same
//! number of connections; the ratio TLS/h2c is the median of the per-round ratios. Connections
//! are long-lived, as Envoy's are: every connection is opened, and its TLS handshake done,
//! before the timed window, so the figures are the per-request cost of TLS (record encryption,
//! framing), not of handshakes; the handshake time is printed apart.
//!
//! Everything (load generator, limiter, Redis) shares this machine's cores: read the figures
//! as relative, not as a capacity plan.
//!
//! Flags: `--seconds N` (default 5, per run), `--connections N` (default 64: HTTP/1.1
//! connections, and concurrent HTTP/2 streams), `--h2-connections N` (default 4: the HTTP/2
//! connections those streams share), `--rounds N` (default 2: h2c/TLS pairs),
//! `--only memory|redis|cluster`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tollgate_e2e::pki::TestCa;
use tollgate_e2e::{RedisCluster, RedisServer};
use tollgate_limiter::tls::TlsSettings;
use tollgate_limiter::{serve, Running, ServerConfig, StoreConfig};

const POLICY: &str = r#"{
  "policies": [{"name": "bench", "key": [{"header": "x-tenant"}],
                "rate": {"units": 1000000000, "per": "1s"}, "burst": 1000000,
                "scope": "global"}],
  "limiter": {"cluster": "tollgate_limiter"}
}"#;
const TENANTS: u64 = 10_000;
const WANT: u64 = 10;
/// The name the limiter's certificate carries (and Envoy's cluster sends as SNI).
const SERVER_NAME: &str = "tollgate-limiter";
/// The identity of the client certificate, the one `--tls-allow` lists.
const CLIENT_ID: &str = "spiffe://bench/ns/edge/sa/gateway";

struct Args {
    seconds: u64,
    connections: usize,
    h2_connections: usize,
    rounds: usize,
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 5,
        connections: 64,
        h2_connections: 4,
        rounds: 2,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut number = |default: usize| {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
                .max(1)
        };
        match flag.as_str() {
            "--seconds" => a.seconds = number(5) as u64,
            "--connections" => a.connections = number(64),
            "--h2-connections" => a.h2_connections = number(4),
            "--rounds" => a.rounds = number(2),
            "--only" => a.only = it.next(),
            // cargo bench passes --bench; ignore anything else.
            _ => {}
        }
    }
    a
}

/// How the load generator reaches the limiter.
#[derive(Clone)]
enum Transport {
    /// One HTTP/1.1 keep-alive connection per concurrent request.
    Http1,
    /// HTTP/2 with prior knowledge, streams multiplexed over a few connections.
    H2c,
    /// HTTP/2 by ALPN over TLS, presenting a client certificate.
    H2Tls(Arc<rustls::ClientConfig>),
}

/// A connection's request sender: HTTP/1.1 (one request at a time) or HTTP/2 (shared).
enum Sender {
    H1(http1::SendRequest<Full<Bytes>>),
    H2(http2::SendRequest<Full<Bytes>>),
    /// Over TLS: also the protocol version negotiated.
    H2Tls(http2::SendRequest<Full<Bytes>>, String),
}

impl Sender {
    async fn send(
        &mut self,
        req: hyper::Request<Full<Bytes>>,
    ) -> hyper::Result<hyper::Response<hyper::body::Incoming>> {
        match self {
            Sender::H1(s) => {
                s.ready().await?;
                s.send_request(req).await
            }
            Sender::H2(s) | Sender::H2Tls(s, _) => {
                s.ready().await?;
                s.send_request(req).await
            }
        }
    }
}

async fn h2_sender<T>(io: T) -> http2::SendRequest<Full<Bytes>>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(io))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// Opens one connection: TCP, then (over TLS) the handshake, then the HTTP/1.1 or HTTP/2
/// preface.
async fn connect(addr: SocketAddr, transport: &Transport) -> Sender {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.set_nodelay(true).unwrap();
    match transport {
        Transport::Http1 => {
            let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
            tokio::spawn(conn);
            Sender::H1(sender)
        }
        Transport::H2c => Sender::H2(h2_sender(stream).await),
        Transport::H2Tls(config) => {
            let name = ServerName::try_from(SERVER_NAME).unwrap();
            let tls = tokio_rustls::TlsConnector::from(Arc::clone(config))
                .connect(name, stream)
                .await
                .unwrap();
            assert_eq!(
                tls.get_ref().1.alpn_protocol(),
                Some(&b"h2"[..]),
                "the limiter did not choose HTTP/2 by ALPN"
            );
            let version = tls
                .get_ref()
                .1
                .protocol_version()
                .map_or_else(|| "TLS".to_owned(), |v| format!("{v:?}"));
            Sender::H2Tls(h2_sender(tls).await, version)
        }
    }
}

struct HttpResult {
    leases_per_s: f64,
    p50: Duration,
    p99: Duration,
    errors: u64,
    /// Mean time to open one connection (TCP connect, TLS handshake, HTTP/2 preface),
    /// spent before the timed window.
    connect: Duration,
    /// The TLS version negotiated, over TLS.
    tls_version: Option<String>,
}

/// Drives `POST /v1/leases` with `streams` concurrent requests for `duration`: over as many
/// HTTP/1.1 connections, or over `h2_connections` HTTP/2 connections shared round-robin. Every
/// connection is open before the clock starts.
async fn drive(
    addr: SocketAddr,
    transport: &Transport,
    streams: usize,
    h2_connections: usize,
    duration: Duration,
) -> HttpResult {
    // Lease ids are fresh in every run (a repeated id is answered from the dedup record),
    // also across the runs on one limiter and the two limiters on one Redis.
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let opened = Instant::now();
    let mut tls_version = None;
    let senders: Vec<Sender> = match transport {
        Transport::Http1 => {
            let mut senders = Vec::with_capacity(streams);
            for _ in 0..streams {
                senders.push(connect(addr, transport).await);
            }
            senders
        }
        Transport::H2c | Transport::H2Tls(_) => {
            let mut shared = Vec::new();
            for _ in 0..h2_connections.min(streams) {
                match connect(addr, transport).await {
                    Sender::H2(s) => shared.push(s),
                    Sender::H2Tls(s, version) => {
                        tls_version = Some(version);
                        shared.push(s);
                    }
                    Sender::H1(_) => {}
                }
            }
            assert!(
                !shared.is_empty(),
                "HTTP/2 transports open HTTP/2 connections"
            );
            (0..streams)
                .map(|i| Sender::H2(shared[i % shared.len()].clone()))
                .collect()
        }
    };
    let connections = match transport {
        Transport::Http1 => streams,
        _ => h2_connections.min(streams),
    };
    let connect = opened.elapsed() / u32::try_from(connections.max(1)).unwrap_or(1);
    let scheme = match transport {
        Transport::H2Tls(_) => "https",
        _ => "http",
    };
    let uri = format!("{scheme}://{SERVER_NAME}/v1/leases");
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (c, mut sender) in senders.into_iter().enumerate() {
        let stop = Arc::clone(&stop);
        let errors = Arc::clone(&errors);
        let uri = uri.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies: Vec<u32> = Vec::with_capacity(1 << 16);
            let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ (c as u64 + 1);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                n += 1;
                let body = format!(
                    r#"{{"leases":[{{"id":"r{run}-b{c}-{n}","policy":"bench","key":"t{}","min":1,"want":{WANT}}}]}}"#,
                    rng % TENANTS
                );
                let req = hyper::Request::post(uri.as_str())
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap();
                let start = Instant::now();
                let resp = sender.send(req).await.unwrap();
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
        connect,
        tls_version,
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
    // Record TTL, assignment period, lease TTL; algorithm, capacity, refill/ms, min, want, no
    // holder (the benchmark's requests name none), demand 0, no window.
    cmd.args([
        "FCALL",
        "tollgate_v4_lease",
        "2",
        &bucket,
        &record,
        "60000",
        "1000",
        "2000",
        "token_bucket",
        "1000000.0",
        "1000000.0",
        "1",
        &WANT.to_string(),
        "",
        "0.0",
        "0",
    ]);
    let out =
        tollgate_e2e::process::output_with_timeout(cmd, Duration::from_secs(seconds * 6 + 30))
            .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with("\"FCALL"))?;
    let rps = line.split("\",\"").nth(1)?.trim_matches('"');
    rps.parse().ok()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report(store: &str, http: &HttpResult, redis: Option<f64>) {
    let ratio = match redis {
        Some(r) if r > 0.0 => format!("{:.0}%", 100.0 * http.leases_per_s / r),
        _ => "n/a".into(),
    };
    let redis = redis.map_or_else(|| "n/a".to_owned(), |r| format!("{r:.0}/s"));
    println!(
        "{store:<8} HTTP/1.1 {:>8.0} leases/s  p50 {:>7.2} ms  p99 {:>7.2} ms  errors {:<4}  redis-benchmark FCALL {redis:>10}  HTTP/FCALL {ratio}",
        http.leases_per_s,
        ms(http.p50),
        ms(http.p99),
        http.errors,
    );
}

/// Median of the values (the mean of the middle two for an even count); 0 for none.
fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| v.is_finite());
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The h2c and the mutual-TLS rounds of one store, side by side, and their ratio.
fn report_transports(store: &str, h2c: &[HttpResult], tls: &[HttpResult]) {
    let line = |name: &str, runs: &[HttpResult]| {
        println!(
            "{store:<8} {name:<8} {:>8.0} leases/s  p50 {:>7.2} ms  p99 {:>7.2} ms  errors {:<4}  connection set-up {:.2} ms (before timing){}",
            median(runs.iter().map(|r| r.leases_per_s).collect()),
            median(runs.iter().map(|r| ms(r.p50)).collect()),
            median(runs.iter().map(|r| ms(r.p99)).collect()),
            runs.iter().map(|r| r.errors).sum::<u64>(),
            median(runs.iter().map(|r| ms(r.connect)).collect()),
            runs.iter()
                .find_map(|r| r.tls_version.as_deref())
                .map_or_else(String::new, |v| format!(", {v}")),
        );
    };
    line("h2c", h2c);
    line("h2+mTLS", tls);
    let ratios = |f: fn(&HttpResult) -> f64| -> Vec<f64> {
        h2c.iter()
            .zip(tls)
            .filter(|(p, _)| f(p) > 0.0)
            .map(|(p, t)| f(t) / f(p))
            .collect()
    };
    let rps = ratios(|r| r.leases_per_s);
    let per_round: Vec<String> = rps.iter().map(|r| format!("{r:.3}")).collect();
    println!(
        "{store:<8} mTLS/h2c leases/s {:.3} (per round: {}), p50 {:.2}×, p99 {:.2}× (medians of per-round ratios, {} rounds; handshakes not timed)",
        median(rps.clone()),
        per_round.join(", "),
        median(ratios(|r| ms(r.p50))),
        median(ratios(|r| ms(r.p99))),
        rps.len(),
    );
}

/// The certificates of the TLS limiter and of its client, written into `dir`.
struct Pki {
    settings: TlsSettings,
    client: Arc<rustls::ClientConfig>,
}

impl Pki {
    fn new(dir: &Path) -> Pki {
        let limiter_ca = TestCa::new("bench limiter CA");
        let gateway_ca = TestCa::new("bench gateway CA");
        let server = limiter_ca.server(dir, "limiter", &[SERVER_NAME, "localhost"]);
        let gateway = gateway_ca.client(dir, "gateway", Some(CLIENT_ID));
        let settings = TlsSettings {
            cert: server.cert,
            key: server.key,
            client_ca: gateway_ca.write_cert(dir, "gateway-ca.crt"),
            allow: vec![CLIENT_ID.to_owned()],
            reload_every: Duration::from_secs(10),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(limiter_ca.cert_pem().as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let chain = CertificateDer::pem_slice_iter(gateway.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(gateway.key_pem.as_bytes()).unwrap();
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .unwrap();
        client.alpn_protocols = vec![b"h2".to_vec()];
        Pki {
            settings,
            client: Arc::new(client),
        }
    }
}

/// Starts a limiter on `store` (over mutual TLS with `tls`) and waits until it is ready.
async fn start(store: &str, config: StoreConfig, tls: Option<TlsSettings>, dir: &Path) -> Running {
    let policies = dir.join("policies.json");
    std::fs::write(&policies, POLICY).unwrap();
    let mut c = ServerConfig::new(policies);
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.store = config;
    c.store_timeout = Duration::from_secs(1);
    if tls.is_some() {
        // The lease port wants a client certificate: probes go to the admin listener.
        c.admin_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    }
    c.tls = tls;
    let limiter = serve(c).await.unwrap();
    let probe = limiter.admin_addr().unwrap_or(limiter.addr());
    let deadline = Instant::now() + Duration::from_secs(15);
    while tollgate_e2e::http_blocking::get(probe.port(), "/readyz", Duration::from_secs(2))
        .map(|r| r.status)
        .unwrap_or(0)
        != 200
    {
        assert!(Instant::now() < deadline, "{store}: limiter not ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    limiter
}

/// What one store measured: HTTP/1.1 (next to redis-benchmark), then h2c and h2 over mutual
/// TLS in alternating rounds.
struct StoreResult {
    http1: HttpResult,
    h2c: Vec<HttpResult>,
    tls: Vec<HttpResult>,
}

async fn run(store: &str, config: StoreConfig, a: &Args) -> StoreResult {
    let dir = tollgate_e2e::paths::new_log_dir("bench-limiter", store);
    let tls_dir = dir.join("tls");
    std::fs::create_dir_all(&tls_dir).unwrap();
    let pki = Pki::new(&tls_dir);
    let plain = start(store, config.clone(), None, &dir).await;
    let secure = start(store, config, Some(pki.settings.clone()), &tls_dir).await;
    let (plain_addr, tls_addr) = (plain.addr(), secure.addr());
    let h2c = Transport::H2c;
    let tls = Transport::H2Tls(Arc::clone(&pki.client));
    let time = Duration::from_secs(a.seconds);
    let warm = Duration::from_millis(500);
    let (n, h2n) = (a.connections, a.h2_connections);
    // Warm up connections, caches and the allocator, on both listeners.
    drive(plain_addr, &Transport::Http1, n, h2n, warm).await;
    drive(plain_addr, &h2c, n, h2n, warm).await;
    drive(tls_addr, &tls, n, h2n, warm).await;
    let http1 = drive(plain_addr, &Transport::Http1, n, h2n, time).await;
    let mut result = StoreResult {
        http1,
        h2c: Vec::new(),
        tls: Vec::new(),
    };
    for round in 0..a.rounds {
        if round % 2 == 0 {
            result.h2c.push(drive(plain_addr, &h2c, n, h2n, time).await);
            result.tls.push(drive(tls_addr, &tls, n, h2n, time).await);
        } else {
            result.tls.push(drive(tls_addr, &tls, n, h2n, time).await);
            result.h2c.push(drive(plain_addr, &h2c, n, h2n, time).await);
        }
    }
    secure.shutdown().await;
    plain.shutdown().await;
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
        "tollgate limiter: POST /v1/leases, 1 lease/request, {TENANTS} tenants, want {WANT}, {} concurrent requests ({} HTTP/1.1 connections; {} HTTP/2 connections for h2c and h2+mTLS), {} s per run, {} h2c/mTLS rounds, {} cores",
        a.connections,
        a.connections,
        a.h2_connections.min(a.connections),
        a.seconds,
        a.rounds,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!(
        "h2+mTLS: rustls (ring) on both ends, client certificate verified against --tls-client-ca and --tls-allow; connections are long-lived (as Envoy's are): opened and handshaken before timing, so the per-request path carries no handshake"
    );
    if wanted("redis") {
        let redis = RedisServer::start_with(tollgate_e2e::redis::RedisOptions {
            name: "bench-limiter".into(),
            ..Default::default()
        });
        let r = rt.block_on(run("redis", StoreConfig::Redis(redis.url()), &a));
        let fcall = redis_benchmark(redis.port(), false, a.connections, a.seconds);
        report("redis", &r.http1, fcall);
        report_transports("redis", &r.h2c, &r.tls);
    }
    if wanted("cluster") {
        let cluster = RedisCluster::start(3, 1);
        let r = rt.block_on(run("cluster", StoreConfig::Cluster(cluster.urls()), &a));
        let port = cluster.primaries().first().map(|n| n.port).unwrap();
        let fcall = redis_benchmark(port, true, a.connections, a.seconds);
        report("cluster", &r.http1, fcall);
        report_transports("cluster", &r.h2c, &r.tls);
    }
    if wanted("memory") {
        let r = rt.block_on(run("memory", StoreConfig::Memory, &a));
        report("memory", &r.http1, None);
        report_transports("memory", &r.h2c, &r.tls);
    }
}
