//! The tollgate proxy-wasm HTTP filter (`tollgate.wasm`): the glue between Envoy's proxy-wasm
//! ABI and the host-neutral engine (`tollgate-engine`). `filter` holds the root and HTTP
//! contexts, `host` the shared data and metrics hostcalls. A native build of the workspace
//! compiles this crate empty.

#![forbid(unsafe_code)]

#[cfg(target_arch = "wasm32")]
mod filter;
#[cfg(target_arch = "wasm32")]
mod host;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    // Every VM of the process sends its stats through the same hostcalls.
    let _ = tollgate_engine::metrics::sink::install(&host::HostMetrics);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(filter::Root::new(context_id))
    });
}}
