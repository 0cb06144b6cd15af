//! The ground floor: what every node runs on, whatever its roles — the cluster, identifiers,
//! time, payloads between nodes, metrics, ports and resilience counters. It imports no plane;
//! the node process and its configuration (the composition root) are in [`crate::node`].
//! - `cluster.rs` — the `ractor_cluster` NodeServer, joining, cookie errors.
//! - `config.rs` — [`config::ConfigError`], what every plane's configuration section answers
//!   its check with (the sections are in their planes, the tree in `node/config.rs`).
//! - `ids.rs` — newtypes: node, worker, request, sequence and event ids.
//! - `clock.rs` — injected time (`SystemClock`, `ManualClock`).
//! - `wire.rs` — MessagePack payloads between nodes.
//! - `metrics.rs` — the Prometheus recorder.
//! - `role.rs` — `NodeRole` (what a node runs) and `Role` (what a replica does: aggregated, prefill, decode).
//! - `resilience.rs` — per-node resilience counters and draining flag, panic accounting.
//! - `signals.rs` — a gateway's cumulative request counts and latency histograms (the
//!   planner's signals).
//! - `supervision.rs` — the generic OTP-style supervisor (specs and the supervisor actor).

pub mod clock;
pub mod cluster;
pub mod config;
pub mod ids;
pub mod metrics;
pub mod otlp;
pub mod ports;
pub mod resilience;
pub mod role;
pub mod signals;
pub mod supervision;
pub mod wire;
