//! Shared test support for the limiter's integration tests: the test policy document, unique
//! keys, store and server constructors, a shared Redis and Redis Cluster per test binary, and a
//! small JSON-over-HTTP client. Real processes come from the `tollgate-e2e` harness.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;
use tollgate_core::assign::Holding;
use tollgate_core::bucket::{BucketState, Limits};
use tollgate_core::policy::{Algorithm, Policies};
use tollgate_e2e::pki::{CertFiles, TestCa};
use tollgate_e2e::redis::RedisOptions;
use tollgate_e2e::redis::Resp;
use tollgate_e2e::{AclUser, RedisCluster, RedisServer, RedisTls, RequestSpec};
use tollgate_limiter::store::{LeaseItem, MemoryStore, RedisSecurity, ReturnItem, StoreSettings};
use tollgate_limiter::{serve, Running, ServerConfig, StoreConfig};

/// Policies every test uses. "Negligible refill" policies refill 1 unit per hour, so a test
/// lasting seconds sees at most a thousandth of a token come back. The windowed ones: 10 per
/// 200 ms windows (`fixed`, `sliding`, `log`) for boundaries, and windows of a day (`*-day`,
/// `route-fixed`) that a test lasting seconds almost never sees end; calendar windows of 5 per
/// week, month, quarter and year (`weekly`, `monthly`, `quarterly`, `yearly`).
pub const DOC: &str = r#"{
  "policies": [
    {"name": "hundred", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "1h"},
     "burst": 100, "scope": "global"},
    {"name": "tenant", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "1h"},
     "burst": 10, "scope": "global"},
    {"name": "route", "key": [{"header": "x-tenant"}, {"header": "x-route"}],
     "rate": {"units": 1, "per": "1h"}, "burst": 3, "scope": "global"},
    {"name": "fast", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "1ms"},
     "burst": 10, "scope": "global"},
    {"name": "tenth", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "10ms"},
     "burst": 10, "scope": "global"},
    {"name": "slowish", "key": [{"header": "x-tenant"}], "rate": {"units": 3, "per": "1s"},
     "burst": 5, "scope": "global"},
    {"name": "thousand", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "1h"},
     "burst": 1000, "scope": "global"},
    {"name": "local-only", "key": [{"header": "x-tenant"}], "rate": {"units": 1, "per": "1s"},
     "burst": 10},
    {"name": "fixed", "key": [{"header": "x-tenant"}], "algorithm": "fixed_window",
     "rate": {"units": 10, "per": "200ms"}, "scope": "global"},
    {"name": "sliding", "key": [{"header": "x-tenant"}], "algorithm": "sliding_window",
     "rate": {"units": 10, "per": "200ms"}, "scope": "global"},
    {"name": "log", "key": [{"header": "x-tenant"}], "algorithm": "sliding_log",
     "rate": {"units": 10, "per": "200ms"}, "scope": "global"},
    {"name": "fixed-day", "key": [{"header": "x-tenant"}], "algorithm": "fixed_window",
     "rate": {"units": 100, "per": "1d"}, "scope": "global"},
    {"name": "sliding-day", "key": [{"header": "x-tenant"}], "algorithm": "sliding_window",
     "rate": {"units": 100, "per": "1d"}, "scope": "global"},
    {"name": "log-day", "key": [{"header": "x-tenant"}], "algorithm": "sliding_log",
     "rate": {"units": 100, "per": "1d"}, "scope": "global"},
    {"name": "route-fixed", "key": [{"header": "x-tenant"}, {"header": "x-route"}],
     "algorithm": "fixed_window", "rate": {"units": 3, "per": "1d"}, "scope": "global"},
    {"name": "weekly", "key": [{"header": "x-tenant"}], "algorithm": "fixed_window",
     "rate": {"units": 5, "per": "1w"}, "scope": "global"},
    {"name": "monthly", "key": [{"header": "x-tenant"}], "algorithm": "fixed_window",
     "rate": {"units": 5, "per": "1mo"}, "scope": "global"},
    {"name": "quarterly", "key": [{"header": "x-tenant"}], "algorithm": "fixed_window",
     "rate": {"units": 5, "per": "3mo"}, "scope": "global"},
    {"name": "yearly", "key": [{"header": "x-tenant"}], "algorithm": "fixed_window",
     "rate": {"units": 5, "per": "1y"}, "scope": "global"}
  ],
  "limiter": {"cluster": "tollgate_limiter"}
}"#;

pub fn policies() -> &'static Policies {
    static P: OnceLock<Policies> = OnceLock::new();
    P.get_or_init(|| Policies::from_json(DOC.as_bytes()).expect("test policy document"))
}

pub fn limits(policy: &str) -> Limits {
    policies().get(policy).expect("test policy").limits
}

pub fn algorithm(policy: &str) -> Algorithm {
    policies().get(policy).expect("test policy").algorithm
}

/// A key nobody else in this test run uses: `<prefix>-<pid>-<n>` (a valid one-part key).
/// How long a test waits for a condition it needs before it can start (a store ready, a
/// server up, a replica in sync) before failing: generous, since the whole suite runs at once
/// on a loaded 2-core machine, and a wait that ends early costs nothing.
pub const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// Retries `attempt` until it succeeds (transient failures: a TLS handshake to every cluster
/// node can take longer than the client's own deadline on a busy machine), for at most
/// [`WAIT_LIMIT`]; fails naming `what` and the last error.
pub async fn eventually<T, E, F>(what: &str, mut attempt: impl FnMut() -> F) -> T
where
    E: std::fmt::Debug,
    F: std::future::Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + WAIT_LIMIT;
    let mut tries = 0u32;
    loop {
        tries += 1;
        match attempt().await {
            Ok(value) => return value,
            Err(e) => assert!(
                Instant::now() < deadline,
                "{what}: not within {WAIT_LIMIT:?} ({tries} attempts); last error: {e:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `store` answers `ready()` (connected, its functions loaded).
pub async fn until_ready(store: &impl tollgate_limiter::store::Store, what: &str) {
    eventually(what, || store.ready()).await;
}

pub fn unique(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Assignment period of the store tests: long, so holdings never end while a test runs,
/// however loaded the machine.
pub const PERIOD_MS: u64 = 20_000;

pub fn settings() -> StoreSettings {
    StoreSettings {
        dedup_ttl_ms: 60_000,
        assignment_period_ms: PERIOD_MS,
        lease_ttl_ms: 2_000,
    }
}

/// A lease item without a holder (leases only).
pub fn lease(id: &str, policy: &str, key: &str, min: u64, want: u64) -> LeaseItem {
    LeaseItem {
        id: id.into(),
        policy: policy.into(),
        key: key.into(),
        limits: limits(policy),
        algorithm: algorithm(policy),
        min,
        want,
        holder: None,
        demand_per_ms: 0.0,
    }
}

/// A lease item of holder `holder` reporting `demand_per_s`.
pub fn ask(
    id: &str,
    policy: &str,
    key: &str,
    (min, want): (u64, u64),
    holder: &str,
    demand_per_s: f64,
) -> LeaseItem {
    LeaseItem {
        holder: Some(holder.into()),
        demand_per_ms: demand_per_s / 1_000.0,
        ..lease(id, policy, key, min, want)
    }
}

pub fn give_back(id: &str, policy: &str, key: &str, unused: u64) -> ReturnItem {
    ReturnItem {
        id: id.into(),
        policy: policy.into(),
        key: key.into(),
        limits: limits(policy),
        algorithm: algorithm(policy),
        unused,
    }
}

/// One standalone Redis for the whole test binary (tests use unique keys).
pub fn shared_redis() -> &'static RedisServer {
    static R: OnceLock<RedisServer> = OnceLock::new();
    R.get_or_init(|| {
        RedisServer::start_with(tollgate_e2e::redis::RedisOptions {
            name: "limiter-shared".into(),
            ..Default::default()
        })
    })
}

/// One 3-primary/3-replica Redis Cluster for the whole test binary.
pub fn shared_cluster() -> &'static RedisCluster {
    SHARED_CLUSTER.get_or_init(|| RedisCluster::start(3, 1))
}

static SHARED_CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
static SHARED_TLS_REDIS: OnceLock<TlsRedis> = OnceLock::new();
static SHARED_TLS_CLUSTER: OnceLock<TlsCluster> = OnceLock::new();

/// The ACL user the TLS fixtures' limiter authenticates as.
pub const TLS_USER: &str = "tollgate";

/// Certificates and credentials for a TLS Redis (made at test time in `dir`, never
/// committed): a CA that signs Redis' certificate and the limiter's client certificate, and
/// an ACL user's password in a file.
pub struct TlsPki {
    pub dir: PathBuf,
    pub redis: RedisTls,
    pub client: CertFiles,
    pub user: AclUser,
    pub password_file: PathBuf,
}

impl TlsPki {
    /// A fresh CA and everything it signs, with client certificates required by Redis.
    pub fn new(label: &str) -> TlsPki {
        let dir = tollgate_e2e::paths::new_log_dir("", label);
        let ca = TestCa::new("tollgate test CA");
        let redis = RedisTls::new(&ca, &dir, true);
        let client = ca.client(&dir, "limiter", None);
        let user = AclUser {
            name: TLS_USER.into(),
            password: format!("pw-{}", unique("acl")),
        };
        let password_file = dir.join("redis-password");
        std::fs::write(&password_file, format!("{}\n", user.password)).expect("password file");
        TlsPki {
            dir,
            redis,
            client,
            user,
            password_file,
        }
    }

    /// Options for a server (or every cluster node) with this TLS and this user.
    pub fn options(&self, name: &str) -> RedisOptions {
        RedisOptions {
            name: name.into(),
            tls: Some(self.redis.clone()),
            acl_user: Some(self.user.clone()),
            ..RedisOptions::default()
        }
    }

    /// What the limiter is given: the CA, its certificate and key, the user and the file.
    pub fn security(&self) -> RedisSecurity {
        RedisSecurity {
            ca: Some(self.redis.ca.clone()),
            client_cert: Some(self.client.cert.clone()),
            client_key: Some(self.client.key.clone()),
            username: Some(self.user.name.clone()),
            password: None,
            password_file: Some(self.password_file.clone()),
        }
    }
}

/// A TLS Redis (client certificates required, an ACL user) and the limiter's credentials.
pub struct TlsRedis {
    pub pki: TlsPki,
    pub server: RedisServer,
    pub security: RedisSecurity,
}

/// A TLS Redis Cluster (3 primaries; TLS cluster bus; client certificates required, an ACL
/// user) and the limiter's credentials.
pub struct TlsCluster {
    pub pki: TlsPki,
    pub cluster: RedisCluster,
    pub security: RedisSecurity,
}

/// One TLS Redis for the whole test binary.
pub fn shared_tls_redis() -> &'static TlsRedis {
    SHARED_TLS_REDIS.get_or_init(|| {
        let pki = TlsPki::new("limiter-shared-tls-pki");
        let server = RedisServer::start_with(pki.options("limiter-shared-tls"));
        let security = pki.security();
        TlsRedis {
            pki,
            server,
            security,
        }
    })
}

/// One TLS Redis Cluster for the whole test binary.
pub fn shared_tls_cluster() -> &'static TlsCluster {
    SHARED_TLS_CLUSTER.get_or_init(|| {
        let pki = TlsPki::new("limiter-shared-tls-cluster-pki");
        let cluster = RedisCluster::start_with(3, 0, pki.options(""));
        let security = pki.security();
        TlsCluster {
            pki,
            cluster,
            security,
        }
    })
}

fn port_of(node: &str) -> Option<u16> {
    node.rsplit(':').next()?.parse().ok()
}

/// The shared server a store with node address `node` talks to: the TLS one if it is at its
/// TLS port, else the plain one.
pub fn redis_serving(node: &str) -> &'static RedisServer {
    match (SHARED_TLS_REDIS.get(), port_of(node)) {
        (Some(tls), Some(port)) if tls.server.tls_port() == Some(port) => &tls.server,
        _ => shared_redis(),
    }
}

/// The shared cluster a store with node address `node` talks to.
pub fn cluster_serving(node: &str) -> &'static RedisCluster {
    let has = |cluster: &RedisCluster, port: u16| {
        cluster
            .servers()
            .iter()
            .any(|n| n.port() == port || n.tls_port() == Some(port))
    };
    match (SHARED_TLS_CLUSTER.get(), port_of(node)) {
        (Some(tls), Some(port)) if has(&tls.cluster, port) => &tls.cluster,
        _ => shared_cluster(),
    }
}

/// A bucket as a store holds it, read behind the store's back.
#[derive(Debug, Clone, PartialEq)]
pub struct Peeked {
    /// As of its last write (not refilled).
    pub state: BucketState,
    /// Sorted by holder id.
    pub holdings: Vec<Holding>,
    /// Milliseconds until the state expires (`None`: never).
    pub ttl_ms: Option<u64>,
}

impl Peeked {
    /// Only the holdings still live at `now_ms`.
    pub fn live_at(mut self, now_ms: u64) -> Self {
        self.holdings.retain(|h| h.ends_ms > now_ms);
        self
    }

    pub fn holding(&self, holder: &str) -> Option<&Holding> {
        self.holdings.iter().find(|h| h.holder == holder)
    }
}

/// The memory store's bucket `bucket_key` as of `now_ms` (`None`: the store's clock).
pub fn peek_memory(store: &MemoryStore, bucket_key: &str, now_ms: Option<u64>) -> Option<Peeked> {
    let view = match now_ms {
        Some(now) => store.bucket_view_at(bucket_key, now),
        None => store.bucket_view(bucket_key),
    }?;
    let mut holdings = view.holdings;
    holdings.sort_by(|a, b| a.holder.cmp(&b.holder));
    Some(Peeked {
        state: view.state,
        holdings,
        ttl_ms: view.ttl_ms,
    })
}

/// A bucket hash of the Redis Function library (`t`, `u`, `h:<holder>` = `share|ends|demand`)
/// and its PTTL, as `server` holds it (every holding field, ended or not).
pub fn peek_redis(server: &RedisServer, bucket_key: &str) -> Option<Peeked> {
    let fields = server.cmd(&["HGETALL", bucket_key]);
    let fields = fields
        .as_array()
        .unwrap_or_else(|| panic!("HGETALL: {fields:?}"));
    if fields.is_empty() {
        return None;
    }
    let text = |r: &Resp| r.as_str().unwrap_or_else(|| panic!("{r:?}")).to_owned();
    let mut tokens = None;
    let mut updated = None;
    let mut holdings = Vec::new();
    for pair in fields.chunks(2) {
        let (field, value) = (text(&pair[0]), text(&pair[1]));
        match field.as_str() {
            "t" => tokens = Some(value.parse::<f64>().unwrap()),
            "u" => updated = Some(value.parse::<u64>().unwrap()),
            _ => {
                let holder = field
                    .strip_prefix("h:")
                    .unwrap_or_else(|| panic!("unexpected field {field} in {bucket_key}"));
                let parts: Vec<&str> = value.split('|').collect();
                assert_eq!(parts.len(), 3, "{field} = {value}");
                holdings.push(Holding {
                    holder: holder.to_owned(),
                    share_per_ms: parts[0].parse().unwrap(),
                    ends_ms: parts[1].parse().unwrap(),
                    demand_per_ms: parts[2].parse().unwrap(),
                });
            }
        }
    }
    holdings.sort_by(|a, b| a.holder.cmp(&b.holder));
    let ttl = server.cmd(&["PTTL", bucket_key]).as_int().expect("PTTL");
    Some(Peeked {
        state: BucketState {
            tokens: tokens.expect("t"),
            updated_ms: updated.expect("u"),
        },
        holdings,
        ttl_ms: u64::try_from(ttl).ok(),
    })
}

/// [`peek_redis`] on the cluster primary owning `bucket_key`.
pub fn peek_cluster(cluster: &RedisCluster, bucket_key: &str) -> Option<Peeked> {
    let owner = cluster.primary_for_key(bucket_key);
    peek_redis(cluster.node(owner.port), bucket_key)
}

/// A replica of `primary`, synced (`master_link_status:up`), with `extra` arguments.
pub fn replica_of(primary: &RedisServer, extra: &[&str]) -> RedisServer {
    replica_with(primary, extra, Vec::new())
}

/// [`replica_of`], with more environment for its `redis-server`.
pub fn replica_with(
    primary: &RedisServer,
    extra: &[&str],
    env: Vec<(String, String)>,
) -> RedisServer {
    let mut args = vec![
        "--replicaof".to_string(),
        "127.0.0.1".to_string(),
        primary.port().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let replica = RedisServer::start_with(RedisOptions {
        extra_args: args,
        env,
        ..RedisOptions::default()
    });
    let deadline = Instant::now() + WAIT_LIMIT;
    while replica
        .info_field("replication", "master_link_status")
        .as_deref()
        != Some("up")
    {
        assert!(
            Instant::now() < deadline,
            "replica of {} not synced within {WAIT_LIMIT:?}: {}",
            primary.port(),
            replica.info("replication")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    replica
}

/// Waits until the replica has applied everything the primary wrote so far.
pub fn caught_up(primary: &RedisServer, replica: &RedisServer) {
    let deadline = Instant::now() + WAIT_LIMIT;
    loop {
        let want = primary.info_field("replication", "master_repl_offset");
        let have = replica.info_field("replication", "slave_repl_offset");
        if want.is_some() && want == have {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replica not caught up within {WAIT_LIMIT:?}: primary {want:?}, replica {have:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The server's `TIME`, in ms since the epoch.
pub fn time_ms(server: &RedisServer) -> u64 {
    let reply = server.cmd(&["TIME"]);
    let parts = reply
        .as_array()
        .unwrap_or_else(|| panic!("TIME: {reply:?}"));
    let field = |i: usize| -> u64 { parts[i].as_str().unwrap().parse().unwrap() };
    field(0) * 1_000 + field(1) / 1_000
}

/// Writes a policy document to a fresh file.
pub fn policy_file(doc: &str) -> PathBuf {
    let dir = tollgate_e2e::paths::new_log_dir("", "policies");
    let path = dir.join("policies.json");
    std::fs::write(&path, doc).expect("write policy file");
    path
}

/// A config on 127.0.0.1:0 with the test policies. The store timeout is generous (500 ms) so
/// a loaded 2-core CI machine does not turn slow answers into UNAVAILABLE; tests about the
/// timeout set their own.
pub fn config(store: StoreConfig) -> ServerConfig {
    let mut c = ServerConfig::new(policy_file(DOC));
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.store = store;
    c.policy_poll = Duration::from_millis(50);
    c.store_timeout = Duration::from_millis(500);
    c
}

/// Starts a limiter and waits (bounded) until `/readyz` says the store is ready, like a load
/// balancer's readiness check would before sending traffic.
pub async fn start(store: StoreConfig) -> Running {
    start_with(config(store)).await
}

pub async fn start_with(config: ServerConfig) -> Running {
    let running = start_unready(config).await;
    until_serving(&running).await;
    running
}

/// Waits (at most [`WAIT_LIMIT`]) until `/readyz` of `running` answers 200.
pub async fn until_serving(running: &Running) {
    let deadline = std::time::Instant::now() + WAIT_LIMIT;
    loop {
        let (status, body) = get(running.addr(), "/readyz").await;
        if status == 200 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "limiter not ready within {WAIT_LIMIT:?}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a limiter without waiting for its store.
pub async fn start_unready(config: ServerConfig) -> Running {
    serve(config).await.expect("limiter starts")
}

/// POSTs JSON and parses the JSON answer.
pub async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, Value) {
    let r = tollgate_e2e::client::try_send(addr.port(), RequestSpec::post(path, body))
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let v = serde_json::from_str(&r.body).unwrap_or(Value::String(r.body.clone()));
    (r.status, v)
}

pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let r = tollgate_e2e::client::try_send(addr.port(), RequestSpec::get(path))
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    (r.status, r.body)
}

/// Body of a one-item lease batch from holder `holder` with `demand_per_s`.
pub fn holder_body(
    id: &str,
    policy: &str,
    key: &str,
    (min, want): (u64, u64),
    holder: &str,
    demand_per_s: f64,
) -> String {
    format!(
        r#"{{"leases":[{{"id":"{id}","policy":"{policy}","key":"{key}","min":{min},"want":{want},"holder":"{holder}","demand_per_s":{demand_per_s}}}]}}"#
    )
}

/// Body of a one-item lease batch.
pub fn lease_body(id: &str, policy: &str, key: &str, min: u64, want: u64) -> String {
    format!(
        r#"{{"leases":[{{"id":"{id}","policy":"{policy}","key":"{key}","min":{min},"want":{want}}}]}}"#
    )
}

pub fn return_body(id: &str, policy: &str, key: &str, unused: u64) -> String {
    format!(
        r#"{{"returns":[{{"id":"{id}","policy":"{policy}","key":"{key}","unused":{unused}}}]}}"#
    )
}

/// The value of the sample `series` (metric name and labels, exactly as rendered) in a
/// Prometheus text exposition, as a `T` (`u64` for counters, `f64` for gauges and histograms);
/// `None` when the series is absent or its value is not a `T`.
pub fn sample<T: std::str::FromStr>(text: &str, series: &str) -> Option<T> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `granted` of the first lease in an answer (panics on anything else).
pub fn granted(v: &Value) -> u64 {
    v["leases"][0]["granted"]
        .as_u64()
        .unwrap_or_else(|| panic!("no grant in {v}"))
}

/// A TCP proxy on 127.0.0.1 that can silently stop forwarding on the connections it already
/// has ("blackhole": no reset, no close, bytes just vanish) while new connections still go
/// through — a peer gone without a trace, which no socket error ever reports.
pub struct BlackholeProxy {
    addr: SocketAddr,
    /// Connections accepted before this generation forward nothing.
    frozen_below: std::sync::Arc<AtomicU64>,
    generation: std::sync::Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl BlackholeProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen_below = std::sync::Arc::new(AtomicU64::new(0));
        let generation = std::sync::Arc::new(AtomicU64::new(0));
        let (frozen, gen) = (frozen_below.clone(), generation.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let me = gen.fetch_add(1, Ordering::SeqCst);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pump(cr, sw, me, frozen.clone()));
                tokio::spawn(pump(sr, cw, me, frozen.clone()));
            }
        });
        Self {
            addr,
            frozen_below,
            generation,
            task,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every connection open now stops forwarding (silently); later ones work.
    pub fn blackhole_existing(&self) {
        self.frozen_below
            .store(self.generation.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

impl Drop for BlackholeProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    me: u64,
    frozen_below: std::sync::Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if me < frozen_below.load(Ordering::SeqCst) {
            // Hold both sockets open and forward nothing, forever (until the test ends).
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Counts the HTTP/2 frames a client sends (after the connection preface), by kind.
#[derive(Debug, Default)]
pub struct FrameCounter {
    seen: Vec<u8>,
    parsed: usize,
    /// RST_STREAM frames.
    pub resets: u64,
    /// HEADERS or DATA frames with END_STREAM: requests sent in full.
    pub ends_of_stream: u64,
}

impl FrameCounter {
    const PREFACE: usize = 24;

    fn feed(&mut self, bytes: &[u8]) {
        self.seen.extend_from_slice(bytes);
        if self.parsed == 0 {
            if self.seen.len() < Self::PREFACE {
                return;
            }
            self.parsed = Self::PREFACE;
        }
        while let Some(header) = self.seen.get(self.parsed..self.parsed + 9) {
            let len =
                usize::from(header[0]) << 16 | usize::from(header[1]) << 8 | usize::from(header[2]);
            let (kind, flags) = (header[3], header[4]);
            if self.seen.len() < self.parsed + 9 + len {
                return;
            }
            match kind {
                0x3 => self.resets += 1,
                0x0 | 0x1 if flags & 0x1 != 0 => self.ends_of_stream += 1,
                _ => {}
            }
            self.parsed += 9 + len;
        }
    }
}

/// A TCP proxy on 127.0.0.1 for one connection that can *stall* the client→server direction:
/// while stalled it forwards nothing and keeps what the client sends; [`StallProxy::release`]
/// hands all of it to the server in one write. That is what a server sees after its process
/// was stopped (SIGSTOP, a long pause) and resumed: everything its clients sent meanwhile,
/// at once, in order. It counts the client's HTTP/2 frames, so a test can wait for exactly
/// what it needs to have been sent.
pub struct StallProxy {
    addr: SocketAddr,
    shared: std::sync::Arc<StallShared>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct StallShared {
    /// `(stalled, bytes held while stalled, client frames)`.
    state: std::sync::Mutex<(bool, Vec<u8>, FrameCounter)>,
    to_server: tokio::sync::Mutex<Option<tokio::net::tcp::OwnedWriteHalf>>,
}

impl StallProxy {
    pub async fn start(target: SocketAddr) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = std::sync::Arc::new(StallShared::default());
        let task = tokio::spawn({
            let shared = shared.clone();
            async move {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let server = tokio::net::TcpStream::connect(target).await.unwrap();
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, sw) = server.into_split();
                *shared.to_server.lock().await = Some(sw);
                let back = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                });
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    {
                        let mut state = shared.state.lock().unwrap();
                        state.2.feed(&buf[..n]);
                        if state.0 {
                            state.1.extend_from_slice(&buf[..n]);
                            continue;
                        }
                    }
                    let mut to = shared.to_server.lock().await;
                    if to.as_mut().unwrap().write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                back.abort();
            }
        });
        Self { addr, shared, task }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// From now on the server receives nothing.
    pub fn stall(&self) {
        self.shared.state.lock().unwrap().0 = true;
    }

    /// `(resets, ends_of_stream)` the client has sent so far (held or forwarded).
    pub fn client_frames(&self) -> (u64, u64) {
        let state = self.shared.state.lock().unwrap();
        (state.2.resets, state.2.ends_of_stream)
    }

    /// Waits (bounded) until the client has sent at least `resets` RST_STREAMs and `ends`
    /// complete requests.
    pub async fn wait_for_client(&self, resets: u64, ends: u64) {
        let deadline = std::time::Instant::now() + WAIT_LIMIT;
        loop {
            let (r, e) = self.client_frames();
            if r >= resets && e >= ends {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the client sent {r} resets and {e} requests within {WAIT_LIMIT:?}, not \
                 {resets} and {ends}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Hands everything held to the server in one write; forwards normally from then on.
    /// Returns how many bytes were held.
    pub async fn release(&self) -> usize {
        use tokio::io::AsyncWriteExt;
        let mut to = self.shared.to_server.lock().await;
        let held = {
            let mut state = self.shared.state.lock().unwrap();
            state.0 = false;
            std::mem::take(&mut state.1)
        };
        to.as_mut()
            .expect("a connection")
            .write_all(&held)
            .await
            .unwrap();
        held.len()
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// When the calendar window of `policy` (`weekly`, `monthly`, `quarterly`, `yearly`) holding
/// `t_ms` ends, counted the slow way, independently of tollgate-core: the next Monday 00:00
/// UTC, or the first of the next month, quarter or year, found by adding up the lengths of
/// years and months from 1970.
pub fn next_utc_boundary(policy: &str, t_ms: u64) -> u64 {
    const DAY: u64 = 86_400_000;
    let leap = |y: u64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let month_days = |y: u64, m: u64| match m {
        2 if leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    let days = t_ms / DAY;
    if policy == "weekly" {
        // 1970-01-01 was a Thursday: Monday is 3 days before it.
        let since_monday = (days + 3) % 7;
        return (days - since_monday + 7) * DAY;
    }
    let every = match policy {
        "monthly" => 1,
        "quarterly" => 3,
        "yearly" => 12,
        other => panic!("{other} is not a calendar test policy"),
    };
    // The first of each month from 1970 on, until one lies past `t_ms` on the grid.
    let (mut year, mut month, mut start) = (1970u64, 1u64, 0u64);
    loop {
        if start > t_ms && (month - 1) % every == 0 {
            return start;
        }
        start += month_days(year, month) * DAY;
        month += 1;
        if month == 13 {
            (year, month) = (year + 1, 1);
        }
    }
}
