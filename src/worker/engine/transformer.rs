//! The real transformer engine.
//!
//! [`Engine`] is synchronous: weights `Arc` + KV pools + per-sequence sampler RNGs;
//! [`Engine::step`] runs one batched forward pass and samples. [`TransformerEngine`] is the
//! same engine as a [`StepEngine`]: each step runs on tokio's blocking pool
//! (`spawn_blocking`), so a long forward pass does not stall the async runtime.
//!
//! The pass runs where [`EngineConfig::device`] says: on the CPU (`model/forward.rs` over the
//! [`Backend`], KV pools in host memory that the node's transport can register), or on a GPU
//! (`kernels/cuda/`: weights, KV pools and activations on the device; only the step's index
//! arrays go up and the sampled rows' statistics come down). Sampling is the same code on
//! both: a greedy row takes the device's argmax (the CPU's tie rule), any other row is copied
//! to the host and drawn from the sequence's own seeded generator, so a sequence migrated
//! between a CPU and a GPU replica draws the same tokens.

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use super::StepEngine;
use super::error::EngineError;
use super::types::{EngineInfo, PromptScores, SampledToken, StepBatch, StepOutput};
use crate::kernels::sample::{SeqSampler, log_prob, top_log_probs};
use crate::kernels::{Backend, Device, Rope};
use crate::model::forward::{ForwardSeq, forward, validate_for};
use crate::model::kv_cache::{DEFAULT_BLOCK_SIZE, KvCache};
use crate::model::weights::ModelWeights;
use crate::runtime::ids::SeqId;
use crate::transport::{KvLayout, KvMemory, Transport};
use crate::worker::engine::gpu::DeviceRunner;

/// Engine construction parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// KV blocks in the pool (each holds `block_size` positions of every layer).
    pub num_blocks: usize,
    /// Tokens per KV block (default 16).
    pub block_size: usize,
    pub device: Device,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            num_blocks: 256,
            block_size: DEFAULT_BLOCK_SIZE,
            device: Device::Cpu,
        }
    }
}

/// `num_blocks` and `block_size` positive, `num_blocks` a valid [`crate::runtime::ids::BlockId`].
fn check(config: &EngineConfig) -> Result<(), EngineError> {
    if config.num_blocks == 0 || config.block_size == 0 {
        return Err(EngineError::Config(
            "num_blocks and block_size must be > 0".into(),
        ));
    }
    if u32::try_from(config.num_blocks).is_err() {
        return Err(EngineError::Config(
            "num_blocks must fit in a BlockId (u32)".into(),
        ));
    }
    Ok(())
}

/// One device's engine.
#[derive(Debug)]
pub struct Engine {
    weights: Arc<ModelWeights>,
    compute: Compute,
    rngs: HashMap<SeqId, SeqSampler>,
}

/// Where the forward pass runs, with its KV pools.
#[derive(Debug)]
enum Compute {
    Cpu {
        backend: Arc<dyn Backend>,
        rope: Rope,
        kv: KvCache,
    },
    Device(DeviceCompute),
}

/// The GPU runner of `config.device`, or `Err(config on the CPU)` for [`Device::Cpu`] and for
/// a GPU that cannot start when its `cpu_fallback` is set (logged).
///
/// # Errors
/// The GPU's, when it cannot start and may not fall back.
fn device_runner_or_fallback(
    weights: &Arc<ModelWeights>,
    config: EngineConfig,
) -> Result<Result<Box<dyn DeviceRunner>, EngineConfig>, EngineError> {
    let cpu = EngineConfig {
        device: Device::Cpu,
        ..config
    };
    match (device_runner(weights, config), config.device) {
        (_, Device::Cpu) => Ok(Err(cpu)),
        (Ok(runner), _) => Ok(Ok(runner)),
        (
            Err(e),
            Device::Cuda {
                cpu_fallback: true, ..
            },
        ) => {
            tracing::warn!(error = %e, "the GPU engine cannot start; running on the CPU (worker.backend = auto)");
            Ok(Err(cpu))
        }
        (Err(e), _) => Err(e),
    }
}

/// Builds the GPU runner of `device` (not [`Device::Cpu`]).
fn device_runner(
    weights: &Arc<ModelWeights>,
    config: EngineConfig,
) -> Result<Box<dyn DeviceRunner>, EngineError> {
    use crate::worker::engine::gpu::GpuEngine;
    let geometry = (config.num_blocks, config.block_size);
    let cfg = |e: String| EngineError::Config(format!("the GPU engine cannot start: {e}"));
    match config.device {
        Device::Cpu => Err(cfg("not a device".into())),
        Device::CudaTwin { precision } => Ok(Box::new(
            GpuEngine::new(
                "cuda-twin",
                crate::kernels::cuda::pass::HostOps,
                weights,
                geometry,
                precision,
            )
            .map_err(cfg)?,
        )),
        #[cfg(feature = "cuda")]
        Device::Cuda {
            ordinal, precision, ..
        } => {
            let ops = crate::kernels::cuda::device::CudaOps::new(ordinal)
                .map_err(|e| cfg(e.to_string()))?;
            tracing::info!(device = %ops.name, arch = %ops.arch, ?precision, "engine on CUDA");
            Ok(Box::new(
                GpuEngine::new("cuda", ops, weights, geometry, precision).map_err(cfg)?,
            ))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda { .. } => Err(cfg("built without the `cuda` cargo feature".into())),
    }
}

impl Engine {
    /// Allocates the KV pools for `config.num_blocks` blocks.
    ///
    /// # Errors
    /// [`EngineError::Config`] when `num_blocks` or `block_size` is 0, or `num_blocks` does
    /// not fit in a [`crate::runtime::ids::BlockId`].
    pub fn new(weights: Arc<ModelWeights>, config: EngineConfig) -> Result<Self, EngineError> {
        check(&config)?;
        let config = match device_runner_or_fallback(&weights, config)? {
            Ok(runner) => return Ok(Self::with_runner(weights, config, runner)),
            Err(cpu) => cpu,
        };
        let bytes = Self::layout(&weights, config).region_bytes() as usize;
        let memory = KvMemory::zeroed(bytes).map_err(|e| EngineError::Config(e.to_string()))?;
        Self::with_memory(weights, config, Arc::new(memory))
    }

    fn with_runner(
        weights: Arc<ModelWeights>,
        config: EngineConfig,
        runner: Box<dyn DeviceRunner>,
    ) -> Self {
        Self {
            weights,
            compute: Compute::Device(DeviceCompute {
                runner,
                num_blocks: config.num_blocks,
                block_size: config.block_size,
            }),
            rngs: HashMap::new(),
        }
    }

    /// The KV layout an engine of this model and `config` has (what to allocate for
    /// [`Engine::with_memory`]).
    pub fn layout(weights: &ModelWeights, config: EngineConfig) -> KvLayout {
        let c = &weights.config;
        KvLayout {
            n_layers: c.n_layers as u32,
            num_blocks: config.num_blocks as u32,
            block_bytes: (config.block_size * c.n_kv_heads * c.head_dim * 4) as u64,
        }
    }

    /// As [`Engine::new`] on the CPU, with the KV pools in `memory` (e.g. allocated by the
    /// node's transport, so that peers can read its blocks).
    ///
    /// # Errors
    /// As [`Engine::new`]; [`EngineError::Config`] when `memory` is too small, or the device
    /// is not the CPU (a GPU's pools are device memory).
    pub fn with_memory(
        weights: Arc<ModelWeights>,
        config: EngineConfig,
        memory: Arc<KvMemory>,
    ) -> Result<Self, EngineError> {
        check(&config)?;
        if config.device != Device::Cpu {
            return Err(EngineError::Config(format!(
                "{:?} keeps its KV pools in device memory, not in host memory",
                config.device
            )));
        }
        let c = &weights.config;
        let kv = KvCache::with_memory(
            c.n_layers,
            c.n_kv_heads,
            c.head_dim,
            config.num_blocks,
            config.block_size,
            memory,
        )
        .map_err(|e| EngineError::Config(e.to_string()))?;
        let rope = Rope::new(c.head_dim, c.rope_dim, c.rope_base, c.rope_layout);
        Ok(Self {
            compute: Compute::Cpu {
                backend: Arc::new(crate::kernels::cpu::CpuBackend),
                rope,
                kv,
            },
            weights,
            rngs: HashMap::new(),
        })
    }

    /// The shared weights.
    pub fn weights(&self) -> &Arc<ModelWeights> {
        &self.weights
    }

    /// The KV pools as transport memory (to register with the node's transport): the host
    /// cache's, or the device's staged memory ([`DeviceRunner::kv_memory`]); `None` when the
    /// device offers none.
    pub fn kv_memory(&self) -> Option<Arc<KvMemory>> {
        match &self.compute {
            Compute::Cpu { kv, .. } => Some(kv.memory().clone()),
            Compute::Device(d) => d.runner.kv_memory(),
        }
    }

    /// The host KV pools (e.g. to register them with a transport); `None` on a GPU.
    pub fn kv_cache(&self) -> Option<&KvCache> {
        match &self.compute {
            Compute::Cpu { kv, .. } => Some(kv),
            Compute::Device(_) => None,
        }
    }

    /// Static facts about this engine.
    pub fn info(&self) -> EngineInfo {
        let c = &self.weights.config;
        let (device, num_blocks, block_size, kv_bytes) = match &self.compute {
            Compute::Cpu { backend, kv, .. } => (
                backend.name(),
                kv.num_blocks,
                kv.block_size,
                kv.total_bytes(),
            ),
            Compute::Device(d) => (
                d.runner.name(),
                d.num_blocks,
                d.block_size,
                d.runner.kv_bytes(),
            ),
        };
        EngineInfo {
            device: device.to_owned(),
            num_blocks,
            block_size,
            vocab_size: c.vocab_size,
            max_context: c.max_context,
            block_bytes: block_size * c.n_kv_heads * c.head_dim * 4,
            kv_bytes,
        }
    }

    fn run(&mut self, batch: &StepBatch, all_logits: bool) -> Result<Vec<f32>, EngineError> {
        let seqs = forward_seqs(batch, all_logits);
        match &mut self.compute {
            Compute::Cpu { backend, rope, kv } => {
                let (w, be) = (&self.weights, backend.as_ref());
                // Run the whole pass on a rayon worker: nested parallel ops then fork-join by
                // work stealing instead of handing every op from this thread to the pool and
                // back.
                Ok(rayon::scope(|_| forward(w, be, rope, kv, &seqs))?)
            }
            Compute::Device(d) => {
                let rows = d.forward(&self.weights, &seqs)?;
                let mut out = Vec::new();
                for i in 0..rows {
                    out.extend(d.runner.logits_row(i).map_err(device_lost)?);
                }
                Ok(out)
            }
        }
    }

    /// Runs one batched forward pass and samples one token for every sequence with
    /// `sample = true`. Each sequence draws from its own generator, created on its first sample
    /// from `sampling.seed` and `sampling.offset` (random when unseeded) and kept until
    /// [`Engine::release`].
    ///
    /// # Errors
    /// [`EngineError::InvalidBatch`] for a malformed batch (checked before any KV write).
    pub fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, EngineError> {
        if let Compute::Device(d) = &mut self.compute {
            return d.step(&self.weights, &mut self.rngs, batch);
        }
        let logits = self.run(batch, false)?;
        let vocab = self.weights.lm_head().rows;
        let rows = RowMap::of(batch);
        let row = |r: usize| &logits[r * vocab..(r + 1) * vocab];
        let mut tokens: Vec<SampledToken> = batch
            .seqs
            .iter()
            .zip(&rows.last)
            .filter(|(s, _)| s.sample)
            .map(|(s, &r)| {
                let sampler = self
                    .rngs
                    .entry(s.seq_id)
                    .or_insert_with(|| SeqSampler::new(s.sampling.seed, s.sampling.offset));
                SampledToken {
                    seq_id: s.seq_id,
                    token: sampler.choose(row(r), &s.sampling),
                    logprob: 0.0,
                    top: Vec::new(),
                }
            })
            .collect();
        let wanted: Vec<(u32, usize)> = batch
            .seqs
            .iter()
            .zip(&rows.last)
            .filter(|(s, _)| s.sample)
            .map(|(s, &r)| (s.sampling.top_logprobs, r))
            .collect();
        // Logprobs (a pass over the vocabulary each, two more for alternatives) in parallel
        // across sequences, from the logits the sampler drew from.
        tokens
            .par_iter_mut()
            .zip(wanted.par_iter())
            .for_each(|(t, &(k, r))| {
                t.logprob = log_prob(row(r), t.token);
                t.top = top_log_probs(row(r), k);
            });
        let prompt = rows.score(batch, |r, target, k| {
            Ok((log_prob(row(r), target), top_log_probs(row(r), k)))
        })?;
        Ok(StepOutput { tokens, prompt })
    }

    /// Runs the batch (writing its K/V like [`Engine::step`]) and returns the last-position
    /// logits (`[vocab]` f32) of every sequence, in batch order; nothing is sampled.
    ///
    /// # Errors
    /// [`EngineError::InvalidBatch`] for a malformed batch (checked before any KV write).
    pub fn logits(&mut self, batch: &StepBatch) -> Result<Vec<Vec<f32>>, EngineError> {
        let logits = self.run(batch, true)?;
        let vocab = self.weights.lm_head().rows;
        Ok(logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }

    /// Forgets a sequence's sampler state (its KV blocks are managed by the caller).
    pub fn release(&mut self, seq: SeqId) {
        self.rngs.remove(&seq);
    }
}

/// A GPU (or the GPU pass on CPU twins) with its pool geometry; its pools live on the device.
#[derive(Debug)]
struct DeviceCompute {
    runner: Box<dyn DeviceRunner>,
    num_blocks: usize,
    block_size: usize,
}

impl DeviceCompute {
    /// Validates and runs the batch; its logits stay on the device. Returns their row count.
    fn forward(
        &mut self,
        weights: &ModelWeights,
        seqs: &[ForwardSeq<'_>],
    ) -> Result<usize, EngineError> {
        validate_for(weights, self.num_blocks, self.block_size, seqs)?;
        self.runner
            .forward(seqs)
            .map_err(|e| EngineError::Crashed(format!("GPU step failed: {e}")))
    }

    /// [`Engine::step`] on the device: greedy rows from the device's row statistics (a greedy
    /// pick still counts as a draw of the sequence's sampler), the others' logits copied to
    /// the host and drawn there by the CPU's sampler, so the draws are the CPU's.
    fn step(
        &mut self,
        weights: &ModelWeights,
        rngs: &mut HashMap<SeqId, SeqSampler>,
        batch: &StepBatch,
    ) -> Result<StepOutput, EngineError> {
        let rows = self.forward(weights, &forward_seqs(batch, false))?;
        let stats = self.runner.row_stats(rows).map_err(device_lost)?;
        let map = RowMap::of(batch);
        let mut tokens = Vec::with_capacity(rows);
        for (s, &i) in batch.seqs.iter().zip(&map.last).filter(|(s, _)| s.sample) {
            let sampler = rngs
                .entry(s.seq_id)
                .or_insert_with(|| SeqSampler::new(s.sampling.seed, s.sampling.offset));
            let k = s.sampling.top_logprobs;
            let (token, logprob, top) = if s.sampling.is_greedy() && k == 0 {
                sampler.skip();
                let (best, max, lse) = stats[i];
                (best, max - lse, Vec::new())
            } else {
                // Drawn here, or alternatives wanted: the row comes to the host.
                let row = self.runner.logits_row(i).map_err(device_lost)?;
                let t = sampler.choose(&row, &s.sampling);
                (t, log_prob(&row, t), top_log_probs(&row, k))
            };
            tokens.push(SampledToken {
                seq_id: s.seq_id,
                token,
                logprob,
                top,
            });
        }
        // Prompt log-probabilities: each scored row comes to the host (an echo request's
        // prefill; rare, and its rows are read once).
        let prompt = map.score(batch, |r, target, k| {
            let row = self.runner.logits_row(r).map_err(device_lost)?;
            Ok((log_prob(&row, target), top_log_probs(&row, k)))
        })?;
        Ok(StepOutput { tokens, prompt })
    }
}

/// The batch as the forward pass takes it (`all_logits`: the last row of every sequence,
/// for [`Engine::logits`]; otherwise the sampled rows, and every row of a sequence that
/// scores its prompt).
fn forward_seqs(batch: &StepBatch, all_logits: bool) -> Vec<ForwardSeq<'_>> {
    batch
        .seqs
        .iter()
        .map(|s| ForwardSeq {
            tokens: &s.tokens,
            start_pos: s.start_pos,
            block_table: &s.block_table,
            want_logits: all_logits || s.sample,
            all_logits: !all_logits && !s.score.is_empty(),
        })
        .collect()
}

/// Where each sequence's logit rows sit in a step's output (`forward_seqs(batch, false)`):
/// none, its last token's, or — a sequence with a [`StepSeq::score`](super::types::StepSeq::score)
/// — one per token, in position order.
struct RowMap {
    /// Per sequence (batch order): its first row.
    first: Vec<usize>,
    /// Per sequence: its last row (its sampled row when it samples).
    last: Vec<usize>,
}

impl RowMap {
    fn of(batch: &StepBatch) -> Self {
        let (mut first, mut last) = (Vec::new(), Vec::new());
        let mut at = 0usize;
        for s in &batch.seqs {
            let n = if !s.score.is_empty() {
                s.tokens.len()
            } else {
                usize::from(s.sample)
            };
            first.push(at);
            at += n;
            last.push(at.saturating_sub(1));
        }
        Self { first, last }
    }

    /// Every scoring sequence's [`PromptScores`]: `score(row, target, top_logprobs)` for the
    /// row of each of its first `score.len()` tokens.
    fn score(
        &self,
        batch: &StepBatch,
        mut score: impl FnMut(usize, u32, u32) -> Result<(f32, Vec<(u32, f32)>), EngineError>,
    ) -> Result<Vec<PromptScores>, EngineError> {
        let mut out = Vec::new();
        for (s, &first) in batch.seqs.iter().zip(&self.first) {
            if s.score.is_empty() {
                continue;
            }
            let k = s.sampling.top_logprobs;
            let logprobs = s
                .score
                .iter()
                .take(s.tokens.len())
                .enumerate()
                .map(|(i, &t)| score(first + i, t, k))
                .collect::<Result<Vec<_>, _>>()?;
            out.push(PromptScores {
                seq_id: s.seq_id,
                first: s.start_pos + 1,
                logprobs,
            });
        }
        Ok(out)
    }
}

/// A device that fails after its step ran cannot be trusted with the next one.
fn device_lost(e: String) -> EngineError {
    EngineError::Crashed(format!("GPU read-back failed: {e}"))
}

/// Spawn inputs of a [`TransformerEngine`].
#[derive(Debug, Clone)]
pub struct TransformerArgs {
    /// Weights shared by every replica of the process.
    pub weights: Arc<ModelWeights>,
    pub config: EngineConfig,
    /// The node's transport and this replica's worker id: the KV pools are allocated through
    /// it and registered as the worker's region (unregistered when the engine drops). `None`:
    /// heap pools no peer can read.
    pub transport: Option<(Arc<Transport>, String)>,
    /// Where the engine publishes its KV memory and layout at start, for the replica's KV
    /// tier copier (`worker/tiers.rs`); `None`: not published.
    pub kv_region: Option<crate::worker::tiers::KvRegionSlot>,
}

/// Unregisters a replica's region when its engine goes (only that epoch: a restarted replica
/// may already have registered anew).
#[derive(Debug)]
struct RegionGuard {
    transport: Arc<Transport>,
    id: crate::transport::RegionId,
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        self.transport.unregister_epoch(&self.id);
    }
}

/// [`Engine`] as a [`StepEngine`]: steps run on tokio's blocking pool.
#[derive(Debug)]
pub struct TransformerEngine {
    /// Keeps the KV region registered while this engine lives. Declared first so that it is
    /// dropped first: a device pool is unregistered before the engine frees it.
    region: Option<RegionGuard>,
    /// Absent while a step runs on the blocking pool, and for good once a step panicked.
    engine: Option<Engine>,
    info: EngineInfo,
}

impl From<Engine> for TransformerEngine {
    fn from(engine: Engine) -> Self {
        Self {
            info: engine.info(),
            engine: Some(engine),
            region: None,
        }
    }
}

impl TransformerEngine {
    /// Runs `f` on the engine in the blocking pool and puts the engine back.
    async fn offload<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut Engine) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, EngineError> {
        let mut engine = self
            .engine
            .take()
            .ok_or_else(|| EngineError::Crashed("engine lost by an earlier failed step".into()))?;
        let (engine, out) = tokio::task::spawn_blocking(move || {
            let out = f(&mut engine);
            (engine, out)
        })
        .await
        .map_err(|e| EngineError::Crashed(format!("engine step panicked: {e}")))?;
        self.engine = Some(engine);
        out
    }
}

impl StepEngine for TransformerEngine {
    type Config = TransformerArgs;

    async fn start(args: TransformerArgs) -> Result<Self, EngineError> {
        let slot = args.kv_region.clone();
        let layout = Engine::layout(&args.weights, args.config);
        let e = Self::start_engine(args).await?;
        if let Some(slot) = slot {
            let memory = e.engine.as_ref().and_then(Engine::kv_memory);
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = memory.map(|m| (m, layout));
        }
        Ok(e)
    }

    fn info(&self) -> EngineInfo {
        self.info.clone()
    }

    async fn step(&mut self, batch: StepBatch) -> Result<StepOutput, EngineError> {
        self.offload(move |e| e.step(&batch)).await
    }

    async fn logits(&mut self, batch: StepBatch) -> Result<Vec<Vec<f32>>, EngineError> {
        self.offload(move |e| e.logits(&batch)).await
    }

    fn release(&mut self, seq: SeqId) {
        if let Some(e) = self.engine.as_mut() {
            e.release(seq);
        }
    }
}

impl TransformerEngine {
    async fn start_engine(mut args: TransformerArgs) -> Result<Self, EngineError> {
        check(&args.config)?;
        if args.config.device != Device::Cpu {
            // Compiling the kernels and uploading the weights take a while: off the runtime.
            let (weights, config) = (args.weights.clone(), args.config);
            let runner =
                tokio::task::spawn_blocking(move || device_runner_or_fallback(&weights, config))
                    .await
                    .map_err(|e| {
                        EngineError::Config(format!("GPU engine start panicked: {e}"))
                    })??;
            match runner {
                Ok(runner) => {
                    let engine = Engine::with_runner(args.weights, args.config, runner);
                    let Some((transport, owner)) = args.transport else {
                        return Ok(engine.into());
                    };
                    let Some(memory) = engine.kv_memory() else {
                        tracing::warn!(
                            worker = %owner,
                            "this device offers no copies of its KV pools: peers recompute \
                             this replica's blocks"
                        );
                        return Ok(engine.into());
                    };
                    let layout = Engine::layout(engine.weights(), args.config);
                    let d = transport
                        .register(&owner, layout, memory)
                        .await
                        .map_err(|e| {
                            EngineError::Config(format!("KV memory through the transport: {e}"))
                        })?;
                    tracing::info!(worker = %owner, memory = %d.memory, ucx = d.ucx.is_some(), "KV pools on the device registered with the node's transport");
                    let mut e: Self = engine.into();
                    e.region = Some(RegionGuard {
                        transport,
                        id: d.id,
                    });
                    return Ok(e);
                }
                // Fell back: the CPU engine, its pools registered as usual.
                Err(cpu) => args.config = cpu,
            }
        }
        let Some((transport, owner)) = args.transport else {
            return Ok(Engine::new(args.weights, args.config)?.into());
        };
        let layout = Engine::layout(&args.weights, args.config);
        let unavailable = |e: crate::transport::TransportError| {
            EngineError::Config(format!("KV memory through the transport: {e}"))
        };
        let memory = transport.allocate(layout).await.map_err(unavailable)?;
        let engine = Engine::with_memory(args.weights, args.config, memory.clone())?;
        let d = transport
            .register(&owner, layout, memory)
            .await
            .map_err(unavailable)?;
        let mut e: Self = engine.into();
        e.region = Some(RegionGuard {
            transport,
            id: d.id,
        });
        Ok(e)
    }
}
