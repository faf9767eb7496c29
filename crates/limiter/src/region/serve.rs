//! Serving the region's instances from the reservoirs: an instance's lease of a global policy
//! (decided from what the region holds, waiting for the parent only when it holds nothing)
//! and its return of unused tokens.

use std::sync::Arc;

use tokio::sync::watch;

use super::ledger::{self, Answer};
use super::{Entry, KeyId, Record, Shared, RECORDS_PER_KEY};
use crate::clock::Clock;
use crate::store::{Grant, LeaseItem, ReturnItem, ReturnOutcome, StoreError};

/// When the reservoir is dry and the parent's answers went to others in the region: how soon
/// to ask again.
const RETRY_DRY_MS: u64 = 20;

impl Shared {
    /// One instance's lease of a global policy: decided from the reservoir, waiting for the
    /// parent (at most its deadline) only when the reservoir is dry.
    pub(super) async fn lease(self: &Arc<Self>, item: &LeaseItem) -> Result<Grant, StoreError> {
        let id: KeyId = (item.policy.clone(), item.key.clone());
        let ask = ledger::Ask {
            min: item.min,
            want: item.want,
            holder: item.holder.as_deref(),
            demand_per_ms: item.demand_per_ms,
        };
        let deadline = tokio::time::Instant::now() + self.parent.timeout();
        loop {
            let mut done = match self.decide(&id, item, ask)? {
                Decision::Decided(grant) => return Ok(grant),
                Decision::Wait(done) => done,
            };
            if tokio::time::timeout_at(deadline, done.changed())
                .await
                .is_err()
            {
                // The parent answered in time but others in the region took what it gave:
                // ask again soon (the next background ask is on its way).
                return if self.lock().parent.down_since_ms.is_none() {
                    Ok(denial(RETRY_DRY_MS))
                } else {
                    Err(StoreError::Parent(format!(
                        "no answer from the parent limiter within {:?}",
                        self.parent.timeout()
                    )))
                };
            }
        }
    }

    /// One attempt at deciding an instance's ask under the lock.
    fn decide(
        self: &Arc<Self>,
        id: &KeyId,
        item: &LeaseItem,
        ask: ledger::Ask<'_>,
    ) -> Result<Decision, StoreError> {
        let now = self.clock.now_ms();
        let mut state = self.lock();
        if !state.reservoirs.contains_key(id) {
            if state.reservoirs.len() >= self.max_keys {
                return Err(StoreError::Config(format!(
                    "the regional ledger holds --regional-keys ({}) keys",
                    self.max_keys
                )));
            }
            state.reservoirs.insert(id.clone(), Entry::new());
        }
        let backoff = Self::in_backoff(&state, now);
        let last_error = state.parent.last_error.clone();
        let Some(entry) = state.reservoirs.get_mut(id) else {
            return Err(StoreError::Protocol("reservoir vanished".into()));
        };
        if let Some(record) = entry.records.iter().find(|r| r.id == item.id) {
            return Ok(Decision::Decided(Grant {
                replayed: true,
                ..record.grant
            }));
        }
        let expired = entry.reservoir.expire(now, self.terms);
        self.metrics
            .regional_tokens(&id.0, "expired", expired.tokens);
        entry.records.retain(|r| r.until_ms > now);
        match entry.reservoir.ask(ask, now, self.terms) {
            Answer::Decided(grant) => {
                let drip = (grant.share_per_ms * grant.period_ms as f64).floor() as u64;
                let taken = grant.granted.saturating_add(drip);
                if taken > 0 {
                    self.metrics.regional_tokens(&id.0, "spent", grant.granted);
                    if entry.records.len() >= RECORDS_PER_KEY {
                        entry.records.pop_front();
                    }
                    let lives = self.terms.record_lifetime_ms(grant.period_ms);
                    let sources = entry.reservoir.take_sources();
                    entry.records.push_back(Record {
                        id: item.id.clone(),
                        grant,
                        taken,
                        returned: 0,
                        sources,
                        until_ms: now + lives,
                    });
                }
                if !backoff {
                    self.start_fetch(&mut state, id, now);
                }
                Ok(Decision::Decided(grant))
            }
            Answer::Dry => {
                if let Some((until, reason)) = &entry.refused {
                    if *until > now {
                        return Err(StoreError::Server(reason.clone()));
                    }
                }
                if backoff {
                    return Err(StoreError::Parent(format!(
                        "nothing held for this key and the parent limiter is unreachable: {last_error}"
                    )));
                }
                let done = entry.done.subscribe();
                if self.start_fetch(&mut state, id, now) {
                    Ok(Decision::Wait(done))
                } else {
                    Ok(Decision::Decided(denial(RETRY_DRY_MS)))
                }
            }
        }
    }

    /// An instance gives back unused tokens of a lease of a global policy.
    pub(super) fn give_back(self: &Arc<Self>, item: &ReturnItem) -> ReturnOutcome {
        let now = self.clock.now_ms();
        let mut state = self.lock();
        let id: KeyId = (item.policy.clone(), item.key.clone());
        let Some(entry) = state.reservoirs.get_mut(&id) else {
            return ReturnOutcome {
                now_ms: now,
                returned: 0,
            };
        };
        let Some(record) = entry.records.iter_mut().find(|r| r.id == item.id) else {
            return ReturnOutcome {
                now_ms: now,
                returned: 0,
            };
        };
        let returned = item.unused.min(record.taken - record.returned);
        record.returned += returned;
        // Back into the parent leases the tokens came from; what came from a lease or drip
        // that has ended goes on to the parent, under that lease's id.
        let sourced = record.sources.total();
        let onward = entry
            .reservoir
            .give_back_to(returned, &mut record.sources, now);
        let lost = returned.saturating_sub(sourced - record.sources.total());
        self.metrics.regional_tokens(&id.0, "expired", lost);
        drop(state);
        for (lease_id, tokens) in onward {
            self.return_to_parent(id.clone(), lease_id, tokens);
        }
        ReturnOutcome {
            now_ms: now,
            returned,
        }
    }
}

/// What one attempt at an ask came to.
enum Decision {
    Decided(Grant),
    /// Dry: wait for the parent's answer to the ask in flight.
    Wait(watch::Receiver<u64>),
}

/// Nothing now; ask again in `retry_after_ms`.
fn denial(retry_after_ms: u64) -> Grant {
    Grant {
        granted: 0,
        remaining: 0.0,
        retry_after_ms,
        replayed: false,
        share_per_ms: 0.0,
        period_ms: 0,
        expires_ms: None,
    }
}
