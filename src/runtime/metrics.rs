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

/// Finer buckets (seconds) of the migration resume gap, whose target is p99 < 1 s, up to
/// `gateway.migration_deadline_ms`'s default (30 s) and past it: under frequent faults a gap
/// spans several, and its p99 must land in a bucket, not past the last one.
pub const RESUME_GAP_BUCKETS_S: &[f64] = &[
    0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
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

/// HELP of every metric this process records: what one increment is (its basis: per request,
/// per choice, per token, per attempt, per event, per block) and its unit. Counters meant to be
/// divided by each other have the same basis (`flotilla_prefix_hit_tokens_total` /
/// `flotilla_prompt_tokens_total`: both per `ok` request, the cached tokens never more than the
/// prompt; `flotilla_router_overlap_blocks_total` / `flotilla_router_prompt_blocks_total`:
/// both per placement). The gateway's per-worker families (`flotilla_worker_*`) are written
/// by hand in `actors/gateway/routes.rs`. The list in `docs/metrics.md` follows this one.
fn describe() {
    let window_s = crate::runtime::signals::RATE_WINDOW.as_secs();
    let every_s = crate::runtime::signals::RATE_SAMPLE_EVERY.as_secs();
    metrics::describe_gauge!(
        "flotilla_request_rate",
        format!(
            "Requests (choices) this gateway completed, successfully or not, per second over the \
             last {window_s} s, from its cumulative count sampled every {every_s} s (the planner's \
             `completed` signal)"
        )
    );
    metrics::describe_gauge!(
        "flotilla_output_token_rate",
        format!(
            "Output tokens of the requests (choices) this gateway completed, per second over the \
             last {window_s} s, from its cumulative count sampled every {every_s} s"
        )
    );
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    const COUNTERS: &[(&str, &str)] = &[
        // The gateway's requests and tokens (`actors/gateway/serve.rs`).
        (
            "flotilla_requests_total",
            "Generation requests (POST /v1/completions, /v1/chat/completions), per request \
             (one per HTTP request whatever n), by route, outcome (ok; error: failed after a worker admitted it; \
             cancelled: its client went away; rejected: refused before any worker saw it) and \
             the HTTP status it got (a stream's is 200 whatever its outcome; 499: a cancelled \
             request that got no response)",
        ),
        (
            "flotilla_prompt_tokens_total",
            "Prompt tokens of ok requests, per request (counted once whatever n): the sum of the \
             usage.prompt_tokens the API returned",
        ),
        (
            "flotilla_completion_tokens_total",
            "Generated tokens of ok requests, per request (summed over its choices; end-of-sequence \
             and stop-string tokens included): the sum of the usage.completion_tokens the \
             API returned",
        ),
        (
            "flotilla_prefix_hit_tokens_total",
            "Prompt tokens of ok requests served from a worker's prefix cache, per request (the \
             first choice's admission, never more than its prompt tokens, so that this over \
             flotilla_prompt_tokens_total is at most 1): the sum of the usage cached_tokens the \
             API returned; label worker: the worker that admitted the first choice",
        ),
        (
            "flotilla_shed_total",
            "Requests refused by admission control (503, also in flotilla_requests_total as \
             rejected), per request, by reason",
        ),
        (
            "flotilla_class_requests_total",
            "Requests per priority class (priority.classes), per request, by outcome as in \
             flotilla_requests_total (refusals before a worker saw it excluded)",
        ),
        (
            "flotilla_class_prompt_tokens_total",
            "usage.prompt_tokens of ok requests, per priority class",
        ),
        (
            "flotilla_class_completion_tokens_total",
            "usage.completion_tokens of ok requests, per priority class",
        ),
        (
            "flotilla_class_shed_total",
            "Requests of a priority class refused by admission control (429 when only its \
             class was refused, 503 otherwise; also in flotilla_shed_total), per request",
        ),
        (
            "flotilla_http_body_timeouts_total",
            "Requests whose body did not arrive within gateway.request_body_timeout_ms (408), per \
             request",
        ),
        (
            "flotilla_http_connections_refused_total",
            "TCP connections closed at once because gateway.max_connections were open, per \
             connection",
        ),
        (
            "flotilla_token_events_dropped_total",
            "Token events dropped on arrival at this gateway (meant for an earlier incarnation), \
             per token event",
        ),
        // Requests on the move (`request_plane/request.rs`).
        (
            "flotilla_route_retries_total",
            "Placements routed again because the chosen worker had just left, per attempt",
        ),
        (
            "flotilla_migrations_total",
            "Choices moved to another worker mid-generation (worker lost, stalled or events \
             lost), per migration (one choice can migrate more than once)",
        ),
        (
            "flotilla_migration_failures_total",
            "Migrations given up (no worker within the migration budget; the choice failed), \
             per choice",
        ),
        // The router (`actors/router.rs`).
        (
            "flotilla_router_placements_total",
            "Placements decided by this router, per attempt (a choice's first placement, and \
             again after a migration or hand-off), by worker, policy and hand_off",
        ),
        (
            "flotilla_router_prompt_blocks_total",
            "KV blocks of the placed prompts, per placement (the denominator of \
             flotilla_router_overlap_blocks_total)",
        ),
        (
            "flotilla_router_overlap_blocks_total",
            "KV blocks of the placed prompts already cached on the chosen worker as the router's \
             index saw them, per placement (at most flotilla_router_prompt_blocks_total)",
        ),
        (
            "flotilla_router_fetch_hints_total",
            "Placements that told the worker to pull a prefix from a peer, per placement",
        ),
        (
            "flotilla_router_local_prefills_total",
            "Placements meant for disaggregation kept on the decode worker, per placement, by why",
        ),
        (
            "flotilla_router_kv_events_total",
            "KV cache events received by the router, per event, by outcome (applied; held: \
             buffered or ignored)",
        ),
        (
            "flotilla_router_resyncs_total",
            "Snapshots asked for after an inconsistent KV event stream, per resync",
        ),
        (
            "flotilla_router_peer_sync_failures_total",
            "Load changes not sent to a peer router, per send",
        ),
        // Workers run in this process (`worker/scheduler/worker_core.rs`, tiers, transport).
        (
            "flotilla_kv_peer_pulls_total",
            "Peer prefix pulls, per request attempt, by worker and outcome (asked, declined, \
             pulled, failed, moot)",
        ),
        (
            "flotilla_kv_peer_pull_blocks_total",
            "KV blocks pulled from peers, per block, by worker",
        ),
        (
            "flotilla_kv_peer_exports_total",
            "Prefixes held for a peer to pull, per request, by worker",
        ),
        (
            "flotilla_disagg_hand_offs_total",
            "Prompts a prefill worker computed and handed to a decode worker, per attempt, by \
             worker",
        ),
        (
            "flotilla_disagg_pulled_blocks_total",
            "KV blocks a decode worker pulled from a prefill worker, per block, by worker",
        ),
        (
            "flotilla_disagg_pull_fallbacks_total",
            "Hand-off pulls that failed (the decode worker recomputed the prompt), per attempt, \
             by worker",
        ),
        (
            "flotilla_disagg_holds_expired_total",
            "Handed-off sequences released unconfirmed after disagg.hold_ms, per sequence",
        ),
        (
            "flotilla_orphaned_sequences_aborted_total",
            "Sequences aborted because their gateway was gone, per sequence",
        ),
        (
            "flotilla_engine_hangs_total",
            "Engine steps the watchdog found hung (the replica restarts), per hang, by worker",
        ),
        (
            "flotilla_scheduler_stall_capped_steps_total",
            "Engine steps whose prefill the decode-stall limit shortened (stall-free batching), \
             per step, by worker",
        ),
        (
            "flotilla_kv_tier_off_total",
            "Lower KV tiers switched off (no copies offered, or the disk failed), per event, by \
             tier",
        ),
        (
            "flotilla_kv_tier_corrupt_blocks_total",
            "Lower-tier KV blocks refused on read (header or checksum), per block, by tier",
        ),
        (
            "flotilla_kv_transfer_bytes_total",
            "Bytes of KV moved between workers, by backend",
        ),
        (
            "flotilla_kv_transfer_failures_total",
            "KV transfers (pulls) that failed, per transfer",
        ),
        (
            "flotilla_kv_zmq_send_errors_total",
            "KV events not published on the ZMQ socket, per message",
        ),
        (
            "flotilla_kv_zmq_untranslatable_total",
            "KV events with no vLLM form, not published on the ZMQ socket, per event",
        ),
        (
            "flotilla_external_kv_gaps_total",
            "Gaps in an external engine's KV event sequence numbers, per gap, by worker",
        ),
        (
            "flotilla_external_kv_events_dropped_total",
            "External engine KV events that could not be translated, per event, by worker",
        ),
        // The node (`runtime/`, `supervisors/`, `actors/discovery.rs`).
        (
            "flotilla_supervisor_restarts_total",
            "Children restarted by a supervisor, per restart",
        ),
        (
            "flotilla_actor_failures_total",
            "Abnormal child exits seen by supervisors, per exit",
        ),
        (
            "flotilla_supervisor_escalations_total",
            "Supervisors that exceeded their restart budget, per escalation",
        ),
        (
            "flotilla_panics_total",
            "Panics caught on this node, per panic",
        ),
        (
            "flotilla_wire_decode_errors_total",
            "Malformed cluster payloads dropped, per payload, by type",
        ),
        (
            "flotilla_membership_events_total",
            "Membership changes seen by discovery, per change, by kind",
        ),
    ];
    const HISTOGRAMS: &[(&str, &str)] = &[
        (
            "flotilla_ttft_seconds",
            "Time to first token in seconds, request received to the choice's first token, per \
             choice",
        ),
        (
            "flotilla_class_ttft_seconds",
            "Time to first token in seconds per priority class, as flotilla_ttft_seconds, per \
             choice",
        ),
        (
            "flotilla_itl_seconds",
            "Inter-token latency in seconds, per token after a choice's first (a migration's \
             resume gap included)",
        ),
        (
            "flotilla_e2e_latency_seconds",
            "Request received to its end in seconds, per request a worker admitted (ok, error \
             or cancelled)",
        ),
        (
            "flotilla_cold_start_wait_seconds",
            "Seconds a request waited for a worker to come up (a pool scaled to zero), per \
             request that got one",
        ),
        (
            "flotilla_migration_resume_gap_seconds",
            "Seconds from the last token before a migration to the first after it, per \
             migration that resumed",
        ),
        (
            "flotilla_kv_transfer_seconds",
            "Seconds one KV transfer (pull) took, per transfer that succeeded",
        ),
        (
            "flotilla_scheduler_step_duration_seconds",
            "Engine step time in seconds as the scheduler timed it (injected chaos delays \
             excluded), per step, by worker",
        ),
    ];
    const GAUGES: &[(&str, &str)] = &[
        ("flotilla_cluster_nodes", "Nodes this node knows, by state"),
        (
            "flotilla_requests_in_flight",
            "Choices in flight on this gateway (a request with n choices counts n)",
        ),
        (
            "flotilla_http_connections_open",
            "HTTP connections open on this gateway",
        ),
        (
            "flotilla_router_index_blocks",
            "KV blocks (worker, block) the router's index holds",
        ),
        (
            "flotilla_planner_desired_replicas",
            "The planner's desired replicas, per pool",
        ),
        (
            "flotilla_planner_actual_replicas",
            "Replicas the planner counted (ready and starting), per pool",
        ),
        (
            "flotilla_planner_leader",
            "1 while this node's planner leads, else 0",
        ),
        ("flotilla_planner_term", "The leading planner's term"),
        (
            "flotilla_scheduler_step_model_ms",
            "Step-time model in ms: per step (term=base), per token (per_token), per 1000 \
             attention pairs (per_kpair), by worker",
        ),
        (
            "flotilla_scheduler_prefill_cap_tokens",
            "Prefill tokens of the last step the decode-stall limit shortened, by worker",
        ),
    ];
    for (name, help) in COUNTERS {
        describe_counter!(*name, *help);
    }
    for (name, help) in HISTOGRAMS {
        describe_histogram!(*name, *help);
    }
    for (name, help) in GAUGES {
        describe_gauge!(*name, *help);
    }
}
