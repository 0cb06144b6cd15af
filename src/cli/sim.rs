//! `flotilla sim`: replay a workload on a simulated fleet ([`crate::sim`]) — the live fleet's
//! admission, request, router and worker cores on a virtual clock — and report it exactly as
//! `flotilla bench` reports a live run.
//!
//! ```text
//! flotilla sim --dataset mooncake-conversation --workers 1000 --out sim-out
//! flotilla sim --dataset mooncake-conversation --max-requests 600 --speedup 20 --workers 16 \
//!     --compare router.policy=kv,round_robin
//! flotilla sim --dataset synthetic-sessions --prefill 1 --decode 2 --kill 5:1
//! ```
//!
//! **Inputs**: the workload options of `flotilla bench` (`--trace` / `--dataset`,
//! `--max-requests`, `--speedup`, `--arrival`, `--rate`, caps, `--seed`, `--salt`, SLOs,
//! `--out`); the fleet: `--workers N` aggregated workers, or `--prefill N --decode M`; any
//! configuration key with `--set section.field=value` (as `flotilla up` takes them; the engine
//! is always the sim engine, its profile `worker.sim_profile` or the built-in H100 one) or a
//! `--config` file. `--compare KEY=V1,V2,…` runs the workload once per value of any
//! configuration key, or of `workers`. The token ids of prompts are those `flotilla bench`
//! sends (the same `--salt` gives the same prompts; the default salt here is 0, not random, so
//! that runs repeat). Chat workloads (`sharegpt`) are not simulated yet: their prompts are text.
//!
//! **Faults**: `--kill AT_S:WORKER` (repeatable) kills worker `WORKER` (0-based, in the order
//! aggregated, prefill, decode) at `AT_S` seconds of simulated time; it restarts after
//! `--restart-ms` (0: it stays down). `--hang FROM_S-UNTIL_S:WORKER` holds a worker's engine
//! (its step and canary wait; past `worker.step_timeout_ms` the replica's own watchdog takes it
//! down and it restarts), `--slow FROM_S-UNTIL_S:WORKER:DELAY_MS` delays each of its steps
//! (chaos `hang` and `slow`). `--drop-kv-events FROM_S-UNTIL_S` drops every KV event
//! batch in that window (the router's index goes stale, as with the chaos `drop_kv_events`).
//!
//! **Outputs**: the bench's table (and comparison table), and with `--out DIR` its
//! `report.json`, `latency_cdf.svg` and `requests.jsonl`, plus `sim.json` (per run: counters,
//! leftovers, simulated and wall seconds) and `fleet_events.jsonl` (the fleet events the live
//! bus would carry, each with its simulated time in ms). Times are simulated: `wall_s` in the
//! report is the simulated span from the first arrival to the last completion.
//!
//! **Errors**: a malformed trace line names the line; an impossible fleet (no worker, a
//! prefill pool without a decode pool, a kill naming a worker that does not exist) or an
//! invalid configuration value is refused before the run, naming the flag or key; a request
//! that no worker can hold is reported failed (400 from the worker), never waited on.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use figment::Figment;
use figment::providers::Serialized;

use crate::cli::bench::metrics::{self, RequestResult, RunContext, Slo};
use crate::cli::bench::workload::{Prompt, Workload};
use crate::cli::bench::{
    WorkloadArgs, arrival_plan, describe_workload, load_workload, report, synth, workload,
    write_outputs,
};
use crate::node::config::Config;
use crate::sim::world::{MAX_SIM_S, sim_time};
use crate::sim::{
    Arrivals, ModelFacts, SimFault, SimFleet, SimOutcome, SimRecord, SimSpec, SimTurn, SimWorkload,
};
use crate::worker::engine::sim::SimProfile;

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
    /// Run once per value of a configuration key (`router.policy=kv,round_robin`) or of
    /// `workers` (`workers=16,64,256`).
    #[arg(long)]
    pub compare: Option<String>,
    /// The model whose facts the workers take (context, vocabulary, block-hash salt)
    /// [default: `FLOTILLA_MODEL`, else the default model].
    #[arg(long, env = "FLOTILLA_MODEL")]
    pub model: Option<PathBuf>,
    /// Delay of KV events from a worker to the router (ms).
    #[arg(long, default_value_t = 1.0)]
    pub kv_event_delay_ms: f64,
    /// Delay of token events from a worker to the gateway (ms).
    #[arg(long, default_value_t = 0.2)]
    pub net_delay_ms: f64,
    /// Kill worker WORKER at AT_S seconds of simulated time: `AT_S:WORKER` (repeatable).
    /// Workers are numbered from 0: the aggregated ones, then prefill, then decode.
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
}

/// A `flotilla bench` workload as the simulator reads it: token-id prompts under one salt.
pub struct BenchWorkload<'a> {
    pub workload: &'a Workload,
    pub salt: u64,
}

impl SimWorkload for BenchWorkload<'_> {
    fn sessions(&self) -> usize {
        self.workload.sessions.len()
    }

    fn turns(&self, i: usize) -> usize {
        self.workload.sessions.get(i).map_or(0, |s| s.turns.len())
    }

    fn turn(&self, i: usize, k: usize) -> SimTurn {
        let t = &self.workload.sessions[i].turns[k];
        let prompt = match &t.prompt {
            Prompt::Tokens(segs) => synth::token_ids(segs, self.salt),
            // Refused before the run (`check_token_prompts`).
            Prompt::Chat { .. } => Vec::new(),
        };
        SimTurn {
            prompt,
            max_tokens: t.max_tokens,
        }
    }
}

fn check_token_prompts(w: &Workload) -> anyhow::Result<()> {
    let chat = w
        .sessions
        .iter()
        .flat_map(|s| &s.turns)
        .any(|t| matches!(t.prompt, Prompt::Chat { .. }));
    ensure!(
        !chat,
        "workload {}: chat prompts (sharegpt) are not simulated yet; use a token-id workload \
         (--dataset mooncake-conversation, mooncake-synthetic, azure-conv, azure-code, \
         synthetic-sessions, or --trace)",
        w.name
    );
    Ok(())
}

/// `--kill`, `--hang`, `--slow` and `--drop-kv-events`.
///
/// # Errors
/// A malformed value, named.
pub fn parse_faults(a: &SimArgs) -> anyhow::Result<Vec<SimFault>> {
    let secs = |flag: &str, v: &str| -> anyhow::Result<Duration> {
        let s: f64 = v
            .trim()
            .parse()
            .with_context(|| format!("{flag}: {v:?} is not a number of seconds"))?;
        sim_time(s).with_context(|| {
            format!("{flag}: {v:?} must be a finite number of seconds from 0 to {MAX_SIM_S:e}")
        })
    };
    // `FROM_S-UNTIL_S`; the separator is the first '-' after the first character (so that a
    // negative FROM_S is reported as such).
    let window = |flag: &str, w: &str| -> anyhow::Result<(Duration, Duration)> {
        let (from, until) = w
            .char_indices()
            .skip(1)
            .find(|&(_, c)| c == '-')
            .map(|(i, _)| (&w[..i], &w[i + 1..]))
            .with_context(|| format!("{flag} {w}: expected FROM_S-UNTIL_S"))?;
        let (from, until) = (secs(flag, from)?, secs(flag, until)?);
        ensure!(from < until, "{flag} {w}: the window ends before it starts");
        Ok((from, until))
    };
    let index = |flag: &str, all: &str, v: &str| -> anyhow::Result<usize> {
        v.trim()
            .parse()
            .with_context(|| format!("{flag} {all}: {v:?} is not a worker index"))
    };
    let mut out = Vec::new();
    for k in &a.kill {
        let (at, worker) = k
            .split_once(':')
            .with_context(|| format!("--kill {k}: expected AT_S:WORKER, e.g. 5:0"))?;
        out.push(SimFault::Kill {
            at: secs("--kill", at)?,
            worker: index("--kill", k, worker)?,
        });
    }
    for h in &a.hang {
        let (w, worker) = h
            .split_once(':')
            .with_context(|| format!("--hang {h}: expected FROM_S-UNTIL_S:WORKER, e.g. 5-40:0"))?;
        let (from, until) = window("--hang", w)?;
        out.push(SimFault::Hang {
            from,
            until,
            worker: index("--hang", h, worker)?,
        });
    }
    for sl in &a.slow {
        let parts: Vec<&str> = sl.split(':').collect();
        let [w, worker, delay] = parts[..] else {
            bail!("--slow {sl}: expected FROM_S-UNTIL_S:WORKER:DELAY_MS, e.g. 5-20:0:50");
        };
        let (from, until) = window("--slow", w)?;
        let ms: f64 = delay
            .trim()
            .parse()
            .with_context(|| format!("--slow {sl}: {delay:?} is not a number of ms"))?;
        let delay = sim_time(ms / 1000.0)
            .with_context(|| format!("--slow {sl}: the delay must be a finite number of ms ≥ 0"))?;
        out.push(SimFault::Slow {
            from,
            until,
            worker: index("--slow", sl, worker)?,
            delay,
        });
    }
    if let Some(d) = &a.drop_kv_events {
        let (from, until) = window("--drop-kv-events", d)?;
        out.push(SimFault::DropKvEvents { from, until });
    }
    Ok(out)
}

/// One run of a `--compare` (or the only one): its label and what it changes.
#[derive(Clone, Debug, PartialEq)]
struct SimVariant {
    label: String,
    set: Option<String>,
    workers: Option<usize>,
}

fn variants(a: &SimArgs, name: &str) -> anyhow::Result<Vec<SimVariant>> {
    let Some(spec) = &a.compare else {
        return Ok(vec![SimVariant {
            label: name.to_owned(),
            set: None,
            workers: None,
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
            if key == "workers" {
                ensure!(
                    a.prefill.is_none() && a.decode.is_none(),
                    "--compare workers=…: sizes an aggregated fleet; it cannot be combined with \
                     --prefill/--decode (compare worker.… keys, or run each split)"
                );
                let n: usize = v
                    .parse()
                    .with_context(|| format!("--compare {label}: not a worker count"))?;
                Ok(SimVariant {
                    label,
                    set: None,
                    workers: Some(n),
                })
            } else {
                Ok(SimVariant {
                    set: Some(label.clone()),
                    label,
                    workers: None,
                })
            }
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
    for kv in a.set.iter().map(String::as_str).chain(extra) {
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
    ensure!(total > 0, "--workers: the fleet needs at least one worker");
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
    Ok(SimSpec {
        config,
        workers,
        prefill,
        decode,
        profile,
        model,
        kv_event_delay,
        net_delay,
        restart_delay: (a.restart_ms > 0).then(|| Duration::from_millis(a.restart_ms)),
    })
}

/// A simulated request's record as the bench's result.
pub fn to_result(r: &SimRecord, ideal: &[Vec<(u64, u64)>]) -> RequestResult {
    RequestResult {
        session: r.session,
        turn: r.turn,
        sent_s: r.sent_s,
        ideal_cached_tokens: ideal
            .get(r.session)
            .and_then(|t| t.get(r.turn))
            .map_or(0, |x| x.0),
        ok: r.ok,
        error: r.error.clone(),
        ttft_ms: r.ttft_ms,
        e2e_ms: r.e2e_ms,
        itl_ms: r.itl_ms.clone(),
        output_tokens: r.output_tokens,
        prompt_tokens: Some(r.prompt_tokens),
        cached_tokens: r.cached_tokens,
    }
}

/// Per run: what `sim.json` keeps.
#[derive(serde::Serialize)]
struct SimSummary<'a> {
    label: &'a str,
    workers: usize,
    prefill: usize,
    decode: usize,
    simulated_s: f64,
    wall_s: f64,
    simulated_s_per_wall_s: f64,
    counters: &'a crate::sim::SimCounters,
    leftovers: &'a crate::sim::SimLeftovers,
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
    ensure!(
        a.workload.dataset != Some(crate::cli::bench::Dataset::Sharegpt),
        "--dataset sharegpt: chat prompts are not simulated yet; use a token-id workload \
         (--dataset mooncake-conversation, mooncake-synthetic, azure-conv, azure-code, \
         synthetic-sessions, or --trace)"
    );
    let workload = load_workload(&a.workload)?;
    ensure!(
        workload.requests() > 0,
        "the workload {} is empty",
        workload.name
    );
    check_token_prompts(&workload)?;
    let (offsets, ideal_table) = arrival_plan(&a.workload, &workload)?;
    let ideal = workload::ideal_rate(&ideal_table);
    let info = workload.info();
    let salt = a.workload.salt.unwrap_or(0);
    eprintln!("{}", describe_workload(&workload, ideal, &a.workload, salt));
    let slo = Slo {
        ttft_ms: Some(a.workload.slo_ttft_ms),
        itl_ms: Some(a.workload.slo_itl_ms),
    };
    let arrivals = match &offsets {
        Some(o) => Arrivals::Open(o.clone()),
        None => Arrivals::Closed(a.workload.concurrency),
    };
    let input = BenchWorkload {
        workload: &workload,
        salt,
    };

    // Check every run's configuration and fleet before the first one starts.
    let variants = variants(&a, &workload.name)?;
    let mut specs = Vec::with_capacity(variants.len());
    for v in &variants {
        let config =
            load_config(&a, v.set.as_deref()).with_context(|| format!("run {}", v.label))?;
        specs.push(spec(&a, config, v.workers, &faults)?);
    }

    let mut runs = Vec::new();
    let mut samples = Vec::new();
    let mut per_request = Vec::new();
    let mut summaries = Vec::new();
    let mut events = String::new();
    for (v, spec) in variants.iter().zip(specs) {
        let (w, p, d) = (spec.workers, spec.prefill, spec.decode);
        let started = Instant::now();
        let fleet = SimFleet::new(spec, &input, arrivals.clone(), &faults)?;
        let outcome: SimOutcome = fleet.run();
        let wall = started.elapsed().as_secs_f64();
        let span = outcome.span.as_secs_f64();
        eprintln!(
            "[{}] simulated {span:.1} s in {wall:.2} s ({:.0}× real time): {} events, {} \
             steps, {} placements, {} migrations, {} shed, {} given up; left over: {}",
            v.label,
            span / wall.max(1e-9),
            outcome.counters.events,
            outcome.counters.steps,
            outcome.counters.placements,
            outcome.counters.migrations,
            outcome.counters.shed,
            outcome.counters.gave_up,
            outcome.leftovers,
        );
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
        };
        let (stats, s) = metrics::summarize(ctx, &results);
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
        })?);
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
    if let Some(dir) = &a.workload.out {
        write_outputs(dir, &runs, &samples, &per_request)?;
        let sim = dir.join("sim.json");
        std::fs::write(&sim, serde_json::to_string_pretty(&summaries)?)
            .with_context(|| format!("cannot write {}", sim.display()))?;
        let ev = dir.join("fleet_events.jsonl");
        std::fs::write(&ev, events).with_context(|| format!("cannot write {}", ev.display()))?;
        eprintln!("wrote {} and {}", sim.display(), ev.display());
    }
    if runs.iter().all(|r| r.requests == r.errors) {
        bail!("no request succeeded in any run");
    }
    Ok(())
}
