//! The chaos API (first kinds: `slow`, `fail_engine`) and the streaming cases that need it:
//! B01(3) keep-alives while a slowed worker stalls the stream, B05(C) an engine failure after
//! the stream started becomes one SSE error record, never a normal finish.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;
#[path = "common/sse.rs"]
mod sse;

use crate::{
    http::{MODEL, post},
    process::Cluster,
    sse::sse_records,
};
use serde_json::{Value, json};
use std::time::Duration;

async fn fault(c: &Cluster, body: Value) -> u64 {
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let v: Value = r.json().await.unwrap();
    v["id"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_is_off_unless_enabled() {
    let c = Cluster::start(2, &["worker.kv_blocks=64"]);
    let r = reqwest::get(c.url("/chaos/faults")).await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "chaos_disabled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_streams_get_keep_alives_and_failures_become_error_records() {
    let c = Cluster::start(
        2,
        &[
            "worker.kv_blocks=128",
            "gateway.keep_alive_ms=300",
            "chaos.enabled=true",
        ],
    );
    let url = c.url("/v1/chat/completions");
    let worker = "node-1/replica-0";

    // The CLI client: add, list, clear.
    let cli = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .arg("chaos")
            .args(args)
            .args(["--gateway", &c.gateway])
            .output()
            .unwrap()
    };
    let out = cli(&["slow", "--target", worker, "--delay-ms", "1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let cli_id = v["id"].as_u64().unwrap().to_string();
    let out = cli(&["list"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains(worker));
    assert!(cli(&["clear", &cli_id]).status.success());
    assert!(
        !cli(&["clear", &cli_id]).status.success(),
        "clearing twice fails"
    );

    // Bad faults are refused.
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "slow", "delay_ms": 5, "target": {"worker": "nope/replica-9"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    // B01(3): a worker slowed to one step a second for 5 s; the stream carries keep-alive
    // comments, stays well framed and ends with [DONE].
    let id = fault(&c, json!({"kind": "slow", "delay_ms": 1000, "target": {"worker": worker}, "duration_ms": 5000})).await;
    let listed: Value = reqwest::get(c.url("/chaos/faults"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let f = listed["faults"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == id)
        .unwrap();
    assert_eq!(f["hit"], json!([worker]));
    assert_eq!(f["active"], true);
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "stream": true, "temperature": 0});
    let (s, _, text) = post(&url, &body).await;
    assert_eq!(s, 200);
    assert!(
        text.contains(": keep-alive\n\n"),
        "no keep-alive comment in {text:?}"
    );
    let recs = sse_records(&text);
    assert_eq!(recs.last().unwrap(), "[DONE]");
    // The stream may end before the 5 s are up (the model can stop early): wait for expiry.
    crate::poll::poll_until(
        Duration::from_secs(10),
        "the timed fault cleared itself",
        || async {
            let listed: Value = reqwest::get(c.url("/chaos/faults"))
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            let timed = listed["faults"]
                .as_array()?
                .iter()
                .find(|f| f["id"] == id)?
                .clone();
            (timed["active"] == false).then_some(())
        },
    )
    .await;

    // Deleting a slow fault ends the stall at once (the delay is not slept out).
    let id = fault(
        &c,
        json!({"kind": "slow", "delay_ms": 600000, "target": {"worker": worker}}),
    )
    .await;
    let slow = tokio::spawn({
        let url = url.clone();
        async move {
            let t0 = std::time::Instant::now();
            let (s, _, _) = post(&url, &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})).await;
            (s, t0.elapsed())
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let r = reqwest::Client::new()
        .delete(c.url(&format!("/chaos/faults/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (s, took) = slow.await.unwrap();
    assert_eq!(s, 200);
    assert!(
        took < std::time::Duration::from_secs(30),
        "stalled {took:?} after the fault was deleted"
    );
    // Bad ids and methods get JSON errors.
    let r = reqwest::Client::new()
        .delete(c.url("/chaos/faults/abc"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "a fault id is a number");
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let r = reqwest::get(c.url("/v1/chat/completions")).await.unwrap();
    assert_eq!(r.status(), 405);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "method_not_allowed");
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "slow", "delay_ms": u64::MAX, "target": "any_busy"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    // B05(C): the engine fails after 10 steps, mid-stream: one error record, no finish.
    let id = fault(
        &c,
        json!({"kind": "fail_engine", "after_steps": 10, "target": {"node": "node-1"}}),
    )
    .await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 200, "ignore_eos": true, "stream": true});
    let (s, _, text) = post(&url, &body).await;
    assert_eq!(s, 200, "the failure comes after the headers");
    let recs = sse_records(&text);
    let errors: Vec<_> = recs.iter().filter(|r| r.get("error").is_some()).collect();
    assert_eq!(errors.len(), 1, "{text}");
    assert!(errors[0]["error"]["message"].is_string() && errors[0]["error"]["type"].is_string());
    let content = recs
        .iter()
        .filter(|r| {
            r["choices"]
                .get(0)
                .is_some_and(|c| c["delta"]["content"].is_string())
        })
        .count();
    assert!(
        content >= 5,
        "tokens were streamed before the failure ({content})"
    );
    assert!(
        recs.iter()
            .filter_map(|r| r["choices"].get(0))
            .all(|c| c["finish_reason"].is_null()),
        "a failure is never masked by a normal finish_reason"
    );
    // Non-streaming, the same failure is a 500 in the error shape.
    let mut b = body.clone();
    b["stream"] = json!(false);
    let (s, ctype, t) = post(&url, &b).await;
    assert_eq!(s, 500, "{t}");
    assert!(ctype.starts_with("application/json"));
    // Cleared, the worker serves again.
    let r = reqwest::Client::new()
        .delete(c.url(&format!("/chaos/faults/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = reqwest::Client::new()
        .delete(c.url(&format!("/chaos/faults/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let (s, _, _) = post(
        &url,
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200);
}
