//! Paged KV memory of one device.
//!
//! Per layer, one K pool and one V pool, each `[num_blocks, block_size, n_kv_heads, head_dim]`
//! f32, all in one [`KvMemory`] allocation laid out `[layer][K, V][block]`
//! ([`KvCache::layout`], the transport's [`KvLayout`]): a transport registers the whole cache
//! once and moves a block as `2 · n_layers` runs at computed offsets. Which block belongs to
//! which sequence is decided outside (block tables); this type only stores values.
//!
//! The memory may be shared with a transport (`Arc<KvMemory>`), which reads and writes only
//! blocks the block manager pinned for a transfer (see `kv/memory.rs`); this type is
//! the only one that makes Rust references into it, and only through `&self` / `&mut self`.

use std::ops::Range;
use std::sync::Arc;

use crate::kv::memory::{KvLayout, KvMemory};
use crate::runtime::ids::BlockId;

/// Default tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Which of a layer's two pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPool {
    K,
    V,
}

/// Why a cache cannot be made.
#[derive(Debug, thiserror::Error)]
#[error("kv cache: {0}")]
pub struct KvCacheError(String);

/// All layers' pools plus their geometry.
#[derive(Debug)]
pub struct KvCache {
    pub num_blocks: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    n_layers: usize,
    memory: Arc<KvMemory>,
}

impl KvCache {
    /// Allocates zeroed pools (`2 · n_layers · num_blocks · block_elems()` f32 in total) on
    /// the heap.
    ///
    /// # Panics
    /// When the allocation fails or is empty (as `vec!` would).
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        let bytes = 2 * n_layers * num_blocks * block_size * n_kv_heads * head_dim * 4;
        #[allow(clippy::expect_used)]
        let memory = KvMemory::zeroed(bytes).expect("KV cache allocation");
        Self::with_memory(
            n_layers,
            n_kv_heads,
            head_dim,
            num_blocks,
            block_size,
            Arc::new(memory),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Pools in `memory` (e.g. allocated by a transport), which must hold at least the
    /// geometry's bytes and be 4-byte aligned.
    ///
    /// # Errors
    /// [`KvCacheError`] when `memory` is too small or misaligned, or reached only through
    /// copies ([`KvMemory::is_staged`]: a device's).
    pub fn with_memory(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        block_size: usize,
        memory: Arc<KvMemory>,
    ) -> Result<Self, KvCacheError> {
        let need = 2 * n_layers * num_blocks * block_size * n_kv_heads * head_dim * 4;
        if memory.is_staged() {
            return Err(KvCacheError(format!(
                "{} memory is reached through copies, not host pools",
                memory.kind()
            )));
        }
        if memory.len() < need
            || !(memory.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>())
        {
            return Err(KvCacheError(format!(
                "{} bytes at {:p} for {need} bytes of f32 pools",
                memory.len(),
                memory.as_ptr()
            )));
        }
        Ok(Self {
            num_blocks,
            block_size,
            n_kv_heads,
            head_dim,
            n_layers,
            memory,
        })
    }

    /// Layers.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// The transport's view of this cache's geometry.
    pub fn layout(&self) -> KvLayout {
        KvLayout {
            n_layers: self.n_layers as u32,
            num_blocks: self.num_blocks as u32,
            block_bytes: self.block_bytes() as u64,
        }
    }

    /// The memory (to register it with a transport).
    pub fn memory(&self) -> &Arc<KvMemory> {
        &self.memory
    }

    /// f32 values in one block of one pool: `block_size · n_kv_heads · head_dim`.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Bytes of one block of one pool of one layer.
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * std::mem::size_of::<f32>()
    }

    /// Bytes of all pools of all layers.
    pub fn total_bytes(&self) -> usize {
        2 * self.n_layers * self.num_blocks * self.block_bytes()
    }

    /// Elements of one pool of one layer.
    fn pool_elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// Byte range of `block` inside any one layer's K or V pool (the same for all pools).
    /// `None` if the block id is out of range.
    pub fn block_byte_range(&self, block: BlockId) -> Option<Range<usize>> {
        let b = block.0 as usize;
        (b < self.num_blocks).then(|| b * self.block_bytes()..(b + 1) * self.block_bytes())
    }

    /// One pool of one layer, all blocks.
    pub fn pool(&self, layer: usize, pool: KvPool) -> Option<&[f32]> {
        (layer < self.n_layers).then(|| {
            let start = (2 * layer + pool as usize) * self.pool_elems();
            // SAFETY: in bounds (checked in `with_memory`), f32-aligned, and no `&mut` into the
            // memory exists while `&self` is borrowed; the transport writes only blocks that
            // are pinned for a transfer and not read by the engine meanwhile (module docs).
            unsafe {
                std::slice::from_raw_parts(
                    (self.memory.as_ptr() as *const f32).add(start),
                    self.pool_elems(),
                )
            }
        })
    }

    /// Both pools of one layer, mutable (the forward pass writes new K/V rows, then attends).
    pub fn layer_mut(&mut self, layer: usize) -> Option<(&mut [f32], &mut [f32])> {
        (layer < self.n_layers).then(|| {
            let n = self.pool_elems();
            let base = (2 * layer) * n;
            // SAFETY: in bounds (checked in `with_memory`), f32-aligned; the two slices are
            // disjoint (K then V); `&mut self` makes them the only references into the memory
            // (the transport's raw accesses touch only pinned blocks, module docs).
            unsafe {
                let p = (self.memory.as_ptr() as *mut f32).add(base);
                (
                    std::slice::from_raw_parts_mut(p, n),
                    std::slice::from_raw_parts_mut(p.add(n), n),
                )
            }
        })
    }

    /// The raw bytes of one pool of one layer.
    pub fn pool_bytes(&self, layer: usize, pool: KvPool) -> Option<&[u8]> {
        self.pool(layer, pool).map(bytemuck::cast_slice)
    }

    /// Values of one block (`[block_size, n_kv_heads, head_dim]` f32).
    pub fn block(&self, layer: usize, pool: KvPool, block: BlockId) -> Option<&[f32]> {
        let (n, b) = (self.block_elems(), block.0 as usize);
        self.pool(layer, pool)?.get(b * n..(b + 1) * n)
    }

    /// Mutable values of one block (e.g. to receive a transferred block).
    pub fn block_mut(&mut self, layer: usize, pool: KvPool, block: BlockId) -> Option<&mut [f32]> {
        let (n, b) = (self.block_elems(), block.0 as usize);
        let (k, v) = self.layer_mut(layer)?;
        match pool {
            KvPool::K => k,
            KvPool::V => v,
        }
        .get_mut(b * n..(b + 1) * n)
    }

    /// Element offset of (block, slot) in a pool; the `n_kv_heads · head_dim` values follow.
    pub fn slot_offset(&self, block: BlockId, slot: usize) -> usize {
        (block.0 as usize * self.block_size + slot) * self.n_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_sit_where_the_transport_layout_says() {
        let mut kv = KvCache::new(2, 3, 4, 5, 16);
        let l = kv.layout();
        assert_eq!(l.region_bytes() as usize, kv.total_bytes());
        kv.block_mut(1, KvPool::V, BlockId(3))
            .expect("block")
            .fill(2.5);
        let mut out = vec![0u8; kv.block_bytes()];
        // SAFETY: nothing else touches the memory.
        unsafe {
            kv.memory()
                .read_into(l.offset(1, 1, 3) as usize, &mut out)
                .expect("in range")
        };
        let vals: &[f32] = bytemuck::cast_slice(&out);
        assert!(vals.iter().all(|&x| x == 2.5));
        assert!(KvCache::with_memory(2, 3, 4, 6, 16, kv.memory().clone()).is_err());
    }

    #[test]
    fn block_ranges_tile_the_pool() {
        let mut kv = KvCache::new(2, 3, 4, 5, 16);
        assert_eq!(kv.block_bytes(), 16 * 3 * 4 * 4);
        assert_eq!(kv.block_byte_range(BlockId(2)), Some(2 * 768..3 * 768));
        assert_eq!(kv.block_byte_range(BlockId(5)), None);
        kv.block_mut(1, KvPool::V, BlockId(4))
            .expect("block")
            .fill(1.0);
        let bytes = kv.pool_bytes(1, KvPool::V).expect("pool");
        assert_eq!(bytes.len(), 5 * 768);
        assert!(
            bytes[4 * 768..].iter().any(|&b| b != 0) && bytes[..4 * 768].iter().all(|&b| b == 0)
        );
    }
}
