//! [`NodeRole`]: what a node runs. Spoken by the configuration (which roles to start), the
//! membership (which roles a peer has) and the routes that act on a node's role.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What a node runs; roles select the branches of the supervision tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeRole {
    /// The HTTP gateway (OpenAI API, health, metrics, fleet status).
    Gateway,
    /// Request placement.
    Router,
    /// Model replicas.
    Worker,
    /// Pool sizing. Reserved: the configuration's `validate` refuses it until the planner exists, so
    /// that a node never accepts a role it would silently not run.
    Planner,
}

impl NodeRole {
    /// Every role, in display order.
    pub const ALL: [NodeRole; 4] = [
        NodeRole::Gateway,
        NodeRole::Router,
        NodeRole::Worker,
        NodeRole::Planner,
    ];

    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeRole::Gateway => "gateway",
            NodeRole::Router => "router",
            NodeRole::Worker => "worker",
            NodeRole::Planner => "planner",
        }
    }
}

impl fmt::Display for NodeRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NodeRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NodeRole::ALL
            .into_iter()
            .find(|r| r.as_str() == s.trim())
            .ok_or_else(|| format!("unknown role {s:?} (expected gateway, router or worker)"))
    }
}
