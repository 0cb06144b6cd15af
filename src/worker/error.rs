//! [`WorkerError`]: why a replica's step produced no tokens.

use serde::{Deserialize, Serialize};

use crate::worker::engine::EngineError;

/// The outcome of a step that failed, as the scheduler receives it (serialisable: it travels
/// back to the scheduler in a message).
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum WorkerError {
    /// The engine answered with an error; no KV slot was written. The step's sequences fail
    /// and the replica goes on.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The engine worker did not answer (its actor stopped or crashed): the replica restarts
    /// and its sequences migrate.
    #[error("engine unavailable: {0}")]
    EngineGone(String),
}

impl WorkerError {
    /// Whether the replica cannot go on and must be restarted by its supervisor.
    pub fn takes_replica_down(&self) -> bool {
        matches!(self, WorkerError::EngineGone(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_gone_engine_takes_the_replica_down() {
        assert!(WorkerError::EngineGone("actor stopped".into()).takes_replica_down());
        assert!(!WorkerError::Engine(EngineError::Injected).takes_replica_down());
        assert!(!WorkerError::from(EngineError::Unavailable("no".into())).takes_replica_down());
    }

    #[test]
    fn engine_errors_keep_their_message_and_survive_the_wire() {
        let e = WorkerError::Engine(EngineError::Injected);
        assert_eq!(e.to_string(), "injected engine failure (chaos)");
        let w = crate::runtime::wire::Wire::encode(&e);
        assert_eq!(w.decode().expect("decode"), e);
        assert_eq!(
            WorkerError::EngineGone("x".into()).to_string(),
            "engine unavailable: x"
        );
    }
}
