//! A Redis Cluster as the store: buckets spread over the primaries by hash tag.
//!
//! redis-rs' async cluster client owns routing: each `FCALL` goes to the primary owning its
//! keys' slot (all keys of a call share the tenant's hash tag, so one slot), `MOVED`/`ASK`
//! are followed and the slot map refreshed, and connections to every node are multiplexed.
//! Replicas are never read (no `read_from_replicas`): admission must see the authoritative
//! state. The function library is loaded on every primary at start and again on any primary
//! that reports it missing (a node that lost it), then the call is retried once.
//!
//! The store keeps its own slot → primary map (`CLUSTER SLOTS`, refreshed every few seconds
//! and after errors) so latency and errors can be labelled by node, the active-keys gauge can
//! ask each primary for `DBSIZE`, and silence can be watched per node.
//!
//! The client reconnects to a node when its connection reports an error, never when it just
//! stops answering (a vanished peer, a partition): its per-attempt response timeout is longer
//! than the service's store timeout, so callers give up first, and a timeout makes it retry
//! on the same connection anyway. So the store watches each primary (`store::watchdog`): when
//! a call to one has waited longer than [`RECONNECT_AFTER`] with no answer from it since, the
//! whole cluster connection is replaced (the client has no way to reconnect one node) — the
//! new one reconnects to every node and reads the slot map afresh; calls in flight on the old
//! one finish or time out as they would have.
//!
//! TLS and ACL credentials come from [`RedisSecurity`] and apply to every node, including the
//! ones discovered through `CLUSTER SLOTS` (a `tls-cluster` cluster reports its TLS ports
//! there). When the nodes refuse them, calls are held back (`security::Refusals`: they fail at
//! once with the reason), a probe tries one new cluster connection per pause, and the store
//! reconnects once a probe gets through; the slot map is not refreshed meanwhile.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo, SingleNodeRoutingInfo,
};
use redis::{Cmd, RedisError, Value};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::script::{self, Reloader};
use super::security::{redact_url, Attempt, RedisSecurity, Refusals};
use super::watchdog::{Watchdog, RECONNECT_AFTER};
use super::{
    CountItem, CountOutcome, ExecStats, LeaseItem, LeaseOutcome, ReturnItem, ReturnOutcome, Store,
    StoreError, StoreSettings,
};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Per-attempt response timeout inside the client (calls are bounded by the store timeout).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often the metrics slot map is refreshed when nothing asks for it.
const SLOT_MAP_REFRESH: Duration = Duration::from_secs(5);
/// Number of hash slots in a Redis Cluster.
pub const SLOTS: u16 = 16_384;

/// CRC16/XMODEM, the checksum Redis Cluster hashes keys with.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The slot of every Redis key of wire key `key`: its hash tag decides (see [`super::keys`]).
pub fn slot_of_key(key: &str) -> u16 {
    crc16(tollgate_core::key::hash_tag(key).as_bytes()) % SLOTS
}

/// `(first slot, last slot, primary address)` ranges.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct SlotMap(Vec<(u16, u16, String)>);

impl SlotMap {
    fn owner(&self, slot: u16) -> Option<&str> {
        self.0
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .map(|(_, _, addr)| addr.as_str())
    }

    fn primaries(&self) -> Vec<String> {
        let mut out: Vec<String> = self.0.iter().map(|(_, _, a)| a.clone()).collect();
        out.sort();
        out.dedup();
        out
    }

    /// Parses a `CLUSTER SLOTS` reply.
    fn parse(value: &Value) -> Result<Self, StoreError> {
        let bad = || StoreError::Protocol(format!("CLUSTER SLOTS: {value:?}"));
        let Value::Array(ranges) = value else {
            return Err(bad());
        };
        let mut map = Vec::with_capacity(ranges.len());
        for range in ranges {
            let Value::Array(fields) = range else {
                return Err(bad());
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(bad());
            };
            let host = match primary.first() {
                Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
                Some(Value::SimpleString(h)) => h.clone(),
                _ => return Err(bad()),
            };
            let Some(Value::Int(port)) = primary.get(1) else {
                return Err(bad());
            };
            let (Ok(start), Ok(end)) = (u16::try_from(*start), u16::try_from(*end)) else {
                return Err(bad());
            };
            map.push((start, end, format!("{host}:{port}")));
        }
        map.sort();
        Ok(Self(map))
    }
}

/// A Redis Cluster.
pub struct RedisClusterStore {
    client: ClusterClient,
    /// The connection every call clones; replaced by [`Self::connection`] after a silence.
    conn: Arc<RwLock<ClusterConnection>>,
    watchdog: Watchdog,
    settings: StoreSettings,
    reloader: Reloader,
    refusals: Arc<Refusals>,
    slots: Arc<RwLock<SlotMap>>,
    refresh: Arc<Notify>,
    refresher: JoinHandle<()>,
}

impl std::fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisClusterStore")
            .field("settings", &self.settings)
            .field("slots", &self.slot_map())
            .finish_non_exhaustive()
    }
}

impl Drop for RedisClusterStore {
    fn drop(&mut self) {
        self.refresher.abort();
    }
}

/// How the client words "no node could be connected to", which is all it says when every
/// node refused the connection (TLS, `AUTH`).
const NO_CONNECTION: &[&str] = &[
    "ClusterConnectionNotFound",
    "Failed to create initial connections",
];

/// Node label of calls whose node the slot map does not know (yet).
const UNKNOWN_NODE: &str = "unknown";

fn connection_config() -> ClusterConfig {
    ClusterConfig::new()
        .set_connection_timeout(CONNECT_TIMEOUT)
        .set_response_timeout(RESPONSE_TIMEOUT)
}

/// The current connection (a cheap clone of the handle).
fn current(conn: &RwLock<ClusterConnection>) -> ClusterConnection {
    match conn.read() {
        Ok(conn) => conn.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    }
}

impl RedisClusterStore {
    /// A store for the cluster reachable through any of `urls` (all `redis://` or all
    /// `rediss://`), with `security`'s credentials (its files are read now: a bad one is an
    /// error). Connects in the background (an unreachable cluster, or one that refuses the
    /// credentials, makes calls fail and `/readyz` say why). Needs a tokio runtime.
    pub fn new(
        urls: &[String],
        security: &RedisSecurity,
        settings: StoreSettings,
    ) -> Result<Self, StoreError> {
        if urls.is_empty() {
            return Err(StoreError::Config("no cluster node URL".into()));
        }
        let shown: Vec<String> = urls.iter().map(|u| redact_url(u)).collect();
        let builder: ClusterClientBuilder = security.cluster_builder(urls)?;
        let client = builder
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(200)
            .build()
            .map_err(|e| StoreError::Config(format!("redis cluster {shown:?}: {e}")))?;
        let conn = Arc::new(RwLock::new(
            client.get_pending_async_connection_with_config(connection_config()),
        ));
        let slots = Arc::new(RwLock::new(SlotMap::default()));
        let refresh = Arc::new(Notify::new());
        let refusals = Arc::new(Refusals::default());
        let refresher = tokio::spawn(refresh_slot_map(
            Arc::clone(&conn),
            Arc::clone(&slots),
            Arc::clone(&refresh),
            Arc::clone(&refusals),
        ));
        Ok(Self {
            client,
            conn,
            watchdog: Watchdog::default(),
            settings,
            reloader: Reloader::default(),
            refusals,
            slots,
            refresh,
            refresher,
        })
    }

    fn slot_map(&self) -> SlotMap {
        self.slots.read().map(|m| m.clone()).unwrap_or_default()
    }

    /// The primary serving `slot` as far as the metrics map knows.
    fn owner_of_slot(&self, slot: u16) -> Option<String> {
        self.slots
            .read()
            .ok()
            .and_then(|m| m.owner(slot).map(str::to_owned))
    }

    /// Refreshes the metrics slot map now and waits for it.
    pub async fn refresh_slot_map(&self) -> Result<(), StoreError> {
        let map = fetch_slot_map(&current(&self.conn)).await?;
        if let Ok(mut slots) = self.slots.write() {
            *slots = map;
        }
        Ok(())
    }

    /// The connection for a call to `nodes`, replaced first if one of them has gone silent.
    fn connection(&self, nodes: &[String]) -> ClusterConnection {
        let mut silent = None;
        for node in nodes {
            if self.watchdog.call_starts(node, RECONNECT_AFTER) {
                silent = Some(node);
            }
        }
        if let Some(node) = silent {
            tracing::warn!(%node, after = ?RECONNECT_AFTER,
                "no answer from a Redis Cluster node; replacing the cluster connection");
            self.replace_connection();
            for node in nodes {
                let _ = self.watchdog.call_starts(node, RECONNECT_AFTER);
            }
        }
        current(&self.conn)
    }

    /// Replaces the cluster connection with a new one (it reconnects to the start-up nodes
    /// and reads the slot map afresh).
    fn replace_connection(&self) {
        let fresh = self
            .client
            .get_pending_async_connection_with_config(connection_config());
        match self.conn.write() {
            Ok(mut conn) => *conn = fresh,
            Err(poisoned) => *poisoned.into_inner() = fresh,
        }
        self.watchdog.reset();
        self.refresh.notify_one();
    }

    /// Runs one store operation unless the nodes refuse the credentials (then it fails at once
    /// with that refusal); once a probe got through, on a new cluster connection.
    async fn guarded<T>(
        &self,
        node: &str,
        operation: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let retry = || probe(self.client.clone());
        if self.refusals.before_call(node, retry)? == Attempt::Reconnect {
            self.replace_connection();
        }
        let result = operation.await;
        if matches!(&result, Err(StoreError::Connection(e)) if NO_CONNECTION.iter().any(|m| e.contains(m)))
        {
            // The client hides why it has no connection at all: a refusal would otherwise go
            // unnamed, and be retried at every call.
            let diagnosis = || probe(self.client.clone());
            self.refusals.diagnose(node, diagnosis);
        }
        self.refusals.after_call(node, result.as_ref().err());
        result
    }

    /// The primary owning `key`'s slot, as the metrics map knows it.
    fn node_of(&self, key: &str) -> String {
        self.owner_of_slot(slot_of_key(key))
            .unwrap_or_else(|| UNKNOWN_NODE.to_owned())
    }

    /// Every primary the metrics map knows.
    fn primaries(&self) -> Vec<String> {
        let primaries = self.slot_map().primaries();
        if primaries.is_empty() {
            vec![UNKNOWN_NODE.to_owned()]
        } else {
            primaries
        }
    }

    /// A keyed call on `node`'s primary. A reply of any kind, even an error, shows the node
    /// answers; only a timeout does not.
    async fn query(&self, node: &str, cmd: &Cmd) -> Result<Value, RedisError> {
        let mut conn = self.connection(std::slice::from_ref(&node.to_owned()));
        let result = cmd.query_async::<Value>(&mut conn).await;
        if !matches!(&result, Err(e) if e.is_timeout()) {
            self.watchdog.answered(node);
        }
        result.and_then(Value::extract_error)
    }

    /// A call on every primary. Only a full answer vouches for every primary (an early error
    /// from one says nothing about the others).
    async fn on_every_primary(&self, cmd: Cmd) -> Result<Value, RedisError> {
        let primaries = self.primaries();
        let mut conn = self.connection(&primaries);
        let result = conn
            .route_command(
                cmd,
                RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                )),
            )
            .await;
        if result.is_ok() {
            for node in &primaries {
                self.watchdog.answered(node);
            }
        }
        result.and_then(Value::extract_error)
    }

    /// Loads (or replaces) the `tollgate_v4` library on every primary.
    async fn load_library(&self) -> Result<(), StoreError> {
        self.on_every_primary(script::load_cmd())
            .await
            .map(|_| ())
            .map_err(|e| script::map_error(&e))
    }

    /// Runs a function call on the primary owning `key`; reloads the library and retries
    /// once if a node lacks it.
    async fn call(&self, key: &str, cmd: &Cmd) -> Result<Value, StoreError> {
        let node = self.node_of(key);
        let seen = self.reloader.generation();
        let result = match self.query(&node, cmd).await {
            Err(e) if script::is_function_missing(&e) => {
                tracing::warn!("tollgate functions missing on a cluster node; loading them");
                self.reloader.reload(seen, || self.load_library()).await?;
                self.query(&node, cmd)
                    .await
                    .map_err(|e| script::map_error(&e))
            }
            other => other.map_err(|e| script::map_error(&e)),
        };
        if result.is_err() {
            // The topology may have changed: relabel metrics soon.
            self.refresh.notify_one();
        }
        result
    }
}

/// Whether the cluster takes the credentials now: a new cluster connection (to the start-up
/// nodes) and `CLUSTER SLOTS`.
async fn probe(client: ClusterClient) -> Result<(), StoreError> {
    let conn = client
        .get_async_connection_with_config(connection_config())
        .await
        .map_err(|e| script::map_error(&e))?;
    fetch_slot_map(&conn).await.map(|_| ())
}

async fn fetch_slot_map(conn: &ClusterConnection) -> Result<SlotMap, StoreError> {
    let mut conn = conn.clone();
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg("SLOTS");
    let reply = conn
        .route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random))
        .await
        .and_then(Value::extract_error)
        .map_err(|e| script::map_error(&e))?;
    SlotMap::parse(&reply)
}

/// Keeps the slot map fresh: every [`SLOT_MAP_REFRESH`], and when notified (always on the
/// current connection). While the nodes refuse the credentials it stays off them: the probes
/// (`security::Refusals`), one per pause, find out when that ends.
async fn refresh_slot_map(
    conn: Arc<RwLock<ClusterConnection>>,
    slots: Arc<RwLock<SlotMap>>,
    notify: Arc<Notify>,
    refusals: Arc<Refusals>,
) {
    loop {
        if refusals.holding_back() {
            let _ = tokio::time::timeout(SLOT_MAP_REFRESH, notify.notified()).await;
            continue;
        }
        match tokio::time::timeout(RESPONSE_TIMEOUT, fetch_slot_map(&current(&conn))).await {
            Ok(Ok(map)) => {
                if let Ok(mut current) = slots.write() {
                    if *current != map {
                        tracing::info!(primaries = ?map.primaries(), "cluster slot map changed");
                        *current = map;
                    }
                }
            }
            Ok(Err(e @ (StoreError::Tls(_) | StoreError::Auth(_)))) => {
                refusals.after_call(UNKNOWN_NODE, Some(&e));
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "cannot refresh the cluster slot map"),
            Err(_) => tracing::debug!("cluster slot map refresh timed out"),
        }
        // At most one refresh per 100ms however many errors ask for one.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = tokio::time::timeout(SLOT_MAP_REFRESH, notify.notified()).await;
    }
}

impl Store for RedisClusterStore {
    async fn lease(&self, items: &[LeaseItem]) -> Result<LeaseOutcome, StoreError> {
        let key = items
            .first()
            .map(|item| item.key.as_str())
            .unwrap_or_default();
        let cmd = script::lease_cmd(items, &self.settings);
        let reply = self
            .guarded(&self.node_of(key), self.call(key, &cmd))
            .await?;
        script::parse_lease_reply(&reply, items.len())
    }

    async fn count(&self, items: &[CountItem]) -> Result<CountOutcome, StoreError> {
        let key = items
            .first()
            .map(|item| item.key.as_str())
            .unwrap_or_default();
        let cmd = script::count_cmd(items);
        let reply = self
            .guarded(&self.node_of(key), self.call(key, &cmd))
            .await?;
        script::parse_count_reply(&reply, items.len())
    }

    async fn give_back(&self, item: &ReturnItem) -> Result<ReturnOutcome, StoreError> {
        let cmd = script::return_cmd(item);
        let reply = self
            .guarded(&self.node_of(&item.key), self.call(&item.key, &cmd))
            .await?;
        script::parse_return_reply(&reply)
    }

    async fn prepare(&self) -> Result<(), StoreError> {
        self.guarded("primaries", self.load_library()).await
    }

    async fn ready(&self) -> Result<(), StoreError> {
        let reply = self
            .guarded("primaries", async {
                let seen = self.reloader.generation();
                match self.on_every_primary(script::ping_cmd()).await {
                    Err(e) if script::is_function_missing(&e) => {
                        self.reloader.reload(seen, || self.load_library()).await?;
                        self.on_every_primary(script::ping_cmd())
                            .await
                            .map_err(|e| script::map_error(&e))
                    }
                    other => other.map_err(|e| script::map_error(&e)),
                }
            })
            .await?;
        script::check_ping_reply(&reply)
    }

    async fn active_keys(&self) -> Result<Vec<(String, u64)>, StoreError> {
        self.guarded("primaries", self.dbsize_per_primary()).await
    }

    async fn exec_stats(&self) -> Result<Vec<(String, ExecStats)>, StoreError> {
        let replies = self
            .guarded("primaries", self.on_each_primary(script::commandstats_cmd))
            .await?;
        replies
            .into_iter()
            .map(|(node, reply)| Ok((node, script::parse_commandstats(&reply)?)))
            .collect()
    }

    fn node_for(&self, key: &str) -> String {
        self.node_of(key)
    }

    fn kind(&self) -> &'static str {
        "redis-cluster"
    }
}

impl RedisClusterStore {
    /// `DBSIZE` of every primary the slot map knows.
    async fn dbsize_per_primary(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let replies = self.on_each_primary(|| redis::cmd("DBSIZE")).await?;
        Ok(replies
            .into_iter()
            .filter_map(|(address, reply)| match reply {
                Value::Int(n) => Some((address, u64::try_from(n).unwrap_or(0))),
                _ => None,
            })
            .collect())
    }

    /// `cmd()` on every primary the slot map knows, one after the other: `(address, reply)`.
    async fn on_each_primary(&self, cmd: fn() -> Cmd) -> Result<Vec<(String, Value)>, StoreError> {
        let mut out = Vec::new();
        for address in self.slot_map().primaries() {
            let Some((host, port)) = address.rsplit_once(':') else {
                continue;
            };
            let Ok(port) = port.parse::<u16>() else {
                continue;
            };
            let mut conn = current(&self.conn);
            let reply = conn
                .route_command(
                    cmd(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                        host: host.to_owned(),
                        port,
                    }),
                )
                .await
                .and_then(Value::extract_error)
                .map_err(|e| script::map_error(&e))?;
            out.push((address, reply));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_redis() {
        // Reference values from the Redis Cluster specification.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(crc16(b"foo") % SLOTS, 12182);
        assert_eq!(slot_of_key("foo:bar"), crc16(b"foo") % SLOTS);
    }

    #[test]
    fn parses_cluster_slots() {
        let node = |port: i64| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let v = Value::Array(vec![
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                node(7001),
                node(7004),
            ]),
            Value::Array(vec![Value::Int(0), Value::Int(5460), node(7000)]),
        ]);
        let map = SlotMap::parse(&v).unwrap();
        assert_eq!(map.owner(0), Some("127.0.0.1:7000"));
        assert_eq!(map.owner(16383), Some("127.0.0.1:7001"));
        assert_eq!(map.primaries(), ["127.0.0.1:7000", "127.0.0.1:7001"]);
        assert!(SlotMap::parse(&Value::Nil).is_err());
    }
}
