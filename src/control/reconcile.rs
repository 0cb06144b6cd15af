//! What a reconciler applies of the planner's decisions, pure. Two reconcilers read the planner
//! through the published fleet view (a gateway's `/v1/fleet`), never by calling it: the local
//! one (`flotilla up --planner`, `cli/up.rs`: starts and drains node processes) and the
//! Kubernetes one (`flotilla reconcile`, `cli/reconcile.rs`: patches the replica count of each
//! pool's StatefulSet or Deployment). Both apply a decision only when the planner acts
//! (`planner.mode = act`), its signals are fresh, and it is newer than the last one applied;
//! both count in nodes, each running `worker.replicas` replicas.

use crate::control::planner::{Decision, PlannerMode, PlannerView};
use crate::runtime::role::Role;

/// The decision to apply now, if any: the newest of the planners' latest decisions (one
/// planner leads; a second would publish its own), when it is `act`, not stale, and newer
/// than `last_applied_ms` (each decision is applied once).
pub fn actionable<'a>(
    planners: impl IntoIterator<Item = &'a PlannerView>,
    last_applied_ms: Option<u64>,
) -> Option<&'a Decision> {
    let d = planners
        .into_iter()
        .filter_map(PlannerView::latest)
        .max_by_key(|d| d.at_ms)?;
    let fresh = last_applied_ms.is_none_or(|t| d.at_ms > t);
    (d.mode == PlannerMode::Act && !d.stale && fresh).then_some(d)
}

/// Nodes a pool needs for `desired` replicas at `replicas_per_node` each (a node is the unit
/// a reconciler starts or drains; a partly used node still counts whole).
pub fn nodes_for(desired: u32, replicas_per_node: u32) -> u32 {
    desired.div_ceil(replicas_per_node.max(1))
}

/// Per pool in `d`: the node count to reach.
pub fn node_targets(d: &Decision, replicas_per_node: u32) -> Vec<(Role, u32)> {
    d.pools
        .iter()
        .map(|p| (p.role, nodes_for(p.desired, replicas_per_node)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::planner::policy::{Action, PoolDecision};

    fn decision(at_ms: u64, mode: PlannerMode, stale: bool, desired: u32) -> Decision {
        Decision {
            at_ms,
            mode,
            stale,
            signals_age_ms: 0,
            forecast: None,
            pools: vec![PoolDecision {
                role: Role::Decode,
                actual: 1,
                desired,
                action: Action::Hold,
                needed: desired,
                load_tokens_per_s: 0.0,
                correction: 1.0,
                reason: String::new(),
            }],
            manual: vec![],
            cost_per_hour: 0.0,
        }
    }

    fn view(d: Vec<Decision>) -> PlannerView {
        PlannerView {
            mode: PlannerMode::Act,
            interval_s: 10.0,
            capacity: String::new(),
            decisions: d,
        }
    }

    #[test]
    fn only_fresh_acting_decisions_are_applied_once() {
        let act = view(vec![decision(1_000, PlannerMode::Act, false, 3)]);
        assert_eq!(actionable([&act], None).map(|d| d.at_ms), Some(1_000));
        assert!(actionable([&act], Some(1_000)).is_none(), "applied once");
        let advisory = view(vec![decision(2_000, PlannerMode::Advisory, false, 3)]);
        assert!(actionable([&advisory], None).is_none());
        let stale = view(vec![decision(2_000, PlannerMode::Act, true, 3)]);
        assert!(
            actionable([&stale], None).is_none(),
            "a stale decision holds"
        );
        // Two planners (a leader and one taking over): the newest decision wins.
        let newer = view(vec![decision(5_000, PlannerMode::Act, false, 4)]);
        let d = actionable([&act, &newer], Some(1_000)).expect("the newer one");
        assert_eq!(d.pools[0].desired, 4);
        assert!(actionable(std::iter::empty(), None).is_none());
    }

    #[test]
    fn nodes_round_up() {
        assert_eq!(nodes_for(0, 2), 0);
        assert_eq!(nodes_for(3, 2), 2);
        assert_eq!(nodes_for(4, 2), 2);
        assert_eq!(nodes_for(3, 0), 3, "0 replicas per node reads as 1");
        let d = decision(1, PlannerMode::Act, false, 5);
        assert_eq!(node_targets(&d, 2), vec![(Role::Decode, 3)]);
    }
}
