//! One request id leads through every node's logs: a request through a 3-node cluster
//! (gateway + router, two workers) and a request migrated off a killed replica each leave
//! lines carrying the client's `x-request-id` on every node they touched — the gateway's
//! access line (and, for the migrated one, its migration line), the router's `placed` line
//! for each placement, each worker's `sequence admitted` and the last worker's `sequence
//! finished` (JSON logs, `--log-format json`).

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::MODEL;
use crate::poll::poll_until;
use crate::process::{Cluster, Logs};
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::Duration;

/// The JSON log lines that carry `id` (a field, or the gateway's request span).
fn lines_of(logs: &Logs, id: &str) -> Vec<Value> {
    logs.all()
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["fields"]["request_id"] == id || v["span"]["request_id"] == id)
        .collect()
}

/// The node of a worker line (`worker` is `<node>/replica-<k>`).
fn node_of(line: &Value) -> Option<String> {
    line["fields"]["worker"]
        .as_str()
        .and_then(|w| w.split('/').next())
        .map(str::to_owned)
}

/// The workers' lines with `message` for `id`, by node.
fn worker_nodes(lines: &[Value], message: &str) -> Vec<String> {
    let mut nodes: Vec<String> = lines
        .iter()
        .filter(|v| v["fields"]["message"] == message)
        .filter_map(node_of)
        .collect();
    nodes.sort();
    nodes.dedup();
    nodes
}

/// The workers named by the router's `placed` lines, in order.
fn placed_workers(lines: &[Value]) -> Vec<String> {
    lines
        .iter()
        .filter(|v| v["target"] == "flotilla::placement" && v["fields"]["message"] == "placed")
        .filter_map(|v| v["fields"]["worker"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_leads_through_every_node_it_touched() {
    let (cluster, logs) = Cluster::start_logged(
        3,
        &["--engine", "sim", "--chaos", "--log-format", "json"],
        &[],
        &[("FLOTILLA_LOG", "info,ractor_cluster=error,ractor=warn")],
    );
    http::wait_routable(&cluster, 2).await;
    let client = reqwest::Client::new();

    // A plain request: the gateway's access line and one worker's admitted and finished lines.
    let r = client
        .post(cluster.url("/v1/completions"))
        .header("x-request-id", "trace-plain")
        .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.text().await;
    let plain = poll_until(
        Duration::from_secs(20),
        "the plain request's lines",
        || async {
            let lines = lines_of(&logs, "trace-plain");
            let done = !worker_nodes(&lines, "sequence finished").is_empty()
                && lines.iter().any(|v| v["target"] == "flotilla::access");
            done.then_some(lines)
        },
    )
    .await;
    let admitted = worker_nodes(&plain, "sequence admitted");
    assert_eq!(admitted.len(), 1, "one worker admitted it: {plain:?}");
    assert_eq!(worker_nodes(&plain, "sequence finished"), admitted);
    let placed = placed_workers(&plain);
    assert_eq!(placed.len(), 1, "the router's one `placed` line: {plain:?}");
    assert_eq!(
        placed[0].split('/').next(),
        Some(admitted[0].as_str()),
        "placed where admitted"
    );
    assert!(
        plain
            .iter()
            .any(|v| v["target"] == "flotilla::access" && v["fields"]["status"] == 200),
        "the gateway's access line: {plain:?}"
    );

    // A long stream whose replica is killed: it migrates to the other worker's node.
    let stream = client
        .post(cluster.url("/v1/completions"))
        .header("x-request-id", "trace-migrated")
        .json(
            &json!({"model": MODEL, "prompt": "tell a long story", "max_tokens": 3000,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let mut body = stream.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(30), body.next())
        .await
        .expect("a first chunk");
    assert!(first.is_some_and(|c| c.is_ok()));
    let first_worker = poll_until(Duration::from_secs(20), "the stream admitted", || async {
        let lines = lines_of(&logs, "trace-migrated");
        lines
            .iter()
            .find(|v| v["fields"]["message"] == "sequence admitted")
            .and_then(|v| v["fields"]["worker"].as_str().map(str::to_owned))
    })
    .await;
    let r = client
        .post(cluster.url("/chaos/faults"))
        .json(&json!({"kind": "kill_actor", "actor": "replica",
                      "target": {"worker": first_worker}}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{:?}", r.text().await);
    let rest = tokio::time::timeout(Duration::from_secs(120), async {
        let mut text = String::new();
        while let Some(chunk) = body.next().await {
            text.push_str(&String::from_utf8_lossy(
                &chunk.expect("the stream goes on"),
            ));
        }
        text
    })
    .await
    .expect("the stream ends");
    assert!(rest.contains("[DONE]"), "the migrated stream completes");
    let migrated = poll_until(
        Duration::from_secs(20),
        "the migrated request's lines",
        || async {
            let lines = lines_of(&logs, "trace-migrated");
            let done = !worker_nodes(&lines, "sequence finished").is_empty()
                && lines.iter().any(|v| v["target"] == "flotilla::access");
            done.then_some(lines)
        },
    )
    .await;
    let admitted = worker_nodes(&migrated, "sequence admitted");
    assert_eq!(
        admitted.len(),
        2,
        "both workers' nodes admitted it: {migrated:#?}"
    );
    let first_node = first_worker.split('/').next().unwrap();
    assert!(admitted.iter().any(|n| n == first_node));
    let finished = worker_nodes(&migrated, "sequence finished");
    assert_eq!(finished.len(), 1, "{migrated:#?}");
    assert_ne!(finished[0], first_node, "it finished on the other node");
    let access = migrated
        .iter()
        .find(|v| v["target"] == "flotilla::access")
        .expect("an access line");
    let workers = access["fields"]["workers"].as_str().unwrap_or_default();
    assert_eq!(
        workers.split(',').count(),
        2,
        "the access line names both workers: {access}"
    );
    let placed = placed_workers(&migrated);
    assert!(
        placed.len() >= 2 && placed.contains(&first_worker),
        "the router placed it twice, first on the killed replica: {placed:?}"
    );
    assert!(
        migrated
            .iter()
            .any(|v| v["fields"]["message"] == "migrating"
                && v["span"]["request_id"] == "trace-migrated"),
        "the gateway's migration line carries the id, inside the request's span: {migrated:#?}"
    );
}
