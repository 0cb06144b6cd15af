//! Unit tests and the seeded invariant test of the block pool.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::*;
use crate::runtime::ids::{BlockHash, EventId, SeqId, SequenceHash, WorkerId};

const SALT: u64 = 0x5EED;

fn pool(num_blocks: usize, block_size: usize) -> BlockPool {
    BlockPool::new(num_blocks, block_size, SALT)
        .expect("valid config")
        .with_worker(WorkerId::new("w/r0"))
}

fn toks(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

/// Allocates, marks the whole prompt computed, returns the lease.
fn fill(p: &mut BlockPool, seq: u64, prompt: &[u32]) -> Allocation {
    let a = p.allocate_sequence(SeqId(seq), prompt).expect("allocate");
    p.mark_computed(SeqId(seq), prompt.len()).expect("mark");
    a
}

fn replay_set(events: &[KvEvent], r: &mut EventReplay) -> HashSet<SnapshotBlock> {
    for e in events {
        r.apply(e).expect("no gap");
    }
    r.blocks().values().copied().collect()
}

#[test]
fn hash_recipe_is_pinned() {
    let v = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, SALT);
    assert_eq!(v.len(), 2);
    assert_eq!(v[0].0, BlockHash(0xa301127d2b4164db));
    assert_eq!(v[0].1, SequenceHash(0x899702b671825686));
    assert_eq!(v[1].0, BlockHash(0xaad4def0727b8c62));
    assert_eq!(v[1].1, SequenceHash(0x1385fdaa8dd540eb));
}

#[test]
fn hash_recipe_matches_documented_bytes() {
    let bytes: Vec<u8> = [1u32, 2, 3, 4]
        .iter()
        .flat_map(|t| t.to_le_bytes())
        .collect();
    let bh = xxh3_64_with_seed(&bytes, SALT);
    let mut chained = ROOT_PARENT_SEQ_HASH.to_le_bytes().to_vec();
    chained.extend_from_slice(&bh.to_le_bytes());
    let sh = xxh3_64_with_seed(&chained, SALT);
    let v = block_hashes(&[1, 2, 3, 4, 9], 4, SALT);
    assert_eq!(v, vec![(BlockHash(bh), SequenceHash(sh))]);
    assert_eq!(block_hash(&[1, 2, 3, 4], SALT), BlockHash(bh));
    assert_eq!(sequence_hash(None, BlockHash(bh), SALT), SequenceHash(sh));
}

#[test]
fn block_hashes_edge_cases() {
    assert!(block_hashes(&[1, 2, 3], 4, SALT).is_empty());
    assert!(block_hashes(&[1, 2, 3], 0, SALT).is_empty());
    assert!(block_hashes(&[], 4, SALT).is_empty());
    assert_ne!(
        block_hashes(&[1, 2, 3, 4], 4, 1),
        block_hashes(&[1, 2, 3, 4], 4, 2)
    );
    // Same block after different prefixes: equal block hash, different sequence hash.
    let a = block_hashes(&[1, 1, 7, 7], 2, SALT);
    let b = block_hashes(&[2, 2, 7, 7], 2, SALT);
    assert_eq!(a[1].0, b[1].0);
    assert_ne!(a[1].1, b[1].1);
}

#[test]
fn new_rejects_bad_config() {
    assert!(matches!(
        BlockPool::new(0, 4, 0),
        Err(PoolError::InvalidConfig(_))
    ));
    assert!(matches!(
        BlockPool::new(4, 0, 0),
        Err(PoolError::InvalidConfig(_))
    ));
}

#[test]
fn prefix_reuse_second_prompt_is_cached() {
    for len in [1usize, 4, 5, 8, 9, 10, 13] {
        let mut p = pool(32, 4);
        let prompt = toks(len, 100);
        let a = fill(&mut p, 1, &prompt);
        assert_eq!(a.cached_tokens, 0);
        p.free(a.lease).expect("free");
        let expect = (len - 1) / 4 * 4;
        assert_eq!(p.match_prefix(&prompt), expect, "len {len}");
        let b = p.allocate_sequence(SeqId(2), &prompt).expect("allocate");
        assert_eq!(b.cached_tokens, expect, "len {len}");
        assert_eq!(b.block_table.len(), (len + 1).div_ceil(4));
        p.check_invariants().expect("invariants");
        p.free(b.lease).expect("free");
    }
}

#[test]
fn prefix_reuse_shares_blocks_between_live_sequences() {
    let mut p = pool(32, 4);
    let a = fill(&mut p, 1, &toks(12, 0));
    let mut longer = toks(12, 0);
    longer.extend([77, 78, 79]);
    let b = p.allocate_sequence(SeqId(2), &longer).expect("allocate");
    assert_eq!(b.cached_tokens, 12);
    assert_eq!(&b.block_table[..3], &a.block_table[..3]);
    p.check_invariants().expect("invariants");
    assert_eq!(p.match_prefix(&[]), 0);
    assert_eq!(p.match_prefix(&[0]), 0);
    p.free(a.lease).expect("free");
    p.free(b.lease).expect("free");
    assert_eq!(p.usage().used_blocks, 0);
}

#[test]
fn registration_equals_block_hashes() {
    let mut p = pool(32, 4);
    let prompt = toks(11, 5);
    let a = p.allocate_sequence(SeqId(1), &prompt).expect("allocate");
    assert!(
        p.drain_events().is_empty(),
        "nothing registered before compute"
    );
    assert_eq!(p.match_prefix(&prompt), 0);
    assert_eq!(p.mark_computed(SeqId(1), 5).expect("mark"), 1);
    assert_eq!(p.mark_computed(SeqId(1), 3).expect("backwards ignored"), 0);
    assert_eq!(p.mark_computed(SeqId(1), 11).expect("mark"), 1);
    let want: Vec<_> = block_hashes(&prompt, 4, SALT);
    let snap = p.snapshot();
    let got: Vec<_> = snap.iter().map(|b| (b.block_hash, b.seq_hash)).collect();
    assert_eq!(got, want);
    assert_eq!(snap[0].parent, None);
    assert_eq!(snap[1].parent, Some(want[0].1));
    let ev = p.drain_events();
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0].event_id, EventId(1));
    assert_eq!(ev[1].event_id, EventId(2));
    assert_eq!(ev[0].tier, Tier::Device);
    assert_eq!(ev[0].worker, WorkerId::new("w/r0"));
    assert_eq!(
        ev[1].data,
        KvEventData::Stored {
            parent: Some(want[0].1),
            blocks: vec![StoredBlock {
                seq_hash: want[1].1,
                block_hash: want[1].0
            }],
        }
    );
    p.free(a.lease).expect("free");
}

#[test]
fn decode_appends_register_blocks() {
    let mut p = pool(8, 2);
    let a = fill(&mut p, 1, &[1, 2, 3]);
    assert_eq!(a.block_table.len(), 2);
    p.append_tokens(SeqId(1), &[4]).expect("fits the +1 slot");
    assert_eq!(p.block_table(SeqId(1)).map(<[_]>::len), Some(2));
    p.mark_computed(SeqId(1), 4).expect("mark");
    assert_eq!(p.usage().registered_blocks, 2);
    p.append_tokens(SeqId(1), &[5, 6, 7]).expect("grow");
    assert_eq!(p.block_table(SeqId(1)).map(<[_]>::len), Some(4));
    assert_eq!(
        p.mark_computed(SeqId(1), 8),
        Err(PoolError::ComputedBeyondTokens {
            seq: SeqId(1),
            computed: 8,
            known: 7
        })
    );
    p.check_invariants().expect("invariants");
    p.free(a.lease).expect("free");
}

#[test]
fn lru_evicts_oldest_release_tail_first() {
    let mut p = pool(8, 2).with_eviction_policy(EvictionPolicy::lru());
    let a = fill(&mut p, 1, &[1, 2, 3, 4]); // 3 blocks, 2 registered
    let b = fill(&mut p, 2, &[5, 6, 7, 8]);
    let ha = block_hashes(&[1, 2, 3, 4], 2, SALT);
    let hb = block_hashes(&[5, 6, 7, 8], 2, SALT);
    p.free(a.lease).expect("free");
    p.free(b.lease).expect("free");
    p.drain_events();
    let order: Vec<SequenceHash> = (0..4)
        .flat_map(|_| {
            assert_eq!(p.evict(1), 1);
            match p.drain_events().pop().map(|e| e.data) {
                Some(KvEventData::Removed { blocks }) => blocks,
                other => panic!("expected Removed, got {other:?}"),
            }
        })
        .collect();
    assert_eq!(order, vec![ha[1].1, ha[0].1, hb[1].1, hb[0].1]);
    assert_eq!(p.evict(5), 0);
    p.check_invariants().expect("invariants");
}

#[test]
fn allocation_evicts_lru_and_reports_removed() {
    let mut p = pool(4, 2).with_eviction_policy(EvictionPolicy::lru());
    let a = fill(&mut p, 1, &[1, 2, 3]); // blocks: [1,2] registered, [3,_]
    p.free(a.lease).expect("free");
    p.drain_events();
    let b = p
        .allocate_sequence(SeqId(2), &[9, 9, 9, 9, 9, 9, 9])
        .expect("evicts one");
    assert_eq!(b.block_table.len(), 4);
    let ev = p.drain_events();
    let h = block_hashes(&[1, 2], 2, SALT)[0].1;
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].data, KvEventData::Removed { blocks: vec![h] });
    p.free(b.lease).expect("free");
}

#[test]
fn frequency_bias_protects_hot_prefix() {
    let policy = EvictionPolicy {
        freq_bonus_ticks_per_hit: 100,
        max_counted_hits: 4,
    };
    let mut p = pool(16, 2).with_eviction_policy(policy);
    let hot = [1, 2, 3];
    let a = fill(&mut p, 1, &hot);
    p.free(a.lease).expect("free");
    for s in 2..5 {
        let l = p.allocate_sequence(SeqId(s), &hot).expect("reuse").lease;
        p.free(l).expect("free");
    }
    let c = fill(&mut p, 9, &[7, 8, 9]); // released later, never reused
    p.free(c.lease).expect("free");
    p.drain_events();
    assert_eq!(p.evict(1), 1);
    let cold = block_hashes(&[7, 8], 2, SALT)[0].1;
    let ev = p.drain_events();
    assert_eq!(ev[0].data, KvEventData::Removed { blocks: vec![cold] });
}

#[test]
fn dedup_keeps_existing_registered() {
    let mut p = pool(16, 2);
    let prompt = [1, 2, 3, 4, 5];
    let a = p.allocate_sequence(SeqId(1), &prompt).expect("a");
    let b = p.allocate_sequence(SeqId(2), &prompt).expect("b");
    assert_eq!(b.cached_tokens, 0, "nothing computed yet");
    p.mark_computed(SeqId(1), 5).expect("a computed");
    let stored = p.drain_events();
    assert_eq!(stored.len(), 1);
    assert_eq!(p.mark_computed(SeqId(2), 5).expect("b computed"), 0);
    assert!(p.drain_events().is_empty(), "duplicates emit nothing");
    let u = p.usage();
    assert_eq!((u.registered_blocks, u.used_blocks), (2, 6));
    p.check_invariants().expect("invariants");
    // The original is evicted while the duplicate lives: the registration moves over.
    let snap = p.snapshot();
    p.free(a.lease).expect("free a");
    assert_eq!(p.evict(10), 2);
    assert!(
        p.drain_events().is_empty(),
        "hash set unchanged: no Removed"
    );
    assert_eq!(p.snapshot(), snap);
    p.check_invariants().expect("invariants");
    assert_eq!(p.match_prefix(&prompt), 4);
    p.free(b.lease).expect("free b");
    assert_eq!(p.usage().cached_blocks, 2);
    p.check_invariants().expect("invariants");
}

#[test]
fn dedup_duplicate_returns_to_free_list() {
    let mut p = pool(16, 2);
    let a = p.allocate_sequence(SeqId(1), &[1, 2, 3]).expect("a");
    let b = p.allocate_sequence(SeqId(2), &[1, 2, 3]).expect("b");
    p.mark_computed(SeqId(1), 3).expect("mark");
    p.mark_computed(SeqId(2), 3).expect("mark");
    p.free(b.lease).expect("free b");
    let u = p.usage();
    assert_eq!((u.free_blocks, u.cached_blocks, u.used_blocks), (14, 0, 2));
    p.free(a.lease).expect("free a");
    p.check_invariants().expect("invariants");
}

#[test]
fn out_of_blocks_is_all_or_nothing() {
    let mut p = pool(4, 2);
    let a = fill(&mut p, 1, &[1, 2, 3, 4]); // 3 blocks
    p.drain_events();
    let before = (p.usage(), p.snapshot());
    let err = p
        .allocate_sequence(SeqId(2), &[5, 6, 7])
        .expect_err("needs 2, has 1");
    assert_eq!(err, PoolError::OutOfBlocks { needed: 2, free: 1 });
    assert_eq!((p.usage(), p.snapshot()), before);
    assert!(p.drain_events().is_empty());
    assert_eq!(p.block_table(SeqId(2)), None);
    let err = p
        .append_tokens(SeqId(1), &[5, 6, 7, 8, 9])
        .expect_err("needs 2 more");
    assert!(matches!(err, PoolError::OutOfBlocks { needed: 2, free: 1 }));
    assert_eq!((p.usage(), p.snapshot()), before);
    assert_eq!(p.block_table(SeqId(1)).map(<[_]>::len), Some(3));
    p.free(a.lease).expect("free");
}

#[test]
fn out_of_blocks_does_not_count_pinned_prefix_as_available() {
    let mut p = pool(4, 2);
    let a = fill(&mut p, 1, &[1, 2, 3, 4, 5]); // 3 blocks, 2 registered
    p.free(a.lease).expect("free"); // 1 free + 2 cached... plus the partial one freed
    assert_eq!(p.usage().available_blocks(), 4);
    // Reuses 2 cached blocks, needs 3 fresh for [5..9] + 1: only 2 left after pinning.
    let err = p.allocate_sequence(SeqId(2), &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(
        err.map(|a| a.cached_tokens),
        Err(PoolError::OutOfBlocks { needed: 3, free: 2 })
    );
    p.check_invariants().expect("invariants");
}

#[test]
fn caller_mistakes_are_errors() {
    let mut p = pool(4, 2);
    assert_eq!(
        p.allocate_sequence(SeqId(1), &[]).map(|a| a.cached_tokens),
        Err(PoolError::EmptyPrompt(SeqId(1)))
    );
    let a = p.allocate_sequence(SeqId(1), &[1]).expect("a");
    let dup = p.allocate_sequence(SeqId(1), &[1]).map(|a| a.cached_tokens);
    assert_eq!(dup, Err(PoolError::DuplicateSequence(SeqId(1))));
    assert_eq!(
        p.append_tokens(SeqId(9), &[1]),
        Err(PoolError::UnknownSequence(SeqId(9)))
    );
    assert_eq!(
        p.reserve(SeqId(9), 1),
        Err(PoolError::UnknownSequence(SeqId(9)))
    );
    assert_eq!(
        p.mark_computed(SeqId(9), 1),
        Err(PoolError::UnknownSequence(SeqId(9)))
    );
    let mut other = pool(4, 2);
    let o = other.allocate_sequence(SeqId(1), &[1]).expect("o");
    assert_eq!(p.free(o.lease), Err(PoolError::ForeignLease(SeqId(1))));
    assert_eq!(
        p.usage().active_sequences,
        1,
        "foreign free touched nothing here"
    );
    assert_eq!(other.reclaim_leaked(), 1, "the foreign lease went home");
    p.free(a.lease).expect("free");
}

#[test]
fn dropped_lease_is_reclaimed_and_counted() {
    let mut p = pool(8, 2);
    let a = fill(&mut p, 1, &[1, 2, 3]);
    drop(a.lease);
    assert_eq!(p.usage().active_sequences, 1, "reclaimed lazily");
    assert_eq!(p.evict(0), 0); // any mutating call reclaims
    assert_eq!(p.usage().active_sequences, 0);
    assert_eq!(p.usage().used_blocks, 0);
    assert_eq!(p.leaked_leases(), 1);
    p.check_invariants().expect("invariants");
}

#[test]
fn clear_drops_unpinned_and_reannounces_pinned() {
    let mut p = pool(16, 2);
    let a = fill(&mut p, 1, &[1, 2, 3, 4, 5]);
    let b = fill(&mut p, 2, &[7, 8, 9]);
    p.free(b.lease).expect("free b");
    let mut r = EventReplay::new();
    replay_set(&p.drain_events(), &mut r);
    p.clear();
    let ev = p.drain_events();
    assert_eq!(ev[0].data, KvEventData::Cleared);
    let got = replay_set(&ev, &mut r);
    let snap: HashSet<_> = p.snapshot().into_iter().collect();
    assert_eq!(got, snap);
    assert_eq!(snap.len(), 2, "a's two blocks survive");
    assert_eq!(p.usage().cached_blocks, 0);
    p.free(a.lease).expect("free a");
    p.check_invariants().expect("invariants");
}

#[test]
fn replay_detects_gaps() {
    let mut p = pool(8, 2);
    let a = fill(&mut p, 1, &[1, 2, 3]);
    p.free(a.lease).expect("free");
    p.evict(1);
    let ev = p.drain_events();
    let mut r = EventReplay::new();
    assert_eq!(
        r.apply(&ev[1]),
        Err(EventError::Gap {
            expected: EventId(1),
            got: EventId(2)
        })
    );
    r.apply(&ev[0]).expect("first");
    r.apply(&ev[1]).expect("second");
    assert_eq!(r.last_event(), Some(EventId(2)));
    assert!(r.blocks().is_empty());
}

/// Random operations over a small pool; every invariant checked after every step.
fn random_run(seed: u64, steps: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut p = pool(64, 4);
    let prefixes: Vec<Vec<u32>> = (0..4)
        .map(|_| {
            (0..rng.random_range(4..14))
                .map(|_| rng.random_range(0..3))
                .collect()
        })
        .collect();
    let mut leases: HashMap<SeqId, SeqLease> = HashMap::new();
    let mut next_seq = 0u64;
    let mut replay = EventReplay::new();
    let mut next_event = 1u64;
    let mut stats = [0usize; 5];
    for step in 0..steps {
        let live: Vec<SeqId> = {
            let mut v: Vec<_> = leases.keys().copied().collect();
            v.sort();
            v
        };
        let pick = |rng: &mut StdRng| live[rng.random_range(0..live.len())];
        match rng.random_range(0..100) {
            0..30 => {
                let mut prompt = prefixes[rng.random_range(0..prefixes.len())].clone();
                prompt.truncate(rng.random_range(0..=prompt.len()));
                prompt.extend((0..rng.random_range(0..10)).map(|_| rng.random_range(0..3u32)));
                next_seq += 1;
                let expect_cached = p.match_prefix(&prompt);
                match p.allocate_sequence(SeqId(next_seq), &prompt) {
                    Ok(a) => {
                        assert_eq!(a.cached_tokens, expect_cached);
                        assert!(a.cached_tokens < prompt.len());
                        stats[0] += 1;
                        stats[1] += usize::from(a.cached_tokens > 0);
                        leases.insert(SeqId(next_seq), a.lease);
                    }
                    Err(PoolError::EmptyPrompt(_)) => assert!(prompt.is_empty()),
                    Err(PoolError::OutOfBlocks { needed, free }) => {
                        assert!(needed > free);
                        stats[2] += 1;
                    }
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            30..55 if !live.is_empty() => {
                let s = pick(&mut rng);
                let known = p.seqs[&s].tokens.len();
                let n = rng.random_range(p.num_computed(s).unwrap_or(0)..=known);
                p.mark_computed(s, n).expect("within known tokens");
            }
            55..75 if !live.is_empty() => {
                let s = pick(&mut rng);
                let new: Vec<u32> = (0..rng.random_range(1..4))
                    .map(|_| rng.random_range(0..3))
                    .collect();
                let before = p.usage();
                match p.append_tokens(s, &new) {
                    Ok(()) => {}
                    Err(PoolError::OutOfBlocks { .. }) => assert_eq!(p.usage(), before),
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            75..90 if !live.is_empty() => {
                let s = pick(&mut rng);
                let lease = leases.remove(&s).expect("live");
                if rng.random_bool(0.1) {
                    drop(lease); // leak path: reclaimed on the next mutating call
                    p.reclaim_leaked();
                } else {
                    p.free(lease).expect("free");
                }
            }
            90..98 => {
                let n = rng.random_range(0..5);
                let before = p.usage().cached_blocks;
                assert_eq!(p.evict(n), n.min(before));
                stats[3] += 1;
            }
            98..100 if rng.random_bool(0.1) => p.clear(),
            _ => {}
        }
        stats[4] += usize::from(!p.dups.is_empty());
        if let Err(e) = p.check_invariants() {
            panic!("seed {seed} step {step}: {e}");
        }
        for ev in p.drain_events() {
            assert_eq!(
                ev.event_id,
                EventId(next_event),
                "ids increase by exactly 1"
            );
            next_event += 1;
            replay.apply(&ev).expect("no gap");
        }
        let snap = p.snapshot();
        let mut seen = HashSet::new();
        for b in &snap {
            if let Some(parent) = b.parent {
                assert!(
                    seen.contains(&parent),
                    "seed {seed} step {step}: parent after child"
                );
            }
            seen.insert(b.seq_hash);
        }
        let replayed: HashSet<SnapshotBlock> = replay.blocks().values().copied().collect();
        assert_eq!(
            replayed,
            snap.into_iter().collect::<HashSet<_>>(),
            "seed {seed} step {step}"
        );
    }
    for (_, l) in leases.drain() {
        p.free(l).expect("free");
    }
    let u = p.usage();
    assert_eq!(u.used_blocks, 0);
    assert_eq!(u.free_blocks + u.cached_blocks, u.total_blocks);
    assert!(
        stats.iter().all(|&n| n > 0),
        "every path exercised: {stats:?}"
    );
}

#[test]
fn seeded_random_operations_keep_invariants() {
    for seed in [1, 2, 3, 0xDEAD_BEEF] {
        random_run(seed, 20_000);
    }
}

#[test]
fn token_events_give_each_stored_event_its_blocks_tokens() {
    let mut p = pool(16, 4).with_token_events();
    let a = toks(9, 100); // 2 full blocks
    let _la = fill(&mut p, 1, &a);
    // Shares the first block with `a`, then 2 new ones: the shared (deduplicated) block
    // splits nothing here since it is already registered and not re-announced.
    let mut b = a[..4].to_vec();
    b.extend(toks(9, 500));
    let _lb = fill(&mut p, 2, &b);
    let events = p.drain_events();
    let tokens: HashMap<EventId, Vec<u32>> = p.drain_event_tokens().into_iter().collect();
    let mut stored = 0;
    for ev in &events {
        if let KvEventData::Stored { blocks, .. } = &ev.data {
            stored += 1;
            let t = &tokens[&ev.event_id];
            assert_eq!(t.len(), blocks.len() * 4);
            for (blk, chunk) in blocks.iter().zip(t.chunks(4)) {
                assert_eq!(blk.block_hash, block_hash(chunk, SALT));
            }
        }
    }
    assert_eq!(stored, tokens.len());
    assert!(p.drain_event_tokens().is_empty());
    // Without the option nothing is kept.
    let mut q = pool(16, 4);
    let _l = fill(&mut q, 1, &a);
    assert!(!q.drain_events().is_empty());
    assert!(q.drain_event_tokens().is_empty());
}

#[test]
fn pin_cached_holds_the_cached_prefix_against_eviction_until_its_lease_is_freed() {
    let mut p = pool(8, 4);
    let shared = toks(10, 100); // two full blocks and a partial one
    let a = fill(&mut p, 1, &shared);
    p.free(a.lease).expect("free");
    let mut asked = shared[..8].to_vec();
    asked.extend(toks(4, 900));
    assert_eq!(p.cached_lead(&asked), 8);

    // A prompt with no cached block pins nothing and hands back no lease.
    let (none, lease) = p.pin_cached(SeqId(3), &toks(8, 5_000)).expect("pin");
    assert!(none.is_empty() && lease.is_none());

    let (table, lease) = p.pin_cached(SeqId(2), &asked).expect("pin");
    assert_eq!(
        table.len(),
        2,
        "only the two full leading blocks are cached"
    );
    let lease = lease.expect("a lease for the pinned prefix");
    assert!(matches!(
        p.pin_cached(SeqId(2), &asked),
        Err(PoolError::DuplicateSequence(SeqId(2)))
    ));
    p.check_invariants().expect("invariants while pinned");
    // The pinned blocks survive an eviction sweep; the unpinned partial block does not matter.
    p.evict(8);
    assert_eq!(p.cached_lead(&asked), 8, "pinned blocks are not evicted");
    assert_eq!(p.block_table(SeqId(2)), Some(&table[..]));

    p.free(lease).expect("free");
    p.check_invariants().expect("invariants after unpin");
    assert_eq!(
        p.cached_lead(&asked),
        8,
        "unpinned blocks stay cached until evicted"
    );
    assert!(p.evict(8) >= 2, "unpinned blocks are evictable again");
    assert_eq!(p.cached_lead(&asked), 0);
    p.check_invariants().expect("invariants after eviction");
}
