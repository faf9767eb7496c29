//! The proxy-wasm glue: reads the plugin configuration, opens the shared table, and for each
//! request hands the engine what it reads through `proxy_wasm::hostcalls` (the calls that
//! return `Result`; the SDK's trait helpers unwrap, and a panic would kill the worker's VM).
//! The root context owns the worker's callouts (see `worker`).

use crate::host::HostSharedData;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};
use tollgate_core::policy::Policies;
use tollgate_core::protocol::MAX_BODY_BYTES;
use tollgate_core::response::LocalReply;
use tollgate_engine::engine::{Engine, SHARED_PREFIX};
use tollgate_engine::metrics::Metrics;
use tollgate_engine::request::RequestSource;
use tollgate_engine::shared::{SharedData, WriteError};
use tollgate_engine::stream::{Flow, Instance, Stream, StreamHost};
use tollgate_engine::table::{unguessable_seed, SlotTable};
use tollgate_engine::worker::{Ctx, Host, Worker};

/// Largest plugin configuration read.
const MAX_CONFIG_BYTES: usize = 4 * 1024 * 1024;

struct Configured {
    engine: Engine,
    metrics: Metrics,
    worker: RefCell<Worker>,
    queue: Option<u32>,
    /// The root context of this VM (whose tick wakes shaped requests).
    root_id: u32,
}

impl Configured {
    /// The worker's view of one root-context event, at the host's current time.
    fn ctx<'a>(&'a self, host: &'a RootHost) -> Ctx<'a, HostSharedData, RootHost> {
        Ctx {
            engine: &self.engine,
            store: &HostSharedData,
            metrics: &self.metrics,
            host,
            now_ms: now_ms(),
        }
    }
}

/// One per VM (per worker): owns the configuration and the worker's callouts.
pub struct Root {
    context_id: u32,
    configured: Option<Rc<Configured>>,
}

impl Root {
    pub fn new(context_id: u32) -> Self {
        Self {
            context_id,
            configured: None,
        }
    }

    fn configure(&self) -> Result<Configured, String> {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, MAX_CONFIG_BYTES)
            .map_err(|status| format!("cannot read plugin configuration: {status:?}"))?
            .ok_or("plugin configuration is empty: pass the policy document as `configuration`")?;
        let policies = Policies::from_json(&bytes).map_err(|errors| errors.to_string())?;
        let seed = unguessable_seed(now_nanos() ^ u64::from(self.context_id).rotate_left(32));
        let table = SlotTable::open(
            &HostSharedData,
            SHARED_PREFIX,
            policies.local_table.slots,
            seed,
        )
        .map_err(|error| format!("cannot create the shared table: {error:?}"))?;
        let instance = table.instance();
        let worker_index = next_worker_index(&HostSharedData);
        let queue = if policies.limiter.is_some() {
            let name = format!("{SHARED_PREFIX}queue/{instance:016x}/{worker_index}");
            Some(
                hostcalls::register_shared_queue(&name)
                    .map_err(|status| format!("cannot register the worker queue: {status:?}"))?,
            )
        } else {
            None
        };
        let metrics = Metrics::define(&policies);
        Ok(Configured {
            engine: Engine::new(policies, table),
            metrics,
            worker: RefCell::new(Worker::new(instance, worker_index)),
            queue,
            root_id: self.context_id,
        })
    }

    fn host(&self, configured: &Configured) -> RootHost {
        configured.root_host()
    }
}

impl Instance for Configured {
    type Store = HostSharedData;
    type WorkerHost = RootHost;

    fn engine(&self) -> &Engine {
        &self.engine
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn store(&self) -> &HostSharedData {
        &HostSharedData
    }

    fn with_worker<R>(&self, f: impl FnOnce(&mut Worker) -> R) -> Option<R> {
        self.worker
            .try_borrow_mut()
            .ok()
            .map(|mut worker| f(&mut worker))
    }

    fn wake(&self) -> bool {
        wake(self)
    }

    fn worker_host(&self) -> RootHost {
        self.root_host()
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }
}

impl Configured {
    fn root_host(&self) -> RootHost {
        let configured = self;
        RootHost {
            root_id: configured.root_id,
            cluster: configured
                .engine
                .limiter()
                .map(|l| l.cluster.clone())
                .unwrap_or_default(),
            authority: configured
                .engine
                .limiter()
                .map(|l| l.authority.clone())
                .unwrap_or_default(),
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(configured) = self.configured.clone() else {
            return;
        };
        // A reset or failed callout has no headers; reading one header then would panic in the SDK.
        let status = if num_headers == 0 {
            None
        } else {
            hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders)
                .ok()
                .and_then(|headers| {
                    headers
                        .into_iter()
                        .find(|(name, _)| name == ":status")
                        .and_then(|(_, value)| std::str::from_utf8(&value).ok()?.parse().ok())
                })
        };
        let body = if body_size > 0 && body_size <= MAX_BODY_BYTES {
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let host = self.host(&configured);
        if let Ok(mut worker) = configured.worker.try_borrow_mut() {
            worker.complete(token_id, status, &body, &configured.ctx(&host));
        };
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        match self.configure() {
            Ok(configured) => {
                log::info!(
                    "{} policies loaded (version {}), shared table of {} slots",
                    configured.engine.policies.policies.len(),
                    configured.engine.policies.version,
                    configured.engine.policies.local_table.slots
                );
                self.configured = Some(Rc::new(configured));
                true
            }
            Err(reason) => {
                log::error!("invalid plugin configuration: {reason}");
                false
            }
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        let Some(configured) = self.configured.clone() else {
            return;
        };
        // Wake-ups carry no data; drain them all, then dispatch what the requests queued.
        while let Ok(Some(_)) = hostcalls::dequeue_shared_queue(queue_id) {}
        let host = self.host(&configured);
        if let Ok(mut worker) = configured.worker.try_borrow_mut() {
            worker.flush(&configured.ctx(&host));
        };
    }

    fn on_tick(&mut self) {
        let Some(configured) = self.configured.clone() else {
            return;
        };
        let host = self.host(&configured);
        if let Ok(mut worker) = configured.worker.try_borrow_mut() {
            worker.tick(&configured.ctx(&host));
        };
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http {
            stream: Stream::new(context_id),
            configured: self.configured.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The host as the root context sees it: callouts are the root's (they outlive requests), and
/// after touching a request the effective context goes back to the root.
struct RootHost {
    root_id: u32,
    cluster: String,
    authority: String,
}

impl Host for RootHost {
    fn dispatch(&self, path: &str, body: &[u8], timeout_ms: u64) -> Result<u32, String> {
        let headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", self.authority.as_str()),
            ("content-type", "application/json"),
        ];
        hostcalls::dispatch_http_call(
            &self.cluster,
            headers,
            Some(body),
            vec![],
            Duration::from_millis(timeout_ms.max(1)),
        )
        .map_err(|status| format!("dispatch to cluster `{}` refused: {status:?}", self.cluster))
    }

    fn resume(&self, context_id: u32, request_headers: &[(String, String)]) -> bool {
        let done = hostcalls::set_effective_context(context_id).is_ok()
            && request_headers.iter().all(|(name, value)| {
                // Envoy clears the route cache when a filter changes a request header.
                hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)).is_ok()
            })
            && hostcalls::resume_http_request().is_ok();
        let _ = hostcalls::set_effective_context(self.root_id);
        done
    }

    fn reply(&self, context_id: u32, reply: &LocalReply) -> bool {
        let done = hostcalls::set_effective_context(context_id).is_ok() && send_reply(reply);
        let _ = hostcalls::set_effective_context(self.root_id);
        done
    }

    fn set_tick(&self, period_ms: u64) {
        let _ = hostcalls::set_tick_period(Duration::from_millis(period_ms));
    }
}

fn send_reply(reply: &LocalReply) -> bool {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    match hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes())) {
        Ok(()) => true,
        Err(status) => {
            log::warn!("cannot send local reply: {status:?}");
            false
        }
    }
}

/// One per request: the host-neutral [`Stream`] with this VM's configuration.
struct Http {
    stream: Stream,
    configured: Option<Rc<Configured>>,
}

impl Context for Http {}

impl Drop for Http {
    fn drop(&mut self) {
        // A stream Envoy never logged (a VM shutting down) still frees its slots.
        if let Some(configured) = &self.configured {
            self.stream.finish(configured.as_ref());
        }
    }
}

fn action(flow: Flow) -> Action {
    match flow {
        Flow::Continue => Action::Continue,
        Flow::Pause => Action::Pause,
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(configured) = self.configured.clone() else {
            return Action::Continue;
        };
        action(self.stream.on_request_headers(
            configured.as_ref(),
            &HostRequest::default(),
            end_of_stream,
        ))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(configured) = self.configured.clone() else {
            return Action::Continue;
        };
        action(self.stream.on_request_body(
            configured.as_ref(),
            &HostRequest::default(),
            body_size,
            end_of_stream,
        ))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let Some(configured) = self.configured.clone() else {
            return Action::Continue;
        };
        action(
            self.stream
                .on_request_trailers(configured.as_ref(), &HostRequest::default()),
        )
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if let Some(configured) = self.configured.clone() {
            self.stream.on_response_headers(
                configured.as_ref(),
                &HostRequest::default(),
                end_of_stream,
            );
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if let Some(configured) = self.configured.clone() {
            self.stream.on_response_body(
                configured.as_ref(),
                &HostRequest::default(),
                body_size,
                end_of_stream,
            );
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        if let Some(configured) = self.configured.clone() {
            self.stream
                .on_response_trailers(configured.as_ref(), &HostRequest::default());
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Some(configured) = self.configured.clone() {
            self.stream.finish(configured.as_ref());
        }
    }
}

/// Wakes this worker's root context (through its shared queue) to send what was queued.
fn wake(configured: &Configured) -> bool {
    configured
        .queue
        .is_some_and(|queue| hostcalls::enqueue_shared_queue(queue, Some(b"w")).is_ok())
}

/// The current request, read with hostcalls that cannot panic on hostile bytes (the `_bytes`
/// variants: the string ones unwrap UTF-8).
/// The request of the running callback, through proxy-wasm's hostcalls.
#[derive(Default)]
struct HostRequest {
    /// The request headers, fetched in one hostcall at the first lookup of a callback and
    /// searched here: each single-header hostcall is a lookup by name in Envoy plus a call
    /// back into the VM for the value's memory, and a request is keyed on several headers.
    /// A `HostRequest` lives for one callback, so the list is never stale.
    request_headers: RefCell<Option<Headers>>,
}

/// Header names and values as proxy-wasm hands them over.
type Headers = Vec<(String, Vec<u8>)>;

impl HostRequest {
    fn with_request_header<R>(&self, name: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        if let Ok(mut cache) = self.request_headers.try_borrow_mut() {
            if cache.is_none() {
                *cache =
                    Some(hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default());
            }
        }
        // Read through a shared borrow: `f` may read another header (the request line is read
        // in place, one header inside another's reader).
        let cache = self.request_headers.borrow();
        // Envoy's names are lower-case; a policy's may not be (Envoy's own lookup ignores case).
        f(cache.as_ref().and_then(|headers| {
            headers
                .iter()
                .find(|(key, _)| key.eq_ignore_ascii_case(name))
                .map(|(_, value)| value.as_slice())
        }))
    }
}

impl StreamHost for HostRequest {
    fn send_reply(&self, reply: &LocalReply) -> bool {
        send_reply(reply)
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .map(Option::unwrap_or_default)
    }

    fn add_response_header(&self, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) {
        // Envoy's Wasm host clears the route cache on any change to the request headers, so
        // the router chooses the route with this one.
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value);
        if let Ok(mut cache) = self.request_headers.try_borrow_mut() {
            *cache = None;
        }
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
            .ok()
            .flatten()
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
            .ok()
            .flatten()
    }

    fn response_trailer(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseTrailers, name)
            .ok()
            .flatten()
    }
}

impl RequestSource for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.with_request_header(name, |value| value.map(<[u8]>::to_vec))
    }

    fn with_header<R>(&self, name: &str, f: impl FnOnce(Option<&[u8]>) -> R) -> R {
        self.with_request_header(name, f)
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }
}

/// A number unique to this worker among the VMs sharing the vm_id (CAS-incremented counter).
fn next_worker_index(store: &impl SharedData) -> u64 {
    let key = format!("{SHARED_PREFIX}workers");
    for _ in 0..64 {
        let (value, cas) = match store.get(&key) {
            Ok(read) => read,
            Err(_) => break,
        };
        let current = value
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map_or(0, u64::from_le_bytes);
        let next = current.wrapping_add(1);
        // A missing key is created whatever CAS is given; a present one must match.
        match store.set(&key, &next.to_le_bytes(), Some(cas.unwrap_or(u32::MAX))) {
            Ok(()) => return next,
            Err(WriteError::CasMismatch) => continue,
            Err(WriteError::Host) => break,
        }
    }
    now_nanos() & 0xffff
}

fn now_nanos() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn now_ms() -> u64 {
    now_nanos() / 1_000_000
}
