//! Injected time.
//!
//! Timeouts, TTLs, heartbeats and restart windows read a [`Clock`] instead of calling
//! `Instant::now()` directly, so tests drive time with [`ManualClock`] or with
//! `tokio::time::pause` (which [`SystemClock`] honours, since it reads `tokio::time::Instant`).

use std::sync::{Arc, Mutex};
use std::time::Duration;
pub use tokio::time::Instant;

/// A source of time: monotonic instants for durations and deadlines, and wall-clock
/// milliseconds for what must mean the same on every node (a request's arrival, the end of a
/// hold, the last event heard).
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;

    /// Wall-clock milliseconds since the Unix epoch.
    fn wall_ms(&self) -> u64;
}

/// Shared handle to a clock.
pub type SharedClock = Arc<dyn Clock>;

/// The process's monotonic clock (paused and advanced by `tokio::time::pause` in tests).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn wall_ms(&self) -> u64 {
        unix_ms()
    }
}

/// A clock that only moves when told to: for pure-logic tests. Its wall clock starts at the
/// real one when it is made and moves with [`ManualClock::advance`] only.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<Instant>>,
    start: Instant,
    start_wall_ms: u64,
}

impl ManualClock {
    /// A manual clock starting at the current instant.
    pub fn new() -> Self {
        let start = Instant::now();
        Self {
            now: Arc::new(Mutex::new(start)),
            start,
            start_wall_ms: unix_ms(),
        }
    }

    /// A manual clock whose wall clock starts at `wall_ms` (ms since the Unix epoch) instead
    /// of the real time: runs that must repeat byte for byte (the offline simulator) start
    /// every clock at the same wall time.
    pub fn at_wall_ms(wall_ms: u64) -> Self {
        Self {
            start_wall_ms: wall_ms,
            ..Self::new()
        }
    }

    /// Move time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        *now += by;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        *self.now.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wall_ms(&self) -> u64 {
        self.start_wall_ms + self.now().saturating_duration_since(self.start).as_millis() as u64
    }
}

/// Wall-clock milliseconds since the Unix epoch (for identities and leases that must mean the
/// same on every node, e.g. a node's incarnation; not for measuring durations).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

/// The default shared clock.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_both_its_instants_and_its_wall_only_when_told() {
        let c = ManualClock::new();
        let (t0, w0) = (c.now(), c.wall_ms());
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!((c.now(), c.wall_ms()), (t0, w0));
        c.advance(Duration::from_millis(1_500));
        assert_eq!(c.now() - t0, Duration::from_millis(1_500));
        assert_eq!(c.wall_ms() - w0, 1_500);
        let shared: SharedClock = Arc::new(c.clone());
        assert_eq!(shared.wall_ms(), c.wall_ms());
        assert!(SystemClock.wall_ms() >= w0);
    }
}
