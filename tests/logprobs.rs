//! Log-probabilities with alternatives on the real model: chat
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

/// The golden long prompt's first `n` token ids (`tests/data/smollm2-golden.json`).
fn golden_ids(n: usize) -> Vec<u64> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/smollm2-golden.json"
    );
    let j: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let case = j["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "long_prompt")
        .unwrap();
    case["prompt_ids"].as_array().unwrap()[..n]
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// A completions `logprobs` object as `(tokens, token_logprobs, top_logprobs, text_offset)`.
struct Lp {
    tokens: Vec<String>,
    logprobs: Vec<Option<f64>>,
    top: Vec<Option<serde_json::Map<String, Value>>>,
    offsets: Vec<u64>,
}

fn lp_of(v: &Value) -> Lp {
    let arr = |k: &str| {
        v[k].as_array()
            .unwrap_or_else(|| panic!("{k}: {v}"))
            .clone()
    };
    Lp {
        tokens: arr("tokens")
            .iter()
            .map(|t| t.as_str().unwrap().to_owned())
            .collect(),
        logprobs: arr("token_logprobs").iter().map(Value::as_f64).collect(),
        top: arr("top_logprobs")
            .iter()
            .map(|t| t.as_object().cloned())
            .collect(),
        offsets: arr("text_offset")
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect(),
    }
}

async fn complete(c: &Cluster, body: Value) -> Value {
    let (status, _, text) = post(&c.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{body}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// Two alternative maps agree: the same tokens, logprobs within 1e-3.
fn same_top(a: &serde_json::Map<String, Value>, b: &serde_json::Map<String, Value>, what: &str) {
    let mut ka: Vec<_> = a.keys().collect();
    let mut kb: Vec<_> = b.keys().collect();
    ka.sort();
    kb.sort();
    assert_eq!(ka, kb, "{what}: {a:?} vs {b:?}");
    for (k, x) in a {
        let (x, y) = (x.as_f64().unwrap(), b[k].as_f64().unwrap());
        assert!((x - y).abs() < 1e-3, "{what}: {k:?} {x} vs {y}");
    }
}

/// Echo on `/v1/completions`, what evaluation harnesses send: the prompt's
/// tokens scored by the model — the first `null`, each later one log P(token | the tokens
/// before it) with its alternatives, exactly what a completion of the prompt's prefix gives
/// for its next token — with `max_tokens: 0` (the prompt alone) or followed by the completion,
/// streamed and not, twice (a prompt whose prefix is cached scores the same: echo computes every
/// position), for token-id, text and batch prompts; bad input refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_scores_the_prompt_as_the_model_reads_it() {
    let c = Cluster::start(2, &["worker.kv_blocks=128"]);
    wait_routable(&c, 1).await;
    let ids = golden_ids(20);
    let echo = |max_tokens: u32| {
        json!({"model": MODEL, "prompt": ids, "echo": true, "max_tokens": max_tokens,
               "logprobs": 5, "temperature": 0})
    };

    // The prompt alone.
    let alone = complete(&c, echo(0)).await;
    let ch = &alone["choices"][0];
    assert_eq!(ch["finish_reason"], "length", "{alone}");
    assert_eq!(alone["usage"]["prompt_tokens"], 20);
    assert_eq!(alone["usage"]["completion_tokens"], 0);
    assert_eq!(
        alone["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "every prompt position computed"
    );
    let lp = lp_of(&ch["logprobs"]);
    assert_eq!(lp.tokens.len(), 20);
    assert_eq!(
        ch["text"].as_str().unwrap(),
        lp.tokens.concat(),
        "text = the prompt"
    );
    assert_eq!(lp.logprobs[0], None, "the first token has no logprob");
    assert!(lp.top[0].is_none(), "nor alternatives");
    assert_eq!(lp.offsets[0], 0);
    assert!(lp.offsets.windows(2).all(|w| w[0] <= w[1]));
    for k in 1..20 {
        let l = lp.logprobs[k].unwrap();
        assert!(l.is_finite() && l <= 0.0, "token {k}: {l}");
        let top = lp.top[k].as_ref().unwrap();
        assert!(!top.is_empty() && top.len() <= 5);
    }

    // Each prompt token's score is what the model gives it after the tokens before it: the
    // next-token alternatives of a completion of the prefix (greedy, one token).
    for k in 1..20 {
        let step = complete(
            &c,
            json!({"model": MODEL, "prompt": &ids[..k], "max_tokens": 1, "logprobs": 5,
                   "temperature": 0}),
        )
        .await;
        let s = lp_of(&step["choices"][0]["logprobs"]);
        let top = s.top[0].as_ref().unwrap();
        same_top(lp.top[k].as_ref().unwrap(), top, &format!("token {k}"));
        if let Some(x) = top.get(&lp.tokens[k]).and_then(Value::as_f64) {
            let l = lp.logprobs[k].unwrap();
            assert!((x - l).abs() < 1e-3, "token {k}: {l} vs {x}");
        }
    }

    // The prompt, then 3 tokens: the prompt's part as above, the rest as a plain completion.
    let both = complete(&c, echo(3)).await;
    let plain = complete(
        &c,
        json!({"model": MODEL, "prompt": ids, "max_tokens": 3, "logprobs": 5, "temperature": 0}),
    )
    .await;
    let b = lp_of(&both["choices"][0]["logprobs"]);
    let p = lp_of(&plain["choices"][0]["logprobs"]);
    assert_eq!(both["usage"]["completion_tokens"], 3);
    assert_eq!(b.tokens.len(), 20 + p.tokens.len());
    assert_eq!(
        both["choices"][0]["text"].as_str().unwrap(),
        format!(
            "{}{}",
            ch["text"].as_str().unwrap(),
            plain["choices"][0]["text"].as_str().unwrap()
        )
    );
    assert_eq!(b.tokens[..20], lp.tokens[..]);
    assert_eq!(b.tokens[20..], p.tokens[..]);
    assert_eq!(b.logprobs[0], None);
    for k in 1..b.tokens.len() {
        let (x, want, wtop) = if k < 20 {
            (b.logprobs[k], lp.logprobs[k], &lp.top[k])
        } else {
            (b.logprobs[k], p.logprobs[k - 20], &p.top[k - 20])
        };
        assert!((x.unwrap() - want.unwrap()).abs() < 1e-3, "entry {k}");
        same_top(
            b.top[k].as_ref().unwrap(),
            wtop.as_ref().unwrap(),
            &format!("entry {k}"),
        );
    }
    let text_len = ch["text"].as_str().unwrap().chars().count() as u64;
    assert_eq!(
        b.offsets[20], text_len,
        "the completion's offsets follow the prompt"
    );

    // Streamed: the prompt (with its logprobs) in the first chunk, then the tokens; the same
    // text and logprobs as the whole answer.
    let mut body = echo(3);
    body["stream"] = json!(true);
    let (status, _, text) = post(&c.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{text}");
    let records: Vec<Value> = sse_records(&text)
        .into_iter()
        .filter(|r| r.is_object() && r["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(
        records[0]["choices"][0]["text"], ch["text"],
        "the prompt first"
    );
    let first = lp_of(&records[0]["choices"][0]["logprobs"]);
    assert_eq!(first.tokens, lp.tokens);
    assert_eq!(first.logprobs[0], None);
    let streamed: String = records
        .iter()
        .filter_map(|r| r["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, both["choices"][0]["text"].as_str().unwrap());
    let s_lps: Vec<Option<f64>> = records
        .iter()
        .flat_map(|r| lp_of(&r["choices"][0]["logprobs"]).logprobs)
        .collect();
    assert_eq!(s_lps.len(), b.logprobs.len());
    for (x, y) in s_lps.iter().zip(&b.logprobs) {
        assert_eq!(x.is_none(), y.is_none());
        if let (Some(x), Some(y)) = (x, y) {
            assert!((x - y).abs() < 1e-3);
        }
    }
    let offsets: Vec<u64> = records
        .iter()
        .flat_map(|r| lp_of(&r["choices"][0]["logprobs"]).offsets)
        .collect();
    assert_eq!(
        offsets, b.offsets,
        "streamed offsets run over the whole text"
    );

    // Again: the prompt's blocks are cached by now (the plain completion above used them), and
    // echo still computes every position: the same scores, nothing reported cached.
    let again = complete(&c, echo(0)).await;
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let a = lp_of(&again["choices"][0]["logprobs"]);
    assert_eq!(a.tokens, lp.tokens);
    for k in 1..20 {
        assert!((a.logprobs[k].unwrap() - lp.logprobs[k].unwrap()).abs() < 1e-3);
    }
    // And the cache is intact: a plain request still hits it.
    let hit = complete(
        &c,
        json!({"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}),
    )
    .await;
    assert!(
        hit["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{hit}"
    );

    // Text prompts, a list of them, n = 2: each choice's text starts with its own prompt, its
    // logprobs with its prompt's tokens; usage sums the prompts. Without logprobs, text only.
    let prompts = ["The capital of France is", "One, two, three,"];
    let batch = complete(
        &c,
        json!({"model": MODEL, "prompt": prompts, "n": 2, "echo": true, "max_tokens": 2,
               "logprobs": 1, "temperature": 0}),
    )
    .await;
    let choices = batch["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let mut prompt_tokens = 0;
    for p in prompts {
        let one = complete(
            &c,
            json!({"model": MODEL, "prompt": p, "echo": true, "max_tokens": 0, "logprobs": 1}),
        )
        .await;
        assert_eq!(one["choices"][0]["text"], p, "a text prompt echoes as sent");
        prompt_tokens += one["usage"]["prompt_tokens"].as_u64().unwrap();
    }
    assert_eq!(
        batch["usage"]["prompt_tokens"].as_u64().unwrap(),
        prompt_tokens
    );
    assert_eq!(batch["usage"]["completion_tokens"], 8);
    for ch in choices {
        let i = ch["index"].as_u64().unwrap() as usize;
        let p = prompts[i / 2];
        let text = ch["text"].as_str().unwrap();
        assert!(text.starts_with(p) && text.len() > p.len(), "{i}: {text:?}");
        let l = lp_of(&ch["logprobs"]);
        assert_eq!(l.logprobs[0], None, "{i}");
        assert!(l.tokens.concat().starts_with(p), "{i}: {:?}", l.tokens);
    }
    let bare = complete(
        &c,
        json!({"model": MODEL, "prompt": "Once upon a time", "echo": true, "max_tokens": 3,
               "temperature": 0}),
    )
    .await;
    assert!(bare["choices"][0]["logprobs"].is_null());
    assert!(
        bare["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Once upon a time")
    );

    // Bad input: refused by name, never served.
    for (path, body, param) in [
        ("/v1/chat/completions", chat(json!({"echo": true})), "echo"),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "echo": true, "best_of": 2}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "echo": 1}),
            "echo",
        ),
    ] {
        let (status, _, text) = post(&c.url(path), &body).await;
        assert_eq!(status, 400, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{text}");
    }
}

/// Disaggregated echo: the prefill worker computes the prompt's scores (the decode worker only
/// pulls its KV); the answer is the aggregated one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_echo_scores_on_the_prefill_worker() {
    let ids = golden_ids(20);
    let body = json!({"model": MODEL, "prompt": ids, "echo": true, "max_tokens": 3,
                      "logprobs": 2, "temperature": 0});
    let reference = {
        let c = Cluster::start(2, &["worker.kv_blocks=128"]);
        wait_routable(&c, 1).await;
        complete(&c, body.clone()).await
    };
    let c = Cluster::start_with(
        3,
        &["--prefill", "1", "--decode", "1"],
        &["worker.kv_blocks=128", "disagg.min_prefill_tokens=8"],
    );
    wait_routable(&c, 2).await;
    let got = complete(&c, body).await;
    assert_eq!(got["choices"][0]["text"], reference["choices"][0]["text"]);
    let (g, r) = (
        lp_of(&got["choices"][0]["logprobs"]),
        lp_of(&reference["choices"][0]["logprobs"]),
    );
    assert_eq!(g.tokens, r.tokens);
    assert_eq!(g.logprobs[0], None);
    for k in 1..g.tokens.len() {
        assert!(
            (g.logprobs[k].unwrap() - r.logprobs[k].unwrap()).abs() < 1e-3,
            "entry {k}"
        );
        same_top(
            g.top[k].as_ref().unwrap(),
            r.top[k].as_ref().unwrap(),
            &format!("entry {k}"),
        );
    }
    assert_eq!(got["usage"]["completion_tokens"], 3);
}
