//! [`StepWatchdog`]: whether a replica's engine is alive, from the steps and canary pings it
//! answers. Pure: time comes from an injected [`Clock`](crate::runtime::clock::Clock); the
//! scheduler actor sends the pings and restarts the replica on [`WatchdogVerdict::Hung`].
//!
//! # The rule
//! - A step handed to the engine must come back within `step_timeout` plus its allowance (a
//!   chaos `slow` delay, which is not engine time).
//! - An engine with no step in flight is pinged once `canary_interval` has passed since its
//!   last proof of life (a step or a ping came back); the ping must come back within
//!   `step_timeout`.
//! - Otherwise the engine is hung. The watchdog is checked periodically, so a hang is found
//!   within one check period of its deadline.

use std::time::Duration;

use crate::runtime::clock::{Instant, SharedClock};

/// What hung.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hang {
    /// A step did not come back.
    Step,
    /// A canary ping did not come back.
    Canary,
}

impl std::fmt::Display for Hang {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Hang::Step => "an engine step",
            Hang::Canary => "the canary",
        })
    }
}

/// The watchdog's answer to [`StepWatchdog::check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchdogVerdict {
    /// Nothing to do.
    Healthy,
    /// The engine has been idle for the canary interval: ping it now (the ping's deadline is
    /// already running).
    Ping,
    /// The engine missed a deadline.
    Hung(Hang),
}

/// The step deadline, the canary deadline and the last proof of life of one engine.
#[derive(Debug)]
pub struct StepWatchdog {
    clock: SharedClock,
    step_timeout: Duration,
    canary_interval: Duration,
    /// When the step in flight counts as hung (`Some` exactly while a step is in flight).
    step_deadline: Option<Instant>,
    /// When the canary in flight counts as hung.
    canary_deadline: Option<Instant>,
    /// Last proof of life of the engine (a step or a canary came back).
    last_alive: Instant,
}

impl StepWatchdog {
    /// A watchdog for an engine that just proved alive (it was just started).
    pub fn new(clock: SharedClock, step_timeout: Duration, canary_interval: Duration) -> Self {
        let last_alive = clock.now();
        Self {
            clock,
            step_timeout,
            canary_interval,
            step_deadline: None,
            canary_deadline: None,
            last_alive,
        }
    }

    /// How long a step or a ping may take.
    pub fn step_timeout(&self) -> Duration {
        self.step_timeout
    }

    /// Whether a step is in flight (between [`Self::step_started`] and
    /// [`Self::step_returned`]).
    pub fn step_in_flight(&self) -> bool {
        self.step_deadline.is_some()
    }

    /// A step was handed to the engine; it may take `allowance` more than the step timeout.
    pub fn step_started(&mut self, allowance: Duration) {
        self.step_deadline = Some(self.clock.now() + allowance + self.step_timeout);
    }

    /// The step in flight came back (with tokens or an error): the engine is alive.
    pub fn step_returned(&mut self) {
        self.step_deadline = None;
        self.last_alive = self.clock.now();
    }

    /// The canary ping came back: the engine is alive.
    pub fn canary_returned(&mut self) {
        self.canary_deadline = None;
        self.last_alive = self.clock.now();
    }

    /// Checks the deadlines; starts a canary's deadline when the answer is [`WatchdogVerdict::Ping`].
    pub fn check(&mut self) -> WatchdogVerdict {
        let now = self.clock.now();
        match (self.step_deadline, self.canary_deadline) {
            (Some(d), _) if now > d => return WatchdogVerdict::Hung(Hang::Step),
            (_, Some(d)) if now > d => return WatchdogVerdict::Hung(Hang::Canary),
            _ => {}
        }
        let idle = self.step_deadline.is_none() && self.canary_deadline.is_none();
        if idle && now.duration_since(self.last_alive) >= self.canary_interval {
            self.canary_deadline = Some(now + self.step_timeout);
            return WatchdogVerdict::Ping;
        }
        WatchdogVerdict::Healthy
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::runtime::clock::ManualClock;

    const TIMEOUT: Duration = Duration::from_millis(1000);
    const CANARY: Duration = Duration::from_millis(300);

    fn watchdog() -> (ManualClock, StepWatchdog) {
        let clock = ManualClock::new();
        let w = StepWatchdog::new(Arc::new(clock.clone()), TIMEOUT, CANARY);
        (clock, w)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_step_that_returns_in_time_is_healthy() {
        let (clock, mut w) = watchdog();
        w.step_started(Duration::ZERO);
        assert!(w.step_in_flight());
        clock.advance(TIMEOUT);
        assert_eq!(
            w.check(),
            WatchdogVerdict::Healthy,
            "the deadline itself is still in time"
        );
        w.step_returned();
        assert!(!w.step_in_flight());
        clock.advance(ms(10));
        assert_eq!(w.check(), WatchdogVerdict::Healthy);
    }

    #[test]
    fn a_step_past_its_deadline_is_a_hang() {
        let (clock, mut w) = watchdog();
        w.step_started(Duration::ZERO);
        clock.advance(TIMEOUT + ms(1));
        assert_eq!(w.check(), WatchdogVerdict::Hung(Hang::Step));
        assert_eq!(Hang::Step.to_string(), "an engine step");
    }

    #[test]
    fn an_injected_delay_is_not_engine_time() {
        let (clock, mut w) = watchdog();
        w.step_started(ms(5000));
        clock.advance(ms(5000) + TIMEOUT);
        assert_eq!(w.check(), WatchdogVerdict::Healthy);
        clock.advance(ms(1));
        assert_eq!(w.check(), WatchdogVerdict::Hung(Hang::Step));
    }

    #[test]
    fn an_idle_engine_is_pinged_once_per_interval_and_must_answer() {
        let (clock, mut w) = watchdog();
        clock.advance(CANARY - ms(1));
        assert_eq!(w.check(), WatchdogVerdict::Healthy, "not idle long enough");
        clock.advance(ms(1));
        assert_eq!(w.check(), WatchdogVerdict::Ping);
        // One ping at a time.
        clock.advance(CANARY);
        assert_eq!(w.check(), WatchdogVerdict::Healthy);
        w.canary_returned();
        clock.advance(CANARY - ms(1));
        assert_eq!(
            w.check(),
            WatchdogVerdict::Healthy,
            "the answer was a proof of life"
        );
        clock.advance(ms(1));
        assert_eq!(w.check(), WatchdogVerdict::Ping);
        clock.advance(TIMEOUT + ms(1));
        assert_eq!(w.check(), WatchdogVerdict::Hung(Hang::Canary));
        assert_eq!(Hang::Canary.to_string(), "the canary");
    }

    #[test]
    fn a_busy_engine_is_not_pinged_and_a_step_is_a_proof_of_life() {
        let (clock, mut w) = watchdog();
        w.step_started(Duration::ZERO);
        clock.advance(CANARY * 2);
        assert_eq!(
            w.check(),
            WatchdogVerdict::Healthy,
            "no ping while a step is out"
        );
        w.step_returned();
        clock.advance(CANARY - ms(1));
        assert_eq!(w.check(), WatchdogVerdict::Healthy);
        clock.advance(ms(1));
        assert_eq!(w.check(), WatchdogVerdict::Ping);
    }
}
