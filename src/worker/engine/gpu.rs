//! [`GpuEngine`]: one replica's model, paged KV pools and workspace on a device, stepping
//! batches through [`forward_pass`]; [`DeviceRunner`] is the same behind a trait object, what
//! [`crate::worker::Engine`] holds for a GPU (or, in tests, for the CPU twins).
//!
//! KV pools: one device buffer of `2 · n_layers · num_blocks · block_size · n_kv_heads ·
//! head_dim` f32 laid out `[layer][K, V][block]`, the host cache's layout (`kv_cache.rs`), so a
//! block is `2 · n_layers` runs at the same offsets on either side (tiers and the transport
//! move it with `copy_runs`). Plain device allocations, no managed memory. The pools are
//! offered to the node's transport as staged memory ([`DeviceRunner::kv_memory`],
//! `kv/memory.rs` "Memory kinds"), under a lease the engine revokes before freeing them.

use std::sync::Arc;

use crate::kernels::Rope;
use crate::kernels::cuda::pass::{DeviceOps, GemmPrecision};
use crate::kernels::cuda::plan::StepPlan;
use crate::kernels::cuda::twin;
use crate::model::device_forward::{DeviceModel, Workspace, forward_pass};
use crate::model::forward::ForwardSeq;
use crate::model::weights::ModelWeights;
use crate::transport::{KvMemory, MemoryLease};

/// What a replica's engine needs of a device: run a batch, then read its logits.
pub trait DeviceRunner: Send + std::fmt::Debug {
    /// Backend name for logs and `EngineInfo::device` (`"cuda"`, `"cuda-twin"`).
    fn name(&self) -> &'static str;
    /// Runs a validated batch; the logits of its flagged sequences (batch order) stay on the
    /// device until the next step. Returns how many rows they are.
    ///
    /// # Errors
    /// The device's, in words.
    fn forward(&mut self, seqs: &[ForwardSeq<'_>]) -> Result<usize, String>;
    /// `(argmax, max, log-sum-exp)` of each of the first `rows` logit rows.
    ///
    /// # Errors
    /// The device's, in words.
    fn row_stats(&self, rows: usize) -> Result<Vec<(u32, f32, f32)>, String>;
    /// Logit row `i` (`[vocab]`).
    ///
    /// # Errors
    /// The device's, in words.
    fn logits_row(&self, i: usize) -> Result<Vec<f32>, String>;
    /// Bytes of the KV pools on the device.
    fn kv_bytes(&self) -> usize;
    /// The KV pools as transport memory (laid out as the host cache), to register with the
    /// node's transport; `None` when the device offers no copies. Copies through it fail once
    /// the engine is dropped.
    fn kv_memory(&self) -> Option<Arc<KvMemory>>;
}

/// Why a model cannot run on the GPU kernels.
pub fn unsupported(w: &ModelWeights) -> Option<String> {
    let c = &w.config;
    if c.head_dim > twin::ATT_MAX_HEAD_DIM {
        return Some(format!(
            "head_dim {} exceeds the attention kernel's {}",
            c.head_dim,
            twin::ATT_MAX_HEAD_DIM
        ));
    }
    if c.n_kv_heads == 0 || !c.n_heads.is_multiple_of(c.n_kv_heads) {
        return Some(format!(
            "{} heads are not a multiple of {} KV heads",
            c.n_heads, c.n_kv_heads
        ));
    }
    None
}

/// A replica on one device.
#[derive(Debug)]
pub struct GpuEngine<O: DeviceOps> {
    name: &'static str,
    ops: O,
    model: DeviceModel<O>,
    pools: O::Buf,
    pool_elems: usize,
    block_size: usize,
    kv_row: usize,
    ws: Workspace<O>,
    /// Revoked (waiting for copies in progress) before `pools` is freed.
    lease: Arc<MemoryLease>,
    memory: Option<Arc<KvMemory>>,
}

impl<O: DeviceOps> GpuEngine<O>
where
    O::Error: std::fmt::Display,
{
    /// Uploads the weights and allocates zeroed KV pools of `num_blocks` blocks.
    ///
    /// # Errors
    /// The model's shape ([`unsupported`]) or the device's, in words.
    pub fn new(
        name: &'static str,
        ops: O,
        weights: &Arc<ModelWeights>,
        (num_blocks, block_size): (usize, usize),
        precision: GemmPrecision,
    ) -> Result<Self, String> {
        if let Some(why) = unsupported(weights) {
            return Err(why);
        }
        if num_blocks > i32::MAX as usize {
            return Err(format!(
                "{num_blocks} KV blocks: the kernels index blocks with int"
            ));
        }
        let c = &weights.config;
        let rope = Rope::new(c.head_dim, c.rope_dim, c.rope_base, c.rope_layout);
        let err = |e: O::Error| e.to_string();
        let model = DeviceModel::upload(&ops, weights, &rope, precision).map_err(err)?;
        let kv_row = c.n_kv_heads * c.head_dim;
        let pool_elems = num_blocks * block_size * kv_row;
        let pools = ops.zeros(2 * c.n_layers * pool_elems).map_err(err)?;
        let ws = Workspace::new(&ops, c, model.vocab, (1, 1)).map_err(err)?;
        let lease = Arc::new(MemoryLease::new());
        let bytes = 2 * c.n_layers * pool_elems * 4;
        let memory = ops
            .transport_access(&pools, &lease)
            .map(|(addr, kind, access)| KvMemory::staged(addr, bytes, kind, access))
            .transpose()
            .map_err(|e| e.to_string())?
            .map(Arc::new);
        Ok(Self {
            name,
            ops,
            model,
            pools,
            pool_elems,
            block_size,
            kv_row,
            ws,
            lease,
            memory,
        })
    }
}

impl<O: DeviceOps> Drop for GpuEngine<O> {
    /// Buffers are freed on the device's own context: make it current on the dropping
    /// thread first (an engine is dropped wherever its last step ran).
    fn drop(&mut self) {
        // No transport copy may run on the pools once they are freed (right after this).
        self.lease.revoke();
        let _ = self.ops.bind();
    }
}

impl<O> DeviceRunner for GpuEngine<O>
where
    O: DeviceOps + Send + std::fmt::Debug,
    O::Buf: Send + std::fmt::Debug,
    O::Mat: Send + std::fmt::Debug,
    O::RopeTable: Send + std::fmt::Debug,
    O::Error: std::fmt::Display,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn forward(&mut self, seqs: &[ForwardSeq<'_>]) -> Result<usize, String> {
        let plan = StepPlan::new(self.block_size, self.kv_row, seqs);
        forward_pass(
            &self.ops,
            &self.model,
            &mut self.pools,
            self.pool_elems,
            self.block_size,
            &plan,
            &mut self.ws,
        )
        .map_err(|e| e.to_string())?;
        Ok(plan.logit_rows.len())
    }

    fn row_stats(&self, rows: usize) -> Result<Vec<(u32, f32, f32)>, String> {
        self.ops
            .row_stats(&self.ws.logits, rows, self.model.vocab)
            .map_err(|e| e.to_string())
    }

    fn logits_row(&self, i: usize) -> Result<Vec<f32>, String> {
        let v = self.model.vocab;
        self.ops
            .download(&self.ws.logits, i * v..(i + 1) * v)
            .map_err(|e| e.to_string())
    }

    fn kv_bytes(&self) -> usize {
        2 * self.model.config.n_layers * self.pool_elems * 4
    }

    fn kv_memory(&self) -> Option<Arc<KvMemory>> {
        self.memory.clone()
    }
}
