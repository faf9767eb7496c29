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

pub mod ledger;
pub mod metrics;
mod parent;

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
use ledger::{Answer, Received, Reservoir, Terms};
pub use metrics::RegionMetrics;
use parent::{Parent, ParentGrant};
pub use parent::{ParentError, ParentTls};

/// Lease ids of the region's instances remembered per reservoir.
pub const RECORDS_PER_KEY: usize = 64;

/// How often reservoirs are swept (expiry, returns, background asks during a partition,
/// idle reservoirs, gauges). Renewals at a drip's end have their own timer, and an ask that
/// leaves a reservoir low starts its refill at once.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// After a failed parent call, instances finding a reservoir dry are answered UNAVAILABLE at
/// once for this long (instead of each waiting for the parent's deadline); background asks
/// try again after it.
const PARENT_BACKOFF_MS: u64 = 250;

/// Leases this close to their expiry go back to the parent with what they have left.
const RETURN_MARGIN_MS: u64 = 200;

/// When the reservoir is dry and the parent's answers went to others in the region: how soon
/// to ask again.
const RETRY_DRY_MS: u64 = 20;

/// A reservoir nobody asked for this long, holding nothing, is forgotten.
const IDLE_MS: u64 = 10_000;

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

    fn in_backoff(state: &State, now_ms: u64) -> bool {
        state.parent.down_since_ms.is_some()
            && now_ms.saturating_sub(state.parent.last_failure_ms) < PARENT_BACKOFF_MS
    }

    /// Starts a background ask of the parent for `id` if the reservoir wants one and none is
    /// in flight. Returns whether one is in flight now.
    fn start_fetch(self: &Arc<Self>, state: &mut State, id: &KeyId, now_ms: u64) -> bool {
        let capacity = self.capacity(&id.0, &id.1);
        let Some(entry) = state.reservoirs.get_mut(id) else {
            return false;
        };
        if entry.fetching {
            return true;
        }
        if entry
            .refused
            .as_ref()
            .is_some_and(|(until, _)| *until > now_ms)
        {
            return false;
        }
        let Some(ask) = entry.reservoir.parent_ask(now_ms, capacity) else {
            return false;
        };
        entry.fetching = true;
        let shared = Arc::clone(self);
        let id = id.clone();
        tokio::spawn(async move {
            let lease_id = shared.parent.new_id();
            let sent = shared.clock.now_ms();
            let amounts = (ask.min, ask.want, ask.demand_per_ms * 1_000.0);
            let result = shared.parent.lease(&lease_id, &id.0, &id.1, amounts).await;
            let now = shared.clock.now_ms();
            shared
                .metrics
                .parent_call("lease", outcome(&result), now - sent);
            shared.received(&id, &lease_id, result, sent, now);
        });
        true
    }

    /// Takes in a parent answer (or its failure) and wakes the instances waiting for it; with
    /// a share, the renewal is scheduled for when the share stops dripping.
    fn received(
        self: &Arc<Self>,
        id: &KeyId,
        lease_id: &str,
        result: Result<ParentGrant, ParentError>,
        sent_ms: u64,
        now_ms: u64,
    ) {
        let mut state = self.lock();
        match &result {
            Ok(_) => {
                if let Some(since) = state.parent.down_since_ms.take() {
                    tracing::info!(
                        partition_ms = now_ms - since,
                        "parent limiter reachable again"
                    );
                }
            }
            Err(ParentError::Unreachable(reason)) => {
                if state.parent.down_since_ms.is_none() {
                    tracing::warn!(error = %reason, "parent limiter unreachable");
                    state.parent.down_since_ms = Some(now_ms);
                }
                state.parent.last_failure_ms = now_ms;
                state.parent.last_error = reason.clone();
            }
            Err(ParentError::Refused(_)) => {}
        }
        let Some(entry) = state.reservoirs.get_mut(id) else {
            return;
        };
        entry.fetching = false;
        match result {
            Ok(g) => {
                let got = Received {
                    granted: g.granted,
                    expires_ms: g.expires_ms,
                    share_per_ms: g.share_per_s / 1_000.0,
                    period_ms: g.period_ms,
                    retry_after_ms: g.retry_after_ms,
                };
                entry
                    .reservoir
                    .receive(lease_id, &got, sent_ms, now_ms, self.terms);
                entry.refused = None;
                if let Some(ends) = entry.reservoir.drip_ends_ms() {
                    self.renew_at(id.clone(), ends.saturating_sub(now_ms));
                }
                self.metrics.regional_tokens(&id.0, "received", g.granted);
                let drip = (got.share_per_ms * got.period_ms as f64).floor();
                if drip >= 1.0 {
                    self.metrics.regional_tokens(&id.0, "assigned", drip as u64);
                }
            }
            Err(ParentError::Refused(reason)) => {
                tracing::warn!(policy = %id.0, error = %reason, "parent limiter refused an ask");
                entry.refused = Some((now_ms + 1_000, reason));
            }
            Err(ParentError::Unreachable(_)) => {}
        }
        entry.done.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Asks the parent for `id` again in `after_ms`, when its share stops dripping: the sweep
    /// would find it up to a sweep later, and its instances' sub-shares end then.
    fn renew_at(self: &Arc<Self>, id: KeyId, after_ms: u64) {
        let shared = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(after_ms)).await;
            let now = shared.clock.now_ms();
            let mut state = shared.lock();
            if !Self::in_backoff(&state, now) {
                shared.start_fetch(&mut state, &id, now);
            }
        });
    }

    /// Expiry, returns to the parent, background asks, idle reservoirs, gauges.
    fn sweep(self: &Arc<Self>) {
        let now = self.clock.now_ms();
        let mut returns = Vec::new();
        let mut held: HashMap<String, u64> = HashMap::new();
        {
            let mut state = self.lock();
            let backoff = Self::in_backoff(&state, now);
            let policies = self.policies.current();
            let (terms, metrics) = (self.terms, &self.metrics);
            let mut asks = Vec::new();
            // One pass, in place: no key is copied unless something is sent for it.
            state.reservoirs.retain(|id, entry| {
                let expired = entry.reservoir.expire(now, terms);
                metrics.regional_tokens(&id.0, "expired", expired.tokens);
                entry.records.retain(|r| r.until_ms > now);
                for (lease_id, tokens) in entry.reservoir.take_expiring(now, RETURN_MARGIN_MS) {
                    returns.push((id.clone(), lease_id, tokens));
                }
                let holds = entry.reservoir.held(now);
                match held.get_mut(&id.0) {
                    Some(sum) => *sum += holds,
                    None => {
                        held.insert(id.0.clone(), holds);
                    }
                }
                if entry.reservoir.idle(now, IDLE_MS) && !entry.fetching && entry.records.is_empty()
                {
                    return false;
                }
                let capacity = policies.get(&id.0).map_or(1, |p| p.rated(&id.1).burst);
                if !backoff
                    && !entry.fetching
                    && entry.reservoir.parent_ask(now, capacity).is_some()
                {
                    asks.push(id.clone());
                }
                true
            });
            for id in asks {
                self.start_fetch(&mut state, &id, now);
            }
            let partition_s = state
                .parent
                .down_since_ms
                .map_or(0.0, |since| now.saturating_sub(since) as f64 / 1_000.0);
            self.metrics
                .set_parent_reachable(state.parent.down_since_ms.is_none(), partition_s);
            self.metrics.set_regional_keys(state.reservoirs.len());
        }
        self.metrics.set_regional_held(&held);
        for (id, lease_id, tokens) in returns {
            self.return_to_parent(id, lease_id, tokens);
        }
    }

    /// One instance's lease of a global policy: decided from the reservoir, waiting for the
    /// parent (at most its deadline) only when the reservoir is dry.
    async fn lease(self: &Arc<Self>, item: &LeaseItem) -> Result<Grant, StoreError> {
        let id: KeyId = (item.policy.clone(), item.key.clone());
        let ask = ledger::Ask {
            min: item.min,
            want: item.want,
            holder: item.holder.as_deref(),
            demand_per_ms: item.demand_per_ms,
        };
        let deadline = tokio::time::Instant::now() + self.parent.timeout();
        loop {
            let mut done = match self.decide(&id, item, ask)? {
                Decision::Decided(grant) => return Ok(grant),
                Decision::Wait(done) => done,
            };
            if tokio::time::timeout_at(deadline, done.changed())
                .await
                .is_err()
            {
                // The parent answered in time but others in the region took what it gave:
                // ask again soon (the next background ask is on its way).
                return if self.lock().parent.down_since_ms.is_none() {
                    Ok(denial(RETRY_DRY_MS))
                } else {
                    Err(StoreError::Parent(format!(
                        "no answer from the parent limiter within {:?}",
                        self.parent.timeout()
                    )))
                };
            }
        }
    }

    /// One attempt at deciding an instance's ask under the lock.
    fn decide(
        self: &Arc<Self>,
        id: &KeyId,
        item: &LeaseItem,
        ask: ledger::Ask<'_>,
    ) -> Result<Decision, StoreError> {
        let now = self.clock.now_ms();
        let mut state = self.lock();
        if !state.reservoirs.contains_key(id) {
            if state.reservoirs.len() >= self.max_keys {
                return Err(StoreError::Config(format!(
                    "the regional ledger holds --regional-keys ({}) keys",
                    self.max_keys
                )));
            }
            state.reservoirs.insert(id.clone(), Entry::new());
        }
        let backoff = Self::in_backoff(&state, now);
        let last_error = state.parent.last_error.clone();
        let Some(entry) = state.reservoirs.get_mut(id) else {
            return Err(StoreError::Protocol("reservoir vanished".into()));
        };
        if let Some(record) = entry.records.iter().find(|r| r.id == item.id) {
            return Ok(Decision::Decided(Grant {
                replayed: true,
                ..record.grant
            }));
        }
        let expired = entry.reservoir.expire(now, self.terms);
        self.metrics
            .regional_tokens(&id.0, "expired", expired.tokens);
        entry.records.retain(|r| r.until_ms > now);
        match entry.reservoir.ask(ask, now, self.terms) {
            Answer::Decided(grant) => {
                let drip = (grant.share_per_ms * grant.period_ms as f64).floor() as u64;
                let taken = grant.granted.saturating_add(drip);
                if taken > 0 {
                    self.metrics.regional_tokens(&id.0, "spent", grant.granted);
                    if entry.records.len() >= RECORDS_PER_KEY {
                        entry.records.pop_front();
                    }
                    let lives = self.terms.record_lifetime_ms(grant.period_ms);
                    let sources = entry.reservoir.take_sources();
                    entry.records.push_back(Record {
                        id: item.id.clone(),
                        grant,
                        taken,
                        returned: 0,
                        sources,
                        until_ms: now + lives,
                    });
                }
                if !backoff {
                    self.start_fetch(&mut state, id, now);
                }
                Ok(Decision::Decided(grant))
            }
            Answer::Dry => {
                if let Some((until, reason)) = &entry.refused {
                    if *until > now {
                        return Err(StoreError::Server(reason.clone()));
                    }
                }
                if backoff {
                    return Err(StoreError::Parent(format!(
                        "nothing held for this key and the parent limiter is unreachable: {last_error}"
                    )));
                }
                let done = entry.done.subscribe();
                if self.start_fetch(&mut state, id, now) {
                    Ok(Decision::Wait(done))
                } else {
                    Ok(Decision::Decided(denial(RETRY_DRY_MS)))
                }
            }
        }
    }

    /// An instance gives back unused tokens of a lease of a global policy.
    fn give_back(self: &Arc<Self>, item: &ReturnItem) -> ReturnOutcome {
        let now = self.clock.now_ms();
        let mut state = self.lock();
        let id: KeyId = (item.policy.clone(), item.key.clone());
        let Some(entry) = state.reservoirs.get_mut(&id) else {
            return ReturnOutcome {
                now_ms: now,
                returned: 0,
            };
        };
        let Some(record) = entry.records.iter_mut().find(|r| r.id == item.id) else {
            return ReturnOutcome {
                now_ms: now,
                returned: 0,
            };
        };
        let returned = item.unused.min(record.taken - record.returned);
        record.returned += returned;
        // Back into the parent leases the tokens came from; what came from a lease or drip
        // that has ended goes on to the parent, under that lease's id.
        let sourced = record.sources.total();
        let onward = entry
            .reservoir
            .give_back_to(returned, &mut record.sources, now);
        let lost = returned.saturating_sub(sourced - record.sources.total());
        self.metrics.regional_tokens(&id.0, "expired", lost);
        drop(state);
        for (lease_id, tokens) in onward {
            self.return_to_parent(id.clone(), lease_id, tokens);
        }
        ReturnOutcome {
            now_ms: now,
            returned,
        }
    }

    /// Gives `tokens` of parent lease `lease_id` back to the parent in the background.
    fn return_to_parent(self: &Arc<Self>, id: KeyId, lease_id: String, tokens: u64) {
        let shared = Arc::clone(self);
        tokio::spawn(async move {
            let sent = shared.clock.now_ms();
            let result = shared
                .parent
                .give_back(&lease_id, &id.0, &id.1, tokens)
                .await;
            let took = shared.clock.now_ms() - sent;
            shared.metrics.parent_call("return", outcome(&result), took);
            let returned = result.unwrap_or(0);
            shared.metrics.regional_tokens(&id.0, "returned", returned);
            shared
                .metrics
                .regional_tokens(&id.0, "expired", tokens.saturating_sub(returned));
        });
    }
}

/// What one attempt at an ask came to.
enum Decision {
    Decided(Grant),
    /// Dry: wait for the parent's answer to the ask in flight.
    Wait(watch::Receiver<u64>),
}

/// Nothing now; ask again in `retry_after_ms`.
fn denial(retry_after_ms: u64) -> Grant {
    Grant {
        granted: 0,
        remaining: 0.0,
        retry_after_ms,
        replayed: false,
        share_per_ms: 0.0,
        period_ms: 0,
        expires_ms: None,
    }
}

fn outcome<T>(result: &Result<T, ParentError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(ParentError::Unreachable(_)) => "unreachable",
        Err(ParentError::Refused(_)) => "refused",
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
