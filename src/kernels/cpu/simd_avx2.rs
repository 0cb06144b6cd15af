//! AVX2 + FMA + F16C twins of the kernels in [`super::simd`], for x86 CPUs without AVX-512.
//! Same contracts, 8-lane registers; the q-kernels only exist for one activation row (batched
//! paths dequantise to f32 and use [`f32_tile`]). Every function is `unsafe` because the caller
//! must have detected `avx2`, `fma` and `f16c` at run time.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::tile::{C, R};
use crate::kernels::quant::{BlockQ4_1, BlockQ8_0};

/// How many register tiles ahead the weight blocks are prefetched.
const PF_TILES: usize = 4;

#[inline(always)]
unsafe fn f16_to_f32(bits: u16) -> f32 {
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)))) }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
}

/// The 32 nibble values of a Q4_1 block as 4 × 8 f32 (`d·q + m`).
#[inline(always)]
unsafe fn q4_1_block(blk: &BlockQ4_1) -> [__m256; 4] {
    unsafe {
        let d = _mm256_set1_ps(f16_to_f32(blk.d.to_bits()));
        let m = _mm256_set1_ps(f16_to_f32(blk.m.to_bits()));
        let mask = _mm_set1_epi8(0x0f);
        let q = _mm_loadu_si128(blk.qs.as_ptr().cast());
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), mask);
        let f = |v: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d, m);
        [
            f(lo),
            f(_mm_srli_si128::<8>(lo)),
            f(hi),
            f(_mm_srli_si128::<8>(hi)),
        ]
    }
}

/// The 32 values of a Q8_0 block as 4 × 8 f32 (`d·q`).
#[inline(always)]
unsafe fn q8_0_block(blk: &BlockQ8_0) -> [__m256; 4] {
    unsafe {
        let d = _mm256_set1_ps(f16_to_f32(blk.d.to_bits()));
        let p = blk.qs.as_ptr().cast::<__m128i>();
        let (a, b) = (_mm_loadu_si128(p), _mm_loadu_si128(p.wrapping_add(1)));
        let f = |v: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
        [
            f(a),
            f(_mm_srli_si128::<8>(a)),
            f(b),
            f(_mm_srli_si128::<8>(b)),
        ]
    }
}

macro_rules! q_rows_times_x {
    ($name:ident, $block:ty, $deq:ident) => {
        /// `out[i][0] = W[i] · x` for `RR` rows of blocks (row `i` at `w[i*nb]`) and one f32
        /// row `x` of `nb * 32` values.
        ///
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $name<const RR: usize>(
            w: &[$block],
            nb: usize,
            x: &[f32],
            out: &mut [[f32; C]; R],
        ) {
            assert!(w.len() >= RR * nb && x.len() >= nb * 32 && RR <= R);
            let mut acc = [_mm256_setzero_ps(); RR];
            let (wp, xp) = (w.as_ptr(), x.as_ptr());
            for b in 0..nb {
                // SAFETY: b*32 + 32 <= x.len(); i*nb + b < RR*nb <= w.len() (asserted).
                unsafe {
                    let xb = xp.wrapping_add(b * 32);
                    let xv = [
                        _mm256_loadu_ps(xb),
                        _mm256_loadu_ps(xb.wrapping_add(8)),
                        _mm256_loadu_ps(xb.wrapping_add(16)),
                        _mm256_loadu_ps(xb.wrapping_add(24)),
                    ];
                    for i in 0..RR {
                        // Same block, PF_TILES tiles ahead (see `simd.rs`); never faults.
                        _mm_prefetch::<_MM_HINT_T0>(
                            wp.wrapping_add((PF_TILES * RR + i) * nb + b).cast(),
                        );
                        let wv = $deq(&*wp.wrapping_add(i * nb + b));
                        for q in 0..4 {
                            acc[i] = _mm256_fmadd_ps(wv[q], xv[q], acc[i]);
                        }
                    }
                }
            }
            for i in 0..RR {
                // SAFETY: AVX is available (function contract).
                out[i][0] = unsafe { hsum(acc[i]) };
            }
        }
    };
}

q_rows_times_x!(q4_1, BlockQ4_1, q4_1_block);
q_rows_times_x!(q8_0, BlockQ8_0, q8_0_block);

macro_rules! dequant_fn {
    ($name:ident, $block:ty, $deq:ident) => {
        /// Dequantises blocks into `out` (`blocks.len() * 32` f32).
        ///
        /// # Safety
        /// The CPU must support AVX2, FMA and F16C.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn $name(blocks: &[$block], out: &mut [f32]) {
            assert!(out.len() >= blocks.len() * 32);
            let op = out.as_mut_ptr();
            for (b, blk) in blocks.iter().enumerate() {
                // SAFETY: b*32 + 32 <= out.len() (asserted above).
                unsafe {
                    let v = $deq(blk);
                    for q in 0..4 {
                        _mm256_storeu_ps(op.wrapping_add(b * 32 + q * 8), v[q]);
                    }
                }
            }
        }
    };
}

dequant_fn!(dequant_q4_1, BlockQ4_1, q4_1_block);
dequant_fn!(dequant_q8_0, BlockQ8_0, q8_0_block);

/// `out[i][j] = w[i] · x[j]` for `RR` f32 rows of `w` and `CC <= 2` f32 rows of `x` (stride `k`,
/// `k % 8 == 0`).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn f32_tile<const RR: usize, const CC: usize>(
    w: &[f32],
    x: &[f32],
    k: usize,
    out: &mut [[f32; 2]; R],
) {
    assert!(w.len() >= RR * k && x.len() >= CC * k && k.is_multiple_of(8) && CC <= 2);
    let mut acc = [[_mm256_setzero_ps(); CC]; RR];
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    for kk in (0..k).step_by(8) {
        // SAFETY: i*k + kk + 8 <= RR*k and j*k + kk + 8 <= CC*k (asserted).
        unsafe {
            let mut wv = [_mm256_setzero_ps(); RR];
            for i in 0..RR {
                wv[i] = _mm256_loadu_ps(wp.wrapping_add(i * k + kk));
            }
            for j in 0..CC {
                let xv = _mm256_loadu_ps(xp.wrapping_add(j * k + kk));
                for i in 0..RR {
                    acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
                }
            }
        }
    }
    for i in 0..RR {
        for j in 0..CC {
            // SAFETY: AVX is available (function contract).
            out[i][j] = unsafe { hsum(acc[i][j]) };
        }
    }
}
