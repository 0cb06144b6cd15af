//! Paged causal attention with grouped-query heads, reading K/V through block tables.
//!
//! The KV pools of one layer are `[num_blocks, block_size, n_kv_heads, head_dim]` f32
//! (see [`crate::model::kv_cache`]); position `p` of a sequence lives in block
//! `block_table[p / block_size]`, slot `p % block_size`.

use rayon::prelude::*;

use crate::runtime::ids::BlockId;

/// Head geometry of one attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttnGeometry {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// One query token: its absolute position and its sequence's block table (validated by the
/// caller to cover positions `0..=pos` with in-range block ids).
#[derive(Debug, Clone, Copy)]
pub struct AttnToken<'a> {
    pub pos: usize,
    pub block_table: &'a [BlockId],
}

/// `out[t, h, :] = softmax(q[t,h]·K[0..=pos_t]ᵀ / sqrt(head_dim)) · V[0..=pos_t]` for every token
/// `t` and query head `h`, with KV head `h / (n_heads / n_kv_heads)`.
///
/// - `q`, `out`: `[n_tokens, n_heads, head_dim]` f32
/// - `k_pool`, `v_pool`: `[num_blocks, block_size, n_kv_heads, head_dim]` f32
///
/// K/V of every position up to `pos_t` (including the token itself) must already be written.
pub fn paged_attention(
    q: &[f32],
    tokens: &[AttnToken<'_>],
    k_pool: &[f32],
    v_pool: &[f32],
    g: AttnGeometry,
    out: &mut [f32],
) {
    let hd = g.head_dim;
    let group = g.n_heads / g.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let simd = hd.is_multiple_of(16) && super::matmul::isa() == super::matmul::Isa::Avx512;
    out.par_chunks_mut(group * hd).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(scores, offs): &mut (Vec<f32>, Vec<usize>), (idx, o)| {
            let (t, kvh) = (idx / g.n_kv_heads, idx % g.n_kv_heads);
            let tok = tokens[t];
            offs.clear();
            offs.extend((0..=tok.pos).map(|p| {
                let b = tok.block_table[p / g.block_size].0 as usize;
                ((b * g.block_size + p % g.block_size) * g.n_kv_heads + kvh) * hd
            }));
            let h0 = (t * g.n_heads + kvh * group) * hd;
            let job = GroupJob {
                q: &q[h0..h0 + group * hd],
                offs,
                k_pool,
                v_pool,
                hd,
                scale,
            };
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: `simd` implies AVX-512F was detected and head_dim % 16 == 0.
                unsafe { attend_group_avx512(&job, o, scores) };
                return;
            }
            let _ = simd;
            attend_group(&job, o, scores, dot, axpy);
        },
    );
}

/// The query heads sharing one KV head, for one token.
struct GroupJob<'a> {
    /// `[group, head_dim]`
    q: &'a [f32],
    /// Pool offset of every attended position's K/V vector for this KV head.
    offs: &'a [usize],
    k_pool: &'a [f32],
    v_pool: &'a [f32],
    hd: usize,
    scale: f32,
}

#[inline(always)]
fn attend_group(
    job: &GroupJob<'_>,
    o: &mut [f32],
    scores: &mut Vec<f32>,
    dot: impl Fn(&[f32], &[f32]) -> f32,
    axpy: impl Fn(&mut [f32], f32, &[f32]),
) {
    let hd = job.hd;
    for (qh, oh) in job.q.chunks_exact(hd).zip(o.chunks_exact_mut(hd)) {
        scores.clear();
        let mut mx = f32::NEG_INFINITY;
        for &off in job.offs {
            let s = dot(qh, &job.k_pool[off..off + hd]) * job.scale;
            mx = mx.max(s);
            scores.push(s);
        }
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = (*s - mx).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        oh.fill(0.0);
        for (&off, &s) in job.offs.iter().zip(scores.iter()) {
            axpy(oh, s * inv, &job.v_pool[off..off + hd]);
        }
    }
}

/// [`attend_group`] compiled for AVX-512 so the 16-lane dot/axpy inline.
///
/// # Safety
/// AVX-512F must be available and `head_dim % 16 == 0`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_group_avx512(job: &GroupJob<'_>, o: &mut [f32], scores: &mut Vec<f32>) {
    attend_group(
        job,
        o,
        scores,
        // SAFETY: AVX-512F is available (this function's contract); lengths are head_dim.
        |a, b| unsafe { super::simd::dot16(a, b) },
        |y, a, x| unsafe { super::simd::axpy16(y, a, x) },
    );
}

/// `y += alpha · x` (portable).
#[inline]
fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (a, &b) in y.iter_mut().zip(x) {
        *a += alpha * b;
    }
}

/// Portable dot product with 8 independent accumulators (vectorises without fast-math).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_position_returns_v() {
        // one block of size 2, one kv head shared by two query heads, head_dim 8
        let g = AttnGeometry {
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 8,
            block_size: 2,
        };
        let k = vec![0.5f32; 2 * 8];
        let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let q = vec![1.0f32; 16];
        let bt = [BlockId(0)];
        let mut out = vec![0.0; 16];
        paged_attention(
            &q,
            &[AttnToken {
                pos: 0,
                block_table: &bt,
            }],
            &k,
            &v,
            g,
            &mut out,
        );
        assert_eq!(&out[..8], &v[..8]);
        assert_eq!(&out[8..], &v[..8]);
    }

    #[test]
    fn paged_gqa_matches_dense_reference() {
        // 4 query heads over 2 KV heads, head_dim 64, block size 4, scrambled block table.
        let g = AttnGeometry {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 64,
            block_size: 4,
        };
        let (nb, len) = (6, 21);
        let mut seed = 1u32;
        let mut rnd = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    (seed >> 9) as f32 / (1u32 << 23) as f32 - 0.5
                })
                .collect()
        };
        let per_pos = g.n_kv_heads * g.head_dim;
        let k = rnd(nb * g.block_size * per_pos);
        let v = rnd(nb * g.block_size * per_pos);
        let bt: Vec<BlockId> = [5u32, 2, 0, 4, 1, 3].iter().map(|&b| BlockId(b)).collect();
        let q = rnd(len * g.n_heads * g.head_dim);
        let toks: Vec<AttnToken<'_>> = (0..len)
            .map(|pos| AttnToken {
                pos,
                block_table: &bt,
            })
            .collect();
        let mut out = vec![0.0; q.len()];
        paged_attention(&q, &toks, &k, &v, g, &mut out);
        let kv_at = |pool: &[f32], p: usize, kvh: usize, d: usize| {
            let b = bt[p / g.block_size].0 as usize;
            pool[((b * g.block_size + p % g.block_size) * g.n_kv_heads + kvh) * g.head_dim + d]
        };
        for t in 0..len {
            for h in 0..g.n_heads {
                let kvh = h / 2;
                let qh = &q[(t * g.n_heads + h) * 64..][..64];
                let s: Vec<f64> = (0..=t)
                    .map(|p| {
                        (0..64)
                            .map(|d| f64::from(qh[d] * kv_at(&k, p, kvh, d)))
                            .sum::<f64>()
                            / 8.0
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..64 {
                    let want: f64 = (0..=t)
                        .map(|p| e[p] / z * f64::from(kv_at(&v, p, kvh, d)))
                        .sum();
                    let got = out[(t * g.n_heads + h) * 64 + d];
                    assert!((f64::from(got) - want).abs() < 1e-5, "t={t} h={h} d={d}");
                }
            }
        }
    }
}
