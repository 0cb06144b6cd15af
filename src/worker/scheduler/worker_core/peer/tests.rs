use super::*;
use crate::runtime::ids::{NodeId, RequestId};
use crate::worker::scheduler::worker_core::tests::job;

const BS: usize = 4;

fn toks(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

fn pool() -> BlockPool {
    BlockPool::new(16, BS, 7).expect("pool")
}

/// A pool whose prefix cache holds `prompt` (computed, then freed).
fn cached(prompt: &[u32]) -> BlockPool {
    let mut p = pool();
    let a = p.allocate_sequence(SeqId(900), prompt).expect("allocate");
    p.mark_computed(SeqId(900), prompt.len()).expect("mark");
    p.free(a.lease).expect("free");
    p
}

/// Peer pulls of `me` on: 5 ms fixed, a 2 ms/block prior, a 1 s ask; holds of 30 s.
fn peers(me: &str) -> PeerPulls {
    PeerPulls::new(
        WorkerId::new(me),
        PeerSetting {
            pull: Some(PeerPullWorker {
                prior_block_ms: 2.0,
                ask_timeout: Duration::from_secs(1),
                fixed_ms: 5.0,
            }),
            can_pull: true,
            block_size: BS,
            hold: Duration::from_secs(30),
        },
    )
}

fn hint(holder: &str, blocks: u32) -> FetchHint {
    FetchHint {
        holder: WorkerId::new(holder),
        blocks,
    }
}

/// Prefill costs 1 ms per token (and nothing per attention pair).
const COST: StepCost = StepCost {
    base_ms: 10.0,
    per_token_ms: 1.0,
    per_kpair_ms: 0.0,
};

#[test]
fn a_hint_is_acted_on_only_for_whole_blocks_to_gain_and_a_pull_cheaper_than_the_prefill() {
    let prompt = toks(21, 1); // five whole blocks before the last token
    let empty = pool();
    let mut p = peers("a/r0");
    // Asked for up to the holder's blocks, never the last token, whole blocks only.
    let (asked, timeout) = p
        .plan(&hint("b/r0", 9), &prompt, &empty, None, None)
        .expect("asked");
    assert_eq!(asked, prompt[..20]);
    assert_eq!(timeout, Duration::from_secs(1));
    let (asked, _) = p
        .plan(&hint("b/r0", 2), &prompt, &empty, None, None)
        .expect("asked");
    assert_eq!(asked, prompt[..8]);
    // Not worth it: the holder is this worker; this pool already holds what the holder has.
    assert_eq!(p.plan(&hint("a/r0", 5), &prompt, &empty, None, None), None);
    let local = cached(&prompt[..8]);
    assert_eq!(p.plan(&hint("b/r0", 2), &prompt, &local, None, None), None);
    assert!(
        p.plan(&hint("b/r0", 3), &prompt, &local, None, None)
            .is_some()
    );
    assert_eq!(p.counters.declined, 0, "none of those is the cost rule's");
    // The cost rule: 3 blocks to gain (12 tokens: 12 ms of prefill) against 5 + 3 × 2 = 11 ms
    // of pull with the prior; with a measured 3 ms per block (14 ms) the prefill wins.
    assert!(
        p.plan(&hint("b/r0", 5), &prompt, &local, Some(COST), None)
            .is_some()
    );
    assert_eq!(
        p.plan(&hint("b/r0", 5), &prompt, &local, Some(COST), Some(3.0)),
        None
    );
    assert_eq!(p.counters.declined, 1);
    // Off here, or no way to pull: never.
    let mut off = peers("a/r0");
    off.set.pull = None;
    assert_eq!(
        off.plan(&hint("b/r0", 5), &prompt, &empty, None, None),
        None
    );
    let mut stuck = peers("a/r0");
    stuck.set.can_pull = false;
    assert_eq!(
        stuck.plan(&hint("b/r0", 5), &prompt, &empty, None, None),
        None
    );
}

#[test]
fn an_asked_submission_waits_until_its_answer_or_its_owner_goes() {
    let mut p = peers("a/r0");
    let req = |id: u64, node: &str| SubmitRequest {
        reply_to: NodeId::new(node),
        ..job(id, 4)
    };
    let key = |id: u64, node: &str| (NodeId::new(node), RequestId(id));
    p.ask(key(1, "gw1"), req(1, "gw1"), WorkerId::new("b/r0"));
    p.ask(key(2, "gw2"), req(2, "gw2"), WorkerId::new("b/r0"));
    p.ask(key(3, "gw2"), req(3, "gw2"), WorkerId::new("c/r0"));
    assert_eq!(p.counters.asked, 3);
    assert!(p.is_fetching(&key(1, "gw1")) && !p.is_idle());
    let f = p.answered(&key(1, "gw1")).expect("waiting");
    assert_eq!(
        (f.req.request, f.holder),
        (RequestId(1), WorkerId::new("b/r0"))
    );
    assert!(p.answered(&key(1, "gw1")).is_none(), "answered once");
    p.retain_fetching(|f| f.req.reply_to != NodeId::new("gw2") || f.req.request != RequestId(2));
    let left: Vec<RequestId> = p.take_fetching().iter().map(|f| f.req.request).collect();
    assert_eq!(left, [RequestId(3)]);
    assert!(p.is_idle());
}

#[test]
fn a_holder_pins_its_cached_prefix_once_per_key_until_unpinned_or_its_hold_ends() {
    let prompt = toks(13, 1);
    let mut pool = cached(&prompt);
    let mut h = peers("b/r0");
    let (t0, wall) = (Instant::now(), 1_000_000);
    let k1 = (NodeId::new("gw"), RequestId(1));
    let kv = h
        .export(
            &mut pool,
            SeqId(1),
            k1.clone(),
            &prompt[..12],
            None,
            t0,
            wall,
        )
        .expect("pinned");
    assert_eq!(
        (kv.worker.clone(), kv.request),
        (WorkerId::new("b/r0"), RequestId(1))
    );
    assert_eq!((kv.blocks.len(), kv.tokens), (3, 12));
    assert_eq!(kv.held_until_ms, wall + 30_000);
    assert_eq!(h.counters.exported, 1);
    // The same key again, or a prefix not cached here: refused with a reason.
    assert!(
        h.export(
            &mut pool,
            SeqId(2),
            k1.clone(),
            &prompt[..12],
            None,
            t0,
            wall
        )
        .is_err()
    );
    let k2 = (NodeId::new("gw"), RequestId(2));
    let none = h.export(
        &mut pool,
        SeqId(3),
        k2.clone(),
        &toks(8, 500),
        None,
        t0,
        wall,
    );
    assert!(none.is_err_and(|why| why.contains("none of the prefix")));
    // Pinned blocks are not free; unpinning (the peer's confirmation) frees them once.
    assert_eq!(pool.usage().used_blocks, 3);
    assert!(h.unpin(&mut pool, &k1));
    assert!(!h.unpin(&mut pool, &k1));
    assert_eq!(pool.usage().used_blocks, 0);
    // An unconfirmed pin ends with its hold, not before.
    h.export(
        &mut pool,
        SeqId(4),
        k2.clone(),
        &prompt[..8],
        None,
        t0,
        wall,
    )
    .expect("pinned");
    assert_eq!(
        h.unpin_expired(&mut pool, Some(t0 + Duration::from_secs(29))),
        0
    );
    assert_eq!(
        h.unpin_expired(&mut pool, Some(t0 + Duration::from_secs(30))),
        1
    );
    assert!(h.is_idle());
    pool.check_invariants().expect("invariants");
}
