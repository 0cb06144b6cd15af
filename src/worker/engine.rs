//! The engine boundary of a replica: the [`StepEngine`] trait and [`EngineWorker`], the one
//! actor that owns a replica's engine and runs batched steps for its scheduler.
//!
//! Files:
//! - `transformer.rs` — the real engine: [`Engine`] (synchronous forward pass + sampling) and
//!   [`TransformerEngine`], the same as a [`StepEngine`] that runs steps on tokio's blocking
//!   pool.
//! - `sim.rs` — [`SimEngine`](sim::SimEngine): a timing model in place of the forward pass.
//! - `chaos.rs` — [`ChaosEngine`]: a filter around any engine that applies the node's
//!   engine faults (`slow`, `hang`, `fail_engine`).
//! - `types.rs` — the step's request and response types; `error.rs` — [`EngineError`].
//!
//! The actor processes one message at a time, so steps never overlap. A replica's tree spawns
//! `EngineWorker<ChaosEngine<TransformerEngine>>` (or the sim engine in place of the
//! transformer); tests spawn an engine without the filter.

mod chaos;
mod error;
pub mod sim;
mod transformer;
mod types;

use std::future::Future;
use std::marker::PhantomData;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

pub use chaos::{ChaosArgs, ChaosEngine};
pub use error::{EngineError, ErrorKind};
pub use transformer::{Engine, EngineConfig, TransformerArgs, TransformerEngine};
pub use types::{EngineInfo, SampledToken, SamplingParams, StepBatch, StepOutput, StepSeq};

use crate::runtime::ids::SeqId;

/// What every engine does for its worker: run a batched step, report its geometry, forget a
/// finished sequence, answer a canary.
pub trait StepEngine: Send + Sized + 'static {
    /// What [`StepEngine::start`] needs: the engine worker's spawn argument.
    type Config: Send + 'static;

    /// Builds the engine (allocates its KV memory) when its worker starts.
    ///
    /// # Errors
    /// [`EngineError::Config`] when the configuration cannot make an engine.
    fn start(config: Self::Config) -> impl Future<Output = Result<Self, EngineError>> + Send;

    /// Static facts: block geometry, vocabulary, KV bytes.
    fn info(&self) -> EngineInfo;

    /// Runs one batched step and samples one token for every sequence with `sample = true`.
    ///
    /// # Errors
    /// [`EngineError::InvalidBatch`] for a malformed batch (no KV slot was written);
    /// [`EngineError::Injected`] for a chaos failure; [`EngineError::Crashed`] when the engine
    /// cannot go on (its worker then stops).
    fn step(
        &mut self,
        batch: StepBatch,
    ) -> impl Future<Output = Result<StepOutput, EngineError>> + Send;

    /// Runs a batch and returns every sequence's last-position logits, in batch order.
    ///
    /// # Errors
    /// As [`StepEngine::step`]; [`EngineError::Unavailable`] for an engine that computes no
    /// logits.
    fn logits(
        &mut self,
        batch: StepBatch,
    ) -> impl Future<Output = Result<Vec<Vec<f32>>, EngineError>> + Send;

    /// Drops a finished sequence's per-sequence state (unknown ids are ignored).
    fn release(&mut self, seq: SeqId);

    /// Resolves when the engine can answer: at once unless it is wedged.
    fn ping(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

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
