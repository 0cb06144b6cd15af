//! Router: places each request on a live worker, KV-aware by default.
//!
//! A driver: mailbox, timers, process groups. What it decides is decided by the pure core it
//! drives, [`RouterCore`] (`request_plane/router/core.rs`: the prefix index, the active load,
//! the policies, sessions and conditional disaggregation), which the simulator and the tests
//! drive on a manual clock.
//!
//! Any node with the `router` role runs one Router, in the process group [`ROUTER_GROUP`];
//! gateways ask their own node's router first. Every router consumes every KV event (a
//! [`KvEventsRelay`] joins [`KV_EVENTS_GROUP`], the KV event publishers broadcast to it), so
//! all routers converge on the same index. The relay is the router's sibling under a
//! one_for_all supervisor (`supervisors/tree.rs`): either exiting restarts both, and the
//! restarted index asks every live worker's KV event publisher for a snapshot on its first
//! tick (1 s), as it does for a worker that joins (`flotilla_router_index_blocks` shows the
//! index filling). The policy is `router.policy`; a request may
//! override it with the header [`POLICY_HEADER`] (`x-flotilla-route-policy: round_robin`).
//!
//! # Who can be chosen
//! Only the members of the routable schedulers' group: `ractor_cluster` removes a node's
//! actors from every group as soon as its session drops, so a dead node's workers stop being
//! chosen at once; a draining or hung replica leaves the group itself. A worker that leaves the
//! schedulers' group (dead, restarting) is also purged from the index and the active load at
//! once (a process-group monitor): a cached prefix is never a reason to pick a worker that is
//! gone, and a restarted replica starts from an empty cache. Placements never released (a
//! gateway that died) expire after [`LEASE_TTL_MS`]. The placement log lines (`placed`, with
//! the cost terms) are written here, under [`PLACEMENT_TARGET`].

pub use crate::request_plane::router::core::{
    DisaggRouting, LEASE_TTL_MS, RESYNC_RETRY_MS, RouterCore, RouterCoreArgs, WorkerSource,
};

use crate::actors::kv_publisher::{
    KV_EVENTS_GROUP, KV_PUBLISHER_GROUP, KvEventsMsg, KvPublisherMsg, KvSnapshot,
};
use crate::kv::KvEvent;
use crate::request_plane::events::{EventBus, FleetEventKind};
use crate::request_plane::protocol::{Placement, RouteRequest};
use crate::request_plane::router::sync;
use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::role::{Role, role_group};
use crate::runtime::wire::Wire;
use crate::worker::scheduler::{ROUTABLE_GROUP, SCHEDULER_GROUP};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;

/// Process group of every Router.
pub const ROUTER_GROUP: &str = "flotilla.routers";
/// HTTP header that overrides the routing policy for one request.
pub const POLICY_HEADER: &str = "x-flotilla-route-policy";

/// Router messages (serializable: gateways on any node ask).
#[derive(RactorClusterMessage)]
pub enum RouterMsg {
    /// Pick a worker (call); `None` when no worker is live.
    #[rpc]
    Route(Wire<RouteRequest>, RpcReplyPort<Wire<Option<Placement>>>),
    /// The request's first token arrived: its prompt is no longer waiting for prefill (cast).
    FirstToken(Wire<(NodeId, RequestId)>),
    /// The request ended (cast).
    Release(Wire<(NodeId, RequestId)>),
    /// KV events from a KV event publisher (cast, via the relay).
    KvEvents(Wire<Vec<KvEvent>>),
    /// A snapshot asked for after a gap (local cast).
    Resynced(Wire<KvSnapshot>),
    /// Local, periodic: expire placements, retry lost resyncs.
    Tick(Wire<()>),
    /// Another router's changes to its load: its registered name and the changes (cast;
    /// `router.share_load`).
    PeerLoad(Wire<(String, Vec<sync::LoadChange>)>),
}

/// The Router actor (see [`RouterArgs`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct Router;

/// The workers of the cluster, read from the schedulers' process groups.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessGroups;

impl WorkerSource for ProcessGroups {
    fn routable(&self) -> Vec<WorkerId> {
        live_workers()
    }

    fn alive(&self) -> Vec<WorkerId> {
        workers_in(SCHEDULER_GROUP)
    }

    fn in_role(&self, role: Role) -> Vec<WorkerId> {
        role_group(role).map(workers_in).unwrap_or_default()
    }
}

/// What a Router starts with: its core's arguments, and what the driver itself needs.
#[derive(Clone)]
pub struct RouterArgs {
    /// The placement core's arguments.
    pub core: RouterCoreArgs,
    /// The node's fleet event bus (workers joining and leaving).
    pub bus: EventBus,
    /// Registered name of this router's [`KvEventsRelay`]: publishers send the snapshots it
    /// asks for there. `None`: a router that hears no KV events, so asks for no snapshot.
    pub relay: Option<String>,
}

/// The Router actor's state: the core it drives, and where its I/O goes.
pub struct RouterState {
    core: RouterCore,
    bus: EventBus,
    relay: Option<String>,
}

impl RouterState {
    /// Ask the KV event publishers of the workers the core wants a snapshot of (a cast both
    /// ways: no task, no call; a lost answer is asked again after [`RESYNC_RETRY_MS`]).
    fn ask_snapshots(&mut self) {
        let wanted = self.core.take_snapshot_requests();
        let Some(relay) = &self.relay else {
            return;
        };
        for worker in wanted {
            let name = format!("{worker}/kv_publisher");
            let Some(kvm) = crate::runtime::cluster::member_named(KV_PUBLISHER_GROUP, &name) else {
                continue; // gone: purged when its scheduler leaves
            };
            let kvm: ActorRef<KvPublisherMsg> = kvm.into();
            let _ = kvm.cast(KvPublisherMsg::SnapshotFor(Wire::encode(relay)));
        }
    }
}

/// Workers a router may choose: members of the routable schedulers' group (alive, healthy,
/// not draining), by worker id (`<worker>/scheduler`).
pub fn live_workers() -> Vec<WorkerId> {
    workers_in(ROUTABLE_GROUP)
}

fn workers_in(group: &str) -> Vec<WorkerId> {
    ractor::pg::get_members(&group.to_owned())
        .iter()
        .filter_map(worker_of_scheduler)
        .collect()
}

/// The worker id of a scheduler actor (registered as `<worker>/scheduler`).
fn worker_of_scheduler(cell: &ractor::ActorCell) -> Option<WorkerId> {
    cell.get_name()?
        .strip_suffix("/scheduler")
        .map(WorkerId::new)
}

impl Actor for Router {
    type Msg = RouterMsg;
    type State = RouterState;
    type Arguments = RouterArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: RouterArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut core = RouterCore::new(args.core).map_err(|e| e.to_string())?;
        // A restarted router starts from an empty index.
        metrics::gauge!("flotilla_router_index_blocks").set(0.0);
        for c in ractor::pg::get_members(&ROUTER_GROUP.to_owned()) {
            if let Some(name) = c.get_name() {
                core.router_joined(&name);
            }
        }
        ractor::pg::join(ROUTER_GROUP.to_owned(), vec![myself.get_cell()]);
        ractor::pg::monitor(SCHEDULER_GROUP.to_owned(), myself.get_cell());
        ractor::pg::monitor(ROUTER_GROUP.to_owned(), myself.get_cell());
        myself.send_interval(std::time::Duration::from_secs(1), || {
            RouterMsg::Tick(Wire::encode(&()))
        });
        Ok(RouterState {
            core,
            bus: args.bus,
            relay: args.relay,
        })
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: ractor::SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        use ractor::SupervisionEvent as E;
        match event {
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Leave(_, group, gone))
                if group == SCHEDULER_GROUP =>
            {
                for w in gone.iter().filter_map(worker_of_scheduler) {
                    state.core.worker_left(&w);
                    state.bus.emit(FleetEventKind::WorkerDown { worker: w });
                }
                state.core.publish_queues();
            }
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Leave(_, group, gone))
                if group == ROUTER_GROUP =>
            {
                for name in gone.iter().filter_map(ractor::ActorCell::get_name) {
                    let dropped = state.core.router_left(&name);
                    tracing::info!(router = %name, dropped, "router left; its placements forgotten");
                }
                state.core.publish_queues();
            }
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Join(_, group, came))
                if group == ROUTER_GROUP =>
            {
                for name in came.iter().filter_map(ractor::ActorCell::get_name) {
                    if Some(&name) != myself.get_name().as_ref() {
                        state.core.router_joined(&name);
                    }
                }
            }
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Join(_, group, came))
                if group == SCHEDULER_GROUP =>
            {
                for worker in came.iter().filter_map(worker_of_scheduler) {
                    state.bus.emit(FleetEventKind::WorkerUp { worker });
                }
            }
            _ => {}
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // KV events and resyncs change the index, not the load.
        let changes_load = !matches!(msg, RouterMsg::KvEvents(_) | RouterMsg::Resynced(_));
        let core = &mut state.core;
        match msg {
            RouterMsg::Route(wire, reply) => {
                let pick = match wire.decode() {
                    Ok(req) => route_traced(core, req).map_err(|e| e.to_string())?,
                    Err(_) => None,
                };
                let _ = reply.send(Wire::encode(&pick));
            }
            RouterMsg::FirstToken(wire) => {
                if let Ok((node, request)) = wire.decode() {
                    core.first_token(node, request);
                }
            }
            RouterMsg::Release(wire) => {
                if let Ok((node, request)) = wire.decode() {
                    core.release(node, request);
                }
            }
            RouterMsg::PeerLoad(wire) => {
                if let Ok((from, changes)) = wire.decode() {
                    core.peer_load(&from, changes);
                }
            }
            RouterMsg::KvEvents(wire) => {
                if let Ok(events) = wire.decode() {
                    core.kv_events(events);
                }
            }
            RouterMsg::Resynced(wire) => {
                if let Ok(snap) = wire.decode() {
                    core.snapshot(snap);
                }
            }
            RouterMsg::Tick(_) => core.tick(),
        }
        tell_peers(&myself, state.core.take_shared());
        state.ask_snapshots();
        if changes_load {
            state.core.publish_queues();
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.core.clear_queues();
        Ok(())
    }
}

/// The tracing target of the router's `placed` lines: `FLOTILLA_LOG=info,flotilla::placement=off`
/// turns them off.
pub const PLACEMENT_TARGET: &str = "flotilla::placement";

/// Place `req` (its [`RouteRequest::trace_id`] and `traceparent` used for the logs only):
/// one `placed` line at info under [`PLACEMENT_TARGET`] with the request id, the chosen
/// worker and the cost terms (or `no worker`), inside a `route` span joined to the gateway's
/// trace when an OTLP export runs (no span otherwise).
fn route_traced(
    core: &mut RouterCore,
    mut req: RouteRequest,
) -> Result<Option<Placement>, crate::request_plane::router::core::RouterError> {
    let id = req.trace_id.take().unwrap_or_else(|| "-".to_owned());
    let span = match req.traceparent.take() {
        Some(tp) => {
            let span = tracing::info_span!(target: PLACEMENT_TARGET, "route", request_id = %id);
            crate::runtime::otlp::adopt_remote_parent(&span, Some(&tp));
            span
        }
        None => tracing::Span::none(),
    };
    let _in = span.enter();
    let (node, request) = (req.node.clone(), req.request);
    let pick = core.place(req)?;
    match &pick {
        Some(p) => {
            let t = p.terms.as_ref();
            tracing::info!(target: PLACEMENT_TARGET, request_id = %id, gateway = %node, %request,
                worker = %p.worker, hand_off = p.hand_off,
                overlap_blocks = t.map(|t| t.overlap_blocks), cost = t.map(|t| t.cost),
                session = t.and_then(|t| t.session.as_deref()),
                "placed");
        }
        None => {
            tracing::info!(target: PLACEMENT_TARGET, request_id = %id, gateway = %node, %request, "no worker to place on");
        }
    }
    Ok(pick)
}

/// Casts `changes` (this router's, `router.share_load`) to every other router in
/// [`ROUTER_GROUP`], once per router per batch. A router that is gone is skipped: its
/// placements are forgotten by the others when it leaves the group.
fn tell_peers(myself: &ActorRef<RouterMsg>, changes: Vec<sync::LoadChange>) {
    if changes.is_empty() {
        return;
    }
    let Some(name) = myself.get_name() else {
        return;
    };
    let peers: Vec<ActorRef<RouterMsg>> = ractor::pg::get_members(&ROUTER_GROUP.to_owned())
        .into_iter()
        .filter(|c| c.get_id() != myself.get_id())
        .map(Into::into)
        .collect();
    if peers.is_empty() {
        return;
    }
    let wire = Wire::encode(&(name, changes));
    for p in peers {
        if p.cast(RouterMsg::PeerLoad(wire.clone())).is_err() {
            metrics::counter!("flotilla_router_peer_sync_failures_total").increment(1);
        }
    }
}

/// Joins [`KV_EVENTS_GROUP`] on behalf of its router and hands every batch of KV events on.
/// (A separate actor because KV event publishers cast [`KvEventsMsg`] to the group's members.)
/// Started after its router, beside it, by the node's tree.
#[derive(Debug, Default, Clone, Copy)]
pub struct KvEventsRelay;

impl Actor for KvEventsRelay {
    type Msg = KvEventsMsg;
    type State = ActorRef<RouterMsg>;
    type Arguments = ActorRef<RouterMsg>;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        router: ActorRef<RouterMsg>,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(KV_EVENTS_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(router)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        router: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let to_router = match msg {
            KvEventsMsg::Publish(events) => RouterMsg::KvEvents(events),
            KvEventsMsg::Snapshot(snapshot) => RouterMsg::Resynced(snapshot),
        };
        router
            .cast(to_router)
            .map_err(|e| format!("router gone: {e}"))?;
        Ok(())
    }
}

/// A router to ask: this node's if it runs one, else any.
pub fn find_router() -> Option<ActorRef<RouterMsg>> {
    let members = ractor::pg::get_members(&ROUTER_GROUP.to_owned());
    members
        .iter()
        .find(|c| c.get_id().is_local())
        .or_else(|| members.first())
        .cloned()
        .map(Into::into)
}
