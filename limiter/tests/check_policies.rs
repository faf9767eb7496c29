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
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
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
