//! [`PeerPulls`]: peer pulls on both sides — a replica asking a peer that holds a request's
//! prefix in G1 to pin it ([`PeerPulls::plan`], [`PeerPulls::ask`]), and the holder pinning
//! it for the peer ([`PeerPulls::export`]) until the peer confirms or the hold ends.
//!
//! The cost rule ([`PeerPulls::plan`]): a hint is acted on only when at least one whole
//! block is to be gained over what this pool caches, and the pull's estimated time (a fixed
//! cost plus the measured — or prior — time per block) is below the prefill's predicted by
//! the step-time model (`docs/routing.md`, "Peer pulls"). Every ask ends as pulled, failed or
//! moot ([`PeerPullCounters`]); a failed one recomputes the prefix, so it costs time, never
//! the request.

use std::collections::HashMap;
use std::time::Duration;

use super::RequestKey;
use crate::kv::{BlockPool, PeerPullCounters, SeqLease};
use crate::request_plane::protocol::{FetchHint, RemoteKv, SubmitRequest};
use crate::runtime::clock::Instant;
use crate::runtime::ids::{SeqId, WorkerId};
use crate::transport::RegionDescriptor;
use crate::worker::scheduler::{PeerPullWorker, StepCost, StepShape};

/// A submission waiting for its holder's answer to an ask.
pub(super) struct Fetching {
    pub req: SubmitRequest,
    pub holder: WorkerId,
}

/// Blocks pinned here for a peer to pull (holder side).
struct Export {
    lease: SeqLease,
    until: Instant,
}

/// What a replica's peer pulls need of its configuration.
#[derive(Clone, Copy, Debug)]
pub(super) struct PeerSetting {
    /// `None`: peer pulls are off here (hints are ignored).
    pub pull: Option<PeerPullWorker>,
    /// Whether this replica can pull at all (a transport, or a simulated engine's model).
    pub can_pull: bool,
    /// Tokens per KV block.
    pub block_size: usize,
    /// How long a holder keeps a prefix pinned without a confirmation.
    pub hold: Duration,
}

/// One replica's peer pulls (see the module doc).
pub(super) struct PeerPulls {
    worker: WorkerId,
    set: PeerSetting,
    pub counters: PeerPullCounters,
    /// Submissions waiting for their holder's answer.
    fetching: HashMap<RequestKey, Fetching>,
    /// Holder side: prefixes pinned for peers, by the puller's request key.
    exports: HashMap<RequestKey, Export>,
}

impl PeerPulls {
    pub fn new(worker: WorkerId, set: PeerSetting) -> Self {
        Self {
            worker,
            set,
            counters: PeerPullCounters::default(),
            fetching: HashMap::new(),
            exports: HashMap::new(),
        }
    }

    fn count(&self, outcome: &'static str) {
        metrics::counter!("flotilla_kv_peer_pulls_total", "worker" => self.worker.to_string(), "outcome" => outcome)
            .increment(1);
    }

    /// What to ask the holder of `hint` for, and within how long — or `None` when the hint is
    /// not worth acting on: peer pulls off here, no way to pull, the holder is this worker,
    /// less than one block to gain over `pool`'s cached lead, or the cost rule (`cost`: the
    /// step-time model's fit, `block_ms`: the measured pull time per block).
    pub fn plan(
        &mut self,
        hint: &FetchHint,
        prompt: &[u32],
        pool: &BlockPool,
        cost: Option<StepCost>,
        block_ms: Option<f64>,
    ) -> Option<(Vec<u32>, Duration)> {
        let pp = self.set.pull?;
        if hint.holder == self.worker || !self.set.can_pull {
            return None;
        }
        let bs = self.set.block_size.max(1);
        // Never the last token (the engine computes at least one), full blocks only.
        let whole = prompt.len().saturating_sub(1) / bs * bs;
        let want = (hint.blocks as usize * bs).min(whole);
        let local = pool.cached_lead(prompt);
        if want < local + bs {
            return None;
        }
        let gain = want - local;
        let pull_ms = pp.fixed_ms + block_ms.unwrap_or(pp.prior_block_ms) * (gain / bs) as f64;
        let prefill_ms = cost.map(|c| c.predict_ms(StepShape::of([(local, gain)])) - c.base_ms);
        if prefill_ms.is_some_and(|p| pull_ms >= p) {
            self.counters.declined += 1;
            self.count("declined");
            return None;
        }
        Some((prompt[..want].to_vec(), pp.ask_timeout))
    }

    /// `req` waits for `holder`'s answer to the ask for its prefix.
    pub fn ask(&mut self, key: RequestKey, req: SubmitRequest, holder: WorkerId) {
        self.counters.asked += 1;
        self.count("asked");
        self.fetching.insert(key, Fetching { req, holder });
    }

    /// The submission that waited for the answer to `key`'s ask (`None`: cancelled or
    /// dropped meanwhile).
    pub fn answered(&mut self, key: &RequestKey) -> Option<Fetching> {
        self.fetching.remove(key)
    }

    /// Whether `key` waits for an answer.
    pub fn is_fetching(&self, key: &RequestKey) -> bool {
        self.fetching.contains_key(key)
    }

    /// Every submission waiting for an answer (their holders' answers then come to nobody:
    /// the pins end with their holds).
    pub fn take_fetching(&mut self) -> Vec<Fetching> {
        std::mem::take(&mut self.fetching).into_values().collect()
    }

    /// Keeps the waiting submissions `keep` selects.
    pub fn retain_fetching(&mut self, keep: impl Fn(&Fetching) -> bool) {
        self.fetching.retain(|_, f| keep(f));
    }

    /// A pull of a peer's prefix landed with `blocks` blocks.
    pub fn pulled(&mut self, blocks: usize) {
        self.counters.pulled += 1;
        self.counters.blocks += blocks as u64;
        self.count("pulled");
        metrics::counter!("flotilla_kv_peer_pull_blocks_total", "worker" => self.worker.to_string())
            .increment(blocks as u64);
    }

    /// An ask or a pull failed (`why`): the prefix is recomputed here.
    pub fn failed(&mut self, holder: &WorkerId, why: &str) {
        self.counters.failed += 1;
        self.count("failed");
        tracing::info!(worker = %self.worker, %holder, %why, "peer pull failed; recomputing the prefix here");
    }

    /// By admission the prefix was cached here after all: nothing is pulled.
    pub fn moot(&mut self) {
        self.counters.moot += 1;
        self.count("moot");
    }

    /// Holder side: pin the leading blocks of `tokens` that `pool` holds in G1 (under `seq`,
    /// a fresh id) for the request `key` of a peer, until the peer confirms or the hold ends.
    /// `region` is where they can be read from (`None` on a simulated engine).
    ///
    /// # Errors
    /// A reason to give the peer (it recomputes): `key` is already pinned, or none of the
    /// prefix is in G1 here.
    #[allow(clippy::too_many_arguments)]
    pub fn export(
        &mut self,
        pool: &mut BlockPool,
        seq: SeqId,
        key: RequestKey,
        tokens: &[u32],
        region: Option<RegionDescriptor>,
        now: Instant,
        wall_ms: u64,
    ) -> Result<RemoteKv, String> {
        if self.exports.contains_key(&key) {
            return Err("this request's prefix is already pinned here".into());
        }
        let (blocks, lease) = pool.pin_cached(seq, tokens).map_err(|e| e.to_string())?;
        let Some(lease) = lease else {
            return Err(format!("{} holds none of the prefix in G1", self.worker));
        };
        let hold = self.set.hold;
        self.counters.exported += 1;
        metrics::counter!("flotilla_kv_peer_exports_total", "worker" => self.worker.to_string())
            .increment(1);
        let kv = RemoteKv {
            worker: self.worker.clone(),
            request: key.1,
            region,
            tokens: (blocks.len() * self.set.block_size) as u32,
            blocks: blocks.iter().map(|b| b.0).collect(),
            held_until_ms: wall_ms + hold.as_millis() as u64,
        };
        self.exports.insert(
            key,
            Export {
                lease,
                until: now + hold,
            },
        );
        Ok(kv)
    }

    /// Holder side: the peer's pull of `key` is over (or moot): unpin. Whether `key` was
    /// pinned here.
    pub fn unpin(&mut self, pool: &mut BlockPool, key: &RequestKey) -> bool {
        let Some(e) = self.exports.remove(key) else {
            return false;
        };
        if let Err(err) = pool.free(e.lease) {
            tracing::error!(worker = %self.worker, error = %err, "unpinning an export");
        }
        true
    }

    /// Holder side: unpin every export whose hold ended by `now` (all of them with `None`).
    /// How many were unpinned.
    pub fn unpin_expired(&mut self, pool: &mut BlockPool, now: Option<Instant>) -> usize {
        let keys: Vec<RequestKey> = self
            .exports
            .iter()
            .filter(|(_, e)| now.is_none_or(|now| e.until <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            self.unpin(pool, k);
        }
        keys.len()
    }

    /// Nothing is asked for or pinned here.
    pub fn is_idle(&self) -> bool {
        self.fetching.is_empty() && self.exports.is_empty()
    }
}

#[cfg(test)]
mod tests;
