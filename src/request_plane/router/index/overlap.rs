//! The query: [`PrefixIndex::overlaps`] walks a request's sequence hashes down the tree, one
//! lookup per node met, narrowing the set of workers still matching at each node
//! (`Walk`), and returns the leading blocks each worker holds ([`Overlaps`]). See the
//! parent module's docs, "Overlap (the query)".

use std::collections::HashMap;

use super::holders::{Holders, slot_of};
use super::tree::{Loc, Node};
use super::{PrefixIndex, TierSet, WorkerSlot};
use crate::runtime::ids::{SequenceHash, WorkerId};

impl PrefixIndex {
    /// Leading blocks of the request (`hashes`: its full blocks' sequence hashes, in order)
    /// held by each worker, any tier.
    pub fn overlaps(&self, hashes: &[SequenceHash]) -> Overlaps<'_> {
        self.overlaps_in(hashes, TierSet::ALL)
    }

    /// Like [`PrefixIndex::overlaps`], counting only copies in `tiers`.
    pub fn overlaps_in(&self, hashes: &[SequenceHash], tiers: TierSet) -> Overlaps<'_> {
        let first = hashes.first().and_then(|h| self.roots.get(h));
        let Some(mut loc) = first.map(|id| Loc {
            node: *id,
            pos: self.node(*id).base,
        }) else {
            // Nothing matches: no scratch at all.
            return Overlaps {
                index: self,
                scores: Vec::new(),
            };
        };
        let mut walk = Walk::new(self.slots.len(), tiers);
        let mut depth = 0;
        loop {
            let node = self.node(loc.node);
            let off = node.offset(loc.pos);
            // ≥ 1: the map sent `hashes[depth]` to this block.
            let run = common_prefix(&node.blocks[off..], &hashes[depth..]);
            if !walk.step(node, run as u32) {
                break;
            }
            depth += run;
            // A branch starts at the end of a node only, so the next block is a node's head
            // (after a mismatch inside the node, no head carries on the request).
            match hashes.get(depth).and_then(|h| self.heads.get(h)) {
                Some(next) => {
                    loc = Loc {
                        node: *next,
                        pos: self.node(*next).base,
                    }
                }
                None => break,
            }
        }
        Overlaps {
            index: self,
            scores: walk.finish(),
        }
    }
}

/// Length of the common prefix of `a` and `b`, eight hashes at a time.
#[inline]
fn common_prefix(a: &[SequenceHash], b: &[SequenceHash]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + 8 <= n {
        let diff = a[i..i + 8]
            .iter()
            .zip(&b[i..i + 8])
            .fold(0, |acc, (x, y)| acc | (x.0 ^ y.0));
        if diff != 0 {
            break;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// One overlap walk: the workers still matching after `depth` blocks.
struct Walk {
    filter: u32,
    depth: u32,
    /// Slots still matching, sorted, and as a bitset.
    active: Vec<u32>,
    active_bits: Vec<u64>,
    next: Vec<u32>,
    /// Final overlap by slot, written when a worker drops out (or at the end).
    scores: Vec<u32>,
}

impl Walk {
    fn new(slots: usize, tiers: TierSet) -> Self {
        Walk {
            filter: u32::from(tiers.0),
            depth: 0,
            active: Vec::new(),
            active_bits: vec![0; slots.div_ceil(64)],
            next: Vec::new(),
            scores: vec![0; slots],
        }
    }

    /// Takes the next node met, whose next `run` blocks the request matches; `false` once no
    /// worker is left.
    #[inline]
    fn step(&mut self, node: &Node, run: u32) -> bool {
        let filter = self.filter;
        if self.depth == 0 {
            let qualifying = node.holders.as_slice().iter().filter(|x| *x & filter != 0);
            self.active.extend(qualifying.map(|x| slot_of(*x)));
            self.sync_bits();
        } else if !self.unchanged(node) {
            let (depth, scores) = (self.depth, &mut self.scores);
            intersect(&self.active, node, filter, &mut self.next, |s| {
                scores[s as usize] = depth;
            });
            std::mem::swap(&mut self.active, &mut self.next);
            self.next.clear();
            self.sync_bits();
        }
        if self.active.is_empty() {
            return false;
        }
        self.depth += run;
        true
    }

    /// Whether every holder of `node` qualifies and the holders are exactly the active
    /// workers: then the active set carries over unchanged.
    #[inline]
    fn unchanged(&self, node: &Node) -> bool {
        let holders = node.holders.as_slice();
        if u32::from(node.tiers_any) & !self.filter != 0 || holders.len() != self.active.len() {
            return false;
        }
        match &node.holders {
            // Equal sizes and holders ⊆ active: equal sets.
            Holders::Spilled(s) => s.subset_of(&self.active_bits),
            Holders::Inline { .. } => same_slots(holders, &self.active),
        }
    }

    fn sync_bits(&mut self) {
        self.active_bits.fill(0);
        for s in &self.active {
            self.active_bits[*s as usize / 64] |= 1 << (s % 64);
        }
    }

    fn finish(mut self) -> Vec<u32> {
        for s in &self.active {
            self.scores[*s as usize] = self.depth;
        }
        self.scores
    }
}

/// Whether the holders' slots are exactly `active` (both sorted).
#[inline]
fn same_slots(holders: &[u32], active: &[u32]) -> bool {
    holders.len() == active.len()
        && holders
            .iter()
            .zip(active)
            .fold(0, |acc, (h, a)| acc | (slot_of(*h) ^ a))
            == 0
}

/// `next = active ∩ {qualifying holders of node}`; `dropped(slot)` for every active slot left
/// out.
#[inline]
fn intersect(
    active: &[u32],
    node: &Node,
    filter: u32,
    next: &mut Vec<u32>,
    mut dropped: impl FnMut(u32),
) {
    let holders = node.holders.as_slice();
    let all_qualify = u32::from(node.tiers_any) & !filter == 0;
    if let (Holders::Spilled(s), true) = (&node.holders, all_qualify) {
        for a in active {
            if s.has(*a) {
                next.push(*a);
            } else {
                dropped(*a);
            }
        }
        return;
    }
    if active.len() * 8 < holders.len() {
        for a in active {
            match holders.binary_search_by_key(a, |h| slot_of(*h)) {
                Ok(i) if holders[i] & filter != 0 => next.push(*a),
                _ => dropped(*a),
            }
        }
        return;
    }
    let mut j = 0;
    for a in active {
        while j < holders.len() && slot_of(holders[j]) < *a {
            j += 1;
        }
        if j < holders.len() && slot_of(holders[j]) == *a && holders[j] & filter != 0 {
            next.push(*a);
        } else {
            dropped(*a);
        }
    }
}

/// Result of [`PrefixIndex::overlaps`]: leading blocks held, per worker.
#[derive(Debug, Clone)]
pub struct Overlaps<'a> {
    index: &'a PrefixIndex,
    /// By slot.
    scores: Vec<u32>,
}

impl<'a> Overlaps<'a> {
    /// Leading blocks `worker` holds (0 if none or unknown).
    pub fn get(&self, worker: &WorkerId) -> u32 {
        let slot = self.index.by_id.get(worker);
        slot.and_then(|s| self.scores.get(*s as usize).copied())
            .unwrap_or(0)
    }

    /// Leading blocks the worker in `slot` holds (`slot` from the same index and epoch).
    #[inline]
    pub fn at(&self, slot: WorkerSlot) -> u32 {
        self.scores.get(slot.0 as usize).copied().unwrap_or(0)
    }

    /// Workers with a non-zero overlap, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (&'a WorkerId, u32)> + '_ {
        let index = self.index;
        self.scores
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .filter_map(move |(slot, n)| index.slots[slot].as_ref().map(|e| (&e.id, *n)))
    }

    /// The largest overlap (0 if none).
    pub fn max(&self) -> u32 {
        self.scores.iter().copied().max().unwrap_or(0)
    }

    /// Owned copy of the non-zero overlaps.
    pub fn to_map(&self) -> HashMap<WorkerId, u32> {
        self.iter().map(|(w, n)| (w.clone(), n)).collect()
    }
}
