//! TokenSink: where a node receives the tokens its requests produce, wherever they run.
//!
//! One per node that submits requests (gateway role), in the process group
//! [`TOKEN_SINK_GROUP`] under the name `<node>/token_sink`. A scheduler sends each step's
//! events for one node as **one** cluster message ([`TokenSinkMsg::Deliver`]), not one per token;
//! the sink hands each event to the local receiver registered for its request
//! ([`SinkRegistry`]). Events for unknown requests (finished, cancelled) are dropped.
//!
//! # Owners and incarnations
//! A sequence on a worker is owned by the gateway node that submitted it, in one
//! **incarnation** (the node's start, ms since the Unix epoch): an [`Owner`]. The sink is
//! registered as `<node>/token_sink@<incarnation in hex>`, every delivery names the
//! incarnation it is for, and a sink drops deliveries for another one. So when a gateway node
//! restarts, the events of its old requests (orphans still running on workers) can never
//! reach the new incarnation's requests; and a worker that finds its owner's sink gone
//! ([`owner_status`]: replaced by a newer incarnation at once, or missing for the liveness
//! timeout) aborts the owner's sequences and frees their KV blocks.

use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::wire::Wire;
use crate::worker::scheduler::FinishReason;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Process group of every TokenSink.
pub const TOKEN_SINK_GROUP: &str = "flotilla.token_sinks";

/// Who submitted a sequence: a gateway node in one incarnation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Owner {
    /// The submitting node.
    pub node: NodeId,
    /// Its incarnation (start time, ms since the Unix epoch).
    pub incarnation: u64,
}

impl Owner {
    /// `node` in `incarnation`.
    pub fn new(node: NodeId, incarnation: u64) -> Self {
        Self { node, incarnation }
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{:x}", self.node, self.incarnation)
    }
}

/// Registered name of `owner`'s sink: `<node>/token_sink@<incarnation in hex>`.
pub fn sink_name(owner: &Owner) -> String {
    format!("{}/token_sink@{:x}", owner.node, owner.incarnation)
}

/// Whether an owner's sink can be reached from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerStatus {
    /// Its sink is in the group.
    Present,
    /// A sink of the same node in another incarnation is: the owner restarted.
    Replaced,
    /// No sink of that node is (restarting, partitioned or dead).
    Missing,
}

/// The status of `owner` among the members of [`TOKEN_SINK_GROUP`] (one group read).
pub fn owner_status(owner: &Owner) -> OwnerStatus {
    let exact = sink_name(owner);
    let same_node = format!("{}/token_sink@", owner.node);
    let mut status = OwnerStatus::Missing;
    for cell in ractor::pg::get_members(&TOKEN_SINK_GROUP.to_owned()) {
        match cell.get_name() {
            Some(n) if n == exact => return OwnerStatus::Present,
            Some(n) if n.starts_with(&same_node) => status = OwnerStatus::Replaced,
            _ => {}
        }
    }
    status
}

/// Why a finished sequence stopped, on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// End of sequence or a stop token (the token is not text to show).
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The context window is full.
    ContextLimit,
}

impl From<FinishReason> for Finish {
    fn from(r: FinishReason) -> Self {
        match r {
            FinishReason::Stop(_) => Finish::Stop,
            FinishReason::Length => Finish::Length,
            FinishReason::ContextLimit => Finish::ContextLimit,
        }
    }
}

/// What happened to a request on its worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum TokenEventKind {
    /// Admitted: the prompt's leading `cached_tokens` came from the prefix cache.
    Admitted {
        /// Worker serving it.
        worker: WorkerId,
        /// Prompt tokens reused from the prefix cache.
        cached_tokens: u32,
    },
    /// One generated token; `finish` is set on the last one. A `Stop` finish token is the EOS
    /// or stop token itself.
    Token {
        /// Token id.
        id: u32,
        /// Natural-log probability under the unmodified distribution.
        logprob: f32,
        /// Set on the request's last token.
        finish: Option<Finish>,
        /// Position of this token among those the worker generated for this submission
        /// (0, 1, 2, …): a gap means events were lost on the way.
        #[serde(default)]
        index: u32,
    },
    /// The worker will not continue this request (its replica is stopping or draining); what
    /// was generated so far is valid and the request may resume elsewhere (migration). The
    /// gateway's Request actor consumes it; a handler treats it as a 503 failure.
    Lost {
        /// Why, for logs.
        reason: String,
    },
    /// The request cannot be served (it will receive nothing more).
    Failed {
        /// Client-safe description.
        message: String,
        /// HTTP status that fits when no byte has reached the client yet: 400 (the request
        /// can never be served), 503 (try again), 500 (a fault).
        status: u16,
    },
}

/// An event for one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    /// The request (unique per submitting node).
    pub request: RequestId,
    /// What happened.
    pub kind: TokenEventKind,
}

/// A batch of events for one owner, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Delivery {
    /// The owner's incarnation these events are for; a sink of another drops them.
    pub incarnation: u64,
    /// The events.
    pub events: Vec<TokenEvent>,
}

/// Messages of the TokenSink (serializable: schedulers on any node send to it).
#[derive(RactorClusterMessage)]
pub enum TokenSinkMsg {
    /// A batch of events, in order. Droppable only if the node is going away.
    Deliver(Wire<Delivery>),
}

/// Receivers of this node's in-flight requests, shared by the sink and whoever submits.
#[derive(Clone, Default)]
pub struct SinkRegistry {
    inner: Arc<Mutex<HashMap<RequestId, mpsc::UnboundedSender<TokenEventKind>>>>,
}

impl SinkRegistry {
    /// Register the receiver of `request`'s events; returns the receiving end.
    pub fn register(&self, request: RequestId) -> mpsc::UnboundedReceiver<TokenEventKind> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock().insert(request, tx);
        rx
    }

    /// Forget `request` (its receiver is dropped).
    pub fn unregister(&self, request: RequestId) {
        self.lock().remove(&request);
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no request is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<RequestId, mpsc::UnboundedSender<TokenEventKind>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn deliver(&self, events: Vec<TokenEvent>) {
        let mut map = self.lock();
        for ev in events {
            if let Some(tx) = map.get(&ev.request)
                && tx.send(ev.kind).is_err()
            {
                // The receiver is gone (client left): forget it.
                map.remove(&ev.request);
            }
        }
    }
}

/// The TokenSink actor; its arguments are the registry it delivers into and this node's
/// incarnation (deliveries for another are dropped).
#[derive(Debug, Default, Clone, Copy)]
pub struct TokenSink;

impl Actor for TokenSink {
    type Msg = TokenSinkMsg;
    type State = (SinkRegistry, u64);
    type Arguments = (SinkRegistry, u64);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: (SinkRegistry, u64),
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(TOKEN_SINK_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        (registry, incarnation): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TokenSinkMsg::Deliver(wire) => match wire.decode() {
                Ok(d) if d.incarnation == *incarnation => registry.deliver(d.events),
                Ok(d) => {
                    metrics::counter!("flotilla_token_events_dropped_total", "reason" => "other_incarnation")
                        .increment(d.events.len() as u64);
                }
                Err(_) => {}
            },
        }
        Ok(())
    }
}

/// The sink of `owner`, wherever it runs (local or a peer's proxy).
pub fn find_sink(owner: &Owner) -> Option<ActorRef<TokenSinkMsg>> {
    crate::runtime::cluster::member_named(TOKEN_SINK_GROUP, &sink_name(owner)).map(Into::into)
}
