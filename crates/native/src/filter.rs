//! One request in the native module: the host-neutral `tollgate_engine::stream::Stream` over Envoy's
//! dynamic-module callbacks. Hooks run on the request's worker thread.

use crate::abi::{self, EnvoyBuffer, EnvoyHttpHeader, FilterEnvoyPtr, ModuleBuffer};
use crate::config::{lock, now_ms, MainHost, NativeConfig, Outcome, Parked, Scheduler};
use crate::shared::ProcessSharedData;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use tollgate_core::policy::authority_host;
use tollgate_core::response::{self, LocalReply};
use tollgate_engine::engine::{when_table_fails, Engine, Outcome as PolicyOutcome};
use tollgate_engine::metrics::Metrics;
use tollgate_engine::request::RequestSource;
use tollgate_engine::stream::{Flow, Instance, Stream, StreamHost};
use tollgate_engine::worker::Worker;

/// Request ids of the process (the worker holds requests by id).
static NEXT_ID: AtomicU32 = AtomicU32::new(1);

pub struct NativeFilter {
    pub config: Arc<NativeConfig>,
    stream: Stream,
    /// A held request was resumed or answered (by the worker's outcome or by a failure mode
    /// after a panic): nothing is left to decide for it.
    released: bool,
}

impl NativeFilter {
    pub fn new(config: Arc<NativeConfig>) -> Self {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Self {
            config,
            stream: Stream::new(id),
            released: false,
        }
    }

    pub fn on_request_headers(&mut self, envoy: FilterEnvoyPtr, end_of_stream: bool) -> Flow {
        let (view, request) = parts(&self.config, self.stream.id, envoy);
        self.stream
            .on_request_headers(&view, &request, end_of_stream)
    }

    pub fn on_request_body(&mut self, envoy: FilterEnvoyPtr, end_of_stream: bool) -> Flow {
        let (view, request) = parts(&self.config, self.stream.id, envoy);
        let size = request.body_size(abi::BODY_BUFFERED_REQUEST)
            + request.body_size(abi::BODY_RECEIVED_REQUEST);
        self.stream
            .on_request_body(&view, &request, size, end_of_stream)
    }

    pub fn on_request_trailers(&mut self, envoy: FilterEnvoyPtr) -> Flow {
        let (view, request) = parts(&self.config, self.stream.id, envoy);
        self.stream.on_request_trailers(&view, &request)
    }

    pub fn on_response_headers(&mut self, envoy: FilterEnvoyPtr, end_of_stream: bool) {
        let (view, request) = parts(&self.config, self.stream.id, envoy);
        self.stream
            .on_response_headers(&view, &request, end_of_stream);
    }

    pub fn on_response_body(&mut self, envoy: FilterEnvoyPtr, end_of_stream: bool) {
        // Most responses settle nothing: no call to Envoy for the chunk's size.
        if !self.stream.reads_response_body() {
            return;
        }
        let (view, request) = parts(&self.config, self.stream.id, envoy);
        let size = request.body_size(abi::BODY_RECEIVED_RESPONSE);
        self.stream
            .on_response_body(&view, &request, size, end_of_stream);
    }

    pub fn on_response_trailers(&mut self, envoy: FilterEnvoyPtr) {
        let (view, request) = parts(&self.config, self.stream.id, envoy);
        self.stream.on_response_trailers(&view, &request);
    }

    /// The stream ended (or the filter goes away): settle, release, unpark.
    pub fn finish(&mut self, envoy: FilterEnvoyPtr) {
        let (view, _) = parts(&self.config, self.stream.id, envoy);
        self.stream.finish(&view);
        // The worker forgot the request; an outcome it left that no hook will act on goes
        // with its scheduler (only a request that was held can have one).
        if !self.stream.was_held() {
            return;
        }
        if let Some(slot) = lock(&self.config.parked).remove(&self.stream.id) {
            // SAFETY: created for this request; removed from the map under the lock the main
            // thread commits under, so nothing commits to it any more.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(slot.scheduler.0)
            };
        }
    }

    /// The worker decided for this held request: act on it on this thread. `true`: the request
    /// is to go on, and the caller continues it once it no longer borrows the filter
    /// (`continue_decoding` runs the rest of the filter chain inline, and a reply the router
    /// sends at once comes back through this filter's response hooks within that call).
    pub fn on_scheduled(&mut self, envoy: FilterEnvoyPtr) -> bool {
        let outcome = lock(&self.config.parked)
            .get_mut(&self.stream.id)
            .and_then(|slot| slot.outcome.take());
        if outcome.is_some() {
            self.released = true;
        }
        let resume = match outcome {
            // SAFETY: `envoy` is this filter, in its own hook.
            Some(Outcome::Resume(request_headers)) => {
                let request = Request::new(envoy);
                for (name, value) in &request_headers {
                    request.set_request_header(name, Some(value));
                }
                true
            }
            Some(Outcome::Reply(reply)) => {
                Request::new(envoy).send_reply(&reply);
                false
            }
            None => false,
        };
        // A request the worker let go no longer needs its scheduler.
        let (view, _) = parts(&self.config, self.stream.id, envoy);
        view.with_worker(|_| ());
        resume
    }

    /// After a panic in the scheduled hook: a request still held takes its policies' failure
    /// mode (`closed` answers 503, `open` lets it on), once; one already resumed or answered
    /// is left alone. `true`: the caller continues the request, as for [`Self::on_scheduled`].
    pub fn release_after_panic(&mut self, envoy: FilterEnvoyPtr) -> bool {
        if std::mem::replace(&mut self.released, true) {
            return false;
        }
        after_panic(&self.config, envoy) == Flow::Continue
    }
}

/// What a request gets when a hook deciding it panicked (the panic was caught): the failure
/// mode of the policies whose match (hosts, routes) it meets, as when the table fails. A
/// policy in `closed` mode, or in `local` mode whose `then` is `closed`, answers 503 with the
/// unavailable body; `open` (or `local` then `open`, or a shadow policy) lets it on; the
/// strictest decides. `local` takes its `then` at once: its fallback budget lives in the
/// engine that just panicked. A request no policy matches goes on.
pub fn after_panic(config: &NativeConfig, envoy: FilterEnvoyPtr) -> Flow {
    let request = Request::new(envoy);
    let text = |name: &str| {
        request
            .header(name)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default()
    };
    let authority = text(":authority");
    let (host, method, path) = (authority_host(&authority), text(":method"), text(":path"));
    let policies = &config.engine.policies.policies;
    let outcomes: Vec<(usize, PolicyOutcome)> = policies
        .iter()
        .enumerate()
        .filter(|(_, p)| p.match_request(&host, &method, &path).is_some())
        .map(|(index, p)| (index, when_table_fails(p)))
        .collect();
    config.metrics.panicked(&outcomes);
    let closed = outcomes
        .iter()
        .find(|(_, outcome)| *outcome == PolicyOutcome::FailClosed)
        .and_then(|(index, _)| policies.get(*index));
    match closed {
        Some(policy) => {
            request.send_reply(&response::limiter_unavailable(&policy.name));
            Flow::Pause
        }
        None => Flow::Continue,
    }
}

/// The last resort when even [`after_panic`] panicked: the request is refused (503, the
/// unavailable body without a policy name), never let through unlimited.
pub fn refuse_after_panic(envoy: FilterEnvoyPtr) -> Flow {
    Request::new(envoy).send_reply(&response::limiter_unavailable(""));
    Flow::Pause
}

/// Test builds only (feature `panic-injection`): a hook panics when the request's
/// `x-tollgate-panic` header names it (`request_headers`, `request_body`, `request_trailers`),
/// so the end-to-end suite can check what a caught panic does. Production builds have no
/// such header.
#[cfg(feature = "panic-injection")]
#[allow(clippy::panic)]
pub fn inject_panic(envoy: FilterEnvoyPtr, hook: &str) {
    let request = Request::new(envoy);
    if request.header("x-tollgate-panic").as_deref() == Some(hook.as_bytes()) {
        panic!("panic injected in {hook}");
    }
}

fn parts(config: &NativeConfig, id: u32, envoy: FilterEnvoyPtr) -> (View<'_>, Request) {
    (View { config, envoy, id }, Request::new(envoy))
}

/// The configuration as one request sees it (its hooks know the request's Envoy pointer, so
/// the worker can reach the request when it holds it).
struct View<'a> {
    config: &'a NativeConfig,
    envoy: FilterEnvoyPtr,
    id: u32,
}

impl<'a> Instance for View<'a> {
    type Store = ProcessSharedData;
    type WorkerHost = MainHost<'a>;

    fn engine(&self) -> &Engine {
        &self.config.engine
    }

    fn metrics(&self) -> &Metrics {
        &self.config.metrics
    }

    fn store(&self) -> &ProcessSharedData {
        self.config.store()
    }

    fn with_worker<R>(&self, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
        let mut worker = self.config.worker();
        let result = f(&mut worker);
        // Under the worker's lock, so the main thread cannot try to reach a request the worker
        // holds before its scheduler is there.
        let mut parked = lock(&self.config.parked);
        if worker.holds(self.id) {
            if let std::collections::hash_map::Entry::Vacant(entry) = parked.entry(self.id) {
                // SAFETY: `envoy` is this request's filter, in its own hook.
                let scheduler = unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_scheduler_new(self.envoy)
                };
                if !scheduler.is_null() {
                    entry.insert(Parked {
                        scheduler: Scheduler(scheduler),
                        outcome: None,
                    });
                }
            }
        } else if parked
            .get(&self.id)
            .is_some_and(|slot| slot.outcome.is_none())
        {
            if let Some(slot) = parked.remove(&self.id) {
                // SAFETY: created above for this request; removed from the map first, under
                // the lock the main thread commits under.
                unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(
                        slot.scheduler.0,
                    )
                };
            }
        }
        Some(result)
    }

    fn wake(&self) -> bool {
        self.config.wake()
    }

    fn worker_host(&self) -> MainHost<'a> {
        // A request uses only its `set_tick` (a shaped request sleeps): the ticker's atomics.
        self.config.main_host()
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }
}

thread_local! {
    /// The request headers' list, kept per thread so that reading them allocates nothing.
    static HEADERS: RefCell<Vec<EnvoyHttpHeader>> = const { RefCell::new(Vec::new()) };
}

/// The request, through its filter's callbacks.
struct Request {
    envoy: FilterEnvoyPtr,
    /// The request headers, fetched from Envoy in one call at the first lookup of a hook and
    /// searched here: Envoy's lookup of one header by name costs about what handing over all
    /// of them does (in callgrind on Envoy 1.40: ~3,400 instructions for a custom header,
    /// ~450 for a pseudo-header; ~960 for the whole list of a benchmark request, the module's
    /// side included), and a request reads several (method, path, host, its key's parts).
    /// The pointers are Envoy's, valid while the hook runs: a `Request` lives for one hook.
    request_headers: RefCell<Option<Vec<EnvoyHttpHeader>>>,
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(mut headers) = self.request_headers.get_mut().take() {
            headers.clear();
            HEADERS.with(|kept| {
                if let Ok(mut kept) = kept.try_borrow_mut() {
                    *kept = headers;
                }
            });
        }
    }
}

impl Request {
    fn new(envoy: FilterEnvoyPtr) -> Self {
        Self {
            envoy,
            request_headers: RefCell::new(None),
        }
    }

    fn header_of(&self, kind: u32, name: &str) -> Option<Vec<u8>> {
        self.with_header_of(kind, name, |value| value.map(<[u8]>::to_vec))
    }

    /// `f` of a request header's first value, found in the list of all request headers
    /// (fetched once per hook), read in place in Envoy's buffer. Names compare without case,
    /// as Envoy's own lookup does.
    fn with_request_header<R>(&self, name: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        let found = {
            let mut cache = self.request_headers.borrow_mut();
            let headers = cache.get_or_insert_with(|| self.fetch_request_headers());
            headers.iter().find_map(|h| {
                // SAFETY: Envoy's buffers, valid during the hook this `Request` lives in.
                let key = unsafe { raw_bytes(h.key_ptr, h.key_length) };
                key.eq_ignore_ascii_case(name.as_bytes()).then(|| {
                    // SAFETY: as for the key.
                    unsafe { raw_bytes(h.value_ptr, h.value_length) }
                })
            })
        };
        f(found)
    }

    fn fetch_request_headers(&self) -> Vec<EnvoyHttpHeader> {
        let mut headers = HEADERS
            .with(|kept| kept.try_borrow_mut().map(|mut k| std::mem::take(&mut *k)))
            .unwrap_or_default();
        headers.clear();
        // SAFETY: `envoy` is the filter of the running hook.
        let count = unsafe {
            abi::envoy_dynamic_module_callback_http_get_headers_size(
                self.envoy,
                abi::HEADER_REQUEST,
            )
        };
        if count == 0 {
            return headers;
        }
        headers.resize(count, EnvoyHttpHeader::NULL);
        // SAFETY: `headers` has room for the `count` headers Envoy writes, as the callback
        // requires; the map does not change between the two calls (same hook, same thread).
        let ok = unsafe {
            abi::envoy_dynamic_module_callback_http_get_headers(
                self.envoy,
                abi::HEADER_REQUEST,
                headers.as_mut_ptr(),
            )
        };
        if !ok {
            headers.clear();
        }
        headers
    }

    /// `f` of a header's first value, read in place in Envoy's buffer (no copy).
    fn with_header_of<R>(&self, kind: u32, name: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        let mut value = EnvoyBuffer::NULL;
        // SAFETY: `envoy` is the filter of the running hook; the value is read (by `f`) before
        // the hook ends.
        let found = unsafe {
            abi::envoy_dynamic_module_callback_http_get_header(
                self.envoy,
                kind,
                ModuleBuffer::of(name.as_bytes()),
                &mut value,
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: Envoy's buffer, valid during the hook, which `f` runs in.
        f((found && !value.ptr.is_null()).then(|| unsafe { value.bytes() }))
    }

    fn body_size(&self, kind: u32) -> usize {
        // SAFETY: as in `header_of`.
        unsafe { abi::envoy_dynamic_module_callback_http_get_body_size(self.envoy, kind) }
    }

    fn body(&self, kind: u32, out: &mut Vec<u8>, max: usize) {
        // SAFETY: as in `header_of`.
        let count = unsafe {
            abi::envoy_dynamic_module_callback_http_get_body_chunks_size(self.envoy, kind)
        };
        if count == 0 {
            return;
        }
        let mut chunks = vec![EnvoyBuffer::NULL; count];
        // SAFETY: `chunks` has room for `count` buffers, as the callback requires.
        if !unsafe {
            abi::envoy_dynamic_module_callback_http_get_body_chunks(
                self.envoy,
                kind,
                chunks.as_mut_ptr(),
            )
        } {
            return;
        }
        for chunk in &chunks {
            // SAFETY: Envoy's buffers, valid during the hook.
            let bytes = unsafe { chunk.bytes() };
            let room = max.saturating_sub(out.len());
            out.extend_from_slice(bytes.get(..room.min(bytes.len())).unwrap_or_default());
        }
    }
}

impl RequestSource for Request {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.with_request_header(name, |value| value.map(<[u8]>::to_vec))
    }

    fn with_header<R>(&self, name: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        self.with_request_header(name, f)
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        let mut value = EnvoyBuffer::NULL;
        let found = match path {
            // SAFETY: as in `header_of`.
            ["source", "address"] => unsafe {
                abi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
                    self.envoy,
                    abi::ATTRIBUTE_SOURCE_ADDRESS,
                    &mut value,
                )
            },
            // Policies with other properties (jwt claims) are refused at load.
            _ => false,
        };
        // SAFETY: Envoy's buffer, valid during the hook.
        (found && !value.ptr.is_null()).then(|| unsafe { value.bytes() }.to_vec())
    }
}

impl StreamHost for Request {
    fn send_reply(&self, reply: &LocalReply) -> bool {
        let mut headers: Vec<abi::ModuleHttpHeader> = reply
            .headers
            .iter()
            .map(|(k, v)| abi::ModuleHttpHeader::of(k, v))
            .collect();
        // SAFETY: as in `header_of`; every buffer outlives the call.
        unsafe {
            abi::envoy_dynamic_module_callback_http_send_response(
                self.envoy,
                reply.status,
                headers.as_mut_ptr(),
                headers.len(),
                ModuleBuffer::of(reply.body.as_bytes()),
                ModuleBuffer::of(b"tollgate"),
            )
        };
        true
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        let mut body = Vec::with_capacity(size);
        self.body(abi::BODY_BUFFERED_REQUEST, &mut body, size);
        self.body(abi::BODY_RECEIVED_REQUEST, &mut body, size);
        Some(body)
    }

    fn add_response_header(&self, name: &str, value: &str) {
        // SAFETY: as in `header_of`.
        unsafe {
            abi::envoy_dynamic_module_callback_http_add_header(
                self.envoy,
                abi::HEADER_RESPONSE,
                ModuleBuffer::of(name.as_bytes()),
                ModuleBuffer::of(value.as_bytes()),
            )
        };
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) {
        let value = value.map_or(ModuleBuffer::NULL, |v| ModuleBuffer::of(v.as_bytes()));
        // The headers read so far point into the map this changes: read them again.
        if let Ok(mut cache) = self.request_headers.try_borrow_mut() {
            *cache = None;
        }
        // SAFETY: as in `header_of`; a null value removes the header (the callback's contract,
        // as declared in `abi`). Clearing the route cache has the router choose the route
        // again, with the new header.
        unsafe {
            abi::envoy_dynamic_module_callback_http_set_header(
                self.envoy,
                abi::HEADER_REQUEST,
                ModuleBuffer::of(name.as_bytes()),
                value,
            );
            abi::envoy_dynamic_module_callback_http_clear_route_cache(self.envoy);
        }
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.header_of(abi::HEADER_RESPONSE, name)
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        let mut body = Vec::with_capacity(size);
        self.body(abi::BODY_RECEIVED_RESPONSE, &mut body, size);
        Some(body)
    }

    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        self.header_of(abi::TRAILER_RESPONSE, name)
    }
}

/// The bytes at `ptr` (empty for null or zero length).
///
/// # Safety
/// `ptr..ptr + len` must be readable for the caller's chosen lifetime (Envoy's buffers are,
/// during the hook that handed them over).
unsafe fn raw_bytes<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if ptr.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: the caller's guarantee.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}
