//! What a gateway counts for the planner: cumulative request and token counts and latency
//! histograms, published in its node's heartbeat (`NodeInfo::signals`). A reader diffs two
//! snapshots to get one interval's rates and percentiles, as with Prometheus counters: no
//! window is reset, so two readers, a missed heartbeat or a restarted reader never lose or
//! double-count an interval.
//!
//! Latencies go into [`LATENCY_BUCKETS`] log-spaced buckets: bucket `i` holds values up to
//! `0.1 ms × 1.12^i` (the last one everything above ~1.8 × 10⁵ ms); a percentile read from
//! them is the upper bound of its bucket, at most 12 % above the true value.
//!
//! The same counts give the gateway's own rates on `/metrics` (`flotilla_request_rate`,
//! `flotilla_output_token_rate`): [`WindowedRate`] turns samples of a cumulative count (the
//! gateway takes one every [`RATE_SAMPLE_EVERY`]) into a per-second rate over the last
//! [`RATE_WINDOW`], for readers without Prometheus' `rate()` (a `curl`, a load balancer).

use crate::runtime::clock::Instant;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The window of the gateway's `flotilla_request_rate` and `flotilla_output_token_rate`.
pub const RATE_WINDOW: Duration = Duration::from_secs(10);
/// How often the gateway samples its counts for them.
pub const RATE_SAMPLE_EVERY: Duration = Duration::from_secs(1);

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

/// A per-second rate over a sliding window, from samples of a cumulative count taken at a
/// steady pace (pure: the caller passes the time). The rate is the count's growth from the
/// baseline — the newest sample at least `window` older than the newest one, or the oldest
/// while there is none yet — to the newest sample, over the time between them: with samples
/// every second, the last 10–11 s of a 10 s window (less while younger than the window). A count
/// that goes down (its source restarted) starts the window over.
#[derive(Clone, Debug)]
pub struct WindowedRate {
    window: Duration,
    /// `(when, count)`, oldest first: the baseline and every sample after it.
    samples: VecDeque<(Instant, u64)>,
}

impl WindowedRate {
    /// An empty window of `window`.
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            samples: VecDeque::new(),
        }
    }

    /// The count was `total` at `now` (a sample older than the newest one is ignored).
    pub fn observe(&mut self, now: Instant, total: u64) {
        if let Some(&(t, last)) = self.samples.back() {
            if now < t {
                return;
            }
            if total < last {
                self.samples.clear();
            }
        }
        self.samples.push_back((now, total));
        // Keep one sample at or before the window's start as the baseline, none older.
        if let Some(start) = now.checked_sub(self.window) {
            while self.samples.get(1).is_some_and(|&(t, _)| t <= start) {
                self.samples.pop_front();
            }
        }
    }

    /// Per second over the window ending at the newest sample; 0 before two samples apart.
    pub fn per_second(&self) -> f64 {
        let (Some(&(t0, n0)), Some(&(t1, n1))) = (self.samples.front(), self.samples.back()) else {
            return 0.0;
        };
        let span = t1.saturating_duration_since(t0).as_secs_f64();
        if span <= 0.0 {
            return 0.0;
        }
        n1.saturating_sub(n0) as f64 / span
    }
}

/// A gateway's completed requests and their output tokens per second over [`RATE_WINDOW`].
#[derive(Debug)]
struct GatewayRates {
    completed: WindowedRate,
    output_tokens: WindowedRate,
}

impl Default for GatewayRates {
    fn default() -> Self {
        Self {
            completed: WindowedRate::new(RATE_WINDOW),
            output_tokens: WindowedRate::new(RATE_WINDOW),
        }
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
    /// Windows over `completed` and `output_tokens` (see [`GatewayCounters::sample_rates`]).
    rates: Mutex<GatewayRates>,
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

    /// Sample the completed requests and output tokens for [`GatewayCounters::rates`]: at a
    /// steady pace ([`RATE_SAMPLE_EVERY`]; the gateway does, on its clock).
    pub fn sample_rates(&self, now: Instant) {
        let completed = self.completed.load(Ordering::Relaxed);
        let output_tokens = self.output_tokens.load(Ordering::Relaxed);
        let mut r = self.rates.lock().unwrap_or_else(|p| p.into_inner());
        r.completed.observe(now, completed);
        r.output_tokens.observe(now, output_tokens);
    }

    /// Completed requests (choices, successfully or not) and their output tokens, per second
    /// over [`RATE_WINDOW`] up to the last [`GatewayCounters::sample_rates`].
    pub fn rates(&self) -> (f64, f64) {
        let r = self.rates.lock().unwrap_or_else(|p| p.into_inner());
        (r.completed.per_second(), r.output_tokens.per_second())
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
    fn a_windowed_rate_is_the_growth_over_the_last_window() {
        use crate::runtime::clock::{Clock, ManualClock};
        let clock = ManualClock::new();
        let mut r = WindowedRate::new(Duration::from_secs(10));
        assert_eq!(r.per_second(), 0.0, "no samples");
        r.observe(clock.now(), 100);
        assert_eq!(r.per_second(), 0.0, "one sample");
        // 5 a second for 4 s: younger than the window, the rate over what there is.
        for _ in 0..4 {
            clock.advance(Duration::from_secs(1));
            let n = 100 + 5 * clock.now().duration_since(r.samples[0].0).as_secs();
            r.observe(clock.now(), n);
        }
        assert_eq!(r.per_second(), 5.0);
        // 30 more in the next second, then nothing for 9 s: still in the window.
        clock.advance(Duration::from_secs(1));
        r.observe(clock.now(), 150);
        for _ in 0..9 {
            clock.advance(Duration::from_secs(1));
            r.observe(clock.now(), 150);
        }
        // Window: the sample at t=4 s (120) to t=14 s (150).
        assert_eq!(r.per_second(), 3.0);
        assert!(r.samples.len() <= 12, "bounded: {}", r.samples.len());
        // Quiet for a whole window: 0.
        for _ in 0..10 {
            clock.advance(Duration::from_secs(1));
            r.observe(clock.now(), 150);
        }
        assert_eq!(r.per_second(), 0.0);
        // Samples further apart than the window: the rate between the last two.
        clock.advance(Duration::from_secs(20));
        r.observe(clock.now(), 190);
        assert_eq!(r.per_second(), 2.0);
        // An older sample is ignored; a count that went down starts over.
        r.observe(clock.now() - Duration::from_secs(1), 0);
        assert_eq!(r.per_second(), 2.0);
        clock.advance(Duration::from_secs(1));
        r.observe(clock.now(), 3);
        assert_eq!(r.per_second(), 0.0, "restarted: one sample");
        clock.advance(Duration::from_secs(2));
        r.observe(clock.now(), 13);
        assert_eq!(r.per_second(), 5.0);
    }

    #[test]
    fn a_gateway_samples_its_completions_and_output_tokens() {
        use crate::runtime::clock::{Clock, ManualClock};
        let clock = ManualClock::new();
        let c = GatewayCounters::default();
        c.sample_rates(clock.now());
        for _ in 0..10 {
            clock.advance(RATE_SAMPLE_EVERY);
            c.finished(8, 0);
            c.finished(4, 0);
            c.sample_rates(clock.now());
        }
        assert_eq!(c.rates(), (2.0, 12.0));
        // Arrivals and shed requests are not completions.
        c.arrived(10);
        c.shed();
        clock.advance(RATE_SAMPLE_EVERY);
        c.sample_rates(clock.now());
        assert_eq!(c.rates(), (1.8, 10.8));
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
