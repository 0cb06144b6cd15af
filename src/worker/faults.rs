//! [`WorkerFaults`]: the chaos faults aimed at this node's replicas, as the filter their
//! schedulers and engines read — the worker boundary's own type (as the transport's
//! [`TransferFaults`](crate::transport::TransferFaults) is the transport's). The node's
//! Chaos actor writes into it (`FaultFilters`, `actors/chaos.rs`); nothing here knows of the
//! fault book or the chaos API.
//!
//! Per replica, the faults in force by fault id: `slow` (a delay before each engine step,
//! summed over faults), `hang` (the engine answers nothing), `fail_engine` (the step fails once
//! `after` more steps have succeeded), `panic` (the scheduler panics once, on its next tick)
//! and `fill_kv` (the scheduler holds that fraction of its pool; the largest one counts).
//! One-shot parts are consumed here: a panic once taken, a hang ended by a restart.

use crate::runtime::ids::WorkerId;
use crate::worker::scheduler::InjectedFaults;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One fault's effect on one replica.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplicaFault {
    /// Delay every engine step by this much.
    Slow(Duration),
    /// The engine answers neither steps nor pings.
    Hang,
    /// The step fails once this many more steps have succeeded.
    FailAfter(u64),
    /// The scheduler panics on its next tick (once).
    Panic,
    /// The scheduler holds this fraction of its KV pool.
    FillKv(f64),
}

type Book = HashMap<WorkerId, HashMap<u64, ReplicaFault>>;

/// The faults aimed at this node's replicas (cheap to clone: one shared map).
#[derive(Clone, Default, Debug)]
pub struct WorkerFaults {
    inner: Arc<Mutex<Book>>,
}

impl WorkerFaults {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fault `id` acts on `worker` as `fault`.
    pub fn set(&self, id: u64, worker: &WorkerId, fault: ReplicaFault) {
        self.lock()
            .entry(worker.clone())
            .or_default()
            .insert(id, fault);
    }

    /// Fault `id` ends on every replica.
    pub fn clear(&self, id: u64) {
        let mut book = self.lock();
        for faults in book.values_mut() {
            faults.remove(&id);
        }
        book.retain(|_, f| !f.is_empty());
    }

    fn fold<T>(&self, worker: &WorkerId, init: T, f: impl Fn(T, &ReplicaFault) -> T) -> T {
        match self.lock().get(worker) {
            Some(faults) => faults.values().fold(init, f),
            None => init,
        }
    }

    /// Total delay before `worker`'s next step.
    pub fn step_delay(&self, worker: &WorkerId) -> Duration {
        self.fold(worker, Duration::ZERO, |d, f| match f {
            ReplicaFault::Slow(s) => d + *s,
            _ => d,
        })
    }

    /// Whether `worker`'s engine is hung.
    pub fn hangs(&self, worker: &WorkerId) -> bool {
        self.fold(worker, false, |h, f| h || *f == ReplicaFault::Hang)
    }

    /// The fraction of `worker`'s pool a `fill_kv` fault occupies, if any.
    pub fn fill_kv(&self, worker: &WorkerId) -> Option<f64> {
        self.fold(worker, None, |m: Option<f64>, f| match f {
            ReplicaFault::FillKv(x) => Some(m.map_or(*x, |m| m.max(*x))),
            _ => m,
        })
    }

    /// What `worker`'s scheduler needs to know now (see [`InjectedFaults`]).
    /// One lock per call: the scheduler reads this before every message.
    pub fn injected(&self, worker: &WorkerId) -> InjectedFaults {
        self.fold(worker, InjectedFaults::default(), |mut i, f| {
            match f {
                ReplicaFault::Slow(d) => i.step_delay += *d,
                ReplicaFault::Hang => i.hang = true,
                ReplicaFault::FillKv(x) => i.fill_kv = Some(i.fill_kv.map_or(*x, |m| m.max(*x))),
                ReplicaFault::FailAfter(_) | ReplicaFault::Panic => {}
            }
            i
        })
    }

    /// Whether `worker`'s scheduler must panic now (takes the panic: it happens once).
    pub fn take_panic(&self, worker: &WorkerId) -> bool {
        let mut book = self.lock();
        let Some(faults) = book.get_mut(worker) else {
            return false;
        };
        let before = faults.len();
        faults.retain(|_, f| *f != ReplicaFault::Panic);
        faults.len() != before
    }

    /// End every hang of `worker` (its replica restarts).
    pub fn end_hangs(&self, worker: &WorkerId) {
        if let Some(faults) = self.lock().get_mut(worker) {
            faults.retain(|_, f| *f != ReplicaFault::Hang);
        }
    }

    /// Whether `worker`'s next step must fail (counts each `fail_engine` down otherwise).
    pub fn step_fails(&self, worker: &WorkerId) -> bool {
        let mut book = self.lock();
        let Some(faults) = book.get_mut(worker) else {
            return false;
        };
        let mut fail = false;
        for f in faults.values_mut() {
            if let ReplicaFault::FailAfter(after) = f {
                if *after == 0 {
                    fail = true;
                } else {
                    *after -= 1;
                }
            }
        }
        fail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_act_per_replica_until_cleared_and_one_shots_are_consumed() {
        let (f, a, b) = (
            WorkerFaults::default(),
            WorkerId::new("n/a"),
            WorkerId::new("n/b"),
        );
        f.set(1, &a, ReplicaFault::Slow(Duration::from_millis(5)));
        f.set(2, &a, ReplicaFault::Slow(Duration::from_millis(7)));
        f.set(3, &b, ReplicaFault::FailAfter(1));
        f.set(4, &b, ReplicaFault::Panic);
        f.set(5, &a, ReplicaFault::FillKv(0.3));
        f.set(6, &a, ReplicaFault::FillKv(0.5));
        assert_eq!(f.step_delay(&a), Duration::from_millis(12));
        assert_eq!(f.step_delay(&b), Duration::ZERO);
        assert_eq!(f.fill_kv(&a), Some(0.5));
        assert!(!f.step_fails(&b), "one step still succeeds");
        assert!(f.step_fails(&b));
        assert!(!f.step_fails(&a));
        assert!(f.take_panic(&b));
        assert!(!f.take_panic(&b), "a panic happens once");
        f.set(7, &a, ReplicaFault::Hang);
        assert!(f.hangs(&a) && !f.hangs(&b));
        f.end_hangs(&a);
        assert!(!f.hangs(&a));
        f.clear(1);
        assert_eq!(f.step_delay(&a), Duration::from_millis(7));
        f.clear(2);
        f.clear(5);
        f.clear(6);
        assert_eq!(f.injected(&a), InjectedFaults::default());
    }
}
