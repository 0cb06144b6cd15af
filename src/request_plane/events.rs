//! The fleet's event bus: one broadcast channel per node on which the actors that *decide*
//! something say so — a placement, a hand-off, a migration, a request given up, a fault
//! installed or cleared, a replica's role change, a worker or node coming and going. Readers
//! (the gateway's `GET /v1/fleet/events` stream; the live fleet page and the offline
//! simulator later) subscribe; a reader that falls behind loses the oldest events (it is
//! told how many), never slows a writer.
//!
//! Events are per node: a gateway node sees its requests' placements and migrations and, where
//! it runs a router, workers joining and leaving; a worker node sees its replicas' role
//! changes and the faults installed on it. Each event names the node that emitted it.

use crate::control::chaos::FaultKind;
use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::role::Role;
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

/// How many events a slow reader may fall behind before it loses the oldest.
pub const EVENT_BUFFER: usize = 4096;

/// What happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum FleetEventKind {
    /// A request's attempt was placed on `worker` and submitted there (`attempt` counts from
    /// 1; `hand_off`: a prefill-only attempt whose KV a decode attempt will pull; `terms`: the
    /// router's cost terms for the choice, absent for a pinned request).
    Placed {
        #[serde(with = "id_string")]
        request: RequestId,
        /// The client's `x-request-id` (what the logs carry), when it had one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<String>,
        worker: WorkerId,
        attempt: u32,
        hand_off: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        terms: Option<crate::request_plane::protocol::PlacementTerms>,
    },
    /// A prefill worker handed the request's KV off (`tokens` of prompt).
    HandedOff {
        #[serde(with = "id_string")]
        request: RequestId,
        from: WorkerId,
        tokens: u32,
    },
    /// The request's worker was lost; it migrates with `generated` tokens.
    Migrated {
        #[serde(with = "id_string")]
        request: RequestId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<String>,
        from: Option<WorkerId>,
        generated: usize,
        reason: String,
    },
    /// The request was given up (its client gets a 503 or an error record).
    GaveUp {
        #[serde(with = "id_string")]
        request: RequestId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<String>,
        reason: String,
    },
    /// A fault was installed on this node.
    FaultInstalled {
        id: u64,
        #[serde(flatten)]
        kind: FaultKind,
        workers: Vec<WorkerId>,
    },
    /// A fault was cleared on this node (`expired`: its time was up).
    FaultCleared {
        id: u64,
        expired: bool,
    },
    /// A replica switched role.
    RoleChanged {
        worker: WorkerId,
        role: Role,
    },
    /// A worker's scheduler joined the fleet (started or restarted).
    WorkerUp {
        worker: WorkerId,
    },
    /// A worker's scheduler left the fleet (dead, restarting or stopped).
    WorkerDown {
        worker: WorkerId,
    },
    /// Membership: a node came up, became suspect, or went down.
    NodeUp {
        node: NodeId,
    },
    NodeSuspect {
        node: NodeId,
    },
    NodeDown {
        node: NodeId,
    },
}

/// Request ids are 64-bit: JSON readers with doubles (a browser) would round them, so the
/// events carry them as decimal strings (and read a number too).
mod id_string {
    use crate::runtime::ids::RequestId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &RequestId, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&id.0)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<RequestId, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Number(u64),
            Text(String),
        }
        match Either::deserialize(d)? {
            Either::Number(n) => Ok(RequestId(n)),
            Either::Text(t) => t.parse().map(RequestId).map_err(serde::de::Error::custom),
        }
    }
}

impl FleetEventKind {
    /// Whether a gateway shows it beyond the node it happened on: faults and role changes
    /// (relayed by Discovery to every gateway node). Requests' events stay on their gateway's
    /// node; worker and node comings and goings every router and Discovery sees for itself.
    pub fn is_fleet_wide(&self) -> bool {
        matches!(
            self,
            Self::FaultInstalled { .. } | Self::FaultCleared { .. } | Self::RoleChanged { .. }
        )
    }
}

/// One event: when (ms since the Unix epoch), where it was emitted, what.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FleetEvent {
    /// Wall-clock time of emission, ms since the Unix epoch.
    pub at_ms: u64,
    /// The node whose actor emitted it.
    pub node: NodeId,
    /// What happened.
    #[serde(flatten)]
    pub kind: FleetEventKind,
}

/// A node's event bus (cloned cheaply; every clone writes to the same channel).
#[derive(Clone, Debug)]
pub struct EventBus {
    node: NodeId,
    tx: broadcast::Sender<FleetEvent>,
    /// This node's own fleet-wide events ([`FleetEventKind::is_fleet_wide`]) again, for the
    /// relay to the gateways: it never wakes for a request's events.
    own_wide: broadcast::Sender<FleetEvent>,
}

/// How many of its own fleet-wide events the relay may fall behind (they are rare).
const WIDE_BUFFER: usize = 256;

impl EventBus {
    /// A bus for `node`'s actors.
    pub fn new(node: NodeId) -> Self {
        Self {
            node,
            tx: broadcast::channel(EVENT_BUFFER).0,
            own_wide: broadcast::channel(WIDE_BUFFER).0,
        }
    }

    /// Say that `kind` happened (dropped when nobody listens).
    pub fn emit(&self, kind: FleetEventKind) {
        let event = FleetEvent {
            at_ms: crate::runtime::clock::unix_ms(),
            node: self.node.clone(),
            kind,
        };
        if event.kind.is_fleet_wide() {
            let _ = self.own_wide.send(event.clone());
        }
        let _ = self.tx.send(event);
    }

    /// Put an event that happened on another node (relayed to this one) on this bus as it
    /// was: its time and node are kept (not relayed again).
    pub fn forward(&self, event: FleetEvent) {
        let _ = self.tx.send(event);
    }

    /// Every event from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<FleetEvent> {
        self.tx.subscribe()
    }

    /// This node's own fleet-wide events from now on (what Discovery relays to the gateways).
    pub fn subscribe_own_fleet_wide(&self) -> broadcast::Receiver<FleetEvent> {
        self.own_wide.subscribe()
    }
}

impl Default for EventBus {
    /// A bus with no node name (tests, tools).
    fn default() -> Self {
        Self::new(NodeId::new(""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_reach_every_subscriber_in_order_with_their_shape() {
        let bus = EventBus::new(NodeId::new("node-0"));
        bus.emit(FleetEventKind::WorkerUp {
            worker: WorkerId::new("node-1/replica-0"),
        }); // nobody listens: dropped, no error
        let mut a = bus.subscribe();
        let mut b = bus.clone().subscribe();
        bus.emit(FleetEventKind::Placed {
            request: RequestId(7),
            request_id: Some("abc".into()),
            worker: WorkerId::new("node-1/replica-0"),
            attempt: 1,
            hand_off: false,
            terms: None,
        });
        bus.emit(FleetEventKind::FaultInstalled {
            id: 3,
            kind: FaultKind::Slow { delay_ms: 5 },
            workers: vec![WorkerId::new("node-1/replica-0")],
        });
        for rx in [&mut a, &mut b] {
            let first = rx.try_recv().expect("placed");
            let v = serde_json::to_value(&first).expect("json");
            assert_eq!(
                v["request"], "7",
                "a string: JSON readers with doubles round u64s"
            );
            assert_eq!(v["request_id"], "abc");
            let back: FleetEvent = serde_json::from_value(v).expect("reads back");
            assert_eq!(back, first);
            assert!(matches!(
                first.kind,
                FleetEventKind::Placed { attempt: 1, .. }
            ));
            assert_eq!(first.node, NodeId::new("node-0"));
            let second = rx.try_recv().expect("fault");
            let v = serde_json::to_value(&second).expect("json");
            assert_eq!(v["event"], "fault_installed");
            assert_eq!(v["kind"], "slow");
            assert_eq!(v["delay_ms"], 5);
            assert_eq!(v["node"], "node-0");
            assert!(rx.try_recv().is_err());
        }
    }

    /// The relay's channel carries this node's own faults and role changes only: not a
    /// request's events, not an event forwarded from another node.
    #[test]
    fn only_own_fleet_wide_events_reach_the_relay() {
        let bus = EventBus::new(NodeId::new("w"));
        let mut wide = bus.subscribe_own_fleet_wide();
        let mut all = bus.subscribe();
        bus.emit(FleetEventKind::WorkerUp {
            worker: WorkerId::new("w/replica-0"),
        });
        bus.forward(FleetEvent {
            at_ms: 1,
            node: NodeId::new("elsewhere"),
            kind: FleetEventKind::FaultCleared {
                id: 9,
                expired: true,
            },
        });
        bus.emit(FleetEventKind::FaultCleared {
            id: 3,
            expired: false,
        });
        let got = wide.try_recv().expect("the own fault");
        assert_eq!(
            (got.node.as_str(), &got.kind),
            (
                "w",
                &FleetEventKind::FaultCleared {
                    id: 3,
                    expired: false
                }
            )
        );
        assert!(wide.try_recv().is_err(), "nothing else");
        assert_eq!(std::iter::from_fn(|| all.try_recv().ok()).count(), 3);
    }
}
