//! Command-line flags (each with an environment variable fallback) and logging set-up for the
//! `tollgate-limiter` binary; turned into a [`ServerConfig`] so the library never sees clap.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use tollgate_core::duration::Millis;

use crate::server::{ServerConfig, StoreConfig};

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

    /// Address to serve HTTP/1.1 and h2c on.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// One Redis server, e.g. redis://127.0.0.1:6379. Without --redis or --redis-cluster the
    /// buckets live in this process.
    #[arg(long, env = "TOLLGATE_REDIS", conflicts_with = "redis_cluster")]
    pub redis: Option<String>,

    /// Redis Cluster node URLs, comma-separated (any reachable node is enough).
    #[arg(long, env = "TOLLGATE_REDIS_CLUSTER", value_delimiter = ',')]
    pub redis_cluster: Vec<String>,

    /// The policy document (the same JSON the filter is configured with); reloaded on change.
    #[arg(long, env = "TOLLGATE_POLICIES", required = true)]
    pub policies: Option<PathBuf>,

    /// How long a granted lease may be spent (its `expires_ms`).
    #[arg(long, env = "TOLLGATE_LEASE_TTL", default_value = "2s", value_parser = parse_duration)]
    pub lease_ttl: Duration,

    /// How long a lease id is remembered for dedup and returns (longer than --lease-ttl).
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

    /// How often the policy file is checked for changes.
    #[arg(long, env = "TOLLGATE_POLICY_POLL", default_value = "1s", value_parser = parse_duration)]
    pub policy_poll: Duration,

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
    },
}

/// `25ms`, `2s`, `1m`: the policy document's duration syntax.
fn parse_duration(text: &str) -> Result<Duration, String> {
    Millis::parse(text).map(|m| Duration::from_millis(m.as_millis()))
}

impl Cli {
    pub fn server_config(&self) -> ServerConfig {
        let store = match (&self.redis, self.redis_cluster.is_empty()) {
            (Some(url), _) => StoreConfig::Redis(url.clone()),
            (None, false) => StoreConfig::Cluster(self.redis_cluster.clone()),
            (None, true) => StoreConfig::Memory,
        };
        ServerConfig {
            listen: self.listen,
            store,
            policies: self.policies.clone().unwrap_or_default(),
            lease_ttl: self.lease_ttl,
            dedup_ttl: self.dedup_ttl,
            assignment_period: self.assignment_period,
            store_timeout: self.store_timeout,
            policy_poll: self.policy_poll,
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
}
