//! Test-only consistency checker for [`BlockPool`] (used by the seeded invariant tests here
//! and by the scheduler's tests).

use std::collections::{HashMap, HashSet};

use super::events::Tier;
use super::hash::block_hashes;
use super::pool::BlockPool;
use super::tiers::{BlockLoc, CopyKind, Slot};
use crate::runtime::ids::BlockId;

impl BlockPool {
    /// Checks every structural invariant; the error names the first one broken.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let touched = self.blocks.len();
        let total = self.num_blocks;
        if touched > total {
            return Err(format!("{touched} blocks used of a pool of {total}"));
        }
        let mut on_free = vec![0u32; touched];
        for b in &self.free {
            on_free[b.0 as usize] += 1;
        }
        let mut refs: HashMap<BlockId, u32> = HashMap::new();
        for table in self.lingering.values() {
            for &b in table {
                *refs.entry(b).or_default() += 1;
            }
        }
        for (seq, st) in &self.seqs {
            let mut seen = HashSet::new();
            for &b in &st.table {
                if !seen.insert(b) {
                    return Err(format!("block {b} twice in the table of sequence {seq}"));
                }
                *refs.entry(b).or_default() += 1;
            }
            let bs = self.block_size;
            if st.table.len() * bs < st.tokens.len() {
                return Err(format!("sequence {seq}: table too small for its tokens"));
            }
            if st.hashed_blocks * bs > st.num_computed || st.num_computed > st.tokens.len() {
                return Err(format!(
                    "sequence {seq}: hashed/computed/known out of order"
                ));
            }
            let expect = block_hashes(&st.tokens[..st.hashed_blocks * bs], bs, self.salt);
            for (i, &b) in st.table.iter().enumerate() {
                let m = &self.blocks[b.0 as usize];
                if i < st.hashed_blocks {
                    let h = expect[i].1;
                    let ok = m.reg.is_some_and(|r| r.seq_hash == h) || m.dup_of == Some(h);
                    if !ok {
                        return Err(format!(
                            "sequence {seq}: block {i} ({b}) not registered as {h}"
                        ));
                    }
                } else if m.reg.is_some() || m.dup_of.is_some() {
                    return Err(format!(
                        "sequence {seq}: unhashed block {i} ({b}) has a hash"
                    ));
                }
            }
            if st.last_seq_hash != expect.last().map(|e| e.1) {
                return Err(format!("sequence {seq}: last_seq_hash mismatch"));
            }
        }
        // Blocks never handed out are free.
        let (mut nfree, mut nevict, mut nused, mut nreg) = (total - touched, 0, 0, 0);
        for (i, m) in self.blocks.iter().enumerate() {
            let b = BlockId(i as u32);
            let expect_refs = refs.get(&b).copied().unwrap_or(0);
            if m.ref_count != expect_refs {
                return Err(format!(
                    "block {b}: refcount {} != {expect_refs} users",
                    m.ref_count
                ));
            }
            let in_evict = m
                .evict_key
                .is_some_and(|k| self.evictable.contains(&(k, b)));
            let states = [on_free[i] > 0, in_evict, m.ref_count > 0];
            if states.iter().filter(|&&s| s).count() != 1 || on_free[i] > 1 {
                return Err(format!("block {b}: not in exactly one state {states:?}"));
            }
            if on_free[i] > 0 {
                nfree += 1;
                if m.reg.is_some() || m.dup_of.is_some() || m.evict_key.is_some() {
                    return Err(format!("free block {b} carries metadata"));
                }
            } else if in_evict {
                nevict += 1;
                if m.reg.is_none() {
                    return Err(format!("evictable block {b} is not registered"));
                }
            } else {
                nused += 1;
                if m.evict_key.is_some() {
                    return Err(format!("used block {b} has an eviction key"));
                }
            }
            if m.ref_count > 1 && m.reg.is_none() {
                return Err(format!("shared block {b} is not registered"));
            }
            if let Some(r) = m.reg {
                nreg += 1;
                if self.index.get(&r.seq_hash) != Some(&b) {
                    return Err(format!("registered block {b} missing from the index"));
                }
                if let Some(p) = r.parent
                    && !self.index.contains_key(&p)
                {
                    return Err(format!("registered block {b}: parent {p} not registered"));
                }
                if m.dup_of.is_some() {
                    return Err(format!("block {b} both registered and duplicate"));
                }
            }
            if let Some(h) = m.dup_of {
                let listed = self.dups.get(&h).is_some_and(|v| v.contains(&b));
                let holder = self.index.get(&h);
                if !listed || holder.is_none() || holder == Some(&b) || m.ref_count != 1 {
                    return Err(format!("duplicate block {b} inconsistent"));
                }
            }
        }
        if nfree + nevict + nused != total || self.evictable.len() != nevict {
            return Err("free + cached + used != total".into());
        }
        if nreg != self.index.len() {
            return Err("index size != registered blocks".into());
        }
        let ndups: usize = self.dups.values().map(Vec::len).sum();
        let ndup_meta = self.blocks.iter().filter(|m| m.dup_of.is_some()).count();
        if ndups != ndup_meta || self.dups.values().any(Vec::is_empty) {
            return Err("duplicate lists inconsistent".into());
        }
        let u = self.usage();
        if u.free_blocks != nfree || u.cached_blocks != nevict || u.used_blocks != nused {
            return Err("usage() disagrees with the blocks".into());
        }
        self.check_tiers()
    }

    /// The lower tiers: each store's slots, index and LRU agree, capacities hold, a hash is in
    /// at most one slot per tier, and every copy in flight holds what it needs (an offload's
    /// G1 block and target slot, a demotion's target slot, an onboard's pinned source).
    fn check_tiers(&self) -> Result<(), String> {
        let Some(t) = self.tiers.as_ref() else {
            return if self.offloads_of.is_empty() && self.lingering.is_empty() {
                Ok(())
            } else {
                Err("offloads without lower tiers".into())
            };
        };
        let mut pins: HashMap<(Tier, u32), u32> = HashMap::new();
        let mut reserved: HashMap<(Tier, u32), u32> = HashMap::new();
        let mut holds: HashMap<u64, u32> = HashMap::new();
        for c in t.pending.values() {
            match (c.kind, c.from, c.to) {
                (CopyKind::Offload, BlockLoc::Device(_), BlockLoc::Host(s)) => {
                    let table = self
                        .offload_table
                        .get(&c.id)
                        .ok_or("offload without a table")?;
                    *holds.entry(*table).or_default() += 1;
                    *reserved.entry((Tier::Host, s)).or_default() += 1;
                    if !t.incoming_host.contains(&c.block.seq_hash) {
                        return Err(format!(
                            "offload of {} not marked incoming",
                            c.block.seq_hash
                        ));
                    }
                }
                (CopyKind::Demote, BlockLoc::Host(_), BlockLoc::Disk(s)) => {
                    *reserved.entry((Tier::Disk, s)).or_default() += 1;
                }
                (CopyKind::Onboard(_), from, BlockLoc::Device(_)) => {
                    let s = match from {
                        BlockLoc::Host(s) | BlockLoc::Disk(s) => s,
                        BlockLoc::Device(_) => return Err("onboard from G1".into()),
                    };
                    *pins.entry((from.tier(), s)).or_default() += 1;
                }
                other => return Err(format!("copy of an impossible shape {other:?}")),
            }
        }
        if holds != self.offloads_of
            || self.offload_table.len() != holds.values().sum::<u32>() as usize
        {
            return Err("offload counts per table disagree with the copies".into());
        }
        if let Some(t) = self
            .lingering
            .keys()
            .find(|t| !self.offloads_of.contains_key(t))
        {
            return Err(format!("table {t} lingers with no offload in flight"));
        }
        for store in std::iter::once(&t.host).chain(t.disk.as_ref()) {
            let tier = store.tier;
            if store.slots.len() > store.capacity || store.index.len() > store.capacity {
                return Err(format!("{tier:?} over capacity"));
            }
            let mut seen = std::collections::HashSet::new();
            let mut lru = 0;
            for (i, slot) in store.slots.iter().enumerate() {
                let s = i as u32;
                let want_pins = pins.get(&(tier, s)).copied().unwrap_or(0);
                let want_res = reserved.get(&(tier, s)).copied().unwrap_or(0);
                match slot {
                    Slot::Free => {
                        if want_pins + want_res > 0 || !store.free.contains(&s) {
                            return Err(format!("{tier:?} slot {s}: free but in use"));
                        }
                    }
                    Slot::Reserved => {
                        if want_res != 1 {
                            return Err(format!("{tier:?} slot {s}: reserved by {want_res}"));
                        }
                    }
                    Slot::Held(e) => {
                        if e.pins != want_pins || want_res > 0 {
                            return Err(format!(
                                "{tier:?} slot {s}: pins {} != {want_pins}",
                                e.pins
                            ));
                        }
                        if e.dead {
                            if e.pins == 0 || store.index.get(&e.block.seq_hash) == Some(&s) {
                                return Err(format!("{tier:?} slot {s}: dead entry kept"));
                            }
                            continue;
                        }
                        if !seen.insert(e.block.seq_hash) {
                            return Err(format!("{tier:?}: {} held twice", e.block.seq_hash));
                        }
                        if store.index.get(&e.block.seq_hash) != Some(&s) {
                            return Err(format!("{tier:?} slot {s}: not indexed"));
                        }
                        let in_lru = store.lru.contains(&(e.key, s));
                        if in_lru != (e.pins == 0) {
                            return Err(format!("{tier:?} slot {s}: LRU membership wrong"));
                        }
                        lru += usize::from(in_lru);
                    }
                }
            }
            if seen.len() != store.index.len() || lru != store.lru.len() {
                return Err(format!("{tier:?}: index or LRU lists dead slots"));
            }
        }
        Ok(())
    }
}
