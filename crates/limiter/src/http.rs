//! The HTTP face of the limiter: routes, body limits and status codes, nothing else.
//!
//! Routed by axum; [`crate::server`] serves the router on hyper-util's auto builder, so
//! HTTP/1.1 and HTTP/2 with prior knowledge (h2c, what Envoy uses to multiplex callouts) share
//! one port. Bodies are read up to `MAX_BODY_BYTES` and handed to
//! [`crate::service::Service`] as bytes.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tollgate_core::protocol::{LEASES_PATH, MAX_BODY_BYTES, RETURNS_PATH};

use crate::service::{Reply, Service};
use crate::store::Store;

/// The hot-key report (`observe`): hashed keys only, so it is served on the admin listener
/// too.
pub const HOT_KEYS_PATH: &str = "/v1/hot-keys";

/// The limiter's routes over a service.
pub fn router<S: Store>(service: Arc<Service<S>>) -> Router {
    Router::new()
        .route(LEASES_PATH, post(leases::<S>))
        .route(RETURNS_PATH, post(returns::<S>))
        .route(HOT_KEYS_PATH, get(hot_keys::<S>))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics::<S>))
        .fallback(not_found)
        .with_state(service)
}

/// The admin listener's routes: health, readiness, metrics and the hot-key report, never the
/// lease endpoints.
pub fn admin_router<S: Store>(service: Arc<Service<S>>) -> Router {
    Router::new()
        .route(HOT_KEYS_PATH, get(hot_keys::<S>))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics::<S>))
        .fallback(not_found)
        .with_state(service)
}

fn json(status: u16, body: String) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn reply(r: Reply) -> Response {
    json(r.status, r.body)
}

/// Reads a request body of at most `MAX_BODY_BYTES`.
async fn read_body(body: Body) -> Result<Bytes, Reply> {
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(Reply::refused(
            413,
            format!("body is larger than {MAX_BODY_BYTES} bytes"),
        )),
        Err(e) => Err(Reply::bad_request(format!("cannot read the body: {e}"))),
    }
}

async fn leases<S: Store>(State(service): State<Arc<Service<S>>>, body: Body) -> Response {
    let r = match read_body(body).await {
        Ok(bytes) => service.lease_batch(&bytes).await,
        Err(r) => r,
    };
    service.metrics().response("leases", r.status);
    reply(r)
}

async fn returns<S: Store>(State(service): State<Arc<Service<S>>>, body: Body) -> Response {
    let r = match read_body(body).await {
        Ok(bytes) => service.return_batch(&bytes).await,
        Err(r) => r,
    };
    service.metrics().response("returns", r.status);
    reply(r)
}

async fn healthz() -> Response {
    json(200, r#"{"status":"ok"}"#.to_owned())
}

async fn readyz<S: Store>(State(service): State<Arc<Service<S>>>) -> Response {
    let r = service.readiness().await;
    service.metrics().response("readyz", r.status);
    reply(r)
}

async fn hot_keys<S: Store>(State(service): State<Arc<Service<S>>>) -> Response {
    let r = Reply::json(200, &service.observer().hot_keys_json());
    service.metrics().response("hot_keys", r.status);
    reply(r)
}

async fn metrics<S: Store>(State(service): State<Arc<Service<S>>>) -> Response {
    service.observer().refresh_gauges();
    let mut response = service.metrics().render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

async fn not_found() -> Response {
    json(404, r#"{"error":"NOT_FOUND"}"#.to_owned())
}
