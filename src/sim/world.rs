//! The simulated fleet: one gateway, one router and N workers, each the live fleet's own pure
//! core, driven by a discrete-event loop on one [`ManualClock`] (see the module doc of
//! [`crate::sim`] for what is modelled and what is not).
//!
//! Events wait in one heap ordered by (time, sequence number), so two runs with the same
//! inputs handle them in the same order. Between two events no time passes: the cores' effects
//! are carried out from two work queues (requests, workers) until none is left. A worker's
//! step is priced by the sim engine's model ([`crate::worker::engine::sim::model_step`]) and
//! ends as an event; its token events reach the gateway after `net_delay`, its KV events reach
//! the router after `kv_event_delay`. Only workers with work tick; an idle worker costs
//! nothing.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::control::discovery::membership::{NodeState, NodeView, WorkerView};
use crate::control::planner::{
    CapacityProfile, Decision, Forecast, Planner, PlannerMode, PoolCount, ViewReader,
};
use crate::kv::{BlockPool, CopyId, CopyOutcome, KvEvent, TierConfig};
use crate::node::config::Config;
use crate::request_plane::admission::{Admission, AdmissionVerdict, waits_for_capacity};
use crate::request_plane::error::RequestError;
use crate::request_plane::error::ShedReason;
use crate::request_plane::events::FleetEventKind;
use crate::request_plane::protocol::{
    OwnerStatus, RemoteKv, SubmitRequest, TokenEvent, TokenEventKind,
};
use crate::request_plane::request::{RequestCore, RequestCoreConfig, RequestEffect};
use crate::request_plane::router::core::{DisaggRouting, RouterCore, RouterCoreArgs, WorkerSource};
use crate::runtime::clock::{Clock, Instant, ManualClock, SharedClock};
use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::role::{Role, role_group};
use crate::runtime::signals::GatewayCounters;
use crate::worker::engine::StepBatch;
use crate::worker::engine::sim::{self, SimEngineArgs, SimProfile};
use crate::worker::scheduler::{
    DisaggWorker, InjectedFaults, PullResult, PullWork, ROUTABLE_GROUP, RequestKey,
    SCHEDULER_GROUP, SchedulerCore, SimTierLinks, StepResult, WorkerCore, WorkerCoreConfig,
    WorkerEffect,
};

/// Latest simulated instant an input may name (s): about 31 years.
pub const MAX_SIM_S: f64 = 1e9;

/// `secs` as a simulated duration, if finite, ≥ 0 and within [`MAX_SIM_S`].
pub fn sim_time(secs: f64) -> Option<Duration> {
    (secs.is_finite() && (0.0..=MAX_SIM_S).contains(&secs)).then(|| Duration::from_secs_f64(secs))
}

/// The gateway node every simulated request is submitted from.
pub const GATEWAY: &str = "sim-gateway";

/// The wall clock every run starts at (2026-01-01T00:00:00Z, ms): runs repeat byte for byte.
pub const START_WALL_MS: u64 = 1_767_225_600_000;

/// What the simulated engine is: its timing model and the model facts the live workers take
/// from the loaded model.
#[derive(Clone, Debug)]
pub struct ModelFacts {
    /// Vocabulary size (placeholder tokens are drawn below it).
    pub vocab_size: usize,
    /// The model's context length (caps `worker.max_model_len_tokens`).
    pub max_context: usize,
    /// The block-hash salt (`ModelConfig::block_hash_salt`).
    pub salt: u64,
    /// End-of-sequence token.
    pub eos_token_id: Option<u32>,
}

/// A simulated fleet's shape and settings.
#[derive(Clone, Debug)]
pub struct SimSpec {
    /// The fleet's configuration, as `flotilla up --set …` would give it.
    pub config: Config,
    /// Aggregated workers (0 with `prefill` and `decode`).
    pub workers: usize,
    /// Disaggregated: prefill workers…
    pub prefill: usize,
    /// …and decode workers.
    pub decode: usize,
    /// The engine's timing model (`worker.sim_profile`, or the built-in H100 one).
    pub profile: SimProfile,
    /// Facts of the served model.
    pub model: ModelFacts,
    /// Delay of a KV event batch from a worker to the router.
    pub kv_event_delay: Duration,
    /// Delay of token events from a worker to the gateway, and of one router's load changes
    /// to the others.
    pub net_delay: Duration,
    /// Routers (≥ 1), each applying every KV event; each request goes to one of them, drawn
    /// from its id (clients spread over several gateways). With `router.share_load` they
    /// tell each other their load changes after `net_delay`.
    pub routers: usize,
    /// How long a killed replica takes to come back (`None`: it stays down).
    pub restart_delay: Option<Duration>,
    /// The planner in the loop (`None`: the fleet keeps its size).
    pub planner: Option<SimPlannerSpec>,
}

/// Where the planner's forecast comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimPlannerKind {
    /// The planner as configured (`planner.*`: forecast, hysteresis, mode).
    Forecast,
    /// Perfect knowledge: each interval's forecast is the workload's true load over the next
    /// interval and the cold start before it (its peak rate; its mean lengths), and scale-down
    /// needs no calm intervals or cool-down (it knows the load will not come back).
    Oracle,
}

/// The planner in a simulated fleet's loop: it reads the fleet's signals every
/// `planner.interval_s` and its decisions start replicas (ready after `cold_start`) or drain
/// them. Each pool can grow to its `planner.<pool>.max`.
#[derive(Clone, Debug)]
pub struct SimPlannerSpec {
    pub kind: SimPlannerKind,
    /// One replica's capacity curves.
    pub capacity: CapacityProfile,
    /// From a scale-up decision to the replica taking requests (process start, weight load,
    /// warm-up).
    pub cold_start: Duration,
}

impl SimSpec {
    /// Workers in all.
    pub fn total_workers(&self) -> usize {
        self.workers + self.prefill + self.decode
    }
}

/// One request of a session: its prompt's token ids and `max_tokens` (outputs ignore EOS,
/// as `flotilla bench` asks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimTurn {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
}

/// Where sessions come from: built lazily, so a trace's prompts are never all in memory.
pub trait SimWorkload {
    /// Sessions in the workload.
    fn sessions(&self) -> usize;
    /// Turns of session `i`.
    fn turns(&self, i: usize) -> usize;
    /// Turn `k` of session `i`.
    fn turn(&self, i: usize, k: usize) -> SimTurn;
    /// The priority class session `i`'s requests name (`priority.classes`), as a client's
    /// `x-priority-class` would; `None`: the default class.
    fn class(&self, _i: usize) -> Option<&str> {
        None
    }

    /// Session `i`'s session key, passed to the router with each of its turns as the gateway
    /// passes `x-session-id` ([`RouteRequest::session`](crate::request_plane::protocol::RouteRequest::session));
    /// `None` (the default): none.
    fn session_key(&self, i: usize) -> Option<String> {
        let _ = i;
        None
    }
}

/// When sessions start.
#[derive(Clone, Debug, PartialEq)]
pub enum Arrivals {
    /// Open loop: session `i` starts at `offsets_s[i]` seconds (sessions past the list's end
    /// are not sent).
    Open(Vec<f64>),
    /// Closed loop: this many sessions at once, each taking the next as soon as it ends.
    Closed(usize),
}

/// A fault at a given time.
#[derive(Clone, Debug, PartialEq)]
pub enum SimFault {
    /// Worker `worker` (index) is killed at `at` (its replica restarts after the spec's
    /// `restart_delay`).
    Kill { at: Duration, worker: usize },
    /// KV events from every worker are dropped between `from` and `until`.
    DropKvEvents { from: Duration, until: Duration },
    /// Worker `worker`'s engine waits `delay` before each step between `from` and `until`
    /// (chaos `slow`: not engine time, the step-time model does not learn from it).
    Slow {
        from: Duration,
        until: Duration,
        worker: usize,
        delay: Duration,
    },
    /// Worker `worker`'s engine does not answer between `from` and `until` (chaos `hang`):
    /// its step and canary wait; past `worker.step_timeout_ms` the watchdog takes the replica
    /// down and it restarts.
    Hang {
        from: Duration,
        until: Duration,
        worker: usize,
    },
}

/// What a run's summary says of a fault: `kill worker 2 (sim-2/replica-0) at 3.0 s`. Workers
/// are numbered from 0 (aggregated, then prefill, then decode); worker `i` is `sim-i/replica-0`
/// in the run's records.
impl std::fmt::Display for SimFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |d: &Duration| d.as_secs_f64();
        match self {
            SimFault::Kill { at, worker } => write!(
                f,
                "kill worker {worker} (sim-{worker}/replica-0) at {:.1} s",
                s(at)
            ),
            SimFault::DropKvEvents { from, until } => write!(
                f,
                "drop every worker's KV events from {:.1} s to {:.1} s",
                s(from),
                s(until)
            ),
            SimFault::Slow {
                from,
                until,
                worker,
                delay,
            } => write!(
                f,
                "slow worker {worker} (sim-{worker}/replica-0) by {} ms a step from {:.1} s to \
                 {:.1} s",
                delay.as_millis(),
                s(from),
                s(until)
            ),
            SimFault::Hang {
                from,
                until,
                worker,
            } => write!(
                f,
                "hang worker {worker} (sim-{worker}/replica-0) from {:.1} s to {:.1} s",
                s(from),
                s(until)
            ),
        }
    }
}

impl SimFault {
    /// The worker a fault names, if it names one.
    pub fn worker(&self) -> Option<usize> {
        match self {
            SimFault::Kill { worker, .. }
            | SimFault::Slow { worker, .. }
            | SimFault::Hang { worker, .. } => Some(*worker),
            SimFault::DropKvEvents { .. } => None,
        }
    }
}

/// What one request gave, as a client would have measured it (times in ms from its send).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimRecord {
    pub session: usize,
    pub turn: usize,
    /// Sent at (s from the first arrival).
    pub sent_s: f64,
    pub ok: bool,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub itl_ms: Vec<f64>,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: Option<u64>,
    /// Its priority class, resolved as a gateway resolves it (`None`: none configured).
    pub class: Option<String>,
}

/// Counts of what happened in a run.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SimCounters {
    /// Events taken from the heap.
    pub events: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Requests refused by admission (503).
    pub shed: u64,
    /// Placements (first attempts, migrations and hand-offs).
    pub placements: u64,
    /// Migrations.
    pub migrations: u64,
    /// Requests given up.
    pub gave_up: u64,
    /// Prefill hand-offs.
    pub hand_offs: u64,
    /// Workers killed, and restarted.
    pub kills: u64,
    pub restarts: u64,
    /// KV event batches dropped by a fault.
    pub kv_batches_dropped: u64,
    /// The lower KV tiers' counters, summed over the workers' last incarnations.
    pub kv_tiers: crate::kv::TierCounters,
    /// Peer pulls (G4), summed over the workers' last incarnations.
    pub peer_pulls: crate::worker::scheduler::PeerPullCounters,
    /// (worker, block, tier) entries on which the router's prefix index and the live
    /// workers' pools disagree once every KV event has arrived, over the workers whose event
    /// stream the index follows (a worker waiting for a resync is skipped: the simulator
    /// sends no snapshot).
    pub index_mismatches: usize,
}

/// What is left over at the end of a run: each should be 0 (conservation).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SimLeftovers {
    /// Requests that never ended (none finished, failed or was shed).
    pub unfinished: usize,
    /// Placements the router still counts.
    pub placed: usize,
    /// Sequences still live, waiting or held on workers.
    pub live_sequences: usize,
    /// KV blocks still pinned by sequences.
    pub pinned_blocks: usize,
    /// Attempts still listened for.
    pub listening: usize,
}

impl std::fmt::Display for SimLeftovers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} unfinished, {} placed, {} live sequences, {} pinned blocks, {} listened for",
            self.unfinished, self.placed, self.live_sequences, self.pinned_blocks, self.listening
        )
    }
}

/// A run's results.
#[derive(Clone, Debug, Default)]
pub struct SimOutcome {
    /// One record per request sent (or skipped), in order of completion.
    pub records: Vec<SimRecord>,
    /// Simulated time from the first arrival to the last completion.
    pub span: Duration,
    pub counters: SimCounters,
    pub leftovers: SimLeftovers,
    /// The fleet events the live fleet's bus would carry, with their time (ms from the start).
    pub fleet_events: Vec<(f64, FleetEventKind)>,
    /// Replica-seconds per pool, from time 0 to the last completion (a replica counts from
    /// the moment it is asked for, through its cold start, to the end of its drain).
    pub replica_seconds: Vec<(Role, f64)>,
    /// The planner's decisions, one per interval.
    pub decisions: Vec<Decision>,
    /// Most replicas each pool had at once (ready, starting or draining).
    pub peak_replicas: Vec<(Role, u32)>,
}

/// Entries on which `index` and `pool` disagree for `worker`: blocks one holds in a tier and
/// the other does not.
fn index_mismatches(
    index: &crate::request_plane::router::index::PrefixIndex,
    worker: &WorkerId,
    pool: &BlockPool,
) -> usize {
    use crate::kv::Tier;
    use std::collections::HashSet;
    if index.is_pending(worker) {
        // Waiting for a snapshot (a restarted worker's events begin again at 1); the
        // simulator sends none, so its old contents stay visible, as documented.
        return 0;
    }
    let held: HashSet<(crate::runtime::ids::SequenceHash, Tier)> = index
        .held_by(worker)
        .into_iter()
        .flat_map(|(h, tiers)| tiers.tiers().map(move |t| (h, t)))
        .collect();
    let pools: HashSet<_> = [Tier::Device, Tier::Host, Tier::Disk]
        .into_iter()
        .flat_map(|t| {
            pool.snapshot_tier(t)
                .into_iter()
                .map(move |b| (b.seq_hash, t))
        })
        .collect();
    held.symmetric_difference(&pools).count()
}

/// The sets of workers the router reads (the live fleet's process groups): each a list in
/// the order workers joined, with a set beside it for membership.
#[derive(Default)]
struct Groups {
    routable: Mutex<Members>,
    alive: Mutex<Members>,
    prefill: Mutex<Members>,
    decode: Mutex<Members>,
}

#[derive(Default)]
struct Members {
    list: Vec<WorkerId>,
    set: HashSet<WorkerId>,
}

impl Members {
    fn join(&mut self, w: &WorkerId) {
        if self.set.insert(w.clone()) {
            self.list.push(w.clone());
        }
    }

    fn leave(&mut self, w: &WorkerId) {
        if self.set.remove(w) {
            self.list.retain(|x| x != w);
        }
    }
}

fn lock(m: &Mutex<Members>) -> std::sync::MutexGuard<'_, Members> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Groups {
    fn set(&self, group: &str) -> Option<&Mutex<Members>> {
        if group == ROUTABLE_GROUP {
            Some(&self.routable)
        } else if group == SCHEDULER_GROUP {
            Some(&self.alive)
        } else if Some(group) == role_group(Role::Prefill) {
            Some(&self.prefill)
        } else if Some(group) == role_group(Role::Decode) {
            Some(&self.decode)
        } else {
            None
        }
    }

    fn join(&self, group: &str, w: &WorkerId) {
        if let Some(set) = self.set(group) {
            lock(set).join(w);
        }
    }

    fn leave(&self, group: &str, w: &WorkerId) {
        if let Some(set) = self.set(group) {
            lock(set).leave(w);
        }
    }

    fn leave_all(&self, w: &WorkerId) {
        for set in [&self.routable, &self.alive, &self.prefill, &self.decode] {
            lock(set).leave(w);
        }
    }
}

impl WorkerSource for Groups {
    fn routable(&self) -> Vec<WorkerId> {
        lock(&self.routable).list.clone()
    }
    fn alive(&self) -> Vec<WorkerId> {
        lock(&self.alive).list.clone()
    }
    fn in_role(&self, role: Role) -> Vec<WorkerId> {
        match role {
            Role::Prefill => lock(&self.prefill).list.clone(),
            Role::Decode => lock(&self.decode).list.clone(),
            Role::Aggregated => Vec::new(),
        }
    }
}

enum Ev {
    Turn(usize, usize),
    StepDone(usize, u32, StepResult),
    /// A pull of worker `i` (incarnation) returned; the worker it read from (index,
    /// incarnation at the pull's start) must still be there for its blocks to be valid.
    PullDone(usize, u32, PullResult, Option<(usize, u32)>),
    /// A peer pull's holder answered worker `i` (incarnation).
    FetchDone(usize, u32, RequestKey, Box<Result<RemoteKv, String>>),
    CopiesDone(usize, u32, Vec<(CopyId, CopyOutcome)>),
    Retry(RequestId),
    Tick(usize, u32),
    /// Worker `i`'s (incarnation) gather window for migrated requests ended.
    Kick(usize, u32),
    KvEvents(Vec<KvEvent>),
    Tokens(Vec<TokenEvent>),
    Kill(usize),
    Restart(usize),
    DropKv(bool),
    /// Set worker `.0`'s engine delay before each step (chaos `slow`).
    Slow(usize, Duration),
    /// Start or end a hang of worker `.0`'s engine.
    Hang(usize, bool),
    /// The planner's interval.
    Plan,
    /// Requests waiting for a worker to start (scale from zero) look at the view again.
    CapacityCheck,
    /// Worker `.0`'s cold start (asked for in generation `.1`) is over: it boots.
    Ready(usize, u32),
    /// Router `.1`'s load changes reach router `.0`.
    LoadSync(
        usize,
        usize,
        Vec<crate::request_plane::router::sync::LoadChange>,
    ),
}

/// Where a worker slot is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Not part of the fleet (a spare slot the planner may start).
    Off,
    /// Asked for, not taking requests yet (cold start).
    Starting,
    /// Serving (or down and restarting after a fault).
    Running,
    /// Leaving: no new work, finishing what it runs.
    Draining,
}

struct Scheduled {
    at: Instant,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    // A max-heap: the earliest (then the first scheduled) comes out first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

struct SimWorker {
    id: WorkerId,
    role: Role,
    core: Option<WorkerCore>,
    /// Bumped at every restart: a step of an earlier incarnation is dropped.
    incarnation: u32,
    ticking: bool,
    queued: bool,
    view_dirty: bool,
    /// The chaos faults aimed at this worker's engine (they outlive a restart, as the node's
    /// filters do).
    faults: InjectedFaults,
    /// A step that reached a hung engine: it runs when the hang ends.
    parked: Option<(u64, StepBatch)>,
    /// A canary ping that reached a hung engine: answered when the hang ends.
    ping_parked: bool,
    phase: Phase,
    /// Since when it costs (asked for), while not `Off`.
    on_since: Option<Instant>,
    /// Bumped each time the slot is asked for: a cold start of an earlier request is dropped.
    generation: u32,
    /// When its KV tier copy lanes are free again (store: offloads and demotions; load:
    /// onboards): each lane carries out one copy at a time.
    store_lane: Instant,
    load_lane: Instant,
}

struct SimPlannerState {
    planner: Planner,
    spec: SimPlannerSpec,
    /// The gateway's signals, counted as a live gateway counts them (`serve.rs`).
    gateway: GatewayCounters,
    /// Reads them with the published view, as the live Planner actor does.
    reader: ViewReader,
    /// Per interval of the workload: (requests, prompt tokens, output tokens).
    oracle: Vec<(u64, u64, u64)>,
    interval: Duration,
    pools: Vec<Role>,
}

/// A request admitted while no worker served the model and a planner acts: it waits at the
/// gateway for one to start (`waits_for_capacity`), as the live gateway's request does.
struct CapacityWaiter {
    session: usize,
    turn: usize,
    since: Instant,
    prompt: SimTurn,
    record: SimRecord,
}

struct SimRequest {
    core: RequestCore,
    sent: Instant,
    last_chunk: Option<Instant>,
    record: SimRecord,
    finished: bool,
    queued: bool,
}

/// The simulated fleet (see the module doc).
pub struct SimFleet<'w> {
    spec: SimSpec,
    workload: &'w dyn SimWorkload,
    clock: ManualClock,
    shared: SharedClock,
    start: Instant,
    first_arrival: Option<Instant>,
    last_completion: Option<Instant>,
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    groups: Arc<Groups>,
    routers: Vec<RouterCore>,
    workers: Vec<SimWorker>,
    index: HashMap<WorkerId, usize>,
    engine: SimEngineArgs,
    scheduler: crate::worker::scheduler::SchedulerConfig,
    core_config: WorkerCoreConfig,
    blocks: usize,
    /// Each replica's lower KV tiers, and the modelled speed of their copies.
    tiers: TierConfig,
    tier_links: SimTierLinks,
    tick_period: Duration,
    requests: HashMap<RequestId, SimRequest>,
    listening: HashMap<RequestId, RequestId>,
    request_queue: VecDeque<RequestId>,
    worker_queue: VecDeque<usize>,
    ids: Arc<AtomicU64>,
    next_request: u64,
    admission: Admission,
    views: Vec<NodeView>,
    views_at: Option<Instant>,
    heartbeat: Duration,
    arrivals: Arrivals,
    next_session: usize,
    drop_kv: bool,
    /// Sessions not finished yet (the planner stops when none is left).
    sessions_left: usize,
    planner: Option<SimPlannerState>,
    /// Requests waiting for a worker to start, oldest first, and whether a look at the view
    /// is scheduled for them.
    capacity_waits: Vec<CapacityWaiter>,
    capacity_check: bool,
    replica_seconds: HashMap<Role, f64>,
    out: SimOutcome,
}

impl<'w> SimFleet<'w> {
    /// A fleet of `spec`'s workers, idle, at time 0, about to serve `workload` as `arrivals`
    /// say, with `faults` at their times.
    ///
    /// # Errors
    /// The configuration cannot build a worker or the router (the key is named).
    pub fn new(
        spec: SimSpec,
        workload: &'w dyn SimWorkload,
        arrivals: Arrivals,
        faults: &[SimFault],
    ) -> anyhow::Result<Self> {
        let clock = ManualClock::at_wall_ms(START_WALL_MS);
        let shared: SharedClock = Arc::new(clock.clone());
        let start = clock.now();
        let groups = Arc::new(Groups::default());
        let c = &spec.config;
        anyhow::ensure!(spec.routers >= 1, "--routers: at least one router");
        let mut router_args = RouterCoreArgs::new(c.selector_config(), groups.clone());
        router_args.clock = shared.clone();
        router_args.disagg = DisaggRouting::from(&c.disagg);
        router_args.share_load = c.router.share_load;
        router_args.sessions = c.session_table();
        let routers = (0..spec.routers)
            .map(|_| RouterCore::new(router_args.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("configuration: router: {e}"))?;
        let mut routers = routers;
        for (k, r) in routers.iter_mut().enumerate() {
            for other in (0..spec.routers).filter(|&o| o != k) {
                r.router_joined(&format!("sim-router-{other}"));
            }
        }
        let block_size = c.worker.block_size_tokens;
        let blocks = c.worker.kv_blocks_with(Some(&spec.profile));
        let engine = SimEngineArgs {
            profile: spec.profile.clone(),
            speedup: c.worker.sim_speedup,
            num_blocks: blocks,
            block_size,
            vocab_size: spec.model.vocab_size,
            max_context: spec.model.max_context,
        };
        let step_timeout = Duration::from_millis(c.worker.step_timeout_ms);
        let core_config = WorkerCoreConfig {
            worker: WorkerId::new("-"),
            eos_token_id: spec.model.eos_token_id,
            block_size,
            role: Role::Aggregated,
            disagg: DisaggWorker::from(&c.disagg),
            step_timeout,
            canary_interval: Duration::from_millis(c.worker.canary_interval_ms),
            owner_grace: Duration::from_millis(c.cluster.liveness_timeout_ms),
            has_transport: false,
            sim_transfer: Some(c.sim_transfer()),
            peer_pull: c.peer_pull_worker(true),
        };
        let mut fleet = Self {
            admission: c.admission(),
            heartbeat: c.cluster.heartbeat_interval(),
            scheduler: c.scheduler_config(spec.model.max_context),
            // The live scheduler's tick (`actors/scheduler.rs`).
            tick_period: (step_timeout / 4)
                .clamp(Duration::from_millis(10), Duration::from_millis(500)),
            core_config,
            engine,
            blocks,
            tiers: c.tier_config(),
            tier_links: c.sim_tier_links(),
            workload,
            clock,
            shared,
            start,
            first_arrival: None,
            last_completion: None,
            heap: BinaryHeap::new(),
            seq: 0,
            groups,
            routers,
            workers: Vec::new(),
            index: HashMap::new(),
            requests: HashMap::new(),
            listening: HashMap::new(),
            request_queue: VecDeque::new(),
            worker_queue: VecDeque::new(),
            ids: Arc::new(AtomicU64::new(1 << 40)),
            next_request: 1,
            views: Vec::new(),
            views_at: None,
            arrivals: arrivals.clone(),
            next_session: 0,
            drop_kv: false,
            sessions_left: match &arrivals {
                Arrivals::Open(o) => o.len().min(workload.sessions()),
                Arrivals::Closed(_) => workload.sessions(),
            },
            planner: None,
            capacity_waits: Vec::new(),
            capacity_check: false,
            replica_seconds: HashMap::new(),
            out: SimOutcome::default(),
            spec,
        };
        let initial = [
            (Role::Aggregated, fleet.spec.workers),
            (Role::Prefill, fleet.spec.prefill),
            (Role::Decode, fleet.spec.decode),
        ];
        // Initial workers first (numbered as the faults name them), then the planner's spare
        // slots, pool by pool.
        let mut slots: Vec<(Role, bool)> = initial
            .iter()
            .flat_map(|&(role, n)| std::iter::repeat_n((role, true), n))
            .collect();
        if let Some(ps) = fleet.spec.planner.clone() {
            let pc = &fleet.spec.config.planner;
            // The pools the fleet starts with, and those `planner.pools` names (a pool
            // deployed at zero); a fleet at zero naming none is aggregated.
            let mut pools: Vec<Role> = initial
                .iter()
                .filter(|(r, n)| *n > 0 || pc.pools.contains(r))
                .map(|(r, _)| *r)
                .collect();
            if pools.is_empty() {
                pools.push(Role::Aggregated);
            }
            for &(role, n) in &initial {
                if pools.contains(&role) {
                    let spare = (pc.bounds(role).max as usize).saturating_sub(n);
                    slots.extend(std::iter::repeat_n((role, false), spare));
                }
            }
            let mut planner_cfg = pc.clone();
            if ps.kind == SimPlannerKind::Oracle {
                planner_cfg.scale_down_intervals = 1;
                planner_cfg.cooldown_s = 0.0;
            }
            let interval = Duration::from_secs_f64(pc.interval_s);
            let oracle = match (&arrivals, ps.kind) {
                (Arrivals::Open(offsets), SimPlannerKind::Oracle) => {
                    oracle_series(workload, offsets, pc.interval_s)
                }
                _ => Vec::new(),
            };
            fleet.planner = Some(SimPlannerState {
                planner: Planner::new(planner_cfg, ps.capacity.clone()),
                spec: ps,
                gateway: GatewayCounters::default(),
                reader: ViewReader::with_pools(&pools).counting_from_zero(),
                oracle,
                interval,
                pools,
            });
            // The oracle knows the first interval's load before it starts.
            let first = if fleet
                .planner
                .as_ref()
                .is_some_and(|p| p.spec.kind == SimPlannerKind::Oracle)
            {
                Duration::ZERO
            } else {
                interval
            };
            fleet.schedule_in(first, Ev::Plan);
        }
        for (i, (role, on)) in slots.into_iter().enumerate() {
            let id = WorkerId::new(format!("sim-{i}/replica-0"));
            fleet.index.insert(id.clone(), i);
            fleet.views.push(NodeView {
                id: NodeId::new(format!("sim-{i}")),
                addr: String::new(),
                http_addr: None,
                roles: vec![],
                pid: 0,
                incarnation: 1,
                state: if on { NodeState::Up } else { NodeState::Down },
                last_seen_ms: START_WALL_MS,
                workers: vec![WorkerView {
                    id: id.to_string(),
                    state: "running".into(),
                    ..WorkerView::default()
                }],
                actors: vec![],
                counters: Default::default(),
                signals: None,
                planner: None,
                regions: vec![],
            });
            fleet.workers.push(SimWorker {
                id,
                role,
                core: None,
                incarnation: 0,
                ticking: false,
                queued: false,
                view_dirty: true,
                faults: InjectedFaults::default(),
                parked: None,
                ping_parked: false,
                phase: if on { Phase::Running } else { Phase::Off },
                on_since: on.then_some(start),
                generation: 0,
                store_lane: start,
                load_lane: start,
            });
            if on {
                fleet.boot(i)?;
            }
        }
        for (role, n) in initial {
            if n > 0 {
                fleet.note_peak(role);
            }
        }
        match &arrivals {
            Arrivals::Open(offsets) => {
                for (i, off) in offsets.iter().enumerate().take(workload.sessions()) {
                    let at = sim_time(*off).ok_or_else(|| {
                        anyhow::anyhow!(
                            "session {i} arrives at {off} s: arrivals must be finite, ≥ 0 and \
                             within {MAX_SIM_S:e} s (check --speedup, --rate, \
                             --trace-jitter-ms and the trace's timestamps)"
                        )
                    })?;
                    fleet.schedule_in(at, Ev::Turn(i, 0));
                }
            }
            Arrivals::Closed(c) => {
                for _ in 0..(*c).max(1) {
                    fleet.start_next_session();
                }
            }
        }
        for f in faults {
            match f {
                SimFault::Kill { at, worker } => {
                    fleet.check_worker(*worker, "--kill")?;
                    fleet.schedule_in(*at, Ev::Kill(*worker));
                }
                SimFault::DropKvEvents { from, until } => {
                    fleet.schedule_in(*from, Ev::DropKv(true));
                    fleet.schedule_in(*until, Ev::DropKv(false));
                }
                SimFault::Slow {
                    from,
                    until,
                    worker,
                    delay,
                } => {
                    fleet.check_worker(*worker, "--slow")?;
                    fleet.schedule_in(*from, Ev::Slow(*worker, *delay));
                    fleet.schedule_in(*until, Ev::Slow(*worker, Duration::ZERO));
                }
                SimFault::Hang {
                    from,
                    until,
                    worker,
                } => {
                    fleet.check_worker(*worker, "--hang")?;
                    fleet.schedule_in(*from, Ev::Hang(*worker, true));
                    fleet.schedule_in(*until, Ev::Hang(*worker, false));
                }
            }
        }
        fleet.pump();
        Ok(fleet)
    }

    fn check_worker(&self, worker: usize, flag: &str) -> anyhow::Result<()> {
        let n = self.spec.total_workers();
        anyhow::ensure!(
            worker < n,
            "{flag} …:{worker}: the fleet has {} workers (0 to {}: aggregated, then prefill, \
             then decode)",
            n,
            n.saturating_sub(1)
        );
        Ok(())
    }

    /// Run until nothing is left to happen; the outcome.
    pub fn run(mut self) -> SimOutcome {
        while let Some(Scheduled { at, ev, .. }) = self.heap.pop() {
            let now = self.clock.now();
            if at > now {
                self.clock.advance(at - now);
            }
            self.out.counters.events += 1;
            self.handle(ev);
            self.pump();
        }
        self.finish()
    }

    fn finish(mut self) -> SimOutcome {
        let now = self.clock.now();
        let unfinished: Vec<RequestId> = {
            let mut ids: Vec<RequestId> = self.requests.keys().copied().collect();
            ids.sort();
            ids
        };
        self.out.leftovers.unfinished = unfinished.len();
        for rid in unfinished {
            if let Some(r) = self.requests.remove(&rid) {
                let mut rec = r.record;
                rec.error = Some("never finished: nothing was left to happen".into());
                rec.e2e_ms = ms(now - r.sent);
                self.out.records.push(rec);
            }
        }
        self.out.leftovers.placed = self.routers.iter().map(RouterCore::placed).sum();
        self.out.leftovers.listening = self.listening.len();
        for w in &self.workers {
            if let Some(core) = &w.core {
                let s = core.stats();
                self.out.leftovers.live_sequences += core.num_live() + s.held;
                self.out.leftovers.pinned_blocks += s.kv_blocks_used;
                self.out.counters.peer_pulls += s.peer_pulls;
                let pool = core.pool();
                if let Some(t) = pool.tier_usage() {
                    let (sum, c) = (&mut self.out.counters.kv_tiers, t.counters);
                    sum.offloads += c.offloads;
                    sum.offload_drops += c.offload_drops;
                    sum.demotions += c.demotions;
                    sum.onboards_host += c.onboards_host;
                    sum.onboards_disk += c.onboards_disk;
                    sum.copy_failures += c.copy_failures;
                    sum.corrupt += c.corrupt;
                }
                for r in &self.routers {
                    self.out.counters.index_mismatches += index_mismatches(r.index(), &w.id, pool);
                }
            }
        }
        let end = self.last_completion.unwrap_or(now);
        for i in 0..self.workers.len() {
            self.account(i, end);
        }
        let mut rs: Vec<(Role, f64)> = self.replica_seconds.iter().map(|(r, s)| (*r, *s)).collect();
        rs.sort_by_key(|(r, _)| pool_order(*r));
        self.out.replica_seconds = rs;
        self.out.span = match (self.first_arrival, self.last_completion) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        self.out
    }

    fn now(&self) -> Instant {
        self.clock.now()
    }

    fn since_start_ms(&self) -> f64 {
        ms(self.now() - self.start)
    }

    fn schedule_in(&mut self, after: Duration, ev: Ev) {
        let at = self.now() + after;
        self.schedule_at(at, ev);
    }

    fn schedule_at(&mut self, at: Instant, ev: Ev) {
        self.seq += 1;
        self.heap.push(Scheduled {
            at,
            seq: self.seq,
            ev,
        });
    }

    /// Start (or restart) worker `i`: a fresh core over an empty pool, joining its groups.
    fn boot(&mut self, i: usize) -> anyhow::Result<()> {
        // A new incarnation starts with an empty pool: the router forgets the old one's
        // blocks (and any of its KV events that arrived after it died).
        let id = self.workers[i].id.clone();
        for r in &mut self.routers {
            r.worker_left(&id);
        }
        let w = &mut self.workers[i];
        w.incarnation += 1;
        let pool = BlockPool::new(self.blocks, self.engine.block_size, self.spec.model.salt)
            .and_then(|p| p.with_tiers(self.tiers))
            .map_err(|e| anyhow::anyhow!("configuration: worker.kv_blocks: {e}"))?
            .with_worker(w.id.clone());
        let now = self.clock.now();
        (w.store_lane, w.load_lane) = (now, now);
        let batcher = SchedulerCore::new(self.scheduler, pool)
            .map_err(|e| anyhow::anyhow!("configuration: worker: {e}"))?;
        let cfg = WorkerCoreConfig {
            worker: w.id.clone(),
            role: w.role,
            ..self.core_config.clone()
        };
        let mut core = WorkerCore::new(cfg, batcher, self.shared.clone());
        core.set_faults(w.faults);
        w.core = Some(core);
        w.ticking = false;
        w.view_dirty = true;
        self.views[i].state = NodeState::Up;
        self.mark_worker(i);
        Ok(())
    }

    fn mark_worker(&mut self, i: usize) {
        let w = &mut self.workers[i];
        w.view_dirty = true;
        if !w.queued {
            w.queued = true;
            self.worker_queue.push_back(i);
        }
    }

    fn mark_request(&mut self, rid: RequestId) {
        if let Some(r) = self.requests.get_mut(&rid)
            && !r.queued
        {
            r.queued = true;
            self.request_queue.push_back(rid);
        }
    }

    /// Carry out every effect until none is left (no time passes).
    fn pump(&mut self) {
        loop {
            if let Some(rid) = self.request_queue.pop_front() {
                self.drive_request(rid);
            } else if let Some(i) = self.worker_queue.pop_front() {
                self.drive_worker(i);
            } else {
                return;
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Turn(i, k) => self.start_turn(i, k),
            Ev::StepDone(i, inc, result) => {
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.step_done(result, || None);
                    self.worker_result(i, r);
                }
            }
            Ev::PullDone(i, inc, mut result, from) => {
                // A pull whose source died or restarted meanwhile read freed memory: it fails
                // (the live transport's read fails against a gone region).
                if let (Some((p, pinc)), Ok(_)) = (from, &result.outcome)
                    && (self.workers[p].incarnation != pinc || self.workers[p].core.is_none())
                {
                    result.outcome = Err("the worker it read from left during the pull".into());
                }
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.pull_done(result);
                    self.worker_result(i, r);
                }
            }
            Ev::FetchDone(i, inc, key, answer) => {
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.fetch_done(&key, *answer);
                    self.worker_result(i, r);
                }
            }
            Ev::CopiesDone(i, inc, results) => {
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.copies_done(&results);
                    self.worker_result(i, r);
                }
            }
            Ev::Tick(i, inc) => {
                self.workers[i].ticking = false;
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.tick(|_| OwnerStatus::Present);
                    self.worker_result(i, r);
                }
            }
            Ev::Kick(i, inc) => {
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.kick_due();
                    self.worker_result(i, r);
                }
            }
            Ev::Retry(rid) => {
                if let Some(r) = self.requests.get_mut(&rid) {
                    r.core.retry();
                    self.mark_request(rid);
                }
            }
            Ev::KvEvents(events) => {
                if let Some((last, rest)) = self.routers.split_last_mut() {
                    for r in rest {
                        r.kv_events(events.clone());
                    }
                    last.kv_events(events);
                }
            }
            Ev::LoadSync(to, from, changes) => {
                self.routers[to].peer_load(&format!("sim-router-{from}"), changes);
            }
            Ev::Tokens(events) => {
                for ev in events {
                    if let Some(rid) = self.listening.get(&ev.request).copied()
                        && let Some(r) = self.requests.get_mut(&rid)
                    {
                        r.core.event(ev.request, ev.kind);
                        self.mark_request(rid);
                    }
                }
            }
            Ev::Kill(i) => self.kill(i),
            Ev::Restart(i) => {
                if self.workers[i].core.is_none()
                    && self.workers[i].phase == Phase::Running
                    && self.boot(i).is_ok()
                {
                    self.out.counters.restarts += 1;
                    let id = self.workers[i].id.clone();
                    self.fleet_event(FleetEventKind::WorkerUp { worker: id });
                }
            }
            Ev::DropKv(on) => self.drop_kv = on,
            Ev::Slow(i, delay) => {
                self.workers[i].faults.step_delay = delay;
                self.apply_faults(i);
            }
            Ev::Hang(i, on) => {
                self.workers[i].faults.hang = on;
                self.apply_faults(i);
                if !on {
                    self.unpark(i);
                }
            }
            Ev::Plan => self.plan_interval(),
            Ev::CapacityCheck => self.capacity_check(),
            Ev::Ready(i, generation) => {
                let w = &self.workers[i];
                if w.phase == Phase::Starting && w.generation == generation {
                    self.workers[i].phase = Phase::Running;
                    if self.boot(i).is_ok() {
                        let id = self.workers[i].id.clone();
                        self.fleet_event(FleetEventKind::WorkerUp { worker: id });
                    }
                }
            }
        }
    }

    /// Stop counting worker `i`'s cost at `at`.
    fn account(&mut self, i: usize, at: Instant) {
        let w = &mut self.workers[i];
        if let Some(t) = w.on_since.take() {
            *self.replica_seconds.entry(w.role).or_default() +=
                at.saturating_duration_since(t).as_secs_f64();
        }
    }

    /// Pool `role`'s replicas as the fleet view shows them.
    fn pool_count(&self, role: Role) -> PoolCount {
        let mut c = PoolCount::new(role);
        for w in self.workers.iter().filter(|w| w.role == role) {
            match w.phase {
                Phase::Off => {}
                // A replica down after a fault is restarting under its supervisor.
                Phase::Running if w.core.is_some() => c.ready += 1,
                Phase::Running | Phase::Starting => c.starting += 1,
                Phase::Draining => c.draining += 1,
            }
        }
        c
    }

    fn note_peak(&mut self, role: Role) {
        let c = self.pool_count(role);
        let n = c.ready + c.starting + c.draining;
        match self.out.peak_replicas.iter_mut().find(|(r, _)| *r == role) {
            Some((_, p)) => *p = (*p).max(n),
            None => {
                self.out.peak_replicas.push((role, n));
                self.out.peak_replicas.sort_by_key(|(r, _)| pool_order(*r));
            }
        }
    }

    /// The planner's interval: the fleet's signals from the published view and the gateway's
    /// window, a decision, and (mode `act`) the pools resized to it.
    fn plan_interval(&mut self) {
        let now = self.now();
        self.refresh_views();
        let Some(pools) = self.planner.as_ref().map(|p| p.pools.clone()) else {
            return;
        };
        let wall =
            |t: Instant| START_WALL_MS + t.saturating_duration_since(self.start).as_millis() as u64;
        let view_at = wall(self.views_at.unwrap_or(now));
        let counts: Vec<PoolCount> = pools.iter().map(|&r| self.pool_count(r)).collect();
        let elapsed = now.saturating_duration_since(self.start);
        let now_ms = wall(now);
        let Some(ps) = self.planner.as_mut() else {
            return;
        };
        let interval_s = ps.interval.as_secs_f64();
        // The live path: the gateway's cumulative signals in its node's view, read with the
        // workers' views by the same ViewReader (it diffs the counts, takes the p99s from
        // the histograms, sums in-flight, waiting and KV use). Only the pool counts are the
        // simulator's own: it knows which slots are starting, which the live view infers.
        let gateway = NodeView {
            id: NodeId::new(GATEWAY),
            addr: String::new(),
            http_addr: None,
            roles: vec![],
            pid: 0,
            incarnation: 1,
            state: NodeState::Up,
            last_seen_ms: view_at,
            workers: vec![],
            actors: vec![],
            counters: Default::default(),
            signals: Some(ps.gateway.snapshot()),
            planner: None,
            regions: vec![],
        };
        let nodes: Vec<NodeView> = std::iter::once(gateway)
            .chain(self.views.iter().cloned())
            .collect();
        let mut signals = ps.reader.read(&nodes, view_at, interval_s);
        signals.pools = counts;
        let oracle = (ps.spec.kind == SimPlannerKind::Oracle)
            .then(|| oracle_forecast(&ps.oracle, elapsed, interval_s, ps.spec.cold_start));
        let decision = ps.planner.plan(&signals, now_ms, oracle);
        let interval = ps.interval;
        let targets: Vec<(Role, u32)> =
            decision.pools.iter().map(|p| (p.role, p.desired)).collect();
        let act = decision.mode == PlannerMode::Act;
        self.out.decisions.push(decision);
        if act {
            for (role, n) in targets {
                self.resize(role, n);
            }
        }
        if self.sessions_left > 0 || !self.requests.is_empty() {
            self.schedule_in(interval, Ev::Plan);
        }
    }

    /// Pool `role` to `n` replicas (ready and starting): spare slots start (ready after the
    /// cold start); above `n`, cold starts are called off first, then the replicas running
    /// the fewest sequences drain (they leave routing and finish what they run).
    fn resize(&mut self, role: Role, n: u32) {
        let Some(cold_start) = self.planner.as_ref().map(|p| p.spec.cold_start) else {
            return;
        };
        let n = n as usize;
        let members: Vec<usize> = (0..self.workers.len())
            .filter(|&i| {
                let w = &self.workers[i];
                w.role == role && matches!(w.phase, Phase::Starting | Phase::Running)
            })
            .collect();
        let now = self.now();
        if n > members.len() {
            let spare: Vec<usize> = (0..self.workers.len())
                .filter(|&i| self.workers[i].role == role && self.workers[i].phase == Phase::Off)
                .take(n - members.len())
                .collect();
            for i in spare {
                let w = &mut self.workers[i];
                w.phase = Phase::Starting;
                w.on_since = Some(now);
                w.generation += 1;
                let generation = w.generation;
                self.schedule_in(cold_start, Ev::Ready(i, generation));
            }
        } else if n < members.len() {
            let mut excess = members.len() - n;
            let starting: Vec<usize> = members
                .iter()
                .rev()
                .copied()
                .filter(|&i| self.workers[i].phase == Phase::Starting)
                .collect();
            for i in starting.into_iter().take(excess) {
                self.workers[i].phase = Phase::Off;
                self.account(i, now);
                excess -= 1;
            }
            let mut running: Vec<(usize, usize)> = members
                .iter()
                .copied()
                .filter(|&i| self.workers[i].phase == Phase::Running)
                .map(|i| (self.workers[i].core.as_ref().map_or(0, |c| c.num_live()), i))
                .collect();
            running.sort_by_key(|&(live, i)| (live, std::cmp::Reverse(i)));
            for (_, i) in running.into_iter().take(excess) {
                self.workers[i].phase = Phase::Draining;
                match self.workers[i].core.as_mut() {
                    Some(core) => {
                        core.drain();
                        self.mark_worker(i);
                    }
                    // Down after a fault: nothing to finish.
                    None => self.retire(i),
                }
            }
        }
        self.note_peak(role);
    }

    /// Worker `i` leaves the fleet (a drained replica with nothing left, or one called off).
    fn retire(&mut self, i: usize) {
        let now = self.now();
        let had_core = self.workers[i].core.take().is_some();
        let w = &mut self.workers[i];
        w.phase = Phase::Off;
        w.parked = None;
        w.ping_parked = false;
        let id = w.id.clone();
        self.groups.leave_all(&id);
        for r in &mut self.routers {
            r.worker_left(&id);
        }
        self.views[i].state = NodeState::Down;
        self.account(i, now);
        if had_core {
            self.fleet_event(FleetEventKind::WorkerDown { worker: id });
        }
    }

    /// Worker `i`'s core, if it is up in incarnation `inc`.
    fn live_core(&mut self, i: usize, inc: u32) -> Option<&mut WorkerCore> {
        let w = &mut self.workers[i];
        if w.incarnation != inc {
            return None;
        }
        w.core.as_mut()
    }

    /// After an input to worker `i`: an error (a hung engine, a broken invariant) takes the
    /// replica down as the live supervisor would, and it restarts.
    fn worker_result<E: std::fmt::Display>(&mut self, i: usize, r: Result<(), E>) {
        self.mark_worker(i);
        if let Err(e) = r {
            tracing::warn!(worker = %self.workers[i].id, error = %e, "simulated replica failed; restarting it");
            self.kill(i);
        }
    }

    /// Worker `i`'s core reads its faults (as the live scheduler reads its node's filters
    /// before each input).
    fn apply_faults(&mut self, i: usize) {
        let faults = self.workers[i].faults;
        if let Some(core) = self.workers[i].core.as_mut() {
            core.set_faults(faults);
        }
        self.mark_worker(i);
    }

    /// A hang ended: the parked step runs, the parked canary answers.
    fn unpark(&mut self, i: usize) {
        if let Some((step, batch)) = self.workers[i].parked.take() {
            self.run_step(i, step, batch);
        }
        if std::mem::take(&mut self.workers[i].ping_parked)
            && let Some(core) = self.workers[i].core.as_mut()
        {
            core.canary_done();
            self.mark_worker(i);
        }
    }

    /// Worker `i`'s engine runs a step: the chaos `slow` delay, then the model's time; a hung
    /// engine keeps it until the hang ends.
    fn run_step(&mut self, i: usize, step: u64, batch: StepBatch) {
        let w = &mut self.workers[i];
        if w.faults.hang {
            w.parked = Some((step, batch));
            return;
        }
        let inc = w.incarnation;
        let delay = w.faults.step_delay;
        self.out.counters.steps += 1;
        let (time, output) = sim::model_step(&self.engine, &batch);
        let result = StepResult {
            step,
            output: Ok(output),
        };
        self.schedule_in(delay + time, Ev::StepDone(i, inc, result));
    }

    /// Worker `i` dies: it leaves every group at once (the Requests' group monitor hears
    /// it), its steps never come back; it restarts after `restart_delay`.
    fn kill(&mut self, i: usize) {
        if self.workers[i].core.take().is_none() {
            return;
        }
        if self.workers[i].phase == Phase::Draining {
            // A draining replica that dies is not restarted: it was leaving.
            self.workers[i].phase = Phase::Off;
            let now = self.now();
            self.account(i, now);
        }
        self.workers[i].parked = None;
        self.workers[i].ping_parked = false;
        self.out.counters.kills += 1;
        let id = self.workers[i].id.clone();
        self.groups.leave_all(&id);
        for r in &mut self.routers {
            r.worker_left(&id);
        }
        self.views[i].state = NodeState::Down;
        self.fleet_event(FleetEventKind::WorkerDown { worker: id.clone() });
        let mut lost: Vec<(RequestId, RequestId)> = self
            .requests
            .iter()
            .filter_map(|(rid, r)| {
                r.core
                    .current()
                    .filter(|(_, w)| **w == id)
                    .map(|(a, _)| (*rid, a))
            })
            .collect();
        lost.sort();
        for (rid, attempt) in lost {
            if let Some(r) = self.requests.get_mut(&rid) {
                r.core.worker_lost(attempt);
            }
            self.mark_request(rid);
        }
        if let Some(d) = self.spec.restart_delay
            && self.workers[i].phase == Phase::Running
        {
            self.schedule_in(d, Ev::Restart(i));
        }
    }

    fn fleet_event(&mut self, ev: FleetEventKind) {
        match &ev {
            FleetEventKind::Placed { .. } => self.out.counters.placements += 1,
            FleetEventKind::Migrated { .. } => self.out.counters.migrations += 1,
            FleetEventKind::GaveUp { .. } => self.out.counters.gave_up += 1,
            FleetEventKind::HandedOff { .. } => self.out.counters.hand_offs += 1,
            _ => {}
        }
        let t = self.since_start_ms();
        self.out.fleet_events.push((t, ev));
    }

    fn start_next_session(&mut self) {
        if self.next_session < self.workload.sessions() {
            let i = self.next_session;
            self.next_session += 1;
            self.schedule_in(Duration::ZERO, Ev::Turn(i, 0));
        }
    }

    /// A client sends turn `k` of session `i`: admission on the published view, then the
    /// request core places it.
    fn start_turn(&mut self, i: usize, k: usize) {
        if k >= self.workload.turns(i) {
            return self.session_done();
        }
        let now = self.now();
        self.first_arrival.get_or_insert(now);
        let turn = self.workload.turn(i, k);
        let sent_s = (now - self.first_arrival.unwrap_or(now)).as_secs_f64();
        let mut record = SimRecord {
            session: i,
            turn: k,
            sent_s,
            prompt_tokens: turn.prompt.len() as u64,
            ..SimRecord::default()
        };
        let class = match self
            .spec
            .config
            .priority
            .resolve(self.workload.class(i), None)
        {
            Ok(c) => c,
            Err(e) => {
                record.error = Some(format!("status 400: {e}"));
                return self.end_session_with(i, k, record);
            }
        };
        record.class = class.as_ref().map(|c| c.tag.name.clone());
        self.refresh_views();
        let verdict = self.admission.decide_for(
            false,
            self.requests.len(),
            Some(&self.views),
            None,
            class.as_ref().map(|c| c.level),
        );
        if verdict != AdmissionVerdict::Admit {
            if let Some(p) = self.planner.as_ref() {
                // As a live gateway counts it: demand the fleet could not take.
                p.gateway.shed();
            }
            self.out.counters.shed += 1;
            record.error = Some(match verdict {
                AdmissionVerdict::Shed { reason, .. } => {
                    let status = if matches!(reason, ShedReason::PriorityClass { .. }) {
                        429
                    } else {
                        503
                    };
                    format!("status {status}: {}", reason.message())
                }
                _ => "status 503: no fleet view".into(),
            });
            return self.end_session_with(i, k, record);
        }
        if waits_for_capacity(&self.views, self.planner_acts(), self.cold_start_timeout()) {
            self.capacity_waits.push(CapacityWaiter {
                session: i,
                turn: k,
                since: now,
                prompt: turn,
                record,
            });
            return self.capacity_waits_changed();
        }
        self.launch(turn, record, now);
    }

    /// Whether the planner in the loop acts (a live gateway sees it in the fleet view).
    fn planner_acts(&self) -> bool {
        self.planner.is_some() && self.spec.config.planner.mode == PlannerMode::Act
    }

    fn cold_start_timeout(&self) -> Duration {
        Duration::from_millis(self.spec.config.gateway.cold_start_timeout_ms)
    }

    /// The count of waiting requests changed: publish it (the planner reads it) and look at
    /// the view again at the next heartbeat, or at the oldest wait's timeout if sooner.
    fn capacity_waits_changed(&mut self) {
        if let Some(p) = self.planner.as_ref() {
            p.gateway
                .set_waiting_for_capacity(self.capacity_waits.len() as u64);
        }
        if self.capacity_check {
            return;
        }
        let Some(oldest) = self.capacity_waits.first().map(|w| w.since) else {
            return;
        };
        let timeout_in = (oldest + self.cold_start_timeout()).saturating_duration_since(self.now());
        self.capacity_check = true;
        self.schedule_in(self.heartbeat.min(timeout_in), Ev::CapacityCheck);
    }

    /// The waiting requests look at the view: with a worker up (or no planner that acts)
    /// they go on, oldest first; past `gateway.cold_start_timeout_ms` one is refused (503),
    /// as the live gateway refuses it.
    fn capacity_check(&mut self) {
        self.capacity_check = false;
        self.refresh_views();
        let now = self.now();
        let timeout = self.cold_start_timeout();
        let go = !waits_for_capacity(&self.views, self.planner_acts(), timeout);
        for w in std::mem::take(&mut self.capacity_waits) {
            let waited = now.saturating_duration_since(w.since);
            if go {
                self.launch(w.prompt, w.record, w.since);
            } else if waited >= timeout {
                if let Some(p) = self.planner.as_ref() {
                    p.gateway.shed();
                }
                self.out.counters.shed += 1;
                let reason = ShedReason::ColdStart {
                    waited_ms: waited.as_millis() as u64,
                };
                let mut record = w.record;
                record.e2e_ms = waited.as_secs_f64() * 1000.0;
                record.error = Some(format!("status 503: {}", reason.message()));
                self.end_session_with(w.session, w.turn, record);
            } else {
                self.capacity_waits.push(w);
            }
        }
        self.capacity_waits_changed();
    }

    /// An admitted request (sent at `sent`) goes to the request core, which places it.
    fn launch(&mut self, turn: SimTurn, record: SimRecord, sent: Instant) {
        if let Some(p) = self.planner.as_ref() {
            // As a live gateway counts it, once the request is on its way.
            p.gateway.arrived(turn.prompt.len() as u64);
        }
        let rid = RequestId(self.next_request);
        self.next_request += 1;
        let job = SubmitRequest {
            request: rid,
            reply_to: NodeId::new(GATEWAY),
            prompt: turn.prompt,
            max_tokens: turn.max_tokens,
            sampling: Default::default(),
            stop_token_ids: vec![],
            ignore_eos: true,
            owner_incarnation: 1,
            waiting_since_ms: self.clock.wall_ms(),
            trace_id: None,
            traceparent: None,
            hand_off: false,
            remote_kv: None,
            fetch: None,
            class: record.class.as_deref().and_then(|n| {
                let c = self.spec.config.priority.resolve(Some(n), None).ok()??;
                Some(c.tag)
            }),
            session: self.workload.session_key(record.session),
        };
        let mut core = RequestCore::new(
            RequestCoreConfig {
                job,
                block_size: self.engine.block_size,
                salt: self.spec.model.salt,
                policy: None,
                pin: None,
                migration: self.spec.config.migration_policy(),
            },
            self.ids.clone(),
            self.shared.clone(),
        );
        core.start();
        self.requests.insert(
            rid,
            SimRequest {
                core,
                sent,
                last_chunk: None,
                record,
                finished: false,
                queued: false,
            },
        );
        self.mark_request(rid);
    }

    /// A session ends after turn `k` with `record` (a failure): the later turns are skipped,
    /// as `flotilla bench` skips them.
    fn end_session_with(&mut self, i: usize, k: usize, record: SimRecord) {
        let now = self.now();
        self.last_completion = Some(now);
        self.out.records.push(record);
        for later in k + 1..self.workload.turns(i) {
            let sent_s = (now - self.first_arrival.unwrap_or(now)).as_secs_f64();
            self.out.records.push(SimRecord {
                session: i,
                turn: later,
                sent_s,
                error: Some("skipped: an earlier turn of the session failed".into()),
                ..SimRecord::default()
            });
        }
        self.session_done();
    }

    fn session_done(&mut self) {
        self.sessions_left = self.sessions_left.saturating_sub(1);
        if matches!(self.arrivals, Arrivals::Closed(_)) {
            self.start_next_session();
        }
    }

    /// The published fleet view, as of the last heartbeat: rebuilt from the workers whose
    /// stats may have changed, at most once per `cluster.heartbeat_interval_ms`.
    fn refresh_views(&mut self) {
        let now = self.now();
        if self
            .views_at
            .is_some_and(|t| now.saturating_duration_since(t) < self.heartbeat)
        {
            return;
        }
        self.views_at = Some(now);
        for (w, view) in self.workers.iter_mut().zip(self.views.iter_mut()) {
            if !w.view_dirty {
                continue;
            }
            w.view_dirty = false;
            if let Some(core) = &w.core {
                core.stats().apply_to(&mut view.workers[0]);
            }
        }
    }

    /// The router request `rid` asks (a client's gateway): drawn from its id, so runs
    /// repeat.
    fn router_of(&self, rid: RequestId) -> usize {
        let n = self.routers.len() as u64;
        if n == 1 {
            return 0;
        }
        // Mixed, so consecutive ids spread.
        (crate::runtime::ids::mix64(rid.0) % n) as usize
    }

    /// Router `k`'s load changes reach the other routers after `net_delay`.
    fn share_load(&mut self, k: usize) {
        let changes = self.routers[k].take_shared();
        if changes.is_empty() || self.routers.len() == 1 {
            return;
        }
        for to in (0..self.routers.len()).filter(|&to| to != k) {
            self.schedule_in(self.spec.net_delay, Ev::LoadSync(to, k, changes.clone()));
        }
    }

    fn drive_request(&mut self, rid: RequestId) {
        let Some(r) = self.requests.get_mut(&rid) else {
            return;
        };
        r.queued = false;
        for e in r.core.take_effects() {
            self.request_effect(rid, e);
        }
    }

    fn request_effect(&mut self, rid: RequestId, effect: RequestEffect) {
        match effect {
            RequestEffect::Route(route) => {
                let k = self.router_of(rid);
                let pick = self.routers[k]
                    .place(route)
                    .map_err(|_| RequestError::RouterReply);
                self.share_load(k);
                if let Some(r) = self.requests.get_mut(&rid) {
                    r.core.picked(pick);
                }
                self.mark_request(rid);
            }
            RequestEffect::Submit { worker, job } => {
                let reached = match self.index.get(&worker).copied() {
                    Some(i) if self.workers[i].core.is_some() => {
                        self.listening.insert(job.request, rid);
                        let r = self.workers[i]
                            .core
                            .as_mut()
                            .map_or(Ok(()), |c| c.submit(*job));
                        self.worker_result(i, r);
                        self.ensure_ticking(i);
                        true
                    }
                    _ => false,
                };
                if let Some(r) = self.requests.get_mut(&rid) {
                    r.core.submitted(reached);
                }
                self.mark_request(rid);
            }
            RequestEffect::Unlisten(attempt) => {
                self.listening.remove(&attempt);
            }
            RequestEffect::Cancel { worker, key } => {
                if let Some(i) = self.index.get(&worker).copied()
                    && let Some(core) = self.workers[i].core.as_mut()
                {
                    let r = core.cancel(&key);
                    self.worker_result(i, r);
                }
            }
            RequestEffect::ReleasePlacement((node, id)) => {
                let k = self.router_of(rid);
                self.routers[k].release(node, id);
                self.share_load(k);
            }
            RequestEffect::FirstToken((node, id)) => {
                let k = self.router_of(rid);
                self.routers[k].first_token(node, id);
                self.share_load(k);
            }
            RequestEffect::AskHas { worker, key } => {
                let has = self
                    .index
                    .get(&worker)
                    .and_then(|i| self.workers[*i].core.as_ref())
                    .is_some_and(|c| c.has(&key));
                if let Some(r) = self.requests.get_mut(&rid) {
                    r.core.has_answer(key.1, has);
                }
                self.mark_request(rid);
            }
            RequestEffect::Deliver(ev) => self.deliver(rid, ev),
            RequestEffect::RetryAt(at) => self.schedule_at(at, Ev::Retry(rid)),
            RequestEffect::Fleet(ev) => self.fleet_event(ev),
            RequestEffect::Stop => self.request_done(rid),
        }
    }

    /// What the client sees of an event (the gateway's handler: a chunk per token).
    fn deliver(&mut self, rid: RequestId, ev: TokenEventKind) {
        let now = self.now();
        let Some(r) = self.requests.get_mut(&rid) else {
            return;
        };
        match ev {
            // A migrated request's later admissions: its usage keeps the first one's.
            TokenEventKind::Admitted { cached_tokens, .. } if r.record.cached_tokens.is_none() => {
                r.record.cached_tokens = Some(u64::from(cached_tokens));
            }
            TokenEventKind::Admitted { .. } => {}
            TokenEventKind::Token { finish, .. } => {
                match r.last_chunk {
                    None => r.record.ttft_ms = Some(ms(now - r.sent)),
                    Some(last) => r.record.itl_ms.push(ms(now - last)),
                }
                r.last_chunk = Some(now);
                r.record.output_tokens += 1;
                if finish.is_some() {
                    r.finished = true;
                }
            }
            TokenEventKind::Failed { message, status } => {
                r.record.error = Some(format!("status {status}: {message}"));
            }
            TokenEventKind::Lost { .. }
            | TokenEventKind::HandOff(_)
            | TokenEventKind::Prompt { .. } => {}
        }
    }

    fn request_done(&mut self, rid: RequestId) {
        let now = self.now();
        let Some(r) = self.requests.remove(&rid) else {
            return;
        };
        let mut record = r.record;
        record.e2e_ms = ms(now - r.sent);
        record.ok = r.finished && record.error.is_none();
        if !record.ok && record.error.is_none() {
            record.error = Some("status 200: incomplete stream".into());
        }
        let (i, k, ok) = (record.session, record.turn, record.ok);
        if ok && let Some(p) = self.planner.as_ref() {
            if let Some(t) = record.ttft_ms {
                p.gateway.first_token(t);
            }
            for &gap in &record.itl_ms {
                p.gateway.next_token(gap);
            }
            p.gateway
                .finished(record.output_tokens, record.cached_tokens.unwrap_or(0));
        }
        if ok {
            self.last_completion = Some(now);
            self.out.records.push(record);
            self.schedule_in(Duration::ZERO, Ev::Turn(i, k + 1));
        } else {
            self.end_session_with(i, k, record);
        }
    }

    /// A worker with work ticks every `tick_period`, as the live scheduler does.
    fn ensure_ticking(&mut self, i: usize) {
        let w = &mut self.workers[i];
        if w.ticking || w.core.is_none() {
            return;
        }
        w.ticking = true;
        let inc = w.incarnation;
        self.schedule_in(self.tick_period, Ev::Tick(i, inc));
    }

    fn drive_worker(&mut self, i: usize) {
        self.workers[i].queued = false;
        loop {
            let Some(core) = self.workers[i].core.as_mut() else {
                return;
            };
            let effects = core.take_effects();
            let mut out: Vec<TokenEvent> = Vec::new();
            let undelivered = core.has_undelivered();
            if effects.is_empty() && !undelivered {
                break;
            }
            for e in effects {
                self.worker_effect(i, e);
            }
            if let Some(core) = self.workers[i].core.as_mut()
                && core.has_undelivered()
            {
                core.flush(
                    |_, events| {
                        out.extend(events);
                        Ok(())
                    },
                    |_| OwnerStatus::Present,
                );
            }
            if !out.is_empty() {
                self.schedule_in(self.spec.net_delay, Ev::Tokens(out));
            }
        }
        let busy = self.workers[i].core.as_ref().is_some_and(|c| !c.is_idle());
        if busy {
            self.ensure_ticking(i);
        } else if self.workers[i].phase == Phase::Draining && self.workers[i].core.is_some() {
            self.retire(i);
        }
    }

    fn worker_effect(&mut self, i: usize, effect: WorkerEffect) {
        let inc = self.workers[i].incarnation;
        let id = self.workers[i].id.clone();
        match effect {
            WorkerEffect::Step { step, batch } => self.run_step(i, step, batch),
            WorkerEffect::Pull(job) => {
                let result = |outcome| PullResult {
                    seq: job.seq,
                    outcome,
                    bytes: 0,
                };
                let from = job.from.as_ref().and_then(|w| self.index.get(w).copied());
                let from = from.map(|p| (p, self.workers[p].incarnation));
                match &job.work {
                    work @ PullWork::Sim { .. } => {
                        if let Some((time, outcome)) = work.simulated(job.blocks) {
                            let r = result(outcome);
                            self.schedule_in(time, Ev::PullDone(i, inc, r, from));
                        }
                    }
                    PullWork::Fail(why) => {
                        let r = result(Err(why.clone()));
                        self.schedule_in(Duration::ZERO, Ev::PullDone(i, inc, r, from));
                    }
                    PullWork::Transport { .. } => {
                        let r = result(Err("no transport in the simulator".into()));
                        self.schedule_in(Duration::ZERO, Ev::PullDone(i, inc, r, from));
                    }
                }
            }
            WorkerEffect::Fetch {
                holder,
                key,
                tokens,
                ..
            } => {
                // The ask and its answer each cross the network once.
                let answer = match self.index.get(&holder).copied() {
                    Some(p) => match self.workers[p].core.as_mut() {
                        Some(core) => core.export(key.clone(), &tokens, None),
                        None => Err(format!("the holder {holder} is down")),
                    },
                    None => Err(format!("the holder {holder} is gone")),
                };
                self.schedule_in(
                    2 * self.spec.net_delay,
                    Ev::FetchDone(i, inc, key, Box::new(answer)),
                );
            }
            WorkerEffect::TierCopies(copies) => {
                // Each lane carries out its copies one after another, after what it has queued;
                // a batch lands at once when its last copy ends.
                let (store, load): (Vec<_>, Vec<_>) =
                    copies.into_iter().partition(|c| c.is_store());
                let now = self.now();
                for (lane, batch) in [(true, store), (false, load)] {
                    if batch.is_empty() {
                        continue;
                    }
                    let took = self.tier_links.time(&batch, self.engine.block_size);
                    let w = &mut self.workers[i];
                    let free = if lane {
                        &mut w.store_lane
                    } else {
                        &mut w.load_lane
                    };
                    let end = (*free).max(now) + took;
                    *free = end;
                    let results = batch.iter().map(|c| (c.id, CopyOutcome::Done)).collect();
                    self.schedule_at(end, Ev::CopiesDone(i, inc, results));
                }
            }
            WorkerEffect::Release(_) => {}
            WorkerEffect::ConfirmPull { prefill, key } => {
                if let Some(p) = self.index.get(&prefill).copied()
                    && let Some(core) = self.workers[p].core.as_mut()
                {
                    let r = core.cancel(&key);
                    self.worker_result(p, r);
                }
            }
            WorkerEffect::KvEvents { events, .. } => {
                if self.drop_kv {
                    self.out.counters.kv_batches_dropped += 1;
                } else {
                    self.schedule_in(self.spec.kv_event_delay, Ev::KvEvents(events));
                }
            }
            WorkerEffect::Join(group) => self.groups.join(group, &id),
            WorkerEffect::Leave(group) => self.groups.leave(group, &id),
            WorkerEffect::RoleChanged(role) => {
                self.fleet_event(FleetEventKind::RoleChanged { worker: id, role })
            }
            WorkerEffect::KickAt(at) => self.schedule_at(at, Ev::Kick(i, inc)),
            WorkerEffect::Ping => {
                if self.workers[i].faults.hang {
                    self.workers[i].ping_parked = true;
                } else if let Some(core) = self.workers[i].core.as_mut() {
                    core.canary_done();
                }
            }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Pools in the order reports list them.
fn pool_order(r: Role) -> u8 {
    match r {
        Role::Aggregated => 0,
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

/// The workload's true load per planner interval: (requests, prompt tokens, output tokens)
/// of the sessions arriving in it (a session's every turn counted at its arrival).
fn oracle_series(
    workload: &dyn SimWorkload,
    offsets: &[f64],
    interval_s: f64,
) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (i, off) in offsets.iter().enumerate().take(workload.sessions()) {
        let k = (off / interval_s).floor().max(0.0) as usize;
        if k > 10_000_000 {
            continue;
        }
        if out.len() <= k {
            out.resize(k + 1, (0, 0, 0));
        }
        for t in 0..workload.turns(i) {
            let turn = workload.turn(i, t);
            out[k].0 += 1;
            out[k].1 += turn.prompt.len() as u64;
            out[k].2 += u64::from(turn.max_tokens);
        }
    }
    out
}

/// The oracle's forecast at `elapsed`: the peak rate and the mean lengths over the interval
/// ahead and the cold start before it.
fn oracle_forecast(
    series: &[(u64, u64, u64)],
    elapsed: Duration,
    interval_s: f64,
    cold_start: Duration,
) -> Forecast {
    let k0 = (elapsed.as_secs_f64() / interval_s + 1e-6).floor() as usize;
    let ahead = (cold_start.as_secs_f64() / interval_s).ceil() as usize;
    let (mut peak, mut n, mut prompt, mut output) = (0u64, 0u64, 0u64, 0u64);
    for &(r, p, o) in series.iter().skip(k0).take(ahead + 1) {
        peak = peak.max(r);
        n += r;
        prompt += p;
        output += o;
    }
    let mean = |x: u64| if n == 0 { 0.0 } else { x as f64 / n as f64 };
    Forecast {
        request_rate: peak as f64 / interval_s,
        prompt_tokens: mean(prompt),
        output_tokens: mean(output),
        cached_tokens: 0.0,
    }
}

/// The replicas each pool of `spec`'s shape needs for the busiest interval of the workload,
/// by the planner's own capacity rule (with its headroom): the size of a static fleet built
/// for the peak.
pub fn static_peak(
    spec: &SimSpec,
    capacity: &CapacityProfile,
    workload: &dyn SimWorkload,
    offsets: &[f64],
) -> Vec<(Role, u32)> {
    let cfg = &spec.config.planner;
    let planner = Planner::new(cfg.clone(), capacity.clone());
    let series = oracle_series(workload, offsets, cfg.interval_s);
    let pools = [
        (Role::Aggregated, spec.workers),
        (Role::Prefill, spec.prefill),
        (Role::Decode, spec.decode),
    ];
    pools
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|&(role, _)| {
            let need = series
                .iter()
                .map(|&(r, p, o)| {
                    let f = Forecast {
                        request_rate: r as f64 / cfg.interval_s,
                        prompt_tokens: if r > 0 { p as f64 / r as f64 } else { 0.0 },
                        output_tokens: if r > 0 { o as f64 / r as f64 } else { 0.0 },
                        cached_tokens: 0.0,
                    };
                    planner.replicas_for(role, &f, 0.0).1
                })
                .fold(0.0f64, f64::max);
            let b = cfg.bounds(role);
            (
                role,
                ((need - 1e-9).ceil().max(1.0) as u32).clamp(b.min.max(1), b.max),
            )
        })
        .collect()
}
