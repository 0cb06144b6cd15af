//! Where the two indexes' answers differ: small event sequences applied to both, with the
//! overlaps each reports afterwards (per worker 0..4), pinned as observed with
//! dynamo-kv-router 1.6.1. The bench's world (chains stored root-first, removed children-first)
//! avoids all of these; both indexes agree on it.

use dynamo_kv_router::RadixTree;
use flotilla::kv::events::{KvEvent, KvEventData, StoredBlock, Tier};
use flotilla::request_plane::router::index::{ApplyOutcome, PrefixIndex};
use flotilla::runtime::ids::{EventId, SequenceHash};
use flotilla_vs_dynamo::{
    Block, Query, chain, dynamo_overlaps, flotilla_overlaps, to_dynamo, worker_name,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

const WORKERS: usize = 4;

/// Both indexes, fed the same events.
struct Both {
    flotilla: PrefixIndex,
    dynamo: RadixTree,
    next_id: Vec<u64>,
}

impl Both {
    fn new() -> Self {
        Both {
            flotilla: PrefixIndex::new(),
            dynamo: RadixTree::new(),
            next_id: vec![1; WORKERS],
        }
    }

    /// Applies the event to both; whether each accepted it.
    fn apply(&mut self, w: usize, data: KvEventData) -> (bool, bool) {
        let ev = KvEvent {
            worker: worker_name(w),
            event_id: EventId(self.next_id[w]),
            tier: Tier::Device,
            data,
        };
        self.next_id[w] += 1;
        let f = self.flotilla.apply(&ev) == ApplyOutcome::Applied;
        let d = self.dynamo.apply_event(to_dynamo(w as u64, &ev)).is_ok();
        (f, d)
    }

    /// Per worker overlap of the prompt: (Flotilla, Dynamo).
    fn overlaps(&self, prompt: &[Block]) -> (Vec<u32>, Vec<u32>) {
        let names: Vec<_> = (0..WORKERS).map(worker_name).collect();
        let q = Query::of(prompt);
        (
            flotilla_overlaps(&self.flotilla, &names, &q),
            dynamo_overlaps(&self.dynamo, WORKERS, &q),
        )
    }
}

fn stored(parent: Option<&Block>, blocks: &[Block]) -> KvEventData {
    KvEventData::Stored {
        parent: parent.map(|b| b.seq),
        blocks: blocks
            .iter()
            .map(|b| StoredBlock {
                seq_hash: b.seq,
                block_hash: b.local,
            })
            .collect(),
    }
}

fn removed(blocks: &[Block]) -> KvEventData {
    KvEventData::Removed {
        blocks: blocks.iter().map(|b| b.seq).collect(),
    }
}

fn prompt() -> Vec<Block> {
    chain(&mut StdRng::seed_from_u64(1), None, 8)
}

#[test]
fn same_answers_for_root_first_stores_and_leaf_first_removals() {
    let c = prompt();
    let mut both = Both::new();
    assert_eq!(both.apply(0, stored(None, &c)), (true, true));
    assert_eq!(both.apply(1, stored(None, &c[..4])), (true, true));
    assert_eq!(both.apply(1, stored(Some(&c[3]), &c[4..6])), (true, true));
    assert_eq!(both.apply(0, removed(&c[6..])), (true, true));
    let (f, d) = both.overlaps(&c);
    assert_eq!(f, [6, 6, 0, 0]);
    assert_eq!(f, d);
    assert_eq!(both.apply(1, KvEventData::Cleared), (true, true));
    let (f, d) = both.overlaps(&c);
    assert_eq!(f, [6, 0, 0, 0]);
    assert_eq!(f, d);
}

/// A block removed from the middle of a chain, then stored again: Flotilla still counts the
/// blocks after it (never removed), Dynamo dropped the rest of its compressed edge for that
/// worker at the removal.
#[test]
fn mid_chain_removal_then_restore() {
    let c = prompt();
    let mut both = Both::new();
    both.apply(0, stored(None, &c));
    assert_eq!(both.apply(0, removed(&c[3..4])), (true, true));
    assert_eq!(both.overlaps(&c), (vec![3, 0, 0, 0], vec![3, 0, 0, 0]));
    assert_eq!(both.apply(0, stored(Some(&c[2]), &c[3..4])), (true, true));
    assert_eq!(both.overlaps(&c), (vec![8, 0, 0, 0], vec![4, 0, 0, 0]));
}

/// A chain stored before its parent (events from one worker reordered, or a parent evicted
/// in between): Flotilla keeps it and counts it once the parent arrives; Dynamo rejects the
/// event (`ParentBlockNotFound`) and never counts those blocks.
#[test]
fn store_before_parent() {
    let c = prompt();
    let mut both = Both::new();
    assert_eq!(both.apply(0, stored(Some(&c[2]), &c[3..6])), (true, false));
    assert_eq!(both.overlaps(&c), (vec![0, 0, 0, 0], vec![0, 0, 0, 0]));
    assert_eq!(both.apply(0, stored(None, &c[..3])), (true, true));
    assert_eq!(both.overlaps(&c), (vec![6, 0, 0, 0], vec![3, 0, 0, 0]));
}

/// The same tokens (local hashes) under other sequence hashes (another salt, e.g. another
/// model or cache namespace that the local hash does not see): Dynamo answers by tokens and
/// matches both workers; Flotilla answers by sequence hash.
#[test]
fn same_tokens_other_sequence_hashes() {
    let c = prompt();
    let other: Vec<Block> = c
        .iter()
        .map(|b| Block {
            seq: SequenceHash(b.seq.0 ^ 1),
            local: b.local,
        })
        .collect();
    let mut both = Both::new();
    assert_eq!(both.apply(0, stored(None, &c)), (true, true));
    assert_eq!(both.apply(1, stored(None, &other)), (true, true));
    assert_eq!(both.overlaps(&c), (vec![8, 0, 0, 0], vec![8, 8, 0, 0]));
}
