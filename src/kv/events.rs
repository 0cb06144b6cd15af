//! KV events: what a block pool tells the routers about the blocks it holds.
//!
//! Every event carries the worker, a per-pool event id (monotonic, starting at 1, no gaps) and
//! the tier. A consumer applies them in id order; [`EventReplay`] is the reference consumer
//! (a set of registered blocks) and reports a gap so the caller can ask for a snapshot.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::runtime::ids::{BlockHash, EventId, SequenceHash, WorkerId};

/// Storage tier of the blocks an event talks about (DESIGN.md §5: G1..G4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Accelerator memory (G1): the engine's pool.
    Device,
    /// Host memory (G2).
    Host,
    /// Local disk (G3).
    Disk,
    /// A remote node (G4).
    Remote,
}

/// One block inside a [`KvEventData::Stored`] chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StoredBlock {
    pub seq_hash: SequenceHash,
    pub block_hash: BlockHash,
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum KvEventData {
    /// A chain of blocks became reusable: `blocks[0]`'s parent is `parent` (`None` = root),
    /// `blocks[i]`'s parent is `blocks[i-1]`.
    Stored {
        parent: Option<SequenceHash>,
        blocks: Vec<StoredBlock>,
    },
    /// These blocks are no longer held.
    Removed { blocks: Vec<SequenceHash> },
    /// Every block of this worker and tier is gone (a `Stored` of survivors may follow).
    Cleared,
}

/// One KV event as published by a block pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    pub worker: WorkerId,
    pub event_id: EventId,
    pub tier: Tier,
    pub data: KvEventData,
}

/// One registered block as listed by a snapshot or held by a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SnapshotBlock {
    pub seq_hash: SequenceHash,
    pub parent: Option<SequenceHash>,
    pub block_hash: BlockHash,
}

/// Every registered block of a worker, as of `last_event`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvSnapshot {
    /// Worker.
    pub worker: WorkerId,
    /// Last event applied (`None` before the first).
    pub last_event: Option<EventId>,
    /// Registered blocks (G1), parents before children.
    pub blocks: Vec<SnapshotBlock>,
    /// The blocks of each lower tier (G2, G3) the worker holds, parents before children.
    #[serde(default)]
    pub lower: Vec<(Tier, Vec<SnapshotBlock>)>,
}

/// Errors of event consumers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// An event id was skipped or repeated: the consumer must resync (replay or snapshot).
    #[error("kv event gap: expected event {expected}, got {got}")]
    Gap { expected: EventId, got: EventId },
}

/// Reference consumer: applies events in order to a set of blocks per tier.
#[derive(Debug, Default, Clone)]
pub struct EventReplay {
    /// G1's blocks.
    blocks: HashMap<SequenceHash, SnapshotBlock>,
    /// The lower tiers' blocks.
    lower: HashMap<Tier, HashMap<SequenceHash, SnapshotBlock>>,
    last_event: Option<EventId>,
}

impl EventReplay {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event; an id that does not follow the previous one is rejected (state kept).
    ///
    /// # Errors
    /// [`EventError::Gap`] for an event whose id does not follow the previous one; the state
    /// is unchanged.
    pub fn apply(&mut self, ev: &KvEvent) -> Result<(), EventError> {
        let expected = EventId(self.last_event.map_or(1, |e| e.0 + 1));
        if ev.event_id != expected {
            return Err(EventError::Gap {
                expected,
                got: ev.event_id,
            });
        }
        self.last_event = Some(ev.event_id);
        let held = match ev.tier {
            Tier::Device => &mut self.blocks,
            tier => self.lower.entry(tier).or_default(),
        };
        match &ev.data {
            KvEventData::Stored { parent, blocks } => {
                let mut parent = *parent;
                for b in blocks {
                    held.insert(
                        b.seq_hash,
                        SnapshotBlock {
                            seq_hash: b.seq_hash,
                            parent,
                            block_hash: b.block_hash,
                        },
                    );
                    parent = Some(b.seq_hash);
                }
            }
            KvEventData::Removed { blocks: removed } => {
                for h in removed {
                    held.remove(h);
                }
            }
            KvEventData::Cleared => held.clear(),
        }
        Ok(())
    }

    /// The G1 blocks currently held, keyed by sequence hash.
    pub fn blocks(&self) -> &HashMap<SequenceHash, SnapshotBlock> {
        &self.blocks
    }

    /// The blocks `tier` currently holds, keyed by sequence hash.
    pub fn tier_blocks(&self, tier: Tier) -> Vec<SnapshotBlock> {
        match tier {
            Tier::Device => self.blocks.values().copied().collect(),
            t => self
                .lower
                .get(&t)
                .map(|m| m.values().copied().collect())
                .unwrap_or_default(),
        }
    }

    /// The id of the last applied event.
    pub fn last_event(&self) -> Option<EventId> {
        self.last_event
    }
}

/// `blocks` reordered so that each block's parent, when listed, comes before it (chains in
/// order of their smallest hash); what a snapshot must be for a consumer that links each block
/// to its parent.
pub fn parents_first(mut blocks: Vec<SnapshotBlock>) -> Vec<SnapshotBlock> {
    let index: HashMap<_, _> = blocks.iter().map(|b| (b.seq_hash, *b)).collect();
    let mut done = HashSet::new();
    let mut out = Vec::with_capacity(blocks.len());
    blocks.sort_by_key(|b| b.seq_hash);
    for b in &blocks {
        let mut chain = vec![*b];
        let mut cur = b.parent;
        while let Some(p) = cur {
            if done.contains(&p) {
                break;
            }
            match index.get(&p) {
                Some(pb) => {
                    chain.push(*pb);
                    cur = pb.parent;
                }
                None => break,
            }
        }
        for c in chain.into_iter().rev() {
            if done.insert(c.seq_hash) {
                out.push(c);
            }
        }
    }
    out
}
