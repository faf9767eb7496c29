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

use std::future::Future;
use std::time::Duration;

use tollgate_core::bucket::Limits;
use tollgate_core::key;

pub mod cluster;
pub mod memory;
pub mod single;

mod any;
pub(crate) mod script;

pub use any::AnyStore;
pub use cluster::RedisClusterStore;
pub use memory::MemoryStore;
pub use single::RedisStore;

/// How much longer than a full refill a bucket's state is kept after its last write: state
/// idle that long describes a full bucket, so dropping it and recreating it full is exact.
/// The slack covers clock differences between the writer and the expiring node.
pub const BUCKET_TTL_MARGIN_MS: u64 = 1_000;
/// Buckets whose full refill takes longer than this (ten years) never expire: an expiry would
/// have to be that far out anyway, and some stores cap expiry times.
pub const MAX_BUCKET_TTL_MS: u64 = 10 * 365 * 24 * 3_600 * 1_000;

/// TTL of a bucket's state after a write, in ms; `0` means "no expiry".
pub fn bucket_ttl_ms(limits: &Limits) -> u64 {
    let full = limits.full_refill_ms();
    let ttl = full.saturating_add(BUCKET_TTL_MARGIN_MS.max(full / 10));
    if ttl > MAX_BUCKET_TTL_MS {
        0
    } else {
        ttl
    }
}

/// Settings every store shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreSettings {
    /// How long a lease id's record (its grant and how much was returned) is kept.
    pub dedup_ttl_ms: u64,
}

/// One validated lease request, with its policy's limits resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseItem {
    pub id: String,
    pub policy: String,
    /// A key that passed [`key::validate_key`].
    pub key: String,
    pub limits: Limits,
    /// `1 ≤ min ≤ capacity`.
    pub min: u64,
    /// `min ≤ want ≤ capacity`.
    pub want: u64,
}

impl LeaseItem {
    pub fn bucket_key(&self) -> String {
        key::redis_bucket_key(&self.policy, &self.key)
    }

    pub fn lease_key(&self) -> String {
        key::redis_lease_key(&self.key, &self.id)
    }
}

/// One validated return of unused lease tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct ReturnItem {
    pub id: String,
    pub policy: String,
    pub key: String,
    pub limits: Limits,
    pub unused: u64,
}

impl ReturnItem {
    pub fn bucket_key(&self) -> String {
        key::redis_bucket_key(&self.policy, &self.key)
    }

    pub fn lease_key(&self) -> String {
        key::redis_lease_key(&self.key, &self.id)
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
            | StoreError::FunctionMissing(_) => true,
            StoreError::Server(_) | StoreError::Protocol(_) | StoreError::Config(_) => false,
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
        }
    }
}

/// Where global buckets live. Every implementation has the same semantics, checked by one
/// contract suite (`tests/contract.rs`).
pub trait Store: Send + Sync + 'static {
    /// Decides one unit atomically: every item of `items` (1 or more, all keys sharing one
    /// hash tag) is granted at least its `min`, or none takes anything. Items whose lease id
    /// was decided before answer from their record and take nothing.
    fn lease(
        &self,
        items: &[LeaseItem],
    ) -> impl Future<Output = Result<LeaseOutcome, StoreError>> + Send;

    /// Gives back `min(unused, granted − returned so far)` of lease `item.id`, never above the
    /// bucket's capacity. Unknown or expired ids, and ids drawn from another bucket, give back
    /// nothing.
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

    /// The node that owns `key` (a wire key), as a metrics label: an address, never a tenant.
    fn node_for(&self, key: &str) -> String;

    /// `memory`, `redis` or `redis-cluster`.
    fn kind(&self) -> &'static str;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_ttl_exceeds_a_full_refill() {
        let l = Limits::new(100, 1_000, 20).unwrap();
        assert_eq!(l.full_refill_ms(), 200);
        assert_eq!(bucket_ttl_ms(&l), 1_200);
        let slow = Limits::new(1, 3_600_000, 100).unwrap();
        assert_eq!(bucket_ttl_ms(&slow), 360_000_000 + 36_000_000);
        let glacial = Limits::new(1, 365 * 24 * 3_600_000, 1_000).unwrap();
        assert_eq!(bucket_ttl_ms(&glacial), 0);
    }

    #[test]
    fn transient_errors_are_the_recoverable_ones() {
        assert!(StoreError::Timeout(Duration::from_millis(50)).is_transient());
        assert!(StoreError::FunctionMissing("x".into()).is_transient());
        assert!(!StoreError::Protocol("x".into()).is_transient());
        assert_eq!(StoreError::Loading.kind(), "loading");
    }
}
