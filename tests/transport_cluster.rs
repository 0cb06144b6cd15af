//! The transport inside a real cluster: every worker node's engines allocate their KV pools
//! through the node's transport and publish them as regions in the fleet view; a process with
//! its own transport can read blocks of a live replica's pool; a restarted replica registers
//! fresh memory under a newer epoch, and the old one is refused.

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

use crate::http::{fleet, wait_routable};
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
