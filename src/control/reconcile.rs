//! What a reconciler applies of the planner's decisions, pure. Two reconcilers read the planner
//! through the published fleet view (a gateway's `/v1/fleet`), never by calling it: the local
//! one (`flotilla up --planner`, `cli/up.rs`: starts and drains node processes) and the
//! Kubernetes one (`flotilla reconcile`, `cli/reconcile.rs`: patches the replica count of each
//! pool's StatefulSet or Deployment). Both apply decisions only while the planner acts
//! (`planner.mode = act`) with fresh signals, each decision once ([`pending`]); both count in
//! nodes, each running `worker.replicas` replicas.
//!
//! And neither lets a lagging view cut a pool ([`change`]): a decision's `desired` comes from
//! the fleet view, which lags the world — after a gateway restart it may show no worker at
//! all, and pods started by hand are not in it until they join — so only a `down` decision
//! (which the planner makes after its calm intervals and cool-down) may lower a pool; `up`
//! and `hold` decisions may only raise it (a hold that waits on replicas it asked for keeps
//! asking: an `up` a reconciler missed is not lost). The decisions not applied yet are folded
//! oldest first ([`target`]), so a `down` missed while a reconciler backed off is applied
//! too; on its first pass it takes only the latest (older ones predate whatever was done by
//! hand since).

use crate::control::planner::{Action, Decision, PlannerMode, PlannerView, PoolDecision};
use crate::runtime::role::Role;

/// The highest leader term a reconciler has seen (`control/leadership.rs`): a decision made
/// under a lower term comes from a deposed leader and is refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fence {
    /// The highest term seen.
    pub term: u64,
    /// Times a leader's decisions were refused for a stale term.
    pub refused: u64,
}

/// The decisions to apply now, oldest first: the leading planner's decisions newer than
/// `last_applied_ms` (only its latest when nothing was applied yet), made in its current term,
/// when its latest is `act` and not stale. Only planners that lead count (a standby's view
/// is ignored; a view without leadership is a lone planner, term 0); should two claim to
/// lead, the higher term wins. A leader whose term is below `fence.term` is refused (counted
/// in `fence.refused`); otherwise `fence.term` rises to its term. Empty: nothing to do.
pub fn pending<'a>(
    planners: impl IntoIterator<Item = &'a PlannerView>,
    last_applied_ms: Option<u64>,
    fence: &mut Fence,
) -> Vec<&'a Decision> {
    let Some((view, term, latest)) = planners
        .into_iter()
        .filter_map(|p| Some((p, p.leading_term()?, p.latest()?)))
        .max_by_key(|(_, term, d)| (*term, d.at_ms))
    else {
        return Vec::new();
    };
    if term < fence.term {
        fence.refused += 1;
        return Vec::new();
    }
    fence.term = term;
    let fresh = last_applied_ms.is_none_or(|t| latest.at_ms > t);
    if latest.mode != PlannerMode::Act || latest.stale || !fresh || latest.term != term {
        return Vec::new();
    }
    match last_applied_ms {
        None => vec![latest],
        Some(t) => view
            .decisions
            .iter()
            .filter(|d| d.at_ms > t && d.mode == PlannerMode::Act && !d.stale && d.term == term)
            .collect(),
    }
}

/// Nodes a pool needs for `desired` replicas at `replicas_per_node` each (a node is the unit
/// a reconciler starts or drains; a partly used node still counts whole).
pub fn nodes_for(desired: u32, replicas_per_node: u32) -> u32 {
    desired.div_ceil(replicas_per_node.max(1))
}

/// The node count one decision brings a pool at `current` nodes to, if it changes it: a
/// `down` decision lowers it to its `desired`; an `up` or a `hold` raises it to its `desired`,
/// never lowers it (see the module doc).
pub fn change(pd: &PoolDecision, current: u32, replicas_per_node: u32) -> Option<u32> {
    let want = nodes_for(pd.desired, replicas_per_node);
    match pd.action {
        Action::Down if want < current => Some(want),
        Action::Up | Action::Hold if want > current => Some(want),
        _ => None,
    }
}

/// Pool `role` at `current` nodes after `pending` (oldest first): each decision's [`change`]
/// in turn; `None` when the pool ends where it is, or no decision names it.
pub fn target(
    pending: &[&Decision],
    role: Role,
    current: u32,
    replicas_per_node: u32,
) -> Option<u32> {
    let mut at = current;
    for pd in pending.iter().filter_map(|d| d.pool(role)) {
        if let Some(n) = change(pd, at, replicas_per_node) {
            at = n;
        }
    }
    (at != current).then_some(at)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            term: 0,
        }
    }

    fn view(d: Vec<Decision>) -> PlannerView {
        PlannerView {
            mode: PlannerMode::Act,
            interval_s: 10.0,
            capacity: String::new(),
            decisions: d,
            leadership: None,
        }
    }

    #[test]
    fn only_fresh_acting_decisions_are_applied_once() {
        let at = |p: Vec<&Decision>| p.iter().map(|d| d.at_ms).collect::<Vec<_>>();
        let act = view(vec![decision(1_000, PlannerMode::Act, false, 3)]);
        assert_eq!(
            at(pending([&act], None, &mut Fence::default())),
            vec![1_000]
        );
        assert!(
            pending([&act], Some(1_000), &mut Fence::default()).is_empty(),
            "applied once"
        );
        let advisory = view(vec![decision(2_000, PlannerMode::Advisory, false, 3)]);
        assert!(pending([&advisory], None, &mut Fence::default()).is_empty());
        let stale = view(vec![decision(2_000, PlannerMode::Act, true, 3)]);
        assert!(
            pending([&stale], None, &mut Fence::default()).is_empty(),
            "a stale decision holds"
        );
        // Two planners (a leader and one taking over): the newest decision's wins.
        let newer = view(vec![decision(5_000, PlannerMode::Act, false, 4)]);
        let p = pending([&act, &newer], Some(1_000), &mut Fence::default());
        assert_eq!(p.last().map(|d| d.pools[0].desired), Some(4));
        assert!(pending(std::iter::empty(), None, &mut Fence::default()).is_empty());
        // Several unapplied decisions: all since the last applied, oldest first (stale ones
        // skipped); on a first pass only the latest.
        let history = view(vec![
            decision(1_000, PlannerMode::Act, false, 3),
            decision(2_000, PlannerMode::Act, true, 3),
            decision(3_000, PlannerMode::Act, false, 3),
            decision(4_000, PlannerMode::Act, false, 3),
        ]);
        assert_eq!(
            at(pending([&history], Some(1_000), &mut Fence::default())),
            vec![3_000, 4_000]
        );
        assert_eq!(
            at(pending([&history], None, &mut Fence::default())),
            vec![4_000]
        );
    }

    #[test]
    fn only_the_leader_acts_and_a_deposed_leader_is_fenced() {
        use crate::control::leadership::Standing;
        let led = |term: u64, at: u64, desired: u32, leads: bool| {
            let mut d = decision(at, PlannerMode::Act, false, desired);
            d.term = term;
            let mut v = view(vec![d]);
            v.leadership = Some(if leads {
                Standing::Leader { term }
            } else {
                Standing::Standby { term, leader: None }
            });
            v
        };
        let mut fence = Fence::default();
        // A standby's decisions are ignored, even newer ones.
        let leader = led(3, 1_000, 2, true);
        let standby = led(3, 2_000, 9, false);
        let p = pending([&leader, &standby], None, &mut fence);
        assert_eq!(
            p.iter().map(|d| d.pools[0].desired).collect::<Vec<_>>(),
            vec![2]
        );
        assert_eq!(fence.term, 3);
        // Both claim to lead (a partition, seen from both sides): the higher term wins.
        let successor = led(4, 1_500, 5, true);
        let old = led(3, 3_000, 1, true);
        let p = pending([&old, &successor], Some(1_000), &mut fence);
        assert_eq!(
            p.iter().map(|d| d.pools[0].desired).collect::<Vec<_>>(),
            vec![5]
        );
        assert_eq!(fence.term, 4);
        // Only the deposed leader is in sight now (its side of the cut): refused.
        let p = pending([&old], Some(1_500), &mut fence);
        assert!(p.is_empty(), "a stale term acts on nothing");
        assert_eq!(fence.refused, 1);
        // A leader's decisions from before it led (term 0, as a standby) are not applied.
        let mut mixed = led(5, 4_000, 7, true);
        let mut early = decision(3_500, PlannerMode::Act, false, 8);
        early.term = 0;
        mixed.decisions.insert(0, early);
        let p = pending([&mixed], Some(3_000), &mut fence);
        assert_eq!(p.iter().map(|d| d.at_ms).collect::<Vec<_>>(), vec![4_000]);
    }

    #[test]
    fn nodes_round_up() {
        assert_eq!(nodes_for(0, 2), 0);
        assert_eq!(nodes_for(3, 2), 2);
        assert_eq!(nodes_for(4, 2), 2);
        assert_eq!(nodes_for(3, 0), 3, "0 replicas per node reads as 1");
    }

    #[test]
    fn a_lagging_view_never_cuts_a_pool() {
        let pd = |desired, action| {
            decision_with(1, PlannerMode::Act, false, desired, action).pools[0].clone()
        };
        // Up raises (5 replicas at 2 per node: 3 nodes); Down lowers.
        assert_eq!(change(&pd(5, Action::Up), 1, 2), Some(3));
        assert_eq!(change(&pd(1, Action::Down), 3, 1), Some(1));
        // Only a down lowers: a hold or an up whose `desired` reads a lagging view (3 pods
        // started by hand, a view emptied by a gateway restart) leaves the pool.
        assert_eq!(change(&pd(1, Action::Hold), 3, 1), None);
        assert_eq!(change(&pd(1, Action::Up), 3, 1), None);
        // A down never raises; a hold raises (it waits on replicas it asked for).
        assert_eq!(change(&pd(4, Action::Down), 3, 1), None);
        assert_eq!(change(&pd(4, Action::Hold), 3, 1), Some(4));
        assert_eq!(change(&pd(3, Action::Up), 3, 1), None, "already there");
    }

    #[test]
    fn missed_decisions_are_folded_in_order() {
        let d = |at, desired, action| decision_with(at, PlannerMode::Act, false, desired, action);
        // An up missed (the API refused it), then holds waiting on it: still raised.
        let (up, hold) = (d(1, 3, Action::Up), d(2, 3, Action::Hold));
        assert_eq!(target(&[&up, &hold], Role::Decode, 0, 1), Some(3));
        // A down missed while backing off, then a hold at the lower count: lowered.
        let (down, hold) = (d(1, 2, Action::Down), d(2, 2, Action::Hold));
        assert_eq!(target(&[&down, &hold], Role::Decode, 3, 1), Some(2));
        // Down then up: the last word.
        let up = d(3, 4, Action::Up);
        assert_eq!(target(&[&down, &up], Role::Decode, 3, 1), Some(4));
        // Nothing to do, or another pool's decisions.
        assert_eq!(target(&[&hold], Role::Decode, 2, 1), None);
        assert_eq!(target(&[&up], Role::Prefill, 2, 1), None);
    }
}
