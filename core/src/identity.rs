//! Pure helpers for identity parts of a key: client IP from the socket or from
//! `X-Forwarded-For` with a number of trusted hops, and API keys kept only as a digest.

use crate::key::digest_hex;
use std::net::{IpAddr, SocketAddr};

/// Most `X-Forwarded-For` entries looked at (right to left); a longer header is still read,
/// only its rightmost entries matter.
pub const MAX_TRUSTED_HOPS: u32 = 16;

/// Client IP from an address as Envoy reports it (`1.2.3.4:5678`, `[::1]:5678`, or a bare IP).
pub fn ip_from_socket_address(text: &str) -> Option<IpAddr> {
    let text = text.trim();
    text.parse::<SocketAddr>()
        .map(|sa| sa.ip())
        .or_else(|_| text.parse::<IpAddr>())
        .ok()
        .map(|ip| ip.to_canonical())
}

/// The client IP as seen by the outermost of `trusted_hops` trusted proxies: each trusted proxy
/// appends the address it received the request from, so the client is the `trusted_hops`-th
/// entry from the right. `None` if there are fewer entries or the entry is not an IP
/// (a forged or garbled header never becomes a key).
pub fn ip_from_forwarded_for(header: &str, trusted_hops: u32) -> Option<IpAddr> {
    if trusted_hops == 0 || trusted_hops > MAX_TRUSTED_HOPS {
        return None;
    }
    let entry = header
        .rsplit(',')
        .nth(usize::try_from(trusted_hops - 1).ok()?)?;
    ip_from_socket_address(entry)
}

/// What an API key becomes in a key part: a digest, never the secret itself.
pub fn api_key_digest(raw: &[u8]) -> String {
    format!("sha256-{}", digest_hex(raw, 16))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses() {
        assert_eq!(
            ip_from_socket_address("10.0.0.1:5000"),
            Some("10.0.0.1".parse().unwrap())
        );
        assert_eq!(
            ip_from_socket_address("[::1]:80"),
            Some("::1".parse().unwrap())
        );
        assert_eq!(
            ip_from_socket_address("[::ffff:1.2.3.4]:80"),
            Some("1.2.3.4".parse().unwrap())
        );
        assert_eq!(ip_from_socket_address("garbage"), None);
    }

    #[test]
    fn forwarded_for_counts_trusted_hops_from_the_right() {
        let xff = "6.6.6.6, 1.1.1.1, 2.2.2.2";
        assert_eq!(
            ip_from_forwarded_for(xff, 1),
            Some("2.2.2.2".parse().unwrap())
        );
        assert_eq!(
            ip_from_forwarded_for(xff, 2),
            Some("1.1.1.1".parse().unwrap())
        );
        assert_eq!(
            ip_from_forwarded_for(xff, 3),
            Some("6.6.6.6".parse().unwrap())
        );
        assert_eq!(ip_from_forwarded_for(xff, 4), None);
        assert_eq!(ip_from_forwarded_for("1.1.1.1, evil", 1), None);
        assert_eq!(ip_from_forwarded_for(xff, 0), None);
    }

    #[test]
    fn api_keys_are_digested() {
        let d = api_key_digest(b"sk_live_secret");
        assert!(d.starts_with("sha256-") && d.len() == 39);
        assert!(!d.contains("secret"));
    }
}
