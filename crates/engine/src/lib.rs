//! The filter's engine, whichever host runs it: the proxy-wasm filter (`crates/wasm`) and the
//! Envoy dynamic module (`crates/native`) are thin glue over it.
//!
//! The path of one request, by file:
//! `engine/plan.rs` (which policies apply, their keys and costs) → `engine/step.rs` (the local
//! step: buckets and windows in the shared table; the global step: spending from a lease) →
//! `engine/commit.rs` (all or nothing over the request's policies) → `engine/settle.rs`
//! (what the response says the request cost) → `stream.rs` (one request's life over the host
//! traits) → the host glue. `global` holds the lease rules, `worker` the global stage's
//! callouts, `table` the bounded per-key records shared by Envoy's workers.
//!
//! Nothing here calls a host directly: time comes in as an argument, storage is the
//! [`shared::SharedData`] trait (the two handed on together as a [`shared::StoreAt`]), stats
//! go to the [`metrics::sink`] a host installs, callouts and replies go through the
//! [`worker::Host`], [`stream::Instance`] and [`stream::StreamHost`] traits, so all of it is
//! unit-tested natively.

#![forbid(unsafe_code)]

pub mod engine;
pub mod global;
pub mod metrics;
pub mod request;
pub mod response_usage;
pub mod shared;
pub mod stream;
pub mod table;
pub mod worker;
