//! OpenTelemetry export (`--otlp-endpoint`): a `flotilla up --engine sim --nodes 2` cluster
//! given the address of an OTLP/HTTP receiver in this test (`POST /v1/traces`, protobuf
//! bodies decoded with `opentelemetry-proto`) serves a request with `x-request-id: otlp-1`;
//! the batch delay is set far beyond the test, so the spans only arrive through the flush of
//! a clean stop (SIGTERM to `up`, each node drains and stops): the gateway's `request` span
//! with `request_id = otlp-1`, under resource `service.name = flotilla` and the node's name,
//! and in the same trace, its children on the other actors and nodes: the router's `route`
//! span and the worker's `sequence` span.
#![cfg(feature = "otlp")]

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::MODEL;
use crate::poll::poll_until;
use crate::process::Cluster;
use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The export requests received so far.
type Received = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

/// An OTLP/HTTP traces receiver on a loopback port: its base URL and what it received.
async fn receiver() -> (String, Received) {
    let got = Received::default();
    let store = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let store = store.clone();
            async move {
                match ExportTraceServiceRequest::decode(body) {
                    Ok(r) => {
                        store.lock().unwrap().push(r);
                        // An empty ExportTraceServiceResponse.
                        (axum::http::StatusCode::OK, Vec::new())
                    }
                    Err(e) => (axum::http::StatusCode::BAD_REQUEST, e.to_string().into()),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), got)
}

/// The string value of attribute `key`.
fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a str> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .and_then(|v| match v {
            any_value::Value::StringValue(s) => Some(s.as_str()),
            _ => None,
        })
}

/// Every span received, with its resource's attributes.
fn spans(got: &Received) -> Vec<(Vec<KeyValue>, Span)> {
    let got = got.lock().unwrap();
    let mut out = Vec::new();
    for req in got.iter() {
        for rs in &req.resource_spans {
            let resource = rs
                .resource
                .as_ref()
                .map(|r| r.attributes.clone())
                .unwrap_or_default();
            for ss in &rs.scope_spans {
                for span in &ss.spans {
                    out.push((resource.clone(), span.clone()));
                }
            }
        }
    }
    out
}

/// The spans named `name` with `request_id = id`.
fn named(got: &Received, name: &str, id: &str) -> Vec<(Vec<KeyValue>, Span)> {
    spans(got)
        .into_iter()
        .filter(|(_, s)| s.name == name && attr(&s.attributes, "request_id") == Some(id))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_span_reaches_an_otlp_collector_when_the_cluster_stops() {
    let (endpoint, got) = receiver().await;
    let (mut cluster, _logs) = Cluster::start_logged(
        2,
        &["--engine", "sim", "--otlp-endpoint", &endpoint],
        &[],
        // No scheduled export within the test: what arrives is the stop's flush.
        &[("OTEL_BSP_SCHEDULE_DELAY", "600000")],
    );
    http::wait_routable(&cluster, 1).await;
    let r = reqwest::Client::new()
        .post(cluster.url("/v1/completions"))
        .header("x-request-id", "otlp-1")
        .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.text().await;
    assert!(
        named(&got, "request", "otlp-1").is_empty(),
        "nothing is exported before the batch delay or the stop"
    );

    // A clean stop: SIGTERM to `up`; every node drains, stops and sends its queued spans.
    let pid = nix::unistd::Pid::from_raw(cluster.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = poll_until(Duration::from_secs(60), "flotilla up stopped", || {
        let s = cluster.child.try_wait().unwrap();
        async move { s }
    })
    .await;
    assert!(status.success(), "up exited with {status}");
    // Reaped: the drop would signal a pid that is no longer ours.
    std::mem::forget(cluster);

    let found = named(&got, "request", "otlp-1");
    assert_eq!(found.len(), 1, "one `request` span for otlp-1");
    let (resource, request) = &found[0];
    assert_eq!(attr(resource, "service.name"), Some("flotilla"));
    assert_eq!(
        attr(resource, "flotilla.node"),
        Some("node-0"),
        "the gateway node's span: {resource:?}"
    );

    // One trace across nodes: the router's `route` span (node 0, another actor) and the
    // worker's `sequence` span (node 1, another process) are children of the gateway's
    // `request` span, through the `traceparent` the request plane's messages carry.
    for (name, node) in [("route", "node-0"), ("sequence", "node-1")] {
        let found = named(&got, name, "otlp-1");
        assert_eq!(found.len(), 1, "one `{name}` span for otlp-1");
        let (resource, span) = &found[0];
        assert_eq!(
            attr(resource, "flotilla.node"),
            Some(node),
            "{name}: {resource:?}"
        );
        assert_eq!(
            span.trace_id, request.trace_id,
            "{name} is in the request's trace"
        );
        assert_eq!(
            span.parent_span_id, request.span_id,
            "{name}'s parent is the gateway's request span"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_not_there_is_said_once_and_serving_goes_on() {
    // A port nobody listens on: every export fails (connection refused).
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let (cluster, logs) = Cluster::start_logged(
        2,
        &["--engine", "sim", "--otlp-endpoint", &endpoint],
        &[],
        &[("OTEL_BSP_SCHEDULE_DELAY", "200")],
    );
    assert!(
        !logs.matching("exporting spans over OTLP/HTTP").is_empty(),
        "each node says where its spans go"
    );
    http::wait_routable(&cluster, 1).await;
    for i in 0..3 {
        let r = reqwest::Client::new()
            .post(cluster.url("/v1/completions"))
            .header("x-request-id", format!("lost-{i}"))
            .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "served without a collector");
        let _ = r.text().await;
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    poll_until(
        Duration::from_secs(20),
        "the failed export said",
        || async { (!logs.matching("OTLP export failed").is_empty()).then_some(()) },
    )
    .await;
    // Said once per node, not once per batch.
    let said = logs.matching("OTLP export failed");
    assert!(said.len() <= 2, "{said:#?}");
}
