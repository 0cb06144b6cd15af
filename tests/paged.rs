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

/// Prompt log-probabilities (`StepSeq::score`, echo): a prefill in chunks scores each prompt
/// token from the logits of the position before it, exactly what the last-position logits of
/// the prompt's prefix give (the same model run alone), with its alternatives ordered and the
/// scored token's own logprob among them when it is that likely; the sampled row is still
/// the last one.
#[test]
fn prompt_scores_match_each_prefix_run_alone() {
    use flotilla::kernels::sample::{log_prob, top_log_probs};
    let m = model();
    let p: Vec<u32> = long_prompt()[..21].to_vec();
    let table = blocks(0..2);
    let mut e = engine(m, 64);
    let mut scored = Vec::new();
    let mut sampled = None;
    // Chunks of 8: every chunk but the last scores all its rows (its last row against the next
    // chunk's first token); the last one scores all but its sampled row.
    for (i, c) in p.chunks(8).enumerate() {
        let start = i * 8;
        let end = start + c.len();
        let mut s = seq(1, c, start, &table, end == p.len());
        s.score = p[start + 1..p.len().min(end + 1)].to_vec();
        s.sampling = SamplingParams {
            top_logprobs: 3,
            echo_tokens: p.len() as u32,
            ..SamplingParams::default()
        };
        let out = e.step(&StepBatch { seqs: vec![s] }).expect("step");
        assert_eq!(out.prompt.len(), 1);
        assert_eq!(out.prompt[0].first, start + 1, "positions");
        scored.extend(out.prompt[0].logprobs.clone());
        if let Some(t) = out.tokens.first() {
            sampled = Some(t.clone());
        }
    }
    assert_eq!(scored.len(), p.len() - 1, "every token but the first");
    let mut fresh = engine(m, 64);
    for k in 1..p.len() {
        let row = fresh
            .logits(&StepBatch {
                seqs: vec![seq(100 + k as u64, &p[..k], 0, &table, true)],
            })
            .expect("prefix")
            .remove(0);
        let (lp, top) = &scored[k - 1];
        let want = log_prob(&row, p[k]);
        assert!((lp - want).abs() < 1e-3, "token {k}: {lp} vs {want}");
        assert!(*lp <= 0.0 && lp.is_finite());
        let want_top = top_log_probs(&row, 3);
        assert_eq!(
            top.iter().map(|t| t.0).collect::<Vec<_>>(),
            want_top.iter().map(|t| t.0).collect::<Vec<_>>(),
            "token {k}: alternatives"
        );
        if let Some(own) = top.iter().find(|t| t.0 == p[k]) {
            assert!(
                (own.1 - lp).abs() < 1e-6,
                "its own entry: the same distribution"
            );
        }
    }
    // The sampled token (greedy) is the whole prompt's argmax, as without scoring.
    let row = fresh
        .logits(&StepBatch {
            seqs: vec![seq(200, &p, 0, &table, true)],
        })
        .expect("whole")
        .remove(0);
    let t = sampled.expect("sampled at the end of the prompt");
    assert_eq!(t.token, flotilla::kernels::sample::argmax(&row));
    assert!((t.logprob - log_prob(&row, t.token)).abs() < 1e-3);
}
