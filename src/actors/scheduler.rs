//! The Scheduler actor: one per replica, the thin driver of [`WorkerCore`].
//!
//! It keeps only the messaging: it reads the chaos faults aimed at its replica, feeds each
//! message to the core, and carries out the core's [`WorkerEffect`]s — hands steps to its
//! engine worker and pulls to the node's transport (each as a task that answers with a
//! message), releases sequences at the engine, confirms pulls to prefill workers, forwards
//! the pool's KV events to the replica's
//! [`KvEventPublisher`](crate::actors::kv_publisher::KvEventPublisher), joins and leaves
//! process groups, pings the engine — then flushes the core's token events to the owners'
//! token sinks and publishes the replica's stats on the node's board. It fails (so that its
//! supervisor restarts the replica) when the core finds the engine hung or the engine worker
//! gone. The policy, the disaggregation protocol and the step protocol are described in
//! [`crate::worker::scheduler`].

use crate::kv::{CopyId, CopyOutcome, TierConfig, TierCopy};
use crate::worker::scheduler::{
    BlockPool, DisaggWorker, PullJob, PullResult, PullWork, SCHEDULER_GROUP, SchedulerConfig,
    SchedulerCore, SchedulerStats, SimTierLinks, SimTransfer, StatsBoard, StepResult, WorkerCore,
    WorkerCoreConfig, WorkerCoreError, WorkerEffect,
};
use crate::worker::tiers::{TierCopier, TierStores};

use crate::actors::engine_worker::EngineWorkerMsg;
use crate::actors::kv_publisher::KvPublisherMsg;
use crate::request_plane::events::FleetEventKind;
use crate::request_plane::protocol::{self, SubmitRequest};
use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::role::Role;
use crate::runtime::wire::Wire;
use crate::worker::WorkerError;
use crate::worker::engine::StepBatch;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
/// Scheduler messages. Serializable: Request actors on any node submit and cancel.
#[derive(RactorClusterMessage)]
pub enum SchedulerMsg {
    /// Queue a request (cast). Refusals come back as a `Failed` token event.
    Submit(Wire<SubmitRequest>),
    /// Cancel `(node, request)` (cast; unknown ids are ignored). Frees its blocks at once.
    Cancel(Wire<(NodeId, RequestId)>),
    /// Local: the engine finished a step.
    StepDone(Wire<StepResult>),
    /// Load and memory (call).
    #[rpc]
    Stats(RpcReplyPort<Wire<SchedulerStats>>),
    /// Whether `(node, request)` is still here (call; a Request that heard nothing for a
    /// while asks, in case events were lost on the way).
    #[rpc]
    Has(Wire<(NodeId, RequestId)>, RpcReplyPort<Wire<bool>>),
    /// Local, periodic: the step watchdog and the canary.
    Tick(Wire<()>),
    /// Local: the canary's ping came back.
    CanaryDone(Wire<()>),
    /// Local: a gather window for migrated requests ended (`WorkerEffect::KickAt`).
    Kick(Wire<()>),
    /// Stop taking new work (leave routing); running requests go on (cast).
    Drain(Wire<()>),
    /// Hand off every request still here: each gets [`TokenEventKind::Lost`] with this
    /// reason and migrates (cast; the end of a drain's grace period).
    HandOffAll(Wire<String>),
    /// Local: a pull of remote KV returned.
    PullDone(Wire<PullResult>),
    /// Local: copies between KV tiers returned.
    CopiesDone(Wire<Vec<(CopyId, CopyOutcome)>>),
    /// Change this replica's role (cast): it leaves routing, finishes what it runs, then
    /// switches and is routable again.
    SetRole(Wire<Role>),
    /// Peer pull, holder side (call): pin the leading blocks of these tokens held in G1 for
    /// the peer's request `(node, request)`, answered with what to pull (or why not); the
    /// peer's `Cancel` of the same key unpins them.
    #[rpc]
    Export(
        Wire<((NodeId, RequestId), Vec<u32>)>,
        RpcReplyPort<Wire<Result<protocol::RemoteKv, String>>>,
    ),
    /// Local: a holder answered a fetch (or did not in time).
    FetchDone(Wire<((NodeId, RequestId), Result<protocol::RemoteKv, String>)>),
}

impl SchedulerMsg {
    /// Whether handling this message can change what a scheduler publishes on its node's
    /// board (every message but the two queries).
    pub fn may_change_stats(&self) -> bool {
        !matches!(self, SchedulerMsg::Stats(_) | SchedulerMsg::Has(..))
    }
}

/// Spawn inputs of a Scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerArgs {
    /// This replica's worker id.
    pub worker: WorkerId,
    /// Registered name of the replica's engine worker.
    pub engine_name: String,
    /// Registered name of the replica's KV event publisher, if it runs one.
    pub kv_publisher_name: Option<String>,
    /// Batch limits.
    pub config: SchedulerConfig,
    /// KV pool geometry: blocks, tokens per block, hash salt.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Hash salt (model identity).
    pub salt: u64,
    /// End-of-sequence token.
    pub eos_token_id: Option<u32>,
    /// The chaos faults aimed at this node's replicas (the worker boundary's filter): the
    /// scheduler reads its own (`panic`, `fill_kv`, the `slow` delay its watchdog allows for)
    /// and ends `hang`s when it restarts the replica; the engine's chaos filter applies the
    /// rest.
    pub faults: crate::worker::faults::WorkerFaults,
    /// Step watchdog: a step (engine time, not injected delay) longer than this is a hang.
    pub step_timeout: std::time::Duration,
    /// An idle replica pings its engine this often.
    pub canary_interval: std::time::Duration,
    /// How long the owner of sequences may be missing from the token sinks' group (a sink
    /// restarting, a node suspect) before its sequences are aborted (`cluster.liveness_timeout_ms`).
    pub owner_grace: std::time::Duration,
    /// This node's resilience counters (engine hangs).
    pub stats: std::sync::Arc<crate::runtime::resilience::NodeStats>,
    /// The replica's role at start (`worker.role`).
    pub role: Role,
    /// Disaggregation settings.
    pub disagg: DisaggWorker,
    /// The node's KV transport: pulls go through its actor, and a prefill worker describes
    /// its region with it.
    pub transport: Option<std::sync::Arc<crate::transport::Transport>>,
    /// On a simulated engine: the modelled transfer time of a pull.
    pub sim_transfer: Option<SimTransfer>,
    /// Peer pulls (G4): `None` when off (`Config::peer_pull_worker`).
    pub peer_pull: Option<crate::worker::scheduler::PeerPullWorker>,
    /// The pool's lower tiers (G2 host, G3 disk: `kv/tiers.rs`).
    pub tiers: TierConfig,
    /// On a simulated engine: the modelled speed of copies between tiers.
    pub tier_links: Option<SimTierLinks>,
    /// On a real engine: where the engine published its KV memory (the tier copier's G1).
    pub kv_region: crate::worker::tiers::KvRegionSlot,
    /// On a real engine: G3's directory.
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Send the token ids of stored blocks with the KV events (the replica publishes
    /// vLLM-format events, which carry them).
    pub token_events: bool,
    /// Where this scheduler publishes its stats (the node's board).
    pub board: StatsBoard,
    /// Time: the outbox's grace, the watchdog's deadlines, holds, the admission window.
    pub clock: crate::runtime::clock::SharedClock,
    /// The node's fleet event bus (role changes).
    pub bus: crate::request_plane::events::EventBus,
}

/// Scheduler state: the core, and what carrying out its effects needs.
pub struct SchedulerState {
    args: SchedulerArgs,
    core: WorkerCore,
    engine: ActorRef<EngineWorkerMsg>,
    ticker: Option<tokio::task::JoinHandle<()>>,
    /// When the modelled tier copy lanes are free again (sim engine: store, load).
    lanes: [tokio::time::Instant; 2],
    /// On a real engine with lower tiers: the threads that move their bytes.
    copier: Option<TierCopier>,
}

/// The Scheduler actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct Scheduler;

impl SchedulerState {
    /// Carry out what the core asked for and deliver its token events, until it asks for
    /// nothing more (a flush that finds an owner gone aborts its sequences, which releases
    /// them at the engine and sends KV events).
    fn apply(&mut self, myself: &ActorRef<SchedulerMsg>) {
        let mut effects = self.core.take_effects();
        loop {
            for effect in effects {
                self.carry_out(myself, effect);
            }
            if self.core.has_undelivered() {
                self.core.flush(protocol::deliver, protocol::owner_status);
            }
            effects = self.core.take_effects();
            if effects.is_empty() {
                return;
            }
        }
    }

    fn carry_out(&mut self, myself: &ActorRef<SchedulerMsg>, effect: WorkerEffect) {
        match effect {
            WorkerEffect::Step { step, batch } => self.run_step(myself, step, batch),
            WorkerEffect::Pull(job) => self.run_pull(myself, job),
            WorkerEffect::Fetch {
                holder,
                key,
                tokens,
                timeout,
            } => {
                let me = myself.clone();
                tokio::spawn(async move {
                    let answer = ask_holder(&holder, key.clone(), tokens, timeout).await;
                    let _ = me.cast(SchedulerMsg::FetchDone(Wire::encode(&(key, answer))));
                });
            }
            WorkerEffect::TierCopies(copies) => self.run_copies(myself, copies),
            WorkerEffect::Release(seq) => {
                let _ = self.engine.cast(EngineWorkerMsg::Release(seq));
            }
            WorkerEffect::ConfirmPull { prefill, key } => {
                let name = format!("{prefill}/scheduler");
                if let Some(s) = crate::runtime::cluster::member_named(SCHEDULER_GROUP, &name) {
                    let s: ActorRef<SchedulerMsg> = s.into();
                    let _ = s.cast(SchedulerMsg::Cancel(Wire::encode(&key)));
                }
            }
            WorkerEffect::KvEvents { events, tokens } => {
                if let Some(name) = &self.args.kv_publisher_name
                    && let Some(cell) = ractor::registry::where_is(name.clone())
                {
                    let publisher: ActorRef<KvPublisherMsg> = cell.into();
                    if !tokens.is_empty() {
                        let _ = publisher.cast(KvPublisherMsg::EventTokens(Wire::encode(&tokens)));
                    }
                    let _ = publisher.cast(KvPublisherMsg::Events(Wire::encode(&events)));
                }
            }
            WorkerEffect::Join(group) => {
                ractor::pg::join(group.to_owned(), vec![myself.get_cell()]);
            }
            WorkerEffect::Leave(group) => {
                ractor::pg::leave(group.to_owned(), vec![myself.get_cell()]);
            }
            WorkerEffect::RoleChanged(role) => self.args.bus.emit(FleetEventKind::RoleChanged {
                worker: self.args.worker.clone(),
                role,
            }),
            WorkerEffect::KickAt(at) => {
                let wait = at.saturating_duration_since(self.args.clock.now());
                myself.send_after(wait, || SchedulerMsg::Kick(Wire::encode(&())));
            }
            WorkerEffect::Ping => {
                let (engine, me) = (self.engine.clone(), myself.clone());
                tokio::spawn(async move {
                    if ractor::call!(engine, EngineWorkerMsg::Ping).is_ok() {
                        let _ = me.cast(SchedulerMsg::CanaryDone(Wire::encode(&())));
                    }
                });
            }
        }
    }

    /// A step on the engine, as a task that answers `StepDone`.
    fn run_step(&self, myself: &ActorRef<SchedulerMsg>, step: u64, batch: StepBatch) {
        let (engine, me) = (self.engine.clone(), myself.clone());
        tokio::spawn(async move {
            let output = match ractor::call!(engine, EngineWorkerMsg::Step, batch) {
                Ok(answer) => answer.map_err(WorkerError::Engine),
                Err(e) => Err(WorkerError::EngineGone(e.to_string())),
            };
            let _ = me.cast(SchedulerMsg::StepDone(Wire::encode(&StepResult {
                step,
                output,
            })));
        });
    }

    /// Copies between KV tiers: on a simulated engine each lane (store, load) carries out its
    /// copies one after another at the modelled speed, and a batch answers `CopiesDone` when
    /// its last copy ends. An engine without a copier answers them failed (the pool then
    /// recomputes; configuration refuses tiers there).
    fn run_copies(&mut self, myself: &ActorRef<SchedulerMsg>, copies: Vec<TierCopy>) {
        let done = |r: Vec<(CopyId, CopyOutcome)>| SchedulerMsg::CopiesDone(Wire::encode(&r));
        if let Some(copier) = &self.copier {
            let me = myself.clone();
            copier.submit(copies, move |r| {
                let _ = me.cast(done(r));
            });
            return;
        }
        let Some(links) = self.args.tier_links else {
            let r = copies.iter().map(|c| (c.id, CopyOutcome::Failed)).collect();
            let _ = myself.cast(done(r));
            return;
        };
        let (store, load): (Vec<_>, Vec<_>) = copies.into_iter().partition(|c| c.is_store());
        let now = tokio::time::Instant::now();
        for (lane, batch) in [(0, store), (1, load)] {
            if batch.is_empty() {
                continue;
            }
            let end = self.lanes[lane].max(now) + links.time(&batch, self.args.block_size);
            self.lanes[lane] = end;
            let r: Vec<_> = batch.iter().map(|c| (c.id, CopyOutcome::Done)).collect();
            let me = myself.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(end).await;
                let _ = me.cast(done(r));
            });
        }
    }

    /// A pull of remote KV (the node's transport actor, or the sim engine's modelled
    /// transfer), as a task that answers `PullDone`.
    fn run_pull(&self, myself: &ActorRef<SchedulerMsg>, job: PullJob) {
        let PullJob {
            seq, blocks, work, ..
        } = job;
        let done = move |outcome, bytes| {
            SchedulerMsg::PullDone(Wire::encode(&PullResult {
                seq,
                outcome,
                bytes,
            }))
        };
        let me = myself.clone();
        match work {
            PullWork::Fail(why) => {
                let _ = me.cast(done(Err(why), 0));
            }
            work @ PullWork::Sim { .. } => {
                if let Some((time, outcome)) = work.simulated(blocks) {
                    tokio::spawn(async move {
                        tokio::time::sleep(time).await;
                        let _ = me.cast(done(outcome, 0));
                    });
                }
            }
            PullWork::Transport {
                from,
                pairs,
                budget,
            } => {
                let Some(t) = self.args.transport.clone() else {
                    let _ = me.cast(done(Err("no transport to pull the KV with".into()), 0));
                    return;
                };
                let req = crate::transport::PullRequest {
                    from,
                    into: self.args.worker.to_string(),
                    blocks: pairs,
                    deadline: std::time::Instant::now() + budget,
                };
                tokio::spawn(async move {
                    let (outcome, bytes) = match pull(&t, req).await {
                        Ok(bytes) => (Ok(blocks), bytes),
                        Err(why) => (Err(why), 0),
                    };
                    let _ = me.cast(done(outcome, bytes));
                });
            }
        }
    }

    /// The faults aimed at this replica now.
    fn read_faults(&mut self) {
        let faults = self.args.faults.injected(&self.args.worker);
        self.core.set_faults(faults);
    }
}

/// On a real engine with lower tiers: the copier over the engine's KV memory, and the tiers
/// that can be had (G3 off when its segment cannot be made; no tiers when the engine published
/// no memory). Each loss is logged once.
fn tier_copier(
    args: &SchedulerArgs,
    myself: &ActorRef<SchedulerMsg>,
) -> (TierConfig, Option<TierCopier>) {
    let mut tiers = args.tiers;
    if !tiers.is_on() || args.tier_links.is_some() {
        return (tiers, None);
    }
    let w = args.worker.to_string();
    let region = args
        .kv_region
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let Some((g1, layout)) = region else {
        tracing::error!(worker = %w, "the engine offers no copies of its KV memory: KV tiers off");
        metrics::counter!("flotilla_kv_tier_off_total", "tier" => "host").increment(1);
        return (TierConfig::default(), None);
    };
    let disk = match (&args.kv_disk_dir, tiers.disk_blocks) {
        (Some(dir), n) if n > 0 => Some((dir.as_path(), n as u32)),
        _ => None,
    };
    let (stores, why) = match TierStores::new(g1, layout, tiers.host_blocks as u32, disk, &w) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(worker = %w, error = %e, "KV tiers off");
            metrics::counter!("flotilla_kv_tier_off_total", "tier" => "host").increment(1);
            return (TierConfig::default(), None);
        }
    };
    if let Some(why) = why {
        tracing::error!(worker = %w, error = %why, "the disk KV tier (G3) cannot be used: it is off; serving goes on");
        metrics::counter!("flotilla_kv_tier_off_total", "tier" => "disk").increment(1);
        tiers.disk_blocks = 0;
    }
    let me = myself.clone();
    let done = move |r: Vec<(CopyId, CopyOutcome)>| {
        let _ = me.cast(SchedulerMsg::CopiesDone(Wire::encode(&r)));
    };
    match TierCopier::start(std::sync::Arc::new(stores), done) {
        Ok(c) => (tiers, Some(c)),
        Err(e) => {
            tracing::error!(worker = %w, error = %e, "KV tier copier threads: tiers off");
            (TierConfig::default(), None)
        }
    }
}

/// The region a decode worker reads `worker`'s KV from.
fn region_of(
    transport: Option<&crate::transport::Transport>,
    worker: &str,
) -> Option<crate::transport::RegionDescriptor> {
    transport?
        .descriptors()
        .into_iter()
        .find(|d| d.id.owner == worker)
}

impl Actor for Scheduler {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SchedulerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let engine: ActorRef<EngineWorkerMsg> =
            ractor::registry::where_is(args.engine_name.clone())
                .ok_or_else(|| format!("engine worker {} is not running", args.engine_name))?
                .into();
        let (tiers, copier) = tier_copier(&args, &myself);
        let mut pool = BlockPool::new(args.num_blocks, args.block_size, args.salt)?
            .with_tiers(tiers)?
            .with_worker(args.worker.clone());
        if args.token_events {
            pool = pool.with_token_events();
        }
        let batcher = SchedulerCore::new(args.config, pool)?;
        let core = WorkerCore::new(
            WorkerCoreConfig {
                worker: args.worker.clone(),
                eos_token_id: args.eos_token_id,
                block_size: args.block_size,
                role: args.role,
                disagg: args.disagg,
                step_timeout: args.step_timeout,
                canary_interval: args.canary_interval,
                owner_grace: args.owner_grace,
                has_transport: args.transport.is_some(),
                sim_transfer: args.sim_transfer,
                peer_pull: args.peer_pull,
            },
            batcher,
            args.clock.clone(),
        );
        let period = (args.step_timeout / 4).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_millis(500),
        );
        let ticker = myself.send_interval(period, || SchedulerMsg::Tick(Wire::encode(&())));
        let mut state = SchedulerState {
            args,
            core,
            engine,
            ticker: Some(ticker),
            lanes: [tokio::time::Instant::now(); 2],
            copier,
        };
        state.apply(&myself);
        state.args.board.publish(state.core.stats());
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Nothing is left hanging: every live request hears that this replica stopped, and
        // migrates with what it has.
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        state.args.board.remove(&state.args.worker);
        state.core.stop();
        state.core.flush(protocol::deliver, protocol::owner_status);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let changes = msg.may_change_stats();
        if changes {
            state.read_faults();
        }
        let out = handle_msg(msg, state);
        if changes {
            state.apply(&myself);
            // Pushed, not pulled: the node's board is what Discovery and admission read.
            state.args.board.publish(state.core.stats());
        }
        match out {
            Err(WorkerCoreError::Hung(hung)) => {
                state.args.stats.count_engine_hang();
                metrics::counter!("flotilla_engine_hangs_total", "worker" => state.args.worker.to_string())
                    .increment(1);
                tracing::error!(worker = %state.args.worker, "{hung}; restarting the replica");
                // A restart is what ends a hang (the injected one included).
                state.args.faults.end_hangs(&state.args.worker);
                Err(format!("engine of {} hung", state.args.worker).into())
            }
            Err(e) => Err(e.into()),
            Ok(()) => Ok(()),
        }
    }
}

/// One message: the core's input (see [`Scheduler`]'s `handle`, which carries out the effects
/// and publishes the stats after it).
fn handle_msg(msg: SchedulerMsg, state: &mut SchedulerState) -> Result<(), WorkerCoreError> {
    match msg {
        SchedulerMsg::Submit(wire) => {
            if let Ok(req) = wire.decode() {
                state.core.submit(req)?;
            }
        }
        SchedulerMsg::Cancel(wire) => {
            if let Ok(key) = wire.decode() {
                state.core.cancel(&key)?;
            }
        }
        SchedulerMsg::StepDone(wire) => {
            let Ok(result) = wire.decode() else {
                tracing::error!(worker = %state.args.worker, "a step result that does not decode");
                return Ok(());
            };
            let transport = state.args.transport.clone();
            let worker = state.args.worker.to_string();
            state
                .core
                .step_done(result, || region_of(transport.as_deref(), &worker))?;
        }
        SchedulerMsg::PullDone(wire) => {
            if let Ok(result) = wire.decode() {
                state.core.pull_done(result)?;
            }
        }
        SchedulerMsg::CopiesDone(wire) => {
            if let Ok(results) = wire.decode() {
                let results: Vec<(CopyId, CopyOutcome)> = results;
                state.core.copies_done(&results)?;
            }
        }
        SchedulerMsg::Export(wire, reply) => match wire.decode() {
            Ok((key, tokens)) => {
                let transport = state.args.transport.clone();
                let worker = state.args.worker.to_string();
                let region = region_of(transport.as_deref(), &worker);
                let answer = state.core.export(key.clone(), &tokens, region);
                let pinned = answer.is_ok();
                if reply.send(Wire::encode(&answer)).is_err() && pinned {
                    // The peer stopped waiting: unpin at once.
                    state.core.cancel(&key)?;
                }
            }
            Err(e) => {
                let answer: Result<protocol::RemoteKv, String> =
                    Err(format!("a request that does not decode: {e}"));
                let _ = reply.send(Wire::encode(&answer));
            }
        },
        SchedulerMsg::FetchDone(wire) => {
            if let Ok((key, answer)) = wire.decode() {
                state.core.fetch_done(&key, answer)?;
            }
        }
        SchedulerMsg::SetRole(wire) => {
            if let Ok(role) = wire.decode() {
                state.core.set_role(role);
            }
        }
        SchedulerMsg::Stats(reply) => {
            let _ = reply.send(Wire::encode(&state.core.stats()));
        }
        SchedulerMsg::Has(key, reply) => {
            let here = key.decode().is_ok_and(|k| state.core.has(&k));
            let _ = reply.send(Wire::encode(&here));
        }
        SchedulerMsg::Tick(_) => {
            if state.args.faults.take_panic(&state.args.worker) {
                panic!(
                    "injected panic in the scheduler of {} (chaos)",
                    state.args.worker
                );
            }
            state.core.tick(protocol::owner_status)?;
        }
        SchedulerMsg::CanaryDone(_) => state.core.canary_done(),
        SchedulerMsg::Kick(_) => state.core.kick_due()?,
        SchedulerMsg::Drain(_) => state.core.drain(),
        SchedulerMsg::HandOffAll(reason) => {
            let reason = reason
                .decode()
                .unwrap_or_else(|_| "the worker is stopping".into());
            state.core.hand_off_all(reason);
        }
    }
    Ok(())
}

/// Peer pull: asks `holder`'s scheduler to pin the prefix for `key`, within `timeout`.
async fn ask_holder(
    holder: &WorkerId,
    key: (NodeId, RequestId),
    tokens: Vec<u32>,
    timeout: std::time::Duration,
) -> Result<protocol::RemoteKv, String> {
    let name = format!("{holder}/scheduler");
    let Some(s) = crate::runtime::cluster::member_named(SCHEDULER_GROUP, &name) else {
        return Err(format!("the holder {holder} is gone"));
    };
    let s: ActorRef<SchedulerMsg> = s.into();
    let ms = timeout.as_millis() as u64;
    match ractor::call_t!(s, SchedulerMsg::Export, ms, Wire::encode(&(key, tokens))) {
        Ok(answer) => answer
            .decode()
            .map_err(|e| format!("the holder's answer does not decode: {e}"))?,
        Err(e) => Err(format!("the holder {holder} did not answer: {e}")),
    }
}

/// One pull through the node's transport actor (the actor runs it as a task and answers when
/// every byte has landed or it failed); straight through the transport when the actor is
/// restarting. The bytes moved.
async fn pull(
    t: &std::sync::Arc<crate::transport::Transport>,
    req: crate::transport::PullRequest,
) -> Result<u64, String> {
    let slack = std::time::Duration::from_secs(5);
    let wait = req
        .deadline
        .saturating_duration_since(std::time::Instant::now())
        + slack;
    let out = match crate::transport::local(t.node()) {
        Some(actor) => ractor::call_t!(
            actor,
            crate::transport::TransportMsg::Pull,
            wait.as_millis() as u64,
            Box::new(req)
        )
        .map_err(|e| format!("transport actor: {e}"))?,
        None => t.pull(req).await,
    };
    out.map(|s| s.bytes).map_err(|e| e.to_string())
}
