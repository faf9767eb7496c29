//! The record of one (policy, key): its local state (bucket, window counters, log, in-flight
//! slots) and, for a global policy, this instance's lease of the global budget.

use super::*;

/// This instance's share of a global bucket, and what it knows about the limiter.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Lease {
    /// Leased tokens not yet spent.
    pub tokens: u64,
    /// After this, unspent tokens are no longer spent (they are returned or count as expired).
    pub expires_ms: u64,
    /// Sequence number of the latest lease of this key (its id is built from it).
    pub seq: u64,
    /// What the latest lease granted: a return never gives back more.
    pub granted: u64,
    /// The lease before the latest, while tokens it granted may be unspent: its sequence
    /// number, its unspent tokens when the latest was credited (at most what it granted; part
    /// of `tokens`), and its expiry. Tokens are spent oldest first, so at expiry the latest
    /// lease keeps up to what it granted, the previous one up to `prev_tokens` of the rest,
    /// and each is returned under its own id (see `global::expire`).
    pub prev_seq: u64,
    pub prev_tokens: u64,
    pub prev_expires_ms: u64,
    /// A background refill is in flight on this instance until this time.
    pub pending_until_ms: u64,
    /// The limiter said "over limit" until this time: deny without asking again.
    pub denied_until_ms: u64,
    /// Start of the current limiter outage for this key (0: none).
    pub unavailable_since_ms: u64,
    /// Until this time requests do not wait for a callout but take the failure mode.
    pub unavailable_until_ms: u64,
    /// Demand estimate: units offered (admitted or denied) since `window_start_ms`, and the
    /// smoothed rate per second.
    pub window_start_ms: u64,
    pub window_units: u64,
    pub rate_per_s: f64,
    /// The assignment's share of the global refill rate (units per ms; kept after the drip
    /// stops, to tell a denied request when its turn comes).
    pub drip_per_ms: f64,
    /// The drip has been credited to `tokens` up to this time...
    pub drip_from_ms: u64,
    /// ...and runs until this time (stopped early when a renewal is asked for).
    pub drip_until_ms: u64,
    /// Fraction of a token dripped but not yet credited.
    pub drip_carry: f64,
    /// Requests are decided against the assignment (never waiting for a callout) until this
    /// time; covers a renewal in flight.
    pub assigned_until_ms: u64,
    /// From this time the next request asks to renew the assignment.
    pub renew_at_ms: u64,
    /// When the running assignment was received.
    pub assigned_at_ms: u64,
    /// The demand (units per second) the latest lease request reported: a demand that has
    /// since grown far beyond it renews the assignment early.
    pub asked_demand_per_s: f64,
    /// Units requests used beyond what they reserved, paid from the next tokens this instance
    /// receives; while it is not paid, the key's requests are refused.
    pub debt: u64,
}

/// The state of one (policy, key) on this Envoy instance.
#[derive(Debug, PartialEq)]
pub struct Record {
    pub id: String,
    /// Local token bucket; `None` means full (never used, or refilled).
    pub bucket: Option<BucketState>,
    pub lease: Lease,
    /// The key's requests in flight on this instance (`max_in_flight`).
    pub in_flight: Slots,
    /// Fixed window / sliding window counters (local windowed policies).
    pub counters: Option<Counters>,
    /// Sliding log (local `sliding_log` policies; at most `MAX_LOG_LIMIT` entries).
    pub log: Option<Log>,
    /// From this time the record equals a fresh one, so its slot may go to another key.
    pub evictable_at_ms: u64,
}

impl Clone for Record {
    fn clone(&self) -> Self {
        Self {
            id: self.id.clone(),
            bucket: self.bucket,
            lease: self.lease,
            in_flight: self.in_flight,
            counters: self.counters,
            log: self.log.clone(),
            evictable_at_ms: self.evictable_at_ms,
        }
    }

    /// Reuses the id's and the log's buffers (a transaction copies its records into a list
    /// kept per thread).
    fn clone_from(&mut self, source: &Self) {
        // Every field by name: a field added to `Record` fails to compile here until it is
        // copied too.
        let Record {
            id,
            bucket,
            lease,
            in_flight,
            counters,
            log,
            evictable_at_ms,
        } = source;
        self.id.clone_from(id);
        self.bucket = *bucket;
        self.lease = *lease;
        self.in_flight = *in_flight;
        self.counters = *counters;
        self.log.clone_from(log);
        self.evictable_at_ms = *evictable_at_ms;
    }
}

impl Record {
    /// Becomes `Record::fresh(id)`, keeping the id's buffer.
    pub(super) fn reset(&mut self, id: &str) {
        let mut fresh = Record::fresh("");
        std::mem::swap(&mut fresh.id, &mut self.id);
        fresh.id.clear();
        fresh.id.push_str(id);
        *self = fresh;
    }

    pub fn fresh(id: &str) -> Self {
        Self {
            id: id.to_string(),
            bucket: None,
            lease: Lease::default(),
            in_flight: Slots::default(),
            counters: None,
            log: None,
            evictable_at_ms: 0,
        }
    }
}
