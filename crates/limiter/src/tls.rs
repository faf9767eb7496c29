//! The lease listener over TLS with client certificates (mutual TLS): only callers holding a
//! certificate signed by the configured CA — and, with an allow-list, naming an allowed
//! identity — get past the handshake, so nobody else can spend or drain a budget.
//!
//! rustls with the `ring` provider; HTTP/2 by ALPN (`h2`, what Envoy's cluster asks for) and
//! HTTP/1.1. A refused handshake ends the connection before any HTTP is read: no lease logic
//! runs for it, and `tollgate_limiter_tls_connections_total{result}` counts why.
//!
//! The certificate, its key and the client CA are files, polled for changes (kubelet secret
//! updates and cert-manager renewals replace them in place or by symlink swap). A complete,
//! valid new set replaces the configuration for the next handshake; connections already open
//! keep theirs. A set that does not load (a key that does not match, half-written files) is
//! logged with the reason and counted, and the configuration in force stays.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::metrics::Metrics;

/// How long a client may take to complete its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the listener's certificate, key and client CA are, and who may call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    /// The server certificate chain (PEM, leaf first).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates (PEM) a client certificate must chain to.
    pub client_ca: PathBuf,
    /// When not empty: a client certificate must also name one of these identities (a URI SAN
    /// such as a SPIFFE id, a DNS SAN, or the subject's common name), compared exactly.
    pub allow: Vec<String>,
    /// How often the three files are checked for changes.
    pub reload_every: Duration,
}

/// Why a TLS configuration could not be built from its files.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{flag} {path}: {reason}")]
    Invalid {
        flag: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error(
        "the certificate (--tls-cert) and key (--tls-key) do not make a TLS configuration: {0}"
    )]
    Config(String),
}

/// The bytes of the three files, compared to see whether anything changed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TlsFiles {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Vec<u8>,
}

impl TlsFiles {
    fn read(settings: &TlsSettings) -> Result<Self, TlsError> {
        let read = |flag: &'static str, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                flag,
                path: path.to_owned(),
                source,
            })
        };
        Ok(Self {
            cert: read("--tls-cert", &settings.cert)?,
            key: read("--tls-key", &settings.key)?,
            client_ca: read("--tls-client-ca", &settings.client_ca)?,
        })
    }
}

/// A built configuration and what the metrics say about it.
struct Loaded {
    config: Arc<rustls::ServerConfig>,
    /// `notAfter` of the served leaf certificate, Unix seconds.
    not_after: i64,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn build(settings: &TlsSettings, files: &TlsFiles) -> Result<Loaded, TlsError> {
    let invalid = |flag: &'static str, path: &Path, reason: String| TlsError::Invalid {
        flag,
        path: path.to_owned(),
        reason,
    };
    let chain = CertificateDer::pem_slice_iter(&files.cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid("--tls-cert", &settings.cert, format!("not PEM: {e}")))?;
    let Some(leaf) = chain.first() else {
        return Err(invalid(
            "--tls-cert",
            &settings.cert,
            "holds no certificate".into(),
        ));
    };
    let not_after = certificate_not_after(leaf)
        .map_err(|reason| invalid("--tls-cert", &settings.cert, reason))?;
    let key = PrivateKeyDer::from_pem_slice(&files.key).map_err(|e| {
        invalid(
            "--tls-key",
            &settings.key,
            format!("holds no private key: {e}"),
        )
    })?;
    let mut roots = RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(&files.client_ca) {
        let ca = ca.map_err(|e| {
            invalid(
                "--tls-client-ca",
                &settings.client_ca,
                format!("not PEM: {e}"),
            )
        })?;
        roots.add(ca).map_err(|e| {
            invalid(
                "--tls-client-ca",
                &settings.client_ca,
                format!("not a CA certificate: {e}"),
            )
        })?;
    }
    if roots.is_empty() {
        return Err(invalid(
            "--tls-client-ca",
            &settings.client_ca,
            "holds no certificate".into(),
        ));
    }
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| {
            invalid(
                "--tls-client-ca",
                &settings.client_ca,
                format!("cannot verify clients with it: {e}"),
            )
        })?;
    let verifier: Arc<dyn ClientCertVerifier> = if settings.allow.is_empty() {
        verifier
    } else {
        Arc::new(AllowListed {
            inner: verifier,
            allow: settings.allow.clone(),
        })
    };
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Loaded {
        config: Arc::new(config),
        not_after,
    })
}

fn certificate_not_after(der: &CertificateDer<'_>) -> Result<i64, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
        .map_err(|e| format!("not an X.509 certificate: {e}"))?;
    Ok(cert.validity().not_after.timestamp())
}

/// The identities a certificate names: URI and DNS subject alternative names, then the
/// subject's common names.
pub fn identities(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let mut names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            match name {
                x509_parser::extensions::GeneralName::URI(uri) => names.push((*uri).to_owned()),
                x509_parser::extensions::GeneralName::DNSName(dns) => names.push((*dns).to_owned()),
                _ => {}
            }
        }
    }
    for cn in cert.subject().iter_common_name() {
        if let Ok(cn) = cn.as_str() {
            names.push(cn.to_owned());
        }
    }
    names
}

/// A client verifier that also requires one allowed identity in the (already verified)
/// certificate.
#[derive(Debug)]
struct AllowListed {
    inner: Arc<dyn ClientCertVerifier>,
    allow: Vec<String>,
}

impl ClientCertVerifier for AllowListed {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if identities(end_entity.as_ref())
            .iter()
            .any(|id| self.allow.contains(id))
        {
            Ok(verified)
        } else {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Label values of `tollgate_limiter_tls_connections_total`.
pub mod result {
    pub const ACCEPTED: &str = "accepted";
    /// No client certificate was presented.
    pub const NO_CLIENT_CERTIFICATE: &str = "no_client_certificate";
    /// The client certificate does not chain to the client CA (or its signature is bad).
    pub const UNTRUSTED_CLIENT: &str = "untrusted_client";
    /// The client certificate is outside its validity period.
    pub const EXPIRED_CLIENT: &str = "expired_client";
    /// Trusted, but none of its identities is in `--tls-allow`.
    pub const CLIENT_NOT_ALLOWED: &str = "client_not_allowed";
    /// The client did not finish its handshake within the timeout.
    pub const HANDSHAKE_TIMEOUT: &str = "handshake_timeout";
    /// Any other handshake failure (not TLS, no common version or cipher, connection lost).
    pub const HANDSHAKE_FAILED: &str = "handshake_failed";
}

/// Why a handshake failed, as a metric label.
fn classify(error: &std::io::Error) -> &'static str {
    let Some(tls) = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    else {
        return result::HANDSHAKE_FAILED;
    };
    match tls {
        rustls::Error::NoCertificatesPresented => result::NO_CLIENT_CERTIFICATE,
        rustls::Error::InvalidCertificate(
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. },
        ) => result::EXPIRED_CLIENT,
        rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure) => {
            result::CLIENT_NOT_ALLOWED
        }
        rustls::Error::InvalidCertificate(_) => result::UNTRUSTED_CLIENT,
        _ => result::HANDSHAKE_FAILED,
    }
}

/// Accepts TLS connections with the configuration in force.
pub struct Acceptor {
    current: RwLock<Arc<rustls::ServerConfig>>,
    metrics: Metrics,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor").finish_non_exhaustive()
    }
}

impl Acceptor {
    /// Loads the files; the limiter does not start without a valid set. Returns the acceptor
    /// and the task that reloads it until `stop` turns true.
    pub fn start(
        settings: TlsSettings,
        metrics: Metrics,
        stop: watch::Receiver<bool>,
    ) -> Result<(Arc<Self>, tokio::task::JoinHandle<()>), TlsError> {
        let files = TlsFiles::read(&settings)?;
        let loaded = build(&settings, &files)?;
        metrics.set_tls_not_after(loaded.not_after);
        let acceptor = Arc::new(Self {
            current: RwLock::new(loaded.config),
            metrics,
        });
        let task = tokio::spawn(reload(settings, files, Arc::clone(&acceptor), stop));
        Ok((acceptor, task))
    }

    fn config(&self) -> Arc<rustls::ServerConfig> {
        match self.current.read() {
            Ok(guard) => Arc::clone(&guard),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    fn replace(&self, config: Arc<rustls::ServerConfig>) {
        match self.current.write() {
            Ok(mut guard) => *guard = config,
            Err(poisoned) => *poisoned.into_inner() = config,
        }
    }

    /// The handshake, bounded in time; `None` (counted, logged at debug) when it fails.
    pub async fn accept(&self, tcp: TcpStream) -> Option<TlsStream<TcpStream>> {
        let peer = tcp.peer_addr().ok();
        let acceptor = TlsAcceptor::from(self.config());
        let outcome = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
        let failure = match outcome {
            Ok(Ok(stream)) => {
                self.metrics.tls_connection(result::ACCEPTED);
                return Some(stream);
            }
            Ok(Err(e)) => (classify(&e), e.to_string()),
            Err(_) => (result::HANDSHAKE_TIMEOUT, "timed out".to_owned()),
        };
        self.metrics.tls_connection(failure.0);
        tracing::debug!(peer = ?peer, result = failure.0, error = %failure.1,
            "TLS handshake refused");
        None
    }
}

/// Polls the files every `reload_every`; installs a changed set that loads, keeps the one in
/// force otherwise. A failure is logged and counted once until it changes or clears.
async fn reload(
    settings: TlsSettings,
    mut loaded: TlsFiles,
    acceptor: Arc<Acceptor>,
    mut stop: watch::Receiver<bool>,
) {
    let mut reported: Option<String> = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(settings.reload_every) => {}
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    return;
                }
                continue;
            }
        }
        let outcome = TlsFiles::read(&settings).and_then(|files| {
            if files == loaded {
                Ok(None)
            } else {
                build(&settings, &files).map(|built| Some((files, built)))
            }
        });
        match outcome {
            Ok(None) => reported = None,
            Ok(Some((files, built))) => {
                acceptor.replace(built.config);
                acceptor.metrics.set_tls_not_after(built.not_after);
                acceptor.metrics.tls_reload("ok");
                tracing::info!(cert = %settings.cert.display(), "TLS certificate reloaded");
                loaded = files;
                reported = None;
            }
            Err(e) => {
                let text = e.to_string();
                if reported.as_deref() != Some(text.as_str()) {
                    let result = match e {
                        TlsError::Read { .. } => "unreadable",
                        _ => "invalid",
                    };
                    tracing::error!(error = %text,
                        "cannot use the new TLS certificate files; the ones in force stay");
                    acceptor.metrics.tls_reload(result);
                    reported = Some(text);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_handshake_errors() {
        let io = |e: rustls::Error| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
        assert_eq!(
            classify(&io(rustls::Error::NoCertificatesPresented)),
            result::NO_CLIENT_CERTIFICATE
        );
        assert_eq!(
            classify(&io(rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer
            ))),
            result::UNTRUSTED_CLIENT
        );
        assert_eq!(
            classify(&io(rustls::Error::InvalidCertificate(
                CertificateError::Expired
            ))),
            result::EXPIRED_CLIENT
        );
        assert_eq!(
            classify(&io(rustls::Error::InvalidCertificate(
                CertificateError::ApplicationVerificationFailure
            ))),
            result::CLIENT_NOT_ALLOWED
        );
        assert_eq!(
            classify(&std::io::Error::other("reset")),
            result::HANDSHAKE_FAILED
        );
    }

    #[test]
    fn bad_files_name_their_flag() {
        let dir = std::env::temp_dir().join(format!("tollgate-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let settings = TlsSettings {
            cert: write("cert.pem", "not a certificate"),
            key: write("key.pem", "not a key"),
            client_ca: write("ca.pem", ""),
            allow: Vec::new(),
            reload_every: Duration::from_secs(1),
        };
        let files = TlsFiles::read(&settings).unwrap();
        let e = build(&settings, &files).err().unwrap().to_string();
        assert!(
            e.contains("--tls-cert") && e.contains("no certificate"),
            "{e}"
        );
        let missing = TlsSettings {
            key: dir.join("absent.pem"),
            ..settings
        };
        let e = TlsFiles::read(&missing).err().unwrap().to_string();
        assert!(e.contains("--tls-key") && e.contains("absent.pem"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let dir = std::env::temp_dir().join(format!("tollgate-tls-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = tollgate_e2e::pki::TestCa::new("unit CA");
        let one = ca.server(&dir, "one", &["localhost"]);
        let two = ca.server(&dir, "two", &["localhost"]);
        let settings = TlsSettings {
            cert: one.cert.clone(),
            key: two.key.clone(),
            client_ca: ca.write_cert(&dir, "ca.crt"),
            allow: vec!["gateway".into()],
            reload_every: Duration::from_secs(1),
        };
        let files = TlsFiles::read(&settings).unwrap();
        let e = build(&settings, &files).err().unwrap().to_string();
        assert!(e.contains("--tls-cert") && e.contains("--tls-key"), "{e}");
        let matching = TlsSettings {
            key: one.key.clone(),
            ..settings
        };
        let loaded = build(&matching, &TlsFiles::read(&matching).unwrap()).unwrap();
        assert_eq!(loaded.not_after, 4_102_444_800, "2100-01-01");
        assert_eq!(
            loaded.config.alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        let client = ca.client(&dir, "gateway", Some("spiffe://t/sa/gw"));
        let der =
            rustls::pki_types::CertificateDer::from_pem_slice(client.cert_pem.as_bytes()).unwrap();
        assert_eq!(
            identities(der.as_ref()),
            vec!["spiffe://t/sa/gw", "gateway"]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
