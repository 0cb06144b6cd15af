//! A gateway node that dies leaves no orphaned work behind, and ids never repeat.
//!
//! (1) Response ids and chaos fault ids stay distinct across restarts of the gateway node;
//! `/v1/fleet` shows the node's restarts and its new incarnation. (2) Streams whose gateway
//! died are aborted on their workers: running, waiting and KV in use go back to idle within
//! about the liveness timeout, and the restarted gateway serves new streams normally. (3) A
//! seed node restarted with no `--join` (a Kubernetes gateway pod) gets its workers back:
//! they re-dial it although they still see each other.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{
    http::{MODEL, fleet, post, wait_routable, workers_sum},
    poll::poll_until,
    process::{Cluster, node_pid, signal},
};
use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::time::Duration;

/// node-0's entry in `/v1/fleet`.
async fn node0(c: &Cluster) -> Value {
    fleet(c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == "node-0")
        .cloned()
        .unwrap()
}

/// SIGKILL the gateway node and wait until `flotilla up` has it back (a new pid, serving, with
/// both workers routable).
async fn restart_gateway(c: &Cluster) {
    let old = node_pid(c, "node-0").await;
    signal(old, Signal::SIGKILL);
    poll_until(Duration::from_secs(90), "the gateway node back", || async {
        let r = reqwest::get(c.url("/v1/fleet")).await.ok()?;
        let v: Value = r.json().await.ok()?;
        let pid = v["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["id"] == "node-0")?["pid"]
            .as_i64()?;
        (pid as i32 != old).then_some(())
    })
    .await;
    wait_routable(c, 2).await;
    poll_until(
        Duration::from_secs(30),
        "both workers in the new fleet view",
        || async {
            let v = fleet(c).await;
            let known = v["nodes"]
                .as_array()?
                .iter()
                .flat_map(|n| n["workers"].as_array().cloned().unwrap_or_default())
                .filter(|w| w["kv_blocks_total"].as_u64().unwrap_or(0) > 0)
                .count();
            (known == 2).then_some(())
        },
    )
    .await;
}

async fn one_request(c: &Cluster, i: usize) -> String {
    let (path, body) = if i.is_multiple_of(2) {
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": format!("Say {i}")}],
                   "max_tokens": 2, "temperature": 0}),
        )
    } else {
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": format!("Count to {i}:"), "max_tokens": 2,
                   "temperature": 0}),
        )
    };
    let (status, _, text) = post(&c.url(path), &body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    v["id"].as_str().unwrap().to_owned()
}

async fn harmless_fault(c: &Cluster) -> u64 {
    let fault =
        json!({"kind": "slow", "delay_ms": 1, "duration_ms": 1, "target": {"node": "node-1"}});
    let (status, _, text) = post(&c.url("/chaos/faults"), &fault).await;
    assert!((200..300).contains(&status), "{status} {text}");
    serde_json::from_str::<Value>(&text).unwrap()["id"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_never_repeat_across_gateway_restarts() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=128"]);
    wait_routable(&c, 2).await;
    let mut ids = Vec::new();
    let mut faults = vec![harmless_fault(&c).await];
    for i in 0..3 {
        ids.push(one_request(&c, i).await);
    }
    let first = node0(&c).await;
    assert_eq!(first["counters"]["node_restarts"], 0);
    restart_gateway(&c).await;
    faults.push(harmless_fault(&c).await);
    for i in 0..5 {
        ids.push(one_request(&c, i).await);
    }
    restart_gateway(&c).await;
    faults.push(harmless_fault(&c).await);
    for i in 0..5 {
        ids.push(one_request(&c, i).await);
    }
    let distinct: HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "response ids repeat: {ids:?}");
    let distinct: HashSet<&u64> = faults.iter().collect();
    assert_eq!(distinct.len(), faults.len(), "fault ids repeat: {faults:?}");
    let last = node0(&c).await;
    assert_eq!(
        last["counters"]["node_restarts"], 2,
        "/v1/fleet shows the restarts `up` made: {last}"
    );
    assert!(
        last["incarnation"].as_u64() > first["incarnation"].as_u64(),
        "a new incarnation labels the per-incarnation counters: {first} → {last}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphaned_streams_are_aborted_and_the_new_gateway_serves() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=512"]);
    wait_routable(&c, 2).await;
    let client = reqwest::Client::new();
    let mut open = Vec::new();
    for i in 0..4 {
        let body = json!({"model": MODEL, "stream": true, "max_tokens": 3000, "ignore_eos": true,
            "messages": [{"role": "user", "content": format!("Tell story number {i}.")}]});
        let r = client
            .post(c.url("/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let mut s = r.bytes_stream();
        let chunk = s.next().await.unwrap().unwrap();
        assert!(!chunk.is_empty());
        open.push(s);
    }
    poll_until(
        Duration::from_secs(30),
        "the four streams running",
        || async { (workers_sum(&c, "running").await == 4).then_some(()) },
    )
    .await;
    restart_gateway(&c).await;
    drop(open);
    // The workers learn that the owner is gone (a newer incarnation of node-0, or its sink
    // missing for the liveness timeout) and abort: back to idle. 3 s liveness + heartbeat
    // delay; the bound is generous for a busy machine.
    let t0 = std::time::Instant::now();
    poll_until(
        Duration::from_secs(20),
        "workers idle after the gateway died",
        || async {
            // Both workers reported to the new gateway (not merely unknown yet), and idle.
            let known = workers_sum(&c, "kv_blocks_total").await == 2 * 512;
            let busy = workers_sum(&c, "running").await
                + workers_sum(&c, "waiting").await
                + workers_sum(&c, "kv_blocks_used").await;
            (known && busy == 0).then_some(())
        },
    )
    .await;
    eprintln!("workers idle {:?} after the gateway was back", t0.elapsed());
    // And they stay idle: no orphan comes back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(workers_sum(&c, "running").await, 0);
    // The new gateway serves four short streams to the end.
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (client, url) = (client.clone(), c.url("/v1/chat/completions"));
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": MODEL, "stream": true, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": format!("Say hello {i}.")}]});
            let r = client.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let text = r.text().await.unwrap();
            assert!(
                text.trim_end().ends_with("data: [DONE]"),
                "a stream after the restart completes: {text}"
            );
            assert!(!text.contains("\"error\""), "{text}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Start `flotilla node` with `args`; its ready line's JSON.
async fn start_node(args: &[&str]) -> (tokio::process::Child, Value) {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .arg("node")
        .args(args)
        .args(["--set", "worker.engine=sim"])
        .args(["--set", "cluster.heartbeat_interval_ms=100"])
        .args(["--set", "cluster.suspect_after_ms=500"])
        .args(["--set", "cluster.liveness_timeout_ms=1500"])
        .env("FLOTILLA_NODE__COOKIE", "seed-restart")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(j) = line.strip_prefix(flotilla::node::READY_PREFIX) {
                return serde_json::from_str::<Value>(j).unwrap();
            }
        }
        panic!("node {args:?} ended before it was ready");
    })
    .await
    .expect("ready within 60 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, ready)
}

/// Nodes up in the fleet view at `http`.
async fn nodes_up(http: &str) -> usize {
    let Ok(r) = reqwest::get(format!("{http}/v1/fleet")).await else {
        return 0;
    };
    let f: Value = r.json().await.unwrap_or_default();
    f["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["state"] == "up")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_rejoin_a_seed_node_restarted_without_join() {
    let seed = format!("127.0.0.1:{}", poll::free_port());
    let http_addr = format!("127.0.0.1:{}", poll::free_port());
    let gateway_args = [
        "--name",
        "gateway-0",
        "--listen",
        seed.as_str(),
        "--roles",
        "gateway,router",
        "--http",
        http_addr.as_str(),
    ];
    let (mut g, _) = start_node(&gateway_args).await;
    let http = format!("http://{http_addr}");
    let mut workers = Vec::new();
    for i in 0..2 {
        let listen = format!("127.0.0.1:{}", poll::free_port());
        let name = format!("worker-{i}");
        let (w, _) = start_node(&[
            "--name", &name, "--listen", &listen, "--roles", "worker", "--join", &seed,
        ])
        .await;
        workers.push(w);
    }
    poll_until(Duration::from_secs(30), "three nodes up", || async {
        (nodes_up(&http).await == 3).then_some(())
    })
    .await;
    // The gateway dies and comes back on the same address, joining nobody.
    g.kill().await.unwrap();
    let _ = g.wait().await;
    let (_g, _) = start_node(&gateway_args).await;
    poll_until(
        Duration::from_secs(30),
        "the workers back in the view",
        || async { (nodes_up(&http).await == 3).then_some(()) },
    )
    .await;
    wait_routable(&crate::http::At(http.clone()), 2).await;
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 4});
    let (status, _, text) = post(&format!("{http}/v1/completions"), &body).await;
    assert_eq!(status, 200, "{text}");
}
