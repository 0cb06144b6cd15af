//! [`SchedulerCore`]: continuous batching with chunked prefill and preemption by recompute.
//!
//! See the parent module doc for the policy; this file holds the code.

use std::collections::{HashMap, HashSet};

use super::step_model::{StepCost, StepShape};
use super::waiting::Waiting;
use crate::kv::{BlockPool, KvEvent, PoolError, PoolUsage, SeqLease};
use crate::request_plane::priority::ClassTag;
use crate::runtime::ids::{BlockId, SeqId};

/// Errors of the scheduler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(&'static str),
    #[error("sequence {0} has an empty prompt")]
    EmptyPrompt(SeqId),
    #[error("sequence {0} asks for max_tokens = 0")]
    ZeroMaxTokens(SeqId),
    #[error("sequence {0} is already queued or running")]
    DuplicateSequence(SeqId),
    #[error(
        "sequence {seq}: prompt of {prompt_tokens} tokens + 1 exceeds max_model_len {max_model_len}"
    )]
    PromptTooLong {
        seq: SeqId,
        prompt_tokens: usize,
        max_model_len: usize,
    },
    #[error(
        "sequence {seq}: prompt of {prompt_tokens} tokens + 1 exceeds the pool's {capacity_tokens} token slots"
    )]
    PromptNeverFits {
        seq: SeqId,
        prompt_tokens: usize,
        capacity_tokens: usize,
    },
    #[error("a step is in flight: call on_step_output before scheduling again")]
    StepInFlight,
    #[error("no step is in flight")]
    NoStepInFlight,
    #[error("sampled token for sequence {0}, which was not scheduled to sample")]
    UnexpectedSample(SeqId),
    #[error("two sampled tokens for sequence {0}")]
    DuplicateSample(SeqId),
    #[error("no sampled token for sequence {0}, which was scheduled to sample")]
    MissingSample(SeqId),
    #[error(
        "sequence {seq}: {remote_tokens} remote KV tokens, but the prompt has only {prompt_tokens}"
    )]
    RemoteBeyondPrompt {
        seq: SeqId,
        remote_tokens: usize,
        prompt_tokens: usize,
    },
    #[error("block pool: {0}")]
    Pool(#[from] PoolError),
}

/// Scheduler limits. `max_model_len` is the context limit in tokens (prompt + generated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// Stall-free batching: a step that holds decode rows takes prefill tokens only while its
    /// predicted time stays within this (ms), given a step-time model
    /// ([`SchedulerCore::schedule_with`]); 0 = off (the token budget alone). The default here
    /// is off; the runtime's comes from `scheduler.max_decode_stall_ms`.
    pub max_decode_stall_ms: u64,
    /// An idle replica given a migrated request waits this long (ms) for the rest of the lost
    /// worker's requests before its next step (`WorkerCore::submit`); 0 = at once. The default
    /// here is off; the runtime's comes from `scheduler.resume_gather_ms`.
    pub resume_gather_ms: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            max_decode_stall_ms: 0,
            resume_gather_ms: 0,
        }
    }
}

impl SchedulerConfig {
    /// Checks the limits.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] when `max_num_seqs` or `max_num_batched_tokens` is 0
    /// or `max_model_len` is below 2.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if self.max_num_seqs == 0 {
            return Err(SchedulerError::InvalidConfig(
                "max_num_seqs must be at least 1",
            ));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(SchedulerError::InvalidConfig(
                "max_num_batched_tokens must be at least 1",
            ));
        }
        if self.max_model_len < 2 {
            return Err(SchedulerError::InvalidConfig(
                "max_model_len must be at least 2",
            ));
        }
        Ok(())
    }
}

/// One sequence to serve.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SeqRequest {
    pub seq: SeqId,
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub eos_token_id: Option<u32>,
    /// Place in the waiting queue: lower first, equal ones in submission order. Since when
    /// the client has waited for the sequence's next token (ms since the Unix epoch: its
    /// arrival at the gateway, or its last token before a migration; see
    /// [`SubmitRequest::waiting_since_ms`](crate::request_plane::protocol::SubmitRequest)).
    pub waiting_since: u64,
    /// Disaggregated decode: the KV of the first `remote_tokens` prompt tokens was computed by
    /// a prefill worker and is pulled from it at admission (a [`PullOrder`]) for the blocks
    /// not already cached here; 0 = none. Must be below the prompt's length.
    pub remote_tokens: usize,
    /// Disaggregated prefill: after the first sampled token (unless it ends the sequence) the
    /// sequence is **handed off**: it leaves the batch and its blocks stay pinned
    /// ([`SeqUpdate::handed_off`]) until [`SchedulerCore::cancel`] releases them.
    pub hand_off: bool,
    /// Its priority class (`request_plane/priority.rs`): its lane in the waiting queue.
    /// `None`: the unclassed lane (the only one when no class is configured).
    pub class: Option<ClassTag>,
    /// Prompt log-probabilities are wanted (`echo`): the prefix cache is not used at
    /// admission ([`BlockPool::allocate_uncached`]), so that every prompt position is computed
    /// and yields its logits; nor are lower tiers onboarded.
    pub uncached: bool,
    /// A migrated stream: its client already has tokens and the prompt holds them, so its
    /// prefill is a recompute during which the stream is stalled. Stall-free batching does
    /// not cut its chunks (only the token budget does): the limit bounds how long a newcomer's
    /// prefill may stall running streams, and this one's own stall is already longer than
    /// that; cut to one block per step beside decodes, its recompute took several steps and
    /// the next fault often came first.
    pub resumed: bool,
}

pub use crate::request_plane::protocol::FinishReason;

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq: SeqId,
    /// Tokens to run, at positions `start_pos..start_pos + token_ids.len()`.
    pub token_ids: Vec<u32>,
    pub start_pos: usize,
    /// Blocks covering every position `< start_pos + token_ids.len()`.
    pub block_table: Vec<BlockId>,
    /// Sample a token after the last position (end of prompt, or a decode token).
    pub sample: bool,
    /// `Some(cached prefix tokens)` when the sequence was admitted in this step.
    pub cached_tokens: Option<usize>,
    /// The sequence's token right after this entry's, when known (the next prompt chunk's
    /// first token): what its last row's logits predict (prompt log-probabilities).
    pub next_token: Option<u32>,
}

/// One engine step.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScheduledBatch {
    /// Decodes first, then prefill continuations, then newly admitted sequences.
    pub entries: Vec<ScheduledSeq>,
    /// Sequences preempted since the last batch (blocks freed; they will be recomputed).
    pub preempted: Vec<SeqId>,
    /// `Some(prefill tokens of the step)` when the stall limit shortened or held back its
    /// prefill (stall-free batching).
    pub stall_capped: Option<usize>,
    /// Sequences admitted in this step whose KV is to be pulled from a prefill worker (they
    /// have no entry: they run once [`SchedulerCore::pull_done`] is called).
    pub pulls: Vec<PullOrder>,
}

impl ScheduledBatch {
    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.entries.iter().map(|e| e.token_ids.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// One sampled token, as accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqUpdate {
    pub seq: SeqId,
    pub token: u32,
    /// `Some` when this token ends the sequence (its blocks are already freed).
    pub finished: Option<FinishReason>,
    /// `Some` when a [`SeqRequest::hand_off`] sequence left the batch after this token: its
    /// blocks stay pinned (held) until the sequence is cancelled.
    pub handed_off: Option<HandedOff>,
}

/// A prefill handed off: the blocks that hold its prompt's KV, pinned until released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedOff {
    /// Prompt tokens whose KV the blocks hold.
    pub tokens: usize,
    /// The blocks, in order: `ceil(tokens / block_size)` of them.
    pub blocks: Vec<BlockId>,
}

/// KV to pull for a sequence admitted with [`SeqRequest::remote_tokens`]: the sequence waits
/// (no step runs it) until [`SchedulerCore::pull_done`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullOrder {
    pub seq: SeqId,
    /// Leading prompt tokens found in this pool's prefix cache (not pulled).
    pub cached_tokens: usize,
    /// Prompt tokens whose KV the pull completes.
    pub tokens: usize,
    /// `(block index in the sequence, local block)` for every block to fill.
    pub blocks: Vec<(usize, BlockId)>,
}

#[derive(Debug)]
struct SeqEntry {
    /// Prompt + generated tokens.
    tokens: Vec<u32>,
    /// Tokens to prefill in the current admission (the prompt, or prompt + generated after a
    /// preemption).
    prefill_len: usize,
    /// Tokens scheduled so far (their KV is written once the in-flight step returns).
    num_computed: usize,
    num_generated: usize,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    eos_token_id: Option<u32>,
    /// `Some` while running.
    lease: Option<SeqLease>,
    /// Remote KV: expected (waiting), being pulled or onboarded (running, not scheduled), or
    /// none.
    remote: Remote,
    hand_off: bool,
    /// Onboarded from a lower tier: the next entry reports its cached tokens (admission).
    report_cached: bool,
    /// See [`SeqRequest::uncached`].
    uncached: bool,
    /// See [`SeqRequest::resumed`].
    resumed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Remote {
    None,
    /// Pull these leading tokens' KV at admission.
    Expected(usize),
    /// Admitted; the pull of these leading tokens' KV is in flight.
    Pulling(usize),
    /// Admitted; these leading tokens' KV is being onboarded from a lower tier (G2/G3).
    Onboarding(usize),
}

impl Remote {
    /// Whether a transfer writes the sequence's blocks now (it is not scheduled, preempted or
    /// freed meanwhile).
    fn in_flight(self) -> bool {
        matches!(self, Remote::Pulling(_) | Remote::Onboarding(_))
    }
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    seq: SeqId,
    computed_after: usize,
    sample: bool,
    /// False once the sequence was cancelled during the step.
    alive: bool,
}

/// Stall-free batching's limit on one step's prefill (see [`SchedulerCore::schedule_with`]).
#[derive(Debug, Clone, Copy)]
struct StallLimit {
    cost: StepCost,
    max_ms: f64,
    /// The step so far.
    shape: StepShape,
    /// Prefill tokens a step always gets (one KV block).
    min_prefill: usize,
    /// Prefill tokens in the step so far.
    prefill: usize,
    /// Whether the limit cut something.
    capped: bool,
}

impl StallLimit {
    /// Whether a new sequence may be admitted: a token at the start of a prompt (the cheapest
    /// place) fits, or the step has not had its minimal prefill yet.
    fn admits(&mut self) -> bool {
        let ok = self.prefill < self.min_prefill
            || self.cost.max_chunk(self.shape, 0, 1, self.max_ms) == 1;
        self.capped |= !ok;
        ok
    }

    /// Tokens of a chunk at `start` that may run (at least `at_least`), of the `want` that the
    /// budget allows; the chunk is counted in the step.
    fn chunk(&mut self, start: usize, want: usize, at_least: usize) -> usize {
        let fits = self.cost.max_chunk(self.shape, start, want, self.max_ms);
        let floor = self
            .min_prefill
            .saturating_sub(self.prefill)
            .max(at_least)
            .min(want);
        let n = fits.max(floor);
        if n < want {
            self.capped = true;
        }
        if n > 0 {
            self.shape.add(start, n);
            self.prefill += n;
        }
        n
    }
}

/// The per-replica batch former (see the module doc).
#[derive(Debug)]
pub struct SchedulerCore {
    config: SchedulerConfig,
    pool: BlockPool,
    /// `min(max_model_len, pool capacity in tokens)`.
    max_len: usize,
    seqs: HashMap<SeqId, SeqEntry>,
    waiting: Waiting,
    /// Admission order: the newest is last (the first preemption victim).
    running: Vec<SeqId>,
    in_flight: Option<Vec<InFlight>>,
    preempted: Vec<SeqId>,
    /// Handed-off sequences: their blocks stay pinned until cancelled.
    held: HashMap<SeqId, SeqLease>,
    /// Sequences cancelled while their pull was in flight: their blocks are written by the
    /// pull, so they are freed only when it returns ([`Self::pull_done`]).
    orphaned_pulls: HashMap<SeqId, SeqLease>,
}

impl SchedulerCore {
    /// A batch former over `pool`, with no sequences.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] for invalid limits (see [`SchedulerConfig::validate`]).
    pub fn new(config: SchedulerConfig, pool: BlockPool) -> Result<Self, SchedulerError> {
        config.validate()?;
        let capacity = pool.num_blocks() * pool.block_size();
        Ok(Self {
            config,
            max_len: config.max_model_len.min(capacity),
            pool,
            seqs: HashMap::new(),
            waiting: Waiting::default(),
            running: Vec::new(),
            in_flight: None,
            preempted: Vec::new(),
            held: HashMap::new(),
            orphaned_pulls: HashMap::new(),
        })
    }

    /// Queues a request: first come, first served by [`SeqRequest::waiting_since`] within its
    /// priority class, classes by deficit round robin (`waiting.rs`).
    ///
    /// # Errors
    /// The request is refused (nothing queued) for an empty prompt, `max_tokens` 0, a
    /// sequence id already here, or a prompt that can never fit (`max_model_len` or the pool).
    pub fn add(&mut self, req: SeqRequest) -> Result<(), SchedulerError> {
        let seq = req.seq;
        if req.prompt.is_empty() {
            return Err(SchedulerError::EmptyPrompt(seq));
        }
        if req.max_tokens == 0 {
            return Err(SchedulerError::ZeroMaxTokens(seq));
        }
        if self.seqs.contains_key(&seq)
            || self.held.contains_key(&seq)
            || self.orphaned_pulls.contains_key(&seq)
        {
            return Err(SchedulerError::DuplicateSequence(seq));
        }
        let prompt_tokens = req.prompt.len();
        if req.remote_tokens >= prompt_tokens {
            return Err(SchedulerError::RemoteBeyondPrompt {
                seq,
                remote_tokens: req.remote_tokens,
                prompt_tokens,
            });
        }
        if prompt_tokens + 1 > self.config.max_model_len {
            return Err(SchedulerError::PromptTooLong {
                seq,
                prompt_tokens,
                max_model_len: self.config.max_model_len,
            });
        }
        if prompt_tokens + 1 > self.max_len {
            return Err(SchedulerError::PromptNeverFits {
                seq,
                prompt_tokens,
                capacity_tokens: self.max_len,
            });
        }
        self.seqs.insert(
            seq,
            SeqEntry {
                prefill_len: prompt_tokens,
                tokens: req.prompt,
                num_computed: 0,
                num_generated: 0,
                max_tokens: req.max_tokens,
                stop_token_ids: req.stop_token_ids,
                eos_token_id: req.eos_token_id,
                lease: None,
                remote: if req.remote_tokens > 0 {
                    Remote::Expected(req.remote_tokens)
                } else {
                    Remote::None
                },
                hand_off: req.hand_off,
                report_cached: false,
                uncached: req.uncached,
                resumed: req.resumed,
            },
        );
        // After every waiting sequence of its class that has waited at least as long.
        self.waiting
            .insert(seq, req.class.as_ref(), req.waiting_since);
        Ok(())
    }

    /// Forms the next step under the token budget alone: [`Self::schedule_with`] without a
    /// step-time model.
    ///
    /// # Errors
    /// See [`Self::schedule_with`].
    pub fn schedule(&mut self) -> Result<ScheduledBatch, SchedulerError> {
        self.schedule_with(None)
    }

    /// Forms the next step: decodes, then prefill continuations, then FCFS admissions (none in
    /// a step that preempted). Exactly one step may be in flight.
    ///
    /// Stall-free batching: with a step-time model `cost`, `max_decode_stall_ms > 0` and at
    /// least one decode row in the step, each prefill chunk is cut to the most tokens that
    /// keep the step's predicted time within `max_decode_stall_ms` — but the step's prefill
    /// always gets at least one KV block's worth of tokens (or what is left of the budget), so
    /// that prefills progress whatever the model says, and an admitted sequence at least one
    /// token. Without decode rows, or without a model, only the token budget applies; nor
    /// does the limit cut a resumed stream's chunks ([`SeqRequest::resumed`]).
    ///
    /// # Errors
    /// [`SchedulerError::StepInFlight`] while a step is out; [`SchedulerError::Pool`] means
    /// a broken invariant between the core and its pool.
    pub fn schedule_with(
        &mut self,
        cost: Option<&StepCost>,
    ) -> Result<ScheduledBatch, SchedulerError> {
        if self.in_flight.is_some() {
            return Err(SchedulerError::StepInFlight);
        }
        let mut budget = self.config.max_num_batched_tokens;
        let mut entries = Vec::new();
        let mut pulls = Vec::new();
        let preempted_before = self.preempted.len();

        // 1. One decode token per running sequence, in admission order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = self.running[i];
            let e = &self.seqs[&s];
            if e.num_computed < e.prefill_len || e.num_computed >= e.tokens.len() {
                i += 1;
                continue;
            }
            // Slots for every known token plus the one this step samples.
            let slots = e.tokens.len() + 1;
            if !self.reserve_or_preempt(s, slots)? {
                continue; // `s` itself was preempted; running[i] is the next one
            }
            entries.push(self.entry(s, 1, None));
            budget -= 1;
            i += 1;
        }

        // The stall limit applies to steps with decode rows (all entries so far are decodes).
        let mut stall = match cost {
            Some(c) if self.config.max_decode_stall_ms > 0 && !entries.is_empty() => {
                Some(StallLimit {
                    cost: *c,
                    max_ms: self.config.max_decode_stall_ms as f64,
                    shape: StepShape::of(entries.iter().map(|e| (e.start_pos, 1))),
                    min_prefill: self.pool.block_size(),
                    prefill: 0,
                    capped: false,
                })
            }
            _ => None,
        };

        // 2. Continue partially prefilled sequences (blocks were allocated at admission).
        for idx in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            let s = self.running[idx];
            let e = &self.seqs[&s];
            if e.num_computed >= e.prefill_len || e.remote.in_flight() {
                continue;
            }
            let mut chunk = (e.prefill_len - e.num_computed).min(budget);
            if let Some(limit) = stall.as_mut() {
                // A resumed stream's chunk is not cut (at least all of it), but counted.
                let at_least = if e.resumed { chunk } else { 0 };
                chunk = limit.chunk(e.num_computed, chunk, at_least);
                if chunk == 0 {
                    break;
                }
            }
            let report = e.report_cached.then_some(e.num_computed);
            if let Some(e) = self.seqs.get_mut(&s) {
                e.report_cached = false;
            }
            entries.push(self.entry(s, chunk, report));
            budget -= chunk;
        }

        // 3. Admit waiting sequences (preempted ones first, then by class: FCFS within a
        //    class, classes by deficit round robin), unless this step had to preempt.
        let preempted_now = self.preempted.len() > preempted_before;
        while !preempted_now && budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(head) = self.waiting.peek() else {
                break;
            };
            let s = head.seq;
            let entry = &self.seqs[&s];
            if !entry.resumed && stall.as_mut().is_some_and(|l| !l.admits()) {
                break;
            }
            let alloc = if entry.uncached && entry.remote == Remote::None {
                self.pool.allocate_uncached(s, &entry.tokens)
            } else if entry.remote == Remote::None {
                // Blocks after the G1 hit that a lower tier holds are onboarded.
                self.pool.allocate_onboarding(s, &entry.tokens)
            } else {
                self.pool.allocate_sequence(s, &entry.tokens)
            };
            let alloc = match alloc {
                Ok(a) => a,
                Err(PoolError::OutOfBlocks { .. }) => break,
                Err(e) => return Err(e.into()),
            };
            // Its class pays for the prompt tokens computed here (cached, pulled and
            // onboarded ones are not): at least 1.
            let reused = match entry.remote {
                Remote::Expected(n) => n.max(alloc.cached_tokens),
                _ => alloc.cached_tokens + alloc.onboard_tokens,
            };
            self.waiting
                .admitted(head, entry.prefill_len.saturating_sub(reused) as u64);
            self.running.push(s);
            let e = self.seqs.get_mut(&s).ok_or(PoolError::UnknownSequence(s))?;
            e.lease = Some(alloc.lease);
            e.num_computed = alloc.cached_tokens;
            if let Remote::Expected(n) = e.remote {
                if n > alloc.cached_tokens {
                    // Pull the blocks from the first one not cached here to the one holding
                    // token n - 1; the sequence runs once the pull returns.
                    let bs = self.pool.block_size();
                    let blocks = (alloc.cached_tokens / bs..n.div_ceil(bs))
                        .filter_map(|i| alloc.block_table.get(i).map(|&b| (i, b)))
                        .collect();
                    e.remote = Remote::Pulling(n);
                    pulls.push(PullOrder {
                        seq: s,
                        cached_tokens: alloc.cached_tokens,
                        tokens: n,
                        blocks,
                    });
                    continue;
                }
                e.remote = Remote::None;
            }
            if alloc.onboard_tokens > 0 {
                // Runs once its onboard copies return (`copies_done`).
                e.remote = Remote::Onboarding(alloc.cached_tokens + alloc.onboard_tokens);
                continue;
            }
            let mut chunk = (e.prefill_len - e.num_computed).min(budget);
            if let Some(limit) = stall.as_mut() {
                let at_least = if e.resumed { chunk } else { 1 };
                chunk = limit.chunk(e.num_computed, chunk, at_least);
            }
            entries.push(self.entry(s, chunk, Some(alloc.cached_tokens)));
            budget -= chunk;
        }

        self.in_flight = Some(
            entries
                .iter()
                .map(|e: &ScheduledSeq| InFlight {
                    seq: e.seq,
                    computed_after: e.start_pos + e.token_ids.len(),
                    sample: e.sample,
                    alive: true,
                })
                .collect(),
        );
        Ok(ScheduledBatch {
            entries,
            preempted: std::mem::take(&mut self.preempted),
            stall_capped: stall.filter(|l| l.capped).map(|l| l.prefill),
            pulls,
        })
    }

    /// Accepts the sampled tokens of the in-flight step (all-or-nothing validation first):
    /// registers the computed blocks, appends the tokens, finishes and frees sequences that
    /// stop. Tokens of sequences cancelled during the step are ignored.
    ///
    /// # Errors
    /// Without a step in flight, or for samples that do not match it (a duplicate, one for
    /// a sequence that was not to sample, a missing one); nothing is applied then.
    pub fn on_step_output(
        &mut self,
        sampled: &[(SeqId, u32)],
    ) -> Result<Vec<SeqUpdate>, SchedulerError> {
        let flight = self
            .in_flight
            .as_ref()
            .ok_or(SchedulerError::NoStepInFlight)?;
        let by_seq: HashMap<SeqId, InFlight> = flight.iter().map(|f| (f.seq, *f)).collect();
        let mut seen = HashSet::new();
        for &(s, _) in sampled {
            if !seen.insert(s) {
                return Err(SchedulerError::DuplicateSample(s));
            }
            match by_seq.get(&s) {
                Some(f) if f.sample || !f.alive => {}
                _ => return Err(SchedulerError::UnexpectedSample(s)),
            }
        }
        if let Some(f) = flight
            .iter()
            .find(|f| f.alive && f.sample && !seen.contains(&f.seq))
        {
            return Err(SchedulerError::MissingSample(f.seq));
        }
        let flight = self.in_flight.take().unwrap_or_default();
        for f in flight.iter().filter(|f| f.alive) {
            self.pool.mark_computed(f.seq, f.computed_after)?;
        }
        let mut updates = Vec::with_capacity(sampled.len());
        for &(s, token) in sampled {
            if !by_seq[&s].alive {
                continue;
            }
            let Some(e) = self.seqs.get_mut(&s) else {
                continue;
            };
            e.tokens.push(token);
            e.num_generated += 1;
            let finished = if e.eos_token_id == Some(token) || e.stop_token_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if e.num_generated >= e.max_tokens {
                Some(FinishReason::Length)
            } else if e.tokens.len() >= self.max_len {
                Some(FinishReason::ContextLimit)
            } else {
                None
            };
            let mut handed_off = None;
            if finished.is_some() {
                self.remove(s)?;
            } else if e.hand_off {
                // Disaggregated prefill: the prompt's KV is complete and the first token
                // sampled; the sequence leaves the batch, its blocks stay pinned for the pull.
                let tokens = e.tokens.len() - 1;
                let blocks = self
                    .pool
                    .block_table(s)
                    .map(|t| t[..tokens.div_ceil(self.pool.block_size()).min(t.len())].to_vec())
                    .unwrap_or_default();
                self.running.retain(|&r| r != s);
                if let Some(lease) = self.seqs.remove(&s).and_then(|e| e.lease) {
                    self.held.insert(s, lease);
                }
                handed_off = Some(HandedOff { tokens, blocks });
            } else if let Err(err) = self.pool.append_tokens(s, &[token]) {
                // Unreachable while schedule() reserves the lookahead slot; recompute later.
                match err {
                    PoolError::OutOfBlocks { .. } => self.preempt(s)?,
                    other => return Err(other.into()),
                }
            }
            updates.push(SeqUpdate {
                seq: s,
                token,
                finished,
                handed_off,
            });
        }
        Ok(updates)
    }

    /// Removes a waiting, running or handed-off sequence and frees its blocks. False if
    /// unknown. A sequence whose pull is in flight leaves at once, but its blocks are freed
    /// only when the pull returns ([`Self::pull_done`]): the pull writes into them.
    pub fn cancel(&mut self, seq: SeqId) -> bool {
        if let Some(lease) = self.held.remove(&seq) {
            let _ = self.pool.free(lease);
            return true;
        }
        let Some(e) = self.seqs.get(&seq) else {
            return false;
        };
        if e.remote.in_flight() {
            self.running.retain(|&r| r != seq);
            if let Some(lease) = self.seqs.remove(&seq).and_then(|e| e.lease) {
                self.orphaned_pulls.insert(seq, lease);
            }
            return true;
        }
        if let Some(flight) = self.in_flight.as_mut() {
            for f in flight.iter_mut().filter(|f| f.seq == seq) {
                f.alive = false;
            }
        }
        self.waiting.remove(seq);
        // A failed free leaves the lease to its Drop, which queues the release in the pool.
        let _ = self.remove(seq);
        true
    }

    /// The pull of `seq`'s remote KV returned: on success its prompt's KV up to the pulled
    /// tokens counts as computed (the full blocks are registered: KV events), else the
    /// sequence prefills what it lacks itself (recompute). A sequence cancelled meanwhile has
    /// its blocks freed now. False if `seq` was not pulling.
    ///
    /// # Errors
    /// [`SchedulerError::Pool`] for a broken invariant between the core and its pool.
    pub fn pull_done(&mut self, seq: SeqId, ok: bool) -> Result<bool, SchedulerError> {
        if let Some(lease) = self.orphaned_pulls.remove(&seq) {
            self.pool.free(lease)?;
            return Ok(true);
        }
        let Some(e) = self.seqs.get_mut(&seq) else {
            return Ok(false);
        };
        let Remote::Pulling(n) = e.remote else {
            return Ok(false);
        };
        e.remote = Remote::None;
        if ok {
            e.num_computed = n;
            self.pool.mark_computed(seq, n)?;
        }
        Ok(true)
    }

    /// Lower-tier copies returned (see `kv/tiers.rs`): each sequence whose onboard finished
    /// counts the leading blocks that arrived intact as computed (registered: KV events) and
    /// prefills the rest; one cancelled meanwhile has its blocks freed now.
    ///
    /// # Errors
    /// [`SchedulerError::Pool`] for a broken invariant between the core and its pool.
    pub fn copies_done(
        &mut self,
        results: &[(crate::kv::CopyId, crate::kv::CopyOutcome)],
    ) -> Result<(), SchedulerError> {
        for (seq, computed) in self.pool.copies_done(results) {
            if let Some(lease) = self.orphaned_pulls.remove(&seq) {
                self.pool.free(lease)?;
                continue;
            }
            let Some(e) = self.seqs.get_mut(&seq) else {
                continue;
            };
            if !matches!(e.remote, Remote::Onboarding(_)) {
                continue;
            }
            e.remote = Remote::None;
            e.num_computed = e.num_computed.max(computed);
            e.report_cached = true;
            let n = e.num_computed;
            self.pool.mark_computed(seq, n)?;
        }
        Ok(())
    }

    /// Sequences handed off whose blocks are still pinned.
    pub fn num_held(&self) -> usize {
        self.held.len()
    }

    /// Pulls and lower-tier onboards in flight (cancelled ones included).
    pub fn num_pulling(&self) -> usize {
        self.orphaned_pulls.len() + self.seqs.values().filter(|e| e.remote.in_flight()).count()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Tokens still to prefill: whole waiting prompts (cache ignored) + unfinished chunks.
    pub fn queued_prefill_tokens(&self) -> usize {
        self.seqs
            .values()
            .map(|e| match e.remote {
                Remote::Expected(n) | Remote::Pulling(n) | Remote::Onboarding(n) => {
                    e.prefill_len.saturating_sub(n)
                }
                Remote::None => e.prefill_len.saturating_sub(e.num_computed),
            })
            .sum()
    }

    /// True while any sequence is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    pub fn step_in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    pub fn kv_usage(&self) -> PoolUsage {
        self.pool.usage()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The pool, for holders of blocks outside the batch former (chaos `fill_kv`): they
    /// allocate under sequence ids the core never uses (it numbers its own from the
    /// requests it is given) and free what they allocated.
    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    pub fn drain_kv_events(&mut self) -> Vec<KvEvent> {
        self.pool.drain_events()
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Grows `s`'s table to `slots`, preempting the newest running sequences as needed.
    /// Returns false when `s` itself had to be preempted.
    fn reserve_or_preempt(&mut self, s: SeqId, slots: usize) -> Result<bool, SchedulerError> {
        loop {
            match self.pool.reserve(s, slots) {
                Ok(()) => return Ok(true),
                Err(PoolError::OutOfBlocks { .. }) => {
                    // Never a sequence whose pull is in flight: the pull writes its blocks.
                    let seqs = &self.seqs;
                    let Some(&victim) = self
                        .running
                        .iter()
                        .rev()
                        .find(|r| seqs.get(r).is_some_and(|e| !e.remote.in_flight()))
                    else {
                        return Ok(false);
                    };
                    self.preempt(victim)?;
                    if victim == s {
                        return Ok(false);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Frees a running sequence's blocks; it goes back to the front of the waiting queue with
    /// prompt + generated tokens as its new prompt (recompute).
    fn preempt(&mut self, s: SeqId) -> Result<(), SchedulerError> {
        self.running.retain(|&r| r != s);
        let e = self.seqs.get_mut(&s).ok_or(PoolError::UnknownSequence(s))?;
        e.num_computed = 0;
        e.prefill_len = e.tokens.len();
        let lease = e.lease.take();
        self.waiting.push_resume(s);
        self.preempted.push(s);
        if let Some(l) = lease {
            self.pool.free(l)?;
        }
        Ok(())
    }

    /// Forgets a sequence, freeing its blocks.
    fn remove(&mut self, s: SeqId) -> Result<(), SchedulerError> {
        self.running.retain(|&r| r != s);
        if let Some(e) = self.seqs.remove(&s)
            && let Some(l) = e.lease
        {
            self.pool.free(l)?;
        }
        Ok(())
    }

    /// Builds the entry for the next `len` tokens of `s` and advances its computed count.
    fn entry(&mut self, s: SeqId, len: usize, cached_tokens: Option<usize>) -> ScheduledSeq {
        let bs = self.pool.block_size();
        let Some(e) = self.seqs.get_mut(&s) else {
            return ScheduledSeq {
                seq: s,
                token_ids: Vec::new(),
                start_pos: 0,
                block_table: Vec::new(),
                sample: false,
                cached_tokens,
                next_token: None,
            };
        };
        let start = e.num_computed;
        let end = start + len;
        e.num_computed = end;
        let table = self.pool.block_table(s).unwrap_or_default();
        ScheduledSeq {
            seq: s,
            token_ids: e.tokens[start..end].to_vec(),
            start_pos: start,
            block_table: table[..end.div_ceil(bs).min(table.len())].to_vec(),
            sample: end == e.tokens.len(),
            cached_tokens,
            next_token: e.tokens.get(end).copied(),
        }
    }
}
