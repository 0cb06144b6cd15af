use std::time::Duration;

use super::*;
use crate::sim::SimConfig;
use crate::worker::engine::sim::SimProfile;

/// Sessions of token-id turns, given in full.
struct Fixed(Vec<Vec<SimTurn>>);

impl SimWorkload for Fixed {
    fn sessions(&self) -> usize {
        self.0.len()
    }
    fn turns(&self, i: usize) -> usize {
        self.0[i].len()
    }
    fn turn(&self, i: usize, k: usize) -> SimTurn {
        self.0[i][k].clone()
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 100 + (seed * 7_919 + i * 31) % 40_000)
        .collect()
}

fn spec(workers: usize) -> SimSpec {
    SimSpec {
        config: SimConfig::default(),
        workers,
        prefill: 0,
        decode: 0,
        profile: SimProfile::h100_vllm(),
        model: ModelFacts {
            vocab_size: 49_152,
            max_context: 8_192,
            salt: 7,
            eos_token_id: None,
        },
        kv_event_delay: Duration::from_millis(1),
        net_delay: Duration::from_micros(200),
        routers: 1,
        planner: None,
        restart_delay: Some(Duration::from_secs(2)),
    }
}

/// 24 sessions of 3 turns (each turn's prompt extends the last), sharing a system prefix.
fn sessions() -> Fixed {
    let system = prompt(0, 256);
    Fixed(
        (0..24)
            .map(|s| {
                let mut history = system.clone();
                (0..3)
                    .map(|t| {
                        history.extend(prompt(1 + s * 10 + t, 64 + 16 * t as usize));
                        SimTurn {
                            prompt: history.clone(),
                            max_tokens: 24,
                        }
                    })
                    .collect()
            })
            .collect(),
    )
}

fn offsets(n: usize, gap_s: f64) -> Arrivals {
    Arrivals::Open((0..n).map(|i| i as f64 * gap_s).collect())
}

fn run(spec: SimSpec, w: &dyn SimWorkload, arrivals: Arrivals, faults: &[SimFault]) -> SimOutcome {
    SimFleet::new(spec, w, arrivals, faults).unwrap().run()
}

/// The workers the requests were placed on, in the order of the placements.
fn placements(out: &SimOutcome) -> Vec<String> {
    out.fleet_events
        .iter()
        .filter_map(|(_, e)| match e {
            crate::request_plane::events::FleetEventKind::Placed { worker, .. } => {
                Some(worker.to_string())
            }
            _ => None,
        })
        .collect()
}

/// The index of a simulated worker from its id (`sim-<index>/replica-0`).
fn worker_index(id: &str) -> usize {
    id.strip_prefix("sim-")
        .and_then(|r| r.split('/').next())
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("not a sim worker id: {id}"))
}

fn assert_conserved(out: &SimOutcome, requests: usize) {
    assert_eq!(out.records.len(), requests, "one record per request");
    let mut keys: Vec<(usize, usize)> = out.records.iter().map(|r| (r.session, r.turn)).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), requests, "each request ended exactly once");
    assert_eq!(out.leftovers, SimLeftovers::default(), "nothing left over");
    assert_eq!(
        out.counters.index_mismatches, 0,
        "the router's index holds what the pools hold"
    );
}

#[test]
fn two_runs_give_the_same_records_and_events() {
    let w = sessions();
    let a = run(spec(4), &w, offsets(24, 0.05), &[]);
    let b = run(spec(4), &w, offsets(24, 0.05), &[]);
    assert_eq!(a.records, b.records);
    assert_eq!(a.counters, b.counters);
    assert_eq!(
        format!("{:?}", a.fleet_events),
        format!("{:?}", b.fleet_events)
    );
    assert_conserved(&a, 72);
    assert!(a.records.iter().all(|r| r.ok), "{:?}", a.records[0]);
}

/// One request on one idle worker, checked by hand against the H100 profile: its first token
/// comes after one prefill step of the whole prompt plus the hop to the gateway; each later
/// token one decode step later.
#[test]
fn a_tiny_fleet_event_by_event() {
    let w = Fixed(vec![vec![SimTurn {
        prompt: prompt(1, 32),
        max_tokens: 4,
    }]]);
    let s = spec(1);
    let p = s.profile.clone();
    let out = run(s, &w, offsets(1, 0.0), &[]);
    assert_conserved(&out, 1);
    let r = &out.records[0];
    assert!(r.ok, "{r:?}");
    assert_eq!(r.output_tokens, 4);
    assert_eq!(r.cached_tokens, Some(0));
    let ttft = r.ttft_ms.unwrap();
    let expect = p.prefill_ms(32) + 0.2;
    assert!((ttft - expect).abs() < 1e-3, "TTFT {ttft} vs {expect}");
    assert_eq!(r.itl_ms.len(), 3);
    for gap in &r.itl_ms {
        // KV use of one short sequence in a 28 672-block pool: u ≈ 0.
        let d = p.decode_ms(0.0, 1);
        assert!((gap - d).abs() < 0.01, "ITL {gap} vs {d}");
    }
    let e2e = ttft + r.itl_ms.iter().sum::<f64>();
    assert!((r.e2e_ms - e2e).abs() < 1e-3, "{} vs {e2e}", r.e2e_ms);
    assert_eq!(out.counters.placements, 1);
    assert_eq!(
        out.counters.steps, 4,
        "one prefill step, three decode steps"
    );
}

#[test]
fn a_shared_prefix_is_found_where_it_was_computed() {
    let base = prompt(3, 128);
    let mut longer = base.clone();
    longer.extend(prompt(4, 32));
    let w = Fixed(vec![
        vec![SimTurn {
            prompt: base,
            max_tokens: 2,
        }],
        vec![SimTurn {
            prompt: longer,
            max_tokens: 2,
        }],
    ]);
    let out = run(spec(8), &w, offsets(2, 1.0), &[]);
    assert_conserved(&out, 2);
    let placed = placements(&out);
    assert_eq!(placed.len(), 2);
    assert_eq!(
        placed[0], placed[1],
        "the second request went to the prefix holder"
    );
    assert_eq!(out.records[1].cached_tokens, Some(128));
}

#[test]
fn a_killed_worker_loses_no_request() {
    let w = sessions();
    let out = run(
        spec(3),
        &w,
        offsets(24, 0.02),
        &[SimFault::Kill {
            at: Duration::from_millis(150),
            worker: 0,
        }],
    );
    assert_conserved(&out, 72);
    assert!(out.records.iter().all(|r| r.ok), "every request finished");
    assert_eq!((out.counters.kills, out.counters.restarts), (1, 1));
    assert!(out.counters.migrations >= 1, "{:?}", out.counters);
    // Every request gave all its tokens, migrated or not.
    assert!(out.records.iter().all(|r| r.output_tokens == 24));
}

#[test]
fn a_prompt_no_worker_can_hold_fails_and_the_run_ends() {
    let mut s = spec(2);
    s.config.worker.kv_blocks = Some(4);
    let w = Fixed(vec![
        vec![SimTurn {
            prompt: prompt(5, 200),
            max_tokens: 4,
        }],
        vec![SimTurn {
            prompt: prompt(6, 16),
            max_tokens: 4,
        }],
    ]);
    let out = run(s, &w, offsets(2, 0.0), &[]);
    assert_conserved(&out, 2);
    let big = out.records.iter().find(|r| r.session == 0).unwrap();
    assert!(!big.ok);
    assert!(
        big.error.as_deref().unwrap_or("").starts_with("status 400"),
        "{big:?}"
    );
    assert!(out.records.iter().find(|r| r.session == 1).unwrap().ok);
}

#[test]
fn disaggregated_prefill_hands_off_to_decode() {
    let mut s = spec(0);
    s.prefill = 1;
    s.decode = 2;
    let w = Fixed(
        (0..6)
            .map(|i| {
                vec![SimTurn {
                    prompt: prompt(10 + i, 1_024),
                    max_tokens: 8,
                }]
            })
            .collect(),
    );
    let out = run(s, &w, offsets(6, 0.1), &[]);
    assert_conserved(&out, 6);
    assert!(out.records.iter().all(|r| r.ok), "{:?}", out.records);
    assert_eq!(out.counters.hand_offs, 6, "{:?}", out.counters);
}

#[test]
fn idle_workers_cost_nothing() {
    let w = Fixed(vec![vec![SimTurn {
        prompt: prompt(1, 64),
        max_tokens: 8,
    }]]);
    let small = run(spec(2), &w, offsets(1, 0.0), &[]);
    let large = run(spec(2_000), &w, offsets(1, 0.0), &[]);
    assert_eq!(small.counters.events, large.counters.events);
    assert_eq!(small.counters.steps, large.counters.steps);
}

/// The simulator decides nothing itself: it drives the live fleet's cores, built from the
/// live configuration's own methods. A decision path copied into the simulator (a policy, an
/// admission rule, a batch former, a step-time model) fails here.
#[test]
fn the_simulator_shares_the_live_decision_code() {
    // The simulated fleet is world.rs and its files under world/, all read.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/sim");
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(format!("{dir}/world"))
        .expect("src/sim/world/")
        .map(|e| e.expect("a file of src/sim/world/").path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    files.insert(0, format!("{dir}/world.rs").into());
    let src: String = files
        .iter()
        .map(|p| std::fs::read_to_string(p).expect("a file of the simulated fleet"))
        .collect();
    for shared in [
        "RouterCore::new(",
        ".place(route)",
        "RequestCore::new(",
        "WorkerCore::new(",
        "SchedulerCore::new(",
        "BlockPool::new(",
        "sim::model_step(",
        "self.admission.decide_for(",
        "c.selector_config()",
        "c.admission()",
        "c.scheduler_config(",
        "c.sim_transfer()",
        "config.migration_policy()",
        "waits_for_capacity(",
    ] {
        assert!(
            src.contains(shared),
            "the simulator no longer calls {shared}"
        );
    }
    for own in [
        "fn select",
        "fn cost",
        "fn score",
        "fn decide",
        "fn admit",
        "fn schedule_batch",
        "fn form_batch",
        "fn step_ms",
        "fn migrate",
        "fn has_worker",
        "fn planner_may_act",
        "impl Selector",
        "impl Policy",
    ] {
        assert!(!src.contains(own), "the simulator defines its own `{own}`");
    }
    assert!(
        include_str!("../actors/gateway/serve/intake.rs").contains("waits_for_capacity("),
        "the live gateway no longer asks waits_for_capacity"
    );
    let live = include_str!("../node/tree_args.rs");
    for shared in [
        "config.admission()",
        "config.migration_policy()",
        "config.scheduler_config(",
        "config.sim_transfer()",
    ] {
        assert!(
            live.contains(shared),
            "the live tree no longer calls {shared}"
        );
    }
}

/// A modelled KV transfer longer than `disagg.transfer_timeout_ms` fails at the limit, as a
/// real pull times out, and the decode worker computes the prompt itself: the run ends.
#[test]
fn a_transfer_past_its_time_limit_falls_back_to_recompute() {
    let mut s = spec(0);
    s.prefill = 1;
    s.decode = 1;
    s.config.worker.sim_transfer_gbps = 1e-6;
    let w = Fixed(vec![vec![SimTurn {
        prompt: prompt(20, 1_024),
        max_tokens: 4,
    }]]);
    let out = run(s, &w, offsets(1, 0.0), &[]);
    assert_conserved(&out, 1);
    let r = &out.records[0];
    assert!(r.ok, "{r:?}");
    assert_eq!(out.counters.hand_offs, 1);
    // The second token waited for the limit (10 s by default), then for the recompute.
    let gap = r.itl_ms[0];
    assert!((10_000.0..11_000.0).contains(&gap), "{gap} ms");
}

/// A hung engine: its step waits; the replica's own watchdog takes it down after
/// `worker.step_timeout_ms` (the live rule, on the simulated clock), its requests migrate and
/// finish elsewhere, and it restarts.
#[test]
fn a_hung_engine_is_found_by_its_watchdog_and_nothing_is_lost() {
    let mut s = spec(3);
    s.config.worker.step_timeout_ms = 2_000;
    let w = sessions();
    // The worker the first request goes to (the same in every run).
    let calm = run(s.clone(), &w, offsets(24, 0.02), &[]);
    let busy = worker_index(&placements(&calm)[0]);
    let out = run(
        s,
        &w,
        offsets(24, 0.02),
        &[SimFault::Hang {
            from: Duration::from_millis(100),
            until: Duration::from_secs(4),
            worker: busy,
        }],
    );
    assert_conserved(&out, 72);
    assert!(out.records.iter().all(|r| r.ok), "every request finished");
    assert!(
        out.counters.kills >= 1,
        "the watchdog fired: {:?}",
        out.counters
    );
    assert!(out.counters.migrations >= 1, "{:?}", out.counters);
    assert!(out.records.iter().all(|r| r.output_tokens == 24));
    // Those caught by the hang waited for the watchdog (2 s), never for the whole hang.
    let worst = out
        .records
        .iter()
        .flat_map(|r| r.itl_ms.iter().copied().chain(r.ttft_ms))
        .fold(0.0, f64::max);
    assert!((2_000.0..3_900.0).contains(&worst), "{worst} ms");
}

#[test]
fn a_slow_engine_slows_its_own_streams() {
    let w = Fixed(vec![vec![SimTurn {
        prompt: prompt(30, 64),
        max_tokens: 6,
    }]]);
    let slow = SimFault::Slow {
        from: Duration::ZERO,
        until: Duration::from_secs(60),
        worker: 0,
        delay: Duration::from_millis(50),
    };
    let fast = run(spec(1), &w, offsets(1, 0.0), &[]);
    let slowed = run(spec(1), &w, offsets(1, 0.0), &[slow]);
    assert_conserved(&slowed, 1);
    let gap = |o: &SimOutcome| o.records[0].itl_ms[0];
    assert!(
        (gap(&slowed) - gap(&fast) - 50.0).abs() < 1e-6,
        "{} vs {}",
        gap(&slowed),
        gap(&fast)
    );
}

/// Single-turn requests of 1,024-token prompts: 5/s for 10 s, 40/s for 10 s, 5/s for 20 s.
fn load_step() -> (Fixed, Arrivals) {
    let mut offsets = Vec::new();
    let mut t = 0.0;
    for (rate, secs) in [(5.0, 10.0), (40.0, 10.0), (5.0, 20.0)] {
        let end = t + secs;
        while t < end - 1e-9 {
            offsets.push(t);
            t += 1.0 / rate;
        }
        t = end;
    }
    let w = Fixed(
        (0..offsets.len())
            .map(|i| {
                vec![SimTurn {
                    prompt: prompt(1000 + i as u32, 1024),
                    max_tokens: 32,
                }]
            })
            .collect(),
    );
    (w, Arrivals::Open(offsets))
}

fn planned(kind: world::SimPlannerKind, mode: crate::control::planner::PlannerMode) -> SimSpec {
    let mut s = spec(1);
    let p = &mut s.config.planner;
    p.mode = mode;
    p.interval_s = 1.0;
    p.cooldown_s = 3.0;
    p.scale_down_intervals = 3;
    p.aggregated.max = 12;
    let w = &s.config.worker;
    let capacity = s.profile.capacity(
        w.sim_speedup,
        w.kv_blocks_with(Some(&s.profile)) * w.block_size_tokens,
        w.max_num_seqs,
        w.max_num_batched_tokens,
        p.ttft_target_ms,
        p.itl_target_ms,
    );
    s.planner = Some(world::SimPlannerSpec {
        kind,
        capacity,
        cold_start: Duration::from_secs(2),
    });
    s
}

fn ups_and_downs(out: &SimOutcome) -> (usize, usize) {
    let ups = out
        .fleet_events
        .iter()
        .filter(|(_, e)| {
            matches!(
                e,
                crate::request_plane::events::FleetEventKind::WorkerUp { .. }
            )
        })
        .count();
    let downs = out
        .fleet_events
        .iter()
        .filter(|(_, e)| {
            matches!(
                e,
                crate::request_plane::events::FleetEventKind::WorkerDown { .. }
            )
        })
        .count();
    (ups, downs)
}

#[test]
fn the_planner_follows_a_load_step_up_and_down_and_drains_without_losing_a_request() {
    use crate::control::planner::{Action, PlannerMode};
    let (w, arrivals) = load_step();
    let n = w.0.len();
    let out = run(
        planned(world::SimPlannerKind::Forecast, PlannerMode::Act),
        &w,
        arrivals,
        &[],
    );
    assert_conserved(&out, n);
    let peak = out.peak_replicas[0].1;
    assert!(peak >= 3, "the step needs more replicas: peak {peak}");
    let (ups, downs) = ups_and_downs(&out);
    assert!(ups >= 2 && downs >= 1, "started {ups}, drained {downs}");
    // Up within two intervals of the step (at 10 s), down only after it ended (at 20 s).
    let first_up = out
        .decisions
        .iter()
        .find(|d| d.pools[0].action == Action::Up)
        .unwrap();
    let up_s = (first_up.at_ms - world::START_WALL_MS) as f64 / 1000.0;
    assert!((10.0..=12.0).contains(&up_s), "first scale-up at {up_s} s");
    let first_down = out
        .decisions
        .iter()
        .find(|d| d.pools[0].action == Action::Down)
        .unwrap();
    assert!(first_down.at_ms - world::START_WALL_MS >= 20_000);
    // Drains cut nothing: no migration, nothing given up; nearly every request served.
    assert_eq!(out.counters.migrations, 0);
    assert_eq!(out.counters.gave_up, 0);
    let ok = out.records.iter().filter(|r| r.ok).count();
    assert!(ok * 100 >= n * 95, "{ok} of {n} served");
    // Cheaper than holding the peak for the whole run.
    let rs = out.replica_seconds[0].1;
    assert!(rs < f64::from(peak) * out.span.as_secs_f64(), "{rs}");
    // The same inputs, the same decisions.
    let (w2, arrivals2) = load_step();
    let again = run(
        planned(world::SimPlannerKind::Forecast, PlannerMode::Act),
        &w2,
        arrivals2,
        &[],
    );
    assert_eq!(
        format!("{:?}", again.decisions),
        format!("{:?}", out.decisions)
    );
    assert_eq!(again.records, out.records);
}

#[test]
fn an_advisory_planner_decides_and_changes_nothing() {
    use crate::control::planner::PlannerMode;
    let (w, arrivals) = load_step();
    let out = run(
        planned(world::SimPlannerKind::Forecast, PlannerMode::Advisory),
        &w,
        arrivals,
        &[],
    );
    assert_conserved(&out, w.0.len());
    assert!(out.decisions.iter().any(|d| d.pools[0].desired > 1));
    assert_eq!(
        out.peak_replicas,
        vec![(crate::runtime::role::Role::Aggregated, 1)]
    );
    assert_eq!(ups_and_downs(&out), (0, 0));
}

#[test]
fn the_oracle_sizes_ahead_of_the_step() {
    use crate::control::planner::PlannerMode;
    let (w, arrivals) = load_step();
    let out = run(
        planned(world::SimPlannerKind::Oracle, PlannerMode::Act),
        &w,
        arrivals,
        &[],
    );
    assert_conserved(&out, w.0.len());
    // It knows the step at 10 s is coming: it asks before the step (cold start 2 s).
    let first_up = out
        .decisions
        .iter()
        .find(|d| d.pools[0].desired > d.pools[0].actual)
        .unwrap();
    assert!(
        first_up.at_ms - world::START_WALL_MS < 10_000,
        "{first_up:?}"
    );
}

#[test]
fn a_kill_while_the_planner_resizes_the_fleet_loses_nothing() {
    use crate::control::planner::PlannerMode;
    let (w, arrivals) = load_step();
    // Worker 0 is the only initial one; kill it late, when the fleet is shrinking.
    let out = run(
        planned(world::SimPlannerKind::Forecast, PlannerMode::Act),
        &w,
        arrivals,
        &[SimFault::Kill {
            at: Duration::from_secs(26),
            worker: 0,
        }],
    );
    assert_conserved(&out, w.0.len());
    assert!(out.records.iter().filter(|r| r.ok).count() * 100 >= w.0.len() * 95);
}

/// Scale from zero in the simulator as in the live fleet: a pool the planner took to zero
/// after an idle spell, then a request — it waits at the gateway (not refused) while the
/// planner asks for a replica and the replica starts, then is served; with a cold-start
/// timeout shorter than the cold start it is refused with 503 (`cold_start`), never lost.
#[test]
fn a_request_at_zero_waits_for_the_planner_to_start_a_replica() {
    use crate::control::planner::PlannerMode;
    let scaled_to_zero = |timeout_ms: u64| {
        let mut s = planned(world::SimPlannerKind::Forecast, PlannerMode::Act);
        s.config.planner.aggregated.min = 0;
        s.config.planner.idle_to_zero_s = 5.0;
        s.config.gateway.cold_start_timeout_ms = timeout_ms;
        s
    };
    let w = Fixed(
        (0..2)
            .map(|i| {
                vec![SimTurn {
                    prompt: prompt(7 + i, 300),
                    max_tokens: 16,
                }]
            })
            .collect(),
    );
    // One request at 0 s, the next at 30 s: the pool is at zero by then.
    let arrivals = Arrivals::Open(vec![0.0, 30.0]);
    let out = run(scaled_to_zero(120_000), &w, arrivals.clone(), &[]);
    assert_conserved(&out, 2);
    assert!(out.records.iter().all(|r| r.ok), "{:?}", out.records);
    assert_eq!(out.counters.shed, 0);
    let (ups, downs) = ups_and_downs(&out);
    assert!(downs >= 1 && ups >= 1, "ups {ups}, downs {downs}");
    let late = out.records.iter().find(|r| r.session == 1).unwrap();
    let ttft = late.ttft_ms.unwrap();
    // The wait: up to one planner interval (1 s), then the 2 s cold start.
    assert!((2_000.0..3_500.0).contains(&ttft), "TTFT at zero {ttft} ms");
    let early = out.records.iter().find(|r| r.session == 0).unwrap();
    assert!(early.ttft_ms.unwrap() < 500.0, "{early:?}");

    let out = run(scaled_to_zero(1_000), &w, arrivals, &[]);
    assert_conserved(&out, 2);
    let late = out.records.iter().find(|r| r.session == 1).unwrap();
    assert!(!late.ok);
    let err = late.error.as_deref().unwrap_or_default();
    assert!(err.starts_with("status 503"), "{err}");
    assert_eq!(out.counters.shed, 1);
}

/// A prefix evicted from G1 comes back from G2 on the worker that computed it: the router
/// credits the G2 copy, the worker onboards it and reports it cached, and the router's index
/// matches every tier of every pool at the end (KV events carry the tier).
#[test]
fn a_prefix_evicted_to_host_memory_is_onboarded_where_it_lives() {
    let mut s = spec(2);
    // G1: 24 blocks of 16 tokens per worker; G2: 64 blocks.
    s.config.worker.kv_blocks = Some(24);
    s.config.worker.kv_host_blocks = 64;
    let hot = prompt(5, 160); // 10 blocks
    let mut turns = vec![vec![SimTurn {
        prompt: hot.clone(),
        max_tokens: 2,
    }]];
    // Other prompts fill both workers' G1 and evict `hot` from it.
    for k in 0..6 {
        turns.push(vec![SimTurn {
            prompt: prompt(50 + k, 300),
            max_tokens: 2,
        }]);
    }
    turns.push(vec![SimTurn {
        prompt: hot,
        max_tokens: 2,
    }]);
    let n = turns.len();
    let out = run(s, &Fixed(turns), offsets(n, 1.0), &[]);
    assert_conserved(&out, n);
    let last = out
        .records
        .iter()
        .find(|r| r.session == n - 1)
        .expect("the repeat");
    assert_eq!(
        last.cached_tokens,
        Some(144),
        "9 full blocks onboarded from G2"
    );
    assert_eq!(
        out.counters.index_mismatches, 0,
        "the index follows every tier"
    );
    let t = out.counters.kv_tiers;
    assert!(t.onboards_host >= 9, "{t:?}");
    assert!(t.offloads > 0 && t.copy_failures == 0, "{t:?}");
}

/// Fork-heavy: one long prefix computed once, then a burst of requests on it with distinct
/// suffixes, more than its holder takes under the balance guard.
fn forks(n: u32) -> (Fixed, Arrivals) {
    let root = prompt(77, 2_048);
    let mut turns = vec![vec![SimTurn {
        prompt: root.clone(),
        max_tokens: 2,
    }]];
    for i in 0..n {
        let mut p = root.clone();
        p.extend(prompt(500 + i, 32));
        turns.push(vec![SimTurn {
            prompt: p,
            max_tokens: 48,
        }]);
    }
    let mut at = vec![0.0];
    at.extend((0..n).map(|i| 1.0 + f64::from(i) * 0.002));
    (Fixed(turns), Arrivals::Open(at))
}

fn pulling(workers: usize) -> SimSpec {
    let mut s = spec(workers);
    s.config.router.pull_credit = 0.5;
    s
}

/// Peer pulls on the simulated fleet: workers the burst spreads to pull the shared prefix
/// from its holder instead of recomputing it; with pulls off (credit 0) none happen; and
/// killing the holder while the burst pulls from it loses no request and leaves no pin.
#[test]
fn a_fork_burst_pulls_the_prefix_from_its_holder_and_a_killed_holder_loses_nothing() {
    let (w, at) = forks(32);
    let mut no_pulls = spec(4);
    no_pulls.config.router.pull_credit = 0.0;
    let off = run(no_pulls, &w, at.clone(), &[]);
    assert_conserved(&off, 33);
    assert_eq!(off.counters.peer_pulls, Default::default());

    let on = run(pulling(4), &w, at.clone(), &[]);
    assert_conserved(&on, 33);
    assert!(on.records.iter().all(|r| r.ok));
    let pp = on.counters.peer_pulls;
    assert!(pp.pulled >= 1, "{pp:?}");
    assert_eq!(pp.blocks % pp.pulled, 0, "whole prefixes: {pp:?}");
    assert!(pp.exported >= pp.pulled, "{pp:?}");
    // Pulled tokens are reported as cached (the admission waits for the pull): with pulls
    // every fork reports its root's 2,048 tokens cached; without, the forks placed away from
    // the holder recompute them.
    let warm = |o: &SimOutcome| {
        o.records
            .iter()
            .filter(|r| r.cached_tokens.unwrap_or(0) >= 2_048)
            .count()
    };
    assert_eq!(warm(&on), 32, "{pp:?}");
    assert!(warm(&off) < 32);
    assert_eq!(
        pp.asked,
        pp.pulled + pp.failed + pp.moot,
        "every ask settled: {pp:?}"
    );

    // The holder is the worker the first request went to.
    let idx = worker_index(&placements(&on)[0]);
    // Kill it 20 ms into the burst, while the first asks and pulls from it are under way.
    let killed = run(
        pulling(4),
        &w,
        at,
        &[SimFault::Kill {
            at: Duration::from_millis(1_020),
            worker: idx,
        }],
    );
    assert_conserved(&killed, 33);
    assert!(
        killed.records.iter().all(|r| r.ok),
        "every request finished"
    );
    assert_eq!(killed.counters.kills, 1);
    // Killed while its peers' asks or pulls were under way: they failed and recomputed.
    let pp = killed.counters.peer_pulls;
    assert!(pp.failed >= 1, "{pp:?}");
    assert_eq!(
        pp.asked,
        pp.pulled + pp.failed + pp.moot,
        "every ask settled: {pp:?}"
    );
}

/// Four routers sharing their load, each request sent to one of them, with a worker killed
/// mid-run: nothing is lost or left over (every router's placements end, every router's
/// index equals the pools), and the prefix hits are those of one router.
#[test]
fn four_routers_lose_nothing_and_hit_the_cache_like_one() {
    let w = sessions();
    let kill = [SimFault::Kill {
        at: Duration::from_millis(150),
        worker: 0,
    }];
    let one = run(spec(3), &w, offsets(24, 0.02), &kill);
    let mut four = spec(3);
    four.routers = 4;
    let four = run(four, &w, offsets(24, 0.02), &kill);
    for out in [&one, &four] {
        assert_conserved(out, 72);
        assert!(out.records.iter().all(|r| r.ok && r.output_tokens == 24));
    }
    let cached = |o: &SimOutcome| -> u64 { o.records.iter().filter_map(|r| r.cached_tokens).sum() };
    assert!(cached(&one) > 0);
    assert!(
        cached(&four) as f64 >= 0.98 * cached(&one) as f64,
        "four routers {} against one {}",
        cached(&four),
        cached(&one)
    );
}

/// Sessions of one turn each, alternating between two priority classes.
struct TwoClasses(Vec<SimTurn>);

impl SimWorkload for TwoClasses {
    fn sessions(&self) -> usize {
        self.0.len()
    }
    fn turns(&self, _: usize) -> usize {
        1
    }
    fn turn(&self, i: usize, _: usize) -> SimTurn {
        self.0[i].clone()
    }
    fn class(&self, i: usize) -> Option<&str> {
        Some(if i.is_multiple_of(2) {
            "interactive"
        } else {
            "batch"
        })
    }
}

impl TwoClasses {
    /// `n` requests of distinct 512-token prompts (seeds from `seed`), `max_tokens` each.
    fn burst(n: u32, seed: u32, max_tokens: u32) -> Self {
        Self(
            (0..n)
                .map(|i| SimTurn {
                    prompt: prompt(seed + i, 512),
                    max_tokens,
                })
                .collect(),
        )
    }
}

fn two_classes(quanta: [u32; 2]) -> SimSpec {
    use crate::request_plane::priority::{PriorityClass, PriorityConfig};
    let mut s = spec(1);
    s.config.priority = PriorityConfig {
        classes: vec![
            PriorityClass {
                name: "interactive".into(),
                quantum: quanta[0],
                ttft_target_ms: None,
            },
            PriorityClass {
                name: "batch".into(),
                quantum: quanta[1],
                ttft_target_ms: None,
            },
        ],
        default: None,
    };
    s
}

/// A burst of like requests, half of each class, on one replica (the virtual clock): while
/// both classes wait, the first tokens go 4 : 1 under quanta 512 : 128 and 1 : 1 under equal
/// quanta (within 10 % of the weights, the bound).
#[test]
fn a_burst_is_served_by_class_weight() {
    let burst = TwoClasses::burst(400, 1_000, 16);
    for (quanta, want) in [([512, 128], 0.8), ([256, 256], 0.5)] {
        let mut spec = two_classes(quanta);
        spec.config.gateway.busy_waiting = 1_000_000;
        let out = run(spec, &burst, Arrivals::Open(vec![0.0; 400]), &[]);
        assert!(
            out.records.iter().all(|r| r.ok),
            "{:?}",
            out.records.iter().find(|r| !r.ok)
        );
        let first = |r: &SimRecord| r.sent_s + r.ttft_ms.unwrap_or(f64::MAX) / 1e3;
        // The window: until the class that finishes first got its last first token.
        let end = ["interactive", "batch"]
            .map(|c| {
                out.records
                    .iter()
                    .filter(|r| r.class.as_deref() == Some(c))
                    .map(first)
                    .fold(0.0, f64::max)
            })
            .into_iter()
            .fold(f64::MAX, f64::min);
        let served = |c: &str| {
            out.records
                .iter()
                .filter(|r| r.class.as_deref() == Some(c) && first(r) <= end)
                .count() as f64
        };
        let share = served("interactive") / (served("interactive") + served("batch"));
        assert!(
            (share - want).abs() <= 0.1 * want,
            "quanta {quanta:?}: interactive share {share:.3}, want {want}"
        );
    }
}

/// Past the lowest class's share of the busy-queue threshold, admission refuses that class
/// (429) and still admits the highest.
#[test]
fn the_lowest_class_is_shed_first() {
    let burst = TwoClasses::burst(200, 3_000, 64);
    let mut spec = two_classes([512, 128]);
    spec.config.gateway.busy_waiting = 40;
    // 8 running at most (~4 requests a second): arrivals 50 ms apart build a queue of ~5
    // more at each heartbeat of the fleet view, past 20 (batch's share) and then 40.
    spec.config.worker.max_num_seqs = 8;
    let out = run(
        spec,
        &burst,
        Arrivals::Open((0..200).map(|i| i as f64 * 0.05).collect()),
        &[],
    );
    let refused = |c: &str, status: &str| {
        out.records
            .iter()
            .filter(|r| {
                r.class.as_deref() == Some(c)
                    && r.error.as_deref().is_some_and(|e| e.starts_with(status))
            })
            .count()
    };
    assert!(
        refused("batch", "status 429") > 0,
        "no batch request was shed"
    );
    assert_eq!(refused("interactive", "status 429"), 0);
    assert!(
        refused("batch", "status 429") + refused("batch", "status 503")
            > refused("interactive", "status 503"),
        "the lower class was not shed first"
    );
}

#[test]
fn a_fault_says_which_worker_and_when() {
    let kill = SimFault::Kill {
        at: Duration::from_secs(3),
        worker: 2,
    };
    assert_eq!(kill.to_string(), "kill worker 2 (sim-2/replica-0) at 3.0 s");
    let hang = SimFault::Hang {
        from: Duration::from_millis(1500),
        until: Duration::from_secs(4),
        worker: 0,
    };
    assert_eq!(
        hang.to_string(),
        "hang worker 0 (sim-0/replica-0) from 1.5 s to 4.0 s"
    );
}
