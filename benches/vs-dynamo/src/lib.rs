//! Flotilla's [`PrefixIndex`] against NVIDIA Dynamo's [`RadixTree`] (`dynamo-kv-router` 1.6.1),
//! fed the same event stream and asked the same questions.
//!
//! The world is the one of Flotilla's `benches/router.rs` (per worker count W ∈ {16, 64, 256, 1024}):
//! - 8 system prompts of 64 blocks, each stored by every worker;
//! - per worker, `(1 000 000 / W − 512) / 448` conversations: one system prompt followed by a
//!   448-block tail unique to the worker, stored as 7 `Stored` events of 64 blocks;
//! - so ≈ 1M (worker, block) holdings for every W.
//!
//! Every block has a random *local* hash (its tokens) and a *sequence* hash chained over its
//! parent (`flotilla::kv::hash::sequence_hash`). Flotilla's event carries both
//! (`StoredBlock { seq_hash, block_hash }`); the same event for Dynamo is a [`RouterEvent`]
//! whose blocks have `block_hash` = the sequence hash (Dynamo's "external" hash) and
//! `tokens_hash` = the local hash, and whose `parent_hash` is the parent's sequence hash.
//! Flotilla worker `i` is Dynamo worker `i` (dp rank 0); event ids are the same.
//!
//! A query is a 512-block prompt: Flotilla walks its sequence hashes
//! ([`PrefixIndex::overlaps`]), Dynamo its local hashes ([`RadixTree::find_matches`], no early
//! exit). Both answer "how many leading blocks of the prompt does each worker hold", which
//! [`check_agreement`] asserts before anything is timed.

use std::hint::black_box;
use std::time::Instant;

use dynamo_kv_router::RadixTree;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use flotilla::kv::events::{KvEvent, KvEventData, StoredBlock, Tier};
use flotilla::kv::hash::sequence_hash;
use flotilla::request_plane::router::index::{ApplyOutcome, PrefixIndex};
use flotilla::runtime::ids::{BlockHash, EventId, SequenceHash, WorkerId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const PROMPT_BLOCKS: usize = 512;
pub const TARGET_HOLDINGS: usize = 1_000_000;
pub const SYSTEM_PROMPTS: usize = 8;
pub const SYSTEM_BLOCKS: usize = 64;
pub const TAIL_BLOCKS: usize = PROMPT_BLOCKS - SYSTEM_BLOCKS;
pub const EVENT_CHUNK: usize = 64;
const SALT: u64 = 0xF107;

/// The worker counts measured; `VS_DYNAMO_WORKERS=256` keeps one.
pub fn worker_counts() -> Vec<usize> {
    let only: Option<usize> = std::env::var("VS_DYNAMO_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok());
    [16, 64, 256, 1024]
        .into_iter()
        .filter(|w| only.is_none_or(|o| o == *w))
        .collect()
}

/// One block: its sequence hash (chained) and its local hash (its tokens alone).
#[derive(Clone, Copy, Debug)]
pub struct Block {
    pub seq: SequenceHash,
    pub local: BlockHash,
}

/// `n` new blocks chained after `parent`.
pub fn chain(rng: &mut StdRng, parent: Option<SequenceHash>, n: usize) -> Vec<Block> {
    let mut out = Vec::with_capacity(n);
    let mut p = parent;
    for _ in 0..n {
        let local = BlockHash(rng.random());
        let seq = sequence_hash(p, local, SALT);
        out.push(Block { seq, local });
        p = Some(seq);
    }
    out
}

fn stored(parent: Option<SequenceHash>, blocks: &[Block]) -> KvEventData {
    KvEventData::Stored {
        parent,
        blocks: blocks
            .iter()
            .map(|b| StoredBlock {
                seq_hash: b.seq,
                block_hash: b.local,
            })
            .collect(),
    }
}

/// Flotilla worker `i`'s name.
pub fn worker_name(i: usize) -> WorkerId {
    WorkerId::new(format!("node-{}/r{}", i / 8, i % 8))
}

/// The same event for Dynamo, from worker `worker` (dp rank 0).
pub fn to_dynamo(worker: u64, ev: &KvEvent) -> RouterEvent {
    let data = match &ev.data {
        KvEventData::Stored { parent, blocks } => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(|p| ExternalSequenceBlockHash(p.0)),
            start_position: None,
            blocks: blocks
                .iter()
                .map(|b| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(b.seq_hash.0),
                    tokens_hash: LocalBlockHash(b.block_hash.0),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        KvEventData::Removed { blocks } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: blocks
                .iter()
                .map(|h| ExternalSequenceBlockHash(h.0))
                .collect(),
        }),
        KvEventData::Cleared => KvCacheEventData::Cleared,
    };
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id: ev.event_id.0,
            data,
            dp_rank: 0,
        },
    )
}

/// A prompt as each index is asked about it.
#[derive(Clone, Debug)]
pub struct Query {
    /// Flotilla's key: sequence hashes.
    pub seq: Vec<SequenceHash>,
    /// Dynamo's key: local hashes.
    pub local: Vec<LocalBlockHash>,
}

impl Query {
    pub fn of(blocks: &[Block]) -> Query {
        Query {
            seq: blocks.iter().map(|b| b.seq).collect(),
            local: blocks.iter().map(|b| LocalBlockHash(b.local.0)).collect(),
        }
    }
}

/// The three kinds of request of `benches/router.rs`.
pub const KINDS: [&str; 3] = ["hit", "shared", "miss"];

/// The world of one worker count, as an event stream.
pub struct World {
    pub workers: usize,
    pub names: Vec<WorkerId>,
    pub systems: Vec<Vec<Block>>,
    pub conversations: Vec<Vec<Block>>,
    /// Every event of the world, in order, with its worker's number.
    pub events: Vec<(usize, KvEvent)>,
    /// Per worker, the id of its next event.
    pub next_event: Vec<u64>,
}

impl World {
    pub fn generate(workers: usize, seed: u64) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let systems: Vec<_> = (0..SYSTEM_PROMPTS)
            .map(|_| chain(&mut rng, None, SYSTEM_BLOCKS))
            .collect();
        let mut world = World {
            workers,
            names: (0..workers).map(worker_name).collect(),
            systems,
            conversations: Vec::new(),
            events: Vec::new(),
            next_event: vec![1; workers],
        };
        let per_worker = (TARGET_HOLDINGS / workers - SYSTEM_PROMPTS * SYSTEM_BLOCKS) / TAIL_BLOCKS;
        for w in 0..workers {
            for s in 0..SYSTEM_PROMPTS {
                let system = world.systems[s].clone();
                world.push(w, None, &system);
            }
            for _ in 0..per_worker {
                let system = world.systems[rng.random_range(0..SYSTEM_PROMPTS)].clone();
                let root = system.last().map(|b| b.seq);
                let tail = chain(&mut rng, root, TAIL_BLOCKS);
                let mut parent = root;
                for part in tail.chunks(EVENT_CHUNK) {
                    world.push(w, parent, part);
                    parent = part.last().map(|b| b.seq);
                }
                let mut full = system;
                full.extend(tail);
                world.conversations.push(full);
            }
        }
        world
    }

    fn push(&mut self, w: usize, parent: Option<SequenceHash>, blocks: &[Block]) {
        let id = self.next_event[w];
        self.next_event[w] += 1;
        let ev = KvEvent {
            worker: self.names[w].clone(),
            event_id: EventId(id),
            tier: Tier::Device,
            data: stored(parent, blocks),
        };
        self.events.push((w, ev));
    }

    /// (worker, block) pairs the stream stores.
    pub fn holdings(&self) -> usize {
        self.events
            .iter()
            .map(|(_, ev)| match &ev.data {
                KvEventData::Stored { blocks, .. } => blocks.len(),
                _ => 0,
            })
            .sum()
    }

    /// The stream, translated for Dynamo.
    pub fn dynamo_events(&self) -> Vec<RouterEvent> {
        self.events
            .iter()
            .map(|(w, ev)| to_dynamo(*w as u64, ev))
            .collect()
    }

    /// `n` prompts of one kind.
    pub fn queries(&self, kind: &str, n: usize, rng: &mut StdRng) -> Vec<Query> {
        (0..n)
            .map(|_| match kind {
                "hit" => {
                    Query::of(&self.conversations[rng.random_range(0..self.conversations.len())])
                }
                "shared" => {
                    let mut r = self.systems[rng.random_range(0..SYSTEM_PROMPTS)].clone();
                    let tail = chain(rng, r.last().map(|b| b.seq), TAIL_BLOCKS);
                    r.extend(tail);
                    Query::of(&r)
                }
                _ => Query::of(&chain(rng, None, PROMPT_BLOCKS)),
            })
            .collect()
    }

    /// A churn source on worker 0, extending system prompt 0 (as `benches/router.rs` does),
    /// whose first event has id `first_id` (Flotilla's index wants each worker's ids without
    /// gaps; Dynamo's tree does not look at them).
    pub fn churn(&self, seed: u64, first_id: u64) -> Churn {
        Churn {
            worker: self.names[0].clone(),
            next_id: first_id,
            root: self.systems[0].last().map(|b| b.seq),
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

/// Applies the whole stream to a new Flotilla index.
pub fn build_flotilla(events: &[(usize, KvEvent)]) -> PrefixIndex {
    let mut index = PrefixIndex::new();
    for (_, ev) in events {
        assert_eq!(index.apply(ev), ApplyOutcome::Applied);
    }
    index
}

/// Applies the whole (translated) stream to a new Dynamo tree.
pub fn build_dynamo(events: Vec<RouterEvent>) -> RadixTree {
    let mut tree = RadixTree::new();
    for ev in events {
        tree.apply_event(ev).expect("dynamo applies the event");
    }
    tree
}

/// Per worker overlap, Flotilla.
pub fn flotilla_overlaps(index: &PrefixIndex, names: &[WorkerId], q: &Query) -> Vec<u32> {
    let o = index.overlaps(&q.seq);
    names.iter().map(|n| o.get(n)).collect()
}

/// Per worker overlap, Dynamo.
pub fn dynamo_overlaps(tree: &RadixTree, workers: usize, q: &Query) -> Vec<u32> {
    let s = tree.find_matches(q.local.clone(), false);
    (0..workers)
        .map(|w| {
            let key = WorkerWithDpRank::new(w as u64, 0);
            s.scores.get(&key).copied().unwrap_or(0)
        })
        .collect()
}

/// Both indexes give every worker the same overlap for every query.
pub fn check_agreement(
    index: &PrefixIndex,
    tree: &RadixTree,
    names: &[WorkerId],
    queries: &[Query],
    what: &str,
) {
    for (i, q) in queries.iter().enumerate() {
        let f = flotilla_overlaps(index, names, q);
        let d = dynamo_overlaps(tree, names.len(), q);
        if f != d {
            let diff: Vec<_> = (0..f.len())
                .filter(|w| f[*w] != d[*w])
                .take(8)
                .map(|w| format!("worker {w}: flotilla {} dynamo {}", f[w], d[w]))
                .collect();
            panic!(
                "{what} query {i}: the indexes disagree: {}",
                diff.join("; ")
            );
        }
    }
}

/// Batches of churn events on worker 0.
pub struct Churn {
    worker: WorkerId,
    next_id: u64,
    root: Option<SequenceHash>,
    rng: StdRng,
}

impl Churn {
    /// The id of the next event.
    pub fn next_id(&self) -> u64 {
        self.next_id
    }

    fn event(&mut self, data: KvEventData) -> KvEvent {
        let id = self.next_id;
        self.next_id += 1;
        KvEvent {
            worker: self.worker.clone(),
            event_id: EventId(id),
            tier: Tier::Device,
            data,
        }
    }

    /// `events` Stored events of `chain_len` blocks each (one chain after the root), then the
    /// Removed events (one per Stored, children first) that undo them; and the chain.
    pub fn batch_with_chain(
        &mut self,
        events: usize,
        chain_len: usize,
    ) -> (Vec<KvEvent>, Vec<Block>) {
        let blocks = chain(&mut self.rng, self.root, events * chain_len);
        let mut out = Vec::with_capacity(2 * events);
        let mut parent = self.root;
        for part in blocks.chunks(chain_len) {
            out.push(self.event(stored(parent, part)));
            parent = part.last().map(|b| b.seq);
        }
        for part in blocks.chunks(chain_len).rev() {
            let removed = part.iter().map(|b| b.seq).collect();
            out.push(self.event(KvEventData::Removed { blocks: removed }));
        }
        (out, blocks)
    }

    pub fn batch(&mut self, events: usize, chain_len: usize) -> Vec<KvEvent> {
        self.batch_with_chain(events, chain_len).0
    }

    /// A batch for Dynamo (worker 0).
    pub fn dynamo_batch(&mut self, events: usize, chain_len: usize) -> Vec<RouterEvent> {
        self.batch(events, chain_len)
            .iter()
            .map(|ev| to_dynamo(0, ev))
            .collect()
    }
}

pub fn apply_flotilla(index: &mut PrefixIndex, batch: &[KvEvent]) -> usize {
    batch
        .iter()
        .filter(|ev| index.apply(ev) == ApplyOutcome::Applied)
        .count()
}

pub fn apply_dynamo(tree: &mut RadixTree, batch: Vec<RouterEvent>) -> usize {
    batch
        .into_iter()
        .filter_map(|ev| tree.apply_event(ev).ok())
        .count()
}

/// Checks churn keeps the indexes in agreement: mid-batch (the chain stored) and after it.
/// Worker 0's events start at `*next_id`, which is advanced.
pub fn check_churn_agreement(
    world: &World,
    index: &mut PrefixIndex,
    tree: &mut RadixTree,
    next_id: &mut u64,
) {
    for chain_len in [1, 16] {
        let (mut f, mut d) = (world.churn(99, *next_id), world.churn(99, *next_id));
        let (batch, blocks) = f.batch_with_chain(32, chain_len);
        let dbatch = d.dynamo_batch(32, chain_len);
        let half = batch.len() / 2;
        let mut prompt = world.systems[0].clone();
        prompt.extend(blocks.iter().take(PROMPT_BLOCKS - SYSTEM_BLOCKS));
        let q = [Query::of(&prompt)];
        assert_eq!(apply_flotilla(index, &batch[..half]), half);
        assert_eq!(apply_dynamo(tree, dbatch[..half].to_vec()), half);
        check_agreement(index, tree, &world.names, &q, "churn (stored)");
        assert_eq!(apply_flotilla(index, &batch[half..]), half);
        assert_eq!(apply_dynamo(tree, dbatch[half..].to_vec()), half);
        check_agreement(index, tree, &world.names, &q, "churn (removed)");
        *next_id = f.next_id();
    }
}

// ---------------------------------------------------------------------------------------------
// Plain timings (the table)

/// Latency of one kind of query: p50, p99 and mean over many timed calls, ns.
#[derive(Clone, Copy, Debug, Default)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Latency {
    pub fn of(mut ns: Vec<u64>) -> Latency {
        ns.sort_unstable();
        let mean = ns.iter().sum::<u64>() as f64 / ns.len() as f64;
        Latency {
            p50: ns[ns.len() / 2] as f64,
            p99: ns[ns.len() * 99 / 100] as f64,
            mean,
        }
    }
}

/// Timed calls per query kind and index.
pub const TIMED_CALLS: usize = 20_000;

/// Calls in a row on one index before switching to the other (the two are interleaved so
/// that a change in the machine's load hits both alike).
const ROUND: usize = 500;

/// Find-matches latency on both indexes, `calls` timed calls each, interleaved by rounds.
/// Dynamo's `find_matches` takes its query by value: the copy is made before the clock starts.
/// For both, the answer is dropped inside the clock.
pub fn time_find_matches(
    index: &PrefixIndex,
    tree: &RadixTree,
    queries: &[Query],
    calls: usize,
) -> Pair<Latency> {
    let (mut f, mut d) = (Vec::with_capacity(calls), Vec::with_capacity(calls));
    let mut i = 0;
    while f.len() < calls {
        for k in i..i + ROUND {
            let q = &queries[k % queries.len()].seq;
            let t = Instant::now();
            black_box(index.overlaps(black_box(q)));
            f.push(t.elapsed().as_nanos() as u64);
        }
        for k in i..i + ROUND {
            let q = queries[k % queries.len()].local.clone();
            let t = Instant::now();
            black_box(tree.find_matches(black_box(q), false));
            d.push(t.elapsed().as_nanos() as u64);
        }
        i += ROUND;
    }
    [Latency::of(f), Latency::of(d)]
}

/// Per index (Flotilla, Dynamo): a pair of figures.
pub type Pair<T> = [T; 2];

/// Everything measured on one world.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    pub workers: usize,
    pub holdings: usize,
    pub build_events: usize,
    /// Seconds to apply the whole world (median of runs).
    pub build_secs: Pair<f64>,
    /// Churn events/s: Stored of 1 block then Removed; of 16-block chains then Removed.
    pub churn_1: Pair<f64>,
    pub churn_16: Pair<f64>,
    /// (kind, latency) for hit, shared, miss.
    pub latency: Vec<(&'static str, Pair<Latency>)>,
    /// Heap bytes held by each index once built (only where a counting allocator is
    /// installed: the `vs-dynamo-table` binary).
    pub heap_bytes: Option<Pair<usize>>,
    /// Criterion's means (only where criterion ran: the bench).
    pub criterion: Option<CriterionMeans>,
}

/// Criterion's mean estimates for one world.
#[derive(Clone, Debug, Default)]
pub struct CriterionMeans {
    /// (kind, mean ns per find-matches call).
    pub find_matches: Vec<(&'static str, Pair<f64>)>,
    /// (blocks per Stored event, events/s).
    pub churn: Vec<(usize, Pair<f64>)>,
}

/// Heap bytes each index holds once built from the world, read with `live` (bytes allocated
/// and not yet freed, from a counting global allocator).
pub fn heap_of(world: &World, live: impl Fn() -> usize) -> Pair<usize> {
    let before = live();
    let index = build_flotilla(&world.events);
    let f = live() - before;
    drop(index);
    let before = live();
    // The events are consumed (and freed) by the build: only the tree is left.
    let tree = build_dynamo(world.dynamo_events());
    let d = live() - before;
    drop(tree);
    [f, d]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Builds both indexes `runs` times from the world's stream; the median times and the indexes
/// of the last run.
pub fn timed_builds(world: &World, runs: usize) -> (Pair<f64>, PrefixIndex, RadixTree) {
    let (mut f, mut d) = (Vec::new(), Vec::new());
    let mut last = None;
    for _ in 0..runs {
        let t = Instant::now();
        let index = build_flotilla(&world.events);
        f.push(t.elapsed().as_secs_f64());
        let events = world.dynamo_events();
        let t = Instant::now();
        let tree = build_dynamo(events);
        d.push(t.elapsed().as_secs_f64());
        // Drop the previous run's indexes outside the clock.
        last = Some((index, tree));
    }
    let (index, tree) = last.expect("runs > 0");
    ([median(f), median(d)], index, tree)
}

/// Churn events/s on each index: `batches` batches of `events` Stored events of `chain_len`
/// blocks, each followed by its Removed events; the same batches for both, alternating.
/// Worker 0's events start at `*next_id`.
pub fn timed_churn(
    world: &World,
    index: &mut PrefixIndex,
    tree: &mut RadixTree,
    next_id: &mut u64,
    (events, chain_len, batches): (usize, usize, usize),
) -> Pair<f64> {
    let (mut fs, mut ds) = (world.churn(12, *next_id), world.churn(12, *next_id));
    let (mut f, mut d, mut n) = (0.0, 0.0, 0);
    for _ in 0..batches {
        let fb = fs.batch(events, chain_len);
        let db = ds.dynamo_batch(events, chain_len);
        n += fb.len();
        let t = Instant::now();
        let applied = apply_flotilla(index, &fb);
        f += t.elapsed().as_secs_f64();
        assert_eq!(applied, fb.len());
        let t = Instant::now();
        let applied = apply_dynamo(tree, db);
        d += t.elapsed().as_secs_f64();
        assert_eq!(applied, fb.len());
    }
    *next_id = fs.next_id();
    [n as f64 / f, n as f64 / d]
}

/// Queries of each kind (1 000 each), the same for every index.
pub fn query_sets(world: &World) -> Vec<(&'static str, Vec<Query>)> {
    let mut rng = StdRng::seed_from_u64(9);
    KINDS
        .iter()
        .map(|k| (*k, world.queries(k, 1000, &mut rng)))
        .collect()
}

/// One world, measured: its figures, and both indexes as the measurement left them.
pub struct Measured {
    pub figures: Figures,
    pub world: World,
    pub index: PrefixIndex,
    pub tree: RadixTree,
    /// Worker 0's next event id.
    pub next_id: u64,
}

/// Builds one world (both indexes, timed), checks that the indexes agree, and measures churn
/// and find-matches latency with plain timers (no criterion).
pub fn measure(workers: usize) -> Measured {
    measure_world(World::generate(workers, 7))
}

/// [`measure`] on a given world.
pub fn measure_world(world: World) -> Measured {
    let workers = world.workers;
    let (build_secs, mut index, mut tree) = timed_builds(&world, 3);
    let sets = query_sets(&world);
    for (kind, qs) in &sets {
        check_agreement(&index, &tree, &world.names, &qs[..16], kind);
    }
    let mut next_id = world.next_event[0];
    check_churn_agreement(&world, &mut index, &mut tree, &mut next_id);
    let mut figures = Figures {
        workers,
        holdings: world.holdings(),
        build_events: world.events.len(),
        build_secs,
        ..Figures::default()
    };
    figures.churn_1 = timed_churn(&world, &mut index, &mut tree, &mut next_id, (10_000, 1, 10));
    figures.churn_16 = timed_churn(&world, &mut index, &mut tree, &mut next_id, (1_000, 16, 10));
    for (kind, qs) in &sets {
        let pair = time_find_matches(&index, &tree, qs, TIMED_CALLS);
        figures.latency.push((kind, pair));
    }
    // The churn must not have changed any answer.
    for (kind, qs) in &sets {
        check_agreement(&index, &tree, &world.names, &qs[..16], kind);
    }
    eprintln!("{}", figures.summary());
    Measured {
        figures,
        world,
        index,
        tree,
        next_id,
    }
}

impl Figures {
    /// One line per figure, for stderr.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "W={}: {} holdings in {} Stored events; build {:.0} ms (Flotilla) vs {:.0} ms (Dynamo); \
             churn 1-block {:.2} vs {:.2} M events/s; churn 16-block {:.2} vs {:.2} M events/s",
            self.workers,
            self.holdings,
            self.build_events,
            self.build_secs[0] * 1e3,
            self.build_secs[1] * 1e3,
            self.churn_1[0] / 1e6,
            self.churn_1[1] / 1e6,
            self.churn_16[0] / 1e6,
            self.churn_16[1] / 1e6,
        );
        for (kind, [f, d]) in &self.latency {
            s += &format!(
                "\n  find matches {kind}: Flotilla p50 {} p99 {} mean {}; Dynamo p50 {} p99 {} mean {}",
                us(f.p50),
                us(f.p99),
                us(f.mean),
                us(d.p50),
                us(d.p99),
                us(d.mean)
            );
        }
        s
    }
}

fn us(ns: f64) -> String {
    format!("{:.2} µs", ns / 1e3)
}

fn ratio(f: f64, d: f64) -> String {
    format!("{:.2}×", f / d)
}

/// Markdown tables of the figures, with Flotilla/Dynamo ratios.
pub fn table(figs: &[Figures]) -> String {
    let mut s = String::new();
    s += "Events applied (M events/s; the build is Stored events of 64 blocks; \
          F/D > 1: Flotilla faster)\n\n";
    s += "| W | holdings | build F | build D | F/D | churn 1-block F | D | F/D | churn 16-block F | D | F/D |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|---|\n";
    for f in figs {
        let b = [
            f.build_events as f64 / f.build_secs[0],
            f.build_events as f64 / f.build_secs[1],
        ];
        s += &format!(
            "| {} | {} | {:.3} | {:.3} | {} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {} |\n",
            f.workers,
            f.holdings,
            b[0] / 1e6,
            b[1] / 1e6,
            ratio(b[0], b[1]),
            f.churn_1[0] / 1e6,
            f.churn_1[1] / 1e6,
            ratio(f.churn_1[0], f.churn_1[1]),
            f.churn_16[0] / 1e6,
            f.churn_16[1] / 1e6,
            ratio(f.churn_16[0], f.churn_16[1]),
        );
    }
    if figs.iter().any(|f| f.heap_bytes.is_some()) {
        s += "\nHeap held once built (MiB)\n\n| W | Flotilla | Dynamo | F/D |\n|---|---|---|---|\n";
        for f in figs {
            if let Some([a, b]) = f.heap_bytes {
                let mib = |x: usize| x as f64 / (1024.0 * 1024.0);
                s += &format!(
                    "| {} | {:.0} | {:.0} | {} |\n",
                    f.workers,
                    mib(a),
                    mib(b),
                    ratio(a as f64, b as f64)
                );
            }
        }
    }
    if figs.iter().any(|f| f.criterion.is_some()) {
        s += "\nCriterion means (find matches in µs, F/D < 1: Flotilla faster; churn in M events/s, \
              F/D > 1: Flotilla faster)\n\n| W | measure | Flotilla | Dynamo | F/D |\n|---|---|---|---|---|\n";
        for f in figs {
            let Some(c) = &f.criterion else { continue };
            for (kind, [a, b]) in &c.find_matches {
                s += &format!(
                    "| {} | {kind} | {:.2} | {:.2} | {} |\n",
                    f.workers,
                    a / 1e3,
                    b / 1e3,
                    ratio(*a, *b)
                );
            }
            for (blocks, [a, b]) in &c.churn {
                s += &format!(
                    "| {} | churn {blocks}-block | {:.2} | {:.2} | {} |\n",
                    f.workers,
                    a / 1e6,
                    b / 1e6,
                    ratio(*a, *b)
                );
            }
        }
    }
    s += "\nFind matches, 512-block prompts (µs; F/D < 1: Flotilla faster)\n\n";
    s += "| W | query | F p50 | D p50 | F/D p50 | F p99 | D p99 | F/D p99 | F/D mean |\n";
    s += "|---|---|---|---|---|---|---|---|---|\n";
    for f in figs {
        for (kind, [a, b]) in &f.latency {
            s += &format!(
                "| {} | {kind} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {} | {} |\n",
                f.workers,
                a.p50 / 1e3,
                b.p50 / 1e3,
                ratio(a.p50, b.p50),
                a.p99 / 1e3,
                b.p99 / 1e3,
                ratio(a.p99, b.p99),
                ratio(a.mean, b.mean),
            );
        }
    }
    s
}
