//! Detection of connections that silently stopped answering.
//!
//! redis-rs reconnects when a connection reports an error. A connection that just stops
//! answering — a peer that vanished without a reset, a partition, a middlebox that dropped its
//! state — reports nothing: the service gives up on each call at its store timeout, and the
//! next call waits on the same dead connection again, forever. The Redis stores therefore
//! remember, per node, when the oldest call still waiting for an answer started; any answer
//! from that node clears it, and a call starting when the node has been silent for longer
//! than [`RECONNECT_AFTER`] makes the store replace its connection.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a node's oldest unanswered call may wait before the connection is replaced.
/// Far above any healthy answer time (a store call's deadline is tens of ms), far below what
/// an operator would otherwise wait for before restarting the limiter.
pub const RECONNECT_AFTER: Duration = Duration::from_secs(3);

/// Per node: when its oldest call still waiting for an answer started.
#[derive(Debug, Default)]
pub(crate) struct Watchdog {
    waiting: Mutex<HashMap<String, Instant>>,
}

impl Watchdog {
    fn waiting(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        // The map is valid whatever a panicking holder did to it: every entry is a start time.
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A call to `node` starts; whether `node` has been silent longer than `after`.
    pub(crate) fn call_starts(&self, node: &str, after: Duration) -> bool {
        let now = Instant::now();
        let mut waiting = self.waiting();
        match waiting.get(node) {
            Some(oldest) => now.saturating_duration_since(*oldest) > after,
            None => {
                waiting.insert(node.to_owned(), now);
                false
            }
        }
    }

    /// `node` answered (anything, even an error reply): its connection is alive.
    pub(crate) fn answered(&self, node: &str) {
        self.waiting().remove(node);
    }

    /// The connection was replaced: nothing is waiting on it any more.
    pub(crate) fn reset(&self) {
        self.waiting().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_only_after_a_long_silence() {
        let w = Watchdog::default();
        let after = Duration::from_millis(30);
        assert!(!w.call_starts("a", after));
        assert!(
            !w.call_starts("a", after),
            "a second call while the first waits"
        );
        std::thread::sleep(Duration::from_millis(40));
        assert!(w.call_starts("a", after), "the oldest call waited too long");
        w.answered("a");
        assert!(!w.call_starts("a", after), "an answer resets it");
        std::thread::sleep(Duration::from_millis(40));
        w.answered("a");
        assert!(!w.call_starts("a", after), "idle time is not silence");
    }

    #[test]
    fn nodes_are_watched_apart() {
        let w = Watchdog::default();
        let after = Duration::from_millis(30);
        assert!(!w.call_starts("silent", after));
        std::thread::sleep(Duration::from_millis(40));
        // Answers from another node do not vouch for the silent one.
        assert!(!w.call_starts("busy", after));
        w.answered("busy");
        assert!(w.call_starts("silent", after));
        assert!(!w.call_starts("busy", after));
        w.reset();
        assert!(
            !w.call_starts("silent", after),
            "a new connection starts afresh"
        );
    }
}
