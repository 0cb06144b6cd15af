//! [`PrefixIndex`]: which worker holds which KV block, built from every worker's KV events.
//!
//! # Structure
//!
//! A path-compressed radix tree over sequence hashes (see `kv_block_manager::hash`). Equal
//! sequence hashes mean equal prefixes (block 0 up to this block), so a block *is* a prefix
//! and the tree needs no token comparison. A node (an *edge*) is a run of blocks, each the
//! parent of the next, that the same workers hold in the same tiers: a worker's unshared tail
//! of 448 blocks is one node, a system prompt every worker holds is another. Each node lists
//! its *holders*: the workers holding its blocks and, per worker, a 4-bit set of [`Tier`]s,
//! packed into one `u32` (`slot << 4 | tiers`, sorted by slot; a slot is the worker's interned
//! index). Up to three holders live inline; more spill to a boxed list plus a bitset of their
//! slots. Nodes live in an arena. A node branches only at its end (its children start with
//! the blocks whose parent is its last block).
//!
//! *Block maps* send each block's sequence hash to its node and its position there. Each
//! block is in exactly one of them, its node's *home*: the own map of the worker holding the
//! node when it has exactly one holder (a worker's unshared tail), else a shared map (two or
//! more holders, or none: placeholders and interior nodes). A worker's new blocks are thus
//! inserts into a map of its own, 1/W of the tree and in cache, not random inserts into one
//! map of every block. A *heads* map sends the first block of every node to the node. A block
//! of worker `w` is looked up in `w`'s own map, then the shared map, then the heads; under
//! content-consistent hashing a new block can only be met as a head (its parent ends a node)
//! or right after its parent, so the other workers' maps are searched (`O(W)` lookups) only
//! for a parent met nowhere else. A node's blocks move between maps when its number of
//! holders goes from or to one.
//!
//! The tree is kept *canonical*: a node that is its parent's only child and has the same
//! holders is merged into it. A change to some blocks of a node (a worker stores or evicts
//! part of it) splits the node where the change starts and ends; the shorter part moves, so
//! a split or merge costs the length of the shorter part in block-map updates (plus a
//! memmove of the node's hash vector). A `Stored`
//! chain that continues a leaf held by the same worker alone in the same tier is appended to
//! it: one block-map insert per block, the common case of a conversation growing.
//!
//! A node exists while it has a holder or a child. A `Stored` chain whose parent has no node
//! yet creates that parent as a *placeholder* (a one-block node with no holder, parent
//! unknown), so the tree stays connected; placeholders are dropped once their last child goes.
//! The worker is **not** recorded as holding the parent: the event says only that it holds
//! the chain, and a chain cut from its prefix is still stored because its blocks are real
//! (their sequence hashes name the whole prefix). Such blocks never add to the worker's
//! overlap until the missing ancestors are stored too, because overlap counts leading blocks
//! only. When a block whose parent was unknown is stored again with its parent, its node is
//! linked under it (never into a cycle: only corrupt events could ask for one).
//!
//! # Overlap (the query)
//!
//! For a request with block sequence hashes `h_0 … h_{n-1}` (the request's full blocks) and
//! a tier filter `T`:
//!
//! ```text
//! overlap(w) = max { k ≤ n : for all i < k, w holds h_i in some tier of T }   (blocks)
//! ```
//!
//! i.e. the number of leading blocks `w` can reuse; the prefix reuse of vLLM automatic prefix
//! caching stops at the first miss the same way. `h_0` is a first block (a block stored with
//! no parent), as every request's is: the walk looks it up among the heads of the tree's
//! first nodes (a small map, in cache), so a hash stored only under some parent (which only
//! corrupt events could make) does not start a match. The walk then compares the request
//! with the node's blocks from there (a contiguous compare, eight hashes at a time), then
//! looks up the first hash past the matched run among the heads of all nodes, and so on: one
//! lookup per node met, not per block. At each node it narrows the set of workers still
//! matching: when the node's holders are exactly the active set (the common case: a shared
//! system prompt, or one worker's own conversation) nothing changes, which costs a comparison
//! of ≤ 3 slots or of `⌈workers/64⌉` bitset words; otherwise the active set is intersected
//! with the holders (bitset membership, binary search, or a merge, whichever is cheapest).
//! The walk stops at the first hash not in the tree or once no worker is left; a request
//! whose first hash is not in the tree costs one lookup and allocates nothing. Cost: one
//! lookup per node, one compare per matched block, `O(workers/64)` per node in the common
//! case and at most `O(|active| + |holders|)`; scratch vectors of `O(workers)`.
//!
//! # Event protocol
//!
//! Each worker numbers its events `1, 2, 3, …` (per pool, all tiers together). The index keeps
//! the id of the last event it applied per worker and applies the next one only:
//!
//! - `id == last + 1`: applied ([`ApplyOutcome::Applied`]).
//! - anything else: a gap (`id > last + 1`, including the first event of a worker the index
//!   joins late), a duplicate (`1 < id ≤ last`) or a reset (`id == 1` after higher ids: the
//!   worker restarted). The index cannot apply it safely, so it returns
//!   [`ApplyOutcome::NeedsResync`] **once** and marks the worker *pending*. While pending,
//!   the worker's last known contents stay visible to queries (stale but usually right), and
//!   its events are buffered by id (the latest arrival of an id wins; an id-1 event, the
//!   first of a new incarnation, drops what was buffered before it; at most
//!   [`DEFAULT_MAX_BUFFERED`] events, further ones are [`ApplyOutcome::Ignored`]) and answered
//!   [`ApplyOutcome::Buffered`], never with a second resync request.
//! - [`PrefixIndex::resync`] replaces the worker's contents with a snapshot taken after its
//!   event `last_event_id`, then replays the buffered events `last_event_id + 1, + 2, …` while
//!   they are contiguous and discards the rest (older ones are already in the snapshot; those
//!   after a hole are lost, and the next live event will then show a gap and ask for a new
//!   resync). Each resync request therefore answers one inconsistency actually observed: the
//!   protocol cannot loop by itself.
//!
//! Event ids alone cannot tell two incarnations of a worker apart: the design assumes that
//! a worker's old events are not delivered after its new incarnation's (one ordered
//! transport session per worker). A caller that learns of a restart from membership should
//! call [`PrefixIndex::remove_worker`], which also drops any buffer. A lost resync request
//! leaves the worker pending: the caller re-asks after a timeout of its own
//! ([`PrefixIndex::pending_resyncs`] lists them).
//!
//! `Removed` of a block the worker does not hold in that tier is ignored, so is a `Stored` of
//! a block already held in that tier (the first parent link recorded for a hash is kept).
//!
//! # Slots
//!
//! Workers are interned to slots (reused after [`PrefixIndex::remove_worker`]).
//! [`PrefixIndex::slot`] and [`Overlaps::at`] let a caller that resolves a worker list once
//! read overlaps without hashing worker ids per decision; the resolution stays valid while
//! [`PrefixIndex::workers_epoch`] is unchanged (the epoch changes whenever a slot is handed
//! out or freed, and is unique across tables in the process).
//!
//! # Costs
//!
//! `Stored`: one lookup in the heads and one insert into the worker's own block map per new
//! block appended or put in a new node; for blocks
//! already in the tree, one lookup per run of blocks in one node, plus the splits that
//! isolate the run when the worker's tiers there change (`O(shorter part)` block-map updates
//! each, `O(holders)` for the holder lists). `Removed`: one lookup per run likewise; the
//! tail of a leaf held by the worker alone (the usual eviction) is cut off in place. A node
//! whose holders go from or to exactly one moves its blocks between block maps (`O(length)`).
//! `Cleared` and [`PrefixIndex::remove_worker`]: `O(nodes the worker held)` holder updates,
//! plus the blocks of the nodes left empty, found through a per-worker set of held nodes (no
//! scan of the tree). Memory: a 16-byte block-map entry and an 8-byte hash in its node per
//! block in the tree (at the map's load factor, ½ to ⅞), plus per node about 100 bytes, a
//! heads entry and
//! its holder list (a boxed list of 4 bytes per holder plus a `⌈workers/64⌉`-word bitset past
//! three holders), plus a 4-byte entry per (worker, node) in the workers' node sets.
//!
//! Hashing: sequence hashes are already XXH3 outputs, so the maps use foldhash's fast hasher
//! ([`FastMap`]) instead of SipHash. It is not HashDoS-resistant; inputs come from our own
//! workers and gateways.
//!
//! # Files
//!
//! This file holds the index itself (its events, resyncs, workers and slots); `tree.rs` the
//! tree and the operations that keep it canonical, `holders.rs` a node's holder list (packed
//! `slot << 4 | tiers`, three inline), `overlap.rs` the query ([`PrefixIndex::overlaps`], its
//! walk, [`Overlaps`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::kv::events::{KvEvent, KvEventData, SnapshotBlock, Tier};
use crate::runtime::ids::{EventId, SequenceHash, WorkerId};

mod holders;
mod overlap;
mod tree;

use holders::{Holders, MAX_SLOTS, TIER_MASK, pack, slot_of};
pub use overlap::Overlaps;
use tree::{Loc, Node, NodeId};

/// Events buffered per pending worker before further ones are ignored.
pub const DEFAULT_MAX_BUFFERED: usize = 4096;

// ---------------------------------------------------------------------------------------------
// Hashing

/// A `HashMap` with foldhash's fast hasher at a fixed seed (deterministic across runs).
pub type FastMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;

/// A `HashSet` with the same hasher.
pub type FastSet<K> = std::collections::HashSet<K, foldhash::fast::FixedState>;

// ---------------------------------------------------------------------------------------------
// Tiers

/// A set of [`Tier`]s, used to filter which copies count as a hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TierSet(u8);

impl TierSet {
    /// No tier.
    pub const EMPTY: TierSet = TierSet(0);
    /// Every tier.
    pub const ALL: TierSet = TierSet(0b1111);
    /// Accelerator memory only.
    pub const DEVICE: TierSet = TierSet(TIER_DEVICE);

    /// The set holding only `tier`.
    pub const fn only(tier: Tier) -> TierSet {
        TierSet(tier_bit(tier))
    }

    /// This set plus `tier`.
    pub const fn with(self, tier: Tier) -> TierSet {
        TierSet(self.0 | tier_bit(tier))
    }

    /// Whether `tier` is in the set.
    pub const fn contains(self, tier: Tier) -> bool {
        self.0 & tier_bit(tier) != 0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The tiers in the set, device first.
    pub fn tiers(self) -> impl Iterator<Item = Tier> {
        [Tier::Device, Tier::Host, Tier::Disk, Tier::Remote]
            .into_iter()
            .filter(move |t| self.contains(*t))
    }
}

impl From<Tier> for TierSet {
    fn from(tier: Tier) -> Self {
        TierSet::only(tier)
    }
}

impl FromIterator<Tier> for TierSet {
    fn from_iter<I: IntoIterator<Item = Tier>>(iter: I) -> Self {
        iter.into_iter().fold(TierSet::EMPTY, TierSet::with)
    }
}

const TIER_DEVICE: u8 = 1;

const fn tier_bit(tier: Tier) -> u8 {
    match tier {
        Tier::Device => TIER_DEVICE,
        Tier::Host => 2,
        Tier::Disk => 4,
        Tier::Remote => 8,
    }
}

// ---------------------------------------------------------------------------------------------
// Public protocol types

/// Why a worker needs a resync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResyncReason {
    /// An id was skipped (also the first event of a worker the index joins late).
    Gap { expected: EventId, got: EventId },
    /// An id at or below the last applied one, other than 1.
    Duplicate { last: EventId, got: EventId },
    /// Event 1 after higher ids: the worker most likely restarted.
    Reset { last: EventId },
}

/// What [`PrefixIndex::apply`] did with an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// Applied in order.
    Applied,
    /// A resync of this worker is pending: kept for replay after it.
    Buffered,
    /// A resync is pending and the buffer is full: dropped.
    Ignored,
    /// Out of order: ask `worker` for a snapshot and call [`PrefixIndex::resync`]. Returned
    /// once per inconsistency; later events are buffered until the resync.
    NeedsResync {
        worker: WorkerId,
        reason: ResyncReason,
    },
}

/// What [`PrefixIndex::resync`] did with the events buffered while the worker was pending.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResyncReport {
    /// Buffered events applied after the snapshot (ids `last_event_id + 1 …`, contiguous).
    pub replayed: usize,
    /// Buffered events already covered by the snapshot (id ≤ `last_event_id`).
    pub stale: usize,
    /// Buffered events after a hole, discarded (the next live event will ask for a resync).
    pub after_gap: usize,
}

// ---------------------------------------------------------------------------------------------
// Workers

/// Events held while a resync is pending.
#[derive(Debug, Clone, Default)]
struct Pending {
    buffered: BTreeMap<u64, KvEvent>,
}

#[derive(Debug, Clone)]
struct WorkerEntry {
    id: WorkerId,
    /// Nodes this worker holds (in some tier).
    nodes: FastSet<NodeId>,
    /// The blocks of the nodes this worker holds alone: their home map (see
    /// [`PrefixIndex::shared`]).
    own: FastMap<SequenceHash, Loc>,
    /// Blocks in those nodes.
    held: usize,
    /// Id of the last applied event (0: none).
    last_event: u64,
    pending: Option<Pending>,
}

impl WorkerEntry {
    fn new(id: WorkerId) -> Self {
        WorkerEntry {
            id,
            nodes: FastSet::default(),
            own: FastMap::default(),
            held: 0,
            last_event: 0,
            pending: None,
        }
    }
}

fn classify(last: u64, got: u64) -> ResyncReason {
    if got > last + 1 {
        ResyncReason::Gap {
            expected: EventId(last + 1),
            got: EventId(got),
        }
    } else if got == 1 {
        ResyncReason::Reset {
            last: EventId(last),
        }
    } else {
        ResyncReason::Duplicate {
            last: EventId(last),
            got: EventId(got),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The index

/// Global prefix index over every worker's KV blocks (see the module docs).
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    /// The blocks of the nodes with no holder or with several: their node and position. Each
    /// block of the tree is in exactly one map, its node's *home*: the own map of the node's
    /// holder (in its [`WorkerEntry`]) when the node has exactly one, else this one. A
    /// worker's new blocks thus go to a map of its own, small and in cache, not to one map of
    /// every block in the tree.
    shared: FastMap<SequenceHash, Loc>,
    /// The first block of every live node: where a query goes on after a node it matched to
    /// its end (a child's head), and where a new block can be met when it is not held by the
    /// worker storing it (a node whose parent was unknown).
    heads: FastMap<SequenceHash, NodeId>,
    /// Heads of the nodes with a `Root` link (first blocks), where a query starts: a small
    /// map, in cache, so a request that matches nothing costs one cheap lookup.
    roots: FastMap<SequenceHash, NodeId>,
    /// The arena (free slots have no blocks).
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    live_nodes: usize,
    /// Nodes changed by the event being applied, to merge afterwards (scratch).
    touched: Vec<NodeId>,
    slots: Vec<Option<WorkerEntry>>,
    free_slots: Vec<u32>,
    by_id: FastMap<WorkerId, u32>,
    /// Bumped whenever a slot is handed out or freed (see [`PrefixIndex::slot`]).
    epoch: u64,
    /// Blocks in nodes with at least one holder.
    held_blocks: usize,
    /// Σ over workers of held blocks.
    holdings: usize,
    max_buffered: usize,
    /// Whether any worker ever announced a block in a lower tier (G2–G4).
    lower_tiers: bool,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        PrefixIndex {
            shared: FastMap::default(),
            heads: FastMap::default(),
            roots: FastMap::default(),
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            live_nodes: 0,
            touched: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_id: FastMap::default(),
            epoch: 0,
            held_blocks: 0,
            holdings: 0,
            max_buffered: DEFAULT_MAX_BUFFERED,
            lower_tiers: false,
        }
    }

    /// Sets how many events are buffered per pending worker (default [`DEFAULT_MAX_BUFFERED`]).
    pub fn with_max_buffered(mut self, max: usize) -> Self {
        self.max_buffered = max;
        self
    }

    // --- events ------------------------------------------------------------------------------

    /// Applies one event of `ev.worker` (see the module docs for the protocol).
    pub fn apply(&mut self, ev: &KvEvent) -> ApplyOutcome {
        let slot = self.slot_or_insert(&ev.worker);
        let max_buffered = self.max_buffered;
        let entry = self.entry_mut(slot);
        if let Some(pending) = entry.pending.as_mut() {
            return buffer(pending, ev, max_buffered);
        }
        let last = entry.last_event;
        let got = ev.event_id.0;
        if got == last + 1 {
            entry.last_event = got;
            self.apply_data(slot, ev.tier, &ev.data);
            return ApplyOutcome::Applied;
        }
        let mut pending = Pending::default();
        buffer(&mut pending, ev, max_buffered);
        entry.pending = Some(pending);
        ApplyOutcome::NeedsResync {
            worker: ev.worker.clone(),
            reason: classify(last, got),
        }
    }

    /// Replaces `worker`'s contents by a device-tier snapshot (a `BlockPool::snapshot` taken
    /// right after its event `last_event_id`; `EventId(0)` = before any event), then replays
    /// the buffered events that follow it. Works for unknown or non-pending workers too (e.g.
    /// to bootstrap a router that starts late).
    pub fn resync(
        &mut self,
        worker: &WorkerId,
        last_event_id: EventId,
        blocks: &[SnapshotBlock],
    ) -> ResyncReport {
        self.resync_tiers(worker, last_event_id, &[(Tier::Device, blocks)])
    }

    /// [`PrefixIndex::resync`] with a snapshot per tier.
    pub fn resync_tiers(
        &mut self,
        worker: &WorkerId,
        last_event_id: EventId,
        snapshot: &[(Tier, &[SnapshotBlock])],
    ) -> ResyncReport {
        let slot = self.slot_or_insert(worker);
        let pending = self.entry_mut(slot).pending.take();
        self.purge_blocks(slot);
        for (tier, blocks) in snapshot {
            let bit = tier_bit(*tier);
            self.lower_tiers |= bit != TIER_DEVICE && !blocks.is_empty();
            // Stored as chains (runs of blocks each the parent of the next, as a block pool's
            // snapshot lists them), not block by block: a block at a time over a long node
            // that others hold would split it once per block.
            let mut start = 0;
            while start < blocks.len() {
                let mut end = start + 1;
                while end < blocks.len() && blocks[end].parent == Some(blocks[end - 1].seq_hash) {
                    end += 1;
                }
                let chain = &blocks[start..end];
                self.store_chain(slot, bit, chain[0].parent, chain.len(), |i| {
                    chain[i].seq_hash
                });
                start = end;
            }
        }
        self.normalize();
        self.entry_mut(slot).last_event = last_event_id.0;
        let buffered = pending.map(|p| p.buffered).unwrap_or_default();
        self.replay(slot, buffered)
    }

    /// Forgets `worker` (it died or restarted): every trace, buffered events included, in
    /// `O(blocks it held)`. Returns whether it was known.
    pub fn remove_worker(&mut self, worker: &WorkerId) -> bool {
        let Some(slot) = self.by_id.remove(worker) else {
            return false;
        };
        self.purge_blocks(slot);
        self.slots[slot as usize] = None;
        self.free_slots.push(slot);
        self.epoch = fresh_epoch();
        true
    }

    // --- queries -----------------------------------------------------------------------------

    /// Distinct blocks held by at least one worker.
    pub fn num_blocks(&self) -> usize {
        self.held_blocks
    }

    /// `worker`'s slot, to read [`Overlaps::at`] without hashing its id again. A slot stays
    /// valid while [`PrefixIndex::workers_epoch`] is unchanged.
    pub fn slot(&self, worker: &WorkerId) -> Option<WorkerSlot> {
        self.by_id.get(worker).map(|s| WorkerSlot(*s))
    }

    /// Changes whenever a worker is added to or removed from the index (never equal to the
    /// epoch of another index that has had workers).
    pub fn workers_epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether any worker ever announced a block in a tier below G1 (a router then weighs
    /// overlaps per tier).
    pub fn has_lower_tiers(&self) -> bool {
        self.lower_tiers
    }

    /// Whether some worker holds `hash` (any tier).
    pub fn contains(&self, hash: SequenceHash) -> bool {
        let loc = self.locate(None, hash);
        loc.is_some_and(|l| !self.node(l.node).holders.is_empty())
    }

    /// Blocks in the tree, placeholders (unheld parents of held blocks) included.
    pub fn num_nodes(&self) -> usize {
        let own = self.slots.iter().flatten().map(|e| e.own.len());
        self.shared.len() + own.sum::<usize>()
    }

    /// Nodes (edges) of the compressed tree: runs of blocks with the same holders.
    pub fn num_edges(&self) -> usize {
        self.live_nodes
    }

    /// Σ over workers of the blocks each holds (a block held by 3 workers counts 3).
    pub fn num_holdings(&self) -> usize {
        self.holdings
    }

    /// The workers known to the index (pending ones included), in no particular order.
    pub fn workers(&self) -> impl Iterator<Item = &WorkerId> {
        self.slots.iter().flatten().map(|e| &e.id)
    }

    /// Number of workers known to the index.
    pub fn num_workers(&self) -> usize {
        self.by_id.len()
    }

    /// Blocks held by `worker` (any tier); 0 if unknown.
    pub fn blocks_of(&self, worker: &WorkerId) -> usize {
        self.entry(worker).map_or(0, |e| e.held)
    }

    /// Tiers in which `worker` holds `hash` (empty if none).
    pub fn tiers_of(&self, worker: &WorkerId, hash: SequenceHash) -> TierSet {
        let Some(slot) = self.by_id.get(worker).copied() else {
            return TierSet::EMPTY;
        };
        let Some(loc) = self.find_held(slot, hash) else {
            return TierSet::EMPTY;
        };
        TierSet(self.node(loc.node).tiers_of(slot))
    }

    /// Every block `worker` holds with its tiers, in no particular order.
    pub fn held_by(&self, worker: &WorkerId) -> Vec<(SequenceHash, TierSet)> {
        let Some(slot) = self.by_id.get(worker).copied() else {
            return Vec::new();
        };
        let entry = self.entry(worker).expect("a mapped worker has an entry");
        let mut out = Vec::with_capacity(entry.held);
        for id in &entry.nodes {
            let node = self.node(*id);
            let tiers = TierSet(node.tiers_of(slot));
            out.extend(node.blocks.iter().map(|h| (*h, tiers)));
        }
        out
    }

    /// Id of the last event applied for `worker` (`EventId(0)`: none yet); `None` if unknown.
    pub fn last_event_id(&self, worker: &WorkerId) -> Option<EventId> {
        self.entry(worker).map(|e| EventId(e.last_event))
    }

    /// Whether a resync of `worker` is pending.
    pub fn is_pending(&self, worker: &WorkerId) -> bool {
        self.entry(worker).is_some_and(|e| e.pending.is_some())
    }

    /// Workers waiting for a resync, with the number of events buffered for each.
    pub fn pending_resyncs(&self) -> Vec<(WorkerId, usize)> {
        let pending = self.slots.iter().flatten();
        pending
            .filter_map(|e| e.pending.as_ref().map(|p| (e.id.clone(), p.buffered.len())))
            .collect()
    }

    // --- internals: workers ------------------------------------------------------------------

    fn entry(&self, worker: &WorkerId) -> Option<&WorkerEntry> {
        let slot = *self.by_id.get(worker)?;
        self.slots[slot as usize].as_ref()
    }

    fn entry_mut(&mut self, slot: u32) -> &mut WorkerEntry {
        self.slots[slot as usize]
            .as_mut()
            .expect("slots handed out by slot_or_insert stay occupied until remove_worker")
    }

    fn slot_or_insert(&mut self, worker: &WorkerId) -> u32 {
        if let Some(slot) = self.by_id.get(worker) {
            return *slot;
        }
        let entry = Some(WorkerEntry::new(worker.clone()));
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = entry;
                s
            }
            None => {
                assert!(self.slots.len() < MAX_SLOTS, "more than 2^28 workers");
                self.slots.push(entry);
                (self.slots.len() - 1) as u32
            }
        };
        self.by_id.insert(worker.clone(), slot);
        self.epoch = fresh_epoch();
        slot
    }

    fn replay(&mut self, slot: u32, buffered: BTreeMap<u64, KvEvent>) -> ResyncReport {
        let mut report = ResyncReport::default();
        for (id, ev) in buffered {
            let last = self.entry_mut(slot).last_event;
            if id <= last {
                report.stale += 1;
            } else if id == last + 1 {
                self.entry_mut(slot).last_event = id;
                self.apply_data(slot, ev.tier, &ev.data);
                report.replayed += 1;
            } else {
                report.after_gap += 1;
            }
        }
        report
    }

    // --- internals: contents -----------------------------------------------------------------

    fn apply_data(&mut self, slot: u32, tier: Tier, data: &KvEventData) {
        let bit = tier_bit(tier);
        match data {
            KvEventData::Stored { parent, blocks } => {
                self.lower_tiers |= bit != TIER_DEVICE && !blocks.is_empty();
                self.store_chain(slot, bit, *parent, blocks.len(), |i| blocks[i].seq_hash);
            }
            KvEventData::Removed { blocks } => self.remove_blocks(slot, bit, blocks),
            KvEventData::Cleared => self.clear_bits(slot, bit),
        }
        self.normalize();
    }

    /// Drops every block of `slot` (all tiers); buffered events are left to the caller.
    fn purge_blocks(&mut self, slot: u32) {
        self.clear_bits(slot, TierSet::ALL.0);
        self.normalize();
    }

    /// Checks every structural invariant; `O(size)`, for tests and debugging.
    ///
    /// # Errors
    /// A description of the first invariant found broken.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_tree()?;
        self.check_workers()
    }

    fn check_workers(&self) -> Result<(), String> {
        let mut holdings = 0;
        for (slot, entry) in self.slots.iter().enumerate() {
            let Some(entry) = entry else {
                if !self.free_slots.contains(&(slot as u32)) {
                    return Err(format!("slot {slot} is empty but not free"));
                }
                continue;
            };
            if self.by_id.get(&entry.id) != Some(&(slot as u32)) {
                return Err(format!("worker {} not mapped to slot {slot}", entry.id));
            }
            let mut held = 0;
            for id in &entry.nodes {
                let node = self.nodes.get(*id as usize).filter(|n| n.is_live());
                let Some(node) = node else {
                    return Err(format!("worker {} lists dead node {id}", entry.id));
                };
                if node.tiers_of(slot as u32) == 0 {
                    return Err(format!(
                        "worker {} lists node {id} it does not hold",
                        entry.id
                    ));
                }
                held += node.blocks.len();
            }
            if held != entry.held {
                return Err(format!(
                    "worker {}: {} held, counted {held}",
                    entry.id, entry.held
                ));
            }
            holdings += held;
        }
        if self.by_id.len() + self.free_slots.len() != self.slots.len() {
            return Err("slot accounting".into());
        }
        if holdings != self.holdings {
            return Err(format!("holdings {} != {holdings}", self.holdings));
        }
        Ok(())
    }
}

/// Buffers `ev` for a pending worker.
fn buffer(pending: &mut Pending, ev: &KvEvent, max: usize) -> ApplyOutcome {
    let id = ev.event_id.0;
    if id == 1 {
        // The first event of a new incarnation: what came before is of the old one.
        pending.buffered.clear();
    }
    if pending.buffered.len() >= max && !pending.buffered.contains_key(&id) {
        return ApplyOutcome::Ignored;
    }
    pending.buffered.insert(id, ev.clone());
    ApplyOutcome::Buffered
}

/// A value no other call returns in this process: epochs of different tables never collide,
/// so a slot cached against one table cannot pass for a slot of another.
pub(crate) fn fresh_epoch() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A worker's slot in a [`PrefixIndex`] (see [`PrefixIndex::slot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WorkerSlot(u32);

#[cfg(test)]
mod tests;
