//! This node's supervision tree, as data (DESIGN.md §3). Roles select the branches.
//!
//! ```text
//! node                 one_for_one, supervision.node_max_restarts in node_period_ms → node exits non-zero
//! ├─ discovery         permanent   membership, heartbeats, liveness, pg groups per role
//! ├─ chaos             permanent   installs and clears injected faults on this node
//! ├─ router            (router)    placement: KV-aware (prefix index + load), KV event relay
//! ├─ gateway_sup       (gateway)   one_for_one
//! │  ├─ token_sink     permanent   receives this node's requests' tokens, one message per step
//! │  ├─ request_sup    permanent   one temporary Request child per in-flight request
//! │  └─ http_gateway   permanent   axum: OpenAI API, /live /health /metrics /v1/fleet
//! │                                (starts last, stops first)
//! └─ worker_pool       (worker)    one_for_one
//!    └─ replica-<k>    ×worker.replicas, one_for_all (the parts share device memory)
//!       ├─ kv_manager  KV events out to subscribers, snapshots
//!       ├─ engine      weights (shared per process) + this replica's KV pools
//!       └─ scheduler   continuous batching over the block pool; drives the engine
//! ```
//! Actor names are registered per node (prefixed by `NodeContext::prefix`, empty in a real
//! node process) and are what `/v1/fleet` lists.

use super::spec::{ChildSpec, Strategy, SupervisorFlags, SupervisorSpec};
use crate::control::chaos::{Chaos, FaultBook};
use crate::control::discovery::{Discovery, DiscoveryArgs};
use crate::kv::KvEventPublisher;
use crate::model::LoadedModel;
use crate::request_plane::gateway::admission::Admission;
use crate::request_plane::gateway::chaos_routes::ChaosController;
use crate::request_plane::gateway::routes::GatewayShared;
use crate::request_plane::gateway::serve::Serving;
use crate::request_plane::gateway::{GatewayArgs, HttpGateway};
use crate::request_plane::protocol::{Owner, sink_name};
use crate::request_plane::router::{Router, RouterArgs};
use crate::request_plane::token_sink::{SinkRegistry, TokenSink};
use crate::runtime::config::Role;
use crate::runtime::context::NodeContext;
use crate::runtime::ids::WorkerId;
use crate::worker::engine::sim::{SimEngine, SimEngineArgs, SimProfile};
use crate::worker::engine::{
    ChaosArgs, ChaosEngine, EngineConfig, EngineWorker, TransformerArgs, TransformerEngine,
};
use crate::worker::scheduler::{Scheduler, SchedulerArgs, SchedulerConfig};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

fn flags(ctx: &NodeContext, strategy: Strategy) -> SupervisorFlags {
    let s = &ctx.config.supervision;
    SupervisorFlags::new(strategy, s.max_restarts, Duration::from_millis(s.period_ms)).with_backoff(
        Duration::from_millis(s.backoff_base_ms),
        Duration::from_millis(s.backoff_max_ms),
    )
}

fn shutdown(ctx: &NodeContext) -> super::Shutdown {
    super::Shutdown::Timeout(Duration::from_millis(
        ctx.config.supervision.shutdown_timeout_ms,
    ))
}

/// The whole tree of a node.
pub fn node_tree(ctx: &NodeContext) -> SupervisorSpec {
    let s = &ctx.config.supervision;
    let node_flags = SupervisorFlags::new(
        Strategy::OneForOne,
        s.node_max_restarts,
        Duration::from_millis(s.node_period_ms),
    )
    .with_backoff(
        Duration::from_millis(s.backoff_base_ms),
        Duration::from_millis(s.backoff_max_ms),
    );
    let faults = ctx.faults.clone();
    let cluster = ctx.cluster.clone();
    let chaos = ChildSpec::actor("chaos", Some(ctx.name("chaos")), move || {
        (Chaos, (faults.clone(), cluster.clone()))
    })
    .shutdown(shutdown(ctx));
    let mut node = SupervisorSpec::new(ctx.name("node"), node_flags)
        .counting(ctx.stats.clone())
        .child(discovery(ctx))
        .child(chaos);
    if ctx.config.has_role(Role::Router) {
        node = node.child(router(ctx));
    }
    if ctx.config.has_role(Role::Gateway) {
        node = node.child(ChildSpec::supervisor(gateway(ctx)));
    }
    if ctx.config.has_role(Role::Worker) {
        node = node.child(ChildSpec::supervisor(worker_pool(ctx)));
    }
    node
}

fn discovery(ctx: &NodeContext) -> ChildSpec {
    let stop = shutdown(ctx);
    let ctx = ctx.clone();
    let name = ctx.name("discovery");
    ChildSpec::actor("discovery", Some(name), move || {
        let c = &ctx.config.cluster;
        let args = DiscoveryArgs {
            node_id: ctx.node_id.clone(),
            addr: ctx.cluster.addr.to_string(),
            roles: ctx.config.node.roles.clone(),
            incarnation: ctx.incarnation,
            http_addr: ctx.http_addr.clone(),
            leases: crate::control::discovery::membership::Leases {
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
            stats: ctx.stats.clone(),
            fleet: ctx.fleet.clone(),
        };
        (Discovery, args)
    })
    .shutdown(stop)
}

fn gateway(ctx: &NodeContext) -> SupervisorSpec {
    let registry = SinkRegistry::default();
    let serving = ctx.frontend.as_ref().map(|fe| {
        Arc::new(Serving {
            frontend: fe.clone(),
            node: ctx.node_id.clone(),
            registry: registry.clone(),
            request_sup: ctx.name("request_sup"),
            next_id: Arc::new(AtomicU64::new(first_request_id(ctx.incarnation))),
            block_size: ctx.config.worker.block_size_tokens,
            migration: crate::request_plane::request::migration::MigrationPolicy {
                limit: ctx.config.gateway.migration_limit,
                deadline: Duration::from_millis(ctx.config.gateway.migration_deadline_ms),
                backoff_base: Duration::from_millis(ctx.config.gateway.migration_backoff_base_ms),
                backoff_max: Duration::from_millis(ctx.config.gateway.migration_backoff_max_ms),
            },
            clock: ctx.clock.clone(),
            incarnation: ctx.incarnation,
            keep_alive: Duration::from_millis(ctx.config.gateway.keep_alive_ms),
            admission: Admission {
                busy_kv_ratio: ctx.config.gateway.busy_kv_ratio,
                busy_waiting: ctx.config.gateway.busy_waiting,
                max_in_flight: ctx.config.gateway.max_in_flight,
            },
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
        max_body_bytes: ctx.config.gateway.max_body_bytes,
        request_body_timeout: Duration::from_millis(ctx.config.gateway.request_body_timeout_ms),
        http_addr: ctx.config.gateway.http_addr,
        serving,
        chaos,
        stats: ctx.stats.clone(),
        fleet: ctx.fleet.clone(),
    });
    let args = GatewayArgs {
        addr: ctx.config.gateway.http_addr,
        bound: ctx.http_addr.clone(),
        shared,
        limits: crate::request_plane::gateway::conn::ConnLimits::of(&ctx.config.gateway),
    };
    let incarnation = ctx.incarnation;
    let owner = Owner::new(ctx.node_id.clone(), incarnation);
    let sink = ChildSpec::actor("token_sink", Some(sink_name(&owner)), move || {
        (TokenSink, (registry.clone(), incarnation))
    })
    .shutdown(shutdown(ctx));
    let requests = SupervisorSpec::new(ctx.name("request_sup"), flags(ctx, Strategy::OneForOne))
        .counting(ctx.stats.clone());
    let http = ChildSpec::actor("http_gateway", Some(ctx.name("http_gateway")), move || {
        (HttpGateway, args.clone())
    })
    .shutdown(shutdown(ctx));
    // The listener starts last and stops first.
    SupervisorSpec::new(ctx.name("gateway_sup"), flags(ctx, Strategy::OneForOne))
        .counting(ctx.stats.clone())
        .child(sink)
        .child(ChildSpec::supervisor(requests))
        .child(http)
}

fn router(ctx: &NodeContext) -> ChildSpec {
    let r = &ctx.config.router;
    let config = crate::request_plane::router::policy::SelectorConfig {
        policy: r.policy,
        block_size: ctx.config.worker.block_size_tokens as u32,
        overlap_weight: r.overlap_weight,
        temperature: r.temperature,
        seed: r.seed,
    };
    ChildSpec::actor("router", Some(ctx.name("router")), move || {
        (Router, RouterArgs::new(config.clone()))
    })
    .shutdown(shutdown(ctx))
}

fn worker_pool(ctx: &NodeContext) -> SupervisorSpec {
    let w = &ctx.config.worker;
    let replicas = (0..w.replicas).map(|k| {
        let name = ctx.name(&format!("replica-{k}"));
        let spec = match &ctx.model {
            Some(model) => replica(ReplicaParams {
                worker: WorkerId::new(name.clone()),
                model: model.clone(),
                engine: EngineConfig {
                    num_blocks: w.kv_blocks,
                    block_size: w.block_size_tokens,
                    ..EngineConfig::default()
                },
                scheduler: SchedulerConfig {
                    max_num_seqs: w.max_num_seqs,
                    max_num_batched_tokens: w.max_num_batched_tokens,
                    max_model_len: w.max_model_len_tokens.min(model.config().max_context),
                },
                flags: flags(ctx, Strategy::OneForAll),
                shutdown: shutdown(ctx),
                faults: ctx.faults.clone(),
                step_timeout: Duration::from_millis(w.step_timeout_ms),
                canary_interval: Duration::from_millis(w.canary_interval_ms),
                owner_grace: Duration::from_millis(ctx.config.cluster.liveness_timeout_ms),
                sim: ctx.sim_profile.clone().map(|p| (p, w.sim_speedup)),
                stats: ctx.stats.clone(),
            }),
            None => SupervisorSpec::new(name, flags(ctx, Strategy::OneForAll))
                .counting(ctx.stats.clone()),
        };
        ChildSpec::supervisor(spec)
    });
    SupervisorSpec::new(ctx.name("worker_pool"), flags(ctx, Strategy::OneForOne))
        .counting(ctx.stats.clone())
        .children(replicas)
}

/// What one replica needs.
#[derive(Clone)]
pub struct ReplicaParams {
    /// Worker id; also the replica supervisor's registered name and the prefix of its
    /// children's names (`<worker>/kv_manager`, `<worker>/engine`, `<worker>/scheduler`).
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
    pub shutdown: super::Shutdown,
    /// Faults injected on this node.
    pub faults: FaultBook,
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
}

/// The model identity salted into every block hash, so that blocks of different models never
/// match: XXH3-64 of the model's configuration (architecture, shapes, vocabulary size).
pub fn model_salt(model: &LoadedModel) -> u64 {
    config_salt(model.config())
}

/// [`model_salt`] from the configuration alone (what a gateway knows from GGUF metadata).
pub fn config_salt(config: &crate::model::config::ModelConfig) -> u64 {
    xxhash_rust::xxh3::xxh3_64(format!("{config:?}").as_bytes())
}

/// A replica: KV event publisher, engine worker, scheduler, under a one_for_all supervisor.
pub fn replica(p: ReplicaParams) -> SupervisorSpec {
    let worker = p.worker.clone();
    let kv_name = format!("{worker}/kv_manager");
    let engine_name = format!("{worker}/engine");
    let sched_name = format!("{worker}/scheduler");
    let kv = {
        let w = worker.clone();
        let faults = p.faults.clone();
        ChildSpec::actor("kv_manager", Some(kv_name.clone()), move || {
            (KvEventPublisher, (w.clone(), faults.clone()))
        })
        .shutdown(p.shutdown)
    };
    let engine = match &p.sim {
        None => {
            let args = ChaosArgs {
                inner: TransformerArgs {
                    weights: p.model.weights.clone(),
                    config: p.engine,
                },
                faults: p.faults.clone(),
                worker: worker.clone(),
            };
            ChildSpec::actor("engine", Some(engine_name.clone()), move || {
                (
                    EngineWorker::<ChaosEngine<TransformerEngine>>::new(),
                    args.clone(),
                )
            })
            .shutdown(p.shutdown)
        }
        Some((profile, speedup)) => {
            let args = ChaosArgs {
                inner: SimEngineArgs {
                    profile: profile.clone(),
                    speedup: *speedup,
                    num_blocks: p.engine.num_blocks,
                    block_size: p.engine.block_size,
                    vocab_size: p.model.config().vocab_size,
                    max_context: p.model.config().max_context,
                },
                faults: p.faults.clone(),
                worker: worker.clone(),
            };
            ChildSpec::actor("engine", Some(engine_name.clone()), move || {
                (EngineWorker::<ChaosEngine<SimEngine>>::new(), args.clone())
            })
            .shutdown(p.shutdown)
        }
    };
    let scheduler = {
        let args = SchedulerArgs {
            worker: worker.clone(),
            engine_name,
            kv_publisher_name: Some(kv_name),
            config: p.scheduler,
            num_blocks: p.engine.num_blocks,
            block_size: p.engine.block_size,
            salt: model_salt(&p.model),
            eos_token_id: p.model.tokenizer.eos_ids.first().copied(),
            faults: p.faults.clone(),
            step_timeout: p.step_timeout,
            canary_interval: p.canary_interval,
            owner_grace: p.owner_grace,
            stats: p.stats.clone(),
        };
        ChildSpec::actor("scheduler", Some(sched_name), move || {
            (Scheduler, args.clone())
        })
        .shutdown(p.shutdown)
    };
    SupervisorSpec::new(worker.to_string(), p.flags)
        .counting(p.stats.clone())
        .children([kv, engine, scheduler])
}

/// The first request id of a gateway incarnation: the incarnation (ms since the Unix epoch)
/// times 2^20, so that ids never repeat across restarts of a node (a node would have to take
/// over a million requests per millisecond of its life to reach the next start's ids).
pub fn first_request_id(incarnation: u64) -> u64 {
    incarnation.saturating_mul(1 << 20).max(1)
}
