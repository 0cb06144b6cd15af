//! Request: one actor per in-flight request, a temporary child of the gateway's
//! `request_sup`. It owns the request from placement to the last token: asks a Router for a
//! worker, submits to that worker's Scheduler, receives the tokens through this node's
//! TokenSink and hands them to the HTTP handler, and on the way out releases the placement.
//!
//! Worker loss: the actor checks every [`WORKER_CHECK_INTERVAL_MS`] that the scheduler it
//! submitted to is still in the schedulers' group; when it is gone (node down, replica
//! restarted), the client gets a 503 or, once streaming, an error record — never a stream that
//! waits forever. (Migration to another worker replaces this failure in a later step.)
//!
//! Cancellation: when the client goes away the handler's stream is dropped, which casts
//! [`RequestMsg::Cancel`] (and the event channel closes, which is detected on the next
//! event). The actor then cancels at the scheduler, which frees the sequence's KV blocks at
//! once — the step already running completes, its token for this sequence is discarded. So
//! the worker's KV usage is back where it was within one engine step of the disconnect.

use crate::actors::router::{RouteRequest, RouterMsg, find_router};
use crate::actors::scheduler::{SCHEDULER_GROUP, SchedulerMsg, SubmitRequest};
use crate::actors::token_sink::{SinkRegistry, TokenEventKind};
use crate::ids::{NodeId, RequestId, WorkerId};
use crate::wire::Wire;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How long placement may take before the request fails with 503 (ms).
pub const ROUTE_TIMEOUT_MS: u64 = 5_000;

/// What to generate: exactly what is submitted to the chosen worker's scheduler
/// (`reply_to` is this gateway node).
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
}

/// Request messages (local).
#[derive(Debug)]
pub enum RequestMsg {
    /// An event from the worker.
    Event(TokenEventKind),
    /// The client is gone or the handler is done: cancel downstream and stop.
    Cancel,
    /// Internal: the scheduler serving the request is gone (its node died or its replica
    /// restarted), so no more tokens will come.
    WorkerLost,
}

impl ractor::Message for RequestMsg {}

/// The Request actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct Request;

/// Request state.
pub struct RequestState {
    args: RequestArgs,
    worker: Option<WorkerId>,
    done: bool,
    forwarder: Option<JoinHandle<()>>,
    watchdog: Option<JoinHandle<()>>,
}

/// How often a Request checks that its scheduler still exists.
pub const WORKER_CHECK_INTERVAL_MS: u64 = 250;

fn scheduler_of(worker: &WorkerId) -> Option<ActorRef<SchedulerMsg>> {
    crate::cluster::member_named(SCHEDULER_GROUP, &format!("{worker}/scheduler")).map(Into::into)
}

impl RequestState {
    fn key(&self) -> (NodeId, RequestId) {
        (self.args.job.reply_to.clone(), self.args.job.request)
    }

    fn fail(&mut self, message: &str, status: u16) {
        let _ = self.args.events.send(TokenEventKind::Failed {
            message: message.to_owned(),
            status,
        });
        self.done = true;
    }

    /// Cancel downstream (if still running) and release the placement; idempotent.
    fn finish(&mut self, cancel: bool) {
        if let Some(w) = self.worker.take() {
            if cancel && let Some(s) = scheduler_of(&w) {
                let _ = s.cast(SchedulerMsg::Cancel(Wire::encode(&self.key())));
            }
            if let Some(r) = find_router() {
                let _ = r.cast(RouterMsg::Release(Wire::encode(&self.key())));
            }
        }
        self.done = true;
    }

    /// Watch the scheduler the request was submitted to: when it leaves the schedulers' group
    /// (node down: its session dropped; replica restarted: a new actor), report it.
    fn watch(&mut self, scheduler: ractor::ActorId, me: ActorRef<RequestMsg>) {
        self.watchdog = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(WORKER_CHECK_INTERVAL_MS))
                    .await;
                let alive = ractor::pg::get_members(&SCHEDULER_GROUP.to_owned())
                    .iter()
                    .any(|c| c.get_id() == scheduler);
                if !alive {
                    let _ = me.cast(RequestMsg::WorkerLost);
                    break;
                }
            }
        }));
    }

    async fn place(&mut self) -> Result<ractor::ActorId, (String, u16)> {
        let job = &self.args.job;
        let router = find_router().ok_or(("no router is available".to_owned(), 503))?;
        let req = RouteRequest {
            node: job.reply_to.clone(),
            request: job.request,
            prompt_tokens: job.prompt.len() as u32,
        };
        let pick = ractor::call_t!(
            router,
            RouterMsg::Route,
            ROUTE_TIMEOUT_MS,
            Wire::encode(&req)
        )
        .map_err(|_| ("the router did not answer".to_owned(), 503))?
        .decode()
        .map_err(|_| ("the router sent a malformed reply".to_owned(), 500))?;
        let worker = pick.ok_or(("no worker is available".to_owned(), 503))?;
        let scheduler =
            scheduler_of(&worker).ok_or(("the chosen worker went away".to_owned(), 503))?;
        self.worker = Some(worker);
        scheduler
            .cast(SchedulerMsg::Submit(Wire::encode(job)))
            .map_err(|_| ("the chosen worker went away".to_owned(), 503))?;
        Ok(scheduler.get_id())
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
        let mut rx = args.registry.register(args.job.request);
        let forwarder = tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                if myself.cast(RequestMsg::Event(ev)).is_err() {
                    break;
                }
            }
        });
        Ok(RequestState {
            args,
            worker: None,
            done: false,
            forwarder: Some(forwarder),
            watchdog: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match state.place().await {
            Ok(scheduler) => state.watch(scheduler, myself.clone()),
            Err((message, status)) => {
                state.fail(&message, status);
                state.finish(false);
                myself.stop(None);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let running = !state.done;
        state.finish(running);
        state.args.registry.unregister(state.args.job.request);
        if let Some(f) = state.forwarder.take() {
            f.abort();
        }
        if let Some(w) = state.watchdog.take() {
            w.abort();
        }
        if running {
            // Stopped from outside (node shutdown) while running: tell the handler.
            let _ = state.args.events.send(TokenEventKind::Failed {
                message: "the gateway is shutting down".into(),
                status: 503,
            });
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RequestMsg::Event(ev) => {
                let last = matches!(
                    ev,
                    TokenEventKind::Failed { .. }
                        | TokenEventKind::Token {
                            finish: Some(_),
                            ..
                        }
                );
                if state.args.events.send(ev).is_err() {
                    // The handler is gone: the client disconnected.
                    state.finish(true);
                    myself.stop(None);
                } else if last {
                    state.finish(false);
                    myself.stop(None);
                }
            }
            RequestMsg::Cancel => {
                state.finish(true);
                myself.stop(None);
            }
            RequestMsg::WorkerLost => {
                if !state.done {
                    tracing::warn!(request = %state.args.job.request, worker = ?state.worker, "worker lost mid-request");
                    state.fail("the worker serving this request was lost", 503);
                    state.finish(false);
                }
                myself.stop(None);
            }
        }
        Ok(())
    }
}
