#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! End-to-end test harness for tollgate.
//!
//! Starts real processes on loopback (Envoy, redis-server, Redis Cluster) and in-process
//! helpers (an HTTP upstream, HTTP clients) so the test files in `tests/tests/*.rs` can
//! exercise both builds of the filter (wasm and native) and the limiter the way production does.
//!
//! Ground rules every helper follows:
//! * loopback only; ports are chosen by the kernel (port 0) or by [`ports::free_port`] with
//!   a retry when the bind races with someone else, so many test binaries and threads can
//!   run at once;
//! * every wait is bounded by a timeout and fails with a message that says what it waited for
//!   (and, for processes, the tail of their log);
//! * child processes are killed and reaped on `Drop`, and also die with the test process
//!   (`PR_SET_PDEATHSIG`) if it is killed before `Drop` can run;
//! * child logs go to `<workspace>/target/e2e-logs/<test-name>-<unique>/`.
//!
//! Control-plane helpers (Envoy admin, Redis commands) are blocking and quick; data-plane
//! helpers ([`client`]) are async (tokio).

pub mod build;
pub mod client;
pub mod clock;
pub mod envoy;
pub mod error;
pub mod http_blocking;
pub mod jwt;
pub mod metered;
pub mod mtls;
pub mod paths;
pub mod pki;
pub mod ports;
pub mod process;
pub mod redis;
pub mod tls_client;
pub mod tollgate;
pub mod upstream;

pub use client::{
    burst, burst_detailed, burst_timed, send, try_burst, try_send, try_send_timeout, RequestSpec,
    Response, Timed,
};
pub use envoy::{render_file, render_template, Envoy, EnvoyOptions};
pub use error::HarnessError;
pub use metered::{
    try_send_streamed, MeteredRequest, MeteredUpstream, StreamedResponse, UsageIn, Wire,
};
pub use ports::free_port;
pub use redis::{
    AclUser, ClusterNode, RedisCluster, RedisOptions, RedisServer, RedisTls, Resp, Role,
};
pub use upstream::{MockResponse, RecordedRequest, Upstream};
