#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! A `client_ip` key cannot be chosen by the client: real Envoys running the shipped configs
//! (`envoy/local.yaml`, `envoy/global.yaml` with the real limiter, `envoy/llm.yaml`) with the
//! built filter, both builds. Requests carrying forged `X-Forwarded-For`, `X-Real-IP` and
//! `Forwarded` headers neither escape a client's limit nor spend another client's (the victim
//! connects from another loopback address, 127.0.0.2). Behind a trusted proxy
//! (`xff_num_trusted_hops: 1`), `trusted_hops: 1` picks the address the proxy appended, the
//! same one Envoy picks (`trusted_hops: 0`), never the proxy's own.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;
use tollgate_e2e::build::Build;
use tollgate_e2e::tollgate::{envoy_config, Limiter, Store};
use tollgate_e2e::{paths, Envoy, EnvoyOptions, Upstream};

const BURST: usize = 4;
const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const VICTIM: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// One policy keyed on the client IP: `BURST` requests, then 429 for an hour.
fn policy(trusted_hops: u32, scope: &str) -> String {
    let limiter = if scope == "global" {
        r#", "limiter": { "cluster": "tollgate_limiter", "timeout": "2s" }"#
    } else {
        ""
    };
    format!(
        r#"{{
  "policies": [{{
    "name": "per-client",
    "match": {{ "routes": ["GET /items/{{id}}"] }},
    "key": [{{ "client_ip": {{ "trusted_hops": {trusted_hops} }} }}],
    "on_missing_key": "deny",
    "rate": {{ "units": 1, "per": "1h" }},
    "burst": {BURST},
    "scope": "{scope}",
    "on_unavailable": {{ "mode": "closed" }}
  }}]{limiter}
}}"#
    )
}

/// A shipped config, test-ready for `build`, unchanged but for ports, paths and the policy.
fn start_envoy(
    build: Build,
    shipped: &str,
    policy: &str,
    upstream: &Upstream,
    limiter: Option<&Limiter>,
    edit: impl Fn(String) -> String,
) -> (Envoy, u16) {
    let config = edit(build.config(envoy_config(
        shipped,
        policy,
        upstream.port(),
        limiter.map(Limiter::port),
    )));
    let envoy = Envoy::start(EnvoyOptions::new(config).concurrency(2).log_level("warn"));
    let port = envoy.listener_port("ingress");
    (envoy, port)
}

/// One HTTP/1.1 request on its own connection from `source` (a loopback address) with extra
/// `headers`; the response status.
async fn get_from(source: Ipv4Addr, port: u16, i: usize, headers: &[(&str, String)]) -> u16 {
    let exchange = async {
        let socket = TcpSocket::new_v4()?;
        socket.bind(SocketAddr::from((source, 0)))?;
        let mut stream = socket
            .connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
            .await?;
        let mut request = format!("GET /items/{i} HTTP/1.1\r\nhost: api.example.com\r\n");
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("connection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .expect("no response within 20 s")
        .expect("request");
    let text = String::from_utf8_lossy(&response);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text}"))
}

/// Every header a client might forge to pass for `ip`.
fn forged(ip: &str) -> Vec<(&'static str, String)> {
    vec![
        ("x-forwarded-for", ip.to_string()),
        ("x-real-ip", ip.to_string()),
        ("forwarded", format!("for={ip}")),
    ]
}

fn admitted(statuses: &[u16]) -> usize {
    for s in statuses {
        assert!(*s == 200 || *s == 429, "{statuses:?}");
    }
    statuses.iter().filter(|s| **s == 200).count()
}

/// The attacker (127.0.0.1) forges a new client address on every request, then the victim's
/// (127.0.0.2); the victim still has its whole limit.
async fn forged_headers_neither_escape_nor_drain(port: u16, what: &str) {
    // A new address per request, in every header form, and a list the client made up.
    let mut attacker = Vec::new();
    for i in 0..10 {
        let mut headers = forged(&format!("198.51.100.{}", 10 + i));
        headers[0].1 = format!("203.0.113.{i}, 192.0.2.{i}");
        attacker.push(get_from(ATTACKER, port, i, &headers).await);
    }
    assert_eq!(
        admitted(&attacker),
        BURST,
        "{what}: forged client addresses escaped the limit: {attacker:?}"
    );
    // Five requests that claim to come from the victim spend the attacker's (empty) budget.
    let mut posing = Vec::new();
    for i in 0..5 {
        posing.push(get_from(ATTACKER, port, i, &forged(&VICTIM.to_string())).await);
    }
    assert_eq!(admitted(&posing), 0, "{what}: {posing:?}");
    let mut victim = Vec::new();
    for i in 0..BURST + 1 {
        victim.push(get_from(VICTIM, port, i, &[]).await);
    }
    assert_eq!(
        victim,
        [vec![200; BURST], vec![429]].concat(),
        "{what}: the victim's limit was spent by requests forging its address"
    );
}

async fn the_local_configs_key_on_the_connection_not_on_forged_headers(build: Build) {
    for shipped in ["envoy/local.yaml", "envoy/llm.yaml"] {
        let upstream = Upstream::start();
        let (_envoy, port) =
            start_envoy(build, shipped, &policy(0, "local"), &upstream, None, |c| c);
        forged_headers_neither_escape_nor_drain(port, shipped).await;
    }
}

async fn the_global_config_keys_on_the_connection_not_on_forged_headers(build: Build) {
    let policy = policy(0, "global");
    let limiter = Limiter::start(&policy, Store::Memory, &[]);
    let upstream = Upstream::start();
    let (_envoy, port) = start_envoy(
        build,
        "envoy/global.yaml",
        &policy,
        &upstream,
        Some(&limiter),
        |c| c,
    );
    forged_headers_neither_escape_nor_drain(port, "envoy/global.yaml").await;
}

/// Behind one trusted proxy (this test's connection from 127.0.0.1 plays it: it appends the
/// address its client connected from to `X-Forwarded-For`), with `xff_num_trusted_hops: 1`:
/// `trusted_hops: 1` keys on the proxy's client, as Envoy's own client address
/// (`trusted_hops: 0`) does. Had `1` counted the entry Envoy appends, every client would
/// share the proxy's bucket.
async fn behind_a_trusted_proxy_trusted_hops_counts_as_envoy(build: Build) {
    for trusted_hops in [1, 0] {
        let upstream = Upstream::start();
        let (_envoy, port) = start_envoy(
            build,
            "envoy/local.yaml",
            &policy(trusted_hops, "local"),
            &upstream,
            None,
            |c| {
                let edited = c.replace(
                    "use_remote_address: true\n",
                    "use_remote_address: true\n          xff_num_trusted_hops: 1\n",
                );
                assert_ne!(edited, c, "no use_remote_address in envoy/local.yaml");
                edited
            },
        );
        let what = format!("trusted_hops {trusted_hops}");
        // Client A (10.0.0.1) spends its limit, whatever it puts in front.
        let mut a = Vec::new();
        for i in 0..BURST + 2 {
            let xff = format!("198.51.100.{i}, 10.0.0.1");
            a.push(get_from(ATTACKER, port, i, &[("x-forwarded-for", xff)]).await);
        }
        assert_eq!(a, [vec![200; BURST], vec![429; 2]].concat(), "{what}");
        // Client B (10.0.0.2) claims to be A: its own limit, untouched by A.
        let mut b = Vec::new();
        for i in 0..BURST + 1 {
            let xff = "10.0.0.1, 10.0.0.2".to_string();
            b.push(get_from(ATTACKER, port, i, &[("x-forwarded-for", xff)]).await);
        }
        assert_eq!(b, [vec![200; BURST], vec![429]].concat(), "{what}");
        // Client C (10.0.0.3) poses as B with the other headers: its own limit too.
        let mut headers = forged("10.0.0.2");
        headers[0].1 = "10.0.0.2, 10.0.0.3".into();
        let c = get_from(ATTACKER, port, 0, &headers).await;
        assert_eq!(c, 200, "{what}");
    }
}

/// Every ingress connection manager of every shipped Envoy config takes the client address
/// from the connection (the e2e cases above run three of them; `envoy/global-mtls.yaml` is
/// `envoy/global.yaml` plus TLS to the limiter, which `limiter_tls.rs` holds it to; `rls.rs`
/// runs `envoy/ratelimit-service.yaml`, whose `remote_address` descriptors read it).
#[test]
fn every_shipped_envoy_config_uses_the_remote_address() {
    let dir = paths::workspace_root().join("envoy");
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        if !text.contains("stat_prefix: ingress") {
            continue;
        }
        let lines: Vec<&str> = text.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.trim() == "stat_prefix: ingress")
            .unwrap();
        // The connection manager's own settings: the lines at its indentation up to its
        // route_config.
        let indent = lines[at].len() - lines[at].trim_start().len();
        let settings: Vec<&str> = lines[at..]
            .iter()
            .take_while(|l| !l.trim_start().starts_with("route_config:"))
            .filter(|l| l.len() - l.trim_start().len() == indent)
            .map(|l| l.trim())
            .collect();
        assert!(
            settings.contains(&"use_remote_address: true"),
            "{}: the ingress must use the remote address: {settings:?}",
            path.display()
        );
        assert!(
            !settings.iter().any(|s| s.starts_with("skip_xff_append")),
            "{}: Envoy must append the connecting address",
            path.display()
        );
        checked.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    checked.sort();
    assert_eq!(
        checked,
        [
            "global-mtls.yaml",
            "global.yaml",
            "llm.yaml",
            "local.yaml",
            "ratelimit-service.yaml"
        ]
    );
}

tollgate_e2e::both_builds!(
    async: [
        the_local_configs_key_on_the_connection_not_on_forged_headers,
        the_global_config_keys_on_the_connection_not_on_forged_headers,
        behind_a_trusted_proxy_trusted_hops_counts_as_envoy,
    ],
    sync: [],
);
