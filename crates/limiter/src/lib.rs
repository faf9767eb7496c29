//! tollgate's limiter: the service that owns every global bucket.
//!
//! The filter (one per Envoy worker) leases tokens from it over HTTP in batches
//! (`POST /v1/leases`) and gives unused ones back (`POST /v1/leases/return`). Buckets live in
//! one of three stores behind [`store::Store`]: in this process, in one Redis, or in a Redis
//! Cluster, where each transition is one atomic Redis Function call on Redis' clock.
//!
//! Layout: `server` starts everything ([`serve`]), `http` maps routes onto `service`
//! (validation, units, deadlines, answers), [`store`] holds the buckets, `policies` keeps
//! the policy document current, `metrics` exports what happened, `observe` keeps hot keys and
//! key counts, [`tls`] is the lease listener's mutual TLS, [`config`] is the CLI, [`check`]
//! the policy checker and [`import`] the envoyproxy/ratelimit importer; [`rls`] serves
//! Envoy's RateLimitService (gRPC) from envoyproxy/ratelimit's configuration; [`region`] is the
//! regional mode (`--parent`), leasing global budgets from a parent limiter. Only what the
//! binary and the tests use is public.
//!
//! Lints: unlike the rest of the workspace, indexing and `expect` are allowed here for
//! invariants stated where they are used (`Cargo.toml` says why); `unwrap` stays denied.

#![forbid(unsafe_code)]

pub mod check;
mod clock;
pub mod config;
pub mod explain;
mod http;
pub mod import;
mod metrics;
mod observe;
mod policies;
pub mod region;
pub mod rls;
mod server;
mod service;
pub mod store;
pub mod tls;

pub use observe::HotKeySettings;
pub use server::{serve, RlsServerConfig, Running, ServerConfig, StartError, StoreConfig};
