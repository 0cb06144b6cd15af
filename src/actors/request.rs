//! Request: one actor per in-flight request, a temporary child of the gateway's
//! `request_sup`. It owns the request from placement to the last token: asks a Router for a
//! worker, submits to that worker's Scheduler, receives the tokens through this node's
//! TokenSink and hands them to the HTTP handler, and on the way out releases the placement.
//!
//! # Attempts and migration
//! Each placement is an **attempt** with its own request id (taken from the gateway's id
//! counter), registered in the node's sink registry; events of an older attempt can no longer
//! reach the handler, so a token is never delivered twice. The actor keeps every token it has
//! delivered. When the worker is lost — its scheduler leaves the schedulers' group (node down,
//! replica killed or restarted by its watchdog; a process-group monitor reports it at once,
//! and a poll every [`WORKER_CHECK_INTERVAL_MS`] backs it up) or
//! the worker says it will not continue ([`TokenEventKind::Lost`]: drain deadline, replica
//! stopping) — the request **migrates**: a new attempt is placed with the prompt plus every
//! token delivered so far as its prompt, `max_tokens` reduced by as many, and the sampler
//! resuming at the same draw index (`SamplingParams::offset`), so the client sees one stream,
//! one id, and the same tokens a run without the fault produces. When to migrate again, wait
//! for a worker or give up is [`Migration`]'s pure rule: a request that keeps
//! making progress is never given up; `gateway.migration_limit` counts only migrations without
//! progress; a migration that finds no worker waits with jittered backoff up to
//! `gateway.migration_deadline_ms`; a worker that failed the request is avoided. A request
//! given up gets a 503 (before the first byte) or an error record (mid-stream). A
//! worker-side failure that is not a loss (`Failed`: bad request, engine fault) is passed on,
//! not migrated. A pick whose worker left before it got the request (the router's view a
//! moment behind a kill) is routed again at once, avoiding that worker, up to
//! [`GONE_PICKS_MAX`] times: neither a migration nor a failed placement.
//!
//! Metrics: `flotilla_migrations_total`, `flotilla_migration_failures_total`,
//! `flotilla_route_retries_total` (picks routed again because their worker was gone), and
//! `flotilla_migration_resume_gap_seconds` (last token before the loss → first token after it,
//! as the client sees it).
//!
//! # Cancellation
//! When the client goes away the handler's stream is dropped, which casts
//! [`RequestMsg::Cancel`] (and the event channel closes, which is detected on the next
//! event). The actor then cancels at the scheduler, which frees the sequence's KV blocks at
//! once — the step already running completes, its token for this sequence is discarded. So
//! the worker's KV usage is back where it was within one engine step of the disconnect.

use crate::actors::router::{RouterMsg, find_router};
use crate::actors::scheduler::SchedulerMsg;
use crate::kv::block_hashes;
use crate::request_plane::error::RequestError;
use crate::request_plane::events::{EventBus, FleetEventKind};
use crate::request_plane::migration::{
    Decision, GONE_PICKS_MAX, GiveUp, Migration, MigrationPolicy,
};
use crate::request_plane::protocol::{
    Placement, RemoteKv, RouteRequest, SubmitRequest, TokenEventKind,
};
use crate::request_plane::router::policy::Policy;
use crate::request_plane::token_sink::SinkRegistry;
use crate::runtime::clock::{Instant, SharedClock};
use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::resilience::NodeStats;
use crate::runtime::wire::Wire;
use crate::worker::scheduler::SCHEDULER_GROUP;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How long placement may take before the request fails with 503 (ms).
pub const ROUTE_TIMEOUT_MS: u64 = 5_000;
/// How often a Request re-checks that its scheduler still exists (ms), besides being told at
/// once when it leaves the schedulers' group (a process-group monitor).
pub const WORKER_CHECK_INTERVAL_MS: u64 = 1_000;
/// Silence after which a Request asks its scheduler whether it still has the request (ms).
/// Events lost on the way (a token sink killed with messages in its mailbox) are found this
/// way, or sooner by a gap in the token indices.
pub const STALL_CHECK_MS: u64 = 5_000;

/// What to generate: exactly what is submitted to the chosen worker's scheduler
/// (`reply_to` is this gateway node). `request` is the id of the first attempt.
pub type Job = SubmitRequest;

/// Spawn inputs.
#[derive(Clone)]
pub struct RequestArgs {
    /// The job.
    pub job: Job,
    /// This node's sink registry.
    pub registry: SinkRegistry,
    /// Where events go (the HTTP handler).
    pub events: mpsc::UnboundedSender<TokenEventKind>,
    /// The gateway's request id counter (each migration attempt takes a fresh id).
    pub ids: Arc<AtomicU64>,
    /// When to migrate, wait or give up.
    pub migration: MigrationPolicy,
    /// Time, for the migration rule and the resume gap.
    pub clock: SharedClock,
    /// Tokens per KV block and the model's hash salt: the request's sequence hashes are
    /// computed here so that the router can match them against its prefix index.
    pub block_size: usize,
    /// See `block_size`.
    pub salt: u64,
    /// Routing policy for this request (`None`: the router's).
    pub policy: Option<Policy>,
    /// Every attempt goes to this worker, without asking a router (a worker's own HTTP face,
    /// `gateway/face.rs`): a loss waits for the replica to come back, within the migration
    /// deadline, instead of moving elsewhere.
    pub pin: Option<WorkerId>,
    /// This node's counters: requests in flight, migrations.
    pub stats: Arc<NodeStats>,
    /// This node's fleet event bus: placements, hand-offs, migrations, give-ups.
    pub bus: EventBus,
}

/// Request messages (local).
#[derive(Debug)]
pub enum RequestMsg {
    /// An event from the worker, for the attempt with this id.
    Event(RequestId, TokenEventKind),
    /// The client is gone or the handler is done: cancel downstream and stop.
    Cancel,
    /// Internal: the scheduler serving this attempt left the schedulers' group.
    WorkerLost(RequestId),
    /// Internal: try placing again (a migration found no worker and waited).
    Retry,
    /// Internal, every [`WORKER_CHECK_INTERVAL_MS`] of an attempt: whether its scheduler is
    /// still in the group (the monitor's backup) and, after [`STALL_CHECK_MS`] without an
    /// event (and each further `STALL_CHECK_MS` of silence), whether it still has the attempt.
    CheckWorker(RequestId),
}

impl ractor::Message for RequestMsg {}

/// The Request actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct Request;

/// One placement of the request.
struct Attempt {
    id: RequestId,
    worker: WorkerId,
    scheduler: ractor::ActorId,
    tasks: Vec<JoinHandle<()>>,
    first_token_seen: bool,
    /// The worker admitted it (its prefill began): a loss from here on counts against it.
    admitted: bool,
    /// Tokens received from this attempt (the next expected index).
    received: u32,
    /// When the last event of this attempt arrived (wall ms, on the request's clock).
    last_event_ms: u64,
    /// When its last stall check was asked (wall ms; 0: never).
    last_check_ms: u64,
    /// A prefill-only attempt (disaggregated): it ends with a hand-off.
    hand_off: bool,
}

/// Request state.
pub struct RequestState {
    args: RequestArgs,
    attempt: Option<Attempt>,
    /// Tokens delivered to the handler, in order.
    generated: Vec<u32>,
    migration: Migration,
    admitted_sent: bool,
    done: bool,
    last_token_at: Option<Instant>,
    /// Attempts placed so far (the first one uses the job's request id).
    attempts: u32,
    /// KV handed off by a prefill worker, for the next (decode) attempt to pull.
    pending_kv: Option<RemoteKv>,
    /// The prefill worker holding this request's KV, and its request id there: released
    /// (a `Cancel`) when the request ends or its decode attempt is given up.
    held: Option<(WorkerId, RequestId)>,
}

fn scheduler_of(worker: &WorkerId) -> Option<ActorRef<SchedulerMsg>> {
    crate::runtime::cluster::member_named(SCHEDULER_GROUP, &format!("{worker}/scheduler"))
        .map(Into::into)
}

impl RequestState {
    fn node(&self) -> NodeId {
        self.args.job.reply_to.clone()
    }

    fn fail(&mut self, error: RequestError) {
        self.args.bus.emit(FleetEventKind::GaveUp {
            request: self.args.job.request,
            reason: error.to_string(),
        });
        let _ = self.args.events.send(error.to_event());
        self.done = true;
        self.release_held();
    }

    /// Tells the prefill worker holding this request's KV to release it (idempotent there:
    /// the decode worker confirms the same way once its pull is over).
    fn release_held(&mut self) {
        self.pending_kv = None;
        if let Some((worker, id)) = self.held.take()
            && let Some(s) = scheduler_of(&worker)
        {
            let _ = s.cast(SchedulerMsg::Cancel(Wire::encode(&(self.node(), id))));
        }
    }

    /// The router this request tells about its placements (none when pinned).
    fn router(&self) -> Option<ActorRef<RouterMsg>> {
        if self.args.pin.is_some() {
            None
        } else {
            find_router()
        }
    }

    /// End the current attempt: cancel it at its scheduler (if `cancel`), release the
    /// placement, stop listening for its events. Idempotent.
    fn end_attempt(&mut self, cancel: bool) {
        let Some(a) = self.attempt.take() else {
            return;
        };
        let key = (self.node(), a.id);
        if cancel && let Some(s) = scheduler_of(&a.worker) {
            let _ = s.cast(SchedulerMsg::Cancel(Wire::encode(&key)));
        }
        if cancel {
            self.release_held();
        }
        if let Some(r) = self.router() {
            let _ = r.cast(RouterMsg::Release(Wire::encode(&key)));
        }
        self.args.registry.unregister(a.id);
        for t in a.tasks {
            t.abort();
        }
    }

    /// The job of the next attempt: the prompt plus what was delivered, the rest of the budget.
    fn next_job(&self, id: RequestId) -> Job {
        let mut job = self.args.job.clone();
        job.request = id;
        job.prompt.extend_from_slice(&self.generated);
        job.max_tokens = job.max_tokens.saturating_sub(self.generated.len() as u32);
        job.sampling.offset = self.generated.len() as u64;
        job
    }

    /// Place a new attempt and start listening for its events and its worker's presence.
    async fn place(&mut self, myself: &ActorRef<RequestMsg>) -> Result<(), RequestError> {
        let id = if self.attempts == 0 {
            self.args.job.request
        } else {
            RequestId(self.args.ids.fetch_add(1, Ordering::Relaxed))
        };
        self.attempts += 1;
        let mut job = self.next_job(id);
        let router = match &self.args.pin {
            Some(_) => None,
            None => Some(find_router().ok_or(RequestError::NoRouter)?),
        };
        let req = RouteRequest {
            node: job.reply_to.clone(),
            request: id,
            prompt_tokens: job.prompt.len() as u32,
            seq_hashes: block_hashes(&job.prompt, self.args.block_size, self.args.salt)
                .into_iter()
                .map(|(_, s)| s)
                .collect(),
            policy: self.args.policy,
            avoid: self.migration.avoid().to_vec(),
            remote_prefill: self.pending_kv.is_none(),
        };
        let pick = match (&router, &self.args.pin) {
            (Some(router), _) => ractor::call_t!(
                router,
                RouterMsg::Route,
                ROUTE_TIMEOUT_MS,
                Wire::encode(&req)
            )
            .map_err(|_| RequestError::RouterTimeout)?
            .decode()
            .map_err(|_| RequestError::RouterReply)?,
            (None, pin) => pin.clone().map(|worker| Placement {
                worker,
                hand_off: false,
            }),
        };
        let pick = pick.ok_or(RequestError::NoWorkers)?;
        let worker = pick.worker;
        // The KV a prefill worker handed off stays this request's until a decode attempt is
        // submitted with it: a pick that finds its worker gone routes again with it.
        if pick.hand_off {
            job.hand_off = true;
        } else {
            job.remote_kv = self.pending_kv.clone();
        }
        let release = || {
            if let Some(router) = &router {
                let _ = router.cast(RouterMsg::Release(Wire::encode(&(
                    job.reply_to.clone(),
                    id,
                ))));
            }
        };
        let Some(scheduler) = scheduler_of(&worker) else {
            release();
            return Err(RequestError::WorkerGone(worker));
        };
        // Listen before submitting so that no event can be missed.
        let mut rx = self.args.registry.register(id);
        let me = myself.clone();
        let forwarder = tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                if me.cast(RequestMsg::Event(id, ev)).is_err() {
                    break;
                }
            }
        });
        // The attempt's check, on the actor's own timer: is its scheduler still in the group
        // (the process-group monitor says so at once; this backs it up), and has it been
        // quiet for too long?
        let ticker = myself
            .send_interval(Duration::from_millis(WORKER_CHECK_INTERVAL_MS), move || {
                RequestMsg::CheckWorker(id)
            });
        if scheduler
            .cast(SchedulerMsg::Submit(Wire::encode(&job)))
            .is_err()
        {
            self.args.registry.unregister(id);
            forwarder.abort();
            ticker.abort();
            release();
            return Err(RequestError::WorkerGone(worker));
        }
        self.attempt = Some(Attempt {
            id,
            worker,
            scheduler: scheduler.get_id(),
            tasks: vec![forwarder, ticker],
            first_token_seen: false,
            admitted: false,
            received: 0,
            last_event_ms: self.args.clock.wall_ms(),
            last_check_ms: 0,
            hand_off: job.hand_off,
        });
        if job.remote_kv.is_some() {
            self.pending_kv = None;
        }
        if let Some(a) = &self.attempt {
            self.args.bus.emit(FleetEventKind::Placed {
                request: self.args.job.request,
                worker: a.worker.clone(),
                attempt: self.attempts,
                hand_off: a.hand_off,
            });
        }
        Ok(())
    }

    /// Place (first attempt or a migration); on failure, wait and retry or fail the request,
    /// as the migration rule says.
    async fn place_or_retry(&mut self, myself: &ActorRef<RequestMsg>) -> bool {
        let mut gone_picks = 0;
        let error = loop {
            match self.place(myself).await {
                Ok(()) => return true,
                // The router chose a worker that left a moment ago: route again at once,
                // avoiding it (a pinned request has no other worker to go to).
                Err(RequestError::WorkerGone(worker))
                    if self.args.pin.is_none() && gone_picks < GONE_PICKS_MAX =>
                {
                    gone_picks += 1;
                    metrics::counter!("flotilla_route_retries_total").increment(1);
                    tracing::debug!(request = %self.args.job.request, %worker, "the chosen worker went away; routing again");
                    self.migration.avoid_worker(worker);
                }
                Err(error) => break error,
            }
        };
        let now = self.args.clock.now();
        match self.migration.on_place_failed(now, error.is_retryable()) {
            Decision::Wait { until } => {
                myself.send_after(until.saturating_duration_since(now), || RequestMsg::Retry);
                true
            }
            Decision::Place => true, // not produced by a failed placement
            Decision::Fail(GiveUp::FirstPlacement) => {
                self.fail(error);
                false
            }
            Decision::Fail(why) => {
                metrics::counter!("flotilla_migration_failures_total").increment(1);
                tracing::warn!(request = %self.args.job.request, trace_id = ?self.args.job.trace_id, %error, %why, "migration failed");
                self.fail(RequestError::GaveUp {
                    cause: error.to_string(),
                    why,
                });
                false
            }
        }
    }

    /// The worker is gone: re-place the request with what it has generated, unless the
    /// migration rule gives it up.
    async fn migrate(&mut self, myself: &ActorRef<RequestMsg>, why: &str) -> bool {
        let from = self.attempt.as_ref().map(|a| a.worker.clone());
        let ran = self.attempt.as_ref().is_some_and(|a| a.admitted);
        self.end_attempt(true);
        let now = self.args.clock.now();
        match self
            .migration
            .on_loss(now, self.generated.len(), ran, from.clone())
        {
            Decision::Fail(give_up) => {
                metrics::counter!("flotilla_migration_failures_total").increment(1);
                tracing::warn!(request = %self.args.job.request, trace_id = ?self.args.job.trace_id, ?from, %why, %give_up, "request given up");
                self.fail(RequestError::GaveUp {
                    cause: why.to_owned(),
                    why: give_up,
                });
                false
            }
            Decision::Place | Decision::Wait { .. } => {
                self.args.bus.emit(FleetEventKind::Migrated {
                    request: self.args.job.request,
                    from: from.clone(),
                    generated: self.generated.len(),
                    reason: why.to_owned(),
                });
                self.args.stats.count_migration();
                metrics::counter!("flotilla_migrations_total").increment(1);
                tracing::warn!(request = %self.args.job.request, trace_id = ?self.args.job.trace_id, ?from, generated = self.generated.len(),
                    stalled = self.migration.stalled(), %why, "migrating");
                self.place_or_retry(myself).await
            }
        }
    }

    /// The attempt's periodic check (see [`RequestMsg::CheckWorker`]).
    async fn check_worker(&mut self, myself: &ActorRef<RequestMsg>) -> bool {
        let Some(a) = self.attempt.as_mut() else {
            return true;
        };
        let alive = ractor::pg::get_members(&SCHEDULER_GROUP.to_owned())
            .iter()
            .any(|c| c.get_id() == a.scheduler);
        if !alive {
            return self
                .migrate(myself, "the worker serving this request was lost")
                .await;
        }
        let now = self.args.clock.wall_ms();
        if now.saturating_sub(a.last_event_ms.max(a.last_check_ms)) < STALL_CHECK_MS {
            return true;
        }
        a.last_check_ms = now;
        self.check_stall(myself).await
    }

    /// The attempt has been quiet: if its scheduler no longer has it (its last events were
    /// lost), resume elsewhere. A scheduler that does not answer is left to the step watchdog.
    async fn check_stall(&mut self, myself: &ActorRef<RequestMsg>) -> bool {
        let Some(a) = &self.attempt else {
            return true;
        };
        let Some(s) = scheduler_of(&a.worker) else {
            return true; // the membership watch reports the loss
        };
        let key = (self.node(), a.id);
        match ractor::call_t!(s, SchedulerMsg::Has, 2_000, Wire::encode(&key)) {
            Ok(w) if w.decode().ok() == Some(false) => {
                self.migrate(
                    myself,
                    "the worker no longer has this request (events lost)",
                )
                .await
            }
            _ => true,
        }
    }

    /// Pass one event of the current attempt on; returns false when the request is over.
    async fn on_event(&mut self, myself: &ActorRef<RequestMsg>, ev: TokenEventKind) -> bool {
        if let Some(a) = self.attempt.as_mut() {
            a.last_event_ms = self.args.clock.wall_ms();
            if let TokenEventKind::Token { index, .. } = ev {
                if index != a.received {
                    // Events were lost between the worker and here: resume from what was
                    // delivered, elsewhere or on the same worker.
                    let why = format!("token events lost (expected {}, got {index})", a.received);
                    return self.migrate(myself, &why).await;
                }
                a.received += 1;
            }
            if matches!(ev, TokenEventKind::Admitted { .. }) {
                a.admitted = true;
            }
        }
        match ev {
            TokenEventKind::Lost { reason } => return self.migrate(myself, &reason).await,
            TokenEventKind::HandOff(kv) => {
                if !self.attempt.as_ref().is_some_and(|a| a.hand_off) {
                    return true; // not asked for: ignored
                }
                // The prefill worker computed the prompt and sent the first token (passed on
                // already); place the decode attempt, which pulls the KV it holds.
                tracing::debug!(request = %self.args.job.request, prefill = %kv.worker, tokens = kv.tokens, "prefill handed off");
                self.args.bus.emit(FleetEventKind::HandedOff {
                    request: self.args.job.request,
                    from: kv.worker.clone(),
                    tokens: kv.tokens,
                });
                // A second hand-off (the decode placement was handed off again) replaces the
                // first: its prefill worker is told to release what it holds for us.
                self.release_held();
                self.held = Some((kv.worker.clone(), kv.request));
                self.pending_kv = Some(*kv);
                self.end_attempt(false);
                // Tokens have reached the client: a placement that finds no worker waits
                // for one (as a migration does) instead of failing the request.
                self.migration.on_hand_off(self.args.clock.now());
                return self.place_or_retry(myself).await;
            }
            TokenEventKind::Admitted { .. } if self.admitted_sent => return true,
            TokenEventKind::Admitted { .. } => self.admitted_sent = true,
            TokenEventKind::Token { id, .. } => {
                if let Some(a) = &self.attempt
                    && !a.first_token_seen
                    && let Some(r) = self.router()
                {
                    let _ = r.cast(RouterMsg::FirstToken(Wire::encode(&(self.node(), a.id))));
                }
                if let Some(a) = self.attempt.as_mut() {
                    a.first_token_seen = true;
                }
                self.generated.push(id);
                let now = self.args.clock.now();
                if self.migration.on_resumed()
                    && let Some(last) = self.last_token_at
                {
                    metrics::histogram!("flotilla_migration_resume_gap_seconds")
                        .record((now - last).as_secs_f64());
                }
                self.last_token_at = Some(now);
            }
            TokenEventKind::Failed { .. } => {}
        }
        let last = matches!(
            ev,
            TokenEventKind::Failed { .. }
                | TokenEventKind::Token {
                    finish: Some(_),
                    ..
                }
        );
        if self.args.events.send(ev).is_err() {
            // The handler is gone: the client disconnected.
            self.end_attempt(true);
            self.done = true;
            return false;
        }
        if last {
            self.end_attempt(false);
            self.release_held();
            self.done = true;
            return false;
        }
        true
    }
}

impl Actor for Request {
    type Msg = RequestMsg;
    type State = RequestState;
    type Arguments = RequestArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: RequestArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        args.stats.request_started();
        // Told at once when a scheduler leaves (removed when this actor stops).
        ractor::pg::monitor(SCHEDULER_GROUP.to_owned(), myself.get_cell());
        let migration = Migration::new(args.migration, args.job.request.0);
        Ok(RequestState {
            args,
            attempt: None,
            generated: Vec::new(),
            migration,
            admitted_sent: false,
            done: false,
            last_token_at: None,
            attempts: 0,
            pending_kv: None,
            held: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if !state.place_or_retry(&myself).await {
            myself.stop(None);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.args.stats.request_ended();
        let running = !state.done;
        state.end_attempt(running);
        if running {
            // Stopped from outside (node shutdown) while running: tell the handler.
            let _ = state
                .args
                .events
                .send(RequestError::ShuttingDown.to_event());
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: ractor::SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let ractor::SupervisionEvent::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Leave(
            _,
            group,
            gone,
        )) = event
            && group == SCHEDULER_GROUP
            && let Some(a) = &state.attempt
            && gone.iter().any(|c| c.get_id() == a.scheduler)
        {
            let _ = myself.cast(RequestMsg::WorkerLost(a.id));
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let current = state.attempt.as_ref().map(|a| a.id);
        let go_on = match msg {
            RequestMsg::Event(id, ev) if Some(id) == current => state.on_event(&myself, ev).await,
            RequestMsg::Event(..) => true, // an older attempt: ignored
            RequestMsg::Cancel => {
                state.end_attempt(true);
                state.done = true;
                false
            }
            RequestMsg::WorkerLost(id) if Some(id) == current => {
                state
                    .migrate(&myself, "the worker serving this request was lost")
                    .await
            }
            RequestMsg::WorkerLost(_) => true,
            RequestMsg::CheckWorker(id) if Some(id) == current => state.check_worker(&myself).await,
            RequestMsg::CheckWorker(_) => true,
            RequestMsg::Retry if current.is_none() && !state.done => {
                state.place_or_retry(&myself).await
            }
            RequestMsg::Retry => true,
        };
        if !go_on {
            myself.stop(None);
        }
        Ok(())
    }
}
