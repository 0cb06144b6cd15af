//! The Scheduler actor: one per replica, the thin driver of [`SchedulerCore`].
//!
//! It keeps only the messaging: it feeds submissions, cancellations and step outputs to the
//! core, times each step for the step-time model (steps an injected chaos `slow` or `hang`
//! may have lengthened are left out, as the watchdog leaves their delay out of its deadline),
//! hands batches to its engine worker, sends the outbox's batches to the owners' token sinks,
//! forwards the pool's KV events to the replica's
//! [`KvEventPublisher`](crate::actors::kv_publisher::KvEventPublisher), and fails (so that its
//! supervisor restarts the replica) when the watchdog finds the engine hung or the engine
//! worker gone. The policy, the disaggregation protocol and the step protocol are described in
//! [`crate::worker::scheduler`].

use crate::worker::scheduler::{
    BlockPool, DisaggWorker, FillChange, Health, KvFill, Outbox, PullOrder, PullResult,
    ROUTABLE_GROUP, SCHEDULER_GROUP, SchedulerConfig, SchedulerCore, SchedulerStats, SeqRequest,
    SimTransfer, StatsBoard, StepResult, StepShape, StepTimeModel, StepWatchdog, WatchdogVerdict,
};

use crate::actors::engine_worker::EngineWorkerMsg;
use crate::kv::KvEvent;
use crate::request_plane::events::FleetEventKind;
use crate::request_plane::protocol::{
    self, Owner, RemoteKv, SubmitRequest, TokenEvent, TokenEventKind,
};
use crate::runtime::ids::{NodeId, RequestId, SeqId, WorkerId};
use crate::runtime::role::{Role, role_group};
use crate::runtime::wire::Wire;
use crate::worker::WorkerError;
use crate::worker::engine::{SamplingParams, StepBatch, StepSeq};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use std::collections::HashMap;
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
    /// Stop taking new work (leave routing); running requests go on (cast).
    Drain(Wire<()>),
    /// Hand off every request still here: each gets [`TokenEventKind::Lost`] with this
    /// reason and migrates (cast; the end of a drain's grace period).
    HandOffAll(Wire<String>),
    /// Local: a pull of remote KV returned.
    PullDone(Wire<PullResult>),
    /// Change this replica's role (cast): it leaves routing, finishes what it runs, then
    /// switches and is routable again.
    SetRole(Wire<Role>),
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
    /// Faults injected on this node (chaos): the scheduler reads the ones aimed at itself
    /// (`panic`, `fill_kv`), the `slow` delay its watchdog allows for, and ends `hang`s when
    /// it restarts the replica; the engine's chaos filter applies the rest.
    pub faults: crate::control::chaos::FaultBook,
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

struct Live {
    request: RequestId,
    owner: Owner,
    sampling: SamplingParams,
    admitted: bool,
    /// Tokens emitted so far (the next token's index).
    emitted: u32,
    /// `SubmitRequest::trace_id`.
    trace_id: Option<String>,
    /// Disaggregated decode: the prefill worker's KV to pull.
    remote: Option<RemoteKv>,
    /// When it was queued here (its wait for admission counts from this).
    queued_at: crate::runtime::clock::Instant,
}

/// A handed-off sequence's pinned blocks.
struct Held {
    request: RequestId,
    owner: Owner,
    until: crate::runtime::clock::Instant,
}

/// Scheduler state.
pub struct SchedulerState {
    args: SchedulerArgs,
    core: SchedulerCore,
    engine: ActorRef<EngineWorkerMsg>,
    live: HashMap<SeqId, Live>,
    by_request: HashMap<(NodeId, RequestId), SeqId>,
    next_seq: u64,
    steps: u64,
    outbox: Outbox<Owner, TokenEvent>,
    health: Health,
    watchdog: StepWatchdog,
    /// Chaos `fill_kv`: blocks held beside the core.
    fill: KvFill,
    ticker: Option<tokio::task::JoinHandle<()>>,
    /// Step times measured here, for stall-free batching.
    step_model: StepTimeModel,
    /// The step in flight: its shape, when it was handed over, and whether it is a clean
    /// sample for the model (no chaos delay or hang when it started).
    step_timing: Option<StepTiming>,
    clock: crate::runtime::clock::SharedClock,
    /// Handed-off sequences (prefill role), until the decode side confirms or the hold ends.
    held: HashMap<SeqId, Held>,
    /// Pulls in flight: whom to confirm to (prefill worker, its request key) when each returns.
    pulls: HashMap<SeqId, (WorkerId, (NodeId, RequestId))>,
    blocks_pulled: u64,
    pull_fallbacks: u64,
    role: Role,
    /// A role change waiting for the replica to be empty.
    next_role: Option<Role>,
    /// The node is draining: never routable again.
    draining: bool,
    /// When sequences were admitted, over the last [`ADMIT_RATE_WINDOW`] (the measured
    /// admission rate behind `prefill_wait_ms`).
    admissions: std::collections::VecDeque<crate::runtime::clock::Instant>,
    /// When this scheduler started (the admission rate's window is shorter before).
    started_at: crate::runtime::clock::Instant,
}

/// Window of the measured admission rate.
pub const ADMIT_RATE_WINDOW: std::time::Duration = std::time::Duration::from_secs(5);

/// Record an admission at `now`, forgetting those older than [`ADMIT_RATE_WINDOW`].
fn note_admission(
    admissions: &mut std::collections::VecDeque<crate::runtime::clock::Instant>,
    now: crate::runtime::clock::Instant,
) {
    while admissions
        .front()
        .is_some_and(|t| now.saturating_duration_since(*t) > ADMIT_RATE_WINDOW)
    {
        admissions.pop_front();
    }
    admissions.push_back(now);
}

struct StepTiming {
    shape: StepShape,
    started: crate::runtime::clock::Instant,
    clean: bool,
}

/// The Scheduler actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct Scheduler;

impl SchedulerState {
    fn emit(&mut self, to: &Owner, request: RequestId, kind: TokenEventKind) {
        self.outbox.push(to, TokenEvent { request, kind });
    }

    /// Send every pending event, one message per owner. Events for an owner whose sink cannot
    /// be found are kept and retried (a sink restarting) until the outbox finds the owner gone;
    /// then its sequences are aborted.
    fn flush(&mut self) {
        let gone = self.outbox.flush(protocol::deliver, protocol::owner_status);
        for owner in gone {
            self.abort_owner(&owner);
        }
    }

    /// Abort every sequence of `owner` (gone): free their KV blocks, forget their events.
    fn abort_owner(&mut self, owner: &Owner) {
        self.outbox.forget(owner);
        let orphans: Vec<SeqId> = self
            .live
            .iter()
            .filter(|(_, l)| l.owner == *owner)
            .map(|(s, _)| *s)
            .collect();
        tracing::warn!(worker = %self.args.worker, %owner, sequences = orphans.len(),
            "the owner of these sequences is gone; aborting them");
        metrics::counter!("flotilla_orphaned_sequences_aborted_total")
            .increment(orphans.len() as u64);
        let held: Vec<SeqId> = self
            .held
            .iter()
            .filter(|(_, h)| h.owner == *owner)
            .map(|(s, _)| *s)
            .collect();
        for s in orphans.into_iter().chain(held) {
            self.drop_seq(s);
        }
        self.forward_kv_events();
    }

    /// Abort the sequences of every owner that is gone (run on each tick: sequences that
    /// emit nothing, e.g. waiting ones, are found too).
    fn check_owners(&mut self) {
        let mut owners: Vec<Owner> = self
            .live
            .values()
            .map(|l| l.owner.clone())
            .chain(self.held.values().map(|h| h.owner.clone()))
            .collect();
        owners.sort();
        owners.dedup();
        for owner in owners {
            if self.outbox.is_gone(&owner, protocol::owner_status(&owner)) {
                self.abort_owner(&owner);
            }
        }
        let live = &self.live;
        self.outbox
            .retain_missing(|o| live.values().any(|l| l.owner == *o));
    }

    fn drop_seq(&mut self, seq: SeqId) {
        self.core.cancel(seq);
        if let Some(l) = self.live.remove(&seq) {
            tracing::debug!(worker = %self.args.worker, request = %l.request, trace_id = l.trace_id.as_deref().unwrap_or("-"), "sequence dropped");
            self.by_request.remove(&(l.owner.node, l.request));
        }
        if let Some(h) = self.held.remove(&seq) {
            tracing::debug!(worker = %self.args.worker, request = %h.request, "handed-off blocks released");
            self.by_request.remove(&(h.owner.node, h.request));
        }
        let _ = self.engine.cast(EngineWorkerMsg::Release(seq));
    }

    /// Releases handed-off blocks whose hold ended without a confirmation.
    fn expire_held(&mut self) {
        let now = self.clock.now();
        let expired: Vec<SeqId> = self
            .held
            .iter()
            .filter(|(_, h)| h.until <= now)
            .map(|(s, _)| *s)
            .collect();
        if expired.is_empty() {
            return;
        }
        tracing::info!(worker = %self.args.worker, sequences = expired.len(), "hand-off holds expired unconfirmed; releasing their blocks");
        metrics::counter!("flotilla_disagg_holds_expired_total").increment(expired.len() as u64);
        for s in expired {
            self.drop_seq(s);
        }
        self.forward_kv_events();
    }

    /// The region a decode worker reads this replica's KV from.
    fn region(&self) -> Option<crate::transport::RegionDescriptor> {
        let owner = self.args.worker.to_string();
        self.args
            .transport
            .as_ref()?
            .descriptors()
            .into_iter()
            .find(|d| d.id.owner == owner)
    }

    /// Starts the pull of a sequence admitted with remote KV: a task asks the node's
    /// transport actor (or runs the sim engine's modelled transfer) and reports `PullDone`.
    fn start_pull(&mut self, order: PullOrder, myself: &ActorRef<SchedulerMsg>) {
        let seq = order.seq;
        let worker = self.args.worker.clone();
        let Some(live) = self.live.get_mut(&seq) else {
            let _ = self.core.pull_done(seq, false);
            return;
        };
        live.admitted = true;
        note_admission(&mut self.admissions, self.clock.now());
        let kv = live.remote.take();
        let (to, req) = (live.owner.clone(), live.request);
        self.emit(
            &to,
            req,
            TokenEventKind::Admitted {
                worker: worker.clone(),
                cached_tokens: order.cached_tokens as u32,
            },
        );
        let Some(kv) = kv else {
            let _ = myself.cast(SchedulerMsg::PullDone(Wire::encode(&PullResult {
                seq,
                outcome: Err("no remote KV".into()),
            })));
            return;
        };
        self.pulls
            .insert(seq, (kv.worker.clone(), (to.node.clone(), kv.request)));
        let pairs: Vec<(u32, u32)> = order
            .blocks
            .iter()
            .filter_map(|&(i, b)| kv.blocks.get(i).map(|&r| (r, b.0)))
            .collect();
        let n = order.blocks.len();
        // The pull must end before the prefill worker's hold does (its clock; the nodes'
        // clocks are assumed within `hold_margin` of each other).
        let d = self.args.disagg;
        let left_ms = kv
            .held_until_ms
            .saturating_sub(self.clock.wall_ms())
            .saturating_sub(d.hold_margin.as_millis() as u64);
        let budget = d
            .transfer_timeout
            .min(std::time::Duration::from_millis(left_ms));
        let transport = self.args.transport.clone();
        let sim = self.args.sim_transfer;
        let block_size = self.args.block_size;
        let me = myself.clone();
        tokio::spawn(async move {
            let outcome = if pairs.len() != n {
                Err(format!(
                    "the hand-off names {} blocks; {n} needed",
                    kv.blocks.len()
                ))
            } else if budget.is_zero() {
                Err("the prefill worker's hold ends too soon".into())
            } else {
                match (kv.region, transport, sim) {
                    (Some(from), Some(t), _) => {
                        let req = crate::transport::PullRequest {
                            from,
                            into: worker.to_string(),
                            blocks: pairs,
                            deadline: std::time::Instant::now() + budget,
                        };
                        pull(&t, req).await.map(|_| n)
                    }
                    (None, _, Some(sim)) => {
                        tokio::time::sleep(sim.time(n, block_size)).await;
                        Ok(n)
                    }
                    _ => Err("no transport to pull the KV with".into()),
                }
            };
            let _ = me.cast(SchedulerMsg::PullDone(Wire::encode(&PullResult {
                seq,
                outcome,
            })));
        });
    }

    /// A pull returned: the sequence decodes (or recomputes what it lacks), and the prefill
    /// worker is told to release its blocks.
    fn on_pull_done(&mut self, r: PullResult) -> Result<(), ActorProcessingErr> {
        let ok = r.outcome.is_ok();
        let w = self.args.worker.to_string();
        match &r.outcome {
            Ok(blocks) => {
                self.blocks_pulled += *blocks as u64;
                metrics::counter!("flotilla_disagg_pulled_blocks_total", "worker" => w)
                    .increment(*blocks as u64);
            }
            Err(why) => {
                self.pull_fallbacks += 1;
                metrics::counter!("flotilla_disagg_pull_fallbacks_total", "worker" => w)
                    .increment(1);
                tracing::warn!(worker = %self.args.worker, seq = %r.seq, %why, "KV pull failed; recomputing the prompt here");
            }
        }
        self.core.pull_done(r.seq, ok)?;
        if let Some((prefill, key)) = self.pulls.remove(&r.seq) {
            let name = format!("{prefill}/scheduler");
            if let Some(s) = crate::runtime::cluster::member_named(SCHEDULER_GROUP, &name) {
                let s: ActorRef<SchedulerMsg> = s.into();
                let _ = s.cast(SchedulerMsg::Cancel(Wire::encode(&key)));
            }
        }
        self.forward_kv_events();
        Ok(())
    }

    /// Carries out a pending role change once nothing runs or is held here.
    fn maybe_switch_role(&mut self, myself: &ActorRef<SchedulerMsg>) {
        let Some(next) = self.next_role else {
            return;
        };
        if !self.live.is_empty() || !self.held.is_empty() || self.core.num_pulling() > 0 {
            return;
        }
        if let Some(g) = role_group(self.role) {
            ractor::pg::leave(g.to_owned(), vec![myself.get_cell()]);
        }
        if let Some(g) = role_group(next) {
            ractor::pg::join(g.to_owned(), vec![myself.get_cell()]);
        }
        tracing::info!(worker = %self.args.worker, from = %self.role, to = %next, "role changed");
        self.args.bus.emit(FleetEventKind::RoleChanged {
            worker: self.args.worker.clone(),
            role: next,
        });
        self.role = next;
        self.next_role = None;
        if !self.draining && self.health == Health::Draining {
            self.health = Health::Ready;
            ractor::pg::join(ROUTABLE_GROUP.to_owned(), vec![myself.get_cell()]);
        }
    }

    fn forward_kv_events(&mut self) {
        let events: Vec<KvEvent> = self.core.drain_kv_events();
        if events.is_empty() {
            return;
        }
        let tokens = self.core.pool_mut().drain_event_tokens();
        if let Some(name) = &self.args.kv_publisher_name
            && let Some(cell) = ractor::registry::where_is(name.clone())
        {
            let publisher: ActorRef<crate::actors::kv_publisher::KvPublisherMsg> = cell.into();
            if !tokens.is_empty() {
                let _ = publisher.cast(crate::actors::kv_publisher::KvPublisherMsg::EventTokens(
                    Wire::encode(&tokens),
                ));
            }
            let _ = publisher.cast(crate::actors::kv_publisher::KvPublisherMsg::Events(
                Wire::encode(&events),
            ));
        }
    }

    /// Start the next step if none is running and there is work.
    fn kick(&mut self, myself: &ActorRef<SchedulerMsg>) -> Result<(), ActorProcessingErr> {
        while !self.watchdog.step_in_flight() && self.core.has_unfinished() {
            let mut batch = self.core.schedule_with(self.step_model.cost().as_ref())?;
            for order in std::mem::take(&mut batch.pulls) {
                self.start_pull(order, myself);
            }
            let mut seqs = Vec::with_capacity(batch.entries.len());
            for e in &batch.entries {
                let Some(live) = self.live.get_mut(&e.seq) else {
                    continue;
                };
                if let Some(cached) = e.cached_tokens
                    && !live.admitted
                {
                    live.admitted = true;
                    note_admission(&mut self.admissions, self.clock.now());
                    tracing::debug!(worker = %self.args.worker, request = %live.request, trace_id = live.trace_id.as_deref().unwrap_or("-"), cached, "sequence admitted");
                    let (to, req) = (live.owner.clone(), live.request);
                    let worker = self.args.worker.clone();
                    self.emit(
                        &to,
                        req,
                        TokenEventKind::Admitted {
                            worker,
                            cached_tokens: cached as u32,
                        },
                    );
                }
                let live = &self.live[&e.seq];
                seqs.push(StepSeq {
                    seq_id: e.seq,
                    tokens: e.token_ids.clone(),
                    start_pos: e.start_pos,
                    block_table: e.block_table.clone(),
                    sampling: live.sampling.clone(),
                    sample: e.sample,
                });
            }
            if seqs.is_empty() {
                // Nothing could run (e.g. all admissions wait for blocks): close the step.
                self.core.on_step_output(&[])?;
                break;
            }
            self.steps += 1;
            let step = self.steps;
            let engine = self.engine.clone();
            let me = myself.clone();
            if let Some(prefill) = batch.stall_capped {
                let worker = self.args.worker.to_string();
                metrics::counter!("flotilla_scheduler_stall_capped_steps_total", "worker" => worker.clone())
                    .increment(1);
                metrics::gauge!("flotilla_scheduler_prefill_cap_tokens", "worker" => worker)
                    .set(prefill as f64);
            }
            // The engine's chaos filter sleeps a `slow` delay before the step: not engine time
            // (the watchdog allows for it; the step-time model does not learn from the step).
            let delay = self.args.faults.step_delay(&self.args.worker);
            self.step_timing = Some(StepTiming {
                shape: StepShape::of(
                    batch
                        .entries
                        .iter()
                        .map(|e| (e.start_pos, e.token_ids.len())),
                ),
                started: self.clock.now(),
                clean: delay.is_zero() && !self.args.faults.hangs(&self.args.worker),
            });
            self.watchdog.step_started(delay);
            tokio::spawn(async move {
                let output = match ractor::call!(engine, EngineWorkerMsg::Step, StepBatch { seqs })
                {
                    Ok(answer) => answer.map_err(WorkerError::Engine),
                    Err(e) => Err(WorkerError::EngineGone(e.to_string())),
                };
                let _ = me.cast(SchedulerMsg::StepDone(Wire::encode(&StepResult {
                    step,
                    output,
                })));
            });
        }
        self.flush();
        Ok(())
    }

    fn on_step_done(&mut self, result: StepResult) -> Result<(), ActorProcessingErr> {
        self.watchdog.step_returned();
        let timing = self.step_timing.take();
        if let (Some(t), Ok(_)) = (timing, &result.output) {
            self.learn_step_time(t);
        }
        let out = match result.output {
            Ok(out) => out,
            Err(err) => {
                // No KV was written. An engine that is gone (its actor died) takes the replica
                // down: every sequence is lost and migrates, and the supervisor restarts the
                // replica. An engine that answered with an error fails the step's sequences.
                tracing::error!(worker = %self.args.worker, error = %err, "engine step failed");
                let gone = err.takes_replica_down();
                let kind = if gone {
                    TokenEventKind::Lost {
                        reason: "the engine of its worker died".into(),
                    }
                } else {
                    TokenEventKind::Failed {
                        message: "the engine failed".into(),
                        status: 500,
                    }
                };
                self.drop_all(&kind);
                let _ = self.core.on_step_output(&[]);
                self.flush();
                if gone {
                    return Err(err.into());
                }
                return Ok(());
            }
        };
        let logprobs: HashMap<SeqId, f32> =
            out.tokens.iter().map(|t| (t.seq_id, t.logprob)).collect();
        let sampled: Vec<(SeqId, u32)> = out.tokens.iter().map(|t| (t.seq_id, t.token)).collect();
        let updates = self.core.on_step_output(&sampled)?;
        for u in updates {
            let Some(l) = self.live.get_mut(&u.seq) else {
                continue;
            };
            let index = l.emitted;
            l.emitted += 1;
            let (to, req) = (l.owner.clone(), l.request);
            let finish = u.finished;
            let logprob = logprobs.get(&u.seq).copied().unwrap_or(0.0);
            self.emit(
                &to,
                req,
                TokenEventKind::Token {
                    id: u.token,
                    logprob,
                    finish,
                    index,
                },
            );
            if let Some(h) = u.handed_off {
                // Disaggregated prefill: the first token went out above; the KV waits,
                // pinned, for the decode worker's pull.
                let now = self.clock.now();
                let hold = self.args.disagg.hold;
                let kv = RemoteKv {
                    worker: self.args.worker.clone(),
                    request: req,
                    region: self.region(),
                    blocks: h.blocks.iter().map(|b| b.0).collect(),
                    tokens: h.tokens as u32,
                    held_until_ms: self.clock.wall_ms() + hold.as_millis() as u64,
                };
                self.emit(&to, req, TokenEventKind::HandOff(Box::new(kv)));
                if let Some(l) = self.live.remove(&u.seq) {
                    self.held.insert(
                        u.seq,
                        Held {
                            request: l.request,
                            owner: l.owner,
                            until: now + hold,
                        },
                    );
                }
                metrics::counter!("flotilla_disagg_hand_offs_total", "worker" => self.args.worker.to_string())
                    .increment(1);
                continue;
            }
            if finish.is_some() {
                if let Some(l) = self.live.remove(&u.seq) {
                    tracing::debug!(worker = %self.args.worker, request = %l.request, trace_id = l.trace_id.as_deref().unwrap_or("-"), tokens = l.emitted, "sequence finished");
                    self.by_request.remove(&(l.owner.node, l.request));
                }
                let _ = self.engine.cast(EngineWorkerMsg::Release(u.seq));
            }
        }
        self.forward_kv_events();
        Ok(())
    }

    /// Feeds a step that came back to the step-time model, unless an injected delay or hang
    /// may have lengthened it (one active when it started or now).
    fn learn_step_time(&mut self, t: StepTiming) {
        let worker = &self.args.worker;
        if !t.clean
            || !self.args.faults.step_delay(worker).is_zero()
            || self.args.faults.hangs(worker)
        {
            return;
        }
        let ms = self.clock.now().duration_since(t.started).as_secs_f64() * 1000.0;
        self.step_model.observe(t.shape, ms);
        let w = worker.to_string();
        metrics::histogram!("flotilla_scheduler_step_duration_seconds", "worker" => w.clone())
            .record(ms / 1000.0);
        if let Some(c) = self.step_model.cost() {
            for (term, v) in [
                ("base", c.base_ms),
                ("per_token", c.per_token_ms),
                ("per_kpair", c.per_kpair_ms),
            ] {
                metrics::gauge!("flotilla_scheduler_step_model_ms", "worker" => w.clone(), "term" => term)
                    .set(v);
            }
        }
    }

    /// Chaos `fill_kv`: hold the asked fraction of the pool while the fault lasts.
    fn fill_kv(&mut self) {
        let fraction = self.args.faults.fill_kv(&self.args.worker);
        match self.fill.apply(fraction, self.core.pool_mut()) {
            Ok(FillChange::Unchanged) => {}
            Ok(FillChange::Occupied(n)) => {
                tracing::warn!(worker = %self.args.worker, blocks = n, "chaos: KV blocks occupied")
            }
            Ok(FillChange::Released) => {
                tracing::warn!(worker = %self.args.worker, "chaos: KV blocks released");
                self.forward_kv_events();
            }
            Err(e) if fraction.is_some() => {
                tracing::warn!(worker = %self.args.worker, error = %e, "chaos: fill_kv failed")
            }
            Err(e) => {
                tracing::error!(worker = %self.args.worker, error = %e, "chaos: fill_kv release failed");
                tracing::warn!(worker = %self.args.worker, "chaos: KV blocks released");
                self.forward_kv_events();
            }
        }
    }

    /// Send `kind` to every live request and drop them all.
    fn drop_all(&mut self, kind: &TokenEventKind) {
        let held: Vec<SeqId> = self.held.keys().copied().collect();
        for s in held {
            self.drop_seq(s);
        }
        let all: Vec<SeqId> = self.live.keys().copied().collect();
        for s in all {
            if let Some(l) = self.live.get(&s) {
                let (to, req) = (l.owner.clone(), l.request);
                self.emit(&to, req, kind.clone());
            }
            self.drop_seq(s);
        }
    }

    /// Leave routing (drain, hang): routers stop choosing this replica at once.
    fn leave_routing(&mut self, myself: &ActorRef<SchedulerMsg>, health: Health) {
        self.health = health;
        ractor::pg::leave(ROUTABLE_GROUP.to_owned(), vec![myself.get_cell()]);
    }

    /// The watchdog and the canary. Returns an error when the engine is hung, which fails
    /// this actor so that the replica supervisor restarts the replica (one_for_all).
    fn tick(&mut self, myself: &ActorRef<SchedulerMsg>) -> Result<(), ActorProcessingErr> {
        match self.watchdog.check() {
            WatchdogVerdict::Healthy => {}
            WatchdogVerdict::Ping => {
                let (engine, me) = (self.engine.clone(), myself.clone());
                tokio::spawn(async move {
                    if ractor::call!(engine, EngineWorkerMsg::Ping).is_ok() {
                        let _ = me.cast(SchedulerMsg::CanaryDone(Wire::encode(&())));
                    }
                });
            }
            WatchdogVerdict::Hung(what) => {
                self.args.stats.count_engine_hang();
                metrics::counter!("flotilla_engine_hangs_total", "worker" => self.args.worker.to_string())
                    .increment(1);
                tracing::error!(worker = %self.args.worker, timeout_ms = self.watchdog.step_timeout().as_millis() as u64,
                    "{what} did not return within the step timeout: engine hung; restarting the replica");
                self.leave_routing(myself, Health::Unhealthy);
                ractor::pg::leave(SCHEDULER_GROUP.to_owned(), vec![myself.get_cell()]);
                // A restart is what ends a hang (the injected one included).
                self.args.faults.end_hangs(&self.args.worker);
                return Err(format!("engine of {} hung", self.args.worker).into());
            }
        }
        Ok(())
    }

    /// [`SchedulerStats::prefill_wait_ms`]: the longest of the compute queue through the
    /// step-time model, the oldest unadmitted request's sojourn, and the unadmitted requests
    /// over the admission rate measured in the last [`ADMIT_RATE_WINDOW`] (Little's law).
    fn prefill_wait_ms(&self) -> Option<f64> {
        let compute = self.step_model.cost().map(|c| {
            let budget = self.core.config().max_num_batched_tokens;
            c.drain_ms(self.core.queued_prefill_tokens(), budget)
        });
        let now = self.clock.now();
        let (waiting, sojourn) = self
            .live
            .values()
            .filter(|l| !l.admitted)
            .map(|l| now.saturating_duration_since(l.queued_at).as_secs_f64() * 1e3)
            .fold((0usize, None::<f64>), |(n, max), ms| {
                (n + 1, Some(max.map_or(ms, |m| m.max(ms))))
            });
        let window = now
            .saturating_duration_since(self.started_at)
            .min(ADMIT_RATE_WINDOW)
            .as_secs_f64();
        let recent = self
            .admissions
            .iter()
            .filter(|t| now.saturating_duration_since(**t) <= ADMIT_RATE_WINDOW)
            .count();
        let little = (recent > 0 && window > 0.0 && waiting > 0)
            .then(|| waiting as f64 / (recent as f64 / window) * 1e3);
        [compute, sojourn, little]
            .into_iter()
            .flatten()
            .reduce(f64::max)
    }

    fn stats(&self) -> SchedulerStats {
        let usage = self.core.kv_usage();
        SchedulerStats {
            worker: self.args.worker.clone(),
            waiting: self.core.num_waiting(),
            running: self.core.num_running(),
            queued_prefill_tokens: self.core.queued_prefill_tokens(),
            kv_blocks_total: usage.total_blocks,
            kv_blocks_used: usage.used_blocks,
            steps: self.steps,
            health: self.health,
            role: self.role,
            held: self.held.len(),
            pulls_pending: self.core.num_pulling(),
            blocks_pulled: self.blocks_pulled,
            pull_fallbacks: self.pull_fallbacks,
            prefill_wait_ms: self.prefill_wait_ms(),
            prefill_tokens_per_s: self.step_model.cost().and_then(|c| {
                let budget = self.core.config().max_num_batched_tokens;
                let ms = c.drain_ms(budget, budget);
                (ms > 0.0).then(|| budget as f64 / ms * 1e3)
            }),
        }
    }
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
        let mut pool = BlockPool::new(args.num_blocks, args.block_size, args.salt)?
            .with_worker(args.worker.clone());
        if args.token_events {
            pool = pool.with_token_events();
        }
        let core = SchedulerCore::new(args.config, pool)?;
        ractor::pg::join(SCHEDULER_GROUP.to_owned(), vec![myself.get_cell()]);
        if let Some(g) = role_group(args.role) {
            ractor::pg::join(g.to_owned(), vec![myself.get_cell()]);
        }
        ractor::pg::join(ROUTABLE_GROUP.to_owned(), vec![myself.get_cell()]);
        let period = (args.step_timeout / 4).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_millis(500),
        );
        let ticker = myself.send_interval(period, || SchedulerMsg::Tick(Wire::encode(&())));
        let clock = args.clock.clone();
        let started_at = clock.now();
        let args_role = args.role;
        let state = SchedulerState {
            outbox: Outbox::new(clock.clone(), args.owner_grace),
            watchdog: StepWatchdog::new(clock.clone(), args.step_timeout, args.canary_interval),
            step_model: StepTimeModel::new(),
            step_timing: None,
            clock,
            fill: KvFill::default(),
            args,
            core,
            engine,
            live: HashMap::new(),
            by_request: HashMap::new(),
            next_seq: 0,
            steps: 0,
            health: Health::Ready,
            ticker: Some(ticker),
            held: HashMap::new(),
            pulls: HashMap::new(),
            blocks_pulled: 0,
            pull_fallbacks: 0,
            role: args_role,
            next_role: None,
            draining: false,
            admissions: Default::default(),
            started_at,
        };
        state.args.board.publish(state.stats());
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
        let lost = TokenEventKind::Lost {
            reason: "the replica stopped".into(),
        };
        let live: Vec<(Owner, RequestId)> = state
            .live
            .values()
            .map(|l| (l.owner.clone(), l.request))
            .collect();
        for (to, req) in live {
            state.emit(&to, req, lost.clone());
        }
        state.flush();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let changes = msg.may_change_stats();
        let out = handle_msg(myself, msg, state).await;
        if changes {
            // Pushed, not pulled: the node's board is what Discovery and admission read.
            state.args.board.publish(state.stats());
        }
        out
    }
}

/// One message (see [`Scheduler`]'s `handle`, which publishes the stats after it).
async fn handle_msg(
    myself: ActorRef<SchedulerMsg>,
    msg: SchedulerMsg,
    state: &mut SchedulerState,
) -> Result<(), ActorProcessingErr> {
    match msg {
        SchedulerMsg::Submit(wire) => {
            let Ok(req) = wire.decode() else {
                return Ok(());
            };
            let key = (req.reply_to.clone(), req.request);
            if state.by_request.contains_key(&key) {
                return Ok(()); // duplicate submission
            }
            let owner = req.owner();
            if state.health != Health::Ready {
                // Routed here just before this replica left routing: place it elsewhere.
                let reason = format!("the worker is {}", state.health);
                state.emit(&owner, req.request, TokenEventKind::Lost { reason });
                state.flush();
                return Ok(());
            }
            state.next_seq += 1;
            let seq = SeqId(state.next_seq);
            // Remote KV must end inside the prompt (the prompt ends with the first token
            // the prefill worker sampled); otherwise the prompt is computed here.
            let remote = req
                .remote_kv
                .filter(|kv| (kv.tokens as usize) < req.prompt.len() && kv.tokens > 0);
            let added = state.core.add(SeqRequest {
                remote_tokens: remote.as_ref().map_or(0, |kv| kv.tokens as usize),
                hand_off: req.hand_off,
                seq,
                prompt: req.prompt,
                max_tokens: req.max_tokens as usize,
                stop_token_ids: req.stop_token_ids,
                eos_token_id: if req.ignore_eos {
                    None
                } else {
                    state.args.eos_token_id
                },
                arrival: req.arrival_ms,
            });
            match added {
                Ok(()) => {
                    tracing::debug!(worker = %state.args.worker, request = %req.request, trace_id = req.trace_id.as_deref().unwrap_or("-"), "sequence queued");
                    state.by_request.insert(key, seq);
                    state.live.insert(
                        seq,
                        Live {
                            request: req.request,
                            owner,
                            sampling: req.sampling,
                            admitted: false,
                            emitted: 0,
                            trace_id: req.trace_id,
                            remote,
                            queued_at: state.clock.now(),
                        },
                    );
                }
                Err(e) => {
                    state.emit(
                        &owner,
                        req.request,
                        TokenEventKind::Failed {
                            message: e.to_string(),
                            status: 400,
                        },
                    );
                }
            }
            state.kick(&myself)?;
        }
        SchedulerMsg::Cancel(wire) => {
            if let Ok(key) = wire.decode()
                && let Some(seq) = state.by_request.get(&key).copied()
            {
                state.drop_seq(seq);
                state.forward_kv_events();
                state.kick(&myself)?;
                state.maybe_switch_role(&myself);
            }
        }
        SchedulerMsg::StepDone(wire) => {
            let result = wire.decode()?;
            state.on_step_done(result)?;
            state.kick(&myself)?;
            state.maybe_switch_role(&myself);
        }
        SchedulerMsg::PullDone(wire) => {
            let result = wire.decode()?;
            state.on_pull_done(result)?;
            state.kick(&myself)?;
            state.maybe_switch_role(&myself);
        }
        SchedulerMsg::SetRole(wire) => {
            if let Ok(role) = wire.decode()
                && (role != state.role || state.next_role.is_some())
            {
                tracing::info!(worker = %state.args.worker, from = %state.role, to = %role, live = state.live.len(), "role change: draining first");
                state.next_role = Some(role);
                if state.health == Health::Ready {
                    state.leave_routing(&myself, Health::Draining);
                }
                state.maybe_switch_role(&myself);
            }
        }
        SchedulerMsg::Stats(reply) => {
            let _ = reply.send(Wire::encode(&state.stats()));
        }
        SchedulerMsg::Has(key, reply) => {
            let here = key
                .decode()
                .is_ok_and(|k| state.by_request.contains_key(&k));
            let _ = reply.send(Wire::encode(&here));
        }
        SchedulerMsg::Tick(_) => {
            if state.args.faults.take_panic(&state.args.worker) {
                panic!(
                    "injected panic in the scheduler of {} (chaos)",
                    state.args.worker
                );
            }
            state.fill_kv();
            state.check_owners();
            state.expire_held();
            state.maybe_switch_role(&myself);
            state.tick(&myself)?;
            // Work that waits for blocks freed outside a step (a fill_kv released), and
            // events for a sink that was away, go on here.
            state.kick(&myself)?;
            if !state.outbox.is_empty() {
                state.flush();
            }
        }
        SchedulerMsg::CanaryDone(_) => state.watchdog.canary_returned(),
        SchedulerMsg::Drain(_) => {
            state.draining = true;
            if state.health == Health::Ready {
                tracing::info!(worker = %state.args.worker, live = state.live.len(), "draining");
                state.leave_routing(&myself, Health::Draining);
            }
        }
        SchedulerMsg::HandOffAll(reason) => {
            let reason = reason
                .decode()
                .unwrap_or_else(|_| "the worker is stopping".into());
            tracing::warn!(worker = %state.args.worker, live = state.live.len(), %reason, "handing every request off");
            state.drop_all(&TokenEventKind::Lost { reason });
            state.forward_kv_events();
            state.flush();
        }
    }
    Ok(())
}

/// One pull through the node's transport actor (the actor runs it as a task and answers when
/// every byte has landed or it failed); straight through the transport when the actor is
/// restarting.
async fn pull(
    t: &std::sync::Arc<crate::transport::Transport>,
    req: crate::transport::PullRequest,
) -> Result<(), String> {
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
    out.map(|_| ()).map_err(|e| e.to_string())
}
