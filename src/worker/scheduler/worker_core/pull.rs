//! [`Pulls`]: the pulls of remote KV a replica runs — a disaggregated decode's pull of its
//! prefill worker's blocks, or a peer pull of a prefix another replica pinned.
//!
//! [`Pulls::start`] turns the batch former's [`PullOrder`] and the hand-off's [`RemoteKv`]
//! into a [`PullJob`] for the driver: through the node's transport, modelled on a simulated
//! engine, or failed at once (the sequence then recomputes). The pull must end before the
//! holder's hold does, less a margin. A pull in flight is kept until it returns even when its
//! sequence is gone, since the transport still writes its blocks and the holder must still be
//! told to release them ([`Pulls::returned`]). Returned pulls are measured: bytes moved, and
//! the time per block that the peer-pull cost rule uses.

use std::collections::HashMap;
use std::time::Duration;

use super::{RequestKey, WorkerCoreConfig};
use crate::request_plane::protocol::RemoteKv;
use crate::runtime::clock::Instant;
use crate::runtime::ids::{NodeId, SeqId, WorkerId};
use crate::transport::RegionDescriptor;
use crate::worker::scheduler::{PullOrder, PullResult};

/// How a pull is carried out.
#[derive(Clone, Debug, PartialEq)]
pub enum PullWork {
    /// It cannot be: answer [`WorkerCore::pull_done`](super::WorkerCore::pull_done) with this
    /// error at once.
    Fail(String),
    /// Through the node's transport: these `(remote, local)` block pairs from `from`, within
    /// `budget`.
    Transport {
        from: RegionDescriptor,
        pairs: Vec<(u32, u32)>,
        budget: Duration,
    },
    /// Simulated: the transfer takes `time`; one longer than `budget` fails when the budget
    /// runs out, as a real pull times out ([`PullWork::simulated`]).
    Sim { time: Duration, budget: Duration },
}

impl PullWork {
    /// A simulated pull of `blocks` blocks: when it ends (after its modelled time, or at its
    /// budget) and its outcome. `None` for other kinds of work.
    pub fn simulated(&self, blocks: usize) -> Option<(Duration, Result<usize, String>)> {
        let PullWork::Sim { time, budget } = self else {
            return None;
        };
        Some(if time <= budget {
            (*time, Ok(blocks))
        } else {
            (
                *budget,
                Err(format!(
                    "the modelled transfer ({} ms) exceeds its time limit ({} ms)",
                    time.as_millis(),
                    budget.as_millis()
                )),
            )
        })
    }
}

/// A pull to start; its result comes back through
/// [`WorkerCore::pull_done`](super::WorkerCore::pull_done).
#[derive(Clone, Debug, PartialEq)]
pub struct PullJob {
    pub seq: SeqId,
    /// The worker read from (a prefill worker, or a peer holding the prefix).
    pub from: Option<WorkerId>,
    /// Blocks it brings.
    pub blocks: usize,
    pub work: PullWork,
}

/// A pull in flight.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct InFlight {
    /// Whom to tell to release the blocks when it returns, and under which key they are held.
    pub confirm: (WorkerId, RequestKey),
    /// A peer pull (else a disaggregated decode's).
    pub peer: bool,
    /// When it started and how many blocks it brings (a pull that fails at once has none).
    started: Option<(Instant, usize)>,
}

/// The pulls of one replica (see the module doc).
#[derive(Debug, Default)]
pub(super) struct Pulls {
    in_flight: HashMap<SeqId, InFlight>,
    /// Measured pull time per block (ms, moving average), once a pull landed.
    block_ms: Option<f64>,
    /// Blocks brought by disaggregated pulls, since start.
    pub blocks_pulled: u64,
    /// Disaggregated pulls that failed (their sequences recomputed), since start.
    pub fallbacks: u64,
    /// Bytes the transport moved into this replica (every pull's, since start).
    pub bytes: u64,
}

impl Pulls {
    /// The pull of `order`'s blocks from `kv`, the KV its sequence was submitted with
    /// (`None`: nothing to pull from, the pull fails at once). `owner` is the sequence's
    /// gateway node (the holder keeps the blocks under that node's request key); `peer`
    /// says whether a peer pinned them.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        cfg: &WorkerCoreConfig,
        order: &PullOrder,
        kv: Option<RemoteKv>,
        owner: &NodeId,
        peer: bool,
        now: Instant,
        wall_ms: u64,
    ) -> PullJob {
        let (seq, n) = (order.seq, order.blocks.len());
        let Some(kv) = kv else {
            return PullJob {
                seq,
                from: None,
                blocks: n,
                work: PullWork::Fail("no remote KV".into()),
            };
        };
        let pairs: Vec<(u32, u32)> = order
            .blocks
            .iter()
            .filter_map(|&(i, b)| kv.blocks.get(i).map(|&r| (r, b.0)))
            .collect();
        // The pull must end before the holder's hold does (its clock; the nodes' clocks are
        // assumed within `hold_margin` of each other).
        let d = cfg.disagg;
        let left_ms = kv
            .held_until_ms
            .saturating_sub(wall_ms)
            .saturating_sub(d.hold_margin.as_millis() as u64);
        let budget = d.transfer_timeout.min(Duration::from_millis(left_ms));
        let work = if pairs.len() != n {
            PullWork::Fail(format!(
                "the hand-off names {} blocks; {n} needed",
                kv.blocks.len()
            ))
        } else if budget.is_zero() {
            PullWork::Fail("the prefill worker's hold ends too soon".into())
        } else {
            match (kv.region, cfg.has_transport, cfg.sim_transfer) {
                (Some(from), true, _) => PullWork::Transport {
                    from,
                    pairs,
                    budget,
                },
                (None, _, Some(sim)) => PullWork::Sim {
                    time: sim.time(n, cfg.block_size),
                    budget,
                },
                _ => PullWork::Fail("no transport to pull the KV with".into()),
            }
        };
        let started = (!matches!(work, PullWork::Fail(_))).then_some((now, n));
        self.in_flight.insert(
            seq,
            InFlight {
                confirm: (kv.worker.clone(), (owner.clone(), kv.request)),
                peer,
                started,
            },
        );
        PullJob {
            seq,
            from: Some(kv.worker),
            blocks: n,
            work,
        }
    }

    /// A pull returned at `now`: its bytes and (when it landed) its time per block are
    /// measured, a disaggregated pull's outcome is counted, and the pull is forgotten. Its
    /// record, when one was kept (whom to confirm to, whether a peer's).
    pub fn returned(
        &mut self,
        worker: &WorkerId,
        r: &PullResult,
        now: Instant,
    ) -> Option<InFlight> {
        self.bytes += r.bytes;
        let f = self.in_flight.remove(&r.seq);
        if let (Some((at, n)), Ok(_)) = (f.as_ref().and_then(|f| f.started), &r.outcome)
            && n > 0
        {
            // The measured time per block, a moving average (the cost rule's pull estimate).
            let ms = now.saturating_duration_since(at).as_secs_f64() * 1e3 / n as f64;
            self.block_ms = Some(self.block_ms.map_or(ms, |m| 0.8 * m + 0.2 * ms));
        }
        if f.as_ref().is_some_and(|f| f.peer) {
            return f;
        }
        let w = worker.to_string();
        match &r.outcome {
            Ok(blocks) => {
                self.blocks_pulled += *blocks as u64;
                metrics::counter!("flotilla_disagg_pulled_blocks_total", "worker" => w)
                    .increment(*blocks as u64);
            }
            Err(why) => {
                self.fallbacks += 1;
                metrics::counter!("flotilla_disagg_pull_fallbacks_total", "worker" => w)
                    .increment(1);
                tracing::warn!(%worker, seq = %r.seq, %why, "KV pull failed; recomputing the prompt here");
            }
        }
        f
    }

    /// The measured pull time per block (ms), once a pull landed.
    pub fn block_ms(&self) -> Option<f64> {
        self.block_ms
    }
}

#[cfg(test)]
mod tests;
