//! The pool's side of the lower tiers (`tiers.rs`): [`BlockPool`]'s methods that offload
//! newly registered blocks, find a prefix's blocks below G1, take copies' outcomes back and
//! list each tier's contents.

use super::events::{KvEventData, SnapshotBlock, StoredBlock, Tier};
use super::hash::{block_hash, sequence_hash};
use super::pool::BlockPool;
use super::tiers::{CopyId, CopyOutcome, LowerHit, LowerTiers, TierCopy, TierUsage};
use crate::runtime::ids::{BlockId, SeqId, SequenceHash};

impl BlockPool {
    /// The copies issued since the last call, in issue order (see the module doc of
    /// `kv/tiers.rs` for the lanes and the contract). Empty without lower tiers.
    pub fn drain_copies(&mut self) -> Vec<TierCopy> {
        self.tiers
            .as_mut()
            .map(LowerTiers::drain)
            .unwrap_or_default()
    }

    /// Copies returned: stores land in their tier (`Stored {tier}`), offload holds end,
    /// corrupt entries are dropped (`Removed {tier}`), and each sequence whose onboard copies
    /// have all returned is listed with the tokens now computed for it — its G1 prefix hit
    /// plus the leading onboarded blocks that arrived intact. Pass that count to
    /// [`BlockPool::mark_computed`] (the scheduler does) to register them. A sequence freed
    /// meanwhile is listed with 0. Unknown or repeated ids are ignored.
    pub fn copies_done(&mut self, results: &[(CopyId, CopyOutcome)]) -> Vec<(SeqId, usize)> {
        self.reclaim_leaked();
        let Some(t) = self.tiers.as_mut() else {
            return Vec::new();
        };
        let landed = t.done(results);
        for id in landed.offloaded {
            let Some(table) = self.offload_table.remove(&id) else {
                continue;
            };
            let left = self.offloads_of.get_mut(&table).map(|n| {
                *n -= 1;
                *n
            });
            if left == Some(0) {
                self.offloads_of.remove(&table);
                if let Some(blocks) = self.lingering.remove(&table) {
                    self.release_table(&blocks);
                }
            }
        }
        self.emit_lower_removed(&landed.removed);
        self.emit_lower_stored(&landed.stored);
        if landed.disk_off {
            self.emit_in(Tier::Disk, KvEventData::Cleared);
        }
        let bs = self.block_size;
        landed
            .onboarded
            .into_iter()
            .map(|(seq, intact)| {
                let computed = self.seqs.get(&seq).map_or(0, |st| {
                    (st.num_computed + intact * bs).min(st.tokens.len().saturating_sub(1))
                });
                (seq, computed)
            })
            .collect()
    }

    /// Whether `seq` waits for onboard copies.
    pub fn is_onboarding(&self, seq: SeqId) -> bool {
        self.tiers.as_ref().is_some_and(|t| t.is_onboarding(seq))
    }

    /// Lower tiers' use and counters; `None` without lower tiers.
    pub fn tier_usage(&self) -> Option<TierUsage> {
        self.tiers.as_ref().map(LowerTiers::usage)
    }

    /// The blocks `tier` holds (G1: [`BlockPool::snapshot`]), parents before children where
    /// both are held (sorted by hash otherwise).
    pub fn snapshot_tier(&self, tier: Tier) -> Vec<SnapshotBlock> {
        let store = match (tier, self.tiers.as_ref()) {
            (Tier::Device, _) => return self.snapshot(),
            (Tier::Host, Some(t)) => Some(&t.host),
            (Tier::Disk, Some(t)) => t.disk.as_ref(),
            _ => None,
        };
        let Some(store) = store else {
            return Vec::new();
        };
        let mut blocks: Vec<SnapshotBlock> = store.blocks().copied().collect();
        blocks.sort_by_key(|b| b.seq_hash);
        super::events::parents_first(blocks)
    }

    /// The blocks of `prompt` after its first `skip` (the G1 hit, ending at `parent`) that a
    /// lower tier holds, up to the first block in neither (never the last prompt token).
    pub(super) fn lower_hits(
        &self,
        prompt: &[u32],
        skip: usize,
        mut parent: Option<SequenceHash>,
    ) -> Vec<LowerHit> {
        let Some(t) = self.tiers.as_ref() else {
            return Vec::new();
        };
        let Some(last) = prompt.len().checked_sub(1) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for chunk in prompt[..last].chunks_exact(self.block_size).skip(skip) {
            let bh = block_hash(chunk, self.salt);
            let sh = sequence_hash(parent, bh, self.salt);
            let Some(from) = t.find(sh) else { break };
            out.push(LowerHit {
                from,
                block: SnapshotBlock {
                    seq_hash: sh,
                    parent,
                    block_hash: bh,
                },
            });
            parent = Some(sh);
        }
        out
    }

    /// Offloads newly registered G1 blocks of the table `table_id`; the table stays whole
    /// until they return, even if its sequence is freed.
    pub(super) fn offload(&mut self, table_id: u64, blocks: Vec<(BlockId, SnapshotBlock)>) {
        let Some(t) = self.tiers.as_mut() else {
            return;
        };
        let mut removed = Vec::new();
        for (b, block) in blocks {
            if let Some(id) = t.offload(b.0, block, &mut removed) {
                self.offload_table.insert(id, table_id);
                *self.offloads_of.entry(table_id).or_default() += 1;
            }
        }
        self.emit_lower_removed(&removed);
    }

    /// `Removed {tier}` events for lower-tier blocks that left, one per tier.
    fn emit_lower_removed(&mut self, removed: &[(Tier, SequenceHash)]) {
        for tier in [Tier::Host, Tier::Disk] {
            let hs: Vec<SequenceHash> = removed
                .iter()
                .filter(|(t, _)| *t == tier)
                .map(|(_, h)| *h)
                .collect();
            if !hs.is_empty() {
                self.emit_in(tier, KvEventData::Removed { blocks: hs });
            }
        }
    }

    /// `Stored {tier}` events for blocks that landed, consecutive chain members grouped.
    fn emit_lower_stored(&mut self, stored: &[(Tier, SnapshotBlock)]) {
        let mut i = 0;
        while i < stored.len() {
            let (tier, first) = stored[i];
            let mut blocks = vec![StoredBlock {
                seq_hash: first.seq_hash,
                block_hash: first.block_hash,
            }];
            let mut j = i + 1;
            while j < stored.len()
                && stored[j].0 == tier
                && stored[j].1.parent == Some(stored[j - 1].1.seq_hash)
            {
                blocks.push(StoredBlock {
                    seq_hash: stored[j].1.seq_hash,
                    block_hash: stored[j].1.block_hash,
                });
                j += 1;
            }
            self.emit_in(
                tier,
                KvEventData::Stored {
                    parent: first.parent,
                    blocks,
                },
            );
            i = j;
        }
    }
}
