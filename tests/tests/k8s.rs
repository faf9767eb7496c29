#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! deploy/k8s: the limiter's Kubernetes manifests. Validated offline against the Kubernetes
//! OpenAPI schemas (the kubernetes-validate wheel bundles them; strict: unknown fields are
//! errors) for the oldest and newest Kubernetes versions we claim, then checked for what a
//! schema cannot see: probes on the limiter's endpoints, the security context, the policy
//! document the limiter loads equal to policies/, selectors that select, the Redis Cluster
//! overlay applying to the base.

mod ops;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use ops::{field, root, run, scratch, str_field, yaml_doc, yaml_docs};
use serde_json::{json, Value};

/// Oldest and newest Kubernetes versions the manifests are checked against.
const K8S_VERSIONS: [&str; 2] = ["1.29.0", "1.37.0"];

fn base() -> PathBuf {
    root().join("deploy/k8s/base")
}

/// Every manifest of the base (kustomization.yaml is kustomize's, not the API server's).
fn base_manifests() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(base())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    files
}

fn kubernetes_validate(version: &str, files: &[PathBuf]) -> (bool, String) {
    let mut cmd = Command::new(ops::tool("kubernetes-validate"));
    cmd.args(["--strict", "-k", version]).args(files);
    let out = run(cmd);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The base Deployment with the redis-cluster overlay's JSON patch applied (its `test` and
/// `replace` operations, as kustomize applies them).
fn overlay_deployment() -> Value {
    let mut deployment = yaml_doc(&base().join("deployment.yaml"));
    let patch = yaml_doc(&root().join("deploy/k8s/redis-cluster/redis-cluster-patch.yaml"));
    for op in patch.as_array().unwrap() {
        let path = str_field(op, "path");
        let target = deployment
            .pointer_mut(path)
            .unwrap_or_else(|| panic!("overlay path {path} does not exist in the base"));
        match str_field(op, "op") {
            "test" => assert_eq!(
                *target, op["value"],
                "overlay `test` at {path} fails against the base"
            ),
            "replace" => *target = op["value"].clone(),
            other => panic!("overlay uses op {other}: teach this test about it"),
        }
    }
    deployment
}

#[test]
fn manifests_pass_the_kubernetes_openapi_schema() {
    let dir = scratch("k8s-overlay");
    let overlay = dir.join("deployment-redis-cluster.yaml");
    ops::write_json(&overlay, &overlay_deployment());
    let mut files = base_manifests();
    files.push(overlay);
    files.push(root().join("envoy/istio/stats-bootstrap.yaml"));
    let resources: usize = files.iter().map(|f| yaml_docs(f).len()).sum();
    assert!(resources >= 9, "expected every manifest, got {resources}");

    for version in K8S_VERSIONS {
        let (ok, report) = kubernetes_validate(version, &files);
        assert!(
            ok,
            "Kubernetes {version} schema validation failed:\n{report}"
        );
        assert!(
            !report.contains("Couldn't find schema"),
            "a kind has no schema (not validated):\n{report}"
        );
        assert_eq!(
            report.matches(" passed for resource ").count(),
            resources,
            "every resource must be validated:\n{report}"
        );
    }
}

#[test]
fn the_schema_check_rejects_broken_manifests() {
    let deployment = yaml_doc(&base().join("deployment.yaml"));
    let dir = scratch("k8s-broken");
    let cases: [(&str, &str, Value); 3] = [
        ("wrong type", "/spec/replicas", json!("three")),
        (
            "unknown field",
            "/spec/template/spec/containers/0/livenessProbe/httpGet/paht",
            json!("/healthz"),
        ),
        (
            "port name as number",
            "/spec/template/spec/containers/0/ports/0/containerPort",
            json!("http"),
        ),
    ];
    for (what, path, value) in cases {
        let mut broken = deployment.clone();
        let (parent, key) = path.rsplit_once('/').unwrap();
        broken.pointer_mut(parent).unwrap()[key] = value;
        let file = dir.join(format!("{}.yaml", what.replace(' ', "-")));
        ops::write_json(&file, &broken);
        let (ok, report) = kubernetes_validate(K8S_VERSIONS[1], &[file]);
        assert!(!ok, "a Deployment with a {what} passed:\n{report}");
    }
}

fn container(deployment: &Value) -> &Value {
    let containers = field(deployment, "spec.template.spec.containers")
        .as_array()
        .unwrap();
    assert_eq!(containers.len(), 1, "one container: the limiter");
    &containers[0]
}

fn env(c: &Value, name: &str) -> Option<Value> {
    c["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .cloned()
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    let sel = selector.as_object().unwrap();
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn deployment_is_shaped_for_production() {
    let d = yaml_doc(&base().join("deployment.yaml"));
    let pod_labels = field(&d, "spec.template.metadata.labels");
    assert!(field(&d, "spec.replicas").as_u64().unwrap() >= 2);
    assert!(labels_match(
        field(&d, "spec.selector.matchLabels"),
        pod_labels
    ));
    let c = container(&d);

    // Listens where the Service and the probes look.
    let port = &c["ports"][0];
    assert_eq!(port["name"], "http");
    assert_eq!(port["containerPort"], 8081);
    assert_eq!(
        env(c, "TOLLGATE_LISTEN").unwrap()["value"],
        "0.0.0.0:8081",
        "the limiter's default listen address is loopback: it must be set for a pod"
    );
    assert_eq!(str_field(c, "livenessProbe.httpGet.path"), "/healthz");
    assert_eq!(str_field(c, "readinessProbe.httpGet.path"), "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "http");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "http");

    // Store from a Secret, never inline.
    let redis = env(c, "TOLLGATE_REDIS").expect("TOLLGATE_REDIS");
    assert!(
        redis.get("value").is_none(),
        "the Redis URL must come from a Secret"
    );
    assert_eq!(
        str_field(&redis, "valueFrom.secretKeyRef.name"),
        "tollgate-redis"
    );
    assert!(
        c.get("args").is_none() && c.get("command").is_none(),
        "configuration by env: no credentials on the command line"
    );

    // Policies from the ConfigMap mounted as a directory (updates reach the pod).
    let policies = env(c, "TOLLGATE_POLICIES").unwrap();
    let policy_path = Path::new(policies["value"].as_str().unwrap());
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "policies")
        .expect("policies volume mount");
    assert!(
        mount.get("subPath").is_none(),
        "subPath mounts never update"
    );
    assert_eq!(mount["readOnly"], true);
    assert_eq!(
        policy_path.parent().unwrap(),
        Path::new(str_field(mount, "mountPath"))
    );
    let volume = field(&d, "spec.template.spec.volumes")
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "policies")
        .unwrap();
    let cm = yaml_doc(&base().join("policies-configmap.yaml"));
    assert_eq!(
        str_field(volume, "configMap.name"),
        str_field(&cm, "metadata.name")
    );
    let key = policy_path.file_name().unwrap().to_str().unwrap();
    assert!(
        cm["data"].get(key).is_some(),
        "the limiter loads {key}, which the ConfigMap does not have"
    );

    // Resources and security.
    for r in ["requests.cpu", "requests.memory", "limits.memory"] {
        assert!(
            c["resources"]
                .pointer(&format!("/{}", r.replace('.', "/")))
                .is_some(),
            "resources.{r} must be set"
        );
    }
    let pod_sc = field(&d, "spec.template.spec.securityContext");
    assert_eq!(pod_sc["runAsNonRoot"], true);
    assert!(pod_sc["runAsUser"].as_u64().unwrap() > 0);
    assert_eq!(pod_sc["seccompProfile"]["type"], "RuntimeDefault");
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(
        field(&d, "spec.template.spec.automountServiceAccountToken"),
        false
    );

    // Scrape annotations point at the metrics endpoint.
    let ann = field(&d, "spec.template.metadata.annotations");
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann["prometheus.io/port"], "8081");
    assert_eq!(ann["prometheus.io/path"], "/metrics");

    // The Service and the PodDisruptionBudget select these pods.
    let svc = yaml_doc(&base().join("service.yaml"));
    assert!(labels_match(field(&svc, "spec.selector"), pod_labels));
    assert_eq!(svc["spec"]["ports"][0]["port"], 8081);
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "http");
    let pdb = yaml_doc(&base().join("poddisruptionbudget.yaml"));
    assert!(labels_match(
        field(&pdb, "spec.selector.matchLabels"),
        pod_labels
    ));
    assert!(
        pdb["spec"]["maxUnavailable"].as_u64().unwrap()
            < field(&d, "spec.replicas").as_u64().unwrap(),
        "the PDB must keep a replica up"
    );
}

#[test]
fn policies_configmap_holds_the_policy_files_byte_for_byte() {
    let cm = yaml_doc(&base().join("policies-configmap.yaml"));
    let data = cm["data"].as_object().unwrap();
    for file in ["payments.json", "payments-global.json"] {
        let expected = std::fs::read_to_string(root().join("policies").join(file)).unwrap();
        assert_eq!(
            data.get(file).and_then(Value::as_str),
            Some(expected.as_str()),
            "deploy/k8s/base/policies-configmap.yaml is stale for {file}: run `just k8s-policies`"
        );
    }
    // And the committed file is exactly what the generator writes now.
    let out = scratch("k8s-policies").join("policies-configmap.yaml");
    let mut cmd = ops::py_tool("render-k8s-policies", &[]);
    cmd.arg("--out").arg(&out);
    ops::run_ok(cmd);
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        std::fs::read_to_string(base().join("policies-configmap.yaml")).unwrap(),
        "run `just k8s-policies`"
    );
}

#[test]
fn redis_cluster_overlay_swaps_the_store() {
    let d = overlay_deployment();
    let c = container(&d);
    assert!(
        env(c, "TOLLGATE_REDIS").is_none(),
        "--redis and --redis-cluster conflict"
    );
    let cluster = env(c, "TOLLGATE_REDIS_CLUSTER").expect("TOLLGATE_REDIS_CLUSTER");
    assert_eq!(
        str_field(&cluster, "valueFrom.secretKeyRef.name"),
        "tollgate-redis"
    );
    assert_eq!(
        str_field(&cluster, "valueFrom.secretKeyRef.key"),
        "cluster-urls"
    );
    let example = yaml_doc(&base().join("redis-secret.example.yaml"));
    assert!(example["stringData"]["cluster-urls"].is_string());
    assert!(example["stringData"]["url"].is_string());

    // Where kubectl is installed, its kustomize must build the same Deployment.
    if let Some(kubectl) = tollgate_e2e::paths::which("kubectl") {
        let mut cmd = Command::new(kubectl);
        cmd.arg("kustomize")
            .arg(root().join("deploy/k8s/redis-cluster"));
        let dir = scratch("kustomize");
        let built = dir.join("built.yaml");
        std::fs::write(&built, ops::run_ok(cmd)).unwrap();
        let from_kustomize = yaml_docs(&built)
            .into_iter()
            .find(|doc| doc["kind"] == "Deployment")
            .unwrap();
        assert_eq!(from_kustomize, d);
    } else {
        eprintln!("kubectl not installed: kustomize cross-check skipped");
    }
}

#[test]
fn kustomizations_list_every_manifest() {
    let k = yaml_doc(&base().join("kustomization.yaml"));
    let listed: BTreeSet<String> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let present: BTreeSet<String> = base_manifests()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .filter(|f| f != "redis-secret.example.yaml")
        .collect();
    assert_eq!(listed, present);
    let overlay = yaml_doc(&root().join("deploy/k8s/redis-cluster/kustomization.yaml"));
    assert_eq!(overlay["resources"], json!(["../base"]));
    assert_eq!(
        str_field(&overlay["patches"][0], "path"),
        "redis-cluster-patch.yaml"
    );
}
