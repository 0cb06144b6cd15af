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
//! What it holds: the batch former and its block pool ([`SchedulerCore`]); one record per
//! sequence with its state — waiting, pulling, prefilling, decoding, handed off
//! (`sequence.rs`; a finished sequence leaves); two sub-cores with their own tests, the pulls
//! of remote KV (`pull.rs`) and peer pulls on both sides (`peer.rs`); the step watchdog, the
//! step-time model, the chaos `fill_kv` blocks, the role and health, and the admission window
//! behind `prefill_wait_ms`.
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

mod io;
mod peer;
mod pull;
mod sequence;
mod step;

pub use io::{
    EngineHung, InjectedFaults, RequestKey, WorkerCoreConfig, WorkerCoreError, WorkerEffect,
};
pub use pull::{PullJob, PullWork};

use super::{
    FillChange, Health, KvFill, Outbox, PullOrder, PullResult, ROUTABLE_GROUP, SCHEDULER_GROUP,
    SchedulerCore, SchedulerStats, SeqRequest, StepResult, StepTimeModel, StepWatchdog,
    WatchdogVerdict,
};
use crate::kv::KvEvent;
use crate::request_plane::protocol::{
    Owner, OwnerStatus, RemoteKv, SubmitRequest, TokenEvent, TokenEventKind,
};
use crate::runtime::clock::{Instant, SharedClock};
use crate::runtime::ids::{RequestId, SeqId, WorkerId};
use crate::runtime::role::{Role, role_group};
use crate::transport::RegionDescriptor;
use peer::{Fetching, PeerPulls, PeerSetting};
use pull::Pulls;
use sequence::{SeqState, Sequence, sequence_span};
use step::StepTiming;

/// Window of the measured admission rate.
pub const ADMIT_RATE_WINDOW: Duration = Duration::from_secs(5);

/// One replica's scheduling state (see the module doc).
pub struct WorkerCore {
    cfg: WorkerCoreConfig,
    core: SchedulerCore,
    clock: SharedClock,
    faults: InjectedFaults,
    effects: Vec<WorkerEffect>,
    /// Every sequence here — waiting, pulling, prefilling, decoding or handed off — in one
    /// record each.
    seqs: HashMap<SeqId, Sequence>,
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
    /// Pulls of remote KV in flight, and what they measured.
    pulls: Pulls,
    /// Peer pulls: asks waiting for their holders, prefixes pinned here for peers.
    peer: PeerPulls,
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
        let peer = PeerPulls::new(
            cfg.worker.clone(),
            PeerSetting {
                pull: cfg.peer_pull,
                can_pull: cfg.has_transport || cfg.sim_transfer.is_some(),
                block_size: cfg.block_size,
                hold: cfg.disagg.hold,
            },
        );
        Self {
            outbox: Outbox::new(clock.clone(), cfg.owner_grace),
            watchdog: StepWatchdog::new(clock.clone(), cfg.step_timeout, cfg.canary_interval),
            step_model: StepTimeModel::new(),
            step_timing: None,
            gather_until: None,
            fill: KvFill::default(),
            faults: InjectedFaults::default(),
            effects,
            seqs: HashMap::new(),
            by_request: HashMap::new(),
            next_seq: 0,
            steps: 0,
            health: Health::Ready,
            pulls: Pulls::default(),
            peer,
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

    /// Requests queued or running here (handed-off ones aside).
    pub fn num_live(&self) -> usize {
        self.seqs.values().filter(|s| s.active()).count()
    }

    /// Nothing runs, waits or is held here (a driver may stop ticking it).
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty() && self.peer.is_idle()
    }

    /// Whether the request `key` is here (queued, running or held).
    pub fn has(&self, key: &RequestKey) -> bool {
        self.by_request.contains_key(key) || self.peer.is_fetching(key)
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

    /// Emits `kind` to the sequence `seq` (if it is here).
    fn emit_to(&mut self, seq: SeqId, kind: TokenEventKind) {
        if let Some(s) = self.seqs.get(&seq) {
            let (to, request) = (s.owner.clone(), s.request);
            self.emit(&to, request, kind);
        }
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
        if self.health != Health::Ready {
            let reason = format!("the worker is {}", self.health);
            self.emit(&req.owner(), req.request, TokenEventKind::Lost { reason });
            return Ok(());
        }
        if let Some(hint) = req.fetch.take()
            && req.remote_kv.is_none()
            && req.sampling.echo_tokens == 0
            && let Some((tokens, timeout)) = self.peer.plan(
                &hint,
                &req.prompt,
                self.core.pool(),
                self.step_model.cost(),
                self.pulls.block_ms(),
            )
        {
            self.effects.push(WorkerEffect::Fetch {
                holder: hint.holder.clone(),
                key: key.clone(),
                tokens,
                timeout,
            });
            self.peer.ask(key, req, hint.holder);
            return Ok(());
        }
        // A migrated stream (it has delivered tokens, and is no disaggregated decode) comes
        // with the rest of its lost worker's requests: an idle engine waits a moment for them,
        // so that they share the first step.
        let resumed = req.sampling.offset > 0 && req.remote_kv.is_none();
        self.enqueue(req, None);
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
        self.next_seq += 1;
        let seq = SeqId(self.next_seq);
        let (now, wall_ms) = (self.clock.now(), self.clock.wall_ms());
        let pool = self.core.pool_mut();
        self.peer
            .export(pool, seq, key, tokens, region, now, wall_ms)
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
        let Some(Fetching { mut req, holder }) = self.peer.answered(key) else {
            // Cancelled (or dropped) meanwhile: unpin what the holder pinned.
            if let Ok(kv) = answer {
                self.confirm(kv.worker, key.clone());
            }
            return Ok(());
        };
        match answer {
            Ok(kv) if (kv.tokens as usize) < req.prompt.len() && kv.tokens > 0 => {
                req.remote_kv = Some(kv);
            }
            Ok(kv) => {
                self.confirm(kv.worker, key.clone());
                self.peer
                    .failed(&holder, "the holder pinned nothing usable");
            }
            Err(why) => self.peer.failed(&holder, &why),
        }
        let peer = req.remote_kv.is_some().then(|| (holder, key.clone()));
        if self.health != Health::Ready {
            if let Some((holder, key)) = peer {
                self.confirm(holder, key);
            }
            let reason = format!("the worker is {}", self.health);
            self.emit(&req.owner(), req.request, TokenEventKind::Lost { reason });
            return Ok(());
        }
        self.enqueue(req, peer);
        self.kick()?;
        self.forward_kv_events();
        Ok(())
    }

    /// Tell `holder` to release the blocks it holds under `key`.
    fn confirm(&mut self, holder: WorkerId, key: RequestKey) {
        self.effects.push(WorkerEffect::ConfirmPull {
            prefill: holder,
            key,
        });
    }

    /// Queue a submission with the batch former (a refusal answers `Failed`, 400). `peer`:
    /// the holder that pinned its prefix (its `remote_kv`) for a peer pull.
    fn enqueue(&mut self, req: SubmitRequest, peer: Option<(WorkerId, RequestKey)>) {
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
        if let Err(e) = added {
            if let Some((holder, key)) = peer {
                self.confirm(holder, key);
            }
            let message = e.to_string();
            self.emit(
                &owner,
                req.request,
                TokenEventKind::Failed {
                    message,
                    status: 400,
                },
            );
            return;
        }
        tracing::debug!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %req.request, request_id = %req.trace_id.as_deref().unwrap_or("-"), "sequence queued");
        self.by_request.insert(key, seq);
        // A peer pull needs the pinned KV; without it the holder is unpinned now.
        let peer = match (peer, &remote) {
            (Some(p), Some(_)) => Some(p),
            (Some((holder, key)), None) => {
                self.confirm(holder, key);
                None
            }
            (None, _) => None,
        };
        let span = sequence_span(&self.cfg.worker, &req.trace_id, req.traceparent.as_deref());
        self.seqs.insert(
            seq,
            Sequence {
                request: req.request,
                owner,
                sampling: req.sampling,
                emitted: 0,
                span,
                trace_id: req.trace_id,
                queued_at: self.clock.now(),
                prompt_tokens,
                state: SeqState::Waiting {
                    remote: remote.map(Box::new),
                    peer,
                },
            },
        );
    }

    /// Cancel the request `key` (unknown keys are ignored): its blocks are freed at once.
    ///
    /// # Errors
    /// A broken invariant of the batch former while starting steps.
    pub fn cancel(&mut self, key: &RequestKey) -> Result<(), WorkerCoreError> {
        if self.peer.unpin(self.core.pool_mut(), key) {
            // A peer's pull is over.
            self.forward_kv_events();
            return self.kick();
        }
        if self.peer.answered(key).is_some() {
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

    /// A pull returned: the sequence decodes (or recomputes what it lacks), and the holder
    /// (prefill worker or peer) is told to release its blocks.
    ///
    /// # Errors
    /// A broken invariant of the batch former.
    pub fn pull_done(&mut self, r: PullResult) -> Result<(), WorkerCoreError> {
        let ok = r.outcome.is_ok();
        let pull = self.pulls.returned(&self.cfg.worker, &r, self.clock.now());
        if let Some(s) = self.seqs.get_mut(&r.seq)
            && let SeqState::Pulling { admit } = s.state
        {
            s.state = SeqState::Prefilling;
            if let Some((local, pulled)) = admit {
                self.admitted(r.seq, if ok { pulled } else { local });
            }
        }
        if let Some(f) = &pull
            && f.peer
        {
            match &r.outcome {
                Ok(blocks) => self.peer.pulled(*blocks),
                Err(why) => self.peer.failed(&f.confirm.0, why),
            }
        }
        self.core.pull_done(r.seq, ok)?;
        if let Some(f) = pull {
            let (holder, key) = f.confirm;
            self.confirm(holder, key);
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
        tracing::info!(worker = %self.cfg.worker, from = %self.role, to = %role, live = self.num_live(), "role change: draining first");
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
            tracing::info!(worker = %self.cfg.worker, live = self.num_live(), "draining");
            self.leave_routing(Health::Draining);
        }
    }

    /// Hand off every request here: each is told `Lost` with `reason` and migrates.
    pub fn hand_off_all(&mut self, reason: String) {
        tracing::warn!(worker = %self.cfg.worker, live = self.num_live(), %reason, "handing every request off");
        self.drop_all(&TokenEventKind::Lost { reason });
        self.forward_kv_events();
    }

    /// The replica stops: every live request hears it and migrates with what it has.
    pub fn stop(&mut self) {
        let lost = TokenEventKind::Lost {
            reason: "the replica stopped".into(),
        };
        let live: Vec<(Owner, RequestId)> = self
            .seqs
            .values()
            .filter(|s| s.active())
            .map(|s| (s.owner.clone(), s.request))
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

    /// The sequences `which` selects.
    fn select(&self, which: impl Fn(&Sequence) -> bool) -> Vec<SeqId> {
        self.seqs
            .iter()
            .filter(|(_, s)| which(s))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Abort every sequence of `owner` (gone): free their KV blocks, forget their events.
    fn abort_owner(&mut self, owner: &Owner) {
        self.outbox.forget(owner);
        let orphans = self.select(|s| s.owner == *owner);
        let active = orphans.iter().filter(|s| self.seqs[s].active()).count();
        tracing::warn!(worker = %self.cfg.worker, %owner, sequences = active,
            "the owner of these sequences is gone; aborting them");
        metrics::counter!("flotilla_orphaned_sequences_aborted_total").increment(active as u64);
        for s in orphans {
            self.drop_seq(s);
        }
        self.peer.retain_fetching(|f| f.req.owner() != *owner);
        self.forward_kv_events();
    }

    /// Abort the sequences of every owner that is gone (sequences that emit nothing, e.g.
    /// waiting ones, are found too).
    fn check_owners(&mut self, mut status: impl FnMut(&Owner) -> OwnerStatus) {
        let mut owners: Vec<Owner> = self.seqs.values().map(|s| s.owner.clone()).collect();
        owners.sort();
        owners.dedup();
        for owner in owners {
            if self.outbox.is_gone(&owner, status(&owner)) {
                self.abort_owner(&owner);
            }
        }
        let seqs = &self.seqs;
        self.outbox
            .retain_missing(|o| seqs.values().any(|s| s.active() && s.owner == *o));
    }

    /// The sequence leaves: its blocks are freed (a handed-off one's hold ends), a peer that
    /// pinned its prefix for a pull not started yet is told to unpin, and the engine may free
    /// what it keeps for it.
    fn drop_seq(&mut self, seq: SeqId) {
        self.core.cancel(seq);
        if let Some(s) = self.seqs.remove(&seq) {
            self.by_request.remove(&s.key());
            match s.state {
                SeqState::HandedOff { .. } => {
                    tracing::debug!(worker = %self.cfg.worker, request = %s.request, "handed-off blocks released");
                }
                state => {
                    let _in = s.span.enter();
                    tracing::info!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %s.request, request_id = %s.trace_id.as_deref().unwrap_or("-"), tokens = s.emitted, "sequence dropped");
                    // Not pulling yet: unpin the holder's blocks now (a running pull
                    // confirms when it returns).
                    if let SeqState::Waiting {
                        peer: Some((holder, key)),
                        ..
                    } = state
                    {
                        self.confirm(holder, key);
                    }
                }
            }
        }
        self.effects.push(WorkerEffect::Release(seq));
    }

    /// Releases handed-off blocks, and peer-pull pins, whose hold ended without a
    /// confirmation.
    fn expire_held(&mut self) {
        let now = self.clock.now();
        let unpinned = self.peer.unpin_expired(self.core.pool_mut(), Some(now));
        if unpinned > 0 {
            tracing::info!(worker = %self.cfg.worker, exports = unpinned, "peer-pull pins expired unconfirmed; unpinned");
            self.forward_kv_events();
        }
        let expired =
            self.select(|s| matches!(s.state, SeqState::HandedOff { until } if until <= now));
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

    /// The sequence `seq` was admitted with `cached_tokens` of its prompt from the prefix
    /// cache (or pulled): counted in the admission window and the prefix-hit counters, and
    /// its owner told.
    fn admitted(&mut self, seq: SeqId, cached_tokens: usize) {
        let Some(s) = self.seqs.get(&seq) else {
            return;
        };
        let prompt_tokens = s.prompt_tokens;
        {
            let _in = s.span.enter();
            tracing::info!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %s.request, request_id = %s.trace_id.as_deref().unwrap_or("-"), prompt_tokens, cached_tokens, "sequence admitted");
        }
        self.note_admission();
        self.admitted_prompt_tokens += u64::from(prompt_tokens);
        self.admitted_cached_tokens += (cached_tokens as u64).min(u64::from(prompt_tokens));
        let worker = self.cfg.worker.clone();
        let cached_tokens = cached_tokens as u32;
        self.emit_to(
            seq,
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
        let Some(s) = self.seqs.get_mut(&seq) else {
            let _ = self.core.pull_done(seq, false);
            return;
        };
        let (kv, peer) = match std::mem::replace(&mut s.state, SeqState::Pulling { admit: None }) {
            SeqState::Waiting { remote, peer } => (remote.map(|kv| *kv), peer),
            other => {
                // Not waiting: it cannot be admitted again; keep its state.
                s.state = other;
                (None, None)
            }
        };
        let owner = s.owner.node.clone();
        // A peer's pinned KV is always there (`enqueue` unpins it otherwise); the pull
        // confirms to the holder when it returns.
        let peer = peer.is_some();
        if peer {
            // Admitted once the pull returns (`pull_done`).
            s.state = SeqState::Pulling {
                admit: Some((order.cached_tokens, order.tokens)),
            };
        } else {
            self.admitted(seq, order.cached_tokens);
        }
        let job = self.pulls.start(
            &self.cfg,
            &order,
            kv,
            &owner,
            peer,
            self.clock.now(),
            self.clock.wall_ms(),
        );
        self.effects.push(WorkerEffect::Pull(job));
    }

    /// Carries out a pending role change once nothing runs or is held here.
    fn maybe_switch_role(&mut self) {
        let Some(next) = self.next_role else {
            return;
        };
        if !self.seqs.is_empty() || self.core.num_pulling() > 0 {
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
        for f in self.peer.take_fetching() {
            // Their holders' answers come to nobody: the pins end with their holds.
            self.emit(&f.req.owner(), f.req.request, kind.clone());
        }
        self.peer.unpin_expired(self.core.pool_mut(), None);
        for s in self.select(|s| !s.active()) {
            self.drop_seq(s);
        }
        for s in self.select(|_| true) {
            self.emit_to(s, kind.clone());
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
            .seqs
            .values()
            .filter(|s| !s.admitted())
            .map(|s| now.saturating_duration_since(s.queued_at).as_secs_f64() * 1e3)
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
            held: self.seqs.values().filter(|s| !s.active()).count(),
            pulls_pending: self.core.num_pulling(),
            blocks_pulled: self.pulls.blocks_pulled,
            pull_fallbacks: self.pulls.fallbacks,
            prefill_wait_ms: self.prefill_wait_ms(),
            prefill_tokens_per_s: self.step_model.cost().and_then(|c| {
                let budget = self.core.config().max_num_batched_tokens;
                let ms = c.drain_ms(budget, budget);
                (ms > 0.0).then(|| budget as f64 / ms * 1e3)
            }),
            kv_tiers: self.core.pool().tier_usage(),
            peer_pulls: self.peer.counters,
            prompt_tokens: self.admitted_prompt_tokens,
            cached_tokens: self.admitted_cached_tokens,
            generated_tokens: self.generated_tokens,
            kv_transfer_bytes: self.pulls.bytes,
        }
    }
}

#[cfg(test)]
mod tests;
