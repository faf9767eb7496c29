//! `when`: the conditions on trusted request facts, ordered cheapest first.

use super::key::jwt_claim_path;
use super::Cx;
use crate::condition::{self, Condition};
use crate::route::RouteTemplate;

pub(super) fn compile_when(cx: &mut Cx<'_>, routes: &[RouteTemplate]) -> Vec<Condition> {
    let spec = cx.spec;
    if spec.when.len() > condition::MAX_CONDITIONS {
        cx.push(
            "when",
            format!("at most {} conditions", condition::MAX_CONDITIONS),
        );
        return Vec::new();
    }
    let mut when = Vec::new();
    for (i, written) in spec.when.iter().enumerate() {
        match condition::compile(i, written, routes, jwt_claim_path) {
            Ok(compiled) => when.push(compiled),
            Err(problems) => {
                for (suffix, reason) in problems {
                    cx.push(&format!("when[{i}]{suffix}"), reason);
                }
            }
        }
    }
    // All must hold: the cheapest are tested first (borrowed request-line facts, then a
    // header, then what the host hands over as a copy), in document order within a rank (at
    // most 16: an insertion keeps it simple, and small in the .wasm).
    let mut ordered: Vec<Condition> = Vec::with_capacity(when.len());
    for c in when {
        let rank = condition::cost_rank(&c.fact);
        let at = ordered
            .iter()
            .position(|o| condition::cost_rank(&o.fact) > rank)
            .unwrap_or(ordered.len());
        ordered.insert(at, c);
    }
    ordered
}
