//! The Request actor's disaggregated hand-off, against a scripted router and scripted
//! schedulers (actors in the real process groups, no engine): the KV a prefill worker handed
//! off survives a decode pick whose worker is gone, and a second hand-off releases the first
//! prefill worker's blocks instead of leaving them pinned until its hold ends.

#[path = "common/poll.rs"]
mod poll;

use flotilla::actors::request::{Request, RequestArgs, RequestMsg};
use flotilla::actors::router::{ROUTER_GROUP, RouterMsg};
use flotilla::actors::scheduler::SchedulerMsg;
use flotilla::request_plane::events::{EventBus, FleetEventKind};
use flotilla::request_plane::migration::MigrationPolicy;
use flotilla::request_plane::protocol::{
    FinishReason, Placement, RemoteKv, RouteRequest, SubmitRequest, TokenEvent, TokenEventKind,
};
use flotilla::request_plane::token_sink::SinkRegistry;
use flotilla::runtime::ids::{NodeId, RequestId, WorkerId};
use flotilla::runtime::resilience::NodeStats;
use flotilla::runtime::wire::Wire;
use flotilla::worker::engine::SamplingParams;
use flotilla::worker::scheduler::SCHEDULER_GROUP;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Answers each `Route` with the next scripted placement, and records what it was asked.
struct ScriptedRouter;

struct RouterLog {
    picks: VecDeque<Placement>,
    asked: Vec<RouteRequest>,
}

impl Actor for ScriptedRouter {
    type Msg = RouterMsg;
    type State = Arc<Mutex<RouterLog>>;
    type Arguments = Arc<Mutex<RouterLog>>;

    async fn pre_start(
        &self,
        myself: ActorRef<RouterMsg>,
        log: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(ROUTER_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(log)
    }

    async fn handle(
        &self,
        _myself: ActorRef<RouterMsg>,
        msg: RouterMsg,
        log: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let RouterMsg::Route(w, reply) = msg {
            let mut log = log.lock().unwrap();
            log.asked.push(w.decode().unwrap());
            let pick = log.picks.pop_front();
            let _ = reply.send(Wire::encode(&pick));
        }
        Ok(())
    }
}

/// What a scripted scheduler does with a submission.
#[derive(Clone, Copy)]
enum Script {
    /// Prefill: the first token, then a hand-off of `blocks` blocks.
    Prefill { blocks: u32 },
    /// Decode: one token that ends the request.
    Decode,
}

struct SchedLog {
    jobs: Vec<SubmitRequest>,
    cancels: Vec<RequestId>,
}

struct ScriptedScheduler;

impl Actor for ScriptedScheduler {
    type Msg = SchedulerMsg;
    type State = (WorkerId, Script, SinkRegistry, Arc<Mutex<SchedLog>>);
    type Arguments = Self::State;

    async fn pre_start(
        &self,
        myself: ActorRef<SchedulerMsg>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(SCHEDULER_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<SchedulerMsg>,
        msg: SchedulerMsg,
        (worker, script, sinks, log): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Submit(w) => {
                let job: SubmitRequest = w.decode().unwrap();
                let request = job.request;
                log.lock().unwrap().jobs.push(job);
                let token = |id, finish| TokenEvent {
                    request,
                    kind: TokenEventKind::Token {
                        id,
                        logprob: 0.0,
                        finish,
                        index: 0,
                        top: Vec::new(),
                    },
                };
                let events = match *script {
                    Script::Prefill { blocks } => vec![
                        token(7, None),
                        TokenEvent {
                            request,
                            kind: TokenEventKind::HandOff(Box::new(RemoteKv {
                                worker: worker.clone(),
                                request,
                                region: None,
                                blocks: (0..blocks).collect(),
                                tokens: 16 * blocks,
                                held_until_ms: u64::MAX,
                            })),
                        },
                    ],
                    Script::Decode => vec![token(8, Some(FinishReason::Length))],
                };
                sinks.deliver(events);
            }
            SchedulerMsg::Cancel(w) => {
                let (_, id): (NodeId, RequestId) = w.decode().unwrap();
                log.lock().unwrap().cancels.push(id);
            }
            _ => {}
        }
        Ok(())
    }
}

struct Fleet {
    sinks: SinkRegistry,
    router: Arc<Mutex<RouterLog>>,
    bus: EventBus,
}

impl Fleet {
    async fn new(picks: &[(&str, bool)]) -> Self {
        let router = Arc::new(Mutex::new(RouterLog {
            picks: picks
                .iter()
                .map(|(w, hand_off)| Placement {
                    worker: WorkerId::new(*w),
                    hand_off: *hand_off,
                    fetch: None,
                    terms: None,
                })
                .collect(),
            asked: vec![],
        }));
        Actor::spawn(None, ScriptedRouter, router.clone())
            .await
            .expect("router");
        Self {
            sinks: SinkRegistry::default(),
            router,
            bus: EventBus::default(),
        }
    }

    async fn scheduler(&self, worker: &str, script: Script) -> Arc<Mutex<SchedLog>> {
        let log = Arc::new(Mutex::new(SchedLog {
            jobs: vec![],
            cancels: vec![],
        }));
        let id = WorkerId::new(worker);
        Actor::spawn(
            Some(format!("{worker}/scheduler")),
            ScriptedScheduler,
            (id, script, self.sinks.clone(), log.clone()),
        )
        .await
        .expect("scheduler");
        log
    }

    /// Run one request to its end; returns the token ids the client saw.
    async fn run(&self) -> Vec<u32> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let job = SubmitRequest {
            request: RequestId(1),
            reply_to: NodeId::new("gw"),
            prompt: (0..64).collect(),
            max_tokens: 2,
            sampling: SamplingParams::default(),
            stop_token_ids: vec![],
            ignore_eos: true,
            owner_incarnation: 1,
            waiting_since_ms: 0,
            trace_id: None,
            traceparent: None,
            hand_off: false,
            remote_kv: None,
            fetch: None,
            class: None,
            session: None,
        };
        let args = RequestArgs {
            job,
            registry: self.sinks.clone(),
            events: tx,
            choice: 0,
            ids: Arc::new(AtomicU64::new(100)),
            migration: MigrationPolicy::default(),
            clock: flotilla::runtime::clock::system(),
            block_size: 16,
            salt: 0,
            policy: None,
            pin: None,
            stats: Arc::new(NodeStats::default()),
            bus: self.bus.clone(),
            span: tracing::Span::none(),
        };
        let (req, handle) = Actor::spawn(None, Request, args).await.expect("request");
        let mut seen = Vec::new();
        let over = tokio::time::timeout(Duration::from_secs(20), async {
            while let Some((_, ev)) = rx.recv().await {
                match ev {
                    TokenEventKind::Token { id, finish, .. } => {
                        seen.push(id);
                        if finish.is_some() {
                            break;
                        }
                    }
                    TokenEventKind::Failed { message, .. } => panic!("failed: {message}"),
                    _ => {}
                }
            }
        })
        .await;
        assert!(over.is_ok(), "the request did not end; saw {seen:?}");
        let _ = req.cast(RequestMsg::Cancel);
        let _ = tokio::time::timeout(Duration::from_secs(5), handle).await;
        seen
    }
}

/// The decode pick's worker left before it got the request: the request routes again and its
/// next decode attempt still pulls the KV the prefill worker handed off (it neither loses it
/// and recomputes, nor asks for a second remote prefill).
#[tokio::test]
async fn a_decode_pick_whose_worker_is_gone_keeps_the_handed_off_kv() {
    let fleet = Fleet::new(&[
        ("p/replica-0", true),
        ("gone/replica-0", false),
        ("d/replica-0", false),
    ])
    .await;
    let prefill = fleet
        .scheduler("p/replica-0", Script::Prefill { blocks: 4 })
        .await;
    let decode = fleet.scheduler("d/replica-0", Script::Decode).await;
    let mut events = fleet.bus.subscribe();

    assert_eq!(fleet.run().await, vec![7, 8]);

    // The bus tells the story: the prefill placed, its hand-off, the decode placed (the pick
    // whose worker was gone is no placement).
    let told: Vec<FleetEventKind> = std::iter::from_fn(|| events.try_recv().ok())
        .map(|e| e.kind)
        .collect();
    let p = WorkerId::new("p/replica-0");
    let d = WorkerId::new("d/replica-0");
    assert!(
        matches!(told.as_slice(), [
            FleetEventKind::Placed { worker: w1, hand_off: true, attempt: 1, .. },
            FleetEventKind::HandedOff { from, .. },
            FleetEventKind::Placed { worker: w3, hand_off: false, attempt: 3, .. },
        ] if *w1 == p && *from == p && *w3 == d),
        "{told:?}"
    );

    let asked = fleet.router.lock().unwrap().asked.clone();
    assert_eq!(asked.len(), 3, "{asked:?}");
    assert!(asked[0].remote_prefill);
    assert!(
        !asked[2].remote_prefill,
        "the re-route still holds handed-off KV"
    );
    let jobs = decode.lock().unwrap().jobs.clone();
    assert_eq!(jobs.len(), 1);
    let kv = jobs[0]
        .remote_kv
        .as_ref()
        .expect("the decode attempt pulls");
    assert_eq!(kv.worker, WorkerId::new("p/replica-0"));
    assert_eq!(kv.blocks, vec![0, 1, 2, 3]);
    assert_eq!(prefill.lock().unwrap().jobs.len(), 1);
}

/// The decode placement was handed off again (a second prefill): the first prefill worker is
/// told at once to release what it holds for this request, and the second one when the
/// request ends — no prefill worker keeps blocks pinned for a request that no longer needs
/// them.
#[tokio::test]
async fn a_second_hand_off_releases_the_first() {
    let fleet = Fleet::new(&[
        ("p1/replica-0", true),
        ("p2/replica-0", true),
        ("d/replica-0", false),
    ])
    .await;
    let first = fleet
        .scheduler("p1/replica-0", Script::Prefill { blocks: 2 })
        .await;
    let second = fleet
        .scheduler("p2/replica-0", Script::Prefill { blocks: 3 })
        .await;
    let decode = fleet.scheduler("d/replica-0", Script::Decode).await;

    // Each scripted prefill sends a first token (7) before it hands off.
    assert_eq!(fleet.run().await, vec![7, 7, 8]);

    let kv = decode.lock().unwrap().jobs[0]
        .remote_kv
        .clone()
        .expect("the decode attempt pulls");
    assert_eq!(kv.worker, WorkerId::new("p2/replica-0"));
    let first_id = first.lock().unwrap().jobs[0].request;
    let second_id = second.lock().unwrap().jobs[0].request;
    for (log, id) in [(&first, first_id), (&second, second_id)] {
        poll::poll_until(
            Duration::from_secs(5),
            "the prefill worker told to release its blocks",
            || async { log.lock().unwrap().cancels.contains(&id).then_some(()) },
        )
        .await;
    }
}
