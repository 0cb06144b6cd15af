//! [`SessionTable`]: which worker served each session's last turn (the router's session
//! affinity; `policy.rs`, "Sessions that stick").
//!
//! ```text
//! entry(session) = (worker that served its last turn, when it was last placed: ms on the router's clock)
//! ```
//!
//! **Bounded.** At most `capacity` sessions (`router.session_capacity`, default
//! [`DEFAULT_SESSION_CAPACITY`]); placing a new session when full evicts the least recently
//! placed one (LRU). An entry not placed for `ttl_ms` (`router.session_ttl_ms`, default
//! [`DEFAULT_SESSION_TTL_MS`]) is dropped: by then its worker's cache has most likely evicted
//! the history, and the KV cost finds whatever is left. A key is at most
//! `gateway`'s bound (256 bytes, `actors/gateway/session.rs`), so the table holds at most
//! `capacity × (256 + worker id + 40)` bytes: ~30 MB at the default.
//!
//! **Shared.** Every router records the placements the other routers tell it of
//! (`sync::LoadChange::Routed`'s `session`, `router.share_load`) as its own, so the next turn
//! of a session sticks to the same worker whichever router replica places it. Entries are
//! timed by the router that records them (its clock when the change arrives), so replicas
//! agree up to one network hop.
//!
//! Costs: `O(log n)` per placement and per lookup that refreshes (a `BTreeMap` keeps the LRU
//! order), `O(1)` per lookup.

use std::collections::BTreeMap;

use crate::request_plane::router::index::FastMap;
use crate::runtime::ids::WorkerId;

/// Sessions remembered unless configured (`router.session_capacity`).
pub const DEFAULT_SESSION_CAPACITY: usize = 100_000;
/// An entry not placed for this long is dropped unless configured (`router.session_ttl_ms`):
/// 30 minutes, the router's placement lease (`LEASE_TTL_MS`).
pub const DEFAULT_SESSION_TTL_MS: u64 = 30 * 60 * 1000;

#[derive(Clone, Debug)]
struct Entry {
    worker: WorkerId,
    last_ms: u64,
    /// Its place in the LRU order (key of `order`).
    tick: u64,
}

/// Session → worker that served its last turn, bounded (module docs).
#[derive(Clone, Debug)]
pub struct SessionTable {
    entries: FastMap<String, Entry>,
    /// LRU order: tick → session (the smallest tick is the least recently placed).
    order: BTreeMap<u64, String>,
    next_tick: u64,
    capacity: usize,
    ttl_ms: u64,
}

impl Default for SessionTable {
    fn default() -> Self {
        Self::new(DEFAULT_SESSION_CAPACITY, DEFAULT_SESSION_TTL_MS)
    }
}

impl SessionTable {
    /// An empty table of at most `capacity` sessions (0: remembers none), each kept `ttl_ms`
    /// after its last placement.
    pub fn new(capacity: usize, ttl_ms: u64) -> Self {
        Self {
            entries: FastMap::default(),
            order: BTreeMap::new(),
            next_tick: 0,
            capacity,
            ttl_ms,
        }
    }

    /// The worker that served `session`'s last turn, unless its entry is older than the TTL
    /// at `now_ms`.
    pub fn worker_of(&self, session: &str, now_ms: u64) -> Option<&WorkerId> {
        self.entries
            .get(session)
            .filter(|e| now_ms.saturating_sub(e.last_ms) <= self.ttl_ms)
            .map(|e| &e.worker)
    }

    /// `session`'s turn was placed on `worker` at `now_ms` (by this router or another one):
    /// it is the session's worker now, and the most recently placed. Evicts what the bounds
    /// say (module docs).
    pub fn placed(&mut self, session: &str, worker: &WorkerId, now_ms: u64) {
        if self.capacity == 0 {
            return;
        }
        let tick = self.next_tick;
        self.next_tick += 1;
        match self.entries.get_mut(session) {
            Some(e) => {
                self.order.remove(&e.tick);
                e.tick = tick;
                e.last_ms = e.last_ms.max(now_ms);
                if e.worker != *worker {
                    e.worker = worker.clone();
                }
            }
            None => {
                self.entries.insert(
                    session.to_owned(),
                    Entry {
                        worker: worker.clone(),
                        last_ms: now_ms,
                        tick,
                    },
                );
            }
        }
        self.order.insert(tick, session.to_owned());
        self.expire(now_ms);
    }

    /// Drops the entries past the TTL at `now_ms`, then the least recently placed ones beyond
    /// the capacity. Returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut dropped = 0;
        while let Some((&tick, session)) = self.order.first_key_value() {
            let stale = self
                .entries
                .get(session)
                .is_none_or(|e| now_ms.saturating_sub(e.last_ms) > self.ttl_ms);
            if !(stale || self.entries.len() > self.capacity) {
                break;
            }
            if let Some(session) = self.order.remove(&tick) {
                self.entries.remove(&session);
                dropped += 1;
            }
        }
        dropped
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
