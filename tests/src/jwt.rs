//! HS256 tokens for the tests that run Envoy's `jwt_authn` in front of the filter: the key
//! set Envoy verifies with and tokens signed by it (no JWT crate: base64url and HMAC-SHA256
//! over `sha2` are a few lines).

use sha2::{Digest, Sha256};

/// The shared secret of the test tokens (key id `k1`).
const SECRET: &[u8] = b"tollgate-e2e-hs256-secret-0123456789";

/// The JWKS Envoy's `jwt_authn` verifies the tokens of [`token`] with (`local_jwks`).
pub fn jwks() -> String {
    format!(
        r#"{{"keys":[{{"kty":"oct","alg":"HS256","kid":"k1","k":"{}"}}]}}"#,
        b64url(SECRET)
    )
}

/// An HS256 token issued by `tollgate-e2e` with these claims (JSON members, without braces),
/// valid for an hour.
pub fn token(claims: &str) -> String {
    let header = b64url(br#"{"alg":"HS256","typ":"JWT","kid":"k1"}"#);
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        + 3600;
    let payload = b64url(format!(r#"{{"iss":"tollgate-e2e","exp":{exp},{claims}}}"#).as_bytes());
    let signing_input = format!("{header}.{payload}");
    let signature = b64url(&hmac_sha256(SECRET, signing_input.as_bytes()));
    format!("{signing_input}.{signature}")
}

/// base64url without padding (JWT encoding).
fn b64url(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

/// HMAC-SHA256 of `message` under `key` (at most one block long).
fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    let mut block = [0u8; 64];
    block[..key.len()].copy_from_slice(key);
    let pad = |byte: u8| block.iter().map(|b| b ^ byte).collect::<Vec<u8>>();
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .to_vec()
}
