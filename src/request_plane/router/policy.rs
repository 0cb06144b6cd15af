//! [`Selector`]: picks a live worker for a request under one of five [`Policy`]s.
//!
//! # `kv` (default): prefix reuse weighed against load
//!
//! For a request of `P` prompt tokens and a worker `w`, with block size `B` (tokens per KV
//! block), lowest cost wins:
//!
//! ```text
//! overlap(w)        = leading prompt blocks w already holds (PrefixIndex::overlaps)      blocks
//! uncached(w)       = P − min(overlap(w) × B, P)                                          tokens
//! queued(w)         = prompt tokens routed to w still waiting for prefill (ActiveLoad)    tokens
//! prefill_blocks(w) = (queued(w) + overlap_weight × uncached(w)) / B   (f64, not rounded) blocks
//! request_blocks    = ceil(P / B)                                                          blocks
//! decode_blocks(w)  = active_decode_blocks(w) + request_blocks                             blocks
//! cost(w)           = prefill_blocks(w) + decode_weight × decode_blocks(w)                 blocks
//! ```
//!
//! The weight multiplies **only what the cache saves** (the request's own uncached tokens),
//! not the queue ahead of it. Under chunked prefill (`worker.max_num_batched_tokens`, 8 192
//! tokens a step on the simulated H100) a new request does not wait for a worker's queue to
//! drain: it joins the next step that has budget left, and every queued token ahead of it costs
//! it what one of its own tokens costs (`prefill_ms ≈ 0.015 ms` per token on the H100 fit,
//! `worker/engine/sim.rs`) — the queue is a delay, counted once. The saving is more: tokens not
//! recomputed are fleet capacity given back to every other request, so `overlap_weight > 1`
//! (default 4) lets a holder busy with another prompt's prefill, or still decoding the
//! conversation's previous turn, win when what it saves is worth more than the queue it makes
//! the request wait for and the decode load it carries. Weighting the queue too (as
//! NVIDIA Dynamo does, below) makes such a holder cost as much as recomputing the whole prefix
//! elsewhere, whatever the weight. The default weight is measured: on the Mooncake
//! conversation trace (600 requests, 16 simulated H100 workers) weights 2, 4 and 8 reach 84 %,
//! 96 % and 98 % of the ideal prefix hit rate, and 4 gives the lowest TTFT p50 and p99
//! (`docs/benchmarks.md`, "KV-aware routing").
//!
//! `active_decode_blocks` counts every in-flight request's blocks, shared or not (a decode
//! step reads each sequence's whole KV), so a hot prefix still spreads once its holder's
//! decode load outweighs the saving (a hot shared prefix must not pile onto one worker).
//!
//! With `decode_weight` below 1 the decode term alone no longer spreads a hot prefix, so `kv`
//! has an **imbalance guard**: a worker whose requests in flight exceed `balance_ratio ×` the
//! live workers' mean `+ balance_requests` (1.5 × and 4 by default) is left out of the choice
//! while others are below it (SGLang's `cache_aware` router has the same guard against the
//! least loaded worker, 1.5 × and 64).
//!
//! `decode_weight` (default 1/8) is what a block of decode load costs against a block of
//! prefill. The two are not the same unit of time: a prompt token queued ahead delays this
//! request's first token by what prefilling it takes (0.015 ms per token on the simulated
//! H100, `prefill_ms = 4.21e-7·T² + 0.01518·T + 16.5`, i.e. ~0.24 ms a block), once; a decode
//! block lengthens every step of the worker while the request runs, by
//! `d decode_ms / du ÷ pool blocks` (`decode_ms = −25.74·u² + 54.01·u + 5.74` over 8 192–28 672
//! blocks: 0.001–0.007 ms a step). Weighting them alike (1) balanced decode blocks and let
//! prefill queues grow where TTFT is made: on the Mooncake conversation trace (600 and 2 000
//! requests) and its synthetic trace, 1/8 cut `kv`'s TTFT p99 by 12–15 % and raised its prefix
//! hits, with TPOT unchanged; 1/16 began to cost TPOT (measured, `docs/benchmarks.md`,
//! "KV-aware routing", the weight sweep).
//!
//! # `dynamo_kv`: NVIDIA Dynamo's KV router cost, for comparison
//!
//! Source: Dynamo KV Router, "Routing Concepts — Cost Calculation"
//! (<https://docs.nvidia.com/dynamo/dev/components/router/routing-concepts>) and its
//! `ActiveSequences` (Dynamo 1.6.1, `kv_router/sequence.rs`):
//!
//! ```text
//! prefill_blocks(w) = (queued(w) + uncached(w)) / B                                       blocks
//! decode_blocks(w)  = unique_active_blocks(w) + request_blocks − active_overlap(w)        blocks
//! cost(w)           = dynamo_overlap_weight × prefill_blocks(w) + decode_blocks(w)        blocks
//! ```
//!
//! with blocks shared by in-flight requests counted once (`unique_active_blocks`), and
//! `active_overlap(w)` the request's leading blocks that requests in flight on `w` already
//! hold: they add no decode load there ([`ActiveLoad::active_overlap_at`]).
//! `dynamo_overlap_weight` defaults to Dynamo's `--kv-overlap-score-weight` default, 1.
//!
//! # Tier credit (both kv policies)
//!
//! Once any worker has announced a block below G1 ([`PrefixIndex::has_lower_tiers`]), the
//! overlap is priced per tier: with `d(w)` the leading blocks `w` holds in G1, `dh(w)` in G1 or
//! G2, and `overlap(w)` in any tier (three index walks),
//!
//! ```text
//! credited(w) = d(w) + tier_credit.host × (dh(w) − d(w)) + tier_credit.disk × (overlap(w) − dh(w))
//! ```
//!
//! replaces `overlap(w)` in the prefill term (`uncached(w) = P − credited(w) × B`), while
//! [`Cost::uncached_tokens`] (what the worker will prefill, booked in its queue) stays
//! `P − overlap(w) × B`: a block below G1 saves its prefill but is copied in first. Defaults
//! 0.75 and 0.25: NVIDIA Dynamo's published weights (KV router, "tier-aware credit"); measured
//! against others in `docs/benchmarks.md`, "KV tiers".
//!
//! # Peer pulls (both kv policies)
//!
//! A worker may pull a prompt's leading blocks from the worker that holds them in G1 (G4,
//! through the KV transport) rather than recompute them. With `g1(v)` the leading blocks `v`
//! holds in G1 and `h` the worker with the most of them (ties: the first index slot), a
//! candidate `w ≠ h` short of `pullable(w) = g1(h) − overlap(w) ≥ peer_pull.min_blocks` blocks
//! is credited
//!
//! ```text
//! credited(w) += peer_pull.credit × pullable(w)
//! ```
//!
//! and when `w` is chosen the [`Decision::fetch`] hint names `h` and `g1(h)`; the worker then
//! decides with its own measured pull and prefill speeds whether the pull pays
//! (`worker/scheduler.rs`, "Peer pulls"). [`Cost::uncached_tokens`] still counts the pullable
//! blocks as prefill (what the worker does when it declines or the pull fails). Default credit
//! 0.75, measured ([`PeerPull::DEFAULT_CREDIT`]; NVIDIA Dynamo weighs a shared remote pool at
//! 0.5); 0 turns pulls off (no extra walk); floor 4 blocks. Blocks a holder keeps only below G1 are not
//! pullable: the holder would have to onboard them first.
//!
//! # Ties and temperature (both kv policies)
//!
//! With `temperature == 0` the lowest cost wins. Costs within `1e-9 × max(1, |min|)` of the
//! minimum tie; ties go to a rotating cursor over the tied workers sorted by id (the cursor
//! advances on every decision), so equal workers take turns and the choice is a pure function
//! of the inputs and the selector's history, whatever the order of `live`.
//!
//! With `temperature T > 0` the worker is sampled (Dynamo's `--router-temperature`):
//!
//! ```text
//! n(w) = (cost(w) − min cost) / (max cost − min cost)      (0 for all when max == min)
//! p(w) = exp(−n(w) / T) / Σ_v exp(−n(v) / T)
//! ```
//!
//! drawn with a `StdRng` seeded from [`SelectorConfig::seed`] over the live workers sorted by
//! id, so a given seed and history reproduce the same choices. Normalising makes `T`
//! independent of the cost scale: at `T = 1` the cheapest worker is `e ≈ 2.7` times as likely
//! as the most expensive one, at `T = 0.1` about 22 000 times.
//!
//! # Other policies
//!
//! - `least_loaded`: fewest requests in flight, then fewest decode blocks; ties by the rotating
//!   cursor as above.
//! - `round_robin`: the rotating cursor over the live workers sorted by id.
//! - `random`: uniform over the live workers sorted by id, from the seeded `StdRng`.
//!
//! # Sessions that stick (both kv policies)
//!
//! A request may carry a **session key** (the gateway reads it from `x-session-id` or another
//! configured header, `gateway.session_headers`). The router remembers which worker served each
//! session's last turn ([`session::SessionTable`]) and [`Selector::select_session`] sends the
//! next turn there — that worker holds the session's whole history in its KV cache — **until
//! that worker saturates**: while its queued prefill tokens (`queued(w)` above, the prompt
//! tokens the routers placed there that wait for their first token) are at most
//! [`SelectorConfig::session_max_queued_tokens`], the session's worker wins whatever the costs;
//! past it, or when the worker is not live or is in the request's `avoid` list, the cost above
//! decides and the session's affinity moves to the worker it picks ([`Affinity::Released`]).
//!
//! The default threshold, [`DEFAULT_SESSION_MAX_QUEUED_TOKENS`] = 256 tokens, is measured
//! (`docs/benchmarks.md`, "Sessions that stick"): a session keeps its worker only while that
//! worker's prefill queue is about empty (256 tokens is ~4 ms of prefill on the simulated H100,
//! 0.015 ms a token, `worker/engine/sim.rs`; one sub-agent's own message in the agent
//! workload). On a multi-turn agent workload with bursts of sub-requests (16 simulated H100
//! workers), thresholds of 1 024 tokens and more piled each burst onto its session's worker and
//! raised `kv`'s TTFT p99 up to 8× (16 384, two chunked-prefill steps, the first guess) while
//! adding at most 5 points of prefix hits; at 256, TTFT p50 stays within 5 % of plain `kv`,
//! p99 within 18 %, hits within a point. Sequential turns gain nothing over `kv` either way: the KV cost already follows a
//! session's history, because its worker holds the longest prefix. What stickiness adds is a
//! guarantee that does not depend on the prefix index (a stale index, `dynamo_kv`'s weights,
//! prompts rewritten between turns). 0 turns stickiness off.
//!
//! Stickiness is a layer over the KV cost, not a policy of its own: it applies under `kv` and
//! `dynamo_kv` only; `least_loaded`, `round_robin` and `random` ignore session keys (a request
//! that overrides its policy with one of them is placed as that policy says). The decision's
//! cost terms are still the chosen worker's, so prefix hits are measured as for any placement.
//!
//! # Cost of a decision
//!
//! One [`PrefixIndex::overlaps_in`] walk, then `O(|live|)` arithmetic (`dynamo_kv` adds one
//! hash lookup per leading block per live worker for its active overlap; plus a sort of the
//! tied workers, or of all live workers for `round_robin`, `random` and `temperature > 0`). The
//! selector remembers the last `live` list resolved to index and load slots and reuses it
//! while the list (compared element by element) and both tables' worker epochs are unchanged,
//! so worker ids are not hashed on every decision.
//!
//! Every policy only ever picks from `live` (duplicates are harmless), and every
//! [`Decision`] carries the chosen worker's overlap and cost (`dynamo_kv`'s form under that
//! policy, `kv`'s under every other) so the caller can measure
//! prefix hits whatever the policy. Under `kv` the decode term balances load and
//! `overlap_weight` sets how much prefix reuse may outweigh it, within the imbalance guard.
//!
//! # Files
//!
//! This file holds the [`Selector`] and its [`Decision`]; `settings.rs` the policies and the
//! selector's settings ([`SelectorConfig`], its defaults and checks), `cost.rs` the cost
//! formulas above ([`kv_cost`], [`cost_of`], [`cost_credited`]), `session.rs` the
//! [`session::SessionTable`].

use rand::distr::Distribution;
use rand::distr::weighted::WeightedIndex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::runtime::ids::{SequenceHash, WorkerId};

mod cost;
pub mod session;
mod settings;

pub use cost::{Cost, CostForm, cost_credited, cost_of, kv_cost, request_blocks};
pub use settings::{
    DEFAULT_BALANCE_RATIO, DEFAULT_BALANCE_REQUESTS, DEFAULT_BLOCK_SIZE, DEFAULT_DECODE_WEIGHT,
    DEFAULT_OVERLAP_WEIGHT, DEFAULT_SESSION_MAX_QUEUED_TOKENS, PeerPull, Policy, SelectorConfig,
    SelectorConfigError, TierCredit, UnknownPolicy,
};

use super::index::{Overlaps, PrefixIndex, TierSet, WorkerSlot};
use super::load::{ActiveLoad, LoadSlot, WorkerLoad};
use crate::kv::Tier;

/// How a placement relates to its request's session (module docs, "Sessions that stick").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Affinity {
    /// No session to stick to: the request has no key, the key is new, or the policy ignores
    /// sessions; the cost decided.
    #[default]
    None,
    /// Placed on the worker that served the session's last turn (sticky).
    Kept,
    /// The session's worker was saturated, not live or avoided: the cost decided, and the
    /// session moves to the worker it picked.
    Released,
}

impl Affinity {
    /// `none`, `kept` or `released`, as the `placed` line and the placement terms say it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Affinity::None => "none",
            Affinity::Kept => "kept",
            Affinity::Released => "released",
        }
    }
}

/// Where a prompt's leading blocks can be pulled from (peer pull, G4): `holder` keeps the
/// first `blocks` full blocks of the prompt in its G1 pool, as its KV events announced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchHint {
    /// The worker holding the blocks.
    pub holder: WorkerId,
    /// Leading full blocks of the prompt it holds.
    pub blocks: u32,
}

/// One placement, with what the caller needs to book it and measure it.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub worker: WorkerId,
    pub policy: Policy,
    /// Leading prompt blocks the chosen worker holds.
    pub overlap_blocks: u32,
    /// The largest overlap among the live workers (`overlap_blocks` ≤ this).
    pub best_overlap_blocks: u32,
    /// The chosen worker's overlap as its cost counted it ([`Cost::credited_blocks`]).
    pub credited_blocks: f64,
    /// Prompt tokens the chosen worker must prefill: pass to [`ActiveLoad::on_routed`].
    pub uncached_tokens: u32,
    /// `ceil(prompt_tokens / block_size)`: pass to [`ActiveLoad::on_routed`].
    pub request_blocks: u32,
    /// The chosen worker's cost terms: `dynamo_kv`'s form under that policy, `kv`'s under
    /// every other (computed whatever the policy).
    pub prefill_blocks: f64,
    pub decode_blocks: f64,
    pub cost: f64,
    /// Live workers passed (duplicates included).
    pub candidates: usize,
    /// Peer pull: the worker holding the most leading prompt blocks in G1, when the chosen
    /// worker lacks at least `peer_pull.min_blocks` of them.
    pub fetch: Option<FetchHint>,
    /// Whether the request's session kept its worker ([`Selector::select_session`]).
    pub affinity: Affinity,
}

/// Picks workers (see the module docs).
#[derive(Debug, Clone)]
pub struct Selector {
    config: SelectorConfig,
    tiers: TierSet,
    rng: StdRng,
    cursor: u64,
    /// Added to the cursor for the next decision only ([`Selector::spread_next`]).
    spread: u64,
    cache: LiveCache,
}

/// The last live list resolved to index and load slots, so that a decision does not hash
/// every worker id twice; valid while the list and both tables' worker epochs are unchanged.
#[derive(Debug, Clone, Default)]
struct LiveCache {
    live: Vec<WorkerId>,
    index_epoch: u64,
    load_epoch: u64,
    slots: Vec<(Option<WorkerSlot>, Option<LoadSlot>)>,
}

impl LiveCache {
    fn refresh(&mut self, live: &[WorkerId], index: &PrefixIndex, load: &ActiveLoad) {
        let (ie, le) = (index.workers_epoch(), load.workers_epoch());
        if self.index_epoch == ie && self.load_epoch == le && self.live == live {
            return;
        }
        self.live = live.to_vec();
        (self.index_epoch, self.load_epoch) = (ie, le);
        self.slots = live.iter().map(|w| (index.slot(w), load.slot(w))).collect();
    }

    /// Load of the `i`-th live worker.
    fn load(&self, i: usize, load: &ActiveLoad) -> WorkerLoad {
        self.slots[i]
            .1
            .map_or_else(WorkerLoad::default, |s| load.load_at(s))
    }
}

impl Selector {
    /// A selector; overlaps count blocks held in any tier (see [`Selector::with_tiers`]).
    ///
    /// # Errors
    /// The configuration is invalid ([`SelectorConfig::validate`]).
    pub fn new(config: SelectorConfig) -> Result<Self, SelectorConfigError> {
        config.validate()?;
        Ok(Selector {
            rng: StdRng::seed_from_u64(config.seed),
            config,
            tiers: TierSet::ALL,
            cursor: 0,
            spread: 0,
            cache: LiveCache::default(),
        })
    }

    /// Counts only blocks held in `tiers` as cached.
    pub fn with_tiers(mut self, tiers: TierSet) -> Self {
        self.tiers = tiers;
        self
    }

    /// The settings.
    pub fn config(&self) -> &SelectorConfig {
        &self.config
    }

    /// The rotating cursor that breaks ties (module docs, "Ties and temperature").
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Moves the cursor to where another router's selector left it after its decision, so
    /// routers that share their load (`router.share_load`) break the next tie alike.
    pub fn follow_cursor(&mut self, cursor: u64) {
        self.cursor = cursor;
    }

    /// The next decision breaks a tie at `cursor + offset` instead of `cursor` (the cursor
    /// still advances by one). Routers that share their load pass an offset drawn from the
    /// request, so requests placed at once by different routers — which see the same loads
    /// and the same cursor — spread over tied workers instead of all taking the same one,
    /// while any router given the same request and state still picks the same worker.
    pub fn spread_next(&mut self, offset: u64) {
        self.spread = offset;
    }

    /// Picks one of `live` for a request of `prompt_tokens` tokens whose full blocks have the
    /// sequence hashes `hashes` (`kv_block_manager::hash::block_hashes`, in order). `None` iff
    /// `live` is empty. Does not book the placement: call [`ActiveLoad::on_routed`] with the
    /// decision.
    pub fn select(
        &mut self,
        live: &[WorkerId],
        hashes: &[SequenceHash],
        prompt_tokens: u32,
        index: &PrefixIndex,
        load: &ActiveLoad,
    ) -> Option<Decision> {
        self.select_session(None, live, hashes, prompt_tokens, index, load)
    }

    /// [`Selector::select`] for a request whose session's last turn was served by `sticky`
    /// (`None`: no session, or a new one): under `kv` and `dynamo_kv`, `sticky` is chosen
    /// when it is in `live` and its queued prefill tokens ([`ActiveLoad`]) are at most
    /// [`SelectorConfig::session_max_queued_tokens`] ([`Affinity::Kept`]); otherwise the
    /// policy decides ([`Affinity::Released`] when `sticky` was given). The tie cursor does
    /// not advance on a kept placement. Module docs, "Sessions that stick".
    pub fn select_session(
        &mut self,
        sticky: Option<&WorkerId>,
        live: &[WorkerId],
        hashes: &[SequenceHash],
        prompt_tokens: u32,
        index: &PrefixIndex,
        load: &ActiveLoad,
    ) -> Option<Decision> {
        if live.is_empty() {
            return None;
        }
        self.cache.refresh(live, index, load);
        let overlaps = index.overlaps_in(hashes, self.tiers);
        // Tier credit: walks restricted to G1, and to G1 + G2, price the blocks below them.
        let lower = index.has_lower_tiers() && self.tiers != TierSet::DEVICE;
        let device = self.tiers.contains(Tier::Device) && lower;
        let by_tier = lower.then(|| {
            let d = if device {
                Some(index.overlaps_in(hashes, TierSet::DEVICE))
            } else {
                None
            };
            let dh = index.overlaps_in(hashes, TierSet::DEVICE.with(Tier::Host));
            (d, dh)
        });
        // Peer pulls: the worker holding the most leading blocks in G1 (ties: the first slot).
        let g1 = match &by_tier {
            _ if !self.config.peer_pull.is_on() || !self.tiers.contains(Tier::Device) => None,
            Some((d, _)) => d.as_ref(),
            None => Some(&overlaps),
        };
        let holder = g1.and_then(|g1| {
            g1.iter()
                .fold(None, |best: Option<(&WorkerId, u32)>, (w, n)| match best {
                    Some((_, b)) if b >= n => best,
                    _ => Some((w, n)),
                })
        });
        let costs = self.costs(
            &overlaps,
            by_tier.as_ref(),
            holder,
            hashes,
            prompt_tokens,
            load,
        );
        let sessions = matches!(self.config.policy, Policy::Kv | Policy::DynamoKv)
            && self.config.session_max_queued_tokens > 0;
        let sticky = sticky.filter(|_| sessions);
        let kept = sticky.and_then(|w| {
            let i = live.iter().position(|l| l == w)?;
            (self.cache.load(i, load).prefill_tokens <= self.config.session_max_queued_tokens)
                .then_some(i)
        });
        let (pick, affinity) = match (kept, sticky) {
            (Some(i), _) => {
                self.spread = 0;
                (i, Affinity::Kept)
            }
            (None, Some(_)) => (self.pick(live, &costs, load), Affinity::Released),
            (None, None) => (self.pick(live, &costs, load), Affinity::None),
        };
        let c = costs[pick];
        let fetch = holder.and_then(|(w, n)| {
            let short = n.saturating_sub(c.overlap_blocks);
            (*w != live[pick] && short >= self.config.peer_pull.min_blocks.max(1)).then(|| {
                FetchHint {
                    holder: w.clone(),
                    blocks: n,
                }
            })
        });
        Some(Decision {
            worker: live[pick].clone(),
            policy: self.config.policy,
            overlap_blocks: c.overlap_blocks,
            best_overlap_blocks: costs.iter().map(|c| c.overlap_blocks).max().unwrap_or(0),
            credited_blocks: c.credited_blocks,
            uncached_tokens: c.uncached_tokens,
            request_blocks: request_blocks(prompt_tokens, self.config.block_size),
            prefill_blocks: c.prefill_blocks,
            decode_blocks: c.decode_blocks,
            cost: c.cost,
            candidates: live.len(),
            fetch,
            affinity,
        })
    }

    /// The cost of every live worker (in `live` order, resolved by the cache).
    fn costs(
        &self,
        overlaps: &Overlaps<'_>,
        by_tier: Option<&(Option<Overlaps<'_>>, Overlaps<'_>)>,
        holder: Option<(&WorkerId, u32)>,
        hashes: &[SequenceHash],
        prompt_tokens: u32,
        load: &ActiveLoad,
    ) -> Vec<Cost> {
        let cache = &self.cache;
        let form = CostForm::of(self.config.policy);
        let credit = self.config.tier_credit;
        let pull = self.config.peer_pull;
        (0..cache.slots.len())
            .map(|i| {
                let slot = cache.slots[i].0;
                let overlap = slot.map_or(0, |s| overlaps.at(s));
                let credited = match (by_tier, slot) {
                    (Some((d, dh)), Some(s)) => {
                        // Leading blocks in G1, then in G2 (or G1), then anywhere (G3).
                        let all = f64::from(overlap);
                        let dh = f64::from(dh.at(s)).min(all);
                        let d = d.as_ref().map_or(0.0, |d| f64::from(d.at(s))).min(dh);
                        d + credit.host * (dh - d) + credit.disk * (all - dh)
                    }
                    _ => f64::from(overlap),
                };
                // Blocks the holder has in G1 beyond this worker's copies, worth a pull.
                let pullable = match holder {
                    Some((w, n)) if *w != cache.live[i] => n.saturating_sub(overlap),
                    _ => 0,
                };
                let credited = if pullable >= pull.min_blocks.max(1) {
                    credited + pull.credit * f64::from(pullable)
                } else {
                    credited
                };
                let active = match (form, cache.slots[i].1) {
                    (CostForm::Dynamo, Some(s)) => load.active_overlap_at(s, hashes),
                    _ => 0,
                };
                let l = cache.load(i, load);
                cost_credited(
                    form,
                    &self.config,
                    prompt_tokens,
                    (overlap, credited),
                    active,
                    l,
                )
            })
            .collect()
    }

    /// Index into `live` of the worker the policy picks.
    fn pick(&mut self, live: &[WorkerId], costs: &[Cost], load: &ActiveLoad) -> usize {
        let allowed = match self.config.policy {
            Policy::Kv => self.balanced(live.len(), load),
            _ => (0..live.len()).collect(),
        };
        match self.config.policy {
            Policy::Kv | Policy::DynamoKv if self.config.temperature > 0.0 => {
                self.sample(live, costs, allowed)
            }
            Policy::Kv | Policy::DynamoKv => self.lowest_cost(live, costs, allowed),
            Policy::LeastLoaded => {
                let loads = (0..live.len()).map(|i| self.cache.load(i, load)).collect();
                self.least_loaded(live, loads)
            }
            Policy::RoundRobin => self.take_turn(live, (0..live.len()).collect()),
            Policy::Random => self.uniform(live),
        }
    }

    /// `kv`'s imbalance guard: the live workers (indices) whose requests in flight are at
    /// most `balance_ratio × mean + balance_requests` (the mean over `live`); all of them when
    /// the guard is off (`balance_ratio` 0) or would leave none.
    fn balanced(&self, n: usize, load: &ActiveLoad) -> Vec<usize> {
        let all: Vec<usize> = (0..n).collect();
        let ratio = self.config.balance_ratio;
        if ratio <= 0.0 || n < 2 {
            return all;
        }
        let flights: Vec<f64> = all
            .iter()
            .map(|&i| f64::from(self.cache.load(i, load).in_flight))
            .collect();
        let mean = flights.iter().sum::<f64>() / n as f64;
        let cap = ratio * mean + f64::from(self.config.balance_requests);
        let ok: Vec<usize> = all.iter().copied().filter(|&i| flights[i] <= cap).collect();
        if ok.is_empty() { all } else { ok }
    }

    /// Lowest cost among `allowed` (indices into `live`, not empty); ties take turns.
    fn lowest_cost(&mut self, live: &[WorkerId], costs: &[Cost], allowed: Vec<usize>) -> usize {
        let min = allowed
            .iter()
            .map(|&i| costs[i].cost)
            .fold(f64::INFINITY, f64::min);
        let eps = 1e-9 * min.abs().max(1.0);
        let ties = allowed.into_iter().filter(|i| costs[*i].cost <= min + eps);
        self.take_turn(live, ties.collect())
    }

    /// Fewest in flight, then fewest decode blocks; ties take turns.
    fn least_loaded(&mut self, live: &[WorkerId], loads: Vec<WorkerLoad>) -> usize {
        let key = |i: usize| (loads[i].in_flight, loads[i].decode_blocks);
        let min = (0..live.len()).map(key).min().expect("live is not empty");
        let ties = (0..live.len()).filter(|i| key(*i) == min);
        self.take_turn(live, ties.collect())
    }

    /// `candidates` (indices into `live`, not empty) sorted by worker id, deduplicated, and
    /// the one under the rotating cursor; advances the cursor.
    fn take_turn(&mut self, live: &[WorkerId], candidates: Vec<usize>) -> usize {
        let sorted = sorted_unique(live, candidates);
        let turn = self.cursor.wrapping_add(std::mem::take(&mut self.spread));
        let i = sorted[(turn % sorted.len() as u64) as usize];
        self.cursor = self.cursor.wrapping_add(1);
        i
    }

    /// Uniform over the distinct live workers.
    fn uniform(&mut self, live: &[WorkerId]) -> usize {
        let sorted = sorted_unique(live, (0..live.len()).collect());
        sorted[self.rng.random_range(0..sorted.len())]
    }

    /// Softmax over normalised negative costs (see the module docs).
    fn sample(&mut self, live: &[WorkerId], costs: &[Cost], allowed: Vec<usize>) -> usize {
        let sorted = sorted_unique(live, allowed);
        let weights = softmax_weights(&sorted, costs, self.config.temperature);
        // Every weight is in (0, 1] and the lowest cost's is 1, so the index is well formed.
        let pick = WeightedIndex::new(&weights).expect("softmax weights are positive and finite");
        sorted[pick.sample(&mut self.rng)]
    }
}

/// `exp(−n / T)` for each candidate, `n` its min-max normalised cost.
fn softmax_weights(candidates: &[usize], costs: &[Cost], temperature: f64) -> Vec<f64> {
    let cost = |i: &usize| costs[*i].cost;
    let min = candidates.iter().map(cost).fold(f64::INFINITY, f64::min);
    let max = candidates
        .iter()
        .map(cost)
        .fold(f64::NEG_INFINITY, f64::max);
    let range = max - min;
    candidates
        .iter()
        .map(|i| {
            let n = if range > 0.0 {
                (cost(i) - min) / range
            } else {
                0.0
            };
            (-n / temperature).exp()
        })
        .collect()
}

/// Indices into `live`, sorted by worker id, one per distinct worker.
fn sorted_unique(live: &[WorkerId], mut indices: Vec<usize>) -> Vec<usize> {
    indices.sort_unstable_by(|a, b| live[*a].cmp(&live[*b]).then(a.cmp(b)));
    indices.dedup_by(|a, b| live[*a] == live[*b]);
    indices
}

#[cfg(test)]
mod tests;
