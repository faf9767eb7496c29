//! The policy document in force, and the watcher that reloads it when its file changes; the
//! same mechanism ([`Current`], [`watch`]) keeps the RateLimitService's configuration
//! (`crate::rls`) current.
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

/// A document in force (the policy document, the RateLimitService's configuration); cheap
/// to read from every request.
#[derive(Debug)]
pub struct Current<T> {
    current: RwLock<Arc<T>>,
}

/// The policy document in force.
pub type PolicyHandle = Current<Policies>;

impl<T> Current<T> {
    pub fn new(value: T) -> Self {
        Self {
            current: RwLock::new(Arc::new(value)),
        }
    }

    /// The document in force now (a snapshot: one request sees one version throughout).
    pub fn current(&self) -> Arc<T> {
        match self.current.read() {
            Ok(guard) => Arc::clone(&guard),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    pub fn replace(&self, value: T) {
        let new = Arc::new(value);
        match self.current.write() {
            Ok(mut guard) => *guard = new,
            Err(poisoned) => *poisoned.into_inner() = new,
        }
    }
}

/// The reload mechanism of every watched document: every `interval` until `shutdown` turns
/// true, `read` runs (off the async threads) and returns the bytes a change is seen on and
/// what was read; when those bytes differ from the last seen (`loaded` at first, so a
/// change made while this task starts is not missed), `apply` gets what was read (it
/// validates, installs or keeps the document in force, logs and counts). A failed read is
/// given to `unreadable` once until a read succeeds again.
pub async fn watch<T, R>(
    loaded: Vec<u8>,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
    read: R,
    mut unreadable: impl FnMut(&str),
    mut apply: impl FnMut(T),
) where
    T: Send + 'static,
    R: Fn() -> Result<(Vec<u8>, T), String> + Clone + Send + 'static,
{
    let mut last_seen = loaded;
    let mut unreadable_logged = false;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let read = read.clone();
        let outcome = match tokio::task::spawn_blocking(read).await {
            Ok(outcome) => outcome,
            Err(e) => Err(e.to_string()),
        };
        match outcome {
            Ok((seen, value)) => {
                unreadable_logged = false;
                if seen != last_seen {
                    apply(value);
                    last_seen = seen;
                }
            }
            Err(e) => {
                if !unreadable_logged {
                    unreadable(&e);
                    unreadable_logged = true;
                }
            }
        }
    }
}

/// Polls the policy file every `interval` until `shutdown` turns true ([`watch`]); installs
/// every new valid document, logs and counts every invalid or unreadable one. `loaded` are
/// the bytes the document in force was read from.
pub async fn watch_file(
    path: PathBuf,
    loaded: Vec<u8>,
    handle: Arc<PolicyHandle>,
    metrics: Metrics,
    interval: Duration,
    shutdown: watch::Receiver<bool>,
) {
    let read = {
        let path = path.clone();
        move || {
            std::fs::read(&path)
                .map(|bytes| (bytes.clone(), bytes))
                .map_err(|e| e.to_string())
        }
    };
    let unreadable = |e: &str| {
        tracing::warn!(path = %path.display(), error = %e,
            "cannot read the policy file; keeping the policies in force");
        metrics.policy_reload("unreadable");
    };
    let apply = |bytes: Vec<u8>| match Policies::from_json(&bytes) {
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
    };
    watch(loaded, interval, shutdown, read, unreadable, apply).await;
}
