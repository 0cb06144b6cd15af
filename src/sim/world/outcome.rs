//! What a run gives: one [`SimRecord`] per request as a client measured it, the counts of what
//! happened ([`SimCounters`]), what is left over ([`SimLeftovers`], all 0 in a correct run),
//! and the final tally the fleet draws up when nothing is left to happen.

use std::time::Duration;

use crate::control::planner::Decision;
use crate::kv::BlockPool;
use crate::request_plane::events::FleetEventKind;
use crate::request_plane::router::core::RouterCore;
use crate::runtime::clock::Clock;
use crate::runtime::ids::{RequestId, WorkerId};
use crate::runtime::role::Role;

use super::planner::pool_order;
use super::{SimFleet, ms};

/// What one request gave, as a client would have measured it (times in ms from its send).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimRecord {
    pub session: usize,
    pub turn: usize,
    /// Sent at (s from the first arrival).
    pub sent_s: f64,
    pub ok: bool,
    pub error: Option<String>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub itl_ms: Vec<f64>,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: Option<u64>,
    /// Its priority class, resolved as a gateway resolves it (`None`: none configured).
    pub class: Option<String>,
}

/// Counts of what happened in a run.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SimCounters {
    /// Events taken from the heap.
    pub events: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Requests refused by admission (503).
    pub shed: u64,
    /// Placements (first attempts, migrations and hand-offs).
    pub placements: u64,
    /// Migrations.
    pub migrations: u64,
    /// Requests given up.
    pub gave_up: u64,
    /// Prefill hand-offs.
    pub hand_offs: u64,
    /// Workers killed, and restarted.
    pub kills: u64,
    pub restarts: u64,
    /// KV event batches dropped by a fault.
    pub kv_batches_dropped: u64,
    /// The lower KV tiers' counters, summed over the workers' last incarnations.
    pub kv_tiers: crate::kv::TierCounters,
    /// Peer pulls (G4), summed over the workers' last incarnations.
    pub peer_pulls: crate::worker::scheduler::PeerPullCounters,
    /// (worker, block, tier) entries on which the router's prefix index and the live
    /// workers' pools disagree once every KV event has arrived, over the workers whose event
    /// stream the index follows (a worker waiting for a resync is skipped: the simulator
    /// sends no snapshot).
    pub index_mismatches: usize,
}

/// What is left over at the end of a run: each should be 0 (conservation).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SimLeftovers {
    /// Requests that never ended (none finished, failed or was shed).
    pub unfinished: usize,
    /// Placements the router still counts.
    pub placed: usize,
    /// Sequences still live, waiting or held on workers.
    pub live_sequences: usize,
    /// KV blocks still pinned by sequences.
    pub pinned_blocks: usize,
    /// Attempts still listened for.
    pub listening: usize,
}

impl std::fmt::Display for SimLeftovers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} unfinished, {} placed, {} live sequences, {} pinned blocks, {} listened for",
            self.unfinished, self.placed, self.live_sequences, self.pinned_blocks, self.listening
        )
    }
}

/// A run's results.
#[derive(Clone, Debug, Default)]
pub struct SimOutcome {
    /// One record per request sent (or skipped), in order of completion.
    pub records: Vec<SimRecord>,
    /// Simulated time from the first arrival to the last completion.
    pub span: Duration,
    pub counters: SimCounters,
    pub leftovers: SimLeftovers,
    /// The fleet events the live fleet's bus would carry, with their time (ms from the start).
    pub fleet_events: Vec<(f64, FleetEventKind)>,
    /// Replica-seconds per pool, from time 0 to the last completion (a replica counts from
    /// the moment it is asked for, through its cold start, to the end of its drain).
    pub replica_seconds: Vec<(Role, f64)>,
    /// The planner's decisions, one per interval.
    pub decisions: Vec<Decision>,
    /// Most replicas each pool had at once (ready, starting or draining).
    pub peak_replicas: Vec<(Role, u32)>,
}

/// Entries on which `index` and `pool` disagree for `worker`: blocks one holds in a tier and
/// the other does not.
fn index_mismatches(
    index: &crate::request_plane::router::index::PrefixIndex,
    worker: &WorkerId,
    pool: &BlockPool,
) -> usize {
    use crate::kv::Tier;
    use std::collections::HashSet;
    if index.is_pending(worker) {
        // Waiting for a snapshot (a restarted worker's events begin again at 1); the
        // simulator sends none, so its old contents stay visible, as documented.
        return 0;
    }
    let held: HashSet<(crate::runtime::ids::SequenceHash, Tier)> = index
        .held_by(worker)
        .into_iter()
        .flat_map(|(h, tiers)| tiers.tiers().map(move |t| (h, t)))
        .collect();
    let pools: HashSet<_> = [Tier::Device, Tier::Host, Tier::Disk]
        .into_iter()
        .flat_map(|t| {
            pool.snapshot_tier(t)
                .into_iter()
                .map(move |b| (b.seq_hash, t))
        })
        .collect();
    held.symmetric_difference(&pools).count()
}

impl<'w> SimFleet<'w> {
    pub(super) fn finish(mut self) -> SimOutcome {
        let now = self.clock.now();
        let unfinished: Vec<RequestId> = {
            let mut ids: Vec<RequestId> = self.requests.keys().copied().collect();
            ids.sort();
            ids
        };
        self.out.leftovers.unfinished = unfinished.len();
        for rid in unfinished {
            if let Some(r) = self.requests.remove(&rid) {
                let mut rec = r.record;
                rec.error = Some("never finished: nothing was left to happen".into());
                rec.e2e_ms = ms(now - r.sent);
                self.out.records.push(rec);
            }
        }
        self.out.leftovers.placed = self.routers.iter().map(RouterCore::placed).sum();
        self.out.leftovers.listening = self.listening.len();
        for w in &self.workers {
            if let Some(core) = &w.core {
                let s = core.stats();
                self.out.leftovers.live_sequences += core.num_live() + s.held;
                self.out.leftovers.pinned_blocks += s.kv_blocks_used;
                self.out.counters.peer_pulls += s.peer_pulls;
                let pool = core.pool();
                if let Some(t) = pool.tier_usage() {
                    let (sum, c) = (&mut self.out.counters.kv_tiers, t.counters);
                    sum.offloads += c.offloads;
                    sum.offload_drops += c.offload_drops;
                    sum.demotions += c.demotions;
                    sum.onboards_host += c.onboards_host;
                    sum.onboards_disk += c.onboards_disk;
                    sum.copy_failures += c.copy_failures;
                    sum.corrupt += c.corrupt;
                }
                for r in &self.routers {
                    self.out.counters.index_mismatches += index_mismatches(r.index(), &w.id, pool);
                }
            }
        }
        let end = self.last_completion.unwrap_or(now);
        for i in 0..self.workers.len() {
            self.account(i, end);
        }
        let mut rs: Vec<(Role, f64)> = self.replica_seconds.iter().map(|(r, s)| (*r, *s)).collect();
        rs.sort_by_key(|(r, _)| pool_order(*r));
        self.out.replica_seconds = rs;
        self.out.span = match (self.first_arrival, self.last_completion) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        self.out
    }

    pub(super) fn fleet_event(&mut self, ev: FleetEventKind) {
        match &ev {
            FleetEventKind::Placed { .. } => self.out.counters.placements += 1,
            FleetEventKind::Migrated { .. } => self.out.counters.migrations += 1,
            FleetEventKind::GaveUp { .. } => self.out.counters.gave_up += 1,
            FleetEventKind::HandedOff { .. } => self.out.counters.hand_offs += 1,
            _ => {}
        }
        let t = self.since_start_ms();
        self.out.fleet_events.push((t, ev));
    }
}
