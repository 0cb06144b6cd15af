//! Priority classes on a live simulated fleet (`flotilla up --engine sim`,
//! `priority.classes` interactive 512 : batch 128): a class is named by header or body field
//! and checked at the door (unknown, malformed or conflicting → 400 naming it, in each route's
//! error shape, and nothing is placed); requests are counted per class; and with
//! `gateway.max_in_flight = 2` the lower class (held to half of it) is refused with 429 and
//! `Retry-After` while one choice is in flight, when the higher class is still admitted.
//! The shares themselves are tested on the simulator's virtual clock (`src/sim/tests.rs`,
//! `a_burst_is_served_by_class_weight`) and in `request_plane/priority.rs`.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::{MODEL, metric_sum, metric_sum_with};
use crate::process::Cluster;
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::Duration;

const CLASSES: &str =
    r#"priority.classes=[{"name":"interactive","quantum":512},{"name":"batch","quantum":128}]"#;

/// POST `body` to `path` with `headers`: (status, Retry-After, body as JSON).
async fn send(
    c: &Cluster,
    path: &str,
    headers: &[(&str, &str)],
    body: Value,
) -> (u16, Option<String>, Value) {
    let mut r = reqwest::Client::new()
        .post(c.url(path))
        .timeout(Duration::from_secs(60))
        .json(&body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let text = r.text().await.unwrap();
    (
        status,
        retry,
        serde_json::from_str(&text).unwrap_or(Value::Null),
    )
}

fn completion(max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": "tell me a story", "max_tokens": max_tokens, "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classes_are_checked_counted_and_the_lower_one_is_shed_first() {
    let c = Cluster::start_with(
        2,
        &["--engine", "sim"],
        &[CLASSES, "gateway.max_in_flight=2"],
    );
    http::wait_routable(&c, 1).await;

    // 1. Bad names: 400 naming the header or field; nothing placed.
    let placed = metric_sum(&c, "flotilla_router_placements_total").await;
    let long = "x".repeat(65);
    let mut conflicting = completion(2);
    conflicting["priority_class"] = json!("interactive");
    let mut not_a_string = completion(2);
    not_a_string["priority_class"] = json!(5);
    let mut unknown_in_body = completion(2);
    unknown_in_body["priority_class"] = json!("gold");
    for (headers, body, param, says) in [
        (
            vec![("x-priority-class", "gold")],
            completion(2),
            "x-priority-class",
            "unknown priority class \"gold\"; configured: interactive, batch",
        ),
        (
            vec![("x-priority-class", long.as_str())],
            completion(2),
            "x-priority-class",
            "1 to 64 visible ASCII",
        ),
        (
            vec![
                ("x-priority-class", "batch"),
                ("x-priority-class", "interactive"),
            ],
            completion(2),
            "x-priority-class",
            "more than once",
        ),
        (vec![], unknown_in_body, "priority_class", "\"gold\""),
        (vec![], not_a_string, "priority_class", "priority_class"),
        (
            vec![("x-priority-class", "batch")],
            conflicting,
            "priority_class",
            "differ",
        ),
    ] {
        let (status, _, err) = send(&c, "/v1/completions", &headers, body).await;
        assert_eq!(status, 400, "{headers:?}: {err}");
        assert_eq!(err["error"]["param"], param, "{err}");
        let msg = err["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{msg}");
    }
    // On the Messages route, in Anthropic's shape.
    let (status, _, err) = send(
        &c,
        "/v1/messages",
        &[("x-priority-class", "gold")],
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(err["type"], "error", "{err}");
    assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
    assert_eq!(
        metric_sum(&c, "flotilla_router_placements_total").await,
        placed,
        "a refused request was placed"
    );

    // 2. One request per class (header, body): served and counted per class.
    let (status, _, a) = send(
        &c,
        "/v1/completions",
        &[("x-priority-class", "interactive")],
        completion(3),
    )
    .await;
    assert_eq!(status, 200, "{a}");
    let mut by_body = json!({"model": MODEL, "max_tokens": 4, "ignore_eos": true,
        "messages": [{"role": "user", "content": "hi"}], "priority_class": "batch"});
    let (status, _, b) = send(&c, "/v1/chat/completions", &[], by_body.take()).await;
    assert_eq!(status, 200, "{b}");
    for (class, usage) in [("interactive", &a["usage"]), ("batch", &b["usage"])] {
        let l = format!("class=\"{class}\"");
        assert_eq!(
            metric_sum_with(&c, "flotilla_class_requests_total", &[&l, "outcome=\"ok\""]).await,
            1
        );
        assert_eq!(
            metric_sum_with(&c, "flotilla_class_completion_tokens_total", &[&l]).await,
            usage["completion_tokens"].as_u64().unwrap()
        );
        assert_eq!(
            metric_sum_with(&c, "flotilla_class_prompt_tokens_total", &[&l]).await,
            usage["prompt_tokens"].as_u64().unwrap()
        );
    }

    // 3. One choice in flight (a long interactive stream): batch is past its half of
    // max_in_flight = 2 → 429 with Retry-After; interactive is still admitted.
    let mut long_stream = completion(4_000);
    long_stream["stream"] = json!(true);
    let held = reqwest::Client::new()
        .post(c.url("/v1/completions"))
        .header("x-priority-class", "interactive")
        .json(&long_stream)
        .send()
        .await
        .unwrap();
    assert_eq!(held.status().as_u16(), 200);
    let mut chunks = held.bytes_stream();
    // Its first event: the choice is in flight on the gateway.
    assert!(chunks.next().await.is_some());
    let (status, retry, err) = send(
        &c,
        "/v1/completions",
        &[("x-priority-class", "batch")],
        completion(2),
    )
    .await;
    assert_eq!(status, 429, "{err}");
    assert_eq!(retry.as_deref(), Some("1"));
    assert_eq!(err["error"]["type"], "rate_limit_error", "{err}");
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("priority class \"batch\": "), "{msg}");
    let (status, _, ok) = send(
        &c,
        "/v1/completions",
        &[("x-priority-class", "interactive")],
        completion(2),
    )
    .await;
    assert_eq!(status, 200, "{ok}");
    drop(chunks);
    assert!(metric_sum_with(&c, "flotilla_class_shed_total", &["class=\"batch\""]).await >= 1);
    assert_eq!(
        metric_sum_with(&c, "flotilla_class_shed_total", &["class=\"interactive\""]).await,
        0
    );
    assert!(metric_sum_with(&c, "flotilla_shed_total", &["reason=\"priority_class\""]).await >= 1);
}
