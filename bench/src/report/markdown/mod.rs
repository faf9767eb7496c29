//! The report as markdown: the setup line, the results table, the notes under it (`notes`),
//! scenario 7's table and the targets table. Each section is a method writing into the
//! report's text; the sections are written in that order.

mod notes;

use super::over_limit::OverLimitRun;
use super::Report;

impl Report {
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        self.md_setup(&mut md);
        // Only scenario 7 ran (`--only 7`): no table of the others.
        if !self.scenarios.is_empty() {
            self.md_results(&mut md);
        }
        md.push('\n');
        self.md_notes(&mut md);
        if let Some(first) = self.over_limit.first() {
            self.md_over_limit(&mut md, first);
        }
        self.md_targets(&mut md);
        md
    }

    /// The title and how the run was set up.
    fn md_setup(&self, md: &mut String) {
        let s = &self.setup;
        md.push_str("# tollgate benchmark (`just bench`)\n\n");
        md.push_str(&format!(
            "{date}, commit `{commit}`, {machine}; {envoy}. Envoy `--concurrency {conc}`; \
             wrk `-t{threads} -c{conns}`, {secs:.0} s per run, {rounds} interleaved rounds \
             (medians; ratios are medians of per-round ratios); {tenants} tenants ({dist}) \
             on `GET /items/{{id}}`.\n\n",
            date = s.date,
            commit = s.commit,
            machine = s.machine,
            envoy = s.envoy,
            conc = s.concurrency,
            threads = s.wrk_threads,
            conns = s.connections,
            secs = s.seconds,
            rounds = s.rounds,
            tenants = s.tenants,
            dist = s.distribution,
        ));
    }

    /// One row per scenario, and the responses other than 200.
    fn md_results(&self, md: &mut String) {
        md.push_str(
            "| # | scenario | req/s | × S1 | × S3 | p50 ms | p99 ms | Envoy CPU µs/req | limiter + Redis CPU µs/req | Redis / 1k req (FCALL · all) | Envoy peak RSS | limiter peak RSS |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for sc in &self.scenarios {
            let ratio = |b: &str| {
                if self.scenario(b).is_some() {
                    fixed(self.rps_ratio(&sc.id, b), 2)
                } else {
                    "–".into()
                }
            };
            let redis = sc
                .redis_per_1k()
                .map_or("–".to_string(), |(l, a)| format!("{l:.1} · {a:.1}"));
            let (cpu, backend) = sc.cpu_us_per_request();
            md.push_str(&format!(
                "| {id} | {title} | {rps} | {r1} | {r3} | {p50} | {p99} | {cpu} | {backend} | {redis} | {envoy} | {limiter} |\n",
                id = sc.id,
                title = sc.title,
                rps = fixed(sc.rps(), 0),
                r1 = ratio(if sc.id.ends_with('u') { "1u" } else { "1" }),
                r3 = if sc.id.ends_with('u') { "–".into() } else { ratio("3") },
                p50 = fixed(sc.p50_ms(), 2),
                p99 = fixed(sc.p99_ms(), 2),
                cpu = fixed(cpu, 1),
                backend = fixed(backend, 1),
                envoy = mib(sc.envoy_peak_rss),
                limiter = mib(sc.limiter_peak_rss),
            ));
        }
        let problems: Vec<String> = self
            .scenarios
            .iter()
            .filter(|sc| sc.non_2xx() > 0 || sc.socket_errors() > 0)
            .map(|sc| {
                format!(
                    "S{}: {} responses ≥ 400, {} socket errors",
                    sc.id,
                    sc.non_2xx(),
                    sc.socket_errors()
                )
            })
            .collect();
        md.push('\n');
        if problems.is_empty() {
            md.push_str("Every response was a 200 (no limit denied, no socket error).\n");
        } else {
            md.push_str(&format!(
                "Responses other than 200 (the policies never deny on rate): {}.\n",
                problems.join("; ")
            ));
        }
    }

    /// Scenario 7: how it was run, one row per variant and round, and the totals.
    fn md_over_limit(&self, md: &mut String, first: &OverLimitRun) {
        let s = &self.setup;
        md.push_str(&format!(
            "\n## Scenario 7: over the limit\n\n\
             Two Envoys (`--concurrency {conc}`) share one global policy ({rate}/s, burst \
             {burst}, `on_unavailable: closed`); each variant loads {tenants} fresh keys with \
             paced demand (a Rust client, new connection per request, sends every {tick} ms \
             what the demand owes) for {secs:.0} s, variants one after another in each round. \
             Admitted = requests that reached the upstream; allowed = rate × time + burst per \
             key (each bucket starts full). Lease calls are the filters' (both Envoys); per \
             key per instance they count from one second in. The split is A's admitted over \
             B's after a {warmup:.0} s warm-up, next to the demand split measured the same \
             way. Latencies are the load generator's, per answer.\n\n\
             | round | variant | s | demand × rate | admitted / allowed | overshoot (worst key) | under-use | lease calls /s · /req | lease calls /key/instance/s (A · B) | Redis FCALL /s · /req | admitted A · B | split A:B (demand) | 429 p50 · p99 ms | 200 p50 · p99 ms | undecided · other |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            conc = s.concurrency,
            rate = first.rate,
            burst = first.burst,
            tenants = first.tenants,
            tick = crate::paced::TICK.as_millis(),
            secs = first.seconds,
            warmup = first.warmup_s,
        ));
        for r in &self.over_limit {
            let [la, lb] = r.lease_calls_per_key_instance_s();
            let [a, b] = &r.instances;
            md.push_str(&format!(
                "| {round} | {variant} | {secs:.2} | {demand:.2} | {admitted} / {allowed:.0} | {over:.2} % | {under:.2} % | {lps} · {lpr} | {la} · {lb} | {fps} · {fpr} | {aa} · {ab} | {split} ({dsplit}) | {denied} | {ok} | {undecided} · {other} |\n",
                round = r.round,
                variant = r.variant,
                secs = r.seconds,
                demand = r.demand_ratio(),
                admitted = r.admitted_total(),
                allowed = r.allowed_total(),
                over = r.overshoot_pct(),
                under = r.underuse_pct(),
                lps = fixed(r.lease_calls_per_s(), 1),
                lpr = fixed(r.lease_calls_per_offered(), 4),
                la = fixed(la, 2),
                lb = fixed(lb, 2),
                fps = fixed(r.fcalls_per_s(), 1),
                fpr = fixed(r.fcalls_per_offered(), 4),
                aa = a.admitted,
                ab = b.admitted,
                split = fixed(r.admitted_split(), 2),
                dsplit = fixed(r.demand_split(), 2),
                denied = r.denied_latency.cell(),
                ok = r.admitted_latency.cell(),
                undecided = r.undecided,
                other = r.other(),
            ));
        }
        let retries: u64 = self.over_limit.iter().map(|r| r.retries).sum();
        let assignments: u64 = self
            .over_limit
            .iter()
            .flat_map(|r| r.instances.iter().map(|i| i.assignments))
            .sum();
        md.push_str(&format!(
            "\nOver all variants and rounds: {assignments} limiter answers carried a share \
             of the rate (assignments), {retries} lease requests were sent again after no answer.\n"
        ));
    }

    fn md_targets(&self, md: &mut String) {
        md.push_str("\n## Targets\n\n| target | measured | |\n|---|---:|---|\n");
        for (what, measured, met) in self.targets() {
            let verdict = match met {
                Some(true) => "met",
                Some(false) => "**missed**",
                None => "not measured",
            };
            md.push_str(&format!("| {what} | {measured} | {verdict} |\n"));
        }
    }
}

/// `v` with `digits` decimals, `–` when not measured.
fn fixed(v: Option<f64>, digits: usize) -> String {
    v.map_or("–".to_string(), |v| format!("{v:.digits$}"))
}

/// `v` with 2 decimals, `–` when not measured.
fn two(v: Option<f64>) -> String {
    fixed(v, 2)
}

/// Bytes as whole MiB, `–` when not measured.
fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("–".to_string(), |b| {
        format!("{:.0} MiB", b as f64 / (1024.0 * 1024.0))
    })
}
