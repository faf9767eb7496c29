//! `tollgate-limiter import-ratelimit CONFIG.yaml...`: migration from envoyproxy/ratelimit.
//!
//! Reads ratelimit descriptor configurations (`input`), converts them into one tollgate
//! policy document (`convert`, pure) and prints it on stdout; on stderr, a report: the choices
//! made, what each policy reads instead of Envoy's `rate_limits` actions, what converted with a
//! difference and what could not be expressed, each with its reason. Invalid input (a file
//! that cannot be read, bad YAML, an unknown field, a bad unit, a duplicate domain, nothing to
//! convert) is an error naming the file and the field.

pub mod convert;
pub mod input;

use std::fmt::Write as _;
use std::path::PathBuf;

use tollgate_core::policy::Policies;

pub use convert::{convert, Conversion, Options, Source};
use input::ConfigFile;

/// What the command prints, and whether it succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub ok: bool,
    /// The policy document (empty on failure).
    pub stdout: String,
    /// The report, or the errors.
    pub stderr: String,
}

/// Reads, validates and converts the files.
pub fn run(files: &[PathBuf], options: &Options) -> Outcome {
    let fail = |stderr: String| Outcome {
        ok: false,
        stdout: String::new(),
        stderr,
    };
    let mut errors = String::new();
    let mut parsed: Vec<ConfigFile> = Vec::new();
    for path in files {
        let name = path.display().to_string();
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) => {
                let _ = writeln!(errors, "{name}: (file): cannot read: {e}");
                continue;
            }
        };
        match input::parse_file(&name, &text) {
            Err(problems) => {
                for problem in problems {
                    let _ = writeln!(errors, "{problem}");
                }
            }
            Ok(file) => {
                if let Some(first) = parsed.iter().find(|f| f.domain == file.domain) {
                    let _ = writeln!(
                        errors,
                        "{name}: domain: `{}` is also the domain of {} (ratelimit refuses a domain in two files unless MERGE_DOMAIN_CONFIG; merge them into one file)",
                        file.domain, first.file
                    );
                } else {
                    parsed.push(file);
                }
            }
        }
    }
    if !errors.is_empty() {
        return fail(errors);
    }
    let conversion = convert(&parsed, options);
    let report = report(&parsed, &conversion, options);
    if conversion.document.policies.is_empty() {
        let names: Vec<&str> = parsed.iter().map(|f| f.file.as_str()).collect();
        return fail(format!(
            "{report}\n{}: (descriptors): nothing to convert: no rate limit became a policy (see above)\n",
            names.join(", ")
        ));
    }
    let document = match serde_json::to_string_pretty(&conversion.document) {
        Ok(text) => text + "\n",
        Err(e) => return fail(format!("cannot write the policy document: {e}\n")),
    };
    // The document must load exactly as the filter and the limiter load it.
    if let Err(problems) = Policies::from_json(document.as_bytes()) {
        let mut text = String::from("the converted document does not validate:\n");
        for problem in &problems.0 {
            let _ = writeln!(text, "  {problem}");
        }
        return fail(text);
    }
    Outcome {
        ok: true,
        stdout: document,
        stderr: report,
    }
}

/// The operator's report (stderr): choices, the Envoy mapping, differences, what was left out.
pub fn report(files: &[ConfigFile], conversion: &Conversion, options: &Options) -> String {
    let mut text = String::new();
    let domains: Vec<&str> = files.iter().map(|f| f.domain.as_str()).collect();
    let _ = writeln!(
        text,
        "# import-ratelimit: {} from {} (domains: {}); {} not converted",
        plural(conversion.document.policies.len(), "policy", "policies"),
        plural(files.len(), "file", "files"),
        domains.join(", "),
        plural(conversion.skipped.len(), "limit", "limits")
    );
    let _ = writeln!(
        text,
        "# Each policy: algorithm fixed_window, rate = requests_per_unit per 1 unit (ratelimit's fixed windows; no burst), \
         scope global, on_unavailable open (Envoy's ratelimit filter default), enforce false where shadow_mode; \
         limiter cluster `{}`. A limit of 0 is a refusing rule (max_in_flight 0, scope local); limits of one level told \
         apart only by a header's value (and their rate) are one policy with `limits` by that header.",
        options.limiter_cluster
    );
    let _ = writeln!(
        text,
        "# tollgate applies every policy to every request its filter sees (ratelimit domains and route-level rate_limits do not scope it): \
         add match.hosts / match.routes where Envoy sent a descriptor only on some routes."
    );
    let _ = writeln!(
        text,
        "\n## Envoy mapping (what tollgate reads instead of each descriptor entry)"
    );
    for policy in &conversion.converted {
        let _ = writeln!(
            text,
            "{}: {} per {}{} <- {} ({})",
            policy.name,
            policy.requests_per_unit,
            policy.unit.name(),
            if policy.enforce {
                ""
            } else {
                ", shadow (enforce false)"
            },
            policy.descriptor,
            policy.file
        );
        for read in &policy.reads {
            let assumed = if read.assumed {
                format!(
                    "; assumed from the key's name (another header: --header {}=HEADER)",
                    read.key
                )
            } else {
                String::new()
            };
            let _ = writeln!(text, "  {} <- {}{assumed}", read.entry, read.from);
        }
    }
    let _ = writeln!(text, "\n## Converted with a difference");
    if conversion.differences.is_empty() {
        let _ = writeln!(text, "(none)");
    }
    for difference in &conversion.differences {
        let _ = writeln!(text, "- {}: {}", difference.policy, difference.reason);
    }
    let _ = writeln!(text, "\n## Not converted");
    if conversion.skipped.is_empty() {
        let _ = writeln!(text, "(none)");
    }
    for skipped in &conversion.skipped {
        let _ = writeln!(
            text,
            "- {} ({}, {}): {}",
            skipped.descriptor,
            skipped.limit,
            skipped.file,
            skipped.reasons.join("; ")
        );
    }
    text
}

fn plural(count: usize, one: &str, many: &str) -> String {
    format!("{count} {}", if count == 1 { one } else { many })
}
