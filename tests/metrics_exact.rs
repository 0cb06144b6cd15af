//! The gateway's `/metrics` agree exactly with what the API returned: a
//! mix of plain and chat completions, streams with `include_usage`, `n` > 1, one stream
//! migrated by killing its replica, one stream its client abandons, and bad requests (400,
//! 404) against a simulated cluster; every counter's delta equals the sum of the `usage` the
//! responses carried, request by request. A second cluster, split into a prefill and a
//! decode worker (`--prefill 1 --decode 1`), does the same for disaggregated requests
//! (plain, `n` = 2, streamed, chat), each handed off from one worker to the other.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;
#[path = "common/sse.rs"]
mod sse;

use crate::http::{MODEL, fleet, post, wait_routable};
use crate::poll::poll_until;
use crate::process::Cluster;
use crate::sse::sse_records;
use futures::StreamExt;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::Duration;

/// Every sample of the gateway's `/metrics` (`name{labels}` → value), and each family's HELP.
async fn scrape(c: &Cluster) -> (BTreeMap<String, f64>, BTreeMap<String, String>) {
    let text = reqwest::get(c.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut samples = BTreeMap::new();
    let mut help = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, h) = rest.split_once(' ').unwrap_or((rest, ""));
            help.insert(name.to_owned(), h.to_owned());
        } else if !line.starts_with('#') && !line.is_empty() {
            let (series, v) = line.rsplit_once(' ').unwrap();
            samples.insert(series.to_owned(), v.parse().unwrap());
        }
    }
    (samples, help)
}

/// The sum of `name`'s series whose labels include every `key="value"` of `labels`.
fn sum(samples: &BTreeMap<String, f64>, name: &str, labels: &[&str]) -> u64 {
    samples
        .iter()
        .filter(|(s, _)| {
            let rest = &s[s.len().min(name.len())..];
            s.starts_with(name)
                && (rest.is_empty() || rest.starts_with('{'))
                && labels.iter().all(|l| rest.contains(l))
        })
        .map(|(_, v)| *v as u64)
        .sum()
}

/// What the API returned, summed.
#[derive(Default, Debug)]
struct Seen {
    /// Requests that ended normally, per route.
    ok: BTreeMap<&'static str, u64>,
    /// Refusals per status.
    rejected: BTreeMap<u16, u64>,
    prompt: u64,
    completion: u64,
    cached: u64,
}

impl Seen {
    fn usage(&mut self, route: &'static str, u: &Value) {
        assert!(u.is_object(), "usage returned: {u}");
        let prompt = u["prompt_tokens"].as_u64().unwrap();
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(cached <= prompt, "cached ≤ prompt tokens: {u}");
        assert_eq!(
            u["total_tokens"].as_u64(),
            Some(prompt + u["completion_tokens"].as_u64().unwrap())
        );
        *self.ok.entry(route).or_default() += 1;
        self.prompt += prompt;
        self.completion += u["completion_tokens"].as_u64().unwrap();
        self.cached += cached;
    }

    /// A Messages API usage (`docs/anthropic.md`): the whole prompt is `input_tokens +
    /// cache_read_input_tokens`, the cached part the latter.
    fn messages_usage(&mut self, input: u64, cache_read: u64, output: u64) {
        *self.ok.entry("messages").or_default() += 1;
        self.prompt += input + cache_read;
        self.completion += output;
        self.cached += cache_read;
    }
}

/// A Messages API request, streamed or not, that must succeed; its usage is added to `seen`.
async fn message(c: &Cluster, seen: &mut Seen, body: Value) {
    let (status, _, text) = post(&c.url("/v1/messages"), &body).await;
    assert_eq!(status, 200, "{text}");
    if body["stream"] != json!(true) {
        let v: Value = serde_json::from_str(&text).unwrap();
        let u = &v["usage"];
        let n = |k: &str| u[k].as_u64().unwrap();
        seen.messages_usage(
            n("input_tokens"),
            n("cache_read_input_tokens"),
            n("output_tokens"),
        );
        return;
    }
    // `event: X` / `data: {...}` records: the prompt's usage in message_start, the output in
    // message_delta.
    let data: Vec<Value> = text
        .split("\n\n")
        .filter_map(|r| r.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(
        data.last().map(|d| &d["type"]),
        Some(&json!("message_stop")),
        "{text}"
    );
    let start = data.iter().find(|d| d["type"] == "message_start").unwrap();
    let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    let u = &start["message"]["usage"];
    seen.messages_usage(
        u["input_tokens"].as_u64().unwrap(),
        u["cache_read_input_tokens"].as_u64().unwrap(),
        delta["usage"]["output_tokens"].as_u64().unwrap(),
    );
}

fn route_of(path: &str) -> &'static str {
    if path.contains("chat") {
        "chat"
    } else {
        "completions"
    }
}

/// A non-streamed request that must succeed; its usage is added to `seen`.
async fn plain(c: &Cluster, seen: &mut Seen, path: &str, body: Value) -> Value {
    let (status, _, text) = post(&c.url(path), &body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let n = body["n"].as_u64().unwrap_or(1);
    assert_eq!(v["choices"].as_array().unwrap().len() as u64, n);
    seen.usage(route_of(path), &v["usage"]);
    v
}

/// A streamed request with `include_usage` that must succeed; its final usage record is added
/// to `seen`.
async fn streamed(c: &Cluster, seen: &mut Seen, path: &str, mut body: Value) {
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, _, text) = post(&c.url(path), &body).await;
    assert_eq!(status, 200, "{text}");
    let records = sse_records(&text);
    assert_eq!(records.last(), Some(&json!("[DONE]")), "{text}");
    let usage = records
        .iter()
        .rev()
        .find(|r| r["usage"].is_object())
        .unwrap_or_else(|| panic!("a usage record: {text}"));
    seen.usage(route_of(path), &usage["usage"]);
}

/// A request that must be refused with `status`.
async fn refused(c: &Cluster, seen: &mut Seen, path: &str, body: Value, status: u16) {
    let (got, _, text) = post(&c.url(path), &body).await;
    assert_eq!(got, status, "{text}");
    *seen.rejected.entry(status).or_default() += 1;
}

/// The worker running a sequence, from the fleet view (heartbeats lag by up to 250 ms).
async fn busy_worker(c: &Cluster) -> String {
    // The view is as fresh as each node's last heartbeat: an earlier request's worker may
    // still show it running for a moment, and the stream's worker not yet. The answer is the
    // worker that has been the only one running for a whole second of views.
    let since: std::sync::Mutex<Option<(String, std::time::Instant)>> = Default::default();
    poll_until(
        Duration::from_secs(30),
        "a worker running the stream",
        || async {
            let now = std::time::Instant::now();
            let only = only_running(c).await;
            let mut s = since.lock().unwrap();
            match (&*s, only) {
                (Some((w, t)), Some(o)) if *w == o => {
                    (now.duration_since(*t) >= Duration::from_secs(1)).then(|| o.clone())
                }
                (_, o) => {
                    *s = o.map(|o| (o, now));
                    None
                }
            }
        },
    )
    .await
}

/// The one worker the view shows running anything, running one sequence.
async fn only_running(c: &Cluster) -> Option<String> {
    let running: Vec<Value> = fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["workers"].as_array().cloned().unwrap_or_default())
        .filter(|w| w["running"].as_u64() > Some(0))
        .collect();
    match running.as_slice() {
        [w] if w["running"] == 1 => w["id"].as_str().map(str::to_owned),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_agree_exactly_with_the_usage_the_api_returned() {
    // A gateway + router node and two simulated worker nodes; a killed replica restarts.
    let c = Cluster::start_with(3, &["--engine", "sim", "--chaos"], &[]);
    wait_routable(&c, 2).await;
    let (before, _) = scrape(&c).await;
    let mut seen = Seen::default();
    let long = "the quick brown fox jumps over the lazy dog ".repeat(12);

    // Plain completions and chat, the same prompt twice (the second one's prefix is cached).
    for _ in 0..2 {
        plain(
            &c,
            &mut seen,
            "/v1/completions",
            json!({"model": MODEL, "prompt": long, "max_tokens": 7, "ignore_eos": true}),
        )
        .await;
    }
    plain(
        &c,
        &mut seen,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
               "max_tokens": 5}),
    )
    .await;
    // n > 1: the prompt counted once, the completions summed over the choices.
    let v = plain(
        &c,
        &mut seen,
        "/v1/completions",
        json!({"model": MODEL, "prompt": long, "max_tokens": 4, "n": 3, "ignore_eos": true}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 12, "3 choices × 4 tokens");
    plain(
        &c,
        &mut seen,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": long}],
               "max_tokens": 3, "n": 2, "ignore_eos": true}),
    )
    .await;
    // Streams with usage, one with n = 2.
    streamed(
        &c,
        &mut seen,
        "/v1/completions",
        json!({"model": MODEL, "prompt": "once upon a time", "max_tokens": 6, "ignore_eos": true}),
    )
    .await;
    streamed(
        &c,
        &mut seen,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": long}],
               "max_tokens": 5, "n": 2, "ignore_eos": true}),
    )
    .await;
    // Anthropic's Messages API counts like chat: the same conversation as the chat request
    // above (its prefix cached), plain and streamed.
    for stream in [false, true] {
        message(
            &c,
            &mut seen,
            json!({"model": MODEL, "max_tokens": 4, "stream": stream,
                   "messages": [{"role": "user", "content": long}]}),
        )
        .await;
    }
    refused(
        &c,
        &mut seen,
        "/v1/messages",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        400,
    )
    .await;
    // Bad requests: 400 (no prompt; max_tokens past the context) and 404 (unknown model).
    refused(
        &c,
        &mut seen,
        "/v1/completions",
        json!({"model": MODEL, "max_tokens": 3}),
        400,
    )
    .await;
    refused(
        &c,
        &mut seen,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [], "max_tokens": 3}),
        400,
    )
    .await;
    refused(
        &c,
        &mut seen,
        "/v1/completions",
        json!({"model": "no-such-model", "prompt": "hi", "max_tokens": 3}),
        404,
    )
    .await;

    // One long stream migrated: its replica is killed mid-stream.
    let migrations = sum(&before, "flotilla_migrations_total", &[]);
    let client = reqwest::Client::new();
    let r = client
        .post(c.url("/v1/completions"))
        .json(
            &json!({"model": MODEL, "prompt": "tell a long story", "max_tokens": 3000,
                      "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut text = String::new();
    let first = tokio::time::timeout(Duration::from_secs(30), body.next())
        .await
        .expect("a first chunk")
        .expect("a chunk")
        .expect("a chunk");
    text.push_str(&String::from_utf8_lossy(&first));
    let worker = busy_worker(&c).await;
    let r = client
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "kill_actor", "actor": "replica", "target": {"worker": worker}}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{:?}", r.text().await);
    tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(chunk) = body.next().await {
            text.push_str(&String::from_utf8_lossy(
                &chunk.expect("the stream goes on"),
            ));
        }
    })
    .await
    .expect("the stream ends");
    let records = sse_records(&text);
    assert_eq!(
        records.last(),
        Some(&json!("[DONE]")),
        "the migrated stream completes"
    );
    let usage = &records
        .iter()
        .rev()
        .find(|r| r["usage"].is_object())
        .expect("a usage record")["usage"];
    assert_eq!(usage["completion_tokens"], 3000, "no token counted twice");
    seen.usage("completions", usage);

    let (after, help) = scrape(&c).await;
    assert!(
        sum(&after, "flotilla_migrations_total", &[]) > migrations,
        "the stream migrated"
    );

    // Requests by route, outcome and status.
    for route in ["completions", "chat", "messages"] {
        let r = format!("route=\"{route}\"");
        assert_eq!(
            sum(
                &after,
                "flotilla_requests_total",
                &[&r, "outcome=\"ok\"", "status=\"200\""]
            ) - sum(&before, "flotilla_requests_total", &[&r, "outcome=\"ok\""]),
            seen.ok.get(route).copied().unwrap_or(0),
            "ok {route} requests: {seen:?}"
        );
    }
    for (status, n) in &seen.rejected {
        let s = format!("status=\"{status}\"");
        assert_eq!(
            sum(
                &after,
                "flotilla_requests_total",
                &["outcome=\"rejected\"", &s]
            ) - sum(
                &before,
                "flotilla_requests_total",
                &["outcome=\"rejected\"", &s]
            ),
            *n,
            "rejected with {status}"
        );
    }
    let requests = |m: &BTreeMap<String, f64>| sum(m, "flotilla_requests_total", &[]);
    let total = seen.ok.values().sum::<u64>() + seen.rejected.values().sum::<u64>();
    assert_eq!(
        requests(&after) - requests(&before),
        total,
        "no request counted twice or not at all (no error, no cancel)"
    );

    // Tokens: exactly the usage returned.
    let delta = |name: &str| sum(&after, name, &[]) - sum(&before, name, &[]);
    assert_eq!(
        delta("flotilla_prompt_tokens_total"),
        seen.prompt,
        "prompt tokens"
    );
    assert_eq!(
        delta("flotilla_completion_tokens_total"),
        seen.completion,
        "completion tokens"
    );
    assert_eq!(
        delta("flotilla_prefix_hit_tokens_total"),
        seen.cached,
        "cached tokens"
    );
    assert!(seen.cached > 0, "a prompt sent twice hit the prefix cache");
    assert!(delta("flotilla_prefix_hit_tokens_total") <= delta("flotilla_prompt_tokens_total"));

    // Every family the mix touched says what one increment is.
    for name in [
        "flotilla_requests_total",
        "flotilla_prompt_tokens_total",
        "flotilla_completion_tokens_total",
        "flotilla_prefix_hit_tokens_total",
        "flotilla_migrations_total",
        "flotilla_router_placements_total",
        "flotilla_router_prompt_blocks_total",
        "flotilla_router_overlap_blocks_total",
        "flotilla_ttft_seconds",
        "flotilla_itl_seconds",
        "flotilla_e2e_latency_seconds",
    ] {
        let h = help
            .get(name)
            .unwrap_or_else(|| panic!("{name} has a HELP"));
        assert!(
            [
                "per request",
                "per choice",
                "per token",
                "per attempt",
                "per placement",
                "per migration"
            ]
            .iter()
            .any(|b| h.contains(b)),
            "{name}'s HELP states its basis: {h}"
        );
    }

    // A stream its client abandons: counted once, as cancelled, and none of its tokens.
    let (before, _) = scrape(&c).await;
    let r = client
        .post(c.url("/v1/completions"))
        .json(
            &json!({"model": MODEL, "prompt": "abandon me", "max_tokens": 3000,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    tokio::time::timeout(Duration::from_secs(30), body.next())
        .await
        .expect("a first chunk");
    drop(body);
    poll_until(
        Duration::from_secs(30),
        "the abandoned stream counted",
        || async {
            let (now, _) = scrape(&c).await;
            (sum(&now, "flotilla_requests_total", &["outcome=\"cancelled\""])
                > sum(
                    &before,
                    "flotilla_requests_total",
                    &["outcome=\"cancelled\""],
                ))
            .then_some(())
        },
    )
    .await;
    let (after, _) = scrape(&c).await;
    assert_eq!(
        sum(&after, "flotilla_requests_total", &[]) - sum(&before, "flotilla_requests_total", &[]),
        1,
        "counted once"
    );
    for name in [
        "flotilla_prompt_tokens_total",
        "flotilla_completion_tokens_total",
    ] {
        assert_eq!(
            sum(&after, name, &[]),
            sum(&before, name, &[]),
            "{name}: a cancelled request returned no usage"
        );
    }
}

/// Generated tokens per worker, from the fleet view.
async fn generated(c: &Cluster) -> BTreeMap<String, u64> {
    fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["workers"].as_array().cloned().unwrap_or_default())
        .filter_map(|w| {
            Some((
                w["id"].as_str()?.to_owned(),
                w["generated_tokens"].as_u64()?,
            ))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_requests_are_counted_exactly() {
    // A gateway + router node, one prefill and one decode worker node; every prompt of 8
    // tokens or more is prefilled on node-1 and decoded on node-2.
    let c = Cluster::start_with(
        3,
        &["--engine", "sim", "--prefill", "1", "--decode", "1"],
        &["disagg.min_prefill_tokens=8"],
    );
    wait_routable(&c, 2).await;
    let (before, _) = scrape(&c).await;
    let gen_before = generated(&c).await;
    let mut seen = Seen::default();
    let long =
        "a disaggregated request is prefilled on one worker and decoded on another ".repeat(4);
    for _ in 0..2 {
        plain(
            &c,
            &mut seen,
            "/v1/completions",
            json!({"model": MODEL, "prompt": long, "max_tokens": 9, "ignore_eos": true}),
        )
        .await;
    }
    plain(
        &c,
        &mut seen,
        "/v1/completions",
        json!({"model": MODEL, "prompt": long, "max_tokens": 4, "n": 2, "ignore_eos": true}),
    )
    .await;
    streamed(
        &c,
        &mut seen,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": long}],
               "max_tokens": 6, "ignore_eos": true}),
    )
    .await;
    let choices = 5;

    // Each choice was handed off: the prefill worker sampled its first token, the decode
    // worker the rest (the view lags by a heartbeat).
    let completion = seen.completion;
    let gen_after = poll_until(Duration::from_secs(10), "the workers' counts", || async {
        let g = generated(&c).await;
        let total: u64 = g.values().sum::<u64>() - gen_before.values().sum::<u64>();
        (total >= completion).then_some(g)
    })
    .await;
    let delta =
        |w: &str| gen_after.get(w).copied().unwrap_or(0) - gen_before.get(w).copied().unwrap_or(0);
    assert_eq!(
        delta("node-1/replica-0"),
        choices,
        "one first token per choice on the prefill worker"
    );
    assert_eq!(
        delta("node-2/replica-0"),
        completion - choices,
        "the rest on the decode worker"
    );

    let (after, _) = scrape(&c).await;
    let d = |name: &str| sum(&after, name, &[]) - sum(&before, name, &[]);
    assert_eq!(
        d("flotilla_requests_total"),
        seen.ok.values().sum::<u64>(),
        "{seen:?}"
    );
    assert_eq!(
        d("flotilla_prompt_tokens_total"),
        seen.prompt,
        "prompt tokens"
    );
    assert_eq!(
        d("flotilla_completion_tokens_total"),
        seen.completion,
        "completion tokens"
    );
    assert_eq!(
        d("flotilla_prefix_hit_tokens_total"),
        seen.cached,
        "cached tokens"
    );
    assert!(
        seen.cached > 0,
        "the prompt sent again hit the prefill worker's cache"
    );
}
