//! CPU implementation of [`super::Backend`]; see the parent module for the file map.

pub mod activation;
pub mod attention;
pub mod matmul;
pub mod norm;
pub mod rope;
#[cfg(target_arch = "x86_64")]
pub mod simd;
#[cfg(target_arch = "x86_64")]
pub mod simd_avx2;
pub mod tile;

use rayon::prelude::*;

use super::{AttnGeometry, AttnToken, Backend, Rope, WeightMatrix};

/// The CPU backend: stateless, threads come from the global rayon pool.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn matmul(&self, x: &[f32], m: usize, w: &WeightMatrix, y: &mut [f32]) {
        matmul::matmul(x, m, w, y);
    }
    fn matmul_many(&self, x: &[f32], m: usize, ws: &[&WeightMatrix], ys: &mut [&mut [f32]]) {
        matmul::matmul_many(x, m, ws, ys);
    }
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        norm::rms_norm(x, w, eps, out);
    }
    fn rope(&self, rope: &Rope, x: &mut [f32], positions: &[usize]) {
        if positions.is_empty() {
            return;
        }
        let row = x.len() / positions.len();
        if positions.len() < 16 {
            for (r, &p) in x.chunks_mut(row).zip(positions) {
                rope.apply(r, p);
            }
            return;
        }
        x.par_chunks_mut(row)
            .zip(positions.par_iter())
            .for_each(|(r, &p)| rope.apply(r, p));
    }
    fn paged_attention(
        &self,
        q: &[f32],
        tokens: &[AttnToken<'_>],
        k_pool: &[f32],
        v_pool: &[f32],
        geometry: AttnGeometry,
        out: &mut [f32],
    ) {
        attention::paged_attention(q, tokens, k_pool, v_pool, geometry, out);
    }
    fn swiglu(&self, gate: &mut [f32], up: &[f32]) {
        if gate.len() >= 1 << 15 {
            gate.par_chunks_mut(4096)
                .zip(up.par_chunks(4096))
                .for_each(|(g, u)| activation::swiglu(g, u));
        } else {
            activation::swiglu(gate, up);
        }
    }
}
