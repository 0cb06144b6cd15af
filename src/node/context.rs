//! What a node's supervision tree is built from: [`NodeContext`], made once by
//! `node::start`; `tree_args.rs` turns it into the arguments the tree
//! (`supervisors/tree.rs`) is started with.

use crate::control::discovery::FleetView;
use crate::control::discovery::membership::MembershipEvent;
use crate::model::LoadedModel;
use crate::node::config::Config;
use crate::runtime::clock::SharedClock;
use crate::runtime::cluster::ClusterHandle;
use crate::runtime::ids::NodeId;
use crate::runtime::resilience::NodeStats;
use std::sync::{Arc, Mutex};

/// Everything the tree's start functions need, cloned into them.
#[derive(Clone)]
pub struct NodeContext {
    /// Validated configuration.
    pub config: Arc<Config>,
    /// This node's name.
    pub node_id: NodeId,
    /// Prefix of every registered actor name: `<node>/`. Names must be unique cluster-wide,
    /// not only per process: ractor unregisters a *name* when any actor bearing it stops, and
    /// the proxies of a peer's actors bear the peer's names, so a peer going away would
    /// otherwise erase our own registrations.
    pub prefix: String,
    /// The cluster server.
    pub cluster: ClusterHandle,
    /// Membership changes (a lagging subscriber re-reads the fleet view).
    pub membership: tokio::sync::broadcast::Sender<MembershipEvent>,
    /// The gateway's bound HTTP address, once bound.
    pub http_addr: Arc<Mutex<Option<String>>>,
    /// Process start, ms since the Unix epoch.
    pub incarnation: u64,
    /// Injected clock.
    pub clock: SharedClock,
    /// The model, loaded once per process, when this node runs workers.
    pub model: Option<Arc<LoadedModel>>,
    /// Faults injected on this node: the book (ids, ends, the transport's filter), kept by
    /// the Chaos actor.
    pub faults: crate::control::chaos::FaultBook,
    /// The filters of the boundaries where they act (replicas, KV event publishers), written
    /// by the Chaos actor and read each by its own boundary.
    pub fault_filters: crate::actors::chaos::FaultFilters,
    /// The model's tokenizer, template and limits, when this node runs a gateway.
    pub frontend: Option<Arc<crate::request_plane::frontend::Frontend>>,
    /// Where this node's real engines run (`worker.backend` resolved at start; replica `k`
    /// of a CUDA node takes GPU `k mod gpus`).
    pub device: crate::kernels::Device,
    /// GPUs the driver sees (0 without CUDA).
    pub gpus: usize,
    /// The sim engine's timing profile when `worker.engine = "sim"`.
    pub sim_profile: Option<crate::worker::engine::sim::SimProfile>,
    /// This node's draining flag and resilience counters (never shared with another node of
    /// the same process).
    pub stats: Arc<NodeStats>,
    /// The fleet view this node's Discovery publishes (read by admission without a call).
    pub fleet: FleetView,
    /// The prefill queues this node's router publishes (read by admission without a call).
    pub prefill_queues: crate::request_plane::router::load::PrefillQueueView,
    /// This node's KV transport (worker nodes): engines allocate and register their pools
    /// through it; Discovery publishes its regions.
    pub transport: Option<Arc<crate::transport::Transport>>,
    /// This node's replicas' own endpoints (HTTP faces, vLLM-format KV event sockets).
    pub endpoints: crate::control::discovery::WorkerEndpoints,
    /// The stats this node's schedulers publish (read by Discovery without a call).
    pub worker_stats: crate::worker::scheduler::StatsBoard,
    /// This node's fleet event bus: the actors that decide write to it.
    pub events: crate::request_plane::events::EventBus,
    /// What this node's planner publishes (read by Discovery without a call).
    pub planner: crate::control::planner::PlannerBoard,
    /// One replica's capacity curves, when this node runs the planner.
    pub planner_capacity: Option<crate::control::planner::CapacityProfile>,
}

impl NodeContext {
    /// Registered name for a node-local actor.
    pub fn name(&self, base: &str) -> String {
        format!("{}{}", self.prefix, base)
    }
}
