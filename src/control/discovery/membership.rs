//! Membership table: who is in the cluster and whether they are alive (pure; time passed in).
//!
//! Liveness is a heartbeat lease: a peer unheard for `suspect_after` becomes `Suspect`, for
//! `down_after` (the liveness timeout) `Down`; a session drop makes an `Up` peer `Suspect` at
//! once. A `Down` peer that heartbeats again comes back `Up` (a restarted process reuses its
//! name). Down peers stay listed for `retention`, then are forgotten.

use crate::runtime::clock::Instant;
use crate::runtime::ids::NodeId;
use crate::runtime::role::{NodeRole, Role};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// Liveness of a node as seen from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Heard from within `suspect_after`.
    Up,
    /// Silent for longer than `suspect_after`, or its session dropped.
    Suspect,
    /// Silent for longer than the liveness timeout.
    Down,
}

/// One actor in a node's supervision tree, as listed in the fleet view.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorView {
    /// Path of registered names from the node supervisor down, `/`-separated.
    pub path: String,
    /// ractor status (`running`, `stopping`, …).
    pub state: String,
}

/// A worker's health in the fleet view (JSON: the snake-case name; `""` while unknown).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerHealth {
    /// Its scheduler has published nothing yet (restarting, or just started).
    #[default]
    #[serde(rename = "")]
    Unknown,
    /// Routable.
    Ready,
    /// Finishing its requests, not routable.
    Draining,
    /// Its watchdog found the engine hung; the replica is being restarted.
    Unhealthy,
    /// Its node is not up (suspect or down): nobody can reach it.
    Unreachable,
}

impl WorkerHealth {
    /// Routable as far as the fleet view knows (ready, or not known to be otherwise).
    pub fn may_route(self) -> bool {
        matches!(self, WorkerHealth::Ready | WorkerHealth::Unknown)
    }
}

/// One worker (replica) of a node, with its load as of the node's last heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct WorkerView {
    /// Worker id (`<node>/replica-<k>`).
    pub id: String,
    /// ractor status of the replica supervisor.
    pub state: String,
    /// Sequences running (admitted) on its scheduler.
    #[serde(default)]
    pub running: usize,
    /// Sequences waiting for admission.
    #[serde(default)]
    pub waiting: usize,
    /// Requests in flight on it (running + waiting).
    #[serde(default)]
    pub in_flight: usize,
    /// KV blocks pinned by live sequences.
    #[serde(default)]
    pub kv_blocks_used: usize,
    /// KV blocks in its pool.
    #[serde(default)]
    pub kv_blocks_total: usize,
    /// Its health as the fleet view shows it.
    #[serde(default)]
    pub health: WorkerHealth,
    /// `aggregated`, `prefill` or `decode` (disaggregated serving); `null` while its
    /// scheduler has published nothing (restarting).
    #[serde(default)]
    pub role: Option<Role>,
    /// Prefill role: sequences handed off whose KV blocks are held for a decode worker's pull.
    #[serde(default)]
    pub kv_held: usize,
    /// Decode role: KV pulls in flight.
    #[serde(default)]
    pub kv_pulls_pending: usize,
    /// KV blocks pulled from prefill workers since the replica started.
    #[serde(default)]
    pub kv_blocks_pulled: u64,
    /// Pulls that failed and were recomputed locally since the replica started.
    #[serde(default)]
    pub kv_pull_fallbacks: u64,
    /// Predicted wait before a request arriving now starts its prefill (ms): the queued
    /// prompt tokens through the replica's fitted step-time model; `None` until it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_wait_ms: Option<u64>,
    /// The replica's measured prefill rate (prompt tokens/s at full steps of
    /// `worker.max_num_batched_tokens`, from the same step-time model); admission turns the
    /// router's fresher prefill queue into a wait with it. `None` until it has a model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_tokens_per_s: Option<u64>,
    /// The replica's own OpenAI-compatible HTTP face (`worker.http`), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_addr: Option<String>,
    /// Where it publishes vLLM-format KV events (`worker.kv_events_addr`), if it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_endpoint: Option<String>,
    /// Peer pulls (G4) since the replica started: as the puller (asked, declined, pulled,
    /// blocks, failed, moot) and as the holder (exported); absent while all are 0.
    #[serde(default, skip_serializing_if = "crate::kv::PeerPullCounters::is_zero")]
    pub kv_peer_pulls: crate::kv::PeerPullCounters,
    /// Its lower KV tiers (G2 host, G3 disk): blocks held and capacity, copies in flight,
    /// counters since its start (`kv/tiers.rs`); absent without tiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_tiers: Option<crate::kv::TierUsage>,
    /// Prompt tokens of the sequences it admitted since it started, and of those the ones
    /// found cached (any tier) or pulled: its prefix-hit rate is `cached_tokens /
    /// prompt_tokens`.
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub cached_tokens: u64,
    /// Tokens it generated since it started (the page's tokens/s: diffs of the sum).
    #[serde(default)]
    pub generated_tokens: u64,
    /// Bytes of KV the replica pulled over the transport since it started (disaggregated and
    /// peer pulls): what its node's `flotilla_kv_transfer_bytes_total` counts, per worker, for
    /// the gateways' `/metrics` (worker nodes serve none).
    #[serde(default)]
    pub kv_transfer_bytes: u64,
}

/// What a node says about itself in every heartbeat.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Node name.
    pub id: NodeId,
    /// Cluster listen address.
    pub addr: String,
    /// HTTP address, for gateway nodes.
    pub http_addr: Option<String>,
    /// Roles.
    pub roles: Vec<NodeRole>,
    /// Process start time (ms since the Unix epoch): tells a restarted node from the old one.
    pub incarnation: u64,
    /// OS process id (for operators and chaos tooling on one machine).
    pub pid: u32,
    /// The node's actors.
    pub actors: Vec<ActorView>,
    /// The node's workers.
    pub workers: Vec<WorkerView>,
    /// Resilience counters since the process started.
    #[serde(default)]
    pub counters: NodeCounters,
    /// A gateway's cumulative request counts and latency histograms (the planner's signals).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signals: Option<crate::runtime::signals::GatewaySignals>,
    /// A planner node's mode and latest decisions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<crate::control::planner::PlannerView>,
    /// The KV regions its transport serves (one per replica with real KV memory): what a
    /// peer needs to pull blocks from them, epochs included.
    #[serde(default)]
    pub regions: Vec<crate::transport::RegionDescriptor>,
}

#[doc(no_inline)]
pub use crate::runtime::resilience::NodeCounters;

/// A node as shown in `/v1/fleet`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    /// Node name.
    pub id: NodeId,
    /// Cluster address.
    pub addr: String,
    /// HTTP address, if it runs a gateway.
    pub http_addr: Option<String>,
    /// Roles.
    pub roles: Vec<NodeRole>,
    /// OS process id.
    pub pid: u32,
    /// Start of the node's process (ms since the Unix epoch): the per-incarnation counters
    /// count from here.
    #[serde(default)]
    pub incarnation: u64,
    /// Liveness.
    pub state: NodeState,
    /// Milliseconds since it was last heard from (0 for this node).
    pub last_seen_ms: u64,
    /// Workers.
    pub workers: Vec<WorkerView>,
    /// Actors.
    pub actors: Vec<ActorView>,
    /// Resilience counters.
    #[serde(default)]
    pub counters: NodeCounters,
    /// A gateway's cumulative request counts and latency histograms (the planner's signals).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signals: Option<crate::runtime::signals::GatewaySignals>,
    /// A planner node's mode and latest decisions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<crate::control::planner::PlannerView>,
    /// KV regions its transport serves.
    #[serde(default)]
    pub regions: Vec<crate::transport::RegionDescriptor>,
}

/// A change of membership, published to subscribers.
#[derive(Clone, Debug, PartialEq)]
pub enum MembershipEvent {
    /// A node joined or came back.
    NodeUp(Box<NodeInfo>),
    /// A node went silent or lost its session.
    NodeSuspect(NodeId),
    /// A node exceeded the liveness timeout.
    NodeDown(NodeId),
    /// A heartbeat from an older incarnation of a node, at another address, than the one
    /// this table holds under its name: a node that was paused or cut off past the liveness
    /// timeout came back after another node took its name. The table keeps the newer one;
    /// the stale one is told to exit (`actors/discovery.rs`).
    Superseded(Box<Superseded>),
}

/// Two incarnations of one node name (see [`MembershipEvent::Superseded`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Superseded {
    /// The name.
    pub node: NodeId,
    /// The stale incarnation's cluster address.
    pub stale_addr: String,
    /// The stale incarnation's process start (ms since the Unix epoch).
    pub stale_incarnation: u64,
    /// Cluster address of the incarnation that holds the name now.
    pub by_addr: String,
    /// Its process start (ms since the Unix epoch).
    pub by_incarnation: u64,
    /// Its OS process id.
    pub by_pid: u32,
}

impl NodeInfo {
    /// A peer's fleet view, read while this node cannot get a session (its re-dials refused):
    /// the incarnation that holds this node's name there, when it is a newer one at another
    /// address and not down. The peers then refuse this node's sessions because they keep the
    /// newer one's under the same name, so no heartbeat of this node reaches them to answer
    /// with [`MembershipEvent::Superseded`].
    pub fn superseded_in(&self, fleet: &[NodeView]) -> Option<Superseded> {
        fleet
            .iter()
            .find(|n| {
                n.id == self.id
                    && n.addr != self.addr
                    && n.incarnation > self.incarnation
                    && n.state != NodeState::Down
            })
            .map(|n| Superseded {
                node: self.id.clone(),
                stale_addr: self.addr.clone(),
                stale_incarnation: self.incarnation,
                by_addr: n.addr.clone(),
                by_incarnation: n.incarnation,
                by_pid: n.pid,
            })
    }
}

/// Lease durations.
#[derive(Clone, Copy, Debug)]
pub struct Leases {
    /// Silence before `Suspect`.
    pub suspect_after: Duration,
    /// Silence before `Down` (the liveness timeout).
    pub down_after: Duration,
    /// How long `Down` nodes stay listed.
    pub retention: Duration,
}

#[derive(Debug, Clone)]
struct Entry {
    info: NodeInfo,
    last_seen: Instant,
    state: NodeState,
}

/// The membership table of one node.
#[derive(Debug)]
pub struct Membership {
    me: NodeInfo,
    leases: Leases,
    peers: BTreeMap<NodeId, Entry>,
}

impl Membership {
    /// A table that knows only this node.
    pub fn new(me: NodeInfo, leases: Leases) -> Self {
        Self {
            me,
            leases,
            peers: BTreeMap::new(),
        }
    }

    /// This node's own info.
    pub fn me(&self) -> &NodeInfo {
        &self.me
    }

    /// Replace this node's own info (actors and workers change).
    pub fn set_me(&mut self, me: NodeInfo) {
        self.me = me;
    }

    /// A heartbeat from `info.id` arrived at `now`.
    pub fn on_heartbeat(&mut self, info: NodeInfo, now: Instant) -> Vec<MembershipEvent> {
        if info.id == self.me.id {
            return Vec::new();
        }
        let mut events = Vec::new();
        match self.peers.get_mut(&info.id) {
            Some(e) if info.incarnation < e.info.incarnation && info.addr != e.info.addr => {
                // Not a restart (a restart is newer): the old process of a name another node
                // took while it was down. Its heartbeat changes nothing here.
                events.push(MembershipEvent::Superseded(Box::new(Superseded {
                    node: info.id.clone(),
                    stale_addr: info.addr,
                    stale_incarnation: info.incarnation,
                    by_addr: e.info.addr.clone(),
                    by_incarnation: e.info.incarnation,
                    by_pid: e.info.pid,
                })));
            }
            Some(e) => {
                let came_back = e.state != NodeState::Up || e.info.incarnation != info.incarnation;
                e.last_seen = now;
                e.state = NodeState::Up;
                e.info = info.clone();
                if came_back {
                    events.push(MembershipEvent::NodeUp(Box::new(info)));
                }
            }
            None => {
                self.peers.insert(
                    info.id.clone(),
                    Entry {
                        info: info.clone(),
                        last_seen: now,
                        state: NodeState::Up,
                    },
                );
                events.push(MembershipEvent::NodeUp(Box::new(info)));
            }
        }
        events
    }

    /// The cluster session to `node` dropped: an `Up` node becomes `Suspect` at once.
    pub fn on_session_lost(&mut self, node: &NodeId) -> Vec<MembershipEvent> {
        match self.peers.get_mut(node) {
            Some(e) if e.state == NodeState::Up => {
                e.state = NodeState::Suspect;
                vec![MembershipEvent::NodeSuspect(node.clone())]
            }
            _ => Vec::new(),
        }
    }

    /// Advance leases to `now`.
    pub fn tick(&mut self, now: Instant) -> Vec<MembershipEvent> {
        let mut events = Vec::new();
        let leases = self.leases;
        self.peers.retain(|id, e| {
            let silent = now.saturating_duration_since(e.last_seen);
            if silent >= leases.down_after {
                if e.state != NodeState::Down {
                    e.state = NodeState::Down;
                    events.push(MembershipEvent::NodeDown(id.clone()));
                }
                return silent < leases.down_after + leases.retention;
            }
            if silent >= leases.suspect_after && e.state == NodeState::Up {
                e.state = NodeState::Suspect;
                events.push(MembershipEvent::NodeSuspect(id.clone()));
            }
            true
        });
        events
    }

    /// State of `node` (this node is always `Up`).
    pub fn state(&self, node: &NodeId) -> Option<NodeState> {
        if *node == self.me.id {
            return Some(NodeState::Up);
        }
        self.peers.get(node).map(|e| e.state)
    }

    /// Every known node, this one first, then by name.
    pub fn view(&self, now: Instant) -> Vec<NodeView> {
        let mine = std::iter::once(NodeView {
            id: self.me.id.clone(),
            addr: self.me.addr.clone(),
            http_addr: self.me.http_addr.clone(),
            roles: self.me.roles.clone(),
            pid: self.me.pid,
            incarnation: self.me.incarnation,
            state: NodeState::Up,
            last_seen_ms: 0,
            workers: self.me.workers.clone(),
            actors: self.me.actors.clone(),
            counters: self.me.counters,
            signals: self.me.signals.clone(),
            planner: self.me.planner.clone(),
            regions: self.me.regions.clone(),
        });
        mine.chain(self.peers.values().map(|e| {
            NodeView {
                id: e.info.id.clone(),
                addr: e.info.addr.clone(),
                http_addr: e.info.http_addr.clone(),
                roles: e.info.roles.clone(),
                pid: e.info.pid,
                incarnation: e.info.incarnation,
                state: e.state,
                last_seen_ms: now.saturating_duration_since(e.last_seen).as_millis() as u64,
                // A node not up cannot vouch for its workers: their last report is shown with
                // health `unreachable`.
                workers: e
                    .info
                    .workers
                    .iter()
                    .cloned()
                    .map(|mut w| {
                        if e.state != NodeState::Up {
                            w.health = WorkerHealth::Unreachable;
                        }
                        w
                    })
                    .collect(),
                actors: e.info.actors.clone(),
                counters: e.info.counters,
                signals: e.info.signals.clone(),
                planner: e.info.planner.clone(),
                regions: e.info.regions.clone(),
            }
        }))
        .collect()
    }
}

#[cfg(test)]
mod tests;
