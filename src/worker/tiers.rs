//! The bytes of the lower KV tiers on a real engine: [`TierStores`] (G2 host memory laid out as
//! the engine's pool, G3 one segment file per replica) and [`TierCopier`], which carries out
//! the pool's [`TierCopy`]s on two threads (the store lane in issue order, the load lane beside
//! it) and reports each batch back. The pool's side — which block is where, and when it may be
//! read or written — is `kv/tiers.rs`; this file only moves bytes and checks them.
//!
//! # G1 access
//! G1 is the engine's [`KvMemory`] (`Engine::kv_memory`: host memory on the CPU engine, staged
//! device memory on a GPU, reached through its copies), shared as the transport shares it: a
//! copy reads a G1 block that its table keeps whole until the copy returns, or writes a block
//! of a sequence that is not scheduled until then — the pinning contract of
//! `kv/memory.rs`, which the pool's lanes guarantee.
//!
//! # G3 segment
//! `<kv_disk_dir>/<worker>.kvseg`, `disk_blocks` records of `RECORD_HEADER + bytes_per_block`
//! bytes, sized with `set_len` at start (sparse where the file system allows). A record is
//! `magic "FLKVBLK1" ‖ seq_hash ‖ block_hash ‖ checksum` (u64 LE each; checksum = XXH3-64 of the
//! payload seeded with the sequence hash) followed by the block's bytes, layer-major, K then V.
//! A read whose magic, hashes or checksum do not match is [`CopyOutcome::Corrupt`]: the pool
//! drops the entry and the prompt is recomputed. The segment is **cleared at start** (a
//! restarted replica begins with an empty G3 and announces nothing from it): what a previous
//! process left is not trusted. A segment that cannot be made (read-only directory, no space)
//! leaves G3 off with one log line; a write that fails later turns G3 off
//! ([`CopyOutcome::TierOff`]); serving goes on either way.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::kv::{BlockLoc, CopyId, CopyOutcome, TierCopy};
use crate::transport::{KvLayout, KvMemory};

/// Where a replica's engine publishes its KV memory and layout at start, and its scheduler
/// reads them (the replica's one_for_all supervisor starts the engine first and restarts both
/// together).
pub type KvRegionSlot = Arc<std::sync::Mutex<Option<(Arc<KvMemory>, KvLayout)>>>;

/// Bytes before each G3 record's payload.
pub const RECORD_HEADER: u64 = 32;
const MAGIC: u64 = u64::from_le_bytes(*b"FLKVBLK1");

/// G3's file.
#[derive(Debug)]
struct Segment {
    file: File,
    path: PathBuf,
    blocks: u32,
}

/// The memory of a replica's tiers (see the module doc).
#[derive(Debug)]
pub struct TierStores {
    g1: Arc<KvMemory>,
    g1_layout: KvLayout,
    host: KvMemory,
    host_layout: KvLayout,
    disk: Option<Segment>,
}

impl TierStores {
    /// G2 of `host_blocks` blocks beside `g1`; G3 of `disk.1` blocks in directory `disk.0`
    /// (file named after `worker`), cleared. Returns the stores and, when G3 could not be
    /// made, why (G3 is then off).
    ///
    /// # Errors
    /// G2 cannot be allocated.
    pub fn new(
        g1: Arc<KvMemory>,
        g1_layout: KvLayout,
        host_blocks: u32,
        disk: Option<(&Path, u32)>,
        worker: &str,
    ) -> Result<(Self, Option<String>), String> {
        let host_layout = KvLayout {
            num_blocks: host_blocks,
            ..g1_layout
        };
        let host = KvMemory::zeroed(host_layout.region_bytes() as usize)
            .map_err(|e| format!("G2 of {host_blocks} blocks: {e}"))?;
        let per_block = g1_layout.bytes_per_block();
        let (disk, why) = match disk {
            None => (None, None),
            Some((dir, blocks)) => match make_segment(dir, blocks, per_block, worker) {
                Ok(s) => (Some(s), None),
                Err(e) => (None, Some(e)),
            },
        };
        Ok((
            Self {
                g1,
                g1_layout,
                host,
                host_layout,
                disk,
            },
            why,
        ))
    }

    /// Whether G3 is on.
    pub fn has_disk(&self) -> bool {
        self.disk.is_some()
    }

    /// The G3 segment's path.
    pub fn disk_path(&self) -> Option<&Path> {
        self.disk.as_ref().map(|d| d.path.as_path())
    }

    fn record_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * (RECORD_HEADER + self.g1_layout.bytes_per_block())
    }

    /// Carries out one copy.
    pub fn run(&self, c: &TierCopy) -> CopyOutcome {
        let r = match (c.from, c.to) {
            (BlockLoc::Device(b), BlockLoc::Host(s)) => self.copy(
                &self.g1,
                &self.g1_layout,
                b,
                &self.host,
                &self.host_layout,
                s,
            ),
            (BlockLoc::Host(s), BlockLoc::Device(b)) => self.copy(
                &self.host,
                &self.host_layout,
                s,
                &self.g1,
                &self.g1_layout,
                b,
            ),
            (BlockLoc::Host(s), BlockLoc::Disk(d)) => return self.demote(c, s, d),
            (BlockLoc::Disk(d), BlockLoc::Device(b)) => return self.onboard_disk(c, d, b),
            _ => Err(format!("no such copy: {c:?}")),
        };
        match r {
            Ok(()) => CopyOutcome::Done,
            Err(e) => {
                tracing::warn!(copy = ?c.id, error = %e, "KV tier copy failed");
                CopyOutcome::Failed
            }
        }
    }

    /// One block from `src` (block `s`) to `dst` (block `d`), run by run.
    fn copy(
        &self,
        src: &KvMemory,
        src_layout: &KvLayout,
        s: u32,
        dst: &KvMemory,
        dst_layout: &KvLayout,
        d: u32,
    ) -> Result<(), String> {
        let segs = src_layout
            .segments(dst_layout, &[(s, d)])
            .map_err(|e| e.to_string())?;
        let mut scratch = Vec::new();
        for seg in segs {
            // SAFETY: the pool's lanes keep the source block unwritten and the target block
            // unread by anyone else until this copy is answered (module doc, "G1 access"); G1
            // and G2 are distinct allocations.
            unsafe {
                src.copy_to(
                    seg.remote as usize,
                    dst,
                    seg.local as usize,
                    seg.len as usize,
                    &mut scratch,
                )
                .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    /// Gathers block `b` of `mem` (laid out as `layout`), layer-major, K then V.
    fn gather(&self, mem: &KvMemory, layout: &KvLayout, b: u32) -> Result<Vec<u8>, String> {
        let bb = layout.block_bytes as usize;
        let mut out = vec![0u8; layout.bytes_per_block() as usize];
        for layer in 0..layout.n_layers {
            for kv in 0..2 {
                let at = ((layer * 2 + kv) as usize) * bb;
                // SAFETY: as in `copy`.
                unsafe {
                    mem.read_into(layout.offset(layer, kv, b) as usize, &mut out[at..at + bb])
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(out)
    }

    fn demote(&self, c: &TierCopy, s: u32, d: u32) -> CopyOutcome {
        let Some(seg) = &self.disk else {
            return CopyOutcome::TierOff;
        };
        if d >= seg.blocks {
            return CopyOutcome::Failed;
        }
        let payload = match self.gather(&self.host, &self.host_layout, s) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "G2 read for G3 failed");
                return CopyOutcome::Failed;
            }
        };
        let seq = c.block.seq_hash.0;
        let mut record = Vec::with_capacity(RECORD_HEADER as usize + payload.len());
        for v in [
            MAGIC,
            seq,
            c.block.block_hash.0,
            xxh3_64_with_seed(&payload, seq),
        ] {
            record.extend_from_slice(&v.to_le_bytes());
        }
        record.extend_from_slice(&payload);
        match seg.file.write_all_at(&record, self.record_offset(d)) {
            Ok(()) => CopyOutcome::Done,
            Err(e) => {
                tracing::error!(path = %seg.path.display(), error = %e, "G3 write failed: the disk tier turns off; serving goes on");
                metrics::counter!("flotilla_kv_tier_off_total", "tier" => "disk").increment(1);
                CopyOutcome::TierOff
            }
        }
    }

    fn onboard_disk(&self, c: &TierCopy, d: u32, b: u32) -> CopyOutcome {
        let Some(seg) = &self.disk else {
            return CopyOutcome::TierOff;
        };
        let per_block = self.g1_layout.bytes_per_block() as usize;
        let mut record = vec![0u8; RECORD_HEADER as usize + per_block];
        if let Err(e) = seg.file.read_exact_at(&mut record, self.record_offset(d)) {
            tracing::debug!(path = %seg.path.display(), error = %e, "G3 read failed");
            return CopyOutcome::Corrupt;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&record[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        let (magic, seq, bh, sum) = (word(0), word(1), word(2), word(3));
        let payload = &record[RECORD_HEADER as usize..];
        if magic != MAGIC
            || seq != c.block.seq_hash.0
            || bh != c.block.block_hash.0
            || sum != xxh3_64_with_seed(payload, seq)
        {
            tracing::debug!(path = %seg.path.display(), slot = d, "G3 block corrupt (header or checksum)");
            metrics::counter!("flotilla_kv_tier_corrupt_blocks_total", "tier" => "disk")
                .increment(1);
            return CopyOutcome::Corrupt;
        }
        let bb = self.g1_layout.block_bytes as usize;
        for layer in 0..self.g1_layout.n_layers {
            for kv in 0..2 {
                let at = ((layer * 2 + kv) as usize) * bb;
                let off = self.g1_layout.offset(layer, kv, b) as usize;
                // SAFETY: the target block belongs to a sequence not scheduled until this
                // copy is answered.
                if let Err(e) = unsafe { self.g1.write_from(off, &payload[at..at + bb]) } {
                    tracing::warn!(error = %e, "G1 write failed");
                    return CopyOutcome::Failed;
                }
            }
        }
        CopyOutcome::Done
    }
}

fn make_segment(dir: &Path, blocks: u32, per_block: u64, worker: &str) -> Result<Segment, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let name: String = worker
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let path = dir.join(format!("{name}.kvseg"));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let len = u64::from(blocks) * (RECORD_HEADER + per_block);
    file.set_len(len)
        .map_err(|e| format!("{}: {len} bytes: {e}", path.display()))?;
    Ok(Segment { file, path, blocks })
}

/// Carries out copies on two threads (store lane, load lane) and hands each batch's outcomes
/// to `done`. The threads end when the copier is dropped.
#[derive(Debug)]
pub struct TierCopier {
    store: mpsc::Sender<Vec<TierCopy>>,
    load: mpsc::Sender<Vec<TierCopy>>,
}

impl TierCopier {
    /// Starts the lanes over `stores`.
    ///
    /// # Errors
    /// A thread cannot be spawned.
    pub fn start<F>(stores: Arc<TierStores>, done: F) -> std::io::Result<Self>
    where
        F: Fn(Vec<(CopyId, CopyOutcome)>) + Send + Clone + 'static,
    {
        let lane = |name: &str| -> std::io::Result<mpsc::Sender<Vec<TierCopy>>> {
            let (tx, rx) = mpsc::channel::<Vec<TierCopy>>();
            let (stores, done) = (stores.clone(), done.clone());
            std::thread::Builder::new()
                .name(name.to_owned())
                .spawn(move || {
                    for batch in rx {
                        let out: Vec<_> = batch.iter().map(|c| (c.id, stores.run(c))).collect();
                        let corrupt = out
                            .iter()
                            .filter(|(_, o)| *o == CopyOutcome::Corrupt)
                            .count();
                        if corrupt > 0 {
                            // One line per batch, not per block.
                            tracing::warn!(
                                blocks = corrupt,
                                path = ?stores.disk_path(),
                                "G3 blocks failed their checksum or could not be read: dropped, their prompts recomputed"
                            );
                        }
                        done(out);
                    }
                })?;
            Ok(tx)
        };
        Ok(Self {
            store: lane("kv-tier-store")?,
            load: lane("kv-tier-load")?,
        })
    }

    /// Queues copies (each lane keeps their order). Copies that cannot be queued (a lane
    /// ended) are answered failed through `failed`.
    pub fn submit(&self, copies: Vec<TierCopy>, failed: impl FnOnce(Vec<(CopyId, CopyOutcome)>)) {
        let (store, load): (Vec<_>, Vec<_>) = copies.into_iter().partition(|c| c.is_store());
        let mut lost = Vec::new();
        for (tx, batch) in [(&self.store, store), (&self.load, load)] {
            if batch.is_empty() {
                continue;
            }
            if let Err(mpsc::SendError(b)) = tx.send(batch) {
                lost.extend(b.iter().map(|c| (c.id, CopyOutcome::Failed)));
            }
        }
        if !lost.is_empty() {
            failed(lost);
        }
    }
}

#[cfg(test)]
mod tests;
