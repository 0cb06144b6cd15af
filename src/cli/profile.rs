//! `flotilla profile`: measure this machine's CPU engine and write a timing profile for the
//! simulated engine (`worker.sim_profile`), in the same form as the built-in H100 profile
//! (`worker/engine/sim.rs`):
//!
//! ```text
//! prefill_ms(T) = a·T² + b·T + c    fitted to one-sequence prefills of T tokens
//! decode_ms(u)  = d·u² + e·u + f    fitted to decode steps of `--batch` sequences whose
//!                                   contexts fill a fraction u of the KV pool
//! ```
//!
//! and, from the fit, the planner's capacity curves (`--capacity-out`, see
//! [`crate::control::planner::capacity`]).
//!
//! Each point is the fastest of `--repeats` timed steps (the minimum is the least disturbed
//! by other work on the machine); the quadratics are ordinary least squares.

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
    /// Timed steps per point (the fastest is kept).
    #[arg(long, default_value_t = 3)]
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
    }
}

fn timed(engine: &mut Engine, batch: &StepBatch) -> anyhow::Result<f64> {
    let t = Instant::now();
    engine.step(batch)?;
    Ok(t.elapsed().as_secs_f64() * 1000.0)
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
    for t in [16usize, 64, 128, 256, 384, 512] {
        if t + 1 > capacity {
            break;
        }
        let mut best = f64::INFINITY;
        for _ in 0..a.repeats.max(1) {
            let s = seq(
                next_id,
                (0..t).map(token).collect(),
                0,
                &blocks[..t.div_ceil(BLOCK) + 1],
            );
            best = best.min(timed(&mut engine, &StepBatch { seqs: vec![s] })?);
            engine.release(SeqId(next_id));
            next_id += 1;
        }
        println!("prefill T={t:>4}: {best:8.2} ms");
        prefill.push((t as f64, best));
    }

    // Decode: `batch` sequences grown (untimed) until they fill a fraction u of the pool, then
    // timed single-token steps.
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
        let mut best = f64::INFINITY;
        for _ in 0..a.repeats.max(1) {
            if len + 1 >= per_seq_blocks * BLOCK {
                break;
            }
            let seqs = (0..a.batch)
                .map(|i| seq(ids[i], vec![token(len)], len, tables[i]))
                .collect();
            best = best.min(timed(&mut engine, &StepBatch { seqs })?);
            len += 1;
        }
        let used = (a.batch * len) as f64 / capacity as f64;
        println!("decode u={used:.2} (batch {}): {best:8.2} ms", a.batch);
        decode.push((used, best));
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
        decode: fit_quadratic(&decode)?,
        min_decode_ms: decode.iter().map(|p| p.1).fold(f64::INFINITY, f64::min) * 0.5,
        kv_tokens: Some(a.num_blocks * BLOCK),
    };
    std::fs::write(&a.out, serde_json::to_string_pretty(&profile)?)?;
    println!(
        "prefill_ms = {:.3e}·T² + {:.4}·T + {:.2}\ndecode_ms = {:.2}·u² + {:.2}·u + {:.2}\nwrote {}",
        profile.prefill[0],
        profile.prefill[1],
        profile.prefill[2],
        profile.decode[0],
        profile.decode[1],
        profile.decode[2],
        a.out.display()
    );
    let limits = crate::node::config::WorkerConfig::default();
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
    }
}
