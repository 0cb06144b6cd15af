//! Faults at rates: the chaos kinds as Poisson processes over a run, drawn before it starts
//! from a seed, so that a run with faults repeats byte for byte.
//!
//! A rate is **per worker-hour** for the faults that strike one worker (`kill`, `hang`,
//! `slow`): with `N` workers, faults of that kind arrive at `rate × N / 3600` per second of
//! simulated time, each on a worker drawn uniformly (a worker that is down when its kill
//! comes is not killed twice: the kill is a no-op). The reciprocal is each worker's mean time
//! between faults (`--kill-rate 6`: every 10 minutes). Dropped KV events strike the whole
//! fleet, so their rate is **per hour**. A window (`hang`, `slow`, dropped events) lasts its
//! given duration; a window that would overlap an earlier one of the same kind on the same
//! worker is not drawn (the process is thinned), so windows never merge.
//!
//! Faults are drawn over `[0, horizon)`: `flotilla sim` passes the span of the arrivals (the
//! first session start to the last).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::world::SimFault;

/// The rates of the chaos kinds (0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultRates {
    /// Kills per worker-hour.
    pub kill: f64,
    /// Hangs per worker-hour, and how long each lasts.
    pub hang: Option<(f64, Duration)>,
    /// Slow windows per worker-hour, how long each lasts and the delay before each step.
    pub slow: Option<(f64, Duration, Duration)>,
    /// Windows of dropped KV events per hour (fleet-wide), and how long each lasts.
    pub drop_kv_events: Option<(f64, Duration)>,
}

impl FaultRates {
    /// Whether any rate is set.
    pub fn any(&self) -> bool {
        self.kill > 0.0
            || self.hang.is_some_and(|h| h.0 > 0.0)
            || self.slow.is_some_and(|s| s.0 > 0.0)
            || self.drop_kv_events.is_some_and(|d| d.0 > 0.0)
    }

    /// The faults of one run on `workers` workers (numbered `0..workers`) over
    /// `[0, horizon)`, drawn from `seed`: kind by kind (kills, hangs, slow windows, dropped
    /// events), each in time order and from its own stream, so that changing one rate leaves
    /// the others' draws alone.
    ///
    /// # Errors
    /// A rate that would draw more than [`MAX_FAULTS`] faults of one kind (named).
    pub fn draw(
        &self,
        workers: usize,
        horizon: Duration,
        seed: u64,
    ) -> anyhow::Result<Vec<SimFault>> {
        let mut out = Vec::new();
        if workers == 0 || horizon.is_zero() {
            return Ok(out);
        }
        let n = workers as f64;
        // One stream per kind: the seed mixed with the kind's tag (splitmix64 constants).
        let stream =
            |tag: u64| StdRng::seed_from_u64(seed ^ tag.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        if self.kill > 0.0 {
            let mut rng = stream(1);
            for at in arrivals(&mut rng, self.kill * n / 3600.0, horizon, "kill")? {
                out.push(SimFault::Kill {
                    at,
                    worker: rng.random_range(0..workers),
                });
            }
        }
        if let Some((rate, len)) = self.hang.filter(|h| h.0 > 0.0) {
            let mut rng = stream(2);
            for (from, worker) in windows(
                &mut rng,
                rate * n / 3600.0,
                horizon,
                len,
                Some(workers),
                "hang",
            )? {
                out.push(SimFault::Hang {
                    from,
                    until: from + len,
                    worker,
                });
            }
        }
        if let Some((rate, len, delay)) = self.slow.filter(|s| s.0 > 0.0) {
            let mut rng = stream(3);
            for (from, worker) in windows(
                &mut rng,
                rate * n / 3600.0,
                horizon,
                len,
                Some(workers),
                "slow",
            )? {
                out.push(SimFault::Slow {
                    from,
                    until: from + len,
                    worker,
                    delay,
                });
            }
        }
        if let Some((rate, len)) = self.drop_kv_events.filter(|d| d.0 > 0.0) {
            let mut rng = stream(4);
            for (from, _) in windows(
                &mut rng,
                rate / 3600.0,
                horizon,
                len,
                None,
                "drop-kv-events",
            )? {
                out.push(SimFault::DropKvEvents {
                    from,
                    until: from + len,
                });
            }
        }
        Ok(out)
    }
}

/// Windows of `len` starting at a Poisson process's times, each on a worker drawn uniformly
/// from `0..n` (`workers: Some(n)`), or fleet-wide (`None`: worker 0, nothing drawn); a
/// window that would overlap the previous one on its worker is not drawn.
///
/// # Errors
/// As [`arrivals`].
fn windows(
    rng: &mut StdRng,
    per_s: f64,
    horizon: Duration,
    len: Duration,
    workers: Option<usize>,
    kind: &str,
) -> anyhow::Result<Vec<(Duration, usize)>> {
    let mut busy_until = vec![Duration::ZERO; workers.unwrap_or(1)];
    let mut out = Vec::new();
    for from in arrivals(rng, per_s, horizon, kind)? {
        let worker = workers.map_or(0, |n| rng.random_range(0..n));
        if from >= busy_until[worker] {
            busy_until[worker] = from + len;
            out.push((from, worker));
        }
    }
    Ok(out)
}

/// Most faults of one kind a run draws: a rate beyond it is an error, not a run that fills
/// memory with fault events.
pub const MAX_FAULTS: usize = 1_000_000;

/// The times of a Poisson process of `per_s` events per second over `[0, horizon)`
/// (exponential gaps by inversion).
///
/// # Errors
/// More than [`MAX_FAULTS`] expected.
fn arrivals(
    rng: &mut StdRng,
    per_s: f64,
    horizon: Duration,
    kind: &str,
) -> anyhow::Result<Vec<Duration>> {
    let mut out = Vec::new();
    if !(per_s > 0.0 && per_s.is_finite()) {
        return Ok(out);
    }
    let end = horizon.as_secs_f64();
    let expected = per_s * end;
    anyhow::ensure!(
        expected <= MAX_FAULTS as f64,
        "the {kind} rate draws about {expected:.3e} faults over {end:.0} s, more than \
         {MAX_FAULTS}: lower it"
    );
    let mut t = 0.0;
    loop {
        // 1 − U is in (0, 1]: its logarithm is finite.
        let u: f64 = rng.random();
        t += -(1.0 - u).ln() / per_s;
        if t >= end || out.len() > 2 * MAX_FAULTS {
            return Ok(out);
        }
        out.push(Duration::from_secs_f64(t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kills_arrive_at_the_rate_on_every_worker_and_repeat_from_the_seed() {
        let r = FaultRates {
            kill: 60.0,
            ..FaultRates::default()
        };
        // 10 workers × 60 per worker-hour over an hour: 600 expected.
        let f = r.draw(10, Duration::from_secs(3600), 7).unwrap();
        assert!((520..=680).contains(&f.len()), "{}", f.len());
        let mut per = [0usize; 10];
        for x in &f {
            let SimFault::Kill { at, worker } = x else {
                panic!("{x:?}")
            };
            assert!(*at < Duration::from_secs(3600));
            per[*worker] += 1;
        }
        assert!(per.iter().all(|&c| c > 30), "{per:?}");
        assert_eq!(f, r.draw(10, Duration::from_secs(3600), 7).unwrap());
        assert_ne!(f, r.draw(10, Duration::from_secs(3600), 8).unwrap());
        let none = FaultRates::default().draw(10, Duration::from_secs(3600), 7);
        assert!(none.unwrap().is_empty());
        assert!(r.draw(0, Duration::from_secs(3600), 7).unwrap().is_empty());
        // A rate that would fill memory is refused, by kind.
        let huge = FaultRates {
            kill: 1e12,
            ..FaultRates::default()
        };
        let e = huge.draw(10, Duration::from_secs(60), 7).unwrap_err();
        assert!(format!("{e}").contains("kill rate"), "{e}");
    }

    #[test]
    fn windows_never_overlap_on_one_worker_and_kinds_draw_apart() {
        let len = Duration::from_secs(30);
        let r = FaultRates {
            hang: Some((100.0, len)),
            slow: Some((100.0, len, Duration::from_millis(50))),
            drop_kv_events: Some((200.0, Duration::from_secs(20))),
            ..FaultRates::default()
        };
        let f = r.draw(3, Duration::from_secs(600), 1).unwrap();
        let mut last: std::collections::HashMap<(u8, Option<usize>), Duration> = Default::default();
        let mut count = [0usize; 3];
        for x in &f {
            let (kind, from, until) = match x {
                SimFault::Hang { from, until, .. } => (0, *from, *until),
                SimFault::Slow { from, until, .. } => (1, *from, *until),
                SimFault::DropKvEvents { from, until } => (2, *from, *until),
                SimFault::Kill { .. } => panic!("no kill rate"),
            };
            count[kind as usize] += 1;
            let key = (kind, x.worker());
            if let Some(end) = last.get(&key) {
                assert!(from >= *end, "{x:?} overlaps the window ending at {end:?}");
            }
            last.insert(key, until);
        }
        assert!(count.iter().all(|&c| c > 3), "{count:?}");
        // The kill stream is its own: adding kills leaves the hangs where they were.
        let with_kills = FaultRates { kill: 50.0, ..r }
            .draw(3, Duration::from_secs(600), 1)
            .unwrap();
        let windows: Vec<_> = with_kills
            .into_iter()
            .filter(|x| !matches!(x, SimFault::Kill { .. }))
            .collect();
        assert_eq!(windows, f);
    }
}
