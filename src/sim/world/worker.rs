//! A worker slot's life in the simulated fleet: its state (`SimWorker`, `Phase`), boot
//! and restart over a fresh pool, its engine's steps priced by the sim model, its core's
//! effects carried out (pulls, peer fetches, tier copies, KV events, groups, the canary), its
//! tick, and retirement when it drains or is called off.

use std::time::Duration;

use crate::control::discovery::membership::NodeState;
use crate::kv::{BlockPool, CopyOutcome};
use crate::request_plane::events::FleetEventKind;
use crate::request_plane::protocol::{OwnerStatus, TokenEvent};
use crate::runtime::clock::{Clock, Instant};
use crate::runtime::ids::WorkerId;
use crate::runtime::role::Role;
use crate::worker::engine::StepBatch;
use crate::worker::engine::sim;
use crate::worker::scheduler::{
    InjectedFaults, PullResult, PullWork, SchedulerCore, StepResult, WorkerCore, WorkerCoreConfig,
    WorkerEffect,
};

use super::{Ev, SimFleet};

/// Where a worker slot is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Not part of the fleet (a spare slot the planner may start).
    Off,
    /// Asked for, not taking requests yet (cold start).
    Starting,
    /// Serving (or down and restarting after a fault).
    Running,
    /// Leaving: no new work, finishing what it runs.
    Draining,
}

pub(super) struct SimWorker {
    pub(super) id: WorkerId,
    pub(super) role: Role,
    pub(super) core: Option<WorkerCore>,
    /// Bumped at every restart: a step of an earlier incarnation is dropped.
    pub(super) incarnation: u32,
    pub(super) ticking: bool,
    pub(super) queued: bool,
    pub(super) view_dirty: bool,
    /// The chaos faults aimed at this worker's engine (they outlive a restart, as the node's
    /// filters do).
    pub(super) faults: InjectedFaults,
    /// A step that reached a hung engine: it runs when the hang ends.
    pub(super) parked: Option<(u64, StepBatch)>,
    /// A canary ping that reached a hung engine: answered when the hang ends.
    pub(super) ping_parked: bool,
    pub(super) phase: Phase,
    /// Since when it costs (asked for), while not `Off`.
    pub(super) on_since: Option<Instant>,
    /// Bumped each time the slot is asked for: a cold start of an earlier request is dropped.
    pub(super) generation: u32,
    /// When its KV tier copy lanes are free again (store: offloads and demotions; load:
    /// onboards): each lane carries out one copy at a time.
    pub(super) store_lane: Instant,
    pub(super) load_lane: Instant,
}

impl<'w> SimFleet<'w> {
    /// Start (or restart) worker `i`: a fresh core over an empty pool, joining its groups.
    pub(super) fn boot(&mut self, i: usize) -> anyhow::Result<()> {
        // A new incarnation starts with an empty pool: the router forgets the old one's
        // blocks (and any of its KV events that arrived after it died).
        let id = self.workers[i].id.clone();
        for r in &mut self.routers {
            r.worker_left(&id);
        }
        let w = &mut self.workers[i];
        w.incarnation += 1;
        let pool = BlockPool::new(self.blocks, self.engine.block_size, self.spec.model.salt)
            .and_then(|p| p.with_tiers(self.tiers))
            .map_err(|e| anyhow::anyhow!("configuration: worker.kv_blocks: {e}"))?
            .with_worker(w.id.clone());
        let now = self.clock.now();
        (w.store_lane, w.load_lane) = (now, now);
        let batcher = SchedulerCore::new(self.scheduler, pool)
            .map_err(|e| anyhow::anyhow!("configuration: worker: {e}"))?;
        let cfg = WorkerCoreConfig {
            worker: w.id.clone(),
            role: w.role,
            ..self.core_config.clone()
        };
        let mut core = WorkerCore::new(cfg, batcher, self.shared.clone());
        core.set_faults(w.faults);
        w.core = Some(core);
        w.ticking = false;
        w.view_dirty = true;
        self.views[i].state = NodeState::Up;
        self.mark_worker(i);
        Ok(())
    }

    pub(super) fn mark_worker(&mut self, i: usize) {
        let w = &mut self.workers[i];
        w.view_dirty = true;
        if !w.queued {
            w.queued = true;
            self.worker_queue.push_back(i);
        }
    }

    /// Worker `i`'s core, if it is up in incarnation `inc`.
    pub(super) fn live_core(&mut self, i: usize, inc: u32) -> Option<&mut WorkerCore> {
        let w = &mut self.workers[i];
        if w.incarnation != inc {
            return None;
        }
        w.core.as_mut()
    }

    /// After an input to worker `i`: an error (a hung engine, a broken invariant) takes the
    /// replica down as the live supervisor would, and it restarts.
    pub(super) fn worker_result<E: std::fmt::Display>(&mut self, i: usize, r: Result<(), E>) {
        self.mark_worker(i);
        if let Err(e) = r {
            tracing::warn!(worker = %self.workers[i].id, error = %e, "simulated replica failed; restarting it");
            self.kill(i);
        }
    }

    /// Worker `i`'s engine runs a step: the chaos `slow` delay, then the model's time; a hung
    /// engine keeps it until the hang ends.
    pub(super) fn run_step(&mut self, i: usize, step: u64, batch: StepBatch) {
        let w = &mut self.workers[i];
        if w.faults.hang {
            w.parked = Some((step, batch));
            return;
        }
        let inc = w.incarnation;
        let delay = w.faults.step_delay;
        self.out.counters.steps += 1;
        let (time, output) = sim::model_step(&self.engine, &batch);
        let result = StepResult {
            step,
            output: Ok(output),
        };
        self.schedule_in(delay + time, Ev::StepDone(i, inc, result));
    }

    /// A worker with work ticks every `tick_period`, as the live scheduler does.
    pub(super) fn ensure_ticking(&mut self, i: usize) {
        let w = &mut self.workers[i];
        if w.ticking || w.core.is_none() {
            return;
        }
        w.ticking = true;
        let inc = w.incarnation;
        self.schedule_in(self.tick_period, Ev::Tick(i, inc));
    }

    pub(super) fn drive_worker(&mut self, i: usize) {
        self.workers[i].queued = false;
        loop {
            let Some(core) = self.workers[i].core.as_mut() else {
                return;
            };
            let effects = core.take_effects();
            let mut out: Vec<TokenEvent> = Vec::new();
            let undelivered = core.has_undelivered();
            if effects.is_empty() && !undelivered {
                break;
            }
            for e in effects {
                self.worker_effect(i, e);
            }
            if let Some(core) = self.workers[i].core.as_mut()
                && core.has_undelivered()
            {
                core.flush(
                    |_, events| {
                        out.extend(events);
                        Ok(())
                    },
                    |_| OwnerStatus::Present,
                );
            }
            if !out.is_empty() {
                self.schedule_in(self.spec.net_delay, Ev::Tokens(out));
            }
        }
        let busy = self.workers[i].core.as_ref().is_some_and(|c| !c.is_idle());
        if busy {
            self.ensure_ticking(i);
        } else if self.workers[i].phase == Phase::Draining && self.workers[i].core.is_some() {
            self.retire(i);
        }
    }

    fn worker_effect(&mut self, i: usize, effect: WorkerEffect) {
        let inc = self.workers[i].incarnation;
        let id = self.workers[i].id.clone();
        match effect {
            WorkerEffect::Step { step, batch } => self.run_step(i, step, batch),
            WorkerEffect::Pull(job) => {
                let result = |outcome| PullResult {
                    seq: job.seq,
                    outcome,
                    bytes: 0,
                };
                let from = job.from.as_ref().and_then(|w| self.index.get(w).copied());
                let from = from.map(|p| (p, self.workers[p].incarnation));
                match &job.work {
                    work @ PullWork::Sim { .. } => {
                        if let Some((time, outcome)) = work.simulated(job.blocks) {
                            let r = result(outcome);
                            self.schedule_in(time, Ev::PullDone(i, inc, r, from));
                        }
                    }
                    PullWork::Fail(why) => {
                        let r = result(Err(why.clone()));
                        self.schedule_in(Duration::ZERO, Ev::PullDone(i, inc, r, from));
                    }
                    PullWork::Transport { .. } => {
                        let r = result(Err("no transport in the simulator".into()));
                        self.schedule_in(Duration::ZERO, Ev::PullDone(i, inc, r, from));
                    }
                }
            }
            WorkerEffect::Fetch {
                holder,
                key,
                tokens,
                ..
            } => {
                // The ask and its answer each cross the network once.
                let answer = match self.index.get(&holder).copied() {
                    Some(p) => match self.workers[p].core.as_mut() {
                        Some(core) => core.export(key.clone(), &tokens, None),
                        None => Err(format!("the holder {holder} is down")),
                    },
                    None => Err(format!("the holder {holder} is gone")),
                };
                self.schedule_in(
                    2 * self.spec.net_delay,
                    Ev::FetchDone(i, inc, key, Box::new(answer)),
                );
            }
            WorkerEffect::TierCopies(copies) => {
                // Each lane carries out its copies one after another, after what it has queued;
                // a batch lands at once when its last copy ends.
                let (store, load): (Vec<_>, Vec<_>) =
                    copies.into_iter().partition(|c| c.is_store());
                let now = self.now();
                for (lane, batch) in [(true, store), (false, load)] {
                    if batch.is_empty() {
                        continue;
                    }
                    let took = self.tier_links.time(&batch, self.engine.block_size);
                    let w = &mut self.workers[i];
                    let free = if lane {
                        &mut w.store_lane
                    } else {
                        &mut w.load_lane
                    };
                    let end = (*free).max(now) + took;
                    *free = end;
                    let results = batch.iter().map(|c| (c.id, CopyOutcome::Done)).collect();
                    self.schedule_at(end, Ev::CopiesDone(i, inc, results));
                }
            }
            WorkerEffect::Release(_) => {}
            WorkerEffect::ConfirmPull { prefill, key } => {
                if let Some(p) = self.index.get(&prefill).copied()
                    && let Some(core) = self.workers[p].core.as_mut()
                {
                    let r = core.cancel(&key);
                    self.worker_result(p, r);
                }
            }
            WorkerEffect::KvEvents { events, .. } => {
                if self.drop_kv {
                    self.out.counters.kv_batches_dropped += 1;
                } else {
                    self.schedule_in(self.spec.kv_event_delay, Ev::KvEvents(events));
                }
            }
            WorkerEffect::Join(group) => self.groups.join(group, &id),
            WorkerEffect::Leave(group) => self.groups.leave(group, &id),
            WorkerEffect::RoleChanged(role) => {
                self.fleet_event(FleetEventKind::RoleChanged { worker: id, role })
            }
            WorkerEffect::KickAt(at) => self.schedule_at(at, Ev::Kick(i, inc)),
            WorkerEffect::Ping => {
                if self.workers[i].faults.hang {
                    self.workers[i].ping_parked = true;
                } else if let Some(core) = self.workers[i].core.as_mut() {
                    core.canary_done();
                }
            }
        }
    }

    /// Worker `i` leaves the fleet (a drained replica with nothing left, or one called off).
    pub(super) fn retire(&mut self, i: usize) {
        let now = self.now();
        let had_core = self.workers[i].core.take().is_some();
        let w = &mut self.workers[i];
        w.phase = Phase::Off;
        w.parked = None;
        w.ping_parked = false;
        let id = w.id.clone();
        self.groups.leave_all(&id);
        for r in &mut self.routers {
            r.worker_left(&id);
        }
        self.views[i].state = NodeState::Down;
        self.account(i, now);
        if had_core {
            self.fleet_event(FleetEventKind::WorkerDown { worker: id });
        }
    }
}
