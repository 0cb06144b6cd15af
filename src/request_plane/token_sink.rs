//! TokenSink: where a node receives the tokens its requests produce, wherever they run.
//!
//! One per node that submits requests (gateway role), in the process group
//! [`TOKEN_SINK_GROUP`] under the name [`sink_name`] of its [`Owner`]. A scheduler sends each
//! step's events for one node as **one** cluster message ([`TokenSinkMsg::Deliver`]), not one
//! per token; the sink hands each event to the local receiver registered for its request
//! ([`SinkRegistry`]). Events for unknown requests (finished, cancelled) and deliveries for
//! another incarnation of the node are dropped. The messages, and how workers address a sink,
//! are in [`crate::request_plane::protocol`].

#[cfg(doc)]
use crate::request_plane::protocol::{Owner, sink_name};
use crate::request_plane::protocol::{TOKEN_SINK_GROUP, TokenEvent, TokenEventKind, TokenSinkMsg};
use crate::runtime::ids::RequestId;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

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
