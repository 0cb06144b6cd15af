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
//!
//! This file holds what a run is given (the spec with its [`Config`], the workload, the
//! arrivals), the fleet's state and its construction, and the published fleet view. The rest is
//! one concern a file, mostly `impl SimFleet` blocks over the state defined here:
//! - `event.rs`: the event queue and the clock: the events, their heap, the loop, dispatch;
//! - `fault.rs`: the faults a run is given and what they do (kill, slow, hang);
//! - `worker.rs`: a worker slot's life: boot, steps, its core's effects, retirement;
//! - `request.rs`: a request's life: sessions and turns, admission, the wait for capacity,
//!   the request core's effects, what the client sees;
//! - `groups.rs`: the worker sets the router reads (the live fleet's process groups);
//! - `planner.rs`: the planner in the loop, pool sizes and replica-seconds, the oracle;
//! - `outcome.rs`: what a run gives: records, counters, leftovers, the final tally.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use crate::control::discovery::membership::{NodeState, NodeView, WorkerView};
use crate::control::planner::{CapacityProfile, Planner, ViewReader};
use crate::kv::TierConfig;
use crate::request_plane::admission::Admission;
use crate::request_plane::router::core::{DisaggRouting, RouterCore, RouterCoreArgs};
use crate::runtime::clock::{Clock, Instant, ManualClock, SharedClock};
use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::role::Role;
use crate::runtime::signals::GatewayCounters;
use crate::sim::SimConfig;
use crate::worker::engine::sim::{SimEngineArgs, SimProfile};
use crate::worker::scheduler::{DisaggWorker, InjectedFaults, SimTierLinks, WorkerCoreConfig};

mod event;
mod fault;
mod groups;
mod outcome;
mod planner;
mod request;
mod worker;

use event::{Ev, Scheduled};
pub use fault::SimFault;
use groups::Groups;
pub use outcome::{SimCounters, SimLeftovers, SimOutcome, SimRecord};
pub use planner::static_peak;
use planner::{SimPlannerState, oracle_series};
use request::{CapacityWaiter, SimRequest};
use worker::{Phase, SimWorker};

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
    pub config: SimConfig,
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
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
