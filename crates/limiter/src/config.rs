//! Command-line flags (each with an environment variable fallback) and logging set-up for the
//! `tollgate-limiter` binary; turned into a [`ServerConfig`] so the library never sees clap.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use tollgate_core::duration::Millis;

use crate::observe::HotKeySettings;
use crate::region::{ParentTls, RegionConfig};
use crate::rls::{Bounds, HeaderNames};
use crate::server::{RlsServerConfig, ServerConfig, StoreConfig};
use crate::store::security::PASSWORD_ENV;
use crate::store::{RedisSecurity, Secret};
use crate::tls::TlsSettings;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Compact,
    /// One JSON object per event.
    Json,
}

/// tollgate's limiter: owns every global bucket and leases tokens to the Envoy filter.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "tollgate-limiter",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Address of the lease listener: HTTP/1.1 and h2c, or with --tls-cert HTTP/2 (ALPN) and
    /// HTTP/1.1 over mutual TLS.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// Serve the lease listener over TLS with this certificate chain (PEM); needs --tls-key
    /// and --tls-client-ca. The files are reloaded when they change.
    #[arg(long, env = "TOLLGATE_TLS_CERT", requires_all = ["tls_key", "tls_client_ca"])]
    pub tls_cert: Option<PathBuf>,

    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "TOLLGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// CA certificates (PEM) that sign the callers' client certificates: a caller without
    /// one is refused in the handshake.
    #[arg(long, env = "TOLLGATE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// Callers allowed besides holding a trusted certificate, comma-separated: a URI SAN
    /// (e.g. a SPIFFE id), a DNS SAN or the subject's common name. Empty: any trusted caller.
    #[arg(
        long,
        env = "TOLLGATE_TLS_ALLOW",
        value_delimiter = ',',
        requires = "tls_cert"
    )]
    pub tls_allow: Vec<String>,

    /// How often the TLS files are checked for changes.
    #[arg(long, env = "TOLLGATE_TLS_RELOAD_EVERY", default_value = "10s", value_parser = parse_duration)]
    pub tls_reload_every: Duration,

    /// Allow the lease listener in plaintext on an address other than loopback. Anyone who can
    /// reach a plaintext lease port can lease from (and drain) any budget: only for a port that
    /// something else guards, e.g. a mesh sidecar with strict mutual TLS. Without it (and
    /// without --tls-cert) the limiter refuses to start on such an address.
    #[arg(long, env = "TOLLGATE_INSECURE_PLAINTEXT", conflicts_with = "tls_cert")]
    pub insecure_plaintext: bool,

    /// Also serve /healthz, /readyz, /metrics and /v1/hot-keys (nothing else) in plaintext on
    /// this address, for probes, scrapers and operators without a client certificate.
    #[arg(long, env = "TOLLGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,

    /// One Redis server, e.g. redis://127.0.0.1:6379, or rediss://host:port for TLS. Without
    /// --redis or --redis-cluster the buckets live in this process.
    // Environment values stay out of --help: a URL may carry a password.
    #[arg(
        long,
        env = "TOLLGATE_REDIS",
        conflicts_with = "redis_cluster",
        hide_env_values = true
    )]
    pub redis: Option<String>,

    /// Redis Cluster node URLs, comma-separated (any reachable node is enough; all redis:// or
    /// all rediss://).
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLUSTER",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub redis_cluster: Vec<String>,

    /// CA certificates (PEM) that Redis' certificate must chain to, for rediss:// URLs;
    /// without it, the system's trust store.
    #[arg(long, env = "TOLLGATE_REDIS_CA", value_name = "FILE")]
    pub redis_ca: Option<PathBuf>,

    /// Client certificate chain (PEM) to present to Redis (for its `tls-auth-clients`);
    /// needs --redis-client-key.
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLIENT_CERT",
        value_name = "FILE",
        requires = "redis_client_key"
    )]
    pub redis_client_cert: Option<PathBuf>,

    /// The private key (PEM) of --redis-client-cert.
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLIENT_KEY",
        value_name = "FILE",
        requires = "redis_client_cert"
    )]
    pub redis_client_key: Option<PathBuf>,

    /// Redis ACL user to authenticate as (needs a password).
    #[arg(long, env = "TOLLGATE_REDIS_USERNAME", value_name = "NAME")]
    pub redis_username: Option<String>,

    /// File holding the Redis password (trailing newlines are trimmed). The password may
    /// instead be in the environment variable TOLLGATE_REDIS_PASSWORD; it is never a flag
    /// (process lists show flags).
    #[arg(long, env = "TOLLGATE_REDIS_PASSWORD_FILE", value_name = "FILE")]
    pub redis_password_file: Option<PathBuf>,

    /// The policy document (the same JSON the filter is configured with); reloaded on change.
    /// Optional when the limiter only serves the RateLimitService (--rls-config).
    #[arg(
        long,
        env = "TOLLGATE_POLICIES",
        required_unless_present = "rls_config"
    )]
    pub policies: Option<PathBuf>,

    /// Serve Envoy's RateLimitService (gRPC `envoy.service.ratelimit.v3`) on this address, with
    /// the lease listener's TLS settings (--tls-cert, --tls-client-ca, --tls-allow) and its
    /// plaintext rule (loopback only unless --insecure-plaintext).
    #[arg(long, env = "TOLLGATE_RLS_LISTEN", requires = "rls_config")]
    pub rls_listen: Option<SocketAddr>,

    /// envoyproxy/ratelimit's configuration for the RateLimitService: one YAML file, or a
    /// directory whose *.yaml and *.yml files are read (ratelimit's
    /// RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config); reloaded on change, keeping the last good
    /// configuration when a new one is invalid.
    #[arg(long, env = "TOLLGATE_RLS_CONFIG", requires = "rls_listen")]
    pub rls_config: Option<PathBuf>,

    /// How often --rls-config is checked for changes.
    #[arg(long, env = "TOLLGATE_RLS_CONFIG_POLL", default_value = "1s", value_parser = parse_duration)]
    pub rls_config_poll: Duration,

    /// Add rate-limit headers to the RateLimitService's answers (ratelimit's
    /// LIMIT_RESPONSE_HEADERS_ENABLED): ratelimit's three (names below) and the IETF
    /// `RateLimit-Policy` and `RateLimit` fields, for the descriptor with the least remaining.
    #[arg(long, env = "TOLLGATE_RLS_RESPONSE_HEADERS")]
    pub rls_response_headers: bool,

    /// Name of the limit header (ratelimit's LIMIT_LIMIT_HEADER).
    #[arg(
        long,
        env = "TOLLGATE_RLS_LIMIT_HEADER",
        default_value = "RateLimit-Limit"
    )]
    pub rls_limit_header: String,

    /// Name of the remaining header (ratelimit's LIMIT_REMAINING_HEADER).
    #[arg(
        long,
        env = "TOLLGATE_RLS_REMAINING_HEADER",
        default_value = "RateLimit-Remaining"
    )]
    pub rls_remaining_header: String,

    /// Name of the reset header (ratelimit's LIMIT_RESET_HEADER).
    #[arg(
        long,
        env = "TOLLGATE_RLS_RESET_HEADER",
        default_value = "RateLimit-Reset"
    )]
    pub rls_reset_header: String,

    /// How long a granted lease may be spent (its `expires_ms`).
    #[arg(long, env = "TOLLGATE_LEASE_TTL", default_value = "2s", value_parser = parse_duration)]
    pub lease_ttl: Duration,

    /// How long a lease id is remembered for dedup and returns: at least --lease-ttl +
    /// --assignment-period + 1s (a return of what a lease did not spend arrives within about a
    /// tenth of a second of its expiry); a regional limiter keeps its Envoys' lease ids as long.
    #[arg(long, env = "TOLLGATE_DEDUP_TTL", default_value = "60s", value_parser = parse_duration)]
    pub dedup_ttl: Duration,

    /// Length of one assignment: when a bucket cannot give an instance what its demand asks
    /// for, the instance gets a share of the bucket's rate for this long (shorter than
    /// --dedup-ttl).
    #[arg(long, env = "TOLLGATE_ASSIGNMENT_PERIOD", default_value = "1s", value_parser = parse_duration)]
    pub assignment_period: Duration,

    /// Deadline of one store call; a call that misses it answers UNAVAILABLE.
    #[arg(long, env = "TOLLGATE_STORE_TIMEOUT", default_value = "50ms", value_parser = parse_duration)]
    pub store_timeout: Duration,

    /// Make this a regional limiter: policies of scope `global` are leased from the parent
    /// limiter at this URL (its lease listener: `http://host:port` for h2c, `https://` for
    /// HTTP/2 over TLS with --parent-ca); `regional` ones stay in this limiter's store. Envoys
    /// talk only to the regional limiter.
    #[arg(long, env = "TOLLGATE_PARENT", requires = "region")]
    pub parent: Option<String>,

    /// This region's name (`[0-9A-Za-z_-]`, 1 to 40 bytes), with --parent: this instance is
    /// holder `<region>-<suffix>` at the parent.
    #[arg(long, env = "TOLLGATE_REGION", requires = "parent")]
    pub region: Option<String>,

    /// Deadline of one call to the parent limiter (the filter's `limiter.timeout` should be
    /// longer: an Envoy whose lease finds the region dry waits for the parent).
    #[arg(long, env = "TOLLGATE_PARENT_TIMEOUT", default_value = "250ms", value_parser = parse_duration)]
    pub parent_timeout: Duration,

    /// CA certificates (PEM) the certificate of an `https://` --parent must chain to.
    #[arg(
        long,
        env = "TOLLGATE_PARENT_CA",
        value_name = "FILE",
        requires = "parent"
    )]
    pub parent_ca: Option<PathBuf>,

    /// Client certificate chain (PEM) to present to an `https://` --parent (its
    /// --tls-client-ca); needs --parent-key.
    #[arg(
        long,
        env = "TOLLGATE_PARENT_CERT",
        value_name = "FILE",
        requires_all = ["parent_key", "parent_ca"]
    )]
    pub parent_cert: Option<PathBuf>,

    /// The private key (PEM) of --parent-cert.
    #[arg(
        long,
        env = "TOLLGATE_PARENT_KEY",
        value_name = "FILE",
        requires = "parent_cert"
    )]
    pub parent_key: Option<PathBuf>,

    /// Most keys of global policies a regional limiter holds budget for at once.
    #[arg(long, env = "TOLLGATE_REGIONAL_KEYS", default_value_t = 100_000)]
    pub regional_keys: usize,

    /// How often the policy file is checked for changes.
    #[arg(long, env = "TOLLGATE_POLICY_POLL", default_value = "1s", value_parser = parse_duration)]
    pub policy_poll: Duration,

    /// Busiest keys reported per policy by GET /v1/hot-keys (1 to 100); each policy keeps
    /// 4 × this many counters per 10 seconds, whatever the traffic.
    #[arg(long, env = "TOLLGATE_HOT_KEYS", default_value_t = 10)]
    pub hot_keys: usize,

    /// Log a warning when one key takes more than this share of its node's lease calls over
    /// the last minute (a fraction: 0.2 = 20 %).
    #[arg(long, env = "TOLLGATE_HOT_KEY_SHARE", default_value_t = 0.2, value_parser = parse_share)]
    pub hot_key_share: f64,

    /// ...once the key has at least this many lease calls in the last minute, so a quiet
    /// limiter does not log.
    #[arg(long, env = "TOLLGATE_HOT_KEY_MIN_CALLS", default_value_t = 1_000)]
    pub hot_key_min_calls: u64,

    /// Salt of the key hash shown for hot keys (the file's content, trailing newlines
    /// trimmed): the same on every replica, and whoever holds it can check which hash a
    /// tenant has. Without it, a random salt per process.
    #[arg(long, env = "TOLLGATE_HOT_KEY_SALT_FILE", value_name = "FILE")]
    pub hot_key_salt_file: Option<PathBuf>,

    /// Log format.
    #[arg(
        long,
        env = "TOLLGATE_LOG_FORMAT",
        value_enum,
        default_value = "compact"
    )]
    pub log_format: LogFormat,

    /// Log filter (tracing `EnvFilter` syntax), e.g. `info` or `tollgate_limiter=debug`.
    #[arg(long, env = "TOLLGATE_LOG", default_value = "info")]
    pub log: String,
}

/// Commands other than serving.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Validate policy documents exactly as the filter and the limiter do, print every error
    /// with its policy and field, and exit 1 if any document is invalid (for CI gates).
    CheckPolicies {
        /// Policy documents (JSON).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Also print, for each valid document, which policies a sample request hits (route,
        /// key, limits entry, cost, rate) and why the others are skipped, as the filter plans it.
        #[arg(long)]
        explain: bool,
        /// `--explain`: the sample request's method.
        #[arg(long, default_value = "GET", requires = "explain")]
        method: String,
        /// `--explain`: its path (query included).
        #[arg(long, default_value = "/", requires = "explain")]
        path: String,
        /// `--explain`: its `:authority` (default none: only policies without `match.hosts`).
        #[arg(long, default_value = "", requires = "explain")]
        host: String,
        /// `--explain`: a request header `name: value`, repeatable.
        #[arg(long = "header", value_name = "NAME: VALUE", requires = "explain",
              value_parser = |s: &str| crate::explain::parse_header(s).map_err(|e| e.to_string()))]
        headers: Vec<(String, String)>,
        /// `--explain`: Envoy's client address.
        #[arg(long, requires = "explain")]
        client_ip: Option<String>,
        /// `--explain`: a verified JWT claim `name=value` (`a.b` for a nested one), repeatable.
        #[arg(long = "claim", value_name = "NAME=VALUE", requires = "explain",
              value_parser = |s: &str| crate::explain::parse_claim(s).map_err(|e| e.to_string()))]
        claims: Vec<(String, String)>,
    },
    /// Convert envoyproxy/ratelimit descriptor configurations (YAML) into one policy document,
    /// printed on stdout. The report on stderr gives what each policy reads instead of Envoy's
    /// rate_limits actions, what converted with a difference, and what could not be expressed,
    /// each with its reason. Exit 1 only on invalid input (naming the file and the field).
    ImportRatelimit {
        /// Where a descriptor key's value is read from, repeatable: `KEY=HEADER` (a request
        /// header), `KEY=:method`, `KEY=:authority`, `KEY=:path` or `KEY=client_ip`. Without
        /// it a key is read from the header of the same name (`remote_address`: the client IP).
        #[arg(long = "header", value_name = "KEY=SOURCE", value_parser = parse_key_source)]
        headers: Vec<(String, crate::import::Source)>,
        /// A `when` condition (JSON, as a policy document writes it) that holds exactly when
        /// Envoy produces the descriptor entry KEY = VALUE, repeatable (all given for one entry
        /// must hold): e.g. the header matchers of a header_value_match action,
        /// `header_match=premium={"header":"x-plan","equals":"premium"}`.
        #[arg(long = "when", value_name = "KEY=VALUE=CONDITION", value_parser = crate::import::convert::parse_when)]
        when: Vec<(String, String, tollgate_core::condition::ConditionSpec)>,
        /// The Envoy cluster of the limiter, written as the document's `limiter.cluster`.
        #[arg(long, value_name = "NAME", default_value = "tollgate_limiter")]
        limiter_cluster: String,
        /// Proxies in front of Envoy that append to X-Forwarded-For, for `remote_address`
        /// (`client_ip.trusted_hops`, counted as Envoy's xff_num_trusted_hops; 0 reads
        /// Envoy's client address, which ratelimit's `remote_address` action also uses).
        #[arg(long, value_name = "N", default_value_t = 0)]
        trusted_hops: u32,
        /// ratelimit configuration files (YAML), one domain each.
        #[arg(required = true, value_name = "CONFIG.yaml")]
        files: Vec<PathBuf>,
    },
}

/// `KEY=SOURCE` of `import-ratelimit --header`.
fn parse_key_source(text: &str) -> Result<(String, crate::import::Source), String> {
    let (key, source) = text
        .split_once('=')
        .filter(|(key, _)| !key.is_empty())
        .ok_or_else(|| format!("`{text}` is not KEY=SOURCE"))?;
    Ok((key.to_string(), crate::import::Source::parse(source)?))
}

/// A share: a number above 0 and at most 1.
fn parse_share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(share) if share.is_finite() && share > 0.0 && share <= 1.0 => Ok(share),
        _ => Err(format!(
            "`{text}` is not a fraction above 0 and at most 1 (e.g. 0.2)"
        )),
    }
}

/// `25ms`, `2s`, `1m`: the policy document's duration syntax.
fn parse_duration(text: &str) -> Result<Duration, String> {
    Millis::parse(text).map(|m| Duration::from_millis(m.as_millis()))
}

impl Cli {
    /// The Redis credentials of the flags, with `password_env` the value of
    /// `TOLLGATE_REDIS_PASSWORD` (read by the caller: it is not a flag).
    fn redis_security(&self, password_env: Option<std::ffi::OsString>) -> RedisSecurity {
        use std::os::unix::ffi::OsStringExt;
        RedisSecurity {
            ca: self.redis_ca.clone(),
            client_cert: self.redis_client_cert.clone(),
            client_key: self.redis_client_key.clone(),
            username: self.redis_username.clone(),
            password: password_env.map(|value| Secret::new(value.into_vec())),
            password_file: self.redis_password_file.clone(),
        }
    }

    pub fn server_config(&self) -> ServerConfig {
        let store = match (&self.redis, self.redis_cluster.is_empty()) {
            (Some(url), _) => StoreConfig::Redis(url.clone()),
            (None, false) => StoreConfig::Cluster(self.redis_cluster.clone()),
            (None, true) => StoreConfig::Memory,
        };
        let tls = match (&self.tls_cert, &self.tls_key, &self.tls_client_ca) {
            (Some(cert), Some(key), Some(client_ca)) => Some(TlsSettings {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca.clone(),
                allow: self.tls_allow.clone(),
                reload_every: self.tls_reload_every,
            }),
            _ => None,
        };
        ServerConfig {
            listen: self.listen,
            tls,
            insecure_plaintext: self.insecure_plaintext,
            admin_listen: self.admin_listen,
            store,
            redis_security: self.redis_security(std::env::var_os(PASSWORD_ENV)),
            policies: self.policies.clone().unwrap_or_default(),
            lease_ttl: self.lease_ttl,
            dedup_ttl: self.dedup_ttl,
            assignment_period: self.assignment_period,
            store_timeout: self.store_timeout,
            policy_poll: self.policy_poll,
            region: match (&self.parent, &self.region) {
                (Some(parent_url), Some(region)) => Some(RegionConfig {
                    parent_url: parent_url.clone(),
                    region: region.clone(),
                    parent_timeout: self.parent_timeout,
                    max_keys: self.regional_keys,
                    tls: self.parent_ca.as_ref().map(|ca| ParentTls {
                        ca: ca.clone(),
                        client: self.parent_cert.clone().zip(self.parent_key.clone()),
                    }),
                }),
                _ => None,
            },
            hot_keys: HotKeySettings {
                top: self.hot_keys,
                share: self.hot_key_share,
                min_calls: self.hot_key_min_calls,
                salt_file: self.hot_key_salt_file.clone(),
            },
            rls: match (&self.rls_listen, &self.rls_config) {
                (Some(listen), Some(path)) => Some(RlsServerConfig {
                    listen: *listen,
                    config: path.clone(),
                    poll: self.rls_config_poll,
                    headers: self.rls_response_headers.then(|| HeaderNames {
                        limit: self.rls_limit_header.clone(),
                        remaining: self.rls_remaining_header.clone(),
                        reset: self.rls_reset_header.clone(),
                    }),
                    bounds: Bounds::default(),
                }),
                _ => None,
            },
        }
    }
}

/// Installs the global `tracing` subscriber (stderr). A second call is a no-op.
pub fn init_logging(format: LogFormat, filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Compact => builder.compact().try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_store_selection() {
        let cli = Cli::try_parse_from(["tollgate-limiter", "--policies", "p.json"]).unwrap();
        let c = cli.server_config();
        assert_eq!(c.listen, "127.0.0.1:8081".parse().unwrap());
        assert_eq!(c.store, StoreConfig::Memory);
        assert_eq!(c.lease_ttl, Duration::from_secs(2));
        assert_eq!(c.dedup_ttl, Duration::from_secs(60));
        assert_eq!(c.assignment_period, Duration::from_secs(1));
        assert_eq!(c.store_timeout, Duration::from_millis(50));
        assert_eq!(c.hot_keys, HotKeySettings::default());

        let cli = Cli::try_parse_from([
            "tollgate-limiter",
            "--policies",
            "p.json",
            "--redis-cluster",
            "redis://a:1,redis://b:2",
            "--store-timeout",
            "25ms",
            "--assignment-period",
            "250ms",
        ])
        .unwrap();
        assert_eq!(
            cli.server_config().store,
            StoreConfig::Cluster(vec!["redis://a:1".into(), "redis://b:2".into()])
        );
        assert_eq!(cli.store_timeout, Duration::from_millis(25));
        assert_eq!(
            cli.server_config().assignment_period,
            Duration::from_millis(250)
        );

        let cli = Cli::try_parse_from([
            "tollgate-limiter",
            "--policies",
            "p.json",
            "--redis",
            "redis://a:1",
        ])
        .unwrap();
        assert_eq!(
            cli.server_config().store,
            StoreConfig::Redis("redis://a:1".into())
        );
    }

    #[test]
    fn tls_needs_its_three_files() {
        let base = ["tollgate-limiter", "--policies", "p.json"];
        let parse = |more: &[&str]| {
            Cli::try_parse_from(base.iter().chain(more.iter()).copied())
                .map(|cli| cli.server_config())
        };
        assert_eq!(parse(&[]).unwrap().tls, None);
        let c = parse(&[
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--tls-client-ca",
            "ca.pem",
            "--tls-allow",
            "spiffe://mesh/sa/gw,gateway",
            "--admin-listen",
            "0.0.0.0:9090",
        ])
        .unwrap();
        let tls = c.tls.unwrap();
        assert_eq!(tls.cert, PathBuf::from("c.pem"));
        assert_eq!(tls.allow, vec!["spiffe://mesh/sa/gw", "gateway"]);
        assert_eq!(tls.reload_every, Duration::from_secs(10));
        assert_eq!(c.admin_listen, Some("0.0.0.0:9090".parse().unwrap()));
        for partial in [
            &["--tls-cert", "c.pem", "--tls-key", "k.pem"][..],
            &["--tls-cert", "c.pem", "--tls-client-ca", "ca.pem"][..],
            &["--tls-key", "k.pem"][..],
            &["--tls-client-ca", "ca.pem"][..],
            &["--tls-allow", "gateway"][..],
        ] {
            assert!(parse(partial).is_err(), "{partial:?} accepted");
        }
    }

    #[test]
    fn insecure_plaintext_is_an_explicit_flag_that_excludes_tls() {
        let base = ["tollgate-limiter", "--policies", "p.json"];
        let parse = |more: &[&str]| {
            Cli::try_parse_from(base.iter().chain(more.iter()).copied())
                .map(|cli| cli.server_config())
        };
        assert!(!parse(&[]).unwrap().insecure_plaintext);
        assert!(parse(&["--insecure-plaintext"]).unwrap().insecure_plaintext);
        let tls = ["--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "ca"];
        assert!(parse(&[&tls[..], &["--insecure-plaintext"][..]].concat()).is_err());
    }

    #[test]
    fn redis_credentials_come_from_flags_files_and_the_environment() {
        let base = ["tollgate-limiter", "--policies", "p.json"];
        let parse = |more: &[&str]| {
            Cli::try_parse_from(base.iter().chain(more.iter()).copied())
                .map(|cli| cli.redis_security(None))
        };
        assert_eq!(parse(&[]).unwrap(), RedisSecurity::default());
        let s = parse(&[
            "--redis",
            "rediss://127.0.0.1:6380",
            "--redis-ca",
            "ca.crt",
            "--redis-client-cert",
            "client.crt",
            "--redis-client-key",
            "client.key",
            "--redis-username",
            "tollgate",
            "--redis-password-file",
            "/run/secrets/redis",
        ])
        .unwrap();
        assert_eq!(s.ca, Some(PathBuf::from("ca.crt")));
        assert_eq!(s.client_cert, Some(PathBuf::from("client.crt")));
        assert_eq!(s.client_key, Some(PathBuf::from("client.key")));
        assert_eq!(s.username.as_deref(), Some("tollgate"));
        assert_eq!(s.password_file, Some(PathBuf::from("/run/secrets/redis")));
        assert_eq!(s.password, None);

        // A certificate needs its key, and the reverse; clap names both flags.
        for half in [
            &["--redis-client-cert", "client.crt"][..],
            &["--redis-client-key", "client.key"][..],
        ] {
            let e = parse(half).unwrap_err().to_string();
            assert!(
                e.contains("--redis-client-cert") && e.contains("--redis-client-key"),
                "{e}"
            );
        }
        // The password is no flag.
        assert!(parse(&["--redis-password", "x"]).is_err());

        let cli = Cli::try_parse_from(base).unwrap();
        let s = cli.redis_security(Some("from-env".into()));
        assert_eq!(s.password, Some(Secret::new("from-env")));
        assert!(!format!("{s:?}").contains("from-env"));
        assert!(!format!("{:?}", cli.server_config()).contains("from-env"));
    }

    #[tokio::test]
    async fn both_password_sources_are_refused_when_the_store_is_built() {
        let dir = std::env::temp_dir().join(format!("tollgate-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "from-file\n").unwrap();
        let cli = Cli::try_parse_from([
            "tollgate-limiter",
            "--policies",
            "p.json",
            "--redis-password-file",
            file.to_str().unwrap(),
        ])
        .unwrap();
        let security = cli.redis_security(Some("from-env".into()));
        let settings = crate::store::StoreSettings {
            dedup_ttl_ms: 60_000,
            assignment_period_ms: 1_000,
            lease_ttl_ms: 2_000,
        };
        let e = crate::store::RedisStore::new("redis://127.0.0.1:1", &security, settings)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(PASSWORD_ENV) && e.contains("--redis-password-file"),
            "{e}"
        );
        assert!(!e.contains("from-env") && !e.contains("from-file"), "{e}");
        let only_file = cli.redis_security(None);
        assert!(crate::store::RedisStore::new("redis://127.0.0.1:1", &only_file, settings).is_ok());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn redis_urls_print_without_passwords() {
        let cli = Cli::try_parse_from([
            "tollgate-limiter",
            "--policies",
            "p.json",
            "--redis",
            "redis://u:sekrit@127.0.0.1:6379",
        ])
        .unwrap();
        let shown = format!("{:?}", cli.server_config());
        assert!(!shown.contains("sekrit"), "{shown}");
        assert!(
            shown.contains("redis://u:<redacted>@127.0.0.1:6379"),
            "{shown}"
        );
    }

    #[test]
    fn rejects_conflicts_and_bad_durations() {
        assert!(Cli::try_parse_from([
            "tollgate-limiter",
            "--policies",
            "p.json",
            "--redis",
            "redis://a:1",
            "--redis-cluster",
            "redis://b:2",
        ])
        .is_err());
        assert!(Cli::try_parse_from([
            "tollgate-limiter",
            "--policies",
            "p.json",
            "--lease-ttl",
            "2",
        ])
        .is_err());
        assert!(Cli::try_parse_from([
            "tollgate-limiter",
            "--policies",
            "p.json",
            "--assignment-period",
            "soon",
        ])
        .is_err());
        assert!(Cli::try_parse_from(["tollgate-limiter"]).is_err());
    }

    #[test]
    fn rls_flags_come_in_pairs_and_make_policies_optional() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["tollgate-limiter"].iter().chain(args).copied())
                .map(|cli| cli.server_config())
        };
        let c = parse(&["--rls-listen", "127.0.0.1:9082", "--rls-config", "rl/"]).unwrap();
        assert!(c.policies.as_os_str().is_empty());
        let rls = c.rls.unwrap();
        assert_eq!(rls.listen, "127.0.0.1:9082".parse().unwrap());
        assert_eq!(rls.config, PathBuf::from("rl/"));
        assert_eq!(rls.poll, Duration::from_secs(1));
        assert_eq!(rls.headers, None);
        assert_eq!(rls.bounds, Bounds::default());
        let c = parse(&[
            "--policies",
            "p.json",
            "--rls-listen",
            "127.0.0.1:9082",
            "--rls-config",
            "rl.yaml",
            "--rls-config-poll",
            "250ms",
            "--rls-response-headers",
            "--rls-limit-header",
            "X-RateLimit-Limit",
        ])
        .unwrap();
        assert_eq!(c.policies, PathBuf::from("p.json"));
        let rls = c.rls.unwrap();
        assert_eq!(rls.poll, Duration::from_millis(250));
        let headers = rls.headers.unwrap();
        assert_eq!(headers.limit, "X-RateLimit-Limit");
        assert_eq!(headers.remaining, "RateLimit-Remaining");
        assert_eq!(headers.reset, "RateLimit-Reset");
        // One without the other, or neither and no policies: refused.
        assert!(parse(&["--rls-listen", "127.0.0.1:9082"]).is_err());
        assert!(parse(&["--rls-config", "rl/"]).is_err());
        assert!(parse(&[]).is_err());
        assert_eq!(parse(&["--policies", "p.json"]).unwrap().rls, None);
    }

    #[test]
    fn hot_key_flags() {
        let parse = |more: &[&str]| {
            Cli::try_parse_from(
                ["tollgate-limiter", "--policies", "p.json"]
                    .iter()
                    .chain(more)
                    .copied(),
            )
            .map(|cli| cli.server_config().hot_keys)
        };
        let h = parse(&[
            "--hot-keys",
            "25",
            "--hot-key-share",
            "0.5",
            "--hot-key-min-calls",
            "50",
            "--hot-key-salt-file",
            "/run/secrets/salt",
        ])
        .unwrap();
        assert_eq!(
            h,
            HotKeySettings {
                top: 25,
                share: 0.5,
                min_calls: 50,
                salt_file: Some(PathBuf::from("/run/secrets/salt")),
            }
        );
        for share in ["0", "1.5", "-0.1", "NaN", "lots"] {
            let e = parse(&[&format!("--hot-key-share={share}")])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("--hot-key-share") && e.contains("fraction"),
                "{e}"
            );
        }
        // Range checks the parser leaves to the server name their flag too.
        let mut c = ServerConfig::new("p.json");
        c.hot_keys.top = 0;
        assert!(c.hot_keys.check().unwrap_err().contains("--hot-keys"));
        c.hot_keys.top = 10;
        c.hot_keys.min_calls = 0;
        assert!(c
            .hot_keys
            .check()
            .unwrap_err()
            .contains("--hot-key-min-calls"));
    }
}
