//! Request: one actor per in-flight request, a temporary child of the gateway's
//! `request_sup`. It owns the request from placement to the last token: asks a Router for a
//! worker, submits to that worker's Scheduler, receives the tokens through this node's
//! TokenSink and hands them to the HTTP handler, and on the way out releases the placement.
//! What to do when is decided by the pure
//! [`RequestCore`](crate::request_plane::request::RequestCore); this actor carries out its
//! effects (router calls, submissions, cancels, timers, deliveries).
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
//! [`GONE_PICKS_MAX`] times: neither a migration nor a failed placement. When a worker joins
//! the routable group (a restart, a scale-up), an attempt still waiting in its worker's queue
//! asks the router whether the newcomer would start it sooner and moves if so — nor is that a
//! migration: nothing was computed for it yet.
//!
//! Metrics: `flotilla_migrations_total`, `flotilla_migration_failures_total`,
//! `flotilla_route_retries_total` (picks routed again because their worker was gone),
//! `flotilla_requests_moved_total` (queued attempts moved to a worker that joined), and
//! `flotilla_migration_resume_gap_seconds` (last token before the loss → first token after it,
//! as the client sees it).
//!
//! A quiet attempt is checked without blocking the actor: the "do you still have it" call to
//! the scheduler runs as a task that answers with a message.
//!
//! # Cancellation
//! When the client goes away the handler's stream is dropped, which casts
//! [`RequestMsg::Cancel`] (and the event channel closes, which is detected on the next
//! event). The actor then cancels at the scheduler, which frees the sequence's KV blocks at
//! once — the step already running completes, its token for this sequence is discarded. So
//! the worker's KV usage is back where it was within one engine step of the disconnect.

use crate::actors::router::{RouterMsg, find_router};
use crate::actors::scheduler::SchedulerMsg;
use crate::request_plane::error::RequestError;
use crate::request_plane::events::EventBus;
use crate::request_plane::migration::MigrationPolicy;
use crate::request_plane::protocol::{SubmitRequest, TokenEventKind};
use crate::request_plane::request::{RequestCore, RequestCoreConfig, RequestEffect};
use crate::request_plane::router::policy::Policy;
use crate::request_plane::token_sink::SinkRegistry;
use crate::runtime::clock::SharedClock;
use crate::runtime::ids::{RequestId, WorkerId};
use crate::runtime::resilience::NodeStats;
use crate::runtime::wire::Wire;
use crate::worker::scheduler::{ROUTABLE_GROUP, SCHEDULER_GROUP};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::Instrument;

pub use crate::request_plane::request::STALL_CHECK_MS;

/// How long placement may take before the request fails with 503 (ms).
pub const ROUTE_TIMEOUT_MS: u64 = 5_000;
/// How often a Request re-checks that its scheduler still exists (ms), besides being told at
/// once when it leaves the schedulers' group (a process-group monitor).
pub const WORKER_CHECK_INTERVAL_MS: u64 = 1_000;

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
    /// Where events go (the HTTP handler's one channel for all of a request's choices),
    /// each tagged with `choice`.
    pub events: mpsc::UnboundedSender<(u32, TokenEventKind)>,
    /// This choice's index in its request (prompt-major).
    pub choice: u32,
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
    /// The HTTP request's `request` span (the gateway's `x-request-id`): the Request's lines
    /// (migrations, give-ups) are written inside it, so they carry the id and, with an OTLP
    /// export, are events of the request's span.
    pub span: tracing::Span,
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
    /// Internal: a worker joined the routable group; a still-queued attempt may move there
    /// ([`RequestCore::worker_joined`]).
    WorkerJoined,
    /// Internal, every [`WORKER_CHECK_INTERVAL_MS`] of an attempt: whether its scheduler is
    /// still in the group (the monitor's backup) and, after [`STALL_CHECK_MS`] without an
    /// event (and each further `STALL_CHECK_MS` of silence), whether it still has the attempt.
    CheckWorker(RequestId),
    /// Internal: the scheduler's answer to whether it still has this attempt.
    HasAnswer(RequestId, bool),
}

impl ractor::Message for RequestMsg {}

/// The Request actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct Request;

/// The current attempt's listening side: its scheduler (for the group monitor) and its check
/// timer.
struct Listening {
    id: RequestId,
    scheduler: ractor::ActorId,
    tasks: Vec<JoinHandle<()>>,
}

/// Request state: the core, and what carrying out its effects needs.
pub struct RequestState {
    args: RequestArgs,
    core: RequestCore,
    listening: Option<Listening>,
    /// The core asked to stop.
    stop: bool,
    /// The actor is in `post_stop`.
    stopping: bool,
}

fn scheduler_of(worker: &WorkerId) -> Option<ActorRef<SchedulerMsg>> {
    crate::runtime::cluster::member_named(SCHEDULER_GROUP, &format!("{worker}/scheduler"))
        .map(Into::into)
}

impl RequestState {
    /// Carry out what the core asked for, feeding back the answers (a route, a submission,
    /// a handler gone) until it asks for nothing more.
    async fn apply(&mut self, myself: &ActorRef<RequestMsg>) {
        loop {
            let effects = self.core.take_effects();
            if effects.is_empty() {
                break;
            }
            for effect in effects {
                self.carry_out(myself, effect).await;
            }
        }
        if self.stop && !self.stopping {
            myself.stop(None);
        }
    }

    async fn carry_out(&mut self, myself: &ActorRef<RequestMsg>, effect: RequestEffect) {
        match effect {
            RequestEffect::Route(req) => {
                let pick = match find_router() {
                    None => Err(RequestError::NoRouter),
                    Some(router) => ractor::call_t!(
                        router,
                        RouterMsg::Route,
                        ROUTE_TIMEOUT_MS,
                        Wire::encode(&req)
                    )
                    .map_err(|_| RequestError::RouterTimeout)
                    .and_then(|w| w.decode().map_err(|_| RequestError::RouterReply)),
                };
                self.core.picked(pick);
            }
            RequestEffect::Submit { worker, job } => {
                let reached = self.submit(myself, &worker, &job);
                self.core.submitted(reached);
            }
            RequestEffect::Unlisten(id) => {
                self.args.registry.unregister(id);
                if let Some(l) = self.listening.take_if(|l| l.id == id) {
                    for t in l.tasks {
                        t.abort();
                    }
                }
            }
            RequestEffect::Cancel { worker, key } => {
                if let Some(s) = scheduler_of(&worker) {
                    let _ = s.cast(SchedulerMsg::Cancel(Wire::encode(&key)));
                }
            }
            RequestEffect::ReleasePlacement(key) => {
                if let Some(r) = find_router() {
                    let _ = r.cast(RouterMsg::Release(Wire::encode(&key)));
                }
            }
            RequestEffect::FirstToken(key) => {
                if let Some(r) = find_router() {
                    let _ = r.cast(RouterMsg::FirstToken(Wire::encode(&key)));
                }
            }
            RequestEffect::AskHas { worker, key } => {
                // A scheduler that is gone is reported by the membership watch.
                if let Some(s) = scheduler_of(&worker) {
                    let me = myself.clone();
                    let id = key.1;
                    tokio::spawn(async move {
                        if let Ok(w) =
                            ractor::call_t!(s, SchedulerMsg::Has, 2_000, Wire::encode(&key))
                            && let Ok(has) = w.decode()
                        {
                            let _ = me.cast(RequestMsg::HasAnswer(id, has));
                        }
                    });
                }
            }
            RequestEffect::Deliver(ev) => {
                if self.args.events.send((self.args.choice, ev)).is_err() {
                    self.core.handler_gone();
                }
            }
            RequestEffect::RetryAt(until) => {
                let wait = until.saturating_duration_since(self.args.clock.now());
                myself.send_after(wait, || RequestMsg::Retry);
            }
            RequestEffect::Fleet(event) => {
                if matches!(
                    event,
                    crate::request_plane::events::FleetEventKind::Migrated { .. }
                ) {
                    self.args.stats.count_migration();
                }
                self.args.bus.emit(event);
            }
            RequestEffect::Stop => self.stop = true,
        }
    }

    /// Listen for the attempt's events and its worker's presence, then submit. Whether the
    /// submission reached the worker's scheduler.
    fn submit(&mut self, myself: &ActorRef<RequestMsg>, worker: &WorkerId, job: &Job) -> bool {
        let id = job.request;
        let Some(scheduler) = scheduler_of(worker) else {
            return false;
        };
        // Listen before submitting so that no event can be missed: the node's token sink
        // casts each event of this attempt straight into this actor's mailbox.
        let me = myself.clone();
        self.args.registry.register_with(
            id,
            Box::new(move |ev| me.cast(RequestMsg::Event(id, ev)).is_ok()),
        );
        // The attempt's check, on the actor's own timer: is its scheduler still in the group
        // (the process-group monitor says so at once; this backs it up), and has it been
        // quiet for too long?
        let ticker = myself
            .send_interval(Duration::from_millis(WORKER_CHECK_INTERVAL_MS), move || {
                RequestMsg::CheckWorker(id)
            });
        if scheduler
            .cast(SchedulerMsg::Submit(Wire::encode(job)))
            .is_err()
        {
            self.args.registry.unregister(id);
            ticker.abort();
            return false;
        }
        self.listening = Some(Listening {
            id,
            scheduler: scheduler.get_id(),
            tasks: vec![ticker],
        });
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
        // Told at once when a scheduler leaves, and when a worker becomes routable (both
        // monitors removed when this actor stops).
        ractor::pg::monitor(SCHEDULER_GROUP.to_owned(), myself.get_cell());
        ractor::pg::monitor(ROUTABLE_GROUP.to_owned(), myself.get_cell());
        let core = RequestCore::new(
            RequestCoreConfig {
                job: args.job.clone(),
                block_size: args.block_size,
                salt: args.salt,
                policy: args.policy,
                pin: args.pin.clone(),
                migration: args.migration,
            },
            args.ids.clone(),
            args.clock.clone(),
        );
        Ok(RequestState {
            args,
            core,
            listening: None,
            stop: false,
            stopping: false,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.core.start();
        state.apply(&myself).await;
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.args.stats.request_ended();
        state.core.stopped();
        state.stopping = true; // already stopping: nothing to stop
        state.apply(&myself).await;
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: ractor::SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        use ractor::pg::GroupChangeMessage;
        match event {
            ractor::SupervisionEvent::ProcessGroupChanged(GroupChangeMessage::Leave(
                _,
                group,
                gone,
            )) if group == SCHEDULER_GROUP => {
                if let Some(l) = &state.listening
                    && gone.iter().any(|c| c.get_id() == l.scheduler)
                {
                    let _ = myself.cast(RequestMsg::WorkerLost(l.id));
                }
            }
            ractor::SupervisionEvent::ProcessGroupChanged(GroupChangeMessage::Join(
                _,
                group,
                _,
            )) if group == ROUTABLE_GROUP && state.listening.is_some() => {
                let _ = myself.cast(RequestMsg::WorkerJoined);
            }
            _ => {}
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let span = state.args.span.clone();
        self.handle_in(&myself, msg, state).instrument(span).await
    }
}

impl Request {
    /// [`Actor::handle`], inside the request's span.
    async fn handle_in(
        &self,
        myself: &ActorRef<RequestMsg>,
        msg: RequestMsg,
        state: &mut RequestState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RequestMsg::Event(id, ev) => state.core.event(id, ev),
            RequestMsg::Cancel => state.core.cancel(),
            RequestMsg::WorkerLost(id) => state.core.worker_lost(id),
            RequestMsg::CheckWorker(id) => {
                if let Some(l) = state.listening.as_ref().filter(|l| l.id == id) {
                    let alive = ractor::pg::get_members(&SCHEDULER_GROUP.to_owned())
                        .iter()
                        .any(|c| c.get_id() == l.scheduler);
                    state.core.check(id, alive);
                }
            }
            RequestMsg::HasAnswer(id, has) => state.core.has_answer(id, has),
            RequestMsg::Retry => state.core.retry(),
            RequestMsg::WorkerJoined => state.core.worker_joined(),
        }
        state.apply(myself).await;
        Ok(())
    }
}
