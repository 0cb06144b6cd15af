//! The planner's policy on a manual clock (times are passed in).

use super::forecast::ForecastSettings;
use super::*;

fn settings(kind: ForecastKind) -> ForecastSettings {
    ForecastSettings {
        kind,
        window: 4,
        alpha: 0.5,
        beta: 0.3,
        season: 5,
    }
}

#[test]
fn a_moving_average_is_the_mean_of_its_window() {
    let mut f = Forecaster::new(settings(ForecastKind::MovingAverage));
    assert_eq!(f.forecast(), None);
    for x in [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] {
        f.observe(x);
    }
    assert_eq!(f.forecast(), Some(4.5), "mean of 3, 4, 5, 6");
    f.observe(f64::NAN);
    assert_eq!(f.forecast(), Some(4.5), "a non-finite value is ignored");
}

#[test]
fn holt_forecasts_a_straight_line_exactly() {
    let mut f = Forecaster::new(settings(ForecastKind::Holt));
    f.observe(10.0);
    assert_eq!(f.forecast(), Some(10.0), "one value: the value");
    for t in 1..20 {
        f.observe(10.0 + 3.0 * f64::from(t));
        let next = 10.0 + 3.0 * f64::from(t + 1);
        assert!((f.forecast().unwrap() - next).abs() < 1e-9, "t={t}");
    }
    // A falling line forecasts below zero: clamped.
    let mut g = Forecaster::new(settings(ForecastKind::Holt));
    g.observe(2.0);
    g.observe(1.0);
    g.observe(0.0);
    assert_eq!(g.forecast(), Some(0.0));
}

#[test]
fn holt_follows_a_step_faster_than_a_moving_average() {
    let mut h = Forecaster::new(settings(ForecastKind::Holt));
    let mut m = Forecaster::new(settings(ForecastKind::MovingAverage));
    for x in [5.0, 5.0, 5.0, 5.0, 20.0, 20.0] {
        h.observe(x);
        m.observe(x);
    }
    let (h, m) = (h.forecast().unwrap(), m.forecast().unwrap());
    assert!(h > m, "holt {h} vs moving average {m}");
    assert!(h >= 17.0, "holt {h}");
}

#[test]
fn seasonal_naive_repeats_the_last_season() {
    let mut f = Forecaster::new(settings(ForecastKind::SeasonalNaive));
    let season = [1.0, 4.0, 9.0, 4.0, 1.0];
    f.observe(1.0);
    assert_eq!(f.forecast(), Some(1.0), "before a season: the last value");
    for t in 1..23 {
        f.observe(season[t % 5]);
        assert_eq!(
            f.forecast(),
            if t >= 4 {
                Some(season[(t + 1) % 5])
            } else {
                Some(season[t % 5])
            },
            "t={t}"
        );
    }
}

/// The sim engine's H100 profile (`worker/engine/sim.rs`), its step times written out.
fn h100_capacity() -> CapacityProfile {
    let m = StepModel {
        source: "vLLM on 1x H100 (the sim engine's profile)".into(),
        prefill_ms: &|t| {
            let t = t as f64;
            if t == 0.0 {
                0.0
            } else {
                4.21e-7 * t * t + 0.01518 * t + 16.5
            }
        },
        decode_ms: &|u, _| (-25.74 * u * u + 54.01 * u + 5.74).max(1.0),
        kv_tokens: 458_752,
        max_num_seqs: 64,
        max_num_batched_tokens: 512,
    };
    CapacityProfile::from_step_model(&m, 500.0, 50.0)
}

#[test]
fn capacity_curves_follow_the_step_model() {
    let c = h100_capacity();
    c.check().unwrap();
    // Longer prompts amortise the step's fixed cost: more tokens/s, up to the chunk.
    assert!(c.prefill_tokens_per_s(512.0) > c.prefill_tokens_per_s(64.0));
    // Longer contexts fill the KV pool: fewer sequences, fewer tokens/s.
    assert!(c.decode_tokens_per_s(32768.0) < c.decode_tokens_per_s(1024.0));
    // The decode batch never exceeds max_num_seqs.
    assert!(c.decode.iter().all(|p| p.batch <= 64 && p.batch >= 1));
    // Interpolation: between two points, and the end points beyond.
    let mid = c.prefill_tokens_per_s(768.0);
    let (a, b) = (
        c.prefill_tokens_per_s(512.0),
        c.prefill_tokens_per_s(1024.0),
    );
    assert!(mid >= a.min(b) && mid <= a.max(b));
    assert_eq!(c.prefill_tokens_per_s(1.0), c.prefill[0].tokens_per_s);
    assert_eq!(
        c.prefill_tokens_per_s(1e9),
        c.prefill.last().unwrap().tokens_per_s
    );
}

#[test]
fn a_tighter_target_means_a_lower_utilisation() {
    let loose = capacity::max_utilisation(30.0, 1000.0);
    let tight = capacity::max_utilisation(30.0, 200.0);
    assert!(tight < loose, "{tight} < {loose}");
    assert_eq!(capacity::max_utilisation(600.0, 500.0), 0.05, "unreachable");
    assert!(capacity::max_utilisation(1.0, 1e6) >= 0.94);
}

#[test]
fn a_bad_capacity_profile_is_refused_with_the_table_named() {
    let mut c = h100_capacity();
    c.decode.clear();
    assert!(c.check().unwrap_err().contains("decode"));
    let mut c = h100_capacity();
    c.prefill.swap(0, 1);
    assert!(c.check().unwrap_err().contains("ascending"));
    let mut c = h100_capacity();
    c.prefill[2].tokens_per_s = f64::NAN;
    assert!(c.check().unwrap_err().contains("tokens_per_s"));
    let e = CapacityProfile::load(std::path::Path::new("/nonexistent/cap.json")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/cap.json"));
}

const T0: u64 = 1_767_225_600_000;
const IV: u64 = 10_000;

fn cfg() -> PlannerConfig {
    PlannerConfig {
        scale_down_intervals: 3,
        cooldown_s: 30.0,
        idle_to_zero_s: 60.0,
        adopt_s: 120.0,
        ..PlannerConfig::default()
    }
}

fn signals(at_ms: u64, rate: f64, pools: &[(Role, u32)]) -> FleetSignals {
    let arrivals = (rate * 10.0).round() as u64;
    FleetSignals {
        at_ms,
        window_s: 10.0,
        arrivals,
        request_rate: rate,
        prompt_tokens: if arrivals > 0 { 1000.0 } else { 0.0 },
        completed: arrivals,
        output_tokens: if arrivals > 0 { 200.0 } else { 0.0 },
        in_flight: arrivals,
        pools: pools
            .iter()
            .map(|&(role, n)| PoolCount {
                ready: n,
                ..PoolCount::new(role)
            })
            .collect(),
        ..FleetSignals::default()
    }
}

/// Runs `rates` through a planner whose decisions are carried out at once; the counts.
fn follow(planner: &mut Planner, rates: &[f64], role: Role, start: u32) -> Vec<u32> {
    let mut n = start;
    let mut out = Vec::new();
    for (k, &r) in rates.iter().enumerate() {
        let now = T0 + k as u64 * IV;
        let d = planner.plan(&signals(now, r, &[(role, n)]), now, None);
        n = d.pool(role).unwrap().desired;
        out.push(n);
    }
    out
}

#[test]
fn a_step_up_in_load_is_followed_within_two_intervals() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let mut rates = vec![5.0; 10];
    rates.extend(vec![50.0; 4]);
    let counts = follow(&mut p, &rates, Role::Aggregated, 1);
    let low = counts[9];
    // What the high load needs, from a planner that always saw it.
    let mut q = Planner::new(cfg(), h100_capacity());
    let need = *follow(&mut q, &[50.0; 4], Role::Aggregated, 1)
        .last()
        .unwrap();
    assert!(need > low, "the step needs more replicas: {need} > {low}");
    assert!(
        counts[11] >= need,
        "within two intervals of the step: {counts:?} (needs {need})"
    );
}

#[test]
fn a_steady_noisy_load_never_flaps() {
    let mut p = Planner::new(cfg(), h100_capacity());
    // 20 req/s with ±15 % noise (a fixed pseudo-random walk).
    let mut x: u64 = 12345;
    let rates: Vec<f64> = (0..200)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            20.0 * (0.85 + 0.3 * ((x >> 33) as f64 / (1u64 << 31) as f64))
        })
        .collect();
    let counts = follow(&mut p, &rates, Role::Aggregated, 1);
    // After the first climb, at most one change in any ten intervals.
    let settled = &counts[10..];
    for w in settled.windows(10) {
        let changes = w.windows(2).filter(|p| p[0] != p[1]).count();
        assert!(changes <= 1, "flapping: {w:?} in {counts:?}");
    }
}

#[test]
fn scale_down_waits_for_calm_intervals_and_the_cool_down() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let mut rates = vec![60.0; 5];
    rates.extend(vec![2.0; 12]);
    let counts = follow(&mut p, &rates, Role::Aggregated, 1);
    let high = counts[4];
    assert!(high > 1);
    // The first low interval's forecast still carries some of the high rate; no scale-down
    // before three calm intervals in a row.
    assert_eq!(&counts[5..7], &[high, high], "{counts:?}");
    let first_down = counts.iter().position(|&c| c < high).unwrap();
    assert!(first_down >= 7, "{counts:?}");
    assert!(*counts.last().unwrap() < high, "{counts:?}");
    // Decisions say why they held.
    let d = p.last().unwrap();
    assert!(!d.pools[0].reason.is_empty());
}

#[test]
fn a_missed_latency_target_blocks_scale_down_and_raises_the_correction() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let mut n = 8;
    for k in 0..8 {
        let now = T0 + k * IV;
        let mut s = signals(now, 2.0, &[(Role::Aggregated, n)]);
        s.ttft_p99_ms = Some(900.0);
        let d = p.plan(&s, now, None);
        let pd = d.pool(Role::Aggregated).unwrap();
        assert_ne!(pd.action, Action::Down, "{pd:?}");
        n = pd.desired;
    }
    let c = p.last().unwrap().pools[0].correction;
    assert!(c > 1.0 && c <= policy::MAX_CORRECTION, "{c}");
}

#[test]
fn stale_signals_hold_the_last_decision() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let d = p.plan(&signals(T0, 40.0, &[(Role::Aggregated, 1)]), T0, None);
    let want = d.pools[0].desired;
    assert!(want > 1);
    // The view stops: the fleet looks idle in it, but it is 25 s old.
    let now = T0 + 25_000;
    let d = p.plan(&signals(T0, 0.0, &[(Role::Aggregated, want)]), now, None);
    assert!(d.stale);
    assert_eq!(d.pools[0].desired, want);
    assert_eq!(d.pools[0].action, Action::Hold);
    assert!(d.pools[0].reason.contains("old"), "{}", d.pools[0].reason);
}

#[test]
fn an_idle_pool_goes_to_zero_after_idle_to_zero_s_and_comes_back_for_a_request() {
    let mut c = cfg();
    c.aggregated.min = 0;
    let mut p = Planner::new(c, h100_capacity());
    let mut n = 2;
    let mut zero_at = None;
    for k in 0..12u64 {
        let now = T0 + k * IV;
        let d = p.plan(&signals(now, 0.0, &[(Role::Aggregated, n)]), now, None);
        n = d.pools[0].desired;
        if n == 0 && zero_at.is_none() {
            zero_at = Some(k);
        }
        if k < 6 {
            assert!(n >= 1, "not idle long enough at interval {k}");
        }
    }
    assert_eq!(zero_at, Some(6), "idle since interval 0, 60 s later");
    // A request waits at a fleet of zero: one replica at once.
    let now = T0 + 12 * IV;
    let mut s = signals(now, 0.0, &[(Role::Aggregated, 0)]);
    s.waiting_for_capacity = 1;
    let d = p.plan(&s, now, None);
    assert_eq!(d.pools[0].desired, 1);
    assert_eq!(d.pools[0].action, Action::Up);
    // With min = 1 it never goes below one.
    let mut p = Planner::new(cfg(), h100_capacity());
    let counts = follow(&mut p, &[0.0; 20], Role::Aggregated, 3);
    assert_eq!(*counts.last().unwrap(), 1);
}

#[test]
fn a_manual_scale_up_is_adopted_as_a_floor_for_adopt_s() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let counts = follow(&mut p, &[2.0; 3], Role::Aggregated, 1);
    assert_eq!(counts, vec![1, 1, 1]);
    // An operator starts three more replicas by hand.
    let mut held = 0;
    for k in 3..30u64 {
        let now = T0 + k * IV;
        let d = p.plan(&signals(now, 2.0, &[(Role::Aggregated, 4)]), now, None);
        if k == 3 {
            assert_eq!(d.manual.len(), 1, "{d:?}");
            assert!(d.manual[0].contains("floor"), "{}", d.manual[0]);
        }
        if d.pools[0].desired == 4 {
            held += 1;
        } else {
            assert!(
                now >= T0 + 3 * IV + 120_000,
                "down before adopt_s ended: {k}"
            );
            break;
        }
    }
    assert!(held >= 12, "held {held} intervals");
}

#[test]
fn a_manual_change_is_only_reported_with_manual_report() {
    let mut c = cfg();
    c.manual = ManualPolicy::Report;
    let mut p = Planner::new(c, h100_capacity());
    follow(&mut p, &[2.0; 3], Role::Aggregated, 1);
    let now = T0 + 3 * IV;
    let d = p.plan(&signals(now, 2.0, &[(Role::Aggregated, 4)]), now, None);
    assert!(d.manual[0].contains("reported"), "{:?}", d.manual);
    // It then plans from 4, scaling down after the calm intervals and the cool-down.
    let mut n = 4;
    for k in 4..20u64 {
        let now = T0 + k * IV;
        n = p
            .plan(&signals(now, 2.0, &[(Role::Aggregated, n)]), now, None)
            .pools[0]
            .desired;
    }
    assert_eq!(n, 1);
}

#[test]
fn advisory_mode_decides_but_notices_no_manual_change() {
    let mut c = cfg();
    c.mode = PlannerMode::Advisory;
    let mut p = Planner::new(c, h100_capacity());
    for k in 0..5u64 {
        let now = T0 + k * IV;
        // Nothing is carried out: the fleet stays at one replica.
        let d = p.plan(&signals(now, 60.0, &[(Role::Aggregated, 1)]), now, None);
        assert_eq!(d.mode, PlannerMode::Advisory);
        assert!(d.pools[0].desired > 1);
        assert!(d.manual.is_empty());
    }
}

#[test]
fn disaggregated_pools_are_sized_apart() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let now = T0;
    let mut s = signals(now, 30.0, &[(Role::Prefill, 1), (Role::Decode, 1)]);
    // Long prompts, short answers: the prefill pool needs more than the decode pool.
    s.prompt_tokens = 8000.0;
    s.output_tokens = 20.0;
    let d = p.plan(&s, now, None);
    let (pf, dc) = (
        d.pool(Role::Prefill).unwrap(),
        d.pool(Role::Decode).unwrap(),
    );
    assert!(pf.desired > dc.desired, "{pf:?} {dc:?}");
    assert!(d.pool(Role::Aggregated).is_none());
    assert!((d.cost_per_hour - f64::from(pf.desired + dc.desired)).abs() < 1e-9);
}

#[test]
fn an_oracle_forecast_replaces_the_forecaster() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let oracle = Forecast {
        request_rate: 80.0,
        prompt_tokens: 1000.0,
        output_tokens: 200.0,
        cached_tokens: 0.0,
    };
    let d = p.plan(
        &signals(T0, 1.0, &[(Role::Aggregated, 1)]),
        T0,
        Some(oracle),
    );
    assert_eq!(d.forecast, Some(oracle));
    assert!(d.pools[0].desired > 2);
}

#[test]
fn the_config_refuses_bad_values_by_name() {
    type Edit = fn(&mut PlannerConfig);
    let cases: Vec<(Edit, &str)> = vec![
        (|c| c.interval_s = -1.0, "planner.interval_s"),
        (|c| c.interval_s = 0.0, "planner.interval_s"),
        (|c| c.cooldown_s = f64::NAN, "planner.cooldown_s"),
        (|c| c.ttft_target_ms = 0.0, "planner.ttft_target_ms"),
        (|c| c.holt_alpha = 0.0, "planner.holt_alpha"),
        (|c| c.decode.min = 9, "planner.decode.min"),
        (|c| c.prefill.max = 0, "planner.prefill.max"),
        (
            |c| c.aggregated.dollars_per_hour = -2.0,
            "planner.aggregated.dollars_per_hour",
        ),
        (|c| c.window_intervals = 0, "planner.window_intervals"),
        (
            |c| c.capacity_profile = Some("/nonexistent/cap.json".into()),
            "planner.capacity_profile",
        ),
    ];
    for (edit, field) in cases {
        let mut c = PlannerConfig::default();
        c.decode.max = 8;
        edit(&mut c);
        let err = c.validate().unwrap_err();
        assert_eq!(err.field(), Some(field), "{err}");
    }
    PlannerConfig::default().validate().unwrap();
}

#[test]
fn cost_per_million_tokens_within_slo() {
    let mut c = PlannerConfig::default();
    c.prefill.dollars_per_hour = 2.0;
    // 3 decode replica-hours at 1 and 1 prefill replica-hour at 2: 5; 2 M tokens within SLO.
    let v = cost_per_million_in_slo(
        &c,
        &[(Role::Decode, 3.0 * 3600.0), (Role::Prefill, 3600.0)],
        2_000_000,
    );
    assert_eq!(v, Some(2.5));
    assert_eq!(cost_per_million_in_slo(&c, &[(Role::Decode, 1.0)], 0), None);
}

fn gateway_node(incarnation: u64, s: crate::runtime::signals::GatewaySignals) -> NodeView {
    use crate::control::discovery::membership::NodeState;
    NodeView {
        id: crate::runtime::ids::NodeId::new("node-0"),
        addr: String::new(),
        http_addr: None,
        roles: vec![],
        pid: 0,
        incarnation,
        state: NodeState::Up,
        last_seen_ms: 0,
        workers: vec![],
        actors: vec![],
        counters: Default::default(),
        signals: Some(s),
        planner: None,
        regions: vec![],
    }
}

fn worker_node(name: &str, workers: &[(Role, WorkerHealth)]) -> NodeView {
    let mut n = gateway_node(1, Default::default());
    n.id = crate::runtime::ids::NodeId::new(name);
    n.signals = None;
    n.workers = workers
        .iter()
        .enumerate()
        .map(|(k, &(role, health))| WorkerView {
            id: format!("{name}/replica-{k}"),
            role: Some(role),
            health,
            in_flight: 2,
            waiting: 1,
            kv_blocks_used: 10,
            kv_blocks_total: 100,
            ..WorkerView::default()
        })
        .collect();
    n
}

use crate::control::discovery::membership::{NodeView, WorkerHealth, WorkerView};

#[test]
fn the_view_reader_diffs_the_gateways_counts_and_counts_the_pools() {
    use crate::runtime::signals::GatewayCounters;
    let c = GatewayCounters::default();
    c.arrived(1000);
    c.first_token(100.0);
    c.finished(10, 0);
    let workers = worker_node(
        "node-1",
        &[
            (Role::Aggregated, WorkerHealth::Ready),
            (Role::Aggregated, WorkerHealth::Draining),
            (Role::Aggregated, WorkerHealth::Unknown),
        ],
    );
    let mut r = ViewReader::default();
    // The first read only sets the baseline.
    let s = r.read(&[gateway_node(1, c.snapshot()), workers.clone()], T0, 10.0);
    assert_eq!((s.arrivals, s.ttft_p99_ms), (0, None));
    let p = s.pool(Role::Aggregated).unwrap();
    assert_eq!((p.ready, p.draining, p.starting), (1, 1, 1));
    assert_eq!((s.in_flight, s.waiting), (6, 3));
    assert!((s.kv_usage - 0.1).abs() < 1e-9);
    for _ in 0..20 {
        c.arrived(500);
        c.first_token(300.0);
        c.finished(100, 50);
    }
    let s = r.read(
        &[gateway_node(1, c.snapshot()), workers.clone()],
        T0 + IV,
        10.0,
    );
    assert_eq!(s.arrivals, 20);
    assert_eq!(s.request_rate, 2.0);
    assert_eq!(s.prompt_tokens, 500.0);
    assert_eq!(
        (s.completed, s.output_tokens, s.cached_tokens),
        (20, 100.0, 50.0)
    );
    let p99 = s.ttft_p99_ms.unwrap();
    assert!((300.0..340.0).contains(&p99), "{p99}");
    // The gateway restarted (a new incarnation): its counts start from zero.
    let fresh = GatewayCounters::default();
    fresh.arrived(100);
    let s = r.read(
        &[gateway_node(2, fresh.snapshot()), workers],
        T0 + 2 * IV,
        10.0,
    );
    assert_eq!(s.arrivals, 1);
    // Every worker of the pool gone: the pool is still listed, empty.
    let s = r.read(&[gateway_node(2, fresh.snapshot())], T0 + 3 * IV, 10.0);
    assert_eq!(s.pool(Role::Aggregated).unwrap().size(), 0);
}

#[test]
fn requests_shed_for_capacity_count_as_demand() {
    use crate::runtime::signals::GatewayCounters;
    let c = GatewayCounters::default();
    let workers = worker_node("node-1", &[(Role::Aggregated, WorkerHealth::Ready)]);
    let mut r = ViewReader::default();
    r.read(&[gateway_node(1, c.snapshot()), workers.clone()], T0, 10.0);
    // An overloaded fleet: 40 requests got in, 360 were shed in the interval.
    for _ in 0..40 {
        c.arrived(1000);
        c.finished(200, 0);
    }
    for _ in 0..360 {
        c.shed();
    }
    let s = r.read(&[gateway_node(1, c.snapshot()), workers], T0 + IV, 10.0);
    assert_eq!((s.arrivals, s.shed), (40, 360));
    assert_eq!(s.request_rate, 40.0, "the demand, served or not");
    assert_eq!(
        s.prompt_tokens, 1000.0,
        "lengths from the requests that got in"
    );
    // The planner sizes for the demand: as for 40 requests/s, more than for the 4 served.
    let mut served = s.clone();
    served.shed = 0;
    served.request_rate = 4.0;
    let plan = |s: &FleetSignals| {
        Planner::new(cfg(), h100_capacity())
            .plan(s, T0 + IV, None)
            .pools[0]
            .desired
    };
    let mut at_40 = signals(T0 + IV, 40.0, &[(Role::Aggregated, 1)]);
    at_40.in_flight = s.in_flight;
    assert!(
        plan(&s) > plan(&served),
        "{} vs {}",
        plan(&s),
        plan(&served)
    );
    assert_eq!(plan(&s), plan(&at_40));
}

#[test]
fn declared_pools_are_sized_before_any_of_their_workers_is_seen() {
    // A fleet deployed at zero (planner.pools): both pools are counted, empty, from the
    // first read; a pool seen later is added; duplicates count once.
    let mut r = ViewReader::with_pools(&[Role::Prefill, Role::Decode, Role::Prefill]);
    let s = r.read(&[gateway_node(1, Default::default())], T0, 10.0);
    let pools: Vec<(Role, u32)> = s.pools.iter().map(|p| (p.role, p.size())).collect();
    assert_eq!(pools, vec![(Role::Prefill, 0), (Role::Decode, 0)]);
    // The policy then brings each to its floor (min 1 by default).
    let mut p = Planner::new(cfg(), h100_capacity());
    let d = p.plan(&s, T0, None);
    let desired: Vec<(Role, u32)> = d.pools.iter().map(|p| (p.role, p.desired)).collect();
    assert_eq!(desired, vec![(Role::Prefill, 1), (Role::Decode, 1)]);
    // Without declared pools a planner that has seen no worker sizes nothing.
    let s = ViewReader::default().read(&[gateway_node(1, Default::default())], T0, 10.0);
    assert!(s.pools.is_empty());
}

#[test]
fn replicas_asked_for_count_as_starting_until_they_appear_or_time_out() {
    let mut c = cfg();
    c.start_timeout_s = 30.0;
    let mut p = Planner::new(c, h100_capacity());
    let d = p.plan(&signals(T0, 40.0, &[(Role::Aggregated, 1)]), T0, None);
    let want = d.pools[0].desired;
    assert!(want > 1);
    // The new replicas are still loading: the view shows one.
    for k in 1..3 {
        let now = T0 + k * IV;
        let d = p.plan(&signals(now, 40.0, &[(Role::Aggregated, 1)]), now, None);
        assert!(d.manual.is_empty(), "{:?}", d.manual);
        assert_eq!(d.pools[0].actual, want, "{}", d.pools[0].reason);
        assert!(d.pools[0].reason.contains("starting"));
    }
    // Past start_timeout_s they failed to start: reported, not adopted, and asked for again.
    let now = T0 + 4 * IV;
    let d = p.plan(&signals(now, 40.0, &[(Role::Aggregated, 1)]), now, None);
    assert!(d.manual[0].contains("did not start"), "{:?}", d.manual);
    assert_eq!(d.pools[0].actual, 1);
    assert_eq!(d.pools[0].desired, want);
    assert_eq!(d.pools[0].action, Action::Up);
}

#[test]
fn a_drained_replica_still_in_the_view_is_not_a_manual_change() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let counts = follow(&mut p, &[60.0; 3], Role::Aggregated, 1);
    let high = counts[2];
    // Load gone: after the calm intervals it scales down…
    let mut n = high;
    let mut k = 3;
    let down_to = loop {
        let now = T0 + k * IV;
        let d = p.plan(&signals(now, 0.0, &[(Role::Aggregated, n)]), now, None);
        k += 1;
        if d.pools[0].action == Action::Down {
            break d.pools[0].desired;
        }
        n = d.pools[0].desired;
    };
    // …but the view still lists the drained replicas for an interval.
    let now = T0 + k * IV;
    let d = p.plan(&signals(now, 0.0, &[(Role::Aggregated, high)]), now, None);
    assert!(d.manual.is_empty(), "{:?}", d.manual);
    assert!(
        d.pools[0].reason.contains("draining"),
        "{}",
        d.pools[0].reason
    );
    assert_eq!(d.pools[0].actual, down_to);
}

#[test]
fn a_pool_that_shrank_outside_the_planner_is_reported_and_refilled() {
    let mut p = Planner::new(cfg(), h100_capacity());
    let counts = follow(&mut p, &[60.0; 3], Role::Aggregated, 1);
    let want = counts[2];
    assert!(want > 2);
    // Two replicas die (or are drained by hand): the load has not changed.
    let now = T0 + 3 * IV;
    let d = p.plan(
        &signals(now, 60.0, &[(Role::Aggregated, want - 2)]),
        now,
        None,
    );
    assert!(
        d.manual[0].contains("failed or was drained"),
        "{:?}",
        d.manual
    );
    assert_eq!(d.pools[0].action, Action::Up, "{:?}", d.pools[0]);
    assert_eq!(d.pools[0].desired, want);
}
