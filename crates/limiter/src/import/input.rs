//! envoyproxy/ratelimit's descriptor configuration as written (YAML, `deny_unknown_fields`),
//! and its validation with the rules the ratelimit service applies when it loads a file
//! (empty key or domain, duplicate composite keys, unknown units, `unlimited` with a unit,
//! bad `replaces`), so a file the service would refuse is refused here too.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// One configuration file as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    domain: Option<Scalar>,
    descriptors: Option<Vec<DescriptorSpec>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct DescriptorSpec {
    key: Option<Scalar>,
    value: Option<Scalar>,
    rate_limit: Option<RateLimitSpec>,
    descriptors: Option<Vec<DescriptorSpec>>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitSpec {
    unit: Option<Scalar>,
    requests_per_unit: Option<u32>,
    #[serde(default)]
    unlimited: bool,
    name: Option<Scalar>,
    replaces: Option<Vec<ReplacesSpec>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplacesSpec {
    name: Option<Scalar>,
}

/// A YAML scalar read as text, as the ratelimit service reads its string fields (`value: 30`
/// and `value: "30"` are the same value).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Scalar(String);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;
        impl Visitor<'_> for ScalarVisitor {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
        }
        deserializer.deserialize_any(ScalarVisitor)
    }
}

/// The time unit of a limit; ratelimit counts one fixed window per unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    fn parse(text: &str) -> Option<Self> {
        Some(match text.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// The window as a policy document duration, as ratelimit sizes it (a month is 30 days,
    /// a year 365).
    pub fn per(self) -> &'static str {
        match self {
            Unit::Second => "1s",
            Unit::Minute => "1m",
            Unit::Hour => "1h",
            Unit::Day => "1d",
            Unit::Week => "7d",
            Unit::Month => "30d",
            Unit::Year => "365d",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }
}

/// A validated `rate_limit` block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Limit {
    /// `unlimited: true`.
    Unlimited,
    Rate {
        unit: Unit,
        requests_per_unit: u32,
    },
}

/// A validated descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub key: String,
    /// `None` (or empty in the file): any value, one limit per distinct value.
    pub value: Option<String>,
    pub limit: Option<Limit>,
    /// `rate_limit.name`.
    pub name: Option<String>,
    /// `rate_limit.replaces[].name`.
    pub replaces: Vec<String>,
    pub shadow_mode: bool,
    pub detailed_metric: bool,
    pub value_to_metric: bool,
    pub share_threshold: bool,
    pub descriptors: Vec<Descriptor>,
    /// Where it is in its file, e.g. `descriptors[0].descriptors[1]`.
    pub field: String,
}

impl Descriptor {
    /// ratelimit's name for this level: `key` or `key_value`.
    pub fn composite_key(&self) -> String {
        match &self.value {
            Some(value) => format!("{}_{value}", self.key),
            None => self.key.clone(),
        }
    }
}

/// A validated configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigFile {
    /// The file's name as given (for messages).
    pub file: String,
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
}

/// One reason a file is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputError {
    pub file: String,
    /// Path of the field, e.g. `descriptors[0].rate_limit.unit`; `(file)` for the whole file.
    pub field: String,
    pub reason: String,
}

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.file, self.field, self.reason)
    }
}

/// Parses and validates one file; every problem found is returned.
pub fn parse_file(file: &str, text: &str) -> Result<ConfigFile, Vec<InputError>> {
    let error = |field: String, reason: String| InputError {
        file: file.to_string(),
        field,
        reason,
    };
    let spec: FileSpec = match serde_yaml_ng::from_str(text) {
        Ok(spec) => spec,
        Err(e) => return Err(vec![yaml_error(file, &e)]),
    };
    let mut errors = Vec::new();
    let domain = spec.domain.map(|d| d.0).unwrap_or_default();
    if domain.is_empty() {
        errors.push(error(
            "domain".into(),
            "missing or empty (every ratelimit configuration names its domain)".into(),
        ));
    }
    let descriptors = validate_level(file, "", spec.descriptors.unwrap_or_default(), &mut errors);
    if errors.is_empty() {
        Ok(ConfigFile {
            file: file.to_string(),
            domain,
            descriptors,
        })
    } else {
        Err(errors)
    }
}

/// A YAML or schema error: the field path serde found, and the position.
fn yaml_error(file: &str, e: &serde_yaml_ng::Error) -> InputError {
    let mut text = e.to_string();
    for (internal, written) in [
        (
            "struct FileSpec",
            "a mapping with `domain` and `descriptors`",
        ),
        (
            "struct DescriptorSpec",
            "a descriptor (a mapping with `key`)",
        ),
        ("struct RateLimitSpec", "a `rate_limit` mapping"),
        ("struct ReplacesSpec", "a mapping with `name`"),
    ] {
        text = text.replace(internal, written);
    }
    // serde_yaml_ng writes `path: reason at line L column C` when it knows the path.
    let (field, reason) = match text.split_once(": ") {
        Some((path, reason))
            if !path.contains(' ')
                && path.chars().next().is_some_and(|c| c.is_ascii_alphabetic()) =>
        {
            (path.to_string(), reason.to_string())
        }
        _ => ("(file)".to_string(), text.clone()),
    };
    InputError {
        file: file.to_string(),
        field,
        reason: if field_is_document(&text) {
            format!("not valid YAML: {reason}")
        } else {
            reason
        },
    }
}

fn field_is_document(text: &str) -> bool {
    !text.contains("unknown field")
        && !text.contains("invalid type")
        && !text.contains("invalid value")
}

fn validate_level(
    file: &str,
    parent: &str,
    specs: Vec<DescriptorSpec>,
    errors: &mut Vec<InputError>,
) -> Vec<Descriptor> {
    let mut seen: Vec<String> = Vec::new();
    let mut out = Vec::new();
    let prefix = if parent.is_empty() {
        String::new()
    } else {
        format!("{parent}.")
    };
    for (index, spec) in specs.into_iter().enumerate() {
        let field = format!("{prefix}descriptors[{index}]");
        let mut push = |sub: &str, reason: String| {
            errors.push(InputError {
                file: file.to_string(),
                field: format!("{field}.{sub}"),
                reason,
            })
        };
        let key = spec.key.map(|k| k.0).unwrap_or_default();
        if key.is_empty() {
            push(
                "key",
                "missing or empty (every descriptor has a key)".into(),
            );
        }
        let value = spec.value.map(|v| v.0).filter(|v| !v.is_empty());
        let composite = match &value {
            Some(v) => format!("{key}_{v}"),
            None => key.clone(),
        };
        if !key.is_empty() {
            if seen.contains(&composite) {
                push(
                    "key",
                    format!(
                        "duplicate descriptor `{composite}` at this level (ratelimit refuses the file)"
                    ),
                );
            }
            seen.push(composite.clone());
        }
        if spec.share_threshold && !composite.ends_with('*') {
            push(
                "share_threshold",
                "only for a wildcard value (one ending in `*`)".into(),
            );
        }
        let mut limit = None;
        let mut name = None;
        let mut replaces = Vec::new();
        if let Some(rate_limit) = spec.rate_limit {
            name = rate_limit.name.map(|n| n.0).filter(|n| !n.is_empty());
            let unit = rate_limit.unit.map(|u| u.0);
            if rate_limit.unlimited {
                if let Some(unit) = unit.filter(|u| !u.is_empty()) {
                    push(
                        "rate_limit.unit",
                        format!("`{unit}` with `unlimited: true` (leave the unit out)"),
                    );
                }
                limit = Some(Limit::Unlimited);
            } else {
                let parsed = match unit.as_deref() {
                    None | Some("") => {
                        push(
                            "rate_limit.unit",
                            "missing (second, minute, hour, day, week, month or year)".into(),
                        );
                        None
                    }
                    Some(text) => {
                        let parsed = Unit::parse(text);
                        if parsed.is_none() {
                            push(
                                "rate_limit.unit",
                                format!(
                                    "`{text}` is not a unit (second, minute, hour, day, week, month or year)"
                                ),
                            );
                        }
                        parsed
                    }
                };
                let requests = rate_limit.requests_per_unit;
                if requests.is_none() {
                    push(
                        "rate_limit.requests_per_unit",
                        "missing (ratelimit would read it as 0 and refuse every request: write 0 if that is meant)"
                            .into(),
                    );
                }
                if let (Some(unit), Some(requests_per_unit)) = (parsed, requests) {
                    limit = Some(Limit::Rate {
                        unit,
                        requests_per_unit,
                    });
                }
            }
            for (i, entry) in rate_limit
                .replaces
                .unwrap_or_default()
                .into_iter()
                .enumerate()
            {
                let replaced = entry.name.map(|n| n.0).unwrap_or_default();
                if replaced.is_empty() {
                    push(
                        &format!("rate_limit.replaces[{i}].name"),
                        "missing or empty".into(),
                    );
                } else if name.as_deref() == Some(replaced.as_str()) {
                    push(
                        &format!("rate_limit.replaces[{i}].name"),
                        format!("`{replaced}` is this limit's own name"),
                    );
                } else {
                    replaces.push(replaced);
                }
            }
        }
        let descriptors =
            validate_level(file, &field, spec.descriptors.unwrap_or_default(), errors);
        out.push(Descriptor {
            key,
            value,
            limit,
            name,
            replaces,
            shadow_mode: spec.shadow_mode,
            detailed_metric: spec.detailed_metric,
            value_to_metric: spec.value_to_metric,
            share_threshold: spec.share_threshold,
            descriptors,
            field,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(text: &str) -> Vec<String> {
        parse_file("f.yaml", text)
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn reads_nested_descriptors_with_scalar_values() {
        let file = parse_file(
            "f.yaml",
            "domain: d\ndescriptors:\n  - key: to_number\n    value: 2061234567\n    descriptors:\n      - key: user\n        rate_limit: {unit: Day, requests_per_unit: 5}\n        shadow_mode: true\n",
        )
        .unwrap();
        assert_eq!(file.domain, "d");
        let top = &file.descriptors[0];
        assert_eq!(top.value.as_deref(), Some("2061234567"));
        assert_eq!(top.limit, None);
        let child = &top.descriptors[0];
        assert_eq!(child.field, "descriptors[0].descriptors[0]");
        assert!(child.shadow_mode);
        assert_eq!(
            child.limit,
            Some(Limit::Rate {
                unit: Unit::Day,
                requests_per_unit: 5
            })
        );
    }

    #[test]
    fn refuses_what_ratelimit_refuses_naming_the_field() {
        let out = errors("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n");
        assert_eq!(
            out,
            ["f.yaml: descriptors[0].rate_limit.unit: `fortnight` is not a unit (second, minute, hour, day, week, month or year)"]
        );
        let out = errors("descriptors:\n  - value: x\n  - key: a\n  - key: a\n");
        assert!(out.contains(&"f.yaml: domain: missing or empty (every ratelimit configuration names its domain)".to_string()), "{out:?}");
        assert!(
            out.iter()
                .any(|e| e.starts_with("f.yaml: descriptors[0].key: missing")),
            "{out:?}"
        );
        assert!(
            out.iter()
                .any(|e| e.starts_with("f.yaml: descriptors[2].key: duplicate descriptor `a`")),
            "{out:?}"
        );
        let out = errors("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: second}\n  - key: b\n    rate_limit: {name: n, unit: second, replaces: [{name: n}]}\n");
        assert!(
            out.iter().any(|e| e.starts_with(
                "f.yaml: descriptors[0].rate_limit.unit: `second` with `unlimited: true`"
            )),
            "{out:?}"
        );
        assert!(
            out.iter()
                .any(|e| e
                    .starts_with("f.yaml: descriptors[1].rate_limit.requests_per_unit: missing")),
            "{out:?}"
        );
        assert!(
            out.iter().any(|e| e.starts_with(
                "f.yaml: descriptors[1].rate_limit.replaces[0].name: `n` is this limit's own name"
            )),
            "{out:?}"
        );
    }

    #[test]
    fn unknown_fields_and_bad_yaml_name_the_place() {
        let out = errors("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 2}\n");
        assert_eq!(out.len(), 1);
        assert!(
            out[0].starts_with("f.yaml: descriptors[0].rate_limit: unknown field `burst`"),
            "{out:?}"
        );
        let out = errors("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -3}\n");
        assert!(
            out[0].starts_with(
                "f.yaml: descriptors[0].rate_limit.requests_per_unit: invalid type: integer `-3`"
            ),
            "{out:?}"
        );
        let out = errors("- a\n");
        assert_eq!(
            out,
            ["f.yaml: (file): invalid type: sequence, expected a mapping with `domain` and `descriptors`"]
        );
        let out = errors("domain: d\ndescriptors:\n  - key: a\n   value: b\n");
        assert!(
            out[0].starts_with("f.yaml: (file): not valid YAML:"),
            "{out:?}"
        );
    }
}
