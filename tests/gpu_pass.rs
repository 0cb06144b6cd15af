//! The GPU engine path (`kernels/cuda/`) end to end through the engine API: the golden cases,
//! a mixed batch against the CPU engine and against solo runs, seeded sampling, bad batches.
//!
//! Everywhere these run on the kernels' CPU twins (`Device::CudaTwin`): the same pass, plan,
//! pools and sampling as on a GPU, with each launch replaced by its twin. With
//! `FLOTILLA_TEST_GPU=cuda` (the device check, `scripts/gpu-check.sh`) they run on GPU 0.

#[path = "common/model.rs"]
mod model;

use std::sync::Arc;

use flotilla::kernels::Device;
use flotilla::kernels::cuda::GemmPrecision;
use flotilla::model::LoadedModel;
use flotilla::worker::engine::{
    Engine, EngineConfig, EngineError, SamplingParams, StepBatch, StepSeq,
};

use crate::model::{assert_golden, blocks, golden, greedy, max_abs_diff, model, seq};

/// The device under test: the twins, or GPU 0 when `FLOTILLA_TEST_GPU=cuda`.
fn device(precision: GemmPrecision) -> Device {
    match std::env::var("FLOTILLA_TEST_GPU").as_deref() {
        Ok("cuda") => Device::Cuda {
            ordinal: 0,
            precision,
            cpu_fallback: false,
        },
        _ => Device::CudaTwin { precision },
    }
}

fn engine_on(m: &LoadedModel, num_blocks: usize, device: Device) -> Engine {
    Engine::new(
        Arc::clone(&m.weights),
        EngineConfig {
            num_blocks,
            device,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

#[test]
fn gpu_pass_matches_golden_greedy_and_logits() {
    let m = model();
    let mut e = engine_on(m, 64, device(GemmPrecision::F32));
    assert!(e.info().device.starts_with("cuda"), "{}", e.info().device);
    assert_golden(&mut e);
}

/// A step mixing a prefill chunk, a second chunk and decode tokens of other sequences gives
/// the CPU engine's logits and the same seeded draws; each sequence as if it ran alone.
#[test]
fn mixed_batch_matches_the_cpu_engine() {
    let m = model();
    let mut gpu = engine_on(m, 96, device(GemmPrecision::F32));
    let mut cpu = engine_on(m, 96, Device::Cpu);
    let prompt = &golden()[0].prompt_ids;
    let long: Vec<u32> = (0..40).map(|i| prompt[i % prompt.len()]).collect();
    let (ta, tb, tc) = (blocks(0..8), blocks(8..16), blocks(16..24));
    // A sequence's generator is made at its first sample, from that step's parameters.
    let sampled = |mut s: StepSeq| {
        s.sampling = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: Some(7 + s.seq_id.0),
            top_logprobs: 4,
            ..SamplingParams::default()
        };
        s
    };
    // A seeded sequence whose first pick is greedy (top_k = 1) and whose second is drawn:
    // the second draw is its second on both engines (a greedy pick counts as a draw).
    let greedy_then_seeded = |mut s: StepSeq, top_k: usize| {
        s.sampling = SamplingParams {
            temperature: 1.0,
            top_k,
            seed: Some(11),
            // Alternatives of a greedy pick bring its row to the host too.
            top_logprobs: 3,
            ..SamplingParams::default()
        };
        s
    };
    let warm = StepBatch {
        seqs: vec![
            seq(1, &long[..24], 0, &ta, false),
            sampled(seq(2, prompt, 0, &tb, true)),
            greedy_then_seeded(seq(3, &long[..5], 0, &tc, true), 1),
        ],
    };
    let next = StepBatch {
        seqs: vec![
            seq(1, &long[24..], 24, &ta, true),
            sampled(seq(2, &[42], prompt.len(), &tb, true)),
            greedy_then_seeded(seq(3, &[43], 5, &tc, true), 0),
        ],
    };
    for b in [&warm, &next] {
        let (lg, lc) = (
            gpu.logits(b).expect("gpu logits"),
            cpu.logits(b).expect("cpu logits"),
        );
        for (x, y) in lg.iter().zip(&lc) {
            assert!(max_abs_diff(x, y) < 2e-3, "{}", max_abs_diff(x, y));
        }
    }
    // Sampling: the same tokens (greedy and seeded) from fresh engines.
    let mut gpu = engine_on(m, 96, device(GemmPrecision::F32));
    let mut cpu = engine_on(m, 96, Device::Cpu);
    for b in [&warm, &next] {
        let (og, oc) = (gpu.step(b).expect("gpu"), cpu.step(b).expect("cpu"));
        let toks = |o: &flotilla::worker::engine::StepOutput| -> Vec<u32> {
            o.tokens.iter().map(|t| t.token).collect()
        };
        assert_eq!(toks(&og), toks(&oc));
        for (a, b) in og.tokens.iter().zip(&oc.tokens) {
            assert!((a.logprob - b.logprob).abs() < 1e-3, "{a:?} vs {b:?}");
            // The same alternatives, from the same logits the token was drawn from.
            assert_eq!(a.top.len(), b.top.len(), "{a:?} vs {b:?}");
            for (x, y) in a.top.iter().zip(&b.top) {
                assert_eq!(x.0, y.0, "{a:?} vs {b:?}");
                assert!((x.1 - y.1).abs() < 1e-3, "{a:?} vs {b:?}");
            }
        }
        let wanted: Vec<usize> = og.tokens.iter().map(|t| t.top.len()).collect();
        assert!(
            wanted.contains(&4) && wanted.contains(&3),
            "alternatives as each sequence asked: {wanted:?}"
        );
    }
    // Sequence 1 alone gives what it gave in the batch.
    let mut solo = engine_on(m, 96, device(GemmPrecision::F32));
    let l1 = solo
        .logits(&StepBatch {
            seqs: vec![seq(1, &long, 0, &ta, true)],
        })
        .expect("solo");
    let lb = gpu
        .logits(&StepBatch {
            seqs: vec![seq(1, &long[39..], 39, &ta, true)],
        })
        .expect("batched");
    assert!(max_abs_diff(&l1[0], &lb[0]) < 2e-3);
}

/// Prompt log-probabilities (echo) on the device path: a scoring sequence's every row comes
/// out, between a decode row before it and a sampled prefill after it, and the scores, the
/// sampled tokens and their logprobs are the CPU engine's.
#[test]
fn prompt_scores_match_the_cpu_engine_in_a_mixed_batch() {
    let m = model();
    let mut gpu = engine_on(m, 96, device(GemmPrecision::F32));
    let mut cpu = engine_on(m, 96, Device::Cpu);
    let prompt = &golden()[2].prompt_ids;
    let (ta, tb, tc) = (blocks(0..8), blocks(8..16), blocks(16..24));
    let scoring = |s: StepSeq, score: &[u32]| {
        let mut s = s;
        s.score = score.to_vec();
        s.sampling = SamplingParams {
            top_logprobs: 2,
            echo_tokens: 30,
            ..SamplingParams::default()
        };
        s
    };
    let warm = StepBatch {
        seqs: vec![
            seq(1, &prompt[..4], 0, &ta, true),
            scoring(seq(2, &prompt[..12], 0, &tb, false), &prompt[1..13]),
            seq(3, &prompt[..6], 0, &tc, true),
        ],
    };
    let next = StepBatch {
        seqs: vec![
            seq(1, &[42], 4, &ta, true),
            scoring(seq(2, &prompt[12..30], 12, &tb, true), &prompt[13..30]),
            seq(3, &[43], 6, &tc, true),
        ],
    };
    for b in [&warm, &next] {
        let (og, oc) = (gpu.step(b).expect("gpu"), cpu.step(b).expect("cpu"));
        let toks = |o: &flotilla::worker::engine::StepOutput| -> Vec<u32> {
            o.tokens.iter().map(|t| t.token).collect()
        };
        assert_eq!(toks(&og), toks(&oc), "the sampled rows are the right ones");
        for (a, b) in og.tokens.iter().zip(&oc.tokens) {
            assert!((a.logprob - b.logprob).abs() < 1e-3, "{a:?} vs {b:?}");
        }
        assert_eq!(og.prompt.len(), 1);
        let (pg, pc) = (&og.prompt[0], &oc.prompt[0]);
        assert_eq!((pg.seq_id, pg.first), (pc.seq_id, pc.first));
        assert_eq!(pg.logprobs.len(), b.seqs[1].score.len());
        for (x, y) in pg.logprobs.iter().zip(&pc.logprobs) {
            assert!((x.0 - y.0).abs() < 1e-3, "{x:?} vs {y:?}");
            assert_eq!(
                x.1.iter().map(|t| t.0).collect::<Vec<_>>(),
                y.1.iter().map(|t| t.0).collect::<Vec<_>>()
            );
        }
    }
}

/// bf16 prefill products: the first greedy tokens agree with the golden ones and step 0's
/// top-5 logits move by less than the measured bound.
#[test]
fn bf16_prefill_stays_close_to_golden() {
    let m = model();
    let mut e = engine_on(m, 64, device(GemmPrecision::Bf16));
    for c in golden() {
        let (logits, ids) = greedy(&mut e, &c.prompt_ids, 4, &m.tokenizer.eos_ids);
        let worst = c
            .top5
            .iter()
            .map(|&(id, want)| (logits[id as usize] - want).abs())
            .fold(0f32, f32::max);
        eprintln!("case {}: bf16 top-5 logit error {worst:.4}", c.name);
        // Measured on the twins (bf16 rounding of weights and activations): 0.03-0.04.
        assert!(worst < 0.1, "case {}: {worst}", c.name);
        assert_eq!(ids[0], c.greedy_ids[0], "case {}", c.name);
    }
}

#[test]
fn malformed_batches_are_typed_errors_and_the_engine_goes_on() {
    let m = model();
    let mut e = engine_on(m, 8, device(GemmPrecision::F32));
    let t = blocks(0..2);
    let bad_token = StepBatch {
        seqs: vec![seq(1, &[u32::MAX], 0, &t, true)],
    };
    let bad_block = StepBatch {
        seqs: vec![seq(
            1,
            &[1],
            0,
            &[flotilla::runtime::ids::BlockId(99)],
            true,
        )],
    };
    let short = StepBatch {
        seqs: vec![seq(1, &[1; 40], 0, &t, true)],
    };
    for b in [&bad_token, &bad_block, &short] {
        assert!(matches!(e.step(b), Err(EngineError::InvalidBatch(_))));
    }
    let ok = StepBatch {
        seqs: vec![seq(1, &[1, 2, 3], 0, &t, true)],
    };
    assert_eq!(e.step(&ok).expect("step").tokens.len(), 1);
}

/// `auto` picked CUDA but the GPU engine cannot start: with `cpu_fallback` the engine runs on
/// the CPU (and gives the golden ids); without it the start fails naming the cause. Here the
/// driver is missing, which is one way a GPU engine fails to start.
#[test]
fn a_gpu_that_cannot_start_falls_back_only_when_allowed() {
    if flotilla::kernels::cuda::probe().driver {
        eprintln!("skipped: a CUDA driver loads here");
        return;
    }
    let m = model();
    let cuda = |cpu_fallback| Device::Cuda {
        ordinal: 0,
        precision: GemmPrecision::F32,
        cpu_fallback,
    };
    let mut e = engine_on(m, 64, cuda(true));
    assert_eq!(e.info().device, "cpu");
    assert_golden(&mut e);
    let err = Engine::new(
        Arc::clone(&m.weights),
        EngineConfig {
            num_blocks: 64,
            device: cuda(false),
            ..EngineConfig::default()
        },
    )
    .expect_err("no fallback");
    assert!(err.to_string().contains("libcuda"), "{err}");
}

/// The GPU pass's KV pools go through the node transport: a prompt
/// prefilled here, its blocks pulled over TCP (the pools staged through host copies) into
/// another engine of the same device and into a CPU engine at other block ids, decodes there
/// to the source's own greedy tokens; once the source engine is dropped its region refuses
/// pulls instead of being read (the device check runs the same on GPU 0).
#[test]
fn kv_blocks_hand_off_through_the_transport_from_device_pools() {
    use flotilla::transport::MemoryKind;
    let m = model();
    let dev = device(GemmPrecision::F32);
    let prompt = &golden()[0].prompt_ids;
    let hs =
        flotilla::cli::cuda::kv_handoff(m, dev, &[dev, Device::Cpu], prompt, 8).expect("handoff");
    assert_eq!(hs.len(), 2);
    let kind = match dev {
        Device::Cuda { .. } => MemoryKind::Cuda { device: 0 },
        _ => MemoryKind::Host,
    };
    for h in &hs {
        assert_eq!(h.equal, h.n, "{h}");
        assert_eq!(h.src_memory, kind, "{h}");
        let blocks = prompt.len().div_ceil(16) as u64;
        let c = &m.weights.config;
        assert_eq!(
            h.bytes,
            blocks * 2 * c.n_layers as u64 * 16 * (c.n_kv_heads * c.head_dim) as u64 * 4
        );
    }
    assert_eq!(
        (hs[0].dst_memory, hs[1].dst_memory),
        (kind, MemoryKind::Host)
    );
    assert!(hs[1].dst.starts_with("cpu"), "{}", hs[1]);
}
