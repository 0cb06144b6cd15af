//! `y = x·Wᵀ` on the CPU for every [`WeightMatrix`] storage.
//!
//! - f32 weights: the `gemm` crate (AVX-512 kernels, rayon).
//! - Quantised weights, `m <= 32` (decode batches): weights are dequantised *in
//!   registers* block by block and multiplied with f32 activations, 4 weight rows × up to 4
//!   activation rows per register tile, prefetching 4 tiles ahead (AVX2: `m == 1` only).
//! - Quantised weights, `32 < m <` [`gemm_min_m`] (larger batches, prefill chunks): a
//!   panel of 64 weight rows is dequantised into an L2-resident f32 scratch, then swept by a
//!   4×4 register tile for every group of 4 activation rows.
//! - Quantised weights, `m >=` [`gemm_min_m`] (prefill chunks, where this machine runs them
//!   faster so): tiles of rows are dequantised to f32 and multiplied with `gemm`.
//!
//! Which of the last two is faster for a prefill chunk depends on the core, not on the model:
//! measured on two machines of the project's kind, both AVX-512, 2 threads, 512 rows, the
//! panel kernel ran 1.7× faster than `gemm` on an AMD EPYC and 1.7× slower on an Intel Xeon
//! (`docs/benchmarks.md`, "Prefill kernels: the crossover is measured"). So the crossover is
//! not a constant: [`crossover`] times both paths on this machine once per process (about
//! 0.1 s) and keeps the smallest candidate row count from which `gemm` wins at every larger
//! candidate; `FLOTILLA_GEMM_MIN_M` sets it instead (reproducible runs, tests).
//!
//! SIMD paths are AVX-512F + F16C, detected at run time (`FLOTILLA_NO_SIMD` forces the
//! portable code). Each weight block is read once per step for the whole batch, and activations
//! stay f32, so results equal a float32 reference up to summation order (no activation
//! quantisation error).

use std::sync::LazyLock;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::simd as avx512;
#[cfg(target_arch = "x86_64")]
use super::simd_avx2 as avx2;
use super::tile::{C, R};
use crate::kernels::quant::{MatrixData, QK, WeightMatrix};

/// From this many activation rows on, quantised weights always go through dequantised tiles +
/// `gemm`, whatever [`crossover`] found: above every prefill chunk
/// (`worker.max_num_batched_tokens`, 512), where the panel kernel never won.
pub const GEMM_MIN_M_MAX: usize = 1024;
/// Row counts [`crossover`] times both paths at: prefill chunks of 128 to 512 tokens.
pub const CROSSOVER_CANDIDATES: [usize; 3] = [128, 256, 512];
/// Timed runs of each path per candidate (the fastest counts: a busy machine only slows a run).
const CROSSOVER_REPS: usize = 3;
/// Weight shapes `(rows, cols)` the crossover is timed on: a model's widest projections are
/// of this kind (SmolLM2-135M's MLP: 1,536 × 576 up, 576 × 1,536 down).
const CROSSOVER_SHAPES: [(usize, usize); 2] = [(1536, 576), (576, 1536)];

/// Where this process's crossover came from.
#[derive(Clone, Debug, PartialEq)]
pub enum CrossoverSource {
    /// `FLOTILLA_GEMM_MIN_M`.
    Env,
    /// Timed on this machine: per candidate row count, `(rows, panel ms, gemm ms)`.
    Measured(Vec<(usize, f64, f64)>),
}

/// The activation-row count from which quantised matmuls use `gemm` (module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Crossover {
    /// `gemm` from this many rows on (33 ..= [`GEMM_MIN_M_MAX`]).
    pub gemm_min_m: usize,
    /// How it was found.
    pub source: CrossoverSource,
}

impl std::fmt::Display for Crossover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "gemm from {} rows", self.gemm_min_m)?;
        match &self.source {
            CrossoverSource::Env => write!(f, " (FLOTILLA_GEMM_MIN_M)"),
            CrossoverSource::Measured(t) => {
                write!(f, " (measured, panel/gemm ms:")?;
                for (m, p, g) in t {
                    write!(f, " {m}: {p:.2}/{g:.2}")?;
                }
                write!(f, ")")
            }
        }
    }
}

static CROSSOVER: LazyLock<Crossover> = LazyLock::new(|| find_crossover(isa()));

/// This process's crossover, found on first use (module docs). A node calls it at start, so
/// that the measurement runs before any request and is logged.
pub fn crossover() -> &'static Crossover {
    &CROSSOVER
}

/// `gemm` from this many activation rows on (quantised weights).
pub fn gemm_min_m() -> usize {
    CROSSOVER.gemm_min_m
}

/// The crossover from `FLOTILLA_GEMM_MIN_M`, else timed on this machine with `simd`.
fn find_crossover(simd: Isa) -> Crossover {
    if let Some(m) = std::env::var("FLOTILLA_GEMM_MIN_M")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        return Crossover {
            gemm_min_m: m.clamp(Q_PATH_MAX_M + 1, GEMM_MIN_M_MAX),
            source: CrossoverSource::Env,
        };
    }
    let times = time_paths(simd);
    Crossover {
        gemm_min_m: pick_crossover(&times),
        source: CrossoverSource::Measured(times),
    }
}

/// The smallest candidate from which `gemm` is faster at that and every larger candidate;
/// [`GEMM_MIN_M_MAX`] when the panel kernel wins at the largest. `times`: `(rows, panel,
/// gemm)`, rows ascending.
fn pick_crossover(times: &[(usize, f64, f64)]) -> usize {
    let mut from = GEMM_MIN_M_MAX;
    for &(m, panel, gemm) in times.iter().rev() {
        if gemm < panel {
            from = m;
        } else {
            break;
        }
    }
    from
}

/// Both quantised paths timed at every candidate row count, interleaved, fastest of
/// [`CROSSOVER_REPS`] (ms, summed over [`CROSSOVER_SHAPES`]).
fn time_paths(simd: Isa) -> Vec<(usize, f64, f64)> {
    use std::time::Instant;
    let mats: Vec<WeightMatrix> = CROSSOVER_SHAPES
        .iter()
        .map(|&(n, k)| {
            let wf: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            WeightMatrix {
                rows: n,
                cols: k,
                data: MatrixData::Q4_1(crate::kernels::quant::quantize_q4_1(&wf)),
            }
        })
        .collect();
    let max_m = CROSSOVER_CANDIDATES[CROSSOVER_CANDIDATES.len() - 1];
    let kmax = CROSSOVER_SHAPES.iter().map(|s| s.1).max().unwrap_or(0);
    let nmax = CROSSOVER_SHAPES.iter().map(|s| s.0).max().unwrap_or(0);
    let x: Vec<f32> = (0..max_m * kmax)
        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let mut y = vec![0f32; max_m * nmax];
    let mut run = |m: usize, gemm: bool| {
        let t = Instant::now();
        for w in &mats {
            let (xs, ys) = (&x[..m * w.cols], &mut y[..m * w.rows]);
            if gemm {
                gemm_tiles(xs, m, w, ys, simd);
            } else {
                quant_small_m(xs, m, &[w], &mut [ys], simd);
            }
        }
        t.elapsed().as_secs_f64() * 1e3
    };
    // Warm-up: the buffers' pages, rayon's threads.
    run(CROSSOVER_CANDIDATES[0], false);
    run(CROSSOVER_CANDIDATES[0], true);
    CROSSOVER_CANDIDATES
        .iter()
        .map(|&m| {
            let (mut panel, mut gemm) = (f64::MAX, f64::MAX);
            for _ in 0..CROSSOVER_REPS {
                panel = panel.min(run(m, false));
                gemm = gemm.min(run(m, true));
            }
            (m, panel, gemm)
        })
        .collect()
}
/// Weight rows dequantised per gemm tile (bounded scratch: `TILE_ROWS * cols` f32).
const TILE_ROWS: usize = 512;

/// Instruction sets the kernels can use, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F + F16C (16 f32 lanes).
    Avx512,
    /// AVX2 + FMA + F16C (8 f32 lanes).
    Avx2,
    /// Plain Rust (auto-vectorised to the build's baseline).
    Portable,
}

static ISA: LazyLock<Isa> = LazyLock::new(detect_isa);

fn detect_isa() -> Isa {
    let want = std::env::var("FLOTILLA_SIMD").unwrap_or_default();
    if std::env::var_os("FLOTILLA_NO_SIMD").is_some() || want == "none" {
        return Isa::Portable;
    }
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        if want != "avx2" && avx2 && has!("avx512f") {
            return Isa::Avx512;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Portable
}

/// The instruction set in use: detected at run time; `FLOTILLA_SIMD=avx2|none` (or
/// `FLOTILLA_NO_SIMD`) caps it.
pub fn isa() -> Isa {
    *ISA
}

/// Whether any SIMD kernels are in use.
pub fn simd_enabled() -> bool {
    isa() != Isa::Portable
}

/// `y[m, n] = x[m, k] · W[n, k]ᵀ` (all f32 except `W`'s storage), with `k = w.cols`,
/// `n = w.rows`. Panics only if slice lengths disagree with the shapes (a programming error).
pub fn matmul(x: &[f32], m: usize, w: &WeightMatrix, y: &mut [f32]) {
    matmul_impl(x, m, w, y, isa(), gemm_min_m());
}

/// `ys[i][m, ws[i].rows] = x[m, k] · ws[i]ᵀ` for matrices sharing the input width `k`
/// (e.g. the q/k/v or gate/up projections): one parallel region for all of them when they are
/// quantised and `m` is small.
pub fn matmul_many(x: &[f32], m: usize, ws: &[&WeightMatrix], ys: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), ys.len(), "matmul_many: one output per matrix");
    let fused = m > 0
        && m < gemm_min_m()
        && ws
            .iter()
            .all(|w| !matches!(w.data, MatrixData::F32(_)) && w.cols == ws[0].cols);
    if !fused {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            matmul(x, m, w, y);
        }
        return;
    }
    for (w, y) in ws.iter().zip(ys.iter()) {
        assert_eq!(x.len(), m * w.cols, "matmul_many: x has wrong length");
        assert_eq!(y.len(), m * w.rows, "matmul_many: y has wrong length");
    }
    quant_small_m(x, m, ws, ys, isa());
}

/// [`matmul`] with an explicit instruction set (must be supported by this CPU: at most
/// [`isa()`]; anything else falls back to portable code).
pub fn matmul_with(x: &[f32], m: usize, w: &WeightMatrix, y: &mut [f32], want: Isa) {
    let usable = match (isa(), want) {
        (Isa::Avx512, w) => w,
        (Isa::Avx2, Isa::Avx512) => Isa::Avx2,
        (Isa::Avx2, w) => w,
        (Isa::Portable, _) => Isa::Portable,
    };
    matmul_impl(x, m, w, y, usable, gemm_min_m());
}

/// [`matmul`] with quantised weights through `gemm` from `gemm_from` rows on.
fn matmul_impl(x: &[f32], m: usize, w: &WeightMatrix, y: &mut [f32], simd: Isa, gemm_from: usize) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "matmul: x has wrong length");
    assert_eq!(y.len(), m * n, "matmul: y has wrong length");
    if m == 0 {
        return;
    }
    match &w.data {
        MatrixData::F32(v) => gemm_f32(x, m, v, n, k, y, 0, n),
        _ if m >= gemm_from => gemm_tiles(x, m, w, y, simd),
        _ => quant_small_m(x, m, &[w], &mut [y], simd),
    }
}

/// `y = x·Wᵀ` for quantised `W`: tiles of [`TILE_ROWS`] weight rows dequantised to f32, each
/// multiplied with `gemm`.
fn gemm_tiles(x: &[f32], m: usize, w: &WeightMatrix, y: &mut [f32], simd: Isa) {
    let (n, k) = (w.rows, w.cols);
    let mut r0 = 0;
    let mut tile = vec![0f32; TILE_ROWS.min(n) * k];
    while r0 < n {
        let t = TILE_ROWS.min(n - r0);
        tile[..t * k]
            .par_chunks_mut(k)
            .enumerate()
            .for_each(|(i, row)| dequant_row(w, r0 + i, row, simd));
        gemm_f32(x, m, &tile[..t * k], t, k, y, r0, n);
        r0 += t;
    }
}

/// `y[:, col0..col0+n] = x[m,k] · W[n,k]ᵀ`, where `y` rows have stride `y_stride`.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    x: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    y: &mut [f32],
    col0: usize,
    y_stride: usize,
) {
    assert!(col0 + n <= y_stride && y.len() >= (m - 1) * y_stride + col0 + n);
    let threads = rayon::current_num_threads();
    let par = if m * n * k < 1 << 16 {
        gemm::Parallelism::None
    } else {
        gemm::Parallelism::Rayon(threads)
    };
    // SAFETY: the pointers cover `m×k` (x), `n×k` (w) and `m` rows of stride `y_stride`
    // starting at `col0` (y), checked above; strides describe exactly those layouts.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            y.as_mut_ptr().add(col0),
            1,
            y_stride as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// Weight rows dequantised together for the batched (m > 1) path.
const PANEL: usize = 64;
/// Up to this many activation rows, AVX-512 runs the in-register dequantising kernels (each
/// block dequantised once per `C` rows; measured faster than the panel path for batches of 8
/// and 32 on the project's VM); above it, the f32 panel path.
const Q_PATH_MAX_M: usize = 32;

/// Whether `rows_task` uses the dequantised f32 panel path.
fn panel_path(simd: Isa, m: usize) -> bool {
    match simd {
        Isa::Avx512 => m > Q_PATH_MAX_M,
        Isa::Avx2 => m > 1,
        Isa::Portable => false,
    }
}

/// `ys[i] = x · ws[i]ᵀ` for quantised `ws` and `m <` [`gemm_min_m`], as one parallel region
/// (fewer fork-joins per layer, better balance for small matrices).
fn quant_small_m(x: &[f32], m: usize, ws: &[&WeightMatrix], ys: &mut [&mut [f32]], simd: Isa) {
    let total: usize = ws.iter().map(|w| w.rows).sum();
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = (total / (threads * 8)).clamp(R * 4, 256) / R * R;
    let kmax = ws.iter().map(|w| w.cols).max().unwrap_or(0);
    // Outputs as yt[n][m] (rows of W contiguous); for m == 1 that is y itself.
    let mut yts: Vec<Vec<f32>> = if m > 1 {
        ws.iter().map(|w| vec![0f32; w.rows * m]).collect()
    } else {
        Vec::new()
    };
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    let outs: Vec<&mut [f32]> = if m > 1 {
        yts.iter_mut().map(Vec::as_mut_slice).collect()
    } else {
        ys.iter_mut().map(|y| &mut **y).collect()
    };
    for (i, out) in outs.into_iter().enumerate() {
        for (t, chunk) in out.chunks_mut(rows_per_task * m).enumerate() {
            tasks.push((i, t * rows_per_task, chunk));
        }
    }
    let panel = if panel_path(simd, m) { PANEL * kmax } else { 0 };
    tasks.into_par_iter().for_each_init(
        || vec![0f32; panel],
        |wbuf, (i, r_start, out)| rows_task(x, m, ws[i], out, r_start, simd, wbuf),
    );
    if m > 1 {
        for ((w, yt), y) in ws.iter().zip(&yts).zip(ys.iter_mut()) {
            let n = w.rows;
            for r in 0..n {
                for j in 0..m {
                    y[j * n + r] = yt[r * m + j];
                }
            }
        }
    }
}

/// Fills `out` = rows `r_start..` of `yt[n][m]` (`yt[r][j] = W[r]·x[j]`).
fn rows_task(
    x: &[f32],
    m: usize,
    w: &WeightMatrix,
    out: &mut [f32],
    r_start: usize,
    simd: Isa,
    wbuf: &mut [f32],
) {
    let k = w.cols;
    let nb = k / QK;
    let rows = out.len() / m;
    if panel_path(simd, m) {
        // Dequantise a panel of PANEL rows once into f32 scratch (L2), then sweep it with
        // each C-row tile of x held in L1: x is streamed once per panel, not once per R rows.
        for p0 in (0..rows).step_by(PANEL) {
            let pr = PANEL.min(rows - p0);
            for i in 0..pr {
                dequant_row(w, r_start + p0 + i, &mut wbuf[i * k..(i + 1) * k], simd);
            }
            let mut c = 0;
            while c < m {
                let cc = (m - c).min(C);
                let xs = &x[c * k..(c + cc) * k];
                let mut r = 0;
                while r < pr {
                    let rr = if pr - r >= R { R } else { 1 };
                    let mut acc = [[0f32; C]; R];
                    f32_tile(&wbuf[r * k..(r + rr) * k], rr, xs, cc, k, &mut acc, simd);
                    for i in 0..rr {
                        for j in 0..cc {
                            out[(p0 + r + i) * m + c + j] = acc[i][j];
                        }
                    }
                    r += rr;
                }
                c += cc;
            }
        }
        return;
    }
    let mut r = 0;
    while r < rows {
        let rr = if rows - r >= R { R } else { 1 };
        let mut c = 0;
        while c < m {
            let cc = (m - c).min(C);
            let xs = &x[c * k..(c + cc) * k];
            let mut acc = [[0f32; C]; R];
            tile(w, r_start + r, rr, nb, xs, cc, k, &mut acc, simd);
            for i in 0..rr {
                for j in 0..cc {
                    out[(r + i) * m + c + j] = acc[i][j];
                }
            }
            c += cc;
        }
        r += rr;
    }
}

/// Dequantises row `r` of `w` into `out` (`[cols]` f32) with the given instruction set.
fn dequant_row(w: &WeightMatrix, r: usize, out: &mut [f32], simd: Isa) {
    #[cfg(target_arch = "x86_64")]
    {
        let nb = w.cols / QK;
        // SAFETY: `simd` never names an instruction set the CPU lacks (see `isa`); `out` holds
        // `nb * 32` floats (asserted inside).
        unsafe {
            match (&w.data, simd) {
                (MatrixData::Q4_1(b), Isa::Avx512) => {
                    return avx512::dequant_q4_1(&b[r * nb..(r + 1) * nb], out);
                }
                (MatrixData::Q8_0(b), Isa::Avx512) => {
                    return avx512::dequant_q8_0(&b[r * nb..(r + 1) * nb], out);
                }
                (MatrixData::Q4_1(b), Isa::Avx2) => {
                    return avx2::dequant_q4_1(&b[r * nb..(r + 1) * nb], out);
                }
                (MatrixData::Q8_0(b), Isa::Avx2) => {
                    return avx2::dequant_q8_0(&b[r * nb..(r + 1) * nb], out);
                }
                _ => {}
            }
        }
    }
    let _ = simd;
    w.dequant_row(r, out);
}

/// `acc[i][j] = wrows[i] · x[j]` over f32 rows of length `k` (a multiple of 32).
fn f32_tile(
    wrows: &[f32],
    rr: usize,
    xs: &[f32],
    cc: usize,
    k: usize,
    acc: &mut [[f32; C]; R],
    simd: Isa,
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `simd` never names an instruction set the CPU lacks; slices cover rr (cc) rows of
    // k floats (asserted inside the kernels).
    unsafe {
        match (simd, rr, cc) {
            (Isa::Avx512, R, 4) => return avx512::f32_tile::<R, 4>(wrows, xs, k, acc),
            (Isa::Avx512, R, 3) => return avx512::f32_tile::<R, 3>(wrows, xs, k, acc),
            (Isa::Avx512, R, 2) => return avx512::f32_tile::<R, 2>(wrows, xs, k, acc),
            (Isa::Avx512, R, 1) => return avx512::f32_tile::<R, 1>(wrows, xs, k, acc),
            (Isa::Avx512, _, 4) => return avx512::f32_tile::<1, 4>(wrows, xs, k, acc),
            (Isa::Avx512, _, 3) => return avx512::f32_tile::<1, 3>(wrows, xs, k, acc),
            (Isa::Avx512, _, 2) => return avx512::f32_tile::<1, 2>(wrows, xs, k, acc),
            (Isa::Avx512, _, _) => return avx512::f32_tile::<1, 1>(wrows, xs, k, acc),
            (Isa::Avx2, _, _) => {
                let mut j = 0;
                while j < cc {
                    let pair = (cc - j).min(2);
                    let x2 = &xs[j * k..(j + pair) * k];
                    let mut a = [[0f32; 2]; R];
                    match (rr, pair) {
                        (R, 2) => avx2::f32_tile::<R, 2>(wrows, x2, k, &mut a),
                        (R, _) => avx2::f32_tile::<R, 1>(wrows, x2, k, &mut a),
                        (_, 2) => avx2::f32_tile::<1, 2>(wrows, x2, k, &mut a),
                        _ => avx2::f32_tile::<1, 1>(wrows, x2, k, &mut a),
                    }
                    for i in 0..rr {
                        acc[i][j..j + pair].copy_from_slice(&a[i][..pair]);
                    }
                    j += pair;
                }
                return;
            }
            (Isa::Portable, _, _) => {}
        }
    }
    let _ = simd;
    for i in 0..rr {
        for j in 0..cc {
            acc[i][j] = wrows[i * k..(i + 1) * k]
                .iter()
                .zip(&xs[j * k..(j + 1) * k])
                .map(|(a, b)| a * b)
                .sum();
        }
    }
}

/// Computes `acc[i][j] = W[row0+i] · x[j]` for `i < rr`, `j < cc`.
#[allow(clippy::too_many_arguments)]
fn tile(
    w: &WeightMatrix,
    row0: usize,
    rr: usize,
    nb: usize,
    xs: &[f32],
    cc: usize,
    k: usize,
    acc: &mut [[f32; C]; R],
    simd: Isa,
) {
    #[cfg(target_arch = "x86_64")]
    if cc == 1 || simd == Isa::Avx512 {
        let b0 = row0 * nb;
        // SAFETY: `simd` never names an instruction set the CPU lacks; slices cover `rr` rows
        // of `nb` blocks and `cc` activation rows of `k` floats (asserted inside the kernels).
        unsafe {
            match (&w.data, simd, rr, cc) {
                (MatrixData::Q4_1(b), Isa::Avx512, R, 4) => {
                    return avx512::q4_1::<R, 4>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx512, R, 3) => {
                    return avx512::q4_1::<R, 3>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx512, R, 2) => {
                    return avx512::q4_1::<R, 2>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx512, R, 1) => {
                    return avx512::q4_1::<R, 1>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx512, 1, 1) => {
                    return avx512::q4_1::<1, 1>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx512, R, 4) => {
                    return avx512::q8_0::<R, 4>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx512, R, 3) => {
                    return avx512::q8_0::<R, 3>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx512, R, 2) => {
                    return avx512::q8_0::<R, 2>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx512, R, 1) => {
                    return avx512::q8_0::<R, 1>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx512, 1, 1) => {
                    return avx512::q8_0::<1, 1>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx2, R, 1) => {
                    return avx2::q4_1::<R>(&b[b0..], nb, xs, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx2, _, 1) => {
                    return avx2::q4_1::<1>(&b[b0..], nb, xs, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx2, R, 1) => {
                    return avx2::q8_0::<R>(&b[b0..], nb, xs, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx2, _, 1) => {
                    return avx2::q8_0::<1>(&b[b0..], nb, xs, acc);
                }
                _ => {}
            }
        }
    }
    let _ = simd;
    portable(w, row0, rr, nb, xs, cc, k, acc);
}

/// Portable fallback: dequantise a block to f32, then dot with 8-lane chunked accumulators.
#[allow(clippy::too_many_arguments)]
fn portable(
    w: &WeightMatrix,
    row0: usize,
    rr: usize,
    nb: usize,
    xs: &[f32],
    cc: usize,
    k: usize,
    acc: &mut [[f32; C]; R],
) {
    let mut wb = [0f32; QK];
    for i in 0..rr {
        let mut lanes = [[0f32; 8]; C];
        for b in 0..nb {
            match &w.data {
                MatrixData::Q4_1(v) => {
                    crate::kernels::quant::dequant_q4_1(&v[(row0 + i) * nb + b], &mut wb)
                }
                MatrixData::Q8_0(v) => {
                    crate::kernels::quant::dequant_q8_0(&v[(row0 + i) * nb + b], &mut wb)
                }
                MatrixData::F32(v) => wb.copy_from_slice(&v[(row0 + i) * k + b * QK..][..QK]),
            }
            for (j, lane) in lanes.iter_mut().enumerate().take(cc) {
                let xb = &xs[j * k + b * QK..][..QK];
                for (wc, xc) in wb.chunks_exact(8).zip(xb.chunks_exact(8)) {
                    for l in 0..8 {
                        lane[l] += wc[l] * xc[l];
                    }
                }
            }
        }
        for j in 0..cc {
            acc[i][j] = lanes[j].iter().sum();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::{quantize_q4_1, quantize_q8_0};

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|l| x[i * k + l] as f64 * w[j * k + l] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    #[test]
    fn all_paths_match_reference() {
        let (n, k) = (72, 96);
        let wf = data(n * k, 7);
        let mats = [
            WeightMatrix {
                rows: n,
                cols: k,
                data: MatrixData::F32(wf.clone()),
            },
            WeightMatrix {
                rows: n,
                cols: k,
                data: MatrixData::Q8_0(quantize_q8_0(&wf)),
            },
            WeightMatrix {
                rows: n,
                cols: k,
                data: MatrixData::Q4_1(quantize_q4_1(&wf)),
            },
        ];
        // Decode rows, batch and prefill-chunk rows (not multiples of the tile), each through
        // the panel kernel and through gemm (whatever this machine's crossover), and rows past
        // GEMM_MIN_M_MAX.
        for m in [1, 2, 3, 5, 8, 50, 130, 513, GEMM_MIN_M_MAX + 3] {
            let x = data(m * k, m as u32);
            for w in &mats {
                let r = reference(&x, m, &w.to_f32(), n, k);
                for simd in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
                    let simd = match (isa(), simd) {
                        (Isa::Portable, _) | (Isa::Avx2, Isa::Avx512) => isa(),
                        (_, s) => s,
                    };
                    for gemm_from in [Q_PATH_MAX_M + 1, GEMM_MIN_M_MAX] {
                        let mut y = vec![0.0; m * n];
                        matmul_impl(&x, m, w, &mut y, simd, gemm_from);
                        for (a, b) in y.iter().zip(&r) {
                            assert!(
                                (a - b).abs() < 1e-4,
                                "m={m} {simd:?} gemm from {gemm_from}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_crossover_is_where_gemm_wins_from_there_on() {
        // (rows, panel ms, gemm ms)
        let t = |v: &[(f64, f64)]| -> Vec<(usize, f64, f64)> {
            CROSSOVER_CANDIDATES
                .iter()
                .zip(v)
                .map(|(&m, &(p, g))| (m, p, g))
                .collect()
        };
        // gemm wins everywhere: from the smallest candidate.
        assert_eq!(
            pick_crossover(&t(&[(2.0, 1.0), (4.0, 2.0), (8.0, 4.0)])),
            128
        );
        // gemm wins from 256 on.
        assert_eq!(
            pick_crossover(&t(&[(1.0, 2.0), (4.0, 3.0), (8.0, 4.0)])),
            256
        );
        // a win at 128 that does not hold at 256 does not count.
        assert_eq!(
            pick_crossover(&t(&[(2.0, 1.0), (3.0, 4.0), (8.0, 4.0)])),
            512
        );
        // the panel kernel wins at 512: gemm only past every prefill chunk.
        assert_eq!(
            pick_crossover(&t(&[(2.0, 1.0), (4.0, 2.0), (4.0, 8.0)])),
            GEMM_MIN_M_MAX
        );
    }

    #[test]
    fn the_crossover_is_measured_on_this_machine_within_bounds() {
        let c = find_crossover(isa());
        assert!(
            (Q_PATH_MAX_M + 1..=GEMM_MIN_M_MAX).contains(&c.gemm_min_m),
            "{c}"
        );
        if let CrossoverSource::Measured(times) = &c.source {
            assert_eq!(times.len(), CROSSOVER_CANDIDATES.len());
            assert!(times.iter().all(|&(_, p, g)| p > 0.0 && g > 0.0), "{c}");
        }
    }

    #[test]
    fn matmul_many_matches_single() {
        let k = 64;
        let mats: Vec<WeightMatrix> = [40usize, 8, 24]
            .iter()
            .enumerate()
            .map(|(i, &n)| WeightMatrix {
                rows: n,
                cols: k,
                data: MatrixData::Q4_1(quantize_q4_1(&data(n * k, 11 + i as u32))),
            })
            .collect();
        for m in [1, 3, 9] {
            let x = data(m * k, 5);
            let mut ys: Vec<Vec<f32>> = mats.iter().map(|w| vec![0.0; m * w.rows]).collect();
            let refs: Vec<&WeightMatrix> = mats.iter().collect();
            let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(Vec::as_mut_slice).collect();
            matmul_many(&x, m, &refs, &mut outs);
            for (w, y) in mats.iter().zip(&ys) {
                let mut single = vec![0.0; m * w.rows];
                matmul(&x, m, w, &mut single);
                assert_eq!(y, &single, "m={m}");
            }
        }
    }
}
