//! One Redis server (or a primary behind a stable address) as the store.
//!
//! All callers share one multiplexed connection (redis-rs `ConnectionManager`): concurrent
//! calls are pipelined on it, so throughput grows with concurrency without a pool, and the
//! manager reconnects in the background after the connection drops. Every decision is one
//! `FCALL` of the `tollgate_v4` library; when Redis answers that the function does not exist
//! (restarted without persistence, `FUNCTION FLUSH`), the library is loaded again and the call
//! retried once, so no decision is lost to it.
//!
//! Only a primary decides: every call is pipelined behind a `ROLE` (`store::role`), so a
//! limiter pointed at a replica — read-only or not — answers `UNAVAILABLE` and `/readyz` says
//! the node is a replica, instead of deciding on state that may be stale.
//!
//! The manager only reconnects when the connection reports an error. A connection that just
//! stops answering (a peer that vanished without a reset, a partition) reports nothing: every
//! call would time out forever. So the store watches for that (`store::watchdog`): when a
//! call has waited longer than [`RECONNECT_AFTER`] with no answer of any kind since, the
//! connection is replaced.
//!
//! TLS and ACL credentials come from [`RedisSecurity`]. When Redis refuses them (or we refuse
//! its certificate), retrying is pointless until someone fixes a file or an ACL: the store
//! holds calls back (`security::Refusals`: they fail at once with the reason), probes with one
//! connection per pause, and reconnects once a probe gets through.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisError, Value};

use super::role;
use super::script::{self, Reloader};
use super::security::{self, Attempt, RedisSecurity, Refusals};
use super::watchdog::{Watchdog, RECONNECT_AFTER};
use super::{
    CountItem, CountOutcome, ExecStats, LeaseItem, LeaseOutcome, ReturnItem, ReturnOutcome, Store,
    StoreError, StoreSettings,
};

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
    refusals: Arc<Refusals>,
    /// No `ROLE` has said `master` since the start or since the node was last seen a replica.
    role_unconfirmed: AtomicBool,
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
    /// A store for `url` (`redis://host:port[/db]`, or `rediss://` for TLS) with `security`'s
    /// credentials (its files are read now: a bad one is an error). Connects lazily: an
    /// unreachable server, or one that refuses the credentials, makes calls fail
    /// (`UNAVAILABLE`) and `/readyz` say why, but does not stop the limiter.
    pub fn new(
        url: &str,
        security: &RedisSecurity,
        settings: StoreSettings,
    ) -> Result<Self, StoreError> {
        let client = security.client(url)?;
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
            refusals: Arc::default(),
            role_unconfirmed: AtomicBool::new(true),
        })
    }

    /// Replaces the connection with a new (lazy) one; whether it was replaced.
    fn replace_connection(&self) -> bool {
        match ConnectionManager::new_lazy_with_config(self.client.clone(), connection_config()) {
            Ok(fresh) => {
                match self.conn.write() {
                    Ok(mut conn) => *conn = fresh,
                    Err(poisoned) => *poisoned.into_inner() = fresh,
                }
                true
            }
            Err(e) => {
                tracing::warn!(node = %self.address, error = %e, "cannot reconnect");
                false
            }
        }
    }

    /// The connection to use for the next call, replaced first if it has gone silent.
    fn connection(&self) -> ConnectionManager {
        if self.watchdog.call_starts(&self.address, RECONNECT_AFTER) {
            if self.replace_connection() {
                tracing::warn!(node = %self.address, after = ?RECONNECT_AFTER,
                    "no answer from Redis; replacing the connection");
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
        // A reply, even an error reply, proves the connection is alive (so does a refused
        // TLS handshake: the peer took part in it); transport errors are the manager's to
        // handle.
        if !matches!(&result, Err(e) if e.is_io_error() && security::credential_error(e).is_none())
        {
            self.watchdog.answered(&self.address);
        }
        result.and_then(Value::extract_error)
    }

    /// `cmd`'s reply, provided the node says it is a primary in the same round trip (`ROLE`
    /// pipelined right before it on the same connection); a replica's answer is never used,
    /// and once a node was seen a replica, calls send `ROLE` alone until it says `master`.
    async fn query_primary(&self, cmd: &Cmd) -> Result<Value, StoreError> {
        if self.role_unconfirmed.load(Ordering::Acquire) {
            // At start, and while the node was last seen a replica: `ROLE` alone, so a
            // replica (even a writable one) never runs the call at all.
            let role = self
                .query(&role::role_cmd())
                .await
                .map_err(|e| role::role_error(&self.address, &e))?;
            role::check_primary(&self.address, &role)?;
            self.role_unconfirmed.store(false, Ordering::Release);
        }
        let mut conn = self.connection();
        let mut pipe = redis::pipe();
        pipe.add_command(role::role_cmd())
            .add_command(cmd.clone())
            .ignore_errors();
        let result = pipe
            .query_async::<Vec<redis::RedisResult<Value>>>(&mut conn)
            .await;
        if !matches!(&result, Err(e) if e.is_io_error() && security::credential_error(e).is_none())
        {
            self.watchdog.answered(&self.address);
        }
        let mut replies = result.map_err(|e| script::map_error(&e))?.into_iter();
        let role = replies
            .next()
            .ok_or_else(|| StoreError::Protocol("no reply to ROLE".into()))?
            .and_then(Value::extract_error)
            .map_err(|e| role::role_error(&self.address, &e))?;
        if let Err(refused) = role::check_primary(&self.address, &role) {
            self.role_unconfirmed.store(true, Ordering::Release);
            return Err(refused);
        }
        replies
            .next()
            .ok_or_else(|| StoreError::Protocol("no reply after ROLE".into()))?
            .and_then(Value::extract_error)
            .map_err(|e| script::map_error(&e))
    }

    /// Runs one store operation unless Redis refuses the credentials (then it fails at once
    /// with that refusal); once a probe got through, on a new connection.
    async fn guarded<T>(
        &self,
        operation: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let retry = || probe(self.client.clone());
        if self.refusals.before_call(&self.address, retry)? == Attempt::Reconnect {
            self.replace_connection();
            self.watchdog.reset();
        }
        let result = operation.await;
        self.refusals
            .after_call(&self.address, result.as_ref().err());
        result
    }

    /// Loads (or replaces) the `tollgate_v4` library, on a primary only.
    async fn load_library(&self) -> Result<(), StoreError> {
        self.query_primary(&script::load_cmd()).await.map(|_| ())
    }

    /// Runs a function call on a primary; reloads the library and retries once if it is
    /// missing.
    async fn call(&self, cmd: &Cmd) -> Result<Value, StoreError> {
        let seen = self.reloader.generation();
        match self.query_primary(cmd).await {
            Err(StoreError::FunctionMissing(_)) => {
                tracing::warn!(node = %self.address, "tollgate functions missing; loading them");
                self.reloader.reload(seen, || self.load_library()).await?;
                self.query_primary(cmd).await
            }
            other => other,
        }
    }
}

/// Whether Redis takes the credentials now: one connection (TLS handshake, `AUTH`) and a
/// `PING`, without retries.
async fn probe(client: redis::Client) -> Result<(), StoreError> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(CONNECT_TIMEOUT));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(|e| script::map_error(&e))?;
    redis::cmd("PING")
        .query_async::<Value>(&mut conn)
        .await
        .and_then(Value::extract_error)
        .map(|_| ())
        .map_err(|e| script::map_error(&e))
}

impl Store for RedisStore {
    async fn lease(&self, items: &[LeaseItem]) -> Result<LeaseOutcome, StoreError> {
        let cmd = script::lease_cmd(items, &self.settings);
        let reply = self.guarded(self.call(&cmd)).await?;
        script::parse_lease_reply(&reply, items.len())
    }

    async fn count(&self, items: &[CountItem]) -> Result<CountOutcome, StoreError> {
        let cmd = script::count_cmd(items);
        let reply = self.guarded(self.call(&cmd)).await?;
        script::parse_count_reply(&reply, items.len())
    }

    async fn give_back(&self, item: &ReturnItem) -> Result<ReturnOutcome, StoreError> {
        let cmd = script::return_cmd(item);
        let reply = self.guarded(self.call(&cmd)).await?;
        script::parse_return_reply(&reply)
    }

    async fn prepare(&self) -> Result<(), StoreError> {
        self.guarded(self.load_library()).await
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let cmd = script::ping_cmd();
        let reply = self.guarded(self.call(&cmd)).await?;
        script::check_ping_reply(&reply)
    }

    async fn active_keys(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let cmd = redis::cmd("DBSIZE");
        let reply = self
            .guarded(async { self.query(&cmd).await.map_err(|e| script::map_error(&e)) })
            .await?;
        match reply {
            Value::Int(n) => Ok(vec![(self.address.clone(), u64::try_from(n).unwrap_or(0))]),
            other => Err(StoreError::Protocol(format!("DBSIZE: {other:?}"))),
        }
    }

    async fn exec_stats(&self) -> Result<Vec<(String, ExecStats)>, StoreError> {
        let cmd = script::commandstats_cmd();
        let reply = self
            .guarded(async { self.query(&cmd).await.map_err(|e| script::map_error(&e)) })
            .await?;
        Ok(vec![(
            self.address.clone(),
            script::parse_commandstats(&reply)?,
        )])
    }

    fn node_for(&self, _key: &str) -> String {
        self.address.clone()
    }

    fn kind(&self) -> &'static str {
        "redis"
    }
}
