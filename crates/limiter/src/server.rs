//! Starting and stopping a limiter: the one entry point shared by the binary, the integration
//! tests and the benchmark (`serve` binds, spawns, and hands back the address and a handle).
//!
//! Besides the HTTP server it runs background tasks: the policy file watcher, the store
//! sampler (key counts, execution statistics), the hot-key check and, over TLS, the
//! certificate reloader. The lease listener speaks plaintext (h2c, for loopback and demos) or
//! TLS with client certificates ([`crate::tls`]); an optional admin listener serves only
//! `/healthz`, `/readyz`, `/metrics` and `/v1/hot-keys` (hashed keys only) in plaintext, for
//! probes, scrapers and operators that hold no client certificate. Shutdown stops accepting, lets in-flight requests
//! finish (bounded), then stops the tasks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::observe::{self, HotKeySettings, Observer};
use crate::policies::{self, LoadError, PolicyHandle};
use crate::region::{RegionConfig, RegionMetrics, RegionalStore};
use crate::service::{Service, ServiceSettings};
use crate::store::{
    AnyStore, MemoryStore, RedisClusterStore, RedisSecurity, RedisStore, Store, StoreError,
    StoreSettings,
};
use crate::tls::{Acceptor, TlsError, TlsSettings};

/// How often the store's key counts and execution statistics are sampled.
const STORE_SAMPLE_EVERY: Duration = Duration::from_secs(5);
/// How often keys above `--hot-key-share` are looked for.
const HOT_KEY_CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long shutdown waits for in-flight requests.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Most concurrent HTTP/2 streams per connection (`SETTINGS_MAX_CONCURRENT_STREAMS`): hyper's
/// default, named here next to the reset limits. Envoy's limiter cluster asks for up to 1024
/// per connection (`envoy/global.yaml`) and opens another connection when the server allows
/// fewer, which spreads a busy Envoy's callouts over several connection tasks, so over the
/// runtime's threads.
const MAX_CONCURRENT_STREAMS: u32 = 200;

/// Most streams a client may have reset while they still wait to be accepted, per connection;
/// beyond it the HTTP/2 stack (h2) answers `GOAWAY ENHANCE_YOUR_CALM` and drops the
/// connection, with every answer still in flight on it.
///
/// h2's default is 20, and a stall reaches it at once: while the limiter does not read (a GC-
/// like pause of the host, CPU starvation, SIGSTOP), Envoy keeps sending callouts on the same
/// connection and resets each when its timeout (tens of ms) passes. When the limiter reads
/// again, the whole backlog — every callout's HEADERS, DATA and RST_STREAM — is parsed in one
/// pass before a single stream is accepted, so all of them count at once, and the connection
/// is dropped with the live callouts that came after them.
///
/// The limit is what bounds the memory of reset-but-unaccepted streams (about 1-2 KB each:
/// the stream, its request head and its buffered body) until the accept loop drains them,
/// which it does as soon as the backlog is parsed. It is the "rapid reset" guard
/// (CVE-2023-44487) of the accept queue only: it does not bound work — every accepted stream
/// is served until its first wait whatever the limit — and the limiter serves the mesh's own
/// Envoys, not the internet. 16 384 covers a stall of several seconds at thousands of
/// cancelled callouts per second on one connection (Envoy's filter sends at most one callout
/// per key and worker, and backs a key off for 500 ms after a failure) while capping one
/// connection's queue at a few tens of MB.
const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 16_384;

/// Most streams the server itself may reset for a client's protocol errors, per connection,
/// before `GOAWAY ENHANCE_YOUR_CALM`: hyper's default, named here with its sibling above. It
/// only counts misbehaviour (malformed frames, bad headers), which no stall produces.
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1_024;

/// The HTTP server: HTTP/1.1 and HTTP/2 with prior knowledge (h2c, what Envoy uses) on one
/// port, with the HTTP/2 limits above.
fn http_builder() -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESET_STREAMS)
        .max_local_error_reset_streams(MAX_LOCAL_ERROR_RESET_STREAMS);
    builder
}

/// Which store holds the buckets. `Debug` shows the URLs without their passwords.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// In this process (the default without Redis).
    Memory,
    /// One Redis server: `redis://host:port`, or `rediss://` for TLS.
    Redis(String),
    /// A Redis Cluster, reached through any of these node URLs.
    Cluster(Vec<String>),
}

impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::store::security::redact_url;
        match self {
            StoreConfig::Memory => f.write_str("Memory"),
            StoreConfig::Redis(url) => f.debug_tuple("Redis").field(&redact_url(url)).finish(),
            StoreConfig::Cluster(urls) => f
                .debug_tuple("Cluster")
                .field(&urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>())
                .finish(),
        }
    }
}

/// Everything a limiter needs to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// The lease listener over mutual TLS; `None`: plaintext.
    pub tls: Option<TlsSettings>,
    /// The operator's explicit consent to a plaintext lease listener on an address other than
    /// loopback (`--insecure-plaintext`): something else must guard the port, e.g. a mesh
    /// sidecar with strict mutual TLS. Without it such a start is refused.
    pub insecure_plaintext: bool,
    /// A plaintext listener for `/healthz`, `/readyz`, `/metrics` and `/v1/hot-keys` only.
    pub admin_listen: Option<SocketAddr>,
    pub store: StoreConfig,
    /// TLS files and ACL credentials for Redis (`store::security`); none by default.
    pub redis_security: RedisSecurity,
    pub policies: PathBuf,
    /// `expires_ms` of granted leases.
    pub lease_ttl: Duration,
    /// How long a lease id is remembered (must exceed `lease_ttl`).
    pub dedup_ttl: Duration,
    /// Length of one assignment (a share of a bucket's rate; `> 0`, shorter than
    /// `dedup_ttl`).
    pub assignment_period: Duration,
    /// Deadline of one store call.
    pub store_timeout: Duration,
    /// How often the policy file is checked for changes.
    pub policy_poll: Duration,
    /// A regional limiter: `global` policies are leased from this parent (`--parent`).
    pub region: Option<RegionConfig>,
    /// Hot-key reporting (`GET /v1/hot-keys`, the hot-key log line).
    pub hot_keys: HotKeySettings,
    /// The RateLimitService listener (`crate::rls`), when configured.
    pub rls: Option<RlsServerConfig>,
}

/// The RateLimitService (`--rls-listen`): its listener takes the lease listener's TLS
/// settings (`tls`, the same certificate, client CA and allow-list) and its plaintext rule
/// (loopback only, unless `insecure_plaintext`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RlsServerConfig {
    pub listen: SocketAddr,
    /// envoyproxy/ratelimit configuration: a YAML file, or a directory of them.
    pub config: PathBuf,
    /// How often the configuration is checked for changes.
    pub poll: Duration,
    /// Response headers (`Some`: on, with ratelimit's header names).
    pub headers: Option<crate::rls::HeaderNames>,
    pub bounds: crate::rls::Bounds,
}

impl RlsServerConfig {
    /// Defaults: loopback port 8082, polled every second, no headers, the default bounds.
    pub fn new(config: impl Into<PathBuf>) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8082)),
            config: config.into(),
            poll: Duration::from_secs(1),
            headers: None,
            bounds: crate::rls::Bounds::default(),
        }
    }
}

impl ServerConfig {
    /// Defaults for everything but the policy file: loopback port 8081, memory store, 2 s
    /// leases remembered 60 s, 1 s assignments, 50 ms store timeout, policy file polled every
    /// second, the default hot-key settings.
    pub fn new(policies: impl Into<PathBuf>) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8081)),
            tls: None,
            insecure_plaintext: false,
            admin_listen: None,
            store: StoreConfig::Memory,
            redis_security: RedisSecurity::default(),
            policies: policies.into(),
            lease_ttl: Duration::from_secs(2),
            dedup_ttl: Duration::from_secs(60),
            assignment_period: Duration::from_secs(1),
            store_timeout: Duration::from_millis(50),
            policy_poll: Duration::from_secs(1),
            region: None,
            hot_keys: HotKeySettings::default(),
            rls: None,
        }
    }

    fn check(&self) -> Result<(), StartError> {
        if self.tls.is_none() && !is_loopback(self.listen) && !self.insecure_plaintext {
            return Err(StartError::Config(format!(
                "refusing to serve the lease listener in plaintext on {}, which is not a \
                 loopback address: anyone who can reach it could lease from (and drain) any \
                 budget. Serve it over mutual TLS with --tls-cert, --tls-key and \
                 --tls-client-ca, or, where something else guards the port (a mesh sidecar \
                 with strict mutual TLS), say so with --insecure-plaintext \
                 (TOLLGATE_INSECURE_PLAINTEXT=true)",
                self.listen
            )));
        }
        if let Some(rls) = &self.rls {
            if self.tls.is_none() && !is_loopback(rls.listen) && !self.insecure_plaintext {
                return Err(StartError::Config(format!(
                    "refusing to serve the RateLimitService (--rls-listen) in plaintext on {}, \
                     which is not a loopback address: anyone who can reach it could spend any \
                     budget. Serve it over mutual TLS with --tls-cert, --tls-key and \
                     --tls-client-ca (the lease listener's), or, where something else guards \
                     the port, say so with --insecure-plaintext",
                    rls.listen
                )));
            }
            if rls.poll.is_zero() {
                return Err(StartError::Config(
                    "--rls-config-poll must be longer than 0".into(),
                ));
            }
        }
        if self.policies.as_os_str().is_empty() && self.rls.is_none() {
            return Err(StartError::Config(
                "--policies is required unless --rls-config serves the RateLimitService".into(),
            ));
        }
        if self.lease_ttl.is_zero() {
            return Err(StartError::Config(
                "--lease-ttl must be longer than 0".into(),
            ));
        }
        if self.dedup_ttl <= self.lease_ttl {
            return Err(StartError::Config(format!(
                "--dedup-ttl ({:?}) must be longer than --lease-ttl ({:?}): a lease id must be \
                 remembered at least as long as its lease can be spent",
                self.dedup_ttl, self.lease_ttl
            )));
        }
        if self.assignment_period.is_zero() {
            return Err(StartError::Config(
                "--assignment-period must be longer than 0".into(),
            ));
        }
        let slack = Duration::from_millis(crate::region::ledger::RETURN_SLACK_MS);
        if self.dedup_ttl < self.lease_ttl + self.assignment_period + slack {
            return Err(StartError::Config(format!(
                "--dedup-ttl ({:?}) must be at least --lease-ttl ({:?}) + --assignment-period \
                 ({:?}) + {slack:?}: a lease id (an assignment's is spent for the TTL plus the \
                 period) must be remembered until its holder's return of what it did not spend \
                 has arrived",
                self.dedup_ttl, self.lease_ttl, self.assignment_period
            )));
        }
        if self.store_timeout.is_zero() {
            return Err(StartError::Config(
                "--store-timeout must be longer than 0".into(),
            ));
        }
        if self.policy_poll.is_zero() {
            return Err(StartError::Config(
                "--policy-poll must be longer than 0".into(),
            ));
        }
        if let Some(region) = &self.region {
            region.check().map_err(StartError::Config)?;
        }
        self.hot_keys.check().map_err(StartError::Config)?;
        if let StoreConfig::Cluster(urls) = &self.store {
            if urls.is_empty() {
                return Err(StartError::Config(
                    "--redis-cluster needs at least one node URL".into(),
                ));
            }
        }
        Ok(())
    }

    fn store_settings(&self) -> StoreSettings {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        StoreSettings {
            dedup_ttl_ms: ms(self.dedup_ttl),
            assignment_period_ms: ms(self.assignment_period),
            lease_ttl_ms: ms(self.lease_ttl),
        }
    }
}

/// A loopback address (an IPv4-mapped IPv6 one included): plaintext there reaches only this
/// host.
fn is_loopback(addr: SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

/// Why a limiter did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Policies(#[from] LoadError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
    #[error("cannot set up metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("{0}")]
    RlsRead(#[from] crate::rls::config::ReadError),
    #[error("invalid --rls-config: {0}")]
    RlsConfig(#[from] crate::rls::config::ConfigErrors),
}

/// A running limiter. Dropping it stops it too (without waiting).
#[derive(Debug)]
pub struct Running {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    rls_addr: Option<SocketAddr>,
    shutdown: watch::Sender<bool>,
    server: Option<JoinHandle<std::io::Result<()>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// The bound address (the real port when `listen` had port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin listener's bound address, when there is one.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The RateLimitService listener's bound address, when there is one.
    pub fn rls_addr(&self) -> Option<SocketAddr> {
        self.rls_addr
    }

    /// Stops accepting, waits (bounded) for in-flight requests, stops the background tasks.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(server) = self.server.take() {
            match tokio::time::timeout(DRAIN_TIMEOUT, server).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::error!(error = %e, "HTTP server failed"),
                Ok(Err(e)) => tracing::error!(error = %e, "HTTP server task failed"),
                Err(_) => {
                    tracing::warn!("in-flight requests did not finish within {DRAIN_TIMEOUT:?}")
                }
            }
        }
        for task in self.tasks.drain(..) {
            task.abort();
        }
    }

    /// Waits until the HTTP server stops by itself (only if its task panics: accept errors
    /// are retried).
    pub async fn stopped(&mut self) {
        if let Some(server) = self.server.as_mut() {
            let _ = server.await;
            self.server = None;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The regional ledger in front of `store`, for a limiter with a parent.
fn regional_store(
    config: &ServerConfig,
    region: &RegionConfig,
    store: AnyStore,
    policies: &Arc<PolicyHandle>,
    metrics: &Metrics,
) -> Result<RegionalStore, StartError> {
    // The same terms the stores give (lease TTL, assignment period), in ms.
    let settings = config.store_settings();
    let parent_timeout_ms = u64::try_from(region.parent_timeout.as_millis()).unwrap_or(u64::MAX);
    let terms = crate::region::ledger::Terms {
        lease_ttl_ms: settings.lease_ttl_ms,
        period_ms: settings.assignment_period_ms,
        // Half the parent's deadline, at least 50 ms: more than a round trip to it.
        renew_lead_ms: (parent_timeout_ms / 2).max(50),
        // Lease ids of the region's Envoys are remembered as long as a plain limiter does.
        remember_ms: settings.dedup_ttl_ms,
    };
    let region_metrics = RegionMetrics::new(metrics.registry())?;
    Ok(RegionalStore::new(
        store,
        config.store_timeout,
        region,
        terms,
        Arc::clone(policies),
        region_metrics,
    )?)
}

/// Builds the configured store (Redis stores connect in the background).
fn build_store(config: &ServerConfig) -> Result<AnyStore, StartError> {
    let settings = config.store_settings();
    Ok(match &config.store {
        StoreConfig::Memory => AnyStore::Memory(MemoryStore::new(settings)),
        StoreConfig::Redis(url) => {
            AnyStore::Redis(RedisStore::new(url, &config.redis_security, settings)?)
        }
        StoreConfig::Cluster(urls) => AnyStore::Cluster(RedisClusterStore::new(
            urls,
            &config.redis_security,
            settings,
        )?),
    })
}

/// Starts a limiter as configured: loads the policies (refusing an invalid document), builds
/// the store, binds `config.listen` and serves until shut down.
pub async fn serve(config: ServerConfig) -> Result<Running, StartError> {
    config.check()?;
    let (policies, loaded) = if config.policies.as_os_str().is_empty() {
        // The RateLimitService alone: no policy document, no lease policies.
        let empty = br#"{"policies":[]}"#.to_vec();
        let policies = tollgate_core::policy::Policies::from_json(&empty).map_err(|errors| {
            LoadError::Invalid {
                path: PathBuf::new(),
                errors,
            }
        })?;
        (policies, empty)
    } else {
        policies::load_file(&config.policies)?
    };
    let metrics = Metrics::new()?;
    metrics.set_policy_version(&policies.version);
    tracing::info!(version = %policies.version, policies = policies.policies.len(),
        path = %config.policies.display(), "policies loaded");
    let handle = Arc::new(PolicyHandle::new(policies));
    let store = build_store(&config)?;
    match config.region.clone() {
        None => serve_with_store(config, store, handle, loaded, metrics).await,
        Some(region) => {
            let store = regional_store(&config, &region, store, &handle, &metrics)?;
            serve_with_store(config, store, handle, loaded, metrics).await
        }
    }
}

/// [`serve`] once the policies are loaded and the store is built.
async fn serve_with_store<S: Store>(
    config: ServerConfig,
    store: S,
    handle: Arc<PolicyHandle>,
    loaded: Vec<u8>,
    metrics: Metrics,
) -> Result<Running, StartError> {
    let salt = config.hot_keys.load_salt().map_err(StartError::Config)?;
    let observer = Observer::new(config.hot_keys.clone(), &salt, metrics.clone());
    let store = Arc::new(store);
    let service = Arc::new(
        Service::new(
            Arc::clone(&store),
            Arc::clone(&handle),
            metrics.clone(),
            ServiceSettings {
                lease_ttl: config.lease_ttl,
                // A regional limiter's store call may wait for the parent (a dry reservoir).
                store_timeout: match &config.region {
                    Some(region) => {
                        config.store_timeout + region.parent_timeout + Duration::from_millis(50)
                    }
                    None => config.store_timeout,
                },
            },
        )
        .with_observer(observer.clone()),
    );

    let (listener, addr) = bind(config.listen).await?;
    let admin = match config.admin_listen {
        Some(admin) => Some(bind(admin).await?),
        None => None,
    };
    let (shutdown, shutdown_rx) = watch::channel(false);

    let mut tasks = Vec::new();
    let tls = match config.tls.clone() {
        Some(settings) => {
            let (acceptor, reloader) =
                Acceptor::start(settings, metrics.clone(), shutdown_rx.clone())?;
            tasks.push(reloader);
            Some(acceptor)
        }
        None => {
            // Only with --insecure-plaintext (`check` refuses it otherwise).
            if !is_loopback(addr) {
                tracing::warn!(%addr,
                    "the lease listener is plaintext on a non-loopback address \
                     (--insecure-plaintext): anyone who can reach it can lease from (and \
                     drain) any budget unless something else guards the port");
            }
            None
        }
    };
    let rls = match &config.rls {
        Some(rls) => {
            Some(start_rls(&config, rls, &metrics, shutdown_rx.clone(), &mut tasks).await?)
        }
        None => None,
    };
    if !config.policies.as_os_str().is_empty() {
        tasks.push(tokio::spawn(policies::watch_file(
            config.policies.clone(),
            loaded,
            handle,
            metrics,
            config.policy_poll,
            shutdown_rx.clone(),
        )));
    }
    tasks.push(tokio::spawn({
        let service = Arc::clone(&service);
        async move {
            // First contact with the store: replace its functions with this build's.
            service.prepare_store().await;
            let deadline = config.store_timeout.max(Duration::from_secs(2));
            loop {
                service.sample_active_keys().await;
                observe::sample_exec(&*store, &observer, deadline).await;
                tokio::time::sleep(STORE_SAMPLE_EVERY).await;
            }
        }
    }));
    tasks.push(tokio::spawn({
        let observer = service.observer().clone();
        async move {
            loop {
                tokio::time::sleep(HOT_KEY_CHECK_EVERY).await;
                observer.check_hot_keys();
            }
        }
    }));

    let admin_addr = admin.as_ref().map(|(_, addr)| *addr);
    if let Some((admin, admin_addr)) = admin {
        let app = crate::http::admin_router(Arc::clone(&service));
        let server = tokio::spawn(serve_http(admin, app, None, shutdown_rx.clone()));
        tasks.push(tokio::spawn(async move {
            if let Ok(Err(e)) = server.await {
                tracing::error!(error = %e, "admin listener failed");
            }
        }));
        tracing::info!(%admin_addr, "admin listener (health, readiness, metrics, hot keys) listening");
    }
    let transport = if tls.is_some() {
        "mutual TLS"
    } else {
        "plaintext"
    };
    let rls_addr = match rls {
        Some((listener, rls_addr, app)) => {
            let server = tokio::spawn(serve_http(listener, app, tls.clone(), shutdown_rx.clone()));
            tasks.push(tokio::spawn(async move {
                if let Ok(Err(e)) = server.await {
                    tracing::error!(error = %e, "RateLimitService listener failed");
                }
            }));
            tracing::info!(%rls_addr, transport, "RateLimitService (gRPC) listening");
            Some(rls_addr)
        }
        None => None,
    };
    let app = crate::http::router(service);
    let server = tokio::spawn(serve_http(listener, app, tls, shutdown_rx));
    tracing::info!(%addr, transport, "tollgate limiter listening");
    Ok(Running {
        addr,
        admin_addr,
        rls_addr,
        shutdown,
        server: Some(server),
        tasks,
    })
}

/// Loads the RateLimitService's configuration (refusing to start on an invalid one), builds
/// its store and its reload task, and binds its listener. The store is the configured one
/// (`--redis`, `--redis-cluster` or memory), built apart from the lease listener's: that one
/// may be a regional store (`region`) counting through a parent, while the service counts
/// in the configured store itself (`Store::count`: no lease records, so no settings of its
/// own).
async fn start_rls(
    config: &ServerConfig,
    rls: &RlsServerConfig,
    metrics: &Metrics,
    shutdown: watch::Receiver<bool>,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<(TcpListener, SocketAddr, Router), StartError> {
    use crate::rls::config::{fingerprint, read_sources, RlsConfig};
    let sources = read_sources(&rls.config)?;
    let loaded = RlsConfig::parse(&sources)?;
    tracing::info!(path = %rls.config.display(), files = loaded.files.len(),
        domains = loaded.domains().count(), "RateLimitService configuration loaded");
    let handle = Arc::new(policies::Current::new(loaded));
    let rls_metrics = crate::rls::RlsMetrics::new(metrics.registry())?;
    let store = Arc::new(build_store(config)?);
    tasks.push(tokio::spawn({
        let store = Arc::clone(&store);
        async move {
            // The lease listener's task loads the functions too; whichever is first.
            if let Err(e) = store.prepare().await {
                tracing::warn!(error = %e, "RateLimitService: cannot load the store's functions yet");
            }
        }
    }));
    let path = rls.config.clone();
    let read = {
        let path = path.clone();
        move || {
            read_sources(&path)
                .map(|sources| (fingerprint(&sources), sources))
                .map_err(|e| e.to_string())
        }
    };
    let unreadable = {
        let m = rls_metrics.clone();
        let path = path.clone();
        move |e: &str| {
            tracing::warn!(path = %path.display(), error = %e,
                "cannot read the RateLimitService configuration; keeping the one in force");
            m.reload("unreadable");
        }
    };
    let apply = {
        let m = rls_metrics.clone();
        let handle = Arc::clone(&handle);
        move |sources: Vec<(String, String)>| match RlsConfig::parse(&sources) {
            Ok(new) => {
                tracing::info!(path = %path.display(), files = new.files.len(),
                    domains = new.domains().count(), "RateLimitService configuration reloaded");
                handle.replace(new);
                m.reload("ok");
            }
            Err(errors) => {
                tracing::error!(path = %path.display(), reasons = %errors,
                    "new RateLimitService configuration is invalid; keeping the one in force");
                m.reload("invalid");
            }
        }
    };
    tasks.push(tokio::spawn(policies::watch(
        fingerprint(&sources),
        rls.poll,
        shutdown,
        read,
        unreadable,
        apply,
    )));
    let service = crate::rls::RlsService::new(
        store,
        handle,
        rls_metrics,
        metrics.clone(),
        crate::rls::RlsSettings {
            store_timeout: config.store_timeout,
            bounds: rls.bounds,
            headers: rls.headers.clone(),
        },
    );
    let app = Router::new().route_service(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        service.into_server(),
    );
    let (listener, addr) = bind(rls.listen).await?;
    Ok((listener, addr, app))
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let bind_error = |source| StartError::Bind { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    Ok((listener, bound))
}

/// Accepts connections until `stop` turns true, then stops accepting and shuts every open
/// connection down gracefully (HTTP/2: GOAWAY, in-flight streams finish; HTTP/1.1: closed
/// after the request in flight); returns when the last one is done. With `tls`, each
/// connection's handshake runs in its own task (a slow client holds up no other), and only
/// a completed one is served.
async fn serve_http(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<Acceptor>>,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let builder = http_builder();
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stopped(&mut stop) => break,
        };
        let tcp = match accepted {
            Ok((tcp, _peer)) => tcp,
            Err(e) => {
                accept_failed(&e).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        let builder = builder.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let served = match tls {
                None => {
                    let connection = builder.serve_connection(TokioIo::new(tcp), service);
                    watcher.watch(connection.into_owned()).await
                }
                Some(acceptor) => {
                    let Some(stream) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let connection = builder.serve_connection(TokioIo::new(stream), service);
                    watcher.watch(connection.into_owned()).await
                }
            };
            if let Err(e) = served {
                // A client going away mid-request is routine; h2 logs its own protocol
                // errors (GOAWAY it sends) at warn.
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Resolves once `stop` is (or turns) true, or its sender is gone.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    while !*stop.borrow_and_update() {
        if stop.changed().await.is_err() {
            return;
        }
    }
}

/// An accept error: a connection that failed before it was accepted is the client's problem;
/// anything else (out of file descriptors) is logged and retried after a pause, so a full
/// descriptor table does not spin the loop.
async fn accept_failed(e: &std::io::Error) {
    use std::io::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused
    ) {
        return;
    }
    tracing::error!(error = %e, "cannot accept a connection; retrying in 1s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rls_listener_follows_the_plaintext_rule_and_policies_become_optional() {
        let mut c = ServerConfig::new("");
        let e = c.check().unwrap_err().to_string();
        assert!(
            e.contains("--policies is required unless --rls-config"),
            "{e}"
        );
        let mut rls = RlsServerConfig::new("rl/");
        c.rls = Some(rls.clone());
        assert!(c.check().is_ok());
        rls.listen = "0.0.0.0:8082".parse().unwrap();
        c.rls = Some(rls.clone());
        let e = c.check().unwrap_err().to_string();
        assert!(
            e.contains("--rls-listen") && e.contains("not a loopback"),
            "{e}"
        );
        c.insecure_plaintext = true;
        assert!(c.check().is_ok());
        c.insecure_plaintext = false;
        c.tls = Some(TlsSettings {
            cert: "c".into(),
            key: "k".into(),
            client_ca: "ca".into(),
            allow: vec![],
            reload_every: Duration::from_secs(10),
        });
        assert!(c.check().is_ok());
        rls.poll = Duration::ZERO;
        c.rls = Some(rls);
        assert!(c
            .check()
            .unwrap_err()
            .to_string()
            .contains("--rls-config-poll"));
    }

    #[test]
    fn the_assignment_period_is_positive_and_shorter_than_the_dedup_ttl() {
        let mut c = ServerConfig::new("p.json");
        assert!(c.check().is_ok());
        assert_eq!(c.store_settings().assignment_period_ms, 1_000);
        assert_eq!(c.store_settings().lease_ttl_ms, 2_000);
        c.assignment_period = Duration::ZERO;
        let e = c.check().unwrap_err().to_string();
        assert!(e.contains("--assignment-period"), "{e}");
        // A lease id outlives what its lease can be spent (TTL + period) by the return slack.
        c.assignment_period = c.dedup_ttl - c.lease_ttl;
        let e = c.check().unwrap_err().to_string();
        assert!(e.contains("--dedup-ttl"), "{e}");
        c.assignment_period = c.dedup_ttl - c.lease_ttl - Duration::from_secs(1);
        assert!(c.check().is_ok());
    }
}
