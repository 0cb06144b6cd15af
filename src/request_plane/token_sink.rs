//! The registry of a node's in-flight requests: where the node's
//! [`TokenSink`](crate::actors::token_sink::TokenSink) actor hands each token event, keyed by
//! request id ([`SinkRegistry`]). Events for unknown requests (finished, cancelled) are
//! dropped.
//!
//! A request registers a [`Receiver`]: a function that takes one event and says whether its
//! request is still there. The Request actor's receiver casts the event straight into its
//! mailbox (no channel and no forwarding task between the sink and the actor); a channel's
//! sender is one too ([`SinkRegistry::register`]).

use crate::request_plane::protocol::{TokenEvent, TokenEventKind};
use crate::runtime::ids::RequestId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Takes one event of its request; false when the request is gone (then it is forgotten).
pub type Receiver = Box<dyn Fn(TokenEventKind) -> bool + Send + Sync>;

/// Receivers of this node's in-flight requests, shared by the sink and whoever submits.
#[derive(Clone, Default)]
pub struct SinkRegistry {
    inner: Arc<Mutex<HashMap<RequestId, Receiver>>>,
}

impl SinkRegistry {
    /// Register a channel as the receiver of `request`'s events; returns the receiving end.
    pub fn register(&self, request: RequestId) -> mpsc::UnboundedReceiver<TokenEventKind> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.register_with(request, Box::new(move |ev| tx.send(ev).is_ok()));
        rx
    }

    /// Register `receiver` for `request`'s events (replacing any earlier one).
    pub fn register_with(&self, request: RequestId, receiver: Receiver) {
        self.lock().insert(request, receiver);
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, Receiver>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hand each event to its request's receiver; forget receivers that are gone.
    pub fn deliver(&self, events: Vec<TokenEvent>) {
        let mut map = self.lock();
        for ev in events {
            if let Some(receive) = map.get(&ev.request)
                && !receive(ev.kind)
            {
                // The receiver is gone (client left): forget it.
                map.remove(&ev.request);
            }
        }
    }
}
