//! Router: places each request on a live worker, KV-aware by default.
//!
//! Files:
//! - `index.rs` — [`index::PrefixIndex`]: which worker holds which prompt prefix, built from
//!   every worker's KV events (radix tree keyed by sequence hash; gap / duplicate / reset of a
//!   worker's event ids triggers one resync from its KV block manager's snapshot).
//! - `load.rs` — [`load::LoadModel`]: per worker, prompt tokens waiting for prefill and active
//!   decode blocks of the requests this router placed.
//! - `policy.rs` — [`policy::Selector`]: `kv` (Dynamo's cost: `overlap_weight × prefill_blocks
//!   + decode_blocks`), `least_loaded`, `round_robin`, `random`.
//!
//! Any node with the `router` role runs one Router, in the process group [`ROUTER_GROUP`];
//! gateways ask their own node's router first. Every router consumes every KV event (a
//! [`KvEventsRelay`] joins [`KV_EVENTS_GROUP`], the block managers broadcast to it), so
//! all routers converge on the same index. The relay is the router's sibling under a
//! one_for_all supervisor (`supervisors/tree.rs`): either exiting restarts both, and the
//! restarted index resyncs from snapshots as events arrive. The policy is `router.policy`; a request may
//! override it with the header [`POLICY_HEADER`] (`x-flotilla-route-policy: round_robin`).
//!
//! # Who can be chosen
//! Only the members of the routable schedulers' group: `ractor_cluster` removes a node's
//! actors from every group as soon as its session drops, so a dead node's workers stop being
//! chosen at once; a draining or hung replica leaves the group itself. A worker that leaves the
//! schedulers' group (dead, restarting) is also purged from the index and the load model at
//! once (a process-group monitor): a cached prefix is never a reason to pick a worker that is
//! gone, and a restarted replica starts from an empty cache. Placements never released (a
//! gateway that died) expire after [`LEASE_TTL_MS`].

pub mod index;
pub mod load;
pub mod policy;

use crate::kv::{
    KV_EVENTS_GROUP, KV_MANAGER_GROUP, KvBlockManagerMsg, KvEvent, KvEventsMsg, KvSnapshot,
};
use crate::runtime::ids::{EventId, NodeId, RequestId, SequenceHash, WorkerId};
use crate::runtime::wire::Wire;
use crate::worker::scheduler::{ROUTABLE_GROUP, SCHEDULER_GROUP};
use index::{ApplyOutcome, PrefixIndex};
use load::LoadModel;
use policy::{Policy, Selector, SelectorConfig};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Process group of every Router.
pub const ROUTER_GROUP: &str = "flotilla.routers";
/// Placements older than this are released (ms).
pub const LEASE_TTL_MS: u64 = 30 * 60 * 1000;
/// HTTP header that overrides the routing policy for one request.
pub const POLICY_HEADER: &str = "x-flotilla-route-policy";
/// A resync asked for and not answered within this long is asked again (ms).
pub const RESYNC_RETRY_MS: u64 = 2_000;

/// A placement request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// Submitting node.
    pub node: NodeId,
    /// Request id on that node.
    pub request: RequestId,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Sequence hash of every full block of the prompt (the KV block manager's recipe).
    #[serde(default)]
    pub seq_hashes: Vec<SequenceHash>,
    /// Policy for this request (`None`: the router's configured one).
    #[serde(default)]
    pub policy: Option<Policy>,
    /// Workers that already failed this request: not chosen unless no other is live.
    #[serde(default)]
    pub avoid: Vec<WorkerId>,
}

/// Router messages (serializable: gateways on any node ask).
#[derive(RactorClusterMessage)]
pub enum RouterMsg {
    /// Pick a worker (call); `None` when no worker is live.
    #[rpc]
    Route(Wire<RouteRequest>, RpcReplyPort<Wire<Option<WorkerId>>>),
    /// The request's first token arrived: its prompt is no longer waiting for prefill (cast).
    FirstToken(Wire<(NodeId, RequestId)>),
    /// The request ended (cast).
    Release(Wire<(NodeId, RequestId)>),
    /// KV events from a block manager (cast, via the relay).
    KvEvents(Wire<Vec<KvEvent>>),
    /// A snapshot asked for after a gap (local cast).
    Resynced(Wire<KvSnapshot>),
    /// Local, periodic: expire placements, retry lost resyncs.
    Tick(Wire<()>),
}

/// The Router actor; its argument is the selector configuration (`router.*`, with the
/// workers' block size).
#[derive(Debug, Default, Clone, Copy)]
pub struct Router;

/// Router state.
pub struct RouterState {
    config: SelectorConfig,
    index: PrefixIndex,
    load: LoadModel,
    /// One selector per policy in use (the configured one, and per-request overrides).
    selectors: HashMap<Policy, Selector>,
    /// Resyncs asked for: worker → when (ms).
    resyncs: HashMap<WorkerId, u64>,
}

/// Workers a router may choose: members of the routable schedulers' group (alive, healthy,
/// not draining), by worker id (`<worker>/scheduler`).
pub fn live_workers() -> Vec<WorkerId> {
    workers_in(ROUTABLE_GROUP)
}

/// `live` without the workers in `avoid`, unless that leaves none.
fn prefer_not(live: Vec<WorkerId>, avoid: &[WorkerId]) -> Vec<WorkerId> {
    if avoid.is_empty() {
        return live;
    }
    let others: Vec<WorkerId> = live
        .iter()
        .filter(|w| !avoid.contains(w))
        .cloned()
        .collect();
    if others.is_empty() { live } else { others }
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

impl RouterState {
    /// Make sure a selector for `policy` exists.
    fn ensure_selector(&mut self, policy: Policy) -> Result<(), ActorProcessingErr> {
        if !self.selectors.contains_key(&policy) {
            let config = SelectorConfig {
                policy,
                ..self.config.clone()
            };
            self.selectors
                .insert(policy, Selector::new(config).map_err(|e| e.to_string())?);
        }
        Ok(())
    }

    fn route(
        &mut self,
        req: RouteRequest,
        now: u64,
    ) -> Result<Option<WorkerId>, ActorProcessingErr> {
        let key = (req.node.to_string(), req.request);
        let live = prefer_not(live_workers(), &req.avoid);
        if let Some(w) = self.load.worker_of(&key).filter(|w| live.contains(w)) {
            return Ok(Some(w.clone()));
        }
        let policy = req.policy.unwrap_or(self.config.policy);
        self.ensure_selector(policy)?;
        let Some(selector) = self.selectors.get_mut(&policy) else {
            return Ok(None);
        };
        let Some(d) = selector.select(
            &live,
            &req.seq_hashes,
            req.prompt_tokens,
            &self.index,
            &self.load,
        ) else {
            return Ok(None);
        };
        self.load
            .on_routed(key, &d.worker, d.uncached_tokens, d.request_blocks, now);
        let w = d.worker.to_string();
        metrics::counter!("flotilla_router_placements_total", "worker" => w.clone(), "policy" => d.policy.as_str())
            .increment(1);
        metrics::counter!("flotilla_router_prompt_blocks_total")
            .increment(u64::from(d.request_blocks));
        metrics::counter!("flotilla_router_overlap_blocks_total")
            .increment(u64::from(d.overlap_blocks));
        Ok(Some(d.worker))
    }

    fn on_events(&mut self, events: Vec<KvEvent>, myself: &ActorRef<RouterMsg>, now: u64) {
        for ev in &events {
            match self.index.apply(ev) {
                ApplyOutcome::NeedsResync { worker, reason } => {
                    tracing::warn!(%worker, ?reason, "KV event stream inconsistent; resyncing from a snapshot");
                    metrics::counter!("flotilla_router_resyncs_total").increment(1);
                    self.ask_snapshot(worker, myself, now);
                }
                ApplyOutcome::Applied => {
                    metrics::counter!("flotilla_router_kv_events_total", "outcome" => "applied")
                        .increment(1);
                }
                ApplyOutcome::Buffered | ApplyOutcome::Ignored => {
                    metrics::counter!("flotilla_router_kv_events_total", "outcome" => "held")
                        .increment(1);
                }
            }
        }
    }

    /// Ask `worker`'s block manager for a snapshot; the reply comes back as `Resynced`.
    fn ask_snapshot(&mut self, worker: WorkerId, myself: &ActorRef<RouterMsg>, now: u64) {
        self.resyncs.insert(worker.clone(), now);
        let me = myself.clone();
        tokio::spawn(async move {
            let name = format!("{worker}/kv_manager");
            let Some(kvm) = crate::runtime::cluster::member_named(KV_MANAGER_GROUP, &name) else {
                return; // gone: purged when its scheduler leaves
            };
            let kvm: ActorRef<KvBlockManagerMsg> = kvm.into();
            if let Ok(w) = ractor::call_t!(kvm, KvBlockManagerMsg::Snapshot, RESYNC_RETRY_MS) {
                let _ = me.cast(RouterMsg::Resynced(w));
            }
        });
    }

    fn on_snapshot(&mut self, snap: KvSnapshot) {
        self.resyncs.remove(&snap.worker);
        let last = snap.last_event.unwrap_or(EventId(0));
        let report = self.index.resync(&snap.worker, last, &snap.blocks);
        tracing::info!(worker = %snap.worker, blocks = snap.blocks.len(), ?report, "resynced from snapshot");
    }

    /// Forget a worker that left (dead or restarting).
    fn purge(&mut self, worker: &WorkerId) {
        let held = self.index.blocks_of(worker);
        self.index.remove_worker(worker);
        self.load.remove_worker(worker);
        self.resyncs.remove(worker);
        tracing::info!(%worker, held, "worker left; purged from the router");
    }

    fn tick(&mut self, myself: &ActorRef<RouterMsg>, now: u64) {
        self.load.expire(now, LEASE_TTL_MS);
        let alive = workers_in(SCHEDULER_GROUP);
        let known: Vec<WorkerId> = self.index.workers().cloned().collect();
        for w in known.iter().filter(|w| !alive.contains(w)) {
            self.purge(w);
        }
        let stale: Vec<WorkerId> = self
            .index
            .pending_resyncs()
            .into_iter()
            .map(|(w, _)| w)
            .filter(|w| {
                self.resyncs
                    .get(w)
                    .is_none_or(|t| now.saturating_sub(*t) >= RESYNC_RETRY_MS)
            })
            .collect();
        for w in stale {
            self.ask_snapshot(w, myself, now);
        }
    }
}

impl Actor for Router {
    type Msg = RouterMsg;
    type State = RouterState;
    type Arguments = SelectorConfig;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        config: SelectorConfig,
    ) -> Result<Self::State, ActorProcessingErr> {
        let selector = Selector::new(config.clone()).map_err(|e| e.to_string())?;
        ractor::pg::join(ROUTER_GROUP.to_owned(), vec![myself.get_cell()]);
        ractor::pg::monitor(SCHEDULER_GROUP.to_owned(), myself.get_cell());
        myself.send_interval(std::time::Duration::from_secs(1), || {
            RouterMsg::Tick(Wire::encode(&()))
        });
        let mut selectors = HashMap::new();
        selectors.insert(config.policy, selector);
        Ok(RouterState {
            config,
            index: PrefixIndex::new(),
            load: LoadModel::new(),
            selectors,
            resyncs: HashMap::new(),
        })
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<Self::Msg>,
        event: ractor::SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        use ractor::SupervisionEvent as E;
        match event {
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Leave(_, group, gone))
                if group == SCHEDULER_GROUP =>
            {
                for w in gone.iter().filter_map(worker_of_scheduler) {
                    state.purge(&w);
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
        let now = crate::runtime::clock::unix_ms();
        match msg {
            RouterMsg::Route(wire, reply) => {
                let pick = match wire.decode() {
                    Ok(req) => state.route(req, now)?,
                    Err(_) => None,
                };
                let _ = reply.send(Wire::encode(&pick));
            }
            RouterMsg::FirstToken(wire) => {
                if let Ok((node, request)) = wire.decode() {
                    state.load.on_first_token(&(node.to_string(), request), now);
                }
            }
            RouterMsg::Release(wire) => {
                if let Ok((node, request)) = wire.decode() {
                    state.load.on_finished(&(node.to_string(), request));
                }
            }
            RouterMsg::KvEvents(wire) => {
                if let Ok(events) = wire.decode() {
                    state.on_events(events, &myself, now);
                }
            }
            RouterMsg::Resynced(wire) => {
                if let Ok(snap) = wire.decode() {
                    state.on_snapshot(snap);
                }
            }
            RouterMsg::Tick(_) => state.tick(&myself, now),
        }
        Ok(())
    }
}

/// Joins [`KV_EVENTS_GROUP`] on behalf of its router and hands every batch of KV events on.
/// (A separate actor because block managers cast [`KvEventsMsg`] to the group's members.)
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
        let KvEventsMsg::Publish(events) = msg;
        router
            .cast(RouterMsg::KvEvents(events))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(names: &[&str]) -> Vec<WorkerId> {
        names.iter().map(|n| WorkerId::new(*n)).collect()
    }

    #[test]
    fn workers_that_failed_a_request_are_avoided_unless_none_is_left() {
        assert_eq!(prefer_not(ws(&["a", "b", "c"]), &[]), ws(&["a", "b", "c"]));
        assert_eq!(
            prefer_not(ws(&["a", "b", "c"]), &ws(&["b"])),
            ws(&["a", "c"])
        );
        assert_eq!(
            prefer_not(ws(&["a", "b"]), &ws(&["a", "b"])),
            ws(&["a", "b"])
        );
        assert_eq!(
            prefer_not(ws(&["a"]), &ws(&["a"])),
            ws(&["a"]),
            "the only one left"
        );
        assert_eq!(prefer_not(vec![], &ws(&["a"])), ws(&[]));
    }
}
