//! Router: places each request on a live worker (first version: least outstanding requests,
//! round-robin among equals — `router/select.rs`). Runs on nodes with the `router` role, in
//! the process group [`ROUTER_GROUP`]; gateways ask any router, preferring their own node's.
//!
//! Live workers are the members of the schedulers' process group: `ractor_cluster` removes a
//! node's actors from every group as soon as its session drops, so a dead node's workers stop
//! being chosen at once, and a replica that restarts rejoins under the same worker id.
//! Placements never released (a gateway that died) expire after [`LEASE_TTL_MS`].

pub mod select;

use crate::actors::scheduler::ROUTABLE_GROUP;
use crate::ids::{NodeId, RequestId, WorkerId};
use crate::wire::Wire;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use select::LeastLoaded;
use serde::{Deserialize, Serialize};

/// Process group of every Router.
pub const ROUTER_GROUP: &str = "flotilla.routers";
/// Placements older than this are released (ms).
pub const LEASE_TTL_MS: u64 = 30 * 60 * 1000;

/// A placement request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// Submitting node.
    pub node: NodeId,
    /// Request id on that node.
    pub request: RequestId,
    /// Prompt length in tokens (used by load-aware policies).
    pub prompt_tokens: u32,
}

/// Router messages (serializable: gateways on any node ask).
#[derive(RactorClusterMessage)]
pub enum RouterMsg {
    /// Pick a worker (call); `None` when no worker is live.
    #[rpc]
    Route(Wire<RouteRequest>, RpcReplyPort<Wire<Option<WorkerId>>>),
    /// The request ended (cast).
    Release(Wire<(NodeId, RequestId)>),
}

/// The Router actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct Router;

/// Router state.
pub struct RouterState {
    select: LeastLoaded,
}

/// Workers a router may choose: members of the routable schedulers' group (alive, healthy,
/// not draining), by worker id (`<worker>/scheduler`).
pub fn live_workers() -> Vec<WorkerId> {
    ractor::pg::get_members(&ROUTABLE_GROUP.to_owned())
        .into_iter()
        .filter_map(|c| c.get_name())
        .filter_map(|n| n.strip_suffix("/scheduler").map(WorkerId::new))
        .collect()
}

impl Actor for Router {
    type Msg = RouterMsg;
    type State = RouterState;
    type Arguments = ();

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        _: (),
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(ROUTER_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(RouterState {
            select: LeastLoaded::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let now = crate::clock::unix_ms();
        match msg {
            RouterMsg::Route(wire, reply) => {
                let pick = match wire.decode() {
                    Ok(req) => {
                        state.select.expire(now, LEASE_TTL_MS);
                        let live = live_workers();
                        state
                            .select
                            .place((req.node.to_string(), req.request), &live, now)
                    }
                    Err(_) => None,
                };
                if let Some(w) = &pick {
                    metrics::counter!("flotilla_router_placements_total", "worker" => w.to_string())
                        .increment(1);
                }
                let _ = reply.send(Wire::encode(&pick));
            }
            RouterMsg::Release(wire) => {
                if let Ok((node, request)) = wire.decode() {
                    state.select.release(&(node.to_string(), request));
                }
            }
        }
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
