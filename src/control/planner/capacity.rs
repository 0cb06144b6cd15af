//! What one replica sustains within the latency targets: the planner's capacity curves.
//!
//! A [`CapacityProfile`] holds two tables, each point measured or derived at the profile's
//! targets:
//! - `prefill`: for a prompt of `tokens` uncached tokens, the prompt tokens/s one replica
//!   prefills with TTFT p99 within `ttft_target_ms`;
//! - `decode`: for sequences of `tokens` context, the output tokens/s one replica decodes with
//!   ITL p99 within `itl_target_ms`, and the batch it takes.
//!
//! Between points the tables are interpolated linearly; beyond them the end point holds. The
//! file is JSON (`planner.capacity_profile`); [`CapacityProfile::from_step_model`] derives it
//! from a step-time model (the sim engine's profile, or `flotilla profile`'s fit of this
//! machine's CPU engine):
//!
//! - a prompt of `L` tokens is prefilled in chunks of `max_num_batched_tokens`, taking
//!   `s(L) = Σ prefill_ms(chunk)`; one replica's raw rate is `L / s(L)`. Requests queue, so
//!   the rate is cut to the utilisation `ρ` at which the p99 TTFT of an M/D/1 queue, about
//!   `s + s·ln(100ρ) / (2(1−ρ))` (half the M/M/1 wait, Kingman's heavy-traffic rule for
//!   deterministic service), stays within the target;
//! - `B` sequences of context `C` decode in a step of `decode_ms(B·C / kv_tokens, B)`; `B` is the
//!   largest batch within `max_num_seqs`, 90 % of the KV pool and the ITL target, and the rate
//!   is `B / step`.

use serde::{Deserialize, Serialize};

/// One point of a capacity curve.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityPoint {
    /// Prompt length (prefill) or context length (decode), tokens.
    pub tokens: u32,
    /// Tokens/s one replica sustains at the target.
    pub tokens_per_s: f64,
    /// Decode: sequences in the batch at that rate (prefill: 1).
    #[serde(default = "one")]
    pub batch: u32,
}

fn one() -> u32 {
    1
}

/// A replica's capacity curves at given latency targets (see the module doc).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityProfile {
    /// Where the numbers come from.
    pub source: String,
    /// The TTFT p99 target the prefill curve holds (ms).
    pub ttft_target_ms: f64,
    /// The ITL p99 target the decode curve holds (ms).
    pub itl_target_ms: f64,
    /// Prefill: prompt tokens/s by prompt length, ascending.
    pub prefill: Vec<CapacityPoint>,
    /// Decode: output tokens/s by context length, ascending.
    pub decode: Vec<CapacityPoint>,
}

/// A replica's step-time model and batch limits, the inputs of
/// [`CapacityProfile::from_step_model`].
pub struct StepModel<'a> {
    /// Where the model comes from (copied into the profile's `source`).
    pub source: String,
    /// Time of a prefill step of `tokens` tokens (ms).
    pub prefill_ms: &'a dyn Fn(usize) -> f64,
    /// Time of a decode step at KV utilisation `u` in [0, 1] with `n` sequences (ms).
    pub decode_ms: &'a dyn Fn(f64, usize) -> f64,
    /// KV tokens one replica holds.
    pub kv_tokens: usize,
    /// `worker.max_num_seqs`.
    pub max_num_seqs: usize,
    /// `worker.max_num_batched_tokens` (the prefill chunk).
    pub max_num_batched_tokens: usize,
}

/// Prompt and context lengths the derived curves are tabulated at.
const LENGTHS: [u32; 12] = [
    64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
];

/// Fraction of the KV pool a decode batch may fill.
const KV_FILL: f64 = 0.9;

impl CapacityProfile {
    /// Derive the curves from a step-time model at the given targets (see the module doc).
    pub fn from_step_model(m: &StepModel<'_>, ttft_target_ms: f64, itl_target_ms: f64) -> Self {
        let chunk = m.max_num_batched_tokens.max(1);
        let prefill = LENGTHS
            .iter()
            .map(|&l| {
                let len = l as usize;
                let full = len / chunk;
                let rest = len % chunk;
                let s = full as f64 * (m.prefill_ms)(chunk) + (m.prefill_ms)(rest);
                let rho = max_utilisation(s, ttft_target_ms);
                CapacityPoint {
                    tokens: l,
                    tokens_per_s: if s > 0.0 {
                        len as f64 * 1000.0 / s * rho
                    } else {
                        0.0
                    },
                    batch: 1,
                }
            })
            .collect();
        let decode = LENGTHS
            .iter()
            .map(|&c| {
                let ctx = f64::from(c);
                let kv = m.kv_tokens.max(1) as f64;
                let fits = ((KV_FILL * kv / ctx).floor() as usize).min(m.max_num_seqs);
                // The largest batch whose step holds the ITL target (at least one sequence).
                let mut b = fits.max(1);
                while b > 1 && (m.decode_ms)(b as f64 * ctx / kv, b) > itl_target_ms {
                    b -= 1;
                }
                let step = (m.decode_ms)(b as f64 * ctx / kv, b).max(1e-3);
                CapacityPoint {
                    tokens: c,
                    tokens_per_s: b as f64 * 1000.0 / step,
                    batch: b as u32,
                }
            })
            .collect();
        Self {
            source: format!(
                "derived from {} (max_num_seqs {}, max_num_batched_tokens {}, {} KV tokens)",
                m.source, m.max_num_seqs, m.max_num_batched_tokens, m.kv_tokens
            ),
            ttft_target_ms,
            itl_target_ms,
            prefill,
            decode,
        }
    }

    /// Read a profile file (JSON).
    ///
    /// # Errors
    /// The file cannot be read, is not a profile, or its tables are empty, unsorted or hold
    /// a rate that is not a positive number.
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        let p: Self = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("bad capacity profile {}: {e}", path.display()))?;
        p.check()
            .map_err(|e| anyhow::anyhow!("bad capacity profile {}: {e}", path.display()))?;
        Ok(p)
    }

    /// Check the tables: non-empty, ascending lengths, positive finite rates.
    ///
    /// # Errors
    /// The first table that breaks a rule, named.
    pub fn check(&self) -> Result<(), String> {
        for (name, table) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if table.is_empty() {
                return Err(format!("{name}: no points"));
            }
            if table.windows(2).any(|w| w[0].tokens >= w[1].tokens) {
                return Err(format!("{name}: lengths must be strictly ascending"));
            }
            if table
                .iter()
                .any(|p| !(p.tokens_per_s.is_finite() && p.tokens_per_s > 0.0))
            {
                return Err(format!("{name}: every tokens_per_s must be a number > 0"));
            }
        }
        Ok(())
    }

    /// Prompt tokens/s one replica prefills within the TTFT target, at prompts of `tokens`.
    pub fn prefill_tokens_per_s(&self, tokens: f64) -> f64 {
        interpolate(&self.prefill, tokens)
    }

    /// Output tokens/s one replica decodes within the ITL target, at contexts of `tokens`.
    pub fn decode_tokens_per_s(&self, tokens: f64) -> f64 {
        interpolate(&self.decode, tokens)
    }
}

/// The largest utilisation in (0, 1) at which an M/D/1 queue with service time `s` keeps its
/// p99 response time (service + wait) within `target` (see the module doc); 0.05 when even
/// an idle replica misses the target (the planner then adds replicas up to its bound).
pub fn max_utilisation(s: f64, target: f64) -> f64 {
    let p99 = |rho: f64| {
        let wait = if rho <= 0.01 {
            0.0
        } else {
            s * (100.0 * rho).ln() / (2.0 * (1.0 - rho))
        };
        s + wait
    };
    if s <= 0.0 {
        return 0.95;
    }
    if p99(0.05) > target {
        return 0.05;
    }
    let (mut lo, mut hi) = (0.05f64, 0.95f64);
    if p99(hi) <= target {
        return hi;
    }
    for _ in 0..50 {
        let mid = 0.5 * (lo + hi);
        if p99(mid) <= target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

fn interpolate(table: &[CapacityPoint], x: f64) -> f64 {
    let (Some(first), Some(last)) = (table.first(), table.last()) else {
        return 0.0;
    };
    if x <= f64::from(first.tokens) {
        return first.tokens_per_s;
    }
    if x >= f64::from(last.tokens) {
        return last.tokens_per_s;
    }
    for w in table.windows(2) {
        let (a, b) = (f64::from(w[0].tokens), f64::from(w[1].tokens));
        if x <= b {
            let t = (x - a) / (b - a);
            return w[0].tokens_per_s + t * (w[1].tokens_per_s - w[0].tokens_per_s);
        }
    }
    last.tokens_per_s
}
