//! The router's placement core, pure: which worker gets a request, on an injected clock and
//! an injected list of workers ([`WorkerSource`]). The Router actor
//! ([`crate::actors::router`]) drives it from its mailbox, the process groups and a 1 s tick;
//! the simulator and the tests drive the same core on a `ManualClock`.
//!
//! It keeps the prefix index (`index.rs`, fed by KV events), the active load (`load.rs`), one
//! selector per policy in use (`policy.rs`), the session table and the other routers' load
//! (`sync.rs`). What it wants done outside — a worker's snapshot after a gap in its events —
//! it hands out as data ([`RouterCore::take_snapshot_requests`]), as it does the changes to
//! tell the other routers ([`RouterCore::take_shared`]).
//!
//! # Sessions
//! A request with a session key ([`RouteRequest::session`]) goes, under the kv policies, to
//! the worker that served its session's last turn until that worker's queued prefill tokens
//! pass `router.session_max_queued_tokens`; then the cost decides and the session moves
//! (`policy.rs`, "Sessions that stick"). The table of sessions ([`SessionTable`],
//! `router.session_capacity` / `router.session_ttl_ms`) is shared like the load: every
//! `Routed` change told to the other routers names its session, and they record it as their
//! own, so a session's next turn sticks whichever router places it. Disaggregated, the session
//! sticks to its **decode** (or aggregated) worker, which holds its history after each turn:
//! the sticky decode worker still hands a long uncached suffix to a prefill worker (the rule
//! below, on its own overlap), and the hand-off's prefill placement does not move the session.
//!
//! # Disaggregation
//! Whole requests go to aggregated and decode workers (prefill workers only when no other is
//! routable). When the Request allows it ([`RouteRequest::remote_prefill`]), the chosen worker
//! is a decode worker, and the part of the prompt it does not hold is at least
//! `disagg.min_prefill_tokens`, the prompt goes to a prefill worker instead, chosen by the
//! same policy among the prefill workers (on their own prefix overlap), unless that worker
//! already has more than `disagg.max_prefill_queue_tokens` prompt tokens queued (Dynamo's
//! conditional disaggregation). The answer ([`Placement::hand_off`]) tells the Request to
//! submit a prefill-only attempt; the decode attempt that follows is routed again, without
//! remote prefill, and pulls the KV.

use super::index::{ApplyOutcome, PrefixIndex};
use super::load::{self, ActiveLoad, RequestKey};
use super::policy::session::SessionTable;
use super::policy::{self, Decision, Policy, Selector, SelectorConfig};
use super::sync;
use crate::kv::{KvEvent, KvSnapshot};
use crate::request_plane::protocol::{Placement, RouteRequest};
use crate::runtime::clock::{Instant, SharedClock};
use crate::runtime::ids::{EventId, NodeId, RequestId, WorkerId};
use crate::runtime::role::Role;
use std::collections::HashMap;
use std::sync::Arc;

/// Placements older than this are released (ms).
pub const LEASE_TTL_MS: u64 = 30 * 60 * 1000;
/// A resync asked for and not answered within this long is asked again (ms).
pub const RESYNC_RETRY_MS: u64 = 2_000;

/// Why a placement could not be decided.
pub type RouterError = policy::SelectorConfigError;

/// Where a router learns which workers exist.
pub trait WorkerSource: Send + Sync + 'static {
    /// Workers a router may choose: alive, healthy, not draining.
    fn routable(&self) -> Vec<WorkerId>;
    /// Workers whose scheduler is alive (routable or not); the others are purged.
    fn alive(&self) -> Vec<WorkerId>;
    /// Workers in `role` (prefill or decode; aggregated workers are in neither), routable
    /// or not.
    fn in_role(&self, role: Role) -> Vec<WorkerId> {
        let _ = role;
        Vec::new()
    }
}

/// When the router sends a request to a prefill worker first (`disagg.*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DisaggRouting {
    /// Uncached prompt tokens on the chosen decode worker from which the prompt is prefilled
    /// remotely; 0 = never.
    pub min_prefill_tokens: u32,
    /// … while the chosen prefill worker has at most this many prompt tokens queued.
    pub max_prefill_queue_tokens: u64,
}

impl DisaggRouting {
    /// `disagg.min_prefill_tokens` unless configured.
    pub const DEFAULT_MIN_PREFILL_TOKENS: u32 = 512;
    /// `disagg.max_prefill_queue_tokens` unless configured.
    pub const DEFAULT_MAX_PREFILL_QUEUE_TOKENS: u64 = 16_384;
}

impl Default for DisaggRouting {
    /// The configuration's defaults (`disagg.*`).
    fn default() -> Self {
        Self {
            min_prefill_tokens: Self::DEFAULT_MIN_PREFILL_TOKENS,
            max_prefill_queue_tokens: Self::DEFAULT_MAX_PREFILL_QUEUE_TOKENS,
        }
    }
}

/// What a [`RouterCore`] starts with.
#[derive(Clone)]
pub struct RouterCoreArgs {
    /// The selector configuration (`router.*`, with the workers' block size).
    pub config: SelectorConfig,
    /// Time, for placement leases and resync retries.
    pub clock: SharedClock,
    /// The workers it may choose.
    pub workers: Arc<dyn WorkerSource>,
    /// Conditional disaggregation.
    pub disagg: DisaggRouting,
    /// Where the router publishes its workers' prefill queues, when admission on its node
    /// reads them (a gateway with `gateway.ttft_target_ms`); `None`: not published.
    pub queues: Option<load::PrefillQueueView>,
    /// Tell the other routers every change to this router's load and count theirs
    /// (`router.share_load`; `load.rs`, "Several routers").
    pub share_load: bool,
    /// Which worker served each session's last turn, empty at start, bounded by
    /// `router.session_capacity` and `router.session_ttl_ms` (`policy/session.rs`).
    pub sessions: SessionTable,
}

impl RouterCoreArgs {
    /// A router on the system clock that chooses among `workers`, with the configuration's
    /// defaults for the rest.
    pub fn new(config: SelectorConfig, workers: Arc<dyn WorkerSource>) -> Self {
        Self {
            config,
            clock: crate::runtime::clock::system(),
            workers,
            disagg: DisaggRouting::default(),
            queues: None,
            share_load: true,
            sessions: SessionTable::default(),
        }
    }
}

/// The router's placement state and rules (see the module doc).
pub struct RouterCore {
    config: SelectorConfig,
    index: PrefixIndex,
    load: ActiveLoad,
    /// One selector per policy in use (the configured one, and per-request overrides).
    selectors: HashMap<Policy, Selector>,
    /// Resyncs asked for: worker → when (ms on [`Self::now_ms`]'s scale).
    resyncs: HashMap<WorkerId, u64>,
    clock: SharedClock,
    /// Time zero of the router's millisecond timestamps.
    epoch: Instant,
    workers: Arc<dyn WorkerSource>,
    disagg: DisaggRouting,
    queues: Option<load::PrefillQueueView>,
    share_load: bool,
    /// This router's changes to its load not told to the other routers yet.
    shared: Vec<sync::LoadChange>,
    /// Requests in the load that another router placed: key → that router.
    peer_placed: HashMap<RequestKey, String>,
    /// The other routers this one knows of (registered names): while there are any, ties
    /// are spread by request ([`Selector::spread_next`]).
    peers: std::collections::HashSet<String>,
    /// Session → worker of its last turn, this router's placements and the others' alike.
    sessions: SessionTable,
    /// Workers whose snapshot this router wants, not handed to the driver yet
    /// ([`RouterCore::take_snapshot_requests`]); each worker at most once.
    snapshots_wanted: Vec<WorkerId>,
}

/// `live` without the workers in `avoid`, unless that leaves none.
fn prefer_not(live: Vec<WorkerId>, avoid: &[WorkerId]) -> Vec<WorkerId> {
    if avoid.is_empty() {
        return live;
    }
    let others: Vec<WorkerId> = live
        .iter()
        .filter(|w| !avoid.contains(w))
        .cloned()
        .collect();
    if others.is_empty() { live } else { others }
}

impl RouterCore {
    /// Empty state: no index, no load, one selector for the configured policy.
    ///
    /// # Errors
    /// The selector configuration is invalid (see [`Selector::new`]).
    pub fn new(args: RouterCoreArgs) -> Result<Self, policy::SelectorConfigError> {
        let selector = Selector::new(args.config.clone())?;
        let mut selectors = HashMap::new();
        selectors.insert(args.config.policy, selector);
        Ok(Self {
            config: args.config,
            index: PrefixIndex::new(),
            load: ActiveLoad::new(),
            selectors,
            resyncs: HashMap::new(),
            epoch: args.clock.now(),
            clock: args.clock,
            workers: args.workers,
            disagg: args.disagg,
            queues: args.queues,
            share_load: args.share_load,
            shared: Vec::new(),
            peer_placed: HashMap::new(),
            peers: Default::default(),
            sessions: args.sessions,
            snapshots_wanted: Vec::new(),
        })
    }

    /// Milliseconds since this router started, on its clock.
    fn now_ms(&self) -> u64 {
        self.clock
            .now()
            .saturating_duration_since(self.epoch)
            .as_millis() as u64
    }

    /// Place a request now (on the router's clock).
    ///
    /// # Errors
    /// The request names a policy whose selector cannot be built.
    pub fn place(&mut self, req: RouteRequest) -> Result<Option<Placement>, RouterError> {
        let now = self.now_ms();
        self.route(req, now)
    }

    /// A placed request's first token came (`RouterMsg::FirstToken`).
    pub fn first_token(&mut self, node: NodeId, request: RequestId) {
        let now = self.now_ms();
        self.on_first_token(node, request, now);
    }

    /// A placed request ended (`RouterMsg::Release`).
    pub fn release(&mut self, node: NodeId, request: RequestId) {
        self.on_release(node, request);
    }

    /// Changes to this router's load since the last call, for the other routers
    /// (`RouterMsg::PeerLoad`); always empty without `share_load`.
    pub fn take_shared(&mut self) -> Vec<sync::LoadChange> {
        std::mem::take(&mut self.shared)
    }

    /// Another router's changes to its load (`RouterMsg::PeerLoad`), counted here as if
    /// this router had made them; `from` names that router (its placements are forgotten
    /// when it leaves: [`RouterCore::router_left`]). Ignored without `share_load`.
    pub fn peer_load(&mut self, from: &str, changes: Vec<sync::LoadChange>) {
        let now = self.now_ms();
        self.on_peer_load(from, changes, now);
    }

    /// Router `name` is another router of the fleet (it joined the routers' group, or told
    /// of a change).
    pub fn router_joined(&mut self, name: &str) {
        self.peers.insert(name.to_owned());
    }

    /// Router `name` left (its node died or it restarted): the placements it told of and
    /// that have not ended are dropped (their requests died with it, or are released through
    /// another router that will say so). Returns how many.
    pub fn router_left(&mut self, name: &str) -> usize {
        self.peers.remove(name);
        let keys: Vec<RequestKey> = self
            .peer_placed
            .iter()
            .filter(|(_, r)| r.as_str() == name)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &keys {
            self.peer_placed.remove(k);
            self.load.on_finished(k);
        }
        keys.len()
    }

    fn on_first_token(&mut self, node: NodeId, request: RequestId, now: u64) {
        let key = RequestKey::new(node, request);
        if self.load.on_first_token(&key, now) && self.share_load {
            self.shared.push(sync::LoadChange::FirstToken {
                node: key.node,
                request: key.request,
            });
        }
    }

    fn on_release(&mut self, node: NodeId, request: RequestId) {
        let key = RequestKey::new(node, request);
        self.peer_placed.remove(&key);
        if self.load.on_finished(&key) && self.share_load {
            self.shared.push(sync::LoadChange::Finished {
                node: key.node,
                request: key.request,
            });
        }
    }

    fn on_peer_load(&mut self, from: &str, changes: Vec<sync::LoadChange>, now: u64) {
        if !self.share_load {
            return;
        }
        if !self.peers.contains(from) {
            self.peers.insert(from.to_owned());
        }
        for change in changes {
            let key = change.key();
            match change {
                sync::LoadChange::Routed {
                    worker,
                    policy,
                    prefill_tokens,
                    hashes,
                    blocks,
                    cursor,
                    session,
                    ..
                } => {
                    if let Some(session) = session {
                        self.sessions.placed(&session, &worker, now);
                    }
                    self.load.on_routed_prefix(
                        key.clone(),
                        &worker,
                        prefill_tokens,
                        &hashes,
                        blocks,
                        now,
                    );
                    self.peer_placed.insert(key, from.to_owned());
                    if self.ensure_selector(policy).is_ok()
                        && let Some(s) = self.selectors.get_mut(&policy)
                    {
                        s.follow_cursor(cursor);
                    }
                }
                sync::LoadChange::FirstToken { .. } => {
                    self.load.on_first_token(&key, now);
                }
                sync::LoadChange::Finished { .. } => {
                    self.peer_placed.remove(&key);
                    self.load.on_finished(&key);
                }
            }
        }
    }

    /// KV events of the workers (`RouterMsg::KvEvents`).
    pub fn kv_events(&mut self, events: Vec<KvEvent>) {
        let now = self.now_ms();
        self.on_events(events, now);
    }

    /// `worker` left its groups (died, restarts, retired): forget what it held, its load and
    /// any resync asked for.
    pub fn worker_left(&mut self, worker: &WorkerId) {
        self.purge(worker);
    }

    /// The prefix index.
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Requests placed and not yet released.
    pub fn placed(&self) -> usize {
        self.load.len()
    }

    /// Make sure a selector for `policy` exists.
    fn ensure_selector(&mut self, policy: Policy) -> Result<(), RouterError> {
        if !self.selectors.contains_key(&policy) {
            let config = SelectorConfig {
                policy,
                ..self.config.clone()
            };
            self.selectors.insert(policy, Selector::new(config)?);
        }
        Ok(())
    }

    /// Places a request (see the module doc, "Disaggregation").
    fn route(&mut self, req: RouteRequest, now: u64) -> Result<Option<Placement>, RouterError> {
        let key = RequestKey::new(req.node.clone(), req.request);
        let routable = self.workers.routable();
        let prefill_pool: Vec<WorkerId> = {
            let prefill = self.workers.in_role(Role::Prefill);
            routable
                .iter()
                .filter(|w| prefill.contains(w))
                .cloned()
                .collect()
        };
        // Whole requests go to aggregated and decode workers; prefill workers take them only
        // when no other worker is routable.
        let serving: Vec<WorkerId> = routable
            .iter()
            .filter(|w| !prefill_pool.contains(w))
            .cloned()
            .collect();
        let serving = if serving.is_empty() {
            routable
        } else {
            serving
        };
        // A queued attempt asking whether to move may only go elsewhere (and nowhere if its
        // placement is no longer known here).
        let moving = req
            .rebalance
            .map(|old| RequestKey::new(req.node.clone(), old));
        let from = match &moving {
            Some(old) => match self.load.worker_of(old) {
                Some(w) => Some(w.clone()),
                None => return Ok(None),
            },
            None => None,
        };
        let live = match &from {
            Some(from) => serving.into_iter().filter(|w| w != from).collect(),
            None => prefer_not(serving, &req.avoid),
        };
        if let Some(w) = self.load.worker_of(&key) {
            let hand_off = req.remote_prefill && prefill_pool.contains(w) && !live.contains(w);
            if live.contains(w) || hand_off {
                return Ok(Some(Placement {
                    worker: w.clone(),
                    hand_off,
                    fetch: None,
                    terms: None,
                }));
            }
        }
        let policy = req.policy.unwrap_or(self.config.policy);
        self.ensure_selector(policy)?;
        let Some(selector) = self.selectors.get_mut(&policy) else {
            return Ok(None);
        };
        if self.share_load && !self.peers.is_empty() {
            selector.spread_next(spread_of(&key));
        }
        let sticky = req
            .session
            .as_deref()
            .filter(|_| moving.is_none())
            .and_then(|k| self.sessions.worker_of(k, now))
            .cloned();
        let Some(mut d) = selector.select_session(
            sticky.as_ref(),
            &live,
            &req.seq_hashes,
            req.prompt_tokens,
            &self.index,
            &self.load,
        ) else {
            return Ok(None);
        };
        if let (Some(old), Some(from)) = (moving, &from) {
            // Move only if the queue there, with this prompt, is no longer than the one here
            // without it: a move never makes the two queues more uneven (so requests never
            // move back and forth), and the request starts no later than where it waits.
            let here = self.load.prefill_tokens(from);
            let own = u64::from(req.prompt_tokens);
            let there = self.load.prefill_tokens(&d.worker) + u64::from(d.uncached_tokens);
            if there > here.saturating_sub(own) {
                return Ok(None);
            }
            // The old placement goes now, not when the Request's release arrives: the other
            // attempts asking in the same moment see the queue this one leaves.
            // (`on_release`'s body: `selector` still borrows `self.selectors`.)
            self.peer_placed.remove(&old);
            if self.load.on_finished(&old) && self.share_load {
                self.shared.push(sync::LoadChange::Finished {
                    node: old.node,
                    request: old.request,
                });
            }
            metrics::counter!("flotilla_router_rebalanced_total").increment(1);
        }
        // Conditional disaggregation (Dynamo's rule): a decode worker that would prefill at
        // least `min_prefill_tokens` of the prompt itself hands the prefill to the prefill
        // worker the same cost picks, unless that one's queue is already long.
        let mut hand_off = false;
        let min = self.disagg.min_prefill_tokens;
        if req.remote_prefill
            && min > 0
            && d.uncached_tokens >= min
            && !prefill_pool.is_empty()
            && self.workers.in_role(Role::Decode).contains(&d.worker)
        {
            let pool = prefer_not(prefill_pool, &req.avoid);
            if let Some(p) = selector.select(
                &pool,
                &req.seq_hashes,
                req.prompt_tokens,
                &self.index,
                &self.load,
            ) && self.load.prefill_tokens(&p.worker) <= self.disagg.max_prefill_queue_tokens
            {
                d = Decision {
                    affinity: d.affinity,
                    ..p
                };
                hand_off = true;
            } else {
                metrics::counter!("flotilla_router_local_prefills_total", "why" => "prefill_queue")
                    .increment(1);
            }
        }
        self.load.on_routed_prefix(
            key.clone(),
            &d.worker,
            d.uncached_tokens,
            &req.seq_hashes,
            d.request_blocks,
            now,
        );
        self.peer_placed.remove(&key);
        // The session follows its decode (or aggregated) worker: a prefill hand-off's worker
        // only computes the prompt, and the decode attempt that follows is placed again.
        let has_session = req.session.is_some();
        let session = req.session.filter(|_| !hand_off);
        if let Some(k) = &session {
            self.sessions.placed(k, &d.worker, now);
            metrics::counter!("flotilla_router_session_placements_total", "affinity" => d.affinity.as_str())
                .increment(1);
        }
        if self.share_load {
            self.shared.push(sync::LoadChange::Routed {
                node: key.node,
                request: key.request,
                worker: d.worker.clone(),
                policy,
                prefill_tokens: d.uncached_tokens,
                hashes: req.seq_hashes.clone(),
                blocks: d.request_blocks,
                cursor: selector.cursor(),
                session: session.clone(),
            });
        }
        let w = d.worker.to_string();
        metrics::counter!("flotilla_router_placements_total", "worker" => w.clone(), "policy" => d.policy.as_str(), "hand_off" => if hand_off { "true" } else { "false" })
            .increment(1);
        metrics::counter!("flotilla_router_prompt_blocks_total")
            .increment(u64::from(d.request_blocks));
        metrics::counter!("flotilla_router_overlap_blocks_total")
            .increment(u64::from(d.overlap_blocks));
        let fetch = if hand_off { None } else { d.fetch };
        if fetch.is_some() {
            metrics::counter!("flotilla_router_fetch_hints_total").increment(1);
        }
        let terms = crate::request_plane::protocol::PlacementTerms {
            policy: d.policy.as_str().to_owned(),
            overlap_blocks: d.overlap_blocks,
            best_overlap_blocks: d.best_overlap_blocks,
            credited_blocks: d.credited_blocks,
            prefill_blocks: d.prefill_blocks,
            decode_blocks: d.decode_blocks,
            cost: d.cost,
            candidates: d.candidates,
            pull_from: fetch.as_ref().map(|f| f.holder.clone()),
            pull_blocks: fetch.as_ref().map(|f| f.blocks),
            session: has_session.then(|| d.affinity.as_str().to_owned()),
        };
        Ok(Some(Placement {
            worker: d.worker,
            hand_off,
            fetch,
            terms: Some(terms),
        }))
    }

    fn on_events(&mut self, events: Vec<KvEvent>, now: u64) {
        for ev in &events {
            match self.index.apply(ev) {
                ApplyOutcome::NeedsResync { worker, reason } => {
                    tracing::warn!(%worker, ?reason, "KV event stream inconsistent; resyncing from a snapshot");
                    metrics::counter!("flotilla_router_resyncs_total").increment(1);
                    self.ask_snapshot(worker, now);
                }
                ApplyOutcome::Applied => {
                    metrics::counter!("flotilla_router_kv_events_total", "outcome" => "applied")
                        .increment(1);
                }
                ApplyOutcome::Buffered | ApplyOutcome::Ignored => {
                    metrics::counter!("flotilla_router_kv_events_total", "outcome" => "held")
                        .increment(1);
                }
            }
        }
    }

    /// Want a snapshot of `worker`'s KV: handed to the driver by
    /// [`Self::take_snapshot_requests`]; a lost answer is asked again after
    /// [`RESYNC_RETRY_MS`].
    fn ask_snapshot(&mut self, worker: WorkerId, now: u64) {
        self.resyncs.insert(worker.clone(), now);
        if !self.snapshots_wanted.contains(&worker) {
            self.snapshots_wanted.push(worker);
        }
    }

    /// The workers whose KV event publisher should send this router a snapshot (their
    /// events had a gap, or the index does not know them yet), asked for since the last
    /// call. The answer comes back through [`Self::snapshot`].
    pub fn take_snapshot_requests(&mut self) -> Vec<WorkerId> {
        std::mem::take(&mut self.snapshots_wanted)
    }

    /// A worker's snapshot, asked for by [`Self::take_snapshot_requests`] (`RouterMsg::Resynced`).
    pub fn snapshot(&mut self, snap: KvSnapshot) {
        self.resyncs.remove(&snap.worker);
        let last = snap.last_event.unwrap_or(EventId(0));
        // A bootstrap snapshot overtaken by a resync (or by events, which the publisher sends
        // in order with its snapshots) is older than what the index holds: not applied.
        let held = self.index.last_event_id(&snap.worker);
        if !self.index.is_pending(&snap.worker) && held.is_some_and(|h| h >= last && h.0 > 0) {
            return;
        }
        let mut tiers = vec![(crate::kv::Tier::Device, snap.blocks.as_slice())];
        tiers.extend(snap.lower.iter().map(|(t, b)| (*t, b.as_slice())));
        let report = self.index.resync_tiers(&snap.worker, last, &tiers);
        tracing::info!(worker = %snap.worker, blocks = snap.blocks.len(), ?report, "resynced from snapshot");
        metrics::gauge!("flotilla_router_index_blocks").set(self.index.num_holdings() as f64);
    }

    /// Forget a worker that left (dead or restarting).
    fn purge(&mut self, worker: &WorkerId) {
        self.snapshots_wanted.retain(|w| w != worker);
        let held = self.index.blocks_of(worker);
        self.index.remove_worker(worker);
        self.load.remove_worker(worker);
        self.resyncs.remove(worker);
        tracing::info!(%worker, held, "worker left; purged from the router");
    }

    /// Publish the prefill queues, if admission on this node reads them.
    pub fn publish_queues(&self) {
        if let Some(q) = &self.queues {
            q.publish(&self.load);
        }
    }

    /// Withdraw the published prefill queues (the router stops).
    pub fn clear_queues(&self) {
        if let Some(q) = &self.queues {
            q.clear();
        }
    }

    /// The periodic step (every second in a node): expire placements and sessions, purge
    /// workers that are gone, want the snapshots that are due.
    pub fn tick(&mut self) {
        let now = self.now_ms();
        self.on_tick(now);
    }

    fn on_tick(&mut self, now: u64) {
        for w in self.housekeeping(now) {
            self.ask_snapshot(w, now);
        }
        // Bootstrap: a live worker the index does not know yet (this router just started or
        // restarted, or the worker just joined) gets a snapshot now, not at its next KV event,
        // which an idle worker may not send for a long time.
        for w in self.workers.alive() {
            let due = self
                .resyncs
                .get(&w)
                .is_none_or(|t| now.saturating_sub(*t) >= RESYNC_RETRY_MS);
            if self.index.last_event_id(&w).is_none() && due {
                self.ask_snapshot(w, now);
            }
        }
        metrics::gauge!("flotilla_router_index_blocks").set(self.index.num_holdings() as f64);
    }

    /// Expire placements older than [`LEASE_TTL_MS`], purge workers whose scheduler is gone;
    /// returns the workers whose resync is due (never asked, or asked [`RESYNC_RETRY_MS`] ago).
    fn housekeeping(&mut self, now: u64) -> Vec<WorkerId> {
        self.load.expire(now, LEASE_TTL_MS);
        self.sessions.expire(now);
        // Peers' placements dropped by expiry or a purged worker leave the origin map too.
        let load = &self.load;
        self.peer_placed.retain(|k, _| load.worker_of(k).is_some());
        let alive = self.workers.alive();
        let known: Vec<WorkerId> = self.index.workers().cloned().collect();
        for w in known.iter().filter(|w| !alive.contains(w)) {
            self.purge(w);
        }
        self.index
            .pending_resyncs()
            .into_iter()
            .map(|(w, _)| w)
            .filter(|w| {
                self.resyncs
                    .get(w)
                    .is_none_or(|t| now.saturating_sub(*t) >= RESYNC_RETRY_MS)
            })
            .collect()
    }
}

/// A tie offset drawn from the request (its id and node, mixed), for
/// [`Selector::spread_next`].
fn spread_of(key: &RequestKey) -> u64 {
    crate::runtime::ids::mix64(
        key.request.0 ^ xxhash_rust::xxh3::xxh3_64(key.node.as_str().as_bytes()),
    )
}

#[cfg(test)]
mod tests;
