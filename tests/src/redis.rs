//! Real Redis for the limiter's store tests: a standalone `redis-server` and a Redis Cluster
//! (3 primaries + replicas) on loopback, with the failure injections the design needs
//! (pause = SIGSTOP, restart = empty store, failover, node kill).
//!
//! Commands go through the `redis` crate's synchronous client (RESP2, no redis-cli output
//! parsing): one connection per command, connecting and every read bounded by a timeout, so a
//! paused server shows up as a timeout, exactly like the limiter would see it. Replies come
//! back as [`Resp`], error replies as values (`Resp::Error`), not transport errors.
//!
//! redis-server cannot bind port 0, so ports come from [`crate::ports::free_port`]; if the
//! bind races and fails the server is started again on another port, and a server is only
//! considered up when `INFO server` reports *our* child's `process_id`.
//!
//! A server (or every node of a cluster) can also serve TLS ([`RedisTls`]: certificates from
//! [`crate::pki`], client certificates required or not) and require an ACL user's password
//! ([`AclUser`]). The harness itself keeps talking plain RESP on the loopback `port()`, as an
//! admin user of its own when ACLs are on; the limiter is given only the TLS port
//! ([`RedisServer::tls_url`]).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::{ConnectionLike, IntoConnectionInfo};

use crate::error::{HarnessError, Result};
use crate::paths;
use crate::pki::{CertFiles, TestCa};
use crate::ports::free_port;
use crate::process::{self, ChildProcess};

/// Default timeout for one command.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const STARTUP_TIMEOUT: Duration = process::STARTUP_DEADLINE;
const CLUSTER_TIMEOUT: Duration = process::STARTUP_DEADLINE;

// ---------------------------------------------------------------------------------------
// Commands

/// A RESP2 reply. Error replies are values (`Resp::Error`), not transport errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(String),
    Nil,
    Array(Vec<Resp>),
}

impl Resp {
    /// Text rendering: strings as-is, integers in decimal, nil as `(nil)`, errors as
    /// `(error) MSG`, arrays one element per line.
    pub fn to_text(&self) -> String {
        match self {
            Resp::Simple(s) | Resp::Bulk(s) => s.clone(),
            Resp::Error(e) => format!("(error) {e}"),
            Resp::Int(i) => i.to_string(),
            Resp::Nil => "(nil)".into(),
            Resp::Array(items) => items
                .iter()
                .map(Resp::to_text)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    pub fn is_error(&self) -> bool {
        matches!(self, Resp::Error(_))
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Resp::Simple(s) | Resp::Bulk(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Resp::Int(i) => Some(*i),
            Resp::Simple(s) | Resp::Bulk(s) => s.parse().ok(),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Resp]> {
        match self {
            Resp::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Send one command to 127.0.0.1:`port` on a fresh connection and read one reply.
pub fn command(port: u16, args: &[&str], timeout: Duration) -> Result<Resp> {
    command_as(port, None, args, timeout)
}

/// [`command`], authenticated first as `auth` (`(user, password)`) when given; a refused
/// `AUTH` is an `Err`. The connection is redis-rs's synchronous one: connecting and the
/// handshake are bounded by `timeout`, the command by what is left of it.
pub fn command_as(
    port: u16,
    auth: Option<(&str, &str)>,
    args: &[&str],
    timeout: Duration,
) -> Result<Resp> {
    let Some((name, rest)) = args.split_first() else {
        return Err(HarnessError::new(format!(
            "redis 127.0.0.1:{port}: no command to send"
        )));
    };
    let what = format!("redis 127.0.0.1:{port} {name:?}");
    let failed = |step: &str, e: redis::RedisError| {
        if e.is_timeout() {
            HarnessError::new(format!("{what}: no reply within {timeout:?}"))
        } else if e.kind() == redis::ErrorKind::AuthenticationFailed {
            HarnessError::new(format!("{what}: AUTH refused: {e}"))
        } else {
            HarnessError::new(format!("{what}: {step}: {e}"))
        }
    };
    let deadline = Instant::now() + timeout;
    let mut settings = redis::RedisConnectionInfo::default().set_skip_set_lib_name();
    if let Some((user, password)) = auth {
        settings = settings.set_username(user).set_password(password);
    }
    let info = redis::ConnectionAddr::Tcp(Ipv4Addr::LOCALHOST.to_string(), port)
        .into_connection_info()
        .map_err(|e| failed("address", e))?
        .set_redis_settings(settings);
    let client = redis::Client::open(info).map_err(|e| failed("client", e))?;
    let mut con = client
        .get_connection_with_timeout(timeout)
        .map_err(|e| failed("connect", e))?;
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(HarnessError::new(format!(
            "{what}: no reply within {timeout:?}"
        )));
    }
    con.set_write_timeout(Some(left))
        .and_then(|()| con.set_read_timeout(Some(left)))
        .map_err(|e| failed("set timeouts", e))?;
    let mut cmd = redis::cmd(name);
    for arg in rest {
        cmd.arg(*arg);
    }
    con.req_command(&cmd)
        .map(Resp::from)
        .map_err(|e| failed("command", e))
}

impl From<redis::Value> for Resp {
    /// RESP2's kinds as they are; an error reply as `CODE detail`; the RESP3-only kinds (the
    /// harness speaks RESP2, so Redis does not send them) as their nearest RESP2 kind.
    fn from(value: redis::Value) -> Resp {
        use redis::Value;
        match value {
            Value::Nil => Resp::Nil,
            Value::Int(i) => Resp::Int(i),
            Value::BulkString(bytes) => Resp::Bulk(String::from_utf8_lossy(&bytes).into_owned()),
            Value::Array(items) | Value::Set(items) => {
                Resp::Array(items.into_iter().map(Resp::from).collect())
            }
            Value::SimpleString(s) => Resp::Simple(s),
            Value::Okay => Resp::Simple("OK".into()),
            Value::ServerError(e) => Resp::Error(match e.details() {
                Some(detail) => format!("{} {detail}", e.code()),
                None => e.code().to_owned(),
            }),
            Value::Map(pairs) => Resp::Array(
                pairs
                    .into_iter()
                    .flat_map(|(k, v)| [Resp::from(k), Resp::from(v)])
                    .collect(),
            ),
            Value::Attribute { data, .. } => Resp::from(*data),
            Value::Double(d) => Resp::Bulk(d.to_string()),
            Value::Boolean(b) => Resp::Int(i64::from(b)),
            Value::VerbatimString { text, .. } => Resp::Bulk(text),
            other => Resp::Bulk(format!("{other:?}")),
        }
    }
}

/// Redis calls in `INFO commandstats` text: `(bucket transitions, all commands)`. A bucket
/// transition is what the limiter issues (`FCALL`/`FCALL_RO`, or `EVALSHA`/`EVAL`); "all" also
/// counts what the Function runs inside Redis (`TIME`, `HMGET`, `HSET`, `PEXPIRE`, ...), which
/// `INFO` lists too, and the limiter's housekeeping (`DBSIZE`, `FUNCTION`). The harness's own
/// `INFO` and `PING` calls are left out.
pub fn commandstats_calls(commandstats: &str) -> (u64, u64) {
    let mut transitions = 0;
    let mut all = 0;
    for line in commandstats.lines() {
        let Some(rest) = line.trim().strip_prefix("cmdstat_") else {
            continue;
        };
        let name = rest.split(':').next().unwrap_or("");
        if matches!(name, "info" | "ping") {
            continue;
        }
        let calls: u64 = rest
            .split("calls=")
            .nth(1)
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        all += calls;
        if matches!(name, "fcall" | "fcall_ro" | "evalsha" | "eval") {
            transitions += calls;
        }
    }
    (transitions, all)
}

/// `field` from `INFO` text (`field:value` lines).
pub fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == field).then(|| v.trim().to_owned())
    })
}

// ---------------------------------------------------------------------------------------
// RedisServer

/// TLS on a test [`RedisServer`]: a TLS port besides the plain one, with certificates signed
/// by a [`TestCa`] (the server's own for `localhost` / `127.0.0.1`, and the one it presents
/// when it connects out: cluster bus and replication links).
#[derive(Debug, Clone)]
pub struct RedisTls {
    /// The CA certificate: what clients trust, and what the server checks client
    /// certificates against.
    pub ca: PathBuf,
    pub server: CertFiles,
    /// Presented by the server on its outgoing TLS links (a client certificate: the peer node
    /// checks it like any client's).
    pub peer: CertFiles,
    /// `--tls-auth-clients yes`: every TLS client must present a certificate `ca` signed.
    pub require_client_certs: bool,
}

impl RedisTls {
    /// Server-side files signed by `ca`, written into `dir`.
    pub fn new(ca: &TestCa, dir: &Path, require_client_certs: bool) -> RedisTls {
        std::fs::create_dir_all(dir).expect("create the certificate directory");
        RedisTls {
            ca: ca.write_cert(dir, "redis-ca.crt"),
            server: ca.server(dir, "redis-server", &["localhost", "127.0.0.1"]),
            peer: ca.client(dir, "redis-peer", None),
            require_client_certs,
        }
    }
}

/// An ACL user with a password (`--user NAME on >PASSWORD ~tollgate:* &* +@all`: every
/// command, only tollgate's keys). With one, the `default` user is off: a client must
/// authenticate. The harness authenticates as [`ADMIN_USER`].
#[derive(Debug, Clone)]
pub struct AclUser {
    pub name: String,
    pub password: String,
}

/// The harness's own ACL user on servers with an [`AclUser`] (and the one replicas
/// authenticate as to their primary).
pub const ADMIN_USER: &str = "e2e-admin";
/// [`ADMIN_USER`]'s password: a test-only constant, on loopback servers only.
const ADMIN_PASSWORD: &str = "e2e-admin-password";

/// How to start a [`RedisServer`]. `RedisOptions::default()` is a plain standalone server.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// Label for the log directory; empty means the current test's name.
    pub name: String,
    /// Use this directory (created if needed) instead of a fresh log directory.
    pub dir: Option<PathBuf>,
    /// Start with `--cluster-enabled yes` (config file in the dir, own bus port).
    pub cluster: bool,
    /// `--cluster-node-timeout`; 0 means 2000 ms.
    pub cluster_node_timeout_ms: u64,
    /// More `redis-server` arguments, e.g. `["--maxmemory", "10mb"]`.
    pub extra_args: Vec<String>,
    /// Also serve TLS, on a port of its own ([`RedisServer::tls_port`]).
    pub tls: Option<RedisTls>,
    /// Require this user's password (the `default` user off).
    pub acl_user: Option<AclUser>,
    /// More environment for `redis-server`, e.g. [`crate::clock::offset_env`] for a skewed
    /// clock.
    pub env: Vec<(String, String)>,
}

impl RedisOptions {
    /// How the harness authenticates its own commands (`None`: it does not need to).
    fn admin_auth(&self) -> Option<(&'static str, &'static str)> {
        self.acl_user.as_ref().map(|_| (ADMIN_USER, ADMIN_PASSWORD))
    }
}

/// A `redis-server` on 127.0.0.1 with no persistence; killed on `Drop`. Methods take `&self`,
/// so one server can be shared by tasks.
#[derive(Debug)]
pub struct RedisServer {
    process: Mutex<ChildProcess>,
    port: u16,
    cluster_port: Option<u16>,
    tls_port: Option<u16>,
    dir: PathBuf,
    opts: RedisOptions,
}

impl RedisServer {
    /// A standalone server; panics if it cannot be started.
    pub fn start() -> RedisServer {
        Self::start_with(RedisOptions::default())
    }

    pub fn start_with(opts: RedisOptions) -> RedisServer {
        Self::try_start_with(opts).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_start_with(opts: RedisOptions) -> Result<RedisServer> {
        let dir = match &opts.dir {
            Some(d) => {
                std::fs::create_dir_all(d)?;
                d.clone()
            }
            None => paths::new_log_dir(&opts.name, "redis"),
        };
        let mut last_err = HarnessError::new("not started");
        for _attempt in 0..8 {
            let port = free_port();
            let cluster_port = opts.cluster.then(free_port);
            let tls_port = opts.tls.is_some().then(free_port);
            match spawn_redis(&dir, port, cluster_port, tls_port, &opts)? {
                Ok(process) => {
                    return Ok(RedisServer {
                        process: Mutex::new(process),
                        port,
                        cluster_port,
                        tls_port,
                        dir,
                        opts,
                    })
                }
                // The port was taken between free_port() and the bind: try other ports.
                Err(e) => last_err = e,
            }
        }
        Err(HarnessError::new(format!(
            "redis-server: gave up after 8 port races; last: {last_err}"
        )))
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster bus port (cluster mode only).
    pub fn cluster_port(&self) -> Option<u16> {
        self.cluster_port
    }

    /// The TLS port (with [`RedisOptions::tls`] only).
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `rediss://127.0.0.1:<tls port>`, without credentials; panics without TLS.
    pub fn tls_url(&self) -> String {
        let port = self
            .tls_port
            .unwrap_or_else(|| panic!("redis on port {} has no TLS port", self.port));
        format!("rediss://127.0.0.1:{port}")
    }

    pub fn pid(&self) -> u32 {
        self.proc().pid()
    }

    pub fn log_dir(&self) -> &Path {
        &self.dir
    }

    /// redis-server's log (its stdout) and stderr.
    pub fn logs(&self) -> String {
        let p = self.proc();
        format!("{}{}", p.stdout(), p.stderr())
    }

    pub fn is_running(&self) -> bool {
        self.proc().is_running()
    }

    fn proc(&self) -> std::sync::MutexGuard<'_, ChildProcess> {
        self.process.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One command with an explicit timeout (on the plain port, as the harness's admin user
    /// when ACLs are on); transport failures are `Err`.
    pub fn try_cmd(&self, args: &[&str], timeout: Duration) -> Result<Resp> {
        command_as(self.port, self.opts.admin_auth(), args, timeout)
    }

    /// One command; panics on transport failure. Error replies are `Resp::Error`.
    pub fn cmd(&self, args: &[&str]) -> Resp {
        self.try_cmd(args, COMMAND_TIMEOUT)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// One command, reply as text (see [`Resp::to_text`]): `cli(&["GET", "k"]) == "v"`.
    pub fn cli(&self, args: &[&str]) -> String {
        self.cmd(args).to_text()
    }

    /// Does the server answer PING within `timeout`?
    pub fn ping(&self, timeout: Duration) -> bool {
        matches!(self.try_cmd(&["PING"], timeout), Ok(Resp::Simple(s)) if s == "PONG")
    }

    /// `INFO <section>` text.
    pub fn info(&self, section: &str) -> String {
        self.cli(&["INFO", section])
    }

    /// One field of `INFO <section>`.
    pub fn info_field(&self, section: &str, field: &str) -> Option<String> {
        info_field(&self.info(section), field)
    }

    /// Freeze the process (SIGSTOP): connections are accepted by the kernel but nothing is
    /// answered, like a stalled server.
    pub fn pause(&self) {
        self.proc()
            .signal(libc::SIGSTOP)
            .unwrap_or_else(|e| panic!("pause redis: {e}"));
    }

    /// Undo [`RedisServer::pause`] (SIGCONT).
    pub fn resume(&self) {
        self.proc()
            .signal(libc::SIGCONT)
            .unwrap_or_else(|e| panic!("resume redis: {e}"));
    }

    /// Kill the server (SIGKILL) without restarting it. Idempotent.
    pub fn kill(&self) {
        self.proc().kill();
    }

    /// Kill and start again on the same port: all keys, scripts and functions are gone
    /// (no persistence). Waits until it answers again.
    pub fn restart(&self) {
        let mut p = self.proc();
        p.kill();
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            match spawn_redis(
                &self.dir,
                self.port,
                self.cluster_port,
                self.tls_port,
                &self.opts,
            ) {
                Ok(Ok(new)) => {
                    *p = new;
                    return;
                }
                // Someone took our port in the meantime; it may be released again.
                Ok(Err(e)) if Instant::now() < deadline => {
                    eprintln!("e2e: redis restart on port {} raced: {e}", self.port);
                    std::thread::sleep(Duration::from_millis(100));
                }
                Ok(Err(e)) | Err(e) => panic!("redis restart on port {}: {e}", self.port),
            }
        }
    }
}

/// Start one redis-server and wait until it answers as itself.
/// `Ok(Err(_))`: the port was taken (retry elsewhere); `Err(_)`: any other failure.
fn spawn_redis(
    dir: &Path,
    port: u16,
    cluster_port: Option<u16>,
    tls_port: Option<u16>,
    opts: &RedisOptions,
) -> Result<Result<ChildProcess>> {
    let mut cmd = Command::new(paths::redis_server_bin());
    cmd.current_dir(dir).args([
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--protected-mode",
        "no",
        "--daemonize",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
        // Replicas sync immediately instead of waiting 5 s for more replicas.
        "--repl-diskless-sync-delay",
        "0",
        "--loglevel",
        "notice",
    ]);
    cmd.arg("--dir").arg(dir);
    if let Some(bus) = cluster_port {
        let timeout = match opts.cluster_node_timeout_ms {
            0 => 2000,
            t => t,
        };
        cmd.args(["--cluster-enabled", "yes"])
            .arg("--cluster-config-file")
            .arg(dir.join("nodes.conf"))
            .args(["--cluster-node-timeout", &timeout.to_string()])
            .args(["--cluster-port", &bus.to_string()])
            .args(["--cluster-announce-ip", "127.0.0.1"]);
    }
    if let (Some(tls), Some(tls_port)) = (&opts.tls, tls_port) {
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        cmd.args(["--tls-port", &tls_port.to_string()])
            .arg("--tls-cert-file")
            .arg(&tls.server.cert)
            .arg("--tls-key-file")
            .arg(&tls.server.key)
            .arg("--tls-client-cert-file")
            .arg(&tls.peer.cert)
            .arg("--tls-client-key-file")
            .arg(&tls.peer.key)
            .arg("--tls-ca-cert-file")
            .arg(&tls.ca)
            .args(["--tls-auth-clients", yes_no(tls.require_client_certs)])
            .args(["--tls-replication", "yes"]);
        if cluster_port.is_some() {
            // The cluster bus is TLS too, and CLUSTER SLOTS / NODES report the TLS ports.
            cmd.args(["--tls-cluster", "yes"]);
        }
    }
    if let Some(user) = &opts.acl_user {
        // One argument per ACL rule: redis-server joins what follows `--user` itself.
        cmd.args(["--user", "default", "off"])
            .args(["--user", ADMIN_USER, "on", &format!(">{ADMIN_PASSWORD}")])
            .args(["~*", "&*", "+@all"])
            .args(["--user", &user.name, "on", &format!(">{}", user.password)])
            .args(["~tollgate:*", "&*", "+@all"])
            .args(["--masteruser", ADMIN_USER, "--masterauth", ADMIN_PASSWORD]);
    }
    cmd.args(&opts.extra_args);
    cmd.envs(opts.env.iter().map(|(k, v)| (k, v)));
    let mut child = ChildProcess::spawn("redis", cmd, dir)?;
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    let pid = child.pid().to_string();
    loop {
        if let Some(status) = child.exit_status() {
            let log = format!("{}{}", child.stdout(), child.stderr());
            let msg = format!(
                "redis-server on port {port} exited during startup ({status}); log:\n{}",
                process::tail(&log, 20)
            );
            return if log.contains("Address already in use") {
                Ok(Err(HarnessError::new(msg)))
            } else {
                Err(HarnessError::new(msg))
            };
        }
        if let Ok(Resp::Bulk(info)) = command_as(
            port,
            opts.admin_auth(),
            &["INFO", "server"],
            Duration::from_secs(1),
        ) {
            if info_field(&info, "process_id").as_deref() == Some(pid.as_str()) {
                return Ok(Ok(child));
            }
            // Another process answers on "our" port: ours will fail to bind.
            child.kill();
            return Ok(Err(HarnessError::new(format!(
                "port {port} belongs to another redis-server"
            ))));
        }
        if Instant::now() >= deadline {
            let log = format!("{}{}", child.stdout(), child.stderr());
            child.kill();
            return Err(HarnessError::new(format!(
                "redis-server on port {port} not answering within {STARTUP_TIMEOUT:?}; log:\n{}",
                process::tail(&log, 20)
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------------------
// RedisCluster

/// A node's role as it reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    Replica,
}

/// A snapshot of one cluster node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNode {
    pub port: u16,
    pub pid: u32,
    /// Cluster node id.
    pub id: String,
    pub role: Role,
    /// For a replica: its primary's id.
    pub primary_id: Option<String>,
    /// Slot ranges served (primaries).
    pub slots: Vec<(u16, u16)>,
    /// Is the process running (not killed)?
    pub alive: bool,
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
struct NodeLine {
    id: String,
    port: u16,
    flags: Vec<String>,
    master: Option<String>,
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
}

fn parse_cluster_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let id = (*fields.first()?).to_owned();
            let addr = fields.get(1)?;
            let port = addr
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .unwrap_or(0);
            let flags = fields.get(2)?.split(',').map(str::to_owned).collect();
            let master = fields
                .get(3)
                .filter(|m| **m != "-")
                .map(|m| (*m).to_owned());
            let slots = fields
                .get(8..)
                .unwrap_or_default()
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => {
                        let n = s.parse().ok()?;
                        Some((n, n))
                    }
                })
                .collect();
            Some(NodeLine {
                id,
                port,
                flags,
                master,
                slots,
            })
        })
        .collect()
}

/// A Redis Cluster of `primaries × (1 + replicas_per_primary)` local redis-servers with a
/// short node timeout (2 s) so failure detection and failover tests are quick.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    ids: Vec<String>,
    dir: PathBuf,
}

impl RedisCluster {
    /// Start, join and wait until `cluster_state:ok` everywhere with every replica in sync.
    pub fn start(primaries: usize, replicas_per_primary: usize) -> RedisCluster {
        Self::try_start(primaries, replicas_per_primary).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_start(primaries: usize, replicas_per_primary: usize) -> Result<RedisCluster> {
        Self::try_start_with(primaries, replicas_per_primary, RedisOptions::default())
    }

    /// [`RedisCluster::start`] with every node started from `node` (its `tls`, `acl_user`,
    /// `extra_args`; `dir` and `cluster` are the cluster's own).
    pub fn start_with(
        primaries: usize,
        replicas_per_primary: usize,
        node: RedisOptions,
    ) -> RedisCluster {
        Self::try_start_with(primaries, replicas_per_primary, node)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_start_with(
        primaries: usize,
        replicas_per_primary: usize,
        node: RedisOptions,
    ) -> Result<RedisCluster> {
        if primaries == 0 || primaries > 16384 {
            return Err(HarnessError::new("a cluster needs 1..=16384 primaries"));
        }
        let dir = paths::new_log_dir("", "redis-cluster");
        let total = primaries * (1 + replicas_per_primary);
        let mut nodes = Vec::with_capacity(total);
        for i in 0..total {
            nodes.push(RedisServer::try_start_with(RedisOptions {
                dir: Some(dir.join(format!("node-{i}"))),
                cluster: true,
                ..node.clone()
            })?);
        }
        let ids = nodes
            .iter()
            .map(|n| {
                let r = n.try_cmd(&["CLUSTER", "MYID"], COMMAND_TIMEOUT)?;
                r.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| HarnessError::new(format!("CLUSTER MYID: {r:?}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let cluster = RedisCluster { nodes, ids, dir };
        cluster.create(primaries)?;
        Ok(cluster)
    }

    fn create(&self, primaries: usize) -> Result<()> {
        let ok = |node: &RedisServer, args: &[&str]| -> Result<()> {
            match node.try_cmd(args, COMMAND_TIMEOUT)? {
                Resp::Simple(s) if s == "OK" => Ok(()),
                other => Err(HarnessError::new(format!(
                    "{args:?} on port {}: {other:?}",
                    node.port()
                ))),
            }
        };
        // Slots split like `redis-cli --cluster create`; distinct config epochs up front.
        let per = 16384 / primaries;
        for (i, node) in self.nodes.iter().enumerate() {
            ok(node, &["CLUSTER", "SET-CONFIG-EPOCH", &(i + 1).to_string()])?;
        }
        for (i, node) in self.nodes.iter().take(primaries).enumerate() {
            let start = i * per;
            let end = if i + 1 == primaries {
                16383
            } else {
                (i + 1) * per - 1
            };
            ok(
                node,
                &[
                    "CLUSTER",
                    "ADDSLOTSRANGE",
                    &start.to_string(),
                    &end.to_string(),
                ],
            )?;
        }
        // Full mesh of MEETs: no waiting for gossip to spread.
        for (i, node) in self.nodes.iter().enumerate() {
            for other in self.nodes.iter().take(i) {
                let bus = other.cluster_port().unwrap_or_default().to_string();
                ok(
                    node,
                    &[
                        "CLUSTER",
                        "MEET",
                        "127.0.0.1",
                        &other.port().to_string(),
                        &bus,
                    ],
                )?;
            }
        }
        let total = self.nodes.len();
        process::wait_for(
            "all cluster nodes to know each other",
            CLUSTER_TIMEOUT,
            || {
                self.nodes
                    .iter()
                    .all(|n| {
                        let Ok(Resp::Bulk(text)) =
                            n.try_cmd(&["CLUSTER", "NODES"], COMMAND_TIMEOUT)
                        else {
                            return false;
                        };
                        let lines = parse_cluster_nodes(&text);
                        lines.len() == total
                            && lines
                                .iter()
                                .all(|l| !l.has("handshake") && !l.has("noaddr") && l.port != 0)
                    })
                    .then_some(())
            },
        )?;
        for (i, replica) in self.nodes.iter().enumerate().skip(primaries) {
            let primary_id = self.ids.get(i % primaries).cloned().unwrap_or_default();
            ok(replica, &["CLUSTER", "REPLICATE", &primary_id])?;
        }
        self.wait_healthy(CLUSTER_TIMEOUT)
    }

    /// Why the cluster is not healthy yet (`None` = healthy): every live node says
    /// `cluster_state:ok`, all live nodes agree which live primary owns every slot, and every
    /// live replica's link to its primary is up and not syncing.
    fn unhealthy_reason(&self) -> Option<String> {
        let mut reference: Option<Vec<(u16, u16, String)>> = None;
        let live_ids: Vec<&String> = self
            .nodes
            .iter()
            .zip(&self.ids)
            .filter(|(n, _)| n.is_running())
            .map(|(_, id)| id)
            .collect();
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            let port = node.port();
            let info = match node.try_cmd(&["CLUSTER", "INFO"], COMMAND_TIMEOUT) {
                Ok(r) => r.to_text(),
                Err(e) => return Some(e.to_string()),
            };
            if info_field(&info, "cluster_state").as_deref() != Some("ok") {
                return Some(format!("node {port}: cluster_state is not ok"));
            }
            let text = match node.try_cmd(&["CLUSTER", "NODES"], COMMAND_TIMEOUT) {
                Ok(r) => r.to_text(),
                Err(e) => return Some(e.to_string()),
            };
            let lines = parse_cluster_nodes(&text);
            let mut owners: Vec<(u16, u16, String)> = lines
                .iter()
                .filter(|l| l.has("master") && !l.has("fail"))
                .flat_map(|l| l.slots.iter().map(|(a, b)| (*a, *b, l.id.clone())))
                .collect();
            owners.sort();
            if let Some((_, _, dead)) = owners.iter().find(|(_, _, id)| !live_ids.contains(&id)) {
                return Some(format!("node {port}: slots owned by dead node {dead}"));
            }
            let covered: usize = owners
                .iter()
                .map(|(a, b, _)| usize::from(*b) - usize::from(*a) + 1)
                .sum();
            if covered != 16384 {
                return Some(format!(
                    "node {port}: only {covered} slots have live owners"
                ));
            }
            match &reference {
                None => reference = Some(owners),
                Some(r) if *r != owners => {
                    return Some(format!("node {port}: disagrees on slot owners"))
                }
                Some(_) => {}
            }
            let Some(me) = lines.iter().find(|l| l.has("myself")) else {
                return Some(format!("node {port}: no `myself` line in CLUSTER NODES"));
            };
            if me.has("slave") {
                let repl = match node.try_cmd(&["INFO", "replication"], COMMAND_TIMEOUT) {
                    Ok(r) => r.to_text(),
                    Err(e) => return Some(e.to_string()),
                };
                if info_field(&repl, "master_link_status").as_deref() != Some("up")
                    || info_field(&repl, "master_sync_in_progress").as_deref() != Some("0")
                {
                    return Some(format!("replica {port}: not in sync with its primary"));
                }
            }
        }
        None
    }

    /// Wait (bounded) until the cluster is healthy (see the module docs for what that means).
    /// After [`RedisCluster::kill_node`] of a primary this waits for its replica to take over.
    pub fn wait_healthy(&self, timeout: Duration) -> Result<()> {
        let mut reason = None;
        process::wait_for("a healthy Redis Cluster", timeout, || {
            reason = self.unhealthy_reason();
            reason.is_none().then_some(())
        })
        .map_err(|e| {
            HarnessError::new(format!(
                "{e}: {}; logs under {}",
                reason.unwrap_or_default(),
                self.dir.display()
            ))
        })
    }

    /// `redis://127.0.0.1:<port>` of every node (primaries first at start).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// `rediss://127.0.0.1:<tls port>` of every node (TLS clusters only).
    pub fn tls_urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::tls_url).collect()
    }

    /// The node servers (for `cmd`, `pause`, `resume`, `info`, ...).
    pub fn servers(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The server listening on `port` (its plain or its TLS port).
    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.port() == port || n.tls_port() == Some(port))
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    fn id_of(&self, port: u16) -> &str {
        self.nodes
            .iter()
            .zip(&self.ids)
            .find(|(n, _)| n.port() == port)
            .map(|(_, id)| id.as_str())
            .unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    /// `CLUSTER NODES` as seen by the first live node.
    fn view(&self) -> Vec<NodeLine> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .unwrap_or_else(|| panic!("no live cluster node"));
        parse_cluster_nodes(&node.cli(&["CLUSTER", "NODES"]))
    }

    /// Every node as it sees itself (a killed node: as the first live node last saw it).
    pub fn nodes(&self) -> Vec<ClusterNode> {
        let others = self.view();
        self.nodes
            .iter()
            .zip(&self.ids)
            .filter_map(|(n, id)| {
                let alive = n.is_running();
                let line = if alive {
                    parse_cluster_nodes(&n.cli(&["CLUSTER", "NODES"]))
                        .into_iter()
                        .find(|l| l.has("myself"))
                } else {
                    others.iter().find(|l| l.id == *id).cloned()
                }?;
                Some(ClusterNode {
                    port: n.port(),
                    pid: n.pid(),
                    id: id.clone(),
                    role: if line.has("master") {
                        Role::Primary
                    } else {
                        Role::Replica
                    },
                    primary_id: line.master,
                    slots: line.slots,
                    alive,
                })
            })
            .collect()
    }

    /// Live primaries.
    pub fn primaries(&self) -> Vec<ClusterNode> {
        self.nodes()
            .into_iter()
            .filter(|n| n.alive && n.role == Role::Primary)
            .collect()
    }

    /// Live replicas.
    pub fn replicas(&self) -> Vec<ClusterNode> {
        self.nodes()
            .into_iter()
            .filter(|n| n.alive && n.role == Role::Replica)
            .collect()
    }

    /// `CLUSTER KEYSLOT key`.
    pub fn key_slot(&self, key: &str) -> u16 {
        let node = self
            .nodes
            .iter()
            .find(|n| n.is_running())
            .unwrap_or_else(|| panic!("no live cluster node"));
        let r = node.cmd(&["CLUSTER", "KEYSLOT", key]);
        r.as_int()
            .and_then(|i| u16::try_from(i).ok())
            .unwrap_or_else(|| panic!("CLUSTER KEYSLOT {key}: {r:?}"))
    }

    /// The live primary serving `slot`.
    pub fn primary_for_slot(&self, slot: u16) -> ClusterNode {
        let view = self.view();
        let owner = view
            .iter()
            .find(|l| {
                l.has("master")
                    && !l.has("fail")
                    && l.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
            })
            .unwrap_or_else(|| panic!("no primary serves slot {slot}"));
        self.nodes()
            .into_iter()
            .find(|n| n.id == owner.id)
            .unwrap_or_else(|| panic!("slot {slot} owner {} is not ours", owner.id))
    }

    /// The live primary serving `key`.
    pub fn primary_for_key(&self, key: &str) -> ClusterNode {
        self.primary_for_slot(self.key_slot(key))
    }

    /// Manual failover of `primary_port`: `CLUSTER FAILOVER` on one of its replicas, then
    /// wait until the roles are swapped and the cluster is healthy. Returns the new
    /// primary's port.
    pub fn failover(&self, primary_port: u16) -> u16 {
        let primary_id = self.id_of(primary_port).to_owned();
        let replica = self
            .replicas()
            .into_iter()
            .find(|n| n.primary_id.as_deref() == Some(primary_id.as_str()))
            .unwrap_or_else(|| panic!("node {primary_port} is not a primary with a live replica"));
        let server = self.node(replica.port);
        let r = server.cmd(&["CLUSTER", "FAILOVER"]);
        assert_eq!(r, Resp::Simple("OK".into()), "CLUSTER FAILOVER: {r:?}");
        let role = |port: u16| self.node(port).info_field("replication", "role");
        process::wait_for(
            &format!("failover {primary_port} -> {}", replica.port),
            CLUSTER_TIMEOUT,
            || {
                (role(replica.port).as_deref() == Some("master")
                    && role(primary_port).as_deref() == Some("slave"))
                .then_some(())
            },
        )
        .unwrap_or_else(|e| panic!("{e}; logs under {}", self.dir.display()));
        self.wait_healthy(CLUSTER_TIMEOUT)
            .unwrap_or_else(|e| panic!("{e}"));
        replica.port
    }

    /// SIGKILL the node on `port` (no failover wait; see [`RedisCluster::wait_healthy`]).
    pub fn kill_node(&self, port: u16) {
        self.node(port).kill();
    }

    pub fn log_dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_limiter_calls_and_all_commands() {
        let info = "# Commandstats\r\n\
            cmdstat_fcall:calls=10,usec=100,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_hset:calls=20,usec=20,usec_per_call=1.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_time:calls=10,usec=5,usec_per_call=0.50,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_info:calls=99,usec=5,usec_per_call=0.05,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_ping:calls=7,usec=1,usec_per_call=0.14,rejected_calls=0,failed_calls=0\r\n";
        assert_eq!(commandstats_calls(info), (10, 40));
        assert_eq!(commandstats_calls(""), (0, 0));
    }

    #[test]
    fn converts_replies() {
        use redis::Value;
        let array = Value::Array(vec![
            Value::Okay,
            Value::Int(42),
            Value::Nil,
            Value::BulkString(b"he\r\no".to_vec()),
            Value::SimpleString("PONG".into()),
        ]);
        assert_eq!(
            Resp::from(array),
            Resp::Array(vec![
                Resp::Simple("OK".into()),
                Resp::Int(42),
                Resp::Nil,
                Resp::Bulk("he\r\no".into()),
                Resp::Simple("PONG".into()),
            ])
        );
        let mut parser = redis::Parser::new();
        let error = parser.parse_value(&b"-ERR nope\r\n"[..]).unwrap();
        assert_eq!(Resp::from(error).to_text(), "(error) ERR nope");
        let error = parser.parse_value(&b"-NOPERM no\r\n"[..]).unwrap();
        assert!(Resp::from(error).is_error());
    }

    #[test]
    fn refuses_an_empty_command() {
        let e = command(1, &[], Duration::from_millis(10)).unwrap_err();
        assert!(e.to_string().contains("no command"), "{e}");
    }

    #[test]
    fn parses_cluster_nodes() {
        let text = "07c3 127.0.0.1:30004@31004 slave e7d1 0 1426238317239 4 connected\n\
                    e7d1 127.0.0.1:30001@31001,host myself,master - 0 0 1 connected 0-5460 7000 [5461->-abc]\n";
        let lines = parse_cluster_nodes(text);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].port, 30004);
        assert_eq!(lines[0].master.as_deref(), Some("e7d1"));
        assert!(lines[1].has("myself") && lines[1].has("master"));
        assert_eq!(lines[1].slots, vec![(0, 5460), (7000, 7000)]);
        assert_eq!(lines[1].master, None);
    }
}
