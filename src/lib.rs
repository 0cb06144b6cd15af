//! Flotilla: serve one LLM from a fleet of replicas.
//!
//! Layout, in the order of the design's planes (`docs/architecture.md` gives the whole picture):
//! - `runtime/` — the node process, cluster, config, ids, clock, wire payloads, metrics.
//! - `supervisors/` — OTP-style supervision: specs, the generic supervisor, the node's tree.
//! - `control/` — control plane: discovery (membership, liveness), chaos (fault injection).
//! - `request_plane/` — gateway, one actor per request, KV-aware router, token sinks.
//! - `worker/` — a replica: the continuous-batching scheduler and the engine worker.
//! - `kv/` — storage plane: the paged block pool, block / sequence hashes, KV events.
//! - `transport/` — KV blocks between nodes: registered memory, one-sided reads (UCX, TCP).
//! - `openai/` — the OpenAI wire protocol, pure: request parsing, responses, SSE, stop strings,
//!   detokenizer, the error shape.
//! - `model/` — GGUF / Hugging Face loading, tokenizer, chat template, forward pass.
//! - `kernels/` — compute kernels behind a device boundary (CPU; CUDA later), sampling.
//! - `cli/` — the `flotilla` subcommands: up, status, generate, chaos, bench, profile, soak.

pub mod cli;
pub mod control;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod openai;
pub mod request_plane;
pub mod runtime;
pub mod supervisors;
pub mod transport;
pub mod worker;
