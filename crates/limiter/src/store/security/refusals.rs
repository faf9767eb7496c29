//! Holding a store back from Redis after Redis refused its credentials ([`Refusals`]): calls
//! fail at once with the refusal, and one probe per pause finds out when it ends.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::store::StoreError;

/// First pause after refused credentials.
pub const REFUSED_PAUSE_MIN: Duration = Duration::from_secs(1);
/// Longest pause: how long a fixed certificate or ACL may wait to be noticed.
pub const REFUSED_PAUSE_MAX: Duration = Duration::from_secs(10);
/// How long one probe may take (a connection, its handshake and a `PING`).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Credentials Redis refused, and until when the store holds back.
#[derive(Debug)]
struct Refused {
    error: StoreError,
    /// No probe before this.
    until: Instant,
    /// The current pause.
    pause: Duration,
    /// A probe is out.
    probing: bool,
}

#[derive(Debug, Default)]
struct State {
    refused: Option<Refused>,
    /// A probe got through: the next call replaces the store's connection (which still holds
    /// the refusal) first.
    reconnect: bool,
    /// When the last diagnosis started ([`Refusals::diagnose`]), and whether it is out.
    diagnosed: Option<Instant>,
    diagnosing: bool,
}

/// What a store should do before it dials Redis.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Go ahead on the current connection.
    Go,
    /// Replace the connection first: it was refused, and a probe since got through.
    Reconnect,
}

/// Holds a store back from Redis after Redis refused its credentials (or we refused Redis'
/// certificate). Calls then fail at once with the refusal, and the store's connection is
/// left alone; a probe — one new connection and a `PING`, in a task of its own, so it is not
/// cut short by a caller's deadline — tries again after [`REFUSED_PAUSE_MIN`], the pause
/// doubling while the refusals go on, up to [`REFUSED_PAUSE_MAX`]. One handshake per pause,
/// whatever the traffic. When a probe gets through, the next call reconnects. Logs the
/// refusal when it starts, each probe refused again, and the end.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    state: Mutex<State>,
}

/// Whether `e` is a refusal of the credentials.
fn is_refusal(e: &StoreError) -> bool {
    matches!(e, StoreError::Tls(_) | StoreError::Auth(_))
}

impl Refusals {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Every value of the state is valid, whatever a panicking holder left.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Before a call: `Err` with the refusal while one stands (starting a `probe` of
    /// `node` when the pause is over and none is out), else how to go ahead. A call that gets
    /// `Err` must not report to [`Refusals::after_call`]. Needs a tokio runtime.
    pub(crate) fn before_call<F, Fut>(
        self: &Arc<Self>,
        node: &str,
        probe: F,
    ) -> Result<Attempt, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        let mut state = self.state();
        if let Some(refused) = state.refused.as_mut() {
            if !refused.probing && Instant::now() >= refused.until {
                refused.probing = true;
                let probe = probe();
                let refusals = Arc::clone(self);
                let node = node.to_owned();
                tokio::spawn(async move {
                    let result = match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                        Ok(result) => result,
                        Err(_) => Err(StoreError::Timeout(PROBE_TIMEOUT)),
                    };
                    refusals.probed(&node, result);
                });
            }
            return Err(refused.error.clone());
        }
        if std::mem::take(&mut state.reconnect) {
            return Ok(Attempt::Reconnect);
        }
        Ok(Attempt::Go)
    }

    /// A probe's outcome: through (the refusal ends), refused again (a longer pause), or
    /// neither (Redis down, a timeout: the same pause again).
    fn probed(&self, node: &str, result: Result<(), StoreError>) {
        let mut state = self.state();
        let Some(refused) = state.refused.as_mut() else {
            return;
        };
        refused.probing = false;
        match result {
            Ok(()) => {
                state.refused = None;
                state.reconnect = true;
                tracing::info!(%node, "Redis accepts the limiter's credentials again");
            }
            Err(e) if is_refusal(&e) => {
                refused.pause = (refused.pause * 2).min(REFUSED_PAUSE_MAX);
                refused.until = Instant::now() + refused.pause;
                tracing::warn!(%node, kind = e.kind(), error = %e, retry_in = ?refused.pause,
                    "Redis still refuses the limiter's credentials");
                refused.error = e;
            }
            Err(e) => {
                refused.until = Instant::now() + refused.pause;
                tracing::debug!(%node, error = %e, retry_in = ?refused.pause,
                    "cannot probe Redis' credentials");
            }
        }
    }

    /// After a call that went ahead: a refusal starts holding back (many calls in flight
    /// failing at once start it once).
    pub(crate) fn after_call(&self, node: &str, error: Option<&StoreError>) {
        let Some(e) = error.filter(|e| is_refusal(e)) else {
            return;
        };
        let mut state = self.state();
        if state.refused.is_some() {
            return;
        }
        tracing::error!(%node, kind = e.kind(), error = %e, retry_in = ?REFUSED_PAUSE_MIN,
            "{}", refusal_hint(e));
        state.reconnect = false;
        state.refused = Some(Refused {
            error: e.clone(),
            until: Instant::now() + REFUSED_PAUSE_MIN,
            pause: REFUSED_PAUSE_MIN,
            probing: false,
        });
    }

    /// A call failed without saying why, in a way that may hide a refusal (the Redis Cluster
    /// client reports nodes that refused the connection only as "no connection"): runs
    /// `probe` to find out, and holds back if it is refused. At most one at a time, and one
    /// per [`REFUSED_PAUSE_MIN`]. Needs a tokio runtime.
    pub(crate) fn diagnose<F, Fut>(self: &Arc<Self>, node: &str, probe: F)
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        {
            let mut state = self.state();
            let recent = state
                .diagnosed
                .is_some_and(|at| at.elapsed() < REFUSED_PAUSE_MIN);
            if state.refused.is_some() || state.diagnosing || recent {
                return;
            }
            state.diagnosing = true;
            state.diagnosed = Some(Instant::now());
        }
        let probe = probe();
        let refusals = Arc::clone(self);
        let node = node.to_owned();
        tokio::spawn(async move {
            let result = tokio::time::timeout(PROBE_TIMEOUT, probe).await;
            refusals.state().diagnosing = false;
            if let Ok(Err(e)) = result {
                refusals.after_call(&node, Some(&e));
            }
        });
    }

    /// Whether calls are being held back now.
    pub(crate) fn holding_back(&self) -> bool {
        self.state().refused.is_some()
    }
}

/// What to check, for the log line of a refusal.
fn refusal_hint(e: &StoreError) -> &'static str {
    match e {
        StoreError::Tls(_) => {
            "TLS handshake with Redis failed: check --redis-ca (the CA that signed Redis' \
             certificate), --redis-client-cert / --redis-client-key (a certificate Redis' \
             tls-ca-cert-file trusts) and that the URL's host is named in Redis' certificate"
        }
        _ => {
            "Redis refused authentication: check --redis-username and the password \
             (--redis-password-file or TOLLGATE_REDIS_PASSWORD) against Redis' ACL"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// Lets the pause run out at once.
    fn expire(r: &Refusals) {
        if let Some(refused) = r.state().refused.as_mut() {
            refused.until = Instant::now();
        }
    }

    fn pause(r: &Refusals) -> Duration {
        r.state()
            .refused
            .as_ref()
            .map(|s| s.pause)
            .unwrap_or_default()
    }

    /// Runs `before_call` with a probe that answers `answer` and counts its runs; waits for
    /// the probe (if one started) to report.
    async fn attempt(
        r: &Arc<Refusals>,
        answer: Result<(), StoreError>,
        probes: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Result<Attempt, StoreError> {
        let counter = Arc::clone(probes);
        let result = r.before_call("n", move || async move {
            counter.fetch_add(1, Ordering::SeqCst);
            answer
        });
        // A started probe reports by itself; wait (bounded) until it has.
        for _ in 0..200 {
            if !r.state().refused.as_ref().is_some_and(|s| s.probing) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        result
    }

    #[tokio::test]
    async fn refusals_hold_calls_back_and_probe_once_per_pause() {
        let r = Arc::new(Refusals::default());
        let probes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        assert_eq!(attempt(&r, Ok(()), &probes).await, Ok(Attempt::Go));
        let refused = StoreError::Auth("WRONGPASS".into());
        // Many calls in flight fail at once: one refusal, one pause.
        for _ in 0..5 {
            r.after_call("n", Some(&refused));
        }
        // Other errors say nothing about the credentials.
        r.after_call("n", Some(&StoreError::Loading));
        assert!(r.holding_back());
        assert_eq!(pause(&r), REFUSED_PAUSE_MIN);
        // While the pause runs: the refusal, at once, and no probe.
        assert_eq!(attempt(&r, Ok(()), &probes).await, Err(refused.clone()));
        assert_eq!(probes.load(Ordering::SeqCst), 0);
        // The pause is over: one probe, refused again: a longer pause.
        expire(&r);
        assert_eq!(
            attempt(&r, Err(refused.clone()), &probes).await,
            Err(refused.clone())
        );
        assert_eq!(probes.load(Ordering::SeqCst), 1);
        assert_eq!(pause(&r), REFUSED_PAUSE_MIN * 2);
        assert_eq!(attempt(&r, Ok(()), &probes).await, Err(refused.clone()));
        assert_eq!(
            probes.load(Ordering::SeqCst),
            1,
            "no probe before the pause is over"
        );
        // A probe that cannot reach Redis keeps the pause.
        expire(&r);
        let _ = attempt(&r, Err(StoreError::Timeout(PROBE_TIMEOUT)), &probes).await;
        assert_eq!(pause(&r), REFUSED_PAUSE_MIN * 2);
        assert!(r.holding_back());
        // The pause never grows beyond the maximum.
        for _ in 0..10 {
            expire(&r);
            let _ = attempt(&r, Err(refused.clone()), &probes).await;
        }
        assert_eq!(pause(&r), REFUSED_PAUSE_MAX);
        // A probe that gets through ends it; the next call reconnects, the ones after go on.
        expire(&r);
        let _ = attempt(&r, Ok(()), &probes).await;
        assert!(!r.holding_back());
        assert_eq!(attempt(&r, Ok(()), &probes).await, Ok(Attempt::Reconnect));
        assert_eq!(attempt(&r, Ok(()), &probes).await, Ok(Attempt::Go));
    }

    #[tokio::test]
    async fn a_diagnosis_finds_a_hidden_refusal_once() {
        let r = Arc::new(Refusals::default());
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let probe = |answer: Result<(), StoreError>| {
            let runs = Arc::clone(&runs);
            move || async move {
                runs.fetch_add(1, Ordering::SeqCst);
                answer
            }
        };
        let settle = || async {
            for _ in 0..200 {
                if !r.state().diagnosing {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        // Not refused: nothing held back; no second diagnosis right away.
        r.diagnose("n", probe(Err(StoreError::Connection("refused".into()))));
        settle().await;
        assert!(!r.holding_back());
        r.diagnose("n", probe(Ok(())));
        settle().await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Later, a diagnosis that meets a refusal starts holding back.
        r.state().diagnosed = None;
        r.diagnose("n", probe(Err(StoreError::Auth("WRONGPASS".into()))));
        settle().await;
        assert!(r.holding_back());
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }
}
