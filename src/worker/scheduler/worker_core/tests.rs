use super::step::prompt_targets;
use super::*;
use crate::kv::BlockPool;
use crate::request_plane::protocol::FetchHint;
use crate::runtime::clock::{Clock, ManualClock};
use crate::runtime::ids::NodeId;
use crate::worker::engine::SamplingParams;
use crate::worker::engine::{SampledToken, StepOutput};
use crate::worker::scheduler::SchedulerConfig;
use crate::worker::scheduler::{DisaggWorker, PeerPullWorker, ScheduledSeq, SimTransfer};
use std::sync::Arc;

/// Echo: each row is scored against the token after it, while that token is among the
/// first `echo_tokens`; the last row of a chunk against the next chunk's first token.
#[test]
fn prompt_rows_are_scored_against_the_next_prompt_token() {
    let entry = |start: usize, ids: &[u32], next: Option<u32>| ScheduledSeq {
        seq: SeqId(1),
        token_ids: ids.to_vec(),
        start_pos: start,
        block_table: vec![],
        sample: next.is_none(),
        cached_tokens: None,
        next_token: next,
    };
    // Prompt [10, 11, 12, 13, 14] in two chunks.
    assert_eq!(
        prompt_targets(&entry(0, &[10, 11, 12], Some(13)), 5),
        [11, 12, 13]
    );
    assert_eq!(prompt_targets(&entry(3, &[13, 14], None), 5), [14]);
    // No echo; a one-token prompt; a decode step past the prompt.
    assert!(prompt_targets(&entry(0, &[10, 11, 12], Some(13)), 0).is_empty());
    assert!(prompt_targets(&entry(0, &[10], None), 1).is_empty());
    assert!(prompt_targets(&entry(5, &[15], None), 5).is_empty());
    // A migrated sequence (prompt + 2 generated): only the client's prompt is scored.
    assert_eq!(
        prompt_targets(&entry(0, &[10, 11, 12, 13, 14, 15, 16], None), 5),
        [11, 12, 13, 14]
    );
}

fn core(clock: &ManualClock, role: Role) -> WorkerCore {
    let pool = BlockPool::new(64, 4, 7).unwrap();
    let batcher = SchedulerCore::new(SchedulerConfig::default(), pool).unwrap();
    WorkerCore::new(
        WorkerCoreConfig {
            worker: WorkerId::new("n/replica-0"),
            eos_token_id: None,
            block_size: 4,
            role,
            disagg: DisaggWorker::default(),
            step_timeout: Duration::from_secs(2),
            canary_interval: Duration::from_secs(10),
            owner_grace: Duration::from_secs(3),
            has_transport: false,
            sim_transfer: None,
            peer_pull: None,
        },
        batcher,
        Arc::new(clock.clone()),
    )
}

/// A request of a 10-token prompt from gateway `gw` (also the sub-cores' tests').
pub(super) fn job(id: u64, max_tokens: u32) -> SubmitRequest {
    SubmitRequest {
        request: RequestId(id),
        reply_to: NodeId::new("gw"),
        prompt: (1..=10).collect(),
        max_tokens,
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
    }
}

/// The step the core asked for, answered with token 42 for every sampling row.
fn answer(effects: &[WorkerEffect]) -> Option<StepResult> {
    effects.iter().find_map(|e| match e {
        WorkerEffect::Step { step, batch } => Some(StepResult {
            step: *step,
            output: Ok(StepOutput {
                tokens: batch
                    .seqs
                    .iter()
                    .filter(|s| s.sample)
                    .map(|s| SampledToken {
                        seq_id: s.seq_id,
                        token: 42,
                        logprob: 0.0,
                        top: Vec::new(),
                    })
                    .collect(),
                prompt: Vec::new(),
            }),
        }),
        _ => None,
    })
}

/// The state of request `id`'s record (`None`: not here).
fn state(w: &WorkerCore, id: u64) -> Option<&'static str> {
    let seq = w.by_request.get(&(NodeId::new("gw"), RequestId(id)))?;
    Some(match w.seqs[seq].state {
        SeqState::Waiting { .. } => "waiting",
        SeqState::Pulling { .. } => "pulling",
        SeqState::Prefilling => "prefilling",
        SeqState::Decoding => "decoding",
        SeqState::HandedOff { .. } => "handed off",
    })
}

fn delivered(core: &mut WorkerCore) -> Vec<TokenEventKind> {
    let mut out = Vec::new();
    core.flush(
        |_, events| {
            out.extend(events.into_iter().map(|e| e.kind));
            Ok(())
        },
        |_| OwnerStatus::Present,
    );
    out
}

/// A puller: peer pulls on, pulls simulated (no transport here).
fn puller(clock: &ManualClock) -> WorkerCore {
    let pool = BlockPool::new(64, 4, 7).unwrap();
    let batcher = SchedulerCore::new(SchedulerConfig::default(), pool).unwrap();
    WorkerCore::new(
        WorkerCoreConfig {
            worker: WorkerId::new("n/replica-1"),
            eos_token_id: None,
            block_size: 4,
            role: Role::Aggregated,
            disagg: DisaggWorker::default(),
            step_timeout: Duration::from_secs(2),
            canary_interval: Duration::from_secs(10),
            owner_grace: Duration::from_secs(3),
            has_transport: false,
            sim_transfer: Some(SimTransfer {
                bytes_per_token: 1024,
                gbps: 1.0,
                latency: Duration::from_micros(100),
                speedup: 1.0,
            }),
            peer_pull: Some(PeerPullWorker {
                prior_block_ms: 0.1,
                fixed_ms: 0.1,
                ask_timeout: Duration::from_secs(1),
            }),
        },
        batcher,
        Arc::new(clock.clone()),
    )
}

fn run_out(w: &mut WorkerCore, clock: &ManualClock) {
    while let Some(step) = answer(&w.take_effects()) {
        clock.advance(Duration::from_millis(5));
        w.step_done(step, || None).unwrap();
        delivered(w);
    }
}

#[test]
fn a_peer_pull_pins_the_holders_prefix_until_the_puller_confirms_and_a_refusal_recomputes() {
    let clock = ManualClock::new();
    let mut h = core(&clock, Role::Aggregated);
    h.submit(job(1, 2)).unwrap();
    run_out(&mut h, &clock);
    let holder = h.worker().clone();
    let mut p = puller(&clock);
    p.take_effects();
    let mut j = job(2, 2);
    j.fetch = Some(FetchHint {
        holder: holder.clone(),
        blocks: 2,
    });
    let key = (NodeId::new("gw"), RequestId(2));
    p.submit(j).unwrap();
    let asked = p.take_effects();
    let Some(WorkerEffect::Fetch { tokens, .. }) = asked
        .iter()
        .find(|e| matches!(e, WorkerEffect::Fetch { .. }))
    else {
        panic!("no fetch: {asked:?}");
    };
    assert_eq!(tokens.len(), 8, "two full blocks, never the last token");
    let kv = h.export(key.clone(), tokens, None).unwrap();
    assert_eq!((kv.blocks.len(), kv.tokens), (2, 8));
    assert!(h.pool().usage().used_blocks >= 2, "pinned for the peer");
    p.fetch_done(&key, Ok(kv)).unwrap();
    let effects = p.take_effects();
    let early = delivered(&mut p);
    assert!(
        !early
            .iter()
            .any(|e| matches!(e, TokenEventKind::Admitted { .. })),
        "admitted once the pull lands: {early:?}"
    );
    let Some(WorkerEffect::Pull(pj)) = effects.iter().find(|e| matches!(e, WorkerEffect::Pull(_)))
    else {
        panic!("no pull: {effects:?}");
    };
    assert_eq!(pj.from.as_ref(), Some(&holder));
    assert!(matches!(pj.work, PullWork::Sim { .. }));
    assert_eq!(state(&p, 2), Some("pulling"));
    clock.advance(Duration::from_millis(1));
    p.pull_done(PullResult {
        seq: pj.seq,
        outcome: Ok(pj.blocks),
        bytes: 4096,
    })
    .unwrap();
    assert_eq!(
        p.stats().kv_transfer_bytes,
        4096,
        "the pull's bytes published"
    );
    let effects = p.take_effects();
    assert!(effects.iter().any(|e| matches!(e,
        WorkerEffect::ConfirmPull { prefill, key: k } if *prefill == holder && *k == key)));
    let admitted = delivered(&mut p);
    assert!(
        admitted.iter().any(|e| matches!(
            e,
            TokenEventKind::Admitted {
                cached_tokens: 8,
                ..
            }
        )),
        "the pulled tokens count as cached: {admitted:?}"
    );
    assert_eq!(
        state(&p, 2),
        Some("prefilling"),
        "its last prompt token is computed here"
    );
    let s = p.stats().peer_pulls;
    assert_eq!((s.asked, s.pulled, s.blocks, s.failed), (1, 1, 2, 0));
    if let Some(step) = answer(&effects) {
        clock.advance(Duration::from_millis(5));
        p.step_done(step, || None).unwrap();
        delivered(&mut p);
    }
    run_out(&mut p, &clock);
    assert!(!p.has(&key), "the pulled request ran to its last token");
    // The confirmation unpins the holder's blocks.
    h.cancel(&key).unwrap();
    assert_eq!(h.pool().usage().used_blocks, 0);
    assert!(h.is_idle());
    // A refused ask: the prompt is computed here, and the request still runs.
    let mut j = job(3, 2);
    j.prompt = (101..=110).collect();
    j.fetch = Some(FetchHint { holder, blocks: 2 });
    let key3 = (NodeId::new("gw"), RequestId(3));
    p.submit(j).unwrap();
    p.take_effects();
    let refused = h.export(key3.clone(), &(101..=108).collect::<Vec<u32>>(), None);
    assert!(refused.is_err(), "the holder holds none of it");
    p.fetch_done(&key3, refused).unwrap();
    assert_eq!(p.stats().peer_pulls.failed, 1);
    run_out(&mut p, &clock);
    assert!(!p.has(&key3), "it ran to its last token");
}

#[test]
fn migrated_requests_that_arrive_together_share_the_first_step() {
    let clock = ManualClock::new();
    let pool = BlockPool::new(64, 4, 7).unwrap();
    let cfg = SchedulerConfig {
        resume_gather_ms: 5,
        ..SchedulerConfig::default()
    };
    let mut w = core(&clock, Role::Aggregated);
    w.core = SchedulerCore::new(cfg, pool).unwrap();
    w.take_effects();
    let migrated = |id| {
        let mut j = job(id, 2);
        j.sampling.offset = 3; // three tokens delivered before the loss
        j
    };
    // The first migrated request on an idle engine waits for the rest of its group.
    w.submit(migrated(1)).unwrap();
    let first = w.take_effects();
    assert!(answer(&first).is_none(), "no step yet: {first:?}");
    let until = first
        .iter()
        .find_map(|e| match e {
            WorkerEffect::KickAt(at) => Some(*at),
            _ => None,
        })
        .expect("a gather window");
    clock.advance(Duration::from_millis(1));
    w.submit(migrated(2)).unwrap();
    w.tick(|_| OwnerStatus::Present).unwrap();
    let more = w.take_effects();
    assert!(
        !more.iter().any(|e| matches!(e, WorkerEffect::KickAt(_))) && answer(&more).is_none(),
        "one window, and nothing starts within it: {more:?}"
    );
    clock.advance(until.saturating_duration_since(clock.now()));
    w.kick_due().unwrap();
    let Some(WorkerEffect::Step { batch, .. }) = w
        .take_effects()
        .into_iter()
        .find(|e| matches!(e, WorkerEffect::Step { .. }))
    else {
        panic!("the window's end starts the step");
    };
    assert_eq!(
        batch.seqs.len(),
        2,
        "both migrated requests in the first step"
    );
    // A new request (nothing delivered yet) never waits.
    let mut w = core(&clock, Role::Aggregated);
    w.core = SchedulerCore::new(cfg, BlockPool::new(64, 4, 7).unwrap()).unwrap();
    w.take_effects();
    w.submit(job(3, 2)).unwrap();
    assert!(
        answer(&w.take_effects()).is_some(),
        "a new request starts at once"
    );
}

#[test]
fn a_request_runs_to_its_last_token_and_frees_its_blocks() {
    let clock = ManualClock::new();
    let mut w = core(&clock, Role::Aggregated);
    let joined = w.take_effects();
    assert!(
        joined
            .iter()
            .any(|e| matches!(e, WorkerEffect::Join(ROUTABLE_GROUP)))
    );
    w.submit(job(1, 3)).unwrap();
    assert_eq!(
        state(&w, 1),
        Some("prefilling"),
        "admitted into the first step"
    );
    // Submitted while that step runs: it waits for the next.
    w.submit(job(2, 1)).unwrap();
    assert_eq!(state(&w, 2), Some("waiting"));
    let mut tokens = 0;
    let mut seen = vec![];
    while let Some(step) = answer(&w.take_effects()) {
        seen.push((state(&w, 1), state(&w, 2)));
        clock.advance(Duration::from_millis(5));
        w.step_done(step, || None).unwrap();
        tokens += delivered(&mut w)
            .iter()
            .filter(|e| matches!(e, TokenEventKind::Token { .. }))
            .count();
    }
    assert_eq!(tokens, 4);
    assert_eq!(
        seen,
        [
            (Some("prefilling"), Some("waiting")),
            (Some("decoding"), Some("prefilling")),
            (Some("decoding"), None),
        ],
        "the second request finished with its first token; a finished record leaves"
    );
    assert_eq!(state(&w, 1), None);
    assert_eq!(w.num_live(), 0);
    assert!(!w.has(&(NodeId::new("gw"), RequestId(1))));
    let stats = w.stats();
    assert_eq!(stats.steps, 3);
    assert_eq!(stats.running + stats.waiting, 0);
    assert!(w.is_idle());
}

#[test]
fn an_engine_that_never_answers_is_found_hung_on_the_injected_clock() {
    let clock = ManualClock::new();
    let mut w = core(&clock, Role::Aggregated);
    w.submit(job(1, 5)).unwrap();
    assert!(answer(&w.take_effects()).is_some(), "a step was started");
    clock.advance(Duration::from_secs(1));
    w.tick(|_| OwnerStatus::Present).unwrap();
    clock.advance(Duration::from_millis(1_100));
    let hung = w.tick(|_| OwnerStatus::Present);
    assert!(matches!(hung, Err(WorkerCoreError::Hung(_))), "{hung:?}");
    let left: Vec<_> = w
        .take_effects()
        .into_iter()
        .filter_map(|e| match e {
            WorkerEffect::Leave(g) => Some(g),
            _ => None,
        })
        .collect();
    assert_eq!(left, vec![ROUTABLE_GROUP, SCHEDULER_GROUP]);
    assert_eq!(w.stats().health, Health::Unhealthy);
}

#[test]
fn a_hand_off_is_held_until_its_hold_ends_on_the_injected_clock() {
    let clock = ManualClock::new();
    let mut w = core(&clock, Role::Prefill);
    let mut j = job(1, 8);
    j.hand_off = true;
    w.submit(j).unwrap();
    let step = answer(&w.take_effects()).unwrap();
    w.step_done(step, || None).unwrap();
    let events = delivered(&mut w);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, TokenEventKind::HandOff(_)))
    );
    assert_eq!(w.stats().held, 1);
    assert_eq!(state(&w, 1), Some("handed off"));
    assert_eq!(w.num_live(), 0, "a handed-off sequence no longer runs here");
    assert!(w.has(&(NodeId::new("gw"), RequestId(1))), "but it is held");
    let used = w.stats().kv_blocks_used;
    assert!(used > 0);
    clock.advance(DisaggWorker::default().hold - Duration::from_millis(1));
    w.tick(|_| OwnerStatus::Present).unwrap();
    assert_eq!(w.stats().held, 1, "still held before the hold ends");
    clock.advance(Duration::from_millis(1));
    w.tick(|_| OwnerStatus::Present).unwrap();
    assert_eq!(w.stats().held, 0);
    assert_eq!(state(&w, 1), None);
    assert!(
        w.take_effects()
            .iter()
            .any(|e| matches!(e, WorkerEffect::Release(_)))
    );
}

#[test]
fn a_missing_owner_loses_its_sequences_after_the_grace() {
    let clock = ManualClock::new();
    let mut w = core(&clock, Role::Aggregated);
    w.submit(job(1, 50)).unwrap();
    let mut pending = answer(&w.take_effects());
    w.tick(|_| OwnerStatus::Missing).unwrap(); // first seen missing now
    for _ in 0..3 {
        assert_eq!(w.num_live(), 1, "kept within the grace");
        clock.advance(Duration::from_secs(1));
        if let Some(step) = pending.take() {
            w.step_done(step, || None).unwrap();
        }
        w.tick(|_| OwnerStatus::Missing).unwrap();
        pending = answer(&w.take_effects());
    }
    assert_eq!(w.num_live(), 0, "aborted after owner_grace");
}
