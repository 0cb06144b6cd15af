//! The control plane (seconds): who is in the fleet and what faults are installed.
//! - `discovery.rs` — membership, heartbeats, liveness, process groups per role
//!   (`discovery/membership.rs`: the lease table).
//! - `chaos.rs` — faults injected on purpose: the node's fault book and the Chaos actor.

pub mod chaos;
pub mod discovery;
