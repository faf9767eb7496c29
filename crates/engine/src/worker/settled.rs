//! Units of finished requests the limiter has not been told of yet: counted per policy as
//! requests settle, carried by the next callout (global policies only), and kept for the one
//! after when a callout cannot be sent.

use super::Worker;
use crate::engine::Engine;
use std::collections::BTreeMap;

impl Worker {
    /// The settled units to report with a callout, by policy name (global policies only: the
    /// limiter owns their budgets); the counts start again from zero.
    pub(super) fn take_settled(&mut self, engine: &Engine) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for (index, units) in self.settled.iter_mut().enumerate() {
            if let (Some(policy), 1..) = (engine.policy(index), *units) {
                if policy.scope.uses_limiter() {
                    out.insert(policy.name.clone(), std::mem::take(units));
                }
            }
        }
        out
    }

    /// Settled units a callout that could not be sent did not report: they go with the next.
    pub(super) fn restore_settled(&mut self, engine: &Engine, settled: BTreeMap<String, u64>) {
        for (name, units) in settled {
            if let Some(index) = engine.policies.policies.iter().position(|p| p.name == name) {
                self.note_settled(index, units);
            }
        }
    }

    /// Counts the settled units of a finished request, to be reported to the limiter.
    pub fn note_settled(&mut self, policy: usize, units: u64) {
        if self.settled.len() <= policy {
            self.settled.resize(policy + 1, 0);
        }
        if let Some(total) = self.settled.get_mut(policy) {
            *total = total.saturating_add(units);
        }
    }
}
