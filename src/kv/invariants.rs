//! Test-only consistency checker for [`BlockPool`] (used by the seeded invariant tests here
//! and by the scheduler's tests).

use std::collections::{HashMap, HashSet};

use super::hash::block_hashes;
use super::pool::BlockPool;
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
        Ok(())
    }
}
