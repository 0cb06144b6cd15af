//! A worker replica: the scheduler that forms batches and the engine that runs them.
//! The actors that drive a replica (scheduler, engine worker, external engine) are in
//! [`crate::actors`]; this module holds their pure parts.
//! - `scheduler.rs` — continuous batching, chunked prefill, paged KV: the replica's decisions
//!   as a pure state machine (`WorkerCore`, `worker_core.rs`), the batch former
//!   ([`SchedulerCore`], `batch.rs`), the step watchdog (`watchdog.rs`), the per-owner outbox
//!   of token events (`outbox.rs`), the step-time model (`step_model.rs`) and the chaos
//!   `fill_kv` holder of blocks (`fill.rs`).
//! - `config.rs` — [`config::WorkerConfig`]: the `[worker]` section (replicas, engine and
//!   backend, KV pool and tiers, batch limits, watchdog, peer pulls, the sim engine's models,
//!   faces) and its checks.
//! - `engine.rs` — the [`StepEngine`] trait: the real transformer (`engine/transformer.rs`),
//!   the simulated engine (`engine/sim.rs`), and the chaos filter that wraps either
//!   (`engine/chaos.rs`).
//! - `error.rs` — [`WorkerError`]: why a step produced no tokens.
//! - `faults.rs` — [`WorkerFaults`](faults::WorkerFaults): the chaos faults aimed at this
//!   node's replicas, as their schedulers and engines read them (written by the Chaos actor).
//! - `tiers.rs` — the bytes of the lower KV tiers on a real engine: G2 host memory, the G3
//!   segment file (checksummed records), and the copier threads that carry out the pool's
//!   tier copies.
//! - `external.rs` — an engine outside Flotilla (`router.external_workers`) seen as a
//!   replica: a scheduler-shaped proxy over HTTP and its KV events over ZMQ.
//!
//! [`SchedulerCore`]: scheduler::SchedulerCore
//! [`StepEngine`]: engine::StepEngine

pub mod config;
pub mod engine;
mod error;
pub mod external;
pub mod faults;
pub mod scheduler;
pub mod tiers;

pub use error::WorkerError;
