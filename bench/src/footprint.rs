//! Bytes of shared state per key, per algorithm, measured: for each kind of policy the filter
//! can enforce, a fresh engine and table over [`MemorySharedData`] (Envoy's shared-data
//! semantics, in process) decide one request for each of `keys` distinct tenants, then the
//! bytes the shared data holds (every value and every key name, as
//! [`MemorySharedData::bytes`] counts them) are divided by the number of tenants.
//!
//! The table is created up front (`local_table.slots`, default 4096, in groups of four slots
//! under one shared-data key, plus the salt), so the bytes held before the first key — the
//! fixed overhead — are reported apart, and the growth per key beside the total per key. No
//! timing: the decisions run in microseconds each, and the figures are exact for the code
//! built. Envoy keeps a 32-bit CAS stamp and its own map node per shared-data key besides:
//! per group, not per key, and not counted here.
//!
//! The native build keeps the same records typed in process memory ([`Cells`]): the same
//! decisions are made on such a table, and its bytes per key (each record's in-memory size
//! plus its heap parts, the groups' fixed part apart) are reported beside.

use serde_json::{json, Value};
use std::sync::Arc;
use tollgate_core::policy::Policies;
use tollgate_core::protocol::LeaseGranted;
use tollgate_engine::engine::{Attempt, Engine, LeaseNeed, Verdict, SHARED_PREFIX};
use tollgate_engine::request::{RequestFacts, RequestSource};
use tollgate_engine::shared::{MemorySharedData, StoreAt};
use tollgate_engine::table::{Cells, SlotTable};

use crate::config::{PolicyDoc, LOG_WINDOW, MAX_LOG_LIMIT, ROUTE};

/// Distinct keys each measurement decides for (a quarter of the default table's 4096 slots:
/// no key is refused for want of a slot).
pub const KEYS: usize = 1_000;

/// When every decision is made (ms): the leases, windows and logs are all live then.
const NOW_MS: u64 = 10_000;

/// One kind of policy's shared state after one or more decisions for each of `keys` keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Footprint {
    /// `token_bucket (local)`, `fixed_window`, ...
    pub name: String,
    /// What the policy is and what each key did, in words.
    pub what: String,
    pub keys: usize,
    /// Decisions made per key (all admitted).
    pub decisions_per_key: usize,
    /// Mean length of a record's id (`<policy>:<key>`), bytes: part of every record.
    pub id_bytes: f64,
    /// Slots the table was created with, and the shared-data keys and bytes it held before the
    /// first decision.
    pub slots: u32,
    pub fixed_entries: usize,
    pub fixed_bytes: usize,
    /// Shared-data keys and bytes after every key's decisions.
    pub entries: usize,
    pub total_bytes: usize,
    /// The native build's typed cells after the same decisions: bytes of the records (their
    /// size and heap parts), and of the groups before the first record.
    pub native_bytes: usize,
    pub native_fixed_bytes: usize,
}

impl Footprint {
    /// Everything held, fixed overhead included, per key.
    pub fn total_per_key(&self) -> f64 {
        self.total_bytes as f64 / self.keys.max(1) as f64
    }

    /// The native build's records, per key.
    pub fn native_per_key(&self) -> f64 {
        self.native_bytes as f64 / self.keys.max(1) as f64
    }

    /// What the keys added to the table, per key.
    pub fn added_per_key(&self) -> f64 {
        self.total_bytes.saturating_sub(self.fixed_bytes) as f64 / self.keys.max(1) as f64
    }
}

struct Tenant(Vec<u8>);

impl RequestSource for Tenant {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        (name == "x-tenant-id").then(|| self.0.clone())
    }

    fn property(&self, _path: &[&str]) -> Option<Vec<u8>> {
        None
    }
}

/// One measured case: a policy document and how many decisions each key gets.
struct Case {
    name: &'static str,
    what: String,
    doc: PolicyDoc<'static>,
    decisions: usize,
}

fn cases() -> Vec<Case> {
    let local = || PolicyDoc::local(ROUTE);
    vec![
        Case {
            name: "token_bucket (local)",
            what: "one local policy, token bucket".into(),
            doc: local(),
            decisions: 1,
        },
        Case {
            name: "token_bucket (global)",
            what: "one global policy: the key holds a lease from the limiter (the bucket is \
                   the limiter's)"
                .into(),
            doc: PolicyDoc::global(None),
            decisions: 1,
        },
        Case {
            name: "fixed_window",
            what: "one local policy, fixed window".into(),
            doc: local().counted_by("fixed_window"),
            decisions: 1,
        },
        Case {
            name: "sliding_window",
            what: "one local policy, sliding window counter".into(),
            doc: local().counted_by("sliding_window"),
            decisions: 1,
        },
        Case {
            name: "sliding_log (1 entry)",
            what: format!(
                "one local policy, sliding log of at most {MAX_LOG_LIMIT} per {LOG_WINDOW}; \
                 one request logged per key"
            ),
            doc: local().counted_by("sliding_log"),
            decisions: 1,
        },
        Case {
            name: "sliding_log (full)",
            what: format!(
                "the same log holding its limit: {MAX_LOG_LIMIT} requests logged per key \
                 (the most a log holds)"
            ),
            doc: local().counted_by("sliding_log"),
            decisions: MAX_LOG_LIMIT as usize,
        },
        Case {
            name: "token_bucket + max_in_flight",
            what: "one local policy, token bucket, `max_in_flight: 100`; one request of each \
                   key still in flight"
                .into(),
            doc: PolicyDoc {
                max_in_flight: Some(100),
                ..local()
            },
            decisions: 1,
        },
    ]
}

/// Every case, `keys` distinct keys each.
pub fn measure(keys: usize) -> Result<Vec<Footprint>, String> {
    cases()
        .iter()
        .map(|case| measure_case(case, keys))
        .collect()
}

fn measure_case(case: &Case, keys: usize) -> Result<Footprint, String> {
    let fail = |what: String| format!("{}: {what}", case.name);
    let policies = Policies::from_json(case.doc.json().as_bytes())
        .map_err(|errors| fail(errors.to_string()))?;
    let slots = policies.local_table.slots;
    let store = MemorySharedData::default();
    let table = SlotTable::open(&store, SHARED_PREFIX, slots, 7)
        .map_err(|e| fail(format!("table: {e:?}")))?;
    let (fixed_entries, fixed_bytes) = (store.entries(), store.bytes());
    let engine = Engine::new(policies.clone(), table);
    let native_store = MemorySharedData::default();
    let native = Engine::new(
        policies,
        SlotTable::open_salted(&native_store, SHARED_PREFIX, slots, 7)
            .map_err(|e| fail(format!("table: {e:?}")))?,
    );
    let cells = Arc::new(Cells::new(native.table().groups_needed()));
    let native_fixed_bytes = cells.fixed_bytes();
    let native = native
        .keeping_records_in(cells.clone())
        .map_err(|e| fail(format!("cells: {e:?}")))?;
    let facts = RequestFacts {
        method: "GET".into(),
        path: "/items/42".into(),
        host: "api.example.com".into(),
    };
    let mut id_bytes = 0usize;
    for k in 0..keys {
        let tenant = Tenant(format!("tenant-{k}").into_bytes());
        let plan = engine.plan(&facts, &tenant);
        let Some(matched) = plan.enforced.first() else {
            return Err(fail("the policy did not match the request".into()));
        };
        id_bytes += matched.bucket_id.len();
        for _ in 0..case.decisions {
            admit(&engine, &store, &plan, k).map_err(|e| fail(format!("key {k}: {e}")))?;
            admit(&native, &native_store, &plan, k)
                .map_err(|e| fail(format!("native, key {k}: {e}")))?;
        }
    }
    let (native_records, native_bytes) = cells.footprint();
    if native_records != keys {
        return Err(fail(format!(
            "{native_records} native records for {keys} keys"
        )));
    }
    Ok(Footprint {
        name: case.name.into(),
        what: case.what.clone(),
        keys,
        decisions_per_key: case.decisions,
        id_bytes: id_bytes as f64 / keys.max(1) as f64,
        slots,
        fixed_entries,
        fixed_bytes,
        entries: store.entries(),
        total_bytes: store.bytes(),
        native_bytes,
        native_fixed_bytes,
    })
}

/// Decides the plan until it is admitted: a global policy's first decision waits for a lease,
/// which is granted here as the limiter would (1,000 units for 1 s), then decided again.
fn admit(
    engine: &Engine,
    store: &MemorySharedData,
    plan: &tollgate_engine::engine::Plan,
    k: usize,
) -> Result<(), String> {
    let mut attempt = Attempt::default();
    for _ in 0..3 {
        let decision = engine.decide(plan, StoreAt::new(store, NOW_MS), attempt);
        if let Some(error) = decision.table_error {
            return Err(format!("table {error:?}"));
        }
        match decision.verdict {
            Verdict::Continue => return Ok(()),
            Verdict::Reply(reply) => return Err(format!("refused: {reply:?}")),
            Verdict::Wait => {}
        }
        if decision.needs.is_empty() {
            return Err("waits with no lease to ask for".into());
        }
        for need in &decision.needs {
            grant(engine, store, need, k)?;
        }
        attempt.round += 1;
    }
    Err("not admitted after its lease was granted".into())
}

fn grant(
    engine: &Engine,
    store: &MemorySharedData,
    need: &LeaseNeed,
    k: usize,
) -> Result<(), String> {
    let seq = (1u64 << 40) + k as u64;
    let granted = LeaseGranted {
        id: format!("lease-{seq}"),
        granted: need.want.max(need.min).max(1_000),
        remaining: 0.0,
        retry_after_ms: 0,
        expires_ms: 1_000,
        share_per_s: 0.0,
        period_ms: 0,
    };
    engine
        .credit(StoreAt::new(store, NOW_MS), need, &granted, seq, true)
        .map(|_| ())
        .map_err(|e| format!("credit: {e:?}"))
}

/// The table for `micro.md`.
pub fn markdown(footprints: &[Footprint]) -> String {
    let Some(first) = footprints.first() else {
        return String::new();
    };
    let mut md = format!(
        "## Bytes of shared state per key\n\n\
         Measured, not estimated: for each kind of policy a fresh engine and table (in-memory \
         shared data with Envoy's semantics) decided for {keys} distinct tenants \
         (`x-tenant-id: tenant-<n>`, all admitted), then every value and key name the shared \
         data held was counted. The table is created up front ({slots} slots in groups of 4, \
         one shared-data key per group, plus the salt): {fixed} bytes in {entries} keys before \
         the first request, whatever the number of keys. \"Added per key\" is what the keys \
         added to it; \"total per key\" counts the fixed part too. Each record holds its id \
         (`<policy>:<key>`, here {id:.1} bytes on average). The native build keeps the same \
         records typed in process memory instead: \"native per key\" is each record's size in \
         memory plus its heap parts (id, log), after the same decisions; its groups take \
         {native_fixed} bytes before the first record.\n\n\
         | policy | each key | added per key (bytes) | total per key (bytes) | shared-data keys after | native per key (bytes) |\n\
         |---|---|---:|---:|---:|---:|\n",
        keys = first.keys,
        slots = first.slots,
        fixed = first.fixed_bytes,
        entries = first.fixed_entries,
        id = first.id_bytes,
        native_fixed = first.native_fixed_bytes,
    );
    for f in footprints {
        md.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {} | {:.1} |\n",
            f.name,
            f.what,
            f.added_per_key(),
            f.total_per_key(),
            f.entries,
            f.native_per_key()
        ));
    }
    md
}

/// The same as JSON.
pub fn json(footprints: &[Footprint]) -> Value {
    json!(footprints
        .iter()
        .map(|f| json!({
            "policy": f.name,
            "what": f.what,
            "keys": f.keys,
            "decisions_per_key": f.decisions_per_key,
            "id_bytes_mean": f.id_bytes,
            "table_slots": f.slots,
            "fixed_entries": f.fixed_entries,
            "fixed_bytes": f.fixed_bytes,
            "entries": f.entries,
            "total_bytes": f.total_bytes,
            "added_bytes_per_key": f.added_per_key(),
            "total_bytes_per_key": f.total_per_key(),
            "native_bytes": f.native_bytes,
            "native_fixed_bytes": f.native_fixed_bytes,
            "native_bytes_per_key": f.native_per_key(),
        }))
        .collect::<Vec<_>>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_algorithm_leaves_a_record_per_key_in_the_preallocated_table() {
        let all = measure(50).unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<&str> = all.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "token_bucket (local)",
                "token_bucket (global)",
                "fixed_window",
                "sliding_window",
                "sliding_log (1 entry)",
                "sliding_log (full)",
                "token_bucket + max_in_flight",
            ]
        );
        let by = |name: &str| {
            all.iter()
                .find(|f| f.name == name)
                .cloned()
                .unwrap_or_else(|| panic!("{name}"))
        };
        for f in &all {
            // The table holds every group from the start: keys add bytes, not shared-data keys.
            assert_eq!(f.entries, f.fixed_entries, "{f:?}");
            assert_eq!(f.fixed_entries, 4096 / 4 + 1, "{f:?}");
            // `per-tenant:tenant-<n>`, 19 or 20 bytes for n < 50.
            assert!((19.0..=20.0).contains(&f.id_bytes), "{f:?}");
            // A record holds at least its id and a timestamp.
            assert!(f.added_per_key() > f.id_bytes + 8.0, "{f:?}");
            assert!(f.total_per_key() > f.added_per_key(), "{f:?}");
        }
        let local = by("token_bucket (local)").added_per_key();
        // The lease's bookkeeping is larger than a local bucket; a full log larger still, by
        // one timestamp per entry.
        assert!(by("token_bucket (global)").added_per_key() > local + 100.0);
        let one = by("sliding_log (1 entry)").added_per_key();
        let full = by("sliding_log (full)").added_per_key();
        assert!(
            full - one >= (MAX_LOG_LIMIT - 1) as f64 * 8.0,
            "{one} {full}"
        );
        assert!(by("token_bucket + max_in_flight").added_per_key() > local);
        // The same measurement twice gives the same bytes (nothing depends on the clock).
        assert_eq!(measure(50).ok(), Some(all.clone()));

        let md = markdown(&all);
        assert!(md.contains("## Bytes of shared state per key"), "{md}");
        assert!(md.contains("decided for 50 distinct tenants"), "{md}");
        assert!(
            md.contains(&format!(
                "| token_bucket (local) | one local policy, token bucket | {local:.1} |"
            )),
            "{md}"
        );
        let value = json(&all);
        assert_eq!(value.as_array().map(Vec::len), Some(7));
        assert_eq!(value[5]["decisions_per_key"], 256);
        assert_eq!(value[0]["added_bytes_per_key"], local);
        assert_eq!(markdown(&[]), "");
    }
}
