//! When sessions start.
//!
//! Open loop ([`ArrivalKind::Poisson`], [`ArrivalKind::Gamma`], [`ArrivalKind::Trace`]): every
//! session's first turn is sent at its offset from the run's start whether or not earlier
//! requests have finished. Closed loop ([`ArrivalKind::Fixed`]): `C` sessions run at once, a
//! new one starting as soon as one ends. Offsets are seconds from the run's start.

use rand::Rng;
use rand_distr::{Distribution, Exp, Gamma};

/// How sessions arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ArrivalKind {
    /// Poisson process at `--rate`: exponential gaps of mean 1/rate.
    Poisson,
    /// Gamma-distributed gaps, shape `--burstiness` k, mean 1/rate (k < 1 burstier than
    /// Poisson, k = 1 Poisson, k > 1 more regular; coefficient of variation 1/√k).
    Gamma,
    /// Closed loop: `--concurrency` sessions at once.
    Fixed,
    /// The trace's timestamps divided by `--speedup`.
    Trace,
}

/// `n` Poisson arrival offsets (s) at `rate` per second; the first at 0.
///
/// # Panics
/// `rate` is not positive.
pub fn poisson(n: usize, rate: f64, rng: &mut impl Rng) -> Vec<f64> {
    let gap = Exp::new(rate).expect("arrival rate must be positive");
    accumulate(n, || gap.sample(rng))
}

/// `n` arrival offsets (s) with Gamma(`shape`) gaps of mean `1/rate`; the first at 0.
///
/// # Panics
/// `rate` or `shape` is not positive.
pub fn gamma(n: usize, rate: f64, shape: f64, rng: &mut impl Rng) -> Vec<f64> {
    let gap = Gamma::new(shape, 1.0 / (shape * rate)).expect("rate and shape must be positive");
    accumulate(n, || gap.sample(rng))
}

fn accumulate(n: usize, mut gap: impl FnMut() -> f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += gap();
            }
            t
        })
        .collect()
}

/// Trace offsets (s): `(timestamp_ms + jitter) / speedup / 1000`, with `jitter` uniform in
/// `[0, jitter_ms)` per request (0 when `jitter_ms` is 0) to spread the trace's ~3 s buckets.
pub fn trace(timestamps_ms: &[f64], speedup: f64, jitter_ms: f64, rng: &mut impl Rng) -> Vec<f64> {
    timestamps_ms
        .iter()
        .map(|&t| {
            let j = if jitter_ms > 0.0 {
                rng.random::<f64>() * jitter_ms
            } else {
                0.0
            };
            (t + j) / speedup / 1000.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn mean_gap(offsets: &[f64]) -> f64 {
        offsets[offsets.len() - 1] / (offsets.len() - 1) as f64
    }

    #[test]
    fn poisson_mean_and_seed() {
        let a = poisson(20_001, 4.0, &mut StdRng::seed_from_u64(1));
        assert_eq!(a[0], 0.0);
        assert!(a.windows(2).all(|w| w[1] >= w[0]));
        let m = mean_gap(&a);
        assert!((m - 0.25).abs() < 0.25 * 0.03, "{m}");
        let b = poisson(20_001, 4.0, &mut StdRng::seed_from_u64(1));
        assert_eq!(a, b, "same seed, same arrivals");
        // Exponential gaps: coefficient of variation ≈ 1.
        let gaps: Vec<f64> = a.windows(2).map(|w| w[1] - w[0]).collect();
        let var = gaps.iter().map(|g| (g - m).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((var.sqrt() / m - 1.0).abs() < 0.05);
    }

    #[test]
    fn gamma_mean_and_burstiness() {
        for shape in [0.25, 1.0, 4.0] {
            let a = gamma(40_001, 2.0, shape, &mut StdRng::seed_from_u64(7));
            let m = mean_gap(&a);
            assert!((m - 0.5).abs() < 0.5 * 0.05, "shape {shape}: {m}");
            let gaps: Vec<f64> = a.windows(2).map(|w| w[1] - w[0]).collect();
            let var = gaps.iter().map(|g| (g - m).powi(2)).sum::<f64>() / gaps.len() as f64;
            let cv = var.sqrt() / m;
            let want = 1.0 / shape.sqrt();
            assert!((cv - want).abs() < want * 0.1, "shape {shape}: cv {cv}");
        }
    }

    #[test]
    fn trace_speedup_and_jitter() {
        let ts = [0.0, 3000.0, 6000.0];
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(trace(&ts, 2.0, 0.0, &mut rng), vec![0.0, 1.5, 3.0]);
        let j = trace(&ts, 1.0, 3000.0, &mut rng);
        for (o, t) in j.iter().zip(ts) {
            assert!(*o >= t / 1000.0 && *o < t / 1000.0 + 3.0);
        }
    }
}
