//! How the limiter proves who it is to Redis and checks who Redis is: TLS (`rediss://`) with a
//! private CA and a client certificate, and ACL authentication (a user name and a password).
//!
//! The flags name files ([`RedisSecurity`]); the files are read when a store is created, so a
//! missing or malformed one stops the limiter at start with an error naming the flag and the
//! path — never the file's contents. The password is never a flag value (a process list shows
//! those): it comes from a file or from `TOLLGATE_REDIS_PASSWORD`, and is carried as a
//! [`Secret`], which prints as `<redacted>`. A password inside the URL still works, with a
//! warning; the URL is only ever printed through [`redact_url`].
//!
//! Credentials Redis refuses (a certificate it does not trust, one we do not trust, a wrong
//! password) are not transient: the same attempt fails the same way until someone changes a
//! file or an ACL. [`Refusals`] makes a store stop dialing Redis for a while after one, so
//! every call (and `/readyz`) answers at once with the specific reason instead of a fresh
//! handshake per call.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::{ClientTlsConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, TlsCertificates};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::StoreError;

/// Flag of the CA file.
pub const CA_FLAG: &str = "--redis-ca";
/// Flag of the client certificate file.
pub const CLIENT_CERT_FLAG: &str = "--redis-client-cert";
/// Flag of the client key file.
pub const CLIENT_KEY_FLAG: &str = "--redis-client-key";
/// Flag of the ACL user name.
pub const USERNAME_FLAG: &str = "--redis-username";
/// Flag of the password file.
pub const PASSWORD_FILE_FLAG: &str = "--redis-password-file";
/// The environment variable that may hold the password itself.
pub const PASSWORD_ENV: &str = "TOLLGATE_REDIS_PASSWORD";

/// What a secret prints as, everywhere.
const REDACTED: &str = "<redacted>";

/// A secret value (a password). `Debug` and `Display` print `<redacted>`; only
/// [`Secret::expose`] gives the bytes, at the one place that hands them to the Redis client.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(value: impl Into<Vec<u8>>) -> Self {
        Self(value.into())
    }

    /// The secret's bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

/// TLS and ACL settings for reaching Redis, as the flags give them (paths, not contents). The
/// default is none of them: plain TCP without authentication, or whatever the URL says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisSecurity {
    /// CA certificate(s) (PEM) that Redis' certificate must chain to; without it, the
    /// system's trust store.
    pub ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for Redis' `tls-auth-clients`.
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub client_key: Option<PathBuf>,
    /// ACL user name (`AUTH <username> <password>`).
    pub username: Option<String>,
    /// The password itself ([`PASSWORD_ENV`]).
    pub password: Option<Secret>,
    /// A file holding the password (trailing newlines trimmed).
    pub password_file: Option<PathBuf>,
}

/// The files read and checked: what a Redis client is built with.
#[derive(Default)]
struct Loaded {
    tls: Option<TlsCertificates>,
    username: Option<String>,
    password: Option<String>,
}

fn config_error(message: String) -> StoreError {
    StoreError::Config(message)
}

/// Reads `path` (given with `flag`); the error names both, never the contents.
pub(crate) fn read(flag: &str, path: &Path) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path)
        .map_err(|e| config_error(format!("{flag} {}: cannot read it: {e}", path.display())))
}

/// Every PEM certificate in `bytes` (at least one).
pub(crate) fn certificates(
    flag: &str,
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, StoreError> {
    // The parser's own message is left out: it may quote a line of the file.
    let bad = || {
        config_error(format!(
            "{flag} {}: not a PEM file of certificates (-----BEGIN CERTIFICATE-----)",
            path.display()
        ))
    };
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| bad())?;
    if certs.is_empty() {
        return Err(bad());
    }
    Ok(certs)
}

/// The one private key in `bytes`.
fn private_key(path: &Path, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, StoreError> {
    private_key_of(CLIENT_KEY_FLAG, path, bytes)
}

/// The one private key in `bytes`, read from `path` given with `flag`.
pub(crate) fn private_key_of(
    flag: &str,
    path: &Path,
    bytes: &[u8],
) -> Result<PrivateKeyDer<'static>, StoreError> {
    PrivateKeyDer::from_pem_slice(bytes).map_err(|_| {
        config_error(format!(
            "{flag} {}: not a PEM private key (PKCS#8, PKCS#1 or SEC1)",
            path.display()
        ))
    })
}

/// The process-wide rustls crypto provider: `ring` (the only one compiled in). Installed
/// once; a provider someone else installed first is kept.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl RedisSecurity {
    /// Whether any TLS file is given.
    pub fn has_tls_files(&self) -> bool {
        self.ca.is_some() || self.client_cert.is_some() || self.client_key.is_some()
    }

    /// Reads and checks every file: PEM that parses, a key that belongs to its certificate,
    /// one password source, a user name only with a password.
    fn load(&self) -> Result<Loaded, StoreError> {
        let mut loaded = Loaded {
            username: self.username.clone(),
            ..Loaded::default()
        };
        if let Some(name) = &self.username {
            if name.is_empty() {
                return Err(config_error(format!("{USERNAME_FLAG} is empty")));
            }
        }
        loaded.password = self.load_password()?;
        if self.has_tls_files() {
            loaded.tls = Some(self.load_tls()?);
        }
        Ok(loaded)
    }

    fn load_password(&self) -> Result<Option<String>, StoreError> {
        let secret = match (&self.password, &self.password_file) {
            (Some(_), Some(file)) => {
                return Err(config_error(format!(
                    "both {PASSWORD_ENV} and {PASSWORD_FILE_FLAG} {} give the Redis password; \
                     give one",
                    file.display()
                )))
            }
            (Some(secret), None) => {
                if secret.is_empty() {
                    return Err(config_error(format!("{PASSWORD_ENV} is empty")));
                }
                String::from_utf8(secret.expose().to_vec())
                    .map_err(|_| config_error(format!("{PASSWORD_ENV} is not UTF-8")))?
            }
            (None, Some(file)) => {
                let bytes = read(PASSWORD_FILE_FLAG, file)?;
                let text = String::from_utf8(bytes).map_err(|_| {
                    config_error(format!(
                        "{PASSWORD_FILE_FLAG} {}: not UTF-8 text",
                        file.display()
                    ))
                })?;
                let password = text.trim_end_matches(['\n', '\r']);
                if password.is_empty() {
                    return Err(config_error(format!(
                        "{PASSWORD_FILE_FLAG} {}: the file is empty",
                        file.display()
                    )));
                }
                password.to_owned()
            }
            (None, None) => return Ok(None),
        };
        Ok(Some(secret))
    }

    fn load_tls(&self) -> Result<TlsCertificates, StoreError> {
        install_crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        let root_cert = match &self.ca {
            Some(path) => {
                let bytes = read(CA_FLAG, path)?;
                for cert in certificates(CA_FLAG, path, &bytes)? {
                    roots.add(cert).map_err(|e| {
                        config_error(format!(
                            "{CA_FLAG} {}: not a usable CA certificate: {e}",
                            path.display()
                        ))
                    })?;
                }
                Some(bytes)
            }
            None => None,
        };
        let client_tls = match (&self.client_cert, &self.client_key) {
            (Some(cert_path), Some(key_path)) => {
                let cert_pem = read(CLIENT_CERT_FLAG, cert_path)?;
                let key_pem = read(CLIENT_KEY_FLAG, key_path)?;
                let chain = certificates(CLIENT_CERT_FLAG, cert_path, &cert_pem)?;
                let key = private_key(key_path, &key_pem)?;
                // What the Redis client will do at every connection, done once here so a key
                // of another certificate fails at start, naming both files.
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| config_error(format!("TLS for Redis: {e}")))?
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, key)
                .map_err(|e| {
                    config_error(format!(
                        "{CLIENT_KEY_FLAG} {} is not the key of {CLIENT_CERT_FLAG} {}: {e}",
                        key_path.display(),
                        cert_path.display()
                    ))
                })?;
                Some(ClientTlsConfig {
                    client_cert: cert_pem,
                    client_key: key_pem,
                })
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(config_error(format!(
                    "{CLIENT_CERT_FLAG} and {CLIENT_KEY_FLAG} go together: give both or neither"
                )))
            }
            (None, None) => None,
        };
        Ok(TlsCertificates {
            client_tls,
            root_cert,
        })
    }

    /// `url` as a connection to open with these settings: the URL parsed, the TLS scheme
    /// checked against the files, the user name and password merged in.
    fn connection(&self, url: &str, loaded: &Loaded) -> Result<ConnectionInfo, StoreError> {
        let shown = redact_url(url);
        let info = url
            .into_connection_info()
            .map_err(|e| config_error(format!("redis URL `{shown}`: {e}")))?;
        match info.addr() {
            ConnectionAddr::TcpTls { insecure: true, .. } => {
                return Err(config_error(format!(
                    "redis URL `{shown}`: #insecure (no certificate checks) is not supported"
                )))
            }
            ConnectionAddr::TcpTls { .. } => {}
            ConnectionAddr::Tcp(..) | ConnectionAddr::Unix(_) if self.has_tls_files() => {
                return Err(config_error(format!(
                    "{CA_FLAG}, {CLIENT_CERT_FLAG} and {CLIENT_KEY_FLAG} are for TLS, but \
                     `{shown}` is not a TLS URL: use rediss://"
                )))
            }
            _ => {}
        }
        let mut redis = info.redis_settings().clone();
        if redis.password().is_some() {
            if loaded.password.is_some() {
                return Err(config_error(format!(
                    "redis URL `{shown}` has a password, and so has {PASSWORD_FILE_FLAG} or \
                     {PASSWORD_ENV}: give one"
                )));
            }
            warn_url_password();
        }
        if let (Some(theirs), Some(ours)) = (redis.username(), &loaded.username) {
            if theirs != ours {
                return Err(config_error(format!(
                    "redis URL `{shown}` names user `{theirs}`, {USERNAME_FLAG} names `{ours}`"
                )));
            }
        }
        if let Some(name) = &loaded.username {
            redis = redis.set_username(name);
        }
        if let Some(password) = &loaded.password {
            redis = redis.set_password(password);
        }
        if redis.username().is_some() && redis.password().is_none() {
            return Err(config_error(format!(
                "a Redis user name without a password: give it with {PASSWORD_FILE_FLAG} or \
                 {PASSWORD_ENV}"
            )));
        }
        Ok(info.set_redis_settings(redis))
    }

    /// A client for one Redis server at `url`.
    pub(crate) fn client(&self, url: &str) -> Result<redis::Client, StoreError> {
        install_crypto_provider();
        let loaded = self.load()?;
        let info = self.connection(url, &loaded)?;
        let shown = redact_url(url);
        match loaded.tls {
            Some(certs) => redis::Client::build_with_tls(info, certs),
            None => redis::Client::open(info),
        }
        .map_err(|e| config_error(format!("redis URL `{shown}`: {e}")))
    }

    /// A Redis Cluster client builder for the start-up `urls` (all TLS or all plain).
    pub(crate) fn cluster_builder(
        &self,
        urls: &[String],
    ) -> Result<redis::cluster::ClusterClientBuilder, StoreError> {
        install_crypto_provider();
        let loaded = self.load()?;
        let infos = urls
            .iter()
            .map(|url| self.connection(url, &loaded))
            .collect::<Result<Vec<_>, _>>()?;
        let mut builder = redis::cluster::ClusterClientBuilder::new(infos);
        if let Some(certs) = loaded.tls {
            builder = builder.certs(certs);
        }
        Ok(builder)
    }
}

static URL_PASSWORD_WARNED: AtomicBool = AtomicBool::new(false);

/// Warns (once per process) that a password in the URL is readable by others.
fn warn_url_password() {
    if !URL_PASSWORD_WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "the Redis URL carries a password: anyone who can list processes (or read this \
             one's environment) can read it; give it with {PASSWORD_FILE_FLAG} or \
             {PASSWORD_ENV} instead"
        );
    }
}

/// `url` fit to print: the password of `user:password@` and a `pass=` query value replaced
/// by `<redacted>`.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    // The user information ends at the last '@' (not at the first '/': a password with an
    // unescaped '/', '?' or '#' makes an invalid URL, which is printed in the error).
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => (format!("{user}:{REDACTED}@"), host),
            None => (format!("{userinfo}@"), host),
        },
        None => (String::new(), rest),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (host, tail) = rest.split_at(authority_end);
    let authority = format!("{userinfo}{host}");
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let (query, fragment) = match query.split_once('#') {
                Some((q, f)) => (q, Some(f)),
                None => (query, None),
            };
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some(("pass" | "password", _)) => {
                        format!("{}={REDACTED}", pair.split('=').next().unwrap_or(""))
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            let mut tail = format!("{path}?{}", query.join("&"));
            if let Some(f) = fragment {
                tail.push('#');
                tail.push_str(f);
            }
            tail
        }
        None => tail.to_owned(),
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{authority}{tail}"),
        None => format!("{authority}{tail}"),
    }
}

/// Whether `e` is Redis (or we) refusing the credentials, and which refusal: a failed TLS
/// handshake ([`StoreError::Tls`]) or a refused `AUTH` / a command without one
/// ([`StoreError::Auth`]). The Redis Cluster client reports failed connections as text only,
/// so the text is read too.
pub(crate) fn credential_error(e: &redis::RedisError) -> Option<StoreError> {
    let text = e.to_string();
    // No `AUTH` sent to a Redis that wants one: `NOAUTH` for a short command; a long one
    // (most `FCALL`s, `FUNCTION LOAD`) is cut off as a protocol error, and the connection
    // closed.
    if e.code() == Some("NOAUTH") || UNAUTHENTICATED_MARKERS.iter().any(|m| text.contains(m)) {
        return Some(StoreError::Auth(format!(
            "Redis requires authentication (a user name and password): {text}"
        )));
    }
    if e.kind() == redis::ErrorKind::AuthenticationFailed || e.code() == Some("WRONGPASS") {
        return Some(StoreError::Auth(text));
    }
    if tls_cause(e).is_some() {
        return Some(StoreError::Tls(text));
    }
    if AUTH_MARKERS.iter().any(|m| text.contains(m)) {
        return Some(StoreError::Auth(text));
    }
    if TLS_MARKERS.iter().any(|m| text.contains(m)) {
        return Some(StoreError::Tls(text));
    }
    None
}

/// Texts of commands Redis refused because the connection has not authenticated.
const UNAUTHENTICATED_MARKERS: &[&str] = &[
    "NOAUTH",
    "unauthenticated multibulk length",
    "unauthenticated bulk length",
];

/// Texts of refused authentication (redis-rs' and Redis' own).
const AUTH_MARKERS: &[&str] = &["AuthenticationFailed", "authentication failed", "WRONGPASS"];

/// Texts of failed TLS handshakes, as rustls words them (`rustls::Error`'s `Display`).
const TLS_MARKERS: &[&str] = &[
    "invalid peer certificate",
    "received fatal alert",
    "peer is incompatible",
    "peer sent no certificates",
    "peer misbehaved",
    "Unable to parse TLS trust anchors",
];

/// The rustls error under `e`, if the failure is one.
fn tls_cause(e: &redis::RedisError) -> Option<&rustls::Error> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = source {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
                    return Some(tls);
                }
            }
        }
        source = err.source();
    }
    None
}

/// First pause after refused credentials.
pub const REFUSED_PAUSE_MIN: Duration = Duration::from_secs(1);
/// Longest pause: how long a fixed certificate or ACL may wait to be noticed.
pub const REFUSED_PAUSE_MAX: Duration = Duration::from_secs(10);
/// How long one probe may take (a connection, its handshake and a `PING`).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Credentials Redis refused, and until when the store holds back.
#[derive(Debug)]
struct Refused {
    error: StoreError,
    /// No probe before this.
    until: Instant,
    /// The current pause.
    pause: Duration,
    /// A probe is out.
    probing: bool,
}

#[derive(Debug, Default)]
struct State {
    refused: Option<Refused>,
    /// A probe got through: the next call replaces the store's connection (which still holds
    /// the refusal) first.
    reconnect: bool,
    /// When the last diagnosis started ([`Refusals::diagnose`]), and whether it is out.
    diagnosed: Option<Instant>,
    diagnosing: bool,
}

/// What a store should do before it dials Redis.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Go ahead on the current connection.
    Go,
    /// Replace the connection first: it was refused, and a probe since got through.
    Reconnect,
}

/// Holds a store back from Redis after Redis refused its credentials (or we refused Redis'
/// certificate). Calls then fail at once with the refusal, and the store's connection is
/// left alone; a probe — one new connection and a `PING`, in a task of its own, so it is not
/// cut short by a caller's deadline — tries again after [`REFUSED_PAUSE_MIN`], the pause
/// doubling while the refusals go on, up to [`REFUSED_PAUSE_MAX`]. One handshake per pause,
/// whatever the traffic. When a probe gets through, the next call reconnects. Logs the
/// refusal when it starts, each probe refused again, and the end.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    state: Mutex<State>,
}

/// Whether `e` is a refusal of the credentials.
fn is_refusal(e: &StoreError) -> bool {
    matches!(e, StoreError::Tls(_) | StoreError::Auth(_))
}

impl Refusals {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Every value of the state is valid, whatever a panicking holder left.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Before a call: `Err` with the refusal while one stands (starting a `probe` of
    /// `node` when the pause is over and none is out), else how to go ahead. A call that gets
    /// `Err` must not report to [`Refusals::after_call`]. Needs a tokio runtime.
    pub(crate) fn before_call<F, Fut>(
        self: &Arc<Self>,
        node: &str,
        probe: F,
    ) -> Result<Attempt, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        let mut state = self.state();
        if let Some(refused) = state.refused.as_mut() {
            if !refused.probing && Instant::now() >= refused.until {
                refused.probing = true;
                let probe = probe();
                let refusals = Arc::clone(self);
                let node = node.to_owned();
                tokio::spawn(async move {
                    let result = match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                        Ok(result) => result,
                        Err(_) => Err(StoreError::Timeout(PROBE_TIMEOUT)),
                    };
                    refusals.probed(&node, result);
                });
            }
            return Err(refused.error.clone());
        }
        if std::mem::take(&mut state.reconnect) {
            return Ok(Attempt::Reconnect);
        }
        Ok(Attempt::Go)
    }

    /// A probe's outcome: through (the refusal ends), refused again (a longer pause), or
    /// neither (Redis down, a timeout: the same pause again).
    fn probed(&self, node: &str, result: Result<(), StoreError>) {
        let mut state = self.state();
        let Some(refused) = state.refused.as_mut() else {
            return;
        };
        refused.probing = false;
        match result {
            Ok(()) => {
                state.refused = None;
                state.reconnect = true;
                tracing::info!(%node, "Redis accepts the limiter's credentials again");
            }
            Err(e) if is_refusal(&e) => {
                refused.pause = (refused.pause * 2).min(REFUSED_PAUSE_MAX);
                refused.until = Instant::now() + refused.pause;
                tracing::warn!(%node, kind = e.kind(), error = %e, retry_in = ?refused.pause,
                    "Redis still refuses the limiter's credentials");
                refused.error = e;
            }
            Err(e) => {
                refused.until = Instant::now() + refused.pause;
                tracing::debug!(%node, error = %e, retry_in = ?refused.pause,
                    "cannot probe Redis' credentials");
            }
        }
    }

    /// After a call that went ahead: a refusal starts holding back (many calls in flight
    /// failing at once start it once).
    pub(crate) fn after_call(&self, node: &str, error: Option<&StoreError>) {
        let Some(e) = error.filter(|e| is_refusal(e)) else {
            return;
        };
        let mut state = self.state();
        if state.refused.is_some() {
            return;
        }
        tracing::error!(%node, kind = e.kind(), error = %e, retry_in = ?REFUSED_PAUSE_MIN,
            "{}", refusal_hint(e));
        state.reconnect = false;
        state.refused = Some(Refused {
            error: e.clone(),
            until: Instant::now() + REFUSED_PAUSE_MIN,
            pause: REFUSED_PAUSE_MIN,
            probing: false,
        });
    }

    /// A call failed without saying why, in a way that may hide a refusal (the Redis Cluster
    /// client reports nodes that refused the connection only as "no connection"): runs
    /// `probe` to find out, and holds back if it is refused. At most one at a time, and one
    /// per [`REFUSED_PAUSE_MIN`]. Needs a tokio runtime.
    pub(crate) fn diagnose<F, Fut>(self: &Arc<Self>, node: &str, probe: F)
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        {
            let mut state = self.state();
            let recent = state
                .diagnosed
                .is_some_and(|at| at.elapsed() < REFUSED_PAUSE_MIN);
            if state.refused.is_some() || state.diagnosing || recent {
                return;
            }
            state.diagnosing = true;
            state.diagnosed = Some(Instant::now());
        }
        let probe = probe();
        let refusals = Arc::clone(self);
        let node = node.to_owned();
        tokio::spawn(async move {
            let result = tokio::time::timeout(PROBE_TIMEOUT, probe).await;
            refusals.state().diagnosing = false;
            if let Ok(Err(e)) = result {
                refusals.after_call(&node, Some(&e));
            }
        });
    }

    /// Whether calls are being held back now.
    pub(crate) fn holding_back(&self) -> bool {
        self.state().refused.is_some()
    }
}

/// What to check, for the log line of a refusal.
fn refusal_hint(e: &StoreError) -> &'static str {
    match e {
        StoreError::Tls(_) => {
            "TLS handshake with Redis failed: check --redis-ca (the CA that signed Redis' \
             certificate), --redis-client-cert / --redis-client-key (a certificate Redis' \
             tls-ca-cert-file trusts) and that the URL's host is named in Redis' certificate"
        }
        _ => {
            "Redis refused authentication: check --redis-username and the password \
             (--redis-password-file or TOLLGATE_REDIS_PASSWORD) against Redis' ACL"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "tollgate-security-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s}"), "<redacted>");
        assert_eq!(format!("{s:?}"), "<redacted>");
        let security = RedisSecurity {
            password: Some(s),
            ..RedisSecurity::default()
        };
        assert!(!format!("{security:?}").contains("hunter2"));
    }

    #[test]
    fn urls_print_without_passwords() {
        assert_eq!(
            redact_url("rediss://alice:s3cr%40t@redis.example:6380/2"),
            "rediss://alice:<redacted>@redis.example:6380/2"
        );
        assert_eq!(
            redact_url("redis://:pw@127.0.0.1:6379"),
            "redis://:<redacted>@127.0.0.1:6379"
        );
        assert_eq!(
            redact_url("redis://alice@127.0.0.1"),
            "redis://alice@127.0.0.1"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?db=1&pass=pw&user=u"),
            "redis+unix:///run/redis.sock?db=1&pass=<redacted>&user=u"
        );
        // A password containing '@', ':' or '/' (unencoded): everything before the last '@'.
        assert_eq!(
            redact_url("redis://u:a:b@c@host:1"),
            "redis://u:<redacted>@host:1"
        );
        assert_eq!(
            redact_url("redis://u:pa/ss?x#y@host:1/0"),
            "redis://u:<redacted>@host:1/0"
        );
    }

    #[test]
    fn password_sources() {
        let dir = temp_dir("password");
        let file = dir.join("password");
        std::fs::write(&file, "from-file\n").unwrap();
        let from_file = RedisSecurity {
            password_file: Some(file.clone()),
            ..RedisSecurity::default()
        };
        assert_eq!(
            from_file.load_password().unwrap().as_deref(),
            Some("from-file")
        );
        std::fs::write(&file, "crlf\r\n").unwrap();
        assert_eq!(from_file.load_password().unwrap().as_deref(), Some("crlf"));

        let from_env = RedisSecurity {
            password: Some(Secret::new("from-env")),
            ..RedisSecurity::default()
        };
        assert_eq!(
            from_env.load_password().unwrap().as_deref(),
            Some("from-env")
        );

        let both = RedisSecurity {
            password: Some(Secret::new("from-env")),
            password_file: Some(file.clone()),
            ..RedisSecurity::default()
        };
        let e = both.load_password().unwrap_err().to_string();
        assert!(
            e.contains(PASSWORD_ENV) && e.contains(PASSWORD_FILE_FLAG),
            "{e}"
        );
        assert!(!e.contains("from-env") && !e.contains("crlf"), "{e}");

        std::fs::write(&file, "\n").unwrap();
        let e = from_file.load_password().unwrap_err().to_string();
        assert!(e.contains("empty") && e.contains(PASSWORD_FILE_FLAG), "{e}");

        let missing = RedisSecurity {
            password_file: Some(dir.join("nope")),
            ..RedisSecurity::default()
        };
        let e = missing.load_password().unwrap_err().to_string();
        assert!(e.contains(PASSWORD_FILE_FLAG) && e.contains("nope"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn file_errors_name_the_flag_and_the_path_not_the_contents() {
        let dir = temp_dir("files");
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n").unwrap();
        let ca = RedisSecurity {
            ca: Some(junk.clone()),
            ..RedisSecurity::default()
        };
        let e = ca.load().err().expect("a bad CA").to_string();
        assert!(e.contains(CA_FLAG) && e.contains("junk.pem"), "{e}");
        assert!(!e.contains("not base64"), "{e}");

        let missing = RedisSecurity {
            ca: Some(dir.join("absent.crt")),
            ..RedisSecurity::default()
        };
        let e = missing.load().err().expect("a missing CA").to_string();
        assert!(e.contains(CA_FLAG) && e.contains("absent.crt"), "{e}");

        let half = RedisSecurity {
            client_cert: Some(junk.clone()),
            ..RedisSecurity::default()
        };
        let e = half.load().err().expect("a cert without a key").to_string();
        assert!(
            e.contains(CLIENT_CERT_FLAG) && e.contains(CLIENT_KEY_FLAG),
            "{e}"
        );
        let half = RedisSecurity {
            client_key: Some(junk.clone()),
            ..RedisSecurity::default()
        };
        let e = half.load().err().expect("a key without a cert").to_string();
        assert!(
            e.contains(CLIENT_CERT_FLAG) && e.contains(CLIENT_KEY_FLAG),
            "{e}"
        );

        let key = dir.join("key.pem");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let bad_key = RedisSecurity {
            client_cert: Some(junk.clone()),
            client_key: Some(key.clone()),
            ..RedisSecurity::default()
        };
        let e = bad_key.load().err().expect("bad files").to_string();
        assert!(!e.contains("c2VjcmV0"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn client_certificates_load_and_a_key_of_another_one_is_refused() {
        let dir = temp_dir("keys");
        let ca = tollgate_e2e::pki::TestCa::new("unit CA");
        let one = ca.client(&dir, "one", None);
        let two = ca.client(&dir, "two", None);
        let good = RedisSecurity {
            ca: Some(ca.write_cert(&dir, "ca.crt")),
            client_cert: Some(one.cert.clone()),
            client_key: Some(one.key.clone()),
            ..RedisSecurity::default()
        };
        let loaded = good.load().expect("matching files load");
        let tls = loaded.tls.expect("TLS settings");
        assert!(tls.root_cert.is_some() && tls.client_tls.is_some());
        assert!(good.client("rediss://127.0.0.1:6380").is_ok());
        let e = good
            .client("redis://127.0.0.1:6379")
            .expect_err("TLS files with redis://")
            .to_string();
        assert!(e.contains("use rediss://"), "{e}");

        let mismatched = RedisSecurity {
            client_key: Some(two.key.clone()),
            ..good
        };
        let e = mismatched.load().err().expect("another key").to_string();
        assert!(
            e.contains(CLIENT_KEY_FLAG) && e.contains(CLIENT_CERT_FLAG),
            "{e}"
        );
        assert!(e.contains("two.key") && e.contains("one.crt"), "{e}");
        for line in two.key_pem.lines().chain(one.key_pem.lines()) {
            assert!(!e.contains(line), "key material in {e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tls_files_need_a_tls_url_and_credentials_one_source() {
        let tls = RedisSecurity {
            ca: Some(PathBuf::from("/nonexistent/ca.crt")),
            ..RedisSecurity::default()
        };
        // The scheme is checked against the settings, whatever the files hold.
        let e = tls
            .connection("redis://127.0.0.1:6379", &Loaded::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("use rediss://"), "{e}");
        assert!(tls
            .connection("rediss://127.0.0.1:6379", &Loaded::default())
            .is_ok());
        let e = tls
            .connection("rediss://127.0.0.1:6379/#insecure", &Loaded::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("#insecure"), "{e}");

        let plain = RedisSecurity::default();
        let with_password = Loaded {
            password: Some("pw2".into()),
            ..Loaded::default()
        };
        let e = plain
            .connection("redis://u:pw1@127.0.0.1:6379", &with_password)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("give one") && !e.contains("pw1") && !e.contains("pw2"),
            "{e}"
        );
        let info = plain
            .connection("redis://u:pw1@127.0.0.1:6379", &Loaded::default())
            .unwrap();
        assert_eq!(info.redis_settings().password(), Some("pw1"));

        let e = plain
            .connection(
                "redis://127.0.0.1:6379",
                &Loaded {
                    username: Some("alice".into()),
                    ..Loaded::default()
                },
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("without a password"), "{e}");
        let info = plain
            .connection(
                "redis://127.0.0.1:6379",
                &Loaded {
                    username: Some("alice".into()),
                    password: Some("pw".into()),
                    ..Loaded::default()
                },
            )
            .unwrap();
        assert_eq!(info.redis_settings().username(), Some("alice"));
        assert_eq!(info.redis_settings().password(), Some("pw"));
        let e = plain
            .connection(
                "redis://bob:pw@127.0.0.1:6379",
                &Loaded {
                    username: Some("alice".into()),
                    ..Loaded::default()
                },
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bob") && e.contains("alice") && !e.contains("pw@"),
            "{e}"
        );
    }

    /// Lets the pause run out at once.
    fn expire(r: &Refusals) {
        if let Some(refused) = r.state().refused.as_mut() {
            refused.until = Instant::now();
        }
    }

    fn pause(r: &Refusals) -> Duration {
        r.state()
            .refused
            .as_ref()
            .map(|s| s.pause)
            .unwrap_or_default()
    }

    /// Runs `before_call` with a probe that answers `answer` and counts its runs; waits for
    /// the probe (if one started) to report.
    async fn attempt(
        r: &Arc<Refusals>,
        answer: Result<(), StoreError>,
        probes: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Result<Attempt, StoreError> {
        let counter = Arc::clone(probes);
        let result = r.before_call("n", move || async move {
            counter.fetch_add(1, Ordering::SeqCst);
            answer
        });
        // A started probe reports by itself; wait (bounded) until it has.
        for _ in 0..200 {
            if !r.state().refused.as_ref().is_some_and(|s| s.probing) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        result
    }

    #[tokio::test]
    async fn refusals_hold_calls_back_and_probe_once_per_pause() {
        let r = Arc::new(Refusals::default());
        let probes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        assert_eq!(attempt(&r, Ok(()), &probes).await, Ok(Attempt::Go));
        let refused = StoreError::Auth("WRONGPASS".into());
        // Many calls in flight fail at once: one refusal, one pause.
        for _ in 0..5 {
            r.after_call("n", Some(&refused));
        }
        // Other errors say nothing about the credentials.
        r.after_call("n", Some(&StoreError::Loading));
        assert!(r.holding_back());
        assert_eq!(pause(&r), REFUSED_PAUSE_MIN);
        // While the pause runs: the refusal, at once, and no probe.
        assert_eq!(attempt(&r, Ok(()), &probes).await, Err(refused.clone()));
        assert_eq!(probes.load(Ordering::SeqCst), 0);
        // The pause is over: one probe, refused again: a longer pause.
        expire(&r);
        assert_eq!(
            attempt(&r, Err(refused.clone()), &probes).await,
            Err(refused.clone())
        );
        assert_eq!(probes.load(Ordering::SeqCst), 1);
        assert_eq!(pause(&r), REFUSED_PAUSE_MIN * 2);
        assert_eq!(attempt(&r, Ok(()), &probes).await, Err(refused.clone()));
        assert_eq!(
            probes.load(Ordering::SeqCst),
            1,
            "no probe before the pause is over"
        );
        // A probe that cannot reach Redis keeps the pause.
        expire(&r);
        let _ = attempt(&r, Err(StoreError::Timeout(PROBE_TIMEOUT)), &probes).await;
        assert_eq!(pause(&r), REFUSED_PAUSE_MIN * 2);
        assert!(r.holding_back());
        // The pause never grows beyond the maximum.
        for _ in 0..10 {
            expire(&r);
            let _ = attempt(&r, Err(refused.clone()), &probes).await;
        }
        assert_eq!(pause(&r), REFUSED_PAUSE_MAX);
        // A probe that gets through ends it; the next call reconnects, the ones after go on.
        expire(&r);
        let _ = attempt(&r, Ok(()), &probes).await;
        assert!(!r.holding_back());
        assert_eq!(attempt(&r, Ok(()), &probes).await, Ok(Attempt::Reconnect));
        assert_eq!(attempt(&r, Ok(()), &probes).await, Ok(Attempt::Go));
    }

    #[tokio::test]
    async fn a_diagnosis_finds_a_hidden_refusal_once() {
        let r = Arc::new(Refusals::default());
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let probe = |answer: Result<(), StoreError>| {
            let runs = Arc::clone(&runs);
            move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                answer
            }
        };
        let settle = || async {
            for _ in 0..200 {
                if !r.state().diagnosing {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        // Not refused: nothing held back; no second diagnosis right away.
        r.diagnose("n", probe(Err(StoreError::Connection("refused".into()))));
        settle().await;
        assert!(!r.holding_back());
        r.diagnose("n", probe(Ok(())));
        settle().await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Later, a diagnosis that meets a refusal starts holding back.
        r.state().diagnosed = None;
        r.diagnose("n", probe(Err(StoreError::Auth("WRONGPASS".into()))));
        settle().await;
        assert!(r.holding_back());
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn credential_errors_are_told_apart() {
        let auth: redis::RedisError = (
            redis::ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        )
            .into();
        assert!(matches!(credential_error(&auth), Some(StoreError::Auth(_))));
        let tls = redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        ));
        assert!(matches!(credential_error(&tls), Some(StoreError::Tls(_))));
        let cluster: redis::RedisError = (
            redis::ErrorKind::Io,
            "Failed to create initial connections",
            "invalid peer certificate: UnknownIssuer".to_owned(),
        )
            .into();
        assert!(matches!(
            credential_error(&cluster),
            Some(StoreError::Tls(_))
        ));
        let noauth =
            redis::make_extension_error("NOAUTH".into(), Some("Authentication required.".into()));
        let e = credential_error(&noauth)
            .expect("NOAUTH is a refusal")
            .to_string();
        assert!(e.contains("requires authentication"), "{e}");
        let refused =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(credential_error(&refused), None);
    }
}
