//! The model, its golden cases (provenance in `tests/data/README.md`) and a greedy driver over
//! the synchronous engine API.
#![allow(dead_code, reason = "each binary that runs the engine uses a subset")]

use std::sync::{Arc, OnceLock};

use flotilla::model::{LoadedModel, load_model, resolve_model_path};
use flotilla::runtime::ids::{BlockId, SeqId};
use flotilla::worker::engine::{Engine, EngineConfig, SamplingParams, StepBatch, StepSeq};

/// The golden cases of the default model.
pub const GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/smollm2-golden.json"
);

/// The golden file as JSON; panics naming the path when it cannot be read.
pub fn golden_json() -> serde_json::Value {
    let text =
        std::fs::read_to_string(GOLDEN).unwrap_or_else(|e| panic!("cannot read {GOLDEN}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{GOLDEN} is not JSON: {e}"))
}

/// One golden case: a prompt, its token ids, the greedy continuation and step 0's top 5.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub top5: Vec<(u32, f32)>,
}

/// Every golden case.
pub fn golden() -> Vec<Case> {
    let j = golden_json();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect()
    };
    j["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().expect("name").to_owned(),
            prompt: c["prompt"].as_str().expect("prompt").to_owned(),
            prompt_ids: ids(&c["prompt_ids"]),
            greedy_ids: ids(&c["greedy_ids"]),
            top5: c["step0_top5_logits"]
                .as_array()
                .expect("top5")
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().expect("id") as u32,
                        p[1].as_f64().expect("logit") as f32,
                    )
                })
                .collect(),
        })
        .collect()
}

/// The default model, loaded once per test binary.
pub fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| {
        let p = resolve_model_path(None).expect("model path (run `make model`)");
        load_model(&p).expect("load model")
    })
}

/// An engine over `m`'s weights with `num_blocks` KV blocks.
pub fn engine(m: &LoadedModel, num_blocks: usize) -> Engine {
    Engine::new(
        Arc::clone(&m.weights),
        EngineConfig {
            num_blocks,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

/// One sequence of a step batch, with default sampling.
pub fn seq(id: u64, tokens: &[u32], start_pos: usize, table: &[BlockId], sample: bool) -> StepSeq {
    StepSeq {
        seq_id: SeqId(id),
        tokens: tokens.to_vec(),
        start_pos,
        block_table: table.to_vec(),
        sampling: SamplingParams::default(),
        sample,
        score: Vec::new(),
    }
}

/// Block ids `range`.
pub fn blocks(range: std::ops::Range<u32>) -> Vec<BlockId> {
    range.map(BlockId).collect()
}

/// Prefills `prompt` in one chunk, returns (step-0 logits, greedy ids up to `n` or EOS).
pub fn greedy(engine: &mut Engine, prompt: &[u32], n: usize, eos: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let table = blocks(0..((prompt.len() + n) / 16 + 1) as u32);
    let batch = StepBatch {
        seqs: vec![seq(1, prompt, 0, &table, true)],
    };
    let logits = engine.logits(&batch).expect("prefill").remove(0);
    let mut out = vec![flotilla::kernels::sample::argmax(&logits)];
    let mut pos = prompt.len();
    while out.len() < n && !eos.contains(out.last().expect("nonempty")) {
        let last = *out.last().expect("nonempty");
        let b = StepBatch {
            seqs: vec![seq(1, &[last], pos, &table, true)],
        };
        let o = engine.step(&b).expect("decode");
        out.push(o.tokens[0].token);
        pos += 1;
    }
    (logits, out)
}

/// Largest absolute difference between two equally long vectors.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

/// Every golden case through `engine`: greedy ids exact, step 0's top-5 logits within 2e-2.
pub fn assert_golden(engine: &mut Engine) {
    let m = model();
    for c in golden() {
        let (logits, ids) = greedy(
            engine,
            &c.prompt_ids,
            c.greedy_ids.len(),
            &m.tokenizer.eos_ids,
        );
        for &(id, want) in &c.top5 {
            let got = logits[id as usize];
            assert!(
                (got - want).abs() < 2e-2,
                "case {} token {id}: {got} vs {want}",
                c.name
            );
        }
        assert_eq!(ids, c.greedy_ids, "case {}", c.name);
    }
}
