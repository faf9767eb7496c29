//! The tollgate proxy-wasm HTTP filter.
//!
//! `engine` decides (policies, keys, local buckets, failure and shadow modes) without any
//! proxy-wasm call, so it is unit-tested natively; `filter` is the thin glue to Envoy.

pub mod engine;
pub mod filter;
pub mod metrics;
pub mod request;
pub mod shared;
pub mod table;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(filter::Root::new(context_id))
    });
}}
