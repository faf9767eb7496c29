//! What the limiter sees of its traffic beyond counters: the busiest keys of each policy (hot
//! keys), how many distinct keys each policy has (active key cardinality), how full the
//! buckets it answers from are (remaining capacity), and how long the store's Function runs
//! apart from the network round trip.
//!
//! Everything is kept over a sliding minute (`minute`: six 10-second buckets) in memory fixed
//! by configuration, never by traffic: per policy, a Space-Saving summary of `4 × top`
//! counters (`top_k`) and a 4 KiB HyperLogLog sketch (`cardinality`) per bucket. Keys never
//! enter these structures, the logs or the metrics: only a keyed hash of them
//! ([`KeyHasher`]: SHA-256 over a salt and the key), shown as its first 12 hex digits.
//!
//! The service records each decided lease item ([`Observer::lease_decided`]); `GET
//! /v1/hot-keys` answers [`Observer::hot_keys_json`]; a background task logs keys that take
//! more than `--hot-key-share` of their node's calls ([`Observer::check_hot_keys`]) and
//! samples the store's execution statistics ([`sample_exec`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::metrics::Metrics;
use crate::store::{ExecStats, Grant, LeaseItem, Store};

mod cardinality;
mod minute;
mod top_k;

use cardinality::WindowedDistinct;
use minute::{Ring, WINDOW_S};
use top_k::{HotKey, Tally, WindowedTopK};

/// Counters per 10-second bucket for each key reported: Space-Saving keeps every key with
/// more than `1 / (4 × top)` of a bucket's calls.
const COUNTERS_PER_REPORTED_KEY: usize = 4;
/// Most keys `--hot-keys` may ask to report per policy.
pub const MAX_TOP: usize = 100;
/// Most hot-key warnings one check logs (each key at most once a minute).
const MAX_WARNINGS_PER_CHECK: usize = 10;
/// Most distinct node labels kept apart; beyond it calls count under [`OTHER_NODE`].
const MAX_NODES: usize = 1_024;
/// Node label of calls beyond [`MAX_NODES`].
const OTHER_NODE: &str = "(other)";

/// Hot-key reporting settings (`--hot-keys`, `--hot-key-share`, `--hot-key-min-calls`,
/// `--hot-key-salt-file`).
#[derive(Debug, Clone, PartialEq)]
pub struct HotKeySettings {
    /// Keys reported per policy (1 to `MAX_TOP`).
    pub top: usize,
    /// A key taking more than this share of its node's lease calls over the last minute is
    /// logged (`0 < share ≤ 1`).
    pub share: f64,
    /// ...once it has at least this many calls in the last minute (`≥ 1`).
    pub min_calls: u64,
    /// The salt of the key hash; `None`: a random one per process. With a shared salt every
    /// replica shows a key under the same hash, and whoever holds the salt can check which
    /// hash a given key has.
    pub salt_file: Option<PathBuf>,
}

// `share` is checked finite before use (`HotKeySettings::check`).
impl Eq for HotKeySettings {}

impl Default for HotKeySettings {
    /// Top 10 keys per policy; log a key above 20 % of its node's calls once it has 1,000
    /// calls a minute; a random salt.
    fn default() -> Self {
        Self {
            top: 10,
            share: 0.2,
            min_calls: 1_000,
            salt_file: None,
        }
    }
}

impl HotKeySettings {
    /// What is wrong with the settings, naming the flag.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_TOP).contains(&self.top) {
            return Err(format!(
                "--hot-keys must be between 1 and {MAX_TOP}, not {}",
                self.top
            ));
        }
        if !(self.share.is_finite() && self.share > 0.0 && self.share <= 1.0) {
            return Err(format!(
                "--hot-key-share must be a fraction above 0 and at most 1, not {}",
                self.share
            ));
        }
        if self.min_calls == 0 {
            return Err("--hot-key-min-calls must be at least 1".into());
        }
        Ok(())
    }

    /// The salt: the file's content without trailing line breaks (not empty), or random.
    pub fn load_salt(&self) -> Result<Vec<u8>, String> {
        let Some(path) = &self.salt_file else {
            return Ok(random_salt());
        };
        let mut salt = std::fs::read(path)
            .map_err(|e| format!("cannot read --hot-key-salt-file `{}`: {e}", path.display()))?;
        while salt.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            salt.pop();
        }
        if salt.is_empty() {
            return Err(format!("--hot-key-salt-file `{}` is empty", path.display()));
        }
        Ok(salt)
    }
}

/// 32 random bytes from the system's generator (or, if it fails, from the clock and the
/// process id: still unknown outside this process, if guessable).
fn random_salt() -> Vec<u8> {
    use ring::rand::SecureRandom;
    let mut salt = vec![0u8; 32];
    if ring::rand::SystemRandom::new().fill(&mut salt).is_err() {
        tracing::warn!("no system randomness for the hot-key salt; deriving it from the clock");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        salt = format!("{nanos}:{}", std::process::id()).into_bytes();
    }
    salt
}

/// The keyed hash under which keys are counted and shown: SHA-256 over the salt followed by
/// the key. Shown as the digest's first 12 hex digits; counted as its first 8 bytes.
#[derive(Clone)]
pub struct KeyHasher {
    salt: Arc<[u8]>,
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyHasher(<salt>)")
    }
}

impl KeyHasher {
    pub fn new(salt: &[u8]) -> Self {
        Self { salt: salt.into() }
    }

    /// The first 8 bytes of SHA-256(salt ‖ key), big-endian.
    pub fn hash(&self, key: &str) -> u64 {
        let mut context = ring::digest::Context::new(&ring::digest::SHA256);
        context.update(&self.salt);
        context.update(key.as_bytes());
        let digest = context.finish();
        let mut first = [0u8; 8];
        for (to, from) in first.iter_mut().zip(digest.as_ref()) {
            *to = *from;
        }
        u64::from_be_bytes(first)
    }

    /// How a hash is shown: the digest's first 12 hex digits.
    pub fn show(hash: u64) -> String {
        format!("{:012x}", hash >> 16)
    }
}

/// Everything kept for one policy.
#[derive(Debug)]
struct PolicyWindow {
    top: WindowedTopK,
    distinct: WindowedDistinct,
    totals: Ring<Tally>,
    /// Calls per node (indexed like [`Nodes`]).
    node_calls: Ring<Vec<u64>>,
}

impl PolicyWindow {
    fn new(counters: usize) -> Self {
        Self {
            top: WindowedTopK::new(counters),
            distinct: WindowedDistinct::default(),
            totals: Ring::new(Tally::default),
            node_calls: Ring::new(Vec::new),
        }
    }

    fn record(&mut self, now_s: u64, hash: u64, node: u16, asked: u64, granted: u64) {
        self.top.record(now_s, hash, node, asked, granted);
        self.distinct.insert(now_s, hash);
        self.totals
            .current(now_s, |t| *t = Tally::default())
            .add(&Tally {
                calls: 1,
                asked,
                granted,
            });
        let calls = self.node_calls.current(now_s, Vec::clear);
        let at = usize::from(node);
        if calls.len() <= at {
            calls.resize(at + 1, 0);
        }
        // Just resized to hold `at`.
        calls[at] = calls[at].saturating_add(1);
    }

    fn totals(&self, now_s: u64) -> Tally {
        let mut sum = Tally::default();
        for t in self.totals.live(now_s) {
            sum.add(t);
        }
        sum
    }

    /// Adds this policy's calls per node in the last minute to `into`.
    fn add_node_calls(&self, now_s: u64, into: &mut Vec<u64>) {
        for bucket in self.node_calls.live(now_s) {
            if into.len() < bucket.len() {
                into.resize(bucket.len(), 0);
            }
            for (sum, calls) in into.iter_mut().zip(bucket) {
                *sum = sum.saturating_add(*calls);
            }
        }
    }
}

/// Node labels, interned so counters hold a small index.
#[derive(Debug, Default)]
struct Nodes {
    names: RwLock<Vec<String>>,
}

impl Nodes {
    fn index(&self, node: &str) -> u16 {
        let known = |names: &[String]| names.iter().position(|n| n == node);
        let to_index = |i: usize| u16::try_from(i).unwrap_or(u16::MAX);
        if let Some(i) = known(&read(&self.names)) {
            return to_index(i);
        }
        let mut names = self.names.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = known(&names) {
            return to_index(i);
        }
        if names.len() >= MAX_NODES {
            if let Some(i) = names.iter().position(|n| n == OTHER_NODE) {
                return to_index(i);
            }
            names.push(OTHER_NODE.to_owned());
        } else {
            names.push(node.to_owned());
        }
        to_index(names.len() - 1)
    }

    fn name(&self, index: u16) -> String {
        read(&self.names)
            .get(usize::from(index))
            .cloned()
            .unwrap_or_else(|| OTHER_NODE.to_owned())
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A key above its share, as [`Observer::check_hot_keys`] found it.
#[derive(Debug, Clone, PartialEq)]
pub struct HotKeyAlert {
    pub policy: String,
    /// The shown hash.
    pub key: String,
    pub node: String,
    /// Calls of the key in the last minute it certainly had (Space-Saving's lower bound).
    pub calls: u64,
    /// Calls of its node in the last minute, all policies.
    pub node_calls: u64,
    pub share: f64,
}

struct Inner {
    settings: HotKeySettings,
    hasher: KeyHasher,
    metrics: Metrics,
    start: Instant,
    policies: RwLock<HashMap<String, Arc<Mutex<PolicyWindow>>>>,
    nodes: Nodes,
    /// `(policy, hash)` → second it was last logged.
    logged: Mutex<HashMap<(String, u64), u64>>,
    /// The store's last execution statistics per node.
    exec: Mutex<HashMap<String, ExecStats>>,
}

/// The limiter's traffic observer (cheap to clone: one shared state).
#[derive(Clone)]
pub struct Observer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observer")
            .field("settings", &self.inner.settings)
            .finish_non_exhaustive()
    }
}

impl Observer {
    /// An observer of `settings` (checked by the caller) hashing keys with `salt`,
    /// exporting through `metrics`.
    pub fn new(settings: HotKeySettings, salt: &[u8], metrics: Metrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                settings,
                hasher: KeyHasher::new(salt),
                metrics,
                start: Instant::now(),
                policies: RwLock::default(),
                nodes: Nodes::default(),
                logged: Mutex::default(),
                exec: Mutex::default(),
            }),
        }
    }

    /// The default settings with a random salt.
    pub fn with_defaults(metrics: Metrics) -> Self {
        Self::new(HotKeySettings::default(), &random_salt(), metrics)
    }

    fn now_s(&self) -> u64 {
        self.inner.start.elapsed().as_secs()
    }

    fn window(&self, policy: &str) -> Arc<Mutex<PolicyWindow>> {
        if let Some(w) = read(&self.inner.policies).get(policy) {
            return Arc::clone(w);
        }
        let counters = self.inner.settings.top * COUNTERS_PER_REPORTED_KEY;
        let mut policies = self
            .inner
            .policies
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(
            policies
                .entry(policy.to_owned())
                .or_insert_with(|| Arc::new(Mutex::new(PolicyWindow::new(counters)))),
        )
    }

    /// Records one lease item the store was asked to decide (on `node`): its answer, or
    /// `None` when the store gave none (the call still went to the node). A replay counts
    /// as a call but grants nothing and is not a fresh reading of the bucket.
    pub fn lease_decided(&self, item: &LeaseItem, grant: Option<&Grant>, node: &str) {
        self.lease_decided_at(self.now_s(), item, grant, node);
    }

    fn lease_decided_at(&self, now_s: u64, item: &LeaseItem, grant: Option<&Grant>, node: &str) {
        let fresh = grant.filter(|g| !g.replayed);
        if let Some(g) = fresh {
            let capacity = item.limits.capacity();
            let ratio = g.remaining / capacity;
            if capacity > 0.0 && ratio.is_finite() {
                self.inner
                    .metrics
                    .remaining_ratio(&item.policy, ratio.clamp(0.0, 1.0));
            }
        }
        let hash = self.inner.hasher.hash(&item.key);
        let node = self.inner.nodes.index(node);
        let granted = fresh.map_or(0, |g| g.granted);
        lock(&self.window(&item.policy)).record(now_s, hash, node, item.want, granted);
    }

    /// Calls per node in the last minute, all policies (indexed like `Nodes`).
    fn node_calls(&self, now_s: u64) -> Vec<u64> {
        let mut calls = Vec::new();
        for w in read(&self.inner.policies).values() {
            lock(w).add_node_calls(now_s, &mut calls);
        }
        calls
    }

    fn policy_windows(&self) -> Vec<(String, Arc<Mutex<PolicyWindow>>)> {
        let mut all: Vec<_> = read(&self.inner.policies)
            .iter()
            .map(|(name, w)| (name.clone(), Arc::clone(w)))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// `GET /v1/hot-keys`: per policy, its calls, distinct keys and busiest keys (hashed) of
    /// the last minute; per node, its calls.
    pub fn hot_keys_json(&self) -> serde_json::Value {
        self.hot_keys_json_at(self.now_s())
    }

    fn hot_keys_json_at(&self, now_s: u64) -> serde_json::Value {
        let node_calls = self.node_calls(now_s);
        let share_of = |hot: &HotKey| {
            let total = node_calls.get(usize::from(hot.node)).copied().unwrap_or(0);
            if total == 0 {
                0.0
            } else {
                hot.tally.calls.min(total) as f64 / total as f64
            }
        };
        let mut policies = Vec::new();
        for (name, window) in self.policy_windows() {
            let (totals, active, top) = {
                let w = lock(&window);
                (
                    w.totals(now_s),
                    w.distinct.estimate(now_s),
                    w.top.top(now_s, self.inner.settings.top),
                )
            };
            if totals.calls == 0 {
                continue;
            }
            let hot: Vec<_> = top
                .iter()
                .map(|h| {
                    json!({
                        "key": KeyHasher::show(h.key),
                        "node": self.inner.nodes.name(h.node),
                        "calls": h.tally.calls,
                        "calls_min": h.tally.calls.saturating_sub(h.over),
                        "calls_max": h.tally.calls.saturating_add(h.missed),
                        "units_asked": h.tally.asked,
                        "units_granted": h.tally.granted,
                        "share_of_node": share_of(h),
                    })
                })
                .collect();
            policies.push(json!({
                "policy": name,
                "calls": totals.calls,
                "units_asked": totals.asked,
                "units_granted": totals.granted,
                "active_keys": active,
                "hot_keys": hot,
            }));
        }
        let nodes: Vec<_> = node_calls
            .iter()
            .enumerate()
            .filter(|(_, calls)| **calls > 0)
            .map(|(i, calls)| {
                json!({
                    "node": self.inner.nodes.name(u16::try_from(i).unwrap_or(u16::MAX)),
                    "calls": calls,
                })
            })
            .collect();
        json!({
            "window_s": WINDOW_S,
            "key_hash": "first 12 hex digits of SHA-256(salt || key)",
            "policies": policies,
            "nodes": nodes,
        })
    }

    /// Sets `tollgate_limiter_active_keys{policy}` to each policy's distinct keys of the last
    /// minute (before each scrape).
    pub fn refresh_gauges(&self) {
        let now_s = self.now_s();
        let counts: Vec<(String, u64)> = self
            .policy_windows()
            .into_iter()
            .map(|(name, w)| {
                let active = lock(&w).distinct.estimate(now_s);
                (name, active)
            })
            .collect();
        self.inner.metrics.set_active_keys_by_policy(&counts);
    }

    /// Logs (warn) every key that certainly had at least `--hot-key-min-calls` calls in the
    /// last minute and more than `--hot-key-share` of its node's: each key at most once a
    /// minute, at most `MAX_WARNINGS_PER_CHECK` per check. Returns what it logged.
    pub fn check_hot_keys(&self) -> Vec<HotKeyAlert> {
        self.check_hot_keys_at(self.now_s())
    }

    fn check_hot_keys_at(&self, now_s: u64) -> Vec<HotKeyAlert> {
        let settings = &self.inner.settings;
        let node_calls = self.node_calls(now_s);
        let mut alerts = Vec::new();
        for (policy, window) in self.policy_windows() {
            let top = lock(&window).top.top(now_s, settings.top);
            for hot in top {
                let certain = hot.tally.calls.saturating_sub(hot.over);
                let total = node_calls.get(usize::from(hot.node)).copied().unwrap_or(0);
                if certain < settings.min_calls || total == 0 {
                    continue;
                }
                let share = certain as f64 / total as f64;
                if share <= settings.share {
                    continue;
                }
                alerts.push((
                    hot.key,
                    HotKeyAlert {
                        policy: policy.clone(),
                        key: KeyHasher::show(hot.key),
                        node: self.inner.nodes.name(hot.node),
                        calls: certain,
                        node_calls: total,
                        share,
                    },
                ));
            }
        }
        let mut logged = lock(&self.inner.logged);
        logged.retain(|_, at| now_s.saturating_sub(*at) < WINDOW_S);
        let mut out = Vec::new();
        for (hash, alert) in alerts {
            if out.len() >= MAX_WARNINGS_PER_CHECK {
                break;
            }
            let id = (alert.policy.clone(), hash);
            if logged.contains_key(&id) {
                continue;
            }
            logged.insert(id, now_s);
            tracing::warn!(policy = %alert.policy, key = %alert.key, node = %alert.node,
                calls = alert.calls, node_calls = alert.node_calls,
                share = format!("{:.3}", alert.share),
                "hot key: one key takes more than --hot-key-share of its node's lease calls \
                 over the last minute (key is a salted hash; see GET /v1/hot-keys)");
            out.push(alert);
        }
        out
    }

    /// Adds what each node's Function ran since the last sample to the execution counters.
    /// A node's first sample only sets its baseline (its series appear at 0); a node whose
    /// counts went down (restarted, `CONFIG RESETSTAT`) counts from zero again.
    pub fn record_exec(&self, samples: &[(String, ExecStats)]) {
        let mut last = lock(&self.inner.exec);
        for (node, now) in samples {
            let delta = match last.get(node) {
                None => ExecStats::default(),
                Some(before) if now.calls < before.calls || now.usec < before.usec => *now,
                Some(before) => ExecStats {
                    calls: now.calls - before.calls,
                    usec: now.usec - before.usec,
                },
            };
            self.inner.metrics.store_exec(node, delta.calls, delta.usec);
            last.insert(node.clone(), *now);
        }
    }
}

/// Samples the store's execution statistics into the observer, within `deadline`.
pub async fn sample_exec<S: Store>(store: &S, observer: &Observer, deadline: Duration) {
    match tokio::time::timeout(deadline, store.exec_stats()).await {
        Ok(Ok(samples)) => observer.record_exec(&samples),
        Ok(Err(e)) => tracing::debug!(error = %e, "cannot sample the store's execution statistics"),
        Err(_) => tracing::debug!("the store's execution statistics sample timed out"),
    }
}

#[cfg(test)]
mod tests;
