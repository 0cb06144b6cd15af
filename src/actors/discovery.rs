//! Discovery: cluster membership, process groups per role, heartbeats and liveness.
//!
//! Every node runs one. It joins the process groups `flotilla.discovery` and
//! `flotilla.role.<role>` for each of its roles (visible from every node of the cluster),
//! sends a heartbeat carrying its [`NodeInfo`] to every peer's Discovery each
//! `cluster.heartbeat_interval_ms`, and keeps the [`Membership`] table whose leases decide
//! `up` → `suspect` → `down` (`cluster.liveness_timeout_ms`). Changes are published on the
//! node's [`MembershipEvent`] broadcast channel. Every [`REJOIN_INTERVAL`] it re-dials the
//! seeds it has no session with (one re-dial per seed at a time). A re-dial refused before it
//! authenticates, after this node was away, may mean another node holds its name: it then
//! asks the gateways it has known for their fleet view over HTTP and exits if one shows a
//! newer incarnation of its name elsewhere ([`check_name_taken`]). Incarnations are process
//! start times, compared across hosts: that assumes clocks in step to well under a restart.
//!
//! # The published fleet view
//! Discovery also publishes the fleet view, this node first, into the node's [`FleetView`]
//! whenever it changes: on its own heartbeat tick (after refreshing its workers' stats), on
//! every heartbeat received, on a session loss and whenever it is asked for the view
//! ([`DiscoveryMsg::GetFleet`]). Hot paths (the gateway's admission control) read that
//! snapshot without a message to this actor; `/v1/fleet` still asks the actor, for the
//! freshest view. While Discovery is stopped the snapshot is withdrawn.
//!
//! Pure logic lives in `control/discovery.rs` and `control/discovery/membership.rs`.

use crate::control::discovery::{
    DISCOVERY_GROUP, FleetView, REJOIN_INTERVAL, WorkerEndpoints, membership, role_group,
};
use crate::request_plane::events::FleetEventKind;
use crate::runtime::clock::SharedClock;
use crate::runtime::cluster::SessionEvent;
use crate::runtime::ids::NodeId;
use crate::runtime::role::NodeRole;
use crate::runtime::wire::Wire;
use membership::{
    ActorView, Leases, Membership, MembershipEvent, NodeInfo, NodeState, NodeView, Superseded,
    WorkerView,
};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::{NodeServerMessage, RactorClusterMessage};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;

/// Messages of the Discovery actor. Serializable: peers cast heartbeats to it and may ask for
/// its view.
#[derive(RactorClusterMessage)]
pub enum DiscoveryMsg {
    /// A peer's self-description (cast; a malformed payload is counted and dropped).
    Heartbeat(Wire<NodeInfo>),
    /// Local timer: heartbeat, advance leases, re-dial seeds. Droppable.
    Tick(u64),
    /// Local: the cluster session to the named peer closed.
    SessionLost(String),
    /// The fleet as this node sees it, this node first.
    #[rpc]
    GetFleet(RpcReplyPort<Wire<Vec<NodeView>>>),
    /// A planner node asks for this node's vote for leadership, or renews it
    /// (`control/leadership.rs`).
    #[rpc]
    Vote(
        Wire<crate::control::leadership::VoteRequest>,
        RpcReplyPort<Wire<crate::control::leadership::VoteReply>>,
    ),
    /// A peer tells this node that it is a stale incarnation of its name (paused or cut off
    /// past the liveness timeout, and another node has taken the name since): the node exits
    /// ([`crate::node::NodeExit::Superseded`]). Ignored unless it names this incarnation.
    Superseded(Wire<Superseded>),
    /// A fleet event worth showing beyond its node (a fault installed or cleared, a role
    /// change): from this node's own bus, relayed to every gateway node's Discovery; from a
    /// peer, emitted on this node's bus as it was (its `node` names where it happened), so a
    /// gateway's `/v1/fleet/events` and live page show the whole fleet's.
    FleetEvent(Wire<crate::request_plane::events::FleetEvent>),
}

/// What Discovery needs to start.
#[derive(Clone)]
pub struct DiscoveryArgs {
    /// This node's name.
    pub node_id: NodeId,
    /// Cluster listen address.
    pub addr: String,
    /// Roles of this node.
    pub roles: Vec<NodeRole>,
    /// Process start time, ms since the epoch.
    pub incarnation: u64,
    /// HTTP address once the gateway has bound it.
    pub http_addr: Arc<Mutex<Option<String>>>,
    /// Liveness leases.
    pub leases: Leases,
    /// Heartbeat interval.
    pub heartbeat_interval: Duration,
    /// Seeds to re-dial while this node has no session with them.
    pub seeds: Vec<String>,
    /// The node server.
    pub server: ActorRef<NodeServerMessage>,
    /// Where membership changes are published.
    pub events: tokio::sync::broadcast::Sender<MembershipEvent>,
    /// Injected clock.
    pub clock: SharedClock,
    /// Name of the worker-pool supervisor whose children are this node's workers.
    pub worker_pool_name: String,
    /// Registered name of the supervisor of this node's external engines
    /// (`router.external_workers`): its children are workers too.
    pub external_pool_name: String,
    /// This node's resilience counters (sent in every heartbeat).
    pub stats: Arc<crate::runtime::resilience::NodeStats>,
    /// Where the fleet view is published.
    pub fleet: FleetView,
    /// This node's KV transport, when it has one: its regions go into every heartbeat, and
    /// peers' regions teach it their newest epochs.
    pub transport: Option<Arc<crate::transport::Transport>>,
    /// This node's replicas' own endpoints (HTTP face, vLLM-format KV events), for the
    /// workers' entries in every heartbeat.
    pub endpoints: WorkerEndpoints,
    /// The stats this node's schedulers publish: each worker's load in every heartbeat.
    pub worker_stats: crate::worker::scheduler::StatsBoard,
    /// What this node's planner publishes (its mode and latest decisions), if it runs one.
    pub planner: crate::control::planner::PlannerBoard,
    /// The node's fleet event bus (membership changes; faults and role changes relayed to
    /// and from gateway nodes).
    pub bus: crate::request_plane::events::EventBus,
    /// The planner leadership lease this node votes on (`control/leadership.rs`).
    pub lease: crate::control::leadership::LeaseConfig,
}

/// The Discovery actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct Discovery;

/// Discovery's state.
pub struct DiscoveryState {
    args: DiscoveryArgs,
    membership: Membership,
    ticker: Option<JoinHandle<()>>,
    session_sub: Option<(String, JoinHandle<()>)>,
    /// Reads this node's bus for the events to relay ([`DiscoveryMsg::FleetEvent`]).
    relay: Option<JoinHandle<()>>,
    tick_no: u64,
    last_rejoin: Option<crate::runtime::clock::Instant>,
    /// Every gateway this node has known (node → the address to ask), kept past the
    /// membership table's retention: a node back from a long pause asks them who holds its
    /// name ([`check_name_taken`]).
    gateways: std::collections::BTreeMap<NodeId, String>,
    /// Seeds being re-dialled now: a re-dial waits up to [`REDIAL_WAIT`], longer than the
    /// re-dial interval, and one at a time per seed.
    redialing: Arc<Mutex<std::collections::HashSet<String>>>,
    /// This node's vote on the planner lease. It starts refusing every grant for one lease
    /// (a vote granted before a restart has run out by then), since it is not kept on disk.
    voter: crate::control::leadership::Voter,
}

impl DiscoveryState {
    fn refresh_me(&mut self, me: &ActorCell) {
        let http = self
            .args
            .http_addr
            .lock()
            .map(|g| g.clone())
            .unwrap_or_else(|p| p.into_inner().clone());
        let pools = [
            self.args.worker_pool_name.as_str(),
            self.args.external_pool_name.as_str(),
        ];
        let (actors, mut workers) = describe_tree(me, &pools);
        fill_worker_stats(&mut workers, &self.args.worker_stats);
        self.args.endpoints.fill(&mut workers);
        let info = NodeInfo {
            id: self.args.node_id.clone(),
            addr: self.args.addr.clone(),
            http_addr: http,
            roles: self.args.roles.clone(),
            incarnation: self.args.incarnation,
            pid: std::process::id(),
            actors,
            workers,
            counters: self.args.stats.counters(),
            signals: self
                .args
                .roles
                .contains(&NodeRole::Gateway)
                .then(|| self.args.stats.signals().snapshot()),
            planner: self.args.planner.latest(),
            regions: self
                .args
                .transport
                .as_ref()
                .map(|t| t.descriptors())
                .unwrap_or_default(),
        };
        self.membership.set_me(info);
    }

    /// Publish the fleet view as of `now`.
    fn publish_view(&self, now: crate::runtime::clock::Instant) {
        self.args.fleet.publish(self.membership.view(now));
    }

    /// Publish membership changes; each log line names the node that saw it (`seen_by`), so
    /// the interleaved logs of a local cluster say who saw what.
    fn publish(&self, events: Vec<MembershipEvent>) {
        let me = &self.args.node_id;
        for ev in events {
            let kind = match &ev {
                MembershipEvent::NodeUp(i) => {
                    tracing::info!(seen_by = %me, node = %i.id, roles = ?i.roles, incarnation = i.incarnation, "node up");
                    self.args
                        .bus
                        .emit(FleetEventKind::NodeUp { node: i.id.clone() });
                    "up"
                }
                MembershipEvent::NodeSuspect(n) => {
                    tracing::warn!(seen_by = %me, node = %n, "node suspect");
                    self.args
                        .bus
                        .emit(FleetEventKind::NodeSuspect { node: n.clone() });
                    "suspect"
                }
                MembershipEvent::NodeDown(n) => {
                    tracing::warn!(seen_by = %me, node = %n, "node down");
                    self.args
                        .bus
                        .emit(FleetEventKind::NodeDown { node: n.clone() });
                    "down"
                }
                MembershipEvent::Superseded(s) if s.node == *me => {
                    tracing::error!(node = %s.node, by_addr = %s.by_addr, by_pid = s.by_pid, "this node was away past the liveness timeout (paused or cut off) and another node has taken its name since; this incarnation exits");
                    "superseded"
                }
                MembershipEvent::Superseded(s) => {
                    tracing::warn!(seen_by = %me, node = %s.node, stale_addr = %s.stale_addr, by_addr = %s.by_addr, "an old incarnation of a node came back under a name another node has taken; told it to exit");
                    "superseded"
                }
            };
            metrics::counter!("flotilla_membership_events_total", "kind" => kind).increment(1);
            // No subscriber yet is fine: the fleet view is always available on request.
            let _ = self.args.events.send(ev);
        }
    }
}

/// Tells the stale incarnation of `s.node` (the peer whose heartbeat just arrived under that
/// name: ractor_cluster holds one session per name, the latest) that it must exit.
fn tell_superseded(s: &Superseded) {
    let name = format!("{}/discovery", s.node);
    if let Some(cell) = crate::runtime::cluster::member_named(DISCOVERY_GROUP, &name)
        && !cell.get_id().is_local()
    {
        let peer: ActorRef<DiscoveryMsg> = cell.into();
        if let Err(e) = peer.cast(DiscoveryMsg::Superseded(Wire::encode(s))) {
            tracing::debug!(error = %e, "could not tell a stale node to exit");
        }
    }
}

/// How long a re-dial waits for its session to become ready (or be refused).
const REDIAL_WAIT: Duration = Duration::from_secs(5);

/// How long a gateway gets to answer `GET /v1/fleet` for [`check_name_taken`].
const FLEET_ASK: Duration = Duration::from_secs(2);

/// The address to ask `v`'s gateway at (`host:port` of its HTTP listener), if it has one;
/// a wildcard listener (`0.0.0.0:8080`, as a Kubernetes pod binds) is asked at the node's
/// cluster address's host.
fn gateway_address(v: &NodeView) -> Option<String> {
    let http = v.http_addr.as_deref()?;
    match http.parse::<std::net::SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => {
            let host = v.addr.parse::<std::net::SocketAddr>().ok()?.ip();
            Some(std::net::SocketAddr::new(host, a.port()).to_string())
        }
        _ => Some(http.to_owned()),
    }
}

/// A seed refused this node's session before it authenticated: after this node was away past
/// the liveness timeout, that is what happens when another node has taken its name (the seed
/// keeps the session it has under the name; which of two sessions under one name ractor_cluster
/// keeps is decided by a random number per connection, so the refusals can go on for good).
/// No heartbeat of this node reaches the seed then, so no peer can tell it
/// ([`tell_superseded`]): it asks the gateways it knew (`GET /v1/fleet`, plain HTTP, no
/// session needed) and tells itself when one of them shows a newer incarnation of its name
/// at another address. The answer counts only from the gateway this node knew at that address
/// (its view lists itself first): an address reused by something else says nothing.
async fn check_name_taken(
    stale: &NodeInfo,
    gateways: &[(NodeId, String)],
    me: &ActorRef<DiscoveryMsg>,
) {
    #[derive(serde::Deserialize)]
    struct Fleet {
        nodes: Vec<NodeView>,
    }
    let Ok(http) = reqwest::Client::builder()
        .timeout(FLEET_ASK)
        .no_proxy()
        .build()
    else {
        return;
    };
    for (id, g) in gateways {
        let fleet = match http.get(format!("http://{g}/v1/fleet")).send().await {
            Ok(r) => r.json::<Fleet>().await,
            Err(e) => Err(e),
        };
        match fleet {
            Ok(f) if f.nodes.first().is_none_or(|n| n.id != *id) => {
                tracing::debug!(gateway = %g, expected = %id, "another node answers at a gateway's address");
            }
            Ok(f) => {
                if let Some(s) = stale.superseded_in(&f.nodes) {
                    if let Err(e) = me.cast(DiscoveryMsg::Superseded(Wire::encode(&s))) {
                        tracing::debug!(error = %e, "discovery gone before it learned it was superseded");
                    }
                    return;
                }
                tracing::debug!(gateway = %g, "no newer holder of this node's name in the gateway's fleet view");
            }
            Err(e) => {
                tracing::debug!(gateway = %g, error = %e, "could not read a gateway's fleet view")
            }
        }
    }
}

/// Fill each local worker's load from what its scheduler last published (no call: a busy
/// scheduler in a long step keeps its last figures, never zeros that would tell admission and
/// the router a busy worker is idle). A worker whose scheduler is not running (restarting)
/// keeps zeros.
fn fill_worker_stats(workers: &mut [WorkerView], board: &crate::worker::scheduler::StatsBoard) {
    use crate::worker::scheduler::SCHEDULER_GROUP;
    let locals = ractor::pg::get_local_members(&SCHEDULER_GROUP.to_owned());
    for w in workers.iter_mut() {
        let name = format!("{}/scheduler", w.id);
        if !locals
            .iter()
            .any(|c| c.get_name().as_deref() == Some(name.as_str()))
        {
            continue;
        }
        let Some(st) = board.get(&crate::runtime::ids::WorkerId::new(w.id.clone())) else {
            continue;
        };
        st.apply_to(w);
    }
}

/// List the actors of this node's tree (from its root supervisor) and its workers.
/// `pools`: the supervisors whose children are workers (the replicas' and the external
/// engines').
fn describe_tree(me: &ActorCell, pools: &[&str]) -> (Vec<ActorView>, Vec<WorkerView>) {
    let mut actors = Vec::new();
    let mut workers = Vec::new();
    let root = me.try_get_supervisor().unwrap_or_else(|| me.clone());
    fn walk(
        cell: &ActorCell,
        prefix: &str,
        pools: &[&str],
        actors: &mut Vec<ActorView>,
        workers: &mut Vec<WorkerView>,
    ) {
        let full = cell
            .get_name()
            .unwrap_or_else(|| format!("<{}>", cell.get_id()));
        // Registered names are `<node>/…/<name>`; show the last segment.
        let name = full.rsplit('/').next().unwrap_or(&full).to_owned();
        let path = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}/{name}")
        };
        let state = format!("{:?}", cell.get_status()).to_lowercase();
        actors.push(ActorView {
            path: path.clone(),
            state,
        });
        let mut children = cell.get_children();
        children.sort_by_key(|c| c.get_id().pid());
        for child in children {
            if pools.contains(&full.as_str()) {
                // A replica supervisor's registered name is its worker id.
                workers.push(WorkerView {
                    id: child.get_name().unwrap_or_default(),
                    state: format!("{:?}", child.get_status()).to_lowercase(),
                    ..WorkerView::default()
                });
            }
            walk(&child, &path, pools, actors, workers);
        }
    }
    walk(&root, "", pools, &mut actors, &mut workers);
    (actors, workers)
}

impl Actor for Discovery {
    type Msg = DiscoveryMsg;
    type State = DiscoveryState;
    type Arguments = DiscoveryArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: DiscoveryArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let me = NodeInfo {
            id: args.node_id.clone(),
            addr: args.addr.clone(),
            http_addr: None,
            roles: args.roles.clone(),
            incarnation: args.incarnation,
            pid: std::process::id(),
            actors: vec![],
            workers: vec![],
            counters: Default::default(),
            signals: None,
            planner: None,
            regions: vec![],
        };
        let state_clock_now = args.clock.now();
        ractor::pg::join(DISCOVERY_GROUP.to_owned(), vec![myself.get_cell()]);
        for role in &args.roles {
            ractor::pg::join(role_group(*role), vec![myself.get_cell()]);
        }
        let voter = crate::control::leadership::Voter::quiet(args.clock.wall_ms(), &args.lease);
        let state = DiscoveryState {
            voter,
            membership: Membership::new(me, args.leases),
            args,
            ticker: None,
            session_sub: None,
            relay: None,
            tick_no: 0,
            // The node joins its seeds itself at start; re-dialling begins one interval later.
            last_rejoin: Some(state_clock_now),
            gateways: Default::default(),
            redialing: Default::default(),
        };
        // A first view at once (this node alone), before the actors started after this one.
        state.publish_view(state_clock_now);
        Ok(state)
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let me = myself.clone();
        let interval = state.args.heartbeat_interval;
        state.ticker = Some(tokio::spawn(async move {
            let mut t = tokio::time::interval(interval);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n = 0u64;
            loop {
                t.tick().await;
                n += 1;
                if me.cast(DiscoveryMsg::Tick(n)).is_err() {
                    break;
                }
            }
        }));
        if let Ok((id, mut rx)) =
            crate::runtime::cluster::subscribe(&state.args.server, "discovery")
        {
            let me = myself.clone();
            let server = state.args.server.clone();
            let task = tokio::spawn(async move {
                while let Some(ev) = rx.recv().await {
                    let SessionEvent::Disconnected(p) = ev else {
                        continue;
                    };
                    let Some(name) = p.name else {
                        continue;
                    };
                    // The old session of a node that restarted under the same name closes
                    // after its new one is up: that node is not suspect.
                    if crate::runtime::cluster::has_session_with(&server, &name).await {
                        continue;
                    }
                    if me.cast(DiscoveryMsg::SessionLost(name)).is_err() {
                        break;
                    }
                }
            });
            state.session_sub = Some((id, task));
        }
        let mut bus = state.args.bus.subscribe_own_fleet_wide();
        let me = myself.clone();
        state.relay = Some(tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                match bus.recv().await {
                    Ok(ev) => {
                        if me
                            .cast(DiscoveryMsg::FleetEvent(Wire::encode(&ev)))
                            .is_err()
                        {
                            break;
                        }
                    }
                    Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => break,
                }
            }
        }));
        state.refresh_me(&myself.get_cell());
        state.publish_view(state.args.clock.now());
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.args.fleet.clear();
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        if let Some(t) = state.relay.take() {
            t.abort();
        }
        if let Some((id, task)) = state.session_sub.take() {
            let _ = state
                .args
                .server
                .cast(NodeServerMessage::UnsubscribeToEvents(id));
            task.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let now = state.args.clock.now();
        match msg {
            DiscoveryMsg::Heartbeat(wire) => {
                if let Ok(info) = wire.decode() {
                    // A peer's newest epochs: pulls naming older ones are refused from now on.
                    if let Some(t) = &state.args.transport {
                        info.regions.iter().for_each(|d| t.learn(d));
                    }
                    let ev = state.membership.on_heartbeat(info, now);
                    for e in &ev {
                        if let MembershipEvent::Superseded(s) = e {
                            tell_superseded(s);
                        }
                    }
                    state.publish(ev);
                    state.publish_view(now);
                }
            }
            DiscoveryMsg::Superseded(wire) => {
                if let Ok(s) = wire.decode()
                    && s.node == state.args.node_id
                    && s.stale_incarnation == state.args.incarnation
                {
                    // `RunningNode::wait` sees this event and stops the node.
                    state.publish(vec![MembershipEvent::Superseded(Box::new(s))]);
                }
            }
            DiscoveryMsg::FleetEvent(wire) => {
                let Ok(ev) = wire.decode() else {
                    return Ok(());
                };
                if ev.node != state.args.node_id {
                    state.args.bus.forward(ev);
                    return Ok(());
                }
                // Ours: to every other gateway node that is up.
                for n in state.membership.view(now).iter().skip(1) {
                    if n.state != NodeState::Up || !n.roles.contains(&NodeRole::Gateway) {
                        continue;
                    }
                    let name = format!("{}/discovery", n.id);
                    if let Some(cell) =
                        crate::runtime::cluster::member_named(DISCOVERY_GROUP, &name)
                        && !cell.get_id().is_local()
                    {
                        let peer: ActorRef<DiscoveryMsg> = cell.into();
                        if let Err(e) = peer.cast(DiscoveryMsg::FleetEvent(wire.clone())) {
                            tracing::debug!(error = %e, "fleet event relay to a gateway failed");
                        }
                    }
                }
            }
            DiscoveryMsg::SessionLost(name) => {
                let ev = state.membership.on_session_lost(&NodeId::new(name));
                state.publish(ev);
                state.publish_view(now);
            }
            DiscoveryMsg::Tick(_) => {
                state.tick_no += 1;
                state.refresh_me(&myself.get_cell());
                let hb = Wire::encode(state.membership.me());
                for cell in ractor::pg::get_members(&DISCOVERY_GROUP.to_owned()) {
                    if cell.get_id().is_local() {
                        continue;
                    }
                    let peer: ActorRef<DiscoveryMsg> = cell.into();
                    if let Err(e) = peer.cast(DiscoveryMsg::Heartbeat(hb.clone())) {
                        tracing::debug!(error = %e, "heartbeat to peer failed");
                    }
                }
                let ev = state.membership.tick(now);
                // A node past the liveness timeout whose session is still open (a cut link
                // sends nothing): close it, so its actors leave the process groups here.
                let down: Vec<NodeId> = ev
                    .iter()
                    .filter_map(|e| match e {
                        MembershipEvent::NodeDown(n) => Some(n.clone()),
                        _ => None,
                    })
                    .collect();
                state.publish(ev);
                for n in down {
                    if crate::runtime::cluster::drop_session(&state.args.server, n.as_str()).await {
                        tracing::warn!(seen_by = %state.args.node_id, node = %n, "closed the session of a node past the liveness timeout");
                    }
                }
                let view = state.membership.view(now);
                // The peers' names and cluster addresses (for the seeds' re-dial below).
                let peers: Vec<(String, std::net::SocketAddr)> = view
                    .iter()
                    .skip(1) // this node
                    .filter_map(|v| Some((v.id.as_str().to_owned(), v.addr.parse().ok()?)))
                    .collect();
                // Where to ask who holds this node's name when a seed refuses it.
                for v in view.iter().skip(1) {
                    if let Some(h) = gateway_address(v) {
                        state.gateways.insert(v.id.clone(), h);
                    }
                }
                for s in [NodeState::Up, NodeState::Suspect, NodeState::Down] {
                    let n = view.iter().filter(|v| v.state == s).count();
                    let label = format!("{s:?}").to_lowercase();
                    metrics::gauge!("flotilla_cluster_nodes", "state" => label).set(n as f64);
                }
                state.args.fleet.publish(view);
                // Re-dial the seeds this node has no session with — alone, or not: worker
                // nodes that see each other still lose the cluster when the seed (the gateway
                // node) restarts without dialling them back (a Kubernetes pod is restarted
                // with no `--join`, possibly on a new address), and a node whose session a
                // stale namesake displaced (`MembershipEvent::Superseded`) gets it back at
                // the next re-dial rather than after the liveness timeout.
                let due = state
                    .last_rejoin
                    .is_none_or(|t| now.saturating_duration_since(t) >= REJOIN_INTERVAL);
                if due && !state.args.seeds.is_empty() {
                    state.last_rejoin = Some(now);
                    let server = state.args.server.clone();
                    let seeds = state.args.seeds.clone();
                    let gateways: Arc<Vec<(NodeId, String)>> = Arc::new(
                        state
                            .gateways
                            .iter()
                            .map(|(id, h)| (id.clone(), h.clone()))
                            .collect(),
                    );
                    let stale = Arc::new(NodeInfo {
                        actors: Vec::new(),
                        workers: Vec::new(),
                        ..state.membership.me().clone()
                    });
                    let redialing = state.redialing.clone();
                    tokio::spawn(async move {
                        let sessions = crate::runtime::cluster::peer_names(&server).await;
                        let connected: std::collections::HashSet<std::net::SocketAddr> = peers
                            .iter()
                            .filter(|(name, _)| sessions.contains(name))
                            .map(|(_, a)| *a)
                            .collect();
                        for seed in seeds {
                            let at: Vec<std::net::SocketAddr> =
                                match tokio::net::lookup_host(seed.as_str()).await {
                                    Ok(a) => a.collect(),
                                    Err(_) => Vec::new(),
                                };
                            if !at.is_empty() && at.iter().any(|a| connected.contains(a)) {
                                continue; // connected to it already
                            }
                            if !redialing
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .insert(seed.clone())
                            {
                                continue; // the last re-dial has not ended
                            }
                            // Each on its own: an unreachable seed does not hold up the next.
                            let server = server.clone();
                            let (gateways, stale, me, redialing) = (
                                gateways.clone(),
                                stale.clone(),
                                myself.clone(),
                                redialing.clone(),
                            );
                            tokio::spawn(async move {
                                let result =
                                    crate::runtime::cluster::join(&server, &seed, REDIAL_WAIT)
                                        .await;
                                redialing
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                                    .remove(&seed);
                                match result {
                                    Ok(()) => {}
                                    Err(crate::runtime::cluster::ClusterError::AuthFailed {
                                        ..
                                    }) => {
                                        tracing::debug!(seed = %seed, "re-dial refused before authentication");
                                        check_name_taken(&stale, &gateways, &me).await;
                                    }
                                    Err(e) => {
                                        tracing::debug!(seed = %seed, error = %e, "re-dial failed");
                                    }
                                }
                            });
                        }
                    });
                }
            }
            DiscoveryMsg::GetFleet(reply) => {
                state.refresh_me(&myself.get_cell());
                let view = state.membership.view(now);
                let _ = reply.send(Wire::encode(&view));
                state.args.fleet.publish(view);
            }
            DiscoveryMsg::Vote(req, reply) => {
                if let Ok(req) = req.decode() {
                    let now_ms = state.args.clock.wall_ms();
                    let answer = state.voter.on_request(&req, now_ms, &state.args.lease);
                    if answer.granted && state.voter.term() == req.term {
                        tracing::debug!(term = req.term, candidate = %req.candidate, "planner lease granted");
                    }
                    let _ = reply.send(Wire::encode(&answer));
                }
            }
        }
        Ok(())
    }
}

/// This process's Discovery actor registered as `name`, found through its process group
/// (not the name registry, which a stopping peer proxy of the same name can clear).
pub fn local(name: &str) -> Option<ActorRef<DiscoveryMsg>> {
    ractor::pg::get_local_members(&DISCOVERY_GROUP.to_owned())
        .into_iter()
        .find(|c| c.get_name().as_deref() == Some(name))
        .map(Into::into)
}

/// Ask a Discovery actor for its fleet view (fresh: it first refreshes its own entry).
///
/// # Errors
/// A message when the actor does not answer within 2 s or its reply cannot be decoded.
pub async fn fleet(discovery: &ActorRef<DiscoveryMsg>) -> Result<Vec<NodeView>, String> {
    let wire = ractor::call_t!(discovery, DiscoveryMsg::GetFleet, 2_000)
        .map_err(|e| format!("discovery did not answer: {e}"))?;
    wire.decode().map_err(|e| e.to_string())
}
