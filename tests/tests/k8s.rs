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
//! document the limiter loads equal to policies/, selectors that select, the overlays
//! (redis-cluster, istio) applying to the base, and the production security setup: mutual TLS
//! on the lease listener, TLS to Redis, every credential a read-only file from a Secret and
//! none in the environment or arguments, NetworkPolicies that admit only the documented
//! callers on the documented ports.
//!
//! The overlays are built here from their kustomization.yaml (resources, and JSON 6902
//! patches applied as kustomize applies them), so the checks run without kubectl; where
//! kubectl is installed, its kustomize must build exactly the same resources.

mod ops;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use ops::{field, root, run, scratch, str_field, yaml_doc, yaml_docs};
use serde_json::{json, Value};

/// Oldest and newest Kubernetes versions the manifests are checked against.
const K8S_VERSIONS: [&str; 2] = ["1.29.0", "1.37.0"];

/// The label that admits a gateway's pods to the limiter (networkpolicy-limiter.yaml, and the
/// book's docs/src/deploy/kubernetes.md).
const GATEWAY_LABEL: (&str, &str) = ("tollgate.io/gateway", "true");

/// The limiter's admin listener (/healthz, /readyz, /metrics; plaintext).
const ADMIN_PORT: u64 = 9090;

/// The overlays of deploy/k8s, each built on the base (or, for istio, on either).
const OVERLAYS: [&str; 2] = ["redis-cluster", "istio"];

fn k8s_dir() -> PathBuf {
    root().join("deploy/k8s")
}

fn base() -> PathBuf {
    k8s_dir().join("base")
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

fn is_example(file: &Path) -> bool {
    file.to_string_lossy().ends_with(".example.yaml")
}

/// The example Secrets (`*.example.yaml` of the base): what the operator creates.
fn example_secrets() -> Vec<Value> {
    let secrets: Vec<Value> = base_manifests()
        .iter()
        .filter(|f| is_example(f))
        .flat_map(|f| yaml_docs(f))
        .collect();
    assert!(secrets.iter().all(|s| s["kind"] == "Secret"));
    secrets
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

// --- kustomize, as far as these kustomizations use it ---------------------------------------

/// A JSON pointer's parent and its last token, unescaped (`~1` is `/`, `~0` is `~`).
fn split_pointer(path: &str) -> (&str, String) {
    let (parent, last) = path.rsplit_once('/').unwrap();
    (parent, last.replace("~1", "/").replace("~0", "~"))
}

/// Applies a JSON 6902 patch (the operations these overlays use: test, replace, add, remove).
fn apply_json_patch(doc: &mut Value, patch: &Value, what: &str) {
    for op in patch.as_array().unwrap() {
        let path = str_field(op, "path");
        match str_field(op, "op") {
            "test" => {
                let target = doc
                    .pointer(path)
                    .unwrap_or_else(|| panic!("{what}: `test` path {path} does not exist"));
                assert_eq!(*target, op["value"], "{what}: `test` at {path} fails");
            }
            "replace" => {
                let target = doc
                    .pointer_mut(path)
                    .unwrap_or_else(|| panic!("{what}: `replace` path {path} does not exist"));
                *target = op["value"].clone();
            }
            "add" => {
                let (parent, key) = split_pointer(path);
                match doc.pointer_mut(parent) {
                    Some(Value::Object(map)) => {
                        map.insert(key, op["value"].clone());
                    }
                    Some(Value::Array(items)) if key == "-" => items.push(op["value"].clone()),
                    Some(Value::Array(items)) => {
                        items.insert(key.parse::<usize>().unwrap(), op["value"].clone())
                    }
                    _ => panic!("{what}: `add` parent {parent} does not exist"),
                }
            }
            "remove" => {
                let (parent, key) = split_pointer(path);
                let removed = match doc.pointer_mut(parent) {
                    Some(Value::Object(map)) => map.remove(&key),
                    Some(Value::Array(items)) => {
                        let i = key.parse::<usize>().unwrap();
                        (i < items.len()).then(|| items.remove(i))
                    }
                    _ => None,
                };
                assert!(
                    removed.is_some(),
                    "{what}: `remove` path {path} does not exist"
                );
            }
            other => panic!("{what} uses op {other}: teach this test about it"),
        }
    }
}

fn kustomization(dir: &Path) -> Value {
    yaml_doc(&dir.join("kustomization.yaml"))
}

/// Whether a kustomize patch target names this resource.
fn targets(target: &Value, resource: &Value) -> bool {
    let api = str_field(resource, "apiVersion");
    let (group, version) = api.rsplit_once('/').unwrap_or(("", api));
    [
        ("group", group),
        ("version", version),
        ("kind", str_field(resource, "kind")),
        ("name", str_field(resource, "metadata.name")),
        (
            "namespace",
            resource["metadata"]["namespace"].as_str().unwrap_or(""),
        ),
    ]
    .iter()
    .all(|(k, v)| target.get(*k).map_or(true, |t| t == v))
}

/// Applies the `patches` of the kustomization in `dir` to `resources`; each patch must target
/// exactly one resource.
fn apply_patches(dir: &Path, mut resources: Vec<Value>) -> Vec<Value> {
    let k = kustomization(dir);
    for p in k["patches"].as_array().into_iter().flatten() {
        let file = str_field(p, "path");
        let patch = yaml_doc(&dir.join(file));
        let mut hits = resources.iter_mut().filter(|r| targets(&p["target"], r));
        let target = hits
            .next()
            .unwrap_or_else(|| panic!("{file}: its target selects no resource"));
        apply_json_patch(target, &patch, file);
        assert!(hits.next().is_none(), "{file}: its target selects several");
    }
    resources
}

/// The resources `kubectl kustomize <dir>` builds.
fn build(dir: &Path) -> Vec<Value> {
    let k = kustomization(dir);
    let mut resources = Vec::new();
    for r in k["resources"].as_array().unwrap() {
        let path = dir.join(r.as_str().unwrap());
        if path.is_dir() {
            resources.extend(build(&path));
        } else {
            resources.extend(yaml_docs(&path));
        }
    }
    apply_patches(dir, resources)
}

fn build_named(name: &str) -> Vec<Value> {
    build(&k8s_dir().join(name))
}

/// The istio overlay's patches over the redis-cluster overlay (what its comment suggests for
/// a Redis Cluster in the mesh).
fn istio_over_redis_cluster() -> Vec<Value> {
    apply_patches(&k8s_dir().join("istio"), build_named("redis-cluster"))
}

/// Every build a user can apply, by name.
fn all_builds() -> Vec<(&'static str, Vec<Value>)> {
    vec![
        ("base", build(&base())),
        ("redis-cluster", build_named("redis-cluster")),
        ("istio", build_named("istio")),
        ("istio over redis-cluster", istio_over_redis_cluster()),
    ]
}

fn find<'a>(resources: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let mut hits = resources
        .iter()
        .filter(|r| r["kind"] == kind && r["metadata"]["name"] == name);
    let hit = hits
        .next()
        .unwrap_or_else(|| panic!("no {kind} {name} in the build"));
    assert!(hits.next().is_none(), "two {kind} {name} in the build");
    hit
}

fn deployment(resources: &[Value]) -> &Value {
    find(resources, "Deployment", "tollgate-limiter")
}

fn resource_key(r: &Value) -> String {
    format!(
        "{}/{}/{}",
        str_field(r, "kind"),
        r["metadata"]["namespace"].as_str().unwrap_or(""),
        str_field(r, "metadata.name")
    )
}

// --- the limiter's container ------------------------------------------------------------------

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

/// A limiter setting, given as its flag (`--flag value` or `--flag=value` in args) or its
/// environment variable (a plain value).
fn setting(c: &Value, flag: &str, var: &str) -> Option<String> {
    let args: Vec<&str> = c["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for (i, arg) in args.iter().enumerate() {
        if let Some(v) = arg.strip_prefix(&format!("{flag}=")) {
            return Some(v.to_string());
        }
        if *arg == flag {
            return args.get(i + 1).map(|v| v.to_string());
        }
    }
    env(c, var).map(|e| {
        e["value"]
            .as_str()
            .unwrap_or_else(|| panic!("{var} must be a plain value (a file path): {e}"))
            .to_string()
    })
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    let sel = selector.as_object().unwrap();
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// The Secret (name, key) whose file `path` is, through the Deployment's volume mounts:
/// panics unless `path` is a key of a Secret volume, mounted read-only as a directory.
fn secret_file(d: &Value, path: &str) -> (String, String) {
    let c = container(d);
    let path = Path::new(path);
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| path.parent() == Some(Path::new(str_field(m, "mountPath"))))
        .unwrap_or_else(|| panic!("{} is not in a mounted directory", path.display()));
    assert_eq!(mount["readOnly"], true, "{mount} must be read-only");
    assert!(
        mount.get("subPath").is_none(),
        "subPath mounts never update"
    );
    let volume = field(d, "spec.template.spec.volumes")
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let secret = volume
        .get("secret")
        .unwrap_or_else(|| panic!("{} must come from a Secret volume", path.display()));
    let file = path.file_name().unwrap().to_str().unwrap();
    let item = secret["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["path"] == file)
        .unwrap_or_else(|| panic!("the Secret volume {volume} has no item {file}"));
    (
        str_field(secret, "secretName").to_string(),
        str_field(item, "key").to_string(),
    )
}

/// Every string of the container's env values, args and command.
fn container_strings(c: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for e in c["env"].as_array().into_iter().flatten() {
        if let Some(v) = e["value"].as_str() {
            out.push(v.to_string());
        }
    }
    for key in ["args", "command"] {
        for v in c[key].as_array().into_iter().flatten() {
            out.push(v.as_str().unwrap().to_string());
        }
    }
    out
}

/// host and port of a `redis://` or `rediss://` URL; panics on credentials in it.
fn redis_host_port(url: &str) -> (String, u16) {
    let rest = url
        .strip_prefix("rediss://")
        .unwrap_or_else(|| panic!("{url}: Redis must be reached over TLS (rediss://)"));
    let authority = rest.split('/').next().unwrap();
    assert!(
        !authority.contains('@'),
        "{url}: no credentials in the URL (the password is a file)"
    );
    let (host, port) = authority.rsplit_once(':').unwrap();
    (host.to_string(), port.parse().unwrap())
}

/// The Redis URLs the limiter connects to (one server, or the cluster's seed nodes).
fn redis_urls(c: &Value) -> Vec<String> {
    let single = setting(c, "--redis", "TOLLGATE_REDIS");
    let cluster = setting(c, "--redis-cluster", "TOLLGATE_REDIS_CLUSTER");
    match (single, cluster) {
        (Some(url), None) => vec![url],
        (None, Some(urls)) => urls.split(',').map(str::to_string).collect(),
        other => panic!("exactly one of --redis and --redis-cluster: {other:?}"),
    }
}

// --- schemas ----------------------------------------------------------------------------------

#[test]
fn manifests_pass_the_kubernetes_openapi_schema() {
    let dir = scratch("k8s-overlays");
    let mut files = base_manifests();
    // Every resource of every overlay build, as kustomize would hand it to the API server.
    for (name, resources) in all_builds().into_iter().skip(1) {
        for (i, r) in resources.iter().enumerate() {
            let file = dir.join(format!("{}-{i}.yaml", name.replace(' ', "-")));
            ops::write_json(&file, r);
            files.push(file);
        }
    }
    files.push(root().join("envoy/istio/stats-bootstrap.yaml"));
    let resources: usize = files.iter().map(|f| yaml_docs(f).len()).sum();
    // 9 resources and 4 example Secrets in the base, 9 in each of the 3 overlay builds, the
    // Istio bootstrap ConfigMap.
    assert!(
        resources >= 41,
        "expected every manifest and every overlay's build, got {resources}"
    );

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
    let policy = yaml_doc(&base().join("networkpolicy-limiter.yaml"));
    let dir = scratch("k8s-broken");
    let cases: [(&str, &Value, &str, Value); 6] = [
        ("wrong type", &deployment, "/spec/replicas", json!("three")),
        (
            "unknown field",
            &deployment,
            "/spec/template/spec/containers/0/livenessProbe/httpGet/paht",
            json!("/healthz"),
        ),
        (
            "port name as number",
            &deployment,
            "/spec/template/spec/containers/0/ports/0/containerPort",
            json!("http"),
        ),
        (
            "mode as text",
            &deployment,
            "/spec/template/spec/volumes/2/secret/defaultMode",
            json!("0440"),
        ),
        (
            "policy unknown field",
            &policy,
            "/spec/ingress/0/form",
            json!([]),
        ),
        (
            "policy protocol as number",
            &policy,
            "/spec/ingress/0/ports/0/protocol",
            json!(6),
        ),
    ];
    for (what, doc, path, value) in cases {
        let mut broken = doc.clone();
        let (parent, key) = path.rsplit_once('/').unwrap();
        broken.pointer_mut(parent).unwrap()[key] = value;
        let file = dir.join(format!("{}.yaml", what.replace(' ', "-")));
        ops::write_json(&file, &broken);
        let (ok, report) = kubernetes_validate(K8S_VERSIONS[1], &[file]);
        assert!(!ok, "a manifest with a {what} passed:\n{report}");
    }
}

// --- the Deployment ---------------------------------------------------------------------------

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

    // Listens where the Service looks; probes and metrics on the admin listener.
    let port = &c["ports"][0];
    assert_eq!(port["name"], "http");
    assert_eq!(port["containerPort"], 8081);
    assert_eq!(
        env(c, "TOLLGATE_LISTEN").unwrap()["value"],
        "0.0.0.0:8081",
        "the limiter's default listen address is loopback: it must be set for a pod"
    );
    let admin = &c["ports"][1];
    assert_eq!(admin["name"], "admin");
    assert_eq!(admin["containerPort"], ADMIN_PORT);
    assert_eq!(
        setting(c, "--admin-listen", "TOLLGATE_ADMIN_LISTEN").as_deref(),
        Some(format!("0.0.0.0:{ADMIN_PORT}").as_str()),
        "the admin listener must listen on the pod's address, on the admin port"
    );
    // The lease port requires a client certificate the kubelet does not have: the probes go to
    // the admin listener (plaintext, health and metrics only).
    assert_eq!(str_field(c, "livenessProbe.httpGet.path"), "/healthz");
    assert_eq!(str_field(c, "readinessProbe.httpGet.path"), "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "admin");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "admin");
    assert!(
        c.get("args").is_none() && c.get("command").is_none(),
        "configuration by env (the image's entrypoint is the limiter)"
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

    // Scrape annotations point at the metrics endpoint of the admin listener (plaintext: the
    // scraper needs no client certificate).
    let ann = field(&d, "spec.template.metadata.annotations");
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann["prometheus.io/port"], ADMIN_PORT.to_string());
    assert_eq!(ann["prometheus.io/path"], "/metrics");
    assert!(
        ann.get("prometheus.io/scheme").is_none(),
        "plaintext: {ann}"
    );

    // The Service and the PodDisruptionBudget select these pods.
    let svc = yaml_doc(&base().join("service.yaml"));
    assert!(labels_match(field(&svc, "spec.selector"), pod_labels));
    assert_eq!(svc["spec"]["ports"][0]["port"], 8081);
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "http");
    assert_eq!(
        svc["spec"]["ports"][0]["appProtocol"], "https",
        "the port speaks TLS: appProtocol must not claim plaintext HTTP/2"
    );
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
fn the_lease_listener_requires_client_certificates_and_redis_is_tls() {
    let secrets = example_secrets();
    let secret_keys = |name: &str| -> BTreeSet<String> {
        let s = secrets
            .iter()
            .find(|s| s["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no example for the Secret {name}"));
        s["stringData"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect()
    };
    for (name, resources) in [
        ("base", build(&base())),
        ("redis-cluster", build_named("redis-cluster")),
    ] {
        let d = deployment(&resources);
        let c = container(d);
        // TLS, so no consent to a plaintext lease port (the binary refuses the two together).
        assert_eq!(
            setting(c, "--insecure-plaintext", "TOLLGATE_INSECURE_PLAINTEXT"),
            None,
            "{name}"
        );
        // Mutual TLS: the listener's certificate and key, and the CA that signs the callers'
        // certificates, each a key of its example Secret, mounted as files.
        for (flag, var, secret) in [
            ("--tls-cert", "TOLLGATE_TLS_CERT", "tollgate-limiter-tls"),
            ("--tls-key", "TOLLGATE_TLS_KEY", "tollgate-limiter-tls"),
            (
                "--tls-client-ca",
                "TOLLGATE_TLS_CLIENT_CA",
                "tollgate-gateway-ca",
            ),
        ] {
            let path = setting(c, flag, var)
                .unwrap_or_else(|| panic!("{name}: the limiter must get {flag} ({var})"));
            let (secret_name, key) = secret_file(d, &path);
            assert_eq!(secret_name, secret, "{name}: {flag}");
            assert!(
                secret_keys(&secret_name).contains(&key),
                "{name}: {flag} reads key {key}, which the example {secret_name} lacks"
            );
        }
        // Who may call: explicit identities, no wildcard.
        let allow = setting(c, "--tls-allow", "TOLLGATE_TLS_ALLOW")
            .unwrap_or_else(|| panic!("{name}: an allow-list of client identities"));
        let ids: Vec<&str> = allow.split(',').collect();
        assert!(
            ids.iter()
                .all(|id| !id.trim().is_empty() && !id.contains('*')),
            "{name}: --tls-allow {allow}"
        );

        // Redis over TLS with a client certificate, an ACL user and a password file.
        for url in redis_urls(c) {
            redis_host_port(&url);
        }
        for (flag, var, secret) in [
            ("--redis-ca", "TOLLGATE_REDIS_CA", "tollgate-redis-tls"),
            (
                "--redis-client-cert",
                "TOLLGATE_REDIS_CLIENT_CERT",
                "tollgate-redis-tls",
            ),
            (
                "--redis-client-key",
                "TOLLGATE_REDIS_CLIENT_KEY",
                "tollgate-redis-tls",
            ),
            (
                "--redis-password-file",
                "TOLLGATE_REDIS_PASSWORD_FILE",
                "tollgate-redis",
            ),
        ] {
            let path = setting(c, flag, var)
                .unwrap_or_else(|| panic!("{name}: the limiter must get {flag} ({var})"));
            let (secret_name, key) = secret_file(d, &path);
            assert_eq!(secret_name, secret, "{name}: {flag}");
            assert!(
                secret_keys(&secret_name).contains(&key),
                "{name}: {flag} reads key {key}, which the example {secret_name} lacks"
            );
        }
        assert!(setting(c, "--redis-username", "TOLLGATE_REDIS_USERNAME").is_some());
    }
}

#[test]
fn no_secret_reaches_the_environment_or_the_arguments() {
    // The example Secrets hold placeholders only, never key material.
    let secrets = example_secrets();
    let mut secret_values = Vec::new();
    for s in &secrets {
        assert_eq!(s["metadata"]["namespace"], "tollgate");
        assert!(s.get("data").is_none(), "examples use readable stringData");
        for (key, v) in s["stringData"].as_object().unwrap() {
            let v = v.as_str().unwrap();
            assert!(
                v.starts_with("EXAMPLE") && !v.contains("-----BEGIN"),
                "{key} of the example {} must be a placeholder: {v}",
                s["metadata"]["name"]
            );
            secret_values.push(v.to_string());
        }
    }

    for (name, resources) in all_builds() {
        let d = deployment(&resources);
        let pod = field(d, "spec.template.spec");
        let containers = pod["containers"]
            .as_array()
            .unwrap()
            .iter()
            .chain(pod["initContainers"].as_array().into_iter().flatten());
        for c in containers {
            assert!(c.get("envFrom").is_none(), "{name}: no envFrom");
            for e in c["env"].as_array().into_iter().flatten() {
                assert!(
                    e.pointer("/valueFrom/secretKeyRef").is_none(),
                    "{name}: a Secret in the environment: {e}"
                );
            }
            assert!(
                env(c, "TOLLGATE_REDIS_PASSWORD").is_none(),
                "{name}: the Redis password is a file (TOLLGATE_REDIS_PASSWORD_FILE)"
            );
            for s in container_strings(c) {
                assert!(
                    !s.contains("-----BEGIN") && !s.contains("PRIVATE KEY"),
                    "{name}: key material in the pod spec: {s}"
                );
                for v in &secret_values {
                    assert!(!s.contains(v.as_str()), "{name}: {v:?} in the pod spec");
                }
                if let Some((_, rest)) = s.split_once("://") {
                    let authority = rest.split('/').next().unwrap();
                    assert!(
                        !authority.contains('@'),
                        "{name}: credentials in a URL: {s}"
                    );
                }
            }
            for url in redis_urls(c) {
                redis_host_port(&url);
            }
        }

        // Secret volumes: read-only to the limiter's user and group, nobody else; the group
        // (fsGroup) is what lets the non-root user read them.
        let volumes = pod["volumes"].as_array().unwrap();
        let secret_volumes: Vec<&Value> = volumes
            .iter()
            .filter(|v| v.get("secret").is_some())
            .collect();
        assert!(!secret_volumes.is_empty(), "{name}: Secret volumes");
        for v in &secret_volumes {
            let mode = v["secret"]["defaultMode"]
                .as_u64()
                .unwrap_or_else(|| panic!("{name}: {v} needs a defaultMode"));
            assert!(
                mode & !0o440 == 0 && mode & 0o400 != 0,
                "{name}: {} has mode {mode:o}: owner/group read-only at most",
                v["name"]
            );
            if mode & 0o040 != 0 {
                assert_eq!(
                    pod["securityContext"]["fsGroup"], pod["securityContext"]["runAsGroup"],
                    "{name}: group-readable Secret files need fsGroup = the limiter's group"
                );
            }
            let secret_name = str_field(v, "secret.secretName");
            let example = secrets
                .iter()
                .find(|s| s["metadata"]["name"] == secret_name)
                .unwrap_or_else(|| panic!("{name}: no example for the Secret {secret_name}"));
            for item in v["secret"]["items"].as_array().unwrap() {
                assert!(
                    example["stringData"].get(str_field(item, "key")).is_some(),
                    "{name}: {secret_name} has no key {item}"
                );
            }
            let mount = container(d)["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["name"] == v["name"])
                .unwrap_or_else(|| panic!("{name}: {} is not mounted", v["name"]));
            assert_eq!(mount["readOnly"], true, "{name}: {mount}");
            assert!(
                mount.get("subPath").is_none(),
                "{name}: subPath never updates"
            );
        }
    }
}

// --- NetworkPolicies --------------------------------------------------------------------------

/// What a NetworkPolicy admits: (source peer, port) pairs. Refuses the shapes that would admit
/// more than they seem to: a rule without sources or ports, IP blocks, a peer without a pod
/// selector, a port range.
fn admitted(policy: &Value) -> BTreeSet<(String, u64)> {
    let what = str_field(policy, "metadata.name");
    assert_eq!(
        policy["spec"]["policyTypes"],
        json!(["Ingress"]),
        "{what}: an ingress policy"
    );
    let mut out = BTreeSet::new();
    for rule in policy["spec"]["ingress"].as_array().into_iter().flatten() {
        let from = rule["from"]
            .as_array()
            .filter(|f| !f.is_empty())
            .unwrap_or_else(|| panic!("{what}: a rule without `from` admits every source"));
        let ports = rule["ports"]
            .as_array()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| panic!("{what}: a rule without `ports` admits every port"));
        for peer in from {
            assert!(peer.get("ipBlock").is_none(), "{what}: ipBlock {peer}");
            let pods = peer["podSelector"]["matchLabels"].as_object();
            assert!(
                pods.is_some_and(|l| !l.is_empty()),
                "{what}: every source must select pods by label: {peer}"
            );
            for port in ports {
                assert_eq!(port["protocol"], "TCP", "{what}: {port}");
                assert!(port.get("endPort").is_none(), "{what}: a port range");
                out.insert((peer.to_string(), port["port"].as_u64().unwrap()));
            }
        }
    }
    out
}

fn peer(namespace_selector: Option<Value>, pod_labels: Value) -> String {
    let mut p = json!({"podSelector": {"matchLabels": pod_labels}});
    if let Some(ns) = namespace_selector {
        p["namespaceSelector"] = ns;
    }
    p.to_string()
}

fn gateway_peer() -> String {
    let (k, v) = GATEWAY_LABEL;
    peer(Some(json!({})), json!({ k: v }))
}

fn prometheus_peer(policy: &Value) -> String {
    // The scraper's rule is the second; its selectors are the documented example.
    let p = &policy["spec"]["ingress"][1]["from"][0];
    assert_eq!(
        p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"], "monitoring",
        "{p}"
    );
    assert_eq!(
        p["podSelector"]["matchLabels"]["app.kubernetes.io/name"], "prometheus",
        "{p}"
    );
    p.to_string()
}

/// Checks the build's NetworkPolicies: default deny in the limiter's namespace, the limiter
/// admitting the gateways on the lease port and Prometheus on `prometheus_port` only, Redis
/// (in the namespace of the host the limiter connects to) admitting the limiter on Redis' port
/// only; returns the Redis policy for the caller to check its own pods' rules.
fn check_policies(name: &str, resources: &[Value], prometheus_port: u64) -> Value {
    let d = deployment(resources);
    let ns = str_field(d, "metadata.namespace");
    let pod_labels = field(d, "spec.template.metadata.labels");
    let policies: Vec<&Value> = resources
        .iter()
        .filter(|r| r["kind"] == "NetworkPolicy")
        .collect();
    let names: BTreeSet<&str> = policies
        .iter()
        .map(|p| str_field(p, "metadata.name"))
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["default-deny-ingress", "tollgate-limiter", "tollgate-redis"]),
        "{name}: the policies this test knows"
    );

    // Default deny: every pod of the namespace, no ingress at all.
    let deny = find(resources, "NetworkPolicy", "default-deny-ingress");
    assert_eq!(deny["metadata"]["namespace"], ns);
    assert_eq!(deny["spec"]["podSelector"], json!({}), "{name}: every pod");
    assert!(
        admitted(deny).is_empty(),
        "{name}: default deny admits nothing"
    );
    assert!(deny["spec"].get("ingress").is_none());

    // The limiter: gateways (any namespace, by label) on the lease port only; Prometheus on
    // its metrics port only (never the lease port).
    let limiter = find(resources, "NetworkPolicy", "tollgate-limiter");
    assert_eq!(limiter["metadata"]["namespace"], ns);
    assert!(
        labels_match(field(limiter, "spec.podSelector.matchLabels"), pod_labels),
        "{name}: the limiter's policy must select its pods"
    );
    let lease_port = container(d)["ports"][0]["containerPort"].as_u64().unwrap();
    assert_eq!(
        admitted(limiter),
        BTreeSet::from([
            (gateway_peer(), lease_port),
            (prometheus_peer(limiter), prometheus_port),
        ]),
        "{name}: only gateways reach the lease port, Prometheus its metrics"
    );

    // Redis: in the namespace of the host the limiter connects to, on its port.
    let redis = find(resources, "NetworkPolicy", "tollgate-redis").clone();
    let redis_ns = str_field(&redis, "metadata.namespace");
    let mut redis_ports = BTreeSet::new();
    for url in redis_urls(container(d)) {
        let (host, port) = redis_host_port(&url);
        let host_ns = host.split('.').rev().nth(3).unwrap_or_else(|| {
            panic!("{name}: {host} is not a <name>.<namespace>.svc.cluster.local name")
        });
        assert!(
            host.ends_with(&format!(".{redis_ns}.svc.cluster.local")),
            "{name}: the limiter connects to {host} (namespace {host_ns}), the policy is in {redis_ns}"
        );
        redis_ports.insert(u64::from(port));
    }
    let limiter_peer = peer(
        Some(json!({"matchLabels": {"kubernetes.io/metadata.name": ns}})),
        field(d, "spec.selector.matchLabels").clone(),
    );
    let from_limiter: BTreeSet<u64> = admitted(&redis)
        .into_iter()
        .filter(|(p, _)| *p == limiter_peer)
        .map(|(_, port)| port)
        .collect();
    assert_eq!(
        from_limiter, redis_ports,
        "{name}: the limiter's pods reach Redis' port, and only that"
    );
    redis
}

/// The Redis policy's own pods as a source (same namespace: no namespace selector).
fn redis_self_peer(redis: &Value) -> String {
    json!({"podSelector": field(redis, "spec.podSelector")}).to_string()
}

#[test]
fn network_policies_admit_only_the_documented_callers() {
    // Base: one Redis (replication and Sentinel between its pods).
    let resources = build(&base());
    let redis = check_policies("base", &resources, ADMIN_PORT);
    let d = deployment(&resources);
    let limiter_peer = peer(
        Some(json!({"matchLabels": {"kubernetes.io/metadata.name": "tollgate"}})),
        field(d, "spec.selector.matchLabels").clone(),
    );
    assert_eq!(
        redis["spec"]["podSelector"],
        json!({"matchLabels": {"app.kubernetes.io/name": "redis"}})
    );
    let own = redis_self_peer(&redis);
    assert_eq!(
        admitted(&redis),
        BTreeSet::from([
            (limiter_peer.clone(), 6379),
            (own.clone(), 6379),
            (own, 26379),
        ]),
        "base: Redis admits the limiter and its own pods, nothing else"
    );

    // Redis Cluster: the cluster's pods, and the cluster bus between them.
    let resources = build_named("redis-cluster");
    let redis = check_policies("redis-cluster", &resources, ADMIN_PORT);
    assert_eq!(
        redis["spec"]["podSelector"],
        json!({"matchLabels": {"app.kubernetes.io/name": "redis-cluster"}})
    );
    let own = redis_self_peer(&redis);
    assert_eq!(
        admitted(&redis),
        BTreeSet::from([(limiter_peer, 6379), (own.clone(), 6379), (own, 16379)]),
        "redis-cluster: the limiter on the data port, the nodes on data port and bus"
    );

    // Istio: Prometheus scrapes the sidecar's merged metrics instead of the lease port.
    check_policies("istio", &build_named("istio"), 15020);
    check_policies(
        "istio over redis-cluster",
        &istio_over_redis_cluster(),
        15020,
    );

    // The book's Kubernetes page tells gateway owners which label admits their pods.
    let page = "docs/src/deploy/kubernetes.md";
    let text = std::fs::read_to_string(root().join(page)).unwrap();
    let (k, v) = GATEWAY_LABEL;
    assert!(
        text.contains(&format!("{k}: \"{v}\"")),
        "{page} must document the gateway label {k}: \"{v}\""
    );
}

// --- overlays ---------------------------------------------------------------------------------

#[test]
fn redis_cluster_overlay_swaps_the_store() {
    let resources = build_named("redis-cluster");
    let c = container(deployment(&resources));
    assert!(
        env(c, "TOLLGATE_REDIS").is_none(),
        "--redis and --redis-cluster conflict"
    );
    let urls = redis_urls(c);
    assert!(urls.len() >= 3, "seed nodes: {urls:?}");
    let hosts: BTreeSet<(String, u16)> = urls.iter().map(|u| redis_host_port(u)).collect();
    assert_eq!(hosts.len(), urls.len(), "distinct seed nodes");
    // Everything else of the base is untouched.
    let base = build(&base());
    assert_eq!(resources.len(), base.len());
    for (b, o) in base.iter().zip(&resources) {
        if !(o["kind"] == "Deployment" || o["metadata"]["name"] == "tollgate-redis") {
            assert_eq!(b, o, "the overlay changed {}", resource_key(o));
        }
    }
}

#[test]
fn istio_overlay_runs_the_limiter_plaintext_behind_the_sidecar() {
    let base = build(&base());
    for (name, resources) in [
        ("istio", build_named("istio")),
        ("istio over redis-cluster", istio_over_redis_cluster()),
    ] {
        let d = deployment(&resources);
        let c = container(d);
        // No listener TLS: the sidecar terminates the mesh's mTLS.
        for e in c["env"].as_array().unwrap() {
            assert!(
                !str_field(e, "name").starts_with("TOLLGATE_TLS_"),
                "{name}: the limiter must listen in plaintext behind its sidecar: {e}"
            );
        }
        // ...on the pod address, which the limiter refuses without explicit consent.
        assert_eq!(
            setting(c, "--insecure-plaintext", "TOLLGATE_INSECURE_PLAINTEXT").as_deref(),
            Some("true"),
            "{name}: a plaintext lease port on 0.0.0.0 needs the operator's explicit consent"
        );
        assert!(
            !setting(c, "--listen", "TOLLGATE_LISTEN")
                .unwrap()
                .starts_with("127."),
            "{name}: the sidecar forwards to the pod address"
        );
        let secrets: BTreeSet<&str> = field(d, "spec.template.spec.volumes")
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.pointer("/secret/secretName").and_then(Value::as_str))
            .collect();
        assert_eq!(
            secrets,
            BTreeSet::from(["tollgate-redis", "tollgate-redis-tls"]),
            "{name}: only the Redis Secrets are mounted"
        );
        let mounts: BTreeSet<&str> = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| str_field(m, "name"))
            .collect();
        assert!(!mounts.contains("listener-tls") && !mounts.contains("gateway-ca"));
        // Redis keeps TLS, its client certificate and password file.
        for url in redis_urls(c) {
            redis_host_port(&url);
        }
        for (flag, var) in [
            ("--redis-ca", "TOLLGATE_REDIS_CA"),
            ("--redis-client-cert", "TOLLGATE_REDIS_CLIENT_CERT"),
            ("--redis-client-key", "TOLLGATE_REDIS_CLIENT_KEY"),
            ("--redis-password-file", "TOLLGATE_REDIS_PASSWORD_FILE"),
        ] {
            let path = setting(c, flag, var).unwrap_or_else(|| panic!("{name}: {flag}"));
            secret_file(d, &path);
        }
        // Probes and scrape annotations as in the base: the injector rewrites them to its
        // agent, which calls the admin listener inside the pod.
        let base_c = container(deployment(&base));
        for key in ["livenessProbe", "readinessProbe", "ports"] {
            assert_eq!(c[key], base_c[key], "{name}: {key}");
        }
        assert!(setting(c, "--admin-listen", "TOLLGATE_ADMIN_LISTEN").is_some());
        assert_eq!(
            field(d, "spec.template.metadata.annotations"),
            field(deployment(&base), "spec.template.metadata.annotations")
        );

        // The Service says HTTP/2 (h2c behind the sidecar); the namespace gets sidecars.
        let svc = find(&resources, "Service", "tollgate-limiter");
        assert_eq!(svc["spec"]["ports"][0]["appProtocol"], "http2");
        let ns = find(&resources, "Namespace", "tollgate");
        assert_eq!(ns["metadata"]["labels"]["istio-injection"], "enabled");
    }
    // The patches change nothing else of the base.
    let istio = build_named("istio");
    for (b, o) in base.iter().zip(&istio) {
        let changed = ["Namespace", "Deployment", "Service"].contains(&str_field(o, "kind"))
            || (o["kind"] == "NetworkPolicy" && o["metadata"]["name"] == "tollgate-limiter");
        if !changed {
            assert_eq!(b, o, "the overlay changed {}", resource_key(o));
        }
    }
}

#[test]
fn kubectl_kustomize_builds_what_these_tests_check() {
    let Some(kubectl) = tollgate_e2e::paths::which("kubectl") else {
        eprintln!("kubectl not installed: kustomize cross-check skipped");
        return;
    };
    let dir = scratch("kustomize");
    for name in ["base"].into_iter().chain(OVERLAYS) {
        let mut cmd = Command::new(&kubectl);
        cmd.arg("kustomize").arg(k8s_dir().join(name));
        let built = dir.join(format!("{name}.yaml"));
        std::fs::write(&built, ops::run_ok(cmd)).unwrap();
        let mut from_kustomize = yaml_docs(&built);
        let mut here = build_named(name);
        from_kustomize.sort_by_key(resource_key);
        here.sort_by_key(resource_key);
        assert_eq!(from_kustomize, here, "kubectl kustomize {name}");
    }
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
fn kustomizations_list_every_manifest() {
    let k = kustomization(&base());
    let listed: BTreeSet<String> = k["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let present: BTreeSet<String> = base_manifests()
        .iter()
        .filter(|p| !is_example(p))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(listed, present);
    assert!(
        example_secrets().len() >= 4,
        "example Secrets for the listener, the gateway CA and Redis"
    );

    // Each overlay builds on the base and uses every patch file it ships.
    for name in OVERLAYS {
        let dir = k8s_dir().join(name);
        let overlay = kustomization(&dir);
        assert_eq!(overlay["resources"], json!(["../base"]), "{name}");
        let patches: BTreeSet<String> = overlay["patches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| str_field(p, "path").to_string())
            .collect();
        let files: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f != "kustomization.yaml")
            .collect();
        assert_eq!(patches, files, "{name}: patch files");
    }
}
