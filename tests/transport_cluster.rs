//! The transport inside a real cluster: every worker node's engines allocate their KV pools
//! through the node's transport and publish them as regions in the fleet view; a process with
//! its own transport can read blocks of a live replica's pool; a restarted replica registers
//! fresh memory under a newer epoch, and the old one is refused. Peer pulls (G4) over the same
//! transport: a worker that lacks a prompt's prefix pulls it from the one that holds it.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use std::time::{Duration, Instant};

use flotilla::transport::{
    BackendChoice, PullRequest, RegionDescriptor, TransferFaults, Transport, TransportConfig,
    TransportError,
};
use serde_json::{Value, json};

use crate::http::{MODEL, delta, fleet, placements, post, wait_routable};
use crate::poll::poll_until;
use crate::process::Cluster;

/// The region `owner` publishes, once the fleet view lists it.
async fn region(c: &Cluster, owner: &str, newer_than: u64) -> RegionDescriptor {
    poll_until(Duration::from_secs(60), "region published", || async {
        let f = fleet(c).await;
        f["nodes"]
            .as_array()?
            .iter()
            .flat_map(|n| n["regions"].as_array().cloned().unwrap_or_default())
            .filter_map(|r| serde_json::from_value::<RegionDescriptor>(r).ok())
            .find(|d| d.id.owner == owner && d.id.epoch > newer_than)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_publish_their_kv_regions_and_a_restart_brings_a_new_epoch() {
    let c = Cluster::start(3, &["worker.kv_blocks=64", "chaos.enabled=true"]);
    wait_routable(&c, 2).await;
    let d1 = region(&c, "node-1/replica-0", 0).await;
    let d2 = region(&c, "node-2/replica-0", 0).await;
    assert_eq!(d1.layout.num_blocks, 64);
    assert_eq!(d1.layout, d2.layout, "same model, same pools");
    assert_ne!(d1.tcp, d2.tcp, "each node serves its own regions");
    // Worker nodes run the transport actor; the gateway node has none.
    let f = fleet(&c).await;
    for n in f["nodes"].as_array().expect("nodes") {
        let has = n["actors"].as_array().expect("actors").iter().any(|a| {
            a["path"]
                .as_str()
                .is_some_and(|p| p.ends_with("/transport"))
                && a["state"] == "running"
        });
        let worker = n["roles"]
            .as_array()
            .expect("roles")
            .iter()
            .any(|r| r == "worker");
        assert_eq!(
            has, worker,
            "{}: transport actor {has}, worker {worker}",
            n["id"]
        );
    }

    // Read two blocks of node-1's live pool over TCP (the server side of every node).
    let t = Transport::start(
        "reader",
        TransportConfig {
            backend: BackendChoice::Tcp,
            ..TransportConfig::default()
        },
        TransferFaults::default(),
    )
    .await
    .expect("transport");
    let mem = t.allocate(d1.layout).await.expect("allocate");
    t.register("reader/replica-0", d1.layout, mem)
        .await
        .expect("register");
    let pull = |from: &RegionDescriptor| PullRequest {
        from: from.clone(),
        into: "reader/replica-0".into(),
        blocks: vec![(0, 0), (63, 1)],
        deadline: Instant::now() + Duration::from_secs(20),
    };
    let s = t.pull(pull(&d1)).await.expect("pull from a live replica");
    assert_eq!(s.bytes, 2 * d1.layout.bytes_per_block());

    // Kill node-1's replica: it restarts with fresh KV memory under a newer epoch.
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "kill_actor", "actor": "replica", "target": {"worker": "node-1/replica-0"}}))
        .send()
        .await
        .expect("chaos");
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    let d1b = region(&c, "node-1/replica-0", d1.id.epoch).await;
    assert_eq!(d1b.tcp, d1.tcp, "same node, same server");
    // The node's server refuses the old epoch by itself…
    let err = t.pull(pull(&d1)).await.expect_err("old epoch");
    assert!(matches!(err, TransportError::Stale(_)), "{err}");
    // …and once the new descriptor is known, the old one is refused before any byte moves.
    t.learn(&d1b);
    assert!(matches!(
        t.pull(pull(&d1)).await,
        Err(TransportError::Stale(_))
    ));
    t.pull(pull(&d1b)).await.expect("the new region reads");
    assert_eq!(t.pending(), 0);

    // The transfer faults are accepted by the chaos API (their effect is unit-tested and
    // exercised by the disaggregated flow).
    for body in [
        json!({"kind": "delay_kv_transfer", "delay_ms": 100, "target": {"node": "node-2"}}),
        json!({"kind": "drop_kv_transfer", "rate": 0.5, "seed": 3, "target": {"node": "node-2"}}),
    ] {
        let r = reqwest::Client::new()
            .post(c.url("/chaos/faults"))
            .json(&body)
            .send()
            .await
            .expect("chaos");
        assert_eq!(r.status(), 201);
    }
    let bad = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "drop_kv_transfer", "rate": 2.0}))
        .send()
        .await
        .expect("chaos");
    assert_eq!(bad.status(), 400);
    let v: Value = bad.json().await.expect("json");
    assert_eq!(v["error"]["param"], "rate");
}

/// The `peer` field (`kv_peer_pulls`) of every worker in the fleet view, summed.
async fn peer_pulls(c: &Cluster, field: &str) -> u64 {
    let f = fleet(c).await;
    f["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .flat_map(|n| n["workers"].as_array().cloned().unwrap_or_default())
        .map(|w| w["kv_peer_pulls"][field].as_u64().unwrap_or(0))
        .sum()
}

async fn complete(c: &Cluster, prompt: &Value, max_tokens: u32) -> Value {
    let (s, _, text) = post(
        &c.url("/v1/completions"),
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
    )
    .await;
    assert_eq!(s, 200, "{text}");
    serde_json::from_str(&text).expect("json")
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

/// Peer pulls on real processes and the real model (G4): with a pull credit of 1 a
/// worker lacking a prompt's prefix costs the router what its holder does, so consecutive
/// requests take turns; the one placed on the other worker pulls the 18 leading blocks over
/// TCP instead of recomputing them — the same greedy text as the cold run, and the pulled
/// tokens reported as cached. Then a holder killed while a pull from it is delayed: the
/// puller recomputes, and the text is still right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_pulls_a_prefix_from_its_holder_and_recomputes_when_the_holder_dies() {
    let c = Cluster::start(
        3,
        &[
            "worker.kv_blocks=256",
            "chaos.enabled=true",
            "transport.backend=tcp",
            "router.pull_credit=1",
        ],
    );
    wait_routable(&c, 2).await;
    let golden: Value =
        serde_json::from_str(include_str!("data/smollm2-golden.json")).expect("golden json");
    let case = golden["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == "long_prompt")
        .expect("long_prompt")
        .clone();
    let prompt = case["prompt_ids"].clone();
    let want = case["greedy_text"]
        .as_str()
        .expect("text")
        .replace("<|im_end|>", "");
    let lead = (prompt.as_array().expect("ids").len() as u64 - 1) / 16 * 16;

    // Cold, then warm until the other worker has taken one (and pulled).
    let cold = complete(&c, &prompt, 16).await;
    assert_eq!(cold["choices"][0]["text"], want.as_str());
    let before = placements(&c).await;
    for _ in 0..4 {
        let v = complete(&c, &prompt, 16).await;
        assert_eq!(
            v["choices"][0]["text"],
            want.as_str(),
            "pulled KV, same text"
        );
        assert!(cached(&v) >= lead, "pulled or local, cached: {v}");
    }
    let spread = delta(&placements(&c).await, &before);
    assert_eq!(spread.len(), 2, "both workers served: {spread:?}");
    let pulled = poll_until(Duration::from_secs(10), "a pull landed", || async {
        let n = peer_pulls(&c, "pulled").await;
        (n >= 1).then_some(n)
    })
    .await;
    assert_eq!(pulled, 1, "once both hold the prefix, nobody pulls");
    assert_eq!(peer_pulls(&c, "blocks").await, lead / 16);
    assert_eq!(peer_pulls(&c, "failed").await, 0);

    // A fresh prompt (the same ids shifted by one token): computed cold on one worker…
    let mut ids = prompt.as_array().expect("ids").clone();
    ids.rotate_left(1);
    let fresh = Value::Array(ids);
    let reference = complete(&c, &fresh, 16).await["choices"][0]["text"].clone();
    // …then two at once, so that one is placed on the other worker (the holder has one in
    // flight), whose pull is held up 3 s; the holder is killed meanwhile.
    for node in ["node-1", "node-2"] {
        let r = reqwest::Client::new()
            .post(c.url("/chaos/faults"))
            .json(&json!({"kind": "delay_kv_transfer", "delay_ms": 3000, "target": {"node": node}}))
            .send()
            .await
            .expect("chaos");
        assert_eq!(r.status(), 201, "{:?}", r.text().await);
    }
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let (c2, p) = (c.url("/v1/completions"), fresh.clone());
            tokio::spawn(async move {
                post(
                    &c2,
                    &json!({"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0}),
                )
                .await
            })
        })
        .collect();
    let puller = poll_until(Duration::from_secs(20), "a peer pull under way", || async {
        let f = fleet(&c).await;
        f["nodes"]
            .as_array()?
            .iter()
            .flat_map(|n| n["workers"].as_array().cloned().unwrap_or_default())
            .find(|w| w["kv_pulls_pending"].as_u64() >= Some(1))
            .and_then(|w| w["id"].as_str().map(str::to_owned))
    })
    .await;
    let holder = if puller.starts_with("node-1") {
        "node-2/replica-0"
    } else {
        "node-1/replica-0"
    };
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "kill_actor", "actor": "replica", "target": {"worker": holder}}))
        .send()
        .await
        .expect("chaos");
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    for run in runs {
        let (s, _, text) = run.await.expect("task");
        assert_eq!(s, 200, "{text}");
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["choices"][0]["text"], reference, "recomputed, same text");
    }
    poll_until(
        Duration::from_secs(10),
        "the failed pull counted",
        || async { (peer_pulls(&c, "failed").await >= 1).then_some(()) },
    )
    .await;
}
