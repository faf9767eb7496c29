//! The policy document in force, and the watcher that reloads it when its file changes.
//!
//! The limiter resolves rate and burst by policy name from the same JSON document the filter
//! is configured with (for a policy with `limits`, from the entry the key's last part names:
//! `Policy::entry_for`), so a reload that changes an entry's numbers keeps its buckets. The file is polled (contents compared, so editors that replace the file
//! and Kubernetes' symlink swaps are both seen); a new valid document replaces the old one
//! atomically for the next request, an invalid one is logged with every reason and ignored,
//! so the last good document stays in force.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;
use tollgate_core::policy::{Policies, PolicyErrors};

use crate::metrics::Metrics;

/// Why a policy file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read policy file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid policy file {path}: {errors}")]
    Invalid { path: PathBuf, errors: PolicyErrors },
}

/// Reads and validates a policy document; also returns the bytes it was read from.
pub fn load_file(path: &Path) -> Result<(Policies, Vec<u8>), LoadError> {
    let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })?;
    let policies = Policies::from_json(&bytes).map_err(|errors| LoadError::Invalid {
        path: path.to_owned(),
        errors,
    })?;
    Ok((policies, bytes))
}

/// The document in force; cheap to read from every request.
#[derive(Debug)]
pub struct PolicyHandle {
    current: RwLock<Arc<Policies>>,
}

impl PolicyHandle {
    pub fn new(policies: Policies) -> Self {
        Self {
            current: RwLock::new(Arc::new(policies)),
        }
    }

    /// The document in force now (a snapshot: one request sees one version throughout).
    pub fn current(&self) -> Arc<Policies> {
        match self.current.read() {
            Ok(guard) => Arc::clone(&guard),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    pub fn replace(&self, policies: Policies) {
        let new = Arc::new(policies);
        match self.current.write() {
            Ok(mut guard) => *guard = new,
            Err(poisoned) => *poisoned.into_inner() = new,
        }
    }
}

/// Polls `path` every `interval` until `shutdown` turns true; installs every new valid
/// document, logs and counts every invalid or unreadable one. `loaded` are the bytes the
/// document in force was read from (so a change made while this task starts is not missed).
pub async fn watch_file(
    path: PathBuf,
    loaded: Vec<u8>,
    handle: Arc<PolicyHandle>,
    metrics: Metrics,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut last_seen: Option<Vec<u8>> = Some(loaded);
    let mut unreadable_logged = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let bytes = match tokio::fs::read(&path).await {
            Ok(bytes) => {
                unreadable_logged = false;
                bytes
            }
            Err(e) => {
                if !unreadable_logged {
                    tracing::warn!(path = %path.display(), error = %e,
                        "cannot read the policy file; keeping the policies in force");
                    metrics.policy_reload("unreadable");
                    unreadable_logged = true;
                }
                continue;
            }
        };
        if last_seen.as_deref() == Some(bytes.as_slice()) {
            continue;
        }
        match Policies::from_json(&bytes) {
            Ok(policies) => {
                let old = handle.current().version.clone();
                let version = policies.version.clone();
                let count = policies.policies.len();
                handle.replace(policies);
                metrics.set_policy_version(&version);
                metrics.policy_reload("ok");
                tracing::info!(path = %path.display(), %old, new = %version, policies = count,
                    "policy document reloaded");
            }
            Err(errors) => {
                metrics.policy_reload("invalid");
                tracing::error!(path = %path.display(), version_in_force = %handle.current().version,
                    reasons = %errors, "new policy document is invalid; keeping the one in force");
            }
        }
        last_seen = Some(bytes);
    }
}
