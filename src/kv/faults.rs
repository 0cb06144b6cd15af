//! [`KvEventFaults`]: the chaos `drop_kv_events` faults aimed at this node's replicas, as the
//! filter their KV event publishers read — the KV event boundary's own type. The node's Chaos
//! actor writes into it (`FaultFilters`, `actors/chaos.rs`).
//!
//! Each fault drops a fraction of a replica's events on their way to the routers; the largest
//! rate in force counts. Drops are drawn from one generator seeded by the latest fault's seed,
//! so a run with the same seed drops the same events.

use crate::runtime::ids::WorkerId;
use rand::SeedableRng;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
struct State {
    /// Worker → fault id → rate.
    rates: HashMap<WorkerId, HashMap<u64, f64>>,
    rng: Option<rand::rngs::StdRng>,
}

/// The `drop_kv_events` faults of this node (cheap to clone: one shared state).
#[derive(Clone, Default, Debug)]
pub struct KvEventFaults {
    inner: Arc<Mutex<State>>,
}

impl KvEventFaults {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fault `id` drops `rate` of `worker`'s events; `seed` reseeds the draws.
    pub fn set(&self, id: u64, worker: &WorkerId, rate: f64, seed: u64) {
        let mut s = self.lock();
        s.rng = Some(rand::rngs::StdRng::seed_from_u64(seed));
        s.rates.entry(worker.clone()).or_default().insert(id, rate);
    }

    /// Fault `id` ends.
    pub fn clear(&self, id: u64) {
        let mut s = self.lock();
        for r in s.rates.values_mut() {
            r.remove(&id);
        }
        s.rates.retain(|_, r| !r.is_empty());
    }

    /// Whether `worker`'s next KV event is dropped.
    pub fn drop_event(&self, worker: &WorkerId) -> bool {
        let mut s = self.lock();
        let rate = s
            .rates
            .get(worker)
            .map_or(0.0, |r| r.values().copied().fold(0.0, f64::max));
        if rate <= 0.0 {
            return false;
        }
        let rng = s
            .rng
            .get_or_insert_with(|| rand::rngs::StdRng::seed_from_u64(0));
        rand::Rng::random_bool(rng, rate.min(1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drop_fault_hits_its_worker_until_cleared() {
        let (f, a, b) = (
            KvEventFaults::default(),
            WorkerId::new("n/a"),
            WorkerId::new("n/b"),
        );
        f.set(1, &a, 1.0, 7);
        assert!(f.drop_event(&a));
        assert!(!f.drop_event(&b));
        f.clear(1);
        assert!(!f.drop_event(&a));
        f.set(2, &a, 0.5, 7);
        let first: Vec<bool> = (0..64).map(|_| f.drop_event(&a)).collect();
        f.set(3, &a, 0.5, 7);
        let again: Vec<bool> = (0..64).map(|_| f.drop_event(&a)).collect();
        assert_eq!(first, again, "the same seed drops the same events");
        assert!(first.iter().any(|d| *d) && first.iter().any(|d| !*d));
    }
}
