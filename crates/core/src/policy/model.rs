//! The compiled, validated form of a policy document: what the filter and the limiter decide
//! with. Built only by `compile`; how a policy matches a request is in `matching`.

use super::matching::HostPattern;
use super::spec::{
    LimiterSpec, LocalTableSpec, OnMissingKey, OnMissingUsage, ResponseSpec, Scope, Terminal,
};
use crate::bucket::Limits;
use crate::condition::Condition;
use crate::key;
use crate::route::RouteTemplate;
use crate::usage::FieldPath;
use crate::window::Window;

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

/// One validated policy.
#[derive(Debug, Clone)]
pub struct Policy {
    pub name: String,
    pub(super) hosts: Vec<HostPattern>,
    pub(super) routes: Vec<RouteTemplate>,
    pub(super) route_costs: Vec<u64>,
    pub(super) methods: Vec<String>,
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
    pub(super) values: Vec<(String, Policy)>,
    /// By key (as built), sorted.
    pub(super) overrides: Vec<(String, Policy)>,
    pub(super) default: Option<Policy>,
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
    pub(super) reads_host: bool,
}

impl Policies {
    /// Whether any policy matches on the request's host (`match.hosts`); when none does, the
    /// host is never looked at and need not be read from the request.
    pub fn reads_host(&self) -> bool {
        self.reads_host
    }

    pub fn get(&self, name: &str) -> Option<&Policy> {
        self.policies.iter().find(|p| p.name == name)
    }
}
