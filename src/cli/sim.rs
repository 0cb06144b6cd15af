//! `flotilla sim`: replay a workload on a simulated fleet ([`crate::sim`]) — the live fleet's
//! admission, request, router and worker cores on a virtual clock — and report it exactly as
//! `flotilla bench` reports a live run.
//!
//! ```text
//! flotilla sim --dataset mooncake-conversation --workers 1000 --out sim-out
//! flotilla sim --dataset mooncake-conversation --max-requests 600 --speedup 20 --workers 16 \
//!     --compare router.policy=kv,round_robin
//! flotilla sim --dataset synthetic-sessions --prefill 1 --decode 2 --kill 5:1
//! flotilla sim --dataset agent-sessions --sessions 64 --turns 8 --workers 16 \
//!     --compare router.policy=kv,kv+router.session_max_queued_tokens=0,round_robin
//! ```
//!
//! **Inputs**: the workload options of `flotilla bench` (`--trace` / `--dataset`,
//! `--max-requests`, `--speedup`, `--arrival`, `--rate`, caps, `--seed`, `--salt`, SLOs,
//! `--out`); the fleet: `--workers N` aggregated workers, or `--prefill N --decode M`; any
//! configuration key with `--set section.field=value` (as `flotilla up` takes them; the engine
//! is always the sim engine, its profile `worker.sim_profile` or the built-in H100 one) or a
//! `--config` file. `--compare KEY=V1,V2,…` runs the workload once per value of any
//! configuration key, or of `workers` or `routers`; a value `V+KEY2=V2+…` sets further keys in
//! that run (`--compare worker.kv_host_blocks=0,8192,8192+worker.kv_disk_blocks=32768`).
//! `--routers N` runs N routers, each request sent to one of them (drawn from its id), every
//! one applying every KV event and, with `router.share_load`, the others' load changes after
//! `--net-delay-ms` (`--compare routers=1,2,4,8,8+router.share_load=false`). The token ids of prompts are those `flotilla bench`
//! sends (the same `--salt` gives the same prompts; the default salt here is 0, not random, so
//! that runs repeat). A workload session's key (`--dataset agent-sessions`) reaches the
//! router with each of its turns as the gateway passes `x-session-id`, so sessions stick as
//! on a live fleet (`router.session_max_queued_tokens`). A chat workload (`--dataset sharegpt`) is rendered through the model's
//! chat template and tokenizer, as the gateway renders it (`--model`).
//!
//! **Faults**: `--kill AT_S:WORKER` (repeatable) kills worker `WORKER` (0-based, in the order
//! aggregated, prefill, decode) at `AT_S` seconds of simulated time; it restarts after
//! `--restart-ms` (0: it stays down). `--hang FROM_S-UNTIL_S:WORKER` holds a worker's engine
//! (its step and canary wait; past `worker.step_timeout_ms` the replica's own watchdog takes it
//! down and it restarts), `--slow FROM_S-UNTIL_S:WORKER:DELAY_MS` delays each of its steps
//! (chaos `hang` and `slow`). `--drop-kv-events FROM_S-UNTIL_S` drops every KV event
//! batch in that window (the router's index goes stale, as with the chaos `drop_kv_events`).
//! **At rates**, drawn from `--seed` over the arrivals' span ([`FaultRates`]):
//! `--kill-rate PER_WORKER_HOUR`, `--hang-rate PER_WORKER_HOUR:DURATION_S`, `--slow-rate
//! PER_WORKER_HOUR:DURATION_S:DELAY_MS`, `--drop-kv-events-rate PER_HOUR:DURATION_S`;
//! `--compare kill_rate=0,6,60` sweeps the kill rate.
//!
//! **Planner**: `--planner on` puts the planner in the loop (`planner.*` settings; the fleet
//! flags give each pool's starting size; a scale-up takes `--cold-start-ms`), `oracle` gives
//! it the workload's true coming load, `peak` runs a static fleet its capacity rule sizes for
//! the busiest interval; `--compare planner=on,oracle,peak` runs them side by side. Each run
//! adds a row to the fleet-cost table (SLO attainment, replica-seconds, mean and peak
//! replicas, changes, cost per million output tokens within the SLOs) and, with `--out`, its
//! decisions to `planner.jsonl`.
//!
//! **Outputs**: the bench's table (and comparison table), and with `--out DIR` its
//! `report.json`, the charts (`latency.svg`/`.png`, `latency_cdf.svg`/`.png`) and
//! `requests.jsonl`, plus `sim.json` (per run: counters,
//! leftovers, simulated and wall seconds) and `fleet_events.jsonl` (the fleet events the live
//! bus would carry, each with its simulated time in ms). Times are simulated: `wall_s` in the
//! report is the simulated span from the first arrival to the last completion.
//!
//! **Errors**: a malformed trace line names the line; an impossible fleet (no worker, a
//! prefill pool without a decode pool, a kill naming a worker that does not exist) or an
//! invalid configuration value is refused before the run, naming the flag or key; a request
//! that no worker can hold is reported failed (400 from the worker), never waited on.
//!
//! **Files**: this one holds the options, the `--compare` variants, each run's configuration
//! and fleet (the code that reads [`Config`]) and the driver ([`run`]); `bench_workload.rs` the
//! bench workload as the simulator reads it, `faults.rs` the fault flags, `summary.rs` what a
//! run's records become (the bench's results, `sim.json`, the fleet-cost table).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use figment::Figment;
use figment::providers::Serialized;

use crate::cli::bench::metrics::{self, RequestResult, RunContext, Slo};
use crate::cli::bench::{
    WorkloadArgs, arrival_order, arrival_plan, describe_workload, load_workload, report, workload,
    write_outputs,
};
use crate::node::config::Config;
use crate::request_plane::frontend::Frontend;
use crate::runtime::role::Role;
use crate::sim::world::{MAX_SIM_S, SimPlannerKind, SimPlannerSpec, sim_time, static_peak};
use crate::sim::{Arrivals, FaultRates, ModelFacts, SimFault, SimFleet, SimOutcome, SimSpec};
use crate::worker::engine::sim::SimProfile;

mod bench_workload;
mod faults;
mod summary;

pub use bench_workload::BenchWorkload;
pub use faults::{parse_faults, parse_rates};
pub use summary::{PlanSummary, to_result};
use summary::{SimSummary, plan_summary, plan_table};

/// Options of `flotilla sim`.
#[derive(Clone, Debug, clap::Args)]
pub struct SimArgs {
    /// The workload, its arrivals, objectives and outputs (as `flotilla bench`).
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Aggregated workers (ignored with `--prefill` and `--decode`).
    #[arg(long, default_value_t = 16)]
    pub workers: usize,
    /// Disaggregated: prefill workers (with `--decode`).
    #[arg(long, requires = "decode")]
    pub prefill: Option<usize>,
    /// Disaggregated: decode workers (with `--prefill`).
    #[arg(long, requires = "prefill")]
    pub decode: Option<usize>,
    /// Configuration file (TOML), as `flotilla up` takes it.
    #[arg(long, env = "FLOTILLA_CONFIG")]
    pub config: Option<PathBuf>,
    /// Set a configuration value, `section.field=value` (repeatable).
    #[arg(long = "set")]
    pub set: Vec<String>,
    /// Run once per value of a configuration key (`router.policy=kv,round_robin`), of
    /// `workers` (`workers=16,64,256`), `routers`, `planner` or `kill_rate`; a value
    /// `V+KEY2=V2+…` sets further configuration keys in its run
    /// (`routers=1,8,8+router.share_load=false`).
    #[arg(long)]
    pub compare: Option<String>,
    /// The model whose facts the workers take (context, vocabulary, block-hash salt)
    /// [default: `FLOTILLA_MODEL`, else the default model].
    #[arg(long, env = "FLOTILLA_MODEL")]
    pub model: Option<PathBuf>,
    /// Delay of KV events from a worker to the router (ms).
    #[arg(long, default_value_t = 1.0)]
    pub kv_event_delay_ms: f64,
    /// Delay of token events from a worker to the gateway, and of a router's load changes to
    /// the other routers (ms).
    #[arg(long, default_value_t = 0.2)]
    pub net_delay_ms: f64,
    /// Routers, each a router node of the live fleet: every one applies every KV event, and
    /// each request is sent to one of them (clients spread over gateways); with
    /// `router.share_load` (default) they count each other's placements.
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub routers: usize,
    /// Kill worker WORKER at AT_S seconds of simulated time: `AT_S:WORKER` (repeatable;
    /// `--kill 3:2` kills worker 2 at 3 s). Workers are numbered from 0: the aggregated ones,
    /// then prefill, then decode; worker `i` is `sim-i/replica-0` in the records, and the run's
    /// summary lists every fault injected.
    #[arg(long, value_name = "AT_S:WORKER")]
    pub kill: Vec<String>,
    /// Hang worker WORKER's engine from FROM_S to UNTIL_S: `FROM_S-UNTIL_S:WORKER` (repeatable;
    /// past `worker.step_timeout_ms` the watchdog takes the replica down and it restarts).
    #[arg(long, value_name = "FROM_S-UNTIL_S:WORKER")]
    pub hang: Vec<String>,
    /// Slow worker WORKER's engine by DELAY_MS before each step from FROM_S to UNTIL_S:
    /// `FROM_S-UNTIL_S:WORKER:DELAY_MS` (repeatable).
    #[arg(long, value_name = "FROM_S-UNTIL_S:WORKER:DELAY_MS")]
    pub slow: Vec<String>,
    /// A killed worker's replica restarts after this long (ms; 0: it stays down).
    #[arg(long, default_value_t = 2_000)]
    pub restart_ms: u64,
    /// Drop every KV event batch between FROM_S and UNTIL_S seconds: `FROM_S-UNTIL_S`.
    #[arg(long, value_name = "FROM_S-UNTIL_S")]
    pub drop_kv_events: Option<String>,
    /// Kill random workers at this rate, per worker-hour (6: each worker every 10 minutes
    /// on average); a Poisson process over the arrivals' span, drawn from `--seed`.
    #[arg(long, value_name = "PER_WORKER_HOUR", default_value_t = 0.0)]
    pub kill_rate: f64,
    /// Hang random workers' engines at a rate, each for DURATION_S:
    /// `PER_WORKER_HOUR:DURATION_S`.
    #[arg(long, value_name = "PER_WORKER_HOUR:DURATION_S")]
    pub hang_rate: Option<String>,
    /// Slow random workers' engines at a rate, each for DURATION_S by DELAY_MS per step:
    /// `PER_WORKER_HOUR:DURATION_S:DELAY_MS`.
    #[arg(long, value_name = "PER_WORKER_HOUR:DURATION_S:DELAY_MS")]
    pub slow_rate: Option<String>,
    /// Drop the fleet's KV events in windows at a rate, each for DURATION_S:
    /// `PER_HOUR:DURATION_S`.
    #[arg(long, value_name = "PER_HOUR:DURATION_S")]
    pub drop_kv_events_rate: Option<String>,
    /// The planner in the loop: `off` (the fleet keeps its size), `on` (as configured:
    /// `planner.*`, its mode act or advisory), `oracle` (it knows the coming load), `peak` (no
    /// planner: a static fleet the planner's capacity rule sizes for the workload's busiest
    /// interval). The fleet's flags give each pool's starting size.
    #[arg(long, value_enum, default_value_t = PlannerChoice::Off)]
    pub planner: PlannerChoice,
    /// From a planner's scale-up to the new replica taking requests (ms): process start,
    /// weight load and warm-up. 30 s is a guess for a GPU replica of an 8B model; measure
    /// yours (`flotilla up` logs each node's start).
    #[arg(long, default_value_t = 30_000)]
    pub cold_start_ms: u64,
}

/// `--planner`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PlannerChoice {
    Off,
    On,
    Oracle,
    Peak,
}

impl PlannerChoice {
    fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::On => "on",
            Self::Oracle => "oracle",
            Self::Peak => "peak",
        }
    }

    fn parse(v: &str) -> anyhow::Result<Self> {
        <Self as clap::ValueEnum>::from_str(v, true)
            .map_err(|_| anyhow::anyhow!("{v:?}: expected off, on, oracle or peak"))
    }
}

/// One run of a `--compare` (or the only one): its label and what it changes.
#[derive(Clone, Debug, Default, PartialEq)]
struct SimVariant {
    label: String,
    set: Option<String>,
    workers: Option<usize>,
    routers: Option<usize>,
    planner: Option<PlannerChoice>,
    kill_rate: Option<f64>,
}

fn variants(a: &SimArgs, name: &str) -> anyhow::Result<Vec<SimVariant>> {
    let Some(spec) = &a.compare else {
        return Ok(vec![SimVariant {
            label: name.to_owned(),
            ..SimVariant::default()
        }]);
    };
    let (key, values) = spec
        .split_once('=')
        .with_context(|| format!("--compare {spec}: expected KEY=V1,V2,…"))?;
    let key = key.trim();
    let values: Vec<&str> = values
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    ensure!(!values.is_empty(), "--compare {spec}: no values");
    values
        .iter()
        .map(|v| {
            let label = format!("{key}={v}");
            // `V+KEY2=V2+…`: one run that also sets further configuration keys.
            let mut parts = v.split('+').map(str::trim);
            let v = parts.next().unwrap_or_default();
            let mut set = Vec::new();
            for extra in parts {
                ensure!(
                    extra.contains('='),
                    "--compare {label}: `{extra}` is not KEY=VALUE (a value is VALUE+KEY=VALUE+…, \
                     e.g. routers=8+router.share_load=false)"
                );
                set.push(extra.to_owned());
            }
            let mut run = SimVariant {
                label: label.clone(),
                ..SimVariant::default()
            };
            match key {
                "workers" => {
                    ensure!(
                        a.prefill.is_none() && a.decode.is_none(),
                        "--compare workers=…: sizes an aggregated fleet; it cannot be combined \
                         with --prefill/--decode (compare worker.… keys, or run each split)"
                    );
                    run.workers = Some(
                        v.parse()
                            .with_context(|| format!("--compare {label}: not a worker count"))?,
                    );
                }
                "routers" => {
                    run.routers = Some(
                        v.parse()
                            .ok()
                            .filter(|n: &usize| *n >= 1)
                            .with_context(|| {
                                format!("--compare {label}: not a router count ≥ 1")
                            })?,
                    );
                }
                "planner" => {
                    run.planner = Some(
                        PlannerChoice::parse(v).with_context(|| format!("--compare {label}"))?,
                    );
                }
                "kill_rate" => {
                    run.kill_rate = Some(
                        v.parse()
                            .ok()
                            .filter(|r: &f64| r.is_finite() && *r >= 0.0)
                            .with_context(|| format!("--compare {label}: not a rate ≥ 0"))?,
                    );
                }
                _ => set.insert(0, format!("{key}={v}")),
            }
            run.set = (!set.is_empty()).then(|| set.join("\n"));
            Ok(run)
        })
        .collect()
}

/// The configuration of one run: `--config`, the environment, `--set`, the variant's value.
fn load_config(a: &SimArgs, extra: Option<&str>) -> anyhow::Result<Config> {
    // No cluster is formed: the cookie only satisfies validation.
    let mut o = Figment::from(Serialized::default("worker.engine", "sim"))
        .merge(Serialized::default("node.cookie", "flotilla-sim"));
    if let Some(m) = &a.model {
        o = o.merge(Serialized::default(
            "worker.model_path",
            m.display().to_string(),
        ));
    }
    for kv in a
        .set
        .iter()
        .map(String::as_str)
        .chain(extra.into_iter().flat_map(|e| e.split('\n')))
    {
        o = o.merge(crate::cli::up::set_override(kv)?);
    }
    Ok(Config::load_with(a.config.as_deref(), o)?)
}

fn model_facts(config: &Config) -> anyhow::Result<ModelFacts> {
    let path = crate::model::resolve_model_path(config.worker.model_path.as_deref())?;
    let face = crate::model::load_face(&path)?;
    Ok(ModelFacts {
        vocab_size: face.config.vocab_size,
        max_context: face.config.max_context,
        salt: face.config.block_hash_salt(),
        eos_token_id: face.tokenizer.eos_ids.first().copied(),
    })
}

/// The fleet of one run.
///
/// # Errors
/// An impossible fleet, named.
fn spec(
    a: &SimArgs,
    config: Config,
    workers: Option<usize>,
    planner: PlannerChoice,
    faults: &[SimFault],
) -> anyhow::Result<SimSpec> {
    let profile = match &config.worker.sim_profile {
        Some(p) => SimProfile::load(p)?,
        None => SimProfile::default(),
    };
    let (workers, prefill, decode) = match (a.prefill, a.decode, workers) {
        (_, _, Some(n)) => (n, 0, 0),
        (Some(p), Some(d), None) => (0, p, d),
        _ => (a.workers, 0, 0),
    };
    let total = workers + prefill + decode;
    if a.prefill.is_some() && workers == 0 {
        ensure!(
            total > 0,
            "--prefill/--decode: the fleet needs at least one worker"
        );
        ensure!(
            decode > 0,
            "--decode: a prefill pool needs a decode pool to hand its prompts to"
        );
    }
    // A planner that acts may start the first replica (a fleet at zero waits for it).
    let may_start = matches!(planner, PlannerChoice::On | PlannerChoice::Oracle);
    ensure!(
        total > 0 || may_start,
        "--workers: the fleet needs at least one worker (or a planner that starts one: \
         --planner on with planner.aggregated.min = 0)"
    );
    for f in faults {
        if let Some(worker) = f.worker() {
            let flag = match f {
                SimFault::Kill { .. } => "--kill",
                SimFault::Hang { .. } => "--hang",
                _ => "--slow",
            };
            ensure!(
                worker < total,
                "{flag} …:{worker}: the fleet has {total} workers (0 to {}: aggregated, then \
                 prefill, then decode)",
                total - 1
            );
        }
    }
    let delay = |flag: &str, ms: f64| {
        sim_time(ms / 1000.0).with_context(|| {
            format!("{flag}: {ms} must be a finite number of ms from 0 to {MAX_SIM_S:e} s")
        })
    };
    let kv_event_delay = delay("--kv-event-delay-ms", a.kv_event_delay_ms)?;
    let net_delay = delay("--net-delay-ms", a.net_delay_ms)?;
    let model = model_facts(&config)?;
    let planner = match planner {
        PlannerChoice::Off => None,
        choice => {
            let capacity = config.planner_capacity(Some(&profile))?;
            Some(SimPlannerSpec {
                kind: if choice == PlannerChoice::Oracle {
                    SimPlannerKind::Oracle
                } else {
                    SimPlannerKind::Forecast
                },
                capacity,
                cold_start: Duration::from_millis(a.cold_start_ms),
            })
        }
    };
    Ok(SimSpec {
        planner,
        config: crate::sim::SimConfig::from(&config),
        workers,
        prefill,
        decode,
        profile,
        model,
        kv_event_delay,
        net_delay,
        routers: a.routers,
        restart_delay: (a.restart_ms > 0).then(|| Duration::from_millis(a.restart_ms)),
    })
}

/// Run `flotilla sim`.
///
/// # Errors
/// Invalid options or configuration, an unreadable workload, or outputs that cannot be
/// written.
pub fn run(a: SimArgs) -> anyhow::Result<()> {
    crate::cli::bench::validate(&a.workload)?;
    if let Some(dir) = &a.workload.out {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--out {}: cannot create the folder", dir.display()))?;
    }
    let faults = parse_faults(&a)?;
    let rates = parse_rates(&a)?;
    // Every run's configuration and fleet, checked before the trace is read (reading one
    // takes seconds): an impossible fleet is refused at once.
    let mut variants = variants(&a, "")?;
    let fleets = variants
        .iter()
        .map(|v| {
            let config =
                load_config(&a, v.set.as_deref()).with_context(|| format!("run {}", v.label))?;
            spec(
                &a,
                config,
                v.workers,
                v.planner.unwrap_or(a.planner),
                &faults,
            )
        })
        .collect::<anyhow::Result<Vec<SimSpec>>>()?;
    let workload = load_workload(&a.workload)?;
    if a.compare.is_none() {
        // The only run is named after its workload.
        variants[0].label = workload.name.clone();
    }
    ensure!(
        workload.requests() > 0,
        "the workload {} is empty",
        workload.name
    );
    let (offsets, ideal_table) = arrival_plan(&a.workload, &workload)?;
    let info = workload.info();
    let salt = a.workload.salt.unwrap_or(0);
    let slo = Slo {
        ttft_ms: Some(a.workload.slo_ttft_ms),
        itl_ms: Some(a.workload.slo_itl_ms),
    };
    let arrivals = match &offsets {
        Some(o) => Arrivals::Open(o.clone()),
        None => Arrivals::Closed(a.workload.concurrency),
    };
    let frontend = if a.workload.dataset == Some(crate::cli::bench::Dataset::Sharegpt) {
        let config = load_config(&a, None)?;
        let path = crate::model::resolve_model_path(config.worker.model_path.as_deref())?;
        Some(Frontend::load(&path, usize::MAX).context("the model's chat template")?)
    } else {
        None
    };
    let mut input = BenchWorkload::new(&workload, salt, frontend.as_ref())?;
    input.classes = a.workload.classes.clone();
    if !input.classes.is_empty() {
        // Every class must be configured: a run whose requests all get a 400 says nothing.
        let config = load_config(&a, None)?;
        for c in &input.classes {
            config
                .priority
                .resolve(Some(c), None)
                .map_err(|e| anyhow::anyhow!("--classes: {e}"))?;
        }
    }
    // A chat workload's ideal hit rate from the token ids the gateway would place (the
    // bench's is estimated from the text, without the template), in arrival order.
    let ideal_table = if input.chat.is_empty() {
        ideal_table
    } else {
        let order = arrival_order(workload.sessions.len(), offsets.as_deref());
        let flat = workload::ideal_cached_tokens(
            order.iter().flat_map(|&i| input.chat[i].iter().cloned()),
        );
        workload::per_session(
            &order,
            |i| input.chat[i].len(),
            workload.sessions.len(),
            flat,
        )
    };
    let ideal = workload::ideal_rate(&ideal_table);
    eprintln!("{}", describe_workload(&workload, ideal, &a.workload, salt));

    // Check every run against the arrivals before the first one starts.
    let mut specs = Vec::with_capacity(variants.len());
    let mut run_faults = Vec::with_capacity(variants.len());
    for (v, mut s) in variants.iter().zip(fleets) {
        let choice = v.planner.unwrap_or(a.planner);
        let rates = FaultRates {
            kill: v.kill_rate.unwrap_or(rates.kill),
            ..rates
        };
        if choice != PlannerChoice::Off {
            ensure!(
                offsets.is_some(),
                "--planner {}: the planner is simulated on open-loop arrivals (a trace, \
                 or --arrival poisson or gamma); closed-loop clients hold the load fixed",
                choice.name()
            );
        }
        s.routers = v.routers.unwrap_or(a.routers);
        let mut these = faults.clone();
        if rates.any() {
            let Some(o) = &offsets else {
                bail!(
                    "fault rates are drawn over the arrivals' span: they need open-loop \
                     arrivals (a trace, or --arrival poisson/gamma)"
                );
            };
            let horizon = o.iter().copied().fold(0.0, f64::max);
            let horizon = sim_time(horizon).context("the arrivals' span")?;
            // The initial fleet (a planner's spare slots are not struck).
            let drawn = rates
                .draw(s.workers + s.prefill + s.decode, horizon, a.workload.seed)
                .with_context(|| format!("run {}", v.label))?;
            let count = |f: fn(&SimFault) -> bool| drawn.iter().filter(|x| f(x)).count();
            eprintln!(
                "[{}] faults drawn at the given rates over {:.0} s: {} kills, {} hangs, {} slow \
                 windows, {} dropped-KV-event windows (a kill that finds its worker down is a \
                 no-op)",
                v.label,
                horizon.as_secs_f64(),
                count(|x| matches!(x, SimFault::Kill { .. })),
                count(|x| matches!(x, SimFault::Hang { .. })),
                count(|x| matches!(x, SimFault::Slow { .. })),
                count(|x| matches!(x, SimFault::DropKvEvents { .. })),
            );
            these.extend(drawn);
        }
        run_faults.push(these);
        if choice == PlannerChoice::Peak
            && let (Some(p), Some(o)) = (s.planner.take(), &offsets)
        {
            for (role, n) in static_peak(&s, &p.capacity, &input, o) {
                let n = n as usize;
                match role {
                    Role::Aggregated => s.workers = n,
                    Role::Prefill => s.prefill = n,
                    Role::Decode => s.decode = n,
                }
            }
            eprintln!(
                "[{}] static fleet for the peak: {} aggregated, {} prefill, {} decode",
                v.label, s.workers, s.prefill, s.decode
            );
        }
        specs.push(s);
    }

    let mut runs = Vec::new();
    let mut samples = Vec::new();
    let mut per_request = Vec::new();
    let mut summaries = Vec::new();
    let mut events = String::new();
    let mut decisions = String::new();
    let mut plans: Vec<PlanSummary> = Vec::new();
    for ((v, spec), faults) in variants.iter().zip(specs).zip(run_faults) {
        let (w, p, d) = (spec.workers, spec.prefill, spec.decode);
        let planner_cfg = spec.config.planner.clone();
        let planned = spec.planner.is_some();
        let started = Instant::now();
        let fleet = SimFleet::new(spec, &input, arrivals.clone(), &faults)?;
        let outcome: SimOutcome = fleet.run();
        let wall = started.elapsed().as_secs_f64();
        let span = outcome.span.as_secs_f64();
        eprintln!(
            "[{}] simulated {span:.1} s in {wall:.2} s ({:.0}× real time): {} events, {} \
             steps, {} placements, {} migrations, {} shed, {} given up; left over: {}; {} \
             router index entries differ from the pools",
            v.label,
            span / wall.max(1e-9),
            outcome.counters.events,
            outcome.counters.steps,
            outcome.counters.placements,
            outcome.counters.migrations,
            outcome.counters.shed,
            outcome.counters.gave_up,
            outcome.leftovers,
            outcome.counters.index_mismatches,
        );
        if !faults.is_empty() {
            const SHOWN: usize = 8;
            let mut list: Vec<String> =
                faults.iter().take(SHOWN).map(ToString::to_string).collect();
            if faults.len() > SHOWN {
                list.push(format!("… and {} more", faults.len() - SHOWN));
            }
            eprintln!(
                "[{}] faults injected ({}): {}",
                v.label,
                faults.len(),
                list.join("; ")
            );
        }
        let t = &outcome.counters.kv_tiers;
        if t.offloads + t.offload_drops > 0 {
            eprintln!(
                "[{}] KV tiers: {} blocks offloaded to G2 ({} dropped: the offload queue or G2 \
                 full), {} demoted to G3, {} onboarded from G2 and {} from G3, {} copy \
                 failures, {} corrupt",
                v.label,
                t.offloads,
                t.offload_drops,
                t.demotions,
                t.onboards_host,
                t.onboards_disk,
                t.copy_failures,
                t.corrupt
            );
        }
        let pp = &outcome.counters.peer_pulls;
        if pp.asked + pp.declined > 0 {
            eprintln!(
                "[{}] peer pulls: {} fetch hints declined (prefill cheaper), {} holders asked, \
                 {} pulls landed ({} blocks), {} failed and recomputed, {} moot (cached here by then)",
                v.label, pp.declined, pp.asked, pp.pulled, pp.blocks, pp.failed, pp.moot
            );
        }
        let results: Vec<RequestResult> = outcome
            .records
            .iter()
            .map(|r| to_result(r, &ideal_table))
            .collect();
        let ctx = RunContext {
            label: &v.label,
            wall_s: span,
            slo,
            ideal_hit_rate: ideal,
            salt,
            workload: &info,
            // The simulated fleet's cost is its own table (per pool, planner prices).
            fleet: None,
        };
        let (stats, s) = metrics::summarize(ctx, &results);
        let plan = plan_summary(
            &v.label,
            &planner_cfg,
            &outcome,
            &results,
            slo,
            span,
            planned,
        );
        eprintln!(
            "[{}] replica-seconds {:.0} (mean {:.2} replicas, peak {}), {} planner changes, \
             cost per million tokens within SLO {}",
            v.label,
            plan.replica_seconds,
            plan.mean_replicas,
            plan.peak_replicas,
            plan.changes,
            plan.cost_per_million_in_slo
                .map_or("-".to_string(), |c| format!("{c:.3}")),
        );
        if a.workload.out.is_some() {
            for dcs in &outcome.decisions {
                let line = serde_json::json!({"run": v.label, "decision": dcs});
                decisions.push_str(&line.to_string());
                decisions.push('\n');
            }
        }
        if let Some(e) = results.iter().find_map(|r| r.error.as_deref()) {
            eprintln!("[{}] first error: {e}", v.label);
        }
        summaries.push(serde_json::to_value(SimSummary {
            label: &v.label,
            workers: w,
            prefill: p,
            decode: d,
            simulated_s: span,
            wall_s: wall,
            simulated_s_per_wall_s: span / wall.max(1e-9),
            counters: &outcome.counters,
            leftovers: &outcome.leftovers,
            planner: &plan,
        })?);
        plans.push(plan);
        if a.workload.out.is_some() {
            for (t, ev) in &outcome.fleet_events {
                let line = serde_json::json!({"run": v.label, "t_ms": t, "event": ev});
                events.push_str(&line.to_string());
                events.push('\n');
            }
        }
        runs.push(stats);
        samples.push((v.label.clone(), s));
        per_request.push((v.label.clone(), results));
    }
    println!("{}", report::markdown_table(&runs));
    if runs.len() > 1 {
        println!("{}", report::compare_table(&runs));
    }
    println!("{}", plan_table(&plans));
    if !a.workload.classes.is_empty() {
        for (label, results) in &per_request {
            let shares = metrics::class_shares(results, &a.workload.classes);
            println!("{}", metrics::class_table(label, &shares));
        }
    }
    if let Some(dir) = &a.workload.out {
        write_outputs(dir, &runs, &samples, &per_request)?;
        let sim = dir.join("sim.json");
        std::fs::write(&sim, serde_json::to_string_pretty(&summaries)?)
            .with_context(|| format!("cannot write {}", sim.display()))?;
        let ev = dir.join("fleet_events.jsonl");
        std::fs::write(&ev, events).with_context(|| format!("cannot write {}", ev.display()))?;
        eprintln!("wrote {} and {}", sim.display(), ev.display());
        if !decisions.is_empty() {
            let pj = dir.join("planner.jsonl");
            std::fs::write(&pj, decisions)
                .with_context(|| format!("cannot write {}", pj.display()))?;
            eprintln!("wrote {}", pj.display());
        }
    }
    if runs.iter().all(|r| r.requests == r.errors) {
        bail!("no request succeeded in any run");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
