//! The generic OTP-style supervisor: what a supervision tree is made of, below every actor
//! that uses it (the gateway starts each request under one) and the node's tree that is
//! written with it (`crate::supervisors::tree`).
//! - `spec.rs` — strategy, restart and shutdown types, flags, child and supervisor specs.
//! - `supervisor.rs` — the supervisor actor that enforces them.

pub mod spec;
pub mod supervisor;

pub use spec::{ChildSpec, Restart, Shutdown, Strategy, SupervisorFlags, SupervisorSpec};
pub use supervisor::{ChildInfo, Supervisor, SupervisorMsg};
