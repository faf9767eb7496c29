//! Reading the PEM files a flag names: the bytes, the certificates, the private key. Every
//! error names the flag and the path, never the file's contents.

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::store::StoreError;

pub(super) fn config_error(message: String) -> StoreError {
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
