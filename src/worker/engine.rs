//! The engine boundary of a replica: the [`StepEngine`] trait that the actor
//! [`EngineWorker`](crate::actors::engine_worker::EngineWorker) drives (it owns a replica's
//! engine and runs batched steps for its scheduler), and the engines behind it.
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
//! The engine worker processes one message at a time, so steps never overlap. A replica's tree
//! spawns `EngineWorker<ChaosEngine<TransformerEngine>>` (or the sim engine in place of the
//! transformer); tests spawn an engine without the filter.

mod chaos;
mod error;
pub mod gpu;
pub mod sim;
mod transformer;
mod types;

use std::future::Future;

pub use chaos::{ChaosArgs, ChaosEngine};
pub use error::{EngineError, ErrorKind};
pub use transformer::{Engine, EngineConfig, TransformerArgs, TransformerEngine};
pub use types::{
    EngineInfo, PromptScores, SampledToken, SamplingParams, StepBatch, StepOutput, StepSeq,
};

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
