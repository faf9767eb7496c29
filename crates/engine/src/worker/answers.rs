//! A callout's answer: grants credited to the shared table (and watched for expiry), refusals
//! and outages marked on their keys, lease requests without an answer retried once under the
//! same ids, and the waiters of every key answered decided again.

use super::callouts::chunks;
use super::{Asked, Callout, Ctx, Host, Worker, MAX_WAITERS};
use crate::global::{self, CalloutError};
use crate::metrics::LeaseEvent;
use crate::shared::SharedData;
use tollgate_core::protocol::{ErrorCode, LeaseResult, ReturnResult};

impl Worker {
    /// A callout answered (`status` None: reset / no response).
    pub fn complete<S: SharedData, H: Host>(
        &mut self,
        token: u32,
        status: Option<u32>,
        body: &[u8],
        ctx: &Ctx<'_, S, H>,
    ) {
        match self.callouts.remove(&token) {
            Some(Callout::Leases { items, sent_ms }) => {
                let elapsed = ctx.now_ms.saturating_sub(sent_ms);
                // Keys answered (or given up) this time: their waiters are decided again.
                let (mut affected, unanswered) = match global::parse_lease_response(status, body) {
                    Ok(answer) => {
                        ctx.metrics.callout(elapsed, false);
                        if answer.policy_version != ctx.engine.policies.version {
                            ctx.metrics.version_mismatch();
                        }
                        self.credit(ctx, items, &answer.leases)
                    }
                    Err(error) => {
                        ctx.metrics.callout(elapsed, true);
                        log_failure(&error);
                        (Vec::new(), items)
                    }
                };
                let (retry, give_up): (Vec<Asked>, Vec<Asked>) =
                    unanswered.into_iter().partition(|a| !a.retried);
                if !give_up.is_empty() {
                    self.unsettle(&give_up);
                    self.fail_leases(ctx, &give_up);
                    affected.extend(give_up.into_iter().map(|a| a.need.bucket_id));
                }
                affected.extend(self.retry(ctx, retry));
                self.resolve(ctx, &affected);
                self.flush(ctx);
            }
            Some(Callout::Returns { items, sent_ms }) => {
                let elapsed = ctx.now_ms.saturating_sub(sent_ms);
                match global::parse_return_response(status, body) {
                    Ok(answer) => {
                        ctx.metrics.callout(elapsed, false);
                        for (item, result) in items.iter().zip(&answer.returns) {
                            let returned = match result {
                                ReturnResult::Returned { returned, .. } => *returned,
                                ReturnResult::Error(_) => 0,
                            };
                            ctx.metrics
                                .lease(item.policy, LeaseEvent::Returned(returned));
                            ctx.metrics.lease(
                                item.policy,
                                LeaseEvent::Expired(item.unused.saturating_sub(returned)),
                            );
                        }
                    }
                    Err(error) => {
                        ctx.metrics.callout(elapsed, true);
                        log_failure(&error);
                        for item in &items {
                            ctx.metrics
                                .lease(item.policy, LeaseEvent::Expired(item.unused));
                        }
                    }
                }
            }
            None => {}
        }
        self.update_tick(ctx.host);
    }

    /// Asks once more, under the same ids, for what got no answer (the key stays marked as
    /// asking, so no other request of this instance asks meanwhile). Returns the bucket ids
    /// that could not be retried (sent to the failure mode).
    pub(super) fn retry<S: SharedData, H: Host>(
        &mut self,
        ctx: &Ctx<'_, S, H>,
        items: Vec<Asked>,
    ) -> Vec<String> {
        if items.is_empty() {
            return Vec::new();
        }
        let items: Vec<Asked> = items
            .into_iter()
            .map(|mut a| {
                a.retried = true;
                self.inflight.remove(&a.need.bucket_id);
                if let Err(error) = ctx.engine.refresh_pending(ctx.at(), &a.need) {
                    log::debug!("cannot mark a key as asking: {error:?}");
                }
                a
            })
            .collect();
        ctx.metrics.callout_retried(items.len());
        let mut failed = Vec::new();
        for chunk in chunks(items) {
            failed.extend(self.send_leases(chunk, ctx, false));
        }
        failed
    }

    /// Credits the answers of one callout; returns the bucket ids answered and the items that
    /// got no usable answer.
    pub(super) fn credit<S: SharedData, H: Host>(
        &mut self,
        ctx: &Ctx<'_, S, H>,
        items: Vec<Asked>,
        results: &[LeaseResult],
    ) -> (Vec<String>, Vec<Asked>) {
        let mut answered = Vec::new();
        let mut unanswered = Vec::new();
        for a in items {
            let result = results.iter().find(|r| match r {
                LeaseResult::Granted(g) => g.id == a.id,
                LeaseResult::Error(e) => e.id == a.id,
            });
            let need = &a.need;
            match result {
                Some(LeaseResult::Granted(grant)) => {
                    self.inflight.remove(&need.bucket_id);
                    self.unsettled.remove(&need.bucket_id);
                    answered.push(need.bucket_id.clone());
                    ctx.metrics
                        .lease(need.policy, LeaseEvent::Granted(grant.granted));
                    if a.fresh && grant.share_per_s > 0.0 {
                        ctx.metrics.lease(need.policy, LeaseEvent::Assigned);
                    }
                    match ctx.engine.credit(ctx.at(), need, grant, a.seq, a.fresh) {
                        Ok(displaced) if grant.granted > 0 || grant.share_per_s > 0.0 => {
                            self.queued_returns.extend(displaced);
                            let at_ms = ctx.now_ms.saturating_add(grant.expires_ms);
                            self.watch(need.policy, &need.key, &need.bucket_id, at_ms);
                        }
                        Ok(displaced) => self.queued_returns.extend(displaced),
                        Err(error) => {
                            log::warn!("granted tokens lost (table {error:?})");
                            ctx.metrics
                                .lease(need.policy, LeaseEvent::Expired(grant.granted));
                        }
                    }
                }
                Some(LeaseResult::Error(error)) if error.error != ErrorCode::Unavailable => {
                    self.inflight.remove(&need.bucket_id);
                    self.unsettled.remove(&need.bucket_id);
                    answered.push(need.bucket_id.clone());
                    if error.error == ErrorCode::InvalidPolicy {
                        ctx.metrics.lease(need.policy, LeaseEvent::InvalidPolicy);
                        log::warn!(
                            "limiter refused policy: {} ({})",
                            error.error.as_str(),
                            error.reason.as_deref().unwrap_or("")
                        );
                    }
                    ctx.metrics.lease(need.policy, LeaseEvent::Unavailable);
                    let _ = ctx.engine.mark_unavailable(ctx.at(), need);
                }
                _ => unanswered.push(a),
            }
        }
        (answered, unanswered)
    }

    /// Remembers lease requests whose outcome is unknown, to be asked again under the same id.
    pub(super) fn unsettle(&mut self, items: &[Asked]) {
        for a in items {
            if self.unsettled.len() < MAX_WAITERS || self.unsettled.contains_key(&a.need.bucket_id)
            {
                self.unsettled
                    .insert(a.need.bucket_id.clone(), (a.seq, a.id.clone()));
            }
        }
    }

    pub(super) fn fail_leases<S: SharedData, H: Host>(
        &mut self,
        ctx: &Ctx<'_, S, H>,
        items: &[Asked],
    ) {
        for a in items {
            ctx.metrics.lease(a.need.policy, LeaseEvent::Unavailable);
            if let Err(error) = ctx.engine.mark_unavailable(ctx.at(), &a.need) {
                log::warn!("cannot record limiter outage for a key: {error:?}");
            }
            self.inflight.remove(&a.need.bucket_id);
        }
    }
}

fn log_failure(error: &CalloutError) {
    log::debug!("limiter callout failed: {error:?}");
}
