//! The `flotilla` binary: parses flags and calls the library.

use clap::{Args, Parser, Subcommand};
use figment::Figment;
use figment::providers::Serialized;
use flotilla::node::config::{Config, NodeRole};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "flotilla",
    version,
    about = "Serve one LLM from a fleet of replicas"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log lines on stderr: `text` (plain, coloured on a terminal only) or `json` (one JSON
    /// object per line: `timestamp`, `level`, `target`, `fields` (with `message`), and `span`
    /// / `spans` with the request's `request_id` inside a request); `flotilla up` passes it
    /// to its nodes.
    #[arg(long, global = true, value_enum, env = "FLOTILLA_LOG_FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Also export the tracing spans (the gateway's `request` span with its `request_id`, …)
    /// to an OpenTelemetry collector over OTLP/HTTP (protobuf), e.g. `http://127.0.0.1:4318`
    /// (`/v1/traces` is added); off when absent. `flotilla up` passes it to its nodes.
    #[arg(
        long,
        global = true,
        env = "FLOTILLA_OTLP_ENDPOINT",
        value_name = "URL"
    )]
    otlp_endpoint: Option<String>,
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start a local cluster of node processes on loopback and print the gateway URL.
    Up(UpArgs),
    /// Start one node of a cluster.
    Node(NodeArgs),
    /// Print the fleet (nodes, roles, actors, states) from a gateway.
    Status(StatusArgs),
    /// Run the engine in-process (no cluster) and print the completion.
    Generate(flotilla::cli::generate::GenerateArgs),
    /// Inject and clear faults through the gateway's chaos API.
    Chaos(flotilla::cli::chaos::ChaosArgs),
    /// Replay a trace or dataset against a gateway; report latency, goodput, prefix hits.
    Bench(flotilla::cli::bench::BenchArgs),
    /// Replay a trace or dataset on a simulated fleet (the fleet's own routing, scheduling and
    /// KV code on a virtual clock); report it as `bench` does.
    Sim(Box<flotilla::cli::sim::SimArgs>),
    /// Draw runs side by side (`bench` and `sim` output folders): TTFT and ITL CDFs, requests
    /// in flight over time.
    Plot(flotilla::cli::plot::PlotArgs),
    /// Measure the CPU engine and write a timing profile for the simulated engine.
    Profile(flotilla::cli::profile::ProfileArgs),
    /// KV transfer between processes: serve a test region, or benchmark the backends.
    Transport(flotilla::cli::transport::TransportArgs),
    /// Apply the planner's decisions to Kubernetes: patch the scale of each pool's workload.
    #[cfg(feature = "kubernetes")]
    Reconcile(flotilla::cli::reconcile::ReconcileArgs),
    /// Report which CUDA libraries load and compile the GPU kernels with NVRTC (no GPU needed).
    Cuda(flotilla::cli::cuda::CudaArgs),
    /// Print the configuration reference (`--reference`: every key, its type, default, unit
    /// and doc, as Markdown), generated from the configuration types.
    Config(flotilla::cli::config::ConfigArgs),
}

#[derive(Args)]
struct UpArgs {
    /// Number of node processes (node 0: gateway + router; the others: workers), not counting
    /// the extra gateways of `--gateways`.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Gateway + router nodes: node 0 and N − 1 more, gateway k serving HTTP on the `--http`
    /// port plus k (any of them serves any request; the routers share one prefix index and
    /// their load).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    gateways: usize,
    /// Model file served by the workers.
    #[arg(long, env = "FLOTILLA_MODEL")]
    model: Option<PathBuf>,
    /// Gateway HTTP address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: SocketAddr,
    /// Configuration file given to every node.
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    /// Set a configuration value on every node, `section.field=value` (repeatable).
    #[arg(long = "set")]
    set: Vec<String>,
    /// Serve the chaos API (`/chaos/faults`) on the gateway.
    #[arg(long)]
    chaos: bool,
    /// Leave a node that dies down instead of starting it again.
    #[arg(long)]
    no_restart: bool,
    /// Most crash restarts of one node within 60 s; one more and it is left down (a chaos
    /// `kill_node` is not counted).
    #[arg(long, default_value_t = flotilla::cli::up::MAX_RESPAWNS)]
    max_restarts: usize,
    /// Engine of every replica: `cpu` (the real model) or `sim` (timing model, for fleet runs).
    #[arg(long, value_parser = ["cpu", "sim"])]
    engine: Option<String>,
    /// Total workers (replicas), spread evenly over the worker nodes (`worker.replicas` each,
    /// rounded up).
    #[arg(long)]
    workers: Option<usize>,
    /// Disaggregated: this many prefill worker nodes (with `--decode`; sets `--nodes` to
    /// 1 + prefill + decode).
    #[arg(long, requires = "decode")]
    prefill: Option<usize>,
    /// Disaggregated: this many decode worker nodes (with `--prefill`).
    #[arg(long, requires = "prefill")]
    decode: Option<usize>,
    /// Run the planner on node 0 (and on every gateway node of `--gateways`: one leads, the
    /// others stand by; `planner.*` settings) and start or drain worker nodes to its
    /// decisions (mode act; in mode advisory it only publishes them).
    #[arg(long)]
    planner: bool,
}

#[derive(Args)]
struct NodeArgs {
    /// Configuration file (TOML).
    #[arg(long, env = "FLOTILLA_CONFIG")]
    config: Option<PathBuf>,
    /// Node name, unique in the cluster.
    #[arg(long)]
    name: Option<String>,
    /// Cluster listen address.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Seed nodes to join, comma-separated `host:port`.
    #[arg(long, value_delimiter = ',')]
    join: Vec<String>,
    /// Roles, comma-separated: gateway, router, worker, planner.
    #[arg(long, value_delimiter = ',')]
    roles: Vec<NodeRole>,
    /// Cluster cookie (shared secret); also FLOTILLA_NODE__COOKIE.
    #[arg(long)]
    cookie: Option<String>,
    /// Gateway HTTP address.
    #[arg(long)]
    http: Option<SocketAddr>,
    /// Replicas on a worker node.
    #[arg(long)]
    replicas: Option<u32>,
    /// Model file (GGUF) or Hugging Face directory served by worker roles.
    #[arg(long, env = "FLOTILLA_MODEL")]
    model: Option<PathBuf>,
    /// Set a configuration value, `section.field=value` (repeatable; value parsed as JSON
    /// when it can be, else taken as a string).
    #[arg(long = "set")]
    set: Vec<String>,
}

#[derive(Args)]
struct StatusArgs {
    /// Gateway base URL.
    #[arg(
        long,
        env = "FLOTILLA_GATEWAY",
        default_value = flotilla::cli::DEFAULT_GATEWAY,
        value_parser = flotilla::cli::gateway_arg
    )]
    gateway: String,
    /// Print the raw JSON of `/v1/fleet`.
    #[arg(long, conflicts_with = "watch")]
    json: bool,
    /// Refresh until Ctrl-C: health, each node's counters, each worker's load, redrawn in
    /// place on a terminal (one frame per interval, blank-line separated, on a pipe).
    #[arg(long)]
    watch: bool,
    /// Seconds between two frames of `--watch`.
    #[arg(long, default_value_t = 1.0, requires = "watch")]
    interval: f64,
}

/// Logs on stderr in `format`, filtered by `FLOTILLA_LOG`, else by `default`; with `otlp`,
/// the spans that pass the same filter are exported too.
fn init_tracing(default: &str, format: LogFormat, otlp: Option<&flotilla::runtime::otlp::Otlp>) {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    // The cluster library's session chatter stays quiet under a user's filter too, unless the
    // filter names it (`FLOTILLA_LOG=info,flotilla::access=off` must not bring it back).
    let filter = match std::env::var("FLOTILLA_LOG") {
        Ok(user) if !user.trim().is_empty() => {
            let quiet = if user.contains("ractor") {
                ""
            } else {
                ",ractor_cluster=error,ractor=warn"
            };
            EnvFilter::try_new(format!("{user}{quiet}")).unwrap_or_else(|_| EnvFilter::new(default))
        }
        _ => EnvFilter::new(default),
    };
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(otlp.map(|o| o.layer()));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => registry
            .with(fmt.json().with_current_span(true).with_span_list(true))
            .try_init(),
        // Colours only on a terminal: a log file or a pipe gets plain text.
        LogFormat::Text => registry
            .with(fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())))
            .try_init(),
    };
    if let Some(o) = otlp {
        tracing::info!(target: "flotilla::otlp", url = %o.url(), "exporting spans over OTLP/HTTP");
    }
}

/// The OTLP export of `--otlp-endpoint`, started (`None` without the flag, or with an empty
/// one, as `FLOTILLA_OTLP_ENDPOINT=`: nothing runs).
fn start_otlp(
    endpoint: Option<&str>,
    cmd: &Cmd,
) -> anyhow::Result<Option<flotilla::runtime::otlp::Otlp>> {
    let Some(endpoint) = endpoint.filter(|e| !e.trim().is_empty()) else {
        return Ok(None);
    };
    let cfg = flotilla::runtime::otlp::OtlpConfig::parse(endpoint).map_err(anyhow::Error::msg)?;
    // A node's name for the resource; a configuration that does not load is `run_node`'s
    // to report.
    let node = match cmd {
        Cmd::Node(a) => node_overrides(a)
            .and_then(|o| Ok(Config::load_with(a.config.as_deref(), o)?))
            .ok()
            .map(|c| c.node.name()),
        _ => None,
    };
    flotilla::runtime::otlp::Otlp::start(&cfg, node.as_deref()).map(Some)
}

/// The node's flags as configuration overrides (dotted key paths), `--set` last.
fn node_overrides(a: &NodeArgs) -> anyhow::Result<Figment> {
    let mut o = Figment::new();
    if let Some(n) = &a.name {
        o = o.merge(Serialized::default("node.name", n));
    }
    if let Some(l) = a.listen {
        o = o.merge(Serialized::default("node.listen_addr", l.to_string()));
    }
    if !a.join.is_empty() {
        o = o.merge(Serialized::default("node.join", &a.join));
    }
    if !a.roles.is_empty() {
        o = o.merge(Serialized::default("node.roles", &a.roles));
    }
    if let Some(c) = &a.cookie {
        o = o.merge(Serialized::default("node.cookie", c));
    }
    if let Some(h) = a.http {
        o = o.merge(Serialized::default("gateway.http_addr", h.to_string()));
    }
    if let Some(r) = a.replicas {
        o = o.merge(Serialized::default("worker.replicas", r));
    }
    if let Some(m) = &a.model {
        o = o.merge(Serialized::default(
            "worker.model_path",
            m.display().to_string(),
        ));
    }
    for kv in &a.set {
        o = o.merge(flotilla::cli::up::set_override(kv)?);
    }
    Ok(o)
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn run_node(a: NodeArgs) -> anyhow::Result<std::process::ExitCode> {
    if let Some(m) = &a.model {
        // Names the path; suggests `make model` only for the default model's path.
        flotilla::model::resolve_model_path(Some(m))?;
    }
    let cfg = Config::load_with(a.config.as_deref(), node_overrides(&a)?)?;
    let node = flotilla::node::start(cfg).await?;
    let ready = node.ready_line();
    println!(
        "{}{}",
        flotilla::node::READY_PREFIX,
        serde_json::to_string(&ready)?
    );
    tracing::info!(node = %ready.node, cluster = %ready.cluster_addr, http = ?ready.http_addr, "node ready");
    match node.wait(shutdown_signal()).await {
        flotilla::node::NodeExit::Stopped => Ok(std::process::ExitCode::SUCCESS),
        flotilla::node::NodeExit::Escalated => Ok(std::process::ExitCode::from(1)),
        flotilla::node::NodeExit::Superseded(s) => {
            eprintln!(
                "flotilla: error: node name {:?} was taken by another node (cluster address {}, pid {}) while this one was away (paused or cut off past the liveness timeout); this incarnation exits. Node names must be unique (--name)",
                s.node.as_str(),
                s.by_addr,
                s.by_pid
            );
            Ok(std::process::ExitCode::from(2))
        }
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let log_format = cli.log_format;
    let otlp = match start_otlp(cli.otlp_endpoint.as_deref(), &cli.cmd) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("flotilla: error: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    let code = run(cli, log_format, otlp.as_ref()).await;
    // A node has drained and stopped (or any command ended): send the spans still queued.
    if let Some(o) = otlp {
        o.shutdown().await;
    }
    code
}

async fn run(
    cli: Cli,
    log_format: LogFormat,
    otlp: Option<&flotilla::runtime::otlp::Otlp>,
) -> std::process::ExitCode {
    init_tracing(
        match cli.cmd {
            // The simulated fleet's warnings (migrations, resyncs) carry wall-clock times that
            // mean nothing there; its report says what happened. `FLOTILLA_LOG=warn` shows them.
            Cmd::Sim(_) => "error",
            // The reconciler says what failed in its own words; kube's logs would say it again.
            #[cfg(feature = "kubernetes")]
            Cmd::Reconcile(_) => "warn,kube_client=off",
            // ractor_cluster reports every closed session as a warning — routine when nodes stop
            // or chaos cuts them; `FLOTILLA_LOG=info,ractor_cluster=warn` shows them again.
            _ => "info,ractor_cluster=error,ractor=warn",
        },
        log_format,
        otlp,
    );
    let result = match cli.cmd {
        Cmd::Up(mut a) => flotilla::cli::up::up(flotilla::cli::up::UpOptions {
            worker_roles: {
                use flotilla::runtime::role::Role;
                let (p, d) = (a.prefill.unwrap_or(0), a.decode.unwrap_or(0));
                if p + d > 0 {
                    a.nodes = 1 + p + d;
                }
                let mut roles = vec![Role::Prefill; p];
                roles.extend(vec![Role::Decode; d]);
                roles
            },
            nodes: a.nodes,
            http: a.http,
            model: a.model,
            config: a.config,
            node_args: {
                if let Some(e) = &a.engine {
                    a.set.push(format!("worker.engine={e}"));
                }
                if let Some(n) = a.workers {
                    let worker_nodes = a.nodes.saturating_sub(1).max(1);
                    a.set.push(format!(
                        "worker.replicas={}",
                        n.div_ceil(worker_nodes).max(1)
                    ));
                }
                a.set
            },
            chaos: a.chaos,
            gateways: a.gateways,
            log_format: (log_format == LogFormat::Json).then(|| "json".to_owned()),
            otlp_endpoint: cli.otlp_endpoint.clone(),
            restart: !a.no_restart,
            max_restarts: a.max_restarts,
            planner: a.planner,
        })
        .await
        .map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Node(a) => match run_node(a).await {
            // A taken cluster / transport port: `up` picked it and tries other ports.
            Err(e) if flotilla::node::is_port_taken(&e) => {
                eprintln!("flotilla: error: {e:#}");
                return std::process::ExitCode::from(flotilla::runtime::ports::PORT_TAKEN_EXIT);
            }
            r => r,
        },
        #[cfg(feature = "kubernetes")]
        Cmd::Reconcile(a) => flotilla::cli::reconcile::run(a).await,
        Cmd::Cuda(a) => tokio::task::spawn_blocking(move || flotilla::cli::cuda::run(a))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r)
            .map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Profile(a) => tokio::task::spawn_blocking(move || flotilla::cli::profile::run(a))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r)
            .map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Sim(a) => tokio::task::spawn_blocking(move || flotilla::cli::sim::run(*a))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r)
            .map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Plot(a) => flotilla::cli::plot::run(a).map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Config(a) => flotilla::cli::config::run(&a).map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Bench(a) => flotilla::cli::bench::run(a)
            .await
            .map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Transport(a) => flotilla::cli::transport::run(a)
            .await
            .map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Chaos(a) => flotilla::cli::chaos::run(a)
            .await
            .map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Generate(a) => tokio::task::spawn_blocking(move || flotilla::cli::generate::run(a))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r)
            .map(|_| std::process::ExitCode::SUCCESS),
        Cmd::Status(a) => {
            async {
                if a.watch {
                    anyhow::ensure!(
                        a.interval.is_finite() && a.interval >= 0.05,
                        "--interval must be at least 0.05 s"
                    );
                    let every = std::time::Duration::from_secs_f64(a.interval);
                    flotilla::cli::status::watch(&a.gateway, every).await?;
                    return Ok(std::process::ExitCode::SUCCESS);
                }
                let (fleet, raw) = flotilla::cli::status::fetch(&a.gateway).await?;
                let text = if a.json {
                    format!("{}\n", serde_json::to_string_pretty(&raw)?)
                } else {
                    flotilla::cli::status::render(&fleet)
                };
                flotilla::cli::print_out(&mut std::io::stdout().lock(), &text)?;
                Ok(std::process::ExitCode::SUCCESS)
            }
            .await
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("flotilla: error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
