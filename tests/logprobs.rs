//! Log-probabilities with alternatives (issue 33 item 6) on the real model: chat
//! `top_logprobs` and completions `logprobs: N`, streamed and not. The alternatives come from
//! the logits the worker sampled from, so they agree with the chosen token's logprob (greedy:
//! the chosen token is the first alternative, with the same logprob), they are ordered, they
//! are probabilities (their mass ≤ 1), a stream carries the same ones as the whole answer, and
//! a disaggregated request (first token from the prefill worker, the rest from the decode
//! worker) carries the same ones as an aggregated one.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;
#[path = "common/sse.rs"]
mod sse;

use crate::http::{MODEL, post, wait_routable};
use crate::process::Cluster;
use crate::sse::sse_records;
use serde_json::{Value, json};

const PROMPT: &str = "Name three colours of the rainbow.";

fn chat(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                       "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 5});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// `(token, logprob, [(alternative, logprob)])` per token of a chat `logprobs.content`.
type Entry = (String, f64, Vec<(String, f64)>);

fn entries(content: &Value) -> Vec<Entry> {
    content
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let top = e["top_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    (
                        t["token"].as_str().unwrap().to_owned(),
                        t["logprob"].as_f64().unwrap(),
                    )
                })
                .collect();
            (
                e["token"].as_str().unwrap().to_owned(),
                e["logprob"].as_f64().unwrap(),
                top,
            )
        })
        .collect()
}

/// Greedy entries: five ordered alternatives, the chosen token first with its own logprob,
/// a mass of at most 1.
fn check_greedy(es: &[Entry]) {
    assert!(!es.is_empty());
    for (token, lp, top) in es {
        assert_eq!(top.len(), 5, "{token:?}: {top:?}");
        assert!(*lp <= 0.0);
        assert_eq!(
            &top[0].0, token,
            "greedy: the chosen token is the most likely"
        );
        assert!(
            (top[0].1 - lp).abs() < 1e-6,
            "the same distribution: {lp} vs {top:?}"
        );
        assert!(
            top.windows(2).all(|w| w[0].1 >= w[1].1),
            "best first: {top:?}"
        );
        let mass: f64 = top.iter().map(|t| t.1.exp()).sum();
        assert!(mass <= 1.0 + 1e-4, "probabilities: {mass}");
    }
}

async fn chat_entries(c: &Cluster, extra: Value) -> Vec<Entry> {
    let (status, _, text) = post(&c.url("/v1/chat/completions"), &chat(extra)).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    entries(&v["choices"][0]["logprobs"]["content"])
}

async fn streamed_entries(c: &Cluster) -> Vec<Entry> {
    let (status, _, text) = post(
        &c.url("/v1/chat/completions"),
        &chat(json!({"stream": true})),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    sse_records(&text)
        .iter()
        .filter(|r| r.is_object())
        .filter_map(|r| r["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flat_map(|a| entries(&Value::Array(a)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alternatives_agree_with_the_sampled_tokens_everywhere() {
    let reference = {
        let c = Cluster::start(2, &["worker.kv_blocks=128"]);
        wait_routable(&c, 1).await;
        let whole = chat_entries(&c, json!({})).await;
        check_greedy(&whole);
        let streamed = streamed_entries(&c).await;
        assert_eq!(
            streamed, whole,
            "a stream carries the same tokens and alternatives"
        );

        // Completions: `logprobs: 3`, sampled (seeded): each token's alternatives are a map of
        // at most 3; the chosen token is among them with its logprob, or less likely than all.
        let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12,
                          "temperature": 1.0, "seed": 7, "logprobs": 3});
        let (status, _, text) = post(&c.url("/v1/completions"), &body).await;
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let lp = &v["choices"][0]["logprobs"];
        let tokens = lp["tokens"].as_array().unwrap();
        let top = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(tokens.len(), top.len());
        for ((t, l), alts) in tokens
            .iter()
            .zip(lp["token_logprobs"].as_array().unwrap())
            .zip(top)
        {
            let (t, l) = (t.as_str().unwrap(), l.as_f64().unwrap());
            let alts = alts.as_object().unwrap();
            assert!(!alts.is_empty() && alts.len() <= 3, "{alts:?}");
            let least = alts.values().filter_map(Value::as_f64).fold(0.0, f64::min);
            match alts.get(t).and_then(Value::as_f64) {
                Some(a) => assert!(a >= l - 1e-6, "{t:?}: {a} vs {l}"),
                None => assert!(l <= least + 1e-6, "{t:?} ({l}) not among {alts:?}"),
            }
        }

        // Over the bounds: refused by name, never served.
        for (path, body, param) in [
            (
                "/v1/chat/completions",
                chat(json!({"top_logprobs": 21})),
                "top_logprobs",
            ),
            (
                "/v1/completions",
                json!({"model": MODEL, "prompt": "x", "max_tokens": 2, "logprobs": 6}),
                "logprobs",
            ),
            (
                "/v1/chat/completions",
                chat(json!({"top_logprobs": "five"})),
                "top_logprobs",
            ),
        ] {
            let (status, _, text) = post(&c.url(path), &body).await;
            assert_eq!(status, 400, "{text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["error"]["param"], param, "{text}");
        }
        whole
    };

    // Disaggregated: the first token and its alternatives from the prefill worker, the rest
    // from the decode worker, on pulled KV: the same as aggregated serving.
    let c = Cluster::start_with(
        3,
        &["--prefill", "1", "--decode", "1"],
        &["worker.kv_blocks=128", "disagg.min_prefill_tokens=8"],
    );
    wait_routable(&c, 2).await;
    let disagg = chat_entries(&c, json!({})).await;
    check_greedy(&disagg);
    assert_eq!(disagg.len(), reference.len());
    for (d, r) in disagg.iter().zip(&reference) {
        assert_eq!(d.0, r.0, "the same tokens");
        let ids = |e: &Entry| e.2.iter().map(|t| t.0.clone()).collect::<Vec<_>>();
        assert_eq!(ids(d), ids(r), "the same alternatives");
        for (a, b) in d.2.iter().zip(&r.2) {
            assert!((a.1 - b.1).abs() < 1e-3, "{a:?} vs {b:?}");
        }
    }
}
