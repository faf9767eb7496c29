//! The regional limiter's client of its parent limiter: the same lease protocol the filter
//! speaks (`POST /v1/leases`, `POST /v1/leases/return`), one item per call, each call under
//! its own deadline. A lease call that fails in transit is retried once with the same id while
//! the deadline allows: the parent's dedup record applies it once.
//!
//! `http://` is h2c (prior knowledge). `https://` is HTTP/2 over TLS (ALPN `h2`): the parent's
//! certificate must chain to `--parent-ca`, and with `--parent-cert`/`--parent-key` this
//! instance presents a client certificate (the parent's `--tls-client-ca`, `--tls-allow`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate_core::protocol::{
    LeaseBatch, LeaseBatchResponse, LeaseRequest, LeaseResult, LeaseReturn, ReturnBatch,
    ReturnBatchResponse, ReturnResult,
};

/// Largest answer body read from the parent (one item's answer is a few hundred bytes).
const MAX_ANSWER_BYTES: usize = 64 * 1024;

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
        http.set_connect_timeout(Some(timeout));
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config)
            .https_or_http()
            .enable_http2()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .http2_only(true)
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
        })
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
        let call = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| ParentError::Unreachable(e.to_string()))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| ParentError::Unreachable(format!("reading the answer: {e}")))?
                .to_bytes();
            if status.is_server_error() {
                return Err(ParentError::Unreachable(format!("answered {status}")));
            }
            if !status.is_success() {
                let text = String::from_utf8_lossy(&body);
                return Err(ParentError::Refused(format!("answered {status}: {text}")));
            }
            Ok(body)
        };
        match tokio::time::timeout(left, call).await {
            Ok(result) => result,
            Err(_) => Err(ParentError::Unreachable(format!(
                "no answer within {:?}",
                self.timeout
            ))),
        }
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
