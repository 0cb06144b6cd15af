//! Admission control (load shedding), pure: checked before a request's body is read, from
//! this node's draining flag, this gateway's requests in flight and the fleet view Discovery
//! last published (no message to any actor on the way).
//!
//! A worker is busy when `kv_blocks_used / kv_blocks_total ≥ busy_kv_ratio` or
//! `waiting ≥ busy_waiting` (as of its node's last heartbeat, ≤ `cluster.heartbeat_interval_ms`
//! old). In order, a request is shed when this node is draining, when this gateway has
//! `max_in_flight` choices in flight, or when every live worker of a node that is up is busy;
//! it then gets **503** with `Retry-After: 1` and no work is done. (429 is reserved for per-key
//! rate limits, which do not exist yet.) With no worker at all the request is admitted: the
//! router answers "no worker is available".

use crate::control::discovery::membership::{NodeState, NodeView, WorkerView};
use crate::request_plane::error::{RETRY_AFTER_S, ShedReason};

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
}

/// What admission decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
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
    pub fn decide(&self, draining: bool, in_flight: usize, fleet: Option<&[NodeView]>) -> Verdict {
        let shed = |reason| Verdict::Shed {
            reason,
            retry_after_s: RETRY_AFTER_S,
        };
        if draining {
            return shed(ShedReason::Draining);
        }
        if in_flight >= self.max_in_flight {
            return shed(ShedReason::GatewayQueue);
        }
        let Some(fleet) = fleet else {
            return Verdict::NoFleetView;
        };
        let mut workers = fleet
            .iter()
            .filter(|n| n.state == NodeState::Up)
            .flat_map(|n| &n.workers)
            .peekable();
        if workers.peek().is_some() && workers.all(|w| self.busy(w)) {
            return shed(ShedReason::AllWorkersBusy);
        }
        Verdict::Admit
    }

    /// Whether `w` is above a threshold.
    fn busy(&self, w: &WorkerView) -> bool {
        w.waiting >= self.busy_waiting
            || (w.kv_blocks_total > 0
                && w.kv_blocks_used as f64 >= self.busy_kv_ratio * w.kv_blocks_total as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::ids::NodeId;

    const A: Admission = Admission {
        busy_kv_ratio: 0.5,
        busy_waiting: 4,
        max_in_flight: 10,
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
            regions: vec![],
        }
    }

    fn shed(reason: ShedReason) -> Verdict {
        Verdict::Shed {
            reason,
            retry_after_s: 1,
        }
    }

    #[test]
    fn an_idle_fleet_admits() {
        let fleet = [node(NodeState::Up, vec![worker(0, 16, 0)])];
        assert_eq!(A.decide(false, 0, Some(&fleet)), Verdict::Admit);
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
        assert_eq!(A.decide(false, 9, None), Verdict::NoFleetView);
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
        assert_eq!(A.decide(false, 0, Some(&one_free)), Verdict::Admit);
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
    fn no_worker_at_all_is_left_to_the_router() {
        assert_eq!(A.decide(false, 0, Some(&[])), Verdict::Admit);
        let fleet = [node(NodeState::Up, vec![])];
        assert_eq!(A.decide(false, 0, Some(&fleet)), Verdict::Admit);
        // A pool of unknown size is never KV-busy.
        let unknown = [node(NodeState::Up, vec![worker(5, 0, 0)])];
        assert_eq!(A.decide(false, 0, Some(&unknown)), Verdict::Admit);
    }
}
