//! The shipped mutual-TLS setup made test-ready: `envoy/global-mtls.yaml`, its SDS files
//! (`envoy/tls/`) and the limiter's `--tls-*` flags, with certificates made at test time and
//! the production `/etc/tollgate/...` paths pointed at them. The end-to-end tests, the func-e
//! check and the benchmark all run the shipped files through this one piece.

use std::path::{Path, PathBuf};

use crate::error::{HarnessError, Result};
use crate::pki::{CertFiles, TestCa};

/// The shipped SDS files `envoy/global-mtls.yaml` reads (in `envoy/tls/`).
pub const SDS_FILES: [&str; 2] = ["limiter-client-sds.yaml", "limiter-ca-sds.yaml"];

/// One deployment's certificates: the limiter's (from the limiter CA, naming
/// `tollgate-limiter`, which the shipped SDS file requires, and `localhost`) and the
/// gateway's client certificate (from the gateway CA, which the limiter trusts for callers),
/// all in `dir`; the shipped SDS files, pointed at them, in `sds_dir`.
pub struct MtlsSetup {
    pub dir: PathBuf,
    pub sds_dir: PathBuf,
    pub limiter_ca: TestCa,
    pub gateway_ca: TestCa,
    pub limiter: CertFiles,
    pub gateway: CertFiles,
    pub limiter_ca_file: PathBuf,
    pub gateway_ca_file: PathBuf,
}

fn display(p: &Path) -> String {
    p.display().to_string()
}

impl MtlsSetup {
    /// New CAs and certificates in `dir`, the gateway's naming `gateway_id` (a URI SAN), and
    /// the SDS files written into `dir/sds`.
    pub fn new(dir: &Path, gateway_id: &str) -> Result<MtlsSetup> {
        let limiter_ca = TestCa::new("limiter CA");
        let gateway_ca = TestCa::new("gateway CA");
        let limiter = limiter_ca.server(dir, "limiter", &["tollgate-limiter", "localhost"]);
        let gateway = gateway_ca.client(dir, "gateway", Some(gateway_id));
        let sds_dir = dir.join("sds");
        std::fs::create_dir_all(&sds_dir)?;
        let setup = MtlsSetup {
            dir: dir.to_path_buf(),
            sds_dir,
            limiter_ca_file: limiter_ca.write_cert(dir, "limiter-ca.crt"),
            gateway_ca_file: gateway_ca.write_cert(dir, "gateway-ca.crt"),
            limiter_ca,
            gateway_ca,
            limiter,
            gateway,
        };
        let root = crate::paths::workspace_root();
        for file in SDS_FILES {
            let shipped = std::fs::read_to_string(root.join("envoy/tls").join(file))
                .map_err(|e| HarnessError::new(format!("envoy/tls/{file}: {e}")))?;
            let local = setup
                .sds(&shipped)
                .map_err(|e| HarnessError::new(format!("envoy/tls/{file}: {e}")))?;
            std::fs::write(setup.sds_dir.join(file), local)?;
        }
        Ok(setup)
    }

    /// The limiter's TLS flags as in production (`envoy/global-mtls.yaml`'s header), callers
    /// limited to `allow`.
    pub fn limiter_flags(&self, allow: &str) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            display(&self.limiter.cert),
            "--tls-key".into(),
            display(&self.limiter.key),
            "--tls-client-ca".into(),
            display(&self.gateway_ca_file),
            "--tls-allow".into(),
            allow.into(),
        ]
    }

    /// A shipped SDS file naming this setup's certificate files.
    pub fn sds(&self, shipped: &str) -> Result<String> {
        let local = shipped
            .replace(
                "/etc/tollgate/tls/gateway.crt",
                &display(&self.gateway.cert),
            )
            .replace("/etc/tollgate/tls/gateway.key", &display(&self.gateway.key))
            .replace(
                "/etc/tollgate/tls/limiter-ca.crt",
                &display(&self.limiter_ca_file),
            );
        if local == shipped {
            return Err(HarnessError::new(
                "the SDS file names none of the shipped certificate paths",
            ));
        }
        if local.contains("/etc/tollgate/") {
            return Err(HarnessError::new(
                "the SDS file names a certificate path the setup does not provide",
            ));
        }
        Ok(local)
    }

    /// `envoy/global-mtls.yaml` (as shipped, or through `envoy_config`) reading its SDS files
    /// from `sds_dir` and watching `dir`.
    pub fn localize(&self, yaml: &str) -> Result<String> {
        if !yaml.contains("UpstreamTlsContext") {
            return Err(HarnessError::new(
                "no TLS transport socket on the limiter cluster",
            ));
        }
        let local = yaml
            .replace(
                "/etc/tollgate/envoy/",
                &format!("{}/", display(&self.sds_dir)),
            )
            .replace("/etc/tollgate/tls", &display(&self.dir));
        // Comments may still name the production paths; the config itself must not.
        let stray = local
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .any(|l| l.contains("/etc/tollgate/"));
        if stray {
            return Err(HarnessError::new(
                "a path under /etc/tollgate/ is left in the config",
            ));
        }
        Ok(local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_mtls_files_read_the_setup_s_certificates() {
        let dir = crate::paths::new_log_dir("mtls-unit", "pki");
        let setup = MtlsSetup::new(&dir, "spiffe://unit/gateway").unwrap();
        let shown = display(&dir);
        for file in SDS_FILES {
            let local = std::fs::read_to_string(setup.sds_dir.join(file)).unwrap();
            assert!(local.contains(&shown), "{file}: {local}");
        }
        let read =
            |f: &str| std::fs::read_to_string(crate::paths::workspace_root().join(f)).unwrap();
        let yaml = setup.localize(&read("envoy/global-mtls.yaml")).unwrap();
        assert!(yaml.contains(&format!("path: {shown}/sds/limiter-client-sds.yaml")));
        assert!(yaml.contains(&format!("watched_directory: {{ path: {shown} }}")));
        assert!(setup.localize(&read("envoy/global.yaml")).is_err());
        assert!(setup.sds("resources: []").is_err());
        let flags = setup.limiter_flags("gateway");
        assert_eq!(flags.last().map(String::as_str), Some("gateway"));
    }
}
