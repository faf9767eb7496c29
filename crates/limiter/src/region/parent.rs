//! The regional limiter's client of its parent limiter: the same lease protocol the filter
//! speaks (`POST /v1/leases`, `POST /v1/leases/return`), one item per call, each call under
//! its own deadline. A lease call that fails in transit is retried once with the same id while
//! the deadline allows: the parent's dedup record applies it once.
//!
//! `http://` is h2c (prior knowledge). `https://` is HTTP/2 over TLS (ALPN `h2`): the parent's
//! certificate must chain to `--parent-ca`, and with `--parent-cert`/`--parent-key` this
//! instance presents a client certificate (the parent's `--tls-client-ca`, `--tls-allow`).
//!
//! One HTTP/2 connection carries every call. It is opened ahead of need and kept open by
//! [`Parent::keep_connected`] (a check every few seconds, HTTP/2 pings while idle, a new
//! connection soon after one drops), so a call's deadline is spent on the call, not on a TCP
//! and TLS handshake that a busy host may take longer than `--parent-timeout` to finish.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::Notify;
use tollgate_core::protocol::{
    LeaseBatch, LeaseBatchResponse, LeaseRequest, LeaseResult, LeaseReturn, ReturnBatch,
    ReturnBatchResponse, ReturnResult,
};

/// Largest answer body read from the parent (one item's answer is a few hundred bytes).
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// How often the connection is checked (`GET /healthz` over it) while it works: calls find
/// it open, and one the parent closed is replaced within this long even without calls.
const CHECK_EVERY: Duration = Duration::from_secs(5);

/// Deadline of one check, and of a connection's TCP set-up: opening a connection (TCP, TLS
/// handshake) happens off the calls' path, so a busy host gets this long rather than a
/// call's deadline.
const CHECK_DEADLINE: Duration = Duration::from_secs(10);

/// After a failed check (or a call that found the parent unreachable), the next check comes
/// after this pause, doubled on each failure up to [`RECONNECT_MAX`].
const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// HTTP/2 pings on the connection, also while idle: one not answered within
/// [`PING_TIMEOUT`] closes it, so a dead peer is found before a call is spent on it.
const PING_EVERY: Duration = Duration::from_secs(10);
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the parent gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParentError {
    /// Not reached in time, connection refused or reset, or it answered 5xx / UNAVAILABLE:
    /// the same call may succeed later.
    #[error("parent limiter unreachable: {0}")]
    Unreachable(String),
    /// It answered, and refused the call (an unknown or non-global policy there, a request
    /// it finds invalid): asking again will not help until its configuration changes.
    #[error("parent limiter refused the call: {0}")]
    Refused(String),
}

/// What the parent answered to one lease ask.
#[derive(Debug, Clone, PartialEq)]
pub struct ParentGrant {
    pub granted: u64,
    pub expires_ms: u64,
    pub share_per_s: f64,
    pub period_ms: u64,
    pub retry_after_ms: u64,
}

/// TLS towards the parent (`https://`): whom to trust, and this instance's certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentTls {
    /// CA certificates (PEM) the parent's certificate must chain to.
    pub ca: PathBuf,
    /// This instance's certificate chain and key (PEM), for a parent that asks for one.
    pub client: Option<(PathBuf, PathBuf)>,
}

impl ParentTls {
    /// The rustls configuration, or why the files do not make one (naming flag and file).
    fn client_config(&self) -> Result<rustls::ClientConfig, String> {
        use crate::store::security::{certificates, private_key_of, read};
        crate::store::security::install_crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        let ca = read("--parent-ca", &self.ca).map_err(|e| e.to_string())?;
        for cert in certificates("--parent-ca", &self.ca, &ca).map_err(|e| e.to_string())? {
            roots.add(cert).map_err(|e| {
                format!(
                    "--parent-ca {}: not a usable CA certificate: {e}",
                    self.ca.display()
                )
            })?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS towards the parent: {e}"))?
        .with_root_certificates(roots);
        // ALPN (`h2`) is the connector's to set (`enable_http2`): it refuses a preset one.
        let config = match &self.client {
            None => builder.with_no_client_auth(),
            Some((cert_path, key_path)) => {
                let cert = read("--parent-cert", cert_path).map_err(|e| e.to_string())?;
                let key = read("--parent-key", key_path).map_err(|e| e.to_string())?;
                let chain =
                    certificates("--parent-cert", cert_path, &cert).map_err(|e| e.to_string())?;
                let key =
                    private_key_of("--parent-key", key_path, &key).map_err(|e| e.to_string())?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    format!(
                        "--parent-key {} is not the key of --parent-cert {}: {e}",
                        key_path.display(),
                        cert_path.display()
                    )
                })?
            }
        };
        Ok(config)
    }
}

/// The parent limiter's address and this region's name there.
#[derive(Debug)]
pub struct Parent {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    base: String,
    timeout: Duration,
    /// This regional instance as a holder at the parent.
    holder: String,
    next_id: AtomicU64,
    /// Whether a check has succeeded since start (the instance is ready from then on).
    reached: AtomicBool,
    /// Why the last check failed, while none has succeeded yet.
    last_check_error: Mutex<String>,
    /// A call found the parent unreachable: check (and reconnect) now.
    call_failed: Notify,
}

impl Parent {
    /// `url`: `http://host:port` (h2c) or `https://host:port` (with `tls`) of the parent's
    /// lease listener. `holder`: this instance at the parent (`[0-9A-Za-z_-]`, at most 64
    /// bytes).
    pub fn new(
        url: &str,
        tls: Option<&ParentTls>,
        holder: String,
        timeout: Duration,
    ) -> Result<Self, String> {
        let base = url.trim_end_matches('/').to_owned();
        let (rest, secure) = match (base.strip_prefix("http://"), base.strip_prefix("https://")) {
            (Some(rest), _) => (rest, false),
            (_, Some(rest)) => (rest, true),
            _ => {
                return Err(format!(
                    "--parent must be an http:// (h2c) or https:// URL, got `{url}`"
                ))
            }
        };
        if rest.is_empty() || rest.contains('/') {
            return Err(format!(
                "--parent must be a scheme, host and port without a path, got `{url}`"
            ));
        }
        let tls_config = match (secure, tls) {
            (true, Some(tls)) => tls.client_config()?,
            (true, None) => {
                return Err(format!(
                    "--parent {url} is https://: --parent-ca must name the CA of its certificate"
                ))
            }
            (false, Some(_)) => {
                return Err(format!(
                    "--parent-ca is given but --parent {url} is not https://"
                ))
            }
            // Never used for an http:// URL (`https_or_http`): no CA needed.
            (false, None) => rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
        };
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        // Calls are bounded by their own deadline; a connection being opened for the check
        // task gets the check's.
        http.set_connect_timeout(Some(CHECK_DEADLINE.max(timeout)));
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config)
            .https_or_http()
            .enable_http2()
            .wrap_connector(http);
        // One connection, kept however long it idles (the checks use it every few seconds
        // anyway); pings close it when the parent stops answering.
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(None)
            .http2_keep_alive_interval(PING_EVERY)
            .http2_keep_alive_timeout(PING_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            .build(connector);
        // Ids unique across restarts of this instance: the start time in ns, then a count.
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Ok(Self {
            client,
            base,
            timeout,
            holder,
            next_id: AtomicU64::new(start),
            reached: AtomicBool::new(false),
            last_check_error: Mutex::new("connecting".into()),
            call_failed: Notify::new(),
        })
    }

    /// `Ok` once a check has reached the parent since start; else why not (yet).
    pub fn reached(&self) -> Result<(), String> {
        if self.reached.load(Ordering::Relaxed) {
            return Ok(());
        }
        let why = self
            .last_check_error
            .lock()
            .map(|e| e.clone())
            .unwrap_or_else(|e| e.into_inner().clone());
        Err(format!(
            "the parent limiter {} has not been reached yet: {why}",
            self.base
        ))
    }

    /// Keeps the connection to the parent open, for as long as the instance runs: connects
    /// at once, checks it every [`CHECK_EVERY`] (which also reconnects after the parent
    /// closed it), and right away when a call found the parent unreachable; after a failed
    /// check, tries again with a growing pause.
    pub async fn keep_connected(&self) {
        let mut pause = RECONNECT_MIN;
        let mut failing = false;
        loop {
            match self.check().await {
                Ok(()) => {
                    if !self.reached.swap(true, Ordering::Relaxed) {
                        tracing::info!(parent = %self.base, "connected to the parent limiter");
                    } else if failing {
                        tracing::info!(parent = %self.base, "connected to the parent limiter again");
                    }
                    failing = false;
                    pause = RECONNECT_MIN;
                    tokio::select! {
                        () = tokio::time::sleep(CHECK_EVERY) => {}
                        () = self.call_failed.notified() => {}
                    }
                    // At most one check per pause, however many calls fail.
                    tokio::time::sleep(RECONNECT_MIN).await;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(parent = %self.base, error = %e,
                            "cannot connect to the parent limiter; retrying in the background");
                        failing = true;
                    }
                    if let Ok(mut last) = self.last_check_error.lock() {
                        *last = e.to_string();
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RECONNECT_MAX);
                }
            }
        }
    }

    /// `GET /healthz` of the parent under [`CHECK_DEADLINE`]: opens the connection if there
    /// is none (TCP, TLS with this instance's certificate), and proves it carries requests.
    async fn check(&self) -> Result<(), ParentError> {
        let request = axum::http::Request::get(format!("{}/healthz", self.base))
            .body(Full::new(Bytes::new()))
            .map_err(|e| ParentError::Refused(format!("cannot build the request: {e}")))?;
        // The answer is read to the end: the stream is done with before the next check.
        match self.send(request, CHECK_DEADLINE).await {
            Some(Ok((status, _))) if status.is_success() => Ok(()),
            Some(Ok((status, _))) => Err(ParentError::Unreachable(format!(
                "/healthz answered {status}"
            ))),
            Some(Err(e)) => Err(e),
            None => Err(ParentError::Unreachable(format!(
                "/healthz not answered within {CHECK_DEADLINE:?}"
            ))),
        }
    }

    /// Sends `request` and reads its answer (at most [`MAX_ANSWER_BYTES`]); `None` when that
    /// took longer than `left`. What went wrong on the way is `Unreachable`.
    async fn send(
        &self,
        request: axum::http::Request<Full<Bytes>>,
        left: Duration,
    ) -> Option<Result<(axum::http::StatusCode, Bytes), ParentError>> {
        let call = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| ParentError::Unreachable(connect_error(&e)))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| ParentError::Unreachable(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(left, call).await.ok()
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A fresh lease id for an ask of this instance.
    pub fn new_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{}-{n:x}", self.holder)
    }

    async fn post(
        &self,
        path: &str,
        body: Vec<u8>,
        deadline: Instant,
    ) -> Result<Bytes, ParentError> {
        let request = axum::http::Request::post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| ParentError::Refused(format!("cannot build the request: {e}")))?;
        let left = deadline.saturating_duration_since(Instant::now());
        let result = match self.send(request, left).await {
            Some(Ok((status, _))) if status.is_server_error() => {
                Err(ParentError::Unreachable(format!("answered {status}")))
            }
            Some(Ok((status, body))) if !status.is_success() => {
                let text = String::from_utf8_lossy(&body);
                Err(ParentError::Refused(format!("answered {status}: {text}")))
            }
            Some(Ok((_, body))) => Ok(body),
            Some(Err(e)) => Err(e),
            None => Err(ParentError::Unreachable(format!(
                "no answer within {:?}",
                self.timeout
            ))),
        };
        if matches!(result, Err(ParentError::Unreachable(_))) {
            self.call_failed.notify_one();
        }
        result
    }

    /// Asks for a lease of (`policy`, `key`) under id `id`, as holder with `demand_per_s`.
    pub async fn lease(
        &self,
        id: &str,
        policy: &str,
        key: &str,
        (min, want, demand_per_s): (u64, u64, f64),
    ) -> Result<ParentGrant, ParentError> {
        let batch = LeaseBatch {
            leases: vec![LeaseRequest {
                id: id.to_owned(),
                policy: policy.to_owned(),
                key: key.to_owned(),
                min,
                want,
                group: None,
                holder: Some(self.holder.clone()),
                demand_per_s: Some(demand_per_s),
            }],
            settled: Default::default(),
        };
        let body = serde_json::to_vec(&batch)
            .map_err(|e| ParentError::Refused(format!("cannot encode the ask: {e}")))?;
        let deadline = Instant::now() + self.timeout;
        let mut attempt = self.post("/v1/leases", body.clone(), deadline).await;
        if matches!(attempt, Err(ParentError::Unreachable(_))) && Instant::now() < deadline {
            // The same id again: if the first one was decided, the parent replays it.
            attempt = self.post("/v1/leases", body, deadline).await;
        }
        let answer: LeaseBatchResponse = serde_json::from_slice(&attempt?)
            .map_err(|e| ParentError::Unreachable(format!("malformed answer: {e}")))?;
        match answer.leases.into_iter().next() {
            Some(LeaseResult::Granted(g)) => Ok(ParentGrant {
                granted: g.granted,
                expires_ms: g.expires_ms,
                share_per_s: g.share_per_s,
                period_ms: g.period_ms,
                retry_after_ms: g.retry_after_ms,
            }),
            Some(LeaseResult::Error(e)) => {
                let reason = e.reason.unwrap_or_default();
                match e.error {
                    tollgate_core::protocol::ErrorCode::Unavailable => {
                        Err(ParentError::Unreachable(format!("UNAVAILABLE: {reason}")))
                    }
                    code => Err(ParentError::Refused(format!("{}: {reason}", code.as_str()))),
                }
            }
            None => Err(ParentError::Unreachable("an answer without items".into())),
        }
    }

    /// Gives back `unused` tokens of lease `id`; the tokens the parent took back.
    pub async fn give_back(
        &self,
        id: &str,
        policy: &str,
        key: &str,
        unused: u64,
    ) -> Result<u64, ParentError> {
        let batch = ReturnBatch {
            returns: vec![LeaseReturn {
                id: id.to_owned(),
                policy: policy.to_owned(),
                key: key.to_owned(),
                unused,
            }],
            settled: Default::default(),
        };
        let body = serde_json::to_vec(&batch)
            .map_err(|e| ParentError::Refused(format!("cannot encode the return: {e}")))?;
        let deadline = Instant::now() + self.timeout;
        let answer: ReturnBatchResponse =
            serde_json::from_slice(&self.post("/v1/leases/return", body, deadline).await?)
                .map_err(|e| ParentError::Unreachable(format!("malformed answer: {e}")))?;
        match answer.returns.into_iter().next() {
            Some(ReturnResult::Returned { returned, .. }) => Ok(returned),
            Some(ReturnResult::Error(e)) => Err(ParentError::Refused(e.error.as_str().into())),
            None => Err(ParentError::Unreachable("an answer without items".into())),
        }
    }
}

/// A client error with its causes (hyper-util's own message is only "client error
/// (Connect)": the cause says refused, reset, or which TLS check failed).
fn connect_error(e: &hyper_util::client::legacy::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
