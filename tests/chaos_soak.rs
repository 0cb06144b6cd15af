//! Chaos soak: steady load through `flotilla up` while the chaos API kills a busy
//! worker every few seconds, alternating actor kills and node-process kills. Every request
//! must return 200 and equal its no-fault reference byte for byte; migrations must happen;
//! the fleet must return to full capacity after every fault. Scaled down for CI; users run
//! `flotilla chaos soak` bigger (see docs/benchmarks.md).

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::process::Cluster;
use flotilla::cli::soak::{SoakOptions, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_loses_nothing_while_workers_are_killed() {
    let c = Cluster::start_with(
        3,
        &["--chaos", "--max-restarts", "100"],
        &["worker.kv_blocks=256"],
    );
    // Sized as the contended soak below says (4 in flight: each fault's re-prefill fits
    // between faults on a busy 2-core machine).
    let opts = SoakOptions {
        requests: 48,
        concurrency: 4,
        max_tokens: 24,
        interval_ms: 1500,
        recover_timeout_ms: 60_000,
    };
    soak_and_check(&c, &opts).await;
}

/// The soak on a disaggregated cluster (one prefill, two decode worker nodes; every prompt is
/// prefilled remotely) with a quarter of the KV transfers dropped throughout: prefill and
/// decode workers are killed, hand-offs fail and are recomputed, and still every request
/// returns its reference bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_loses_nothing_disaggregated_with_transfer_faults() {
    let c = Cluster::start_with(
        4,
        &[
            "--chaos",
            "--max-restarts",
            "100",
            "--prefill",
            "1",
            "--decode",
            "2",
        ],
        &["worker.kv_blocks=256", "disagg.min_prefill_tokens=8"],
    );
    crate::http::wait_routable(&c, 3).await;
    for node in ["node-2", "node-3"] {
        let r = reqwest::Client::new()
            .post(c.url("/chaos/faults"))
            .json(
                &serde_json::json!({"kind": "drop_kv_transfer", "rate": 0.25, "seed": 5,
                "target": {"node": node}}),
            )
            .send()
            .await
            .expect("chaos");
        assert_eq!(r.status(), 201, "{:?}", r.text().await);
    }
    let opts = SoakOptions {
        requests: 32,
        concurrency: 4,
        max_tokens: 24,
        interval_ms: 1500,
        recover_timeout_ms: 60_000,
    };
    soak_and_check(&c, &opts).await;
    let f = crate::http::fleet(&c).await;
    let workers: Vec<serde_json::Value> = f["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|n| n["workers"].as_array().unwrap().clone())
        .collect();
    eprintln!(
        "pulled blocks / fallbacks per worker: {:?}",
        workers
            .iter()
            .map(|w| (
                &w["id"],
                &w["role"],
                &w["kv_blocks_pulled"],
                &w["kv_pull_fallbacks"]
            ))
            .collect::<Vec<_>>()
    );
}

/// Run the soak; nothing lost or changed, both kinds of kill, migrations, back to capacity
/// after every fault.
async fn soak_and_check(c: &Cluster, opts: &SoakOptions) {
    let report = run(&c.gateway, None, opts)
        .await
        .unwrap_or_else(|e| panic!("the soak could not run: {e:#}"));
    eprintln!("{}", report.markdown());
    assert!(report.problems.is_empty(), "{:#?}", report.problems);
    assert_eq!(report.lost, 0);
    assert_eq!(report.mismatched, 0);
    assert!(report.faults.len() >= 2, "{:?}", report.faults);
    assert!(
        report.faults.iter().any(|f| f.kind == "kill_node")
            && report.faults.iter().any(|f| f.kind == "kill_actor"),
        "both kinds of kill: {:?}",
        report.faults
    );
    assert!(report.migrations > 0, "migrations happened");
    assert!(report.passed(), "back to full capacity after every fault");
}

/// Busy-loop threads beside the cluster (a CPU hog, like `stress-ng --cpu N`), until dropped.
struct CpuHog {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuHog {
    fn start(threads: usize) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for _ in 0..100_000 {
                            x = std::hint::black_box(
                                x.wrapping_mul(6364136223846793005).wrapping_add(1),
                            );
                        }
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The same under CPU contention: two busy-loop threads beside the cluster on a 2-core
/// machine (plus whatever else the suite runs), a fault every 1.5 s. Restarted workers become
/// ready slowly here, so faults arrive while requests are still migrating: a request that keeps
/// making progress must never be given up, and one that finds no worker waits for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_loses_nothing_under_cpu_contention() {
    // A node kill every ~3 s on the busiest node outruns `up`'s default restart budget
    // (10 a minute): this soak kills on purpose, so it allows more.
    // Under the hog a step can take seconds; a request stalled for the default 30 s would be
    // given up although the fleet is only slow. 120 s still fails a real livelock.
    let c = Cluster::start_with(
        3,
        &["--chaos", "--max-restarts", "100"],
        &[
            "worker.kv_blocks=256",
            "gateway.migration_deadline_ms=120000",
        ],
    );
    let _hog = CpuHog::start(2);
    // Sized so that the fleet can make progress between faults: every kill makes the killed
    // worker's requests re-prefill prompt + tokens elsewhere (migration by recompute), and on
    // this machine 8 such 80-token contexts take longer than 1.5 s — then no request gets a
    // token between faults and, after 30 s of that, requests are rightly given up (see
    // docs/benchmarks.md).
    let opts = SoakOptions {
        requests: 24,
        concurrency: 4,
        max_tokens: 24,
        interval_ms: 1500,
        recover_timeout_ms: 90_000,
    };
    soak_and_check(&c, &opts).await;
}

/// The soak as a user runs it (`flotilla up --nodes 3 --chaos` with nothing changed, then
/// `flotilla chaos soak --requests 64 --concurrency 16 --max-tokens 64 --interval-ms 1500`),
/// with two busy-loop threads beside the cluster on a 2-core machine (plus whatever else the
/// suite runs): a fault every 1.5 s after the fleet is back at capacity, 16 streams in flight
/// of up to 64 tokens, the default migration deadline (30 s without a new token) and the
/// default restart budget (chaos kills are not counted against it). Every kill makes its
/// worker's requests re-prefill prompt + tokens elsewhere; a request that keeps making
/// progress must never be given up, and the order recomputes are served in must not starve
/// any (the oldest waits are served first). The resume gap is printed (docs/benchmarks.md,
/// "Recovery under contention"); a regression there shows first as lost requests here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_soak_a_user_runs_loses_nothing() {
    let c = Cluster::start_with(3, &["--chaos"], &[]);
    let _hog = CpuHog::start(2);
    let opts = SoakOptions {
        requests: 64,
        concurrency: 16,
        max_tokens: 64,
        interval_ms: 1500,
        recover_timeout_ms: 90_000,
    };
    soak_and_check(&c, &opts).await;
}
