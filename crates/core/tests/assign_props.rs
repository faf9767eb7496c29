//! Properties of leases and assignments against a model of the instances that spend them:
//! whatever the interleaving of asks, renewals, answer delays and spends, the fleet never
//! admits more than `burst + rate·t`, and the live shares never exceed the rate.

use proptest::prelude::*;
use tollgate_core::assign::{allot, Ask, Holding, Terms};
use tollgate_core::bucket::{BucketState, Limits};

/// One instance as the filter keeps it: whole tokens it may spend, and a drip that accrues
/// from when the answer arrived until the end of its period, stopped when it asks again.
#[derive(Debug, Default, Clone)]
struct Instance {
    tokens: f64,
    drip_per_ms: f64,
    drip_from: u64,
    drip_until: u64,
}

impl Instance {
    fn accrue(&mut self, now: u64) {
        let end = now.min(self.drip_until);
        if end > self.drip_from {
            self.tokens += self.drip_per_ms * (end - self.drip_from) as f64;
            self.drip_from = end;
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Ask {
        who: usize,
        min: u64,
        want: u64,
        demand_per_s: u32,
        /// Delay until the instance receives the answer.
        latency: u64,
    },
    Spend {
        who: usize,
        units: u64,
    },
}

fn op(instances: usize) -> impl Strategy<Value = (u64, Op)> {
    let ask = (0..instances, 1u64..6, 1u64..30, 0u32..400, 0u64..60).prop_map(
        |(who, min, want, demand_per_s, latency)| Op::Ask {
            who,
            min,
            want,
            demand_per_s,
            latency,
        },
    );
    let spend = (0..instances, 1u64..8).prop_map(|(who, units)| Op::Spend { who, units });
    (0u64..120, prop_oneof![ask, spend])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn fleet_never_admits_more_than_burst_plus_rate_times_t(
        units in 5u64..200,
        burst in 5u64..40,
        period_ms in 200u64..2_000,
        ops in prop::collection::vec(op(4), 1..300),
    ) {
        let limits = Limits::new(units, 1_000, burst).unwrap();
        let terms = Terms { period_ms, lease_ttl_ms: 2_000 };
        let mut state: Option<BucketState> = None;
        let mut holdings: Vec<Holding> = Vec::new();
        let mut fleet = vec![Instance::default(); 4];
        // Answers on their way: (arrives at, who, granted, share, period).
        let mut in_flight: Vec<(u64, usize, u64, f64, u64)> = Vec::new();
        let mut now = 0u64;
        let mut admitted = 0u64;
        for (dt, op) in ops {
            now += dt;
            in_flight.retain(|&(at, who, granted, share, period)| {
                if at > now {
                    return true;
                }
                let i = &mut fleet[who];
                i.accrue(at);
                i.tokens += granted as f64;
                i.drip_per_ms = share;
                i.drip_from = at;
                i.drip_until = at + period;
                false
            });
            match op {
                Op::Ask { who, min, want, demand_per_s, latency } => {
                    if in_flight.iter().any(|f| f.1 == who) {
                        continue;
                    }
                    let min = min.min(burst);
                    let want = want.clamp(min, burst);
                    let i = &mut fleet[who];
                    // Asking again stops the running drip.
                    i.accrue(now);
                    i.drip_until = i.drip_until.min(now);
                    let holder = format!("i{who}");
                    let ask = Ask {
                        min,
                        want,
                        holder: Some(&holder),
                        demand_per_ms: f64::from(demand_per_s) / 1_000.0,
                    };
                    let (next, a) = allot(&limits, state, &mut holdings, now, ask, terms);
                    state = Some(next);
                    prop_assert!(a.granted == 0 || (a.granted >= min && a.granted <= want));
                    let live: f64 = holdings.iter().filter(|h| h.ends_ms > now)
                        .map(|h| h.share_per_ms).sum();
                    prop_assert!(live <= limits.refill_per_ms() * (1.0 + 1e-9), "shares {live}");
                    prop_assert!(next.tokens <= limits.capacity());
                    in_flight.push((now + latency, who, a.granted, a.share_per_ms, a.period_ms));
                }
                Op::Spend { who, units } => {
                    let i = &mut fleet[who];
                    i.accrue(now);
                    if i.tokens + 1e-9 >= units as f64 {
                        i.tokens -= units as f64;
                        admitted += units;
                    }
                }
            }
            if let Some(st) = state {
                let b = tollgate_core::assign::current(&limits, Some(st), now).tokens;
                let u: f64 = holdings.iter().filter(|h| h.ends_ms > now)
                    .map(|h| h.share_per_ms * (h.ends_ms - now) as f64).sum();
                prop_assert!(b + u >= -1e-6, "V = {b} + {u} < 0 at {now}");
            }
            let bound = burst as f64 + limits.refill_per_ms() * now as f64;
            prop_assert!(admitted as f64 <= bound + 1e-6, "admitted {admitted} > {bound} at {now}");
        }
    }

    #[test]
    fn backward_time_creates_nothing(
        tokens in -100.0f64..40.0,
        at in 1_000u64..2_000,
        back in 1u64..1_000,
    ) {
        let limits = Limits::new(50, 1_000, 40).unwrap();
        let s = BucketState { tokens, updated_ms: at };
        let earlier = tollgate_core::assign::current(&limits, Some(s), at - back);
        prop_assert_eq!(earlier.tokens, tokens.min(40.0));
        prop_assert_eq!(earlier.updated_ms, at);
    }
}
