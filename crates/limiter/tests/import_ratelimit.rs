#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! `tollgate-limiter import-ratelimit`: the binary over envoyproxy/ratelimit configurations
//! shaped like its documented examples and a gateway's: the exact policies, a document that
//! `check-policies` accepts, what could not be converted listed with reasons (exit 0), and
//! invalid input refused with the file and the field (exit 1).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn import(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-limiter"))
        .arg("import-ratelimit")
        .args(args)
        .current_dir(fixtures())
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ratelimit")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tollgate-import-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `check-policies` on a converted document.
fn check_policies(document: &str, dir: &Path) -> String {
    let path = dir.join("imported.json");
    std::fs::write(&path, document).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-limiter"))
        .arg("check-policies")
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "check-policies refused it: {text}");
    text
}

fn policy<'a>(document: &'a Value, name: &str) -> &'a Value {
    document["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no policy `{name}` in {document:#}"))
}

fn global_fixed_window(name: &str, key: Value, units: u64, per: &str, enforce: bool) -> Value {
    json!({
        "name": name,
        "key": key,
        "rate": { "units": units, "per": per },
        "algorithm": "fixed_window",
        "scope": "global",
        "enforce": enforce,
        "on_unavailable": { "mode": "open" },
    })
}

#[test]
fn documented_examples_convert_exactly_and_list_the_rest() {
    let files = [
        "example1-mongo_cps.yaml",
        "example2-messaging.yaml",
        "example3-edge_proxy_per_ip.yaml",
        "example4.yaml",
        "example5-internal.yaml",
        "example6.yaml",
        "example7.yaml",
        "example8.yaml",
        "example9.yaml",
    ];
    let run = import(&files);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let document: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(
        document["limiter"],
        json!({ "cluster": "tollgate_limiter" })
    );
    assert_eq!(document["policies"].as_array().unwrap().len(), 15);
    // `requests_per_unit: 0`: a refusing rule, no request may be in flight.
    let refusing = policy(&document, "edge_proxy_per_ip-remote_address_50_0_0_5");
    assert_eq!(refusing["max_in_flight"], json!(0));
    assert_eq!(refusing["scope"], json!("local"));
    assert_eq!(
        policy(&document, "messaging-to_number"),
        &global_fixed_window(
            "messaging-to_number",
            json!([{ "header": "to_number" }]),
            100,
            "1d",
            true
        )
    );
    assert_eq!(
        policy(&document, "edge_proxy_per_ip-remote_address"),
        &global_fixed_window(
            "edge_proxy_per_ip-remote_address",
            json!([{ "client_ip": { "trusted_hops": 0 } }]),
            10,
            "1s",
            true
        )
    );
    assert_eq!(
        policy(&document, "internal-azure"),
        &global_fixed_window(
            "internal-azure",
            json!([{ "header": "azure" }]),
            100,
            "1m",
            true
        )
    );
    assert_eq!(
        policy(&document, "example8-key1"),
        &global_fixed_window(
            "example8-key1",
            json!([{ "header": "key1" }]),
            10,
            "1m",
            true
        )
    );
    // Fixed values become `when` conditions: a header's value, a prefix (`value*`).
    let mut marketing = global_fixed_window(
        "messaging-message_type_marketing-to_number",
        json!([{ "header": "to_number" }]),
        5,
        "1d",
        true,
    );
    marketing["when"] = json!([{ "header": "message_type", "equals": "marketing" }]);
    assert_eq!(
        policy(&document, "messaging-message_type_marketing-to_number"),
        &marketing
    );
    let mut users = global_fixed_window(
        "mongo_cps-database_users",
        json!([{ "constant": "mongo_cps.database_users" }]),
        500,
        "1s",
        true,
    );
    users["when"] = json!([{ "header": "database", "equals": "users" }]);
    assert_eq!(policy(&document, "mongo_cps-database_users"), &users);
    let mut wildcard = global_fixed_window(
        "example9-key1_value_",
        json!([{ "constant": "example9.key1_value*" }]),
        20,
        "1m",
        true,
    );
    wildcard["when"] = json!([{ "header": "key1", "prefix": "value" }]);
    assert_eq!(policy(&document, "example9-key1_value_"), &wildcard);
    let mut shadowed = global_fixed_window(
        "example6-service-user_user-a",
        json!([{ "header": "service" }]),
        10,
        "1s",
        false,
    );
    shadowed["when"] = json!([{ "header": "user", "equals": "user-a" }]);
    assert_eq!(policy(&document, "example6-service-user_user-a"), &shadowed);
    let mut nested = global_fixed_window(
        "example7-key_1_value_1-user_bkthomps",
        json!([{ "constant": "example7.key_1_value_1.user_bkthomps" }]),
        5,
        "1s",
        true,
    );
    nested["when"] = json!([
        { "header": "key_1", "equals": "value_1" },
        { "header": "user", "equals": "bkthomps" }
    ]);
    assert_eq!(
        policy(&document, "example7-key_1_value_1-user_bkthomps"),
        &nested
    );
    let dir = scratch("examples");
    let checked = check_policies(&run.stdout, &dir);
    assert!(
        checked.contains(": ok: 15 policies (14 global)"),
        "{checked}"
    );

    let report = &run.stderr;
    assert!(
        report.starts_with("# import-ratelimit: 15 policies from 9 files (domains: mongo_cps, messaging, edge_proxy_per_ip, example4, internal, example6, example7, example8, example9); 1 limit not converted\n"),
        "{report}"
    );
    for line in [
        "  `to_number` <- header `to_number` (Envoy: `request_headers` action, header_name `to_number`, descriptor_key `to_number`); assumed from the key's name (another header: --header to_number=HEADER)",
        "- edge_proxy_per_ip-remote_address: also counts requests whose `remote_address` is `50.0.0.5`, which ratelimit gives to the more specific `edge_proxy_per_ip.remote_address_50.0.0.5` instead",
        "- example8-key1: `detailed_metric`/`value_to_metric` (metrics per descriptor value): tollgate's metrics are per policy, never per key",
        "- example8-key1: also counts requests whose `key1` is `value1`, which ratelimit gives to the more specific `example8.key1_value1` instead",
        "  `message_type` = `marketing` <- when header `message_type` equals `marketing` (Envoy: `request_headers` action, header_name `message_type`, descriptor_key `message_type`); assumed from the key's name (another header: --header message_type=HEADER)",
        "  `key1` = `value*` <- when header `key1` prefix `value` (Envoy: `request_headers` action, header_name `key1`, descriptor_key `key1`); assumed from the key's name (another header: --header key1=HEADER)",
        "- edge_proxy_per_ip-remote_address_50_0_0_5: `requests_per_unit: 0` refuses every matching request: converted to `max_in_flight: 0` (no request may be in flight: each is answered 429 `the policy refuses every request`, without `Retry-After`), scope local (no limiter needed)",
        "- internal.ldap (unlimited, example5-internal.yaml): `unlimited: true`: no policy is needed (tollgate admits what no policy limits)",
    ] {
        assert!(report.lines().any(|l| l == line), "missing {line:?} in\n{report}");
    }
    // Every limit of the examples converts: only the unlimited one (no policy needed) is listed.
    let not_converted = report.split("## Not converted\n").nth(1).unwrap();
    assert_eq!(not_converted.lines().count(), 1, "{not_converted}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn header_mapping_turns_values_into_match_conditions() {
    let run = import(&[
        "--header",
        "method=:method",
        "--header",
        "path=:path",
        "--header",
        "user_id=x-user-id",
        "--trusted-hops",
        "1",
        "--when",
        r#"header_match=internal={"header":"x-internal","equals":"true"}"#,
        "--limiter-cluster",
        "rate_limits",
        "api-gateway.yaml",
    ]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let document: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(document["limiter"], json!({ "cluster": "rate_limits" }));
    let mut writes = global_fixed_window(
        "api-gateway-method_post-user_id",
        json!([{ "header": "x-user-id" }]),
        60,
        "1m",
        true,
    );
    writes["match"] = json!({ "methods": ["POST"] });
    assert_eq!(
        policy(&document, "api-gateway-method_post-user_id"),
        &writes
    );
    let mut reads = global_fixed_window(
        "api-gateway-method_get-user_id",
        json!([{ "header": "x-user-id" }]),
        600,
        "1m",
        true,
    );
    reads["match"] = json!({ "methods": ["GET"] });
    assert_eq!(policy(&document, "api-gateway-method_get-user_id"), &reads);
    let mut login = global_fixed_window(
        "api-gateway-path__v1_login-remote_address",
        json!([{ "client_ip": { "trusted_hops": 1 } }]),
        20,
        "1h",
        true,
    );
    login["match"] = json!({ "routes": ["/v1/login"] });
    assert_eq!(
        policy(&document, "api-gateway-path__v1_login-remote_address"),
        &login
    );
    // shadow_mode: decide and count, never deny.
    assert_eq!(
        policy(&document, "api-gateway-remote_address"),
        &global_fixed_window(
            "api-gateway-remote_address",
            json!([{ "client_ip": { "trusted_hops": 1 } }]),
            50,
            "1s",
            false
        )
    );
    // A fixed header value (the plan) and an entry `--when` maps become `when` conditions.
    let mut premium = global_fixed_window(
        "api-gateway-plan_premium-user_id",
        json!([{ "header": "x-user-id" }]),
        300,
        "1m",
        true,
    );
    premium["when"] = json!([{ "header": "plan", "equals": "premium" }]);
    assert_eq!(
        policy(&document, "api-gateway-plan_premium-user_id"),
        &premium
    );
    let mut internal = global_fixed_window(
        "api-gateway-header_match_internal",
        json!([{ "constant": "api-gateway.header_match_internal" }]),
        1000,
        "1s",
        true,
    );
    internal["when"] = json!([{ "header": "x-internal", "equals": "true" }]);
    assert_eq!(
        policy(&document, "api-gateway-header_match_internal"),
        &internal
    );
    assert_eq!(document["policies"].as_array().unwrap().len(), 6);
    let dir = scratch("gateway");
    check_policies(&run.stdout, &dir);
    std::fs::remove_dir_all(&dir).unwrap();

    let report = &run.stderr;
    for line in [
        "api-gateway-remote_address: 50 per second, shadow (enforce false) <- api-gateway.remote_address (api-gateway.yaml)",
        "  `method` = `POST` <- match.methods [POST] (Envoy: `request_headers` action on `:method`)",
        "  `user_id` <- header `x-user-id` (Envoy: `request_headers` action, header_name `x-user-id`, descriptor_key `user_id`)",
    ] {
        assert!(report.lines().any(|l| l == line), "missing {line:?} in\n{report}");
    }
    assert!(report.lines().any(|l| l == r#"  `header_match` = `internal` <- when {"header":"x-internal","equals":"true"} (--when: the request facts for which Envoy sets this entry)"#), "{report}");
    assert!(report.contains("- api-gateway.generic_key_slow_reports (1000 per month, api-gateway.yaml): `generic_key` is set by Envoy's generic_key action"), "{report}");
}

#[test]
fn invalid_input_exits_1_naming_the_file_and_the_field() {
    let dir = scratch("invalid");
    let cases = [
        (
            "bad-yaml.yaml",
            "domain: d\ndescriptors:\n  - key: a\n   value: b\n",
            "bad-yaml.yaml: (file): not valid YAML: ",
        ),
        (
            "unknown-field.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: second\n      requests_per_unit: 5\n      burst: 10\n",
            "unknown-field.yaml: descriptors[0].rate_limit: unknown field `burst`",
        ),
        (
            "bad-unit.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: {unit: fortnight, requests_per_unit: 5}\n",
            "bad-unit.yaml: descriptors[0].descriptors[0].rate_limit.unit: `fortnight` is not a unit",
        ),
        (
            "no-requests.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second}\n",
            "no-requests.yaml: descriptors[0].rate_limit.requests_per_unit: missing",
        ),
        (
            "negative.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -5}\n",
            "negative.yaml: descriptors[0].rate_limit.requests_per_unit: invalid type: integer `-5`",
        ),
        (
            "no-domain.yaml",
            "descriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 5}\n",
            "no-domain.yaml: domain: missing or empty",
        ),
        (
            "nothing.yaml",
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true}\n",
            "nothing.yaml: (descriptors): nothing to convert",
        ),
    ];
    for (name, body, expected) in cases {
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        let run = import(&[path.to_str().unwrap()]);
        assert_eq!(run.code, 1, "{name}: {}", run.stderr);
        assert!(run.stdout.is_empty(), "{name}: printed a document on error");
        let expected = format!("{}/{expected}", dir.display());
        assert!(
            run.stderr.lines().any(|l| l.starts_with(&expected)),
            "{name}: expected a line starting {expected:?} in\n{}",
            run.stderr
        );
    }

    // One domain in two files, and a file that cannot be read.
    let again = dir.join("again.yaml");
    std::fs::write(&again, "domain: messaging\ndescriptors: []\n").unwrap();
    let missing = dir.join("missing.yaml");
    let run = import(&[
        "example2-messaging.yaml",
        again.to_str().unwrap(),
        missing.to_str().unwrap(),
    ]);
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stdout.is_empty());
    assert!(
        run.stderr.contains(&format!(
            "{}: domain: `messaging` is also the domain of example2-messaging.yaml",
            again.display()
        )),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr
            .contains(&format!("{}: (file): cannot read:", missing.display())),
        "{}",
        run.stderr
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn readme_shows_what_the_command_prints() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate-limiter"))
        .args([
            "import-ratelimit",
            "--header",
            "to_number=x-to-number",
            "--header",
            "message_type=x-message-type",
            "crates/limiter/tests/fixtures/ratelimit/example2-messaging.yaml",
            "crates/limiter/tests/fixtures/ratelimit/example3-edge_proxy_per_ip.yaml",
        ])
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(out.status.success());
    // The book's page on the importer shows the report and the document as printed.
    let section = std::fs::read_to_string(root.join("docs/src/ratelimit/import.md")).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        section.contains(&format!("imported.json\n{stderr}$ ")),
        "docs/src/ratelimit/import.md's report differs from:\n{stderr}"
    );
    assert!(
        section.contains(&format!("$ cat imported.json\n{stdout}```")),
        "docs/src/ratelimit/import.md's document differs from:\n{stdout}"
    );
}
