//! Router: places each request on a live worker, KV-aware by default.
//!
//! The pure parts it drives are in `request_plane/router/`: the prefix index (`index.rs`), the
//! active load (`load.rs`) and the policies (`policy.rs`).
//!
//! Any node with the `router` role runs one Router, in the process group [`ROUTER_GROUP`];
//! gateways ask their own node's router first. Every router consumes every KV event (a
//! [`KvEventsRelay`] joins [`KV_EVENTS_GROUP`], the KV event publishers broadcast to it), so
//! all routers converge on the same index. The relay is the router's sibling under a
//! one_for_all supervisor (`supervisors/tree.rs`): either exiting restarts both, and the
//! restarted index asks every live worker's KV event publisher for a snapshot on its first
//! tick (1 s), as it does for a worker that joins (`flotilla_router_index_blocks` shows the
//! index filling). The policy is `router.policy`; a request may
//! override it with the header [`POLICY_HEADER`] (`x-flotilla-route-policy: round_robin`).
//!
//! # Who can be chosen
//! Only the members of the routable schedulers' group: `ractor_cluster` removes a node's
//! actors from every group as soon as its session drops, so a dead node's workers stop being
//! chosen at once; a draining or hung replica leaves the group itself. A worker that leaves the
//! schedulers' group (dead, restarting) is also purged from the index and the active load at
//! once (a process-group monitor): a cached prefix is never a reason to pick a worker that is
//! gone, and a restarted replica starts from an empty cache. Placements never released (a
//! gateway that died) expire after [`LEASE_TTL_MS`].
//!
//! # Sessions
//! A request with a session key ([`RouteRequest::session`]) goes, under the kv policies, to
//! the worker that served its session's last turn until that worker's queued prefill tokens
//! pass `router.session_max_queued_tokens`; then the cost decides and the session moves
//! (`router/policy.rs`, "Sessions that stick"). The table of sessions
//! ([`SessionTable`], `router.session_capacity` / `router.session_ttl_ms`) is shared like the
//! load: every `Routed` change told to the other routers names its session, and they record it
//! as their own, so a session's next turn sticks whichever router places it. Disaggregated,
//! the session sticks to its **decode** (or aggregated) worker, which holds its history after
//! each turn: the sticky decode worker still hands a long uncached suffix to a prefill worker
//! (the rule below, on its own overlap), and the hand-off's prefill placement does not move
//! the session. The `placed` line says `session=kept|released|none` for a request with a key.
//!
//! # Disaggregation
//! Replicas have a [`Role`] (their schedulers join the role's process group). Whole requests
//! go to aggregated and decode workers (prefill workers only when no other is routable). When
//! the Request allows it ([`RouteRequest::remote_prefill`]), the chosen worker is a decode
//! worker, and the part of the prompt it does not hold is at least
//! `disagg.min_prefill_tokens`, the prompt goes to a prefill worker instead, chosen by the
//! same policy among the prefill workers (on their own prefix overlap), unless that worker
//! already has more than `disagg.max_prefill_queue_tokens` prompt tokens queued (Dynamo's
//! conditional disaggregation). The answer ([`Placement::hand_off`]) tells the Request to
//! submit a prefill-only attempt; the decode attempt that follows is routed again, without
//! remote prefill, and pulls the KV.
//!
//! # Injected
//! The Router reads time from a [`Clock`](crate::runtime::clock::Clock) and the workers it may choose from a
//! [`WorkerSource`] ([`RouterArgs`]): in a node these are the system clock and the process
//! groups ([`ProcessGroups`]); unit tests drive the same state with a `ManualClock` and a fixed
//! list of workers.

use crate::request_plane::router::{index, load, policy, sync};

use crate::actors::kv_publisher::{
    KV_EVENTS_GROUP, KV_PUBLISHER_GROUP, KvEventsMsg, KvPublisherMsg, KvSnapshot,
};
use crate::kv::KvEvent;
use crate::request_plane::events::FleetEventKind;
use crate::request_plane::protocol::{Placement, RouteRequest};
use crate::runtime::clock::{Instant, SharedClock};
use crate::runtime::ids::{EventId, NodeId, RequestId, WorkerId};
use crate::runtime::role::Role;
use crate::runtime::role::role_group;
use crate::runtime::wire::Wire;
use crate::worker::scheduler::{ROUTABLE_GROUP, SCHEDULER_GROUP};
use index::{ApplyOutcome, PrefixIndex};
use load::{ActiveLoad, RequestKey};
use policy::session::SessionTable;
use policy::{Decision, Policy, Selector, SelectorConfig};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use std::collections::HashMap;
use std::sync::Arc;

/// Process group of every Router.
pub const ROUTER_GROUP: &str = "flotilla.routers";
/// Placements older than this are released (ms).
pub const LEASE_TTL_MS: u64 = 30 * 60 * 1000;
/// HTTP header that overrides the routing policy for one request.
pub const POLICY_HEADER: &str = "x-flotilla-route-policy";
/// A resync asked for and not answered within this long is asked again (ms).
pub const RESYNC_RETRY_MS: u64 = 2_000;

/// Router messages (serializable: gateways on any node ask).
#[derive(RactorClusterMessage)]
pub enum RouterMsg {
    /// Pick a worker (call); `None` when no worker is live.
    #[rpc]
    Route(Wire<RouteRequest>, RpcReplyPort<Wire<Option<Placement>>>),
    /// The request's first token arrived: its prompt is no longer waiting for prefill (cast).
    FirstToken(Wire<(NodeId, RequestId)>),
    /// The request ended (cast).
    Release(Wire<(NodeId, RequestId)>),
    /// KV events from a KV event publisher (cast, via the relay).
    KvEvents(Wire<Vec<KvEvent>>),
    /// A snapshot asked for after a gap (local cast).
    Resynced(Wire<KvSnapshot>),
    /// Local, periodic: expire placements, retry lost resyncs.
    Tick(Wire<()>),
    /// Another router's changes to its load: its registered name and the changes (cast;
    /// `router.share_load`).
    PeerLoad(Wire<(String, Vec<sync::LoadChange>)>),
}

/// The Router actor (see [`RouterArgs`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct Router;

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

/// The workers of the cluster, read from the schedulers' process groups.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessGroups;

impl WorkerSource for ProcessGroups {
    fn routable(&self) -> Vec<WorkerId> {
        live_workers()
    }

    fn alive(&self) -> Vec<WorkerId> {
        workers_in(SCHEDULER_GROUP)
    }

    fn in_role(&self, role: Role) -> Vec<WorkerId> {
        role_group(role).map(workers_in).unwrap_or_default()
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

/// What a Router starts with.
#[derive(Clone)]
pub struct RouterArgs {
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
    /// The node's fleet event bus (workers joining and leaving).
    pub bus: crate::request_plane::events::EventBus,
    /// Registered name of this router's [`KvEventsRelay`]: publishers send the snapshots it
    /// asks for there.
    pub relay: Option<String>,
    /// Tell the other routers every change to this router's load and count theirs
    /// (`router.share_load`; `load.rs`, "Several routers").
    pub share_load: bool,
    /// Which worker served each session's last turn, empty at start, bounded by
    /// `router.session_capacity` and `router.session_ttl_ms` (`policy/session.rs`).
    pub sessions: SessionTable,
}

impl RouterArgs {
    /// A router on the system clock that reads the process groups.
    pub fn new(config: SelectorConfig) -> Self {
        Self {
            config,
            clock: crate::runtime::clock::system(),
            workers: Arc::new(ProcessGroups),
            disagg: DisaggRouting::default(),
            queues: None,
            bus: Default::default(),
            relay: None,
            share_load: true,
            sessions: SessionTable::default(),
        }
    }
}

/// Router state.
pub struct RouterState {
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
    bus: crate::request_plane::events::EventBus,
    relay: Option<String>,
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
}

/// Workers a router may choose: members of the routable schedulers' group (alive, healthy,
/// not draining), by worker id (`<worker>/scheduler`).
pub fn live_workers() -> Vec<WorkerId> {
    workers_in(ROUTABLE_GROUP)
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

fn workers_in(group: &str) -> Vec<WorkerId> {
    ractor::pg::get_members(&group.to_owned())
        .iter()
        .filter_map(worker_of_scheduler)
        .collect()
}

/// The worker id of a scheduler actor (registered as `<worker>/scheduler`).
fn worker_of_scheduler(cell: &ractor::ActorCell) -> Option<WorkerId> {
    cell.get_name()?
        .strip_suffix("/scheduler")
        .map(WorkerId::new)
}

impl RouterState {
    /// Empty state: no index, no load, one selector for the configured policy.
    ///
    /// # Errors
    /// The selector configuration is invalid (see [`Selector::new`]).
    pub fn new(args: RouterArgs) -> Result<Self, policy::SelectorConfigError> {
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
            bus: args.bus,
            relay: args.relay,
            share_load: args.share_load,
            shared: Vec::new(),
            peer_placed: HashMap::new(),
            peers: Default::default(),
            sessions: args.sessions,
        })
    }

    /// Milliseconds since this router started, on its clock.
    fn now_ms(&self) -> u64 {
        self.clock
            .now()
            .saturating_duration_since(self.epoch)
            .as_millis() as u64
    }

    /// Place a request now (on the router's clock): the pure entry of
    /// [`RouterMsg::Route`], for drivers without an actor (tests, the offline simulator).
    ///
    /// # Errors
    /// The request names a policy whose selector cannot be built.
    pub fn place(&mut self, req: RouteRequest) -> Result<Option<Placement>, ActorProcessingErr> {
        let now = self.now_ms();
        self.route(req, now)
    }

    /// A placed request's first token came ([`RouterMsg::FirstToken`]).
    pub fn first_token(&mut self, node: NodeId, request: RequestId) {
        let now = self.now_ms();
        self.on_first_token(node, request, now);
    }

    /// A placed request ended ([`RouterMsg::Release`]).
    pub fn release(&mut self, node: NodeId, request: RequestId) {
        self.on_release(node, request);
    }

    /// Changes to this router's load since the last call, for the other routers
    /// ([`RouterMsg::PeerLoad`]); always empty without `share_load`.
    pub fn take_shared(&mut self) -> Vec<sync::LoadChange> {
        std::mem::take(&mut self.shared)
    }

    /// Another router's changes to its load ([`RouterMsg::PeerLoad`]), counted here as if
    /// this router had made them; `from` names that router (its placements are forgotten
    /// when it leaves: [`RouterState::router_left`]). Ignored without `share_load`.
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

    /// KV events of the workers ([`RouterMsg::KvEvents`]).
    pub fn kv_events(&mut self, events: Vec<KvEvent>) {
        let now = self.now_ms();
        self.on_events(events, now);
    }

    /// Requests placed and not yet released.
    /// `worker` left its groups (died, restarts, retired): forget what it held, its load and
    /// any resync asked for — what the live router does when a scheduler leaves its group
    /// (for drivers without process groups: the simulator).
    pub fn worker_left(&mut self, worker: &WorkerId) {
        self.purge(worker);
    }

    /// The prefix index.
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    pub fn placed(&self) -> usize {
        self.load.len()
    }

    /// Make sure a selector for `policy` exists.
    fn ensure_selector(&mut self, policy: Policy) -> Result<(), ActorProcessingErr> {
        if !self.selectors.contains_key(&policy) {
            let config = SelectorConfig {
                policy,
                ..self.config.clone()
            };
            self.selectors
                .insert(policy, Selector::new(config).map_err(|e| e.to_string())?);
        }
        Ok(())
    }

    /// Places a request (see the module doc, "Disaggregation").
    fn route(
        &mut self,
        req: RouteRequest,
        now: u64,
    ) -> Result<Option<Placement>, ActorProcessingErr> {
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

    /// Ask `worker`'s KV event publisher for a snapshot, cast back as `Resynced` (no task, no
    /// call: a lost answer is asked again after [`RESYNC_RETRY_MS`]).
    fn ask_snapshot(&mut self, worker: WorkerId, now: u64) {
        self.resyncs.insert(worker.clone(), now);
        let name = format!("{worker}/kv_publisher");
        let Some(kvm) = crate::runtime::cluster::member_named(KV_PUBLISHER_GROUP, &name) else {
            return; // gone: purged when its scheduler leaves
        };
        let Some(relay) = &self.relay else {
            return; // a router without a relay hears no events, so needs no snapshot
        };
        let kvm: ActorRef<KvPublisherMsg> = kvm.into();
        let _ = kvm.cast(KvPublisherMsg::SnapshotFor(Wire::encode(relay)));
    }

    fn on_snapshot(&mut self, snap: KvSnapshot) {
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
        let held = self.index.blocks_of(worker);
        self.index.remove_worker(worker);
        self.load.remove_worker(worker);
        self.resyncs.remove(worker);
        tracing::info!(%worker, held, "worker left; purged from the router");
    }

    /// Publish the prefill queues, if admission here reads them.
    fn publish_queues(&self) {
        if let Some(q) = &self.queues {
            q.publish(&self.load);
        }
    }

    fn tick(&mut self, now: u64) {
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

impl Actor for Router {
    type Msg = RouterMsg;
    type State = RouterState;
    type Arguments = RouterArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: RouterArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut state = RouterState::new(args).map_err(|e| e.to_string())?;
        // A restarted router starts from an empty index.
        metrics::gauge!("flotilla_router_index_blocks").set(0.0);
        for c in ractor::pg::get_members(&ROUTER_GROUP.to_owned()) {
            if let Some(name) = c.get_name() {
                state.router_joined(&name);
            }
        }
        ractor::pg::join(ROUTER_GROUP.to_owned(), vec![myself.get_cell()]);
        ractor::pg::monitor(SCHEDULER_GROUP.to_owned(), myself.get_cell());
        ractor::pg::monitor(ROUTER_GROUP.to_owned(), myself.get_cell());
        myself.send_interval(std::time::Duration::from_secs(1), || {
            RouterMsg::Tick(Wire::encode(&()))
        });
        Ok(state)
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: ractor::SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        use ractor::SupervisionEvent as E;
        match event {
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Leave(_, group, gone))
                if group == SCHEDULER_GROUP =>
            {
                for w in gone.iter().filter_map(worker_of_scheduler) {
                    state.purge(&w);
                    state.bus.emit(FleetEventKind::WorkerDown { worker: w });
                }
                state.publish_queues();
            }
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Leave(_, group, gone))
                if group == ROUTER_GROUP =>
            {
                for name in gone.iter().filter_map(ractor::ActorCell::get_name) {
                    let dropped = state.router_left(&name);
                    tracing::info!(router = %name, dropped, "router left; its placements forgotten");
                }
                state.publish_queues();
            }
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Join(_, group, came))
                if group == ROUTER_GROUP =>
            {
                for name in came.iter().filter_map(ractor::ActorCell::get_name) {
                    if Some(&name) != myself.get_name().as_ref() {
                        state.router_joined(&name);
                    }
                }
            }
            E::ProcessGroupChanged(ractor::pg::GroupChangeMessage::Join(_, group, came))
                if group == SCHEDULER_GROUP =>
            {
                for worker in came.iter().filter_map(worker_of_scheduler) {
                    state.bus.emit(FleetEventKind::WorkerUp { worker });
                }
            }
            _ => {}
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let now = state.now_ms();
        // KV events and resyncs change the index, not the load.
        let changes_load = !matches!(msg, RouterMsg::KvEvents(_) | RouterMsg::Resynced(_));
        match msg {
            RouterMsg::Route(wire, reply) => {
                let pick = match wire.decode() {
                    Ok(req) => route_traced(state, req, now)?,
                    Err(_) => None,
                };
                let _ = reply.send(Wire::encode(&pick));
            }
            RouterMsg::FirstToken(wire) => {
                if let Ok((node, request)) = wire.decode() {
                    state.on_first_token(node, request, now);
                }
            }
            RouterMsg::Release(wire) => {
                if let Ok((node, request)) = wire.decode() {
                    state.on_release(node, request);
                }
            }
            RouterMsg::PeerLoad(wire) => {
                if let Ok((from, changes)) = wire.decode() {
                    state.on_peer_load(&from, changes, now);
                }
            }
            RouterMsg::KvEvents(wire) => {
                if let Ok(events) = wire.decode() {
                    state.on_events(events, now);
                }
            }
            RouterMsg::Resynced(wire) => {
                if let Ok(snap) = wire.decode() {
                    state.on_snapshot(snap);
                }
            }
            RouterMsg::Tick(_) => state.tick(now),
        }
        tell_peers(&myself, state.take_shared());
        if changes_load {
            state.publish_queues();
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(q) = &state.queues {
            q.clear();
        }
        Ok(())
    }
}

/// A tie offset drawn from the request (its id and node, mixed), for
/// [`Selector::spread_next`].
fn spread_of(key: &RequestKey) -> u64 {
    crate::runtime::ids::mix64(
        key.request.0 ^ xxhash_rust::xxh3::xxh3_64(key.node.as_str().as_bytes()),
    )
}

/// The tracing target of the router's `placed` lines: `FLOTILLA_LOG=info,flotilla::placement=off`
/// turns them off.
pub const PLACEMENT_TARGET: &str = "flotilla::placement";

/// Place `req` (its [`RouteRequest::trace_id`] and `traceparent` used for the logs only):
/// one `placed` line at info under [`PLACEMENT_TARGET`] with the request id, the chosen
/// worker and the cost terms (or `no worker`), inside a `route` span joined to the gateway's
/// trace when an OTLP export runs (no span otherwise).
fn route_traced(
    state: &mut RouterState,
    mut req: RouteRequest,
    now: u64,
) -> Result<Option<Placement>, ActorProcessingErr> {
    let id = req.trace_id.take().unwrap_or_else(|| "-".to_owned());
    let span = match req.traceparent.take() {
        Some(tp) => {
            let span = tracing::info_span!(target: PLACEMENT_TARGET, "route", request_id = %id);
            crate::runtime::otlp::adopt_remote_parent(&span, Some(&tp));
            span
        }
        None => tracing::Span::none(),
    };
    let _in = span.enter();
    let (node, request) = (req.node.clone(), req.request);
    let pick = state.route(req, now)?;
    match &pick {
        Some(p) => {
            let t = p.terms.as_ref();
            tracing::info!(target: PLACEMENT_TARGET, request_id = %id, gateway = %node, %request,
                worker = %p.worker, hand_off = p.hand_off,
                overlap_blocks = t.map(|t| t.overlap_blocks), cost = t.map(|t| t.cost),
                session = t.and_then(|t| t.session.as_deref()),
                "placed");
        }
        None => {
            tracing::info!(target: PLACEMENT_TARGET, request_id = %id, gateway = %node, %request, "no worker to place on");
        }
    }
    Ok(pick)
}

/// Casts `changes` (this router's, `router.share_load`) to every other router in
/// [`ROUTER_GROUP`], once per router per batch. A router that is gone is skipped: its
/// placements are forgotten by the others when it leaves the group.
fn tell_peers(myself: &ActorRef<RouterMsg>, changes: Vec<sync::LoadChange>) {
    if changes.is_empty() {
        return;
    }
    let Some(name) = myself.get_name() else {
        return;
    };
    let peers: Vec<ActorRef<RouterMsg>> = ractor::pg::get_members(&ROUTER_GROUP.to_owned())
        .into_iter()
        .filter(|c| c.get_id() != myself.get_id())
        .map(Into::into)
        .collect();
    if peers.is_empty() {
        return;
    }
    let wire = Wire::encode(&(name, changes));
    for p in peers {
        if p.cast(RouterMsg::PeerLoad(wire.clone())).is_err() {
            metrics::counter!("flotilla_router_peer_sync_failures_total").increment(1);
        }
    }
}

/// Joins [`KV_EVENTS_GROUP`] on behalf of its router and hands every batch of KV events on.
/// (A separate actor because KV event publishers cast [`KvEventsMsg`] to the group's members.)
/// Started after its router, beside it, by the node's tree.
#[derive(Debug, Default, Clone, Copy)]
pub struct KvEventsRelay;

impl Actor for KvEventsRelay {
    type Msg = KvEventsMsg;
    type State = ActorRef<RouterMsg>;
    type Arguments = ActorRef<RouterMsg>;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        router: ActorRef<RouterMsg>,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join(KV_EVENTS_GROUP.to_owned(), vec![myself.get_cell()]);
        Ok(router)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        router: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let to_router = match msg {
            KvEventsMsg::Publish(events) => RouterMsg::KvEvents(events),
            KvEventsMsg::Snapshot(snapshot) => RouterMsg::Resynced(snapshot),
        };
        router
            .cast(to_router)
            .map_err(|e| format!("router gone: {e}"))?;
        Ok(())
    }
}

/// A router to ask: this node's if it runs one, else any.
pub fn find_router() -> Option<ActorRef<RouterMsg>> {
    let members = ractor::pg::get_members(&ROUTER_GROUP.to_owned());
    members
        .iter()
        .find(|c| c.get_id().is_local())
        .or_else(|| members.first())
        .cloned()
        .map(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::clock::ManualClock;
    use std::sync::Mutex;
    use std::time::Duration;

    /// Workers set by the test.
    #[derive(Default)]
    struct Fixed {
        routable: Mutex<Vec<WorkerId>>,
        alive: Mutex<Vec<WorkerId>>,
        prefill: Mutex<Vec<WorkerId>>,
        decode: Mutex<Vec<WorkerId>>,
    }

    impl Fixed {
        fn set(&self, routable: &[&str], alive: &[&str]) {
            *self.routable.lock().unwrap() = ws(routable);
            *self.alive.lock().unwrap() = ws(alive);
        }
    }

    impl WorkerSource for Fixed {
        fn routable(&self) -> Vec<WorkerId> {
            self.routable.lock().unwrap().clone()
        }
        fn alive(&self) -> Vec<WorkerId> {
            self.alive.lock().unwrap().clone()
        }
        fn in_role(&self, role: Role) -> Vec<WorkerId> {
            match role {
                Role::Prefill => self.prefill.lock().unwrap().clone(),
                Role::Decode => self.decode.lock().unwrap().clone(),
                Role::Aggregated => vec![],
            }
        }
    }

    fn router(policy: Policy) -> (RouterState, ManualClock, Arc<Fixed>) {
        let clock = ManualClock::new();
        let workers = Arc::new(Fixed::default());
        let state = RouterState::new(RouterArgs {
            config: SelectorConfig {
                policy,
                ..SelectorConfig::default()
            },
            clock: Arc::new(clock.clone()),
            workers: workers.clone(),
            disagg: DisaggRouting::default(),
            queues: None,
            bus: Default::default(),
            relay: None,
            share_load: true,
            sessions: SessionTable::default(),
        })
        .unwrap();
        (state, clock, workers)
    }

    /// Stored events: worker `w{i % 8}` holds the first `4 + i % 5` blocks of prefix `i`
    /// (prefix `i`'s block `b` has sequence hash `1000 i + b`), one event per prefix, ids
    /// counting per worker.
    fn fleet_events(prefixes: u64) -> Vec<KvEvent> {
        use crate::kv::{KvEventData, StoredBlock, Tier};
        let mut next: HashMap<u64, u64> = HashMap::new();
        (0..prefixes)
            .map(|i| {
                let id = next.entry(i % 8).or_insert(0);
                *id += 1;
                KvEvent {
                    worker: WorkerId::new(format!("w{}", i % 8)),
                    event_id: EventId(*id),
                    tier: Tier::Device,
                    data: KvEventData::Stored {
                        parent: None,
                        blocks: (0..4 + i % 5)
                            .map(|b| StoredBlock {
                                seq_hash: crate::runtime::ids::SequenceHash(1000 * i + b),
                                block_hash: crate::runtime::ids::BlockHash(1000 * i + b),
                            })
                            .collect(),
                    },
                }
            })
            .collect()
    }

    /// Request `n`: 12 blocks, the first `n % 9` of prefix `n % 13`, the rest its own.
    fn prefix_req(n: u64) -> RouteRequest {
        let p = n % 13;
        let shared = n % 9;
        let hashes = (0..12)
            .map(|b| {
                let h = if b < shared {
                    1000 * p + b
                } else {
                    1_000_000 * (n + 1) + b
                };
                crate::runtime::ids::SequenceHash(h)
            })
            .collect();
        RouteRequest {
            prompt_tokens: 12 * 16,
            seq_hashes: hashes,
            ..req(n)
        }
    }

    /// Routers `rs` take requests in turn and tell each other every change at once: each
    /// placement must be the one a single router taking them all makes.
    fn shared_routers_place_like_one(policy: Policy) {
        let all: Vec<String> = (0..8).map(|i| format!("w{i}")).collect();
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let (mut one, _, w1) = router(policy);
        w1.set(&all, &all);
        // It stands for routers that know of each other (ties spread by request).
        one.router_joined("r-other");
        let mut rs: Vec<RouterState> = (0..4)
            .map(|k| {
                let (mut r, _, w) = router(policy);
                w.set(&all, &all);
                for other in (0..4).filter(|o| *o != k) {
                    r.router_joined(&format!("r{other}"));
                }
                r
            })
            .collect();
        let events = fleet_events(13);
        one.kv_events(events.clone());
        for r in &mut rs {
            r.kv_events(events.clone());
        }
        let mut spread = std::collections::HashSet::new();
        for n in 0..200u64 {
            let k = (n % 4) as usize;
            let expect = one.place(prefix_req(n)).unwrap().unwrap();
            let got = rs[k].place(prefix_req(n)).unwrap().unwrap();
            assert_eq!(got, expect, "request {n} on router {k}");
            spread.insert(got.worker.clone());
            // Some requests end, some see their first token, through the router that placed
            // them (FirstToken and Release go to the request's router).
            let node = NodeId::new("gw");
            if n % 3 == 0 {
                one.first_token(node.clone(), RequestId(n));
                rs[k].first_token(node.clone(), RequestId(n));
            }
            if n >= 5 && n % 2 == 0 {
                one.release(node.clone(), RequestId(n - 5));
                rs[((n - 5) % 4) as usize].release(node, RequestId(n - 5));
            }
            for from in 0..rs.len() {
                let changes = rs[from].take_shared();
                for (to, r) in rs.iter_mut().enumerate() {
                    if to != from {
                        r.peer_load(&format!("r{from}"), changes.clone());
                    }
                }
            }
        }
        assert!(
            spread.len() >= 4,
            "the workload exercises the load, not one worker"
        );
        for r in &rs {
            assert_eq!(
                r.placed(),
                one.placed(),
                "every router counts every placement"
            );
        }
    }

    #[test]
    fn routers_that_share_their_load_place_like_one_router() {
        shared_routers_place_like_one(Policy::Kv);
        shared_routers_place_like_one(Policy::DynamoKv);
        shared_routers_place_like_one(Policy::LeastLoaded);
        shared_routers_place_like_one(Policy::RoundRobin);
    }

    #[test]
    fn routers_that_do_not_share_their_load_pile_onto_the_same_idle_worker() {
        let all = ["w0", "w1", "w2", "w3"];
        let mut rs: Vec<RouterState> = (0..4)
            .map(|_| {
                let (mut r, _, w) = router(Policy::Kv);
                r.share_load = false;
                w.set(&all, &all);
                r
            })
            .collect();
        // Four cold requests, one per router, nothing cached: each router sees an idle
        // fleet and takes the first worker.
        let picks: std::collections::HashSet<WorkerId> = (0..4)
            .map(|k| rs[k].place(req(k as u64)).unwrap().unwrap().worker)
            .collect();
        assert_eq!(picks.len(), 1, "independent routers collide: {picks:?}");
        assert!(rs.iter_mut().all(|r| r.take_shared().is_empty()));
    }

    #[test]
    fn a_router_that_leaves_takes_its_placements_with_it() {
        let (mut a, _, wa) = router(Policy::LeastLoaded);
        let (mut b, _, wb) = router(Policy::LeastLoaded);
        wa.set(&["w0", "w1"], &["w0", "w1"]);
        wb.set(&["w0", "w1"], &["w0", "w1"]);
        let p = a.place(req(1)).unwrap().unwrap();
        b.peer_load("ra", a.take_shared());
        assert_eq!(b.load.in_flight(&p.worker), 1, "b counts a's placement");
        // b's own next pick avoids the busy worker.
        let q = b.place(req(2)).unwrap().unwrap();
        assert_ne!(q.worker, p.worker);
        // A release through b of a's request is told to a too.
        b.release(NodeId::new("gw"), RequestId(1));
        a.peer_load("rb", b.take_shared());
        assert_eq!(a.load.in_flight(&p.worker), 0);
        assert_eq!(a.load.in_flight(&q.worker), 1, "b's placement reached a");
        // b leaves: a forgets what b placed, and only that.
        let (mut c, _, wc) = router(Policy::LeastLoaded);
        wc.set(&["w0", "w1"], &["w0", "w1"]);
        c.place(req(3)).unwrap();
        a.peer_load("rc", c.take_shared());
        assert_eq!(a.router_left("rb"), 1);
        assert_eq!(a.placed(), 1, "c's placement stays");
        // c's worker dies: its placement goes, and so does the note of who placed it.
        let w = a
            .load
            .worker_of(&RequestKey::new(NodeId::new("gw"), RequestId(3)))
            .cloned();
        a.worker_left(&w.unwrap());
        let now = a.now_ms();
        a.housekeeping(now);
        assert_eq!(a.placed(), 0);
        assert!(
            a.peer_placed.is_empty(),
            "no origin kept for a placement gone"
        );
    }

    #[test]
    fn a_queued_request_moves_only_to_a_shorter_queue() {
        let (mut r, _, workers) = router(Policy::LeastLoaded);
        // Four requests of 32 tokens wait on w0, the only worker; then w1 joins.
        workers.set(&["w0"], &["w0"]);
        for n in 1..=4 {
            assert_eq!(
                r.place(req(n)).unwrap().unwrap().worker,
                WorkerId::new("w0")
            );
        }
        workers.set(&["w0", "w1"], &["w0", "w1"]);
        // Each queued request asks with a fresh attempt id, naming the attempt it would move;
        // a move releases the old placement at once (the Request's own release comes later
        // and changes nothing), so asks in the same moment see the queue as it will be.
        let ask = |n: u64, old: u64| RouteRequest {
            rebalance: Some(RequestId(old)),
            ..req(n)
        };
        let p = r.place(ask(11, 1)).unwrap().expect("w1 is idle: move");
        assert_eq!(p.worker, WorkerId::new("w1"));
        assert_eq!(r.load.prefill_tokens(&WorkerId::new("w0")), 96);
        let p = r
            .place(ask(12, 2))
            .unwrap()
            .expect("32 + 32 there, 96 - 32 here: move");
        assert_eq!(p.worker, WorkerId::new("w1"));
        r.release(NodeId::new("gw"), RequestId(2));
        // Now 64 and 64: a move would only turn the imbalance around.
        assert!(r.place(ask(13, 3)).unwrap().is_none(), "stays");
        assert_eq!(r.load.prefill_tokens(&WorkerId::new("w0")), 64);
        assert_eq!(r.load.prefill_tokens(&WorkerId::new("w1")), 64);
        // An attempt this router no longer knows, or no other worker: nowhere to go.
        assert!(r.place(ask(14, 99)).unwrap().is_none());
        workers.set(&["w0"], &["w0"]);
        assert!(r.place(ask(15, 4)).unwrap().is_none());
    }

    fn req(n: u64) -> RouteRequest {
        RouteRequest {
            node: NodeId::new("gw"),
            request: RequestId(n),
            prompt_tokens: 32,
            seq_hashes: vec![],
            policy: None,
            avoid: vec![],
            rebalance: None,
            remote_prefill: false,
            trace_id: None,
            traceparent: None,
            session: None,
        }
    }

    fn turn(n: u64, session: &str) -> RouteRequest {
        RouteRequest {
            session: Some(session.to_owned()),
            ..req(n)
        }
    }

    #[test]
    fn a_sessions_turns_stick_and_another_router_adopts_its_affinity() {
        let all = ["w0", "w1", "w2", "w3"];
        let (mut a, _, wa) = router(Policy::Kv);
        let (mut b, _, wb) = router(Policy::Kv);
        // Turns' prompts are never first-tokened here: they pile up in the queue.
        for r in [&mut a, &mut b] {
            r.config.session_max_queued_tokens = 16_384;
            r.selectors.clear();
        }
        wa.set(&all, &all);
        wb.set(&all, &all);
        a.router_joined("rb");
        b.router_joined("ra");
        let first = a.place(turn(1, "s")).unwrap().unwrap();
        assert_eq!(
            first.terms.as_ref().unwrap().session.as_deref(),
            Some("none")
        );
        b.peer_load("ra", a.take_shared());
        // Turns of "s" end and new ones come, through either router, while other requests
        // load the fleet: every turn goes to the first worker.
        for n in 2..12u64 {
            let r = if n % 2 == 0 { &mut b } else { &mut a };
            let p = r.place(turn(n, "s")).unwrap().unwrap();
            assert_eq!(p.worker, first.worker, "turn {n}");
            assert_eq!(p.terms.as_ref().unwrap().session.as_deref(), Some("kept"));
            r.place(req(100 + n)).unwrap();
            let changes = r.take_shared();
            let other = if n % 2 == 0 { &mut a } else { &mut b };
            other.peer_load(if n % 2 == 0 { "rb" } else { "ra" }, changes);
        }
        // Avoided (it failed this request): placed elsewhere, and the session moves there
        // for both routers.
        let mut moved = turn(50, "s");
        moved.avoid = vec![first.worker.clone()];
        let p = a.place(moved).unwrap().unwrap();
        assert_ne!(p.worker, first.worker);
        assert_eq!(
            p.terms.as_ref().unwrap().session.as_deref(),
            Some("released")
        );
        b.peer_load("ra", a.take_shared());
        let q = b.place(turn(51, "s")).unwrap().unwrap();
        assert_eq!(q.worker, p.worker, "b adopted a's new affinity");
        // Requests without a session say nothing of one.
        assert_eq!(
            b.place(req(60)).unwrap().unwrap().terms.unwrap().session,
            None
        );
    }

    #[test]
    fn a_saturated_sessions_worker_releases_it() {
        let (mut r, _, workers) = router(Policy::Kv);
        r.config.session_max_queued_tokens = 100;
        r.selectors.clear();
        workers.set(&["w0", "w1"], &["w0", "w1"]);
        let first = r.place(turn(1, "s")).unwrap().unwrap().worker;
        // Turn 1 has not seen its first token: its 32 tokens are queued, under 100.
        let p = r.place(turn(2, "s")).unwrap().unwrap();
        assert_eq!(p.worker, first);
        // A long turn (64 tokens queued after 64: still at most 100) takes it past 100.
        let mut long = turn(3, "s");
        long.prompt_tokens = 64;
        assert_eq!(r.place(long).unwrap().unwrap().worker, first);
        let p = r.place(turn(9, "s")).unwrap().unwrap();
        assert_ne!(p.worker, first, "over 100 queued tokens: released");
        assert_eq!(p.terms.unwrap().session.as_deref(), Some("released"));
        let p = r.place(turn(10, "s")).unwrap().unwrap();
        assert_ne!(p.worker, first, "the session moved");
    }

    #[test]
    fn no_live_worker_no_placement() {
        let (mut r, _, _) = router(Policy::LeastLoaded);
        assert_eq!(r.route(req(1), r.now_ms()).unwrap(), None);
        assert!(r.load.is_empty());
    }

    #[test]
    fn a_placement_sticks_while_its_worker_is_live() {
        let (mut r, _, workers) = router(Policy::RoundRobin);
        workers.set(&["a", "b"], &["a", "b"]);
        let now = r.now_ms();
        let first = r.route(req(1), now).unwrap().unwrap().worker;
        for _ in 0..3 {
            assert_eq!(
                r.route(req(1), now).unwrap().map(|p| p.worker),
                Some(first.clone())
            );
        }
        assert_eq!(r.load.len(), 1);
        // Its worker leaves routing: the request is placed elsewhere.
        let other = if first.as_str() == "a" { "b" } else { "a" };
        workers.set(&[other], &["a", "b"]);
        assert_eq!(
            r.route(req(1), now).unwrap().map(|p| p.worker),
            Some(WorkerId::new(other))
        );
        assert_eq!(r.load.len(), 1, "moved, not duplicated");
    }

    #[test]
    fn placements_expire_on_the_injected_clock() {
        let (mut r, clock, workers) = router(Policy::LeastLoaded);
        workers.set(&["a"], &["a"]);
        r.route(req(1), r.now_ms()).unwrap();
        clock.advance(Duration::from_millis(LEASE_TTL_MS));
        assert!(r.housekeeping(r.now_ms()).is_empty());
        assert_eq!(r.load.len(), 1, "not yet: a lease lasts LEASE_TTL_MS");
        clock.advance(Duration::from_millis(1));
        r.housekeeping(r.now_ms());
        assert!(r.load.is_empty(), "expired past the lease");
    }

    #[test]
    fn released_placements_free_their_worker() {
        let (mut r, _, workers) = router(Policy::LeastLoaded);
        workers.set(&["a"], &["a"]);
        let now = r.now_ms();
        r.route(req(1), now).unwrap();
        r.route(req(2), now).unwrap();
        assert_eq!(r.load.in_flight(&WorkerId::new("a")), 2);
        r.load
            .on_finished(&RequestKey::new(NodeId::new("gw"), RequestId(1)));
        assert_eq!(r.load.in_flight(&WorkerId::new("a")), 1);
    }

    fn ws(names: &[&str]) -> Vec<WorkerId> {
        names.iter().map(|n| WorkerId::new(*n)).collect()
    }

    #[test]
    fn workers_that_failed_a_request_are_avoided_unless_none_is_left() {
        assert_eq!(prefer_not(ws(&["a", "b", "c"]), &[]), ws(&["a", "b", "c"]));
        assert_eq!(
            prefer_not(ws(&["a", "b", "c"]), &ws(&["b"])),
            ws(&["a", "c"])
        );
        assert_eq!(
            prefer_not(ws(&["a", "b"]), &ws(&["a", "b"])),
            ws(&["a", "b"])
        );
        assert_eq!(
            prefer_not(ws(&["a"]), &ws(&["a"])),
            ws(&["a"]),
            "the only one left"
        );
        assert_eq!(prefer_not(vec![], &ws(&["a"])), ws(&[]));
    }

    /// Workers p (prefill), d (decode), a (aggregated); min_prefill_tokens 64.
    fn disagg_router() -> (RouterState, Arc<Fixed>) {
        let (mut r, _, workers) = router(Policy::Kv);
        r.disagg = DisaggRouting {
            min_prefill_tokens: 64,
            max_prefill_queue_tokens: 200,
        };
        workers.set(&["p", "d"], &["p", "d"]);
        *workers.prefill.lock().unwrap() = ws(&["p"]);
        *workers.decode.lock().unwrap() = ws(&["d"]);
        (r, workers)
    }

    fn long(n: u64, tokens: u32) -> RouteRequest {
        RouteRequest {
            prompt_tokens: tokens,
            remote_prefill: true,
            ..req(n)
        }
    }

    #[test]
    fn a_long_uncached_prompt_goes_to_a_prefill_worker_first() {
        let (mut r, _) = disagg_router();
        let now = r.now_ms();
        let p = r.route(long(1, 100), now).unwrap().unwrap();
        assert_eq!(p.worker, WorkerId::new("p"));
        assert!(p.hand_off);
        assert_eq!(
            r.load.prefill_tokens(&WorkerId::new("p")),
            100,
            "booked on p"
        );
        // Short prompts prefill on the decode worker.
        let p = r.route(long(2, 63), now).unwrap().unwrap();
        assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
        // The decode attempt of a hand-off never goes back to a prefill worker.
        let mut decode = long(3, 100);
        decode.remote_prefill = false;
        let p = r.route(decode, now).unwrap().unwrap();
        assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
    }

    #[test]
    fn a_long_prefill_queue_keeps_the_prefill_on_the_decode_worker() {
        let (mut r, _) = disagg_router();
        let now = r.now_ms();
        assert!(r.route(long(1, 150), now).unwrap().unwrap().hand_off);
        // The rule reads p's queue before booking the request: 150 <= 200 still hands off;
        // with 250 queued the decode worker prefills itself.
        assert!(r.route(long(2, 100), now).unwrap().unwrap().hand_off);
        let p = r.route(long(3, 100), now).unwrap().unwrap();
        assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
    }

    #[test]
    fn aggregated_workers_prefill_themselves_and_prefill_workers_serve_when_alone() {
        let (mut r, workers) = disagg_router();
        workers.set(&["p", "a"], &["p", "a"]);
        let now = r.now_ms();
        let p = r.route(long(1, 500), now).unwrap().unwrap();
        assert_eq!((p.worker.as_str(), p.hand_off), ("a", false));
        // Only the prefill worker is left: it serves whole requests.
        workers.set(&["p"], &["p"]);
        let p = r.route(long(2, 500), now).unwrap().unwrap();
        assert_eq!((p.worker.as_str(), p.hand_off), ("p", false));
        // No prefill worker: decode workers prefill everything.
        workers.set(&["d"], &["d"]);
        let p = r.route(long(3, 500), now).unwrap().unwrap();
        assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
    }

    #[test]
    fn disaggregation_off_never_hands_off() {
        let (mut r, _) = disagg_router();
        r.disagg.min_prefill_tokens = 0;
        let p = r.route(long(1, 5000), r.now_ms()).unwrap().unwrap();
        assert_eq!((p.worker.as_str(), p.hand_off), ("d", false));
    }
}
