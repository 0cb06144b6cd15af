//! Roles, the vocabulary every layer speaks: [`NodeRole`], what a node runs (the
//! configuration starts it, the membership shows it), and [`Role`], what a replica does in
//! disaggregated serving (routers, workers, the fleet view).
//!
//! A replica's [`Role`]:
//! - `aggregated` (default): prefill and decode on the same replica, as before
//!   disaggregation.
//! - `prefill`: chosen by routers only to compute a long prompt's KV and its first token,
//!   which it hands off (the protocol's `TokenEventKind::HandOff`) to a
//!   decode worker; when no other worker is routable it serves whole requests too.
//! - `decode`: serves whole requests; a router sends a request whose uncached prompt part is
//!   at least `disagg.min_prefill_tokens` to a prefill worker first (Dynamo's conditional
//!   disaggregation), and this replica pulls the KV and decodes.
//!
//! A replica's scheduler is a member of [`role_group`] of its role (none for aggregated);
//! routers read the groups. The role changes at run time by `SchedulerMsg::SetRole`: the
//! replica leaves routing, finishes what it runs (a drain), switches groups and comes back.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// What a node runs; roles select the branches of the supervision tree.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum NodeRole {
    /// The HTTP gateway (OpenAI API, health, metrics, fleet status).
    Gateway,
    /// Request placement.
    Router,
    /// Model replicas.
    Worker,
    /// Pool sizing: the Planner actor decides each pool's size from the fleet view and
    /// publishes it (a reconciler applies it).
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

/// A replica's role (`worker.role`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill and decode here.
    #[default]
    Aggregated,
    /// Prefill long prompts for decode workers.
    Prefill,
    /// Decode, pulling long prompts' KV from prefill workers.
    Decode,
}

impl Role {
    /// The role's name in configuration and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "aggregated" => Ok(Role::Aggregated),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(format!(
                "unknown role {other:?} (aggregated, prefill or decode)"
            )),
        }
    }
}

/// Process group of the schedulers in `role` (`None` for aggregated: no group).
pub fn role_group(role: Role) -> Option<&'static str> {
    match role {
        Role::Aggregated => None,
        Role::Prefill => Some("flotilla.schedulers.prefill"),
        Role::Decode => Some("flotilla.schedulers.decode"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_parse_and_print_the_same_names() {
        for r in [Role::Aggregated, Role::Prefill, Role::Decode] {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.as_str())
            );
        }
        assert!("both".parse::<Role>().is_err());
        assert_eq!(role_group(Role::Aggregated), None);
        assert_ne!(role_group(Role::Prefill), role_group(Role::Decode));
    }
}
