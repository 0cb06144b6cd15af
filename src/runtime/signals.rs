//! What a gateway counts for the planner: cumulative request and token counts and latency
//! histograms, published in its node's heartbeat (`NodeInfo::signals`). A reader diffs two
//! snapshots to get one interval's rates and percentiles, as with Prometheus counters: no
//! window is reset, so two readers, a missed heartbeat or a restarted reader never lose or
//! double-count an interval.
//!
//! Latencies go into [`LATENCY_BUCKETS`] log-spaced buckets: bucket `i` holds values up to
//! `0.1 ms × 1.12^i` (the last one everything above ~1.8 × 10⁵ ms); a percentile read from
//! them is the upper bound of its bucket, at most 12 % above the true value.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};

/// Buckets of a latency histogram.
pub const LATENCY_BUCKETS: usize = 128;
/// Upper bound of the first bucket (ms).
const FIRST_MS: f64 = 0.1;
/// Ratio of one bucket's upper bound to the previous one's.
const RATIO: f64 = 1.12;

/// Upper bound of bucket `i` (ms).
pub fn bucket_upper_ms(i: usize) -> f64 {
    FIRST_MS * RATIO.powi(i as i32)
}

fn bucket_of(ms: f64) -> usize {
    if ms.is_nan() || ms <= FIRST_MS {
        return 0;
    }
    let i = ((ms / FIRST_MS).ln() / RATIO.ln()).ceil() as usize;
    i.min(LATENCY_BUCKETS - 1)
}

/// A latency histogram written from many tasks at once (one atomic add per value).
pub struct AtomicHistogram {
    buckets: Box<[AtomicU64]>,
}

impl Default for AtomicHistogram {
    fn default() -> Self {
        Self {
            buckets: (0..LATENCY_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl std::fmt::Debug for AtomicHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AtomicHistogram").finish_non_exhaustive()
    }
}

impl AtomicHistogram {
    /// Count one value (ms).
    pub fn record(&self, ms: f64) {
        self.buckets[bucket_of(ms)].fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn snapshot(&self) -> Histogram {
        Histogram {
            counts: self
                .buckets
                .iter()
                .enumerate()
                .filter_map(|(i, b)| {
                    let n = b.load(Ordering::Relaxed);
                    (n > 0).then_some((i as u16, n))
                })
                .collect(),
        }
    }
}

/// Counts per bucket, only the buckets that hold any (`[bucket, count]` pairs, ascending).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Histogram {
    pub counts: Vec<(u16, u64)>,
}

impl Histogram {
    /// Values counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().map(|(_, n)| n).sum()
    }

    /// What was counted since `earlier` (a snapshot of the same histogram); counts that went
    /// down (the histogram restarted) count from zero.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let before = |b: u16| {
            earlier
                .counts
                .iter()
                .find(|(i, _)| *i == b)
                .map_or(0, |(_, n)| *n)
        };
        let restarted = earlier.total() > self.total();
        Histogram {
            counts: self
                .counts
                .iter()
                .filter_map(|&(b, n)| {
                    let d = if restarted {
                        n
                    } else {
                        n.saturating_sub(before(b))
                    };
                    (d > 0).then_some((b, d))
                })
                .collect(),
        }
    }

    /// Add `other`'s counts.
    pub fn add(&mut self, other: &Histogram) {
        for &(b, n) in &other.counts {
            match self.counts.iter_mut().find(|(i, _)| *i == b) {
                Some((_, m)) => *m += n,
                None => self.counts.push((b, n)),
            }
        }
        self.counts.sort_unstable_by_key(|(b, _)| *b);
    }

    /// The `q` quantile (0–1, ms), interpolated within the bucket holding it: geometrically
    /// between the bucket's bounds by the rank's place among the bucket's values (linearly
    /// in the first bucket, from 0), so that the estimate is not biased high by up to a
    /// bucket's width (12 %) as the bucket's upper bound would be; `None` when empty.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        let total = self.total();
        if total == 0 {
            return None;
        }
        let rank = ((total as f64 * q).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for &(b, n) in &self.counts {
            if n == 0 {
                continue;
            }
            if seen + n >= rank {
                let b = usize::from(b);
                let upper = bucket_upper_ms(b);
                let frac = (rank - seen) as f64 / n as f64;
                return Some(if b == 0 {
                    upper * frac
                } else if b + 1 >= LATENCY_BUCKETS {
                    // The overflow bucket has no upper bound: its floor.
                    bucket_upper_ms(b - 1)
                } else {
                    let lower = bucket_upper_ms(b - 1);
                    lower * (upper / lower).powf(frac)
                });
            }
            seen += n;
        }
        self.counts
            .last()
            .map(|(b, _)| bucket_upper_ms(usize::from(*b)))
    }
}

/// A gateway's cumulative counts, as published (see the module doc).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GatewaySignals {
    /// Requests (choices) that arrived.
    pub arrivals: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Requests that finished (successfully or not).
    pub completed: u64,
    /// Their output tokens.
    pub output_tokens: u64,
    /// Their prompt tokens served from a prefix cache.
    pub cached_tokens: u64,
    /// Time to first token (ms).
    pub ttft: Histogram,
    /// Inter-token latency (ms).
    pub itl: Histogram,
    /// Requests waiting now for a worker to serve the model (a gauge, not cumulative).
    #[serde(default)]
    pub waiting_for_capacity: u64,
    /// Requests refused for want of capacity (shed by admission, or past the cold-start
    /// wait): demand the fleet did not serve, which the planner counts with the arrivals.
    #[serde(default)]
    pub shed: u64,
}

/// The live counters behind [`GatewaySignals`] (in the node's `NodeStats`).
#[derive(Debug, Default)]
pub struct GatewayCounters {
    arrivals: AtomicU64,
    prompt_tokens: AtomicU64,
    completed: AtomicU64,
    output_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    ttft: AtomicHistogram,
    itl: AtomicHistogram,
    waiting_for_capacity: AtomicU64,
    shed: AtomicU64,
}

impl GatewayCounters {
    /// A request starts waiting for a worker (none serves the model); the guard ends the
    /// wait when dropped.
    pub fn wait_for_capacity(&self) -> CapacityWait<'_> {
        self.waiting_for_capacity.fetch_add(1, Ordering::Relaxed);
        CapacityWait(self)
    }

    /// Set the count of requests waiting for a worker, for a caller that keeps its own
    /// (the simulator, whose waits outlive any guard).
    pub fn set_waiting_for_capacity(&self, n: u64) {
        self.waiting_for_capacity.store(n, Ordering::Relaxed);
    }

    /// A request of `prompt_tokens` arrived.
    pub fn arrived(&self, prompt_tokens: u64) {
        self.arrivals.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
    }

    /// A request was refused for want of capacity (before its prompt was read).
    pub fn shed(&self) {
        self.shed.fetch_add(1, Ordering::Relaxed);
    }

    /// A request's first token came `ms` after it arrived.
    pub fn first_token(&self, ms: f64) {
        self.ttft.record(ms);
    }

    /// A later token came `ms` after the one before.
    pub fn next_token(&self, ms: f64) {
        self.itl.record(ms);
    }

    /// A request ended with `output_tokens`, `cached_tokens` of its prompt from a cache.
    pub fn finished(&self, output_tokens: u64, cached_tokens: u64) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        self.output_tokens
            .fetch_add(output_tokens, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached_tokens, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn snapshot(&self) -> GatewaySignals {
        GatewaySignals {
            arrivals: self.arrivals.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
            output_tokens: self.output_tokens.load(Ordering::Relaxed),
            cached_tokens: self.cached_tokens.load(Ordering::Relaxed),
            ttft: self.ttft.snapshot(),
            itl: self.itl.snapshot(),
            waiting_for_capacity: self.waiting_for_capacity.load(Ordering::Relaxed),
            shed: self.shed.load(Ordering::Relaxed),
        }
    }
}

/// One request waiting for capacity (see [`GatewayCounters::wait_for_capacity`]).
pub struct CapacityWait<'a>(&'a GatewayCounters);

impl Drop for CapacityWait<'_> {
    fn drop(&mut self) {
        self.0.waiting_for_capacity.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_percentile_is_within_one_bucket_of_the_truth() {
        let h = AtomicHistogram::default();
        for i in 1..=1000 {
            h.record(f64::from(i));
        }
        let s = h.snapshot();
        assert_eq!(s.total(), 1000);
        // Interpolated within the bucket: within a bucket's width of the truth, either side.
        let p99 = s.quantile_ms(0.99).unwrap();
        assert!((990.0 / RATIO..=990.0 * RATIO).contains(&p99), "{p99}");
        let p50 = s.quantile_ms(0.5).unwrap();
        assert!((500.0 / RATIO..=500.0 * RATIO).contains(&p50), "{p50}");
        // Never outside the bucket holding the rank.
        let one = AtomicHistogram::default();
        one.record(42.0);
        let v = one.snapshot().quantile_ms(0.99).unwrap();
        assert!((42.0 / RATIO..=42.0 * RATIO).contains(&v), "{v}");
        assert_eq!(Histogram::default().quantile_ms(0.5), None);
        // Out of range values land in the end buckets.
        h.record(-1.0);
        h.record(f64::NAN);
        h.record(1e12);
        assert_eq!(h.snapshot().total(), 1003);
    }

    #[test]
    fn an_interval_is_the_difference_of_two_snapshots() {
        let h = AtomicHistogram::default();
        for _ in 0..10 {
            h.record(5.0);
        }
        let a = h.snapshot();
        for _ in 0..10 {
            h.record(500.0);
        }
        let b = h.snapshot();
        let d = b.since(&a);
        assert_eq!(d.total(), 10);
        assert!(d.quantile_ms(0.01).unwrap() >= 500.0 / RATIO);
        // A histogram that restarted (fewer counts) counts from zero.
        let fresh = AtomicHistogram::default();
        fresh.record(1.0);
        assert_eq!(fresh.snapshot().since(&b).total(), 1);
        let mut sum = a.clone();
        sum.add(&d);
        assert_eq!(sum, b);
    }

    #[test]
    fn counters_snapshot_what_they_counted() {
        let c = GatewayCounters::default();
        c.arrived(100);
        c.arrived(50);
        c.first_token(20.0);
        c.next_token(5.0);
        c.finished(2, 30);
        let s = c.snapshot();
        assert_eq!((s.arrivals, s.prompt_tokens, s.completed), (2, 150, 1));
        assert_eq!((s.output_tokens, s.cached_tokens), (2, 30));
        assert_eq!((s.ttft.total(), s.itl.total()), (1, 1));
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<GatewaySignals>(&json).unwrap(), s);
    }
}
