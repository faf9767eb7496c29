//! The policy document: serde types (`deny_unknown_fields`) and their validation into the
//! compiled [`Policies`] both the filter and the limiter use.
//!
//! One JSON document is the source of truth. It is parsed and validated once, at load; every
//! error names the policy (when known), the field path and the reason, and all errors of a
//! document are reported together.

use crate::bucket::Limits;
use crate::calendar::RatePeriod;
use crate::condition::{self, Condition, ConditionSpec};
use crate::duration::Millis;
use crate::key::{self, digest_hex, is_valid_policy_name};
use crate::route::RouteTemplate;
use crate::usage::FieldPath;
use crate::window::{Window, MAX_LOG_LIMIT};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::fmt;

// ---------------------------------------------------------------------------------------------
// The document as written
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyDocument {
    pub policies: Vec<PolicySpec>,
    /// Where the filter reaches the limiter; required when any policy is `global`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limiter: Option<LimiterSpec>,
    #[serde(default)]
    pub local_table: LocalTableSpec,
    #[serde(default)]
    pub response: ResponseSpec,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    pub name: String,
    #[serde(rename = "match", default)]
    pub matcher: MatchSpec,
    /// Conditions on trusted request facts, all of which must hold for the policy to apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub when: Vec<ConditionSpec>,
    pub key: Vec<KeyPartSpec>,
    #[serde(default)]
    pub on_missing_key: OnMissingKey,
    /// The policy's rate; required unless `limits` gives one per value of an identity fact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<RateSpec>,
    /// Token bucket: most units at once (required). Windowed algorithms admit `rate.units` per
    /// `rate.per` and take no burst.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub burst: u64,
    /// Rates by value: the rate (and burst) chosen by the value of one trusted identity fact,
    /// with a default and per-key overrides, instead of `rate` and `burst`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<LimitsSpec>,
    /// How the limit is counted (default `token_bucket`).
    #[serde(default)]
    pub algorithm: AlgorithmName,
    /// Token bucket only: delay a request over the rate until its turn comes, up to
    /// `max_delay`, instead of refusing it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<ShapeSpec>,
    /// Cost per route template (as written in `match.routes`); unlisted routes cost 1.
    #[serde(default)]
    pub cost: BTreeMap<String, u64>,
    #[serde(default)]
    pub scope: Scope,
    #[serde(default)]
    pub on_unavailable: FailureSpec,
    /// `false`: shadow mode — decide and count, never deny.
    #[serde(default = "default_true")]
    pub enforce: bool,
    /// Reserve an estimate read from the request at admission (instead of `cost`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<ReserveSpec>,
    /// Settle the actual cost, read from the response, when the stream ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settle: Option<SettleSpec>,
    /// Most requests of one key in flight at once on one Envoy instance (all its workers);
    /// `0` refuses every request the policy applies to (a refusing rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u32>,
    /// A slot of `max_in_flight` whose release never came expires after this long (at most a
    /// quarter more): set it to the longest a request of the routes may take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight_timeout: Option<Millis>,
    /// What a request over the limit gets: a 429 (`reject`, the default) or a request header
    /// naming the policy, on its way upstream (`tag`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_over_limit: Option<OnOverLimitSpec>,
    /// Whether this policy's `RateLimit-Policy`/`RateLimit` fields go on allowed responses
    /// (default: the document's `response.ratelimit_headers_on_allow`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratelimit_headers_on_allow: Option<bool>,
}

/// `limits`: a rate per value of one trusted identity fact (`by`), a `default` for other
/// values, and `overrides` per key (the policy's key as tollgate builds it, e.g. a tenant id).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsSpec {
    /// The fact whose value picks the entry: a trusted `header` or a `jwt_claim`.
    pub by: KeyPartSpec,
    /// Value (as the request carries it) → its rate.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub values: BTreeMap<String, LimitSpec>,
    /// The rate of a request whose value is absent or has no entry (without it, such a request
    /// is one without its identity: `on_missing_key` decides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<LimitSpec>,
    /// Key → its own rate, whatever the value.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub overrides: BTreeMap<String, LimitSpec>,
}

/// One entry of `limits`: a rate, and the burst of a token bucket.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSpec {
    pub rate: RateSpec,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub burst: u64,
}

/// `on_over_limit`: `{"action": "reject"}` or `{"action": "tag", "header": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OnOverLimitSpec {
    pub action: OverLimitAction,
    /// `tag` only: the request header set to the names of the policies over their limit
    /// (default [`DEFAULT_TAG_HEADER`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OverLimitAction {
    /// Refuse with 429.
    Reject,
    /// Let the request go on upstream with a header naming the policy (Envoy's route table
    /// may send it to a degraded cluster).
    Tag,
}

/// The request header a `tag` policy sets when none is named.
pub const DEFAULT_TAG_HEADER: &str = "x-tollgate-over-limit";

/// Headers a tag may not be: Envoy's own framing and routing inputs.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "upgrade",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-request-id",
];

/// Where a number of units is read from.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum UnitsSourceSpec {
    /// A header (request headers for `reserve`, response headers for `settle`).
    Header(String),
    /// A response trailer (`settle` only).
    Trailer(String),
    /// A field of a JSON body (for `settle`, also the last event of a `text/event-stream`
    /// response that carries it).
    Body(BodyFieldSpec),
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BodyFieldSpec {
    /// Dot-separated path, e.g. `max_tokens` or `usage.total_tokens`.
    pub field: String,
    /// Most bytes of the body read; a longer body reads as "no value" (default 64 KiB for a
    /// request, 256 KiB for a response; at most 1 MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

/// The cost a request reserves at admission: `plus` (per route, default 0) and the value read
/// `from` the request (or `default` when it is absent or unusable), clamped to `[min, max]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReserveSpec {
    pub from: UnitsSourceSpec,
    #[serde(default)]
    pub plus: BTreeMap<String, u64>,
    pub default: u64,
    #[serde(default = "default_reserve_min")]
    pub min: u64,
    pub max: u64,
}

fn default_reserve_min() -> u64 {
    1
}

/// What a stream without a usable actual cost (reset, upstream error, missing field) settles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMissingUsage {
    /// The reservation stands (conservative).
    #[default]
    Keep,
    /// The reservation goes back whole.
    Refund,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SettleSpec {
    pub from: UnitsSourceSpec,
    #[serde(default)]
    pub on_missing: OnMissingUsage,
    /// Most units an excess may put a key in debt (default: the burst); an excess beyond it is
    /// counted as uncharged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_debt: Option<u64>,
}

fn default_true() -> bool {
    true
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmName {
    #[default]
    TokenBucket,
    FixedWindow,
    SlidingWindow,
    SlidingLog,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ShapeSpec {
    /// Longest a request waits for its turn; later turns are refused with 429.
    pub max_delay: Millis,
    /// Most requests of one key waiting at once on one Envoy worker (default 64); beyond it, 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_waiting: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MatchSpec {
    /// `api.example.com`, `*.example.com`; empty: any host.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Route templates `METHOD /path/{param}` or `/path`; empty: any path.
    #[serde(default)]
    pub routes: Vec<String>,
    /// Methods; empty: any.
    #[serde(default)]
    pub methods: Vec<String>,
}

/// One identity part of a bucket key.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum KeyPartSpec {
    /// A request header set by a trusted component (e.g. an auth filter): `{"header": "x-tenant-id"}`.
    Header(String),
    /// A claim of a JWT verified by Envoy's `jwt_authn` (its `payload_in_metadata`).
    JwtClaim(JwtClaimSpec),
    /// The client IP: Envoy's client address (`trusted_hops: 0`), or the `X-Forwarded-For`
    /// entry Envoy's `xff_num_trusted_hops: N` would pick (`trusted_hops: N`).
    ClientIp(ClientIpSpec),
    /// An API key header, kept only as a SHA-256 digest.
    ApiKey(String),
    /// A constant: one bucket shared by every request the policy matches.
    Constant(String),
    /// The matched route template.
    Route,
    /// The request method.
    Method,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JwtClaimSpec {
    /// jwt_authn's `payload_in_metadata` name.
    #[serde(default = "default_jwt_payload")]
    pub payload: String,
    /// Claim name, or a path into nested claims (`["org", "id"]`).
    pub claim: ClaimPath,
    /// Dynamic metadata namespace jwt_authn writes to.
    #[serde(default = "default_jwt_namespace")]
    pub namespace: String,
}

fn default_jwt_payload() -> String {
    "jwt_payload".into()
}

fn default_jwt_namespace() -> String {
    "envoy.filters.http.jwt_authn".into()
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum ClaimPath {
    Name(String),
    Path(Vec<String>),
}

impl ClaimPath {
    pub fn segments(&self) -> Vec<&str> {
        match self {
            ClaimPath::Name(name) => vec![name.as_str()],
            ClaimPath::Path(path) => path.iter().map(String::as_str).collect(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClientIpSpec {
    /// Trusted proxies in front of Envoy that append to `X-Forwarded-For`, counted as Envoy's
    /// `xff_num_trusted_hops`; 0 uses Envoy's client address (the socket peer with
    /// `use_remote_address: true`).
    #[serde(default)]
    pub trusted_hops: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMissingKey {
    /// The policy does not apply to the request.
    #[default]
    Skip,
    /// The request counts against one shared `anonymous` bucket.
    Anonymous,
    /// The request is refused with 403.
    Deny,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RateSpec {
    pub units: u64,
    /// A duration, or (fixed windows only) a calendar period: `1w`, `1mo`, `1y`.
    pub per: RatePeriod,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Each Envoy instance enforces the policy on its own.
    #[default]
    Local,
    /// One budget across all instances, owned by the limiter. Behind a regional limiter
    /// (`tollgate-limiter --parent`), the budget of the whole fleet: the region leases it from
    /// the parent limiter.
    Global,
    /// One budget across the instances of a region, owned by the region's limiter (its own
    /// Redis); it never leaves the region. Without a parent limiter it is a global budget.
    Regional,
}

impl Scope {
    /// Whether the limiter decides the policy (`global` or `regional`): the filter spends it
    /// from leases, and the policy needs `limiter`.
    pub fn uses_limiter(self) -> bool {
        matches!(self, Scope::Global | Scope::Regional)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureModeName {
    #[default]
    Open,
    Closed,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Terminal {
    Open,
    Closed,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FailureSpec {
    pub mode: FailureModeName,
    /// `local` mode: the share of the policy rate this instance may use on its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<f64>,
    /// `local` mode: how long the local budget may stand in for the limiter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_ttl: Option<Millis>,
    /// `local` mode: what happens after `stale_ttl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub then: Option<Terminal>,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimiterSpec {
    /// Envoy cluster name of the limiter.
    pub cluster: String,
    /// Deadline of one callout.
    #[serde(default = "default_limiter_timeout")]
    pub timeout: Millis,
    /// `:authority` of callouts.
    #[serde(default = "default_limiter_authority")]
    pub authority: String,
    /// A lease asks for about this much of the recent local demand of its key.
    #[serde(default = "default_lease_horizon")]
    pub lease_horizon: Millis,
    /// Most tokens one lease asks for; `1` turns batching off (one callout per request).
    #[serde(default = "default_lease_max")]
    pub lease_max: u64,
    /// Refill in the background once a lease is below this fraction of its grant.
    #[serde(default = "default_low_water")]
    pub low_water: f64,
    /// After a failed callout, requests of that key go straight to the failure mode (no
    /// waiting) for this long, while one probe per instance checks for recovery.
    #[serde(default = "default_unavailable_backoff")]
    pub unavailable_backoff: Millis,
}

fn default_lease_horizon() -> Millis {
    // `just bench`: 1 s halves the Redis calls of 250 ms (14 vs 30 per 1,000 requests over 100
    // Zipf-distributed tenants) for no measurable under-use at the limit, where leases shrink to
    // the request's cost anyway.
    Millis(1_000)
}

fn default_lease_max() -> u64 {
    100
}

fn default_low_water() -> f64 {
    0.25
}

fn default_unavailable_backoff() -> Millis {
    Millis(500)
}

fn default_limiter_timeout() -> Millis {
    Millis(25)
}

fn default_limiter_authority() -> String {
    "tollgate-limiter".into()
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LocalTableSpec {
    /// Slots in the filter's shared-data bucket table (bounds its memory).
    #[serde(default = "default_slots")]
    pub slots: u32,
}

impl Default for LocalTableSpec {
    fn default() -> Self {
        Self {
            slots: default_slots(),
        }
    }
}

fn default_slots() -> u32 {
    4096
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseSpec {
    /// Also send `RateLimit-Policy`/`RateLimit` headers on allowed responses.
    #[serde(default)]
    pub ratelimit_headers_on_allow: bool,
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// One problem in a policy document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// The policy's name, when the problem is inside a named policy.
    pub policy: Option<String>,
    /// Path of the field, e.g. `policies[0].rate.per`.
    pub field: String,
    pub reason: String,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(policy) = &self.policy {
            write!(f, "policy `{policy}`: ")?;
        }
        write!(f, "{}: {}", self.field, self.reason)
    }
}

/// All problems found in a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyErrors(pub Vec<PolicyError>);

impl fmt::Display for PolicyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for PolicyErrors {}

// ---------------------------------------------------------------------------------------------
// The compiled, validated form
// ---------------------------------------------------------------------------------------------

/// What to do when the global stage cannot decide.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FailureMode {
    Open,
    Closed,
    Local {
        share: f64,
        stale_ttl_ms: u64,
        then: Terminal,
    },
}

/// Where units are read from, validated.
#[derive(Debug, Clone, PartialEq)]
pub enum UnitsSource {
    Header(String),
    Trailer(String),
    Body { path: FieldPath, max_bytes: usize },
}

/// A validated `reserve`.
#[derive(Debug, Clone, PartialEq)]
pub struct Reserve {
    pub source: UnitsSource,
    pub default: u64,
    pub min: u64,
    pub max: u64,
}

impl Reserve {
    /// The units to reserve: the route's constant plus the value read (or the default),
    /// clamped to `[min, max]`.
    pub fn units(&self, plus: u64, value: Option<u64>) -> u64 {
        plus.saturating_add(value.unwrap_or(self.default))
            .clamp(self.min, self.max)
    }
}

/// A validated `settle`.
#[derive(Debug, Clone, PartialEq)]
pub struct Settle {
    pub source: UnitsSource,
    pub on_missing: OnMissingUsage,
    pub max_debt: u64,
}

/// How a policy counts its limit, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    TokenBucket,
    FixedWindow(Window),
    SlidingWindow(Window),
    SlidingLog(Window),
}

impl Algorithm {
    /// The window of a windowed algorithm.
    pub fn window(&self) -> Option<&Window> {
        match self {
            Algorithm::TokenBucket => None,
            Algorithm::FixedWindow(w) | Algorithm::SlidingWindow(w) | Algorithm::SlidingLog(w) => {
                Some(w)
            }
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::FixedWindow(_) => "fixed_window",
            Algorithm::SlidingWindow(_) => "sliding_window",
            Algorithm::SlidingLog(_) => "sliding_log",
        }
    }
}

/// A validated `shape`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub max_delay_ms: u64,
    pub max_waiting: u32,
}

/// A validated `max_in_flight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlightLimit {
    pub max: u32,
    pub timeout_ms: u64,
}

/// An identity part, ready to be read from a request.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyPart {
    Header(String),
    JwtClaim {
        path: Vec<String>,
    },
    ClientIp {
        trusted_hops: u32,
    },
    ApiKey(String),
    /// Already escaped.
    Constant(String),
    Route,
    Method,
}

#[derive(Debug, Clone, PartialEq)]
enum HostPattern {
    Any,
    Exact(String),
    /// `*.example.com` stored as `.example.com`.
    Suffix(String),
}

impl HostPattern {
    fn parse(text: &str) -> Result<Self, String> {
        let lower = text.trim().to_ascii_lowercase();
        if lower == "*" {
            return Ok(HostPattern::Any);
        }
        let (pattern, name) = match lower.strip_prefix("*.") {
            Some(rest) => (HostPattern::Suffix(format!(".{rest}")), rest.to_string()),
            None => (HostPattern::Exact(lower.clone()), lower.clone()),
        };
        let valid = !name.is_empty()
            && name.len() <= 253
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
        if valid {
            Ok(pattern)
        } else {
            Err(format!(
                "`{text}` is not a host name or `*.domain` pattern (no ports, schemes or paths)"
            ))
        }
    }

    fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Any => true,
            HostPattern::Exact(name) => host == name,
            HostPattern::Suffix(suffix) => {
                host.len() > suffix.len() && host.ends_with(suffix.as_str())
            }
        }
    }
}

/// Lower-cased host of an `:authority` value, without port.
pub fn authority_host(authority: &str) -> Cow<'_, str> {
    let authority = authority.trim();
    // Searched as bytes (`[`, `]` and `:` are ASCII, so every position found is a char
    // boundary): this runs on every request.
    let bytes = authority.as_bytes();
    let host = if bytes.first() == Some(&b'[') {
        let end = bytes.iter().position(|b| *b == b']').unwrap_or(bytes.len());
        authority.get(1..end).unwrap_or_default()
    } else {
        match bytes.iter().rposition(|b| *b == b':') {
            Some(colon)
                if bytes
                    .get(colon + 1..)
                    .is_some_and(|port| port.iter().all(u8::is_ascii_digit)) =>
            {
                authority.get(..colon).unwrap_or(authority)
            }
            _ => authority,
        }
    };
    // Borrowed as it is when already lower-case (what clients send): no copy per request.
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

/// One validated policy.
#[derive(Debug, Clone)]
pub struct Policy {
    pub name: String,
    hosts: Vec<HostPattern>,
    routes: Vec<RouteTemplate>,
    route_costs: Vec<u64>,
    methods: Vec<String>,
    /// `when`: all must hold (cheapest first), checked after `match`.
    pub when: Vec<Condition>,
    pub key: Vec<KeyPart>,
    pub on_missing_key: OnMissingKey,
    pub units: u64,
    /// `rate.per` in ms; a calendar period's longest window (see [`Policy::window_ms_at`]).
    pub per_ms: u64,
    pub burst: u64,
    pub limits: Limits,
    pub scope: Scope,
    pub failure: FailureMode,
    pub enforce: bool,
    /// `None`: the route's constant cost is the cost.
    pub reserve: Option<Reserve>,
    pub settle: Option<Settle>,
    pub in_flight: Option<InFlightLimit>,
    pub algorithm: Algorithm,
    pub shape: Option<Shape>,
    /// `on_over_limit: tag`: the request header to set instead of refusing (`None`: 429).
    pub tag: Option<String>,
    /// This policy's `RateLimit-Policy`/`RateLimit` fields go on allowed responses.
    pub headers_on_allow: bool,
    /// `limits`: the entries whose rates replace the numbers above (which are those of the
    /// default entry, or else of the first entry, for whatever needs one rate by name).
    pub limits_by: Option<Box<LimitsBy>>,
}

/// A validated `limits`: each entry is the policy with the entry's rate, burst and window.
#[derive(Debug, Clone)]
pub struct LimitsBy {
    /// The fact whose value picks a `values` entry (a header or a claim).
    pub by: KeyPart,
    /// By entry part (`!v<escaped value>`), sorted.
    values: Vec<(String, Policy)>,
    /// By key (as built), sorted.
    overrides: Vec<(String, Policy)>,
    default: Option<Policy>,
}

impl LimitsBy {
    /// Whether `key` (identity parts only) has an override.
    pub fn has_override(&self, key: &str) -> bool {
        self.overrides
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .is_ok()
    }

    /// Whether a `values` entry has the entry part `part` (`!v<escaped value>`).
    pub fn has_value(&self, part: &str) -> bool {
        self.values
            .binary_search_by(|(p, _)| p.as_str().cmp(part))
            .is_ok()
    }

    pub fn has_default(&self) -> bool {
        self.default.is_some()
    }

    /// The entry a key built for this policy names: its last part, and for an override the
    /// identity before it. `None`: no entry of this document.
    pub fn entry(&self, key: &str) -> Option<&Policy> {
        let (identity, part) = key::split_entry(key);
        match part? {
            key::DEFAULT_ENTRY_PART => self.default.as_ref(),
            key::OVERRIDE_ENTRY_PART => self
                .overrides
                .binary_search_by(|(k, _)| k.as_str().cmp(identity))
                .ok()
                .and_then(|i| self.overrides.get(i))
                .map(|(_, p)| p),
            part => self
                .values
                .binary_search_by(|(p, _)| p.as_str().cmp(part))
                .ok()
                .and_then(|i| self.values.get(i))
                .map(|(_, p)| p),
        }
    }

    /// Each entry as written (`values.pro`, `default`, `overrides.acme`) with its policy.
    pub fn entries(&self) -> impl Iterator<Item = (String, &Policy)> {
        let values = self.values.iter().map(|(part, p)| {
            let value = part.strip_prefix(key::VALUE_ENTRY_PREFIX).unwrap_or(part);
            (format!("values.{value}"), p)
        });
        let default = self.default.iter().map(|p| ("default".to_string(), p));
        let overrides = self
            .overrides
            .iter()
            .map(|(k, p)| (format!("overrides.{k}"), p));
        values.chain(default).chain(overrides)
    }
}

/// A request matched by a policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteMatch<'a> {
    /// The matched template, when the policy declares routes.
    pub route: Option<&'a str>,
    /// Its position in `match.routes` (where a `path_param` condition finds its segment).
    pub template: Option<usize>,
    /// The route's constant cost; with `reserve`, the constant part of the estimate.
    pub cost: u64,
}

impl Policy {
    /// The policy as it decides a bucket of `key` (wire form, entry part last): itself without
    /// `limits`, else the entry the key names; `None` when the key names no entry of this
    /// document, or names one while the policy has no `limits` (the limiter refuses both).
    pub fn entry_for(&self, key: &str) -> Option<&Policy> {
        match &self.limits_by {
            None => key::split_entry(key).1.is_none().then_some(self),
            Some(by) => by.entry(key),
        }
    }

    /// [`Policy::entry_for`] on the filter, whose keys this document built: the entry, or the
    /// policy's own numbers should a key name none (a key outliving a reload).
    pub fn rated(&self, key: &str) -> &Policy {
        match &self.limits_by {
            None => self,
            Some(by) => by.entry(key).unwrap_or(self),
        }
    }

    /// [`Policy::rated`] of a local bucket id (`<policy>:<key>`).
    pub fn rated_bucket(&self, bucket_id: &str) -> &Policy {
        match &self.limits_by {
            None => self,
            Some(_) => bucket_id
                .strip_prefix(self.name.as_str())
                .and_then(|rest| rest.strip_prefix(':'))
                .map_or(self, |key| self.rated(key)),
        }
    }

    /// Whether the policy applies to a request, and at what cost. `host` is already lower-case
    /// without port ([`authority_host`]).
    pub fn match_request(&self, host: &str, method: &str, path: &str) -> Option<RouteMatch<'_>> {
        if !self.hosts.is_empty() && !self.hosts.iter().any(|h| h.matches(host)) {
            return None;
        }
        if !self.methods.is_empty() && !self.methods.iter().any(|m| m == method) {
            return None;
        }
        if self.routes.is_empty() {
            return Some(RouteMatch {
                route: None,
                template: None,
                cost: if self.reserve.is_some() { 0 } else { 1 },
            });
        }
        self.routes
            .iter()
            .zip(&self.route_costs)
            .enumerate()
            .find(|(_, (route, _))| route.matches(method, path))
            .map(|(i, (route, cost))| RouteMatch {
                route: Some(route.as_str()),
                template: Some(i),
                cost: *cost,
            })
    }

    /// How long the policy's window at `now_ms` is (`RateLimit-Policy`'s `w`): `rate.per`,
    /// or for a calendar period the window's own length (a month of 28 to 31 days).
    pub fn window_ms_at(&self, now_ms: u64) -> u64 {
        match self.algorithm.window() {
            Some(w) if w.calendar.is_some() => w.length_ms_at(now_ms),
            _ => self.per_ms,
        }
    }

    /// Whether any key part needs the client's identity (as opposed to constants, route, method).
    pub fn needs_identity(&self) -> bool {
        self.key.iter().any(|p| {
            matches!(
                p,
                KeyPart::Header(_)
                    | KeyPart::JwtClaim { .. }
                    | KeyPart::ClientIp { .. }
                    | KeyPart::ApiKey(_)
            )
        })
    }
}

/// A validated document.
#[derive(Debug, Clone)]
pub struct Policies {
    /// First 12 hex digits of SHA-256 over the canonical document.
    pub version: String,
    pub policies: Vec<Policy>,
    pub limiter: Option<LimiterSpec>,
    pub local_table: LocalTableSpec,
    pub response: ResponseSpec,
    /// Some policy matches `hosts`: only then is a request's host worth reading.
    reads_host: bool,
}

impl Policies {
    /// Whether any policy matches on the request's host (`match.hosts`); when none does, the
    /// host is never looked at and need not be read from the request.
    pub fn reads_host(&self) -> bool {
        self.reads_host
    }

    /// Parses and validates a document; all problems are reported at once.
    pub fn from_json(bytes: &[u8]) -> Result<Self, PolicyErrors> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| {
            PolicyErrors(vec![PolicyError {
                policy: None,
                field: "(document)".into(),
                reason: format!("not valid JSON: {e}"),
            }])
        })?;
        let version = digest_hex(value.to_string().as_bytes(), 6);
        let document: PolicyDocument = serde_path_to_error::deserialize(&value).map_err(|e| {
            let field = e.path().to_string();
            PolicyErrors(vec![PolicyError {
                policy: policy_name_at(&value, &field),
                field,
                reason: e.into_inner().to_string(),
            }])
        })?;
        compile(document, version)
    }

    pub fn get(&self, name: &str) -> Option<&Policy> {
        self.policies.iter().find(|p| p.name == name)
    }
}

/// The `name` of the policy a field path (`policies[3].rate`) points into, if any.
fn policy_name_at(value: &Value, field: &str) -> Option<String> {
    let index: usize = field
        .strip_prefix("policies[")?
        .split(']')
        .next()?
        .parse()
        .ok()?;
    value
        .get("policies")?
        .get(index)?
        .get("name")?
        .as_str()
        .map(str::to_string)
}

struct Collector {
    errors: Vec<PolicyError>,
}

impl Collector {
    fn push(&mut self, policy: Option<&str>, field: String, reason: impl Into<String>) {
        self.errors.push(PolicyError {
            policy: policy.map(str::to_string),
            field,
            reason: reason.into(),
        });
    }
}

const MAX_POLICIES: usize = 1024;
const MAX_UNITS: u64 = 1_000_000_000_000;
const MAX_BURST: u64 = 1_000_000_000;

fn compile(document: PolicyDocument, version: String) -> Result<Policies, PolicyErrors> {
    let mut errors = Collector { errors: Vec::new() };
    if document.policies.len() > MAX_POLICIES {
        errors.push(
            None,
            "policies".into(),
            format!("more than {MAX_POLICIES} policies"),
        );
    }
    let mut names = HashSet::new();
    let mut policies = Vec::new();
    for (index, spec) in document.policies.iter().enumerate() {
        if !names.insert(spec.name.as_str()) {
            errors.push(
                Some(&spec.name),
                format!("policies[{index}].name"),
                "duplicate policy name",
            );
        }
        if let Some(mut policy) = compile_policy(index, spec, &mut errors) {
            policy.headers_on_allow = spec
                .ratelimit_headers_on_allow
                .unwrap_or(document.response.ratelimit_headers_on_allow);
            // Each `limits` entry is the policy at another rate: the same answer.
            if let Some(by) = policy.limits_by.as_mut() {
                let on = policy.headers_on_allow;
                by.values
                    .iter_mut()
                    .chain(by.overrides.iter_mut())
                    .map(|(_, p)| p)
                    .chain(by.default.iter_mut())
                    .for_each(|p| p.headers_on_allow = on);
            }
            policies.push(policy);
        }
    }
    if errors.errors.is_empty() {
        // Indices of `policies` are the document's only when every policy compiled.
        check_tag_headers(&policies, &mut errors);
    }
    let has_global = policies.iter().any(|p| p.scope.uses_limiter());
    match &document.limiter {
        Some(limiter) => {
            if limiter.cluster.trim().is_empty() {
                errors.push(
                    None,
                    "limiter.cluster".into(),
                    "must name the Envoy cluster of the limiter",
                );
            }
            if limiter.timeout.0 == 0 || limiter.timeout.0 > 10_000 {
                errors.push(
                    None,
                    "limiter.timeout".into(),
                    "must be between 1ms and 10s (requests wait for the limiter up to this long)",
                );
            }
            if limiter.authority.trim().is_empty() {
                errors.push(None, "limiter.authority".into(), "must not be empty");
            }
            if limiter.lease_horizon.0 == 0 {
                errors.push(
                    None,
                    "limiter.lease_horizon".into(),
                    "must be longer than 0ms",
                );
            }
            if limiter.lease_max == 0 || limiter.lease_max > MAX_BURST {
                errors.push(
                    None,
                    "limiter.lease_max".into(),
                    format!("must be between 1 and {MAX_BURST}"),
                );
            }
            if !(0.0..1.0).contains(&limiter.low_water) {
                errors.push(None, "limiter.low_water".into(), "must be in [0, 1)");
            }
            if limiter.unavailable_backoff.0 == 0 || limiter.unavailable_backoff.0 > 60_000 {
                errors.push(
                    None,
                    "limiter.unavailable_backoff".into(),
                    "must be between 1ms and 60s",
                );
            }
        }
        None if has_global => errors.push(
            None,
            "limiter".into(),
            "required when a policy has scope `global` or `regional` (the Envoy cluster of the limiter)",
        ),
        None => {}
    }
    let slots = document.local_table.slots;
    if !(16..=1 << 20).contains(&slots) {
        errors.push(
            None,
            "local_table.slots".into(),
            "must be between 16 and 1048576",
        );
    }
    if !errors.errors.is_empty() {
        return Err(PolicyErrors(errors.errors));
    }
    Ok(Policies {
        version,
        reads_host: policies.iter().any(|p| !p.hosts.is_empty()),
        policies,
        limiter: document.limiter,
        local_table: document.local_table,
        response: document.response,
    })
}

fn compile_policy(index: usize, spec: &PolicySpec, errors: &mut Collector) -> Option<Policy> {
    let before = errors.errors.len();
    let at = |field: &str| format!("policies[{index}].{field}");
    let name = Some(spec.name.as_str());
    if !is_valid_policy_name(&spec.name) {
        errors.push(
            name,
            at("name"),
            "must be 1-64 characters of a-z, 0-9, `-`, `_`",
        );
    }

    let mut hosts = Vec::new();
    for (i, host) in spec.matcher.hosts.iter().enumerate() {
        match HostPattern::parse(host) {
            Ok(h) => hosts.push(h),
            Err(reason) => errors.push(name, at(&format!("match.hosts[{i}]")), reason),
        }
    }
    let mut routes = Vec::new();
    for (i, route) in spec.matcher.routes.iter().enumerate() {
        match RouteTemplate::parse(route) {
            Ok(r) => routes.push(r),
            Err(reason) => errors.push(name, at(&format!("match.routes[{i}]")), reason),
        }
    }
    let mut methods = Vec::new();
    for (i, method) in spec.matcher.methods.iter().enumerate() {
        if method.is_empty() || method.len() > 16 || !method.bytes().all(|b| b.is_ascii_uppercase())
        {
            errors.push(
                name,
                at(&format!("match.methods[{i}]")),
                format!("`{method}` is not an upper-case HTTP method"),
            );
        } else {
            methods.push(method.clone());
        }
    }

    let when = compile_when(spec, &routes, &at, name, errors);

    if spec.key.is_empty() {
        errors.push(
            name,
            at("key"),
            "needs at least one part (use {\"constant\": \"all\"} for one shared bucket)",
        );
    }
    if spec.key.len() > key::MAX_PARTS {
        errors.push(name, at("key"), format!("at most {} parts", key::MAX_PARTS));
    }
    let mut key = Vec::new();
    for (i, part) in spec.key.iter().enumerate() {
        let field = at(&format!("key[{i}]"));
        match part {
            KeyPartSpec::Header(h) | KeyPartSpec::ApiKey(h) => {
                if !is_header_name(h) {
                    errors.push(
                        name,
                        field,
                        format!("`{h}` is not a lower-case header name"),
                    );
                } else if matches!(part, KeyPartSpec::Header(_)) {
                    key.push(KeyPart::Header(h.clone()));
                } else {
                    key.push(KeyPart::ApiKey(h.clone()));
                }
            }
            KeyPartSpec::JwtClaim(claim) => match jwt_claim_path(claim) {
                Ok(path) => key.push(KeyPart::JwtClaim { path }),
                Err((suffix, reason)) => errors.push(name, format!("{field}{suffix}"), reason),
            },
            KeyPartSpec::ClientIp(ip) => {
                if ip.trusted_hops > crate::identity::MAX_TRUSTED_HOPS {
                    errors.push(
                        name,
                        format!("{field}.client_ip.trusted_hops"),
                        format!("at most {}", crate::identity::MAX_TRUSTED_HOPS),
                    );
                } else {
                    key.push(KeyPart::ClientIp {
                        trusted_hops: ip.trusted_hops,
                    });
                }
            }
            KeyPartSpec::Constant(value) => {
                if value.is_empty() {
                    errors.push(name, field, "constant must not be empty");
                } else {
                    key.push(KeyPart::Constant(key::escape_part(value.as_bytes())));
                }
            }
            KeyPartSpec::Route => {
                if spec.matcher.routes.is_empty() {
                    errors.push(
                        name,
                        field,
                        "`route` needs `match.routes` (unmatched paths never become keys)",
                    );
                } else {
                    key.push(KeyPart::Route);
                }
            }
            KeyPartSpec::Method => key.push(KeyPart::Method),
        }
    }

    // The rate: `rate` and `burst`, or those of the `limits` entry that stands for the policy.
    let written = match (&spec.rate, &spec.limits) {
        (Some(rate), None) => Some((rate, spec.burst, String::new())),
        (None, Some(limits)) => {
            if spec.burst != 0 {
                errors.push(
                    name,
                    at("burst"),
                    "with `limits`, each entry carries its own `burst`",
                );
            }
            let first = limits
                .default
                .as_ref()
                .map(|d| (d, "limits.default.".to_string()))
                .or_else(|| {
                    limits
                        .values
                        .iter()
                        .next()
                        .map(|(v, d)| (d, format!("limits.values.{v}.")))
                })
                .or_else(|| {
                    limits
                        .overrides
                        .iter()
                        .next()
                        .map(|(k, d)| (d, format!("limits.overrides.{k}.")))
                });
            match first {
                Some((entry, prefix)) => Some((&entry.rate, entry.burst, prefix)),
                None => {
                    errors.push(
                        name,
                        at("limits"),
                        "needs at least one entry (`values`, `default` or `overrides`)",
                    );
                    None
                }
            }
        }
        (Some(_), Some(_)) => {
            errors.push(
                name,
                at("rate"),
                "`rate` and `limits` exclude each other: with `limits`, each entry has its rate",
            );
            None
        }
        (None, None) => {
            errors.push(
                name,
                at("rate"),
                "required (or `limits`: a rate per value of an identity fact)",
            );
            None
        }
    };
    let rated = written.and_then(|(rate, burst, prefix)| {
        compile_rate(
            spec,
            rate,
            burst,
            &|f: &str| at(&format!("{prefix}{f}")),
            name,
            errors,
        )
    });
    let burst = rated.map_or(MAX_BURST, |r| r.burst);
    check_settled_algorithm(spec, &at, name, errors);
    let shape = compile_shape(spec, &at, name, errors);

    let (constants, constants_field, default_constant) = match &spec.reserve {
        Some(reserve) => {
            if !spec.cost.is_empty() {
                errors.push(
                    name,
                    at("cost"),
                    "with `reserve`, a route's constant goes in `reserve.plus`",
                );
            }
            (&reserve.plus, "reserve.plus", 0)
        }
        None => (&spec.cost, "cost", 1),
    };
    let most = spec.reserve.as_ref().map_or(burst, |r| r.max);
    let mut route_costs = vec![default_constant; routes.len()];
    for (template, cost) in constants {
        let field = at(&format!("{constants_field}[\"{template}\"]"));
        let canonical = RouteTemplate::parse(template).map(|t| t.as_str().to_string());
        let position = canonical
            .as_ref()
            .ok()
            .and_then(|c| routes.iter().position(|r| r.as_str() == c));
        match position {
            None => errors.push(name, field, "names no route of `match.routes`"),
            Some(_) if *cost < default_constant => errors.push(name, field, "must be at least 1"),
            Some(_) if *cost > most => errors.push(
                name,
                field,
                if spec.reserve.is_some() {
                    format!("{cost} is more than `reserve.max` ({most})")
                } else {
                    format!(
                        "{cost} is more than the burst ({burst}): such a request could never pass"
                    )
                },
            ),
            Some(i) => {
                if let Some(slot) = route_costs.get_mut(i) {
                    *slot = *cost;
                }
            }
        }
    }
    let reserve = spec
        .reserve
        .as_ref()
        .and_then(|r| compile_reserve(r, burst, &at, name, errors));
    let settle = spec
        .settle
        .as_ref()
        .and_then(|s| compile_settle(s, burst, &at, name, errors));
    let in_flight = compile_in_flight(spec, &at, name, errors);

    let failure = match compile_failure(&spec.on_unavailable) {
        Ok(f) => Some(f),
        Err((field, reason)) => {
            errors.push(name, at(&format!("on_unavailable.{field}")), reason);
            None
        }
    };

    let tag = compile_on_over_limit(spec, &at, name, errors);
    if errors.errors.len() > before {
        return None;
    }
    let rated = rated?;
    let mut policy = Policy {
        name: spec.name.clone(),
        hosts,
        routes,
        route_costs,
        methods,
        when,
        key,
        on_missing_key: spec.on_missing_key,
        units: rated.units,
        per_ms: rated.per_ms,
        burst: rated.burst,
        limits: rated.limits,
        scope: spec.scope,
        failure: failure?,
        enforce: spec.enforce,
        reserve,
        settle,
        in_flight,
        algorithm: rated.algorithm,
        shape,
        tag,
        // Resolved against the document's `response` by `compile`.
        headers_on_allow: false,
        limits_by: None,
    };
    if let Some(limits) = &spec.limits {
        policy.limits_by = Some(Box::new(compile_limits(
            spec, limits, &policy, &at, name, errors,
        )?));
    }
    Some(policy)
}

/// A rate as compiled: the numbers a policy (or one `limits` entry) decides with.
#[derive(Debug, Clone, Copy)]
struct Rated {
    units: u64,
    per_ms: u64,
    burst: u64,
    limits: Limits,
    algorithm: Algorithm,
}

/// A rate and burst under the policy's algorithm; `at` names the fields (`rate.units`,
/// `burst`) where they are written.
fn compile_rate(
    spec: &PolicySpec,
    rate: &RateSpec,
    written_burst: u64,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<Rated> {
    let before = errors.errors.len();
    if rate.units == 0 || rate.units > MAX_UNITS {
        errors.push(
            name,
            at("rate.units"),
            format!("must be between 1 and {MAX_UNITS}"),
        );
    }
    let per_ms = rate.per.nominal_ms();
    if per_ms == 0 {
        errors.push(name, at("rate.per"), "must be longer than 0ms");
    }
    if let (Some(calendar), false) = (
        rate.per.calendar(),
        spec.algorithm == AlgorithmName::FixedWindow,
    ) {
        errors.push(
            name,
            at("rate.per"),
            format!(
                "a calendar period (`{calendar}`) counts fixed windows: set `algorithm: \
                 fixed_window`, or state a duration (e.g. `30d`)"
            ),
        );
    }
    let windowed = spec.algorithm != AlgorithmName::TokenBucket;
    if windowed {
        if written_burst != 0 {
            errors.push(
                name,
                at("burst"),
                "a windowed algorithm admits `rate.units` per `rate.per`: leave `burst` out",
            );
        }
    } else if written_burst == 0 || written_burst > MAX_BURST {
        errors.push(
            name,
            at("burst"),
            format!("must be between 1 and {MAX_BURST}"),
        );
    }
    // A window's limit is its burst: what may pass at once.
    let burst = if windowed {
        rate.units.min(MAX_BURST)
    } else {
        written_burst
    };
    let algorithm = compile_algorithm(spec, rate, at, name, errors);
    if errors.errors.len() > before {
        return None;
    }
    Some(Rated {
        units: rate.units,
        per_ms,
        burst,
        limits: Limits::new(rate.units, per_ms, burst)?,
        algorithm: algorithm?,
    })
}

/// Most entries of one policy's `limits` (values and overrides together).
pub const MAX_LIMIT_ENTRIES: usize = 1024;

/// The entries of a `limits`, each the compiled `base` policy with the entry's rate.
fn compile_limits(
    spec: &PolicySpec,
    limits: &LimitsSpec,
    base: &Policy,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<LimitsBy> {
    let before = errors.errors.len();
    let by = match &limits.by {
        KeyPartSpec::Header(h) if is_header_name(h) => Some(KeyPart::Header(h.clone())),
        KeyPartSpec::Header(h) => {
            errors.push(
                name,
                at("limits.by.header"),
                format!("`{h}` is not a lower-case header name"),
            );
            None
        }
        KeyPartSpec::JwtClaim(claim) => match jwt_claim_path(claim) {
            Ok(path) => Some(KeyPart::JwtClaim { path }),
            Err((suffix, reason)) => {
                errors.push(name, format!("{}{suffix}", at("limits.by")), reason);
                None
            }
        },
        _ => {
            errors.push(
                name,
                at("limits.by"),
                "a plan is read from a trusted `header` or a verified `jwt_claim`",
            );
            None
        }
    };
    if limits.values.len() + limits.overrides.len() > MAX_LIMIT_ENTRIES {
        errors.push(
            name,
            at("limits"),
            format!("at most {MAX_LIMIT_ENTRIES} entries in `values` and `overrides` together"),
        );
        return None;
    }
    if base.key.len() >= key::MAX_PARTS {
        errors.push(
            name,
            at("key"),
            format!(
                "at most {} parts with `limits` (the entry is a part of the bucket's key)",
                key::MAX_PARTS - 1
            ),
        );
    }
    if spec.on_missing_key == OnMissingKey::Anonymous && limits.default.is_none() {
        errors.push(
            name,
            at("limits.default"),
            "required with `on_missing_key: anonymous` (the shared bucket needs a rate)",
        );
    }
    let entry = |written: &LimitSpec, field: String, errors: &mut Collector| {
        compile_entry(
            spec,
            written,
            base,
            &|f: &str| format!("{field}.{f}"),
            name,
            errors,
        )
    };
    let mut values = Vec::new();
    for (value, written) in &limits.values {
        let field = at(&format!("limits.values.{value}"));
        let escaped = key::escape_part(value.as_bytes());
        if value.is_empty()
            || escaped.starts_with('#')
            || escaped.len() > key::MAX_ENTRY_VALUE_BYTES
        {
            errors.push(
                name,
                field,
                format!(
                    "a value must be 1 to {} bytes once escaped (as a key part)",
                    key::MAX_ENTRY_VALUE_BYTES
                ),
            );
            continue;
        }
        if let Some(policy) = entry(written, field, errors) {
            values.push((format!("{}{escaped}", key::VALUE_ENTRY_PREFIX), policy));
        }
    }
    let mut overrides = Vec::new();
    for (tenant, written) in &limits.overrides {
        let field = at(&format!("limits.overrides.{tenant}"));
        let parts = tenant.split(':').count();
        if key::validate_key(tenant).is_err()
            || key::split_entry(tenant).1.is_some()
            || parts != base.key.len()
        {
            errors.push(
                name,
                field,
                format!(
                    "names a key as tollgate builds it: {} escaped part(s) joined by `:` \
                     (e.g. a tenant id)",
                    base.key.len()
                ),
            );
            continue;
        }
        if let Some(policy) = entry(written, field, errors) {
            overrides.push((tenant.clone(), policy));
        }
    }
    let default = limits
        .default
        .as_ref()
        .and_then(|d| entry(d, at("limits.default"), errors));
    if errors.errors.len() > before {
        return None;
    }
    values.sort_by(|a, b| a.0.cmp(&b.0));
    overrides.sort_by(|a, b| a.0.cmp(&b.0));
    Some(LimitsBy {
        by: by?,
        values,
        overrides,
        default,
    })
}

/// One `limits` entry: the base policy with the entry's rate, checked against what the base
/// policy's costs, reservation and settlement need of a burst.
fn compile_entry(
    spec: &PolicySpec,
    written: &LimitSpec,
    base: &Policy,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<Policy> {
    let rated = compile_rate(spec, &written.rate, written.burst, at, name, errors)?;
    let most = base.reserve.as_ref().map_or_else(
        || base.route_costs.iter().copied().max().unwrap_or(1),
        |r| r.max,
    );
    if most > rated.burst {
        errors.push(
            name,
            at("burst"),
            format!(
                "{} is less than the policy's largest cost or `reserve.max` ({most}): such a \
                 request could never pass",
                rated.burst
            ),
        );
        return None;
    }
    let settle = match (&base.settle, &spec.settle) {
        (Some(settle), Some(written)) => Some(Settle {
            max_debt: written.max_debt.unwrap_or(rated.burst),
            ..settle.clone()
        }),
        (settle, _) => settle.clone(),
    };
    Some(Policy {
        units: rated.units,
        per_ms: rated.per_ms,
        burst: rated.burst,
        limits: rated.limits,
        algorithm: rated.algorithm,
        settle,
        limits_by: None,
        ..base.clone()
    })
}

fn compile_when(
    spec: &PolicySpec,
    routes: &[RouteTemplate],
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Vec<Condition> {
    if spec.when.len() > condition::MAX_CONDITIONS {
        errors.push(
            name,
            at("when"),
            format!("at most {} conditions", condition::MAX_CONDITIONS),
        );
        return Vec::new();
    }
    let mut when = Vec::new();
    for (i, written) in spec.when.iter().enumerate() {
        match condition::compile(i, written, routes, jwt_claim_path) {
            Ok(compiled) => when.push(compiled),
            Err(problems) => {
                for (suffix, reason) in problems {
                    errors.push(name, at(&format!("when[{i}]{suffix}")), reason);
                }
            }
        }
    }
    // All must hold: the cheapest are tested first (borrowed request-line facts, then a
    // header, then what the host hands over as a copy), in document order within a rank (at
    // most 16: an insertion keeps it simple, and small in the .wasm).
    let mut ordered: Vec<Condition> = Vec::with_capacity(when.len());
    for c in when {
        let rank = condition::cost_rank(&c.fact);
        let at = ordered
            .iter()
            .position(|o| condition::cost_rank(&o.fact) > rank)
            .unwrap_or(ordered.len());
        ordered.insert(at, c);
    }
    ordered
}

/// A tag header must not be one a policy reads: the filter removes a client's copy of it from
/// every request its policy matches, and sets it on requests over the limit.
fn check_tag_headers(policies: &[Policy], errors: &mut Collector) {
    for (index, policy) in policies.iter().enumerate() {
        let Some(tag) = &policy.tag else {
            continue;
        };
        let read_by = policies.iter().find(|other| {
            let reserve_header = other
                .reserve
                .as_ref()
                .is_some_and(|r| matches!(&r.source, UnitsSource::Header(h) if h == tag));
            let plan_header = other
                .limits_by
                .as_ref()
                .is_some_and(|by| matches!(&by.by, KeyPart::Header(h) if h == tag));
            reserve_header
                || plan_header
                || other
                    .key
                    .iter()
                    .any(|part| matches!(part, KeyPart::Header(h) | KeyPart::ApiKey(h) if h == tag))
        });
        if let Some(other) = read_by {
            errors.push(
                Some(&policy.name),
                format!("policies[{index}].on_over_limit.header"),
                format!(
                    "`{tag}` is read by policy `{}`: a tag header is set by the filter, \
                     never an identity or a cost",
                    other.name
                ),
            );
        }
    }
}

fn compile_on_over_limit(
    spec: &PolicySpec,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<String> {
    let on_over_limit = spec.on_over_limit.as_ref()?;
    match on_over_limit.action {
        OverLimitAction::Reject => {
            if on_over_limit.header.is_some() {
                errors.push(
                    name,
                    at("on_over_limit.header"),
                    "belongs to action `tag` (a rejected request is answered 429)",
                );
            }
            None
        }
        OverLimitAction::Tag => {
            let header = on_over_limit
                .header
                .clone()
                .unwrap_or_else(|| DEFAULT_TAG_HEADER.to_string());
            if !is_header_name(&header) || RESERVED_HEADERS.contains(&header.as_str()) {
                errors.push(
                    name,
                    at("on_over_limit.header"),
                    format!(
                        "`{header}` is not a lower-case header name a tag may set \
                         ([a-z0-9._-], not {})",
                        RESERVED_HEADERS.join(", ")
                    ),
                );
                return None;
            }
            if !spec.enforce {
                errors.push(
                    name,
                    at("on_over_limit.action"),
                    "a shadow policy (`enforce: false`) never acts on a request: `tag` needs an \
                     enforced policy (a tag policy refuses nothing; route tagged requests as \
                     before to observe it)",
                );
                return None;
            }
            let from_body = matches!(
                spec.reserve.as_ref().map(|r| &r.from),
                Some(UnitsSourceSpec::Body(_))
            );
            if from_body {
                errors.push(
                    name,
                    at("on_over_limit.action"),
                    "a cost read from the request body is known after Envoy chose the route: \
                     `tag` needs a cost known at the request headers",
                );
                return None;
            }
            Some(header)
        }
    }
}

const MAX_SHAPE_DELAY_MS: u64 = 30_000;
const DEFAULT_MAX_WAITING: u32 = 64;
const MAX_WAITING: u32 = 10_000;

fn compile_algorithm(
    spec: &PolicySpec,
    rate: &RateSpec,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<Algorithm> {
    let window = match rate.per {
        RatePeriod::Duration(ms) => Window::new(rate.units, ms.0),
        RatePeriod::Calendar(c) => Window::calendar(rate.units, c),
    };
    let algorithm = match spec.algorithm {
        AlgorithmName::TokenBucket => return Some(Algorithm::TokenBucket),
        AlgorithmName::FixedWindow => Algorithm::FixedWindow(window?),
        AlgorithmName::SlidingWindow => Algorithm::SlidingWindow(window?),
        AlgorithmName::SlidingLog => {
            if rate.units > MAX_LOG_LIMIT {
                errors.push(
                    name,
                    at("rate.units"),
                    format!(
                        "a sliding log keeps one entry per unit: at most {MAX_LOG_LIMIT} per window \
                         (use sliding_window for more)"
                    ),
                );
                return None;
            }
            Algorithm::SlidingLog(window?)
        }
    };
    Some(algorithm)
}

/// `reserve` and `settle` need the token bucket (whatever the rate, or rates, of the policy).
fn check_settled_algorithm(
    spec: &PolicySpec,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) {
    let algorithm = match spec.algorithm {
        AlgorithmName::TokenBucket => return,
        AlgorithmName::FixedWindow => "fixed_window",
        AlgorithmName::SlidingWindow => "sliding_window",
        AlgorithmName::SlidingLog => "sliding_log",
    };
    for (field, set) in [
        ("reserve", spec.reserve.is_some()),
        ("settle", spec.settle.is_some()),
    ] {
        if set {
            errors.push(
                name,
                at(field),
                format!("costs settled after the response need the token bucket, not {algorithm}"),
            );
        }
    }
}

fn compile_shape(
    spec: &PolicySpec,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<Shape> {
    let shape = spec.shape.as_ref()?;
    if spec.algorithm != AlgorithmName::TokenBucket {
        errors.push(
            name,
            at("shape"),
            "only the token bucket shapes (delays requests to its rate)",
        );
        return None;
    }
    if spec.settle.is_some() || spec.reserve.is_some() {
        errors.push(
            name,
            at("shape"),
            "a shaped policy spaces requests by their cost at admission: not with reserve or settle",
        );
        return None;
    }
    if shape.max_delay.0 == 0 || shape.max_delay.0 > MAX_SHAPE_DELAY_MS {
        errors.push(
            name,
            at("shape.max_delay"),
            "must be between 1ms and 30s (requests wait paused in Envoy)",
        );
        return None;
    }
    let max_waiting = shape.max_waiting.unwrap_or(DEFAULT_MAX_WAITING);
    if max_waiting == 0 || max_waiting > MAX_WAITING {
        errors.push(
            name,
            at("shape.max_waiting"),
            format!("must be between 1 and {MAX_WAITING}"),
        );
        return None;
    }
    Some(Shape {
        max_delay_ms: shape.max_delay.0,
        max_waiting,
    })
}

/// Longest body `reserve` or `settle` may read.
pub const MAX_BODY_READ: u64 = 1024 * 1024;
const DEFAULT_REQUEST_BODY_READ: u64 = 64 * 1024;
const DEFAULT_RESPONSE_BODY_READ: u64 = 256 * 1024;
const MAX_IN_FLIGHT: u32 = 1_000_000;
const DEFAULT_IN_FLIGHT_TIMEOUT: Millis = Millis(60_000);
const MAX_IN_FLIGHT_TIMEOUT_MS: u64 = 24 * 3_600_000;

fn compile_source(
    spec: &UnitsSourceSpec,
    field: String,
    default_bytes: u64,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<UnitsSource> {
    match spec {
        UnitsSourceSpec::Header(h) | UnitsSourceSpec::Trailer(h) => {
            if !is_header_name(h) || h.starts_with(':') {
                errors.push(
                    name,
                    field,
                    format!("`{h}` is not a lower-case header name"),
                );
                return None;
            }
            Some(match spec {
                UnitsSourceSpec::Trailer(_) => UnitsSource::Trailer(h.clone()),
                _ => UnitsSource::Header(h.clone()),
            })
        }
        UnitsSourceSpec::Body(body) => {
            let path = match FieldPath::parse(&body.field) {
                Ok(path) => path,
                Err(reason) => {
                    errors.push(name, format!("{field}.body.field"), reason);
                    return None;
                }
            };
            let max_bytes = body.max_bytes.unwrap_or(default_bytes);
            if max_bytes == 0 || max_bytes > MAX_BODY_READ {
                errors.push(
                    name,
                    format!("{field}.body.max_bytes"),
                    format!("must be between 1 and {MAX_BODY_READ}"),
                );
                return None;
            }
            Some(UnitsSource::Body {
                path,
                max_bytes: usize::try_from(max_bytes).ok()?,
            })
        }
    }
}

fn compile_reserve(
    spec: &ReserveSpec,
    burst: u64,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<Reserve> {
    let before = errors.errors.len();
    if matches!(spec.from, UnitsSourceSpec::Trailer(_)) {
        errors.push(
            name,
            at("reserve.from"),
            "a trailer arrives after admission: reserve from a `header` or the request `body`",
        );
    }
    let source = compile_source(
        &spec.from,
        at("reserve.from"),
        DEFAULT_REQUEST_BODY_READ,
        name,
        errors,
    );
    if spec.min == 0 {
        errors.push(name, at("reserve.min"), "must be at least 1");
    }
    if spec.max < spec.min {
        errors.push(
            name,
            at("reserve.max"),
            format!("{} is less than `reserve.min` ({})", spec.max, spec.min),
        );
    }
    if spec.max > burst {
        errors.push(
            name,
            at("reserve.max"),
            format!(
                "{} is more than the burst ({burst}): such a reservation could never pass",
                spec.max
            ),
        );
    }
    if spec.default < spec.min || spec.default > spec.max {
        errors.push(
            name,
            at("reserve.default"),
            format!("{} is not within [min, max]", spec.default),
        );
    }
    if errors.errors.len() > before {
        return None;
    }
    Some(Reserve {
        source: source?,
        default: spec.default,
        min: spec.min,
        max: spec.max,
    })
}

fn compile_settle(
    spec: &SettleSpec,
    burst: u64,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<Settle> {
    let source = compile_source(
        &spec.from,
        at("settle.from"),
        DEFAULT_RESPONSE_BODY_READ,
        name,
        errors,
    )?;
    let max_debt = spec.max_debt.unwrap_or(burst);
    if max_debt > MAX_BURST {
        errors.push(
            name,
            at("settle.max_debt"),
            format!("must be at most {MAX_BURST}"),
        );
        return None;
    }
    Some(Settle {
        source,
        on_missing: spec.on_missing,
        max_debt,
    })
}

fn compile_in_flight(
    spec: &PolicySpec,
    at: &dyn Fn(&str) -> String,
    name: Option<&str>,
    errors: &mut Collector,
) -> Option<InFlightLimit> {
    let Some(max) = spec.max_in_flight else {
        if spec.in_flight_timeout.is_some() {
            errors.push(name, at("in_flight_timeout"), "belongs to `max_in_flight`");
        }
        return None;
    };
    // 0: no request may be in flight, so every request the policy applies to is refused.
    if max > MAX_IN_FLIGHT {
        errors.push(
            name,
            at("max_in_flight"),
            format!("must be between 0 (refuse every request) and {MAX_IN_FLIGHT}"),
        );
        return None;
    }
    let timeout = spec.in_flight_timeout.unwrap_or(DEFAULT_IN_FLIGHT_TIMEOUT);
    if timeout.0 < 1_000 || timeout.0 > MAX_IN_FLIGHT_TIMEOUT_MS {
        errors.push(name, at("in_flight_timeout"), "must be between 1s and 24h");
        return None;
    }
    Some(InFlightLimit {
        max,
        timeout_ms: timeout.0,
    })
}

fn compile_failure(spec: &FailureSpec) -> Result<FailureMode, (&'static str, String)> {
    match spec.mode {
        FailureModeName::Open | FailureModeName::Closed => {
            if spec.share.is_some() || spec.stale_ttl.is_some() || spec.then.is_some() {
                return Err((
                    "mode",
                    "`share`, `stale_ttl` and `then` belong to mode `local`".into(),
                ));
            }
            Ok(if spec.mode == FailureModeName::Open {
                FailureMode::Open
            } else {
                FailureMode::Closed
            })
        }
        FailureModeName::Local => {
            let share = spec.share.ok_or((
                "share",
                "mode `local` needs `share` (0 < share ≤ 1)".to_string(),
            ))?;
            if !(share > 0.0 && share <= 1.0) {
                return Err(("share", format!("{share} is not in (0, 1]")));
            }
            let ttl = spec.stale_ttl.ok_or((
                "stale_ttl",
                "mode `local` needs `stale_ttl`, e.g. \"30s\"".to_string(),
            ))?;
            if ttl.0 == 0 {
                return Err(("stale_ttl", "must be longer than 0ms".into()));
            }
            let then = spec.then.ok_or((
                "then",
                "mode `local` needs `then`: `open` or `closed`".to_string(),
            ))?;
            Ok(FailureMode::Local {
                share,
                stale_ttl_ms: ttl.0,
                then,
            })
        }
    }
}

/// The dynamic-metadata property path of a jwt_authn claim, or the problem (a field under the
/// `jwt_claim`'s parent and the reason).
fn jwt_claim_path(claim: &JwtClaimSpec) -> Result<Vec<String>, (String, String)> {
    let segments = claim.claim.segments();
    if segments.is_empty() || segments.iter().any(|s| s.is_empty()) {
        return Err((".jwt_claim.claim".into(), "must name a claim".into()));
    }
    if claim.payload.is_empty() || claim.namespace.is_empty() {
        return Err((
            ".jwt_claim".into(),
            "payload and namespace must not be empty".into(),
        ));
    }
    let mut path = vec![
        "metadata".to_string(),
        "filter_metadata".to_string(),
        claim.namespace.clone(),
        claim.payload.clone(),
    ];
    path.extend(segments.iter().map(|s| s.to_string()));
    Ok(path)
}

/// A header name a policy document accepts: 1 to 128 bytes of lower-case `[a-z0-9._-]`.
pub fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
        })
}

#[cfg(test)]
mod tests;
