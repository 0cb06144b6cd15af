//! Tests of the lower tiers (G2 host, G3 disk) against a model of the bytes: every copy is
//! carried out on a map of block contents, as a driver would, so that an onboarded block is
//! checked to hold exactly the KV of its sequence hash.

use std::collections::{HashMap, HashSet, VecDeque};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::runtime::ids::{EventId, SeqId, SequenceHash, WorkerId};

const SALT: u64 = 0x5EED;

fn tiered(g1: usize, host: usize, disk: usize, in_flight: usize) -> BlockPool {
    BlockPool::new(g1, 4, SALT)
        .expect("pool")
        .with_worker(WorkerId::new("w/r0"))
        .with_tiers(TierConfig {
            host_blocks: host,
            disk_blocks: disk,
            max_offloads_in_flight: in_flight,
            disk_min_hits: 1,
        })
        .expect("tiers")
}

fn toks(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

/// The bytes of every tier, keyed by location; a block's "KV" is its sequence hash.
#[derive(Default)]
struct Bytes {
    at: HashMap<BlockLoc, SequenceHash>,
    /// Store-lane copies not carried out yet, in issue order; load-lane ones.
    store: VecDeque<TierCopy>,
    load: Vec<TierCopy>,
}

impl Bytes {
    /// The engine wrote the KV of `seq`'s blocks `from..to` (block indexes).
    fn write(&mut self, p: &BlockPool, seq: SeqId, from_tok: usize, to_tok: usize) {
        let bs = p.block_size();
        let tokens = &p.seqs[&seq].tokens;
        let hashes = block_hashes(&tokens[..to_tok.min(tokens.len()) / bs * bs], bs, SALT);
        let table = p.block_table(seq).expect("table").to_vec();
        for i in from_tok / bs..hashes.len() {
            self.at.insert(BlockLoc::Device(table[i].0), hashes[i].1);
        }
    }

    fn take(&mut self, p: &mut BlockPool) {
        for c in p.drain_copies() {
            if c.is_store() {
                self.store.push_back(c);
            } else {
                self.load.push(c);
            }
        }
    }

    /// Carries out every copy issued so far (the store lane in order) and reports them all
    /// landed or corrupt; returns the onboards that finished.
    fn run_all(&mut self, p: &mut BlockPool) -> Vec<(SeqId, usize)> {
        self.take(p);
        let mut r = Vec::new();
        while let Some(c) = self.store.pop_front() {
            r.push((c.id, self.run(&c)));
        }
        for c in std::mem::take(&mut self.load) {
            r.push((c.id, self.run(&c)));
        }
        p.copies_done(&r)
    }

    /// Carries out one copy: the source must hold the block (else corrupt, which only a
    /// damaged disk slot may be).
    fn run(&mut self, c: &TierCopy) -> CopyOutcome {
        let got = self.at.get(&c.from).copied();
        if got != Some(c.block.seq_hash) {
            assert!(
                matches!(c.from, BlockLoc::Disk(_)),
                "{c:?}: source holds {got:?}: bytes overwritten under a copy"
            );
            return CopyOutcome::Corrupt;
        }
        self.at.insert(c.to, c.block.seq_hash);
        CopyOutcome::Done
    }
}

#[test]
fn registration_offloads_and_an_evicted_prefix_onboards_from_host() {
    let mut p = tiered(8, 16, 0, 64);
    let mut bytes = Bytes::default();
    let prompt = toks(13, 1); // 3 full blocks (+1 token)
    let a = p.allocate_onboarding(SeqId(1), &prompt).expect("alloc");
    assert_eq!((a.cached_tokens, a.onboard_tokens), (0, 0));
    p.mark_computed(SeqId(1), 13).expect("mark");
    bytes.write(&p, SeqId(1), 0, 13);
    bytes.take(&mut p);
    assert_eq!(bytes.store.len(), 3, "one offload per registered block");
    // Held while their copy is in flight: not evictable even after the sequence ends.
    p.free(a.lease).expect("free");
    assert_eq!(p.evict(8), 0);
    let results: Vec<_> = std::mem::take(&mut bytes.store)
        .into_iter()
        .map(|c| (c.id, bytes.run(&c)))
        .collect();
    assert!(p.copies_done(&results).is_empty());
    p.check_invariants().expect("invariants");
    let u = p.tier_usage().expect("tiers");
    assert_eq!((u.host_blocks, u.counters.offloads), (3, 3));
    assert_eq!(p.evict(8), 3);
    assert_eq!(p.match_prefix(&prompt), 0);

    // The same prompt again: all three blocks come back from G2.
    let b = p.allocate_onboarding(SeqId(2), &prompt).expect("alloc");
    assert_eq!((b.cached_tokens, b.onboard_tokens), (0, 12));
    assert!(p.is_onboarding(SeqId(2)));
    bytes.take(&mut p);
    assert_eq!(bytes.load.len(), 3);
    let results: Vec<_> = std::mem::take(&mut bytes.load)
        .into_iter()
        .map(|c| (c.id, bytes.run(&c)))
        .collect();
    assert_eq!(p.copies_done(&results), vec![(SeqId(2), 12)]);
    p.mark_computed(SeqId(2), 12).expect("mark");
    // Byte-identical: the G1 blocks hold the KV of their own sequence hashes.
    let want = block_hashes(&prompt[..12], 4, SALT);
    for (i, b) in p.block_table(SeqId(2)).expect("table")[..3]
        .iter()
        .enumerate()
    {
        assert_eq!(bytes.at[&BlockLoc::Device(b.0)], want[i].1);
    }
    assert_eq!(p.match_prefix(&prompt), 12);
    assert_eq!(p.tier_usage().expect("tiers").counters.onboards_host, 3);
    p.check_invariants().expect("invariants");
    // Events name the tier: a replay holds the same blocks per tier as the pool.
    let mut replay = EventReplay::new();
    for e in p.drain_events() {
        replay.apply(&e).expect("no gap");
    }
    for tier in [Tier::Device, Tier::Host] {
        let got: HashSet<_> = replay.tier_blocks(tier).into_iter().collect();
        let want: HashSet<_> = p.snapshot_tier(tier).into_iter().collect();
        assert_eq!(got, want, "{tier:?}");
    }
}

#[test]
fn offloads_beyond_the_queue_are_dropped_and_counted() {
    let mut p = tiered(16, 16, 0, 2);
    let _a = p
        .allocate_onboarding(SeqId(1), &toks(17, 1))
        .expect("alloc");
    p.mark_computed(SeqId(1), 17).expect("mark");
    assert_eq!(p.drain_copies().len(), 2);
    let c = p.tier_usage().expect("tiers").counters;
    assert_eq!(c.offload_drops, 2);
    p.check_invariants().expect("invariants");
}

#[test]
fn only_reused_blocks_are_demoted_to_disk() {
    // G2 holds 2 blocks: a third offload evicts the least recent to G3 if it was reused.
    let mut p = tiered(16, 2, 8, 64);
    let mut bytes = Bytes::default();
    let hot = toks(5, 100); // 1 block
    let a = p.allocate_onboarding(SeqId(1), &hot).expect("alloc");
    p.mark_computed(SeqId(1), 5).expect("mark");
    bytes.write(&p, SeqId(1), 0, 5);
    bytes.run_all(&mut p);
    p.free(a.lease).expect("free");
    // Reused once in G1, then evicted: G2's entry carries the hit.
    let b = p.allocate_onboarding(SeqId(2), &hot).expect("alloc");
    assert_eq!(b.cached_tokens, 4);
    p.free(b.lease).expect("free");
    assert_eq!(p.evict(16), 1);
    for (k, base) in [(3u64, 200), (4, 300)] {
        let l = p
            .allocate_onboarding(SeqId(k), &toks(5, base))
            .expect("alloc");
        p.mark_computed(SeqId(k), 5).expect("mark");
        bytes.write(&p, SeqId(k), 0, 5);
        bytes.run_all(&mut p);
        p.free(l.lease).expect("free");
    }
    // `hot` went to disk; of the two cold blocks the older left G2 for nowhere.
    let u = p.tier_usage().expect("tiers");
    assert_eq!(
        (u.host_blocks, u.disk_blocks, u.counters.demotions),
        (2, 1, 1)
    );
    assert_eq!(
        p.snapshot_tier(Tier::Disk)[0].seq_hash,
        block_hashes(&hot[..4], 4, SALT)[0].1
    );
    // It onboards from disk, byte-identical.
    let c = p.allocate_onboarding(SeqId(5), &hot).expect("alloc");
    assert_eq!(c.onboard_tokens, 4);
    assert_eq!(bytes.run_all(&mut p), vec![(SeqId(5), 4)]);
    assert_eq!(p.tier_usage().expect("tiers").counters.onboards_disk, 1);
    p.check_invariants().expect("invariants");
}

#[test]
fn a_corrupt_disk_block_is_a_miss_and_is_dropped() {
    let mut p = tiered(16, 2, 8, 64);
    let mut bytes = Bytes::default();
    let prompt = toks(9, 100); // 2 blocks, both offloaded to G2
    let a = p.allocate_onboarding(SeqId(1), &prompt).expect("alloc");
    p.mark_computed(SeqId(1), 9).expect("mark");
    bytes.write(&p, SeqId(1), 0, 9);
    bytes.run_all(&mut p);
    p.free(a.lease).expect("free");
    // Reused once, then evicted from G1: G2's entries carry the hit.
    let b = p.allocate_onboarding(SeqId(2), &prompt).expect("alloc");
    assert_eq!(b.cached_tokens, 8);
    p.free(b.lease).expect("free");
    p.evict(16);
    // A new prompt's offloads push both to disk.
    let c = p
        .allocate_onboarding(SeqId(3), &toks(9, 500))
        .expect("alloc");
    p.mark_computed(SeqId(3), 9).expect("mark");
    bytes.write(&p, SeqId(3), 0, 9);
    bytes.run_all(&mut p);
    p.free(c.lease).expect("free");
    p.evict(16);
    assert_eq!(p.tier_usage().expect("tiers").disk_blocks, 2);
    // Damage block 1 on disk: the onboard keeps block 0 and recomputes from block 1.
    let h1 = block_hashes(&prompt[..8], 4, SALT)[1].1;
    let slot = bytes
        .at
        .iter()
        .find(|(l, h)| matches!(l, BlockLoc::Disk(_)) && **h == h1)
        .map(|(l, _)| *l)
        .expect("on disk");
    bytes.at.insert(slot, SequenceHash(0xBAD));
    let d = p.allocate_onboarding(SeqId(4), &prompt).expect("alloc");
    assert_eq!(d.onboard_tokens, 8);
    assert_eq!(bytes.run_all(&mut p), vec![(SeqId(4), 4)]);
    let u = p.tier_usage().expect("tiers");
    assert_eq!((u.counters.corrupt, u.disk_blocks), (1, 1));
    p.check_invariants().expect("invariants");
    p.mark_computed(SeqId(4), 4).expect("mark");
    assert_eq!(
        p.match_prefix(&prompt),
        4,
        "the corrupt block is never served"
    );
}

/// Random allocations (onboarding), prefill, decode, frees, evictions and copies returned in
/// random batches and outcomes, on the byte model; the invariants, the per-tier replay and
/// the bytes of every onboarded block are checked after each operation.
fn random_run(seed: u64, steps: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut p = tiered(24, 12, 16, 6);
    let mut bytes = Bytes::default();
    let prefixes: Vec<Vec<u32>> = (0..5)
        .map(|_| {
            (0..rng.random_range(4..20))
                .map(|_| rng.random_range(0..3))
                .collect()
        })
        .collect();
    let mut leases: HashMap<SeqId, SeqLease> = HashMap::new();
    // Sequences whose onboard is out, and those freed meanwhile (freed when it returns).
    let mut orphans: HashMap<SeqId, SeqLease> = HashMap::new();
    let mut next_seq = 0u64;
    let mut replay = EventReplay::new();
    let mut next_event = 1u64;
    let mut stats = [0usize; 6];
    for step in 0..steps {
        let live: Vec<SeqId> = {
            let mut v: Vec<_> = leases
                .keys()
                .copied()
                .filter(|s| !p.is_onboarding(*s))
                .collect();
            v.sort();
            v
        };
        let pick = |rng: &mut StdRng| live[rng.random_range(0..live.len())];
        match rng.random_range(0..100) {
            0..25 => {
                let mut prompt = prefixes[rng.random_range(0..prefixes.len())].clone();
                prompt.truncate(rng.random_range(1..=prompt.len()));
                prompt.extend((0..rng.random_range(0..8)).map(|_| rng.random_range(0..3u32)));
                next_seq += 1;
                let s = SeqId(next_seq);
                match p.allocate_onboarding(s, &prompt) {
                    Ok(a) => {
                        assert!(a.cached_tokens + a.onboard_tokens < prompt.len());
                        stats[0] += usize::from(a.onboard_tokens > 0);
                        leases.insert(s, a.lease);
                    }
                    Err(PoolError::OutOfBlocks { .. }) => {}
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            25..45 if !live.is_empty() => {
                let s = pick(&mut rng);
                let known = p.seqs[&s].tokens.len();
                let from = p.num_computed(s).unwrap_or(0);
                let n = rng.random_range(from..=known);
                bytes.write(&p, s, from, n);
                p.mark_computed(s, n).expect("within known tokens");
            }
            45..55 if !live.is_empty() => {
                let s = pick(&mut rng);
                let new: Vec<u32> = (0..rng.random_range(1..4))
                    .map(|_| rng.random_range(0..3))
                    .collect();
                let _ = p.append_tokens(s, &new);
            }
            55..68 if !leases.is_empty() => {
                let mut all: Vec<SeqId> = leases.keys().copied().collect();
                all.sort();
                let s = all[rng.random_range(0..all.len())];
                let lease = leases.remove(&s).expect("live");
                if p.is_onboarding(s) {
                    orphans.insert(s, lease);
                } else {
                    p.free(lease).expect("free");
                }
            }
            68..76 => {
                p.evict(rng.random_range(0..6));
            }
            76..100 => {
                bytes.take(&mut p);
                // A prefix of the store lane, in order; any load copies.
                let mut r = Vec::new();
                for _ in 0..rng.random_range(0..=bytes.store.len()) {
                    let c = bytes.store.pop_front().expect("queued");
                    let out = if rng.random_bool(0.05) {
                        CopyOutcome::Failed
                    } else {
                        bytes.run(&c)
                    };
                    r.push((c.id, out));
                }
                let mut keep = Vec::new();
                for c in std::mem::take(&mut bytes.load) {
                    if rng.random_bool(0.5) {
                        keep.push(c);
                        continue;
                    }
                    if let BlockLoc::Disk(_) = c.from
                        && rng.random_bool(0.05)
                    {
                        bytes.at.insert(c.from, SequenceHash(0xBAD));
                    }
                    let out = if rng.random_bool(0.03) {
                        CopyOutcome::Failed
                    } else {
                        bytes.run(&c)
                    };
                    stats[1] += usize::from(out == CopyOutcome::Corrupt);
                    stats[2] += usize::from(matches!(c.from, BlockLoc::Disk(_)));
                    r.push((c.id, out));
                }
                bytes.load = keep;
                for (s, computed) in p.copies_done(&r) {
                    if let Some(l) = orphans.remove(&s) {
                        p.free(l).expect("free");
                        continue;
                    }
                    // Byte-identical: every block counted as computed holds its own KV.
                    let bs = p.block_size();
                    let tokens = p.seqs[&s].tokens.clone();
                    let want = block_hashes(&tokens[..computed / bs * bs], bs, SALT);
                    let table = p.block_table(s).expect("table").to_vec();
                    for (i, (_, h)) in want.iter().enumerate() {
                        assert_eq!(
                            bytes.at.get(&BlockLoc::Device(table[i].0)),
                            Some(h),
                            "seed {seed} step {step}: onboarded block {i} of {s}"
                        );
                    }
                    p.mark_computed(s, computed).expect("mark");
                    stats[3] += 1;
                }
            }
            _ => {}
        }
        let u = p.tier_usage().expect("tiers");
        stats[4] += usize::from(u.counters.demotions > 0);
        stats[5] += usize::from(u.counters.offload_drops > 0);
        if let Err(e) = p.check_invariants() {
            panic!("seed {seed} step {step}: {e}");
        }
        for ev in p.drain_events() {
            assert_eq!(ev.event_id, EventId(next_event));
            next_event += 1;
            replay.apply(&ev).expect("no gap");
        }
        for tier in [Tier::Device, Tier::Host, Tier::Disk] {
            let got: HashSet<_> = replay.tier_blocks(tier).into_iter().collect();
            let want: HashSet<_> = p.snapshot_tier(tier).into_iter().collect();
            assert_eq!(got, want, "seed {seed} step {step} {tier:?}");
        }
    }
    assert!(
        stats.iter().all(|&n| n > 0),
        "every path exercised: {stats:?}"
    );
}

#[test]
fn seeded_random_tier_operations_keep_invariants_and_bytes() {
    for seed in [1, 2, 3, 0xDEAD_BEEF] {
        random_run(seed, 20_000);
    }
}

#[test]
fn tier_config_is_validated() {
    let bad = TierConfig {
        disk_blocks: 4,
        ..TierConfig::default()
    };
    assert!(matches!(
        BlockPool::new(4, 4, 0).expect("pool").with_tiers(bad),
        Err(PoolError::InvalidTiers(_))
    ));
    let off = BlockPool::new(4, 4, 0)
        .expect("pool")
        .with_tiers(TierConfig::default())
        .expect("off is valid");
    assert!(off.tier_usage().is_none());
}
