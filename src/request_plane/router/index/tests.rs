use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::kv::events::StoredBlock;
use crate::kv::hash::sequence_hash;
use crate::runtime::ids::BlockHash;

// ---------------------------------------------------------------------------------------------
// Helpers

fn w(s: &str) -> WorkerId {
    WorkerId::new(s)
}

/// A chain of `n` sequence hashes continuing `parent`, block hashes derived from `seed`.
fn chain_from(parent: Option<SequenceHash>, seed: u64, n: usize) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(n);
    let mut p = parent;
    for i in 0..n as u64 {
        let s = sequence_hash(p, BlockHash(seed.wrapping_mul(1_000_003) + i), 9);
        out.push(s);
        p = Some(s);
    }
    out
}

fn chain(seed: u64, n: usize) -> Vec<SequenceHash> {
    chain_from(None, seed, n)
}

fn stored(parent: Option<SequenceHash>, hashes: &[SequenceHash]) -> KvEventData {
    let blocks = hashes
        .iter()
        .map(|h| StoredBlock {
            seq_hash: *h,
            block_hash: BlockHash(h.0 ^ 1),
        })
        .collect();
    KvEventData::Stored { parent, blocks }
}

fn removed(hashes: &[SequenceHash]) -> KvEventData {
    KvEventData::Removed {
        blocks: hashes.to_vec(),
    }
}

fn ev(worker: &str, id: u64, tier: Tier, data: KvEventData) -> KvEvent {
    KvEvent {
        worker: w(worker),
        event_id: EventId(id),
        tier,
        data,
    }
}

fn snapshot_of(chain: &[SequenceHash]) -> Vec<SnapshotBlock> {
    let mut parent = None;
    chain
        .iter()
        .map(|h| {
            let b = SnapshotBlock {
                seq_hash: *h,
                parent,
                block_hash: BlockHash(h.0 ^ 1),
            };
            parent = Some(*h);
            b
        })
        .collect()
}

fn ok(index: &PrefixIndex) {
    if let Err(e) = index.check_invariants() {
        panic!("invariant broken: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Unit tests

#[test]
fn overlap_counts_leading_blocks_per_worker() {
    let c = chain(1, 10);
    let mut index = PrefixIndex::new();
    let a = index.apply(&ev("a", 1, Tier::Device, stored(None, &c[..10])));
    assert_eq!(a, ApplyOutcome::Applied);
    index.apply(&ev("b", 1, Tier::Device, stored(None, &c[..4])));
    index.apply(&ev("c", 1, Tier::Device, stored(None, &c[..7])));
    // c loses block 2: only 2 leading blocks left, although it holds 3..7.
    index.apply(&ev("c", 2, Tier::Device, removed(&c[2..3])));
    ok(&index);
    let o = index.overlaps(&c);
    assert_eq!((o.get(&w("a")), o.get(&w("b")), o.get(&w("c"))), (10, 4, 2));
    assert_eq!(o.get(&w("nobody")), 0);
    assert_eq!(o.max(), 10);
    assert_eq!(o.iter().count(), 3);
    assert_eq!(o.to_map()[&w("b")], 4);
    assert_eq!(index.num_blocks(), 10);
    assert_eq!(index.num_holdings(), 10 + 4 + 6);
    assert_eq!(index.blocks_of(&w("c")), 6);
    assert_eq!(index.num_workers(), 3);
    assert_eq!(index.workers().count(), 3);
    // A request diverging after block 5 matches at most 5.
    let mut fork = c[..5].to_vec();
    fork.extend(chain_from(Some(c[4]), 99, 3));
    let o = index.overlaps(&fork);
    assert_eq!((o.get(&w("a")), o.get(&w("b")), o.get(&w("c"))), (5, 4, 2));
    // Nothing matches a foreign first block; an empty request matches nothing.
    assert_eq!(index.overlaps(&chain(2, 3)).max(), 0);
    assert_eq!(index.overlaps(&[]).max(), 0);
}

#[test]
fn chain_with_unknown_parent_is_stored_but_not_counted_until_connected() {
    let c = chain(3, 6);
    let mut index = PrefixIndex::new();
    // x stores blocks 3..6 under parent c[2], which nobody holds.
    index.apply(&ev("x", 1, Tier::Device, stored(Some(c[2]), &c[3..])));
    ok(&index);
    assert_eq!(index.num_blocks(), 3);
    assert_eq!(index.num_nodes(), 4, "placeholder for the parent");
    assert_eq!(index.tiers_of(&w("x"), c[2]), TierSet::EMPTY);
    assert_eq!(index.overlaps(&c).get(&w("x")), 0);
    // y holds 0..3, so the placeholder becomes a real node with a known parent.
    index.apply(&ev("y", 1, Tier::Device, stored(None, &c[..3])));
    ok(&index);
    assert_eq!(index.num_nodes(), 6);
    let o = index.overlaps(&c);
    assert_eq!((o.get(&w("x")), o.get(&w("y"))), (0, 3));
    // x stores its missing prefix: now it matches the whole chain.
    index.apply(&ev("x", 2, Tier::Device, stored(None, &c[..3])));
    assert_eq!(index.overlaps(&c).get(&w("x")), 6);
    // Removing everything leaves an empty tree.
    index.apply(&ev("x", 3, Tier::Device, removed(&c)));
    index.apply(&ev("y", 2, Tier::Device, removed(&c[..3])));
    ok(&index);
    assert_eq!(
        (index.num_nodes(), index.num_blocks(), index.num_holdings()),
        (0, 0, 0)
    );
}

#[test]
fn placeholder_goes_with_its_last_child() {
    let c = chain(4, 4);
    let mut index = PrefixIndex::new();
    index.apply(&ev("x", 1, Tier::Device, stored(Some(c[1]), &c[2..])));
    assert_eq!(index.num_nodes(), 3);
    index.apply(&ev("x", 2, Tier::Device, removed(&c[3..])));
    ok(&index);
    assert_eq!(index.num_nodes(), 2);
    index.apply(&ev("x", 3, Tier::Device, removed(&c[2..3])));
    ok(&index);
    assert_eq!(index.num_nodes(), 0);
    // An interior block removed first stays as a placeholder under its child.
    index.apply(&ev("x", 4, Tier::Device, stored(None, &c)));
    index.apply(&ev("x", 5, Tier::Device, removed(&c[1..2])));
    ok(&index);
    assert_eq!((index.num_nodes(), index.num_blocks()), (4, 3));
    assert_eq!(index.overlaps(&c).get(&w("x")), 1);
}

#[test]
fn tiers_are_tracked_and_filtered() {
    let c = chain(5, 5);
    let mut index = PrefixIndex::new();
    index.apply(&ev("a", 1, Tier::Device, stored(None, &c[..3])));
    index.apply(&ev("a", 2, Tier::Host, stored(None, &c)));
    ok(&index);
    assert_eq!(index.blocks_of(&w("a")), 5);
    assert_eq!(
        index.tiers_of(&w("a"), c[0]),
        TierSet::DEVICE.with(Tier::Host)
    );
    assert_eq!(index.overlaps(&c).get(&w("a")), 5);
    assert_eq!(index.overlaps_in(&c, TierSet::DEVICE).get(&w("a")), 3);
    assert_eq!(index.overlaps_in(&c, Tier::Host.into()).get(&w("a")), 5);
    assert_eq!(index.overlaps_in(&c, TierSet::EMPTY).get(&w("a")), 0);
    // Clearing the host tier keeps the device copies.
    index.apply(&ev("a", 3, Tier::Host, KvEventData::Cleared));
    ok(&index);
    assert_eq!(index.blocks_of(&w("a")), 3);
    assert_eq!(index.overlaps(&c).get(&w("a")), 3);
    assert_eq!(index.num_blocks(), 3);
    // Removing a device block that is also... not held in host any more: gone.
    index.apply(&ev("a", 4, Tier::Host, removed(&c[..1])));
    assert_eq!(index.blocks_of(&w("a")), 3, "not held in host: ignored");
    index.apply(&ev("a", 5, Tier::Device, KvEventData::Cleared));
    ok(&index);
    assert_eq!((index.num_nodes(), index.num_holdings()), (0, 0));
    let tiers: TierSet = [Tier::Disk, Tier::Remote].into_iter().collect();
    assert_eq!(
        tiers.tiers().collect::<Vec<_>>(),
        [Tier::Disk, Tier::Remote]
    );
}

#[test]
fn filtered_walk_sees_mixed_tiers_on_shared_nodes() {
    let c = chain(6, 4);
    let mut index = PrefixIndex::new();
    index.apply(&ev("a", 1, Tier::Device, stored(None, &c)));
    index.apply(&ev("b", 1, Tier::Device, stored(None, &c[..2])));
    index.apply(&ev("b", 2, Tier::Host, stored(Some(c[1]), &c[2..])));
    let o = index.overlaps_in(&c, TierSet::DEVICE);
    assert_eq!((o.get(&w("a")), o.get(&w("b"))), (4, 2));
    let o = index.overlaps(&c);
    assert_eq!((o.get(&w("a")), o.get(&w("b"))), (4, 4));
}

#[test]
fn few_active_workers_against_many_holders_use_the_tier_filter() {
    // Block 0 held by x only, block 1 by x (host) and 20 others (device): the walk checks
    // x by binary search in block 1's 21 holders.
    let c = chain(15, 2);
    let mut index = PrefixIndex::new();
    for i in 0..20 {
        let name = format!("w{i:02}");
        index.apply(&ev(&name, 1, Tier::Device, stored(Some(c[0]), &c[1..])));
    }
    index.apply(&ev("x", 1, Tier::Device, stored(None, &c[..1])));
    index.apply(&ev("x", 2, Tier::Host, stored(Some(c[0]), &c[1..])));
    ok(&index);
    assert_eq!(index.overlaps_in(&c, TierSet::DEVICE).get(&w("x")), 1);
    assert_eq!(index.overlaps(&c).get(&w("x")), 2);
    assert_eq!(index.overlaps(&c).get(&w("w03")), 0, "block 0 missing");
    index.apply(&ev("x", 3, Tier::Host, removed(&c[1..])));
    assert_eq!(index.overlaps(&c).get(&w("x")), 1);
}

#[test]
fn many_holders_spill_and_shrink() {
    let c = chain(7, 3);
    let mut index = PrefixIndex::new();
    let names: Vec<String> = (0..40).map(|i| format!("w{i:02}")).collect();
    for (i, n) in names.iter().enumerate() {
        let len = 1 + i % 3;
        index.apply(&ev(n, 1, Tier::Device, stored(None, &c[..len])));
    }
    ok(&index);
    let o = index.overlaps(&c);
    for (i, n) in names.iter().enumerate() {
        assert_eq!(o.get(&w(n)) as usize, 1 + i % 3);
    }
    for n in names.iter().step_by(2) {
        assert!(index.remove_worker(&w(n)));
    }
    ok(&index);
    let o = index.overlaps(&c);
    assert_eq!(o.iter().count(), 20);
    for n in names.iter().skip(1).step_by(2) {
        index.remove_worker(&w(n));
    }
    ok(&index);
    assert_eq!((index.num_nodes(), index.num_workers()), (0, 0));
}

#[test]
fn gap_asks_for_one_resync_then_buffers_and_replays() {
    let c = chain(8, 8);
    let mut index = PrefixIndex::new();
    index.apply(&ev("a", 1, Tier::Device, stored(None, &c[..2])));
    // Event 2 is lost; 3 arrives.
    let out = index.apply(&ev("a", 3, Tier::Device, stored(Some(c[2]), &c[3..4])));
    assert_eq!(
        out,
        ApplyOutcome::NeedsResync {
            worker: w("a"),
            reason: ResyncReason::Gap {
                expected: EventId(2),
                got: EventId(3)
            }
        }
    );
    assert!(index.is_pending(&w("a")));
    for id in [4, 5, 4, 2] {
        let k = id as usize;
        let data = stored(Some(c[k - 1]), &c[k..=k]);
        let out = index.apply(&ev("a", id, Tier::Device, data));
        assert_eq!(out, ApplyOutcome::Buffered, "no second resync request");
    }
    assert_eq!(index.pending_resyncs(), vec![(w("a"), 4)]);
    // Stale contents stay visible while pending.
    assert_eq!(index.overlaps(&c).get(&w("a")), 2);
    // Snapshot after event 3: blocks 0..4. Buffered 4 and 5 replay; 2 and 3 are stale.
    let report = index.resync(&w("a"), EventId(3), &snapshot_of(&c[..4]));
    assert_eq!(
        report,
        ResyncReport {
            replayed: 2,
            stale: 2,
            after_gap: 0
        }
    );
    ok(&index);
    assert!(!index.is_pending(&w("a")));
    assert_eq!(index.last_event_id(&w("a")), Some(EventId(5)));
    assert_eq!(index.overlaps(&c).get(&w("a")), 6);
    assert_eq!(
        index.apply(&ev("a", 6, Tier::Device, removed(&c[5..6]))),
        ApplyOutcome::Applied
    );
    assert_eq!(index.overlaps(&c).get(&w("a")), 5);
}

#[test]
fn duplicate_reset_and_late_join_are_detected() {
    let c = chain(9, 3);
    let mut index = PrefixIndex::new();
    for id in 1..=3 {
        index.apply(&ev("a", id, Tier::Device, stored(None, &c[..1])));
    }
    let out = index.apply(&ev("a", 2, Tier::Device, stored(None, &c[..1])));
    assert!(matches!(
        out,
        ApplyOutcome::NeedsResync {
            reason: ResyncReason::Duplicate { .. },
            ..
        }
    ));
    index.resync(&w("a"), EventId(3), &snapshot_of(&c[..1]));
    let out = index.apply(&ev("a", 1, Tier::Device, stored(None, &c[..2])));
    assert_eq!(
        out,
        ApplyOutcome::NeedsResync {
            worker: w("a"),
            reason: ResyncReason::Reset { last: EventId(3) }
        }
    );
    // The restarted worker's snapshot is taken before its event 1: that event replays.
    let report = index.resync(&w("a"), EventId(0), &[]);
    assert_eq!(report.replayed, 1);
    assert_eq!(index.overlaps(&c).get(&w("a")), 2);
    // A router that joins late sees event 57 first.
    let out = index.apply(&ev("b", 57, Tier::Device, stored(None, &c)));
    assert!(matches!(
        out,
        ApplyOutcome::NeedsResync {
            reason: ResyncReason::Gap { .. },
            ..
        }
    ));
    assert_eq!(index.last_event_id(&w("b")), Some(EventId(0)));
    index.resync(&w("b"), EventId(57), &snapshot_of(&c));
    assert_eq!(index.overlaps(&c).get(&w("b")), 3);
    ok(&index);
}

#[test]
fn event_one_while_pending_drops_the_old_incarnation_buffer() {
    let c = chain(10, 4);
    let mut index = PrefixIndex::new();
    index.apply(&ev("a", 1, Tier::Device, stored(None, &c[..1])));
    index.apply(&ev("a", 3, Tier::Device, stored(None, &c[..1])));
    index.apply(&ev("a", 4, Tier::Device, stored(None, &c[..2])));
    // The worker restarts: its new event 1 arrives, then its new 2.
    index.apply(&ev("a", 1, Tier::Device, stored(None, &c[..3])));
    index.apply(&ev("a", 2, Tier::Device, removed(&c[2..3])));
    let report = index.resync(&w("a"), EventId(0), &[]);
    assert_eq!((report.replayed, report.stale, report.after_gap), (2, 0, 0));
    assert_eq!(index.overlaps(&c).get(&w("a")), 2);
}

#[test]
fn buffer_is_bounded_and_holes_are_reported() {
    let c = chain(11, 2);
    let mut index = PrefixIndex::new().with_max_buffered(3);
    index.apply(&ev("a", 1, Tier::Device, stored(None, &c[..1])));
    assert!(matches!(
        index.apply(&ev("a", 3, Tier::Device, stored(None, &c[..1]))),
        ApplyOutcome::NeedsResync { .. }
    ));
    for id in [4, 6] {
        let out = index.apply(&ev("a", id, Tier::Device, stored(None, &c[..1])));
        assert_eq!(out, ApplyOutcome::Buffered);
    }
    let out = index.apply(&ev("a", 7, Tier::Device, stored(None, &c[..1])));
    assert_eq!(out, ApplyOutcome::Ignored);
    let out = index.apply(&ev("a", 6, Tier::Device, stored(None, &c[..2])));
    assert_eq!(
        out,
        ApplyOutcome::Buffered,
        "an id already buffered is replaced"
    );
    let report = index.resync(&w("a"), EventId(3), &snapshot_of(&c[..1]));
    assert_eq!((report.replayed, report.stale, report.after_gap), (1, 1, 1));
    assert_eq!(index.last_event_id(&w("a")), Some(EventId(4)));
    // Event 5 was never seen: the next live event (7) asks again.
    assert!(matches!(
        index.apply(&ev("a", 7, Tier::Device, stored(None, &c[..1]))),
        ApplyOutcome::NeedsResync { .. }
    ));
}

#[test]
fn remove_worker_leaves_no_trace_and_reuses_its_slot() {
    let c = chain(12, 6);
    let d = chain_from(Some(c[2]), 13, 3);
    let mut index = PrefixIndex::new();
    index.apply(&ev("a", 1, Tier::Device, stored(None, &c)));
    index.apply(&ev("a", 2, Tier::Host, stored(Some(c[2]), &d)));
    index.apply(&ev("b", 1, Tier::Device, stored(None, &c[..2])));
    index.apply(&ev("a", 9, Tier::Device, KvEventData::Cleared));
    assert!(index.is_pending(&w("a")));
    assert!(index.remove_worker(&w("a")));
    assert!(!index.remove_worker(&w("a")));
    ok(&index);
    assert_eq!(
        (index.num_nodes(), index.num_blocks(), index.num_holdings()),
        (2, 2, 2)
    );
    assert_eq!(index.blocks_of(&w("a")), 0);
    assert_eq!(index.last_event_id(&w("a")), None);
    assert!(index.pending_resyncs().is_empty());
    assert_eq!(index.overlaps(&c).get(&w("a")), 0);
    // A new worker takes the freed slot; "a" coming back starts from scratch.
    index.apply(&ev("z", 1, Tier::Device, stored(None, &c[..1])));
    assert_eq!(
        index.apply(&ev("a", 1, Tier::Device, stored(None, &c[..3]))),
        ApplyOutcome::Applied
    );
    ok(&index);
    let o = index.overlaps(&c);
    assert_eq!((o.get(&w("a")), o.get(&w("b")), o.get(&w("z"))), (3, 2, 1));
}

#[test]
fn resync_replaces_all_tiers() {
    let c = chain(14, 4);
    let mut index = PrefixIndex::new();
    index.apply(&ev("a", 1, Tier::Host, stored(None, &c)));
    let dev = snapshot_of(&c[..2]);
    let host = snapshot_of(&c[..1]);
    let report = index.resync_tiers(
        &w("a"),
        EventId(10),
        &[(Tier::Device, &dev), (Tier::Host, &host)],
    );
    assert_eq!(report, ResyncReport::default());
    ok(&index);
    assert_eq!(index.blocks_of(&w("a")), 2);
    assert_eq!(
        index.tiers_of(&w("a"), c[0]),
        TierSet::DEVICE.with(Tier::Host)
    );
    assert_eq!(index.overlaps_in(&c, Tier::Host.into()).get(&w("a")), 1);
    assert_eq!(index.num_nodes(), 2);
    assert_eq!(
        index.apply(&ev("a", 11, Tier::Device, KvEventData::Cleared)),
        ApplyOutcome::Applied
    );
}

#[test]
fn holders_and_hasher_basics() {
    let mut h = Holders::new();
    for (i, s) in [5u32, 1, 9, 3, 7].into_iter().enumerate() {
        let pos = h.find(s).unwrap_err();
        h.insert_at(pos, pack(s, 1 + (i as u8 % 3)));
    }
    let slots: Vec<u32> = h.as_slice().iter().map(|x| slot_of(*x)).collect();
    assert_eq!(slots, [1, 3, 5, 7, 9]);
    assert!(matches!(h, Holders::Spilled(_)));
    for s in [1, 9, 5, 3, 7] {
        let i = h.find(s).unwrap();
        h.remove_at(i);
    }
    assert!(h.is_empty());
    assert!(
        std::mem::size_of::<Holders>() <= 16,
        "{}",
        std::mem::size_of::<Holders>()
    );
    let h = FastMap::<(), ()>::default();
    let hash = |s: &str| std::hash::BuildHasher::hash_one(h.hasher(), s);
    assert_ne!(hash("node-1/r0"), hash("node-1/r1"));
}

#[test]
fn a_growing_conversation_is_one_node_and_partial_copies_split_then_merge_back() {
    let c = chain(20, 448);
    let mut index = PrefixIndex::new();
    let mut parent = None;
    for (i, part) in c.chunks(64).enumerate() {
        index.apply(&ev("a", i as u64 + 1, Tier::Device, stored(parent, part)));
        parent = part.last().copied();
    }
    ok(&index);
    assert_eq!((index.num_edges(), index.num_nodes()), (1, 448));
    // b copies the first 100 blocks: two nodes, {a, b} then {a}.
    index.apply(&ev("b", 1, Tier::Device, stored(None, &c[..100])));
    ok(&index);
    assert_eq!(index.num_edges(), 2);
    let o = index.overlaps(&c);
    assert_eq!((o.get(&w("a")), o.get(&w("b"))), (448, 100));
    // b evicts from its tail, one block per event: the boundary moves back with it.
    for (k, h) in c[50..100].iter().rev().enumerate() {
        index.apply(&ev("b", k as u64 + 2, Tier::Device, removed(&[*h])));
    }
    ok(&index);
    assert_eq!(index.num_edges(), 2);
    assert_eq!(index.overlaps(&c).get(&w("b")), 50);
    // b drops a block in the middle of what it holds: three runs of holders, then b's copy
    // goes altogether and the conversation is one node again.
    index.apply(&ev("b", 52, Tier::Device, removed(&c[20..21])));
    ok(&index);
    assert_eq!(index.num_edges(), 4);
    assert_eq!(index.overlaps(&c).get(&w("b")), 20);
    index.apply(&ev("b", 53, Tier::Device, KvEventData::Cleared));
    ok(&index);
    assert_eq!((index.num_edges(), index.num_holdings()), (1, 448));
    // a's tail evicted in chunks, children first: the node shrinks in place.
    for (k, part) in c.chunks(64).rev().enumerate() {
        index.apply(&ev("a", k as u64 + 8, Tier::Device, removed(part)));
        ok(&index);
    }
    assert_eq!((index.num_edges(), index.num_nodes()), (0, 0));
}

#[test]
fn branches_split_at_the_fork_and_the_shorter_side_moves() {
    let c = chain(21, 300);
    let mut index = PrefixIndex::new();
    index.apply(&ev("a", 1, Tier::Device, stored(None, &c)));
    // Forks after block 10 and after block 290, by the same worker.
    let early = chain_from(Some(c[9]), 22, 5);
    let late = chain_from(Some(c[289]), 23, 5);
    index.apply(&ev("a", 2, Tier::Device, stored(Some(c[9]), &early)));
    index.apply(&ev("a", 3, Tier::Device, stored(Some(c[289]), &late)));
    ok(&index);
    assert_eq!(index.num_edges(), 5);
    let mut q = c[..10].to_vec();
    q.extend(&early);
    assert_eq!(index.overlaps(&q).get(&w("a")), 15);
    let mut q = c[..290].to_vec();
    q.extend(&late);
    q.extend(chain_from(late.last().copied(), 24, 3));
    assert_eq!(index.overlaps(&q).get(&w("a")), 295);
    // The forks go: everything is one node again.
    index.apply(&ev("a", 4, Tier::Device, removed(&late)));
    index.apply(&ev("a", 5, Tier::Device, removed(&early)));
    ok(&index);
    assert_eq!(index.num_edges(), 1);
    assert_eq!(index.overlaps(&c).get(&w("a")), 300);
}

#[test]
fn snapshots_in_any_order_build_the_same_tree() {
    let c = chain(25, 40);
    let mut snap = snapshot_of(&c);
    snap.reverse();
    snap.swap(3, 30);
    let mut index = PrefixIndex::new();
    index.resync(&w("a"), EventId(7), &snap);
    ok(&index);
    assert_eq!((index.num_edges(), index.num_blocks()), (1, 40));
    assert_eq!(index.overlaps(&c).get(&w("a")), 40);
    // A second worker resynced with the same blocks, parents first (as a block pool lists
    // them): one run over the node, which gains a holder, not one split per block.
    index.resync(&w("b"), EventId(3), &snapshot_of(&c));
    ok(&index);
    assert_eq!((index.num_edges(), index.num_holdings()), (1, 80));
    assert_eq!(index.overlaps(&c).get(&w("b")), 40);
}

#[test]
fn corrupt_links_never_make_a_cycle() {
    let c = chain(26, 3);
    let mut index = PrefixIndex::new();
    // c[1] under c[0]; then c[0] claimed under c[2] and under itself.
    index.apply(&ev("a", 1, Tier::Device, stored(Some(c[0]), &c[1..2])));
    index.apply(&ev("a", 2, Tier::Device, stored(Some(c[1]), &c[2..])));
    index.apply(&ev("a", 3, Tier::Device, stored(Some(c[2]), &c[..1])));
    index.apply(&ev("b", 1, Tier::Device, stored(Some(c[0]), &c[..1])));
    ok(&index);
    // Nobody stored c[0] as a first block: no request starts a match there.
    assert_eq!(index.overlaps(&c).max(), 0);
    assert_eq!((index.blocks_of(&w("a")), index.blocks_of(&w("b"))), (3, 1));
    // A block stored twice in one chain, and a chain through a block held elsewhere; c[0]
    // is now a first block.
    index.apply(&ev("b", 2, Tier::Device, stored(None, &[c[0], c[0], c[1]])));
    ok(&index);
    let o = index.overlaps(&c);
    assert_eq!((o.get(&w("a")), o.get(&w("b"))), (3, 2));
    assert_eq!(index.num_edges(), 2);
    index.apply(&ev("a", 4, Tier::Device, removed(&c)));
    index.apply(&ev("b", 3, Tier::Device, removed(&c)));
    ok(&index);
    assert_eq!((index.num_edges(), index.num_nodes()), (0, 0));
}

#[test]
fn corrupt_streams_never_panic_and_leave_nothing_behind() {
    // Chains over a pool of 12 hashes in any order, under any parent: hashes met in several
    // places, repeated in one chain, or stored under another worker's block. The index may
    // answer anything for such streams, but must not panic, loop or leak.
    for seed in 0..300 {
        let mut rng = StdRng::seed_from_u64(seed);
        let pool = chain(5000 + seed, 12);
        let pick = |rng: &mut StdRng, n: usize| -> Vec<SequenceHash> {
            (0..n)
                .map(|_| pool[rng.random_range(0..pool.len())])
                .collect()
        };
        let mut index = PrefixIndex::new();
        let mut ids = [0u64; 4];
        for _ in 0..200 {
            let k = rng.random_range(0..4);
            let name = format!("c{k}");
            let data = match rng.random_range(0..10) {
                0..=5 => {
                    let n = rng.random_range(1..6);
                    let blocks = pick(&mut rng, n);
                    let parent = rng.random_bool(0.7).then(|| pick(&mut rng, 1)[0]);
                    stored(parent, &blocks)
                }
                6..=8 => {
                    let n = rng.random_range(1..8);
                    removed(&pick(&mut rng, n))
                }
                _ => KvEventData::Cleared,
            };
            ids[k] += 1;
            let tier = if rng.random_bool(0.8) {
                Tier::Device
            } else {
                Tier::Host
            };
            index.apply(&ev(&name, ids[k], tier, data));
            if rng.random_bool(0.05) {
                let n = rng.random_range(0..10);
                let snap: Vec<SnapshotBlock> = pick(&mut rng, n)
                    .into_iter()
                    .map(|h| SnapshotBlock {
                        seq_hash: h,
                        parent: rng.random_bool(0.7).then(|| pool[rng.random_range(0..12)]),
                        block_hash: BlockHash(h.0 ^ 1),
                    })
                    .collect();
                index.resync(&w(&name), EventId(ids[k]), &snap);
            }
            if rng.random_bool(0.02) {
                index.remove_worker(&w(&name));
                ids[k] = 0;
            }
            let n = rng.random_range(0..14);
            let _ = index.overlaps(&pick(&mut rng, n)).max();
            let _ = index.overlaps(&pool).max();
            let _ = index.contains(pool[rng.random_range(0..12)]);
        }
        for k in 0..4 {
            index.remove_worker(&w(&format!("c{k}")));
        }
        assert_eq!(
            (index.num_edges(), index.num_nodes()),
            (0, 0),
            "seed {seed}"
        );
        assert_eq!(index.num_blocks(), 0);
        ok(&index);
    }
}

// ---------------------------------------------------------------------------------------------
// Randomised: the index against a brute-force model under a lossy, duplicating, reordering
// event channel with worker restarts, removals and delayed snapshots.

/// Brute-force contents of one worker: held hash → (parent, tier bits).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Model {
    blocks: BTreeMap<SequenceHash, (Option<SequenceHash>, u8)>,
}

impl Model {
    fn apply(&mut self, tier: Tier, data: &KvEventData) {
        let bit = tier_bit(tier);
        match data {
            KvEventData::Stored { parent, blocks } => {
                let mut p = *parent;
                for b in blocks {
                    self.blocks.entry(b.seq_hash).or_insert((p, 0)).1 |= bit;
                    p = Some(b.seq_hash);
                }
            }
            KvEventData::Removed { blocks } => {
                for h in blocks {
                    if let Some(e) = self.blocks.get_mut(h) {
                        e.1 &= !bit;
                        if e.1 == 0 {
                            self.blocks.remove(h);
                        }
                    }
                }
            }
            KvEventData::Cleared => {
                for e in self.blocks.values_mut() {
                    e.1 &= !bit;
                }
                self.blocks.retain(|_, e| e.1 != 0);
            }
        }
    }

    /// Walks the request's hashes: leading blocks held in a tier of `filter`.
    fn overlap(&self, hashes: &[SequenceHash], filter: TierSet) -> u32 {
        let held = |h: &SequenceHash| self.blocks.get(h).is_some_and(|e| e.1 & filter.0 != 0);
        hashes.iter().take_while(|h| held(h)).count() as u32
    }

    fn snapshot(&self, tier: Tier) -> Vec<SnapshotBlock> {
        let bit = tier_bit(tier);
        let held = self.blocks.iter().filter(|(_, e)| e.1 & bit != 0);
        held.map(|(h, e)| SnapshotBlock {
            seq_hash: *h,
            parent: e.0,
            block_hash: BlockHash(h.0 ^ 1),
        })
        .collect()
    }

    fn tiers(&self) -> BTreeMap<SequenceHash, u8> {
        self.blocks.iter().map(|(h, e)| (*h, e.1)).collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Applied,
    Buffered,
    Ignored,
    NeedsResync,
}

fn kind(o: &ApplyOutcome) -> Kind {
    match o {
        ApplyOutcome::Applied => Kind::Applied,
        ApplyOutcome::Buffered => Kind::Buffered,
        ApplyOutcome::Ignored => Kind::Ignored,
        ApplyOutcome::NeedsResync { .. } => Kind::NeedsResync,
    }
}

/// What the index should hold for one worker, by the documented protocol.
#[derive(Clone, Debug, Default)]
struct Mirror {
    model: Model,
    last: u64,
    /// While a resync is pending: buffered (incarnation, event) by id.
    pending: Option<BTreeMap<u64, (u32, KvEvent)>>,
}

impl Mirror {
    fn apply(&mut self, inc: u32, ev: &KvEvent, max: usize) -> Kind {
        let id = ev.event_id.0;
        if let Some(buf) = self.pending.as_mut() {
            if id == 1 {
                buf.clear();
            }
            if buf.len() >= max && !buf.contains_key(&id) {
                return Kind::Ignored;
            }
            buf.insert(id, (inc, ev.clone()));
            return Kind::Buffered;
        }
        if id == self.last + 1 {
            self.last = id;
            self.model.apply(ev.tier, &ev.data);
            return Kind::Applied;
        }
        self.pending = Some(BTreeMap::from([(id, (inc, ev.clone()))]));
        Kind::NeedsResync
    }

    /// Applies a snapshot; returns the incarnations of the replayed events.
    fn resync(&mut self, last: u64, snapshot: Model) -> Vec<u32> {
        self.model = snapshot;
        self.last = last;
        let mut replayed = Vec::new();
        for (id, (inc, ev)) in self.pending.take().unwrap_or_default() {
            if id == self.last + 1 {
                self.last = id;
                self.model.apply(ev.tier, &ev.data);
                replayed.push(inc);
            }
        }
        replayed
    }
}

/// A simulated worker: the truth, its event log and its channel to the index.
#[derive(Debug)]
struct SimWorker {
    id: WorkerId,
    truth: Model,
    incarnation: u32,
    log: Vec<KvEvent>,
    channel: VecDeque<(u32, KvEvent)>,
}

impl SimWorker {
    /// The truth after the first `n` events of the current incarnation.
    fn truth_at(&self, n: u64) -> Model {
        let mut m = Model::default();
        for e in &self.log[..n as usize] {
            m.apply(e.tier, &e.data);
        }
        m
    }
}

/// A snapshot answer on its way: (last event id, contents, incarnation, step it arrives).
#[derive(Debug)]
struct Answer {
    last: u64,
    model: Model,
    incarnation: u32,
    due: usize,
}

#[derive(Debug, Default)]
struct Stats {
    resyncs: usize,
    converged: usize,
    replayed: usize,
    removals: usize,
    ignored: usize,
    overlap_checks: usize,
    nonzero_overlaps: usize,
}

struct Sim {
    rng: StdRng,
    index: PrefixIndex,
    max_buffered: usize,
    chains: Vec<Vec<SequenceHash>>,
    workers: Vec<SimWorker>,
    mirrors: BTreeMap<WorkerId, Mirror>,
    answers: BTreeMap<WorkerId, Answer>,
    lossy: bool,
    stats: Stats,
}

/// Chains sharing prefixes: new roots, or extensions of a prefix of an earlier chain.
fn universe(rng: &mut StdRng, n: usize) -> Vec<Vec<SequenceHash>> {
    let mut chains: Vec<Vec<SequenceHash>> = Vec::new();
    for i in 0..n {
        let len = rng.random_range(1..=12);
        if chains.is_empty() || rng.random_bool(0.3) {
            chains.push(chain(1000 + i as u64, len));
        } else {
            let base = &chains[rng.random_range(0..chains.len())];
            let keep = rng.random_range(1..=base.len());
            let mut c = base[..keep].to_vec();
            c.extend(chain_from(Some(c[keep - 1]), 1000 + i as u64, len));
            chains.push(c);
        }
    }
    chains
}

impl Sim {
    fn new(seed: u64, workers: usize, max_buffered: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let chains = universe(&mut rng, 30);
        let workers = (0..workers)
            .map(|i| SimWorker {
                id: WorkerId::new(format!("node-{}/r{}", i / 2, i % 2)),
                truth: Model::default(),
                incarnation: 0,
                log: Vec::new(),
                channel: VecDeque::new(),
            })
            .collect();
        Sim {
            rng,
            index: PrefixIndex::new().with_max_buffered(max_buffered),
            max_buffered,
            chains,
            workers,
            mirrors: BTreeMap::new(),
            answers: BTreeMap::new(),
            lossy: true,
            stats: Stats::default(),
        }
    }

    fn random_tier(&mut self) -> Tier {
        if self.rng.random_bool(0.8) {
            Tier::Device
        } else {
            Tier::Host
        }
    }

    /// What worker `i` does next (always consistent with its truth).
    fn next_data(&mut self, i: usize, tier: Tier) -> KvEventData {
        let roll = self.rng.random_range(0..100);
        if roll < 60 {
            let c = self.chains[self.rng.random_range(0..self.chains.len())].clone();
            let start = if self.rng.random_bool(0.7) {
                0
            } else {
                self.rng.random_range(0..c.len())
            };
            let end = self.rng.random_range(start + 1..=c.len());
            let parent = start.checked_sub(1).map(|p| c[p]);
            return stored(parent, &c[start..end]);
        }
        if roll < 95 {
            let bit = tier_bit(tier);
            let held: Vec<SequenceHash> = self.workers[i]
                .truth
                .blocks
                .iter()
                .filter(|(_, e)| e.1 & bit != 0)
                .map(|(h, _)| *h)
                .collect();
            let mut pick = Vec::new();
            for _ in 0..self.rng.random_range(1..=3) {
                if !held.is_empty() && self.rng.random_bool(0.9) {
                    pick.push(held[self.rng.random_range(0..held.len())]);
                } else {
                    let c = &self.chains[self.rng.random_range(0..self.chains.len())];
                    pick.push(c[self.rng.random_range(0..c.len())]);
                }
            }
            return removed(&pick);
        }
        KvEventData::Cleared
    }

    /// Worker `i` emits one event into its (possibly lossy) channel.
    fn emit(&mut self, i: usize) {
        let tier = self.random_tier();
        let data = self.next_data(i, tier);
        let w = &mut self.workers[i];
        w.truth.apply(tier, &data);
        let ev = KvEvent {
            worker: w.id.clone(),
            event_id: EventId(w.log.len() as u64 + 1),
            tier,
            data,
        };
        w.log.push(ev.clone());
        let item = (w.incarnation, ev);
        let roll = if self.lossy {
            self.rng.random_range(0..100)
        } else {
            99
        };
        let w = &mut self.workers[i];
        match roll {
            0..2 => {}
            2..4 => {
                w.channel.push_back(item.clone());
                w.channel.push_back(item);
            }
            4..7 if !w.channel.is_empty() => {
                let at = w.channel.len() - 1;
                w.channel.insert(at, item);
            }
            _ => w.channel.push_back(item),
        }
    }

    /// The index receives the oldest event in worker `i`'s channel.
    fn deliver(&mut self, i: usize, step: usize) {
        let Some((inc, ev)) = self.workers[i].channel.pop_front() else {
            return;
        };
        let id = self.workers[i].id.clone();
        let mirror = self.mirrors.entry(id.clone()).or_default();
        let last = mirror.last;
        let want = mirror.apply(inc, &ev, self.max_buffered);
        let got = self.index.apply(&ev);
        assert_eq!(kind(&got), want, "{ev:?}");
        self.stats.ignored += usize::from(want == Kind::Ignored);
        if let ApplyOutcome::NeedsResync { worker, reason } = got {
            assert_eq!(worker, id);
            check_reason(&reason, last, ev.event_id.0);
            assert!(
                !self.answers.contains_key(&id),
                "second outstanding resync for {id}"
            );
            self.ask_snapshot(i, step);
        }
        assert_eq!(
            self.index.is_pending(&id),
            self.mirrors[&id].pending.is_some()
        );
        assert_eq!(self.index.is_pending(&id), self.answers.contains_key(&id));
    }

    /// The worker answers with its state now; the answer arrives after a random delay.
    fn ask_snapshot(&mut self, i: usize, step: usize) {
        let delay = self.rng.random_range(0..40);
        let w = &self.workers[i];
        let answer = Answer {
            last: w.log.len() as u64,
            model: w.truth.clone(),
            incarnation: w.incarnation,
            due: step + delay,
        };
        self.answers.insert(w.id.clone(), answer);
    }

    fn answer_all_now(&mut self, step: usize) {
        for a in self.answers.values_mut() {
            a.due = step;
        }
        self.deliver_due_answers(step);
    }

    fn deliver_due_answers(&mut self, step: usize) {
        let due: Vec<WorkerId> = self
            .answers
            .iter()
            .filter(|(_, a)| a.due <= step)
            .map(|(w, _)| w.clone())
            .collect();
        for id in due {
            let a = self.answers.remove(&id).expect("listed above");
            self.resync(&id, a);
        }
    }

    fn resync(&mut self, id: &WorkerId, a: Answer) {
        let dev = a.model.snapshot(Tier::Device);
        let host = a.model.snapshot(Tier::Host);
        let snapshot: [(Tier, &[SnapshotBlock]); 2] = [(Tier::Device, &dev), (Tier::Host, &host)];
        let report = self.index.resync_tiers(id, EventId(a.last), &snapshot);
        let mirror = self.mirrors.entry(id.clone()).or_default();
        let replayed = mirror.resync(a.last, a.model);
        assert_eq!(report.replayed, replayed.len());
        self.stats.resyncs += 1;
        self.stats.replayed += replayed.len();
        // Exactly the model after every resync.
        self.assert_worker_matches(id);
        // And the truth, when nothing of another incarnation was mixed in.
        let w = self
            .workers
            .iter()
            .find(|w| &w.id == id)
            .expect("simulated");
        let same_life =
            a.incarnation == w.incarnation && replayed.iter().all(|i| *i == w.incarnation);
        if same_life {
            let last = self.mirrors[id].last;
            assert_eq!(self.mirrors[id].model, w.truth_at(last), "resync of {id}");
            self.stats.converged += 1;
        }
    }

    fn reset_worker(&mut self, i: usize) {
        let w = &mut self.workers[i];
        w.incarnation += 1;
        w.truth = Model::default();
        w.log.clear();
        w.channel.clear();
    }

    fn remove_worker(&mut self, i: usize) {
        let id = self.workers[i].id.clone();
        let known = self.mirrors.remove(&id).is_some();
        assert_eq!(self.index.remove_worker(&id), known);
        self.answers.remove(&id);
        self.stats.removals += 1;
        assert_eq!(self.index.blocks_of(&id), 0);
        assert_eq!(self.index.last_event_id(&id), None);
        assert!(!self.index.is_pending(&id));
        self.assert_totals();
    }

    fn assert_worker_matches(&self, id: &WorkerId) {
        let mirror = &self.mirrors[id];
        let held: BTreeMap<SequenceHash, u8> = self
            .index
            .held_by(id)
            .into_iter()
            .map(|(h, t)| (h, t.0))
            .collect();
        assert_eq!(held, mirror.model.tiers(), "contents of {id}");
        assert_eq!(self.index.last_event_id(id), Some(EventId(mirror.last)));
    }

    fn assert_totals(&self) {
        ok(&self.index);
        let mut union = BTreeSet::new();
        let mut holdings = 0;
        for m in self.mirrors.values() {
            union.extend(m.model.blocks.keys().copied());
            holdings += m.model.blocks.len();
        }
        assert_eq!(self.index.num_blocks(), union.len());
        assert_eq!(self.index.num_holdings(), holdings);
        assert_eq!(self.index.num_workers(), self.mirrors.len());
        assert!(self.index.num_nodes() >= union.len());
    }

    fn assert_all_match(&self) {
        for id in self.mirrors.keys() {
            self.assert_worker_matches(id);
        }
        self.assert_totals();
    }

    /// A request: a chain prefix, sometimes with a foreign tail or a foreign block inside.
    fn random_request(&mut self) -> Vec<SequenceHash> {
        let c = &self.chains[self.rng.random_range(0..self.chains.len())];
        let mut req = c[..self.rng.random_range(1..=c.len())].to_vec();
        if self.rng.random_bool(0.2) {
            let at = self.rng.random_range(0..req.len());
            req[at] = SequenceHash(self.rng.random());
        }
        if self.rng.random_bool(0.2) {
            let last = *req.last().expect("not empty");
            req.extend(chain_from(Some(last), self.rng.random(), 2));
        }
        req
    }

    fn check_overlaps(&mut self) {
        let req = self.random_request();
        let filter = match self.rng.random_range(0..3) {
            0 => TierSet::ALL,
            1 => TierSet::DEVICE,
            _ => TierSet::only(Tier::Host),
        };
        let o = self.index.overlaps_in(&req, filter);
        let mut nonzero = 0;
        for w in &self.workers {
            let want = self
                .mirrors
                .get(&w.id)
                .map_or(0, |m| m.model.overlap(&req, filter));
            assert_eq!(o.get(&w.id), want, "overlap of {} on {req:?}", w.id);
            nonzero += usize::from(want > 0);
        }
        assert_eq!(o.iter().count(), nonzero);
        self.stats.overlap_checks += 1;
        self.stats.nonzero_overlaps += nonzero;
    }

    fn step(&mut self, step: usize) {
        let i = self.rng.random_range(0..self.workers.len());
        match self.rng.random_range(0..1000) {
            0..450 => self.emit(i),
            450..960 => self.deliver(i, step),
            960..985 => self.reset_worker(i),
            985..995 => self.remove_worker(i),
            _ => self.check_overlaps(),
        }
        self.deliver_due_answers(step);
        if step.is_multiple_of(7) {
            self.check_overlaps();
        }
        if step.is_multiple_of(97) {
            self.assert_all_match();
        }
    }

    /// Quiet network: drain every channel, answer every resync, and poke each worker with
    /// one clean event (a lagging index only notices on the next event), until the index is
    /// in step with every worker's truth.
    fn settle(&mut self, step: usize) {
        self.lossy = false;
        for _ in 0..3 {
            for i in 0..self.workers.len() {
                while !self.workers[i].channel.is_empty() {
                    self.deliver(i, step);
                }
            }
            self.answer_all_now(step);
            for i in 0..self.workers.len() {
                self.emit(i);
                self.deliver(i, step);
            }
            self.answer_all_now(step);
        }
        // Clean traffic now applies without any resync.
        for _ in 0..200 {
            let i = self.rng.random_range(0..self.workers.len());
            self.emit(i);
            self.deliver(i, step);
            assert!(
                self.answers.is_empty(),
                "resync requested on a clean channel"
            );
        }
        for w in &self.workers {
            if let Some(m) = self.mirrors.get(&w.id) {
                assert_eq!(m.model, w.truth, "{} after settling", w.id);
                assert_eq!(m.last, w.log.len() as u64);
            }
        }
        self.assert_all_match();
    }
}

fn check_reason(reason: &ResyncReason, last: u64, got: u64) {
    let ok = match reason {
        ResyncReason::Gap { expected, got: g } => {
            got > last + 1 && expected.0 == last + 1 && g.0 == got
        }
        ResyncReason::Reset { last: l } => got == 1 && l.0 == last && last >= 1,
        ResyncReason::Duplicate { last: l, got: g } => {
            got <= last && got != 1 && l.0 == last && g.0 == got
        }
    };
    assert!(ok, "{reason:?} for last {last}, got {got}");
}

fn run_sim(seed: u64, workers: usize, max_buffered: usize, steps: usize) -> Stats {
    let mut sim = Sim::new(seed, workers, max_buffered);
    for step in 0..steps {
        sim.step(step);
    }
    sim.assert_all_match();
    sim.settle(steps);
    // Removing every worker empties the index.
    for i in 0..sim.workers.len() {
        sim.remove_worker(i);
    }
    assert_eq!(
        (
            sim.index.num_nodes(),
            sim.index.num_blocks(),
            sim.index.num_holdings()
        ),
        (0, 0, 0)
    );
    sim.stats
}

#[test]
fn random_event_streams_match_the_model() {
    for seed in 1..=12 {
        let stats = run_sim(seed, 5, DEFAULT_MAX_BUFFERED, 4000);
        println!("seed {seed}: {stats:?}");
        assert!(stats.resyncs >= 20, "seed {seed}: {stats:?}");
        assert!(
            stats.converged * 10 >= stats.resyncs * 8,
            "seed {seed}: {stats:?}"
        );
        assert!(stats.replayed > 0, "seed {seed}: {stats:?}");
        assert!(stats.removals > 0, "seed {seed}: {stats:?}");
        assert!(
            stats.nonzero_overlaps > stats.overlap_checks,
            "seed {seed}: overlaps mostly trivial {stats:?}"
        );
    }
}

#[test]
fn random_event_streams_with_a_tiny_buffer() {
    for seed in [11, 12, 13] {
        let stats = run_sim(seed, 3, 2, 3000);
        println!("seed {seed}: {stats:?}");
        assert!(stats.resyncs >= 10, "seed {seed}: {stats:?}");
    }
}

#[test]
fn random_event_streams_with_many_workers() {
    let stats = run_sim(21, 24, DEFAULT_MAX_BUFFERED, 6000);
    println!("{stats:?}");
    assert!(stats.resyncs >= 20, "{stats:?}");
}
