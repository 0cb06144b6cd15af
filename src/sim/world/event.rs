//! The event queue and the clock: every event of a run waits in one heap ordered by (time,
//! sequence number), so two runs with the same inputs handle them in the same order; the loop
//! advances the [`ManualClock`](crate::runtime::clock::ManualClock) to each event, hands it to
//! the part of the fleet it is for, then carries out every effect (no time passes between).

use std::cmp::Ordering;
use std::time::Duration;

use crate::kv::{CopyId, CopyOutcome, KvEvent};
use crate::request_plane::events::FleetEventKind;
use crate::request_plane::protocol::{OwnerStatus, RemoteKv, TokenEvent};
use crate::runtime::clock::{Clock, Instant};
use crate::runtime::ids::RequestId;
use crate::worker::scheduler::{PullResult, RequestKey, StepResult};

use super::{Phase, SimFleet, SimOutcome, ms};

pub(super) enum Ev {
    Turn(usize, usize),
    StepDone(usize, u32, StepResult),
    /// A pull of worker `i` (incarnation) returned; the worker it read from (index,
    /// incarnation at the pull's start) must still be there for its blocks to be valid.
    PullDone(usize, u32, PullResult, Option<(usize, u32)>),
    /// A peer pull's holder answered worker `i` (incarnation).
    FetchDone(usize, u32, RequestKey, Box<Result<RemoteKv, String>>),
    CopiesDone(usize, u32, Vec<(CopyId, CopyOutcome)>),
    Retry(RequestId),
    Tick(usize, u32),
    /// Worker `i`'s (incarnation) gather window for migrated requests ended.
    Kick(usize, u32),
    KvEvents(Vec<KvEvent>),
    Tokens(Vec<TokenEvent>),
    Kill(usize),
    Restart(usize),
    DropKv(bool),
    /// Set worker `.0`'s engine delay before each step (chaos `slow`).
    Slow(usize, Duration),
    /// Start or end a hang of worker `.0`'s engine.
    Hang(usize, bool),
    /// The planner's interval.
    Plan,
    /// Requests waiting for a worker to start (scale from zero) look at the view again.
    CapacityCheck,
    /// Worker `.0`'s cold start (asked for in generation `.1`) is over: it boots.
    Ready(usize, u32),
    /// Router `.1`'s load changes reach router `.0`.
    LoadSync(
        usize,
        usize,
        Vec<crate::request_plane::router::sync::LoadChange>,
    ),
}

pub(super) struct Scheduled {
    at: Instant,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    // A max-heap: the earliest (then the first scheduled) comes out first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

impl<'w> SimFleet<'w> {
    /// Run until nothing is left to happen; the outcome.
    pub fn run(mut self) -> SimOutcome {
        while let Some(Scheduled { at, ev, .. }) = self.heap.pop() {
            let now = self.clock.now();
            if at > now {
                self.clock.advance(at - now);
            }
            self.out.counters.events += 1;
            self.handle(ev);
            self.pump();
        }
        self.finish()
    }

    pub(super) fn now(&self) -> Instant {
        self.clock.now()
    }

    pub(super) fn since_start_ms(&self) -> f64 {
        ms(self.now() - self.start)
    }

    pub(super) fn schedule_in(&mut self, after: Duration, ev: Ev) {
        let at = self.now() + after;
        self.schedule_at(at, ev);
    }

    pub(super) fn schedule_at(&mut self, at: Instant, ev: Ev) {
        self.seq += 1;
        self.heap.push(Scheduled {
            at,
            seq: self.seq,
            ev,
        });
    }

    /// Carry out every effect until none is left (no time passes).
    pub(super) fn pump(&mut self) {
        loop {
            if let Some(rid) = self.request_queue.pop_front() {
                self.drive_request(rid);
            } else if let Some(i) = self.worker_queue.pop_front() {
                self.drive_worker(i);
            } else {
                return;
            }
        }
    }

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Turn(i, k) => self.start_turn(i, k),
            Ev::StepDone(i, inc, result) => {
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.step_done(result, || None);
                    self.worker_result(i, r);
                }
            }
            Ev::PullDone(i, inc, mut result, from) => {
                // A pull whose source died or restarted meanwhile read freed memory: it fails
                // (the live transport's read fails against a gone region).
                if let (Some((p, pinc)), Ok(_)) = (from, &result.outcome)
                    && (self.workers[p].incarnation != pinc || self.workers[p].core.is_none())
                {
                    result.outcome = Err("the worker it read from left during the pull".into());
                }
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.pull_done(result);
                    self.worker_result(i, r);
                }
            }
            Ev::FetchDone(i, inc, key, answer) => {
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.fetch_done(&key, *answer);
                    self.worker_result(i, r);
                }
            }
            Ev::CopiesDone(i, inc, results) => {
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.copies_done(&results);
                    self.worker_result(i, r);
                }
            }
            Ev::Tick(i, inc) => {
                self.workers[i].ticking = false;
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.tick(|_| OwnerStatus::Present);
                    self.worker_result(i, r);
                }
            }
            Ev::Kick(i, inc) => {
                if let Some(core) = self.live_core(i, inc) {
                    let r = core.kick_due();
                    self.worker_result(i, r);
                }
            }
            Ev::Retry(rid) => {
                if let Some(r) = self.requests.get_mut(&rid) {
                    r.core.retry();
                    self.mark_request(rid);
                }
            }
            Ev::KvEvents(events) => {
                if let Some((last, rest)) = self.routers.split_last_mut() {
                    for r in rest {
                        r.kv_events(events.clone());
                    }
                    last.kv_events(events);
                }
            }
            Ev::LoadSync(to, from, changes) => {
                self.routers[to].peer_load(&format!("sim-router-{from}"), changes);
            }
            Ev::Tokens(events) => {
                for ev in events {
                    if let Some(rid) = self.listening.get(&ev.request).copied()
                        && let Some(r) = self.requests.get_mut(&rid)
                    {
                        r.core.event(ev.request, ev.kind);
                        self.mark_request(rid);
                    }
                }
            }
            Ev::Kill(i) => self.kill(i),
            Ev::Restart(i) => {
                if self.workers[i].core.is_none()
                    && self.workers[i].phase == Phase::Running
                    && self.boot(i).is_ok()
                {
                    self.out.counters.restarts += 1;
                    let id = self.workers[i].id.clone();
                    self.fleet_event(FleetEventKind::WorkerUp { worker: id });
                }
            }
            Ev::DropKv(on) => self.drop_kv = on,
            Ev::Slow(i, delay) => {
                self.workers[i].faults.step_delay = delay;
                self.apply_faults(i);
            }
            Ev::Hang(i, on) => {
                self.workers[i].faults.hang = on;
                self.apply_faults(i);
                if !on {
                    self.unpark(i);
                }
            }
            Ev::Plan => self.plan_interval(),
            Ev::CapacityCheck => self.capacity_check(),
            Ev::Ready(i, generation) => {
                let w = &self.workers[i];
                if w.phase == Phase::Starting && w.generation == generation {
                    self.workers[i].phase = Phase::Running;
                    if self.boot(i).is_ok() {
                        let id = self.workers[i].id.clone();
                        self.fleet_event(FleetEventKind::WorkerUp { worker: id });
                    }
                }
            }
        }
    }
}
