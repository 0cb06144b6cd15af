//! Flotilla: serve one LLM from a fleet of replicas.
//!
//! Layout (`docs/architecture.md` gives the whole picture): the design card's folders first,
//! then the planes whose pure logic the actors drive.
//! - `actors/` — every actor of a node, one file each (gateway, request, router, token sink,
//!   scheduler, engine worker, KV event publisher, external engine, discovery, chaos): thin
//!   drivers — mailbox, messages, timers, I/O — over the planes below.
//! - `supervisors/` — OTP-style supervision: specs, the generic supervisor, the node's tree.
//! - `transport/` — KV blocks between nodes: registered memory, one-sided reads (UCX, TCP),
//!   and its actor.
//! - `kernels/` — compute kernels behind a device boundary (CPU, CUDA through `cudarc` behind
//!   the `cuda` feature), sampling.
//! - `request_plane/` — what the request path speaks and decides: protocol, errors, admission,
//!   the model's frontend, migration, the prefix index, load and routing policy.
//! - `worker/` — a replica's pure parts: the batch former, watchdog, outbox, step-time model;
//!   the engines (transformer, sim, chaos filter); the external engine's stream decoder.
//! - `kv/` — storage plane: the paged block pool, block / sequence hashes, KV events and
//!   their wire formats.
//! - `control/` — control plane: membership and the fleet view, the chaos fault book.
//! - `openai/` — the OpenAI wire protocol, pure: request parsing, responses, SSE, stop strings,
//!   detokenizer, the error shape.
//! - `anthropic/` — Anthropic's Messages API wire protocol, pure: request parsing into the
//!   same normalized request, the message body, the streaming events, the error shape.
//! - `model/` — GGUF / Hugging Face loading, tokenizer, chat template, forward pass.
//! - `node/` — the composition root: one node process (start, ready line, drain, stop), the
//!   typed configuration, the context the supervision tree is built from.
//! - `otlp` — the optional OpenTelemetry export of the tracing spans (`--otlp-endpoint`).
//! - `runtime/` — the ground floor: cluster, ids, clock, wire payloads, metrics, ports,
//!   resilience counters.
//! - `cli/` — the `flotilla` subcommands: up, node, status, generate, chaos, bench, profile,
//!   soak, transport, cuda.

pub mod actors;
pub mod anthropic;
pub mod cli;
pub mod control;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod node;
pub mod openai;
pub mod request_plane;
pub mod runtime;
pub mod sim;
pub mod supervisors;
pub mod transport;
pub mod worker;
