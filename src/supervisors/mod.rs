//! Supervision trees, OTP style.
//!
//! - `spec.rs` — strategy, restart and shutdown types, flags, child and supervisor specs.
//! - `supervisor.rs` — the generic supervisor actor that enforces them.
//! - `tree.rs` — this node's whole tree as data (DESIGN.md §3); roles select the branches.

pub mod spec;
pub mod supervisor;
pub mod tree;

pub use spec::{ChildSpec, Restart, Shutdown, Strategy, SupervisorFlags, SupervisorSpec};
pub use supervisor::{ChildInfo, Supervisor, SupervisorMsg};
