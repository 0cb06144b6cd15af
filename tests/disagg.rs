//! Disaggregated prefill and decode on real processes (`flotilla up --prefill 1 --decode 1`,
//! the real model): the same answers as aggregated serving, only the missing KV blocks moved
//! (their bytes on the gateway's `/metrics`), a run-time role change, and B10 (C)/(D) — a
//! transfer delayed by chaos, cancelled by its client or losing its prefill worker, frees both
//! sides (cases in `../shared/cases/`).

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::{MODEL, fleet, post, wait_routable};
use crate::poll::poll_until;
use crate::process::Cluster;
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::Duration;

const PREFILL: &str = "node-1/replica-0";
const DECODE: &str = "node-2/replica-0";

/// One prefill and one decode worker node; every prompt of 8 tokens or more is prefilled
/// remotely. `sets`: more configuration.
fn cluster(sets: &[&str]) -> Cluster {
    let mut all = vec!["worker.kv_blocks=256", "disagg.min_prefill_tokens=8"];
    all.extend_from_slice(sets);
    Cluster::start_with(3, &["--chaos", "--prefill", "1", "--decode", "1"], &all)
}

fn golden(name: &str) -> Value {
    let j: Value =
        serde_json::from_str(include_str!("data/smollm2-golden.json")).expect("golden json");
    j["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()
        .clone()
}

/// A golden case's greedy continuation as the completions route returns it.
fn greedy_text(name: &str) -> String {
    golden(name)["greedy_text"]
        .as_str()
        .unwrap()
        .replace("<|im_end|>", "")
}

/// A worker's entry in the fleet view.
async fn worker(c: &Cluster, id: &str) -> Value {
    fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["workers"].as_array().unwrap().clone())
        .find(|w| w["id"] == id)
        .unwrap_or(Value::Null)
}

/// Until the fleet view shows `id`'s `field` satisfying `ok` (heartbeats lag by up to 250 ms).
async fn wait_worker(c: &Cluster, id: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    poll_until(Duration::from_secs(30), what, || async {
        let w = worker(c, id).await;
        ok(&w).then_some(w)
    })
    .await
}

/// Both workers back at their idle state: no blocks used or held, no pull pending.
async fn wait_idle(c: &Cluster, what: &str) {
    for id in [PREFILL, DECODE] {
        wait_worker(c, id, what, |w| {
            w["kv_blocks_used"] == 0 && w["kv_held"] == 0 && w["kv_pulls_pending"] == 0
        })
        .await;
    }
}

async fn completion(c: &Cluster, body: Value) -> Value {
    let (s, _, text) = post(&c.url("/v1/completions"), &body).await;
    assert_eq!(s, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// Stream a completion; `hook` runs once `mark` chunks with text have arrived. Returns the
/// text and whether the stream ended with `[DONE]` and no error record.
async fn stream(
    c: &Cluster,
    mut body: Value,
    mark: usize,
    hook: impl AsyncFnOnce(),
) -> (String, bool) {
    body["stream"] = json!(true);
    let resp = reqwest::Client::new()
        .post(c.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut bytes = resp.bytes_stream();
    let (mut text, mut buf, mut clean, mut chunks) = (String::new(), String::new(), false, 0);
    let mut hook = Some(hook);
    while let Some(b) = bytes.next().await {
        buf.push_str(&String::from_utf8_lossy(&b.unwrap()));
        while let Some(pos) = buf.find("\n\n") {
            let rec: String = buf.drain(..pos + 2).collect();
            let Some(data) = rec.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                clean = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            assert!(v.get("error").is_none(), "error record: {v}");
            if let Some(t) = v["choices"][0]["text"].as_str().filter(|t| !t.is_empty()) {
                text.push_str(t);
                chunks += 1;
            }
        }
        if chunks >= mark
            && let Some(h) = hook.take()
        {
            h().await;
        }
    }
    (text, clean)
}

async fn chaos(c: &Cluster, fault: Value) {
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&fault)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
}

fn long_prompt(max_tokens: usize) -> Value {
    let g = golden("long_prompt");
    json!({"model": MODEL, "prompt": g["prompt_ids"], "max_tokens": max_tokens, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_cluster_answers_as_an_aggregated_one_and_moves_only_missing_blocks() {
    let c = cluster(&[]);
    wait_routable(&c, 2).await;
    assert_eq!(worker(&c, PREFILL).await["role"], "prefill");
    assert_eq!(worker(&c, DECODE).await["role"], "decode");

    // Every golden case, prefilled on node-1 and decoded on node-2: the golden greedy text.
    let mut pulled = 0;
    for name in ["chat_capital", "chat_list", "long_prompt"] {
        let g = golden(name);
        let n = g["greedy_ids"].as_array().unwrap().len();
        let v = completion(
            &c,
            json!({"model": MODEL, "prompt": g["prompt_ids"], "max_tokens": n, "temperature": 0}),
        )
        .await;
        let want = greedy_text(name);
        assert_eq!(v["choices"][0]["text"], want.as_str(), "{name}");
        assert_eq!(
            v["usage"]["prompt_tokens"],
            g["prompt_ids"].as_array().unwrap().len()
        );
        let blocks = g["prompt_ids"].as_array().unwrap().len().div_ceil(16) as u64;
        pulled += blocks;
        wait_worker(&c, DECODE, "the decode worker pulled the prompt", |w| {
            w["kv_blocks_pulled"] == pulled
        })
        .await;
    }
    assert_eq!(worker(&c, DECODE).await["kv_pull_fallbacks"], 0);
    // The bytes the decode worker pulled, counted on its node, reach the gateway's `/metrics`
    // through the fleet view (the fleet view shows them with the blocks: one stats update).
    let bytes = worker(&c, DECODE).await["kv_transfer_bytes"]
        .as_u64()
        .unwrap_or(0);
    assert!(bytes > 0, "the decode worker's transfer bytes");
    assert_eq!(worker(&c, PREFILL).await["kv_transfer_bytes"], 0);
    let line = format!("flotilla_worker_kv_transfer_bytes_total{{worker=\"{DECODE}\"}} {bytes}\n");
    poll_until(Duration::from_secs(10), "the bytes on /metrics", || async {
        let text = reqwest::get(c.url("/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.contains(&line).then_some(())
    })
    .await;
    wait_idle(&c, "blocks released after each request").await;

    // The long prompt again: the decode worker holds its 18 full blocks, so only the last,
    // partial one moves; the prefill worker's cache served the prompt (cached_tokens).
    let v = completion(&c, long_prompt(16)).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 288);
    wait_worker(&c, DECODE, "one more block pulled", |w| {
        w["kv_blocks_pulled"] == pulled + 1
    })
    .await;

    // A seeded sampled stream, disaggregated…
    let sampled = json!({"model": MODEL, "prompt": "Write a short poem about the sea, the wind and the old lighthouse on the hill.",
        "max_tokens": 32, "temperature": 0.9, "seed": 11});
    let disagg = completion(&c, sampled.clone()).await;
    wait_worker(&c, DECODE, "the sampled request was disaggregated", |w| {
        w["kv_blocks_pulled"].as_u64() > Some(pulled + 1)
    })
    .await;

    // …then the prefill worker becomes aggregated at run time (a control message: drain,
    // then switch): no prefill pool is left, so nothing is disaggregated any more…
    let url = c.url("/v1/workers/role");
    let (s, _, body) = post(&url, &json!({"worker": PREFILL, "role": "aggregated"})).await;
    assert_eq!(s, 202, "{body}");
    let (s, _, body) = post(&url, &json!({"worker": PREFILL, "role": "both"})).await;
    assert_eq!(s, 400, "{body}");
    let (s, _, body) = post(
        &url,
        &json!({"worker": "node-9/replica-0", "role": "decode"}),
    )
    .await;
    assert_eq!(s, 404, "{body}");
    wait_worker(&c, PREFILL, "role switched", |w| {
        w["role"] == "aggregated" && w["health"] == "ready"
    })
    .await;
    wait_routable(&c, 2).await;
    let before = worker(&c, DECODE).await["kv_blocks_pulled"].clone();
    let agg = completion(&c, sampled).await;
    // …and the seeded sampled text is the same.
    assert_eq!(agg["choices"][0]["text"], disagg["choices"][0]["text"]);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        worker(&c, DECODE).await["kv_blocks_pulled"],
        before,
        "served aggregated"
    );
}

/// B10 (B): a near-context prompt dropped before its first token stops on the prefill worker.
/// B10 (C) and (D): chaos delays every KV transfer by 2 s; clients cancel during the transfer
/// (both workers' KV back to idle after each, nothing left pending, the next request
/// succeeds); then the prefill worker is killed mid-transfer and the request still finishes,
/// identical, by recomputing its prompt on the decode worker; then every transfer is dropped,
/// and requests are recomputed likewise. On the TCP backend, whose server refuses a region
/// that is gone at once (over UCX shared memory, a read of a restarted replica's old pool may
/// still succeed, with the right bytes: B10 (D) allows either).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_cancelled_or_losing_their_prefill_worker_free_both_sides() {
    let c = cluster(&["transport.backend=tcp"]);
    wait_routable(&c, 2).await;
    let want = greedy_text("long_prompt");
    // (B) A cold near-context prompt (`max_tokens: 1`) dropped after 1 s, before any token:
    // the prefill worker stops it within a step or two and frees its blocks; a short request
    // right after is served.
    let short = json!({"model": MODEL, "prompt": "Name three colours of the rainbow, please.", "max_tokens": 20});
    let t = std::time::Instant::now();
    completion(&c, short.clone()).await;
    let baseline = t.elapsed();
    let ids: Vec<Value> = golden("long_prompt")["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .cycle()
        .take(3900)
        .cloned()
        .collect();
    let long = json!({"model": MODEL, "prompt": ids, "max_tokens": 1, "stream": true});
    let client = reqwest::Client::new();
    let pending = client.post(c.url("/v1/completions")).json(&long).send();
    let resp = tokio::time::timeout(Duration::from_secs(1), async {
        let r = pending.await.unwrap();
        let mut bytes = r.bytes_stream();
        while let Some(b) = bytes.next().await {
            let b = b.unwrap();
            assert!(
                !String::from_utf8_lossy(&b).contains("\"text\""),
                "no token within 1 s of a 3 900-token prefill"
            );
        }
    })
    .await;
    assert!(resp.is_err(), "still prefilling after 1 s");
    let dropped = std::time::Instant::now();
    wait_worker(&c, PREFILL, "the dropped prefill stopped", |w| {
        w["kv_blocks_used"] == 0 && w["running"] == 0 && w["waiting"] == 0
    })
    .await;
    eprintln!(
        "B10 (B): prefill stopped {:?} after the drop",
        dropped.elapsed()
    );
    let t = std::time::Instant::now();
    completion(&c, short).await;
    eprintln!(
        "B10 (B): short request {:?} (baseline {baseline:?})",
        t.elapsed()
    );
    wait_idle(&c, "idle after the dropped prefill").await;

    chaos(
        &c,
        json!({"kind": "delay_kv_transfer", "delay_ms": 2000, "target": {"node": "node-2"}}),
    )
    .await;

    // (C) The client goes away as soon as its first token (from the prefill worker) arrives,
    // while the decode worker waits on the delayed pull.
    for i in 0..4 {
        let mut body = long_prompt(200);
        body["stream"] = json!(true);
        let resp = reqwest::Client::new()
            .post(c.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let mut bytes = resp.bytes_stream();
        let mut buf = String::new();
        'first: while let Some(b) = bytes.next().await {
            buf.push_str(&String::from_utf8_lossy(&b.unwrap()));
            while let Some(pos) = buf.find("\n\n") {
                let rec: String = buf.drain(..pos + 2).collect();
                if let Some(data) = rec.trim().strip_prefix("data: ")
                    && let Ok(v) = serde_json::from_str::<Value>(data)
                    && v["choices"][0]["text"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty())
                {
                    break 'first;
                }
            }
        }
        wait_worker(&c, DECODE, "the decode worker is pulling", |w| {
            w["kv_pulls_pending"] == 1
        })
        .await;
        drop(bytes); // the client disconnects mid-transfer
        wait_idle(&c, &format!("attempt {i}: both sides freed")).await;
        // The next request succeeds.
        let (s, _, body) = post(
            &c.url("/v1/completions"),
            &json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200, "{body}");
    }

    // (D) The prefill worker dies while the decode worker waits on the delayed transfer: the
    // pull fails, the decode worker recomputes the prompt, the stream finishes unchanged.
    let fallbacks = worker(&c, DECODE).await["kv_pull_fallbacks"]
        .as_u64()
        .unwrap();
    let c2 = &c;
    let (text, clean) = stream(&c, long_prompt(16), 1, async || {
        chaos(
            c2,
            json!({"kind": "kill_actor", "actor": "replica", "target": {"worker": PREFILL}}),
        )
        .await;
    })
    .await;
    assert!(clean, "[DONE], no error record");
    assert_eq!(text, want, "recomputed on the decode worker, same text");
    wait_worker(&c, DECODE, "the pull failed and was recomputed", |w| {
        w["kv_pull_fallbacks"].as_u64() > Some(fallbacks)
    })
    .await;
    wait_routable(&c, 2).await;
    wait_idle(&c, "both sides freed after the kill").await;

    // A transfer fault that drops every pull: recomputed on the decode worker, same text.
    chaos(
        &c,
        json!({"kind": "drop_kv_transfer", "rate": 1.0, "seed": 1, "target": {"node": "node-2"}}),
    )
    .await;
    let fallbacks = worker(&c, DECODE).await["kv_pull_fallbacks"]
        .as_u64()
        .unwrap();
    let v = completion(&c, long_prompt(16)).await;
    assert_eq!(v["choices"][0]["text"], want.as_str());
    wait_worker(&c, DECODE, "the dropped pull was recomputed", |w| {
        w["kv_pull_fallbacks"].as_u64() > Some(fallbacks)
    })
    .await;
    wait_idle(&c, "both sides freed after the dropped pull").await;
}

/// B16 and B17 with roles: a panic in the prefill worker's scheduler restarts its replica,
/// which comes back as a prefill worker, and requests go on; then the prefill node drains
/// (SIGTERM) while requests keep arriving: it leaves routing at once, the decode worker
/// prefills by itself, no request fails, and the node exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_that_panics_or_drains_loses_no_request() {
    use crate::process::{node_pid, signal};
    let c = cluster(&["node.drain_grace_ms=20000"]);
    wait_routable(&c, 2).await;
    let want = greedy_text("long_prompt");
    let restarts = |f: &Value| -> u64 {
        f["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["counters"]["restarts"].as_u64().unwrap_or(0))
            .sum()
    };
    let before = restarts(&fleet(&c).await);
    // The prefill worker's scheduler panics in its next handler.
    chaos(&c, json!({"kind": "panic", "target": {"worker": PREFILL}})).await;
    poll_until(Duration::from_secs(30), "the replica restarted", || async {
        (restarts(&fleet(&c).await) > before).then_some(())
    })
    .await;
    wait_worker(&c, PREFILL, "back as a prefill worker", |w| {
        w["role"] == "prefill" && w["health"] == "ready"
    })
    .await;
    wait_routable(&c, 2).await;
    let pulled = worker(&c, DECODE).await["kv_blocks_pulled"]
        .as_u64()
        .unwrap_or(0);
    let v = completion(&c, long_prompt(16)).await;
    assert_eq!(v["choices"][0]["text"], want.as_str());
    wait_worker(&c, DECODE, "disaggregated again after the restart", |w| {
        w["kv_blocks_pulled"].as_u64() > Some(pulled)
    })
    .await;

    // Drain the prefill node while requests arrive.
    let pid = node_pid(&c, "node-1").await;
    let load = {
        let gw = c.url("/v1/completions");
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..6 {
                let body = long_prompt(16);
                let (s, _, text) = post(&gw, &body).await;
                statuses.push((s, text));
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            statuses
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    signal(pid, nix::sys::signal::Signal::SIGTERM);
    for (s, text) in load.await.unwrap() {
        assert_eq!(s, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["choices"][0]["text"], want.as_str());
    }
    poll_until(
        Duration::from_secs(40),
        "node-1 exited after its drain",
        || async {
            let gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err();
            gone.then_some(())
        },
    )
    .await;
    wait_routable(&c, 1).await;
    let v = completion(&c, long_prompt(16)).await;
    assert_eq!(
        v["choices"][0]["text"],
        want.as_str(),
        "served by the decode worker alone"
    );
}

/// B11 disaggregated: a greedy stream whose decode worker's node is killed after 50 tokens
/// migrates — its prompt plus the 50 tokens is prefilled again on the prefill worker and
/// handed to the other decode worker — and the client's text equals the reference run byte
/// for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_stream_migrates_without_a_seam() {
    let c = Cluster::start_with(
        4,
        &["--chaos", "--prefill", "1", "--decode", "2"],
        &[
            "worker.kv_blocks=256",
            "disagg.min_prefill_tokens=8",
            "gateway.migration_limit=2",
        ],
    );
    wait_routable(&c, 3).await;
    let body = json!({"model": MODEL, "prompt": "Tell me a long story about a lighthouse keeper and the sea.",
        "max_tokens": 120, "temperature": 0, "ignore_eos": true});
    let (reference, clean) = stream(&c, body.clone(), 0, async || {}).await;
    assert!(clean);
    let pulled_before: u64 = fleet(&c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["workers"].as_array().unwrap().clone())
        .map(|w| w["kv_blocks_pulled"].as_u64().unwrap_or(0))
        .sum();
    assert!(pulled_before > 0, "the reference run was disaggregated");

    // Kill the node of the decode worker serving the stream once 50 chunks have arrived.
    let c2 = &c;
    let (text, clean) = stream(&c, body, 50, async || {
        let f = fleet(c2).await;
        let busy = f["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| {
                n["workers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|w| w["role"] == "decode" && w["running"].as_u64() > Some(0))
            })
            .map(|n| n["id"].as_str().unwrap().to_owned())
            .expect("a decode worker runs the stream");
        chaos(c2, json!({"kind": "kill_node", "target": {"node": busy}})).await;
    })
    .await;
    assert!(clean, "[DONE]");
    assert_eq!(text, reference, "byte for byte across the migration");
    let migrations: u64 = fleet(&c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["counters"]["migrations"].as_u64().unwrap_or(0))
        .sum();
    assert!(migrations >= 1, "the stream migrated");
}
