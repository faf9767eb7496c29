//! A regional limiter (`tollgate-limiter --parent URL`): the region's Envoys lease from it as
//! from any limiter; policies of scope `regional` live in its own store, and policies of scope
//! `global` are leased from the parent limiter, over the same protocol the filter speaks.
//!
//! Envoys → regional limiter → parent limiter:
//! * the region holds what the parent gave it per (`policy`, `key`) in a [`ledger::Reservoir`]
//!   (leases, and under overload a share of the parent's rate), and hands it out to its
//!   instances as leases and sub-assignments; tokens leave the parent before the region
//!   spends them, so regions never overshoot without faults, however many there are;
//! * the parent is asked off the request path: in the background when a reservoir runs
//!   low or its assignment ends, one ask in flight per key, under `--parent-timeout`; an
//!   instance waits for the parent only when the reservoir is dry (its first lease, or after
//!   the region's assignment ended);
//! * the connection to the parent is opened at start and kept open in the background, so an
//!   ask's deadline is not spent on a TCP and TLS handshake; `/readyz` answers 503 until the
//!   parent has been reached once;
//! * leases about to expire with tokens left go back to the parent, so an idle region does
//!   not strand budget another region needs;
//! * partition: while the parent cannot be reached, the region spends what it holds until
//!   that expires (the parent's lease TTL; an assignment's period), then answers its
//!   instances `UNAVAILABLE`, and each policy's failure mode applies in the filter. Asks go
//!   on in the background; the first answer after the heal ends the partition.
//!
//! The reservoirs live in this process, bounded by `--regional-keys`: each regional instance
//! is one holder at the parent, like an Envoy is one holder here. Lease ids of the region's
//! instances are remembered per reservoir (the last [`RECORDS_PER_KEY`], each as long as a
//! plain limiter remembers a lease id, `--dedup-ttl`) for replays and returns, and a
//! reservoir is kept while it remembers any; a return the reservoir can no longer hold goes
//! on to the parent under the parent leases its tokens came from. A retry that reaches another
//! regional instance is decided anew (under-use of one lease, never overshoot).
//!
//! Here: the settings, the store and the state it shares with its background tasks; `supply`
//! keeps the reservoirs supplied by the parent (asks, answers, the sweep, returns), `serve`
//! decides the region's instances' leases and returns from them.

pub mod ledger;
pub mod metrics;
mod parent;
mod serve;
mod supply;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tollgate_core::policy::Scope;

use crate::clock::{Clock, MonotonicClock};
use crate::policies::PolicyHandle;
use crate::store::{
    AnyStore, ExecStats, Grant, LeaseItem, LeaseOutcome, ReturnItem, ReturnOutcome, Store,
    StoreError,
};
use ledger::{Reservoir, Terms};
pub use metrics::RegionMetrics;
use parent::Parent;
pub use parent::{ParentError, ParentTls};

/// Lease ids of the region's instances remembered per reservoir.
pub const RECORDS_PER_KEY: usize = 64;

/// How often reservoirs are swept (expiry, returns, background asks during a partition,
/// idle reservoirs, gauges). Renewals at a drip's end have their own timer, and an ask that
/// leaves a reservoir low starts its refill at once.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// A regional limiter's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionConfig {
    /// `http://host:port` of the parent limiter's lease listener (h2c).
    pub parent_url: String,
    /// This region's name (`[0-9A-Za-z_-]`, 1 to 40 bytes): with a per-process suffix, the
    /// holder id this instance has at the parent.
    pub region: String,
    /// Deadline of one call to the parent.
    pub parent_timeout: Duration,
    /// Most (`policy`, `key`) reservoirs held at once.
    pub max_keys: usize,
    /// TLS towards an `https://` parent.
    pub tls: Option<ParentTls>,
}

impl RegionConfig {
    /// The checks `ServerConfig::check` runs.
    pub fn check(&self) -> Result<(), String> {
        let name_ok = !self.region.is_empty()
            && self.region.len() <= 40
            && self
                .region
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !name_ok {
            return Err(format!(
                "--region must be 1 to 40 bytes of [0-9A-Za-z_-], got `{}`",
                self.region
            ));
        }
        if self.parent_timeout.is_zero() || self.parent_timeout > Duration::from_secs(10) {
            return Err("--parent-timeout must be longer than 0 and at most 10s".into());
        }
        if self.max_keys == 0 {
            return Err("--regional-keys must be at least 1".into());
        }
        Ok(())
    }
}

/// The reachability of the parent, as this instance saw it.
#[derive(Debug, Default)]
struct Reachability {
    /// When calls started failing (`None`: the last call succeeded).
    down_since_ms: Option<u64>,
    last_failure_ms: u64,
    last_error: String,
}

/// What the region remembers of one lease it handed out.
#[derive(Debug, Clone)]
struct Record {
    id: String,
    grant: Grant,
    /// Tokens it took: its grant and the whole tokens of its sub-share.
    taken: u64,
    returned: u64,
    /// The parent leases its tokens came from: a return the reservoir cannot hold goes there.
    sources: ledger::Sources,
    /// Forgotten from then on.
    until_ms: u64,
}

struct Entry {
    reservoir: Reservoir,
    fetching: bool,
    /// Bumped when a parent ask of this reservoir completes.
    done: watch::Sender<u64>,
    records: VecDeque<Record>,
    /// The parent refused this key's asks (its policy there): until when, and why.
    refused: Option<(u64, String)>,
}

impl Entry {
    fn new() -> Self {
        Self {
            reservoir: Reservoir::default(),
            fetching: false,
            done: watch::channel(0).0,
            records: VecDeque::new(),
            refused: None,
        }
    }
}

type KeyId = (String, String);

#[derive(Default)]
struct State {
    reservoirs: HashMap<KeyId, Entry>,
    parent: Reachability,
}

struct Shared {
    parent: Parent,
    policies: Arc<PolicyHandle>,
    clock: MonotonicClock,
    terms: Terms,
    max_keys: usize,
    state: Mutex<State>,
    metrics: RegionMetrics,
}

/// The store of a regional limiter: `regional` policies in `inner`, `global` ones leased from
/// the parent. Dropping it stops its background sweep.
pub struct RegionalStore {
    inner: AnyStore,
    /// Deadline of one call to `inner` (`--store-timeout`): the service's deadline for a
    /// store call of a regional limiter also covers a wait for the parent.
    inner_timeout: Duration,
    shared: Arc<Shared>,
    sweeper: JoinHandle<()>,
    /// Keeps the connection to the parent open ([`Parent::keep_connected`]).
    connector: JoinHandle<()>,
}

impl std::fmt::Debug for RegionalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionalStore")
            .field("inner", &self.inner)
            .field("parent", &self.shared.parent)
            .finish()
    }
}

impl Drop for RegionalStore {
    fn drop(&mut self) {
        self.sweeper.abort();
        self.connector.abort();
    }
}

impl RegionalStore {
    /// Starts the background sweep (needs a tokio runtime).
    pub fn new(
        inner: AnyStore,
        inner_timeout: Duration,
        config: &RegionConfig,
        terms: Terms,
        policies: Arc<PolicyHandle>,
        metrics: RegionMetrics,
    ) -> Result<Self, StoreError> {
        config.check().map_err(StoreError::Config)?;
        let suffix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() ^ std::process::id())
            .unwrap_or(0);
        let holder = format!("{}-{suffix:08x}", config.region);
        let parent = Parent::new(
            &config.parent_url,
            config.tls.as_ref(),
            holder,
            config.parent_timeout,
        )
        .map_err(StoreError::Config)?;
        tracing::info!(parent = %config.parent_url, holder = parent.holder(),
            "regional limiter: global policies are leased from the parent");
        let shared = Arc::new(Shared {
            parent,
            policies,
            clock: MonotonicClock::new(),
            terms,
            max_keys: config.max_keys,
            state: Mutex::new(State::default()),
            metrics,
        });
        shared.metrics.set_parent_reachable(true, 0.0);
        let sweeper = tokio::spawn({
            let shared = Arc::clone(&shared);
            async move {
                loop {
                    tokio::time::sleep(SWEEP_EVERY).await;
                    Shared::sweep(&shared);
                }
            }
        });
        // The connection to the parent is opened now, before any instance asks.
        let connector = tokio::spawn({
            let shared = Arc::clone(&shared);
            async move { shared.parent.keep_connected().await }
        });
        Ok(Self {
            inner,
            inner_timeout,
            shared,
            sweeper,
            connector,
        })
    }

    /// A call to the inner store under `--store-timeout`.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.inner_timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.inner_timeout)),
        }
    }

    fn is_global(&self, policy: &str) -> bool {
        self.shared
            .policies
            .current()
            .get(policy)
            .is_some_and(|p| p.scope == Scope::Global)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a reservoir half-updated in a way that
        // overspends (every update is a few assignments): keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The burst of (`policy`, `key`): of the key's `limits` entry when the policy has any.
    fn capacity(&self, policy: &str, key: &str) -> u64 {
        self.policies
            .current()
            .get(policy)
            .map_or(1, |p| p.rated(key).burst)
    }
}

impl Store for RegionalStore {
    async fn lease(&self, items: &[LeaseItem]) -> Result<LeaseOutcome, StoreError> {
        let global = items.iter().filter(|i| self.is_global(&i.policy)).count();
        match (global, items) {
            (0, _) => self.bounded(self.inner.lease(items)).await,
            (1, [item]) => {
                let grant = self.shared.lease(item).await?;
                Ok(LeaseOutcome {
                    now_ms: self.shared.clock.now_ms(),
                    grants: vec![grant],
                })
            }
            _ => Err(StoreError::Config(
                "a group with a global policy cannot be decided atomically by a regional \
                 limiter (its budget is leased from the parent)"
                    .into(),
            )),
        }
    }

    async fn give_back(&self, item: &ReturnItem) -> Result<ReturnOutcome, StoreError> {
        if self.is_global(&item.policy) {
            Ok(self.shared.give_back(item))
        } else {
            self.bounded(self.inner.give_back(item)).await
        }
    }

    async fn prepare(&self) -> Result<(), StoreError> {
        self.inner.prepare().await
    }

    /// Its own store is ready, and the parent has been reached since start (an instance that
    /// never reached it can lease nothing of a global policy: a rollout with a wrong
    /// `--parent`, CA or certificate stops at its first instance). A later partition does not
    /// make it unready: it spends what it holds, and its regional policies are its own.
    async fn ready(&self) -> Result<(), StoreError> {
        self.inner.ready().await?;
        self.shared.parent.reached().map_err(StoreError::Parent)
    }

    async fn active_keys(&self) -> Result<Vec<(String, u64)>, StoreError> {
        self.inner.active_keys().await
    }

    async fn exec_stats(&self) -> Result<Vec<(String, ExecStats)>, StoreError> {
        self.inner.exec_stats().await
    }

    fn node_for(&self, key: &str) -> String {
        self.inner.node_for(key)
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}
