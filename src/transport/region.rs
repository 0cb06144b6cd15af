//! Registered memory: the bytes a transport may read or write, their identity and layout.
//!
//! A KV pool lives in one [`KvMemory`] allocation, laid out `[layer][K, V][block][bytes]`
//! ([`KvLayout`]), so one registration (one UCX rkey) covers a whole replica's KV and a block is
//! `2 · n_layers` fixed-size runs at computed offsets. [`KvLayout::segments`] turns a list of
//! `(remote block, local block)` pairs into byte runs, merging runs that are consecutive on both
//! sides (consecutive block ids of one layer and pool are adjacent in memory).
//!
//! # Who touches the bytes
//! The engine owns the pool and reads and writes it through `&mut` slices
//! ([`crate::model::kv_cache::KvCache`]). A transport reaches the same bytes only through raw
//! pointers (`ptr::copy_nonoverlapping`, UCX one-sided gets, another process's reads), and only
//! for blocks the block manager has pinned for the transfer: complete blocks a sequence holds
//! (read side: they are never written again while pinned) or blocks allocated for a sequence that
//! is not scheduled until its transfer ends (write side). So no byte is written by one party
//! while another accesses it: the contract of DMA, which this is.
//!
//! # Epochs
//! Each registration gets a fresh [`RegionId::epoch`] (a process-wide counter seeded by the wall
//! clock, so it also grows across restarts). A replica that restarts registers new memory under
//! a new epoch; a pull naming an older epoch than the one its owner published is refused
//! ([`super::TransportError::Stale`]), and the TCP server refuses any epoch it does not hold.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::TransportError;

/// Alignment of a [`KvMemory`] allocation: a page, as RDMA registration prefers.
const ALIGN: usize = 4096;

/// A KV pool's bytes: one allocation that never moves.
///
/// Either a zeroed, page-aligned heap allocation ([`KvMemory::zeroed`]) or memory a transport
/// allocated and registered itself ([`KvMemory::external`]: UCX allocates shared memory that
/// peers on the same machine map directly). Shared (`Arc`) between the engine that computes in
/// it and the transport that registered it, so that the memory outlives every registration of
/// it. See the module docs for who may access which bytes when.
pub struct KvMemory {
    ptr: NonNull<u8>,
    len: usize,
    /// `None`: a heap allocation (freed here); `Some`: the owner's release.
    release: Option<Box<dyn FnOnce() + Send + Sync>>,
    registered: Option<Preregistered>,
}

/// A registration made together with the allocation (by the transport that allocated it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preregistered {
    /// Which backend instance registered it.
    pub instance: u64,
    /// The registration's packed remote key.
    pub rkey: Vec<u8>,
}

impl std::fmt::Debug for KvMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("external", &self.release.is_some())
            .finish()
    }
}

// SAFETY: `KvMemory` is a plain allocation; it hands out raw pointers only. Every access
// through them follows the pinning contract in the module docs. The release closure is
// `Send + Sync`.
unsafe impl Send for KvMemory {}
// SAFETY: as above: `&KvMemory` gives only the base pointer and length.
unsafe impl Sync for KvMemory {}

impl KvMemory {
    /// Allocates `len` zeroed bytes (`len` ≥ 1) on the heap.
    ///
    /// # Errors
    /// [`TransportError::Layout`] when `len` is 0 or too large to allocate.
    pub fn zeroed(len: usize) -> Result<Self, TransportError> {
        let layout = Layout::from_size_align(len.max(1), ALIGN)
            .map_err(|e| TransportError::Layout(format!("{len} bytes: {e}")))?;
        if len == 0 {
            return Err(TransportError::Layout("an empty region".into()));
        }
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| TransportError::Layout(format!("cannot allocate {len} bytes")))?;
        Ok(Self {
            ptr,
            len,
            release: None,
            registered: None,
        })
    }

    /// Wraps memory someone else allocated; `release` runs once, when this is dropped.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes, not used through any other path,
    /// and stay valid until `release` runs.
    pub unsafe fn external(
        ptr: NonNull<u8>,
        len: usize,
        registered: Option<Preregistered>,
        release: Box<dyn FnOnce() + Send + Sync>,
    ) -> Self {
        Self {
            ptr,
            len,
            release: Some(release),
            registered,
        }
    }

    /// The registration made with the allocation, if any.
    pub fn preregistered(&self) -> Option<&Preregistered> {
        self.registered.as_ref()
    }

    /// Base address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a region has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `len` bytes at `offset` out.
    ///
    /// # Safety
    /// No one may write these bytes during the call (the pinning contract).
    ///
    /// # Errors
    /// [`TransportError::OutOfRange`] when the range leaves the region.
    pub unsafe fn read_into(&self, offset: usize, out: &mut [u8]) -> Result<(), TransportError> {
        self.check(offset, out.len())?;
        // SAFETY: in bounds (checked); the caller guarantees no concurrent writer; `out` is a
        // distinct Rust buffer, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Copies `data` in at `offset`.
    ///
    /// # Safety
    /// No one else may access these bytes during the call (the pinning contract).
    ///
    /// # Errors
    /// [`TransportError::OutOfRange`] when the range leaves the region.
    pub unsafe fn write_from(&self, offset: usize, data: &[u8]) -> Result<(), TransportError> {
        self.check(offset, data.len())?;
        // SAFETY: in bounds (checked); the caller guarantees exclusive access to the range.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(TransportError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                region: self.len as u64,
            }),
        }
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        match self.release.take() {
            Some(release) => release(),
            // SAFETY: allocated in `zeroed` with this size and alignment (checked there).
            None => unsafe {
                dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, ALIGN),
                )
            },
        }
    }
}

/// Names one registration: whose memory (a worker id, or any owner name) and which epoch.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId {
    /// The owner (a worker id such as `n1/replica-0`).
    pub owner: String,
    /// Fresh per registration; grows across restarts.
    pub epoch: u64,
}

impl std::fmt::Display for RegionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.owner, self.epoch)
    }
}

static NEXT_EPOCH: AtomicU64 = AtomicU64::new(0);

/// A new epoch: wall-clock microseconds at first use, then +1 per call (so it grows within a
/// process and, unless the clock steps back, across process restarts).
pub fn next_epoch() -> u64 {
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(1);
    let _ = NEXT_EPOCH.compare_exchange(0, now_us, Ordering::Relaxed, Ordering::Relaxed);
    NEXT_EPOCH.fetch_add(1, Ordering::Relaxed)
}

/// Geometry of a KV pool laid out `[layer][K, V][block][block_bytes]` in one region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// Transformer layers.
    pub n_layers: u32,
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// Bytes of one block of one pool (K or V) of one layer.
    pub block_bytes: u64,
}

/// One contiguous run to copy: `len` bytes from `remote` (offset in the source region) to
/// `local` (offset in the destination region).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Source offset (bytes).
    pub remote: u64,
    /// Destination offset (bytes).
    pub local: u64,
    /// Length (bytes).
    pub len: u64,
}

impl KvLayout {
    /// Bytes of the whole pool.
    pub fn region_bytes(&self) -> u64 {
        2 * self.n_layers as u64 * self.num_blocks as u64 * self.block_bytes
    }

    /// Bytes of one block across all layers and both pools.
    pub fn bytes_per_block(&self) -> u64 {
        2 * self.n_layers as u64 * self.block_bytes
    }

    /// Offset of `block` in `layer`'s pool `kv` (0 = K, 1 = V).
    pub fn offset(&self, layer: u32, kv: u32, block: u32) -> u64 {
        ((layer as u64 * 2 + kv as u64) * self.num_blocks as u64 + block as u64) * self.block_bytes
    }

    /// The byte runs that move `pairs` (`(source block, destination block)`) from a pool laid
    /// out as `self` into one laid out as `dst`, in layer-major order, merging runs consecutive
    /// on both sides.
    ///
    /// # Errors
    /// [`TransportError::Layout`] when the two pools differ in layers or block bytes, or a block
    /// id is out of its pool.
    pub fn segments(
        &self,
        dst: &KvLayout,
        pairs: &[(u32, u32)],
    ) -> Result<Vec<Segment>, TransportError> {
        if self.n_layers != dst.n_layers || self.block_bytes != dst.block_bytes {
            return Err(TransportError::Layout(format!(
                "source has {} layers × {} B blocks, destination {} × {} B",
                self.n_layers, self.block_bytes, dst.n_layers, dst.block_bytes
            )));
        }
        if let Some(&(s, d)) = pairs
            .iter()
            .find(|&&(s, d)| s >= self.num_blocks || d >= dst.num_blocks)
        {
            return Err(TransportError::Layout(format!(
                "block pair ({s} → {d}) out of range ({} source, {} destination blocks)",
                self.num_blocks, dst.num_blocks
            )));
        }
        let mut out: Vec<Segment> = Vec::new();
        for layer in 0..self.n_layers {
            for kv in 0..2 {
                for &(s, d) in pairs {
                    let seg = Segment {
                        remote: self.offset(layer, kv, s),
                        local: dst.offset(layer, kv, d),
                        len: self.block_bytes,
                    };
                    match out.last_mut() {
                        Some(last)
                            if last.remote + last.len == seg.remote
                                && last.local + last.len == seg.local =>
                        {
                            last.len += seg.len
                        }
                        _ => out.push(seg),
                    }
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: KvLayout = KvLayout {
        n_layers: 2,
        num_blocks: 8,
        block_bytes: 64,
    };

    #[test]
    fn offsets_tile_the_region() {
        assert_eq!(L.region_bytes(), 2 * 2 * 8 * 64);
        assert_eq!(L.offset(0, 0, 0), 0);
        assert_eq!(L.offset(0, 1, 0), 8 * 64);
        assert_eq!(L.offset(1, 0, 3), (2 * 8 + 3) * 64);
        assert_eq!(L.offset(1, 1, 7) + 64, L.region_bytes());
    }

    #[test]
    fn consecutive_pairs_merge_per_layer_and_pool() {
        let segs = L.segments(&L, &[(2, 5), (3, 6), (4, 7)]).expect("segments");
        // One run per (layer, pool): 3 blocks each.
        assert_eq!(segs.len(), 4);
        assert!(segs.iter().all(|s| s.len == 3 * 64));
        assert_eq!(segs[0].remote, L.offset(0, 0, 2));
        assert_eq!(segs[0].local, L.offset(0, 0, 5));
        let total: u64 = segs.iter().map(|s| s.len).sum();
        assert_eq!(total, 3 * L.bytes_per_block());
    }

    #[test]
    fn scattered_pairs_do_not_merge() {
        let segs = L.segments(&L, &[(0, 1), (1, 0)]).expect("segments");
        assert_eq!(segs.len(), 8);
        // One block: one run per layer and pool.
        let segs = L.segments(&L, &[(7, 7)]).expect("segments");
        assert_eq!(segs.len(), 4, "{segs:?}");
    }

    #[test]
    fn mismatched_layouts_and_bad_blocks_are_errors() {
        let other = KvLayout {
            block_bytes: 32,
            ..L
        };
        assert!(matches!(
            L.segments(&other, &[(0, 0)]),
            Err(TransportError::Layout(_))
        ));
        assert!(matches!(
            L.segments(&L, &[(8, 0)]),
            Err(TransportError::Layout(_))
        ));
        assert!(matches!(
            L.segments(&L, &[(0, 8)]),
            Err(TransportError::Layout(_))
        ));
    }

    #[test]
    fn memory_copies_check_bounds() {
        let m = KvMemory::zeroed(128).expect("alloc");
        assert_eq!(m.as_ptr() as usize % ALIGN, 0);
        // SAFETY: no one else uses this memory.
        unsafe {
            m.write_from(100, &[7; 28]).expect("in range");
            assert!(m.write_from(101, &[7; 28]).is_err());
            let mut out = [0u8; 30];
            m.read_into(98, &mut out).expect("in range");
            assert_eq!(&out[..2], &[0, 0]);
            assert!(out[2..].iter().all(|&b| b == 7));
            assert!(m.read_into(usize::MAX, &mut out).is_err());
        }
        assert!(KvMemory::zeroed(0).is_err());
    }

    #[test]
    fn epochs_grow() {
        let a = next_epoch();
        let b = next_epoch();
        assert!(b > a && a > 1_600_000_000_000_000);
    }
}
