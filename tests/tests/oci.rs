#![cfg(feature = "e2e")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! The filter's OCI image (`just oci`, tools/oci-build): reproducible, and what Istio's image
//! fetcher accepts (compat variant: one `application/vnd.oci.image.layer.v1.tar+gzip` layer
//! holding `plugin.wasm`). Inspected with tools that share no code with the builder: skopeo
//! (containers/image) reads the layout and the archive, umoci unpacks the layer (verifying
//! blob digests and the config's diff_ids), GNU tar lists it.

mod ops;

use std::process::Command;

use ops::{build_oci, filter_version, run_ok, scratch, sha256_hex, str_field};
use serde_json::Value;
use tollgate_e2e::paths;

const MT_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MT_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

fn skopeo_raw(reference: &str, config: bool) -> Vec<u8> {
    let mut cmd = Command::new(ops::tool("skopeo"));
    cmd.arg("inspect");
    if config {
        cmd.arg("--config");
    }
    cmd.args(["--raw", reference]);
    let out = ops::run(cmd);
    assert!(
        out.status.success(),
        "skopeo inspect {reference}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn oci_image_is_reproducible_and_holds_exactly_the_built_wasm() {
    let wasm_path = paths::wasm_path();
    let wasm = std::fs::read(&wasm_path).unwrap();
    let tag = filter_version();
    let (a, b) = (scratch("oci-a"), scratch("oci-b"));

    // Twice, into different directories: same digest, same bytes.
    let digest = build_oci(&wasm_path, &a);
    assert_eq!(build_oci(&wasm_path, &b), digest, "two builds, two digests");
    for file in ["tollgate.tar", "tollgate.digest", "tollgate/index.json"] {
        assert_eq!(
            std::fs::read(a.join(file)).unwrap(),
            std::fs::read(b.join(file)).unwrap(),
            "{file} differs between two builds of the same module"
        );
    }
    assert_eq!(
        std::fs::read_to_string(a.join("tollgate.digest"))
            .unwrap()
            .trim(),
        digest
    );
    let hex = digest.strip_prefix("sha256:").expect("sha256 digest");

    // skopeo reads the layout: the manifest it returns hashes to the digest we pin.
    let layout_ref = format!("oci:{}:{tag}", a.join("tollgate").display());
    let raw = skopeo_raw(&layout_ref, false);
    assert_eq!(
        sha256_hex(&raw),
        hex,
        "manifest bytes do not hash to the digest"
    );
    let manifest: Value = serde_json::from_slice(&raw).unwrap();
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(str_field(&manifest, "mediaType"), MT_MANIFEST);
    assert_eq!(str_field(&manifest, "config.mediaType"), MT_CONFIG);
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "compat variant: exactly one layer");
    assert_eq!(str_field(&layers[0], "mediaType"), MT_LAYER);

    // The archive (for `skopeo copy oci-archive:...`) holds the same image.
    let archive_ref = format!("oci-archive:{}:{tag}", a.join("tollgate.tar").display());
    assert_eq!(skopeo_raw(&archive_ref, false), raw);

    // Config: a valid image config for a wasm module, one diff_id.
    let config: Value = serde_json::from_slice(&skopeo_raw(&layout_ref, true)).unwrap();
    assert_eq!(str_field(&config, "architecture"), "wasm");
    assert_eq!(str_field(&config, "os"), "wasip1");
    assert_eq!(str_field(&config, "rootfs.type"), "layers");
    assert_eq!(config["rootfs"]["diff_ids"].as_array().unwrap().len(), 1);
    assert!(
        config.get("created").is_none(),
        "a creation time would make the digest depend on when it was built"
    );

    // The layer: exactly one file, plugin.wasm, no host metadata.
    let layer_hex = str_field(&layers[0], "digest")
        .strip_prefix("sha256:")
        .unwrap();
    let layer_path = a.join("tollgate/blobs/sha256").join(layer_hex);
    let mut tar = Command::new("tar");
    tar.arg("-tvzf").arg(&layer_path);
    let listing = run_ok(tar);
    let entries: Vec<&str> = listing.lines().collect();
    assert_eq!(entries.len(), 1, "layer entries: {listing}");
    assert!(
        entries[0].contains(" 0/0 ") && entries[0].contains("1970-01-01 00:00"),
        "owner/mtime not fixed: {listing}"
    );
    assert!(entries[0].ends_with(" plugin.wasm"), "{listing}");

    // umoci unpacks it (checking digests and diff_ids): the bytes are the built module.
    let rootfs = scratch("oci-rootfs").join("rootfs");
    let mut umoci = Command::new(ops::tool("umoci"));
    umoci
        .args(["raw", "unpack", "--rootless", "--image"])
        .arg(format!("{}:{tag}", a.join("tollgate").display()))
        .arg(&rootfs);
    run_ok(umoci);
    let unpacked: Vec<_> = std::fs::read_dir(&rootfs)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(unpacked, vec!["plugin.wasm".to_string()]);
    assert!(
        std::fs::read(rootfs.join("plugin.wasm")).unwrap() == wasm,
        "plugin.wasm in the image differs from {}",
        wasm_path.display()
    );
}

#[test]
fn oci_digest_changes_with_the_module() {
    let wasm_path = paths::wasm_path();
    let mut other = std::fs::read(&wasm_path).unwrap();
    // An empty custom section named "x" at the end: still a valid module, other bytes.
    other.extend_from_slice(&[0x00, 0x02, 0x01, b'x']);
    let dir = scratch("oci-other");
    let other_path = dir.join("other.wasm");
    std::fs::write(&other_path, &other).unwrap();
    let d1 = build_oci(&wasm_path, &dir.join("one"));
    let d2 = build_oci(&other_path, &dir.join("two"));
    assert_ne!(d1, d2);

    // And it refuses what is not a module at all.
    let junk = dir.join("junk.wasm");
    std::fs::write(&junk, b"not wasm").unwrap();
    let mut cmd = ops::py_tool("oci-build", &[]);
    cmd.arg("--wasm")
        .arg(&junk)
        .arg("--out")
        .arg(dir.join("junk"));
    assert!(!ops::run(cmd).status.success());
}
