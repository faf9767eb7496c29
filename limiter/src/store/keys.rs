//! The Redis key schema of the Redis stores (one Redis and Redis Cluster alike).
//!
//! Every key tollgate writes to Redis starts with `tollgate:{<hash tag>}:`, the hash tag being
//! the first part of the wire key (`tollgate_core::key::hash_tag`). A bucket and the lease
//! records drawn from it therefore share one Redis Cluster slot, which is what lets one
//! Redis Function call read and write them together, and what keeps one tenant's buckets
//! (when the tenant is the first key part) on one primary. Wire keys are already escaped
//! (`tollgate_core::key::validate_key`), so no input can contain `{` or `}` and move a key
//! to another slot; lease ids are escaped here with `tollgate_core::key::escape_part`.

use tollgate_core::key::{escape_part, hash_tag};

/// Prefix of every Redis key tollgate writes.
pub const PREFIX: &str = "tollgate";

/// Redis key of a bucket: `tollgate:{<hash tag>}:<policy>:<key>`.
pub fn bucket_key(policy: &str, key: &str) -> String {
    format!("{PREFIX}:{{{}}}:{policy}:{key}", hash_tag(key))
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
