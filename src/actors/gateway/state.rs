//! What the gateway's routes share ([`GatewayShared`], their axum state) and the data it holds:
//! the generation routes' [`Serving`], the chaos API's [`ChaosController`], a replica face's
//! [`FaceInfo`]. Types only (their behaviour is in `serve.rs`, `chaos_routes.rs`, `face.rs`),
//! so that every route module imports this one and none imports another's state.

use crate::actors::discovery;
use crate::control::chaos::FaultSpec;
use crate::control::discovery::FleetView;
use crate::control::discovery::membership::NodeView;
use crate::openai::error::{ApiError, ErrorKind};
use crate::request_plane::admission::Admission;
use crate::request_plane::frontend::Frontend;
use crate::request_plane::token_sink::SinkRegistry;
use crate::runtime::ids::{NodeId, WorkerId};
use crate::runtime::resilience::NodeStats;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the routes share.
pub struct GatewayShared {
    /// Name of this node's Discovery actor (looked up per request, so a restarted Discovery
    /// is found).
    pub discovery_name: String,
    /// Metrics renderer.
    pub metrics: PrometheusHandle,
    /// Largest accepted body.
    pub max_body_bytes: usize,
    /// A body must be read completely within this (`gateway.request_body_timeout_ms`).
    pub request_body_timeout: std::time::Duration,
    /// The configured listen address (`gateway.http_addr`), an allowed `Host` of the control
    /// API.
    pub http_addr: std::net::SocketAddr,
    /// The generation routes' state; `None` when this gateway serves no model (they answer 503).
    pub serving: Option<Arc<Serving>>,
    /// The chaos API; `None` when disabled (its routes answer 404).
    pub chaos: Option<Arc<ChaosController>>,
    /// This node's draining flag and counters.
    pub stats: Arc<NodeStats>,
    /// The fleet view this node's Discovery publishes (what admission control reads).
    pub fleet: FleetView,
    /// The prefill queues this node's router publishes (what admission reads beside `fleet`).
    pub prefill_queues: crate::request_plane::router::load::PrefillQueueView,
    /// `Some`: this is a worker's own face (`face.rs`), not the gateway.
    pub face: Option<Arc<FaceInfo>>,
    /// This node's fleet event bus, streamed by `GET /v1/fleet/events`.
    pub bus: crate::request_plane::events::EventBus,
    /// The fleet page stream's recent past, replayed to a page when it connects
    /// (`page.rs`; recorded by the gateway actor while it runs).
    pub page_history: super::page::history::PageHistory,
}

impl GatewayShared {
    /// The fleet view this node's Discovery last published (each heartbeat tick and on every
    /// change): what `/health`, `/metrics` and admission read, without a call.
    ///
    /// # Errors
    /// 503 when none is published (Discovery is restarting).
    pub(crate) fn published_fleet(&self) -> Result<Arc<[NodeView]>, ApiError> {
        self.fleet.latest().ok_or_else(|| {
            ApiError::new(ErrorKind::Unavailable, "cluster membership is restarting")
        })
    }

    /// The fleet, fresh from this node's Discovery (for `/v1/fleet` and the chaos API, which
    /// want this node's own entry as of now; Discovery answers from what is published, no
    /// call to any scheduler).
    ///
    /// # Errors
    /// 503 when this node's Discovery is not running or does not answer.
    pub(crate) async fn fresh_fleet(&self) -> Result<Vec<NodeView>, ApiError> {
        let discovery = discovery::local(&self.discovery_name).ok_or_else(|| {
            ApiError::new(ErrorKind::Unavailable, "cluster membership is restarting")
        })?;
        discovery::fleet(&discovery).await.map_err(|e| {
            tracing::warn!(error = %e, "fleet view unavailable");
            ApiError::new(ErrorKind::Unavailable, "cluster membership is unavailable")
        })
    }
}

/// What the generation routes share.
#[derive(Clone)]
pub struct Serving {
    /// The model.
    pub frontend: Arc<Frontend>,
    /// This node.
    pub node: NodeId,
    /// Where this node's TokenSink delivers.
    pub registry: SinkRegistry,
    /// Registered name of the request supervisor.
    pub request_sup: String,
    /// Request id counter (shared with Request actors: each migration attempt takes a new id).
    pub next_id: Arc<AtomicU64>,
    /// Tokens per KV block (`worker.block_size_tokens`), for the requests' sequence hashes.
    pub block_size: usize,
    /// When a request whose worker is lost migrates, waits or gives up
    /// (`gateway.migration_*`).
    pub migration: crate::request_plane::migration::MigrationPolicy,
    /// Time for the Request actors.
    pub clock: crate::runtime::clock::SharedClock,
    /// This node's incarnation (its start, ms since the Unix epoch): every submitted sequence
    /// names it, so that workers can tell a restarted gateway's requests from the orphans of
    /// the one before.
    pub incarnation: u64,
    /// Interval of SSE keep-alive comments while a stream waits (`gateway.keep_alive_ms`).
    pub keep_alive: Duration,
    /// How long a request waits for a worker when none serves the model
    /// (`gateway.cold_start_timeout_ms`).
    pub cold_start_timeout: Duration,
    /// Admission thresholds.
    pub admission: Admission,
    /// Priority classes (`priority.*`): a request's class, its lane at the worker and its
    /// share of the shedding thresholds.
    pub priority: Arc<crate::request_plane::priority::PriorityConfig>,
    /// A worker's own face (`face.rs`): every request goes to this worker, no router asked.
    pub pin: Option<crate::runtime::ids::WorkerId>,
    /// This node's fleet event bus (placements, migrations, give-ups).
    pub bus: crate::request_plane::events::EventBus,
    /// Where a request's session key is read (`gateway.session_headers`,
    /// `gateway.session_from_user`).
    pub sessions: super::session::SessionKeys,
}

/// One fault as listed by `GET /chaos/faults`.
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecord {
    /// Id.
    pub id: u64,
    /// The fault as posted.
    pub spec: FaultSpec,
    /// Workers it hit.
    pub hit: Vec<WorkerId>,
    /// Nodes it was sent to.
    pub nodes: Vec<String>,
    /// Still installed.
    pub active: bool,
    /// When a timed fault ends (each node it hit ends it by itself then; the record follows).
    #[serde(skip)]
    pub ends_at: Option<std::time::Instant>,
}

/// The gateway's fault registry.
pub struct ChaosController {
    pub(super) next_id: std::sync::atomic::AtomicU64,
    pub(super) faults: std::sync::Mutex<Vec<FaultRecord>>,
    pub(super) token: Option<String>,
}

/// What a face knows about its replica.
#[derive(Debug)]
pub struct FaceInfo {
    /// The replica.
    pub worker: WorkerId,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The vLLM-format KV event socket's address, once bound.
    pub kv_events: Arc<Mutex<Option<SocketAddr>>>,
    /// The model file, as `model_path` in `/server_info`.
    pub model_path: String,
}
