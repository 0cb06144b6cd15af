//! [`RequestCore`]: everything the per-request actor decides, as a pure state machine around
//! the [`Migration`] rule.
//!
//! The [`Request`](crate::actors::request::Request) actor feeds it what happens — the
//! router's pick, whether a submission reached its scheduler, the attempt's token events, a
//! lost worker, a periodic check, the answer to "do you still have it", a retry timer, the
//! client going away — and carries out the [`RequestEffect`]s it asks for: route, submit,
//! cancel, release the placement, tell the router of the first token, ask the worker, deliver
//! an event to the HTTP handler, wait until an instant, emit a fleet event, stop. Time comes
//! from the injected [`Clock`](crate::runtime::clock::Clock) only, so a test (or the offline
//! simulator) drives a request from admission to its last token, migrations included, under a
//! [`ManualClock`](crate::runtime::clock::ManualClock) with no actor and no socket.
//!
//! The rules (attempts, migration, hand-off, stall checks, cancellation) are described in the
//! actor's module doc, [`crate::actors::request`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::kv::block_hashes;
use crate::request_plane::error::RequestError;
use crate::request_plane::events::FleetEventKind;
use crate::request_plane::migration::{
    Decision, GONE_PICKS_MAX, GiveUp, Migration, MigrationPolicy,
};
use crate::request_plane::protocol::{
    Placement, RemoteKv, RouteRequest, SubmitRequest, TokenEventKind,
};
use crate::request_plane::router::policy::Policy;
use crate::runtime::clock::{Instant, SharedClock};
use crate::runtime::ids::{NodeId, RequestId, WorkerId};

/// Silence after which a request asks its worker whether it still has the request (ms).
/// Events lost on the way (a token sink killed with messages in its mailbox) are found this
/// way, or sooner by a gap in the token indices.
pub const STALL_CHECK_MS: u64 = 5_000;

/// A request's key at a worker and at the router: its gateway node and its attempt's id.
pub type AttemptKey = (NodeId, RequestId);

/// What a [`RequestCore`] is built from.
#[derive(Clone, Debug)]
pub struct RequestCoreConfig {
    /// What to generate, exactly as submitted (`reply_to` is this gateway node); `request` is
    /// the id of the first attempt.
    pub job: SubmitRequest,
    /// Tokens per KV block and the model's hash salt: the prompt's sequence hashes for the
    /// router's prefix index.
    pub block_size: usize,
    /// See `block_size`.
    pub salt: u64,
    /// Routing policy for this request (`None`: the router's).
    pub policy: Option<Policy>,
    /// Every attempt goes to this worker, without asking a router.
    pub pin: Option<WorkerId>,
    /// When to migrate, wait or give up.
    pub migration: MigrationPolicy,
}

/// What the core asks its driver to do, in order.
#[derive(Clone, Debug)]
pub enum RequestEffect {
    /// Ask a router for a worker; answer with [`RequestCore::picked`].
    Route(RouteRequest),
    /// Listen for the events of attempt `job.request`, then submit `job` to `worker`; answer
    /// with [`RequestCore::submitted`].
    Submit {
        worker: WorkerId,
        job: Box<SubmitRequest>,
    },
    /// Stop listening for the events of this attempt (it ended).
    Unlisten(RequestId),
    /// Cancel at the worker's scheduler: it frees the sequence's (or the hand-off's) blocks.
    Cancel { worker: WorkerId, key: AttemptKey },
    /// Release the placement at the router.
    ReleasePlacement(AttemptKey),
    /// Tell the router the attempt's first token came (its prefill is over).
    FirstToken(AttemptKey),
    /// Ask `worker` whether it still has `key`; answer with [`RequestCore::has_answer`]
    /// (no answer: the step watchdog deals with a worker that does not answer).
    AskHas { worker: WorkerId, key: AttemptKey },
    /// Pass this event to the HTTP handler; when the handler is gone, answer with
    /// [`RequestCore::handler_gone`].
    Deliver(TokenEventKind),
    /// Call [`RequestCore::retry`] at this instant.
    RetryAt(Instant),
    /// For the node's fleet event bus.
    Fleet(FleetEventKind),
    /// The request is over: the driver stops.
    Stop,
}

/// One placement of the request.
#[derive(Clone, Debug)]
struct Attempt {
    id: RequestId,
    worker: WorkerId,
    first_token_seen: bool,
    /// The worker admitted it (its prefill began): a loss from here on counts against it.
    admitted: bool,
    /// Tokens received from this attempt (the next expected index).
    received: u32,
    /// When the last event of this attempt arrived (wall ms).
    last_event_ms: u64,
    /// When its last stall check was asked (wall ms; 0: never).
    last_check_ms: u64,
    /// A prefill-only attempt (disaggregated): it ends with a hand-off.
    hand_off: bool,
    /// It pulls KV from another worker (a peer pull or a hand-off): never moved while queued.
    pulls: bool,
}

/// A placement in progress: asked the router, or submitting.
#[derive(Clone, Debug)]
struct Placing {
    job: SubmitRequest,
    /// The chosen worker, once picked.
    worker: Option<WorkerId>,
    /// The router's cost terms for it, for the `placed` event.
    terms: Option<crate::request_plane::protocol::PlacementTerms>,
    /// Asked by a queued attempt whether to move ([`RequestCore::worker_joined`]): the
    /// current attempt stays unless the router names another worker.
    moving: bool,
}

/// One request's state (see the module doc).
pub struct RequestCore {
    cfg: RequestCoreConfig,
    clock: SharedClock,
    /// The gateway's request id counter (each attempt after the first takes a fresh id).
    ids: Arc<AtomicU64>,
    effects: Vec<RequestEffect>,
    attempt: Option<Attempt>,
    placing: Option<Placing>,
    /// Picks routed again in this placement because their worker was gone.
    gone_picks: u32,
    /// Tokens delivered to the handler, in order.
    generated: Vec<u32>,
    migration: Migration,
    done: bool,
    last_token_at: Option<Instant>,
    /// When the last token was delivered (wall ms): the next attempt's place in its worker's
    /// queue ([`SubmitRequest::waiting_since_ms`]).
    last_token_wall_ms: Option<u64>,
    /// Attempts placed so far (the first one uses the job's request id).
    attempts: u32,
    /// KV handed off by a prefill worker, for the next (decode) attempt to pull.
    pending_kv: Option<RemoteKv>,
    /// The prefill worker holding this request's KV, and its request id there.
    held: Option<(WorkerId, RequestId)>,
    /// Prompt log-probabilities (echo): the position of the next prompt token whose logprob
    /// the handler has not had yet (1: none yet; each position is passed on once, whatever
    /// attempt computed it).
    prompt_scored: u32,
}

impl RequestCore {
    /// A request not yet placed; [`RequestCore::start`] places it.
    pub fn new(cfg: RequestCoreConfig, ids: Arc<AtomicU64>, clock: SharedClock) -> Self {
        let migration = Migration::new(cfg.migration, cfg.job.request.0);
        Self {
            cfg,
            clock,
            ids,
            effects: Vec::new(),
            attempt: None,
            placing: None,
            gone_picks: 0,
            generated: Vec::new(),
            migration,
            done: false,
            last_token_at: None,
            last_token_wall_ms: None,
            attempts: 0,
            pending_kv: None,
            held: None,
            prompt_scored: 1,
        }
    }

    /// Whether the handler has every prompt log-probability the request asked for (always,
    /// without echo).
    fn prompt_complete(&self) -> bool {
        self.prompt_scored >= self.cfg.job.sampling.echo_tokens
    }

    /// The effects asked for since the last call, in order.
    pub fn take_effects(&mut self) -> Vec<RequestEffect> {
        std::mem::take(&mut self.effects)
    }

    /// The first attempt's id (the request's id for the client and the logs).
    pub fn id(&self) -> RequestId {
        self.cfg.job.request
    }

    /// The current attempt and its worker.
    pub fn current(&self) -> Option<(RequestId, &WorkerId)> {
        self.attempt.as_ref().map(|a| (a.id, &a.worker))
    }

    /// Whether the request is over.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Tokens delivered so far.
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    fn node(&self) -> NodeId {
        self.cfg.job.reply_to.clone()
    }

    /// Place the first attempt.
    pub fn start(&mut self) {
        self.place_or_retry();
    }

    /// The client is gone or the handler is done: cancel downstream and stop.
    pub fn cancel(&mut self) {
        self.end_attempt(true);
        self.done = true;
        self.effects.push(RequestEffect::Stop);
    }

    /// The driver stops (from outside, e.g. a node shutting down): a request still running
    /// tells its handler.
    pub fn stopped(&mut self) {
        let running = !self.done;
        self.end_attempt(running);
        if running {
            self.done = true;
            self.effects.push(RequestEffect::Deliver(
                RequestError::ShuttingDown.to_event(),
            ));
        }
    }

    /// A worker joined the routable group (restarted, scaled up, back from draining): if
    /// the current attempt still waits in its worker's queue (not admitted, no token yet),
    /// ask the router whether another worker would start it sooner
    /// ([`RouteRequest::rebalance`]). Without this, the requests a fault moved onto the
    /// one surviving worker would all wait there while the restarted one sits idle.
    pub fn worker_joined(&mut self) {
        if self.done
            || self.placing.is_some()
            || self.cfg.pin.is_some()
            || self.held.is_some()
            || self.pending_kv.is_some()
        {
            return;
        }
        let Some(a) = self.attempt.as_ref() else {
            return;
        };
        if a.admitted || a.first_token_seen || a.hand_off || a.pulls {
            return;
        }
        let old = a.id;
        let job = self.next_job(RequestId(self.ids.fetch_add(1, Ordering::Relaxed)));
        let mut route = self.route_request(&job);
        route.rebalance = Some(old);
        route.remote_prefill = false;
        self.placing = Some(Placing {
            job,
            worker: None,
            terms: None,
            moving: true,
        });
        self.effects.push(RequestEffect::Route(route));
    }

    /// The router's answer to a [`RequestCore::worker_joined`] question: move the queued
    /// attempt to the worker it names, if it is still queued; otherwise stay.
    fn move_picked(&mut self, pick: Result<Option<Placement>, RequestError>) {
        let Some(placing) = self.placing.take() else {
            return;
        };
        let Ok(Some(p)) = pick else {
            return; // stay: no worker would start it sooner (or the router is away)
        };
        let queued = self
            .attempt
            .as_ref()
            .is_some_and(|a| !a.admitted && !a.first_token_seen);
        if self.done || !queued {
            // Its prefill began meanwhile: it stays, and the router forgets the move.
            self.effects.push(RequestEffect::ReleasePlacement((
                self.node(),
                placing.job.request,
            )));
            return;
        }
        tracing::debug!(request = %self.id(), request_id = %self.cfg.job.trace_id.as_deref().unwrap_or("-"),
            from = ?self.current().map(|(_, w)| w.clone()), to = %p.worker, "moving a queued request to a worker that starts it sooner");
        metrics::counter!("flotilla_requests_moved_total").increment(1);
        self.end_attempt(true);
        self.attempts += 1;
        self.placing = Some(Placing {
            moving: false,
            ..placing
        });
        self.picked(Ok(Some(p)));
    }

    /// The router's answer to [`RequestEffect::Route`].
    pub fn picked(&mut self, pick: Result<Option<Placement>, RequestError>) {
        match self.placing.as_ref() {
            None => return,
            Some(p) if p.moving => return self.move_picked(pick),
            Some(_) => {}
        }
        let pick = match pick.and_then(|p| p.ok_or(RequestError::NoWorkers)) {
            Ok(p) => p,
            Err(e) => {
                self.placing = None;
                return self.place_failed(e);
            }
        };
        let pending_kv = self.pending_kv.clone();
        let Some(placing) = self.placing.as_mut() else {
            return;
        };
        // The KV a prefill worker handed off stays this request's until a decode attempt is
        // submitted with it: a pick that finds its worker gone routes again with it.
        if pick.hand_off {
            placing.job.hand_off = true;
        } else {
            placing.job.fetch = if pending_kv.is_none() {
                pick.fetch
            } else {
                None
            };
            placing.job.remote_kv = pending_kv;
        }
        placing.worker = Some(pick.worker.clone());
        placing.terms = pick.terms;
        let job = placing.job.clone();
        self.effects.push(RequestEffect::Submit {
            worker: pick.worker,
            job: Box::new(job),
        });
    }

    /// Whether the submission of [`RequestEffect::Submit`] reached the worker's scheduler
    /// (false: the worker left a moment ago; the driver stopped listening).
    pub fn submitted(&mut self, reached: bool) {
        let Some(Placing {
            job,
            worker: Some(worker),
            terms,
            moving: false,
        }) = self.placing.take()
        else {
            return;
        };
        if !reached {
            if self.cfg.pin.is_none() {
                self.effects
                    .push(RequestEffect::ReleasePlacement((self.node(), job.request)));
            }
            // The router chose a worker that left a moment ago: route again at once, avoiding
            // it (a pinned request has no other worker to go to).
            if self.cfg.pin.is_none() && self.gone_picks < GONE_PICKS_MAX {
                self.gone_picks += 1;
                metrics::counter!("flotilla_route_retries_total").increment(1);
                tracing::debug!(request = %self.id(), %worker, "the chosen worker went away; routing again");
                self.migration.avoid_worker(worker);
                return self.place();
            }
            return self.place_failed(RequestError::WorkerGone(worker));
        }
        if job.remote_kv.is_some() {
            self.pending_kv = None;
        }
        self.attempt = Some(Attempt {
            id: job.request,
            worker: worker.clone(),
            first_token_seen: false,
            admitted: false,
            received: 0,
            last_event_ms: self.clock.wall_ms(),
            last_check_ms: 0,
            hand_off: job.hand_off,
            pulls: job.fetch.is_some() || job.remote_kv.is_some(),
        });
        self.effects
            .push(RequestEffect::Fleet(FleetEventKind::Placed {
                request: self.id(),
                request_id: self.cfg.job.trace_id.clone(),
                worker,
                attempt: self.attempts,
                hand_off: job.hand_off,
                terms,
            }));
    }

    /// The scheduler serving attempt `id` left the schedulers' group.
    pub fn worker_lost(&mut self, id: RequestId) {
        if self.current().is_some_and(|(a, _)| a == id) {
            self.migrate("the worker serving this request was lost");
        }
    }

    /// Periodic check of attempt `id`: whether its scheduler is still in the group (`alive`,
    /// the backup of the group monitor), and after [`STALL_CHECK_MS`] of silence (and each
    /// further `STALL_CHECK_MS`) ask the worker whether it still has the attempt.
    pub fn check(&mut self, id: RequestId, alive: bool) {
        if self.current().is_none_or(|(a, _)| a != id) {
            return;
        }
        if !alive {
            return self.migrate("the worker serving this request was lost");
        }
        let now = self.clock.wall_ms();
        let node = self.node();
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        if now.saturating_sub(a.last_event_ms.max(a.last_check_ms)) < STALL_CHECK_MS {
            return;
        }
        a.last_check_ms = now;
        let ask = RequestEffect::AskHas {
            worker: a.worker.clone(),
            key: (node, a.id),
        };
        self.effects.push(ask);
    }

    /// The worker's answer to [`RequestEffect::AskHas`] for attempt `id`: if it no longer
    /// has the attempt (its last events were lost), resume elsewhere.
    pub fn has_answer(&mut self, id: RequestId, has: bool) {
        if !has && self.current().is_some_and(|(a, _)| a == id) {
            self.migrate("the worker no longer has this request (events lost)");
        }
    }

    /// A migration that found no worker waited: try placing again.
    pub fn retry(&mut self) {
        if self.attempt.is_none() && self.placing.is_none() && !self.done {
            self.place_or_retry();
        }
    }

    /// The HTTP handler is gone (a [`RequestEffect::Deliver`] could not be sent): the client
    /// disconnected.
    pub fn handler_gone(&mut self) {
        if self.done {
            return;
        }
        self.end_attempt(true);
        self.done = true;
        self.effects.push(RequestEffect::Stop);
    }

    /// An event of attempt `id` (events of older attempts are ignored).
    pub fn event(&mut self, id: RequestId, ev: TokenEventKind) {
        if self.done || self.current().is_none_or(|(a, _)| a != id) {
            return;
        }
        let now_ms = self.clock.wall_ms();
        if let Some(a) = self.attempt.as_mut() {
            a.last_event_ms = now_ms;
            if let TokenEventKind::Token { index, .. } = ev {
                if self.prompt_scored < self.cfg.job.sampling.echo_tokens {
                    // The first token comes after the whole prompt's logprobs: some were
                    // lost on the way. The next attempt computes them again.
                    return self.migrate("prompt log-probabilities lost before the first token");
                }
                if index != a.received {
                    // Events were lost between the worker and here: resume from what was
                    // delivered, elsewhere or on the same worker.
                    let why = format!("token events lost (expected {}, got {index})", a.received);
                    return self.migrate(&why);
                }
                a.received += 1;
            }
            if matches!(ev, TokenEventKind::Admitted { .. }) {
                a.admitted = true;
            }
        }
        let ev = match ev {
            TokenEventKind::Prompt { first, logprobs } => {
                if first > self.prompt_scored {
                    let why = format!(
                        "prompt log-probabilities lost (expected position {}, got {first})",
                        self.prompt_scored
                    );
                    return self.migrate(&why);
                }
                // Positions already passed on (a recomputed prompt) are dropped.
                let skip = (self.prompt_scored - first) as usize;
                if skip >= logprobs.len() {
                    return;
                }
                let logprobs = logprobs[skip..].to_vec();
                let first = self.prompt_scored;
                self.prompt_scored = first.saturating_add(logprobs.len() as u32);
                TokenEventKind::Prompt { first, logprobs }
            }
            other => other,
        };
        match ev {
            TokenEventKind::Lost { reason } => return self.migrate(&reason),
            TokenEventKind::Prompt { .. } => {}
            TokenEventKind::HandOff(kv) => {
                if !self.attempt.as_ref().is_some_and(|a| a.hand_off) {
                    return; // not asked for: ignored
                }
                // The prefill worker computed the prompt and sent the first token (passed on
                // already); place the decode attempt, which pulls the KV it holds.
                tracing::debug!(request = %self.id(), prefill = %kv.worker, tokens = kv.tokens, "prefill handed off");
                self.effects
                    .push(RequestEffect::Fleet(FleetEventKind::HandedOff {
                        request: self.id(),
                        from: kv.worker.clone(),
                        tokens: kv.tokens,
                    }));
                // A second hand-off (the decode placement was handed off again) replaces the
                // first: its prefill worker is told to release what it holds for us.
                self.release_held();
                self.held = Some((kv.worker.clone(), kv.request));
                self.pending_kv = Some(*kv);
                self.end_attempt(false);
                // Tokens have reached the client: a placement that finds no worker waits
                // for one (as a migration does) instead of failing the request.
                self.migration.on_hand_off(self.clock.now());
                return self.place_or_retry();
            }
            // Every admission is passed on (a migrated choice's new worker too: the handler
            // lists each worker that served it; its usage keeps the first one's cached tokens).
            TokenEventKind::Admitted { .. } => {}
            TokenEventKind::Token { id: token, .. } => {
                let node = self.node();
                if let Some(a) = self.attempt.as_mut() {
                    if !a.first_token_seen && self.cfg.pin.is_none() {
                        self.effects.push(RequestEffect::FirstToken((node, a.id)));
                    }
                    a.first_token_seen = true;
                }
                self.generated.push(token);
                let now = self.clock.now();
                if self.migration.on_resumed()
                    && let Some(last) = self.last_token_at
                {
                    let gap = now - last;
                    metrics::histogram!("flotilla_migration_resume_gap_seconds")
                        .record(gap.as_secs_f64());
                    tracing::debug!(request = %self.id(), gap_ms = gap.as_millis() as u64, generated = self.generated.len(), "resumed");
                }
                self.last_token_at = Some(now);
                self.last_token_wall_ms = Some(now_ms);
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
        self.effects.push(RequestEffect::Deliver(ev));
        if last {
            self.end_attempt(false);
            self.release_held();
            self.done = true;
            self.effects.push(RequestEffect::Stop);
        }
    }

    fn fail(&mut self, error: RequestError) {
        self.effects
            .push(RequestEffect::Fleet(FleetEventKind::GaveUp {
                request: self.id(),
                request_id: self.cfg.job.trace_id.clone(),
                reason: error.to_string(),
            }));
        self.effects.push(RequestEffect::Deliver(error.to_event()));
        self.done = true;
        self.release_held();
        self.effects.push(RequestEffect::Stop);
    }

    /// Tells the prefill worker holding this request's KV to release it (idempotent there:
    /// the decode worker confirms the same way once its pull is over).
    fn release_held(&mut self) {
        self.pending_kv = None;
        if let Some((worker, id)) = self.held.take() {
            let key = (self.node(), id);
            self.effects.push(RequestEffect::Cancel { worker, key });
        }
    }

    /// End the current attempt: cancel it at its scheduler (if `cancel`), release the
    /// placement, stop listening for its events. Idempotent.
    fn end_attempt(&mut self, cancel: bool) {
        let Some(a) = self.attempt.take() else {
            return;
        };
        let key = (self.node(), a.id);
        if cancel {
            self.effects.push(RequestEffect::Cancel {
                worker: a.worker,
                key: key.clone(),
            });
            self.release_held();
        }
        if self.cfg.pin.is_none() {
            self.effects.push(RequestEffect::ReleasePlacement(key));
        }
        self.effects.push(RequestEffect::Unlisten(a.id));
    }

    /// The job of the next attempt: the prompt plus what was delivered, the rest of the budget.
    fn next_job(&self, id: RequestId) -> SubmitRequest {
        let mut job = self.cfg.job.clone();
        job.request = id;
        job.prompt.extend_from_slice(&self.generated);
        job.max_tokens = job.max_tokens.saturating_sub(self.generated.len() as u32);
        job.sampling.offset = self.generated.len() as u64;
        // The client has waited since its last token (or its arrival, before any).
        if let Some(ms) = self.last_token_wall_ms {
            job.waiting_since_ms = ms;
        }
        if self.prompt_complete() {
            // Every prompt logprob was passed on: the next attempt need not score (and may
            // use its prefix cache).
            job.sampling.echo_tokens = 0;
        }
        job
    }

    /// Place (first attempt or a migration); a failure waits and retries or fails the
    /// request, as the migration rule says.
    fn place_or_retry(&mut self) {
        self.gone_picks = 0;
        self.place();
    }

    /// Start a new attempt: ask the router (or take the pinned worker).
    fn place(&mut self) {
        let id = if self.attempts == 0 {
            self.cfg.job.request
        } else {
            RequestId(self.ids.fetch_add(1, Ordering::Relaxed))
        };
        self.attempts += 1;
        let job = self.next_job(id);
        let route = self.route_request(&job);
        self.placing = Some(Placing {
            job,
            worker: None,
            terms: None,
            moving: false,
        });
        match self.cfg.pin.clone() {
            Some(worker) => self.picked(Ok(Some(Placement {
                worker,
                hand_off: false,
                fetch: None,
                terms: None,
            }))),
            None => self.effects.push(RequestEffect::Route(route)),
        }
    }

    /// What the router is asked to place `job`.
    fn route_request(&self, job: &SubmitRequest) -> RouteRequest {
        RouteRequest {
            node: job.reply_to.clone(),
            request: job.request,
            prompt_tokens: job.prompt.len() as u32,
            seq_hashes: block_hashes(&job.prompt, self.cfg.block_size, self.cfg.salt)
                .into_iter()
                .map(|(_, s)| s)
                .collect(),
            policy: self.cfg.policy,
            avoid: self.migration.avoid().to_vec(),
            rebalance: None,
            remote_prefill: self.pending_kv.is_none(),
            trace_id: job.trace_id.clone(),
            traceparent: job.traceparent.clone(),
            session: job.session.clone(),
        }
    }

    fn place_failed(&mut self, error: RequestError) {
        let now = self.clock.now();
        let decision = if error == RequestError::RouterTimeout {
            // The router died or hung mid-call: ask again (another one, once it is dropped).
            self.migration.on_router_failed(now)
        } else {
            self.migration.on_place_failed(now, error.is_retryable())
        };
        match decision {
            Decision::Wait { until } => self.effects.push(RequestEffect::RetryAt(until)),
            Decision::Place => {} // not produced by a failed placement
            Decision::Fail(GiveUp::FirstPlacement) => self.fail(error),
            Decision::Fail(why) => {
                metrics::counter!("flotilla_migration_failures_total").increment(1);
                tracing::warn!(request = %self.id(), request_id = %self.cfg.job.trace_id.as_deref().unwrap_or("-"), %error, %why, "migration failed");
                self.fail(RequestError::GaveUp {
                    cause: error.to_string(),
                    why,
                });
            }
        }
    }

    /// The worker is gone: re-place the request with what it has generated, unless the
    /// migration rule gives it up.
    fn migrate(&mut self, why: &str) {
        let from = self.attempt.as_ref().map(|a| a.worker.clone());
        let ran = self.attempt.as_ref().is_some_and(|a| a.admitted);
        self.end_attempt(true);
        let now = self.clock.now();
        match self
            .migration
            .on_loss(now, self.generated.len(), ran, from.clone())
        {
            Decision::Fail(give_up) => {
                metrics::counter!("flotilla_migration_failures_total").increment(1);
                tracing::warn!(request = %self.id(), request_id = %self.cfg.job.trace_id.as_deref().unwrap_or("-"), ?from, %why, %give_up, "request given up");
                self.fail(RequestError::GaveUp {
                    cause: why.to_owned(),
                    why: give_up,
                });
            }
            Decision::Place | Decision::Wait { .. } => {
                self.effects
                    .push(RequestEffect::Fleet(FleetEventKind::Migrated {
                        request: self.id(),
                        request_id: self.cfg.job.trace_id.clone(),
                        from: from.clone(),
                        generated: self.generated.len(),
                        reason: why.to_owned(),
                    }));
                metrics::counter!("flotilla_migrations_total").increment(1);
                tracing::warn!(request = %self.id(), request_id = %self.cfg.job.trace_id.as_deref().unwrap_or("-"), ?from, generated = self.generated.len(),
                    stalled = self.migration.stalled(), %why, "migrating");
                self.place_or_retry();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::clock::{Clock, ManualClock};
    use std::time::Duration;

    fn core(clock: &ManualClock, pin: Option<&str>) -> RequestCore {
        let job = SubmitRequest {
            request: RequestId(1),
            reply_to: NodeId::new("gw"),
            prompt: (1..=20).collect(),
            max_tokens: 10,
            sampling: Default::default(),
            stop_token_ids: vec![],
            ignore_eos: true,
            owner_incarnation: 1,
            waiting_since_ms: clock.wall_ms(),
            trace_id: None,
            traceparent: None,
            hand_off: false,
            remote_kv: None,
            fetch: None,
            class: None,
            session: None,
        };
        RequestCore::new(
            RequestCoreConfig {
                job,
                block_size: 4,
                salt: 1,
                policy: None,
                pin: pin.map(WorkerId::new),
                migration: MigrationPolicy::default(),
            },
            Arc::new(AtomicU64::new(100)),
            Arc::new(clock.clone()),
        )
    }

    /// The router's pick of `worker` (no hand-off, no pull).
    fn on(worker: &str) -> Result<Option<Placement>, RequestError> {
        Ok(Some(Placement {
            worker: w(worker),
            hand_off: false,
            fetch: None,
            terms: None,
        }))
    }

    fn w(s: &str) -> WorkerId {
        WorkerId::new(s)
    }

    /// The Submit effects so far, in order.
    fn submits(c: &mut RequestCore) -> Vec<(WorkerId, SubmitRequest)> {
        c.take_effects()
            .into_iter()
            .filter_map(|e| match e {
                RequestEffect::Submit { worker, job } => Some((worker, *job)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_migrated_attempt_queues_by_its_last_token_not_its_arrival() {
        let clock = ManualClock::new();
        let arrival = clock.wall_ms();
        let mut c = core(&clock, Some("a"));
        c.start();
        let (_, first) = submits(&mut c).pop().expect("first attempt");
        assert_eq!(
            first.waiting_since_ms, arrival,
            "a new request waits since its arrival"
        );
        c.submitted(true);
        let id = first.request;
        for (i, ms) in [(0u32, 300u64), (1, 700)] {
            clock.advance(Duration::from_millis(ms));
            c.event(
                id,
                TokenEventKind::Token {
                    id: 7,
                    index: i,
                    finish: None,
                    logprob: 0.0,
                    top: Vec::new(),
                },
            );
        }
        let last_token = clock.wall_ms();
        clock.advance(Duration::from_millis(2_000));
        c.worker_lost(id);
        let (_, next) = submits(&mut c).pop().expect("the migration's attempt");
        assert_eq!(next.prompt.len(), first.prompt.len() + 2);
        assert_eq!(
            next.waiting_since_ms, last_token,
            "its client has waited since the last token"
        );
    }

    fn token(index: u32) -> TokenEventKind {
        TokenEventKind::Token {
            id: 500 + index,
            logprob: 0.0,
            finish: None,
            index,
            top: Vec::new(),
        }
    }

    /// Route to `worker` and submit there; the attempt's id.
    fn place_on(c: &mut RequestCore, worker: &str) -> RequestId {
        let effects = c.take_effects();
        assert!(
            matches!(effects.last(), Some(RequestEffect::Route(_))),
            "{effects:?}"
        );
        c.picked(on(worker));
        let id = match c.take_effects().as_slice() {
            [RequestEffect::Submit { worker: to, job }] if *to == w(worker) => job.request,
            other => panic!("{other:?}"),
        };
        c.submitted(true);
        id
    }

    #[test]
    fn a_pinned_request_asks_no_router() {
        let clock = ManualClock::new();
        let mut c = core(&clock, Some("n/replica-0"));
        c.start();
        let effects = c.take_effects();
        assert!(
            matches!(effects.as_slice(), [RequestEffect::Submit { worker, .. }] if *worker == w("n/replica-0")),
            "{effects:?}"
        );
        c.submitted(true);
        c.event(RequestId(1), token(0));
        c.cancel();
        let effects = c.take_effects();
        assert!(
            !effects.iter().any(|e| matches!(
                e,
                RequestEffect::ReleasePlacement(_) | RequestEffect::FirstToken(_)
            )),
            "{effects:?}"
        );
        assert!(matches!(effects.last(), Some(RequestEffect::Stop)));
    }

    #[test]
    fn no_worker_for_the_first_placement_is_a_503_at_once() {
        let clock = ManualClock::new();
        let mut c = core(&clock, None);
        c.start();
        let _ = c.take_effects();
        c.picked(Ok(None));
        let effects = c.take_effects();
        let status = effects.iter().find_map(|e| match e {
            RequestEffect::Deliver(TokenEventKind::Failed { status, .. }) => Some(*status),
            _ => None,
        });
        assert_eq!(status, Some(503), "{effects:?}");
        assert!(matches!(effects.last(), Some(RequestEffect::Stop)));
        assert!(c.is_done());
    }

    #[test]
    fn a_router_that_fails_the_first_placement_is_asked_again_not_a_503() {
        let clock = ManualClock::new();
        let mut c = core(&clock, None);
        c.start();
        let _ = c.take_effects();
        // The router died during the call (or did not answer): wait, then route again.
        c.picked(Err(RequestError::RouterTimeout));
        let until = match c.take_effects().as_slice() {
            [RequestEffect::RetryAt(until)] => *until,
            other => panic!("{other:?}"),
        };
        assert!(!c.is_done());
        clock.advance(until - clock.now());
        c.retry();
        let first = place_on(&mut c, "b/replica-0");
        let _ = c.take_effects();
        c.event(first, token(0));
        let effects = c.take_effects();
        assert!(
            effects
                .iter()
                .any(|e| matches!(e, RequestEffect::Deliver(TokenEventKind::Token { .. }))),
            "{effects:?}"
        );
        // Routers failing until the migration deadline: then a 503.
        let mut c = core(&clock, None);
        c.start();
        let _ = c.take_effects();
        let deadline = clock.now() + MigrationPolicy::default().deadline;
        loop {
            c.picked(Err(RequestError::RouterTimeout));
            match c.take_effects().as_slice() {
                [RequestEffect::RetryAt(until)] => {
                    clock.advance((*until - clock.now()).max(Duration::from_millis(1)));
                    c.retry();
                    let _ = c.take_effects();
                }
                effects => {
                    assert!(clock.now() >= deadline, "gave up early: {effects:?}");
                    let status = effects.iter().find_map(|e| match e {
                        RequestEffect::Deliver(TokenEventKind::Failed { status, .. }) => {
                            Some(*status)
                        }
                        _ => None,
                    });
                    assert_eq!(status, Some(503), "{effects:?}");
                    break;
                }
            }
        }
    }

    #[test]
    fn a_queued_attempt_moves_to_a_worker_that_joined_only_before_it_starts() {
        let clock = ManualClock::new();
        let mut c = core(&clock, None);
        c.start();
        let first = place_on(&mut c, "a/replica-0");
        let _ = c.take_effects();
        // A worker joins: the queued attempt asks whether to move, and the router says stay.
        c.worker_joined();
        let route = match c.take_effects().as_slice() {
            [RequestEffect::Route(r)] => r.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(route.rebalance, Some(first));
        assert!(!route.remote_prefill, "a move is never a prefill hand-off");
        c.picked(Ok(None));
        assert!(c.take_effects().is_empty(), "stays where it is");
        assert_eq!(c.current().map(|(id, _)| id), Some(first));
        // Next time the router names another worker: cancelled there, submitted here.
        c.worker_joined();
        let _ = c.take_effects();
        c.picked(on("b/replica-0"));
        let effects = c.take_effects();
        assert!(effects.iter().any(
            |e| matches!(e, RequestEffect::Cancel { worker, key } if *worker == w("a/replica-0") && key.1 == first)
        ), "{effects:?}");
        assert!(
            effects
                .iter()
                .any(|e| matches!(e, RequestEffect::ReleasePlacement(key) if key.1 == first))
        );
        let moved = effects
            .iter()
            .find_map(|e| match e {
                RequestEffect::Submit { worker, job } if *worker == w("b/replica-0") => {
                    Some(job.request)
                }
                _ => None,
            })
            .expect("submitted to the new worker");
        assert_ne!(moved, first);
        c.submitted(true);
        assert_eq!(c.current(), Some((moved, &w("b/replica-0"))));
        // Once admitted it stays, whoever joins.
        c.event(
            moved,
            TokenEventKind::Admitted {
                worker: w("b/replica-0"),
                cached_tokens: 0,
            },
        );
        let _ = c.take_effects();
        c.worker_joined();
        assert!(c.take_effects().is_empty(), "its prefill began: it stays");
        // A move the router granted after the prefill began is taken back.
        let mut c = core(&clock, None);
        c.start();
        let first = place_on(&mut c, "a/replica-0");
        let _ = c.take_effects();
        c.worker_joined();
        let asked = match c.take_effects().as_slice() {
            [RequestEffect::Route(r)] => r.request,
            other => panic!("{other:?}"),
        };
        c.event(first, token(0));
        let _ = c.take_effects();
        c.picked(on("b/replica-0"));
        match c.take_effects().as_slice() {
            [RequestEffect::ReleasePlacement(key)] if key.1 == asked => {}
            other => panic!("only the granted move released: {other:?}"),
        }
        assert_eq!(c.current().map(|(id, _)| id), Some(first));
    }

    #[test]
    fn a_quiet_attempt_is_asked_and_moves_when_its_worker_forgot_it() {
        let clock = ManualClock::new();
        let mut c = core(&clock, None);
        c.start();
        let first = place_on(&mut c, "a/replica-0");
        let _ = c.take_effects();
        c.event(first, token(0));
        c.event(first, token(1));
        let _ = c.take_effects();
        clock.advance(Duration::from_millis(STALL_CHECK_MS - 1));
        c.check(first, true);
        assert!(c.take_effects().is_empty(), "not quiet long enough");
        clock.advance(Duration::from_millis(1));
        c.check(first, true);
        let effects = c.take_effects();
        assert!(
            matches!(effects.as_slice(), [RequestEffect::AskHas { worker, key }] if *worker == w("a/replica-0") && key.1 == first),
            "{effects:?}"
        );
        c.has_answer(first, false);
        let effects = c.take_effects();
        let route = effects.iter().find_map(|e| match e {
            RequestEffect::Route(r) => Some(r.clone()),
            _ => None,
        });
        let route = route.expect("placed again");
        assert_ne!(route.request, first, "a new attempt id");
        assert_eq!(
            route.prompt_tokens, 22,
            "the prompt plus the two tokens delivered"
        );
        assert!(effects.iter().any(
            |e| matches!(e, RequestEffect::Cancel { worker, .. } if *worker == w("a/replica-0"))
        ));
        assert!(
            effects
                .iter()
                .any(|e| matches!(e, RequestEffect::Unlisten(id) if *id == first))
        );
        // An answer about the old attempt changes nothing any more.
        c.has_answer(first, false);
        assert!(c.take_effects().is_empty());
    }

    #[test]
    fn a_hand_off_places_the_decode_attempt_with_the_kv_and_releases_it_at_the_end() {
        let clock = ManualClock::new();
        let mut c = core(&clock, None);
        c.start();
        let _ = c.take_effects();
        c.picked(Ok(Some(Placement {
            worker: w("p/replica-0"),
            hand_off: true,
            fetch: None,
            terms: None,
        })));
        let prefill = match c.take_effects().as_slice() {
            [RequestEffect::Submit { job, .. }] if job.hand_off => job.request,
            other => panic!("{other:?}"),
        };
        c.submitted(true);
        c.event(prefill, token(0));
        let kv = RemoteKv {
            worker: w("p/replica-0"),
            request: prefill,
            region: None,
            blocks: vec![1, 2, 3, 4, 5],
            tokens: 20,
            held_until_ms: clock.wall_ms() + 30_000,
        };
        c.event(prefill, TokenEventKind::HandOff(Box::new(kv.clone())));
        let effects = c.take_effects();
        let route = effects.iter().find_map(|e| match e {
            RequestEffect::Route(r) => Some(r.clone()),
            _ => None,
        });
        assert!(!route.expect("decode placement").remote_prefill);
        c.picked(on("d/replica-0"));
        let decode = match c.take_effects().as_slice() {
            [RequestEffect::Submit { job, .. }] => {
                assert_eq!(
                    job.remote_kv.as_ref(),
                    Some(&kv),
                    "the decode attempt pulls it"
                );
                job.request
            }
            other => panic!("{other:?}"),
        };
        c.submitted(true);
        c.event(
            decode,
            TokenEventKind::Token {
                id: 7,
                logprob: 0.0,
                finish: Some(crate::request_plane::protocol::FinishReason::Length),
                index: 0,
                top: Vec::new(),
            },
        );
        let effects = c.take_effects();
        assert!(
            effects.iter().any(|e| matches!(e, RequestEffect::Cancel { worker, key } if *worker == w("p/replica-0") && key.1 == prefill)),
            "the prefill worker is told to release its blocks: {effects:?}"
        );
        assert!(c.is_done());
        assert_eq!(c.generated(), &[500, 7]);
    }

    fn prompt(first: u32, n: u32) -> TokenEventKind {
        TokenEventKind::Prompt {
            first,
            logprobs: (first..first + n)
                .map(|p| (-(p as f32), Vec::new()))
                .collect(),
        }
    }

    fn delivered_prompt(effects: &[RequestEffect]) -> Vec<(u32, usize)> {
        effects
            .iter()
            .filter_map(|e| match e {
                RequestEffect::Deliver(TokenEventKind::Prompt { first, logprobs }) => {
                    Some((*first, logprobs.len()))
                }
                _ => None,
            })
            .collect()
    }

    /// Echo: each prompt position reaches the handler once, whatever attempt computed it. A
    /// migration after the prompt's logprobs were all passed on submits without echo (nothing
    /// is scored twice); one before resubmits with it, and the new attempt's repeats are
    /// dropped; a gap (events lost) migrates.
    #[test]
    fn prompt_logprobs_are_passed_on_once_across_attempts() {
        let clock = ManualClock::new();
        let mut c = core(&clock, None);
        c.cfg.job.sampling.echo_tokens = 20;
        c.start();
        let first = place_on(&mut c, "a/replica-0");
        c.event(first, prompt(1, 8));
        assert_eq!(delivered_prompt(&c.take_effects()), [(1, 8)]);
        // The worker is lost mid-prefill: the next attempt still scores the prompt.
        c.event(first, TokenEventKind::Lost { reason: "x".into() });
        let effects = c.take_effects();
        let job = effects.iter().find_map(|e| match e {
            RequestEffect::Route(_) => None,
            RequestEffect::Submit { job, .. } => Some(job.clone()),
            _ => None,
        });
        assert!(job.is_none(), "routed first: {effects:?}");
        c.picked(on("b/replica-0"));
        let (second, echo) = match c.take_effects().as_slice() {
            [RequestEffect::Submit { job, .. }] => (job.request, job.sampling.echo_tokens),
            other => panic!("{other:?}"),
        };
        c.submitted(true);
        assert_eq!(echo, 20, "positions 9.. are still owed");
        // It recomputes from position 1: the known positions are dropped, the rest passed on.
        c.event(second, prompt(1, 4));
        c.event(second, prompt(5, 8));
        c.event(second, prompt(13, 7));
        assert_eq!(delivered_prompt(&c.take_effects()), [(9, 4), (13, 7)]);
        c.event(second, token(0));
        // Lost after the first token: the prompt was all passed on, so no more echo.
        c.event(second, TokenEventKind::Lost { reason: "y".into() });
        let _ = c.take_effects();
        c.picked(on("c/replica-0"));
        match c.take_effects().as_slice() {
            [RequestEffect::Submit { job, .. }] => {
                assert_eq!(job.sampling.echo_tokens, 0);
                assert_eq!(job.prompt.len(), 21, "prompt + the token delivered");
            }
            other => panic!("{other:?}"),
        }
        // A gap in the positions, or a first token before the whole prompt: events were lost.
        for lossy in [
            vec![prompt(1, 3), prompt(6, 2)],
            vec![prompt(1, 3), token(0)],
        ] {
            let mut c = core(&clock, None);
            c.cfg.job.sampling.echo_tokens = 20;
            c.start();
            let id = place_on(&mut c, "a/replica-0");
            for ev in lossy {
                c.event(id, ev);
            }
            let effects = c.take_effects();
            assert!(
                effects
                    .iter()
                    .any(|e| matches!(e, RequestEffect::Fleet(FleetEventKind::Migrated { .. }))),
                "{effects:?}"
            );
            assert!(
                !effects
                    .iter()
                    .any(|e| matches!(e, RequestEffect::Deliver(TokenEventKind::Token { .. }))),
                "{effects:?}"
            );
        }
    }
}
