#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! `tollgate-limiter check-policies`: exit 0 for the shipped documents, 1 with every error
//! (policy, field, reason) for a bad one — the binary as a CI gate would run it.

use std::process::Command;

fn run(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-limiter"))
        .arg("check-policies")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn shipped_policies_pass_and_bad_ones_fail_with_fields() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let shipped: Vec<String> = std::fs::read_dir(format!("{root}/policies"))
        .unwrap()
        .map(|e| e.unwrap().path().display().to_string())
        .filter(|p| p.ends_with(".json"))
        .collect();
    assert!(shipped.len() >= 2);
    let args: Vec<&str> = shipped.iter().map(String::as_str).collect();
    let (code, out) = run(&args);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out.lines().filter(|l| l.contains(": ok: ")).count(),
        shipped.len(),
        "{out}"
    );

    let dir = std::env::temp_dir().join(format!("tollgate-check-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        r#"{"policies":[{"name":"checkout","key":[{"header":"x-tenant-id"}],"rate":{"units":10,"per":"1 fortnight"},"burst":5}]}"#,
    )
    .unwrap();
    let (code, out) = run(&[bad.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("policy `checkout`: policies[0].rate.per:"),
        "{out}"
    );

    // Calendar periods: fixed windows take them; other algorithms are refused, naming the field.
    let calendar = dir.join("calendar.json");
    std::fs::write(
        &calendar,
        r#"{"policies":[
          {"name":"weekly","key":[{"header":"x"}],"algorithm":"fixed_window","rate":{"units":10,"per":"1w"}},
          {"name":"quarterly","key":[{"header":"x"}],"algorithm":"fixed_window","rate":{"units":10,"per":"3mo"}},
          {"name":"yearly","key":[{"header":"x"}],"algorithm":"fixed_window","rate":{"units":10,"per":"1y"}}]}"#,
    )
    .unwrap();
    let (code, out) = run(&[calendar.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(": ok: 3 policies"), "{out}");
    let sliding = dir.join("sliding-month.json");
    std::fs::write(
        &sliding,
        r#"{"policies":[{"name":"smooth","key":[{"header":"x"}],"algorithm":"sliding_window","rate":{"units":10,"per":"1mo"}}]}"#,
    )
    .unwrap();
    let (code, out) = run(&[sliding.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("policy `smooth`: policies[0].rate.per: a calendar period (`1mo`)"),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // Serving still needs --policies; check-policies needs a file.
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-limiter"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let (code, _) = run(&[]);
    assert_ne!(code, 0);
}

/// `--explain`: the book (docs/src/policies/limits.md) shows what the binary prints for
/// `policies/plans.json`, and the
/// sample request's facts decide the entry (an override, a default, no header at all).
#[test]
fn explain_prints_the_plan_of_a_sample_request() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let explain = |headers: &[&str]| {
        let mut args = vec![
            "policies/plans.json",
            "--explain",
            "--method",
            "GET",
            "--path",
            "/items/1",
        ];
        for h in headers {
            args.extend(["--header", h]);
        }
        let out = Command::new(env!("CARGO_BIN_EXE_tollgate-limiter"))
            .arg("check-policies")
            .args(&args)
            .current_dir(root)
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    let pro = explain(&["x-tenant-id: t1", "x-plan: pro"]);
    let page = std::fs::read_to_string(format!("{root}/docs/src/policies/limits.md")).unwrap();
    assert!(
        page.contains(&format!("--header 'x-plan: pro'\n{pro}```")),
        "the --explain output in docs/src/policies/limits.md differs from:\n{pro}"
    );
    let acme = explain(&["x-tenant-id: acme", "x-plan: free"]);
    assert!(
        acme.contains("key `acme:!o`, limits entry `overrides.acme`, cost 1, rate 5000"),
        "{acme}"
    );
    let unknown = explain(&["x-tenant-id: t2", "x-plan: gold"]);
    assert!(
        unknown.contains("key `t2:!d`, limits entry `default`, cost 1, rate 2 per 60000ms"),
        "{unknown}"
    );
    let anonymous = explain(&[]);
    assert!(
        anonymous.contains("policy `items-by-plan`: skipped: an identity part of its `key`"),
        "{anonymous}"
    );
    // --explain's options need --explain.
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-limiter"))
        .args(["check-policies", "policies/plans.json", "--path", "/x"])
        .current_dir(root)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
