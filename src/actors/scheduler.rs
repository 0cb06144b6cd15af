//! Scheduler: the per-replica batch former, as plain code over the [`BlockPool`].
//!
//! Files:
//! - `batch.rs` — [`SchedulerCore`], its config, requests, batches, updates and errors.
//! - `tests.rs` — unit tests, preemption equivalence, seeded random workload.
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
//! 3. admits waiting sequences strictly FCFS (no skipping) while `max_num_seqs`, the token
//!    budget `max_num_batched_tokens` and the pool allow, chunking the last prefill to fit.
//!    Admission allocates blocks for the whole prompt + 1 at once (all-or-nothing), reusing the
//!    longest cached prefix. No admission happens in a step that preempted (as in vLLM v1),
//!    which avoids admit/preempt thrashing.
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

#[cfg(test)]
mod tests;

pub use batch::{
    FinishReason, ScheduledBatch, ScheduledSeq, SchedulerConfig, SchedulerCore, SchedulerError,
    SeqRequest, SeqUpdate, StopCause,
};

#[doc(no_inline)]
pub use crate::actors::kv_block_manager::BlockPool;

// ---------------------------------------------------------------------------------------------
// The Scheduler actor
// ---------------------------------------------------------------------------------------------

use crate::actors::engine_worker::{
    EngineWorkerMsg, SamplingParams, StepBatch, StepOutput, StepSeq,
};
use crate::actors::kv_block_manager::KvEvent;
use crate::actors::token_sink::{self, TokenEvent, TokenEventKind};
use crate::ids::{NodeId, RequestId, SeqId, WorkerId};
use crate::wire::Wire;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Process group of every Scheduler (one per replica), named `<worker id>/scheduler`.
pub const SCHEDULER_GROUP: &str = "flotilla.schedulers";

/// A request handed to a replica.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SubmitRequest {
    /// Request id, unique per submitting node.
    pub request: RequestId,
    /// Node whose TokenSink receives the events.
    pub reply_to: NodeId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: u32,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Token ids that end the sequence (besides EOS).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
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
}

/// Outcome of one engine step (local message payload).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepResult {
    /// Step number.
    pub step: u64,
    /// The engine's output, or its error message.
    pub output: Result<StepOutput, String>,
}

/// Scheduler messages. Serializable: Request actors on any node submit and cancel.
#[derive(RactorClusterMessage)]
pub enum SchedulerMsg {
    /// Queue a request (cast). Refusals come back as a `Failed` token event.
    Submit(Wire<SubmitRequest>),
    /// Cancel `(node, request)` (cast; unknown ids are ignored). Frees its blocks at once.
    Cancel(Wire<(NodeId, RequestId)>),
    /// Local: the engine finished a step.
    StepDone(Wire<StepResult>),
    /// Load and memory (call).
    #[rpc]
    Stats(RpcReplyPort<Wire<SchedulerStats>>),
}

/// Spawn inputs of a Scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerArgs {
    /// This replica's worker id.
    pub worker: WorkerId,
    /// Registered name of the replica's engine worker.
    pub engine_name: String,
    /// Registered name of the replica's KV block manager, if it runs one.
    pub kv_manager_name: Option<String>,
    /// Batch limits.
    pub config: SchedulerConfig,
    /// KV pool geometry: blocks, tokens per block, hash salt.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Hash salt (model identity).
    pub salt: u64,
    /// End-of-sequence token.
    pub eos_token_id: Option<u32>,
    /// Faults injected on this node (chaos): step delays and step failures.
    pub faults: crate::actors::chaos::FaultBook,
}

struct Live {
    request: RequestId,
    reply_to: NodeId,
    sampling: SamplingParams,
    admitted: bool,
}

/// Scheduler state.
pub struct SchedulerState {
    args: SchedulerArgs,
    core: SchedulerCore,
    engine: ActorRef<EngineWorkerMsg>,
    live: HashMap<SeqId, Live>,
    by_request: HashMap<(NodeId, RequestId), SeqId>,
    next_seq: u64,
    steps: u64,
    in_flight: bool,
    outbox: HashMap<NodeId, Vec<TokenEvent>>,
}

/// The Scheduler actor.
#[derive(Debug, Default, Clone, Copy)]
pub struct Scheduler;

impl SchedulerState {
    fn emit(&mut self, to: &NodeId, request: RequestId, kind: TokenEventKind) {
        self.outbox
            .entry(to.clone())
            .or_default()
            .push(TokenEvent { request, kind });
    }

    /// Send every pending event, one message per destination node. A node without a sink
    /// (gone) has its requests cancelled.
    fn flush(&mut self) {
        for (node, events) in std::mem::take(&mut self.outbox) {
            let delivered = token_sink::find_sink(&node).is_some_and(|s| {
                s.cast(token_sink::TokenSinkMsg::Deliver(Wire::encode(&events)))
                    .is_ok()
            });
            if !delivered {
                tracing::warn!(%node, "no token sink for node; cancelling its requests");
                let gone: Vec<SeqId> = self
                    .live
                    .iter()
                    .filter(|(_, l)| l.reply_to == node)
                    .map(|(s, _)| *s)
                    .collect();
                for s in gone {
                    self.drop_seq(s);
                }
            }
        }
    }

    fn drop_seq(&mut self, seq: SeqId) {
        self.core.cancel(seq);
        if let Some(l) = self.live.remove(&seq) {
            self.by_request.remove(&(l.reply_to, l.request));
        }
        let _ = self.engine.cast(EngineWorkerMsg::Release(seq));
    }

    fn forward_kv_events(&mut self) {
        let events: Vec<KvEvent> = self.core.drain_kv_events();
        if events.is_empty() {
            return;
        }
        if let Some(name) = &self.args.kv_manager_name
            && let Some(cell) = ractor::registry::where_is(name.clone())
        {
            let kvm: ActorRef<crate::actors::kv_block_manager::KvBlockManagerMsg> = cell.into();
            let _ = kvm.cast(crate::actors::kv_block_manager::KvBlockManagerMsg::Events(
                Wire::encode(&events),
            ));
        }
    }

    /// Start the next step if none is running and there is work.
    fn kick(&mut self, myself: &ActorRef<SchedulerMsg>) -> Result<(), ActorProcessingErr> {
        while !self.in_flight && self.core.has_unfinished() {
            let batch = self.core.schedule()?;
            let mut seqs = Vec::with_capacity(batch.entries.len());
            for e in &batch.entries {
                let Some(live) = self.live.get_mut(&e.seq) else {
                    continue;
                };
                if let Some(cached) = e.cached_tokens
                    && !live.admitted
                {
                    live.admitted = true;
                    let (to, req) = (live.reply_to.clone(), live.request);
                    let worker = self.args.worker.clone();
                    self.emit(
                        &to,
                        req,
                        TokenEventKind::Admitted {
                            worker,
                            cached_tokens: cached as u32,
                        },
                    );
                }
                let live = &self.live[&e.seq];
                seqs.push(StepSeq {
                    seq_id: e.seq,
                    tokens: e.token_ids.clone(),
                    start_pos: e.start_pos,
                    block_table: e.block_table.clone(),
                    sampling: live.sampling.clone(),
                    sample: e.sample,
                });
            }
            if seqs.is_empty() {
                // Nothing could run (e.g. all admissions wait for blocks): close the step.
                self.core.on_step_output(&[])?;
                break;
            }
            self.steps += 1;
            self.in_flight = true;
            let step = self.steps;
            let engine = self.engine.clone();
            let me = myself.clone();
            let delay = self.args.faults.step_delay(&self.args.worker);
            let injected_failure = self.args.faults.step_fails(&self.args.worker);
            let (faults, worker) = (self.args.faults.clone(), self.args.worker.clone());
            tokio::spawn(async move {
                // An injected delay is slept in slices so that clearing the fault ends it.
                let until = tokio::time::Instant::now() + delay;
                while tokio::time::Instant::now() < until && !faults.step_delay(&worker).is_zero() {
                    let left = until.saturating_duration_since(tokio::time::Instant::now());
                    tokio::time::sleep(left.min(std::time::Duration::from_millis(50))).await;
                }
                let output = if injected_failure {
                    Err("injected engine failure (chaos)".to_owned())
                } else {
                    match ractor::call!(engine, EngineWorkerMsg::Step, StepBatch { seqs }) {
                        Ok(Ok(out)) => Ok(out),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(e) => Err(format!("engine unavailable: {e}")),
                    }
                };
                let _ = me.cast(SchedulerMsg::StepDone(Wire::encode(&StepResult {
                    step,
                    output,
                })));
            });
        }
        self.flush();
        Ok(())
    }

    fn on_step_done(&mut self, result: StepResult) -> Result<(), ActorProcessingErr> {
        self.in_flight = false;
        let out = match result.output {
            Ok(out) => out,
            Err(msg) => {
                // No KV was written: fail every sequence of the step, then let the supervisor
                // restart the replica if the engine itself is gone.
                tracing::error!(worker = %self.args.worker, error = %msg, "engine step failed");
                let all: Vec<SeqId> = self.live.keys().copied().collect();
                for s in all {
                    if let Some(l) = self.live.get(&s) {
                        let (to, req) = (l.reply_to.clone(), l.request);
                        self.emit(
                            &to,
                            req,
                            TokenEventKind::Failed {
                                message: "the engine failed".into(),
                                status: 500,
                            },
                        );
                    }
                    self.drop_seq(s);
                }
                let _ = self.core.on_step_output(&[]);
                self.flush();
                if msg.starts_with("engine unavailable") {
                    return Err(msg.into());
                }
                return Ok(());
            }
        };
        let logprobs: HashMap<SeqId, f32> =
            out.tokens.iter().map(|t| (t.seq_id, t.logprob)).collect();
        let sampled: Vec<(SeqId, u32)> = out.tokens.iter().map(|t| (t.seq_id, t.token)).collect();
        let updates = self.core.on_step_output(&sampled)?;
        for u in updates {
            let Some(l) = self.live.get(&u.seq) else {
                continue;
            };
            let (to, req) = (l.reply_to.clone(), l.request);
            let finish = u.finished.map(Into::into);
            let logprob = logprobs.get(&u.seq).copied().unwrap_or(0.0);
            self.emit(
                &to,
                req,
                TokenEventKind::Token {
                    id: u.token,
                    logprob,
                    finish,
                },
            );
            if finish.is_some() {
                if let Some(l) = self.live.remove(&u.seq) {
                    self.by_request.remove(&(l.reply_to, l.request));
                }
                let _ = self.engine.cast(EngineWorkerMsg::Release(u.seq));
            }
        }
        self.forward_kv_events();
        Ok(())
    }

    fn stats(&self) -> SchedulerStats {
        let usage = self.core.kv_usage();
        SchedulerStats {
            worker: self.args.worker.clone(),
            waiting: self.core.num_waiting(),
            running: self.core.num_running(),
            queued_prefill_tokens: self.core.queued_prefill_tokens(),
            kv_blocks_total: usage.total_blocks,
            kv_blocks_used: usage.used_blocks,
            steps: self.steps,
        }
    }
}

impl Actor for Scheduler {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SchedulerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let engine: ActorRef<EngineWorkerMsg> =
            ractor::registry::where_is(args.engine_name.clone())
                .ok_or_else(|| format!("engine worker {} is not running", args.engine_name))?
                .into();
        let pool = BlockPool::new(args.num_blocks, args.block_size, args.salt)?
            .with_worker(args.worker.clone());
        let core = SchedulerCore::new(args.config, pool)?;
        ractor::pg::join(SCHEDULER_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(SchedulerState {
            args,
            core,
            engine,
            live: HashMap::new(),
            by_request: HashMap::new(),
            next_seq: 0,
            steps: 0,
            in_flight: false,
            outbox: HashMap::new(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Nothing is left hanging: every live request hears that this replica stopped.
        let live: Vec<(NodeId, RequestId)> = state
            .live
            .values()
            .map(|l| (l.reply_to.clone(), l.request))
            .collect();
        for (to, req) in live {
            state.emit(
                &to,
                req,
                TokenEventKind::Failed {
                    message: "the replica stopped".into(),
                    status: 503,
                },
            );
        }
        state.flush();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Submit(wire) => {
                let Ok(req) = wire.decode() else {
                    return Ok(());
                };
                let key = (req.reply_to.clone(), req.request);
                if state.by_request.contains_key(&key) {
                    return Ok(()); // duplicate submission
                }
                state.next_seq += 1;
                let seq = SeqId(state.next_seq);
                let added = state.core.add(SeqRequest {
                    seq,
                    prompt: req.prompt,
                    max_tokens: req.max_tokens as usize,
                    stop_token_ids: req.stop_token_ids,
                    eos_token_id: if req.ignore_eos {
                        None
                    } else {
                        state.args.eos_token_id
                    },
                });
                match added {
                    Ok(()) => {
                        state.by_request.insert(key, seq);
                        state.live.insert(
                            seq,
                            Live {
                                request: req.request,
                                reply_to: req.reply_to,
                                sampling: req.sampling,
                                admitted: false,
                            },
                        );
                    }
                    Err(e) => {
                        state.emit(
                            &req.reply_to,
                            req.request,
                            TokenEventKind::Failed {
                                message: e.to_string(),
                                status: 400,
                            },
                        );
                    }
                }
                state.kick(&myself)?;
            }
            SchedulerMsg::Cancel(wire) => {
                if let Ok(key) = wire.decode()
                    && let Some(seq) = state.by_request.get(&key).copied()
                {
                    state.drop_seq(seq);
                    state.forward_kv_events();
                }
            }
            SchedulerMsg::StepDone(wire) => {
                let result = wire.decode()?;
                state.on_step_done(result)?;
                state.kick(&myself)?;
            }
            SchedulerMsg::Stats(reply) => {
                let _ = reply.send(Wire::encode(&state.stats()));
            }
        }
        Ok(())
    }
}
