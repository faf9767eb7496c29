//! A blocking HTTP/1.1 client over TLS, for the limiter's mutual-TLS listener: it trusts a
//! given CA, presents a client certificate or none, and reports the certificate the server
//! presented (to see which one a rotation put in force). A refused handshake is an `Err`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::error::{HarnessError, Result};
use crate::pki::CertFiles;

/// Whom the client trusts and who it is.
#[derive(Debug, Clone)]
pub struct TlsClient {
    /// CA certificate(s), PEM.
    pub ca_pem: String,
    /// The client certificate to present, if any.
    pub identity: Option<CertFiles>,
    /// The name the server's certificate must carry.
    pub server_name: String,
}

/// What the server answered.
#[derive(Debug, Clone)]
pub struct TlsResponse {
    pub status: u16,
    pub body: String,
    /// The leaf certificate the server presented (DER).
    pub server_cert: Vec<u8>,
}

impl TlsClient {
    pub fn new(ca_pem: &str, identity: Option<&CertFiles>) -> TlsClient {
        TlsClient {
            ca_pem: ca_pem.to_owned(),
            identity: identity.cloned(),
            server_name: "localhost".into(),
        }
    }

    fn config(&self) -> Result<Arc<rustls::ClientConfig>> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            let cert = cert.map_err(|e| HarnessError::new(format!("CA PEM: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| HarnessError::new(format!("CA: {e}")))?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| HarnessError::new(e.to_string()))?
            .with_root_certificates(roots);
        let mut config = match &self.identity {
            None => builder.with_no_client_auth(),
            Some(identity) => {
                let chain = CertificateDer::pem_slice_iter(identity.cert_pem.as_bytes())
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| HarnessError::new(format!("client cert PEM: {e}")))?;
                let key = PrivateKeyDer::from_pem_slice(identity.key_pem.as_bytes())
                    .map_err(|e| HarnessError::new(format!("client key PEM: {e}")))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| HarnessError::new(e.to_string()))?
            }
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// One request (`Connection: close`), bounded by `timeout` for connect, handshake and
    /// every read.
    pub fn request(
        &self,
        port: u16,
        method: &str,
        path: &str,
        body: &str,
        timeout: Duration,
    ) -> Result<TlsResponse> {
        let name = ServerName::try_from(self.server_name.clone())
            .map_err(|e| HarnessError::new(e.to_string()))?;
        let mut conn = rustls::ClientConnection::new(self.config()?, name)
            .map_err(|e| HarnessError::new(e.to_string()))?;
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let mut tcp = TcpStream::connect_timeout(&addr, timeout)?;
        tcp.set_read_timeout(Some(timeout))?;
        tcp.set_write_timeout(Some(timeout))?;
        while conn.is_handshaking() {
            conn.complete_io(&mut tcp)
                .map_err(|e| HarnessError::new(format!("TLS handshake: {e}")))?;
        }
        let server_cert = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.as_ref().to_vec())
            .unwrap_or_default();
        let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
        let head = format!(
            "{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(head.as_bytes())
            .map_err(|e| HarnessError::new(format!("TLS write: {e}")))?;
        let mut raw = Vec::new();
        if let Err(e) = tls.read_to_end(&mut raw) {
            // A server that closes without close_notify still sent a whole answer.
            if raw.is_empty() {
                return Err(HarnessError::new(format!("TLS read: {e}")));
            }
        }
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| HarnessError::new(format!("no HTTP answer: {text:?}")))?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| HarnessError::new(format!("no status in {head:?}")))?;
        Ok(TlsResponse {
            status,
            body: body.to_owned(),
            server_cert,
        })
    }
}
