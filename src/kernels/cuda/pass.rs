//! The GPU forward pass, written once over [`DeviceOps`]: the CUDA implementation
//! (`device.rs`, feature `cuda`) launches the kernels of `kernels.cu`; [`HostOps`] runs their
//! CPU twins (`twin.rs`) on host vectors. Tests run the pass on [`HostOps`] against the CPU
//! engine and the golden outputs, so the order of the ops, every buffer's size and every
//! offset are checked on machines without a GPU; on a GPU only the launches themselves differ.
//!
//! The pass is [`crate::model::forward::forward`]'s, op for op: per layer RMSNorm, q/k/v
//! (+ bias), RoPE, K/V into the paged pools, paged attention, output projection and residual,
//! RMSNorm, gate/up, SwiGLU, down projection and residual; then the final RMSNorm and the
//! output projection for the rows whose logits are wanted. Activations stay on the device for
//! the whole step; only the plan goes up and the logits' statistics (or wanted rows) come down.

use std::ptr::NonNull;
use std::sync::Arc;

use super::plan::StepPlan;
use super::twin;
use crate::kernels::quant::{MatrixData, WeightMatrix};
use crate::kernels::{AttnGeometry, RopeLayout};
use crate::kv::memory::LeasedHost;
use crate::kv::memory::{DeviceAccess, MemoryKind, MemoryLease};

/// How prefill matrix products (more rows than one decode GEMV takes) are computed.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum GemmPrecision {
    /// f32 weights (dequantised once at load) and activations, f32 accumulation (cuBLAS
    /// SGEMM without TF32): the CPU engine's numbers, so a sequence migrated between a CPU and
    /// a GPU replica continues with the same tokens. 4 bytes per weight on the device.
    #[default]
    F32,
    /// bf16 weights and activations, f32 accumulation (cuBLAS `gemmEx`, tensor cores): the
    /// fast path; logits move by ~1e-2 against f32. 2 bytes per weight on the device.
    Bf16,
}

impl std::str::FromStr for GemmPrecision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            other => Err(format!("unknown precision {other:?} (f32 or bf16)")),
        }
    }
}

/// Where the K and V pools of one layer start (elements) in the engine's one KV buffer,
/// laid out `[layer][K, V][block]` as [`crate::model::kv_cache::KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPools {
    pub k: usize,
    pub v: usize,
}

impl LayerPools {
    /// Layer `l` of a cache whose pools hold `pool_elems` f32 each.
    pub fn of(l: usize, pool_elems: usize) -> Self {
        Self {
            k: 2 * l * pool_elems,
            v: (2 * l + 1) * pool_elems,
        }
    }
}

/// The device operations of one forward pass. Every length is explicit (elements or rows),
/// so buffers may be larger than a step needs (a workspace is reused across steps).
pub trait DeviceOps {
    /// An f32 buffer on the device.
    type Buf: std::fmt::Debug;
    /// A weight matrix on the device (its quantised blocks and its GEMM copy).
    type Mat: std::fmt::Debug;
    /// A step's [`StepPlan`] on the device.
    type Plan;
    /// RoPE's `inv_freq` table on the device.
    type RopeTable: std::fmt::Debug;
    type Error;

    /// Makes the device current on the calling thread (before every step: steps run on
    /// whichever thread of a pool is free). Default: nothing to do.
    fn bind(&self) -> Result<(), Self::Error> {
        Ok(())
    }
    /// A zeroed buffer of `n` f32.
    fn zeros(&self, n: usize) -> Result<Self::Buf, Self::Error>;
    /// How a transport reaches `pools` (a buffer from [`DeviceOps::zeros`], `bytes` long): its
    /// address, its memory kind and synchronous copies to and from host buffers, each made
    /// under `lease` (which the owner revokes before freeing `pools`). `None`: no transport
    /// can reach it (the default).
    fn transport_access(
        &self,
        pools: &Self::Buf,
        lease: &Arc<MemoryLease>,
    ) -> Option<(NonNull<u8>, MemoryKind, Box<dyn DeviceAccess>)> {
        let _ = (pools, lease);
        None
    }
    /// Uploads host values.
    fn upload(&self, v: &[f32]) -> Result<Self::Buf, Self::Error>;
    /// Uploads a weight matrix for both the GEMV (quantised) and the GEMM (`precision`) path.
    fn upload_matrix(
        &self,
        w: &WeightMatrix,
        precision: GemmPrecision,
    ) -> Result<Self::Mat, Self::Error>;
    fn upload_rope(&self, inv_freq: &[f64]) -> Result<Self::RopeTable, Self::Error>;
    /// The plan, with `width` (the hidden size) to turn its row numbers into offsets.
    fn upload_plan(&self, plan: &StepPlan, width: usize) -> Result<Self::Plan, Self::Error>;
    /// `values[range]` back to the host.
    fn download(
        &self,
        b: &Self::Buf,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<f32>, Self::Error>;

    /// `out[t, :] = table[tokens[t], :]` for the plan's `n` tokens; `cols` = hidden size.
    fn embed(
        &self,
        table: &Self::Mat,
        plan: &Self::Plan,
        n: usize,
        cols: usize,
        out: &mut Self::Buf,
    ) -> Result<(), Self::Error>;
    /// RMSNorm of `shape.0` rows of width `shape.1`.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        shape: (usize, usize),
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<(), Self::Error>;
    /// `y[m, w.rows] = x[m, w.cols] · Wᵀ`: GEMV with on-the-fly dequantisation for
    /// `m ≤ GEMV_MAX_M`, the GEMM copy otherwise.
    fn matmul(
        &self,
        x: &Self::Buf,
        m: usize,
        w: &Self::Mat,
        y: &mut Self::Buf,
    ) -> Result<(), Self::Error>;
    /// `x[r, c] += b[c]` over `n` elements of rows of width `d`.
    fn add_bias(
        &self,
        x: &mut Self::Buf,
        b: &Self::Buf,
        n: usize,
        d: usize,
    ) -> Result<(), Self::Error>;
    /// RoPE in place on `[n, heads, head_dim]` at the plan's positions.
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut Self::Buf,
        table: &Self::RopeTable,
        plan: &Self::Plan,
        n: usize,
        heads: usize,
        head_dim: usize,
        layout: RopeLayout,
    ) -> Result<(), Self::Error>;
    /// The `n` tokens' K and V rows (`kvd` wide) into their slots of one layer's pools.
    #[allow(clippy::too_many_arguments)]
    fn kv_write(
        &self,
        pools: &mut Self::Buf,
        at: LayerPools,
        k: &Self::Buf,
        v: &Self::Buf,
        plan: &Self::Plan,
        n: usize,
        kvd: usize,
    ) -> Result<(), Self::Error>;
    /// Paged causal attention of the plan's `n` tokens over one layer's pools.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf,
        pools: &Self::Buf,
        at: LayerPools,
        plan: &Self::Plan,
        n: usize,
        geometry: AttnGeometry,
        out: &mut Self::Buf,
    ) -> Result<(), Self::Error>;
    /// `x += y` over `n` elements.
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf, n: usize) -> Result<(), Self::Error>;
    /// `gate = silu(gate) · up` over `n` elements.
    fn swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf, n: usize) -> Result<(), Self::Error>;
    /// `dst[i, :] = src[plan.logit_rows[i], :]` (rows of width `d`).
    fn gather_logit_rows(
        &self,
        src: &Self::Buf,
        plan: &Self::Plan,
        rows: usize,
        d: usize,
        dst: &mut Self::Buf,
    ) -> Result<(), Self::Error>;
    /// Per row of `[rows, vocab]` logits: `(argmax, max, log-sum-exp)` (`row_stats`).
    fn row_stats(
        &self,
        logits: &Self::Buf,
        rows: usize,
        vocab: usize,
    ) -> Result<Vec<(u32, f32, f32)>, Self::Error>;
}

/// The pass on host vectors through the kernels' CPU twins (for tests and for checking the
/// pass's bookkeeping where no GPU is), with the CPU engine's matrix products standing in
/// for the GEMV/GEMM launches (their twins are tested on their own in `twin.rs`; a
/// [`GemmPrecision::Bf16`] product rounds weights and activations to bf16 first, as cuBLAS
/// is given them).
#[derive(Debug, Default, Clone, Copy)]
pub struct HostOps;

/// A matrix as [`HostOps`] holds it.
#[derive(Debug, Clone)]
pub struct HostMat {
    pub w: WeightMatrix,
    /// At [`GemmPrecision::Bf16`], the GEMM copy: the weights rounded to bf16 (made once at
    /// upload, as the device makes its bf16 copy).
    pub bf16: Option<WeightMatrix>,
}

/// [`HostOps`]' uploaded plan is the plan.
#[derive(Debug, Clone)]
pub struct HostPlan(StepPlan);

/// [`HostOps`] cannot fail.
#[derive(Debug, thiserror::Error)]
#[error("host ops do not fail")]
pub enum Never {}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| twin::bf16_to_f32(twin::f32_to_bf16(x)))
        .collect()
}

impl DeviceOps for HostOps {
    type Buf = Vec<f32>;
    type Mat = HostMat;
    type Plan = HostPlan;
    type RopeTable = Vec<f64>;
    type Error = Never;

    fn zeros(&self, n: usize) -> Result<Vec<f32>, Never> {
        Ok(vec![0.0; n])
    }

    /// The twin's pools stand in for device memory: host bytes, reached through copies only.
    fn transport_access(
        &self,
        pools: &Vec<f32>,
        lease: &Arc<MemoryLease>,
    ) -> Option<(NonNull<u8>, MemoryKind, Box<dyn DeviceAccess>)> {
        let ptr = NonNull::new(pools.as_ptr() as *mut u8)?;
        // SAFETY: the pools never grow or move, and their engine revokes `lease` before it
        // frees them; KV bytes are accessed under the pinning contract (`kv/memory.rs`).
        let access = unsafe { LeasedHost::new(ptr, lease.clone()) };
        Some((ptr, MemoryKind::Host, Box::new(access)))
    }

    fn upload(&self, v: &[f32]) -> Result<Vec<f32>, Never> {
        Ok(v.to_vec())
    }

    fn upload_matrix(&self, w: &WeightMatrix, precision: GemmPrecision) -> Result<HostMat, Never> {
        let bf16 = (precision == GemmPrecision::Bf16).then(|| WeightMatrix {
            rows: w.rows,
            cols: w.cols,
            data: MatrixData::F32(bf16_round(&w.to_f32())),
        });
        Ok(HostMat { w: w.clone(), bf16 })
    }

    fn upload_rope(&self, inv_freq: &[f64]) -> Result<Vec<f64>, Never> {
        Ok(inv_freq.to_vec())
    }

    fn upload_plan(&self, plan: &StepPlan, _width: usize) -> Result<HostPlan, Never> {
        Ok(HostPlan(plan.clone()))
    }

    fn download(&self, b: &Vec<f32>, range: std::ops::Range<usize>) -> Result<Vec<f32>, Never> {
        Ok(b[range].to_vec())
    }

    fn embed(
        &self,
        table: &HostMat,
        plan: &HostPlan,
        n: usize,
        cols: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), Never> {
        let at = |i: usize| match &table.w.data {
            MatrixData::F32(v) => v[i],
            MatrixData::Q8_0(b) => twin::q8_0_at(b, i),
            MatrixData::Q4_1(b) => twin::q4_1_at(b, i),
        };
        for (row, &t) in out[..n * cols].chunks_exact_mut(cols).zip(&plan.0.tokens) {
            for (c, o) in row.iter_mut().enumerate() {
                *o = at(t as usize * cols + c);
            }
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Vec<f32>,
        (rows, d): (usize, usize),
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), Never> {
        twin::rms_norm(&x[..rows * d], w, eps, &mut out[..rows * d]);
        Ok(())
    }

    fn matmul(&self, x: &Vec<f32>, m: usize, w: &HostMat, y: &mut Vec<f32>) -> Result<(), Never> {
        let (x, y) = (&x[..m * w.w.cols], &mut y[..m * w.w.rows]);
        match &w.bf16 {
            Some(wb) if m > twin::GEMV_MAX_M => {
                crate::kernels::cpu::matmul::matmul(&bf16_round(x), m, wb, y);
            }
            _ => crate::kernels::cpu::matmul::matmul(x, m, &w.w, y),
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, b: &Vec<f32>, n: usize, d: usize) -> Result<(), Never> {
        for (i, v) in x[..n].iter_mut().enumerate() {
            *v += b[i % d];
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        table: &Vec<f64>,
        plan: &HostPlan,
        n: usize,
        heads: usize,
        head_dim: usize,
        layout: RopeLayout,
    ) -> Result<(), Never> {
        let positions: Vec<usize> = plan.0.positions[..n].iter().map(|&p| p as usize).collect();
        twin::rope(
            &mut x[..n * heads * head_dim],
            &positions,
            table,
            heads,
            head_dim,
            layout == RopeLayout::Interleaved,
        );
        Ok(())
    }

    fn kv_write(
        &self,
        pools: &mut Vec<f32>,
        at: LayerPools,
        k: &Vec<f32>,
        v: &Vec<f32>,
        plan: &HostPlan,
        n: usize,
        kvd: usize,
    ) -> Result<(), Never> {
        for (t, &slot) in plan.0.slots[..n].iter().enumerate() {
            let s = slot as usize;
            pools[at.k + s..at.k + s + kvd].copy_from_slice(&k[t * kvd..(t + 1) * kvd]);
            pools[at.v + s..at.v + s + kvd].copy_from_slice(&v[t * kvd..(t + 1) * kvd]);
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        pools: &Vec<f32>,
        at: LayerPools,
        plan: &HostPlan,
        n: usize,
        g: AttnGeometry,
        out: &mut Vec<f32>,
    ) -> Result<(), Never> {
        let p = &plan.0;
        let positions: Vec<usize> = p.positions[..n].iter().map(|&x| x as usize).collect();
        let starts: Vec<usize> = p.table_start[..n].iter().map(|&x| x as usize).collect();
        let tables: Vec<u32> = p.block_tables.iter().map(|&b| b as u32).collect();
        let qd = g.n_heads * g.head_dim;
        twin::paged_attention(
            &q[..n * qd],
            &pools[at.k..],
            &pools[at.v..],
            &positions,
            &starts,
            &tables,
            twin::PagedGeometry {
                n_heads: g.n_heads,
                n_kv_heads: g.n_kv_heads,
                head_dim: g.head_dim,
                block_size: g.block_size,
            },
            &mut out[..n * qd],
        );
        Ok(())
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>, n: usize) -> Result<(), Never> {
        x[..n].iter_mut().zip(&y[..n]).for_each(|(a, &b)| *a += b);
        Ok(())
    }

    fn swiglu(&self, gate: &mut Vec<f32>, up: &Vec<f32>, n: usize) -> Result<(), Never> {
        twin::swiglu(&mut gate[..n], &up[..n]);
        Ok(())
    }

    fn gather_logit_rows(
        &self,
        src: &Vec<f32>,
        plan: &HostPlan,
        rows: usize,
        d: usize,
        dst: &mut Vec<f32>,
    ) -> Result<(), Never> {
        let src_off: Vec<usize> = plan.0.logit_rows[..rows].iter().map(|&r| r * d).collect();
        let dst_off: Vec<usize> = (0..rows).map(|i| i * d).collect();
        twin::copy_runs(src, dst, &src_off, &dst_off, d);
        Ok(())
    }

    fn row_stats(
        &self,
        logits: &Vec<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<Vec<(u32, f32, f32)>, Never> {
        Ok(logits[..rows * vocab]
            .chunks_exact(vocab)
            .map(twin::row_stats)
            .collect())
    }
}
