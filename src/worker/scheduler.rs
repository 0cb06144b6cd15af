//! Scheduler, pure: the per-replica batch former over the [`BlockPool`] and what it needs
//! beside it (step watchdog, outbox, step-time model).
//!
//! Files:
//! - `config.rs` — the `[scheduler]` and `[disagg]` sections ([`config::SchedulerSection`],
//!   [`config::DisaggConfig`]) and their checks.
//! - `batch.rs` — [`SchedulerCore`], its config, requests, batches, updates and errors.
//! - `watchdog.rs` — [`StepWatchdog`]: step and canary deadlines, whether the engine hung.
//! - `outbox.rs` — [`Outbox`]: token events queued per owner, when an owner is gone.
//! - `fill.rs` — [`KvFill`]: the blocks a chaos `fill_kv` fault holds, beside the core.
//! - `step_model.rs` — [`StepTimeModel`]: step time from the step's shape, fitted online.
//! - `worker_core.rs` — [`WorkerCore`]: the replica's whole scheduling state machine (one
//!   record per sequence, the pull and peer-pull sub-cores, the steps), driven by the actor.
//! - `tests.rs` — unit tests, preemption equivalence, seeded random workload.
//!
//! The actor that drives them is [`crate::actors::scheduler`]; this module also holds what the
//! actor shares with its callers: the process groups, [`SchedulerStats`] and [`Health`].
//!
//! # Policy
//! Continuous batching (Orca, Yu et al., OSDI 2022) over paged KV blocks (vLLM PagedAttention,
//! Kwon et al., SOSP 2023), with chunked prefill mixed into decode steps (Sarathi-Serve,
//! Agrawal et al., OSDI 2024; vLLM v1's unified token budget). Each [`SchedulerCore::schedule`]:
//! 1. gives every running decoding sequence one token, in admission order, first reserving
//!    the slot its sampled token will need; when the pool is out of blocks it **preempts the
//!    newest running sequence** (possibly the one being served), which frees its blocks and
//!    returns to the front of the waiting queue with prompt + generated tokens as its new
//!    prompt (vLLM's preemption by recompute; its registered blocks usually come back as a
//!    prefix-cache hit);
//! 2. continues partially prefilled sequences;
//! 3. admits waiting sequences — preempted ones first, then strictly FCFS within each priority
//!    class (no skipping; "first come" is since when the client has waited for the
//!    sequence's next token — its arrival at the gateway, or its last token before a
//!    migration — so a migrated request keeps its place and requests that migrate together
//!    take turns), the classes served by deficit round robin on uncached prompt
//!    tokens (`waiting.rs`, `request_plane/priority.rs`; one class when none is configured:
//!    plain FCFS) — while `max_num_seqs`, the token budget `max_num_batched_tokens` and the
//!    pool allow, chunking the last prefill to fit.
//!    Admission allocates blocks for the whole prompt + 1 at once (all-or-nothing), reusing the
//!    longest cached prefix. No admission happens in a step that preempted (as in vLLM v1),
//!    which avoids admit/preempt thrashing.
//!
//! **Stall-free batching** (Sarathi-Serve's time-bounded steps): when the step holds at least
//! one decode row, steps 2 and 3 also stop at `max_decode_stall_ms` of *predicted* step time
//! (`scheduler.max_decode_stall_ms`, default 200 ms, 0 = off): each chunk gets the most tokens
//! that keep `base + per_token·tokens + per_kpair·attention pairs/1000` within the limit
//! ([`StepTimeModel`], least squares over this replica's own measured steps), so a newcomer's
//! prompt is spread over several steps instead of holding every running stream for its
//! whole prefill. Prefill still progresses: a step always gets one KV block of prefill (or
//! what is left of the token budget), and a sequence is admitted only while a token of it
//! fits (or that block is not used yet). Steps without decode rows, and every step until the
//! model has seen enough step shapes, use the token budget alone.
//!
//! # Disaggregation (`request_plane/role.rs`)
//! - **Hand-off (prefill side).** A submission with `hand_off` runs as usual until its first
//!   token; unless that token ends it, the sequence then leaves the batch and its blocks stay
//!   pinned ([`SchedulerCore`]'s held sequences). The scheduler sends the token, then
//!   [`TokenEventKind::HandOff`](crate::request_plane::protocol::TokenEventKind::HandOff) with the blocks, this replica's KV region (from the node's
//!   transport) and the end of the hold (`disagg.hold_ms`). A `Cancel` of the request — the
//!   decode worker's confirmation, or the gateway's Request giving up — releases the blocks
//!   (they stay in the prefix cache); so does the end of the hold, checked on every tick.
//! - **Pull (decode side).** A submission with `remote_kv` (its prompt ends with the token the
//!   prefill worker sampled) is admitted like any other, reusing this pool's cached prefix; the
//!   blocks it still lacks up to the prefill worker's last prompt token are pulled (a
//!   [`PullOrder`]) through the node's transport actor (on a simulated engine: a sleep for the
//!   modelled transfer time, [`SimTransfer`]), by the earlier of `disagg.transfer_timeout_ms`
//!   and the hold's end less a margin. The sequence is not scheduled, preempted or freed
//!   while its pull runs (the pull writes its blocks; a cancelled one is freed when the pull
//!   returns). When it returns, the prompt's KV counts as computed and decoding starts — or,
//!   after any failure (peer dead or restarted, deadline, chaos), the sequence prefills
//!   what it lacks itself: a failed transfer costs time, never the request. Either way the
//!   prefill worker is told to release its blocks.
//!
//! # Step protocol
//! `schedule()` → engine runs the batch → `on_step_output(sampled)`; exactly one step is in
//! flight. Computed counts advance at scheduling time; the pool registers blocks (KV events)
//! only when the step's output arrives, i.e. after the KV is written. A sequence cancelled
//! while its step is in flight is freed at once; its sampled token is ignored (its blocks are
//! only reused by the next `schedule()`, after the step returned).
//!
//! # Stop conditions
//! Checked on each sampled token, in order: EOS, a stop token id, `max_tokens`, context limit
//! (`min(max_model_len, pool capacity)` total tokens). A finished sequence's blocks are freed
//! at once; its cached blocks stay reusable.

mod batch;
pub mod config;
mod fill;
mod outbox;
mod step_model;
mod waiting;
mod watchdog;
mod worker_core;

#[cfg(test)]
mod tests;

pub use batch::{
    FinishReason, HandedOff, PullOrder, ScheduledBatch, ScheduledSeq, SchedulerConfig,
    SchedulerCore, SchedulerError, SeqRequest, SeqUpdate,
};
pub use fill::{FILL_SEQ, FillChange, KvFill};
pub use outbox::Outbox;
pub use step_model::{StepCost, StepShape, StepTimeModel};
pub use watchdog::{Hang, StepWatchdog, WatchdogVerdict};
pub use worker_core::{
    ADMIT_RATE_WINDOW, EngineHung, InjectedFaults, PullJob, PullWork, RequestKey, WorkerCore,
    WorkerCoreConfig, WorkerCoreError, WorkerEffect,
};

#[doc(no_inline)]
pub use crate::kv::BlockPool;

pub use crate::kv::PeerPullCounters;
use crate::runtime::ids::{SeqId, WorkerId};
use crate::runtime::role::Role;
use crate::worker::WorkerError;
use crate::worker::engine::StepOutput;
use serde::{Deserialize, Serialize};

/// Process group of every Scheduler (one per replica), named `<worker id>/scheduler`: the
/// replicas that are alive. A Request watches its scheduler's membership here.
pub const SCHEDULER_GROUP: &str = "flotilla.schedulers";
/// The schedulers routers may choose: alive, healthy and not draining.
pub const ROUTABLE_GROUP: &str = "flotilla.schedulers.routable";

/// A replica's health as its scheduler sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Routable.
    #[default]
    Ready,
    /// Finishing its requests; routers no longer choose it.
    Draining,
    /// The step watchdog or the canary found the engine hung; the replica is restarting.
    Unhealthy,
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Health::Ready => "ready",
            Health::Draining => "draining",
            Health::Unhealthy => "unhealthy",
        })
    }
}

/// Load and memory of one replica.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SchedulerStats {
    /// Worker id.
    pub worker: WorkerId,
    /// Sequences waiting for admission.
    pub waiting: usize,
    /// Sequences admitted.
    pub running: usize,
    /// Prompt tokens not yet prefilled.
    pub queued_prefill_tokens: usize,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// KV blocks pinned by live sequences.
    pub kv_blocks_used: usize,
    /// Steps run since start.
    pub steps: u64,
    /// Ready, draining or unhealthy.
    #[serde(default)]
    pub health: Health,
    /// Aggregated, prefill or decode.
    #[serde(default)]
    pub role: Role,
    /// Disaggregated prefill: sequences handed off whose blocks are held for a pull.
    #[serde(default)]
    pub held: usize,
    /// Disaggregated decode: KV pulls in flight.
    #[serde(default)]
    pub pulls_pending: usize,
    /// KV blocks pulled from prefill workers since start.
    #[serde(default)]
    pub blocks_pulled: u64,
    /// Pulls that failed (the prompt was recomputed here) since start.
    #[serde(default)]
    pub pull_fallbacks: u64,
    /// Predicted wait of a request arriving now before its own prefill starts (ms): the
    /// larger of the queued prompt tokens through the fitted step-time model
    /// ([`StepCost::drain_ms`]: the compute queue) and how long the oldest request still
    /// waiting for admission has waited (its sojourn time: the memory queue too — a request
    /// that waits for KV blocks shows here, not in the compute queue; under first-come,
    /// first-served admission a newcomer waits about as long while the queue stands, the
    /// signal CoDel uses, Nichols & Jacobson 2012). `None` with no model and nobody waiting.
    #[serde(default)]
    pub prefill_wait_ms: Option<f64>,
    /// Prefill rate at full steps (prompt tokens/s): `max_num_batched_tokens` over the fitted
    /// model's time for such a step. `None` with no model.
    #[serde(default)]
    pub prefill_tokens_per_s: Option<f64>,
    /// The lower KV tiers (G2 host, G3 disk): blocks held, copies in flight, counters since
    /// start. `None` without lower tiers.
    #[serde(default)]
    pub kv_tiers: Option<crate::kv::TierUsage>,
    /// Peer pulls (G4), both sides, since start.
    #[serde(default)]
    pub peer_pulls: PeerPullCounters,
    /// Prompt tokens of the sequences admitted since start (a migrated or decode attempt's
    /// whole prompt, generated tokens included).
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Of those, the tokens found cached (any tier) or pulled at admission: the prefix-hit
    /// rate is `cached_tokens / prompt_tokens` (same basis, never above 1).
    #[serde(default)]
    pub cached_tokens: u64,
    /// Tokens it generated (sampled and sent) since start.
    #[serde(default)]
    pub generated_tokens: u64,
    /// Bytes of KV this replica pulled over the transport since start (disaggregated and peer
    /// pulls), as `flotilla_kv_transfer_bytes_total` counts them on its node.
    #[serde(default)]
    pub kv_transfer_bytes: u64,
}

impl SchedulerStats {
    /// A worker's view in the fleet view, from these stats (what Discovery does for each local
    /// worker, and what a driver without actors — the simulator — does to feed admission).
    pub fn apply_to(&self, w: &mut crate::control::discovery::membership::WorkerView) {
        use crate::control::discovery::membership::WorkerHealth;
        w.running = self.running;
        w.waiting = self.waiting;
        w.in_flight = self.running + self.waiting;
        w.kv_blocks_used = self.kv_blocks_used;
        w.kv_blocks_total = self.kv_blocks_total;
        w.health = match self.health {
            Health::Ready => WorkerHealth::Ready,
            Health::Draining => WorkerHealth::Draining,
            Health::Unhealthy => WorkerHealth::Unhealthy,
        };
        w.role = Some(self.role);
        w.kv_held = self.held;
        w.kv_pulls_pending = self.pulls_pending;
        w.kv_blocks_pulled = self.blocks_pulled;
        w.kv_pull_fallbacks = self.pull_fallbacks;
        w.kv_peer_pulls = self.peer_pulls;
        w.prefill_wait_ms = self.prefill_wait_ms.map(|ms| ms.round() as u64);
        w.prefill_tokens_per_s = self.prefill_tokens_per_s.map(|r| r.round().max(1.0) as u64);
        w.kv_tiers = self.kv_tiers;
        w.prompt_tokens = self.prompt_tokens;
        w.cached_tokens = self.cached_tokens;
        w.generated_tokens = self.generated_tokens;
        w.kv_transfer_bytes = self.kv_transfer_bytes;
    }
}

/// A replica's side of peer pulls: what a pull costs before any was measured, and how long the
/// holder may take to pin.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PeerPullWorker {
    /// Time to pull one block before a pull was measured here (ms); later, the measured
    /// pulls' moving average replaces it.
    pub prior_block_ms: f64,
    /// The ask to the holder (pin and answer): a fixed cost of every pull, and its limit.
    pub ask_timeout: std::time::Duration,
    /// Fixed cost of an ask and a pull, besides the blocks (ms).
    pub fixed_ms: f64,
}

impl PeerPullWorker {
    /// The holder's answer must come within this (`worker.pull_ask_timeout_ms` default).
    pub const DEFAULT_ASK_TIMEOUT_MS: u64 = 1_000;
}

/// The stats of a node's replicas as their schedulers last published them: each scheduler
/// writes its own entry after every message that can change it (a step, a submission, a
/// tick), so readers (Discovery's heartbeats, the fleet view, admission) never call a
/// scheduler and never wait behind a long step. Cloned cheaply; one per node.
#[derive(Clone, Debug, Default)]
pub struct StatsBoard {
    tx: std::sync::Arc<
        tokio::sync::watch::Sender<std::collections::HashMap<WorkerId, SchedulerStats>>,
    >,
}

impl StatsBoard {
    /// Publish `stats` as its worker's entry.
    pub fn publish(&self, stats: SchedulerStats) {
        self.tx.send_modify(|m| {
            m.insert(stats.worker.clone(), stats);
        });
    }

    /// Withdraw `worker`'s entry (its scheduler stopped).
    pub fn remove(&self, worker: &WorkerId) {
        self.tx.send_if_modified(|m| m.remove(worker).is_some());
    }

    /// `worker`'s last published stats.
    pub fn get(&self, worker: &WorkerId) -> Option<SchedulerStats> {
        self.tx.borrow().get(worker).cloned()
    }

    /// A receiver that sees every change.
    pub fn subscribe(
        &self,
    ) -> tokio::sync::watch::Receiver<std::collections::HashMap<WorkerId, SchedulerStats>> {
        self.tx.subscribe()
    }
}

/// How a pull of remote KV ended (local message payload).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PullResult {
    /// The sequence.
    pub seq: SeqId,
    /// Blocks moved, or why not.
    pub outcome: Result<usize, String>,
    /// Bytes the KV transport moved (0 for the sim engine's modelled transfer and for a
    /// failed pull).
    #[serde(default)]
    pub bytes: u64,
}

/// Disaggregation settings of a replica (`disagg.*`).
#[derive(Clone, Copy, Debug)]
pub struct DisaggWorker {
    /// How long a prefill worker holds handed-off blocks without a confirmation.
    pub hold: std::time::Duration,
    /// How long a decode worker's pull may take.
    pub transfer_timeout: std::time::Duration,
    /// A decode worker gives up a pull this long before the prefill worker's hold ends.
    pub hold_margin: std::time::Duration,
}

impl DisaggWorker {
    /// `disagg.hold_ms` unless configured.
    pub const DEFAULT_HOLD_MS: u64 = 30_000;
    /// `disagg.transfer_timeout_ms` unless configured.
    pub const DEFAULT_TRANSFER_TIMEOUT_MS: u64 = 10_000;
    /// How long before the prefill worker's hold ends a decode worker gives up its pull.
    pub const HOLD_MARGIN: std::time::Duration = std::time::Duration::from_secs(2);

    /// The settings for a hold and a transfer timeout (ms).
    pub fn new(hold_ms: u64, transfer_timeout_ms: u64) -> Self {
        Self {
            hold: std::time::Duration::from_millis(hold_ms),
            transfer_timeout: std::time::Duration::from_millis(transfer_timeout_ms),
            hold_margin: Self::HOLD_MARGIN,
        }
    }
}

impl Default for DisaggWorker {
    /// The configuration's defaults (`disagg.*`).
    fn default() -> Self {
        Self::new(Self::DEFAULT_HOLD_MS, Self::DEFAULT_TRANSFER_TIMEOUT_MS)
    }
}

/// Modelled KV transfer of the simulated engine: no memory moves, the pull takes
/// `latency + bytes / bandwidth` (divided by the sim speed-up).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimTransfer {
    /// KV bytes per token (all layers, K and V).
    pub bytes_per_token: u64,
    /// Link bandwidth, GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// Fixed cost per pull.
    pub latency: std::time::Duration,
    /// The sim engine's speed-up (`worker.sim_speedup`).
    pub speedup: f64,
}

impl SimTransfer {
    /// Modelled time of a pull of `blocks` blocks of `block_size` tokens.
    pub fn time(&self, blocks: usize, block_size: usize) -> std::time::Duration {
        let bytes = (blocks * block_size) as f64 * self.bytes_per_token as f64;
        let secs = self.latency.as_secs_f64() + bytes / (self.gbps.max(1e-9) * 1e9);
        // Saturating: an absurd setting gives a transfer that never ends in time (the pull's
        // budget cuts it), never a panic.
        std::time::Duration::try_from_secs_f64(secs / self.speedup.max(1e-9))
            .unwrap_or(std::time::Duration::MAX)
    }
}

/// Sim engine: the modelled speed of copies between KV tiers (`kv/tiers.rs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimTierLinks {
    /// KV bytes per token (all layers, K and V).
    pub bytes_per_token: u64,
    /// Device ↔ host bandwidth, GB/s.
    pub host_gbps: f64,
    /// Host ↔ disk bandwidth, GB/s.
    pub disk_gbps: f64,
    /// The sim engine's speed-up (`worker.sim_speedup`).
    pub speedup: f64,
}

impl SimTierLinks {
    /// Modelled time of `copies` carried out one after another (one lane): each block at the
    /// bandwidth of the slower end (the disk's for a copy to or from G3, else the host link's).
    pub fn time(&self, copies: &[crate::kv::TierCopy], block_size: usize) -> std::time::Duration {
        let bytes = (block_size as u64 * self.bytes_per_token) as f64;
        let secs: f64 = copies
            .iter()
            .map(|c| {
                let disk =
                    c.from.tier() == crate::kv::Tier::Disk || c.to.tier() == crate::kv::Tier::Disk;
                let gbps = if disk { self.disk_gbps } else { self.host_gbps };
                bytes / (gbps.max(1e-9) * 1e9)
            })
            .sum();
        std::time::Duration::try_from_secs_f64(secs / self.speedup.max(1e-9))
            .unwrap_or(std::time::Duration::MAX)
    }
}

/// Outcome of one engine step (local message payload).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepResult {
    /// Step number.
    pub step: u64,
    /// The engine's output, or why there is none.
    pub output: Result<StepOutput, WorkerError>,
}
