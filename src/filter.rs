//! The proxy-wasm glue: reads the plugin configuration, opens the shared bucket table, and for
//! each request hands the engine what it reads through `proxy_wasm::hostcalls` (the calls that
//! return `Result`; the SDK's trait helpers unwrap, and a panic would kill the worker's VM).

use crate::engine::{check_supported, Engine, SHARED_PREFIX};
use crate::metrics::Metrics;
use crate::request::{RequestFacts, RequestSource};
use crate::shared::HostSharedData;
use crate::table::SlotTable;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, MapType};
use std::rc::Rc;
use std::time::UNIX_EPOCH;
use tollgate_core::policy::{authority_host, Policies};

/// Largest plugin configuration read.
const MAX_CONFIG_BYTES: usize = 4 * 1024 * 1024;

struct Configured {
    engine: Engine,
    metrics: Metrics,
}

/// One per VM (per worker): owns the configuration.
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
        check_supported(&policies)?;
        let seed = now_nanos() ^ u64::from(self.context_id).rotate_left(32);
        let table = SlotTable::open(
            &HostSharedData,
            SHARED_PREFIX,
            policies.local_table.slots,
            seed,
        )
        .map_err(|error| format!("cannot create the shared bucket table: {error:?}"))?;
        let metrics = Metrics::define(&policies);
        Ok(Configured {
            engine: Engine::new(policies, table),
            metrics,
        })
    }
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        match self.configure() {
            Ok(configured) => {
                log::info!(
                    "tollgate: {} policies loaded (version {}), local table of {} slots",
                    configured.engine.policies.policies.len(),
                    configured.engine.policies.version,
                    configured.engine.policies.local_table.slots
                );
                self.configured = Some(Rc::new(configured));
                true
            }
            Err(reason) => {
                log::error!("tollgate: invalid plugin configuration: {reason}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Http {
            configured: self.configured.clone(),
            response_headers: Vec::new(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// One per request.
struct Http {
    configured: Option<Rc<Configured>>,
    response_headers: Vec<(String, String)>,
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(configured) = self.configured.clone() else {
            return Action::Continue;
        };
        let source = HostRequest;
        let facts = RequestFacts {
            method: source.header_text(":method"),
            path: source.header_text(":path"),
            host: authority_host(&source.header_text(":authority")),
        };
        let now_ms = now_nanos() / 1_000_000;
        let evaluation = configured
            .engine
            .evaluate(&facts, &source, &HostSharedData, now_ms);
        configured.metrics.record(&evaluation);
        match evaluation.reply {
            Some(reply) => {
                let headers: Vec<(&str, &str)> = reply
                    .headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                if let Err(status) = hostcalls::send_http_response(
                    reply.status,
                    headers,
                    Some(reply.body.as_bytes()),
                ) {
                    log::warn!("tollgate: cannot send local reply: {status:?}");
                    return Action::Continue;
                }
                Action::Pause
            }
            None => {
                self.response_headers = evaluation.response_headers;
                Action::Continue
            }
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        for (name, value) in std::mem::take(&mut self.response_headers) {
            let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, &name, &value);
        }
        Action::Continue
    }
}

/// The current request, read with hostcalls that cannot panic on hostile bytes (the `_bytes`
/// variants: the string ones unwrap UTF-8).
struct HostRequest;

impl HostRequest {
    fn header_text(&self, name: &str) -> String {
        self.header(name)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default()
    }
}

impl RequestSource for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }
}

fn now_nanos() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
