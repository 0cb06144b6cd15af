//! Case B24 on raw HTTP against real clusters with the real model: Anthropic's Messages API
//! (`POST /v1/messages`) beside the chat route — shapes, the streaming event order, the same
//! greedy text as the equivalent chat completion, a prefix cached through one API and read
//! through the other, `stop_sequences` and `max_tokens` endings, errors in Anthropic's shape,
//! exact metrics, and a stream migrated through a worker kill.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{
    http::{MODEL, counter_sum, kv_used, metric_sum_with, wait_routable},
    poll::poll_until,
    process::Cluster,
};
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::Duration;

const SYSTEM: &str = "You are a terse assistant.";
const ASK: &str = "Name three colors.";

/// Status, headers and JSON body of a POST.
async fn post_json(url: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    (status, headers, v)
}

fn messages(max_tokens: u32, extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                       "system": SYSTEM, "messages": [{"role": "user", "content": ASK}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn chat(max_tokens: u32) -> Value {
    json!({"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
           "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]})
}

/// One streamed message: its events (`event:` name and JSON data), in order.
struct Events(Vec<(String, Value)>);

impl Events {
    fn names(&self) -> Vec<&str> {
        self.0.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn text(&self) -> String {
        self.0
            .iter()
            .filter(|(n, _)| n == "content_block_delta")
            .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_owned())
            .collect()
    }

    fn one(&self, name: &str) -> &Value {
        let all: Vec<&Value> = self
            .0
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, d)| d)
            .collect();
        assert_eq!(all.len(), 1, "one {name}: {:?}", self.names());
        all[0]
    }
}

/// Parse SSE records `event: X\ndata: {...}\n\n`; comments (keep-alives) are skipped. Every
/// record must carry an event name equal to its data's `type`.
fn parse_events(buf: &mut String, out: &mut Events) {
    while let Some(pos) = buf.find("\n\n") {
        let rec: String = buf.drain(..pos + 2).collect();
        let rec = rec.trim();
        if rec.is_empty() || rec.starts_with(':') {
            continue;
        }
        let mut lines = rec.lines();
        let name = lines
            .next()
            .and_then(|l| l.strip_prefix("event: "))
            .unwrap_or_else(|| panic!("record without an event name: {rec:?}"))
            .to_owned();
        let data = lines
            .next()
            .and_then(|l| l.strip_prefix("data: "))
            .unwrap_or_else(|| panic!("record without data: {rec:?}"));
        assert!(lines.next().is_none(), "one data line: {rec:?}");
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], name, "the data's type names its event: {rec}");
        out.0.push((name, v));
    }
}

/// Stream `body` (with `stream: true`) to its end; after `kill_after` deltas, `on_mark` runs
/// once.
async fn stream_messages(
    url: &str,
    mut body: Value,
    kill_after: Option<usize>,
    on_mark: impl FnOnce() -> futures::future::BoxFuture<'static, ()>,
) -> Events {
    body["stream"] = json!(true);
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let ctype = r.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    let mut out = Events(Vec::new());
    let mut buf = String::new();
    let mut bytes = r.bytes_stream();
    let mut on_mark = Some(on_mark);
    let read = async {
        while let Some(b) = bytes.next().await {
            buf.push_str(&String::from_utf8_lossy(&b.unwrap()));
            parse_events(&mut buf, &mut out);
            let deltas = out
                .0
                .iter()
                .filter(|(n, _)| n == "content_block_delta")
                .count();
            if kill_after.is_some_and(|k| deltas >= k)
                && let Some(f) = on_mark.take()
            {
                f().await;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(300), read)
        .await
        .expect("the stream ends");
    assert!(
        buf.trim().is_empty(),
        "a partial record at the end: {buf:?}"
    );
    out
}

/// Anthropic's event order: `message_start`, `content_block_start`, `ping`,
/// `content_block_delta`…, `content_block_stop`, `message_delta`, `message_stop`.
fn assert_order(ev: &Events) {
    let names = ev.names();
    assert!(names.len() >= 6, "{names:?}");
    assert_eq!(
        names[..3],
        ["message_start", "content_block_start", "ping"],
        "{names:?}"
    );
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"],
        "{names:?}"
    );
    assert!(
        names[3..names.len() - 3]
            .iter()
            .all(|n| *n == "content_block_delta"),
        "{names:?}"
    );
}

/// The sum of the `/metrics` series of `name` whose labels contain every one of `labels`.
async fn metric(c: &Cluster, name: &str, labels: &[&str]) -> u64 {
    metric_sum_with(c, name, labels).await
}

/// An Anthropic error body of `ty` whose message names `field`.
fn assert_error(status: u16, v: &Value, want_status: u16, ty: &str, field: &str) {
    assert_eq!(status, want_status, "{v}");
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], ty, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(field), "the message names {field}: {msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_beside_chat_on_raw_http() {
    let c = Cluster::start(2, &["worker.kv_blocks=128"]);
    wait_routable(&c, 1).await;
    let url = c.url("/v1/messages");

    // A message: shape, and the same greedy text as the equivalent chat completion.
    let ok_before = metric(
        &c,
        "flotilla_requests_total",
        &["route=\"messages\"", "outcome=\"ok\""],
    )
    .await;
    let prompt_before = metric(&c, "flotilla_prompt_tokens_total", &[]).await;
    let completion_before = metric(&c, "flotilla_completion_tokens_total", &[]).await;
    let (status, headers, m) = post_json(&url, &messages(24, json!({}))).await;
    assert_eq!(status, 200, "{m}");
    assert!(headers.contains_key("x-request-id"));
    assert!(m["id"].as_str().unwrap().starts_with("msg_"), "{m}");
    assert_eq!(m["type"], "message");
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["model"], MODEL);
    let content = m["content"].as_array().unwrap();
    assert_eq!(content.len(), 1, "{m}");
    assert_eq!(content[0]["type"], "text");
    let text = content[0]["text"].as_str().unwrap().to_owned();
    assert!(!text.trim().is_empty(), "{m}");
    assert_eq!(m["stop_sequence"], Value::Null);
    let usage = &m["usage"];
    let input = usage["input_tokens"].as_u64().unwrap();
    let cache_read = usage["cache_read_input_tokens"].as_u64().unwrap();
    let output = usage["output_tokens"].as_u64().unwrap();
    assert_eq!(usage["cache_creation_input_tokens"], 0);
    // Counted exactly like chat: one ok request, the whole prompt and every output token.
    assert_eq!(
        metric(
            &c,
            "flotilla_requests_total",
            &["route=\"messages\"", "outcome=\"ok\""]
        )
        .await,
        ok_before + 1
    );
    assert_eq!(
        metric(&c, "flotilla_prompt_tokens_total", &[]).await,
        prompt_before + input + cache_read
    );
    assert_eq!(
        metric(&c, "flotilla_completion_tokens_total", &[]).await,
        completion_before + output
    );

    let (status, _, ch) = post_json(&c.url("/v1/chat/completions"), &chat(24)).await;
    assert_eq!(status, 200, "{ch}");
    assert_eq!(
        ch["choices"][0]["message"]["content"], text,
        "the same text as the chat route"
    );
    assert_eq!(
        ch["usage"]["prompt_tokens"].as_u64().unwrap(),
        input + cache_read,
        "the same prompt tokens (the same template)"
    );
    assert_eq!(ch["usage"]["completion_tokens"].as_u64().unwrap(), output);
    let reason = match ch["choices"][0]["finish_reason"].as_str().unwrap() {
        "length" => "max_tokens",
        _ => "end_turn",
    };
    assert_eq!(m["stop_reason"], reason, "{m}");

    // A conversation cached through one API is read through the other, both ways.
    let long = "Here are my notes on the history of lighthouses, their keepers and the lenses \
                they tended along rocky coasts, written over many long winters by the sea.";
    for (i, first_chat) in [true, false].into_iter().enumerate() {
        let ask = format!("{long} Question {i}: summarise them in one line.");
        let chat_body = json!({"model": MODEL, "max_tokens": 4, "temperature": 0,
                               "messages": [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": ask}]});
        let msg_body = json!({"model": MODEL, "max_tokens": 4, "temperature": 0,
                              "system": [{"type": "text", "text": SYSTEM}],
                              "messages": [{"role": "user",
                                            "content": [{"type": "text", "text": ask}]}]});
        if first_chat {
            let (s, _, v) = post_json(&c.url("/v1/chat/completions"), &chat_body).await;
            assert_eq!(s, 200, "{v}");
            let (s, _, v) = post_json(&url, &msg_body).await;
            assert_eq!(s, 200, "{v}");
            assert!(
                v["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0,
                "messages reads the prefix chat cached: {v}"
            );
        } else {
            let (s, _, v) = post_json(&url, &msg_body).await;
            assert_eq!(s, 200, "{v}");
            let (s, _, v) = post_json(&c.url("/v1/chat/completions"), &chat_body).await;
            assert_eq!(s, 200, "{v}");
            assert!(
                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
                    > 0,
                "chat reads the prefix messages cached: {v}"
            );
        }
    }

    // The stream: Anthropic's event order, the same text, ending and usage.
    let ev = stream_messages(&url, messages(24, json!({})), None, || Box::pin(async {})).await;
    assert_order(&ev);
    assert_eq!(ev.text(), text);
    let start = &ev.one("message_start")["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(
        start["usage"]["input_tokens"].as_u64().unwrap()
            + start["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        input + cache_read
    );
    assert_eq!(
        ev.one("content_block_start")["content_block"],
        json!({"type": "text", "text": ""})
    );
    let delta = ev.one("message_delta");
    assert_eq!(delta["delta"]["stop_reason"], m["stop_reason"]);
    assert_eq!(delta["delta"]["stop_sequence"], Value::Null);
    assert_eq!(delta["usage"]["output_tokens"].as_u64().unwrap(), output);

    // stop_sequences: cut before the first match, named in stop_sequence; streamed too.
    let seq = text
        .split_whitespace()
        .nth(1)
        .expect("two words")
        .to_owned();
    let cut_at = text.find(&seq).unwrap();
    let (status, _, cut) = post_json(
        &url,
        &messages(24, json!({"stop_sequences": [seq.clone(), "NEVER-SEEN"]})),
    )
    .await;
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["stop_reason"], "stop_sequence", "{cut}");
    assert_eq!(cut["stop_sequence"], seq.as_str());
    assert_eq!(cut["content"][0]["text"], &text[..cut_at]);
    let ev = stream_messages(
        &url,
        messages(24, json!({"stop_sequences": [seq.clone()]})),
        None,
        || Box::pin(async {}),
    )
    .await;
    assert_order(&ev);
    assert_eq!(ev.text(), &text[..cut_at]);
    let delta = &ev.one("message_delta")["delta"];
    assert_eq!(delta["stop_reason"], "stop_sequence");
    assert_eq!(delta["stop_sequence"], seq.as_str());

    // max_tokens.
    let (status, _, short) = post_json(&url, &messages(3, json!({}))).await;
    assert_eq!(status, 200, "{short}");
    assert_eq!(short["stop_reason"], "max_tokens");
    assert_eq!(short["usage"]["output_tokens"], 3);

    // Errors: Anthropic's shape, the field named, nothing reaches a worker.
    let rejected_before = metric(
        &c,
        "flotilla_requests_total",
        &["route=\"messages\"", "outcome=\"rejected\""],
    )
    .await;
    let mut missing = messages(8, json!({}));
    missing.as_object_mut().unwrap().remove("max_tokens");
    let image = json!([{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]);
    let tool_result = json!([{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}]);
    let bad: Vec<(Value, &str)> = vec![
        (missing, "max_tokens"),
        (messages(8, json!({"messages": image})), "image"),
        (
            messages(8, json!({"messages": tool_result})),
            "messages[0].content[0].type",
        ),
        (
            messages(
                8,
                json!({"tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}),
            ),
            "tools",
        ),
        (
            messages(8, json!({"tool_choice": {"type": "any"}})),
            "tool_choice",
        ),
        (
            messages(
                8,
                json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
            ),
            "thinking",
        ),
        (messages(8, json!({"max_tokens": "8"})), "max_tokens"),
        (messages(8, json!({"temperature": "hot"})), "temperature"),
        (messages(8, json!({"messages": "hi"})), "messages"),
        (messages(8, json!({"stream": "yes"})), "stream"),
        (
            messages(8, json!({"stop_sequences": "END"})),
            "stop_sequences",
        ),
        (messages(8, json!({"system": 7})), "system"),
        (messages(8, json!({"top_k": -1})), "top_k"),
        (messages(8, json!({"n": 2})), "n"),
    ];
    let n_bad = bad.len() as u64;
    for (body, field) in bad {
        let (status, headers, v) = post_json(&url, &body).await;
        assert_error(status, &v, 400, "invalid_request_error", field);
        assert!(headers.contains_key("x-request-id"));
    }
    let (status, _, v) = post_json(&url, &messages(8, json!({"model": "no-such-model"}))).await;
    assert_error(status, &v, 404, "not_found_error", "no-such-model");
    let r = reqwest::Client::new()
        .post(&url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert_error(status, &v, 400, "invalid_request_error", "JSON");
    let r = reqwest::Client::new()
        .post(&url)
        .header("content-type", "text/plain")
        .body(messages(8, json!({})).to_string())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert_error(status, &v, 415, "invalid_request_error", "application/json");
    // B25 on this route too: a gzip body is read, an unknown coding refused by name in
    // Anthropic's shape.
    let gz = {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(messages(4, json!({})).to_string().as_bytes())
            .unwrap();
        e.finish().unwrap()
    };
    let send = |coding: &'static str, body: Vec<u8>| {
        reqwest::Client::new()
            .post(&url)
            .header("content-type", "application/json")
            .header("content-encoding", coding)
            .body(body)
            .send()
    };
    let r = send("gzip", gz.clone()).await.unwrap();
    assert_eq!(r.status(), 200, "a gzip body is decoded");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "message", "{v}");
    let r = send("x-unknown", gz).await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert_error(status, &v, 415, "invalid_request_error", "x-unknown");
    assert_eq!(
        metric(
            &c,
            "flotilla_requests_total",
            &["route=\"messages\"", "outcome=\"rejected\""]
        )
        .await,
        rejected_before + n_bad + 4,
        "each refusal counted once, as rejected"
    );

    // A client that goes away mid-stream: its request is cancelled at the worker (its KV
    // freed) and counted once, as cancelled.
    let cancelled = |status: &'static str| [status, "route=\"messages\"", "outcome=\"cancelled\""];
    let cancelled_before =
        metric(&c, "flotilla_requests_total", &cancelled("status=\"200\"")).await;
    let mut story = messages(400, json!({"stream": true}));
    story["messages"] = json!([{"role": "user",
                                "content": "Tell me a long story about a lighthouse keeper."}]);
    let r = reqwest::Client::new()
        .post(&url)
        .json(&story)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("content_block_delta") {
        let chunk = tokio::time::timeout(Duration::from_secs(60), body.next())
            .await
            .expect("a record")
            .expect("the stream goes on")
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(body);
    poll_until(
        Duration::from_secs(60),
        "the abandoned stream cancelled",
        || async {
            let n = metric(&c, "flotilla_requests_total", &cancelled("status=\"200\"")).await;
            (n == cancelled_before + 1 && kv_used(&c).await == 0).then_some(())
        },
    )
    .await;
}

/// A stream whose worker is killed mid-way migrates and still ends with `message_stop`
/// and the reference text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_stream_ends_with_message_stop_and_the_reference_text() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=128"]);
    wait_routable(&c, 2).await;
    let url = c.url("/v1/messages");
    let story = json!({"model": MODEL, "max_tokens": 120, "temperature": 0,
                       "messages": [{"role": "user",
                                     "content": "Tell me a long story about a lighthouse keeper."}]});
    let reference = stream_messages(&url, story.clone(), None, || Box::pin(async {})).await;
    assert_order(&reference);
    let reference_tokens = reference.one("message_delta")["usage"]["output_tokens"]
        .as_u64()
        .unwrap();
    assert!(reference_tokens > 40, "a long enough reference");

    let gw = c.url("");
    let migrated = stream_messages(&url, story, Some(10), move || {
        Box::pin(async move {
            let r = reqwest::Client::new()
                .post(format!("{gw}/chaos/faults"))
                .json(&json!({"kind": "kill_actor", "actor": "scheduler", "target": "any_busy"}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 201, "{:?}", r.text().await);
        })
    })
    .await;
    assert!(
        !migrated.names().contains(&"error"),
        "no error event: {:?}",
        migrated.0
    );
    assert_order(&migrated);
    assert_eq!(migrated.text(), reference.text(), "byte for byte");
    assert_eq!(
        migrated.one("message_delta")["usage"]["output_tokens"],
        reference_tokens
    );
    assert!(
        counter_sum(&c, "migrations").await >= 1,
        "the stream migrated"
    );
}

/// The Messages API's edges: `POST /v1/messages/count_tokens` counts exactly the prompt a
/// message with the same body runs (`usage.input_tokens` + `cache_read_input_tokens`), with
/// errors in Anthropic's shape; a wrong route or method under `/v1/messages` answers in
/// Anthropic's shape; consecutive turns of one role are combined into one turn (their texts
/// joined with "\n"), so `user, user` runs as the one user turn holding both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_count_tokens_fallbacks_and_combined_turns() {
    let c = Cluster::start(2, &["worker.kv_blocks=128"]);
    wait_routable(&c, 1).await;
    let count_url = c.url("/v1/messages/count_tokens");
    let count = |body: Value| {
        let url = count_url.clone();
        async move { post_json(&url, &body).await }
    };

    // count_tokens = the prompt a message runs.
    let (status, _, m) = post_json(&c.url("/v1/messages"), &messages(4, json!({}))).await;
    assert_eq!(status, 200, "{m}");
    let ran = m["usage"]["input_tokens"].as_u64().unwrap()
        + m["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    let (status, _, v) = count(json!({"model": MODEL, "system": SYSTEM,
                                      "messages": [{"role": "user", "content": ASK}]}))
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v, json!({"input_tokens": ran}));
    let (_, _, bare) = count(json!({"model": MODEL,
                                    "messages": [{"role": "user", "content": ASK}]}))
    .await;
    // The template's own default system prompt stands in for the missing one: another count.
    assert_ne!(
        bare["input_tokens"].as_u64().unwrap(),
        ran,
        "the system prompt counts: {bare}"
    );

    // Errors in Anthropic's shape, naming the field.
    let (status, _, v) = count(json!({"model": MODEL, "max_tokens": 5,
                                      "messages": [{"role": "user", "content": ASK}]}))
    .await;
    assert_error(status, &v, 400, "invalid_request_error", "max_tokens");
    let (status, _, v) = count(json!({"model": MODEL})).await;
    assert_error(status, &v, 400, "invalid_request_error", "messages");
    let (status, _, v) = count(json!({"model": "no-such-model",
                                      "messages": [{"role": "user", "content": ASK}]}))
    .await;
    assert_error(status, &v, 404, "not_found_error", "no-such-model");
    let (status, _, v) = count(json!({"model": MODEL, "messages": [{"role": "user",
        "content": [{"type": "image", "source": {}}]}]}))
    .await;
    assert_error(
        status,
        &v,
        400,
        "invalid_request_error",
        "messages[0].content[0].type",
    );

    // Fallbacks under /v1/messages: Anthropic's shape; elsewhere OpenAI's.
    let (status, _, v) = post_json(&c.url("/v1/messages/nope"), &json!({})).await;
    assert_error(status, &v, 404, "not_found_error", "/v1/messages/nope");
    let r = reqwest::get(c.url("/v1/messages")).await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    let r = reqwest::get(c.url("/v1/messages/count_tokens"))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    let (status, _, v) = post_json(&c.url("/v1/nope"), &json!({})).await;
    assert_eq!(status, 404);
    assert!(
        v["error"]["message"].is_string() && v.get("type").is_none(),
        "{v}"
    );

    // Combined turns: user, user runs as one user turn with both texts joined by "\n".
    let split = messages(
        12,
        json!({"messages": [{"role": "user", "content": "Name three colors."},
                            {"role": "user", "content": [{"type": "text", "text": "Be brief."}]}]}),
    );
    let joined = messages(
        12,
        json!({"messages": [{"role": "user", "content": "Name three colors.\nBe brief."}]}),
    );
    let (s1, _, a) = post_json(&c.url("/v1/messages"), &split).await;
    let (s2, _, b) = post_json(&c.url("/v1/messages"), &joined).await;
    assert_eq!((s1, s2), (200, 200), "{a} {b}");
    assert_eq!(
        a["content"], b["content"],
        "the same turn, the same greedy text"
    );
    let input = |m: &Value| {
        m["usage"]["input_tokens"].as_u64().unwrap()
            + m["usage"]["cache_read_input_tokens"].as_u64().unwrap()
    };
    assert_eq!(input(&a), input(&b));
    let (_, _, n) = count(json!({"model": MODEL, "system": SYSTEM,
                                 "messages": split["messages"].clone()}))
    .await;
    assert_eq!(n["input_tokens"].as_u64().unwrap(), input(&a));
    // A final assistant turn after combining is still a prefill: refused, naming the last one.
    let (status, _, v) = post_json(
        &c.url("/v1/messages"),
        &messages(
            4,
            json!({"messages": [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hel"},
                                {"role": "assistant", "content": "lo"}]}),
        ),
    )
    .await;
    assert_error(status, &v, 400, "invalid_request_error", "messages[2].role");
}
