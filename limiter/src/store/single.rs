//! One Redis server (or a primary behind a stable address) as the store.
//!
//! All callers share one multiplexed connection (redis-rs `ConnectionManager`): concurrent
//! calls are pipelined on it, so throughput grows with concurrency without a pool, and the
//! manager reconnects in the background after the connection drops. Every decision is one
//! `FCALL` of the `tollgate_v2` library; when Redis answers that the function does not exist
//! (restarted without persistence, `FUNCTION FLUSH`), the library is loaded again and the call
//! retried once, so no decision is lost to it.
//!
//! The manager only reconnects when the connection reports an error. A connection that just
//! stops answering (a peer that vanished without a reset, a partition) reports nothing: every
//! call would time out forever. So the store watches for that (`store::watchdog`): when a
//! call has waited longer than [`RECONNECT_AFTER`] with no answer of any kind since, the
//! connection is replaced.

use std::sync::RwLock;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisError, Value};

use super::script::{self, Reloader};
use super::watchdog::{Watchdog, RECONNECT_AFTER};
use super::{LeaseItem, LeaseOutcome, ReturnItem, ReturnOutcome, Store, StoreError, StoreSettings};

/// How long one connection attempt may take (calls themselves are bounded by the service's
/// store timeout).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A single Redis server.
pub struct RedisStore {
    client: redis::Client,
    conn: RwLock<ConnectionManager>,
    watchdog: Watchdog,
    address: String,
    settings: StoreSettings,
    reloader: Reloader,
}

fn connection_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(None)
        .set_min_delay(Duration::from_millis(20))
        .set_max_delay(Duration::from_millis(500))
        .set_number_of_retries(6)
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
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), connection_config())
            .map_err(|e| StoreError::Config(format!("redis `{address}`: {e}")))?;
        Ok(Self {
            client,
            conn: RwLock::new(conn),
            watchdog: Watchdog::default(),
            address,
            settings,
            reloader: Reloader::default(),
        })
    }

    /// The connection to use for the next call, replaced first if it has gone silent.
    fn connection(&self) -> ConnectionManager {
        if self.watchdog.call_starts(&self.address, RECONNECT_AFTER) {
            match ConnectionManager::new_lazy_with_config(self.client.clone(), connection_config())
            {
                Ok(fresh) => {
                    tracing::warn!(node = %self.address, after = ?RECONNECT_AFTER,
                        "no answer from Redis; replacing the connection");
                    match self.conn.write() {
                        Ok(mut conn) => *conn = fresh,
                        Err(poisoned) => *poisoned.into_inner() = fresh,
                    }
                }
                Err(e) => tracing::warn!(node = %self.address, error = %e, "cannot reconnect"),
            }
            self.watchdog.reset();
        }
        match self.conn.read() {
            Ok(conn) => conn.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    async fn query(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        let mut conn = self.connection();
        let result = cmd.query_async::<Value>(&mut conn).await;
        // A reply, even an error reply, proves the connection is alive; transport errors
        // are the manager's to handle.
        if !matches!(&result, Err(e) if e.is_io_error()) {
            self.watchdog.answered(&self.address);
        }
        result.and_then(Value::extract_error)
    }

    /// Loads (or replaces) the `tollgate_v2` library.
    async fn load_library(&self) -> Result<(), StoreError> {
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
