//! Token sampling from one row of logits: greedy, temperature, top-k, top-p (nucleus).
//!
//! Randomness is injected: the caller owns one seeded generator per sequence
//! ([`SeqRng`]) so a request's draws do not depend on what else shares the batch.

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// The per-sequence random generator (ChaCha12 via rand's `StdRng`).
pub type SeqRng = rand::rngs::StdRng;

/// Creates a sequence generator: seeded from `seed`, or from the OS when `None`.
pub fn seq_rng(seed: Option<u64>) -> SeqRng {
    match seed {
        Some(s) => SeqRng::seed_from_u64(s),
        None => SeqRng::from_os_rng(),
    }
}

/// The draws of one sequence. With a seed, the generator of the `n`-th sampled token is a
/// pure function of `(seed, n)` ([`position_rng`]), so a sequence that resumes elsewhere
/// (migration) with `offset = n` draws exactly what it would have drawn in place. Without a
/// seed, one OS-seeded generator serves every draw.
#[derive(Debug)]
pub struct SeqSampler {
    seed: Option<u64>,
    next: u64,
    os: Option<SeqRng>,
}

impl SeqSampler {
    /// A sampler whose next draw is the `offset`-th of the sequence.
    pub fn new(seed: Option<u64>, offset: u64) -> Self {
        Self {
            seed,
            next: offset,
            os: None,
        }
    }

    /// Counts a draw made elsewhere (a greedy pick taken from a device's argmax), so the next
    /// draw keeps its index in the sequence as if [`SeqSampler::choose`] had made it.
    pub fn skip(&mut self) {
        self.next += 1;
    }

    /// Picks the next token with [`choose`].
    pub fn choose(&mut self, logits: &[f32], p: &SamplingParams) -> u32 {
        let n = self.next;
        self.next += 1;
        match self.seed {
            Some(seed) => choose(logits, p, &mut position_rng(seed, n)),
            None => choose(logits, p, self.os.get_or_insert_with(|| seq_rng(None))),
        }
    }
}

/// The generator of draw `n` of a sequence seeded with `seed` (ChaCha12 seeded from
/// `seed ^ n·φ64`, φ64 = 0x9E37_79B9_7F4A_7C15, the 64-bit golden-ratio constant of
/// Fibonacci hashing).
pub fn position_rng(seed: u64, n: u64) -> SeqRng {
    SeqRng::seed_from_u64(seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// How to pick the next token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` means greedy (argmax).
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]`; `1` = off. Values `<= 0` keep only the top token.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; `0` = off.
    pub top_k: usize,
    /// Seed of this sequence's generator; `None` = random.
    pub seed: Option<u64>,
    /// Tokens this sequence already sampled elsewhere (a migrated request resumes its draws
    /// at this index; see [`SeqSampler`]).
    #[serde(default)]
    pub offset: u64,
    /// Whether the caller wants [`SampledToken`](crate::worker::engine::SampledToken)
    /// logprobs (always computed; the flag is informational for the API layer).
    pub logprobs: bool,
    /// How many of the most likely tokens to return with each sampled one, with their
    /// logprobs ([`top_log_probs`]): `top_logprobs` on chat, `logprobs` on completions; at
    /// most [`MAX_TOP_LOGPROBS`]; 0 = none.
    #[serde(default)]
    pub top_logprobs: u32,
    /// Prompt log-probabilities (`echo` on `/v1/completions`, vLLM's `prompt_logprobs`): the
    /// sequence's first `echo_tokens` tokens are the client's prompt, and the prefill scores
    /// each of them from the second on — its logprob given the tokens before it, with
    /// `top_logprobs` alternatives — from the logits of the position before it (so the
    /// worker computes every prompt position, bypassing its prefix cache). Kept across a
    /// migration (whose prompt grows by the tokens already generated: only these first
    /// `echo_tokens` are scored); 0 = none.
    #[serde(default)]
    pub echo_tokens: u32,
}

/// Most alternatives a sampled token carries (OpenAI's bound on chat's `top_logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl Default for SamplingParams {
    /// Greedy decoding.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            offset: 0,
            logprobs: false,
            top_logprobs: 0,
            echo_tokens: 0,
        }
    }
}

impl SamplingParams {
    /// True when the choice is deterministic argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1 || self.top_p <= 0.0
    }
}

/// Index of the largest logit (lowest index on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

/// `log softmax(logits)[idx]` at temperature 1 (the model's own distribution).
pub fn log_prob(logits: &[f32], idx: u32) -> f32 {
    let lse = log_sum_exp(logits);
    logits
        .get(idx as usize)
        .map_or(f32::NEG_INFINITY, |&v| v - lse)
}

/// `log Σ exp(logits)`, shifted by the largest logit (NaN when any logit is NaN).
fn log_sum_exp(logits: &[f32]) -> f32 {
    let mx = logits.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    logits
        .iter()
        .map(|&v| f64::from(v - mx).exp())
        .sum::<f64>()
        .ln() as f32
        + mx
}

/// The `k` (at most [`MAX_TOP_LOGPROBS`]) most likely tokens of `logits` with their
/// `log softmax` at temperature 1 — the distribution [`log_prob`] reads, so the sampled
/// token's logprob equals its entry when it is among them — best first, the lower id first
/// on ties; NaN logits are never listed (but, as for [`log_prob`], make every logprob of the
/// row NaN). Two passes over the vocabulary (the top `k` kept
/// in a sorted array of at most 20, then the normaliser).
pub fn top_log_probs(logits: &[f32], k: u32) -> Vec<(u32, f32)> {
    let k = k.min(MAX_TOP_LOGPROBS) as usize;
    if k == 0 {
        return Vec::new();
    }
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() || (top.len() == k && v <= top[k - 1].1) {
            continue;
        }
        // After every kept entry with a logit at least as large (ties: the earlier id).
        let at = top.partition_point(|&(_, t)| t >= v);
        top.insert(at, (i as u32, v));
        top.truncate(k);
    }
    let lse = log_sum_exp(logits);
    top.into_iter().map(|(i, v)| (i, v - lse)).collect()
}

/// Picks one token from `logits` (`[vocab]` f32). Returns `(token, logprob)` where logprob is
/// under the unmodified model distribution ([`log_prob`]).
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut impl Rng) -> (u32, f32) {
    let tok = choose(logits, p, rng);
    (tok, log_prob(logits, tok))
}

/// Picks one token from `logits` (`[vocab]` f32) without computing its logprob; the generator
/// is only advanced for non-greedy parameters.
pub fn choose(logits: &[f32], p: &SamplingParams, rng: &mut impl Rng) -> u32 {
    if p.is_greedy() {
        argmax(logits)
    } else {
        sample_stochastic(logits, p, rng)
    }
}

fn sample_stochastic(logits: &[f32], p: &SamplingParams, rng: &mut impl Rng) -> u32 {
    let inv_t = 1.0 / p.temperature;
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_nan())
        .map(|(i, &v)| (i as u32, v * inv_t))
        .collect();
    if cand.is_empty() {
        return 0;
    }
    let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.select_nth_unstable_by(p.top_k - 1, desc);
        cand.truncate(p.top_k);
    }
    let nucleus = p.top_p < 1.0;
    if nucleus {
        cand.sort_unstable_by(desc);
    }
    let mx = cand.iter().fold(f32::NEG_INFINITY, |a, c| a.max(c.1));
    let mut probs: Vec<f64> = cand.iter().map(|c| f64::from(c.1 - mx).exp()).collect();
    let total: f64 = probs.iter().sum();
    let mut keep = probs.len();
    if nucleus {
        let target = f64::from(p.top_p) * total;
        let mut cum = 0.0;
        for (i, &pr) in probs.iter().enumerate() {
            cum += pr;
            if cum >= target {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let mass: f64 = probs.iter().sum();
    let mut u = rng.random::<f64>() * mass;
    for (c, &pr) in cand.iter().zip(&probs) {
        if u < pr {
            return c.0;
        }
        u -= pr;
    }
    cand[keep - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 37) % 100) as f32 * 0.1).collect()
    }

    #[test]
    fn seeded_is_deterministic() {
        let p = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        let l = logits();
        let draw = |s| {
            let mut r = seq_rng(Some(s));
            (0..20)
                .map(|_| sample(&l, &p, &mut r).0)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let l = logits();
        let p = SamplingParams {
            temperature: 5.0,
            top_k: 1,
            ..Default::default()
        };
        let mut r = seq_rng(Some(1));
        for _ in 0..20 {
            assert_eq!(sample(&l, &p, &mut r).0, argmax(&l));
        }
    }

    #[test]
    fn top_p_edges() {
        let l = logits();
        let mut r = seq_rng(Some(3));
        // tiny nucleus keeps only the best token
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            ..Default::default()
        };
        for _ in 0..20 {
            assert_eq!(sample(&l, &p, &mut r).0, argmax(&l));
        }
        // top_p = 0 is greedy
        let p0 = SamplingParams {
            temperature: 1.0,
            top_p: 0.0,
            ..Default::default()
        };
        assert_eq!(sample(&l, &p0, &mut r).0, argmax(&l));
        // a nucleus of two equally likely tokens only ever yields those two
        let mut two = vec![-100.0f32; 10];
        two[3] = 5.0;
        two[6] = 5.0;
        let p2 = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        };
        let mut seen = [false; 10];
        for _ in 0..200 {
            seen[sample(&two, &p2, &mut r).0 as usize] = true;
        }
        assert!(seen[3] && seen[6] && seen.iter().filter(|&&s| s).count() == 2);
        // top_p = 1 with top_k = 3 only yields the three best
        let p3 = SamplingParams {
            temperature: 100.0,
            top_k: 3,
            ..Default::default()
        };
        let mut best: Vec<usize> = (0..l.len()).collect();
        best.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
        for _ in 0..100 {
            assert!(best[..3].contains(&(sample(&l, &p3, &mut r).0 as usize)));
        }
    }

    #[test]
    fn top_log_probs_agree_with_the_sampled_tokens_logprob() {
        let l = vec![1.0, 3.0, -7.0, 3.0, -2.0, 0.5];
        let top = top_log_probs(&l, 3);
        assert_eq!(
            top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3, 0],
            "best first, the lower id first on a tie"
        );
        for (id, lp) in &top {
            assert_eq!(*lp, log_prob(&l, *id), "the same normaliser as log_prob");
        }
        assert_eq!(top_log_probs(&l, 0), vec![]);
        let nan = vec![1.0, f32::NAN, 0.5];
        let top = top_log_probs(&nan, 5);
        assert_eq!(
            top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![0, 2],
            "NaN never listed"
        );
        let wide: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1000) as f32 / 10.0)
            .collect();
        let top = top_log_probs(&wide, 50);
        assert_eq!(top.len(), MAX_TOP_LOGPROBS as usize, "capped");
        assert_eq!(top[0].0, argmax(&wide));
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn logprob_is_normalised() {
        let l = logits();
        let s: f64 = (0..l.len() as u32)
            .map(|i| f64::from(log_prob(&l, i)).exp())
            .sum();
        assert!((s - 1.0).abs() < 1e-4);
    }
}
