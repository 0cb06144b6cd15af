//! A worker replica: the scheduler that forms batches and the engine that runs them.
//! - `scheduler.rs` — continuous batching, chunked prefill, paged KV (`scheduler/batch.rs`:
//!   the pure batch former).
//! - `engine.rs` — one device's engine worker: the real transformer (`engine/transformer.rs`)
//!   or the simulated engine (`engine/sim.rs`).

pub mod engine;
pub mod scheduler;
