//! The RateLimitService: Envoy's own rate-limit protocol (gRPC
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`), serving envoyproxy/
//! ratelimit's descriptor configuration, so Envoy's `envoy.filters.http.ratelimit` filter (and
//! anything configured for envoyproxy/ratelimit) calls the limiter instead.
//!
//! Each descriptor of a request resolves to one rule ([`config`]: ratelimit's matching rules)
//! and is counted with `hits_addend` as its cost (a descriptor's own, else the request's; 0
//! counts 1, as ratelimit) in a fixed window of the rule's unit aligned to the epoch, by the
//! store's atomic count call on the store's clock ([`Store::count`]; the Redis Function
//! `tollgate_v4_count`, which writes no lease record): a descriptor is OK when its cost
//! fits the window, OVER_LIMIT otherwise (and then nothing is taken: unlike ratelimit, a
//! refused hit does not count). Descriptors whose buckets share a hash tag (domain and first
//! entry, `store::rls_key`) are decided in one call, all or nothing; the others are charged
//! independently, as ratelimit charges every descriptor. `shadow_mode` rules are counted and
//! always answered OK (each in a call of its own, so it never holds back another).
//!
//! A store that cannot answer makes the whole call `UNAVAILABLE` (Envoy's `failure_mode_deny`
//! decides), counted as `unavailable`, never as over limit. Hostile input is bounded before
//! anything is looked up ([`Bounds`]): each violation is `INVALID_ARGUMENT` naming the field.
//! An unknown domain answers OK for every descriptor, as ratelimit does, and is counted as
//! `unknown_domain`.

pub mod config;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    rate_limit::Unit as PbUnit, Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use futures_util::future::join_all;
use prometheus::{IntCounterVec, Opts, Registry};
use tollgate_core::key::hash_tag;

use crate::import::input::Unit;
use crate::metrics::Metrics;
use crate::policies::Current;
use crate::service::LogThrottle;
use crate::store::{rls_key, CountItem, CountOutcome, Store, StoreError};
use config::{Rate, Resolved, RlsConfig};

/// Limits on one request; each violation is `INVALID_ARGUMENT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Most descriptors per request.
    pub descriptors: usize,
    /// Most entries per descriptor.
    pub entries: usize,
    /// Longest domain, entry key or entry value, in bytes.
    pub text_bytes: usize,
    /// Largest request message tonic decodes (`RESOURCE_EXHAUSTED` beyond).
    pub message_bytes: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            descriptors: 64,
            entries: 32,
            text_bytes: 4_096,
            message_bytes: 256 * 1_024,
        }
    }
}

/// Response headers (`--rls-response-headers`): the names of ratelimit's three
/// (`LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`), and the IETF
/// `RateLimit-Policy` and `RateLimit` fields besides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNames {
    pub limit: String,
    pub remaining: String,
    pub reset: String,
}

impl Default for HeaderNames {
    fn default() -> Self {
        Self {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// How the service answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RlsSettings {
    pub store_timeout: Duration,
    pub bounds: Bounds,
    /// `Some`: add the rate-limit headers to every answer with a limited descriptor.
    pub headers: Option<HeaderNames>,
}

/// Outcome label values of `tollgate_limiter_rls_descriptors_total`.
pub mod outcome {
    pub const OK: &str = "ok";
    pub const OVER_LIMIT: &str = "over_limit";
    /// A `shadow_mode` rule over its limit (answered OK).
    pub const SHADOW_OVER_LIMIT: &str = "shadow_over_limit";
    /// `unlimited`, or replaced by another rule of the request.
    pub const NOT_COUNTED: &str = "not_counted";
    pub const NO_RULE: &str = "no_rule";
    pub const UNKNOWN_DOMAIN: &str = "unknown_domain";
    /// The store did not answer: the call was `UNAVAILABLE`.
    pub const UNAVAILABLE: &str = "unavailable";
}

/// The service's metrics, in the limiter's registry. The domain label is a configured domain
/// or `(unknown)`: the series are bounded by the configuration, not by traffic.
#[derive(Debug, Clone)]
pub struct RlsMetrics {
    descriptors: IntCounterVec,
    calls: IntCounterVec,
    reloads: IntCounterVec,
}

impl RlsMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let descriptors = IntCounterVec::new(
            Opts::new(
                "tollgate_limiter_rls_descriptors_total",
                "RateLimitService descriptors decided, by domain and outcome (unavailable: the \
                 store did not answer and the call failed UNAVAILABLE).",
            ),
            &["domain", "outcome"],
        )?;
        let calls = IntCounterVec::new(
            Opts::new(
                "tollgate_limiter_rls_calls_total",
                "RateLimitService calls, by gRPC code (OK, UNAVAILABLE, INVALID_ARGUMENT) and \
                 overall answer (ok, over_limit; none for a failed call).",
            ),
            &["grpc_code", "answer"],
        )?;
        let reloads = IntCounterVec::new(
            Opts::new(
                "tollgate_limiter_rls_config_reloads_total",
                "RateLimitService configuration reloads, by result (ok, invalid, unreadable).",
            ),
            &["result"],
        )?;
        registry.register(Box::new(descriptors.clone()))?;
        registry.register(Box::new(calls.clone()))?;
        registry.register(Box::new(reloads.clone()))?;
        Ok(Self {
            descriptors,
            calls,
            reloads,
        })
    }

    fn descriptor(&self, domain: &str, outcome: &str) {
        self.descriptors.with_label_values(&[domain, outcome]).inc();
    }

    fn call(&self, code: &str, answer: &str) {
        self.calls.with_label_values(&[code, answer]).inc();
    }

    pub fn reload(&self, result: &str) {
        self.reloads.with_label_values(&[result]).inc();
    }
}

/// One descriptor counted against a rate.
#[derive(Debug, Clone, PartialEq)]
struct Counted {
    index: usize,
    rate: Rate,
    name: Option<String>,
    shadow: bool,
    key: String,
    cost: u64,
}

/// What a request resolved to, before the store is asked.
#[derive(Debug, Clone, PartialEq)]
enum Plan {
    /// OK, no `current_limit`: no rule, unlimited, replaced or a negative hit; with its
    /// outcome label for a known domain (`no_rule`, `not_counted`).
    Free(&'static str),
    Counted(Counted),
}

/// The RateLimitService over a store.
pub struct RlsService<S> {
    store: Arc<S>,
    config: Arc<Current<RlsConfig>>,
    metrics: RlsMetrics,
    /// The limiter's store metrics (call latency `op="rls"`, errors by kind).
    store_metrics: Metrics,
    store_log: LogThrottle,
    settings: RlsSettings,
}

impl<S> std::fmt::Debug for RlsService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RlsService")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

fn invalid(message: String) -> tonic::Status {
    tonic::Status::invalid_argument(message)
}

/// The request's descriptors as `(key, value)` lists, checked against `bounds`.
fn checked_descriptors<'r>(
    request: &'r RateLimitRequest,
    bounds: &Bounds,
) -> Result<Vec<Vec<(&'r str, &'r str)>>, tonic::Status> {
    if request.domain.is_empty() {
        return Err(invalid("domain: empty".into()));
    }
    if request.domain.len() > bounds.text_bytes {
        return Err(invalid(format!(
            "domain: longer than {} bytes",
            bounds.text_bytes
        )));
    }
    if request.descriptors.is_empty() {
        return Err(invalid("descriptors: none".into()));
    }
    if request.descriptors.len() > bounds.descriptors {
        return Err(invalid(format!(
            "descriptors: {} of them, at most {}",
            request.descriptors.len(),
            bounds.descriptors
        )));
    }
    let mut out = Vec::with_capacity(request.descriptors.len());
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(invalid(format!("descriptors[{i}].entries: none")));
        }
        if d.entries.len() > bounds.entries {
            return Err(invalid(format!(
                "descriptors[{i}].entries: {} of them, at most {}",
                d.entries.len(),
                bounds.entries
            )));
        }
        let mut entries = Vec::with_capacity(d.entries.len());
        for (j, e) in d.entries.iter().enumerate() {
            if e.key.is_empty() {
                return Err(invalid(format!("descriptors[{i}].entries[{j}].key: empty")));
            }
            for (field, text) in [("key", &e.key), ("value", &e.value)] {
                if text.len() > bounds.text_bytes {
                    return Err(invalid(format!(
                        "descriptors[{i}].entries[{j}].{field}: longer than {} bytes",
                        bounds.text_bytes
                    )));
                }
            }
            entries.push((e.key.as_str(), e.value.as_str()));
        }
        out.push(entries);
    }
    Ok(out)
}

/// A descriptor's cost: its own `hits_addend`, else the request's; 0 counts 1.
fn cost(request: &RateLimitRequest, d: &RateLimitDescriptor) -> u64 {
    let hits = d
        .hits_addend
        .as_ref()
        .map_or(u64::from(request.hits_addend), |h| h.value);
    hits.max(1)
}

fn unit_from_pb(unit: i32) -> Option<Unit> {
    Some(match PbUnit::try_from(unit).ok()? {
        PbUnit::Second => Unit::Second,
        PbUnit::Minute => Unit::Minute,
        PbUnit::Hour => Unit::Hour,
        PbUnit::Day => Unit::Day,
        PbUnit::Week => Unit::Week,
        PbUnit::Month => Unit::Month,
        PbUnit::Year => Unit::Year,
        PbUnit::Unknown => return None,
    })
}

fn unit_to_pb(unit: Unit) -> PbUnit {
    match unit {
        Unit::Second => PbUnit::Second,
        Unit::Minute => PbUnit::Minute,
        Unit::Hour => PbUnit::Hour,
        Unit::Day => PbUnit::Day,
        Unit::Week => PbUnit::Week,
        Unit::Month => PbUnit::Month,
        Unit::Year => PbUnit::Year,
    }
}

/// Resolves a checked request against `config` (pure: the unit tests drive it).
fn plan(
    config: &RlsConfig,
    request: &RateLimitRequest,
    descriptors: &[Vec<(&str, &str)>],
) -> Result<Vec<Plan>, tonic::Status> {
    let resolved = config.resolve(&request.domain, descriptors);
    let mut plans = Vec::with_capacity(resolved.len());
    for (index, (r, d)) in resolved.into_iter().zip(&request.descriptors).enumerate() {
        let cost = cost(request, d);
        if d.is_negative_hits {
            // A refill of earlier hits: windows give nothing back, so it is answered OK and
            // changes nothing.
            plans.push(Plan::Free(outcome::NOT_COUNTED));
            continue;
        }
        // A limit the request itself carries (Envoy's `limit` override) wins, as in ratelimit
        // (which looks the domain up first: an unknown domain limits nothing).
        if let Some(limit) = d
            .limit
            .as_ref()
            .filter(|_| config.has_domain(&request.domain))
        {
            let unit = unit_from_pb(limit.unit)
                .ok_or_else(|| invalid(format!("descriptors[{index}].limit.unit: unknown")))?;
            plans.push(Plan::Counted(Counted {
                index,
                rate: Rate {
                    requests_per_unit: limit.requests_per_unit,
                    unit,
                },
                name: None,
                shadow: false,
                key: rls_key(&request.domain, &descriptors[index]),
                cost,
            }));
            continue;
        }
        plans.push(match r {
            Resolved::NoRule => Plan::Free(outcome::NO_RULE),
            Resolved::NotCounted => Plan::Free(outcome::NOT_COUNTED),
            Resolved::Limited { rule, entries } => match rule.rate {
                None => Plan::Free(outcome::NOT_COUNTED),
                Some(rate) => Plan::Counted(Counted {
                    index,
                    rate,
                    name: rule.name.clone(),
                    shadow: rule.shadow_mode,
                    key: rls_key(&request.domain, &entries),
                    cost,
                }),
            },
        });
    }
    Ok(plans)
}

/// Groups of counted descriptors decided in one store call each: those sharing a hash tag
/// together (shadow-mode ones alone, so they never hold another back), in request order.
fn groups(counted: &[&Counted]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(Option<&str>, Vec<usize>)> = Vec::new();
    for (i, c) in counted.iter().enumerate() {
        if c.shadow {
            groups.push((None, vec![i]));
            continue;
        }
        let tag = hash_tag(&c.key);
        match groups.iter_mut().find(|(t, _)| *t == Some(tag)) {
            Some((_, members)) => members.push(i),
            None => groups.push((Some(tag), vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

/// One descriptor's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Decided {
    admitted: bool,
    remaining: u64,
    reset_ms: u64,
}

impl<S: Store> RlsService<S> {
    pub fn new(
        store: Arc<S>,
        config: Arc<Current<RlsConfig>>,
        metrics: RlsMetrics,
        store_metrics: Metrics,
        settings: RlsSettings,
    ) -> Self {
        Self {
            store,
            config,
            metrics,
            store_metrics,
            store_log: LogThrottle::default(),
            settings,
        }
    }

    /// The tonic service, with the decode limit of [`Bounds::message_bytes`].
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        let max = self.settings.bounds.message_bytes;
        RateLimitServiceServer::new(self).max_decoding_message_size(max)
    }

    /// Decides one group in one store call.
    async fn decide(&self, members: &[&Counted]) -> Result<Vec<Decided>, StoreError> {
        // A rate of 0, or a cost above the limit, never fits: no store call for it, and it
        // holds its group back (all or nothing) without taking anything.
        let mut items = Vec::with_capacity(members.len());
        for c in members {
            let limit = u64::from(c.rate.requests_per_unit);
            if limit == 0 || c.cost > limit {
                let now = now_ms();
                return Ok(members
                    .iter()
                    .map(|c| Decided {
                        admitted: false,
                        remaining: 0,
                        reset_ms: reset_ms(c.rate, now),
                    })
                    .collect());
            }
            items.push(CountItem {
                key: c.key.clone(),
                limit,
                window_ms: c.rate.window_ms(),
                cost: c.cost,
            });
        }
        let node = items
            .first()
            .map(|item| self.store.node_for(&item.key))
            .unwrap_or_default();
        let started = std::time::Instant::now();
        let call = self.store.count(&items);
        let result = match tokio::time::timeout(self.settings.store_timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.settings.store_timeout)),
        };
        let CountOutcome {
            now_ms,
            admitted,
            remaining,
        } = match result {
            Ok(outcome) => {
                self.store_metrics
                    .store_call(&node, "rls", started.elapsed());
                outcome
            }
            Err(e) => {
                self.store_metrics.store_error(&node, e.kind());
                return Err(e);
            }
        };
        if remaining.len() != members.len() {
            return Err(StoreError::Protocol(format!(
                "{} answers for {} items",
                remaining.len(),
                members.len()
            )));
        }
        Ok(remaining
            .iter()
            .zip(members)
            .map(|(&remaining, c)| Decided {
                admitted,
                remaining,
                reset_ms: reset_ms(c.rate, now_ms),
            })
            .collect())
    }

    async fn answer(&self, request: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        let descriptors = checked_descriptors(&request, &self.settings.bounds)?;
        let config = self.config.current();
        let known = config.has_domain(&request.domain);
        let domain_label = if known {
            request.domain.as_str()
        } else {
            "(unknown)"
        };
        let plans = plan(&config, &request, &descriptors)?;
        let counted: Vec<&Counted> = plans
            .iter()
            .filter_map(|p| match p {
                Plan::Counted(c) => Some(c),
                Plan::Free(_) => None,
            })
            .collect();
        let groups = groups(&counted);
        let calls = groups.iter().map(|members| {
            let members: Vec<&Counted> = members.iter().map(|&i| counted[i]).collect();
            async move {
                let decided = self.decide(&members).await;
                (members, decided)
            }
        });
        let mut decided: Vec<Option<Decided>> = vec![None; plans.len()];
        let mut failure = None;
        for (members, result) in join_all(calls).await {
            match result {
                Ok(answers) => {
                    for (c, d) in members.iter().zip(answers) {
                        decided[c.index] = Some(d);
                    }
                }
                Err(e) => failure = Some(e),
            }
        }
        if let Some(e) = failure {
            for _ in &plans {
                self.metrics.descriptor(domain_label, outcome::UNAVAILABLE);
            }
            if self.store_log.allow() {
                tracing::warn!(error = %e, kind = e.kind(), domain = domain_label,
                    "RateLimitService: the store did not answer; answering UNAVAILABLE");
            }
            return Err(tonic::Status::unavailable(format!(
                "the rate-limit store did not answer: {}",
                e.kind()
            )));
        }

        let mut statuses = Vec::with_capacity(plans.len());
        let mut over = false;
        // The status the headers describe: the counted one with the least remaining.
        let mut tightest: Option<(&Counted, Decided)> = None;
        for (plan, decided) in plans.iter().zip(&decided) {
            let (Plan::Counted(c), Some(d)) = (plan, decided) else {
                let free = match plan {
                    Plan::Free(free) if known => free,
                    Plan::Free(_) => outcome::UNKNOWN_DOMAIN,
                    // Unreachable in practice: every counted descriptor got its answer.
                    Plan::Counted(_) => outcome::UNAVAILABLE,
                };
                self.metrics.descriptor(domain_label, free);
                statuses.push(DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                });
                continue;
            };
            let code = match (d.admitted, c.shadow) {
                (true, _) => {
                    self.metrics.descriptor(domain_label, outcome::OK);
                    Code::Ok
                }
                (false, true) => {
                    self.metrics
                        .descriptor(domain_label, outcome::SHADOW_OVER_LIMIT);
                    Code::Ok
                }
                (false, false) => {
                    self.metrics.descriptor(domain_label, outcome::OVER_LIMIT);
                    over = true;
                    Code::OverLimit
                }
            };
            let tighter = match tightest {
                None => true,
                Some((_, t)) => d.remaining < t.remaining,
            };
            if tighter {
                tightest = Some((c, *d));
            }
            statuses.push(DescriptorStatus {
                code: code as i32,
                current_limit: Some(RateLimit {
                    name: c.name.clone().unwrap_or_default(),
                    requests_per_unit: c.rate.requests_per_unit,
                    unit: unit_to_pb(c.rate.unit) as i32,
                }),
                limit_remaining: u32::try_from(d.remaining).unwrap_or(u32::MAX),
                duration_until_reset: Some(pb_duration(d.reset_ms)),
                ..Default::default()
            });
        }
        let mut response = RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            ..Default::default()
        };
        if let (Some(names), Some((c, d))) = (&self.settings.headers, tightest) {
            response.response_headers_to_add = headers(names, c, &d);
        }
        Ok(response)
    }
}

/// Milliseconds until the window of `rate` that holds `now_ms` ends.
fn reset_ms(rate: Rate, now_ms: u64) -> u64 {
    let w = rate.window_ms();
    w - now_ms % w
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn pb_duration(ms: u64) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(ms / 1_000).unwrap_or(i64::MAX),
        nanos: i32::try_from((ms % 1_000) * 1_000_000).unwrap_or(0),
    }
}

/// ratelimit's three headers and the IETF `RateLimit-Policy` / `RateLimit` fields, for the
/// tightest counted descriptor (seconds rounded up).
fn headers(names: &HeaderNames, c: &Counted, d: &Decided) -> Vec<HeaderValue> {
    let window_s = c.rate.window_ms() / 1_000;
    let reset_s = d.reset_ms.div_ceil(1_000);
    let name = c
        .name
        .as_deref()
        .unwrap_or("default")
        .replace(['"', '\\'], "");
    let limit = c.rate.requests_per_unit;
    let header = |key: &str, value: String| HeaderValue {
        key: key.to_string(),
        value,
        ..Default::default()
    };
    vec![
        header(&names.limit, limit.to_string()),
        header(&names.remaining, d.remaining.to_string()),
        header(&names.reset, reset_s.to_string()),
        header(
            "RateLimit-Policy",
            format!("\"{name}\";q={limit};w={window_s}"),
        ),
        header(
            "RateLimit",
            format!("\"{name}\";r={};t={reset_s}", d.remaining),
        ),
    ]
}

#[tonic::async_trait]
impl<S: Store> RateLimitService for RlsService<S> {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        match self.answer(request.into_inner()).await {
            Ok(response) => {
                let answer = if response.overall_code == Code::OverLimit as i32 {
                    "over_limit"
                } else {
                    "ok"
                };
                self.metrics.call("OK", answer);
                Ok(tonic::Response::new(response))
            }
            Err(status) => {
                let code = match status.code() {
                    tonic::Code::Unavailable => "UNAVAILABLE",
                    tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
                    _ => "OTHER",
                };
                self.metrics.call(code, "none");
                Err(status)
            }
        }
    }
}

#[cfg(test)]
mod tests;
