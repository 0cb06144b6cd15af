//! Two sections the replicas' schedulers read: `[scheduler]` (batch forming beyond
//! `worker`'s limits) and `[disagg]` (disaggregated prefill and decode: when a router sends a
//! prompt to a prefill worker first — [`DisaggRouting`] — and how long its KV waits there —
//! [`DisaggWorker`]). Read through the composition root and by `flotilla sim`.

use crate::request_plane::router::core::DisaggRouting;
use crate::runtime::config::ConfigError;
use crate::worker::scheduler::DisaggWorker;
use serde::{Deserialize, Serialize};

/// Batch forming on each replica (the batch limits themselves are in `worker`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerSection {
    /// Stall-free batching (Sarathi-Serve, Agrawal et al., OSDI 2024): a step that carries
    /// decode rows takes prefill tokens only while its predicted time, from a step-time model
    /// the scheduler fits to its own measured steps, stays within this (ms), so that a
    /// newcomer's prefill delays running streams by at most about this much per token; at
    /// least one KV block of prefill still runs per step. Steps without decodes use the whole
    /// `worker.max_num_batched_tokens` budget, as does every step until the model has samples
    /// enough, and so does a migrated stream's recompute (its client is already waiting longer
    /// than this). 0 = off (the token budget alone). Default 200, chosen by a sweep on the
    /// project's 2-core VM (`docs/benchmarks.md`, "Stall-free batching"): about 4× the
    /// decode-only step there (45–50 ms at 4 streams); 100 ms left room for no more than the
    /// one-block minimum beside the decodes (ITL p50 tripled, throughput −38 %), while 200 ms
    /// cut the ITL p99 about 3× for about a fifth of the throughput, and 300 ms only 2×.
    pub max_decode_stall_ms: u64,
    /// A worker that is idle when a migrated request arrives waits this long (ms) before its
    /// next step, so that the other requests of the lost worker, which arrive together, run
    /// in that step instead of behind a step of the first one alone. Only migrated requests
    /// wait (a new request or a disaggregated decode starts at once). Default 5: a lost
    /// worker's 16 requests reached their new worker within 0.3–0.6 ms on the project's
    /// 2-core VM, under two CPU hogs; without it the first of them ran alone in a step of
    /// 0.3–0.6 s that every other one waited for (`docs/benchmarks.md`, "Recovery under
    /// contention"). 0 = off.
    pub resume_gather_ms: u64,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        Self {
            max_decode_stall_ms: 200,
            resume_gather_ms: 5,
        }
    }
}

/// Disaggregated prefill and decode: when a request goes to a prefill worker first, and how
/// long its KV waits there.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggConfig {
    /// A request placed on a decode worker is prefilled remotely when the part of its prompt
    /// that worker does not hold is at least this long (tokens); shorter ones prefill there
    /// (Dynamo's conditional disaggregation, its `max_local_prefill_length`). 0 = never remote.
    /// Default 512: on the project's 2-core VM a 512-token prefill takes about 1.4 s on the
    /// CPU engine, the cost a running decode stream is spared.
    pub min_prefill_tokens: u32,
    /// … and only while the chosen prefill worker has at most this many prompt tokens queued
    /// for prefill (the router's active load); above it the decode worker prefills itself.
    pub max_prefill_queue_tokens: u64,
    /// A prefill worker keeps handed-off blocks pinned this long at most without the decode
    /// worker's confirmation (ms).
    pub hold_ms: u64,
    /// A decode worker's pull gives up after this long and recomputes the prompt (ms).
    pub transfer_timeout_ms: u64,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            min_prefill_tokens: DisaggRouting::DEFAULT_MIN_PREFILL_TOKENS,
            max_prefill_queue_tokens: DisaggRouting::DEFAULT_MAX_PREFILL_QUEUE_TOKENS,
            hold_ms: DisaggWorker::DEFAULT_HOLD_MS,
            transfer_timeout_ms: DisaggWorker::DEFAULT_TRANSFER_TIMEOUT_MS,
        }
    }
}

impl DisaggConfig {
    /// Check that a pull has a deadline and ends before the hold.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `disagg.transfer_timeout_ms` or `disagg.hold_ms`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.transfer_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "disagg.transfer_timeout_ms",
                "must be at least 1",
            ));
        }
        if self.hold_ms <= self.transfer_timeout_ms {
            return Err(ConfigError::invalid(
                "disagg.hold_ms",
                format!(
                    "must exceed disagg.transfer_timeout_ms ({} <= {}): a pull must end before the hold",
                    self.hold_ms, self.transfer_timeout_ms
                ),
            ));
        }
        Ok(())
    }
}

impl From<&DisaggConfig> for DisaggRouting {
    fn from(c: &DisaggConfig) -> Self {
        Self {
            min_prefill_tokens: c.min_prefill_tokens,
            max_prefill_queue_tokens: c.max_prefill_queue_tokens,
        }
    }
}

impl From<&DisaggConfig> for DisaggWorker {
    fn from(c: &DisaggConfig) -> Self {
        DisaggWorker::new(c.hold_ms, c.transfer_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decode_stall_limit_defaults_on_and_zero_turns_it_off() {
        assert_eq!(SchedulerSection::default().max_decode_stall_ms, 200);
        let s: SchedulerSection =
            serde_json::from_value(serde_json::json!({"max_decode_stall_ms": 0})).unwrap();
        assert_eq!(s.max_decode_stall_ms, 0);
        assert_eq!(s.resume_gather_ms, 5, "the other field keeps its default");
    }

    #[test]
    fn a_pull_must_end_before_the_hold() {
        DisaggConfig::default().validate().unwrap();
        let d = DisaggConfig {
            hold_ms: 1_000,
            transfer_timeout_ms: 1_000,
            ..Default::default()
        };
        let err = d.validate().unwrap_err();
        assert_eq!(err.field(), Some("disagg.hold_ms"), "{err}");
    }
}
