use crate::control::discovery::membership::{NodeState, NodeView};
use crate::control::planner::{PlannerMode, PlannerView};
use crate::request_plane::admission::planner_may_act;
use crate::runtime::role::NodeRole;

fn node(roles: Vec<NodeRole>, state: NodeState, mode: Option<PlannerMode>) -> NodeView {
    NodeView {
        id: crate::runtime::ids::NodeId::new("node-0"),
        addr: String::new(),
        http_addr: None,
        roles,
        pid: 0,
        incarnation: 1,
        state,
        last_seen_ms: 0,
        workers: vec![],
        actors: vec![],
        counters: Default::default(),
        signals: None,
        planner: mode.map(|mode| PlannerView {
            mode,
            interval_s: 10.0,
            capacity: String::new(),
            decisions: vec![],
            leadership: None,
        }),
        regions: vec![],
    }
}

#[test]
fn a_request_waits_for_capacity_only_while_a_planner_may_act() {
    use NodeState::{Down, Up};
    let planner = vec![NodeRole::Gateway, NodeRole::Planner];
    // Published, acting: wait. Published, advisory: nothing will start a worker.
    assert!(planner_may_act(&[node(
        planner.clone(),
        Up,
        Some(PlannerMode::Act)
    )]));
    assert!(!planner_may_act(&[node(
        planner.clone(),
        Up,
        Some(PlannerMode::Advisory)
    )]));
    // A planner node before its first decision may act (a request right after start).
    assert!(planner_may_act(&[node(planner.clone(), Up, None)]));
    // No planner, or a planner node that is down: refuse at once.
    assert!(!planner_may_act(&[node(vec![NodeRole::Gateway], Up, None)]));
    assert!(!planner_may_act(&[node(
        planner,
        Down,
        Some(PlannerMode::Act)
    )]));
}
