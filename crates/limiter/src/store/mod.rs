//! The store seam: every global bucket lives behind [`Store`], so the HTTP service, its
//! validation and its metrics are written once and run unchanged against the in-memory store,
//! one Redis, or a Redis Cluster.
//!
//! A store decides one *unit* per call: a single lease, or an all-or-nothing group of leases
//! whose keys share a hash tag (one Redis Cluster slot). Each call is atomic on the store side
//! (a mutex in memory, one Redis Function call in Redis). Lease ids make calls idempotent: the
//! store keeps a record per id in the bucket's slot and answers a repeated id from it.
//!
//! Stores never invent answers: a call they could not complete is a [`StoreError`], which the
//! service turns into `UNAVAILABLE`, never into a grant or a denial.
//!
//! A policy's algorithm decides which state an item reads: a token bucket (`tollgate_core::
//! assign`, with assignments), or a window (`tollgate_core::window`: fixed window, sliding
//! window counter, sliding log), each under keys of its own (`store::keys`), so a policy switched
//! from one algorithm to another never reads the other's state as its own. A windowed lease is
//! drawn from the current window and expires with it; its unused units are never given back
//! (they count as used in their window: under-use, never overshoot), and windows assign
//! nothing.

use std::future::Future;
use std::time::Duration;

use tollgate_core::assign::{self, Ask, Holding, Terms};
use tollgate_core::bucket::{BucketState, Limits};
use tollgate_core::policy::Algorithm;

mod cluster;
mod keys;
mod memory;
mod role;
mod single;

mod any;
pub(crate) mod script;
pub mod security;
mod watchdog;

pub(crate) use any::AnyStore;
pub use cluster::RedisClusterStore;
pub use keys::{fixed_count_key, log_seen_key, rls_key, rls_window_key, RLS_POLICY};
pub use memory::{MemoryStore, WindowState};
pub use security::{RedisSecurity, Secret};
pub use single::RedisStore;
pub use watchdog::RECONNECT_AFTER;

/// How much longer than a full refill a bucket's state is kept after its last write: state
/// idle that long describes a full bucket, so dropping it and recreating it full is exact.
/// The slack covers clock differences between the writer and the expiring node.
pub const BUCKET_TTL_MARGIN_MS: u64 = 1_000;
/// Buckets whose state would have to be kept longer than this (ten years) never expire: an
/// expiry would have to be that far out anyway, and some stores cap expiry times.
pub const MAX_BUCKET_TTL_MS: u64 = 10 * 365 * 24 * 3_600 * 1_000;

/// TTL of a bucket's state written at `now_ms` (`state` as written, `holdings` as kept with
/// it), in ms; `0` means "no expiry". The one rule of every store (the Redis Function mirrors
/// it line by line):
///
/// * the state lives until a full refill from empty, and until a full refill from its own
///   content, debt included ([`assign::refill_from_ms`]): only then does dropping it and
///   recreating it full lose nothing;
/// * and until its latest live holding ends, so the shares of running assignments are never
///   forgotten while they run;
/// * plus `max(BUCKET_TTL_MARGIN_MS, 10 %)` of that;
/// * a TTL beyond [`MAX_BUCKET_TTL_MS`] (glacial policies, or debt of one) is no expiry.
pub fn bucket_ttl_ms(
    limits: &Limits,
    state: &BucketState,
    holdings: &[Holding],
    now_ms: u64,
) -> u64 {
    let mut need = limits
        .full_refill_ms()
        .max(assign::refill_from_ms(limits, state));
    for h in holdings {
        if h.ends_ms > now_ms {
            need = need.max(h.ends_ms - now_ms);
        }
    }
    let ttl = need.saturating_add(BUCKET_TTL_MARGIN_MS.max(need / 10));
    if ttl > MAX_BUCKET_TTL_MS {
        0
    } else {
        ttl
    }
}

/// How much longer than the moment it equals a fresh one a window's state is kept (the end
/// of its newest window for a fixed window, of the window after it for a sliding window
/// counter, a window after its newest unit for a sliding log): the slack covers clock
/// differences between the writer and the expiring node, like [`BUCKET_TTL_MARGIN_MS`].
pub const WINDOW_TTL_MARGIN_MS: u64 = 1_000;

/// TTL of a window's state written at `now_ms` that equals a fresh one from `idle_at_ms` on
/// (`window::Counters::idle_at_ms`, `window::Log::idle_at_ms`), in ms (> 0). The one rule of
/// every store (the Redis Function mirrors it). Windows are at most 365 days long, so this is
/// always a real expiry.
pub fn window_ttl_ms(idle_at_ms: u64, now_ms: u64) -> u64 {
    idle_at_ms
        .saturating_sub(now_ms)
        .saturating_add(WINDOW_TTL_MARGIN_MS)
}

/// Settings every store shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreSettings {
    /// How long a lease id's record (its grant and how much was returned) is kept.
    pub dedup_ttl_ms: u64,
    /// Length of one assignment (`> 0`, shorter than `dedup_ttl_ms`).
    pub assignment_period_ms: u64,
    /// How long a lease's tokens may be spent: a holder that got only a lease stays known to
    /// the bucket that long (`> 0`).
    pub lease_ttl_ms: u64,
}

impl StoreSettings {
    /// The terms of assignments, as `tollgate_core::assign` takes them.
    pub(crate) fn terms(&self) -> Terms {
        Terms {
            period_ms: self.assignment_period_ms,
            lease_ttl_ms: self.lease_ttl_ms,
        }
    }
}

/// One validated lease request, with its policy's limits resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseItem {
    pub id: String,
    pub policy: String,
    /// A key that passed [`tollgate_core::key::validate_key`].
    pub key: String,
    /// The token bucket's limits (a windowed policy has them too, unused).
    pub limits: Limits,
    /// How the policy counts: a token bucket (`limits`), or a window.
    pub algorithm: Algorithm,
    /// `1 ≤ min ≤ capacity`.
    pub min: u64,
    /// `min ≤ want ≤ capacity`.
    pub want: u64,
    /// The asking instance (1 to `assign::MAX_HOLDER_BYTES` bytes of `[0-9A-Za-z_-]`); only
    /// a named holder of a token bucket can receive an assignment (windows assign nothing).
    pub holder: Option<String>,
    /// The holder's offered demand for this bucket, units per ms (finite, `≥ 0`).
    pub demand_per_ms: f64,
}

impl LeaseItem {
    /// The Redis key of the item's token bucket (`store::keys::bucket_key`).
    pub fn bucket_key(&self) -> String {
        keys::bucket_key(&self.policy, &self.key)
    }

    /// The Redis key of the state the item's algorithm reads: its token bucket, or its window
    /// (`store::keys::state_key`).
    pub fn state_key(&self) -> String {
        keys::state_key(&self.algorithm, &self.policy, &self.key)
    }

    /// The Redis key of the item's lease record (`store::keys::lease_key`).
    pub fn lease_key(&self) -> String {
        keys::lease_key(&self.key, &self.id)
    }

    /// The item as `tollgate_core::assign::allot` takes it.
    pub(crate) fn ask(&self) -> Ask<'_> {
        Ask {
            min: self.min,
            want: self.want,
            holder: self.holder.as_deref(),
            demand_per_ms: self.demand_per_ms,
        }
    }
}

/// One validated return of unused lease tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct ReturnItem {
    pub id: String,
    pub policy: String,
    pub key: String,
    pub limits: Limits,
    /// The policy's algorithm now: only a token bucket takes units back.
    pub algorithm: Algorithm,
    pub unused: u64,
}

impl ReturnItem {
    /// The Redis key of the bucket the lease was drawn from (`store::keys::bucket_key`).
    pub fn bucket_key(&self) -> String {
        keys::bucket_key(&self.policy, &self.key)
    }

    /// Whether the policy takes units back: a token bucket does; a window never does (units
    /// leased from it count as used in their window).
    pub fn takes_back(&self) -> bool {
        self.algorithm == Algorithm::TokenBucket
    }

    /// The Redis key of the lease's record (`store::keys::lease_key`).
    pub fn lease_key(&self) -> String {
        keys::lease_key(&self.key, &self.id)
    }
}

/// The answer to one lease item.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    /// `0`, or within `[min, want]`.
    pub granted: u64,
    /// Tokens left in the bucket (fractional).
    pub remaining: f64,
    /// When `granted == 0`: how long until `min` tokens are there (`0` when the item alone
    /// would have been granted but another item of its group was not).
    pub retry_after_ms: u64,
    /// The lease id had been decided before; this is the original answer, nothing was taken.
    pub replayed: bool,
    /// Assigned share of the bucket's refill rate, units per ms (`0`: none).
    pub share_per_ms: f64,
    /// How long the share may be spent (`0` without a share).
    pub period_ms: u64,
    /// A windowed policy's item: how long from the decision (the store's clock) the lease may
    /// be spent, until the end of the window it was drawn from (a sliding log: one window);
    /// for a replay, what is left of that (`0` once it ended). `None` for a token bucket,
    /// whose leases last the service's lease TTL.
    pub expires_ms: Option<u64>,
}

/// The answer to one unit: one [`Grant`] per item, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseOutcome {
    /// The store's clock when it decided (Redis `TIME`, or the memory store's clock).
    pub now_ms: u64,
    pub grants: Vec<Grant>,
}

/// The answer to one return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReturnOutcome {
    pub now_ms: u64,
    /// Tokens that went back (`0` for an unknown, expired or fully returned lease).
    pub returned: u64,
}

/// One hit counted by [`Store::count`]: a fixed window of `window_ms` aligned to the epoch
/// (window `n` holds `[n·window_ms, (n+1)·window_ms)` of the store's clock) under the
/// RateLimitService's reserved policy ([`RLS_POLICY`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountItem {
    /// The bucket's wire key ([`rls_key`]).
    pub key: String,
    /// Units a window holds.
    pub limit: u64,
    /// `> 0`.
    pub window_ms: u64,
    /// Units the hit takes, `≥ 1`.
    pub cost: u64,
}

impl CountItem {
    /// The Redis key of the window the item is counted in ([`rls_window_key`]).
    pub fn window_key(&self) -> String {
        keys::rls_window_key(&self.key, self.window_ms)
    }

    /// The same hit as a `fixed_window` lease item (`min = want = cost`), for stores without
    /// a count operation of their own.
    fn as_lease(&self, id: String) -> Result<LeaseItem, StoreError> {
        let bad = || StoreError::Config(format!("count item out of range: {self:?}"));
        let window =
            tollgate_core::window::Window::new(self.limit, self.window_ms).ok_or_else(bad)?;
        let limits = Limits::new(self.limit, self.window_ms, self.limit).ok_or_else(bad)?;
        Ok(LeaseItem {
            id,
            policy: RLS_POLICY.to_string(),
            key: self.key.clone(),
            limits,
            algorithm: Algorithm::FixedWindow(window),
            min: self.cost,
            want: self.cost,
            holder: None,
            demand_per_ms: 0.0,
        })
    }
}

/// The answer to one [`Store::count`] call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountOutcome {
    /// The store's clock when it decided.
    pub now_ms: u64,
    /// Every item was counted (`true`) or none was.
    pub admitted: bool,
    /// Per item, in order: units left in its window after it (admitted), or before the call
    /// (refused); `0` when the window is over its limit.
    pub remaining: Vec<u64>,
}

/// Lease ids of [`Store::count`]'s fallback through [`Store::lease`]: `count-<instance>-<n>`,
/// unique per process and item.
fn fallback_lease_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static INSTANCE: OnceLock<String> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let instance = INSTANCE.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{:x}{nanos:x}", std::process::id())
    });
    format!("count-{instance}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// How long the store's own decision code has run, cumulative per node: Redis' `INFO
/// commandstats` for `FCALL` (the Function's execution on the server, without the network),
/// or the memory store's in-process decision time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExecStats {
    /// Decisions (lease and return calls) run.
    pub calls: u64,
    /// Microseconds they ran, in total.
    pub usec: f64,
}

/// Why a store call did not produce an answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    #[error("cannot reach the store: {0}")]
    Connection(String),
    #[error("cluster is reconfiguring: {0}")]
    Cluster(String),
    #[error("store is loading its data set")]
    Loading,
    #[error("store node is a read-only replica: {0}")]
    ReadOnly(String),
    #[error("tollgate functions are not loaded: {0}")]
    FunctionMissing(String),
    #[error("store rejected the call: {0}")]
    Server(String),
    #[error("unexpected reply from the store: {0}")]
    Protocol(String),
    #[error("bad store configuration: {0}")]
    Config(String),
    /// The TLS handshake failed: Redis' certificate is not one we trust, or Redis refused
    /// ours (`store::security`).
    #[error("TLS handshake with the store failed: {0}")]
    Tls(String),
    /// Redis refused the user name and password, or wants some (`WRONGPASS`, `NOAUTH`).
    #[error("authentication with the store failed: {0}")]
    Auth(String),
    /// A regional limiter holds nothing for the key and its parent limiter gave no answer
    /// (`region`): a partition, not a fault of the region's own store.
    #[error("{0}")]
    Parent(String),
}

impl StoreError {
    /// Whether the same call may succeed later without anyone changing anything (network,
    /// failover, restart). Non-transient errors point at a bug or a misconfiguration.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Timeout(_)
            | StoreError::Connection(_)
            | StoreError::Cluster(_)
            | StoreError::Loading
            | StoreError::ReadOnly(_)
            | StoreError::FunctionMissing(_)
            | StoreError::Parent(_) => true,
            StoreError::Server(_)
            | StoreError::Protocol(_)
            | StoreError::Config(_)
            | StoreError::Tls(_)
            | StoreError::Auth(_) => false,
        }
    }

    /// Short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Connection(_) => "connection",
            StoreError::Cluster(_) => "cluster",
            StoreError::Loading => "loading",
            StoreError::ReadOnly(_) => "read_only",
            StoreError::FunctionMissing(_) => "function_missing",
            StoreError::Server(_) => "server",
            StoreError::Protocol(_) => "protocol",
            StoreError::Config(_) => "config",
            StoreError::Tls(_) => "tls",
            StoreError::Auth(_) => "auth",
            StoreError::Parent(_) => "parent",
        }
    }
}

/// Where global buckets live. Every implementation has the same semantics, checked by one
/// contract suite (`tests/contract.rs`).
pub trait Store: Send + Sync + 'static {
    /// Decides one unit atomically with `tollgate_core::assign::allot` (token buckets) and
    /// `tollgate_core::window` (windowed policies: `lease` of the policy's algorithm, no
    /// assignments), its items (1 or more, all keys sharing one hash tag, algorithms mixed at
    /// will) in order: every item gets something (a grant of at least its `min`, or a share),
    /// or none takes anything. When some got something and
    /// others nothing, no bucket and no holding changes; when all got nothing, what `allot`
    /// left is kept (waiting holders' demands are recorded, so the others' renewals make
    /// room for them). Items whose lease id was decided before answer from their record and
    /// take nothing.
    fn lease(
        &self,
        items: &[LeaseItem],
    ) -> impl Future<Output = Result<LeaseOutcome, StoreError>> + Send;

    /// Counts one hit per item in its fixed window on the store's clock, all or nothing (all
    /// keys sharing one hash tag): when every item's window count plus its cost (plus the
    /// costs of the call's earlier items in the same window) is within its limit, every count
    /// grows by its cost; otherwise nothing changes. A window's count lives until the end of
    /// its window plus [`WINDOW_TTL_MARGIN_MS`]. No lease record is written: a count is never
    /// replayed nor given back. Its windows are those of a `fixed_window` lease item of the
    /// same key and length ([`CountItem::window_key`]).
    ///
    /// The default runs the items as `fixed_window` lease items (`min = want = cost`), which
    /// decides the same but writes a lease record per item; the memory and Redis stores have
    /// a dedicated operation (Redis: the Function `tollgate_v4_count`).
    fn count(
        &self,
        items: &[CountItem],
    ) -> impl Future<Output = Result<CountOutcome, StoreError>> + Send {
        let leased: Result<Vec<LeaseItem>, StoreError> = items
            .iter()
            .map(|item| item.as_lease(fallback_lease_id()))
            .collect();
        async move {
            let leased = leased?;
            let outcome = self.lease(&leased).await?;
            if outcome.grants.len() != leased.len() {
                return Err(StoreError::Protocol(format!(
                    "{} answers for {} items",
                    outcome.grants.len(),
                    leased.len()
                )));
            }
            Ok(CountOutcome {
                now_ms: outcome.now_ms,
                admitted: outcome.grants.iter().all(|g| g.granted > 0),
                remaining: outcome
                    .grants
                    .iter()
                    .map(|g| g.remaining.max(0.0).floor() as u64)
                    .collect(),
            })
        }
    }

    /// Gives back `min(unused, taken − returned so far)` of lease `item.id` (`taken`: its
    /// grant plus the whole tokens of its assignment, `Allotment::taken`), added to the
    /// bucket's content even while it is in debt, never above capacity. Unknown or expired
    /// ids, ids drawn from another bucket, leases drawn from a window (they took nothing
    /// returnable) and returns to a windowed policy give back nothing.
    fn give_back(
        &self,
        item: &ReturnItem,
    ) -> impl Future<Output = Result<ReturnOutcome, StoreError>> + Send;

    /// Puts the store's server-side code in place, replacing any older revision of it (Redis:
    /// `FUNCTION LOAD REPLACE` on every primary). Called at start; a no-op in memory.
    fn prepare(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Reachable, with its functions loaded (loading them if they are missing).
    fn ready(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Keys held, per node (`(node, count)`), for the active-keys gauge.
    fn active_keys(&self) -> impl Future<Output = Result<Vec<(String, u64)>, StoreError>> + Send;

    /// Cumulative execution statistics of the decision code, per node (`(node, stats)`).
    fn exec_stats(
        &self,
    ) -> impl Future<Output = Result<Vec<(String, ExecStats)>, StoreError>> + Send;

    /// The node that owns `key` (a wire key), as a metrics label: an address, never a tenant.
    fn node_for(&self, key: &str) -> String;

    /// `memory`, `redis` or `redis-cluster`.
    fn kind(&self) -> &'static str;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(l: &Limits) -> BucketState {
        BucketState::full(l, 0)
    }

    #[test]
    fn bucket_ttl_exceeds_a_full_refill() {
        let l = Limits::new(100, 1_000, 20).unwrap();
        assert_eq!(l.full_refill_ms(), 200);
        assert_eq!(bucket_ttl_ms(&l, &full(&l), &[], 0), 1_200);
        let slow = Limits::new(1, 3_600_000, 100).unwrap();
        assert_eq!(
            bucket_ttl_ms(&slow, &full(&slow), &[], 0),
            360_000_000 + 36_000_000
        );
        let glacial = Limits::new(1, 365 * 24 * 3_600_000, 1_000).unwrap();
        assert_eq!(bucket_ttl_ms(&glacial, &full(&glacial), &[], 0), 0);
    }

    #[test]
    fn bucket_ttl_covers_debt_and_holdings() {
        // 50/s, burst 15: a full refill is 300 ms.
        let l = Limits::new(50, 1_000, 15).unwrap();
        let debt = BucketState {
            tokens: -35.0,
            updated_ms: 10_000,
        };
        // 50 tokens to refill at 0.05/ms: 1 s, plus the 1 s margin.
        assert_eq!(bucket_ttl_ms(&l, &debt, &[], 10_000), 2_000);
        let holding = |ends_ms| Holding {
            holder: "a".into(),
            share_per_ms: 0.01,
            ends_ms,
            demand_per_ms: 0.1,
        };
        // A holding ending 30 s out: 30 s plus 10 %.
        assert_eq!(bucket_ttl_ms(&l, &debt, &[holding(40_000)], 10_000), 33_000);
        // An ended holding does not count.
        assert_eq!(bucket_ttl_ms(&l, &debt, &[holding(9_000)], 10_000), 2_000);
        // Debt of a slow policy beyond ten years: no expiry.
        let slow = Limits::new(1, 3_600_000, 10).unwrap();
        let deep = BucketState {
            tokens: -1e6,
            updated_ms: 0,
        };
        assert_eq!(bucket_ttl_ms(&slow, &deep, &[], 0), 0);
    }

    #[test]
    fn transient_errors_are_the_recoverable_ones() {
        assert!(StoreError::Timeout(Duration::from_millis(50)).is_transient());
        assert!(StoreError::FunctionMissing("x".into()).is_transient());
        assert!(!StoreError::Protocol("x".into()).is_transient());
        assert!(!StoreError::Tls("x".into()).is_transient());
        assert!(!StoreError::Auth("x".into()).is_transient());
        assert_eq!(StoreError::Tls("x".into()).kind(), "tls");
        assert_eq!(StoreError::Auth("x".into()).kind(), "auth");
        assert_eq!(StoreError::Loading.kind(), "loading");
    }
}
