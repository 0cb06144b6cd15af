//! The composition root: one node process — its NodeServer, its supervision tree, and how it
//! starts and stops — and what the tree is built from.
//! - `config.rs` — the typed configuration tree (TOML + env + `--set`); it builds the planes'
//!   own settings (`From` impls).
//! - `context.rs` — [`context::NodeContext`]: the node's shared parts and configuration;
//!   `tree_args.rs` builds from it what the supervision tree (`supervisors/tree.rs`) is
//!   started with.
//! - this file — start, the ready line, drain, ordered stop.

pub mod config;
pub mod context;
mod name_check;
pub mod tree_args;

use crate::node::config::Config;
use crate::node::context::NodeContext;
use crate::runtime::cluster::{self, ClusterError};
use crate::runtime::ids::NodeId;
use crate::runtime::resilience::NodeStats;
use crate::runtime::supervision::{Supervisor, SupervisorMsg};
use crate::supervisors::tree;
use ractor::{Actor, ActorRef};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;

/// Errors starting a node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Cluster layer.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The model could not be loaded.
    #[error("model: {0}")]
    Model(#[from] crate::model::ModelError),
    /// The supervision tree failed to start.
    #[error("supervision tree failed to start: {0}")]
    Tree(String),
    /// `worker.backend` cannot be honoured (`cuda` without a usable GPU: the message names
    /// what is missing).
    #[error("worker.backend: {0}")]
    Backend(String),
    /// The KV transport could not start (`transport.backend = "ucx"` without UCX, a TCP
    /// address that cannot be bound).
    #[error("transport: {0}")]
    Transport(crate::transport::TransportError),
    /// A live node of the cluster already has this node's name (`name_check.rs`).
    #[error(
        "node name {name:?} is taken: a live node of the cluster has it (cluster address \
         {addr}, pid {pid}); node names must be unique (--name)"
    )]
    NameTaken {
        /// The name.
        name: String,
        /// The live node's cluster address.
        addr: String,
        /// Its process id (on its host).
        pid: u32,
    },
}

// By hand, not `#[from]`: the message above already holds the transport's, which a source
// would print a second time in `{:#}`.
impl From<crate::transport::TransportError> for NodeError {
    fn from(e: crate::transport::TransportError) -> Self {
        Self::Transport(e)
    }
}

impl NodeError {
    /// A port this node was told to bind (cluster, KV transport) is taken.
    #[must_use]
    pub fn is_port_taken(&self) -> bool {
        use std::io::ErrorKind::AddrInUse;
        match self {
            Self::Cluster(ClusterError::Listen { source, .. }) => source.kind() == AddrInUse,
            Self::Transport(crate::transport::TransportError::Bind { kind, .. }) => {
                *kind == AddrInUse
            }
            _ => false,
        }
    }
}

/// Where this node's real engines run: `worker.backend` resolved against what loads here
/// (logged with the reason), and the GPUs the driver sees. Nodes without the worker role or
/// with the sim engine run no real engine: CPU, no question asked.
///
/// # Errors
/// [`NodeError::Backend`] when `worker.backend = "cuda"` cannot be honoured.
fn engine_device(config: &Config) -> Result<(crate::kernels::Device, usize), NodeError> {
    use crate::kernels::{Device, cuda};
    let w = &config.worker;
    if !config.has_role(crate::runtime::role::NodeRole::Worker)
        || w.engine != crate::worker::config::EngineKind::Cpu
    {
        return Ok((Device::Cpu, 0));
    }
    let sel = cuda::select(w.backend).map_err(NodeError::Backend)?;
    tracing::info!(cuda = sel.cuda, gpus = sel.gpus, reason = %sel.reason, "engine backend");
    let device = sel.device(0, w.cuda_gemm);
    if matches!(device, Device::Cpu) {
        // Measured here once (about 0.1 s), before the first request needs it.
        let isa = crate::kernels::cpu::matmul::isa();
        let crossover = crate::kernels::cpu::matmul::crossover();
        tracing::info!(?isa, %crossover, "cpu kernels");
    }
    Ok((device, sel.gpus))
}

/// The line a node prints on stdout once it is up, prefixed by [`READY_PREFIX`].
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ReadyLine {
    /// Node name.
    pub node: String,
    /// Cluster address.
    pub cluster_addr: String,
    /// HTTP address, when the node runs a gateway.
    pub http_addr: Option<String>,
}

/// Prefix of the ready line.
pub const READY_PREFIX: &str = "FLOTILLA_READY ";

/// A started node.
pub struct RunningNode {
    /// Shared context.
    pub ctx: NodeContext,
    /// Root supervisor.
    pub root: ActorRef<SupervisorMsg>,
    root_task: JoinHandle<()>,
}

/// How a node ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeExit {
    /// Asked to stop; everything stopped in order.
    Stopped,
    /// The root supervisor exceeded its restart budget.
    Escalated,
    /// This node was away (paused, or cut off) past the liveness timeout, and another node
    /// took its name meanwhile: a peer told it so when it came back, or a gateway's fleet view
    /// showed it the newer holder when the seeds refused its sessions; it stopped (without a
    /// drain: the cluster had already moved its work). Where its session had displaced the
    /// new node's, the new node re-dials its seeds and is whole again once this one is gone.
    Superseded(Box<crate::control::discovery::membership::Superseded>),
}

/// A start failure of the tree as a plain chain of causes: ractor words every start failure
/// "Actor panicked during startup '…'" (nested once per supervisor level, and no panic is
/// involved); this keeps "child X failed to start: …" down to the innermost cause.
fn plain_start_error(e: &ractor::SpawnErr) -> String {
    let s = e.to_string();
    let plain = s.replace("Actor panicked during startup '", "");
    let quotes = s.matches("Actor panicked during startup '").count();
    let mut out = plain.as_str();
    for _ in 0..quotes {
        out = out.strip_suffix('\'').unwrap_or(out);
    }
    out.to_owned()
}

/// Start a node: NodeServer, tree, then join the seeds (an authentication failure is fatal).
///
/// # Errors
/// [`NodeError::Model`] when a worker or gateway node cannot load its model;
/// [`NodeError::Tree`] when the sim profile is unreadable or the supervision tree fails to
/// start; [`NodeError::Cluster`] when the NodeServer cannot listen or no seed can be joined
/// (a wrong cookie included); [`NodeError::NameTaken`] when a live node of the cluster has
/// this node's name.
pub async fn start(config: Config) -> Result<RunningNode, NodeError> {
    crate::runtime::metrics::handle();
    crate::runtime::resilience::install_panic_hook();
    let config = Arc::new(config);
    let node_id = NodeId::new(config.node.name());
    if !config.node.join.is_empty()
        && let Some(namesake) = name_check::live_namesake(&config, &node_id).await?
    {
        return Err(NodeError::NameTaken {
            name: node_id.to_string(),
            addr: namesake.addr,
            pid: namesake.pid,
        });
    }
    let model = if config.has_role(crate::runtime::role::NodeRole::Worker) {
        let path = crate::model::resolve_model_path(config.worker.model_path.as_deref())?;
        let loaded = crate::model::load_model(&path)?;
        tracing::info!(model = %path.display(), "model loaded");
        Some(Arc::new(loaded))
    } else {
        None
    };
    // Gateways tokenize; so do workers with their own HTTP faces.
    let frontend = if config.has_role(crate::runtime::role::NodeRole::Gateway)
        || (config.has_role(crate::runtime::role::NodeRole::Worker) && config.worker.http.is_some())
    {
        let path = crate::model::resolve_model_path(config.worker.model_path.as_deref())?;
        let fe = crate::request_plane::frontend::Frontend::load(
            &path,
            config.worker.max_model_len_tokens,
        )?;
        tracing::info!(model = %fe.model_id, context = fe.context_len, "serving model");
        Some(Arc::new(fe))
    } else {
        None
    };
    let sim_profile = match config.worker.engine {
        crate::worker::config::EngineKind::Cpu => None,
        crate::worker::config::EngineKind::Sim => Some(match &config.worker.sim_profile {
            Some(p) => crate::worker::engine::sim::SimProfile::load(p)
                .map_err(|e| NodeError::Tree(e.to_string()))?,
            None => Default::default(),
        }),
    };
    let planner_capacity = if config.has_role(crate::runtime::role::NodeRole::Planner) {
        let sim = sim_profile.clone().unwrap_or_default();
        Some(
            config
                .planner_capacity(Some(&sim))
                .map_err(|e| NodeError::Tree(e.to_string()))?,
        )
    } else {
        None
    };
    let (device, gpus) = engine_device(&config)?;
    let cluster = cluster::start_node_server(
        node_id.clone(),
        config.node.listen_addr,
        config.node.cookie.clone(),
        config.cluster.max_frame_bytes,
    )
    .await?;
    // Worker nodes own KV memory peers may read: one transport per node, before the tree (the
    // engines allocate their pools through it), after the cluster listener (so that its own
    // port is taken before the transport binds one).
    let faults = crate::control::chaos::FaultBook::default();
    let transport = if config.has_role(crate::runtime::role::NodeRole::Worker) {
        Some(Arc::new(
            crate::transport::Transport::start(
                node_id.as_str(),
                config.transport.clone(),
                faults.transfer.clone(),
            )
            .await?,
        ))
    } else {
        None
    };
    let ctx = NodeContext {
        config: config.clone(),
        node_id: node_id.clone(),
        prefix: format!("{node_id}/"),
        cluster: cluster.clone(),
        membership: tokio::sync::broadcast::channel(1024).0,
        http_addr: Arc::new(Mutex::new(None)),
        incarnation: crate::runtime::clock::unix_ms(),
        clock: crate::runtime::clock::system(),
        model,
        faults,
        fault_filters: Default::default(),
        frontend,
        transport,
        sim_profile,
        device,
        gpus,
        stats: Arc::new(NodeStats::from_env()),
        fleet: Default::default(),
        prefill_queues: Default::default(),
        endpoints: Default::default(),
        worker_stats: Default::default(),
        events: crate::request_plane::events::EventBus::new(node_id.clone()),
        planner: Default::default(),
        planner_capacity,
    };
    let spec = tree::node_tree(&tree_args::node_tree_args(&ctx));
    let (root, root_task) = match Actor::spawn(spec.actor_name.clone(), Supervisor, spec).await {
        Ok(x) => x,
        Err(e) => {
            cluster.server.stop(None);
            return Err(NodeError::Tree(plain_start_error(&e)));
        }
    };
    let node = RunningNode {
        ctx,
        root,
        root_task,
    };
    if !config.node.join.is_empty() {
        let timeout = Duration::from_millis(config.cluster.connect_timeout_ms);
        if let Err(e) = cluster::join_any(&cluster.server, &config.node.join, timeout).await {
            node.stop().await;
            return Err(e.into());
        }
    }
    Ok(node)
}

impl RunningNode {
    /// The ready line for this node.
    pub fn ready_line(&self) -> ReadyLine {
        ReadyLine {
            node: self.ctx.node_id.to_string(),
            cluster_addr: self.ctx.cluster.addr.to_string(),
            http_addr: self
                .ctx
                .http_addr
                .lock()
                .map(|g| g.clone())
                .unwrap_or_else(|p| p.into_inner().clone()),
        }
    }

    /// Run until `shutdown` resolves (then drain and stop in order) or the root supervisor
    /// dies.
    pub async fn wait(mut self, shutdown: impl std::future::Future<Output = ()>) -> NodeExit {
        let superseded = superseded(&self.ctx);
        tokio::select! {
            s = superseded => {
                self.stop_ref().await;
                NodeExit::Superseded(s)
            }
            _ = shutdown => {
                let grace = Duration::from_millis(self.ctx.config.node.drain_grace_ms);
                drain(&self.ctx, grace).await;
                self.stop_ref().await;
                NodeExit::Stopped
            }
            _ = &mut self.root_task => {
                tracing::error!("node supervisor exceeded its restart budget; node exits");
                self.ctx.cluster.server.stop(None);
                NodeExit::Escalated
            }
        }
    }

    async fn stop_ref(&mut self) {
        let _ = self
            .root
            .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(60)))
            .await;
        let _ = self
            .ctx
            .cluster
            .server
            .stop_and_wait(None, Some(Duration::from_secs(5)))
            .await;
    }

    /// Stop the tree (reverse start order) and the cluster server.
    pub async fn stop(mut self) {
        self.stop_ref().await;
    }
}

/// Resolves when this node's Discovery learns that this incarnation has been superseded
/// ([`crate::actors::discovery::DiscoveryMsg::Superseded`]).
async fn superseded(ctx: &NodeContext) -> Box<crate::control::discovery::membership::Superseded> {
    use crate::control::discovery::membership::MembershipEvent;
    use tokio::sync::broadcast::error::RecvError;
    let mut rx = ctx.membership.subscribe();
    loop {
        match rx.recv().await {
            Ok(MembershipEvent::Superseded(s))
                if s.node == ctx.node_id && s.stale_incarnation == ctx.incarnation =>
            {
                return s;
            }
            Ok(_) | Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => std::future::pending().await,
        }
    }
}

/// Drain this node: its workers leave routing at once (routers stop choosing them; `/health`
/// and `/v1/fleet` show `draining`), its gateway refuses new requests with 503; in-flight
/// requests get `grace` to finish; whatever still runs on its workers then migrates
/// ([`crate::actors::scheduler::SchedulerMsg::HandOffAll`]). Returns when nothing is left or the
/// grace period is over. Only this node's schedulers are drained, also when other nodes run
/// in the same process.
pub async fn drain(ctx: &NodeContext, grace: Duration) {
    use crate::actors::scheduler::SchedulerMsg;
    use crate::runtime::wire::Wire;
    use crate::worker::scheduler::SCHEDULER_GROUP;
    ctx.stats.set_draining();
    let schedulers: Vec<ActorRef<SchedulerMsg>> =
        ractor::pg::get_local_members(&SCHEDULER_GROUP.to_owned())
            .into_iter()
            .filter(|c| c.get_name().is_some_and(|n| n.starts_with(&ctx.prefix)))
            .map(Into::into)
            .collect();
    for s in &schedulers {
        let _ = s.cast(SchedulerMsg::Drain(Wire::encode(&())));
    }
    let deadline = tokio::time::Instant::now() + grace;
    let started = std::time::Instant::now();
    loop {
        let mut busy = ctx.stats.gateway_in_flight() as usize;
        for s in &schedulers {
            if let Ok(w) = ractor::call_t!(s, SchedulerMsg::Stats, 500)
                && let Ok(st) = w.decode()
            {
                busy += st.running + st.waiting;
            }
        }
        if busy == 0 {
            tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, "drained");
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(busy, "drain grace period over; migrating what is left");
            for s in &schedulers {
                let _ = s.cast(SchedulerMsg::HandOffAll(Wire::encode(
                    &"the worker drained".to_owned(),
                )));
            }
            // Let the hand-offs reach their gateways before the node stops.
            tokio::time::sleep(Duration::from_millis(300)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `e`, a node's start-up error, is a port it was told to bind (cluster, KV
/// transport) being taken: the node then exits with [`PORT_TAKEN_EXIT`](crate::runtime::ports::PORT_TAKEN_EXIT).
#[must_use]
pub fn is_port_taken(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<NodeError>()
            .is_some_and(NodeError::is_port_taken)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_errors_read_plainly() {
        let inner: ractor::ActorProcessingErr =
            "gateway cannot listen on 127.0.0.1:1: in use".into();
        let mid: ractor::ActorProcessingErr = format!(
            "child http_gateway failed to start: {}",
            ractor::SpawnErr::StartupFailed(inner)
        )
        .into();
        let e = ractor::SpawnErr::StartupFailed(mid);
        assert_eq!(
            super::plain_start_error(&e),
            "child http_gateway failed to start: gateway cannot listen on 127.0.0.1:1: in use"
        );
    }

    #[tokio::test]
    async fn a_taken_cluster_or_transport_port_is_told_apart() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let cluster = crate::runtime::cluster::start_node_server(
            crate::runtime::ids::NodeId::from("n"),
            addr,
            "c".into(),
            1 << 20,
        )
        .await
        .map(|_| ())
        .unwrap_err();
        let e = anyhow::Error::from(NodeError::from(cluster));
        assert!(is_port_taken(&e), "{e:#}");
        assert_eq!(
            format!("{e:#}").matches("in use").count(),
            1,
            "said once: {e:#}"
        );
        let served = crate::transport::tcp::ServedRegions::default();
        let tcp = crate::transport::tcp::TcpServer::start(&addr.to_string(), served)
            .await
            .map(|_| ())
            .unwrap_err();
        let e = anyhow::Error::from(NodeError::from(tcp));
        assert!(is_port_taken(&e), "{e:#}");
        assert_eq!(
            format!("{e:#}").matches("cannot listen").count(),
            1,
            "said once: {e:#}"
        );
        assert!(!is_port_taken(&anyhow::anyhow!("other")));
    }
}
