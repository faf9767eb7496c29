#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! envoy/istio/: the WasmPlugin rendered by `just istio` (tools/render-istio) pins exactly the
//! image `just oci` built and carries exactly the policy document; every Istio resource passes
//! the OpenAPI schemas of Istio's CRDs; the filter loads the plugin configuration in the shape
//! Istio hands it over (JSON text, empty vm_id, limiter cluster named `outbound|...`); the mesh
//! guards the limiter (PeerAuthentication STRICT on its pods, DestinationRule ISTIO_MUTUAL, an
//! AuthorizationPolicy that admits only the gateways' service accounts).

mod ops;

use std::path::{Path, PathBuf};
use std::process::Command;

use ops::{build_oci, field, filter_version, json_file, root, run, scratch, str_field, yaml_doc};
use serde_json::{json, Value};
use tollgate_e2e::paths;

const REPO: &str = "registry.test/platform/tollgate";

/// The limiter's cluster as Istio names it, derived from deploy/k8s's Service.
fn limiter_cluster_from_service() -> String {
    let svc = yaml_doc(&root().join("deploy/k8s/base/service.yaml"));
    let name = str_field(&svc, "metadata.name");
    let ns = str_field(&svc, "metadata.namespace");
    let port = svc["spec"]["ports"][0]["port"].as_u64().unwrap();
    format!("outbound|{port}||{name}.{ns}.svc.cluster.local")
}

/// Builds the image of the current module into a scratch dir and renders the WasmPlugin for
/// `policy`; returns (rendered file, layout dir).
fn render(policy: &Path) -> (PathBuf, PathBuf) {
    let dir = scratch("istio");
    build_oci(&paths::wasm_path(), &dir);
    let out = dir.join("wasmplugin.yaml");
    let mut cmd = ops::py_tool("render-istio", &[]);
    cmd.arg("--wasm")
        .arg(paths::wasm_path())
        .arg("--layout")
        .arg(dir.join("tollgate"))
        .args(["--repo", REPO, "--policy"])
        .arg(policy)
        .arg("--out")
        .arg(&out);
    ops::run_ok(cmd);
    (out, dir.join("tollgate"))
}

/// The manifest digest of the layout's image as skopeo reads it, hashed here (not taken from
/// the builder's output).
fn digest_by_skopeo(layout: &Path) -> String {
    let mut cmd = Command::new(ops::tool("skopeo"));
    cmd.args(["inspect", "--raw"])
        .arg(format!("oci:{}:{}", layout.display(), filter_version()));
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ops::sha256_hex(&out.stdout)
}

#[test]
fn rendered_wasmplugin_pins_the_built_image_and_carries_payments_json() {
    let policy_path = root().join("policies/payments.json");
    let (rendered, layout) = render(&policy_path);
    let wp = yaml_doc(&rendered);

    assert_eq!(str_field(&wp, "apiVersion"), "extensions.istio.io/v1alpha1");
    assert_eq!(str_field(&wp, "kind"), "WasmPlugin");
    let spec = field(&wp, "spec");
    assert_eq!(
        str_field(spec, "sha256"),
        digest_by_skopeo(&layout),
        "the WasmPlugin must pin the manifest digest of the image built from this module"
    );
    assert_eq!(
        str_field(spec, "url"),
        format!("oci://{REPO}:{}", filter_version())
    );
    assert_eq!(str_field(spec, "phase"), "STATS");
    assert_eq!(str_field(spec, "failStrategy"), "FAIL_RELOAD");
    assert_eq!(str_field(spec, "pluginName"), "tollgate");
    assert_eq!(str_field(spec, "imagePullPolicy"), "IfNotPresent");
    assert_eq!(
        field(spec, "pluginConfig"),
        &json_file(&policy_path),
        "pluginConfig must be policies/payments.json exactly"
    );
    let text = std::fs::read_to_string(&rendered).unwrap();
    assert!(!text.contains("{{"), "a placeholder was left: {text}");
    assert!(text.contains("RENDERED by `just istio`"));
}

#[test]
fn rendered_global_policy_names_the_limiter_cluster_istio_builds() {
    let policy_path = root().join("policies/payments-global.json");
    let (rendered, _) = render(&policy_path);
    let config = field(&yaml_doc(&rendered), "spec.pluginConfig").clone();

    let mut expected = json_file(&policy_path);
    assert!(
        expected.get("limiter").is_some(),
        "payments-global.json has a limiter section"
    );
    expected["limiter"]["cluster"] = json!(limiter_cluster_from_service());
    assert_eq!(
        config, expected,
        "only limiter.cluster may differ from the policy file"
    );
    assert_eq!(
        str_field(&config, "limiter.cluster"),
        "outbound|8081||tollgate-limiter.tollgate.svc.cluster.local"
    );

    // The DestinationRule tunes that same host.
    let dr = yaml_doc(&root().join("envoy/istio/limiter-destinationrule.yaml"));
    assert_eq!(
        format!("outbound|8081||{}", str_field(&dr, "spec.host")),
        limiter_cluster_from_service()
    );
}

#[test]
fn render_refuses_an_image_of_another_module() {
    let dir = scratch("istio-stale");
    let mut other = std::fs::read(paths::wasm_path()).unwrap();
    other.extend_from_slice(&[0x00, 0x02, 0x01, b'x']); // one more (empty) custom section
    let other_wasm = dir.join("older.wasm");
    std::fs::write(&other_wasm, other).unwrap();
    build_oci(&other_wasm, &dir);

    let mut cmd = ops::py_tool("render-istio", &[]);
    cmd.arg("--wasm")
        .arg(paths::wasm_path())
        .arg("--layout")
        .arg(dir.join("tollgate"))
        .arg("--out")
        .arg(dir.join("wasmplugin.yaml"));
    let out = run(cmd);
    assert!(
        !out.status.success(),
        "rendering must fail when the image holds another module"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("rebuild it with `just oci`"));
    assert!(!dir.join("wasmplugin.yaml").exists());
}

fn validate_istio(files: &[PathBuf]) -> (bool, String) {
    let mut cmd = Command::new(ops::tool("node"));
    cmd.arg(root().join("tools/istio-schema/validate.mjs"))
        .args(files);
    let out = run(cmd);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn istio_resources_pass_the_istio_crd_schemas() {
    let (rendered, _) = render(&root().join("policies/payments-global.json"));
    let mut files = vec![rendered.clone()];
    let mut shipped: Vec<PathBuf> = std::fs::read_dir(root().join("envoy/istio"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    shipped.sort();
    files.extend(shipped);
    let (ok, report) = validate_istio(&files);
    assert!(ok, "Istio schema validation failed:\n{report}");
    assert!(
        report.contains("5 Istio resource(s) checked, 0 invalid"),
        "expected WasmPlugin, DestinationRule, ServiceEntry, PeerAuthentication and \
         AuthorizationPolicy to be checked:\n{report}"
    );

    // The checker is not a rubber stamp: a bad enum value, a bad digest and a typo'd field
    // are each refused.
    let text = std::fs::read_to_string(&rendered).unwrap();
    let dir = rendered.parent().unwrap();
    for (name, from, to) in [
        ("phase", "\n  phase: STATS", "\n  phase: LATE"),
        ("sha256", "\n  sha256: ", "\n  sha256: 0x"),
        ("typo", "\n  failStrategy:", "\n  failStrategi:"),
    ] {
        let bad = dir.join(format!("bad-{name}.yaml"));
        assert!(text.contains(from));
        std::fs::write(&bad, text.replacen(from, to, 1)).unwrap();
        let (ok, report) = validate_istio(&[bad]);
        assert!(!ok, "a WasmPlugin with a bad {name} passed:\n{report}");
    }
    // Nor for the resources that guard the limiter: a weaker or misspelt mode, a bad action
    // and a typo'd principals field are refused.
    for (file, from, to) in [
        (
            "limiter-peerauthentication.yaml",
            "mode: STRICT",
            "mode: STRICTER",
        ),
        (
            "limiter-destinationrule.yaml",
            "mode: ISTIO_MUTUAL",
            "mode: ISTIO",
        ),
        (
            "limiter-authorizationpolicy.yaml",
            "action: ALLOW",
            "action: PERMIT",
        ),
        (
            "limiter-authorizationpolicy.yaml",
            "principals:",
            "principles:",
        ),
    ] {
        let text = std::fs::read_to_string(root().join("envoy/istio").join(file)).unwrap();
        assert!(text.contains(from), "{file} has no `{from}`");
        let bad = dir.join(format!(
            "bad-{}",
            file.replace(".yaml", "-") + to.split(':').next().unwrap() + ".yaml"
        ));
        std::fs::write(&bad, text.replacen(from, to, 1)).unwrap();
        let (ok, report) = validate_istio(&[bad]);
        assert!(!ok, "{file} with `{to}` passed:\n{report}");
    }
}

/// The labels of the limiter's pods (deploy/k8s) and their namespace.
fn limiter_pods() -> (Value, String) {
    let d = yaml_doc(&root().join("deploy/k8s/base/deployment.yaml"));
    (
        field(&d, "spec.template.metadata.labels").clone(),
        str_field(&d, "metadata.namespace").to_string(),
    )
}

/// A workload selector that selects exactly the limiter's pods' labels (non-empty: an empty
/// selector would apply the resource to the whole namespace).
fn selects_the_limiter(resource: &Value, pod_labels: &Value) -> bool {
    let selector = field(resource, "spec.selector.matchLabels")
        .as_object()
        .unwrap();
    !selector.is_empty() && selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v))
}

#[test]
fn the_mesh_guards_the_limiter_with_mutual_tls_and_authorization() {
    let (pod_labels, ns) = limiter_pods();
    let dir = root().join("envoy/istio");

    // The limiter's sidecars accept only mesh mTLS, on every port.
    let pa = yaml_doc(&dir.join("limiter-peerauthentication.yaml"));
    assert_eq!(str_field(&pa, "apiVersion"), "security.istio.io/v1");
    assert_eq!(str_field(&pa, "kind"), "PeerAuthentication");
    assert_eq!(str_field(&pa, "metadata.namespace"), ns);
    assert!(selects_the_limiter(&pa, &pod_labels), "{pa}");
    assert_eq!(str_field(&pa, "spec.mtls.mode"), "STRICT");
    assert!(
        pa["spec"].get("portLevelMtls").is_none(),
        "no port may be exempted from STRICT: {pa}"
    );

    // The gateways' callouts to the limiter are Istio mTLS.
    let dr = yaml_doc(&dir.join("limiter-destinationrule.yaml"));
    assert_eq!(str_field(&dr, "metadata.namespace"), ns);
    assert_eq!(
        str_field(&dr, "spec.trafficPolicy.tls.mode"),
        "ISTIO_MUTUAL"
    );
    assert!(
        dr["spec"]["trafficPolicy"]
            .get("portLevelSettings")
            .is_none(),
        "no port-level setting may override the TLS mode: {dr}"
    );

    // Only the gateways' service accounts may call, and only on the lease port.
    let ap = yaml_doc(&dir.join("limiter-authorizationpolicy.yaml"));
    assert_eq!(str_field(&ap, "apiVersion"), "security.istio.io/v1");
    assert_eq!(str_field(&ap, "kind"), "AuthorizationPolicy");
    assert_eq!(str_field(&ap, "metadata.namespace"), ns);
    assert!(selects_the_limiter(&ap, &pod_labels), "{ap}");
    assert_eq!(str_field(&ap, "spec.action"), "ALLOW");
    let svc = yaml_doc(&root().join("deploy/k8s/base/service.yaml"));
    let lease_port = svc["spec"]["ports"][0]["port"]
        .as_u64()
        .unwrap()
        .to_string();
    let rules = field(&ap, "spec.rules").as_array().unwrap();
    assert!(
        !rules.is_empty(),
        "an ALLOW policy without rules denies everything"
    );
    let mut principals = Vec::new();
    for rule in rules {
        // A rule without `from` would admit every caller; `when` conditions are not used.
        let from = rule["from"].as_array().filter(|f| !f.is_empty());
        assert!(
            from.is_some(),
            "a rule without sources admits everyone: {rule}"
        );
        assert!(rule.get("when").is_none(), "{rule}");
        for source in from.unwrap() {
            let source = &source["source"];
            let keys: Vec<&String> = source.as_object().unwrap().keys().collect();
            assert_eq!(keys, ["principals"], "sources by principal only: {source}");
            for p in source["principals"].as_array().unwrap() {
                let p = p.as_str().unwrap();
                let parts: Vec<&str> = p.split('/').collect();
                assert!(
                    parts.len() == 5 && parts[1] == "ns" && parts[3] == "sa" && !p.contains('*'),
                    "a principal is <trust domain>/ns/<namespace>/sa/<account>, no wildcard: {p}"
                );
                principals.push(p.to_string());
            }
        }
        let ports: Vec<&str> = rule["to"]
            .as_array()
            .unwrap_or_else(|| panic!("a rule limited to the lease port: {rule}"))
            .iter()
            .flat_map(|t| t["operation"]["ports"].as_array().unwrap())
            .map(|p| p.as_str().unwrap())
            .collect();
        assert_eq!(ports, [lease_port.as_str()], "{rule}");
    }
    // The gateway of the WasmPlugin's namespace is among them.
    let template = std::fs::read_to_string(dir.join("wasmplugin.yaml.tmpl")).unwrap();
    let gateway_ns = template
        .lines()
        .find_map(|l| l.strip_prefix("  namespace: "))
        .unwrap()
        .trim();
    assert!(
        principals
            .iter()
            .any(|p| p.contains(&format!("/ns/{gateway_ns}/sa/"))),
        "no principal of the gateway namespace {gateway_ns}: {principals:?}"
    );
}

/// An Envoy bootstrap with the wasm filter configured the way istiod configures a
/// WasmPlugin: no vm_id, root_id = pluginName, configuration = pluginConfig as JSON text,
/// plus the limiter cluster under its Istio name.
fn istio_shaped_bootstrap(plugin_config: &Value) -> Value {
    let cluster = limiter_cluster_from_service();
    json!({
      "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
      "static_resources": {
        "listeners": [{
          "name": "gateway",
          "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
          "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
              "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
              "stat_prefix": "gateway",
              "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]},
              "http_filters": [
                {"name": "istio-system.tollgate", "typed_config": {
                  "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                  "config": {
                    "name": "istio-system.tollgate",
                    "root_id": "tollgate",
                    "failure_policy": "FAIL_RELOAD",
                    "vm_config": {
                      "runtime": "envoy.wasm.runtime.v8",
                      "code": {"local": {"filename": paths::wasm_path()}}
                    },
                    "configuration": {
                      "@type": "type.googleapis.com/google.protobuf.StringValue",
                      "value": serde_json::to_string(plugin_config).unwrap()
                    }
                  }
                }},
                {"name": "envoy.filters.http.router", "typed_config": {
                  "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
              ]
            }
          }]}]
        }],
        "clusters": [{
          "name": cluster,
          "type": "STATIC",
          "connect_timeout": "0.25s",
          "load_assignment": {"cluster_name": cluster, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8081}}}}]}]}
        }]
      }
    })
}

/// `envoy --mode validate`: builds every filter, which loads the wasm VM and runs the
/// filter's on_configure with the configuration (a rejected policy fails validation).
fn envoy_validates(bootstrap: &Value, label: &str) -> (bool, String) {
    let dir = scratch(label);
    let cfg = dir.join("bootstrap.json");
    ops::write_json(&cfg, bootstrap);
    let mut cmd = Command::new(paths::envoy_bin());
    cmd.args(["--mode", "validate", "-l", "warn", "-c"])
        .arg(&cfg);
    let out = run(cmd);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn filter_accepts_the_plugin_config_as_istio_delivers_it() {
    for policy in ["policies/payments.json", "policies/payments-global.json"] {
        let (rendered, _) = render(&root().join(policy));
        let config = field(&yaml_doc(&rendered), "spec.pluginConfig").clone();
        let (ok, log) = envoy_validates(&istio_shaped_bootstrap(&config), "istio-validate");
        assert!(
            ok,
            "Envoy refused the rendered pluginConfig of {policy}:\n{log}"
        );
    }

    // Control: the same check refuses a document the filter rejects.
    let mut bad = json_file(&root().join("policies/payments.json"));
    bad["policies"][0]["burst"] = json!("twenty");
    let (ok, log) = envoy_validates(&istio_shaped_bootstrap(&bad), "istio-validate-bad");
    assert!(!ok, "a bad policy document passed validation:\n{log}");
    assert!(log.contains("Unable to create Wasm plugin"), "{log}");
}

/// The `policy` stats tag regex of an Envoy bootstrap (JSON form).
fn policy_tag_regex(bootstrap: &Value) -> String {
    let tags = field(bootstrap, "stats_config.stats_tags")
        .as_array()
        .unwrap();
    let tag = tags
        .iter()
        .find(|t| t["tag_name"] == "policy")
        .unwrap_or_else(|| panic!("no `policy` stats tag in {bootstrap}"));
    str_field(tag, "regex").to_string()
}

#[test]
fn istio_bootstrap_override_tags_policies_like_the_local_config() {
    let cm = yaml_doc(&root().join("envoy/istio/stats-bootstrap.yaml"));
    assert_eq!(str_field(&cm, "kind"), "ConfigMap");
    let override_json: Value =
        serde_json::from_str(cm["data"]["custom_bootstrap.json"].as_str().unwrap()).unwrap();
    let local = ops::yaml_docs(&root().join("envoy/local.yaml")).remove(0);
    assert_eq!(
        policy_tag_regex(&override_json),
        policy_tag_regex(&local),
        "envoy/istio/stats-bootstrap.yaml must tag metrics as envoy/local.yaml does"
    );
}
