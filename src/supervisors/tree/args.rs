//! Configuration → actor arguments: everything the tree's children are started with, built
//! from the node's [`NodeContext`]. No actor is named or spawned here (see `spawn.rs`).

use crate::actors::chaos::FaultFilters;
use crate::actors::discovery::DiscoveryArgs;
use crate::actors::gateway::GatewayArgs;
use crate::actors::gateway::conn::ConnLimits;
use crate::actors::gateway::routes::GatewayShared;
use crate::actors::gateway::state::ChaosController;
use crate::actors::gateway::state::FaceInfo;
use crate::actors::gateway::state::Serving;
use crate::actors::router::RouterArgs;
use crate::control::discovery::membership::Leases;
use crate::model::LoadedModel;
use crate::node::context::NodeContext;
use crate::request_plane::token_sink::SinkRegistry;
use crate::runtime::ids::WorkerId;
use crate::runtime::role::NodeRole;
use crate::runtime::supervision::{Shutdown, SupervisorFlags};
use crate::worker::engine::EngineConfig;
use crate::worker::engine::sim::SimProfile;
use crate::worker::scheduler::{DisaggWorker, SchedulerConfig, SimTransfer};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// How long each child is given to stop (`supervision.shutdown_timeout_ms`).
pub(super) fn shutdown(ctx: &NodeContext) -> Shutdown {
    Shutdown::Timeout(Duration::from_millis(
        ctx.config.supervision.shutdown_timeout_ms,
    ))
}

/// Discovery: membership leases, heartbeats and seeds.
pub(super) fn discovery(ctx: &NodeContext) -> DiscoveryArgs {
    let c = &ctx.config.cluster;
    DiscoveryArgs {
        node_id: ctx.node_id.clone(),
        addr: ctx.cluster.addr.to_string(),
        roles: ctx.config.node.roles.clone(),
        incarnation: ctx.incarnation,
        http_addr: ctx.http_addr.clone(),
        leases: Leases {
            suspect_after: Duration::from_millis(c.suspect_after_ms),
            down_after: Duration::from_millis(c.liveness_timeout_ms),
            retention: Duration::from_millis(c.down_retention_ms),
        },
        heartbeat_interval: c.heartbeat_interval(),
        seeds: ctx.config.node.join.clone(),
        server: ctx.cluster.server.clone(),
        events: ctx.membership.clone(),
        clock: ctx.clock.clone(),
        worker_pool_name: ctx.name("worker_pool"),
        external_pool_name: ctx.name("external_workers"),
        stats: ctx.stats.clone(),
        fleet: ctx.fleet.clone(),
        transport: ctx.transport.clone(),
        endpoints: ctx.endpoints.clone(),
        worker_stats: ctx.worker_stats.clone(),
        planner: ctx.planner.clone(),
        bus: ctx.events.clone(),
        lease: crate::control::leadership::LeaseConfig::from_liveness(c.liveness_timeout_ms),
    }
}

/// The router's placement policy (on the system clock and the live schedulers' group).
pub(super) fn router(ctx: &NodeContext) -> RouterArgs {
    let mut args = RouterArgs::new(ctx.config.selector_config());
    args.disagg = (&ctx.config.disagg).into();
    // Only a gateway on this node with a TTFT target reads them (admission.rs).
    args.queues = (ctx.config.has_role(NodeRole::Gateway)
        && ctx.config.gateway.ttft_target_ms.is_some())
    .then(|| ctx.prefill_queues.clone());
    args.bus = ctx.events.clone();
    args.relay = Some(ctx.name("kv_event_relay"));
    args.share_load = ctx.config.router.share_load;
    args.sessions = ctx.config.session_table();
    args
}

/// What the gateway's children share: the token sink's registry (also read by the HTTP
/// actors' serving state) and the HTTP actors' arguments.
pub(super) struct GatewayParts {
    /// Per-request token senders, filled by the HTTP actors and read by the token sink.
    pub registry: SinkRegistry,
    /// The gateway's HTTP actor's arguments (`None` on a node without the gateway role).
    pub http: Option<GatewayArgs>,
    /// The replicas' own faces (`worker.http`): `(k, arguments)`.
    pub faces: Vec<(u32, GatewayArgs)>,
}

/// The gateway's serving state, admission, migration policy and HTTP limits.
pub(super) fn gateway(ctx: &NodeContext) -> GatewayParts {
    let g = &ctx.config.gateway;
    let registry = SinkRegistry::default();
    let serving = ctx.frontend.as_ref().map(|fe| {
        Arc::new(Serving {
            frontend: fe.clone(),
            node: ctx.node_id.clone(),
            registry: registry.clone(),
            request_sup: ctx.name("request_sup"),
            next_id: Arc::new(AtomicU64::new(first_request_id(ctx.incarnation))),
            block_size: ctx.config.worker.block_size_tokens,
            migration: ctx.config.migration_policy(),
            clock: ctx.clock.clone(),
            incarnation: ctx.incarnation,
            keep_alive: Duration::from_millis(g.keep_alive_ms),
            cold_start_timeout: Duration::from_millis(g.cold_start_timeout_ms),
            admission: ctx.config.admission(),
            priority: Arc::new(ctx.config.priority.clone()),
            pin: None,
            bus: ctx.events.clone(),
            sessions: crate::actors::gateway::session::SessionKeys::new(
                &g.session_headers,
                g.session_from_user,
            ),
        })
    });
    let chaos = ctx
        .config
        .chaos
        .enabled
        .then(|| Arc::new(ChaosController::new(ctx.config.chaos.token.clone())));
    let shared = Arc::new(GatewayShared {
        discovery_name: ctx.name("discovery"),
        metrics: crate::runtime::metrics::handle(),
        max_body_bytes: g.max_body_bytes,
        request_body_timeout: Duration::from_millis(g.request_body_timeout_ms),
        http_addr: g.http_addr,
        serving,
        chaos,
        stats: ctx.stats.clone(),
        fleet: ctx.fleet.clone(),
        prefill_queues: ctx.prefill_queues.clone(),
        face: None,
        bus: ctx.events.clone(),
    });
    let faces = faces(ctx, &shared);
    let http = ctx.config.has_role(NodeRole::Gateway).then(|| GatewayArgs {
        addr: g.http_addr,
        bound: ctx.http_addr.clone(),
        shared,
        limits: ConnLimits::from(g),
    });
    GatewayParts {
        registry,
        http,
        faces,
    }
}

/// Each replica's own face (`worker.http`, port + k): the gateway's routes state with the
/// requests pinned to that replica (`gateway/face.rs`).
fn faces(ctx: &NodeContext, gateway: &Arc<GatewayShared>) -> Vec<(u32, GatewayArgs)> {
    let w = &ctx.config.worker;
    let (Some(base), Some(serving)) = (w.http, gateway.serving.as_ref()) else {
        return Vec::new();
    };
    if !ctx.config.has_role(NodeRole::Worker) || ctx.model.is_none() {
        return Vec::new();
    }
    (0..w.replicas)
        .map(|k| {
            let worker = WorkerId::new(ctx.name(&format!("replica-{k}")));
            let ends = ctx.endpoints.entry(worker.as_str());
            let addr = crate::node::config::WorkerConfig::replica_addr(base, k);
            let serving = Arc::new(Serving {
                pin: Some(worker.clone()),
                ..serving.as_ref().clone()
            });
            let shared = Arc::new(GatewayShared {
                discovery_name: gateway.discovery_name.clone(),
                metrics: gateway.metrics.clone(),
                max_body_bytes: gateway.max_body_bytes,
                request_body_timeout: gateway.request_body_timeout,
                http_addr: addr,
                serving: Some(serving),
                chaos: None,
                stats: gateway.stats.clone(),
                fleet: gateway.fleet.clone(),
                prefill_queues: gateway.prefill_queues.clone(),
                bus: gateway.bus.clone(),
                face: Some(Arc::new(FaceInfo {
                    worker,
                    block_size: w.block_size_tokens,
                    kv_events: ends.kv_events.clone(),
                    model_path: w
                        .model_path
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                })),
            });
            let args = GatewayArgs {
                addr,
                bound: ends.http,
                shared,
                limits: ConnLimits::from(&ctx.config.gateway),
            };
            (k, args)
        })
        .collect()
}

/// Replica `k` of this node (`<node>/replica-<k>`), or `None` when the node has no model
/// loaded (a node without the worker role never asks).
pub(super) fn replica(ctx: &NodeContext, k: u32, flags: SupervisorFlags) -> Option<ReplicaParams> {
    let w = &ctx.config.worker;
    let model = ctx.model.as_ref()?;
    Some(ReplicaParams {
        worker: WorkerId::new(ctx.name(&format!("replica-{k}"))),
        model: model.clone(),
        engine: EngineConfig {
            num_blocks: w.kv_blocks_with(ctx.sim_profile.as_ref()),
            block_size: w.block_size_tokens,
            device: match ctx.device {
                crate::kernels::Device::Cuda {
                    precision,
                    cpu_fallback,
                    ..
                } => crate::kernels::Device::Cuda {
                    ordinal: k as usize % ctx.gpus.max(1),
                    precision,
                    cpu_fallback,
                },
                other => other,
            },
        },
        scheduler: ctx.config.scheduler_config(model.config().max_context),
        flags,
        shutdown: shutdown(ctx),
        faults: ctx.fault_filters.clone(),
        step_timeout: Duration::from_millis(w.step_timeout_ms),
        canary_interval: Duration::from_millis(w.canary_interval_ms),
        owner_grace: Duration::from_millis(ctx.config.cluster.liveness_timeout_ms),
        sim: ctx.sim_profile.clone().map(|p| (p, w.sim_speedup)),
        stats: ctx.stats.clone(),
        board: ctx.worker_stats.clone(),
        clock: ctx.clock.clone(),
        bus: ctx.events.clone(),
        transport: ctx.transport.clone(),
        role: if k < w.prefill_replicas {
            crate::runtime::role::Role::Prefill
        } else {
            w.role
        },
        disagg: DisaggWorker::from(&ctx.config.disagg),
        kv_events: w
            .kv_events_addr
            .map(|base| crate::actors::kv_publisher::VllmEventsConfig {
                addr: crate::node::config::WorkerConfig::replica_addr(base, k),
                block_size: w.block_size_tokens as u32,
                layout: w.kv_events_layout,
                bound: ctx
                    .endpoints
                    .entry(&ctx.name(&format!("replica-{k}")))
                    .kv_events,
            }),
        sim_transfer: ctx.sim_profile.is_some().then(|| ctx.config.sim_transfer()),
        peer_pull: ctx.config.peer_pull_worker(ctx.sim_profile.is_some()),
        tiers: ctx.config.tier_config(),
        tier_links: ctx
            .sim_profile
            .is_some()
            .then(|| ctx.config.sim_tier_links()),
        kv_region: Default::default(),
        kv_disk_dir: w.kv_disk_dir.clone(),
    })
}

/// What one replica needs.
#[derive(Clone)]
pub struct ReplicaParams {
    /// Worker id; also the replica supervisor's registered name and the prefix of its
    /// children's names (`<worker>/kv_publisher`, `<worker>/engine`, `<worker>/scheduler`).
    pub worker: WorkerId,
    /// The model, shared read-only by every replica of the process.
    pub model: Arc<LoadedModel>,
    /// KV pool geometry.
    pub engine: EngineConfig,
    /// Batch limits.
    pub scheduler: SchedulerConfig,
    /// The replica supervisor's flags (one_for_all: its parts share device memory).
    pub flags: SupervisorFlags,
    /// Shutdown of each part.
    pub shutdown: Shutdown,
    /// The filters of the faults injected on this node (its parts read their own).
    pub faults: FaultFilters,
    /// How long sequences' owner may be missing before they are aborted
    /// (`cluster.liveness_timeout_ms`).
    pub owner_grace: Duration,
    /// Step watchdog timeout (`worker.step_timeout_ms`).
    pub step_timeout: Duration,
    /// Canary period (`worker.canary_interval_ms`).
    pub canary_interval: Duration,
    /// `Some((profile, speedup))`: a simulated engine instead of the real one.
    pub sim: Option<(SimProfile, f64)>,
    /// The node's resilience counters (restarts, engine hangs).
    pub stats: Arc<crate::runtime::resilience::NodeStats>,
    /// Where the scheduler publishes its stats (the node's board).
    pub board: crate::worker::scheduler::StatsBoard,
    /// The node's clock.
    pub clock: crate::runtime::clock::SharedClock,
    /// The node's fleet event bus.
    pub bus: crate::request_plane::events::EventBus,
    /// The node's KV transport: the engine allocates and registers its pools through it.
    pub transport: Option<Arc<crate::transport::Transport>>,
    /// The replica's role at start (`worker.role`).
    pub role: crate::runtime::role::Role,
    /// Disaggregation settings (`disagg.*`).
    pub disagg: DisaggWorker,
    /// On a simulated engine: the modelled KV transfer.
    pub sim_transfer: Option<SimTransfer>,
    /// Peer pulls (`worker.peer_pulls`): the cost rule's settings, `None` when off.
    pub peer_pull: Option<crate::worker::scheduler::PeerPullWorker>,
    /// The pool's lower KV tiers (`worker.kv_host_blocks`, `kv_disk_*`).
    pub tiers: crate::kv::TierConfig,
    /// On a simulated engine: the modelled speed of copies between tiers.
    pub tier_links: Option<crate::worker::scheduler::SimTierLinks>,
    /// The engine's KV memory, for the tier copier (filled by the engine at start).
    pub kv_region: crate::worker::tiers::KvRegionSlot,
    /// G3's directory on a real engine (`worker.kv_disk_dir`).
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Publish the KV events in vLLM's format too (`worker.kv_events_addr`).
    pub kv_events: Option<crate::actors::kv_publisher::VllmEventsConfig>,
}

impl ReplicaParams {
    /// Registered name of the replica's part `part` (`kv_publisher`, `engine`, `scheduler`).
    pub fn part_name(&self, part: &str) -> String {
        format!("{}/{part}", self.worker)
    }
}

/// The first request id of a gateway incarnation: the incarnation (ms since the Unix epoch)
/// times 2^20, so that ids never repeat across restarts of a node (a node would have to take
/// over a million requests per millisecond of its life to reach the next start's ids).
pub fn first_request_id(incarnation: u64) -> u64 {
    incarnation.saturating_mul(1 << 20).max(1)
}
