//! Unit tests, preemption equivalence and a seeded random workload for the batch former.

use std::collections::{BTreeMap, HashMap};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::runtime::ids::SeqId;

const VOCAB: u64 = 50;

fn core(num_blocks: usize, block_size: usize, cfg: SchedulerConfig) -> SchedulerCore {
    let pool = BlockPool::new(num_blocks, block_size, 7).expect("pool");
    SchedulerCore::new(cfg, pool).expect("core")
}

fn cfg(
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    max_model_len: usize,
) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        max_decode_stall_ms: 0,
        resume_gather_ms: 0,
    }
}

fn req(seq: u64, prompt: Vec<u32>, max_tokens: usize) -> SeqRequest {
    SeqRequest {
        seq: SeqId(seq),
        prompt,
        max_tokens,
        ..SeqRequest::default()
    }
}

/// Deterministic fake model: the token generated at `pos` depends only on (seq, pos).
fn fake_token(seq: SeqId, pos: usize) -> u32 {
    let mut x = seq.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (pos as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    ((x ^ (x >> 29)) % VOCAB) as u32
}

fn sample_all(b: &ScheduledBatch) -> Vec<(SeqId, u32)> {
    b.entries
        .iter()
        .filter(|e| e.sample)
        .map(|e| (e.seq, fake_token(e.seq, e.start_pos + e.token_ids.len())))
        .collect()
}

/// Checks one batch against the config and the per-sequence expected positions.
fn check_batch(c: &SchedulerCore, b: &ScheduledBatch, next_pos: &mut HashMap<SeqId, usize>) {
    let cfg = *c.config();
    assert!(b.num_tokens() <= cfg.max_num_batched_tokens, "token budget");
    assert!(b.entries.len() <= cfg.max_num_seqs, "seq budget");
    assert!(c.num_running() <= cfg.max_num_seqs);
    let bs = c.pool().block_size();
    for p in &b.preempted {
        next_pos.remove(p);
    }
    for e in &b.entries {
        assert!(!e.token_ids.is_empty());
        let end = e.start_pos + e.token_ids.len();
        assert_eq!(
            e.block_table.len(),
            end.div_ceil(bs),
            "table covers positions"
        );
        let expect = match e.cached_tokens {
            Some(cached) => cached,
            None => next_pos.get(&e.seq).copied().expect("continuing sequence"),
        };
        assert_eq!(e.start_pos, expect, "contiguous positions for {}", e.seq);
        next_pos.insert(e.seq, end);
    }
}

/// Runs until idle; returns each sequence's generated tokens and finish reason.
fn drive(c: &mut SchedulerCore) -> (BTreeMap<SeqId, (Vec<u32>, FinishReason)>, usize) {
    drive_from(c, HashMap::new())
}

/// [`drive`], continuing from positions already tracked by [`check_batch`].
fn drive_from(
    c: &mut SchedulerCore,
    mut next_pos: HashMap<SeqId, usize>,
) -> (BTreeMap<SeqId, (Vec<u32>, FinishReason)>, usize) {
    let mut out: BTreeMap<SeqId, (Vec<u32>, Option<FinishReason>)> = BTreeMap::new();
    let mut preemptions = 0;
    let mut steps = 0;
    while c.has_unfinished() {
        steps += 1;
        assert!(steps < 100_000, "no progress");
        let b = c.schedule().expect("schedule");
        check_batch(c, &b, &mut next_pos);
        preemptions += b.preempted.len();
        for u in c.on_step_output(&sample_all(&b)).expect("output") {
            let slot = out.entry(u.seq).or_default();
            assert!(slot.1.is_none(), "token after finish");
            slot.0.push(u.token);
            slot.1 = u.finished;
        }
        c.pool().check_invariants().expect("pool invariants");
    }
    let out = out
        .into_iter()
        .map(|(s, (t, f))| (s, (t, f.expect("finished"))))
        .collect();
    (out, preemptions)
}

#[test]
fn config_and_add_validation() {
    assert!(matches!(
        SchedulerCore::new(cfg(0, 8, 16), BlockPool::new(4, 4, 0).expect("pool")),
        Err(SchedulerError::InvalidConfig(_))
    ));
    let mut c = core(4, 4, cfg(4, 8, 12));
    assert_eq!(
        c.add(req(1, vec![], 1)),
        Err(SchedulerError::EmptyPrompt(SeqId(1)))
    );
    assert_eq!(
        c.add(req(1, vec![1], 0)),
        Err(SchedulerError::ZeroMaxTokens(SeqId(1)))
    );
    assert!(matches!(
        c.add(req(1, vec![1; 12], 1)),
        Err(SchedulerError::PromptTooLong { .. })
    ));
    let mut small = core(2, 4, cfg(4, 8, 64));
    assert!(matches!(
        small.add(req(1, vec![1; 8], 1)),
        Err(SchedulerError::PromptNeverFits { .. })
    ));
    small.add(req(1, vec![1; 7], 1)).expect("fits");
    assert_eq!(
        small.add(req(1, vec![1], 1)),
        Err(SchedulerError::DuplicateSequence(SeqId(1)))
    );
}

#[test]
fn step_protocol_errors() {
    let mut c = core(16, 4, cfg(4, 64, 64));
    assert_eq!(c.on_step_output(&[]), Err(SchedulerError::NoStepInFlight));
    c.add(req(1, vec![1, 2, 3], 3)).expect("add");
    c.add(req(2, vec![4; 10], 3)).expect("add");
    let b = c.schedule().expect("schedule");
    assert_eq!(c.schedule(), Err(SchedulerError::StepInFlight));
    assert_eq!(
        c.on_step_output(&[]),
        Err(SchedulerError::MissingSample(SeqId(1)))
    );
    let dup = [(SeqId(1), 5), (SeqId(1), 5), (SeqId(2), 5)];
    assert_eq!(
        c.on_step_output(&dup),
        Err(SchedulerError::DuplicateSample(SeqId(1)))
    );
    let stray = [(SeqId(1), 5), (SeqId(2), 5), (SeqId(9), 5)];
    assert_eq!(
        c.on_step_output(&stray),
        Err(SchedulerError::UnexpectedSample(SeqId(9)))
    );
    assert!(c.step_in_flight(), "failed validation changes nothing");
    assert_eq!(c.on_step_output(&sample_all(&b)).expect("ok").len(), 2);
}

#[test]
fn budgets_and_fcfs_admission() {
    let mut c = core(64, 4, cfg(2, 6, 64));
    for s in 1..=4 {
        c.add(req(s, vec![s as u32; 3], 2)).expect("add");
    }
    let b = c.schedule().expect("schedule");
    let seqs: Vec<_> = b.entries.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, vec![SeqId(1), SeqId(2)], "FCFS, max_num_seqs = 2");
    assert_eq!(b.num_tokens(), 6);
    assert_eq!((c.num_running(), c.num_waiting()), (2, 2));
    assert_eq!(c.queued_prefill_tokens(), 6);
    c.on_step_output(&sample_all(&b)).expect("out");
    let b = c.schedule().expect("schedule");
    assert_eq!(
        b.entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![SeqId(1), SeqId(2)]
    );
    let done = c.on_step_output(&sample_all(&b)).expect("out");
    assert!(
        done.iter()
            .all(|u| u.finished == Some(FinishReason::Length))
    );
    let b = c.schedule().expect("schedule");
    assert_eq!(
        b.entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![SeqId(3), SeqId(4)]
    );
    c.on_step_output(&sample_all(&b)).expect("out");
    let b = c.schedule().expect("schedule");
    let done = c.on_step_output(&sample_all(&b)).expect("out");
    assert_eq!(done.iter().filter(|u| u.finished.is_some()).count(), 2);
    assert!(!c.has_unfinished());
}

#[test]
fn chunked_prefill_is_contiguous() {
    let mut c = core(64, 4, cfg(4, 4, 64));
    let prompt: Vec<u32> = (10..20).collect();
    c.add(req(1, prompt.clone(), 1)).expect("add");
    let mut got = Vec::new();
    loop {
        let b = c.schedule().expect("schedule");
        let e = &b.entries[0];
        got.push((
            e.start_pos,
            e.token_ids.clone(),
            e.sample,
            e.block_table.len(),
            e.cached_tokens,
        ));
        let done = c.on_step_output(&sample_all(&b)).expect("out");
        if !done.is_empty() {
            break;
        }
    }
    assert_eq!(
        got,
        vec![
            (0, prompt[0..4].to_vec(), false, 1, Some(0)),
            (4, prompt[4..8].to_vec(), false, 2, None),
            (8, prompt[8..10].to_vec(), true, 3, None),
        ]
    );
    assert_eq!(c.kv_usage().used_blocks, 0);
    assert_eq!(c.kv_usage().registered_blocks, 2, "both full blocks cached");
}

#[test]
fn decodes_come_first_then_prefill_fills_the_budget() {
    let mut c = core(64, 4, cfg(4, 4, 64));
    c.add(req(1, vec![1, 2], 10)).expect("add");
    let b = c.schedule().expect("schedule");
    c.on_step_output(&sample_all(&b)).expect("out");
    c.add(req(2, (0..9).collect(), 1)).expect("add");
    let b = c.schedule().expect("schedule");
    assert_eq!(b.entries[0].seq, SeqId(1));
    assert_eq!(b.entries[0].token_ids.len(), 1);
    assert!(b.entries[0].sample);
    assert_eq!(b.entries[1].seq, SeqId(2));
    assert_eq!(b.entries[1].token_ids.len(), 3, "chunked to fit the budget");
    assert!(!b.entries[1].sample);
    c.on_step_output(&sample_all(&b)).expect("out");
    let b = c.schedule().expect("schedule");
    assert_eq!(
        b.entries
            .iter()
            .map(|e| (e.seq, e.token_ids.len()))
            .collect::<Vec<_>>(),
        vec![(SeqId(1), 1), (SeqId(2), 3)]
    );
    c.on_step_output(&sample_all(&b)).expect("out");
}

#[test]
fn second_identical_prompt_reports_cached_tokens() {
    let mut c = core(64, 4, cfg(4, 64, 64));
    let prompt: Vec<u32> = (0..10).collect();
    c.add(req(1, prompt.clone(), 1)).expect("add");
    drive(&mut c);
    c.add(req(2, prompt, 1)).expect("add");
    let b = c.schedule().expect("schedule");
    assert_eq!(b.entries[0].cached_tokens, Some(8));
    assert_eq!(b.entries[0].start_pos, 8);
    assert_eq!(b.entries[0].token_ids, vec![8, 9]);
    c.on_step_output(&sample_all(&b)).expect("out");
}

/// An `uncached` (echo) sequence computes its whole prompt though its prefix is cached, each
/// entry knowing the token after it; the cache is left as it was: a later ordinary sequence
/// still hits it, and the pool's usage returns to what it was.
#[test]
fn an_uncached_sequence_computes_its_cached_prefix_and_leaves_the_cache_intact() {
    let mut c = core(64, 4, cfg(4, 6, 64));
    let prompt: Vec<u32> = (0..10).collect();
    c.add(req(1, prompt.clone(), 1)).expect("add");
    drive(&mut c);
    let used = c.kv_usage();
    c.add(SeqRequest {
        uncached: true,
        ..req(2, prompt.clone(), 1)
    })
    .expect("add");
    let b = c.schedule().expect("schedule");
    assert_eq!(
        b.entries[0].cached_tokens,
        Some(0),
        "nothing from the cache"
    );
    assert_eq!(b.entries[0].start_pos, 0);
    assert_eq!(b.entries[0].token_ids, (0..6).collect::<Vec<u32>>());
    assert_eq!(
        b.entries[0].next_token,
        Some(6),
        "the next chunk's first token"
    );
    c.on_step_output(&sample_all(&b)).expect("out");
    let b = c.schedule().expect("schedule");
    assert_eq!(b.entries[0].token_ids, (6..10).collect::<Vec<u32>>());
    assert_eq!(b.entries[0].next_token, None, "the last chunk samples");
    c.on_step_output(&sample_all(&b)).expect("out");
    assert!(!c.has_unfinished());
    assert_eq!(
        c.kv_usage(),
        used,
        "its duplicate blocks went back to the free list"
    );
    c.add(req(3, prompt, 1)).expect("add");
    let b = c.schedule().expect("schedule");
    assert_eq!(
        b.entries[0].cached_tokens,
        Some(8),
        "the cache still serves"
    );
    c.on_step_output(&sample_all(&b)).expect("out");
}

#[test]
fn stop_conditions() {
    let mut c = core(64, 4, cfg(8, 64, 64));
    let eos = fake_token(SeqId(1), 3);
    c.add(SeqRequest {
        eos_token_id: Some(eos),
        ..req(1, vec![1, 2, 3], 50)
    })
    .expect("add");
    let stop = fake_token(SeqId(2), 4);
    c.add(SeqRequest {
        stop_token_ids: vec![stop],
        ..req(2, vec![1, 2, 3, 4], 50)
    })
    .expect("add");
    c.add(req(3, vec![1, 2], 5)).expect("add");
    c.add(req(4, vec![1; 10], 100)).expect("add");
    let (out, _) = drive(&mut c);
    assert_eq!(out[&SeqId(1)], (vec![eos], FinishReason::Stop));
    assert_eq!(out[&SeqId(2)], (vec![stop], FinishReason::Stop));
    assert_eq!(out[&SeqId(3)].0.len(), 5);
    assert_eq!(out[&SeqId(3)].1, FinishReason::Length);
    assert_eq!(
        out[&SeqId(4)].0.len(),
        64 - 10,
        "stops at max_model_len total tokens"
    );
    assert_eq!(out[&SeqId(4)].1, FinishReason::ContextLimit);
    assert_eq!(c.kv_usage().used_blocks, 0);
}

#[test]
fn context_limit_is_capped_by_pool_capacity() {
    let mut c = core(4, 4, cfg(8, 64, 1000));
    c.add(req(1, vec![1; 5], 1000)).expect("add");
    let (out, _) = drive(&mut c);
    assert_eq!(
        out[&SeqId(1)],
        (out[&SeqId(1)].0.clone(), FinishReason::ContextLimit)
    );
    assert_eq!(out[&SeqId(1)].0.len(), 16 - 5);
}

#[test]
fn cancel_frees_everything() {
    let mut c = core(32, 4, cfg(8, 8, 64));
    for s in 1..=4 {
        c.add(req(s, vec![s as u32; 6], 20)).expect("add");
    }
    let b = c.schedule().expect("schedule"); // 1 whole + 2 partial; 3 and 4 wait
    assert!(c.cancel(SeqId(1)), "running, step in flight");
    assert!(c.cancel(SeqId(4)), "waiting");
    assert!(!c.cancel(SeqId(99)));
    let ups = c
        .on_step_output(&sample_all(&b))
        .expect("cancelled token ignored");
    assert!(ups.iter().all(|u| u.seq != SeqId(1)));
    let b = c.schedule().expect("schedule");
    c.on_step_output(&sample_all(&b)).expect("out");
    assert!(c.cancel(SeqId(2)));
    assert!(c.cancel(SeqId(3)));
    assert!(!c.has_unfinished());
    let u = c.kv_usage();
    assert_eq!((u.used_blocks, u.active_sequences), (0, 0));
    assert_eq!(u.free_blocks + u.cached_blocks, 32);
    c.pool().check_invariants().expect("invariants");
}

#[test]
fn preemption_recomputes_without_losing_tokens() {
    let workload: Vec<SeqRequest> = (1..=6)
        .map(|s| {
            req(
                s,
                (0..(3 + s as u32 * 2)).map(|t| t * 7 + s as u32).collect(),
                20,
            )
        })
        .collect();
    let run = |num_blocks: usize| {
        let mut c = core(num_blocks, 4, cfg(6, 16, 64));
        for r in &workload {
            c.add(r.clone()).expect("add");
        }
        drive(&mut c)
    };
    let (ample, p0) = run(256);
    let (tight, p1) = run(16);
    assert_eq!(p0, 0);
    assert!(p1 > 0, "the tight pool must preempt");
    assert_eq!(
        tight, ample,
        "identical outputs with and without preemption"
    );
}

#[test]
fn newest_running_sequence_is_preempted_first() {
    // 8 blocks of 2: four sequences of 3-token prompts take 2 blocks each.
    let mut c = core(8, 2, cfg(8, 64, 12));
    for s in 1..=4 {
        c.add(req(s, vec![s as u32 * 10, 1, 2], 10)).expect("add");
    }
    let mut pos = HashMap::new();
    let b = c.schedule().expect("schedule");
    check_batch(&c, &b, &mut pos);
    assert_eq!(b.entries.len(), 4);
    c.on_step_output(&sample_all(&b)).expect("out");
    // Decode: each needs a third block for its lookahead slot. Seq 1 preempts 4 (2 blocks
    // back), seq 2 takes the second, seq 3 is then the newest and preempts itself.
    let b = c.schedule().expect("schedule");
    check_batch(&c, &b, &mut pos);
    assert_eq!(b.preempted, vec![SeqId(4), SeqId(3)]);
    assert_eq!(
        b.entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![SeqId(1), SeqId(2)]
    );
    assert_eq!(c.num_waiting(), 2);
    assert_eq!(
        c.queued_prefill_tokens(),
        8,
        "prompt + generated token each"
    );
    c.on_step_output(&sample_all(&b)).expect("out");
    let (out, _) = drive_from(&mut c, pos);
    assert_eq!(out.len(), 4, "everyone finishes after recompute");
    assert_eq!(c.kv_usage().used_blocks, 0);
}

#[test]
fn seeded_random_workload() {
    for seed in [11u64, 12, 13] {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut c = core(24, 4, cfg(6, 24, 48));
        let mut next_pos = HashMap::new();
        let mut finished: HashMap<SeqId, usize> = HashMap::new();
        let mut cancelled = 0usize;
        let mut preempted = 0usize;
        let mut added = 0u64;
        let mut step = 0;
        while added < 300 || c.has_unfinished() {
            step += 1;
            assert!(step < 200_000, "seed {seed}: no progress");
            if added < 300 && rng.random_bool(0.5) {
                added += 1;
                let len = rng.random_range(1..30);
                let prompt = (0..len).map(|_| rng.random_range(0..4)).collect();
                let r = SeqRequest {
                    eos_token_id: Some(0),
                    ..req(added, prompt, rng.random_range(1..30))
                };
                c.add(r).expect("fits");
            }
            if rng.random_bool(0.05) {
                let victim = SeqId(rng.random_range(1..=added.max(1)));
                if c.cancel(victim) {
                    cancelled += 1;
                    assert!(!finished.contains_key(&victim));
                    *finished.entry(victim).or_default() += 1;
                }
            }
            let b = c.schedule().expect("schedule");
            check_batch(&c, &b, &mut next_pos);
            preempted += b.preempted.len();
            let mut sampled = sample_all(&b);
            if rng.random_bool(0.05) && !b.entries.is_empty() {
                let e = &b.entries[rng.random_range(0..b.entries.len())];
                if c.cancel(e.seq) {
                    cancelled += 1;
                    *finished.entry(e.seq).or_default() += 1;
                    sampled.retain(|s| s.0 != e.seq || rng.random_bool(0.5));
                }
            }
            for u in c.on_step_output(&sampled).expect("output") {
                if u.finished.is_some() {
                    *finished.entry(u.seq).or_default() += 1;
                }
            }
            c.pool()
                .check_invariants()
                .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
        }
        assert_eq!(
            finished.len() as u64,
            added,
            "seed {seed}: every request ends"
        );
        assert!(
            finished.values().all(|&n| n == 1),
            "seed {seed}: exactly once"
        );
        assert!(
            cancelled > 0 && preempted > 0,
            "seed {seed}: {cancelled} cancels, {preempted} preemptions"
        );
        let u = c.kv_usage();
        assert_eq!((u.used_blocks, u.active_sequences), (0, 0), "seed {seed}");
        assert_eq!(u.free_blocks + u.cached_blocks, u.total_blocks);
        assert_eq!(c.pool().leaked_leases(), 0);
    }
}

#[test]
fn waiting_sequences_are_admitted_longest_waiting_first() {
    // Room for one sequence at a time: admission order is the order of service.
    let mut c = core(64, 4, cfg(1, 64, 64));
    for (seq, waiting_since) in [(1, 30), (2, 10), (3, 20), (4, 10), (5, 0)] {
        c.add(SeqRequest {
            waiting_since,
            ..req(seq, vec![1, 2, 3], 2)
        })
        .expect("add");
    }
    let mut order = Vec::new();
    while c.has_unfinished() {
        let batch = c.schedule().expect("schedule");
        let sampled: Vec<(SeqId, u32)> = batch
            .entries
            .iter()
            .filter(|e| e.sample)
            .map(|e| (e.seq, fake_token(e.seq, e.start_pos + e.token_ids.len())))
            .collect();
        for e in &batch.entries {
            if !order.contains(&e.seq.0) {
                order.push(e.seq.0);
            }
        }
        c.on_step_output(&sampled).expect("output");
    }
    // Earliest arrival first; equal arrivals (2 and 4) in submission order.
    assert_eq!(order, vec![5, 2, 4, 3, 1]);
}

// ---------------------------------------------------------------------------------------------
// Stall-free batching
// ---------------------------------------------------------------------------------------------

/// 10 ms per step + 1 ms per token, no attention term.
const LINEAR: StepCost = StepCost {
    base_ms: 10.0,
    per_token_ms: 1.0,
    per_kpair_ms: 0.0,
};

fn stall_cfg(max_num_batched_tokens: usize, max_decode_stall_ms: u64) -> SchedulerConfig {
    SchedulerConfig {
        max_decode_stall_ms,
        ..cfg(8, max_num_batched_tokens, 1024)
    }
}

/// Runs one step of `c` with `cost`, checking it; returns it.
fn step_with(
    c: &mut SchedulerCore,
    cost: Option<&StepCost>,
    next_pos: &mut HashMap<SeqId, usize>,
) -> ScheduledBatch {
    let b = c.schedule_with(cost).expect("schedule");
    check_batch(c, &b, next_pos);
    c.on_step_output(&sample_all(&b)).expect("output");
    b
}

fn prefill_tokens(b: &ScheduledBatch, decoding: &[SeqId]) -> usize {
    b.entries
        .iter()
        .filter(|e| !decoding.contains(&e.seq))
        .map(|e| e.token_ids.len())
        .sum()
}

#[test]
fn with_decodes_running_prefill_chunks_respect_the_stall_limit() {
    let mut c = core(128, 4, stall_cfg(512, 50));
    let mut pos = HashMap::new();
    c.add(req(1, vec![1, 2, 3], 100)).expect("add");
    c.add(req(2, vec![4, 5, 6], 100)).expect("add");
    step_with(&mut c, Some(&LINEAR), &mut pos); // both prefilled, no decode yet
    c.add(req(3, (0..200).collect(), 2)).expect("add");
    let mut chunks = Vec::new();
    loop {
        let b = step_with(&mut c, Some(&LINEAR), &mut pos);
        assert_eq!(
            b.entries[..2]
                .iter()
                .map(|e| e.token_ids.len())
                .sum::<usize>(),
            2
        );
        let shape = StepShape::of(b.entries.iter().map(|e| (e.start_pos, e.token_ids.len())));
        assert!(LINEAR.predict_ms(shape) <= 50.0, "{shape:?}");
        let Some(e) = b.entries.iter().find(|e| e.seq == SeqId(3)) else {
            break; // decoding: its prefill is done
        };
        if e.sample {
            assert_eq!(b.stall_capped, None, "the last chunk fits whole");
            break;
        }
        // 10 + 2 decode rows + x ≤ 50.
        assert_eq!(e.token_ids.len(), 38);
        assert_eq!(b.stall_capped, Some(38));
        chunks.push(e.token_ids.len());
    }
    assert_eq!(
        chunks,
        vec![38; 5],
        "five capped chunks, then the last 10 tokens"
    );
    let (out, _) = drive_from(&mut c, pos);
    // Its first token came with the last chunk; the second comes here.
    assert_eq!(out[&SeqId(3)].0.len(), 1, "and the newcomer decodes");
    assert_eq!(out[&SeqId(3)].1, FinishReason::Length);
}

#[test]
fn without_decodes_or_without_a_model_the_token_budget_alone_applies() {
    // No decode running: a lone prompt gets the whole budget whatever the model says.
    let mut c = core(128, 4, stall_cfg(128, 50));
    c.add(req(1, (0..300).collect(), 1)).expect("add");
    let b = c.schedule_with(Some(&LINEAR)).expect("schedule");
    assert_eq!(b.num_tokens(), 128);
    assert_eq!(b.stall_capped, None);
    c.on_step_output(&sample_all(&b)).expect("output");
    // A decode running, but no model yet, or the limit off: the budget alone.
    for (stall, cost) in [(50, None), (0, Some(&LINEAR))] {
        let mut c = core(128, 4, stall_cfg(128, stall));
        let mut pos = HashMap::new();
        c.add(req(1, vec![1, 2, 3], 100)).expect("add");
        step_with(&mut c, cost, &mut pos);
        c.add(req(2, (0..300).collect(), 1)).expect("add");
        let b = step_with(&mut c, cost, &mut pos);
        assert_eq!(prefill_tokens(&b, &[SeqId(1)]), 127, "stall {stall}");
        assert_eq!(b.stall_capped, None);
    }
}

#[test]
fn a_resumed_stream_recomputes_in_one_step_beside_decodes() {
    // A decode-only step is already predicted above the limit: a newcomer gets one block
    // (4 tokens) per step, a migrated stream (resumed) its whole recompute in one step.
    let slow = StepCost {
        base_ms: 100.0,
        ..LINEAR
    };
    for (resumed, chunks) in [(false, vec![4, 4, 4, 4, 4]), (true, vec![20])] {
        let mut c = core(128, 4, stall_cfg(512, 50));
        let mut pos = HashMap::new();
        c.add(req(1, vec![1, 2, 3], 100)).expect("add");
        step_with(&mut c, Some(&slow), &mut pos);
        c.add(SeqRequest {
            resumed,
            ..req(2, (0..20).collect(), 4)
        })
        .expect("add");
        let mut got = Vec::new();
        loop {
            let b = step_with(&mut c, Some(&slow), &mut pos);
            assert_eq!(b.entries[0].token_ids.len(), 1, "the decode row runs");
            let e = b.entries.iter().find(|e| e.seq == SeqId(2)).expect("seq 2");
            got.push(e.token_ids.len());
            if e.sample {
                break;
            }
        }
        assert_eq!(got, chunks, "resumed {resumed}");
    }
}

#[test]
fn a_model_that_allows_nothing_still_lets_one_block_through() {
    // Even a decode-only step is predicted above the limit: one block (4 tokens) per step.
    let slow = StepCost {
        base_ms: 100.0,
        ..LINEAR
    };
    let mut c = core(128, 4, stall_cfg(512, 50));
    let mut pos = HashMap::new();
    c.add(req(1, vec![1, 2, 3], 100)).expect("add");
    step_with(&mut c, Some(&slow), &mut pos);
    c.add(req(2, (0..10).collect(), 1)).expect("add");
    c.add(req(3, (20..30).collect(), 1)).expect("add");
    let mut prefills = Vec::new();
    for _ in 0..6 {
        let b = step_with(&mut c, Some(&slow), &mut pos);
        prefills.push(prefill_tokens(&b, &[SeqId(1)]));
    }
    // Four tokens per step: seq 2 in 4, 4, 2, topped up by seq 3's admission with 2, then
    // seq 3's 4 and 4; then only the decode is left.
    assert_eq!(prefills, vec![4, 4, 4, 4, 4, 0]);
    assert_eq!(
        (c.num_running(), c.num_waiting()),
        (1, 0),
        "both prefilled and done"
    );
}

#[test]
fn the_stall_limit_changes_no_token() {
    // Same workload, with and without the limit: every sequence generates the same tokens
    // (the fake model depends only on sequence and position), and the limit holds.
    let run = |stall: u64| {
        let mut c = core(64, 4, stall_cfg(48, stall));
        let mut rng = StdRng::seed_from_u64(5);
        let mut pos = HashMap::new();
        let mut out: BTreeMap<SeqId, Vec<u32>> = BTreeMap::new();
        let mut added = 0;
        let mut capped = 0;
        while added < 40 || c.has_unfinished() {
            if added < 40 && rng.random_bool(0.3) {
                added += 1;
                let len = rng.random_range(1..60);
                let prompt = (0..len)
                    .map(|_| rng.random_range(0..VOCAB as u32))
                    .collect();
                c.add(req(added, prompt, rng.random_range(1..20)))
                    .expect("add");
            }
            let b = c.schedule_with(Some(&LINEAR)).expect("schedule");
            check_batch(&c, &b, &mut pos);
            capped += usize::from(b.stall_capped.is_some());
            for u in c.on_step_output(&sample_all(&b)).expect("output") {
                out.entry(u.seq).or_default().push(u.token);
            }
            c.pool().check_invariants().expect("invariants");
        }
        (out, capped)
    };
    let (off, none) = run(0);
    let (on, capped) = run(30);
    assert_eq!(none, 0);
    assert!(capped > 0, "the limit was exercised");
    assert_eq!(off, on);
    assert_eq!(on.len(), 40);
}

// ---------------------------------------------------------------------------------------------
// Disaggregation: hand-off (prefill side) and remote KV pulls (decode side)
// ---------------------------------------------------------------------------------------------

/// Runs steps until the batch is empty, sampling every sampled position.
fn run_until_idle(c: &mut SchedulerCore) -> Vec<SeqUpdate> {
    let mut all = Vec::new();
    for _ in 0..1000 {
        if !c.has_unfinished() {
            break;
        }
        let b = c.schedule().unwrap();
        if b.entries.is_empty() {
            c.on_step_output(&[]).unwrap();
            break;
        }
        all.extend(c.on_step_output(&sample_all(&b)).unwrap());
    }
    all
}

#[test]
fn a_hand_off_sequence_leaves_after_its_first_token_and_its_blocks_stay_pinned() {
    let mut c = core(16, 4, cfg(8, 64, 64));
    let prompt: Vec<u32> = (0..10).collect();
    c.add(SeqRequest {
        hand_off: true,
        ..req(1, prompt, 20)
    })
    .unwrap();
    let ups = run_until_idle(&mut c);
    assert_eq!(ups.len(), 1, "exactly one token: the first");
    let h = ups[0].handed_off.clone().expect("handed off");
    assert_eq!(ups[0].finished, None);
    assert_eq!(h.tokens, 10);
    assert_eq!(h.blocks.len(), 3, "ceil(10 / 4) blocks hold the prompt");
    assert!(!c.has_unfinished());
    assert_eq!(c.num_held(), 1);
    assert!(c.kv_usage().used_blocks >= 3, "held blocks stay pinned");
    // The two full blocks are registered: a later prompt with that prefix hits them.
    assert_eq!(c.pool().match_prefix(&(0..10).collect::<Vec<u32>>()), 8);
    assert!(c.cancel(SeqId(1)), "release the hold");
    assert_eq!(c.num_held(), 0);
    assert_eq!(c.kv_usage().used_blocks, 0);
    assert!(!c.cancel(SeqId(1)), "released once");
}

#[test]
fn a_hand_off_whose_first_token_ends_it_is_not_held() {
    let mut c = core(16, 4, cfg(8, 64, 64));
    c.add(SeqRequest {
        hand_off: true,
        ..req(1, (0..6).collect(), 1)
    })
    .unwrap();
    let ups = run_until_idle(&mut c);
    assert_eq!(ups[0].finished, Some(FinishReason::Length));
    assert!(ups[0].handed_off.is_none());
    assert_eq!(c.num_held(), 0);
    assert_eq!(c.kv_usage().used_blocks, 0);
}

#[test]
fn remote_kv_is_pulled_for_the_blocks_not_cached_and_then_decoded() {
    let mut c = core(32, 4, cfg(8, 64, 128));
    // Cache the first 8 tokens here (two full blocks).
    c.add(req(9, (0..9).collect(), 1)).unwrap();
    run_until_idle(&mut c);
    // Prompt 0..14 computed remotely, plus its first sampled token 99.
    let mut prompt: Vec<u32> = (0..14).collect();
    prompt.push(99);
    c.add(SeqRequest {
        remote_tokens: 14,
        ..req(1, prompt, 3)
    })
    .unwrap();
    let b = c.schedule().unwrap();
    assert!(b.entries.is_empty(), "no step runs a pulling sequence");
    assert_eq!(b.pulls.len(), 1);
    let order = &b.pulls[0];
    assert_eq!(order.cached_tokens, 8);
    assert_eq!(order.tokens, 14);
    let idx: Vec<usize> = order.blocks.iter().map(|(i, _)| *i).collect();
    assert_eq!(idx, vec![2, 3], "blocks 2 (8..12) and 3 (12..14) only");
    c.on_step_output(&[]).unwrap();
    // Still pulling: nothing is scheduled.
    assert!(c.schedule().unwrap().entries.is_empty());
    c.on_step_output(&[]).unwrap();
    assert_eq!(c.num_pulling(), 1);
    assert!(c.pull_done(SeqId(1), true).unwrap());
    assert_eq!(c.num_pulling(), 0);
    let b = c.schedule().unwrap();
    assert_eq!(b.entries.len(), 1);
    let e = &b.entries[0];
    assert_eq!(
        e.start_pos, 14,
        "decoding starts at the first sampled token"
    );
    assert_eq!(e.token_ids, vec![99]);
    assert!(e.sample);
    c.on_step_output(&sample_all(&b)).unwrap();
    let ups = run_until_idle(&mut c);
    assert_eq!(
        ups.len(),
        2,
        "max_tokens counts the tokens generated here: 1 + 2"
    );
    assert_eq!(c.kv_usage().used_blocks, 0);
    // The pulled prompt's full blocks are registered here now.
    assert_eq!(c.pool().match_prefix(&(0..14).collect::<Vec<u32>>()), 12);
}

#[test]
fn a_failed_pull_recomputes_the_prompt_here() {
    let mut c = core(32, 4, cfg(8, 64, 128));
    let mut prompt: Vec<u32> = (0..10).collect();
    prompt.push(7);
    c.add(SeqRequest {
        remote_tokens: 10,
        ..req(1, prompt, 2)
    })
    .unwrap();
    let b = c.schedule().unwrap();
    assert_eq!(b.pulls.len(), 1);
    c.on_step_output(&[]).unwrap();
    c.pull_done(SeqId(1), false).unwrap();
    let b = c.schedule().unwrap();
    assert_eq!(b.entries[0].start_pos, 0, "prefill from the start");
    assert_eq!(b.entries[0].token_ids.len(), 11);
    c.on_step_output(&sample_all(&b)).unwrap();
    run_until_idle(&mut c);
    assert_eq!(c.kv_usage().used_blocks, 0);
}

#[test]
fn a_sequence_cancelled_while_pulling_keeps_its_blocks_until_the_pull_returns() {
    let mut c = core(8, 4, cfg(8, 64, 64));
    let mut prompt: Vec<u32> = (0..12).collect();
    prompt.push(1);
    c.add(SeqRequest {
        remote_tokens: 12,
        ..req(1, prompt, 4)
    })
    .unwrap();
    let b = c.schedule().unwrap();
    assert_eq!(b.pulls.len(), 1);
    c.on_step_output(&[]).unwrap();
    let used = c.kv_usage().used_blocks;
    assert!(used >= 3);
    assert!(c.cancel(SeqId(1)));
    assert!(!c.has_unfinished());
    assert_eq!(
        c.kv_usage().used_blocks,
        used,
        "the pull still writes into them"
    );
    assert_eq!(c.num_pulling(), 1);
    assert!(c.pull_done(SeqId(1), true).unwrap());
    assert_eq!(c.kv_usage().used_blocks, 0, "freed when the pull returned");
    assert_eq!(c.num_pulling(), 0);
}

#[test]
fn a_pulling_sequence_is_never_preempted() {
    // 6 blocks of 4 tokens. A pulls (3 blocks); B decodes and outgrows the rest.
    let mut c = core(6, 4, cfg(8, 64, 64));
    let mut prompt: Vec<u32> = (0..10).collect();
    prompt.push(1);
    c.add(SeqRequest {
        waiting_since: 1,
        remote_tokens: 10,
        ..req(1, prompt, 4)
    })
    .unwrap();
    c.add(SeqRequest {
        waiting_since: 2,
        ..req(2, (20..26).collect(), 40)
    })
    .unwrap();
    let b = c.schedule().unwrap();
    assert_eq!(b.pulls.len(), 1);
    c.on_step_output(&sample_all(&b)).unwrap();
    for _ in 0..20 {
        let b = c.schedule().unwrap();
        assert!(
            !b.preempted.contains(&SeqId(1)),
            "the pulling sequence stays"
        );
        if b.entries.is_empty() {
            c.on_step_output(&[]).unwrap();
            break;
        }
        c.on_step_output(&sample_all(&b)).unwrap();
    }
    assert_eq!(c.num_pulling(), 1);
    assert!(c.pull_done(SeqId(1), true).unwrap());
}

#[test]
fn remote_tokens_must_end_inside_the_prompt() {
    let mut c = core(8, 4, cfg(8, 64, 64));
    let err = c
        .add(SeqRequest {
            remote_tokens: 5,
            ..req(1, (0..5).collect(), 4)
        })
        .unwrap_err();
    assert!(matches!(err, SchedulerError::RemoteBeyondPrompt { .. }));
}

/// A pool with a host tier: its copies carried out at once (all landed).
fn run_copies(c: &mut SchedulerCore) -> usize {
    let copies = c.pool_mut().drain_copies();
    let n = copies.len();
    let done: Vec<_> = copies
        .iter()
        .map(|k| (k.id, crate::kv::CopyOutcome::Done))
        .collect();
    c.copies_done(&done).expect("copies");
    n
}

#[test]
fn a_prefix_onboarded_from_host_runs_after_its_copies_and_reports_them_cached() {
    let pool = BlockPool::new(8, 4, 7)
        .expect("pool")
        .with_tiers(crate::kv::TierConfig {
            host_blocks: 16,
            ..Default::default()
        })
        .expect("tiers");
    let mut c = SchedulerCore::new(cfg(4, 64, 64), pool).expect("core");
    let prompt: Vec<u32> = (0..13).collect();
    c.add(req(1, prompt.clone(), 1)).expect("add");
    drive(&mut c);
    assert_eq!(run_copies(&mut c), 3, "three blocks offloaded");
    assert_eq!(c.pool_mut().evict(8), 3);
    // Same prompt: admitted, but not scheduled until its onboard returns.
    c.add(req(2, prompt.clone(), 1)).expect("add");
    let b = c.schedule().expect("schedule");
    assert!(b.entries.is_empty());
    c.on_step_output(&[]).expect("out");
    assert_eq!(c.num_pulling(), 1);
    assert_eq!(run_copies(&mut c), 3, "three blocks onboarded");
    let b = c.schedule().expect("schedule");
    assert_eq!(b.entries[0].cached_tokens, Some(12));
    assert_eq!(b.entries[0].token_ids, vec![12]);
    c.on_step_output(&sample_all(&b)).expect("out");
    // Cancelled while onboarding: its blocks are freed when the copies return.
    c.pool_mut().evict(8);
    c.add(req(3, prompt, 1)).expect("add");
    let b = c.schedule().expect("schedule");
    c.on_step_output(&sample_all(&b)).expect("out");
    assert!(c.cancel(SeqId(3)));
    assert!(
        c.kv_usage().used_blocks > 0,
        "written by the copies in flight"
    );
    run_copies(&mut c);
    assert_eq!(c.kv_usage().used_blocks, 0);
    assert!(!c.has_unfinished());
}
