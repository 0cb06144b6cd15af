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
