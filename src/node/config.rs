//! One typed configuration tree: the composition of the planes' sections.
//!
//! Sources, lowest precedence first: built-in defaults → a TOML file (`--config PATH` or
//! `FLOTILLA_CONFIG`) → environment variables `FLOTILLA_<SECTION>__<FIELD>` (for example
//! `FLOTILLA_CLUSTER__LIVENESS_TIMEOUT_MS=5000`) → command-line flags (`--set
//! section.field=value` and the named flags, each a figment key path). Units are in field
//! names; every section has a `Default`; [`Config::validate`] runs once at start and names
//! the offending field.
//!
//! Each section lives in the plane that reads it, with its `Default` and its own `validate`
//! (`[cluster]`: `control/discovery/config.rs`; `[gateway]`: `request_plane/gateway.rs`;
//! `[router]`: `request_plane/router/config.rs`; `[worker]`: `worker/config.rs`;
//! `[scheduler]`, `[disagg]`: `worker/scheduler/config.rs`; `[planner]`:
//! `control/planner.rs`; `[priority]`: `request_plane/priority.rs`; `[transport]`:
//! `transport/mod.rs`; `[supervision]`: `supervisors/config.rs`; `[chaos]`:
//! `actors/gateway/chaos_routes.rs`). This file holds the tree, `[node]` (the node itself),
//! the loading, the rules that span sections, and the settings built from several sections.

use crate::actors::gateway::chaos_routes::ChaosConfig;
use crate::control::discovery::config::ClusterConfig;
use crate::control::planner::PlannerConfig;
use crate::request_plane::gateway::GatewayConfig;
use crate::request_plane::priority::PriorityConfig;
use crate::request_plane::router::config::RouterConfig;
pub use crate::runtime::config::ConfigError;
pub use crate::runtime::role::NodeRole;
use crate::supervisors::config::SupervisionConfig;
use crate::transport::TransportConfig;
use crate::worker::config::{EngineKind, WorkerConfig};
#[doc(no_inline)]
pub use crate::worker::external::ExternalWorkerConfig;
use crate::worker::scheduler::config::{DisaggConfig, SchedulerSection};
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::Path;

/// The whole configuration.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// This node.
    pub node: NodeConfig,
    /// Cluster membership and liveness.
    pub cluster: ClusterConfig,
    /// HTTP gateway.
    pub gateway: GatewayConfig,
    /// Supervision budgets.
    pub supervision: SupervisionConfig,
    /// Worker nodes.
    pub worker: WorkerConfig,
    /// The chaos API.
    pub chaos: ChaosConfig,
    /// Request placement.
    pub router: RouterConfig,
    /// KV transfer between nodes (`src/transport/`).
    pub transport: TransportConfig,
    /// Batch forming on each replica, beyond `worker`'s limits.
    pub scheduler: SchedulerSection,
    /// Disaggregated prefill and decode (used when some replicas have `worker.role` prefill
    /// or decode).
    pub disagg: DisaggConfig,
    /// Pool sizing (`control/planner.rs`): read by `flotilla sim --planner` today.
    pub planner: PlannerConfig,
    /// Priority classes with fair shares (`request_plane/priority.rs`): read by gateways
    /// (a request's class, shedding by class) and `flotilla sim`.
    pub priority: PriorityConfig,
}

/// This node's identity and place in the cluster.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Node name, unique in the cluster; defaults to `node@<listen_addr>`.
    pub name: Option<String>,
    /// Cluster listen address (TCP).
    pub listen_addr: SocketAddr,
    /// Seed nodes to join (`host:port`); empty for the first node.
    pub join: Vec<String>,
    /// Roles this node runs.
    pub roles: Vec<NodeRole>,
    /// Shared secret every node of the cluster must present (challenge/response; never sent).
    pub cookie: String,
    /// Drain on SIGTERM: the node leaves routing at once, in-flight requests get this long to
    /// finish, the rest migrate, then the node stops (ms). `flotilla up` gives its nodes
    /// `launcher::STOP_GRACE` (60 s) in all before it kills them.
    pub drain_grace_ms: u64,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            name: None,
            listen_addr: "127.0.0.1:7070".parse().expect("static address"),
            join: Vec::new(),
            roles: vec![NodeRole::Gateway, NodeRole::Router, NodeRole::Worker],
            cookie: String::new(),
            drain_grace_ms: 30_000,
        }
    }
}

impl NodeConfig {
    /// The effective node name.
    pub fn name(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("node@{}", self.listen_addr))
    }
}

impl NodeConfig {
    /// Check that the node runs something and has the cluster's cookie.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `node.roles` or `node.cookie`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.roles.is_empty() {
            return Err(ConfigError::invalid(
                "node.roles",
                "at least one role is required",
            ));
        }
        if self.cookie.is_empty() {
            return Err(ConfigError::invalid(
                "node.cookie",
                "a cluster cookie is required (--cookie or FLOTILLA_NODE__COOKIE)",
            ));
        }
        Ok(())
    }
}

impl Config {
    /// Load defaults → `file` (if any) → `FLOTILLA_*` env → `overrides` (flags, as a partial
    /// tree), then validate.
    ///
    /// # Errors
    /// See [`Config::load_with`].
    pub fn load(file: Option<&Path>, overrides: serde_json::Value) -> Result<Self, ConfigError> {
        Self::load_with(file, Serialized::defaults(overrides))
    }

    /// [`Config::load`] with the overrides as any figment provider (the command line builds
    /// them from dotted key paths: `Serialized::default("node.name", …)`).
    ///
    /// # Errors
    /// `file` does not exist; a source cannot be read or parsed, or has a value of the wrong
    /// type or an unknown field ([`ConfigError::Load`]); a value fails [`Config::validate`].
    pub fn load_with(
        file: Option<&Path>,
        overrides: impl figment::Provider,
    ) -> Result<Self, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            if !path.exists() {
                return Err(ConfigError::invalid(
                    "--config",
                    format!("file {} does not exist", path.display()),
                ));
            }
            fig = fig.merge(Toml::file(path));
        }
        // Only `SECTION__FIELD` variables belong to the tree; FLOTILLA_MODEL, FLOTILLA_CONFIG
        // and friends are read by the CLI itself.
        fig = fig.merge(
            Env::prefixed("FLOTILLA_")
                .filter(|k| k.as_str().contains("__"))
                .split("__"),
        );
        fig = fig.merge(overrides);
        let cfg: Config = fig.extract().map_err(Box::new)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Check every section (each with its own `validate`), then the rules that span
    /// sections.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first field that is out of range or
    /// inconsistent with another.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.cluster.validate()?;
        // Read by router nodes only, like the rest of `router.*` (so one `--set` can go to
        // every node of `flotilla up`); a router node needs the gateway's model too.
        if !self.router.external_workers.is_empty()
            && self.has_role(NodeRole::Router)
            && !self.has_role(NodeRole::Gateway)
        {
            return Err(ConfigError::invalid(
                "router.external_workers",
                "a router node that starts external workers needs the gateway role too (the \
                 gateway's model gives the block-hash salt and end-of-sequence tokens)",
            ));
        }
        self.router.validate()?;
        self.node.validate()?;
        self.worker.validate()?;
        self.disagg.validate()?;
        self.priority.validate()?;
        self.planner.validate()?;
        if self.has_role(NodeRole::Planner)
            && self.planner.capacity_profile.is_none()
            && self.worker.engine != EngineKind::Sim
        {
            return Err(ConfigError::invalid(
                "planner.capacity_profile",
                "the planner role needs one replica's capacity curves with worker.engine = \
                 \"cpu\": write them with `flotilla profile --capacity-out capacity-cpu.json`",
            ));
        }
        if self.chaos.enabled
            && !self.gateway.http_addr.ip().is_loopback()
            && self.chaos.token.as_deref().is_none_or(str::is_empty)
        {
            return Err(ConfigError::invalid(
                "chaos.token",
                "required when chaos.enabled and the gateway listens beyond loopback",
            ));
        }
        self.gateway.validate()?;
        self.supervision.validate()?;
        Ok(())
    }

    /// The router's placement settings (`router.*` with the workers' block size).
    pub fn selector_config(&self) -> crate::request_plane::router::policy::SelectorConfig {
        self.router.selector_config(self.worker.block_size_tokens)
    }

    /// The router's session table, empty, with its bounds (`router.session_capacity`,
    /// `router.session_ttl_ms`).
    pub fn session_table(&self) -> crate::request_plane::router::policy::session::SessionTable {
        self.router.session_table()
    }

    /// Gateway admission (`gateway.busy_kv_ratio`, `busy_waiting`, `max_in_flight`,
    /// `ttft_target_ms`): what a live gateway and `flotilla sim` both judge requests by.
    pub fn admission(&self) -> crate::request_plane::admission::Admission {
        self.gateway.admission()
    }

    /// Migration bounds of a request (`gateway.migration_*`).
    pub fn migration_policy(&self) -> crate::request_plane::migration::MigrationPolicy {
        self.gateway.migration_policy()
    }

    /// A replica's batch limits (`worker.max_num_seqs`, `max_num_batched_tokens`,
    /// `max_model_len_tokens` capped by the model's context `model_context` in tokens, and
    /// `scheduler.max_decode_stall_ms`, `scheduler.resume_gather_ms`).
    pub fn scheduler_config(
        &self,
        model_context: usize,
    ) -> crate::worker::scheduler::SchedulerConfig {
        self.worker.scheduler_config(&self.scheduler, model_context)
    }

    /// The lower KV tiers of each replica (`worker.kv_host_blocks`, `kv_disk_*`).
    pub fn tier_config(&self) -> crate::kv::TierConfig {
        self.worker.tier_config()
    }

    /// A replica's side of peer pulls (`worker.peer_pulls`, `pull_block_ms`,
    /// `pull_ask_timeout_ms`); on the sim engine (`sim`) the pull estimate is the modelled
    /// transfer's. `None` when off.
    pub fn peer_pull_worker(&self, sim: bool) -> Option<crate::worker::scheduler::PeerPullWorker> {
        self.worker.peer_pull_worker(sim)
    }

    /// The sim engine's model of copies between KV tiers.
    pub fn sim_tier_links(&self) -> crate::worker::scheduler::SimTierLinks {
        self.worker.sim_tier_links()
    }

    /// The sim engine's modelled KV transfer (`worker.sim_transfer_*`,
    /// `sim_kv_bytes_per_token`, `sim_speedup`).
    pub fn sim_transfer(&self) -> crate::worker::scheduler::SimTransfer {
        self.worker.sim_transfer()
    }

    /// Whether this node runs `role`.
    pub fn has_role(&self, role: NodeRole) -> bool {
        self.node.roles.contains(&role)
    }

    /// One replica's capacity curves for the planner: `planner.capacity_profile` when set,
    /// else derived from the sim engine's profile (`profile`: `worker.sim_profile` or the
    /// built-in one) with the scheduler's limits at the planner's targets.
    ///
    /// # Errors
    /// The file cannot be read or is not a profile; or no file is set and the workers run
    /// the CPU engine (no profile to derive one from).
    pub fn planner_capacity(
        &self,
        profile: Option<&crate::worker::engine::sim::SimProfile>,
    ) -> Result<crate::control::planner::CapacityProfile, ConfigError> {
        use crate::control::planner::CapacityProfile;
        let p = &self.planner;
        if let Some(path) = &p.capacity_profile {
            return CapacityProfile::load(path)
                .map_err(|e| ConfigError::invalid("planner.capacity_profile", e.to_string()));
        }
        let Some(profile) = profile.filter(|_| self.worker.engine == EngineKind::Sim) else {
            return Err(ConfigError::invalid(
                "planner.capacity_profile",
                "required with worker.engine = \"cpu\": write one with `flotilla profile \
                 --capacity-out capacity-cpu.json` (or run the sim engine, whose profile \
                 gives one)",
            ));
        };
        let w = &self.worker;
        let blocks = w.kv_blocks_with(Some(profile));
        Ok(profile.capacity(
            w.sim_speedup,
            blocks * w.block_size_tokens,
            w.max_num_seqs,
            w.max_num_batched_tokens,
            p.ttft_target_ms,
            p.itl_target_ms,
        ))
    }
}

/// The sections a simulated fleet reads, as this configuration gives them (`flotilla sim`
/// loads the node's configuration: `--config`, the environment, `--set`).
impl From<&Config> for crate::sim::SimConfig {
    fn from(c: &Config) -> Self {
        Self {
            cluster: c.cluster.clone(),
            gateway: c.gateway.clone(),
            worker: c.worker.clone(),
            router: c.router.clone(),
            scheduler: c.scheduler.clone(),
            disagg: c.disagg.clone(),
            planner: c.planner.clone(),
            priority: c.priority.clone(),
        }
    }
}

pub mod reference;

#[cfg(test)]
mod tests;
