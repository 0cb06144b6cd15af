//! Process-wide Prometheus recorder (`metrics` facade + `metrics-exporter-prometheus`).
//!
//! Installed once per process; `/metrics` renders it. Metric names carry units
//! (`_seconds`, `_total`, `_bytes`).

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Bucket bounds (seconds) of every `*_seconds` histogram: 5 ms to 600 s (`flotilla bench`'s
/// default request timeout), roughly ×2: a long generation's TTFT and end-to-end latency fall in a
/// bucket, not past the last one (where every percentile a client extrapolates is wrong).
pub const LATENCY_BUCKETS_S: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Finer buckets (seconds) of the migration resume gap, whose target is p99 < 1 s.
pub const RESUME_GAP_BUCKETS_S: &[f64] = &[
    0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0,
    10.0,
];

/// The process's recorder, installed on first use.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            // Latency histograms get real buckets (the exporter's default is a summary).
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Full(
                        "flotilla_migration_resume_gap_seconds".into(),
                    ),
                    RESUME_GAP_BUCKETS_S,
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                        LATENCY_BUCKETS_S,
                    )
                })
                .unwrap_or_else(|_| PrometheusBuilder::new());
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (a test harness): keep ours for
            // rendering anyway, and say so.
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            describe();
            handle
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge};
    describe_counter!(
        "flotilla_supervisor_restarts_total",
        "Children restarted by a supervisor"
    );
    describe_counter!(
        "flotilla_actor_failures_total",
        "Abnormal child exits seen by supervisors"
    );
    describe_counter!(
        "flotilla_supervisor_escalations_total",
        "Supervisors that exceeded their restart budget"
    );
    describe_counter!(
        "flotilla_wire_decode_errors_total",
        "Malformed cluster payloads dropped"
    );
    describe_counter!(
        "flotilla_membership_events_total",
        "Membership changes seen by discovery"
    );
    describe_gauge!("flotilla_cluster_nodes", "Known nodes by state");
    use metrics::describe_histogram;
    describe_histogram!(
        "flotilla_ttft_seconds",
        "Time to first token, request received → first token"
    );
    describe_histogram!(
        "flotilla_itl_seconds",
        "Inter-token latency within one choice"
    );
    describe_histogram!(
        "flotilla_e2e_latency_seconds",
        "Request received → last token"
    );
    describe_histogram!(
        "flotilla_cold_start_wait_seconds",
        "Time a request waited for a worker to come up (a pool scaled to zero)"
    );
    describe_gauge!(
        "flotilla_planner_desired_replicas",
        "The planner's desired replicas, per pool"
    );
    describe_gauge!(
        "flotilla_planner_actual_replicas",
        "Replicas the planner counted (ready and starting), per pool"
    );
    describe_counter!(
        "flotilla_requests_total",
        "Requests by route and outcome (ok, error, rejected)"
    );
    describe_counter!(
        "flotilla_prompt_tokens_total",
        "Prompt tokens of finished requests"
    );
    describe_counter!(
        "flotilla_completion_tokens_total",
        "Generated tokens of finished requests"
    );
    describe_counter!(
        "flotilla_prefix_hit_tokens_total",
        "Prompt tokens served from a worker's prefix cache"
    );
    describe_gauge!(
        "flotilla_requests_in_flight",
        "Choices in flight on this gateway"
    );
    let window_s = crate::runtime::signals::RATE_WINDOW.as_secs();
    let every_s = crate::runtime::signals::RATE_SAMPLE_EVERY.as_secs();
    describe_gauge!(
        "flotilla_request_rate",
        format!(
            "Requests (choices) this gateway completed, successfully or not, per second over the \
             last {window_s} s, from its cumulative count sampled every {every_s} s (the planner's \
             `completed` signal)"
        )
    );
    describe_gauge!(
        "flotilla_output_token_rate",
        format!(
            "Output tokens of the requests (choices) this gateway completed, per second over the \
             last {window_s} s, from its cumulative count sampled every {every_s} s"
        )
    );
    describe_histogram!(
        "flotilla_scheduler_step_duration_seconds",
        "Engine steps as the scheduler timed them (injected chaos delays excluded), per worker"
    );
    describe_gauge!(
        "flotilla_scheduler_step_model_ms",
        "Step-time model: ms per step (term=base), per token (per_token), per 1000 attention pairs (per_kpair)"
    );
    describe_counter!(
        "flotilla_scheduler_stall_capped_steps_total",
        "Steps whose prefill the decode-stall limit shortened (stall-free batching), per worker"
    );
    describe_gauge!(
        "flotilla_scheduler_prefill_cap_tokens",
        "Prefill tokens of the last step the decode-stall limit shortened, per worker"
    );
}
