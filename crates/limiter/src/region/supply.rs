//! Keeping the reservoirs supplied by the parent limiter, off the request path: background
//! asks (one in flight per key), taking in their answers, renewals when a share stops
//! dripping, the periodic sweep (expiry, returns, idle reservoirs, gauges) and returns of
//! what the region will not spend.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::ledger::Received;
use super::parent::{ParentError, ParentGrant};
use super::{KeyId, Shared, State};
use crate::clock::Clock;

/// After a failed parent call, instances finding a reservoir dry are answered UNAVAILABLE at
/// once for this long (instead of each waiting for the parent's deadline); background asks
/// try again after it.
const PARENT_BACKOFF_MS: u64 = 250;

/// Leases this close to their expiry go back to the parent with what they have left.
const RETURN_MARGIN_MS: u64 = 200;

/// A reservoir nobody asked for this long, holding nothing, is forgotten.
const IDLE_MS: u64 = 10_000;

impl Shared {
    pub(super) fn in_backoff(state: &State, now_ms: u64) -> bool {
        state.parent.down_since_ms.is_some()
            && now_ms.saturating_sub(state.parent.last_failure_ms) < PARENT_BACKOFF_MS
    }

    /// Starts a background ask of the parent for `id` if the reservoir wants one and none is
    /// in flight. Returns whether one is in flight now.
    pub(super) fn start_fetch(
        self: &Arc<Self>,
        state: &mut State,
        id: &KeyId,
        now_ms: u64,
    ) -> bool {
        let capacity = self.capacity(&id.0, &id.1);
        let Some(entry) = state.reservoirs.get_mut(id) else {
            return false;
        };
        if entry.fetching {
            return true;
        }
        if entry
            .refused
            .as_ref()
            .is_some_and(|(until, _)| *until > now_ms)
        {
            return false;
        }
        let Some(ask) = entry.reservoir.parent_ask(now_ms, capacity) else {
            return false;
        };
        entry.fetching = true;
        let shared = Arc::clone(self);
        let id = id.clone();
        tokio::spawn(async move {
            let lease_id = shared.parent.new_id();
            let sent = shared.clock.now_ms();
            let amounts = (ask.min, ask.want, ask.demand_per_ms * 1_000.0);
            let result = shared.parent.lease(&lease_id, &id.0, &id.1, amounts).await;
            let now = shared.clock.now_ms();
            shared
                .metrics
                .parent_call("lease", outcome(&result), now - sent);
            shared.received(&id, &lease_id, result, sent, now);
        });
        true
    }

    /// Takes in a parent answer (or its failure) and wakes the instances waiting for it; with
    /// a share, the renewal is scheduled for when the share stops dripping.
    fn received(
        self: &Arc<Self>,
        id: &KeyId,
        lease_id: &str,
        result: Result<ParentGrant, ParentError>,
        sent_ms: u64,
        now_ms: u64,
    ) {
        let mut state = self.lock();
        match &result {
            Ok(_) => {
                if let Some(since) = state.parent.down_since_ms.take() {
                    tracing::info!(
                        partition_ms = now_ms - since,
                        "parent limiter reachable again"
                    );
                }
            }
            Err(ParentError::Unreachable(reason)) => {
                if state.parent.down_since_ms.is_none() {
                    tracing::warn!(error = %reason, "parent limiter unreachable");
                    state.parent.down_since_ms = Some(now_ms);
                }
                state.parent.last_failure_ms = now_ms;
                state.parent.last_error = reason.clone();
            }
            Err(ParentError::Refused(_)) => {}
        }
        let Some(entry) = state.reservoirs.get_mut(id) else {
            return;
        };
        entry.fetching = false;
        match result {
            Ok(g) => {
                let got = Received {
                    granted: g.granted,
                    expires_ms: g.expires_ms,
                    share_per_ms: g.share_per_s / 1_000.0,
                    period_ms: g.period_ms,
                    retry_after_ms: g.retry_after_ms,
                };
                entry
                    .reservoir
                    .receive(lease_id, &got, sent_ms, now_ms, self.terms);
                entry.refused = None;
                if let Some(ends) = entry.reservoir.drip_ends_ms() {
                    self.renew_at(id.clone(), ends.saturating_sub(now_ms));
                }
                self.metrics.regional_tokens(&id.0, "received", g.granted);
                let drip = (got.share_per_ms * got.period_ms as f64).floor();
                if drip >= 1.0 {
                    self.metrics.regional_tokens(&id.0, "assigned", drip as u64);
                }
            }
            Err(ParentError::Refused(reason)) => {
                tracing::warn!(policy = %id.0, error = %reason, "parent limiter refused an ask");
                entry.refused = Some((now_ms + 1_000, reason));
            }
            Err(ParentError::Unreachable(_)) => {}
        }
        entry.done.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Asks the parent for `id` again in `after_ms`, when its share stops dripping: the sweep
    /// would find it up to a sweep later, and its instances' sub-shares end then.
    fn renew_at(self: &Arc<Self>, id: KeyId, after_ms: u64) {
        let shared = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(after_ms)).await;
            let now = shared.clock.now_ms();
            let mut state = shared.lock();
            if !Self::in_backoff(&state, now) {
                shared.start_fetch(&mut state, &id, now);
            }
        });
    }

    /// Expiry, returns to the parent, background asks, idle reservoirs, gauges.
    pub(super) fn sweep(self: &Arc<Self>) {
        let now = self.clock.now_ms();
        let mut returns = Vec::new();
        let mut held: HashMap<String, u64> = HashMap::new();
        {
            let mut state = self.lock();
            let backoff = Self::in_backoff(&state, now);
            let policies = self.policies.current();
            let (terms, metrics) = (self.terms, &self.metrics);
            let mut asks = Vec::new();
            // One pass, in place: no key is copied unless something is sent for it.
            state.reservoirs.retain(|id, entry| {
                let expired = entry.reservoir.expire(now, terms);
                metrics.regional_tokens(&id.0, "expired", expired.tokens);
                entry.records.retain(|r| r.until_ms > now);
                for (lease_id, tokens) in entry.reservoir.take_expiring(now, RETURN_MARGIN_MS) {
                    returns.push((id.clone(), lease_id, tokens));
                }
                let holds = entry.reservoir.held(now);
                match held.get_mut(&id.0) {
                    Some(sum) => *sum += holds,
                    None => {
                        held.insert(id.0.clone(), holds);
                    }
                }
                if entry.reservoir.idle(now, IDLE_MS) && !entry.fetching && entry.records.is_empty()
                {
                    return false;
                }
                let capacity = policies.get(&id.0).map_or(1, |p| p.rated(&id.1).burst);
                if !backoff
                    && !entry.fetching
                    && entry.reservoir.parent_ask(now, capacity).is_some()
                {
                    asks.push(id.clone());
                }
                true
            });
            for id in asks {
                self.start_fetch(&mut state, &id, now);
            }
            let partition_s = state
                .parent
                .down_since_ms
                .map_or(0.0, |since| now.saturating_sub(since) as f64 / 1_000.0);
            self.metrics
                .set_parent_reachable(state.parent.down_since_ms.is_none(), partition_s);
            self.metrics.set_regional_keys(state.reservoirs.len());
        }
        self.metrics.set_regional_held(&held);
        for (id, lease_id, tokens) in returns {
            self.return_to_parent(id, lease_id, tokens);
        }
    }

    /// Gives `tokens` of parent lease `lease_id` back to the parent in the background.
    pub(super) fn return_to_parent(self: &Arc<Self>, id: KeyId, lease_id: String, tokens: u64) {
        let shared = Arc::clone(self);
        tokio::spawn(async move {
            let sent = shared.clock.now_ms();
            let result = shared
                .parent
                .give_back(&lease_id, &id.0, &id.1, tokens)
                .await;
            let took = shared.clock.now_ms() - sent;
            shared.metrics.parent_call("return", outcome(&result), took);
            let returned = result.unwrap_or(0);
            shared.metrics.regional_tokens(&id.0, "returned", returned);
            shared
                .metrics
                .regional_tokens(&id.0, "expired", tokens.saturating_sub(returned));
        });
    }
}

fn outcome<T>(result: &Result<T, ParentError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(ParentError::Unreachable(_)) => "unreachable",
        Err(ParentError::Refused(_)) => "refused",
    }
}
