//! The engine worker: the one actor that owns a replica's engine (any
//! [`StepEngine`]) and runs batched steps for its scheduler, one message at a time, so steps
//! never overlap.

use std::marker::PhantomData;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::runtime::ids::SeqId;
use crate::worker::engine::{EngineError, EngineInfo, StepBatch, StepEngine, StepOutput};

/// The engine worker actor over any [`StepEngine`]; its spawn argument is the engine's
/// [`StepEngine::Config`].
pub struct EngineWorker<E>(PhantomData<fn() -> E>);

impl<E> EngineWorker<E> {
    /// The actor value to spawn.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<E> Default for EngineWorker<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> Clone for EngineWorker<E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for EngineWorker<E> {}

impl<E> std::fmt::Debug for EngineWorker<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EngineWorker<{}>", std::any::type_name::<E>())
    }
}

/// Messages of the engine worker.
#[derive(Debug)]
pub enum EngineWorkerMsg {
    /// Run one batched step and sample (call; replies with the sampled tokens or a typed error
    /// for a malformed batch, in which case no KV slot was written).
    Step(StepBatch, RpcReplyPort<Result<StepOutput, EngineError>>),
    /// Run a batch and return every sequence's last-position logits (call; tests and tools).
    Logits(StepBatch, RpcReplyPort<Result<Vec<Vec<f32>>, EngineError>>),
    /// Drop a finished sequence's sampler state (cast; may be sent for unknown ids).
    Release(SeqId),
    /// Static facts: block geometry, vocabulary, KV bytes (call).
    Info(RpcReplyPort<EngineInfo>),
    /// Canary: answers at once unless the engine is hung (call).
    Ping(RpcReplyPort<()>),
}

impl ractor::Message for EngineWorkerMsg {}

fn reply<T>(port: RpcReplyPort<T>, value: T) {
    if port.send(value).is_err() {
        tracing::debug!("engine worker: caller went away before the reply");
    }
}

/// Replies with `out`, unless the engine crashed: then the worker fails without answering
/// (the caller sees the worker gone) and its supervisor restarts the replica.
fn answer<T>(
    port: RpcReplyPort<Result<T, EngineError>>,
    out: Result<T, EngineError>,
) -> Result<(), ActorProcessingErr> {
    match out {
        Err(e @ EngineError::Crashed(_)) => Err(e.into()),
        out => {
            reply(port, out);
            Ok(())
        }
    }
}

impl<E: StepEngine> Actor for EngineWorker<E> {
    type Msg = EngineWorkerMsg;
    type State = E;
    type Arguments = E::Config;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        config: E::Config,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(E::start(config).await?)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        engine: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EngineWorkerMsg::Ping(port) => {
                engine.ping().await;
                reply(port, ());
            }
            EngineWorkerMsg::Step(batch, port) => answer(port, engine.step(batch).await)?,
            EngineWorkerMsg::Logits(batch, port) => answer(port, engine.logits(batch).await)?,
            EngineWorkerMsg::Release(seq) => engine.release(seq),
            EngineWorkerMsg::Info(port) => reply(port, engine.info()),
        }
        Ok(())
    }
}
