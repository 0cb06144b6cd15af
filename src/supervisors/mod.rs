//! Supervision trees, OTP style.
//!
//! - `spec.rs` — strategy, restart and shutdown types, flags, child and supervisor specs.
//! - `supervisor.rs` — the generic supervisor actor that enforces them.
//! - `tree.rs` — this node's whole tree as data (roles select the branches); `tree/args.rs`
//!   builds its children's arguments from the configuration, `tree/spawn.rs` their child specs.

pub mod spec;
pub mod supervisor;
pub mod tree;

pub use spec::{ChildSpec, Restart, Shutdown, Strategy, SupervisorFlags, SupervisorSpec};
pub use supervisor::{ChildInfo, Supervisor, SupervisorMsg};
