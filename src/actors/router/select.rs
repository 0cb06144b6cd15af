//! Worker selection, first version: least outstanding requests, round-robin among equals.
//!
//! Plain code: the caller passes the live workers; the selector keeps the outstanding count
//! per worker (incremented on placement, decremented on release) and a rotating cursor that
//! breaks ties, so equal workers take turns. The KV-aware selector replaces the cost, keeping
//! this interface.

use crate::ids::{RequestId, WorkerId};
use std::collections::{BTreeMap, HashMap};

/// A placement the selector remembers until it is released.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Lease {
    worker: WorkerId,
    placed_at_ms: u64,
}

/// Least-outstanding selector with round-robin tie-break.
#[derive(Debug, Default)]
pub struct LeastLoaded {
    outstanding: BTreeMap<WorkerId, u32>,
    leases: HashMap<(String, RequestId), Lease>,
    cursor: u64,
}

impl LeastLoaded {
    /// A selector with no placements.
    pub fn new() -> Self {
        Self::default()
    }

    /// Pick one of `live` (in any order) for the request `key`, or `None` if `live` is empty.
    /// `now_ms` dates the placement for [`LeastLoaded::expire`].
    pub fn place(
        &mut self,
        key: (String, RequestId),
        live: &[WorkerId],
        now_ms: u64,
    ) -> Option<WorkerId> {
        if let Some(l) = self.leases.get(&key) {
            if live.contains(&l.worker) {
                return Some(l.worker.clone());
            }
            self.release(&key);
        }
        let mut sorted: Vec<&WorkerId> = live.iter().collect();
        sorted.sort();
        sorted.dedup();
        let load = |w: &WorkerId| self.outstanding.get(w).copied().unwrap_or(0);
        let min = sorted.iter().map(|w| load(w)).min()?;
        let ties: Vec<&WorkerId> = sorted.into_iter().filter(|w| load(w) == min).collect();
        let pick = ties[(self.cursor % ties.len() as u64) as usize].clone();
        self.cursor = self.cursor.wrapping_add(1);
        *self.outstanding.entry(pick.clone()).or_default() += 1;
        self.leases.insert(
            key,
            Lease {
                worker: pick.clone(),
                placed_at_ms: now_ms,
            },
        );
        Some(pick)
    }

    /// The request `key` ended; unknown keys are ignored.
    pub fn release(&mut self, key: &(String, RequestId)) {
        if let Some(l) = self.leases.remove(key)
            && let Some(n) = self.outstanding.get_mut(&l.worker)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.outstanding.remove(&l.worker);
            }
        }
    }

    /// Forget every placement on `worker` (it died).
    pub fn remove_worker(&mut self, worker: &WorkerId) {
        self.outstanding.remove(worker);
        self.leases.retain(|_, l| l.worker != *worker);
    }

    /// Release placements older than `ttl_ms` (requests never heard from again).
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> usize {
        let old: Vec<_> = self
            .leases
            .iter()
            .filter(|(_, l)| now_ms.saturating_sub(l.placed_at_ms) > ttl_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &old {
            self.release(k);
        }
        old.len()
    }

    /// Outstanding requests on `worker`.
    pub fn outstanding(&self, worker: &WorkerId) -> u32 {
        self.outstanding.get(worker).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: &str) -> WorkerId {
        WorkerId::new(s)
    }
    fn k(n: u64) -> (String, RequestId) {
        ("gw".into(), RequestId(n))
    }

    #[test]
    fn equals_take_turns_and_load_wins() {
        let mut s = LeastLoaded::new();
        let live = [w("b"), w("a")];
        let picks: Vec<_> = (0..4).map(|i| s.place(k(i), &live, 0).unwrap()).collect();
        assert_eq!(picks, [w("a"), w("b"), w("a"), w("b")]);
        s.release(&k(0));
        s.release(&k(2));
        assert_eq!(
            s.place(k(9), &live, 0),
            Some(w("a")),
            "a has less outstanding"
        );
    }

    #[test]
    fn release_is_idempotent_and_dead_workers_are_forgotten() {
        let mut s = LeastLoaded::new();
        let live = [w("a")];
        s.place(k(1), &live, 0);
        s.release(&k(1));
        s.release(&k(1));
        assert_eq!(s.outstanding(&w("a")), 0);
        s.place(k(2), &live, 0);
        s.remove_worker(&w("a"));
        assert_eq!(s.outstanding(&w("a")), 0);
        assert_eq!(s.place(k(3), &[], 0), None);
    }

    #[test]
    fn replacing_a_request_keeps_its_worker_while_it_lives() {
        let mut s = LeastLoaded::new();
        let first = s.place(k(1), &[w("a"), w("b")], 0).unwrap();
        assert_eq!(s.place(k(1), &[w("a"), w("b")], 0).unwrap(), first);
        assert_eq!(s.outstanding(&first), 1);
        let other = if first == w("a") { w("b") } else { w("a") };
        assert_eq!(
            s.place(k(1), std::slice::from_ref(&other), 0),
            Some(other.clone()),
            "moved off a dead worker"
        );
        assert_eq!(s.outstanding(&first), 0);
    }

    #[test]
    fn stale_placements_expire() {
        let mut s = LeastLoaded::new();
        s.place(k(1), &[w("a")], 0);
        s.place(k(2), &[w("a")], 500);
        assert_eq!(s.expire(1_000, 600), 1);
        assert_eq!(s.outstanding(&w("a")), 1);
    }
}
