//! Actors, one per file, each with its message enum beside it; pure logic they drive sits in
//! a sibling folder.
//! - `discovery.rs` — membership, heartbeats, liveness, pg groups per role
//!   (`discovery/membership.rs`: the lease table).
//! - `gateway.rs` — the HTTP gateway (`gateway/routes.rs`, `gateway/error.rs`).

pub mod discovery;
pub mod gateway;
