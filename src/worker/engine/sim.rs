//! Simulated engine: the real Scheduler and KvEventPublisher (real paged blocks, real KV events,
//! real prefix hits) driving an engine whose forward pass is a timing model, for fleet-scale
//! runs on one machine (`worker.engine = "sim"`, `flotilla up --engine sim --workers N`).
//! [`SimEngine`] is a [`StepEngine`]: the same engine worker runs it.
//!
//! # Timing model
//! A step holds prefill chunks and decode tokens. With `T` the prompt tokens prefilled in the
//! step (uncached tokens: cached prefix blocks are never sent to the engine) and `u` the KV
//! utilisation (blocks referenced by the step's sequences ÷ blocks in the pool, capped at 1):
//!
//! ```text
//! prefill_ms(T) = a·T² + b·T + c                     (only when T > 0)
//! decode_ms(u)  = max(min_decode_ms, d·u² + e·u + f)  (only when the step decodes)
//! step_ms       = (prefill_ms + decode_ms) / speedup
//! ```
//!
//! The default [`SimProfile`] is a published fit of vLLM on one H100 (the one NVIDIA Dynamo's
//! mocker engine ships): `prefill_ms = 4.21e-7·T² + 0.01518·T + 16.5`,
//! `decode_ms = −25.74·u² + 54.01·u + 5.74`, at least 1 ms. `flotilla profile` fits the same
//! forms to the CPU engine of this machine and writes a profile file (`worker.sim_profile`).
//!
//! # Tokens
//! Deterministic placeholders: the token at position `p` of sequence `s` is
//! `FIRST_TOKEN + (p·31 + s) mod TOKEN_RANGE`, never an end-of-sequence id in practice
//! (requests that must run to `max_tokens` set `ignore_eos` anyway). Logprobs are 0.

use super::{EngineError, EngineInfo, SampledToken, StepBatch, StepEngine, StepOutput};
use crate::runtime::ids::SeqId;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// First placeholder token id.
pub const FIRST_TOKEN: u32 = 1000;
/// Placeholder ids span `FIRST_TOKEN..FIRST_TOKEN + TOKEN_RANGE`.
pub const TOKEN_RANGE: u32 = 20_000;

/// Step-time model (milliseconds; see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimProfile {
    /// Where the numbers come from.
    pub source: String,
    /// `prefill_ms = prefill[0]·T² + prefill[1]·T + prefill[2]`.
    pub prefill: [f64; 3],
    /// `decode_ms = decode[0]·u² + decode[1]·u + decode[2]`.
    pub decode: [f64; 3],
    /// Floor of a decode step (ms).
    pub min_decode_ms: f64,
}

impl Default for SimProfile {
    fn default() -> Self {
        Self::h100_vllm()
    }
}

impl SimProfile {
    /// vLLM on one H100 (NVIDIA Dynamo mocker's fit).
    pub fn h100_vllm() -> Self {
        Self {
            source: "vLLM on 1x H100, polynomial fit shipped with NVIDIA Dynamo's mocker engine"
                .into(),
            prefill: [4.21e-7, 0.01518, 16.5],
            decode: [-25.74, 54.01, 5.74],
            min_decode_ms: 1.0,
        }
    }

    /// Read a profile file (JSON).
    ///
    /// # Errors
    /// When the file cannot be read or is not a profile.
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("bad sim profile {}: {e}", path.display()))
    }

    /// Prefill time of `tokens` uncached prompt tokens (ms).
    pub fn prefill_ms(&self, tokens: usize) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        let [a, b, c] = self.prefill;
        (a * t * t + b * t + c).max(0.0)
    }

    /// Decode step time at KV utilisation `u` in `[0, 1]` (ms).
    pub fn decode_ms(&self, u: f64) -> f64 {
        let u = u.clamp(0.0, 1.0);
        let [d, e, f] = self.decode;
        (d * u * u + e * u + f).max(self.min_decode_ms)
    }

    /// Time of one step (ms, before speedup).
    pub fn step_ms(&self, batch: &StepBatch, num_blocks: usize) -> f64 {
        let prefill: usize = batch
            .seqs
            .iter()
            .filter(|s| !(s.tokens.len() == 1 && s.start_pos > 0 && s.sample))
            .map(|s| s.tokens.len())
            .sum();
        let decodes = batch
            .seqs
            .iter()
            .any(|s| s.tokens.len() == 1 && s.start_pos > 0);
        let blocks: usize = batch.seqs.iter().map(|s| s.block_table.len()).sum();
        let u = blocks as f64 / num_blocks.max(1) as f64;
        self.prefill_ms(prefill) + if decodes { self.decode_ms(u) } else { 0.0 }
    }
}

/// Spawn inputs of a simulated engine.
#[derive(Clone, Debug)]
pub struct SimEngineArgs {
    /// Timing model.
    pub profile: SimProfile,
    /// Time compression: step times are divided by this.
    pub speedup: f64,
    /// KV blocks of the replica (for the utilisation).
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Reported vocabulary size.
    pub vocab_size: usize,
    /// Reported context length.
    pub max_context: usize,
}

/// The simulated engine: sleeps for the modelled step time and returns placeholder tokens.
#[derive(Debug)]
pub struct SimEngine {
    args: SimEngineArgs,
}

/// Placeholder token at position `pos` of sequence `seq`.
pub fn placeholder(seq: u64, pos: usize) -> u32 {
    FIRST_TOKEN + ((pos as u64 * 31 + seq) % u64::from(TOKEN_RANGE)) as u32
}

impl StepEngine for SimEngine {
    type Config = SimEngineArgs;

    async fn start(args: SimEngineArgs) -> Result<Self, EngineError> {
        if !(args.speedup > 0.0 && args.speedup.is_finite()) {
            return Err(EngineError::Config(format!(
                "sim speedup must be positive, got {}",
                args.speedup
            )));
        }
        Ok(Self { args })
    }

    fn info(&self) -> EngineInfo {
        let s = &self.args;
        EngineInfo {
            device: format!("sim ({})", s.profile.source),
            num_blocks: s.num_blocks,
            block_size: s.block_size,
            vocab_size: s.vocab_size,
            max_context: s.max_context,
            block_bytes: 0,
            kv_bytes: 0,
        }
    }

    async fn step(&mut self, batch: StepBatch) -> Result<StepOutput, EngineError> {
        let s = &self.args;
        let ms = s.profile.step_ms(&batch, s.num_blocks) / s.speedup;
        tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0)).await;
        let tokens = batch
            .seqs
            .iter()
            .filter(|q| q.sample)
            .map(|q| SampledToken {
                seq_id: q.seq_id,
                token: placeholder(q.seq_id.0, q.start_pos + q.tokens.len()),
                logprob: 0.0,
            })
            .collect();
        Ok(StepOutput { tokens })
    }

    async fn logits(&mut self, _batch: StepBatch) -> Result<Vec<Vec<f32>>, EngineError> {
        Err(EngineError::Unavailable(
            "the simulated engine computes no logits".into(),
        ))
    }

    fn release(&mut self, _seq: SeqId) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_h100_profile_matches_its_formula() {
        let p = SimProfile::h100_vllm();
        assert_eq!(p.prefill_ms(0), 0.0);
        let t = 1000.0;
        assert!((p.prefill_ms(1000) - (4.21e-7 * t * t + 0.01518 * t + 16.5)).abs() < 1e-9);
        assert!((p.decode_ms(0.5) - (-25.74 * 0.25 + 54.01 * 0.5 + 5.74)).abs() < 1e-9);
        assert!(p.decode_ms(0.0) >= 1.0);
        // Monotone where it matters: more tokens take longer.
        assert!(p.prefill_ms(4096) > p.prefill_ms(512));
    }

    #[test]
    fn placeholders_are_deterministic_and_in_range() {
        assert_eq!(placeholder(3, 10), placeholder(3, 10));
        assert_ne!(placeholder(3, 10), placeholder(3, 11));
        for p in 0..100 {
            let t = placeholder(7, p);
            assert!((FIRST_TOKEN..FIRST_TOKEN + TOKEN_RANGE).contains(&t));
        }
    }
}
