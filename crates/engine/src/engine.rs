//! The filter's decision for one request, free of proxy-wasm so it is tested natively.
//!
//! The request path, a file each (`engine/`): `plan` matches policies, builds keys and estimates costs
//! once per request; `step` asks each policy's record what it says (in-flight slots, the
//! local stage's token bucket, the global stage's lease or assignment, the failure-mode
//! wrapper); `commit` combines the steps into the verdict and writes the records
//! all-or-nothing (`lone`: the common request, one policy that its record decides alone,
//! without the combination); `settle` applies what the response says the request really cost, and
//! frees its in-flight slot, when the stream ends. A request that must wait for the limiter
//! gets [`Verdict::Wait`] plus the leases to ask for; the glue (`worker`) decides the same plan
//! again when the limiter has answered, and credits answers through [`Engine::credit`].

mod commit;
mod lone;
mod plan;
mod settle;
mod step;

use crate::global::{self, DEADLINE_MARGIN_MS};
use crate::shared::{SharedData, StoreAt};
#[cfg(not(target_family = "wasm"))]
use crate::table::Cells;
use crate::table::{SlotTable, TableError};
use smallvec::SmallVec;
use std::cell::RefCell;
#[cfg(not(target_family = "wasm"))]
use std::sync::Arc;
use tollgate_core::policy::{LimiterSpec, Policies, Policy};
use tollgate_core::response::LocalReply;

pub use commit::when_table_fails;
pub use settle::{Settlement, Usage};

/// Prefix of every shared-data key the filter writes (Istio shares the empty `vm_id` between
/// plugins, so ours must not collide with theirs).
pub const SHARED_PREFIX: &str = "tollgate/v1/";

/// What one policy decided for a request (one metric each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Allowed,
    /// Over limit, enforced.
    Denied,
    /// Over limit in shadow mode: admitted, counted.
    ShadowDenied,
    /// The identity the key needs is absent and the policy says `deny`.
    IdentityMissing,
    /// Could not decide; admitted by the failure mode.
    FailOpen,
    /// Could not decide; refused by the failure mode.
    FailClosed,
    /// Could not decide; admitted by the local fallback budget (`mode: local`).
    FallbackAllowed,
    /// Could not decide; refused by the local fallback budget (over it).
    FallbackDenied,
    /// The key has `max_in_flight` requests in flight already.
    InFlightDenied,
    /// Over the limit of an `on_over_limit: tag` policy: let on with the policy's tag header,
    /// nothing taken.
    Tagged,
}

/// What each policy of a request decided (index into `Policies::policies`), inline for the
/// common one or two.
pub type Outcomes = SmallVec<[(usize, Outcome); 2]>;

/// A policy that applies to the request, with its bucket and cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matched {
    pub index: usize,
    /// `<policy>:<key>` (`tollgate_core::key::local_bucket_id`): the key's record in the table.
    /// The key is its part after the policy's name, so a request builds one string per policy.
    pub bucket_id: String,
    /// Where the key starts in `bucket_id`.
    key_from: usize,
    /// What the request takes at admission: the route's constant, or the reserved estimate.
    pub cost: u64,
    /// The estimate is read from the request body, which has not been seen yet: the route's
    /// constant part of it (until then `cost` holds the estimate's default).
    pub from_body: Option<u64>,
    /// A shaped policy may delay the request (its worker has room for one more waiting
    /// request of the key); set by the glue before each decision.
    pub may_wait: bool,
}

/// Where an admitted request's cost was taken from: where its settlement goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spent {
    /// Admitted by a failure mode without taking anything.
    Nothing,
    /// The record's token bucket (a local policy, or a global one's fallback budget).
    Bucket,
    /// This instance's lease of the global budget.
    Lease,
}

/// What an admitted request holds on one policy's record until its stream ends: the cost it
/// reserved (settled against the actual one) and its in-flight slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub policy: usize,
    pub bucket_id: String,
    pub reserved: u64,
    pub spent: Spent,
    /// The epoch of the in-flight slot taken (see `tollgate_core::in_flight`).
    pub slot: Option<u64>,
}

/// What a request needs decided; computed once, decided again after each wait.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub enforced: SmallVec<[Matched; 2]>,
    pub shadow: Vec<Matched>,
    /// Refused before any bucket (identity missing): a refused request consumes nothing.
    pub refused: Option<LocalReply>,
    pub early_outcomes: Vec<(usize, Outcome)>,
    /// The tag headers of the `tag` policies the request matches (each once): a client's copy
    /// is removed before the request goes on.
    pub tag_headers: Vec<String>,
    /// Decided after the request headers went on (a cost read from the body): Envoy has
    /// chosen the route, so a `tag` policy over its limit refuses (429) instead.
    pub after_headers: bool,
}

impl Matched {
    /// A policy's bucket `<policy>:<key>`, the key written by `write_key` into the buffer after
    /// `<policy>:` (`None`: it wrote nothing usable, the key is missing).
    pub fn new(
        index: usize,
        policy: &str,
        write_key: impl FnOnce(&mut String) -> bool,
    ) -> Option<Self> {
        let mut bucket_id = id_buffer();
        bucket_id.reserve(policy.len() + 48);
        bucket_id.push_str(policy);
        bucket_id.push(':');
        let key_from = bucket_id.len();
        if !write_key(&mut bucket_id) {
            give_back_id_buffer(bucket_id);
            return None;
        }
        Some(Matched {
            index,
            bucket_id,
            key_from,
            cost: 0,
            from_body: None,
            may_wait: true,
        })
    }

    /// The policy's key for this request (the bucket id without the policy's name).
    pub fn key(&self) -> &str {
        self.bucket_id.get(self.key_from..).unwrap_or_default()
    }
}

/// A request's bucket id's buffer goes back to its thread's spares: the next request's id is
/// written into it instead of a new allocation.
impl Drop for Matched {
    fn drop(&mut self) {
        give_back_id_buffer(std::mem::take(&mut self.bucket_id));
    }
}

/// Spare bucket-id buffers kept per thread: at most [`SPARE_IDS`], each of at most
/// [`SPARE_ID_BYTES`] (a longer one is freed), so what is kept stays small whatever the keys.
const SPARE_IDS: usize = 8;
const SPARE_ID_BYTES: usize = 256;

thread_local! {
    static SPARE_ID_BUFFERS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer for a bucket id: a spare of this thread, else a new one.
fn id_buffer() -> String {
    SPARE_ID_BUFFERS
        .try_with(|spares| spares.try_borrow_mut().ok().and_then(|mut s| s.pop()))
        .ok()
        .flatten()
        .unwrap_or_default()
}

fn give_back_id_buffer(mut buffer: String) {
    if buffer.capacity() == 0 || buffer.capacity() > SPARE_ID_BYTES {
        return;
    }
    buffer.clear();
    let _ = SPARE_ID_BUFFERS.try_with(|spares| {
        if let Ok(mut spares) = spares.try_borrow_mut() {
            if spares.len() < SPARE_IDS {
                spares.push(buffer);
            }
        }
    });
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.enforced.is_empty()
            && self.shadow.is_empty()
            && self.refused.is_none()
            && self.early_outcomes.is_empty()
    }

    /// Every policy of the plan, enforced and shadow.
    pub fn matched(&self) -> impl Iterator<Item = &Matched> {
        self.enforced.iter().chain(&self.shadow)
    }

    /// Whether a cost still waits for the request body.
    pub fn needs_body(&self) -> bool {
        self.refused.is_none() && self.matched().any(|m| m.from_body.is_some())
    }
}

/// A lease to ask the limiter for.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseNeed {
    pub policy: usize,
    pub key: String,
    pub bucket_id: String,
    pub min: u64,
    pub want: u64,
    /// This instance's offered demand for the key, units per second (sizes an assignment).
    pub demand_per_s: f64,
    /// A request waits for it (else it is a background refill, renewal or recovery probe).
    pub blocking: bool,
    /// A refill of a lease that still holds a quarter of its grant: it may wait up to
    /// [`global::REFILL_LINGER_MS`] for other needs to share its callout (renewals of an
    /// assignment and probes go at once: the drip stops when a renewal is asked for).
    pub may_linger: bool,
    /// When it was asked for (no later than its callout is sent): a window's lease expires
    /// measured from then (`global::apply_grant`).
    pub asked_ms: u64,
}

/// Unspent tokens of an expired lease to give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReturnNeed {
    pub policy: usize,
    pub key: String,
    pub seq: u64,
    pub unused: u64,
}

impl ReturnNeed {
    /// What an expiry of (`policy`, `key`)'s lease hands back: one return per lease that left
    /// tokens unspent (a decision's scratch and the worker's tick both queue them).
    pub fn of_expiry<'a>(
        policy: usize,
        key: &'a str,
        expiry: &global::Expiry,
    ) -> impl Iterator<Item = ReturnNeed> + 'a {
        expiry
            .returns
            .into_iter()
            .filter(|&(_, unused)| unused > 0)
            .map(move |(seq, unused)| ReturnNeed {
                policy,
                key: key.to_owned(),
                seq,
                unused,
            })
    }
}

/// What to do with the request.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Continue,
    Reply(LocalReply),
    /// Pause until the blocking leases in [`Decision::needs`] are answered.
    Wait,
}

/// The decision for one request, with the work it leaves for the glue.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    /// Headers to add to the upstream's response (`ratelimit_headers_on_allow`).
    pub response_headers: Vec<(String, String)>,
    /// With [`Verdict::Continue`]: request headers to set before the request goes on (a tag
    /// header naming the `tag` policies over their limit, comma-separated).
    pub request_headers: Vec<(String, String)>,
    /// Per policy (index into `Policies::policies`): what it decided.
    pub outcomes: Outcomes,
    /// Set when the local table could not decide.
    pub table_error: Option<TableError>,
    pub evictions: u32,
    pub needs: Vec<LeaseNeed>,
    pub returns: Vec<ReturnNeed>,
    /// Tokens of expired leases that cannot be returned, per policy.
    pub expired: Vec<(usize, u64)>,
    /// With [`Verdict::Wait`]: the bucket ids whose lease answers the request waits for
    /// (asked for by this decision, or by another request of this instance).
    pub waiting_for: Vec<String>,
    /// With [`Verdict::Continue`]: what the request holds until its stream ends (policies with
    /// a reservation to settle or an in-flight limit).
    pub admissions: Vec<Admission>,
    /// In-flight slots that expired without being released, per policy.
    pub slots_expired: Vec<(usize, u64)>,
    /// With [`Verdict::Continue`]: a shaped request goes on only after this long (the
    /// policies that delay it in `delayed`).
    pub delay_ms: u64,
    pub delayed: Vec<usize>,
}

impl Decision {
    fn new() -> Self {
        Self {
            verdict: Verdict::Continue,
            response_headers: Vec::new(),
            request_headers: Vec::new(),
            outcomes: Outcomes::new(),
            table_error: None,
            evictions: 0,
            needs: Vec::new(),
            returns: Vec::new(),
            expired: Vec::new(),
            waiting_for: Vec::new(),
            admissions: Vec::new(),
            slots_expired: Vec::new(),
            delay_ms: 0,
            delayed: Vec::new(),
        }
    }
}

/// How this decision of a plan comes about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Attempt {
    /// How many times the request has already waited for leases.
    pub round: u32,
    /// The filter's own deadline passed: what still needs the limiter is undecided.
    pub deadline_passed: bool,
}

impl Attempt {
    /// A first decision that may not wait (the request cannot be paused for a callout).
    pub const NO_WAIT: Attempt = Attempt {
        round: 0,
        deadline_passed: true,
    };
}

/// The configured filter: validated policies plus the shared table.
#[derive(Debug, Clone)]
pub struct Engine {
    pub policies: Policies,
    table: SlotTable,
}

impl Engine {
    /// The table is split into one region per policy, so no policy's keys can take the slots
    /// of another.
    pub fn new(policies: Policies, table: SlotTable) -> Self {
        let table = table.partitioned(policies.policies.iter().map(|p| p.name.as_str()));
        Self { policies, table }
    }

    pub fn table(&self) -> &SlotTable {
        &self.table
    }

    /// The same engine with its table's records kept typed in `cells` (see
    /// [`crate::table::Cells`]; sized by the table's `groups_needed`), for a host whose
    /// workers are threads of one process.
    #[cfg(not(target_family = "wasm"))]
    pub fn keeping_records_in(mut self, cells: Arc<Cells>) -> Result<Self, TableError> {
        self.table = self.table.in_cells(cells)?;
        Ok(self)
    }

    pub fn limiter(&self) -> Option<&LimiterSpec> {
        self.policies.limiter.as_ref()
    }

    pub fn policy(&self, index: usize) -> Option<&Policy> {
        self.policies.policies.get(index)
    }

    /// Decides a plan against the shared table at `at.now_ms`.
    pub fn decide(
        &self,
        plan: &Plan,
        at: StoreAt<'_, impl SharedData>,
        attempt: Attempt,
    ) -> Decision {
        let mut decision = Decision::new();
        if attempt.round == 0 {
            // Counted once, by the first decision of the request.
            decision
                .outcomes
                .extend(plan.early_outcomes.iter().copied());
        }
        if let Some(reply) = &plan.refused {
            decision.verdict = Verdict::Reply(reply.clone());
            return decision;
        }
        self.decide_enforced(plan, at, attempt, &mut decision);
        if decision.verdict == Verdict::Continue {
            // Shadow policies see the traffic that is admitted, each on its own.
            for matched in &plan.shadow {
                self.decide_shadow(matched, at, &mut decision);
            }
        }
        decision
    }

    /// Credits a limiter answer to a key's record. Returns the unspent tokens of a lease the
    /// record no longer keeps an id for, taken out of it to give back now (see
    /// `global::apply_grant`).
    pub fn credit(
        &self,
        at: StoreAt<'_, impl SharedData>,
        need: &LeaseNeed,
        grant: &tollgate_core::protocol::LeaseGranted,
        seq: u64,
        fresh: bool,
    ) -> Result<Option<ReturnNeed>, TableError> {
        let now_ms = at.now_ms;
        let policy = self
            .policies
            .policies
            .get(need.policy)
            .map(|p| p.rated(&need.key));
        let times = global::GrantTimes {
            now_ms,
            asked_ms: need.asked_ms,
            windowed: policy.is_some_and(|p| p.algorithm.window().is_some()),
        };
        self.table.update(at, &need.bucket_id, |record| {
            let displaced = global::apply_grant(record, grant, seq, times, fresh);
            global::pay_debt(&mut record.lease);
            if let Some(policy) = policy {
                commit::mark_evictable(record, policy, now_ms);
            }
            displaced.map(|(seq, unused)| ReturnNeed {
                policy: need.policy,
                key: need.key.clone(),
                seq,
                unused,
            })
        })
    }

    /// Marks the key as asking again (a retry of a callout that got no answer), so no other
    /// request of this instance asks for it meanwhile.
    pub fn refresh_pending(
        &self,
        at: StoreAt<'_, impl SharedData>,
        need: &LeaseNeed,
    ) -> Result<(), TableError> {
        let now_ms = at.now_ms;
        self.update_global(at, need, |lease, settings| {
            lease.pending_until_ms = now_ms + settings.timeout.0 + DEADLINE_MARGIN_MS;
            if global::assigned(lease, now_ms) {
                lease.assigned_until_ms = lease.assigned_until_ms.max(lease.pending_until_ms);
            }
        })
    }

    /// Records that the limiter could not decide for a key.
    pub fn mark_unavailable(
        &self,
        at: StoreAt<'_, impl SharedData>,
        need: &LeaseNeed,
    ) -> Result<(), TableError> {
        self.update_global(at, need, |lease, settings| {
            global::apply_unavailable(lease, settings, at.now_ms)
        })
    }

    /// Changes the lease bookkeeping of a global policy's record (nothing without a limiter).
    fn update_global(
        &self,
        at: StoreAt<'_, impl SharedData>,
        need: &LeaseNeed,
        change: impl Fn(&mut crate::table::Lease, &LimiterSpec),
    ) -> Result<(), TableError> {
        let (Some(settings), Some(policy)) = (
            self.policies.limiter.as_ref(),
            self.policies
                .policies
                .get(need.policy)
                .map(|p| p.rated(&need.key)),
        ) else {
            return Ok(());
        };
        self.table.update(at, &need.bucket_id, |record| {
            change(&mut record.lease, settings);
            commit::mark_evictable(record, policy, at.now_ms);
        })
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod settle_tests;

#[cfg(test)]
mod algorithm_tests;

#[cfg(test)]
mod tag_tests;

#[cfg(test)]
mod lone_tests;
