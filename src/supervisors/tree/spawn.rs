//! The tree's leaves: one [`ChildSpec`] per actor type, with the name it registers under and
//! the arguments it is (re)started with. The only place that names the actor types the tree
//! starts; what they are started with is built in `args.rs`.

use super::args::{self, GatewayParts, ReplicaParams};
use crate::actors::chaos::Chaos;
use crate::actors::discovery::Discovery;
use crate::actors::engine_worker::EngineWorker;
use crate::actors::gateway::{GatewayArgs, HttpGateway};
use crate::actors::kv_publisher::{KvEventPublisher, KvPublisherArgs};
use crate::actors::router::{KvEventsRelay, Router, RouterMsg};
use crate::actors::scheduler::{Scheduler, SchedulerArgs};
use crate::actors::token_sink::TokenSink;
use crate::node::context::NodeContext;
use crate::request_plane::protocol::{Owner, sink_name};
use crate::runtime::supervision::spec::{ChildSpec, StartFn};
use crate::worker::engine::sim::{SimEngine, SimEngineArgs};
use crate::worker::engine::{ChaosArgs, ChaosEngine, TransformerArgs, TransformerEngine};
use ractor::{Actor, ActorCell, ActorRef, SpawnErr};
use std::sync::Arc;

/// Membership, heartbeats, liveness, role groups.
pub(super) fn discovery(ctx: &NodeContext) -> ChildSpec {
    let ctx2 = ctx.clone();
    ChildSpec::actor("discovery", Some(ctx.name("discovery")), move || {
        (Discovery, args::discovery(&ctx2))
    })
    .shutdown(args::shutdown(ctx))
}

/// The planner (role `planner`, with its capacity curves resolved at start).
pub(super) fn planner(ctx: &NodeContext) -> Option<ChildSpec> {
    let capacity = ctx.planner_capacity.clone()?;
    let args = crate::actors::planner::PlannerArgs {
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
    };
    Some(
        ChildSpec::actor("planner", Some(ctx.name("planner")), move || {
            (crate::actors::planner::PlannerActor, args.clone())
        })
        .shutdown(args::shutdown(ctx)),
    )
}

/// Installs and clears injected faults on this node.
pub(super) fn chaos(ctx: &NodeContext) -> ChildSpec {
    let faults = ctx.faults.clone();
    let filters = ctx.fault_filters.clone();
    let cluster = ctx.cluster.clone();
    let clock = ctx.clock.clone();
    let bus = ctx.events.clone();
    ChildSpec::actor("chaos", Some(ctx.name("chaos")), move || {
        (
            Chaos,
            (
                faults.clone(),
                filters.clone(),
                cluster.clone(),
                clock.clone(),
                bus.clone(),
            ),
        )
    })
    .shutdown(args::shutdown(ctx))
}

/// The node's KV transport (worker nodes): a handle on the transport `node::start` made.
pub(super) fn transport(
    ctx: &NodeContext,
    transport: Arc<crate::transport::Transport>,
) -> ChildSpec {
    ChildSpec::actor("transport", Some(ctx.name("transport")), move || {
        (crate::transport::TransportActor, transport.clone())
    })
    .shutdown(args::shutdown(ctx))
}

/// Placement: prefix index, load, policy.
pub(super) fn router(ctx: &NodeContext) -> ChildSpec {
    let config = args::router(ctx);
    ChildSpec::actor("router", Some(ctx.name("router")), move || {
        (Router, config.clone())
    })
    .shutdown(args::shutdown(ctx))
}

/// Joins the KV-events group on behalf of this node's router and hands every batch on. It
/// starts after the router (under the same one_for_all supervisor) and finds it by name.
pub(super) fn kv_event_relay(ctx: &NodeContext) -> ChildSpec {
    let router_name = ctx.name("router");
    let name = ctx.name("kv_event_relay");
    let start: StartFn = Arc::new(move |sup: ActorCell| {
        let (router_name, name) = (router_name.clone(), name.clone());
        Box::pin(async move {
            let router: ActorRef<RouterMsg> = ractor::registry::where_is(router_name.clone())
                .ok_or_else(|| {
                    SpawnErr::StartupFailed(format!("router {router_name} is not running").into())
                })?
                .into();
            let (r, _) = Actor::spawn_linked(Some(name), KvEventsRelay, router, sup).await?;
            Ok(r.get_cell())
        })
    });
    ChildSpec::new("kv_event_relay", start).shutdown(args::shutdown(ctx))
}

/// Receives this node's requests' tokens, one message per engine step.
pub(super) fn token_sink(ctx: &NodeContext, parts: &GatewayParts) -> ChildSpec {
    let registry = parts.registry.clone();
    let incarnation = ctx.incarnation;
    let owner = Owner::new(ctx.node_id.clone(), incarnation);
    ChildSpec::actor("token_sink", Some(sink_name(&owner)), move || {
        (TokenSink, (registry.clone(), incarnation))
    })
    .shutdown(args::shutdown(ctx))
}

/// The HTTP listener: OpenAI API, `/live`, `/health`, `/metrics`, `/v1/fleet`.
pub(super) fn http_gateway(ctx: &NodeContext, http: &GatewayArgs) -> ChildSpec {
    let http = http.clone();
    ChildSpec::actor("http_gateway", Some(ctx.name("http_gateway")), move || {
        (HttpGateway, http.clone())
    })
    .shutdown(args::shutdown(ctx))
}

/// Replica `k`'s own HTTP face (`worker.http`): the gateway actor over the face's routes.
pub(super) fn face(ctx: &NodeContext, k: u32, http: &GatewayArgs) -> ChildSpec {
    let http = http.clone();
    let name = format!("face-{k}");
    ChildSpec::actor(name.clone(), Some(ctx.name(&name)), move || {
        (HttpGateway, http.clone())
    })
    .shutdown(args::shutdown(ctx))
}

/// A replica's KV-event publisher and snapshot server.
pub(super) fn kv_publisher(p: &ReplicaParams) -> ChildSpec {
    let worker = p.worker.clone();
    let faults = p.faults.kv_events.clone();
    let vllm = p.kv_events.clone();
    ChildSpec::actor(
        "kv_publisher",
        Some(p.part_name("kv_publisher")),
        move || {
            (
                KvEventPublisher,
                KvPublisherArgs {
                    worker: worker.clone(),
                    faults: faults.clone(),
                    vllm: vllm.clone(),
                },
            )
        },
    )
    .shutdown(p.shutdown)
}

/// An external engine's KV event publisher: a replica's, fed by the engine's translated
/// vLLM-format events instead of a block pool.
pub(super) fn external_kv_publisher(
    ctx: &NodeContext,
    a: &crate::worker::external::ExternalArgs,
) -> ChildSpec {
    let worker = a.worker.clone();
    let faults = ctx.fault_filters.kv_events.clone();
    ChildSpec::actor(
        "kv_publisher",
        Some(a.kv_publisher_name.clone()),
        move || {
            (
                KvEventPublisher,
                KvPublisherArgs {
                    worker: worker.clone(),
                    faults: faults.clone(),
                    vllm: None,
                },
            )
        },
    )
    .shutdown(args::shutdown(ctx))
}

/// An external engine seen as a scheduler (`worker::external`).
pub(super) fn external_engine(
    ctx: &NodeContext,
    a: &crate::worker::external::ExternalArgs,
) -> ChildSpec {
    let a = a.clone();
    let name = format!("{}/scheduler", a.worker);
    ChildSpec::actor("scheduler", Some(name), move || {
        (crate::actors::external_engine::ExternalEngine, a.clone())
    })
    .shutdown(args::shutdown(ctx))
}

/// A replica's engine: the real forward pass, or the timing model when `p.sim` is set.
pub(super) fn engine(p: &ReplicaParams) -> ChildSpec {
    let name = Some(p.part_name("engine"));
    // Every engine runs behind the chaos filter, which applies this node's injected engine
    // faults (slow, hang, fail) at the engine boundary.
    let spec = match &p.sim {
        None => {
            let args = ChaosArgs {
                inner: TransformerArgs {
                    weights: p.model.weights.clone(),
                    config: p.engine,
                    transport: p.transport.clone().map(|t| (t, p.worker.to_string())),
                    kv_region: p.tiers.is_on().then(|| p.kv_region.clone()),
                },
                faults: p.faults.workers.clone(),
                worker: p.worker.clone(),
            };
            ChildSpec::actor("engine", name, move || {
                (
                    EngineWorker::<ChaosEngine<TransformerEngine>>::new(),
                    args.clone(),
                )
            })
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
                faults: p.faults.workers.clone(),
                worker: p.worker.clone(),
            };
            ChildSpec::actor("engine", name, move || {
                (EngineWorker::<ChaosEngine<SimEngine>>::new(), args.clone())
            })
        }
    };
    spec.shutdown(p.shutdown)
}

/// A replica's scheduler: continuous batching over the block pool; drives the engine.
pub(super) fn scheduler(p: &ReplicaParams) -> ChildSpec {
    let args = SchedulerArgs {
        worker: p.worker.clone(),
        engine_name: p.part_name("engine"),
        kv_publisher_name: Some(p.part_name("kv_publisher")),
        config: p.scheduler,
        num_blocks: p.engine.num_blocks,
        block_size: p.engine.block_size,
        salt: p.model.config().block_hash_salt(),
        eos_token_id: p.model.tokenizer.eos_ids.first().copied(),
        faults: p.faults.workers.clone(),
        step_timeout: p.step_timeout,
        canary_interval: p.canary_interval,
        owner_grace: p.owner_grace,
        stats: p.stats.clone(),
        role: p.role,
        disagg: p.disagg,
        transport: p.transport.clone(),
        sim_transfer: p.sim_transfer,
        peer_pull: p.peer_pull,
        tiers: p.tiers,
        tier_links: p.tier_links,
        kv_region: p.kv_region.clone(),
        kv_disk_dir: p.kv_disk_dir.clone(),
        token_events: p.kv_events.is_some(),
        board: p.board.clone(),
        clock: p.clock.clone(),
        bus: p.bus.clone(),
    };
    ChildSpec::actor("scheduler", Some(p.part_name("scheduler")), move || {
        (Scheduler, args.clone())
    })
    .shutdown(p.shutdown)
}
