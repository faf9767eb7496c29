//! The store chosen at start-up (`--redis`, `--redis-cluster`, or neither), as one type the
//! server can hold without generics or boxing.

use super::{
    CountItem, CountOutcome, ExecStats, LeaseItem, LeaseOutcome, MemoryStore, RedisClusterStore,
    RedisStore, ReturnItem, ReturnOutcome, Store, StoreError,
};

/// One of the three stores.
#[derive(Debug)]
pub enum AnyStore {
    Memory(MemoryStore),
    Redis(RedisStore),
    Cluster(RedisClusterStore),
}

impl Store for AnyStore {
    async fn lease(&self, items: &[LeaseItem]) -> Result<LeaseOutcome, StoreError> {
        match self {
            AnyStore::Memory(s) => s.lease(items).await,
            AnyStore::Redis(s) => s.lease(items).await,
            AnyStore::Cluster(s) => s.lease(items).await,
        }
    }

    async fn count(&self, items: &[CountItem]) -> Result<CountOutcome, StoreError> {
        match self {
            AnyStore::Memory(s) => s.count(items).await,
            AnyStore::Redis(s) => s.count(items).await,
            AnyStore::Cluster(s) => s.count(items).await,
        }
    }

    async fn give_back(&self, item: &ReturnItem) -> Result<ReturnOutcome, StoreError> {
        match self {
            AnyStore::Memory(s) => s.give_back(item).await,
            AnyStore::Redis(s) => s.give_back(item).await,
            AnyStore::Cluster(s) => s.give_back(item).await,
        }
    }

    async fn prepare(&self) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.prepare().await,
            AnyStore::Redis(s) => s.prepare().await,
            AnyStore::Cluster(s) => s.prepare().await,
        }
    }

    async fn ready(&self) -> Result<(), StoreError> {
        match self {
            AnyStore::Memory(s) => s.ready().await,
            AnyStore::Redis(s) => s.ready().await,
            AnyStore::Cluster(s) => s.ready().await,
        }
    }

    async fn active_keys(&self) -> Result<Vec<(String, u64)>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.active_keys().await,
            AnyStore::Redis(s) => s.active_keys().await,
            AnyStore::Cluster(s) => s.active_keys().await,
        }
    }

    async fn exec_stats(&self) -> Result<Vec<(String, ExecStats)>, StoreError> {
        match self {
            AnyStore::Memory(s) => s.exec_stats().await,
            AnyStore::Redis(s) => s.exec_stats().await,
            AnyStore::Cluster(s) => s.exec_stats().await,
        }
    }

    fn node_for(&self, key: &str) -> String {
        match self {
            AnyStore::Memory(s) => s.node_for(key),
            AnyStore::Redis(s) => s.node_for(key),
            AnyStore::Cluster(s) => s.node_for(key),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            AnyStore::Memory(s) => s.kind(),
            AnyStore::Redis(s) => s.kind(),
            AnyStore::Cluster(s) => s.kind(),
        }
    }
}
