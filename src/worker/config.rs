//! The `[worker]` section: a worker node's replicas — how many, their engine and its
//! backend, the model, KV pool and tiers, batch limits, watchdog, peer pulls, the sim
//! engine's models, and each replica's own HTTP face and KV event socket. Read by the
//! replicas' scheduler, engine and KV publisher (through the composition root) and by
//! `flotilla sim`.

use super::scheduler::config::SchedulerSection;
use crate::runtime::config::ConfigError;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Worker nodes: replicas and their engines.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Replicas per worker node.
    #[schemars(extend("x-unit" = "replicas"))]
    pub replicas: u32,
    /// Model file (GGUF) or Hugging Face directory; `None`: `FLOTILLA_MODEL`, else
    /// `models/smollm2-135m-instruct-q4_1.gguf` (what `make model` fetches).
    pub model_path: Option<std::path::PathBuf>,
    /// KV blocks per replica; `None`: the engine's default — the sim profile's KV capacity
    /// (`kv_tokens ÷ block_size_tokens`, the simulated device's pool) for `sim`, else
    /// [`DEFAULT_KV_BLOCKS`]. The default model's KV is 46 KiB per token in f32 (30 layers ×
    /// K,V × 3 heads × 64 × 4 bytes), so 512 blocks of 16 tokens take 360 MiB.
    pub kv_blocks: Option<usize>,
    /// KV tier G2: blocks of host memory per replica that G1 offloads to and onboards from
    /// (`kv/tiers.rs`); 0 = off. On the CPU engine a block takes what a G1 block takes.
    pub kv_host_blocks: usize,
    /// KV tier G3: blocks on local disk per replica, fed by G2's evictions of blocks reused at
    /// least `kv_disk_min_hits` times; 0 = off. Needs `kv_host_blocks`, and on the CPU engine
    /// `kv_disk_dir` (the sim engine models the disk).
    pub kv_disk_blocks: usize,
    /// G3's directory (one segment file per replica, sized and cleared at start:
    /// `worker/tiers.rs`); `None`: no G3 on the CPU engine.
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Prefix reuses a block needs before G2 demotes it to G3 (frequency filter).
    pub kv_disk_min_hits: u32,
    /// Offload copies (G1 → G2, G2 → G3) in flight per replica at most; a block registered
    /// beyond that is not offloaded (`flotilla_kv_offload_drops_total`).
    #[schemars(extend("x-unit" = "copies"))]
    pub kv_offload_in_flight: usize,
    /// Peer pulls (G4): act on the router's fetch hints — pull a prompt's leading blocks from
    /// the worker holding them in G1 when the pull is estimated cheaper than the prefill
    /// (`worker/scheduler.rs`, "Peer pulls"). The router's side is `router.pull_credit`.
    pub peer_pulls: bool,
    /// The cost rule's estimate of one block's pull (ms) until a pull was measured here (then
    /// the measured moving average). Default 1 ms: a 16-token block of the default model is
    /// 736 KiB, pulled at 0.7–1.9 GB/s over the TCP backend on a 2-core VM
    /// (`docs/benchmarks.md`, "KV transport"). The sim engine uses its modelled transfer.
    pub pull_block_ms: f64,
    /// How long the holder may take to pin the blocks and answer (ms): past it the prefix is
    /// recomputed.
    pub pull_ask_timeout_ms: u64,
    /// Tokens per KV block.
    pub block_size_tokens: usize,
    /// Sequences batched at once per replica.
    pub max_num_seqs: usize,
    /// Tokens per engine step (prefill chunks + decode tokens).
    pub max_num_batched_tokens: usize,
    /// Context limit (capped by the model's own).
    pub max_model_len_tokens: usize,
    /// Step watchdog: an engine step running longer than this marks the replica unhealthy
    /// and restarts it (ms). The slowest step measured on the CPU engine (a 512-token prefill
    /// chunk on 2 cores) takes about 1.4 s; the default leaves a wide margin.
    pub step_timeout_ms: u64,
    /// Canary: an idle replica pings its engine this often; no answer within
    /// `step_timeout_ms` counts as a hang (ms).
    pub canary_interval_ms: u64,
    /// `cpu` (the real transformer) or `sim` (the real scheduler and KV manager over a timing
    /// model: `worker/engine/sim.rs`), for fleet-scale runs.
    pub engine: EngineKind,
    /// Where the real engine runs (`engine = "cpu"`): `auto` (a GPU when the CUDA driver
    /// and the kernels load and a device exists, else the CPU; a GPU engine that then cannot
    /// start falls back to the CPU too; the node's log says which and why), `cpu`, or `cuda`
    /// (a GPU or an error at start naming what is missing). cuBLAS is optional (without it,
    /// prefill products run as GEMVs). Replica `k` of a node uses GPU `k mod devices`
    /// (`kernels/cuda/`). `cuda` with `engine = "sim"` is refused (it would do nothing).
    pub backend: crate::kernels::cuda::BackendChoice,
    /// GPU engine: precision of the prefill matrix products, `f32` (the CPU engine's numbers)
    /// or `bf16` (tensor cores). Decode GEMVs read the quantised weights in f32 either way.
    /// `bf16` with `backend = "cpu"` is refused (it would do nothing).
    pub cuda_gemm: crate::kernels::cuda::GemmPrecision,
    /// Timing profile of the sim engine (JSON written by `flotilla profile`); `None`: the
    /// built-in H100 profile.
    pub sim_profile: Option<std::path::PathBuf>,
    /// The sim engine's step times are divided by this.
    pub sim_speedup: f64,
    /// The replicas' role in disaggregated serving: `aggregated`, `prefill` or `decode`
    /// (`runtime/role.rs`).
    pub role: crate::runtime::role::Role,
    /// Of this node's replicas, the first this many are `prefill` whatever `role` says (a
    /// mixed node: e.g. a simulated fleet of 16 replicas in one process with 4 prefill ones).
    pub prefill_replicas: u32,
    /// Sim engine: the modelled KV transfer between nodes, GB/s (default 25, a 200 Gb/s
    /// RDMA link).
    pub sim_transfer_gbps: f64,
    /// Sim engine: fixed cost of one KV pull (µs).
    pub sim_transfer_latency_us: u64,
    /// Sim engine: KV bytes per token (default 131072: Llama-3-8B in fp16, 32 layers × K,V ×
    /// 8 KV heads × 128 × 2 bytes, the model of the built-in H100 profile).
    pub sim_kv_bytes_per_token: u64,
    /// Sim engine: device ↔ host copy bandwidth of the KV tiers, GB/s (default 25: about half
    /// of PCIe 5.0 x16's 64 GB/s per direction, what pageable-memory copies reach).
    pub sim_host_gbps: f64,
    /// Sim engine: host ↔ disk bandwidth of G3, GB/s (default 5: one PCIe 4.0 NVMe drive's
    /// sequential rate, ~7 GB/s read, less for writes).
    pub sim_disk_gbps: f64,
    /// Each replica's own OpenAI-compatible HTTP face (`actors/gateway/face.rs`), so
    /// that other routers (SGLang's, vLLM's) can route over Flotilla workers: replica `k`
    /// listens on this address with port + k (port 0: a free port each, listed in
    /// `/v1/fleet` as the worker's `http_addr`). `None`: no face.
    pub http: Option<std::net::SocketAddr>,
    /// Each replica also publishes its KV events in vLLM's format (ZMQ PUB, MessagePack
    /// `KVEventBatch`: `kv/vllm.rs`): replica `k` binds this address with port + k, as vLLM
    /// offsets its `kv-events-config` endpoint by data-parallel rank (port 0: a free port
    /// each, listed in `/v1/fleet` as `kv_events_endpoint`). `None`: not published.
    pub kv_events_addr: Option<std::net::SocketAddr>,
    /// Layout of those events: `map` (each a map tagged by `type`: what `vllm-router` 0.1.17
    /// and Dynamo's ZMQ relay read) or `array` (each a positional array led by its tag, as
    /// vLLM's own publisher writes them). See `kv/vllm.rs`.
    pub kv_events_layout: crate::kv::vllm::EventLayout,
}

impl WorkerConfig {
    /// Replica `k`'s address given a base address: port + k, or port 0 for every replica
    /// when the base port is 0 (`worker.http`, `worker.kv_events_addr`).
    pub fn replica_addr(base: std::net::SocketAddr, k: u32) -> std::net::SocketAddr {
        let mut a = base;
        if base.port() != 0 {
            a.set_port(base.port().saturating_add(k as u16));
        }
        a
    }
}

/// KV blocks per replica of the CPU engine unless `worker.kv_blocks` says otherwise.
pub const DEFAULT_KV_BLOCKS: usize = 512;

impl WorkerConfig {
    /// The KV blocks each replica gets: `kv_blocks` if set, else the sim profile's capacity
    /// (`profile` is the sim engine's, `None` for the CPU engine), else [`DEFAULT_KV_BLOCKS`].
    pub fn kv_blocks_with(
        &self,
        profile: Option<&crate::worker::engine::sim::SimProfile>,
    ) -> usize {
        self.kv_blocks
            .or_else(|| profile.and_then(|p| p.kv_blocks(self.block_size_tokens)))
            .unwrap_or(DEFAULT_KV_BLOCKS)
    }
}

/// Which engine a replica runs.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// The real model (on the CPU or a GPU: `worker.backend`).
    #[default]
    Cpu,
    /// The timing model with placeholder tokens.
    Sim,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            replicas: 1,
            model_path: None,
            kv_blocks: None,
            kv_host_blocks: 0,
            kv_disk_blocks: 0,
            kv_disk_dir: None,
            kv_disk_min_hits: 1,
            kv_offload_in_flight: 256,
            peer_pulls: true,
            pull_block_ms: 1.0,
            pull_ask_timeout_ms: crate::worker::scheduler::PeerPullWorker::DEFAULT_ASK_TIMEOUT_MS,
            block_size_tokens: 16,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            max_model_len_tokens: 8192,
            step_timeout_ms: 30_000,
            canary_interval_ms: 5_000,
            engine: EngineKind::Cpu,
            backend: Default::default(),
            cuda_gemm: Default::default(),
            sim_profile: None,
            sim_speedup: 1.0,
            role: crate::runtime::role::Role::Aggregated,
            prefill_replicas: 0,
            sim_transfer_gbps: 25.0,
            sim_transfer_latency_us: 50,
            sim_kv_bytes_per_token: 131_072,
            sim_host_gbps: 25.0,
            sim_disk_gbps: 5.0,
            http: None,
            kv_events_addr: None,
            kv_events_layout: Default::default(),
        }
    }
}

impl WorkerConfig {
    /// A replica's batch limits (`worker.max_num_seqs`, `max_num_batched_tokens`,
    /// `max_model_len_tokens` capped by the model's context `model_context` in tokens, and
    /// `scheduler.max_decode_stall_ms`, `scheduler.resume_gather_ms`).
    pub fn scheduler_config(
        &self,
        scheduler: &SchedulerSection,
        model_context: usize,
    ) -> crate::worker::scheduler::SchedulerConfig {
        crate::worker::scheduler::SchedulerConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len_tokens.min(model_context),
            max_decode_stall_ms: scheduler.max_decode_stall_ms,
            resume_gather_ms: scheduler.resume_gather_ms,
        }
    }

    /// The lower KV tiers of each replica (`worker.kv_host_blocks`, `kv_disk_*`).
    pub fn tier_config(&self) -> crate::kv::TierConfig {
        crate::kv::TierConfig {
            host_blocks: self.kv_host_blocks,
            disk_blocks: self.kv_disk_blocks,
            max_offloads_in_flight: self.kv_offload_in_flight,
            disk_min_hits: self.kv_disk_min_hits,
        }
    }

    /// A replica's side of peer pulls (`worker.peer_pulls`, `pull_block_ms`,
    /// `pull_ask_timeout_ms`); on the sim engine (`sim`) the pull estimate is the modelled
    /// transfer's. `None` when off.
    pub fn peer_pull_worker(&self, sim: bool) -> Option<crate::worker::scheduler::PeerPullWorker> {
        if !self.peer_pulls {
            return None;
        }
        let (prior_block_ms, fixed_ms) = if sim {
            let t = self.sim_transfer();
            let bs = self.block_size_tokens;
            let fixed = t.time(0, bs).as_secs_f64() * 1e3;
            (t.time(1, bs).as_secs_f64() * 1e3 - fixed, fixed)
        } else {
            (self.pull_block_ms, 1.0)
        };
        Some(crate::worker::scheduler::PeerPullWorker {
            prior_block_ms,
            fixed_ms,
            ask_timeout: Duration::from_millis(self.pull_ask_timeout_ms),
        })
    }

    /// The sim engine's model of copies between KV tiers.
    pub fn sim_tier_links(&self) -> crate::worker::scheduler::SimTierLinks {
        crate::worker::scheduler::SimTierLinks {
            bytes_per_token: self.sim_kv_bytes_per_token,
            host_gbps: self.sim_host_gbps,
            disk_gbps: self.sim_disk_gbps,
            speedup: self.sim_speedup,
        }
    }

    /// The sim engine's modelled KV transfer (`worker.sim_transfer_*`,
    /// `sim_kv_bytes_per_token`, `sim_speedup`).
    pub fn sim_transfer(&self) -> crate::worker::scheduler::SimTransfer {
        crate::worker::scheduler::SimTransfer {
            bytes_per_token: self.sim_kv_bytes_per_token,
            gbps: self.sim_transfer_gbps,
            latency: Duration::from_micros(self.sim_transfer_latency_us),
            speedup: self.sim_speedup,
        }
    }

    /// Check ranges, and refuse settings that would be accepted and then do nothing (naming
    /// the other one).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first field (`worker.<field>`) out of range or
    /// inconsistent with another.
    pub fn validate(&self) -> Result<(), ConfigError> {
        use crate::kernels::cuda::{BackendChoice, GemmPrecision};
        let w = self;
        if !(w.sim_speedup.is_finite() && w.sim_speedup > 0.0) {
            return Err(ConfigError::invalid(
                "worker.sim_speedup",
                "must be a finite number > 0",
            ));
        }
        if !(w.sim_transfer_gbps.is_finite() && w.sim_transfer_gbps > 0.0) {
            return Err(ConfigError::invalid(
                "worker.sim_transfer_gbps",
                "must be > 0",
            ));
        }
        // Settings that would be accepted and then do nothing: refused, naming the other one.
        if w.engine == EngineKind::Sim && w.backend == BackendChoice::Cuda {
            return Err(ConfigError::invalid(
                "worker.backend",
                "cuda has no effect with worker.engine = \"sim\" (the sim engine runs \
                 no kernels); leave it auto or cpu",
            ));
        }
        if w.backend == BackendChoice::Cpu && w.cuda_gemm != GemmPrecision::F32 {
            return Err(ConfigError::invalid(
                "worker.cuda_gemm",
                "bf16 has no effect with worker.backend = \"cpu\"; set the backend to \
                 auto or cuda",
            ));
        }
        if w.replicas == 0 {
            return Err(ConfigError::invalid(
                "worker.replicas",
                "must be at least 1",
            ));
        }
        if w.kv_blocks == Some(0) {
            return Err(ConfigError::invalid(
                "worker.kv_blocks",
                "must be at least 1",
            ));
        }
        if w.kv_disk_blocks > 0 && w.kv_host_blocks == 0 {
            return Err(ConfigError::invalid(
                "worker.kv_disk_blocks",
                "the disk tier (G3) is fed by the host tier (G2): set worker.kv_host_blocks too",
            ));
        }
        if w.kv_disk_blocks > 0 && w.engine == EngineKind::Cpu && w.kv_disk_dir.is_none() {
            return Err(ConfigError::invalid(
                "worker.kv_disk_blocks",
                "the CPU engine keeps G3 in files: set worker.kv_disk_dir",
            ));
        }
        if !(w.pull_block_ms.is_finite() && w.pull_block_ms >= 0.0) {
            return Err(ConfigError::invalid(
                "worker.pull_block_ms",
                "must be finite and >= 0",
            ));
        }
        if w.peer_pulls && w.pull_ask_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "worker.pull_ask_timeout_ms",
                "must be at least 1",
            ));
        }
        if w.kv_host_blocks > 0 && w.kv_offload_in_flight == 0 {
            return Err(ConfigError::invalid(
                "worker.kv_offload_in_flight",
                "must be at least 1",
            ));
        }
        for (field, v) in [
            ("worker.sim_host_gbps", w.sim_host_gbps),
            ("worker.sim_disk_gbps", w.sim_disk_gbps),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError::invalid(field, "must be a positive number"));
            }
        }
        for (field, base) in [
            ("worker.http", w.http),
            ("worker.kv_events_addr", w.kv_events_addr),
        ] {
            if let Some(b) = base
                && b.port() != 0
                && u32::from(b.port()) + w.replicas > 65_536
            {
                return Err(ConfigError::invalid(
                    field,
                    format!(
                        "port {} + {} replicas runs past 65535",
                        b.port(),
                        w.replicas
                    ),
                ));
            }
        }
        if w.block_size_tokens == 0 {
            return Err(ConfigError::invalid(
                "worker.block_size_tokens",
                "must be at least 1",
            ));
        }
        if w.max_num_seqs == 0 || w.max_num_batched_tokens == 0 {
            return Err(ConfigError::invalid(
                "worker.max_num_seqs",
                "batch limits must be at least 1",
            ));
        }
        if w.max_model_len_tokens < 2 {
            return Err(ConfigError::invalid(
                "worker.max_model_len_tokens",
                "must be at least 2",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_that_would_do_nothing_are_refused_naming_the_other() {
        let load = |w: serde_json::Value| {
            serde_json::from_value::<WorkerConfig>(w)
                .expect("a worker section")
                .validate()
        };
        let err = load(serde_json::json!({"engine": "sim", "backend": "cuda"})).unwrap_err();
        assert!(
            err.to_string().contains("worker.backend") && err.to_string().contains("sim"),
            "{err}"
        );
        let err = load(serde_json::json!({"backend": "cpu", "cuda_gemm": "bf16"})).unwrap_err();
        assert!(
            err.to_string().contains("worker.cuda_gemm") && err.to_string().contains("cpu"),
            "{err}"
        );
        // What does act is accepted.
        load(serde_json::json!({"engine": "sim", "backend": "cpu"})).unwrap();
        load(serde_json::json!({"backend": "auto", "cuda_gemm": "bf16"})).unwrap();
        load(serde_json::json!({"backend": "cuda", "cuda_gemm": "bf16"})).unwrap();
    }
}
