//! [`KvFill`]: chaos `fill_kv` as a holder of blocks beside the batch former.
//!
//! While a `fill_kv` fault holds a worker, its pool loses a fraction of its blocks to a
//! phantom sequence ([`FILL_SEQ`]) that the batch former never sees, so admission, preemption
//! and shedding meet a fuller pool through the pool's ordinary accounting. The blocks are
//! taken through the pool API only: free or evictable ones, never registered (the phantom
//! sequence is never computed), under token ids above any vocabulary so that they never match
//! a real prefix.

use crate::kv::{BlockPool, PoolError, SeqLease};
use crate::runtime::ids::SeqId;

/// The phantom sequence that holds the blocks (the batch former numbers its sequences from 1).
pub const FILL_SEQ: SeqId = SeqId(u64::MAX);

/// What [`KvFill::apply`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillChange {
    /// Nothing: blocks are held and the fault lasts, or none are held and there is no fault.
    Unchanged,
    /// A fault asked for blocks and this many were taken (0 when none were free or
    /// evictable: the next apply tries again).
    Occupied(usize),
    /// The fault ended and the blocks went back to the pool.
    Released,
}

/// The blocks a `fill_kv` fault holds in one pool.
#[derive(Debug, Default)]
pub struct KvFill {
    lease: Option<SeqLease>,
}

impl KvFill {
    /// Whether blocks are held.
    pub fn is_holding(&self) -> bool {
        self.lease.is_some()
    }

    /// Brings the held blocks in line with the fault: `fraction` of the pool while a fault asks
    /// for it (taken once, when none are held), none once it ends.
    ///
    /// # Errors
    /// The pool's error if it refuses the allocation or the release (the pool is unchanged).
    pub fn apply(
        &mut self,
        fraction: Option<f64>,
        pool: &mut BlockPool,
    ) -> Result<FillChange, PoolError> {
        match fraction {
            Some(f) if self.lease.is_none() => {
                let want = (f * pool.num_blocks() as f64).round() as usize;
                self.occupy(want, pool).map(FillChange::Occupied)
            }
            None => match self.lease.take() {
                Some(lease) => pool.free(lease).map(|()| FillChange::Released),
                None => Ok(FillChange::Unchanged),
            },
            Some(_) => Ok(FillChange::Unchanged),
        }
    }

    /// Pins up to `blocks` unreferenced blocks (free or evictable); returns how many.
    fn occupy(&mut self, blocks: usize, pool: &mut BlockPool) -> Result<usize, PoolError> {
        let u = pool.usage();
        let n = blocks.min(u.free_blocks + u.cached_blocks);
        if n == 0 {
            return Ok(0);
        }
        // `n·block_size − 1` tokens + the slot for a first sampled token = exactly n blocks.
        let bs = pool.block_size();
        let tokens: Vec<u32> = (0..(n * bs - 1) as u32).map(|i| 0xF000_0000 | i).collect();
        let alloc = pool.allocate_sequence(FILL_SEQ, &tokens)?;
        self.lease = Some(alloc.lease);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> BlockPool {
        BlockPool::new(10, 4, 7).expect("pool")
    }

    #[test]
    fn a_fault_holds_its_fraction_until_it_ends() {
        let mut p = pool();
        let mut fill = KvFill::default();
        assert_eq!(fill.apply(None, &mut p), Ok(FillChange::Unchanged));
        assert_eq!(fill.apply(Some(0.66), &mut p), Ok(FillChange::Occupied(7)));
        assert!(fill.is_holding());
        assert_eq!(p.usage().free_blocks, 3);
        // Taken once: a lasting fault changes nothing, whatever its fraction now.
        assert_eq!(fill.apply(Some(1.0), &mut p), Ok(FillChange::Unchanged));
        assert_eq!(p.usage().free_blocks, 3);
        assert_eq!(fill.apply(None, &mut p), Ok(FillChange::Released));
        assert!(!fill.is_holding());
        assert_eq!(p.usage().free_blocks, 10);
    }

    #[test]
    fn it_takes_only_what_is_unreferenced_and_retries_when_nothing_is() {
        let mut p = pool();
        let other = p
            .allocate_sequence(SeqId(1), &[1; 39])
            .expect("fill the pool");
        let mut fill = KvFill::default();
        assert_eq!(fill.apply(Some(0.5), &mut p), Ok(FillChange::Occupied(0)));
        assert!(
            !fill.is_holding(),
            "nothing held: the next apply tries again"
        );
        p.free(other.lease).expect("free");
        assert_eq!(fill.apply(Some(0.5), &mut p), Ok(FillChange::Occupied(5)));
        assert_eq!(fill.apply(None, &mut p), Ok(FillChange::Released));
    }
}
