//! What a reconciler applies of the planner's decisions, pure. Two reconcilers read the planner
//! through the published fleet view (a gateway's `/v1/fleet`), never by calling it: the local
//! one (`flotilla up --planner`, `cli/up.rs`: starts and drains node processes) and the
//! Kubernetes one (`flotilla reconcile`, `cli/reconcile.rs`: patches the replica count of each
//! pool's StatefulSet or Deployment). Both apply a decision only when the planner acts
//! (`planner.mode = act`), its signals are fresh, and it is newer than the last one applied;
//! both count in nodes, each running `worker.replicas` replicas.
//!
//! And both apply only the planner's *changes* ([`change`]): an `up` decision may raise a
//! pool, a `down` decision may lower it, a `hold` touches nothing. The decision's `desired`
//! is computed from the fleet view, which lags the world — after a gateway restart it may
//! show no worker at all, and pods started by hand are not in it until they join — so
//! reconciling `hold` decisions would cut a pool the planner never chose to cut, bypassing
//! its calm intervals and cool-down, and would undo a manual scale-up before the planner
//! could notice and adopt it.

use crate::control::planner::{Action, Decision, PlannerMode, PlannerView, PoolDecision};

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

/// The node count a reconciler should bring a pool at `current` nodes to, if any: an `up`
/// decision above `current`, a `down` decision below it; `None` otherwise (see the module
/// doc for why `hold`, and changes against the decision's direction, are left alone).
pub fn change(pd: &PoolDecision, current: u32, replicas_per_node: u32) -> Option<u32> {
    let want = nodes_for(pd.desired, replicas_per_node);
    match pd.action {
        Action::Up if want > current => Some(want),
        Action::Down if want < current => Some(want),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::role::Role;

    fn decision(at_ms: u64, mode: PlannerMode, stale: bool, desired: u32) -> Decision {
        decision_with(at_ms, mode, stale, desired, Action::Hold)
    }

    fn decision_with(
        at_ms: u64,
        mode: PlannerMode,
        stale: bool,
        desired: u32,
        action: Action,
    ) -> Decision {
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
                action,
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
    }

    #[test]
    fn only_the_planners_changes_are_applied() {
        let pd = |desired, action| {
            decision_with(1, PlannerMode::Act, false, desired, action).pools[0].clone()
        };
        // Up raises (5 replicas at 2 per node: 3 nodes); Down lowers.
        assert_eq!(change(&pd(5, Action::Up), 1, 2), Some(3));
        assert_eq!(change(&pd(1, Action::Down), 3, 1), Some(1));
        // A hold never moves a pool, whatever the view made `desired`: 3 pods started by
        // hand, or a view emptied by a gateway restart.
        assert_eq!(change(&pd(1, Action::Hold), 3, 1), None);
        assert_eq!(change(&pd(4, Action::Hold), 3, 1), None);
        // An up decision never lowers (a lagging view: it asks for 1, the pool has 3), a
        // down decision never raises.
        assert_eq!(change(&pd(1, Action::Up), 3, 1), None);
        assert_eq!(change(&pd(4, Action::Down), 3, 1), None);
        assert_eq!(change(&pd(3, Action::Up), 3, 1), None, "already there");
    }
}
