//! The registry of a node's in-flight requests: where the node's
//! [`TokenSink`](crate::actors::token_sink::TokenSink) actor hands each token event, keyed by
//! request id ([`SinkRegistry`]). Events for unknown requests (finished, cancelled) are
//! dropped.

use crate::request_plane::protocol::{TokenEvent, TokenEventKind};
use crate::runtime::ids::RequestId;
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

    /// Hand each event to its request's receiver; forget receivers that are gone.
    pub fn deliver(&self, events: Vec<TokenEvent>) {
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
