//! Settle: what an admitted request really cost, applied to its key's record when the
//! response says it (a header, a trailer, the body), and its in-flight slot freed when the
//! stream ends, however it ends.
//!
//! Reserved but unused units go back where they were taken from: the token bucket (local), or
//! this instance's lease (global; what stays unspent there is returned to the limiter by the
//! existing return call when the lease expires). Units used beyond the reservation are charged:
//! the bucket goes below zero, or the lease carries a debt that the next tokens pay, by at most
//! the policy's `max_debt`; until then the key's requests are refused with a `Retry-After` that
//! covers it. A stream that ends without a usable actual cost follows `settle.on_missing`.

use super::step::bucket_limits;
use super::{Admission, Engine, Spent};
use crate::shared::{SharedData, StoreAt};
use crate::table::TableError;
use tollgate_core::bucket;
use tollgate_core::policy::OnMissingUsage;

/// What the response said a request cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// The actual cost, in the policy's units.
    Known(u64),
    /// The stream ended without a usable actual cost (reset, upstream error, missing field).
    Missing,
}

/// What finishing one admission did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settlement {
    /// The units the request is accounted for in the end (when it was settled).
    pub settled: Option<u64>,
    pub refunded: u64,
    /// Charged as debt on the key.
    pub charged: u64,
    /// Beyond `max_debt`: not charged.
    pub uncharged: u64,
    /// The stream had no usable actual cost.
    pub missing: bool,
    /// Its in-flight slot was freed (false when it had expired already).
    pub released: bool,
    /// Other slots of the key that expired meanwhile (their release never came).
    pub slots_expired: u64,
}

impl Engine {
    /// Settles an admission against `usage` (when given) and frees its in-flight slot (when
    /// `release`), in one table update.
    pub fn finish(
        &self,
        at: StoreAt<'_, impl SharedData>,
        admission: &Admission,
        usage: Option<Usage>,
        release: bool,
    ) -> Result<Settlement, TableError> {
        let now_ms = at.now_ms;
        let Some(policy) = self
            .policies
            .policies
            .get(admission.policy)
            .map(|p| p.rated_bucket(&admission.bucket_id))
        else {
            return Ok(Settlement::default());
        };
        let settle = policy.settle.as_ref();
        let actual = match (usage, settle) {
            (Some(Usage::Known(units)), Some(_)) => Some(units),
            (Some(Usage::Missing), Some(s)) => Some(match s.on_missing {
                OnMissingUsage::Keep => admission.reserved,
                OnMissingUsage::Refund => 0,
            }),
            _ => None,
        };
        let slot = admission.slot.zip(policy.in_flight).filter(|_| release);
        if actual.is_none() && slot.is_none() {
            return Ok(Settlement::default());
        }
        self.table.update(at, &admission.bucket_id, |record| {
            let mut out = Settlement {
                missing: usage == Some(Usage::Missing),
                ..Settlement::default()
            };
            if let (Some(actual), Some(settle)) = (actual, settle) {
                let reserved = admission.reserved;
                let done = match admission.spent {
                    Spent::Bucket => {
                        let limits = bucket_limits(policy);
                        let (state, done) = bucket::settle(
                            &limits,
                            record.bucket,
                            now_ms,
                            reserved,
                            actual,
                            settle.max_debt,
                        );
                        record.bucket = Some(state);
                        Some(done)
                    }
                    Spent::Lease => {
                        let lease = &mut record.lease;
                        let mut done = bucket::Settled::default();
                        if actual <= reserved {
                            done.refunded = reserved - actual;
                            lease.tokens = lease.tokens.saturating_add(done.refunded);
                        } else {
                            let excess = actual - reserved;
                            done.charged = excess.min(settle.max_debt.saturating_sub(lease.debt));
                            done.uncharged = excess - done.charged;
                            lease.debt += done.charged;
                        }
                        crate::global::pay_debt(lease);
                        Some(done)
                    }
                    // Admitted by a failure mode: nothing was taken, nothing goes back.
                    Spent::Nothing => None,
                };
                if let Some(done) = done {
                    out.settled = Some(actual);
                    out.refunded = done.refunded;
                    out.charged = done.charged;
                    out.uncharged = done.uncharged;
                }
            }
            if let Some((epoch, limit)) = slot {
                out.slots_expired = record.in_flight.advance(limit.timeout_ms, now_ms);
                out.released = record.in_flight.release(epoch, limit.timeout_ms, now_ms);
            }
            super::commit::mark_evictable(record, policy, now_ms);
            out
        })
    }
}
