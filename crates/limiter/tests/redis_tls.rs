//! The limiter binary against a real redis-server over TLS, with a client certificate and an
//! ACL user's password: leases work when the credentials are right; when they are wrong (a
//! Redis certificate from another CA, a client certificate Redis does not trust, a wrong
//! password, none at all) the limiter still starts, `/readyz` says which it is, the log names
//! it, and Redis is not dialed in a loop; when they are fixed, it recovers by itself. The
//! password and the client key never show in the logs or `/metrics`.
//!
//! The limiter is only ever given the TLS port (`rediss://`); the harness keeps the plain
//! loopback port for its own admin commands. Certificates are made at test time in each
//! test's log directory.
//!
//! The `e2e` tier (it needs `redis-server`): built only with the feature.

// Test code: failing loudly is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::time::{Duration, Instant};

use support::*;
use tollgate_e2e::http_blocking::{self, BlockingResponse};
use tollgate_e2e::pki::{CertFiles, TestCa};
use tollgate_e2e::process::wait_for;
use tollgate_e2e::tollgate::{Limiter, Store};
use tollgate_e2e::{RedisCluster, RedisServer};

/// Generous for a loaded 2-core machine: the limiter's store timeout (the default 50 ms would
/// turn slow TLS answers into UNAVAILABLE) and every wait of these tests.
const STORE_TIMEOUT: &str = "500ms";
const WAIT: Duration = WAIT_LIMIT;
const HTTP: Duration = Duration::from_secs(5);

/// A TLS Redis of its own (client certificates required, an ACL user) and its certificates.
fn tls_redis(label: &str) -> (TlsPki, RedisServer) {
    let pki = TlsPki::new(&format!("{label}-pki"));
    let server = RedisServer::start_with(pki.options(label));
    (pki, server)
}

fn path(p: &std::path::Path) -> String {
    p.display().to_string()
}

/// The limiter's TLS flags for `pki`: its CA, its client certificate and the ACL user
/// (the password comes separately: a file or the environment).
fn tls_flags(ca: &std::path::Path, client: &CertFiles, user: &str) -> Vec<String> {
    vec![
        "--redis-ca".into(),
        path(ca),
        "--redis-client-cert".into(),
        path(&client.cert),
        "--redis-client-key".into(),
        path(&client.key),
        "--redis-username".into(),
        user.into(),
        "--store-timeout".into(),
        STORE_TIMEOUT.into(),
    ]
}

fn good_flags(pki: &TlsPki) -> Vec<String> {
    let mut flags = tls_flags(&pki.redis.ca, &pki.client, &pki.user.name);
    flags.extend(["--redis-password-file".into(), path(&pki.password_file)]);
    flags
}

fn start(store: Store, flags: &[String], env: &[(&str, &str)]) -> Limiter {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Limiter::try_start_with_env(DOC, store, &flags, env).unwrap_or_else(|e| panic!("{e}"))
}

fn readyz(limiter: &Limiter) -> BlockingResponse {
    http_blocking::get(limiter.port(), "/readyz", HTTP).expect("/readyz answers")
}

/// Waits until `/readyz` answers `status` with a body containing `needle`; returns the body.
fn wait_ready(limiter: &Limiter, status: u16, needle: &str) -> String {
    let mut last = String::new();
    wait_for(&format!("/readyz {status} with {needle:?}"), WAIT, || {
        let r = readyz(limiter);
        last = r.body.clone();
        (r.status == status && r.body.contains(needle)).then_some(r.body)
    })
    .unwrap_or_else(|e| panic!("{e}; last /readyz: {last}\nlogs:\n{}", logs(limiter)))
}

/// The limiter's stdout and stderr without the terminal colour codes of its log lines.
fn logs(limiter: &Limiter) -> String {
    let raw = limiter.logs();
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw.as_str();
    while let Some(start) = rest.find("\x1b[") {
        out.push_str(&rest[..start]);
        rest = &rest[start + 2..];
        match rest.find('m') {
            Some(end) => rest = &rest[end + 1..],
            None => rest = "",
        }
    }
    out.push_str(rest);
    out
}

/// Waits until the limiter's log has a line containing every one of `needles`.
fn wait_log(limiter: &Limiter, needles: &[&str]) -> String {
    wait_for(&format!("a log line with {needles:?}"), WAIT, || {
        logs(limiter)
            .lines()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .map(str::to_owned)
    })
    .unwrap_or_else(|e| panic!("{e}; logs:\n{}", logs(limiter)))
}

/// One lease of `want` from `key`: `Some(granted)`, or `None` for UNAVAILABLE.
fn lease_once(limiter: &Limiter, key: &str, want: u64) -> Option<u64> {
    let body = lease_body(&unique("id"), "tenant", key, 1, want);
    let r = http_blocking::post(limiter.port(), "/v1/leases", &body, HTTP).expect("lease answers");
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON answer");
    match r.status {
        200 => Some(granted(&v)),
        503 => {
            assert_eq!(v["error"], "UNAVAILABLE", "{v}");
            None
        }
        other => panic!("unexpected {other}: {v}"),
    }
}

/// Drains a fresh key of "tenant" (burst 10); every answer must be a decision.
fn drain(limiter: &Limiter) -> u64 {
    let key = unique("tls");
    let mut total = 0;
    for _ in 0..20 {
        match lease_once(limiter, &key, 3) {
            Some(0) => return total,
            Some(g) => total += g,
            None => panic!("UNAVAILABLE while draining:\n{}", logs(limiter)),
        }
    }
    panic!("{key} never ran out: {total} granted");
}

/// `(user, local port)` of every client connected to `server` (`CLIENT LIST`).
fn clients(server: &RedisServer) -> Vec<(String, u16)> {
    server
        .cli(&["CLIENT", "LIST"])
        .lines()
        .filter_map(|line| {
            let field = |name: &str| {
                line.split(' ')
                    .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                    .map(str::to_owned)
            };
            let port = field("laddr")?.rsplit(':').next()?.parse().ok()?;
            Some((field("user")?, port))
        })
        .collect()
}

/// Failed authentications Redis counted: the `count` of its `ACL LOG` entries of reason
/// `auth` (Redis 7.0 has no counter of its own in `INFO`).
fn auth_failures(server: &RedisServer) -> u64 {
    let log = server.cmd(&["ACL", "LOG"]);
    let entries = log.as_array().unwrap_or_else(|| panic!("ACL LOG: {log:?}"));
    entries
        .iter()
        .filter_map(|entry| {
            let fields = entry.as_array()?;
            let field = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| kv[0].as_str() == Some(name))
                    .map(|kv| kv[1].clone())
            };
            (field("reason")?.as_str()? == "auth").then(|| field("count")?.as_int())?
        })
        .map(|n| u64::try_from(n).unwrap_or(0))
        .sum()
}

/// TLS handshakes Redis refused for want of a client certificate, as its log counts them.
fn certificate_refusals(server: &RedisServer) -> usize {
    server
        .logs()
        .lines()
        .filter(|l| l.contains("peer did not return a certificate"))
        .count()
}

/// Waits (bounded) until `count` has not changed for a second.
fn wait_quiet(count: impl Fn() -> usize) {
    let deadline = Instant::now() + WAIT;
    let mut last = (count(), Instant::now());
    while last.1.elapsed() < Duration::from_secs(1) {
        assert!(Instant::now() < deadline, "still changing after {WAIT:?}");
        std::thread::sleep(Duration::from_millis(50));
        let now = count();
        if now != last.0 {
            last = (now, Instant::now());
        }
    }
}

/// Sends leases for `how_long` (each must fail at once: held back, not a new handshake);
/// returns how many were sent.
fn leases_while_refused(limiter: &Limiter, how_long: Duration) -> u32 {
    let until = Instant::now() + how_long;
    let mut sent = 0;
    while Instant::now() < until {
        let started = Instant::now();
        assert_eq!(lease_once(limiter, &unique("refused"), 1), None);
        sent += 1;
        // Generous: a fresh handshake per call would also be fast on loopback; the counts
        // on the Redis side are what tell the two apart.
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a lease took {:?}",
            started.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    sent
}

/// Right credentials: leases are decided (exactly the burst), and Redis sees the limiter only
/// as the ACL user, only on its TLS port.
#[test]
fn leases_work_over_tls_with_a_client_certificate_and_an_acl_user() {
    let (pki, redis) = tls_redis("tls-leases");
    let limiter = start(Store::Redis(redis.tls_url()), &good_flags(&pki), &[]);
    wait_ready(&limiter, 200, r#""ready":true"#);
    assert_eq!(drain(&limiter), 10);
    let tls_port = redis.tls_port().expect("a TLS port");
    let ours: Vec<_> = clients(&redis)
        .into_iter()
        .filter(|(user, _)| user != tollgate_e2e::redis::ADMIN_USER)
        .collect();
    assert!(!ours.is_empty(), "no limiter connection in CLIENT LIST");
    for (user, port) in &ours {
        assert_eq!(user, TLS_USER, "{ours:?}");
        assert_eq!(
            *port, tls_port,
            "a limiter connection off the TLS port: {ours:?}"
        );
    }
}

/// The password from `TOLLGATE_REDIS_PASSWORD` (no file, no flag) works the same.
#[test]
fn the_password_may_come_from_the_environment() {
    let (pki, redis) = tls_redis("tls-env-password");
    let flags = tls_flags(&pki.redis.ca, &pki.client, &pki.user.name);
    let limiter = start(
        Store::Redis(redis.tls_url()),
        &flags,
        &[("TOLLGATE_REDIS_PASSWORD", &pki.user.password)],
    );
    wait_ready(&limiter, 200, r#""ready":true"#);
    assert_eq!(drain(&limiter), 10);
}

/// A Redis certificate signed by a CA the limiter does not trust: it starts, is not ready,
/// and says TLS (the certificate's issuer is unknown); leases answer UNAVAILABLE.
#[test]
fn a_redis_certificate_from_another_ca_is_a_tls_error() {
    let (pki, redis) = tls_redis("tls-wrong-ca");
    let other = TestCa::new("another CA");
    let wrong_ca = other.write_cert(&pki.dir, "another-ca.crt");
    let mut flags = tls_flags(&wrong_ca, &pki.client, &pki.user.name);
    flags.extend(["--redis-password-file".into(), path(&pki.password_file)]);
    let limiter = start(Store::Redis(redis.tls_url()), &flags, &[]);
    let body = wait_ready(&limiter, 503, "TLS handshake with the store failed");
    assert!(body.contains("UnknownIssuer"), "{body}");
    assert!(!body.contains("authentication"), "{body}");
    wait_log(
        &limiter,
        &["ERROR", "TLS handshake with Redis failed", "UnknownIssuer"],
    );
    assert_eq!(lease_once(&limiter, &unique("k"), 1), None);
}

/// A client certificate Redis' CA did not sign, or none at all: Redis ends the handshake,
/// and the limiter says TLS and why.
#[test]
fn a_client_certificate_redis_does_not_trust_is_a_tls_error() {
    let (pki, redis) = tls_redis("tls-wrong-client");
    let other = TestCa::new("another CA");
    let stranger = other.client(&pki.dir, "stranger", None);
    let mut flags = tls_flags(&pki.redis.ca, &stranger, &pki.user.name);
    flags.extend(["--redis-password-file".into(), path(&pki.password_file)]);
    let limiter = start(Store::Redis(redis.tls_url()), &flags, &[]);
    let body = wait_ready(&limiter, 503, "TLS handshake with the store failed");
    assert!(body.contains("UnknownCA"), "{body}");
    wait_log(
        &limiter,
        &["ERROR", "TLS handshake with Redis failed", "UnknownCA"],
    );

    let flags = vec![
        "--redis-ca".to_string(),
        path(&pki.redis.ca),
        "--redis-username".into(),
        pki.user.name.clone(),
        "--redis-password-file".into(),
        path(&pki.password_file),
        "--store-timeout".into(),
        STORE_TIMEOUT.into(),
    ];
    let limiter = start(Store::Redis(redis.tls_url()), &flags, &[]);
    let body = wait_ready(&limiter, 503, "TLS handshake with the store failed");
    assert!(body.contains("CertificateRequired"), "{body}");
}

/// A wrong password, or none: the limiter starts, is not ready, and says authentication
/// failed (not TLS: the handshake went through).
#[test]
fn a_wrong_or_missing_password_is_an_authentication_error() {
    let (pki, redis) = tls_redis("tls-wrong-password");
    let flags = tls_flags(&pki.redis.ca, &pki.client, &pki.user.name);
    let limiter = start(
        Store::Redis(redis.tls_url()),
        &flags,
        &[("TOLLGATE_REDIS_PASSWORD", "not-the-password")],
    );
    let body = wait_ready(&limiter, 503, "authentication with the store failed");
    assert!(!body.contains("TLS"), "{body}");
    let line = wait_log(
        &limiter,
        &["ERROR", "Redis refused authentication", r#"kind="auth""#],
    );
    assert!(line.contains("authentication failed"), "{line}");
    assert_eq!(lease_once(&limiter, &unique("k"), 1), None);

    // No user name and no password: Redis (whose default user is off) wants them.
    let mut flags = tls_flags(&pki.redis.ca, &pki.client, &pki.user.name);
    flags.drain(6..8);
    assert!(!flags.iter().any(|f| f == "--redis-username"));
    let limiter = start(Store::Redis(redis.tls_url()), &flags, &[]);
    let body = wait_ready(&limiter, 503, "authentication with the store failed");
    assert!(body.contains("requires authentication"), "{body}");
}

/// Refused credentials are not retried per call: while Redis refuses them, leases fail at once
/// and Redis sees a few probes (one per pause, the pause doubling), not a handshake or an
/// `AUTH` per call. Once the credentials are good again (here: Redis' ACL takes the
/// password), the limiter notices by itself, within a pause, and serves.
#[test]
fn refused_credentials_are_probed_not_retried_per_call_and_recover() {
    let (pki, redis) = tls_redis("tls-refusal-pace");

    // A wrong password.
    let flags = tls_flags(&pki.redis.ca, &pki.client, &pki.user.name);
    let limiter = start(
        Store::Redis(redis.tls_url()),
        &flags,
        &[("TOLLGATE_REDIS_PASSWORD", "stale-password")],
    );
    wait_ready(&limiter, 503, "authentication with the store failed");
    let before = auth_failures(&redis);
    let sent = leases_while_refused(&limiter, Duration::from_secs(6));
    let probes = auth_failures(&redis) - before;
    println!("{sent} leases while refused; {probes} AUTH attempts reached Redis");
    assert!(sent >= 20, "only {sent} leases sent");
    // Pauses of 1, 2, 4 s (and 8): at most 3 probes in 6 s.
    assert!(probes <= 4, "{probes} AUTH attempts for {sent} leases");

    // The operator fixes the ACL: the stale password becomes a valid one.
    assert_eq!(
        redis.cli(&["ACL", "SETUSER", &pki.user.name, ">stale-password"]),
        "OK"
    );
    wait_ready(&limiter, 200, r#""ready":true"#);
    wait_log(&limiter, &["Redis accepts the limiter's credentials again"]);
    assert_eq!(drain(&limiter), 10);

    // No client certificate: Redis refuses the handshake; the same pace.
    let flags = vec![
        "--redis-ca".to_string(),
        path(&pki.redis.ca),
        "--redis-username".into(),
        pki.user.name.clone(),
        "--redis-password-file".into(),
        path(&pki.password_file),
        "--store-timeout".into(),
        STORE_TIMEOUT.into(),
    ];
    let limiter = start(Store::Redis(redis.tls_url()), &flags, &[]);
    wait_ready(&limiter, 503, "CertificateRequired");
    // The connection that met the refusal may still be finishing the reconnect attempts it
    // had started by itself (at most 7, half a second apart at most): wait until Redis has
    // seen none for a second; after them, only probes reach it.
    wait_quiet(|| certificate_refusals(&redis));
    let before = certificate_refusals(&redis);
    let sent = leases_while_refused(&limiter, Duration::from_secs(6));
    let refused = certificate_refusals(&redis) - before;
    println!("{sent} leases while refused; {refused} handshakes without a certificate");
    assert!(sent >= 20, "only {sent} leases sent");
    assert!(refused <= 5, "{refused} handshakes for {sent} leases");
}

/// Nothing secret in the logs (debug level) or the metrics: not the password — from a file,
/// from the environment, or in the URL — and no line of the client key, whatever happens:
/// leases, a wrong password, an untrusted certificate.
#[test]
fn secrets_never_appear_in_logs_or_metrics() {
    let (pki, redis) = tls_redis("tls-secrets");
    let key_lines: Vec<&str> = pki
        .client
        .key_pem
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert!(key_lines.len() > 2, "a PEM key has lines");
    let wrong_password = format!("wrong-{}", unique("secret"));
    let check = |limiter: &Limiter, secrets: &[&str]| {
        let logs = logs(limiter);
        let raw = limiter.logs();
        let metrics = limiter.metrics();
        assert!(!metrics.is_empty(), "no /metrics");
        for secret in secrets.iter().chain(&key_lines) {
            assert!(!logs.contains(secret), "{secret:?} in the logs:\n{logs}");
            assert!(!raw.contains(secret), "{secret:?} in the logs:\n{raw}");
            assert!(
                !metrics.contains(secret),
                "{secret:?} in /metrics:\n{metrics}"
            );
        }
    };
    let debug = |mut flags: Vec<String>, filter: &str| {
        flags.extend(["--log".into(), filter.into()]);
        flags
    };

    // Right credentials (password from a file), a few leases and returns.
    let limiter = start(
        Store::Redis(redis.tls_url()),
        &debug(good_flags(&pki), "tollgate_limiter=debug"),
        &[],
    );
    wait_ready(&limiter, 200, r#""ready":true"#);
    assert_eq!(drain(&limiter), 10);
    let r = http_blocking::post(
        limiter.port(),
        "/v1/leases/return",
        &return_body("nope", "tenant", "k", 1),
        HTTP,
    )
    .expect("return answers");
    assert_eq!(r.status, 200, "{}", r.body);
    check(&limiter, &[&pki.user.password]);

    // A wrong password from the environment; every target at debug, the Redis client's too.
    let flags = tls_flags(&pki.redis.ca, &pki.client, &pki.user.name);
    let limiter = start(
        Store::Redis(redis.tls_url()),
        &debug(flags, "debug"),
        &[("TOLLGATE_REDIS_PASSWORD", &wrong_password)],
    );
    wait_ready(&limiter, 503, "authentication with the store failed");
    assert_eq!(lease_once(&limiter, &unique("k"), 1), None);
    check(&limiter, &[&wrong_password, &pki.user.password]);

    // The password in the URL (accepted, with a warning): never printed with it.
    let url = format!(
        "rediss://{}:{}@127.0.0.1:{}",
        pki.user.name,
        pki.user.password,
        redis.tls_port().expect("TLS port")
    );
    let mut flags = tls_flags(&pki.redis.ca, &pki.client, &pki.user.name);
    flags.drain(6..8);
    let limiter = start(
        Store::Redis(url),
        &debug(flags, "tollgate_limiter=debug"),
        &[],
    );
    wait_ready(&limiter, 200, r#""ready":true"#);
    assert_eq!(drain(&limiter), 10);
    let warning = wait_log(&limiter, &["WARN", "the Redis URL carries a password"]);
    assert_eq!(
        logs(&limiter)
            .matches("the Redis URL carries a password")
            .count(),
        1,
        "warned once: {warning}"
    );
    check(&limiter, &[&pki.user.password]);

    // An untrusted Redis certificate, with the client key loaded.
    let other = TestCa::new("another CA");
    let wrong_ca = other.write_cert(&pki.dir, "another-ca.crt");
    let mut flags = tls_flags(&wrong_ca, &pki.client, &pki.user.name);
    flags.extend(["--redis-password-file".into(), path(&pki.password_file)]);
    let limiter = start(Store::Redis(redis.tls_url()), &debug(flags, "debug"), &[]);
    wait_ready(&limiter, 503, "TLS handshake with the store failed");
    assert_eq!(lease_once(&limiter, &unique("k"), 1), None);
    check(&limiter, &[&pki.user.password]);
}

/// A bad file stops the limiter at start, naming the flag and the file, never its contents.
#[test]
fn a_bad_credential_file_stops_the_limiter_at_start() {
    let (pki, redis) = tls_redis("tls-bad-file");
    let mut flags = good_flags(&pki);
    // The client key in place of the CA: not a certificate.
    flags[1] = path(&pki.client.key);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let e = Limiter::try_start(DOC, Store::Redis(redis.tls_url()), &flags)
        .expect_err("a key is no CA")
        .to_string();
    assert!(
        e.contains("--redis-ca") && e.contains(&path(&pki.client.key)),
        "{e}"
    );
    for line in pki.client.key_pem.lines().filter(|l| !l.is_empty()) {
        assert!(!e.contains(line), "key material in: {e}");
    }
    // TLS files with a plain URL.
    let flags = good_flags(&pki);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let e = Limiter::try_start(DOC, Store::Redis(redis.url()), &flags)
        .expect_err("TLS files with redis://")
        .to_string();
    assert!(e.contains("use rediss://"), "{e}");
}

/// The same against a TLS Redis Cluster (TLS cluster bus, client certificates, an ACL user):
/// leases work through one start-up node (the others at the TLS ports CLUSTER SLOTS gives);
/// a wrong password shows as an authentication failure, an untrusted certificate as a TLS
/// one, and refused credentials are probed, not retried per call.
#[test]
fn a_tls_cluster_serves_leases_and_names_a_refused_password() {
    let pki = TlsPki::new("tls-cluster-pki");
    let cluster = RedisCluster::start_with(3, 0, pki.options(""));
    let first = cluster.tls_urls()[..1].to_vec();
    let limiter = start(Store::Cluster(first.clone()), &good_flags(&pki), &[]);
    wait_ready(&limiter, 200, r#""ready":true"#);
    for _ in 0..3 {
        assert_eq!(drain(&limiter), 10);
    }
    for server in cluster.servers() {
        let tls_port = server.tls_port().expect("a TLS port");
        for (user, port) in clients(server) {
            if user == TLS_USER {
                assert_eq!(port, tls_port, "a limiter connection off the TLS port");
            }
        }
    }

    let flags = tls_flags(&pki.redis.ca, &pki.client, &pki.user.name);
    let limiter = start(
        Store::Cluster(first),
        &flags,
        &[("TOLLGATE_REDIS_PASSWORD", "not-the-password")],
    );
    let body = wait_ready(&limiter, 503, "authentication with the store failed");
    assert!(!body.contains("TLS"), "{body}");
    wait_log(&limiter, &["ERROR", "Redis refused authentication"]);

    // A CA that did not sign the nodes' certificates: TLS, named as such.
    let other = TestCa::new("another CA");
    let wrong_ca = other.write_cert(&pki.dir, "another-ca.crt");
    let mut flags = tls_flags(&wrong_ca, &pki.client, &pki.user.name);
    flags.extend(["--redis-password-file".into(), path(&pki.password_file)]);
    let untrusting = start(
        Store::Cluster(cluster.tls_urls()[..1].to_vec()),
        &flags,
        &[],
    );
    let body = wait_ready(&untrusting, 503, "TLS handshake with the store failed");
    assert!(body.contains("UnknownIssuer"), "{body}");

    // Held back here too: a few probes, not an `AUTH` per call (nor the cluster client's
    // own reconnect loop).
    let failures = || cluster.servers().iter().map(auth_failures).sum::<u64>();
    let before = failures();
    let sent = leases_while_refused(&limiter, Duration::from_secs(6));
    let probes = failures() - before;
    println!("{sent} leases while refused; {probes} AUTH attempts reached the cluster");
    assert!(sent >= 20, "only {sent} leases sent");
    assert!(probes <= 4, "{probes} AUTH attempts for {sent} leases");
}
