//! Scenario 7's load generator: paced demand on two Envoys at once, built from the harness
//! client ([`tollgate_e2e::client::burst_detailed`]) because it reports every request's status
//! and latency (wrk gives one latency distribution for all answers).
//!
//! Every tick (20 ms) each instance is sent what its demand owes since the start: for a
//! demand of `r` requests per second per key, tick `n` brings the total sent to
//! `floor(r × tick × (n + 1))` per key ([`due`]), so the offered rate is exact whatever the
//! rate and tick, and late ticks catch up instead of lowering the demand. A tick's requests
//! start together, one connection each, keys interleaved. Every answer is also counted in the
//! second of the run its tick was sent in ([`Second`]), per instance, for the over-time chart.

use std::time::{Duration, Instant};

use tollgate_e2e::client::{burst_detailed, RequestSpec};

/// Time between two sends.
pub const TICK: Duration = Duration::from_millis(20);
/// A request not answered within this is counted as `other`.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Total requests per key owed by the end of tick `n` (0-based) at `per_s` requests/s.
pub fn due(per_s: f64, tick: Duration, n: u64) -> u64 {
    (per_s * tick.as_secs_f64() * (n + 1) as f64 + 1e-9).floor() as u64
}

/// Number of ticks in a run of `seconds`.
pub fn ticks(seconds: f64, tick: Duration) -> u64 {
    (seconds / tick.as_secs_f64()).round().max(1.0) as u64
}

/// One instance's demand: where to send and how much per key.
#[derive(Debug, Clone, Copy)]
pub struct Demand {
    pub port: u16,
    /// Requests per second per key.
    pub per_key_per_s: f64,
}

/// One second of a paced run at one instance: what was sent in it and how it was answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Second {
    pub offered: u64,
    pub admitted: u64,
    pub denied: u64,
}

impl Second {
    fn add(&mut self, other: Second) {
        self.offered += other.offered;
        self.admitted += other.admitted;
        self.denied += other.denied;
    }
}

/// The second of the run (0-based) tick `n` is sent in.
pub fn second_of_tick(n: u64, tick: Duration) -> usize {
    ((n as f64 * tick.as_secs_f64()) + 1e-9).floor() as usize
}

/// What one instance saw during a paced run.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    pub offered: u64,
    pub admitted: u64,
    pub denied: u64,
    /// Neither 200 nor 429: other statuses and transport errors.
    pub other: u64,
    /// Offered and admitted from the end of the warm-up on (the split is judged on these).
    pub offered_steady: u64,
    pub admitted_steady: u64,
    /// Latency of every 200 and every 429, µs.
    pub admitted_us: Vec<u64>,
    pub denied_us: Vec<u64>,
    /// Per second of the run (by the second each request was sent in).
    pub per_second: Vec<Second>,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.offered += other.offered;
        self.admitted += other.admitted;
        self.denied += other.denied;
        self.other += other.other;
        self.offered_steady += other.offered_steady;
        self.admitted_steady += other.admitted_steady;
        self.admitted_us.extend(other.admitted_us);
        self.denied_us.extend(other.denied_us);
        if self.per_second.len() < other.per_second.len() {
            self.per_second
                .resize(other.per_second.len(), Second::default());
        }
        for (sum, s) in self.per_second.iter_mut().zip(other.per_second) {
            sum.add(s);
        }
    }
}

fn request(tenant: &str, id: u64) -> RequestSpec {
    RequestSpec::get(format!("/items/{id}"))
        .host("api.example.com")
        .header("x-tenant-id", tenant)
}

/// One tick's requests to one instance: `per_key` for each tenant, interleaved.
async fn tick_burst(
    port: u16,
    tenants: &[String],
    per_key: u64,
    first_id: u64,
    steady: bool,
    second: usize,
) -> Tally {
    let n = (per_key as usize) * tenants.len();
    let mut t = Tally {
        per_second: vec![Second::default(); second + 1],
        ..Tally::default()
    };
    if n == 0 || tenants.is_empty() {
        return t;
    }
    let results = burst_detailed(port, n, n, REQUEST_TIMEOUT, |i| {
        let tenant = tenants.get(i % tenants.len()).map_or("", String::as_str);
        request(tenant, first_id + i as u64)
    })
    .await;
    let mut this_second = Second::default();
    for r in results {
        t.offered += 1;
        this_second.offered += 1;
        if steady {
            t.offered_steady += 1;
        }
        let us = r.latency.as_micros() as u64;
        match r.response.as_ref().map(|resp| resp.status) {
            Ok(200) => {
                t.admitted += 1;
                this_second.admitted += 1;
                if steady {
                    t.admitted_steady += 1;
                }
                t.admitted_us.push(us);
            }
            Ok(429) => {
                t.denied += 1;
                this_second.denied += 1;
                t.denied_us.push(us);
            }
            _ => t.other += 1,
        }
    }
    if let Some(slot) = t.per_second.get_mut(second) {
        *slot = this_second;
    }
    t
}

/// Paced demand on two instances for `seconds`, the same `tenants` on both. Returns each
/// instance's tally and the elapsed time (first tick to last answer); `at_one_second` is
/// called once, at the first tick one second or more into the run.
pub async fn run(
    instances: [Demand; 2],
    tenants: &[String],
    seconds: f64,
    warmup: Duration,
    mut at_one_second: impl FnMut(),
) -> ([Tally; 2], f64) {
    let n_ticks = ticks(seconds, TICK);
    let start = Instant::now();
    let mut interval = tokio::time::interval(TICK);
    let mut pending = Vec::new();
    let mut called = false;
    for n in 0..n_ticks {
        interval.tick().await;
        if !called && start.elapsed() >= Duration::from_secs(1) {
            at_one_second();
            called = true;
        }
        let steady = start.elapsed() >= warmup;
        for (i, d) in instances.iter().enumerate() {
            let per_key = due(d.per_key_per_s, TICK, n)
                - n.checked_sub(1)
                    .map_or(0, |p| due(d.per_key_per_s, TICK, p));
            let tenants = tenants.to_vec();
            let port = d.port;
            // Request ids unique per instance and tick (paths only; the key is the header).
            let first_id = (n * 2 + i as u64) * 10_000;
            let second = second_of_tick(n, TICK);
            pending.push((
                i,
                tokio::spawn(async move {
                    tick_burst(port, &tenants, per_key, first_id, steady, second).await
                }),
            ));
        }
    }
    if !called {
        at_one_second();
    }
    let mut tallies = [Tally::default(), Tally::default()];
    for (i, handle) in pending {
        // A panicked tick counts as nothing offered: the totals then show the gap.
        let t = handle.await.unwrap_or_default();
        if let Some(sum) = tallies.get_mut(i) {
            sum.add(t);
        }
    }
    (tallies, start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacing_owes_exactly_the_rate() {
        let tick = Duration::from_millis(20);
        // 75/s: 1.5 per tick, alternating 1 and 2.
        assert_eq!(due(75.0, tick, 0), 1);
        assert_eq!(due(75.0, tick, 1), 3);
        assert_eq!(due(75.0, tick, 2), 4);
        assert_eq!(ticks(8.0, tick), 400);
        assert_eq!(due(75.0, tick, ticks(8.0, tick) - 1), 600);
        // Exact multiples are not lost to rounding (0.2 × 5 × 0.02 × 50 is 5, not 4.999…).
        assert_eq!(due(50.0, tick, 49), 50);
        assert_eq!(due(0.0, tick, 10), 0);
        assert_eq!(ticks(0.001, tick), 1);
    }

    #[test]
    fn ticks_fall_in_their_second() {
        let tick = Duration::from_millis(20);
        assert_eq!(second_of_tick(0, tick), 0);
        assert_eq!(second_of_tick(49, tick), 0);
        assert_eq!(second_of_tick(50, tick), 1);
        assert_eq!(second_of_tick(399, tick), 7);
    }

    #[test]
    fn tallies_add_up_per_second() {
        let one = |second: usize, admitted: u64| Tally {
            offered: 3,
            admitted,
            denied: 3 - admitted,
            per_second: {
                let mut v = vec![Second::default(); second + 1];
                if let Some(s) = v.get_mut(second) {
                    *s = Second {
                        offered: 3,
                        admitted,
                        denied: 3 - admitted,
                    };
                }
                v
            },
            ..Tally::default()
        };
        let mut sum = Tally::default();
        sum.add(one(2, 1));
        sum.add(one(0, 3));
        sum.add(one(2, 2));
        assert_eq!(sum.offered, 9);
        assert_eq!(
            sum.per_second,
            vec![
                Second {
                    offered: 3,
                    admitted: 3,
                    denied: 0
                },
                Second::default(),
                Second {
                    offered: 6,
                    admitted: 3,
                    denied: 3
                },
            ]
        );
    }
}
