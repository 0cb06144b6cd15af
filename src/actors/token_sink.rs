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
use crate::request_plane::protocol::{TOKEN_SINK_GROUP, TokenSinkMsg};
use crate::request_plane::token_sink::SinkRegistry;
use ractor::{Actor, ActorProcessingErr, ActorRef};

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
