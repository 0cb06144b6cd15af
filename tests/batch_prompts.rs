//! B23 against a live cluster (real processes, raw HTTP): a list of prompts on
//! `/v1/completions` — strings or token-id lists, `n` per prompt, indexes prompt-major, each
//! text equal to its prompt sent alone (temperature 0), `usage` summed, streamed with one usage
//! record; the prompts placed on their own (on both workers here); `/metrics` counting one
//! request with the summed tokens; the access line listing the workers; and the bad lists
//! refused with a 400 naming `prompt` before any worker sees them.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;
#[path = "common/sse.rs"]
mod sse;

use crate::{http::MODEL, process::Cluster};
use serde_json::{Value, json};

const PROMPTS: [&str; 3] = ["The capital of France is", "One, two, three,", "The sky is"];

fn completion(prompt: Value, extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// POST to `/v1/completions` with `headers`: status and body text.
async fn post(c: &Cluster, body: &Value, headers: &[(&str, &str)]) -> (u16, String) {
    let mut r = reqwest::Client::new()
        .post(c.url("/v1/completions"))
        .json(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn post_ok(c: &Cluster, body: &Value, headers: &[(&str, &str)]) -> Value {
    let (s, text) = post(c, body, headers).await;
    assert_eq!(s, 200, "{body}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// The answer of one prompt sent alone: text, prompt tokens, completion tokens.
async fn alone(c: &Cluster, prompt: Value) -> (String, u64, u64) {
    let v = post_ok(c, &completion(prompt, json!({})), &[]).await;
    (
        v["choices"][0]["text"].as_str().unwrap().to_owned(),
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

/// The choices' texts by index, after checking they are in order `0..len`.
fn texts(v: &Value) -> Vec<String> {
    let choices = v["choices"].as_array().unwrap();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "choices in index order: {v}");
    }
    choices
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_list_of_prompts_is_answered_prompt_by_prompt() {
    let (c, logs) = Cluster::start_logged(
        3,
        &[],
        &["worker.kv_blocks=128"],
        &[("FLOTILLA_LOG", "info,ractor_cluster=error,ractor=warn")],
    );
    http::wait_routable(&c, 2).await;
    let tag = format!("{:08x}", rand::random::<u32>());

    let singles = {
        let mut v = Vec::new();
        for p in PROMPTS {
            v.push(alone(&c, json!(p)).await);
        }
        v
    };
    let want: Vec<String> = singles.iter().map(|s| s.0.clone()).collect();
    let prompt_sum: u64 = singles.iter().map(|s| s.1).sum();
    let completion_sum: u64 = singles.iter().map(|s| s.2).sum();

    // ----- The B23 trigger: three prompts, placed round robin so both workers take some.
    let before = (
        http::metric_sum(&c, "flotilla_requests_total").await,
        http::metric_sum(&c, "flotilla_prompt_tokens_total").await,
        http::metric_sum(&c, "flotilla_completion_tokens_total").await,
    );
    let id = format!("b23-{tag}");
    let v = post_ok(
        &c,
        &completion(json!(PROMPTS), json!({})),
        &[
            ("x-request-id", id.as_str()),
            ("x-flotilla-route-policy", "round_robin"),
        ],
    )
    .await;
    assert_eq!(texts(&v), want, "each text as its prompt alone: {v}");
    assert!(
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["finish_reason"].is_string())
    );
    assert_eq!(v["usage"]["prompt_tokens"], prompt_sum, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], completion_sum, "{v}");
    assert_eq!(v["usage"]["total_tokens"], prompt_sum + completion_sum);
    // One request in /metrics, with the summed tokens.
    let after = (
        http::metric_sum(&c, "flotilla_requests_total").await,
        http::metric_sum(&c, "flotilla_prompt_tokens_total").await,
        http::metric_sum(&c, "flotilla_completion_tokens_total").await,
    );
    assert_eq!(after.0 - before.0, 1, "one request counted");
    assert_eq!(after.1 - before.1, prompt_sum, "prompt tokens summed");
    assert_eq!(
        after.2 - before.2,
        completion_sum,
        "completion tokens summed"
    );
    // The access line lists the workers: the prompts ran on both.
    let line = poll::poll_until(
        std::time::Duration::from_secs(10),
        "the access line",
        || async {
            logs.matching(&id)
                .into_iter()
                .find(|l| l.contains("request done"))
        },
    )
    .await;
    for w in ["node-1/replica-0", "node-2/replica-0"] {
        assert!(line.contains(w), "{w} in {line}");
    }

    // ----- n = 2: index = prompt_index × 2 + j, usage counts each prompt once.
    let v = post_ok(&c, &completion(json!(PROMPTS), json!({"n": 2})), &[]).await;
    let got = texts(&v);
    assert_eq!(got.len(), 6);
    for (i, t) in got.iter().enumerate() {
        assert_eq!(t, &want[i / 2], "choice {i}");
    }
    assert_eq!(v["usage"]["prompt_tokens"], prompt_sum);
    assert_eq!(v["usage"]["completion_tokens"], 2 * completion_sum);

    // ----- Streamed with include_usage: every index, one finish each, one usage, [DONE].
    let body = completion(
        json!(PROMPTS),
        json!({"n": 2, "stream": true, "stream_options": {"include_usage": true}}),
    );
    let (s, text) = post(&c, &body, &[]).await;
    assert_eq!(s, 200, "{text}");
    let records = sse::sse_records(&text);
    assert_eq!(records.last().unwrap(), "[DONE]");
    for i in 0..6u64 {
        assert_eq!(
            sse::joined_text(&records, i),
            want[i as usize / 2],
            "streamed {i}"
        );
        let finishes = records
            .iter()
            .flat_map(|r| r["choices"].as_array().cloned().unwrap_or_default())
            .filter(|c| c["index"] == i && !c["finish_reason"].is_null())
            .count();
        assert_eq!(finishes, 1, "one finish_reason for index {i}");
    }
    let usages: Vec<&Value> = records
        .iter()
        .filter(|r| r.get("usage").is_some_and(|u| !u.is_null()))
        .collect();
    assert_eq!(usages.len(), 1, "one usage record");
    assert_eq!(usages[0]["usage"]["prompt_tokens"], prompt_sum);
    assert_eq!(usages[0]["usage"]["completion_tokens"], 2 * completion_sum);

    // ----- Token-id lists, each against the same ids sent alone.
    let ids = [json!([1, 2, 3, 4]), json!([5, 6, 7, 8])];
    let mut want_ids = Vec::new();
    let mut sum = 0;
    for p in &ids {
        let (t, pt, _) = alone(&c, p.clone()).await;
        assert_eq!(pt, 4);
        sum += pt;
        want_ids.push(t);
    }
    let v = post_ok(&c, &completion(json!(ids), json!({})), &[]).await;
    assert_eq!(texts(&v), want_ids);
    assert_eq!(v["usage"]["prompt_tokens"], sum);

    // ----- Bad lists: 400 naming `prompt`, and nothing reaches a worker.
    let placed = http::placements(&c).await;
    let long = "word ".repeat(20000);
    let over: Vec<String> = (0..65).map(|i| format!("p{i}")).collect();
    let half: Vec<String> = (0..33).map(|i| format!("p{i}")).collect();
    for (prompt, extra, says) in [
        (json!([]), json!({}), "must not be empty"),
        (
            json!(["a", [1, 2]]),
            json!({}),
            "mixes strings and token-id lists",
        ),
        (json!([[1, 2], "a"]), json!({}), "prompt[1]"),
        (json!(["a", ""]), json!({}), "prompt[1] must not be empty"),
        (json!([[1], []]), json!({}), "prompt[1] must not be empty"),
        (json!([[1], [2.5]]), json!({}), "prompt[1]"),
        (
            json!([[1], [99999999]]),
            json!({}),
            "prompt[1] token id 99999999",
        ),
        (json!(over), json!({}), "at most 64"),
        (json!(half), json!({"n": 2}), "at most 64"),
        (
            json!(["a", long]),
            json!({}),
            "prompt[1]: This model's maximum context",
        ),
    ] {
        let (s, text) = post(&c, &completion(prompt.clone(), extra), &[]).await;
        assert_eq!(s, 400, "{prompt}: {text}");
        let e: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(e["error"]["param"], "prompt", "{text}");
        let m = e["error"]["message"].as_str().unwrap();
        assert!(m.contains(says), "{says} in {m}");
    }
    assert_eq!(
        http::placements(&c).await,
        placed,
        "no refused prompt was placed"
    );
}
