//! `flotilla profile`: measure this machine's CPU engine and write a timing profile for the
//! simulated engine (`worker.sim_profile`), in the same form as the built-in H100 profile
//! (`worker/engine/sim.rs`):
//!
//! ```text
//! prefill_ms(T)   = a·T² + b·T + c         fitted to one-sequence prefills of T tokens (and
//!                                          the measured points, `prefill_points`, which the
//!                                          simulated engine interpolates)
//!                   + g·T·P                g: 64-token chunks after P = 0…384 tokens of
//!                                          context (`prefill_context_ms`), the slope over P ÷ 64
//! decode_ms(u, n) = d·u² + e·u + f(n)      f(n): decode steps of n = 1, 2, 4, 8 sequences
//!                                          of short contexts (u ≈ 0; `decode_points`,
//!                                          interpolated); d, e: fitted (through the origin)
//!                                          to steps of `--batch` sequences whose contexts
//!                                          fill a fraction u of the KV pool, less f(batch)
//! ```
//!
//! and, from the fit, the planner's capacity curves (`--capacity-out`, see
//! [`crate::control::planner::capacity`]).
//!
//! Each point is the median of `--repeats` timed steps (what a live replica's steps take on
//! this machine, others' work included, which the simulator is compared against); the
//! quadratics are ordinary least squares.

use crate::runtime::ids::{BlockId, SeqId};
use crate::worker::engine::sim::SimProfile;
use crate::worker::engine::{Engine, EngineConfig, SamplingParams, StepBatch, StepSeq};
use std::path::PathBuf;
use std::time::Instant;

/// Options of `flotilla profile`.
#[derive(clap::Args, Debug, Clone)]
pub struct ProfileArgs {
    /// Model file (default: `FLOTILLA_MODEL`, else the default model).
    #[arg(long, env = "FLOTILLA_MODEL")]
    pub model: Option<PathBuf>,
    /// Where to write the profile (JSON).
    #[arg(long, default_value = "sim-profile-cpu.json")]
    pub out: PathBuf,
    /// KV blocks of the profiled pool (16 tokens each).
    #[arg(long, default_value_t = 256)]
    pub num_blocks: usize,
    /// Sequences in the decode batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Timed steps per point (their median is kept).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Where to write the planner's capacity curves (`planner.capacity_profile`): one
    /// replica's prompt tokens/s within `--ttft-target-ms` and output tokens/s within
    /// `--itl-target-ms`, derived from the fitted step times with the default batch limits
    /// (`worker.max_num_seqs`, `worker.max_num_batched_tokens`).
    #[arg(long, default_value = "capacity-cpu.json")]
    pub capacity_out: PathBuf,
    /// TTFT p99 target of the capacity curves (ms).
    #[arg(long, default_value_t = 500.0)]
    pub ttft_target_ms: f64,
    /// ITL p99 target of the capacity curves (ms).
    #[arg(long, default_value_t = 50.0)]
    pub itl_target_ms: f64,
}

const BLOCK: usize = 16;

fn seq(id: u64, tokens: Vec<u32>, start: usize, table: &[BlockId]) -> StepSeq {
    StepSeq {
        seq_id: SeqId(id),
        tokens,
        start_pos: start,
        block_table: table.to_vec(),
        sampling: SamplingParams::default(),
        sample: true,
        score: Vec::new(),
    }
}

fn timed(engine: &mut Engine, batch: &StepBatch) -> anyhow::Result<f64> {
    let t = Instant::now();
    engine.step(batch)?;
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}

/// The median of `v` (the mean of the middle two for an even count; infinite when empty).
fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::INFINITY;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// The least-squares slope of `y` over `x` (0 with fewer than two distinct `x`).
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx > 0.0 { sxy / sxx } else { 0.0 }
}

/// Least squares fit of `y = p0·x² + p1·x` (no constant term).
///
/// # Errors
/// Fewer than 2 points, or points that do not determine the fit (all at one `x`, or at 0).
pub fn fit_quadratic_through_origin(points: &[(f64, f64)]) -> anyhow::Result<[f64; 2]> {
    anyhow::ensure!(points.len() >= 2, "the fit needs at least 2 points");
    // Normal equations over rows [x², x].
    let (mut a, mut b, mut c, mut p, mut q) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, y) in points {
        a += x.powi(4);
        b += x.powi(3);
        c += x * x;
        p += x * x * y;
        q += x * y;
    }
    let det = a * c - b * b;
    anyhow::ensure!(det.abs() > 1e-12, "degenerate points");
    Ok([(p * c - b * q) / det, (a * q - b * p) / det])
}

/// Ordinary least squares fit of `y = p0·x² + p1·x + p2`.
///
/// # Errors
/// Fewer than 3 points, or points that do not determine a quadratic (all at
/// one or two distinct `x`).
pub fn fit_quadratic(points: &[(f64, f64)]) -> anyhow::Result<[f64; 3]> {
    anyhow::ensure!(points.len() >= 3, "a quadratic needs at least 3 points");
    // Normal equations: (XᵀX) p = Xᵀy with rows [x², x, 1].
    let mut m = [[0.0f64; 4]; 3];
    for &(x, y) in points {
        let row = [x * x, x, 1.0];
        for i in 0..3 {
            for j in 0..3 {
                m[i][j] += row[i] * row[j];
            }
            m[i][3] += row[i] * y;
        }
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..3 {
        let pivot = (col..3)
            .max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))
            .unwrap_or(col);
        m.swap(col, pivot);
        anyhow::ensure!(m[col][col].abs() > 1e-12, "degenerate points");
        let pivot_row = m[col];
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row.iter_mut().zip(pivot_row.iter()).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    Ok([m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]])
}

/// Measure and write the profile; prints the points and the fit.
///
/// # Errors
/// The model cannot be found or loaded, an engine step fails, `--num-blocks` is
/// too small for `--batch`, or the profile cannot be written.
pub fn run(a: ProfileArgs) -> anyhow::Result<()> {
    let path = crate::model::resolve_model_path(a.model.as_deref())?;
    let model = crate::model::load_model(&path)?;
    let mut engine = Engine::new(
        model.weights.clone(),
        EngineConfig {
            num_blocks: a.num_blocks,
            block_size: BLOCK,
            ..EngineConfig::default()
        },
    )?;
    let blocks: Vec<BlockId> = (0..a.num_blocks as u32).map(BlockId).collect();
    let capacity = a.num_blocks * BLOCK;
    let token = |i: usize| 100 + (i % 5000) as u32;

    // Prefill: one sequence of T tokens from position 0.
    let mut prefill = Vec::new();
    let mut next_id = 1u64;
    for t in [1usize, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512] {
        if t + 1 > capacity {
            break;
        }
        let mut times = Vec::new();
        for _ in 0..a.repeats.max(1) {
            let s = seq(
                next_id,
                (0..t).map(token).collect(),
                0,
                &blocks[..t.div_ceil(BLOCK) + 1],
            );
            times.push(timed(&mut engine, &StepBatch { seqs: vec![s] })?);
            engine.release(SeqId(next_id));
            next_id += 1;
        }
        let best = median(times);
        println!("prefill T={t:>4}: {best:8.2} ms");
        prefill.push((t as f64, best));
    }

    // Prefill after a cached prefix: 64-token chunks after P tokens of context (prefilled
    // untimed); the slope of time over P, per chunk token.
    const CHUNK: usize = 64;
    let mut by_context = Vec::new();
    for p in [0usize, 128, 256, 384] {
        if p + CHUNK + 1 > capacity {
            break;
        }
        let mut times = Vec::new();
        for _ in 0..a.repeats.max(1) {
            let table = &blocks[..(p + CHUNK).div_ceil(BLOCK) + 1];
            if p > 0 {
                let s = seq(next_id, (0..p).map(token).collect(), 0, table);
                engine.step(&StepBatch { seqs: vec![s] })?;
            }
            let s = seq(next_id, (p..p + CHUNK).map(token).collect(), p, table);
            times.push(timed(&mut engine, &StepBatch { seqs: vec![s] })?);
            engine.release(SeqId(next_id));
            next_id += 1;
        }
        let best = median(times);
        println!("prefill of {CHUNK} tokens after {p:>3}: {best:8.2} ms");
        by_context.push((p as f64, best));
    }
    let prefill_context_ms = (slope(&by_context) / CHUNK as f64).max(0.0);

    // Decode, the batch term: n sequences of 32-token contexts (prefilled untimed), timed
    // single-token steps; the slope of time over n.
    const SHORT: usize = 32;
    let mut by_batch = Vec::new();
    for n in [1usize, 2, 4, 8] {
        if n * (SHORT.div_ceil(BLOCK) + a.repeats.max(1).div_ceil(BLOCK) + 1) > a.num_blocks {
            break;
        }
        let per = a.num_blocks / n;
        let ids: Vec<u64> = (0..n as u64)
            .map(|i| 2_000_000 + 100 * n as u64 + i)
            .collect();
        let table = |i: usize| &blocks[i * per..(i + 1) * per];
        let seqs = (0..n)
            .map(|i| seq(ids[i], (0..SHORT).map(token).collect(), 0, table(i)))
            .collect();
        engine.step(&StepBatch { seqs })?;
        let mut times = Vec::new();
        for r in 0..a.repeats.max(1) {
            let pos = SHORT + r;
            let seqs = (0..n)
                .map(|i| seq(ids[i], vec![token(pos)], pos, table(i)))
                .collect();
            times.push(timed(&mut engine, &StepBatch { seqs })?);
        }
        for &id in &ids {
            engine.release(SeqId(id));
        }
        let best = median(times);
        println!("decode n={n} (contexts of {SHORT} tokens): {best:8.2} ms");
        by_batch.push((n as f64, best));
    }
    let decode_points: Vec<(usize, f64)> =
        by_batch.iter().map(|&(n, ms)| (n as usize, ms)).collect();
    let at_batch = |n: usize| {
        let probe = SimProfile {
            decode: [0.0, 0.0, 0.0],
            min_decode_ms: 0.0,
            decode_points: decode_points.clone(),
            ..SimProfile::default()
        };
        probe.decode_ms(0.0, n)
    };
    let base = at_batch(a.batch);

    // Decode, the KV term: `batch` sequences grown (untimed) until they fill a fraction u of
    // the pool, then timed single-token steps.
    let per_seq_blocks = a.num_blocks / a.batch.max(1);
    anyhow::ensure!(per_seq_blocks >= 2, "--num-blocks too small for --batch");
    let tables: Vec<&[BlockId]> = (0..a.batch)
        .map(|i| &blocks[i * per_seq_blocks..(i + 1) * per_seq_blocks])
        .collect();
    let ids: Vec<u64> = (0..a.batch as u64).map(|i| 1_000_000 + i).collect();
    let mut len = 0usize;
    let mut decode = Vec::new();
    for u in [0.1f64, 0.3, 0.5, 0.7, 0.9] {
        let target = ((u * (per_seq_blocks * BLOCK) as f64) as usize).max(len + 1);
        // Grow every sequence to `target` tokens in chunks of at most 512.
        while len < target {
            let n = (target - len).min(512);
            let seqs = (0..a.batch)
                .map(|i| seq(ids[i], (len..len + n).map(token).collect(), len, tables[i]))
                .collect();
            engine.step(&StepBatch { seqs })?;
            len += n;
        }
        let mut times = Vec::new();
        for _ in 0..a.repeats.max(1) {
            if len + 1 >= per_seq_blocks * BLOCK {
                break;
            }
            let seqs = (0..a.batch)
                .map(|i| seq(ids[i], vec![token(len)], len, tables[i]))
                .collect();
            times.push(timed(&mut engine, &StepBatch { seqs })?);
            len += 1;
        }
        let best = median(times);
        let used = (a.batch * len) as f64 / capacity as f64;
        println!("decode u={used:.2} (batch {}): {best:8.2} ms", a.batch);
        decode.push((used, best - base));
    }

    let profile = SimProfile {
        source: format!(
            "flotilla profile: CPU engine on this machine ({} threads), model {}, pool {} blocks, decode batch {}",
            rayon::current_num_threads(),
            path.display(),
            a.num_blocks,
            a.batch
        ),
        prefill: fit_quadratic(&prefill)?,
        decode: {
            let [d, e] = fit_quadratic_through_origin(&decode)?;
            [d, e, at_batch(1)]
        },
        min_decode_ms: by_batch
            .iter()
            .map(|p| p.1)
            .fold(f64::INFINITY, f64::min)
            .max(0.0)
            * 0.5,
        kv_tokens: Some(a.num_blocks * BLOCK),
        prefill_context_ms,
        decode_points,
        prefill_points: prefill.iter().map(|&(t, ms)| (t as usize, ms)).collect(),
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&profile)?)?;
    println!(
        "prefill_ms = {:.3e}·T² + {:.4}·T + {:.2} (and the {} points, interpolated) + {:.2e}·T·P\n\
         decode_ms = {:.2}·u² + {:.2}·u + f(n), f = {} ms at n = 1, 2, 4, 8\nwrote {}",
        profile.prefill[0],
        profile.prefill[1],
        profile.prefill[2],
        profile.prefill_points.len(),
        profile.prefill_context_ms,
        profile.decode[0],
        profile.decode[1],
        profile
            .decode_points
            .iter()
            .map(|p| format!("{:.2}", p.1))
            .collect::<Vec<_>>()
            .join(", "),
        a.out.display()
    );
    let limits = crate::worker::config::WorkerConfig::default();
    let capacity = profile.capacity(
        1.0,
        a.num_blocks * BLOCK,
        limits.max_num_seqs,
        limits.max_num_batched_tokens,
        a.ttft_target_ms,
        a.itl_target_ms,
    );
    std::fs::write(&a.capacity_out, serde_json::to_string_pretty(&capacity)?)?;
    let at = |t: &[crate::control::planner::CapacityPoint], n: u32| {
        t.iter()
            .find(|p| p.tokens == n)
            .map_or(0.0, |p| p.tokens_per_s)
    };
    println!(
        "capacity at TTFT p99 {} ms / ITL p99 {} ms: prefill {:.0} tokens/s at 1,024-token \
         prompts, decode {:.0} tokens/s at 1,024-token contexts\nwrote {}",
        a.ttft_target_ms,
        a.itl_target_ms,
        at(&capacity.prefill, 1024),
        at(&capacity.decode, 1024),
        a.capacity_out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_quadratic() {
        let pts: Vec<(f64, f64)> = (0..6)
            .map(|i| {
                let x = i as f64 * 100.0;
                (x, 4.21e-7 * x * x + 0.01518 * x + 16.5)
            })
            .collect();
        let p = fit_quadratic(&pts).unwrap();
        assert!((p[0] - 4.21e-7).abs() < 1e-12, "{p:?}");
        assert!((p[1] - 0.01518).abs() < 1e-8, "{p:?}");
        assert!((p[2] - 16.5).abs() < 1e-6, "{p:?}");
        assert!(fit_quadratic(&pts[..2]).is_err());
        let line = [(1.0, 12.0), (2.0, 14.5), (4.0, 19.5), (8.0, 29.5)];
        assert!((slope(&line) - 2.5).abs() < 1e-9, "{}", slope(&line));
        assert_eq!(slope(&line[..1]), 0.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        let curve: Vec<(f64, f64)> = [0.1, 0.3, 0.5, 0.9]
            .iter()
            .map(|&u| (u, -29.0 * u * u + 56.0 * u))
            .collect();
        let [d, e] = fit_quadratic_through_origin(&curve).unwrap();
        assert!(
            (d + 29.0).abs() < 1e-9 && (e - 56.0).abs() < 1e-9,
            "{d} {e}"
        );
        assert!(fit_quadratic_through_origin(&curve[..1]).is_err());
    }
}
