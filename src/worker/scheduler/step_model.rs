//! [`StepTimeModel`]: how long an engine step takes, as a function of its shape, learned online
//! from the scheduler's own measured steps. Stall-free batching (Sarathi-Serve, Agrawal et
//! al., OSDI 2024) uses it to size prefill chunks so that a step holding decode rows stays
//! within `scheduler.max_decode_stall_ms`. Pure: plain numbers in, plain numbers out.
//!
//! # The model
//! ```text
//! step_ms = base_ms + per_token_ms · tokens + per_kpair_ms · pairs / 1000
//! ```
//! - `tokens`: every token the step runs (one per decode row, plus the prefill chunks) — the
//!   weight matrices' work, linear in the batch's rows.
//! - `pairs`: the (query, key) pairs attention visits: a chunk of `L` tokens at positions
//!   `s..s + L` attends `L·s + L(L+1)/2` keys (a decode row at position `s`: `s + 1`).
//! - `base_ms`: what a step costs regardless (reading every weight once, the per-layer
//!   fork-joins, the actor round trip).
//!
//! This is the shape of the CPU engine's measured profile (`docs/benchmarks.md`, `flotilla
//! profile`): one-sequence prefills fit `6.5e-4·T² + 0.68·T + 33` ms, where the `T²` term is
//! attention over the `T²/2` pairs of a `T`-token prompt.
//!
//! # The fit
//! Samples are kept per bucket of token count (powers of two: 1, 2–3, 4–7, …), the last
//! [`BUCKET_CAP`] of each, so that the many decode-only steps do not push the rarer prefill
//! steps out of memory, and recent samples replace old ones (a machine that got busier is
//! followed). Each new sample refits by ordinary least squares (3×3 normal equations), then
//! once more without the samples whose relative residual is far from the others' (more than
//! `3 × 1.4826 × MAD` and more than 25 %: a step that shared its cores with a burst of other
//! work). Coefficients are never negative: when the attention term comes out negative or is
//! not identified (pairs in proportion to tokens), it is dropped (`base + per_token` only);
//! when `per_token_ms` is not positive either, there is no fit.
//!
//! The model is **ready** once it holds [`MIN_SAMPLES`] samples in at least [`MIN_BUCKETS`]
//! token buckets (decode-only steps alone say nothing about a prefill chunk's cost) and has a
//! fit. Until then the scheduler uses its token budget alone. The caller keeps injected
//! delays (chaos `slow`, `hang`) out of the samples.

use std::collections::VecDeque;

/// Samples kept per token bucket.
pub const BUCKET_CAP: usize = 32;
/// Samples needed before the model predicts.
pub const MIN_SAMPLES: usize = 16;
/// Distinct token buckets needed before the model predicts.
pub const MIN_BUCKETS: usize = 3;
/// Buckets: tokens in `[2^k, 2^(k+1))`; the last one takes everything above.
const BUCKETS: usize = 16;
/// Relative residuals within this are never outliers.
const MIN_OUTLIER_REL: f64 = 0.25;

/// What a step's time depends on (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Tokens run in the step.
    pub tokens: usize,
    /// Attention (query, key) pairs.
    pub pairs: u64,
}

impl StepShape {
    /// The shape of a step of chunks `(start position, tokens)`.
    pub fn of(chunks: impl IntoIterator<Item = (usize, usize)>) -> Self {
        let mut s = Self::default();
        for (start, len) in chunks {
            s.add(start, len);
        }
        s
    }

    /// Adds a chunk of `len` tokens at positions `start..start + len`.
    pub fn add(&mut self, start: usize, len: usize) {
        *self = self.with(start, len);
    }

    /// This shape plus a chunk of `len` tokens at `start..start + len`.
    pub fn with(self, start: usize, len: usize) -> Self {
        let (s, l) = (start as u64, len as u64);
        Self {
            tokens: self.tokens + len,
            pairs: self.pairs + l * s + l * (l + 1) / 2,
        }
    }
}

/// A fitted step-time model (ms); all coefficients are `>= 0`, `per_token_ms > 0`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Cost of any step.
    pub base_ms: f64,
    /// Cost per token run.
    pub per_token_ms: f64,
    /// Cost per thousand attention pairs.
    pub per_kpair_ms: f64,
}

impl StepCost {
    /// Predicted duration of a step of `shape` (ms).
    pub fn predict_ms(&self, shape: StepShape) -> f64 {
        self.base_ms
            + self.per_token_ms * shape.tokens as f64
            + self.per_kpair_ms * shape.pairs as f64 / 1000.0
    }

    /// Predicted time to prefill `queued` prompt tokens at most `budget` tokens per step (ms):
    /// `⌈queued / budget⌉` steps, each predicted as one fresh chunk of `budget` tokens (the
    /// last of the rest). What a request arriving now waits before its own prefill is done
    /// under first-come-first-served admission; it leaves out the decode rows sharing those
    /// steps and the attention over earlier chunks of long prompts, so it errs low.
    pub fn drain_ms(&self, queued: usize, budget: usize) -> f64 {
        if queued == 0 || budget == 0 {
            return 0.0;
        }
        let full = queued / budget;
        let rest = queued % budget;
        let mut ms = full as f64 * self.predict_ms(StepShape::of([(0, budget)]));
        if rest > 0 {
            ms += self.predict_ms(StepShape::of([(0, rest)]));
        }
        ms
    }

    /// The most tokens, up to `max_len`, of a chunk at `start` that a step of shape `base`
    /// can take while its predicted time stays within `limit_ms` (0 when not even one fits).
    pub fn max_chunk(&self, base: StepShape, start: usize, max_len: usize, limit_ms: f64) -> usize {
        let fits = |len: usize| self.predict_ms(base.with(start, len)) <= limit_ms;
        if fits(max_len) {
            return max_len;
        }
        // Monotone in `len` (coefficients are non-negative): the largest fitting length.
        let (mut lo, mut hi) = (0, max_len); // lo == 0 or fits(lo); !fits(hi)
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    shape: StepShape,
    ms: f64,
}

impl Sample {
    fn features(&self) -> [f64; 3] {
        [
            1.0,
            self.shape.tokens as f64,
            self.shape.pairs as f64 / 1000.0,
        ]
    }
}

/// The online step-time model (see the module doc).
#[derive(Debug, Clone)]
pub struct StepTimeModel {
    buckets: Vec<VecDeque<Sample>>,
    fit: Option<StepCost>,
}

impl Default for StepTimeModel {
    fn default() -> Self {
        Self::new()
    }
}

impl StepTimeModel {
    /// A model with no samples.
    pub fn new() -> Self {
        Self {
            buckets: vec![VecDeque::new(); BUCKETS],
            fit: None,
        }
    }

    /// Records that a step of `shape` took `ms` of engine time, and refits. Empty steps and
    /// non-finite or negative times are ignored.
    pub fn observe(&mut self, shape: StepShape, ms: f64) {
        if shape.tokens == 0 || !ms.is_finite() || ms < 0.0 {
            return;
        }
        let b = (usize::BITS - 1 - shape.tokens.leading_zeros()) as usize;
        let bucket = &mut self.buckets[b.min(BUCKETS - 1)];
        if bucket.len() == BUCKET_CAP {
            bucket.pop_front();
        }
        bucket.push_back(Sample { shape, ms });
        self.fit = self.refit();
    }

    /// Samples held.
    pub fn samples(&self) -> usize {
        self.buckets.iter().map(VecDeque::len).sum()
    }

    /// The fit, once the model is ready (module doc).
    pub fn cost(&self) -> Option<StepCost> {
        self.fit
    }

    /// Predicted duration of a step of `shape` (ms), once ready.
    pub fn predict_ms(&self, shape: StepShape) -> Option<f64> {
        self.fit.map(|c| c.predict_ms(shape))
    }

    fn refit(&self) -> Option<StepCost> {
        let filled = self.buckets.iter().filter(|b| !b.is_empty()).count();
        if self.samples() < MIN_SAMPLES || filled < MIN_BUCKETS {
            return None;
        }
        let all: Vec<Sample> = self.buckets.iter().flatten().copied().collect();
        let first = fit(&all)?;
        // Relative residuals; drop the ones far from the rest (robust scale: MAD).
        let rel: Vec<f64> = all
            .iter()
            .map(|s| {
                let p = first.predict_ms(s.shape).max(1e-3);
                (s.ms - p) / p
            })
            .collect();
        let med = median(rel.clone());
        let mad = median(rel.iter().map(|r| (r - med).abs()).collect());
        let bound = (3.0 * 1.4826 * mad).max(MIN_OUTLIER_REL);
        let kept: Vec<Sample> = all
            .iter()
            .zip(&rel)
            .filter(|(_, r)| (*r - med).abs() <= bound)
            .map(|(s, _)| *s)
            .collect();
        if kept.len() == all.len() {
            return Some(first);
        }
        fit(&kept).or(Some(first))
    }
}

/// The median, by selection (O(n): this runs at every step of every replica).
fn median(mut v: Vec<f64>) -> f64 {
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    let (below, mid, _) = v.select_nth_unstable_by(n / 2, f64::total_cmp);
    let hi = *mid;
    if n % 2 == 1 {
        hi
    } else {
        let lo = below.iter().copied().max_by(f64::total_cmp).unwrap_or(hi);
        (lo + hi) / 2.0
    }
}

/// Least squares with all three terms, else without the attention term (module doc).
fn fit(samples: &[Sample]) -> Option<StepCost> {
    let ok = |c: &StepCost| c.per_token_ms > 0.0 && c.base_ms >= 0.0 && c.per_kpair_ms >= 0.0;
    if let Some([a, b, c]) = least_squares::<3>(samples) {
        let cost = StepCost {
            base_ms: a,
            per_token_ms: b,
            per_kpair_ms: c,
        };
        if ok(&cost) {
            return Some(cost);
        }
    }
    let [a, b] = least_squares::<2>(samples)?;
    let cost = StepCost {
        base_ms: a.max(0.0),
        per_token_ms: b,
        per_kpair_ms: 0.0,
    };
    ok(&cost).then_some(cost)
}

/// Ordinary least squares on the first `N` features (normal equations, Gaussian elimination
/// with partial pivoting); `None` when they are not identified.
#[allow(clippy::needless_range_loop)] // index notation, as the algebra is written
fn least_squares<const N: usize>(samples: &[Sample]) -> Option<[f64; N]> {
    if samples.len() < N {
        return None;
    }
    let mut m = [[0.0f64; N]; N];
    let mut v = [0.0f64; N];
    for s in samples {
        let x = s.features();
        for i in 0..N {
            for j in 0..N {
                m[i][j] += x[i] * x[j];
            }
            v[i] += x[i] * s.ms;
        }
    }
    // Scale each row and column by the diagonal so that the pivot test is unit-free.
    let d: Vec<f64> = (0..N).map(|i| m[i][i].sqrt()).collect();
    if d.iter().any(|&x| x <= 0.0 || !x.is_finite()) {
        return None;
    }
    for i in 0..N {
        for j in 0..N {
            m[i][j] /= d[i] * d[j];
        }
        v[i] /= d[i];
    }
    for col in 0..N {
        let p = (col..N).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[p][col].abs() < 1e-9 {
            return None;
        }
        m.swap(col, p);
        v.swap(col, p);
        for r in col + 1..N {
            let f = m[r][col] / m[col][col];
            for k in col..N {
                m[r][k] -= f * m[col][k];
            }
            v[r] -= f * v[col];
        }
    }
    let mut x = [0.0f64; N];
    for i in (0..N).rev() {
        let s: f64 = (i + 1..N).map(|k| m[i][k] * x[k]).sum();
        x[i] = (v[i] - s) / m[i][i];
    }
    for i in 0..N {
        x[i] /= d[i];
    }
    x.iter().all(|c| c.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_by_selection_is_the_sorted_median() {
        let sorted_median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let n = v.len();
            if n % 2 == 1 {
                v[n / 2]
            } else {
                (v[n / 2 - 1] + v[n / 2]) / 2.0
            }
        };
        let mut x = 0x9e37_79b9_u64;
        for n in 1..40 {
            let v: Vec<f64> = (0..n)
                .map(|_| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    ((x >> 40) % 17) as f64 - 8.0
                })
                .collect();
            assert_eq!(median(v.clone()), sorted_median(v), "n = {n}");
        }
        assert_eq!(median(vec![]), 0.0);
    }

    const TRUE: StepCost = StepCost {
        base_ms: 12.0,
        per_token_ms: 0.7,
        per_kpair_ms: 1.3,
    };

    /// Decode steps of 1–8 rows at contexts up to 400, and prefill chunks of 16–512 tokens
    /// beside them: the shapes a scheduler produces.
    fn shapes() -> Vec<StepShape> {
        let mut v = Vec::new();
        for i in 0..200usize {
            let rows = 1 + i % 8;
            let mut s = StepShape::default();
            for r in 0..rows {
                s.add(20 + (i * 7 + r * 31) % 400, 1);
            }
            if i % 3 == 0 {
                s.add((i * 13) % 256, 16 << (i % 6)); // chunks of 16 … 512 tokens
            }
            v.push(s);
        }
        v
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn draining_a_queue_costs_its_full_steps_and_the_rest() {
        let c = StepCost {
            base_ms: 10.0,
            per_token_ms: 0.1,
            per_kpair_ms: 0.0,
        };
        assert_eq!(c.drain_ms(0, 512), 0.0);
        assert_eq!(c.drain_ms(100, 0), 0.0);
        // 1 200 tokens at 512 a step: two full steps (61.2 ms each) and one of 176 (27.6 ms).
        assert!(close(c.drain_ms(1_200, 512), 2.0 * 61.2 + 27.6, 1e-9));
        // It grows with the queue and never falls below one step's base per step.
        assert!(c.drain_ms(5_000, 512) > c.drain_ms(4_000, 512));
        assert!(c.drain_ms(5_120, 512) >= 10.0 * 10.0);
    }

    #[test]
    fn shapes_count_tokens_and_attention_pairs() {
        let s = StepShape::of([(0, 4), (10, 1)]);
        assert_eq!(s.tokens, 5);
        // 4 tokens from 0: 1+2+3+4 = 10 keys; a decode at 10 attends 11.
        assert_eq!(s.pairs, 10 + 11);
        assert_eq!(StepShape::default().with(3, 2).pairs, 2 * 3 + 3);
    }

    #[test]
    fn the_fit_recovers_known_coefficients() {
        let mut m = StepTimeModel::new();
        // Deterministic ±3 % noise.
        for (i, s) in shapes().into_iter().enumerate() {
            let noise = 1.0 + 0.03 * ((i * 37 % 11) as f64 / 5.0 - 1.0);
            m.observe(s, TRUE.predict_ms(s) * noise);
        }
        let c = m.cost().expect("ready");
        assert!(close(c.base_ms, TRUE.base_ms, 1.5), "{c:?}");
        assert!(close(c.per_token_ms, TRUE.per_token_ms, 0.05), "{c:?}");
        assert!(close(c.per_kpair_ms, TRUE.per_kpair_ms, 0.3), "{c:?}");
        let exact = StepTimeModel::new();
        assert!(exact.cost().is_none());
    }

    #[test]
    fn outliers_are_ignored() {
        let mut clean = StepTimeModel::new();
        let mut noisy = StepTimeModel::new();
        for (i, s) in shapes().into_iter().enumerate() {
            let t = TRUE.predict_ms(s);
            clean.observe(s, t);
            // One step in ten shares its cores with something else: 5× slower.
            noisy.observe(s, if i % 10 == 7 { 5.0 * t } else { t });
        }
        let (c, n) = (clean.cost().expect("ready"), noisy.cost().expect("ready"));
        let probe = StepShape::of([(100, 1), (200, 1), (300, 1), (0, 128)]);
        let (pc, pn) = (c.predict_ms(probe), n.predict_ms(probe));
        assert!(close(pc, TRUE.predict_ms(probe), 0.01), "{c:?}");
        assert!((pn - pc).abs() / pc < 0.05, "{pn} vs {pc}: {n:?}");
    }

    #[test]
    fn not_ready_without_enough_samples_or_spread() {
        let mut m = StepTimeModel::new();
        // Decode-only steps of 3–4 rows: two buckets, whatever their number.
        for i in 0..100 {
            let s = StepShape::of((0..3 + i % 2).map(|r| (50 + r, 1)));
            m.observe(s, TRUE.predict_ms(s));
        }
        assert!(
            m.cost().is_none(),
            "decode steps alone do not predict a prefill"
        );
        let mut m = StepTimeModel::new();
        for s in shapes().into_iter().take(MIN_SAMPLES - 1) {
            m.observe(s, TRUE.predict_ms(s));
        }
        assert!(m.cost().is_none());
        let s = shapes()[MIN_SAMPLES];
        m.observe(s, TRUE.predict_ms(s));
        assert!(m.cost().is_some());
        // Garbage is ignored.
        let before = m.samples();
        m.observe(StepShape::default(), 5.0);
        m.observe(s, f64::NAN);
        m.observe(s, -1.0);
        assert_eq!(m.samples(), before);
    }

    #[test]
    fn without_an_attention_signal_the_fit_is_linear() {
        // Pairs exactly proportional to tokens (every chunk a decode at the same position):
        // the attention term is not identified and is dropped.
        let mut m = StepTimeModel::new();
        for n in 1..=64usize {
            let s = StepShape::of((0..n).map(|_| (9, 1)));
            m.observe(s, 10.0 + 0.5 * n as f64);
        }
        let c = m.cost().expect("ready");
        assert_eq!(c.per_kpair_ms, 0.0);
        assert!(
            close(c.base_ms, 10.0, 1e-6) && close(c.per_token_ms, 0.5, 1e-6),
            "{c:?}"
        );
    }

    #[test]
    fn recent_samples_replace_old_ones() {
        let mut m = StepTimeModel::new();
        for s in shapes() {
            m.observe(s, TRUE.predict_ms(s));
        }
        // The machine gets twice as slow.
        for _ in 0..BUCKET_CAP {
            for s in shapes() {
                m.observe(s, 2.0 * TRUE.predict_ms(s));
            }
        }
        let probe = StepShape::of([(0, 64)]);
        let p = m.predict_ms(probe).expect("ready");
        assert!(close(p, 2.0 * TRUE.predict_ms(probe), 0.5), "{p}");
    }

    #[test]
    fn max_chunk_is_the_largest_that_fits() {
        let c = StepCost {
            base_ms: 10.0,
            per_token_ms: 1.0,
            per_kpair_ms: 0.0,
        };
        let base = StepShape::of([(100, 1), (100, 1)]); // 12 ms
        assert_eq!(c.max_chunk(base, 0, 1000, 50.0), 38);
        assert_eq!(c.max_chunk(base, 0, 20, 50.0), 20, "the whole rest fits");
        assert_eq!(c.max_chunk(base, 0, 1000, 12.5), 0, "not even one token");
        assert_eq!(c.max_chunk(base, 0, 1000, 13.0), 1);
        // Attention makes a chunk later in the prompt dearer.
        let a = StepCost {
            per_kpair_ms: 1.0,
            ..c
        };
        let early = a.max_chunk(base, 0, 1000, 100.0);
        let late = a.max_chunk(base, 2000, 1000, 100.0);
        assert!(late < early, "{late} < {early}");
        for (start, got) in [(0, early), (2000, late)] {
            assert!(a.predict_ms(base.with(start, got)) <= 100.0);
            assert!(a.predict_ms(base.with(start, got + 1)) > 100.0);
        }
    }
}
