//! Leases this worker credited, watched for their expiry: the tick takes an expired lease's
//! unspent tokens out of its record (one CAS transaction, so exactly one taker returns them)
//! and queues their return, whether or not the key gets another request.

use super::{Ctx, Host, Watched, Worker, MAX_RETURNS_PER_TICK, MAX_WATCHED, RETURN_TICK_MS};
use crate::engine::{Engine, ReturnNeed};
use crate::global;
use crate::metrics::LeaseEvent;
use crate::shared::{SharedData, StoreAt};
use crate::table::{TableError, Txn};

impl Worker {
    /// Watches `bucket_id`'s lease, credited here, for its expiry at `at_ms` (a later credit
    /// of the key moves it: the record's lease expires with its latest grant).
    pub(super) fn watch(&mut self, policy: usize, key: &str, bucket_id: &str, at_ms: u64) {
        let room = self.watched.len() < MAX_WATCHED;
        match self.watched.get_mut(bucket_id) {
            Some(watched) => {
                self.expiring
                    .remove(&(watched.at_ms, bucket_id.to_string()));
                // The earlier time: a lease found live then is watched again until the
                // expiry its record says (a windowed lease may end before `at_ms`).
                watched.at_ms = watched.at_ms.min(at_ms);
                watched.policy = policy;
            }
            None if room => {
                self.watched.insert(
                    bucket_id.to_string(),
                    Watched {
                        at_ms,
                        policy,
                        key: key.to_string(),
                    },
                );
            }
            None => return,
        }
        if let Some(watched) = self.watched.get(bucket_id) {
            self.expiring.insert((watched.at_ms, bucket_id.to_string()));
        }
    }

    /// Keys whose lease this worker watches for expiry.
    pub fn watching(&self) -> usize {
        self.watched.len()
    }

    /// Takes the unspent tokens of watched leases that have expired out of their records and
    /// queues their return (at most [`MAX_RETURNS_PER_TICK`] keys; the rest next tick). A
    /// lease that another answer has renewed meanwhile is watched again until its new expiry.
    pub(super) fn take_expired<S: SharedData, H: Host>(&mut self, ctx: &Ctx<'_, S, H>) {
        for _ in 0..MAX_RETURNS_PER_TICK {
            let Some((at_ms, bucket_id)) = self.expiring.first().cloned() else {
                break;
            };
            if at_ms > ctx.now_ms {
                break;
            }
            self.expiring.remove(&(at_ms, bucket_id.clone()));
            let Some(watched) = self.watched.remove(&bucket_id) else {
                continue;
            };
            match take_expired(ctx.engine, ctx.at(), &bucket_id) {
                Ok(LeaseExpiry::Taken { expiry, live_until }) => {
                    self.queued_returns.extend(ReturnNeed::of_expiry(
                        watched.policy,
                        &watched.key,
                        &expiry,
                    ));
                    if expiry.expired > 0 {
                        ctx.metrics
                            .lease(watched.policy, LeaseEvent::Expired(expiry.expired));
                    }
                    if let Some(until_ms) = live_until {
                        self.watch(watched.policy, &watched.key, &bucket_id, until_ms);
                    }
                }
                Ok(LeaseExpiry::Live(until_ms)) => {
                    self.watch(watched.policy, &watched.key, &bucket_id, until_ms);
                }
                Ok(LeaseExpiry::Empty) => {}
                Err(TableError::Contended) => {
                    // Requests of the key keep winning the record: look again next tick.
                    let again = ctx.now_ms.saturating_add(RETURN_TICK_MS);
                    self.watch(watched.policy, &watched.key, &bucket_id, again);
                }
                Err(error) => log::debug!("cannot look at an expired lease: {error:?}"),
            }
        }
    }
}

/// What a key's record held when the worker looked at its lease for expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseExpiry {
    /// A lease had expired: its unspent tokens were taken out of the record (to give back
    /// under their lease ids, or counted expired). `live_until`: the latest lease runs on
    /// until then (only the previous lease had expired).
    Taken {
        expiry: global::Expiry,
        live_until: Option<u64>,
    },
    /// The lease runs until then (a later answer renewed it).
    Live(u64),
    /// Nothing left to return (spent, or taken already by a request or another worker).
    Empty,
}

/// Takes the unspent tokens of `bucket_id`'s lease out of its record if the lease has expired:
/// one CAS transaction, so of every worker and request that finds the lease expired exactly
/// one gets its tokens to return. Writes nothing otherwise (never creates a record). The
/// record's eviction time is left as it was: taking tokens out never makes it later.
fn take_expired(
    engine: &Engine,
    at: StoreAt<'_, impl SharedData>,
    bucket_id: &str,
) -> Result<LeaseExpiry, TableError> {
    let now_ms = at.now_ms;
    let result = engine.table().transact(
        at,
        &[bucket_id],
        |records| {
            let Some(lease) = records.first_mut().map(|r| &mut r.lease) else {
                return Txn::Abort(LeaseExpiry::Empty);
            };
            global::accrue(lease, now_ms);
            let expiry = global::expire(lease, now_ms);
            let live =
                lease.expires_ms > now_ms && (lease.tokens > 0 || lease.drip_until_ms > now_ms);
            // The previous lease's expiry comes first, if it still has tokens to give back.
            let until_ms = if lease.prev_seq != 0 {
                lease.prev_expires_ms.min(lease.expires_ms)
            } else {
                lease.expires_ms
            };
            match expiry {
                Some(expiry) => Txn::Commit(LeaseExpiry::Taken {
                    expiry,
                    live_until: live.then_some(until_ms),
                }),
                None if live => Txn::Abort(LeaseExpiry::Live(until_ms)),
                None => Txn::Abort(LeaseExpiry::Empty),
            }
        },
        |_, _, _, _| {},
    )?;
    Ok(result.value)
}
