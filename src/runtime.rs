//! What every node runs on, whatever its roles: the node process, the cluster, configuration,
//! identifiers, time, payloads between nodes, metrics and resilience counters.
//! - `node.rs` — one node process: start, ready line, drain, ordered stop.
//! - `context.rs` — `NodeContext`: what the node's supervision tree is built from.
//! - `cluster.rs` — the `ractor_cluster` NodeServer, joining, cookie errors.
//! - `config.rs` — the typed configuration tree (TOML + env + `--set`).
//! - `ids.rs` — newtypes: node, worker, request, sequence and event ids.
//! - `clock.rs` — injected time (`SystemClock`, `ManualClock`).
//! - `wire.rs` — MessagePack payloads between nodes.
//! - `metrics.rs` — the Prometheus recorder.
//! - `role.rs` — `NodeRole`: gateway, router, worker (what a node runs).
//! - `resilience.rs` — per-node resilience counters and draining flag, panic accounting.

pub mod clock;
pub mod cluster;
pub mod config;
pub mod context;
pub mod ids;
pub mod metrics;
pub mod node;
pub mod ports;
pub mod resilience;
pub mod role;
pub mod wire;
