//! Request and response types of one engine step.

use serde::{Deserialize, Serialize};

pub use crate::kernels::sample::SamplingParams;
use crate::runtime::ids::{BlockId, SeqId};

/// One sequence's work in a step: a prefill chunk or one decode token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepSeq {
    pub seq_id: SeqId,
    /// New tokens to run.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`.
    pub start_pos: usize,
    /// Covers positions `0..start_pos + tokens.len()`; block `i` holds positions
    /// `i·block_size..(i+1)·block_size`.
    pub block_table: Vec<BlockId>,
    pub sampling: SamplingParams,
    /// True when this chunk completes the prompt or is a decode token: sample one token.
    pub sample: bool,
    /// Prompt log-probabilities (`SamplingParams::echo_tokens`): the token that follows each of
    /// the first `score.len()` tokens of `tokens` (at positions `start_pos + 1 ..`), to be
    /// scored from that row's logits ([`StepOutput::prompt`]); empty = none (every ordinary
    /// step). At most `tokens.len()` long.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub score: Vec<u32>,
}

/// The prompt log-probabilities one step computed for one sequence ([`StepSeq::score`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptScores {
    pub seq_id: SeqId,
    /// Position (in the sequence) of the token `logprobs[0]` scores: the step's `start_pos + 1`.
    pub first: usize,
    /// Per scored token: its natural-log probability given the tokens before it (temperature 1,
    /// the distribution [`SampledToken::logprob`] reads) and the `top_logprobs` most likely
    /// tokens at that position with theirs, best first.
    pub logprobs: Vec<(f32, Vec<(u32, f32)>)>,
}

/// All sequences of one step; they run through one forward pass.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepBatch {
    pub seqs: Vec<StepSeq>,
}

/// The token drawn for one sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampledToken {
    pub seq_id: SeqId,
    pub token: u32,
    /// Natural-log probability of `token` under the model's unmodified distribution
    /// (temperature 1, no top-k/top-p).
    pub logprob: f32,
    /// The sequence's `top_logprobs` most likely tokens at this step with their logprobs
    /// under the same distribution, best first (`kernels::sample::top_log_probs`); empty
    /// when none were asked for. The simulated engine, which has no distribution, lists its
    /// token alone (logprob 0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<(u32, f32)>,
}

/// Result of one step: one token per sequence that had `sample = true`, in batch order, and
/// the prompt log-probabilities of every sequence with a [`StepSeq::score`], in batch order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepOutput {
    pub tokens: Vec<SampledToken>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt: Vec<PromptScores>,
}

/// Static facts about an engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineInfo {
    /// Backend name ("cpu").
    pub device: String,
    pub num_blocks: usize,
    pub block_size: usize,
    pub vocab_size: usize,
    pub max_context: usize,
    /// Bytes of one block of one pool of one layer.
    pub block_bytes: usize,
    /// Bytes of all KV pools.
    pub kv_bytes: usize,
}
