//! Pure helpers for identity parts of a key: client IP from Envoy's client address or from
//! `X-Forwarded-For` behind a number of trusted proxies (counted as Envoy's
//! `xff_num_trusted_hops`), and API keys kept only as a digest.

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

/// The client IP behind `trusted_hops` trusted proxies, counted as Envoy's
/// `xff_num_trusted_hops` counts them: the `trusted_hops`-th `X-Forwarded-For` entry from the
/// right as the header reached Envoy. The filter sees the header after the connection
/// manager, which with `use_remote_address: true` has appended the address that connected to
/// it, so that entry is the `trusted_hops + 1`-th from the right here (with
/// `use_remote_address: false` Envoy appends nothing and also takes the `N + 1`-th: the same
/// entry Envoy picks either way). Behind one trusted proxy, `1` is the address that proxy
/// appended (the client), never the proxy's own. `None` if the header has too few entries or
/// that entry is not an IP (a forged or garbled header never becomes a key); `trusted_hops` 0
/// is the connection's own address, read from Envoy, not from the header.
pub fn ip_from_forwarded_for(header: &str, trusted_hops: u32) -> Option<IpAddr> {
    if trusted_hops == 0 || trusted_hops > MAX_TRUSTED_HOPS {
        return None;
    }
    let entry = header
        .rsplit(',')
        .nth(usize::try_from(trusted_hops).ok()?)?;
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
    fn forwarded_for_counts_trusted_hops_as_envoy_does() {
        // A client sent "6.6.6.6" (forged), two trusted proxies appended 1.1.1.1 (the client)
        // and 2.2.2.2 (the first proxy), and Envoy appended 3.3.3.3 (the second proxy, which
        // connected to it).
        let xff = "6.6.6.6, 1.1.1.1, 2.2.2.2, 3.3.3.3";
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
        // One trusted proxy: 1 is the client it appended, not the proxy Envoy appended.
        assert_eq!(
            ip_from_forwarded_for("1.1.1.1,10.0.0.9", 1),
            Some("1.1.1.1".parse().unwrap())
        );
        assert_eq!(ip_from_forwarded_for("10.0.0.9", 1), None);
        assert_eq!(ip_from_forwarded_for("evil, 10.0.0.9", 1), None);
        assert_eq!(ip_from_forwarded_for(xff, 0), None);
    }

    #[test]
    fn api_keys_are_digested() {
        let d = api_key_digest(b"sk_live_secret");
        assert!(d.starts_with("sha256-") && d.len() == 39);
        assert!(!d.contains("secret"));
    }
}
