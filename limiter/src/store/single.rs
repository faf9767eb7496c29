//! One Redis server (or a primary behind a stable address) as the store.
//!
//! All callers share one multiplexed connection (redis-rs `ConnectionManager`): concurrent
//! calls are pipelined on it, so throughput grows with concurrency without a pool, and the
//! manager reconnects in the background after the connection drops. Every decision is one
//! `FCALL` of the `tollgate_v1` library; when Redis answers that the function does not exist
//! (restarted without persistence, `FUNCTION FLUSH`), the library is loaded again and the call
//! retried once, so no decision is lost to it.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisError, Value};

use super::script::{self, Reloader};
use super::{LeaseItem, LeaseOutcome, ReturnItem, ReturnOutcome, Store, StoreError, StoreSettings};

/// How long one connection attempt may take (calls themselves are bounded by the service's
/// store timeout).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A single Redis server.
pub struct RedisStore {
    conn: ConnectionManager,
    address: String,
    settings: StoreSettings,
    reloader: Reloader,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("address", &self.address)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store for `url` (`redis://host:port[/db]`). Connects lazily: an unreachable server
    /// makes calls fail (`UNAVAILABLE`) and `/readyz` say so, but does not stop the limiter.
    pub fn new(url: &str, settings: StoreSettings) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Config(format!("redis URL `{url}`: {e}")))?;
        let address = client.get_connection_info().addr().to_string();
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(None)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(500))
            .set_number_of_retries(6);
        let conn = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|e| StoreError::Config(format!("redis `{address}`: {e}")))?;
        Ok(Self {
            conn,
            address,
            settings,
            reloader: Reloader::default(),
        })
    }

    /// `host:port` of the server.
    pub fn address(&self) -> &str {
        &self.address
    }

    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        let mut conn = self.conn.clone();
        cmd.query_async::<Value>(&mut conn)
            .await
            .and_then(Value::extract_error)
    }

    /// Loads (or replaces) the `tollgate_v1` library.
    pub async fn load_library(&self) -> Result<(), StoreError> {
        self.query(&script::load_cmd())
            .await
            .map(|_| ())
            .map_err(|e| script::map_error(&e))
    }

    /// Runs a function call; reloads the library and retries once if it is missing.
    async fn call(&self, cmd: &Cmd) -> Result<Value, StoreError> {
        let seen = self.reloader.generation();
        match self.query(cmd).await {
            Err(e) if script::is_function_missing(&e) => {
                tracing::warn!(node = %self.address, "tollgate functions missing; loading them");
                self.reloader.reload(seen, || self.load_library()).await?;
                self.query(cmd).await.map_err(|e| script::map_error(&e))
            }
            other => other.map_err(|e| script::map_error(&e)),
        }
    }
}

impl Store for RedisStore {
    async fn lease(&self, items: &[LeaseItem]) -> Result<LeaseOutcome, StoreError> {
        let reply = self.call(&script::lease_cmd(items, &self.settings)).await?;
        script::parse_lease_reply(&reply, items.len())
    }

    async fn give_back(&self, item: &ReturnItem) -> Result<ReturnOutcome, StoreError> {
        let reply = self.call(&script::return_cmd(item)).await?;
        script::parse_return_reply(&reply)
    }

    async fn prepare(&self) -> Result<(), StoreError> {
        self.load_library().await
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let reply = self.call(&script::ping_cmd()).await?;
        script::check_ping_reply(&reply)
    }

    async fn active_keys(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let reply = self
            .query(&redis::cmd("DBSIZE"))
            .await
            .map_err(|e| script::map_error(&e))?;
        match reply {
            Value::Int(n) => Ok(vec![(self.address.clone(), u64::try_from(n).unwrap_or(0))]),
            other => Err(StoreError::Protocol(format!("DBSIZE: {other:?}"))),
        }
    }

    fn node_for(&self, _key: &str) -> String {
        self.address.clone()
    }

    fn kind(&self) -> &'static str {
        "redis"
    }
}
