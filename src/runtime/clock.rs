//! Injected time.
//!
//! Timeouts, TTLs, heartbeats and restart windows read a [`Clock`] instead of calling
//! `Instant::now()` directly, so tests drive time with [`ManualClock`] or with
//! `tokio::time::pause` (which [`SystemClock`] honours, since it reads `tokio::time::Instant`).

use std::sync::{Arc, Mutex};
use std::time::Duration;
pub use tokio::time::Instant;

/// A source of monotonic time.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
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
}

/// A clock that only moves when told to: for pure-logic tests.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<Mutex<Instant>>,
}

impl ManualClock {
    /// A manual clock starting at the current instant.
    pub fn new() -> Self {
        Self {
            now: Arc::new(Mutex::new(Instant::now())),
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
