//! Policy conditions (`when`): a policy applies only to requests for which all of its
//! conditions hold, as it applies only to requests its `match` matches.
//!
//! A condition reads one trusted fact of the request (a request header, the method, a verified
//! JWT claim, Envoy's client address, a parameter of the matched route template) and tests it
//! with one operator. Everything that can be decided about a condition is decided here, once,
//! at load: regular expressions are compiled with bounded size (`regex-lite`: a Pike VM, no
//! backtracking, time linear in the value), CIDRs parsed, `in` sets sorted. A test then costs a
//! comparison of borrowed bytes, allocates nothing, and reads at most a bounded prefix of any
//! value, whatever a request carries.

use crate::policy::{ClientIpSpec, JwtClaimSpec};
use crate::route::RouteTemplate;
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// Most conditions of one policy.
pub const MAX_CONDITIONS: usize = 16;
/// Most values of one `in` list, or CIDRs of one `cidr` list.
pub const MAX_SET: usize = 1024;
/// Longest value an operator compares with (`equals`, each of `in`, `prefix`).
pub const MAX_VALUE_BYTES: usize = 1024;
/// Longest `regex` pattern, as written.
pub const MAX_PATTERN_BYTES: usize = 512;
/// Most heap a compiled `regex` may take (regex-lite's approximate size of its program): its
/// matching time grows with it. `user-[0-9]{1,6}` takes ~0.9 KiB, a UUID ~1.9 KiB; counted
/// repetitions of classes grow fast (`[a-z0-9]{1,64}` does not fit: write `[a-z0-9]+`).
/// Measured with regex-lite 0.1.9 natively on a 2-core EPYC VM: `[0-9]{1,12}` 1.2 µs on a
/// matching value, `.*bot.*` 58 µs over a [`MAX_REGEX_INPUT`] value, and among the slowest
/// patterns that fit (many `.*` alive at once, like `(?:.*-){1,20}z`) 0.74 ms over one.
pub const REGEX_SIZE_LIMIT: usize = 4 * 1024;
/// Deepest nesting of groups and repetitions in a `regex`.
const REGEX_NEST_LIMIT: u32 = 32;
/// Longest value a `regex` is run on: a longer one does not match (its cost is bounded by this
/// times the program's size, whatever a request carries).
pub const MAX_REGEX_INPUT: usize = 1024;

/// One condition as written: exactly one fact (`header`, `jwt_claim`, `client_ip`,
/// `path_param`) and exactly one operator.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConditionSpec {
    /// A request header (lower-case name), or `:method`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// A claim of the JWT Envoy's `jwt_authn` verified (as the key part reads it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt_claim: Option<JwtClaimSpec>,
    /// Envoy's client address (as the key part reads it), tested with `cidr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ip: Option<ClientIpSpec>,
    /// A `{name}` parameter of the matched route template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_param: Option<String>,
    /// The value is exactly this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<String>,
    /// The value is one of these.
    #[serde(rename = "in", default, skip_serializing_if = "Option::is_none")]
    pub one_of: Option<Vec<String>>,
    /// The value starts with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// `true`: the request has the value (an empty header counts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub present: Option<bool>,
    /// `true`: the request does not have the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub absent: Option<bool>,
    /// The whole value matches this regular expression (as Envoy's `safe_regex` does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    /// The client address is in one of these networks (`10.0.0.0/8`, `2001:db8::/32`, or an
    /// address alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<Vec<String>>,
}

/// What a condition reads from the request.
#[derive(Debug, Clone, PartialEq)]
pub enum Fact {
    /// A request header's first value (the one a key part reads).
    Header(String),
    /// The request method.
    Method,
    /// A verified JWT claim: the full property path of its dynamic metadata.
    JwtClaim { path: Vec<String> },
    /// Envoy's client address, or the `X-Forwarded-For` entry `trusted_hops` picks.
    ClientIp { trusted_hops: u32 },
    /// A route parameter: for each of the policy's routes (in `match.routes` order), the
    /// position of the parameter's segment in the path, `None` where the route has none.
    PathParam {
        name: String,
        positions: Vec<Option<usize>>,
    },
}

/// A test of a fact's value.
#[derive(Debug, Clone)]
pub enum Test {
    Equals(Box<[u8]>),
    /// Sorted and without duplicates (a binary search).
    In(Vec<Box<[u8]>>),
    Prefix(Box<[u8]>),
    Present,
    Absent,
    /// Anchored at both ends.
    Regex(Box<regex_lite::Regex>),
    Cidr(Vec<Cidr>),
}

impl Test {
    /// Whether a value (`None`: the request does not have it) passes. Bytes are compared as
    /// they are (case-sensitive, no trimming); a regex runs only on UTF-8 of at most
    /// [`MAX_REGEX_INPUT`] bytes.
    pub fn holds(&self, value: Option<&[u8]>) -> bool {
        match (self, value) {
            (Test::Present, value) => value.is_some(),
            (Test::Absent, value) => value.is_none(),
            (_, None) => false,
            (Test::Equals(expected), Some(value)) => **expected == *value,
            (Test::In(set), Some(value)) => set.binary_search_by(|v| (**v).cmp(value)).is_ok(),
            (Test::Prefix(prefix), Some(value)) => value.starts_with(prefix),
            (Test::Regex(regex), Some(value)) => {
                value.len() <= MAX_REGEX_INPUT
                    && std::str::from_utf8(value).is_ok_and(|text| regex.is_match(text))
            }
            // A client address is tested with `holds_ip`; nothing else reads as an address.
            (Test::Cidr(_), Some(_)) => false,
        }
    }

    /// Whether a client address (`None`: Envoy gave none) passes.
    pub fn holds_ip(&self, ip: Option<IpAddr>) -> bool {
        match (self, ip) {
            (Test::Present, ip) => ip.is_some(),
            (Test::Absent, ip) => ip.is_none(),
            (Test::Cidr(networks), Some(ip)) => networks.iter().any(|n| n.contains(ip)),
            _ => false,
        }
    }
}

/// The order conditions are tested in (all must hold, so the cheapest go first): facts of
/// the request line, then a header found in the list the filter already holds, then what the
/// host copies out (a claim, the client address).
pub fn cost_rank(fact: &Fact) -> u8 {
    match fact {
        Fact::Method | Fact::PathParam { .. } => 0,
        Fact::Header(_) => 1,
        Fact::JwtClaim { .. } | Fact::ClientIp { .. } => 2,
    }
}

/// A validated condition.
#[derive(Debug, Clone)]
pub struct Condition {
    /// Its position in the policy's `when` (errors and refusals name it).
    pub index: usize,
    pub fact: Fact,
    pub test: Test,
}

/// An IP network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cidr {
    V4 { network: u32, mask: u32 },
    V6 { network: u128, mask: u128 },
}

impl Cidr {
    /// `10.0.0.0/8`, `2001:db8::/32`, or an address alone (`/32`, `/128`). Host bits must be
    /// zero (`10.0.0.1/8` is refused: it is probably a typo of a longer prefix).
    pub fn parse(text: &str) -> Result<Self, String> {
        let (address, length) = match text.split_once('/') {
            Some((address, length)) => (address, Some(length)),
            None => (text, None),
        };
        let ip: IpAddr = address
            .parse()
            .map_err(|_| format!("`{text}` is not an IPv4 or IPv6 network"))?;
        let bits: u8 = if ip.is_ipv4() { 32 } else { 128 };
        let length = match length {
            None => bits,
            Some(length) => match length.parse::<u8>() {
                Ok(n) if n <= bits && !length.starts_with('+') => n,
                _ => return Err(format!("`{text}`: the prefix length must be 0 to {bits}")),
            },
        };
        let cidr = match ip {
            IpAddr::V4(v4) => {
                let mask = u32::MAX.checked_shl(u32::from(32 - length)).unwrap_or(0);
                let network = u32::from(v4);
                if network & !mask != 0 {
                    return Err(host_bits(
                        text,
                        IpAddr::from((network & mask).to_be_bytes()),
                    ));
                }
                Cidr::V4 { network, mask }
            }
            IpAddr::V6(v6) => {
                let mask = u128::MAX.checked_shl(u32::from(128 - length)).unwrap_or(0);
                let network = u128::from(v6);
                if network & !mask != 0 {
                    return Err(host_bits(
                        text,
                        IpAddr::from((network & mask).to_be_bytes()),
                    ));
                }
                Cidr::V6 { network, mask }
            }
        };
        Ok(cidr)
    }

    /// Whether the network holds the address (an IPv4-mapped IPv6 address is its IPv4 one).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self, ip.to_canonical()) {
            (Cidr::V4 { network, mask }, IpAddr::V4(v4)) => u32::from(v4) & mask == *network,
            (Cidr::V6 { network, mask }, IpAddr::V6(v6)) => u128::from(v6) & mask == *network,
            _ => false,
        }
    }
}

fn host_bits(text: &str, network: IpAddr) -> String {
    let length = text.split_once('/').map_or("", |(_, l)| l);
    format!("`{text}` has bits set past its prefix length (the network is {network}/{length})")
}

/// A problem in one condition: the field under `when[i]` (empty: the condition itself, or
/// e.g. `.regex`, `.cidr[2]`) and the reason.
pub type ConditionError = (String, String);

/// Validates one condition. `routes`: the policy's route templates (a `path_param` must be a
/// parameter of at least one); `claim_path`: builds a claim's metadata path (as the key part
/// does), or names the problem.
pub fn compile(
    index: usize,
    spec: &ConditionSpec,
    routes: &[RouteTemplate],
    claim_path: impl Fn(&JwtClaimSpec) -> Result<Vec<String>, ConditionError>,
) -> Result<Condition, Vec<ConditionError>> {
    let mut errors = Vec::new();
    let fact = compile_fact(spec, routes, claim_path, &mut errors);
    let test = compile_test(spec, &mut errors);
    if let (Some(fact), Some(test)) = (&fact, &test) {
        if let Some(problem) = misfit(fact, test) {
            errors.push(problem);
        }
    }
    match (fact, test) {
        (Some(fact), Some(test)) if errors.is_empty() => Ok(Condition { index, fact, test }),
        _ => Err(errors),
    }
}

const FACTS: &str = "`header`, `jwt_claim`, `client_ip` or `path_param`";
const OPERATORS: &str = "`equals`, `in`, `prefix`, `present`, `absent`, `regex` or `cidr`";

fn compile_fact(
    spec: &ConditionSpec,
    routes: &[RouteTemplate],
    claim_path: impl Fn(&JwtClaimSpec) -> Result<Vec<String>, ConditionError>,
    errors: &mut Vec<ConditionError>,
) -> Option<Fact> {
    let given = [
        spec.header.is_some(),
        spec.jwt_claim.is_some(),
        spec.client_ip.is_some(),
        spec.path_param.is_some(),
    ];
    let count = given.iter().filter(|g| **g).count();
    if count != 1 {
        errors.push((
            String::new(),
            format!("needs exactly one fact to test: {FACTS} (has {count})"),
        ));
        return None;
    }
    if let Some(name) = &spec.header {
        if name == ":method" {
            return Some(Fact::Method);
        }
        if name.starts_with(':') {
            errors.push((
                ".header".into(),
                format!(
                    "`{name}`: of the pseudo-headers only `:method` (hosts and paths are `match.hosts`, `match.routes` and `path_param`)"
                ),
            ));
            return None;
        }
        if !crate::policy::is_header_name(name) {
            errors.push((
                ".header".into(),
                format!("`{name}` is not a lower-case header name"),
            ));
            return None;
        }
        return Some(Fact::Header(name.clone()));
    }
    if let Some(claim) = &spec.jwt_claim {
        return match claim_path(claim) {
            Ok(path) => Some(Fact::JwtClaim { path }),
            Err(error) => {
                errors.push(error);
                None
            }
        };
    }
    if let Some(ip) = &spec.client_ip {
        if ip.trusted_hops > crate::identity::MAX_TRUSTED_HOPS {
            errors.push((
                ".client_ip.trusted_hops".into(),
                format!("at most {}", crate::identity::MAX_TRUSTED_HOPS),
            ));
            return None;
        }
        return Some(Fact::ClientIp {
            trusted_hops: ip.trusted_hops,
        });
    }
    let name = spec.path_param.as_deref().unwrap_or_default();
    let positions: Vec<Option<usize>> = routes.iter().map(|r| r.param_position(name)).collect();
    if positions.iter().all(Option::is_none) {
        let mut defined: Vec<&str> = Vec::new();
        for name in routes.iter().flat_map(RouteTemplate::param_names) {
            if !defined.contains(&name) {
                defined.push(name);
            }
        }
        let reason = if routes.is_empty() {
            format!("`{name}`: a path parameter needs `match.routes` with a `{{{name}}}` segment")
        } else if defined.is_empty() {
            format!("`{name}` is not a parameter of `match.routes` (they have none)")
        } else {
            format!(
                "`{name}` is not a parameter of `match.routes` (they have {})",
                defined.join(", ")
            )
        };
        errors.push((".path_param".into(), reason));
        return None;
    }
    Some(Fact::PathParam {
        name: name.to_string(),
        positions,
    })
}

fn compile_test(spec: &ConditionSpec, errors: &mut Vec<ConditionError>) -> Option<Test> {
    let given = [
        spec.equals.is_some(),
        spec.one_of.is_some(),
        spec.prefix.is_some(),
        spec.present.is_some(),
        spec.absent.is_some(),
        spec.regex.is_some(),
        spec.cidr.is_some(),
    ];
    let count = given.iter().filter(|g| **g).count();
    if count != 1 {
        errors.push((
            String::new(),
            format!("needs exactly one operator: {OPERATORS} (has {count})"),
        ));
        return None;
    }
    let value = |field: &str, text: &str| -> Result<Box<[u8]>, ConditionError> {
        if text.len() > MAX_VALUE_BYTES {
            Err((
                field.to_string(),
                format!("longer than {MAX_VALUE_BYTES} bytes"),
            ))
        } else {
            Ok(text.as_bytes().into())
        }
    };
    let result = if let Some(text) = &spec.equals {
        value(".equals", text).map(Test::Equals)
    } else if let Some(prefix) = &spec.prefix {
        if prefix.is_empty() {
            Err((
                ".prefix".into(),
                "must not be empty (every value starts with it: use `present`)".into(),
            ))
        } else {
            value(".prefix", prefix).map(Test::Prefix)
        }
    } else if let Some(list) = &spec.one_of {
        compile_in(list, value)
    } else if let Some(present) = spec.present {
        if present {
            Ok(Test::Present)
        } else {
            Err((
                ".present".into(),
                "only `true` (write `absent: true`)".into(),
            ))
        }
    } else if let Some(absent) = spec.absent {
        if absent {
            Ok(Test::Absent)
        } else {
            Err((
                ".absent".into(),
                "only `true` (write `present: true`)".into(),
            ))
        }
    } else if let Some(pattern) = &spec.regex {
        compile_regex(pattern).map(|r| Test::Regex(Box::new(r)))
    } else {
        compile_cidrs(spec.cidr.as_deref().unwrap_or_default()).map(Test::Cidr)
    };
    match result {
        Ok(test) => Some(test),
        Err(error) => {
            errors.push(error);
            None
        }
    }
}

fn compile_in(
    list: &[String],
    value: impl Fn(&str, &str) -> Result<Box<[u8]>, ConditionError>,
) -> Result<Test, ConditionError> {
    if list.is_empty() {
        return Err((
            ".in".into(),
            "must list at least one value (an empty set never holds)".into(),
        ));
    }
    if list.len() > MAX_SET {
        return Err((".in".into(), format!("at most {MAX_SET} values")));
    }
    // Sorted by insertion, duplicates dropped (at load; a slice sort would add ~10 KB of
    // .wasm for this one type).
    let mut set: Vec<Box<[u8]>> = Vec::with_capacity(list.len());
    for (i, text) in list.iter().enumerate() {
        let item = value(&format!(".in[{i}]"), text)?;
        if let Err(at) = set.binary_search(&item) {
            set.insert(at, item);
        }
    }
    Ok(Test::In(set))
}

fn compile_regex(pattern: &str) -> Result<regex_lite::Regex, ConditionError> {
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err((
            ".regex".into(),
            format!("longer than {MAX_PATTERN_BYTES} bytes"),
        ));
    }
    let build = |pattern: &str| {
        regex_lite::RegexBuilder::new(pattern)
            .size_limit(REGEX_SIZE_LIMIT)
            .nest_limit(REGEX_NEST_LIMIT)
            .build()
    };
    // The whole value must match, as in Envoy's `safe_regex` matchers. The pattern compiles
    // on its own first, so its groups are balanced and the anchors wrap all of it.
    build(pattern)
        .and_then(|_| build(&format!("^(?:{pattern})$")))
        .map_err(|e| {
            let reason = e.to_string();
            let reason = if reason.contains("size limit") {
                format!(
                    "compiles to more than the {REGEX_SIZE_LIMIT} bytes a condition may use (simplify it, or use `in` or `prefix`)"
                )
            } else {
                format!("not a valid regular expression: {}", reason.trim())
            };
            (".regex".to_string(), reason)
        })
}

fn compile_cidrs(list: &[String]) -> Result<Vec<Cidr>, ConditionError> {
    if list.is_empty() {
        return Err((".cidr".into(), "must list at least one network".into()));
    }
    if list.len() > MAX_SET {
        return Err((".cidr".into(), format!("at most {MAX_SET} networks")));
    }
    list.iter()
        .enumerate()
        .map(|(i, text)| Cidr::parse(text.trim()).map_err(|e| (format!(".cidr[{i}]"), e)))
        .collect()
}

/// An operator that cannot apply to the fact.
fn misfit(fact: &Fact, test: &Test) -> Option<ConditionError> {
    let operator = match test {
        Test::Equals(_) => ".equals",
        Test::In(_) => ".in",
        Test::Prefix(_) => ".prefix",
        Test::Present => ".present",
        Test::Absent => ".absent",
        Test::Regex(_) => ".regex",
        Test::Cidr(_) => ".cidr",
    };
    let reason = match (fact, test) {
        (Fact::ClientIp { .. }, Test::Cidr(_) | Test::Present | Test::Absent) => return None,
        (Fact::ClientIp { .. }, _) => {
            "a client address is tested with `cidr` (a list of networks; an address alone is one)"
        }
        (_, Test::Cidr(_)) => "`cidr` tests `client_ip` only",
        (Fact::Method, Test::Present | Test::Absent) => "every request has a method",
        _ => return None,
    };
    Some((operator.to_string(), reason.to_string()))
}

#[cfg(test)]
mod tests;
