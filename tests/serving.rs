//! The serving path end to end on a real cluster of processes with the real model: the OpenAI
//! routes, streaming and not, on raw HTTP (cases B01–B09 of `../shared/cases/README.md`),
//! golden outputs, batching that never changes results, prefix reuse, and cancellation.

#[path = "common/http.rs"]
mod http;
#[path = "common/model.rs"]
mod model;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;
#[path = "common/sse.rs"]
mod sse;

use crate::{
    http::{MODEL, kv_used, post, post_raw},
    poll::poll_until,
    process::Cluster,
    sse::{joined_text, sse_records},
};
use serde_json::{Value, json};
use std::time::Duration;

fn golden(name: &str) -> Value {
    let j: Value = crate::model::golden_json();
    j["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()
        .clone()
}

fn chat(content: &str, extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_answers_and_models() {
    let c = Cluster::start(2, &["worker.kv_blocks=128"]);
    // Chat at temperature 0.
    let (s, ctype, body) = post(
        &c.url("/v1/chat/completions"),
        &chat("What is the capital of France?", json!({})),
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert!(ctype.starts_with("application/json"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "The capital of France is Paris."
    );
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"],
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );

    // The golden long prompt through /v1/completions gives its golden continuation.
    let g = golden("long_prompt");
    let want_ids: Vec<u32> = g["greedy_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let body = json!({"model": MODEL, "prompt": g["prompt"], "max_tokens": want_ids.len(), "temperature": 0});
    let (s, _, text) = post(&c.url("/v1/completions"), &body).await;
    assert_eq!(s, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        v["usage"]["prompt_tokens"],
        g["prompt_ids"].as_array().unwrap().len()
    );
    assert_eq!(v["usage"]["completion_tokens"], want_ids.len());
    let want_text = g["greedy_text"].as_str().unwrap().replace("<|im_end|>", "");
    assert_eq!(v["choices"][0]["text"], want_text);
    // Token-id prompts give the same.
    let body = json!({"model": MODEL, "prompt": g["prompt_ids"], "max_tokens": want_ids.len(), "temperature": 0});
    let (_, _, text) = post(&c.url("/v1/completions"), &body).await;
    let v2: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v2["choices"][0]["text"], want_text);

    // One BOS and the system prompt once — the chat route's prompt_tokens equals an
    // offline count (template + tokenizer, no extra special tokens), and the same text sent
    // to /v1/completions counts the same.
    let fe = flotilla::request_plane::frontend::Frontend::load(
        &flotilla::model::resolve_model_path(None).unwrap(),
        8192,
    )
    .unwrap();
    let msgs = vec![
        flotilla::model::chat_template::ChatMessage {
            role: "system".into(),
            content: "You are terse.".into(),
        },
        flotilla::model::chat_template::ChatMessage {
            role: "user".into(),
            content: "Hello".into(),
        },
    ];
    let templated = fe.template.as_ref().unwrap().render(&msgs, true).unwrap();
    let offline = fe.tokenizer.encode(&templated).unwrap();
    let body = json!({"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]});
    let (_, _, t) = post(&c.url("/v1/chat/completions"), &body).await;
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], offline.len());
    assert_eq!(
        templated.matches("You are terse.").count(),
        1,
        "system prompt once"
    );
    let (_, _, t) = post(
        &c.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": templated, "max_tokens": 1}),
    )
    .await;
    let v: Value = serde_json::from_str(&t).unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens"],
        offline.len(),
        "completions counts the same"
    );

    // Metrics: latency histograms, outcomes, per-worker gauges.
    let m = reqwest::get(c.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for want in [
        "flotilla_ttft_seconds_bucket",
        "flotilla_itl_seconds_bucket",
        "flotilla_e2e_latency_seconds_bucket",
        "flotilla_requests_total{route=\"chat\",outcome=\"ok\",status=\"200\"}",
        "flotilla_prompt_tokens_total",
        "flotilla_worker_kv_blocks_total{worker=\"node-1/replica-0\"} 128",
        "flotilla_worker_waiting",
        "flotilla_requests_in_flight",
        // Latency buckets reach past a long generation (up to 600 s).
        "flotilla_e2e_latency_seconds_bucket{le=\"600\"}",
    ] {
        assert!(m.contains(want), "/metrics lacks {want}");
    }

    // Models.
    let m: Value = reqwest::get(c.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["data"][0]["id"], MODEL);
    let r = reqwest::get(c.url(&format!("/v1/models/{MODEL}")))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = reqwest::get(c.url("/v1/models/nope")).await.unwrap();
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "model_not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_framing_usage_roles_and_finish_reasons() {
    let c = Cluster::start(2, &["worker.kv_blocks=128"]);
    let url = c.url("/v1/chat/completions");
    // B01 framing + B02 usage + B03 finish_reason + B04 role, on chat.
    let body = chat(
        "Write a long essay about the sea.",
        json!({"stream": true, "max_tokens": 5, "stream_options": {"include_usage": true}}),
    );
    let (s, ctype, text) = post(&url, &body).await;
    assert_eq!(s, 200, "{text}");
    assert_eq!(ctype, "text/event-stream");
    let recs = sse_records(&text);
    assert_eq!(recs.last().unwrap(), "[DONE]");
    assert_eq!(recs.iter().filter(|r| *r == "[DONE]").count(), 1);
    let chunks = &recs[..recs.len() - 1];
    let id = chunks[0]["id"].clone();
    assert!(
        chunks
            .iter()
            .all(|r| r["id"] == id && r["object"] == "chat.completion.chunk")
    );
    let usage_chunks: Vec<_> = chunks
        .iter()
        .filter(|r| r["choices"].as_array().unwrap().is_empty())
        .collect();
    assert_eq!(usage_chunks.len(), 1, "exactly one usage chunk");
    assert!(
        chunks.last().unwrap()["choices"]
            .as_array()
            .unwrap()
            .is_empty(),
        "usage chunk last"
    );
    let u = &usage_chunks[0]["usage"];
    assert_eq!(u["completion_tokens"], 5);
    let with_choices: Vec<_> = chunks
        .iter()
        .filter(|r| !r["choices"].as_array().unwrap().is_empty())
        .collect();
    for (k, r) in with_choices.iter().enumerate() {
        assert!(
            r.get("usage").is_none_or(Value::is_null),
            "usage only in the usage chunk"
        );
        let ch = &r["choices"][0];
        assert!(
            ch.as_object().unwrap().contains_key("finish_reason"),
            "finish_reason key present"
        );
        let last = k + 1 == with_choices.len();
        if last {
            assert_eq!(ch["finish_reason"], "length");
        } else {
            assert!(ch["finish_reason"].is_null());
        }
        assert_eq!(
            ch["delta"].get("role").is_some(),
            k == 0,
            "role only in the first delta"
        );
    }
    // Non-streaming twin has the same completion_tokens; no stream_options → no usage chunk.
    let body = chat(
        "Write a long essay about the sea.",
        json!({"stream": true, "max_tokens": 5}),
    );
    let (_, _, text) = post(&url, &body).await;
    let recs = sse_records(&text);
    assert!(
        recs.iter()
            .all(|r| r == "[DONE]" || !r["choices"].as_array().unwrap().is_empty())
    );
    let body = chat(
        "Write a long essay about the sea.",
        json!({"stream": false, "stream_options": {"include_usage": true}}),
    );
    let (s, _, text) = post(&url, &body).await;
    assert_eq!(s, 400);
    let e: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(e["error"]["param"], "stream_options");

    // A stream that ends on its own, on both routes: "stop" and fewer tokens than allowed.
    let body = chat(
        "What is the capital of France?",
        json!({"stream": true, "max_tokens": 50, "stream_options": {"include_usage": true}}),
    );
    let recs = sse_records(&post(&url, &body).await.2);
    let fin: Vec<_> = recs
        .iter()
        .filter_map(|r| r["choices"].get(0))
        .filter(|c| !c["finish_reason"].is_null())
        .collect();
    assert_eq!(fin.len(), 1);
    assert_eq!(fin[0]["finish_reason"], "stop");
    let usage = recs
        .iter()
        .find(|r| r.get("usage").is_some_and(|u| !u.is_null()))
        .unwrap();
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() < 50);
    let body = json!({"model": MODEL, "prompt": "Say hi", "stream": true, "max_tokens": 8, "temperature": 0});
    let (s, _, text) = post(&c.url("/v1/completions"), &body).await;
    assert_eq!(s, 200);
    let recs = sse_records(&text);
    assert!(
        recs[..recs.len() - 1]
            .iter()
            .all(|r| r["object"] == "text_completion")
    );

    // B03(3): the legacy route follows the same rules — "length" with completion_tokens 5,
    // and "stop" on a prompt that ends on its own.
    let comp = c.url("/v1/completions");
    let body = json!({"model": MODEL, "prompt": "Write a long essay about the sea.", "stream": true, "max_tokens": 5,
                      "temperature": 0, "ignore_eos": true, "stream_options": {"include_usage": true}});
    let recs = sse_records(&post(&comp, &body).await.2);
    let fins: Vec<_> = recs
        .iter()
        .filter_map(|r| r["choices"].get(0))
        .map(|c| c["finish_reason"].clone())
        .collect();
    assert!(fins[..fins.len() - 1].iter().all(Value::is_null));
    assert_eq!(fins.last().unwrap(), "length");
    let u = recs
        .iter()
        .find(|r| r.get("usage").is_some_and(|u| !u.is_null()))
        .unwrap();
    assert_eq!(u["usage"]["completion_tokens"], 5);
    let g = golden("chat_capital");
    let body = json!({"model": MODEL, "prompt": g["prompt"], "stream": true, "max_tokens": 50, "temperature": 0});
    let recs = sse_records(&post(&comp, &body).await.2);
    let fin = recs
        .iter()
        .filter_map(|r| r["choices"].get(0))
        .find(|c| !c["finish_reason"].is_null())
        .unwrap();
    assert_eq!(fin["finish_reason"], "stop");
    assert_eq!(joined_text(&recs, 0), "The capital of France is Paris.");

    // B04(2): a choice whose only chunk is the finish chunk gets the role there (the first
    // token's text is all held back by a matching stop string).
    let body = chat(
        "What is the capital of France?",
        json!({"stream": true, "max_tokens": 1, "stop": ["The"]}),
    );
    let recs = sse_records(&post(&url, &body).await.2);
    let choices: Vec<_> = recs.iter().filter_map(|r| r["choices"].get(0)).collect();
    assert_eq!(choices.len(), 1, "{recs:?}");
    assert_eq!(choices[0]["delta"]["role"], "assistant");
    assert_eq!(choices[0]["finish_reason"], "stop");

    // n = 2: one role per choice, each choice finishes once.
    let body = chat(
        "Say hi",
        json!({"stream": true, "max_tokens": 4, "n": 2, "temperature": 0.8, "seed": 3}),
    );
    let recs = sse_records(&post(&url, &body).await.2);
    for idx in 0..2u64 {
        let mine: Vec<_> = recs
            .iter()
            .filter_map(|r| r["choices"].get(0))
            .filter(|c| c["index"] == idx)
            .collect();
        assert_eq!(
            mine.iter()
                .filter(|c| c["delta"].get("role").is_some())
                .count(),
            1,
            "choice {idx}"
        );
        assert_eq!(
            mine.iter()
                .filter(|c| !c["finish_reason"].is_null())
                .count(),
            1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_and_validation_errors() {
    let c = Cluster::start(
        2,
        &["worker.kv_blocks=128", "worker.max_model_len_tokens=512"],
    );
    let comp = c.url("/v1/completions");
    // Stream == non-stream, no stop string in the output, ends with "stop".
    for (prompt, stop) in [
        ("Here is the English alphabet: ABC", "DEFGHIJ"),
        ("Count: 1, 2, 3, 4,", " 7"),
    ] {
        let base = json!({"model": MODEL, "prompt": prompt, "stop": [stop], "max_tokens": 20, "temperature": 0, "seed": 1});
        let (_, _, text) = post(&comp, &base).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        let whole = v["choices"][0]["text"].as_str().unwrap().to_owned();
        let mut sb = base.clone();
        sb["stream"] = json!(true);
        let recs = sse_records(&post(&comp, &sb).await.2);
        assert_eq!(
            joined_text(&recs, 0),
            whole,
            "stream and non-stream agree for {stop:?}"
        );
        assert!(!whole.contains(stop));
        if stop == "DEFGHIJ" {
            // The model continues the alphabet at temperature 0: the stop string matches at
            // once, so nothing is sent.
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            assert_eq!(whole, "");
        }
        if v["choices"][0]["finish_reason"] == "stop" {
            for k in 1..stop.len() {
                assert!(
                    !whole.ends_with(&stop[..k]),
                    "ends with a prefix of the stop string"
                );
            }
        }
    }
    // B06(2): a chat stream with a multi-token stop string.
    let chat_url0 = c.url("/v1/chat/completions");
    let body = chat(
        "Repeat exactly: alpha beta gamma delta",
        json!({"stop": ["beta gamma"], "max_tokens": 20, "seed": 1}),
    );
    let (_, _, t) = post(&chat_url0, &body).await;
    let v: Value = serde_json::from_str(&t).unwrap();
    let whole = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    assert_eq!(
        joined_text(&sse_records(&post(&chat_url0, &sb).await.2), 0),
        whole
    );
    assert!(!whole.contains("beta gamma"), "{whole:?}");
    // B06(4): generation that ends on length while a possible stop prefix is held back
    // releases it: the text equals the same request without stop strings.
    let base = json!({"model": MODEL, "prompt": "Here is the English alphabet: ABC", "max_tokens": 3, "temperature": 0});
    let (_, _, t) = post(&comp, &base).await;
    let plain: Value = serde_json::from_str(&t).unwrap();
    let mut with_stop = base.clone();
    with_stop["stop"] = json!(["DEFGHIJ"]);
    with_stop["stream"] = json!(true);
    let recs = sse_records(&post(&comp, &with_stop).await.2);
    let fin = recs
        .iter()
        .filter_map(|r| r["choices"].get(0))
        .find(|c| !c["finish_reason"].is_null())
        .unwrap();
    // At temperature 0 the 3 tokens are "DEFGHI": all of it a proper prefix of the stop
    // string, held back until generation ends on length, then released.
    assert_eq!(fin["finish_reason"], "length");
    assert_eq!(plain["choices"][0]["text"], "DEFGHI");
    assert_eq!(joined_text(&recs, 0), "DEFGHI", "held-back text released");

    // Logprobs never carry the text of a stop match either.
    let body = json!({"model": MODEL, "prompt": "The capital of France is", "stop": ["Paris"], "max_tokens": 5, "temperature": 0, "logprobs": 0});
    let (s, _, t) = post(&comp, &body).await;
    assert_eq!(s, 200, "{t}");
    assert!(!t.contains("Paris"), "{t}");

    // B06(3): no special-token text in chat deltas.
    let recs = sse_records(
        &post(
            &c.url("/v1/chat/completions"),
            &chat("Say hi", json!({"stream": true, "max_tokens": 30})),
        )
        .await
        .2,
    );
    let all = joined_text(&recs, 0);
    for frag in ["<|", "im_end", "im_start"] {
        assert!(!all.contains(frag), "{all:?}");
    }

    // Max_tokens edge cases and context overflow (context 512).
    let chat_url = c.url("/v1/chat/completions");
    for (val, param) in [
        (json!(0), "max_tokens"),
        (json!(-1), "max_tokens"),
        (json!("ten"), "max_tokens"),
    ] {
        let (s, _, t) = post(&chat_url, &chat("hi", json!({"max_tokens": val}))).await;
        assert_eq!(s, 400, "{t}");
        let e: Value = serde_json::from_str(&t).unwrap();
        assert_eq!(e["error"]["param"], param);
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    let (s, _, t) = post(&chat_url, &chat("hi", json!({"max_completion_tokens": 0}))).await;
    assert_eq!(s, 400);
    assert!(t.contains("max_completion_tokens"));
    let long = "word ".repeat(700);
    let (s, _, t) = post(&comp, &json!({"model": MODEL, "prompt": long})).await;
    assert_eq!(s, 400);
    assert!(
        t.contains("512") && !t.contains("max_tokens") && !t.contains('-'),
        "{t}"
    );
    let (s, _, t) = post(
        &comp,
        &json!({"model": MODEL, "prompt": "hello", "max_tokens": 600}),
    )
    .await;
    assert_eq!(s, 400);
    assert!(t.contains("512") && t.contains("600"), "{t}");
    let (s, _, t) = post(
        &chat_url,
        &chat("hi", json!({"max_tokens": 50, "max_completion_tokens": 3})),
    )
    .await;
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&t).unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 3);
    // Streaming twins get the same 400 as JSON, before any stream.
    for extra in [json!({"temperature": -1}), json!({"top_p": 2})] {
        let mut b = chat("hi", json!({"stream": true}));
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (s, ctype, t) = post(&chat_url, &b).await;
        assert_eq!(s, 400, "{t}");
        assert!(ctype.starts_with("application/json"));
    }
    let (s, ctype, _) = post(
        &comp,
        &json!({"model": MODEL, "prompt": long, "stream": true}),
    )
    .await;
    assert_eq!(s, 400);
    assert!(ctype.starts_with("application/json"));

    // Broken, mistyped, unknown model, oversized — then a valid request still works.
    let (s, ctype, _) = post_raw(
        &chat_url,
        br#"{"model":"x","messages":[{"role":"user","content":"hi"}], x}"#.to_vec(),
    )
    .await;
    assert_eq!((s, ctype.starts_with("application/json")), (400, true));
    let (s, _, _) = post_raw(&chat_url, b"hello".to_vec()).await;
    assert_eq!(s, 400);
    let (s, _, t) = post(&chat_url, &json!({"model": MODEL, "messages": "hi"})).await;
    assert_eq!(s, 400);
    assert!(t.contains("\"param\":\"messages\""), "{t}");
    let (s, _, t) = post(&chat_url, &json!({"model": MODEL})).await;
    assert_eq!(s, 400);
    assert!(t.contains("messages"));
    // (Each route gets its own input field: the other route's is an unknown field, a 400.)
    for (url, input) in [
        (
            &chat_url,
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
        (&comp, json!({"prompt": "hi"})),
    ] {
        let mut body = input;
        body["model"] = json!("no-such-model");
        let (s, _, t) = post(url, &body).await;
        assert_eq!(s, 404, "{t}");
        let e: Value = serde_json::from_str(&t).unwrap();
        assert_eq!(e["error"]["code"], "model_not_found");
    }
    // f: a body over the limit is refused from its headers alone — the 413 arrives without
    // the body ever being sent.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = c.gateway.trim_start_matches("http://").to_owned();
        let mut sock = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            50 * 1024 * 1024
        );
        sock.write_all(head.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        let resp = String::from_utf8_lossy(&buf[..n]);
        assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
        assert!(resp.contains("application/json"), "{resp}");
    }
    let (s, _, _) = post(&chat_url, &chat("hi", json!({"max_tokens": 2}))).await;
    assert_eq!(s, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batching_never_changes_results_and_prefixes_are_reused() {
    let c = Cluster::start(3, &["worker.kv_blocks=256"]);
    let url = c.url("/v1/chat/completions");
    let prompts: Vec<(String, u32)> = (0..16)
        .map(|i| {
            (
                format!("Tell me a fact about the number {i}."),
                8 + (i % 5) * 6,
            )
        })
        .collect();
    // Solo runs, one at a time.
    let mut solo = Vec::new();
    for (p, n) in &prompts {
        let (s, _, t) = post(&url, &chat(p, json!({"max_tokens": n}))).await;
        assert_eq!(s, 200, "{t}");
        let v: Value = serde_json::from_str(&t).unwrap();
        solo.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    // All 64 at once, streaming.
    let futs = prompts.iter().map(|(p, n)| {
        let url = url.clone();
        let body = chat(p, json!({"max_tokens": n, "stream": true}));
        async move { joined_text(&sse_records(&post(&url, &body).await.2), 0) }
    });
    let together = futures::future::join_all(futs).await;
    for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
        assert_eq!(a, b, "request {i} differs when batched");
    }
    // A repeated long prompt reports cached tokens and the same output.
    let g = golden("long_prompt");
    let body = json!({"model": MODEL, "prompt": g["prompt"], "max_tokens": 6, "temperature": 0});
    let (_, _, t1) = post(&c.url("/v1/completions"), &body).await;
    let (_, _, t2) = post(&c.url("/v1/completions"), &body).await;
    let (v1, v2): (Value, Value) = (
        serde_json::from_str(&t1).unwrap(),
        serde_json::from_str(&t2).unwrap(),
    );
    assert_eq!(v1["choices"][0]["text"], v2["choices"][0]["text"]);
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Either worker may serve the repeat; a third request lands on the one that has it cached
    // under round-robin at most one placement later.
    let (_, _, t3) = post(&c.url("/v1/completions"), &body).await;
    let v3: Value = serde_json::from_str(&t3).unwrap();
    let cached3 = v3["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached.max(cached3) > 0,
        "a repeated prompt reuses cached blocks"
    );
    assert_eq!(v1["choices"][0]["text"], v3["choices"][0]["text"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_kv() {
    use futures::StreamExt;
    let c = Cluster::start(
        2,
        &["worker.kv_blocks=128", "cluster.heartbeat_interval_ms=100"],
    );
    let baseline = kv_used(&c).await;
    let body = chat(
        "Write a very long story about a dragon.",
        json!({"stream": true, "max_tokens": 1000, "ignore_eos": true}),
    );
    let resp = reqwest::Client::new()
        .post(c.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut chunks = 0;
    while chunks < 5 {
        let b = stream.next().await.unwrap().unwrap();
        chunks += String::from_utf8_lossy(&b).matches("data: ").count();
    }
    poll_until(
        Duration::from_secs(10),
        "the request holds KV blocks",
        || async { (kv_used(&c).await > baseline).then_some(()) },
    )
    .await;
    drop(stream); // the client goes away mid-stream
    poll_until(
        Duration::from_secs(10),
        "KV usage back to baseline after disconnect",
        || async { (kv_used(&c).await == baseline).then_some(()) },
    )
    .await;
    // The worker still serves.
    let (s, _, _) = post(
        &c.url("/v1/chat/completions"),
        &chat("hi", json!({"max_tokens": 2})),
    )
    .await;
    assert_eq!(s, 200);
}
