//! `flotilla sim`'s fault flags: the faults at given times (`--kill`, `--hang`, `--slow`,
//! `--drop-kv-events`) and the rates faults are drawn at (`--kill-rate`, `--hang-rate`,
//! `--slow-rate`, `--drop-kv-events-rate`), parsed and checked with the flag named.

use std::time::Duration;

use anyhow::{Context, bail, ensure};

use crate::sim::world::{MAX_SIM_S, sim_time};
use crate::sim::{FaultRates, SimFault};

use super::SimArgs;

/// `--kill`, `--hang`, `--slow` and `--drop-kv-events`.
///
/// # Errors
/// A malformed value, named.
pub fn parse_faults(a: &SimArgs) -> anyhow::Result<Vec<SimFault>> {
    let secs = |flag: &str, v: &str| -> anyhow::Result<Duration> {
        let s: f64 = v
            .trim()
            .parse()
            .with_context(|| format!("{flag}: {v:?} is not a number of seconds"))?;
        sim_time(s).with_context(|| {
            format!("{flag}: {v:?} must be a finite number of seconds from 0 to {MAX_SIM_S:e}")
        })
    };
    // `FROM_S-UNTIL_S`; the separator is the first '-' after the first character (so that a
    // negative FROM_S is reported as such).
    let window = |flag: &str, w: &str| -> anyhow::Result<(Duration, Duration)> {
        let (from, until) = w
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == '-')
            .map(|(i, _)| (&w[..i], &w[i + 1..]))
            .with_context(|| format!("{flag} {w}: expected FROM_S-UNTIL_S"))?;
        let (from, until) = (secs(flag, from)?, secs(flag, until)?);
        ensure!(from < until, "{flag} {w}: the window ends before it starts");
        Ok((from, until))
    };
    let index = |flag: &str, all: &str, v: &str| -> anyhow::Result<usize> {
        v.trim()
            .parse()
            .with_context(|| format!("{flag} {all}: {v:?} is not a worker index"))
    };
    let mut out = Vec::new();
    for k in &a.kill {
        let (at, worker) = k
            .split_once(':')
            .with_context(|| format!("--kill {k}: expected AT_S:WORKER, e.g. 5:0"))?;
        out.push(SimFault::Kill {
            at: secs("--kill", at)?,
            worker: index("--kill", k, worker)?,
        });
    }
    for h in &a.hang {
        let (w, worker) = h
            .split_once(':')
            .with_context(|| format!("--hang {h}: expected FROM_S-UNTIL_S:WORKER, e.g. 5-40:0"))?;
        let (from, until) = window("--hang", w)?;
        out.push(SimFault::Hang {
            from,
            until,
            worker: index("--hang", h, worker)?,
        });
    }
    for sl in &a.slow {
        let parts: Vec<&str> = sl.split(':').collect();
        let [w, worker, delay] = parts[..] else {
            bail!("--slow {sl}: expected FROM_S-UNTIL_S:WORKER:DELAY_MS, e.g. 5-20:0:50");
        };
        let (from, until) = window("--slow", w)?;
        let ms: f64 = delay
            .trim()
            .parse()
            .with_context(|| format!("--slow {sl}: {delay:?} is not a number of ms"))?;
        let delay = sim_time(ms / 1000.0)
            .with_context(|| format!("--slow {sl}: the delay must be a finite number of ms ≥ 0"))?;
        out.push(SimFault::Slow {
            from,
            until,
            worker: index("--slow", sl, worker)?,
            delay,
        });
    }
    if let Some(d) = &a.drop_kv_events {
        let (from, until) = window("--drop-kv-events", d)?;
        out.push(SimFault::DropKvEvents { from, until });
    }
    Ok(out)
}

/// `--kill-rate`, `--hang-rate`, `--slow-rate` and `--drop-kv-events-rate`.
///
/// # Errors
/// A malformed value, named.
pub fn parse_rates(a: &SimArgs) -> anyhow::Result<FaultRates> {
    let rate = |flag: &str, v: &str| -> anyhow::Result<f64> {
        let r: f64 = v
            .trim()
            .parse()
            .with_context(|| format!("{flag}: {v:?} is not a rate"))?;
        ensure!(
            r.is_finite() && r >= 0.0,
            "{flag}: {v:?} must be a finite rate ≥ 0"
        );
        Ok(r)
    };
    let span = |flag: &str, v: &str, unit_s: f64| -> anyhow::Result<Duration> {
        let x: f64 = v
            .trim()
            .parse()
            .with_context(|| format!("{flag}: {v:?} is not a number"))?;
        sim_time(x * unit_s).with_context(|| format!("{flag}: {v:?} is out of range"))
    };
    let window = |flag: &str, v: &str| -> anyhow::Result<(f64, Duration)> {
        let (r, d) = v
            .split_once(':')
            .with_context(|| format!("{flag} {v}: expected RATE:DURATION_S, e.g. 6:10"))?;
        let d = span(flag, d, 1.0)?;
        ensure!(!d.is_zero(), "{flag} {v}: the duration must be > 0");
        Ok((rate(flag, r)?, d))
    };
    let slow = match &a.slow_rate {
        None => None,
        Some(v) => {
            let parts: Vec<&str> = v.split(':').collect();
            let [r, d, ms] = parts[..] else {
                bail!(
                    "--slow-rate {v}: expected PER_WORKER_HOUR:DURATION_S:DELAY_MS, e.g. 6:10:50"
                );
            };
            let (r, d) = window("--slow-rate", &format!("{r}:{d}"))?;
            Some((r, d, span("--slow-rate", ms, 1e-3)?))
        }
    };
    Ok(FaultRates {
        kill: rate("--kill-rate", &a.kill_rate.to_string())?,
        hang: a
            .hang_rate
            .as_deref()
            .map(|v| window("--hang-rate", v))
            .transpose()?,
        slow,
        drop_kv_events: a
            .drop_kv_events_rate
            .as_deref()
            .map(|v| window("--drop-kv-events-rate", v))
            .transpose()?,
    })
}
