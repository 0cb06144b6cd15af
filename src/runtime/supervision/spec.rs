//! Supervision types, after Erlang/OTP's supervisor design principles
//! (<https://www.erlang.org/doc/system/sup_princ.html>): flags (strategy + restart intensity)
//! and an ordered list of child specs (id, restart type, shutdown, start function).

use futures::future::BoxFuture;
use ractor::{Actor, ActorCell, SpawnErr};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Which children restart when one of them exits and must be restarted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Only the child that exited.
    OneForOne,
    /// Every child: the others are stopped (reverse start order), then all restart in order.
    OneForAll,
    /// The child that exited and every child started after it.
    RestForOne,
}

/// When a child that exited is restarted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Restart {
    /// Always.
    Permanent,
    /// Only after an abnormal exit (a failure, a kill, or a stop reason other than normal/shutdown).
    Transient,
    /// Never (per-request and other short-lived children).
    Temporary,
}

/// How a child is stopped by its supervisor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// Kill at once (aborts the message being handled).
    Kill,
    /// Ask it to stop; kill it if it has not stopped after this long.
    Timeout(Duration),
    /// Ask it to stop and wait as long as it takes (use for child supervisors).
    Infinity,
}

/// Restart intensity and backoff of one supervisor.
#[derive(Clone, Copy, Debug)]
pub struct SupervisorFlags {
    /// Restart strategy.
    pub strategy: Strategy,
    /// More than this many restarts within `period` escalates: the supervisor stops its
    /// children and fails, so its own parent decides.
    pub max_restarts: u32,
    /// The sliding window for `max_restarts`.
    pub period: Duration,
    /// Delay before the first restart in a window; doubles with each further restart in the
    /// window, capped at `backoff_max`. Zero restarts at once.
    pub backoff_base: Duration,
    /// Upper bound of the restart delay.
    pub backoff_max: Duration,
}

impl SupervisorFlags {
    /// Flags with the given strategy and intensity, and a 10 ms → 1 s backoff.
    pub fn new(strategy: Strategy, max_restarts: u32, period: Duration) -> Self {
        Self {
            strategy,
            max_restarts,
            period,
            backoff_base: Duration::from_millis(10),
            backoff_max: Duration::from_secs(1),
        }
    }

    /// Replace the backoff bounds.
    pub fn with_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }

    /// The delay before the `n`-th restart (1-based) within the current window.
    pub fn backoff(&self, n: u32) -> Duration {
        if self.backoff_base.is_zero() || n == 0 {
            return Duration::ZERO;
        }
        let factor = 1u32
            .checked_shl(n.saturating_sub(1).min(20))
            .unwrap_or(u32::MAX);
        self.backoff_base
            .saturating_mul(factor)
            .min(self.backoff_max)
    }
}

/// Starts a child linked to the given supervisor cell and returns the child's cell.
pub type StartFn =
    Arc<dyn Fn(ActorCell) -> BoxFuture<'static, Result<ActorCell, SpawnErr>> + Send + Sync>;

/// One child of a supervisor.
#[derive(Clone)]
pub struct ChildSpec {
    /// Unique id among the supervisor's children (also used in metrics labels).
    pub id: String,
    /// Restart type.
    pub restart: Restart,
    /// Shutdown behaviour.
    pub shutdown: Shutdown,
    /// Start function.
    pub start: StartFn,
}

impl fmt::Debug for ChildSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChildSpec")
            .field("id", &self.id)
            .field("restart", &self.restart)
            .field("shutdown", &self.shutdown)
            .finish()
    }
}

/// Default time a worker child is given to stop before it is killed.
pub const DEFAULT_SHUTDOWN: Duration = Duration::from_secs(5);

impl ChildSpec {
    /// A permanent child with a 5 s shutdown timeout, started by `start`.
    pub fn new(id: impl Into<String>, start: StartFn) -> Self {
        Self {
            id: id.into(),
            restart: Restart::Permanent,
            shutdown: Shutdown::Timeout(DEFAULT_SHUTDOWN),
            start,
        }
    }

    /// A child that is an actor of type `A`, spawned as `name` (registered on this node when
    /// `Some`) with a fresh `(actor, args)` from `make` at every (re)start.
    pub fn actor<A, F>(id: impl Into<String>, name: Option<String>, make: F) -> Self
    where
        A: Actor,
        F: Fn() -> (A, A::Arguments) + Send + Sync + 'static,
    {
        let make = Arc::new(make);
        let start: StartFn = Arc::new(move |sup: ActorCell| {
            let make = make.clone();
            let name = name.clone();
            Box::pin(async move {
                let (actor, args) = make();
                let (r, _) = Actor::spawn_linked(name, actor, args, sup).await?;
                Ok(r.get_cell())
            })
        });
        Self::new(id, start)
    }

    /// A child that is itself a supervisor, waited on without a time limit when stopped.
    pub fn supervisor(spec: SupervisorSpec) -> Self {
        let id = spec.name.clone();
        let start: StartFn = Arc::new(move |sup: ActorCell| {
            let spec = spec.clone();
            Box::pin(async move {
                let name = spec.actor_name.clone();
                let (r, _) = Actor::spawn_linked(name, super::Supervisor, spec, sup).await?;
                Ok(r.get_cell())
            })
        });
        Self::new(id, start).shutdown(Shutdown::Infinity)
    }

    /// Set the restart type.
    pub fn restart(mut self, restart: Restart) -> Self {
        self.restart = restart;
        self
    }

    /// Set the shutdown behaviour.
    pub fn shutdown(mut self, shutdown: Shutdown) -> Self {
        self.shutdown = shutdown;
        self
    }
}

/// A supervisor: its flags and its ordered children.
#[derive(Clone, Debug)]
pub struct SupervisorSpec {
    /// Id of the supervisor (child id in its parent, metrics label).
    pub name: String,
    /// Name the supervisor actor registers under, if any (unique per node).
    pub actor_name: Option<String>,
    /// Strategy and intensity.
    pub flags: SupervisorFlags,
    /// Children, in start order.
    pub children: Vec<ChildSpec>,
    /// The node whose restart counter this supervisor's restarts add to, if any.
    pub stats: Option<Arc<crate::runtime::resilience::NodeStats>>,
}

impl SupervisorSpec {
    /// A supervisor named `name` (also its registered actor name).
    pub fn new(name: impl Into<String>, flags: SupervisorFlags) -> Self {
        let name = name.into();
        Self {
            actor_name: Some(name.clone()),
            name,
            flags,
            children: Vec::new(),
            stats: None,
        }
    }

    /// Count this supervisor's restarts in `stats` (its node's counters).
    pub fn counting(mut self, stats: Arc<crate::runtime::resilience::NodeStats>) -> Self {
        self.stats = Some(stats);
        self
    }

    /// Register the supervisor actor under a different name (or none).
    pub fn actor_name(mut self, name: Option<String>) -> Self {
        self.actor_name = name;
        self
    }

    /// Append a child.
    pub fn child(mut self, child: ChildSpec) -> Self {
        self.children.push(child);
        self
    }

    /// Append several children.
    pub fn children(mut self, children: impl IntoIterator<Item = ChildSpec>) -> Self {
        self.children.extend(children);
        self
    }
}

/// Sliding-window restart counter (pure; time is passed in).
#[derive(Debug, Clone)]
pub struct RestartIntensity {
    max: u32,
    period: Duration,
    history: std::collections::VecDeque<tokio::time::Instant>,
}

impl RestartIntensity {
    /// At most `max` restarts within any `period`.
    pub fn new(max: u32, period: Duration) -> Self {
        Self {
            max,
            period,
            history: Default::default(),
        }
    }

    /// Record a restart at `now`. Returns the number of restarts in the window including this
    /// one, or `None` when the budget is exceeded.
    pub fn record(&mut self, now: tokio::time::Instant) -> Option<u32> {
        while let Some(&t) = self.history.front() {
            if now.duration_since(t) >= self.period {
                self.history.pop_front();
            } else {
                break;
            }
        }
        self.history.push_back(now);
        let n = self.history.len() as u32;
        (n <= self.max).then_some(n)
    }
}
