//! The tollgate proxy-wasm HTTP filter.
//!
//! `engine` decides (policies, keys, local buckets, leases of the global budget, failure and
//! shadow modes) and `global` holds the lease rules, both without any proxy-wasm call, so they
//! are unit-tested natively; `stream` is one request's life and `worker` the global stage's
//! callouts, over host traits; `filter` is the proxy-wasm glue (the .wasm only; the native
//! dynamic module is the `tollgate-native` crate).

#![forbid(unsafe_code)]

pub mod engine;
#[cfg(target_arch = "wasm32")]
pub mod filter;
pub mod global;
pub mod metrics;
pub mod request;
pub mod response_usage;
pub mod shared;
pub mod stream;
pub mod table;
pub mod worker;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(filter::Root::new(context_id))
    });
}}
