//! KV cache bookkeeping of one replica: the pure block pool over its KV memory, its events
//! and their wire formats. The actor that publishes the events to the cluster is
//! [`crate::actors::kv_publisher`].
//!
//! Files:
//! - `hash.rs` — block hash / sequence hash recipe (XXH3-64) and [`block_hashes`].
//! - `pool.rs` — [`BlockPool`]: ids, refcounts, prefix cache, eviction, KV event outbox.
//! - `eviction.rs` — [`EvictionPolicy`]: LRU with a frequency bias.
//! - `tiers.rs` — the lower tiers G2 (host) and G3 (disk): offload, demotion, onboard, the
//!   copies a driver carries out ([`TierCopy`]), [`TierConfig`]; `pool_tiers.rs` — the
//!   pool's methods over them.
//! - `lease.rs` — [`SeqLease`]: the value that stands for a sequence's blocks; drop-safe.
//! - `memory.rs` — the KV memory itself: [`memory::KvMemory`] (one registrable region per
//!   pool), its layout, kinds (host or staged device memory), leases and epochs; the engines
//!   allocate in it and the transport moves its bytes.
//! - `events.rs` — [`KvEvent`] and friends (serde), [`EventReplay`] (reference consumer).
//! - `vllm.rs` — vLLM's KV event wire format (MessagePack) and [`vllm::Translator`], which
//!   turns an external engine's events into Flotilla's.
//! - `zmq.rs` — the ZMQ PUB socket that publishes a replica's events in vLLM's format.
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
pub mod faults;
pub mod hash;
mod lease;
pub mod memory;
pub mod pool;
mod pool_tiers;
pub mod tiers;
pub mod vllm;
pub mod zmq;

#[cfg(test)]
mod invariants;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;

pub use events::{
    EventError, EventReplay, KvEvent, KvEventData, KvSnapshot, SnapshotBlock, StoredBlock, Tier,
};
pub use eviction::EvictionPolicy;
pub use hash::{ROOT_PARENT_SEQ_HASH, block_hash, block_hashes, sequence_hash};
pub use lease::SeqLease;
pub use pool::{Allocation, BlockPool, PoolError, PoolUsage};
pub use tiers::{
    BlockLoc, CopyId, CopyKind, CopyOutcome, PeerPullCounters, TierConfig, TierCopy, TierCounters,
    TierUsage,
};
