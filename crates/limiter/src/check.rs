//! `tollgate-limiter check-policies FILE...`: validates policy documents with the one
//! validation the filter and the limiter share (`tollgate_core::policy`), so teams can gate
//! policy changes in CI. Every error is reported with its policy, field and reason. With
//! `--explain`, a valid document is also asked what it makes of a sample request
//! ([`crate::explain`]).

use std::path::PathBuf;

use tollgate_core::policy::Policies;

use crate::explain::{explain, SampleRequest};

/// What `check-policies` prints, and whether every document is valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub ok: bool,
    pub text: String,
}

/// Checks each file; one line per valid file, one line per error of an invalid one.
pub fn check_files(files: &[PathBuf]) -> Report {
    check_files_explaining(files, None)
}

/// [`check_files`], and after each valid file what its policies make of `sample`
/// ([`crate::explain`]).
pub fn check_files_explaining(files: &[PathBuf], sample: Option<&SampleRequest>) -> Report {
    let mut ok = true;
    let mut text = String::new();
    for file in files {
        let name = file.display();
        match std::fs::read(file) {
            Err(e) => {
                ok = false;
                text.push_str(&format!("{name}: cannot read: {e}\n"));
            }
            Ok(bytes) => match Policies::from_json(&bytes) {
                Ok(policies) => {
                    let global = policies
                        .policies
                        .iter()
                        .filter(|p| p.scope.uses_limiter())
                        .count();
                    text.push_str(&format!(
                        "{name}: ok: {} policies ({global} global), version {}\n",
                        policies.policies.len(),
                        policies.version
                    ));
                    if let Some(sample) = sample {
                        match explain(&policies, sample) {
                            Ok(lines) => text.push_str(&lines),
                            Err(e) => {
                                ok = false;
                                text.push_str(&format!("{name}: {e}\n"));
                            }
                        }
                    }
                }
                Err(errors) => {
                    ok = false;
                    for error in &errors.0 {
                        text.push_str(&format!("{name}: {error}\n"));
                    }
                }
            },
        }
    }
    Report { ok, text }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &std::path::Path, name: &str, body: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        path
    }

    #[test]
    fn reports_every_error_with_its_field() {
        let dir = std::env::temp_dir().join(format!("tollgate-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../policies/payments.json"
        ));
        let bad = write(
            &dir,
            "bad.json",
            r#"{"policies":[{"name":"p","key":[],"rate":{"units":0,"per":"1s"},"burst":5}]}"#,
        );
        let report = check_files(std::slice::from_ref(&good));
        assert!(report.ok, "{}", report.text);
        assert!(report.text.contains("ok: 1 policies (0 global)"));
        let report = check_files(&[good, bad, dir.join("missing.json")]);
        assert!(!report.ok);
        assert!(
            report
                .text
                .contains("bad.json: policy `p`: policies[0].key:"),
            "{}",
            report.text
        );
        assert!(
            report
                .text
                .contains("bad.json: policy `p`: policies[0].rate.units:"),
            "{}",
            report.text
        );
        assert!(
            report.text.contains("missing.json: cannot read"),
            "{}",
            report.text
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
