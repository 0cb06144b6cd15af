//! Registered KV memory: the bytes a transport may read or write, their identity and layout.
//! The KV plane owns it (the engines allocate their pools in it); the transport
//! (`crate::transport`) registers it and moves its bytes, it does not own it.
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
//! # Memory kinds
//! A region is host memory ([`MemoryKind::Host`]: the heap, or memory UCX allocated), read and
//! written by plain copies at its address, or memory reached only through copies
//! ([`KvMemory::staged`]): a GPU engine's KV pool ([`MemoryKind::Cuda`]), or the host pool of
//! the GPU pass on its CPU twins, which stands in for one. Staged memory is read and written
//! through the [`DeviceAccess`] its owner gave (synchronous device↔host copies:
//! `cuMemcpyDtoH` / `cuMemcpyHtoD`). The TCP backend **stages** every run through a host
//! buffer that way; UCX reads CUDA memory in place only when it registers it as CUDA memory
//! itself (a UCX built with `cuda_copy` / `cuda_ipc` / `gdr_copy`), and otherwise the region
//! is served over TCP. Staged memory is not owned by its [`KvMemory`]: the owner frees it after
//! [`MemoryLease::revoke`], and copies after that fail with [`MemoryError::Backend`]
//! instead of touching freed memory.
//!
//! # Epochs
//! Each registration gets a fresh [`RegionId::epoch`] (a process-wide counter seeded by the wall
//! clock, so it also grows across restarts). A replica that restarts registers new memory under
//! a new epoch; a pull naming an older epoch than the one its owner published is refused
//! (the transport's `TransportError::Stale`), and the TCP server refuses any epoch it does not hold.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard};

use serde::{Deserialize, Serialize};

/// Why a region could not be made, read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// The two pools' geometries differ, a block is out of range, or a region is empty or
    /// too large to allocate.
    #[error("layout: {0}")]
    Layout(String),
    /// A byte range leaves its region.
    #[error("range {offset}+{len} leaves a region of {region} bytes")]
    OutOfRange {
        /// Offset (bytes).
        offset: u64,
        /// Length (bytes).
        len: u64,
        /// Region size (bytes).
        region: u64,
    },
    /// A staged copy failed (the device refused it, or the memory was revoked).
    #[error("backend: {0}")]
    Backend(String),
}

/// Alignment of a [`KvMemory`] allocation: a page, as RDMA registration prefers.
const ALIGN: usize = 4096;

/// Where a region's bytes live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum MemoryKind {
    /// Host memory, addressable by this process.
    #[default]
    Host,
    /// Memory of CUDA device `device` (an ordinal of the owner's process).
    Cuda {
        /// The device's ordinal.
        device: u32,
    },
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::Cuda { device } => write!(f, "cuda:{device}"),
        }
    }
}

/// Copies between host buffers and memory the host cannot address (a device's): how the
/// transport reaches a [`KvMemory::staged`] region. Both copies are synchronous: the bytes have
/// landed when they return. Offsets are bytes from the region's start, bounds-checked by
/// [`KvMemory`] before the call.
pub trait DeviceAccess: Send + Sync {
    /// Copies `out.len()` bytes at `offset` of the device memory into `out`.
    ///
    /// # Errors
    /// The device's, in words (a revoked lease included).
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String>;
    /// Copies `data` into the device memory at `offset`.
    ///
    /// # Errors
    /// As [`DeviceAccess::read`].
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), String>;
}

/// The owner's promise that device memory still exists: each copy holds the lease shared while
/// it runs, and the owner [`revoke`](MemoryLease::revoke)s it (waiting for copies in progress)
/// before freeing the memory; copies after that fail.
#[derive(Debug)]
pub struct MemoryLease(RwLock<bool>);

impl Default for MemoryLease {
    fn default() -> Self {
        Self(RwLock::new(true))
    }
}

impl MemoryLease {
    /// A live lease.
    pub fn new() -> Self {
        Self::default()
    }

    /// Holds the lease for one copy; `Err` once revoked.
    ///
    /// # Errors
    /// The memory is gone, in words.
    pub fn hold(&self) -> Result<RwLockReadGuard<'_, bool>, String> {
        let g = self.0.read().unwrap_or_else(|p| p.into_inner());
        if *g {
            Ok(g)
        } else {
            Err("the device memory was freed (its engine stopped)".into())
        }
    }

    /// Ends the lease, after every copy holding it has returned.
    pub fn revoke(&self) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = false;
    }
}

/// [`DeviceAccess`] to host memory someone else owns and frees (the pool of the GPU pass on
/// its CPU twins): plain copies at `ptr`, each under the owner's lease.
pub struct LeasedHost {
    ptr: NonNull<u8>,
    lease: std::sync::Arc<MemoryLease>,
}

// SAFETY: a base pointer used only under the lease, by the pinning contract (module docs).
unsafe impl Send for LeasedHost {}
// SAFETY: as above.
unsafe impl Sync for LeasedHost {}

impl LeasedHost {
    /// Copies at `ptr` while `lease` is live.
    ///
    /// # Safety
    /// `ptr..ptr + len` of the [`KvMemory::staged`] made with this must be valid for reads and
    /// writes until `lease` is revoked, and accessed by others only under the pinning contract.
    pub unsafe fn new(ptr: NonNull<u8>, lease: std::sync::Arc<MemoryLease>) -> Self {
        Self { ptr, lease }
    }
}

impl DeviceAccess for LeasedHost {
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String> {
        let _held = self.lease.hold()?;
        // SAFETY: in bounds (checked by `KvMemory`); valid while the lease is held (`new`).
        unsafe { copy_out(self.ptr, offset, out) };
        Ok(())
    }

    fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
        let _held = self.lease.hold()?;
        // SAFETY: as in `read`.
        unsafe { copy_in(self.ptr, offset, data) };
        Ok(())
    }
}

/// Copies `out.len()` bytes at `base + offset` into `out`.
///
/// # Safety
/// The range must be valid for reads and not written meanwhile; `out` is a distinct buffer.
unsafe fn copy_out(base: NonNull<u8>, offset: usize, out: &mut [u8]) {
    // SAFETY: the caller's contract; `out` cannot overlap memory only reached by pointer.
    unsafe { std::ptr::copy_nonoverlapping(base.as_ptr().add(offset), out.as_mut_ptr(), out.len()) }
}

/// Copies `data` to `base + offset`.
///
/// # Safety
/// The range must be valid for writes and accessed by no one else meanwhile.
unsafe fn copy_in(base: NonNull<u8>, offset: usize, data: &[u8]) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base.as_ptr().add(offset), data.len()) }
}

/// How a [`KvMemory`]'s bytes are reached and freed.
enum Backing {
    /// A heap allocation, freed here.
    Heap,
    /// Host memory someone else allocated; their release runs once, on drop.
    External(Box<dyn FnOnce() + Send + Sync>),
    /// Memory reached only through copies (a device's); its owner frees it.
    Staged {
        kind: MemoryKind,
        access: Box<dyn DeviceAccess>,
    },
}

/// A KV pool's bytes: one allocation that never moves.
///
/// A zeroed, page-aligned heap allocation ([`KvMemory::zeroed`]), memory a transport
/// allocated and registered itself ([`KvMemory::external`]: UCX allocates shared memory that
/// peers on the same machine map directly), or memory reached only through copies
/// ([`KvMemory::staged`]: a GPU engine's pool, see "Memory kinds" in the module docs). Shared (`Arc`) between the engine
/// that computes in it and the transport that registered it, so that host memory outlives
/// every registration of it. See the module docs for who may access which bytes when.
pub struct KvMemory {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
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
            .field("kind", &self.kind())
            .field("external", &!matches!(self.backing, Backing::Heap))
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
    /// [`MemoryError::Layout`] when `len` is 0 or too large to allocate.
    pub fn zeroed(len: usize) -> Result<Self, MemoryError> {
        let layout = Layout::from_size_align(len.max(1), ALIGN)
            .map_err(|e| MemoryError::Layout(format!("{len} bytes: {e}")))?;
        if len == 0 {
            return Err(MemoryError::Layout("an empty region".into()));
        }
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| MemoryError::Layout(format!("cannot allocate {len} bytes")))?;
        Ok(Self {
            ptr,
            len,
            backing: Backing::Heap,
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
            backing: Backing::External(release),
            registered,
        }
    }

    /// Memory reached only through `access`: `len` bytes at address `addr` of a device's
    /// memory (`kind` [`MemoryKind::Cuda`]; UCX may register it as device memory), or of host
    /// memory that stands in for one (`kind` [`MemoryKind::Host`]: the GPU pass on its CPU
    /// twins; never registered with UCX). This process never dereferences `addr`. Dropping
    /// this frees nothing: the owner frees the memory, after revoking the [`MemoryLease`] its
    /// `access` holds.
    ///
    /// # Errors
    /// [`MemoryError::Layout`] for an empty region.
    pub fn staged(
        addr: NonNull<u8>,
        len: usize,
        kind: MemoryKind,
        access: Box<dyn DeviceAccess>,
    ) -> Result<Self, MemoryError> {
        if len == 0 {
            return Err(MemoryError::Layout("an empty region".into()));
        }
        Ok(Self {
            ptr: addr,
            len,
            backing: Backing::Staged { kind, access },
            registered: None,
        })
    }

    /// Whether the bytes are reached only through copies ([`KvMemory::staged`]), never at
    /// [`KvMemory::as_ptr`].
    pub fn is_staged(&self) -> bool {
        matches!(self.backing, Backing::Staged { .. })
    }

    /// Where the bytes live.
    pub fn kind(&self) -> MemoryKind {
        match &self.backing {
            Backing::Staged { kind, .. } => *kind,
            Backing::Heap | Backing::External(_) => MemoryKind::Host,
        }
    }

    /// The registration made with the allocation, if any.
    pub fn preregistered(&self) -> Option<&Preregistered> {
        self.registered.as_ref()
    }

    /// Base address (for staged memory a device's address: never dereference it then, see
    /// [`KvMemory::is_staged`]).
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
    /// [`MemoryError::OutOfRange`] when the range leaves the region.
    pub unsafe fn read_into(&self, offset: usize, out: &mut [u8]) -> Result<(), MemoryError> {
        self.check(offset, out.len())?;
        if let Backing::Staged { kind, access } = &self.backing {
            return access
                .read(offset, out)
                .map_err(|e| MemoryError::Backend(format!("{kind} read: {e}")));
        }
        // SAFETY: in bounds (checked); the caller guarantees no concurrent writer.
        unsafe { copy_out(self.ptr, offset, out) };
        Ok(())
    }

    /// Copies `data` in at `offset`.
    ///
    /// # Safety
    /// No one else may access these bytes during the call (the pinning contract).
    ///
    /// # Errors
    /// [`MemoryError::OutOfRange`] when the range leaves the region.
    pub unsafe fn write_from(&self, offset: usize, data: &[u8]) -> Result<(), MemoryError> {
        self.check(offset, data.len())?;
        if let Backing::Staged { kind, access } = &self.backing {
            return access
                .write(offset, data)
                .map_err(|e| MemoryError::Backend(format!("{kind} write: {e}")));
        }
        // SAFETY: in bounds (checked); the caller guarantees exclusive access to the range.
        unsafe { copy_in(self.ptr, offset, data) };
        Ok(())
    }

    /// Copies `len` bytes at `offset` into `dst` at `dst_offset`: one `memcpy` between two
    /// host memories, else through `scratch` (read, then write).
    ///
    /// # Safety
    /// As [`KvMemory::read_into`] for the source range and [`KvMemory::write_from`] for the
    /// destination range; the two ranges do not overlap.
    ///
    /// # Errors
    /// [`MemoryError::OutOfRange`] when a range leaves its region; a staged side's copy
    /// error.
    pub unsafe fn copy_to(
        &self,
        offset: usize,
        dst: &KvMemory,
        dst_offset: usize,
        len: usize,
        scratch: &mut Vec<u8>,
    ) -> Result<(), MemoryError> {
        self.check(offset, len)?;
        dst.check(dst_offset, len)?;
        if !self.is_staged() && !dst.is_staged() {
            // SAFETY: both ranges are in bounds (checked); the caller guarantees no concurrent
            // access and no overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr.as_ptr().add(offset),
                    dst.ptr.as_ptr().add(dst_offset),
                    len,
                );
            }
            return Ok(());
        }
        scratch.resize(len, 0);
        // SAFETY: as the caller guarantees.
        unsafe {
            self.read_into(offset, scratch)?;
            dst.write_from(dst_offset, scratch)
        }
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), MemoryError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(MemoryError::OutOfRange {
                offset: offset as u64,
                len: len as u64,
                region: self.len as u64,
            }),
        }
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.backing, Backing::Heap) {
            Backing::External(release) => release(),
            // The owner frees device memory.
            Backing::Staged { .. } => {}
            // SAFETY: allocated in `zeroed` with this size and alignment (checked there).
            Backing::Heap => unsafe {
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
    /// [`MemoryError::Layout`] when the two pools differ in layers or block bytes, or a block
    /// id is out of its pool.
    pub fn segments(
        &self,
        dst: &KvLayout,
        pairs: &[(u32, u32)],
    ) -> Result<Vec<Segment>, MemoryError> {
        if self.n_layers != dst.n_layers || self.block_bytes != dst.block_bytes {
            return Err(MemoryError::Layout(format!(
                "source has {} layers × {} B blocks, destination {} × {} B",
                self.n_layers, self.block_bytes, dst.n_layers, dst.block_bytes
            )));
        }
        if let Some(&(s, d)) = pairs
            .iter()
            .find(|&&(s, d)| s >= self.num_blocks || d >= dst.num_blocks)
        {
            return Err(MemoryError::Layout(format!(
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
            Err(MemoryError::Layout(_))
        ));
        assert!(matches!(
            L.segments(&L, &[(8, 0)]),
            Err(MemoryError::Layout(_))
        ));
        assert!(matches!(
            L.segments(&L, &[(0, 8)]),
            Err(MemoryError::Layout(_))
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
    fn staged_memory_is_reached_through_its_access_until_the_lease_ends() {
        let mut backing = vec![0u8; 256];
        let lease = std::sync::Arc::new(MemoryLease::new());
        let ptr = NonNull::new(backing.as_mut_ptr()).expect("non-null");
        // SAFETY: `backing` outlives every copy: the lease is revoked before it drops.
        let access = unsafe { LeasedHost::new(ptr, lease.clone()) };
        let m = KvMemory::staged(ptr, 256, MemoryKind::Host, Box::new(access)).expect("staged");
        assert!(m.is_staged());
        assert_eq!(m.kind(), MemoryKind::Host);
        // SAFETY: no one else uses these bytes meanwhile.
        unsafe {
            m.write_from(250, &[9; 6]).expect("in range");
            assert!(matches!(
                m.write_from(251, &[9; 6]),
                Err(MemoryError::OutOfRange { .. })
            ));
            let mut out = [0u8; 8];
            m.read_into(248, &mut out).expect("in range");
            assert_eq!(out, [0, 0, 9, 9, 9, 9, 9, 9]);
        }
        lease.revoke();
        // SAFETY: as above; the copies must now fail without touching the bytes.
        let err = unsafe { m.read_into(0, &mut [0u8; 4]) }.expect_err("revoked");
        assert!(err.to_string().contains("freed"), "{err}");
        assert!(unsafe { m.write_from(0, &[1; 4]) }.is_err());
        drop(m); // frees nothing: `backing` is still ours
        assert_eq!(backing[250], 9);
        assert!(KvMemory::staged(ptr, 0, MemoryKind::Host, Box::new(Dev::default())).is_err());
    }

    /// A device stand-in that owns its bytes and counts copies.
    #[derive(Default)]
    struct Dev {
        bytes: std::sync::Mutex<Vec<u8>>,
        copies: AtomicU64,
    }

    impl DeviceAccess for std::sync::Arc<Dev> {
        fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), String> {
            self.copies.fetch_add(1, Ordering::Relaxed);
            let b = self.bytes.lock().expect("lock");
            out.copy_from_slice(&b[offset..offset + out.len()]);
            Ok(())
        }
        fn write(&self, offset: usize, data: &[u8]) -> Result<(), String> {
            self.copies.fetch_add(1, Ordering::Relaxed);
            let mut b = self.bytes.lock().expect("lock");
            b[offset..offset + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    impl DeviceAccess for Dev {
        fn read(&self, _: usize, _: &mut [u8]) -> Result<(), String> {
            Err("no device".into())
        }
        fn write(&self, _: usize, _: &[u8]) -> Result<(), String> {
            Err("no device".into())
        }
    }

    #[test]
    fn device_memory_is_never_dereferenced_and_names_its_kind_in_errors() {
        let dev = std::sync::Arc::new(Dev {
            bytes: std::sync::Mutex::new(vec![0; 64]),
            ..Dev::default()
        });
        // An address nothing maps: a dereference would crash the test.
        let addr = NonNull::new(0x10 as *mut u8).expect("non-null");
        let kind = MemoryKind::Cuda { device: 3 };
        let m = KvMemory::staged(addr, 64, kind, Box::new(dev.clone())).expect("staged");
        assert_eq!((m.kind(), m.as_ptr() as usize), (kind, 0x10));
        // SAFETY: the stand-in owns its bytes.
        unsafe {
            m.write_from(8, &[5; 8]).expect("write");
            let mut out = [0u8; 16];
            m.read_into(0, &mut out).expect("read");
            assert_eq!(&out[8..], &[5; 8]);
        }
        assert_eq!(dev.copies.load(Ordering::Relaxed), 2);
        let failing = KvMemory::staged(addr, 64, kind, Box::new(Dev::default())).expect("staged");
        // SAFETY: as above.
        let e = unsafe { failing.read_into(0, &mut [0u8; 4]) }.expect_err("fails");
        assert_eq!(e.to_string(), "backend: cuda:3 read: no device");
        assert_eq!(
            serde_json::to_string(&kind).expect("json"),
            r#"{"kind":"cuda","device":3}"#
        );
    }

    #[test]
    fn epochs_grow() {
        let a = next_epoch();
        let b = next_epoch();
        assert!(b > a && a > 1_600_000_000_000_000);
    }
}
