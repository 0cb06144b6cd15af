//! The HTTP edge against a live cluster (real processes): B19 fields that cannot be honoured
//! are refused, B20 the control API refuses cross-site and DNS-rebinding requests and the POST
//! routes need JSON, B21 slow or incomplete requests cannot hold connections, B22
//! `x-request-id` on every response and in the logs of every node a request touches.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{
    http::MODEL,
    poll::poll_until,
    process::{Cluster, Logs},
};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const WORKER: &str = "node-1/replica-0";

/// A client without a connection pool: every request opens its own connection, so no test
/// step can meet a kept-alive connection the server has just closed.
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

fn chat(extra: Value) -> Value {
    let mut b = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 4,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn completion(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "prompt": "Say hi", "max_tokens": 4, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// POST `body` as JSON with `x-request-id: id`: status, content type, body, echoed id.
async fn post_id(url: &str, body: &Value, id: &str) -> (u16, String, Value, String) {
    let r = client()
        .post(url)
        .header("x-request-id", id)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let ctype = header(&r, "content-type");
    let echoed = header(&r, "x-request-id");
    let text = r.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, ctype, v, echoed)
}

fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

fn assert_refused(status: u16, ctype: &str, v: &Value, param: &str) {
    assert_eq!(status, 400, "{param}: {v}");
    assert!(ctype.starts_with("application/json"), "{param}: {ctype}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(v["error"]["param"], param, "{v}");
}

/// Lines of `logs` with `id` that a worker's scheduler wrote (its per-sequence lines, target
/// `flotilla::sequence`).
fn worker_lines(logs: &Logs, id: &str) -> Vec<String> {
    logs.matching(id)
        .into_iter()
        .filter(|l| l.contains("flotilla::sequence"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_and_request_ids() {
    let (c, logs) = Cluster::start_logged(
        2,
        &[],
        &["worker.kv_blocks=128", "chaos.enabled=true"],
        &[(
            "FLOTILLA_LOG",
            "info,flotilla::actors::gateway=debug,flotilla::worker::scheduler=debug,ractor_cluster=error,ractor=warn",
        )],
    );
    let chat_url = c.url("/v1/chat/completions");
    let comp_url = c.url("/v1/completions");
    let tag = format!("{:08x}", rand::random::<u32>());

    // ----- a forced tool call with no tools, on every trigger of the case.
    let forced = json!({"type": "function", "function": {"name": "f"}});
    for (i, extra) in [
        json!({"tool_choice": "required"}),
        json!({"tool_choice": "required", "tools": []}),
        json!({"tool_choice": forced}),
        json!({"tool_choice": "required", "stream": true}),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("b19-{tag}-{i}");
        let (s, ctype, v, _) = post_id(&chat_url, &chat(extra.clone()), &id).await;
        assert_refused(s, &ctype, &v, "tool_choice");
        assert!(!ctype.contains("event-stream"), "{extra}: a stream header");
    }
    // Every other field this server cannot honour, on both routes, names itself.
    for (url, body, param) in [
        (
            &chat_url,
            chat(json!({"presence_penalty": 0.5})),
            "presence_penalty",
        ),
        (
            &chat_url,
            chat(json!({"frequency_penalty": -1})),
            "frequency_penalty",
        ),
        (
            &chat_url,
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (
            &chat_url,
            chat(json!({"parallel_tool_calls": true})),
            "parallel_tool_calls",
        ),
        (&chat_url, chat(json!({"store": true})), "store"),
        (
            &chat_url,
            chat(json!({"reasoning_effort": "low"})),
            "reasoning_effort",
        ),
        (
            &chat_url,
            chat(json!({"service_tier": "flex"})),
            "service_tier",
        ),
        (
            &chat_url,
            chat(json!({"modalities": ["text", "audio"]})),
            "modalities",
        ),
        (&chat_url, chat(json!({"not_a_field": 1})), "not_a_field"),
        (
            &comp_url,
            completion(json!({"presence_penalty": 1})),
            "presence_penalty",
        ),
        (&comp_url, completion(json!({"logprobs": 6})), "logprobs"),
        // `echo` is served on completions (tests/logprobs.rs): a wrong type is refused, and
        // chat has no such field.
        (&comp_url, completion(json!({"echo": "yes"})), "echo"),
        (&chat_url, chat(json!({"echo": true})), "echo"),
        (&comp_url, completion(json!({"suffix": "x"})), "suffix"),
        (&comp_url, completion(json!({"best_of": 2})), "best_of"),
        (
            &comp_url,
            completion(json!({"tool_choice": "required"})),
            "tool_choice",
        ),
        (
            &comp_url,
            completion(json!({"stream_options": {}})),
            "stream_options",
        ),
    ] {
        let (s, ctype, v, _) = post_id(url, &body, &format!("b19-{tag}-{param}")).await;
        assert_refused(s, &ctype, &v, param);
    }
    // "none" and "auto" with no tools are a plain answer, as are penalties of 0.
    for choice in ["none", "auto"] {
        let body = chat(json!({"tool_choice": choice, "presence_penalty": 0}));
        let (s, _, v, _) = post_id(&chat_url, &body, &format!("ok-{tag}-{choice}")).await;
        assert_eq!(s, 200, "{choice}: {v}");
        assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    }

    // ----- JSON content type on the POST routes, on both OpenAI routes.
    for url in [&chat_url, &comp_url] {
        let body = serde_json::to_string(&chat(json!({}))).unwrap();
        for ctype in [Some("text/plain"), None] {
            let mut rq = client().post(url.as_str()).body(body.clone());
            if let Some(t) = ctype {
                rq = rq.header("content-type", t);
            }
            let r = rq.send().await.unwrap();
            assert_eq!(r.status(), 415, "{url} {ctype:?}");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
            assert!(v["error"]["message"].is_string(), "{v}");
        }
    }
    // The control API: (a) text/plain from a foreign origin, (b) JSON with a foreign Host,
    // (c) a GET with that Host; none creates a fault.
    let port = c.gateway.rsplit(':').next().unwrap().to_owned();
    let fault =
        json!({"kind": "slow", "delay_ms": 1, "target": {"worker": WORKER}, "duration_ms": 1000});
    let faults_url = c.url("/chaos/faults");
    let r = client()
        .post(&faults_url)
        .header("content-type", "text/plain")
        .header("origin", "http://elsewhere.example")
        .body(fault.to_string())
        .send()
        .await
        .unwrap();
    assert!(
        [403, 415].contains(&r.status().as_u16()),
        "(a) {}",
        r.status()
    );
    let r = client()
        .post(&faults_url)
        .header("host", format!("elsewhere.example:{port}"))
        .json(&fault)
        .send()
        .await
        .unwrap();
    assert!(
        [403, 421].contains(&r.status().as_u16()),
        "(b) {}",
        r.status()
    );
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    let r = client()
        .get(&faults_url)
        .header("host", format!("elsewhere.example:{port}"))
        .send()
        .await
        .unwrap();
    assert!(
        [403, 421].contains(&r.status().as_u16()),
        "(c) {}",
        r.status()
    );
    let v: Value = client()
        .get(&faults_url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["faults"], json!([]), "no fault was created: {v}");

    // ----- x-request-id on every response.
    // (a) echoed on a plain answer, (b) on a stream, (c) on an error.
    let a = format!("abc-{tag}-a");
    let (s, _, v, echoed) = post_id(&chat_url, &chat(json!({})), &a).await;
    assert_eq!((s, echoed.as_str()), (200, a.as_str()), "{v}");
    let b = format!("abc-{tag}-b");
    let (s, ctype, v, echoed) = post_id(&chat_url, &chat(json!({"stream": true})), &b).await;
    assert_eq!((s, echoed.as_str()), (200, b.as_str()), "{v}");
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    assert!(v.as_str().unwrap().contains("[DONE]"), "{v}");
    let e = format!("abc-{tag}-c");
    let (s, _, v, echoed) = post_id(
        &chat_url,
        &json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
        &e,
    )
    .await;
    assert_eq!((s, echoed.as_str()), (404, e.as_str()), "{v}");
    // (d) none: a generated, distinct id each time, also on 4xx and unknown routes.
    let mut seen = std::collections::HashSet::new();
    for path in ["/v1/models", "/v1/models", "/nope", "/health"] {
        let r = client().get(c.url(path)).send().await.unwrap();
        let id = header(&r, "x-request-id");
        assert!(!id.is_empty() && id.len() <= 128, "{path}: {id:?}");
        assert!(seen.insert(id.clone()), "{path}: {id} repeated");
    }
    // (e) 8,000 characters: served, the id replaced by a bounded one.
    let huge = "x".repeat(8000);
    let (s, _, v, echoed) = post_id(&chat_url, &chat(json!({})), &huge).await;
    assert_eq!(s, 200, "{v}");
    assert!(
        !echoed.is_empty() && echoed.len() <= 128,
        "{}",
        echoed.len()
    );
    assert_ne!(echoed, huge);

    // The ids are in the gateway's lines (its span) and in the worker's lines (node-1).
    for id in [&a, &b] {
        poll_until(
            Duration::from_secs(20),
            "a worker logs the request id",
            || async { (!worker_lines(&logs, id).is_empty()).then_some(()) },
        )
        .await;
        let gateway: Vec<_> = logs
            .matching(&format!("request_id={id}"))
            .into_iter()
            .filter(|l| l.contains("flotilla::actors::gateway"))
            .collect();
        assert!(!gateway.is_empty(), "no gateway line with {id}");
        let worker = worker_lines(&logs, id);
        assert!(
            worker.iter().any(|l| l.contains(WORKER)),
            "no line of {WORKER} with {id}: {worker:?}"
        );
        assert!(
            worker.iter().any(|l| l.contains("sequence finished")),
            "{worker:?}"
        );
    }
    assert!(
        !logs.matching(&format!("request_id={e}")).is_empty(),
        "the error's id is logged"
    );
    // Nothing logged carries the 8,000-character value, and no refused request reached a
    // worker ("no worker saw the request").
    assert!(logs.all().iter().all(|l| !l.contains(&huge[..200])));
    assert!(
        worker_lines(&logs, &format!("b19-{tag}")).is_empty(),
        "a refused request reached a worker"
    );
}

/// Read from `s` until the server closes it; how long that took and what came.
async fn until_closed(mut s: TcpStream, started: Instant, limit: Duration) -> (Duration, String) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let end = tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(end.is_ok(), "the server kept the socket open for {limit:?}");
    (
        started.elapsed(),
        String::from_utf8_lossy(&got).into_owned(),
    )
}

async fn connect(addr: &str, send: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    if !send.is_empty() {
        s.write_all(send).await.unwrap();
    }
    s
}

/// The value of a metric line `name` (no labels) in a Prometheus page.
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_or_incomplete_requests_cannot_hold_connections() {
    // Head and body deadlines; a silent new connection gets longer, so that the connection
    // cap can be filled with silent connections well before the first of them expires.
    const DEADLINE: Duration = Duration::from_millis(2000);
    const IDLE: Duration = Duration::from_millis(5000);
    // Generous on a busy machine: a deadline fires late, never early.
    const SLACK: Duration = Duration::from_secs(10);
    let c = Cluster::start(
        2,
        &[
            "worker.kv_blocks=128",
            "chaos.enabled=true",
            "gateway.request_header_timeout_ms=2000",
            "gateway.request_body_timeout_ms=2000",
            "gateway.idle_timeout_ms=5000",
            "gateway.max_connections=250",
        ],
    );
    let addr = c.gateway.trim_start_matches("http://").to_owned();
    let head = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\n");

    // A stream that lasts longer than every deadline: one step per 700 ms for 8 tokens.
    let r = client()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "slow", "delay_ms": 700, "target": {"worker": WORKER}, "duration_ms": 20000}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let stream_url = c.url("/v1/chat/completions");
    let streaming = tokio::spawn(async move {
        let t0 = Instant::now();
        let r = client()
            .post(stream_url)
            .json(&chat(
                json!({"stream": true, "max_tokens": 8, "ignore_eos": true}),
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body = r.text().await.unwrap();
        (t0.elapsed(), body)
    });

    let t0 = Instant::now();
    // (1) request line and one header; (2) full headers, 4 of 100 body bytes; (3) nothing.
    let one = connect(&addr, head.as_bytes()).await;
    let two_head =
        format!("{head}content-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"mo");
    let two = connect(&addr, two_head.as_bytes()).await;
    let three = connect(&addr, b"").await;
    // 200 more like (1).
    let mut many = Vec::new();
    for _ in 0..200 {
        many.push(connect(&addr, head.as_bytes()).await);
    }
    // A normal request is served at once meanwhile.
    let t = Instant::now();
    let r = client().get(c.url("/v1/models")).send().await.unwrap();
    let latency = t.elapsed();
    assert_eq!(r.status(), 200);
    assert!(latency < DEADLINE, "normal request took {latency:?}");

    let (d1, _) = until_closed(one, t0, DEADLINE + SLACK).await;
    let (d2, body2) = until_closed(two, t0, DEADLINE + SLACK).await;
    let (d3, _) = until_closed(three, t0, IDLE + SLACK).await;
    for (what, d, limit) in [
        ("(1)", d1, DEADLINE),
        ("(2)", d2, DEADLINE),
        ("(3)", d3, IDLE),
    ] {
        // A deadline fires late on a busy machine, never early.
        assert!(
            d >= limit - Duration::from_millis(100),
            "{what} closed early: {d:?}"
        );
    }
    assert!(body2.starts_with("HTTP/1.1 408"), "(2) got {body2:?}");
    for s in many {
        until_closed(s, t0, DEADLINE + SLACK).await;
    }

    // The stream outlived every deadline and ended normally.
    let (took, body) = streaming.await.unwrap();
    assert!(took > DEADLINE * 2, "the stream took only {took:?}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");

    // The cap: 250 silent connections open, more are refused with a 503 and counted.
    let mut held = Vec::new();
    for _ in 0..250 {
        held.push(connect(&addr, b"").await);
    }
    let mut refused = 0;
    for _ in 0..20 {
        let s = connect(&addr, b"").await;
        let (_, got) = until_closed(s, Instant::now(), IDLE + SLACK).await;
        if got.starts_with("HTTP/1.1 503") {
            refused += 1;
            assert!(got.contains("too_many_connections"), "{got}");
        }
    }
    assert!(
        refused >= 10,
        "only {refused} of 20 connections over the cap refused"
    );
    drop(held);
    let page = poll_until(Duration::from_secs(20), "metrics served again", || async {
        let r = client().get(c.url("/metrics")).send().await.ok()?;
        // Until the held connections are closed, the cap may still refuse this one (503).
        if !r.status().is_success() {
            return None;
        }
        r.text().await.ok()
    })
    .await;
    let n = metric(&page, "flotilla_http_connections_refused_total").unwrap_or(0.0);
    assert!(n >= f64::from(refused), "refused counter {n}:\n{page}");
    assert!(
        metric(&page, "flotilla_http_connections_open").is_some_and(|v| v >= 1.0),
        "{page}"
    );
}
