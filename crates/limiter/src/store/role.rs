//! Which role a Redis node plays (`ROLE`), so the single-node store decides only on a primary.
//!
//! A replica's state lags its primary's, so a decision taken on it can grant tokens the
//! primary has already given away; and a replica with `replica-read-only no` would even take
//! the Function's writes locally (they are never replicated, and the next full sync drops
//! them). So every call of the single-node store is pipelined right behind a `ROLE` on the same
//! connection (one round trip, no extra wait), and a reply that says anything but `master`
//! turns the call into [`StoreError::ReadOnly`] (`UNAVAILABLE`), whatever the Function
//! answered; from then on (and at start) `ROLE` goes alone until it says `master`, so a
//! replica runs no call at all. Only a `REPLICAOF` that lands between the two commands slips through: that call
//! is decided on the state the node held as primary an instant before (like a write lost in
//! a failover), and the next call is refused. A Redis Cluster needs no such check: its replicas redirect
//! every keyed command to the primary (`MOVED`), and the cluster client never asks a replica.

use redis::Value;

use super::StoreError;

/// `ROLE`.
pub fn role_cmd() -> redis::Cmd {
    redis::cmd("ROLE")
}

/// The error of a `ROLE` that Redis answered with an error: a user whose ACL lacks `ROLE`
/// (it is in `@admin`/`@dangerous`) is told what to grant; anything else maps as usual.
pub fn role_error(node: &str, e: &redis::RedisError) -> StoreError {
    if e.code() == Some("NOPERM") {
        return StoreError::Config(format!(
            "the Redis user may not run ROLE on `{node}`, which the limiter needs to decide on \
             primaries only: grant it `+role` ({e})"
        ));
    }
    super::script::map_error(e)
}

fn text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

/// `Ok(())` when `reply` (to `ROLE`) says `node` is a primary; otherwise why it must not
/// decide: a replica (naming its primary and the link's state), a Sentinel, or a reply that
/// is not a role at all.
pub fn check_primary(node: &str, reply: &Value) -> Result<(), StoreError> {
    let Value::Array(fields) = reply else {
        return Err(StoreError::Protocol(format!(
            "ROLE reply from `{node}`: {reply:?}"
        )));
    };
    match text(fields.first()).as_deref() {
        Some("master") => Ok(()),
        Some("slave") => {
            let host = text(fields.get(1)).unwrap_or_else(|| "?".into());
            let port = text(fields.get(2)).unwrap_or_else(|| "?".into());
            let link = text(fields.get(3)).unwrap_or_else(|| "?".into());
            Err(StoreError::ReadOnly(format!(
                "`{node}` is a replica of {host}:{port} (link {link}), not a primary: its state \
                 may be stale, so it decides nothing; point --redis at the primary"
            )))
        }
        Some("sentinel") => Err(StoreError::Config(format!(
            "`{node}` is a Sentinel, not a Redis primary: point --redis at the primary"
        ))),
        _ => Err(StoreError::Protocol(format!(
            "ROLE reply from `{node}`: {reply:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn a_primary_may_decide() {
        let reply = Value::Array(vec![bulk("master"), Value::Int(42), Value::Array(vec![])]);
        assert_eq!(check_primary("127.0.0.1:6379", &reply), Ok(()));
    }

    #[test]
    fn a_replica_is_refused_with_its_primary_named() {
        let reply = Value::Array(vec![
            bulk("slave"),
            bulk("127.0.0.1"),
            Value::Int(6379),
            bulk("connected"),
            Value::Int(42),
        ]);
        let err = check_primary("127.0.0.1:6380", &reply).unwrap_err();
        assert_eq!(err.kind(), "read_only");
        assert!(err.is_transient(), "a promotion makes it decide again");
        let text = err.to_string();
        assert!(
            text.contains("`127.0.0.1:6380` is a replica of 127.0.0.1:6379"),
            "{text}"
        );
        assert!(text.contains("link connected"), "{text}");
    }

    #[test]
    fn sentinels_and_garbage_are_refused() {
        let sentinel = Value::Array(vec![bulk("sentinel"), Value::Array(vec![])]);
        assert_eq!(check_primary("s", &sentinel).unwrap_err().kind(), "config");
        assert_eq!(
            check_primary("s", &Value::Nil).unwrap_err().kind(),
            "protocol"
        );
        let odd = Value::Array(vec![bulk("leader")]);
        assert_eq!(check_primary("s", &odd).unwrap_err().kind(), "protocol");
    }
}
