use super::*;
use crate::runtime::ids::{BlockId, RequestId};
use crate::runtime::role::Role;
use crate::worker::scheduler::{DisaggWorker, SimTransfer};

/// A decode replica on a simulated engine: pulls are modelled (40 ms each, whatever their
/// size), with a 10 s transfer limit and the default 2 s hold margin.
fn cfg() -> WorkerCoreConfig {
    WorkerCoreConfig {
        worker: WorkerId::new("d/replica-0"),
        eos_token_id: None,
        block_size: 4,
        role: Role::Decode,
        disagg: DisaggWorker::new(30_000, 10_000),
        step_timeout: Duration::from_secs(2),
        canary_interval: Duration::from_secs(10),
        owner_grace: Duration::from_secs(3),
        has_transport: false,
        sim_transfer: Some(SimTransfer {
            bytes_per_token: 0,
            gbps: 1.0,
            latency: Duration::from_millis(40),
            speedup: 1.0,
        }),
        peer_pull: None,
    }
}

/// The prefill worker's hand-off: `blocks` blocks, held until `held_until_ms`.
fn kv(blocks: u32, held_until_ms: u64) -> RemoteKv {
    RemoteKv {
        worker: WorkerId::new("p/replica-0"),
        request: RequestId(7),
        region: None,
        blocks: (100..100 + blocks).collect(),
        tokens: blocks * 4,
        held_until_ms,
    }
}

/// An order to fill the sequence's blocks `from..to` into local blocks 0, 1, ….
fn order(from: usize, to: usize) -> PullOrder {
    PullOrder {
        seq: SeqId(1),
        cached_tokens: from * 4,
        tokens: to * 4,
        blocks: (from..to)
            .map(|i| (i, BlockId((i - from) as u32)))
            .collect(),
    }
}

#[test]
fn a_pull_ends_by_the_earlier_of_its_limit_and_the_holders_hold_less_the_margin() {
    let (now, wall) = (Instant::now(), 1_000_000);
    let mut p = Pulls::default();
    let gw = NodeId::new("gw");
    // A hold far ahead: the transfer limit bounds it.
    let job = p.start(
        &cfg(),
        &order(1, 3),
        Some(kv(3, wall + 60_000)),
        &gw,
        false,
        now,
        wall,
    );
    assert_eq!(job.from, Some(WorkerId::new("p/replica-0")));
    assert_eq!(job.blocks, 2);
    assert_eq!(
        job.work,
        PullWork::Sim {
            time: Duration::from_millis(40),
            budget: Duration::from_secs(10)
        }
    );
    // A hold ending in 2.5 s: 0.5 s are left after the margin.
    let job = p.start(
        &cfg(),
        &order(0, 3),
        Some(kv(3, wall + 2_500)),
        &gw,
        false,
        now,
        wall,
    );
    assert_eq!(
        job.work,
        PullWork::Sim {
            time: Duration::from_millis(40),
            budget: Duration::from_millis(500)
        }
    );
    // A pull longer than its budget ends at the budget, failed; one within it lands.
    let slow = PullWork::Sim {
        time: Duration::from_millis(900),
        budget: Duration::from_millis(500),
    };
    let (at, outcome) = slow.simulated(2).expect("simulated");
    assert_eq!(at, Duration::from_millis(500));
    assert!(outcome.is_err());
    assert_eq!(
        job.work.simulated(3),
        Some((Duration::from_millis(40), Ok(3)))
    );
}

#[test]
fn a_pull_that_cannot_run_fails_at_once_and_still_confirms_to_its_holder() {
    let (now, wall) = (Instant::now(), 1_000_000);
    let gw = NodeId::new("gw");
    let fails = |job: &PullJob| matches!(job.work, PullWork::Fail(_));
    let mut p = Pulls::default();
    // Nothing to pull from: failed, and nobody to confirm to.
    let job = p.start(&cfg(), &order(0, 2), None, &gw, false, now, wall);
    assert!(fails(&job) && job.from.is_none());
    let r = PullResult {
        seq: SeqId(1),
        outcome: Err("no remote KV".into()),
        bytes: 0,
    };
    assert_eq!(p.returned(&cfg().worker, &r, now), None);
    assert_eq!(p.fallbacks, 1);
    // The hand-off names fewer blocks than needed; the hold ends within the margin; no way
    // to move bytes: each fails at once, and its return confirms to the holder under the
    // gateway's key.
    let mut no_sim = cfg();
    no_sim.sim_transfer = None;
    for (c, o, k) in [
        (cfg(), order(0, 3), kv(2, wall + 60_000)),
        (cfg(), order(0, 2), kv(2, wall + 1_500)),
        (no_sim, order(0, 2), kv(2, wall + 60_000)),
    ] {
        let job = p.start(&c, &o, Some(k), &gw, false, now, wall);
        assert!(fails(&job), "{job:?}");
        let f = p
            .returned(&c.worker, &r, now)
            .expect("kept until it returns");
        assert_eq!(
            f.confirm,
            (WorkerId::new("p/replica-0"), (gw.clone(), RequestId(7)))
        );
    }
    assert_eq!(p.fallbacks, 4);
    assert_eq!(p.block_ms(), None, "a failed pull measures nothing");
}

#[test]
fn returned_pulls_are_measured_and_only_disaggregated_ones_counted_here() {
    let (t0, wall) = (Instant::now(), 1_000_000);
    let gw = NodeId::new("gw");
    let w = cfg().worker;
    let mut p = Pulls::default();
    let ok = |blocks, bytes| PullResult {
        seq: SeqId(1),
        outcome: Ok(blocks),
        bytes,
    };
    // 4 blocks in 40 ms: 10 ms per block.
    p.start(
        &cfg(),
        &order(0, 4),
        Some(kv(4, wall + 60_000)),
        &gw,
        false,
        t0,
        wall,
    );
    let f = p.returned(&w, &ok(4, 4096), t0 + Duration::from_millis(40));
    assert!(f.is_some_and(|f| !f.peer));
    assert_eq!(p.block_ms(), Some(10.0));
    assert_eq!((p.blocks_pulled, p.bytes), (4, 4096));
    // A peer pull of 2 blocks in 60 ms (30 per block): the moving average moves a fifth
    // of the way; its blocks are the peer counters' (the caller's), not these.
    p.start(
        &cfg(),
        &order(0, 2),
        Some(kv(2, wall + 60_000)),
        &gw,
        true,
        t0,
        wall,
    );
    let f = p.returned(&w, &ok(2, 2048), t0 + Duration::from_millis(60));
    assert!(f.is_some_and(|f| f.peer));
    assert_eq!(p.block_ms(), Some(0.8 * 10.0 + 0.2 * 30.0));
    assert_eq!((p.blocks_pulled, p.bytes, p.fallbacks), (4, 6144, 0));
    // A result for a pull never started (or already returned) is only measured in bytes.
    assert_eq!(p.returned(&w, &ok(1, 1), t0), None);
    assert_eq!((p.blocks_pulled, p.bytes), (5, 6145));
}
