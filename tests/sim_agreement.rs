//! The simulator against a live fleet, kept short for CI: the same
//! workload through `flotilla up --engine sim` (3 node processes, 4 replicas, actors and
//! loopback TCP) with `flotilla bench`, and through `flotilla sim` with the same fleet,
//! profile and prompts. The full comparison, with its figures, is `scripts/sim-fidelity.sh`
//! (`docs/benchmarks.md`: 2–3 % median error); here the bounds are wide enough to hold on a
//! busy 2-core machine running other tests, and narrow enough to catch a simulator that
//! prices steps, routes or caches differently from the fleet it claims to model.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::ready_workers;
use crate::poll::poll_until;
use crate::process::Cluster;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
/// The first 80 requests of the Mooncake conversation trace, 4× faster (about 6 s), the
/// prompts of salt 1.
const WORKLOAD: &[&str] = &[
    "--dataset",
    "mooncake-conversation",
    "--max-requests",
    "80",
    "--speedup",
    "4",
    "--salt",
    "1",
];

fn report(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("report.json")).expect("report.json");
    let v: Value = serde_json::from_str(&text).expect("report.json parses");
    v[0].clone()
}

fn run(args: &[&str]) -> String {
    let out = std::process::Command::new(BIN)
        .args(args)
        .output()
        .expect("flotilla runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "flotilla {args:?}: {text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_agrees_with_a_live_sim_fleet() {
    let dir = tempfile::tempdir().unwrap();
    let (live_dir, sim_dir) = (dir.path().join("live"), dir.path().join("sim"));
    {
        let c = Cluster::start_with(3, &["--engine", "sim", "--workers", "4"], &[]);
        poll_until(Duration::from_secs(60), "4 ready workers", || async {
            (ready_workers(&c).await == 4).then_some(())
        })
        .await;
        let mut args = vec!["bench", "--gateway", &c.gateway];
        args.extend_from_slice(WORKLOAD);
        args.extend_from_slice(&["--out", live_dir.to_str().unwrap()]);
        tokio::task::block_in_place(|| run(&args));
    }
    let mut args = vec!["sim", "--workers", "4"];
    args.extend_from_slice(WORKLOAD);
    args.extend_from_slice(&["--out", sim_dir.to_str().unwrap()]);
    run(&args);

    let (live, sim) = (report(&live_dir), report(&sim_dir));
    let both = format!("live {live}\nsim {sim}");
    for r in [&live, &sim] {
        assert_eq!(r["requests"], 80, "{both}");
        assert_eq!(r["errors"], 0, "{both}");
    }
    let num = |r: &Value, path: &[&str]| {
        path.iter()
            .fold(r, |v, k| &v[*k])
            .as_f64()
            .unwrap_or_else(|| panic!("{path:?}: {both}"))
    };
    // Where requests go and what they find cached does not depend on timing much: the same
    // router and pools on the same prompts.
    let (lh, sh) = (
        num(&live, &["prefix_hit_rate"]),
        num(&sim, &["prefix_hit_rate"]),
    );
    assert!(
        (lh - sh).abs() <= 0.05,
        "prefix hit rate {lh} vs {sh}\n{both}"
    );
    // Latencies: the same step model, live on a busy host; within ±50 % at the medians
    // (a simulator that prices steps differently misses by multiples).
    for path in [["ttft_ms", "p50"], ["itl_ms", "p50"], ["e2e_ms", "p50"]] {
        let (l, s) = (num(&live, &path), num(&sim, &path));
        assert!(
            s > 0.5 * l && s < 1.5 * l,
            "{path:?}: live {l} ms, sim {s} ms\n{both}"
        );
    }
    let (lg, sg) = (num(&live, &["goodput_rps"]), num(&sim, &["goodput_rps"]));
    assert!(
        (sg / lg - 1.0).abs() <= 0.15,
        "goodput {lg} vs {sg}\n{both}"
    );
}
