//! Certificates made at test time: a certificate authority and the server and client
//! certificates it signs, written as PEM files into a test's directory. Nothing here is ever
//! committed; every test that needs TLS makes its own.
//!
//! ```ignore
//! let ca = TestCa::new("tollgate test CA");
//! let server = ca.server(dir, "limiter", &["localhost", "127.0.0.1"]);
//! let client = ca.client(dir, "gateway", "spiffe://mesh/ns/gw/sa/envoy");
//! ```

use std::path::{Path, PathBuf};

use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate and its private key on disk (PEM), plus the certificate's PEM text.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub cert_pem: String,
    pub key_pem: String,
}

/// A certificate authority that signs test certificates.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

/// How long a certificate is valid: from a past day to a future one, or only in the past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    Current,
    Expired,
}

impl TestCa {
    /// A new CA (its own key; its certificate valid from 2020 to 2100).
    pub fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().expect("generate a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = date_time_ymd(2020, 1, 1);
        params.not_after = date_time_ymd(2100, 1, 1);
        let cert = params.self_signed(&key).expect("self-sign the CA");
        let cert_pem = cert.pem();
        let issuer = Issuer::new(params, key);
        TestCa { issuer, cert_pem }
    }

    /// The CA certificate (PEM).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Writes the CA certificate to `dir/<file>` and returns its path.
    pub fn write_cert(&self, dir: &Path, file: &str) -> PathBuf {
        let path = dir.join(file);
        std::fs::write(&path, &self.cert_pem).expect("write the CA certificate");
        path
    }

    /// A server certificate for `names` (DNS names or IP addresses), written as
    /// `dir/<label>.crt` and `dir/<label>.key`.
    pub fn server(&self, dir: &Path, label: &str, names: &[&str]) -> CertFiles {
        self.issue(dir, label, label, names, &[], Validity::Current, true)
    }

    /// A client certificate with common name `label` and, when given, a URI SAN (a SPIFFE id,
    /// as a mesh issues them).
    pub fn client(&self, dir: &Path, label: &str, uri: Option<&str>) -> CertFiles {
        let uris: Vec<&str> = uri.into_iter().collect();
        self.issue(dir, label, label, &[], &uris, Validity::Current, false)
    }

    /// A client certificate whose validity ended years ago.
    pub fn expired_client(&self, dir: &Path, label: &str) -> CertFiles {
        self.issue(dir, label, label, &[], &[], Validity::Expired, false)
    }

    /// Any certificate this CA signs.
    #[allow(clippy::too_many_arguments)]
    pub fn issue(
        &self,
        dir: &Path,
        label: &str,
        common_name: &str,
        names: &[&str],
        uris: &[&str],
        validity: Validity,
        server: bool,
    ) -> CertFiles {
        let key = KeyPair::generate().expect("generate a key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("parameters");
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        for name in names {
            let san = match name.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName((*name).try_into().expect("a DNS name")),
            };
            params.subject_alt_names.push(san);
        }
        for uri in uris {
            params
                .subject_alt_names
                .push(SanType::URI((*uri).try_into().expect("a URI")));
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = if server {
            vec![ExtendedKeyUsagePurpose::ServerAuth]
        } else {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        };
        let (not_before, not_after) = match validity {
            Validity::Current => (date_time_ymd(2020, 1, 1), date_time_ymd(2100, 1, 1)),
            Validity::Expired => (date_time_ymd(2000, 1, 1), date_time_ymd(2001, 1, 1)),
        };
        params.not_before = not_before;
        params.not_after = not_after;
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        let cert_pem = cert.pem();
        let key_pem = key.serialize_pem();
        let cert_path = dir.join(format!("{label}.crt"));
        let key_path = dir.join(format!("{label}.key"));
        std::fs::write(&cert_path, &cert_pem).expect("write a certificate");
        std::fs::write(&key_path, &key_pem).expect("write a key");
        CertFiles {
            cert: cert_path,
            key: key_path,
            cert_pem,
            key_pem,
        }
    }
}
