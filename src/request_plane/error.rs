//! [`RequestError`]: every way the request plane can refuse or fail a request, one closed type
//! with one mapping to an HTTP status and the OpenAI error body ([`ApiError`]).
//!
//! Between a worker and a gateway a failure travels as [`TokenEventKind::Failed`] (a message
//! and an HTTP status, the wire format); [`RequestError::from_failed`] and
//! [`RequestError::to_event`] convert, preserving both.

use super::migration::GiveUp;
use super::protocol::TokenEventKind;
use crate::openai::error::{ApiError, ErrorKind};
use crate::runtime::ids::WorkerId;

/// Seconds a client is asked to wait before retrying a 503.
pub const RETRY_AFTER_S: u64 = 1;

/// Why admission control refused a request before doing any work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShedReason {
    /// This node is draining.
    Draining,
    /// This gateway has `gateway.max_in_flight` requests in flight.
    GatewayQueue,
    /// Every live worker is busy (KV use or queue above the thresholds).
    AllWorkersBusy,
    /// Every worker's predicted wait before a new prefill starts exceeds the TTFT target
    /// (`gateway.ttft_target_ms`).
    TtftTarget {
        /// The least predicted wait over the workers (ms).
        predicted_ms: u64,
        /// The target (ms).
        target_ms: u64,
    },
    /// No worker served the model within `gateway.cold_start_timeout_ms` (a pool at zero
    /// whose replica did not come up in time).
    ColdStart {
        /// How long the request waited (ms).
        waited_ms: u64,
    },
    /// The request's priority class is past its share of the shedding thresholds while a
    /// higher class would still be admitted (`request_plane/priority.rs`): **429**.
    PriorityClass {
        /// The class's rank (0 = highest).
        rank: u16,
        /// Classes configured.
        classes: u16,
    },
}

impl ShedReason {
    /// Every label of `flotilla_shed_total` ([`ShedReason::as_str`]), for a gateway to
    /// register its series at zero before the first request is shed.
    pub const LABELS: [&'static str; 6] = [
        "draining",
        "gateway_queue",
        "all_workers_busy",
        "ttft_target",
        "cold_start",
        "priority_class",
    ];

    /// Label of `flotilla_shed_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::Draining => "draining",
            ShedReason::GatewayQueue => "gateway_queue",
            ShedReason::AllWorkersBusy => "all_workers_busy",
            ShedReason::TtftTarget { .. } => "ttft_target",
            ShedReason::ColdStart { .. } => "cold_start",
            ShedReason::PriorityClass { .. } => "priority_class",
        }
    }

    /// What the client is told.
    pub fn message(self) -> String {
        match self {
            ShedReason::Draining => "this gateway is draining; use another".into(),
            ShedReason::GatewayQueue => {
                "the gateway is at its in-flight limit; retry shortly".into()
            }
            ShedReason::AllWorkersBusy => "every worker is busy; retry shortly".into(),
            ShedReason::TtftTarget {
                predicted_ms,
                target_ms,
            } => format!(
                "every worker is predicted to start a new request's prefill in {predicted_ms} ms \
                 or later (its queued prompt tokens at its measured rate, or requests \
                 waiting that long already), past the \
                 time-to-first-token target of {target_ms} ms; retry after the queue drains"
            ),
            ShedReason::ColdStart { waited_ms } => format!(
                "no worker is serving the model: waited {waited_ms} ms for one to start \
                 (gateway.cold_start_timeout_ms); retry shortly"
            ),
            ShedReason::PriorityClass { rank, classes } => format!(
                "the fleet is past this request's priority class's share of the load (class \
                 {} of {classes}, highest first; lower classes are shed first, and a higher \
                 class is still admitted); retry shortly",
                rank + 1
            ),
        }
    }
}

/// A request the request plane could not serve.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Load shedding: refused before any work (503 with `Retry-After`; 429 when only the
    /// request's priority class is refused, [`ShedReason::PriorityClass`]).
    #[error("{}", .reason.message())]
    Overloaded {
        /// Why.
        reason: ShedReason,
        /// Seconds to wait before retrying.
        retry_after_s: u64,
    },
    /// This gateway has no model to serve.
    #[error("this gateway serves no model")]
    NoModel,
    /// The gateway's request supervisor is not running (restarting).
    #[error("the gateway is restarting")]
    GatewayRestarting,
    /// This node's Discovery publishes no fleet view (it is restarting).
    #[error("cluster membership is restarting")]
    MembershipUnavailable,
    /// No Router runs in the cluster.
    #[error("no router is available")]
    NoRouter,
    /// The Router did not answer in time.
    #[error("the router did not answer")]
    RouterTimeout,
    /// The Router's reply could not be decoded.
    #[error("the router sent a malformed reply")]
    RouterReply,
    /// No worker can take the request.
    #[error("no worker is available")]
    NoWorkers,
    /// The worker chosen for the request left before it got the request.
    #[error("the chosen worker {0} went away")]
    WorkerGone(WorkerId),
    /// The request was lost on its worker and was not (or could not be) resumed elsewhere.
    #[error("{0}")]
    Lost(String),
    /// A placement or a migration failed and the migration rule gave the request up.
    #[error("{cause}; {why}")]
    GaveUp {
        /// What went wrong last.
        cause: String,
        /// Why no further attempt is made.
        why: GiveUp,
    },
    /// The request's event stream closed before its end.
    #[error("the request ended unexpectedly")]
    EndedUnexpectedly,
    /// The gateway stopped while the request ran.
    #[error("the gateway is shutting down")]
    ShuttingDown,
    /// The Request actor could not be started.
    #[error("internal error starting the request")]
    StartFailed,
    /// A worker says the request can never be served (400), e.g. its context is too long.
    #[error("{0}")]
    Rejected(String),
    /// A worker says it cannot serve the request now (503).
    #[error("{0}")]
    Unavailable(String),
    /// A fault on the worker, e.g. the engine failed (500).
    #[error("{0}")]
    Internal(String),
}

impl RequestError {
    /// A failure as a worker reported it on the wire (`message`, `status`).
    pub fn from_failed(message: String, status: u16) -> Self {
        match status {
            400 => RequestError::Rejected(message),
            503 => RequestError::Unavailable(message),
            _ => RequestError::Internal(message),
        }
    }

    /// HTTP status for a client that has not received a byte yet.
    pub fn status(&self) -> u16 {
        match self {
            RequestError::Rejected(_) => 400,
            RequestError::Overloaded {
                reason: ShedReason::PriorityClass { .. },
                ..
            } => 429,
            RequestError::RouterReply | RequestError::StartFailed | RequestError::Internal(_) => {
                500
            }
            _ => 503,
        }
    }

    /// Whether trying again later may succeed (a 503): a failed placement that is retryable
    /// waits for a worker under the migration rule.
    pub fn is_retryable(&self) -> bool {
        self.status() == 503
    }

    /// Seconds the client should wait before retrying, when it should.
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            RequestError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
            // Answered without a delay hint, as the other membership routes are.
            RequestError::MembershipUnavailable => None,
            _ if self.is_retryable() => Some(RETRY_AFTER_S),
            _ => None,
        }
    }

    /// The wire event that carries this failure to the request's handler.
    pub fn to_event(&self) -> TokenEventKind {
        TokenEventKind::Failed {
            message: self.to_string(),
            status: self.status(),
        }
    }

    /// The OpenAI error class of this failure.
    pub fn kind(&self) -> ErrorKind {
        match self.status() {
            400 => ErrorKind::InvalidRequest,
            429 => ErrorKind::RateLimited,
            503 => ErrorKind::Unavailable,
            _ => ErrorKind::Internal,
        }
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let mut api = ApiError::new(e.kind(), e.to_string());
        api.retry_after_s = e.retry_after_s();
        api
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_every_reason() {
        let all = [
            ShedReason::Draining,
            ShedReason::GatewayQueue,
            ShedReason::AllWorkersBusy,
            ShedReason::TtftTarget {
                predicted_ms: 0,
                target_ms: 0,
            },
            ShedReason::ColdStart { waited_ms: 0 },
            ShedReason::PriorityClass {
                rank: 1,
                classes: 2,
            },
        ];
        assert_eq!(all.map(ShedReason::as_str), ShedReason::LABELS);
    }

    #[test]
    fn statuses_and_retry_after() {
        let shed = RequestError::Overloaded {
            reason: ShedReason::AllWorkersBusy,
            retry_after_s: 1,
        };
        assert_eq!(shed.status(), 503);
        assert_eq!(shed.to_string(), "every worker is busy; retry shortly");
        let api = ApiError::from(shed);
        assert_eq!(api.status().as_u16(), 503);
        assert_eq!(api.retry_after_s, Some(1));
        let bad = ApiError::from(RequestError::Rejected("prompt too long".into()));
        assert_eq!((bad.status().as_u16(), bad.retry_after_s), (400, None));
        let fault = ApiError::from(RequestError::RouterReply);
        assert_eq!((fault.status().as_u16(), fault.retry_after_s), (500, None));
        assert_eq!(
            ApiError::from(RequestError::NoWorkers).retry_after_s,
            Some(RETRY_AFTER_S)
        );
    }

    #[test]
    fn a_failure_survives_the_wire() {
        for e in [
            RequestError::Rejected("never fits".into()),
            RequestError::Internal("the engine failed".into()),
            RequestError::NoWorkers,
            RequestError::GaveUp {
                cause: "no worker is available".into(),
                why: GiveUp::FirstPlacement,
            },
        ] {
            let TokenEventKind::Failed { message, status } = e.to_event() else {
                panic!("not a failure");
            };
            let back = RequestError::from_failed(message.clone(), status);
            assert_eq!(back.status(), e.status());
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(message, e.to_string());
        }
    }
}
