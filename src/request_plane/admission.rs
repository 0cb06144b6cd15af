//! Admission control (load shedding), pure: checked before a request's body is read, from
//! this node's draining flag, this gateway's requests in flight and the fleet view Discovery
//! last published (no message to any actor on the way).
//!
//! A worker is busy when `kv_blocks_used / kv_blocks_total ≥ busy_kv_ratio` or
//! `waiting ≥ busy_waiting` (as of its node's last heartbeat, ≤ `cluster.heartbeat_interval_ms`
//! old). In order, a request is shed when this node is draining, when this gateway has
//! `max_in_flight` choices in flight, or when every live worker of a node that is up is busy;
//! it then gets **503** with `Retry-After: 1` and no work is done. With no worker at all the
//! request is admitted: the router answers "no worker is available".
//!
//! **Priority classes** (`priority.classes`, `priority.rs`): a class below the highest is held
//! to its fraction `(n − rank) / n` of `max_in_flight` and of `busy_waiting`, so the lowest
//! class is shed first; such a refusal — one the highest class would not get — is **429** with
//! `Retry-After: 1` (label `priority_class`). A class's own `ttft_target_ms` replaces
//! `gateway.ttft_target_ms` for its requests.
//!
//! **Admission that predicts** (`gateway.ttft_target_ms`, off by default): each worker reports
//! its predicted wait before a new request's prefill starts (`prefill_wait_ms`): the larger of
//! its queued prompt tokens through its own step-time model fitted online
//! (`scheduler/step_model.rs`, `StepCost::drain_ms` — the rate measured on that worker, not a
//! constant), the time its oldest request still waiting for admission has waited (requests
//! held back for KV blocks show there; CoDel's sojourn signal), and the requests waiting
//! divided by its admission rate over the last 5 s (Little's law: it rises as soon as a queue
//! forms, before anyone has waited long). When every live worker with a
//! prediction is predicted past the target (a worker without one yet counts as free), the
//! request is shed with 503; the body gives the least predicted wait and the target, and
//! `Retry-After` is the excess in seconds (rounded up, 1 to [`MAX_RETRY_AFTER_S`]). This is
//! the rule of SLO-aware admission in SLOs-Serve (Chen et al., 2025) and of Dynamo's planner
//! reduced to one gateway: refuse what would miss its TTFT anyway, so that what is admitted
//! meets it, instead of queueing every request until all miss. A heartbeat's prediction is as
//! old as that heartbeat (≤ `cluster.heartbeat_interval_ms`), so where the router runs on the
//! gateway's node its own load model counts too: the prompt tokens it has routed to each
//! worker and not yet seen a first token for (`router/load.rs`, published after every routing
//! message, read without a call), over the worker's measured `prefill_tokens_per_s`. A worker's
//! prediction is the larger of the two, so a burst routed since the last heartbeat is judged
//! on the queue it makes, not the one before it. A waiting prompt counts whole (the part a
//! prefix cache may still save once an earlier request computes it is not subtracted), so
//! many waiting requests sharing one uncached prefix make it err high.

use crate::control::discovery::membership::{NodeState, NodeView, WorkerView};
use crate::request_plane::error::{RETRY_AFTER_S, ShedReason};
use crate::request_plane::priority::ClassLevel;
use crate::runtime::ids::WorkerId;
use std::collections::HashMap;

/// Whether the fleet view shows a worker that may take requests.
pub fn has_worker(nodes: &[NodeView]) -> bool {
    nodes
        .iter()
        .filter(|n| n.state == NodeState::Up)
        .flat_map(|n| &n.workers)
        .any(|w| w.health.may_route())
}

/// Whether a planner that may bring a worker up is in the fleet: one publishing decisions in
/// mode `act`, or a planner node that has not published its first decision yet (it starts
/// within `planner.interval_s`; a request that finds it then waits, and stops waiting if it
/// turns out advisory).
pub fn planner_may_act(nodes: &[NodeView]) -> bool {
    nodes
        .iter()
        .filter(|n| n.state == NodeState::Up)
        .any(|n| match &n.planner {
            Some(p) => p.mode == crate::control::planner::PlannerMode::Act,
            None => n.roles.contains(&crate::runtime::role::NodeRole::Planner),
        })
}

/// Scale from zero: whether an admitted request waits for a worker to start (at most
/// `cold_start_timeout`, `gateway.cold_start_timeout_ms`) instead of going to the router
/// now — when no worker serves the model and a planner that acts is in the fleet. Without
/// such a planner a fleet with no worker refuses at once, as the router decides.
/// The live gateway (`actors/gateway/serve.rs`) and the simulator ask this.
pub fn waits_for_capacity(
    nodes: &[NodeView],
    planner_acts: bool,
    cold_start_timeout: std::time::Duration,
) -> bool {
    planner_acts && !cold_start_timeout.is_zero() && !has_worker(nodes)
}

/// Most seconds a TTFT-target refusal asks the client to wait.
pub const MAX_RETRY_AFTER_S: u64 = 60;

/// Admission thresholds (`gateway.busy_kv_ratio`, `gateway.busy_waiting`,
/// `gateway.max_in_flight`).
#[derive(Clone, Copy, Debug)]
pub struct Admission {
    /// See `gateway.busy_kv_ratio`.
    pub busy_kv_ratio: f64,
    /// See `gateway.busy_waiting`.
    pub busy_waiting: usize,
    /// See `gateway.max_in_flight`.
    pub max_in_flight: usize,
    /// See `gateway.ttft_target_ms`.
    pub ttft_target_ms: Option<u64>,
}

/// What admission decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionVerdict {
    /// Go on with the request.
    Admit,
    /// Refuse it now.
    Shed {
        /// Why.
        reason: ShedReason,
        /// Seconds the client should wait before retrying.
        retry_after_s: u64,
    },
    /// No fleet view is published (Discovery is restarting): the request cannot be judged.
    NoFleetView,
}

impl Admission {
    /// Decide on one request: `draining` is this node's flag, `in_flight` this gateway's
    /// requests (choices) in flight, `fleet` the published fleet view.
    pub fn decide(
        &self,
        draining: bool,
        in_flight: usize,
        fleet: Option<&[NodeView]>,
    ) -> AdmissionVerdict {
        self.decide_with(draining, in_flight, fleet, None)
    }

    /// [`Admission::decide`] with the prefill queues this node's router published, if one
    /// runs here (worker id → prompt tokens routed there and not yet prefilled).
    pub fn decide_with(
        &self,
        draining: bool,
        in_flight: usize,
        fleet: Option<&[NodeView]>,
        queues: Option<&HashMap<WorkerId, u64>>,
    ) -> AdmissionVerdict {
        self.decide_for(draining, in_flight, fleet, queues, None)
    }

    /// [`Admission::decide_with`] for a request of priority class `class`
    /// (`request_plane/priority.rs`, "Shedding"): a class below the highest is held to its
    /// fraction of `max_in_flight` and `busy_waiting` (refused with
    /// [`ShedReason::PriorityClass`], 429, where the highest class would still be admitted),
    /// and its own TTFT target, if it has one, replaces `ttft_target_ms`.
    pub fn decide_for(
        &self,
        draining: bool,
        in_flight: usize,
        fleet: Option<&[NodeView]>,
        queues: Option<&HashMap<WorkerId, u64>>,
        class: Option<ClassLevel>,
    ) -> AdmissionVerdict {
        // Held to a fraction of the thresholds: a class below the highest.
        let lower = class.filter(|c| !c.is_highest());
        let class_shed = |c: ClassLevel| AdmissionVerdict::Shed {
            reason: ShedReason::PriorityClass {
                rank: u16::try_from(c.rank).unwrap_or(u16::MAX),
                classes: u16::try_from(c.classes).unwrap_or(u16::MAX),
            },
            retry_after_s: RETRY_AFTER_S,
        };
        let shed = |reason| AdmissionVerdict::Shed {
            reason,
            retry_after_s: RETRY_AFTER_S,
        };
        if draining {
            return shed(ShedReason::Draining);
        }
        if in_flight >= self.max_in_flight {
            return shed(ShedReason::GatewayQueue);
        }
        if let Some(c) = lower
            && in_flight >= c.scaled(self.max_in_flight)
        {
            return class_shed(c);
        }
        let Some(fleet) = fleet else {
            return AdmissionVerdict::NoFleetView;
        };
        let mut workers = fleet
            .iter()
            .filter(|n| n.state == NodeState::Up)
            .flat_map(|n| &n.workers)
            .peekable();
        if workers.peek().is_some() {
            let class_waiting = lower.map(|c| c.scaled(self.busy_waiting));
            let (mut all, mut all_for_class) = (true, true);
            for w in workers {
                all &= self.busy(w, self.busy_waiting);
                if let Some(n) = class_waiting {
                    all_for_class &= self.busy(w, n);
                }
            }
            if all {
                return shed(ShedReason::AllWorkersBusy);
            }
            if let Some(c) = lower
                && all_for_class
            {
                return class_shed(c);
            }
        }
        let target = class.and_then(|c| c.ttft_target_ms).or(self.ttft_target_ms);
        if let Some(target) = target {
            let least = fleet
                .iter()
                .filter(|n| n.state == NodeState::Up)
                .flat_map(|n| &n.workers)
                .filter(|w| w.health.may_route())
                .map(|w| predicted_wait_ms(w, queues))
                .min();
            if let Some(least) = least
                && least > target
            {
                let excess_s = (least - target).div_ceil(1000);
                return AdmissionVerdict::Shed {
                    reason: ShedReason::TtftTarget {
                        predicted_ms: least,
                        target_ms: target,
                    },
                    retry_after_s: excess_s.clamp(1, MAX_RETRY_AFTER_S),
                };
            }
        }
        AdmissionVerdict::Admit
    }

    /// Whether `w` is above a threshold (`busy_waiting`: this request's share of it).
    fn busy(&self, w: &WorkerView, busy_waiting: usize) -> bool {
        w.waiting >= busy_waiting
            || (w.kv_blocks_total > 0
                && w.kv_blocks_used as f64 >= self.busy_kv_ratio * w.kv_blocks_total as f64)
    }
}

/// A worker's predicted wait before a new request's prefill starts (ms): the larger of its
/// heartbeat's `prefill_wait_ms` and the router's queue for it (`queues`: what was routed
/// there and not yet prefilled, a burst since the heartbeat included) at its measured
/// `prefill_tokens_per_s`. 0 with neither (no prediction yet: counts as free).
fn predicted_wait_ms(w: &WorkerView, queues: Option<&HashMap<WorkerId, u64>>) -> u64 {
    let beat = w.prefill_wait_ms.unwrap_or(0);
    let routed = match (
        queues.and_then(|q| q.get(w.id.as_str())),
        w.prefill_tokens_per_s,
    ) {
        (Some(&tokens), Some(rate)) if rate > 0 => tokens.saturating_mul(1000) / rate,
        _ => 0,
    };
    beat.max(routed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::discovery::membership::WorkerHealth;
    use crate::runtime::ids::NodeId;

    const A: Admission = Admission {
        busy_kv_ratio: 0.5,
        busy_waiting: 4,
        max_in_flight: 10,
        ttft_target_ms: None,
    };

    fn worker(used: usize, total: usize, waiting: usize) -> WorkerView {
        WorkerView {
            id: "n/replica-0".into(),
            state: "running".into(),
            kv_blocks_used: used,
            kv_blocks_total: total,
            waiting,
            ..WorkerView::default()
        }
    }

    fn node(state: NodeState, workers: Vec<WorkerView>) -> NodeView {
        NodeView {
            id: NodeId::new("n"),
            addr: String::new(),
            http_addr: None,
            roles: vec![],
            pid: 0,
            incarnation: 0,
            state,
            last_seen_ms: 0,
            workers,
            actors: vec![],
            counters: Default::default(),
            signals: None,
            planner: None,
            regions: vec![],
        }
    }

    fn shed(reason: ShedReason) -> AdmissionVerdict {
        AdmissionVerdict::Shed {
            reason,
            retry_after_s: 1,
        }
    }

    #[test]
    fn an_idle_fleet_admits() {
        let fleet = [node(NodeState::Up, vec![worker(0, 16, 0)])];
        assert_eq!(A.decide(false, 0, Some(&fleet)), AdmissionVerdict::Admit);
    }

    #[test]
    fn draining_comes_first_then_the_in_flight_cap() {
        let fleet = [node(NodeState::Up, vec![worker(16, 16, 9)])];
        assert_eq!(A.decide(true, 10, Some(&fleet)), shed(ShedReason::Draining));
        assert_eq!(A.decide(true, 0, None), shed(ShedReason::Draining));
        assert_eq!(
            A.decide(false, 10, Some(&fleet)),
            shed(ShedReason::GatewayQueue)
        );
        assert_eq!(A.decide(false, 10, None), shed(ShedReason::GatewayQueue));
        assert_eq!(A.decide(false, 9, None), AdmissionVerdict::NoFleetView);
    }

    #[test]
    fn sheds_only_when_every_live_worker_is_busy() {
        let kv_busy = worker(8, 16, 0);
        let queue_busy = worker(0, 16, 4);
        let free = worker(7, 16, 3);
        let all_busy = [node(
            NodeState::Up,
            vec![kv_busy.clone(), queue_busy.clone()],
        )];
        assert_eq!(
            A.decide(false, 0, Some(&all_busy)),
            shed(ShedReason::AllWorkersBusy)
        );
        let one_free = [
            node(NodeState::Up, vec![kv_busy.clone()]),
            node(NodeState::Up, vec![free.clone()]),
        ];
        assert_eq!(A.decide(false, 0, Some(&one_free)), AdmissionVerdict::Admit);
        // A free worker on a node that is not up does not count.
        let free_but_suspect = [
            node(NodeState::Up, vec![kv_busy]),
            node(NodeState::Suspect, vec![free]),
        ];
        assert_eq!(
            A.decide(false, 0, Some(&free_but_suspect)),
            shed(ShedReason::AllWorkersBusy)
        );
    }

    #[test]
    fn lower_classes_are_shed_first_and_the_highest_at_the_thresholds() {
        let class = |rank| {
            Some(ClassLevel {
                rank,
                classes: 2,
                ttft_target_ms: None,
            })
        };
        let low = shed(ShedReason::PriorityClass {
            rank: 1,
            classes: 2,
        });
        // Half the busy queue (4 → 2) on every worker: the low class is refused, not the high.
        let half = [node(
            NodeState::Up,
            vec![worker(0, 16, 2), worker(0, 16, 3)],
        )];
        assert_eq!(A.decide_for(false, 0, Some(&half), None, class(1)), low);
        assert_eq!(
            A.decide_for(false, 0, Some(&half), None, class(0)),
            AdmissionVerdict::Admit
        );
        let one_free = [node(
            NodeState::Up,
            vec![worker(0, 16, 2), worker(0, 16, 1)],
        )];
        assert_eq!(
            A.decide_for(false, 0, Some(&one_free), None, class(1)),
            AdmissionVerdict::Admit
        );
        // At the full threshold every class is refused, 503.
        let full = [node(NodeState::Up, vec![worker(0, 16, 4)])];
        assert_eq!(
            A.decide_for(false, 0, Some(&full), None, class(0)),
            shed(ShedReason::AllWorkersBusy)
        );
        // Half the in-flight cap (10 → 5).
        let idle = [node(NodeState::Up, vec![worker(0, 16, 0)])];
        assert_eq!(A.decide_for(false, 5, Some(&idle), None, class(1)), low);
        assert_eq!(
            A.decide_for(false, 5, Some(&idle), None, class(0)),
            AdmissionVerdict::Admit
        );
        let e = crate::request_plane::error::RequestError::Overloaded {
            reason: ShedReason::PriorityClass {
                rank: 1,
                classes: 2,
            },
            retry_after_s: 1,
        };
        assert_eq!(e.status(), 429);
        assert_eq!(e.retry_after_s(), Some(1));
    }

    #[test]
    fn a_class_target_replaces_the_gateway_target() {
        let w = WorkerView {
            prefill_wait_ms: Some(800),
            ..worker(0, 16, 0)
        };
        let fleet = [node(NodeState::Up, vec![w])];
        let strict = Some(ClassLevel {
            rank: 0,
            classes: 2,
            ttft_target_ms: Some(500),
        });
        assert!(matches!(
            A.decide_for(false, 0, Some(&fleet), None, strict),
            AdmissionVerdict::Shed {
                reason: ShedReason::TtftTarget { target_ms: 500, .. },
                ..
            }
        ));
        assert_eq!(
            A.decide_for(false, 0, Some(&fleet), None, None),
            AdmissionVerdict::Admit
        );
    }

    fn waiting(ms: Option<u64>, health: WorkerHealth) -> WorkerView {
        WorkerView {
            prefill_wait_ms: ms,
            health,
            ..worker(0, 16, 0)
        }
    }

    #[test]
    fn a_ttft_target_sheds_only_when_every_worker_is_predicted_past_it() {
        let a = Admission {
            ttft_target_ms: Some(2_000),
            ..A
        };
        let late = [node(
            NodeState::Up,
            vec![
                waiting(Some(2_500), WorkerHealth::Ready),
                waiting(Some(4_100), WorkerHealth::Ready),
            ],
        )];
        assert_eq!(
            a.decide(false, 0, Some(&late)),
            AdmissionVerdict::Shed {
                reason: ShedReason::TtftTarget {
                    predicted_ms: 2_500,
                    target_ms: 2_000
                },
                retry_after_s: 1,
            }
        );
        // The message says why, with the numbers.
        let m = ShedReason::TtftTarget {
            predicted_ms: 2_500,
            target_ms: 2_000,
        }
        .message();
        assert!(m.contains("2500 ms") && m.contains("2000 ms"), "{m}");
        // Retry-After is the excess, rounded up, capped.
        let very = [node(
            NodeState::Up,
            vec![waiting(Some(9_001), WorkerHealth::Ready)],
        )];
        assert!(matches!(
            a.decide(false, 0, Some(&very)),
            AdmissionVerdict::Shed {
                retry_after_s: 8,
                ..
            }
        ));
        let endless = [node(
            NodeState::Up,
            vec![waiting(Some(1_000_000_000), WorkerHealth::Ready)],
        )];
        assert!(matches!(
            a.decide(false, 0, Some(&endless)),
            AdmissionVerdict::Shed {
                retry_after_s: MAX_RETRY_AFTER_S,
                ..
            }
        ));
        // One worker in time, or one without a model yet: admitted.
        for free in [
            waiting(Some(1_999), WorkerHealth::Ready),
            waiting(None, WorkerHealth::Ready),
        ] {
            let fleet = [node(
                NodeState::Up,
                vec![waiting(Some(2_500), WorkerHealth::Ready), free],
            )];
            assert_eq!(a.decide(false, 0, Some(&fleet)), AdmissionVerdict::Admit);
        }
        // A draining or unhealthy worker's short queue does not count; off by default.
        let fleet = [node(
            NodeState::Up,
            vec![
                waiting(Some(2_500), WorkerHealth::Ready),
                waiting(Some(0), WorkerHealth::Draining),
                waiting(Some(0), WorkerHealth::Unhealthy),
            ],
        )];
        assert!(matches!(
            a.decide(false, 0, Some(&fleet)),
            AdmissionVerdict::Shed { .. }
        ));
        assert_eq!(A.decide(false, 0, Some(&late)), AdmissionVerdict::Admit);
    }

    /// A burst routed since the last heartbeat: the router's queue, at the worker's measured
    /// rate, is the prediction when it is the larger; without a rate or a queue, the heartbeat.
    #[test]
    fn the_routers_queue_predicts_a_burst_the_heartbeat_has_not_seen() {
        let a = Admission {
            ttft_target_ms: Some(1_500),
            ..A
        };
        let rated = |id: &str, ms: Option<u64>, rate: Option<u64>| WorkerView {
            id: id.into(),
            prefill_tokens_per_s: rate,
            ..waiting(ms, WorkerHealth::Ready)
        };
        // 16 000 tokens routed to a worker that prefills 4 000 tokens/s: 4 s, past 1.5 s.
        let queues: HashMap<WorkerId, u64> = [
            (WorkerId::new("n/replica-0"), 16_000),
            (WorkerId::new("n/replica-1"), 1_000),
        ]
        .into();
        let one = [node(
            NodeState::Up,
            vec![rated("n/replica-0", Some(100), Some(4_000))],
        )];
        assert_eq!(
            a.decide(false, 0, Some(&one)),
            AdmissionVerdict::Admit,
            "heartbeat alone"
        );
        assert_eq!(
            a.decide_with(false, 0, Some(&one), Some(&queues)),
            AdmissionVerdict::Shed {
                reason: ShedReason::TtftTarget {
                    predicted_ms: 4_000,
                    target_ms: 1_500
                },
                retry_after_s: 3,
            }
        );
        // A second worker with a short queue (250 ms) takes it.
        let two = [node(
            NodeState::Up,
            vec![
                rated("n/replica-0", Some(100), Some(4_000)),
                rated("n/replica-1", Some(100), Some(4_000)),
            ],
        )];
        assert_eq!(
            a.decide_with(false, 0, Some(&two), Some(&queues)),
            AdmissionVerdict::Admit
        );
        // The heartbeat's wait still counts when it is the larger (a memory queue, say).
        let beat = [node(
            NodeState::Up,
            vec![rated("n/replica-1", Some(2_000), Some(4_000))],
        )];
        assert!(matches!(
            a.decide_with(false, 0, Some(&beat), Some(&queues)),
            AdmissionVerdict::Shed { .. }
        ));
        // No measured rate, or a worker the router has nothing queued on: the heartbeat.
        let unrated = [node(
            NodeState::Up,
            vec![rated("n/replica-0", Some(100), None)],
        )];
        assert_eq!(
            a.decide_with(false, 0, Some(&unrated), Some(&queues)),
            AdmissionVerdict::Admit
        );
        let unknown = [node(
            NodeState::Up,
            vec![rated("n/replica-9", Some(100), Some(1))],
        )];
        assert_eq!(
            a.decide_with(false, 0, Some(&unknown), Some(&queues)),
            AdmissionVerdict::Admit
        );
    }

    #[test]
    fn no_worker_at_all_is_left_to_the_router() {
        assert_eq!(A.decide(false, 0, Some(&[])), AdmissionVerdict::Admit);
        let fleet = [node(NodeState::Up, vec![])];
        assert_eq!(A.decide(false, 0, Some(&fleet)), AdmissionVerdict::Admit);
        // A pool of unknown size is never KV-busy.
        let unknown = [node(NodeState::Up, vec![worker(5, 0, 0)])];
        assert_eq!(A.decide(false, 0, Some(&unknown)), AdmissionVerdict::Admit);
    }
}
