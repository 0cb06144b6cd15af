//! The control plane (seconds), pure: who is in the fleet, what faults are installed, and how
//! big each pool should be. Its
//! actors (Discovery, Chaos) are in [`crate::actors`].
//! - `discovery.rs` — the published fleet view, the replicas' endpoints
//!   (`discovery/membership.rs`: the lease table, node and worker views).
//! - `chaos.rs` — faults injected on purpose: their kinds and the node's fault book.
//! - `planner.rs` — the pool sizing policy: signals, forecasts, capacity curves, hysteresis,
//!   decisions (`planner/`).
//! - `reconcile.rs` — which of the planner's decisions a reconciler applies, in node counts.

pub mod chaos;
pub mod discovery;
pub mod leadership;
pub mod planner;
pub mod reconcile;
