//! Load shedding (B14 in part): when every live worker is above the configured KV threshold,
//! new requests — streaming or not — get 503 with `Retry-After` and the OpenAI error body,
//! fast and before any work; once load falls, requests are admitted again.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{
    http::{MODEL, kv_used},
    poll::poll_until,
    process::Cluster,
};
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_shed_with_503_when_every_worker_is_busy() {
    let c = Cluster::start(
        2,
        &[
            "worker.kv_blocks=16",
            "gateway.busy_kv_ratio=0.5",
            "cluster.heartbeat_interval_ms=100",
        ],
    );
    let client = reqwest::Client::new();
    // One long request (≈ 9 blocks of prompt, 800 tokens to generate: seconds of work) holds
    // more than a tenth of the only worker's 64 blocks.
    let body = json!({"model": MODEL, "prompt": "word ".repeat(140), "max_tokens": 800, "ignore_eos": true, "stream": true});
    let resp = client
        .post(c.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let _first = stream.next().await.unwrap().unwrap();
    poll_until(
        Duration::from_secs(10),
        "the worker reports its KV use",
        || async { (kv_used(&c).await >= 8).then_some(()) },
    )
    .await;
    for streaming in [false, true] {
        let t0 = Instant::now();
        let r = client
            .post(c.url("/v1/chat/completions"))
            .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": streaming}))
            .send()
            .await
            .unwrap();
        let took = t0.elapsed();
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "1");
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json")
        );
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains("busy"),
            "{v}"
        );
        assert!(took < Duration::from_secs(1), "shed in {took:?}");
    }
    let m = reqwest::get(c.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("flotilla_shed_total{reason=\"all_workers_busy\"} 2"),
        "shed counted"
    );
    // The long request leaves; requests are admitted again.
    drop(stream);
    poll_until(Duration::from_secs(10), "KV freed", || async {
        (kv_used(&c).await == 0).then_some(())
    })
    .await;
    let r = client
        .post(c.url("/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}
