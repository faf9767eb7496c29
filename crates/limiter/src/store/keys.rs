//! The Redis key schema of the Redis stores (one Redis and Redis Cluster alike).
//!
//! Every key tollgate writes to Redis starts with `tollgate:{<hash tag>}:`, the hash tag being
//! the first part of the wire key (`tollgate_core::key::hash_tag`). A bucket and the lease
//! records drawn from it therefore share one Redis Cluster slot, which is what lets one
//! Redis Function call read and write them together, and what keeps one tenant's buckets
//! (when the tenant is the first key part) on one primary. Wire keys are already escaped
//! (`tollgate_core::key::validate_key`), so no input can contain `{` or `}` and move a key
//! to another slot; lease ids are escaped here with `tollgate_core::key::escape_part`.
//!
//! Each algorithm has keys of its own, so a policy switched from one to another (or to another
//! window length) starts from fresh state instead of reading the other's as its own:
//!
//! | state | key | type |
//! | --- | --- | --- |
//! | token bucket | `tollgate:{<tag>}:<policy>:<key>` | hash (`tollgate.lua`) |
//! | fixed window: newest window seen | `…:<policy>:<key>\|fixed:<grid>` | string: window index |
//! | fixed window: its count | `…\|fixed:<grid>:w<index>` | string (INCRBY) |
//! | sliding window counter | `…:<policy>:<key>\|sliding:<window_ms>` | hash `{w, c, p}` |
//! | sliding log: units | `…:<policy>:<key>\|log:<window_ms>` | sorted set, score = time |
//! | sliding log: newest time seen | `…\|log:<window_ms>:seen` | string: ms |
//!
//! Buckets of the RateLimitService (`crate::rls`, Envoy's gRPC rate-limit protocol) are fixed
//! windows under the reserved policy name [`RLS_POLICY`] (`~` is not allowed in a policy
//! name, so no policy document can name their state) and the key [`rls_key`] builds from the
//! request's domain and descriptor entries: its first part, so its hash tag, is the domain and
//! the descriptor's first entry, so every descriptor of one domain that starts with the same
//! entry (e.g. one tenant) lives in one Redis Cluster slot and can be decided in one call.
//!
//! `<grid>` is the window's length in ms, or a calendar period (`1w`, `1mo`, `12mo` for a year:
//! [`window_grid`]), whose window index is a week or month number, not a multiple of a length.
//!
//! A policy with `limits` has its entry as the wire key's last part (`acme:!vpro`, `acme:!o`):
//! the entry's name, never its numbers, so a reload that changes an entry's rate finds the same
//! state, and the hash tag (the first part) is the tenant's whatever the entry.
//!
//! `|` is neither in a policy name nor in an escaped key part (nor in an escaped lease id), so
//! a window's key can never be another bucket's or another window's. The keys derived from a
//! window's state key (`:w<index>`, `:seen`) are derived inside the Redis Function from the
//! state key it is given (the window index comes from Redis' clock), and share its hash tag,
//! so its slot.

use tollgate_core::calendar::Calendar;
use tollgate_core::key::{escape_part, hash_tag};
use tollgate_core::policy::Algorithm;
use tollgate_core::window::Window;

/// Prefix of every Redis key tollgate writes.
pub const PREFIX: &str = "tollgate";

/// Redis key of a bucket: `tollgate:{<hash tag>}:<policy>:<key>`.
pub fn bucket_key(policy: &str, key: &str) -> String {
    format!("{PREFIX}:{{{}}}:{policy}:{key}", hash_tag(key))
}

/// Redis key of the state `algorithm` keeps for (`policy`, `key`): the bucket
/// ([`bucket_key`]) of a token bucket, `<bucket key>|<fixed|sliding|log>:<grid>` of a
/// window ([`window_grid`]).
pub fn state_key(algorithm: &Algorithm, policy: &str, key: &str) -> String {
    let bucket = bucket_key(policy, key);
    match algorithm {
        Algorithm::TokenBucket => bucket,
        Algorithm::FixedWindow(w) => format!("{bucket}|fixed:{}", window_grid(w)),
        Algorithm::SlidingWindow(w) => format!("{bucket}|sliding:{}", window_grid(w)),
        Algorithm::SlidingLog(w) => format!("{bucket}|log:{}", window_grid(w)),
    }
}

/// A window's grid as its state key and the Redis Function's window argument name it: its
/// length in ms (`1000`), or its calendar period, `<n>w` (weeks from Monday) or `<n>mo`
/// (months from January; a year is `12mo`).
pub fn window_grid(w: &Window) -> String {
    match w.calendar {
        None => w.window_ms.to_string(),
        Some(Calendar::Weeks(n)) => format!("{n}w"),
        Some(Calendar::Months(n)) => format!("{n}mo"),
    }
}

/// Suffix of a fixed window's count key, after its state key and before the window index
/// (`tollgate.lua` appends it).
pub const FIXED_COUNT_SUFFIX: &str = ":w";
/// Suffix of a sliding log's "newest time seen" key, after its state key.
pub const LOG_SEEN_SUFFIX: &str = ":seen";

/// Redis key of the count of window `index` of the fixed window whose state key is `state`.
pub fn fixed_count_key(state: &str, index: u64) -> String {
    format!("{state}{FIXED_COUNT_SUFFIX}{index}")
}

/// Redis key of the newest time seen by the sliding log whose state key is `state`.
pub fn log_seen_key(state: &str) -> String {
    format!("{state}{LOG_SEEN_SUFFIX}")
}

/// Redis key of a lease's dedup record, in the same slot as its bucket:
/// `tollgate:{<hash tag>}:lease:<escaped lease id>`.
pub fn lease_key(key: &str, lease_id: &str) -> String {
    format!(
        "{PREFIX}:{{{}}}:lease:{}",
        hash_tag(key),
        escape_part(lease_id.as_bytes())
    )
}

/// Policy name of the RateLimitService's buckets: outside the policy-name alphabet
/// (`[A-Za-z0-9._-]`), so it can never be a policy document's.
pub const RLS_POLICY: &str = "~rls";

/// One length-prefixed field of an RLS key part: `<bytes>~<text>`, so no choice of domains,
/// keys and values can make two different descriptors produce the same part.
fn push_field(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(text.len().to_string().as_bytes());
    out.push(b'~');
    out.extend_from_slice(text.as_bytes());
}

/// The wire key of an RLS bucket: the domain with the first entry (the hash tag), then the
/// other entries, each part escaped (`tollgate_core::key::escape_part`: a part longer than
/// 64 bytes once escaped becomes its SHA-256 digest, so the key stays bounded whatever the
/// input). Entries are `(key, value)`; `value` is what the bucket is counted under (the
/// request's value, or a `share_threshold` pattern). An empty `entries` gives the domain's
/// part alone.
pub fn rls_key(domain: &str, entries: &[(&str, &str)]) -> String {
    let mut first = Vec::new();
    push_field(&mut first, domain);
    let mut rest = Vec::new();
    for (i, (key, value)) in entries.iter().enumerate() {
        let out = if i == 0 { &mut first } else { &mut rest };
        push_field(out, key);
        push_field(out, value);
    }
    let head = escape_part(&first);
    if entries.len() < 2 {
        head
    } else {
        format!("{head}:{}", escape_part(&rest))
    }
}

/// Redis key of the fixed window of `window_ms` an RLS bucket (wire key `key`, [`rls_key`])
/// is counted in: `state_key` of a fixed window under [`RLS_POLICY`], built in one step
/// (the RateLimitService builds one per counted descriptor). `tollgate.lua`'s
/// `tollgate_v4_count` keeps each window's count under it plus `FIXED_COUNT_SUFFIX` and the
/// window's index, like a fixed window's lease.
pub fn rls_window_key(key: &str, window_ms: u64) -> String {
    format!(
        "{PREFIX}:{{{}}}:{RLS_POLICY}:{key}|fixed:{window_ms}",
        hash_tag(key)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::key::join_parts;

    #[test]
    fn redis_keys_keep_the_tenant_as_hash_tag() {
        let key = join_parts(&[escape_part(b"t{1}:x"), escape_part(b"GET /a")]);
        let redis = bucket_key("p", &key);
        assert_eq!(redis, "tollgate:{t%7b1%7d%3ax}:p:t%7b1%7d%3ax:GET%20%2fa");
        // Exactly one `{` and one `}`: the tag cannot be moved by input.
        assert_eq!(redis.matches('{').count(), 1);
        assert_eq!(redis.matches('}').count(), 1);
        assert!(lease_key(&key, "id{}").starts_with("tollgate:{t%7b1%7d%3ax}:lease:"));
    }

    #[test]
    fn each_algorithm_has_keys_of_its_own_in_the_bucket_slot() {
        use tollgate_core::window::Window;
        let key = "acme:GET%20%2fa";
        let w = Window::new(10, 1_000).unwrap();
        let longer = Window::new(10, 60_000).unwrap();
        // A month, and 31 days: the same longest length, other windows.
        let month = Window::calendar(10, Calendar::Months(1)).unwrap();
        let days = Window::new(10, month.window_ms).unwrap();
        let year = Window::calendar(10, Calendar::Months(12)).unwrap();
        let week = Window::calendar(10, Calendar::Weeks(1)).unwrap();
        let keys = [
            state_key(&Algorithm::TokenBucket, "p", key),
            state_key(&Algorithm::FixedWindow(w), "p", key),
            state_key(&Algorithm::SlidingWindow(w), "p", key),
            state_key(&Algorithm::SlidingLog(w), "p", key),
            state_key(&Algorithm::FixedWindow(longer), "p", key),
            fixed_count_key(&state_key(&Algorithm::FixedWindow(w), "p", key), 1_700_000),
            log_seen_key(&state_key(&Algorithm::SlidingLog(w), "p", key)),
            state_key(&Algorithm::FixedWindow(month), "p", key),
            state_key(&Algorithm::FixedWindow(days), "p", key),
            state_key(&Algorithm::FixedWindow(year), "p", key),
            state_key(&Algorithm::FixedWindow(week), "p", key),
        ];
        assert_eq!(keys[0], bucket_key("p", key));
        assert_eq!(keys[1], "tollgate:{acme}:p:acme:GET%20%2fa|fixed:1000");
        assert_eq!(
            keys[5],
            "tollgate:{acme}:p:acme:GET%20%2fa|fixed:1000:w1700000"
        );
        assert_eq!(keys[6], "tollgate:{acme}:p:acme:GET%20%2fa|log:1000:seen");
        assert_eq!(keys[7], "tollgate:{acme}:p:acme:GET%20%2fa|fixed:1mo");
        assert_eq!(
            keys[8],
            "tollgate:{acme}:p:acme:GET%20%2fa|fixed:2678400000"
        );
        assert_eq!(keys[9], "tollgate:{acme}:p:acme:GET%20%2fa|fixed:12mo");
        assert_eq!(keys[10], "tollgate:{acme}:p:acme:GET%20%2fa|fixed:1w");
        let distinct: std::collections::HashSet<&String> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len(), "{keys:?}");
        for k in &keys {
            assert!(k.starts_with("tollgate:{acme}:"), "{k}");
            assert_eq!(k.matches('{').count(), 1, "{k}");
        }
        // No token bucket key (any policy, any valid key) contains `|`.
        assert!(!bucket_key("p", "a:w1").contains('|'));
    }

    #[test]
    fn rls_keys_are_valid_distinct_and_tagged_by_domain_and_first_entry() {
        use tollgate_core::key::validate_key;
        let keys = [
            rls_key("d", &[]),
            rls_key("d", &[("k", "v")]),
            rls_key("d", &[("k", "v"), ("p", "/a")]),
            rls_key("d", &[("k", "v"), ("p", "/b")]),
            rls_key("d", &[("k_v", "")]),
            rls_key("d_k", &[("v", "")]),
            rls_key("d", &[("k", "v"), ("p", "/a"), ("x", "")]),
            rls_key("d", &[("k", "v"), ("p", "/a:x")]),
            rls_key("e", &[("k", "v")]),
        ];
        let distinct: std::collections::HashSet<&String> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len(), "{keys:?}");
        for k in &keys {
            validate_key(k).unwrap();
        }
        assert_eq!(hash_tag(&keys[2]), hash_tag(&keys[3]));
        assert_eq!(hash_tag(&keys[2]), keys[1]);
        assert_ne!(hash_tag(&keys[1]), hash_tag(&keys[8]));
        // Hostile bytes stay escaped, and a long value stays bounded.
        let long = "v".repeat(65_536);
        let k = rls_key("d{x}", &[("a:b", "{}"), ("c", &long)]);
        validate_key(&k).unwrap();
        assert!(k.len() < 200, "{}", k.len());
        assert_eq!(bucket_key(RLS_POLICY, &k).matches('{').count(), 1);
        // The window a count runs in is a fixed window's lease state, in the same slot.
        for window_ms in [1_000, 60_000, 31_536_000_000] {
            let window = Window::new(3, window_ms).unwrap();
            assert_eq!(
                rls_window_key(&k, window_ms),
                state_key(&Algorithm::FixedWindow(window), RLS_POLICY, &k)
            );
        }
    }

    #[test]
    fn a_lease_record_shares_its_bucket_slot_whatever_the_id() {
        let key = "acme:GET%20%2fa";
        let tag = |k: &str| {
            let open = k.find('{').unwrap_or(0);
            let close = k.find('}').unwrap_or(0);
            k.get(open..=close).map(str::to_owned)
        };
        for id in ["a", "{x}", "a:b", "}{", &"i".repeat(300)] {
            let record = lease_key(key, id);
            assert_eq!(tag(&record), tag(&bucket_key("p", key)), "{id}: {record}");
            assert_eq!(record.matches('{').count(), 1, "{record}");
        }
    }
}
