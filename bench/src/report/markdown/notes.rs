//! The notes under the results table: what the table does not show (lease requests, CPU
//! relative to S3) and each comparison in prose (the native build, the RateLimitService,
//! mutual TLS, settlement, windowed algorithms).

use super::two;
use crate::report::compare::{
    AlgorithmComparison, MtlsComparison, RlsComparison, SettleComparison,
};
use crate::report::measure::ratio;
use crate::report::Report;

impl Report {
    /// Every note, in order; a comparison whose scenarios did not run has none.
    pub(super) fn md_notes(&self, md: &mut String) {
        self.md_lease_notes(md);
        self.md_cpu_note(md);
        self.md_native_note(md);
        if let Some(r) = self.rls() {
            md_rls_note(md, &r);
        }
        if let Some(m) = self.mtls() {
            md_mtls_note(md, &m);
        }
        for c in self.settlements() {
            md_settlement_note(md, &c);
        }
        for c in self.algorithms() {
            md_algorithm_note(md, &c);
        }
    }

    /// Per scenario with leases or undecided requests: what the filter did.
    fn md_lease_notes(&self, md: &mut String) {
        for sc in &self.scenarios {
            let undecided = sc.counter("undecided");
            let leases = sc.counter("lease_requests");
            if leases > 0 || undecided > 0 {
                md.push_str(&format!(
                    "- S{}: {} lease requests for {} decided requests (warm-up included); {} refused by the filter (429), {} decided by the failure mode.\n",
                    sc.id,
                    leases,
                    sc.counter("decided"),
                    sc.counter("denied"),
                    undecided
                ));
            }
        }
    }

    /// Envoy CPU per request relative to S3, when S4 and S5 ran.
    fn md_cpu_note(&self, md: &mut String) {
        if let (Some(cpu4), Some(cpu5)) = (self.cpu_ratio("4", "3"), self.cpu_ratio("5", "3")) {
            let more: String = ["4s", "4f", "4w", "4l", "5s", "5t", "6", "8"]
                .iter()
                .filter_map(|id| self.cpu_ratio(id, "3").map(|r| format!(", S{id} {r:.2}")))
                .collect();
            md.push_str(&format!(
                "- Envoy CPU per request relative to S3 (less sensitive to the load generator's share of the cores than req/s): S4 {cpu4:.2}, S5 {cpu5:.2}{more}.\n"
            ));
        }
    }

    fn md_native_note(&self, md: &mut String) {
        let native = self.native_ratios();
        if !native.is_empty() {
            let pairs: Vec<String> = native
                .iter()
                .map(|r| {
                    format!(
                        "S{} × S{} {} · {}",
                        r.id,
                        r.base,
                        two(r.rps),
                        two(r.envoy_cpu)
                    )
                })
                .collect();
            md.push_str(&format!(
                "- The native build (dynamic module), req/s · Envoy CPU per request, each the \
                 median of per-round ratios: {}. S3n (no policy matches) is the module's own \
                 floor: what loading it costs before any policy decides.\n",
                pairs.join(", ")
            ));
        }
    }
}

/// Scenario 8 next to 5 and 6.
fn md_rls_note(md: &mut String, r: &RlsComparison) {
    let per_round: Vec<String> = r
        .s5_to_s8_per_round
        .iter()
        .map(|x| format!("{x:.2}"))
        .collect();
    let us = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1} µs"));
    let rounds = |n: usize| format!("{n} round{}", if n == 1 { "" } else { "s" });
    let measured_errors = r.errors.saturating_sub(r.errors_before_rounds);
    let errors = if measured_errors > 0 {
        format!(
            " **{measured_errors} calls in the measured rounds failed and were let \
                 through undecided (`failure_mode_deny: false`): S8's figures include \
                 requests no limit decided.**"
        )
    } else if r.errors > 0 {
        format!(
            " The {} failed calls were all in the warm-up, none in the measured rounds.",
            r.errors
        )
    } else {
        String::new()
    };
    md.push_str(&format!(
        "- S5 / S8 = {rps} in req/s (per round: {per_round}; {n5}): tollgate's \
             filter with leases over Envoy's `ratelimit` filter calling this limiter's \
             RateLimitService once per request, what moving from the one to the other \
             gains in throughput. S8's limiter + Redis CPU per decision {b8} against S6's \
             {b6} (one lease call per request; {cpu6} × S6, {n6}), Envoy CPU per \
             request {cpu5} × S5, p99 {p99} × S6. Envoy's filter was answered {ok} OK and \
             {over} over the limit, {errs} calls failed; the limiter answered {calls} calls \
             on {conns} (warm-up included).{errors}\n",
        rps = two(r.s5_to_s8),
        per_round = if per_round.is_empty() {
            "–".into()
        } else {
            per_round.join(", ")
        },
        n5 = rounds(r.rounds_with_s5),
        b8 = us(r.backend_us),
        b6 = us(r.s6_backend_us),
        cpu6 = two(r.backend_cpu_to_s6),
        n6 = rounds(r.rounds_with_s6),
        cpu5 = two(r.envoy_cpu_to_s5),
        p99 = two(r.p99_to_s6),
        ok = r.ok,
        over = r.over_limit,
        errs = r.errors,
        calls = r.limiter_calls,
        conns = if r.connections == 1 {
            "1 connection".to_string()
        } else {
            format!("{} connections", r.connections)
        },
    ));
}

/// Scenario 5t next to 5 (and 4).
fn md_mtls_note(md: &mut String, m: &MtlsComparison) {
    let s4 = match (m.s5t_to_s4, m.s5_to_s4) {
        (None, None) => String::new(),
        (t, p) => format!(" Relative to S4 (req/s): S5t {}, S5 {}.", two(t), two(p)),
    };
    let per_round: Vec<String> = m.rps_per_round.iter().map(|r| format!("{r:.2}")).collect();
    let plural = |n: u64, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    md.push_str(&format!(
        "- S5t (the limiter behind mutual TLS, `envoy/global-mtls.yaml`) relative to S5 \
             (h2c), measured in the same {rounds} rounds: req/s {rps} (per round: \
             {per_round}), p50 {p50}, p99 {p99}, Envoy CPU per request {cpu}, limiter + Redis \
             CPU per request {backend}.{s4} Envoy made {handshakes} with the limiter over the \
             whole run ({connections}, warm-up included): the connections are long-lived, so \
             no handshake is on the per-request path.\n",
        rounds = m.rounds,
        rps = two(m.rps),
        per_round = per_round.join(", "),
        p50 = two(m.p50),
        p99 = two(m.p99),
        cpu = two(m.envoy_cpu),
        backend = two(m.backend_cpu),
        handshakes = plural(m.handshakes, "TLS handshake", "TLS handshakes"),
        connections = plural(m.connections, "connection", "connections"),
    ));
}

/// A settling scenario next to its base.
fn md_settlement_note(md: &mut String, c: &SettleComparison) {
    let per_round: Vec<String> = c.rps_per_round.iter().map(|r| format!("{r:.2}")).collect();
    let backend = c.backend_cpu.map_or(String::new(), |r| {
        format!(", limiter + Redis CPU per request {r:.2}")
    });
    let per_request = |units: u64| {
        ratio(units as f64, c.decided as f64).map_or("–".into(), |u| format!("{u:.1}"))
    };
    let limiter = c.limiter_settled.map_or(String::new(), |n| {
        format!(
            "; the limiter was told of {n} settled units (on the existing lease calls; \
                 the last ones of the run may still have been on their way)"
        )
    });
    let verdict = if c.settled_any() {
        String::new()
    } else {
        " **No units settled (`tollgate_units_settled` is 0): settlement did not \
             happen, so these ratios measure a policy that never settles; the run failed.**"
            .into()
    };
    md.push_str(&format!(
        "- S{id} (S{base} + settlement: the route's cost reserved, the actual cost settled \
             from the response header) relative to S{base}, measured in the same {rounds} \
             rounds: req/s {rps} (per round: {per_round}), p50 {p50}, p99 {p99}, Envoy CPU \
             per request {cpu}{backend}. The filter settled {settled} units for {decided} \
             decided requests (warm-up included; per request {reserved_pr} reserved, \
             {settled_pr} settled, {refunded_pr} refunded; {debt} units charged beyond the \
             reservation, {missing} responses without usage){limiter}.{verdict}\n",
        id = c.id,
        base = c.base,
        rounds = c.rounds,
        rps = two(c.rps),
        per_round = per_round.join(", "),
        p50 = two(c.p50),
        p99 = two(c.p99),
        cpu = two(c.envoy_cpu),
        settled = c.settled,
        decided = c.decided,
        reserved_pr = per_request(c.reserved),
        settled_pr = per_request(c.settled),
        refunded_pr = per_request(c.refunded),
        debt = c.debt,
        missing = c.missing,
    ));
}

/// A windowed scenario next to S4.
fn md_algorithm_note(md: &mut String, c: &AlgorithmComparison) {
    let per_round: Vec<String> = c.rps_per_round.iter().map(|r| format!("{r:.2}")).collect();
    let window = crate::config::LOG_WINDOW;
    let limit = crate::config::MAX_LOG_LIMIT;
    // The sliding log's window against the hottest tenant's traffic.
    let log = match (c.hottest_share, c.hottest_per_window) {
        (Some(share), Some(sent)) => format!(
            " The log keeps at most {limit} entries per {window} window: the hottest \
                 tenant ({pct:.1} % of the requests) sent about {sent:.0} per window at \
                 S{id}'s median req/s, and would fill it only past {full:.0} req/s in all.",
            pct = share * 100.0,
            id = c.id,
            full = limit as f64 * 1e3 / crate::config::LOG_WINDOW_MS as f64 / share,
        ),
        _ => String::new(),
    };
    let denials = format!(
        "the filter denied {} of {} decided requests (warm-up included), {} measured \
             responses were not 200",
        c.denied, c.decided, c.non_2xx
    );
    let verdict = if !c.denied_any() {
        format!(" Nothing was denied: {denials}.")
    } else if c.algorithm == "sliding_log" {
        format!(
            " **Denials: {denials}. At this load the hottest tenant sent more than \
                 {limit} per {window} (the most a sliding log holds), so these ratios are of \
                 a run that denied, not of a never-denying one.**"
        )
    } else {
        format!(
            " **Denials: {denials}, though the policy admits 10⁹ per 1 s window: these \
                 ratios are of a run that denied.**"
        )
    };
    md.push_str(&format!(
        "- S{id} (S4 counted by `{algorithm}` instead of the token bucket, no burst) \
             relative to S4, measured in the same {rounds} rounds: req/s {rps} (per round: \
             {per_round}), p50 {p50}, p99 {p99}, Envoy CPU per request {cpu}.{log}{verdict}\n",
        id = c.id,
        algorithm = c.algorithm,
        rounds = c.rounds,
        rps = two(c.rps),
        per_round = per_round.join(", "),
        p50 = two(c.p50),
        p99 = two(c.p99),
        cpu = two(c.envoy_cpu),
    ));
}
