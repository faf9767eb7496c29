//! tollgate as a native Envoy HTTP filter: a dynamic module (`envoy.filters.http.dynamic_modules`)
//! over the same engine, policy document and limiter protocol as the proxy-wasm filter, for
//! gateways that control their Envoy binary (Istio keeps the wasm filter).
//!
//! `abi` declares the Envoy callbacks used, `hooks` exports the event hooks Envoy calls (none
//! lets a panic cross into Envoy), `config` holds one filter configuration and its worker,
//! `filter` one request, `shared` the process-wide table, `stats` the metrics, `log` the log.
//!
//! Every `unsafe` block says why it is sound (`// SAFETY:`), which clippy checks.

#![deny(clippy::undocumented_unsafe_blocks)]

mod abi;
mod config;
mod filter;
mod hooks;
mod log;
mod shared;
mod stats;
