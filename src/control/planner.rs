//! The planner, pure: it sizes the prefill and decode pools (or the one aggregated pool) to
//! hold the TTFT and ITL targets at the least cost.
//!
//! Every `planner.interval_s` the driver hands [`Planner::plan`] the fleet's signals of the
//! interval that ended ([`FleetSignals`]: request rate, prompt and output lengths, TTFT and ITL
//! p99, requests waiting, each pool's replicas — read from the published fleet view, never by
//! asking every actor) and the time. The planner
//! 1. **forecasts** the next interval's request rate ([`forecast`]: moving average, Holt's
//!    linear trend or seasonal naive, `planner.forecast`) and mean prompt, cached and output
//!    lengths (moving averages);
//! 2. turns the forecast into **load** — prompt tokens/s to prefill (less the cached ones) and
//!    output tokens/s to decode, with `planner.headroom` on the rate and the waiting requests
//!    to clear within one interval — and reads one replica's **capacity** at those lengths
//!    from the profile's curves ([`capacity`]); a pool needs `load ÷ capacity` replicas
//!    (an aggregated replica serves both, so it needs the sum of the two fractions), times a
//!    **correction** the observed p99s raise when they miss their target (×≤1.5 a miss, at
//!    most ×2, easing back by 5 % an interval once they are under 80 % of it);
//! 3. applies **hysteresis**: scale-up at once; scale-down only after
//!    `planner.scale_down_intervals` calm intervals in a row, never within `planner.cooldown_s`
//!    of the last change, never while a p99 misses its target, and only to the most any of
//!    the calm intervals needed; every count within the pool's `min`/`max`;
//! 4. goes to **zero** (pools with `min = 0`) only after the fleet saw no request for
//!    `planner.idle_to_zero_s`, and back to one as soon as a request waits;
//! 5. notices **manual changes** (a pool's count moved without the planner asking): a pool
//!    that grew is, with `planner.manual = adopt`, held at that floor for `planner.adopt_s`
//!    (with `report` it is only recorded); a pool that shrank is recorded and planning goes
//!    on from it — a replica may have failed, so lost capacity is replaced, never pinned
//!    away. Never a tug-of-war;
//! 6. counts replicas it asked for as **starting** until they appear in the view (at most
//!    `planner.start_timeout_s`; past it they failed to start, are reported, and are not
//!    capacity);
//! 7. **holds** when the signals are older than two intervals (a missing view must not look
//!    like an idle fleet), and says so.
//!
//! Each [`Decision`] carries its signals' age, the forecast, and per pool the actual and
//! desired counts, the load, the correction and the reason in words, and the desired fleet's
//! cost (`dollars_per_hour` per pool: by default 1, so costs read in replica-hours).
//! `planner.mode = advisory` computes and publishes decisions; the driver changes nothing.

pub mod capacity;
pub mod forecast;
pub mod policy;
pub mod signals;
#[cfg(test)]
mod tests;

pub use capacity::{CapacityPoint, CapacityProfile, StepModel};
pub use forecast::{ForecastKind, Forecaster};
pub use policy::{Action, Decision, Forecast, Planner, PoolDecision};
pub use signals::{FleetSignals, PoolCount, ViewReader};

use crate::runtime::config::ConfigError;
use crate::runtime::role::Role;
use serde::{Deserialize, Serialize};

/// `planner.mode`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum PlannerMode {
    /// Carry out the decisions.
    #[default]
    Act,
    /// Compute and publish decisions, change nothing.
    Advisory,
}

/// `planner.manual`: what a count changed outside the planner becomes.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ManualPolicy {
    /// A grown count is the pool's floor for `planner.adopt_s` (a shrunk one is reported:
    /// it may be a failure).
    #[default]
    Adopt,
    /// Record it; plan on from the new count.
    Report,
}

/// One pool's bounds and price.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PoolBounds {
    /// Fewest replicas (0: the pool may scale to zero).
    #[schemars(extend("x-unit" = "replicas"))]
    pub min: u32,
    /// Most replicas.
    #[schemars(extend("x-unit" = "replicas"))]
    pub max: u32,
    /// Price of one replica for an hour (any currency; default 1, so costs read in
    /// replica-hours).
    pub dollars_per_hour: f64,
}

impl Default for PoolBounds {
    fn default() -> Self {
        Self {
            min: 1,
            max: 64,
            dollars_per_hour: 1.0,
        }
    }
}

/// The `[planner]` section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct PlannerConfig {
    /// `act` or `advisory`.
    pub mode: PlannerMode,
    /// Seconds between decisions (10: the interval NVIDIA Dynamo's planner simulations found
    /// best).
    pub interval_s: f64,
    /// TTFT p99 target (ms; 500, the design's default).
    pub ttft_target_ms: f64,
    /// ITL p99 target (ms; 50, the design's default).
    pub itl_target_ms: f64,
    /// The request-rate forecast.
    pub forecast: ForecastKind,
    /// Intervals a moving average covers (also the lengths' average).
    pub window_intervals: usize,
    /// Holt's level smoothing, in (0, 1].
    pub holt_alpha: f64,
    /// Holt's trend smoothing, in [0, 1].
    pub holt_beta: f64,
    /// Seasonal naive: intervals per season (360: one hour of 10 s intervals).
    pub season_intervals: usize,
    /// Margin on the forecast rate (0.1: plan for 10 % more).
    #[schemars(extend("x-unit" = "fraction"))]
    pub headroom: f64,
    /// Calm intervals in a row before a scale-down.
    pub scale_down_intervals: u32,
    /// No scale-down within this many seconds of the last change.
    pub cooldown_s: f64,
    /// A fleet idle this long lets pools with `min = 0` go to zero (s).
    pub idle_to_zero_s: f64,
    /// What a count changed outside the planner becomes.
    pub manual: ManualPolicy,
    /// How long an adopted manual count binds (s).
    pub adopt_s: f64,
    /// How long a replica asked for may take to appear in the fleet view (process start,
    /// weight load) before it counts as failed to start (s).
    pub start_timeout_s: f64,
    /// The capacity curves (JSON, see [`CapacityProfile`]); unset: derived from the sim
    /// engine's profile (`worker.sim_profile` or the built-in one).
    pub capacity_profile: Option<std::path::PathBuf>,
    /// The pools the planner sizes from its start, before any of their workers is in the
    /// fleet view — a fleet deployed at zero (`["aggregated"]`, or `["prefill", "decode"]`).
    /// Empty: the pools it sees (a pool once seen stays sized, down to zero).
    pub pools: Vec<Role>,
    /// The aggregated pool.
    pub aggregated: PoolBounds,
    /// The prefill pool.
    pub prefill: PoolBounds,
    /// The decode pool.
    pub decode: PoolBounds,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            mode: PlannerMode::Act,
            interval_s: 10.0,
            ttft_target_ms: 500.0,
            itl_target_ms: 50.0,
            forecast: ForecastKind::Holt,
            window_intervals: 6,
            holt_alpha: 0.5,
            holt_beta: 0.2,
            season_intervals: 360,
            headroom: 0.1,
            scale_down_intervals: 6,
            cooldown_s: 60.0,
            idle_to_zero_s: 300.0,
            manual: ManualPolicy::Adopt,
            adopt_s: 600.0,
            start_timeout_s: 300.0,
            capacity_profile: None,
            pools: Vec::new(),
            aggregated: PoolBounds::default(),
            prefill: PoolBounds::default(),
            decode: PoolBounds::default(),
        }
    }
}

impl PlannerConfig {
    /// Pool `role`'s bounds.
    pub fn bounds(&self, role: Role) -> PoolBounds {
        match role {
            Role::Aggregated => self.aggregated,
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
        }
    }

    /// Check ranges.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`]: the first field out of range, named (`planner.<field>`),
    /// and why.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |f: &str, m: &str| Err(ConfigError::invalid(format!("planner.{f}"), m));
        let secs = [
            ("interval_s", self.interval_s),
            ("cooldown_s", self.cooldown_s),
            ("idle_to_zero_s", self.idle_to_zero_s),
            ("adopt_s", self.adopt_s),
            ("start_timeout_s", self.start_timeout_s),
        ];
        for (f, v) in secs {
            if !(v.is_finite() && (0.0..=1e7).contains(&v)) {
                return bad(f, "must be a number of seconds in 0..=1e7");
            }
        }
        if self.interval_s < 0.1 {
            return bad("interval_s", "must be at least 0.1 s");
        }
        for (f, v) in [
            ("ttft_target_ms", self.ttft_target_ms),
            ("itl_target_ms", self.itl_target_ms),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(f, "must be a number of milliseconds > 0");
            }
        }
        if self.window_intervals == 0 {
            return bad("window_intervals", "must be at least 1");
        }
        if self.season_intervals == 0 {
            return bad("season_intervals", "must be at least 1");
        }
        if !(self.holt_alpha > 0.0 && self.holt_alpha <= 1.0) {
            return bad("holt_alpha", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.holt_beta) {
            return bad("holt_beta", "must be in [0, 1]");
        }
        if !(self.headroom.is_finite() && (0.0..=10.0).contains(&self.headroom)) {
            return bad("headroom", "must be in 0..=10");
        }
        if self.scale_down_intervals == 0 {
            return bad("scale_down_intervals", "must be at least 1");
        }
        for (name, b) in [
            ("aggregated", self.aggregated),
            ("prefill", self.prefill),
            ("decode", self.decode),
        ] {
            if b.max == 0 {
                return Err(ConfigError::invalid(
                    format!("planner.{name}.max"),
                    "must be at least 1",
                ));
            }
            if b.min > b.max {
                return Err(ConfigError::invalid(
                    format!("planner.{name}.min"),
                    format!("must not exceed planner.{name}.max ({} > {})", b.min, b.max),
                ));
            }
            if !(b.dollars_per_hour.is_finite() && b.dollars_per_hour >= 0.0) {
                return Err(ConfigError::invalid(
                    format!("planner.{name}.dollars_per_hour"),
                    "must be a number ≥ 0",
                ));
            }
        }
        if let Some(p) = &self.capacity_profile
            && !p.is_file()
        {
            return bad(
                "capacity_profile",
                &format!("no such file: {}", p.display()),
            );
        }
        Ok(())
    }
}

/// What a planner node publishes in its heartbeat (and `/v1/fleet` shows).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerView {
    /// `act` or `advisory`.
    pub mode: PlannerMode,
    /// Seconds between decisions.
    pub interval_s: f64,
    /// Where the capacity curves come from.
    pub capacity: String,
    /// The latest decisions, oldest first (at most [`PlannerView::KEEP`]).
    pub decisions: Vec<Decision>,
    /// Whether this planner leads, and in which term (`control/leadership.rs`); reconcilers
    /// apply only a leader's decisions. `None`: a planner that stands for no lease (read as
    /// leading in term 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leadership: Option<crate::control::leadership::Standing>,
}

impl PlannerView {
    /// Decisions kept in the view.
    pub const KEEP: usize = 6;

    /// The latest decision.
    pub fn latest(&self) -> Option<&Decision> {
        self.decisions.last()
    }

    /// The term it leads in, if it leads (a planner without a lease: term 0).
    pub fn leading_term(&self) -> Option<u64> {
        match &self.leadership {
            None => Some(0),
            Some(s) if s.leads() => Some(s.term()),
            Some(_) => None,
        }
    }
}

/// Where a node's planner publishes its view for the node's heartbeat (empty on a node
/// without one).
#[derive(Clone, Debug, Default)]
pub struct PlannerBoard(std::sync::Arc<std::sync::Mutex<Option<PlannerView>>>);

impl PlannerBoard {
    /// Publish the planner's view.
    pub fn publish(&self, view: PlannerView) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(view);
    }

    /// The view last published.
    pub fn latest(&self) -> Option<PlannerView> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Cost per million output tokens served within the SLO: the fleet's cost over a run
/// (`replica_seconds` per pool at its price) ÷ (`tokens_in_slo` ÷ 10⁶). `None` when no token
/// was served within the SLO.
pub fn cost_per_million_in_slo(
    cfg: &PlannerConfig,
    replica_seconds: &[(Role, f64)],
    tokens_in_slo: u64,
) -> Option<f64> {
    if tokens_in_slo == 0 {
        return None;
    }
    let dollars: f64 = replica_seconds
        .iter()
        .map(|(role, s)| s / 3600.0 * cfg.bounds(*role).dollars_per_hour)
        .sum();
    Some(dollars / (tokens_in_slo as f64 / 1e6))
}
