//! Paged KV memory of one device.
//!
//! Per layer, one K pool and one V pool, each a contiguous f32 array shaped
//! `[num_blocks, block_size, n_kv_heads, head_dim]`. A block is therefore one addressable
//! region per layer and per pool: [`KvCache::block_byte_range`] gives its byte range inside the
//! pool, and [`KvCache::pool_bytes`] the pool's bytes, so a transport can register the pools
//! and move blocks by offset. Which block belongs to which sequence is decided outside (block
//! tables); this type only stores values.

use std::ops::Range;

use crate::runtime::ids::BlockId;

/// Default tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Which of a layer's two pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPool {
    K,
    V,
}

/// K and V pools of one layer, each `[num_blocks, block_size, n_kv_heads, head_dim]` f32.
#[derive(Debug, Clone)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// All layers' pools plus their geometry.
#[derive(Debug, Clone)]
pub struct KvCache {
    pub num_blocks: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub layers: Vec<LayerKv>,
}

impl KvCache {
    /// Allocates zeroed pools (`2 · n_layers · num_blocks · block_elems()` f32 in total).
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        let n = num_blocks * block_size * n_kv_heads * head_dim;
        let layers = (0..n_layers)
            .map(|_| LayerKv {
                k: vec![0.0; n],
                v: vec![0.0; n],
            })
            .collect();
        Self {
            num_blocks,
            block_size,
            n_kv_heads,
            head_dim,
            layers,
        }
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
        2 * self.layers.len() * self.num_blocks * self.block_bytes()
    }

    /// Byte range of `block` inside any one layer's K or V pool (the same for all pools).
    /// `None` if the block id is out of range.
    pub fn block_byte_range(&self, block: BlockId) -> Option<Range<usize>> {
        let b = block.0 as usize;
        (b < self.num_blocks).then(|| b * self.block_bytes()..(b + 1) * self.block_bytes())
    }

    /// The raw bytes of one pool of one layer (for registration with a transport).
    pub fn pool_bytes(&self, layer: usize, pool: KvPool) -> Option<&[u8]> {
        let l = self.layers.get(layer)?;
        Some(bytemuck::cast_slice(match pool {
            KvPool::K => &l.k,
            KvPool::V => &l.v,
        }))
    }

    /// Values of one block (`[block_size, n_kv_heads, head_dim]` f32).
    pub fn block(&self, layer: usize, pool: KvPool, block: BlockId) -> Option<&[f32]> {
        let (n, b) = (self.block_elems(), block.0 as usize);
        let l = self.layers.get(layer)?;
        let p = match pool {
            KvPool::K => &l.k,
            KvPool::V => &l.v,
        };
        p.get(b * n..(b + 1) * n)
    }

    /// Mutable values of one block (e.g. to receive a transferred block).
    pub fn block_mut(&mut self, layer: usize, pool: KvPool, block: BlockId) -> Option<&mut [f32]> {
        let (n, b) = (self.block_elems(), block.0 as usize);
        let l = self.layers.get_mut(layer)?;
        let p = match pool {
            KvPool::K => &mut l.k,
            KvPool::V => &mut l.v,
        };
        p.get_mut(b * n..(b + 1) * n)
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
