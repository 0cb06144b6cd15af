//! A real cluster of processes: `flotilla up --nodes 3` becomes ready; SIGKILL of a worker
//! node is reported down within the liveness timeout and the rest keep serving; `flotilla
//! status` lists the nodes; SIGTERM stops `up` with exit 0 and no orphans; a node with a
//! wrong cookie exits with a clear error.

#[path = "common/poll.rs"]
mod poll;

use crate::poll::poll_until;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const HEARTBEAT_MS: u64 = 100;
const SUSPECT_MS: u64 = 500;
const LIVENESS_MS: u64 = 1500;

async fn get(url: &str) -> Option<(u16, Value)> {
    let r = reqwest::get(url).await.ok()?;
    let status = r.status().as_u16();
    Some((status, r.json().await.ok()?))
}

fn alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_forms_detects_a_killed_node_and_stops_cleanly() {
    let mut up = Command::new(BIN)
        // A dead node stays down here (the restart of dead nodes: tests/chaos_soak.rs).
        .args([
            "up",
            "--nodes",
            "3",
            "--http",
            "127.0.0.1:0",
            "--no-restart",
        ])
        .args([
            "--set",
            &format!("cluster.heartbeat_interval_ms={HEARTBEAT_MS}"),
        ])
        .args(["--set", &format!("cluster.suspect_after_ms={SUSPECT_MS}")])
        .args([
            "--set",
            &format!("cluster.liveness_timeout_ms={LIVENESS_MS}"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let gateway = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(j) = line.strip_prefix("FLOTILLA_UP ") {
                let v: Value = serde_json::from_str(j).unwrap();
                return v["gateway"].as_str().unwrap().to_owned();
            }
        }
        panic!("flotilla up ended before it was ready");
    })
    .await
    .expect("cluster formed within 60 s");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    // Ready: three nodes up with the expected roles, health 200.
    let (status, fleet) = get(&format!("{gateway}/v1/fleet")).await.unwrap();
    assert_eq!(status, 200);
    let nodes = fleet["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "{fleet}");
    for n in nodes {
        assert_eq!(n["state"], "up", "{n}");
        for key in ["id", "addr", "roles", "state", "workers"] {
            assert!(n.get(key).is_some(), "node lacks {key}: {n}");
        }
    }
    let node0 = nodes.iter().find(|n| n["id"] == "node-0").unwrap();
    assert_eq!(node0["roles"], serde_json::json!(["gateway", "router"]));
    let victim = nodes.iter().find(|n| n["id"] == "node-2").unwrap();
    assert_eq!(victim["roles"], serde_json::json!(["worker"]));
    let victim_pid = victim["pid"].as_i64().unwrap() as i32;
    let pids: Vec<i32> = nodes
        .iter()
        .map(|n| n["pid"].as_i64().unwrap() as i32)
        .collect();
    assert_eq!(get(&format!("{gateway}/health")).await.unwrap().0, 200);

    // `flotilla status` lists the three nodes with their roles.
    let out = Command::new(BIN)
        .args(["status", "--gateway", &gateway])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "node-0",
        "node-1",
        "node-2",
        "gateway,router",
        "worker",
        "http_gateway",
    ] {
        assert!(text.contains(want), "status output lacks {want}:\n{text}");
    }
    let out = Command::new(BIN)
        .args(["status", "--json", "--gateway", &gateway])
        .output()
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["nodes"].as_array().unwrap().len(), 3);

    // SIGKILL a worker node: reported down within the liveness timeout (plus one heartbeat
    // and polling slack), and /health keeps answering 200 from the remaining worker.
    let t0 = Instant::now();
    kill(Pid::from_raw(victim_pid), Signal::SIGKILL).unwrap();
    let gw = gateway.clone();
    poll_until(Duration::from_secs(30), "node-2 reported down", || {
        let gw = gw.clone();
        async move {
            let (_, f) = get(&format!("{gw}/v1/fleet")).await?;
            let nodes = f["nodes"].as_array()?.clone();
            let n2 = nodes.iter().find(|n| n["id"] == "node-2");
            match n2 {
                None => Some(()),
                Some(n) if n["state"] == "down" => Some(()),
                _ => None,
            }
        }
    })
    .await;
    let detected = t0.elapsed();
    let bound = Duration::from_millis(LIVENESS_MS + HEARTBEAT_MS + 1_000);
    assert!(
        detected <= bound,
        "down after {detected:?}, bound {bound:?}"
    );
    assert_eq!(get(&format!("{gateway}/health")).await.unwrap().0, 200);
    let (_, f) = get(&format!("{gateway}/v1/fleet")).await.unwrap();
    let up_nodes = f["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["state"] == "up")
        .count();
    assert_eq!(up_nodes, 2, "{f}");

    // A node with the wrong cookie exits non-zero with a clear error.
    let seed = node0["addr"].as_str().unwrap().to_owned();
    let port = crate::poll::free_port();
    let out = Command::new(BIN)
        .args([
            "node", "--name", "intruder", "--roles", "worker", "--cookie", "wrong",
        ])
        .args(["--listen", &format!("127.0.0.1:{port}"), "--join", &seed])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cookie"), "stderr: {err}");

    // SIGTERM: `up` stops every node and exits 0; nothing is left behind.
    kill(Pid::from_raw(up.id().unwrap() as i32), Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(40), up.wait())
        .await
        .expect("up stopped within 40 s")
        .unwrap();
    assert!(status.success(), "up exited with {status}");
    for pid in pids {
        assert!(!alive(pid), "node process {pid} outlived `flotilla up`");
    }
}
