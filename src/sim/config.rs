//! The configuration a simulated fleet reads: the planes' own sections, the ones the live
//! nodes read too (`flotilla sim` fills them from the node's configuration: `--config`, the
//! environment, `--set`), and the settings the live composition root builds from them, built
//! here by the same section methods. Nothing here is the simulator's own: a setting
//! `flotilla up` takes means the same in a simulated fleet.

use crate::control::discovery::config::ClusterConfig;
use crate::control::planner::PlannerConfig;
use crate::request_plane::gateway::GatewayConfig;
use crate::request_plane::priority::PriorityConfig;
use crate::request_plane::router::config::RouterConfig;
use crate::worker::config::WorkerConfig;
use crate::worker::scheduler::config::{DisaggConfig, SchedulerSection};

/// The sections a simulated fleet reads (each as `flotilla up` would give it, under the same
/// key: `cluster.*`, `gateway.*`, …).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimConfig {
    /// Heartbeats (the fleet view's refresh) and liveness (the owners' grace).
    pub cluster: ClusterConfig,
    /// Admission, migration bounds, the wait for capacity.
    pub gateway: GatewayConfig,
    /// The replicas: KV pool and tiers, batch limits, watchdog, the sim engine's models.
    pub worker: WorkerConfig,
    /// Placement.
    pub router: RouterConfig,
    /// Batch forming beyond `worker`'s limits.
    pub scheduler: SchedulerSection,
    /// Disaggregated prefill and decode.
    pub disagg: DisaggConfig,
    /// The planner in the loop (`flotilla sim --planner`).
    pub planner: PlannerConfig,
    /// Priority classes.
    pub priority: PriorityConfig,
}

impl SimConfig {
    /// The router's placement settings (`router.*` with the workers' block size), as the
    /// live node's `Config::selector_config`.
    pub fn selector_config(&self) -> crate::request_plane::router::policy::SelectorConfig {
        self.router.selector_config(self.worker.block_size_tokens)
    }

    /// The router's session table, empty, with its bounds.
    pub fn session_table(&self) -> crate::request_plane::router::policy::session::SessionTable {
        self.router.session_table()
    }

    /// Gateway admission (`gateway.busy_kv_ratio`, `busy_waiting`, `max_in_flight`,
    /// `ttft_target_ms`).
    pub fn admission(&self) -> crate::request_plane::admission::Admission {
        self.gateway.admission()
    }

    /// Migration bounds of a request (`gateway.migration_*`).
    pub fn migration_policy(&self) -> crate::request_plane::migration::MigrationPolicy {
        self.gateway.migration_policy()
    }

    /// A replica's batch limits, the model's context `model_context` (tokens) capping
    /// `worker.max_model_len_tokens`.
    pub fn scheduler_config(
        &self,
        model_context: usize,
    ) -> crate::worker::scheduler::SchedulerConfig {
        self.worker.scheduler_config(&self.scheduler, model_context)
    }

    /// The lower KV tiers of each replica.
    pub fn tier_config(&self) -> crate::kv::TierConfig {
        self.worker.tier_config()
    }

    /// A replica's side of peer pulls (`None` when off); `sim`: the estimate is the modelled
    /// transfer's.
    pub fn peer_pull_worker(&self, sim: bool) -> Option<crate::worker::scheduler::PeerPullWorker> {
        self.worker.peer_pull_worker(sim)
    }

    /// The sim engine's model of copies between KV tiers.
    pub fn sim_tier_links(&self) -> crate::worker::scheduler::SimTierLinks {
        self.worker.sim_tier_links()
    }

    /// The sim engine's modelled KV transfer.
    pub fn sim_transfer(&self) -> crate::worker::scheduler::SimTransfer {
        self.worker.sim_transfer()
    }
}
