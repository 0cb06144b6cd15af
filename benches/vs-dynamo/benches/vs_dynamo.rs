//! Flotilla's `PrefixIndex` against Dynamo's `RadixTree` (see the package's README.md).
//!
//! For each W ∈ {16, 64, 256, 1024} (`VS_DYNAMO_WORKERS=64` keeps one): build both indexes from the
//! same ~1M-holding event stream (timed), assert that they agree, time churn and find-matches
//! with plain timers (p50/p99), then criterion's means for the same operations. The markdown
//! table of Flotilla/Dynamo ratios is printed at the end.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use criterion::{BatchSize, Criterion, Throughput};

use flotilla_vs_dynamo::{
    CriterionMeans, KINDS, Measured, apply_dynamo, apply_flotilla, measure, query_sets, table,
    worker_counts,
};

/// (blocks per Stored event, Stored events per batch) of the churn benchmarks.
const CHURN: [(usize, usize); 2] = [(1, 10_000), (16, 1_000)];

fn bench_world(c: &mut Criterion, m: &mut Measured) {
    let w = m.world.workers;
    let sets = query_sets(&m.world);
    let mut group = c.benchmark_group(format!("find_matches/{w}w"));
    for (kind, qs) in &sets {
        // Both through `iter_batched`: the answer is dropped outside the clock for both, and
        // Dynamo's by-value query is copied outside it.
        let mut i = 0;
        group.bench_function(format!("{kind}/flotilla"), |b| {
            b.iter_batched(
                || {
                    i += 1;
                    &qs[i % qs.len()].seq
                },
                |q| m.index.overlaps(black_box(q)),
                BatchSize::SmallInput,
            )
        });
        let mut j = 0;
        group.bench_function(format!("{kind}/dynamo"), |b| {
            b.iter_batched(
                || {
                    j += 1;
                    qs[j % qs.len()].local.clone()
                },
                |q| m.tree.find_matches(black_box(q), false),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();

    let mut group = c.benchmark_group(format!("events/{w}w"));
    for (chain_len, events) in CHURN {
        group.throughput(Throughput::Elements(2 * events as u64));
        let mut source = m.world.churn(13, m.next_id);
        group.bench_function(format!("stored_{chain_len}_then_removed/flotilla"), |b| {
            b.iter_batched(
                || source.batch(events, chain_len),
                |batch| {
                    assert_eq!(apply_flotilla(&mut m.index, &batch), batch.len());
                    batch
                },
                BatchSize::PerIteration,
            )
        });
        m.next_id = source.next_id();
        // Dynamo does not check event ids; the same hashes as Flotilla's first batches.
        let mut source = m.world.churn(13, 1);
        group.bench_function(format!("stored_{chain_len}_then_removed/dynamo"), |b| {
            b.iter_batched(
                || source.dynamo_batch(events, chain_len),
                |batch| {
                    let n = batch.len();
                    assert_eq!(apply_dynamo(&mut m.tree, batch), n);
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

/// Where criterion writes its estimates: as criterion itself decides (`CRITERION_HOME`, else
/// `$CARGO_TARGET_DIR/criterion`, else `target/criterion`), set explicitly so it can be read.
fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => PathBuf::from(t).join("criterion"),
        None => PathBuf::from("target/criterion"),
    }
}

/// Criterion's mean estimate (ns per iteration) of `group`/`id`, if it ran since `since`.
fn criterion_mean(dir: &Path, group: &str, id: &str, since: SystemTime) -> Option<f64> {
    let path = dir
        .join(group.replace('/', "_"))
        .join(id.replace('/', "_"))
        .join("new/estimates.json");
    if std::fs::metadata(&path).ok()?.modified().ok()? < since {
        return None;
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
    json["mean"]["point_estimate"].as_f64()
}

fn criterion_means(dir: &Path, w: usize, since: SystemTime) -> Option<CriterionMeans> {
    let pair = |group: &str, id: &str| {
        Some([
            criterion_mean(dir, group, &format!("{id}/flotilla"), since)?,
            criterion_mean(dir, group, &format!("{id}/dynamo"), since)?,
        ])
    };
    let mut means = CriterionMeans::default();
    for kind in KINDS {
        if let Some(p) = pair(&format!("find_matches/{w}w"), kind) {
            means.find_matches.push((kind, p));
        }
    }
    for (chain_len, events) in CHURN {
        let id = format!("stored_{chain_len}_then_removed");
        if let Some([f, d]) = pair(&format!("events/{w}w"), &id) {
            let per_sec = |ns: f64| 2.0 * events as f64 / (ns / 1e9);
            means.churn.push((chain_len, [per_sec(f), per_sec(d)]));
        }
    }
    (!means.find_matches.is_empty() || !means.churn.is_empty()).then_some(means)
}

fn main() {
    let dir = criterion_dir();
    let start = SystemTime::now();
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .output_directory(&dir)
        .configure_from_args();
    let mut figures = Vec::new();
    for w in worker_counts() {
        let mut m = measure(w);
        bench_world(&mut c, &mut m);
        figures.push(m.figures);
    }
    c.final_summary();
    for f in &mut figures {
        f.criterion = criterion_means(&dir, f.workers, start);
    }
    println!("\n{}", table(&figures));
}
