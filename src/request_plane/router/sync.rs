//! What routers tell each other of their load (`router.share_load`; `load.rs`, "Several
//! routers"): one [`LoadChange`] per change a router makes to its own [`ActiveLoad`](super::load::ActiveLoad), applied by
//! the others as their own.

use super::load::RequestKey;
use super::policy::Policy;
use crate::runtime::ids::{NodeId, RequestId, SequenceHash, WorkerId};

/// A change one router made to its [`ActiveLoad`](super::load::ActiveLoad), told to the other routers (module doc,
/// "Several routers").
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum LoadChange {
    /// `request` of gateway `node` was placed on `worker` by `policy`
    /// ([`ActiveLoad::on_routed_prefix`](super::load::ActiveLoad::on_routed_prefix)'s arguments).
    Routed {
        node: NodeId,
        request: RequestId,
        worker: WorkerId,
        policy: Policy,
        /// Uncached prompt tokens to prefill.
        prefill_tokens: u32,
        /// The prompt's full blocks' sequence hashes.
        hashes: Vec<SequenceHash>,
        /// KV blocks in all (prompt blocks, rounded up).
        blocks: u32,
        /// The placing selector's tie cursor after the decision
        /// ([`super::policy::Selector::follow_cursor`]).
        cursor: u64,
        /// The request's session key: `worker` is the session's worker now
        /// ([`super::policy::session::SessionTable::placed`]), for every router. `None`: no
        /// session, or a prefill hand-off (the session follows its decode worker).
        #[serde(default)]
        session: Option<String>,
    },
    /// Its first token came ([`ActiveLoad::on_first_token`](super::load::ActiveLoad::on_first_token)).
    FirstToken { node: NodeId, request: RequestId },
    /// It ended ([`ActiveLoad::on_finished`](super::load::ActiveLoad::on_finished)).
    Finished { node: NodeId, request: RequestId },
}

impl LoadChange {
    /// The request the change is about.
    pub fn key(&self) -> RequestKey {
        match self {
            Self::Routed { node, request, .. }
            | Self::FirstToken { node, request }
            | Self::Finished { node, request } => RequestKey::new(node.clone(), *request),
        }
    }
}
