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

use crate::control::discovery::FleetView;
use crate::control::discovery::membership::NodeView;
use crate::control::planner::{
    Action, CapacityProfile, Decision, Planner, PlannerBoard, PlannerConfig, PlannerView,
    ViewReader,
};
use crate::runtime::clock::SharedClock;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// The Planner actor.
pub struct PlannerActor;

/// Its messages (local only).
pub enum PlannerMsg {
    /// The interval's timer.
    Tick,
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
        tracing::info!(
            mode = ?args.config.mode,
            interval_s = args.config.interval_s,
            capacity = %args.capacity.source,
            "planner started"
        );
        let mut view = args.fleet.subscribe();
        view.mark_changed();
        Ok(PlannerState {
            planner: Planner::new(args.config.clone(), args.capacity.clone()),
            reader: ViewReader::with_pools(&args.config.pools),
            fresh_at_ms: args.clock.wall_ms(),
            last_tick_ms: None,
            decisions: VecDeque::new(),
            view,
            args,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PlannerMsg::Tick => st.tick(),
        }
        Ok(())
    }
}

impl PlannerState {
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
        let d = self.planner.plan(&signals, now_ms, None);
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
        self.args.board.publish(PlannerView {
            mode: self.args.config.mode,
            interval_s: self.args.config.interval_s,
            capacity: self.args.capacity.source.clone(),
            decisions: self.decisions.iter().cloned().collect(),
        });
    }
}
