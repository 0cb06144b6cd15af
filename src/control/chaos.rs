//! Chaos: faults injected on purpose while load runs.
//!
//! The gateway's `/chaos/faults` routes ([`ChaosController`]) resolve a fault's target to
//! workers from the fleet view and send it to the Chaos actor of each affected node (process
//! group [`CHAOS_GROUP`], name `<node>/chaos`). One-shot kinds (`kill_actor`, `kill_node`,
//! `panic_task`) and `partition` act in the Chaos actor; the others are recorded in the node's
//! [`FaultBook`] (ids, ends) and written by the Chaos actor into the filter type of the
//! boundary where each acts (the boundary owns that type and reads nothing else of chaos):
//! - [`WorkerFaults`](crate::worker::faults::WorkerFaults), the replicas': the engine's
//!   chaos filter ([`ChaosEngine`](crate::worker::engine::ChaosEngine)) applies `slow` (a
//!   delay before every engine step), `fail_engine` (the step fails after a number of further
//!   steps; every sequence of the step then fails with an error record) and `hang` (steps and
//!   canary pings are not answered); the scheduler holds blocks of its pool beside the batch
//!   former (`fill_kv`) and panics (`panic`);
//! - [`KvEventFaults`](crate::kv::faults::KvEventFaults), the KV event publishers': the
//!   publisher ([`KvEventPublisher`](crate::actors::kv_publisher::KvEventPublisher)) drops a
//!   fraction of the events on their way to the routers (`drop_kv_events`);
//! - the node's KV transport ([`TransferFaults`](crate::transport::TransferFaults)) delays
//!   (`delay_kv_transfer`) or fails (`drop_kv_transfer`) its pulls, and refuses pulls across a
//!   `partition`.
//!
//! A fault with `duration_ms` ends by itself on each node it hit: its end is kept in the node's
//! book ([`FaultBook::apply_at`]) and the node's Chaos actor clears it when the time is up
//! ([`FaultBook::expire`], every 100 ms), whatever became of the gateway that created it or of
//! an earlier incarnation of the actor. `DELETE /chaos/faults/{id}` clears it at once. A
//! fault that could not reach every node it targets is dropped again by the ones it reached.
//! The routes exist only when `chaos.enabled` (`flotilla up --chaos`).
//!
//! The actor is [`crate::actors::chaos`]; this module is its pure part: the fault kinds and
//! the book, which holds no actor.
//!
//! [`ChaosController`]: crate::actors::gateway::state::ChaosController

use crate::runtime::clock::Instant;
use crate::runtime::ids::{NodeId, WorkerId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Process group of every Chaos actor.
pub const CHAOS_GROUP: &str = "flotilla.chaos";

/// Exit status of a node process killed by a `kill_node` fault (sysexits' `EX_TEMPFAIL`, 75):
/// how `flotilla up` tells an injected kill from a crash.
pub const CHAOS_KILL_EXIT: i32 = 75;

/// What a fault does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FaultKind {
    /// Add `delay_ms` before every engine step of the target workers.
    Slow {
        /// Added delay per step (ms).
        delay_ms: u64,
    },
    /// Fail the engine step of the target workers after `after_steps` more steps.
    FailEngine {
        /// Steps that still succeed.
        #[serde(default)]
        after_steps: u64,
    },
    /// The engines of the target workers stop answering (steps and canary pings) while their
    /// processes go on. Lasts until the fault is cleared or the replica is restarted — which
    /// the scheduler's step watchdog does after `worker.step_timeout_ms`.
    Hang,
    /// Kill one actor of each target (no cleanup runs, as after a crash); its supervisor
    /// reacts. `actor`: `replica` (the replica's supervisor and so all of it), `scheduler`,
    /// `engine`, `kv_publisher` — or a node-wide actor of the target's node: `router`,
    /// `http_gateway`, `token_sink`, `discovery`, `worker_pool` (the supervisor of its
    /// replicas).
    KillActor {
        /// Which actor (default `replica`).
        #[serde(default)]
        actor: ActorKind,
    },
    /// The target's node process exits abruptly with status [`CHAOS_KILL_EXIT`]: no destructor
    /// runs and no actor stops, so to its peers it is a SIGKILL. `flotilla up` starts it again, and does not
    /// count it against `--max-restarts` (a budget against crash loops, not injected faults).
    KillNode,
    /// The target workers' KV event publishers drop this fraction of their KV events on the
    /// way to the routers (seeded by the fault's `seed`): routers see gaps and resync from
    /// snapshots.
    DropKvEvents {
        /// Fraction of events dropped, in `[0, 1]`.
        rate: f64,
    },
    /// Occupy this fraction of the target workers' KV blocks (free or evictable ones) with a
    /// phantom sequence until the fault ends; admission and shedding see the fuller pool.
    FillKv {
        /// Fraction of the pool, in `[0, 1]`.
        fraction: f64,
    },
    /// The target workers' schedulers panic while handling their next message (their
    /// supervisor restarts the replica; the panic is counted).
    Panic,
    /// Cut the nodes in `nodes` off from all the others (every node refuses sessions across
    /// the cut: a filter on the inter-node path), then heal after `duration_ms` (required).
    /// `DELETE` heals the side the gateway still reaches at once; the far side heals at the
    /// deadline.
    Partition {
        /// One side of the cut.
        nodes: Vec<String>,
    },
    /// A bare task on the target's node panics — one no supervisor watches; the panic hook
    /// counts and logs it (`flotilla_panics_total`).
    PanicTask,
    /// Every KV transfer the target's node pulls is held back `delay_ms` first (the largest
    /// such delay in force applies).
    DelayKvTransfer {
        /// Added delay per pull (ms).
        delay_ms: u64,
    },
    /// The target's node fails this fraction of its KV pulls before any byte moves (seeded by
    /// the fault's `seed`; the latest such fault applies).
    DropKvTransfer {
        /// Fraction of pulls failed, in `[0, 1]`.
        rate: f64,
    },
}

/// The actors `kill_actor` can name: a part of each target worker, or an actor of the target's
/// node. The wire names are the actors' registered names (`<worker>/<name>`,
/// `<node>/<name>`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActorKind {
    /// The replica's supervisor, and so all of the replica.
    #[default]
    Replica,
    /// The replica's scheduler.
    Scheduler,
    /// The replica's engine worker.
    Engine,
    /// The replica's KV event publisher.
    KvPublisher,
    /// The node's router.
    Router,
    /// The node's HTTP gateway.
    HttpGateway,
    /// The node's token sink.
    TokenSink,
    /// The node's Discovery.
    Discovery,
    /// The supervisor of the node's replicas.
    WorkerPool,
}

impl ActorKind {
    /// Every kind, in the order the API lists them.
    pub const ALL: [ActorKind; 9] = [
        ActorKind::Replica,
        ActorKind::Scheduler,
        ActorKind::Engine,
        ActorKind::KvPublisher,
        ActorKind::Router,
        ActorKind::HttpGateway,
        ActorKind::TokenSink,
        ActorKind::Discovery,
        ActorKind::WorkerPool,
    ];

    /// The registered name's last part.
    pub fn as_str(self) -> &'static str {
        match self {
            ActorKind::Replica => "replica",
            ActorKind::Scheduler => "scheduler",
            ActorKind::Engine => "engine",
            ActorKind::KvPublisher => "kv_publisher",
            ActorKind::Router => "router",
            ActorKind::HttpGateway => "http_gateway",
            ActorKind::TokenSink => "token_sink",
            ActorKind::Discovery => "discovery",
            ActorKind::WorkerPool => "worker_pool",
        }
    }

    /// One per node (not per worker).
    pub fn is_node_wide(self) -> bool {
        matches!(
            self,
            ActorKind::Router
                | ActorKind::HttpGateway
                | ActorKind::TokenSink
                | ActorKind::Discovery
                | ActorKind::WorkerPool
        )
    }
}

impl std::fmt::Display for ActorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FaultKind {
    /// One-shot kinds act once when installed and stay listed only as history.
    pub fn is_one_shot(&self) -> bool {
        matches!(
            self,
            FaultKind::KillActor { .. }
                | FaultKind::KillNode
                | FaultKind::Panic
                | FaultKind::PanicTask
        )
    }
}

/// Whom a fault hits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// One worker by id (`node-1/replica-0`).
    Worker(WorkerId),
    /// Every worker of a node.
    Node(NodeId),
    /// A worker with in-flight requests (the busiest).
    AnyBusy,
}

fn any_busy() -> Target {
    Target::AnyBusy
}

/// A fault as the API receives it: `{"kind": "slow", "delay_ms": 2000, "target": {"worker":
/// "node-1/replica-0"} | {"node": "node-1"} | "any_busy", "duration_ms": 5000}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FaultSpec {
    /// What it does.
    #[serde(flatten)]
    pub kind: FaultKind,
    /// Whom it hits (default `any_busy`; ignored by `partition`, which names its nodes).
    #[serde(default = "any_busy")]
    pub target: Target,
    /// Clears itself after this long; `None`: until deleted.
    #[serde(default)]
    pub duration_ms: Option<u64>,
    /// Seed of randomised kinds (`drop_kv_events`; the fault id when absent).
    #[serde(default)]
    pub seed: Option<u64>,
}

/// A fault sent to a node: its id, what it does, and the workers it hits there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Injection {
    /// Fault id.
    pub id: u64,
    /// The node it is sent to.
    #[serde(default)]
    pub node: String,
    /// What it does.
    pub kind: FaultKind,
    /// Workers hit.
    pub workers: Vec<WorkerId>,
    /// Seed of randomised kinds.
    #[serde(default)]
    pub seed: Option<u64>,
    /// How long it lasts (ms); each node it hit ends it by itself then.
    #[serde(default)]
    pub duration_ms: Option<u64>,
}

/// Fault id → (workers hit, what it does).
type Faults = HashMap<u64, (Vec<WorkerId>, FaultKind)>;

/// The faults active in this process, by fault id, with their ends; it keeps the transport's
/// filter ([`TransferFaults`](crate::transport::TransferFaults)) in step. The Chaos actor
/// writes the others into their boundaries' filters
/// ([`FaultFilters`](crate::actors::chaos::FaultFilters)).
#[derive(Clone, Default, Debug)]
pub struct FaultBook {
    inner: Arc<Mutex<Faults>>,
    /// The node transport's filters (`delay_kv_transfer`, `drop_kv_transfer`, partitions),
    /// kept in step with the book by the Chaos actor.
    pub transfer: crate::transport::TransferFaults,
    /// When each timed fault ends, on the clock of whoever applied it (the node's Chaos
    /// actor). Kept in the book, not in a timer, so a fault outlives neither a restart of the
    /// Chaos actor nor the gateway that created it: [`FaultBook::expire`] clears it.
    until: Arc<Mutex<HashMap<u64, Instant>>>,
}

impl FaultBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record an injection (`seed` seeds randomised kinds) that ends by itself at `until`
    /// (its `duration_ms` after `now`, when it has one).
    pub fn apply_at(&self, inj: Injection, now: Instant) {
        if let Some(ms) = inj.duration_ms {
            self.until
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(inj.id, now + Duration::from_millis(ms));
        }
        self.apply(inj);
    }

    /// Clear every timed fault whose end is not after `now`; returns them (id, kind).
    pub fn expire(&self, now: Instant) -> Vec<(u64, FaultKind)> {
        let due: Vec<u64> = {
            let mut until = self.until.lock().unwrap_or_else(|p| p.into_inner());
            let due: Vec<u64> = until
                .iter()
                .filter(|(_, t)| **t <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in &due {
                until.remove(id);
            }
            due
        };
        due.into_iter()
            .filter_map(|id| self.remove(id).map(|kind| (id, kind)))
            .collect()
    }

    /// Ids of the faults in force on this node.
    pub fn active(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.lock().keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Record an injection with no end of its own (`seed` seeds randomised kinds).
    pub fn apply(&self, inj: Injection) {
        if let FaultKind::DropKvTransfer { rate } = inj.kind {
            self.transfer
                .set_drop(Some((rate, inj.seed.unwrap_or(inj.id))));
        }
        self.lock().insert(inj.id, (inj.workers, inj.kind));
        self.sync_transfer(None);
    }

    /// Brings the transport's filters in line with the book (`cleared`: a fault just removed).
    fn sync_transfer(&self, cleared: Option<&FaultKind>) {
        let book = self.lock();
        let delay = book
            .values()
            .filter_map(|(_, k)| match k {
                FaultKind::DelayKvTransfer { delay_ms } => Some(*delay_ms),
                _ => None,
            })
            .max();
        self.transfer.set_delay(delay.map(Duration::from_millis));
        if matches!(cleared, Some(FaultKind::DropKvTransfer { .. })) {
            // The latest drop fault still in force, if any, takes over.
            let next = book
                .iter()
                .filter_map(|(id, (_, k))| match k {
                    FaultKind::DropKvTransfer { rate } => Some((*id, *rate)),
                    _ => None,
                })
                .max_by_key(|(id, _)| *id);
            self.transfer.set_drop(next.map(|(id, rate)| (rate, id)));
        }
    }

    /// Remove a fault; false when unknown.
    pub fn clear(&self, id: u64) -> bool {
        self.remove(id).is_some()
    }

    /// Remove a fault and its end; its kind, or `None` when unknown.
    fn remove(&self, id: u64) -> Option<FaultKind> {
        self.until
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        let (_, kind) = self.lock().remove(&id)?;
        self.sync_transfer(Some(&kind));
        Some(kind)
    }
}

/// Registered name of the actor `actor` for `worker` (see [`FaultKind::KillActor`]).
pub fn actor_name(actor: ActorKind, worker: &WorkerId) -> String {
    let node = worker.as_str().split('/').next().unwrap_or_default();
    match actor {
        ActorKind::Replica => worker.to_string(),
        a if a.is_node_wide() => format!("{node}/{a}"),
        a => format!("{worker}/{a}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_apply_to_their_workers_and_clear() {
        let book = FaultBook::default();
        let (a, b) = (WorkerId::new("n/a"), WorkerId::new("n/b"));
        book.apply(Injection {
            node: "n".into(),
            id: 1,
            kind: FaultKind::Slow { delay_ms: 5 },
            workers: vec![a.clone()],
            seed: None,
            duration_ms: None,
        });
        book.apply(Injection {
            node: "n".into(),
            id: 2,
            kind: FaultKind::FailEngine { after_steps: 1 },
            workers: vec![b.clone()],
            seed: None,
            duration_ms: None,
        });
        assert_eq!(book.active(), vec![1, 2]);
        assert!(book.clear(1) && !book.clear(1));
        assert_eq!(book.active(), vec![2]);
    }

    #[test]
    fn timed_faults_expire_at_their_end_and_untimed_ones_stay() {
        let book = FaultBook::default();
        let w = WorkerId::new("n/a");
        let t0 = crate::runtime::clock::Instant::now();
        let inj = |id, duration_ms| Injection {
            node: "n".into(),
            id,
            kind: FaultKind::Slow { delay_ms: 5 },
            workers: vec![w.clone()],
            seed: None,
            duration_ms,
        };
        book.apply_at(inj(1, Some(100)), t0);
        book.apply_at(inj(2, None), t0);
        book.apply_at(inj(3, Some(300)), t0);
        assert!(book.expire(t0 + Duration::from_millis(99)).is_empty());
        let gone: Vec<u64> = book
            .expire(t0 + Duration::from_millis(100))
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(gone, vec![1]);
        assert!(book.clear(3), "cleared early by hand");
        assert!(book.expire(t0 + Duration::from_secs(3600)).is_empty());
        assert_eq!(book.active(), vec![2]);
    }

    #[test]
    fn transfer_faults_follow_the_book() {
        use crate::transport::TransferVerdict;
        let book = FaultBook::default();
        let inj = |id, kind| Injection {
            node: "n".into(),
            id,
            kind,
            workers: vec![WorkerId::new("n/a")],
            seed: Some(9),
            duration_ms: None,
        };
        assert_eq!(book.transfer.verdict("m/r0"), TransferVerdict::Pass);
        book.apply(inj(1, FaultKind::DelayKvTransfer { delay_ms: 50 }));
        book.apply(inj(2, FaultKind::DelayKvTransfer { delay_ms: 20 }));
        assert_eq!(
            book.transfer.verdict("m/r0"),
            TransferVerdict::Delay(Duration::from_millis(50)),
            "the largest delay in force"
        );
        book.clear(1);
        assert_eq!(
            book.transfer.verdict("m/r0"),
            TransferVerdict::Delay(Duration::from_millis(20))
        );
        book.clear(2);
        book.apply(inj(3, FaultKind::DropKvTransfer { rate: 1.0 }));
        assert!(matches!(
            book.transfer.verdict("m/r0"),
            TransferVerdict::Drop(_)
        ));
        book.clear(3);
        assert_eq!(book.transfer.verdict("m/r0"), TransferVerdict::Pass);
    }

    #[test]
    fn specs_parse_from_the_documented_json() {
        let f: FaultSpec = serde_json::from_str(
            r#"{"kind": "slow", "delay_ms": 2000, "target": {"worker": "node-1/replica-0"}, "duration_ms": 5000}"#,
        )
        .unwrap();
        assert_eq!(f.kind, FaultKind::Slow { delay_ms: 2000 });
        assert_eq!(f.target, Target::Worker(WorkerId::new("node-1/replica-0")));
        let f: FaultSpec = serde_json::from_str(
            r#"{"kind": "fail_engine", "after_steps": 10, "target": "any_busy"}"#,
        )
        .unwrap();
        assert_eq!(f.target, Target::AnyBusy);
    }
}
