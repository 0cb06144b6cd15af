//! [`EvictionPolicy`]: the order in which unreferenced registered blocks are evicted.

/// Eviction order among unreferenced registered blocks: LRU with a frequency bias.
///
/// Each release of a block to the evictable set takes the next tick of a logical clock (one
/// tick per released block, no wall clock). Its eviction key is
/// `tick + freq_bonus_ticks_per_hit * min(hits, max_counted_hits)`, where `hits` counts prefix
/// matches that reused the block; the smallest key is evicted first. A block reused `k` times
/// thus survives as if it had been released `k * bonus` ticks later. `lru()` disables the bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictionPolicy {
    pub freq_bonus_ticks_per_hit: u64,
    pub max_counted_hits: u32,
}

impl EvictionPolicy {
    /// Pure LRU.
    pub fn lru() -> Self {
        Self {
            freq_bonus_ticks_per_hit: 0,
            max_counted_hits: 0,
        }
    }

    /// Default bias: a hit is worth a quarter of the pool's turnover, at most 4 hits counted.
    pub fn for_pool(num_blocks: usize) -> Self {
        Self {
            freq_bonus_ticks_per_hit: (num_blocks as u64 / 4).max(1),
            max_counted_hits: 4,
        }
    }
}
