//! Chaos soak (issue 5): steady load through `flotilla up` while the chaos API kills a busy
//! worker every few seconds, alternating actor kills and node-process kills. Every request
//! must return 200 and equal its no-fault reference byte for byte; migrations must happen;
//! the fleet must return to full capacity after every fault. Scaled down for CI; users run
//! `flotilla chaos soak` bigger (see docs/benchmarks.md).

mod common;

use common::Cluster;
use flotilla::soak::{SoakOptions, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_loses_nothing_while_workers_are_killed() {
    let c = Cluster::start_with(3, &["--chaos"], &["worker.kv_blocks=256"]);
    let opts = SoakOptions {
        requests: 64,
        concurrency: 8,
        max_tokens: 40,
        interval_ms: 1500,
        recover_timeout_ms: 60_000,
    };
    let report = run(&c.gateway, None, &opts)
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
