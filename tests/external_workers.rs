//! `router.external_workers`: Flotilla's router places requests on engines
//! outside its fleet. The engines here are another Flotilla cluster's per-worker faces
//! (`worker.http`, vLLM-format KV events on `worker.kv_events_addr`), two worker node
//! processes on the simulated engine; the routing fleet runs in this process with the gateway and router
//! roles only, so every token it serves came from an external engine over HTTP.

#[path = "common/http.rs"]
mod http;
#[path = "common/inproc.rs"]
mod inproc;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::{MODEL, delta, fleet, metric_sum, placements, wait_routable};
use crate::inproc::FleetOptions;
use crate::poll::poll_until;
use crate::process::{Cluster, node_pid, signal};
use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::Duration;

/// `(http base URL, KV event endpoint)` of each engine node's replica, by node name.
async fn engine_endpoints(engines: &Cluster) -> BTreeMap<String, (String, String)> {
    poll_until(
        Duration::from_secs(30),
        "the engines' faces bound",
        || async {
            let f = fleet(engines).await;
            let mut out = BTreeMap::new();
            for n in f["nodes"].as_array()? {
                let Some(w) = n["workers"].as_array()?.first() else {
                    continue;
                };
                out.insert(
                    n["id"].as_str()?.to_owned(),
                    (
                        format!("http://{}", w["http_addr"].as_str()?),
                        w["kv_events_endpoint"].as_str()?.to_owned(),
                    ),
                );
            }
            (out.len() == 2).then_some(out)
        },
    )
    .await
}

fn chat(system: &str, user: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

async fn send(url: &str, body: &Value) -> Value {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_serves_from_external_engines_by_their_kv_events_and_survives_one_dying() {
    // `up --nodes 3`: node-0 runs the engines' own gateway, node-1 and node-2 a replica each.
    let engines = Cluster::start_with(
        3,
        &["--engine", "sim", "--no-restart"],
        &[
            "worker.http=127.0.0.1:0",
            "worker.kv_events_addr=127.0.0.1:0",
        ],
    );
    let ends = engine_endpoints(&engines).await;
    let externals: Vec<Value> = ends
        .iter()
        .map(
            |(node, (url, kv))| json!({"name": format!("ext-{node}"), "url": url, "kv_events": kv}),
        )
        .collect();
    // Without the worker role, worker.replicas is not used.
    let c = FleetOptions::new(1)
        .set(r#"node.roles=["gateway","router"]"#)
        .set(&format!(
            "router.external_workers={}",
            Value::Array(externals)
        ))
        .start()
        .await;
    wait_routable(&c, 2).await;
    let f = fleet(&c).await;
    let ids: Vec<&str> = f["nodes"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["node-0/ext-node-1", "node-0/ext-node-2"], "{f}");

    // Served from an engine (the simulated engine's tokens are placeholders of the sequence
    // and position, so the answer is checked by its token count and ids).
    let prefix: String = (0..300).map(|i| format!("alpha{} ", i % 97)).collect();
    let before = placements(&c).await;
    let mut body = chat(&prefix, "q0", 6);
    body["return_token_ids"] = json!(true);
    let first = send(&c.url("/v1/chat/completions"), &body).await;
    let d = delta(&placements(&c).await, &before);
    assert_eq!(d.len(), 1, "{d:?}");
    let holder = d.keys().next().unwrap().clone();
    assert_eq!(first["usage"]["completion_tokens"], 6);
    assert_eq!(
        first["choices"][0]["token_ids"].as_array().unwrap().len(),
        6,
        "{first}"
    );
    assert!(
        !first["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );

    // The engine's vLLM-format KV events reached the router: the prefix follows its holder.
    poll_until(
        Duration::from_secs(10),
        "the holder's blocks in the router's index",
        || async {
            let text = reqwest::get(c.url("/metrics"))
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            text.lines()
                .any(|l| l.starts_with("flotilla_router_kv_events_total") && !l.ends_with(" 0"))
                .then_some(())
        },
    )
    .await;
    let before = placements(&c).await;
    let overlap_before = metric_sum(&c, "flotilla_router_overlap_blocks_total").await;
    for i in 1..5 {
        send(
            &c.url("/v1/chat/completions"),
            &chat(&prefix, &format!("q{i}"), 4),
        )
        .await;
    }
    let d = delta(&placements(&c).await, &before);
    assert_eq!(
        d.keys().collect::<Vec<_>>(),
        [&holder],
        "all on the holder: {d:?}"
    );
    // …because the router saw the prefix's blocks there (the 300-word system prompt is
    // more than 16 blocks of 16 tokens), not by a tie.
    let overlap = metric_sum(&c, "flotilla_router_overlap_blocks_total").await - overlap_before;
    assert!(
        overlap >= 4 * 16,
        "prefix blocks the router found cached: {overlap}"
    );

    // The engine serving a stream dies: the stream migrates to the other engine, no seam.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                      "max_tokens": 120, "ignore_eos": true, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}});
    let before = placements(&c).await;
    let resp = reqwest::Client::new()
        .post(c.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    while text.matches("data: ").count() < 5 {
        text.push_str(&String::from_utf8_lossy(
            &stream.next().await.unwrap().unwrap(),
        ));
    }
    let serving = delta(&placements(&c).await, &before);
    let victim = serving
        .keys()
        .next()
        .unwrap()
        .trim_start_matches("node-0/ext-")
        .to_owned();
    signal(node_pid(&engines, &victim).await, Signal::SIGKILL);
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(b) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&b.unwrap()));
        }
    })
    .await
    .expect("the stream ends");
    assert!(text.contains("data: [DONE]"), "{text}");
    let records: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .collect();
    assert!(
        records.iter().all(|r| r.get("error").is_none()),
        "no error record: {text}"
    );
    let usage = records
        .iter()
        .find(|v| v.get("usage").is_some())
        .expect("a usage chunk");
    assert_eq!(
        usage["usage"]["completion_tokens"], 120,
        "every token once: {usage}"
    );
    let after = delta(&placements(&c).await, &before);
    assert_eq!(
        after.len(),
        2,
        "placed on the second engine after the first died: {after:?}"
    );
    wait_routable(&c, 1).await;
    c.stop().await;
}
