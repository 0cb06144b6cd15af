//! The request plane's messages, shared by both ends: the gateway side (Request actors,
//! TokenSinks) and the worker side (schedulers). Neither end imports the other's actors for
//! these types; the workers know this module, not the door.
//!
//! - [`SubmitRequest`] — a gateway's Request actor hands one attempt to a worker's scheduler.
//! - [`RouteRequest`] / [`Placement`] — a Request actor asks a Router for a placement.
//! - [`RemoteKv`] — a prefill worker's KV, handed off to a decode worker (disaggregated).
//! - [`TokenEvent`] / [`TokenEventKind`] / [`FinishReason`] — what happened to a request on its
//!   worker, batched per owner in a [`Delivery`] and sent as one [`TokenSinkMsg::Deliver`]
//!   per engine step.
//! - [`Owner`] — who submitted a sequence (a gateway node in one incarnation), and how a worker
//!   finds and checks its sink ([`find_sink`], [`owner_status`]).
//!
//! Every type that crosses nodes travels in a [`Wire`] (MessagePack with named fields), so
//! the encodings here are the cluster's wire format: change them compatibly only.
//!
//! # Owners and incarnations
//! A sequence on a worker is owned by the gateway node that submitted it, in one
//! **incarnation** (the node's start, ms since the Unix epoch): an [`Owner`]. The owner's sink
//! is registered as `<node>/token_sink@<incarnation in hex>` ([`sink_name`]), every delivery
//! names the incarnation it is for, and a sink drops deliveries for another one. So when a
//! gateway node restarts, the events of its old requests (orphans still running on workers)
//! can never reach the new incarnation's requests; and a worker that finds its owner's sink
//! gone ([`owner_status`]: replaced by a newer incarnation at once, or missing for the
//! liveness timeout) aborts the owner's sequences and frees their KV blocks.

pub use crate::kernels::sample::SamplingParams;
pub use crate::request_plane::router::policy::FetchHint;
use crate::request_plane::router::policy::Policy;
use crate::runtime::ids::{NodeId, RequestId, SequenceHash, WorkerId};
use crate::runtime::wire::Wire;
use ractor::ActorRef;
use ractor_cluster::RactorClusterMessage;
use serde::{Deserialize, Serialize};

/// A request handed to a replica.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SubmitRequest {
    /// Request id, unique per submitting node.
    pub request: RequestId,
    /// Node whose TokenSink receives the events.
    pub reply_to: NodeId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: u32,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Token ids that end the sequence (besides EOS).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Incarnation of `reply_to` that submitted it: with `reply_to`, the sequence's
    /// [`Owner`]. When the owner is gone (its node restarted or left),
    /// the scheduler aborts the sequence.
    #[serde(default)]
    pub owner_incarnation: u64,
    /// Since when the client has been waiting for this attempt's next token (ms since the
    /// Unix epoch): the request's arrival at its gateway, or, for a migrated request, when its
    /// last token was delivered. The worker queues by it, first come first served, so that
    /// among the requests re-prefilling after a fault the one whose client has waited longest
    /// goes first: a migrated request keeps its place ahead of later arrivals, and the
    /// requests that move together from fault to fault take turns instead of keeping one
    /// order (ordered by arrival, the last of such a group never reached the front between
    /// faults and was given up).
    #[serde(default)]
    pub waiting_since_ms: u64,
    /// The HTTP request's `x-request-id`, for this worker's log lines about the sequence.
    #[serde(default)]
    pub trace_id: Option<String>,
    /// The gateway's `request` span as a W3C `traceparent` (`00-<trace>-<span>-<flags>`)
    /// when it exports OpenTelemetry spans (`--otlp-endpoint`): the worker's `sequence` span
    /// joins that trace. `None` without an export.
    #[serde(default)]
    pub traceparent: Option<String>,
    /// Disaggregated prefill: compute the prompt's KV, sample the first token, then hand
    /// the sequence off ([`TokenEventKind::HandOff`]) and hold its blocks for a decode worker
    /// to pull, until it confirms (a `Cancel` of this request) or `disagg.hold_ms` passes.
    #[serde(default)]
    pub hand_off: bool,
    /// Disaggregated decode: the KV of the prompt's first [`RemoteKv::tokens`] tokens is held
    /// by a prefill worker; pull what is not cached here, then decode. The prompt ends with
    /// the first token that worker sampled.
    #[serde(default)]
    pub remote_kv: Option<RemoteKv>,
    /// Peer pull (G4): the router found more of the prompt's leading blocks in another
    /// worker's G1 than here; the worker may pull them from that holder instead of
    /// recomputing them (`worker/scheduler.rs`, "Peer pulls"). A hint, never an order.
    #[serde(default)]
    pub fetch: Option<FetchHint>,
    /// Its priority class (`request_plane/priority.rs`), resolved at the gateway: its lane in
    /// the worker's waiting queue. `None`: no class configured.
    #[serde(default)]
    pub class: Option<super::priority::ClassTag>,
    /// The request's session key (`x-session-id` or another configured header, or the body's
    /// `user` when configured; at most 256 visible ASCII bytes, checked at the door): passed
    /// to the router with every attempt ([`RouteRequest::session`]). `None`: no session.
    #[serde(default)]
    pub session: Option<String>,
}

/// The cost terms of one placement (`router/policy.rs`, [`Decision`](super::router::policy::Decision)),
/// for the fleet event bus and the live page. Blocks are KV blocks of the router's
/// `block_size`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementTerms {
    /// The policy that chose (`kv`, `dynamo_kv`, `round_robin`, …).
    pub policy: String,
    /// Leading prompt blocks the chosen worker holds (any tier).
    pub overlap_blocks: u32,
    /// The largest overlap among the candidates.
    pub best_overlap_blocks: u32,
    /// The overlap as the cost counted it, in G1 blocks (the tier credit: lower-tier copies
    /// discounted, pullable blocks credited).
    pub credited_blocks: f64,
    /// The prefill term (blocks).
    pub prefill_blocks: f64,
    /// The decode (load) term (blocks).
    pub decode_blocks: f64,
    /// The cost the policy ranked by (lower is better).
    pub cost: f64,
    /// Workers it chose among.
    pub candidates: usize,
    /// Peer pull: the worker the chosen one pulls leading blocks from, and how many it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_from: Option<WorkerId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_blocks: Option<u32>,
    /// For a request with a session key: `kept` (placed on the session's worker, sticky) or
    /// `released` (that worker was saturated, not live or avoided; the cost chose), or `none`
    /// (a new session); absent without a session key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
}

/// KV a prefill worker holds for a decode worker to pull (disaggregated serving).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RemoteKv {
    /// The prefill worker.
    pub worker: WorkerId,
    /// The prefill attempt's request id there (its node is the submitting gateway): the
    /// decode worker confirms with a `Cancel` of it, which unpins the blocks.
    pub request: RequestId,
    /// The prefill worker's KV region (`None` on a simulated engine: no memory to read).
    pub region: Option<crate::transport::RegionDescriptor>,
    /// Its blocks holding the prompt's KV, in order (`ceil(tokens / block_size)`).
    pub blocks: Vec<u32>,
    /// Prompt tokens whose KV the blocks hold.
    pub tokens: u32,
    /// Until when the prefill worker keeps the blocks pinned (ms since the Unix epoch, its
    /// clock): a pull must be over before then, or the decode worker recomputes.
    pub held_until_ms: u64,
}

impl SubmitRequest {
    /// Who owns the sequence.
    pub fn owner(&self) -> Owner {
        Owner::new(self.reply_to.clone(), self.owner_incarnation)
    }
}

/// A placement request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// Submitting node.
    pub node: NodeId,
    /// Request id on that node.
    pub request: RequestId,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Sequence hash of every full block of the prompt (the KV block manager's recipe).
    #[serde(default)]
    pub seq_hashes: Vec<SequenceHash>,
    /// Policy for this request (`None`: the router's configured one).
    #[serde(default)]
    pub policy: Option<Policy>,
    /// Workers that already failed this request: not chosen unless no other is live.
    #[serde(default)]
    pub avoid: Vec<WorkerId>,
    /// Set when an attempt still queued on its worker asks whether to move (a worker joined
    /// the routable group): that attempt's request id on the same `node`. The router places
    /// the new attempt on another worker only if that worker's prefill queue, this prompt
    /// included, stays no longer than the old worker's without it — and then releases the old
    /// attempt's placement at once, so the next attempt asking sees the queue as it will be —
    /// and answers `None` (stay) otherwise. `None`: an ordinary placement.
    #[serde(default)]
    pub rebalance: Option<RequestId>,
    /// The router may send the prompt to a prefill worker ([`Placement::hand_off`]); false
    /// for a decode attempt that carries remote KV.
    #[serde(default)]
    pub remote_prefill: bool,
    /// The HTTP request's `x-request-id`, for the router's `placed` line.
    #[serde(default)]
    pub trace_id: Option<String>,
    /// The gateway's `request` span as a W3C `traceparent`, as in [`SubmitRequest`].
    #[serde(default)]
    pub traceparent: Option<String>,
    /// The request's session key ([`SubmitRequest::session`]): under the kv policies the
    /// router keeps a session's turns on the worker that served its last one until that
    /// worker saturates (`router/policy.rs`, "Sessions that stick"). `None`: no session.
    #[serde(default)]
    pub session: Option<String>,
}

/// A router's answer: where to submit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// The worker.
    pub worker: WorkerId,
    /// Disaggregated: `worker` is a prefill worker; submit with [`SubmitRequest::hand_off`]
    /// and place the decode attempt when it hands off.
    pub hand_off: bool,
    /// Peer pull: another worker holds more of the prompt than `worker` does, and pulling it
    /// pays (`router/policy.rs`, "Peer pulls"); passed on in [`SubmitRequest::fetch`].
    #[serde(default)]
    pub fetch: Option<FetchHint>,
    /// Why this worker: the router's cost terms for it (`None` for a pinned request or a
    /// placement the router already held). Carried into the `placed` fleet event.
    #[serde(default)]
    pub terms: Option<PlacementTerms>,
}

/// Process group of every TokenSink.
pub const TOKEN_SINK_GROUP: &str = "flotilla.token_sinks";

/// Who submitted a sequence: a gateway node in one incarnation.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Owner {
    /// The submitting node.
    pub node: NodeId,
    /// Its incarnation (start time, ms since the Unix epoch).
    pub incarnation: u64,
}

impl Owner {
    /// `node` in `incarnation`.
    pub fn new(node: NodeId, incarnation: u64) -> Self {
        Self { node, incarnation }
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{:x}", self.node, self.incarnation)
    }
}

/// Registered name of `owner`'s sink: `<node>/token_sink@<incarnation in hex>`.
pub fn sink_name(owner: &Owner) -> String {
    format!("{}/token_sink@{:x}", owner.node, owner.incarnation)
}

/// Whether an owner's sink can be reached from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerStatus {
    /// Its sink is in the group.
    Present,
    /// A sink of the same node in another incarnation is: the owner restarted.
    Replaced,
    /// No sink of that node is (restarting, partitioned or dead).
    Missing,
}

/// The status of `owner` among the members of [`TOKEN_SINK_GROUP`] (one group read).
pub fn owner_status(owner: &Owner) -> OwnerStatus {
    let exact = sink_name(owner);
    let same_node = format!("{}/token_sink@", owner.node);
    let mut status = OwnerStatus::Missing;
    for cell in ractor::pg::get_members(&TOKEN_SINK_GROUP.to_owned()) {
        match cell.get_name() {
            Some(n) if n == exact => return OwnerStatus::Present,
            Some(n) if n.starts_with(&same_node) => status = OwnerStatus::Replaced,
            _ => {}
        }
    }
    status
}

#[doc(no_inline)]
pub use crate::openai::response::FinishReason;

/// What happened to a request on its worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum TokenEventKind {
    /// Admitted: the prompt's leading `cached_tokens` came from the prefix cache.
    Admitted {
        /// Worker serving it.
        worker: WorkerId,
        /// Prompt tokens reused from the prefix cache.
        cached_tokens: u32,
    },
    /// One generated token; `finish` is set on the last one. A `Stop` finish token is the EOS
    /// or stop token itself.
    Token {
        /// Token id.
        id: u32,
        /// Natural-log probability under the unmodified distribution.
        logprob: f32,
        /// Set on the request's last token.
        finish: Option<FinishReason>,
        /// Position of this token among those the worker generated for this submission
        /// (0, 1, 2, …): a gap means events were lost on the way.
        #[serde(default)]
        index: u32,
        /// The most likely tokens at this step with their logprobs (same distribution as
        /// `logprob`), best first, when the request asked for alternatives
        /// (`SamplingParams::top_logprobs`); empty otherwise.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        top: Vec<(u32, f32)>,
    },
    /// Prompt log-probabilities (`SamplingParams::echo_tokens`), sent as the prefill computes
    /// them (one event per prefill chunk, all before the first `Token`): entry `i` scores the
    /// prompt token at position `first + i` — its logprob given the tokens before it, with
    /// the `top_logprobs` most likely tokens at that position and theirs, best first. The
    /// first prompt token (position 0) has none. A prompt computed twice (a preemption, a
    /// migration) sends its positions again: the gateway's Request keeps each position once.
    Prompt {
        /// Position of the token `logprobs[0]` scores (≥ 1).
        first: u32,
        /// `(logprob, [(token id, logprob)])` per scored token, in position order.
        logprobs: Vec<(f32, Vec<(u32, f32)>)>,
    },
    /// The worker will not continue this request (its replica is stopping or draining); what
    /// was generated so far is valid and the request may resume elsewhere (migration). The
    /// gateway's Request actor consumes it; a handler treats it as a 503 failure.
    Lost {
        /// Why, for logs.
        reason: String,
    },
    /// Disaggregated prefill done (after the first token's `Token` event): the prompt's KV
    /// waits, pinned, for a decode worker to pull it. Consumed by the gateway's Request,
    /// which places the decode attempt with it.
    HandOff(Box<RemoteKv>),
    /// The request cannot be served (it will receive nothing more).
    Failed {
        /// Client-safe description.
        message: String,
        /// HTTP status that fits when no byte has reached the client yet: 400 (the request
        /// can never be served), 503 (try again), 500 (a fault).
        status: u16,
    },
}

/// An event for one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    /// The request (unique per submitting node).
    pub request: RequestId,
    /// What happened.
    pub kind: TokenEventKind,
}

/// A batch of events for one owner, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Delivery {
    /// The owner's incarnation these events are for; a sink of another drops them.
    pub incarnation: u64,
    /// The events.
    pub events: Vec<TokenEvent>,
}

/// Messages of the TokenSink (serializable: schedulers on any node send to it).
#[derive(RactorClusterMessage)]
pub enum TokenSinkMsg {
    /// A batch of events, in order. Droppable only if the node is going away.
    Deliver(Wire<Delivery>),
}

/// The sink of `owner`, wherever it runs (local or a peer's proxy).
pub fn find_sink(owner: &Owner) -> Option<ActorRef<TokenSinkMsg>> {
    crate::runtime::cluster::member_named(TOKEN_SINK_GROUP, &sink_name(owner)).map(Into::into)
}

/// Send `events` to `owner`'s sink as one [`TokenSinkMsg::Deliver`]; gives them back when
/// the sink cannot be found or reached (restarting, or the owner gone).
pub fn deliver(owner: &Owner, events: Vec<TokenEvent>) -> Result<(), Vec<TokenEvent>> {
    let delivery = Delivery {
        incarnation: owner.incarnation,
        events,
    };
    let sent = find_sink(owner).is_some_and(|s| {
        s.cast(TokenSinkMsg::Deliver(Wire::encode(&delivery)))
            .is_ok()
    });
    if sent { Ok(()) } else { Err(delivery.events) }
}
