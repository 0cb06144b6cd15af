//! [`WorkerCore`]: everything one replica's scheduler decides, as a pure state machine.
//!
//! The [`Scheduler`](crate::actors::scheduler::Scheduler) actor feeds it inputs — a
//! submission, a cancel, a step or a pull that came back, a tick, a role change, a drain —
//! and carries out the [`WorkerEffect`]s it asks for: run a step on the engine, pull remote KV,
//! release a sequence's engine state, confirm a pull to the prefill worker, forward KV events,
//! join or leave a process group, ping the engine. Token events wait in the core's
//! [`Outbox`] until the actor flushes it with its delivery function. Time comes from the
//! injected [`Clock`](crate::runtime::clock::Clock) only, and the chaos faults aimed at this
//! replica arrive as data ([`InjectedFaults`]), so a test (or the offline simulator) drives
//! the whole worker under a [`ManualClock`](crate::runtime::clock::ManualClock), without an
//! actor, an engine or a socket.
//!
//! What it holds: the batch former and its block pool ([`SchedulerCore`]), the requests it
//! serves by id, the hand-offs it holds (prefill role) and the pulls it waits for (decode
//! role), the step watchdog, the step-time model, the chaos `fill_kv` blocks, the role and
//! health, and the admission window behind `prefill_wait_ms`.
//!
//! Each sequence logs one `info` line when admitted (`prompt_tokens`, `cached_tokens`) and one
//! when it finishes or is dropped (`tokens` emitted), with the client's request id
//! (`request_id`, the gateway's `x-request-id`, carried in `SubmitRequest::trace_id` through
//! migrations and hand-offs): grep every node's log for one id. Their target is
//! [`SEQUENCE_TARGET`] (`FLOTILLA_LOG=info,flotilla::sequence=off` turns them off).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// The tracing target of the per-sequence lines (admitted, finished, dropped).
pub const SEQUENCE_TARGET: &str = "flotilla::sequence";
/// The tracing target of one debug line per engine step (tokens, duration, queue):
/// `FLOTILLA_LOG=info,flotilla::step=debug`.
pub const STEP_TARGET: &str = "flotilla::step";

use super::{
    DisaggWorker, FillChange, Hang, Health, KvFill, Outbox, PeerPullCounters, PeerPullWorker,
    PullOrder, PullResult, ROUTABLE_GROUP, SCHEDULER_GROUP, ScheduledSeq, SchedulerCore,
    SchedulerError, SchedulerStats, SeqRequest, SimTransfer, StepResult, StepShape, StepTimeModel,
    StepWatchdog, WatchdogVerdict,
};
use crate::kv::KvEvent;
use crate::request_plane::protocol::{
    FetchHint, Owner, OwnerStatus, RemoteKv, SubmitRequest, TokenEvent, TokenEventKind,
};
use crate::runtime::clock::{Instant, SharedClock};
use crate::runtime::ids::{NodeId, RequestId, SeqId, WorkerId};
use crate::runtime::role::{Role, role_group};
use crate::transport::RegionDescriptor;
use crate::worker::WorkerError;
use crate::worker::engine::{SamplingParams, StepBatch, StepSeq};

/// Window of the measured admission rate.
pub const ADMIT_RATE_WINDOW: Duration = Duration::from_secs(5);

/// A request's key at a worker: its gateway node and its (attempt's) request id.
pub type RequestKey = (NodeId, RequestId);

/// What a [`WorkerCore`] is built from (the rest of the scheduler's arguments are the
/// actor's: names, the transport, the node's board and bus).
#[derive(Clone, Debug)]
pub struct WorkerCoreConfig {
    /// This replica.
    pub worker: WorkerId,
    /// End-of-sequence token (a request may ask to ignore it).
    pub eos_token_id: Option<u32>,
    /// Tokens per KV block (the modelled transfer time of a pull).
    pub block_size: usize,
    /// The replica's role at start.
    pub role: Role,
    /// Disaggregation: how long a hand-off is held, the pull's time limit.
    pub disagg: DisaggWorker,
    /// A step longer than this (engine time) is a hang.
    pub step_timeout: Duration,
    /// An idle engine is pinged this often.
    pub canary_interval: Duration,
    /// How long an owner may be missing before its sequences are aborted.
    pub owner_grace: Duration,
    /// Pulls go through the node's transport (when the hand-off names a region).
    pub has_transport: bool,
    /// On a simulated engine: the modelled transfer time of a pull.
    pub sim_transfer: Option<SimTransfer>,
    /// Peer pulls (G4): `None` turns them off here (fetch hints are ignored).
    pub peer_pull: Option<PeerPullWorker>,
}

/// The chaos faults aimed at this replica, as the actor reads them before each input.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct InjectedFaults {
    /// `slow`: the engine sleeps this long before each step (not engine time).
    pub step_delay: Duration,
    /// `hang`: the engine does not answer.
    pub hang: bool,
    /// `fill_kv`: the fraction of the pool to hold.
    pub fill_kv: Option<f64>,
}

/// How a pull is carried out.
#[derive(Clone, Debug, PartialEq)]
pub enum PullWork {
    /// It cannot be: answer [`WorkerCore::pull_done`] with this error at once.
    Fail(String),
    /// Through the node's transport: these `(remote, local)` block pairs from `from`, within
    /// `budget`.
    Transport {
        from: RegionDescriptor,
        pairs: Vec<(u32, u32)>,
        budget: Duration,
    },
    /// Simulated: the transfer takes `time`; one longer than `budget` fails when the budget
    /// runs out, as a real pull times out ([`PullWork::simulated`]).
    Sim { time: Duration, budget: Duration },
}

impl PullWork {
    /// A simulated pull of `blocks` blocks: when it ends (after its modelled time, or at its
    /// budget) and its outcome. `None` for other kinds of work.
    pub fn simulated(&self, blocks: usize) -> Option<(Duration, Result<usize, String>)> {
        let PullWork::Sim { time, budget } = self else {
            return None;
        };
        Some(if time <= budget {
            (*time, Ok(blocks))
        } else {
            (
                *budget,
                Err(format!(
                    "the modelled transfer ({} ms) exceeds its time limit ({} ms)",
                    time.as_millis(),
                    budget.as_millis()
                )),
            )
        })
    }
}

/// A pull to start; its result comes back through [`WorkerCore::pull_done`].
#[derive(Clone, Debug, PartialEq)]
pub struct PullJob {
    pub seq: SeqId,
    /// The worker read from (a prefill worker, or a peer holding the prefix).
    pub from: Option<WorkerId>,
    /// Blocks it brings.
    pub blocks: usize,
    pub work: PullWork,
}

/// What the core asks its driver to do, in order.
#[derive(Clone, Debug)]
pub enum WorkerEffect {
    /// Run this step on the engine; answer with [`WorkerCore::step_done`].
    Step { step: u64, batch: StepBatch },
    /// Pull remote KV; answer with [`WorkerCore::pull_done`].
    Pull(PullJob),
    /// Peer pull: ask `holder` to pin the leading blocks of `tokens` it holds in G1 for this
    /// request ([`WorkerCore::export`] there), within `timeout`; answer with
    /// [`WorkerCore::fetch_done`].
    Fetch {
        holder: WorkerId,
        key: RequestKey,
        tokens: Vec<u32>,
        timeout: Duration,
    },
    /// Copies between KV tiers (`kv/tiers.rs`: offloads, demotions, onboards), in issue
    /// order; answer each with [`WorkerCore::copies_done`].
    TierCopies(Vec<crate::kv::TierCopy>),
    /// The sequence is gone: the engine may free what it keeps for it.
    Release(SeqId),
    /// A pull of the prefill worker's KV returned: tell that worker to release its blocks.
    ConfirmPull { prefill: WorkerId, key: RequestKey },
    /// KV events of the pool (and the token ids of stored blocks, when the pool keeps them),
    /// for the replica's KV event publisher.
    KvEvents {
        events: Vec<KvEvent>,
        tokens: Vec<(crate::runtime::ids::EventId, Vec<u32>)>,
    },
    /// Join this process group.
    Join(&'static str),
    /// Leave this process group.
    Leave(&'static str),
    /// The role changed (for the fleet's event bus).
    RoleChanged(Role),
    /// Ping the engine; answer with [`WorkerCore::canary_done`].
    Ping,
    /// Call [`WorkerCore::kick_due`] at this instant (the end of a gather window).
    KickAt(Instant),
}

/// The engine missed a deadline: the replica must restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} did not return within the step timeout ({timeout_ms} ms): engine hung")]
pub struct EngineHung {
    pub what: Hang,
    pub timeout_ms: u64,
}

/// Errors of the core's inputs: the batch former's (a broken invariant) or a hung engine.
#[derive(Debug, thiserror::Error)]
pub enum WorkerCoreError {
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error(transparent)]
    Hung(#[from] EngineHung),
    /// The engine of this replica is gone (its actor died): the replica must restart.
    #[error(transparent)]
    EngineGone(#[from] WorkerError),
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
    /// The `sequence` span, a child of the gateway's `request` span
    /// (`SubmitRequest::traceparent`) when an OTLP export runs; `Span::none()` otherwise.
    /// It ends when the sequence leaves this worker (finished, dropped, handed off).
    span: tracing::Span,
    /// Disaggregated decode: the prefill worker's KV to pull.
    remote: Option<RemoteKv>,
    /// When it was queued here (its wait for admission counts from this).
    queued_at: Instant,
    /// Its prompt's length (tokens), counted at admission.
    prompt_tokens: u32,
}

/// A submission waiting for its holder's answer to a fetch hint.
struct Fetching {
    req: SubmitRequest,
    holder: WorkerId,
}

/// Blocks pinned here for a peer to pull (peer pulls, holder side).
struct Export {
    lease: crate::kv::SeqLease,
    until: Instant,
}

/// A handed-off sequence's pinned blocks.
struct Held {
    request: RequestId,
    owner: Owner,
    until: Instant,
}

struct StepTiming {
    shape: StepShape,
    started: Instant,
    clean: bool,
}

/// One replica's scheduling state (see the module doc).
pub struct WorkerCore {
    cfg: WorkerCoreConfig,
    core: SchedulerCore,
    clock: SharedClock,
    faults: InjectedFaults,
    effects: Vec<WorkerEffect>,
    live: HashMap<SeqId, Live>,
    by_request: HashMap<RequestKey, SeqId>,
    next_seq: u64,
    steps: u64,
    outbox: Outbox<Owner, TokenEvent>,
    health: Health,
    watchdog: StepWatchdog,
    fill: KvFill,
    step_model: StepTimeModel,
    step_timing: Option<StepTiming>,
    /// The end of a gather window for migrated requests (no step starts before it).
    gather_until: Option<Instant>,
    held: HashMap<SeqId, Held>,
    /// Pulls in flight: whom to confirm to (prefill worker, its request key) when each returns.
    pulls: HashMap<SeqId, (WorkerId, RequestKey)>,
    blocks_pulled: u64,
    pull_fallbacks: u64,
    /// Bytes the transport moved into this replica (every pull's, since start).
    kv_transfer_bytes: u64,
    /// Peer pulls: submissions waiting for their holder's answer.
    fetching: HashMap<RequestKey, Fetching>,
    /// Peer pulls: sequences whose remote KV comes from a peer, and whom to confirm to while
    /// no pull of theirs runs.
    peer_seqs: HashMap<SeqId, (WorkerId, RequestKey)>,
    /// Peer pulls running: the tokens cached here before the pull and once it lands. The
    /// sequence's `Admitted` waits for the pull, so that pulled tokens count as cached and a
    /// failed pull's recomputed ones do not.
    peer_admits: HashMap<SeqId, (usize, usize)>,
    /// Peer pulls, holder side: prefixes pinned for peers, by the puller's request key.
    exports: HashMap<RequestKey, Export>,
    /// Pulls in flight: when each started and how many blocks it brings (the measured rate).
    pull_started: HashMap<SeqId, (Instant, usize)>,
    /// Measured pull time per block (ms, moving average), once a pull landed.
    pull_block_ms: Option<f64>,
    peer: PeerPullCounters,
    /// Prompt tokens admitted since start, and of those the cached (or pulled) ones.
    admitted_prompt_tokens: u64,
    admitted_cached_tokens: u64,
    /// Tokens sampled and sent since start.
    generated_tokens: u64,
    role: Role,
    /// A role change waiting for the replica to be empty.
    next_role: Option<Role>,
    /// The node is draining: never routable again.
    draining: bool,
    /// When sequences were admitted, over the last [`ADMIT_RATE_WINDOW`].
    admissions: VecDeque<Instant>,
    started_at: Instant,
}

impl WorkerCore {
    /// A replica with `core` (the batch former and its pool), ready and routable: the first
    /// effects join the schedulers' group, the role's group and the routable group.
    pub fn new(cfg: WorkerCoreConfig, core: SchedulerCore, clock: SharedClock) -> Self {
        let started_at = clock.now();
        let mut effects = vec![WorkerEffect::Join(SCHEDULER_GROUP)];
        if let Some(g) = role_group(cfg.role) {
            effects.push(WorkerEffect::Join(g));
        }
        effects.push(WorkerEffect::Join(ROUTABLE_GROUP));
        Self {
            outbox: Outbox::new(clock.clone(), cfg.owner_grace),
            watchdog: StepWatchdog::new(clock.clone(), cfg.step_timeout, cfg.canary_interval),
            step_model: StepTimeModel::new(),
            step_timing: None,
            gather_until: None,
            fill: KvFill::default(),
            faults: InjectedFaults::default(),
            effects,
            live: HashMap::new(),
            by_request: HashMap::new(),
            next_seq: 0,
            steps: 0,
            health: Health::Ready,
            held: HashMap::new(),
            pulls: HashMap::new(),
            blocks_pulled: 0,
            pull_fallbacks: 0,
            kv_transfer_bytes: 0,
            fetching: HashMap::new(),
            peer_seqs: HashMap::new(),
            peer_admits: HashMap::new(),
            exports: HashMap::new(),
            pull_started: HashMap::new(),
            pull_block_ms: None,
            peer: PeerPullCounters::default(),
            admitted_prompt_tokens: 0,
            admitted_cached_tokens: 0,
            generated_tokens: 0,
            role: cfg.role,
            next_role: None,
            draining: false,
            admissions: VecDeque::new(),
            started_at,
            clock,
            core,
            cfg,
        }
    }

    /// The effects asked for since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<WorkerEffect> {
        std::mem::take(&mut self.effects)
    }

    /// The chaos faults aimed at this replica now (read by the driver before each input).
    pub fn set_faults(&mut self, faults: InjectedFaults) {
        self.faults = faults;
    }

    /// This replica.
    pub fn worker(&self) -> &WorkerId {
        &self.cfg.worker
    }

    /// The replica's block pool (read-only).
    pub fn pool(&self) -> &crate::kv::BlockPool {
        self.core.pool()
    }

    /// Requests queued, running or held here.
    pub fn num_live(&self) -> usize {
        self.live.len()
    }

    /// Nothing runs, waits or is held here (a driver may stop ticking it).
    pub fn is_idle(&self) -> bool {
        self.live.is_empty()
            && self.held.is_empty()
            && self.fetching.is_empty()
            && self.exports.is_empty()
    }

    /// Whether the request `key` is here (queued, running or held).
    pub fn has(&self, key: &RequestKey) -> bool {
        self.by_request.contains_key(key) || self.fetching.contains_key(key)
    }

    /// Whether token events wait to be delivered.
    pub fn has_undelivered(&self) -> bool {
        !self.outbox.is_empty()
    }

    /// The batch former (read-only: its pool, its queues).
    pub fn scheduler(&self) -> &SchedulerCore {
        &self.core
    }

    fn emit(&mut self, to: &Owner, request: RequestId, kind: TokenEventKind) {
        self.outbox.push(to, TokenEvent { request, kind });
    }

    /// Hands every pending event to `deliver`, one batch per owner. Events for an owner that
    /// cannot be reached are kept and retried until `status` finds the owner gone; then its
    /// sequences are aborted.
    pub fn flush(
        &mut self,
        deliver: impl FnMut(&Owner, Vec<TokenEvent>) -> Result<(), Vec<TokenEvent>>,
        status: impl FnMut(&Owner) -> OwnerStatus,
    ) {
        let gone = self.outbox.flush(deliver, status);
        for owner in gone {
            self.abort_owner(&owner);
        }
    }

    /// Queue a request. A replica that is not ready answers `Lost` (routed here just before
    /// it left routing: the request is placed elsewhere); a request the batch former refuses
    /// gets `Failed` (400). Duplicates are ignored.
    ///
    /// # Errors
    /// A broken invariant of the batch former while starting steps.
    pub fn submit(&mut self, mut req: SubmitRequest) -> Result<(), WorkerCoreError> {
        let key = (req.reply_to.clone(), req.request);
        if self.has(&key) {
            return Ok(()); // duplicate submission
        }
        let owner = req.owner();
        if self.health != Health::Ready {
            let reason = format!("the worker is {}", self.health);
            self.emit(&owner, req.request, TokenEventKind::Lost { reason });
            return Ok(());
        }
        if let Some(hint) = req.fetch.take()
            && req.remote_kv.is_none()
            && req.sampling.echo_tokens == 0
            && let Some((tokens, timeout)) = self.fetch_plan(&hint, &req.prompt)
        {
            self.peer.asked += 1;
            metrics::counter!("flotilla_kv_peer_pulls_total", "worker" => self.cfg.worker.to_string(), "outcome" => "asked")
                .increment(1);
            self.effects.push(WorkerEffect::Fetch {
                holder: hint.holder.clone(),
                key: key.clone(),
                tokens,
                timeout,
            });
            self.fetching.insert(
                key,
                Fetching {
                    req,
                    holder: hint.holder,
                },
            );
            return Ok(());
        }
        // A migrated stream (it has delivered tokens, and is no disaggregated decode) comes
        // with the rest of its lost worker's requests: an idle engine waits a moment for them,
        // so that they share the first step.
        let resumed = req.sampling.offset > 0 && req.remote_kv.is_none();
        self.enqueue(req);
        let gather = Duration::from_millis(self.core.config().resume_gather_ms);
        if resumed && !gather.is_zero() && !self.watchdog.step_in_flight() {
            if self.gather_until.is_none() {
                let until = self.clock.now() + gather;
                self.gather_until = Some(until);
                self.effects.push(WorkerEffect::KickAt(until));
            }
            return Ok(());
        }
        self.kick()
    }

    /// A gather window ([`WorkerEffect::KickAt`]) ended: start the step it waited for.
    ///
    /// # Errors
    /// A broken invariant of the batch former while starting steps.
    pub fn kick_due(&mut self) -> Result<(), WorkerCoreError> {
        self.gather_until = None;
        self.kick()
    }

    /// Peer pulls: what to ask the holder for, and within how long — or `None` when the hint
    /// is not worth acting on (peer pulls off here, no way to pull, the holder is this worker,
    /// fewer than one block to gain, or the cost rule: the pull's estimated time ≥ the
    /// prefill's, see `worker/scheduler.rs`, "Peer pulls").
    fn fetch_plan(&mut self, hint: &FetchHint, prompt: &[u32]) -> Option<(Vec<u32>, Duration)> {
        let pp = self.cfg.peer_pull?;
        if hint.holder == self.cfg.worker
            || !(self.cfg.has_transport || self.cfg.sim_transfer.is_some())
        {
            return None;
        }
        let bs = self.cfg.block_size.max(1);
        // Never the last token (the engine computes at least one), full blocks only.
        let whole = prompt.len().saturating_sub(1) / bs * bs;
        let want = (hint.blocks as usize * bs).min(whole);
        let local = self.core.pool().cached_lead(prompt);
        if want < local + bs {
            return None;
        }
        let gain = want - local;
        let block_ms = self.pull_block_ms.unwrap_or(pp.prior_block_ms);
        let pull_ms = pp.fixed_ms + block_ms * (gain / bs) as f64;
        let prefill_ms = self
            .step_model
            .cost()
            .map(|c| c.predict_ms(StepShape::of([(local, gain)])) - c.base_ms);
        if prefill_ms.is_some_and(|p| pull_ms >= p) {
            self.peer.declined += 1;
            metrics::counter!("flotilla_kv_peer_pulls_total", "worker" => self.cfg.worker.to_string(), "outcome" => "declined")
                .increment(1);
            return None;
        }
        Some((prompt[..want].to_vec(), pp.ask_timeout))
    }

    /// Peer pull, holder side: pin the leading blocks of `tokens` this replica holds in G1 for
    /// the request `key` of a peer, until the peer confirms (a `Cancel` of `key`) or the hold
    /// (`disagg.hold_ms`) ends. `region` describes where they can be read from (`None` on a
    /// simulated engine).
    ///
    /// # Errors
    /// A reason to give the peer (it recomputes): the replica is not serving, `key` is
    /// already pinned, or none of the prefix is in G1 here.
    pub fn export(
        &mut self,
        key: RequestKey,
        tokens: &[u32],
        region: Option<RegionDescriptor>,
    ) -> Result<RemoteKv, String> {
        if self.health == Health::Unhealthy {
            return Err(format!("the holder {} is unhealthy", self.cfg.worker));
        }
        if self.exports.contains_key(&key) {
            return Err("this request's prefix is already pinned here".into());
        }
        self.next_seq += 1;
        let seq = SeqId(self.next_seq);
        let (blocks, lease) = self
            .core
            .pool_mut()
            .pin_cached(seq, tokens)
            .map_err(|e| e.to_string())?;
        let Some(lease) = lease else {
            return Err(format!(
                "{} holds none of the prefix in G1",
                self.cfg.worker
            ));
        };
        let hold = self.cfg.disagg.hold;
        self.peer.exported += 1;
        metrics::counter!("flotilla_kv_peer_exports_total", "worker" => self.cfg.worker.to_string())
            .increment(1);
        let kv = RemoteKv {
            worker: self.cfg.worker.clone(),
            request: key.1,
            region,
            tokens: (blocks.len() * self.cfg.block_size) as u32,
            blocks: blocks.iter().map(|b| b.0).collect(),
            held_until_ms: self.clock.wall_ms() + hold.as_millis() as u64,
        };
        self.exports.insert(
            key,
            Export {
                lease,
                until: self.clock.now() + hold,
            },
        );
        Ok(kv)
    }

    /// The holder answered a [`WorkerEffect::Fetch`]: the request is queued, with the pinned
    /// blocks to pull (or, after a refusal or a timeout, to compute here).
    ///
    /// # Errors
    /// A broken invariant of the batch former while starting steps.
    pub fn fetch_done(
        &mut self,
        key: &RequestKey,
        answer: Result<RemoteKv, String>,
    ) -> Result<(), WorkerCoreError> {
        let Some(Fetching { mut req, holder }) = self.fetching.remove(key) else {
            // Cancelled (or dropped) meanwhile: unpin what the holder pinned.
            if let Ok(kv) = answer {
                self.effects.push(WorkerEffect::ConfirmPull {
                    prefill: kv.worker,
                    key: key.clone(),
                });
            }
            return Ok(());
        };
        match answer {
            Ok(kv) if (kv.tokens as usize) < req.prompt.len() && kv.tokens > 0 => {
                req.remote_kv = Some(kv);
            }
            Ok(kv) => {
                self.effects.push(WorkerEffect::ConfirmPull {
                    prefill: kv.worker,
                    key: key.clone(),
                });
                self.peer_failed(&holder, "the holder pinned nothing usable");
            }
            Err(why) => self.peer_failed(&holder, &why),
        }
        let peer = req.remote_kv.is_some();
        if self.health != Health::Ready {
            if peer {
                self.effects.push(WorkerEffect::ConfirmPull {
                    prefill: holder,
                    key: key.clone(),
                });
            }
            let reason = format!("the worker is {}", self.health);
            self.emit(&req.owner(), req.request, TokenEventKind::Lost { reason });
            return Ok(());
        }
        self.enqueue(req);
        if peer {
            match self.by_request.get(key) {
                Some(&seq) => {
                    self.peer_seqs.insert(seq, (holder, key.clone()));
                }
                None => self.effects.push(WorkerEffect::ConfirmPull {
                    prefill: holder,
                    key: key.clone(),
                }),
            }
        }
        self.kick()?;
        self.forward_kv_events();
        Ok(())
    }

    fn peer_failed(&mut self, holder: &WorkerId, why: &str) {
        self.peer.failed += 1;
        metrics::counter!("flotilla_kv_peer_pulls_total", "worker" => self.cfg.worker.to_string(), "outcome" => "failed")
            .increment(1);
        tracing::info!(worker = %self.cfg.worker, %holder, %why, "peer pull failed; recomputing the prefix here");
    }

    /// Queue a submission with the batch former (a refusal answers `Failed`, 400).
    fn enqueue(&mut self, req: SubmitRequest) {
        let key = (req.reply_to.clone(), req.request);
        let owner = req.owner();
        self.next_seq += 1;
        let seq = SeqId(self.next_seq);
        // Remote KV must end inside the prompt (the prompt ends with the first token the
        // prefill worker sampled); otherwise the prompt is computed here.
        let remote = req
            .remote_kv
            .filter(|kv| (kv.tokens as usize) < req.prompt.len() && kv.tokens > 0);
        let prompt_tokens = u32::try_from(req.prompt.len()).unwrap_or(u32::MAX);
        let added = self.core.add(SeqRequest {
            remote_tokens: remote.as_ref().map_or(0, |kv| kv.tokens as usize),
            hand_off: req.hand_off,
            class: req.class,
            // Prompt log-probabilities need every prompt position computed here.
            uncached: req.sampling.echo_tokens > 0 && remote.is_none(),
            // A migrated stream re-prefills what its client already has.
            resumed: req.sampling.offset > 0 && remote.is_none(),
            seq,
            prompt: req.prompt,
            max_tokens: req.max_tokens as usize,
            stop_token_ids: req.stop_token_ids,
            eos_token_id: if req.ignore_eos {
                None
            } else {
                self.cfg.eos_token_id
            },
            waiting_since: req.waiting_since_ms,
        });
        match added {
            Ok(()) => {
                tracing::debug!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %req.request, request_id = %req.trace_id.as_deref().unwrap_or("-"), "sequence queued");
                self.by_request.insert(key, seq);
                self.live.insert(
                    seq,
                    Live {
                        request: req.request,
                        owner,
                        sampling: req.sampling,
                        admitted: false,
                        emitted: 0,
                        span: sequence_span(
                            &self.cfg.worker,
                            &req.trace_id,
                            req.traceparent.as_deref(),
                        ),
                        trace_id: req.trace_id,
                        remote,
                        queued_at: self.clock.now(),
                        prompt_tokens,
                    },
                );
            }
            Err(e) => {
                self.emit(
                    &owner,
                    req.request,
                    TokenEventKind::Failed {
                        message: e.to_string(),
                        status: 400,
                    },
                );
            }
        }
    }

    /// Cancel the request `key` (unknown keys are ignored): its blocks are freed at once.
    ///
    /// # Errors
    /// A broken invariant of the batch former while starting steps.
    pub fn cancel(&mut self, key: &RequestKey) -> Result<(), WorkerCoreError> {
        if let Some(e) = self.exports.remove(key) {
            // A peer's pull is over: unpin.
            if let Err(err) = self.core.pool_mut().free(e.lease) {
                tracing::error!(worker = %self.cfg.worker, error = %err, "unpinning an export");
            }
            self.forward_kv_events();
            return self.kick();
        }
        if self.fetching.remove(key).is_some() {
            return Ok(()); // its fetch answer unpins the holder
        }
        if let Some(seq) = self.by_request.get(key).copied() {
            self.drop_seq(seq);
            self.forward_kv_events();
            self.kick()?;
            self.maybe_switch_role();
        }
        Ok(())
    }

    /// A step came back from the engine. `region` describes where this replica's KV can be
    /// read from (asked only when a sequence is handed off).
    ///
    /// # Errors
    /// The engine is gone (the replica must restart: every sequence was told `Lost`), or a
    /// broken invariant of the batch former.
    pub fn step_done(
        &mut self,
        result: StepResult,
        region: impl Fn() -> Option<RegionDescriptor>,
    ) -> Result<(), WorkerCoreError> {
        self.on_step_done(result, region)?;
        self.kick()?;
        self.maybe_switch_role();
        Ok(())
    }

    /// Lower-tier copies returned: onboarded sequences run (recomputing what did not arrive
    /// intact), stored blocks are announced.
    ///
    /// # Errors
    /// A broken invariant of the batch former.
    pub fn copies_done(
        &mut self,
        results: &[(crate::kv::CopyId, crate::kv::CopyOutcome)],
    ) -> Result<(), WorkerCoreError> {
        self.core.copies_done(results)?;
        self.forward_kv_events();
        self.kick()?;
        self.maybe_switch_role();
        Ok(())
    }

    /// A pull returned: the sequence decodes (or recomputes what it lacks), and the prefill
    /// worker is told to release its blocks.
    ///
    /// # Errors
    /// A broken invariant of the batch former.
    pub fn pull_done(&mut self, r: PullResult) -> Result<(), WorkerCoreError> {
        let ok = r.outcome.is_ok();
        self.kv_transfer_bytes += r.bytes;
        let w = self.cfg.worker.to_string();
        let started = self.pull_started.remove(&r.seq);
        if let (Some((at, n)), Ok(_)) = (started, &r.outcome)
            && n > 0
        {
            // The measured time per block, a moving average (the cost rule's pull estimate).
            let ms = self.clock.now().saturating_duration_since(at).as_secs_f64() * 1e3 / n as f64;
            self.pull_block_ms = Some(self.pull_block_ms.map_or(ms, |m| 0.8 * m + 0.2 * ms));
        }
        let peer = self.peer_seqs.remove(&r.seq).map(|(holder, _)| holder);
        if let Some((local, pulled)) = self.peer_admits.remove(&r.seq)
            && let Some(live) = self.live.get(&r.seq)
        {
            let (to, req, prompt) = (live.owner.clone(), live.request, live.prompt_tokens);
            let trace = (live.trace_id.clone(), live.span.clone());
            self.admitted(&to, req, trace, prompt, if ok { pulled } else { local });
        }
        match (&r.outcome, peer) {
            (Ok(blocks), Some(_)) => {
                self.peer.pulled += 1;
                self.peer.blocks += *blocks as u64;
                metrics::counter!("flotilla_kv_peer_pulls_total", "worker" => w.clone(), "outcome" => "pulled")
                    .increment(1);
                metrics::counter!("flotilla_kv_peer_pull_blocks_total", "worker" => w)
                    .increment(*blocks as u64);
            }
            (Err(why), Some(holder)) => self.peer_failed(&holder, why),
            (Ok(blocks), None) => {
                self.blocks_pulled += *blocks as u64;
                metrics::counter!("flotilla_disagg_pulled_blocks_total", "worker" => w)
                    .increment(*blocks as u64);
            }
            (Err(why), None) => {
                self.pull_fallbacks += 1;
                metrics::counter!("flotilla_disagg_pull_fallbacks_total", "worker" => w)
                    .increment(1);
                tracing::warn!(worker = %self.cfg.worker, seq = %r.seq, %why, "KV pull failed; recomputing the prompt here");
            }
        }
        self.core.pull_done(r.seq, ok)?;
        if let Some((prefill, key)) = self.pulls.remove(&r.seq) {
            self.effects
                .push(WorkerEffect::ConfirmPull { prefill, key });
        }
        self.forward_kv_events();
        self.kick()?;
        self.maybe_switch_role();
        Ok(())
    }

    /// Change this replica's role: it leaves routing, finishes what it runs, then switches and
    /// is routable again.
    pub fn set_role(&mut self, role: Role) {
        if role == self.role && self.next_role.is_none() {
            return;
        }
        tracing::info!(worker = %self.cfg.worker, from = %self.role, to = %role, live = self.live.len(), "role change: draining first");
        self.next_role = Some(role);
        if self.health == Health::Ready {
            self.leave_routing(Health::Draining);
        }
        self.maybe_switch_role();
    }

    /// Stop taking new work (leave routing for good); running requests go on.
    pub fn drain(&mut self) {
        self.draining = true;
        if self.health == Health::Ready {
            tracing::info!(worker = %self.cfg.worker, live = self.live.len(), "draining");
            self.leave_routing(Health::Draining);
        }
    }

    /// Hand off every request here: each is told `Lost` with `reason` and migrates.
    pub fn hand_off_all(&mut self, reason: String) {
        tracing::warn!(worker = %self.cfg.worker, live = self.live.len(), %reason, "handing every request off");
        self.drop_all(&TokenEventKind::Lost { reason });
        self.forward_kv_events();
    }

    /// The replica stops: every live request hears it and migrates with what it has.
    pub fn stop(&mut self) {
        let lost = TokenEventKind::Lost {
            reason: "the replica stopped".into(),
        };
        let live: Vec<(Owner, RequestId)> = self
            .live
            .values()
            .map(|l| (l.owner.clone(), l.request))
            .collect();
        for (to, req) in live {
            self.emit(&to, req, lost.clone());
        }
    }

    /// The canary's ping came back.
    pub fn canary_done(&mut self) {
        self.watchdog.canary_returned();
    }

    /// Periodic: chaos `fill_kv`, owners gone (`status`), holds ended, a pending role change,
    /// the watchdog and canary, and work that waits for blocks freed outside a step.
    ///
    /// # Errors
    /// [`EngineHung`] when the engine missed a deadline: the replica has left routing and
    /// the schedulers' group, and must restart. Or a broken invariant of the batch former.
    pub fn tick(
        &mut self,
        status: impl FnMut(&Owner) -> OwnerStatus,
    ) -> Result<(), WorkerCoreError> {
        self.fill_kv();
        self.check_owners(status);
        self.expire_held();
        self.maybe_switch_role();
        match self.watchdog.check() {
            WatchdogVerdict::Healthy => {}
            WatchdogVerdict::Ping => self.effects.push(WorkerEffect::Ping),
            WatchdogVerdict::Hung(what) => {
                self.leave_routing(Health::Unhealthy);
                self.effects.push(WorkerEffect::Leave(SCHEDULER_GROUP));
                return Err(EngineHung {
                    what,
                    timeout_ms: self.watchdog.step_timeout().as_millis() as u64,
                }
                .into());
            }
        }
        self.kick()
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
        tracing::warn!(worker = %self.cfg.worker, %owner, sequences = orphans.len(),
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
        self.fetching.retain(|_, f| f.req.owner() != *owner);
        self.forward_kv_events();
    }

    /// Abort the sequences of every owner that is gone (sequences that emit nothing, e.g.
    /// waiting ones, are found too).
    fn check_owners(&mut self, mut status: impl FnMut(&Owner) -> OwnerStatus) {
        let mut owners: Vec<Owner> = self
            .live
            .values()
            .map(|l| l.owner.clone())
            .chain(self.held.values().map(|h| h.owner.clone()))
            .collect();
        owners.sort();
        owners.dedup();
        for owner in owners {
            if self.outbox.is_gone(&owner, status(&owner)) {
                self.abort_owner(&owner);
            }
        }
        let live = &self.live;
        self.outbox
            .retain_missing(|o| live.values().any(|l| l.owner == *o));
    }

    fn drop_seq(&mut self, seq: SeqId) {
        self.core.cancel(seq);
        self.peer_admits.remove(&seq);
        if let Some((holder, key)) = self.peer_seqs.remove(&seq)
            && !self.pulls.contains_key(&seq)
        {
            // Not pulling yet: unpin the holder's blocks now (a running pull confirms when
            // it returns).
            self.effects.push(WorkerEffect::ConfirmPull {
                prefill: holder,
                key,
            });
        }
        if let Some(l) = self.live.remove(&seq) {
            let _in = l.span.enter();
            tracing::info!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %l.request, request_id = %l.trace_id.as_deref().unwrap_or("-"), tokens = l.emitted, "sequence dropped");
            self.by_request.remove(&(l.owner.node, l.request));
        }
        if let Some(h) = self.held.remove(&seq) {
            tracing::debug!(worker = %self.cfg.worker, request = %h.request, "handed-off blocks released");
            self.by_request.remove(&(h.owner.node, h.request));
        }
        self.effects.push(WorkerEffect::Release(seq));
    }

    /// Unpins the exports `which` selects.
    fn release_exports(&mut self, which: impl Fn(&Export) -> bool) {
        let keys: Vec<RequestKey> = self
            .exports
            .iter()
            .filter(|(_, e)| which(e))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            if let Some(e) = self.exports.remove(&k)
                && let Err(err) = self.core.pool_mut().free(e.lease)
            {
                tracing::error!(worker = %self.cfg.worker, error = %err, "unpinning an export");
            }
        }
    }

    /// Releases handed-off blocks whose hold ended without a confirmation.
    fn expire_held(&mut self) {
        let now = self.clock.now();
        let before = self.exports.len();
        self.release_exports(|e| e.until <= now);
        if self.exports.len() < before {
            tracing::info!(worker = %self.cfg.worker, exports = before - self.exports.len(), "peer-pull pins expired unconfirmed; unpinned");
            self.forward_kv_events();
        }
        let expired: Vec<SeqId> = self
            .held
            .iter()
            .filter(|(_, h)| h.until <= now)
            .map(|(s, _)| *s)
            .collect();
        if expired.is_empty() {
            return;
        }
        tracing::info!(worker = %self.cfg.worker, sequences = expired.len(), "hand-off holds expired unconfirmed; releasing their blocks");
        metrics::counter!("flotilla_disagg_holds_expired_total").increment(expired.len() as u64);
        for s in expired {
            self.drop_seq(s);
        }
        self.forward_kv_events();
    }

    /// A sequence of `prompt_tokens` was admitted with `cached_tokens` from the prefix cache
    /// (or pulled): counted in the admission window and the prefix-hit counters, and its owner
    /// told.
    fn admitted(
        &mut self,
        to: &Owner,
        request: RequestId,
        (trace_id, span): (Option<String>, tracing::Span),
        prompt_tokens: u32,
        cached_tokens: usize,
    ) {
        let _in = span.enter();
        tracing::info!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %request, request_id = %trace_id.as_deref().unwrap_or("-"), prompt_tokens, cached_tokens, "sequence admitted");
        self.note_admission();
        self.admitted_prompt_tokens += u64::from(prompt_tokens);
        self.admitted_cached_tokens += (cached_tokens as u64).min(u64::from(prompt_tokens));
        let worker = self.cfg.worker.clone();
        let cached_tokens = cached_tokens as u32;
        self.emit(
            to,
            request,
            TokenEventKind::Admitted {
                worker,
                cached_tokens,
            },
        );
    }

    fn note_admission(&mut self) {
        let now = self.clock.now();
        while self
            .admissions
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > ADMIT_RATE_WINDOW)
        {
            self.admissions.pop_front();
        }
        self.admissions.push_back(now);
    }

    /// Starts the pull of a sequence admitted with remote KV.
    fn start_pull(&mut self, order: PullOrder) {
        let seq = order.seq;
        let Some(live) = self.live.get_mut(&seq) else {
            let _ = self.core.pull_done(seq, false);
            return;
        };
        live.admitted = true;
        let kv = live.remote.take();
        let (to, req, prompt) = (live.owner.clone(), live.request, live.prompt_tokens);
        let trace = (live.trace_id.clone(), live.span.clone());
        if self.peer_seqs.contains_key(&seq) {
            // Admitted once the pull returns (`pull_done`).
            self.peer_admits
                .insert(seq, (order.cached_tokens, order.tokens));
        } else {
            self.admitted(&to, req, trace, prompt, order.cached_tokens);
        }
        let n = order.blocks.len();
        let Some(kv) = kv else {
            self.effects.push(WorkerEffect::Pull(PullJob {
                seq,
                from: None,
                blocks: n,
                work: PullWork::Fail("no remote KV".into()),
            }));
            return;
        };
        self.pulls
            .insert(seq, (kv.worker.clone(), (to.node.clone(), kv.request)));
        let pairs: Vec<(u32, u32)> = order
            .blocks
            .iter()
            .filter_map(|&(i, b)| kv.blocks.get(i).map(|&r| (r, b.0)))
            .collect();
        // The pull must end before the prefill worker's hold does (its clock; the nodes'
        // clocks are assumed within `hold_margin` of each other).
        let d = self.cfg.disagg;
        let left_ms = kv
            .held_until_ms
            .saturating_sub(self.clock.wall_ms())
            .saturating_sub(d.hold_margin.as_millis() as u64);
        let budget = d.transfer_timeout.min(Duration::from_millis(left_ms));
        let work = if pairs.len() != n {
            PullWork::Fail(format!(
                "the hand-off names {} blocks; {n} needed",
                kv.blocks.len()
            ))
        } else if budget.is_zero() {
            PullWork::Fail("the prefill worker's hold ends too soon".into())
        } else {
            match (kv.region, self.cfg.has_transport, self.cfg.sim_transfer) {
                (Some(from), true, _) => PullWork::Transport {
                    from,
                    pairs,
                    budget,
                },
                (None, _, Some(sim)) => PullWork::Sim {
                    time: sim.time(n, self.cfg.block_size),
                    budget,
                },
                _ => PullWork::Fail("no transport to pull the KV with".into()),
            }
        };
        if !matches!(work, PullWork::Fail(_)) {
            self.pull_started.insert(seq, (self.clock.now(), n));
        }
        self.effects.push(WorkerEffect::Pull(PullJob {
            seq,
            from: Some(kv.worker.clone()),
            blocks: n,
            work,
        }));
    }

    /// Carries out a pending role change once nothing runs or is held here.
    fn maybe_switch_role(&mut self) {
        let Some(next) = self.next_role else {
            return;
        };
        if !self.live.is_empty() || !self.held.is_empty() || self.core.num_pulling() > 0 {
            return;
        }
        if let Some(g) = role_group(self.role) {
            self.effects.push(WorkerEffect::Leave(g));
        }
        if let Some(g) = role_group(next) {
            self.effects.push(WorkerEffect::Join(g));
        }
        tracing::info!(worker = %self.cfg.worker, from = %self.role, to = %next, "role changed");
        self.effects.push(WorkerEffect::RoleChanged(next));
        self.role = next;
        self.next_role = None;
        if !self.draining && self.health == Health::Draining {
            self.health = Health::Ready;
            self.effects.push(WorkerEffect::Join(ROUTABLE_GROUP));
        }
    }

    fn forward_kv_events(&mut self) {
        let copies = self.core.pool_mut().drain_copies();
        if !copies.is_empty() {
            self.effects.push(WorkerEffect::TierCopies(copies));
        }
        let events: Vec<KvEvent> = self.core.drain_kv_events();
        if events.is_empty() {
            return;
        }
        let tokens = self.core.pool_mut().drain_event_tokens();
        self.effects.push(WorkerEffect::KvEvents { events, tokens });
    }

    /// Start the next step if none is running and there is work (not within a gather window).
    fn kick(&mut self) -> Result<(), WorkerCoreError> {
        if self
            .gather_until
            .is_some_and(|until| self.clock.now() < until)
        {
            return Ok(());
        }
        while !self.watchdog.step_in_flight() && self.core.has_unfinished() {
            let mut batch = self.core.schedule_with(self.step_model.cost().as_ref())?;
            for order in std::mem::take(&mut batch.pulls) {
                self.start_pull(order);
            }
            let copies = self.core.pool_mut().drain_copies();
            if !copies.is_empty() {
                self.effects.push(WorkerEffect::TierCopies(copies));
            }
            let mut seqs = Vec::with_capacity(batch.entries.len());
            for e in &batch.entries {
                let Some(live) = self.live.get_mut(&e.seq) else {
                    continue;
                };
                if e.cached_tokens.is_some()
                    && !self.pulls.contains_key(&e.seq)
                    && let Some((holder, key)) = self.peer_seqs.remove(&e.seq)
                {
                    // Cached here after all (nothing to pull): unpin the holder's blocks.
                    self.peer.moot += 1;
                    metrics::counter!("flotilla_kv_peer_pulls_total", "worker" => self.cfg.worker.to_string(), "outcome" => "moot")
                        .increment(1);
                    self.effects.push(WorkerEffect::ConfirmPull {
                        prefill: holder,
                        key,
                    });
                }
                if let Some(cached) = e.cached_tokens
                    && !live.admitted
                {
                    live.admitted = true;
                    let (to, req, prompt) = (live.owner.clone(), live.request, live.prompt_tokens);
                    let trace = (live.trace_id.clone(), live.span.clone());
                    self.admitted(&to, req, trace, prompt, cached);
                }
                let live = &self.live[&e.seq];
                seqs.push(StepSeq {
                    seq_id: e.seq,
                    tokens: e.token_ids.clone(),
                    start_pos: e.start_pos,
                    block_table: e.block_table.clone(),
                    sampling: live.sampling.clone(),
                    sample: e.sample,
                    score: prompt_targets(e, live.sampling.echo_tokens as usize),
                });
            }
            if seqs.is_empty() {
                // Nothing could run (e.g. all admissions wait for blocks): close the step.
                self.core.on_step_output(&[])?;
                break;
            }
            self.steps += 1;
            if let Some(prefill) = batch.stall_capped {
                let worker = self.cfg.worker.to_string();
                metrics::counter!("flotilla_scheduler_stall_capped_steps_total", "worker" => worker.clone())
                    .increment(1);
                metrics::gauge!("flotilla_scheduler_prefill_cap_tokens", "worker" => worker)
                    .set(prefill as f64);
            }
            // The engine's chaos filter sleeps a `slow` delay before the step: not engine time
            // (the watchdog allows for it; the step-time model does not learn from the step).
            let delay = self.faults.step_delay;
            self.step_timing = Some(StepTiming {
                shape: StepShape::of(
                    batch
                        .entries
                        .iter()
                        .map(|e| (e.start_pos, e.token_ids.len())),
                ),
                started: self.clock.now(),
                clean: delay.is_zero() && !self.faults.hang,
            });
            self.watchdog.step_started(delay);
            self.effects.push(WorkerEffect::Step {
                step: self.steps,
                batch: StepBatch { seqs },
            });
        }
        Ok(())
    }

    fn on_step_done(
        &mut self,
        result: StepResult,
        region: impl Fn() -> Option<RegionDescriptor>,
    ) -> Result<(), WorkerCoreError> {
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
                tracing::error!(worker = %self.cfg.worker, error = %err, "engine step failed");
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
                if gone {
                    return Err(err.into());
                }
                return Ok(());
            }
        };
        // Prompt log-probabilities first: they precede the sequence's first token.
        for p in out.prompt {
            let Some(l) = self.live.get(&p.seq_id) else {
                continue;
            };
            let (to, req) = (l.owner.clone(), l.request);
            self.emit(
                &to,
                req,
                TokenEventKind::Prompt {
                    first: u32::try_from(p.first).unwrap_or(u32::MAX),
                    logprobs: p.logprobs,
                },
            );
        }
        let sampled: Vec<(SeqId, u32)> = out.tokens.iter().map(|t| (t.seq_id, t.token)).collect();
        let mut logprobs: HashMap<SeqId, (f32, Vec<(u32, f32)>)> = out
            .tokens
            .into_iter()
            .map(|t| (t.seq_id, (t.logprob, t.top)))
            .collect();
        let updates = self.core.on_step_output(&sampled)?;
        for u in updates {
            let Some(l) = self.live.get_mut(&u.seq) else {
                continue;
            };
            let index = l.emitted;
            l.emitted += 1;
            self.generated_tokens += 1;
            let (to, req) = (l.owner.clone(), l.request);
            let finish = u.finished;
            let (logprob, top) = logprobs.remove(&u.seq).unwrap_or((0.0, Vec::new()));
            self.emit(
                &to,
                req,
                TokenEventKind::Token {
                    id: u.token,
                    logprob,
                    finish,
                    index,
                    top,
                },
            );
            if let Some(h) = u.handed_off {
                // Disaggregated prefill: the first token went out above; the KV waits,
                // pinned, for the decode worker's pull.
                let now = self.clock.now();
                let hold = self.cfg.disagg.hold;
                let kv = RemoteKv {
                    worker: self.cfg.worker.clone(),
                    request: req,
                    region: region(),
                    blocks: h.blocks.iter().map(|b| b.0).collect(),
                    tokens: h.tokens as u32,
                    held_until_ms: self.clock.wall_ms() + hold.as_millis() as u64,
                };
                let blocks = kv.blocks.len();
                self.emit(&to, req, TokenEventKind::HandOff(Box::new(kv)));
                if let Some(l) = self.live.remove(&u.seq) {
                    let _in = l.span.enter();
                    tracing::info!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %l.request, request_id = %l.trace_id.as_deref().unwrap_or("-"), blocks, "sequence handed off");
                    self.held.insert(
                        u.seq,
                        Held {
                            request: l.request,
                            owner: l.owner,
                            until: now + hold,
                        },
                    );
                }
                metrics::counter!("flotilla_disagg_hand_offs_total", "worker" => self.cfg.worker.to_string())
                    .increment(1);
                continue;
            }
            if finish.is_some() {
                if let Some(l) = self.live.remove(&u.seq) {
                    let _in = l.span.enter();
                    tracing::info!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %l.request, request_id = %l.trace_id.as_deref().unwrap_or("-"), tokens = l.emitted, "sequence finished");
                    self.by_request.remove(&(l.owner.node, l.request));
                }
                self.effects.push(WorkerEffect::Release(u.seq));
            }
        }
        self.forward_kv_events();
        Ok(())
    }

    /// Feeds a step that came back to the step-time model, unless an injected delay or hang
    /// may have lengthened it (one active when it started or now).
    fn learn_step_time(&mut self, t: StepTiming) {
        if !t.clean || !self.faults.step_delay.is_zero() || self.faults.hang {
            return;
        }
        let ms = self.clock.now().duration_since(t.started).as_secs_f64() * 1000.0;
        tracing::debug!(target: STEP_TARGET, worker = %self.cfg.worker, tokens = t.shape.tokens, ms = ms.round(), running = self.core.num_running(), waiting = self.core.num_waiting(), "step");
        self.step_model.observe(t.shape, ms);
        let w = self.cfg.worker.to_string();
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
        let fraction = self.faults.fill_kv;
        let worker = &self.cfg.worker;
        match self.fill.apply(fraction, self.core.pool_mut()) {
            Ok(FillChange::Unchanged) => {}
            Ok(FillChange::Occupied(n)) => {
                tracing::warn!(%worker, blocks = n, "chaos: KV blocks occupied")
            }
            Ok(FillChange::Released) => {
                tracing::warn!(%worker, "chaos: KV blocks released");
                self.forward_kv_events();
            }
            Err(e) if fraction.is_some() => {
                tracing::warn!(%worker, error = %e, "chaos: fill_kv failed")
            }
            Err(e) => {
                tracing::error!(%worker, error = %e, "chaos: fill_kv release failed");
                tracing::warn!(%worker, "chaos: KV blocks released");
                self.forward_kv_events();
            }
        }
    }

    /// Send `kind` to every live request and drop them all (held hand-offs are released).
    fn drop_all(&mut self, kind: &TokenEventKind) {
        for (_, f) in std::mem::take(&mut self.fetching) {
            // Their holders' answers come to nobody: the pins end with their holds.
            self.emit(&f.req.owner(), f.req.request, kind.clone());
        }
        self.release_exports(|_| true);
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

    /// Leave routing (drain, hang, role change): routers stop choosing this replica at once.
    fn leave_routing(&mut self, health: Health) {
        self.health = health;
        self.effects.push(WorkerEffect::Leave(ROUTABLE_GROUP));
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

    /// What this replica publishes on its node's board.
    pub fn stats(&self) -> SchedulerStats {
        let usage = self.core.kv_usage();
        SchedulerStats {
            worker: self.cfg.worker.clone(),
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
            kv_tiers: self.core.pool().tier_usage(),
            peer_pulls: self.peer,
            prompt_tokens: self.admitted_prompt_tokens,
            cached_tokens: self.admitted_cached_tokens,
            generated_tokens: self.generated_tokens,
            kv_transfer_bytes: self.kv_transfer_bytes,
        }
    }
}

/// The `sequence` span of a submission that carries a `traceparent` (an OTLP export runs on
/// its gateway): a child of the gateway's `request` span, under [`SEQUENCE_TARGET`]. Without
/// one, no span (the lines carry `request_id` themselves).
/// What each row of a scheduled entry is scored against for prompt log-probabilities: the
/// token after it, for every row whose next position is among the first `echo_tokens` (the
/// client's prompt; a migrated sequence's prompt also holds the tokens generated before).
/// Empty when the entry scores nothing (no echo, a decode step, or past the prompt).
fn prompt_targets(e: &ScheduledSeq, echo_tokens: usize) -> Vec<u32> {
    let scored = echo_tokens
        .saturating_sub(e.start_pos + 1)
        .min(e.token_ids.len());
    (0..scored)
        .filter_map(|i| e.token_ids.get(i + 1).copied().or(e.next_token))
        .collect()
}

fn sequence_span(
    worker: &WorkerId,
    trace_id: &Option<String>,
    traceparent: Option<&str>,
) -> tracing::Span {
    let Some(tp) = traceparent else {
        return tracing::Span::none();
    };
    let span = tracing::info_span!(target: SEQUENCE_TARGET, "sequence", %worker, request_id = %trace_id.as_deref().unwrap_or("-"));
    crate::runtime::otlp::adopt_remote_parent(&span, Some(tp));
    span
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::BlockPool;
    use crate::runtime::clock::{Clock, ManualClock};
    use crate::worker::engine::{SampledToken, StepOutput};
    use crate::worker::scheduler::SchedulerConfig;
    use std::sync::Arc;

    /// Echo: each row is scored against the token after it, while that token is among the
    /// first `echo_tokens`; the last row of a chunk against the next chunk's first token.
    #[test]
    fn prompt_rows_are_scored_against_the_next_prompt_token() {
        let entry = |start: usize, ids: &[u32], next: Option<u32>| ScheduledSeq {
            seq: SeqId(1),
            token_ids: ids.to_vec(),
            start_pos: start,
            block_table: vec![],
            sample: next.is_none(),
            cached_tokens: None,
            next_token: next,
        };
        // Prompt [10, 11, 12, 13, 14] in two chunks.
        assert_eq!(
            prompt_targets(&entry(0, &[10, 11, 12], Some(13)), 5),
            [11, 12, 13]
        );
        assert_eq!(prompt_targets(&entry(3, &[13, 14], None), 5), [14]);
        // No echo; a one-token prompt; a decode step past the prompt.
        assert!(prompt_targets(&entry(0, &[10, 11, 12], Some(13)), 0).is_empty());
        assert!(prompt_targets(&entry(0, &[10], None), 1).is_empty());
        assert!(prompt_targets(&entry(5, &[15], None), 5).is_empty());
        // A migrated sequence (prompt + 2 generated): only the client's prompt is scored.
        assert_eq!(
            prompt_targets(&entry(0, &[10, 11, 12, 13, 14, 15, 16], None), 5),
            [11, 12, 13, 14]
        );
    }

    fn core(clock: &ManualClock, role: Role) -> WorkerCore {
        let pool = BlockPool::new(64, 4, 7).unwrap();
        let batcher = SchedulerCore::new(SchedulerConfig::default(), pool).unwrap();
        WorkerCore::new(
            WorkerCoreConfig {
                worker: WorkerId::new("n/replica-0"),
                eos_token_id: None,
                block_size: 4,
                role,
                disagg: DisaggWorker::default(),
                step_timeout: Duration::from_secs(2),
                canary_interval: Duration::from_secs(10),
                owner_grace: Duration::from_secs(3),
                has_transport: false,
                sim_transfer: None,
                peer_pull: None,
            },
            batcher,
            Arc::new(clock.clone()),
        )
    }

    fn job(id: u64, max_tokens: u32) -> SubmitRequest {
        SubmitRequest {
            request: RequestId(id),
            reply_to: NodeId::new("gw"),
            prompt: (1..=10).collect(),
            max_tokens,
            sampling: SamplingParams::default(),
            stop_token_ids: vec![],
            ignore_eos: true,
            owner_incarnation: 1,
            waiting_since_ms: 0,
            trace_id: None,
            traceparent: None,
            hand_off: false,
            remote_kv: None,
            fetch: None,
            class: None,
            session: None,
        }
    }

    /// The step the core asked for, answered with token 42 for every sampling row.
    fn answer(effects: &[WorkerEffect]) -> Option<StepResult> {
        effects.iter().find_map(|e| match e {
            WorkerEffect::Step { step, batch } => Some(StepResult {
                step: *step,
                output: Ok(StepOutput {
                    tokens: batch
                        .seqs
                        .iter()
                        .filter(|s| s.sample)
                        .map(|s| SampledToken {
                            seq_id: s.seq_id,
                            token: 42,
                            logprob: 0.0,
                            top: Vec::new(),
                        })
                        .collect(),
                    prompt: Vec::new(),
                }),
            }),
            _ => None,
        })
    }

    fn delivered(core: &mut WorkerCore) -> Vec<TokenEventKind> {
        let mut out = Vec::new();
        core.flush(
            |_, events| {
                out.extend(events.into_iter().map(|e| e.kind));
                Ok(())
            },
            |_| OwnerStatus::Present,
        );
        out
    }

    /// A puller: peer pulls on, pulls simulated (no transport here).
    fn puller(clock: &ManualClock) -> WorkerCore {
        let pool = BlockPool::new(64, 4, 7).unwrap();
        let batcher = SchedulerCore::new(SchedulerConfig::default(), pool).unwrap();
        WorkerCore::new(
            WorkerCoreConfig {
                worker: WorkerId::new("n/replica-1"),
                eos_token_id: None,
                block_size: 4,
                role: Role::Aggregated,
                disagg: DisaggWorker::default(),
                step_timeout: Duration::from_secs(2),
                canary_interval: Duration::from_secs(10),
                owner_grace: Duration::from_secs(3),
                has_transport: false,
                sim_transfer: Some(SimTransfer {
                    bytes_per_token: 1024,
                    gbps: 1.0,
                    latency: Duration::from_micros(100),
                    speedup: 1.0,
                }),
                peer_pull: Some(PeerPullWorker {
                    prior_block_ms: 0.1,
                    fixed_ms: 0.1,
                    ask_timeout: Duration::from_secs(1),
                }),
            },
            batcher,
            Arc::new(clock.clone()),
        )
    }

    fn run_out(w: &mut WorkerCore, clock: &ManualClock) {
        while let Some(step) = answer(&w.take_effects()) {
            clock.advance(Duration::from_millis(5));
            w.step_done(step, || None).unwrap();
            delivered(w);
        }
    }

    #[test]
    fn a_peer_pull_pins_the_holders_prefix_until_the_puller_confirms_and_a_refusal_recomputes() {
        let clock = ManualClock::new();
        let mut h = core(&clock, Role::Aggregated);
        h.submit(job(1, 2)).unwrap();
        run_out(&mut h, &clock);
        let holder = h.worker().clone();
        let mut p = puller(&clock);
        p.take_effects();
        let mut j = job(2, 2);
        j.fetch = Some(FetchHint {
            holder: holder.clone(),
            blocks: 2,
        });
        let key = (NodeId::new("gw"), RequestId(2));
        p.submit(j).unwrap();
        let asked = p.take_effects();
        let Some(WorkerEffect::Fetch { tokens, .. }) = asked
            .iter()
            .find(|e| matches!(e, WorkerEffect::Fetch { .. }))
        else {
            panic!("no fetch: {asked:?}");
        };
        assert_eq!(tokens.len(), 8, "two full blocks, never the last token");
        let kv = h.export(key.clone(), tokens, None).unwrap();
        assert_eq!((kv.blocks.len(), kv.tokens), (2, 8));
        assert!(h.pool().usage().used_blocks >= 2, "pinned for the peer");
        p.fetch_done(&key, Ok(kv)).unwrap();
        let effects = p.take_effects();
        let early = delivered(&mut p);
        assert!(
            !early
                .iter()
                .any(|e| matches!(e, TokenEventKind::Admitted { .. })),
            "admitted once the pull lands: {early:?}"
        );
        let Some(WorkerEffect::Pull(pj)) =
            effects.iter().find(|e| matches!(e, WorkerEffect::Pull(_)))
        else {
            panic!("no pull: {effects:?}");
        };
        assert_eq!(pj.from.as_ref(), Some(&holder));
        assert!(matches!(pj.work, PullWork::Sim { .. }));
        clock.advance(Duration::from_millis(1));
        p.pull_done(PullResult {
            seq: pj.seq,
            outcome: Ok(pj.blocks),
            bytes: 4096,
        })
        .unwrap();
        assert_eq!(
            p.stats().kv_transfer_bytes,
            4096,
            "the pull's bytes published"
        );
        let effects = p.take_effects();
        assert!(effects.iter().any(|e| matches!(e,
            WorkerEffect::ConfirmPull { prefill, key: k } if *prefill == holder && *k == key)));
        let admitted = delivered(&mut p);
        assert!(
            admitted.iter().any(|e| matches!(
                e,
                TokenEventKind::Admitted {
                    cached_tokens: 8,
                    ..
                }
            )),
            "the pulled tokens count as cached: {admitted:?}"
        );
        let s = p.stats().peer_pulls;
        assert_eq!((s.asked, s.pulled, s.blocks, s.failed), (1, 1, 2, 0));
        if let Some(step) = answer(&effects) {
            clock.advance(Duration::from_millis(5));
            p.step_done(step, || None).unwrap();
            delivered(&mut p);
        }
        run_out(&mut p, &clock);
        assert!(!p.has(&key), "the pulled request ran to its last token");
        // The confirmation unpins the holder's blocks.
        h.cancel(&key).unwrap();
        assert_eq!(h.pool().usage().used_blocks, 0);
        assert!(h.is_idle());
        // A refused ask: the prompt is computed here, and the request still runs.
        let mut j = job(3, 2);
        j.prompt = (101..=110).collect();
        j.fetch = Some(FetchHint { holder, blocks: 2 });
        let key3 = (NodeId::new("gw"), RequestId(3));
        p.submit(j).unwrap();
        p.take_effects();
        let refused = h.export(key3.clone(), &(101..=108).collect::<Vec<u32>>(), None);
        assert!(refused.is_err(), "the holder holds none of it");
        p.fetch_done(&key3, refused).unwrap();
        assert_eq!(p.stats().peer_pulls.failed, 1);
        run_out(&mut p, &clock);
        assert!(!p.has(&key3), "it ran to its last token");
    }

    #[test]
    fn migrated_requests_that_arrive_together_share_the_first_step() {
        let clock = ManualClock::new();
        let pool = BlockPool::new(64, 4, 7).unwrap();
        let cfg = SchedulerConfig {
            resume_gather_ms: 5,
            ..SchedulerConfig::default()
        };
        let mut w = core(&clock, Role::Aggregated);
        w.core = SchedulerCore::new(cfg, pool).unwrap();
        w.take_effects();
        let migrated = |id| {
            let mut j = job(id, 2);
            j.sampling.offset = 3; // three tokens delivered before the loss
            j
        };
        // The first migrated request on an idle engine waits for the rest of its group.
        w.submit(migrated(1)).unwrap();
        let first = w.take_effects();
        assert!(answer(&first).is_none(), "no step yet: {first:?}");
        let until = first
            .iter()
            .find_map(|e| match e {
                WorkerEffect::KickAt(at) => Some(*at),
                _ => None,
            })
            .expect("a gather window");
        clock.advance(Duration::from_millis(1));
        w.submit(migrated(2)).unwrap();
        w.tick(|_| OwnerStatus::Present).unwrap();
        let more = w.take_effects();
        assert!(
            !more.iter().any(|e| matches!(e, WorkerEffect::KickAt(_))) && answer(&more).is_none(),
            "one window, and nothing starts within it: {more:?}"
        );
        clock.advance(until.saturating_duration_since(clock.now()));
        w.kick_due().unwrap();
        let Some(WorkerEffect::Step { batch, .. }) = w
            .take_effects()
            .into_iter()
            .find(|e| matches!(e, WorkerEffect::Step { .. }))
        else {
            panic!("the window's end starts the step");
        };
        assert_eq!(
            batch.seqs.len(),
            2,
            "both migrated requests in the first step"
        );
        // A new request (nothing delivered yet) never waits.
        let mut w = core(&clock, Role::Aggregated);
        w.core = SchedulerCore::new(cfg, BlockPool::new(64, 4, 7).unwrap()).unwrap();
        w.take_effects();
        w.submit(job(3, 2)).unwrap();
        assert!(
            answer(&w.take_effects()).is_some(),
            "a new request starts at once"
        );
    }

    #[test]
    fn a_request_runs_to_its_last_token_and_frees_its_blocks() {
        let clock = ManualClock::new();
        let mut w = core(&clock, Role::Aggregated);
        let joined = w.take_effects();
        assert!(
            joined
                .iter()
                .any(|e| matches!(e, WorkerEffect::Join(ROUTABLE_GROUP)))
        );
        w.submit(job(1, 3)).unwrap();
        let mut tokens = 0;
        while let Some(step) = answer(&w.take_effects()) {
            clock.advance(Duration::from_millis(5));
            w.step_done(step, || None).unwrap();
            tokens += delivered(&mut w)
                .iter()
                .filter(|e| matches!(e, TokenEventKind::Token { .. }))
                .count();
        }
        assert_eq!(tokens, 3);
        assert_eq!(w.num_live(), 0);
        assert!(!w.has(&(NodeId::new("gw"), RequestId(1))));
        let stats = w.stats();
        assert_eq!(stats.steps, 3);
        assert_eq!(stats.running + stats.waiting, 0);
    }

    #[test]
    fn an_engine_that_never_answers_is_found_hung_on_the_injected_clock() {
        let clock = ManualClock::new();
        let mut w = core(&clock, Role::Aggregated);
        w.submit(job(1, 5)).unwrap();
        assert!(answer(&w.take_effects()).is_some(), "a step was started");
        clock.advance(Duration::from_secs(1));
        w.tick(|_| OwnerStatus::Present).unwrap();
        clock.advance(Duration::from_millis(1_100));
        let hung = w.tick(|_| OwnerStatus::Present);
        assert!(matches!(hung, Err(WorkerCoreError::Hung(_))), "{hung:?}");
        let left: Vec<_> = w
            .take_effects()
            .into_iter()
            .filter_map(|e| match e {
                WorkerEffect::Leave(g) => Some(g),
                _ => None,
            })
            .collect();
        assert_eq!(left, vec![ROUTABLE_GROUP, SCHEDULER_GROUP]);
        assert_eq!(w.stats().health, Health::Unhealthy);
    }

    #[test]
    fn a_hand_off_is_held_until_its_hold_ends_on_the_injected_clock() {
        let clock = ManualClock::new();
        let mut w = core(&clock, Role::Prefill);
        let mut j = job(1, 8);
        j.hand_off = true;
        w.submit(j).unwrap();
        let step = answer(&w.take_effects()).unwrap();
        w.step_done(step, || None).unwrap();
        let events = delivered(&mut w);
        assert!(
            events
                .iter()
                .any(|e| matches!(e, TokenEventKind::HandOff(_)))
        );
        assert_eq!(w.stats().held, 1);
        let used = w.stats().kv_blocks_used;
        assert!(used > 0);
        clock.advance(DisaggWorker::default().hold - Duration::from_millis(1));
        w.tick(|_| OwnerStatus::Present).unwrap();
        assert_eq!(w.stats().held, 1, "still held before the hold ends");
        clock.advance(Duration::from_millis(1));
        w.tick(|_| OwnerStatus::Present).unwrap();
        assert_eq!(w.stats().held, 0);
        assert!(
            w.take_effects()
                .iter()
                .any(|e| matches!(e, WorkerEffect::Release(_)))
        );
    }

    #[test]
    fn a_missing_owner_loses_its_sequences_after_the_grace() {
        let clock = ManualClock::new();
        let mut w = core(&clock, Role::Aggregated);
        w.submit(job(1, 50)).unwrap();
        let mut pending = answer(&w.take_effects());
        w.tick(|_| OwnerStatus::Missing).unwrap(); // first seen missing now
        for _ in 0..3 {
            assert_eq!(w.num_live(), 1, "kept within the grace");
            clock.advance(Duration::from_secs(1));
            if let Some(step) = pending.take() {
                w.step_done(step, || None).unwrap();
            }
            w.tick(|_| OwnerStatus::Missing).unwrap();
            pending = answer(&w.take_effects());
        }
        assert_eq!(w.num_live(), 0, "aborted after owner_grace");
    }
}
