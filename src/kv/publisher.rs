//! [`KvEventPublisher`]: a replica's KV events out to the cluster.
//!
//! The pool itself is owned by the replica's scheduler (allocation is on the scheduling hot
//! path and must be synchronous). The publisher is the pool's face to the cluster: it receives
//! the pool's KV events after every step, keeps a mirror of the registered blocks (an
//! [`EventReplay`]), publishes the events to every subscriber in [`KV_EVENTS_GROUP`], and
//! answers snapshot requests from that mirror (routers resync from it after a gap).
//!
//! Chaos `drop_kv_events` is a filter here, between the mirror and the subscribers: dropped
//! events never reach the routers, while the mirror (and so every snapshot) keeps them.

use std::collections::{HashMap, HashSet};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;

use super::{EventReplay, KvEvent, SnapshotBlock};
use crate::control::chaos::FaultBook;
use crate::runtime::ids::{EventId, WorkerId};
use crate::runtime::wire::Wire;

/// Process group of KV event subscribers (they accept [`KvEventsMsg`]).
pub const KV_EVENTS_GROUP: &str = "flotilla.kv_events";
/// Process group of KV event publishers, named `<worker id>/kv_manager`.
pub const KV_PUBLISHER_GROUP: &str = "flotilla.kv_managers";

/// What a KV event subscriber accepts.
#[derive(RactorClusterMessage)]
pub enum KvEventsMsg {
    /// Events of one worker, in event-id order (cast).
    Publish(Wire<Vec<KvEvent>>),
}

/// Every registered block of a worker, as of `last_event`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KvSnapshot {
    /// Worker.
    pub worker: WorkerId,
    /// Last event applied (`None` before the first).
    pub last_event: Option<EventId>,
    /// Registered blocks, parents before children.
    pub blocks: Vec<SnapshotBlock>,
}

/// Messages of the [`KvEventPublisher`].
#[derive(RactorClusterMessage)]
pub enum KvPublisherMsg {
    /// Local: events drained from the pool after a step (cast).
    Events(Wire<Vec<KvEvent>>),
    /// Every registered block (call; routers use it to resync).
    #[rpc]
    Snapshot(RpcReplyPort<Wire<KvSnapshot>>),
}

/// The KV event publisher actor; its arguments are the worker id and the node's fault book.
#[derive(Debug, Default, Clone, Copy)]
pub struct KvEventPublisher;

/// [`KvEventPublisher`] state.
pub struct KvPublisherState {
    worker: WorkerId,
    mirror: EventReplay,
    faults: FaultBook,
}

impl KvPublisherState {
    /// The events that reach the subscribers: all of them unless a `drop_kv_events` fault
    /// on this worker drops some.
    fn filter_dropped(&self, events: Vec<KvEvent>) -> Vec<KvEvent> {
        events
            .into_iter()
            .filter(|_| !self.faults.drop_kv_event(&self.worker))
            .collect()
    }
}

fn parents_first(mut blocks: Vec<SnapshotBlock>) -> Vec<SnapshotBlock> {
    let index: HashMap<_, _> = blocks.iter().map(|b| (b.seq_hash, *b)).collect();
    let mut done = HashSet::new();
    let mut out = Vec::with_capacity(blocks.len());
    blocks.sort_by_key(|b| b.seq_hash);
    for b in &blocks {
        let mut chain = vec![*b];
        let mut cur = b.parent;
        while let Some(p) = cur {
            if done.contains(&p) {
                break;
            }
            match index.get(&p) {
                Some(pb) => {
                    chain.push(*pb);
                    cur = pb.parent;
                }
                None => break,
            }
        }
        for c in chain.into_iter().rev() {
            if done.insert(c.seq_hash) {
                out.push(c);
            }
        }
    }
    out
}

impl Actor for KvEventPublisher {
    type Msg = KvPublisherMsg;
    type State = KvPublisherState;
    type Arguments = (WorkerId, FaultBook);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (worker, faults): (WorkerId, FaultBook),
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(KV_PUBLISHER_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(KvPublisherState {
            worker,
            mirror: EventReplay::new(),
            faults,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            KvPublisherMsg::Events(wire) => {
                let Ok(events) = wire.decode() else {
                    return Ok(());
                };
                for ev in &events {
                    if let Err(e) = state.mirror.apply(ev) {
                        tracing::error!(worker = %state.worker, error = %e, "KV event mirror out of order");
                    }
                }
                let events = state.filter_dropped(events);
                if events.is_empty() {
                    return Ok(());
                }
                let payload = Wire::encode(&events);
                for cell in ractor::pg::get_members(&KV_EVENTS_GROUP.to_owned()) {
                    let sub: ActorRef<KvEventsMsg> = cell.into();
                    let _ = sub.cast(KvEventsMsg::Publish(payload.clone()));
                }
            }
            KvPublisherMsg::Snapshot(reply) => {
                let snap = KvSnapshot {
                    worker: state.worker.clone(),
                    last_event: state.mirror.last_event(),
                    blocks: parents_first(state.mirror.blocks().values().copied().collect()),
                };
                let _ = reply.send(Wire::encode(&snap));
            }
        }
        Ok(())
    }
}
