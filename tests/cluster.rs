//! Cluster formation in one process: two nodes on loopback form a cluster, see each other's
//! role groups and heartbeats; a wrong cookie is a clear error, so is a name a live node has.

#[path = "common/poll.rs"]
mod poll;

use crate::poll::{free_port, poll_until};
use flotilla::actors::discovery::{self, DiscoveryMsg};
use flotilla::control::discovery::membership::NodeState;
use flotilla::control::discovery::role_group;
use flotilla::node::config::{Config, NodeRole};
use flotilla::node::{self, NodeError};
use flotilla::runtime::cluster::ClusterError;
use std::time::Duration;

fn config(name: &str, port: u16, roles: &[NodeRole], join: Option<u16>, cookie: &str) -> Config {
    let mut c = Config::default();
    c.node.name = Some(name.into());
    c.node.listen_addr = format!("127.0.0.1:{port}").parse().unwrap();
    c.node.roles = roles.to_vec();
    c.node.cookie = cookie.into();
    c.node.join = join
        .map(|p| vec![format!("127.0.0.1:{p}")])
        .unwrap_or_default();
    c.gateway.http_addr = "127.0.0.1:0".parse().unwrap();
    c.cluster.connect_timeout_ms = 5_000;
    c.validate().unwrap();
    c
}

fn discovery_of(prefix: &str) -> ractor::ActorRef<DiscoveryMsg> {
    discovery::local(&format!("{prefix}discovery")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_form_a_cluster_and_see_each_others_roles() {
    crate::poll::init_tracing();
    let (pa, pb) = (free_port(), free_port());
    let a = node::start(config(
        "alpha",
        pa,
        &[NodeRole::Gateway, NodeRole::Router],
        None,
        "c00kie",
    ))
    .await
    .unwrap();
    let b = node::start(config("beta", pb, &[NodeRole::Worker], Some(pa), "c00kie"))
        .await
        .unwrap();

    // NodeRole groups of each node are visible from the other, as remote members.
    poll_until(
        Duration::from_secs(10),
        "remote worker and gateway pg members",
        || async {
            let remote = |g: String| {
                ractor::pg::get_members(&g)
                    .iter()
                    .any(|c| !c.get_id().is_local())
            };
            (remote(role_group(NodeRole::Worker)) && remote(role_group(NodeRole::Gateway)))
                .then_some(())
        },
    )
    .await;

    // Heartbeats make each node list the other as up, with its roles and workers. (A
    // heartbeat sent while beta's tree was still starting lists no replica yet: the view is
    // eventually complete, so wait for one that lists the worker pool.)
    let fa = poll_until(Duration::from_secs(10), "alpha sees beta up", || async {
        let f = discovery::fleet(&discovery_of("alpha/")).await.ok()?;
        f.iter()
            .any(|n| {
                n.id.as_str() == "beta"
                    && n.state == NodeState::Up
                    && n.actors.iter().any(|x| x.path == "node/worker_pool")
                    && !n.workers.is_empty()
            })
            .then_some(f)
    })
    .await;
    let beta = fa.iter().find(|n| n.id.as_str() == "beta").unwrap();
    assert_eq!(beta.roles, vec![NodeRole::Worker]);
    assert_eq!(
        beta.workers.len(),
        1,
        "one (empty) replica by default: {beta:?}"
    );
    assert_eq!(beta.workers[0].id, "beta/replica-0");
    assert!(
        beta.actors.iter().any(|x| x.path == "node/worker_pool"),
        "{:?}",
        beta.actors
    );
    poll_until(Duration::from_secs(10), "beta sees alpha up", || async {
        let f = discovery::fleet(&discovery_of("beta/")).await.ok()?;
        f.iter()
            .any(|n| n.id.as_str() == "alpha" && n.state == NodeState::Up && n.http_addr.is_some())
            .then_some(())
    })
    .await;

    b.stop().await;
    // Stopping beta is noticed: the session drop makes it suspect, then the lease makes it down.
    poll_until(Duration::from_secs(10), "alpha sees beta down", || async {
        let f = discovery::fleet(&discovery_of("alpha/")).await.ok()?;
        f.iter()
            .any(|n| n.id.as_str() == "beta" && n.state == NodeState::Down)
            .then_some(())
    })
    .await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_cookie_is_a_clear_error() {
    crate::poll::init_tracing();
    let (pa, pc) = (free_port(), free_port());
    let a = node::start(config("gamma", pa, &[NodeRole::Gateway], None, "right"))
        .await
        .unwrap();
    let err = match node::start(config("delta", pc, &[NodeRole::Worker], Some(pa), "wrong")).await {
        Ok(_) => panic!("joined with a wrong cookie"),
        Err(e) => e,
    };
    assert!(
        matches!(err, NodeError::Cluster(ClusterError::AuthFailed { .. })),
        "unexpected error: {err}"
    );
    assert!(err.to_string().contains("cookie"), "{err}");
    // The failed node cleaned up after itself: its names are free again.
    assert!(discovery::local("delta/discovery").is_none());
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_node_under_a_taken_name_is_refused() {
    crate::poll::init_tracing();
    let (pa, pb, pc) = (free_port(), free_port(), free_port());
    let a = node::start(config("theta", pa, &[NodeRole::Router], None, "k"))
        .await
        .unwrap();
    let b = node::start(config("iota", pb, &[NodeRole::Router], Some(pa), "k"))
        .await
        .unwrap();
    let seen = |state: NodeState| async move {
        let fleet = ractor::call_t!(discovery_of("theta/"), DiscoveryMsg::GetFleet, 2_000)
            .unwrap()
            .decode()
            .unwrap();
        fleet
            .iter()
            .any(|n| n.id.as_str() == "iota" && n.state == state)
    };
    poll_until(Duration::from_secs(10), "theta sees iota up", || async {
        seen(NodeState::Up).await.then_some(())
    })
    .await;
    // A second "iota" on another address: refused before it touches the cluster.
    let err = match node::start(config("iota", pc, &[NodeRole::Router], Some(pa), "k")).await {
        Ok(_) => panic!("a second live node named iota joined"),
        Err(e) => e,
    };
    assert!(matches!(err, NodeError::NameTaken { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("\"iota\" is taken") && msg.contains(&format!("127.0.0.1:{pb}")),
        "{msg}"
    );
    // The first iota kept its session: still up, seen from theta, its discovery in place.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(seen(NodeState::Up).await, "iota stays up");
    assert!(discovery::local("iota/discovery").is_some());
    // iota restarted on its own address: not a namesake, it joins.
    b.stop().await;
    let b = node::start(config("iota", pb, &[NodeRole::Router], Some(pa), "k"))
        .await
        .unwrap();
    b.stop().await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_seed_is_a_clear_error() {
    let (dead, pc) = (free_port(), free_port());
    let mut cfg = config("eps", pc, &[NodeRole::Worker], Some(dead), "x");
    cfg.cluster.connect_timeout_ms = 500;
    let err = match node::start(cfg).await {
        Ok(_) => panic!("joined a seed that does not exist"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("could not join"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_heartbeat_is_counted_not_fatal() {
    flotilla::runtime::metrics::handle();
    let p = free_port();
    let a = node::start(config("zeta", p, &[NodeRole::Worker], None, "k"))
        .await
        .unwrap();
    let d = discovery_of("zeta/");
    d.cast(DiscoveryMsg::Heartbeat(
        flotilla::runtime::wire::Wire::from_raw(vec![0xc1, 0xff, 0x00]),
    ))
    .unwrap();
    // Still answers.
    let f = discovery::fleet(&d).await.unwrap();
    assert_eq!(f.len(), 1);
    let rendered = flotilla::runtime::metrics::handle().render();
    assert!(
        rendered.contains("flotilla_wire_decode_errors_total"),
        "{rendered}"
    );
    a.stop().await;
}

/// Two nodes that dial each other at the same moment (as a node does when a third one tells it
/// of a newcomer that is joining it) both join: ractor_cluster keeps one connection and closes
/// the other before it authenticates, and that close is not a refused cookie. Seen in CI: a
/// node of `flotilla up` exited with "does --cookie match" on a simultaneous connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_dialling_each_other_at_once_both_join() {
    use flotilla::runtime::cluster::{join, session_count, start_node_server};
    use flotilla::runtime::ids::NodeId;
    crate::poll::init_tracing();
    for round in 0..20 {
        let (pa, pb) = (free_port(), free_port());
        let addr = |p: u16| format!("127.0.0.1:{p}");
        let a = start_node_server(
            NodeId::new(format!("sim-a{round}")),
            addr(pa).parse().unwrap(),
            "c".into(),
            1 << 20,
        )
        .await
        .unwrap();
        let b = start_node_server(
            NodeId::new(format!("sim-b{round}")),
            addr(pb).parse().unwrap(),
            "c".into(),
            1 << 20,
        )
        .await
        .unwrap();
        let t = Duration::from_secs(5);
        let (to_a, to_b) = (addr(pa), addr(pb));
        let (ab, ba) = tokio::join!(join(&a.server, &to_b, t), join(&b.server, &to_a, t));
        assert!(ab.is_ok(), "round {round}: a joining b: {ab:?}");
        assert!(ba.is_ok(), "round {round}: b joining a: {ba:?}");
        assert_eq!(session_count(&a.server).await.unwrap(), 1, "round {round}");
        a.server.stop(None);
        b.server.stop(None);
    }
}
