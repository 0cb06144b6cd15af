//! Actors, one per file, each with its message enum beside it; pure logic they drive sits in
//! a sibling folder.
//! - `chaos.rs` — faults injected on purpose: the node's fault book and Chaos actor.
//! - `discovery.rs` — membership, heartbeats, liveness, pg groups per role
//!   (`discovery/membership.rs`: the lease table).
//! - `engine_worker.rs` — one device's engine: weights + KV pools, batched steps
//!   (`engine_worker/engine.rs`: the synchronous engine; `types.rs`: step types).
//! - `token_sink.rs` — where a node receives its requests' tokens, one message per step.
//! - `gateway.rs` — the HTTP gateway (`gateway/routes.rs`, `gateway/error.rs`).
//! - `kv_block_manager.rs` — the paged KV block pool, block/sequence hashes, KV events
//!   (pure logic in `kv_block_manager/`; the actor lands with the serving path).
//! - `request.rs` — one actor per in-flight request: placement, submission, tokens, cancel.
//! - `router.rs` — placement (first version: least outstanding, round-robin ties; `router/select.rs`).
//! - `scheduler.rs` — the continuous-batching batch former (pure logic in `scheduler/`).

pub mod chaos;
pub mod discovery;
pub mod engine_worker;
pub mod gateway;
pub mod kv_block_manager;
pub mod request;
pub mod router;
pub mod scheduler;
pub mod token_sink;
