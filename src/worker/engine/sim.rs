//! Simulated engine: the real Scheduler and KvEventPublisher (real paged blocks, real KV events,
//! real prefix hits) driving an engine whose forward pass is a timing model, for fleet-scale
//! runs on one machine (`worker.engine = "sim"`, `flotilla up --engine sim --workers N`).
//! [`SimEngine`] is a [`StepEngine`]: the same engine worker runs it.
//!
//! # Timing model
//! A step holds prefill chunks and decode tokens. With `T` the prompt tokens prefilled in the
//! step (uncached tokens: cached prefix blocks are never sent to the engine) and `u` the KV
//! utilisation (blocks referenced by the step's sequences ÷ blocks in the pool, capped at 1; a
//! prefix block shared by several sequences counts once per sequence, since each decode row
//! reads its whole context — the "logical" active KV Dynamo's mocker uses too):
//!
//! ```text
//! prefill_ms(T)   = a·T² + b·T + c + g·Σ Tᵢ·Pᵢ             (only when T > 0)
//! decode_ms(u, n) = max(min_decode_ms, d·u² + e·u + f(n))  (only when the step decodes)
//! step_ms         = (prefill_ms + decode_ms) / speedup
//! ```
//!
//! with `Tᵢ` the new tokens of prefill chunk `i` after `Pᵢ` tokens of context already in the
//! KV (a cached prefix, or earlier chunks), `g` the profile's `prefill_context_ms` (0 in the
//! H100 fit; measured by `flotilla profile` on a CPU, where attention over a long prefix
//! shows), `n` the sequences decoding in the step and `f(n)` the constant `f` of the H100 fit
//! (on a GPU a decode step reads the weights once and each row's KV, so its cost is in `u`),
//! or, when the profile carries measured `decode_points` `[[n, ms], …]` (decode steps of `n`
//! short sequences: on a CPU each row also costs its own matrix-vector work), those points
//! interpolated. Likewise measured `prefill_points` `[[T, ms], …]` replace the prefill
//! quadratic, which cannot follow a CPU kernel's steps between tile sizes. Points are
//! interpolated linearly: the first point's time below it, the last two points' slope
//! beyond them. `flotilla profile` measures both.
//!
//! The default [`SimProfile`] is a published fit of vLLM on one H100 (the one NVIDIA Dynamo's
//! mocker engine ships): `prefill_ms = 4.21e-7·T² + 0.01518·T + 16.5`,
//! `decode_ms = −25.74·u² + 54.01·u + 5.74`, at least 1 ms. `flotilla profile` fits the same
//! forms to the CPU engine of this machine and writes a profile file (`worker.sim_profile`).
//!
//! # KV capacity
//! A profile also says how many tokens of KV the simulated device holds
//! ([`SimProfile::kv_tokens`]); unless `worker.kv_blocks` is set, each sim replica gets
//! `kv_tokens ÷ block_size` blocks, so a simulated H100 fleet is not limited by the CPU
//! engine's 512-block pool. The H100 profile's capacity is Llama-3-8B in bf16 on an 80 GiB
//! H100 under vLLM's default `gpu_memory_utilization = 0.9`: (0.9 × 80 GiB − 16 GiB of weights
//! and activations) ÷ 128 KiB per token (32 layers × K,V × 8 KV heads × 128 × 2 bytes)
//! = 458 752 tokens, 28 672 blocks of 16.
//!
//! # Time
//! Steps shorter than the timer's 1 ms resolution must still cost what the profile says (at
//! `speedup = 1000` an H100 decode step is ~6 µs). The engine keeps a virtual clock: each step
//! ends `step_ms` after the previous step's end (or after now, when the engine sat idle), and
//! it sleeps only while that end is more than [`SLEEP_THRESHOLD`] ahead of the real clock;
//! a step that is due returns at once. The next step starts at that end plus the real time
//! between the wait's return and the next step's arrival (scheduler work, or idleness): a
//! step that returned early or overslept a timer tick is neither gained nor lost, so the mean
//! step time is the profile's, and idle time is never paid back (a step never starts before
//! its work arrived, up to [`CATCH_UP`]).
//!
//! # Tokens
//! Deterministic placeholders: the token at position `p` of sequence `s` is
//! `FIRST_TOKEN + (p·31 + s) mod TOKEN_RANGE`, never an end-of-sequence id in practice
//! (requests that must run to `max_tokens` set `ignore_eos` anyway). Logprobs are 0 (a
//! sampled token's, and an echoed prompt's tokens': each its own only alternative).

use super::{
    EngineError, EngineInfo, PromptScores, SampledToken, StepBatch, StepEngine, StepOutput,
};
use crate::control::planner::{CapacityProfile, StepModel};
use crate::runtime::ids::SeqId;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::time::Instant;

/// The engine sleeps only when its virtual clock is this far ahead of the real one.
pub const SLEEP_THRESHOLD: Duration = Duration::from_millis(1);
/// The most a step may start before its work arrived, paying back a sleep that woke late (a
/// longer delay is a stall of the machine, not the timer).
pub const CATCH_UP: Duration = Duration::from_millis(5);

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
    /// Tokens of KV the simulated device holds per replica (see the module docs); `None`:
    /// the pool is `worker.kv_blocks` or the CPU engine's default.
    #[serde(default)]
    pub kv_tokens: Option<usize>,
    /// Each new prefill token costs this much more per token of context before it (ms;
    /// see the module docs).
    #[serde(default)]
    pub prefill_context_ms: f64,
    /// Measured decode steps of `n` short sequences, `[n, ms]` in increasing `n`: they
    /// replace `decode[2]` when present (see the module docs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decode_points: Vec<(usize, f64)>,
    /// Measured one-sequence prefills, `[tokens, ms]` in increasing `tokens`: interpolated
    /// instead of the quadratic when present (see the module docs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefill_points: Vec<(usize, f64)>,
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
            kv_tokens: Some(H100_LLAMA3_8B_KV_TOKENS),
            prefill_context_ms: 0.0,
            decode_points: Vec::new(),
            prefill_points: Vec::new(),
        }
    }

    /// KV blocks of `block_size` tokens the simulated device holds, if the profile says.
    pub fn kv_blocks(&self, block_size: usize) -> Option<usize> {
        self.kv_tokens.map(|t| (t / block_size.max(1)).max(1))
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
        if let Some(ms) = interpolate(&self.prefill_points, t) {
            return ms.max(0.0);
        }
        let [a, b, c] = self.prefill;
        (a * t * t + b * t + c).max(0.0)
    }

    /// Decode step time at KV utilisation `u` in `[0, 1]` with `n` sequences decoding (ms).
    pub fn decode_ms(&self, u: f64, n: usize) -> f64 {
        let u = u.clamp(0.0, 1.0);
        let [d, e, f] = self.decode;
        let f = interpolate(&self.decode_points, n as f64).unwrap_or(f);
        (d * u * u + e * u + f).max(self.min_decode_ms)
    }

    /// The planner's capacity curves of a replica running this model (times ÷ `speedup`,
    /// as `worker.sim_speedup` divides them) over `kv_tokens` of KV, with the scheduler's
    /// batch limits, at the given TTFT and ITL p99 targets (see
    /// [`CapacityProfile::from_step_model`]).
    pub fn capacity(
        &self,
        speedup: f64,
        kv_tokens: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        ttft_target_ms: f64,
        itl_target_ms: f64,
    ) -> CapacityProfile {
        let speedup = if speedup > 0.0 { speedup } else { 1.0 };
        let m = StepModel {
            source: format!("the sim profile \"{}\" at {speedup}× speed", self.source),
            prefill_ms: &|t| self.prefill_ms(t) / speedup,
            decode_ms: &|u, n| self.decode_ms(u, n) / speedup,
            kv_tokens,
            max_num_seqs,
            max_num_batched_tokens,
        };
        CapacityProfile::from_step_model(&m, ttft_target_ms, itl_target_ms)
    }

    /// Time of one step (ms, before speedup).
    pub fn step_ms(&self, batch: &StepBatch, num_blocks: usize) -> f64 {
        let chunks = || {
            batch
                .seqs
                .iter()
                .filter(|s| !(s.tokens.len() == 1 && s.start_pos > 0 && s.sample))
        };
        let prefill: usize = chunks().map(|s| s.tokens.len()).sum();
        let attention = if self.prefill_context_ms > 0.0 {
            let tp: usize = chunks().map(|s| s.tokens.len() * s.start_pos).sum();
            self.prefill_context_ms * tp as f64
        } else {
            0.0
        };
        let decodes = batch
            .seqs
            .iter()
            .filter(|s| s.tokens.len() == 1 && s.start_pos > 0)
            .count();
        let blocks: usize = batch.seqs.iter().map(|s| s.block_table.len()).sum();
        let u = blocks as f64 / num_blocks.max(1) as f64;
        self.prefill_ms(prefill)
            + attention
            + if decodes > 0 {
                self.decode_ms(u, decodes)
            } else {
                0.0
            }
    }
}

/// Linear interpolation through `points` (increasing `x`) at `x`: the first point's `y` below
/// it, the last two points' slope beyond them; `None` without points.
fn interpolate(points: &[(usize, f64)], x: f64) -> Option<f64> {
    let (&(x0, y0), rest) = points.split_first()?;
    if x <= x0 as f64 || rest.is_empty() {
        return Some(y0);
    }
    let seg = points
        .windows(2)
        .find(|w| x <= w[1].0 as f64)
        .unwrap_or(&points[points.len() - 2..]);
    let ((xa, ya), (xb, yb)) = ((seg[0].0 as f64, seg[0].1), (seg[1].0 as f64, seg[1].1));
    if xb <= xa {
        return Some(yb);
    }
    Some(ya + (yb - ya) * (x - xa) / (xb - xa))
}

/// KV capacity of the H100 profile (tokens): see the module docs.
pub const H100_LLAMA3_8B_KV_TOKENS: usize = 458_752;

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
    clock: VirtualClock,
}

/// When simulated steps end (see the module docs, "Time").
#[derive(Debug, Default, Clone, Copy)]
pub struct VirtualClock {
    /// End of the last step on the virtual timeline.
    end: Option<Instant>,
    /// When the last step's wait returned (real clock).
    returned: Option<Instant>,
}

impl VirtualClock {
    /// Books a step of `length` whose work arrived by `now`; returns when it ends. The step
    /// starts after the last one's end plus the real time between the last wait's return and
    /// `now` (scheduler work or idleness: real time, counted), so a step that returned early
    /// (no sleep) or late (a timer overshoot) is neither gained nor lost on the timeline —
    /// but never more than [`CATCH_UP`] before `now` (a stall of the whole machine is not paid
    /// back).
    pub fn book(&mut self, now: Instant, length: Duration) -> Instant {
        let start = match (self.end, self.returned) {
            (Some(end), Some(returned)) => {
                let start = end + now.saturating_duration_since(returned);
                now.checked_sub(CATCH_UP)
                    .map_or(start, |floor| start.max(floor))
            }
            _ => now,
        };
        let end = start + length;
        self.end = Some(end);
        end
    }

    /// Waits until the step that ends at `end` is due (sleeps only when it is more than
    /// [`SLEEP_THRESHOLD`] away; else yields once, so a free engine still shares the runtime),
    /// and notes when it returned.
    pub async fn wait(&mut self, end: Instant) {
        if end.saturating_duration_since(Instant::now()) > SLEEP_THRESHOLD {
            tokio::time::sleep_until(end).await;
        } else {
            tokio::task::yield_now().await;
        }
        self.returned = Some(Instant::now());
    }

    /// Notes that the last wait returned at `at` (for tests).
    pub fn returned_at(&mut self, at: Instant) {
        self.returned = Some(at);
    }
}

/// Placeholder token at position `pos` of sequence `seq`.
pub fn placeholder(seq: u64, pos: usize) -> u32 {
    FIRST_TOKEN + ((pos as u64 * 31 + seq) % u64::from(TOKEN_RANGE)) as u32
}

/// One step as the model says, with no clock: how long it takes (the profile's time divided
/// by the speed-up) and the tokens it samples. [`SimEngine`] waits that long on its virtual
/// clock; a driver without actors (a test, an offline simulator) advances its own
/// [`ManualClock`](crate::runtime::clock::ManualClock) by it instead.
pub fn model_step(args: &SimEngineArgs, batch: &StepBatch) -> (Duration, StepOutput) {
    let ms = args.profile.step_ms(batch, args.num_blocks) / args.speedup;
    let tokens = batch
        .seqs
        .iter()
        .filter(|q| q.sample)
        .map(|q| {
            let token = placeholder(q.seq_id.0, q.start_pos + q.tokens.len());
            SampledToken {
                seq_id: q.seq_id,
                token,
                logprob: 0.0,
                // A point mass: the token is the only one with any probability.
                top: if q.sampling.top_logprobs > 0 {
                    vec![(token, 0.0)]
                } else {
                    Vec::new()
                },
            }
        })
        .collect();
    // Prompt log-probabilities (echo): the same point mass — each scored prompt token is
    // "certain" (logprob 0), alone among its alternatives.
    let prompt = batch
        .seqs
        .iter()
        .filter(|q| !q.score.is_empty())
        .map(|q| PromptScores {
            seq_id: q.seq_id,
            first: q.start_pos + 1,
            logprobs: q
                .score
                .iter()
                .map(|&t| {
                    let top = if q.sampling.top_logprobs > 0 {
                        vec![(t, 0.0)]
                    } else {
                        Vec::new()
                    };
                    (0.0, top)
                })
                .collect(),
        })
        .collect();
    (step_duration(ms), StepOutput { tokens, prompt })
}

/// Longest modelled step (s): a profile that prices a step beyond it (or below zero, or not
/// at all) is cut to the bound instead of panicking; the step watchdog fires long before.
const MAX_STEP_S: f64 = 1e6;

fn step_duration(ms: f64) -> Duration {
    let s = ms / 1000.0;
    let s = if s.is_finite() {
        s.clamp(0.0, MAX_STEP_S)
    } else {
        0.0
    };
    Duration::from_secs_f64(s)
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
        Ok(Self {
            args,
            clock: VirtualClock::default(),
        })
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
        let (length, output) = model_step(&self.args, &batch);
        let end = self.clock.book(Instant::now(), length);
        self.clock.wait(end).await;
        Ok(output)
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
        assert!((p.decode_ms(0.5, 8) - (-25.74 * 0.25 + 54.01 * 0.5 + 5.74)).abs() < 1e-9);
        assert!(p.decode_ms(0.0, 1) >= 1.0);
        // Monotone where it matters: more tokens take longer.
        assert!(p.prefill_ms(4096) > p.prefill_ms(512));
    }

    /// A measured CPU profile: decode steps follow their measured batch points (plus the KV
    /// term), prefills their measured points (flat below the first, the last slope beyond).
    #[test]
    fn a_measured_profile_prices_each_decoding_sequence_and_follows_its_points() {
        let p: SimProfile = serde_json::from_str(
            r#"{"source":"cpu","prefill":[0,1,0],"decode":[0,10,99],"min_decode_ms":5,
                "decode_points":[[1,9],[2,12],[4,17],[8,26]],
                "prefill_points":[[16,40],[64,130],[128,560]]}"#,
        )
        .unwrap();
        assert!((p.decode_ms(0.5, 1) - 14.0).abs() < 1e-9);
        assert!((p.decode_ms(0.5, 3) - 19.5).abs() < 1e-9);
        assert!((p.decode_ms(0.5, 10) - 35.5).abs() < 1e-9);
        assert_eq!(p.prefill_ms(0), 0.0);
        assert_eq!(p.prefill_ms(4), 40.0);
        assert!((p.prefill_ms(40) - 85.0).abs() < 1e-9);
        assert!((p.prefill_ms(96) - 345.0).abs() < 1e-9);
        assert!((p.prefill_ms(192) - 990.0).abs() < 1e-9);
        // Round trip: the fields survive a write and a read.
        let back: SimProfile = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        // Without points or a batch term: the quadratic and u alone, as before.
        let h = SimProfile::h100_vllm();
        assert_eq!(h.decode_ms(0.3, 1), h.decode_ms(0.3, 64));
        assert!(
            !serde_json::to_string(&h)
                .unwrap()
                .contains("prefill_points")
        );
    }

    #[test]
    fn the_h100_profile_holds_an_h100_pool() {
        let p = SimProfile::h100_vllm();
        assert_eq!(p.kv_blocks(16), Some(28_672));
        assert_eq!(p.kv_blocks(64), Some(7_168));
        let old: SimProfile = serde_json::from_str(
            r#"{"source":"x","prefill":[0,1,2],"decode":[0,0,1],"min_decode_ms":1}"#,
        )
        .expect("a profile file without kv_tokens still loads");
        assert_eq!(old.kv_blocks(16), None);
    }

    #[test]
    fn the_virtual_clock_pays_back_overshoot_but_never_idle_time() {
        let t0 = Instant::now();
        let us = Duration::from_micros;
        let mut c = VirtualClock::default();
        assert_eq!(
            c.book(t0, us(100)),
            t0 + us(100),
            "the first step starts now"
        );
        // It returned early (a yield) and 10 µs of scheduler work followed: the next step
        // starts at the last one's end plus those 10 µs.
        c.returned_at(t0 + us(50));
        assert_eq!(c.book(t0 + us(60), us(100)), t0 + us(210));
        // A sleep overshot by 890 µs, and the next step is booked at once: it starts at the
        // last end, so the overshoot is paid back.
        c.returned_at(t0 + us(1_100));
        assert_eq!(c.book(t0 + us(1_100), us(100)), t0 + us(310));
        // Idle 3 ms after returning on time: idleness is real time, not paid back.
        c.returned_at(t0 + us(310));
        assert_eq!(c.book(t0 + us(3_310), us(100)), t0 + us(3_410));
        // A machine stall of 20 ms: at most CATCH_UP is paid back.
        c.returned_at(t0 + us(23_410));
        let now = t0 + us(23_410);
        assert_eq!(c.book(now, us(100)), now - CATCH_UP + us(100));
    }

    #[tokio::test(start_paused = true)]
    async fn sub_millisecond_steps_cost_what_the_profile_says() {
        // Tokio's clock is paused: it moves only when every task waits on a timer, by what the
        // timer wheel (1 ms ticks) says — the granularity that made each sim step cost ≥ 1 ms.
        let step = Duration::from_micros(20);
        // Control: one plain sleep per step pays a whole tick each time.
        let start = Instant::now();
        for _ in 0..500 {
            tokio::time::sleep(step).await;
        }
        assert!(
            start.elapsed() >= Duration::from_millis(500),
            "{:?}",
            start.elapsed()
        );
        // The virtual clock: 500 steps of 20 µs cost their 10 ms (plus at most one tick).
        let mut c = VirtualClock::default();
        let start = Instant::now();
        for _ in 0..500 {
            let end = c.book(Instant::now(), step);
            c.wait(end).await;
        }
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(9), "{took:?}");
        assert!(took <= Duration::from_millis(12), "{took:?}");
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
