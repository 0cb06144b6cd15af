use super::*;
use crate::runtime::clock::ManualClock;
use std::sync::Mutex;
use std::time::Duration;

/// Workers set by the test.
#[derive(Default)]
struct Fixed {
    routable: Mutex<Vec<WorkerId>>,
    alive: Mutex<Vec<WorkerId>>,
    prefill: Mutex<Vec<WorkerId>>,
    decode: Mutex<Vec<WorkerId>>,
}

impl Fixed {
    fn set(&self, routable: &[&str], alive: &[&str]) {
        *self.routable.lock().unwrap() = ws(routable);
        *self.alive.lock().unwrap() = ws(alive);
    }
}

impl WorkerSource for Fixed {
    fn routable(&self) -> Vec<WorkerId> {
        self.routable.lock().unwrap().clone()
    }
    fn alive(&self) -> Vec<WorkerId> {
        self.alive.lock().unwrap().clone()
    }
    fn in_role(&self, role: Role) -> Vec<WorkerId> {
        match role {
            Role::Prefill => self.prefill.lock().unwrap().clone(),
            Role::Decode => self.decode.lock().unwrap().clone(),
            Role::Aggregated => vec![],
        }
    }
}

fn router(policy: Policy) -> (RouterCore, ManualClock, Arc<Fixed>) {
    let clock = ManualClock::new();
    let workers = Arc::new(Fixed::default());
    let state = RouterCore::new(RouterCoreArgs {
        config: SelectorConfig {
            policy,
            ..SelectorConfig::default()
        },
        clock: Arc::new(clock.clone()),
        workers: workers.clone(),
        disagg: DisaggRouting::default(),
        queues: None,
        share_load: true,
        sessions: SessionTable::default(),
    })
    .unwrap();
    (state, clock, workers)
}

/// Stored events: worker `w{i % 8}` holds the first `4 + i % 5` blocks of prefix `i`
/// (prefix `i`'s block `b` has sequence hash `1000 i + b`), one event per prefix, ids
/// counting per worker.
fn fleet_events(prefixes: u64) -> Vec<KvEvent> {
    use crate::kv::{KvEventData, StoredBlock, Tier};
    let mut next: HashMap<u64, u64> = HashMap::new();
    (0..prefixes)
        .map(|i| {
            let id = next.entry(i % 8).or_insert(0);
            *id += 1;
            KvEvent {
                worker: WorkerId::new(format!("w{}", i % 8)),
                event_id: EventId(*id),
                tier: Tier::Device,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: (0..4 + i % 5)
                        .map(|b| StoredBlock {
                            seq_hash: crate::runtime::ids::SequenceHash(1000 * i + b),
                            block_hash: crate::runtime::ids::BlockHash(1000 * i + b),
                        })
                        .collect(),
                },
            }
        })
        .collect()
}

/// Request `n`: 12 blocks, the first `n % 9` of prefix `n % 13`, the rest its own.
fn prefix_req(n: u64) -> RouteRequest {
    let p = n % 13;
    let shared = n % 9;
    let hashes = (0..12)
        .map(|b| {
            let h = if b < shared {
                1000 * p + b
            } else {
                1_000_000 * (n + 1) + b
            };
            crate::runtime::ids::SequenceHash(h)
        })
        .collect();
    RouteRequest {
        prompt_tokens: 12 * 16,
        seq_hashes: hashes,
        ..req(n)
    }
}

/// Routers `rs` take requests in turn and tell each other every change at once: each
/// placement must be the one a single router taking them all makes.
fn shared_routers_place_like_one(policy: Policy) {
    let all: Vec<String> = (0..8).map(|i| format!("w{i}")).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let (mut one, _, w1) = router(policy);
    w1.set(&all, &all);
    // It stands for routers that know of each other (ties spread by request).
    one.router_joined("r-other");
    let mut rs: Vec<RouterCore> = (0..4)
        .map(|k| {
            let (mut r, _, w) = router(policy);
            w.set(&all, &all);
            for other in (0..4).filter(|o| *o != k) {
                r.router_joined(&format!("r{other}"));
            }
            r
        })
        .collect();
    let events = fleet_events(13);
    one.kv_events(events.clone());
    for r in &mut rs {
        r.kv_events(events.clone());
    }
    let mut spread = std::collections::HashSet::new();
    for n in 0..200u64 {
        let k = (n % 4) as usize;
        let expect = one.place(prefix_req(n)).unwrap().unwrap();
        let got = rs[k].place(prefix_req(n)).unwrap().unwrap();
        assert_eq!(got, expect, "request {n} on router {k}");
        spread.insert(got.worker.clone());
        // Some requests end, some see their first token, through the router that placed
        // them (FirstToken and Release go to the request's router).
        let node = NodeId::new("gw");
        if n % 3 == 0 {
            one.first_token(node.clone(), RequestId(n));
            rs[k].first_token(node.clone(), RequestId(n));
        }
        if n >= 5 && n % 2 == 0 {
            one.release(node.clone(), RequestId(n - 5));
            rs[((n - 5) % 4) as usize].release(node, RequestId(n - 5));
        }
        for from in 0..rs.len() {
            let changes = rs[from].take_shared();
            for (to, r) in rs.iter_mut().enumerate() {
                if to != from {
                    r.peer_load(&format!("r{from}"), changes.clone());
                }
            }
        }
    }
    assert!(
        spread.len() >= 4,
        "the workload exercises the load, not one worker"
    );
    for r in &rs {
        assert_eq!(
            r.placed(),
            one.placed(),
            "every router counts every placement"
        );
    }
}

#[test]
fn routers_that_share_their_load_place_like_one_router() {
    shared_routers_place_like_one(Policy::Kv);
    shared_routers_place_like_one(Policy::DynamoKv);
    shared_routers_place_like_one(Policy::LeastLoaded);
    shared_routers_place_like_one(Policy::RoundRobin);
}

#[test]
fn routers_that_do_not_share_their_load_pile_onto_the_same_idle_worker() {
    let all = ["w0", "w1", "w2", "w3"];
    let mut rs: Vec<RouterCore> = (0..4)
        .map(|_| {
            let (mut r, _, w) = router(Policy::Kv);
            r.share_load = false;
            w.set(&all, &all);
            r
        })
        .collect();
    // Four cold requests, one per router, nothing cached: each router sees an idle
    // fleet and takes the first worker.
    let picks: std::collections::HashSet<WorkerId> = (0..4)
        .map(|k| rs[k].place(req(k as u64)).unwrap().unwrap().worker)
        .collect();
    assert_eq!(picks.len(), 1, "independent routers collide: {picks:?}");
    assert!(rs.iter_mut().all(|r| r.take_shared().is_empty()));
}

#[test]
fn a_router_that_leaves_takes_its_placements_with_it() {
    let (mut a, _, wa) = router(Policy::LeastLoaded);
    let (mut b, _, wb) = router(Policy::LeastLoaded);
    wa.set(&["w0", "w1"], &["w0", "w1"]);
    wb.set(&["w0", "w1"], &["w0", "w1"]);
    let p = a.place(req(1)).unwrap().unwrap();
    b.peer_load("ra", a.take_shared());
    assert_eq!(b.load.in_flight(&p.worker), 1, "b counts a's placement");
    // b's own next pick avoids the busy worker.
    let q = b.place(req(2)).unwrap().unwrap();
    assert_ne!(q.worker, p.worker);
    // A release through b of a's request is told to a too.
    b.release(NodeId::new("gw"), RequestId(1));
    a.peer_load("rb", b.take_shared());
    assert_eq!(a.load.in_flight(&p.worker), 0);
    assert_eq!(a.load.in_flight(&q.worker), 1, "b's placement reached a");
    // b leaves: a forgets what b placed, and only that.
    let (mut c, _, wc) = router(Policy::LeastLoaded);
    wc.set(&["w0", "w1"], &["w0", "w1"]);
    c.place(req(3)).unwrap();
    a.peer_load("rc", c.take_shared());
    assert_eq!(a.router_left("rb"), 1);
    assert_eq!(a.placed(), 1, "c's placement stays");
    // c's worker dies: its placement goes, and so does the note of who placed it.
    let w = a
        .load
        .worker_of(&RequestKey::new(NodeId::new("gw"), RequestId(3)))
        .cloned();
    a.worker_left(&w.unwrap());
    let now = a.now_ms();
    a.housekeeping(now);
    assert_eq!(a.placed(), 0);
    assert!(
        a.peer_placed.is_empty(),
        "no origin kept for a placement gone"
    );
}

#[test]
fn a_queued_request_moves_only_to_a_shorter_queue() {
    let (mut r, _, workers) = router(Policy::LeastLoaded);
    // Four requests of 32 tokens wait on w0, the only worker; then w1 joins.
    workers.set(&["w0"], &["w0"]);
    for n in 1..=4 {
        assert_eq!(
            r.place(req(n)).unwrap().unwrap().worker,
            WorkerId::new("w0")
        );
    }
    workers.set(&["w0", "w1"], &["w0", "w1"]);
    // Each queued request asks with a fresh attempt id, naming the attempt it would move;
    // a move releases the old placement at once (the Request's own release comes later
    // and changes nothing), so asks in the same moment see the queue as it will be.
    let ask = |n: u64, old: u64| RouteRequest {
        rebalance: Some(RequestId(old)),
        ..req(n)
    };
    let p = r.place(ask(11, 1)).unwrap().expect("w1 is idle: move");
    assert_eq!(p.worker, WorkerId::new("w1"));
    assert_eq!(r.load.prefill_tokens(&WorkerId::new("w0")), 96);
    let p = r
        .place(ask(12, 2))
        .unwrap()
        .expect("32 + 32 there, 96 - 32 here: move");
    assert_eq!(p.worker, WorkerId::new("w1"));
    r.release(NodeId::new("gw"), RequestId(2));
    // Now 64 and 64: a move would only turn the imbalance around.
    assert!(r.place(ask(13, 3)).unwrap().is_none(), "stays");
    assert_eq!(r.load.prefill_tokens(&WorkerId::new("w0")), 64);
    assert_eq!(r.load.prefill_tokens(&WorkerId::new("w1")), 64);
    // An attempt this router no longer knows, or no other worker: nowhere to go.
    assert!(r.place(ask(14, 99)).unwrap().is_none());
    workers.set(&["w0"], &["w0"]);
    assert!(r.place(ask(15, 4)).unwrap().is_none());
}

fn req(n: u64) -> RouteRequest {
    RouteRequest {
        node: NodeId::new("gw"),
        request: RequestId(n),
        prompt_tokens: 32,
        seq_hashes: vec![],
        policy: None,
        avoid: vec![],
        rebalance: None,
        remote_prefill: false,
        trace_id: None,
        traceparent: None,
        session: None,
    }
}

fn turn(n: u64, session: &str) -> RouteRequest {
    RouteRequest {
        session: Some(session.to_owned()),
        ..req(n)
    }
}

#[test]
fn a_sessions_turns_stick_and_another_router_adopts_its_affinity() {
    let all = ["w0", "w1", "w2", "w3"];
    let (mut a, _, wa) = router(Policy::Kv);
    let (mut b, _, wb) = router(Policy::Kv);
    // Turns' prompts are never first-tokened here: they pile up in the queue.
    for r in [&mut a, &mut b] {
        r.config.session_max_queued_tokens = 16_384;
        r.selectors.clear();
    }
    wa.set(&all, &all);
    wb.set(&all, &all);
    a.router_joined("rb");
    b.router_joined("ra");
    let first = a.place(turn(1, "s")).unwrap().unwrap();
    assert_eq!(
        first.terms.as_ref().unwrap().session.as_deref(),
        Some("none")
    );
    b.peer_load("ra", a.take_shared());
    // Turns of "s" end and new ones come, through either router, while other requests
    // load the fleet: every turn goes to the first worker.
    for n in 2..12u64 {
        let r = if n % 2 == 0 { &mut b } else { &mut a };
        let p = r.place(turn(n, "s")).unwrap().unwrap();
        assert_eq!(p.worker, first.worker, "turn {n}");
        assert_eq!(p.terms.as_ref().unwrap().session.as_deref(), Some("kept"));
        r.place(req(100 + n)).unwrap();
        let changes = r.take_shared();
        let other = if n % 2 == 0 { &mut a } else { &mut b };
        other.peer_load(if n % 2 == 0 { "rb" } else { "ra" }, changes);
    }
    // Avoided (it failed this request): placed elsewhere, and the session moves there
    // for both routers.
    let mut moved = turn(50, "s");
    moved.avoid = vec![first.worker.clone()];
    let p = a.place(moved).unwrap().unwrap();
    assert_ne!(p.worker, first.worker);
    assert_eq!(
        p.terms.as_ref().unwrap().session.as_deref(),
        Some("released")
    );
    b.peer_load("ra", a.take_shared());
    let q = b.place(turn(51, "s")).unwrap().unwrap();
    assert_eq!(q.worker, p.worker, "b adopted a's new affinity");
    // Requests without a session say nothing of one.
    assert_eq!(
        b.place(req(60)).unwrap().unwrap().terms.unwrap().session,
        None
    );
}

#[test]
fn a_saturated_sessions_worker_releases_it() {
    let (mut r, _, workers) = router(Policy::Kv);
    r.config.session_max_queued_tokens = 100;
    r.selectors.clear();
    workers.set(&["w0", "w1"], &["w0", "w1"]);
    let first = r.place(turn(1, "s")).unwrap().unwrap().worker;
    // Turn 1 has not seen its first token: its 32 tokens are queued, under 100.
    let p = r.place(turn(2, "s")).unwrap().unwrap();
    assert_eq!(p.worker, first);
    // A long turn (64 tokens queued after 64: still at most 100) takes it past 100.
    let mut long = turn(3, "s");
    long.prompt_tokens = 64;
    assert_eq!(r.place(long).unwrap().unwrap().worker, first);
    let p = r.place(turn(9, "s")).unwrap().unwrap();
    assert_ne!(p.worker, first, "over 100 queued tokens: released");
    assert_eq!(p.terms.unwrap().session.as_deref(), Some("released"));
    let p = r.place(turn(10, "s")).unwrap().unwrap();
    assert_ne!(p.worker, first, "the session moved");
}

#[test]
fn no_live_worker_no_placement() {
    let (mut r, _, _) = router(Policy::LeastLoaded);
    assert_eq!(r.route(req(1), r.now_ms()).unwrap(), None);
    assert!(r.load.is_empty());
}

#[test]
fn a_placement_sticks_while_its_worker_is_live() {
    let (mut r, _, workers) = router(Policy::RoundRobin);
    workers.set(&["a", "b"], &["a", "b"]);
    let now = r.now_ms();
    let first = r.route(req(1), now).unwrap().unwrap().worker;
    for _ in 0..3 {
        assert_eq!(
            r.route(req(1), now).unwrap().map(|p| p.worker),
            Some(first.clone())
        );
    }
    assert_eq!(r.load.len(), 1);
    // Its worker leaves routing: the request is placed elsewhere.
    let other = if first.as_str() == "a" { "b" } else { "a" };
    workers.set(&[other], &["a", "b"]);
    assert_eq!(
        r.route(req(1), now).unwrap().map(|p| p.worker),
        Some(WorkerId::new(other))
    );
    assert_eq!(r.load.len(), 1, "moved, not duplicated");
}

#[test]
fn placements_expire_on_the_injected_clock() {
    let (mut r, clock, workers) = router(Policy::LeastLoaded);
    workers.set(&["a"], &["a"]);
    r.route(req(1), r.now_ms()).unwrap();
    clock.advance(Duration::from_millis(LEASE_TTL_MS));
    assert!(r.housekeeping(r.now_ms()).is_empty());
    assert_eq!(r.load.len(), 1, "not yet: a lease lasts LEASE_TTL_MS");
    clock.advance(Duration::from_millis(1));
    r.housekeeping(r.now_ms());
    assert!(r.load.is_empty(), "expired past the lease");
}

#[test]
fn released_placements_free_their_worker() {
    let (mut r, _, workers) = router(Policy::LeastLoaded);
    workers.set(&["a"], &["a"]);
    let now = r.now_ms();
    r.route(req(1), now).unwrap();
    r.route(req(2), now).unwrap();
    assert_eq!(r.load.in_flight(&WorkerId::new("a")), 2);
    r.load
        .on_finished(&RequestKey::new(NodeId::new("gw"), RequestId(1)));
    assert_eq!(r.load.in_flight(&WorkerId::new("a")), 1);
}

fn ws(names: &[&str]) -> Vec<WorkerId> {
    names.iter().map(|n| WorkerId::new(*n)).collect()
}

#[test]
fn workers_that_failed_a_request_are_avoided_unless_none_is_left() {
    assert_eq!(prefer_not(ws(&["a", "b", "c"]), &[]), ws(&["a", "b", "c"]));
    assert_eq!(
        prefer_not(ws(&["a", "b", "c"]), &ws(&["b"])),
        ws(&["a", "c"])
    );
    assert_eq!(
        prefer_not(ws(&["a", "b"]), &ws(&["a", "b"])),
        ws(&["a", "b"])
    );
    assert_eq!(
        prefer_not(ws(&["a"]), &ws(&["a"])),
        ws(&["a"]),
        "the only one left"
    );
    assert_eq!(prefer_not(vec![], &ws(&["a"])), ws(&[]));
}

/// Workers p (prefill), d (decode), a (aggregated); min_prefill_tokens 64.
fn disagg_router() -> (RouterCore, Arc<Fixed>) {
    let (mut r, _, workers) = router(Policy::Kv);
    r.disagg = DisaggRouting {
        min_prefill_tokens: 64,
        max_prefill_queue_tokens: 200,
    };
    workers.set(&["p", "d"], &["p", "d"]);
    *workers.prefill.lock().unwrap() = ws(&["p"]);
    *workers.decode.lock().unwrap() = ws(&["d"]);
    (r, workers)
}

fn long(n: u64, tokens: u32) -> RouteRequest {
    RouteRequest {
        prompt_tokens: tokens,
        remote_prefill: true,
        ..req(n)
    }
}

#[test]
fn a_long_uncached_prompt_goes_to_a_prefill_worker_first() {
    let (mut r, _) = disagg_router();
    let now = r.now_ms();
    let p = r.route(long(1, 100), now).unwrap().unwrap();
    assert_eq!(p.worker, WorkerId::new("p"));
    assert!(p.hand_off);
    assert_eq!(
        r.load.prefill_tokens(&WorkerId::new("p")),
        100,
        "booked on p"
    );
    // Short prompts prefill on the decode worker.
    let p = r.route(long(2, 63), now).unwrap().unwrap();
    assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
    // The decode attempt of a hand-off never goes back to a prefill worker.
    let mut decode = long(3, 100);
    decode.remote_prefill = false;
    let p = r.route(decode, now).unwrap().unwrap();
    assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
}

#[test]
fn a_long_prefill_queue_keeps_the_prefill_on_the_decode_worker() {
    let (mut r, _) = disagg_router();
    let now = r.now_ms();
    assert!(r.route(long(1, 150), now).unwrap().unwrap().hand_off);
    // The rule reads p's queue before booking the request: 150 <= 200 still hands off;
    // with 250 queued the decode worker prefills itself.
    assert!(r.route(long(2, 100), now).unwrap().unwrap().hand_off);
    let p = r.route(long(3, 100), now).unwrap().unwrap();
    assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
}

#[test]
fn aggregated_workers_prefill_themselves_and_prefill_workers_serve_when_alone() {
    let (mut r, workers) = disagg_router();
    workers.set(&["p", "a"], &["p", "a"]);
    let now = r.now_ms();
    let p = r.route(long(1, 500), now).unwrap().unwrap();
    assert_eq!((p.worker.as_str(), p.hand_off), ("a", false));
    // Only the prefill worker is left: it serves whole requests.
    workers.set(&["p"], &["p"]);
    let p = r.route(long(2, 500), now).unwrap().unwrap();
    assert_eq!((p.worker.as_str(), p.hand_off), ("p", false));
    // No prefill worker: decode workers prefill everything.
    workers.set(&["d"], &["d"]);
    let p = r.route(long(3, 500), now).unwrap().unwrap();
    assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
}

#[test]
fn disaggregation_off_never_hands_off() {
    let (mut r, _) = disagg_router();
    r.disagg.min_prefill_tokens = 0;
    let p = r.route(long(1, 5000), r.now_ms()).unwrap().unwrap();
    assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
}

/// A live worker the index does not know is wanted for a snapshot at the next tick, once per
/// [`RESYNC_RETRY_MS`] until its snapshot comes; a worker that leaves is no longer wanted.
#[test]
fn snapshots_are_wanted_for_unknown_workers_and_asked_again_when_lost() {
    let (mut r, clock, workers) = router(Policy::LeastLoaded);
    workers.set(&["a", "b"], &["a", "b"]);
    r.tick();
    assert_eq!(r.take_snapshot_requests(), ws(&["a", "b"]));
    r.tick();
    assert!(
        r.take_snapshot_requests().is_empty(),
        "asked, not due again yet"
    );
    clock.advance(Duration::from_millis(RESYNC_RETRY_MS));
    r.tick();
    r.worker_left(&WorkerId::new("b"));
    assert_eq!(
        r.take_snapshot_requests(),
        ws(&["a"]),
        "asked again; b left"
    );
    // a's snapshot comes: known now, not wanted again.
    r.snapshot(KvSnapshot {
        worker: WorkerId::new("a"),
        last_event: Some(EventId(3)),
        blocks: Vec::new(),
        lower: Vec::new(),
    });
    workers.set(&["a"], &["a"]);
    clock.advance(Duration::from_millis(RESYNC_RETRY_MS));
    r.tick();
    assert!(r.take_snapshot_requests().is_empty());
}
