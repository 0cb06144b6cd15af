//! [`Sequence`]: everything a [`WorkerCore`](super::WorkerCore) keeps about one sequence, in
//! one record with an explicit [`SeqState`].
//!
//! The batch former ([`SchedulerCore`](super::SchedulerCore)) owns a sequence's tokens and
//! blocks; this record owns the rest — whom it answers to, what it has emitted, its log
//! identity and span, and where it stands. A finished or dropped sequence leaves the map (its
//! last line is logged as it goes); pulls in flight outlive it in [`super::pull::Pulls`],
//! since the transport still writes their blocks.

use crate::request_plane::protocol::{Owner, RemoteKv};
use crate::runtime::clock::Instant;
use crate::runtime::ids::{RequestId, WorkerId};
use crate::worker::engine::SamplingParams;

use super::{RequestKey, SEQUENCE_TARGET};

/// Where a sequence stands on this replica.
#[derive(Debug)]
pub(super) enum SeqState {
    /// Queued with the batch former, not admitted yet.
    Waiting {
        /// KV to pull once admitted: the prefill worker's (disaggregated decode) or a
        /// peer's (peer pull).
        remote: Option<Box<RemoteKv>>,
        /// Peer pull: the holder that pinned the prefix for this request, and the key it
        /// pinned it under — confirmed (unpinned) by the pull, or at once when the pull
        /// turns out moot or the sequence is dropped first.
        peer: Option<(WorkerId, RequestKey)>,
    },
    /// Admitted; its KV is being pulled ([`super::pull::Pulls`] holds the pull).
    Pulling {
        /// Peer pull: `(tokens cached here, tokens once the pull lands)`. Its `Admitted`
        /// waits for the pull, so that pulled tokens count as cached and a failed pull's
        /// recomputed ones do not.
        admit: Option<(usize, usize)>,
    },
    /// Admitted; its prompt is being computed (chunk by chunk, or what a pull lacked).
    Prefilling,
    /// Its first token is out.
    Decoding,
    /// Disaggregated prefill: its first token went out and its KV stays pinned here for the
    /// decode worker's pull until the decode worker confirms or `until`.
    HandedOff { until: Instant },
}

/// One sequence on this replica (see the module doc).
pub(super) struct Sequence {
    pub request: RequestId,
    pub owner: Owner,
    pub sampling: SamplingParams,
    /// Tokens emitted so far (the next token's index).
    pub emitted: u32,
    /// `SubmitRequest::trace_id` (the gateway's `x-request-id`).
    pub trace_id: Option<String>,
    /// The `sequence` span, a child of the gateway's `request` span
    /// (`SubmitRequest::traceparent`) when an OTLP export runs; `Span::none()` otherwise.
    /// It ends when the sequence leaves this worker (finished, dropped, handed off).
    pub span: tracing::Span,
    /// When it was queued here (its wait for admission counts from this).
    pub queued_at: Instant,
    /// Its prompt's length (tokens).
    pub prompt_tokens: u32,
    pub state: SeqState,
}

impl Sequence {
    /// Its key at this worker.
    pub fn key(&self) -> RequestKey {
        (self.owner.node.clone(), self.request)
    }

    /// Admitted (pulling, prefilling, decoding) or handed off.
    pub fn admitted(&self) -> bool {
        !matches!(self.state, SeqState::Waiting { .. })
    }

    /// It runs (or waits to run) here: not handed off.
    pub fn active(&self) -> bool {
        !matches!(self.state, SeqState::HandedOff { .. })
    }
}

/// The `sequence` span of a submission that carries a `traceparent` (an OTLP export runs on
/// its gateway): a child of the gateway's `request` span, under [`SEQUENCE_TARGET`]. Without
/// one, no span (the lines carry `request_id` themselves).
pub(super) fn sequence_span(
    worker: &WorkerId,
    trace_id: &Option<String>,
    traceparent: Option<&str>,
) -> tracing::Span {
    let Some(tp) = traceparent else {
        return tracing::Span::none();
    };
    let span = tracing::info_span!(target: SEQUENCE_TARGET, "sequence", %worker, request_id = %trace_id.as_deref().unwrap_or("-"));
    crate::runtime::otlp::adopt_remote_parent(&span, Some(tp));
    span
}
