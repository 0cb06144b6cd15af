//! [`BlockPool`]: paged KV block ids, reference counts, prefix cache, eviction, KV events.
//!
//! See the parent module doc for the block life cycle, the registration rule, deduplication and
//! the eviction order; this file holds the code.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use super::events::{KvEvent, KvEventData, SnapshotBlock, StoredBlock, Tier};
use super::eviction::EvictionPolicy;
use super::hash::{block_hash, sequence_hash};
use super::lease::{ReturnQueue, SeqLease};
use super::tiers::{LowerTiers, TierConfig};
use crate::runtime::ids::{BlockHash, BlockId, EventId, SeqId, SequenceHash, WorkerId};

/// Errors of the block pool. None of them changes the pool (every operation is all-or-nothing).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("invalid block pool config: {0}")]
    InvalidConfig(&'static str),
    #[error("sequence {0} has an empty prompt")]
    EmptyPrompt(SeqId),
    #[error("sequence {0} already holds blocks")]
    DuplicateSequence(SeqId),
    #[error("sequence {0} holds no blocks in this pool")]
    UnknownSequence(SeqId),
    #[error("out of KV blocks: needed {needed}, free (incl. evictable) {free}")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("sequence {seq}: {computed} computed tokens exceed its {known} known tokens")]
    ComputedBeyondTokens {
        seq: SeqId,
        computed: usize,
        known: usize,
    },
    #[error("the lease of sequence {0} was issued by another pool")]
    ForeignLease(SeqId),
    #[error("invalid KV tier config: {0}")]
    InvalidTiers(&'static str),
}

/// Result of [`BlockPool::allocate_sequence`].
#[derive(Debug)]
pub struct Allocation {
    /// Leading prompt tokens whose KV is already cached in G1 (a multiple of the block size).
    pub cached_tokens: usize,
    /// Prompt tokens after those whose KV is being onboarded from a lower tier (a multiple of
    /// the block size; 0 without lower tiers): the sequence must not be scheduled until
    /// [`BlockPool::copies_done`] reports its onboard finished.
    pub onboard_tokens: usize,
    /// The sequence's blocks: cached prefix first, then fresh blocks for the rest (+1 slot).
    pub block_table: Vec<BlockId>,
    /// Hand back with [`BlockPool::free`].
    pub lease: SeqLease,
}

/// Block counts. `free_blocks + cached_blocks + used_blocks == total_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUsage {
    pub total_blocks: usize,
    /// Never-hashed blocks on the free list.
    pub free_blocks: usize,
    /// Registered blocks with refcount 0 (evictable, reusable by prefix).
    pub cached_blocks: usize,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: usize,
    /// Registered blocks, referenced or not.
    pub registered_blocks: usize,
    /// Sequences holding blocks.
    pub active_sequences: usize,
}

impl PoolUsage {
    /// Blocks an allocation may take: free plus evictable.
    pub fn available_blocks(&self) -> usize {
        self.free_blocks + self.cached_blocks
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Registration {
    pub(super) seq_hash: SequenceHash,
    pub(super) parent: Option<SequenceHash>,
    pub(super) block_hash: BlockHash,
    /// Index of the block in its sequence (parents have depth - 1).
    pub(super) depth: usize,
}

#[derive(Debug, Clone, Default)]
pub(super) struct BlockMeta {
    pub(super) ref_count: u32,
    pub(super) reg: Option<Registration>,
    /// Full, computed, but a duplicate of the registered block with this sequence hash.
    pub(super) dup_of: Option<SequenceHash>,
    /// `Some(key)` iff the block is in the evictable set.
    pub(super) evict_key: Option<u64>,
    pub(super) hits: u32,
}

#[derive(Debug, Clone)]
pub(super) struct SeqState {
    pub(super) tokens: Vec<u32>,
    pub(super) table: Vec<BlockId>,
    /// Tokens whose KV the engine has written.
    pub(super) num_computed: usize,
    /// Leading blocks already registered or deduplicated.
    pub(super) hashed_blocks: usize,
    pub(super) last_seq_hash: Option<SequenceHash>,
    /// Unique per allocation: offload copies of its blocks name it.
    pub(super) table_id: u64,
}

/// The block pool of one replica (see the module doc).
#[derive(Debug)]
pub struct BlockPool {
    pub(super) block_size: usize,
    pub(super) salt: u64,
    pub(super) worker: WorkerId,
    pub(super) policy: EvictionPolicy,
    /// Blocks in the pool; `blocks` holds the metadata of those handed out at least once
    /// (ids `0..blocks.len()`), the rest are free and untouched.
    pub(super) num_blocks: usize,
    pub(super) blocks: Vec<BlockMeta>,
    /// Stack of free blocks (pops the lowest id first on a fresh pool).
    pub(super) free: Vec<BlockId>,
    pub(super) evictable: BTreeSet<(u64, BlockId)>,
    pub(super) index: HashMap<SequenceHash, BlockId>,
    pub(super) dups: HashMap<SequenceHash, Vec<BlockId>>,
    pub(super) seqs: HashMap<SeqId, SeqState>,
    pub(super) outbox: Vec<KvEvent>,
    /// With [`BlockPool::with_token_events`]: the tokens of each `Stored` event in the outbox
    /// that [`BlockPool::mark_computed`] emitted, by event id.
    pub(super) token_outbox: Option<Vec<(EventId, Vec<u32>)>>,
    pub(super) next_event_id: u64,
    pub(super) tick: u64,
    pub(super) returns: ReturnQueue,
    pub(super) leaked: u64,
    /// G2 and G3 (`kv/tiers.rs`), when configured.
    pub(super) tiers: Option<LowerTiers>,
    pub(super) next_table_id: u64,
    /// Offload copies in flight per table (see [`BlockPool::free`]).
    pub(super) offloads_of: HashMap<u64, u32>,
    /// The table each offload in flight belongs to.
    pub(super) offload_table: HashMap<super::tiers::CopyId, u64>,
    /// Tables of freed sequences kept until their offloads return.
    pub(super) lingering: HashMap<u64, Vec<BlockId>>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens, hashing with `salt`.
    ///
    /// # Errors
    /// [`PoolError::InvalidConfig`] when `num_blocks` is 0 or does not fit in a `u32`, or
    /// `block_size` is 0.
    pub fn new(num_blocks: usize, block_size: usize, salt: u64) -> Result<Self, PoolError> {
        if num_blocks == 0 || num_blocks > u32::MAX as usize {
            return Err(PoolError::InvalidConfig(
                "num_blocks must be in 1..=u32::MAX",
            ));
        }
        if block_size == 0 {
            return Err(PoolError::InvalidConfig("block_size must be at least 1"));
        }
        Ok(Self {
            block_size,
            salt,
            worker: WorkerId::default(),
            policy: EvictionPolicy::for_pool(num_blocks),
            num_blocks,
            blocks: Vec::new(),
            free: Vec::new(),
            evictable: BTreeSet::new(),
            index: HashMap::new(),
            dups: HashMap::new(),
            seqs: HashMap::new(),
            outbox: Vec::new(),
            token_outbox: None,
            next_event_id: 1,
            tick: 0,
            returns: Arc::new(Mutex::new(Vec::new())),
            leaked: 0,
            tiers: None,
            next_table_id: 0,
            offloads_of: HashMap::new(),
            offload_table: HashMap::new(),
            lingering: HashMap::new(),
        })
    }

    /// Stamps events with `worker`.
    pub fn with_worker(mut self, worker: WorkerId) -> Self {
        self.worker = worker;
        self
    }

    /// Also keep the token ids of newly registered blocks, for consumers whose event format
    /// carries them (vLLM's `BlockStored.token_ids`: `kv/vllm.rs`); drained with
    /// [`BlockPool::drain_event_tokens`].
    pub fn with_token_events(mut self) -> Self {
        self.token_outbox = Some(Vec::new());
        self
    }

    /// Adds lower tiers (G2 host, G3 disk: `kv/tiers.rs`); a config with no tier on leaves
    /// the pool as it is.
    ///
    /// # Errors
    /// [`PoolError::InvalidTiers`] ([`TierConfig::validate`]).
    pub fn with_tiers(mut self, config: TierConfig) -> Result<Self, PoolError> {
        config.validate().map_err(PoolError::InvalidTiers)?;
        self.tiers = config.is_on().then(|| LowerTiers::new(config));
        Ok(self)
    }

    /// Replaces the eviction policy.
    pub fn with_eviction_policy(mut self, policy: EvictionPolicy) -> Self {
        self.policy = policy;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Free blocks: released ones, and those never handed out yet.
    fn free_len(&self) -> usize {
        self.free.len() + (self.num_blocks - self.blocks.len())
    }

    pub fn salt(&self) -> u64 {
        self.salt
    }

    /// Blocks needed to hold `num_tokens` token slots.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Number of leading tokens of `tokens` whose KV is cached (full blocks only, and never the
    /// last token: the engine always has at least one token to compute).
    pub fn match_prefix(&self, tokens: &[u32]) -> usize {
        self.prefix_hits(tokens).len() * self.block_size
    }

    fn prefix_hits(&self, tokens: &[u32]) -> Vec<(BlockId, SequenceHash)> {
        let Some(last) = tokens.len().checked_sub(1) else {
            return Vec::new();
        };
        let mut hits = Vec::new();
        let mut parent = None;
        for chunk in tokens[..last].chunks_exact(self.block_size) {
            let sh = sequence_hash(parent, block_hash(chunk, self.salt), self.salt);
            let Some(&b) = self.index.get(&sh) else { break };
            hits.push((b, sh));
            parent = Some(sh);
        }
        hits
    }

    /// Pins the cached prefix of `prompt` and allocates fresh blocks for the rest of it plus
    /// one slot (the first sampled token), evicting as needed. All-or-nothing.
    ///
    /// # Errors
    /// [`PoolError::EmptyPrompt`], [`PoolError::DuplicateSequence`] when `seq` already holds
    /// blocks, [`PoolError::OutOfBlocks`] when free and evictable blocks do not suffice.
    pub fn allocate_sequence(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
    ) -> Result<Allocation, PoolError> {
        self.allocate(seq, prompt, false, true)
    }

    /// [`BlockPool::allocate_sequence`] without the prefix cache: fresh blocks for the whole
    /// prompt plus one slot, so that every position is computed (prompt log-probabilities
    /// need each position's logits, which a cached block does not hold). The cache is neither
    /// read nor harmed: once computed, blocks whose prefix is already cached stay unregistered
    /// duplicates ([`BlockPool::mark_computed`]) and return to the free list when freed.
    ///
    /// # Errors
    /// As [`BlockPool::allocate_sequence`].
    pub fn allocate_uncached(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
    ) -> Result<Allocation, PoolError> {
        self.allocate(seq, prompt, false, false)
    }

    /// [`BlockPool::allocate_sequence`], and the blocks after the G1 prefix hit that a lower
    /// tier holds (G2 first, then G3, up to the first block in neither) are onboarded: their
    /// copies wait in [`BlockPool::drain_copies`] and [`Allocation::onboard_tokens`] counts
    /// them. Without lower tiers, the same as `allocate_sequence`.
    ///
    /// # Errors
    /// As [`BlockPool::allocate_sequence`].
    pub fn allocate_onboarding(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
    ) -> Result<Allocation, PoolError> {
        self.allocate(seq, prompt, true, true)
    }

    fn allocate(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        onboard: bool,
        cached: bool,
    ) -> Result<Allocation, PoolError> {
        self.reclaim_leaked();
        if prompt.is_empty() {
            return Err(PoolError::EmptyPrompt(seq));
        }
        if self.seqs.contains_key(&seq) {
            return Err(PoolError::DuplicateSequence(seq));
        }
        let hits = if cached {
            self.prefix_hits(prompt)
        } else {
            Vec::new()
        };
        let fresh = self.blocks_for(prompt.len() + 1) - hits.len();
        let pinned_evictable = hits
            .iter()
            .filter(|(b, _)| self.blocks[b.0 as usize].ref_count == 0)
            .count();
        let available = self.free_len() + self.evictable.len() - pinned_evictable;
        if fresh > available {
            return Err(PoolError::OutOfBlocks {
                needed: fresh,
                free: available,
            });
        }
        let mut table = Vec::with_capacity(hits.len() + fresh);
        for &(b, _) in &hits {
            self.pin(b);
            table.push(b);
        }
        let mut removed = Vec::new();
        for _ in 0..fresh {
            // Cannot fail: `fresh <= available` was checked above.
            if let Some(b) = self.take_block(&mut removed) {
                table.push(b);
            }
        }
        self.emit_removed(removed);
        let lower = if onboard {
            self.lower_hits(prompt, hits.len(), hits.last().map(|&(_, h)| h))
        } else {
            Vec::new()
        };
        if let Some(t) = self.tiers.as_mut()
            && !lower.is_empty()
        {
            let targets: Vec<u32> = table[hits.len()..hits.len() + lower.len()]
                .iter()
                .map(|b| b.0)
                .collect();
            t.onboard(seq, &lower, &targets);
        }
        let cached_tokens = hits.len() * self.block_size;
        self.next_table_id += 1;
        self.seqs.insert(
            seq,
            SeqState {
                tokens: prompt.to_vec(),
                table: table.clone(),
                num_computed: cached_tokens,
                hashed_blocks: hits.len(),
                last_seq_hash: hits.last().map(|&(_, h)| h),
                table_id: self.next_table_id,
            },
        );
        Ok(Allocation {
            cached_tokens,
            onboard_tokens: lower.len() * self.block_size,
            block_table: table,
            lease: SeqLease::new(seq, Arc::clone(&self.returns)),
        })
    }

    /// Peer pull, holder side: pins the leading full blocks of `tokens` that G1 holds (every
    /// full block may count, the last token's included: nothing is computed here) under `seq`,
    /// so that a peer can read them; hand the lease back with [`BlockPool::free`] when the
    /// peer confirms or the hold ends. Returns the pinned blocks in order (empty: none held,
    /// and nothing is pinned).
    ///
    /// # Errors
    /// [`PoolError::DuplicateSequence`] when `seq` already holds blocks.
    pub fn pin_cached(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
    ) -> Result<(Vec<BlockId>, Option<SeqLease>), PoolError> {
        self.reclaim_leaked();
        if self.seqs.contains_key(&seq) {
            return Err(PoolError::DuplicateSequence(seq));
        }
        let mut hits = Vec::new();
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block_size) {
            let sh = sequence_hash(parent, block_hash(chunk, self.salt), self.salt);
            let Some(&b) = self.index.get(&sh) else { break };
            hits.push((b, sh));
            parent = Some(sh);
        }
        if hits.is_empty() {
            return Ok((Vec::new(), None));
        }
        let table: Vec<BlockId> = hits.iter().map(|&(b, _)| b).collect();
        for &b in &table {
            self.pin(b);
        }
        let n = hits.len() * self.block_size;
        self.next_table_id += 1;
        self.seqs.insert(
            seq,
            SeqState {
                tokens: tokens[..n].to_vec(),
                table: table.clone(),
                num_computed: n,
                hashed_blocks: hits.len(),
                last_seq_hash: hits.last().map(|&(_, h)| h),
                table_id: self.next_table_id,
            },
        );
        Ok((table, Some(SeqLease::new(seq, Arc::clone(&self.returns)))))
    }

    /// Leading tokens of `prompt` this pool can serve without computing them: the G1 prefix
    /// hit and the blocks after it that a lower tier holds (full blocks, never the last
    /// token).
    pub fn cached_lead(&self, prompt: &[u32]) -> usize {
        let hits = self.prefix_hits(prompt);
        let lower = self.lower_hits(prompt, hits.len(), hits.last().map(|&(_, h)| h));
        (hits.len() + lower.len()) * self.block_size
    }

    /// Grows `seq`'s block table to hold at least `num_slots` token slots. All-or-nothing.
    ///
    /// # Errors
    /// [`PoolError::UnknownSequence`], or [`PoolError::OutOfBlocks`] when free and evictable
    /// blocks do not suffice.
    pub fn reserve(&mut self, seq: SeqId, num_slots: usize) -> Result<(), PoolError> {
        self.reclaim_leaked();
        let have = self
            .seqs
            .get(&seq)
            .ok_or(PoolError::UnknownSequence(seq))?
            .table
            .len();
        let needed = self.blocks_for(num_slots).saturating_sub(have);
        let available = self.free_len() + self.evictable.len();
        if needed > available {
            return Err(PoolError::OutOfBlocks {
                needed,
                free: available,
            });
        }
        let mut removed = Vec::new();
        let mut fresh = Vec::with_capacity(needed);
        for _ in 0..needed {
            if let Some(b) = self.take_block(&mut removed) {
                fresh.push(b);
            }
        }
        self.emit_removed(removed);
        if let Some(st) = self.seqs.get_mut(&seq) {
            st.table.extend(fresh);
        }
        Ok(())
    }

    /// Appends known tokens (e.g. sampled ones) to `seq`, growing its table to hold them.
    /// All-or-nothing. Blocks are registered by [`BlockPool::mark_computed`], not here.
    ///
    /// # Errors
    /// As [`BlockPool::reserve`].
    pub fn append_tokens(&mut self, seq: SeqId, new_tokens: &[u32]) -> Result<(), PoolError> {
        let known = self
            .seqs
            .get(&seq)
            .ok_or(PoolError::UnknownSequence(seq))?
            .tokens
            .len();
        self.reserve(seq, known + new_tokens.len())?;
        if let Some(st) = self.seqs.get_mut(&seq) {
            st.tokens.extend_from_slice(new_tokens);
        }
        Ok(())
    }

    /// Records that the engine has written the KV of `seq`'s first `num_computed` tokens;
    /// registers every block that became full and computed (emitting `Stored`), deduplicating
    /// against blocks already registered. Smaller values than before are ignored. Returns the
    /// number of blocks registered.
    ///
    /// # Errors
    /// [`PoolError::UnknownSequence`], or [`PoolError::ComputedBeyondTokens`] when
    /// `num_computed` exceeds the tokens the pool knows for `seq`.
    pub fn mark_computed(&mut self, seq: SeqId, num_computed: usize) -> Result<usize, PoolError> {
        self.reclaim_leaked();
        let mut st = self
            .seqs
            .remove(&seq)
            .ok_or(PoolError::UnknownSequence(seq))?;
        if num_computed > st.tokens.len() {
            let known = st.tokens.len();
            self.seqs.insert(seq, st);
            return Err(PoolError::ComputedBeyondTokens {
                seq,
                computed: num_computed,
                known,
            });
        }
        st.num_computed = st.num_computed.max(num_computed);
        let bs = self.block_size;
        let mut registered = 0;
        let mut group: Vec<StoredBlock> = Vec::new();
        let mut group_tokens: Vec<u32> = Vec::new();
        let keep_tokens = self.token_outbox.is_some();
        let mut group_parent = st.last_seq_hash;
        let mut offload = Vec::new();
        while (st.hashed_blocks + 1) * bs <= st.num_computed {
            let i = st.hashed_blocks;
            let bh = block_hash(&st.tokens[i * bs..(i + 1) * bs], self.salt);
            let sh = sequence_hash(st.last_seq_hash, bh, self.salt);
            let b = st.table[i];
            if self.index.contains_key(&sh) {
                // Dedup: the existing block stays registered, ours stays unregistered.
                self.blocks[b.0 as usize].dup_of = Some(sh);
                self.dups.entry(sh).or_default().push(b);
                self.emit_stored_tokens(
                    group_parent,
                    std::mem::take(&mut group),
                    std::mem::take(&mut group_tokens),
                );
                group_parent = Some(sh);
            } else {
                self.blocks[b.0 as usize].reg = Some(Registration {
                    seq_hash: sh,
                    parent: st.last_seq_hash,
                    block_hash: bh,
                    depth: i,
                });
                self.index.insert(sh, b);
                if self.tiers.is_some() {
                    offload.push((
                        b,
                        SnapshotBlock {
                            seq_hash: sh,
                            parent: st.last_seq_hash,
                            block_hash: bh,
                        },
                    ));
                }
                group.push(StoredBlock {
                    seq_hash: sh,
                    block_hash: bh,
                });
                if keep_tokens {
                    group_tokens.extend_from_slice(&st.tokens[i * bs..(i + 1) * bs]);
                }
                registered += 1;
            }
            st.last_seq_hash = Some(sh);
            st.hashed_blocks += 1;
        }
        self.emit_stored_tokens(group_parent, group, group_tokens);
        let table_id = st.table_id;
        self.seqs.insert(seq, st);
        self.offload(table_id, offload);
        Ok(registered)
    }

    /// Hands a lease back: decrements refcounts (tail blocks first, so a chain is evicted
    /// child-first); registered blocks reaching 0 become evictable, others return to the free
    /// list.
    ///
    /// # Errors
    /// [`PoolError::ForeignLease`] for a lease of another pool (dropping it queues the release
    /// there), [`PoolError::UnknownSequence`] when the sequence holds no blocks here.
    pub fn free(&mut self, lease: SeqLease) -> Result<(), PoolError> {
        self.reclaim_leaked();
        let seq = lease.seq();
        if !lease.belongs_to(&self.returns) {
            // Dropping the foreign lease queues the release in the pool that issued it.
            return Err(PoolError::ForeignLease(seq));
        }
        lease.disarm();
        if self.release_seq(seq) {
            Ok(())
        } else {
            Err(PoolError::UnknownSequence(seq))
        }
    }

    /// Frees the sequences whose lease was dropped without [`BlockPool::free`]. Every
    /// mutating method calls this first. Returns how many were freed.
    pub fn reclaim_leaked(&mut self) -> usize {
        let queued = {
            let mut q = self.returns.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::take(&mut *q)
        };
        let mut n = 0;
        for seq in queued {
            if self.release_seq(seq) {
                n += 1;
            }
        }
        self.leaked += n as u64;
        n
    }

    /// Leases dropped without being handed back, since creation.
    pub fn leaked_leases(&self) -> u64 {
        self.leaked
    }

    /// Evicts up to `n` evictable blocks (lowest eviction key first); returns how many.
    pub fn evict(&mut self, n: usize) -> usize {
        self.reclaim_leaked();
        let mut removed = Vec::new();
        let mut done = 0;
        while done < n && self.evict_one(&mut removed) {
            done += 1;
        }
        self.emit_removed(removed);
        done
    }

    /// Drops every unreferenced registered block and emits `Cleared`, followed by one `Stored`
    /// per surviving (pinned) registered block, parents first, so a consumer that applies the
    /// events holds exactly [`BlockPool::snapshot`].
    pub fn clear(&mut self) {
        self.reclaim_leaked();
        let mut removed = Vec::new();
        while self.evict_one(&mut removed) {}
        self.emit(KvEventData::Cleared);
        for b in self.snapshot() {
            let stored = StoredBlock {
                seq_hash: b.seq_hash,
                block_hash: b.block_hash,
            };
            self.emit_stored(b.parent, vec![stored]);
        }
    }

    /// Block counts.
    pub fn usage(&self) -> PoolUsage {
        let total = self.num_blocks;
        let free = self.free_len();
        let cached = self.evictable.len();
        PoolUsage {
            total_blocks: total,
            free_blocks: free,
            cached_blocks: cached,
            used_blocks: total - free - cached,
            registered_blocks: self.index.len(),
            active_sequences: self.seqs.len(),
        }
    }

    /// Every registered block, parents before children (sorted by depth, then hash).
    pub fn snapshot(&self) -> Vec<SnapshotBlock> {
        let mut regs: Vec<Registration> = self
            .index
            .values()
            .filter_map(|b| self.blocks[b.0 as usize].reg)
            .collect();
        regs.sort_by_key(|r| (r.depth, r.seq_hash));
        regs.into_iter()
            .map(|r| SnapshotBlock {
                seq_hash: r.seq_hash,
                parent: r.parent,
                block_hash: r.block_hash,
            })
            .collect()
    }

    /// Takes the events accumulated since the last call, in id order.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.outbox)
    }

    /// With [`BlockPool::with_token_events`]: the token ids of the `Stored` events emitted
    /// since the last call (by event id; `block_size` per block, in order). A `Stored` event
    /// of [`BlockPool::clear`] re-announces blocks registered earlier and has no entry: the
    /// consumer knows their tokens from the first announcement.
    pub fn drain_event_tokens(&mut self) -> Vec<(EventId, Vec<u32>)> {
        self.token_outbox
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// `seq`'s block table.
    pub fn block_table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.seqs.get(&seq).map(|s| s.table.as_slice())
    }

    /// Tokens of `seq` whose KV is written (per [`BlockPool::mark_computed`]).
    pub fn num_computed(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.num_computed)
    }

    fn pin(&mut self, b: BlockId) {
        let m = &mut self.blocks[b.0 as usize];
        if let Some(k) = m.evict_key.take() {
            self.evictable.remove(&(k, b));
        }
        m.ref_count += 1;
        m.hits = m.hits.saturating_add(1);
    }

    pub(super) fn release(&mut self, b: BlockId) {
        let m = &mut self.blocks[b.0 as usize];
        m.ref_count = m.ref_count.saturating_sub(1);
        if m.ref_count > 0 {
            return;
        }
        if m.reg.is_some() {
            self.make_evictable(b);
        } else if let Some(h) = m.dup_of.take() {
            if let Some(v) = self.dups.get_mut(&h) {
                v.retain(|&d| d != b);
                if v.is_empty() {
                    self.dups.remove(&h);
                }
            }
            self.free.push(b);
            // Releasing a duplicate counts as a use of the registered block it duplicates,
            // so that a parent is never older than its children in the eviction order.
            if let Some(&holder) = self.index.get(&h)
                && self.blocks[holder.0 as usize].ref_count == 0
            {
                self.make_evictable(holder);
            }
        } else {
            self.free.push(b);
        }
    }

    /// (Re)inserts a refcount-0 registered block into the evictable set with a fresh key.
    fn make_evictable(&mut self, b: BlockId) {
        self.tick += 1;
        let m = &mut self.blocks[b.0 as usize];
        if let Some(k) = m.evict_key.take() {
            self.evictable.remove(&(k, b));
        }
        let hits = u64::from(m.hits.min(self.policy.max_counted_hits));
        let key = self.tick + self.policy.freq_bonus_ticks_per_hit * hits;
        m.evict_key = Some(key);
        self.evictable.insert((key, b));
    }

    fn release_seq(&mut self, seq: SeqId) -> bool {
        let Some(st) = self.seqs.remove(&seq) else {
            return false;
        };
        if self.offloads_of.contains_key(&st.table_id) {
            // Offloads of its blocks are in flight: the whole table stays (so a block being
            // read is not reused, and no parent is evicted before its child).
            self.lingering.insert(st.table_id, st.table);
            return true;
        }
        self.release_table(&st.table);
        true
    }

    /// Releases a table's blocks, tail first.
    pub(super) fn release_table(&mut self, table: &[BlockId]) {
        for &b in table.iter().rev() {
            self.release(b);
        }
    }

    /// A free block with refcount 1, evicting one if the free list is empty.
    fn take_block(&mut self, removed: &mut Vec<SequenceHash>) -> Option<BlockId> {
        if self.free_len() == 0 && !self.evict_one(removed) {
            return None;
        }
        // Released blocks first (last released, first reused); then one never handed out,
        // in id order (a pool's metadata grows with the blocks it has used, so an idle
        // replica of a large simulated fleet costs no memory).
        let b = match self.free.pop() {
            Some(b) => b,
            None if self.blocks.len() < self.num_blocks => {
                self.blocks.push(BlockMeta::default());
                BlockId((self.blocks.len() - 1) as u32)
            }
            None => return None,
        };
        self.blocks[b.0 as usize].ref_count = 1;
        Some(b)
    }

    /// Evicts the evictable block with the smallest key onto the free list. If an in-use
    /// duplicate of it exists, the registration moves to the duplicate (no event: the set of
    /// held sequence hashes is unchanged); otherwise its hash is pushed onto `removed`.
    fn evict_one(&mut self, removed: &mut Vec<SequenceHash>) -> bool {
        let Some((key, b)) = self.evictable.pop_first() else {
            return false;
        };
        let m = &mut self.blocks[b.0 as usize];
        debug_assert_eq!(m.evict_key, Some(key));
        m.evict_key = None;
        let hits = std::mem::take(&mut m.hits);
        if let Some(reg) = m.reg.take() {
            let dup = self.dups.get_mut(&reg.seq_hash).and_then(|v| v.pop());
            if self.dups.get(&reg.seq_hash).is_some_and(|v| v.is_empty()) {
                self.dups.remove(&reg.seq_hash);
            }
            if let Some(d) = dup {
                let dm = &mut self.blocks[d.0 as usize];
                dm.dup_of = None;
                dm.reg = Some(reg);
                dm.hits = hits;
                self.index.insert(reg.seq_hash, d);
            } else {
                self.index.remove(&reg.seq_hash);
                removed.push(reg.seq_hash);
                if let Some(t) = self.tiers.as_mut() {
                    t.on_device_evict(reg.seq_hash, hits);
                }
            }
        }
        self.free.push(b);
        true
    }

    fn emit(&mut self, data: KvEventData) {
        self.emit_in(Tier::Device, data);
    }

    pub(super) fn emit_in(&mut self, tier: Tier, data: KvEventData) {
        self.outbox.push(KvEvent {
            worker: self.worker.clone(),
            event_id: EventId(self.next_event_id),
            tier,
            data,
        });
        self.next_event_id += 1;
    }

    fn emit_stored(&mut self, parent: Option<SequenceHash>, blocks: Vec<StoredBlock>) {
        if !blocks.is_empty() {
            self.emit(KvEventData::Stored { parent, blocks });
        }
    }

    fn emit_stored_tokens(
        &mut self,
        parent: Option<SequenceHash>,
        blocks: Vec<StoredBlock>,
        tokens: Vec<u32>,
    ) {
        if blocks.is_empty() {
            return;
        }
        let id = EventId(self.next_event_id);
        self.emit_stored(parent, blocks);
        if let Some(out) = self.token_outbox.as_mut() {
            out.push((id, tokens));
        }
    }

    fn emit_removed(&mut self, blocks: Vec<SequenceHash>) {
        if !blocks.is_empty() {
            self.emit(KvEventData::Removed { blocks });
        }
    }
}
