//! KV tier copy bandwidth on this machine next to its baselines, interleaved in one run.
//!
//! `cargo run --release --example kv_tier_bandwidth [-- ROUNDS [BLOCKS] [DIR]]` (defaults 5,
//! 256 blocks, the system temp dir): blocks of the default model's KV geometry (30 layers ×
//! K,V × 16 tokens × 3 KV heads × 64 × f32 = 720 KiB a block) moved by the real tier stores
//! (`worker/tiers.rs`), per round:
//! - `memcpy`: one contiguous copy of the same bytes (the bound for G1 ↔ G2);
//! - `offload G1→G2`, `onboard G2→G1`: the stores' block copies (60 runs of 12 KiB a block,
//!   one `memcpy` each);
//! - `demote G2→G3`: gather, checksum and write each block's record to the segment file;
//! - `file read`: the segment file read sequentially, 1 MiB at a time, into a buffer made
//!   beforehand (the bound for G3 → G1; from the page cache when the file was just written, as
//!   here);
//! - `onboard G3→G1`: read each record, verify its checksum, scatter it into G1;
//! - `peer pull G1→G1 (tcp)`, `(ucx)`: a peer pull (G4) — one transport (`transport/`) reads
//!   every block of another's registered G1 into its own, as a worker pulls a prefix from its
//!   holder; in one process over loopback, the UCX row only where UCX starts (baseline:
//!   `memcpy`).
//!
//! Prints the median GB/s of each row over the rounds and its ratio to its baseline.

use std::sync::Arc;
use std::time::Instant;

use flotilla::kv::{BlockLoc, CopyId, CopyKind, CopyOutcome, SnapshotBlock, TierCopy};
use flotilla::runtime::ids::{BlockHash, SeqId, SequenceHash};
use flotilla::transport::{
    BackendChoice, KvLayout, KvMemory, PullRequest, RegionDescriptor, TransferFaults, Transport,
    TransportConfig,
};
use flotilla::worker::tiers::TierStores;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn copy(kind: CopyKind, from: BlockLoc, to: BlockLoc, h: u64) -> TierCopy {
    TierCopy {
        id: CopyId(h),
        kind,
        from,
        to,
        block: SnapshotBlock {
            seq_hash: SequenceHash(h + 1),
            parent: None,
            block_hash: BlockHash(h),
        },
    }
}

/// A holder and a puller transport on `backend`, the holder's G1 registered; `None` when the
/// backend does not start here (UCX without its libraries).
async fn peers(
    backend: BackendChoice,
    g1: Arc<KvMemory>,
    layout: KvLayout,
) -> Option<(Transport, Transport, RegionDescriptor)> {
    let config = || TransportConfig {
        backend,
        ..TransportConfig::default()
    };
    let holder = Transport::start("holder", config(), TransferFaults::default())
        .await
        .ok()?;
    let puller = Transport::start("puller", config(), TransferFaults::default())
        .await
        .ok()?;
    let from = holder.register("holder/replica-0", layout, g1).await.ok()?;
    let mem = puller.allocate(layout).await.ok()?;
    puller
        .register("puller/replica-0", layout, mem)
        .await
        .ok()?;
    Some((holder, puller, from))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = args.first().map_or(Ok(5), |s| s.parse())?;
    let blocks: u32 = args.get(1).map_or(Ok(256), |s| s.parse())?;
    let dir = args
        .get(2)
        .map_or_else(std::env::temp_dir, std::path::PathBuf::from)
        .join(format!("flotilla-tier-bw-{}", std::process::id()));
    let layout = KvLayout {
        n_layers: 30,
        num_blocks: blocks,
        block_bytes: 16 * 3 * 64 * 4,
    };
    let g1 = Arc::new(KvMemory::zeroed(layout.region_bytes() as usize)?);
    let fill: Vec<u8> = (0..g1.len()).map(|i| (i * 31) as u8).collect();
    // SAFETY: nobody else holds this memory yet.
    unsafe { g1.write_from(0, &fill)? };
    drop(fill);
    let (stores, why) = TierStores::new(g1.clone(), layout, blocks, Some((&dir, blocks)), "bw")
        .map_err(anyhow::Error::msg)?;
    anyhow::ensure!(why.is_none(), "G3: {why:?}");
    let bytes = layout.region_bytes() as f64;
    let seg = stores.disk_path().expect("G3 on").to_owned();
    let run = |c: Vec<TierCopy>| -> anyhow::Result<f64> {
        let t = Instant::now();
        for c in &c {
            anyhow::ensure!(stores.run(c) == CopyOutcome::Done, "{c:?} failed");
        }
        Ok(bytes / t.elapsed().as_secs_f64() / 1e9)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut pulls: Vec<(&str, Transport, Transport, RegionDescriptor, Vec<f64>)> = Vec::new();
    for (name, backend) in [("tcp", BackendChoice::Tcp), ("ucx", BackendChoice::Ucx)] {
        match rt.block_on(peers(backend, g1.clone(), layout)) {
            Some((h, p, d)) => pulls.push((name, h, p, d, Vec::new())),
            None => eprintln!("peer pull over {name}: the backend does not start here; skipped"),
        }
    }
    let seq = SeqId(1);
    let (mut mc, mut off, mut on2, mut dem, mut fr, mut on3) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    let mut dst = vec![0u8; bytes as usize];
    let src = vec![7u8; bytes as usize];
    for _ in 0..rounds {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        mc.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        let b = |f: fn(u32) -> BlockLoc, g: fn(u32) -> BlockLoc, k: CopyKind| {
            (0..blocks)
                .map(|i| copy(k, f(i), g(i), u64::from(i)))
                .collect::<Vec<_>>()
        };
        off.push(run(b(BlockLoc::Device, BlockLoc::Host, CopyKind::Offload))?);
        on2.push(run(b(
            BlockLoc::Host,
            BlockLoc::Device,
            CopyKind::Onboard(seq),
        ))?);
        dem.push(run(b(BlockLoc::Host, BlockLoc::Disk, CopyKind::Demote))?);
        // Sequential 1 MiB reads into a buffer allocated before the clock starts.
        let f = std::fs::File::open(&seg)?;
        let len = f.metadata()?.len() as usize;
        let mut buf = vec![1u8; len]; // touched: no page faults on the clock
        let t = Instant::now();
        for (i, chunk) in buf.chunks_mut(1 << 20).enumerate() {
            std::os::unix::fs::FileExt::read_exact_at(&f, chunk, (i << 20) as u64)?;
        }
        fr.push(len as f64 / t.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(&buf);
        on3.push(run(b(
            BlockLoc::Disk,
            BlockLoc::Device,
            CopyKind::Onboard(seq),
        ))?);
        for (_, _, puller, from, v) in &mut pulls {
            let req = PullRequest {
                from: from.clone(),
                into: "puller/replica-0".into(),
                blocks: (0..blocks).map(|i| (i, i)).collect(),
                deadline: Instant::now() + std::time::Duration::from_secs(120),
            };
            let t = Instant::now();
            let st = rt.block_on(puller.pull(req))?;
            anyhow::ensure!(
                st.bytes as f64 == bytes,
                "pulled {} of {bytes} bytes",
                st.bytes
            );
            v.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    let (mc, fr) = (median(&mut mc), median(&mut fr));
    println!(
        "{blocks} blocks of {} KiB ({:.0} MiB), {rounds} rounds, medians:\n",
        layout.bytes_per_block() / 1024,
        bytes / (1 << 20) as f64
    );
    println!("| copy | GB/s | ÷ baseline |\n|---|---:|---:|");
    println!("| memcpy (baseline for G1 ↔ G2) | {mc:.2} | 1.00 |");
    for (name, v) in [("offload G1→G2", &mut off), ("onboard G2→G1", &mut on2)] {
        let m = median(v);
        println!("| {name} | {m:.2} | {:.2} |", m / mc);
    }
    let m = median(&mut dem);
    println!(
        "| demote G2→G3 (write + checksum) | {m:.2} | {:.2} of memcpy |",
        m / mc
    );
    println!("| sequential file read (baseline for G3 → G1) | {fr:.2} | 1.00 |");
    let m = median(&mut on3);
    println!("| onboard G3→G1 (read + verify) | {m:.2} | {:.2} |", m / fr);
    for (name, _, _, _, v) in &mut pulls {
        let m = median(v);
        println!(
            "| peer pull G1→G1 ({name}, loopback) | {m:.2} | {:.2} of memcpy |",
            m / mc
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
