//! Membership and the fleet view: the pure part of the control plane's discovery.
//!
//! - `config.rs` — [`config::ClusterConfig`]: the `[cluster]` section (heartbeats, suspicion,
//!   liveness, frame size) and its checks.
//! - `membership.rs` — [`membership::Membership`]: the lease table (`up` → `suspect` →
//!   `down`), node and worker views, the heartbeat payload.
//! - [`FleetView`] — the fleet view a node's Discovery actor publishes and hot paths read
//!   without a call; [`WorkerEndpoints`] — where each replica's own HTTP face and KV event
//!   socket are bound.
//!
//! The actor that drives them is [`crate::actors::discovery`].

pub mod config;
pub mod membership;

use crate::runtime::role::NodeRole;
use membership::{NodeView, WorkerView};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// The fleet view last published by a node's Discovery: cloned cheaply, read without a call.
#[derive(Clone, Debug)]
pub struct FleetView {
    tx: Arc<watch::Sender<Option<Arc<[NodeView]>>>>,
}

impl Default for FleetView {
    fn default() -> Self {
        Self {
            tx: Arc::new(watch::channel(None).0),
        }
    }
}

impl FleetView {
    /// Replace the view.
    pub fn publish(&self, nodes: Vec<NodeView>) {
        self.tx.send_replace(Some(nodes.into()));
    }

    /// Withdraw the view (its publisher stopped).
    pub fn clear(&self) {
        self.tx.send_replace(None);
    }

    /// A receiver that sees each new view (the planner tells a stale view by it).
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<[NodeView]>>> {
        self.tx.subscribe()
    }

    /// The latest view, this node first; `None` when none is published (Discovery is not
    /// running).
    pub fn latest(&self) -> Option<Arc<[NodeView]>> {
        self.tx.borrow().clone()
    }
}

/// Process group of every Discovery actor.
pub const DISCOVERY_GROUP: &str = "flotilla.discovery";

/// How often a node re-dials the seeds it has no session with.
pub const REJOIN_INTERVAL: Duration = Duration::from_secs(2);

/// Process group of the Discovery actors of nodes with `role`.
pub fn role_group(role: NodeRole) -> String {
    format!("flotilla.role.{role}")
}

/// Where one replica can be reached besides the cluster, once bound: its own HTTP face
/// (`worker.http`) and its vLLM-format KV event socket (`worker.kv_events_addr`). The actors
/// that bind them write here (and read it back on a restart, to keep a port chosen as 0).
#[derive(Clone, Debug, Default)]
pub struct WorkerEndpoint {
    /// The face's bound address.
    pub http: Arc<Mutex<Option<String>>>,
    /// The KV event socket's bound address.
    pub kv_events: Arc<Mutex<Option<std::net::SocketAddr>>>,
}

/// [`WorkerEndpoint`]s of a node's replicas, by worker id.
#[derive(Clone, Debug, Default)]
pub struct WorkerEndpoints(Arc<Mutex<std::collections::HashMap<String, WorkerEndpoint>>>);

impl WorkerEndpoints {
    /// `worker`'s endpoints (created empty on first use).
    pub fn entry(&self, worker: &str) -> WorkerEndpoint {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(worker.to_owned())
            .or_default()
            .clone()
    }

    /// Fill each view's `http_addr` and `kv_events_endpoint` from what is bound.
    pub fn fill(&self, workers: &mut [WorkerView]) {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for w in workers {
            if let Some(e) = map.get(&w.id) {
                w.http_addr = e.http.lock().unwrap_or_else(|p| p.into_inner()).clone();
                w.kv_events_endpoint = e
                    .kv_events
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .map(|a| format!("tcp://{a}"));
            }
        }
    }
}
