//! What the node's supervision tree is started with ([`NodeTreeArgs`]), built from the
//! configuration and the node's shared parts ([`NodeContext`]): the composition root's half of
//! the tree; the tree itself (`supervisors/tree.rs`) never reads the configuration.

use crate::actors::discovery::DiscoveryArgs;
use crate::actors::gateway::GatewayArgs;
use crate::actors::gateway::conn::ConnLimits;
use crate::actors::gateway::routes::GatewayShared;
use crate::actors::gateway::state::ChaosController;
use crate::actors::gateway::state::FaceInfo;
use crate::actors::gateway::state::Serving;
use crate::actors::router::{ProcessGroups, RouterArgs, RouterCoreArgs};
use crate::control::discovery::membership::Leases;
use crate::node::context::NodeContext;
use crate::request_plane::token_sink::SinkRegistry;
use crate::runtime::ids::WorkerId;
use crate::runtime::role::NodeRole;
use crate::runtime::supervision::{Shutdown, Strategy, SupervisorFlags};
use crate::supervisors::tree::{
    Budgets, GatewayParts, NodeTreeArgs, REPLICA_BUDGET, ReplicaParams,
};
use crate::worker::engine::EngineConfig;
use crate::worker::scheduler::DisaggWorker;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The tree's arguments for this node.
pub fn node_tree_args(ctx: &NodeContext) -> NodeTreeArgs {
    let s = &ctx.config.supervision;
    let budgets = Budgets {
        node: (s.node_max_restarts, Duration::from_millis(s.node_period_ms)),
        inner: (s.max_restarts, Duration::from_millis(s.period_ms)),
        backoff_base: Duration::from_millis(s.backoff_base_ms),
        backoff_max: Duration::from_millis(s.backoff_max_ms),
    };
    let faces = ctx.config.has_role(NodeRole::Worker) && ctx.config.worker.http.is_some();
    let replica_flags = budgets.flags(Strategy::OneForAll, REPLICA_BUDGET);
    NodeTreeArgs {
        prefix: ctx.prefix.clone(),
        node_id: ctx.node_id.clone(),
        incarnation: ctx.incarnation,
        stats: ctx.stats.clone(),
        budgets,
        shutdown: shutdown(ctx),
        discovery: discovery(ctx),
        chaos: (
            ctx.faults.clone(),
            ctx.fault_filters.clone(),
            ctx.cluster.clone(),
            ctx.clock.clone(),
            ctx.events.clone(),
        ),
        fault_filters: ctx.fault_filters.clone(),
        router: ctx.config.has_role(NodeRole::Router).then(|| router(ctx)),
        external: external(ctx),
        gateway: (ctx.config.has_role(NodeRole::Gateway) || faces).then(|| gateway(ctx)),
        transport: ctx.transport.clone(),
        replicas: ctx.config.has_role(NodeRole::Worker).then(|| {
            (0..ctx.config.worker.replicas)
                .map(|k| replica(ctx, k, replica_flags))
                .collect()
        }),
        planner: planner(ctx),
    }
}

/// The planner (role `planner`, with its capacity curves resolved at start).
fn planner(ctx: &NodeContext) -> Option<crate::actors::planner::PlannerArgs> {
    let capacity = ctx.planner_capacity.clone()?;
    Some(crate::actors::planner::PlannerArgs {
        config: ctx.config.planner.clone(),
        capacity,
        fleet: ctx.fleet.clone(),
        board: ctx.planner.clone(),
        clock: ctx.clock.clone(),
        node: ctx.node_id.clone(),
        lease: crate::control::leadership::LeaseConfig::from_liveness(
            ctx.config.cluster.liveness_timeout_ms,
        ),
        liveness_ms: ctx.config.cluster.liveness_timeout_ms,
    })
}

/// The external engines of `router.external_workers`, each as a worker of this node (none
/// without any, without the router role, or without the gateway's model to hash and stop
/// with).
fn external(ctx: &NodeContext) -> Vec<crate::worker::external::ExternalArgs> {
    let ext = &ctx.config.router.external_workers;
    if ext.is_empty() || !ctx.config.has_role(NodeRole::Router) {
        return Vec::new();
    }
    let Some(frontend) = &ctx.frontend else {
        tracing::error!(
            "router.external_workers: no model on this node; external engines not started"
        );
        return Vec::new();
    };
    ext.iter()
        .map(|e| {
            let worker = WorkerId::new(format!("{}{}", ctx.prefix, e.name));
            crate::worker::external::ExternalArgs {
                kv_publisher_name: format!("{worker}/kv_publisher"),
                worker,
                config: e.clone(),
                block_size: ctx.config.worker.block_size_tokens as u32,
                salt: frontend.salt,
                eos_ids: frontend.tokenizer.eos_ids.clone(),
                board: ctx.worker_stats.clone(),
            }
        })
        .collect()
}

/// How long each child is given to stop (`supervision.shutdown_timeout_ms`).
fn shutdown(ctx: &NodeContext) -> Shutdown {
    Shutdown::Timeout(Duration::from_millis(
        ctx.config.supervision.shutdown_timeout_ms,
    ))
}

/// Discovery: membership leases, heartbeats and seeds.
fn discovery(ctx: &NodeContext) -> DiscoveryArgs {
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
fn router(ctx: &NodeContext) -> RouterArgs {
    let mut core = RouterCoreArgs::new(ctx.config.selector_config(), Arc::new(ProcessGroups));
    core.disagg = (&ctx.config.disagg).into();
    // Only a gateway on this node with a TTFT target reads them (admission.rs).
    core.queues = (ctx.config.has_role(NodeRole::Gateway)
        && ctx.config.gateway.ttft_target_ms.is_some())
    .then(|| ctx.prefill_queues.clone());
    core.share_load = ctx.config.router.share_load;
    core.sessions = ctx.config.session_table();
    RouterArgs {
        core,
        bus: ctx.events.clone(),
        relay: Some(ctx.name("kv_event_relay")),
    }
}

/// The gateway's serving state, admission, migration policy and HTTP limits.
fn gateway(ctx: &NodeContext) -> GatewayParts {
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
        page_history: Default::default(),
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
            let addr = crate::worker::config::WorkerConfig::replica_addr(base, k);
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
                page_history: Default::default(),
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
fn replica(ctx: &NodeContext, k: u32, flags: SupervisorFlags) -> Option<ReplicaParams> {
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
                addr: crate::worker::config::WorkerConfig::replica_addr(base, k),
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

/// The first request id of a gateway incarnation: the incarnation (ms since the Unix epoch)
/// times 2^20, so that ids never repeat across restarts of a node (a node would have to take
/// over a million requests per millisecond of its life to reach the next start's ids).
pub fn first_request_id(incarnation: u64) -> u64 {
    incarnation.saturating_mul(1 << 20).max(1)
}
