//! Forecasts of the next interval's value of one signal (request rate, prompt length, output
//! length) from the values seen so far, one per planner interval.
//!
//! - **moving average** of the last `window` values: steady, slow to follow a ramp;
//! - **Holt's linear trend** (double exponential smoothing; Holt 1957): a level and a trend,
//!   smoothed by `alpha` and `beta`, forecast `level + trend`; initialised from the first two
//!   values, so a straight line is forecast exactly from the third value on;
//! - **seasonal naive**: the value one season ago (`season` intervals: a daily cycle is 8,640
//!   intervals of 10 s), the last value until a whole season is seen.
//!
//! No forecast is below zero.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Which forecast the planner uses (`planner.forecast`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ForecastKind {
    /// Mean of the last `planner.window_intervals` values.
    MovingAverage,
    /// Holt's linear trend with `planner.holt_alpha` and `planner.holt_beta`.
    #[default]
    Holt,
    /// The value `planner.season_intervals` intervals ago.
    SeasonalNaive,
}

/// The settings of a forecast.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForecastSettings {
    pub kind: ForecastKind,
    /// Moving average: values averaged (≥ 1).
    pub window: usize,
    /// Holt: level smoothing in (0, 1].
    pub alpha: f64,
    /// Holt: trend smoothing in [0, 1].
    pub beta: f64,
    /// Seasonal naive: intervals per season (≥ 1).
    pub season: usize,
}

/// One signal's forecaster.
#[derive(Clone, Debug)]
pub struct Forecaster {
    settings: ForecastSettings,
    /// The values kept: the last `window` (moving average) or `season` (seasonal naive).
    history: VecDeque<f64>,
    /// Holt's level and trend, once two values were seen.
    holt: Option<(f64, f64)>,
    last: Option<f64>,
}

impl Forecaster {
    /// An empty forecaster.
    pub fn new(settings: ForecastSettings) -> Self {
        Self {
            settings,
            history: VecDeque::new(),
            holt: None,
            last: None,
        }
    }

    /// The value of the interval that just ended (non-finite values are ignored).
    pub fn observe(&mut self, x: f64) {
        if !x.is_finite() {
            return;
        }
        let s = self.settings;
        match s.kind {
            ForecastKind::MovingAverage => {
                self.history.push_back(x);
                while self.history.len() > s.window.max(1) {
                    self.history.pop_front();
                }
            }
            ForecastKind::SeasonalNaive => {
                self.history.push_back(x);
                while self.history.len() > s.season.max(1) {
                    self.history.pop_front();
                }
            }
            ForecastKind::Holt => {
                self.holt = match (self.holt, self.last) {
                    (Some((level, trend)), _) => {
                        let l = s.alpha * x + (1.0 - s.alpha) * (level + trend);
                        let t = s.beta * (l - level) + (1.0 - s.beta) * trend;
                        Some((l, t))
                    }
                    (None, Some(prev)) => Some((x, x - prev)),
                    (None, None) => None,
                };
            }
        }
        self.last = Some(x);
    }

    /// The forecast of the next interval's value; `None` before any value was seen.
    pub fn forecast(&self) -> Option<f64> {
        let s = self.settings;
        let f = match s.kind {
            ForecastKind::MovingAverage => {
                if self.history.is_empty() {
                    return None;
                }
                self.history.iter().sum::<f64>() / self.history.len() as f64
            }
            ForecastKind::SeasonalNaive => {
                if self.history.len() >= s.season.max(1) {
                    // The value one season before the next interval.
                    *self.history.front()?
                } else {
                    self.last?
                }
            }
            ForecastKind::Holt => match self.holt {
                Some((level, trend)) => level + trend,
                None => self.last?,
            },
        };
        Some(f.max(0.0))
    }

    /// The last value seen.
    pub fn last(&self) -> Option<f64> {
        self.last
    }
}
