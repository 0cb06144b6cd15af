//! When a request's worker is lost: migrate again, wait for a worker, or give up. Pure: every
//! decision takes the time from the caller (an injected clock), so the rules are unit-tested
//! on a [`crate::runtime::clock::ManualClock`].
//!
//! # The rule
//! - A request that keeps making progress is never given up. A loss counts **against** the
//!   request only when its attempt was running on the lost worker (admitted: its prefill had
//!   begun) and no new token was delivered since the previous loss (or since the start). A
//!   loss while the attempt still waited in the worker's queue costs nothing: the request
//!   had no chance there (a fleet busy re-prefilling the requests of the last fault), and a
//!   poison request is only poison once it runs. A token resets the count and ends the stall.
//! - Losses without progress are not a count that fast failures use up: a request is given
//!   up only when more than [`MigrationPolicy::limit`] losses count against it **and** the
//!   stall has lasted [`MigrationPolicy::deadline`] (from the first of them). Faults that
//!   arrive faster than restarted workers become ready therefore cost time, not the request.
//! - A loss is followed by a placement at once: a migrated request keeps its place among
//!   the others (the scheduler's queue is first come, first served by how long the client
//!   has waited for its next token: since its last token, or its arrival), so re-placing it
//!   late would only push it behind requests that are not losing anything. (Measured: backing off after losses without progress starved
//!   the backed-off requests under the contended soak, each placed last and lost again
//!   before its turn.)
//! - A placement that finds no routable worker (every worker down or restarting, the router
//!   unreachable) waits and tries again with exponential backoff and "equal jitter" (half the
//!   step fixed, half random; Brooker, "Exponential Backoff And Jitter", AWS Architecture
//!   Blog, 2015): the `k`-th wait is `min(backoff_max, backoff_base · 2^k) · (1/2 + U[0,
//!   1/2))`, up to the deadline counted from the loss.
//! - A worker that failed the request is not chosen for it again, unless it is the only one
//!   left ([`Migration::avoid`] is handed to the router as a preference, not a ban).
//! - A first placement (not a migration) does not wait: no worker means 503 at once, which
//!   is load shedding's answer.
//! - A placement whose chosen worker is already gone when the request is handed to it (the
//!   router's view of the fleet is a moment behind a kill) is no loss and no failure: the
//!   request is routed again at once, avoiding that worker, up to
//!   [`GONE_PICKS_MAX`] times in a row; only then does the placement count as failed.
//!
//! Bounds: a request without progress fails on its first loss after `deadline` of stall once
//! it has more than `limit` losses in it (so a poison request, one that crashes every worker
//! it lands on, is given up after at most `deadline` of crashes past the first `limit`), or
//! when a placement finds no worker for `deadline` after a loss. A request that keeps
//! receiving tokens migrates as often as its workers fail.

use crate::runtime::clock::Instant;
use crate::runtime::ids::WorkerId;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

/// Workers remembered as having failed a request (the most recent ones).
pub const AVOID_MAX: usize = 8;

/// Picks in a row whose worker was gone before it got the request, routed again at once;
/// one more fails the placement (a router that keeps choosing departed workers is not
/// catching up, and the request then follows the rule for a failed placement).
pub const GONE_PICKS_MAX: u32 = 3;

/// Bounds of migration (from `gateway.migration_*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MigrationPolicy {
    /// Losses in a row without progress that never give a request up
    /// (`gateway.migration_limit`); beyond them, a stall of `deadline` does.
    pub limit: u32,
    /// How long one migration may look for a worker, from the loss; and how long a stall
    /// of more than `limit` losses may last (`gateway.migration_deadline_ms`).
    pub deadline: Duration,
    /// First backoff step while no worker is routable (`gateway.migration_backoff_base_ms`).
    pub backoff_base: Duration,
    /// Largest backoff step (`gateway.migration_backoff_max_ms`).
    pub backoff_max: Duration,
}

impl Default for MigrationPolicy {
    fn default() -> Self {
        Self {
            limit: 3,
            deadline: Duration::from_secs(30),
            backoff_base: Duration::from_millis(50),
            backoff_max: Duration::from_secs(1),
        }
    }
}

/// What to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Place the request now (avoiding [`Migration::avoid`] where possible).
    Place,
    /// Try placing again at `until`.
    Wait {
        /// When to try again.
        until: Instant,
    },
    /// Give the request up.
    Fail(GiveUp),
}

/// Why a request was given up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GiveUp {
    /// More than `limit` losses in a row brought no new token, over at least `deadline`.
    NoProgress {
        /// Losses in the stall.
        losses: u32,
        /// How long the stall lasted.
        stalled_for: Duration,
    },
    /// No worker could be placed on before the migration's deadline.
    Deadline {
        /// The policy's deadline.
        deadline: Duration,
    },
    /// The first placement failed (no waiting before a request has started).
    FirstPlacement,
}

impl std::fmt::Display for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GiveUp::NoProgress {
                losses,
                stalled_for,
            } => write!(
                f,
                "{losses} migrations in a row over {} ms brought no new token \
                 (gateway.migration_limit, gateway.migration_deadline_ms)",
                stalled_for.as_millis()
            ),
            GiveUp::Deadline { deadline } => write!(
                f,
                "no worker became available within {} ms (gateway.migration_deadline_ms)",
                deadline.as_millis()
            ),
            GiveUp::FirstPlacement => f.write_str("the request could not be placed"),
        }
    }
}

/// The migration state of one request.
#[derive(Debug)]
pub struct Migration {
    policy: MigrationPolicy,
    /// Tokens delivered when the previous loss happened (0 at the start).
    delivered_at_loss: usize,
    /// Losses in a row without progress.
    stalled: u32,
    /// When the current stall began (the first loss counted against the request since its
    /// last token).
    stall_start: Option<Instant>,
    /// Migrations begun (all of them, with progress or not).
    total: u32,
    /// The migration under way: its deadline and the placement tries it made.
    current: Option<(Instant, u32)>,
    /// `current` is a hand-off's placement, not a migration.
    hand_off: bool,
    /// `current` retries a first placement whose router failed, not a migration.
    router_retry: bool,
    avoid: Vec<WorkerId>,
    rng: StdRng,
}

impl Migration {
    /// A request's migration state; `seed` drives the backoff jitter.
    pub fn new(policy: MigrationPolicy, seed: u64) -> Self {
        Self {
            policy,
            delivered_at_loss: 0,
            stalled: 0,
            stall_start: None,
            total: 0,
            current: None,
            hand_off: false,
            router_retry: false,
            avoid: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The worker serving the request was lost at `now`, after `delivered` tokens in all had
    /// reached the client; `ran`: the lost attempt had been admitted there (not only queued).
    /// `worker` (if known) is avoided from now on. Returns `Place`, or `Fail` when the stall
    /// is over both bounds.
    pub fn on_loss(
        &mut self,
        now: Instant,
        delivered: usize,
        ran: bool,
        worker: Option<WorkerId>,
    ) -> Decision {
        if delivered > self.delivered_at_loss {
            self.stalled = 0;
            self.stall_start = None;
        } else if ran {
            self.stalled += 1;
            self.stall_start.get_or_insert(now);
        }
        self.delivered_at_loss = delivered;
        if let Some(w) = worker {
            self.avoid_worker(w);
        }
        let stalled_for = self.stall_start.map_or(Duration::ZERO, |s| now - s);
        if self.stalled > self.policy.limit && stalled_for >= self.policy.deadline {
            self.current = None;
            return Decision::Fail(GiveUp::NoProgress {
                losses: self.stalled,
                stalled_for,
            });
        }
        self.total += 1;
        self.current = Some((now + self.policy.deadline, 0));
        self.hand_off = false;
        self.router_retry = false;
        Decision::Place
    }

    /// A prefill worker handed the request off at `now` (disaggregated serving): the decode
    /// attempt's placement may wait for a worker like a migration's (backoff up to the
    /// deadline) — tokens have reached the client — but nothing was lost, so no migration is
    /// counted and no worker avoided.
    pub fn on_hand_off(&mut self, now: Instant) {
        self.current = Some((now + self.policy.deadline, 0));
        self.hand_off = true;
        self.router_retry = false;
    }

    /// The router asked for a placement at `now` failed (it died or hung during the call):
    /// the request is not at fault and no router decided anything, so even a first placement
    /// is tried again (another router answers once the cluster has dropped this one), with
    /// the backoff of a migration up to its deadline. Nothing was lost: no migration is
    /// counted.
    pub fn on_router_failed(&mut self, now: Instant) -> Decision {
        if self.current.is_none() {
            self.current = Some((now + self.policy.deadline, 0));
            self.router_retry = true;
        }
        self.on_place_failed(now, true)
    }

    /// The `k`-th backoff step (from 0), jittered.
    fn backoff(&mut self, k: u32) -> Duration {
        let step = self
            .policy
            .backoff_base
            .saturating_mul(1u32 << k.min(16))
            .min(self.policy.backoff_max);
        step.mul_f64(self.rng.random_range(0.5..1.0))
    }

    /// A placement failed at `now`; `retryable` when it may succeed later (no worker
    /// routable, router unreachable), not when the request itself is at fault.
    pub fn on_place_failed(&mut self, now: Instant, retryable: bool) -> Decision {
        let Some((deadline, tries)) = self.current else {
            return Decision::Fail(GiveUp::FirstPlacement);
        };
        if !retryable || now >= deadline {
            self.current = None;
            return Decision::Fail(GiveUp::Deadline {
                deadline: self.policy.deadline,
            });
        }
        self.current = Some((deadline, tries + 1));
        let until = (now + self.backoff(tries)).min(deadline);
        Decision::Wait { until }
    }

    /// The request is placed and produced a token: the migration under way (if any) is over.
    /// Returns whether one was (a hand-off's placement is not one).
    pub fn on_resumed(&mut self) -> bool {
        let migrated = self.current.take().is_some() && !self.hand_off && !self.router_retry;
        self.hand_off = false;
        self.router_retry = false;
        migrated
    }

    /// Avoid `worker` in this request's next placements (the most recent [`AVOID_MAX`]).
    pub fn avoid_worker(&mut self, worker: WorkerId) {
        self.avoid.retain(|a| *a != worker);
        self.avoid.push(worker);
        if self.avoid.len() > AVOID_MAX {
            self.avoid.remove(0);
        }
    }

    /// Workers that failed this request, oldest first: to avoid when placing it.
    pub fn avoid(&self) -> &[WorkerId] {
        &self.avoid
    }

    /// Migrations begun so far.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Losses counted against the request since its last token.
    pub fn stalled(&self) -> u32 {
        self.stalled
    }
}

#[cfg(test)]
mod tests;
