//! This node's supervision tree, OTP style, written with the generic supervisor of
//! [`crate::runtime::supervision`].
//!
//! - `config.rs` — [`config::SupervisionConfig`]: the `[supervision]` section (the node's and
//!   the pools' restart budgets, backoff, shutdown deadline) and its checks.
//! - `tree.rs` — this node's whole tree as data (roles select the branches): each
//!   supervisor's flags, its ordered children and their child specs, over the arguments the
//!   composition root builds (`node/tree_args.rs`).

pub mod config;
pub mod tree;
