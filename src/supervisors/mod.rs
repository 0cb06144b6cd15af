//! This node's supervision tree, OTP style, written with the generic supervisor of
//! [`crate::runtime::supervision`].
//!
//! - `tree.rs` — this node's whole tree as data (roles select the branches); `tree/args.rs`
//!   builds its children's arguments from the configuration, `tree/spawn.rs` their child specs.

pub mod tree;
