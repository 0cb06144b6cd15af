//! KV block manager: the pure block pool over one replica's KV memory.
//!
//! Files:
//! - `hash.rs` — block hash / sequence hash recipe (XXH3-64) and [`block_hashes`].
//! - `pool.rs` — [`BlockPool`]: ids, refcounts, prefix cache, eviction, KV event outbox.
//! - `eviction.rs` — [`EvictionPolicy`]: LRU with a frequency bias.
//! - `lease.rs` — [`SeqLease`]: the value that stands for a sequence's blocks; drop-safe.
//! - `events.rs` — [`KvEvent`] and friends (serde), [`EventReplay`] (reference consumer).
//! - `invariants.rs` — test-only consistency checker; `tests.rs` — unit and seeded tests.
//!
//! # Model
//! The pool manages `num_blocks` block ids of `block_size` token slots each; the memory itself
//! lives in the engine, which reads a sequence's KV through its block table (vLLM
//! PagedAttention, Kwon et al., SOSP 2023). All methods are synchronous, take no clock and no
//! randomness, and are all-or-nothing: an error leaves the pool unchanged.
//!
//! # Hash recipe
//! See [`hash`]: `block_hash = xxh3_64_with_seed(u32 LE token bytes, salt)`,
//! `seq_hash = xxh3_64_with_seed(parent_seq_hash LE ++ block_hash LE, salt)`, root parent `0`.
//! A router recomputes it from token ids alone with [`block_hashes`].
//!
//! # Block life cycle
//! `free → partial (in a table, being filled / computed) → complete (full and computed) →
//! registered (in the prefix index, reusable) → free`.
//! - [`BlockPool::allocate_sequence`] pins the longest cached prefix (by sequence hash, full
//!   blocks only, never the last prompt token) and allocates fresh blocks for the rest of the
//!   prompt plus one slot for the first sampled token (vLLM automatic prefix caching; SGLang
//!   RadixAttention reuses prefixes the same way through a radix tree).
//! - [`BlockPool::append_tokens`] / [`BlockPool::reserve`] grow the table as decode proceeds.
//! - **Registration happens when a block is full *and computed*** —
//!   [`BlockPool::mark_computed`], called after the engine step that wrote the KV. Registering
//!   earlier (when the token ids are merely known) would let a sequence admitted while a long
//!   prompt is still being prefilled in chunks reuse blocks whose KV is not written yet.
//! - **Dedup**: if a block completes with a sequence hash that is already registered, the
//!   existing block stays registered and the new one stays unregistered in its sequence's table
//!   (tables are append-only, as in vLLM v1); no event. It returns to the free list when its
//!   sequence ends. If the registered original is evicted while the duplicate is still in use,
//!   the registration moves to the duplicate (no event: the set of held hashes is unchanged).
//! - [`BlockPool::free`] decrements refcounts, **tail block first**: registered blocks reaching
//!   0 become evictable, others go back to the free list.
//!
//! # Eviction
//! Unreferenced registered blocks are evicted by smallest key, LRU with a frequency bias (see
//! [`EvictionPolicy`]). Releasing tail blocks first, counting prefix hits on every block of the
//! matched prefix, and treating the release of a duplicate as a use of its original keep every
//! registered block's parent registered: a chain is always evicted from its leaves. Evictions
//! emit `Removed`; [`BlockPool::clear`] emits `Cleared` then re-announces pinned survivors.
//!
//! # Leases
//! An allocation returns a [`SeqLease`]; hand it back with [`BlockPool::free`]. A lease dropped
//! instead queues its release, which the pool performs on its next mutating call and counts in
//! [`BlockPool::leaked_leases`] (see `lease.rs`).
//!
//! # Events
//! One outbox per pool, drained with [`BlockPool::drain_events`]; event ids start at 1 and
//! increase by 1. Applying every event in order to an [`EventReplay`] yields exactly
//! [`BlockPool::snapshot`] (which lists parents before children).

pub mod events;
pub mod eviction;
pub mod hash;
mod lease;
pub mod pool;

#[cfg(test)]
mod invariants;
#[cfg(test)]
mod tests;

pub use events::{EventError, EventReplay, KvEvent, KvEventData, SnapshotBlock, StoredBlock, Tier};
pub use eviction::EvictionPolicy;
pub use hash::{ROOT_PARENT_SEQ_HASH, block_hash, block_hashes, sequence_hash};
pub use lease::SeqLease;
pub use pool::{Allocation, BlockPool, PoolError, PoolUsage};

// ---------------------------------------------------------------------------------------------
// The KvBlockManager actor
// ---------------------------------------------------------------------------------------------
//
// The pool itself is owned by the replica's scheduler (allocation is on the scheduling hot path
// and must be synchronous). The KvBlockManager is the pool's face to the cluster: it receives
// the pool's KV events after every step, keeps a mirror of the registered blocks (an
// [`EventReplay`]), publishes the events to every subscriber in [`KV_EVENTS_GROUP`], and
// answers snapshot requests from that mirror (routers resync from it after a gap).

use crate::runtime::ids::{EventId, WorkerId};
use crate::runtime::wire::Wire;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;

/// Process group of KV event subscribers (they accept [`KvEventsMsg`]).
pub const KV_EVENTS_GROUP: &str = "flotilla.kv_events";
/// Process group of KV block managers, named `<worker id>/kv_manager`.
pub const KV_MANAGER_GROUP: &str = "flotilla.kv_managers";

/// What a KV event subscriber accepts.
#[derive(RactorClusterMessage)]
pub enum KvEventsMsg {
    /// Events of one worker, in event-id order (cast).
    Publish(Wire<Vec<KvEvent>>),
}

/// Every registered block of a worker, as of `last_event`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KvSnapshot {
    /// Worker.
    pub worker: WorkerId,
    /// Last event applied (`None` before the first).
    pub last_event: Option<EventId>,
    /// Registered blocks, parents before children.
    pub blocks: Vec<SnapshotBlock>,
}

/// Messages of the KvBlockManager.
#[derive(RactorClusterMessage)]
pub enum KvBlockManagerMsg {
    /// Local: events drained from the pool after a step (cast).
    Events(Wire<Vec<KvEvent>>),
    /// Every registered block (call; routers use it to resync).
    #[rpc]
    Snapshot(RpcReplyPort<Wire<KvSnapshot>>),
}

/// The KvBlockManager actor; its argument is the worker id.
#[derive(Debug, Default, Clone, Copy)]
pub struct KvBlockManager;

/// KvBlockManager state.
pub struct KvBlockManagerState {
    worker: WorkerId,
    mirror: EventReplay,
    faults: crate::control::chaos::FaultBook,
}

fn parents_first(mut blocks: Vec<SnapshotBlock>) -> Vec<SnapshotBlock> {
    use std::collections::{HashMap, HashSet};
    let index: HashMap<_, _> = blocks.iter().map(|b| (b.seq_hash, *b)).collect();
    let mut done = HashSet::new();
    let mut out = Vec::with_capacity(blocks.len());
    blocks.sort_by_key(|b| b.seq_hash);
    for b in &blocks {
        let mut chain = vec![*b];
        let mut cur = b.parent;
        while let Some(p) = cur {
            if done.contains(&p) {
                break;
            }
            match index.get(&p) {
                Some(pb) => {
                    chain.push(*pb);
                    cur = pb.parent;
                }
                None => break,
            }
        }
        for c in chain.into_iter().rev() {
            if done.insert(c.seq_hash) {
                out.push(c);
            }
        }
    }
    out
}

impl Actor for KvBlockManager {
    type Msg = KvBlockManagerMsg;
    type State = KvBlockManagerState;
    type Arguments = (WorkerId, crate::control::chaos::FaultBook);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (worker, faults): (WorkerId, crate::control::chaos::FaultBook),
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(KV_MANAGER_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(KvBlockManagerState {
            worker,
            mirror: EventReplay::new(),
            faults,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            KvBlockManagerMsg::Events(wire) => {
                let Ok(events) = wire.decode() else {
                    return Ok(());
                };
                for ev in &events {
                    if let Err(e) = state.mirror.apply(ev) {
                        tracing::error!(worker = %state.worker, error = %e, "KV event mirror out of order");
                    }
                }
                // Chaos `drop_kv_events`: lose some on the way to the subscribers (the
                // mirror, and so the snapshots, keep them).
                let events: Vec<KvEvent> = events
                    .into_iter()
                    .filter(|_| !state.faults.drop_kv_event(&state.worker))
                    .collect();
                if events.is_empty() {
                    return Ok(());
                }
                let payload = Wire::encode(&events);
                for cell in ractor::pg::get_members(&KV_EVENTS_GROUP.to_owned()) {
                    let sub: ActorRef<KvEventsMsg> = cell.into();
                    let _ = sub.cast(KvEventsMsg::Publish(payload.clone()));
                }
            }
            KvBlockManagerMsg::Snapshot(reply) => {
                let snap = KvSnapshot {
                    worker: state.worker.clone(),
                    last_event: state.mirror.last_event(),
                    blocks: parents_first(state.mirror.blocks().values().copied().collect()),
                };
                let _ = reply.send(Wire::encode(&snap));
            }
        }
        Ok(())
    }
}
