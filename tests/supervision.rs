//! Supervision semantics on a paused clock: strategies, restart types, budgets, escalation,
//! shutdown order and timeouts, dynamic children.

#[path = "common/poll.rs"]
mod poll;

use crate::poll::poll_until;
use flotilla::runtime::supervision::{
    ChildSpec, Restart, Shutdown, Strategy, Supervisor, SupervisorFlags, SupervisorMsg,
    SupervisorSpec,
};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Log = Arc<Mutex<Vec<String>>>;

enum ProbeMsg {
    Panic,
    Fail,
    Stop(Option<String>),
    Block,
}
impl ractor::Message for ProbeMsg {}

struct Probe;

impl Actor for Probe {
    type Msg = ProbeMsg;
    type State = (String, Log);
    type Arguments = (String, Log);

    async fn pre_start(
        &self,
        _me: ActorRef<ProbeMsg>,
        (id, log): (String, Log),
    ) -> Result<Self::State, ActorProcessingErr> {
        log.lock().unwrap().push(format!("start:{id}"));
        Ok((id, log))
    }

    async fn post_stop(
        &self,
        _me: ActorRef<ProbeMsg>,
        (id, log): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        log.lock().unwrap().push(format!("stop:{id}"));
        Ok(())
    }

    async fn handle(
        &self,
        me: ActorRef<ProbeMsg>,
        msg: ProbeMsg,
        _state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ProbeMsg::Panic => panic!("probe panic"),
            ProbeMsg::Fail => Err("probe failure".into()),
            ProbeMsg::Stop(reason) => {
                me.stop(reason);
                Ok(())
            }
            ProbeMsg::Block => {
                std::future::pending::<()>().await;
                Ok(())
            }
        }
    }
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

fn probe(id: &str, log: &Log) -> ChildSpec {
    let (id_s, log) = (id.to_owned(), log.clone());
    ChildSpec::actor(id, None, move || (Probe, (id_s.clone(), log.clone())))
        .shutdown(Shutdown::Timeout(Duration::from_millis(500)))
}

fn flags(strategy: Strategy, max: u32) -> SupervisorFlags {
    SupervisorFlags::new(strategy, max, Duration::from_secs(10))
        .with_backoff(Duration::from_millis(10), Duration::from_millis(100))
}

fn spec(strategy: Strategy, max: u32, children: Vec<ChildSpec>) -> SupervisorSpec {
    let n = UNIQUE.fetch_add(1, Ordering::Relaxed);
    SupervisorSpec::new(format!("sup-{n}"), flags(strategy, max))
        .actor_name(None)
        .children(children)
}

async fn children(sup: &ActorRef<SupervisorMsg>) -> Vec<(String, Option<ActorCell>)> {
    ractor::call!(sup, SupervisorMsg::WhichChildren)
        .unwrap()
        .into_iter()
        .map(|c| (c.id, c.cell))
        .collect()
}

async fn child(sup: &ActorRef<SupervisorMsg>, id: &str) -> Option<ActorRef<ProbeMsg>> {
    children(sup)
        .await
        .into_iter()
        .find(|(i, _)| i == id)
        .and_then(|(_, c)| c.map(Into::into))
}

fn take(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

/// Wait until child `id` runs as a different actor than `old`.
async fn restarted(
    sup: &ActorRef<SupervisorMsg>,
    id: &str,
    old: &ActorRef<ProbeMsg>,
) -> ActorRef<ProbeMsg> {
    let old_id = old.get_id();
    poll_until(Duration::from_secs(5), "child restarted", || async {
        child(sup, id).await.filter(|c| c.get_id() != old_id)
    })
    .await
}

#[tokio::test(start_paused = true)]
async fn one_for_one_restarts_only_the_failed_child() {
    let log: Log = Default::default();
    let s = spec(
        Strategy::OneForOne,
        5,
        vec![probe("a", &log), probe("b", &log), probe("c", &log)],
    );
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    assert_eq!(take(&log), ["start:a", "start:b", "start:c"]);
    let (a, b, c) = (
        child(&sup, "a").await.unwrap(),
        child(&sup, "b").await.unwrap(),
        child(&sup, "c").await.unwrap(),
    );
    b.cast(ProbeMsg::Panic).unwrap();
    restarted(&sup, "b", &b).await;
    assert_eq!(child(&sup, "a").await.unwrap().get_id(), a.get_id());
    assert_eq!(child(&sup, "c").await.unwrap().get_id(), c.get_id());
    assert_eq!(take(&log).last().map(String::as_str), Some("start:b"));
    sup.stop_and_wait(None, None).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn one_for_all_stops_others_in_reverse_then_restarts_all_in_order() {
    let log: Log = Default::default();
    let s = spec(
        Strategy::OneForAll,
        5,
        vec![probe("a", &log), probe("b", &log), probe("c", &log)],
    );
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    take(&log);
    let b = child(&sup, "b").await.unwrap();
    let c = child(&sup, "c").await.unwrap();
    b.cast(ProbeMsg::Fail).unwrap();
    restarted(&sup, "c", &c).await;
    let l = take(&log);
    // b failed (its post_stop may or may not run first); the others stop c then a; then all
    // start in order.
    let others: Vec<_> = l.iter().filter(|e| *e != "stop:b").cloned().collect();
    assert_eq!(
        others,
        ["stop:c", "stop:a", "start:a", "start:b", "start:c"],
        "{l:?}"
    );
    sup.stop_and_wait(None, None).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn rest_for_one_restarts_the_failed_child_and_those_after_it() {
    let log: Log = Default::default();
    let s = spec(
        Strategy::RestForOne,
        5,
        vec![
            probe("a", &log),
            probe("b", &log),
            probe("c", &log),
            probe("d", &log),
        ],
    );
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    take(&log);
    let a = child(&sup, "a").await.unwrap();
    let b = child(&sup, "b").await.unwrap();
    let d = child(&sup, "d").await.unwrap();
    b.cast(ProbeMsg::Panic).unwrap();
    restarted(&sup, "d", &d).await;
    let l = take(&log);
    let others: Vec<_> = l.iter().filter(|e| *e != "stop:b").cloned().collect();
    assert_eq!(
        others,
        ["stop:d", "stop:c", "start:b", "start:c", "start:d"],
        "{l:?}"
    );
    assert_eq!(
        child(&sup, "a").await.unwrap().get_id(),
        a.get_id(),
        "a untouched"
    );
    sup.stop_and_wait(None, None).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn restart_types_permanent_transient_temporary() {
    let log: Log = Default::default();
    let s = spec(
        Strategy::OneForOne,
        10,
        vec![
            probe("perm", &log),
            probe("trans", &log).restart(Restart::Transient),
            probe("temp", &log).restart(Restart::Temporary),
        ],
    );
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    take(&log);

    // A permanent child is restarted even after a normal stop.
    let perm = child(&sup, "perm").await.unwrap();
    perm.cast(ProbeMsg::Stop(None)).unwrap();
    restarted(&sup, "perm", &perm).await;

    // A transient child: normal stop → stays down; a failure → restarted.
    let trans = child(&sup, "trans").await.unwrap();
    trans.cast(ProbeMsg::Stop(Some("shutdown".into()))).unwrap();
    poll_until(Duration::from_secs(5), "transient down", || async {
        children(&sup)
            .await
            .into_iter()
            .find(|(i, c)| i == "trans" && c.is_none())
            .map(|_| ())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        child(&sup, "trans").await.is_none(),
        "transient child restarted after a normal exit"
    );

    // A temporary child that fails is removed, not restarted.
    let temp = child(&sup, "temp").await.unwrap();
    temp.cast(ProbeMsg::Panic).unwrap();
    poll_until(Duration::from_secs(5), "temporary removed", || async {
        (!children(&sup).await.iter().any(|(i, _)| i == "temp")).then_some(())
    })
    .await;
    sup.stop_and_wait(None, None).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn transient_child_restarts_after_kill_and_abnormal_reason() {
    let log: Log = Default::default();
    let s = spec(
        Strategy::OneForOne,
        10,
        vec![probe("t", &log).restart(Restart::Transient)],
    );
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    let t = child(&sup, "t").await.unwrap();
    t.kill();
    let t2 = restarted(&sup, "t", &t).await;
    t2.cast(ProbeMsg::Stop(Some("lost connection".into())))
        .unwrap();
    restarted(&sup, "t", &t2).await;
    sup.stop_and_wait(None, None).await.unwrap();
}

/// Records the supervision events its child supervisor sends it.
struct Parent;
impl Actor for Parent {
    type Msg = ();
    type State = (Arc<Mutex<Vec<String>>>, Option<ActorRef<SupervisorMsg>>);
    type Arguments = (
        Arc<Mutex<Vec<String>>>,
        SupervisorSpec,
        tokio::sync::oneshot::Sender<ActorRef<SupervisorMsg>>,
    );

    async fn pre_start(
        &self,
        me: ActorRef<()>,
        (events, spec, tx): Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        let (sup, _) = Actor::spawn_linked(None, Supervisor, spec, me.get_cell()).await?;
        let _ = tx.send(sup.clone());
        Ok((events, Some(sup)))
    }

    async fn handle_supervisor_evt(
        &self,
        _me: ActorRef<()>,
        ev: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let s = match ev {
            SupervisionEvent::ActorFailed(_, e) => format!("failed: {e}"),
            SupervisionEvent::ActorTerminated(_, _, r) => format!("terminated: {r:?}"),
            _ => return Ok(()),
        };
        state.0.lock().unwrap().push(s);
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn exceeding_the_budget_stops_children_and_escalates_to_the_parent() {
    let log: Log = Default::default();
    let events: Arc<Mutex<Vec<String>>> = Default::default();
    let s = spec(
        Strategy::OneForOne,
        2,
        vec![probe("a", &log), probe("b", &log)],
    );
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (_parent, _) = Actor::spawn(None, Parent, (events.clone(), s, tx))
        .await
        .unwrap();
    let sup = rx.await.unwrap();
    for round in 0..3 {
        let b = child(&sup, "b").await.unwrap();
        b.cast(ProbeMsg::Panic).unwrap();
        if round < 2 {
            restarted(&sup, "b", &b).await;
        }
    }
    poll_until(
        Duration::from_secs(5),
        "escalation reaches parent",
        || async {
            events
                .lock()
                .unwrap()
                .iter()
                .find(|e| e.contains("restart intensity exceeded"))
                .cloned()
        },
    )
    .await;
    assert!(
        take(&log).contains(&"stop:a".to_string()),
        "siblings stopped on escalation"
    );
}

#[tokio::test(start_paused = true)]
async fn restarts_spread_over_time_do_not_escalate() {
    let log: Log = Default::default();
    let s = spec(Strategy::OneForOne, 2, vec![probe("a", &log)]);
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    for _ in 0..5 {
        let a = child(&sup, "a").await.unwrap();
        a.cast(ProbeMsg::Panic).unwrap();
        restarted(&sup, "a", &a).await;
        tokio::time::sleep(Duration::from_secs(11)).await; // past the 10 s window
    }
    assert_eq!(sup.get_status(), ractor::ActorStatus::Running);
    sup.stop_and_wait(None, None).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn shutdown_is_reverse_start_order() {
    let log: Log = Default::default();
    let s = spec(
        Strategy::OneForOne,
        5,
        vec![probe("a", &log), probe("b", &log), probe("c", &log)],
    );
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    take(&log);
    sup.stop_and_wait(None, None).await.unwrap();
    assert_eq!(take(&log), ["stop:c", "stop:b", "stop:a"]);
}

#[tokio::test(start_paused = true)]
async fn a_child_that_ignores_shutdown_is_killed_after_its_timeout() {
    let log: Log = Default::default();
    let s = spec(
        Strategy::OneForOne,
        5,
        vec![probe("a", &log), probe("stuck", &log)],
    );
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    take(&log);
    let stuck = child(&sup, "stuck").await.unwrap();
    stuck.cast(ProbeMsg::Block).unwrap();
    tokio::task::yield_now().await;
    let t0 = tokio::time::Instant::now();
    sup.stop_and_wait(None, None).await.unwrap();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(500),
        "waited its 500 ms timeout, took {took:?}"
    );
    assert_eq!(stuck.get_status(), ractor::ActorStatus::Stopped);
    // Killed: no post_stop for the stuck child; a still stopped after it.
    assert_eq!(take(&log), ["stop:a"]);
}

#[tokio::test(start_paused = true)]
async fn dynamic_temporary_children_come_and_go() {
    let log: Log = Default::default();
    let s = spec(Strategy::OneForOne, 5, vec![probe("static", &log)]);
    let (sup, _) = Actor::spawn(None, Supervisor, s).await.unwrap();
    let spec_r1 = probe("req-1", &log).restart(Restart::Temporary);
    let cell = ractor::call!(sup, SupervisorMsg::StartChild, spec_r1)
        .unwrap()
        .unwrap();
    let dup = ractor::call!(sup, SupervisorMsg::StartChild, probe("req-1", &log)).unwrap();
    assert!(dup.is_err(), "duplicate ids are refused");
    let r1: ActorRef<ProbeMsg> = cell.into();
    r1.cast(ProbeMsg::Panic).unwrap();
    poll_until(
        Duration::from_secs(5),
        "temporary child removed",
        || async { (children(&sup).await.len() == 1).then_some(()) },
    )
    .await;
    let spec_r2 = probe("req-2", &log).restart(Restart::Temporary);
    ractor::call!(sup, SupervisorMsg::StartChild, spec_r2)
        .unwrap()
        .unwrap();
    assert!(ractor::call!(sup, SupervisorMsg::TerminateChild, "req-2".to_owned()).unwrap());
    assert_eq!(children(&sup).await.len(), 1);
    assert!(!ractor::call!(sup, SupervisorMsg::TerminateChild, "nope".to_owned()).unwrap());
    assert_eq!(sup.get_status(), ractor::ActorStatus::Running);
    sup.stop_and_wait(None, None).await.unwrap();
}
