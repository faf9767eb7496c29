//! The limiter through its HTTP API, started in-process on 127.0.0.1:0: exactness under 64
//! concurrent connections (memory; Redis and Redis Cluster in the `e2e` tier), dedup by lease id, returns, settled units, h2c (and
//! its connections surviving a stall's backlog of cancelled streams), request validation, health/readiness/metrics, policy reload, an unreachable store, and the
//! real binary's flags and signal handling.

// Test code: failing loudly is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use support::*;
use tollgate_e2e::{burst, RequestSpec};
use tollgate_limiter::StoreConfig;

/// 64 clients, each on its own keep-alive connection, fire 320 lease requests (want 1..=3)
/// at one key of capacity 100 with negligible refill: exactly 100 units are granted.
async fn sixty_four_clients_get_exactly_the_capacity(store: StoreConfig) {
    let limiter = start(store).await;
    let key = unique("hammer");
    let responses = burst(limiter.addr().port(), 320, 64, |i| {
        RequestSpec::post(
            "/v1/leases",
            lease_body(&format!("h{i}"), "hundred", &key, 1, 1 + (i as u64 % 3)),
        )
    })
    .await;
    let mut total = 0;
    let mut denied = 0;
    for r in &responses {
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        let g = granted(&v);
        total += g;
        if g == 0 {
            denied += 1;
            assert!(v["leases"][0]["retry_after_ms"].as_u64().unwrap() > 0);
        }
    }
    println!(
        "granted {total} over {} requests ({denied} denied)",
        responses.len()
    );
    assert_eq!(total, 100);
    limiter.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_memory() {
    sixty_four_clients_get_exactly_the_capacity(StoreConfig::Memory).await;
}

#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_redis() {
    sixty_four_clients_get_exactly_the_capacity(StoreConfig::Redis(shared_redis().url())).await;
}

#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_clients_cluster() {
    sixty_four_clients_get_exactly_the_capacity(StoreConfig::Cluster(shared_cluster().urls()))
        .await;
}

/// A lease id sent twice, then one sent by 32 connections at once: granted once each.
#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_lease_id_is_granted_once() {
    let limiter = start(StoreConfig::Redis(shared_redis().url())).await;
    let addr = limiter.addr();
    let key = unique("dup");
    let body = lease_body("retry-me", "tenant", &key, 4, 4);
    let (s1, first) = post(addr, "/v1/leases", &body).await;
    let (s2, second) = post(addr, "/v1/leases", &body).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(granted(&first), 4);
    assert_eq!(
        first["leases"], second["leases"],
        "a retry gets the original answer"
    );
    // 6 left: the retry took nothing.
    let (_, rest) = post(
        addr,
        "/v1/leases",
        &lease_body("rest", "tenant", &key, 6, 6),
    )
    .await;
    assert_eq!(granted(&rest), 6);

    let key = unique("dup-burst");
    let body = lease_body("twin", "tenant", &key, 3, 3);
    let responses = burst(addr.port(), 32, 32, |_| {
        RequestSpec::post("/v1/leases", body.clone())
    })
    .await;
    for r in &responses {
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(granted(&v), 3);
    }
    let (_, rest) = post(
        addr,
        "/v1/leases",
        &lease_body("after", "tenant", &key, 7, 7),
    )
    .await;
    assert_eq!(granted(&rest), 7, "32 copies of one id took 3 tokens once");
    let (_, none) = post(
        addr,
        "/v1/leases",
        &lease_body("none", "tenant", &key, 1, 1),
    )
    .await;
    assert_eq!(granted(&none), 0);
    limiter.shutdown().await;
}

/// Unused tokens go back once; the response carries the policy version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unused_tokens_are_returned_once() {
    let limiter = start(StoreConfig::Memory).await;
    let addr = limiter.addr();
    let key = unique("ret");
    let (_, v) = post(
        addr,
        "/v1/leases",
        &lease_body("l1", "tenant", &key, 10, 10),
    )
    .await;
    assert_eq!(granted(&v), 10);
    assert_eq!(v["leases"][0]["expires_ms"], 2000);
    assert_eq!(v["policy_version"], policies().version);
    let (s, v) = post(
        addr,
        "/v1/leases/return",
        &return_body("l1", "tenant", &key, 7),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(v["returns"][0]["returned"], 7);
    let (_, v) = post(
        addr,
        "/v1/leases/return",
        &return_body("l1", "tenant", &key, 7),
    )
    .await;
    assert_eq!(v["returns"][0]["returned"], 3);
    let (_, v) = post(
        addr,
        "/v1/leases/return",
        &return_body("l1", "tenant", &key, 7),
    )
    .await;
    assert_eq!(v["returns"][0]["returned"], 0);
    let (_, v) = post(
        addr,
        "/v1/leases",
        &lease_body("l2", "tenant", &key, 10, 10),
    )
    .await;
    assert_eq!(granted(&v), 10);
    limiter.shutdown().await;
}

/// `body` (a JSON object) with `"settled":<settled>` added.
fn with_settled(body: &str, settled: &str) -> String {
    let open = body.trim_end().strip_suffix('}').expect("a JSON object");
    format!(r#"{open},"settled":{settled}}}"#)
}

/// Units settled, piggybacked on lease and return batches, are summed per policy the
/// document defines (local ones too); other names go to `(unknown)`, never to a label of
/// their own. A retried lease batch (every item a replay) is not counted twice; a batch
/// refused whole (too many entries, a bad amount) counts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_units_are_counted_per_known_policy() {
    let limiter = start(StoreConfig::Memory).await;
    let addr = limiter.addr();
    let key = unique("settled");
    let lease = with_settled(
        &lease_body("s1", "tenant", &key, 4, 4),
        r#"{"tenant":5,"hundred":2,"no-such-policy":7,"zero":0}"#,
    );
    let (status, v) = post(addr, "/v1/leases", &lease).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(granted(&v), 4);
    // The filter's retry of a callout that got no answer: same ids, same map. Every item is
    // a replay, so the batch was counted when it was first decided.
    let (status, v) = post(addr, "/v1/leases", &lease).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(granted(&v), 4, "replayed: {v}");
    // A batch with a fresh item next to a replayed one counts.
    let mixed = format!(
        r#"{{"leases":[
        {{"id":"s1","policy":"tenant","key":"{key}","min":4,"want":4}},
        {{"id":"s2","policy":"tenant","key":"{key}","min":1,"want":1}}],
        "settled":{{"tenant":10}}}}"#
    );
    let (status, v) = post(addr, "/v1/leases", &mixed).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["leases"][1]["granted"], 1, "{v}");
    let ret = with_settled(
        &return_body("s1", "tenant", &key, 3),
        r#"{"tenant":3,"local-only":4,"other-unknown":1}"#,
    );
    let (status, v) = post(addr, "/v1/leases/return", &ret).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["returns"][0]["returned"], 3);
    // Nothing to return, only settlements; and a lease batch without the field.
    let (status, v) = post(
        addr,
        "/v1/leases/return",
        r#"{"returns":[],"settled":{"tenant":1}}"#,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (status, _) = post(addr, "/v1/leases", &lease_body("s3", "tenant", &key, 1, 1)).await;
    assert_eq!(status, 200);

    // Refused whole: more entries than a document may have policies, or a bad amount.
    let many: Vec<String> = (0..1025).map(|i| format!(r#""p{i}":1"#)).collect();
    let many = format!("{{{}}}", many.join(","));
    for (path, body) in [
        (
            "/v1/leases",
            with_settled(&lease_body("big", "tenant", &key, 1, 1), &many),
        ),
        (
            "/v1/leases/return",
            with_settled(&return_body("s1", "tenant", &key, 1), &many),
        ),
        (
            "/v1/leases",
            with_settled(&lease_body("neg", "tenant", &key, 1, 1), r#"{"tenant":-1}"#),
        ),
        (
            "/v1/leases/return",
            with_settled(&return_body("s1", "tenant", &key, 1), r#"{"tenant":0.5}"#),
        ),
    ] {
        let (status, v) = post(addr, path, &body).await;
        assert_eq!(status, 400, "{path}: {v}");
        assert_eq!(v["error"], "INVALID_REQUEST");
        assert!(v["reason"].is_string(), "{v}");
    }
    let (status, v) = post(
        addr,
        "/v1/leases",
        &with_settled(&lease_body("big", "tenant", &key, 1, 1), &many),
    )
    .await;
    assert!(
        v["reason"]
            .as_str()
            .unwrap()
            .contains("1025 policies in `settled`; at most 1024"),
        "{status}: {v}"
    );
    // Nothing of a refused batch was decided: its lease id is new.
    let (_, v) = post(addr, "/v1/leases", &lease_body("big", "tenant", &key, 1, 1)).await;
    assert_eq!(granted(&v), 1, "not a replay: {v}");

    let (_, text) = get(addr, "/metrics").await;
    let settled = |policy: &str| {
        sample::<u64>(
            &text,
            &format!(r#"tollgate_limiter_units_settled_total{{policy="{policy}"}}"#),
        )
    };
    assert_eq!(settled("tenant"), Some(5 + 10 + 3 + 1), "{text}");
    assert_eq!(settled("hundred"), Some(2), "{text}");
    assert_eq!(settled("local-only"), Some(4), "{text}");
    assert_eq!(settled("(unknown)"), Some(7 + 1), "{text}");
    assert_eq!(settled("route"), None, "never reported: no series");
    for name in ["no-such-policy", "other-unknown", "zero", "p1024"] {
        assert!(!text.contains(name), "{name} is no label value:\n{text}");
    }
    limiter.shutdown().await;
}

/// A batch answered 503 (the store decided nothing) counts none of its settled units: the
/// filter may report them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_units_are_not_counted_without_an_answer() {
    let port = tollgate_e2e::free_port();
    let limiter = start_unready(config(StoreConfig::Redis(format!(
        "redis://127.0.0.1:{port}"
    ))))
    .await;
    let addr = limiter.addr();
    let (status, v) = post(
        addr,
        "/v1/leases",
        &with_settled(&lease_body("a", "tenant", "t", 1, 1), r#"{"tenant":5}"#),
    )
    .await;
    assert_eq!((status, v["error"].as_str()), (503, Some("UNAVAILABLE")));
    let (status, v) = post(
        addr,
        "/v1/leases/return",
        &with_settled(&return_body("a", "tenant", "t", 1), r#"{"tenant":5}"#),
    )
    .await;
    assert_eq!((status, v["error"].as_str()), (503, Some("UNAVAILABLE")));
    // A 200 next to unavailable items is an answer: counted.
    let (status, v) = post(
        addr,
        "/v1/leases",
        r#"{"leases":[
        {"id":"b","policy":"tenant","key":"t","min":1,"want":1},
        {"id":"c","policy":"nope","key":"t","min":1,"want":1}],"settled":{"tenant":2}}"#,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["leases"][0]["error"], "UNAVAILABLE");
    let (_, text) = get(addr, "/metrics").await;
    assert_eq!(
        sample::<u64>(
            &text,
            r#"tollgate_limiter_units_settled_total{policy="tenant"}"#
        ),
        Some(2),
        "{text}"
    );
    limiter.shutdown().await;
}

async fn h2c_post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let request = hyper::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.version(), hyper::Version::HTTP_2);
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// HTTP/2 with prior knowledge (how Envoy multiplexes callouts) and HTTP/1.1 on one port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_and_http1_share_the_port() {
    let limiter = start(StoreConfig::Memory).await;
    let key = unique("h2");
    let (status, body) = h2c_post(
        limiter.addr(),
        "/v1/leases",
        &lease_body("h2-1", "tenant", &key, 2, 2),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(granted(&v), 2);
    let (status, v) = post(
        limiter.addr(),
        "/v1/leases",
        &lease_body("h1-1", "tenant", &key, 8, 8),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(granted(&v), 8);
    limiter.shutdown().await;
}

/// A stall seen from the server: while the limiter reads nothing, an HTTP/2 client (Envoy)
/// keeps sending callouts on its connection and cancels each (RST_STREAM) when its timeout
/// passes; when the limiter reads again it gets the whole backlog at once. Every cancelled
/// stream is then reset before the server could accept it, and h2 drops a connection with
/// more of those than `max_pending_accept_reset_streams` (GOAWAY ENHANCE_YOUR_CALM, default
/// 20) — taking along the callouts still waiting on it. Here 200 cancelled callouts and 10
/// live ones arrive in one write: the live ones are all answered, on the same connection,
/// which then keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_cancelled_streams_keeps_the_connection_and_its_answers() {
    const CANCELLED: u64 = 200;
    const LIVE: u64 = 10;
    let limiter = start(StoreConfig::Memory).await;
    let proxy = StallProxy::start(limiter.addr()).await;
    let stream = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    let connection = tokio::spawn(conn);
    let key = unique("stall");
    let request = |id: String| {
        let body = lease_body(&id, "thousand", &key, 1, 1);
        let mut sender = sender.clone();
        async move {
            let request = hyper::Request::post("http://limiter/v1/leases")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .unwrap();
            let response = sender.send_request(request).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, hyper::Error>((status, String::from_utf8_lossy(&body).into_owned()))
        }
    };
    let (status, body) = request("before".into()).await.unwrap();
    assert_eq!(status, 200, "{body}");

    proxy.stall();
    // Callouts sent in full, then given up on (their timeout): HEADERS, DATA, RST_STREAM.
    let cancelled: Vec<_> = (0..CANCELLED)
        .map(|n| tokio::spawn(request(format!("cancelled-{n}"))))
        .collect();
    proxy.wait_for_client(0, 1 + CANCELLED).await;
    for task in &cancelled {
        task.abort();
    }
    proxy.wait_for_client(CANCELLED, 1 + CANCELLED).await;
    // Callouts still waiting when the limiter resumes.
    let live: Vec<_> = (0..LIVE)
        .map(|n| tokio::spawn(request(format!("live-{n}"))))
        .collect();
    proxy.wait_for_client(CANCELLED, 1 + CANCELLED + LIVE).await;
    let held = proxy.release().await;
    println!("released {held} bytes: {CANCELLED} cancelled and {LIVE} live requests");

    for (n, task) in live.into_iter().enumerate() {
        let answer = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("an answer within 10 s")
            .unwrap();
        let (status, body) = answer.unwrap_or_else(|e| panic!("live-{n} lost: {e:?}"));
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(granted(&v), 1, "{v}");
    }
    let (status, _) = request("after".into())
        .await
        .expect("the connection still serves");
    assert_eq!(status, 200);
    assert!(!connection.is_finished(), "the connection was closed");
    let (_, text) = get(limiter.addr(), "/metrics").await;
    let granted_total = text
        .lines()
        .find(|l| {
            l.starts_with(
                r#"tollgate_limiter_decisions_total{outcome="GRANTED",policy="thousand"}"#,
            )
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    // The cancelled requests were complete when they arrived, so the server may decide some
    // of them before it sees their reset (a retry of such an id is a replay); every live one
    // and the two others are decided.
    println!("decided: {granted_total} grants (2 + {LIVE} live + cancelled ones served)");
    assert!((2 + LIVE..=2 + LIVE + CANCELLED).contains(&granted_total));
    limiter.shutdown().await;
}

/// Malformed bodies get 400 with a reason, oversized bodies 413, unknown paths 404; per-item
/// problems are per-item errors next to real decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_reasons() {
    let limiter = start(StoreConfig::Memory).await;
    let addr = limiter.addr();
    for body in [
        "",
        "{",
        r#"{"leases":[{"id":"a","policy":"tenant","key":"k","min":1,"want":1,"x":true}]}"#,
        r#"{"leases":[{"id":"a","policy":"tenant","key":"k","min":-3,"want":1}]}"#,
        r#"{"leases":[{"id":"a","policy":"tenant","key":"k","min":1,"want":2.5}]}"#,
        r#"{"leases":[{"id":"a","policy":"tenant","key":"k","min":1,"want":1e999}]}"#,
        r#"{"leases":[{"id":"a","policy":"tenant","key":"k","min":1,"want":99999999999999999999999}]}"#,
        r#"{"returns":[]}"#,
    ] {
        let (status, v) = post(addr, "/v1/leases", body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"], "INVALID_REQUEST");
        assert!(v["reason"].is_string(), "{v}");
    }
    let (status, v) = post(addr, "/v1/leases/return", r#"{"returns":[{"id":"a"}]}"#).await;
    assert_eq!(
        (status, v["error"].as_str()),
        (400, Some("INVALID_REQUEST"))
    );

    let items: Vec<String> = (0..300)
        .map(|i| format!(r#"{{"id":"{i}","policy":"tenant","key":"k","min":1,"want":1}}"#))
        .collect();
    let (status, v) = post(
        addr,
        "/v1/leases",
        &format!(r#"{{"leases":[{}]}}"#, items.join(",")),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert!(v["reason"].as_str().unwrap().contains("at most 256"));

    let huge = format!(r#"{{"leases":[],"pad":"{}"}}"#, "x".repeat(300 * 1024));
    let (status, v) = post(addr, "/v1/leases", &huge).await;
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"], "INVALID_REQUEST");

    let (status, _) = post(addr, "/v2/leases", "{}").await;
    assert_eq!(status, 404);
    let (status, _) = get(addr, "/v1/leases").await;
    assert_eq!(status, 405);

    let key = unique("mixed");
    let body = format!(
        r#"{{"leases":[
        {{"id":"ok","policy":"tenant","key":"{key}","min":1,"want":1}},
        {{"id":"p","policy":"no-such-policy","key":"{key}","min":1,"want":1}},
        {{"id":"l","policy":"local-only","key":"{key}","min":1,"want":1}},
        {{"id":"k","policy":"tenant","key":"a b","min":1,"want":1}},
        {{"id":"z","policy":"tenant","key":"{key}","min":0,"want":1}},
        {{"id":"b","policy":"tenant","key":"{key}","min":11,"want":11}},
        {{"id":"{long}","policy":"tenant","key":"{key}","min":1,"want":1}},
        {{"id":"h1","policy":"tenant","key":"{key}","min":1,"want":1,"holder":""}},
        {{"id":"h2","policy":"tenant","key":"{key}","min":1,"want":1,"holder":"{long_holder}"}},
        {{"id":"h3","policy":"tenant","key":"{key}","min":1,"want":1,"holder":"i:1"}},
        {{"id":"h4","policy":"tenant","key":"{key}","min":1,"want":1,"holder":"ünï"}},
        {{"id":"d1","policy":"tenant","key":"{key}","min":1,"want":1,"holder":"i-1","demand_per_s":-0.5}},
        {{"id":"d2","policy":"tenant","key":"{key}","min":1,"want":1,"demand_per_s":1000000001}}]}}"#,
        long = "x".repeat(129),
        long_holder = "h".repeat(65)
    );
    let (status, v) = post(addr, "/v1/leases", &body).await;
    assert_eq!(status, 200, "{v}");
    let l = v["leases"].as_array().unwrap();
    assert_eq!(l[0]["granted"], 1);
    assert_eq!(l[1]["error"], "INVALID_POLICY");
    assert_eq!(l[2]["error"], "INVALID_POLICY");
    for item in &l[3..] {
        assert_eq!(item["error"], "INVALID_REQUEST", "{item}");
        assert!(item["reason"].is_string());
    }
    for item in &l[7..11] {
        assert!(
            item["reason"].as_str().unwrap().contains("holder"),
            "{item}"
        );
    }
    for item in &l[11..] {
        let reason = item["reason"].as_str().unwrap();
        assert!(reason.contains("demand_per_s"), "{item}");
    }
    // Not a number at all: the batch does not parse.
    let (status, v) = post(
        addr,
        "/v1/leases",
        r#"{"leases":[{"id":"a","policy":"tenant","key":"k","min":1,"want":1,"demand_per_s":1e999}]}"#,
    )
    .await;
    assert_eq!(
        (status, v["error"].as_str()),
        (400, Some("INVALID_REQUEST"))
    );
    limiter.shutdown().await;
}

/// A batch repeating a lease id is refused whole, naming the id; nothing in it is decided
/// (an id names one lease record: two items with it could not both be decided once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_id_repeated_in_one_batch_refuses_the_batch() {
    let limiter = start(StoreConfig::Memory).await;
    let addr = limiter.addr();
    let key = unique("twice");
    let body = format!(
        r#"{{"leases":[
        {{"id":"once","policy":"tenant","key":"{key}","min":1,"want":1}},
        {{"id":"twice","policy":"tenant","key":"{key}","min":2,"want":2}},
        {{"id":"twice","policy":"tenant","key":"{key}","min":3,"want":3}}]}}"#
    );
    let (status, v) = post(addr, "/v1/leases", &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"], "INVALID_REQUEST");
    let reason = v["reason"].as_str().unwrap();
    assert!(
        reason.contains("`twice`") && reason.contains("items 1 and 2"),
        "{reason}"
    );
    assert!(v.get("leases").is_none(), "no per-item answers: {v}");
    // Nothing was decided: the whole burst of 10 is there, and neither id has a record.
    let (_, v) = post(
        addr,
        "/v1/leases",
        &lease_body("all", "tenant", &key, 10, 10),
    )
    .await;
    assert_eq!(granted(&v), 10);
    let (_, v) = post(
        addr,
        "/v1/leases",
        &lease_body("once", "tenant", &key, 1, 1),
    )
    .await;
    assert_eq!(granted(&v), 0, "`once` is decided now, not replayed: {v}");
    let (_, text) = get(addr, "/metrics").await;
    assert!(
        text.contains(r#"tollgate_limiter_http_responses_total{endpoint="leases",status="400"} 1"#),
        "{text}"
    );
    limiter.shutdown().await;
}

/// A named holder the bucket cannot serve gets a share of the rate for the period, answered
/// as `share_per_s` and `period_ms`, its `expires_ms` covering the period; a second holder
/// waits, then both renew into equal halves; the assignment metrics count it all.
async fn holders_get_shares(store: StoreConfig) {
    let mut c = config(store);
    c.assignment_period = Duration::from_secs(30);
    let limiter = start_with(c).await;
    let addr = limiter.addr();
    let key = unique("share");
    let rate_per_s = limits("tenant").refill_per_ms() * 1_000.0;
    let (_, v) = post(addr, "/v1/leases", &lease_body("d", "tenant", &key, 10, 10)).await;
    assert_eq!(granted(&v), 10);

    let (_, v) = post(addr, "/v1/leases", &lease_body("p", "tenant", &key, 1, 5)).await;
    let p = &v["leases"][0];
    assert_eq!(
        (p["granted"].as_u64(), p["expires_ms"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(
        p.get("share_per_s").is_none() && p.get("period_ms").is_none(),
        "{p}"
    );

    let body = |id: &str, holder: &str| holder_body(id, "tenant", &key, (1, 5), holder, 50.0);
    let (status, v) = post(addr, "/v1/leases", &body("a1", "i-a")).await;
    assert_eq!(status, 200, "{v}");
    let a = &v["leases"][0];
    assert_eq!(a["granted"], 0, "{a}");
    let share = a["share_per_s"].as_f64().unwrap();
    assert!((share - rate_per_s).abs() <= rate_per_s * 1e-9, "{a}");
    assert_eq!(a["period_ms"], 30_000);
    assert_eq!(a["expires_ms"], 32_000, "lease TTL + period");
    assert_eq!(a["retry_after_ms"], 0);
    assert!(a["remaining"].as_f64().unwrap() < 0.0, "{a}");

    let (_, v) = post(addr, "/v1/leases", &body("b1", "i-b")).await;
    let b = &v["leases"][0];
    assert!(b.get("share_per_s").is_none(), "the rate is held: {b}");
    assert!(b["retry_after_ms"].as_u64().unwrap() <= 30_000, "{b}");
    let (_, v) = post(addr, "/v1/leases", &body("a2", "i-a")).await;
    let a = v["leases"][0]["share_per_s"].as_f64().unwrap();
    let (_, v) = post(addr, "/v1/leases", &body("b2", "i-b")).await;
    let b = v["leases"][0]["share_per_s"].as_f64().unwrap();
    assert!((a - rate_per_s / 2.0).abs() <= rate_per_s * 1e-9, "{a} {b}");
    assert!((a - b).abs() <= rate_per_s * 1e-9, "{a} {b}");
    // A retry of the same id answers the same assignment.
    let (_, first) = post(addr, "/v1/leases", &body("b2", "i-b")).await;
    assert_eq!(first["leases"], v["leases"]);

    let (_, text) = get(addr, "/metrics").await;
    for needle in [
        r#"tollgate_limiter_assignments_total{outcome="ASSIGNED",policy="tenant"} 3"#,
        r#"tollgate_limiter_assignments_total{outcome="WAITING",policy="tenant"} 1"#,
        r#"tollgate_limiter_decisions_total{outcome="ASSIGNED",policy="tenant"} 3"#,
        r#"tollgate_limiter_decisions_total{outcome="OVER_LIMIT",policy="tenant"} 2"#,
        r#"tollgate_limiter_decisions_total{outcome="REPLAYED",policy="tenant"} 1"#,
        r#"tollgate_limiter_tokens_assigned_total{policy="tenant"}"#,
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    assert!(!text.contains("i-a"), "holders never appear in metrics");
    limiter.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_get_shares_memory() {
    holders_get_shares(StoreConfig::Memory).await;
}

#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_get_shares_redis() {
    holders_get_shares(StoreConfig::Redis(shared_redis().url())).await;
}

/// `/healthz`, `/readyz` (store reachable, functions loaded) and `/metrics`.
#[cfg(feature = "e2e")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics() {
    let redis = shared_redis();
    let limiter = start(StoreConfig::Redis(redis.url())).await;
    let addr = limiter.addr();
    assert_eq!(get(addr, "/healthz").await.0, 200);
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ready"], true);
    assert_eq!(v["store"], "redis");

    let key = unique("metrics");
    post(
        addr,
        "/v1/leases",
        &lease_body("m1", "tenant", &key, 10, 10),
    )
    .await;
    post(addr, "/v1/leases", &lease_body("m2", "tenant", &key, 1, 1)).await;
    post(
        addr,
        "/v1/leases",
        &lease_body("m1", "tenant", &key, 10, 10),
    )
    .await;
    post(addr, "/v1/leases", &lease_body("m3", "nope", &key, 1, 1)).await;
    post(
        addr,
        "/v1/leases/return",
        &return_body("m1", "tenant", &key, 4),
    )
    .await;
    let node = format!("127.0.0.1:{}", redis.port());
    // The store-keys gauge is sampled in the background once the store is prepared.
    let deadline = Instant::now() + WAIT_LIMIT;
    let text = loop {
        let (status, text) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        if text.contains(&format!(r#"tollgate_limiter_store_keys{{node="{node}"}}"#)) {
            break text;
        }
        assert!(Instant::now() < deadline, "no store keys sample:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for needle in [
        r#"tollgate_limiter_decisions_total{outcome="GRANTED",policy="tenant"} 1"#.to_owned(),
        r#"tollgate_limiter_decisions_total{outcome="OVER_LIMIT",policy="tenant"} 1"#.to_owned(),
        r#"tollgate_limiter_decisions_total{outcome="REPLAYED",policy="tenant"} 1"#.to_owned(),
        r#"tollgate_limiter_decisions_total{outcome="INVALID_POLICY",policy="(unknown)"} 1"#
            .to_owned(),
        r#"tollgate_limiter_tokens_granted_total{policy="tenant"} 10"#.to_owned(),
        r#"tollgate_limiter_tokens_returned_total{policy="tenant"} 4"#.to_owned(),
        format!(
            r#"tollgate_limiter_store_call_duration_seconds_count{{node="{node}",op="lease"}} 3"#
        ),
        format!(r#"tollgate_limiter_store_keys{{node="{node}"}}"#),
        format!(
            r#"tollgate_limiter_policy_info{{version="{}"}} 1"#,
            policies().version
        ),
    ] {
        assert!(text.contains(&needle), "missing {needle} in\n{text}");
    }
    assert!(!text.contains(&key), "tenant keys never appear in metrics");
    limiter.shutdown().await;
}

/// A changed policy file is picked up; an invalid one is refused and the last good stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_reload_keeps_the_last_good_document() {
    let config = config(StoreConfig::Memory);
    let path = config.policies.clone();
    let limiter = start_with(config).await;
    let addr = limiter.addr();
    let v1 = policies().version.clone();

    let bigger = DOC.replace(
        r#""burst": 10, "scope": "global"},"#,
        r#""burst": 20, "scope": "global"},"#,
    );
    assert_ne!(bigger, DOC);
    std::fs::write(&path, &bigger).unwrap();
    let deadline = Instant::now() + WAIT_LIMIT;
    let key = unique("reload");
    let v2 = loop {
        let (_, v) = post(
            addr,
            "/v1/leases",
            &lease_body(&unique("id"), "hundred", &key, 1, 1),
        )
        .await;
        let version = v["policy_version"].as_str().unwrap().to_owned();
        if version != v1 {
            break version;
        }
        assert!(Instant::now() < deadline, "policy change not picked up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (_, v) = post(
        addr,
        "/v1/leases",
        &lease_body("big", "tenant", &unique("t"), 20, 20),
    )
    .await;
    assert_eq!(granted(&v), 20, "new burst in force");

    std::fs::write(&path, r#"{"policies": [{"name": "Bad Name"}]}"#).unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (status, v) = post(
        addr,
        "/v1/leases",
        &lease_body("after", "tenant", &unique("t"), 20, 20),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        v["policy_version"],
        v2.as_str(),
        "the last good document stays"
    );
    assert_eq!(granted(&v), 20);
    let deadline = Instant::now() + WAIT_LIMIT;
    let text = loop {
        let (_, text) = get(addr, "/metrics").await;
        if text.contains(r#"tollgate_limiter_policy_reloads_total{result="invalid"} 1"#) {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "invalid document never seen:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        text.contains(r#"tollgate_limiter_policy_reloads_total{result="ok"} 1"#),
        "{text}"
    );
    assert!(text.contains(&format!(
        r#"tollgate_limiter_policy_info{{version="{v2}"}} 1"#
    )));
    limiter.shutdown().await;
}

/// No store: every item UNAVAILABLE → 503; next to invalid items → per-item errors; never a
/// grant or a denial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_is_unavailable_never_a_decision() {
    let port = tollgate_e2e::free_port();
    let limiter = start_unready(config(StoreConfig::Redis(format!(
        "redis://127.0.0.1:{port}"
    ))))
    .await;
    let addr = limiter.addr();
    let start = Instant::now();
    let (status, v) = post(addr, "/v1/leases", &lease_body("a", "tenant", "t", 1, 1)).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"], "UNAVAILABLE");
    assert!(start.elapsed() < Duration::from_secs(2));
    let body = r#"{"leases":[
        {"id":"a","policy":"tenant","key":"t","min":1,"want":1},
        {"id":"b","policy":"nope","key":"t","min":1,"want":1}]}"#;
    let (status, v) = post(addr, "/v1/leases", body).await;
    assert_eq!(status, 200);
    assert_eq!(v["leases"][0]["error"], "UNAVAILABLE");
    assert!(v["leases"][0].get("granted").is_none());
    assert_eq!(v["leases"][1]["error"], "INVALID_POLICY");
    let (status, v) = post(
        addr,
        "/v1/leases/return",
        &return_body("a", "tenant", "t", 1),
    )
    .await;
    assert_eq!((status, v["error"].as_str()), (503, Some("UNAVAILABLE")));
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(get(addr, "/healthz").await.0, 200, "alive, just not ready");
    limiter.shutdown().await;
}

/// The binary: flags and env vars, listening, SIGTERM → clean exit; a bad policy file or an
/// assignment period as long as the dedup TTL → refuses to start, saying why.
#[test]
fn the_binary_starts_serves_and_stops_on_sigterm() {
    let bin = env!("CARGO_BIN_EXE_tollgate-limiter");
    let dir = tollgate_e2e::paths::new_log_dir("", "limiter-bin");
    let policies = policy_file(DOC);
    let port = tollgate_e2e::free_port();
    let mut cmd = std::process::Command::new(bin);
    cmd.args([
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--log-format",
        "json",
    ])
    .env("TOLLGATE_POLICIES", &policies)
    .env("TOLLGATE_STORE_TIMEOUT", "30ms")
    .env("TOLLGATE_ASSIGNMENT_PERIOD", "500ms");
    let mut child = tollgate_e2e::process::ChildProcess::spawn("limiter", cmd, &dir).unwrap();
    let ready = tollgate_e2e::process::wait_for("the limiter binary", WAIT_LIMIT, || {
        tollgate_e2e::http_blocking::get(port, "/readyz", Duration::from_millis(500))
            .ok()
            .filter(|r| r.status == 200)
    });
    assert!(ready.is_ok(), "{ready:?}\n{}", child.stderr());
    child.signal(libc::SIGTERM).unwrap();
    let status =
        tollgate_e2e::process::wait_for("exit after SIGTERM", WAIT_LIMIT, || child.exit_status())
            .unwrap();
    assert!(status.success(), "{status:?}\n{}", child.stderr());
    let log = child.stderr();
    assert!(
        log.contains(r#""message":"tollgate limiter listening""#),
        "{log}"
    );
    assert!(log.contains("SIGTERM"), "{log}");

    let bad = policy_file(r#"{"policies": [{"name": "x", "rate": 5}]}"#);
    let out = std::process::Command::new(bin)
        .args(["--listen", "127.0.0.1:0"])
        .env("TOLLGATE_POLICIES", &bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid policy file"), "{err}");
    assert!(err.contains("policies[0]"), "{err}");

    // An assignment must end before its lease id is forgotten.
    let out = std::process::Command::new(bin)
        .args(["--listen", "127.0.0.1:0", "--dedup-ttl", "10s"])
        .env("TOLLGATE_POLICIES", &policies)
        .env("TOLLGATE_ASSIGNMENT_PERIOD", "10s")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--assignment-period"), "{err}");
}
