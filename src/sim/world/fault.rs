//! The faults a run is given ([`SimFault`], at their times; `sim/faults.rs` draws them at
//! rates) and what each does to the fleet: a kill takes a worker down (it restarts after
//! `restart_delay`), a slow or hung engine is set on the worker core as the chaos filters set
//! it, and a hang's parked step and canary go on when it ends.

use std::time::Duration;

use crate::control::discovery::membership::NodeState;
use crate::request_plane::events::FleetEventKind;
use crate::runtime::ids::RequestId;

use super::{Ev, Phase, SimFleet};

/// A fault at a given time.
#[derive(Clone, Debug, PartialEq)]
pub enum SimFault {
    /// Worker `worker` (index) is killed at `at` (its replica restarts after the spec's
    /// `restart_delay`).
    Kill { at: Duration, worker: usize },
    /// KV events from every worker are dropped between `from` and `until`.
    DropKvEvents { from: Duration, until: Duration },
    /// Worker `worker`'s engine waits `delay` before each step between `from` and `until`
    /// (chaos `slow`: not engine time, the step-time model does not learn from it).
    Slow {
        from: Duration,
        until: Duration,
        worker: usize,
        delay: Duration,
    },
    /// Worker `worker`'s engine does not answer between `from` and `until` (chaos `hang`):
    /// its step and canary wait; past `worker.step_timeout_ms` the watchdog takes the replica
    /// down and it restarts.
    Hang {
        from: Duration,
        until: Duration,
        worker: usize,
    },
}

/// What a run's summary says of a fault: `kill worker 2 (sim-2/replica-0) at 3.0 s`. Workers
/// are numbered from 0 (aggregated, then prefill, then decode); worker `i` is `sim-i/replica-0`
/// in the run's records.
impl std::fmt::Display for SimFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = |d: &Duration| d.as_secs_f64();
        match self {
            SimFault::Kill { at, worker } => write!(
                f,
                "kill worker {worker} (sim-{worker}/replica-0) at {:.1} s",
                s(at)
            ),
            SimFault::DropKvEvents { from, until } => write!(
                f,
                "drop every worker's KV events from {:.1} s to {:.1} s",
                s(from),
                s(until)
            ),
            SimFault::Slow {
                from,
                until,
                worker,
                delay,
            } => write!(
                f,
                "slow worker {worker} (sim-{worker}/replica-0) by {} ms a step from {:.1} s to \
                 {:.1} s",
                delay.as_millis(),
                s(from),
                s(until)
            ),
            SimFault::Hang {
                from,
                until,
                worker,
            } => write!(
                f,
                "hang worker {worker} (sim-{worker}/replica-0) from {:.1} s to {:.1} s",
                s(from),
                s(until)
            ),
        }
    }
}

impl SimFault {
    /// The worker a fault names, if it names one.
    pub fn worker(&self) -> Option<usize> {
        match self {
            SimFault::Kill { worker, .. }
            | SimFault::Slow { worker, .. }
            | SimFault::Hang { worker, .. } => Some(*worker),
            SimFault::DropKvEvents { .. } => None,
        }
    }
}

impl<'w> SimFleet<'w> {
    pub(super) fn check_worker(&self, worker: usize, flag: &str) -> anyhow::Result<()> {
        let n = self.spec.total_workers();
        anyhow::ensure!(
            worker < n,
            "{flag} …:{worker}: the fleet has {} workers (0 to {}: aggregated, then prefill, \
             then decode)",
            n,
            n.saturating_sub(1)
        );
        Ok(())
    }

    /// Worker `i` dies: it leaves every group at once (the Requests' group monitor hears
    /// it), its steps never come back; it restarts after `restart_delay`.
    pub(super) fn kill(&mut self, i: usize) {
        if self.workers[i].core.take().is_none() {
            return;
        }
        if self.workers[i].phase == Phase::Draining {
            // A draining replica that dies is not restarted: it was leaving.
            self.workers[i].phase = Phase::Off;
            let now = self.now();
            self.account(i, now);
        }
        self.workers[i].parked = None;
        self.workers[i].ping_parked = false;
        self.out.counters.kills += 1;
        let id = self.workers[i].id.clone();
        self.groups.leave_all(&id);
        for r in &mut self.routers {
            r.worker_left(&id);
        }
        self.views[i].state = NodeState::Down;
        self.fleet_event(FleetEventKind::WorkerDown { worker: id.clone() });
        let mut lost: Vec<(RequestId, RequestId)> = self
            .requests
            .iter()
            .filter_map(|(rid, r)| {
                r.core
                    .current()
                    .filter(|(_, w)| **w == id)
                    .map(|(a, _)| (*rid, a))
            })
            .collect();
        lost.sort();
        for (rid, attempt) in lost {
            if let Some(r) = self.requests.get_mut(&rid) {
                r.core.worker_lost(attempt);
            }
            self.mark_request(rid);
        }
        if let Some(d) = self.spec.restart_delay
            && self.workers[i].phase == Phase::Running
        {
            self.schedule_in(d, Ev::Restart(i));
        }
    }

    /// Worker `i`'s core reads its faults (as the live scheduler reads its node's filters
    /// before each input).
    pub(super) fn apply_faults(&mut self, i: usize) {
        let faults = self.workers[i].faults;
        if let Some(core) = self.workers[i].core.as_mut() {
            core.set_faults(faults);
        }
        self.mark_worker(i);
    }

    /// A hang ended: the parked step runs, the parked canary answers.
    pub(super) fn unpark(&mut self, i: usize) {
        if let Some((step, batch)) = self.workers[i].parked.take() {
            self.run_step(i, step, batch);
        }
        if std::mem::take(&mut self.workers[i].ping_parked)
            && let Some(core) = self.workers[i].core.as_mut()
        {
            core.canary_done();
            self.mark_worker(i);
        }
    }
}
