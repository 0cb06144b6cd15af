//! The planner in a live fleet: `flotilla up --engine sim --planner` follows a load step up
//! (the local reconciler starts a worker node) and down (it drains one: no request is cut);
//! in mode advisory it publishes the same kind of decisions and changes nothing.
//!
//! The simulated replicas run 20× slower than the H100 profile (`worker.sim_speedup=0.05`)
//! so that a few requests at a time need more than one, with targets to match.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::{Gateway, MODEL, fleet, ready_workers};
use crate::poll::poll_until;
use crate::process::Cluster;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

const SETS: &[&str] = &[
    "worker.sim_speedup=0.05",
    "planner.interval_s=1",
    "planner.cooldown_s=2",
    "planner.scale_down_intervals=3",
    "planner.ttft_target_ms=5000",
    "planner.itl_target_ms=2000",
    "planner.aggregated.max=3",
];

/// The planner's latest decision for the aggregated pool, from `/v1/fleet`.
async fn latest_decision(c: &impl Gateway) -> Option<Value> {
    let f = fleet(c).await;
    f["nodes"]
        .as_array()?
        .iter()
        .find_map(|n| n["planner"]["decisions"].as_array()?.last().cloned())
}

/// Clients sending completions with `concurrency` at a time until `stop`; counts successes
/// and failures.
fn load(
    c: &Cluster,
    concurrency: usize,
    stop: Arc<AtomicBool>,
) -> (
    Arc<AtomicU64>,
    Arc<AtomicU64>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let url = c.url("/v1/completions");
    let tasks = (0..concurrency)
        .map(|k| {
            let (ok, failed, stop, url) = (ok.clone(), failed.clone(), stop.clone(), url.clone());
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let prompt: String = (0..120).map(|i| format!("w{k}x{n}y{i} ")).collect();
                    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 16});
                    match client.post(&url).json(&body).send().await {
                        Ok(r) if r.status().is_success() => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {
                            failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    (ok, failed, tasks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_scales_a_live_fleet_up_and_drains_it_down() {
    let mut sets = SETS.to_vec();
    sets.push("planner.mode=act");
    let c = Cluster::start_with(2, &["--engine", "sim", "--planner"], &sets);
    assert_eq!(ready_workers(&c).await, 1);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed, tasks) = load(&c, 6, stop.clone());
    // Up: the planner asks for more and the reconciler starts a worker node.
    poll_until(
        Duration::from_secs(60),
        "a second worker under load",
        || async { (ready_workers(&c).await >= 2).then_some(()) },
    )
    .await;
    let d = latest_decision(&c).await.expect("a decision in /v1/fleet");
    assert_eq!(d["mode"], "act");
    assert!(d["forecast"]["request_rate"].as_f64().unwrap() > 0.0, "{d}");
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    // Down: with no load the planner drains back to its floor of one.
    poll_until(Duration::from_secs(90), "back to one worker", || async {
        (ready_workers(&c).await == 1).then_some(())
    })
    .await;
    let d = latest_decision(&c).await.unwrap();
    assert_eq!(d["pools"][0]["desired"], 1, "{d}");
    // Nothing was cut by the drain.
    assert!(ok.load(Ordering::Relaxed) > 0);
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "requests failed during scaling"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advisory_planner_publishes_decisions_and_changes_nothing() {
    let mut sets = SETS.to_vec();
    sets.push("planner.mode=advisory");
    let c = Cluster::start_with(2, &["--engine", "sim", "--planner"], &sets);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, _failed, tasks) = load(&c, 6, stop.clone());
    let d = poll_until(Duration::from_secs(60), "an advisory scale-up", || async {
        latest_decision(&c)
            .await
            .filter(|d| d["pools"][0]["desired"].as_u64() > Some(1))
    })
    .await;
    assert_eq!(d["mode"], "advisory");
    // Nobody acts on it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(ready_workers(&c).await, 1);
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    assert!(ok.load(Ordering::Relaxed) > 0);
    // `flotilla status` prints the planner.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["status", "--gateway", &c.gateway])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("planner on node-0 (advisory"), "{text}");
}

#[test]
fn the_planner_role_on_the_cpu_engine_needs_capacity_curves() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["up", "--nodes", "2", "--http", "127.0.0.1:0", "--planner"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("planner.capacity_profile"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_at_zero_serves_the_next_request_after_a_cold_start() {
    let mut sets = SETS.to_vec();
    sets.extend([
        "planner.mode=act",
        "planner.aggregated.min=0",
        "planner.idle_to_zero_s=2",
    ]);
    let c = Cluster::start_with(2, &["--engine", "sim", "--planner"], &sets);
    // Idle: the pool goes to zero (its worker node drains and stops). Wait until no up node
    // lists a worker at all (the gateway's admission then waits for a cold start): a worker
    // that is draining is no longer "ready", but until its node's stop reaches the view the
    // gateway still counts it, and a request sent in that instant finds no worker to place on.
    poll_until(Duration::from_secs(60), "the pool at zero", || async {
        let f = crate::http::fleet(&c).await;
        let listed = f["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| n["state"] == "up")
            .flat_map(|n| n["workers"].as_array().cloned().unwrap_or_default())
            .count();
        (ready_workers(&c).await == 0 && listed == 0).then_some(())
    })
    .await;
    let d = latest_decision(&c).await.unwrap();
    assert_eq!(d["pools"][0]["desired"], 0, "{d}");
    // The model stays listed.
    let models = reqwest::get(c.url("/v1/models")).await.unwrap();
    assert_eq!(models.status(), 200);
    let models = models.text().await.unwrap();
    assert!(models.contains(MODEL), "{models}");
    // A request at zero waits while the planner wakes a replica, and is served.
    let t0 = std::time::Instant::now();
    let body = json!({"model": MODEL, "prompt": "hello there", "max_tokens": 4});
    let (s, _, text) = crate::http::post(&c.url("/v1/completions"), &body).await;
    assert_eq!(s, 200, "{text}");
    let waited = t0.elapsed();
    assert!(
        waited > Duration::from_millis(200),
        "served at once? {waited:?}"
    );
    assert_eq!(ready_workers(&c).await, 1);
    let cold = crate::http::metric_sum(&c, "flotilla_cold_start_wait_seconds_count").await;
    assert_eq!(cold, 1, "one request waited for a cold start");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_reports_the_fleets_cost_per_million_tokens_within_the_slos() {
    let c = Cluster::start_with(2, &["--engine", "sim"], &[]);
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["bench", "--gateway", c.gateway()])
        .args([
            "--dataset",
            "synthetic-sessions",
            "--sessions",
            "2",
            "--turns",
            "2",
        ])
        .args(["--dollars-per-replica-hour", "3.6"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.contains("] fleet: "))
        .unwrap_or_else(|| panic!("no fleet line: {stdout}"));
    // One worker node (one replica) held for the whole run: replica-s ≈ the run's wall time.
    let rs: f64 = line
        .split("fleet: ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(rs > 0.0, "{line}");
    assert!(line.contains("at $3.6/replica-hour"), "{line}");
    assert!(line.contains("cost per million of them: $"), "{line}");
}

/// Planner nodes that `/v1/fleet` at `base` shows leading, among nodes it sees up:
/// (node, term).
async fn leaders(base: &str) -> Vec<(String, u64)> {
    let Ok(r) = reqwest::get(format!("{base}/v1/fleet")).await else {
        return Vec::new();
    };
    let Ok(f) = r.json::<Value>().await else {
        return Vec::new();
    };
    f["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["state"] == "up" && n["planner"]["leadership"]["state"] == "leader")
        .map(|n| {
            (
                n["id"].as_str().unwrap_or_default().to_owned(),
                n["planner"]["leadership"]["term"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// Three planner nodes (`--gateways 3 --planner`: each gateway node also plans): exactly one
/// leads, through a lease a majority of the control nodes grant. Killing the leader, a
/// standby leads in a higher term within the liveness timeout (3 s; the bound here allows for
/// a busy machine); cutting the new leader off from the others (chaos partition), one on the
/// majority side leads in a higher term still, and once the cut heals the cut-off one is a
/// standby: one leader again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_three_planners_leads_and_a_standby_takes_over() {
    let mut sets = SETS.to_vec();
    sets.push("planner.mode=advisory");
    let c = Cluster::start_with(
        2,
        &["--engine", "sim", "--planner", "--gateways", "3", "--chaos"],
        &sets,
    );
    let f = fleet(&c).await;
    let gateways: Vec<(String, String)> = f["gateways"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["node"].as_str().unwrap().to_owned(),
                g["url"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(gateways.len(), 3, "{gateways:?}");
    let other_than = |node: &str| {
        gateways
            .iter()
            .find(|(n, _)| n != node)
            .map(|(_, u)| u.clone())
            .unwrap()
    };
    let (first, term1) = poll_until(Duration::from_secs(30), "one planner leads", || async {
        let l = leaders(&c.gateway).await;
        (l.len() == 1).then(|| l[0].clone())
    })
    .await;
    let chaos = |base: String, body: Value| async move {
        let r = reqwest::Client::new()
            .post(format!("{base}/chaos/faults"))
            .json(&body)
            .send()
            .await
            .expect("chaos");
        assert_eq!(r.status(), 201, "{:?}", r.text().await);
    };

    // The leader dies: a standby takes over in a higher term.
    let via = other_than(&first);
    chaos(
        via.clone(),
        json!({"kind": "kill_node", "target": {"node": first}}),
    )
    .await;
    let killed = std::time::Instant::now();
    let (second, term2) = poll_until(Duration::from_secs(20), "a standby leads", || async {
        let l = leaders(&via).await;
        l.into_iter().find(|(n, t)| *n != first && *t > term1)
    })
    .await;
    let took = killed.elapsed();
    eprintln!(
        "planner take-over after the leader's kill: {} ms (term {term1} → {term2})",
        took.as_millis()
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");

    // The new leader is cut off from every other node: it stops leading, and a planner on
    // the majority side leads in a higher term.
    let via = gateways
        .iter()
        .find(|(n, _)| *n != second && *n != first)
        .map(|(_, u)| u.clone())
        .unwrap();
    chaos(
        via.clone(),
        json!({"kind": "partition", "nodes": [second], "target": "any_busy", "duration_ms": 8000}),
    )
    .await;
    let (third, term3) = poll_until(
        Duration::from_secs(20),
        "the majority side leads",
        || async {
            let l = leaders(&via).await;
            l.into_iter().find(|(n, t)| *n != second && *t > term2)
        },
    )
    .await;
    eprintln!("after the partition: {third} leads in term {term3}");
    // Healed: one leader, and the cut-off one stands by.
    poll_until(
        Duration::from_secs(40),
        "one leader after the cut heals",
        || async {
            let l = leaders(&via).await;
            let f: Value = reqwest::get(format!("{via}/v1/fleet"))
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            let cut_off_stands_by = f["nodes"].as_array()?.iter().any(|n| {
                n["id"] == second.as_str()
                    && n["state"] == "up"
                    && n["planner"]["leadership"]["state"] == "standby"
            });
            (l.len() == 1 && cut_off_stands_by).then_some(())
        },
    )
    .await;
}
