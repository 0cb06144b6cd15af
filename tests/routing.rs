//! KV-aware routing on a simulated fleet: the real schedulers, block managers, KV events and
//! router, with the forward pass replaced by the H100 timing model. B12 and B13 of
//! `../shared/cases/README.md`, and a shared-prefix workload.
//!
//! Most tests run the fleet in this process (`inproc::Fleet`: one node with the gateway, the
//! router and the simulated workers); the two that kill a worker node's process run on
//! `flotilla up --engine sim`.

#[path = "common/http.rs"]
mod http;
#[path = "common/inproc.rs"]
mod inproc;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{
    http::{Gateway, MODEL, delta, metric_sum, placements, wait_routable},
    inproc::{FleetOptions, NODE},
    process::{Cluster, node_pid, signal},
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::time::Duration;

fn prefix(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{} ", i % 97)).collect()
}

fn chat(system: &str, user: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
           "max_tokens": max_tokens, "ignore_eos": true})
}

async fn send(c: &impl Gateway, path: &str, body: &Value) -> Value {
    let r = reqwest::Client::new()
        .post(c.url(path))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

/// Requests sharing a prefix land on the worker that holds it (and hit its cache); a new
/// prefix is placed by load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_lands_on_its_holder() {
    let c = FleetOptions::new(4).start().await;
    wait_routable(&c, 4).await;
    let p = prefix("alpha", 300);
    let first = send(&c, "/v1/chat/completions", &chat(&p, "q0", 4)).await;
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let before = placements(&c).await;
    for i in 1..6 {
        let v = send(&c, "/v1/chat/completions", &chat(&p, &format!("q{i}"), 4)).await;
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= 256, "request {i} reused the prefix: {cached}");
    }
    let d = delta(&placements(&c).await, &before);
    assert_eq!(d.len(), 1, "all on the holder: {d:?}");
    // The same workload with round_robin spreads and misses.
    let before = placements(&c).await;
    for i in 6..10 {
        let r = reqwest::Client::new()
            .post(c.url("/v1/chat/completions"))
            .header("x-flotilla-route-policy", "round_robin")
            .json(&chat(&p, &format!("q{i}"), 4))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let d = delta(&placements(&c).await, &before);
    assert_eq!(d.len(), 4, "round_robin visits every worker: {d:?}");
}

/// One hot 2k-token prefix, many clients on the chat and completions routes: load wins
/// over cache — no worker serves more than half — and every in-flight count returns to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_still_spreads_over_workers() {
    let c = FleetOptions::new(4)
        .set("worker.kv_blocks=4096")
        .start()
        .await;
    wait_routable(&c, 4).await;
    let p = prefix("shared", 1000);
    let before = placements(&c).await;
    let mut tasks = Vec::new();
    for i in 0..48 {
        let url = c.url("");
        let p = p.clone();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let (path, body) = if i % 2 == 0 {
                ("/v1/chat/completions", chat(&p, &format!("client {i}"), 64))
            } else {
                (
                    "/v1/completions",
                    json!({"model": MODEL, "prompt": format!("{p} client {i}"), "max_tokens": 64, "ignore_eos": true}),
                )
            };
            let r = client.post(format!("{url}{path}")).json(&body).send().await.unwrap();
            r.status().as_u16()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let d = delta(&placements(&c).await, &before);
    let total: u64 = d.values().sum();
    assert_eq!(total, 48);
    let max = *d.values().max().unwrap();
    assert!(max * 2 <= total, "no worker serves more than half: {d:?}");
    assert!(d.len() >= 3, "load spread: {d:?}");
    crate::poll::poll_until(Duration::from_secs(10), "in-flight back to 0", || async {
        (crate::http::workers_sum(&c, "in_flight").await == 0).then_some(())
    })
    .await;
}

/// B12 with the KV-aware router: the worker holding the hottest prefix dies abruptly; once
/// its session drops it is never chosen again, and requests sharing the prefix all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefix_holder_is_never_chosen() {
    let c = Cluster::start_with(4, &["--engine", "sim", "--no-restart"], &[]);
    wait_routable(&c, 3).await;
    let p = prefix("hot", 700);
    let before = placements(&c).await;
    for i in 0..5 {
        send(
            &c,
            "/v1/chat/completions",
            &chat(&p, &format!("warm {i}"), 2),
        )
        .await;
    }
    let d = delta(&placements(&c).await, &before);
    assert_eq!(d.len(), 1, "the prefix lives on one worker: {d:?}");
    let holder = d.keys().next().unwrap().clone();
    let node = holder.split('/').next().unwrap().to_owned();
    let pid = node_pid(&c, &node).await;
    signal(pid, Signal::SIGKILL);
    wait_routable(&c, 2).await;
    let before = placements(&c).await;
    let mut tasks = Vec::new();
    for i in 0..30 {
        let url = c.url("/v1/chat/completions");
        let body = chat(&p, &format!("after {i}"), 2);
        tasks.push(tokio::spawn(async move {
            let r = reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap();
            r.status().as_u16()
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200, "no client-visible error");
    }
    let d = delta(&placements(&c).await, &before);
    assert!(
        !d.contains_key(&holder),
        "the dead holder was chosen: {d:?}"
    );
    assert_eq!(d.values().sum::<u64>(), 30);
}

/// The router's resync count (`flotilla_router_resyncs_total`) on the gateway's `/metrics`.
async fn resyncs(c: &impl Gateway) -> Option<f64> {
    let text = reqwest::get(c.url("/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with("flotilla_router_resyncs_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
}

/// Chaos `drop_kv_events`: routers see gaps, resync each affected worker from its block
/// manager's snapshot (counted), and prefix-aware placement keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_kv_events_trigger_a_resync_and_routing_recovers() {
    let c = FleetOptions::new(2).chaos().start().await;
    wait_routable(&c, 2).await;
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "drop_kv_events", "rate": 0.5, "seed": 3, "target": {"worker": format!("{NODE}/replica-0")}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"].as_u64().unwrap();
    // Counted from here: the metrics recorder is per process, shared with earlier tests.
    let resyncs0 = resyncs(&c).await.unwrap_or(0.0);
    for i in 0..8 {
        let p = prefix(&format!("d{i}x"), 200);
        send(&c, "/v1/chat/completions", &chat(&p, "q", 2)).await;
    }
    reqwest::Client::new()
        .delete(c.url(&format!("/chaos/faults/{id}")))
        .send()
        .await
        .unwrap();
    // A later event after the gap makes the router notice and resync.
    let p = prefix("after", 200);
    send(&c, "/v1/chat/completions", &chat(&p, "q", 2)).await;
    let n = crate::poll::poll_until(Duration::from_secs(10), "a resync", || async {
        resyncs(&c).await.filter(|n| *n >= resyncs0 + 1.0)
    })
    .await;
    assert!(n >= resyncs0 + 1.0);
    // After the resync, a shared prefix still lands on its holder.
    let before = placements(&c).await;
    for i in 0..4 {
        let v = send(
            &c,
            "/v1/chat/completions",
            &chat(&p, &format!("again {i}"), 2),
        )
        .await;
        assert!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                >= 128
        );
    }
    assert_eq!(delta(&placements(&c).await, &before).len(), 1);
}

/// A restarted router rebuilds its prefix index from every live worker's snapshot on its
/// first tick, not at each worker's next KV event (an idle fleet sends none): the index is
/// whole again within a bound, and a cached prefix still lands on its holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_rebuilds_its_index_from_snapshots_at_once() {
    let c = FleetOptions::new(2).chaos().start().await;
    wait_routable(&c, 2).await;
    let prompts: Vec<String> = (0..4).map(|i| prefix(&format!("r{i}x"), 200)).collect();
    for p in &prompts {
        send(&c, "/v1/chat/completions", &chat(p, "q", 2)).await;
    }
    // The index as the first router built it from events (settled: two equal reads).
    let last = std::sync::atomic::AtomicU64::new(0);
    let held = crate::poll::poll_until(Duration::from_secs(10), "a settled index", || async {
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        let now = metric_sum(&c, "flotilla_router_index_blocks").await;
        let before = last.swap(now, std::sync::atomic::Ordering::Relaxed);
        (now > 0 && now == before).then_some(now)
    })
    .await;
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "kill_actor", "actor": "router", "target": {"node": NODE}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let killed = std::time::Instant::now();
    // The new router starts from an empty index; no request meanwhile: nothing but the
    // bootstrap can fill it.
    crate::poll::poll_until(Duration::from_secs(10), "the new router", || async {
        (metric_sum(&c, "flotilla_router_index_blocks").await == 0).then_some(())
    })
    .await;
    crate::poll::poll_until(Duration::from_secs(10), "the index rebuilt", || async {
        (metric_sum(&c, "flotilla_router_index_blocks").await == held).then_some(())
    })
    .await;
    let took = killed.elapsed();
    // The figure for docs/benchmarks.md; no timed assertion: without the bootstrap the index
    // never fills (the poll above times out), with it a tick (1 s) plus a round trip.
    eprintln!("router index rebuilt ({held} holdings) {took:?} after the kill");
    wait_routable(&c, 2).await;
    for p in &prompts {
        let v = send(&c, "/v1/chat/completions", &chat(p, "again", 2)).await;
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        assert!(cached.unwrap() >= 128, "{v}");
    }
}

/// `flotilla profile` fits the CPU engine and writes a profile that a sim fleet runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_measured_cpu_profile_drives_a_sim_fleet() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cpu.json");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args([
            "profile",
            "--num-blocks",
            "64",
            "--batch",
            "4",
            "--repeats",
            "1",
            "--out",
        ])
        .arg(&out)
        // Its capacity file too goes to the temporary directory, not over the repository's.
        .arg("--capacity-out")
        .arg(dir.path().join("capacity.json"))
        .status()
        .unwrap();
    assert!(status.success());
    let p = flotilla::worker::engine::sim::SimProfile::load(&out).unwrap();
    assert!(p.source.contains("CPU engine"), "{}", p.source);
    assert!(p.prefill_ms(512) > p.prefill_ms(16), "{p:?}");
    // The measured points travel with the fit: prefills of 1…512 tokens, decodes of 1…8
    // sequences (the batch), and the cost of a cached prefix.
    assert_eq!(p.prefill_points.len(), 11, "{p:?}");
    assert_eq!(p.decode_points.len(), 4, "{p:?}");
    assert!(p.prefill_context_ms >= 0.0, "{p:?}");
    let set = format!("worker.sim_profile={}", out.display());
    let c = FleetOptions::new(1).set(&set).start().await;
    wait_routable(&c, 1).await;
    let v = send(&c, "/v1/chat/completions", &chat("You are terse.", "hi", 8)).await;
    assert_eq!(v["usage"]["completion_tokens"], 8);
}

/// B12 variant: the router's node is cut off from membership, a worker dies during the cut;
/// after healing, the router has the smaller pool and never picks the dead worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_lost_during_a_partition_is_dropped_after_healing() {
    let c = Cluster::start_with(4, &["--engine", "sim", "--no-restart", "--chaos"], &[]);
    wait_routable(&c, 3).await;
    let pid = node_pid(&c, "node-2").await;
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "partition", "nodes": ["node-0"], "target": "any_busy", "duration_ms": 2500}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    wait_routable(&c, 0).await;
    signal(pid, Signal::SIGKILL);
    // Healed: the two survivors come back, the dead one does not.
    wait_routable(&c, 2).await;
    let before = placements(&c).await;
    for i in 0..12 {
        send(
            &c,
            "/v1/chat/completions",
            &chat(&prefix("p", 50), &format!("{i}"), 2),
        )
        .await;
    }
    let d = delta(&placements(&c).await, &before);
    assert!(!d.contains_key("node-2/replica-0"), "{d:?}");
    assert_eq!(d.values().sum::<u64>(), 12);
    crate::poll::poll_until(
        Duration::from_secs(10),
        "node-2 down in the fleet",
        || async {
            let f = crate::http::fleet(&c).await;
            let n2 = f["nodes"]
                .as_array()?
                .iter()
                .find(|n| n["id"] == "node-2")
                .cloned();
            n2.is_none_or(|n| n["state"] != "up").then_some(())
        },
    )
    .await;
}

/// B13 variant: one worker ten times slower; requests with no cached prefix anywhere go to
/// workers with little load, so the slow one gets the least.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_worker_gets_the_least_new_work() {
    let c = FleetOptions::new(4).chaos().start().await;
    wait_routable(&c, 4).await;
    let r = reqwest::Client::new()
        .post(c.url("/chaos/faults"))
        .json(&json!({"kind": "slow", "delay_ms": 150, "target": {"worker": format!("{NODE}/replica-0")}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let before = placements(&c).await;
    let mut tasks = Vec::new();
    for i in 0..40 {
        let url = c.url("/v1/chat/completions");
        let body = chat(&prefix(&format!("u{i}x"), 100), "q", 32);
        tasks.push(tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let d = delta(&placements(&c).await, &before);
    let slow = d.get(&format!("{NODE}/replica-0")).copied().unwrap_or(0);
    let total: u64 = d.values().sum();
    assert_eq!(total, 40);
    assert!(
        slow * 5 <= total,
        "the slow worker got {slow} of {total}: {d:?}"
    );
    for (w, n) in &d {
        assert!(slow <= *n, "the slow worker got more than {w}: {d:?}");
    }
}

/// Disaggregation on the simulated engine: one prefill replica and three decode replicas in
/// one node (`worker.prefill_replicas`); long prompts are prefilled on the prefill replica and
/// their KV "pulled" by a decode replica in the modelled transfer time (bytes ÷ bandwidth), so
/// the gap between the first token (from the prefill replica) and the second (after the pull)
/// is at least that long; short prompts stay on the decode replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_fleet_disaggregates_with_modelled_transfer_times() {
    use futures::StreamExt;
    // 1 MiB per token at 1 GB/s: a ~600-token prompt takes ≥ 0.6 s to move.
    let c = FleetOptions::new(4)
        .set("worker.role=decode")
        .set("worker.prefill_replicas=1")
        .set("disagg.min_prefill_tokens=256")
        .set("worker.sim_kv_bytes_per_token=1048576")
        .set("worker.sim_transfer_gbps=1")
        .start()
        .await;
    wait_routable(&c, 4).await;
    let f: Value = reqwest::get(c.url("/v1/fleet"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let roles: Vec<(String, String)> = f["nodes"][0]["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["id"].as_str().unwrap().to_owned(),
                w["role"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert!(
        roles.contains(&(format!("{NODE}/replica-0"), "prefill".into())),
        "{roles:?}"
    );
    assert_eq!(roles.iter().filter(|(_, r)| r == "decode").count(), 3);

    let mut body = chat(&prefix("delta", 300), "go", 4);
    body["stream"] = json!(true);
    let resp = reqwest::Client::new()
        .post(c.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let (mut buf, mut times) = (String::new(), Vec::new());
    while let Some(b) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&b.unwrap()));
        while let Some(pos) = buf.find("\n\n") {
            let rec: String = buf.drain(..pos + 2).collect();
            if rec.contains("\"content\":") && !rec.contains("\"content\":\"\"") {
                times.push(std::time::Instant::now());
            }
        }
    }
    assert!(times.len() >= 2, "tokens streamed: {}", times.len());
    let gap = times[1] - times[0];
    assert!(
        gap >= Duration::from_millis(550),
        "the second token waits for the modelled transfer: {gap:?}"
    );
    let pulled = |f: &Value| -> u64 {
        f["nodes"][0]["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["kv_blocks_pulled"].as_u64().unwrap_or(0))
            .sum()
    };
    let f = crate::poll::poll_until(Duration::from_secs(10), "pull counted", || async {
        let f: Value = reqwest::get(c.url("/v1/fleet"))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        (pulled(&f) > 0).then_some(f)
    })
    .await;
    let p = pulled(&f);
    assert!(p >= 600 / 16, "the prompt's blocks were pulled: {p}");
    // A short prompt is not disaggregated: nothing more is pulled.
    send(&c, "/v1/chat/completions", &chat("Be brief.", "hi", 2)).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let f: Value = reqwest::get(c.url("/v1/fleet"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(pulled(&f), p);
    c.stop().await;
}

/// A pick whose worker left a moment before the request reached it (the router still lists
/// it: here its scheduler is taken out of the schedulers' group while it stays routable, the
/// window a kill opens before the router's view catches up) is routed again at once,
/// avoiding that worker: the client never sees "the chosen worker went away".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_whose_worker_is_gone_is_routed_again() {
    let c = FleetOptions::new(2).start().await;
    wait_routable(&c, 2).await;
    let group = "flotilla.schedulers".to_owned();
    let gone = format!("{NODE}/replica-0/scheduler");
    let cell = ractor::pg::get_members(&group)
        .into_iter()
        .find(|a| a.get_name().as_deref() == Some(gone.as_str()))
        .expect("replica-0's scheduler");
    ractor::pg::leave(group, vec![cell]);
    let retries_before = metric_sum(&c, "flotilla_route_retries_total").await;
    for i in 0..6 {
        let r = reqwest::Client::new()
            .post(c.url("/v1/chat/completions"))
            .header("x-flotilla-route-policy", "round_robin")
            .json(&chat("hello", &format!("q{i}"), 2))
            .send()
            .await
            .unwrap();
        let status = r.status();
        assert_eq!(status, 200, "request {i}: {}", r.text().await.unwrap());
    }
    let retries = metric_sum(&c, "flotilla_route_retries_total").await - retries_before;
    assert!(
        retries >= 1,
        "round_robin chose the departed worker at least once and routed again: {retries}"
    );
}
