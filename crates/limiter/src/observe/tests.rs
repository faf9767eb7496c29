//! The observer as the service drives it: items in, the hot-key report, the warnings, the
//! gauges and the execution counters out.

use tollgate_core::bucket::Limits;
use tollgate_core::policy::Algorithm;

use super::*;

fn item(policy: &str, key: &str, want: u64) -> LeaseItem {
    LeaseItem {
        id: "i".into(),
        policy: policy.into(),
        key: key.into(),
        limits: Limits::new(1, 1_000, 100).unwrap(),
        algorithm: Algorithm::TokenBucket,
        min: 1,
        want,
        holder: None,
        demand_per_ms: 0.0,
    }
}

fn grant(granted: u64, remaining: f64) -> Grant {
    Grant {
        granted,
        remaining,
        retry_after_ms: 0,
        replayed: false,
        share_per_ms: 0.0,
        period_ms: 0,
        expires_ms: None,
    }
}

fn observer(settings: HotKeySettings) -> Observer {
    Observer::new(settings, b"test salt", Metrics::new().unwrap())
}

/// 2,000 calls over 20 seconds: tenant `hot` a quarter of them on node `a`, 1,500 distinct
/// cold tenants the rest, spread over nodes `a` and `b`.
fn drive(o: &Observer) {
    let mut cold = 0;
    for n in 0..2_000u64 {
        let now_s = n / 100;
        if n % 4 == 0 {
            o.lease_decided_at(now_s, &item("p", "hot", 5), Some(&grant(5, 40.0)), "a");
        } else {
            let node = if cold % 2 == 0 { "a" } else { "b" };
            let key = format!("cold-{cold}");
            o.lease_decided_at(now_s, &item("p", &key, 1), Some(&grant(1, 99.0)), node);
            cold += 1;
        }
    }
}

#[test]
fn the_report_puts_the_hot_key_first_hashed() {
    let o = observer(HotKeySettings::default());
    drive(&o);
    let v = o.hot_keys_json_at(19);
    let text = v.to_string();
    assert_eq!(v["window_s"], 60);
    let p = &v["policies"][0];
    assert_eq!(p["policy"], "p");
    assert_eq!(p["calls"], 2_000);
    assert_eq!(p["units_asked"], 500 * 5 + 1_500);
    let active = p["active_keys"].as_u64().unwrap();
    // 1,501 distinct keys; linear counting's standard error is ~1.2 % here.
    assert!((1_426..=1_576).contains(&active), "{active}");
    let hot = &p["hot_keys"][0];
    let shown = KeyHasher::show(KeyHasher::new(b"test salt").hash("hot"));
    assert_eq!(hot["key"], shown.as_str());
    assert_eq!(shown.len(), 12);
    assert_eq!(hot["node"], "a");
    assert_eq!(hot["calls"], 500);
    assert_eq!(
        (hot["calls_min"].as_u64(), hot["calls_max"].as_u64()),
        (Some(500), Some(500))
    );
    assert_eq!(hot["units_granted"], 2_500);
    // Node a: 500 hot + 750 cold calls.
    let share = hot["share_of_node"].as_f64().unwrap();
    assert!((share - 0.4).abs() < 1e-9, "{share}");
    assert_eq!(p["hot_keys"].as_array().unwrap().len(), 10);
    assert!(!text.contains("hot\"") && !text.contains("cold-"), "{text}");
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    assert_eq!(nodes[0]["calls"], 1_250);
    // A minute later it has all gone.
    assert_eq!(o.hot_keys_json_at(80)["policies"], serde_json::json!([]));
}

#[test]
fn the_hash_is_salted() {
    let a = KeyHasher::new(b"one").hash("tenant");
    assert_eq!(a, KeyHasher::new(b"one").hash("tenant"));
    assert_ne!(a, KeyHasher::new(b"two").hash("tenant"));
    // SHA-256("one" || "tenant") begins with these 12 hex digits
    // (`printf 'onetenant' | sha256sum`).
    assert_eq!(KeyHasher::show(a), "34e27f709f3b");
}

#[test]
fn a_key_above_its_share_is_logged_once_a_minute() {
    let o = observer(HotKeySettings {
        min_calls: 100,
        share: 0.3,
        ..HotKeySettings::default()
    });
    drive(&o);
    let alerts = o.check_hot_keys_at(19);
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(alerts[0].policy, "p");
    assert_eq!(alerts[0].node, "a");
    assert_eq!((alerts[0].calls, alerts[0].node_calls), (500, 1_250));
    // Not again within the minute; again after it, if still hot.
    assert!(o.check_hot_keys_at(30).is_empty());
    for n in 0..1_000 {
        o.lease_decided_at(70 + n / 100, &item("p", "hot", 1), None, "a");
    }
    assert_eq!(o.check_hot_keys_at(79).len(), 1);
}

#[test]
fn a_quiet_or_spread_limiter_logs_nothing() {
    // Above the share but below the minimum number of calls.
    let o = observer(HotKeySettings {
        min_calls: 501,
        share: 0.3,
        ..HotKeySettings::default()
    });
    drive(&o);
    assert!(o.check_hot_keys_at(19).is_empty());
    // Enough calls but below the share.
    let o = observer(HotKeySettings {
        min_calls: 100,
        share: 0.5,
        ..HotKeySettings::default()
    });
    drive(&o);
    assert!(o.check_hot_keys_at(19).is_empty());
}

#[test]
fn gauges_and_the_remaining_ratio() {
    let metrics = Metrics::new().unwrap();
    let o = Observer::new(HotKeySettings::default(), b"s", metrics.clone());
    for k in 0..40 {
        let key = format!("tenant-secret-{k}");
        o.lease_decided(&item("p", &key, 1), Some(&grant(1, 25.0)), "m");
    }
    // A replay is no reading of the bucket; a debt reads as 0.
    let replay = Grant {
        replayed: true,
        ..grant(1, 90.0)
    };
    o.lease_decided(&item("p", "tenant-secret-0", 1), Some(&replay), "m");
    o.lease_decided(&item("p", "tenant-secret-0", 1), Some(&grant(0, -3.0)), "m");
    o.refresh_gauges();
    let text = metrics.render();
    let active: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(r#"tollgate_limiter_active_keys{policy="p"} "#))
        .unwrap()
        .parse()
        .unwrap();
    assert!((39..=41).contains(&active), "{active}");
    for needle in [
        r#"tollgate_limiter_remaining_ratio_bucket{policy="p",le="0"} 1"#,
        r#"tollgate_limiter_remaining_ratio_bucket{policy="p",le="0.2"} 1"#,
        r#"tollgate_limiter_remaining_ratio_bucket{policy="p",le="0.3"} 41"#,
        r#"tollgate_limiter_remaining_ratio_count{policy="p"} 41"#,
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    assert!(!text.contains("tenant-secret"), "{text}");
}

#[test]
fn execution_counters_add_deltas_from_a_baseline() {
    let metrics = Metrics::new().unwrap();
    let o = Observer::new(HotKeySettings::default(), b"s", metrics.clone());
    let at = |calls, usec| {
        vec![(
            "n:1".to_owned(),
            ExecStats {
                calls,
                usec: f64::from(usec),
            },
        )]
    };
    o.record_exec(&at(1_000, 50_000));
    let text = metrics.render();
    assert!(
        text.contains(r#"tollgate_limiter_store_exec_calls_total{node="n:1"} 0"#),
        "{text}"
    );
    o.record_exec(&at(1_010, 50_300));
    // The node restarted: its counts start from zero again.
    o.record_exec(&at(4, 100));
    let text = metrics.render();
    for needle in [
        r#"tollgate_limiter_store_exec_calls_total{node="n:1"} 14"#,
        r#"tollgate_limiter_store_exec_microseconds_total{node="n:1"} 400"#,
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[test]
fn the_salt_file_is_read_and_checked() {
    let dir = std::env::temp_dir().join(format!("tollgate-salt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("salt");
    std::fs::write(&file, "shared-salt\n").unwrap();
    let settings = HotKeySettings {
        salt_file: Some(file.clone()),
        ..HotKeySettings::default()
    };
    assert_eq!(settings.load_salt().unwrap(), b"shared-salt");
    std::fs::write(&file, "\n").unwrap();
    let e = settings.load_salt().unwrap_err();
    assert!(
        e.contains("--hot-key-salt-file") && e.contains("empty"),
        "{e}"
    );
    std::fs::remove_file(&file).unwrap();
    let e = settings.load_salt().unwrap_err();
    assert!(e.contains("cannot read --hot-key-salt-file"), "{e}");
    // Without a file: random, so two processes (here: two calls) differ.
    let random = HotKeySettings::default();
    assert_ne!(random.load_salt().unwrap(), random.load_salt().unwrap());
    std::fs::remove_dir_all(&dir).ok();
}
