//! One filter configuration of the native module: the engine, the process-wide table, the
//! metrics, and the global stage's worker shared by all of Envoy's worker threads.
//!
//! Threads: request hooks run on Envoy's workers; the worker's callouts are the
//! configuration's own (they outlive the request that caused them, as the wasm root's do) and
//! run on Envoy's main thread, woken through the configuration's scheduler. Their answers
//! resume or answer the requests that wait, through each request's own scheduler (its hooks
//! then run on its worker thread again). A small ticker thread wakes the main thread while
//! something waits (deadlines, shaped turns, polls). Lock order: `worker`, then `parked`.

use crate::abi::{self, ConfigEnvoyPtr, ModuleBuffer};
use crate::shared::ProcessSharedData;
use crate::stats;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tollgate_core::condition::Fact;
use tollgate_core::policy::{KeyPart, Policies};
use tollgate_core::protocol::MAX_BODY_BYTES;
use tollgate_core::response::LocalReply;
use tollgate_engine::engine::{Engine, SHARED_PREFIX};
use tollgate_engine::metrics::Metrics;
use tollgate_engine::table::{unguessable_seed, Cells, SlotTable};
use tollgate_engine::worker::{Ctx, Host, Worker};

/// Events of the configuration's scheduler (main thread).
pub const EVENT_FLUSH: u64 = 1;
pub const EVENT_TICK: u64 = 2;

/// The table of the process: like proxy-wasm shared data of one `vm_id`, it outlives a
/// configuration, so buckets survive a listener update.
fn process_store() -> &'static ProcessSharedData {
    static STORE: OnceLock<ProcessSharedData> = OnceLock::new();
    STORE.get_or_init(ProcessSharedData::default)
}

/// The table's records, typed, for every configuration of the process: a configuration that
/// keeps the table's size (a listener update) finds every key's state where it was; one of
/// another size gets fresh cells (its keys move to other groups anyway), and the old cells go
/// when the last configuration using them does.
fn process_cells(groups: u32) -> Arc<Cells> {
    static CELLS: Mutex<Option<Arc<Cells>>> = Mutex::new(None);
    let mut current = lock(&CELLS);
    match current.as_ref() {
        Some(cells) if cells.groups() == groups => cells.clone(),
        _ => {
            let cells = Arc::new(Cells::new(groups));
            *current = Some(cells.clone());
            cells
        }
    }
}

/// Worker numbers of this process (each configuration's worker has its own lease ids).
static NEXT_WORKER: AtomicU64 = AtomicU64::new(1);

/// A scheduler of Envoy's: a request's (`..._http_filter_scheduler_new`, committed by the
/// main thread when the worker settles the request) or the configuration's
/// (`..._http_filter_config_scheduler_new`, committed by workers and the ticker thread).
#[derive(Clone, Copy)]
pub struct Scheduler(pub *mut c_void);
// SAFETY: a scheduler is the one per-request or per-configuration object of the ABI that any
// thread may use: `..._scheduler_commit` only posts the event to the dispatcher of the thread
// that owns the request or the configuration, which then runs the `..._scheduled` hook there.
// Deleting it is ours to order after the last commit: a request's is deleted once its slot
// in `parked` is gone (under that lock), the configuration's once the ticker is joined and
// every filter of the configuration is gone (`NativeConfig::shutdown`).
unsafe impl Send for Scheduler {}
// SAFETY: as above; `commit` is the only call made through a shared reference.
unsafe impl Sync for Scheduler {}

/// The configuration's Envoy pointer, valid from `config_new` until `config_destroy` (after
/// every filter of the configuration is destroyed). [`NativeConfig`] is shared by the filters
/// of every worker thread, so it crosses threads inside it.
#[derive(Clone, Copy)]
pub struct ConfigHandle(pub ConfigEnvoyPtr);
// SAFETY: used on two kinds of threads only, as Envoy allows: on the main thread, in the
// configuration's own hooks (`config_new`, `config_scheduled`, `config_http_callout_done`), for
// its scheduler, callouts and stat definitions; and on workers, only as the handle of the
// configuration's stats (`stats::enter`; incrementing and recording go to Envoy's thread-safe
// stats store).
unsafe impl Send for ConfigHandle {}
// SAFETY: as above: the workers' calls at the same time are the stats callbacks, which Envoy
// makes safe to call from any worker (its stats are atomic).
unsafe impl Sync for ConfigHandle {}

/// What the worker decided for a request that waits or sleeps; its own hook acts on it.
pub enum Outcome {
    /// Go on, with these request headers set first (tags).
    Resume(Vec<(String, String)>),
    Reply(LocalReply),
}

/// A request the worker holds, reachable from the main thread.
pub struct Parked {
    pub scheduler: Scheduler,
    pub outcome: Option<Outcome>,
}

pub struct NativeConfig {
    pub envoy: ConfigHandle,
    pub engine: Engine,
    pub metrics: Metrics,
    worker: Mutex<Worker>,
    pub parked: Mutex<HashMap<u32, Parked>>,
    scheduler: Scheduler,
    flush_pending: AtomicBool,
    ticker: Ticker,
    cluster: String,
    authority: String,
}

/// Locks a mutex whatever a panic elsewhere left (the data stays consistent: every update
/// under these locks is a plain assignment).
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Why the native build refuses a policy document the wasm filter takes.
fn native_limits(policies: &Policies) -> Result<(), String> {
    // A document that validated holds every policy, in order: the index is the document's.
    for (index, policy) in policies.policies.iter().enumerate() {
        if policy
            .key
            .iter()
            .any(|part| matches!(part, KeyPart::JwtClaim { .. }))
        {
            return Err(format!(
                "policy `{}`: key.jwt_claim is not supported by the native build (the \
                 dynamic-module ABI of Envoy 1.40 reads no nested metadata); use the wasm \
                 filter, or jwt_authn's claim_to_headers with a header key",
                policy.name
            ));
        }
        if policy
            .limits_by
            .as_ref()
            .is_some_and(|by| matches!(by.by, KeyPart::JwtClaim { .. }))
        {
            return Err(format!(
                "policy `{}`: policies[{index}].limits.by.jwt_claim is not supported by the \
                 native build (the dynamic-module ABI of Envoy 1.40 reads no nested metadata); \
                 use the wasm filter, or jwt_authn's claim_to_headers with a `header`",
                policy.name
            ));
        }
        if let Some(condition) = policy
            .when
            .iter()
            .find(|c| matches!(c.fact, Fact::JwtClaim { .. }))
        {
            return Err(format!(
                "policy `{}`: policies[{index}].when[{}].jwt_claim is not supported by the \
                 native build (the dynamic-module ABI of Envoy 1.40 reads no nested metadata); \
                 use the wasm filter, or jwt_authn's claim_to_headers with a `header` condition",
                policy.name, condition.index
            ));
        }
    }
    Ok(())
}

impl NativeConfig {
    pub fn new(envoy: ConfigEnvoyPtr, config: &[u8]) -> Result<Arc<NativeConfig>, String> {
        stats::enter(envoy);
        let policies = Policies::from_json(config).map_err(|errors| errors.to_string())?;
        native_limits(&policies)?;
        let seed = unguessable_seed(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
                ^ u64::from(std::process::id()).rotate_left(32),
        );
        let table = SlotTable::open_salted(
            process_store(),
            SHARED_PREFIX,
            policies.local_table.slots,
            seed,
        )
        .map_err(|error| format!("cannot create the shared table: {error:?}"))?;
        let instance = table.instance();
        // One process: the records live typed in its memory, not as shared-data bytes.
        let engine = Engine::new(policies, table);
        let cells = process_cells(engine.table().groups_needed());
        let engine = engine
            .keeping_records_in(cells)
            .map_err(|error| format!("cannot keep the table in memory: {error:?}"))?;
        let policies = &engine.policies;
        let worker = Worker::new(instance, NEXT_WORKER.fetch_add(1, Ordering::Relaxed));
        let metrics = Metrics::define(policies);
        let (cluster, authority) = policies
            .limiter
            .as_ref()
            .map(|l| (l.cluster.clone(), l.authority.clone()))
            .unwrap_or_default();
        // SAFETY: `envoy` is the configuration being created (its hook runs now).
        let scheduler =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(envoy) };
        if scheduler.is_null() {
            return Err("Envoy gave no scheduler for the configuration".into());
        }
        let scheduler = Scheduler(scheduler);
        Ok(Arc::new(NativeConfig {
            envoy: ConfigHandle(envoy),
            engine,
            metrics,
            worker: Mutex::new(worker),
            parked: Mutex::new(HashMap::new()),
            scheduler,
            flush_pending: AtomicBool::new(false),
            ticker: Ticker::new(scheduler),
            cluster,
            authority,
        }))
    }

    pub fn worker(&self) -> MutexGuard<'_, Worker> {
        lock(&self.worker)
    }

    /// Has the main thread send what was queued (many requests, one wake-up).
    pub fn wake(&self) -> bool {
        if self.engine.limiter().is_none() {
            return false;
        }
        if !self.flush_pending.swap(true, Ordering::AcqRel) {
            // SAFETY: the scheduler lives until `shutdown`, after every filter is gone.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                    self.scheduler.0,
                    EVENT_FLUSH,
                )
            };
        }
        true
    }

    /// A scheduler event, on the main thread.
    pub fn on_scheduled(&self, event: u64) {
        let host = self.main_host();
        let ctx = self.ctx(&host);
        let mut worker = self.worker();
        match event {
            EVENT_FLUSH => {
                self.flush_pending.store(false, Ordering::Release);
                worker.flush(&ctx);
            }
            EVENT_TICK => {
                self.ticker.pending.store(false, Ordering::Release);
                worker.tick(&ctx);
            }
            _ => {}
        }
    }

    /// A callout's answer, on the main thread.
    pub fn on_callout_done(&self, callout: u64, status: Option<u32>, body: &[u8]) {
        let Ok(token) = u32::try_from(callout) else {
            return;
        };
        let host = self.main_host();
        let ctx = self.ctx(&host);
        self.worker().complete(token, status, body, &ctx);
    }

    fn ctx<'a>(&'a self, host: &'a MainHost<'a>) -> Ctx<'a, ProcessSharedData, MainHost<'a>> {
        Ctx {
            engine: &self.engine,
            store: process_store(),
            metrics: &self.metrics,
            host,
            now_ms: now_ms(),
        }
    }

    pub fn store(&self) -> &'static ProcessSharedData {
        process_store()
    }

    pub fn main_host(&self) -> MainHost<'_> {
        MainHost { config: self }
    }

    /// The configuration is going away: the ticker stops before its scheduler is deleted.
    pub fn shutdown(&self) {
        self.ticker.stop();
        // SAFETY: nothing commits to the scheduler any more (the ticker is joined, every
        // filter of this configuration is gone).
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.scheduler.0)
        };
    }
}

/// The host as the worker sees it: callouts are the configuration's, on the main thread.
pub struct MainHost<'a> {
    config: &'a NativeConfig,
}

impl MainHost<'_> {
    fn settle(&self, context_id: u32, outcome: Outcome) -> bool {
        let mut parked = lock(&self.config.parked);
        let Some(slot) = parked.get_mut(&context_id) else {
            return false;
        };
        slot.outcome = Some(outcome);
        // SAFETY: the slot's scheduler is deleted only after the slot is removed, under this
        // lock.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(
                slot.scheduler.0,
                u64::from(context_id),
            )
        };
        true
    }
}

impl Host for MainHost<'_> {
    fn dispatch(&self, path: &str, body: &[u8], timeout_ms: u64) -> Result<u32, String> {
        let mut headers = [
            abi::ModuleHttpHeader::of(":method", "POST"),
            abi::ModuleHttpHeader::of(":path", path),
            abi::ModuleHttpHeader::of("host", &self.config.authority),
            abi::ModuleHttpHeader::of("content-type", "application/json"),
        ];
        let mut id = 0u64;
        // SAFETY: called on the main thread during a hook of this configuration; every buffer
        // outlives the call.
        let result = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.config.envoy.0,
                &mut id,
                ModuleBuffer::of(self.config.cluster.as_bytes()),
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                timeout_ms.max(1),
            )
        };
        if result != abi::CALLOUT_INIT_SUCCESS {
            return Err(format!(
                "dispatch to cluster `{}` refused (result {result})",
                self.config.cluster
            ));
        }
        u32::try_from(id).map_err(|_| format!("callout id {id} out of range"))
    }

    fn resume(&self, context_id: u32, request_headers: &[(String, String)]) -> bool {
        self.settle(context_id, Outcome::Resume(request_headers.to_vec()))
    }

    fn reply(&self, context_id: u32, reply: &LocalReply) -> bool {
        self.settle(context_id, Outcome::Reply(reply.clone()))
    }

    fn set_tick(&self, period_ms: u64) {
        self.config.ticker.set(period_ms);
    }
}

/// Wakes the main thread every period while the worker asks for a tick.
struct Ticker {
    period_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    pending: Arc<AtomicBool>,
    scheduler: Scheduler,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Ticker {
    fn new(scheduler: Scheduler) -> Self {
        Self {
            period_ms: Arc::new(AtomicU64::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            pending: Arc::new(AtomicBool::new(false)),
            scheduler,
            thread: Mutex::new(None),
        }
    }

    fn set(&self, period_ms: u64) {
        self.period_ms.store(period_ms, Ordering::Release);
        let mut thread = lock(&self.thread);
        match thread.as_ref() {
            Some(handle) => handle.thread().unpark(),
            None if period_ms > 0 => *thread = self.spawn(),
            None => {}
        }
    }

    fn spawn(&self) -> Option<JoinHandle<()>> {
        let (period_ms, stop, pending) = (
            self.period_ms.clone(),
            self.stop.clone(),
            self.pending.clone(),
        );
        let scheduler = self.scheduler;
        let spawned = std::thread::Builder::new()
            .name("tollgate-ticker".into())
            .spawn(move || {
                let scheduler = scheduler;
                while !stop.load(Ordering::Acquire) {
                    let period = period_ms.load(Ordering::Acquire);
                    if period == 0 {
                        std::thread::park();
                        continue;
                    }
                    std::thread::park_timeout(Duration::from_millis(period));
                    if stop.load(Ordering::Acquire) || period_ms.load(Ordering::Acquire) == 0 {
                        continue;
                    }
                    if !pending.swap(true, Ordering::AcqRel) {
                        // SAFETY: the scheduler is deleted only after this thread is joined.
                        unsafe {
                            abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                                scheduler.0,
                                EVENT_TICK,
                            )
                        };
                    }
                }
            });
        match spawned {
            Ok(handle) => Some(handle),
            Err(error) => {
                log::error!("cannot start the ticker thread: {error}");
                None
            }
        }
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(handle) = lock(&self.thread).take() {
            handle.thread().unpark();
            let _ = handle.join();
        }
    }
}

/// The `:status` and body of a callout's answer.
///
/// # Safety
/// The arrays must be Envoy's, valid during the hook.
pub unsafe fn callout_answer(
    headers: *const abi::EnvoyHttpHeader,
    headers_size: usize,
    chunks: *const abi::EnvoyBuffer,
    chunks_size: usize,
) -> (Option<u32>, Vec<u8>) {
    let mut status = None;
    if !headers.is_null() {
        // SAFETY: Envoy passes `headers_size` headers.
        let headers = unsafe { std::slice::from_raw_parts(headers, headers_size) };
        for header in headers {
            let key = abi::EnvoyBuffer {
                ptr: header.key_ptr,
                length: header.key_length,
            };
            // SAFETY: Envoy's buffers, valid during the hook.
            if unsafe { key.bytes() } == b":status" {
                let value = abi::EnvoyBuffer {
                    ptr: header.value_ptr,
                    length: header.value_length,
                };
                // SAFETY: as above.
                let value = unsafe { value.bytes() };
                status = std::str::from_utf8(value).ok().and_then(|v| v.parse().ok());
            }
        }
    }
    let mut body = Vec::new();
    if !chunks.is_null() {
        // SAFETY: Envoy passes `chunks_size` buffers.
        let chunks = unsafe { std::slice::from_raw_parts(chunks, chunks_size) };
        for chunk in chunks {
            // SAFETY: as above.
            let bytes = unsafe { chunk.bytes() };
            if body.len() + bytes.len() > MAX_BODY_BYTES {
                // Too big to be an answer of ours: read as no answer.
                return (status, Vec::new());
            }
            body.extend_from_slice(bytes);
        }
    }
    (status, body)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::native_limits;
    use tollgate_core::policy::Policies;

    fn refusal(extra: &str) -> Option<String> {
        let doc =
            format!(r#"{{"policies":[{{"name":"p","key":[{{"header":"x-tenant"}}],{extra}}}]}}"#);
        native_limits(&Policies::from_json(doc.as_bytes()).unwrap()).err()
    }

    /// What the dynamic-module ABI cannot read (a verified JWT's claims) is refused at load,
    /// naming the field, wherever a policy would read it; a header in its place loads.
    #[test]
    fn claims_are_refused_wherever_a_policy_reads_them() {
        let limits = |by: &str| {
            format!(
                r#""limits":{{"by":{by},"values":{{"pro":{{"rate":{{"units":5,"per":"1s"}},"burst":5}}}},
                    "default":{{"rate":{{"units":1,"per":"1s"}},"burst":1}}}}"#
            )
        };
        let rate = r#""rate":{"units":5,"per":"1s"},"burst":5"#;
        for (extra, field) in [
            (
                limits(r#"{"jwt_claim":{"claim":"plan"}}"#),
                "policies[0].limits.by.jwt_claim",
            ),
            (
                format!(r#"{rate},"when":[{{"jwt_claim":{{"claim":"plan"}},"equals":"pro"}}]"#),
                "policies[0].when[0].jwt_claim",
            ),
        ] {
            let refused = refusal(&extra).expect(field);
            assert!(refused.contains(field), "{refused}");
        }
        let keyed = format!(r#"{rate},"key":[{{"jwt_claim":{{"claim":"sub"}}}}]"#);
        let doc = format!(r#"{{"policies":[{{"name":"p",{keyed}}}]}}"#);
        let refused = native_limits(&Policies::from_json(doc.as_bytes()).unwrap()).unwrap_err();
        assert!(refused.contains("key.jwt_claim"), "{refused}");
        assert_eq!(refusal(&limits(r#"{"header":"x-plan"}"#)), None);
    }
}
