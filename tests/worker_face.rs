//! Each worker speaking for itself: a replica's own OpenAI face
//! (`worker.http`) and its KV events in vLLM's wire format (`worker.kv_events_addr`), on an
//! in-process simulated fleet of two replicas — what SGLang's and vLLM's routers need to route
//! over Flotilla workers.

#[path = "common/http.rs"]
mod http;
#[path = "common/inproc.rs"]
mod inproc;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/sse.rs"]
mod sse;

use crate::http::{Gateway, MODEL, fleet, wait_routable};
use crate::inproc::{FleetOptions, NODE};
use crate::poll::poll_until;
use flotilla::kv::vllm::{Translator, VllmEvent};
use flotilla::kv::zmq::ZmqSubscriber;
use flotilla::runtime::ids::WorkerId;
use serde_json::{Value, json};
use std::time::Duration;

/// `(http base URL, KV event endpoint)` of replica `k`, from the gateway's fleet view.
async fn endpoints(c: &impl Gateway, k: usize) -> (String, String) {
    let id = format!("{NODE}/replica-{k}");
    poll_until(Duration::from_secs(10), "the faces bound", || async {
        let f = fleet(c).await;
        let w = f["nodes"][0]["workers"]
            .as_array()?
            .iter()
            .find(|w| w["id"] == id.as_str())?
            .clone();
        Some((
            format!("http://{}", w["http_addr"].as_str()?),
            w["kv_events_endpoint"].as_str()?.to_owned(),
        ))
    })
    .await
}

async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

fn prompt(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{i} ")).collect()
}

/// Read BlockStored events until they cover `want` blocks; returns their token ids and hashes.
async fn stored(sub: &mut ZmqSubscriber, want: usize) -> (Vec<u32>, Vec<u64>, Vec<VllmEvent>) {
    let (mut tokens, mut hashes, mut events) = (Vec::new(), Vec::new(), Vec::new());
    while hashes.len() < want {
        let (_, batch) = tokio::time::timeout(Duration::from_secs(10), sub.next())
            .await
            .expect("KV events within 10 s")
            .expect("a decodable batch");
        for ev in batch.events {
            if let VllmEvent::BlockStored {
                block_hashes,
                token_ids,
                block_size,
                ..
            } = &ev
            {
                assert_eq!(*block_size, 16);
                tokens.extend_from_slice(token_ids);
                hashes.extend_from_slice(block_hashes);
            }
            events.push(ev);
        }
    }
    (tokens, hashes, events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_serves_openai_and_publishes_vllm_kv_events() {
    let c = FleetOptions::new(2)
        .chaos()
        .set("worker.http=127.0.0.1:0")
        .set("worker.kv_events_addr=127.0.0.1:0")
        .start()
        .await;
    wait_routable(&c, 2).await;
    let (face0, ev0) = endpoints(&c, 0).await;
    let (face1, ev1) = endpoints(&c, 1).await;
    assert_ne!(face0, face1);
    assert_ne!(ev0, ev1);
    let mut sub0 = ZmqSubscriber::connect(&ev0).await.unwrap();
    let mut sub1 = ZmqSubscriber::connect(&ev1).await.unwrap();

    // The face answers what routers probe.
    let h: Value = reqwest::get(format!("{face0}/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(h["status"], "ready");
    let info: Value = reqwest::get(format!("{face1}/get_server_info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["kv_events_endpoint"], ev1.as_str());
    assert_eq!(info["page_size"], 16);
    assert_eq!(info["served_model_name"], MODEL);
    let models: Value = reqwest::get(format!("{face0}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);

    // Render gives the prompt's token ids: what vllm-router hashes to match KV events.
    let body = json!({"model": MODEL, "prompt": prompt("alpha", 120), "max_tokens": 4});
    let (s, r) = post(&format!("{face1}/v1/completions/render"), &body).await;
    assert_eq!(s, 200, "{r}");
    let ids: Vec<u32> = serde_json::from_value(r["token_ids"].clone()).unwrap();
    assert!(ids.len() > 64, "{}", ids.len());
    let (s, t) = post(
        &format!("{face1}/tokenize"),
        &json!({"prompt": prompt("alpha", 120)}),
    )
    .await;
    assert_eq!(s, 200, "{t}");
    assert_eq!(t["tokens"], r["token_ids"]);
    assert_eq!(t["count"], ids.len());

    // A completion on replica 1's face runs on replica 1: its socket announces the prompt's
    // blocks, with the prompt's tokens, whose hashes a consumer can rebuild from the tokens.
    let (s, v) = post(&format!("{face1}/v1/completions"), &body).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    let full = ids.len() / 16;
    let (tokens, hashes, events) = stored(&mut sub1, full).await;
    assert_eq!(tokens[..full * 16], ids[..full * 16]);
    let salt = flotilla::request_plane::frontend::Frontend::load(
        &flotilla::model::resolve_model_path(None).unwrap(),
        8192,
    )
    .unwrap()
    .salt;
    let want: Vec<u64> = flotilla::kv::block_hashes(&ids, 16, salt)
        .into_iter()
        .map(|(_, s)| s.0)
        .collect();
    assert_eq!(
        hashes[..full],
        want[..full],
        "sequence hashes as block hashes"
    );
    let mut t = Translator::new(WorkerId::new("ext/r1"), 16, salt);
    let mut ours = Vec::new();
    for ev in &events {
        if let Some(e) = t.apply(ev).unwrap()
            && let flotilla::kv::KvEventData::Stored { blocks, .. } = e.data
        {
            ours.extend(blocks.iter().map(|b| b.seq_hash.0));
        }
    }
    assert_eq!(ours[..full], want[..full], "the translator rebuilds them");
    // …and nothing of it on replica 0's socket.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), sub0.next())
            .await
            .is_err(),
        "replica 0 stored nothing"
    );

    // Chat through the face, the SGLang router's way (max_completion_tokens, extra fields).
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 3, "no_stop_trim": false, "separate_reasoning": true,
        "skip_special_tokens": true});
    let (s, v) = post(&format!("{face0}/v1/chat/completions"), &chat).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);

    // vLLM's metric names for this replica.
    let m = reqwest::get(format!("{face0}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
    ] {
        assert!(m.contains(name), "{name} in {m}");
    }
    let load: Value = reqwest::get(format!("{face0}/get_load"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(load["load"].is_u64(), "{load}");

    // Bad input gets the OpenAI error shape.
    let (s, e) = post(
        &format!("{face0}/v1/completions"),
        &json!({"model": "other", "prompt": "x"}),
    )
    .await;
    assert_eq!(s, 404, "{e}");
    assert_eq!(e["error"]["code"], "model_not_found");
    let (s, e) = post(&format!("{face0}/v1/chat/completions/render"), &json!({})).await;
    assert_eq!(s, 400, "{e}");
    let (s, e) = post(&format!("{face0}/tokenize"), &json!([1, 2])).await;
    assert_eq!(s, 400, "{e}");
    let r = reqwest::get(format!("{face0}/v1/fleet")).await.unwrap();
    assert_eq!(r.status(), 404, "a face is not the gateway");

    // The replica restarts under a stream on its face: the stream waits for it and finishes
    // there, with every token.
    let req = json!({"model": MODEL, "prompt": prompt("beta", 40), "max_tokens": 150,
        "stream": true, "ignore_eos": true, "stream_options": {"include_usage": true}});
    let url = format!("{face0}/v1/completions");
    let streaming = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .json(&req)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap()
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let restarts = fleet(&c).await["nodes"][0]["counters"]["restarts"]
        .as_u64()
        .unwrap();
    let (s, v) = post(
        &c.url("/chaos/faults"),
        &json!({"kind": "kill_actor", "actor": "scheduler",
            "target": {"worker": format!("{NODE}/replica-0")}}),
    )
    .await;
    assert!(s == 200 || s == 201 || s == 202, "{s} {v}");
    let body = tokio::time::timeout(Duration::from_secs(60), streaming)
        .await
        .expect("the stream ends")
        .unwrap();
    let records = sse::sse_records(&body);
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(records.iter().all(|r| r.get("error").is_none()), "{body}");
    let usage = records
        .iter()
        .find_map(|r| r.get("usage").filter(|u| !u.is_null()))
        .expect("a usage record");
    assert_eq!(usage["completion_tokens"], 150, "{body}");
    let after = fleet(&c).await["nodes"][0]["counters"]["restarts"]
        .as_u64()
        .unwrap();
    assert!(
        after > restarts,
        "the replica was restarted: {restarts} → {after}"
    );
    wait_routable(&c, 2).await;
}
