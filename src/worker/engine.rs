//! `EngineWorker`: the actor that owns one device's engine (an `Arc` of the shared weights plus
//! its KV pools) and runs batched steps for the scheduler.
//!
//! Each step runs on tokio's blocking pool (`spawn_blocking`), so a long forward pass does not
//! stall the async runtime; the actor processes one message at a time, so steps never overlap.

pub mod sim;
mod transformer;
mod types;

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

pub use transformer::{Engine, EngineConfig, EngineError, ErrorKind};
pub use types::{EngineInfo, SampledToken, SamplingParams, StepBatch, StepOutput, StepSeq};

use crate::control::chaos::FaultBook;
use crate::model::weights::ModelWeights;
use crate::runtime::ids::{SeqId, WorkerId};

/// The actor (no configuration; everything is in [`EngineWorkerArgs`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct EngineWorker;

/// Spawn inputs.
#[derive(Debug, Clone)]
pub struct EngineWorkerArgs {
    /// Weights shared by every replica of the process.
    pub weights: Arc<ModelWeights>,
    pub config: EngineConfig,
    /// Chaos: the node's fault book and this engine's worker id (`hang` faults stop it).
    pub faults: Option<(FaultBook, WorkerId)>,
}

/// Actor state: the engine, absent only while a step runs on the blocking pool.
#[derive(Debug)]
pub struct EngineWorkerState {
    engine: Option<Engine>,
    faults: Option<(FaultBook, WorkerId)>,
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

impl EngineWorkerState {
    /// Runs `f` on the engine in the blocking pool and puts the engine back.
    async fn with_engine<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut Engine) -> T + Send + 'static,
    ) -> Result<T, ActorProcessingErr> {
        let mut engine = self
            .engine
            .take()
            .ok_or_else(|| ActorProcessingErr::from("engine lost by an earlier failed step"))?;
        let (engine, out) = tokio::task::spawn_blocking(move || {
            let out = f(&mut engine);
            (engine, out)
        })
        .await
        .map_err(|e| ActorProcessingErr::from(format!("engine step panicked: {e}")))?;
        self.engine = Some(engine);
        Ok(out)
    }
}

impl Actor for EngineWorker {
    type Msg = EngineWorkerMsg;
    type State = EngineWorkerState;
    type Arguments = EngineWorkerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: EngineWorkerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let engine = Engine::new(args.weights, args.config)?;
        Ok(EngineWorkerState {
            engine: Some(engine),
            faults: args.faults,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if matches!(msg, EngineWorkerMsg::Step(..) | EngineWorkerMsg::Ping(..))
            && let Some((faults, worker)) = &state.faults
        {
            // An injected hang: this actor stops answering, as a wedged device would.
            while faults.hangs(worker) {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
        match msg {
            EngineWorkerMsg::Ping(port) => reply(port, ()),
            EngineWorkerMsg::Step(batch, port) => {
                let out = state.with_engine(move |e| e.step(&batch)).await?;
                reply(port, out);
            }
            EngineWorkerMsg::Logits(batch, port) => {
                let out = state.with_engine(move |e| e.logits(&batch)).await?;
                reply(port, out);
            }
            EngineWorkerMsg::Release(seq) => {
                if let Some(e) = state.engine.as_mut() {
                    e.release(seq);
                }
            }
            EngineWorkerMsg::Info(port) => {
                if let Some(e) = state.engine.as_ref() {
                    reply(port, e.info());
                }
            }
        }
        Ok(())
    }
}
