//! TokenSink: where a node receives the tokens its requests produce, wherever they run.
//!
//! One per node that submits requests (gateway role), in the process group
//! [`TOKEN_SINK_GROUP`] under the name `<node>/token_sink`. A scheduler sends each step's
//! events for one node as **one** cluster message ([`TokenSinkMsg::Deliver`]), not one per token;
//! the sink hands each event to the local receiver registered for its request
//! ([`SinkRegistry`]). Events for unknown requests (finished, cancelled) are dropped.

use crate::actors::scheduler::FinishReason;
use crate::ids::{NodeId, RequestId, WorkerId};
use crate::wire::Wire;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Process group of every TokenSink.
pub const TOKEN_SINK_GROUP: &str = "flotilla.token_sinks";

/// Registered name of `node`'s sink.
pub fn sink_name(node: &NodeId) -> String {
    format!("{node}/token_sink")
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

/// Messages of the TokenSink (serializable: schedulers on any node send to it).
#[derive(RactorClusterMessage)]
pub enum TokenSinkMsg {
    /// A batch of events, in order. Droppable only if the node is going away.
    Deliver(Wire<Vec<TokenEvent>>),
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

/// The TokenSink actor; its argument is the registry it delivers into.
#[derive(Debug, Default, Clone, Copy)]
pub struct TokenSink;

impl Actor for TokenSink {
    type Msg = TokenSinkMsg;
    type State = SinkRegistry;
    type Arguments = SinkRegistry;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        registry: SinkRegistry,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(TOKEN_SINK_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(registry)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        registry: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TokenSinkMsg::Deliver(wire) => {
                if let Ok(events) = wire.decode() {
                    registry.deliver(events);
                }
            }
        }
        Ok(())
    }
}

/// The sink of `node`, wherever it runs (local or a peer's proxy).
pub fn find_sink(node: &NodeId) -> Option<ActorRef<TokenSinkMsg>> {
    crate::cluster::member_named(TOKEN_SINK_GROUP, &sink_name(node)).map(Into::into)
}
