//! Several gateways: `flotilla up --gateways 2` runs two gateway + router nodes over
//! the same workers. Streams go to both while the chaos API kills one gateway node and a busy
//! worker: every request sent to the gateway that lived returns its no-fault reference byte for
//! byte; a stream cut by its gateway's death ends with a transport error at its client, which
//! retries on the other gateway (as the failover client of docs/fleet.md does) and gets the same bytes; the dead
//! gateway's work on the workers is freed; the gateway comes back on its port and serves again.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::{At, MODEL, fleet, workers_sum};
use crate::poll::poll_until;
use crate::process::Cluster;
use flotilla::cli::client::{StreamOutcome, stream_chat};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const REQUESTS: usize = 24;
const MAX_TOKENS: u32 = 32;

fn body(i: usize) -> serde_json::Value {
    const TOPICS: [&str; 6] = [
        "lighthouses",
        "owls",
        "glaciers",
        "tea",
        "bridges",
        "the moon",
    ];
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!(
            "Request {i}. Tell me three facts about {}.", TOPICS[i % TOPICS.len()])}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    })
}

/// The gateways `/v1/fleet` lists: (node, url).
async fn gateways(c: &impl http::Gateway) -> Vec<(String, String)> {
    fleet(c).await["gateways"]
        .as_array()
        .expect("/v1/fleet lists its gateways")
        .iter()
        .filter(|g| g["state"] == "up")
        .map(|g| {
            (
                g["node"].as_str().unwrap().to_owned(),
                g["url"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_lose_nothing_when_one_is_killed_under_load() {
    let c = Cluster::start_with(
        3,
        &["--gateways", "2", "--chaos", "--max-restarts", "100"],
        &["worker.kv_blocks=256"],
    );
    let gws = gateways(&c).await;
    assert_eq!(gws.len(), 2, "{gws:?}");
    let routers = fleet(&c).await["routers"].as_array().unwrap().len();
    assert_eq!(routers, 2, "each gateway node runs a router");
    let a = c.gateway.clone();
    let (b_node, b) = gws
        .iter()
        .find(|(_, url)| *url != a)
        .cloned()
        .expect("a second gateway");
    crate::http::wait_routable(&c, 2).await;

    // No-fault references, half through each gateway (both place on the same workers).
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(180))
        .build()
        .unwrap();
    let mut reference = Vec::new();
    for i in 0..REQUESTS {
        let base = if i % 2 == 0 { &a } else { &b };
        let r = stream_chat(&client, base, body(i))
            .await
            .expect("reference");
        assert!(r.is_complete(), "reference {i}: {r:?}");
        reference.push(r.text);
    }

    // The load: 6 in flight, requests alternating between the gateways; a request whose
    // gateway breaks off retries on the other one.
    let started_on_b = Arc::new(AtomicUsize::new(0));
    let load = {
        let (a, b, client) = (a.clone(), b.clone(), client.clone());
        let started_on_b = started_on_b.clone();
        tokio::spawn(async move {
            use futures::StreamExt;
            futures::stream::iter(0..REQUESTS)
                .map(|i| {
                    let (a, b, client) = (a.clone(), b.clone(), client.clone());
                    let started_on_b = started_on_b.clone();
                    async move {
                        let (first, other) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
                        if first == &b {
                            started_on_b.fetch_add(1, Ordering::SeqCst);
                        }
                        let on_first = stream_chat(&client, first, body(i)).await;
                        let retried = match &on_first {
                            Ok(r) if r.is_complete() => None,
                            _ => Some(stream_chat(&client, other, body(i)).await),
                        };
                        (i, first == &b, on_first, retried)
                    }
                })
                .buffer_unordered(6)
                .collect::<Vec<_>>()
                .await
        })
    };
    // Kill gateway b while streams run through it, then a busy worker.
    poll_until(Duration::from_secs(60), "streams on gateway b", || async {
        (started_on_b.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let chaos = |body: serde_json::Value| {
        let (client, url) = (client.clone(), format!("{a}/chaos/faults"));
        async move {
            let r = client.post(url).json(&body).send().await.expect("chaos");
            assert_eq!(r.status(), 201, "{:?}", r.text().await);
        }
    };
    chaos(serde_json::json!({"kind": "kill_node", "target": {"node": b_node}})).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    chaos(serde_json::json!({"kind": "kill_actor", "actor": "replica", "target": "any_busy"}))
        .await;

    let results = load.await.unwrap();
    let mut cut = 0;
    for (i, via_b, on_first, retried) in results {
        let check = |r: &StreamOutcome, how: &str| {
            assert!(r.is_complete(), "request {i} ({how}): {r:?}");
            assert_eq!(r.text, reference[i], "request {i} ({how}) changed");
        };
        match retried {
            None => check(on_first.as_ref().unwrap(), "first gateway"),
            Some(r) => {
                assert!(
                    via_b,
                    "request {i} failed on the gateway that lived: {on_first:?}"
                );
                cut += 1;
                check(&r.expect("the retry reaches the other gateway"), "retried");
            }
        }
    }
    eprintln!("streams cut by the gateway's death, retried on the other: {cut}");
    assert!(cut >= 1, "the kill cut at least one stream on gateway b");

    // The dead gateway's sequences were aborted on the workers (their owner is gone), and
    // the gateway came back on its port and serves.
    poll_until(Duration::from_secs(30), "workers idle", || async {
        let busy = workers_sum(&c, "running").await + workers_sum(&c, "waiting").await;
        (busy == 0).then_some(())
    })
    .await;
    let b_at = At(b.clone());
    poll_until(Duration::from_secs(60), "gateway b back", || async {
        let ok = reqwest::get(format!("{b}/health"))
            .await
            .is_ok_and(|r| r.status() == 200);
        ok.then_some(())
    })
    .await;
    let again = stream_chat(&client, &b, body(0))
        .await
        .expect("b serves again");
    assert!(again.is_complete(), "{again:?}");
    assert_eq!(again.text, reference[0]);
    assert_eq!(gateways(&b_at).await.len(), 2);

    // The failover client of docs/fleet.md (the `openai` package, `make venv`): its first gateway is
    // dead, it answers through the next one.
    let root = env!("CARGO_MANIFEST_DIR");
    let python = format!("{root}/.venv/bin/python");
    assert!(
        std::path::Path::new(&python).exists(),
        "{python} is missing: run `make venv` (make test does it)"
    );
    let dead = format!("http://127.0.0.1:{}", crate::poll::free_port());
    let out = std::process::Command::new(&python)
        .arg(format!("{root}/deploy/clients/openai_failover.py"))
        .args([MODEL, &dead, &a])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "failover client:\n{stdout}\n{stderr}");
    assert!(
        !stdout.trim().is_empty(),
        "it printed the reply: {stdout:?}"
    );
}

/// `deploy/haproxy/haproxy.cfg` in front of two gateways: non-streamed requests through it keep
/// succeeding, byte for byte, while one gateway node is killed — HAProxy sends a request whose
/// gateway died before answering to the other one. Skipped where `haproxy` is not installed
/// (`make test` installs it on Debian).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_in_front_of_two_gateways_hides_the_death_of_one() {
    if std::process::Command::new("haproxy")
        .arg("-v")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: haproxy is not installed (apt-get install haproxy)");
        return;
    }
    let c = Cluster::start_with(
        3,
        &["--gateways", "2", "--chaos", "--max-restarts", "100"],
        &["worker.kv_blocks=256"],
    );
    crate::http::wait_routable(&c, 2).await;
    let gws = gateways(&c).await;
    assert_eq!(gws.len(), 2, "{gws:?}");
    let a = c.gateway.clone();
    let (b_node, b) = gws.iter().find(|(_, u)| *u != a).cloned().unwrap();
    let front = format!("127.0.0.1:{}", crate::poll::free_port());
    let cfg = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/haproxy/haproxy.cfg"
    ))
    .unwrap()
    .replace("127.0.0.1:8000", &front)
    .replace("127.0.0.1:8080", a.trim_start_matches("http://"))
    .replace("127.0.0.1:8081", b.trim_start_matches("http://"));
    let dir = std::env::temp_dir().join(format!("flotilla-haproxy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, cfg).unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _haproxy = Kill(
        std::process::Command::new("haproxy")
            .arg("-db")
            .arg("-f")
            .arg(&path)
            .spawn()
            .expect("haproxy starts"),
    );
    let front = format!("http://{front}");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(180))
        .build()
        .unwrap();
    let ask = {
        let (client, front) = (client.clone(), front.clone());
        move |i: usize| {
            let (client, url) = (client.clone(), format!("{front}/v1/chat/completions"));
            async move {
                let r = client.post(url).json(&body(i)).send().await?;
                let status = r.status().as_u16();
                let v: serde_json::Value = r.json().await?;
                anyhow::ensure!(status == 200, "{status}: {v}");
                Ok::<String, anyhow::Error>(
                    v["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                )
            }
        }
    };
    poll_until(Duration::from_secs(30), "haproxy up", || async {
        reqwest::get(format!("{front}/health"))
            .await
            .is_ok_and(|r| r.status() == 200)
            .then_some(())
    })
    .await;
    let mut reference = Vec::new();
    for i in 0..12 {
        reference.push(ask(i).await.expect("reference through haproxy"));
    }
    let load = {
        let ask = ask.clone();
        tokio::spawn(async move {
            use futures::StreamExt;
            futures::stream::iter(0..12)
                .map(|i| {
                    let ask = ask.clone();
                    async move { (i, ask(i).await) }
                })
                .buffer_unordered(4)
                .collect::<Vec<_>>()
                .await
        })
    };
    // Kill b while it holds requests (its in-flight gauge), so HAProxy must resend them.
    let b_at = At(b.clone());
    poll_until(
        Duration::from_secs(60),
        "requests in flight on b",
        || async {
            (crate::http::metric_sum(&b_at, "flotilla_requests_in_flight").await > 0).then_some(())
        },
    )
    .await;
    let r = client
        .post(format!("{a}/chaos/faults"))
        .json(&serde_json::json!({"kind": "kill_node", "target": {"node": b_node}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    for (i, r) in load.await.unwrap() {
        let text = r.unwrap_or_else(|e| panic!("request {i} through haproxy failed: {e:#}"));
        assert_eq!(text, reference[i], "request {i} changed");
    }
}
