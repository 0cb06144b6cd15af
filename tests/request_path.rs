//! The whole request path with no actor, no task and no socket, on one `ManualClock`: gateway
//! admission (`Admission`), the request core (`RequestCore`, around `Migration`), the router's
//! state (`RouterCore`: prefix index fed by the workers' KV events, active load), the worker
//! core (`WorkerCore`) with its batch former (`SchedulerCore`) and block pool (`BlockPool`).
//! Engine steps take the time the simulated engine's profile says (`SimProfile`, the published
//! vLLM-on-H100 fit), paid by advancing the manual clock: a small discrete-event loop, the
//! shape the offline simulator runs the real code in.
//!
//! Shown: a request runs to its last token; a second one sharing its prompt lands on the
//! worker that holds the prefix and is admitted with it cached; a request whose worker is
//! killed mid-stream migrates and its client sees the same tokens a run without the fault
//! gives; nothing is left placed, queued or held at the end; time is the model's alone.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla::control::discovery::membership::{NodeState, NodeView, WorkerView};
use flotilla::kv::BlockPool;
use flotilla::request_plane::admission::{Admission, AdmissionVerdict};
use flotilla::request_plane::error::RequestError;
use flotilla::request_plane::events::FleetEventKind;
use flotilla::request_plane::migration::MigrationPolicy;
use flotilla::request_plane::protocol::{OwnerStatus, SubmitRequest, TokenEventKind};
use flotilla::request_plane::request::{RequestCore, RequestCoreConfig, RequestEffect};
use flotilla::request_plane::router::core::{
    DisaggRouting, RouterCore, RouterCoreArgs, WorkerSource,
};
use flotilla::request_plane::router::policy::SelectorConfig;
use flotilla::runtime::clock::{Clock, Instant, ManualClock, SharedClock};
use flotilla::runtime::ids::{NodeId, RequestId, WorkerId};
use flotilla::runtime::role::Role;
use flotilla::worker::engine::sim::{self, SimEngineArgs, SimProfile};
use flotilla::worker::engine::{StepBatch, StepOutput};
use flotilla::worker::scheduler::{
    DisaggWorker, ROUTABLE_GROUP, SchedulerConfig, SchedulerCore, StepResult, WorkerCore,
    WorkerCoreConfig, WorkerEffect,
};

const BLOCK: usize = 16;
const SALT: u64 = 0x5eed;
const GATEWAY: &str = "gw";

/// The token sampled at position `pos`: a function of the position alone, so a stream that
/// migrates (and resumes at the same position elsewhere) is byte-identical to one that does
/// not.
fn token_at(pos: usize) -> u32 {
    1_000 + (pos as u32 * 7) % 5_000
}

/// The workers the router may choose: those in the routable group (the worker cores' own
/// join and leave effects keep it).
#[derive(Default)]
struct Groups {
    routable: Mutex<Vec<WorkerId>>,
    alive: Mutex<Vec<WorkerId>>,
}

impl WorkerSource for Groups {
    fn routable(&self) -> Vec<WorkerId> {
        self.routable.lock().unwrap().clone()
    }
    fn alive(&self) -> Vec<WorkerId> {
        self.alive.lock().unwrap().clone()
    }
    fn in_role(&self, _role: Role) -> Vec<WorkerId> {
        vec![]
    }
}

struct Req {
    core: RequestCore,
    delivered: Vec<TokenEventKind>,
    stopped: bool,
    retry_at: Option<Instant>,
}

impl Req {
    fn tokens(&self) -> Vec<u32> {
        self.delivered
            .iter()
            .filter_map(|e| match e {
                TokenEventKind::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect()
    }
}

/// The fleet: one gateway's requests, one router, the workers, the steps in flight.
struct Fleet {
    clock: ManualClock,
    shared: SharedClock,
    groups: Arc<Groups>,
    router: RouterCore,
    workers: BTreeMap<WorkerId, WorkerCore>,
    /// Steps in flight: when each ends, on which worker, what it returns.
    steps: Vec<(Instant, WorkerId, StepResult)>,
    /// Gather windows the workers asked to be woken at (`WorkerEffect::KickAt`).
    kicks: Vec<(Instant, WorkerId)>,
    requests: BTreeMap<RequestId, Req>,
    /// Attempt id → the request (the gateway's sink registry).
    listening: HashMap<RequestId, RequestId>,
    ids: Arc<AtomicU64>,
    sim: SimEngineArgs,
    fleet_events: Vec<FleetEventKind>,
    pool_blocks: usize,
}

impl Fleet {
    fn new(workers: usize) -> Self {
        let clock = ManualClock::new();
        let shared: SharedClock = Arc::new(clock.clone());
        let groups = Arc::new(Groups::default());
        let router = RouterCore::new(RouterCoreArgs {
            config: SelectorConfig {
                block_size: BLOCK as u32,
                ..SelectorConfig::default()
            },
            clock: shared.clone(),
            workers: groups.clone(),
            disagg: DisaggRouting::default(),
            queues: None,
            share_load: true,
            sessions: Default::default(),
        })
        .unwrap();
        let mut fleet = Self {
            clock,
            shared,
            groups,
            router,
            workers: BTreeMap::new(),
            steps: Vec::new(),
            kicks: Vec::new(),
            requests: BTreeMap::new(),
            listening: HashMap::new(),
            ids: Arc::new(AtomicU64::new(1_000)),
            sim: SimEngineArgs {
                profile: SimProfile::h100_vllm(),
                speedup: 1.0,
                num_blocks: 256,
                block_size: BLOCK,
                vocab_size: 49_152,
                max_context: 8_192,
            },
            fleet_events: Vec::new(),
            pool_blocks: 256,
        };
        for i in 0..workers {
            fleet.add_worker(WorkerId::new(format!("node-{}/replica-0", i + 1)));
        }
        fleet.pump();
        fleet
    }

    fn add_worker(&mut self, id: WorkerId) {
        let pool = BlockPool::new(self.pool_blocks, BLOCK, SALT)
            .unwrap()
            .with_worker(id.clone());
        let batcher = SchedulerCore::new(SchedulerConfig::default(), pool).unwrap();
        let core = WorkerCore::new(
            WorkerCoreConfig {
                worker: id.clone(),
                eos_token_id: None,
                block_size: BLOCK,
                role: Role::Aggregated,
                disagg: DisaggWorker::default(),
                step_timeout: Duration::from_secs(30),
                canary_interval: Duration::from_secs(3600),
                owner_grace: Duration::from_secs(5),
                has_transport: false,
                sim_transfer: None,
                peer_pull: None,
            },
            batcher,
            self.shared.clone(),
        );
        self.groups.alive.lock().unwrap().push(id.clone());
        self.workers.insert(id, core);
    }

    /// The worker's node is killed: its scheduler leaves every group (the Request's group
    /// monitor hears it), its steps never come back.
    fn kill(&mut self, id: &WorkerId) {
        self.workers.remove(id);
        self.groups.routable.lock().unwrap().retain(|w| w != id);
        self.groups.alive.lock().unwrap().retain(|w| w != id);
        self.steps.retain(|(_, w, _)| w != id);
        let lost: Vec<(RequestId, RequestId)> = self
            .requests
            .iter()
            .filter_map(|(rid, r)| {
                r.core
                    .current()
                    .filter(|(_, w)| *w == id)
                    .map(|(a, _)| (*rid, a))
            })
            .collect();
        for (rid, attempt) in lost {
            self.requests
                .get_mut(&rid)
                .unwrap()
                .core
                .worker_lost(attempt);
        }
        self.pump();
    }

    /// The fleet view admission reads (what Discovery publishes from the workers' boards).
    fn fleet_view(&self) -> Vec<NodeView> {
        self.workers
            .iter()
            .map(|(id, w)| {
                let mut view = WorkerView {
                    id: id.to_string(),
                    state: "running".into(),
                    ..WorkerView::default()
                };
                w.stats().apply_to(&mut view);
                NodeView {
                    id: NodeId::new(id.as_str().split('/').next().unwrap()),
                    addr: String::new(),
                    http_addr: None,
                    roles: vec![],
                    pid: 0,
                    incarnation: 1,
                    state: NodeState::Up,
                    last_seen_ms: self.clock.wall_ms(),
                    workers: vec![view],
                    actors: vec![],
                    counters: Default::default(),
                    signals: None,
                    planner: None,
                    regions: vec![],
                }
            })
            .collect()
    }

    /// A client's request: admitted (or not) on the published view, then placed.
    fn submit(&mut self, id: u64, prompt: Vec<u32>, max_tokens: u32) -> AdmissionVerdict {
        let admission = Admission {
            busy_kv_ratio: 0.95,
            busy_waiting: 64,
            max_in_flight: 1_024,
            ttft_target_ms: None,
        };
        let in_flight = self.requests.values().filter(|r| !r.stopped).count();
        let view = self.fleet_view();
        let verdict = admission.decide(false, in_flight, Some(&view));
        if verdict != AdmissionVerdict::Admit {
            return verdict;
        }
        let job = SubmitRequest {
            request: RequestId(id),
            reply_to: NodeId::new(GATEWAY),
            prompt,
            max_tokens,
            sampling: Default::default(),
            stop_token_ids: vec![],
            ignore_eos: true,
            owner_incarnation: 1,
            waiting_since_ms: self.clock.wall_ms(),
            trace_id: None,
            traceparent: None,
            hand_off: false,
            remote_kv: None,
            fetch: None,
            class: None,
            session: None,
        };
        let mut core = RequestCore::new(
            RequestCoreConfig {
                job,
                block_size: BLOCK,
                salt: SALT,
                policy: None,
                pin: None,
                migration: MigrationPolicy::default(),
            },
            self.ids.clone(),
            self.shared.clone(),
        );
        core.start();
        self.requests.insert(
            RequestId(id),
            Req {
                core,
                delivered: vec![],
                stopped: false,
                retry_at: None,
            },
        );
        self.pump();
        verdict
    }

    /// The simulated engine's step (`sim::model_step`: the profile's time, paid on the
    /// manual clock), with each token a function of its position (the sim engine's own
    /// placeholders also depend on the sequence id, which a migration changes).
    fn run_step(&self, batch: &StepBatch) -> (Duration, StepOutput) {
        let (time, mut output) = sim::model_step(&self.sim, batch);
        for (t, s) in output
            .tokens
            .iter_mut()
            .zip(batch.seqs.iter().filter(|s| s.sample))
        {
            t.token = token_at(s.start_pos + s.tokens.len());
        }
        (time, output)
    }

    /// Carry every effect out until none is left (no time passes).
    fn pump(&mut self) {
        loop {
            let mut busy = false;
            let rids: Vec<RequestId> = self.requests.keys().copied().collect();
            for rid in rids {
                let effects = self.requests.get_mut(&rid).unwrap().core.take_effects();
                busy |= !effects.is_empty();
                for e in effects {
                    self.request_effect(rid, e);
                }
            }
            let wids: Vec<WorkerId> = self.workers.keys().cloned().collect();
            for wid in wids {
                let Some(w) = self.workers.get_mut(&wid) else {
                    continue;
                };
                let effects = w.take_effects();
                busy |= !effects.is_empty();
                for e in effects {
                    self.worker_effect(&wid, e);
                }
                // The token sink: every event to the request listening for its attempt.
                let mut out = Vec::new();
                if let Some(w) = self.workers.get_mut(&wid) {
                    w.flush(
                        |_, events| {
                            out.extend(events);
                            Ok(())
                        },
                        |_| OwnerStatus::Present,
                    );
                }
                busy |= !out.is_empty();
                for ev in out {
                    if let Some(rid) = self.listening.get(&ev.request).copied() {
                        self.requests
                            .get_mut(&rid)
                            .unwrap()
                            .core
                            .event(ev.request, ev.kind);
                    }
                }
            }
            if !busy {
                return;
            }
        }
    }

    fn request_effect(&mut self, rid: RequestId, effect: RequestEffect) {
        match effect {
            RequestEffect::Route(route) => {
                let pick = self
                    .router
                    .place(route)
                    .map_err(|_| RequestError::RouterReply);
                self.req(rid).core.picked(pick);
            }
            RequestEffect::Submit { worker, job } => {
                let reached = match self.workers.get_mut(&worker) {
                    Some(w) => {
                        self.listening.insert(job.request, rid);
                        w.submit(*job).unwrap();
                        true
                    }
                    None => false,
                };
                self.req(rid).core.submitted(reached);
            }
            RequestEffect::Unlisten(attempt) => {
                self.listening.remove(&attempt);
            }
            RequestEffect::Cancel { worker, key } => {
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.cancel(&key).unwrap();
                }
            }
            RequestEffect::ReleasePlacement((node, id)) => self.router.release(node, id),
            RequestEffect::FirstToken((node, id)) => self.router.first_token(node, id),
            RequestEffect::AskHas { worker, key } => {
                if let Some(has) = self.workers.get(&worker).map(|w| w.has(&key)) {
                    self.req(rid).core.has_answer(key.1, has);
                }
            }
            RequestEffect::Deliver(ev) => self.req(rid).delivered.push(ev),
            RequestEffect::RetryAt(at) => self.req(rid).retry_at = Some(at),
            RequestEffect::Fleet(ev) => self.fleet_events.push(ev),
            RequestEffect::Stop => self.req(rid).stopped = true,
        }
    }

    fn worker_effect(&mut self, wid: &WorkerId, effect: WorkerEffect) {
        match effect {
            WorkerEffect::Step { step, batch } => {
                let (time, output) = self.run_step(&batch);
                let end = self.clock.now() + time;
                let result = StepResult {
                    step,
                    output: Ok(output),
                };
                self.steps.push((end, wid.clone(), result));
            }
            WorkerEffect::Pull(job) => panic!("no disaggregation here: {job:?}"),
            WorkerEffect::TierCopies(c) => panic!("no lower KV tiers here: {c:?}"),
            WorkerEffect::Fetch { .. } => panic!("no peer pulls here"),
            WorkerEffect::KickAt(at) => self.kicks.push((at, wid.clone())),
            WorkerEffect::Release(_) | WorkerEffect::RoleChanged(_) | WorkerEffect::Ping => {}
            WorkerEffect::ConfirmPull { .. } => panic!("no disaggregation here"),
            WorkerEffect::KvEvents { events, .. } => self.router.kv_events(events),
            WorkerEffect::Join(group) if group == ROUTABLE_GROUP => {
                self.groups.routable.lock().unwrap().push(wid.clone());
            }
            WorkerEffect::Leave(group) if group == ROUTABLE_GROUP => {
                self.groups.routable.lock().unwrap().retain(|w| w != wid);
            }
            WorkerEffect::Join(_) | WorkerEffect::Leave(_) => {}
        }
    }

    fn req(&mut self, rid: RequestId) -> &mut Req {
        self.requests.get_mut(&rid).unwrap()
    }

    /// Advance the clock to the next step end or retry and handle what is due; false when
    /// nothing is left to happen.
    fn advance(&mut self) -> bool {
        let next_step = self.steps.iter().map(|(t, ..)| *t).min();
        let next_retry = self.requests.values().filter_map(|r| r.retry_at).min();
        let next_kick = self.kicks.iter().map(|(t, _)| *t).min();
        let Some(next) = [next_step, next_retry, next_kick]
            .into_iter()
            .flatten()
            .min()
        else {
            return false;
        };
        let now = self.clock.now();
        self.clock.advance(next.saturating_duration_since(now));
        let now = self.clock.now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.steps)
            .into_iter()
            .partition(|(t, ..)| *t <= now);
        self.steps = later;
        for (_, wid, result) in due {
            if let Some(w) = self.workers.get_mut(&wid) {
                w.step_done(result, || None).unwrap();
            }
        }
        let (kicks, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.kicks)
            .into_iter()
            .partition(|(t, _)| *t <= now);
        self.kicks = later;
        for (_, wid) in kicks {
            if let Some(w) = self.workers.get_mut(&wid) {
                w.kick_due().unwrap();
            }
        }
        for r in self.requests.values_mut() {
            if r.retry_at.is_some_and(|t| t <= now) {
                r.retry_at = None;
                r.core.retry();
            }
        }
        for w in self.workers.values_mut() {
            w.tick(|_| OwnerStatus::Present).unwrap();
        }
        self.pump();
        true
    }

    fn run_until(&mut self, mut done: impl FnMut(&Self) -> bool) {
        while !done(self) {
            assert!(self.advance(), "nothing left to happen, and not done");
        }
    }

    fn run_until_idle(&mut self) {
        while self.advance() {}
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 100 + (seed * 131 + i) % 900)
        .collect()
}

fn expected(prompt_len: usize, max_tokens: usize) -> Vec<u32> {
    (0..max_tokens).map(|i| token_at(prompt_len + i)).collect()
}

#[test]
fn the_request_path_runs_on_one_manual_clock() {
    let mut f = Fleet::new(2);
    let start = f.clock.now();
    assert_eq!(f.groups.routable().len(), 2, "both workers joined routing");

    // 1. A request runs to its last token.
    let a = prompt(1, 64);
    assert_eq!(f.submit(1, a.clone(), 8), AdmissionVerdict::Admit);
    f.run_until_idle();
    let r = &f.requests[&RequestId(1)];
    assert!(r.stopped && r.core.is_done());
    assert_eq!(r.tokens(), expected(64, 8));
    assert!(matches!(
        r.delivered.last(),
        Some(TokenEventKind::Token {
            finish: Some(_),
            ..
        })
    ));
    let first_worker = match &f.fleet_events[0] {
        FleetEventKind::Placed { worker, .. } => worker.clone(),
        other => panic!("first fleet event: {other:?}"),
    };

    // 2. A request sharing its prompt lands where the prefix is and is admitted with it cached.
    let mut b = a.clone();
    b.extend(prompt(2, 16));
    f.submit(2, b, 4);
    f.run_until_idle();
    let placed_b = f.fleet_events.iter().rev().find_map(|e| match e {
        FleetEventKind::Placed {
            request, worker, ..
        } if *request == RequestId(2) => Some(worker.clone()),
        _ => None,
    });
    assert_eq!(placed_b.as_ref(), Some(&first_worker), "the prefix holder");
    let cached = f.requests[&RequestId(2)]
        .delivered
        .iter()
        .find_map(|e| match e {
            TokenEventKind::Admitted { cached_tokens, .. } => Some(*cached_tokens),
            _ => None,
        });
    assert_eq!(
        cached,
        Some(64),
        "the shared 4 blocks came from the prefix cache"
    );
    assert_eq!(f.requests[&RequestId(2)].tokens(), expected(80, 4));

    // 3. A request whose worker is killed mid-stream migrates without a seam.
    let c = prompt(3, 40);
    f.submit(3, c, 20);
    f.run_until(|f| f.requests[&RequestId(3)].tokens().len() >= 5);
    let (_, serving) = f.requests[&RequestId(3)].core.current().unwrap();
    let serving = serving.clone();
    f.kill(&serving);
    f.run_until_idle();
    let r = &f.requests[&RequestId(3)];
    assert!(r.core.is_done());
    assert_eq!(
        r.tokens(),
        expected(40, 20),
        "the same tokens as without the fault"
    );
    assert!(f.fleet_events.iter().any(|e| matches!(
        e,
        FleetEventKind::Migrated { request, from: Some(w), .. } if *request == RequestId(3) && *w == serving
    )));
    let (_, now_on) = f
        .fleet_events
        .iter()
        .rev()
        .find_map(|e| match e {
            FleetEventKind::Placed {
                request, worker, ..
            } if *request == RequestId(3) => Some(((), worker.clone())),
            _ => None,
        })
        .unwrap();
    assert_ne!(now_on, serving);

    // 4. Nothing is left placed, queued or held; the blocks are free (cached, evictable).
    assert_eq!(f.router.placed(), 0);
    for w in f.workers.values() {
        let s = w.stats();
        assert_eq!((s.running, s.waiting, s.held), (0, 0, 0), "{s:?}");
        assert_eq!(w.num_live(), 0);
    }
    assert!(f.listening.is_empty(), "every attempt stopped listening");

    // 5. Time is the model's: tens of H100 steps, whatever the machine's clock did.
    let modelled = f.clock.now() - start;
    assert!(
        modelled > Duration::from_millis(100) && modelled < Duration::from_secs(5),
        "{modelled:?}"
    );
}
