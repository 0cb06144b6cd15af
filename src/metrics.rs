//! Process-wide Prometheus recorder (`metrics` facade + `metrics-exporter-prometheus`).
//!
//! Installed once per process; `/metrics` renders it. Metric names carry units
//! (`_seconds`, `_total`, `_bytes`).

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The process's recorder, installed on first use.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new();
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
}
