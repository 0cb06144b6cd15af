//! Refusing a second live node under a name the cluster already has.
//!
//! ractor_cluster takes a new session under a name it already has a session with for that
//! peer reconnecting, and drops the old session. With two live processes under one name,
//! the second one's join would cut the first off the cluster (its actors leave every process
//! group, so its requests migrate and routers forget its workers), and the two would then
//! take turns. So before joining under its own name, a node asks a seed for its fleet view,
//! through a throwaway NodeServer (`<name>.name-check.<pid>`, isolated: it talks to the seed
//! only, and holds no actor). A node of the same name that the seed sees up or suspect, at
//! another cluster address, and that still accepts TCP connections there, is a live namesake:
//! the node refuses to start ([`NodeError::NameTaken`](super::NodeError::NameTaken), exit
//! code 2). A node restarted under its name on the same address (as `flotilla up` restarts
//! them), or whose previous process is gone, passes.
//!
//! A namesake that appears later (a node paused or cut off past the liveness timeout is down
//! to the others, so a new node may take its name) is caught when the old one comes back:
//! either its heartbeat's older incarnation makes a peer tell it to exit
//! ([`MembershipEvent::Superseded`](crate::control::discovery::membership::MembershipEvent::Superseded)),
//! or, when the seeds keep the new one's session and refuse its own, a gateway's fleet view
//! shows it the newer holder of its name (`actors::discovery`'s re-dial).
//! Two nodes started under one name at the same moment: one joins, the other's handshake is
//! closed and it reports the cookie error.

use std::net::SocketAddr;
use std::time::Duration;

use crate::actors::discovery::DiscoveryMsg;
use crate::control::discovery::membership::{NodeState, NodeView};
use crate::node::config::Config;
use crate::runtime::cluster::{self, ClusterError};
use crate::runtime::ids::NodeId;

/// How long a live namesake's cluster address gets to accept a TCP connection.
const CONNECT_PROBE: Duration = Duration::from_millis(500);

/// How long the seed's Discovery gets to appear once the probe session is ready (its process
/// groups arrive right after the handshake).
const DISCOVERY_WAIT: Duration = Duration::from_secs(2);

/// The live node already named `node_id` in the cluster behind `config.node.join`, if any.
///
/// # Errors
/// The join errors of [`cluster::join_any`] (a wrong cookie, no seed reachable): the real join
/// would meet them too, so they are reported here rather than after a second wait.
pub async fn live_namesake(
    config: &Config,
    node_id: &NodeId,
) -> Result<Option<NodeView>, ClusterError> {
    let me = config.node.listen_addr;
    let probe_name = format!("{node_id}.name-check.{}", std::process::id());
    let server = cluster::start_probe_server(
        probe_name,
        me.ip(),
        config.node.cookie.clone(),
        config.cluster.max_frame_bytes,
    )
    .await?;
    let timeout = Duration::from_millis(config.cluster.connect_timeout_ms);
    let mut peers = Vec::new();
    let result = async {
        cluster::join_any(&server, &config.node.join, timeout).await?;
        peers = cluster::peer_names(&server).await;
        Ok(ask(&server, node_id, me).await)
    }
    .await;
    let _ = server
        .stop_and_wait(Some("name check done".into()), Some(Duration::from_secs(2)))
        .await;
    proxies_gone(&peers).await;
    result
}

/// Waits (up to [`DISCOVERY_WAIT`]) until the proxies the probe session registered for the
/// seeds' actors are gone: the real session registers proxies under the same names, which a
/// lingering one would refuse. A name held by a local actor (a node of this process) is not
/// the probe's.
async fn proxies_gone(peers: &[String]) {
    let deadline = tokio::time::Instant::now() + DISCOVERY_WAIT;
    let lingering = || {
        peers.iter().any(|peer| {
            ractor::registry::where_is(format!("{peer}/discovery"))
                .is_some_and(|cell| !cell.get_id().is_local())
        })
    };
    while lingering() {
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(?peers, "name check: the probe session's proxies linger");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Asks the seed's Discovery for its fleet view and looks for a live namesake.
async fn ask(
    server: &ractor::ActorRef<ractor_cluster::NodeServerMessage>,
    node_id: &NodeId,
    me: SocketAddr,
) -> Option<NodeView> {
    let deadline = tokio::time::Instant::now() + DISCOVERY_WAIT;
    let discovery = loop {
        let seeds = cluster::peer_names(server).await;
        let found = seeds.iter().find_map(|peer| {
            cluster::member_named(
                crate::control::discovery::DISCOVERY_GROUP,
                &format!("{peer}/discovery"),
            )
        });
        if let Some(d) = found {
            break d;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!("name check: the seed's discovery did not appear; not checked");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let discovery = ractor::ActorRef::<DiscoveryMsg>::from(discovery);
    let fleet = ractor::call_t!(discovery, DiscoveryMsg::GetFleet, 2_000).ok()?;
    let fleet = fleet.decode().ok()?;
    let namesake = fleet
        .into_iter()
        .find(|n| n.id == *node_id && n.state != NodeState::Down && !same_addr(&n.addr, me))?;
    let addr = namesake.addr.clone();
    let alive = tokio::time::timeout(CONNECT_PROBE, tokio::net::TcpStream::connect(&addr))
        .await
        .is_ok_and(|c| c.is_ok());
    alive.then_some(namesake)
}

/// Whether a cluster address names `me` (an unparsable one does not).
fn same_addr(addr: &str, me: SocketAddr) -> bool {
    addr.parse::<SocketAddr>().is_ok_and(|a| a == me)
}
