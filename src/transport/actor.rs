//! The node's Transport actor: the supervised face of the node's [`Transport`].
//!
//! A permanent child of every worker node's tree (registered as `<node>/transport`). Its
//! state is only a handle: the backends, the registered regions and the pulls in flight live in
//! the node's [`Transport`], created before the tree (the engines allocate their KV through it),
//! so a restart of this actor loses no registration and cuts no transfer short. Each
//! [`TransportMsg::Pull`] runs as its own task and replies when every byte has landed or the
//! pull failed: many pulls are in flight at once, and the actor's mailbox never waits on one.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::{PullRequest, PullStats, RegionDescriptor, Transport, TransportError};

/// Messages of the Transport actor (local: a pull names memory in this process).
#[derive(Debug)]
pub enum TransportMsg {
    /// Read blocks of a peer's region into a local one (call; replies when done).
    Pull(
        Box<PullRequest>,
        RpcReplyPort<Result<PullStats, TransportError>>,
    ),
    /// Pulls not finished (call).
    Pending(RpcReplyPort<usize>),
    /// The regions this node serves (call).
    Regions(RpcReplyPort<Vec<RegionDescriptor>>),
}

impl ractor::Message for TransportMsg {}

/// The Transport actor; its argument is the node's transport.
#[derive(Debug, Default, Clone, Copy)]
pub struct TransportActor;

impl Actor for TransportActor {
    type Msg = TransportMsg;
    type State = Arc<Transport>;
    type Arguments = Arc<Transport>;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        transport: Arc<Transport>,
    ) -> Result<Self::State, ActorProcessingErr> {
        tracing::debug!(backend = %transport.backend(), tcp = %transport.tcp_addr(), "transport actor up");
        Ok(transport)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        transport: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            TransportMsg::Pull(req, port) => {
                let t = transport.clone();
                // The task owns the pull to its end (see `Transport::pull` on dropping one).
                tokio::spawn(async move {
                    let out = t.pull(*req).await;
                    if port.send(out).is_err() {
                        tracing::debug!("transport: the puller went away before the reply");
                    }
                });
            }
            TransportMsg::Pending(port) => {
                let _ = port.send(transport.pending());
            }
            TransportMsg::Regions(port) => {
                let _ = port.send(transport.descriptors());
            }
        }
        Ok(())
    }
}

/// The Transport actor of this process's node `node`, if it runs.
pub fn local(node: &str) -> Option<ActorRef<TransportMsg>> {
    ractor::registry::where_is(format!("{node}/transport")).map(Into::into)
}
