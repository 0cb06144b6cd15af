//! Compute kernels of the forward pass, behind a small device boundary.
//!
//! Layout:
//! - `mod.rs`: the [`Backend`] trait (one method per op) and [`Device`] selection.
//! - `quant.rs`: weight storage ([`quant::WeightMatrix`]: f32 / Q8_0 / Q4_1 blocks) and (de)quantisation.
//! - `sample.rs`: greedy / temperature / top-k / top-p sampling with per-sequence seeded RNGs.
//! - `cpu/mod.rs`: [`cpu::CpuBackend`], the CPU implementation (rayon over rows / heads).
//! - `cpu/matmul.rs`: `y = x·Wᵀ` (gemm for f32 and large batches, AVX-512 in-register dequant for decode).
//! - `cpu/simd.rs`: the AVX-512 register-tile kernels behind `cpu/matmul.rs` and attention.
//! - `cpu/simd_avx2.rs`: their AVX2 + FMA twins for CPUs without AVX-512.
//! - `cpu/tile.rs`: the register tile (rows × activation rows) those kernels are written for.
//! - `cpu/norm.rs`: RMSNorm.
//! - `cpu/rope.rs`: rotary embeddings, adjacent-pair (GGUF) and half-split (HF) layouts.
//! - `cpu/attention.rs`: paged causal attention with grouped-query heads.
//! - `cpu/activation.rs`: SwiGLU and softmax.
//! - `cuda/`: the GPU path: CUDA kernels (NVRTC sources) with CPU twins, the forward pass over
//!   device buffers, the CUDA device (feature `cuda`, libraries loaded at run time) and
//!   backend selection.
//!
//! [`Backend`] is the CPU's op boundary: activations are host f32 slices and
//! `model/forward.rs` calls one op at a time. A GPU keeps a whole step's activations on the
//! device instead, so the GPU path has its own pass (`model/device_forward.rs` over `cuda/pass.rs`'s
//! `DeviceOps`, the same ops in the same order) and [`Device`] says which of the two an engine runs.

pub mod cpu;
pub mod cuda;
pub mod quant;
pub mod sample;

pub use cpu::attention::{AttnGeometry, AttnToken};
pub use cpu::rope::{Rope, RopeLayout};
pub use quant::{MatrixData, WeightMatrix};

/// The ops one forward pass needs. Shapes are row-major; every tensor is f32 unless stated.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Short name for logs ("cpu").
    fn name(&self) -> &'static str;
    /// `y[m, w.rows] = x[m, w.cols] · Wᵀ`.
    fn matmul(&self, x: &[f32], m: usize, w: &WeightMatrix, y: &mut [f32]);
    /// `ys[i] = x · ws[i]ᵀ` for several matrices of the same input width (one pass when the
    /// backend can fuse them). Default: one [`Backend::matmul`] per matrix.
    fn matmul_many(&self, x: &[f32], m: usize, ws: &[&WeightMatrix], ys: &mut [&mut [f32]]) {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            self.matmul(x, m, w, y);
        }
    }
    /// RMSNorm of each row of `x` (`[n, d]`) with gain `w` (`[d]`) into `out` (`[n, d]`).
    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]);
    /// Rotates `x` (`[n, heads, head_dim]`) in place; row `i` is at position `positions[i]`.
    fn rope(&self, rope: &Rope, x: &mut [f32], positions: &[usize]);
    /// Paged attention, see [`cpu::attention::paged_attention`].
    fn paged_attention(
        &self,
        q: &[f32],
        tokens: &[AttnToken<'_>],
        k_pool: &[f32],
        v_pool: &[f32],
        geometry: AttnGeometry,
        out: &mut [f32],
    );
    /// `gate = silu(gate) · up`, both `[n, ffn]`.
    fn swiglu(&self, gate: &mut [f32], up: &[f32]);
}

/// Where the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// Host CPU (rayon thread pool).
    #[default]
    Cpu,
    /// GPU `ordinal` through the CUDA kernels (feature `cuda`).
    Cuda {
        ordinal: usize,
        precision: cuda::GemmPrecision,
        /// When the GPU engine cannot start (no memory, kernels that do not load), run on the
        /// CPU instead, with a warning (`worker.backend = "auto"`); else fail.
        cpu_fallback: bool,
    },
    /// The GPU pass on the host through the kernels' CPU twins (`cuda/pass.rs` `HostOps`):
    /// slow; it checks the GPU path's bookkeeping where no GPU is.
    CudaTwin { precision: cuda::GemmPrecision },
}

/// One sequence's slice of the batch.
#[derive(Debug, Clone, Copy)]
pub struct ForwardSeq<'a> {
    /// New tokens, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// Covers positions `0..start_pos + tokens.len()`.
    pub block_table: &'a [crate::runtime::ids::BlockId],
    /// Compute the logits of this sequence's last token.
    pub want_logits: bool,
    /// Compute the logits of every token of this sequence (prompt log-probabilities, `echo`);
    /// implies `want_logits`. Its rows come in position order, the last token's last.
    pub all_logits: bool,
}
