//! What a regional limiter holds of one global bucket (`policy`, `key`), and how it hands it
//! to the region's Envoys. Pure: time comes in as an argument (the limiter's monotonic clock).
//!
//! The region receives from the parent limiter what any instance receives: **leases**
//! (tokens, spendable until they expire) and, when the parent's bucket cannot give the
//! region's demand, an **assignment** (a share of the parent's rate for one period, which
//! the region may only spend as it drips in). The reservoir passes these on to the region's
//! instances the same way the parent would: leases out of what it holds, and, while it drips,
//! *sub-assignments* — shares of its own share, by the instances' reported demand.
//!
//! Why the region never spends more than the parent gave it:
//! * a lease handed out takes whole tokens that are there now: held leases first (the ones
//!   that expire first), then what has dripped and is not committed yet;
//! * a sub-share `s` for a period `p` commits `s × p` of the drip at once (the drip's
//!   `given` may run ahead of what has dripped, as the parent's bucket runs into debt), and
//!   every sub-assignment ends no later than the drip, with `Σ s ≤` the region's share;
//!   so what the instances may drip never exceeds what the region's drip brings;
//! * an instance that asks again ends its running sub-assignment: its undripped rest is
//!   committed no more (the instance stopped its drip when it asked);
//! * the region asks the parent for nothing while its own assignment runs (a new answer
//!   ends the parent's holding and takes its undripped rest back): its drip stops a little
//!   before the parent's holding ends ([`Terms::renew_lead_ms`]), every sub-assignment ends
//!   by then, and the region renews then.
//!
//! A late return is not refused while it can arrive: the region remembers each lease it
//! hands out, with the parent leases its tokens came from ([`Sources`]), for as long as a
//! plain limiter remembers a lease id ([`Terms::record_lifetime_ms`]). Returned tokens go back
//! into the parent lease they came from while it is live, else on to the parent under its id
//! ([`Reservoir::give_back_to`]).
//!
//! The tests (`ledger/tests.rs`) drive random asks, returns and parent answers against a
//! model of instances that spend everything they are given as soon as they may, and check
//! that they never spend more than the parent gave.

use crate::store::Grant;

/// Float slack when comparing tokens (as in the core).
const EPSILON: f64 = 1e-9;

/// Most instances one reservoir tracks; beyond them an instance gets leases only.
pub const MAX_HOLDERS: usize = 64;

/// A sub-assignment shorter than this is not worth an answer: the instance waits for the
/// region's renewal instead.
const MIN_SUB_PERIOD_MS: u64 = 10;

/// How much of its demand the region asks the parent for at once, in ms of that demand.
const WANT_HORIZON_MS: f64 = 1_000.0;

/// Below this much of its demand (in ms), the region refills in the background.
const LOW_WATER_MS: f64 = 500.0;

/// A lease id handed to an instance is remembered at least this long after its lease can no
/// longer be spent (its TTL, plus the period of a sub-share): the instance's return of an
/// expired lease comes from its periodic tick, within a fraction of this.
pub const RETURN_SLACK_MS: u64 = 1_000;

/// Terms the region gives its instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    /// How long a lease the region hands out may be spent (at most what its source has left).
    pub lease_ttl_ms: u64,
    /// Longest sub-assignment (at most what the region's drip has left).
    pub period_ms: u64,
    /// The region stops its drip this long before the parent's assignment would end, and
    /// renews then (at most a quarter of the assignment): the parent still holds the region's
    /// share when the renewal arrives, so it splits the rate by demand instead of handing it
    /// to whichever region asks first after the end. It must exceed the round trip to the
    /// parent; the parent takes back the rest of the old share, so nothing is lost.
    pub renew_lead_ms: u64,
    /// How long a lease id handed to an instance is remembered, for replays and returns: the
    /// limiter's `--dedup-ttl`, what a plain limiter keeps a lease id for (at least the
    /// lease's life plus [`RETURN_SLACK_MS`], see [`Terms::record_lifetime_ms`]).
    pub remember_ms: u64,
}

impl Terms {
    /// How long the record of a lease with a sub-share of `period_ms` (0: none) is kept after
    /// it is handed out: `remember_ms`, and never less than the lease can be spent plus
    /// [`RETURN_SLACK_MS`], so the instance's return of what it did not spend is taken.
    pub fn record_lifetime_ms(&self, period_ms: u64) -> u64 {
        let spendable = self.lease_ttl_ms.saturating_add(period_ms);
        self.remember_ms
            .max(spendable.saturating_add(RETURN_SLACK_MS))
    }
}

/// Where the tokens of a lease handed to an instance came from: the parent's lease ids, and
/// how many each gave. What the instance returns when the reservoir holds nothing live any
/// more goes back to the parent under these ids (the parent takes back at most what each of
/// its leases gave, so the split only has to be right in total).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sources(Vec<(String, u64)>);

impl Sources {
    fn add(&mut self, id: &str, tokens: u64) {
        if tokens == 0 {
            return;
        }
        match self.0.iter_mut().find(|(source, _)| source == id) {
            Some((_, n)) => *n = n.saturating_add(tokens),
            None => self.0.push((id.to_owned(), tokens)),
        }
    }

    /// Takes `tokens` out of the sources, most recent source first: (parent lease id, tokens)
    /// to give back to the parent. Less than `tokens` in all if the sources hold less.
    pub fn take(&mut self, mut tokens: u64) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (id, n) in self.0.iter_mut().rev() {
            if tokens == 0 {
                break;
            }
            let part = tokens.min(*n);
            if part > 0 {
                *n -= part;
                tokens -= part;
                out.push((id.clone(), part));
            }
        }
        self.0.retain(|(_, n)| *n > 0);
        out
    }

    /// Tokens the sources still account for.
    pub fn total(&self) -> u64 {
        self.0.iter().map(|(_, n)| *n).sum()
    }
}

/// One instance's ask (as validated by the service).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask<'a> {
    pub min: u64,
    pub want: u64,
    pub holder: Option<&'a str>,
    pub demand_per_ms: f64,
}

/// What the parent answered to one ask of the region.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    pub granted: u64,
    /// The lease's `expires_ms`, counted by the region from when it *sent* the ask.
    pub expires_ms: u64,
    pub share_per_ms: f64,
    pub period_ms: u64,
    /// When nothing was given: how long until asking again may give something.
    pub retry_after_ms: u64,
}

/// What the region asks the parent for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ParentAsk {
    pub min: u64,
    pub want: u64,
    /// The region's demand: the sum of its instances' reported demands, units per ms.
    pub demand_per_ms: f64,
}

/// The answer to an instance's ask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Answer {
    /// Tokens, a sub-share, or a denial with the time to ask again.
    Decided(Grant),
    /// The reservoir holds nothing and the parent has not said to wait: ask the parent.
    Dry,
}

#[derive(Debug, Clone, PartialEq)]
struct Held {
    /// The parent's lease id (to give unused tokens back to it).
    id: String,
    left: u64,
    expires_ms: u64,
}

#[derive(Debug, Clone, PartialEq)]
struct Drip {
    /// The parent's lease id of the assignment.
    id: String,
    share_per_ms: f64,
    from_ms: u64,
    ends_ms: u64,
    /// What has dripped by its end and is not handed out is spendable until then.
    expires_ms: u64,
    /// Tokens handed out as leases plus sub-shares committed (`s × p`), minus refunds.
    given: f64,
}

impl Drip {
    fn accrued(&self, now_ms: u64) -> f64 {
        let until = now_ms.min(self.ends_ms);
        self.share_per_ms * until.saturating_sub(self.from_ms) as f64
    }

    /// Whole tokens that have dripped and are not handed out or committed.
    fn spendable(&self, now_ms: u64) -> u64 {
        let free = (self.accrued(now_ms) - self.given + EPSILON).floor();
        if free.is_finite() && free > 0.0 {
            free as u64
        } else {
            0
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Holder {
    id: String,
    share_per_ms: f64,
    ends_ms: u64,
    demand_per_ms: f64,
    seen_ms: u64,
}

/// Tokens that left the reservoir without being handed out, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expired {
    pub tokens: u64,
}

/// What a region holds of one global bucket.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reservoir {
    /// Leases from the parent, earliest expiry first.
    leases: Vec<Held>,
    drip: Option<Drip>,
    holders: Vec<Holder>,
    /// The largest `min` and `want` an instance asked for while the reservoir was dry.
    pending_min: u64,
    pending_want: u64,
    /// The parent said nothing is there until then.
    parent_wait_until_ms: u64,
    /// Last time an instance asked.
    pub last_ask_ms: u64,
    /// Where the last decided ask's tokens came from ([`Reservoir::take_sources`]).
    drawn: Sources,
}

impl Reservoir {
    /// Whole tokens the reservoir can hand out now.
    pub fn spendable(&self, now_ms: u64) -> u64 {
        let leased: u64 = self
            .leases
            .iter()
            .filter(|h| h.expires_ms > now_ms)
            .map(|h| h.left)
            .sum();
        leased + self.drip.as_ref().map_or(0, |d| d.spendable(now_ms))
    }

    /// What the region still holds from the parent: leased tokens, what has dripped and is
    /// not handed out, and the rest of its share until the drip stops (some of it committed
    /// to its instances' sub-assignments).
    pub fn held(&self, now_ms: u64) -> u64 {
        let rest = self.drip.as_ref().map_or(0.0, |d| {
            d.share_per_ms * d.ends_ms.saturating_sub(now_ms) as f64
        });
        self.spendable(now_ms) + rest.floor().max(0.0) as u64
    }

    /// When the region's running drip stops (and it renews), if it has one.
    pub fn drip_ends_ms(&self) -> Option<u64> {
        self.drip.as_ref().map(|d| d.ends_ms)
    }

    /// Whether the region's assignment from the parent is still dripping.
    pub fn dripping(&self, now_ms: u64) -> bool {
        self.drip.as_ref().is_some_and(|d| d.ends_ms > now_ms)
    }

    /// Holds nothing and nobody asked for a while: the reservoir can be forgotten.
    pub fn idle(&self, now_ms: u64, quiet_ms: u64) -> bool {
        self.leases.is_empty()
            && self.drip.is_none()
            && self.holders.iter().all(|h| h.ends_ms <= now_ms)
            && now_ms.saturating_sub(self.last_ask_ms) >= quiet_ms
    }

    /// Drops what has expired: leases past their end, an ended drip (what dripped and was
    /// not handed out stays spendable until the drip's lease expiry), ended sub-shares, and
    /// instances not heard from for two periods.
    pub fn expire(&mut self, now_ms: u64, terms: Terms) -> Expired {
        let mut expired = 0u64;
        self.leases.retain(|h| {
            let live = h.expires_ms > now_ms;
            if !live {
                expired += h.left;
            }
            live
        });
        if let Some(drip) = &self.drip {
            if drip.ends_ms <= now_ms {
                let rest = drip.spendable(drip.ends_ms);
                if drip.expires_ms > now_ms {
                    if rest > 0 {
                        let (id, expires) = (drip.id.clone(), drip.expires_ms);
                        self.insert_lease(id, rest, expires);
                    }
                } else {
                    expired += rest;
                }
                self.drip = None;
            }
        }
        for h in &mut self.holders {
            if h.ends_ms <= now_ms {
                h.share_per_ms = 0.0;
            }
        }
        let forget_after = terms.period_ms.saturating_mul(2).max(terms.lease_ttl_ms);
        self.holders
            .retain(|h| h.share_per_ms > 0.0 || now_ms.saturating_sub(h.seen_ms) < forget_after);
        Expired { tokens: expired }
    }

    fn insert_lease(&mut self, id: String, left: u64, expires_ms: u64) {
        let at = self
            .leases
            .iter()
            .position(|h| h.expires_ms > expires_ms)
            .unwrap_or(self.leases.len());
        self.leases.insert(
            at,
            Held {
                id,
                left,
                expires_ms,
            },
        );
    }

    /// Takes `n` tokens (`n ≤ spendable`): leases that expire first, then the drip. Returns
    /// the earliest expiry among the leases drawn from (`None`: all from the drip).
    fn take(&mut self, mut n: u64, now_ms: u64) -> Option<u64> {
        let mut earliest = None;
        for h in self.leases.iter_mut().filter(|h| h.expires_ms > now_ms) {
            if n == 0 {
                break;
            }
            let part = n.min(h.left);
            if part > 0 {
                h.left -= part;
                n -= part;
                earliest = Some(earliest.map_or(h.expires_ms, |e: u64| e.min(h.expires_ms)));
                self.drawn.add(&h.id, part);
            }
        }
        // Spent leases stay until they expire: returned tokens may go back into them.
        if n > 0 {
            if let Some(drip) = &mut self.drip {
                drip.given += n as f64;
                self.drawn.add(&drip.id, n);
            }
        }
        earliest
    }

    /// The instance's record, created (while there is room) with its demand; ends its running
    /// sub-assignment (the undripped rest is committed no more).
    fn holder_entry(&mut self, ask: &Ask<'_>, now_ms: u64) -> Option<usize> {
        let id = ask.holder?;
        let index = match self.holders.iter().position(|h| h.id == id) {
            Some(i) => i,
            None if self.holders.len() < MAX_HOLDERS => {
                self.holders.push(Holder {
                    id: id.to_owned(),
                    share_per_ms: 0.0,
                    ends_ms: now_ms,
                    demand_per_ms: 0.0,
                    seen_ms: now_ms,
                });
                self.holders.len() - 1
            }
            None => return None,
        };
        let holder = self.holders.get_mut(index)?;
        if holder.share_per_ms > 0.0 && holder.ends_ms > now_ms {
            let rest = holder.share_per_ms * (holder.ends_ms - now_ms) as f64;
            if let Some(drip) = &mut self.drip {
                drip.given -= rest;
            }
        }
        holder.share_per_ms = 0.0;
        holder.ends_ms = now_ms;
        holder.demand_per_ms = ask.demand_per_ms;
        holder.seen_ms = now_ms;
        Some(index)
    }

    /// Decides an instance's ask at `now_ms` (after [`Reservoir::expire`]); `remaining` is
    /// what the reservoir can still hand out.
    pub fn ask(&mut self, ask: Ask<'_>, now_ms: u64, terms: Terms) -> Answer {
        self.drawn = Sources::default();
        match self.decide(ask, now_ms, terms) {
            Answer::Decided(mut grant) => {
                grant.remaining = self.spendable(now_ms) as f64;
                Answer::Decided(grant)
            }
            Answer::Dry => Answer::Dry,
        }
    }

    fn decide(&mut self, ask: Ask<'_>, now_ms: u64, terms: Terms) -> Answer {
        self.last_ask_ms = now_ms;
        let holder = self.holder_entry(&ask, now_ms);
        let min = ask.min.max(1);
        let want = ask.want.max(min);
        let spendable = self.spendable(now_ms);
        let dripping = self.dripping(now_ms);

        if !dripping || spendable >= want {
            if spendable >= min {
                let granted = spendable.min(want);
                let source_ends = self.take(granted, now_ms);
                let expires = lease_expiry(source_ends, now_ms, terms);
                return Answer::Decided(grant(granted, expires, 0.0, 0, 0));
            }
            self.pending_min = self.pending_min.max(min);
            self.pending_want = self.pending_want.max(want);
            if self.parent_wait_until_ms > now_ms {
                let wait = self.parent_wait_until_ms - now_ms;
                return Answer::Decided(grant(0, 0, 0.0, 0, wait));
            }
            return Answer::Dry;
        }

        // The region is on an assignment and cannot give the demand what it asks: all that is
        // spendable goes out now, and a share of the region's share by demand.
        let Some(drip) = self.drip.clone() else {
            return Answer::Dry;
        };
        let mut granted = 0;
        let mut source_ends = None;
        if spendable >= min {
            granted = spendable;
            source_ends = self.take(granted, now_ms);
        }
        let mut share = 0.0;
        let mut period_ms = 0;
        if let Some(index) = holder {
            let (mut others, mut total_demand) = (0.0, 0.0);
            for (i, h) in self.holders.iter().enumerate() {
                total_demand += h.demand_per_ms;
                if i != index && h.ends_ms > now_ms {
                    others += h.share_per_ms;
                }
            }
            let rate = drip.share_per_ms;
            let target = if total_demand <= rate {
                ask.demand_per_ms
            } else {
                rate * ask.demand_per_ms / total_demand
            };
            period_ms = terms.period_ms.min(drip.ends_ms - now_ms);
            share = target.min(rate - others);
            if share.is_nan() || share <= rate * 1e-6 || period_ms < MIN_SUB_PERIOD_MS {
                share = 0.0;
                period_ms = 0;
            }
            if let (Some(h), Some(d)) = (self.holders.get_mut(index), self.drip.as_mut()) {
                if share > 0.0 {
                    h.share_per_ms = share;
                    h.ends_ms = now_ms + period_ms;
                    d.given += share * period_ms as f64;
                    let whole = (share * period_ms as f64).floor();
                    if whole >= 1.0 {
                        self.drawn.add(&d.id, whole as u64);
                    }
                }
            }
        }
        if granted == 0 && share == 0.0 {
            // Ask again when `min` has dripped, or when the region renews.
            let missing = min as f64 - (drip.accrued(now_ms) - drip.given);
            let until_end = drip.ends_ms - now_ms;
            let wait = if drip.share_per_ms > 0.0 {
                ((missing / drip.share_per_ms).ceil() as u64).clamp(1, until_end.max(1))
            } else {
                until_end.max(1)
            };
            return Answer::Decided(grant(0, 0, 0.0, 0, wait));
        }
        let expires = lease_expiry(source_ends, now_ms, terms);
        Answer::Decided(grant(granted, expires, share, period_ms, 0))
    }

    /// Where the tokens of the last decided ask came from (its answer's [`Sources`]).
    pub fn take_sources(&mut self) -> Sources {
        std::mem::take(&mut self.drawn)
    }

    /// Takes back `unused` tokens an instance returns: into the lease that expires first (no
    /// later than any the tokens can have come from), else into the running drip. With
    /// neither, the reservoir cannot hold them: they are returned as not taken (the caller
    /// gives them back to the parent under the lease's [`Sources`]).
    pub fn give_back(&mut self, unused: u64, now_ms: u64) -> Expired {
        if unused == 0 {
            return Expired::default();
        }
        if let Some(h) = self.leases.iter_mut().find(|h| h.expires_ms > now_ms) {
            h.left += unused;
            return Expired::default();
        }
        if let Some(drip) = self.drip.as_mut().filter(|d| d.ends_ms > now_ms) {
            drip.given -= unused as f64;
            return Expired::default();
        }
        Expired { tokens: unused }
    }

    /// Takes back `unused` tokens an instance returns, each part into the parent lease it
    /// came from (`sources`, the instance lease's) while that lease is live, or into the
    /// running drip it came from. A part whose source has ended (or was given back already)
    /// cannot be held any more: it comes out as (parent lease id, tokens) to give back to the
    /// parent, which takes back at most what each of its leases gave. Putting a part into
    /// another lease instead would make that lease give back more than the parent gave it.
    pub fn give_back_to(
        &mut self,
        unused: u64,
        sources: &mut Sources,
        now_ms: u64,
    ) -> Vec<(String, u64)> {
        let mut onward = Vec::new();
        for (id, part) in sources.take(unused) {
            if let Some(h) = self
                .leases
                .iter_mut()
                .find(|h| h.id == id && h.expires_ms > now_ms)
            {
                h.left += part;
            } else if let Some(drip) = self
                .drip
                .as_mut()
                .filter(|d| d.id == id && d.ends_ms > now_ms)
            {
                drip.given -= part as f64;
            } else {
                onward.push((id, part));
            }
        }
        onward
    }

    /// What to ask the parent for now, if anything: nothing while the region's assignment
    /// drips or the parent said to wait; else when an instance found the reservoir dry, or
    /// when what it holds is below half a second of the region's demand. It asks for a second
    /// of that demand, and at least what a waiting instance wanted.
    pub fn parent_ask(&self, now_ms: u64, capacity: u64) -> Option<ParentAsk> {
        if self.dripping(now_ms) || self.parent_wait_until_ms > now_ms {
            return None;
        }
        let demand: f64 = self
            .holders
            .iter()
            .filter(|h| now_ms.saturating_sub(h.seen_ms) < 2 * WANT_HORIZON_MS as u64)
            .map(|h| h.demand_per_ms)
            .sum();
        let spendable = self.spendable(now_ms);
        let low_water = (demand * LOW_WATER_MS).ceil();
        if self.pending_min == 0 && (demand <= 0.0 || spendable as f64 >= low_water) {
            return None;
        }
        let capacity = capacity.max(1);
        let min = self.pending_min.clamp(1, capacity);
        let want = ((demand * WANT_HORIZON_MS).ceil() as u64)
            .max(self.pending_want)
            .clamp(min, capacity);
        Some(ParentAsk {
            min,
            want,
            demand_per_ms: demand,
        })
    }

    /// Takes in what the parent answered to ask `id`, sent at `sent_ms`, arriving at `now_ms`.
    pub fn receive(&mut self, id: &str, got: &Received, sent_ms: u64, now_ms: u64, terms: Terms) {
        self.pending_min = 0;
        self.pending_want = 0;
        if got.granted > 0 {
            let expires = sent_ms.saturating_add(got.expires_ms);
            self.insert_lease(id.to_owned(), got.granted, expires);
        }
        if got.share_per_ms > 0.0 && got.period_ms > 0 && !self.dripping(now_ms) {
            // The drip starts when the answer arrives (never sooner than the parent assumed)
            // and stops the renewal lead before the parent's holding ends.
            let lead = terms.renew_lead_ms.min(got.period_ms / 4);
            self.drip = Some(Drip {
                id: id.to_owned(),
                share_per_ms: got.share_per_ms,
                from_ms: now_ms,
                ends_ms: now_ms.saturating_add(got.period_ms - lead),
                expires_ms: sent_ms.saturating_add(got.expires_ms),
                given: 0.0,
            });
        }
        if got.granted == 0 && got.share_per_ms <= 0.0 {
            self.parent_wait_until_ms = now_ms.saturating_add(got.retry_after_ms.max(1));
        }
    }

    /// Leases about to expire (within `margin_ms`) with tokens left: taken out of the
    /// reservoir, to give back to the parent before they are lost, as (parent lease id,
    /// tokens).
    pub fn take_expiring(&mut self, now_ms: u64, margin_ms: u64) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        self.leases.retain(|h| {
            let expiring = h.expires_ms > now_ms && h.expires_ms <= now_ms + margin_ms;
            if expiring && h.left > 0 {
                out.push((h.id.clone(), h.left));
            }
            !expiring
        });
        out
    }
}

fn lease_expiry(source_ends_ms: Option<u64>, now_ms: u64, terms: Terms) -> u64 {
    match source_ends_ms {
        Some(ends) => terms.lease_ttl_ms.min(ends.saturating_sub(now_ms)),
        None => terms.lease_ttl_ms,
    }
}

fn grant(granted: u64, expires_ms: u64, share: f64, period_ms: u64, retry_after_ms: u64) -> Grant {
    Grant {
        granted,
        remaining: 0.0,
        retry_after_ms,
        replayed: false,
        share_per_ms: share,
        period_ms,
        expires_ms: Some(if share > 0.0 {
            expires_ms.saturating_add(period_ms)
        } else {
            expires_ms
        }),
    }
}

#[cfg(test)]
mod tests;
