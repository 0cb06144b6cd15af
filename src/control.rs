//! The control plane (seconds), pure: who is in the fleet and what faults are installed. Its
//! actors (Discovery, Chaos) are in [`crate::actors`].
//! - `discovery.rs` — the published fleet view, the replicas' endpoints
//!   (`discovery/membership.rs`: the lease table, node and worker views).
//! - `chaos.rs` — faults injected on purpose: their kinds and the node's fault book.

pub mod chaos;
pub mod discovery;
