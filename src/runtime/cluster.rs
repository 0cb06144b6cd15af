//! The cluster transport for control messages: a `ractor_cluster` NodeServer per node.
//!
//! Nodes authenticate each other with a shared cookie (SHA-256 challenge/response; the cookie
//! is never sent). `ractor_cluster` fails silently on a wrong cookie — the session just never
//! becomes ready — so [`join`] watches the session events and turns that into
//! [`ClusterError::AuthFailed`]. Connections are transitive: joining one seed connects the node
//! to every node the seed knows. Only small control messages travel here (about 250 MB/s,
//! frames up to `cluster.max_frame_bytes`); KV blocks move through the transport actor.

use crate::runtime::ids::NodeId;
use ractor::{Actor, ActorRef};
use ractor_cluster::node::{NodeConnectionMode, NodeServerSessionInformation};
use ractor_cluster::{NodeEventSubscription, NodeServer, NodeServerMessage};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Errors of the cluster layer.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The listen address cannot be bound.
    // The cause is the source, printed after this by `{:#}`: not in the message too.
    #[error("cannot listen for cluster connections on {addr}")]
    Listen {
        /// Address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The NodeServer actor failed to start.
    #[error("cluster node server failed to start: {0}")]
    Start(String),
    /// The peer closed the session during the handshake: almost always a cookie mismatch.
    #[error(
        "cluster handshake with {seed} failed: the peer closed the session before authenticating \
         (does --cookie match the cluster's?)"
    )]
    AuthFailed {
        /// Seed address.
        seed: String,
    },
    /// No seed answered in time.
    #[error("could not join the cluster through {seeds:?} within {timeout_ms} ms: {last_error}")]
    Unreachable {
        /// Seeds tried.
        seeds: Vec<String>,
        /// Time allowed.
        timeout_ms: u64,
        /// Last error seen.
        last_error: String,
    },
    /// The node server actor is gone.
    #[error("cluster node server is not running")]
    ServerGone,
}

/// A running NodeServer.
#[derive(Clone, Debug)]
pub struct ClusterHandle {
    /// The NodeServer actor.
    pub server: ActorRef<NodeServerMessage>,
    /// This node's name.
    pub node_id: NodeId,
    /// Listen address.
    pub addr: SocketAddr,
    /// Chaos `partition`: which peers this node refuses sessions with.
    pub partition: PartitionFilter,
}

/// A filter on the inter-node path (chaos `partition`): while set, every session with a peer
/// on the other side of the cut is stopped as soon as it authenticates (so neither a redial
/// nor a transitive connection gets through), and [`PartitionFilter::cut`] stops the ones
/// that exist. Sides: the nodes listed in `group` against all others.
#[derive(Clone, Debug, Default)]
pub struct PartitionFilter {
    inner: Arc<Mutex<Option<Partition>>>,
}

#[derive(Clone, Debug)]
struct Partition {
    group: HashSet<String>,
    /// Whether this node is in `group`.
    inside: bool,
}

/// The node name of a session's peer (`node-2` from `node-2@127.0.0.1`).
fn peer_node(ses: &NodeServerSessionInformation) -> Option<String> {
    ses.peer_name
        .as_ref()
        .map(|n| n.name.split('@').next().unwrap_or_default().to_owned())
}

/// Stops the cluster session with node `peer`, if one is established: its actors leave
/// every process group on this node at once (requests placed there migrate, routers purge
/// its workers). Discovery calls it for a node past the liveness timeout, because a cut
/// network (a link down, a host gone) sends no FIN or RST: the session would otherwise stay
/// open until TCP gave up, minutes later. A node that comes back dials in again.
pub async fn drop_session(server: &ActorRef<NodeServerMessage>, peer: &str) -> bool {
    let Ok(sessions) = ractor::call_t!(server, NodeServerMessage::GetSessions, 2_000) else {
        return false;
    };
    let mut dropped = false;
    for ses in sessions.values() {
        if peer_node(ses).as_deref() == Some(peer) {
            ses.actor
                .stop(Some(format!("{peer} past the liveness timeout")));
            dropped = true;
        }
    }
    dropped
}

impl PartitionFilter {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Partition>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cut `group` from the rest, as seen from node `me`.
    pub fn set(&self, me: &str, group: &[String]) {
        let group: HashSet<String> = group.iter().cloned().collect();
        let inside = group.contains(me);
        *self.lock() = Some(Partition { group, inside });
    }

    /// Heal.
    pub fn clear(&self) {
        *self.lock() = None;
    }

    /// Whether sessions with `peer` are refused now.
    pub fn blocks(&self, peer: &str) -> bool {
        self.lock()
            .as_ref()
            .is_some_and(|p| p.inside != p.group.contains(peer))
    }

    /// Stop every established session the filter blocks; returns the listen addresses
    /// (`connection_string`) of the peers cut, for redialling when the partition heals.
    pub async fn cut(&self, server: &ActorRef<NodeServerMessage>) -> Vec<(String, String)> {
        let Ok(sessions) = ractor::call_t!(server, NodeServerMessage::GetSessions, 2_000) else {
            return Vec::new();
        };
        let mut cut = Vec::new();
        for ses in sessions.values() {
            if let Some(peer) = peer_node(ses)
                && self.blocks(&peer)
            {
                tracing::warn!(%peer, "chaos: partition cuts the session");
                if let Some(n) = &ses.peer_name {
                    cut.push((peer.clone(), n.connection_string.clone()));
                }
                ses.actor.stop(Some("partitioned (chaos)".into()));
            }
        }
        cut
    }
}

struct FilterSubscription(PartitionFilter);

impl FilterSubscription {
    fn check(&self, ses: &NodeServerSessionInformation) {
        if let Some(peer) = peer_node(ses)
            && self.0.blocks(&peer)
        {
            tracing::warn!(%peer, "chaos: partition refuses a session");
            ses.actor.stop(Some("partitioned (chaos)".into()));
        }
    }
}

impl NodeEventSubscription for FilterSubscription {
    fn node_session_opened(&self, _ses: NodeServerSessionInformation) {}
    fn node_session_disconnected(&self, _ses: NodeServerSessionInformation) {}
    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        self.check(&ses);
    }
    fn node_session_ready(&self, ses: NodeServerSessionInformation) {
        self.check(&ses);
    }
}

/// Start this node's NodeServer on `addr` with the given cookie and frame limit.
///
/// # Errors
/// [`ClusterError::Listen`] when `addr` cannot be bound (e.g. the port is taken);
/// [`ClusterError::Start`] when the NodeServer actor does not start.
pub async fn start_node_server(
    node_id: NodeId,
    addr: SocketAddr,
    cookie: String,
    max_frame_bytes: u64,
) -> Result<ClusterHandle, ClusterError> {
    // ractor_cluster binds inside an actor and only logs a failure: probe the address first
    // so that "address in use" is a clear error.
    std::net::TcpListener::bind(addr).map_err(|source| ClusterError::Listen { addr, source })?;
    let server = NodeServer::new(
        addr.port(),
        cookie,
        node_id.to_string(),
        addr.ip().to_string(),
        None,
        Some(NodeConnectionMode::Transitive),
    )
    .with_listen_addr(addr.ip())
    .with_max_inbound_frame_size(max_frame_bytes);
    let (server, _) = Actor::spawn(None, server, ())
        .await
        .map_err(|e| ClusterError::Start(e.to_string()))?;
    let partition = PartitionFilter::default();
    server
        .cast(NodeServerMessage::SubscribeToEvents {
            id: "chaos-partition".into(),
            subscription: Box::new(FilterSubscription(partition.clone())),
        })
        .map_err(|_| ClusterError::ServerGone)?;
    Ok(ClusterHandle {
        server,
        node_id,
        addr,
        partition,
    })
}

/// Start a throwaway NodeServer named `name` on an OS-chosen port of `ip`, in isolated mode
/// (it connects to the seeds it is given and to no one they know): a way to ask the cluster
/// something before joining it under this node's own name. Stop it with `stop_and_wait`.
///
/// # Errors
/// As [`start_node_server`].
pub async fn start_probe_server(
    name: String,
    ip: std::net::IpAddr,
    cookie: String,
    max_frame_bytes: u64,
) -> Result<ActorRef<NodeServerMessage>, ClusterError> {
    let port = std::net::TcpListener::bind(SocketAddr::new(ip, 0))
        .and_then(|l| l.local_addr())
        .map_err(|source| ClusterError::Listen {
            addr: SocketAddr::new(ip, 0),
            source,
        })?
        .port();
    let server = NodeServer::new(
        port,
        cookie,
        name,
        ip.to_string(),
        None,
        Some(NodeConnectionMode::Isolated),
    )
    .with_listen_addr(ip)
    .with_max_inbound_frame_size(max_frame_bytes);
    let (server, _) = Actor::spawn(None, server, ())
        .await
        .map_err(|e| ClusterError::Start(e.to_string()))?;
    Ok(server)
}

/// Node names of the peers this NodeServer has sessions with.
pub async fn peer_names(server: &ActorRef<NodeServerMessage>) -> Vec<String> {
    let sessions = ractor::call_t!(server, NodeServerMessage::GetSessions, 2_000);
    sessions.map_or_else(
        |_| Vec::new(),
        |s| s.values().filter_map(peer_node).collect(),
    )
}

/// Session lifecycle events forwarded to a channel.
#[derive(Debug, Clone)]
pub enum SessionEvent {
    /// TCP session opened.
    Opened(SessionPeer),
    /// Authenticated.
    Authenticated(SessionPeer),
    /// State exchange done: remote actors and pg groups are visible.
    Ready(SessionPeer),
    /// Closed.
    Disconnected(SessionPeer),
}

/// Who a session is with.
#[derive(Debug, Clone)]
pub struct SessionPeer {
    /// Peer's node name, once known.
    pub name: Option<String>,
    /// Peer's socket address.
    pub addr: String,
    /// Whether the peer dialled us.
    pub incoming: bool,
    /// The address the peer listens on (`host:port`, as it advertises it), once known.
    pub listens_on: Option<String>,
}

impl From<&NodeServerSessionInformation> for SessionPeer {
    fn from(s: &NodeServerSessionInformation) -> Self {
        Self {
            name: s.peer_name.as_ref().map(|n| n.name.clone()),
            addr: s.peer_addr.clone(),
            incoming: s.is_server,
            listens_on: s.peer_name.as_ref().map(|n| n.connection_string.clone()),
        }
    }
}

/// A [`NodeEventSubscription`] that forwards into an unbounded channel.
pub struct ChannelSubscription(pub mpsc::UnboundedSender<SessionEvent>);

impl NodeEventSubscription for ChannelSubscription {
    fn node_session_opened(&self, ses: NodeServerSessionInformation) {
        let _ = self.0.send(SessionEvent::Opened((&ses).into()));
    }
    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        let _ = self.0.send(SessionEvent::Disconnected((&ses).into()));
    }
    fn node_session_authenticated(&self, ses: NodeServerSessionInformation) {
        let _ = self.0.send(SessionEvent::Authenticated((&ses).into()));
    }
    fn node_session_ready(&self, ses: NodeServerSessionInformation) {
        let _ = self.0.send(SessionEvent::Ready((&ses).into()));
    }
}

static SUB_SEQ: AtomicU64 = AtomicU64::new(0);

/// Subscribe to session events; returns the subscription id (for unsubscribing) and the stream.
///
/// # Errors
/// [`ClusterError::ServerGone`] when the NodeServer has stopped.
pub fn subscribe(
    server: &ActorRef<NodeServerMessage>,
    label: &str,
) -> Result<(String, mpsc::UnboundedReceiver<SessionEvent>), ClusterError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let id = format!("{label}-{}", SUB_SEQ.fetch_add(1, Ordering::Relaxed));
    server
        .cast(NodeServerMessage::SubscribeToEvents {
            id: id.clone(),
            subscription: Box::new(ChannelSubscription(tx)),
        })
        .map_err(|_| ClusterError::ServerGone)?;
    Ok((id, rx))
}

/// Connect to `seed` and wait until a session with it is ready (authenticated and state
/// exchanged).
///
/// The ready session need not be the one this call opened: when the seed dials this node at
/// the same moment (it learned of us from a third node: transitive mode), ractor_cluster keeps
/// one of the two connections by name order and closes the other, before or just after it
/// authenticates. So the close of this call's session is an error only when no other session
/// with the seed is open either: [`ClusterError::AuthFailed`] when it closed before
/// authenticating.
///
/// # Errors
/// [`ClusterError::AuthFailed`] when the seed refuses this node's cookie;
/// [`ClusterError::Unreachable`] when no session is ready within `timeout`.
pub async fn join(
    server: &ActorRef<NodeServerMessage>,
    seed: &str,
    timeout: Duration,
) -> Result<(), ClusterError> {
    let seed_addr: Vec<SocketAddr> = tokio::net::lookup_host(seed)
        .await
        .map(|a| a.collect())
        .unwrap_or_default();
    let is_seed = |addr: &str| {
        addr.parse::<SocketAddr>()
            .map(|a| seed_addr.contains(&a))
            .unwrap_or(addr == seed)
    };
    let (sub, mut rx) = subscribe(server, "join")?;
    let unreachable = |last_error: &str| ClusterError::Unreachable {
        seeds: vec![seed.to_owned()],
        timeout_ms: timeout.as_millis() as u64,
        last_error: last_error.to_owned(),
    };
    let result = async {
        ractor_cluster::client_connect(server, seed)
            .await
            .map_err(|e| unreachable(&e.to_string()))?;
        // The session this call opened.
        let ours = |p: &SessionPeer| !p.incoming && is_seed(&p.addr);
        // Any session with the seed, in either direction.
        let with_seed = |p: &SessionPeer| ours(p) || p.listens_on.as_deref().is_some_and(is_seed);
        let mut authenticated = false;
        let wait = async {
            while let Some(ev) = rx.recv().await {
                match ev {
                    SessionEvent::Authenticated(p) if ours(&p) => authenticated = true,
                    SessionEvent::Ready(p) if with_seed(&p) => return Ok(()),
                    SessionEvent::Disconnected(p) if ours(&p) => {
                        if !open_session_listening_on(server, &is_seed).await {
                            return Err(if authenticated {
                                unreachable("session closed after authentication")
                            } else {
                                ClusterError::AuthFailed {
                                    seed: seed.to_owned(),
                                }
                            });
                        }
                        // The seed kept its own connection to us: wait for that one (or
                        // find it already ready when no event comes).
                        let ready = async {
                            while let Some(ev) = rx.recv().await {
                                if matches!(&ev, SessionEvent::Ready(p) if with_seed(p)) {
                                    return;
                                }
                            }
                        };
                        let _ = tokio::time::timeout(SIMULTANEOUS_GRACE, ready).await;
                        return if open_session_listening_on(server, &is_seed).await {
                            Ok(())
                        } else {
                            Err(unreachable("both connections with the seed closed"))
                        };
                    }
                    _ => {}
                }
            }
            Err(ClusterError::ServerGone)
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(r) => r,
            Err(_) => Err(unreachable("handshake timed out")),
        }
    }
    .await;
    let _ = server.cast(NodeServerMessage::UnsubscribeToEvents(sub));
    result
}

/// How long [`join`] waits for the seed's own connection to become ready after the seed
/// closed ours in a simultaneous connect (a handshake takes a few milliseconds on one host).
const SIMULTANEOUS_GRACE: Duration = Duration::from_secs(1);

/// Whether a session with a peer that listens on an address `is_seed` accepts is open.
async fn open_session_listening_on(
    server: &ActorRef<NodeServerMessage>,
    is_seed: &impl Fn(&str) -> bool,
) -> bool {
    ractor::call_t!(server, NodeServerMessage::GetSessions, 2_000).is_ok_and(|sessions| {
        sessions.values().any(|s| {
            s.peer_name
                .as_ref()
                .is_some_and(|n| is_seed(&n.connection_string))
        })
    })
}

/// How many handshakes in a row a seed must close before authenticating for [`join_any`] to
/// call it a refused cookie. A wrong cookie closes every one; a right one is closed now and
/// then too: the seed's session asks its NodeServer whether the handshake may go on and
/// gives up after 500 ms (ractor_cluster 0.16, `NodeSession::handle_auth`), which a loaded
/// host misses (seen in CI: a node of `flotilla up` exited with "does --cookie match" while
/// the suite ran beside it).
const AUTH_ATTEMPTS: u32 = 3;

/// Join through any of `seeds`, retrying refused connections (a seed may still be starting)
/// until `timeout`. A seed that closes `AUTH_ATTEMPTS` (3) handshakes in a row before they
/// authenticate refuses the cookie: that is final.
///
/// # Errors
/// [`ClusterError::AuthFailed`] on a refused cookie;
/// [`ClusterError::Unreachable`] when no seed answers within `timeout`.
pub async fn join_any(
    server: &ActorRef<NodeServerMessage>,
    seeds: &[String],
    timeout: Duration,
) -> Result<(), ClusterError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = String::from("no seed given");
    let mut backoff = Duration::from_millis(50);
    let mut closed_before_auth = 0;
    loop {
        for seed in seeds {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match join(server, seed, left.min(Duration::from_secs(5))).await {
                Ok(()) => return Ok(()),
                Err(e @ ClusterError::AuthFailed { .. }) => {
                    closed_before_auth += 1;
                    if closed_before_auth >= AUTH_ATTEMPTS {
                        return Err(e);
                    }
                    tracing::info!(%seed, attempt = closed_before_auth, "the seed closed the handshake before authenticating; trying again");
                    last_error = e.to_string();
                }
                // The cause, not a second "could not join" around it; a seed that did not
                // answer breaks a run of refusals.
                Err(ClusterError::Unreachable { last_error: e, .. }) => {
                    closed_before_auth = 0;
                    last_error = e;
                }
                Err(e) => {
                    closed_before_auth = 0;
                    last_error = e.to_string();
                }
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ClusterError::Unreachable {
                seeds: seeds.to_vec(),
                timeout_ms: timeout.as_millis() as u64,
                last_error,
            });
        }
        // After a refusal, at least the seed's session-check time before the next try.
        if closed_before_auth > 0 {
            backoff = backoff.max(Duration::from_millis(500));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// The member of process group `group` registered as `name`, on this node or a peer (a
/// peer's actor appears here as its proxy, bearing the same name). Names are node-prefixed,
/// so at most one actor of the cluster bears a given name.
pub fn member_named(group: &str, name: &str) -> Option<ractor::ActorCell> {
    ractor::pg::get_members(&group.to_owned())
        .into_iter()
        .find(|c| c.get_name().as_deref() == Some(name))
}

/// Whether a session with the peer named `name` is established now (a dropped session may be
/// an old one, its peer already back on a new one: a node restarted under the same name).
pub async fn has_session_with(server: &ActorRef<NodeServerMessage>, name: &str) -> bool {
    ractor::call_t!(server, NodeServerMessage::GetSessions, 2_000).is_ok_and(|sessions| {
        sessions
            .values()
            .any(|s| s.peer_name.as_ref().is_some_and(|n| n.name == name))
    })
}

/// Number of established sessions.
///
/// # Errors
/// [`ClusterError::ServerGone`] when the NodeServer does not answer within 2 s.
pub async fn session_count(server: &ActorRef<NodeServerMessage>) -> Result<usize, ClusterError> {
    ractor::call_t!(server, NodeServerMessage::GetSessions, 2_000)
        .map(|m| m.len())
        .map_err(|_| ClusterError::ServerGone)
}
