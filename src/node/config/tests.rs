use super::*;

fn with_cookie() -> serde_json::Value {
    serde_json::json!({"node": {"cookie": "s3cret"}})
}

#[test]
fn defaults_need_a_cookie() {
    let err = Config::load(None, serde_json::json!({})).unwrap_err();
    assert!(err.to_string().contains("node.cookie"), "{err}");
}

#[test]
fn the_planner_role_needs_capacity_curves_on_the_cpu_engine() {
    let mut o = with_cookie();
    o["node"]["roles"] = serde_json::json!(["gateway", "planner"]);
    let err = Config::load(None, o.clone()).unwrap_err().to_string();
    assert!(err.contains("planner.capacity_profile"), "{err}");
    // The sim engine's profile gives them.
    o["worker"] = serde_json::json!({"engine": "sim"});
    let c = Config::load(None, o).unwrap();
    let sim = crate::worker::engine::sim::SimProfile::default();
    let cap = c.planner_capacity(Some(&sim)).unwrap();
    assert!(cap.check().is_ok());
    assert!(cap.source.contains("sim profile"), "{}", cap.source);
}

#[test]
fn planner_settings_are_checked_at_start_with_the_key_named() {
    let mut o = with_cookie();
    o["planner"] = serde_json::json!({"decode": {"min": 9, "max": 2}});
    let err = Config::load(None, o).unwrap_err().to_string();
    assert!(err.contains("planner.decode.min"), "{err}");
    let mut o = with_cookie();
    o["planner"] = serde_json::json!({"interval_s": -10.0});
    let err = Config::load(None, o).unwrap_err().to_string();
    assert!(err.contains("planner.interval_s"), "{err}");
    let mut o = with_cookie();
    o["planner"] = serde_json::json!({"mode": "sometimes"});
    let err = Config::load(None, o).unwrap_err().to_string();
    assert!(err.contains("mode") && err.contains("sometimes"), "{err}");
    let mut o = with_cookie();
    o["planner"] = serde_json::json!({"capacity_profile": "/nonexistent/capacity.json"});
    let err = Config::load(None, o).unwrap_err().to_string();
    assert!(err.contains("planner.capacity_profile"), "{err}");
    let mut o = with_cookie();
    o["planner"] = serde_json::json!({"mode": "advisory", "forecast": "seasonal_naive"});
    let c = Config::load(None, o).unwrap();
    assert_eq!(
        c.planner.mode,
        crate::control::planner::PlannerMode::Advisory
    );
}

#[test]
fn flags_override_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.toml");
    std::fs::write(
        &path,
        "[cluster]\nliveness_timeout_ms = 9000\n[node]\nroles = [\"worker\"]\ncookie = \"a\"\n",
    )
    .unwrap();
    let cfg = Config::load(
        Some(&path),
        serde_json::json!({"node": {"cookie": "b"}, "cluster": {"suspect_after_ms": 2000}}),
    )
    .unwrap();
    assert_eq!(cfg.cluster.liveness_timeout_ms, 9000);
    assert_eq!(cfg.cluster.suspect_after_ms, 2000);
    assert_eq!(cfg.node.cookie, "b");
    assert_eq!(cfg.node.roles, vec![NodeRole::Worker]);
}

#[test]
fn unknown_fields_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.toml");
    std::fs::write(&path, "[cluster]\nliveness_timeout = 9000\n").unwrap();
    let err = Config::load(Some(&path), with_cookie()).unwrap_err();
    assert!(err.to_string().contains("liveness_timeout"), "{err}");
}

#[test]
fn roles_parse() {
    assert_eq!("worker".parse::<NodeRole>().unwrap(), NodeRole::Worker);
    assert!("nope".parse::<NodeRole>().is_err());
}

#[test]
fn dotted_key_overrides() {
    use figment::Figment;
    use figment::providers::Serialized;
    let o = Figment::from(Serialized::default("node.cookie", "a"))
        .merge(Serialized::default("cluster.suspect_after_ms", 2000))
        .merge(Serialized::default("node.cookie", "b"));
    let cfg = Config::load_with(None, o).unwrap();
    assert_eq!(cfg.node.cookie, "b", "a later key wins");
    assert_eq!(cfg.cluster.suspect_after_ms, 2000);
    let bad = Figment::from(Serialized::default("node.cookie", "a"))
        .merge(Serialized::default("worker.replicas", "many"));
    let err = Config::load_with(None, bad).unwrap_err();
    assert!(err.to_string().contains("worker.replicas"), "{err}");
}

#[test]
fn the_kv_events_layout_is_map_unless_set_to_array() {
    use crate::kv::vllm::EventLayout;
    use figment::Figment;
    use figment::providers::Serialized;
    let cfg = Config::load(None, with_cookie()).unwrap();
    assert_eq!(cfg.worker.kv_events_layout, EventLayout::Map);
    let o = Figment::from(Serialized::default("node.cookie", "a"))
        .merge(Serialized::default("worker.kv_events_layout", "array"));
    let cfg = Config::load_with(None, o).unwrap();
    assert_eq!(cfg.worker.kv_events_layout, EventLayout::Array);
    let bad = Figment::from(Serialized::default("node.cookie", "a"))
        .merge(Serialized::default("worker.kv_events_layout", "tuple"));
    let err = Config::load_with(None, bad).unwrap_err();
    assert!(err.to_string().contains("kv_events_layout"), "{err}");
}

#[test]
fn external_workers_are_read_from_a_file_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.toml");
    std::fs::write(
        &path,
        "[node]\ncookie = \"a\"\n[[router.external_workers]]\nname = \"vllm-a\"\n\
         url = \"http://10.0.0.7:8000\"\nkv_events = \"tcp://10.0.0.7:5557\"\n",
    )
    .unwrap();
    let c = Config::load(Some(&path), serde_json::json!({})).unwrap();
    let e = &c.router.external_workers[0];
    assert_eq!((e.name.as_str(), e.model.as_deref()), ("vllm-a", None));
    assert_eq!(e.kv_events.as_deref(), Some("tcp://10.0.0.7:5557"));
    let check = |ext: serde_json::Value, roles: serde_json::Value| {
        let mut o = with_cookie();
        o["router"] = serde_json::json!({"external_workers": ext});
        o["node"]["roles"] = roles;
        Config::load(None, o).map(|_| ()).map_err(|e| e.to_string())
    };
    let all = serde_json::json!(["gateway", "router", "worker"]);
    let one = |name: &str, url: &str| serde_json::json!([{"name": name, "url": url}]);
    check(one("a", "http://h:1"), all.clone()).unwrap();
    // A node that is no router does not read it (one `--set` for every node of `up`).
    check(one("a", "http://h:1"), serde_json::json!(["worker"])).unwrap();
    for (ext, roles, says) in [
        (
            one("a", "http://h:1"),
            serde_json::json!(["router"]),
            "gateway role",
        ),
        (one("a b", "http://h:1"), all.clone(), "letters"),
        (one("replica-0", "http://h:1"), all.clone(), "own replicas"),
        (one("a", "https://h:1"), all.clone(), "http://"),
        (
            serde_json::json!([{"name": "a", "url": "http://h:1"}, {"name": "a", "url": "http://h:2"}]),
            all.clone(),
            "twice",
        ),
        (
            serde_json::json!([{"name": "a", "url": "http://h:1", "kv_events": "h:5557"}]),
            all.clone(),
            "tcp://",
        ),
    ] {
        let err = check(ext, roles).unwrap_err();
        assert!(
            err.contains("router.external_workers") && err.contains(says),
            "{err}"
        );
    }
}

#[test]
fn router_weights_are_checked_when_the_configuration_loads() {
    for (key, value) in [
        ("decode_weight", serde_json::json!(-1.0)),
        ("overlap_weight", serde_json::json!(-0.5)),
        ("balance_ratio", serde_json::json!(-2.0)),
    ] {
        let mut o = with_cookie();
        o["router"] = serde_json::json!({ key: value });
        let err = Config::load(None, o).unwrap_err().to_string();
        assert!(err.contains("router") && err.contains(key), "{key}: {err}");
    }
    let cfg = Config::load(None, with_cookie()).unwrap();
    assert_eq!(cfg.selector_config().block_size, 16);
}

#[test]
fn kv_tiers_are_checked_with_the_key_named() {
    for (worker, key) in [
        (
            serde_json::json!({"engine": "sim", "kv_disk_blocks": 64}),
            "worker.kv_disk_blocks",
        ),
        (
            serde_json::json!({"kv_host_blocks": 64, "kv_disk_blocks": 64}),
            "worker.kv_disk_dir",
        ),
        (
            serde_json::json!({"engine": "sim", "kv_host_blocks": 8, "sim_host_gbps": 0.0}),
            "worker.sim_host_gbps",
        ),
    ] {
        let mut o = with_cookie();
        o["worker"] = worker;
        let err = Config::load(None, o).unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
    let mut o = with_cookie();
    o["worker"] = serde_json::json!({"engine": "sim", "kv_host_blocks": 8, "kv_disk_blocks": 16});
    o["router"] = serde_json::json!({"tier_credit_host": 2.0});
    let err = Config::load(None, o.clone()).unwrap_err().to_string();
    assert!(err.contains("tier_credit"), "{err}");
    o["router"] = serde_json::json!({});
    let c = Config::load(None, o).unwrap();
    let t = c.tier_config();
    assert_eq!((t.host_blocks, t.disk_blocks, t.disk_min_hits), (8, 16, 1));
}

#[test]
fn a_bad_set_flag_is_named_once() {
    let o = figment::Figment::from(figment::providers::Serialized::default(
        "node.cookie",
        "s3cret",
    ))
    .merge(crate::cli::up::set_override("worker.kv_host_blocks=abc").expect("flag"));
    let err = anyhow::Error::from(Config::load_with(None, o).unwrap_err());
    let text = format!("{err:#}");
    assert!(text.contains("--set worker.kv_host_blocks=abc"), "{text}");
    assert_eq!(text.matches("invalid type").count(), 1, "{text}");
    assert!(!text.contains("src/cli"), "{text}");
}
