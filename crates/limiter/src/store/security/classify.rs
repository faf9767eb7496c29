//! Which Redis errors are refused credentials (a failed TLS handshake, a refused or missing
//! `AUTH`), told from other failures by the error's kind and code, its source chain, or (for
//! the Redis Cluster client, which reports failed connections as text) its text.

use crate::store::StoreError;

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

#[cfg(test)]
mod tests {
    use super::*;

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
