#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The limiter's container image (`just oci-limiter`, tools/oci-build-limiter): built without
//! Docker, reproducible, minimal, and runnable. Inspected with tools that share no code with
//! the builder: skopeo reads the layout and the archive (manifest, config: non-root numeric
//! user, entrypoint, labels, fixed creation time), umoci unpacks it rootless (verifying every
//! blob digest and diff_id) into an OCI runtime bundle, and the binary of that root file
//! system, started with nothing from the host's environment, answers `/healthz` and grants a
//! lease, and, configured as envoyproxy/ratelimit's replacement, answers the RateLimitService.
//! The deployment manifest pins the image by digest, and tools/k8s-pin re-pins it to
//! the build (what a release does), checks a pin, and renders a pinned copy of deploy/k8s.

mod ops;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ops::{root, run, run_ok, scratch, sha256_hex, str_field};
use serde_json::Value;
use tollgate_e2e::process::{self, output_with_timeout, ChildProcess};
use tollgate_e2e::{free_port, http_blocking};

const NAME: &str = "tollgate-limiter";
const BINARY: &str = "usr/local/bin/tollgate-limiter";
const UID: u64 = 65532;
const MT_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The image reference deploy/k8s/base/deployment.yaml names (before its digest).
const REPO: &str = "registry.example.com/platform/tollgate-limiter";

fn limiter_version() -> String {
    let toml = std::fs::read_to_string(root().join("crates/limiter/Cargo.toml")).unwrap();
    toml.lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|rest| rest.split('"').next())
        .expect("limiter version")
        .to_string()
}

/// Runs tools/oci-build-limiter into `out` (it builds the static binary first when `binary`
/// is None; a cold build of profile `server` takes minutes); returns the digest it printed.
fn build_image(out: &Path, binary: Option<&Path>) -> String {
    build_image_at(out, binary, "0")
}

/// [`build_image`] with `SOURCE_DATE_EPOCH=epoch`.
fn build_image_at(out: &Path, binary: Option<&Path>, epoch: &str) -> String {
    let mut cmd = ops::py_tool("oci-build-limiter", &[]);
    cmd.arg("--out")
        .arg(out)
        .env("SOURCE_DATE_EPOCH", epoch)
        .current_dir(root());
    if let Some(b) = binary {
        cmd.arg("--binary").arg(b);
    }
    let what = format!("{cmd:?}");
    let out = output_with_timeout(cmd, Duration::from_secs(1800))
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}",
        out.status,
        process::tail(&String::from_utf8_lossy(&out.stderr), 40)
    );
    let digest = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        digest.len() == 71 && digest.starts_with("sha256:"),
        "{digest:?}"
    );
    digest
}

fn the_binary() -> PathBuf {
    tollgate_e2e::paths::target_dir().join("x86_64-unknown-linux-musl/server/tollgate-limiter")
}

/// Builds the image with its binary (a cold build takes minutes) once for the tests of this
/// file, which run in parallel: the first caller builds, the others wait for it. Returns the
/// image's digest as built into `scratch("image-first")`.
fn first_build() -> String {
    static FIRST: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let mut first = FIRST.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(digest) = first.as_ref() {
        return digest.clone();
    }
    let digest = build_image(&scratch("image-first"), None);
    *first = Some(digest.clone());
    digest
}

fn skopeo(args: &[&str], reference: &str) -> Vec<u8> {
    let mut cmd = Command::new(ops::tool("skopeo"));
    cmd.arg("inspect").args(args).arg(reference);
    let out = run(cmd);
    assert!(
        out.status.success(),
        "skopeo inspect {args:?} {reference}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Every path of a directory tree, relative, sorted (directories end with `/`).
fn tree(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(base).unwrap().to_string_lossy().into_owned();
            if p.is_dir() && !p.is_symlink() {
                out.push(format!("{rel}/"));
                walk(base, &p, out);
            } else {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

#[test]
fn limiter_image_is_reproducible_minimal_and_serves_from_its_unpacked_rootfs() {
    let tag = limiter_version();
    let (a, b) = (scratch("image-a"), scratch("image-b"));
    // Once with the build (cargo), once from the binary it built: the same image.
    let digest = first_build();
    assert_eq!(
        build_image(&a, None),
        digest,
        "the tool's own build of the binary"
    );
    assert_eq!(
        build_image(&b, Some(&the_binary())),
        digest,
        "two builds of one binary, two digests"
    );
    for file in [
        "tollgate-limiter.tar",
        "tollgate-limiter.digest",
        "tollgate-limiter/index.json",
    ] {
        assert_eq!(
            std::fs::read(a.join(file)).unwrap(),
            std::fs::read(b.join(file)).unwrap(),
            "{file} differs between two builds"
        );
    }
    let hex = digest.strip_prefix("sha256:").unwrap();

    // SOURCE_DATE_EPOCH is the only time that goes in: another one, another digest; a bad
    // one is refused by name.
    let later = scratch("image-later");
    assert_ne!(
        build_image_at(&later, Some(&the_binary()), "1700000000"),
        digest
    );
    let later_config: Value = serde_json::from_slice(&skopeo(
        &["--config", "--raw"],
        &format!("oci:{}:{tag}", later.join(NAME).display()),
    ))
    .unwrap();
    assert_eq!(str_field(&later_config, "created"), "2023-11-14T22:13:20Z");
    let mut bad = ops::py_tool("oci-build-limiter", &[]);
    bad.arg("--binary")
        .arg(the_binary())
        .arg("--out")
        .arg(&later)
        .env("SOURCE_DATE_EPOCH", "yesterday");
    let out = run(bad);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success() && err.contains("SOURCE_DATE_EPOCH"),
        "{err}"
    );

    // skopeo reads the layout; the manifest hashes to the digest; the archive is the same.
    let layout = a.join(NAME);
    let layout_ref = format!("oci:{}:{tag}", layout.display());
    let raw = skopeo(&["--raw"], &layout_ref);
    assert_eq!(
        sha256_hex(&raw),
        hex,
        "manifest bytes do not hash to the digest"
    );
    let archive_ref = format!(
        "oci-archive:{}:{tag}",
        a.join("tollgate-limiter.tar").display()
    );
    assert_eq!(skopeo(&["--raw"], &archive_ref), raw);
    let manifest: Value = serde_json::from_slice(&raw).unwrap();
    assert_eq!(str_field(&manifest, "mediaType"), MT_MANIFEST);
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "one layer: {manifest}");
    assert_eq!(str_field(&layers[0], "mediaType"), MT_LAYER);

    // The config: linux/amd64, non-root numeric user, the binary as entrypoint, labels, and a
    // creation time that is SOURCE_DATE_EPOCH (0), not the time of the build.
    let config: Value =
        serde_json::from_slice(&skopeo(&["--config", "--raw"], &layout_ref)).unwrap();
    assert_eq!(str_field(&config, "os"), "linux");
    assert_eq!(str_field(&config, "architecture"), "amd64");
    assert_eq!(str_field(&config, "created"), "1970-01-01T00:00:00Z");
    assert_eq!(str_field(&config, "config.User"), format!("{UID}:{UID}"));
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!([format!("/{BINARY}")])
    );
    assert!(
        config["config"].get("Cmd").is_none(),
        "no default arguments: {config}"
    );
    let labels = &config["config"]["Labels"];
    assert_eq!(labels["org.opencontainers.image.title"], NAME);
    assert_eq!(labels["org.opencontainers.image.version"], tag.as_str());
    assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0");
    // skopeo's own view (containers/image parses the config) agrees.
    let inspected: Value = serde_json::from_slice(&skopeo(&[], &layout_ref)).unwrap();
    assert_eq!(inspected["Digest"], digest.as_str());
    assert_eq!(inspected["Os"], "linux");
    assert_eq!(inspected["Labels"]["org.opencontainers.image.title"], NAME);

    // umoci unpacks it, rootless, into a runtime bundle: the process is the binary, as
    // 65532:65532, and the root file system holds the binary, passwd and group: no shell.
    let bundle = scratch("image-bundle").join("bundle");
    let mut umoci = Command::new(ops::tool("umoci"));
    umoci
        .args(["unpack", "--rootless", "--image"])
        .arg(format!("{}:{tag}", layout.display()))
        .arg(&bundle);
    run_ok(umoci);
    let spec: Value = ops::json_file(&bundle.join("config.json"));
    assert_eq!(
        spec["process"]["args"],
        serde_json::json!([format!("/{BINARY}")])
    );
    assert_eq!(spec["process"]["user"]["uid"], UID);
    assert_eq!(spec["process"]["user"]["gid"], UID);
    let rootfs = bundle.join("rootfs");
    assert_eq!(
        tree(&rootfs),
        [
            "etc/",
            "etc/group",
            "etc/passwd",
            "usr/",
            "usr/local/",
            "usr/local/bin/",
            BINARY
        ],
        "the root file system holds more than the limiter"
    );
    assert!(!rootfs.join("bin/sh").exists());
    let passwd = std::fs::read_to_string(rootfs.join("etc/passwd")).unwrap();
    assert!(passwd.contains(&format!(":{UID}:{UID}:")), "{passwd}");
    let binary = rootfs.join(BINARY);
    assert_eq!(
        std::fs::read(&binary).unwrap(),
        std::fs::read(the_binary()).unwrap(),
        "the image's binary is not the one built"
    );

    // The binary runs from there with nothing from the host: no environment, no libc (it is
    // static), configured by TOLLGATE_* variables as in deploy/k8s; in-memory store.
    let dir = scratch("image-run");
    let policies = dir.join("policies.json");
    std::fs::write(
        &policies,
        r#"{ "policies": [{ "name": "per-tenant", "key": [{ "header": "x-tenant-id" }],
             "rate": { "units": 10, "per": "1s" }, "burst": 10, "scope": "global" }],
             "limiter": { "cluster": "tollgate_limiter" } }"#,
    )
    .unwrap();
    let (mut limiter, port) = (0..5)
        .find_map(|_| {
            let port = free_port();
            let mut cmd = Command::new(&binary);
            cmd.env_clear()
                .env("TOLLGATE_LISTEN", format!("127.0.0.1:{port}"))
                .env("TOLLGATE_POLICIES", &policies)
                .current_dir(&rootfs);
            let mut child = ChildProcess::spawn("limiter-from-image", cmd, &dir).unwrap();
            let up = process::wait_for(
                "the image's limiter /healthz",
                Duration::from_secs(15),
                || {
                    if !child.is_running() {
                        return Some(false);
                    }
                    http_blocking::get(port, "/healthz", Duration::from_millis(500))
                        .ok()
                        .filter(|r| r.status == 200)
                        .map(|_| true)
                },
            );
            if up == Ok(true) {
                Some((child, port))
            } else {
                eprintln!(
                    "did not start on {port}: {}",
                    process::tail(&child.stderr(), 10)
                );
                child.kill();
                None
            }
        })
        .expect("the limiter from the image never answered /healthz");
    let body =
        r#"{"leases":[{"id":"image-1","policy":"per-tenant","key":"acme","min":1,"want":3}]}"#;
    let r = http_blocking::request(
        port,
        "POST",
        "/v1/leases",
        &[("content-type", "application/json")],
        body,
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["leases"][0]["granted"], 3, "{v}");
    assert!(limiter.is_running());
    limiter.kill();

    // The same binary in place of envoyproxy/ratelimit (docs/src/ratelimit/rls.md, *Replace envoyproxy/
    // ratelimit*): configured by the environment alone, no policy document, the
    // RateLimitService reading ratelimit's configuration directory.
    let config = dir.join("ratelimit-config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::copy(
        root().join("deploy/ratelimit/config/edge.yaml"),
        config.join("config.yaml"),
    )
    .unwrap();
    let (lease_port, rls_port) = (free_port(), free_port());
    let mut cmd = Command::new(&binary);
    cmd.env_clear()
        .env("TOLLGATE_LISTEN", format!("127.0.0.1:{lease_port}"))
        .env("TOLLGATE_RLS_LISTEN", format!("127.0.0.1:{rls_port}"))
        .env("TOLLGATE_RLS_CONFIG", &config)
        .current_dir(&rootfs);
    let mut rls = ChildProcess::spawn("rls-from-image", cmd, &dir).unwrap();
    process::wait_for(
        "the image's RateLimitService",
        Duration::from_secs(15),
        || {
            http_blocking::get(lease_port, "/healthz", Duration::from_millis(500))
                .ok()
                .filter(|r| r.status == 200)
        },
    )
    .unwrap_or_else(|e| panic!("{e}: {}", process::tail(&rls.stderr(), 10)));
    let codes = rls_codes(rls_port, 6);
    assert_eq!(
        codes,
        [1, 1, 1, 1, 1, 2],
        "5 OK (1) then OVER_LIMIT (2): {codes:?}"
    );
    rls.kill();
}

/// `n` calls of the RateLimitService on `port` for tenant `acme` of domain `edge`: their
/// overall codes.
fn rls_codes(port: u16, n: usize) -> Vec<i32> {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"))
            .await
            .unwrap();
        let mut codes = Vec::new();
        for _ in 0..n {
            let request = RateLimitRequest {
                domain: "edge".into(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "tenant".into(),
                        value: "acme".into(),
                    }],
                    ..Default::default()
                }],
                hits_addend: 0,
            };
            let answer = client.should_rate_limit(request).await.unwrap();
            codes.push(answer.into_inner().overall_code);
        }
        codes
    })
}

// --- deploy/k8s pins the image by digest ---------------------------------------------------

fn k8s_pin(args: &[&str]) -> std::process::Output {
    let mut cmd = ops::py_tool("k8s-pin", args);
    cmd.current_dir(root());
    run(cmd)
}

fn image_of(deployment: &Path) -> String {
    let doc = ops::yaml_doc(deployment);
    let containers = doc["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    containers[0]["image"].as_str().unwrap().to_string()
}

#[test]
fn deployment_pins_the_image_by_digest_and_k8s_pin_renders_the_build() {
    let tag = limiter_version();
    let deployment = root().join("deploy/k8s/base/deployment.yaml");
    // The committed manifest pins a digest (the kubelet pulls exactly that image), with the
    // tag people read beside it.
    let committed = image_of(&deployment);
    let (name, digest) = committed
        .split_once('@')
        .unwrap_or_else(|| panic!("{committed}: not pinned by digest"));
    assert_eq!(name, format!("{REPO}:{tag}"));
    let hex = digest.strip_prefix("sha256:").unwrap();
    assert!(
        hex.len() == 64
            && hex
                .bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
        "{digest} is not a sha256 digest"
    );

    // The build's digest, rendered into a copy of deploy/k8s: only the image line differs.
    let out = scratch("k8s-pin");
    first_build();
    let built = build_image(&out.join("oci"), Some(&the_binary()));
    let rendered = out.join("k8s");
    let r = k8s_pin(&["--digest", &built, "--out", rendered.to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(
        image_of(&rendered.join("base/deployment.yaml")),
        format!("{REPO}:{tag}@{built}")
    );
    let (before, after) = (
        std::fs::read_to_string(&deployment).unwrap(),
        std::fs::read_to_string(rendered.join("base/deployment.yaml")).unwrap(),
    );
    let diff: Vec<(&str, &str)> = before
        .lines()
        .zip(after.lines())
        .filter(|(x, y)| x != y)
        .collect();
    assert!(
        before.lines().count() == after.lines().count() && diff.len() <= 1,
        "{diff:?}"
    );
    for file in [
        "base/kustomization.yaml",
        "istio/kustomization.yaml",
        "base/service.yaml",
    ] {
        assert_eq!(
            std::fs::read(root().join("deploy/k8s").join(file)).unwrap(),
            std::fs::read(rendered.join(file)).unwrap(),
            "{file} changed"
        );
    }

    // --check on a manifest pinned elsewhere fails, naming both; after pinning it passes, and
    // pinning again changes nothing.
    let copy = out.join("deployment.yaml");
    std::fs::copy(&deployment, &copy).unwrap();
    let stale = format!("sha256:{}", "0".repeat(64));
    let pin = |digest: &str, extra: &[&str]| {
        let mut args = vec!["--digest", digest, "--manifest", copy.to_str().unwrap()];
        args.extend_from_slice(extra);
        k8s_pin(&args)
    };
    assert!(pin(&stale, &[]).status.success());
    let check = pin(&built, &["--check"]);
    let said = String::from_utf8_lossy(&check.stderr).into_owned();
    assert!(!check.status.success(), "a stale pin passed --check");
    assert!(
        said.contains(&stale) && said.contains(&built) && said.contains("just k8s-pin"),
        "{said}"
    );
    assert!(pin(&built, &[]).status.success());
    assert!(pin(&built, &["--check"]).status.success());
    let once = std::fs::read(&copy).unwrap();
    assert!(pin(&built, &[]).status.success());
    assert_eq!(std::fs::read(&copy).unwrap(), once);
    assert_eq!(image_of(&copy), format!("{REPO}:{tag}@{built}"));

    // Bad input is refused with a message, never a traceback.
    for bad in ["sha256:xyz", "md5:0123"] {
        let r = pin(bad, &[]);
        let err = String::from_utf8_lossy(&r.stderr).into_owned();
        assert!(
            !r.status.success() && err.contains("not a sha256 digest"),
            "{bad}: {err}"
        );
        assert!(!err.contains("Traceback"), "{err}");
    }

    // Whether the committed pin is this build: a release re-pins (`just k8s-pin`) and
    // `just k8s-pin-check` gates it; an ordinary code change leaves it stale, which is fine.
    println!(
        "committed pin {digest}, this build {built}: {}",
        if digest == built {
            "current"
        } else {
            "stale (re-pin at release)"
        }
    );
}
