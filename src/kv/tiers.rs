//! Lower KV tiers of one replica: the G2 (host memory) and G3 (local disk) block stores beside
//! the engine's pool (G1), pure — which sequence hashes each tier holds, in which slot, in what
//! LRU order, and the copies that move blocks between tiers. The bytes are moved by the
//! replica's driver (the CPU engine's copy thread, the sim engine's timing model), which reports
//! each copy back with [`BlockPool::copies_done`](super::BlockPool::copies_done). Nothing here
//! touches memory or a clock.
//!
//! # Policy (DESIGN.md §5)
//! - **Offload, write-through.** A block is copied G1 → G2 when it is registered in G1 (full and
//!   computed), so that it is already in G2 when G1 evicts it: eviction never waits for a copy
//!   and the step path never copies. G2 is therefore *inclusive* of G1's recent blocks, as
//!   in NVIDIA Dynamo's KVBM (host offload on registration) and vLLM's offloading connector
//!   (stores as blocks complete). While its copy is in flight the block table of the sequence
//!   that registered it stays whole — freeing that sequence waits for its offloads, as vLLM
//!   delays freeing a request's blocks until their store ends — so the bytes being read are not
//!   reused, and no parent block is evicted before its child. At most
//!   [`TierConfig::max_offloads_in_flight`] store-lane copies are in flight: a block registered
//!   beyond that is not offloaded (counted in [`TierCounters::offload_drops`]) — the bounded
//!   queue of the issue, which never blocks the scheduler.
//! - **LRU inside each tier.** A G2 entry's recency is refreshed when it is stored, when G1
//!   evicts the same block (G2 now holds its only copy) and when it is onboarded. A G2 slot
//!   needed by an offload evicts the least recent unpinned entry.
//! - **Demotion G2 → G3 with a frequency filter.** An entry evicted from G2 goes to G3 only if it
//!   was reused at least [`TierConfig::disk_min_hits`] times (prefix hits in G1 counted when G1
//!   evicts it, plus onboards): one-off blocks never cost a disk write. G3 evicts its least
//!   recent entry for room. G3 is fed only by G2, so it needs G2.
//! - **Onboard at admission.** After the G1 prefix hit, the sequence's next blocks are looked up
//!   in G2, then G3, block by block, until the first block found in neither; each found block
//!   gets a fresh G1 block and a copy into it. The sequence is not scheduled until its onboard
//!   copies return; the leading blocks that arrived intact count as computed (registered in G1),
//!   the rest is recomputed — a failed or corrupt copy costs time, never a wrong answer.
//!
//! # Copy lanes and the driver's contract
//! Copies come out of [`BlockPool::drain_copies`](super::BlockPool::drain_copies) in issue order.
//! - The **store lane** ([`CopyKind::Offload`], [`CopyKind::Demote`]) must be carried out in
//!   issue order: a G2 slot emptied by a demotion may be the target of the next offload, so the
//!   demotion must have read it first.
//! - The **load lane** ([`CopyKind::Onboard`]) reads pinned entries and writes blocks of a
//!   sequence that is not scheduled meanwhile: any order, beside the store lane.
//!
//! Every copy must be answered once ([`CopyOutcome`]); until then its source is pinned and its
//! target reserved. An onboard whose sequence was freed meanwhile is still answered (the
//! scheduler frees the sequence's blocks when its onboard returns).
//!
//! # Events
//! Lower tiers speak through the pool's one event stream (ids shared with G1): `Stored {tier}`
//! when a copy into G2/G3 lands, `Removed {tier}` when an entry is evicted or found corrupt.

use std::collections::{BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::events::{SnapshotBlock, Tier};
use crate::runtime::ids::{SeqId, SequenceHash};

/// Lower tiers of one replica's pool (`worker.kv_host_blocks`, `worker.kv_disk_blocks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierConfig {
    /// G2 blocks (host memory); 0 = no lower tiers.
    pub host_blocks: usize,
    /// G3 blocks (local disk); 0 = off. Needs G2.
    pub disk_blocks: usize,
    /// Store-lane copies (offloads and demotions) in flight at most; a block registered beyond
    /// that is not offloaded (counted). Default 256: a few steps' worth of blocks.
    pub max_offloads_in_flight: usize,
    /// Prefix reuses a block needs before G2 may demote it to G3 (frequency filter). Default 1.
    pub disk_min_hits: u32,
}

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            host_blocks: 0,
            disk_blocks: 0,
            max_offloads_in_flight: 256,
            disk_min_hits: 1,
        }
    }
}

impl TierConfig {
    /// Whether any lower tier is on.
    pub fn is_on(&self) -> bool {
        self.host_blocks > 0
    }

    /// Checks the ranges documented on the fields.
    ///
    /// # Errors
    /// The first rule broken, in words.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.disk_blocks > 0 && self.host_blocks == 0 {
            return Err("the disk tier (G3) is fed by the host tier (G2): set kv_host_blocks too");
        }
        if self.host_blocks > u32::MAX as usize || self.disk_blocks > u32::MAX as usize {
            return Err("kv_host_blocks and kv_disk_blocks must fit in 32 bits");
        }
        if self.is_on() && self.max_offloads_in_flight == 0 {
            return Err("max_offloads_in_flight must be at least 1");
        }
        Ok(())
    }
}

/// Where a block's bytes are: a G1 block id, a G2 slot or a G3 slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockLoc {
    Device(u32),
    Host(u32),
    Disk(u32),
}

impl BlockLoc {
    /// The tier of this location.
    pub fn tier(self) -> Tier {
        match self {
            BlockLoc::Device(_) => Tier::Device,
            BlockLoc::Host(_) => Tier::Host,
            BlockLoc::Disk(_) => Tier::Disk,
        }
    }
}

/// Id of one copy, unique per pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CopyId(pub u64);

/// Why a copy exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyKind {
    /// G1 → G2 (store lane).
    Offload,
    /// G2 → G3 (store lane).
    Demote,
    /// G2 or G3 → G1 for this sequence (load lane).
    Onboard(SeqId),
}

/// One block to copy (see the module doc for the lanes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCopy {
    pub id: CopyId,
    pub kind: CopyKind,
    pub from: BlockLoc,
    pub to: BlockLoc,
    /// The block: its sequence hash (a disk segment records it, with a checksum), parent and
    /// block hash.
    pub block: SnapshotBlock,
}

impl TierCopy {
    /// Whether it belongs to the store lane (offloads and demotions: carried out in order).
    pub fn is_store(&self) -> bool {
        !matches!(self.kind, CopyKind::Onboard(_))
    }
}

/// How a copy ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyOutcome {
    /// The bytes landed.
    Done,
    /// It could not be carried out (I/O error, tier off, time out): nothing landed.
    Failed,
    /// The source did not hold the block (a wrong sequence hash or checksum on disk): its
    /// entry is dropped and never served.
    Corrupt,
    /// The disk tier cannot be used any more (a write failed: no space, read-only): G3 is
    /// turned off (`Cleared {disk}`); nothing landed.
    TierOff,
}

/// Counters of the lower tiers since the pool was made, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCounters {
    /// G1 → G2 copies that landed.
    pub offloads: u64,
    /// Registered blocks not offloaded: the store lane was full, or G2 had no slot to give.
    pub offload_drops: u64,
    /// G2 → G3 copies that landed.
    pub demotions: u64,
    /// Blocks onboarded from G2 and from G3 and used: the leading intact blocks of each
    /// sequence's onboard (a block after a failed or corrupt one is recomputed, not counted).
    pub onboards_host: u64,
    pub onboards_disk: u64,
    /// Copies that failed (any lane; corrupt blocks are counted in `corrupt` only).
    pub copy_failures: u64,
    /// G3 blocks found corrupt (dropped, never served).
    pub corrupt: u64,
}

/// Blocks held per lower tier and the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierUsage {
    pub host_blocks: usize,
    pub host_capacity: usize,
    pub disk_blocks: usize,
    pub disk_capacity: usize,
    /// Copies issued and not answered yet.
    pub copies_in_flight: usize,
    pub counters: TierCounters,
}

// ---------------------------------------------------------------------------------------------
// One store

#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) block: SnapshotBlock,
    pub(super) hits: u32,
    /// Onboards reading it now.
    pub(super) pins: u32,
    /// LRU key while unpinned and live.
    pub(super) key: u64,
    /// Dropped from the index (corrupt) while pinned: freed at the last unpin.
    pub(super) dead: bool,
}

#[derive(Debug, Clone)]
pub(super) enum Slot {
    Free,
    /// The target of a copy in flight.
    Reserved,
    Held(Entry),
}

/// One lower tier: `capacity` slots, an index by sequence hash, LRU over unpinned entries.
#[derive(Debug)]
pub(super) struct Store {
    pub(super) tier: Tier,
    pub(super) capacity: usize,
    /// Slots handed out at least once (`0..slots.len()`); the rest are free and untouched.
    pub(super) slots: Vec<Slot>,
    pub(super) free: Vec<u32>,
    pub(super) index: HashMap<SequenceHash, u32>,
    pub(super) lru: BTreeSet<(u64, u32)>,
    tick: u64,
}

impl Store {
    fn new(tier: Tier, capacity: usize) -> Self {
        Self {
            tier,
            capacity,
            slots: Vec::new(),
            free: Vec::new(),
            index: HashMap::new(),
            lru: BTreeSet::new(),
            tick: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    fn get(&self, h: SequenceHash) -> Option<u32> {
        self.index.get(&h).copied()
    }

    fn entry_mut(&mut self, slot: u32) -> Option<&mut Entry> {
        match self.slots.get_mut(slot as usize) {
            Some(Slot::Held(e)) => Some(e),
            _ => None,
        }
    }

    /// A slot for an incoming copy: a free one, else the least recent unpinned entry's
    /// (returned, already out of the index). `None` when every slot is pinned or reserved.
    fn reserve(&mut self) -> Option<(u32, Option<Entry>)> {
        if let Some(s) = self.free.pop() {
            self.slots[s as usize] = Slot::Reserved;
            return Some((s, None));
        }
        if self.slots.len() < self.capacity {
            self.slots.push(Slot::Reserved);
            return Some(((self.slots.len() - 1) as u32, None));
        }
        let (_, s) = self.lru.pop_first()?;
        let Slot::Held(e) = std::mem::replace(&mut self.slots[s as usize], Slot::Reserved) else {
            return None;
        };
        self.index.remove(&e.block.seq_hash);
        Some((s, Some(e)))
    }

    /// A reserved slot receives its block (or nothing: `None` frees it).
    fn land(&mut self, slot: u32, block: Option<(SnapshotBlock, u32)>) {
        let Some(Slot::Reserved) = self.slots.get(slot as usize) else {
            return;
        };
        match block {
            Some((block, hits)) if !self.index.contains_key(&block.seq_hash) => {
                self.tick += 1;
                self.index.insert(block.seq_hash, slot);
                self.lru.insert((self.tick, slot));
                self.slots[slot as usize] = Slot::Held(Entry {
                    block,
                    hits,
                    pins: 0,
                    key: self.tick,
                    dead: false,
                });
            }
            _ => {
                self.slots[slot as usize] = Slot::Free;
                self.free.push(slot);
            }
        }
    }

    fn pin(&mut self, slot: u32) {
        let Some(e) = self.entry_mut(slot) else {
            return;
        };
        let key = e.key;
        e.pins += 1;
        self.lru.remove(&(key, slot));
    }

    /// Ends a pin; `hit` counts a reuse and refreshes the entry. A dead entry's slot is freed
    /// at its last unpin.
    fn unpin(&mut self, slot: u32, hit: bool) {
        self.tick += 1;
        let tick = self.tick;
        let Some(e) = self.entry_mut(slot) else {
            return;
        };
        e.pins = e.pins.saturating_sub(1);
        if hit {
            e.hits = e.hits.saturating_add(1);
        }
        if e.pins > 0 {
            return;
        }
        if e.dead {
            self.slots[slot as usize] = Slot::Free;
            self.free.push(slot);
        } else {
            e.key = tick;
            self.lru.insert((tick, slot));
        }
    }

    /// Refreshes an entry's recency and adds `hits` reuses to it.
    fn touch(&mut self, slot: u32, hits: u32) {
        self.tick += 1;
        let tick = self.tick;
        let Some(e) = self.entry_mut(slot) else {
            return;
        };
        e.hits = e.hits.saturating_add(hits);
        if e.pins > 0 || e.dead {
            return;
        }
        let old = std::mem::replace(&mut e.key, tick);
        self.lru.remove(&(old, slot));
        self.lru.insert((tick, slot));
    }

    /// Drops the entry at `slot` from the index (corrupt): freed now, or at its last unpin.
    fn kill(&mut self, slot: u32) -> Option<SequenceHash> {
        let e = self.entry_mut(slot)?;
        if e.dead {
            return None;
        }
        e.dead = true;
        let (h, key, pinned) = (e.block.seq_hash, e.key, e.pins > 0);
        self.index.remove(&h);
        self.lru.remove(&(key, slot));
        if !pinned {
            self.slots[slot as usize] = Slot::Free;
            self.free.push(slot);
        }
        Some(h)
    }

    /// Every live entry, in no particular order.
    pub(super) fn blocks(&self) -> impl Iterator<Item = &SnapshotBlock> {
        self.index
            .values()
            .filter_map(|&s| match &self.slots[s as usize] {
                Slot::Held(e) => Some(&e.block),
                _ => None,
            })
    }
}

// ---------------------------------------------------------------------------------------------
// The lower tiers of one pool

/// A block found in a lower tier at admission.
#[derive(Debug, Clone, Copy)]
pub(super) struct LowerHit {
    pub(super) from: BlockLoc,
    pub(super) block: SnapshotBlock,
}

/// What the pool must do after copies returned.
#[derive(Debug, Default)]
pub(super) struct Landed {
    /// Offloads that returned, whatever their outcome.
    pub(super) offloaded: Vec<CopyId>,
    /// Lower-tier blocks stored, per tier, in landing order.
    pub(super) stored: Vec<(Tier, SnapshotBlock)>,
    /// Lower-tier blocks removed, per tier.
    pub(super) removed: Vec<(Tier, SequenceHash)>,
    /// Sequences whose onboard finished: the leading blocks that arrived intact.
    pub(super) onboarded: Vec<(SeqId, usize)>,
    /// G3 was turned off.
    pub(super) disk_off: bool,
}

#[derive(Debug)]
struct Onboarding {
    /// Copy ids in block order, their source tier, and their outcome once known.
    copies: Vec<(CopyId, Tier, Option<bool>)>,
}

/// G2 and G3 of one pool (see the module doc).
#[derive(Debug)]
pub(super) struct LowerTiers {
    pub(super) config: TierConfig,
    pub(super) host: Store,
    pub(super) disk: Option<Store>,
    next_copy: u64,
    pub(super) pending: HashMap<CopyId, TierCopy>,
    outbox: Vec<TierCopy>,
    /// Sequence hashes with a store-lane copy in flight into G2 / G3.
    pub(super) incoming_host: HashSet<SequenceHash>,
    pub(super) incoming_disk: HashSet<SequenceHash>,
    stores_in_flight: usize,
    /// The reuse count of each entry on its way to G3.
    demote_hits: HashMap<SequenceHash, u32>,
    onboarding: HashMap<SeqId, Onboarding>,
    pub(super) counters: TierCounters,
}

impl LowerTiers {
    pub(super) fn new(config: TierConfig) -> Self {
        Self {
            config,
            host: Store::new(Tier::Host, config.host_blocks),
            disk: (config.disk_blocks > 0).then(|| Store::new(Tier::Disk, config.disk_blocks)),
            next_copy: 1,
            pending: HashMap::new(),
            outbox: Vec::new(),
            incoming_host: HashSet::new(),
            incoming_disk: HashSet::new(),
            stores_in_flight: 0,
            demote_hits: HashMap::new(),
            onboarding: HashMap::new(),
            counters: TierCounters::default(),
        }
    }

    fn issue(
        &mut self,
        kind: CopyKind,
        from: BlockLoc,
        to: BlockLoc,
        block: SnapshotBlock,
    ) -> CopyId {
        let id = CopyId(self.next_copy);
        self.next_copy += 1;
        let copy = TierCopy {
            id,
            kind,
            from,
            to,
            block,
        };
        self.pending.insert(id, copy);
        self.outbox.push(copy);
        id
    }

    pub(super) fn drain(&mut self) -> Vec<TierCopy> {
        std::mem::take(&mut self.outbox)
    }

    /// A block was registered in G1 (`device` is its block id): offload it unless G2 holds it
    /// or is receiving it. Returns the copy's id when one was issued (the G1 block must stay
    /// put until it returns); pushes the G2 / G3 evictions this caused onto `removed`.
    pub(super) fn offload(
        &mut self,
        device: u32,
        block: SnapshotBlock,
        removed: &mut Vec<(Tier, SequenceHash)>,
    ) -> Option<CopyId> {
        let h = block.seq_hash;
        if self.host.get(h).is_some() || self.incoming_host.contains(&h) {
            return None;
        }
        if self.stores_in_flight >= self.config.max_offloads_in_flight {
            self.counters.offload_drops += 1;
            return None;
        }
        let Some((slot, evicted)) = self.host.reserve() else {
            self.counters.offload_drops += 1;
            return None;
        };
        if let Some(e) = evicted {
            removed.push((Tier::Host, e.block.seq_hash));
            self.demote(slot, e, removed);
        }
        self.incoming_host.insert(h);
        self.stores_in_flight += 1;
        Some(self.issue(
            CopyKind::Offload,
            BlockLoc::Device(device),
            BlockLoc::Host(slot),
            block,
        ))
    }

    /// An entry left G2 from `slot`: to G3 if it passes the frequency filter.
    fn demote(&mut self, slot: u32, e: Entry, removed: &mut Vec<(Tier, SequenceHash)>) {
        let min_hits = self.config.disk_min_hits;
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        let h = e.block.seq_hash;
        if e.hits < min_hits || disk.get(h).is_some() || self.incoming_disk.contains(&h) {
            return;
        }
        let Some((to, evicted)) = disk.reserve() else {
            return;
        };
        if let Some(old) = evicted {
            removed.push((Tier::Disk, old.block.seq_hash));
        }
        self.incoming_disk.insert(h);
        self.stores_in_flight += 1;
        self.issue(
            CopyKind::Demote,
            BlockLoc::Host(slot),
            BlockLoc::Disk(to),
            e.block,
        );
        self.demote_hits.insert(h, e.hits);
    }

    /// G1 evicted `h` after `hits` prefix reuses: G2's copy (if any) is now the only one.
    pub(super) fn on_device_evict(&mut self, h: SequenceHash, hits: u32) {
        if let Some(s) = self.host.get(h) {
            self.host.touch(s, hits);
        }
    }

    /// The lower-tier location of `h`: G2 first, then G3.
    pub(super) fn find(&self, h: SequenceHash) -> Option<BlockLoc> {
        if let Some(s) = self.host.get(h) {
            return Some(BlockLoc::Host(s));
        }
        self.disk
            .as_ref()
            .and_then(|d| d.get(h))
            .map(BlockLoc::Disk)
    }

    /// Starts the onboard of `hits` into the G1 blocks `targets` (same order) for `seq`.
    pub(super) fn onboard(&mut self, seq: SeqId, hits: &[LowerHit], targets: &[u32]) {
        let mut copies = Vec::with_capacity(hits.len());
        for (hit, &to) in hits.iter().zip(targets) {
            match hit.from {
                BlockLoc::Host(s) => self.host.pin(s),
                BlockLoc::Disk(s) => {
                    if let Some(d) = self.disk.as_mut() {
                        d.pin(s);
                    }
                }
                BlockLoc::Device(_) => continue,
            }
            copies.push((CopyId(self.next_copy), hit.from.tier(), None));
            self.issue(
                CopyKind::Onboard(seq),
                hit.from,
                BlockLoc::Device(to),
                hit.block,
            );
        }
        if !copies.is_empty() {
            self.onboarding.insert(seq, Onboarding { copies });
        }
    }

    /// Whether `seq` waits for onboard copies.
    pub(super) fn is_onboarding(&self, seq: SeqId) -> bool {
        self.onboarding.contains_key(&seq)
    }

    /// Copies returned (unknown or repeated ids are ignored).
    pub(super) fn done(&mut self, results: &[(CopyId, CopyOutcome)]) -> Landed {
        let mut out = Landed::default();
        for &(id, outcome) in results {
            let Some(copy) = self.pending.remove(&id) else {
                continue;
            };
            let ok = outcome == CopyOutcome::Done;
            if matches!(outcome, CopyOutcome::Failed | CopyOutcome::TierOff) {
                self.counters.copy_failures += 1;
            }
            if outcome == CopyOutcome::TierOff && self.disk.take().is_some() {
                out.disk_off = true;
            }
            let h = copy.block.seq_hash;
            match (copy.kind, copy.from, copy.to) {
                (CopyKind::Offload, BlockLoc::Device(_), BlockLoc::Host(slot)) => {
                    self.stores_in_flight -= 1;
                    self.incoming_host.remove(&h);
                    out.offloaded.push(id);
                    self.host.land(slot, ok.then_some((copy.block, 0)));
                    if ok {
                        self.counters.offloads += 1;
                        out.stored.push((Tier::Host, copy.block));
                    }
                }
                (CopyKind::Demote, _, BlockLoc::Disk(slot)) => {
                    self.stores_in_flight -= 1;
                    self.incoming_disk.remove(&h);
                    let hits = self.demote_hits.remove(&h).unwrap_or(0);
                    if let Some(d) = self.disk.as_mut() {
                        d.land(slot, ok.then_some((copy.block, hits)));
                    }
                    if ok {
                        self.counters.demotions += 1;
                        out.stored.push((Tier::Disk, copy.block));
                    }
                }
                (CopyKind::Onboard(seq), from, _) => {
                    let store = match from {
                        BlockLoc::Host(s) => Some((&mut self.host, s)),
                        BlockLoc::Disk(s) => self.disk.as_mut().map(|d| (d, s)),
                        BlockLoc::Device(_) => None,
                    };
                    if let Some((store, s)) = store {
                        if outcome == CopyOutcome::Corrupt {
                            self.counters.corrupt += 1;
                            if let Some(dead) = store.kill(s) {
                                out.removed.push((store.tier, dead));
                            }
                        }
                        store.unpin(s, ok);
                    }
                    if let Some(o) = self.onboarding.get_mut(&seq) {
                        if let Some(c) = o.copies.iter_mut().find(|c| c.0 == id) {
                            c.2 = Some(ok);
                        }
                        if o.copies.iter().all(|c| c.2.is_some()) {
                            let used: Vec<Tier> = o
                                .copies
                                .iter()
                                .take_while(|c| c.2 == Some(true))
                                .map(|c| c.1)
                                .collect();
                            for t in &used {
                                match t {
                                    Tier::Disk => self.counters.onboards_disk += 1,
                                    _ => self.counters.onboards_host += 1,
                                }
                            }
                            self.onboarding.remove(&seq);
                            out.onboarded.push((seq, used.len()));
                        }
                    }
                }
                _ => {}
            }
        }
        out
    }

    pub(super) fn usage(&self) -> TierUsage {
        TierUsage {
            host_blocks: self.host.len(),
            host_capacity: self.host.capacity,
            disk_blocks: self.disk.as_ref().map_or(0, Store::len),
            disk_capacity: self.disk.as_ref().map_or(0, |d| d.capacity),
            copies_in_flight: self.pending.len(),
            counters: self.counters,
        }
    }
}

/// Peer pulls (G4) of one replica since start: as the puller (asked, declined, pulled,
/// failed) and as the holder (exports). Every count is of requests, except `blocks`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerPullCounters {
    /// Fetch hints acted on: the holder was asked to pin its blocks.
    pub asked: u64,
    /// Fetch hints declined by the cost rule (the prefill here was cheaper than the pull).
    pub declined: u64,
    /// Pulls that landed.
    pub pulled: u64,
    /// Blocks those pulls brought.
    pub blocks: u64,
    /// Asks or pulls that failed (holder gone, slow, refused, transfer error): recomputed.
    pub failed: u64,
    /// Asks made moot: by admission the prefix was cached here after all (an earlier
    /// request computed or pulled it), so nothing was pulled and the holder was unpinned.
    /// Once every ask has settled, `asked = pulled + failed + moot`.
    #[serde(default)]
    pub moot: u64,
    /// As the holder: prefixes pinned for a peer to read.
    pub exported: u64,
}

impl std::ops::AddAssign for PeerPullCounters {
    /// Field by field (a fleet's sum over its workers).
    fn add_assign(&mut self, o: Self) {
        self.asked += o.asked;
        self.declined += o.declined;
        self.pulled += o.pulled;
        self.blocks += o.blocks;
        self.failed += o.failed;
        self.moot += o.moot;
        self.exported += o.exported;
    }
}

impl PeerPullCounters {
    /// No pull asked, declined or exported (what the fleet view leaves out).
    pub fn is_zero(&self) -> bool {
        *self == Self::default()
    }
}
