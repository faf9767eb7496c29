//! envoyproxy/ratelimit's descriptor configuration as the RateLimitService serves it: the
//! files parsed and validated by the importer's reader (`crate::import::input`, the same
//! rules ratelimit applies when it loads a file), arranged per domain into a lookup tree, and
//! the resolution of a request's descriptors to the rule that limits each, with ratelimit's
//! matching rules:
//!
//! * a descriptor's entries are walked level by level; at each level an entry matches the
//!   config descriptor with its key and value, else the first whose value is a wildcard
//!   pattern (`*` matches any run of bytes) that matches, else the one with its key and no
//!   value (the default: any value, one bucket per distinct value);
//! * the rule is the `rate_limit` of the level of the descriptor's *last* entry: a descriptor
//!   longer or shorter than the configured path is not limited;
//! * `unlimited: true` answers OK without counting; a rule whose `name` another matched
//!   rule of the same request `replaces` is not applied;
//! * the bucket is counted under the domain and every entry of the request's descriptor (with
//!   `share_threshold`, under the wildcard pattern instead of the value, so every matching
//!   value shares one bucket), in a window of the rule's unit aligned to the epoch.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::import::input::{self, Descriptor, Limit, Unit};

/// A rate limit as the config (or a descriptor's override) gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// `None`: `unlimited: true`.
    pub rate: Option<Rate>,
    /// `rate_limit.name` (what `replaces` refers to; the `RateLimit-Policy` name).
    pub name: Option<String>,
    pub replaces: Vec<String>,
    /// Counted and reported in metrics, always answered OK.
    pub shadow_mode: bool,
    /// Where the rule is in its file (`descriptors[0].descriptors[1]`), for logs.
    pub field: String,
}

/// `requests_per_unit` per `unit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub requests_per_unit: u32,
    pub unit: Unit,
}

impl Rate {
    /// The window: ratelimit's divider (a month is 30 days, a year 365), in ms.
    pub fn window_ms(&self) -> u64 {
        let seconds: u64 = match self.unit {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        };
        seconds * 1_000
    }
}

/// One level of a domain's tree.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Level {
    /// key → value → node (nested, so a request's entry is looked up without copying it).
    exact: HashMap<String, HashMap<String, Node>>,
    /// Wildcard values in file order: key, the pattern split on `*`, the pattern, node.
    wildcards: Vec<Wildcard>,
    /// Key without value → node.
    default: HashMap<String, Node>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Wildcard {
    key: String,
    parts: Vec<String>,
    pattern: String,
    node: Node,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    rule: Option<Rule>,
    share_threshold: bool,
    children: Level,
}

/// Every domain's tree; what one snapshot of the configuration serves.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RlsConfig {
    domains: HashMap<String, Level>,
    /// The files it was read from, for logs.
    pub files: Vec<String>,
}

/// Why a configuration was refused: every problem found, one per line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.join("; "))]
pub struct ConfigErrors(pub Vec<String>);

/// How a descriptor resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved<'a> {
    /// No rule limits it (ratelimit answers OK without `current_limit`).
    NoRule,
    /// `unlimited: true`, or a rule another matched rule `replaces`: OK, not counted.
    NotCounted,
    /// Counted against `rule` in the bucket of these entries (values as counted).
    Limited {
        rule: &'a Rule,
        entries: Vec<(&'a str, &'a str)>,
    },
}

/// `*` globbing as ratelimit's `wildcardMatch`: `parts` is the pattern split on `*`.
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str())
    {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for middle in &parts[1..parts.len() - 1] {
        match rest.find(middle.as_str()) {
            Some(at) => rest = &rest[at + middle.len()..],
            None => return false,
        }
    }
    true
}

fn build_level(descriptors: &[Descriptor]) -> Level {
    let mut level = Level::default();
    for d in descriptors {
        let node = Node {
            rule: d.limit.as_ref().map(|limit| Rule {
                rate: match limit {
                    Limit::Unlimited => None,
                    Limit::Rate {
                        unit,
                        requests_per_unit,
                    } => Some(Rate {
                        requests_per_unit: *requests_per_unit,
                        unit: *unit,
                    }),
                },
                name: d.name.clone(),
                replaces: d.replaces.clone(),
                shadow_mode: d.shadow_mode,
                field: d.field.clone(),
            }),
            share_threshold: d.share_threshold,
            children: build_level(&d.descriptors),
        };
        match &d.value {
            None => {
                level.default.insert(d.key.clone(), node);
            }
            Some(value) if value.contains('*') => level.wildcards.push(Wildcard {
                key: d.key.clone(),
                parts: value.split('*').map(str::to_owned).collect(),
                pattern: value.clone(),
                node,
            }),
            Some(value) => {
                level
                    .exact
                    .entry(d.key.clone())
                    .or_default()
                    .insert(value.clone(), node);
            }
        }
    }
    level
}

impl RlsConfig {
    /// Builds the trees of validated files; two files of one domain are refused (as
    /// ratelimit does without MERGE_DOMAIN_CONFIG).
    pub fn from_files(files: Vec<input::ConfigFile>) -> Result<Self, ConfigErrors> {
        let mut errors = Vec::new();
        let mut config = RlsConfig::default();
        let mut seen: HashMap<String, String> = HashMap::new();
        for file in files {
            if let Some(first) = seen.get(&file.domain) {
                errors.push(format!(
                    "{}: domain: `{}` is also the domain of {first} (ratelimit refuses a domain \
                     in two files; merge them into one file)",
                    file.file, file.domain
                ));
                continue;
            }
            seen.insert(file.domain.clone(), file.file.clone());
            config
                .domains
                .insert(file.domain.clone(), build_level(&file.descriptors));
            config.files.push(file.file);
        }
        if errors.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors(errors))
        }
    }

    /// Parses `(name, text)` pairs (YAML) and builds the configuration.
    pub fn parse(sources: &[(String, String)]) -> Result<Self, ConfigErrors> {
        let mut errors = Vec::new();
        let mut files = Vec::new();
        for (name, text) in sources {
            match input::parse_file(name, text) {
                Ok(file) => files.push(file),
                Err(problems) => errors.extend(problems.iter().map(ToString::to_string)),
            }
        }
        if !errors.is_empty() {
            return Err(ConfigErrors(errors));
        }
        Self::from_files(files)
    }

    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.domains.keys().map(String::as_str)
    }

    /// The rule of one descriptor (`None`: no rule at its depth, or an unknown domain), with
    /// the entries its bucket is counted under.
    pub fn lookup<'a, K: AsRef<str>, V: AsRef<str>>(
        &'a self,
        domain: &str,
        entries: &'a [(K, V)],
    ) -> Option<(&'a Rule, Vec<(&'a str, &'a str)>)> {
        let mut level = self.domains.get(domain)?;
        let mut counted: Vec<(&'a str, &'a str)> = Vec::with_capacity(entries.len());
        let last = entries.len().checked_sub(1)?;
        for (i, (key, value)) in entries.iter().enumerate() {
            let (key, value): (&'a str, &'a str) = (key.as_ref(), value.as_ref());
            let mut count_as = value;
            let exact = level.exact.get(key).and_then(|values| values.get(value));
            let node = match exact {
                Some(node) => node,
                None => match level
                    .wildcards
                    .iter()
                    .find(|w| w.key == key && wildcard_match(&w.parts, value))
                {
                    Some(w) => {
                        if w.node.share_threshold {
                            count_as = &w.pattern;
                        }
                        &w.node
                    }
                    None => level.default.get(key)?,
                },
            };
            counted.push((key, count_as));
            if i == last {
                return node.rule.as_ref().map(|rule| (rule, counted));
            }
            level = &node.children;
        }
        None
    }

    /// Resolves every descriptor of one request, `replaces` applied across them.
    pub fn resolve<'a, K: AsRef<str>, V: AsRef<str>>(
        &'a self,
        domain: &str,
        descriptors: &'a [Vec<(K, V)>],
    ) -> Vec<Resolved<'a>> {
        let found: Vec<_> = descriptors
            .iter()
            .map(|entries| self.lookup(domain, entries))
            .collect();
        let replaced: Vec<&str> = found
            .iter()
            .flatten()
            .flat_map(|(rule, _)| rule.replaces.iter().map(String::as_str))
            .collect();
        found
            .into_iter()
            .map(|found| match found {
                None => Resolved::NoRule,
                Some((rule, _)) if rule.rate.is_none() => Resolved::NotCounted,
                Some((rule, _))
                    if rule
                        .name
                        .as_deref()
                        .is_some_and(|name| replaced.contains(&name)) =>
                {
                    Resolved::NotCounted
                }
                Some((rule, entries)) => Resolved::Limited { rule, entries },
            })
            .collect()
    }
}

/// Longest configuration file read (a larger one is refused, not truncated).
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// Most files read from a configuration directory.
pub const MAX_FILES: usize = 1_000;

/// Why the configuration could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read --rls-config {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--rls-config {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

/// The files of `path` (a file, or a directory's `*.yaml`/`*.yml` files not starting with
/// `.`, in name order, as ratelimit's runtime directory), as `(name, text)` pairs.
pub fn read_sources(path: &Path) -> Result<Vec<(String, String)>, ReadError> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ReadError::Io { path, source }
    };
    let meta = std::fs::metadata(path).map_err(io(path))?;
    let files: Vec<PathBuf> = if meta.is_dir() {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(path).map_err(io(path))? {
            let entry = entry.map_err(io(path))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') || !(name.ends_with(".yaml") || name.ends_with(".yml")) {
                continue;
            }
            // Follows symlinks (Kubernetes mounts ConfigMap keys as symlinks).
            if std::fs::metadata(entry.path()).is_ok_and(|m| m.is_file()) {
                files.push(entry.path());
            }
        }
        files.sort();
        if files.len() > MAX_FILES {
            return Err(ReadError::Invalid {
                path: path.to_owned(),
                reason: format!("more than {MAX_FILES} configuration files"),
            });
        }
        files
    } else {
        vec![path.to_owned()]
    };
    let mut sources = Vec::with_capacity(files.len());
    for file in files {
        let size = std::fs::metadata(&file).map_err(io(&file))?.len();
        if size > MAX_FILE_BYTES {
            return Err(ReadError::Invalid {
                path: file,
                reason: format!("larger than {MAX_FILE_BYTES} bytes"),
            });
        }
        let bytes = std::fs::read(&file).map_err(io(&file))?;
        let text = String::from_utf8(bytes).map_err(|_| ReadError::Invalid {
            path: file.clone(),
            reason: "not UTF-8".into(),
        })?;
        sources.push((file.display().to_string(), text));
    }
    Ok(sources)
}

/// The bytes a change is detected on: every file's name and text, length-prefixed.
pub fn fingerprint(sources: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, text) in sources {
        for field in [name, text] {
            out.extend_from_slice(&(field.len() as u64).to_le_bytes());
            out.extend_from_slice(field.as_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 5 }
  - key: tenant
    rate_limit: { unit: minute, requests_per_unit: 100 }
    descriptors:
      - key: path
        rate_limit: { unit: minute, requests_per_unit: 10 }
      - key: path
        value: /health
        rate_limit: { unlimited: true }
  - key: tenant
    value: acme
    rate_limit: { unit: minute, requests_per_unit: 1000 }
    descriptors:
      - key: path
        value: /bulk
        rate_limit: { unit: hour, requests_per_unit: 2 }
  - key: user
    value: "bot-*"
    share_threshold: true
    rate_limit: { unit: second, requests_per_unit: 1 }
  - key: user
    value: "x*y*z"
    rate_limit: { unit: day, requests_per_unit: 3 }
  - key: generic_key
    value: slow
    shadow_mode: true
    rate_limit: { unit: second, requests_per_unit: 1, name: old }
  - key: generic_key
    value: fast
    rate_limit: { unit: second, requests_per_unit: 9, replaces: [{ name: old }] }
  - key: only_parent
    descriptors:
      - key: child
        rate_limit: { unit: second, requests_per_unit: 4 }
"#;

    fn config() -> RlsConfig {
        RlsConfig::parse(&[("edge.yaml".into(), CONFIG.into())]).unwrap()
    }

    fn d(entries: &[(&str, &str)]) -> Vec<(String, String)> {
        entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn rate(c: &RlsConfig, entries: &[(&str, &str)]) -> Option<(u32, Unit)> {
        let e = d(entries);
        c.lookup("edge", &e)
            .and_then(|(rule, _)| rule.rate)
            .map(|r| (r.requests_per_unit, r.unit))
    }

    #[test]
    fn the_most_specific_match_at_the_descriptors_depth_wins() {
        let c = config();
        assert_eq!(
            rate(&c, &[("remote_address", "10.0.0.1")]),
            Some((5, Unit::Second))
        );
        // Default key match, then the value-specific one.
        assert_eq!(rate(&c, &[("tenant", "other")]), Some((100, Unit::Minute)));
        assert_eq!(rate(&c, &[("tenant", "acme")]), Some((1000, Unit::Minute)));
        // Nested: the rule of the last entry's level.
        assert_eq!(
            rate(&c, &[("tenant", "other"), ("path", "/x")]),
            Some((10, Unit::Minute))
        );
        assert_eq!(
            rate(&c, &[("tenant", "acme"), ("path", "/bulk")]),
            Some((2, Unit::Hour))
        );
        // `tenant_acme` has no default `path` child: ratelimit does not fall back to
        // `tenant`'s children.
        assert_eq!(rate(&c, &[("tenant", "acme"), ("path", "/x")]), None);
        // Deeper or shallower than configured: no rule.
        assert_eq!(rate(&c, &[("remote_address", "a"), ("x", "y")]), None);
        assert_eq!(rate(&c, &[("only_parent", "a")]), None);
        assert_eq!(
            rate(&c, &[("only_parent", "a"), ("child", "b")]),
            Some((4, Unit::Second))
        );
        // Unknown key, unknown domain, no entries.
        assert_eq!(rate(&c, &[("nope", "a")]), None);
        assert!(c.lookup("other", &d(&[("tenant", "a")])).is_none());
        assert!(c.lookup::<&str, &str>("edge", &[]).is_none());
    }

    #[test]
    fn wildcards_and_share_threshold() {
        let c = config();
        assert_eq!(rate(&c, &[("user", "bot-1")]), Some((1, Unit::Second)));
        assert_eq!(rate(&c, &[("user", "xAyBz")]), Some((3, Unit::Day)));
        assert_eq!(rate(&c, &[("user", "xyz")]), Some((3, Unit::Day)));
        assert_eq!(rate(&c, &[("user", "xz")]), None);
        assert_eq!(rate(&c, &[("user", "human")]), None);
        // share_threshold: every matching value counts in the pattern's bucket.
        let a = d(&[("user", "bot-1")]);
        let b = d(&[("user", "bot-2")]);
        assert_eq!(c.lookup("edge", &a).unwrap().1, vec![("user", "bot-*")]);
        assert_eq!(c.lookup("edge", &b).unwrap().1, vec![("user", "bot-*")]);
        // Without it, each value has its own bucket.
        let x = d(&[("user", "xAyz")]);
        assert_eq!(c.lookup("edge", &x).unwrap().1, vec![("user", "xAyz")]);
    }

    #[test]
    fn unlimited_and_replaces_are_not_counted() {
        let c = config();
        let reqs = vec![
            d(&[("tenant", "t"), ("path", "/health")]),
            d(&[("generic_key", "slow")]),
            d(&[("tenant", "t")]),
            d(&[("nope", "x")]),
        ];
        let r = c.resolve("edge", &reqs);
        assert_eq!(r[0], Resolved::NotCounted);
        assert!(matches!(&r[1], Resolved::Limited { rule, .. } if rule.shadow_mode));
        assert!(matches!(&r[2], Resolved::Limited { .. }));
        assert_eq!(r[3], Resolved::NoRule);
        // `fast` replaces `old` when both are in one request.
        let reqs = vec![d(&[("generic_key", "slow")]), d(&[("generic_key", "fast")])];
        let r = c.resolve("edge", &reqs);
        assert_eq!(r[0], Resolved::NotCounted);
        assert!(
            matches!(&r[1], Resolved::Limited { rule, .. } if rule.rate.unwrap().requests_per_unit == 9)
        );
    }

    #[test]
    fn files_are_validated_and_domains_unique() {
        let e = RlsConfig::parse(&[
            ("a.yaml".into(), "domain: x\ndescriptors: []\n".into()),
            ("b.yaml".into(), "domain: x\ndescriptors: []\n".into()),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("b.yaml: domain"), "{e}");
        let e = RlsConfig::parse(&[(
            "c.yaml".into(),
            "domain: x\ndescriptors:\n  - key: k\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n"
                .into(),
        )])
        .unwrap_err();
        assert!(
            e.to_string().contains("descriptors[0].rate_limit.unit"),
            "{e}"
        );
        let e = RlsConfig::parse(&[("d.yaml".into(), "domain: x\nbogus: 1\n".into())]).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    #[test]
    fn windows_are_ratelimits_dividers() {
        let r = |unit| Rate {
            requests_per_unit: 1,
            unit,
        };
        assert_eq!(r(Unit::Second).window_ms(), 1_000);
        assert_eq!(r(Unit::Month).window_ms(), 2_592_000_000);
        assert_eq!(r(Unit::Year).window_ms(), 31_536_000_000);
    }

    #[test]
    fn wildcard_matching_is_ordered_globbing() {
        let p = |s: &str| s.split('*').map(str::to_owned).collect::<Vec<_>>();
        assert!(wildcard_match(&p("a*"), "a"));
        assert!(wildcard_match(&p("a*"), "abc"));
        assert!(!wildcard_match(&p("a*"), "ba"));
        assert!(wildcard_match(&p("*c"), "abc"));
        assert!(wildcard_match(&p("a*b*c"), "a_b_c"));
        assert!(!wildcard_match(&p("a*b*c"), "a_c_b"));
        assert!(!wildcard_match(&p("ab*ba"), "aba"));
        assert!(wildcard_match(&p("exact"), "exact"));
    }
}
