#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! deploy/envoy-gateway/: the EnvoyExtensionPolicy that loads the filter into Envoy Gateway's
//! Envoys. No schema package of Envoy Gateway's CRDs is available offline, so the fields of
//! `gateway.envoyproxy.io/v1alpha1` EnvoyExtensionPolicy that the manifest uses are checked
//! here by name, type and allowed values (spec.targetRefs, spec.wasm[].name / rootID / failOpen
//! / code.type Image|HTTP with the matching image.url or http.url / config), unknown fields are
//! refused, and the checker is shown to refuse broken copies. Its `config` must be
//! policies/payments.json exactly and a policy document the filter accepts; its image the tag
//! `just oci` gives.

mod ops;

use ops::{field, filter_version, json_file, root, str_field, yaml_docs};
use serde_json::{json, Value};

const MANIFEST: &str = "deploy/envoy-gateway/extensionpolicy.yaml";

/// What the manifest's fields may be, per the EnvoyExtensionPolicy API (v1alpha1).
fn problems(doc: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let only = |v: &Value, path: &str, known: &[&str], out: &mut Vec<String>| match v.as_object() {
        Some(map) => {
            for k in map.keys().filter(|k| !known.contains(&k.as_str())) {
                out.push(format!(
                    "{}/{k}: not a field of EnvoyExtensionPolicy",
                    path.trim_end_matches('/')
                ));
            }
        }
        None => out.push(format!("{path}: not an object")),
    };
    let text = |v: &Value, path: &str, out: &mut Vec<String>| match v.pointer(path) {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        _ => {
            out.push(format!("{path}: a non-empty string is required"));
            None
        }
    };
    only(
        doc,
        "",
        &["apiVersion", "kind", "metadata", "spec"],
        &mut out,
    );
    if doc["apiVersion"] != "gateway.envoyproxy.io/v1alpha1" {
        out.push("apiVersion: must be gateway.envoyproxy.io/v1alpha1".into());
    }
    if doc["kind"] != "EnvoyExtensionPolicy" {
        out.push("kind: must be EnvoyExtensionPolicy".into());
    }
    text(doc, "/metadata/name", &mut out);
    let spec = &doc["spec"];
    only(
        spec,
        "/spec",
        &[
            "targetRef",
            "targetRefs",
            "targetSelectors",
            "mergeType",
            "wasm",
            "extProc",
            "lua",
        ],
        &mut out,
    );
    match spec["targetRefs"].as_array() {
        Some(refs) if !refs.is_empty() => {
            for (i, r) in refs.iter().enumerate() {
                let path = format!("/spec/targetRefs/{i}");
                only(
                    r,
                    &path,
                    &["group", "kind", "name", "sectionName"],
                    &mut out,
                );
                if r["group"] != "gateway.networking.k8s.io" {
                    out.push(format!("{path}/group: must be gateway.networking.k8s.io"));
                }
                let kinds = [
                    "Gateway",
                    "HTTPRoute",
                    "GRPCRoute",
                    "UDPRoute",
                    "TCPRoute",
                    "TLSRoute",
                ];
                if !r["kind"].as_str().is_some_and(|k| kinds.contains(&k)) {
                    out.push(format!("{path}/kind: one of {kinds:?}"));
                }
                text(doc, &format!("{path}/name"), &mut out);
            }
        }
        _ => out.push("/spec/targetRefs: at least one target is required".into()),
    }
    match spec["wasm"].as_array() {
        Some(list) if !list.is_empty() && list.len() <= 16 => {
            for (i, w) in list.iter().enumerate() {
                let path = format!("/spec/wasm/{i}");
                only(
                    w,
                    &path,
                    &["name", "rootID", "code", "config", "failOpen", "env"],
                    &mut out,
                );
                for name in ["name", "rootID"] {
                    if !w.get(name).map_or(true, Value::is_string) {
                        out.push(format!("{path}/{name}: must be a string"));
                    }
                }
                if !w.get("failOpen").map_or(true, Value::is_boolean) {
                    out.push(format!("{path}/failOpen: must be true or false"));
                }
                if !w.get("config").map_or(true, Value::is_object) {
                    out.push(format!("{path}/config: must be a JSON object"));
                }
                let code = &w["code"];
                only(
                    code,
                    &format!("{path}/code"),
                    &["type", "http", "image", "configMap", "sha256", "pullPolicy"],
                    &mut out,
                );
                match code["type"].as_str() {
                    Some("Image") => {
                        if code.get("http").is_some() {
                            out.push(format!("{path}/code/http: only with type HTTP"));
                        }
                        only(
                            &code["image"],
                            &format!("{path}/code/image"),
                            &["url", "pullSecretRef"],
                            &mut out,
                        );
                        text(doc, &format!("{path}/code/image/url"), &mut out);
                    }
                    Some("HTTP") => {
                        if code.get("image").is_some() {
                            out.push(format!("{path}/code/image: only with type Image"));
                        }
                        only(
                            &code["http"],
                            &format!("{path}/code/http"),
                            &["url"],
                            &mut out,
                        );
                        text(doc, &format!("{path}/code/http/url"), &mut out);
                    }
                    _ => out.push(format!("{path}/code/type: Image or HTTP")),
                }
                if let Some(sha) = code.get("sha256") {
                    let hex = sha.as_str().unwrap_or("");
                    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                        out.push(format!("{path}/code/sha256: 64 hex digits"));
                    }
                }
            }
        }
        _ => out.push("/spec/wasm: 1 to 16 extensions".into()),
    }
    out
}

fn manifest() -> Value {
    let docs = yaml_docs(&root().join(MANIFEST));
    assert_eq!(docs.len(), 1, "{MANIFEST} holds one resource");
    docs.into_iter().next().unwrap()
}

#[test]
fn the_manifest_has_the_fields_of_an_envoy_extension_policy() {
    let doc = manifest();
    assert_eq!(problems(&doc), Vec::<String>::new(), "{doc:#}");
    let wasm = field(&doc, "spec.wasm.0");
    assert_eq!(str_field(wasm, "code.type"), "Image");
    assert_eq!(str_field(wasm, "rootID"), "tollgate");
    assert_eq!(field(wasm, "failOpen"), &json!(false));
    assert_eq!(str_field(&doc, "spec.targetRefs.0.kind"), "Gateway");
}

#[test]
fn the_image_is_the_one_just_oci_tags() {
    let url = str_field(&manifest(), "spec.wasm.0.code.image.url").to_string();
    assert_eq!(
        url,
        format!(
            "registry.example.com/platform/tollgate:{}",
            filter_version()
        ),
        "the tag must be the filter's version, the tag `just oci` gives the image"
    );
    assert!(
        !url.contains("://"),
        "an image reference has no scheme: {url}"
    );
    let text = std::fs::read_to_string(root().join(MANIFEST)).unwrap();
    assert!(
        text.contains(&format!(
            "docker://registry.example.com/platform/tollgate:{}",
            filter_version()
        )),
        "the push command in the comment names the same image"
    );
}

#[test]
fn the_config_is_the_shipped_policy_document_and_the_filter_accepts_it() {
    let config = field(&manifest(), "spec.wasm.0.config").clone();
    assert_eq!(
        config,
        json_file(&root().join("policies/payments.json")),
        "config must be policies/payments.json exactly"
    );
    let bytes = serde_json::to_vec(&config).unwrap();
    let policies = tollgate_core::policy::Policies::from_json(&bytes)
        .unwrap_or_else(|e| panic!("the filter refuses the config: {e:?}"));
    drop(policies);
    // No global policy: this resource creates no limiter cluster for `limiter.cluster`.
    for p in config["policies"].as_array().unwrap() {
        assert_eq!(p["scope"], "local", "{p}");
    }
    assert!(config.get("limiter").is_none());
}

#[test]
fn the_checker_refuses_broken_manifests() {
    let good = manifest();
    type Breaks = fn(&mut Value);
    let broken: [(&str, Breaks); 7] = [
        ("a typo'd field", |d| {
            d["spec"]["wasm"][0]["failOpne"] = json!(false);
        }),
        ("an unknown code type", |d| {
            d["spec"]["wasm"][0]["code"]["type"] = json!("OCI");
        }),
        ("an Image without its url", |d| {
            d["spec"]["wasm"][0]["code"]["image"] = json!({});
        }),
        ("a string for failOpen", |d| {
            d["spec"]["wasm"][0]["failOpen"] = json!("no");
        }),
        ("config as text", |d| {
            d["spec"]["wasm"][0]["config"] = json!("{\"policies\": []}");
        }),
        ("no target", |d| {
            d["spec"]["targetRefs"] = json!([]);
        }),
        ("a bad sha256", |d| {
            d["spec"]["wasm"][0]["code"]["sha256"] = json!("sha256:abc");
        }),
    ];
    for (what, breaks) in broken {
        let mut doc = good.clone();
        breaks(&mut doc);
        assert!(!problems(&doc).is_empty(), "{what} passed the check");
    }
    let mut typo = good.clone();
    typo["spec"]["wasm"][0]["failOpne"] = json!(false);
    assert_eq!(
        problems(&typo),
        vec!["/spec/wasm/0/failOpne: not a field of EnvoyExtensionPolicy".to_string()]
    );
}
