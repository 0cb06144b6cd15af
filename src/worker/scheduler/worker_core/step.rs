//! A [`WorkerCore`]'s engine steps: forming the next one from the batch former's batch
//! (admissions, pulls to start, prompt rows to score), and taking one back (tokens to emit,
//! hand-offs, finished sequences, the step-time model's lesson).

use std::collections::HashMap;

use super::{SEQUENCE_TARGET, STEP_TARGET, SeqState, WorkerCore, WorkerCoreError, WorkerEffect};
use crate::request_plane::protocol::{RemoteKv, TokenEventKind};
use crate::runtime::clock::Instant;
use crate::runtime::ids::SeqId;
use crate::transport::RegionDescriptor;
use crate::worker::engine::{StepBatch, StepSeq};
use crate::worker::scheduler::{ScheduledSeq, StepResult, StepShape};

/// The step in flight: its shape, when it started, and whether no injected delay or hang
/// could lengthen it (only such steps teach the step-time model).
pub(super) struct StepTiming {
    pub shape: StepShape,
    pub started: Instant,
    pub clean: bool,
}

impl WorkerCore {
    /// Start the next step if none is running and there is work (not within a gather window).
    pub(super) fn kick(&mut self) -> Result<(), WorkerCoreError> {
        if self
            .gather_until
            .is_some_and(|until| self.clock.now() < until)
        {
            return Ok(());
        }
        while !self.watchdog.step_in_flight() && self.core.has_unfinished() {
            let mut batch = self.core.schedule_with(self.step_model.cost().as_ref())?;
            for order in std::mem::take(&mut batch.pulls) {
                self.start_pull(order);
            }
            let copies = self.core.pool_mut().drain_copies();
            if !copies.is_empty() {
                self.effects.push(WorkerEffect::TierCopies(copies));
            }
            let mut seqs = Vec::with_capacity(batch.entries.len());
            for e in &batch.entries {
                let Some(s) = self.seqs.get_mut(&e.seq) else {
                    continue;
                };
                if let Some(cached) = e.cached_tokens
                    && let SeqState::Waiting { peer, .. } = &mut s.state
                {
                    // Admitted with its prefix computed here.
                    let moot = peer.take();
                    s.state = SeqState::Prefilling;
                    if let Some((holder, key)) = moot {
                        // Cached here after all (nothing to pull): unpin the holder's blocks.
                        self.peer.moot();
                        self.confirm(holder, key);
                    }
                    self.admitted(e.seq, cached);
                }
                let s = &self.seqs[&e.seq];
                seqs.push(StepSeq {
                    seq_id: e.seq,
                    tokens: e.token_ids.clone(),
                    start_pos: e.start_pos,
                    block_table: e.block_table.clone(),
                    sampling: s.sampling.clone(),
                    sample: e.sample,
                    score: prompt_targets(e, s.sampling.echo_tokens as usize),
                });
            }
            if seqs.is_empty() {
                // Nothing could run (e.g. all admissions wait for blocks): close the step.
                self.core.on_step_output(&[])?;
                break;
            }
            self.steps += 1;
            if let Some(prefill) = batch.stall_capped {
                let worker = self.cfg.worker.to_string();
                metrics::counter!("flotilla_scheduler_stall_capped_steps_total", "worker" => worker.clone())
                    .increment(1);
                metrics::gauge!("flotilla_scheduler_prefill_cap_tokens", "worker" => worker)
                    .set(prefill as f64);
            }
            // The engine's chaos filter sleeps a `slow` delay before the step: not engine time
            // (the watchdog allows for it; the step-time model does not learn from the step).
            let delay = self.faults.step_delay;
            self.step_timing = Some(StepTiming {
                shape: StepShape::of(
                    batch
                        .entries
                        .iter()
                        .map(|e| (e.start_pos, e.token_ids.len())),
                ),
                started: self.clock.now(),
                clean: delay.is_zero() && !self.faults.hang,
            });
            self.watchdog.step_started(delay);
            self.effects.push(WorkerEffect::Step {
                step: self.steps,
                batch: StepBatch { seqs },
            });
        }
        Ok(())
    }

    pub(super) fn on_step_done(
        &mut self,
        result: StepResult,
        region: impl Fn() -> Option<RegionDescriptor>,
    ) -> Result<(), WorkerCoreError> {
        self.watchdog.step_returned();
        let timing = self.step_timing.take();
        if let (Some(t), Ok(_)) = (timing, &result.output) {
            self.learn_step_time(t);
        }
        let out = match result.output {
            Ok(out) => out,
            Err(err) => {
                // No KV was written. An engine that is gone (its actor died) takes the replica
                // down: every sequence is lost and migrates, and the supervisor restarts the
                // replica. An engine that answered with an error fails the step's sequences.
                tracing::error!(worker = %self.cfg.worker, error = %err, "engine step failed");
                let gone = err.takes_replica_down();
                let kind = if gone {
                    TokenEventKind::Lost {
                        reason: "the engine of its worker died".into(),
                    }
                } else {
                    TokenEventKind::Failed {
                        message: "the engine failed".into(),
                        status: 500,
                    }
                };
                self.drop_all(&kind);
                let _ = self.core.on_step_output(&[]);
                if gone {
                    return Err(err.into());
                }
                return Ok(());
            }
        };
        // Prompt log-probabilities first: they precede the sequence's first token.
        for p in out.prompt {
            let first = u32::try_from(p.first).unwrap_or(u32::MAX);
            let logprobs = p.logprobs;
            self.emit_to(p.seq_id, TokenEventKind::Prompt { first, logprobs });
        }
        let sampled: Vec<(SeqId, u32)> = out.tokens.iter().map(|t| (t.seq_id, t.token)).collect();
        let mut logprobs: HashMap<SeqId, (f32, Vec<(u32, f32)>)> = out
            .tokens
            .into_iter()
            .map(|t| (t.seq_id, (t.logprob, t.top)))
            .collect();
        let updates = self.core.on_step_output(&sampled)?;
        for u in updates {
            let Some(s) = self.seqs.get_mut(&u.seq).filter(|s| s.active()) else {
                continue;
            };
            let index = s.emitted;
            s.emitted += 1;
            s.state = SeqState::Decoding;
            let (to, request) = (s.owner.clone(), s.request);
            self.generated_tokens += 1;
            let finish = u.finished;
            let (logprob, top) = logprobs.remove(&u.seq).unwrap_or((0.0, Vec::new()));
            let token = TokenEventKind::Token {
                id: u.token,
                logprob,
                finish,
                index,
                top,
            };
            self.emit(&to, request, token);
            if let Some(h) = u.handed_off {
                self.hand_off(u.seq, &h.blocks, h.tokens, region());
                continue;
            }
            if finish.is_some() {
                if let Some(s) = self.seqs.remove(&u.seq) {
                    let _in = s.span.enter();
                    tracing::info!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %s.request, request_id = %s.trace_id.as_deref().unwrap_or("-"), tokens = s.emitted, "sequence finished");
                    self.by_request.remove(&s.key());
                }
                self.effects.push(WorkerEffect::Release(u.seq));
            }
        }
        self.forward_kv_events();
        Ok(())
    }

    /// Disaggregated prefill: the first token of `seq` went out; its KV (`blocks`, holding
    /// `tokens` tokens, readable at `region`) waits, pinned, for the decode worker's pull.
    fn hand_off(
        &mut self,
        seq: SeqId,
        blocks: &[crate::runtime::ids::BlockId],
        tokens: usize,
        region: Option<RegionDescriptor>,
    ) {
        let hold = self.cfg.disagg.hold;
        let until = self.clock.now() + hold;
        let Some(s) = self.seqs.get_mut(&seq) else {
            return;
        };
        let kv = RemoteKv {
            worker: self.cfg.worker.clone(),
            request: s.request,
            region,
            blocks: blocks.iter().map(|b| b.0).collect(),
            tokens: tokens as u32,
            held_until_ms: self.clock.wall_ms() + hold.as_millis() as u64,
        };
        s.state = SeqState::HandedOff { until };
        {
            let _in = s.span.enter();
            tracing::info!(target: SEQUENCE_TARGET, worker = %self.cfg.worker, request = %s.request, request_id = %s.trace_id.as_deref().unwrap_or("-"), blocks = blocks.len(), "sequence handed off");
        }
        // The span ends here: what remains is the hold.
        s.span = tracing::Span::none();
        self.emit_to(seq, TokenEventKind::HandOff(Box::new(kv)));
        metrics::counter!("flotilla_disagg_hand_offs_total", "worker" => self.cfg.worker.to_string())
            .increment(1);
    }

    /// Feeds a step that came back to the step-time model, unless an injected delay or hang
    /// may have lengthened it (one active when it started or now).
    fn learn_step_time(&mut self, t: StepTiming) {
        if !t.clean || !self.faults.step_delay.is_zero() || self.faults.hang {
            return;
        }
        let ms = self.clock.now().duration_since(t.started).as_secs_f64() * 1000.0;
        tracing::debug!(target: STEP_TARGET, worker = %self.cfg.worker, tokens = t.shape.tokens, ms = ms.round(), running = self.core.num_running(), waiting = self.core.num_waiting(), "step");
        self.step_model.observe(t.shape, ms);
        let w = self.cfg.worker.to_string();
        metrics::histogram!("flotilla_scheduler_step_duration_seconds", "worker" => w.clone())
            .record(ms / 1000.0);
        if let Some(c) = self.step_model.cost() {
            for (term, v) in [
                ("base", c.base_ms),
                ("per_token", c.per_token_ms),
                ("per_kpair", c.per_kpair_ms),
            ] {
                metrics::gauge!("flotilla_scheduler_step_model_ms", "worker" => w.clone(), "term" => term)
                    .set(v);
            }
        }
    }
}

/// What each row of a scheduled entry is scored against for prompt log-probabilities: the
/// token after it, for every row whose next position is among the first `echo_tokens` (the
/// client's prompt; a migrated sequence's prompt also holds the tokens generated before).
/// Empty when the entry scores nothing (no echo, a decode step, or past the prompt).
pub(super) fn prompt_targets(e: &ScheduledSeq, echo_tokens: usize) -> Vec<u32> {
    let scored = echo_tokens
        .saturating_sub(e.start_pos + 1)
        .min(e.token_ids.len());
    (0..scored)
        .filter_map(|i| e.token_ids.get(i + 1).copied().or(e.next_token))
        .collect()
}
