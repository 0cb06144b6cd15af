//! The `[supervision]` section: the restart budgets and stop deadlines of this node's tree
//! (`tree.rs`), given to the supervisors as [`SupervisorFlags`] and child shutdowns by the
//! composition root (`node/tree_args.rs`).
//!
//! [`SupervisorFlags`]: crate::runtime::supervision::SupervisorFlags

use crate::runtime::config::ConfigError;
use serde::{Deserialize, Serialize};

/// Restart budgets (see `runtime::supervision::SupervisorFlags`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisionConfig {
    /// The node supervisor's budget: more restarts than this within `node_period_ms` and
    /// the node process exits non-zero.
    pub node_max_restarts: u32,
    /// Window of the node budget.
    pub node_period_ms: u64,
    /// Restart budget of the gateway supervisor and of the worker pool (the replicas,
    /// `router_sup` and `request_sup` have their own, fixed in `supervisors/tree.rs`).
    pub max_restarts: u32,
    /// Window of that budget.
    pub period_ms: u64,
    /// First restart delay; doubles per restart within the window.
    pub backoff_base_ms: u64,
    /// Largest restart delay.
    pub backoff_max_ms: u64,
    /// Time a child is given to stop before it is killed.
    pub shutdown_timeout_ms: u64,
}

impl Default for SupervisionConfig {
    fn default() -> Self {
        Self {
            node_max_restarts: 3,
            node_period_ms: 60_000,
            max_restarts: 10,
            period_ms: 60_000,
            backoff_base_ms: 10,
            backoff_max_ms: 1_000,
            shutdown_timeout_ms: 5_000,
        }
    }
}

impl SupervisionConfig {
    /// Check that the node's budget has a window and the backoff grows.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field (`supervision.<field>`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.node_max_restarts == 0 && self.node_period_ms == 0 {
            return Err(ConfigError::invalid(
                "supervision.node_period_ms",
                "must be positive",
            ));
        }
        if self.backoff_max_ms < self.backoff_base_ms {
            return Err(ConfigError::invalid(
                "supervision.backoff_max_ms",
                "must be at least supervision.backoff_base_ms",
            ));
        }
        Ok(())
    }
}
