use super::*;

fn info(id: &str, incarnation: u64) -> NodeInfo {
    NodeInfo {
        id: NodeId::new(id),
        addr: "127.0.0.1:1".into(),
        http_addr: None,
        roles: vec![NodeRole::Worker],
        incarnation,
        pid: 1,
        actors: vec![],
        workers: vec![],
        counters: Default::default(),
        signals: None,
        planner: None,
        regions: vec![],
    }
}

fn leases() -> Leases {
    Leases {
        suspect_after: Duration::from_millis(1000),
        down_after: Duration::from_millis(3000),
        retention: Duration::from_millis(10_000),
    }
}

#[test]
fn lease_walks_up_suspect_down_forgotten() {
    let t0 = Instant::now();
    let mut m = Membership::new(info("me", 1), leases());
    assert_eq!(
        m.on_heartbeat(info("a", 1), t0),
        vec![MembershipEvent::NodeUp(Box::new(info("a", 1)))]
    );
    assert!(
        m.on_heartbeat(info("a", 1), t0).is_empty(),
        "a repeat heartbeat is not news"
    );
    assert!(m.tick(t0 + Duration::from_millis(999)).is_empty());
    assert_eq!(
        m.tick(t0 + Duration::from_millis(1000)),
        vec![MembershipEvent::NodeSuspect(NodeId::new("a"))]
    );
    assert_eq!(
        m.tick(t0 + Duration::from_millis(3000)),
        vec![MembershipEvent::NodeDown(NodeId::new("a"))]
    );
    assert!(
        m.tick(t0 + Duration::from_millis(4000)).is_empty(),
        "down is reported once"
    );
    assert_eq!(m.state(&NodeId::new("a")), Some(NodeState::Down));
    m.tick(t0 + Duration::from_millis(13_000));
    assert_eq!(
        m.state(&NodeId::new("a")),
        None,
        "forgotten after retention"
    );
}

#[test]
fn down_node_comes_back_and_restart_is_news() {
    let t0 = Instant::now();
    let mut m = Membership::new(info("me", 1), leases());
    m.on_heartbeat(info("a", 1), t0);
    m.tick(t0 + Duration::from_secs(5));
    let ev = m.on_heartbeat(info("a", 1), t0 + Duration::from_secs(6));
    assert_eq!(ev, vec![MembershipEvent::NodeUp(Box::new(info("a", 1)))]);
    let ev = m.on_heartbeat(info("a", 2), t0 + Duration::from_secs(6));
    assert_eq!(
        ev,
        vec![MembershipEvent::NodeUp(Box::new(info("a", 2)))],
        "new incarnation"
    );
}

/// The newer "a": incarnation 9 at address :2, pid 42.
fn newer_a() -> NodeInfo {
    let mut newer = info("a", 9);
    newer.addr = "127.0.0.1:2".into();
    newer.pid = 42;
    newer
}

/// In `m`'s table, "a" (incarnation 5, at :1) is heard at `t0` and goes down; at `t0` + 6 s
/// [`newer_a`] is heard: returns that heartbeat's events.
fn a_went_down_and_newer_took_its_name(m: &mut Membership, t0: Instant) -> Vec<MembershipEvent> {
    m.on_heartbeat(info("a", 5), t0);
    m.tick(t0 + Duration::from_secs(5));
    m.on_heartbeat(newer_a(), t0 + Duration::from_secs(6))
}

#[test]
fn an_old_incarnation_elsewhere_is_superseded_not_news() {
    let t0 = Instant::now();
    let mut m = Membership::new(info("me", 1), leases());
    let newer = newer_a();
    let ev = a_went_down_and_newer_took_its_name(&mut m, t0);
    assert_eq!(ev, vec![MembershipEvent::NodeUp(Box::new(newer.clone()))]);
    // The old one comes back: reported, and the table keeps the newer one.
    let ev = m.on_heartbeat(info("a", 5), t0 + Duration::from_secs(7));
    assert_eq!(
        ev,
        vec![MembershipEvent::Superseded(Box::new(Superseded {
            node: NodeId::new("a"),
            stale_addr: "127.0.0.1:1".into(),
            stale_incarnation: 5,
            by_addr: "127.0.0.1:2".into(),
            by_incarnation: 9,
            by_pid: 42,
        }))]
    );
    let v = m.view(t0 + Duration::from_secs(7));
    let a = v.iter().find(|n| n.id.as_str() == "a").unwrap();
    assert_eq!((a.addr.as_str(), a.incarnation), ("127.0.0.1:2", 9));
    // An older heartbeat from the same address (in flight across a restart) is not a clash.
    let mut late = newer.clone();
    late.incarnation = 8;
    assert!(
        m.on_heartbeat(late, t0 + Duration::from_secs(7))
            .iter()
            .all(|e| !matches!(e, MembershipEvent::Superseded(_)))
    );
}

#[test]
fn a_stale_node_finds_its_name_taken_in_a_peers_view() {
    let t0 = Instant::now();
    // The seed's table: "a" at :1 went down, a new "a" at :2 holds the name.
    let mut seed = Membership::new(info("seed", 1), leases());
    a_went_down_and_newer_took_its_name(&mut seed, t0);
    let view = seed.view(t0 + Duration::from_secs(6));

    let stale = info("a", 5);
    assert_eq!(
        stale.superseded_in(&view),
        Some(Superseded {
            node: NodeId::new("a"),
            stale_addr: "127.0.0.1:1".into(),
            stale_incarnation: 5,
            by_addr: "127.0.0.1:2".into(),
            by_incarnation: 9,
            by_pid: 42,
        })
    );
    // Not a clash: this incarnation itself, a newer one at this address (a restart), an
    // older one elsewhere, or a newer one that is down.
    assert_eq!(info("a", 9).superseded_in(&view), None);
    let mut restarted = info("a", 5);
    restarted.addr = "127.0.0.1:2".into();
    assert_eq!(restarted.superseded_in(&view), None);
    assert_eq!(info("a", 10).superseded_in(&view), None);
    seed.tick(t0 + Duration::from_secs(10));
    let later = seed.view(t0 + Duration::from_secs(10));
    assert_eq!(
        later.iter().find(|n| n.id.as_str() == "a").map(|n| n.state),
        Some(NodeState::Down)
    );
    assert_eq!(stale.superseded_in(&later), None);
}

#[test]
fn session_loss_makes_suspect_at_once() {
    let t0 = Instant::now();
    let mut m = Membership::new(info("me", 1), leases());
    m.on_heartbeat(info("a", 1), t0);
    assert_eq!(
        m.on_session_lost(&NodeId::new("a")),
        vec![MembershipEvent::NodeSuspect(NodeId::new("a"))]
    );
    assert!(m.on_session_lost(&NodeId::new("a")).is_empty());
    assert!(m.on_session_lost(&NodeId::new("zz")).is_empty());
}

#[test]
fn view_lists_me_first() {
    let t0 = Instant::now();
    let mut m = Membership::new(info("me", 1), leases());
    m.on_heartbeat(info("b", 1), t0);
    m.on_heartbeat(info("a", 1), t0);
    let v = m.view(t0);
    let ids: Vec<_> = v.iter().map(|n| n.id.as_str().to_owned()).collect();
    assert_eq!(ids, ["me", "a", "b"]);
    assert!(
        m.on_heartbeat(info("me", 1), t0).is_empty(),
        "own heartbeat ignored"
    );
}
