//! The planner's decision: from one interval's signals to each pool's desired replica count,
//! with its reason. Pure: the caller passes the time and carries out what it decides.

use super::capacity::CapacityProfile;
use super::forecast::{ForecastSettings, Forecaster};
use super::signals::FleetSignals;
use super::{ManualPolicy, PlannerConfig, PlannerMode};
use crate::runtime::role::Role;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// What the planner expects of the next interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Forecast {
    /// Requests/s.
    pub request_rate: f64,
    /// Mean prompt length (tokens).
    pub prompt_tokens: f64,
    /// Mean output length (tokens).
    pub output_tokens: f64,
    /// Mean prompt tokens served from the prefix cache.
    pub cached_tokens: f64,
}

/// What the planner does to a pool this interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Hold,
    Up,
    Down,
}

/// One pool's decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolDecision {
    /// The pool.
    pub role: Role,
    /// Replicas it has (ready and starting).
    pub actual: u32,
    /// Replicas it should have.
    pub desired: u32,
    /// `desired` against `actual`.
    pub action: Action,
    /// Replicas the forecast load needs, before hysteresis (within the pool's bounds).
    pub needed: u32,
    /// Forecast load (tokens/s: prompt tokens to prefill and output tokens to decode).
    pub load_tokens_per_s: f64,
    /// The factor the observed latencies put on the load (1: the capacity curves hold).
    pub correction: f64,
    /// Why, in words.
    pub reason: String,
}

/// One interval's decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// `act` or `advisory` (advisory changes nothing).
    pub mode: PlannerMode,
    /// The signals were older than two intervals: every pool holds.
    pub stale: bool,
    /// Age of the signals when planned (ms).
    pub signals_age_ms: u64,
    /// The forecast planned for (`None` when stale).
    pub forecast: Option<Forecast>,
    /// Per pool.
    pub pools: Vec<PoolDecision>,
    /// Changes made outside the planner that it noticed this interval.
    pub manual: Vec<String>,
    /// Cost of the desired fleet ($/hour, from each pool's `dollars_per_hour`).
    pub cost_per_hour: f64,
    /// The leader's term when it was made (its fencing token; 0 for a planner that stands for
    /// no lease, and in `flotilla sim`).
    #[serde(default)]
    pub term: u64,
}

impl Decision {
    /// Pool `role`'s decision, if the fleet has that pool.
    pub fn pool(&self, role: Role) -> Option<&PoolDecision> {
        self.pools.iter().find(|p| p.role == role)
    }
}

#[derive(Clone, Copy, Debug)]
struct Pin {
    count: u32,
    until_ms: u64,
}

#[derive(Clone, Debug)]
struct PoolState {
    role: Role,
    /// The count the planner last asked for (act mode).
    expected: Option<u32>,
    last_change_ms: Option<u64>,
    calm: u32,
    recent: VecDeque<u32>,
    pin: Option<Pin>,
    correction: f64,
    /// Until when the view may still lag the last change (replicas starting, or draining
    /// ones still listed).
    pending_until_ms: Option<u64>,
    /// The last change (`Up` or `Down`).
    last_action: Action,
}

/// Largest factor observed latencies may put on the forecast load.
pub const MAX_CORRECTION: f64 = 2.0;

/// The planner's policy (see the module doc of [`crate::control::planner`]).
#[derive(Clone, Debug)]
pub struct Planner {
    cfg: PlannerConfig,
    capacity: CapacityProfile,
    rate: Forecaster,
    prompt: Forecaster,
    output: Forecaster,
    cached: Forecaster,
    pools: Vec<PoolState>,
    idle_since_ms: Option<u64>,
    last: Option<Decision>,
}

impl Planner {
    /// A planner with `cfg` (validated) and a replica's `capacity`.
    pub fn new(cfg: PlannerConfig, capacity: CapacityProfile) -> Self {
        let f = ForecastSettings {
            kind: cfg.forecast,
            window: cfg.window_intervals,
            alpha: cfg.holt_alpha,
            beta: cfg.holt_beta,
            season: cfg.season_intervals,
        };
        // Lengths move slowly and are noisy: a moving average over the same window.
        let lengths = ForecastSettings {
            kind: super::forecast::ForecastKind::MovingAverage,
            ..f
        };
        Self {
            rate: Forecaster::new(f),
            prompt: Forecaster::new(lengths),
            output: Forecaster::new(lengths),
            cached: Forecaster::new(lengths),
            cfg,
            capacity,
            pools: Vec::new(),
            idle_since_ms: None,
            last: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.cfg
    }

    /// The capacity curves.
    pub fn capacity(&self) -> &CapacityProfile {
        &self.capacity
    }

    /// The last decision.
    pub fn last(&self) -> Option<&Decision> {
        self.last.as_ref()
    }

    fn interval_ms(&self) -> u64 {
        (self.cfg.interval_s * 1000.0) as u64
    }

    fn state(&mut self, role: Role) -> &mut PoolState {
        if let Some(i) = self.pools.iter().position(|p| p.role == role) {
            return &mut self.pools[i];
        }
        self.pools.push(PoolState {
            role,
            expected: None,
            last_change_ms: None,
            calm: 0,
            recent: VecDeque::new(),
            pin: None,
            correction: 1.0,
            pending_until_ms: None,
            last_action: Action::Hold,
        });
        let last = self.pools.len() - 1;
        &mut self.pools[last]
    }

    /// Plan one interval at `now_ms` from `signals`. `oracle`, when given, replaces the
    /// forecast (the simulator's perfect-knowledge baseline).
    pub fn plan(
        &mut self,
        signals: &FleetSignals,
        now_ms: u64,
        oracle: Option<Forecast>,
    ) -> Decision {
        let age = now_ms.saturating_sub(signals.at_ms);
        let decision = if age > 2 * self.interval_ms() {
            self.hold_stale(signals, now_ms, age)
        } else {
            self.decide(signals, now_ms, age, oracle)
        };
        self.last = Some(decision.clone());
        decision
    }

    fn hold_stale(&mut self, signals: &FleetSignals, now_ms: u64, age: u64) -> Decision {
        let mode = self.cfg.mode;
        let mut pools = Vec::new();
        for p in &signals.pools {
            let actual = p.size();
            let st = self.state(p.role);
            let desired = st.expected.unwrap_or(actual);
            pools.push(PoolDecision {
                role: p.role,
                actual,
                desired,
                action: Action::Hold,
                needed: desired,
                load_tokens_per_s: 0.0,
                correction: st.correction,
                reason: format!(
                    "signals are {age} ms old (over two intervals): holding the last decision"
                ),
            });
        }
        let cost_per_hour = self.cost(&pools);
        Decision {
            at_ms: now_ms,
            mode,
            stale: true,
            signals_age_ms: age,
            forecast: None,
            pools,
            manual: Vec::new(),
            cost_per_hour,
            term: 0,
        }
    }

    fn cost(&self, pools: &[PoolDecision]) -> f64 {
        pools
            .iter()
            .map(|p| f64::from(p.desired) * self.cfg.bounds(p.role).dollars_per_hour)
            .sum()
    }

    fn decide(
        &mut self,
        s: &FleetSignals,
        now_ms: u64,
        age: u64,
        oracle: Option<Forecast>,
    ) -> Decision {
        self.rate.observe(s.request_rate);
        if s.arrivals > 0 {
            self.prompt.observe(s.prompt_tokens);
        }
        if s.completed > 0 {
            self.output.observe(s.output_tokens);
            self.cached.observe(s.cached_tokens);
        }
        let forecast = oracle.unwrap_or(Forecast {
            request_rate: self.rate.forecast().unwrap_or(0.0),
            prompt_tokens: self.prompt.forecast().unwrap_or(0.0),
            output_tokens: self.output.forecast().unwrap_or(0.0),
            cached_tokens: self.cached.forecast().unwrap_or(0.0),
        });
        let idle =
            s.arrivals == 0 && s.shed == 0 && s.in_flight == 0 && s.waiting_for_capacity == 0;
        if idle {
            self.idle_since_ms.get_or_insert(s.at_ms);
        } else {
            self.idle_since_ms = None;
        }
        let idle_for_s = self
            .idle_since_ms
            .map_or(0.0, |t| now_ms.saturating_sub(t) as f64 / 1000.0);
        let to_zero = idle && idle_for_s >= self.cfg.idle_to_zero_s;
        // Work that must be served in the next interval: the forecast arrivals and the
        // requests already waiting.
        let backlog = (s.waiting + s.waiting_for_capacity) as f64 / self.cfg.interval_s;
        let ttft_ratio = s.ttft_p99_ms.map(|t| t / self.cfg.ttft_target_ms);
        let itl_ratio = s.itl_p99_ms.map(|t| t / self.cfg.itl_target_ms);

        let mode = self.cfg.mode;
        let cfg = self.cfg.clone();
        let mut pools = Vec::new();
        let mut manual = Vec::new();
        for p in &s.pools {
            let bounds = cfg.bounds(p.role);
            let mut actual = p.size();
            let (load, units) = self.replicas_for(p.role, &forecast, backlog);
            let latency = match p.role {
                Role::Aggregated => max_opt(ttft_ratio, itl_ratio),
                Role::Prefill => ttft_ratio,
                Role::Decode => itl_ratio,
            };
            let st = self.state(p.role);
            // Feedback: latencies over target raise the load the curves are read at.
            match latency {
                Some(r) if r > 1.0 => {
                    st.correction = (st.correction * r.min(1.5)).min(MAX_CORRECTION);
                }
                Some(r) if r < 0.8 => st.correction = (st.correction * 0.95).max(1.0),
                _ => {}
            }
            let missing = latency.is_some_and(|r| r > 1.0);
            let mut needed = (units * st.correction - 1e-9).ceil().max(0.0) as u32;
            let mut why = format!(
                "forecast {:.2} req/s × {:.0} prompt ({:.0} cached) / {:.0} output tokens: \
                 {:.0} tokens/s, {:.2} replicas at {:.2}× correction",
                forecast.request_rate,
                forecast.prompt_tokens,
                forecast.cached_tokens,
                forecast.output_tokens,
                load,
                units * st.correction,
                st.correction
            );
            if to_zero {
                needed = 0;
                why = if bounds.min == 0 {
                    format!("idle for {idle_for_s:.0} s: to zero")
                } else {
                    format!(
                        "idle for {idle_for_s:.0} s: to the pool's min {}",
                        bounds.min
                    )
                };
            } else if needed == 0 {
                // A pool goes to zero only when the fleet was idle for `idle_to_zero_s`.
                needed = 1;
            }
            needed = needed.clamp(bounds.min, bounds.max);
            // The view lags a change: replicas asked for join it only once started (process,
            // weights), drained ones leave it only once gone. Until `start_timeout_s` after
            // the change, a count behind it in the change's direction is the change in
            // progress; past it, the replicas that did not start are reported and not capacity.
            if st.expected == Some(actual) {
                // The view caught up: the change is done.
                st.pending_until_ms = None;
            }
            if mode == PlannerMode::Act
                && let Some(exp) = st.expected
                && actual != exp
            {
                let pending = st.pending_until_ms.is_some_and(|t| now_ms < t);
                match (st.last_action, actual < exp, pending) {
                    (Action::Up, true, true) => {
                        why.push_str(&format!(
                            "; {} asked for, not in the view yet (starting)",
                            exp - actual
                        ));
                        actual = exp;
                    }
                    (Action::Down, false, true) => {
                        why.push_str(&format!("; {} draining, still in the view", actual - exp));
                        actual = exp;
                    }
                    (Action::Up, true, false) if st.pending_until_ms.is_some() => {
                        st.pending_until_ms = None;
                        manual.push(format!(
                            "{} {} replica(s) asked for did not start within {} s: not counted",
                            exp - actual,
                            p.role.as_str(),
                            cfg.start_timeout_s
                        ));
                        st.expected = Some(actual);
                    }
                    _ => {}
                }
            }
            // Manual changes: the count moved without the planner asking.
            if mode == PlannerMode::Act
                && let Some(exp) = st.expected
                && exp != actual
            {
                // A pool that shrank may have lost a replica to a failure as well as to a
                // hand: never pinned there, its lost capacity is replaced.
                match (cfg.manual, actual > exp) {
                    (_, false) => manual.push(format!(
                        "{} pool went from {exp} to {actual} outside the planner (a replica \
                         failed or was drained by hand): planning goes on from {actual}",
                        p.role.as_str()
                    )),
                    (ManualPolicy::Adopt, true) => {
                        st.pin = Some(Pin {
                            count: actual,
                            until_ms: now_ms + (cfg.adopt_s * 1000.0) as u64,
                        });
                        manual.push(format!(
                            "{} pool went from {exp} to {actual} outside the planner: adopted \
                             as its floor for {} s",
                            p.role.as_str(),
                            cfg.adopt_s
                        ));
                    }
                    (ManualPolicy::Report, true) => manual.push(format!(
                        "{} pool went from {exp} to {actual} outside the planner (reported; \
                         planning goes on from {actual})",
                        p.role.as_str()
                    )),
                }
                st.expected = Some(actual);
                st.last_change_ms = Some(now_ms);
                st.calm = 0;
            }
            if let Some(pin) = st.pin {
                if now_ms >= pin.until_ms {
                    st.pin = None;
                } else if needed < pin.count {
                    needed = pin.count;
                    why.push_str(&format!("; held at the adopted floor {}", pin.count));
                }
            }
            st.recent.push_back(needed);
            while st.recent.len() > cfg.scale_down_intervals.max(1) as usize {
                st.recent.pop_front();
            }
            let cooled = st
                .last_change_ms
                .is_none_or(|t| now_ms.saturating_sub(t) as f64 >= cfg.cooldown_s * 1000.0);
            let (desired, action) = if needed > actual {
                st.calm = 0;
                (needed, Action::Up)
            } else if needed < actual && to_zero {
                st.calm = 0;
                (needed, Action::Down)
            } else if needed < actual {
                if missing {
                    st.calm = 0;
                    why.push_str("; latency over target: not scaling down");
                    (actual, Action::Hold)
                } else {
                    st.calm += 1;
                    if st.calm >= cfg.scale_down_intervals && cooled {
                        st.calm = 0;
                        // Down to the most any of the calm intervals needed.
                        let floor = st.recent.iter().copied().max().unwrap_or(needed);
                        (floor.max(needed).min(actual), Action::Down)
                    } else {
                        if st.calm < cfg.scale_down_intervals {
                            why.push_str(&format!(
                                "; calm {} of {} intervals",
                                st.calm, cfg.scale_down_intervals
                            ));
                        } else {
                            why.push_str(&format!(
                                "; calm, cooling down ({} s since the last change)",
                                st.last_change_ms
                                    .map_or(0, |t| now_ms.saturating_sub(t) / 1000)
                            ));
                        }
                        (actual, Action::Hold)
                    }
                }
            } else {
                st.calm = 0;
                (actual, Action::Hold)
            };
            let action = if desired == actual {
                Action::Hold
            } else {
                action
            };
            if action != Action::Hold {
                st.last_change_ms = Some(now_ms);
            }
            if action != Action::Hold {
                st.pending_until_ms = Some(now_ms + (cfg.start_timeout_s * 1000.0) as u64);
                st.last_action = action;
            }
            if mode == PlannerMode::Act {
                st.expected = Some(desired);
            }
            pools.push(PoolDecision {
                role: p.role,
                actual,
                desired,
                action,
                needed,
                load_tokens_per_s: load,
                correction: st.correction,
                reason: why,
            });
        }
        let cost_per_hour = self.cost(&pools);
        Decision {
            at_ms: now_ms,
            mode,
            stale: false,
            signals_age_ms: age,
            forecast: Some(forecast),
            pools,
            manual,
            cost_per_hour,
            term: 0,
        }
    }

    /// The load pool `role` carries under `forecast` (tokens/s) and the replicas it needs
    /// for it by the capacity curves (fractional, before correction and bounds): the
    /// forecast rate with `planner.headroom`, plus `backlog` requests/s to clear.
    pub fn replicas_for(&self, role: Role, forecast: &Forecast, backlog: f64) -> (f64, f64) {
        let rate = forecast.request_rate * (1.0 + self.cfg.headroom) + backlog;
        let uncached = (forecast.prompt_tokens - forecast.cached_tokens).max(0.0);
        let prefill_load = rate * uncached;
        let decode_load = rate * forecast.output_tokens;
        let prefill_cap = self.capacity.prefill_tokens_per_s(forecast.prompt_tokens);
        let decode_cap = self
            .capacity
            .decode_tokens_per_s(forecast.prompt_tokens + forecast.output_tokens / 2.0);
        match role {
            Role::Aggregated => (
                prefill_load + decode_load,
                ratio(prefill_load, prefill_cap) + ratio(decode_load, decode_cap),
            ),
            Role::Prefill => (prefill_load, ratio(prefill_load, prefill_cap)),
            Role::Decode => (decode_load, ratio(decode_load, decode_cap)),
        }
    }

    /// A pool's count moved because the planner's own reconciler could not follow (a replica
    /// failed to start): the planner expects `count` from now on, without calling it manual.
    pub fn reconciled(&mut self, role: Role, count: u32) {
        self.state(role).expected = Some(count);
    }
}

fn ratio(load: f64, cap: f64) -> f64 {
    if load <= 0.0 {
        0.0
    } else if cap > 0.0 {
        load / cap
    } else {
        f64::INFINITY
    }
}

fn max_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, None) => x,
        (None, y) => y,
    }
}
