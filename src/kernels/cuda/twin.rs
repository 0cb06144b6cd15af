//! CPU twins of the CUDA kernels in `kernels.cu`: the same math in the same decomposition
//! (threads of a block, tiles, the order of every reduction), run sequentially. On a GPU the
//! results agree to rounding, not bit for bit: NVRTC fuses multiply-adds. They are tested
//! here against the CPU kernels (`kernels/cpu/`), so the kernels' algorithms (online softmax over
//! tiles, nibble order, tie rules, bf16 rounding) are checked on every machine; the device
//! script checks that the CUDA code does what its twin does.
//!
//! Constants mirror the `#define`s of `kernels.cu`.

use half::bf16;

use crate::kernels::quant::{BlockQ4_1, BlockQ8_0, QK};

/// Threads per block of every reducing kernel (`THREADS`).
pub const THREADS: usize = 256;
/// Threads per block of `paged_attention` (`ATT_THREADS`): positions per tile.
pub const ATT_THREADS: usize = 128;
/// Largest head dimension `paged_attention` handles (`ATT_MAX_HEAD_DIM`).
pub const ATT_MAX_HEAD_DIM: usize = 256;
/// Most rows one `gemv_*` launch multiplies (`GEMV_MAX_M`).
pub const GEMV_MAX_M: usize = 8;

/// `__shfl_xor_sync` butterfly over one warp's 32 values; returns lane 0's result.
fn warp_reduce(mut v: [f32; 32], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut o = 16;
    while o > 0 {
        let prev = v;
        for (l, x) in v.iter_mut().enumerate() {
            *x = op(prev[l], prev[l ^ o]);
        }
        o >>= 1;
    }
    v[0]
}

fn warp_sum(v: [f32; 32]) -> f32 {
    warp_reduce(v, |a, b| a + b)
}

/// `block_sum` / `block_max`: per warp, then warp 0 over the warps' results (`identity` in
/// lanes past the last warp).
fn block_reduce(vals: &[f32], identity: f32, op: impl Fn(f32, f32) -> f32 + Copy) -> f32 {
    assert!(vals.len().is_multiple_of(32));
    let mut warps = [identity; 32];
    for (w, chunk) in vals.chunks_exact(32).enumerate() {
        let mut lanes = [0f32; 32];
        lanes.copy_from_slice(chunk);
        warps[w] = warp_reduce(lanes, op);
    }
    warp_reduce(warps, op)
}

fn block_sum(vals: &[f32]) -> f32 {
    block_reduce(vals, 0.0, |a, b| a + b)
}

fn block_max(vals: &[f32]) -> f32 {
    block_reduce(vals, f32::NEG_INFINITY, f32::max)
}

/// `f32_to_bf16`: round to nearest even, NaN kept quiet.
pub fn f32_to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// `rms_norm`, one row per block.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mut part = [0f32; THREADS];
        for (t, p) in part.iter_mut().enumerate() {
            let mut i = t;
            while i < d {
                *p += xr[i] * xr[i];
                i += THREADS;
            }
        }
        let ss = block_sum(&part);
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &g) in o.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// `rope`: `x` is `[tokens, heads, head_dim]`.
pub fn rope(
    x: &mut [f32],
    positions: &[usize],
    inv_freq: &[f64],
    heads: usize,
    head_dim: usize,
    interleaved: bool,
) {
    let half = inv_freq.len();
    for (xt, &pos) in x.chunks_exact_mut(heads * head_dim).zip(positions) {
        for j in 0..heads * half {
            let (h, i) = (j / half, j % half);
            let a = pos as f64 * inv_freq[i];
            let (c, s) = (a.cos() as f32, a.sin() as f32);
            let (ia, ib) = if interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let hp = &mut xt[h * head_dim..(h + 1) * head_dim];
            let (x0, x1) = (hp[ia], hp[ib]);
            hp[ia] = x0 * c - x1 * s;
            hp[ib] = x0 * s + x1 * c;
        }
    }
}

/// `swiglu`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `q8_0_at`: element `i` of a run of Q8_0 blocks.
pub fn q8_0_at(blocks: &[BlockQ8_0], i: usize) -> f32 {
    let b = &blocks[i / QK];
    b.d.to_f32() * f32::from(b.qs[i % QK])
}

/// `q4_1_at`: element `i` of a run of Q4_1 blocks.
pub fn q4_1_at(blocks: &[BlockQ4_1], i: usize) -> f32 {
    let b = &blocks[i / QK];
    let j = i % QK;
    let q = b.qs[j & 15];
    let q = if j < 16 { q & 15 } else { q >> 4 };
    b.d.to_f32() * f32::from(q) + b.m.to_f32()
}

/// `dequant_q4_1_bf16` (and, with [`q8_0_at`], `dequant_q8_0_bf16`).
pub fn dequant_bf16(n: usize, at: impl Fn(usize) -> f32) -> Vec<u16> {
    (0..n).map(|i| f32_to_bf16(at(i))).collect()
}

/// How a `gemv_*` kernel walks a row: which elements lane `l` adds, in which order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvWalk {
    /// `gemv_q4_1`: quant blocks `l, l + 32, …`; per step the byte's two elements `j`, `j + 16`.
    Q4_1,
    /// `gemv_q8_0`: quant blocks `l, l + 32, …`; their 32 elements in order.
    Q8_0,
    /// `gemv_f32`: elements `l, l + 32, …`.
    F32,
}

/// `gemv_*`: `y[r, row] = x[r, :] · W[row, :]` for `r < m ≤ GEMV_MAX_M`; `w_at(row, c)` is the
/// dequantised weight. Each lane's partial sum is combined by the warp butterfly.
pub fn gemv(
    walk: GemvWalk,
    w_at: impl Fn(usize, usize) -> f32,
    x: &[f32],
    y: &mut [f32],
    (rows, cols, m): (usize, usize, usize),
) {
    assert!(m <= GEMV_MAX_M && cols.is_multiple_of(QK));
    let nb = cols / QK;
    for row in 0..rows {
        let mut acc = [[0f32; 32]; GEMV_MAX_M];
        for lane in 0..32 {
            let mut add = |c: usize| {
                let w = w_at(row, c);
                for (r, a) in acc.iter_mut().enumerate().take(m) {
                    a[lane] += w * x[r * cols + c];
                }
            };
            match walk {
                GemvWalk::Q4_1 => {
                    for b in (lane..nb).step_by(32) {
                        for j in 0..QK / 2 {
                            let (c0, c1) = (b * QK + j, b * QK + j + QK / 2);
                            let (w0, w1) = (w_at(row, c0), w_at(row, c1));
                            for (r, a) in acc.iter_mut().enumerate().take(m) {
                                a[lane] += w0 * x[r * cols + c0] + w1 * x[r * cols + c1];
                            }
                        }
                    }
                }
                GemvWalk::Q8_0 => (lane..nb)
                    .step_by(32)
                    .for_each(|b| (b * QK..(b + 1) * QK).for_each(&mut add)),
                GemvWalk::F32 => (lane..cols).step_by(32).for_each(add),
            }
        }
        for (r, a) in acc.iter().enumerate().take(m) {
            y[r * rows + row] = warp_sum(*a);
        }
    }
}

/// `copy_runs`: `dst[dst_off[r] + i] = src[src_off[r] + i]` for `i < run_len`.
pub fn copy_runs(src: &[f32], dst: &mut [f32], src_off: &[usize], dst_off: &[usize], len: usize) {
    for (&s, &d) in src_off.iter().zip(dst_off) {
        dst[d..d + len].copy_from_slice(&src[s..s + len]);
    }
}

/// Where `paged_attention` reads position `p` of one KV head.
#[derive(Debug, Clone, Copy)]
pub struct PagedGeometry {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// `paged_attention`: token `t` at `positions[t]` reads its block table
/// `block_tables[table_start[t]..]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    positions: &[usize],
    table_start: &[usize],
    block_tables: &[u32],
    g: PagedGeometry,
    out: &mut [f32],
) {
    let hd = g.head_dim;
    assert!(hd <= ATT_MAX_HEAD_DIM);
    let scale = 1.0 / (hd as f32).sqrt();
    let group = g.n_heads / g.n_kv_heads;
    for (t, &pos) in positions.iter().enumerate() {
        let bt = &block_tables[table_start[t]..];
        let off = |p: usize, kvh: usize| {
            ((bt[p / g.block_size] as usize * g.block_size + p % g.block_size) * g.n_kv_heads + kvh)
                * hd
        };
        for h in 0..g.n_heads {
            let kvh = h / group;
            let qh = &q[(t * g.n_heads + h) * hd..][..hd];
            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
            let mut acc = [[0f32; ATT_THREADS]; 2];
            let mut p0 = 0;
            while p0 <= pos {
                let mut s = [f32::NEG_INFINITY; ATT_THREADS];
                for (tid, st) in s.iter_mut().enumerate() {
                    let p = p0 + tid;
                    if p <= pos {
                        let k = &k_pool[off(p, kvh)..][..hd];
                        let dot = qh.iter().zip(k).fold(0f32, |a, (&x, &y)| a + x * y);
                        *st = dot * scale;
                    }
                }
                let m_new = m.max(block_max(&s));
                let corr = (m - m_new).exp();
                let mut e = [0f32; ATT_THREADS];
                for (tid, ev) in e.iter_mut().enumerate() {
                    if p0 + tid <= pos {
                        *ev = (s[tid] - m_new).exp();
                    }
                }
                l = l * corr + block_sum(&e);
                for half in &mut acc {
                    half.iter_mut().for_each(|a| *a *= corr);
                }
                let cnt = ATT_THREADS.min(pos - p0 + 1);
                for (j, &wgt) in e.iter().enumerate().take(cnt) {
                    let v = &v_pool[off(p0 + j, kvh)..][..hd];
                    for tid in 0..ATT_THREADS {
                        if tid < hd {
                            acc[0][tid] += wgt * v[tid];
                        }
                        if tid + ATT_THREADS < hd {
                            acc[1][tid] += wgt * v[tid + ATT_THREADS];
                        }
                    }
                }
                m = m_new;
                p0 += ATT_THREADS;
            }
            let o = &mut out[(t * g.n_heads + h) * hd..][..hd];
            let inv = 1.0 / l;
            for (d, od) in o.iter_mut().enumerate() {
                *od = acc[d / ATT_THREADS][d % ATT_THREADS] * inv;
            }
        }
    }
}

/// `row_stats` of one row: `(argmax, max, log-sum-exp)`.
pub fn row_stats(x: &[f32]) -> (u32, f32, f32) {
    let mut bv = [f32::NEG_INFINITY; THREADS];
    let mut bi = [i32::MAX; THREADS];
    for tid in 0..THREADS {
        let mut i = tid;
        while i < x.len() {
            if x[i] > bv[tid] {
                bv[tid] = x[i];
                bi[tid] = i as i32;
            }
            i += THREADS;
        }
    }
    let mut s = THREADS / 2;
    while s > 0 {
        for tid in 0..s {
            let (ov, oi) = (bv[tid + s], bi[tid + s]);
            if ov > bv[tid] || (ov == bv[tid] && oi < bi[tid]) {
                bv[tid] = ov;
                bi[tid] = oi;
            }
        }
        s >>= 1;
    }
    let (mx, best) = (bv[0], bi[0]);
    let mut sums = [0f64; THREADS];
    for (tid, sum) in sums.iter_mut().enumerate() {
        let mut i = tid;
        while i < x.len() {
            *sum += f64::from(x[i] - mx).exp();
            i += THREADS;
        }
    }
    let mut s = THREADS / 2;
    while s > 0 {
        for tid in 0..s {
            sums[tid] += sums[tid + s];
        }
        s >>= 1;
    }
    let best = if best == i32::MAX { 0 } else { best as u32 };
    (best, mx, sums[0].ln() as f32 + mx)
}

/// bf16 back to f32 (`bf16_to_f32`).
pub fn bf16_to_f32(h: u16) -> f32 {
    bf16::from_bits(h).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::{attention, norm};
    use crate::kernels::quant::{MatrixData, WeightMatrix, quantize_q4_1, quantize_q8_0};
    use crate::kernels::sample;
    use crate::kernels::{AttnGeometry, AttnToken, Rope, RopeLayout};
    use crate::runtime::ids::BlockId;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut r = StdRng::seed_from_u64(seed);
        (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            let lim = tol * (1.0 + y.abs());
            assert!((x - y).abs() <= lim, "element {i}: twin {x} vs cpu {y}");
        }
    }

    #[test]
    fn bf16_rounding_is_halfs() {
        let mut vals = data(4096, 1);
        vals.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE / 3.0,
            1.0 + f32::EPSILON,
            f32::from_bits(0x3f80_8000), // a tie: rounds to even
            f32::from_bits(0x3f81_8000),
        ]);
        for v in vals {
            assert_eq!(f32_to_bf16(v), bf16::from_f32(v).to_bits(), "{v}");
        }
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn rms_norm_matches_cpu() {
        for d in [64, 576, 1000] {
            let x = data(3 * d, 2);
            let w = data(d, 3);
            let (mut a, mut b) = (vec![0.0; 3 * d], vec![0.0; 3 * d]);
            rms_norm(&x, &w, 1e-5, &mut a);
            norm::rms_norm(&x, &w, 1e-5, &mut b);
            close(&a, &b, 1e-5);
        }
    }

    #[test]
    fn rope_matches_cpu_in_both_layouts() {
        let (heads, hd) = (3, 64);
        for (layout, interleaved) in [
            (RopeLayout::Interleaved, true),
            (RopeLayout::HalfSplit, false),
        ] {
            for rot in [hd, hd / 2] {
                let r = Rope::new(hd, rot, 10000.0, layout);
                let positions = [0usize, 7, 4095];
                let x = data(positions.len() * heads * hd, 4);
                let mut a = x.clone();
                rope(&mut a, &positions, r.inv_freq(), heads, hd, interleaved);
                let mut b = x.clone();
                for (row, &p) in b.chunks_exact_mut(heads * hd).zip(&positions) {
                    r.apply(row, p);
                }
                assert_eq!(a, b, "{layout:?} rot {rot}");
            }
        }
    }

    #[test]
    fn dequant_and_gemv_match_cpu_matmul() {
        let (rows, cols) = (40, 96);
        let wf = data(rows * cols, 5);
        let q8 = quantize_q8_0(&wf);
        let q4 = quantize_q4_1(&wf);
        let mats = [
            WeightMatrix {
                rows,
                cols,
                data: MatrixData::Q8_0(q8.clone()),
            },
            WeightMatrix {
                rows,
                cols,
                data: MatrixData::Q4_1(q4.clone()),
            },
        ];
        let f = wf.clone();
        type At<'a> = Box<dyn Fn(usize) -> f32 + 'a>;
        let ats: [(GemvWalk, At<'_>); 2] = [
            (GemvWalk::Q8_0, Box::new(|i| q8_0_at(&q8, i))),
            (GemvWalk::Q4_1, Box::new(|i| q4_1_at(&q4, i))),
        ];
        for (w, (walk, at)) in mats.iter().zip(&ats) {
            // Element access and bf16 dequantisation agree with the CPU's dequantisation.
            let full = w.to_f32();
            let mine: Vec<f32> = (0..rows * cols).map(at).collect();
            assert_eq!(mine, full);
            let b = dequant_bf16(rows * cols, at);
            let want: Vec<u16> = full.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            assert_eq!(b, want);
            for m in [1, 3, GEMV_MAX_M] {
                let x = data(m * cols, 6);
                let (mut a, mut c) = (vec![0.0; m * rows], vec![0.0; m * rows]);
                gemv(*walk, |r, k| at(r * cols + k), &x, &mut a, (rows, cols, m));
                crate::kernels::cpu::matmul::matmul(&x, m, w, &mut c);
                close(&a, &c, 1e-5);
            }
        }
        let wm = WeightMatrix {
            rows,
            cols,
            data: MatrixData::F32(f.clone()),
        };
        let x = data(2 * cols, 11);
        let (mut a, mut c) = (vec![0.0; 2 * rows], vec![0.0; 2 * rows]);
        gemv(
            GemvWalk::F32,
            |r, k| f[r * cols + k],
            &x,
            &mut a,
            (rows, cols, 2),
        );
        crate::kernels::cpu::matmul::matmul(&x, 2, &wm, &mut c);
        close(&a, &c, 1e-5);
    }

    #[test]
    fn paged_attention_matches_cpu_across_tiles_and_gqa() {
        let g = PagedGeometry {
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: 64,
            block_size: 16,
        };
        let num_blocks = 40;
        let kvd = g.n_kv_heads * g.head_dim;
        let k_pool = data(num_blocks * g.block_size * kvd, 7);
        let v_pool = data(num_blocks * g.block_size * kvd, 8);
        // Two sequences with scattered blocks: one short (decode at 5), one past two tiles.
        let t0: Vec<u32> = vec![17];
        let t1: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % num_blocks as u32).collect();
        let positions = [5usize, 0, 127, 128, 300];
        let starts = [0usize, 0, 1, 1, 1];
        let mut tables = t0.clone();
        tables.extend(&t1);
        let q = data(positions.len() * g.n_heads * g.head_dim, 9);
        let mut a = vec![0.0; q.len()];
        paged_attention(
            &q, &k_pool, &v_pool, &positions, &starts, &tables, g, &mut a,
        );
        let bt0: Vec<BlockId> = t0.iter().map(|&b| BlockId(b)).collect();
        let bt1: Vec<BlockId> = t1.iter().map(|&b| BlockId(b)).collect();
        let toks: Vec<AttnToken<'_>> = positions
            .iter()
            .zip(starts)
            .map(|(&pos, s)| AttnToken {
                pos,
                block_table: if s == 0 { &bt0 } else { &bt1 },
            })
            .collect();
        let mut b = vec![0.0; q.len()];
        let geo = AttnGeometry {
            n_heads: g.n_heads,
            n_kv_heads: g.n_kv_heads,
            head_dim: g.head_dim,
            block_size: g.block_size,
        };
        attention::paged_attention(&q, &toks, &k_pool, &v_pool, geo, &mut b);
        close(&a, &b, 2e-5);
    }

    #[test]
    fn row_stats_match_cpu_argmax_and_logprob() {
        let mut x = data(49_152, 10);
        for (i, v) in [(5usize, 3.0f32), (40_000, 3.0), (7, f32::NAN)] {
            x[i] = v;
        }
        let (best, mx, lse) = row_stats(&x);
        assert_eq!(best, sample::argmax(&x));
        assert_eq!(best, 5, "lowest index wins a tie");
        assert_eq!(mx, 3.0);
        // A NaN logit makes both log-sum-exps NaN; without it they agree.
        assert!(lse.is_nan() && sample::log_prob(&x, best).is_nan());
        x[7] = 0.5;
        let (best, mx, lse) = row_stats(&x);
        let lp = sample::log_prob(&x, best);
        assert!((mx - lse - lp).abs() < 1e-5, "{} vs {lp}", mx - lse);
        let all_neg = vec![f32::NEG_INFINITY; 300];
        assert_eq!(row_stats(&all_neg).0, sample::argmax(&all_neg));
    }

    #[test]
    fn copy_runs_moves_whole_blocks() {
        let src: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let mut dst = vec![0.0; 32];
        copy_runs(&src, &mut dst, &[48, 16], &[0, 16], 16);
        assert_eq!(&dst[..16], &src[48..]);
        assert_eq!(&dst[16..], &src[16..32]);
    }
}
