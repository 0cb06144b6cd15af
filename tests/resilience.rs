//! The resilience loop on real processes (`flotilla up`): B11 migration, B15 health under a
//! hung or dead engine, B16 drain, B17 containment (cases in `../shared/cases/README.md`).

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{
    http::{MODEL, counter_sum, fleet, health, post, wait_routable},
    process::{Cluster, node_pid, signal},
};
use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// A streamed chat completion, read as it arrives.
struct Stream {
    text: String,
    ids: Vec<String>,
    role_deltas: usize,
    finishes: Vec<String>,
    done: bool,
    error: Option<Value>,
    /// Tokens counted through `logprobs` (one entry per token).
    tokens: usize,
    usage_completion: Option<u64>,
}

/// Stream `body` (streaming with usage and logprobs forced on); `on_tokens(n)` runs once each
/// time the token count crosses a value in `marks` (in order).
async fn stream_with(
    url: &str,
    body: Value,
    marks: &[usize],
    on_mark: impl FnMut(usize) -> futures::future::BoxFuture<'static, ()>,
) -> Stream {
    stream_routed(url, body, None, marks, on_mark).await
}

/// [`stream_with`] under the routing policy `policy` (header `x-flotilla-route-policy`).
async fn stream_routed(
    url: &str,
    mut body: Value,
    policy: Option<&str>,
    marks: &[usize],
    mut on_mark: impl FnMut(usize) -> futures::future::BoxFuture<'static, ()>,
) -> Stream {
    body["stream"] = json!(true);
    body["logprobs"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let mut req = reqwest::Client::new().post(url).json(&body);
    if let Some(p) = policy {
        req = req.header("x-flotilla-route-policy", p);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut s = Stream {
        text: String::new(),
        ids: vec![],
        role_deltas: 0,
        finishes: vec![],
        done: false,
        error: None,
        tokens: 0,
        usage_completion: None,
    };
    let mut next_mark = 0;
    let mut buf = String::new();
    let mut bytes = resp.bytes_stream();
    while let Some(b) = bytes.next().await {
        buf.push_str(&String::from_utf8_lossy(&b.unwrap()));
        while let Some(pos) = buf.find("\n\n") {
            let rec: String = buf.drain(..pos + 2).collect();
            let Some(data) = rec.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                s.done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            if v.get("error").is_some() {
                s.error = Some(v["error"].clone());
                continue;
            }
            let id = v["id"].as_str().unwrap().to_owned();
            if !s.ids.contains(&id) {
                s.ids.push(id);
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                s.usage_completion = Some(n);
            }
            for c in v["choices"].as_array().into_iter().flatten() {
                if c["delta"].get("role").is_some() {
                    s.role_deltas += 1;
                }
                if let Some(t) = c["delta"]["content"].as_str() {
                    s.text.push_str(t);
                }
                s.tokens += c["logprobs"]["content"].as_array().map_or(0, |a| a.len());
                if let Some(f) = c["finish_reason"].as_str() {
                    s.finishes.push(f.to_owned());
                }
            }
            while next_mark < marks.len() && s.tokens >= marks[next_mark] {
                on_mark(next_mark).await;
                next_mark += 1;
            }
        }
    }
    s
}

fn nodes(f: &Value) -> Vec<Value> {
    f["nodes"].as_array().unwrap().clone()
}

async fn chaos(gateway: &str, fault: Value) -> Value {
    let r = reqwest::Client::new()
        .post(format!("{gateway}/chaos/faults"))
        .json(&fault)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 201, "{v}");
    v
}

fn story(max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
           "max_tokens": max_tokens, "temperature": 0, "seed": 1})
}

fn assert_one_sound_stream(s: &Stream, max_tokens: u64) {
    assert!(s.error.is_none(), "error record: {:?}", s.error);
    assert_eq!(s.ids.len(), 1, "one id: {:?}", s.ids);
    assert_eq!(s.role_deltas, 1, "one role delta");
    assert_eq!(s.finishes.len(), 1, "one finish reason: {:?}", s.finishes);
    assert!(s.done, "[DONE]");
    let usage = s.usage_completion.expect("usage");
    assert_eq!(
        usage as usize, s.tokens,
        "usage counts the tokens delivered"
    );
    assert!(usage <= max_tokens, "the budget carries across migrations");
}

/// B11 (1) and (2): kill the serving worker's node after 50 tokens, then the new serving
/// worker after 120; the client sees one seamless stream equal to the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_migrates_twice_without_a_seam() {
    let c = Cluster::start_with(
        4,
        &["--chaos"],
        &["worker.kv_blocks=128", "gateway.migration_limit=2"],
    );
    wait_routable(&c, 3).await;
    let url = c.url("/v1/chat/completions");
    let reference = stream_with(&url, story(200), &[], |_| Box::pin(async {})).await;
    assert_one_sound_stream(&reference, 200);
    assert_eq!(reference.tokens, 200, "the reference runs to max_tokens");

    let gw = c.url("");
    let migrated = stream_with(&url, story(200), &[50, 120], move |_| {
        let gw = gw.clone();
        Box::pin(async move {
            chaos(&gw, json!({"kind": "kill_node", "target": "any_busy"})).await;
        })
    })
    .await;
    assert_one_sound_stream(&migrated, 200);
    assert_eq!(migrated.text, reference.text, "byte for byte");
    assert_eq!(migrated.tokens, reference.tokens);
    let migrations = counter_sum(&c, "migrations").await;
    assert_eq!(migrations, 2, "two migrations, counted in /v1/fleet");
}

/// B11 with sampling: a seeded `temperature > 0` stream resumes its draws where it left off,
/// so even a sampled stream is identical after migrating (here: its replica killed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_sampled_stream_migrates_identically() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=128"]);
    wait_routable(&c, 2).await;
    let url = c.url("/v1/chat/completions");
    let mut body = story(120);
    body["temperature"] = json!(0.9);
    body["seed"] = json!(7);
    let reference = stream_with(&url, body.clone(), &[], |_| Box::pin(async {})).await;
    assert_one_sound_stream(&reference, 120);
    let gw = c.url("");
    let migrated = stream_with(&url, body, &[40], move |_| {
        let gw = gw.clone();
        Box::pin(async move {
            chaos(
                &gw,
                json!({"kind": "kill_actor", "actor": "scheduler", "target": "any_busy"}),
            )
            .await;
        })
    })
    .await;
    assert_one_sound_stream(&migrated, 120);
    assert_eq!(migrated.text, reference.text);
}

/// B15 (1): a hung engine is detected within the step timeout, its replica leaves routing and
/// restarts, and the request on it migrates and completes; counters say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_is_detected_and_its_request_migrates() {
    let c = Cluster::start_with(
        3,
        &["--chaos"],
        &[
            "worker.kv_blocks=128",
            "worker.step_timeout_ms=1500",
            "worker.canary_interval_ms=500",
        ],
    );
    wait_routable(&c, 2).await;
    let url = c.url("/v1/chat/completions");
    let reference = stream_with(&url, story(150), &[], |_| Box::pin(async {})).await;
    let gw = c.url("");
    let hung_at = std::sync::Arc::new(std::sync::Mutex::new(None));
    let h2 = hung_at.clone();
    let s = stream_with(&url, story(150), &[30], move |_| {
        let (gw, h2) = (gw.clone(), h2.clone());
        Box::pin(async move {
            chaos(&gw, json!({"kind": "hang", "target": "any_busy"})).await;
            *h2.lock().unwrap() = Some(Instant::now());
        })
    })
    .await;
    assert_one_sound_stream(&s, 150);
    assert_eq!(s.text, reference.text, "the migrated stream is unchanged");
    let t0 = hung_at.lock().unwrap().expect("the hang was injected");
    let elapsed = t0.elapsed();
    // Detected within the step timeout plus a watchdog tick and the re-prefill.
    let hangs = counter_sum(&c, "engine_hangs").await;
    assert_eq!(hangs, 1, "one hang detected");
    assert!(
        elapsed < Duration::from_secs(15),
        "the stream ended {elapsed:?} after the hang"
    );
    // The restarted replica is routable again.
    wait_routable(&c, 2).await;

    // An idle engine that hangs is found by the canary.
    let before = Instant::now();
    chaos(
        &c.url(""),
        json!({"kind": "hang", "target": {"node": "node-2"}}),
    )
    .await;
    crate::poll::poll_until(Duration::from_secs(10), "canary detection", || async {
        let n = counter_sum(&c, "engine_hangs").await;
        (n == 2).then_some(())
    })
    .await;
    // canary interval + step timeout + a heartbeat.
    assert!(before.elapsed() < Duration::from_millis(500 + 1500 + 4000));
}

/// B15 (2): the engine of the only worker killed: its replica restarts and serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_restarts_its_replica() {
    let c = Cluster::start_with(2, &["--chaos"], &["worker.kv_blocks=128"]);
    wait_routable(&c, 1).await;
    assert_eq!(health(&c).await.0, 200);
    let r0 = counter_sum(&c, "restarts").await;
    chaos(
        &c.url(""),
        json!({"kind": "kill_actor", "actor": "engine", "target": {"node": "node-1"}}),
    )
    .await;
    crate::poll::poll_until(Duration::from_secs(10), "replica restarted", || async {
        (counter_sum(&c, "restarts").await > r0).then_some(())
    })
    .await;
    wait_routable(&c, 1).await;
    let (s, _, t) = post(&c.url("/v1/chat/completions"), &story(8)).await;
    assert_eq!(s, 200, "{t}");
}

/// B15 (3): with every worker gone, `/health` is 503 (`not_ready`) and requests are refused
/// cleanly with 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_with_no_worker() {
    let c = Cluster::start_with(2, &["--no-restart"], &["worker.kv_blocks=128"]);
    wait_routable(&c, 1).await;
    let pid = node_pid(&c, "node-1").await;
    signal(pid, Signal::SIGKILL);
    let body = crate::poll::poll_until(Duration::from_secs(5), "health 503", || async {
        let (s, b) = health(&c).await;
        (s == 503).then_some(b)
    })
    .await;
    assert_eq!(body["status"], "not_ready", "{body}");
    let (s, _, t) = post(&c.url("/v1/chat/completions"), &story(8)).await;
    assert_eq!(s, 503, "{t}");
}

/// SIGTERM drains a worker node — it leaves routing at once, its streams finish
/// normally, new requests go elsewhere with no 5xx, and the process exits; with a short grace
/// period the streams still running migrate and finish unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_worker_node() {
    let c = Cluster::start_with(
        3,
        &[],
        &["worker.kv_blocks=256", "node.drain_grace_ms=60000"],
    );
    wait_routable(&c, 2).await;
    let url = c.url("/v1/chat/completions");
    let reference = stream_with(&url, story(120), &[], |_| Box::pin(async {})).await;
    // Several streams, on both workers.
    let streams: Vec<_> = (0..6)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(
                // Round-robin: the test is about draining, so both workers must have streams
                // (kv would keep these identical prompts on the worker that holds them).
                async move {
                    stream_routed(&url, story(120), Some("round_robin"), &[], |_| {
                        Box::pin(async {})
                    })
                    .await
                },
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let f = fleet(&c).await;
    let node2 = nodes(&f).into_iter().find(|n| n["id"] == "node-2").unwrap();
    assert!(
        node2["workers"][0]["in_flight"].as_u64().unwrap() > 0,
        "node-2 has work: {node2}"
    );
    let pid = node2["pid"].as_i64().unwrap() as i32;
    signal(pid, Signal::SIGTERM);
    // It leaves routing at once.
    crate::poll::poll_until(Duration::from_secs(2), "node-2 out of routing", || async {
        let (_, h) = health(&c).await;
        (h["routable_workers"].as_u64() == Some(1)).then_some(())
    })
    .await;
    // New requests are served (by node-1) with no 5xx while node-2 drains.
    for _ in 0..3 {
        let (s, _, t) = post(&url, &story(4)).await;
        assert_eq!(s, 200, "{t}");
    }
    for h in streams {
        let s = h.await.unwrap();
        assert_one_sound_stream(&s, 120);
        assert_eq!(s.text, reference.text);
    }
    // Drained: the process exits (and `up` leaves it stopped).
    crate::poll::poll_until(Duration::from_secs(20), "node-2 exits", || async {
        let gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_err();
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true);
        (gone || zombie).then_some(())
    })
    .await;
}

/// B16 variant: a grace period shorter than the streams: what still runs at the deadline
/// migrates and finishes unchanged; none is cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_grace_migrates_the_rest() {
    let c = Cluster::start_with(3, &[], &["worker.kv_blocks=256", "node.drain_grace_ms=300"]);
    wait_routable(&c, 2).await;
    let url = c.url("/v1/chat/completions");
    let reference = stream_with(&url, story(200), &[], |_| Box::pin(async {})).await;
    let streams: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(
                // Round-robin: the test is about draining, so both workers must have streams
                // (kv would keep these identical prompts on the worker that holds them).
                async move {
                    stream_routed(&url, story(200), Some("round_robin"), &[], |_| {
                        Box::pin(async {})
                    })
                    .await
                },
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = node_pid(&c, "node-2").await;
    signal(pid, Signal::SIGTERM);
    for h in streams {
        let s = h.await.unwrap();
        assert_one_sound_stream(&s, 200);
        assert_eq!(s.text, reference.text);
    }
    let migrations = counter_sum(&c, "migrations").await;
    assert!(
        migrations > 0,
        "streams still running at the deadline migrated"
    );
}

/// A panic in a worker's actor reaches its supervisor (the replica restarts, the panic
/// and the restart are counted), a panic in a bare task is counted and logged, and killing
/// the gateway's HTTP actor restarts it — traffic to healthy workers sees no 5xx throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panics_are_contained_and_counted() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=128"]);
    wait_routable(&c, 2).await;
    let counters = |f: &Value, node: &str| {
        nodes(f).into_iter().find(|n| n["id"] == node).unwrap()["counters"].clone()
    };
    let f0 = fleet(&c).await;
    let before = counters(&f0, "node-1");
    chaos(
        &c.url(""),
        json!({"kind": "panic", "target": {"worker": "node-1/replica-0"}}),
    )
    .await;
    chaos(
        &c.url(""),
        json!({"kind": "panic_task", "target": {"node": "node-1"}}),
    )
    .await;
    let after = crate::poll::poll_until(Duration::from_secs(10), "counters", || async {
        let f = fleet(&c).await;
        let a = counters(&f, "node-1");
        (a["panics"].as_u64() == Some(before["panics"].as_u64().unwrap() + 2)
            && a["restarts"].as_u64() > before["restarts"].as_u64())
        .then_some(a)
    })
    .await;
    // The scheduler's panic restarts its replica: one_for_all restarts its 3 parts.
    assert_eq!(
        after["restarts"].as_u64().unwrap() - before["restarts"].as_u64().unwrap(),
        3,
        "{after}"
    );
    wait_routable(&c, 2).await;
    for _ in 0..4 {
        let (s, _, t) = post(&c.url("/v1/chat/completions"), &story(4)).await;
        assert_eq!(s, 200, "{t}");
    }
    // B17 (4): the worker-pool supervisor of node-1 killed: the node's supervisor starts it
    // again and it rebuilds its replicas in order; node-2 serves meanwhile.
    let r0 = counter_sum(&c, "restarts").await;
    chaos(
        &c.url(""),
        json!({"kind": "kill_actor", "actor": "worker_pool", "target": {"node": "node-1"}}),
    )
    .await;
    let (s, _, t) = post(&c.url("/v1/chat/completions"), &story(4)).await;
    assert_eq!(s, 200, "{t}");
    crate::poll::poll_until(Duration::from_secs(10), "worker pool restarted", || async {
        (counter_sum(&c, "restarts").await > r0).then_some(())
    })
    .await;
    wait_routable(&c, 2).await;
    // A gateway actor named on a worker target: that node runs none, so nothing would be
    // killed: refused, naming the node.
    // (The fleet view the chaos API resolves targets from follows the routable group by up to
    // a heartbeat: until it lists the rebuilt replica, the answer is "matches no live worker".)
    let t = crate::poll::poll_until(Duration::from_secs(10), "the rebuilt replica in the fleet view", || async {
        let (s, _, t) = post(
            &c.url("/chaos/faults"),
            &json!({"kind": "kill_actor", "actor": "http_gateway", "target": {"worker": "node-1/replica-0"}}),
        )
        .await;
        assert_eq!(s, 400, "{t}");
        (!t.contains("matches no live worker")).then_some(t)
    })
    .await;
    assert!(t.contains("node node-1 runs no http_gateway"), "{t}");
    // The gateway's HTTP actor killed: its supervisor starts it again on the same address.
    chaos(
        &c.url(""),
        json!({"kind": "kill_actor", "actor": "http_gateway", "target": {"node": "node-0"}}),
    )
    .await;
    let (s, _, t) = crate::poll::poll_until(Duration::from_secs(10), "gateway back", || async {
        match reqwest::Client::new()
            .post(c.url("/v1/chat/completions"))
            .json(&story(4))
            .send()
            .await
        {
            Ok(r) => {
                let s = r.status().as_u16();
                Some((s, (), r.text().await.unwrap_or_default()))
            }
            Err(_) => None,
        }
    })
    .await;
    assert_eq!(s, 200, "{t}");
}

/// Chaos `partition`: a worker node cut off from the rest (sessions refused across the cut,
/// its process alive) leaves routing at once; the streams it served migrate and finish
/// unchanged; at the deadline the cut heals and the node is routable again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_worker_leaves_routing_and_heals() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=128"]);
    wait_routable(&c, 2).await;
    let url = c.url("/v1/chat/completions");
    let reference = stream_with(&url, story(150), &[], |_| Box::pin(async {})).await;
    let pid = node_pid(&c, "node-2").await;
    // Two streams on different workers (round-robin: the kv policy would keep both on the
    // worker that cached the reference's prompt).
    let streams: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let rr = Some("round_robin");
                stream_routed(&url, story(150), rr, &[], |_| Box::pin(async {})).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    chaos(
        &c.url(""),
        json!({"kind": "partition", "nodes": ["node-2"], "target": "any_busy", "duration_ms": 3000}),
    )
    .await;
    wait_routable(&c, 1).await;
    for h in streams {
        let s = h.await.unwrap();
        assert_one_sound_stream(&s, 150);
        assert_eq!(s.text, reference.text);
    }
    assert!(
        counter_sum(&c, "migrations").await >= 1,
        "the stream on node-2 migrated"
    );
    assert!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok(),
        "a partition cuts the network, not the process"
    );
    wait_routable(&c, 2).await;
    assert_eq!(node_pid(&c, "node-2").await, pid, "healed, not restarted");
    // A partition needs a deadline.
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "partition", "nodes": ["node-2"], "target": "any_busy"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

/// Killing the gateway node's token sink (events in its mailbox are lost) or its HTTP actor
/// mid-stream loses nothing: the lost tokens show up as a gap in the token indices (or a
/// stall), the request resumes from what was delivered, and the restarted HTTP actor binds
/// the same port while the old connection finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_token_sink_or_the_http_actor_loses_nothing() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=128"]);
    wait_routable(&c, 2).await;
    let url = c.url("/v1/chat/completions");
    let reference = stream_with(&url, story(200), &[], |_| Box::pin(async {})).await;
    let gw = c.url("");
    let s = stream_with(&url, story(200), &[30, 80], move |k| {
        let gw = gw.clone();
        let actor = if k == 0 { "token_sink" } else { "http_gateway" };
        Box::pin(async move {
            chaos(
                &gw,
                json!({"kind": "kill_actor", "actor": actor, "target": {"node": "node-0"}}),
            )
            .await;
        })
    })
    .await;
    assert_one_sound_stream(&s, 200);
    assert_eq!(s.text, reference.text);
    let (status, _, t) = post(&url, &story(4)).await;
    assert_eq!(status, 200, "{t}");
}

/// `fill_kv` pauses a worker's requests (no blocks); when it ends they resume by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_paused_by_fill_kv_resumes_when_it_ends() {
    let c = Cluster::start_with(2, &["--chaos"], &["worker.kv_blocks=64"]);
    wait_routable(&c, 1).await;
    let url = c.url("/v1/chat/completions");
    let reference = stream_with(&url, story(300), &[], |_| Box::pin(async {})).await;
    let gw = c.url("");
    let s = tokio::time::timeout(
        Duration::from_secs(60),
        stream_with(&url, story(300), &[20], move |_| {
            let gw = gw.clone();
            Box::pin(async move {
                chaos(
                    &gw,
                    json!({"kind": "fill_kv", "fraction": 0.99, "target": {"node": "node-1"}, "duration_ms": 1500}),
                )
                .await;
            })
        }),
    )
    .await
    .expect("the stream resumed after fill_kv ended");
    assert_one_sound_stream(&s, 300);
    assert_eq!(s.text, reference.text);
}

/// The chaos API refuses what cannot be done, with the OpenAI error shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_refuses_impossible_faults() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=64"]);
    wait_routable(&c, 2).await;
    let client = reqwest::Client::new();
    for (body, param) in [
        (
            json!({"kind": "partition", "nodes": ["node-0", "node-1", "node-2"], "duration_ms": 1000}),
            "nodes",
        ),
        (
            json!({"kind": "partition", "nodes": ["node-1"], "duration_ms": 18446744073709551615u64}),
            "duration_ms",
        ),
        (
            json!({"kind": "partition", "nodes": ["node-9"], "duration_ms": 1000}),
            "nodes",
        ),
        (
            json!({"kind": "kill_actor", "actor": "router", "target": {"node": "node-1"}}),
            "actor",
        ),
        (
            json!({"kind": "kill_actor", "actor": "nobody", "target": "any_busy"}),
            "actor",
        ),
        (
            json!({"kind": "fill_kv", "fraction": 1.5, "target": "any_busy"}),
            "fraction",
        ),
    ] {
        let r = client
            .post(c.url("/chaos/faults"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    let r = client
        .delete(c.url("/chaos/faults/abc"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = client
        .post(c.url("/chaos/faults"))
        .header("content-type", "application/json")
        .body(vec![b' '; 100 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    // Still serving.
    let (s, _, t) = post(&c.url("/v1/chat/completions"), &story(4)).await;
    assert_eq!(s, 200, "{t}");
}
