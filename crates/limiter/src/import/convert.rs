//! The conversion itself, pure: validated ratelimit files in, a tollgate policy document out,
//! with what each policy reads instead of Envoy's descriptor actions, what converted with a
//! difference, and what could not be expressed (each with its reason).
//!
//! Choices (also stated in the printed report and the book's docs/src/ratelimit/import.md):
//! * one policy per descriptor path that ends in a `rate_limit`, named after the domain and
//!   the path;
//! * `algorithm: fixed_window`, `rate.units` = `requests_per_unit` per one unit: ratelimit
//!   counts fixed windows aligned to the clock, as tollgate's fixed window does; no burst;
//! * `scope: global` (ratelimit is one service shared by every Envoy) and `on_unavailable`
//!   `open` (Envoy's ratelimit filter lets requests through when the service fails, unless
//!   `failure_mode_deny`);
//! * `shadow_mode: true` becomes `enforce: false`;
//! * an entry without a value becomes a key part (a header, the client IP, the method); an
//!   entry with a value becomes a match condition (`:method`, `:authority`, `:path`) or a
//!   `when` condition (a header's value or prefix, the client address, or the conditions
//!   `--when` gives for it, e.g. for Envoy's header_value_match), and the limit is listed as
//!   not expressible otherwise.

use std::collections::BTreeMap;

use serde::Serialize;
use tollgate_core::condition::{Cidr, ConditionSpec};
use tollgate_core::key::{self, digest_hex, is_valid_policy_name};
use tollgate_core::policy::{is_header_name, ClientIpSpec};
use tollgate_core::route::RouteTemplate;

use super::input::{ConfigFile, Descriptor, Limit, Unit};

/// Where tollgate reads a descriptor entry from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A request header (what Envoy's `request_headers` action reads).
    Header(String),
    /// The client address (Envoy's `remote_address` action).
    ClientIp,
    /// `:method`: a value becomes `match.methods`, no value the `method` key part.
    Method,
    /// `:authority`: a value becomes `match.hosts`.
    Authority,
    /// `:path`: a value becomes `match.routes`.
    Path,
}

impl Source {
    /// Parses the right-hand side of `--header KEY=SOURCE`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            ":method" => Ok(Source::Method),
            ":authority" | "host" => Ok(Source::Authority),
            ":path" => Ok(Source::Path),
            "client_ip" => Ok(Source::ClientIp),
            other => {
                let lower = other.to_ascii_lowercase();
                if is_header_name(&lower) {
                    Ok(Source::Header(lower))
                } else {
                    Err(format!(
                        "`{other}` is not a header name, `:method`, `:authority`, `:path` or `client_ip`"
                    ))
                }
            }
        }
    }
}

/// Parses `--when KEY=VALUE=CONDITION`: the descriptor entry, and one `when` condition as a
/// policy document writes it (checked for its fields here; for its values when the document
/// is validated).
pub fn parse_when(text: &str) -> Result<(String, String, ConditionSpec), String> {
    let shape = || {
        format!(
            "`{text}` is not KEY=VALUE=CONDITION (e.g. header_match=premium={{\"header\":\"x-plan\",\"equals\":\"premium\"}})"
        )
    };
    let (key, rest) = text.split_once('=').ok_or_else(shape)?;
    let at = rest.find("={").ok_or_else(shape)?;
    let (value, condition) = (&rest[..at], &rest[at + 1..]);
    if key.is_empty() || value.is_empty() {
        return Err(shape());
    }
    let condition: ConditionSpec = serde_json::from_str(condition)
        .map_err(|e| format!("`{condition}` is not a `when` condition: {e}"))?;
    Ok((key.to_string(), value.to_string(), condition))
}

/// How to convert.
#[derive(Debug, Clone)]
pub struct Options {
    /// `--header KEY=SOURCE`: where a descriptor key's value comes from.
    pub sources: BTreeMap<String, Source>,
    /// `--when KEY=VALUE=CONDITION`: the tollgate conditions that hold exactly when Envoy
    /// produces the entry `KEY` = `VALUE` (all must hold), e.g. the header matchers of a
    /// header_value_match action. They take precedence over `sources` for that entry.
    pub conditions: BTreeMap<(String, String), Vec<ConditionSpec>>,
    /// The Envoy cluster of the limiter (the document's `limiter.cluster`).
    pub limiter_cluster: String,
    /// `client_ip.trusted_hops` for `remote_address`.
    pub trusted_hops: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            sources: BTreeMap::new(),
            conditions: BTreeMap::new(),
            limiter_cluster: "tollgate_limiter".into(),
            trusted_hops: 0,
        }
    }
}

/// One descriptor entry a converted policy reads, for the Envoy mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    /// The descriptor key.
    pub key: String,
    /// `key` or `key` = `value`, as printed.
    pub entry: String,
    /// What tollgate reads instead, and which Envoy action produced the entry.
    pub from: String,
    /// The source was assumed (no `--header` for the key).
    pub assumed: bool,
}

/// A policy made from one descriptor path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Converted {
    pub name: String,
    pub file: String,
    /// ratelimit's full key, e.g. `messaging.message_type_marketing.to_number`.
    pub descriptor: String,
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub enforce: bool,
    pub reads: Vec<Read>,
}

/// A limit that did not become a policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub file: String,
    pub descriptor: String,
    /// `5 per day`, `unlimited`.
    pub limit: String,
    pub reasons: Vec<String>,
}

/// A converted policy that does not behave exactly as its descriptor did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub policy: String,
    pub reason: String,
}

/// The result: the document and what to tell the operator.
#[derive(Debug, Clone)]
pub struct Conversion {
    pub document: Document,
    pub converted: Vec<Converted>,
    pub differences: Vec<Difference>,
    pub skipped: Vec<Skipped>,
}

/// The policy document written (the subset of `tollgate_core::policy::PolicyDocument` an
/// import uses, in the order a person reads it).
#[derive(Debug, Clone, Serialize)]
pub struct Document {
    pub policies: Vec<Policy>,
    pub limiter: LimiterRef,
}

#[derive(Debug, Clone, Serialize)]
pub struct LimiterRef {
    pub cluster: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Policy {
    pub name: String,
    #[serde(rename = "match", skip_serializing_if = "Match::is_empty")]
    pub matcher: Match,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub when: Vec<ConditionSpec>,
    pub key: Vec<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// Sibling limits told apart only by a header's value, as one policy (`merge_by_value`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<Limits>,
    pub algorithm: &'static str,
    pub scope: &'static str,
    pub enforce: bool,
    pub on_unavailable: FailOpen,
    /// `0`: a refusing rule (`requests_per_unit: 0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u32>,
    /// Where a value-specific limit came from, for merging its siblings.
    #[serde(skip)]
    origin: Option<ValueOrigin>,
}

/// `limits` by the value of one header.
#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    pub by: serde_json::Value,
    pub values: BTreeMap<String, LimitEntry>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LimitEntry {
    pub rate: Rate,
}

/// A policy converted from a path with exactly one fixed header value (an `equals` condition
/// at `when[condition]`) and an identity key: siblings that differ only in that value and the
/// rate become one policy with `limits` by the header.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ValueOrigin {
    header: String,
    value: String,
    condition: usize,
    /// The policy's name with the value's level named by its key alone.
    name: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Match {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
}

impl Match {
    fn is_empty(&self) -> bool {
        self.hosts.is_empty() && self.routes.is_empty() && self.methods.is_empty()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Rate {
    pub units: u64,
    pub per: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct FailOpen {
    pub mode: &'static str,
}

/// Converts validated files (distinct domains) into one document.
pub fn convert(files: &[ConfigFile], options: &Options) -> Conversion {
    let mut out = Conversion {
        document: Document {
            policies: Vec::new(),
            limiter: LimiterRef {
                cluster: options.limiter_cluster.clone(),
            },
        },
        converted: Vec::new(),
        differences: Vec::new(),
        skipped: Vec::new(),
    };
    for file in files {
        let mut path = Vec::new();
        let from = out.document.policies.len();
        walk(file, &file.descriptors, &mut path, options, &mut out);
        merge_by_value(&mut out, from);
    }
    out
}

/// One level of a descriptor path: the descriptor and the level it sits in.
type Step<'a> = (&'a Descriptor, &'a [Descriptor]);

fn walk<'a>(
    file: &'a ConfigFile,
    level: &'a [Descriptor],
    path: &mut Vec<Step<'a>>,
    options: &Options,
    out: &mut Conversion,
) {
    for descriptor in level {
        path.push((descriptor, level));
        if let Some(limit) = &descriptor.limit {
            convert_limit(file, path, limit, options, out);
        }
        walk(file, &descriptor.descriptors, path, options, out);
        path.pop();
    }
}

fn full_key(domain: &str, path: &[Step<'_>]) -> String {
    let mut text = domain.to_string();
    for (descriptor, _) in path {
        text.push('.');
        text.push_str(&descriptor.composite_key());
    }
    text
}

fn convert_limit(
    file: &ConfigFile,
    path: &[Step<'_>],
    limit: &Limit,
    options: &Options,
    out: &mut Conversion,
) {
    let descriptor = full_key(&file.domain, path);
    let Some(&(last, _)) = path.last() else {
        return;
    };
    let skip = |out: &mut Conversion, limit: String, reasons: Vec<String>| {
        out.skipped.push(Skipped {
            file: file.file.clone(),
            descriptor: descriptor.clone(),
            limit,
            reasons,
        })
    };
    let (unit, requests_per_unit) = match limit {
        Limit::Unlimited => {
            return skip(
                out,
                "unlimited".into(),
                vec![
                "`unlimited: true`: no policy is needed (tollgate admits what no policy limits)"
                    .into(),
            ],
            )
        }
        Limit::Rate {
            unit,
            requests_per_unit,
        } => (*unit, *requests_per_unit),
    };
    let limit_text = format!("{requests_per_unit} per {}", unit.name());
    // `requests_per_unit: 0` refuses every matching request: a policy with `max_in_flight: 0`.
    let refuse = requests_per_unit == 0;

    let mut reasons = Vec::new();
    let mut parts = Vec::new();
    let mut matcher = Match::default();
    let mut when: Vec<ConditionSpec> = Vec::new();
    let mut reads = Vec::new();
    for (descriptor, _) in path {
        let key = descriptor.key.as_str();
        if let Some(value) = &descriptor.value {
            if let Some(conditions) = options.conditions.get(&(key.to_string(), value.clone())) {
                let written: Vec<String> = conditions
                    .iter()
                    .map(|c| serde_json::to_string(c).unwrap_or_default())
                    .collect();
                when.extend(conditions.iter().cloned());
                reads.push(Read {
                    key: key.to_string(),
                    entry: format!("`{key}` = `{value}`"),
                    from: format!(
                        "when {} (--when: the request facts for which Envoy sets this entry)",
                        written.join(" and ")
                    ),
                    assumed: false,
                });
                continue;
            }
        }
        let (source, assumed) = match source_of(key, options) {
            Ok(found) => found,
            Err(reason) => {
                reasons.push(reason);
                continue;
            }
        };
        match (&descriptor.value, &source) {
            (Some(value), Source::Header(header)) => {
                // ratelimit's `value*` matches every value that starts with `value`.
                let mut condition = ConditionSpec {
                    header: Some(header.clone()),
                    ..ConditionSpec::default()
                };
                let says = match value.strip_suffix('*') {
                    Some("") => {
                        condition.present = Some(true);
                        "present".to_string()
                    }
                    Some(prefix) => {
                        condition.prefix = Some(prefix.to_string());
                        format!("prefix `{prefix}`")
                    }
                    None => {
                        condition.equals = Some(value.clone());
                        format!("equals `{value}`")
                    }
                };
                if contradicts(&when, header, &condition) {
                    reasons.push(format!(
                        "`{key}` = `{value}` contradicts another level of the path"
                    ));
                    continue;
                }
                when.push(condition);
                reads.push(Read {
                    key: key.to_string(),
                    entry: format!("`{key}` = `{value}`"),
                    from: format!(
                        "when header `{header}` {says} (Envoy: `request_headers` action, header_name `{header}`, descriptor_key `{key}`)"
                    ),
                    assumed,
                });
            }
            (Some(value), Source::ClientIp) => {
                if value.ends_with('*') {
                    reasons.push(format!(
                        "`{key}` = `{value}` is a prefix of the address's text: tollgate tests a client address with CIDRs (write that policy by hand)"
                    ));
                    continue;
                }
                // An address alone: ratelimit compares the text, so a network never matches.
                if value.contains('/') || Cidr::parse(value).is_err() {
                    reasons.push(format!("`{key}` = `{value}` is not an IP address"));
                    continue;
                }
                when.push(ConditionSpec {
                    client_ip: Some(ClientIpSpec {
                        trusted_hops: options.trusted_hops,
                    }),
                    cidr: Some(vec![value.clone()]),
                    ..ConditionSpec::default()
                });
                reads.push(Read {
                    key: key.to_string(),
                    entry: format!("`{key}` = `{value}`"),
                    from: format!(
                        "when client_ip (trusted_hops {}) cidr [{value}] (Envoy: `remote_address` action)",
                        options.trusted_hops
                    ),
                    assumed,
                });
            }
            (Some(value), _) if value.ends_with('*') => reasons.push(format!(
                "`{key}` = `{value}` is a prefix match: tollgate matches a prefix of a header's value, not of a method, a host or a path"
            )),
            (None, Source::Header(header)) => {
                parts.push(serde_json::json!({ "header": header }));
                reads.push(Read {
                    key: key.to_string(),
                    entry: format!("`{key}`"),
                    from: format!(
                        "header `{header}` (Envoy: `request_headers` action, header_name `{header}`, descriptor_key `{key}`)"
                    ),
                    assumed,
                });
            }
            (None, Source::ClientIp) => {
                parts.push(serde_json::json!({ "client_ip": { "trusted_hops": options.trusted_hops } }));
                reads.push(Read {
                    key: key.to_string(),
                    entry: format!("`{key}`"),
                    from: format!(
                        "the client IP, key part client_ip with trusted_hops {} (Envoy: `remote_address` action, the downstream address as the connection manager's xff_num_trusted_hops sets it)",
                        options.trusted_hops
                    ),
                    assumed,
                });
            }
            (None, Source::Method) => {
                parts.push(serde_json::json!("method"));
                reads.push(Read {
                    key: key.to_string(),
                    entry: format!("`{key}`"),
                    from: "the method, key part method (Envoy: `request_headers` action on `:method`)".into(),
                    assumed,
                });
            }
            (None, Source::Authority) => reasons.push(format!(
                "`{key}` (any host, one limit each): a tollgate key has no host part"
            )),
            (None, Source::Path) => reasons.push(format!(
                "`{key}` (any path, one limit each): a tollgate key holds a declared route template, never the raw path"
            )),
            (Some(value), Source::Method) => {
                let valid = !value.is_empty()
                    && value.len() <= 16
                    && value.bytes().all(|b| b.is_ascii_uppercase());
                if !valid {
                    reasons.push(format!("`{key}` = `{value}` is not an upper-case HTTP method"));
                } else if add_condition(&mut matcher.methods, value) {
                    reads.push(Read {
                    key: key.to_string(),
                        entry: format!("`{key}` = `{value}`"),
                        from: format!("match.methods [{value}] (Envoy: `request_headers` action on `:method`)"),
                        assumed,
                    });
                } else {
                    reasons.push(format!("`{key}` = `{value}` contradicts another level of the path"));
                }
            }
            (Some(value), Source::Authority) => {
                let valid = !value.is_empty()
                    && value.len() <= 253
                    && value
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
                let host = value.to_ascii_lowercase();
                if !valid {
                    reasons.push(format!("`{key}` = `{value}` is not a host name"));
                } else if add_condition(&mut matcher.hosts, &host) {
                    reads.push(Read {
                    key: key.to_string(),
                        entry: format!("`{key}` = `{value}`"),
                        from: format!("match.hosts [{host}] (Envoy: `request_headers` action on `:authority`)"),
                        assumed,
                    });
                } else {
                    reasons.push(format!("`{key}` = `{value}` contradicts another level of the path"));
                }
            }
            (Some(value), Source::Path) => {
                let template = RouteTemplate::parse(value).ok().filter(|_| !value.contains(['{', '}']));
                match template {
                    None => reasons.push(format!("`{key}` = `{value}` is not a path tollgate can match (`/a/b`, no query)")),
                    Some(template) => {
                        let route = template.as_str().to_string();
                        if add_condition(&mut matcher.routes, &route) {
                            reads.push(Read {
                    key: key.to_string(),
                                entry: format!("`{key}` = `{value}`"),
                                from: format!("match.routes [{route}] (Envoy: `request_headers` action on `:path`; tollgate matches the path without its query)"),
                                assumed,
                            });
                        } else {
                            reasons.push(format!("`{key}` = `{value}` contradicts another level of the path"));
                        }
                    }
                }
            }
        }
    }
    if parts.is_empty() && reasons.is_empty() {
        // Every level is a fixed value: one bucket shared by every matching request.
        parts.push(serde_json::json!({ "constant": descriptor }));
    }
    if parts.len() > key::MAX_PARTS {
        reasons.push(format!(
            "{} key parts: a tollgate key has at most {}",
            parts.len(),
            key::MAX_PARTS
        ));
    }
    if !reasons.is_empty() {
        return skip(out, limit_text, reasons);
    }

    let name = policy_name(&file.domain, path, &descriptor, &out.document.policies);
    let enforce = !last.shadow_mode;
    let mut differences = Vec::new();
    if refuse {
        differences.push(
            "`requests_per_unit: 0` refuses every matching request: converted to `max_in_flight: 0` \
             (no request may be in flight: each is answered 429 `the policy refuses every request`, \
             without `Retry-After`), scope local (no limiter needed)"
                .to_string(),
        );
    }
    let origin = value_origin(&file.domain, path, &when, &parts, refuse);
    if path
        .iter()
        .any(|(d, _)| d.detailed_metric || d.value_to_metric)
    {
        differences.push(
            "`detailed_metric`/`value_to_metric` (metrics per descriptor value): tollgate's metrics are per policy, never per key"
                .to_string(),
        );
    }
    for replaced in &last.replaces {
        differences.push(format!(
            "`replaces: {replaced}`: ratelimit drops the limit named `{replaced}` for a request that also matches this one; tollgate applies every policy a request matches, so both count"
        ));
    }
    for (depth, (descriptor, level)) in path.iter().enumerate() {
        if descriptor.value.is_some() {
            continue;
        }
        for sibling in level.iter() {
            if sibling.key != descriptor.key {
                continue;
            }
            let Some(value) = &sibling.value else {
                continue;
            };
            let target = full_key(
                &file.domain,
                &[path[..depth].to_vec(), vec![(sibling, *level)]].concat(),
            );
            let whose = match value.strip_suffix('*') {
                Some(prefix) => format!("starts with `{prefix}`"),
                None => format!("is `{value}`"),
            };
            differences.push(format!(
                "also counts requests whose `{}` {whose}, which ratelimit gives to the more specific `{target}` instead",
                descriptor.key
            ));
        }
    }
    out.differences
        .extend(differences.into_iter().map(|reason| Difference {
            policy: name.clone(),
            reason,
        }));
    out.converted.push(Converted {
        name: name.clone(),
        file: file.file.clone(),
        descriptor,
        requests_per_unit,
        unit,
        enforce,
        reads,
    });
    out.document.policies.push(Policy {
        name,
        matcher,
        when,
        key: parts,
        rate: Some(Rate {
            units: u64::from(requests_per_unit.max(1)),
            per: unit.per(),
        }),
        limits: None,
        algorithm: "fixed_window",
        scope: if refuse { "local" } else { "global" },
        enforce,
        on_unavailable: FailOpen { mode: "open" },
        max_in_flight: refuse.then_some(0),
        origin,
    });
}

/// The origin of a policy that may merge with its siblings by value: its path has exactly one
/// fixed value, read from a header and tested with `equals`, and its key reads an identity
/// (a path of fixed values only keeps one shared bucket per value: `when` fits it better).
fn value_origin(
    domain: &str,
    path: &[Step<'_>],
    when: &[ConditionSpec],
    parts: &[serde_json::Value],
    refuse: bool,
) -> Option<ValueOrigin> {
    if refuse || parts.iter().any(|p| p.get("constant").is_some()) {
        return None;
    }
    let mut valued = path.iter().filter(|(d, _)| d.value.is_some());
    let (descriptor, _) = valued.next()?;
    if valued.next().is_some() {
        return None;
    }
    let value = descriptor.value.as_ref()?;
    let (condition, header) = when.iter().enumerate().find_map(|(i, c)| {
        (c.equals.as_ref() == Some(value))
            .then_some(())
            .and(c.header.as_ref())
            .map(|h| (i, h.clone()))
    })?;
    let mut name = sanitize(domain);
    for (d, _) in path {
        name.push('-');
        let level = if d.value.is_some() {
            d.key.clone()
        } else {
            d.composite_key()
        };
        name.push_str(&sanitize(&level));
    }
    Some(ValueOrigin {
        header,
        value: value.clone(),
        condition,
        name,
    })
}

/// Merges the policies of `out` from index `from` that differ only in one header's value and
/// their rate into one policy with `limits` by that header (the entry is part of each bucket,
/// so every value keeps a budget of its own, as ratelimit's descriptors do).
fn merge_by_value(out: &mut Conversion, from: usize) {
    let mut index = from;
    while index < out.document.policies.len() {
        let Some(origin) = out.document.policies[index].origin.clone() else {
            index += 1;
            continue;
        };
        let same = |p: &Policy| -> bool {
            let first = &out.document.policies[index];
            let Some(o) = &p.origin else {
                return false;
            };
            let rest = |p: &Policy, at: usize| -> Vec<String> {
                p.when
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != at)
                    .map(|(_, c)| serde_json::to_string(c).unwrap_or_default())
                    .collect()
            };
            o.name == origin.name
                && o.header == origin.header
                && o.condition == origin.condition
                && p.key == first.key
                && p.enforce == first.enforce
                && p.rate.as_ref().map(|r| r.per) == first.rate.as_ref().map(|r| r.per)
                && serde_json::to_string(&p.matcher).ok()
                    == serde_json::to_string(&first.matcher).ok()
                && rest(p, o.condition) == rest(first, origin.condition)
        };
        let members: Vec<usize> = (index..out.document.policies.len())
            .filter(|&i| same(&out.document.policies[i]))
            .collect();
        let values: std::collections::BTreeSet<&str> = members
            .iter()
            .filter_map(|&i| out.document.policies[i].origin.as_ref())
            .map(|o| o.value.as_str())
            .collect();
        if members.len() < 2 || values.len() != members.len() {
            index += 1;
            continue;
        }
        let taken = |name: &str| out.document.policies.iter().any(|p| p.name == name);
        let name = if is_valid_policy_name(&origin.name) && !taken(&origin.name) {
            origin.name.clone()
        } else {
            let suffix = digest_hex(origin.name.as_bytes(), 4);
            let mut name = origin.name.clone();
            name.truncate(64 - 1 - suffix.len());
            format!("{name}-{suffix}")
        };
        let mut entries = BTreeMap::new();
        let mut names = Vec::new();
        for &i in &members {
            let p = &out.document.policies[i];
            if let (Some(o), Some(rate)) = (&p.origin, &p.rate) {
                entries.insert(o.value.clone(), LimitEntry { rate: rate.clone() });
                names.push(p.name.clone());
            }
        }
        let mut merged = out.document.policies[index].clone();
        merged.when.remove(origin.condition);
        merged.name = name.clone();
        merged.rate = None;
        merged.limits = Some(Limits {
            by: serde_json::json!({ "header": origin.header }),
            values: entries,
        });
        merged.origin = None;
        for &i in members.iter().rev() {
            out.document.policies.remove(i);
        }
        out.document.policies.insert(index, merged);
        for converted in out.converted.iter_mut().filter(|c| names.contains(&c.name)) {
            converted.name = name.clone();
            for read in &mut converted.reads {
                if read
                    .from
                    .starts_with(&format!("when header `{}` equals", origin.header))
                {
                    read.from = format!(
                        "limits by header `{}`, its entry for this value (Envoy: `request_headers` action, header_name `{}`, descriptor_key `{}`)",
                        origin.header, origin.header, read.key
                    );
                }
            }
        }
        for difference in out
            .differences
            .iter_mut()
            .filter(|d| names.contains(&d.policy))
        {
            difference.policy = name.clone();
        }
        index += 1;
    }
}

/// Whether a header condition can never hold together with the `when` conditions already
/// gathered: another level of the path asks for a different exact value of the same header.
fn contradicts(when: &[ConditionSpec], header: &str, condition: &ConditionSpec) -> bool {
    let Some(value) = &condition.equals else {
        return false;
    };
    when.iter().any(|c| {
        c.header.as_deref() == Some(header) && c.equals.as_ref().is_some_and(|v| v != value)
    })
}

/// Adds a match condition; `false` when the list already holds a different one (two levels
/// of one path that ask for different values of the same request data never match).
fn add_condition(list: &mut Vec<String>, value: &str) -> bool {
    if list.is_empty() {
        list.push(value.to_string());
        true
    } else {
        list.iter().any(|v| v == value)
    }
}

/// Where a key is read from, and whether that was assumed.
fn source_of(key: &str, options: &Options) -> Result<(Source, bool), String> {
    if let Some(source) = options.sources.get(key) {
        return Ok((source.clone(), false));
    }
    match key {
        "remote_address" => Ok((Source::ClientIp, false)),
        "generic_key" => Err(
            "`generic_key` is set by Envoy's generic_key action, a constant of the route that carries it: tollgate selects routes with `match.routes` (write that policy by hand, rerun with --header generic_key=:path if its values are paths, or with --when generic_key=VALUE=CONDITION naming what tells that route's requests apart)"
                .into(),
        ),
        "destination_cluster" | "source_cluster" => Err(format!(
            "`{key}` is set by Envoy's {key} action (a cluster name): tollgate does not read cluster names"
        )),
        "header_match" => Err(
            "`header_match` is set by Envoy's header_value_match action (a constant when its header matchers hold, which ratelimit's file does not say): rerun with --when header_match=VALUE=CONDITION, e.g. --when 'header_match=premium={\"header\":\"x-plan\",\"equals\":\"premium\"}', once per matcher"
                .into(),
        ),
        "masked_remote_address" => Err(
            "`masked_remote_address` is the client IP masked to a prefix: tollgate keys on the whole address"
                .into(),
        ),
        _ => {
            let header = key.to_ascii_lowercase();
            if is_header_name(&header) {
                Ok((Source::Header(header), true))
            } else {
                Err(format!(
                    "`{key}` is not a header name: rerun with --header '{key}=HEADER'"
                ))
            }
        }
    }
}

/// `domain-key_value-key`, in the name charset; a hash suffix when too long or taken.
fn policy_name(domain: &str, path: &[Step<'_>], full: &str, taken: &[Policy]) -> String {
    let mut name = sanitize(domain);
    for (descriptor, _) in path {
        name.push('-');
        name.push_str(&sanitize(&descriptor.composite_key()));
    }
    let is_taken = |candidate: &str| taken.iter().any(|p| p.name == candidate);
    if is_valid_policy_name(&name) && !is_taken(&name) {
        return name;
    }
    // Sanitized text is ASCII: any byte index is a char boundary.
    let suffix = digest_hex(full.as_bytes(), 4);
    name.truncate(64 - 1 - suffix.len());
    format!("{name}-{suffix}")
}

fn sanitize(text: &str) -> String {
    text.chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::import::input::parse_file;
    use tollgate_core::policy::{AlgorithmName, KeyPart, Policies, Scope};

    fn files(texts: &[&str]) -> Vec<ConfigFile> {
        texts
            .iter()
            .enumerate()
            .map(|(i, text)| parse_file(&format!("f{i}.yaml"), text).unwrap())
            .collect()
    }

    fn options(sources: &[(&str, &str)]) -> Options {
        Options {
            sources: sources
                .iter()
                .map(|(k, s)| (k.to_string(), Source::parse(s).unwrap()))
                .collect(),
            ..Options::default()
        }
    }

    /// The document as the filter and the limiter load it.
    fn load(conversion: &Conversion) -> Policies {
        let json = serde_json::to_vec(&conversion.document).unwrap();
        Policies::from_json(&json).unwrap()
    }

    #[test]
    fn nested_value_less_keys_become_header_parts_of_a_fixed_window() {
        let conversion = convert(
            &files(&["domain: messaging\ndescriptors:\n  - key: to_number\n    descriptors:\n      - key: user\n        rate_limit: {unit: day, requests_per_unit: 5}\n"]),
            &options(&[("user", "X-User")]),
        );
        let policies = load(&conversion);
        let policy = policies.get("messaging-to_number-user").unwrap();
        assert_eq!(
            policy.key,
            [
                KeyPart::Header("to_number".into()),
                KeyPart::Header("x-user".into())
            ]
        );
        assert_eq!((policy.units, policy.per_ms), (5, 86_400_000));
        assert_eq!(policy.algorithm.name(), "fixed_window");
        assert_eq!(policy.scope, Scope::Global);
        assert!(policy.enforce);
        let reads = &conversion.converted[0].reads;
        assert!(reads[0].assumed && !reads[1].assumed, "{reads:?}");
        assert!(conversion.skipped.is_empty() && conversion.differences.is_empty());
        assert_eq!(
            serde_json::to_value(&conversion.document.policies[0]).unwrap()["algorithm"],
            serde_json::to_value(AlgorithmName::FixedWindow).unwrap()
        );
    }

    #[test]
    fn fixed_values_become_match_conditions_where_tollgate_has_them() {
        let conversion = convert(
            &files(&["domain: api\ndescriptors:\n  - key: method\n    value: POST\n    descriptors:\n      - key: host\n        value: API.example.com\n        descriptors:\n          - key: path\n            value: /v1/login\n            rate_limit: {unit: hour, requests_per_unit: 20}\n            shadow_mode: true\n"]),
            &options(&[("method", ":method"), ("host", ":authority"), ("path", ":path")]),
        );
        let policies = load(&conversion);
        let policy = &policies.policies[0];
        assert!(!policy.enforce, "shadow_mode is enforce false");
        assert!(policy
            .match_request("api.example.com", "POST", "/v1/login")
            .is_some());
        assert!(policy
            .match_request("api.example.com", "GET", "/v1/login")
            .is_none());
        assert!(policy
            .match_request("other.example.com", "POST", "/v1/login")
            .is_none());
        assert!(policy
            .match_request("api.example.com", "POST", "/v1/logout")
            .is_none());
        // Every level fixed: one bucket shared by every matching request.
        assert!(
            matches!(policy.key[..], [KeyPart::Constant(_)]),
            "{:?}",
            policy.key
        );
        assert_eq!((policy.units, policy.per_ms), (20, 3_600_000));
    }

    #[test]
    fn what_cannot_be_expressed_is_listed_with_its_reason() {
        let conversion = convert(
            &files(&["domain: d\ndescriptors:\n  - key: ldap\n    rate_limit: {unlimited: true}\n  - key: remote_address\n    value: 50.0.0.5\n    rate_limit: {unit: second, requests_per_unit: 0}\n  - key: generic_key\n    value: slow\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: header_match\n    value: premium\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: remote_address\n    value: 10.0.0.0/8\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: remote_address\n    value: 10.0.*\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: m\n    value: GE*\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 10}\n"]),
            &options(&[("m", ":method")]),
        );
        let reasons: Vec<(String, String)> = conversion
            .skipped
            .iter()
            .map(|s| (s.descriptor.clone(), s.reasons.join("; ")))
            .collect();
        let reason_of = |descriptor: &str| {
            reasons
                .iter()
                .find(|(d, _)| d == descriptor)
                .map(|(_, r)| r.clone())
                .unwrap_or_else(|| panic!("{descriptor} not listed: {reasons:?}"))
        };
        assert!(reason_of("d.ldap").contains("no policy is needed"));
        assert!(reason_of("d.generic_key_slow").contains("generic_key action"));
        assert!(reason_of("d.header_match_premium").contains("--when header_match=VALUE=CONDITION"));
        // ratelimit compares an address's text: a network written as a value matches nothing.
        assert!(reason_of("d.remote_address_10.0.0.0/8").contains("not an IP address"));
        assert!(reason_of("d.remote_address_10.0.*").contains("tests a client address with CIDRs"));
        assert!(reason_of("d.m_GE*").contains("prefix match"));
        assert_eq!(reasons.len(), 6);
        // `requests_per_unit: 0` converts to a refusing rule: no request may be in flight.
        let policies = load(&conversion);
        let refusing = policies.get("d-remote_address_50_0_0_5").unwrap();
        assert_eq!(refusing.in_flight.map(|l| l.max), Some(0));
        assert_eq!(refusing.scope, Scope::Local);
        assert_eq!(refusing.when.len(), 1);
        // The value-less remote_address converts, with the more specific sibling noted.
        let policy = policies.get("d-remote_address").unwrap();
        assert_eq!(policy.key, [KeyPart::ClientIp { trusted_hops: 0 }]);
        assert_eq!(
            conversion.differences.len(),
            4,
            "{:?}",
            conversion.differences
        );
        assert!(conversion.differences[0]
            .reason
            .contains("converted to `max_in_flight: 0`"));
        assert!(conversion.differences[1].reason.contains(
            "is `50.0.0.5`, which ratelimit gives to the more specific `d.remote_address_50.0.0.5`"
        ));
    }

    #[test]
    fn siblings_told_apart_by_a_header_value_become_limits_by_value() {
        let conversion = convert(
            &files(&["domain: d\ndescriptors:\n  - key: plan\n    value: free\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: plan\n    value: pro\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 100}\n  - key: plan\n    value: team\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 5}\n  - key: tier\n    value: gold\n    rate_limit: {unit: minute, requests_per_unit: 7}\n  - key: tier\n    value: silver\n    rate_limit: {unit: minute, requests_per_unit: 3}\n"]),
            &options(&[]),
        );
        let document = serde_json::to_value(&conversion.document).unwrap();
        let names: Vec<&str> = document["policies"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["name"].as_str())
            .collect();
        // free and pro (per minute) merge; team counts per hour, so it stays a `when` policy;
        // fixed values with no identity (one shared bucket each) stay `when` policies.
        assert_eq!(
            names,
            [
                "d-plan-user",
                "d-plan_team-user",
                "d-tier_gold",
                "d-tier_silver"
            ]
        );
        let merged = &document["policies"][0];
        assert_eq!(
            merged["limits"],
            serde_json::json!({"by": {"header": "plan"}, "values": {
                "free": {"rate": {"units": 10, "per": "1m"}},
                "pro": {"rate": {"units": 100, "per": "1m"}}}})
        );
        assert!(merged.get("rate").is_none() && merged.get("when").is_none());
        assert_eq!(merged["key"], serde_json::json!([{ "header": "user" }]));
        // It validates, and each value has its own bucket: the entry is part of the key.
        let policies = load(&conversion);
        let policy = policies.get("d-plan-user").unwrap();
        assert_eq!(policy.entry_for("u1:!vpro").map(|p| p.units), Some(100));
        assert_eq!(policy.entry_for("u1:!vfree").map(|p| p.units), Some(10));
        let converted: Vec<&str> = conversion
            .converted
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(converted.iter().filter(|n| **n == "d-plan-user").count(), 2);
    }

    /// The `when` conditions of the one converted policy, as written.
    fn when_of(conversion: &Conversion, name: &str) -> serde_json::Value {
        let policy = conversion
            .document
            .policies
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no {name}: {:?}", conversion.skipped));
        serde_json::to_value(&policy.when).unwrap()
    }

    #[test]
    fn fixed_header_values_and_prefixes_become_when_conditions() {
        let conversion = convert(
            &files(&["domain: d\ndescriptors:\n  - key: database\n    value: users\n    rate_limit: {unit: second, requests_per_unit: 500}\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit: {unit: day, requests_per_unit: 5}\n  - key: k\n    value: v*\n    rate_limit: {unit: minute, requests_per_unit: 20}\n  - key: k\n    value: \"*\"\n    rate_limit: {unit: minute, requests_per_unit: 30}\n  - key: a\n    value: x\n    descriptors:\n      - key: a\n        value: y\n        rate_limit: {unit: minute, requests_per_unit: 1}\n"]),
            &options(&[("message_type", "X-Message-Type")]),
        );
        assert_eq!(
            when_of(&conversion, "d-database_users"),
            serde_json::json!([{ "header": "database", "equals": "users" }])
        );
        assert_eq!(
            when_of(&conversion, "d-message_type_marketing-to_number"),
            serde_json::json!([{ "header": "x-message-type", "equals": "marketing" }])
        );
        assert_eq!(
            when_of(&conversion, "d-k_v_"),
            serde_json::json!([{ "header": "k", "prefix": "v" }])
        );
        assert_eq!(
            when_of(&conversion, "d-k__"),
            serde_json::json!([{ "header": "k", "present": true }])
        );
        // Two levels that want different values of one header never hold together.
        assert_eq!(conversion.skipped.len(), 1);
        assert!(conversion.skipped[0].reasons[0].contains("contradicts"));
        // As the filter loads them: a fixed value alone is one bucket, the conditions decide.
        let policies = load(&conversion);
        let users = policies.get("d-database_users").unwrap();
        assert!(matches!(users.key[..], [KeyPart::Constant(_)]));
        let marketing = policies.get("d-message_type_marketing-to_number").unwrap();
        assert_eq!(marketing.key, [KeyPart::Header("to_number".into())]);
        assert!(marketing.when[0].test.holds(Some(b"marketing")));
        assert!(!marketing.when[0].test.holds(Some(b"transactional")));
        let read = &conversion.converted[1].reads[0];
        assert_eq!(read.entry, "`message_type` = `marketing`");
        assert!(
            read.from
                .starts_with("when header `x-message-type` equals `marketing`"),
            "{read:?}"
        );
        assert!(!read.assumed);
    }

    #[test]
    fn a_client_address_value_becomes_a_cidr_condition_on_the_same_address() {
        let conversion = convert(
            &files(&["domain: d\ndescriptors:\n  - key: remote_address\n    value: 2001:db8::7\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 3}\n"]),
            &Options {
                trusted_hops: 2,
                ..options(&[("user", "x-user")])
            },
        );
        assert_eq!(
            when_of(&conversion, "d-remote_address_2001_db8__7-user"),
            serde_json::json!([{ "client_ip": { "trusted_hops": 2 }, "cidr": ["2001:db8::7"] }])
        );
        let policies = load(&conversion);
        let test = &policies.policies[0].when[0].test;
        assert!(test.holds_ip(Some("2001:db8::7".parse().unwrap())));
        assert!(!test.holds_ip(Some("2001:db8::8".parse().unwrap())));
    }

    #[test]
    fn when_flags_convert_header_value_match_entries() {
        let (key, value, plan) =
            parse_when(r#"header_match=premium={"header":"x-plan","equals":"premium"}"#).unwrap();
        let (_, _, region) =
            parse_when(r#"header_match=premium={"header":"x-region","prefix":"eu-"}"#).unwrap();
        let mut options = options(&[("user", "x-user")]);
        options.conditions.insert((key, value), vec![plan, region]);
        let conversion = convert(
            &files(&["domain: d\ndescriptors:\n  - key: header_match\n    value: premium\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 300}\n  - key: header_match\n    value: basic\n    rate_limit: {unit: minute, requests_per_unit: 30}\n"]),
            &options,
        );
        assert_eq!(
            when_of(&conversion, "d-header_match_premium-user"),
            serde_json::json!([
                { "header": "x-plan", "equals": "premium" },
                { "header": "x-region", "prefix": "eu-" }
            ])
        );
        // Only the values given are converted.
        assert_eq!(conversion.skipped.len(), 1);
        assert_eq!(conversion.skipped[0].descriptor, "d.header_match_basic");
        load(&conversion);
        for bad in [
            "header_match=premium",
            "=premium={\"header\":\"x\",\"present\":true}",
            "header_match={\"header\":\"x\",\"present\":true}",
            "header_match=premium={\"header\":\"x\",\"startswith\":\"a\"}",
            "header_match=premium={not json}",
        ] {
            assert!(parse_when(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn replaces_and_metric_options_are_differences() {
        let conversion = convert(
            &files(&["domain: d\ndescriptors:\n  - key: user\n    detailed_metric: true\n    rate_limit: {name: base, unit: second, requests_per_unit: 5}\n  - key: tenant\n    rate_limit: {replaces: [{name: base}], unit: second, requests_per_unit: 10}\n"]),
            &Options::default(),
        );
        load(&conversion);
        let differences: Vec<String> = conversion
            .differences
            .iter()
            .map(|d| format!("{}: {}", d.policy, d.reason))
            .collect();
        assert_eq!(differences.len(), 2, "{differences:?}");
        assert!(differences[0].starts_with("d-user: `detailed_metric`"));
        assert!(differences[1].starts_with("d-tenant: `replaces: base`"));
    }

    #[test]
    fn names_are_sanitized_unique_and_at_most_64_characters() {
        let long = "k".repeat(80);
        let conversion = convert(
            &files(&[
                &format!("domain: Shop.EU\ndescriptors:\n  - key: a.b\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n  - key: a_b\n    rate_limit: {{unit: second, requests_per_unit: 2}}\n  - key: {long}\n    rate_limit: {{unit: year, requests_per_unit: 3}}\n"),
            ]),
            &options(&[("a.b", "x-a")]),
        );
        let names: Vec<&str> = conversion
            .document
            .policies
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        assert_eq!(names[0], "shop_eu-a_b");
        assert!(
            names[1].starts_with("shop_eu-a_b-") && names[1].len() == 20,
            "{names:?}"
        );
        assert_eq!(names[2].len(), 64, "{names:?}");
        let policies = load(&conversion);
        assert_eq!(policies.policies[2].per_ms, 365 * 86_400_000);
    }

    #[test]
    fn sources_parse_headers_pseudo_headers_and_the_client_ip() {
        assert_eq!(
            Source::parse("X-User-Id"),
            Ok(Source::Header("x-user-id".into()))
        );
        assert_eq!(Source::parse(":method"), Ok(Source::Method));
        assert_eq!(Source::parse("client_ip"), Ok(Source::ClientIp));
        assert!(Source::parse("a header").is_err());
        assert!(Source::parse(":scheme").is_err());
    }
}
