//! `y = x·Wᵀ` on the CPU for every [`WeightMatrix`] storage.
//!
//! - f32 weights: the `gemm` crate (AVX-512 kernels, rayon).
//! - Quantised weights, `m == 1` (single-stream decode): weights are dequantised *in
//!   registers* block by block and multiplied with f32 activations, 4 weight rows at a time.
//! - Quantised weights, `1 < m <` [`GEMM_MIN_M`] (batched decode, short prefill chunks): a
//!   panel of 64 weight rows is dequantised into an L2-resident f32 scratch, then swept by a
//!   4×4 register tile for every group of 4 activation rows.
//! - Quantised weights, large `m` (prefill): tiles of rows are dequantised to f32 and multiplied
//!   with `gemm`.
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
use crate::kernels::quant::{MatrixData, QK, WeightMatrix};

/// From this many activation rows on, quantised weights go through dequantised tiles + gemm.
pub const GEMM_MIN_M: usize = 128;
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
    matmul_impl(x, m, w, y, isa());
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
    matmul_impl(x, m, w, y, usable);
}

fn matmul_impl(x: &[f32], m: usize, w: &WeightMatrix, y: &mut [f32], simd: Isa) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "matmul: x has wrong length");
    assert_eq!(y.len(), m * n, "matmul: y has wrong length");
    if m == 0 {
        return;
    }
    match &w.data {
        MatrixData::F32(v) => gemm_f32(x, m, v, n, k, y, 0, n),
        _ if m >= GEMM_MIN_M => {
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
        _ => quant_small_m(x, m, w, y, simd),
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

/// Rows of `W` handled per register tile.
pub(super) const R: usize = 4;
/// Weight rows dequantised together for the batched (m > 1) path.
const PANEL: usize = 64;
/// Activation rows handled per register tile.
pub(super) const C: usize = 4;

fn quant_small_m(x: &[f32], m: usize, w: &WeightMatrix, y: &mut [f32], simd: Isa) {
    let (n, k) = (w.rows, w.cols);
    let nb = k / QK;
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = (n / (threads * 8)).clamp(R * 4, 256) / R * R;
    if m == 1 {
        small_m_into(x, 1, w, y, rows_per_task, nb, simd);
        return;
    }
    // yt[n][m]: each task owns a contiguous slab of output rows; transposed at the end.
    let mut yt = vec![0f32; n * m];
    small_m_into(x, m, w, &mut yt, rows_per_task, nb, simd);
    for i in 0..n {
        for j in 0..m {
            y[j * n + i] = yt[i * m + j];
        }
    }
}

/// Fills `yt[n][m]` (`yt[r][j] = W[r]·x[j]`).
fn small_m_into(
    x: &[f32],
    m: usize,
    w: &WeightMatrix,
    yt: &mut [f32],
    rows_per_task: usize,
    nb: usize,
    simd: Isa,
) {
    let k = w.cols;
    if simd != Isa::Portable && m > 1 {
        // Dequantise a panel of PANEL rows once into f32 scratch (L2), then sweep it with
        // each C-row tile of x held in L1: x is streamed once per panel, not once per R rows.
        yt.par_chunks_mut(rows_per_task * m)
            .enumerate()
            .for_each_init(
                || vec![0f32; PANEL * k],
                |wbuf, (t, out)| {
                    let r_start = t * rows_per_task;
                    let rows = out.len() / m;
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
                },
            );
        return;
    }
    yt.par_chunks_mut(rows_per_task * m)
        .enumerate()
        .for_each(|(t, out)| {
            let r_start = t * rows_per_task;
            let rows = out.len() / m;
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
        });
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
    if cc == 1 {
        let b0 = row0 * nb;
        // SAFETY: `simd` never names an instruction set the CPU lacks; slices cover `rr` rows
        // of `nb` blocks and one activation row of `k` floats (asserted inside the kernels).
        unsafe {
            match (&w.data, simd, rr) {
                (MatrixData::Q4_1(b), Isa::Avx512, R) => {
                    return avx512::q4_1::<R, 1>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx512, _) => {
                    return avx512::q4_1::<1, 1>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx512, R) => {
                    return avx512::q8_0::<R, 1>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx512, _) => {
                    return avx512::q8_0::<1, 1>(&b[b0..], nb, xs, k, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx2, R) => {
                    return avx2::q4_1::<R>(&b[b0..], nb, xs, acc);
                }
                (MatrixData::Q4_1(b), Isa::Avx2, _) => {
                    return avx2::q4_1::<1>(&b[b0..], nb, xs, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx2, R) => {
                    return avx2::q8_0::<R>(&b[b0..], nb, xs, acc);
                }
                (MatrixData::Q8_0(b), Isa::Avx2, _) => {
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
        for m in [1, 2, 3, 5, 8, 50] {
            let x = data(m * k, m as u32);
            for w in &mats {
                let r = reference(&x, m, &w.to_f32(), n, k);
                for simd in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
                    let mut y = vec![0.0; m * n];
                    matmul_with(&x, m, w, &mut y, simd);
                    for (a, b) in y.iter().zip(&r) {
                        assert!((a - b).abs() < 1e-4, "m={m} {simd:?} {a} vs {b}");
                    }
                }
            }
        }
    }
}
