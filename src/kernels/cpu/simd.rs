//! AVX-512 (+F16C) kernels for [`super::matmul`]: weights are dequantised in registers and
//! multiplied with f32 activations. Every function is `unsafe` because the caller must have
//! detected `avx512f` and `f16c` at run time.
//!
//! Register tiles are indexed `acc[i][j]` on purpose: with constant `RR`/`CC` the loops fully
//! unroll into registers (this needs opt-level 3).
#![allow(clippy::needless_range_loop)]

use super::tile::{C, R};
use crate::kernels::quant::{BlockQ4_1, BlockQ8_0};
use std::arch::x86_64::*;

/// How many register tiles ahead the weight blocks are prefetched.
const PF_TILES: usize = 4;

#[inline(always)]
unsafe fn f16_to_f32(bits: u16) -> f32 {
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)))) }
}

/// Dequantises Q4_1 blocks into `out` (`blocks.len() * 32` f32).
///
/// # Safety
/// The CPU must support AVX-512F and F16C (checked by the caller at run time).
#[target_feature(enable = "avx512f,f16c")]
pub unsafe fn dequant_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    assert!(out.len() >= blocks.len() * 32);
    let mask = _mm_set1_epi8(0x0f);
    let op = out.as_mut_ptr();
    for (b, blk) in blocks.iter().enumerate() {
        // Sequential stream: keep ~1 KiB of blocks in flight. Never faults.
        _mm_prefetch::<_MM_HINT_T0>(blocks.as_ptr().wrapping_add(b + 32).cast());
        // SAFETY: b*32 + 32 <= out.len() (asserted above); unaligned loads/stores.
        unsafe {
            let d = _mm512_set1_ps(f16_to_f32(blk.d.to_bits()));
            let m = _mm512_set1_ps(f16_to_f32(blk.m.to_bits()));
            let q = _mm_loadu_si128(blk.qs.as_ptr().cast());
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            let p = op.wrapping_add(b * 32);
            _mm512_storeu_ps(
                p,
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m),
            );
            _mm512_storeu_ps(
                p.wrapping_add(16),
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m),
            );
        }
    }
}

/// Dequantises Q8_0 blocks into `out` (`blocks.len() * 32` f32).
///
/// # Safety
/// The CPU must support AVX-512F and F16C (checked by the caller at run time).
#[target_feature(enable = "avx512f,f16c")]
pub unsafe fn dequant_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    assert!(out.len() >= blocks.len() * 32);
    let op = out.as_mut_ptr();
    for (b, blk) in blocks.iter().enumerate() {
        // Sequential stream: keep ~1 KiB of blocks in flight. Never faults.
        _mm_prefetch::<_MM_HINT_T0>(blocks.as_ptr().wrapping_add(b + 32).cast());
        // SAFETY: b*32 + 32 <= out.len() (asserted above); unaligned loads/stores.
        unsafe {
            let d = _mm512_set1_ps(f16_to_f32(blk.d.to_bits()));
            let q = blk.qs.as_ptr().cast::<__m128i>();
            let (ql, qh) = (_mm_loadu_si128(q), _mm_loadu_si128(q.wrapping_add(1)));
            let p = op.wrapping_add(b * 32);
            _mm512_storeu_ps(
                p,
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ql)), d),
            );
            _mm512_storeu_ps(
                p.wrapping_add(16),
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qh)), d),
            );
        }
    }
}

/// `RR` f32 rows (stride `k`) times `CC` f32 rows of `x` (stride `k`); `k % 16 == 0`.
///
/// # Safety
/// The CPU must support AVX-512F and F16C (checked by the caller at run time).
#[target_feature(enable = "avx512f")]
pub unsafe fn f32_tile<const RR: usize, const CC: usize>(
    w: &[f32],
    x: &[f32],
    k: usize,
    out: &mut [[f32; C]; R],
) {
    assert!(w.len() >= RR * k && x.len() >= CC * k && k.is_multiple_of(16));
    let mut acc = [[_mm512_setzero_ps(); CC]; RR];
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    for kk in (0..k).step_by(16) {
        let mut wv = [_mm512_setzero_ps(); RR];
        for (i, v) in wv.iter_mut().enumerate() {
            // SAFETY: i*k + kk + 16 <= RR*k <= w.len().
            *v = unsafe { _mm512_loadu_ps(wp.wrapping_add(i * k + kk)) };
        }
        for j in 0..CC {
            // SAFETY: j*k + kk + 16 <= CC*k <= x.len().
            let xv = unsafe { _mm512_loadu_ps(xp.wrapping_add(j * k + kk)) };
            for i in 0..RR {
                acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
            }
        }
    }
    for i in 0..RR {
        for j in 0..CC {
            out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
        }
    }
}

/// `RR` rows of Q4_1 blocks (row `i` starts at `w[i*nb]`) times `CC` f32 rows of `x`
/// (stride `k`).
///
/// # Safety
/// The CPU must support AVX-512F and F16C (checked by the caller at run time).
#[target_feature(enable = "avx512f,f16c")]
pub unsafe fn q4_1<const RR: usize, const CC: usize>(
    w: &[BlockQ4_1],
    nb: usize,
    x: &[f32],
    k: usize,
    out: &mut [[f32; C]; R],
) {
    assert!(w.len() >= RR * nb && x.len() >= CC * k);
    let mask = _mm_set1_epi8(0x0f);
    let mut acc = [[_mm512_setzero_ps(); CC]; RR];
    let wp = w.as_ptr();
    let xp = x.as_ptr();
    for b in 0..nb {
        let mut wl = [_mm512_setzero_ps(); RR];
        let mut wh = [_mm512_setzero_ps(); RR];
        for i in 0..RR {
            // SAFETY: i*nb + b < RR*nb <= w.len().
            let blk = unsafe { &*wp.wrapping_add(i * nb + b) };
            // Prefetch the same block of the next tile (rows RR.. ahead): tiles are contiguous,
            // so this runs PF_TILES tiles ahead of the loads. Prefetch never faults.
            _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add((PF_TILES * RR + i) * nb + b).cast());
            let d = _mm512_set1_ps(unsafe { f16_to_f32(blk.d.to_bits()) });
            let m = _mm512_set1_ps(unsafe { f16_to_f32(blk.m.to_bits()) });
            let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            wl[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
            wh[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
        }
        for j in 0..CC {
            // SAFETY: j*k + b*32 + 32 <= CC*k <= x.len().
            let (xl, xh) = unsafe {
                let p = xp.wrapping_add(j * k + b * 32);
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.wrapping_add(16)))
            };
            for i in 0..RR {
                acc[i][j] = _mm512_fmadd_ps(wl[i], xl, acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(wh[i], xh, acc[i][j]);
            }
        }
    }
    for i in 0..RR {
        for j in 0..CC {
            out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
        }
    }
}

/// `RR` rows of Q8_0 blocks times `CC` f32 rows of `x` (stride `k`).
///
/// # Safety
/// The CPU must support AVX-512F and F16C (checked by the caller at run time).
#[target_feature(enable = "avx512f,f16c")]
pub unsafe fn q8_0<const RR: usize, const CC: usize>(
    w: &[BlockQ8_0],
    nb: usize,
    x: &[f32],
    k: usize,
    out: &mut [[f32; C]; R],
) {
    assert!(w.len() >= RR * nb && x.len() >= CC * k);
    let mut acc = [[_mm512_setzero_ps(); CC]; RR];
    let wp = w.as_ptr();
    let xp = x.as_ptr();
    for b in 0..nb {
        let mut wl = [_mm512_setzero_ps(); RR];
        let mut wh = [_mm512_setzero_ps(); RR];
        for i in 0..RR {
            // SAFETY: i*nb + b < RR*nb <= w.len().
            let blk = unsafe { &*wp.wrapping_add(i * nb + b) };
            // Prefetch the same block of the next tile (rows RR.. ahead): tiles are contiguous,
            // so this runs PF_TILES tiles ahead of the loads. Prefetch never faults.
            _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add((PF_TILES * RR + i) * nb + b).cast());
            let d = _mm512_set1_ps(unsafe { f16_to_f32(blk.d.to_bits()) });
            let (ql, qh) = unsafe {
                let p = blk.qs.as_ptr().cast::<__m128i>();
                (_mm_loadu_si128(p), _mm_loadu_si128(p.wrapping_add(1)))
            };
            wl[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ql)), d);
            wh[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qh)), d);
        }
        for j in 0..CC {
            // SAFETY: j*k + b*32 + 32 <= CC*k <= x.len().
            let (xl, xh) = unsafe {
                let p = xp.wrapping_add(j * k + b * 32);
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.wrapping_add(16)))
            };
            for i in 0..RR {
                acc[i][j] = _mm512_fmadd_ps(wl[i], xl, acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(wh[i], xh, acc[i][j]);
            }
        }
    }
    for i in 0..RR {
        for j in 0..CC {
            out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
        }
    }
}

/// `a · b` for f32 slices whose length is a multiple of 16.
///
/// # Safety
/// The CPU must support AVX-512F (checked by the caller at run time).
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn dot16(a: &[f32], b: &[f32]) -> f32 {
    assert!(a.len() == b.len() && a.len().is_multiple_of(16));
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= a.len() {
        // SAFETY: i + 32 <= len for both slices.
        unsafe {
            acc0 = _mm512_fmadd_ps(
                _mm512_loadu_ps(ap.wrapping_add(i)),
                _mm512_loadu_ps(bp.wrapping_add(i)),
                acc0,
            );
            acc1 = _mm512_fmadd_ps(
                _mm512_loadu_ps(ap.wrapping_add(i + 16)),
                _mm512_loadu_ps(bp.wrapping_add(i + 16)),
                acc1,
            );
        }
        i += 32;
    }
    if i < a.len() {
        // SAFETY: i + 16 == len.
        unsafe {
            acc0 = _mm512_fmadd_ps(
                _mm512_loadu_ps(ap.wrapping_add(i)),
                _mm512_loadu_ps(bp.wrapping_add(i)),
                acc0,
            );
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
}

/// `y += alpha · x` for f32 slices whose length is a multiple of 16.
///
/// # Safety
/// The CPU must support AVX-512F (checked by the caller at run time).
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn axpy16(y: &mut [f32], alpha: f32, x: &[f32]) {
    assert!(y.len() == x.len() && y.len().is_multiple_of(16));
    let a = _mm512_set1_ps(alpha);
    let (yp, xp) = (y.as_mut_ptr(), x.as_ptr());
    for i in (0..y.len()).step_by(16) {
        // SAFETY: i + 16 <= len for both slices.
        unsafe {
            let v = _mm512_fmadd_ps(
                a,
                _mm512_loadu_ps(xp.wrapping_add(i)),
                _mm512_loadu_ps(yp.wrapping_add(i)),
            );
            _mm512_storeu_ps(yp.wrapping_add(i), v);
        }
    }
}
