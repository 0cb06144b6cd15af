use std::collections::HashMap;

use serde::de::IntoDeserializer;
use serde::de::value::{Error as DeError, StrDeserializer};

use super::*;
use crate::kv::events::{KvEvent, KvEventData, StoredBlock, Tier};
use crate::kv::hash::block_hashes;
use crate::request_plane::router::load::RequestKey;
use crate::runtime::ids::{BlockHash, EventId, RequestId};

fn w(s: &str) -> WorkerId {
    WorkerId::new(s)
}

fn key(n: u64) -> RequestKey {
    RequestKey::new(crate::runtime::ids::NodeId::new("gw"), RequestId(n))
}

/// Sequence hashes of a prompt of `blocks` full blocks of 16 tokens, varying with `seed`.
fn prompt(blocks: usize, seed: u32) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = (0..blocks as u32 * 16).map(|t| t * 7 + seed).collect();
    block_hashes(&tokens, 16, 42)
        .into_iter()
        .map(|(_, s)| s)
        .collect()
}

/// An index where `worker` holds the first `n` blocks of `hashes` (one Stored event).
fn hold(index: &mut PrefixIndex, worker: &str, hashes: &[SequenceHash], n: usize) {
    let next = index.last_event_id(&w(worker)).map_or(1, |e| e.0 + 1);
    let blocks = hashes[..n]
        .iter()
        .map(|h| StoredBlock {
            seq_hash: *h,
            block_hash: crate::runtime::ids::BlockHash(h.0),
        })
        .collect();
    let ev = KvEvent {
        worker: w(worker),
        event_id: EventId(next),
        tier: Tier::Device,
        data: KvEventData::Stored {
            parent: None,
            blocks,
        },
    };
    assert_eq!(
        index.apply(&ev),
        crate::request_plane::router::index::ApplyOutcome::Applied
    );
}

/// A selector with peer pulls off, so the costs are the plain formulas of the module docs
/// (pull credit has its own tests).
fn selector(policy: Policy) -> Selector {
    Selector::new(SelectorConfig {
        policy,
        peer_pull: PeerPull {
            credit: 0.0,
            ..PeerPull::default()
        },
        ..SelectorConfig::default()
    })
    .unwrap()
}

#[test]
fn names_parse_display_and_deserialize() {
    for p in Policy::ALL {
        assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
        let de: StrDeserializer<'_, DeError> = p.as_str().into_deserializer();
        assert_eq!(Policy::deserialize(de).unwrap(), p);
    }
    assert_eq!(Policy::default(), Policy::Kv);
    assert_eq!(
        "least-loaded".parse::<Policy>(),
        Err(UnknownPolicy("least-loaded".into()))
    );
    assert!(
        UnknownPolicy("x".into())
            .to_string()
            .contains("kv, least_loaded, round_robin or random")
    );
}

#[test]
fn config_is_validated() {
    let bad = |f: fn(&mut SelectorConfig)| {
        let mut c = SelectorConfig::default();
        f(&mut c);
        Selector::new(c).unwrap_err()
    };
    assert_eq!(
        bad(|c| c.block_size = 0),
        SelectorConfigError::ZeroBlockSize
    );
    assert!(matches!(
        bad(|c| c.overlap_weight = -1.0),
        SelectorConfigError::OverlapWeight(_)
    ));
    assert!(matches!(
        bad(|c| c.decode_weight = f64::NAN),
        SelectorConfigError::OverlapWeight(_)
    ));
    assert!(matches!(
        bad(|c| c.balance_ratio = -0.5),
        SelectorConfigError::OverlapWeight(_)
    ));
    assert!(matches!(
        bad(|c| c.temperature = f64::NAN),
        SelectorConfigError::Temperature(_)
    ));
}

#[test]
fn empty_live_list_gives_none() {
    let index = PrefixIndex::new();
    let load = ActiveLoad::new();
    for p in Policy::ALL {
        assert_eq!(
            selector(p).select(&[], &prompt(4, 0), 64, &index, &load),
            None
        );
    }
}

#[test]
fn cost_formula_by_hand() {
    // B = 16, P = 100 tokens (7 blocks), overlap 4 blocks (64 tokens) → 36 uncached;
    // queued prefill 32 tokens, 10 decode blocks, weight 2:
    // prefill = (32 + 2 × 36) / 16 = 6.5, decode = 10 + 7 = 17, cost = 6.5 + 17 = 23.5.
    let config = SelectorConfig {
        overlap_weight: 2.0,
        decode_weight: 1.0,
        ..SelectorConfig::default()
    };
    let load = WorkerLoad {
        prefill_tokens: 32,
        decode_blocks: 10,
        unique_blocks: 8,
        in_flight: 3,
    };
    let c = kv_cost(&config, 100, 4, load);
    assert_eq!(c.uncached_tokens, 36);
    assert_eq!(c.prefill_blocks, 6.5);
    assert_eq!(c.decode_blocks, 17.0);
    assert_eq!(c.cost, 23.5);
    // The default decode weight, 1/8: 6.5 + 17 / 8 = 8.625.
    let c = kv_cost(
        &SelectorConfig {
            decode_weight: DEFAULT_DECODE_WEIGHT,
            ..config.clone()
        },
        100,
        4,
        load,
    );
    assert_eq!((c.decode_blocks, c.cost), (17.0, 8.625));
    // Dynamo's form, weight 2, 3 of the prompt's blocks held by requests in flight:
    // prefill = (32 + 36) / 16 = 4.25, decode = 8 unique + (7 − 3) new = 12,
    // cost = 2 × 4.25 + 12 = 20.5.
    let dynamo = SelectorConfig {
        dynamo_overlap_weight: 2.0,
        ..config.clone()
    };
    let c = cost_of(CostForm::Dynamo, &dynamo, 100, 4, 3, load);
    assert_eq!(
        (c.prefill_blocks, c.decode_blocks, c.cost),
        (4.25, 12.0, 20.5)
    );
    // An overlap beyond the prompt caps at the prompt.
    assert_eq!(kv_cost(&config, 100, 50, load).uncached_tokens, 0);
    assert_eq!(request_blocks(100, 16), 7);
    assert_eq!(request_blocks(96, 16), 6);
}

#[test]
fn decision_reports_the_formula_terms() {
    let hashes = prompt(6, 1);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &hashes, 4);
    let mut load = ActiveLoad::new();
    load.on_routed(key(1), &w("a"), 32, 10, 0);
    let mut s = Selector::new(SelectorConfig {
        overlap_weight: 2.0,
        decode_weight: 1.0,
        ..SelectorConfig::default()
    })
    .unwrap();
    // Only "a" is live: 100-token prompt, 4 blocks cached → the hand-computed 23.5.
    let d = s.select(&[w("a")], &hashes, 100, &index, &load).unwrap();
    assert_eq!(d.worker, w("a"));
    assert_eq!(d.policy, Policy::Kv);
    assert_eq!(
        (d.overlap_blocks, d.best_overlap_blocks, d.uncached_tokens),
        (4, 4, 36)
    );
    assert_eq!(d.request_blocks, 7);
    assert_eq!(
        (d.prefill_blocks, d.decode_blocks, d.cost),
        (6.5, 17.0, 23.5)
    );
    assert_eq!(d.candidates, 1);
}

#[test]
fn prefix_holder_wins_when_loads_are_equal() {
    let hashes = prompt(32, 2);
    let mut index = PrefixIndex::new();
    hold(&mut index, "b", &hashes, 20);
    hold(&mut index, "c", &hashes, 5);
    let load = ActiveLoad::new();
    let live = [w("a"), w("b"), w("c"), w("d")];
    let mut s = selector(Policy::Kv);
    for _ in 0..5 {
        let d = s.select(&live, &hashes, 32 * 16, &index, &load).unwrap();
        assert_eq!(d.worker, w("b"));
        assert_eq!(d.overlap_blocks, 20);
        assert_eq!(d.uncached_tokens, 12 * 16);
    }
}

#[test]
fn load_wins_when_the_holder_is_much_busier() {
    let hashes = prompt(32, 3);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &hashes, 32);
    let mut load = ActiveLoad::new();
    // a saves 4 × 32 prefill blocks but carries 2000 decode blocks more than b:
    // a = (2000 + 32) / 8 = 254, b = 4 × 32 + 32 / 8 = 132.
    load.on_routed(key(1), &w("a"), 0, 2000, 0);
    let mut s = selector(Policy::Kv);
    let d = s
        .select(&[w("a"), w("b")], &hashes, 32 * 16, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("b"));
    assert_eq!(
        d.best_overlap_blocks, 32,
        "the better prefix existed elsewhere"
    );
    // With a load gap below the prefill saving, the holder wins again.
    load.on_finished(&key(1));
    load.on_routed(key(2), &w("a"), 0, 20, 0);
    let d = s
        .select(&[w("a"), w("b")], &hashes, 32 * 16, &index, &load)
        .unwrap();
    assert_eq!(
        d.worker,
        w("a"),
        "cost a = (20 + 32) / 8, b = 4 × 32 + 32 / 8"
    );
    // A larger overlap weight makes the prefix worth more than the same load gap.
    let mut heavy = Selector::new(SelectorConfig {
        overlap_weight: 40.0,
        ..SelectorConfig::default()
    })
    .unwrap();
    load.on_finished(&key(2));
    load.on_routed(key(3), &w("a"), 0, 2000, 0);
    let d = heavy
        .select(&[w("a"), w("b")], &hashes, 32 * 16, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("a"), "a = 2032 / 8, b = 40 × 32 + 32 / 8");
}

#[test]
fn queued_prefill_counts_against_a_worker() {
    let hashes = prompt(8, 4);
    let index = PrefixIndex::new();
    let mut load = ActiveLoad::new();
    load.on_routed(key(1), &w("a"), 4096, 0, 0);
    let mut s = selector(Policy::Kv);
    let d = s
        .select(&[w("a"), w("b")], &hashes, 128, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("b"));
    load.on_first_token(&key(1), 1);
    let picks: Vec<_> = (0..2)
        .map(|_| s.select(&[w("a"), w("b")], &hashes, 128, &index, &load))
        .map(|d| d.unwrap().worker)
        .collect();
    assert_eq!(
        picks,
        [w("b"), w("a")],
        "prefill done: equal costs, the cursor takes turns"
    );
}

#[test]
fn ties_are_deterministic_whatever_the_live_order() {
    let index = PrefixIndex::new();
    let load = ActiveLoad::new();
    let hashes = prompt(4, 5);
    let orders = [
        [w("c"), w("a"), w("b")],
        [w("b"), w("c"), w("a")],
        [w("a"), w("b"), w("c")],
    ];
    for p in [Policy::Kv, Policy::LeastLoaded, Policy::RoundRobin] {
        let runs: Vec<Vec<WorkerId>> = orders
            .iter()
            .map(|live| {
                let mut s = selector(p);
                (0..6)
                    .map(|_| s.select(live, &hashes, 64, &index, &load).unwrap().worker)
                    .collect()
            })
            .collect();
        let want = [w("a"), w("b"), w("c"), w("a"), w("b"), w("c")];
        for run in &runs {
            assert_eq!(run, &want, "{p}");
        }
    }
}

#[test]
fn booking_decisions_spreads_cold_requests() {
    let index = PrefixIndex::new();
    let mut load = ActiveLoad::new();
    let live = [w("a"), w("b"), w("c"), w("d")];
    let mut s = selector(Policy::Kv);
    let mut count: HashMap<WorkerId, u32> = HashMap::new();
    for i in 0..40 {
        let hashes = prompt(8, 100 + i as u32);
        let d = s.select(&live, &hashes, 128, &index, &load).unwrap();
        load.on_routed(key(i), &d.worker, d.uncached_tokens, d.request_blocks, 0);
        *count.entry(d.worker).or_default() += 1;
    }
    assert!(count.values().all(|n| *n == 10), "{count:?}");
}

#[test]
fn temperature_sampling_is_reproducible_and_spreads() {
    let hashes = prompt(32, 6);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &hashes, 32);
    hold(&mut index, "b", &hashes, 16);
    let load = ActiveLoad::new();
    let live = [w("d"), w("c"), w("b"), w("a")];
    let config = SelectorConfig {
        temperature: 0.5,
        seed: 7,
        ..SelectorConfig::default()
    };
    let run = |live: &[WorkerId], seed: u64| -> Vec<WorkerId> {
        let mut s = Selector::new(SelectorConfig {
            seed,
            ..config.clone()
        })
        .unwrap();
        (0..400)
            .map(|_| s.select(live, &hashes, 512, &index, &load).unwrap().worker)
            .collect()
    };
    let first = run(&live, 7);
    assert_eq!(first, run(&live, 7), "same seed, same choices");
    let mut reversed = live.clone();
    reversed.reverse();
    assert_eq!(first, run(&reversed, 7), "independent of the live order");
    assert_ne!(first, run(&live, 8), "another seed, other choices");
    let mut count: HashMap<&WorkerId, u32> = HashMap::new();
    for x in &first {
        *count.entry(x).or_default() += 1;
    }
    // Costs: a = 32, b = 48, c = d = 64 → n = 0, 0.5, 1, 1 → weights 1, e^-1, e^-2, e^-2.
    assert_eq!(count.len(), 4, "every worker gets some: {count:?}");
    assert!(count[&w("a")] > count[&w("b")], "{count:?}");
    assert!(count[&w("b")] > count[&w("c")], "{count:?}");
    let p_a = f64::from(count[&w("a")]) / 400.0;
    let want = 1.0 / (1.0 + (-1.0f64).exp() + 2.0 * (-2.0f64).exp());
    assert!((p_a - want).abs() < 0.08, "p(a) = {p_a}, expected ≈ {want}");
}

#[test]
fn temperature_with_equal_costs_is_uniform() {
    let index = PrefixIndex::new();
    let load = ActiveLoad::new();
    let live = [w("a"), w("b")];
    let mut s = Selector::new(SelectorConfig {
        temperature: 1.0,
        seed: 3,
        ..SelectorConfig::default()
    })
    .unwrap();
    let a = (0..1000)
        .filter(|_| {
            s.select(&live, &prompt(2, 0), 32, &index, &load)
                .unwrap()
                .worker
                == w("a")
        })
        .count();
    assert!((400..600).contains(&a), "{a}");
}

#[test]
fn dead_workers_are_never_chosen() {
    let hashes = prompt(16, 7);
    let mut index = PrefixIndex::new();
    hold(&mut index, "dead", &hashes, 16);
    hold(&mut index, "b", &hashes, 2);
    let load = ActiveLoad::new();
    let live = [w("a"), w("b"), w("c")];
    for p in Policy::ALL {
        for temperature in [0.0, 0.3, 50.0] {
            let mut s = Selector::new(SelectorConfig {
                policy: p,
                temperature,
                seed: 11,
                ..SelectorConfig::default()
            })
            .unwrap();
            for _ in 0..200 {
                let d = s.select(&live, &hashes, 256, &index, &load).unwrap();
                assert_ne!(d.worker, w("dead"), "{p} T={temperature}");
                assert!(live.contains(&d.worker));
                assert!(d.best_overlap_blocks <= 2, "dead holders do not count");
            }
        }
    }
}

#[test]
fn least_loaded_prefers_fewest_in_flight_then_decode_blocks() {
    let hashes = prompt(8, 8);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &hashes, 8);
    let mut load = ActiveLoad::new();
    load.on_routed(key(1), &w("a"), 0, 1, 0);
    load.on_routed(key(2), &w("b"), 0, 50, 0);
    load.on_routed(key(3), &w("c"), 0, 10, 0);
    load.on_routed(key(4), &w("c"), 0, 10, 0);
    let live = [w("a"), w("b"), w("c")];
    let mut s = selector(Policy::LeastLoaded);
    let d = s.select(&live, &hashes, 128, &index, &load).unwrap();
    assert_eq!(d.worker, w("a"), "1 in flight with 1 block beats 1 with 50");
    assert_eq!(d.overlap_blocks, 8, "overlap is reported for any policy");
    load.on_routed(key(5), &w("a"), 0, 100, 0);
    let d = s.select(&live, &hashes, 128, &index, &load).unwrap();
    assert_eq!(d.worker, w("b"), "a now has 2 in flight");
    assert_eq!(d.overlap_blocks, 0);
}

#[test]
fn round_robin_cycles_through_sorted_live_workers() {
    let index = PrefixIndex::new();
    let mut load = ActiveLoad::new();
    load.on_routed(key(1), &w("b"), 999, 999, 0);
    let mut s = selector(Policy::RoundRobin);
    let live = [w("c"), w("b"), w("a"), w("b")];
    let picks: Vec<_> = (0..6)
        .map(|_| s.select(&live, &[], 10, &index, &load).unwrap().worker)
        .collect();
    assert_eq!(picks, [w("a"), w("b"), w("c"), w("a"), w("b"), w("c")]);
}

#[test]
fn random_is_seeded_uniform_over_live_workers() {
    let index = PrefixIndex::new();
    let load = ActiveLoad::new();
    let live: Vec<WorkerId> = (0..5).map(|i| w(&format!("w{i}"))).collect();
    let run = |seed: u64| -> Vec<WorkerId> {
        let mut s = Selector::new(SelectorConfig {
            policy: Policy::Random,
            seed,
            ..SelectorConfig::default()
        })
        .unwrap();
        (0..1000)
            .map(|_| s.select(&live, &[], 10, &index, &load).unwrap().worker)
            .collect()
    };
    let picks = run(1);
    assert_eq!(picks, run(1));
    assert_ne!(picks, run(2));
    let mut count: HashMap<WorkerId, u32> = HashMap::new();
    for p in picks {
        *count.entry(p).or_default() += 1;
    }
    assert_eq!(count.len(), 5);
    assert!(count.values().all(|n| (140..260).contains(n)), "{count:?}");
}

#[test]
fn device_only_selector_ignores_host_copies() {
    let hashes = prompt(8, 9);
    let mut index = PrefixIndex::new();
    let blocks = hashes
        .iter()
        .map(|h| StoredBlock {
            seq_hash: *h,
            block_hash: crate::runtime::ids::BlockHash(h.0),
        })
        .collect();
    index.apply(&KvEvent {
        worker: w("a"),
        event_id: EventId(1),
        tier: Tier::Host,
        data: KvEventData::Stored {
            parent: None,
            blocks,
        },
    });
    let load = ActiveLoad::new();
    let d = selector(Policy::Kv)
        .select(&[w("a")], &hashes, 128, &index, &load)
        .unwrap();
    assert_eq!(d.overlap_blocks, 8, "any tier by default");
    let d = selector(Policy::Kv)
        .with_tiers(TierSet::DEVICE)
        .select(&[w("a")], &hashes, 128, &index, &load)
        .unwrap();
    assert_eq!(d.overlap_blocks, 0);
}

#[test]
fn cached_slots_follow_worker_churn() {
    let hashes = prompt(8, 10);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &hashes, 8);
    let mut load = ActiveLoad::new();
    let mut s = selector(Policy::Kv);
    let live = [w("a"), w("b")];
    let d = s.select(&live, &hashes, 128, &index, &load).unwrap();
    assert_eq!((d.worker.clone(), d.overlap_blocks), (w("a"), 8));
    // a leaves the index, c takes its slot with the same prefix: same live list, new answer.
    index.remove_worker(&w("a"));
    hold(&mut index, "c", &hashes, 8);
    let d = s.select(&live, &hashes, 128, &index, &load).unwrap();
    assert_eq!(d.overlap_blocks, 0, "a's old slot now belongs to c");
    assert_eq!(d.best_overlap_blocks, 0);
    let d = s
        .select(&[w("b"), w("c")], &hashes, 128, &index, &load)
        .unwrap();
    assert_eq!((d.worker.clone(), d.overlap_blocks), (w("c"), 8));
    // Load: c gets very busy, is removed from the active load, and d reuses its slot.
    load.on_routed(key(1), &w("c"), 0, 10_000, 0);
    let d = s
        .select(&[w("b"), w("c")], &hashes, 128, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("b"));
    load.remove_worker(&w("c"));
    load.on_routed(key(2), &w("d"), 0, 10_000, 0);
    let d = s
        .select(&[w("b"), w("c")], &hashes, 128, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("c"), "c is idle again; d's load is not c's");
    // Another index with the same history does not reuse the cache by mistake.
    let mut other = PrefixIndex::new();
    hold(&mut other, "b", &hashes, 3);
    let d = s
        .select(&[w("b"), w("c")], &hashes, 128, &other, &load)
        .unwrap();
    assert_eq!(d.best_overlap_blocks, 3);
}

/// A 3 000-token prompt whose first 2 560 tokens (160 blocks) worker `a` holds, while `a` is
/// prefilling another 2 000-token prompt; `b` is idle.
fn busy_holder() -> (Vec<SequenceHash>, PrefixIndex, ActiveLoad) {
    let hashes = prompt(187, 11);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &hashes, 160);
    let mut load = ActiveLoad::new();
    load.on_routed_prefix(key(1), &w("a"), 2000, &prompt(125, 12), 125, 0);
    (hashes, index, load)
}

#[test]
fn a_holder_busy_with_a_long_prefill_still_wins_when_the_saving_is_larger() {
    let (hashes, index, load) = busy_holder();
    let live = [w("a"), w("b")];
    // kv, weight 4, decode weight 1/8: a = (2000 + 4 × 440) / 16 + (125 + 188) / 8 = 274.125;
    // b = 4 × 3000 / 16 + 188 / 8 = 773.5.
    let d = selector(Policy::Kv)
        .select(&live, &hashes, 3000, &index, &load)
        .unwrap();
    assert_eq!((d.worker.clone(), d.cost), (w("a"), 274.125));
    // Dynamo's form weighs the queue like the saving: a = (2000 + 440) / 16 + 125 + 188 =
    // 465.5 > b = 3000 / 16 + 188 = 375.5, so the 2 560 cached tokens are recomputed on b.
    let d = selector(Policy::DynamoKv)
        .select(&live, &hashes, 3000, &index, &load)
        .unwrap();
    assert_eq!((d.worker.clone(), d.cost), (w("b"), 375.5));
    // A queue longer than what the cache saves still sends the request elsewhere under kv.
    let mut load = load;
    load.on_routed(key(2), &w("a"), 10_000, 0, 0);
    let d = selector(Policy::Kv)
        .select(&live, &hashes, 3000, &index, &load)
        .unwrap();
    assert_eq!(d.worker, w("b"), "a = 899.125, b = 773.5");
}

#[test]
fn dynamo_kv_counts_blocks_held_by_requests_in_flight_once() {
    // a runs turn 1 of a conversation (40 blocks, still decoding; its blocks are cached on a
    // too). Turn 2 (48 blocks) costs a only its 8 new blocks of decode load under Dynamo's
    // form; under kv the earlier turn is decode work like any other request's.
    let turn2 = prompt(48, 13);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &turn2, 40);
    let mut load = ActiveLoad::new();
    load.on_routed_prefix(key(1), &w("a"), 0, &turn2[..40], 41, 0);
    load.on_routed(key(2), &w("b"), 0, 30, 0);
    let live = [w("a"), w("b")];
    let d = selector(Policy::DynamoKv)
        .select(&live, &turn2, 48 * 16, &index, &load)
        .unwrap();
    // a: 8 + (41 + 8) = 57; b: 48 + 30 + 48 = 126.
    assert_eq!(
        (d.worker.clone(), d.decode_blocks, d.cost),
        (w("a"), 49.0, 57.0)
    );
    let d = selector(Policy::Kv)
        .select(&live, &turn2, 48 * 16, &index, &load)
        .unwrap();
    // a: 4 × 8 + (41 + 48) / 8 = 43.125; b: 4 × 48 + (30 + 48) / 8 = 201.75.
    assert_eq!(
        (d.worker.clone(), d.decode_blocks, d.cost),
        (w("a"), 89.0, 43.125)
    );
}

/// Routes `n` requests that share a 63-block prefix held by `a` (each with 2 blocks of its
/// own, none finishing) and returns how many each worker got.
fn route_hot_prefix(policy: Policy, n: u64) -> HashMap<WorkerId, u64> {
    route_hot_prefix_with(selector(policy), n)
}

/// [`route_hot_prefix`] through the selector `s`.
fn route_hot_prefix_with(mut s: Selector, n: u64) -> HashMap<WorkerId, u64> {
    let prefix = prompt(63, 14);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &prefix, 63);
    let mut load = ActiveLoad::new();
    let live = [w("a"), w("b"), w("c"), w("d")];
    let mut got = HashMap::new();
    for i in 0..n {
        let mut hashes = prefix.clone();
        hashes.extend(prompt(2, 100 + i as u32));
        let d = s.select(&live, &hashes, 65 * 16, &index, &load).unwrap();
        load.on_routed_prefix(
            key(i),
            &d.worker,
            d.uncached_tokens,
            &hashes,
            d.request_blocks,
            0,
        );
        *got.entry(d.worker).or_insert(0) += 1;
    }
    got
}

#[test]
fn a_hot_prefix_still_spreads_under_kv() {
    // A hot prefix: 48 concurrent requests on one hot prefix, none done. At decode weight 1/8 the
    // holder stays cheapest (a = 10.1·n + 16 against 73.1·m + 268 elsewhere), so the
    // imbalance guard spreads them: the holder takes at most 1.5 × the mean + 4 in flight.
    let got = route_hot_prefix(Policy::Kv, 48);
    let max = *got.values().max().unwrap();
    assert!(max * 2 <= 48, "{got:?}");
    assert_eq!(
        got.get(&w("a")),
        Some(&max),
        "the holder takes the most: {got:?}"
    );
    assert_eq!(got.len(), 4, "{got:?}");
    // Without the guard the holder would keep almost all of them.
    let mut s = selector(Policy::Kv);
    s.config.balance_ratio = 0.0;
    let got = route_hot_prefix_with(s, 48);
    assert!(got[&w("a")] > 24, "{got:?}");
    // Dynamo's form counts the shared prefix once: the holder keeps the first 16 alone.
    let got = route_hot_prefix(Policy::DynamoKv, 16);
    assert_eq!(got.get(&w("a")), Some(&16), "{got:?}");
}

/// Tier credit: a worker holding the prefix in G2 loses to one holding it in G1 and beats one
/// holding nothing; with credit 1 the tiers weigh alike.
#[test]
fn tier_credit_prices_host_copies_below_device_ones() {
    let c: Vec<SequenceHash> = (1..=8).map(SequenceHash).collect();
    let stored = |w: &str, tier: Tier| KvEvent {
        worker: WorkerId::new(w),
        event_id: EventId(1),
        tier,
        data: KvEventData::Stored {
            parent: None,
            blocks: c
                .iter()
                .map(|&h| StoredBlock {
                    seq_hash: h,
                    block_hash: BlockHash(h.0),
                })
                .collect(),
        },
    };
    let mut index = PrefixIndex::new();
    index.apply(&stored("g1", Tier::Device));
    index.apply(&stored("g2", Tier::Host));
    let live = [
        WorkerId::new("g1"),
        WorkerId::new("g2"),
        WorkerId::new("none"),
    ];
    let load = ActiveLoad::new();
    let mut sel = selector(Policy::Kv);
    let costs: Vec<f64> = live
        .iter()
        .map(|w| {
            let one = [w.clone()];
            sel.select(&one, &c, 8 * 16 + 1, &index, &load)
                .expect("decision")
                .cost
        })
        .collect();
    assert!(costs[0] < costs[1] && costs[1] < costs[2], "{costs:?}");
    // Credit 0.75: the G2 holder's prefill term counts a quarter of the cached tokens.
    let (d, h) = (costs[0], costs[1]);
    let want = 4.0 * 0.25 * 128.0 / 16.0;
    assert!((h - d - want).abs() < 1e-9, "{h} - {d} != {want}");
    let mut flat = Selector::new(SelectorConfig {
        tier_credit: TierCredit {
            host: 1.0,
            disk: 1.0,
        },
        ..SelectorConfig::default()
    })
    .expect("config");
    let d1 = flat
        .select(&live[..1], &c, 129, &index, &load)
        .expect("d")
        .cost;
    let h1 = flat
        .select(&live[1..2], &c, 129, &index, &load)
        .expect("d")
        .cost;
    assert!((d1 - h1).abs() < 1e-9);
    assert!(
        SelectorConfig {
            tier_credit: TierCredit {
                host: 1.5,
                disk: 0.0
            },
            ..SelectorConfig::default()
        }
        .validate()
        .is_err()
    );
}

/// Peer pulls: off at credit 0 (no hint); with credit on (the default), a cold worker chosen over a busy
/// holder is told where the prefix lives, pullable blocks lower its cost, a worker short of
/// fewer than `min_blocks` gets no hint, and a credit outside [0, 1] is refused.
#[test]
fn a_cold_pick_is_told_which_peer_holds_the_prefix_when_pulls_are_on() {
    let hashes = prompt(32, 9);
    let mut index = PrefixIndex::new();
    hold(&mut index, "a", &hashes, 32);
    let mut load = ActiveLoad::new();
    load.on_routed(key(1), &w("a"), 0, 2000, 0);
    let live = [w("a"), w("b")];

    let on = |credit: f64| {
        Selector::new(SelectorConfig {
            peer_pull: PeerPull {
                credit,
                ..PeerPull::default()
            },
            ..SelectorConfig::default()
        })
    };
    let mut off = on(0.0).unwrap();
    let d = off.select(&live, &hashes, 32 * 16, &index, &load).unwrap();
    assert_eq!(d.worker, w("b"));
    assert_eq!(d.fetch, None, "credit 0: pulls off");
    assert_eq!(
        SelectorConfig::default().peer_pull.credit,
        PeerPull::DEFAULT_CREDIT,
        "on by default"
    );

    let mut s = on(0.5).unwrap();
    let d = s.select(&live, &hashes, 32 * 16, &index, &load).unwrap();
    assert_eq!(d.worker, w("b"));
    assert_eq!(
        d.fetch,
        Some(FetchHint {
            holder: w("a"),
            blocks: 32
        })
    );
    assert!(
        d.cost
            < off
                .select(&live, &hashes, 32 * 16, &index, &load)
                .unwrap()
                .cost,
        "pullable blocks are credited"
    );

    // b already holds 30 of the 32: 2 pullable blocks are under the floor of 4.
    hold(&mut index, "b", &hashes, 30);
    let d = s.select(&live, &hashes, 32 * 16, &index, &load).unwrap();
    assert_eq!(d.worker, w("b"));
    assert_eq!(d.fetch, None);

    // The holder itself is never told to pull from itself.
    load.on_finished(&key(1));
    load.on_routed(key(2), &w("b"), 0, 2000, 0);
    let d = s.select(&live, &hashes, 32 * 16, &index, &load).unwrap();
    assert_eq!(d.worker, w("a"));
    assert_eq!(d.fetch, None);

    assert!(matches!(on(1.5), Err(SelectorConfigError::PullCredit(_))));
    let zero_floor = Selector::new(SelectorConfig {
        peer_pull: PeerPull {
            credit: 0.5,
            min_blocks: 0,
        },
        ..SelectorConfig::default()
    });
    assert!(matches!(
        zero_floor,
        Err(SelectorConfigError::PullMinBlocks)
    ));
}

/// A kv selector whose sessions stick while a worker has at most `max` tokens queued.
fn sticky_selector(policy: Policy, max: u64) -> Selector {
    Selector::new(SelectorConfig {
        policy,
        session_max_queued_tokens: max,
        peer_pull: PeerPull {
            credit: 0.0,
            ..PeerPull::default()
        },
        ..SelectorConfig::default()
    })
    .unwrap()
}

#[test]
fn a_session_sticks_to_its_worker_over_a_cheaper_one() {
    // w0 holds the prompt and is idle; the session's worker w1 has 1 000 tokens queued and
    // holds nothing: the cost alone picks w0, the session keeps w1.
    let hashes = prompt(8, 1);
    let mut index = PrefixIndex::new();
    hold(&mut index, "w0", &hashes, 8);
    let mut load = ActiveLoad::new();
    load.on_routed(key(1), &w("w1"), 1000, 63, 0);
    let live = [w("w0"), w("w1")];
    for policy in [Policy::Kv, Policy::DynamoKv] {
        let mut s = sticky_selector(policy, 1000);
        let plain = s.select(&live, &hashes, 128, &index, &load).unwrap();
        assert_eq!(
            (plain.worker.as_str(), plain.affinity),
            ("w0", Affinity::None)
        );
        let d = s
            .select_session(Some(&w("w1")), &live, &hashes, 128, &index, &load)
            .unwrap();
        assert_eq!(
            (d.worker.as_str(), d.affinity),
            ("w1", Affinity::Kept),
            "{policy}"
        );
        // The terms are still the chosen worker's.
        assert_eq!(d.overlap_blocks, 0);
        assert_eq!(d.best_overlap_blocks, 8);
        assert_eq!(d.uncached_tokens, 128);
    }
}

#[test]
fn a_session_is_released_when_its_worker_saturates() {
    let hashes = prompt(4, 2);
    let index = PrefixIndex::new();
    let mut load = ActiveLoad::new();
    load.on_routed(key(1), &w("w1"), 1000, 63, 0);
    let live = [w("w0"), w("w1")];
    // Exactly at the threshold it still sticks; one token past, the cost decides.
    let mut s = sticky_selector(Policy::Kv, 1000);
    let d = s
        .select_session(Some(&w("w1")), &live, &hashes, 64, &index, &load)
        .unwrap();
    assert_eq!((d.worker.as_str(), d.affinity), ("w1", Affinity::Kept));
    let mut s = sticky_selector(Policy::Kv, 999);
    let d = s
        .select_session(Some(&w("w1")), &live, &hashes, 64, &index, &load)
        .unwrap();
    assert_eq!((d.worker.as_str(), d.affinity), ("w0", Affinity::Released));
    // The first token came: its queue is empty again, the session sticks.
    load.on_first_token(&key(1), 1);
    let d = s
        .select_session(Some(&w("w1")), &live, &hashes, 64, &index, &load)
        .unwrap();
    assert_eq!((d.worker.as_str(), d.affinity), ("w1", Affinity::Kept));
    // 0 turns stickiness off.
    let mut s = sticky_selector(Policy::Kv, 0);
    let d = s
        .select_session(Some(&w("w1")), &live, &hashes, 64, &index, &load)
        .unwrap();
    assert_eq!(d.affinity, Affinity::None);
}

#[test]
fn a_session_whose_worker_is_gone_or_avoided_is_placed_by_the_cost() {
    let hashes = prompt(4, 3);
    let index = PrefixIndex::new();
    let load = ActiveLoad::new();
    let mut s = sticky_selector(Policy::Kv, 1000);
    // Dead (not routable), or avoided (the router leaves avoided workers out of `live`).
    for live in [vec![w("w0"), w("w2")], vec![w("w2")]] {
        let d = s
            .select_session(Some(&w("w1")), &live, &hashes, 64, &index, &load)
            .unwrap();
        assert!(live.contains(&d.worker));
        assert_eq!(d.affinity, Affinity::Released);
    }
}

#[test]
fn policies_other_than_kv_ignore_sessions() {
    let hashes = prompt(4, 4);
    let index = PrefixIndex::new();
    let load = ActiveLoad::new();
    let live = [w("w0"), w("w1")];
    for policy in [Policy::RoundRobin, Policy::LeastLoaded, Policy::Random] {
        let mut s = sticky_selector(policy, 1000);
        let picks: std::collections::HashSet<WorkerId> = (0..8)
            .map(|_| {
                let d = s
                    .select_session(Some(&w("w1")), &live, &hashes, 64, &index, &load)
                    .unwrap();
                assert_eq!(d.affinity, Affinity::None, "{policy}");
                d.worker
            })
            .collect();
        if policy == Policy::RoundRobin {
            assert_eq!(picks.len(), 2, "round_robin still takes turns");
        }
    }
}

#[test]
fn the_session_table_is_bounded_lru_and_ttl() {
    use super::session::SessionTable;
    let mut t = SessionTable::new(3, 1000);
    for (i, s) in ["a", "b", "c"].iter().enumerate() {
        t.placed(s, &w(&format!("w{i}")), 0);
    }
    // "a" placed again: "b" is now the least recently placed, and goes first.
    t.placed("a", &w("w9"), 10);
    t.placed("d", &w("w3"), 10);
    assert_eq!(t.len(), 3);
    assert_eq!(t.worker_of("b", 10), None, "evicted: least recently placed");
    assert_eq!(
        t.worker_of("a", 10),
        Some(&w("w9")),
        "moved to its last worker"
    );
    assert_eq!(t.worker_of("c", 10), Some(&w("w2")));
    // Past the TTL an entry is not used, and the next expiry drops it.
    assert_eq!(t.worker_of("c", 1001), None);
    assert_eq!(t.worker_of("a", 1001), Some(&w("w9")));
    assert_eq!(t.expire(1001), 1, "c, last placed at 0");
    assert_eq!(t.len(), 2);
    // A table of capacity 0 remembers nothing.
    let mut none = SessionTable::new(0, 1000);
    none.placed("a", &w("w0"), 0);
    assert!(none.is_empty());
    // Many sessions: never more than the capacity.
    let mut t = SessionTable::new(100, u64::MAX);
    for i in 0..10_000u64 {
        t.placed(&format!("s{i}"), &w("w0"), i);
        assert!(t.len() <= 100);
    }
    assert_eq!(t.worker_of("s9999", 10_000), Some(&w("w0")));
    assert_eq!(t.worker_of("s9899", 10_000), None);
}
