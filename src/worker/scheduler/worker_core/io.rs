//! What goes into a [`WorkerCore`](super::WorkerCore) and what comes out: its configuration,
//! the chaos faults aimed at it, the effects it asks its driver to carry out, and its errors.

use std::time::Duration;

use crate::kv::KvEvent;
use crate::runtime::clock::Instant;
use crate::runtime::ids::{NodeId, RequestId, SeqId, WorkerId};
use crate::runtime::role::Role;
use crate::worker::WorkerError;
use crate::worker::engine::StepBatch;
use crate::worker::scheduler::{DisaggWorker, Hang, PeerPullWorker, SchedulerError, SimTransfer};

use super::PullJob;

/// A request's key at a worker: its gateway node and its (attempt's) request id.
pub type RequestKey = (NodeId, RequestId);

/// What a [`WorkerCore`] is built from (the rest of the scheduler's arguments are the
/// actor's: names, the transport, the node's board and bus).
#[derive(Clone, Debug)]
pub struct WorkerCoreConfig {
    /// This replica.
    pub worker: WorkerId,
    /// End-of-sequence token (a request may ask to ignore it).
    pub eos_token_id: Option<u32>,
    /// Tokens per KV block (the modelled transfer time of a pull).
    pub block_size: usize,
    /// The replica's role at start.
    pub role: Role,
    /// Disaggregation: how long a hand-off is held, the pull's time limit.
    pub disagg: DisaggWorker,
    /// A step longer than this (engine time) is a hang.
    pub step_timeout: Duration,
    /// An idle engine is pinged this often.
    pub canary_interval: Duration,
    /// How long an owner may be missing before its sequences are aborted.
    pub owner_grace: Duration,
    /// Pulls go through the node's transport (when the hand-off names a region).
    pub has_transport: bool,
    /// On a simulated engine: the modelled transfer time of a pull.
    pub sim_transfer: Option<SimTransfer>,
    /// Peer pulls (G4): `None` turns them off here (fetch hints are ignored).
    pub peer_pull: Option<PeerPullWorker>,
}

/// The chaos faults aimed at this replica, as the actor reads them before each input.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct InjectedFaults {
    /// `slow`: the engine sleeps this long before each step (not engine time).
    pub step_delay: Duration,
    /// `hang`: the engine does not answer.
    pub hang: bool,
    /// `fill_kv`: the fraction of the pool to hold.
    pub fill_kv: Option<f64>,
}

/// What the core asks its driver to do, in order.
#[derive(Clone, Debug)]
pub enum WorkerEffect {
    /// Run this step on the engine; answer with [`WorkerCore::step_done`].
    Step { step: u64, batch: StepBatch },
    /// Pull remote KV; answer with [`WorkerCore::pull_done`].
    Pull(PullJob),
    /// Peer pull: ask `holder` to pin the leading blocks of `tokens` it holds in G1 for this
    /// request ([`WorkerCore::export`] there), within `timeout`; answer with
    /// [`WorkerCore::fetch_done`].
    Fetch {
        holder: WorkerId,
        key: RequestKey,
        tokens: Vec<u32>,
        timeout: Duration,
    },
    /// Copies between KV tiers (`kv/tiers.rs`: offloads, demotions, onboards), in issue
    /// order; answer each with [`WorkerCore::copies_done`].
    TierCopies(Vec<crate::kv::TierCopy>),
    /// The sequence is gone: the engine may free what it keeps for it.
    Release(SeqId),
    /// A pull of the prefill worker's KV returned: tell that worker to release its blocks.
    ConfirmPull { prefill: WorkerId, key: RequestKey },
    /// KV events of the pool (and the token ids of stored blocks, when the pool keeps them),
    /// for the replica's KV event publisher.
    KvEvents {
        events: Vec<KvEvent>,
        tokens: Vec<(crate::runtime::ids::EventId, Vec<u32>)>,
    },
    /// Join this process group.
    Join(&'static str),
    /// Leave this process group.
    Leave(&'static str),
    /// The role changed (for the fleet's event bus).
    RoleChanged(Role),
    /// Ping the engine; answer with [`WorkerCore::canary_done`].
    Ping,
    /// Call [`WorkerCore::kick_due`] at this instant (the end of a gather window).
    KickAt(Instant),
}

/// The engine missed a deadline: the replica must restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} did not return within the step timeout ({timeout_ms} ms): engine hung")]
pub struct EngineHung {
    pub what: Hang,
    pub timeout_ms: u64,
}

/// Errors of the core's inputs: the batch former's (a broken invariant) or a hung engine.
#[derive(Debug, thiserror::Error)]
pub enum WorkerCoreError {
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error(transparent)]
    Hung(#[from] EngineHung),
    /// The engine of this replica is gone (its actor died): the replica must restart.
    #[error(transparent)]
    EngineGone(#[from] WorkerError),
}
