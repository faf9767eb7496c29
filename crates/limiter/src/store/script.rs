//! The Rust side of the `tollgate_v4` Redis Function library (`tollgate.lua`): the library
//! source, how calls are encoded, how replies are decoded, and how Redis errors map onto
//! [`StoreError`]. Shared by the single-node and the cluster store, so both speak the exact
//! same contract.

use std::sync::atomic::{AtomicU64, Ordering};

use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};
use tollgate_core::policy::Algorithm;

use super::{
    CountItem, CountOutcome, ExecStats, Grant, LeaseItem, LeaseOutcome, ReturnItem, ReturnOutcome,
    StoreError, StoreSettings,
};

/// The library source (`FUNCTION LOAD REPLACE`).
pub const LIBRARY: &str = include_str!("tollgate.lua");
/// Library name; carries the contract version.
pub const LIBRARY_NAME: &str = "tollgate_v4";
pub const LEASE_FN: &str = "tollgate_v4_lease";
pub const RETURN_FN: &str = "tollgate_v4_return";
pub const PING_FN: &str = "tollgate_v4_ping";
pub const COUNT_FN: &str = "tollgate_v4_count";

/// The algorithm as the library names it (the policy document's name).
fn algorithm_arg(algorithm: &Algorithm) -> &'static str {
    algorithm.name()
}

/// `%.17g`-equivalent text of an `f64` that Lua's `tonumber` reads back to the same value
/// (Rust's shortest round-trip formatting).
fn float_arg(x: f64) -> String {
    format!("{x:?}")
}

/// `FCALL tollgate_v4_lease` for one unit.
pub fn lease_cmd(items: &[LeaseItem], settings: &StoreSettings) -> Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(LEASE_FN).arg(items.len() * 2);
    for item in items {
        cmd.arg(item.state_key()).arg(item.lease_key());
    }
    cmd.arg(settings.dedup_ttl_ms)
        .arg(settings.assignment_period_ms)
        .arg(settings.lease_ttl_ms);
    for item in items {
        cmd.arg(algorithm_arg(&item.algorithm));
        match item.algorithm.window() {
            // A window: its limit, no refill.
            Some(w) => cmd.arg(w.limit).arg("0"),
            None => cmd
                .arg(float_arg(item.limits.capacity()))
                .arg(float_arg(item.limits.refill_per_ms())),
        };
        cmd.arg(item.min)
            .arg(item.want)
            .arg(item.holder.as_deref().unwrap_or(""))
            .arg(float_arg(item.demand_per_ms))
            .arg(
                item.algorithm
                    .window()
                    .map_or_else(|| "0".to_string(), super::keys::window_grid),
            );
    }
    cmd
}

/// `FCALL tollgate_v4_count` for one unit: each item's window key, then its limit, window
/// length and cost.
pub fn count_cmd(items: &[CountItem]) -> Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(COUNT_FN).arg(items.len());
    for item in items {
        cmd.arg(item.window_key());
    }
    for item in items {
        cmd.arg(item.limit).arg(item.window_ms).arg(item.cost);
    }
    cmd
}

/// `FCALL tollgate_v4_return` for one return.
pub fn return_cmd(item: &ReturnItem) -> Cmd {
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(RETURN_FN)
        .arg(2)
        .arg(item.bucket_key())
        .arg(item.lease_key())
        .arg(algorithm_arg(&item.algorithm))
        .arg(float_arg(item.limits.capacity()))
        .arg(float_arg(item.limits.refill_per_ms()))
        .arg(item.unused);
    cmd
}

/// `FCALL_RO tollgate_v4_ping 0`.
pub fn ping_cmd() -> Cmd {
    let mut cmd = redis::cmd("FCALL_RO");
    cmd.arg(PING_FN).arg(0);
    cmd
}

/// `FUNCTION LOAD REPLACE <library>`.
pub fn load_cmd() -> Cmd {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LOAD").arg("REPLACE").arg(LIBRARY);
    cmd
}

fn protocol(what: &str, value: &Value) -> StoreError {
    StoreError::Protocol(format!("{what}: {value:?}"))
}

fn int(value: &Value, what: &str) -> Result<u64, StoreError> {
    match value {
        Value::Int(i) => u64::try_from(*i).map_err(|_| protocol(what, value)),
        _ => Err(protocol(what, value)),
    }
}

fn text(value: &Value, what: &str) -> Result<String, StoreError> {
    match value {
        Value::BulkString(bytes) => {
            String::from_utf8(bytes.clone()).map_err(|_| protocol(what, value))
        }
        Value::SimpleString(s) => Ok(s.clone()),
        _ => Err(protocol(what, value)),
    }
}

fn float(value: &Value, what: &str) -> Result<f64, StoreError> {
    let t = text(value, what)?;
    t.parse::<f64>().map_err(|_| protocol(what, value))
}

/// A millisecond count the function sent as text: an integer, or a float that saturates.
fn millis(value: &Value, what: &str) -> Result<u64, StoreError> {
    let t = text(value, what)?;
    if let Ok(ms) = t.parse::<u64>() {
        return Ok(ms);
    }
    let f = t.parse::<f64>().map_err(|_| protocol(what, value))?;
    if f.is_nan() || f < 0.0 {
        return Err(protocol(what, value));
    }
    // `as` saturates, exactly like core's `ms as u64`.
    Ok(f as u64)
}

/// Values per item in a lease reply.
const REPLY_FIELDS: usize = 7;

/// A window lease's `expires_ms` (`-1`: a bucket's lease, `None`).
fn window_expiry(value: &Value, what: &str) -> Result<Option<u64>, StoreError> {
    match value {
        Value::Int(-1) => Ok(None),
        _ => int(value, what).map(Some),
    }
}

/// Decodes `{ now_ms, (granted, remaining, retry_after_ms, replayed, share_per_ms,
/// period_ms, expires_ms) × n }`.
pub fn parse_lease_reply(value: &Value, n: usize) -> Result<LeaseOutcome, StoreError> {
    let Value::Array(items) = value else {
        return Err(protocol("lease reply is not an array", value));
    };
    if items.len() != 1 + REPLY_FIELDS * n {
        return Err(protocol(
            &format!("lease reply has {} elements for {n} items", items.len()),
            value,
        ));
    }
    let mut iter = items.iter();
    let now_ms = int(iter.next().unwrap_or(&Value::Nil), "lease reply: now_ms")?;
    let mut grants = Vec::with_capacity(n);
    let nil = Value::Nil;
    for _ in 0..n {
        let granted = int(iter.next().unwrap_or(&nil), "lease reply: granted")?;
        let remaining = float(iter.next().unwrap_or(&nil), "lease reply: remaining")?;
        let retry_after_ms = millis(iter.next().unwrap_or(&nil), "lease reply: retry_after_ms")?;
        let replayed = int(iter.next().unwrap_or(&nil), "lease reply: replayed")? == 1;
        let share_per_ms = float(iter.next().unwrap_or(&nil), "lease reply: share_per_ms")?;
        let period_ms = int(iter.next().unwrap_or(&nil), "lease reply: period_ms")?;
        let expires_ms = window_expiry(iter.next().unwrap_or(&nil), "lease reply: expires_ms")?;
        if !share_per_ms.is_finite() || share_per_ms < 0.0 {
            return Err(protocol("lease reply: share_per_ms", value));
        }
        grants.push(Grant {
            granted,
            remaining,
            retry_after_ms,
            replayed,
            share_per_ms,
            period_ms,
            expires_ms,
        });
    }
    Ok(LeaseOutcome { now_ms, grants })
}

/// Decodes `{ now_ms, admitted (1|0), remaining × n }`.
pub fn parse_count_reply(value: &Value, n: usize) -> Result<CountOutcome, StoreError> {
    let Value::Array(items) = value else {
        return Err(protocol("count reply is not an array", value));
    };
    let [now_ms, admitted, remaining @ ..] = items.as_slice() else {
        return Err(protocol("count reply is too short", value));
    };
    if remaining.len() != n {
        return Err(protocol(
            &format!("count reply has {} counts for {n} items", remaining.len()),
            value,
        ));
    }
    let admitted = match int(admitted, "count reply: admitted")? {
        0 => false,
        1 => true,
        _ => return Err(protocol("count reply: admitted", value)),
    };
    Ok(CountOutcome {
        now_ms: int(now_ms, "count reply: now_ms")?,
        admitted,
        remaining: remaining
            .iter()
            .map(|r| int(r, "count reply: remaining"))
            .collect::<Result<_, _>>()?,
    })
}

/// Decodes `{ now_ms, returned }`.
pub fn parse_return_reply(value: &Value) -> Result<ReturnOutcome, StoreError> {
    match value {
        Value::Array(items) if items.len() == 2 => {
            let nil = Value::Nil;
            Ok(ReturnOutcome {
                now_ms: int(items.first().unwrap_or(&nil), "return reply: now_ms")?,
                returned: int(items.get(1).unwrap_or(&nil), "return reply: returned")?,
            })
        }
        _ => Err(protocol("return reply", value)),
    }
}

/// Checks the ping reply names our library.
pub fn check_ping_reply(value: &Value) -> Result<(), StoreError> {
    match value {
        Value::BulkString(b) if b.as_slice() == LIBRARY_NAME.as_bytes() => Ok(()),
        Value::SimpleString(s) if s == LIBRARY_NAME => Ok(()),
        _ => Err(protocol("ping reply", value)),
    }
}

/// `INFO commandstats`: the node's statistics of every command it ran.
pub fn commandstats_cmd() -> Cmd {
    let mut cmd = redis::cmd("INFO");
    cmd.arg("commandstats");
    cmd
}

/// The `FCALL` line of an `INFO commandstats` reply
/// (`cmdstat_fcall:calls=N,usec=U,usec_per_call=…`): every lease and return decision the node
/// ran (readiness pings are `FCALL_RO`, counted apart), all clients together. A node that has
/// run none has no such line: zero.
pub fn parse_commandstats(value: &Value) -> Result<ExecStats, StoreError> {
    let text = match value {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::VerbatimString { text, .. } => text.clone(),
        Value::SimpleString(s) => s.clone(),
        other => return Err(protocol("INFO commandstats", other)),
    };
    let Some(fields) = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("cmdstat_fcall:"))
    else {
        return Ok(ExecStats::default());
    };
    let field = |name: &str| {
        fields
            .split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| {
                StoreError::Protocol(format!("INFO commandstats: no `{name}` in `{fields}`"))
            })
    };
    Ok(ExecStats {
        calls: field("calls")?,
        usec: field("usec")? as f64,
    })
}

/// Whether `e` says our functions are not loaded on the node that answered (a restarted or
/// flushed server, a fresh replica promoted without them).
pub fn is_function_missing(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
        || e.detail().is_some_and(|d| d.contains("Function not found"))
        || e.to_string().contains("Function not found")
}

/// Maps a redis-rs error onto a [`StoreError`].
pub fn map_error(e: &RedisError) -> StoreError {
    if is_function_missing(e) {
        return StoreError::FunctionMissing(e.to_string());
    }
    // Before the I/O errors: a failed TLS handshake is one, but not a transient one.
    if let Some(refused) = super::security::credential_error(e) {
        return refused;
    }
    if e.is_timeout() {
        return StoreError::Connection(format!("timed out: {e}"));
    }
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        return StoreError::Connection(e.to_string());
    }
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::BusyLoading) => StoreError::Loading,
        ErrorKind::Server(ServerErrorKind::ReadOnly) => StoreError::ReadOnly(e.to_string()),
        ErrorKind::Server(
            ServerErrorKind::Moved
            | ServerErrorKind::Ask
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown,
        ) => StoreError::Cluster(e.to_string()),
        ErrorKind::ClusterConnectionNotFound => StoreError::Connection(e.to_string()),
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => StoreError::Protocol(e.to_string()),
        ErrorKind::InvalidClientConfig => StoreError::Config(e.to_string()),
        _ => StoreError::Server(e.to_string()),
    }
}

/// Coalesces library reloads: when many concurrent calls find the functions missing at
/// once (a restarted Redis), one of them reloads and the others just retry.
#[derive(Debug, Default)]
pub struct Reloader {
    lock: tokio::sync::Mutex<()>,
    generation: AtomicU64,
}

impl Reloader {
    /// The current generation; pass it to [`Reloader::reload`] after a call failed.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Runs `load` unless someone reloaded since `seen` was read.
    pub async fn reload<F, Fut>(&self, seen: u64, load: F) -> Result<(), StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(), StoreError>>,
    {
        let _guard = self.lock.lock().await;
        if self.generation() != seen {
            return Ok(());
        }
        load().await?;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn commandstats_give_the_fcall_line() {
        let reply = redis::Value::BulkString(
            b"# Commandstats\r\ncmdstat_fcall_ro:calls=3,usec=30,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\
              cmdstat_fcall:calls=120,usec=4567,usec_per_call=38.06,rejected_calls=0,failed_calls=1\r\n"
                .to_vec(),
        );
        assert_eq!(
            super::parse_commandstats(&reply).unwrap(),
            super::ExecStats {
                calls: 120,
                usec: 4567.0
            }
        );
        let none =
            redis::Value::BulkString(b"# Commandstats\r\ncmdstat_ping:calls=1,usec=1\r\n".to_vec());
        assert_eq!(
            super::parse_commandstats(&none).unwrap(),
            super::ExecStats::default()
        );
        let bad = redis::Value::BulkString(b"cmdstat_fcall:usec=1\r\n".to_vec());
        assert!(super::parse_commandstats(&bad)
            .unwrap_err()
            .to_string()
            .contains("calls"));
        assert!(super::parse_commandstats(&redis::Value::Nil).is_err());
    }

    use super::*;
    use tollgate_core::bucket::Limits;

    #[test]
    fn float_args_round_trip() {
        for x in [0.1, 1.0 / 3.0, 100.0, 1e-11, 123_456_789.123_456_78] {
            let s = float_arg(x);
            assert_eq!(s.parse::<f64>().unwrap(), x, "{s}");
        }
    }

    #[test]
    fn lease_command_layout() {
        let limits = Limits::new(100, 1_000, 20).unwrap();
        let item = LeaseItem {
            id: "id-1".into(),
            policy: "p".into(),
            key: "acme".into(),
            limits,
            algorithm: Algorithm::TokenBucket,
            min: 1,
            want: 5,
            holder: Some("i-1".into()),
            demand_per_ms: 0.25,
        };
        let anonymous = LeaseItem {
            id: "id-2".into(),
            holder: None,
            demand_per_ms: 0.0,
            ..item.clone()
        };
        let window = tollgate_core::window::Window::new(7, 250).unwrap();
        let windowed = LeaseItem {
            id: "id-3".into(),
            algorithm: Algorithm::SlidingLog(window),
            ..anonymous.clone()
        };
        let monthly = tollgate_core::window::Window::calendar(
            9,
            tollgate_core::calendar::Calendar::Months(1),
        )
        .unwrap();
        let calendar = LeaseItem {
            id: "id-4".into(),
            algorithm: Algorithm::FixedWindow(monthly),
            ..anonymous.clone()
        };
        let cmd = lease_cmd(
            &[item, anonymous, windowed, calendar],
            &StoreSettings {
                dedup_ttl_ms: 60_000,
                assignment_period_ms: 1_000,
                lease_ttl_ms: 2_000,
            },
        );
        let args: Vec<String> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
                _ => "<other>".into(),
            })
            .collect();
        assert_eq!(
            args,
            [
                "FCALL",
                "tollgate_v4_lease",
                "8",
                "tollgate:{acme}:p:acme",
                "tollgate:{acme}:lease:id-1",
                "tollgate:{acme}:p:acme",
                "tollgate:{acme}:lease:id-2",
                "tollgate:{acme}:p:acme|log:250",
                "tollgate:{acme}:lease:id-3",
                "tollgate:{acme}:p:acme|fixed:1mo",
                "tollgate:{acme}:lease:id-4",
                "60000",
                "1000",
                "2000",
                "token_bucket",
                "20.0",
                "0.1",
                "1",
                "5",
                "i-1",
                "0.25",
                "0",
                "token_bucket",
                "20.0",
                "0.1",
                "1",
                "5",
                "",
                "0.0",
                "0",
                "sliding_log",
                "7",
                "0",
                "1",
                "5",
                "",
                "0.0",
                "250",
                "fixed_window",
                "9",
                "0",
                "1",
                "5",
                "",
                "0.0",
                "1mo"
            ]
        );
    }

    #[test]
    fn the_library_mirrors_the_rust_constants() {
        use tollgate_core::assign::MAX_HOLDERS;
        for line in [
            format!("local MAX_HOLDERS = {MAX_HOLDERS}\n"),
            format!(
                "local BUCKET_TTL_MARGIN_MS = {}\n",
                super::super::BUCKET_TTL_MARGIN_MS
            ),
            format!(
                "local MAX_BUCKET_TTL_MS = {}\n",
                super::super::MAX_BUCKET_TTL_MS
            ),
            format!(
                "local WINDOW_TTL_MARGIN_MS = {}\n",
                super::super::WINDOW_TTL_MARGIN_MS
            ),
            format!(
                "local FIXED_COUNT_SUFFIX = '{}'\n",
                super::super::keys::FIXED_COUNT_SUFFIX
            ),
            format!(
                "local LOG_SEEN_SUFFIX = '{}'\n",
                super::super::keys::LOG_SEEN_SUFFIX
            ),
            format!("#!lua name={LIBRARY_NAME}\n"),
            format!("redis.register_function('{LEASE_FN}', lease_fn)"),
            format!("redis.register_function('{RETURN_FN}', return_fn)"),
            format!("redis.register_function('{COUNT_FN}', count_fn)"),
            format!("function_name = '{PING_FN}',"),
            format!("return '{LIBRARY_NAME}'"),
        ] {
            assert!(LIBRARY.contains(&line), "tollgate.lua lacks {line:?}");
        }
    }

    #[test]
    fn count_command_layout_and_reply() {
        let item = |key: &str, limit, window_ms, cost| CountItem {
            key: key.into(),
            limit,
            window_ms,
            cost,
        };
        let cmd = count_cmd(&[item("t", 5, 1_000, 2), item("t:p", 1, 60_000, 1)]);
        let args: Vec<String> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
                _ => "<other>".into(),
            })
            .collect();
        assert_eq!(
            args,
            [
                "FCALL",
                "tollgate_v4_count",
                "2",
                "tollgate:{t}:~rls:t|fixed:1000",
                "tollgate:{t}:~rls:t:p|fixed:60000",
                "5",
                "1000",
                "2",
                "1",
                "60000",
                "1"
            ]
        );
        let reply = |v: Vec<i64>| Value::Array(v.into_iter().map(Value::Int).collect());
        assert_eq!(
            parse_count_reply(&reply(vec![1_700_000_000_000, 1, 3, 0]), 2).unwrap(),
            CountOutcome {
                now_ms: 1_700_000_000_000,
                admitted: true,
                remaining: vec![3, 0]
            }
        );
        assert!(
            !parse_count_reply(&reply(vec![7, 0, 1]), 1)
                .unwrap()
                .admitted
        );
        assert!(parse_count_reply(&reply(vec![7, 1, 1]), 2).is_err());
        assert!(parse_count_reply(&reply(vec![7, 2, 1]), 1).is_err());
        assert!(parse_count_reply(&reply(vec![7, 1, -1]), 1).is_err());
        assert!(parse_count_reply(&Value::Nil, 1).is_err());
    }

    #[test]
    fn parses_replies() {
        let v = Value::Array(vec![
            Value::Int(1_700_000_000_000),
            Value::Int(5),
            Value::BulkString(b"12.5".to_vec()),
            Value::BulkString(b"0".to_vec()),
            Value::Int(0),
            Value::BulkString(b"0".to_vec()),
            Value::Int(0),
            Value::Int(-1),
            Value::Int(0),
            Value::BulkString(b"-49.999999999999993".to_vec()),
            Value::BulkString(b"1.8446744073709552e+19".to_vec()),
            Value::Int(1),
            Value::BulkString(b"0.050000000000000003".to_vec()),
            Value::Int(1_000),
            Value::Int(250),
        ]);
        let o = parse_lease_reply(&v, 2).unwrap();
        assert_eq!(o.now_ms, 1_700_000_000_000);
        assert_eq!(o.grants[0].granted, 5);
        assert_eq!(o.grants[0].remaining, 12.5);
        assert_eq!((o.grants[0].share_per_ms, o.grants[0].period_ms), (0.0, 0));
        assert_eq!(
            o.grants[1].remaining,
            "-49.999999999999993".parse::<f64>().unwrap()
        );
        assert_eq!(o.grants[1].retry_after_ms, u64::MAX);
        assert!(o.grants[1].replayed);
        assert_eq!(o.grants[1].share_per_ms, 0.05);
        assert_eq!(o.grants[1].period_ms, 1_000);
        assert_eq!(
            (o.grants[0].expires_ms, o.grants[1].expires_ms),
            (None, Some(250))
        );
        assert!(parse_lease_reply(&v, 1).is_err());
        assert!(parse_return_reply(&Value::Array(vec![Value::Int(1), Value::Int(3)])).is_ok());
        assert!(parse_return_reply(&Value::Nil).is_err());
    }
}
