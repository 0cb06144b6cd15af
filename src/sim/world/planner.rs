//! The planner in the simulated fleet's loop: every `planner.interval_s` the live planner's
//! policy reads the fleet's signals and its decisions resize the pools (spare slots start
//! after the cold start, running replicas drain); the replica-seconds each pool costs; the
//! oracle's forecast from the workload's true load, and [`static_peak`], the static fleet
//! sized for the peak.

use std::time::Duration;

use crate::control::discovery::membership::{NodeState, NodeView};
use crate::control::planner::{
    CapacityProfile, Forecast, Planner, PlannerMode, PoolCount, ViewReader,
};
use crate::runtime::clock::Instant;
use crate::runtime::ids::NodeId;
use crate::runtime::role::Role;
use crate::runtime::signals::GatewayCounters;

use super::{
    Ev, GATEWAY, Phase, START_WALL_MS, SimFleet, SimPlannerKind, SimPlannerSpec, SimSpec,
    SimWorkload,
};

pub(super) struct SimPlannerState {
    pub(super) planner: Planner,
    pub(super) spec: SimPlannerSpec,
    /// The gateway's signals, counted as a live gateway counts them (`serve.rs`).
    pub(super) gateway: GatewayCounters,
    /// Reads them with the published view, as the live Planner actor does.
    pub(super) reader: ViewReader,
    /// Per interval of the workload: (requests, prompt tokens, output tokens).
    pub(super) oracle: Vec<(u64, u64, u64)>,
    pub(super) interval: Duration,
    pub(super) pools: Vec<Role>,
}

impl<'w> SimFleet<'w> {
    /// The planner's interval: the fleet's signals from the published view and the gateway's
    /// window, a decision, and (mode `act`) the pools resized to it.
    pub(super) fn plan_interval(&mut self) {
        let now = self.now();
        self.refresh_views();
        let Some(pools) = self.planner.as_ref().map(|p| p.pools.clone()) else {
            return;
        };
        let wall =
            |t: Instant| START_WALL_MS + t.saturating_duration_since(self.start).as_millis() as u64;
        let view_at = wall(self.views_at.unwrap_or(now));
        let counts: Vec<PoolCount> = pools.iter().map(|&r| self.pool_count(r)).collect();
        let elapsed = now.saturating_duration_since(self.start);
        let now_ms = wall(now);
        let Some(ps) = self.planner.as_mut() else {
            return;
        };
        let interval_s = ps.interval.as_secs_f64();
        // The live path: the gateway's cumulative signals in its node's view, read with the
        // workers' views by the same ViewReader (it diffs the counts, takes the p99s from
        // the histograms, sums in-flight, waiting and KV use). Only the pool counts are the
        // simulator's own: it knows which slots are starting, which the live view infers.
        let gateway = NodeView {
            id: NodeId::new(GATEWAY),
            addr: String::new(),
            http_addr: None,
            roles: vec![],
            pid: 0,
            incarnation: 1,
            state: NodeState::Up,
            last_seen_ms: view_at,
            workers: vec![],
            actors: vec![],
            counters: Default::default(),
            signals: Some(ps.gateway.snapshot()),
            planner: None,
            regions: vec![],
        };
        let nodes: Vec<NodeView> = std::iter::once(gateway)
            .chain(self.views.iter().cloned())
            .collect();
        let mut signals = ps.reader.read(&nodes, view_at, interval_s);
        signals.pools = counts;
        let oracle = (ps.spec.kind == SimPlannerKind::Oracle)
            .then(|| oracle_forecast(&ps.oracle, elapsed, interval_s, ps.spec.cold_start));
        let decision = ps.planner.plan(&signals, now_ms, oracle);
        let interval = ps.interval;
        let targets: Vec<(Role, u32)> =
            decision.pools.iter().map(|p| (p.role, p.desired)).collect();
        let act = decision.mode == PlannerMode::Act;
        self.out.decisions.push(decision);
        if act {
            for (role, n) in targets {
                self.resize(role, n);
            }
        }
        if self.sessions_left > 0 || !self.requests.is_empty() {
            self.schedule_in(interval, Ev::Plan);
        }
    }

    /// Pool `role` to `n` replicas (ready and starting): spare slots start (ready after the
    /// cold start); above `n`, cold starts are called off first, then the replicas running
    /// the fewest sequences drain (they leave routing and finish what they run).
    fn resize(&mut self, role: Role, n: u32) {
        let Some(cold_start) = self.planner.as_ref().map(|p| p.spec.cold_start) else {
            return;
        };
        let n = n as usize;
        let members: Vec<usize> = (0..self.workers.len())
            .filter(|&i| {
                let w = &self.workers[i];
                w.role == role && matches!(w.phase, Phase::Starting | Phase::Running)
            })
            .collect();
        let now = self.now();
        if n > members.len() {
            let spare: Vec<usize> = (0..self.workers.len())
                .filter(|&i| self.workers[i].role == role && self.workers[i].phase == Phase::Off)
                .take(n - members.len())
                .collect();
            for i in spare {
                let w = &mut self.workers[i];
                w.phase = Phase::Starting;
                w.on_since = Some(now);
                w.generation += 1;
                let generation = w.generation;
                self.schedule_in(cold_start, Ev::Ready(i, generation));
            }
        } else if n < members.len() {
            let mut excess = members.len() - n;
            let starting: Vec<usize> = members
                .iter()
                .rev()
                .copied()
                .filter(|&i| self.workers[i].phase == Phase::Starting)
                .collect();
            for i in starting.into_iter().take(excess) {
                self.workers[i].phase = Phase::Off;
                self.account(i, now);
                excess -= 1;
            }
            let mut running: Vec<(usize, usize)> = members
                .iter()
                .copied()
                .filter(|&i| self.workers[i].phase == Phase::Running)
                .map(|i| (self.workers[i].core.as_ref().map_or(0, |c| c.num_live()), i))
                .collect();
            running.sort_by_key(|&(live, i)| (live, std::cmp::Reverse(i)));
            for (_, i) in running.into_iter().take(excess) {
                self.workers[i].phase = Phase::Draining;
                match self.workers[i].core.as_mut() {
                    Some(core) => {
                        core.drain();
                        self.mark_worker(i);
                    }
                    // Down after a fault: nothing to finish.
                    None => self.retire(i),
                }
            }
        }
        self.note_peak(role);
    }

    /// Stop counting worker `i`'s cost at `at`.
    pub(super) fn account(&mut self, i: usize, at: Instant) {
        let w = &mut self.workers[i];
        if let Some(t) = w.on_since.take() {
            *self.replica_seconds.entry(w.role).or_default() +=
                at.saturating_duration_since(t).as_secs_f64();
        }
    }

    /// Pool `role`'s replicas as the fleet view shows them.
    fn pool_count(&self, role: Role) -> PoolCount {
        let mut c = PoolCount::new(role);
        for w in self.workers.iter().filter(|w| w.role == role) {
            match w.phase {
                Phase::Off => {}
                // A replica down after a fault is restarting under its supervisor.
                Phase::Running if w.core.is_some() => c.ready += 1,
                Phase::Running | Phase::Starting => c.starting += 1,
                Phase::Draining => c.draining += 1,
            }
        }
        c
    }

    pub(super) fn note_peak(&mut self, role: Role) {
        let c = self.pool_count(role);
        let n = c.ready + c.starting + c.draining;
        match self.out.peak_replicas.iter_mut().find(|(r, _)| *r == role) {
            Some((_, p)) => *p = (*p).max(n),
            None => {
                self.out.peak_replicas.push((role, n));
                self.out.peak_replicas.sort_by_key(|(r, _)| pool_order(*r));
            }
        }
    }
}

/// Pools in the order reports list them.
pub(super) fn pool_order(r: Role) -> u8 {
    match r {
        Role::Aggregated => 0,
        Role::Prefill => 1,
        Role::Decode => 2,
    }
}

/// The workload's true load per planner interval: (requests, prompt tokens, output tokens)
/// of the sessions arriving in it (a session's every turn counted at its arrival).
pub(super) fn oracle_series(
    workload: &dyn SimWorkload,
    offsets: &[f64],
    interval_s: f64,
) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (i, off) in offsets.iter().enumerate().take(workload.sessions()) {
        let k = (off / interval_s).floor().max(0.0) as usize;
        if k > 10_000_000 {
            continue;
        }
        if out.len() <= k {
            out.resize(k + 1, (0, 0, 0));
        }
        for t in 0..workload.turns(i) {
            let turn = workload.turn(i, t);
            out[k].0 += 1;
            out[k].1 += turn.prompt.len() as u64;
            out[k].2 += u64::from(turn.max_tokens);
        }
    }
    out
}

/// The oracle's forecast at `elapsed`: the peak rate and the mean lengths over the interval
/// ahead and the cold start before it.
fn oracle_forecast(
    series: &[(u64, u64, u64)],
    elapsed: Duration,
    interval_s: f64,
    cold_start: Duration,
) -> Forecast {
    let k0 = (elapsed.as_secs_f64() / interval_s + 1e-6).floor() as usize;
    let ahead = (cold_start.as_secs_f64() / interval_s).ceil() as usize;
    let (mut peak, mut n, mut prompt, mut output) = (0u64, 0u64, 0u64, 0u64);
    for &(r, p, o) in series.iter().skip(k0).take(ahead + 1) {
        peak = peak.max(r);
        n += r;
        prompt += p;
        output += o;
    }
    let mean = |x: u64| if n == 0 { 0.0 } else { x as f64 / n as f64 };
    Forecast {
        request_rate: peak as f64 / interval_s,
        prompt_tokens: mean(prompt),
        output_tokens: mean(output),
        cached_tokens: 0.0,
    }
}

/// The replicas each pool of `spec`'s shape needs for the busiest interval of the workload,
/// by the planner's own capacity rule (with its headroom): the size of a static fleet built
/// for the peak.
pub fn static_peak(
    spec: &SimSpec,
    capacity: &CapacityProfile,
    workload: &dyn SimWorkload,
    offsets: &[f64],
) -> Vec<(Role, u32)> {
    let cfg = &spec.config.planner;
    let planner = Planner::new(cfg.clone(), capacity.clone());
    let series = oracle_series(workload, offsets, cfg.interval_s);
    let pools = [
        (Role::Aggregated, spec.workers),
        (Role::Prefill, spec.prefill),
        (Role::Decode, spec.decode),
    ];
    pools
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|&(role, _)| {
            let need = series
                .iter()
                .map(|&(r, p, o)| {
                    let f = Forecast {
                        request_rate: r as f64 / cfg.interval_s,
                        prompt_tokens: if r > 0 { p as f64 / r as f64 } else { 0.0 },
                        output_tokens: if r > 0 { o as f64 / r as f64 } else { 0.0 },
                        cached_tokens: 0.0,
                    };
                    planner.replicas_for(role, &f, 0.0).1
                })
                .fold(0.0f64, f64::max);
            let b = cfg.bounds(role);
            (
                role,
                ((need - 1e-9).ceil().max(1.0) as u32).clamp(b.min.max(1), b.max),
            )
        })
        .collect()
}
