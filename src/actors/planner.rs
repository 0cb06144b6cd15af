//! The Planner actor (role `planner`): every `planner.interval_s` it reads the fleet view
//! this node's Discovery last published — never by calling every actor — turns it into the
//! interval's signals ([`ViewReader`]: the gateways' cumulative counts diffed, the workers
//! counted per pool), asks the pure policy ([`Planner`]) for a decision, and publishes it:
//! a log line, the gauges `flotilla_planner_desired_replicas{pool}` and
//! `flotilla_planner_actual_replicas{pool}`, and the [`PlannerBoard`] this node's heartbeat
//! carries (so every gateway's `/v1/fleet` and `flotilla status` show it).
//!
//! It starts and drains nothing itself: in mode `act` a reconciler (`flotilla up --planner`)
//! applies the desired counts; in mode `advisory` nobody does. A view that has not changed
//! for two intervals (this node's Discovery stopped publishing) makes the policy hold.
//!
//! Several nodes may hold the role: one leads, through a lease that a majority of the control
//! nodes (gateway, router or planner roles) grant it (`control/leadership.rs`, a
//! [`Candidate`] ticked every [`LEASE_TICK`]; the votes are RPCs to each control node's
//! Discovery). Only the leader plans (a fresh policy each time it is elected); standbys keep
//! reading the view and publish as standbys. The leader's decisions carry its term, and
//! reconcilers apply only a leader's, refusing a term below the highest they have seen.

use crate::control::discovery::FleetView;
use crate::control::discovery::membership::NodeView;
use crate::control::leadership::{Candidate, LeaseConfig, LeaseEffect, Standing, VoteReply};
use crate::control::planner::{
    Action, CapacityProfile, Decision, Planner, PlannerBoard, PlannerConfig, PlannerView,
    ViewReader,
};
use crate::runtime::clock::SharedClock;
use crate::runtime::ids::NodeId;
use crate::runtime::role::NodeRole;
use crate::runtime::wire::Wire;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// The Planner actor.
pub struct PlannerActor;

/// How often the leadership lease is looked at (ms).
pub const LEASE_TICK: Duration = Duration::from_millis(100);

/// Its messages (local only).
pub enum PlannerMsg {
    /// The interval's timer.
    Tick,
    /// The lease's timer.
    LeaseTick,
    /// A control node's answer to round `.0` of vote requests.
    Voted(u64, NodeId, VoteReply),
}

impl ractor::Message for PlannerMsg {}

/// What it starts with.
#[derive(Clone)]
pub struct PlannerArgs {
    pub config: PlannerConfig,
    pub capacity: CapacityProfile,
    /// The fleet view this node's Discovery publishes.
    pub fleet: FleetView,
    /// Where it publishes its view for the heartbeat.
    pub board: PlannerBoard,
    pub clock: SharedClock,
    /// This node's name (it stands for the lease under it).
    pub node: NodeId,
    /// The lease's timing (`cluster.liveness_timeout_ms`).
    pub lease: LeaseConfig,
    /// `cluster.liveness_timeout_ms`: how long it waits after start before it stands.
    pub liveness_ms: u64,
}

/// Its state.
pub struct PlannerState {
    args: PlannerArgs,
    planner: Planner,
    reader: ViewReader,
    /// Changes of the fleet view (a view that stops changing is stale).
    view: tokio::sync::watch::Receiver<Option<Arc<[NodeView]>>>,
    /// When the view last changed (ms since the Unix epoch).
    fresh_at_ms: u64,
    last_tick_ms: Option<u64>,
    decisions: VecDeque<Decision>,
    candidate: Candidate,
    /// The control nodes seen (the lease's voters): a control node that goes away keeps
    /// counting, so both sides of a partition count the same voters.
    voters: std::collections::BTreeSet<NodeId>,
}

impl Actor for PlannerActor {
    type Msg = PlannerMsg;
    type State = PlannerState;
    type Arguments = PlannerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: PlannerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let interval = Duration::from_secs_f64(args.config.interval_s);
        myself.send_interval(interval, || PlannerMsg::Tick);
        myself.send_interval(LEASE_TICK, || PlannerMsg::LeaseTick);
        tracing::info!(
            mode = ?args.config.mode,
            interval_s = args.config.interval_s,
            capacity = %args.capacity.source,
            "planner started"
        );
        let mut view = args.fleet.subscribe();
        view.mark_changed();
        let mut state = PlannerState {
            planner: Planner::new(args.config.clone(), args.capacity.clone()),
            reader: ViewReader::with_pools(&args.config.pools),
            fresh_at_ms: args.clock.wall_ms(),
            last_tick_ms: None,
            decisions: VecDeque::new(),
            candidate: Candidate::new(
                args.node.clone(),
                args.lease,
                // Planner nodes stand one after another when a lease runs out.
                (xxhash_rust::xxh3::xxh3_64(args.node.as_str().as_bytes()) % 4)
                    * args.lease.renew_ms,
            ),
            voters: std::iter::once(args.node.clone()).collect(),
            view,
            args,
        };
        // Stand only once the membership has had a liveness timeout to fill.
        state
            .candidate
            .hold_until(state.args.clock.wall_ms() + state.args.liveness_ms);
        state.publish();
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PlannerMsg::Tick => st.tick(),
            PlannerMsg::LeaseTick => {
                st.learn_voters();
                let now = st.args.clock.wall_ms();
                let effects = st.candidate.tick(now, st.voters.len());
                st.carry_out(&myself, effects);
            }
            PlannerMsg::Voted(round, from, reply) => {
                let now = st.args.clock.wall_ms();
                let effects = st.candidate.on_reply(round, from, &reply, now);
                st.carry_out(&myself, effects);
            }
        }
        Ok(())
    }
}

impl PlannerState {
    /// Adds the control nodes of the latest fleet view to the voters.
    fn learn_voters(&mut self) {
        let Some(nodes) = self.args.fleet.latest() else {
            return;
        };
        for n in nodes.iter() {
            let control = n
                .roles
                .iter()
                .any(|r| matches!(r, NodeRole::Gateway | NodeRole::Router | NodeRole::Planner));
            if control && !self.voters.contains(&n.id) {
                self.voters.insert(n.id.clone());
            }
        }
    }

    /// Sends a round's requests (one RPC per voter, each answer cast back), and says when it
    /// leads or stops leading.
    fn carry_out(&mut self, myself: &ActorRef<PlannerMsg>, effects: Vec<LeaseEffect>) {
        for e in effects {
            match e {
                LeaseEffect::Ask { round, request } => {
                    let timeout = self.args.lease.renew_ms;
                    for voter in &self.voters {
                        let name = format!("{voter}/discovery");
                        let Some(cell) = crate::runtime::cluster::member_named(
                            crate::control::discovery::DISCOVERY_GROUP,
                            &name,
                        ) else {
                            continue; // unreachable now: no vote
                        };
                        let disc: ActorRef<crate::actors::discovery::DiscoveryMsg> = cell.into();
                        let (me, voter, wire) =
                            (myself.clone(), voter.clone(), Wire::encode(&request));
                        tokio::spawn(async move {
                            let answer = ractor::call_t!(
                                disc,
                                crate::actors::discovery::DiscoveryMsg::Vote,
                                timeout,
                                wire
                            );
                            if let Ok(w) = answer
                                && let Ok(reply) = w.decode()
                            {
                                // The planner stopped: nothing to tell.
                                let _ = me.cast(PlannerMsg::Voted(round, voter, reply));
                            }
                        });
                    }
                }
                LeaseEffect::Elected { term } => {
                    tracing::info!(term, voters = self.voters.len(), "planner: leading");
                    // A fresh policy: hysteresis from its own decisions only, none from an
                    // earlier reign.
                    self.planner =
                        Planner::new(self.args.config.clone(), self.args.capacity.clone());
                    metrics::gauge!("flotilla_planner_leader").set(1.0);
                    metrics::gauge!("flotilla_planner_term").set(term as f64);
                    self.publish();
                }
                LeaseEffect::SteppedDown { term } => {
                    tracing::warn!(
                        term,
                        "planner: lease ran out without a majority; standing by"
                    );
                    metrics::gauge!("flotilla_planner_leader").set(0.0);
                    self.publish();
                }
            }
        }
    }

    /// Publishes the latest decisions and the standing for the heartbeat.
    fn publish(&self) {
        self.args.board.publish(PlannerView {
            mode: self.args.config.mode,
            interval_s: self.args.config.interval_s,
            capacity: self.args.capacity.source.clone(),
            decisions: self.decisions.iter().cloned().collect(),
            leadership: Some(self.candidate.standing()),
        });
    }

    fn tick(&mut self) {
        let now_ms = self.args.clock.wall_ms();
        if self.view.has_changed().unwrap_or(false) {
            self.view.borrow_and_update();
            self.fresh_at_ms = now_ms;
        }
        let window_s = self.last_tick_ms.map_or(self.args.config.interval_s, |t| {
            now_ms.saturating_sub(t) as f64 / 1000.0
        });
        self.last_tick_ms = Some(now_ms);
        let nodes = self.args.fleet.latest().unwrap_or_else(|| Arc::from([]));
        let signals = self.reader.read(&nodes, self.fresh_at_ms, window_s);
        // Only the leader plans: a standby's policy would keep hysteresis about changes no one
        // made (and take the fleet that stayed as a pool grown by hand). A standby keeps its
        // reader's baselines current, so its first interval as leader diffs one interval.
        let Standing::Leader { term } = self.candidate.standing() else {
            self.publish(); // a standby says so (and which term it has heard of)
            return;
        };
        let mut d = self.planner.plan(&signals, now_ms, None);
        d.term = term;
        for p in &d.pools {
            let pool = p.role.as_str();
            metrics::gauge!("flotilla_planner_desired_replicas", "pool" => pool)
                .set(f64::from(p.desired));
            metrics::gauge!("flotilla_planner_actual_replicas", "pool" => pool)
                .set(f64::from(p.actual));
            if p.action != Action::Hold || d.stale {
                tracing::info!(
                    pool,
                    actual = p.actual,
                    desired = p.desired,
                    action = ?p.action,
                    mode = ?d.mode,
                    term = d.term,
                    reason = %p.reason,
                    "planner decision"
                );
            }
        }
        for m in &d.manual {
            tracing::warn!(change = %m, "planner: a pool changed outside the planner");
        }
        self.decisions.push_back(d);
        while self.decisions.len() > PlannerView::KEEP {
            self.decisions.pop_front();
        }
        self.publish();
    }
}
