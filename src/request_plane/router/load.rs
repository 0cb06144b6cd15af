//! [`ActiveLoad`]: the load the router itself has put on each worker.
//!
//! Per worker, two quantities (the inputs of the KV cost, NVIDIA Dynamo's "active prefill" and
//! "active decode blocks", <https://docs.nvidia.com/dynamo/dev/components/router/routing-concepts>):
//!
//! ```text
//! prefill_tokens(w) = Σ uncached_prompt_tokens(r)  over requests r routed to w, first token not seen   (tokens)
//! decode_blocks(w)  = Σ total_blocks(r)            over requests r routed to w, not finished          (KV blocks)
//! unique_blocks(w)  = |∪ hashed blocks(r)| + Σ (total_blocks(r) − hashed blocks(r))                  (KV blocks)
//! in_flight(w)      = #requests routed to w, not finished
//! ```
//!
//! `decode_blocks` counts every request's blocks, shared or not: a decode step reads each
//! sequence's whole KV, so it is the work a worker's decode steps do (the simulated engine's
//! step time grows with it, `worker/engine/sim.rs`). `unique_blocks` counts the blocks the
//! requests hold in the pool, a block shared by several requests (a common prefix, by sequence
//! hash: [`ActiveLoad::on_routed_prefix`]) once, and the unhashed partial last block of each —
//! NVIDIA Dynamo's "active blocks" (its `ActiveSequences` keeps one entry per unique block
//! hash); [`ActiveLoad::active_overlap_at`] is the number of a new prompt's leading blocks that
//! requests in flight on a worker already hold (Dynamo's "new blocks" are the rest).
//!
//! A request enters at [`ActiveLoad::on_routed`] (its uncached prompt tokens wait for prefill,
//! its blocks count as decode load at once, as Dynamo's "potential active blocks" do), its
//! prefill tokens leave at [`ActiveLoad::on_first_token`] (prefill is done once the first token
//! is out), and everything leaves at [`ActiveLoad::on_finished`]. Decode blocks stay at the
//! routed value: they do not grow with generated tokens. Requests never heard of
//! again (a gateway that died) are dropped by [`ActiveLoad::expire`], `ttl_ms` after the last
//! call that named them. Unknown keys are ignored everywhere, so every call is idempotent.
//!
//! Requests are keyed by [`RequestKey`]: the submitting gateway node and the request id on
//! that node (ids are unique per node only). Workers are interned to slots ([`ActiveLoad::slot`],
//! [`ActiveLoad::load_at`]) like in the prefix index, so the selector can read loads without
//! hashing worker ids per decision. Costs: `O(1)` per call except `expire` and
//! `remove_worker`, `O(requests in flight)`.
//!
//! # Several routers (`router.share_load`)
//!
//! Each router tells the others every change it makes to its own model as a `LoadChange`
//! (`sync.rs`)
//! (a placement with what it counts, a first token, an end), and applies theirs to its own
//! model as if it had made them: every router then counts the load of every placement in the
//! fleet, one network hop late, and N routers fed the same KV events and the same changes in
//! the same order hold the same model (NVIDIA Dynamo's router replicas sync their active
//! sequences the same way, one event per change). A change costs one cast per other router;
//! a `Routed` carries the prompt's block hashes, 8 bytes per block.

use crate::runtime::ids::{NodeId, RequestId, SequenceHash, WorkerId};

use super::index::{FastMap, fresh_epoch};

/// A request placed by a router: the gateway node that submitted it and its id on that node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RequestKey {
    /// The submitting (gateway) node.
    pub node: NodeId,
    /// The request's id on that node.
    pub request: RequestId,
}

impl RequestKey {
    /// `request` of `node`.
    pub fn new(node: NodeId, request: RequestId) -> Self {
        Self { node, request }
    }
}

/// Load of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerLoad {
    /// Prompt tokens routed here and waiting for prefill (tokens).
    pub prefill_tokens: u64,
    /// KV blocks of the requests routed here and not finished, each request's own (blocks).
    pub decode_blocks: u64,
    /// The same blocks counted once each when requests share them (blocks).
    pub unique_blocks: u64,
    /// Requests routed here and not finished.
    pub in_flight: u32,
}

/// One placement the model remembers.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Placement {
    slot: u32,
    /// Prompt tokens still waiting for prefill (0 after the first token).
    prefill_tokens: u64,
    decode_blocks: u64,
    /// Sequence hashes of its full prompt blocks (counted once per worker in `unique_blocks`).
    hashes: Box<[SequenceHash]>,
    last_seen_ms: u64,
}

/// A worker's slot in a [`ActiveLoad`] (see [`ActiveLoad::slot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LoadSlot(u32);

/// Per-worker prefill and decode load (see the module docs).
///
/// Workers are interned to slots on their first placement and keep them until
/// [`ActiveLoad::remove_worker`], so [`ActiveLoad::workers_epoch`] changes only when a worker
/// appears or is removed.
#[derive(Debug, Clone, Default)]
pub struct ActiveLoad {
    placements: FastMap<RequestKey, Placement>,
    by_id: FastMap<WorkerId, u32>,
    /// By slot: the worker (None: free slot) and its load.
    workers: Vec<Option<(WorkerId, WorkerLoad)>>,
    /// By slot: how many of the worker's requests in flight hold each hashed block.
    held: Vec<FastMap<SequenceHash, u32>>,
    free: Vec<u32>,
    epoch: u64,
}

impl ActiveLoad {
    /// An empty model.
    pub fn new() -> Self {
        Self::default()
    }

    /// The request `key` was routed to `worker`, with `uncached_prompt_tokens` to prefill and
    /// `total_blocks` KV blocks (prompt blocks, rounded up), none of them shared with other
    /// requests: [`ActiveLoad::on_routed_prefix`] without hashes.
    pub fn on_routed(
        &mut self,
        key: RequestKey,
        worker: &WorkerId,
        uncached_prompt_tokens: u32,
        total_blocks: u32,
        now_ms: u64,
    ) {
        self.on_routed_prefix(
            key,
            worker,
            uncached_prompt_tokens,
            &[],
            total_blocks,
            now_ms,
        );
    }

    /// The request `key` was routed to `worker`, with `uncached_prompt_tokens` to prefill and
    /// `total_blocks` KV blocks, the first `hashes.len()` of them full blocks with these
    /// sequence hashes (shared with other requests on `worker` that hold the same hashes).
    /// Routing a key again moves it.
    pub fn on_routed_prefix(
        &mut self,
        key: RequestKey,
        worker: &WorkerId,
        uncached_prompt_tokens: u32,
        hashes: &[SequenceHash],
        total_blocks: u32,
        now_ms: u64,
    ) {
        self.on_finished(&key);
        let slot = self.slot_or_insert(worker);
        let hashes: Box<[SequenceHash]> = hashes[..hashes.len().min(total_blocks as usize)].into();
        let held = &mut self.held[slot as usize];
        let mut fresh = 0u64;
        for h in hashes.iter() {
            let n = held.entry(*h).or_insert(0);
            fresh += u64::from(*n == 0);
            *n += 1;
        }
        let placement = Placement {
            slot,
            prefill_tokens: u64::from(uncached_prompt_tokens),
            decode_blocks: u64::from(total_blocks),
            hashes,
            last_seen_ms: now_ms,
        };
        let unhashed = placement.decode_blocks - placement.hashes.len() as u64;
        let load = self.load_mut(slot);
        load.prefill_tokens += placement.prefill_tokens;
        load.decode_blocks += placement.decode_blocks;
        load.unique_blocks += fresh + unhashed;
        load.in_flight += 1;
        self.placements.insert(key, placement);
    }

    /// How many leading blocks of `hashes` requests in flight on the worker in `slot` hold.
    pub fn active_overlap_at(&self, slot: LoadSlot, hashes: &[SequenceHash]) -> u32 {
        let Some(held) = self.held.get(slot.0 as usize) else {
            return 0;
        };
        if held.is_empty() {
            return 0;
        }
        hashes.iter().take_while(|h| held.contains_key(h)).count() as u32
    }

    /// The request's first token came out: its prefill tokens are done (its decode blocks
    /// stay). Returns whether the key was known.
    pub fn on_first_token(&mut self, key: &RequestKey, now_ms: u64) -> bool {
        let Some(p) = self.placements.get_mut(key) else {
            return false;
        };
        p.last_seen_ms = now_ms;
        let done = std::mem::take(&mut p.prefill_tokens);
        let slot = p.slot;
        self.load_mut(slot).prefill_tokens -= done;
        true
    }

    /// The request ended (finished, failed or cancelled). Returns whether the key was known.
    pub fn on_finished(&mut self, key: &RequestKey) -> bool {
        let Some(p) = self.placements.remove(key) else {
            return false;
        };
        self.release(&p);
        true
    }

    /// Drops the requests not named for more than `ttl_ms` (ms); returns how many.
    pub fn expire(&mut self, now_ms: u64, ttl_ms: u64) -> usize {
        let stale = |p: &Placement| now_ms.saturating_sub(p.last_seen_ms) > ttl_ms;
        self.drop_where(stale)
    }

    /// Forgets every request on `worker` (it died) and the worker itself; returns how many
    /// requests.
    pub fn remove_worker(&mut self, worker: &WorkerId) -> usize {
        let Some(slot) = self.by_id.remove(worker) else {
            return 0;
        };
        let n = self.drop_where(|p| p.slot == slot);
        self.workers[slot as usize] = None;
        self.held[slot as usize] = FastMap::default();
        self.free.push(slot);
        self.epoch = fresh_epoch();
        n
    }

    /// Prompt tokens waiting for prefill on `worker`.
    pub fn prefill_tokens(&self, worker: &WorkerId) -> u64 {
        self.load(worker).prefill_tokens
    }

    /// Active decode blocks on `worker`.
    pub fn decode_blocks(&self, worker: &WorkerId) -> u64 {
        self.load(worker).decode_blocks
    }

    /// Requests in flight on `worker`.
    pub fn in_flight(&self, worker: &WorkerId) -> u32 {
        self.load(worker).in_flight
    }

    /// All three numbers of `worker` (zero if it has nothing in flight).
    pub fn load(&self, worker: &WorkerId) -> WorkerLoad {
        self.slot(worker)
            .map_or_else(WorkerLoad::default, |s| self.load_at(s))
    }

    /// `worker`'s slot, to read [`ActiveLoad::load_at`] without hashing its id again. A slot
    /// stays valid while [`ActiveLoad::workers_epoch`] is unchanged.
    pub fn slot(&self, worker: &WorkerId) -> Option<LoadSlot> {
        self.by_id.get(worker).map(|s| LoadSlot(*s))
    }

    /// The load of the worker in `slot` (`slot` from this model and epoch).
    #[inline]
    pub fn load_at(&self, slot: LoadSlot) -> WorkerLoad {
        let entry = self.workers.get(slot.0 as usize).and_then(Option::as_ref);
        entry.map_or_else(WorkerLoad::default, |(_, load)| *load)
    }

    /// Every worker with a slot and its load.
    pub fn loads(&self) -> impl Iterator<Item = (&WorkerId, WorkerLoad)> {
        self.workers.iter().flatten().map(|(w, l)| (w, *l))
    }

    /// Changes whenever a worker gets a slot or is removed.
    pub fn workers_epoch(&self) -> u64 {
        self.epoch
    }

    /// The worker `key` was routed to, if it is in flight.
    pub fn worker_of(&self, key: &RequestKey) -> Option<&WorkerId> {
        let p = self.placements.get(key)?;
        self.workers[p.slot as usize].as_ref().map(|(id, _)| id)
    }

    /// Requests in flight, all workers.
    pub fn len(&self) -> usize {
        self.placements.len()
    }

    /// Whether no request is in flight.
    pub fn is_empty(&self) -> bool {
        self.placements.is_empty()
    }

    fn slot_or_insert(&mut self, worker: &WorkerId) -> u32 {
        if let Some(slot) = self.by_id.get(worker) {
            return *slot;
        }
        let entry = Some((worker.clone(), WorkerLoad::default()));
        let slot = match self.free.pop() {
            Some(s) => {
                self.workers[s as usize] = entry;
                s
            }
            None => {
                self.workers.push(entry);
                self.held.push(FastMap::default());
                u32::try_from(self.workers.len() - 1).expect("fewer than 2^32 workers")
            }
        };
        self.by_id.insert(worker.clone(), slot);
        self.epoch = fresh_epoch();
        slot
    }

    fn load_mut(&mut self, slot: u32) -> &mut WorkerLoad {
        let entry = self.workers[slot as usize].as_mut();
        &mut entry.expect("placements only name occupied slots").1
    }

    fn drop_where(&mut self, pred: impl Fn(&Placement) -> bool) -> usize {
        let mut dropped = Vec::new();
        self.placements.retain(|_, p| {
            let drop = pred(p);
            if drop {
                dropped.push(p.clone());
            }
            !drop
        });
        for p in &dropped {
            self.release(p);
        }
        dropped.len()
    }

    /// Subtracts a placement that left the map from its worker's load.
    fn release(&mut self, p: &Placement) {
        let held = &mut self.held[p.slot as usize];
        let mut gone = 0u64;
        for h in p.hashes.iter() {
            if let Some(n) = held.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    held.remove(h);
                    gone += 1;
                }
            }
        }
        let unhashed = p.decode_blocks - p.hashes.len() as u64;
        let load = self.load_mut(p.slot);
        load.prefill_tokens -= p.prefill_tokens;
        load.decode_blocks -= p.decode_blocks;
        load.unique_blocks -= gone + unhashed;
        load.in_flight -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: &str) -> WorkerId {
        WorkerId::new(s)
    }

    fn k(n: u64) -> RequestKey {
        RequestKey::new(NodeId::new("gw"), RequestId(n))
    }

    #[test]
    fn the_published_queues_follow_the_load() {
        let view = PrefillQueueView::default();
        assert!(view.latest().is_none(), "nothing before a router publishes");
        let mut m = ActiveLoad::new();
        m.on_routed(k(1), &w("a"), 100, 10, 0);
        m.on_routed(k(2), &w("b"), 7, 1, 0);
        view.publish(&m);
        let q = view.latest().unwrap();
        assert_eq!((q.get("a"), q.get("b")), (Some(&100), Some(&7)));
        m.on_first_token(&k(1), 1);
        m.remove_worker(&w("b"));
        view.publish(&m);
        let q = view.latest().unwrap();
        assert_eq!((q.get("a"), q.get("b")), (Some(&0), None));
        view.clear();
        assert!(view.latest().is_none());
    }

    #[test]
    fn routed_first_token_finished() {
        let mut m = ActiveLoad::new();
        m.on_routed(k(1), &w("a"), 100, 10, 0);
        m.on_routed(k(2), &w("a"), 30, 4, 0);
        m.on_routed(k(3), &w("b"), 7, 1, 0);
        assert_eq!(
            m.load(&w("a")),
            WorkerLoad {
                prefill_tokens: 130,
                decode_blocks: 14,
                unique_blocks: 14,
                in_flight: 2
            }
        );
        assert!(m.on_first_token(&k(1), 5));
        assert_eq!(m.prefill_tokens(&w("a")), 30);
        assert_eq!(
            m.decode_blocks(&w("a")),
            14,
            "decode blocks stay after prefill"
        );
        assert!(
            m.on_first_token(&k(1), 6),
            "known key, nothing left to move"
        );
        assert_eq!(m.prefill_tokens(&w("a")), 30);
        assert!(m.on_finished(&k(1)));
        assert!(!m.on_finished(&k(1)), "finishing twice is a no-op");
        assert_eq!(
            m.load(&w("a")),
            WorkerLoad {
                prefill_tokens: 30,
                decode_blocks: 4,
                unique_blocks: 4,
                in_flight: 1
            }
        );
        assert!(m.on_finished(&k(2)));
        assert_eq!(m.load(&w("a")), WorkerLoad::default());
        assert_eq!(m.in_flight(&w("b")), 1);
        assert_eq!(m.len(), 1);
        assert!(!m.on_first_token(&k(9), 0), "unknown key");
    }

    #[test]
    fn finishing_before_first_token_releases_prefill() {
        let mut m = ActiveLoad::new();
        m.on_routed(k(1), &w("a"), 50, 5, 0);
        m.on_finished(&k(1));
        assert_eq!(m.load(&w("a")), WorkerLoad::default());
        assert!(m.is_empty());
    }

    #[test]
    fn rerouting_moves_the_request() {
        let mut m = ActiveLoad::new();
        m.on_routed(k(1), &w("a"), 50, 5, 0);
        m.on_routed(k(1), &w("b"), 20, 5, 1);
        assert_eq!(m.load(&w("a")), WorkerLoad::default());
        assert_eq!(m.prefill_tokens(&w("b")), 20);
        assert_eq!(m.worker_of(&k(1)), Some(&w("b")));
    }

    #[test]
    fn stale_requests_expire_from_their_last_news() {
        let mut m = ActiveLoad::new();
        m.on_routed(k(1), &w("a"), 10, 1, 0);
        m.on_routed(k(2), &w("a"), 20, 2, 0);
        m.on_routed(k(3), &w("b"), 40, 4, 500);
        m.on_first_token(&k(2), 900);
        assert_eq!(m.expire(1_000, 600), 1, "only k1: k2 was heard of at 900");
        assert_eq!(
            m.load(&w("a")),
            WorkerLoad {
                prefill_tokens: 0,
                decode_blocks: 2,
                unique_blocks: 2,
                in_flight: 1
            }
        );
        assert_eq!(m.expire(1_000, 600), 0, "idempotent");
        assert_eq!(m.expire(2_000, 600), 2);
        assert!(m.is_empty());
        assert_eq!(m.load(&w("b")), WorkerLoad::default());
    }

    #[test]
    fn slots_are_stable_until_a_worker_is_removed() {
        let mut m = ActiveLoad::new();
        assert_eq!(m.slot(&w("a")), None);
        m.on_routed(k(1), &w("a"), 10, 1, 0);
        let (a, epoch) = (m.slot(&w("a")).unwrap(), m.workers_epoch());
        m.on_finished(&k(1));
        m.on_routed(k(2), &w("a"), 5, 2, 0);
        assert_eq!((m.slot(&w("a")), m.workers_epoch()), (Some(a), epoch));
        assert_eq!(m.load_at(a).prefill_tokens, 5);
        m.on_routed(k(3), &w("b"), 1, 1, 0);
        assert_ne!(m.workers_epoch(), epoch, "b got a slot");
        let epoch = m.workers_epoch();
        m.remove_worker(&w("a"));
        assert_ne!(m.workers_epoch(), epoch);
        assert_eq!(
            m.load_at(a),
            WorkerLoad::default(),
            "a stale slot reads as idle"
        );
        m.on_routed(k(4), &w("c"), 7, 1, 0);
        assert_eq!(m.slot(&w("c")), Some(a), "the freed slot is reused");
        assert_eq!(m.worker_of(&k(4)), Some(&w("c")));
    }

    fn hs(range: std::ops::Range<u64>) -> Vec<SequenceHash> {
        range.map(SequenceHash).collect()
    }

    #[test]
    fn shared_blocks_count_once_in_unique_blocks() {
        let mut m = ActiveLoad::new();
        // Turn 1: 10 full blocks + a partial one; turn 2 extends it to 14 + a partial one.
        m.on_routed_prefix(k(1), &w("a"), 170, &hs(0..10), 11, 0);
        m.on_routed_prefix(k(2), &w("a"), 70, &hs(0..14), 15, 0);
        let l = m.load(&w("a"));
        assert_eq!((l.decode_blocks, l.unique_blocks), (26, 14 + 2));
        let a = m.slot(&w("a")).unwrap();
        assert_eq!(m.active_overlap_at(a, &hs(0..20)), 14);
        let mut other = hs(0..3);
        other.push(SequenceHash(99));
        assert_eq!(m.active_overlap_at(a, &other), 3, "leading blocks only");
        m.on_finished(&k(2));
        let l = m.load(&w("a"));
        assert_eq!((l.decode_blocks, l.unique_blocks), (11, 11));
        assert_eq!(m.active_overlap_at(a, &hs(0..20)), 10);
        m.on_finished(&k(1));
        assert_eq!(m.load(&w("a")), WorkerLoad::default());
        assert_eq!(m.active_overlap_at(a, &hs(0..20)), 0);
        // Moving a request moves its held blocks; removing a worker forgets them.
        m.on_routed_prefix(k(3), &w("a"), 0, &hs(0..4), 4, 0);
        m.on_routed_prefix(k(3), &w("b"), 0, &hs(0..4), 4, 0);
        assert_eq!(m.active_overlap_at(a, &hs(0..4)), 0);
        let b = m.slot(&w("b")).unwrap();
        assert_eq!(m.active_overlap_at(b, &hs(0..4)), 4);
        m.remove_worker(&w("b"));
        m.on_routed(k(4), &w("c"), 0, 1, 0);
        let c = m.slot(&w("c")).unwrap();
        assert_eq!(
            m.active_overlap_at(c, &hs(0..4)),
            0,
            "a reused slot starts empty"
        );
        // More hashes than blocks (a caller's mistake) never underflows.
        m.on_routed_prefix(k(5), &w("d"), 0, &hs(0..8), 2, 0);
        m.on_finished(&k(5));
        assert_eq!(m.load(&w("d")), WorkerLoad::default());
    }

    #[test]
    fn removing_a_worker_forgets_its_requests_only() {
        let mut m = ActiveLoad::new();
        m.on_routed(k(1), &w("a"), 10, 1, 0);
        m.on_routed(k(2), &w("b"), 20, 2, 0);
        m.on_routed(k(3), &w("a"), 30, 3, 0);
        assert_eq!(m.remove_worker(&w("a")), 2);
        assert_eq!(m.load(&w("a")), WorkerLoad::default());
        assert_eq!(m.prefill_tokens(&w("b")), 20);
        assert!(!m.on_finished(&k(1)), "gone with its worker");
        assert!(m.on_finished(&k(2)));
        assert_eq!(m.remove_worker(&w("zz")), 0);
    }
}

/// The prompt tokens waiting for prefill on each worker ([`WorkerLoad::prefill_tokens`]), as
/// this node's router last saw them: published after every message that changes them (only
/// where a gateway with `gateway.ttft_target_ms` runs on the node), read by that gateway's
/// admission without a call. Unlike a heartbeat it already
/// counts what was routed a moment ago (a burst). `None` when no router runs on this node.
#[derive(Clone, Debug)]
pub struct PrefillQueueView {
    tx: std::sync::Arc<tokio::sync::watch::Sender<Option<PrefillQueues>>>,
}

/// Worker → prompt tokens waiting for prefill there (tokens).
pub type PrefillQueues = std::sync::Arc<std::collections::HashMap<WorkerId, u64>>;

impl Default for PrefillQueueView {
    fn default() -> Self {
        Self {
            tx: std::sync::Arc::new(tokio::sync::watch::channel(None).0),
        }
    }
}

impl PrefillQueueView {
    /// Publish `load`'s queues.
    pub fn publish(&self, load: &ActiveLoad) {
        let queues = load
            .loads()
            .map(|(w, l)| (w.clone(), l.prefill_tokens))
            .collect();
        self.tx.send_replace(Some(std::sync::Arc::new(queues)));
    }

    /// Withdraw the view (the router stopped).
    pub fn clear(&self) {
        self.tx.send_replace(None);
    }

    /// The latest queues, if a router publishes here.
    pub fn latest(&self) -> Option<PrefillQueues> {
        self.tx.borrow().clone()
    }
}
