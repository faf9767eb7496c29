//! The one owner of tollgate's key format.
//!
//! A bucket is named by its policy and a *key*: the escaped identity parts joined by `:`
//! (e.g. `acme` or `acme:GET%20%2Fitems%2F%7Bid%7D`). The filter builds keys, sends them to the
//! limiter, and uses `<policy>:<key>` for its local table; the limiter's Redis stores turn them
//! into Redis keys with the first part as the Redis Cluster hash tag ([`hash_tag`]; the Redis
//! key schema itself lives with those stores, in `tollgate-limiter`).
//!
//! User-supplied bytes are escaped so that `{`, `}`, `:` (and anything outside a small safe
//! alphabet) cannot move a key to another Redis Cluster slot, or collide with another tenant's
//! key; parts longer than [`MAX_PART_BYTES`] once escaped are replaced by a SHA-256 digest, so
//! key size is bounded whatever the input.

use sha2::{Digest, Sha256};

/// Longest escaped part kept verbatim; longer ones become `#<32 hex>`.
pub const MAX_PART_BYTES: usize = 64;
/// Most parts a key may have.
pub const MAX_PARTS: usize = 8;
/// Longest key on the wire: every part at its bound plus separators.
pub const MAX_KEY_BYTES: usize = MAX_PARTS * (MAX_PART_BYTES + 1);
/// The key part used for requests without the identity when a policy says `anonymous`.
/// `!` is outside the escaped alphabet, so no real identity can produce it.
pub const ANONYMOUS_PART: &str = "!anonymous";

/// Bytes kept as they are in a key part, one flag per byte value (every key part of every
/// request is checked byte by byte: a table lookup, not a chain of range tests). Built at
/// compile time, where an index out of range fails the build.
#[allow(clippy::indexing_slicing)]
const PLAIN: [bool; 256] = {
    let mut plain = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        let b = byte as u8;
        plain[byte] = b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~' | b'@' | b'+' | b'=');
        byte += 1;
    }
    plain
};

/// The last key part of a policy with `limits` names the entry whose rate decides the bucket:
/// `!v<escaped value>` (a `values` entry), [`DEFAULT_ENTRY_PART`] or [`OVERRIDE_ENTRY_PART`]
/// (the override of the key the part follows). `!` is outside the escaped alphabet, so no
/// identity can produce an entry part, and an entry part is never [`ANONYMOUS_PART`].
pub const VALUE_ENTRY_PREFIX: &str = "!v";
/// The entry part of a policy's `limits.default`.
pub const DEFAULT_ENTRY_PART: &str = "!d";
/// The entry part of a policy's `limits.overrides` entry for the key before it.
pub const OVERRIDE_ENTRY_PART: &str = "!o";
/// Longest escaped value a `values` entry may name (its part, with the prefix, stays within
/// [`MAX_PART_BYTES`] and is never replaced by a digest).
pub const MAX_ENTRY_VALUE_BYTES: usize = MAX_PART_BYTES - VALUE_ENTRY_PREFIX.len();

/// Whether `part` has the form of a limits entry part (not whether a policy has the entry).
pub fn is_entry_part(part: &str) -> bool {
    if part == DEFAULT_ENTRY_PART || part == OVERRIDE_ENTRY_PART {
        return true;
    }
    part.strip_prefix(VALUE_ENTRY_PREFIX).is_some_and(|value| {
        value.len() <= MAX_ENTRY_VALUE_BYTES
            && !value.starts_with(['#', '!'])
            && is_valid_part(value)
    })
}

/// A key split into its identity and its limits entry part, when its last part is one.
pub fn split_entry(key: &str) -> (&str, Option<&str>) {
    match key.rsplit_once(':') {
        Some((identity, last)) if is_entry_part(last) => (identity, Some(last)),
        _ => (key, None),
    }
}

fn is_plain(byte: u8) -> bool {
    PLAIN.get(usize::from(byte)).copied().unwrap_or(false)
}

/// Escapes one identity part: safe bytes stay, others become `%XX`; too long → `#` + digest.
/// The three forms (plain/percent, digest, anonymous) never collide: `#` and `!` are always
/// percent-escaped in the first form.
pub fn escape_part(raw: &[u8]) -> String {
    let mut out = String::new();
    escape_part_into(&mut out, raw);
    out
}

/// [`escape_part`] appended to `out`: the filter builds a whole key in one buffer.
pub fn escape_part_into(out: &mut String, raw: &[u8]) {
    // The common case: a short part of plain (ASCII) bytes only, copied as it is.
    if raw.len() <= MAX_PART_BYTES && raw.iter().all(|b| is_plain(*b)) {
        // Plain bytes are ASCII, so valid UTF-8: appended in one copy (the check passes at
        // once on ASCII).
        if let Ok(plain) = std::str::from_utf8(raw) {
            out.push_str(plain);
            return;
        }
    }
    let escaped_len: usize = raw.iter().map(|b| if is_plain(*b) { 1 } else { 3 }).sum();
    if escaped_len > MAX_PART_BYTES {
        out.push('#');
        out.push_str(&digest_hex(raw, 16));
        return;
    }
    if escaped_len == raw.len() {
        // Every byte is plain (ASCII): copied as it is.
        if let Ok(plain) = std::str::from_utf8(raw) {
            out.push_str(plain);
            return;
        }
    }
    out.reserve(escaped_len);
    for &byte in raw {
        if is_plain(byte) {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(hex_digit(byte >> 4));
            out.push(hex_digit(byte & 0x0f));
        }
    }
}

/// Lowercase hex of the first `bytes` bytes of SHA-256(`data`).
pub fn digest_hex(data: &[u8], bytes: usize) -> String {
    let digest = Sha256::digest(data);
    digest
        .iter()
        .take(bytes)
        .flat_map(|b| [hex_digit(b >> 4), hex_digit(b & 0x0f)])
        .collect()
}

fn hex_digit(nibble: u8) -> char {
    char::from(match nibble {
        0..=9 => b'0' + nibble,
        _ => b'a' + (nibble - 10),
    })
}

/// Joins escaped parts into a key.
pub fn join_parts<S: AsRef<str>>(parts: &[S]) -> String {
    let mut key = String::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            key.push(':');
        }
        key.push_str(part.as_ref());
    }
    key
}

/// Checks a key that arrived over the wire: 1..=[`MAX_PARTS`] parts, each one of the forms
/// [`escape_part`] produces (or [`ANONYMOUS_PART`]), and at most one limits entry part after
/// at least one identity part (whether the policy has that entry is the policy's to say).
pub fn validate_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("key is empty".into());
    }
    if let (identity, Some(_)) = split_entry(key) {
        if key.len() > MAX_KEY_BYTES {
            return Err(format!("key is longer than {MAX_KEY_BYTES} bytes"));
        }
        return validate_key(identity).and_then(|()| {
            if identity.split(':').count() >= MAX_PARTS {
                Err(format!("key has more than {MAX_PARTS} parts"))
            } else if split_entry(identity).1.is_some() {
                Err("key has more than one limits entry part".into())
            } else {
                Ok(())
            }
        });
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(format!("key is longer than {MAX_KEY_BYTES} bytes"));
    }
    let mut count = 0;
    for part in key.split(':') {
        count += 1;
        if count > MAX_PARTS {
            return Err(format!("key has more than {MAX_PARTS} parts"));
        }
        if !is_valid_part(part) {
            return Err(format!("key part `{part}` is not an escaped identity"));
        }
    }
    Ok(())
}

fn is_valid_part(part: &str) -> bool {
    if part == ANONYMOUS_PART {
        return true;
    }
    if let Some(hex) = part.strip_prefix('#') {
        return hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    }
    if part.is_empty() || part.len() > MAX_PART_BYTES {
        return false;
    }
    let bytes = part.as_bytes();
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex_ok = bytes
                .get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
            if !hex_ok {
                return false;
            }
            i += 3;
        } else if is_plain(b) {
            i += 1;
        } else {
            return false;
        }
    }
    true
}

/// Whether a policy name can appear in keys and metric names: `[a-z0-9_-]`, 1..=64 bytes
/// (no `.`: Envoy's stats tag extraction splits metric names on it).
pub fn is_valid_policy_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_'))
}

/// The Redis Cluster hash tag of a key: its first part. All of one tenant's buckets (when the
/// tenant is the first key part) therefore share a slot and can be decided in one script.
pub fn hash_tag(key: &str) -> &str {
    key.split(':').next().unwrap_or(key)
}

/// Local (filter) name of a bucket: `<policy>:<key>`.
pub fn local_bucket_id(policy: &str, key: &str) -> String {
    let mut id = String::with_capacity(policy.len() + 1 + key.len());
    id.push_str(policy);
    id.push(':');
    id.push_str(key);
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_slot_moving_and_separator_bytes() {
        assert_eq!(escape_part(b"acme"), "acme");
        assert_eq!(escape_part(b"a:b"), "a%3ab");
        assert_eq!(escape_part(b"{x}"), "%7bx%7d");
        assert_eq!(escape_part(b"#1"), "%231");
        assert_eq!(escape_part(b"!anonymous"), "%21anonymous");
        assert_eq!(escape_part(&[0, 255]), "%00%ff");
        let long = escape_part(&[b'x'; 200]);
        assert!(long.starts_with('#') && long.len() == 33);
        assert_ne!(escape_part(&[b'x'; 200]), escape_part(&[b'x'; 201]));
    }

    #[test]
    fn validates_wire_keys() {
        assert!(validate_key("acme").is_ok());
        assert!(validate_key("acme:GET%20%2fa").is_ok());
        assert!(validate_key(ANONYMOUS_PART).is_ok());
        assert!(validate_key(&escape_part(&[b'y'; 100])).is_ok());
        for bad in [
            "",
            "a::b",
            "a{b}",
            "%zz",
            "%4",
            "#abc",
            "a b",
            "!x",
            &"a:".repeat(9),
        ] {
            assert!(validate_key(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn entry_parts_come_last_and_once() {
        assert!(validate_key("acme:!vpro").is_ok());
        assert!(validate_key("acme:GET%20%2fa:!d").is_ok());
        assert!(validate_key("!anonymous:!o").is_ok());
        assert_eq!(split_entry("acme:!vpro"), ("acme", Some("!vpro")));
        assert_eq!(
            split_entry("acme:!vgold%20plan"),
            ("acme", Some("!vgold%20plan"))
        );
        assert_eq!(split_entry("acme"), ("acme", None));
        assert_eq!(split_entry("!anonymous"), ("!anonymous", None));
        for bad in [
            "!vpro",
            "!d",
            "!vpro:acme",
            "acme:!d:!o",
            "acme:!v",
            "acme:!x",
            "acme:!v#0123",
            "acme:!v!anonymous",
            &format!("acme:!v{}", "p".repeat(63)),
            &format!("{}!d", "a:".repeat(8)),
        ] {
            assert!(validate_key(bad).is_err(), "{bad}");
        }
        assert!(validate_key(&format!("{}!d", "a:".repeat(7))).is_ok());
    }

    #[test]
    fn policy_names() {
        assert!(is_valid_policy_name("payments-per-tenant"));
        assert!(!is_valid_policy_name("Payments"));
        assert!(!is_valid_policy_name("a:b"));
        assert!(!is_valid_policy_name("a.b"));
        assert!(!is_valid_policy_name(""));
    }
}
