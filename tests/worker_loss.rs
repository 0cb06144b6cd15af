//! A worker lost mid-request (its node process SIGKILLed, and not restarted) when no other
//! worker exists never leaves a stream waiting: the request tries to migrate for
//! `gateway.migration_deadline_ms`, then the client gets one SSE error record, and new requests
//! get a clean 503 while no worker is left. (Migration that succeeds: `tests/resilience.rs`.)

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{
    http::{MODEL, post},
    process::{Cluster, node_pid, signal},
};
use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_node_ends_its_streams_with_an_error() {
    let c = Cluster::start_with(
        2,
        &["--no-restart"],
        &[
            "worker.kv_blocks=128",
            "cluster.heartbeat_interval_ms=100",
            "gateway.migration_deadline_ms=1000",
        ],
    );
    let pid = node_pid(&c, "node-1").await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                      "max_tokens": 4000, "ignore_eos": true, "stream": true});
    let resp = reqwest::Client::new()
        .post(c.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    while text.matches("data: ").count() < 3 {
        text.push_str(&String::from_utf8_lossy(
            &stream.next().await.unwrap().unwrap(),
        ));
    }
    signal(pid, Signal::SIGKILL);
    let t0 = Instant::now();
    let rest = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(b) = stream.next().await {
            match b {
                Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
                Err(_) => break,
            }
        }
    })
    .await;
    assert!(
        rest.is_ok(),
        "the stream was still open 20 s after its worker died"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    let last = text.trim_end().rsplit("\n\n").next().unwrap().to_owned();
    assert!(
        last.starts_with("data: {\"error\""),
        "the stream ends with an error record: {last}"
    );
    assert!(
        !text.contains("\"finish_reason\":\"length\""),
        "no normal finish masks the loss"
    );
    // With no worker left, a new request is refused cleanly.
    let (s, _, t) = post(
        &c.url("/v1/chat/completions"),
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, 503, "{t}");
}
