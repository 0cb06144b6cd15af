//! The generic supervisor actor.
//!
//! Starts its children in order; when one exits, decides from its restart type and the
//! strategy which children to stop (in reverse start order, honouring each child's shutdown)
//! and restart (in start order, after a backoff); counts restarts in a sliding window and,
//! past the budget, stops every child and fails so that its own parent decides (escalation).
//! On stop it stops its children in reverse start order. Dynamic children (per-request,
//! per-replica) are added and removed at run time with [`SupervisorMsg::StartChild`] /
//! [`SupervisorMsg::TerminateChild`]; they come after the static children in stop order.
//!
//! ractor's default `handle_supervisor_evt` (stop the supervisor when any child exits) is
//! never used: every child exit goes through [`Supervisor::on_child_exit`].
//!
//! Exit classification (OTP's): a stop with no reason, `normal`, `shutdown` or
//! `shutdown:<detail>` is *normal*; a failure (panic or error), a kill, or any other stop
//! reason is *abnormal*.

use super::spec::{ChildSpec, Restart, RestartIntensity, Shutdown, Strategy, SupervisorSpec};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::time::Duration;

/// How long a killed child is waited for.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// Messages a supervisor accepts (local only).
pub enum SupervisorMsg {
    /// Start a dynamic child (its id must be unique); replies with its cell. Never dropped.
    StartChild(ChildSpec, RpcReplyPort<Result<ActorCell, String>>),
    /// Stop a child by id (static or dynamic) with its shutdown rule; it is not restarted and
    /// a dynamic child is removed. Replies whether the id was found.
    TerminateChild(String, RpcReplyPort<bool>),
    /// List the children in start order.
    WhichChildren(RpcReplyPort<Vec<ChildInfo>>),
    /// Internal: (re)start these children, by id, in start order (sent after a backoff).
    Restart(Vec<String>),
}

impl ractor::Message for SupervisorMsg {}

/// A child as reported by [`SupervisorMsg::WhichChildren`].
#[derive(Debug, Clone)]
pub struct ChildInfo {
    /// Child id.
    pub id: String,
    /// Restart type.
    pub restart: Restart,
    /// The running actor, if any.
    pub cell: Option<ActorCell>,
    /// Restarts of this child since the supervisor started.
    pub restarts: u64,
}

/// The generic supervisor actor; its arguments are its [`SupervisorSpec`].
#[derive(Debug, Default, Clone, Copy)]
pub struct Supervisor;

struct Child {
    spec: ChildSpec,
    cell: Option<ActorCell>,
    restarts: u64,
    dynamic: bool,
}

/// Supervisor state: the spec's flags and the children in start order (static, then dynamic).
pub struct SupervisorState {
    name: String,
    spec: SupervisorSpec,
    children: Vec<Child>,
    intensity: RestartIntensity,
}

impl SupervisorState {
    fn index_of_cell(&self, cell: &ActorCell) -> Option<usize> {
        let id = cell.get_id();
        self.children
            .iter()
            .position(|c| c.cell.as_ref().is_some_and(|x| x.get_id() == id))
    }

    fn index_of_id(&self, id: &str) -> Option<usize> {
        self.children.iter().position(|c| c.spec.id == id)
    }
}

/// Whether an exit is abnormal (see the module doc).
pub fn is_abnormal(event: &SupervisionEvent) -> bool {
    match event {
        SupervisionEvent::ActorFailed(..) => true,
        SupervisionEvent::ActorTerminated(_, _, reason) => match reason.as_deref() {
            None | Some("normal") | Some("shutdown") => false,
            Some(r) => !r.starts_with("shutdown:"),
        },
        _ => false,
    }
}

/// Stop one child according to its shutdown rule and wait until it is gone.
pub async fn shutdown_child(cell: &ActorCell, shutdown: Shutdown) {
    match shutdown {
        Shutdown::Kill => {
            let _ = cell.kill_and_wait(Some(KILL_WAIT)).await;
        }
        Shutdown::Timeout(d) => {
            if cell
                .stop_and_wait(Some("shutdown".into()), Some(d))
                .await
                .is_err()
                && cell.get_status() != ractor::ActorStatus::Stopped
            {
                tracing::warn!(actor = ?cell.get_name(), timeout_ms = d.as_millis() as u64, "child ignored shutdown; killing it");
                let _ = cell.kill_and_wait(Some(KILL_WAIT)).await;
            }
        }
        Shutdown::Infinity => {
            let _ = cell.stop_and_wait(Some("shutdown".into()), None).await;
        }
    }
}

impl Supervisor {
    async fn start_child(
        myself: &ActorRef<SupervisorMsg>,
        child: &mut Child,
    ) -> Result<(), String> {
        match (child.spec.start)(myself.get_cell()).await {
            Ok(cell) => {
                child.cell = Some(cell);
                Ok(())
            }
            Err(e) => Err(format!("child {} failed to start: {e}", child.spec.id)),
        }
    }

    /// Stop children `idx` (in reverse order of the given list, which is in start order).
    async fn stop_children(state: &mut SupervisorState, idx: &[usize]) {
        for &i in idx.iter().rev() {
            let child = &mut state.children[i];
            if let Some(cell) = child.cell.take() {
                shutdown_child(&cell, child.spec.shutdown).await;
            }
        }
    }

    async fn stop_all(state: &mut SupervisorState) {
        let all: Vec<usize> = (0..state.children.len()).collect();
        Self::stop_children(state, &all).await;
    }

    /// Handle the exit of the child at `i`.
    async fn on_child_exit(
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        i: usize,
        abnormal: bool,
        why: String,
    ) -> Result<(), ActorProcessingErr> {
        let (id, restart) = {
            let c = &mut state.children[i];
            c.cell = None;
            (c.spec.id.clone(), c.spec.restart)
        };
        let sup = state.name.clone();
        if abnormal {
            metrics::counter!("flotilla_actor_failures_total", "supervisor" => sup.clone(), "child" => id.clone()).increment(1);
            tracing::warn!(supervisor = %sup, child = %id, reason = %why, "child exited abnormally");
        } else {
            tracing::debug!(supervisor = %sup, child = %id, reason = %why, "child exited normally");
        }
        let restart_it = match restart {
            Restart::Permanent => true,
            Restart::Transient => abnormal,
            Restart::Temporary => false,
        };
        if !restart_it {
            if state.children[i].dynamic || restart == Restart::Temporary {
                state.children.remove(i);
            }
            return Ok(());
        }
        let now = tokio::time::Instant::now();
        let Some(n) = state.intensity.record(now) else {
            metrics::counter!("flotilla_supervisor_escalations_total", "supervisor" => sup.clone())
                .increment(1);
            tracing::error!(supervisor = %sup, child = %id, max = state.spec.flags.max_restarts,
                period_ms = state.spec.flags.period.as_millis() as u64, "restart intensity exceeded; escalating");
            Self::stop_all(state).await;
            return Err(
                format!("supervisor {sup}: restart intensity exceeded (last: {id})").into(),
            );
        };
        // Which children restart, in start order; the others among them are stopped first.
        let affected: Vec<usize> = match state.spec.flags.strategy {
            Strategy::OneForOne => vec![i],
            Strategy::OneForAll => (0..state.children.len()).collect(),
            Strategy::RestForOne => (i..state.children.len()).collect(),
        };
        let others: Vec<usize> = affected.iter().copied().filter(|&j| j != i).collect();
        Self::stop_children(state, &others).await;
        // Temporary siblings stopped by the strategy are removed, not restarted (OTP).
        let mut ids = Vec::new();
        for &j in &affected {
            let c = &state.children[j];
            if c.spec.restart != Restart::Temporary || j == i {
                ids.push(c.spec.id.clone());
            }
        }
        state
            .children
            .retain(|c| !(c.spec.restart == Restart::Temporary && c.cell.is_none()));
        for cid in &ids {
            if let Some(j) = state.index_of_id(cid) {
                state.children[j].restarts += 1;
            }
            metrics::counter!("flotilla_supervisor_restarts_total", "supervisor" => sup.clone(), "child" => cid.clone()).increment(1);
            if let Some(stats) = &state.spec.stats {
                stats.count_restart();
            }
        }
        let delay = state.spec.flags.backoff(n);
        if delay.is_zero() {
            Self::restart(myself, state, ids).await
        } else {
            myself.send_after(delay, move || SupervisorMsg::Restart(ids));
            Ok(())
        }
    }

    async fn restart(
        myself: &ActorRef<SupervisorMsg>,
        state: &mut SupervisorState,
        ids: Vec<String>,
    ) -> Result<(), ActorProcessingErr> {
        for id in ids {
            let Some(j) = state.index_of_id(&id) else {
                continue;
            };
            if state.children[j].cell.is_some() {
                continue;
            }
            if let Err(e) = Self::start_child(myself, &mut state.children[j]).await {
                tracing::warn!(supervisor = %state.name, child = %id, error = %e, "restart failed");
                // A failed start counts as another exit of that child.
                return Box::pin(Self::on_child_exit(myself, state, j, true, e)).await;
            }
            tracing::info!(supervisor = %state.name, child = %id, "child restarted");
        }
        Ok(())
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorSpec;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        spec: SupervisorSpec,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut state = SupervisorState {
            name: spec.name.clone(),
            intensity: RestartIntensity::new(spec.flags.max_restarts, spec.flags.period),
            children: spec
                .children
                .iter()
                .map(|c| Child {
                    spec: c.clone(),
                    cell: None,
                    restarts: 0,
                    dynamic: false,
                })
                .collect(),
            spec,
        };
        for i in 0..state.children.len() {
            if let Err(e) = Self::start_child(&myself, &mut state.children[i]).await {
                // Start-up failure: stop what started (reverse order) and fail.
                let started: Vec<usize> = (0..i).collect();
                Self::stop_children(&mut state, &started).await;
                return Err(e.into());
            }
        }
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        Self::stop_all(state).await;
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::StartChild(spec, reply) => {
                let result = if state.index_of_id(&spec.id).is_some() {
                    Err(format!("child id {} already exists", spec.id))
                } else {
                    let mut child = Child {
                        spec,
                        cell: None,
                        restarts: 0,
                        dynamic: true,
                    };
                    match Self::start_child(&myself, &mut child).await {
                        Ok(()) => {
                            let cell = child.cell.clone();
                            state.children.push(child);
                            cell.ok_or_else(|| "child did not start".to_string())
                        }
                        Err(e) => Err(e),
                    }
                };
                let _ = reply.send(result);
            }
            SupervisorMsg::TerminateChild(id, reply) => {
                let found = match state.index_of_id(&id) {
                    Some(i) => {
                        Self::stop_children(state, &[i]).await;
                        if state.children[i].dynamic {
                            state.children.remove(i);
                        }
                        true
                    }
                    None => false,
                };
                let _ = reply.send(found);
            }
            SupervisorMsg::WhichChildren(reply) => {
                let list = state
                    .children
                    .iter()
                    .map(|c| ChildInfo {
                        id: c.spec.id.clone(),
                        restart: c.spec.restart,
                        cell: c.cell.clone(),
                        restarts: c.restarts,
                    })
                    .collect();
                let _ = reply.send(list);
            }
            SupervisorMsg::Restart(ids) => Self::restart(&myself, state, ids).await?,
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let abnormal = is_abnormal(&event);
        let (cell, why) = match &event {
            SupervisionEvent::ActorFailed(cell, err) => (cell.clone(), format!("failed: {err}")),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (
                cell.clone(),
                format!("stopped: {}", reason.as_deref().unwrap_or("normal")),
            ),
            _ => return Ok(()),
        };
        // Exits of children we stopped ourselves (or of unknown actors) are ignored.
        let Some(i) = state.index_of_cell(&cell) else {
            return Ok(());
        };
        Self::on_child_exit(&myself, state, i, abnormal, why).await
    }
}
