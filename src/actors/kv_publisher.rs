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
//!
//! With `worker.kv_events_endpoint` set it also publishes the same events in vLLM's format on
//! a ZMQ PUB socket (`kv/vllm.rs`, `kv/zmq.rs`), for routers built for vLLM. That format
//! carries each stored block's token ids: the scheduler sends them with the events
//! ([`KvPublisherMsg::EventTokens`]), and the publisher remembers them per block so that the
//! re-announcements after a clear carry them too.

use std::collections::HashMap;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;

pub use crate::kv::KvSnapshot;
use crate::kv::events::parents_first;
use crate::kv::faults::KvEventFaults;
use crate::kv::vllm::{VllmBatch, from_flotilla};
use crate::kv::zmq::ZmqPublisher;
use crate::kv::{EventReplay, KvEvent, KvEventData, Tier};
use crate::runtime::ids::{EventId, SequenceHash, WorkerId};
use crate::runtime::wire::Wire;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// Process group of KV event subscribers (they accept [`KvEventsMsg`]).
pub const KV_EVENTS_GROUP: &str = "flotilla.kv_events";
/// Process group of KV event publishers, named `<worker id>/kv_publisher`.
pub const KV_PUBLISHER_GROUP: &str = "flotilla.kv_publishers";

/// What a KV event subscriber accepts.
#[derive(RactorClusterMessage)]
pub enum KvEventsMsg {
    /// Events of one worker, in event-id order (cast).
    Publish(Wire<Vec<KvEvent>>),
    /// One worker's snapshot, to the relay whose router asked for it
    /// ([`KvPublisherMsg::SnapshotFor`]; cast).
    Snapshot(Wire<KvSnapshot>),
}

/// Messages of the [`KvEventPublisher`].
#[derive(RactorClusterMessage)]
pub enum KvPublisherMsg {
    /// Local: events drained from the pool after a step (cast).
    Events(Wire<Vec<KvEvent>>),
    /// Local: the token ids of the `Stored` events about to be sent, by event id (cast just
    /// before [`KvPublisherMsg::Events`]; only when the vLLM-format socket is on).
    EventTokens(Wire<Vec<(EventId, Vec<u32>)>>),
    /// Every registered block (call; tools and tests).
    #[rpc]
    Snapshot(RpcReplyPort<Wire<KvSnapshot>>),
    /// Every registered block, cast back as [`KvEventsMsg::Snapshot`] to the member of
    /// [`KV_EVENTS_GROUP`] registered under this name — the asking router's relay (a cast both
    /// ways: a router resyncing waits on nothing; an answer to one that has gone is dropped).
    SnapshotFor(Wire<String>),
}

/// The KV event publisher actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct KvEventPublisher;

/// Where a replica publishes vLLM-format KV events.
#[derive(Clone, Debug)]
pub struct VllmEventsConfig {
    /// Address to bind (port 0: any; the first bind's port is kept across restarts).
    pub addr: SocketAddr,
    /// Tokens per block.
    pub block_size: u32,
    /// The bound address, shared with whoever reports it (the worker's HTTP face).
    pub bound: Arc<Mutex<Option<SocketAddr>>>,
    /// How events are laid out (`worker.kv_events_layout`).
    pub layout: crate::kv::vllm::EventLayout,
}

/// [`KvEventPublisher`]'s arguments.
#[derive(Clone)]
pub struct KvPublisherArgs {
    /// The replica.
    pub worker: WorkerId,
    /// The node's faults (`drop_kv_events`).
    pub faults: KvEventFaults,
    /// The vLLM-format socket, if any.
    pub vllm: Option<VllmEventsConfig>,
}

/// The vLLM-format side of a publisher.
struct VllmSide {
    socket: ZmqPublisher,
    block_size: u32,
    layout: crate::kv::vllm::EventLayout,
    /// Tokens of the next `Stored` events, by event id.
    pending: HashMap<EventId, Vec<u32>>,
    /// Tokens of every registered block (for re-announcements, which come without).
    blocks: HashMap<SequenceHash, Vec<u32>>,
    /// After a clear: the blocks before it, until the re-announcements that follow it in the
    /// same batch have been published.
    cleared: HashMap<SequenceHash, Vec<u32>>,
}

impl VllmSide {
    /// Publish `events` (already filtered) as one batch.
    fn publish(&mut self, events: &[KvEvent]) {
        let bs = self.block_size as usize;
        let mut out = Vec::with_capacity(events.len());
        for ev in events {
            let tokens = match &ev.data {
                KvEventData::Stored { blocks, .. } => {
                    let tokens = self.pending.remove(&ev.event_id).or_else(|| {
                        blocks
                            .iter()
                            .map(|b| {
                                self.blocks
                                    .get(&b.seq_hash)
                                    .or_else(|| self.cleared.get(&b.seq_hash))
                                    .cloned()
                            })
                            .collect::<Option<Vec<_>>>()
                            .map(|v| v.concat())
                    });
                    if let Some(t) = &tokens {
                        for (b, chunk) in blocks.iter().zip(t.chunks(bs)) {
                            self.blocks.insert(b.seq_hash, chunk.to_vec());
                        }
                    }
                    tokens
                }
                KvEventData::Removed { blocks } => {
                    for h in blocks {
                        self.blocks.remove(h);
                    }
                    None
                }
                KvEventData::Cleared => {
                    // Pinned survivors are re-announced next: keep their tokens until then.
                    self.cleared = std::mem::take(&mut self.blocks);
                    None
                }
            };
            match from_flotilla(ev, tokens.as_deref(), self.block_size) {
                Some(v) => out.push(v),
                None => {
                    metrics::counter!("flotilla_kv_zmq_untranslatable_total").increment(1);
                }
            }
        }
        self.cleared.clear();
        self.pending.clear();
        if out.is_empty() {
            return;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        let batch = VllmBatch {
            ts,
            events: out,
            data_parallel_rank: Some(0),
        };
        self.socket.publish_as(&batch, self.layout);
    }
}

/// [`KvEventPublisher`] state.
pub struct KvPublisherState {
    worker: WorkerId,
    mirror: EventReplay,
    faults: KvEventFaults,
    vllm: Option<VllmSide>,
}

impl KvPublisherState {
    /// Every block the mirror holds, parents first, with the last event id applied.
    fn snapshot(&self) -> KvSnapshot {
        KvSnapshot {
            worker: self.worker.clone(),
            last_event: self.mirror.last_event(),
            blocks: parents_first(self.mirror.blocks().values().copied().collect()),
            lower: [Tier::Host, Tier::Disk]
                .into_iter()
                .map(|t| (t, parents_first(self.mirror.tier_blocks(t))))
                .filter(|(_, b)| !b.is_empty())
                .collect(),
        }
    }

    /// The events that reach the subscribers: all of them unless a `drop_kv_events` fault
    /// on this worker drops some.
    fn filter_dropped(&self, events: Vec<KvEvent>) -> Vec<KvEvent> {
        events
            .into_iter()
            .filter(|_| !self.faults.drop_event(&self.worker))
            .collect()
    }
}

impl Actor for KvEventPublisher {
    type Msg = KvPublisherMsg;
    type State = KvPublisherState;
    type Arguments = KvPublisherArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: KvPublisherArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let vllm = match args.vllm {
            None => None,
            Some(c) => {
                let previous = *c.bound.lock().unwrap_or_else(|p| p.into_inner());
                let addr = match previous {
                    Some(prev) if c.addr.port() == 0 => prev,
                    _ => c.addr,
                };
                let socket = ZmqPublisher::bind(addr, "").await?;
                *c.bound.lock().unwrap_or_else(|p| p.into_inner()) = Some(socket.addr());
                tracing::info!(worker = %args.worker, endpoint = %socket.endpoint(), "publishing vLLM-format KV events");
                Some(VllmSide {
                    socket,
                    block_size: c.block_size,
                    layout: c.layout,
                    pending: HashMap::new(),
                    blocks: HashMap::new(),
                    cleared: HashMap::new(),
                })
            }
        };
        ractor::pg::join(KV_PUBLISHER_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(KvPublisherState {
            worker: args.worker,
            mirror: EventReplay::new(),
            faults: args.faults,
            vllm,
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
                if let Some(v) = state.vllm.as_mut() {
                    v.publish(&events);
                }
                if events.is_empty() {
                    return Ok(());
                }
                let payload = Wire::encode(&events);
                for cell in ractor::pg::get_members(&KV_EVENTS_GROUP.to_owned()) {
                    let sub: ActorRef<KvEventsMsg> = cell.into();
                    let _ = sub.cast(KvEventsMsg::Publish(payload.clone()));
                }
            }
            KvPublisherMsg::EventTokens(wire) => {
                if let (Some(v), Ok(tokens)) = (state.vllm.as_mut(), wire.decode()) {
                    v.pending.extend(tokens);
                }
            }
            KvPublisherMsg::Snapshot(reply) => {
                let _ = reply.send(Wire::encode(&state.snapshot()));
            }
            KvPublisherMsg::SnapshotFor(wire) => {
                let Ok(relay) = wire.decode() else {
                    return Ok(());
                };
                if let Some(cell) = crate::runtime::cluster::member_named(KV_EVENTS_GROUP, &relay) {
                    let relay: ActorRef<KvEventsMsg> = cell.into();
                    let _ = relay.cast(KvEventsMsg::Snapshot(Wire::encode(&state.snapshot())));
                }
            }
        }
        Ok(())
    }
}
