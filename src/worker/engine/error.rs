//! [`EngineError`]: what an engine answers instead of a step's output.

use serde::{Deserialize, Serialize};

use crate::model::forward::ForwardError;

/// Errors of an engine (serialisable: a step's outcome travels back to the scheduler as a
/// message).
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum EngineError {
    /// The engine cannot be built from this configuration.
    #[error("invalid engine config: {0}")]
    Config(String),
    /// The batch is malformed; no KV slot was written.
    #[error("invalid batch: {0}")]
    InvalidBatch(#[from] ForwardError),
    /// The engine cannot serve this request (e.g. logits from the simulated engine).
    #[error("engine worker unavailable: {0}")]
    Unavailable(String),
    /// A `fail_engine` chaos fault failed the step; the engine did not run it.
    #[error("injected engine failure (chaos)")]
    Injected,
    /// The engine cannot go on (a step panicked and took the engine's state with it). The
    /// engine worker stops instead of answering, so that its supervisor restarts the replica.
    #[error("engine crashed: {0}")]
    Crashed(String),
}

impl EngineError {
    /// Coarse class for metrics, retries and HTTP status: a bad batch or config is the
    /// caller's fault (`InvalidRequest`), an unavailable worker may be retried elsewhere.
    pub fn kind(&self) -> ErrorKind {
        match self {
            EngineError::Config(_) | EngineError::InvalidBatch(_) => ErrorKind::InvalidRequest,
            EngineError::Unavailable(_) | EngineError::Injected | EngineError::Crashed(_) => {
                ErrorKind::Unavailable
            }
        }
    }
}

/// See [`EngineError::kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidRequest,
    Unavailable,
}
