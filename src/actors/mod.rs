//! Every actor of a node, one file each, its messages beside it. Each is a thin driver —
//! mailbox, messages, timers, I/O — over pure logic that lives in the plane modules
//! (`request_plane/`, `worker/`, `kv/`, `control/`); the node's tree (`supervisors/tree.rs`)
//! starts them.
//!
//! - `gateway.rs` — the HTTP gateway: the only door for clients (`gateway/`: routes, the
//!   request handlers, the accept loop, the request edge, the chaos and worker routes, the
//!   replicas' own faces).
//! - `request.rs` — one per in-flight request: placement, submission, stream, cancel,
//!   migration.
//! - `router.rs` — KV-aware placement, and the relay that feeds it every KV event.
//! - `token_sink.rs` — where a node receives its requests' tokens, one message per step.
//! - `scheduler.rs` — a replica's continuous batching over its block pool.
//! - `engine_worker.rs` — a replica's engine: runs batched steps, one at a time.
//! - `kv_publisher.rs` — a replica's KV events to every router; snapshots for resyncs.
//! - `external_engine.rs` — an engine outside the fleet, seen as a replica's scheduler.
//! - `discovery.rs` — membership, heartbeats, liveness, the published fleet view.
//! - `chaos.rs` — carries out the faults aimed at its node.
//! - `planner.rs` — sizes the pools every interval from the fleet view; publishes decisions.
//!
//! The transport's actor lives with the transport (`transport/actor.rs`), the generic
//! supervisor below every actor (`runtime/supervision/`), the node's tree above them
//! (`supervisors/tree.rs`).

pub mod chaos;
pub mod discovery;
pub mod engine_worker;
pub mod external_engine;
pub mod gateway;
pub mod kv_publisher;
pub mod planner;
pub mod request;
pub mod router;
pub mod scheduler;
pub mod token_sink;
