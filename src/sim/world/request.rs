//! A request's life in the simulated fleet, from a client's send to its record: sessions and
//! their turns, the gateway's admission on the published view, the wait for capacity when a
//! pool scales from zero, the request core's effects (placement on a router, submission,
//! cancellation, hand-off checks) and what the client sees of its token events.

use std::time::Duration;

use crate::control::planner::PlannerMode;
use crate::request_plane::admission::{AdmissionVerdict, waits_for_capacity};
use crate::request_plane::error::{RequestError, ShedReason};
use crate::request_plane::protocol::{SubmitRequest, TokenEventKind};
use crate::request_plane::request::{RequestCore, RequestCoreConfig, RequestEffect};
use crate::runtime::clock::{Clock, Instant};
use crate::runtime::ids::{NodeId, RequestId};

use super::{Arrivals, Ev, GATEWAY, SimFleet, SimRecord, SimTurn, ms};

/// A request admitted while no worker served the model and a planner acts: it waits at the
/// gateway for one to start (`waits_for_capacity`), as the live gateway's request does.
pub(super) struct CapacityWaiter {
    session: usize,
    turn: usize,
    since: Instant,
    prompt: SimTurn,
    record: SimRecord,
}

pub(super) struct SimRequest {
    pub(super) core: RequestCore,
    pub(super) sent: Instant,
    last_chunk: Option<Instant>,
    pub(super) record: SimRecord,
    finished: bool,
    queued: bool,
}

impl<'w> SimFleet<'w> {
    pub(super) fn start_next_session(&mut self) {
        if self.next_session < self.workload.sessions() {
            let i = self.next_session;
            self.next_session += 1;
            self.schedule_in(Duration::ZERO, Ev::Turn(i, 0));
        }
    }

    /// A client sends turn `k` of session `i`: admission on the published view, then the
    /// request core places it.
    pub(super) fn start_turn(&mut self, i: usize, k: usize) {
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
    pub(super) fn capacity_check(&mut self) {
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

    pub(super) fn mark_request(&mut self, rid: RequestId) {
        if let Some(r) = self.requests.get_mut(&rid)
            && !r.queued
        {
            r.queued = true;
            self.request_queue.push_back(rid);
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

    pub(super) fn drive_request(&mut self, rid: RequestId) {
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
}
