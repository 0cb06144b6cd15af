//! One replica in-process — KV event publisher, engine worker and scheduler under their
//! one_for_all supervisor — driven through its real messages: submissions come in as
//! `SchedulerMsg::Submit`, tokens go out through a TokenSink, exactly as across nodes.

#[path = "common/model.rs"]
mod model;
#[path = "common/poll.rs"]
mod poll;

use crate::poll::poll_until;
use flotilla::actors::kv_publisher::KvPublisherMsg;
use flotilla::actors::scheduler::SchedulerMsg;
use flotilla::actors::token_sink::TokenSink;
use flotilla::kv::TierConfig;
use flotilla::model::{LoadedModel, load_model, resolve_model_path};
use flotilla::request_plane::protocol::{
    FinishReason, Owner, RemoteKv, SubmitRequest, TokenEventKind, TokenSinkMsg, sink_name,
};
use flotilla::request_plane::token_sink::SinkRegistry;
use flotilla::runtime::ids::{NodeId, RequestId, WorkerId};
use flotilla::runtime::role::Role;
use flotilla::runtime::supervision::{Shutdown, Strategy, Supervisor, SupervisorFlags};
use flotilla::runtime::wire::Wire;
use flotilla::supervisors::tree::{ReplicaParams, replica};
use flotilla::transport::{Transport, TransportActor, TransportConfig};
use flotilla::worker::engine::{EngineConfig, SamplingParams};
use flotilla::worker::scheduler::{SchedulerConfig, SchedulerStats, StatsBoard};
use ractor::{Actor, ActorRef};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

fn model() -> Arc<LoadedModel> {
    static M: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    M.get_or_init(|| {
        let path = resolve_model_path(None).expect("model (run `make model`)");
        Arc::new(load_model(&path).expect("model loads"))
    })
    .clone()
}

fn golden(name: &str) -> (Vec<u32>, Vec<u32>) {
    let j: serde_json::Value = crate::model::golden_json();
    let case = j["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap();
    let ids = |v: &serde_json::Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    (ids(&case["prompt_ids"]), ids(&case["greedy_ids"]))
}

struct Harness {
    node: NodeId,
    worker: WorkerId,
    registry: SinkRegistry,
    sup: ActorRef<flotilla::runtime::supervision::SupervisorMsg>,
    sink: ActorRef<TokenSinkMsg>,
    board: StatsBoard,
}

impl Harness {
    async fn start(name: &str, num_blocks: usize) -> Self {
        Self::start_with_grace(name, num_blocks, Duration::from_secs(3)).await
    }

    /// As [`Harness::start`], with the owner grace (`cluster.liveness_timeout_ms`) given.
    async fn start_with_grace(name: &str, num_blocks: usize, owner_grace: Duration) -> Self {
        Self::start_full(name, num_blocks, owner_grace, None, Role::Aggregated, None).await
    }

    /// A replica with lower KV tiers (`tiers`; G3 in `disk_dir`).
    async fn start_tiered(
        name: &str,
        num_blocks: usize,
        tiers: TierConfig,
        disk_dir: Option<std::path::PathBuf>,
    ) -> Self {
        Self::start_full(
            name,
            num_blocks,
            Duration::from_secs(3),
            None,
            Role::Aggregated,
            Some((tiers, disk_dir)),
        )
        .await
    }

    /// A replica in `role` whose KV lives in memory registered with `transport` (run by a
    /// transport actor named `<name>/transport`, as in a node).
    async fn start_disagg(name: &str, role: Role) -> Self {
        let t = Arc::new(
            Transport::start(name, TransportConfig::default(), Default::default())
                .await
                .unwrap(),
        );
        Actor::spawn(Some(format!("{name}/transport")), TransportActor, t.clone())
            .await
            .unwrap();
        Self::start_full(name, 256, Duration::from_secs(3), Some(t), role, None).await
    }

    async fn start_full(
        name: &str,
        num_blocks: usize,
        owner_grace: Duration,
        transport: Option<Arc<Transport>>,
        role: Role,
        tiers: Option<(TierConfig, Option<std::path::PathBuf>)>,
    ) -> Self {
        let (tiers, kv_disk_dir) = tiers.unwrap_or_default();
        let node = NodeId::new(name);
        let worker = WorkerId::new(format!("{name}/replica-0"));
        let registry = SinkRegistry::default();
        let board = StatsBoard::default();
        let owner = Owner::new(node.clone(), 1);
        let (sink, _) = Actor::spawn(Some(sink_name(&owner)), TokenSink, (registry.clone(), 1))
            .await
            .unwrap();
        let spec = replica(ReplicaParams {
            worker: worker.clone(),
            model: model(),
            engine: EngineConfig {
                num_blocks,
                block_size: 16,
                ..EngineConfig::default()
            },
            scheduler: SchedulerConfig {
                max_num_seqs: 16,
                max_num_batched_tokens: 128,
                max_model_len: 2048,
                ..SchedulerConfig::default()
            },
            flags: SupervisorFlags::new(Strategy::OneForAll, 3, Duration::from_secs(60)),
            shutdown: Shutdown::Timeout(Duration::from_secs(5)),
            faults: Default::default(),
            step_timeout: Duration::from_secs(30),
            canary_interval: Duration::from_secs(5),
            owner_grace,
            sim: None,
            stats: Default::default(),
            transport,
            role,
            disagg: Default::default(),
            sim_transfer: None,
            peer_pull: Some(flotilla::worker::scheduler::PeerPullWorker {
                prior_block_ms: 1.0,
                fixed_ms: 1.0,
                ask_timeout: Duration::from_secs(1),
            }),
            tiers,
            tier_links: None,
            kv_region: Default::default(),
            kv_disk_dir,
            kv_events: None,
            board: board.clone(),
            clock: flotilla::runtime::clock::system(),
            bus: Default::default(),
        });
        let (sup, _) = Actor::spawn(spec.actor_name.clone(), Supervisor, spec)
            .await
            .unwrap();
        Self {
            node,
            worker,
            registry,
            sup,
            sink,
            board,
        }
    }

    fn scheduler(&self) -> ActorRef<SchedulerMsg> {
        ractor::registry::where_is(format!("{}/scheduler", self.worker))
            .unwrap()
            .into()
    }

    fn submit(
        &self,
        id: u64,
        prompt: Vec<u32>,
        max_tokens: u32,
    ) -> tokio::sync::mpsc::UnboundedReceiver<TokenEventKind> {
        self.submit_to(self, self.request(id, prompt, max_tokens))
    }

    /// Submits `req` (owned by this harness's sink) to `target`'s scheduler.
    fn submit_to(
        &self,
        target: &Harness,
        req: SubmitRequest,
    ) -> tokio::sync::mpsc::UnboundedReceiver<TokenEventKind> {
        let rx = self.registry.register(req.request);
        target
            .scheduler()
            .cast(SchedulerMsg::Submit(Wire::encode(&req)))
            .unwrap();
        rx
    }

    /// A request owned by this harness's sink.
    fn request(&self, id: u64, prompt: Vec<u32>, max_tokens: u32) -> SubmitRequest {
        SubmitRequest {
            request: RequestId(id),
            reply_to: self.node.clone(),
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_token_ids: vec![],
            ignore_eos: false,
            owner_incarnation: 1,
            waiting_since_ms: 0,
            trace_id: None,
            traceparent: None,
            hand_off: false,
            remote_kv: None,
            fetch: None,
            class: None,
            session: None,
        }
    }

    /// Until nothing is held or used in this replica's pool (a hand-off released).
    async fn wait_released(&self) {
        poll_until(Duration::from_secs(5), "blocks released", || async {
            let s = self.stats().await;
            (s.held == 0 && s.kv_blocks_used == 0).then_some(())
        })
        .await;
    }

    /// The scheduler's answer to a stats call, checked against what it publishes on the
    /// node's board (pushed after every message: never behind the answer by a step).
    async fn stats(&self) -> SchedulerStats {
        let s: SchedulerStats = ractor::call!(self.scheduler(), SchedulerMsg::Stats)
            .unwrap()
            .decode()
            .unwrap();
        let b = self
            .board
            .get(&self.worker)
            .expect("the scheduler publishes its stats");
        assert!(b.steps >= s.steps, "board {b:?} behind the answer {s:?}");
        assert_eq!((b.worker.clone(), b.role), (s.worker.clone(), s.role));
        s
    }

    async fn stop(self) {
        self.sup.stop_and_wait(None, None).await.unwrap();
        self.sink.stop_and_wait(None, None).await.unwrap();
        assert!(
            self.board.get(&self.worker).is_none(),
            "a stopped scheduler withdraws its stats"
        );
    }
}

/// A KV event subscriber: joins the group and records what it is published.
struct Subscriber;
impl Actor for Subscriber {
    type Msg = flotilla::actors::kv_publisher::KvEventsMsg;
    type State = Arc<std::sync::Mutex<Vec<flotilla::kv::KvEvent>>>;
    type Arguments = Self::State;
    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        s: Self::State,
    ) -> Result<Self::State, ractor::ActorProcessingErr> {
        ractor::pg::join(
            flotilla::actors::kv_publisher::KV_EVENTS_GROUP.to_owned(),
            vec![me.get_cell()],
        );
        Ok(s)
    }
    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        s: &mut Self::State,
    ) -> Result<(), ractor::ActorProcessingErr> {
        if let flotilla::actors::kv_publisher::KvEventsMsg::Publish(w) = msg {
            s.lock().unwrap().extend(w.decode().unwrap());
        }
        Ok(())
    }
}

/// Collect a request's tokens until it finishes (or fails).
async fn collect(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<TokenEventKind>,
) -> (Vec<u32>, Option<FinishReason>, u32) {
    let mut ids = Vec::new();
    let mut cached = 0;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("token within 60 s")
            .expect("stream open");
        match ev {
            TokenEventKind::Admitted { cached_tokens, .. } => cached = cached_tokens,
            TokenEventKind::Token { id, finish, .. } => {
                ids.push(id);
                if finish.is_some() {
                    return (ids, finish, cached);
                }
            }
            TokenEventKind::Failed { message, .. } => panic!("request failed: {message}"),
            TokenEventKind::Lost { reason } => panic!("request lost: {reason}"),
            TokenEventKind::HandOff(_) => panic!("hand-off not asked for"),
            TokenEventKind::Prompt { .. } => panic!("prompt logprobs not asked for"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_serves_the_golden_cases_alone_and_batched() {
    let h = Harness::start("rep-a", 256).await;
    let (p1, g1) = golden("chat_capital");
    let (p2, g2) = golden("chat_list");
    let (p3, g3) = golden("long_prompt");
    // Alone.
    let mut rx = h.submit(1, p1.clone(), g1.len() as u32);
    let (ids, finish, _) = collect(&mut rx).await;
    assert_eq!(ids, g1);
    assert_eq!(
        finish,
        Some(FinishReason::Stop),
        "chat_capital ends on <|im_end|>"
    );
    // Batched together (mixed prefill and decode in the same steps).
    let mut rx2 = h.submit(2, p2.clone(), g2.len() as u32);
    let mut rx3 = h.submit(3, p3.clone(), g3.len() as u32);
    let mut rx1 = h.submit(4, p1.clone(), g1.len() as u32);
    let (a, b, c) = tokio::join!(collect(&mut rx2), collect(&mut rx3), collect(&mut rx1));
    assert_eq!(a.0, g2);
    assert_eq!(a.1, Some(FinishReason::Length));
    assert_eq!(b.0, g3);
    assert_eq!(c.0, g1);
    // The long prompt again: its 18 full leading blocks come from the prefix cache, and the
    // output is unchanged.
    let mut rx = h.submit(5, p3.clone(), g3.len() as u32);
    let (ids, _, cached) = collect(&mut rx).await;
    assert_eq!(ids, g3);
    assert_eq!(
        cached,
        (303 - 1) / 16 * 16,
        "cached tokens of the repeated long prompt"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_frees_the_blocks_and_events_reach_the_kv_publisher() {
    let sub_events: Arc<std::sync::Mutex<Vec<flotilla::kv::KvEvent>>> = Default::default();
    let (_sub, _) = Actor::spawn(None, Subscriber, sub_events.clone())
        .await
        .unwrap();
    let h = Harness::start("rep-b", 128).await;
    let baseline = h.stats().await.kv_blocks_used;
    let (p3, _) = golden("long_prompt");
    let mut rx = h.submit(7, p3, 1000);
    // Wait for a few tokens, then cancel.
    let mut got = 0;
    while got < 3 {
        if let Some(TokenEventKind::Token { .. }) = rx.recv().await {
            got += 1;
        }
    }
    let used = h.stats().await.kv_blocks_used;
    assert!(used > baseline, "the request holds blocks while it runs");
    h.scheduler()
        .cast(SchedulerMsg::Cancel(Wire::encode(&(
            h.node.clone(),
            RequestId(7),
        ))))
        .unwrap();
    poll_until(
        Duration::from_secs(5),
        "blocks freed after cancel",
        || async { (h.stats().await.kv_blocks_used == baseline).then_some(()) },
    )
    .await;
    // Subscribers in the KV events group received the same events, in order, from 1 (the
    // group is process-wide: other tests' replicas publish there too).
    let got: Vec<_> = sub_events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.worker == h.worker)
        .cloned()
        .collect();
    assert!(!got.is_empty(), "KV events reached the subscriber");
    for (i, e) in got.iter().enumerate() {
        assert_eq!(
            e.event_id.0,
            i as u64 + 1,
            "event ids are consecutive from 1"
        );
    }
    // The prompt's full blocks were registered and mirrored by the KV event publisher.
    let kvm: ActorRef<KvPublisherMsg> =
        ractor::registry::where_is(format!("{}/kv_publisher", h.worker))
            .unwrap()
            .into();
    let snap = ractor::call!(kvm, KvPublisherMsg::Snapshot)
        .unwrap()
        .decode()
        .unwrap();
    assert!(
        snap.blocks.len() >= 303 / 16,
        "{} blocks registered",
        snap.blocks.len()
    );
    assert!(snap.last_event.is_some());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_fail_cleanly_and_stopping_fails_the_rest() {
    let h = Harness::start("rep-c", 8).await;
    // 8 blocks × 16 tokens = 128 slots: a 303-token prompt can never fit.
    let (p3, _) = golden("long_prompt");
    let mut rx = h.submit(9, p3, 10);
    match tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap()
        .unwrap()
    {
        TokenEventKind::Failed { message, .. } => {
            assert!(message.contains("token slots"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A running request hears that it is lost (so that it can migrate) when the replica
    // stops.
    let (p1, _) = golden("chat_capital");
    let mut rx = h.submit(10, p1, 100_000);
    loop {
        if let Some(TokenEventKind::Token { .. }) = rx.recv().await {
            break;
        }
    }
    let sched = h.scheduler();
    h.sup.stop_and_wait(None, None).await.unwrap();
    let mut failed = false;
    while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
        if let TokenEventKind::Lost { reason } = ev {
            assert!(reason.contains("stopped"), "{reason}");
            failed = true;
            break;
        }
    }
    assert!(failed, "the stopped replica told its request");
    assert_eq!(sched.get_status(), ractor::ActorStatus::Stopped);
    h.sink.stop_and_wait(None, None).await.unwrap();
}

/// B18 at the replica: sequences whose owner is gone are aborted and their blocks freed —
/// at once when a newer incarnation of the owner's node appears, after the grace when its
/// sink is just missing — and the old incarnation's events never reach the new one's sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequences_of_a_gone_owner_are_aborted_and_freed() {
    // A grace far longer than the test: an abort here can only come from the replaced owner.
    let h = Harness::start_with_grace("rep-d", 128, Duration::from_secs(600)).await;
    let baseline = h.stats().await.kv_blocks_used;
    let (p3, _) = golden("long_prompt");

    // (1) The owner's node restarts: a sink of a newer incarnation replaces the old one.
    let mut rx = h.submit(21, p3.clone(), 3000);
    while !matches!(rx.recv().await, Some(TokenEventKind::Token { .. })) {}
    h.sink.stop_and_wait(None, None).await.unwrap();
    let new_registry = SinkRegistry::default();
    let mut stray = new_registry.register(RequestId(21));
    let newer = Owner::new(h.node.clone(), 2);
    let (new_sink, _) = Actor::spawn(
        Some(sink_name(&newer)),
        TokenSink,
        (new_registry.clone(), 2),
    )
    .await
    .unwrap();
    poll_until(
        Duration::from_secs(30),
        "orphan of a replaced owner aborted",
        || async {
            let s = h.stats().await;
            (s.running + s.waiting == 0 && s.kv_blocks_used == baseline).then_some(())
        },
    )
    .await;
    assert!(
        stray.try_recv().is_err(),
        "no event of the old incarnation reached the new one"
    );

    new_sink.stop_and_wait(None, None).await.unwrap();
    h.sup.stop_and_wait(None, None).await.unwrap();

    // (2) The owner's sink is missing (no newer incarnation): aborted after the grace.
    let h = Harness::start("rep-e", 128).await;
    let baseline = h.stats().await.kv_blocks_used;
    h.sink.stop_and_wait(None, None).await.unwrap();
    let mut rx = h.submit(22, p3, 3000);
    // Events pile up undelivered; the sequence runs until the grace is over.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(rx.try_recv().is_err(), "nobody delivers to a missing sink");
    let s = h.stats().await;
    assert_eq!(s.running + s.waiting, 1, "still there within the grace");
    poll_until(
        Duration::from_secs(15),
        "orphan aborted after the grace",
        || async {
            let s = h.stats().await;
            (s.running + s.waiting == 0 && s.kv_blocks_used == baseline).then_some(())
        },
    )
    .await;
    h.sup.stop_and_wait(None, None).await.unwrap();
}

/// The first token and the hand-off of a prefill-only request.
async fn collect_hand_off(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<TokenEventKind>,
) -> (u32, RemoteKv) {
    let mut first = None;
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("event within 60 s")
            .expect("stream open");
        match ev {
            TokenEventKind::Admitted { .. } => {}
            TokenEventKind::Token {
                id, finish, index, ..
            } => {
                assert_eq!(index, 0);
                assert_eq!(finish, None, "the first token does not end it");
                first = Some(id);
            }
            TokenEventKind::HandOff(kv) => return (first.expect("token first"), *kv),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Prefill on `p` (hand-off), decode on `d` with the handed-off KV; returns every token, the
/// decode side's cached tokens, and the hand-off (as `tamper` left it).
async fn disaggregated(
    p: &Harness,
    d: &Harness,
    id: u64,
    prompt: &[u32],
    max_tokens: u32,
    tamper: impl FnOnce(&mut RemoteKv),
) -> (Vec<u32>, u32, RemoteKv) {
    let mut req = p.request(id, prompt.to_vec(), max_tokens);
    req.hand_off = true;
    let mut rx = p.submit_to(p, req);
    let (first, mut kv) = collect_hand_off(&mut rx).await;
    assert_eq!(kv.tokens as usize, prompt.len());
    assert_eq!(kv.blocks.len(), prompt.len().div_ceil(16));
    tamper(&mut kv);
    let mut decode_prompt = prompt.to_vec();
    decode_prompt.push(first);
    let mut req = p.request(id + 1, decode_prompt, max_tokens - 1);
    req.sampling.offset = 1;
    req.remote_kv = Some(kv.clone());
    let mut rx = p.submit_to(d, req);
    let (rest, _, cached) = collect(&mut rx).await;
    let mut ids = vec![first];
    ids.extend(rest);
    (ids, cached, kv)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_prefill_and_decode_give_the_golden_ids_and_move_only_missing_blocks() {
    let p = Harness::start_disagg("dis-p", Role::Prefill).await;
    let d = Harness::start_disagg("dis-d", Role::Decode).await;
    assert_eq!(p.stats().await.role, Role::Prefill);
    assert_eq!(d.stats().await.role, Role::Decode);
    let (prompt, golden_ids) = golden("long_prompt");
    let n = golden_ids.len() as u32;

    // 1. Cold: every one of the prompt's 19 blocks moves.
    let (ids, cached, kv) = disaggregated(&p, &d, 10, &prompt, n, |_| {}).await;
    assert_eq!(ids, golden_ids, "disaggregated = aggregated (greedy)");
    assert_eq!(cached, 0, "nothing was cached on the decode worker");
    assert!(kv.region.is_some(), "a real engine hands off its region");
    let s = d.stats().await;
    assert_eq!((s.blocks_pulled, s.pull_fallbacks), (19, 0));
    // The decode worker confirmed: the prefill worker released its blocks.
    p.wait_released().await;

    // 2. Warm: the decode worker now holds the prompt's 18 full blocks; only the last,
    //    partial one moves.
    let (ids, cached, _) = disaggregated(&p, &d, 20, &prompt, n, |_| {}).await;
    assert_eq!(ids, golden_ids);
    assert_eq!(cached, 18 * 16);
    assert_eq!(
        d.stats().await.blocks_pulled,
        19 + 1,
        "only the missing block moved"
    );

    // 3. A pull that fails (the prefill worker's address is wrong) falls back to computing
    //    the prompt on the decode worker: same tokens.
    let (prompt2, golden2) = golden("chat_list");
    let (ids, _, _) = disaggregated(&p, &d, 30, &prompt2, golden2.len() as u32, |kv| {
        if let Some(r) = kv.region.as_mut() {
            r.ucx = None;
            r.tcp = "127.0.0.1:1".into();
        }
    })
    .await;
    assert_eq!(ids, golden2, "recomputed on the decode worker");
    let s = d.stats().await;
    assert_eq!(s.pull_fallbacks, 1);
    assert_eq!((s.pulls_pending, s.kv_blocks_used), (0, 0));
    p.wait_released().await;
    p.stop().await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_off_is_released_when_its_request_is_cancelled() {
    let p = Harness::start_disagg("dis-q", Role::Prefill).await;
    let (prompt, _) = golden("chat_list");
    let mut req = p.request(40, prompt.clone(), 8);
    req.hand_off = true;
    let mut rx = p.submit_to(&p, req);
    let (_, kv) = collect_hand_off(&mut rx).await;
    let s = p.stats().await;
    assert_eq!(s.held, 1);
    assert!(s.kv_blocks_used >= kv.blocks.len());
    // The gateway's Request cancels (the client left): the hold ends at once.
    p.scheduler()
        .cast(SchedulerMsg::Cancel(Wire::encode(&(
            p.node.clone(),
            RequestId(40),
        ))))
        .unwrap();
    p.wait_released().await;
    p.stop().await;
}

/// Until no tier copy is in flight; the tier counters then.
async fn tiers_settled(h: &Harness) -> flotilla::kv::TierUsage {
    poll_until(Duration::from_secs(20), "tier copies returned", || async {
        let t = h.stats().await.kv_tiers.expect("tiers on");
        (t.copies_in_flight == 0).then_some(t)
    })
    .await
}

/// The real model over G1 → G2 → G3: a long prompt pushed out of G1 (and G2) by another one
/// comes back from the lower tiers with the same greedy ids, its onboarded tokens reported as
/// cached; a damaged G3 segment is a miss (recomputed, same ids), never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_evicted_to_host_and_disk_gives_the_same_ids_and_counts_as_cached() {
    let dir = std::env::temp_dir().join(format!("flotilla-replica-tiers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let tiers = TierConfig {
        host_blocks: 20,
        disk_blocks: 64,
        disk_min_hits: 0,
        ..TierConfig::default()
    };
    // G1 of 24 blocks: the long prompt (303 tokens, 19 blocks) and a second one of the same
    // length cannot both stay.
    let h = Harness::start_tiered("rep-tiers", 24, tiers, Some(dir.clone())).await;
    let (p3, g3) = golden("long_prompt");
    let mut other = p3.clone();
    other[0] = other[0].wrapping_add(1); // another chain, same length
    let full = (303 - 1) / 16 * 16;

    let mut rx = h.submit(1, p3.clone(), g3.len() as u32);
    let (ids, _, cached) = collect(&mut rx).await;
    assert_eq!((ids.as_slice(), cached), (g3.as_slice(), 0));
    tiers_settled(&h).await;
    // The other prompt evicts the long one from G1; its offloads push it from G2 to G3.
    let mut rx = h.submit(2, other.clone(), 4);
    collect(&mut rx).await;
    let t = tiers_settled(&h).await;
    assert!(t.counters.demotions > 0, "{t:?}");

    let mut rx = h.submit(3, p3.clone(), g3.len() as u32);
    let (ids, _, cached) = collect(&mut rx).await;
    assert_eq!(ids, g3, "onboarded KV gives the cold run's greedy ids");
    assert_eq!(
        cached as usize, full,
        "G1 + onboarded tokens reported cached"
    );
    let t = tiers_settled(&h).await;
    assert!(t.counters.onboards_disk > 0, "{t:?}");

    // Push it out again, then damage the whole segment: every G3 read is a miss.
    let mut rx = h.submit(4, other, 4);
    collect(&mut rx).await;
    let before = tiers_settled(&h).await;
    let seg = std::fs::read_dir(&dir)
        .expect("segment dir")
        .map(|e| e.expect("entry").path())
        .find(|p| p.extension().is_some_and(|x| x == "kvseg"))
        .expect("the G3 segment");
    let len = std::fs::metadata(&seg).expect("segment").len();
    std::fs::write(&seg, vec![0x5A; len as usize]).expect("damage the segment");
    let mut rx = h.submit(5, p3, g3.len() as u32);
    let (ids, _, _) = collect(&mut rx).await;
    assert_eq!(ids, g3, "recomputed, never served from a damaged block");
    let t = tiers_settled(&h).await;
    assert!(
        t.counters.corrupt > before.counters.corrupt && t.disk_blocks < before.disk_blocks,
        "damaged G3 blocks are found and dropped: {before:?} → {t:?}"
    );
    assert_eq!(t.counters.onboards_disk, before.counters.onboards_disk);
    assert_eq!(h.stats().await.kv_blocks_used, 0, "no block leaked");
    h.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
