//! Flotilla: serve one LLM from a fleet of replicas.
//!
//! Layout (one line per module; DESIGN.md and `docs/architecture.md` give the whole picture):
//! - `actors/` — one actor per file, its messages beside it: discovery, gateway, …
//! - `supervisors/` — OTP-style supervision: specs, the generic supervisor, the node's tree.
//! - `kernels/` — compute kernels behind a device boundary (CPU; CUDA later), sampling.
//! - `model/` — GGUF / Hugging Face loading, tokenizer, chat template, KV pools, forward pass.
//! - `generate.rs` — `flotilla generate`: the engine in-process, no cluster.
//! - `transport/` — moving KV blocks between nodes (UCX / TCP; later).
//! - `cluster.rs` — the `ractor_cluster` NodeServer, joining, cookie errors.
//! - `node.rs` — one node process: start, ready line, ordered stop.
//! - `launcher.rs` — `flotilla up`: a local cluster of node processes.
//! - `status.rs` — `flotilla status`: the fleet view from a gateway.
//! - `chaos_cli.rs` — `flotilla chaos`: a client of the gateway's chaos API.
//! - `config.rs` — the typed configuration tree (TOML + env + flags).
//! - `ids.rs`, `clock.rs`, `wire.rs`, `metrics.rs` — newtypes, injected time, payloads
//!   between nodes, the Prometheus recorder.

pub mod actors;
pub mod bench;
pub mod chaos_cli;
pub mod client;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod generate;
pub mod ids;
pub mod kernels;
pub mod launcher;
pub mod metrics;
pub mod model;
pub mod node;
pub mod profile;
pub mod resilience;
pub mod soak;
pub mod status;
pub mod supervisors;
pub mod wire;
