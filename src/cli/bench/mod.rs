//! `flotilla bench`: replay a request trace or a dataset against a gateway and report latency
//! (TTFT, ITL, TPOT, end-to-end), throughput, goodput under SLOs and prefix-cache hit rates.
//!
//! ```text
//! flotilla bench --gateway http://127.0.0.1:8080 --dataset mooncake-conversation \
//!     --max-requests 200 --speedup 20 --compare policy=round_robin,kv --out bench-out
//! ```
//!
//! **Workloads** ([`workload`]): `--trace FILE` or one of the bundled public traces
//! (`--dataset mooncake-conversation`, `mooncake-synthetic`, `azure-conv`, `azure-code`,
//! embedded in the binary, see [`trace::BUNDLED`]; `--traces-dir` reads them from a folder
//! instead). Mooncake traces (prompts of token ids built per 512-token
//! `hash_id`, posted to `/v1/completions` as `prompt: [ids]`, so prefix sharing is exact),
//! Azure traces (lengths and arrivals only, random ids), `--dataset sharegpt` (multi-turn chat
//! sessions through `/v1/chat/completions`), `--dataset synthetic-sessions` (a shared
//! system prefix plus multi-turn user messages, token ids) and `--dataset agent-sessions`
//! (the same with a session key per agent, sent as `x-session-id`, and bursts of `--fanout`
//! sub-requests sharing the agent's history: [`workload::agent_sessions`]). Every request sets `ignore_eos`
//! with `max_tokens` = the wanted output length, so outputs have the workload's lengths.
//! A session's turns follow each other without think time; turn k's history holds the
//! dataset's *recorded* answers (synthetic ids for synthetic-sessions), not the model's, so
//! every run sends the same prompts — the server can reuse turn k−1's prompt blocks, never
//! its generated tokens. Lengths are capped by `--max-input-tokens` / `--max-output-tokens`;
//! how many prompts were cut, outputs capped and turns dropped is printed and kept in
//! `report.json` (`workload`).
//!
//! **Arrivals** ([`arrival`]): open loop (Poisson, Gamma, trace timestamps ÷ `--speedup`) or
//! closed loop (`--arrival fixed --concurrency C`). The same seeded arrival times are used for
//! every run of a `--compare`.
//!
//! **Metrics**: definitions in [`metrics`]; ideal hit rates in [`workload`]. `--out DIR` also
//! keeps every request's result (`requests.jsonl`) for splits the tables do not make, and
//! draws the latencies as SVG and PNG charts ([`charts`], [`write_outputs`]).
//!
//! **Progress**: a bar on stderr with live TTFT and output tokens/s while a run goes, on a
//! terminal only ([`driver`]).
//!
//! **Any gateway**: `--model NAME` skips the `/v1/models` lookup, and a gateway without
//! Flotilla's `/v1/fleet` is not waited on; `--fresh-connections` opens a connection per
//! request (`scripts/bench-routing.sh` drives NVIDIA Dynamo's frontend this way).
//!
//! **Several gateways**: `--gateway URL1,URL2,…` spreads the clients: session `i` goes to
//! gateway `i mod N` (every turn of a session to the same one, as a client keeps its
//! gateway). The model lookup and the fleet views (`/v1/fleet`: idleness, replica-seconds)
//! use the first. `scripts/bench-routers.sh` runs 1 → 8 Flotilla routers and SGLang's router
//! as N independent replicas this way.
//!
//! **`--compare KEY=V1,V2,…`** runs the same workload once per value, in order, labelled
//! `KEY=V`. Only `policy` can be changed per request: each request of the run carries the
//! header `x-flotilla-route-policy: V`, which the router honours; any other key is an error
//! (other router settings need a restart of the fleet). Before each run the bench waits until
//! `GET /v1/fleet` shows no request in flight on any worker.
//!
//! **Prefix salt**: caches stay warm between runs (and between invocations), so run `i` gets
//! its own salt `combine(--salt, i)` (`--salt` defaults to a random value, printed): token ids
//! are drawn from (salt, segment seed), and chat prompts get a system message
//! `Run <salt hex>.` first. Within a run the sharing structure is the workload's; across runs
//! nothing is shared, so run 2 does not profit from run 1's cache. Pass the same `--salt` to
//! replay exactly the same prompts.

pub mod arrival;
pub mod charts;
pub mod driver;
pub mod metrics;
pub mod report;
pub mod sharegpt;
pub mod synth;
pub mod text;
pub mod trace;
pub mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use rand::SeedableRng;
use rand::rngs::StdRng;

use arrival::ArrivalKind;
use driver::{RunPlan, Target};
use metrics::{RunContext, RunStats, Samples, Slo};
use workload::{Caps, SyntheticSpec, Workload};

pub use crate::actors::router::POLICY_HEADER;
pub use crate::cli::status::base_url;

/// Named workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Dataset {
    /// ShareGPT V3 conversations as multi-turn chat sessions (file: `--dataset-path`).
    Sharegpt,
    /// `--sessions` sessions sharing a `--system-prompt-tokens` prefix, `--turns` turns each.
    SyntheticSessions,
    /// Agent sessions with session keys (`x-session-id`): `--sessions` agents of `--turns`
    /// turns (each turn's prompt = the agent's whole history + a new message), and after every
    /// `--fanout-every`-th turn a burst of `--fanout` sub-requests sharing that history, sent
    /// at once under the agent's key (`workload::agent_sessions`).
    AgentSessions,
    /// Mooncake FAST'25 conversation trace (bundled; `mooncake_conversation_trace.jsonl`).
    MooncakeConversation,
    /// Mooncake FAST'25 synthetic trace (bundled; `mooncake_synthetic_trace.jsonl`).
    MooncakeSynthetic,
    /// Azure LLM inference trace 2023, conversation (bundled; `azure_llm_2023_conv.csv`).
    AzureConv,
    /// Azure LLM inference trace 2023, code (bundled; `azure_llm_2023_code.csv`).
    AzureCode,
}

impl Dataset {
    /// The trace file of a trace dataset.
    fn trace_file(self) -> Option<&'static str> {
        match self {
            Dataset::MooncakeConversation => Some("mooncake_conversation_trace.jsonl"),
            Dataset::MooncakeSynthetic => Some("mooncake_synthetic_trace.jsonl"),
            Dataset::AzureConv => Some("azure_llm_2023_conv.csv"),
            Dataset::AzureCode => Some("azure_llm_2023_code.csv"),
            Dataset::Sharegpt | Dataset::SyntheticSessions | Dataset::AgentSessions => None,
        }
    }
}

/// Options of `flotilla bench`: where to send the workload, and the workload.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// Gateway base URL (or `host:port`); several, comma-separated, spread the sessions over
    /// them (session `i` to gateway `i mod N`).
    #[arg(
        long,
        env = "FLOTILLA_GATEWAY",
        default_value = crate::cli::DEFAULT_GATEWAY,
        value_parser = crate::cli::gateway_arg
    )]
    pub gateway: String,
    /// Run the workload once per value: `policy=round_robin,kv` (only `policy`).
    #[arg(long)]
    pub compare: Option<String>,
    /// `model` of the requests [default: the first of `GET /v1/models`].
    #[arg(long)]
    pub model: Option<String>,
    /// Send trace prompts as text (one single-token word of the model's vocabulary per token
    /// id: `text.rs`) instead of token ids, for gateways that take only text on
    /// `/v1/completions` (SGLang's and vLLM's routers).
    #[arg(long)]
    pub text_prompts: bool,
    /// The model whose tokenizer `--text-prompts` uses [default: `FLOTILLA_MODEL`, else the
    /// embedded default model's file].
    #[arg(long)]
    pub tokenizer_model: Option<std::path::PathBuf>,
    /// Longest wait for one request, stream included (s).
    #[arg(long, default_value_t = 600)]
    pub request_timeout_s: u64,
    /// Longest wait for the fleet to go idle before a run (s).
    #[arg(long, default_value_t = 300)]
    pub idle_timeout_s: u64,
    /// Open a new connection for every request (no keep-alive), e.g. for a server whose
    /// listener lacks TCP_NODELAY, where a reused connection can stall on a delayed ACK.
    #[arg(long)]
    pub fresh_connections: bool,
    /// Price of one worker replica-hour ($), for the cost per million output tokens served
    /// within the SLOs (1: the planner's default `planner.<pool>.dollars_per_hour`). The
    /// replicas are counted from `/v1/fleet` every second of the run.
    #[arg(long, default_value_t = 1.0)]
    pub dollars_per_replica_hour: f64,
    /// The workload, its arrivals, objectives and outputs (shared with `flotilla sim`).
    #[command(flatten)]
    pub workload: WorkloadArgs,
}

/// The workload options `flotilla bench` and `flotilla sim` share: what is sent, when, the
/// objectives it is judged by, and where the report goes.
#[derive(Clone, Debug, clap::Args)]
pub struct WorkloadArgs {
    /// Trace file: Mooncake `.jsonl` or Azure `.csv`, plain or `.gz`. Give either `--trace`
    /// or `--dataset`.
    #[arg(long, conflicts_with = "dataset", required_unless_present = "dataset")]
    pub trace: Option<PathBuf>,
    /// Named workload, the alternative to `--trace`; the four trace datasets are bundled
    /// with flotilla.
    #[arg(long, value_enum, conflicts_with = "trace")]
    pub dataset: Option<Dataset>,
    /// Read the trace datasets from this folder (`<name>` or `<name>.gz`, names as listed
    /// under `--dataset`) instead of the bundled copies.
    #[arg(long)]
    pub traces_dir: Option<PathBuf>,
    /// ShareGPT JSON file (default: `$FLOTILLA_SHAREGPT`, else
    /// `~/.cache/flotilla/ShareGPT_V3_unfiltered_cleaned_split.json`, see
    /// `scripts/fetch-sharegpt.sh`).
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Send at most this many requests (the first of the trace; whole sessions in order, the
    /// last one cut).
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Skip a malformed trace line (counted: `skipped_lines` in `report.json`, the first few
    /// printed) instead of stopping on it.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// How sessions arrive [default: `trace` when the workload has timestamps, else `poisson`].
    #[arg(long, value_enum)]
    pub arrival: Option<ArrivalKind>,
    /// Trace timestamps are divided by this (2 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Uniform jitter added to each trace timestamp before `--speedup` (ms), to spread the
    /// trace's ~3 s buckets.
    #[arg(long, default_value_t = 0.0)]
    pub trace_jitter_ms: f64,
    /// Mean arrival rate of `poisson` and `gamma` (sessions per second).
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    /// Gamma shape k of `gamma` (k < 1 burstier than Poisson, 1 = Poisson).
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Sessions at once with `--arrival fixed` (closed loop).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Write `report.json`, `requests.jsonl` (one line per request and run: session, turn,
    /// send time, TTFT, ITL, E2E, tokens, cached and ideal cached tokens) and the charts
    /// (`latency.svg`/`.png`: TTFT and ITL over time and their CDFs; `latency_cdf.svg`/`.png`:
    /// TTFT and end-to-end CDFs) into this folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// TTFT objective (ms).
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// Inter-token objective on each request's TPOT (ms).
    #[arg(long, default_value_t = 200.0)]
    pub slo_itl_ms: f64,
    /// Largest `max_tokens` (outputs longer in the workload are capped).
    #[arg(long, default_value_t = 256)]
    pub max_output_tokens: u32,
    /// Longest prompt (tokens; longer prompts are cut, or session turns dropped).
    #[arg(long, default_value_t = 4096)]
    pub max_input_tokens: u32,
    /// Seed of the arrival times and trace jitter.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Prefix salt of the first run [default: bench: random, printed; sim: 0].
    #[arg(long)]
    pub salt: Option<u64>,
    /// synthetic-sessions: sessions.
    #[arg(long, default_value_t = 32)]
    pub sessions: usize,
    /// synthetic-sessions: turns per session.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// synthetic-sessions: tokens of the system prefix every session shares.
    #[arg(long, default_value_t = 1024)]
    pub system_prompt_tokens: u32,
    /// synthetic-sessions: tokens of each user message.
    #[arg(long, default_value_t = 128)]
    pub user_tokens: u32,
    /// synthetic-sessions: tokens of each answer.
    #[arg(long, default_value_t = 128)]
    pub session_output_tokens: u32,
    /// Priority classes (`priority.classes` of the fleet), comma-separated: session `i` is of
    /// class `classes[h(i) mod N]` (`metrics::class_of`: mixed in arrival order; sent as
    /// `x-priority-class`); the report adds each class's share of
    /// the first tokens served while every class still had requests to serve
    /// ([`metrics::class_shares`]).
    #[arg(long, value_delimiter = ',')]
    pub classes: Vec<String>,
    /// agent-sessions: sub-requests in each burst (0: none).
    #[arg(long, default_value_t = 4)]
    pub fanout: usize,
    /// agent-sessions: a burst after every this many turns of an agent (≥ 1).
    #[arg(long, default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub fanout_every: usize,
    /// agent-sessions: agent `a` starts at `a ×` this (ms of trace time, ÷ `--speedup`).
    #[arg(long, default_value_t = 1000.0)]
    pub agent_gap_ms: f64,
    /// agent-sessions: the burst after turn `k` is sent `(k + 1) ×` this after its agent
    /// starts (ms of trace time, ÷ `--speedup`): about one turn's duration.
    #[arg(long, default_value_t = 2000.0)]
    pub turn_gap_ms: f64,
}

/// What one run of a `--compare` changes: its label and its extra headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Variant {
    /// `policy=round_robin`, or the workload's name without `--compare`.
    pub label: String,
    /// Headers added to every request of the run.
    pub headers: Vec<(String, String)>,
}

/// Parse `--compare KEY=V1,V2,…` into one variant per value (labels `KEY=V`). Only `policy`
/// can be set per request (header [`POLICY_HEADER`]).
///
/// # Errors
/// `spec` is not `policy=V1,V2,…` with known policies.
pub fn parse_compare(spec: &str) -> anyhow::Result<Vec<Variant>> {
    let (key, values) = spec
        .split_once('=')
        .with_context(|| format!("--compare {spec}: expected KEY=V1,V2,…"))?;
    let key = key.trim();
    if key != "policy" {
        bail!(
            "--compare {key}=…: only `policy` can be changed per request (header \
             {POLICY_HEADER}); other router settings need the fleet restarted with \
             `--set router.{key}=…` between benches"
        );
    }
    let values: Vec<&str> = values
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    ensure!(!values.is_empty(), "--compare {spec}: no values");
    for v in &values {
        v.parse::<crate::request_plane::router::policy::Policy>()
            .map_err(|_| {
                anyhow::anyhow!(
                    "--compare policy={v}: expected kv, dynamo_kv, least_loaded, round_robin \
                     or random"
                )
            })?;
    }
    Ok(values
        .iter()
        .map(|v| Variant {
            label: format!("{key}={v}"),
            headers: vec![(POLICY_HEADER.to_owned(), (*v).to_owned())],
        })
        .collect())
}

/// Check the numeric options.
pub fn validate(a: &WorkloadArgs) -> anyhow::Result<()> {
    ensure!(
        a.speedup > 0.0 && a.speedup.is_finite(),
        "--speedup must be > 0"
    );
    ensure!(a.rate > 0.0 && a.rate.is_finite(), "--rate must be > 0");
    ensure!(
        a.burstiness > 0.0 && a.burstiness.is_finite(),
        "--burstiness must be > 0"
    );
    ensure!(a.trace_jitter_ms >= 0.0, "--trace-jitter-ms must be ≥ 0");
    ensure!(a.concurrency >= 1, "--concurrency must be ≥ 1");
    ensure!(a.max_input_tokens >= 1, "--max-input-tokens must be ≥ 1");
    ensure!(a.max_output_tokens >= 1, "--max-output-tokens must be ≥ 1");
    ensure!(a.max_requests != Some(0), "--max-requests must be ≥ 1");
    Ok(())
}

/// The trace dataset file `file`: from `dir` when given (`dir/file`, else `dir/file.gz`), else
/// the bundled copy.
fn load_dataset_trace(
    file: &str,
    dir: Option<&Path>,
    bad: &mut trace::BadLines,
) -> anyhow::Result<(trace::TraceFormat, Vec<trace::TraceRecord>)> {
    let Some(dir) = dir else {
        return trace::load_bundled(file);
    };
    let plain = dir.join(file);
    let gz = dir.join(format!("{file}.gz"));
    match [&plain, &gz].into_iter().find(|p| p.exists()) {
        Some(p) => trace::load(p, bad),
        None => bail!(
            "--traces-dir: neither {} nor {} exists (leave out --traces-dir to use the bundled \
             trace)",
            plain.display(),
            gz.display()
        ),
    }
}

/// Load the workload the options name.
///
/// # Errors
/// The dataset or trace cannot be read or parsed.
pub fn load_workload(a: &WorkloadArgs) -> anyhow::Result<Workload> {
    let caps = Caps {
        max_input: a.max_input_tokens,
        max_output: a.max_output_tokens,
    };
    let limit = a.max_requests.unwrap_or(usize::MAX);
    let mut bad = trace::BadLines {
        skip: a.skip_bad_lines,
        skipped: Vec::new(),
    };
    let loaded = match (&a.trace, a.dataset) {
        (Some(p), _) => Some((trace::trace_name(p), trace::load(p, &mut bad)?)),
        (None, Some(d)) => match d.trace_file() {
            Some(f) => Some((
                trace::trace_name(Path::new(f)),
                load_dataset_trace(f, a.traces_dir.as_deref(), &mut bad)?,
            )),
            None => None,
        },
        (None, None) => bail!("give --trace FILE or --dataset NAME"),
    };
    if let Some((name, (format, records))) = loaded {
        if let Some(line) = bad.summary() {
            eprintln!("{line}");
        }
        let mut w = workload::from_trace(&name, format, &records, caps, limit);
        w.adjustments.skipped_lines = bad.skipped.len();
        return Ok(w);
    }
    match a.dataset {
        Some(Dataset::Sharegpt) => {
            let path = a
                .dataset_path
                .clone()
                .unwrap_or_else(sharegpt::default_path);
            let convs = sharegpt::load(&path, limit)?;
            ensure!(
                !convs.is_empty(),
                "no conversation in {}: expected a JSON array of {{\"id\": \"…\", \
                 \"conversations\": [{{\"from\": \"human\", \"value\": \"…\"}}, …]}} objects \
                 (records that do not parse are left out)",
                path.display()
            );
            Ok(workload::from_sharegpt(&convs, caps, limit))
        }
        Some(Dataset::AgentSessions) => {
            ensure!(
                a.agent_gap_ms.is_finite()
                    && a.agent_gap_ms >= 0.0
                    && a.turn_gap_ms.is_finite()
                    && a.turn_gap_ms >= 0.0,
                "--agent-gap-ms and --turn-gap-ms must be finite and >= 0"
            );
            let spec = workload::AgentSpec {
                base: SyntheticSpec {
                    sessions: a.sessions,
                    turns: a.turns,
                    system_tokens: a.system_prompt_tokens,
                    user_tokens: a.user_tokens,
                    output_tokens: a.session_output_tokens,
                },
                fanout: a.fanout,
                fanout_every: a.fanout_every.max(1),
                agent_gap_ms: a.agent_gap_ms,
                turn_gap_ms: a.turn_gap_ms,
            };
            Ok(workload::agent_sessions(spec, caps, limit))
        }
        _ => {
            let spec = SyntheticSpec {
                sessions: a.sessions,
                turns: a.turns,
                system_tokens: a.system_prompt_tokens,
                user_tokens: a.user_tokens,
                output_tokens: a.session_output_tokens,
            };
            Ok(workload::synthetic_sessions(spec, caps, limit))
        }
    }
}

/// Session start offsets (s) for `kind`, or `None` for the closed loop.
///
/// # Errors
/// `--arrival trace` with a workload that has no timestamps.
pub fn arrival_offsets(
    a: &WorkloadArgs,
    kind: ArrivalKind,
    w: &Workload,
) -> anyhow::Result<Option<Vec<f64>>> {
    let mut rng = StdRng::seed_from_u64(a.seed);
    let n = w.sessions.len();
    Ok(match kind {
        ArrivalKind::Fixed => None,
        ArrivalKind::Poisson => Some(arrival::poisson(n, a.rate, &mut rng)),
        ArrivalKind::Gamma => Some(arrival::gamma(n, a.rate, a.burstiness, &mut rng)),
        ArrivalKind::Trace => {
            ensure!(
                w.has_timestamps(),
                "--arrival trace needs a trace with timestamps; {} has none (use poisson, \
                 gamma or fixed)",
                w.name
            );
            let ts: Vec<f64> = w.sessions.iter().filter_map(|s| s.timestamp_ms).collect();
            Some(arrival::trace(&ts, a.speedup, a.trace_jitter_ms, &mut rng))
        }
    })
}

/// Per session, per turn: `(ideal cached tokens, prompt tokens)` ([`Workload::ideal_cached_in`]).
pub type IdealTable = Vec<Vec<(u64, u64)>>;

/// When the sessions of `w` are sent (`--arrival`, by default the trace's timestamps when it
/// has them, else Poisson; `None`: the closed loop) and, per session and turn, the prompt
/// tokens an infinite cache would hold in that order (open loop: by offset; closed loop: in
/// order): what `bench` and `sim` both start from.
///
/// # Errors
/// As [`arrival_offsets`].
pub fn arrival_plan(
    a: &WorkloadArgs,
    w: &Workload,
) -> anyhow::Result<(Option<Vec<f64>>, IdealTable)> {
    let kind = a.arrival.unwrap_or(if w.has_timestamps() {
        ArrivalKind::Trace
    } else {
        ArrivalKind::Poisson
    });
    let offsets = arrival_offsets(a, kind, w)?;
    let order = arrival_order(w.sessions.len(), offsets.as_deref());
    Ok((offsets, w.ideal_cached_in(&order)))
}

/// The order `sessions` sessions start in: by their `offsets` (those without one are not
/// sent), or as listed (closed loop).
pub fn arrival_order(sessions: usize, offsets: Option<&[f64]>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sessions).collect();
    if let Some(o) = offsets {
        order.retain(|&i| i < o.len());
        order.sort_by(|&x, &y| o[x].total_cmp(&o[y]));
    }
    order
}

/// Lines about the workload for stderr: size, what the caps changed, hit-rate ceilings.
pub fn describe_workload(w: &Workload, ideal: f64, a: &WorkloadArgs, salt: u64) -> String {
    let adj = &w.adjustments;
    let mut s = format!(
        "workload {}: {} sessions, {} requests; {} prompts cut to {} tokens, {} outputs capped \
         at {} tokens, {} session turns dropped; ideal prefix hit rate {:.1} % (infinite \
         cache, {}-token blocks)",
        w.name,
        w.sessions.len(),
        w.requests(),
        adj.truncated_inputs,
        a.max_input_tokens,
        adj.capped_outputs,
        a.max_output_tokens,
        adj.dropped_turns,
        100.0 * ideal,
        workload::SERVER_BLOCK,
    );
    if adj.skipped_lines > 0 {
        s.push_str(&format!(
            "; {} malformed trace lines skipped",
            adj.skipped_lines
        ));
    }
    if let Some(r) = w.trace_block_hit_rate {
        s.push_str(&format!(
            "; trace definition (512-token hash_id blocks seen before, uncapped): {:.1} %",
            100.0 * r
        ));
    }
    s.push_str(&format!(
        "\nprefix salt {salt} (pass --salt {salt} to replay these prompts)"
    ));
    s
}

/// Write `report.json`, `requests.jsonl` and the charts into `dir`: `latency.svg` /
/// `latency.png` (TTFT and ITL over time and their CDFs) and `latency_cdf.svg` /
/// `latency_cdf.png` (the CDFs of TTFT and end-to-end latency), one series per run
/// ([`charts`]).
///
/// # Errors
/// `dir` cannot be created, or a file cannot be drawn or written.
pub fn write_outputs(
    dir: &Path,
    runs: &[RunStats],
    samples: &[(String, Samples)],
    per_request: &[(String, Vec<metrics::RequestResult>)],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let json = dir.join("report.json");
    std::fs::write(&json, report::report_json(runs)?)
        .with_context(|| format!("cannot write {}", json.display()))?;
    let jsonl = dir.join("requests.jsonl");
    std::fs::write(&jsonl, report::requests_jsonl(per_request)?)
        .with_context(|| format!("cannot write {}", jsonl.display()))?;
    let [latency, _] = charts::write_figure(dir, "latency", &charts::latency_panels(per_request))?;
    let cdf_runs: Vec<(&str, &[f64], &[f64])> = samples
        .iter()
        .map(|(l, s)| (l.as_str(), s.ttft_ms.as_slice(), s.e2e_ms.as_slice()))
        .collect();
    let [cdf, _] = charts::write_figure(dir, "latency_cdf", &charts::cdf_panels(&cdf_runs))?;
    eprintln!(
        "wrote {}, {}, {} and {} (each also as .png)",
        json.display(),
        jsonl.display(),
        latency.display(),
        cdf.display()
    );
    Ok(())
}

/// Run `flotilla bench`: load the workload, send it once per `--compare` value (once without),
/// print the table(s) and write the outputs.
///
/// # Errors
/// Invalid options, `--out` not writable, the workload cannot be loaded, the
/// gateway cannot be reached, or the outputs cannot be written.
pub async fn run(a: BenchArgs) -> anyhow::Result<()> {
    validate(&a.workload)?;
    if let Some(dir) = &a.workload.out {
        // Fail before the run, not after it.
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--out {}: cannot create the folder", dir.display()))?;
        let probe = dir.join(".flotilla-bench-write-test");
        std::fs::write(&probe, b"")
            .with_context(|| format!("--out {}: not writable", dir.display()))?;
        let _ = std::fs::remove_file(probe);
    }
    let variants = match &a.compare {
        Some(spec) => parse_compare(spec)?,
        None => Vec::new(),
    };
    let bases: Vec<String> = a
        .gateway
        .split(',')
        .map(str::trim)
        .filter(|g| !g.is_empty())
        .map(base_url)
        .collect();
    ensure!(!bases.is_empty(), "--gateway: no gateway given");
    let base = bases[0].clone();
    let workload = Arc::new(load_workload(&a.workload)?);
    ensure!(
        workload.requests() > 0,
        "the workload {} is empty",
        workload.name
    );
    let variants = if variants.is_empty() {
        vec![Variant {
            label: workload.name.clone(),
            headers: Vec::new(),
        }]
    } else {
        variants
    };
    let (offsets, ideal_table) = arrival_plan(&a.workload, &workload)?;
    let ideal_table = Arc::new(ideal_table);
    let ideal = workload::ideal_rate(&ideal_table);
    let info = workload.info();
    let base_salt = a.workload.salt.unwrap_or_else(rand::random);
    eprintln!(
        "{}",
        describe_workload(&workload, ideal, &a.workload, base_salt)
    );

    let mut client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true);
    if a.fresh_connections {
        client = client.pool_max_idle_per_host(0);
    }
    let client = client.build()?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => driver::first_model(&client, &base).await?,
    };
    let text = if a.text_prompts {
        let path = crate::model::resolve_model_path(a.tokenizer_model.as_deref())?;
        Some(Arc::new(text::TextPrompts::from_model(&path)?))
    } else {
        None
    };
    let target = Arc::new(Target {
        client: client.clone(),
        bases,
        model,
        request_timeout: Duration::from_secs(a.request_timeout_s),
        text,
    });
    let slo = Slo {
        ttft_ms: Some(a.workload.slo_ttft_ms),
        itl_ms: Some(a.workload.slo_itl_ms),
    };

    let mut runs = Vec::with_capacity(variants.len());
    let mut samples = Vec::with_capacity(variants.len());
    let mut per_request = Vec::with_capacity(variants.len());
    for (i, v) in variants.into_iter().enumerate() {
        driver::wait_idle(&client, &base, Duration::from_secs(a.idle_timeout_s)).await;
        let salt = synth::combine(base_salt, i as u64);
        let plan = RunPlan {
            label: v.label.clone(),
            offsets: offsets.clone(),
            concurrency: a.workload.concurrency,
            salt,
            headers: v.headers,
            classes: a.workload.classes.clone(),
        };
        let meter = driver::FleetMeter::start(client.clone(), base.clone());
        let (results, wall_s) = driver::execute(
            Arc::clone(&target),
            Arc::clone(&workload),
            plan,
            Arc::clone(&ideal_table),
        )
        .await;
        let replica_seconds = meter.stop().await;
        let ctx = RunContext {
            label: &v.label,
            wall_s,
            slo,
            ideal_hit_rate: ideal,
            salt,
            workload: &info,
            fleet: replica_seconds.map(|rs| metrics::FleetUse {
                replica_seconds: rs,
                dollars: rs / 3600.0 * a.dollars_per_replica_hour,
            }),
        };
        let (stats, s) = metrics::summarize(ctx, &results);
        report_first_error(&v.label, &results);
        runs.push(stats);
        samples.push((v.label.clone(), s));
        per_request.push((v.label, results));
    }

    println!("{}", report::markdown_table(&runs));
    if runs.len() > 1 {
        println!("{}", report::compare_table(&runs));
    }
    print!("{}", report::cost_lines(&runs, a.dollars_per_replica_hour));
    if !a.workload.classes.is_empty() {
        for (label, results) in &per_request {
            let shares = metrics::class_shares(results, &a.workload.classes);
            println!("{}", metrics::class_table(label, &shares));
        }
    }
    if let Some(dir) = &a.workload.out {
        write_outputs(dir, &runs, &samples, &per_request)?;
    }
    let failed: Vec<&str> = per_request
        .iter()
        .filter(|(_, results)| every_request_failed(results))
        .map(|(label, _)| label.as_str())
        .collect();
    ensure!(
        failed.is_empty(),
        "every request failed in {} (the first error is above): nothing was measured",
        failed.join(", ")
    );
    Ok(())
}

/// A run none of whose requests succeeded: its figures measure nothing, and `bench` fails.
fn every_request_failed(results: &[metrics::RequestResult]) -> bool {
    !results.is_empty() && results.iter().all(|r| !r.ok)
}

/// Print the first error of a run, if any, so a misconfiguration shows at once.
fn report_first_error(label: &str, results: &[metrics::RequestResult]) {
    if let Some(e) = results.iter().find_map(|r| r.error.as_deref()) {
        eprintln!("[{label}] first error: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<WorkloadArgs, clap::Error> {
        let mut v = vec!["bench"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v).map(|c| c.bench.workload)
    }

    #[test]
    fn a_run_whose_every_request_failed_fails_the_bench() {
        let ok = metrics::RequestResult {
            ok: true,
            ..Default::default()
        };
        let failed = metrics::RequestResult {
            error: Some("connection refused".into()),
            ..Default::default()
        };
        assert!(every_request_failed(&[failed.clone(), failed.clone()]));
        assert!(!every_request_failed(&[failed, ok]));
        assert!(
            !every_request_failed(&[]),
            "an empty run is refused before it starts"
        );
    }

    #[test]
    fn compare_spec() {
        let v = parse_compare("policy=round_robin, kv").unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].label, "policy=kv");
        assert_eq!(
            v[0].headers,
            vec![(POLICY_HEADER.to_owned(), "round_robin".to_owned())]
        );
        let err = parse_compare("block_size=16,32").unwrap_err().to_string();
        assert!(err.contains("only `policy`"), "{err}");
        assert!(parse_compare("policy").is_err());
        assert!(parse_compare("policy=").is_err());
    }

    #[test]
    fn flags() {
        let a = parse(&[
            "--dataset",
            "synthetic-sessions",
            "--arrival",
            "gamma",
            "--burstiness",
            "0.5",
        ])
        .unwrap();
        assert_eq!(a.dataset, Some(Dataset::SyntheticSessions));
        assert_eq!(a.arrival, Some(ArrivalKind::Gamma));
        assert_eq!((a.max_input_tokens, a.max_output_tokens), (4096, 256));
        assert!(parse(&[]).is_err(), "a workload is required");
        assert!(parse(&["--trace", "x.jsonl", "--dataset", "sharegpt"]).is_err());
        assert_eq!(base_url("127.0.0.1:8080/"), "http://127.0.0.1:8080");
    }

    #[test]
    fn synthetic_workload_and_arrivals() {
        let a = parse(&[
            "--dataset",
            "synthetic-sessions",
            "--sessions",
            "5",
            "--turns",
            "2",
            "--max-requests",
            "7",
        ])
        .unwrap();
        let w = load_workload(&a).unwrap();
        assert_eq!(w.requests(), 7);
        assert_eq!(w.sessions.len(), 4);
        let off = arrival_offsets(&a, ArrivalKind::Poisson, &w)
            .unwrap()
            .unwrap();
        assert_eq!(off.len(), 4);
        assert_eq!(arrival_offsets(&a, ArrivalKind::Fixed, &w).unwrap(), None);
        assert!(
            arrival_offsets(&a, ArrivalKind::Trace, &w).is_err(),
            "no timestamps"
        );
    }

    #[test]
    fn trace_workload_from_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 2]}\n\
             {\"timestamp\": 3000, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 3]}\n",
        )
        .unwrap();
        let a = parse(&["--trace", p.to_str().unwrap(), "--speedup", "3"]).unwrap();
        let w = load_workload(&a).unwrap();
        assert_eq!(w.name, "t");
        assert_eq!(w.trace_block_hit_rate, Some(0.25));
        let off = arrival_offsets(&a, ArrivalKind::Trace, &w)
            .unwrap()
            .unwrap();
        assert_eq!(off, vec![0.0, 1.0]);
        // The second prompt re-uses block 1 (512 tokens = 32 server blocks) of the first.
        assert!((w.ideal_hit_rate() - 512.0 / 1200.0).abs() < 1e-12);
        let mut bad = a.clone();
        bad.speedup = 0.0;
        assert!(validate(&bad).is_err());
    }

    /// `--dataset azure-code` works with nothing on disk (the bundled trace), and from a
    /// `--traces-dir` holding the `.gz` file; a folder without it gives an error naming both
    /// paths tried.
    #[test]
    fn dataset_traces_bundled_or_from_a_folder() {
        let a = parse(&["--dataset", "azure-code", "--max-requests", "5"]).unwrap();
        let w = load_workload(&a).unwrap();
        assert_eq!(w.name, "azure_llm_2023_code");
        assert_eq!(w.requests(), 5);

        let dir = tempfile::tempdir().unwrap();
        let gz = trace::BUNDLED
            .iter()
            .find(|(n, _)| *n == "azure_llm_2023_code.csv")
            .unwrap()
            .1;
        std::fs::write(dir.path().join("azure_llm_2023_code.csv.gz"), gz).unwrap();
        let d = dir.path().to_str().unwrap();
        let from_dir = parse(&["--dataset", "azure-code", "--traces-dir", d]).unwrap();
        let w2 = load_workload(&from_dir).unwrap();
        assert_eq!(w2.name, "azure_llm_2023_code");
        assert_eq!(w2.requests(), 8_819);

        let none = parse(&["--dataset", "azure-conv", "--traces-dir", d]).unwrap();
        let e = format!("{:#}", load_workload(&none).unwrap_err());
        assert!(e.contains("azure_llm_2023_conv.csv.gz"), "{e}");
        assert!(e.contains(d), "{e}");
    }

    #[test]
    fn outputs_written() {
        let dir = tempfile::tempdir().unwrap();
        let results = vec![
            metrics::RequestResult {
                ok: true,
                ttft_ms: Some(10.0),
                e2e_ms: 20.0,
                output_tokens: 2,
                ..Default::default()
            },
            metrics::RequestResult {
                ok: true,
                session: 1,
                turn: 1,
                ttft_ms: Some(30.0),
                e2e_ms: 40.0,
                output_tokens: 2,
                ideal_cached_tokens: 1024,
                ..Default::default()
            },
        ];
        let ctx = RunContext {
            label: "policy=a",
            wall_s: 1.0,
            slo: Slo::default(),
            ideal_hit_rate: 0.0,
            salt: 0,
            workload: &workload::WorkloadInfo::default(),
            fleet: None,
        };
        let (stats, s) = metrics::summarize(ctx, &results);
        assert_eq!(
            (
                stats.reuse_requests,
                stats.reuse_ttft_mean_ms,
                stats.other_ttft_mean_ms
            ),
            (1, 30.0, 10.0)
        );
        write_outputs(
            dir.path(),
            &[stats],
            &[("policy=a".into(), s)],
            &[("policy=a".into(), results)],
        )
        .unwrap();
        let lines = std::fs::read_to_string(dir.path().join("requests.jsonl")).unwrap();
        let rows: Vec<serde_json::Value> = lines
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1]["run"], "policy=a");
        assert_eq!(rows[1]["ideal_cached_tokens"], 1024);
        assert_eq!(rows[1]["ttft_ms"], 30.0);
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap())
                .unwrap();
        assert_eq!(json[0]["label"], "policy=a");
        for stem in ["latency", "latency_cdf"] {
            let svg = std::fs::read_to_string(dir.path().join(format!("{stem}.svg"))).unwrap();
            assert!(svg.starts_with("<svg"), "{stem}");
            let png = std::fs::read(dir.path().join(format!("{stem}.png"))).unwrap();
            assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "{stem}");
        }
    }
}
