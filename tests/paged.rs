//! Paged / batched consistency: chunked prefill, mixed batches and shared prefixes give the
//! same logits as running each sequence alone in one shot; seeded sampling is reproducible;
//! malformed batches give typed errors.

#[path = "common/model.rs"]
mod model;

use crate::model::{blocks, engine, golden, max_abs_diff, model, seq};
use flotilla::runtime::ids::BlockId;
use flotilla::worker::engine::{EngineError, SamplingParams, StepBatch};

fn long_prompt() -> Vec<u32> {
    golden()
        .into_iter()
        .find(|c| c.name == "long_prompt")
        .expect("long case")
        .prompt_ids
}

#[test]
fn chunked_prefill_matches_one_shot() {
    let m = model();
    let p = long_prompt();
    let table = blocks(0..(p.len() / 16 + 1) as u32);
    let mut e = engine(m, 64);
    let one = e
        .logits(&StepBatch {
            seqs: vec![seq(1, &p, 0, &table, true)],
        })
        .expect("one shot");
    for chunk in [1usize, 7, 16, 64] {
        // A different block order per run checks the indirection, not just contiguity.
        let mut t = table.clone();
        t.reverse();
        let mut last = Vec::new();
        for (i, c) in p.chunks(chunk).enumerate() {
            let b = StepBatch {
                seqs: vec![seq(2, c, i * chunk, &t, true)],
            };
            last = e.logits(&b).expect("chunk").remove(0);
        }
        let d = max_abs_diff(&last, &one[0]);
        assert!(d < 1e-3, "chunk {chunk}: max diff {d}");
    }
}

#[test]
fn mixed_batch_matches_solo_runs() {
    let m = model();
    let p = long_prompt();
    let mut e = engine(m, 160);
    // 8 sequences: different prompts (slices of the long prompt) and different positions.
    let specs: Vec<(usize, usize)> = (0..8).map(|i| (3 + 11 * i, 5 + 30 * i)).collect(); // (offset, len)
    let tables: Vec<Vec<BlockId>> = (0..8).map(|i| blocks(i * 20..i * 20 + 20)).collect();
    let mut solo = Vec::new();
    for (i, &(off, len)) in specs.iter().enumerate() {
        let toks = &p[off..off + len];
        let b = StepBatch {
            seqs: vec![seq(i as u64, toks, 0, &tables[i], true)],
        };
        solo.push(e.logits(&b).expect("solo").remove(0));
    }
    // Now: prefill all but the last token of each (some in chunks), then one mixed batch where
    // each runs its remaining tokens (decode tokens and prefill chunks together).
    let mut pre = Vec::new();
    for (i, &(off, len)) in specs.iter().enumerate() {
        let keep = if i % 2 == 0 { len - 1 } else { len / 2 };
        pre.push(seq(i as u64, &p[off..off + keep], 0, &tables[i], false));
    }
    e.logits(&StepBatch { seqs: pre }).expect("prefix batch");
    let mut rest = Vec::new();
    for (i, &(off, len)) in specs.iter().enumerate() {
        let keep = if i % 2 == 0 { len - 1 } else { len / 2 };
        rest.push(seq(
            i as u64,
            &p[off + keep..off + len],
            keep,
            &tables[i],
            true,
        ));
    }
    let batched = e.logits(&StepBatch { seqs: rest }).expect("mixed batch");
    for i in 0..8 {
        let d = max_abs_diff(&batched[i], &solo[i]);
        assert!(d < 1e-3, "seq {i}: max diff {d}");
    }
}

#[test]
fn shared_prefix_blocks_match_solo() {
    let m = model();
    let p = long_prompt();
    let prefix = &p[..48]; // 3 full blocks
    let (a, b) = (&p[48..60], &p[100..117]);
    let mut e = engine(m, 64);
    let solo = |e: &mut flotilla::worker::engine::Engine, tail: &[u32], base: u32| {
        let full: Vec<u32> = prefix.iter().chain(tail).copied().collect();
        let t = blocks(base..base + 5);
        e.logits(&StepBatch {
            seqs: vec![seq(9, &full, 0, &t, true)],
        })
        .expect("solo")
        .remove(0)
    };
    let sa = solo(&mut e, a, 20);
    let sb = solo(&mut e, b, 30);
    // Shared prefix in blocks 0..3, then each continuation in its own blocks.
    e.logits(&StepBatch {
        seqs: vec![seq(1, prefix, 0, &blocks(0..3), false)],
    })
    .expect("prefix");
    let ta = [blocks(0..3), vec![BlockId(3), BlockId(4)]].concat();
    let tb = [blocks(0..3), vec![BlockId(5), BlockId(6)]].concat();
    let out = e
        .logits(&StepBatch {
            seqs: vec![seq(1, a, 48, &ta, true), seq(2, b, 48, &tb, true)],
        })
        .expect("continuations");
    assert!(max_abs_diff(&out[0], &sa) < 1e-3);
    assert!(max_abs_diff(&out[1], &sb) < 1e-3);
}

#[test]
fn seeded_sampling_is_reproducible_and_per_sequence() {
    let m = model();
    let p = &golden()[0].prompt_ids;
    let run = |seed: u64, with_neighbour: bool| -> Vec<u32> {
        let mut e = engine(m, 16);
        let mut s = seq(1, p, 0, &blocks(0..4), true);
        s.sampling = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(seed),
            ..Default::default()
        };
        let mut out = Vec::new();
        let mut pos = 0;
        for _ in 0..8 {
            let mut seqs = vec![s.clone()];
            if with_neighbour {
                let mut n = seq(2, &p[..3], 0, &blocks(8..9), true);
                n.sampling = SamplingParams {
                    temperature: 1.0,
                    seed: Some(99),
                    ..Default::default()
                };
                seqs.insert(0, n);
            }
            let o = e.step(&StepBatch { seqs }).expect("step");
            let t = o
                .tokens
                .iter()
                .find(|t| t.seq_id.0 == 1)
                .expect("token")
                .token;
            out.push(t);
            pos += s.tokens.len();
            s.tokens = vec![t];
            s.start_pos = pos;
        }
        out
    };
    let a = run(42, false);
    assert_eq!(a, run(42, false));
    assert_eq!(
        a,
        run(42, true),
        "a neighbour in the batch must not change the draws"
    );
}

#[test]
fn malformed_batches_are_typed_errors() {
    let m = model();
    let mut e = engine(m, 4);
    let bad_token = StepBatch {
        seqs: vec![seq(1, &[1, 60_000], 0, &blocks(0..1), true)],
    };
    assert!(matches!(
        e.step(&bad_token),
        Err(EngineError::InvalidBatch(_))
    ));
    let short = StepBatch {
        seqs: vec![seq(1, &[1; 20], 0, &blocks(0..1), true)],
    };
    assert!(matches!(e.step(&short), Err(EngineError::InvalidBatch(_))));
    let out_of_pool = StepBatch {
        seqs: vec![seq(1, &[1], 0, &[BlockId(7)], true)],
    };
    assert!(matches!(
        e.step(&out_of_pool),
        Err(EngineError::InvalidBatch(_))
    ));
}
