use super::*;
use proptest::prelude::*;

const TERMS: Terms = Terms {
    lease_ttl_ms: 2_000,
    period_ms: 1_000,
    renew_lead_ms: 0,
    remember_ms: 60_000,
};

fn ask(min: u64, want: u64, holder: &str, demand_per_s: f64) -> Ask<'_> {
    Ask {
        min,
        want,
        holder: Some(holder),
        demand_per_ms: demand_per_s / 1_000.0,
    }
}

fn lease(granted: u64, expires_ms: u64) -> Received {
    Received {
        granted,
        expires_ms,
        share_per_ms: 0.0,
        period_ms: 0,
        retry_after_ms: 0,
    }
}

fn decided(answer: Answer) -> Grant {
    match answer {
        Answer::Decided(grant) => grant,
        Answer::Dry => panic!("expected a decision, got Dry"),
    }
}

#[test]
fn a_dry_reservoir_asks_the_parent_for_the_waiting_min() {
    let mut r = Reservoir::default();
    assert_eq!(r.ask(ask(3, 10, "a", 100.0), 0, TERMS), Answer::Dry);
    let wanted = r.parent_ask(0, 50).unwrap();
    assert_eq!(wanted.min, 3);
    // A second of 100/s, within the burst.
    assert_eq!(wanted.want, 50);
    r.receive("p1", &lease(60, 2_000), 0, 5, TERMS);
    assert_eq!(r.parent_ask(5, 50), None, "60 tokens cover 500 ms of 100/s");
    let g = decided(r.ask(ask(3, 10, "a", 100.0), 5, TERMS));
    assert_eq!(g.granted, 10);
    assert_eq!(g.remaining, 50.0);
    // 49 would not: the region refills in the background.
    decided(r.ask(ask(1, 1, "a", 100.0), 6, TERMS));
    assert_eq!(r.parent_ask(6, 50).map(|a| a.min), Some(1));
    // The lease the region hands out ends with the parent's (sent at 0, 2 s).
    assert_eq!(g.expires_ms, Some(1_995));
}

#[test]
fn leases_that_expire_first_are_spent_first_and_expiry_loses_the_rest() {
    let mut r = Reservoir::default();
    r.receive("late", &lease(5, 3_000), 0, 0, TERMS);
    r.receive("early", &lease(5, 1_000), 0, 0, TERMS);
    let g = decided(r.ask(ask(4, 4, "a", 1.0), 10, TERMS));
    assert_eq!(g.granted, 4);
    assert_eq!(g.expires_ms, Some(990));
    assert_eq!(r.spendable(10), 6);
    assert_eq!(r.take_expiring(800, 250), vec![("early".to_owned(), 1)]);
    assert_eq!(r.expire(3_000, TERMS), Expired { tokens: 5 });
    assert_eq!(r.spendable(3_000), 0);
}

#[test]
fn a_drip_is_shared_by_demand_and_ends_with_the_region() {
    let mut r = Reservoir::default();
    // 100/s for the region, for 1 s.
    let assignment = Received {
        granted: 0,
        expires_ms: 3_000,
        share_per_ms: 0.1,
        period_ms: 1_000,
        retry_after_ms: 0,
    };
    assert_eq!(r.ask(ask(1, 10, "a", 300.0), 0, TERMS), Answer::Dry);
    r.receive("p1", &assignment, 0, 0, TERMS);
    assert!(r.dripping(0));
    assert_eq!(
        r.parent_ask(500, 100),
        None,
        "no renewal while the drip runs"
    );
    let a = decided(r.ask(ask(1, 10, "a", 300.0), 0, TERMS));
    // Alone, `a` gets all of the region's 100/s.
    assert_eq!(a.granted, 0);
    assert!((a.share_per_ms - 0.1).abs() < 1e-12);
    assert_eq!(a.period_ms, 1_000);
    // `b` comes with the same demand: the rate is taken by `a` until `a` asks again.
    let b = decided(r.ask(ask(1, 10, "b", 300.0), 100, TERMS));
    assert_eq!(b.share_per_ms, 0.0);
    assert!(b.retry_after_ms >= 1);
    // `a` renews at 200: half of the rate, for the 800 ms the region's drip has left.
    let a = decided(r.ask(ask(1, 10, "a", 300.0), 200, TERMS));
    assert!((a.share_per_ms - 0.05).abs() < 1e-12, "{a:?}");
    assert_eq!(a.period_ms, 800);
    let b = decided(r.ask(ask(1, 10, "b", 300.0), 210, TERMS));
    assert!((b.share_per_ms - 0.05).abs() < 1e-9, "{b:?}");
    assert_eq!(b.period_ms, 790);
    // After the drip, the region asks again with the sum of the demands.
    r.expire(1_000, TERMS);
    let renew = r.parent_ask(1_000, 100).unwrap();
    assert!((renew.demand_per_ms - 0.6).abs() < 1e-12);
}

#[test]
fn a_parent_denial_is_passed_on_until_its_retry_time() {
    let mut r = Reservoir::default();
    assert_eq!(r.ask(ask(1, 5, "a", 10.0), 0, TERMS), Answer::Dry);
    r.receive(
        "p1",
        &Received {
            granted: 0,
            expires_ms: 0,
            share_per_ms: 0.0,
            period_ms: 0,
            retry_after_ms: 700,
        },
        0,
        10,
        TERMS,
    );
    let g = decided(r.ask(ask(1, 5, "a", 10.0), 110, TERMS));
    assert_eq!((g.granted, g.retry_after_ms), (0, 600));
    assert_eq!(r.parent_ask(110, 50), None);
    assert_eq!(r.ask(ask(1, 5, "a", 10.0), 710, TERMS), Answer::Dry);
}

#[test]
fn returns_go_back_into_a_live_lease_or_are_lost() {
    let mut r = Reservoir::default();
    r.receive("p1", &lease(10, 1_000), 0, 0, TERMS);
    decided(r.ask(ask(10, 10, "a", 1.0), 0, TERMS));
    assert_eq!(r.give_back(4, 100), Expired::default());
    assert_eq!(r.spendable(100), 4);
    r.expire(1_000, TERMS);
    assert_eq!(r.give_back(3, 1_000), Expired { tokens: 3 });
    assert!(r.idle(5_000, 1_000));
}

#[test]
fn a_lease_id_is_remembered_as_long_as_a_plain_limiter_does_and_past_its_return() {
    // The limiter's --dedup-ttl (60 s by default) is what a plain limiter keeps an id for.
    assert_eq!(TERMS.record_lifetime_ms(0), 60_000);
    assert_eq!(TERMS.record_lifetime_ms(1_000), 60_000);
    // Never shorter than the lease can be spent (TTL, plus a sub-share's period) plus the
    // time its holder's tick takes to return what it did not spend.
    let short = Terms {
        remember_ms: 0,
        ..TERMS
    };
    assert_eq!(short.record_lifetime_ms(0), 2_000 + RETURN_SLACK_MS);
    assert_eq!(short.record_lifetime_ms(1_000), 3_000 + RETURN_SLACK_MS);
    assert!(TERMS.record_lifetime_ms(1_000) > TERMS.lease_ttl_ms + 1_000 + RETURN_SLACK_MS);
}

#[test]
fn an_answer_says_which_parent_leases_its_tokens_came_from() {
    let mut r = Reservoir::default();
    r.receive("late", &lease(5, 3_000), 0, 0, TERMS);
    r.receive("early", &lease(5, 1_000), 0, 0, TERMS);
    let g = decided(r.ask(ask(7, 7, "a", 1.0), 10, TERMS));
    assert_eq!(g.granted, 7);
    let mut sources = r.take_sources();
    assert_eq!(sources.total(), 7);
    assert_eq!(r.take_sources(), Sources::default(), "taken once");
    // "early" has expired: a return of 3 goes back into "late" (2 came from it, live) and
    // on to the parent for the 1 of "early", never more than each gave.
    r.expire(1_000, TERMS);
    let left_late = r.spendable(1_000);
    let mut copy = sources.clone();
    assert_eq!(
        r.give_back_to(3, &mut copy, 1_000),
        vec![("early".to_owned(), 1)]
    );
    assert_eq!(r.spendable(1_000), left_late + 2);
    // Both expired: a late return goes to the parent, most recent source first.
    r.expire(3_000, TERMS);
    assert_eq!(
        r.give_back_to(6, &mut sources, 3_000),
        vec![("late".to_owned(), 2), ("early".to_owned(), 4)]
    );
    assert_eq!(sources.take(5), vec![("early".to_owned(), 1)]);
    assert_eq!(sources.total(), 0);
    // A denial draws nothing.
    let _ = r.ask(ask(1, 1, "a", 1.0), 3_000, TERMS);
    assert_eq!(r.take_sources().total(), 0);
}

#[test]
fn a_sub_share_draws_on_the_region_drip() {
    let mut r = Reservoir::default();
    let share = Received {
        granted: 0,
        expires_ms: 3_000,
        share_per_ms: 0.05,
        period_ms: 1_000,
        retry_after_ms: 0,
    };
    r.receive("assignment", &share, 0, 0, TERMS);
    let g = decided(r.ask(ask(1, 100, "a", 100.0), 0, TERMS));
    assert!(g.share_per_ms > 0.0);
    let whole = (g.share_per_ms * g.period_ms as f64).floor() as u64;
    let sources = r.take_sources();
    assert_eq!(sources.total(), g.granted + whole);
    assert!(whole > 0);
}

/// One step of a random history.
#[derive(Debug, Clone)]
enum Op {
    /// Instance `who` asks (`min`, `want`, demand per s) after `dt` ms.
    Ask {
        dt: u64,
        who: usize,
        min: u64,
        want: u64,
        demand: f64,
    },
    /// The parent answers the region's pending ask.
    Parent {
        dt: u64,
        granted: u64,
        share_per_s: f64,
        period_ms: u64,
    },
    /// Instance `who` returns `unused` of what it holds.
    Return { dt: u64, who: usize, unused: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..300, 0usize..4, 1u64..5, 1u64..20, 0.0f64..500.0).prop_map(
            |(dt, who, min, want, demand)| Op::Ask {
                dt,
                who,
                min,
                want,
                demand
            }
        ),
        (0u64..300, 0u64..30, 0.0f64..200.0, 1u64..1_500).prop_map(
            |(dt, granted, share_per_s, period_ms)| Op::Parent {
                dt,
                granted,
                share_per_s,
                period_ms
            }
        ),
        (0u64..300, 0usize..4, 0u64..10).prop_map(|(dt, who, unused)| Op::Return {
            dt,
            who,
            unused
        }),
    ]
}

/// An instance that spends everything it may as soon as it may.
#[derive(Debug, Default, Clone)]
struct Instance {
    /// Tokens received and not spent (it spends them at once, but may return some).
    spent: f64,
    held: u64,
    share_per_ms: f64,
    from_ms: u64,
    ends_ms: u64,
}

impl Instance {
    fn dripped(&self, now_ms: u64) -> f64 {
        self.share_per_ms * (now_ms.min(self.ends_ms).saturating_sub(self.from_ms)) as f64
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Whatever the instances ask, return and receive, and whatever the parent answers, the
    /// region's instances never spend more than the parent has given the region so far.
    #[test]
    fn instances_never_spend_more_than_the_parent_gave(ops in proptest::collection::vec(op(), 1..120)) {
        let mut r = Reservoir::default();
        let mut instances = vec![Instance::default(); 4];
        // (share per ms, from, end) of every drip the region received, and leased tokens.
        let mut drips: Vec<(f64, u64, u64)> = Vec::new();
        let mut leased = 0u64;
        let mut now = 0u64;
        let mut seq = 0;
        let given_by = |now: u64, drips: &Vec<(f64, u64, u64)>, leased: u64| {
            leased as f64 + drips.iter().map(|(s, from, end)| s * (now.min(*end).saturating_sub(*from)) as f64).sum::<f64>()
        };
        for op in ops {
            match op {
                Op::Ask { dt, who, min, want, demand } => {
                    now += dt;
                    r.expire(now, TERMS);
                    let inst = &mut instances[who];
                    // Asking ends the instance's own drip (it stops when it asks).
                    inst.spent += inst.dripped(now);
                    inst.share_per_ms = 0.0;
                    let id = format!("i{who}");
                    if let Answer::Decided(g) = r.ask(Ask { min, want: want.max(min), holder: Some(&id), demand_per_ms: demand / 1_000.0 }, now, TERMS) {
                        prop_assert!(g.granted == 0 || g.granted >= min);
                        inst.spent += g.granted as f64;
                        inst.held += g.granted;
                        if g.share_per_ms > 0.0 {
                            inst.share_per_ms = g.share_per_ms;
                            inst.from_ms = now;
                            inst.ends_ms = now + g.period_ms;
                        }
                    }
                }
                Op::Parent { dt, granted, share_per_s, period_ms } => {
                    now += dt;
                    r.expire(now, TERMS);
                    if r.parent_ask(now, 50).is_none() {
                        continue;
                    }
                    seq += 1;
                    let got = Received { granted, expires_ms: 2_000, share_per_ms: share_per_s / 1_000.0, period_ms, retry_after_ms: 50 };
                    let was_dripping = r.dripping(now);
                    r.receive(&format!("p{seq}"), &got, now, now, TERMS);
                    leased += granted;
                    if got.share_per_ms > 0.0 && !was_dripping {
                        drips.push((got.share_per_ms, now, now + period_ms));
                    }
                }
                Op::Return { dt, who, unused } => {
                    now += dt;
                    r.expire(now, TERMS);
                    // An instance returns only tokens it holds and has not spent: in this
                    // model it spends at once, so it "un-spends" what it returns.
                    let inst = &mut instances[who];
                    let unused = unused.min(inst.held);
                    inst.held -= unused;
                    inst.spent -= unused as f64;
                    r.give_back(unused, now);
                }
            }
            let spent: f64 = instances.iter().map(|i| i.spent + i.dripped(now)).sum();
            let given = given_by(now, &drips, leased);
            prop_assert!(spent <= given + 1e-6, "spent {spent} > given {given} at {now}");
            // Looking ahead: what instances may still drip is covered by what the region's
            // drips still bring.
            let horizon = now + 10_000;
            let spent_later: f64 = instances.iter().map(|i| i.spent + i.dripped(horizon)).sum();
            prop_assert!(spent_later <= given_by(horizon, &drips, leased) + 1e-6);
        }
    }
}

#[test]
fn the_drip_stops_the_renewal_lead_before_the_parent_holding_ends() {
    let terms = Terms {
        renew_lead_ms: 100,
        ..TERMS
    };
    let mut r = Reservoir::default();
    let share = Received {
        granted: 0,
        expires_ms: 3_000,
        share_per_ms: 0.05,
        period_ms: 1_000,
        retry_after_ms: 0,
    };
    assert_eq!(r.ask(ask(1, 10, "a", 100.0), 0, terms), Answer::Dry);
    r.receive("p1", &share, 0, 0, terms);
    // 50/s until 900 ms: 45 tokens in all.
    assert_eq!(r.held(0), 45);
    let a = decided(r.ask(ask(1, 100, "a", 100.0), 0, terms));
    assert_eq!(a.period_ms, 900);
    assert!(r.dripping(899));
    assert!(!r.dripping(900));
    assert!(
        r.parent_ask(900, 100).is_some(),
        "renews at 900, before the parent's 1 000"
    );
    // A lead longer than a quarter of the period is cut to the quarter.
    let mut short = Reservoir::default();
    short.receive(
        "p2",
        &Received {
            period_ms: 200,
            ..share
        },
        0,
        0,
        terms,
    );
    assert!(short.dripping(149) && !short.dripping(150));
}
