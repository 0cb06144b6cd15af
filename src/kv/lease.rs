//! [`SeqLease`]: the value that stands for one sequence's blocks.
//!
//! The pool is plain code, so a lease cannot free its blocks by itself on drop. Instead the
//! pool and its leases share a *return queue* (`Arc<Mutex<Vec<SeqId>>>`): `BlockPool::free`
//! takes the lease back (disarming it); a lease dropped without being handed back pushes its
//! sequence id onto the queue, and the pool frees those sequences at the start of its next
//! mutating call (counting each one in `BlockPool::leaked_leases`). No path leaks a block.
//! The pool lives inside the replica's scheduler (synchronous, on the scheduling hot path),
//! so a queue drained by the pool's next call is all a dropped lease needs.

use std::sync::{Arc, Mutex};

use crate::runtime::ids::SeqId;

/// Shared queue of sequences whose lease was dropped without `BlockPool::free`.
pub(crate) type ReturnQueue = Arc<Mutex<Vec<SeqId>>>;

/// Proof of ownership of one sequence's blocks in one pool. Hand it back with
/// `BlockPool::free`; dropping it instead queues the release (see the module doc).
#[must_use = "a lease must be handed back with BlockPool::free (dropping it defers the release)"]
#[derive(Debug)]
pub struct SeqLease {
    seq: SeqId,
    returns: ReturnQueue,
    armed: bool,
}

impl SeqLease {
    pub(crate) fn new(seq: SeqId, returns: ReturnQueue) -> Self {
        Self {
            seq,
            returns,
            armed: true,
        }
    }

    /// The sequence this lease stands for.
    pub fn seq(&self) -> SeqId {
        self.seq
    }

    /// True when this lease was issued by the pool owning `returns`.
    pub(crate) fn belongs_to(&self, returns: &ReturnQueue) -> bool {
        Arc::ptr_eq(&self.returns, returns)
    }

    /// Consumes the lease without queuing a release (the pool frees the blocks itself).
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for SeqLease {
    fn drop(&mut self) {
        if self.armed {
            // A poisoned lock still holds a valid Vec: recover it rather than lose the release.
            let mut q = self.returns.lock().unwrap_or_else(|e| e.into_inner());
            q.push(self.seq);
        }
    }
}
