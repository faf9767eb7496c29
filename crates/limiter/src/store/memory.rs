//! The embedded store: every bucket and window in this process, for a single limiter instance
//! without Redis (development, tests, a one-replica deployment).
//!
//! Same semantics as the Redis Function, running tollgate-core's `assign` and `window` math
//! directly: one mutex makes each unit atomic, each bucket keeps its state and its holdings
//! together, each window its counters or its log, lease records dedup ids, and state expires
//! like Redis keys (a bucket `bucket_ttl_ms` after its last write, a window `window_ttl_ms`
//! after it, a lease record `dedup_ttl_ms` after it was created). Expired entries are ignored
//! when read and removed by a bounded sweep on every call (an expiry heap with one live entry
//! per key), so memory follows the active keys and no call does unbounded work.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tollgate_core::assign::{self, Allotment, Holding};
use tollgate_core::bucket::{BucketState, Limits};
use tollgate_core::policy::Algorithm;
use tollgate_core::window::{self, CounterKind, Counters, Log, Window, WindowGrant};

use super::{
    bucket_ttl_ms, keys, window_ttl_ms, CountItem, CountOutcome, ExecStats, Grant, LeaseItem,
    LeaseOutcome, ReturnItem, ReturnOutcome, Store, StoreError, StoreSettings,
    WINDOW_TTL_MARGIN_MS,
};
use crate::clock::{Clock, MonotonicClock};

/// Most expired entries removed per call.
const SWEEP_BATCH: usize = 32;

/// The memory store. Cheap to share behind an `Arc`; all state is behind one mutex.
pub struct MemoryStore {
    inner: Mutex<Inner>,
    clock: Arc<dyn Clock>,
    settings: StoreSettings,
    /// Decisions made through [`Store`] and the nanoseconds they took (lock wait included):
    /// the memory store's counterpart of Redis' `FCALL` statistics.
    exec: ExecTally,
}

/// Cumulative decision count and time.
#[derive(Debug, Default)]
struct ExecTally {
    calls: AtomicU64,
    nanos: AtomicU64,
}

impl ExecTally {
    fn timed<T>(&self, decide: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = decide();
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
        out
    }

    fn stats(&self) -> ExecStats {
        ExecStats {
            calls: self.calls.load(Ordering::Relaxed),
            usec: self.nanos.load(Ordering::Relaxed) as f64 / 1_000.0,
        }
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// What is kept of a decided lease id: its answer (replayed as it was), and how much of what
/// it took may still come back.
#[derive(Debug, Clone, PartialEq)]
struct LeaseRecord {
    granted: u64,
    /// Everything the answer took from the bucket (`Allotment::taken`): returns stop there.
    taken: u64,
    returned: u64,
    remaining: f64,
    retry_after_ms: u64,
    share_per_ms: f64,
    period_ms: u64,
    /// The state it was drawn from (a bucket key, or a window's state key).
    bucket: String,
    /// A window's lease: when it ends (the store's clock, ms). `None` for a token bucket.
    ends_at_ms: Option<u64>,
}

impl LeaseRecord {
    /// The recorded answer, as of `now` (a window's lease has less time left).
    fn replay(&self, now: u64) -> Grant {
        Grant {
            granted: self.granted,
            remaining: self.remaining,
            retry_after_ms: self.retry_after_ms,
            replayed: true,
            share_per_ms: self.share_per_ms,
            period_ms: self.period_ms,
            expires_ms: self.ends_at_ms.map(|end| end.saturating_sub(now)),
        }
    }
}

/// A window's state: counters (fixed window, sliding window counter) or a log.
#[derive(Debug, Clone, PartialEq)]
pub enum WindowState {
    Counters(Counters),
    Log(Log),
}

/// One bucket as stored: its state and the holdings of the instances it knows.
#[derive(Debug, Clone, PartialEq)]
struct Bucket {
    state: BucketState,
    holdings: Vec<Holding>,
}

/// A bucket as the memory store sees it now (tests compare it with Redis' hash and PTTL).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketView {
    /// The stored state (as of its last write, not refilled).
    pub state: BucketState,
    /// Live holdings, in stored order.
    pub holdings: Vec<Holding>,
    /// Milliseconds until the state expires; `None` for never.
    pub ttl_ms: Option<u64>,
}

#[derive(Debug)]
struct Entry<T> {
    value: T,
    /// Last millisecond at which the entry is alive (Redis: expired when `now > when`);
    /// `u64::MAX` for never.
    expires_at: u64,
    /// The time of this key's entry in the expiry heap.
    heap_at: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Bucket,
    Lease,
    Window,
    Count,
}

#[derive(Debug, Default)]
struct Inner {
    buckets: HashMap<String, Entry<Bucket>>,
    leases: HashMap<String, Entry<LeaseRecord>>,
    windows: HashMap<String, Entry<WindowState>>,
    /// [`Store::count`]'s window counts, under their Redis count keys.
    counts: HashMap<String, Entry<u64>>,
    expiries: BinaryHeap<Reverse<(u64, Kind, String)>>,
}

fn expiry(now: u64, ttl_ms: u64) -> u64 {
    if ttl_ms == 0 {
        u64::MAX
    } else {
        now.saturating_add(ttl_ms)
    }
}

impl Inner {
    /// The stored bucket if it has not expired, with its live holdings only.
    fn bucket(&self, key: &str, now: u64) -> Option<Bucket> {
        self.buckets
            .get(key)
            .filter(|e| e.expires_at >= now)
            .map(|e| Bucket {
                state: e.value.state,
                holdings: e
                    .value
                    .holdings
                    .iter()
                    .filter(|h| h.ends_ms > now)
                    .cloned()
                    .collect(),
            })
    }

    fn lease(&self, key: &str, now: u64) -> Option<&LeaseRecord> {
        self.leases
            .get(key)
            .filter(|e| e.expires_at >= now)
            .map(|e| &e.value)
    }

    fn put_bucket(&mut self, key: &str, value: Bucket, expires_at: u64) {
        let push = put(&mut self.buckets, key, value, expires_at);
        if push {
            self.expiries
                .push(Reverse((expires_at, Kind::Bucket, key.to_owned())));
        }
    }

    /// The stored window state if it has not expired.
    fn window(&self, key: &str, now: u64) -> Option<WindowState> {
        self.windows
            .get(key)
            .filter(|e| e.expires_at >= now)
            .map(|e| e.value.clone())
    }

    fn put_window(&mut self, key: &str, value: WindowState, expires_at: u64) {
        let push = put(&mut self.windows, key, value, expires_at);
        if push {
            self.expiries
                .push(Reverse((expires_at, Kind::Window, key.to_owned())));
        }
    }

    fn put_lease(&mut self, key: &str, value: LeaseRecord, expires_at: u64) {
        let push = put(&mut self.leases, key, value, expires_at);
        if push {
            self.expiries
                .push(Reverse((expires_at, Kind::Lease, key.to_owned())));
        }
    }

    /// A window count if it has not expired.
    fn count(&self, key: &str, now: u64) -> Option<u64> {
        self.counts
            .get(key)
            .filter(|e| e.expires_at >= now)
            .map(|e| e.value)
    }

    fn put_count(&mut self, key: &str, value: u64, expires_at: u64) {
        let push = put(&mut self.counts, key, value, expires_at);
        if push {
            self.expiries
                .push(Reverse((expires_at, Kind::Count, key.to_owned())));
        }
    }

    /// Removes at most [`SWEEP_BATCH`] expired entries.
    fn sweep(&mut self, now: u64) {
        for _ in 0..SWEEP_BATCH {
            match self.expiries.peek() {
                Some(Reverse((at, _, _))) if *at < now => {}
                _ => return,
            }
            let Some(Reverse((at, kind, key))) = self.expiries.pop() else {
                return;
            };
            let requeue = match kind {
                Kind::Bucket => sweep_one(&mut self.buckets, &key, at, now),
                Kind::Lease => sweep_one(&mut self.leases, &key, at, now),
                Kind::Window => sweep_one(&mut self.windows, &key, at, now),
                Kind::Count => sweep_one(&mut self.counts, &key, at, now),
            };
            if let Some(next) = requeue {
                self.expiries.push(Reverse((next, kind, key)));
            }
        }
    }

    fn len(&self) -> usize {
        self.buckets.len() + self.leases.len() + self.windows.len() + self.counts.len()
    }
}

/// Inserts or overwrites `key`; whether a heap entry must be pushed for it.
fn put<T>(map: &mut HashMap<String, Entry<T>>, key: &str, value: T, expires_at: u64) -> bool {
    match map.get_mut(key) {
        Some(entry) => {
            entry.value = value;
            entry.expires_at = expires_at;
            if expires_at < entry.heap_at {
                // The heap entry is later than the new expiry: queue an earlier one; the old
                // one is recognised as stale when it comes up.
                entry.heap_at = expires_at;
                true
            } else {
                false
            }
        }
        None => {
            map.insert(
                key.to_owned(),
                Entry {
                    value,
                    expires_at,
                    heap_at: expires_at,
                },
            );
            true
        }
    }
}

/// Handles one due heap entry: removes the key if it expired, or returns when to look again.
fn sweep_one<T>(map: &mut HashMap<String, Entry<T>>, key: &str, at: u64, now: u64) -> Option<u64> {
    let entry = map.get_mut(key)?;
    if entry.heap_at != at {
        return None;
    }
    if entry.expires_at < now {
        map.remove(key);
        None
    } else {
        entry.heap_at = entry.expires_at;
        Some(entry.expires_at)
    }
}

/// A window touched by the fresh items of one unit.
struct TouchedWindow {
    key: String,
    algorithm: Algorithm,
    /// Moved to the unit's time (a new window, units that left the log) before any item took
    /// from it.
    start: WindowState,
    /// After the items decided so far.
    now: WindowState,
}

/// The counter kind and window of a counter algorithm (`None`: a log or a token bucket).
fn counter_kind(algorithm: &Algorithm) -> Option<(CounterKind, &Window)> {
    match algorithm {
        Algorithm::FixedWindow(w) => Some((CounterKind::Fixed, w)),
        Algorithm::SlidingWindow(w) => Some((CounterKind::Sliding, w)),
        Algorithm::TokenBucket | Algorithm::SlidingLog(_) => None,
    }
}

impl TouchedWindow {
    /// The stored state (or a fresh one) moved to `now`.
    fn start(key: String, algorithm: Algorithm, stored: Option<WindowState>, now: u64) -> Self {
        let start = match (&algorithm, stored) {
            (Algorithm::SlidingLog(w), stored) => {
                let mut log = match stored {
                    Some(WindowState::Log(log)) => log,
                    _ => Log::default(),
                };
                log.trim(w, now);
                WindowState::Log(log)
            }
            (algorithm, stored) => {
                let counters = match stored {
                    Some(WindowState::Counters(c)) => c,
                    _ => Counters::default(),
                };
                match counter_kind(algorithm) {
                    Some((_, w)) => WindowState::Counters(counters.at(w, now)),
                    None => WindowState::Counters(counters),
                }
            }
        };
        Self {
            key,
            algorithm,
            now: start.clone(),
            start,
        }
    }

    /// `window::lease` of the item on the state as the unit left it so far.
    fn lease(&mut self, now: u64, min: u64, want: u64) -> Option<WindowGrant> {
        match (&self.algorithm, &mut self.now) {
            (Algorithm::SlidingLog(w), WindowState::Log(log)) => Some(log.lease(w, now, min, want)),
            (algorithm, WindowState::Counters(c)) => {
                let (kind, w) = counter_kind(algorithm)?;
                let (next, grant) = window::lease(kind, w, Some(*c), now, min, want);
                *c = next;
                Some(grant)
            }
            _ => None,
        }
    }

    /// Units that would fit the state before the unit took any (what a denied group's items
    /// answer as `remaining`): core's `room` of `window::lease`.
    fn start_room(&self, now: u64) -> f64 {
        match (&self.algorithm, &self.start) {
            (Algorithm::SlidingLog(w), WindowState::Log(log)) => {
                w.limit.saturating_sub(log.times.len() as u64) as f64
            }
            (algorithm, WindowState::Counters(c)) => match counter_kind(algorithm) {
                Some((kind, w)) => (w.limit as f64 - window::counted(kind, w, c, now) + 1e-9)
                    .floor()
                    .max(0.0),
                None => 0.0,
            },
            _ => 0.0,
        }
    }
}

/// When `state` equals a fresh one (`None`: a log with nothing in it, which is dropped).
fn window_idle_at(algorithm: &Algorithm, state: &WindowState) -> Option<u64> {
    match (algorithm, state) {
        (Algorithm::SlidingLog(w), WindowState::Log(log)) => {
            (!log.times.is_empty()).then(|| log.idle_at_ms(w))
        }
        (Algorithm::FixedWindow(w), WindowState::Counters(c)) => Some(c.idle_at_ms(w, false)),
        (Algorithm::SlidingWindow(w), WindowState::Counters(c)) => Some(c.idle_at_ms(w, true)),
        _ => None,
    }
}

/// What one fresh item of a unit was decided.
enum Decided {
    /// From bucket `touched[at]`.
    Bucket(Allotment, usize),
    /// From window `windows[at]`.
    Window(WindowGrant, usize),
}

impl Decided {
    fn is_empty(&self) -> bool {
        match self {
            Decided::Bucket(a, _) => a.is_empty(),
            Decided::Window(g, _) => g.granted == 0,
        }
    }
}

/// A bucket touched by the fresh items of one unit.
struct Touched {
    key: String,
    /// The bucket's policy limits (one policy per bucket key).
    limits: Limits,
    /// Refilled state and live holdings before any item took from it.
    start: Bucket,
    /// State and holdings after the items decided so far.
    now: Bucket,
}

impl MemoryStore {
    /// A store on this process' monotonic clock.
    pub fn new(settings: StoreSettings) -> Self {
        Self::with_clock(settings, Arc::new(MonotonicClock::new()))
    }

    /// A store on a given clock (tests drive it by hand).
    pub(crate) fn with_clock(settings: StoreSettings, clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            clock,
            settings,
            exec: ExecTally::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-written unit: every write
        // happens after all decisions, so the state is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of live-or-unswept entries (buckets plus lease records).
    fn len(&self) -> usize {
        self.lock().len()
    }

    /// The bucket `bucket_key` as of the store's clock.
    pub fn bucket_view(&self, bucket_key: &str) -> Option<BucketView> {
        self.bucket_view_at(bucket_key, self.clock.now_ms())
    }

    /// The bucket `bucket_key` as of `now` (absent once expired).
    pub fn bucket_view_at(&self, bucket_key: &str, now: u64) -> Option<BucketView> {
        let inner = self.lock();
        let stored = inner.bucket(bucket_key, now)?;
        let expires_at = inner.buckets.get(bucket_key).map(|e| e.expires_at)?;
        Some(BucketView {
            state: stored.state,
            holdings: stored.holdings,
            ttl_ms: (expires_at != u64::MAX).then(|| expires_at - now),
        })
    }

    /// The decision the Redis Function `tollgate_v4_lease` makes, line by line.
    pub fn lease_at(&self, items: &[LeaseItem], now: u64) -> Result<LeaseOutcome, StoreError> {
        let mut inner = self.lock();
        inner.sweep(now);
        let terms = self.settings.terms();

        // Indexed by item position (`i`, from `enumerate`) and by position in `touched` or
        // `windows` (`at`, from `position` or the push just made).
        let mut grants: Vec<Option<Grant>> = vec![None; items.len()];
        let mut touched: Vec<Touched> = Vec::new();
        let mut windows: Vec<TouchedWindow> = Vec::new();
        let mut decided: Vec<(usize, Decided)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            if let Some(record) = inner.lease(&item.lease_key(), now) {
                grants[i] = Some(record.replay(now));
                continue;
            }
            if item.algorithm != Algorithm::TokenBucket {
                let key = item.state_key();
                let at = match windows.iter().position(|t| t.key == key) {
                    Some(at) => at,
                    None => {
                        let stored = inner.window(&key, now);
                        windows.push(TouchedWindow::start(key, item.algorithm, stored, now));
                        windows.len() - 1
                    }
                };
                let grant = windows[at].lease(now, item.min, item.want).ok_or_else(|| {
                    StoreError::Protocol("memory store: window state mixed up".into())
                })?;
                decided.push((i, Decided::Window(grant, at)));
                continue;
            }
            let bucket_key = item.bucket_key();
            let at = match touched.iter().position(|t| t.key == bucket_key) {
                Some(at) => at,
                None => {
                    let stored = inner.bucket(&bucket_key, now);
                    let holdings = stored
                        .as_ref()
                        .map(|b| b.holdings.clone())
                        .unwrap_or_default();
                    let start = Bucket {
                        state: assign::current(&item.limits, stored.map(|b| b.state), now),
                        holdings,
                    };
                    touched.push(Touched {
                        key: bucket_key,
                        limits: item.limits,
                        now: start.clone(),
                        start,
                    });
                    touched.len() - 1
                }
            };
            let t = &mut touched[at];
            let (next, allotment) = assign::allot(
                &item.limits,
                Some(t.now.state),
                &mut t.now.holdings,
                now,
                item.ask(),
                terms,
            );
            t.now.state = next;
            decided.push((i, Decided::Bucket(allotment, at)));
        }

        // All or nothing: when some fresh items got something and others nothing, none of
        // them takes anything and no bucket, window or holding changes (they keep only what
        // time did: a refill, a new window, units that left a log). Items that all got
        // nothing took nothing; what they leave is kept (a waiting holder's demand, the rest
        // of a running assignment its renewal gave back), so the next renewals make room for
        // it.
        let given = decided.iter().filter(|(_, d)| !d.is_empty()).count();
        let apply = given == decided.len() || given == 0;
        for t in &touched {
            let bucket = if apply { &t.now } else { &t.start };
            let ttl = bucket_ttl_ms(&t.limits, &bucket.state, &bucket.holdings, now);
            inner.put_bucket(&t.key, bucket.clone(), expiry(now, ttl));
        }
        for t in &windows {
            let state = if apply { &t.now } else { &t.start };
            match window_idle_at(&t.algorithm, state) {
                Some(idle_at) => {
                    let expires_at = expiry(now, window_ttl_ms(idle_at, now));
                    inner.put_window(&t.key, state.clone(), expires_at);
                }
                None => {
                    inner.windows.remove(&t.key);
                }
            }
        }
        let record_expiry = expiry(now, self.settings.dedup_ttl_ms);
        for (i, d) in decided {
            let record = match d {
                Decided::Bucket(allotment, at) => {
                    let t = &touched[at];
                    if apply {
                        LeaseRecord {
                            granted: allotment.granted,
                            taken: allotment.taken(),
                            returned: 0,
                            remaining: allotment.remaining,
                            retry_after_ms: allotment.retry_after_ms,
                            share_per_ms: allotment.share_per_ms,
                            period_ms: allotment.period_ms,
                            bucket: t.key.clone(),
                            ends_at_ms: None,
                        }
                    } else {
                        LeaseRecord {
                            granted: 0,
                            taken: 0,
                            returned: 0,
                            remaining: t.start.state.tokens,
                            retry_after_ms: allotment.retry_after_ms,
                            share_per_ms: 0.0,
                            period_ms: 0,
                            bucket: t.key.clone(),
                            ends_at_ms: None,
                        }
                    }
                }
                // A window's lease takes nothing returnable (`taken` 0): its units count as
                // used in their window (a log's, from the grant until a window after the
                // lease ends: core's `Log::lease`), spent or not. Nothing unspent comes back:
                // a return could only shorten that, and would have to tell the units the
                // instance never spent from the ones it did.
                Decided::Window(grant, at) => {
                    let t = &windows[at];
                    let (granted, remaining) = if apply {
                        (grant.granted, grant.remaining)
                    } else {
                        (0, t.start_room(now))
                    };
                    LeaseRecord {
                        granted,
                        taken: 0,
                        returned: 0,
                        remaining,
                        retry_after_ms: grant.retry_after_ms,
                        share_per_ms: 0.0,
                        period_ms: 0,
                        bucket: t.key.clone(),
                        ends_at_ms: Some(now.saturating_add(grant.expires_ms)),
                    }
                }
            };
            grants[i] = Some(Grant {
                replayed: false,
                ..record.replay(now)
            });
            inner.put_lease(&items[i].lease_key(), record, record_expiry);
        }
        // Every item was either replayed or decided; anything else is a bug, reported as an
        // error rather than turned into a denial.
        let grants = grants
            .into_iter()
            .collect::<Option<Vec<Grant>>>()
            .ok_or_else(|| StoreError::Protocol("memory store left an item undecided".into()))?;
        Ok(LeaseOutcome {
            now_ms: now,
            grants,
        })
    }

    /// A window's state as stored (`key`: `LeaseItem::state_key`) as of the store's clock,
    /// with milliseconds until it expires.
    pub fn window_view(&self, key: &str) -> Option<(WindowState, u64)> {
        self.window_view_at(key, self.clock.now_ms())
    }

    /// A window's state as stored, as of `now` (absent once expired), with milliseconds
    /// until it expires.
    pub fn window_view_at(&self, key: &str, now: u64) -> Option<(WindowState, u64)> {
        let inner = self.lock();
        let state = inner.window(key, now)?;
        let expires_at = inner.windows.get(key).map(|e| e.expires_at)?;
        Some((state, expires_at.saturating_sub(now)))
    }

    /// The decision the Redis Function `tollgate_v4_count` makes, line by line.
    pub fn count_at(&self, items: &[CountItem], now: u64) -> Result<CountOutcome, StoreError> {
        if items.is_empty() {
            return Err(StoreError::Server("tollgate_v4_count: no items".into()));
        }
        if let Some(bad) = items.iter().find(|i| i.window_ms == 0 || i.cost == 0) {
            return Err(StoreError::Server(format!(
                "tollgate_v4_count: bad item {bad:?}"
            )));
        }
        let count_keys: Vec<String> = items
            .iter()
            .map(|i| keys::fixed_count_key(&i.window_key(), now / i.window_ms))
            .collect();
        let mut inner = self.lock();
        inner.sweep(now);
        // Per distinct count key, first use first: its count before the call, and after the
        // items decided so far.
        let mut seen: Vec<(&str, u64, u64)> = Vec::new();
        let mut admitted = true;
        let mut remaining = Vec::with_capacity(items.len());
        for (item, key) in items.iter().zip(&count_keys) {
            let at = match seen.iter().position(|(k, _, _)| *k == key.as_str()) {
                Some(at) => at,
                None => {
                    let before = inner.count(key, now).unwrap_or(0);
                    seen.push((key, before, before));
                    seen.len() - 1
                }
            };
            let Some(entry) = seen.get_mut(at) else {
                return Err(StoreError::Protocol("memory store lost a count".into()));
            };
            entry.2 = entry.2.saturating_add(item.cost);
            if entry.2 > item.limit {
                admitted = false;
            }
            remaining.push(item.limit.saturating_sub(entry.2));
        }
        if admitted {
            for (item, key) in items.iter().zip(&count_keys) {
                let stored = inner.counts.get(key).filter(|e| e.expires_at >= now);
                let (count, expires_at) = match stored {
                    Some(e) => (e.value.saturating_add(item.cost), e.expires_at),
                    // A new count lives until its window's end plus the margin.
                    None => {
                        let ends = (now / item.window_ms + 1).saturating_mul(item.window_ms);
                        (item.cost, ends.saturating_add(WINDOW_TTL_MARGIN_MS))
                    }
                };
                inner.put_count(key, count, expires_at);
            }
        } else {
            remaining.clear();
            for (item, key) in items.iter().zip(&count_keys) {
                let before = seen
                    .iter()
                    .find(|(k, _, _)| *k == key.as_str())
                    .map_or(0, |(_, before, _)| *before);
                remaining.push(item.limit.saturating_sub(before));
            }
        }
        Ok(CountOutcome {
            now_ms: now,
            admitted,
            remaining,
        })
    }

    /// A window count of [`Store::count`] (`count_key`: `store::fixed_count_key` of the
    /// item's window key and window index) as of the store's clock, with milliseconds until
    /// it expires.
    pub fn count_view(&self, count_key: &str) -> Option<(u64, u64)> {
        let now = self.clock.now_ms();
        let inner = self.lock();
        let count = inner.count(count_key, now)?;
        let expires_at = inner.counts.get(count_key).map(|e| e.expires_at)?;
        Some((count, expires_at.saturating_sub(now)))
    }

    /// The decision the Redis Function `tollgate_v4_return` makes, line by line.
    pub fn give_back_at(&self, item: &ReturnItem, now: u64) -> ReturnOutcome {
        let mut inner = self.lock();
        inner.sweep(now);
        let nothing = ReturnOutcome {
            now_ms: now,
            returned: 0,
        };
        if !item.takes_back() {
            return nothing;
        }
        let lease_key = item.lease_key();
        let bucket_key = item.bucket_key();
        let Some(record) = inner.lease(&lease_key, now) else {
            return nothing;
        };
        if record.bucket != bucket_key {
            return nothing;
        }
        let amount = item
            .unused
            .min(record.taken.saturating_sub(record.returned));
        if amount == 0 {
            return nothing;
        }
        let returned = record.returned.saturating_add(amount);
        let stored = inner.bucket(&bucket_key, now);
        let holdings = stored
            .as_ref()
            .map(|b| b.holdings.clone())
            .unwrap_or_default();
        // Into a bucket that may be in debt: no clamp at zero, or tokens would come from debt.
        let state = assign::give_back(&item.limits, stored.map(|b| b.state), now, amount);
        let ttl = bucket_ttl_ms(&item.limits, &state, &holdings, now);
        inner.put_bucket(&bucket_key, Bucket { state, holdings }, expiry(now, ttl));
        if let Some(entry) = inner.leases.get_mut(&lease_key) {
            entry.value.returned = returned;
        }
        ReturnOutcome {
            now_ms: now,
            returned: amount,
        }
    }
}

impl Store for MemoryStore {
    async fn lease(&self, items: &[LeaseItem]) -> Result<LeaseOutcome, StoreError> {
        let now = self.clock.now_ms();
        self.exec.timed(|| self.lease_at(items, now))
    }

    async fn count(&self, items: &[CountItem]) -> Result<CountOutcome, StoreError> {
        let now = self.clock.now_ms();
        self.exec.timed(|| self.count_at(items, now))
    }

    async fn give_back(&self, item: &ReturnItem) -> Result<ReturnOutcome, StoreError> {
        let now = self.clock.now_ms();
        Ok(self.exec.timed(|| self.give_back_at(item, now)))
    }

    async fn prepare(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn ready(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn active_keys(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let count = u64::try_from(self.len()).unwrap_or(u64::MAX);
        Ok(vec![("memory".to_owned(), count)])
    }

    async fn exec_stats(&self) -> Result<Vec<(String, ExecStats)>, StoreError> {
        Ok(vec![("memory".to_owned(), self.exec.stats())])
    }

    fn node_for(&self, _key: &str) -> String {
        "memory".to_owned()
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn item(id: &str, key: &str, limits: Limits, min: u64, want: u64) -> LeaseItem {
        LeaseItem {
            id: id.into(),
            policy: "p".into(),
            key: key.into(),
            limits,
            algorithm: Algorithm::TokenBucket,
            min,
            want,
            holder: None,
            demand_per_ms: 0.0,
        }
    }

    fn store() -> (MemoryStore, ManualClock) {
        let clock = ManualClock::new(1_000_000);
        let store = MemoryStore::with_clock(
            StoreSettings {
                dedup_ttl_ms: 60_000,
                assignment_period_ms: 1_000,
                lease_ttl_ms: 2_000,
            },
            Arc::new(clock.clone()),
        );
        (store, clock)
    }

    #[test]
    fn expired_entries_are_swept_in_bounded_batches() {
        let (store, clock) = store();
        // 1 unit/10ms, burst 1: full refill 10ms, bucket TTL 1010ms.
        let l = Limits::new(1, 10, 1).unwrap();
        for i in 0..100 {
            let o = store
                .lease_at(
                    &[item(&format!("id{i}"), &format!("t{i}"), l, 1, 1)],
                    clock.now_ms(),
                )
                .unwrap();
            assert_eq!(o.grants[0].granted, 1);
        }
        assert_eq!(store.len(), 200);
        // Buckets expired, lease records not yet.
        clock.advance(2_000);
        let now = clock.now_ms();
        store.lock().sweep(now);
        assert_eq!(store.len(), 200 - SWEEP_BATCH);
        for _ in 0..10 {
            store.lock().sweep(now);
        }
        assert_eq!(store.len(), 100);
        clock.advance(60_000);
        for _ in 0..10 {
            store.lock().sweep(clock.now_ms());
        }
        assert_eq!(store.len(), 0);
        assert!(store.lock().expiries.is_empty());
    }

    #[test]
    fn rewritten_keys_keep_one_heap_entry() {
        let (store, clock) = store();
        let l = Limits::new(1, 10, 5).unwrap();
        for i in 0..50 {
            clock.advance(1);
            store
                .lease_at(&[item(&format!("id{i}"), "t", l, 1, 1)], clock.now_ms())
                .unwrap();
        }
        // 1 bucket + 50 records, one heap entry each.
        assert_eq!(store.lock().expiries.len(), 51);
    }

    fn named(id: &str, key: &str, limits: Limits, holder: &str, demand_per_ms: f64) -> LeaseItem {
        LeaseItem {
            holder: Some(holder.into()),
            demand_per_ms,
            ..item(id, key, limits, 1, 5)
        }
    }

    fn give(id: &str, key: &str, limits: Limits, unused: u64) -> ReturnItem {
        ReturnItem {
            id: id.into(),
            policy: "p".into(),
            key: key.into(),
            limits,
            algorithm: Algorithm::TokenBucket,
            unused,
        }
    }

    #[test]
    fn debt_is_kept_until_refilled_and_returns_add_to_it() {
        let (store, clock) = store();
        // 3/s, burst 5: a full refill is 1667 ms.
        let l = Limits::new(3, 1_000, 5).unwrap();
        let now = clock.now_ms();
        assert_eq!(
            store
                .lease_at(&[item("d", "t", l, 5, 5)], now)
                .unwrap()
                .grants[0]
                .granted,
            5
        );
        let a = store
            .lease_at(&[named("a", "t", l, "i1", 0.01)], now)
            .unwrap()
            .grants[0];
        // The whole rate (demand 10/s > 3/s) for the 1 s period: 3 tokens of debt.
        assert_eq!((a.granted, a.share_per_ms, a.period_ms), (0, 0.003, 1_000));
        assert!((a.remaining + 3.0).abs() < 1e-9, "{a:?}");
        let key = item("a", "t", l, 1, 1).bucket_key();
        let view = store.bucket_view(&key).unwrap();
        assert_eq!(view.holdings.len(), 1);
        // 8 tokens to refill at 0.003/ms: 2667 ms, plus the 1 s margin.
        assert_eq!(view.ttl_ms, Some(3_667));
        // A return into debt adds to it (no clamp at 0 first), bounded by what was taken.
        assert_eq!(store.give_back_at(&give("a", "t", l, 100), now).returned, 3);
        let view = store.bucket_view(&key).unwrap();
        assert!(view.state.tokens.abs() < 1e-9, "{view:?}");
        assert_eq!(store.give_back_at(&give("a", "t", l, 100), now).returned, 0);
    }

    #[test]
    fn a_failed_group_changes_no_bucket_and_no_holding() {
        let (store, clock) = store();
        let l = Limits::new(3, 1_000, 5).unwrap();
        let tiny = Limits::new(1, 3_600_000, 1).unwrap();
        let now = clock.now_ms();
        store.lease_at(&[item("d", "t", l, 5, 5)], now).unwrap();
        store
            .lease_at(&[named("a", "t", l, "i1", 0.001)], now)
            .unwrap();
        store
            .lease_at(&[item("e", "t:r", tiny, 1, 1)], now)
            .unwrap();
        let key = item("a", "t", l, 1, 1).bucket_key();
        let before = store.bucket_view(&key).unwrap();
        // i2 alone would get a share; the drained route bucket gives its partner nothing.
        let o = store
            .lease_at(
                &[
                    named("b", "t", l, "i2", 0.002),
                    item("f", "t:r", tiny, 1, 1),
                ],
                now,
            )
            .unwrap();
        assert!(
            o.grants
                .iter()
                .all(|g| g.granted == 0 && g.share_per_ms == 0.0),
            "{o:?}"
        );
        assert_eq!(o.grants[0].retry_after_ms, 0, "alone it was fine");
        assert_eq!(store.bucket_view(&key).unwrap(), before);
    }

    #[test]
    fn an_expired_record_reads_as_absent_before_it_is_swept() {
        let (store, clock) = store();
        let l = Limits::new(1, 3_600_000, 5).unwrap();
        let a = store
            .lease_at(&[item("x", "t", l, 1, 1)], clock.now_ms())
            .unwrap();
        assert_eq!(a.grants[0].granted, 1);
        clock.advance(60_001);
        let b = store
            .lease_at(&[item("x", "t", l, 1, 1)], clock.now_ms())
            .unwrap();
        assert!(!b.grants[0].replayed);
        assert_eq!(b.grants[0].granted, 1);
    }

    fn windowed(id: &str, key: &str, algorithm: Algorithm, min: u64, want: u64) -> LeaseItem {
        LeaseItem {
            algorithm,
            ..item(id, key, Limits::new(10, 1_000, 10).unwrap(), min, want)
        }
    }

    #[test]
    fn a_clock_that_went_back_counts_in_the_newest_window_seen() {
        let (store, clock) = store();
        let w = Window::new(10, 1_000).unwrap();
        // 1,000,000 starts window 1,000: 10 units near its end, then the clock goes back
        // 1.2 s, into the window before: nothing new to spend (a fresh window would give 10).
        for algorithm in [
            Algorithm::FixedWindow(w),
            Algorithm::SlidingWindow(w),
            Algorithm::SlidingLog(w),
        ] {
            clock.set(1_000_900);
            let k = format!("back-{}", algorithm.name());
            let g = store
                .lease_at(&[windowed("a", &k, algorithm, 10, 10)], clock.now_ms())
                .unwrap()
                .grants[0];
            assert_eq!(g.granted, 10, "{algorithm:?}");
            clock.set(999_700);
            let d = store
                .lease_at(&[windowed("b", &k, algorithm, 1, 1)], clock.now_ms())
                .unwrap()
                .grants[0];
            assert_eq!(d.granted, 0, "{algorithm:?}: {d:?}");
            // Counted in window 1,000: fixed 1,001,000 and sliding 1,001,100 from the clock
            // that went back; the log from the newest time it saw, 1,000,900: its leased
            // units were entered at the end of their lease, 1,001,000, and leave 1 s later.
            let retry = match algorithm {
                Algorithm::FixedWindow(_) => 1_300,
                Algorithm::SlidingWindow(_) => 1_400,
                _ => 1_100,
            };
            assert_eq!(d.retry_after_ms, retry, "{algorithm:?}: {d:?}");
            let (state, ttl) = store
                .window_view(&windowed("-", &k, algorithm, 1, 1).state_key())
                .unwrap();
            match state {
                WindowState::Log(log) => {
                    assert_eq!(log.seen_ms, 1_000_900);
                    assert_eq!(log.times, vec![1_001_000; 10]);
                    // Empty a window after its units (1,002,000), plus the margin.
                    assert_eq!(ttl, 2_300 + 1_000);
                }
                WindowState::Counters(c) => assert_eq!(c.window, 1_000, "{algorithm:?}"),
            }
        }
    }

    #[test]
    fn window_leases_take_nothing_returnable_and_replay_what_is_left() {
        let (store, clock) = store();
        let w = Window::new(10, 1_000).unwrap();
        let fixed = Algorithm::FixedWindow(w);
        clock.set(2_000_250);
        let g = store
            .lease_at(&[windowed("a", "t", fixed, 1, 8)], clock.now_ms())
            .unwrap()
            .grants[0];
        assert_eq!((g.granted, g.expires_ms), (8, Some(750)));
        clock.set(2_000_900);
        let again = store
            .lease_at(&[windowed("a", "t", fixed, 1, 8)], clock.now_ms())
            .unwrap()
            .grants[0];
        assert!(again.replayed);
        assert_eq!((again.granted, again.expires_ms), (8, Some(100)));
        clock.set(2_001_100);
        let late = store
            .lease_at(&[windowed("a", "t", fixed, 1, 8)], clock.now_ms())
            .unwrap()
            .grants[0];
        assert_eq!(
            late.expires_ms,
            Some(0),
            "the window it was drawn from ended"
        );
        // Under the token bucket (the policy switched back) or the window: nothing returns.
        let back = ReturnItem {
            algorithm: fixed,
            ..give("a", "t", Limits::new(10, 1_000, 10).unwrap(), 8)
        };
        assert_eq!(store.give_back_at(&back, clock.now_ms()).returned, 0);
        let as_bucket = give("a", "t", Limits::new(10, 1_000, 10).unwrap(), 8);
        assert_eq!(store.give_back_at(&as_bucket, clock.now_ms()).returned, 0);
    }

    #[test]
    fn a_monthly_window_ends_at_the_first_of_the_month_and_its_state_with_it() {
        use tollgate_core::calendar::{days_from_civil, Calendar, DAY_MS};
        let (store, clock) = store();
        let monthly = Algorithm::FixedWindow(Window::calendar(10, Calendar::Months(1)).unwrap());
        // 28 February 2027, 23:59:59: February (28 days) ends in a second.
        let mar1 = days_from_civil(2027, 3, 1) * DAY_MS;
        clock.set(mar1 - 1_000);
        let lease = |id: &str, min, want| {
            store
                .lease_at(&[windowed(id, "t", monthly, min, want)], clock.now_ms())
                .unwrap()
                .grants[0]
        };
        let g = lease("a", 1, 10);
        assert_eq!((g.granted, g.expires_ms), (10, Some(1_000)));
        let d = lease("b", 1, 1);
        assert_eq!((d.granted, d.retry_after_ms), (0, 1_000));
        // Kept until February ends (plus the margin), under the calendar window's own key.
        let key = windowed("-", "t", monthly, 1, 1).state_key();
        assert!(key.ends_with("|fixed:1mo"), "{key}");
        let (_, ttl) = store.window_view(&key).unwrap();
        assert_eq!(ttl, 1_000 + crate::store::WINDOW_TTL_MARGIN_MS);
        // March: 10 more, until the first of April, 31 days later.
        clock.set(mar1);
        let g = lease("c", 1, 10);
        assert_eq!((g.granted, g.expires_ms), (10, Some(31 * DAY_MS)));
        let d = lease("d", 1, 1);
        assert_eq!(d.retry_after_ms, 31 * DAY_MS);
    }
}
