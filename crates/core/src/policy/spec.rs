//! The policy document as written: the serde types (`deny_unknown_fields` throughout) and the
//! defaults of their optional fields. Nothing here is validated; see `compile`.

use crate::calendar::RatePeriod;
use crate::condition::ConditionSpec;
use crate::duration::Millis;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
    // A lease asks for `lease_horizon` of its key's demand; this cap only binds on keys busier
    // than 1,000 units/s per worker. At 100 it bound on every key above 100/s, and such keys
    // then called the limiter about once per 100 requests whatever the horizon (`just bench`,
    // 100 Zipf tenants at ~25,000 req/s: 12 lease calls per 1,000 requests at 100, 6 at 1,000).
    // Near the limit the limiter grants less anyway (a bucket at fill f grants at most f × what
    // it holds), so the cap matters for budgets far above the demand, where a few hundred
    // tokens more stranded per key and worker cost nothing.
    1_000
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
