//! This node's supervision tree, as data. Roles select the branches.
//!
//! ```text
//! node                 one_for_one  supervision.node_max_restarts in node_period_ms → node exits non-zero
//! ├─ discovery         membership, heartbeats, liveness, pg groups per role
//! ├─ chaos             installs and clears injected faults on this node
//! ├─ router_sup        (router)  one_for_all  10 in 60 s: the relay is useless without its router
//! │  ├─ router         placement: KV-aware (prefix index + load)
//! │  └─ kv_event_relay joins the KV-events group, hands every batch to the router
//! ├─ external_workers  (router.external_workers) one_for_one  supervision.max_restarts in period_ms
//! │  └─ <name>         one per external engine, one_for_all, 5 in 10 s (worker `<node>/<name>`)
//! │     ├─ kv_publisher  the engine's KV events (translated from vLLM's) out to the routers
//! │     └─ scheduler   the engine seen as a scheduler: requests over HTTP, health polled
//! ├─ gateway_sup       (gateway, or a worker with worker.http) one_for_one
//! │  │                 supervision.max_restarts in period_ms
//! │  ├─ token_sink     receives this node's requests' tokens, one message per step
//! │  ├─ request_sup    one_for_one  one temporary Request child per in-flight request
//! │  ├─ http_gateway   (gateway) axum: OpenAI API, /live /health /metrics /v1/fleet
//! │  │                 (starts last, stops first)
//! │  └─ face-<k>       (worker.http) replica k's own OpenAI face, pinned to it
//! ├─ planner           (planner) sizes the pools every planner.interval_s from the fleet
//! │                    view; publishes its decisions in this node's heartbeat
//! ├─ transport         (worker)  KV pulls between nodes; a handle on the node's transport
//! │                    (made before the tree: engines allocate their KV through it)
//! └─ worker_pool       (worker)  one_for_one  supervision.max_restarts in period_ms
//!    └─ replica-<k>    ×worker.replicas, one_for_all (the parts share device memory), 5 in 10 s
//!       ├─ kv_publisher  KV events out to subscribers, snapshots
//!       ├─ engine      weights (shared per process) + this replica's KV pools
//!       └─ scheduler   continuous batching over the block pool; drives the engine
//! ```
//! Every child is permanent. Actor names are registered per node (prefixed by
//! `NodeTreeArgs::prefix`) and are what `/v1/fleet` lists.
//!
//! This file holds the tree: each supervisor's flags and its ordered children, and the child
//! spec of each leaf (the one place that names the actor types the tree starts). What the
//! children are started with ([`NodeTreeArgs`]) is built by the composition root from the
//! configuration (`node/tree_args.rs`); the tree never reads the configuration itself.
//!
//! # Restart budgets
//! Budgets multiply across levels: a replica that spends its budget costs the worker pool
//! one restart, a pool that spends its own costs the node one, so a crash loop deep in the
//! tree gets the product of the budgets on its path before the node gives up. Each level's
//! budget is therefore sized for the failures that reach it rather than copied:
//! - the node (`supervision.node_max_restarts` in `node_period_ms`, 3 in 60 s) has the last
//!   word and the smallest budget;
//! - the gateway and the worker pool (`supervision.max_restarts` in `period_ms`, 10 in 60 s)
//!   restart whole services or whole replicas, rarely and at some cost;
//! - a replica ([`REPLICA_BUDGET`]) is where engines hang and fail: a short window makes a
//!   crash loop escalate to the pool within seconds, while faults spread over time (one every
//!   two seconds or slower) never escalate;
//! - the router and its relay ([`ROUTER_BUDGET`]) restart together and cheaply (the index
//!   resyncs from snapshots); their own budget keeps a flapping router off the node's;
//! - `request_sup` ([`REQUEST_BUDGET`]) never restarts anything (every request is
//!   temporary): a restart there would be a bug, so the first one escalates.

use crate::actors::chaos::{Chaos, FaultFilters};
use crate::actors::discovery::{Discovery, DiscoveryArgs};
use crate::actors::engine_worker::EngineWorker;
use crate::actors::gateway::{GatewayArgs, HttpGateway};
use crate::actors::kv_publisher::{KvEventPublisher, KvPublisherArgs};
use crate::actors::planner::{PlannerActor, PlannerArgs};
use crate::actors::router::{KvEventsRelay, Router, RouterArgs, RouterMsg};
use crate::actors::scheduler::{Scheduler, SchedulerArgs};
use crate::actors::token_sink::TokenSink;
use crate::model::LoadedModel;
use crate::request_plane::protocol::{Owner, sink_name};
use crate::request_plane::token_sink::SinkRegistry;
use crate::runtime::ids::{NodeId, WorkerId};
use crate::runtime::resilience::NodeStats;
use crate::runtime::supervision::spec::StartFn;
use crate::runtime::supervision::{ChildSpec, Shutdown, Strategy, SupervisorFlags, SupervisorSpec};
use crate::worker::engine::EngineConfig;
use crate::worker::engine::sim::{SimEngine, SimEngineArgs, SimProfile};
use crate::worker::engine::{ChaosArgs, ChaosEngine, TransformerArgs, TransformerEngine};
use crate::worker::external::ExternalArgs;
use crate::worker::scheduler::{DisaggWorker, SchedulerConfig, SimTransfer};
use ractor::{Actor, ActorCell, ActorRef, SpawnErr};
use std::sync::Arc;
use std::time::Duration;

/// Restart budget of each replica: at most this many restarts within this window.
pub const REPLICA_BUDGET: (u32, Duration) = (5, Duration::from_secs(10));
/// Restart budget of the router's supervisor (router and KV-event relay, one_for_all).
pub const ROUTER_BUDGET: (u32, Duration) = (10, Duration::from_secs(60));
/// Restart budget of `request_sup`, whose children are all temporary.
pub const REQUEST_BUDGET: (u32, Duration) = (0, Duration::from_secs(60));

/// The restart budgets and backoff of the node's supervisors (`supervision.*`).
#[derive(Clone, Copy, Debug)]
pub struct Budgets {
    /// The node's own (`supervision.node_max_restarts` in `node_period_ms`).
    pub node: (u32, Duration),
    /// The gateway's, the worker pool's and the external engines' (`supervision.max_restarts`
    /// in `period_ms`).
    pub inner: (u32, Duration),
    /// First restart delay (`supervision.backoff_base_ms`), doubling up to `backoff_max`.
    pub backoff_base: Duration,
    /// Longest restart delay (`supervision.backoff_max_ms`).
    pub backoff_max: Duration,
}

impl Budgets {
    /// Flags with `strategy`, the budget `(max restarts, window)` and the backoff.
    pub fn flags(&self, strategy: Strategy, (max, period): (u32, Duration)) -> SupervisorFlags {
        SupervisorFlags::new(strategy, max, period)
            .with_backoff(self.backoff_base, self.backoff_max)
    }
}

/// Everything the tree is started with, built once per node by the composition root
/// (`node/tree_args.rs`) from the configuration; roles select the branches (a `None` or
/// empty branch is not started).
pub struct NodeTreeArgs {
    /// Prefix of every registered actor name: `<node>/`.
    pub prefix: String,
    /// This node's name.
    pub node_id: NodeId,
    /// Process start, ms since the Unix epoch.
    pub incarnation: u64,
    /// The node's resilience counters: every supervisor counts its restarts there.
    pub stats: Arc<NodeStats>,
    /// Restart budgets and backoff.
    pub budgets: Budgets,
    /// How long each child is given to stop (`supervision.shutdown_timeout_ms`).
    pub shutdown: Shutdown,
    /// Discovery's arguments.
    pub discovery: DiscoveryArgs,
    /// The Chaos actor's arguments.
    pub chaos: <Chaos as Actor>::Arguments,
    /// The filters of the faults injected on this node (external engines' publishers read
    /// theirs).
    pub fault_filters: FaultFilters,
    /// The router's arguments (role router).
    pub router: Option<RouterArgs>,
    /// The external engines of `router.external_workers` (empty without any).
    pub external: Vec<ExternalArgs>,
    /// The gateway's children (role gateway, or a worker with `worker.http`).
    pub gateway: Option<GatewayParts>,
    /// The node's KV transport (worker nodes).
    pub transport: Option<Arc<crate::transport::Transport>>,
    /// The worker pool's replicas (role worker): `None` for a replica without a model (an
    /// empty replica supervisor).
    pub replicas: Option<Vec<Option<ReplicaParams>>>,
    /// The planner's arguments (role planner).
    pub planner: Option<PlannerArgs>,
}

impl NodeTreeArgs {
    /// Registered name for a node-local actor.
    pub fn name(&self, base: &str) -> String {
        format!("{}{}", self.prefix, base)
    }

    fn flags(&self, strategy: Strategy, budget: (u32, Duration)) -> SupervisorFlags {
        self.budgets.flags(strategy, budget)
    }
}

/// What the gateway's children share: the token sink's registry (also read by the HTTP
/// actors' serving state) and the HTTP actors' arguments.
pub struct GatewayParts {
    /// Per-request token senders, filled by the HTTP actors and read by the token sink.
    pub registry: SinkRegistry,
    /// The gateway's HTTP actor's arguments (`None` on a node without the gateway role).
    pub http: Option<GatewayArgs>,
    /// The replicas' own faces (`worker.http`): `(k, arguments)`.
    pub faces: Vec<(u32, GatewayArgs)>,
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

/// The whole tree of a node.
pub fn node_tree(a: &NodeTreeArgs) -> SupervisorSpec {
    let mut node =
        SupervisorSpec::new(a.name("node"), a.flags(Strategy::OneForOne, a.budgets.node))
            .counting(a.stats.clone())
            .child(discovery(a))
            .child(chaos(a));
    if let Some(router) = &a.router {
        node = node.child(ChildSpec::supervisor(router_sup(a, router)));
    }
    if !a.external.is_empty() {
        node = node.child(ChildSpec::supervisor(external_workers(a)));
    }
    if let Some(parts) = &a.gateway {
        node = node.child(ChildSpec::supervisor(gateway_sup(a, parts)));
    }
    if let Some(t) = &a.transport {
        node = node.child(transport(a, t.clone()));
    }
    if let Some(replicas) = &a.replicas {
        node = node.child(ChildSpec::supervisor(worker_pool(a, replicas)));
    }
    if let Some(args) = &a.planner {
        node = node.child(planner(a, args));
    }
    node
}

/// The router and the relay that feeds it KV events: either exiting restarts both.
fn router_sup(a: &NodeTreeArgs, router_args: &RouterArgs) -> SupervisorSpec {
    SupervisorSpec::new(
        a.name("router_sup"),
        a.flags(Strategy::OneForAll, ROUTER_BUDGET),
    )
    .counting(a.stats.clone())
    .child(router(a, router_args))
    .child(kv_event_relay(a))
}

/// The external engines of `router.external_workers`, each as a worker of this node.
fn external_workers(a: &NodeTreeArgs) -> SupervisorSpec {
    let pair_flags = a.flags(Strategy::OneForAll, REPLICA_BUDGET);
    let engines = a.external.iter().map(|e| {
        ChildSpec::supervisor(
            SupervisorSpec::new(e.worker.to_string(), pair_flags)
                .counting(a.stats.clone())
                .children([external_kv_publisher(a, e), external_engine(a, e)]),
        )
    });
    SupervisorSpec::new(
        a.name("external_workers"),
        a.flags(Strategy::OneForOne, a.budgets.inner),
    )
    .counting(a.stats.clone())
    .children(engines)
}

/// The request plane's doors: the gateway's listener and the replicas' own faces
/// (`worker.http`), over one token sink and one request supervisor. The listeners start last
/// and stop first.
fn gateway_sup(a: &NodeTreeArgs, parts: &GatewayParts) -> SupervisorSpec {
    let requests = SupervisorSpec::new(
        a.name("request_sup"),
        a.flags(Strategy::OneForOne, REQUEST_BUDGET),
    )
    .counting(a.stats.clone());
    let mut sup = SupervisorSpec::new(
        a.name("gateway_sup"),
        a.flags(Strategy::OneForOne, a.budgets.inner),
    )
    .counting(a.stats.clone())
    .child(token_sink(a, parts))
    .child(ChildSpec::supervisor(requests));
    if let Some(http) = &parts.http {
        sup = sup.child(http_gateway(a, http));
    }
    for (k, face_args) in &parts.faces {
        sup = sup.child(face(a, *k, face_args));
    }
    sup
}

/// `worker.replicas` replicas, each under its own one_for_all supervisor.
fn worker_pool(a: &NodeTreeArgs, replicas: &[Option<ReplicaParams>]) -> SupervisorSpec {
    let replica_flags = a.flags(Strategy::OneForAll, REPLICA_BUDGET);
    let replicas = replicas.iter().enumerate().map(|(k, p)| {
        let spec = match p {
            Some(p) => replica(p.clone()),
            // No model loaded: an empty replica (nothing to serve with).
            None => SupervisorSpec::new(a.name(&format!("replica-{k}")), replica_flags)
                .counting(a.stats.clone()),
        };
        ChildSpec::supervisor(spec)
    });
    SupervisorSpec::new(
        a.name("worker_pool"),
        a.flags(Strategy::OneForOne, a.budgets.inner),
    )
    .counting(a.stats.clone())
    .children(replicas)
}

/// A replica: KV event publisher, engine worker, scheduler, under a one_for_all supervisor
/// with `p.flags`, registered as `p.worker`.
pub fn replica(p: ReplicaParams) -> SupervisorSpec {
    SupervisorSpec::new(p.worker.to_string(), p.flags)
        .counting(p.stats.clone())
        .children([kv_publisher(&p), engine(&p), scheduler(&p)])
}

// The leaves: one child spec per actor type, with the name it registers under and the
// arguments it is (re)started with.

/// Membership, heartbeats, liveness, role groups.
fn discovery(a: &NodeTreeArgs) -> ChildSpec {
    let args = a.discovery.clone();
    ChildSpec::actor("discovery", Some(a.name("discovery")), move || {
        (Discovery, args.clone())
    })
    .shutdown(a.shutdown)
}

/// The planner (role `planner`).
fn planner(a: &NodeTreeArgs, args: &PlannerArgs) -> ChildSpec {
    let args = args.clone();
    ChildSpec::actor("planner", Some(a.name("planner")), move || {
        (PlannerActor, args.clone())
    })
    .shutdown(a.shutdown)
}

/// Installs and clears injected faults on this node.
fn chaos(a: &NodeTreeArgs) -> ChildSpec {
    let args = a.chaos.clone();
    ChildSpec::actor("chaos", Some(a.name("chaos")), move || {
        (Chaos, args.clone())
    })
    .shutdown(a.shutdown)
}

/// The node's KV transport (worker nodes): a handle on the transport `node::start` made.
fn transport(a: &NodeTreeArgs, transport: Arc<crate::transport::Transport>) -> ChildSpec {
    ChildSpec::actor("transport", Some(a.name("transport")), move || {
        (crate::transport::TransportActor, transport.clone())
    })
    .shutdown(a.shutdown)
}

/// Placement: prefix index, load, policy.
fn router(a: &NodeTreeArgs, args: &RouterArgs) -> ChildSpec {
    let config = args.clone();
    ChildSpec::actor("router", Some(a.name("router")), move || {
        (Router, config.clone())
    })
    .shutdown(a.shutdown)
}

/// Joins the KV-events group on behalf of this node's router and hands every batch on. It
/// starts after the router (under the same one_for_all supervisor) and finds it by name.
fn kv_event_relay(a: &NodeTreeArgs) -> ChildSpec {
    let router_name = a.name("router");
    let name = a.name("kv_event_relay");
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
    ChildSpec::new("kv_event_relay", start).shutdown(a.shutdown)
}

/// Receives this node's requests' tokens, one message per engine step.
fn token_sink(a: &NodeTreeArgs, parts: &GatewayParts) -> ChildSpec {
    let registry = parts.registry.clone();
    let incarnation = a.incarnation;
    let owner = Owner::new(a.node_id.clone(), incarnation);
    ChildSpec::actor("token_sink", Some(sink_name(&owner)), move || {
        (TokenSink, (registry.clone(), incarnation))
    })
    .shutdown(a.shutdown)
}

/// The HTTP listener: OpenAI API, `/live`, `/health`, `/metrics`, `/v1/fleet`.
fn http_gateway(a: &NodeTreeArgs, http: &GatewayArgs) -> ChildSpec {
    let http = http.clone();
    ChildSpec::actor("http_gateway", Some(a.name("http_gateway")), move || {
        (HttpGateway, http.clone())
    })
    .shutdown(a.shutdown)
}

/// Replica `k`'s own HTTP face (`worker.http`): the gateway actor over the face's routes.
fn face(a: &NodeTreeArgs, k: u32, http: &GatewayArgs) -> ChildSpec {
    let http = http.clone();
    let name = format!("face-{k}");
    ChildSpec::actor(name.clone(), Some(a.name(&name)), move || {
        (HttpGateway, http.clone())
    })
    .shutdown(a.shutdown)
}

/// A replica's KV-event publisher and snapshot server.
fn kv_publisher(p: &ReplicaParams) -> ChildSpec {
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
fn external_kv_publisher(t: &NodeTreeArgs, a: &ExternalArgs) -> ChildSpec {
    let worker = a.worker.clone();
    let faults = t.fault_filters.kv_events.clone();
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
    .shutdown(t.shutdown)
}

/// An external engine seen as a scheduler (`worker::external`).
fn external_engine(t: &NodeTreeArgs, a: &ExternalArgs) -> ChildSpec {
    let a = a.clone();
    let name = format!("{}/scheduler", a.worker);
    ChildSpec::actor("scheduler", Some(name), move || {
        (crate::actors::external_engine::ExternalEngine, a.clone())
    })
    .shutdown(t.shutdown)
}

/// A replica's engine: the real forward pass, or the timing model when `p.sim` is set.
fn engine(p: &ReplicaParams) -> ChildSpec {
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
fn scheduler(p: &ReplicaParams) -> ChildSpec {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_has_its_own_budget_and_a_crash_loop_escalates_sooner() {
        let s = crate::supervisors::config::SupervisionConfig::default();
        let node = (s.node_max_restarts, Duration::from_millis(s.node_period_ms));
        let inner = (s.max_restarts, Duration::from_millis(s.period_ms));
        for b in [inner, REPLICA_BUDGET, ROUTER_BUDGET, REQUEST_BUDGET] {
            assert_ne!(b, node);
        }
        assert_ne!(REPLICA_BUDGET, inner);
        // Engine restarts a crash-looping replica gets before its node gives up: the product
        // of the budgets (plus one each: the restart past a budget escalates) on its path.
        let path = |replica: u32| (replica + 1) * (inner.0 + 1) * (node.0 + 1);
        assert!(path(REPLICA_BUDGET.0) < path(inner.0));
    }
}
