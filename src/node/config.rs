//! One typed configuration tree.
//!
//! Sources, lowest precedence first: built-in defaults → a TOML file (`--config PATH` or
//! `FLOTILLA_CONFIG`) → environment variables `FLOTILLA_<SECTION>__<FIELD>` (for example
//! `FLOTILLA_CLUSTER__LIVENESS_TIMEOUT_MS=5000`) → command-line flags (`--set
//! section.field=value` and the named flags, each a figment key path). Units are in field
//! names; every section has a `Default`; [`Config::validate`] runs once at start and names
//! the offending field.

use crate::actors::gateway::conn::ConnLimits;
use crate::request_plane::router::core::DisaggRouting;
pub use crate::runtime::role::NodeRole;
#[doc(no_inline)]
pub use crate::worker::external::ExternalWorkerConfig;
use crate::worker::scheduler::DisaggWorker;
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

/// The whole configuration.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// This node.
    pub node: NodeConfig,
    /// Cluster membership and liveness.
    pub cluster: ClusterConfig,
    /// HTTP gateway.
    pub gateway: GatewayConfig,
    /// Supervision budgets.
    pub supervision: SupervisionConfig,
    /// Worker nodes.
    pub worker: WorkerConfig,
    /// The chaos API.
    pub chaos: ChaosConfig,
    /// Request placement.
    pub router: RouterConfig,
    /// KV transfer between nodes (`src/transport/`).
    pub transport: crate::transport::TransportConfig,
    /// Batch forming on each replica, beyond `worker`'s limits.
    pub scheduler: SchedulerSection,
    /// Disaggregated prefill and decode (used when some replicas have `worker.role` prefill
    /// or decode).
    pub disagg: DisaggConfig,
    /// Pool sizing (`control/planner.rs`): read by `flotilla sim --planner` today.
    pub planner: crate::control::planner::PlannerConfig,
    /// Priority classes with fair shares (`request_plane/priority.rs`): read by gateways
    /// (a request's class, shedding by class) and `flotilla sim`.
    pub priority: crate::request_plane::priority::PriorityConfig,
}

/// Disaggregated prefill and decode: when a request goes to a prefill worker first, and how
/// long its KV waits there.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggConfig {
    /// A request placed on a decode worker is prefilled remotely when the part of its prompt
    /// that worker does not hold is at least this long (tokens); shorter ones prefill there
    /// (Dynamo's conditional disaggregation, its `max_local_prefill_length`). 0 = never remote.
    /// Default 512: on the project's 2-core VM a 512-token prefill takes about 1.4 s on the
    /// CPU engine, the cost a running decode stream is spared.
    pub min_prefill_tokens: u32,
    /// … and only while the chosen prefill worker has at most this many prompt tokens queued
    /// for prefill (the router's active load); above it the decode worker prefills itself.
    pub max_prefill_queue_tokens: u64,
    /// A prefill worker keeps handed-off blocks pinned this long at most without the decode
    /// worker's confirmation (ms).
    pub hold_ms: u64,
    /// A decode worker's pull gives up after this long and recomputes the prompt (ms).
    pub transfer_timeout_ms: u64,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            min_prefill_tokens: DisaggRouting::DEFAULT_MIN_PREFILL_TOKENS,
            max_prefill_queue_tokens: DisaggRouting::DEFAULT_MAX_PREFILL_QUEUE_TOKENS,
            hold_ms: DisaggWorker::DEFAULT_HOLD_MS,
            transfer_timeout_ms: DisaggWorker::DEFAULT_TRANSFER_TIMEOUT_MS,
        }
    }
}

/// Batch forming on each replica (the batch limits themselves are in `worker`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerSection {
    /// Stall-free batching (Sarathi-Serve, Agrawal et al., OSDI 2024): a step that carries
    /// decode rows takes prefill tokens only while its predicted time, from a step-time model
    /// the scheduler fits to its own measured steps, stays within this (ms), so that a
    /// newcomer's prefill delays running streams by at most about this much per token; at
    /// least one KV block of prefill still runs per step. Steps without decodes use the whole
    /// `worker.max_num_batched_tokens` budget, as does every step until the model has samples
    /// enough, and so does a migrated stream's recompute (its client is already waiting longer
    /// than this). 0 = off (the token budget alone). Default 200, chosen by a sweep on the
    /// project's 2-core VM (`docs/benchmarks.md`, "Stall-free batching"): about 4× the
    /// decode-only step there (45–50 ms at 4 streams); 100 ms left room for no more than the
    /// one-block minimum beside the decodes (ITL p50 tripled, throughput −38 %), while 200 ms
    /// cut the ITL p99 about 3× for about a fifth of the throughput, and 300 ms only 2×.
    pub max_decode_stall_ms: u64,
    /// A worker that is idle when a migrated request arrives waits this long (ms) before its
    /// next step, so that the other requests of the lost worker, which arrive together, run
    /// in that step instead of behind a step of the first one alone. Only migrated requests
    /// wait (a new request or a disaggregated decode starts at once). Default 5: a lost
    /// worker's 16 requests reached their new worker within 0.3–0.6 ms on the project's
    /// 2-core VM, under two CPU hogs; without it the first of them ran alone in a step of
    /// 0.3–0.6 s that every other one waited for (`docs/benchmarks.md`, "Recovery under
    /// contention"). 0 = off.
    pub resume_gather_ms: u64,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        Self {
            max_decode_stall_ms: 200,
            resume_gather_ms: 5,
        }
    }
}

/// Request placement (see `request_plane/router/policy.rs` for the cost formula and its source).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// `kv` (prefix overlap against load), `least_loaded`, `round_robin` or `random`; a
    /// request may override it with the `x-flotilla-route-policy` header.
    pub policy: crate::request_plane::router::policy::Policy,
    /// `kv`: weight of the prompt tokens the cache saves against load (default 4).
    pub overlap_weight: f64,
    /// `kv`: weight of a decode block against a block of prefill (default 0.125).
    pub decode_weight: f64,
    /// `kv`'s imbalance guard: a worker with more requests in flight than `balance_ratio ×`
    /// the mean `+ balance_requests` is not picked while others are below (1.5 and 4; 0: off).
    pub balance_ratio: f64,
    /// See `balance_ratio`.
    pub balance_requests: u32,
    /// `dynamo_kv`: weight of the prefill term (Dynamo's `--kv-overlap-score-weight`,
    /// default 1).
    pub dynamo_overlap_weight: f64,
    /// 0: the cheapest worker wins; above, a softmax over normalised costs is sampled.
    pub temperature: f64,
    /// Seed of the router's random choices (`random`, `temperature > 0`).
    pub seed: u64,
    /// `kv`, `dynamo_kv`: what a prefix block cached in G2 (`tier_credit_host`, default 0.75)
    /// or G3 (`tier_credit_disk`, default 0.25) is worth against one in G1 (NVIDIA Dynamo's
    /// published weights; `docs/benchmarks.md`, "KV tiers").
    pub tier_credit_host: f64,
    /// See `tier_credit_host`.
    pub tier_credit_disk: f64,
    /// `kv`, `dynamo_kv`: what a prompt block another worker holds in G1 is worth to a
    /// worker that could pull it (peer pulls, G4), in [0, 1]; default 0.75, measured
    /// (`docs/benchmarks.md`, "Peer pulls"; NVIDIA Dynamo weighs a shared remote pool at 0.5);
    /// 0 turns peer pulls off.
    pub pull_credit: f64,
    /// Fewest blocks a placement's fetch hint names beyond what the chosen worker holds
    /// (default 4).
    pub pull_min_blocks: u32,
    /// Several routers (nodes with the router role) tell each other every change to the
    /// load they put on the workers and count each other's (default true; false: each
    /// counts only its own placements, as independent routers do). The prefix index is
    /// shared either way: every router applies every worker's KV events.
    pub share_load: bool,
    /// `kv`, `dynamo_kv`: a session's turns (requests with the same session key, see
    /// `gateway.session_headers`) stay on the worker that served its last turn while that
    /// worker's queued prefill tokens are at most this many; past it the cost decides and the
    /// session moves (default 256, measured: `router/policy.rs`, "Sessions that stick";
    /// `docs/benchmarks.md`). 0: off.
    pub session_max_queued_tokens: u64,
    /// Sessions the router remembers (default 100 000); a new one past it evicts the least
    /// recently placed. Shared by every router (`router/policy/session.rs`).
    pub session_capacity: usize,
    /// A session not placed for this long is forgotten (ms, default 1 800 000: 30 minutes).
    pub session_ttl_ms: u64,
    /// Engines outside Flotilla (vLLM-compatible servers, or another fleet's `worker.http`
    /// faces) that this node's router places requests on, as workers `<node>/<name>`
    /// (`worker::external`). Read by router nodes, which need the gateway role too; other
    /// nodes ignore it.
    pub external_workers: Vec<ExternalWorkerConfig>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: Default::default(),
            overlap_weight: crate::request_plane::router::policy::DEFAULT_OVERLAP_WEIGHT,
            decode_weight: crate::request_plane::router::policy::DEFAULT_DECODE_WEIGHT,
            balance_ratio: crate::request_plane::router::policy::DEFAULT_BALANCE_RATIO,
            balance_requests: crate::request_plane::router::policy::DEFAULT_BALANCE_REQUESTS,
            dynamo_overlap_weight: 1.0,
            temperature: 0.0,
            seed: 0,
            tier_credit_host: 0.75,
            tier_credit_disk: 0.25,
            pull_credit: crate::request_plane::router::policy::PeerPull::DEFAULT_CREDIT,
            pull_min_blocks: crate::request_plane::router::policy::PeerPull::DEFAULT_MIN_BLOCKS,
            share_load: true,
            session_max_queued_tokens:
                crate::request_plane::router::policy::DEFAULT_SESSION_MAX_QUEUED_TOKENS,
            session_capacity:
                crate::request_plane::router::policy::session::DEFAULT_SESSION_CAPACITY,
            session_ttl_ms: crate::request_plane::router::policy::session::DEFAULT_SESSION_TTL_MS,
            external_workers: Vec::new(),
        }
    }
}

/// The chaos API (fault injection), off by default.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ChaosConfig {
    /// Serve `/chaos/faults` on the gateway.
    pub enabled: bool,
    /// Bearer token the chaos routes require; mandatory when the gateway listens beyond
    /// loopback.
    pub token: Option<String>,
}

/// This node's identity and place in the cluster.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Node name, unique in the cluster; defaults to `node@<listen_addr>`.
    pub name: Option<String>,
    /// Cluster listen address (TCP).
    pub listen_addr: SocketAddr,
    /// Seed nodes to join (`host:port`); empty for the first node.
    pub join: Vec<String>,
    /// Roles this node runs.
    pub roles: Vec<NodeRole>,
    /// Shared secret every node of the cluster must present (challenge/response; never sent).
    pub cookie: String,
    /// Drain on SIGTERM: the node leaves routing at once, in-flight requests get this long to
    /// finish, the rest migrate, then the node stops (ms). `flotilla up` gives its nodes
    /// `launcher::STOP_GRACE` (60 s) in all before it kills them.
    pub drain_grace_ms: u64,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            name: None,
            listen_addr: "127.0.0.1:7070".parse().expect("static address"),
            join: Vec::new(),
            roles: vec![NodeRole::Gateway, NodeRole::Router, NodeRole::Worker],
            cookie: String::new(),
            drain_grace_ms: 30_000,
        }
    }
}

impl NodeConfig {
    /// The effective node name.
    pub fn name(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("node@{}", self.listen_addr))
    }
}

/// Membership, heartbeats and liveness.
///
/// A peer that has not been heard from for `suspect_after_ms` is *suspect* (still routed to);
/// after `liveness_timeout_ms` it is *down*: subscribers are told and its workers leave
/// routing. With the defaults a killed node is declared down at most 3 s + one heartbeat
/// interval after its last heartbeat.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Interval between heartbeats sent to every peer.
    pub heartbeat_interval_ms: u64,
    /// Silence after which a peer is suspect.
    pub suspect_after_ms: u64,
    /// Silence after which a peer is declared down (the liveness timeout).
    pub liveness_timeout_ms: u64,
    /// How long a down node stays listed (as `down`) in the fleet view.
    pub down_retention_ms: u64,
    /// How long a joining node keeps trying to reach its seeds before giving up.
    pub connect_timeout_ms: u64,
    /// Largest inbound cluster frame accepted (ractor_cluster's default is 16 MiB; a larger
    /// frame tears the session down, so every node must use the same value).
    pub max_frame_bytes: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 250,
            suspect_after_ms: 1_000,
            liveness_timeout_ms: 3_000,
            down_retention_ms: 60_000,
            connect_timeout_ms: 15_000,
            max_frame_bytes: 64 * 1024 * 1024,
        }
    }
}

impl ClusterConfig {
    /// Heartbeat interval.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }
}

/// HTTP gateway.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// HTTP listen address (port 0 picks a free port, reported in the node's ready line).
    pub http_addr: SocketAddr,
    /// Largest accepted request body; larger bodies get 413 without being buffered.
    pub max_body_bytes: usize,
    /// Interval of SSE keep-alive comments while a stream waits for tokens.
    pub keep_alive_ms: u64,
    /// Admission: a worker is busy when this fraction of its KV blocks is in use…
    pub busy_kv_ratio: f64,
    /// …or when this many sequences wait for admission on it. When every live worker is
    /// busy, new requests get 503 with `Retry-After` before any work is done.
    pub busy_waiting: usize,
    /// Admission: most choices in flight on this gateway; beyond, 503.
    pub max_in_flight: usize,
    /// Admission that predicts (`gateway/admission.rs`): a TTFT target (ms). When every
    /// worker's predicted wait before a new request's prefill starts (its queued prompt
    /// tokens through its measured step-time model, or the wait of its oldest request not yet
    /// admitted, whichever is longer, as of the last heartbeat) exceeds it, the
    /// request gets 503 with the prediction in the body and `Retry-After`. `None`: off.
    pub ttft_target_ms: Option<u64>,
    /// Losses in a row **without progress** (no new token since the previous loss) that
    /// never give a request up; beyond them, a stall of `migration_deadline_ms` does. Losses
    /// after progress do not count. See `request_plane::request::migration`.
    pub migration_limit: u32,
    /// How long one migration keeps looking for a worker, from the loss, and how long a stall
    /// of more than `migration_limit` losses may last, before the request fails (ms).
    pub migration_deadline_ms: u64,
    /// First wait between placement tries while no worker is routable (ms); doubles per try,
    /// with jitter, up to `migration_backoff_max_ms`.
    pub migration_backoff_base_ms: u64,
    /// Longest wait between placement tries (ms).
    pub migration_backoff_max_ms: u64,
    /// A request's head (request line and headers) must be complete within this many ms of
    /// the connection being ready for it: from its first byte on a new connection, from the
    /// end of the previous response on a kept-alive one (so it also closes a kept-alive
    /// connection idle this long). Else the connection is closed (hyper's
    /// `header_read_timeout`).
    pub request_header_timeout_ms: u64,
    /// A request body must be complete within this many ms of the handler starting to read
    /// it; else 408 in the OpenAI error shape and the connection is closed.
    pub request_body_timeout_ms: u64,
    /// A new connection that sends no byte for this many ms is closed.
    pub idle_timeout_ms: u64,
    /// Most open client connections; beyond, a new connection gets a 503 and is closed
    /// (`flotilla_http_connections_open`, `flotilla_http_connections_refused_total`).
    pub max_connections: usize,
    /// A request that finds no worker serving the model while a planner in mode `act` is in
    /// the fleet (a pool scaled to zero) waits up to this many ms for one to come up — the
    /// planner sees it waiting and starts a replica — then gets a 503 with `Retry-After`
    /// (0: no wait). Without such a planner it is refused at once.
    pub cold_start_timeout_ms: u64,
    /// Headers that carry a request's session key, first present wins (lower case; default
    /// [`crate::actors::gateway::session::DEFAULT_SESSION_HEADERS`]: `x-session-id`,
    /// `x-session-affinity`, `x-claude-code-session-id`, `session_id`). Under the kv policies
    /// the router keeps a session's turns on one worker until it saturates
    /// (`router.session_max_queued_tokens`). A key is 1..=256 visible ASCII bytes, else 400.
    /// Empty: no header is read.
    pub session_headers: Vec<String>,
    /// Without a session header, take the body's `user` (OpenAI routes) or
    /// `metadata.user_id` (`/v1/messages`) as the session key (default false: one user may
    /// run many unrelated sessions). Bounded as the headers are.
    pub session_from_user: bool,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            http_addr: "127.0.0.1:8080".parse().expect("static address"),
            max_body_bytes: 4 * 1024 * 1024,
            keep_alive_ms: 10_000,
            busy_kv_ratio: 0.95,
            busy_waiting: 64,
            max_in_flight: 4096,
            ttft_target_ms: None,
            migration_limit: 3,
            migration_deadline_ms: 30_000,
            migration_backoff_base_ms: 50,
            migration_backoff_max_ms: 1_000,
            request_header_timeout_ms: 30_000,
            request_body_timeout_ms: 30_000,
            idle_timeout_ms: 30_000,
            max_connections: 1024,
            cold_start_timeout_ms: 120_000,
            session_headers: crate::actors::gateway::session::DEFAULT_SESSION_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            session_from_user: false,
        }
    }
}

/// Restart budgets (see `runtime::supervision::SupervisorFlags`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisionConfig {
    /// The node supervisor's budget: more restarts than this within `node_period_ms` and
    /// the node process exits non-zero.
    pub node_max_restarts: u32,
    /// Window of the node budget.
    pub node_period_ms: u64,
    /// Restart budget of the gateway supervisor and of the worker pool (the replicas,
    /// `router_sup` and `request_sup` have their own, fixed in `supervisors/tree.rs`).
    pub max_restarts: u32,
    /// Window of that budget.
    pub period_ms: u64,
    /// First restart delay; doubles per restart within the window.
    pub backoff_base_ms: u64,
    /// Largest restart delay.
    pub backoff_max_ms: u64,
    /// Time a child is given to stop before it is killed.
    pub shutdown_timeout_ms: u64,
}

impl Default for SupervisionConfig {
    fn default() -> Self {
        Self {
            node_max_restarts: 3,
            node_period_ms: 60_000,
            max_restarts: 10,
            period_ms: 60_000,
            backoff_base_ms: 10,
            backoff_max_ms: 1_000,
            shutdown_timeout_ms: 5_000,
        }
    }
}

/// Worker nodes: replicas and their engines.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Replicas per worker node.
    pub replicas: u32,
    /// Model file (GGUF) or Hugging Face directory; `None`: `FLOTILLA_MODEL`, else
    /// `models/smollm2-135m-instruct-q4_1.gguf` (what `make model` fetches).
    pub model_path: Option<std::path::PathBuf>,
    /// KV blocks per replica; `None`: the engine's default — the sim profile's KV capacity
    /// (`kv_tokens ÷ block_size_tokens`, the simulated device's pool) for `sim`, else
    /// [`DEFAULT_KV_BLOCKS`]. The default model's KV is 46 KiB per token in f32 (30 layers ×
    /// K,V × 3 heads × 64 × 4 bytes), so 512 blocks of 16 tokens take 360 MiB.
    pub kv_blocks: Option<usize>,
    /// KV tier G2: blocks of host memory per replica that G1 offloads to and onboards from
    /// (`kv/tiers.rs`); 0 = off. On the CPU engine a block takes what a G1 block takes.
    pub kv_host_blocks: usize,
    /// KV tier G3: blocks on local disk per replica, fed by G2's evictions of blocks reused at
    /// least `kv_disk_min_hits` times; 0 = off. Needs `kv_host_blocks`, and on the CPU engine
    /// `kv_disk_dir` (the sim engine models the disk).
    pub kv_disk_blocks: usize,
    /// G3's directory (one segment file per replica, sized and cleared at start:
    /// `worker/tiers.rs`); `None`: no G3 on the CPU engine.
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Prefix reuses a block needs before G2 demotes it to G3 (frequency filter).
    pub kv_disk_min_hits: u32,
    /// Offload copies (G1 → G2, G2 → G3) in flight per replica at most; a block registered
    /// beyond that is not offloaded (`flotilla_kv_offload_drops_total`).
    pub kv_offload_in_flight: usize,
    /// Peer pulls (G4): act on the router's fetch hints — pull a prompt's leading blocks from
    /// the worker holding them in G1 when the pull is estimated cheaper than the prefill
    /// (`worker/scheduler.rs`, "Peer pulls"). The router's side is `router.pull_credit`.
    pub peer_pulls: bool,
    /// The cost rule's estimate of one block's pull (ms) until a pull was measured here (then
    /// the measured moving average). Default 1 ms: a 16-token block of the default model is
    /// 736 KiB, pulled at 0.7–1.9 GB/s over the TCP backend on a 2-core VM
    /// (`docs/benchmarks.md`, "KV transport"). The sim engine uses its modelled transfer.
    pub pull_block_ms: f64,
    /// How long the holder may take to pin the blocks and answer (ms): past it the prefix is
    /// recomputed.
    pub pull_ask_timeout_ms: u64,
    /// Tokens per KV block.
    pub block_size_tokens: usize,
    /// Sequences batched at once per replica.
    pub max_num_seqs: usize,
    /// Tokens per engine step (prefill chunks + decode tokens).
    pub max_num_batched_tokens: usize,
    /// Context limit (capped by the model's own).
    pub max_model_len_tokens: usize,
    /// Step watchdog: an engine step running longer than this marks the replica unhealthy
    /// and restarts it (ms). The slowest step measured on the CPU engine (a 512-token prefill
    /// chunk on 2 cores) takes about 1.4 s; the default leaves a wide margin.
    pub step_timeout_ms: u64,
    /// Canary: an idle replica pings its engine this often; no answer within
    /// `step_timeout_ms` counts as a hang (ms).
    pub canary_interval_ms: u64,
    /// `cpu` (the real transformer) or `sim` (the real scheduler and KV manager over a timing
    /// model: `worker/engine/sim.rs`), for fleet-scale runs.
    pub engine: EngineKind,
    /// Where the real engine runs (`engine = "cpu"`): `auto` (a GPU when the CUDA driver
    /// and the kernels load and a device exists, else the CPU; a GPU engine that then cannot
    /// start falls back to the CPU too; the node's log says which and why), `cpu`, or `cuda`
    /// (a GPU or an error at start naming what is missing). cuBLAS is optional (without it,
    /// prefill products run as GEMVs). Replica `k` of a node uses GPU `k mod devices`
    /// (`kernels/cuda/`). `cuda` with `engine = "sim"` is refused (it would do nothing).
    pub backend: crate::kernels::cuda::BackendChoice,
    /// GPU engine: precision of the prefill matrix products, `f32` (the CPU engine's numbers)
    /// or `bf16` (tensor cores). Decode GEMVs read the quantised weights in f32 either way.
    /// `bf16` with `backend = "cpu"` is refused (it would do nothing).
    pub cuda_gemm: crate::kernels::cuda::GemmPrecision,
    /// Timing profile of the sim engine (JSON written by `flotilla profile`); `None`: the
    /// built-in H100 profile.
    pub sim_profile: Option<std::path::PathBuf>,
    /// The sim engine's step times are divided by this.
    pub sim_speedup: f64,
    /// The replicas' role in disaggregated serving: `aggregated`, `prefill` or `decode`
    /// (`request_plane/role.rs`).
    pub role: crate::runtime::role::Role,
    /// Of this node's replicas, the first this many are `prefill` whatever `role` says (a
    /// mixed node: e.g. a simulated fleet of 16 replicas in one process with 4 prefill ones).
    pub prefill_replicas: u32,
    /// Sim engine: the modelled KV transfer between nodes, GB/s (default 25, a 200 Gb/s
    /// RDMA link).
    pub sim_transfer_gbps: f64,
    /// Sim engine: fixed cost of one KV pull (µs).
    pub sim_transfer_latency_us: u64,
    /// Sim engine: KV bytes per token (default 131072: Llama-3-8B in fp16, 32 layers × K,V ×
    /// 8 KV heads × 128 × 2 bytes, the model of the built-in H100 profile).
    pub sim_kv_bytes_per_token: u64,
    /// Sim engine: device ↔ host copy bandwidth of the KV tiers, GB/s (default 25: about half
    /// of PCIe 5.0 x16's 64 GB/s per direction, what pageable-memory copies reach).
    pub sim_host_gbps: f64,
    /// Sim engine: host ↔ disk bandwidth of G3, GB/s (default 5: one PCIe 4.0 NVMe drive's
    /// sequential rate, ~7 GB/s read, less for writes).
    pub sim_disk_gbps: f64,
    /// Each replica's own OpenAI-compatible HTTP face (`request_plane/gateway/face.rs`), so
    /// that other routers (SGLang's, vLLM's) can route over Flotilla workers: replica `k`
    /// listens on this address with port + k (port 0: a free port each, listed in
    /// `/v1/fleet` as the worker's `http_addr`). `None`: no face.
    pub http: Option<std::net::SocketAddr>,
    /// Each replica also publishes its KV events in vLLM's format (ZMQ PUB, MessagePack
    /// `KVEventBatch`: `kv/vllm.rs`): replica `k` binds this address with port + k, as vLLM
    /// offsets its `kv-events-config` endpoint by data-parallel rank (port 0: a free port
    /// each, listed in `/v1/fleet` as `kv_events_endpoint`). `None`: not published.
    pub kv_events_addr: Option<std::net::SocketAddr>,
    /// Layout of those events: `map` (each a map tagged by `type`: what `vllm-router` 0.1.17
    /// and Dynamo's ZMQ relay read) or `array` (each a positional array led by its tag, as
    /// vLLM's own publisher writes them). See `kv/vllm.rs`.
    pub kv_events_layout: crate::kv::vllm::EventLayout,
}

impl WorkerConfig {
    /// Replica `k`'s address given a base address: port + k, or port 0 for every replica
    /// when the base port is 0 (`worker.http`, `worker.kv_events_addr`).
    pub fn replica_addr(base: std::net::SocketAddr, k: u32) -> std::net::SocketAddr {
        let mut a = base;
        if base.port() != 0 {
            a.set_port(base.port().saturating_add(k as u16));
        }
        a
    }
}

/// KV blocks per replica of the CPU engine unless `worker.kv_blocks` says otherwise.
pub const DEFAULT_KV_BLOCKS: usize = 512;

impl WorkerConfig {
    /// The KV blocks each replica gets: `kv_blocks` if set, else the sim profile's capacity
    /// (`profile` is the sim engine's, `None` for the CPU engine), else [`DEFAULT_KV_BLOCKS`].
    pub fn kv_blocks_with(
        &self,
        profile: Option<&crate::worker::engine::sim::SimProfile>,
    ) -> usize {
        self.kv_blocks
            .or_else(|| profile.and_then(|p| p.kv_blocks(self.block_size_tokens)))
            .unwrap_or(DEFAULT_KV_BLOCKS)
    }
}

/// Which engine a replica runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// The real model (on the CPU or a GPU: `worker.backend`).
    #[default]
    Cpu,
    /// The timing model with placeholder tokens.
    Sim,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            replicas: 1,
            model_path: None,
            kv_blocks: None,
            kv_host_blocks: 0,
            kv_disk_blocks: 0,
            kv_disk_dir: None,
            kv_disk_min_hits: 1,
            kv_offload_in_flight: 256,
            peer_pulls: true,
            pull_block_ms: 1.0,
            pull_ask_timeout_ms: crate::worker::scheduler::PeerPullWorker::DEFAULT_ASK_TIMEOUT_MS,
            block_size_tokens: 16,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            max_model_len_tokens: 8192,
            step_timeout_ms: 30_000,
            canary_interval_ms: 5_000,
            engine: EngineKind::Cpu,
            backend: Default::default(),
            cuda_gemm: Default::default(),
            sim_profile: None,
            sim_speedup: 1.0,
            role: crate::runtime::role::Role::Aggregated,
            prefill_replicas: 0,
            sim_transfer_gbps: 25.0,
            sim_transfer_latency_us: 50,
            sim_kv_bytes_per_token: 131_072,
            sim_host_gbps: 25.0,
            sim_disk_gbps: 5.0,
            http: None,
            kv_events_addr: None,
            kv_events_layout: Default::default(),
        }
    }
}

/// A configuration that cannot be used, naming the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A source could not be read or parsed.
    #[error("configuration: {0}")]
    Load(Box<figment::Error>),
    /// A value is out of range or inconsistent.
    #[error("configuration: {field}: {message}")]
    Invalid {
        /// Dotted field path.
        field: std::borrow::Cow<'static, str>,
        /// What is wrong.
        message: String,
    },
}

// Not `#[from]`: that would make the figment error the source too, and error chains would
// print it twice.
impl From<Box<figment::Error>> for ConfigError {
    fn from(e: Box<figment::Error>) -> Self {
        ConfigError::Load(e)
    }
}

fn invalid(field: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

impl Config {
    /// Load defaults → `file` (if any) → `FLOTILLA_*` env → `overrides` (flags, as a partial
    /// tree), then validate.
    ///
    /// # Errors
    /// See [`Config::load_with`].
    pub fn load(file: Option<&Path>, overrides: serde_json::Value) -> Result<Self, ConfigError> {
        Self::load_with(file, Serialized::defaults(overrides))
    }

    /// [`Config::load`] with the overrides as any figment provider (the command line builds
    /// them from dotted key paths: `Serialized::default("node.name", …)`).
    ///
    /// # Errors
    /// `file` does not exist; a source cannot be read or parsed, or has a value of the wrong
    /// type or an unknown field ([`ConfigError::Load`]); a value fails [`Config::validate`].
    pub fn load_with(
        file: Option<&Path>,
        overrides: impl figment::Provider,
    ) -> Result<Self, ConfigError> {
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = file {
            if !path.exists() {
                return Err(invalid(
                    "--config",
                    format!("file {} does not exist", path.display()),
                ));
            }
            fig = fig.merge(Toml::file(path));
        }
        // Only `SECTION__FIELD` variables belong to the tree; FLOTILLA_MODEL, FLOTILLA_CONFIG
        // and friends are read by the CLI itself.
        fig = fig.merge(
            Env::prefixed("FLOTILLA_")
                .filter(|k| k.as_str().contains("__"))
                .split("__"),
        );
        fig = fig.merge(overrides);
        let cfg: Config = fig.extract().map_err(Box::new)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// `router.external_workers`: roles, names, URLs.
    fn validate_external_workers(&self) -> Result<(), ConfigError> {
        let ext = &self.router.external_workers;
        if ext.is_empty() {
            return Ok(());
        }
        const F: &str = "router.external_workers";
        // Read by router nodes only, like the rest of `router.*` (so one `--set` can go to
        // every node of `flotilla up`); a router node needs the gateway's model too.
        if self.has_role(NodeRole::Router) && !self.has_role(NodeRole::Gateway) {
            return Err(invalid(
                F,
                "a router node that starts external workers needs the gateway role too (the \
                 gateway's model gives the block-hash salt and end-of-sequence tokens)",
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for e in ext {
            let ok_name = !e.name.is_empty()
                && e.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !ok_name {
                return Err(invalid(
                    F,
                    format!("name {:?}: use letters, digits, '-' and '_'", e.name),
                ));
            }
            if e.name.starts_with("replica-") {
                return Err(invalid(
                    F,
                    format!(
                        "name {:?}: replica-<k> names this node's own replicas",
                        e.name
                    ),
                ));
            }
            if !names.insert(e.name.as_str()) {
                return Err(invalid(F, format!("name {:?} appears twice", e.name)));
            }
            if !e.url.starts_with("http://") {
                return Err(invalid(
                    F,
                    format!(
                        "{}: url {:?} must start with http:// (the engine client speaks plain \
                         HTTP; put a TLS proxy on the engine's side)",
                        e.name, e.url
                    ),
                ));
            }
            if let Some(k) = &e.kv_events
                && !k.starts_with("tcp://")
            {
                return Err(invalid(
                    F,
                    format!("{}: kv_events {k:?} must be a tcp:// endpoint", e.name),
                ));
            }
        }
        Ok(())
    }

    /// Check ranges and consistency.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first field that is out of range or
    /// inconsistent with another.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let c = &self.cluster;
        if c.heartbeat_interval_ms == 0 {
            return Err(invalid(
                "cluster.heartbeat_interval_ms",
                "must be at least 1",
            ));
        }
        if c.suspect_after_ms <= c.heartbeat_interval_ms {
            return Err(invalid(
                "cluster.suspect_after_ms",
                format!(
                    "must exceed cluster.heartbeat_interval_ms ({} <= {})",
                    c.suspect_after_ms, c.heartbeat_interval_ms
                ),
            ));
        }
        if c.liveness_timeout_ms < c.suspect_after_ms {
            return Err(invalid(
                "cluster.liveness_timeout_ms",
                format!(
                    "must be at least cluster.suspect_after_ms ({} < {})",
                    c.liveness_timeout_ms, c.suspect_after_ms
                ),
            ));
        }
        if c.max_frame_bytes < 1024 * 1024 {
            return Err(invalid("cluster.max_frame_bytes", "must be at least 1 MiB"));
        }
        self.validate_external_workers()?;
        if self.node.roles.is_empty() {
            return Err(invalid("node.roles", "at least one role is required"));
        }
        if !(self.worker.sim_speedup.is_finite() && self.worker.sim_speedup > 0.0) {
            return Err(invalid("worker.sim_speedup", "must be a finite number > 0"));
        }
        if !(self.worker.sim_transfer_gbps.is_finite() && self.worker.sim_transfer_gbps > 0.0) {
            return Err(invalid("worker.sim_transfer_gbps", "must be > 0"));
        }
        // Settings that would be accepted and then do nothing: refused, naming the other one.
        {
            use crate::kernels::cuda::{BackendChoice, GemmPrecision};
            let w = &self.worker;
            if w.engine == EngineKind::Sim && w.backend == BackendChoice::Cuda {
                return Err(invalid(
                    "worker.backend",
                    "cuda has no effect with worker.engine = \"sim\" (the sim engine runs \
                     no kernels); leave it auto or cpu",
                ));
            }
            if w.backend == BackendChoice::Cpu && w.cuda_gemm != GemmPrecision::F32 {
                return Err(invalid(
                    "worker.cuda_gemm",
                    "bf16 has no effect with worker.backend = \"cpu\"; set the backend to \
                     auto or cuda",
                ));
            }
        }
        if self.disagg.transfer_timeout_ms == 0 {
            return Err(invalid("disagg.transfer_timeout_ms", "must be at least 1"));
        }
        if self.disagg.hold_ms <= self.disagg.transfer_timeout_ms {
            return Err(invalid(
                "disagg.hold_ms",
                format!(
                    "must exceed disagg.transfer_timeout_ms ({} <= {}): a pull must end before the hold",
                    self.disagg.hold_ms, self.disagg.transfer_timeout_ms
                ),
            ));
        }
        self.priority
            .validate()
            .map_err(|(field, message)| invalid(field, message))?;
        self.planner
            .validate()
            .map_err(|(field, message)| ConfigError::Invalid {
                field: field.into(),
                message,
            })?;
        if self.node.roles.contains(&NodeRole::Planner)
            && self.planner.capacity_profile.is_none()
            && self.worker.engine != EngineKind::Sim
        {
            return Err(invalid(
                "planner.capacity_profile",
                "the planner role needs one replica's capacity curves with worker.engine = \
                 \"cpu\": write them with `flotilla profile --capacity-out capacity-cpu.json`",
            ));
        }
        if self.node.cookie.is_empty() {
            return Err(invalid(
                "node.cookie",
                "a cluster cookie is required (--cookie or FLOTILLA_NODE__COOKIE)",
            ));
        }
        if self.chaos.enabled
            && !self.gateway.http_addr.ip().is_loopback()
            && self.chaos.token.as_deref().is_none_or(str::is_empty)
        {
            return Err(invalid(
                "chaos.token",
                "required when chaos.enabled and the gateway listens beyond loopback",
            ));
        }
        if !(self.gateway.busy_kv_ratio > 0.0 && self.gateway.busy_kv_ratio <= 1.0) {
            return Err(invalid("gateway.busy_kv_ratio", "must be in (0, 1]"));
        }
        if self.gateway.max_in_flight == 0 || self.gateway.busy_waiting == 0 {
            return Err(invalid(
                "gateway.max_in_flight",
                "admission bounds must be at least 1",
            ));
        }
        if self.gateway.keep_alive_ms == 0 {
            return Err(invalid("gateway.keep_alive_ms", "must be at least 1"));
        }
        let g = &self.gateway;
        for (field, ms) in [
            (
                "gateway.request_header_timeout_ms",
                g.request_header_timeout_ms,
            ),
            ("gateway.request_body_timeout_ms", g.request_body_timeout_ms),
            ("gateway.idle_timeout_ms", g.idle_timeout_ms),
        ] {
            if !(1..=600_000).contains(&ms) {
                return Err(invalid(field, "must be within 1..=600000 (ms)"));
            }
        }
        for h in &g.session_headers {
            if axum::http::HeaderName::from_lowercase(h.as_bytes()).is_err() {
                return Err(invalid(
                    "gateway.session_headers",
                    format!("{h:?} is not a lower-case HTTP header name"),
                ));
            }
        }
        if g.cold_start_timeout_ms > 3_600_000 {
            return Err(invalid(
                "gateway.cold_start_timeout_ms",
                "must be within 0..=3600000 (ms)",
            ));
        }
        if g.max_connections == 0 {
            return Err(invalid("gateway.max_connections", "must be at least 1"));
        }
        if self.gateway.max_body_bytes < 1024 {
            return Err(invalid("gateway.max_body_bytes", "must be at least 1024"));
        }
        if self.supervision.node_max_restarts == 0 && self.supervision.node_period_ms == 0 {
            return Err(invalid("supervision.node_period_ms", "must be positive"));
        }
        if self.supervision.backoff_max_ms < self.supervision.backoff_base_ms {
            return Err(invalid(
                "supervision.backoff_max_ms",
                "must be at least supervision.backoff_base_ms",
            ));
        }
        let w = &self.worker;
        if w.replicas == 0 {
            return Err(invalid("worker.replicas", "must be at least 1"));
        }
        if w.kv_blocks == Some(0) {
            return Err(invalid("worker.kv_blocks", "must be at least 1"));
        }
        if w.kv_disk_blocks > 0 && w.kv_host_blocks == 0 {
            return Err(invalid(
                "worker.kv_disk_blocks",
                "the disk tier (G3) is fed by the host tier (G2): set worker.kv_host_blocks too",
            ));
        }
        if w.kv_disk_blocks > 0 && w.engine == EngineKind::Cpu && w.kv_disk_dir.is_none() {
            return Err(invalid(
                "worker.kv_disk_blocks",
                "the CPU engine keeps G3 in files: set worker.kv_disk_dir",
            ));
        }
        if !(w.pull_block_ms.is_finite() && w.pull_block_ms >= 0.0) {
            return Err(invalid("worker.pull_block_ms", "must be finite and >= 0"));
        }
        if w.peer_pulls && w.pull_ask_timeout_ms == 0 {
            return Err(invalid("worker.pull_ask_timeout_ms", "must be at least 1"));
        }
        if w.kv_host_blocks > 0 && w.kv_offload_in_flight == 0 {
            return Err(invalid("worker.kv_offload_in_flight", "must be at least 1"));
        }
        for (field, v) in [
            ("worker.sim_host_gbps", w.sim_host_gbps),
            ("worker.sim_disk_gbps", w.sim_disk_gbps),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(field, "must be a positive number"));
            }
        }
        for (field, base) in [
            ("worker.http", w.http),
            ("worker.kv_events_addr", w.kv_events_addr),
        ] {
            if let Some(b) = base
                && b.port() != 0
                && u32::from(b.port()) + w.replicas > 65_536
            {
                return Err(invalid(
                    field,
                    format!(
                        "port {} + {} replicas runs past 65535",
                        b.port(),
                        w.replicas
                    ),
                ));
            }
        }
        if w.block_size_tokens == 0 {
            return Err(invalid("worker.block_size_tokens", "must be at least 1"));
        }
        if w.max_num_seqs == 0 || w.max_num_batched_tokens == 0 {
            return Err(invalid(
                "worker.max_num_seqs",
                "batch limits must be at least 1",
            ));
        }
        if w.max_model_len_tokens < 2 {
            return Err(invalid("worker.max_model_len_tokens", "must be at least 2"));
        }
        // The router's weights, checked here (before a node loads its model) with the same
        // rules the router applies when it starts.
        self.selector_config()
            .validate()
            .map_err(|e| invalid("router", e.to_string()))?;
        Ok(())
    }

    /// The router's placement settings (`router.*` with the workers' block size).
    pub fn selector_config(&self) -> crate::request_plane::router::policy::SelectorConfig {
        let r = &self.router;
        crate::request_plane::router::policy::SelectorConfig {
            policy: r.policy,
            block_size: u32::try_from(self.worker.block_size_tokens).unwrap_or(u32::MAX),
            overlap_weight: r.overlap_weight,
            decode_weight: r.decode_weight,
            balance_ratio: r.balance_ratio,
            balance_requests: r.balance_requests,
            dynamo_overlap_weight: r.dynamo_overlap_weight,
            temperature: r.temperature,
            seed: r.seed,
            tier_credit: crate::request_plane::router::policy::TierCredit {
                host: r.tier_credit_host,
                disk: r.tier_credit_disk,
            },
            peer_pull: crate::request_plane::router::policy::PeerPull {
                credit: r.pull_credit,
                min_blocks: r.pull_min_blocks,
            },
            session_max_queued_tokens: r.session_max_queued_tokens,
        }
    }

    /// The router's session table, empty, with its bounds (`router.session_capacity`,
    /// `router.session_ttl_ms`).
    pub fn session_table(&self) -> crate::request_plane::router::policy::session::SessionTable {
        crate::request_plane::router::policy::session::SessionTable::new(
            self.router.session_capacity,
            self.router.session_ttl_ms,
        )
    }

    /// Gateway admission (`gateway.busy_kv_ratio`, `busy_waiting`, `max_in_flight`,
    /// `ttft_target_ms`): what a live gateway and `flotilla sim` both judge requests by.
    pub fn admission(&self) -> crate::request_plane::admission::Admission {
        let g = &self.gateway;
        crate::request_plane::admission::Admission {
            busy_kv_ratio: g.busy_kv_ratio,
            busy_waiting: g.busy_waiting,
            max_in_flight: g.max_in_flight,
            ttft_target_ms: g.ttft_target_ms,
        }
    }

    /// Migration bounds of a request (`gateway.migration_*`).
    pub fn migration_policy(&self) -> crate::request_plane::migration::MigrationPolicy {
        let g = &self.gateway;
        crate::request_plane::migration::MigrationPolicy {
            limit: g.migration_limit,
            deadline: Duration::from_millis(g.migration_deadline_ms),
            backoff_base: Duration::from_millis(g.migration_backoff_base_ms),
            backoff_max: Duration::from_millis(g.migration_backoff_max_ms),
        }
    }

    /// A replica's batch limits (`worker.max_num_seqs`, `max_num_batched_tokens`,
    /// `max_model_len_tokens` capped by the model's context `model_context`, and
    /// `scheduler.max_decode_stall_ms`, `scheduler.resume_gather_ms`).
    pub fn scheduler_config(
        &self,
        model_context: usize,
    ) -> crate::worker::scheduler::SchedulerConfig {
        let w = &self.worker;
        crate::worker::scheduler::SchedulerConfig {
            max_num_seqs: w.max_num_seqs,
            max_num_batched_tokens: w.max_num_batched_tokens,
            max_model_len: w.max_model_len_tokens.min(model_context),
            max_decode_stall_ms: self.scheduler.max_decode_stall_ms,
            resume_gather_ms: self.scheduler.resume_gather_ms,
        }
    }

    /// The sim engine's modelled KV transfer (`worker.sim_transfer_*`,
    /// `sim_kv_bytes_per_token`, `sim_speedup`).
    /// The lower KV tiers of each replica (`worker.kv_host_blocks`, `kv_disk_*`).
    pub fn tier_config(&self) -> crate::kv::TierConfig {
        let w = &self.worker;
        crate::kv::TierConfig {
            host_blocks: w.kv_host_blocks,
            disk_blocks: w.kv_disk_blocks,
            max_offloads_in_flight: w.kv_offload_in_flight,
            disk_min_hits: w.kv_disk_min_hits,
        }
    }

    /// A replica's side of peer pulls (`worker.peer_pulls`, `pull_block_ms`,
    /// `pull_ask_timeout_ms`); on the sim engine (`sim`) the pull estimate is the modelled
    /// transfer's. `None` when off.
    pub fn peer_pull_worker(&self, sim: bool) -> Option<crate::worker::scheduler::PeerPullWorker> {
        let w = &self.worker;
        if !w.peer_pulls {
            return None;
        }
        let (prior_block_ms, fixed_ms) = if sim {
            let t = self.sim_transfer();
            let bs = w.block_size_tokens;
            let fixed = t.time(0, bs).as_secs_f64() * 1e3;
            (t.time(1, bs).as_secs_f64() * 1e3 - fixed, fixed)
        } else {
            (w.pull_block_ms, 1.0)
        };
        Some(crate::worker::scheduler::PeerPullWorker {
            prior_block_ms,
            fixed_ms,
            ask_timeout: Duration::from_millis(w.pull_ask_timeout_ms),
        })
    }

    /// The sim engine's model of copies between KV tiers.
    pub fn sim_tier_links(&self) -> crate::worker::scheduler::SimTierLinks {
        let w = &self.worker;
        crate::worker::scheduler::SimTierLinks {
            bytes_per_token: w.sim_kv_bytes_per_token,
            host_gbps: w.sim_host_gbps,
            disk_gbps: w.sim_disk_gbps,
            speedup: w.sim_speedup,
        }
    }

    pub fn sim_transfer(&self) -> crate::worker::scheduler::SimTransfer {
        let w = &self.worker;
        crate::worker::scheduler::SimTransfer {
            bytes_per_token: w.sim_kv_bytes_per_token,
            gbps: w.sim_transfer_gbps,
            latency: Duration::from_micros(w.sim_transfer_latency_us),
            speedup: w.sim_speedup,
        }
    }

    /// Whether this node runs `role`.
    pub fn has_role(&self, role: NodeRole) -> bool {
        self.node.roles.contains(&role)
    }

    /// One replica's capacity curves for the planner: `planner.capacity_profile` when set,
    /// else derived from the sim engine's profile (`profile`: `worker.sim_profile` or the
    /// built-in one) with the scheduler's limits at the planner's targets.
    ///
    /// # Errors
    /// The file cannot be read or is not a profile; or no file is set and the workers run
    /// the CPU engine (no profile to derive one from).
    pub fn planner_capacity(
        &self,
        profile: Option<&crate::worker::engine::sim::SimProfile>,
    ) -> Result<crate::control::planner::CapacityProfile, ConfigError> {
        use crate::control::planner::CapacityProfile;
        let p = &self.planner;
        if let Some(path) = &p.capacity_profile {
            return CapacityProfile::load(path)
                .map_err(|e| invalid("planner.capacity_profile", e.to_string()));
        }
        let Some(profile) = profile.filter(|_| self.worker.engine == EngineKind::Sim) else {
            return Err(invalid(
                "planner.capacity_profile",
                "required with worker.engine = \"cpu\": write one with `flotilla profile \
                 --capacity-out capacity-cpu.json` (or run the sim engine, whose profile \
                 gives one)",
            ));
        };
        let w = &self.worker;
        let blocks = w.kv_blocks_with(Some(profile));
        Ok(profile.capacity(
            w.sim_speedup,
            blocks * w.block_size_tokens,
            w.max_num_seqs,
            w.max_num_batched_tokens,
            p.ttft_target_ms,
            p.itl_target_ms,
        ))
    }
}

#[cfg(test)]
mod tests;

impl From<&DisaggConfig> for DisaggRouting {
    fn from(c: &DisaggConfig) -> Self {
        Self {
            min_prefill_tokens: c.min_prefill_tokens,
            max_prefill_queue_tokens: c.max_prefill_queue_tokens,
        }
    }
}

impl From<&DisaggConfig> for DisaggWorker {
    fn from(c: &DisaggConfig) -> Self {
        DisaggWorker::new(c.hold_ms, c.transfer_timeout_ms)
    }
}

impl From<&GatewayConfig> for ConnLimits {
    fn from(g: &GatewayConfig) -> Self {
        Self {
            header_timeout: Duration::from_millis(g.request_header_timeout_ms),
            idle_timeout: Duration::from_millis(g.idle_timeout_ms),
            max_connections: g.max_connections,
        }
    }
}
