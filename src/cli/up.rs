//! `flotilla up`: a local cluster of node processes on loopback.
//!
//! Node 0 runs the gateway and router roles; nodes 1.. run workers and join node 0 (with a
//! single node, it runs every role). `--gateways N` adds N − 1 more gateway + router nodes
//! (slots after the worker slots, named `gateway-<k>`), gateway k serving HTTP on the `--http`
//! port + k (port 0:
//! any free port each); any of them serves any request, and the routers share their load
//! (`router.share_load`). Every child gets a fresh random cookie, a free loopback
//! cluster port and KV transport port (outside the ephemeral range, see `runtime::ports`; a
//! node that finds one taken all the same exits with `PORT_TAKEN_EXIT` and `up` starts the
//! cluster again on other ports, [`PORT_ATTEMPTS`] starts in all), and `PR_SET_PDEATHSIG` so
//! it dies with this process even on SIGKILL. Once the
//! gateway reports every node up, the summary is printed (and a machine-readable
//! `FLOTILLA_UP {"gateway": URL, "gateways": [URL, …]}` line). A node that exits before that (HTTP port in use,
//! model missing, …) fails `up` at once: its own error is already on stderr, the other
//! nodes are stopped and `up` returns an error naming the node. After start-up, a node that
//! dies (crash, chaos `kill_node`) is started again under its name and joins the others; one
//! that stops cleanly is left stopped. More than `--max-restarts` crashes within
//! [`RESPAWN_WINDOW`] leave a node down; a chaos `kill_node` (exit
//! [`CHAOS_KILL_EXIT`]) is not counted: the budget stops crash loops, not injected faults.
//! `--prefill N --decode M` starts N prefill and M decode worker nodes (`worker.role`; see
//! `request_plane/role.rs`) instead of aggregated ones: a disaggregated cluster.
//! On Ctrl-C / SIGTERM each child gets SIGTERM — each node drains (see `node::drain`) — and is
//! given `STOP_GRACE` to stop in order, then SIGKILL; `up` exits 0 with no child left behind.

use crate::control::chaos::CHAOS_KILL_EXIT;
use crate::node::{READY_PREFIX, ReadyLine};
use figment::Figment;
use figment::providers::Serialized;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The tracing target of `up`'s own lines (nodes exiting, restarted, stopped; the planner's
/// starts and drains), written in the nodes' log format (`--log-format`).
pub const UP_TARGET: &str = "flotilla::up";

/// Time children get to stop after SIGTERM before they are killed.
pub const STOP_GRACE: Duration = Duration::from_secs(60);
/// Time allowed for the cluster to form while every node is alive.
pub const FORM_TIMEOUT: Duration = Duration::from_secs(90);
/// Starts of the whole cluster when a node finds a picked port taken (see `runtime::ports`).
pub const PORT_ATTEMPTS: usize = 3;
/// Prefix of the machine-readable line printed once the cluster is up.
pub const UP_PREFIX: &str = "FLOTILLA_UP ";

/// Options of `flotilla up`.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Node processes.
    pub nodes: usize,
    /// Gateway HTTP address (port 0: any free port).
    pub http: SocketAddr,
    /// Model file for the workers (passed on as `--model`).
    pub model: Option<PathBuf>,
    /// Config file passed to every node.
    pub config: Option<PathBuf>,
    /// Extra `--set`-style flags for every node (`key=value`).
    pub node_args: Vec<String>,
    /// Serve the chaos API on the gateway.
    pub chaos: bool,
    /// Start a node that dies again (`--no-restart` turns it off).
    pub restart: bool,
    /// Most restarts of one node within [`RESPAWN_WINDOW`]; one more and it stays down
    /// (chaos `kill_node` exits are not counted).
    pub max_restarts: usize,
    /// `worker.role` of each worker node (node 1, 2, …), for a disaggregated cluster
    /// (`--prefill N --decode M`); empty: every node keeps its configured role.
    pub worker_roles: Vec<crate::runtime::role::Role>,
    /// Run the planner on node 0 and reconcile its decisions (`--planner`): worker nodes
    /// started and drained to the desired counts (see [`reconcile`]).
    pub planner: bool,
    /// Gateway + router nodes (≥ 1): node 0 and `gateways − 1` more (`--gateways`).
    pub gateways: usize,
    /// The nodes' log format (`--log-format`, passed on as `FLOTILLA_LOG_FORMAT`); `None`:
    /// the environment's, else text.
    pub log_format: Option<String>,
    /// The nodes' OTLP export (`--otlp-endpoint`, passed on as `FLOTILLA_OTLP_ENDPOINT`);
    /// `None`: the environment's, else none.
    pub otlp_endpoint: Option<String>,
}

struct NodeProc {
    /// The node's slot (`node-<index>`).
    index: usize,
    name: String,
    child: Child,
    /// SIGTERM sent by the reconciler: it drains and stops, and is not restarted.
    draining: bool,
    /// When it was restarted (within the respawn window).
    restarts: Vec<std::time::Instant>,
    /// It exited with success (drained on SIGTERM): not restarted.
    stopped: bool,
}

/// Default of [`UpOptions::max_restarts`]: most restarts of one node within
/// [`RESPAWN_WINDOW`].
pub const MAX_RESPAWNS: usize = 10;
/// Window of [`UpOptions::max_restarts`].
pub const RESPAWN_WINDOW: Duration = Duration::from_secs(60);

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

impl NodeProc {
    /// Node slot `i`, just started under `name`.
    fn started(i: usize, name: String, child: Child) -> Self {
        Self {
            index: i,
            name,
            child,
            draining: false,
            restarts: Vec::new(),
            stopped: false,
        }
    }
}

/// The cluster addresses node `i` joins when it starts after the others: every other slot's.
fn peers(ports: &[u16], i: usize) -> Vec<String> {
    (0..ports.len())
        .filter(|j| *j != i)
        .map(|j| format!("127.0.0.1:{}", ports[j]))
        .collect()
}

/// What every node process of one `up` shares.
struct Launch {
    /// Starts of each node so far (the first is not a restart).
    starts: Vec<std::sync::atomic::AtomicU64>,
    exe: PathBuf,
    cookie: String,
    ports: Vec<u16>,
    /// Each node's KV transport port.
    transport_ports: Vec<u16>,
    /// `worker.role` of each node slot that sets one (slot 0: none).
    slot_roles: Vec<Option<crate::runtime::role::Role>>,
    /// The extra gateway nodes' slots (after every worker slot).
    gateway_slots: Vec<usize>,
    /// `FLOTILLA_GEMM_MIN_M` for every node: the CPU kernels' crossover, measured once here
    /// (`kernels/cpu/matmul.rs`), so that a node (re)started under load neither pays for the
    /// measurement nor measures a busy machine.
    gemm_min_m: Option<usize>,
    opts: UpOptions,
}

impl Launch {
    /// Slot `i`'s node name: `node-<i>`, or `gateway-<k>` for the k-th extra gateway.
    fn name(&self, i: usize) -> String {
        match self.gateway_slots.iter().position(|&g| g == i) {
            Some(k) => format!("gateway-{}", k + 1),
            None => node_name(i),
        }
    }

    /// Whether slot `i` runs a gateway (node 0 and the extra gateway slots).
    fn is_gateway(&self, i: usize) -> bool {
        i == 0 || self.gateway_slots.contains(&i)
    }

    /// The HTTP address gateway slot `i` is first started on: `--http`, its port + k for the
    /// k-th extra gateway (port 0 stays 0: a free port each).
    fn first_http(&self, i: usize) -> Option<SocketAddr> {
        let k = if i == 0 {
            0
        } else {
            1 + self.gateway_slots.iter().position(|&g| g == i)?
        };
        let mut addr = self.opts.http;
        if addr.port() != 0 {
            addr.set_port(addr.port().checked_add(u16::try_from(k).ok()?)?);
        }
        Some(addr)
    }

    /// Start node `i`, joining `join`, serving HTTP on `http` (node 0); its ready line goes to
    /// `ready`, its other output to ours.
    fn spawn(
        &self,
        i: usize,
        join: &[String],
        http: Option<&str>,
        ready: &tokio::sync::mpsc::UnboundedSender<ReadyLine>,
    ) -> anyhow::Result<Child> {
        let opts = &self.opts;
        let name = self.name(i);
        let roles = match (i, opts.nodes, opts.planner) {
            (0, 1, false) => "gateway,router,worker",
            (0, 1, true) => "gateway,router,worker,planner",
            (0, _, false) => "gateway,router",
            (0, _, true) => "gateway,router,planner",
            _ if self.is_gateway(i) && opts.planner => "gateway,router,planner",
            _ if self.is_gateway(i) => "gateway,router",
            _ => "worker",
        };
        let mut cmd = Command::new(&self.exe);
        cmd.arg("node")
            .arg("--name")
            .arg(&name)
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.ports[i]))
            .arg("--roles")
            .arg(roles)
            .env("FLOTILLA_NODE__COOKIE", &self.cookie);
        if let Some(m) = self.gemm_min_m {
            cmd.env("FLOTILLA_GEMM_MIN_M", m.to_string());
        }
        if let Some(f) = &opts.log_format {
            cmd.env("FLOTILLA_LOG_FORMAT", f);
        }
        if let Some(e) = &opts.otlp_endpoint {
            cmd.env("FLOTILLA_OTLP_ENDPOINT", e);
        }
        if let Some(role) = self.slot_roles.get(i).copied().flatten() {
            // Disaggregated: this worker node's role (a `--set worker.role=…` still wins).
            cmd.env("FLOTILLA_WORKER__ROLE", role.as_str());
        }
        if let Some(p) = self.transport_ports.get(i) {
            // The KV transport's TCP server (a `--set transport.tcp_bind=…` still wins).
            cmd.env("FLOTILLA_TRANSPORT__TCP_BIND", format!("127.0.0.1:{p}"));
        }
        if let Some(starts) = self.starts.get(i) {
            let before = starts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            cmd.env(
                crate::runtime::resilience::NODE_RESTARTS_ENV,
                before.to_string(),
            );
        }
        if let Some(h) = http {
            cmd.arg("--http").arg(h);
        }
        for j in join {
            cmd.arg("--join").arg(j);
        }
        if let Some(m) = &opts.model {
            cmd.arg("--model").arg(m);
        }
        if let Some(c) = &opts.config {
            cmd.arg("--config").arg(c);
        }
        for a in &opts.node_args {
            cmd.arg("--set").arg(a);
        }
        if opts.chaos {
            cmd.arg("--set").arg("chaos.enabled=true");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; the closure only calls it.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                    .map_err(std::io::Error::other)
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {name}: {e}"))?;
        if let Some(out) = child.stdout.take() {
            let tx = ready.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    match line.strip_prefix(READY_PREFIX) {
                        Some(json) => {
                            if let Ok(r) = serde_json::from_str::<ReadyLine>(json) {
                                let _ = tx.send(r);
                            }
                        }
                        None => println!("{line}"),
                    }
                }
            });
        }
        Ok(child)
    }
}

/// How the start-up phase of `up` ended.
enum Startup {
    /// Every node is up: the first gateway's URL and the fleet.
    Formed((String, crate::cli::status::Fleet)),
    /// A node exited, or the cluster did not form in time.
    Failed(anyhow::Error),
    /// Ctrl-C or SIGTERM.
    Stopped,
    /// This node exited because a port picked for it was taken ([`crate::runtime::ports`]).
    PortTaken(String),
}

fn cookie() -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..32)
        .map(|_| char::from(b"0123456789abcdef"[rng.random_range(0..16)]))
        .collect()
}

/// One `--set section.field=value` as a configuration layer: the dotted path is a figment key
/// path, the value is JSON when it parses as JSON, else a string.
///
/// # Errors
/// `kv` has no `=`.
pub fn set_override(kv: &str) -> anyhow::Result<SetFlag> {
    let (path, v) = kv
        .split_once('=')
        .ok_or_else(|| anyhow::anyhow!("--set {kv}: expected section.field=value"))?;
    let v = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.into()));
    Ok(SetFlag {
        flag: format!("--set {kv}"),
        value: Serialized::default(path, v),
    })
}

/// One `--set` as a configuration layer, named after the flag in errors (figment would name
/// the code that built it).
pub struct SetFlag {
    flag: String,
    value: Serialized<serde_json::Value>,
}

impl figment::Provider for SetFlag {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named(self.flag.clone())
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        self.value.data()
    }
}

/// What every node checks first — the configuration and the model path — checked once before
/// any node starts, so such a mistake is one plain error in milliseconds, not one per node.
/// Returns the model path the nodes will use.
fn preflight(
    opts: &UpOptions,
    cookie: &str,
) -> anyhow::Result<(PathBuf, crate::node::config::Config)> {
    let mut o = Figment::from(Serialized::default("node.cookie", cookie));
    for kv in &opts.node_args {
        o = o.merge(set_override(kv)?);
    }
    if let Some(m) = &opts.model {
        o = o.merge(Serialized::default(
            "worker.model_path",
            m.display().to_string(),
        ));
    }
    let config = crate::node::config::Config::load_with(opts.config.as_deref(), o)?;
    if opts.planner {
        // Node 0's own check, with the planner role it will have.
        let mut c = config.clone();
        c.node.roles.push(crate::runtime::role::NodeRole::Planner);
        c.validate()?;
    }
    let model = crate::model::resolve_model_path(config.worker.model_path.as_deref())?;
    Ok((model, config))
}

/// The worker node slots of a cluster: the first `opts.nodes - 1` start with it; with
/// `--planner`, spare slots follow, pool by pool, up to each pool's `planner.<pool>.max`
/// replicas (in nodes of `worker.replicas`). Each slot's `worker.role` (`None`: configured).
fn slot_roles(
    opts: &UpOptions,
    config: &crate::node::config::Config,
) -> Vec<Option<crate::runtime::role::Role>> {
    use crate::runtime::role::Role;
    let initial: Vec<Option<Role>> = (1..opts.nodes)
        .map(|i| opts.worker_roles.get(i - 1).copied())
        .collect();
    let mut slots = vec![None];
    slots.extend(initial.iter().copied());
    if opts.planner && opts.nodes > 1 {
        let per_node = config.worker.replicas.max(1) as usize;
        let pools: Vec<Option<Role>> = if opts.worker_roles.is_empty() {
            vec![None]
        } else {
            vec![Some(Role::Prefill), Some(Role::Decode)]
        };
        for pool in pools {
            let role = pool.unwrap_or(config.worker.role);
            let max_nodes = (config.planner.bounds(role).max as usize).div_ceil(per_node);
            let have = initial.iter().filter(|r| **r == pool).count();
            slots.extend(std::iter::repeat_n(pool, max_nodes.saturating_sub(have)));
        }
    }
    slots
}

/// The CPU kernels' crossover for every node of a CPU-engine cluster, measured here once on
/// the still idle machine (`None`: sim engines, or `FLOTILLA_GEMM_MIN_M` already set, which
/// the nodes inherit).
async fn cpu_crossover(config: &crate::node::config::Config) -> Option<usize> {
    if config.worker.engine != crate::worker::config::EngineKind::Cpu
        || std::env::var_os("FLOTILLA_GEMM_MIN_M").is_some()
    {
        return None;
    }
    let c = tokio::task::spawn_blocking(crate::kernels::cpu::matmul::crossover)
        .await
        .ok()?;
    tracing::info!(target: UP_TARGET, crossover = %c, "cpu kernels, for every node");
    Some(c.gemm_min_m)
}

/// A cluster being started: its node processes and what restarting one needs.
struct Started {
    procs: Vec<NodeProc>,
    launch: Launch,
    /// Each node's cluster port.
    ports: Vec<u16>,
    ready_tx: tokio::sync::mpsc::UnboundedSender<ReadyLine>,
}

/// Start every node on freshly picked ports and wait for the cluster to form (or a node to
/// exit, [`FORM_TIMEOUT`], or a signal).
async fn start_cluster(
    opts: &UpOptions,
    slot_roles: &[Option<crate::runtime::role::Role>],
    gemm_min_m: Option<usize>,
    cookie: &str,
    sigterm: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<(Startup, Started)> {
    let exe = std::env::current_exe()?;
    let worker_slots = slot_roles.len().max(opts.nodes);
    let gateway_slots: Vec<usize> =
        (worker_slots..worker_slots + opts.gateways.saturating_sub(1)).collect();
    let slots = worker_slots + gateway_slots.len();
    // Two ports per node (cluster, KV transport), all picked before any is released so that
    // they differ, and outside the ephemeral range so that no `bind(:0)` takes one before its
    // node binds it (see `runtime::ports`); a node binds its own, so no node binds port 0.
    let picked = crate::runtime::ports::free_loopback_ports(2 * slots)?;
    let (ports, transport_ports): (Vec<u16>, Vec<u16>) =
        (picked[..slots].to_vec(), picked[slots..].to_vec());
    let seed = format!("127.0.0.1:{}", ports[0]);
    let mut procs: Vec<NodeProc> = Vec::new();
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel::<ReadyLine>();
    let launch = Launch {
        starts: ports.iter().map(|_| Default::default()).collect(),
        exe,
        cookie: cookie.to_owned(),
        ports: ports.clone(),
        transport_ports,
        slot_roles: slot_roles.to_vec(),
        gateway_slots: gateway_slots.clone(),
        gemm_min_m,
        opts: opts.clone(),
    };
    let first: Vec<usize> = (0..opts.nodes)
        .chain(gateway_slots.iter().copied())
        .collect();
    let total = first.len();
    for i in first {
        let join = if i == 0 { vec![] } else { vec![seed.clone()] };
        let http = launch.first_http(i).map(|a| a.to_string());
        match launch.spawn(i, &join, http.as_deref(), &ready_tx) {
            Ok(child) => procs.push(NodeProc::started(i, launch.name(i), child)),
            Err(e) => {
                stop_all(&mut procs).await;
                return Err(e);
            }
        }
    }
    let formed = async {
        let mut gateway = None;
        while gateway.is_none() {
            let r = ready_rx
                .recv()
                .await
                .ok_or_else(|| anyhow::anyhow!("every node exited before the gateway was ready"))?;
            if let Some(h) = r.http_addr {
                gateway = Some(format!("http://{h}"));
            }
        }
        let gateway = gateway.unwrap_or_default();
        loop {
            if let Ok((fleet, _)) = crate::cli::status::fetch(&gateway).await {
                let up = fleet
                    .nodes
                    .iter()
                    .filter(|n| n.state == crate::control::discovery::membership::NodeState::Up)
                    .count();
                if up >= total {
                    return Ok::<_, anyhow::Error>((gateway, fleet));
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    // Start-up ends when the cluster forms, when a node exits (its own error is on stderr
    // already: `up` stops the others and fails at once), at FORM_TIMEOUT, or on a signal.
    let died = async {
        loop {
            for p in procs.iter_mut() {
                if let Ok(Some(status)) = p.child.try_wait() {
                    return (p.name.clone(), status);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let result = tokio::select! {
        r = tokio::time::timeout(FORM_TIMEOUT, formed) => match r {
            Ok(Ok(formed)) => Startup::Formed(formed),
            Ok(Err(e)) => Startup::Failed(e),
            Err(_) => Startup::Failed(anyhow::anyhow!(
                "the cluster did not form within {} s",
                FORM_TIMEOUT.as_secs()
            )),
        },
        (name, status) = died => {
            if status.code() == Some(i32::from(crate::runtime::ports::PORT_TAKEN_EXIT)) {
                Startup::PortTaken(name)
            } else {
                Startup::Failed(anyhow::anyhow!(
                    "{name} exited during start-up ({status}); its error is printed above"
                ))
            }
        }
        _ = tokio::signal::ctrl_c() => Startup::Stopped,
        _ = sigterm.recv() => Startup::Stopped,
    };
    Ok((
        result,
        Started {
            procs,
            launch,
            ports,
            ready_tx,
        },
    ))
}

/// Run a local cluster until Ctrl-C / SIGTERM.
///
/// # Errors
/// A bad configuration or a missing model (before any node starts); a node that exits before
/// the cluster has formed (its own error is on stderr; the others are stopped); the cluster not
/// forming within [`FORM_TIMEOUT`].
pub async fn up(opts: UpOptions) -> anyhow::Result<()> {
    anyhow::ensure!(opts.nodes >= 1, "--nodes must be at least 1");
    let cookie = cookie();
    let (model, config) = preflight(&opts, &cookie)?;
    let slot_roles = slot_roles(&opts, &config);
    let gemm_min_m = cpu_crossover(&config).await;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // A node whose picked port another process took meanwhile: start again on other ports.
    let mut attempt = 1;
    let (result, started) = loop {
        let (result, mut started) =
            start_cluster(&opts, &slot_roles, gemm_min_m, &cookie, &mut sigterm).await?;
        match result {
            Startup::PortTaken(name) if attempt < PORT_ATTEMPTS => {
                tracing::warn!(target: UP_TARGET,
                    "a port picked for {name} was taken meanwhile; \
                     starting the cluster again on other ports"
                );
                stop_all(&mut started.procs).await;
                attempt += 1;
            }
            r => break (r, started),
        }
    };
    let Started {
        mut procs,
        launch,
        ports,
        ready_tx,
    } = started;
    // Every gateway node's bound HTTP address, by node name (a restarted one binds it again).
    let mut gateway_http: std::collections::BTreeMap<String, String> = Default::default();
    let gateway_addr = match result {
        Startup::Formed((gateway, fleet)) => {
            for n in &fleet.nodes {
                if let Some(h) = &n.http_addr
                    && n.roles.contains(&crate::runtime::role::NodeRole::Gateway)
                {
                    gateway_http.insert(n.id.to_string(), h.clone());
                }
            }
            let urls: Vec<String> = (0..procs.len())
                .filter_map(|k| {
                    let p = procs.get(k)?;
                    launch
                        .is_gateway(p.index)
                        .then(|| gateway_http.get(&p.name))?
                })
                .map(|h| format!("http://{h}"))
                .collect();
            println!(
                "Flotilla is up: {} node(s)",
                opts.nodes + opts.gateways.saturating_sub(1)
            );
            if urls.len() > 1 {
                println!("gateways: {} (any serves any request)", urls.join(" "));
            } else {
                println!("gateway: {gateway}");
            }
            println!("model:   {}", model.display());
            if gateway.trim_end_matches('/') != crate::cli::DEFAULT_GATEWAY {
                // `flotilla status` and `flotilla chaos` default to DEFAULT_GATEWAY.
                println!("other shells: export FLOTILLA_GATEWAY={gateway}");
            }
            println!();
            print!("{}", crate::cli::status::render(&fleet));
            println!(
                "{UP_PREFIX}{}",
                serde_json::json!({ "gateway": gateway, "gateways": urls })
            );
            println!("Ctrl-C stops the cluster.");
            gateway.trim_start_matches("http://").to_owned()
        }
        Startup::Failed(e) => {
            stop_all(&mut procs).await;
            return Err(e);
        }
        Startup::PortTaken(name) => {
            stop_all(&mut procs).await;
            anyhow::bail!(
                "{name} could not bind its cluster or KV transport port in {PORT_ATTEMPTS} starts; \
                 its error is printed above"
            );
        }
        Startup::Stopped => {
            stop_all(&mut procs).await;
            return Ok(());
        }
    };

    // Supervise until asked to stop: a node that dies (crash, `kill_node`: a non-zero exit or
    // a signal) is started again under the same name, joining the others; more than
    // `max_restarts` within RESPAWN_WINDOW and it stays down. A node that stops cleanly (it
    // drained after its own SIGTERM) stays stopped.
    let gateway_urls: Vec<String> = std::iter::once(gateway_addr.clone())
        .chain(
            gateway_http
                .values()
                .filter(|h| **h != gateway_addr)
                .cloned(),
        )
        .collect();
    let mut reconciler = Reconciler {
        last_applied_ms: None,
        fence: Default::default(),
        per_node: config.worker.replicas.max(1),
        next_at: std::time::Instant::now(),
    };
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if opts.planner && std::time::Instant::now() >= reconciler.next_at {
                    reconciler.next_at = std::time::Instant::now() + RECONCILE_EVERY;
                    reconciler
                        .reconcile(&gateway_urls, &mut procs, &launch, &ports, &ready_tx)
                        .await;
                }
                for p in procs.iter_mut() {
                    let i = p.index;
                    if p.stopped {
                        continue;
                    }
                    if !opts.restart {
                        if let Ok(Some(status)) = p.child.try_wait() {
                            tracing::warn!(target: UP_TARGET,"{} exited ({status}); left down (--no-restart)", p.name);
                            p.stopped = true;
                        }
                        continue;
                    }
                    let Ok(Some(status)) = p.child.try_wait() else { continue };
                    if status.success() || p.draining {
                        // Drained and stopped on purpose (SIGTERM to that node): leave it.
                        tracing::info!(target: UP_TARGET,"{} stopped ({status})", p.name);
                        p.stopped = true;
                        continue;
                    }
                    let now = std::time::Instant::now();
                    p.restarts.retain(|t| now.duration_since(*t) < RESPAWN_WINDOW);
                    // A chaos `kill_node` is a fault the user injected, not a crash loop: it
                    // is restarted without counting against the budget.
                    let injected = status.code() == Some(CHAOS_KILL_EXIT);
                    if injected {
                        tracing::warn!(target: UP_TARGET, "{} killed by the chaos API (exit {CHAOS_KILL_EXIT}); starting it again", p.name);
                    } else if p.restarts.len() >= opts.max_restarts {
                        tracing::warn!(target: UP_TARGET,
                            "{} exited ({status}) {} times within {} s; leaving it down (--max-restarts)",
                            p.name, p.restarts.len() + 1, RESPAWN_WINDOW.as_secs()
                        );
                        p.stopped = true;
                        continue;
                    }
                    if !injected {
                        tracing::warn!(target: UP_TARGET,"{} exited ({status}); starting it again", p.name);
                        p.restarts.push(now);
                    }
                    let join = peers(&ports, i);
                    let http = if launch.is_gateway(i) {
                        gateway_http
                            .get(&p.name)
                            .cloned()
                            .or_else(|| launch.first_http(i).map(|a| a.to_string()))
                    } else {
                        None
                    };
                    match launch.spawn(i, &join, http.as_deref(), &ready_tx) {
                        Ok(child) => p.child = child,
                        Err(e) => tracing::warn!(target: UP_TARGET,"cannot restart {}: {e}", launch.name(i)),
                    }
                }
            }
        }
    }
    tracing::info!(target: UP_TARGET,"stopping {} node(s)…", procs.len());
    stop_all(&mut procs).await;
    Ok(())
}

async fn stop_all(procs: &mut [NodeProc]) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    for p in procs.iter() {
        if let Some(pid) = p.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
    }
    let deadline = tokio::time::Instant::now() + STOP_GRACE;
    for p in procs.iter_mut() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, p.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                tracing::warn!(target: UP_TARGET,"{} did not stop in time; killing it", p.name);
                let _ = p.child.kill().await;
            }
        }
    }
}

/// How often `up --planner` reads the planner's decision.
pub const RECONCILE_EVERY: Duration = Duration::from_secs(1);

/// `up --planner`'s local reconciler: it reads the planner's latest decision from the
/// gateway's `/v1/fleet` (the published fleet view) and starts or drains worker node
/// processes to match each pool's desired replica count (in nodes of `worker.replicas`).
/// A scale-up starts the lowest free slots of the pool (a spare, or a node it drained
/// before); a scale-down sends SIGTERM to the pool's highest running slots — each drains
/// (leaves routing, finishes what it runs) and stops, and is not restarted. Node 0 (gateway,
/// router, planner) is never drained. A node that fails while starting is restarted by the
/// launcher's own rule (at most `--max-restarts` a minute); the planner does not count it
/// until it is in the view. Only decisions in mode `act`, not stale, each applied once
/// (`control::reconcile`: only a down decision drains; an up or hold starts).
struct Reconciler {
    last_applied_ms: Option<u64>,
    /// The highest planner term seen (`control::reconcile::Fence`).
    fence: crate::control::reconcile::Fence,
    per_node: u32,
    next_at: std::time::Instant,
}

impl Reconciler {
    async fn reconcile(
        &mut self,
        gateways: &[String],
        procs: &mut Vec<NodeProc>,
        launch: &Launch,
        ports: &[u16],
        ready: &tokio::sync::mpsc::UnboundedSender<ReadyLine>,
    ) {
        // Any gateway will do: each publishes the same fleet view.
        let mut fleet = None;
        for g in gateways {
            if let Ok((f, _)) = crate::cli::status::fetch(g).await {
                fleet = Some(f);
                break;
            }
        }
        let Some(fleet) = fleet else {
            return;
        };
        let planners = fleet.nodes.iter().filter_map(|n| n.planner.as_ref());
        let refused = self.fence.refused;
        let pending =
            crate::control::reconcile::pending(planners, self.last_applied_ms, &mut self.fence);
        if self.fence.refused > refused {
            tracing::warn!(target: UP_TARGET,
                "refused the decisions of a planner leading in a term below {} \
                 (a deposed leader)",
                self.fence.term
            );
        }
        let Some(d) = pending.last().copied() else {
            return;
        };
        self.last_applied_ms = Some(d.at_ms);
        for pd in &d.pools {
            let in_pool = |i: usize| {
                i > 0
                    && !launch.is_gateway(i)
                    && launch
                        .slot_roles
                        .get(i)
                        .copied()
                        .flatten()
                        .unwrap_or_default()
                        == pd.role
            };
            let running: Vec<usize> = procs
                .iter()
                .filter(|p| in_pool(p.index) && !p.stopped && !p.draining)
                .map(|p| p.index)
                .collect();
            // The decisions since the last pass, folded: only a down lowers a pool.
            let Some(want) = crate::control::reconcile::target(
                &pending,
                pd.role,
                running.len() as u32,
                self.per_node,
            ) else {
                continue;
            };
            let want = want as usize;
            if want > running.len() {
                let free: Vec<usize> = (1..launch.slot_roles.len())
                    .filter(|&i| in_pool(i) && !running.contains(&i))
                    .filter(|&i| {
                        procs
                            .iter()
                            .find(|p| p.index == i)
                            .is_none_or(|p| p.stopped)
                    })
                    .take(want - running.len())
                    .collect();
                for i in free {
                    let join = peers(ports, i);
                    tracing::info!(target: UP_TARGET,
                        "the planner wants {} {} replica(s): starting {}",
                        pd.desired,
                        pd.role.as_str(),
                        node_name(i)
                    );
                    match launch.spawn(i, &join, None, ready) {
                        Ok(child) => {
                            procs.retain(|p| p.index != i);
                            procs.push(NodeProc::started(i, launch.name(i), child));
                        }
                        Err(e) => {
                            tracing::warn!(target: UP_TARGET,"cannot start {}: {e}", node_name(i))
                        }
                    }
                }
            } else if want < running.len() {
                let mut drain = running.clone();
                drain.sort_unstable_by(|a, b| b.cmp(a));
                for i in drain.into_iter().take(running.len() - want) {
                    let Some(p) = procs.iter_mut().find(|p| p.index == i) else {
                        continue;
                    };
                    tracing::info!(target: UP_TARGET,
                        "the planner wants {} {} replica(s): draining {}",
                        pd.desired,
                        pd.role.as_str(),
                        p.name
                    );
                    p.draining = true;
                    if let Some(pid) = p.child.id() {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid as i32),
                            nix::sys::signal::Signal::SIGTERM,
                        );
                    }
                }
            }
        }
    }
}
