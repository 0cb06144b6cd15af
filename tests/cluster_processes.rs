//! A real cluster of processes: `flotilla up --nodes 3` becomes ready; SIGKILL of a worker
//! node is reported down within the liveness timeout and the rest keep serving; `flotilla
//! status` lists the nodes; SIGTERM stops `up` with exit 0 and no orphans; a node with a
//! wrong cookie exits with a clear error; `flotilla status --watch` on a pipe prints plain
//! frames until Ctrl-C, which ends it with exit 0.

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

/// The gateway URL of `flotilla up`'s ready line (within 60 s); the rest of its stdout is
/// drained in the background.
async fn up_gateway(stdout: tokio::process::ChildStdout) -> String {
    let mut lines = BufReader::new(stdout).lines();
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
    gateway
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
    let gateway = up_gateway(up.stdout.take().unwrap()).await;

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

/// `flotilla node` with the fast test leases, stderr to `err`.
fn node_cmd(
    name: &str,
    port: u16,
    roles: &str,
    join: Option<u16>,
    err: &std::path::Path,
) -> Command {
    let mut c = Command::new(BIN);
    c.args(["node", "--name", name, "--roles", roles])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--set",
            &format!("cluster.heartbeat_interval_ms={HEARTBEAT_MS}"),
        ])
        .args(["--set", &format!("cluster.suspect_after_ms={SUSPECT_MS}")])
        .args([
            "--set",
            &format!("cluster.liveness_timeout_ms={LIVENESS_MS}"),
        ])
        .env("FLOTILLA_NODE__COOKIE", "pause-test")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(err).unwrap())
        .kill_on_drop(true);
    if let Some(j) = join {
        c.args(["--join", &format!("127.0.0.1:{j}")]);
    }
    c
}

/// A node paused past the liveness timeout is down to the cluster, which lets a new node take
/// its name. When the old one wakes up and re-dials, the first peer that hears its heartbeat
/// (an older incarnation at another address) tells it so, and it exits with code 2 and a clear
/// message; the new one keeps the name. Before, the two took turns on the name forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_from_a_pause_under_a_taken_name_exits_and_the_new_one_keeps_it() {
    let dir = tempfile::tempdir().unwrap();
    let (p0, p1, p2, http) = (
        crate::poll::free_port(),
        crate::poll::free_port(),
        crate::poll::free_port(),
        crate::poll::free_port(),
    );
    let mut seed = node_cmd(
        "seed",
        p0,
        "gateway,router",
        None,
        &dir.path().join("seed.err"),
    );
    let mut seed = seed
        .args(["--http", &format!("127.0.0.1:{http}")])
        .spawn()
        .unwrap();
    let fleet = format!("http://127.0.0.1:{http}/v1/fleet");
    // beta's (state, cluster address) as the seed sees it.
    let beta = || async {
        let (_, f) = get(&fleet).await?;
        let n = f["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["id"] == "beta")?
            .clone();
        Some((
            n["state"].as_str()?.to_owned(),
            n["addr"].as_str()?.to_owned(),
        ))
    };
    let old_err = dir.path().join("old.err");
    let mut old = node_cmd("beta", p1, "router", Some(p0), &old_err)
        .spawn()
        .unwrap();
    let old_pid = Pid::from_raw(old.id().unwrap() as i32);
    let at = |p: u16| format!("127.0.0.1:{p}");
    poll_until(
        Duration::from_secs(60),
        "the seed sees the old beta up",
        || async { (beta().await? == ("up".to_owned(), at(p1))).then_some(()) },
    )
    .await;

    kill(old_pid, Signal::SIGSTOP).unwrap();
    poll_until(
        Duration::from_secs(20),
        "the paused beta goes down",
        || async { (beta().await?.0 == "down").then_some(()) },
    )
    .await;
    let new_err = dir.path().join("new.err");
    let mut new = node_cmd("beta", p2, "router", Some(p0), &new_err)
        .spawn()
        .unwrap();
    poll_until(Duration::from_secs(60), "the new beta is up", || async {
        (beta().await? == ("up".to_owned(), at(p2))).then_some(())
    })
    .await;

    kill(old_pid, Signal::SIGCONT).unwrap();
    let woke = Instant::now();
    let Ok(status) = tokio::time::timeout(Duration::from_secs(30), old.wait()).await else {
        let log = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap_or_default();
        panic!(
            "the old beta did not exit within 30 s of waking up\n--- old beta:\n{}\n--- new beta:\n{}\n--- seed:\n{}",
            log("old.err"),
            log("new.err"),
            log("seed.err")
        );
    };
    let status = status.unwrap();
    let exited = woke.elapsed();
    let err = std::fs::read_to_string(&old_err).unwrap();
    assert_eq!(status.code(), Some(2), "stderr: {err}");
    assert!(
        err.contains("node name \"beta\" was taken by another node")
            && err.contains(&format!("cluster address {}", at(p2))),
        "stderr: {err}"
    );
    // The new beta keeps the name. Its session with the seed was displaced for a moment (the
    // seed may still show its last heartbeat as up, then suspect): it re-dials its seed, and
    // the seed sees it up at its address, and stays so.
    tokio::time::sleep(Duration::from_millis(LIVENESS_MS)).await;
    poll_until(
        Duration::from_secs(30),
        "the new beta is up again",
        || async { (beta().await? == ("up".to_owned(), at(p2))).then_some(()) },
    )
    .await;
    eprintln!(
        "old beta exited {:.2} s after waking up; the seed saw the new one up again {:.2} s after",
        exited.as_secs_f64(),
        woke.elapsed().as_secs_f64()
    );
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            beta().await,
            Some(("up".to_owned(), at(p2))),
            "the name stays with the new beta"
        );
    }
    assert!(new.try_wait().unwrap().is_none(), "the new beta runs on");
    for c in [&mut new, &mut seed] {
        let _ = c.start_kill();
        let _ = c.wait().await;
    }
}

/// `--log-format json`: every stderr line is one JSON object (level, target, fields.message);
/// plain text on a pipe carries no colour codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_json_lines_with_log_format_json_and_plain_on_a_pipe() {
    for json in [true, false] {
        let port = crate::poll::free_port();
        let mut cmd = Command::new(BIN);
        cmd.args(["node", "--name", "logs", "--roles", "router"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("FLOTILLA_NODE__COOKIE", "logs")
            .env_remove("FLOTILLA_LOG_FORMAT")
            .env_remove("FLOTILLA_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if json {
            cmd.args(["--log-format", "json"]);
        }
        let mut child = cmd.spawn().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                seen.push(line.clone());
                if line.contains("node ready") {
                    return line;
                }
            }
            panic!("the node ended before it was ready: {seen:?}");
        })
        .await
        .expect("node ready within 30 s");
        let _ = child.start_kill();
        let _ = child.wait().await;
        for line in &seen {
            assert!(!line.contains('\u{1b}'), "colour codes on a pipe: {line:?}");
            if json {
                let v: Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
                assert!(v["level"].is_string() && v["target"].is_string(), "{v}");
            }
        }
        if json {
            let v: Value = serde_json::from_str(&ready).unwrap();
            assert_eq!(v["fields"]["message"], "node ready", "{v}");
            assert_eq!(v["level"], "INFO", "{v}");
            assert_eq!(v["fields"]["node"], "logs", "{v}");
        } else {
            assert!(
                ready.contains(" INFO ") && ready.contains("node=logs"),
                "{ready}"
            );
        }
    }
}

/// One access line per API request at `info` (`request done`, in the request's span: id,
/// method, path; with status, duration and the worker that served it), for a plain answer,
/// a stream (logged at its end) and a refused request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_request_gets_one_access_line_with_its_id_status_and_worker() {
    let mut up = Command::new(BIN)
        .args([
            "up",
            "--engine",
            "sim",
            "--nodes",
            "2",
            "--http",
            "127.0.0.1:0",
        ])
        .args(["--log-format", "json"])
        .env_remove("FLOTILLA_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut err = BufReader::new(up.stderr.take().unwrap()).lines();
    let logs = tokio::spawn(async move {
        let mut all = Vec::new();
        while let Ok(Some(l)) = err.next_line().await {
            all.push(l);
        }
        all
    });
    let gateway = up_gateway(up.stdout.take().unwrap()).await;
    let (_, models) = get(&format!("{gateway}/v1/models")).await.unwrap();
    let model = models["data"][0]["id"].as_str().unwrap().to_owned();
    let http = reqwest::Client::new();
    let send = |id: &'static str, body: Value| {
        let (http, url) = (http.clone(), format!("{gateway}/v1/chat/completions"));
        async move {
            let r = http
                .post(url)
                .header("x-request-id", id)
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let _ = r.text().await;
            status
        }
    };
    let chat = |stream: bool| {
        serde_json::json!({"model": model, "max_tokens": 3, "stream": stream,
                           "messages": [{"role": "user", "content": "hi"}]})
    };
    assert_eq!(send("access-plain", chat(false)).await, 200);
    assert_eq!(send("access-stream", chat(true)).await, 200);
    assert_eq!(
        send("access-bad", serde_json::json!({"model": model})).await,
        400
    );
    kill(Pid::from_raw(up.id().unwrap() as i32), Signal::SIGTERM).unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(40), up.wait()).await;
    let lines = logs.await.unwrap();
    let access = |id: &str| -> Vec<Value> {
        lines
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["fields"]["message"] == "request done" && v["span"]["request_id"] == id)
            .collect()
    };
    for (id, status, served) in [
        ("access-plain", 200, true),
        ("access-stream", 200, true),
        ("access-bad", 400, false),
    ] {
        let found = access(id);
        assert_eq!(found.len(), 1, "one access line for {id}: {found:?}");
        let v = &found[0];
        assert_eq!(
            (&v["level"], &v["target"]),
            (&"INFO".into(), &"flotilla::access".into()),
            "{v}"
        );
        assert_eq!(v["fields"]["status"], status, "{v}");
        assert_eq!(v["span"]["method"], "POST", "{v}");
        assert_eq!(v["span"]["path"], "/v1/chat/completions", "{v}");
        assert!(v["fields"]["duration_ms"].as_f64().is_some(), "{v}");
        let workers = v["fields"]["workers"].as_str().unwrap();
        if served {
            assert!(workers.starts_with("node-1/replica-"), "{v}");
        } else {
            assert_eq!(workers, "-", "{v}");
        }
    }
}

/// `flotilla status --watch` with stdout on a pipe: one plain frame per interval, each
/// ended by a blank line (header, health, the nodes' counters, the worker's load), no
/// escape codes; SIGINT (Ctrl-C) ends it with exit status 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_watch_prints_plain_frames_on_a_pipe_and_exits_0_on_ctrl_c() {
    let mut up = Command::new(BIN)
        .args([
            "up",
            "--engine",
            "sim",
            "--nodes",
            "2",
            "--http",
            "127.0.0.1:0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let gateway = up_gateway(up.stdout.take().unwrap()).await;
    let mut watch = Command::new(BIN)
        .args([
            "status",
            "--watch",
            "--interval",
            "0.2",
            "--gateway",
            &gateway,
        ])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    // Frames until two show the worker with its role (the first may come before the
    // worker's scheduler has published it).
    let frames = tokio::time::timeout(Duration::from_secs(60), async {
        let (mut frames, mut frame) = (Vec::new(), Vec::new());
        while let Some(line) = lines.next_line().await.unwrap() {
            if !line.is_empty() {
                frame.push(line);
                continue;
            }
            let text = std::mem::take(&mut frame).join("\n");
            let role_shown = text
                .lines()
                .any(|l| l.starts_with("node-1/replica-0 ") && l.contains(" aggregated "));
            if role_shown {
                frames.push(text);
                if frames.len() == 2 {
                    return frames;
                }
            }
        }
        panic!("status --watch ended before two frames: {frames:?}");
    })
    .await
    .expect("two frames within 60 s");
    for f in &frames {
        assert!(
            f.starts_with("flotilla status --watch: "),
            "header first: {f}"
        );
        assert!(f.contains("health: 2/2 nodes up"), "{f}");
        assert!(
            f.contains("MIGRATIONS") && f.contains("ENGINE HANGS"),
            "{f}"
        );
        let worker = f
            .lines()
            .find(|l| l.starts_with("node-1/replica-0"))
            .unwrap();
        let cells: Vec<&str> = worker.split_whitespace().collect();
        assert_eq!(cells[1], "aggregated", "{f}");
        assert!(!f.contains('\x1b'), "no escape codes on a pipe: {f:?}");
    }
    kill(Pid::from_raw(watch.id().unwrap() as i32), Signal::SIGINT).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), watch.wait())
        .await
        .expect("status --watch ends on SIGINT")
        .unwrap();
    assert!(status.success(), "exit status 0 on Ctrl-C: {status:?}");
    kill(Pid::from_raw(up.id().unwrap() as i32), Signal::SIGTERM).unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(40), up.wait()).await;
}
