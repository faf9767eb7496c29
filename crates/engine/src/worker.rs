//! Per-worker bookkeeping of the global stage, owned by the root context (callouts must
//! outlive the request that caused them: Envoy cancels a request's own callouts when its
//! stream ends, which would lose granted tokens).
//!
//! HTTP contexts queue lease needs and register themselves as waiters, then wake the root
//! through the worker's shared queue; the root dispatches the needs of a wake-up in one batch
//! (one request per key: the shared record lets only one request of the instance ask for a key
//! at a time), credits answers to the shared table, and decides every waiter again — resuming
//! it, answering it, or letting it wait for another round. A callout that gets no answer is
//! retried once under the same lease ids before its keys take the failure mode. A tick
//! enforces the filter's own deadline, so no request waits longer than the limiter timeout plus
//! a small margin whatever the network does, and looks again at requests waiting for an answer
//! another worker asked for.
//!
//! Leases this worker credited are watched for expiry: the tick takes an expired lease's
//! unspent tokens out of its record and returns them, whatever the traffic (a key that gets no
//! more requests would otherwise keep them until its record is evicted). Taking them out is
//! one CAS transaction on the record, so exactly one taker (this tick, another worker's, or a
//! request of the key that finds the lease expired) returns a given lease.
//!
//! The state and the small entry points are here; the rest, a file per concern: `waiters`
//! (requests waiting for leases, decided again), `sleepers` (shaped requests waiting for
//! their turn), `callouts` (batching and sending lease and return callouts), `answers`
//! (crediting answers, the retry, the failure mode), `settled` (units reported to the
//! limiter), `expiry` (leases watched and taken back when they expire) and `tick`.

mod answers;
mod callouts;
mod expiry;
mod settled;
mod sleepers;
mod tick;
mod waiters;

pub use sleepers::{no_room_reply, shaped_ids};

use crate::engine::{Admission, Decision, Engine, LeaseNeed, Plan, ReturnNeed};
use crate::metrics::Metrics;
use crate::shared::{SharedData, StoreAt};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tollgate_core::response::LocalReply;

// Names the unit tests (`tests.rs`) use through `use super::*`.
#[cfg(test)]
use crate::engine::{Attempt, Verdict};
#[cfg(test)]
use crate::global::{self, DEADLINE_MARGIN_MS, REFILL_LINGER_MS};
#[cfg(test)]
use tollgate_core::protocol::{LEASES_PATH, RETURNS_PATH};

/// Tick period while requests wait (the deadline's resolution).
pub const TICK_MS: u64 = 5;
/// Most requests one worker keeps waiting; beyond it a request is decided as if the limiter
/// were unavailable (bounded memory whatever the load).
pub const MAX_WAITERS: usize = 10_000;
/// Most requests waiting for another worker's answer that one tick decides again.
pub const MAX_POLLED_PER_TICK: usize = 512;
/// Tick period while nobody waits but leases this worker credited are outstanding: an
/// expired lease's unspent tokens go back to the limiter within about this long of its expiry
/// (plus the return callout), whether or not its key gets another request.
pub const RETURN_TICK_MS: u64 = 100;
/// Most expired leases one tick takes back (bounded work per tick; the rest go next tick).
pub const MAX_RETURNS_PER_TICK: usize = 256;
/// Most keys one worker watches for lease expiry (bounded memory); beyond it, a key's expired
/// lease is returned by its next request, as before.
pub const MAX_WATCHED: usize = 65_536;
/// Rounds of dispatching in one flush (a failed dispatch decides its waiters, which may queue
/// a probe: bounded, never a loop without end).
const MAX_FLUSH_ROUNDS: usize = 4;

/// What the worker needs from the host (proxy-wasm in production, a fake in unit tests).
pub trait Host {
    /// Sends `body` to the limiter; returns the callout token.
    fn dispatch(&self, path: &str, body: &[u8], timeout_ms: u64) -> Result<u32, String>;
    /// Lets a paused request go on to the upstream, with `request_headers` set on it first
    /// (tag headers: the route is chosen again); `false` if it is gone.
    fn resume(&self, context_id: u32, request_headers: &[(String, String)]) -> bool;
    /// Answers a paused request; `false` if it is gone.
    fn reply(&self, context_id: u32, reply: &LocalReply) -> bool;
    /// Sets the root's tick period (0: off).
    fn set_tick(&self, period_ms: u64);
}

/// Everything a root-context event hands the worker: the engine, the shared table, metrics,
/// the host and the time of the event.
pub struct Ctx<'a, S: SharedData, H: Host> {
    pub engine: &'a Engine,
    pub store: &'a S,
    pub metrics: &'a Metrics,
    pub host: &'a H,
    pub now_ms: u64,
}

impl<'a, S: SharedData, H: Host> Ctx<'a, S, H> {
    /// The shared table's store at the time of the event, as the engine takes it.
    pub fn at(&self) -> StoreAt<'a, S> {
        StoreAt::new(self.store, self.now_ms)
    }
}

/// What an admitted request carries to its response: headers to add, and the admissions its
/// stream end settles and releases. Filled in when the request is admitted (by the worker, for
/// a request that waited).
#[derive(Debug, Default)]
pub struct AdmittedState {
    pub response_headers: Vec<(String, String)>,
    /// Request headers to set when a request the worker holds is resumed (tags).
    pub request_headers: Vec<(String, String)>,
    pub admissions: Vec<Admission>,
    /// A request that waited was let go on (so its body may follow it now).
    pub resumed: bool,
}

/// The state an admitted request shares with the worker that may resume it. A mutex, not a
/// `RefCell`: the native build's worker is shared by Envoy's threads (in the wasm build the lock
/// is never contended).
#[derive(Debug, Clone, Default)]
pub struct Admitted(Arc<Mutex<AdmittedState>>);

impl Admitted {
    /// The state (a lock poisoned by a panic elsewhere still holds usable data).
    pub fn lock(&self) -> MutexGuard<'_, AdmittedState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A shaped request waiting for its turn.
struct Sleeper {
    wake_at_ms: u64,
    /// The shaped policies' bucket ids (the per-key bound counts these).
    bucket_ids: Vec<String>,
    admitted: Admitted,
}

struct Waiter {
    plan: Plan,
    deadline_ms: u64,
    round: u32,
    waiting_for: Vec<String>,
    admitted: Admitted,
}

/// One lease request of a callout.
#[derive(Debug, Clone)]
struct Asked {
    need: LeaseNeed,
    seq: u64,
    id: String,
    /// This is already the retry under the same id.
    retried: bool,
    /// The id is asked for the first time, or retried at once; `false` for an id reused long
    /// after its answer was lost (its share, if any, is not started: see `apply_grant`).
    fresh: bool,
}

/// A key whose lease this worker credited: when it expires, and what its return names.
struct Watched {
    at_ms: u64,
    policy: usize,
    key: String,
}

enum Callout {
    Leases {
        items: Vec<Asked>,
        sent_ms: u64,
    },
    Returns {
        items: Vec<ReturnNeed>,
        sent_ms: u64,
    },
}

/// One worker's global-stage state.
pub struct Worker {
    instance: u64,
    /// This instance's name towards the limiter (assignments are per holder).
    holder: String,
    next_seq: u64,
    queued: Vec<LeaseNeed>,
    queued_returns: Vec<ReturnNeed>,
    /// Bucket ids with a callout in flight on this worker.
    inflight: HashSet<String>,
    /// Lease requests whose outcome is unknown (no answer even after the retry: the limiter
    /// may have applied them), by bucket id: the next request for that key reuses the id, so
    /// the limiter's dedup record hands over what it granted then and no grant is lost.
    unsettled: HashMap<String, (u64, String)>,
    callouts: HashMap<u32, Callout>,
    waiters: HashMap<u32, Waiter>,
    /// Shaped requests paused until their turn, by context.
    sleepers: HashMap<u32, Sleeper>,
    /// Keys whose lease this worker credited, by expiry (`watched` says when each is due).
    expiring: BTreeSet<(u64, String)>,
    watched: HashMap<String, Watched>,
    /// The tick period asked of the host (0: off).
    tick_ms: u64,
    /// Units of finished requests per policy (index), not yet reported to the limiter: they
    /// go with the next lease or return callout.
    settled: Vec<u64>,
}

impl Worker {
    /// `instance` makes lease ids unique across Envoy instances, `worker` across workers.
    pub fn new(instance: u64, worker: u64) -> Self {
        Self {
            instance,
            holder: format!("{instance:016x}"),
            next_seq: worker << 40,
            queued: Vec::new(),
            queued_returns: Vec::new(),
            inflight: HashSet::new(),
            unsettled: HashMap::new(),
            callouts: HashMap::new(),
            waiters: HashMap::new(),
            sleepers: HashMap::new(),
            expiring: BTreeSet::new(),
            watched: HashMap::new(),
            tick_ms: 0,
            settled: Vec::new(),
        }
    }

    /// Queues the lease needs and returns of a decision; `true` when the root must be woken.
    pub fn queue(&mut self, decision: &Decision) -> bool {
        self.queued.extend(decision.needs.iter().cloned());
        self.queued_returns.extend(decision.returns.iter().cloned());
        !decision.needs.is_empty() || !decision.returns.is_empty()
    }

    /// A request ended (answered, reset or done): forget it.
    pub fn forget(&mut self, context_id: u32) {
        self.waiters.remove(&context_id);
        self.sleepers.remove(&context_id);
    }

    /// Whether the worker will resume or answer this request (it waits or sleeps).
    pub fn holds(&self, context_id: u32) -> bool {
        self.waiters.contains_key(&context_id) || self.sleepers.contains_key(&context_id)
    }
}

#[cfg(test)]
mod tests;
