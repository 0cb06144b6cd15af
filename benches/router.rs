//! Router benchmarks: decision latency over a ~1M-block index, and KV events per second.
//!
//! The world (per worker count W ∈ {16, 64, 256}):
//! - 8 system prompts of 64 blocks (1 024 tokens), each stored by every worker;
//! - per worker, `(1 000 000 / W − 512) / 448` conversations: one system prompt followed by a
//!   448-block tail unique to the worker (512 blocks = 8 192 tokens in all), stored as
//!   7 `Stored` events of 64 blocks;
//! - so ≈ 1M (worker, block) holdings and ≈ 1M distinct nodes for every W;
//! - an active load with 0–7 requests in flight per worker.
//!
//! Requests are 8 192-token prompts (512 blocks of 16 tokens), three kinds:
//! - `hit`: a stored conversation — one worker matches all 512 blocks, all match 64;
//! - `shared`: a system prompt and a new tail — every worker matches 64 blocks;
//! - `miss`: a new prompt — nothing matches.
//!
//! `ROUTER_BENCH_WORKERS=256` limits the decision benchmarks to one world.
//!
//! Besides criterion's means, each decision kind prints p50/p99 over 20 000 timed calls.
//!
//! Events: on the W = 256 world, one worker applies `Stored` events of one block each
//! (extending a chain), or of 16-block chains, each batch followed by the `Removed` events
//! that undo it so the index stays at ~1M blocks.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use flotilla::kv::events::{KvEvent, KvEventData, StoredBlock, Tier};
use flotilla::kv::hash::sequence_hash;
use flotilla::request_plane::router::index::{ApplyOutcome, PrefixIndex};
use flotilla::request_plane::router::load::{ActiveLoad, RequestKey};
use flotilla::request_plane::router::policy::{Selector, SelectorConfig};
use flotilla::runtime::ids::{BlockHash, EventId, NodeId, RequestId, SequenceHash, WorkerId};

const BLOCK_SIZE: u32 = 16;
const PROMPT_BLOCKS: usize = 512;
const PROMPT_TOKENS: u32 = PROMPT_BLOCKS as u32 * BLOCK_SIZE;
const TARGET_HOLDINGS: usize = 1_000_000;
const SYSTEM_PROMPTS: usize = 8;
const SYSTEM_BLOCKS: usize = 64;
const TAIL_BLOCKS: usize = PROMPT_BLOCKS - SYSTEM_BLOCKS;
const EVENT_CHUNK: usize = 64;
const SALT: u64 = 0xF107;

struct World {
    index: PrefixIndex,
    load: ActiveLoad,
    live: Vec<WorkerId>,
    systems: Vec<Vec<SequenceHash>>,
    conversations: Vec<Vec<SequenceHash>>,
    next_event: Vec<u64>,
}

fn chain(rng: &mut StdRng, parent: Option<SequenceHash>, n: usize) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(n);
    let mut p = parent;
    for _ in 0..n {
        let s = sequence_hash(p, BlockHash(rng.random()), SALT);
        out.push(s);
        p = Some(s);
    }
    out
}

fn stored(parent: Option<SequenceHash>, hashes: &[SequenceHash]) -> KvEventData {
    let blocks = hashes
        .iter()
        .map(|h| StoredBlock {
            seq_hash: *h,
            block_hash: BlockHash(h.0),
        })
        .collect();
    KvEventData::Stored { parent, blocks }
}

impl World {
    fn build(workers: usize, seed: u64) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let live: Vec<WorkerId> = (0..workers)
            .map(|i| WorkerId::new(format!("node-{}/r{}", i / 8, i % 8)))
            .collect();
        let systems: Vec<_> = (0..SYSTEM_PROMPTS)
            .map(|_| chain(&mut rng, None, SYSTEM_BLOCKS))
            .collect();
        let mut world = World {
            index: PrefixIndex::new(),
            load: ActiveLoad::new(),
            live,
            systems,
            conversations: Vec::new(),
            next_event: vec![1; workers],
        };
        let per_worker = (TARGET_HOLDINGS / workers - SYSTEM_PROMPTS * SYSTEM_BLOCKS) / TAIL_BLOCKS;
        for w in 0..workers {
            for s in 0..SYSTEM_PROMPTS {
                let system = world.systems[s].clone();
                world.store(w, None, &system);
            }
            for _ in 0..per_worker {
                let system = world.systems[rng.random_range(0..SYSTEM_PROMPTS)].clone();
                let tail = chain(&mut rng, system.last().copied(), TAIL_BLOCKS);
                let mut parent = system.last().copied();
                for part in tail.chunks(EVENT_CHUNK) {
                    world.store(w, parent, part);
                    parent = part.last().copied();
                }
                let mut full = system;
                full.extend(tail);
                world.conversations.push(full);
            }
            for r in 0..rng.random_range(0..8u64) {
                let key = RequestKey::new(NodeId::new(format!("gw{w}")), RequestId(r));
                let uncached = rng.random_range(0..PROMPT_TOKENS);
                let blocks = rng.random_range(1..2 * PROMPT_BLOCKS as u32);
                world
                    .load
                    .on_routed(key, &world.live[w], uncached, blocks, 0);
            }
        }
        world
    }

    fn event(&mut self, w: usize, data: KvEventData) -> KvEvent {
        let id = self.next_event[w];
        self.next_event[w] += 1;
        KvEvent {
            worker: self.live[w].clone(),
            event_id: EventId(id),
            tier: Tier::Device,
            data,
        }
    }

    fn store(&mut self, w: usize, parent: Option<SequenceHash>, hashes: &[SequenceHash]) {
        let ev = self.event(w, stored(parent, hashes));
        assert_eq!(self.index.apply(&ev), ApplyOutcome::Applied);
    }

    /// 1 000 requests of one kind.
    fn requests(&self, kind: &str, rng: &mut StdRng) -> Vec<Vec<SequenceHash>> {
        (0..1000)
            .map(|_| match kind {
                "hit" => self.conversations[rng.random_range(0..self.conversations.len())].clone(),
                "shared" => {
                    let mut r = self.systems[rng.random_range(0..SYSTEM_PROMPTS)].clone();
                    let tail = chain(rng, r.last().copied(), TAIL_BLOCKS);
                    r.extend(tail);
                    r
                }
                _ => chain(rng, None, PROMPT_BLOCKS),
            })
            .collect()
    }
}

/// Resident memory of this process, MiB (Linux; 0 elsewhere).
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / (1024.0 * 1024.0)
}

fn percentiles(mut ns: Vec<u64>) -> (u64, u64) {
    ns.sort_unstable();
    (ns[ns.len() / 2], ns[ns.len() * 99 / 100])
}

fn decision_latency(c: &mut Criterion) {
    let only: Option<usize> = std::env::var("ROUTER_BENCH_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok());
    for workers in [16, 64, 256] {
        if only.is_some_and(|o| o != workers) {
            continue;
        }
        let (t, rss) = (Instant::now(), rss_mib());
        let world = World::build(workers, 7);
        eprintln!(
            "world W={workers}: {} holdings, {} blocks, {} nodes, {} conversations, \
             built in {:.1?}, +{:.0} MiB resident",
            world.index.num_holdings(),
            world.index.num_blocks(),
            world.index.num_nodes(),
            world.conversations.len(),
            t.elapsed(),
            rss_mib() - rss
        );
        let mut rng = StdRng::seed_from_u64(9);
        let mut group = c.benchmark_group(format!("decision/{workers}w"));
        for kind in ["hit", "shared", "miss"] {
            let requests = world.requests(kind, &mut rng);
            let mut selector = Selector::new(SelectorConfig::default()).expect("valid");
            let mut i = 0;
            let mut decide = || {
                let r = &requests[i % requests.len()];
                i += 1;
                selector.select(&world.live, r, PROMPT_TOKENS, &world.index, &world.load)
            };
            let samples: Vec<u64> = (0..20_000)
                .map(|_| {
                    let t = Instant::now();
                    black_box(decide());
                    t.elapsed().as_nanos() as u64
                })
                .collect();
            let (p50, p99) = percentiles(samples);
            let d = decide().expect("live workers");
            eprintln!(
                "decision W={workers} {kind}: p50 {:.2} µs, p99 {:.2} µs (overlap of pick {}, best {})",
                p50 as f64 / 1e3,
                p99 as f64 / 1e3,
                d.overlap_blocks,
                d.best_overlap_blocks
            );
            group.bench_function(kind, |b| b.iter(|| black_box(decide())));
            // Reference: the 512 node lookups of a `hit` request, nothing else.
            if kind == "hit" {
                let mut k = 0;
                group.bench_function("hit/lookups_only", |b| {
                    b.iter(|| {
                        k += 1;
                        let r = &requests[k % requests.len()];
                        black_box(r.iter().filter(|h| world.index.contains(**h)).count())
                    })
                });
            }
            let mut j = 0;
            group.bench_function(format!("{kind}/overlaps_only"), |b| {
                b.iter(|| {
                    j += 1;
                    black_box(world.index.overlaps(&requests[j % requests.len()]).max())
                })
            });
        }
        group.finish();
    }
}

/// Where a batch of events comes from: worker 0 of the world, extending a system prompt.
struct EventSource {
    worker: WorkerId,
    next_id: u64,
    root: Option<SequenceHash>,
    rng: StdRng,
}

impl EventSource {
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

    /// `events` Stored events of `chain_len` blocks each (one chain), then the Removed
    /// events (one per Stored, children first) that undo them.
    fn batch(&mut self, events: usize, chain_len: usize) -> Vec<KvEvent> {
        let hashes = chain(&mut self.rng, self.root, events * chain_len);
        let mut out = Vec::with_capacity(2 * events);
        let mut parent = self.root;
        for part in hashes.chunks(chain_len) {
            out.push(self.event(stored(parent, part)));
            parent = part.last().copied();
        }
        for part in hashes.chunks(chain_len).rev() {
            let blocks = part.to_vec();
            out.push(self.event(KvEventData::Removed { blocks }));
        }
        out
    }
}

fn apply_all(index: &mut PrefixIndex, batch: &[KvEvent]) -> usize {
    let applied = batch
        .iter()
        .filter(|ev| index.apply(ev) == ApplyOutcome::Applied);
    applied.count()
}

fn events_per_second(c: &mut Criterion) {
    let world = World::build(256, 11);
    let mut source = EventSource {
        worker: world.live[0].clone(),
        next_id: world.next_event[0],
        root: world.systems[0].last().copied(),
        rng: StdRng::seed_from_u64(12),
    };
    let mut index = world.index;
    let mut group = c.benchmark_group("events");
    for (chain_len, events) in [(1usize, 10_000usize), (16, 1_000)] {
        // One long timed run first, for a plain figure.
        let batches: Vec<_> = (0..20).map(|_| source.batch(events, chain_len)).collect();
        let n: usize = batches.iter().map(Vec::len).sum();
        let t = Instant::now();
        let applied: usize = batches.iter().map(|b| apply_all(&mut index, b)).sum();
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(applied, n);
        eprintln!(
            "events: Stored of {chain_len} block(s) then Removed, index ≈ {} blocks: \
             {:.2} M events/s, {:.2} M blocks/s",
            index.num_blocks(),
            n as f64 / secs / 1e6,
            (n * chain_len) as f64 / secs / 1e6
        );
        group.throughput(Throughput::Elements(2 * events as u64));
        group.bench_function(format!("stored_{chain_len}_then_removed"), |b| {
            b.iter_batched(
                || source.batch(events, chain_len),
                |batch| {
                    assert_eq!(apply_all(&mut index, &batch), batch.len());
                    batch
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = decision_latency, events_per_second
}
criterion_main!(benches);
