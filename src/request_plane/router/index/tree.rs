//! The path-compressed tree behind [`PrefixIndex`]: nodes (edges) in an arena, the block map,
//! and the operations that keep the tree in its canonical form (see the parent module's docs).
//!
//! Every operation here keeps these invariants (checked by
//! [`PrefixIndex::check_invariants`]):
//! - a live node has at least one block; `blocks[i + 1]`'s parent is `blocks[i]`;
//! - each block of each live node is in exactly one block map, its node's *home* (the own map
//!   of its only holder, else the shared map), which sends it to `(node, base + offset)`; the
//!   maps hold nothing else;
//! - `heads` sends the first block of each live node to that node, and holds nothing else;
//! - a node with a `Known` parent is that parent's child at `child_pos`, and its head's parent
//!   block is the parent's last block: branches only happen at the end of a node;
//! - no node is *garbage* (no holder and no child);
//! - the tree is *canonical*: no node is the only child of a parent with the same holders
//!   (such pairs are merged, so that a prefix is as few nodes as its holder sets allow);
//! - each worker's node set lists exactly the nodes it holds, and its block count is their
//!   total length.

use std::collections::hash_map::Entry;

use super::{FastMap, Holders, PrefixIndex, TIER_MASK, WorkerEntry, pack, slot_of};
use crate::runtime::ids::SequenceHash;

/// Index of a node in the arena.
pub(super) type NodeId = u32;

/// A node's parent link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Link {
    /// The head is the first block of a sequence.
    Root,
    /// The head's parent is the last block of this node.
    Known(NodeId),
    /// The head's parent is not known (a placeholder, or a chain stored under a parent that
    /// had no node then).
    Unknown,
}

/// Where a block lives: its node and its position there (`offset = pos − node.base`, wrapping).
/// Positions let a node shed or take blocks at its front without touching the entries of the
/// blocks it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Loc {
    pub(super) node: NodeId,
    pub(super) pos: u32,
}

/// One edge of the tree: a run of blocks, each the parent of the next, held by the same
/// workers in the same tiers.
#[derive(Debug, Clone)]
pub(super) struct Node {
    /// Sequence hashes, parent first. Empty only for a free arena slot.
    pub(super) blocks: Vec<SequenceHash>,
    /// Position of `blocks[0]` (see [`Loc`]).
    pub(super) base: u32,
    pub(super) parent: Link,
    /// Index in the parent's `children` (meaningful with a `Known` parent).
    pub(super) child_pos: u32,
    pub(super) children: Vec<NodeId>,
    /// Union of the holders' tiers.
    pub(super) tiers_any: u8,
    pub(super) holders: Holders,
}

impl Node {
    pub(super) fn new(blocks: Vec<SequenceHash>, parent: Link) -> Self {
        Node {
            blocks,
            base: 0,
            parent,
            child_pos: 0,
            children: Vec::new(),
            tiers_any: 0,
            holders: Holders::new(),
        }
    }

    pub(super) fn is_live(&self) -> bool {
        !self.blocks.is_empty()
    }

    pub(super) fn is_garbage(&self) -> bool {
        self.holders.is_empty() && self.children.is_empty()
    }

    /// Offset of the block at `pos`.
    #[inline]
    pub(super) fn offset(&self, pos: u32) -> usize {
        pos.wrapping_sub(self.base) as usize
    }

    /// Tiers in which `slot` holds this node's blocks (0: none).
    #[inline]
    pub(super) fn tiers_of(&self, slot: u32) -> u8 {
        match self.holders.find(slot) {
            Ok(i) => (self.holders.as_slice()[i] & TIER_MASK) as u8,
            Err(_) => 0,
        }
    }
}

/// Which block map holds a node's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Home {
    /// The shared map: no holder, or several.
    Shared,
    /// The own map of the only holder.
    Own(u32),
}

/// The home of a node with these holders.
#[inline]
pub(super) fn home_of(holders: &Holders) -> Home {
    match holders.as_slice() {
        [x] => Home::Own(slot_of(*x)),
        _ => Home::Shared,
    }
}

/// The block map `home` (fields borrowed apart, so the caller may hold a node meanwhile).
#[inline]
fn map_mut<'a>(
    shared: &'a mut FastMap<SequenceHash, Loc>,
    slots: &'a mut [Option<WorkerEntry>],
    home: Home,
) -> &'a mut FastMap<SequenceHash, Loc> {
    match home {
        Home::Shared => shared,
        Home::Own(slot) => {
            let entry = slots[slot as usize].as_mut();
            &mut entry.expect("a holder's slot is occupied").own
        }
    }
}

/// Removes `h` from `map` if it sends it to node `id` (a corrupt stream can put one hash in
/// two nodes; the other's entry stays).
#[inline]
fn unmap(map: &mut FastMap<SequenceHash, Loc>, h: &SequenceHash, id: NodeId) {
    if let Some(loc) = map.remove(h)
        && loc.node != id
    {
        map.insert(*h, loc);
    }
}

/// Removes head `h` from `heads` if it names node `id`.
#[inline]
fn unhead(heads: &mut FastMap<SequenceHash, NodeId>, h: &SequenceHash, id: NodeId) {
    if let Some(n) = heads.remove(h)
        && n != id
    {
        heads.insert(*h, n);
    }
}

/// Points `map`'s entries for `node`'s blocks `range` at it.
fn relocate(
    map: &mut FastMap<SequenceHash, Loc>,
    id: NodeId,
    node: &Node,
    range: std::ops::Range<usize>,
) {
    for (i, h) in node
        .blocks
        .iter()
        .enumerate()
        .take(range.end)
        .skip(range.start)
    {
        map.insert(
            *h,
            Loc {
                node: id,
                pos: node.base.wrapping_add(i as u32),
            },
        );
    }
}

impl PrefixIndex {
    // --- arena ------------------------------------------------------------------------------

    pub(super) fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        self.live_nodes += 1;
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("fewer than 2^32 nodes")
            }
        }
    }

    fn release(&mut self, id: NodeId) {
        self.nodes[id as usize] = Node::new(Vec::new(), Link::Unknown);
        self.free_nodes.push(id);
        self.live_nodes -= 1;
    }

    /// Makes `child` the last child of `parent`.
    fn attach(&mut self, child: NodeId, parent: NodeId) {
        let pos = self.node(parent).children.len() as u32;
        self.node_mut(parent).children.push(child);
        let c = self.node_mut(child);
        c.parent = Link::Known(parent);
        c.child_pos = pos;
    }

    /// Takes `child` out of its parent's children (O(1)).
    fn detach(&mut self, child: NodeId) {
        let Link::Known(p) = self.node(child).parent else {
            return;
        };
        let pos = self.node(child).child_pos as usize;
        let children = &mut self.nodes[p as usize].children;
        children.swap_remove(pos);
        if let Some(moved) = children.get(pos).copied() {
            self.node_mut(moved).child_pos = pos as u32;
        }
        self.node_mut(child).parent = Link::Unknown;
    }

    /// Points the home map's entries for node `id`'s blocks `range` at it.
    fn relocate_range(&mut self, id: NodeId, range: std::ops::Range<usize>) {
        let node = &self.nodes[id as usize];
        let map = map_mut(&mut self.shared, &mut self.slots, home_of(&node.holders));
        relocate(map, id, node, range);
    }

    fn own(&self, slot: u32) -> &FastMap<SequenceHash, Loc> {
        let entry = self.slots[slot as usize].as_ref();
        &entry.expect("a slot in use is occupied").own
    }

    /// Where block `h` is if `slot` holds it (its own map, else the shared one).
    #[inline]
    pub(super) fn find_held(&self, slot: u32, h: SequenceHash) -> Option<Loc> {
        if let Some(loc) = self.own(slot).get(&h) {
            return Some(*loc);
        }
        self.shared.get(&h).copied()
    }

    /// Where block `h` is if `slot` holds it, or it is shared, or it heads a node: every
    /// place a block can be met except inside another worker's node of its own.
    #[inline]
    fn find_near(&self, slot: u32, h: SequenceHash) -> Option<Loc> {
        if let Some(loc) = self.find_held(slot, h) {
            return Some(loc);
        }
        let id = *self.heads.get(&h)?;
        Some(Loc {
            node: id,
            pos: self.node(id).base,
        })
    }

    /// Where block `h` is, anywhere: [`Self::find_near`] (`slot`'s own map first, when
    /// given), then every worker's own map (`O(workers)`, only for a block met neither held,
    /// shared nor as a head).
    pub(super) fn locate(&self, slot: Option<u32>, h: SequenceHash) -> Option<Loc> {
        let near = match slot {
            Some(s) => self.find_near(s, h),
            None => self.shared.get(&h).copied().or_else(|| {
                let id = *self.heads.get(&h)?;
                Some(Loc {
                    node: id,
                    pos: self.node(id).base,
                })
            }),
        };
        near.or_else(|| {
            let mut owns = self.slots.iter().flatten().map(|e| &e.own);
            owns.find_map(|own| own.get(&h).copied())
        })
    }

    /// The block after `loc` in its node, if that is `h`.
    #[inline]
    fn next_in_node(&self, loc: Loc, h: SequenceHash) -> Option<Loc> {
        let node = self.node(loc.node);
        let off = node.offset(loc.pos);
        (node.blocks.get(off + 1) == Some(&h)).then(|| Loc {
            node: loc.node,
            pos: loc.pos.wrapping_add(1),
        })
    }

    /// Makes node `id` (parent unknown so far) a first node: its head is a first block.
    fn set_root(&mut self, id: NodeId) {
        self.node_mut(id).parent = Link::Root;
        self.mark_root(id);
    }

    /// Points the roots map at `id`, a node with a `Root` link.
    fn mark_root(&mut self, id: NodeId) {
        let head = self.node(id).blocks[0];
        self.roots.insert(head, id);
    }

    // --- shape ------------------------------------------------------------------------------

    /// Splits node `id` before its block `k` (`0 < k < len`); returns `(upper, lower)`: the
    /// node ending at block `k − 1` (keeps the parent link) and the node starting at block
    /// `k` (keeps the children). The shorter part moves to a new node, so a split costs
    /// `O(min(k, len − k))` map updates, plus `O(children)` when the lower part moves and
    /// `O(holders)` worker-set inserts.
    pub(super) fn split(&mut self, id: NodeId, k: usize) -> (NodeId, NodeId) {
        let len = self.node(id).blocks.len();
        debug_assert!(0 < k && k < len, "split {k} of {len}");
        let mut fresh = Node::new(Vec::new(), Link::Unknown);
        fresh.holders = self.node(id).holders.clone();
        fresh.tiers_any = self.node(id).tiers_any;
        let (upper, lower);
        if k <= len - k {
            // The upper part moves out; the lower keeps `id`, its children and positions.
            let node = self.node_mut(id);
            fresh.blocks = node.blocks.drain(..k).collect();
            node.base = node.base.wrapping_add(k as u32);
            fresh.parent = node.parent;
            fresh.child_pos = node.child_pos;
            let m = self.alloc(fresh);
            match self.node(m).parent {
                Link::Known(p) => {
                    let pos = self.node(m).child_pos as usize;
                    self.node_mut(p).children[pos] = m;
                }
                Link::Root => self.mark_root(m),
                Link::Unknown => {}
            }
            let node = self.node_mut(id);
            node.parent = Link::Known(m);
            node.child_pos = 0;
            self.node_mut(m).children.push(id);
            (upper, lower) = (m, id);
        } else {
            // The lower part moves out with the children.
            let node = self.node_mut(id);
            fresh.blocks = node.blocks.split_off(k);
            fresh.children = std::mem::take(&mut node.children);
            let m = self.alloc(fresh);
            for i in 0..self.node(m).children.len() {
                let c = self.node(m).children[i];
                self.node_mut(c).parent = Link::Known(m);
            }
            self.attach(m, id);
            (upper, lower) = (id, m);
        }
        let moved = if upper == id { lower } else { upper };
        let len = self.node(moved).blocks.len();
        self.relocate_range(moved, 0..len);
        if moved == upper {
            self.heads.insert(self.node(upper).blocks[0], upper);
        }
        self.heads.insert(self.node(lower).blocks[0], lower);
        for i in 0..self.node(moved).holders.as_slice().len() {
            let slot = super::slot_of(self.node(moved).holders.as_slice()[i]);
            self.entry_mut(slot).nodes.insert(moved);
        }
        (upper, lower)
    }

    /// Merges `id` into its parent when it is the parent's only child and has the same
    /// holders; returns the surviving node. The shorter node's blocks move.
    fn try_merge(&mut self, id: NodeId) -> Option<NodeId> {
        let Link::Known(p) = self.node(id).parent else {
            return None;
        };
        let (parent, child) = (self.node(p), self.node(id));
        if parent.children.len() != 1 || parent.holders.as_slice() != child.holders.as_slice() {
            return None;
        }
        let (gone, kept) = if child.blocks.len() <= parent.blocks.len() {
            // Append the child's blocks to the parent; the parent takes the grandchildren.
            let blocks = std::mem::take(&mut self.node_mut(id).blocks);
            unhead(&mut self.heads, &blocks[0], id);
            let children = std::mem::take(&mut self.node_mut(id).children);
            let start = self.node(p).blocks.len();
            let node = self.node_mut(p);
            node.blocks.extend(blocks);
            node.children = children;
            for i in 0..self.node(p).children.len() {
                let c = self.node(p).children[i];
                self.node_mut(c).parent = Link::Known(p);
            }
            let end = self.node(p).blocks.len();
            self.relocate_range(p, start..end);
            (id, p)
        } else {
            // Prepend the parent's blocks to the child; the child takes the parent's place.
            let blocks = std::mem::take(&mut self.node_mut(p).blocks);
            let old_head = self.node(id).blocks[0];
            unhead(&mut self.heads, &old_head, id);
            self.heads.insert(blocks[0], id);
            let (link, pos) = (self.node(p).parent, self.node(p).child_pos);
            let n = blocks.len();
            let node = self.node_mut(id);
            node.base = node.base.wrapping_sub(n as u32);
            node.blocks.splice(0..0, blocks);
            node.parent = link;
            node.child_pos = pos;
            match link {
                Link::Known(g) => self.node_mut(g).children[pos as usize] = id,
                Link::Root => self.mark_root(id),
                Link::Unknown => {}
            }
            self.node_mut(p).children.clear();
            // Only the parent's blocks moved: the child's keep their positions.
            self.relocate_range(id, 0..n);
            (p, id)
        };
        for i in 0..self.node(kept).holders.as_slice().len() {
            let slot = super::slot_of(self.node(kept).holders.as_slice()[i]);
            self.entry_mut(slot).nodes.remove(&gone);
        }
        self.release(gone);
        Some(kept)
    }

    /// Merges every node touched since the last call with its parent and its only child
    /// where their holders are equal: back to the canonical form.
    pub(super) fn normalize(&mut self) {
        while let Some(id) = self.touched.pop() {
            if !self.nodes.get(id as usize).is_some_and(Node::is_live) {
                continue;
            }
            let mut id = id;
            while let Some(kept) = self.try_merge(id) {
                id = kept;
            }
            while self.node(id).children.len() == 1 {
                match self.try_merge(self.node(id).children[0]) {
                    Some(kept) => id = kept,
                    None => break,
                }
            }
        }
    }

    /// Removes node `id` (garbage: no holder, no child) and its blocks, then every ancestor
    /// left garbage. `mapped`: whether `id`'s blocks are still in their home map (the shared
    /// one; [`Self::set_holder`] leaves them out of every map when it makes a node garbage).
    fn delete(&mut self, mut id: NodeId, mut mapped: bool) {
        loop {
            debug_assert!(self.node(id).is_garbage());
            let parent = self.node(id).parent;
            let head = self.node(id).blocks[0];
            if parent == Link::Root {
                self.roots.remove(&head);
            }
            unhead(&mut self.heads, &head, id);
            if mapped {
                for h in &self.nodes[id as usize].blocks {
                    unmap(&mut self.shared, h, id);
                }
            }
            mapped = true;
            self.detach(id);
            self.release(id);
            let Link::Known(p) = parent else {
                return;
            };
            if !self.node(p).is_garbage() {
                self.touched.push(p);
                return;
            }
            id = p;
        }
    }

    /// A placeholder node for block `h` (no holder, parent unknown).
    fn placeholder(&mut self, h: SequenceHash) -> NodeId {
        let id = self.alloc(Node::new(vec![h], Link::Unknown));
        self.shared.insert(h, Loc { node: id, pos: 0 });
        self.heads.insert(h, id);
        id
    }

    /// The node ending at block `q` (at `loc`, splitting its node after it), or a
    /// placeholder for `q` (`loc` is `None`: `q` is not in the tree).
    fn node_ending_at(&mut self, q: SequenceHash, loc: Option<Loc>) -> NodeId {
        let Some(loc) = loc else {
            return self.placeholder(q);
        };
        let off = self.node(loc.node).offset(loc.pos);
        if off + 1 < self.node(loc.node).blocks.len() {
            self.split(loc.node, off + 1).0
        } else {
            loc.node
        }
    }

    /// Whether `ancestor` is `id` or above it.
    fn is_ancestor(&self, ancestor: NodeId, mut id: NodeId) -> bool {
        loop {
            if id == ancestor {
                return true;
            }
            match self.node(id).parent {
                Link::Known(p) => id = p,
                _ => return false,
            }
        }
    }

    /// Gives node `id` (whose head's parent was unknown) the parent block `q`, unless that
    /// would close a cycle (only corrupt events can ask for one). `slot` is storing the link.
    fn link(&mut self, slot: u32, id: NodeId, q: SequenceHash) {
        let loc = self.locate(Some(slot), q);
        if let Some(loc) = loc
            && self.is_ancestor(id, loc.node)
        {
            return;
        }
        let p = self.node_ending_at(q, loc);
        self.attach(id, p);
        self.touched.push(id);
    }

    // --- holders ----------------------------------------------------------------------------

    /// Sets `slot`'s tiers on the whole of node `id` (0 removes it), keeping the counts, the
    /// worker's node set and the blocks' home (they move when the number of holders goes
    /// from or to one). Returns whether the node's blocks are in a map: `false` when the
    /// node was left garbage, whose blocks then are in none (the caller deletes it).
    pub(super) fn set_holder(&mut self, id: NodeId, slot: u32, tiers: u8) -> bool {
        let from = home_of(&self.node(id).holders);
        self.set_holder_counts(id, slot, tiers);
        let node = &self.nodes[id as usize];
        let to = home_of(&node.holders);
        if from == to {
            return true;
        }
        let map = map_mut(&mut self.shared, &mut self.slots, from);
        for h in &node.blocks {
            unmap(map, h, id);
        }
        if node.is_garbage() {
            return false;
        }
        let map = map_mut(&mut self.shared, &mut self.slots, to);
        map.reserve(node.blocks.len());
        relocate(map, id, node, 0..node.blocks.len());
        true
    }

    /// [`Self::set_holder`] but for the blocks' home.
    fn set_holder_counts(&mut self, id: NodeId, slot: u32, tiers: u8) {
        let node = &mut self.nodes[id as usize];
        let len = node.blocks.len();
        let before = node.tiers_of(slot);
        let was_held = !node.holders.is_empty();
        match (node.holders.find(slot), tiers) {
            (Ok(i), 0) => node.holders.remove_at(i),
            (Ok(i), t) => node.holders.set_at(i, pack(slot, t)),
            (Err(_), 0) => {}
            (Err(i), t) => node.holders.insert_at(i, pack(slot, t)),
        }
        node.tiers_any = node.holders.tier_union();
        let held = !node.holders.is_empty();
        match (was_held, held) {
            (false, true) => self.held_blocks += len,
            (true, false) => self.held_blocks -= len,
            _ => {}
        }
        match (before, tiers) {
            (0, t) if t != 0 => {
                self.holdings += len;
                let entry = self.entry_mut(slot);
                entry.held += len;
                entry.nodes.insert(id);
            }
            (b, 0) if b != 0 => {
                self.holdings -= len;
                let entry = self.entry_mut(slot);
                entry.held -= len;
                entry.nodes.remove(&id);
            }
            _ => {}
        }
    }

    /// Applies `change` to `slot`'s tiers on blocks `off..off + len` of node `id`, splitting
    /// the node where the run starts and ends inside it.
    pub(super) fn change_run(
        &mut self,
        slot: u32,
        id: NodeId,
        (off, len): (usize, usize),
        change: impl Fn(u8) -> u8,
    ) {
        let node = self.node(id);
        let cur = node.tiers_of(slot);
        let new = change(cur);
        if new == cur {
            return;
        }
        let total = node.blocks.len();
        if new == 0
            && off + len == total
            && off > 0
            && node.children.is_empty()
            && node.holders.as_slice() == [pack(slot, cur)]
        {
            // The common eviction: the tail of a leaf held by this worker alone.
            self.truncate(id, slot, off);
            return;
        }
        let mut id = id;
        if off > 0 {
            id = self.split(id, off).1;
        }
        if len < self.node(id).blocks.len() {
            id = self.split(id, len).0;
        }
        let mapped = self.set_holder(id, slot, new);
        if self.node(id).is_garbage() {
            self.delete(id, mapped);
        } else {
            self.touched.push(id);
        }
    }

    /// Drops blocks `off..` (`off > 0`) of leaf `id`, whose only holder is `slot`.
    fn truncate(&mut self, id: NodeId, slot: u32, off: usize) {
        let node = &mut self.nodes[id as usize];
        let gone = node.blocks.len() - off;
        let own = &mut self.slots[slot as usize].as_mut().expect("a holder").own;
        for h in node.blocks.drain(off..) {
            unmap(own, &h, id);
        }
        self.held_blocks -= gone;
        self.holdings -= gone;
        self.entry_mut(slot).held -= gone;
    }

    /// A new block `h` (in no map) stored by `slot` in tier `bit` under parent `prev`, which
    /// is at `loc` (`None`: not in the tree): appended to the parent's node when that is a
    /// leaf held by this worker alone in this tier, else in a new node. Returns the node it
    /// went to.
    fn store_new(
        &mut self,
        slot: u32,
        bit: u8,
        prev: Option<(SequenceHash, Option<Loc>)>,
        h: SequenceHash,
    ) -> NodeId {
        let link = match prev {
            None => Link::Root,
            Some((q, _)) if q == h => Link::Unknown, // only a corrupt event: never self-link
            Some((q, loc)) => {
                if let Some(loc) = loc {
                    let node = self.node(loc.node);
                    let at_end = node.offset(loc.pos) + 1 == node.blocks.len();
                    if at_end
                        && node.children.is_empty()
                        && node.holders.as_slice() == [pack(slot, bit)]
                    {
                        self.push_block(loc.node, slot, h);
                        return loc.node;
                    }
                }
                Link::Known(self.node_ending_at(q, loc))
            }
        };
        let id = self.alloc(Node::new(vec![h], Link::Unknown));
        self.heads.insert(h, id);
        match link {
            Link::Known(p) => self.attach(id, p),
            Link::Root => self.set_root(id),
            Link::Unknown => {}
        }
        // Held by `slot` alone: its home is `slot`'s own map.
        self.set_holder_counts(id, slot, bit);
        self.entry_mut(slot).own.insert(h, Loc { node: id, pos: 0 });
        id
    }

    /// Appends block `h` (in no map) to node `id`, a leaf held by `slot` alone.
    fn push_block(&mut self, id: NodeId, slot: u32, h: SequenceHash) {
        let node = &mut self.nodes[id as usize];
        let pos = node.base.wrapping_add(node.blocks.len() as u32);
        node.blocks.push(h);
        let entry = self.entry_mut(slot);
        entry.own.insert(h, Loc { node: id, pos });
        entry.held += 1;
        self.held_blocks += 1;
        self.holdings += 1;
    }

    /// Appends `hash(i) …` to node `id` (a leaf held by `slot` alone) up to `len` or the first
    /// block already in the tree; returns where it stopped. The block before `hash(i)` ends
    /// the node and has no child, so under content-consistent hashing `hash(i)` can be in
    /// the tree only as the head of a node whose parent was unknown: a lookup in the heads
    /// (a small map), then an insert into `slot`'s own map (small too), whose entry also
    /// catches a block repeated in one chain (a corrupt event).
    fn append_run(
        &mut self,
        id: NodeId,
        slot: u32,
        mut i: usize,
        len: usize,
        hash: &impl Fn(usize) -> SequenceHash,
    ) -> usize {
        let start = i;
        let node = &mut self.nodes[id as usize];
        let entry = self.slots[slot as usize].as_mut().expect("a holder");
        node.blocks.reserve(len.saturating_sub(i));
        while i < len {
            let h = hash(i);
            if self.heads.contains_key(&h) {
                break;
            }
            let Entry::Vacant(v) = entry.own.entry(h) else {
                break; // the same block twice in one chain (a corrupt event)
            };
            v.insert(Loc {
                node: id,
                pos: node.base.wrapping_add(node.blocks.len() as u32),
            });
            node.blocks.push(h);
            i += 1;
        }
        let added = i - start;
        entry.held += added;
        self.held_blocks += added;
        self.holdings += added;
        i
    }

    /// Stores the chain `hash(0) … hash(len − 1)` (each the parent of the next, the first
    /// under `parent`) for `slot` in tier `bit`.
    pub(super) fn store_chain(
        &mut self,
        slot: u32,
        bit: u8,
        parent: Option<SequenceHash>,
        len: usize,
        hash: impl Fn(usize) -> SequenceHash,
    ) {
        let mut prev = parent;
        let mut i = 0;
        while i < len {
            let h = hash(i);
            let mut found = self.find_near(slot, h);
            let mut prev_loc = None;
            if found.is_none()
                && let Some(q) = prev
                && q != h
            {
                // Not held by this worker, not shared, not a head: under content-consistent
                // hashing `h` can then only be inside another worker's node, right after its
                // parent.
                prev_loc = self.locate(Some(slot), q);
                found = prev_loc.and_then(|l| self.next_in_node(l, h));
            }
            let Some(loc) = found else {
                // New blocks: the first finds its place, the next ones follow it.
                let id = self.store_new(slot, bit, prev.map(|q| (q, prev_loc)), h);
                i = self.append_run(id, slot, i + 1, len, &hash);
                prev = Some(hash(i - 1));
                continue;
            };
            let (id, off) = (loc.node, self.node(loc.node).offset(loc.pos));
            if off == 0 && self.node(id).parent == Link::Unknown {
                match prev {
                    None => self.set_root(id),
                    Some(q) if q != h => self.link(slot, id, q),
                    Some(_) => {}
                }
            }
            // `link` never splits `id` (that would be a cycle), so `off` still holds.
            let node = self.node(id);
            let mut run = 1;
            while i + run < len
                && off + run < node.blocks.len()
                && node.blocks[off + run] == hash(i + run)
            {
                run += 1;
            }
            self.change_run(slot, id, (off, run), |t| t | bit);
            i += run;
            prev = Some(hash(i - 1));
        }
    }

    /// Removes `slot`'s copies in tier `bit` of `hashes` (in any order; blocks it does not
    /// hold there are skipped).
    pub(super) fn remove_blocks(&mut self, slot: u32, bit: u8, hashes: &[SequenceHash]) {
        let mut i = 0;
        while i < hashes.len() {
            // A block `slot` holds is in its own map or the shared one.
            let Some(loc) = self.find_held(slot, hashes[i]) else {
                i += 1;
                continue;
            };
            let node = self.node(loc.node);
            if node.tiers_of(slot) & bit == 0 {
                i += 1;
                continue;
            }
            let off = node.offset(loc.pos);
            let mut run = 1;
            while i + run < hashes.len()
                && off + run < node.blocks.len()
                && node.blocks[off + run] == hashes[i + run]
            {
                run += 1;
            }
            self.change_run(slot, loc.node, (off, run), |t| t & !bit);
            i += run;
        }
    }

    /// Removes tier bits `bits` of `slot` from every node it holds.
    pub(super) fn clear_bits(&mut self, slot: u32, bits: u8) {
        let held: Vec<NodeId> = self.entry_mut(slot).nodes.iter().copied().collect();
        for id in held {
            let tiers = self.node(id).tiers_of(slot);
            if tiers & bits == 0 {
                continue;
            }
            let mapped = self.set_holder(id, slot, tiers & !bits);
            if self.node(id).is_garbage() {
                self.delete(id, mapped);
            } else {
                self.touched.push(id);
            }
        }
    }

    /// Checks the tree's invariants (see the module docs); `O(size)`.
    pub(super) fn check_tree(&self) -> Result<(), String> {
        let mut mapped = 0;
        let mut held = 0;
        let mut live = 0;
        let free: std::collections::HashSet<NodeId> = self.free_nodes.iter().copied().collect();
        for (i, node) in self.nodes.iter().enumerate() {
            let id = i as NodeId;
            if !node.is_live() {
                if !free.contains(&id) {
                    return Err(format!("node {id} is empty but not free"));
                }
                continue;
            }
            live += 1;
            if node.is_garbage() {
                return Err(format!("node {id} has neither holder nor child"));
            }
            for (k, h) in node.blocks.iter().enumerate() {
                let want = Loc {
                    node: id,
                    pos: node.base.wrapping_add(k as u32),
                };
                let home = home_of(&node.holders);
                let map = match home {
                    Home::Shared => &self.shared,
                    Home::Own(slot) => match self.slots.get(slot as usize).and_then(Option::as_ref)
                    {
                        Some(e) => &e.own,
                        None => return Err(format!("node {id}: holder slot {slot} is free")),
                    },
                };
                if map.get(h) != Some(&want) {
                    return Err(format!(
                        "block {h} of node {id}: home map {home:?} says {:?}",
                        map.get(h)
                    ));
                }
            }
            if self.heads.get(&node.blocks[0]) != Some(&id) {
                return Err(format!(
                    "head of node {id}: heads say {:?}",
                    self.heads.get(&node.blocks[0])
                ));
            }
            mapped += node.blocks.len();
            if !node.holders.is_empty() {
                held += node.blocks.len();
            }
            if let Link::Known(p) = node.parent {
                let parent = self.nodes.get(p as usize).filter(|n| n.is_live());
                let Some(parent) = parent else {
                    return Err(format!("node {id} links to dead node {p}"));
                };
                if parent.children.get(node.child_pos as usize) != Some(&id) {
                    return Err(format!("node {id} is not at its place in {p}'s children"));
                }
                if parent.children.len() == 1
                    && parent.holders.as_slice() == node.holders.as_slice()
                {
                    return Err(format!("node {id} and its parent {p} should be one node"));
                }
                if self.is_ancestor(id, p) {
                    return Err(format!("node {id} is its own ancestor"));
                }
            }
            for c in &node.children {
                let child = self.nodes.get(*c as usize).filter(|n| n.is_live());
                if child.map(|c| c.parent) != Some(Link::Known(id)) {
                    return Err(format!("child {c} of node {id} does not link back"));
                }
            }
            let holders = node.holders.as_slice();
            if node.tiers_any != node.holders.tier_union() {
                return Err(format!("node {id}: stale tier union"));
            }
            if holders
                .windows(2)
                .any(|w| super::slot_of(w[0]) >= super::slot_of(w[1]))
            {
                return Err(format!("node {id}: holders not strictly sorted"));
            }
            for x in holders {
                let slot = super::slot_of(*x);
                let entry = self.slots.get(slot as usize).and_then(Option::as_ref);
                if !entry.is_some_and(|e| e.nodes.contains(&id)) {
                    return Err(format!("node {id}: holder slot {slot} does not list it"));
                }
            }
        }
        let first_nodes = self
            .nodes
            .iter()
            .filter(|n| n.is_live() && n.parent == Link::Root);
        if first_nodes.count() != self.roots.len() {
            return Err(format!("{} roots for other first nodes", self.roots.len()));
        }
        for (h, id) in &self.roots {
            let node = self.nodes.get(*id as usize).filter(|n| n.is_live());
            if !node.is_some_and(|n| n.parent == Link::Root && n.blocks[0] == *h) {
                return Err(format!(
                    "root {h} names node {id}, not a first node with that head"
                ));
            }
        }
        // Each block is in its home map (above): with the counts equal, in no other map.
        let in_maps = self.num_nodes();
        if mapped != in_maps {
            return Err(format!("{in_maps} blocks mapped, {mapped} in nodes"));
        }
        if self.heads.len() != live {
            return Err(format!("{} heads for {live} nodes", self.heads.len()));
        }
        if held != self.held_blocks {
            return Err(format!("held_blocks {} != {held}", self.held_blocks));
        }
        if live != self.live_nodes {
            return Err(format!("live_nodes {} != {live}", self.live_nodes));
        }
        Ok(())
    }
}
