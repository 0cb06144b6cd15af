//! Sending a workload: open or closed loop, sessions turn by turn, a progress bar, and the
//! gateway helpers the bench needs (`/v1/models`, idleness from `/v1/fleet`).
//!
//! **Progress**: while a run goes, an `indicatif` bar on stderr shows the requests finished
//! of the run's total, the elapsed time, and live numbers ([`Progress::message`]): the
//! median TTFT of the last [`RECENT_TTFTS`] successful requests, output tokens per second
//! (finished requests' tokens over the elapsed time), errors and requests in flight. The bar
//! is drawn only when stderr is a terminal (hidden in pipes, files, tests and CI logs); when
//! the run ends it is cleared and one summary line ([`Progress::line`]) is printed either way.

use std::collections::VecDeque;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::metrics::RequestResult;
use super::synth::token_ids;
use super::workload::{Prompt, Session, Turn, Workload};
use crate::cli::client::{Route, stream_request};

/// Where and how requests go.
#[derive(Clone, Debug)]
pub struct Target {
    /// HTTP client (shared connection pool).
    pub client: reqwest::Client,
    /// Gateway base URLs, no trailing `/`: session `i` goes to `bases[i % len]` (clients
    /// spread over several gateways); never empty.
    pub bases: Vec<String>,
    /// `model` of every request.
    pub model: String,
    /// Longest time one request may take, stream included.
    pub request_timeout: Duration,
    /// `--text-prompts`: token-id prompts go as text.
    pub text: Option<std::sync::Arc<super::text::TextPrompts>>,
}

/// One run of a workload.
#[derive(Clone, Debug)]
pub struct RunPlan {
    /// Shown on the progress line.
    pub label: String,
    /// Start offset (s) of each session, in the workload's order (open loop); `None` for a
    /// closed loop of `concurrency` sessions.
    pub offsets: Option<Vec<f64>>,
    /// Sessions at once in a closed loop.
    pub concurrency: usize,
    /// Prefix salt of this run (see the `bench` module doc).
    pub salt: u64,
    /// Headers added to every request (e.g. `x-flotilla-route-policy`).
    pub headers: Vec<(String, String)>,
    /// `--classes`: session `i` sends `x-priority-class` (`metrics::class_of`).
    pub classes: Vec<String>,
}

/// The system-message prefix that salts a chat prompt.
pub fn chat_salt_prefix(salt: u64) -> String {
    format!("Run {salt:016x}.")
}

/// The request body of `turn` under `salt` (`stream` and usage are added by the client), and
/// the route it goes to. Every request sets `ignore_eos` and `temperature: 0`, so its output
/// has exactly `max_tokens` tokens unless the context ends first.
pub fn request_body(
    model: &str,
    turn: &Turn,
    salt: u64,
    text: Option<&super::text::TextPrompts>,
) -> (Route, Value) {
    match &turn.prompt {
        Prompt::Tokens(segs) => (
            Route::Completions,
            json!({
                "model": model,
                "prompt": match text {
                    None => json!(token_ids(segs, salt)),
                    Some(t) => json!(t.text(&token_ids(segs, salt))),
                },
                "max_tokens": turn.max_tokens,
                "ignore_eos": true,
                "temperature": 0,
            }),
        ),
        Prompt::Chat { conv, turn: k } => {
            let messages: Vec<Value> = conv
                .messages(*k, &chat_salt_prefix(salt))
                .into_iter()
                .map(|(role, content)| json!({"role": role, "content": content}))
                .collect();
            (
                Route::Chat,
                json!({
                    "model": model,
                    "messages": messages,
                    "max_tokens": turn.max_tokens,
                    "ignore_eos": true,
                    "temperature": 0,
                }),
            )
        }
    }
}

/// How many of the latest successful requests the live TTFT is the median of.
pub const RECENT_TTFTS: usize = 100;

/// Counters behind the progress bar and the summary line.
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests finished (ok or not).
    pub done: AtomicUsize,
    /// Requests that failed or were skipped.
    pub errors: AtomicUsize,
    /// Requests sent and not yet finished.
    pub in_flight: AtomicUsize,
    /// Output tokens of the successful requests finished.
    pub output_tokens: AtomicU64,
    /// TTFTs (ms) of the latest [`RECENT_TTFTS`] successful requests, oldest first.
    recent_ttft_ms: Mutex<VecDeque<f64>>,
}

impl Progress {
    /// `[label] done/total  errors  in flight  elapsed`.
    pub fn line(&self, label: &str, total: usize, elapsed: Duration) -> String {
        format!(
            "[{label}] {}/{total} done, {} errors, {} in flight, {:.1} s",
            self.done.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.in_flight.load(Ordering::Relaxed),
            elapsed.as_secs_f64()
        )
    }

    /// The bar's live numbers: `TTFT p50 N ms (last K) | N out tok/s | N errors | N in
    /// flight` (TTFT `–` before the first success).
    pub fn message(&self, elapsed: Duration) -> String {
        let ttft = self
            .recent_ttft_ms
            .lock()
            .ok()
            .map(|q| q.iter().copied().collect::<Vec<f64>>())
            .unwrap_or_default();
        let ttft = if ttft.is_empty() {
            "TTFT p50 – ms".to_owned()
        } else {
            let mut v = ttft;
            v.sort_by(f64::total_cmp);
            format!("TTFT p50 {:.0} ms (last {})", v[(v.len() - 1) / 2], v.len())
        };
        let secs = elapsed.as_secs_f64();
        let tps = if secs > 0.0 {
            self.output_tokens.load(Ordering::Relaxed) as f64 / secs
        } else {
            0.0
        };
        format!(
            "{ttft} | {tps:.0} out tok/s | {} errors | {} in flight",
            self.errors.load(Ordering::Relaxed),
            self.in_flight.load(Ordering::Relaxed)
        )
    }

    fn finish(&self, r: &RequestResult) {
        self.done.fetch_add(1, Ordering::Relaxed);
        if !r.ok {
            self.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.output_tokens
            .fetch_add(r.output_tokens, Ordering::Relaxed);
        if let (Some(t), Ok(mut q)) = (r.ttft_ms, self.recent_ttft_ms.lock()) {
            if q.len() == RECENT_TTFTS {
                q.pop_front();
            }
            q.push_back(t);
        }
    }
}

/// The run's progress bar on stderr: `total` requests, prefixed with the run's label;
/// hidden unless stderr is a terminal.
fn progress_bar(label: &str, total: usize) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    let style =
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed} {msg}")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(format!("[{label}]"));
    bar
}

/// Update `bar` from `progress` 5 times a second until aborted.
fn spawn_progress(
    progress: Arc<Progress>,
    bar: indicatif::ProgressBar,
    start: Instant,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            bar.set_position(progress.done.load(Ordering::Relaxed) as u64);
            bar.set_message(progress.message(start.elapsed()));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// Send one turn and read its answer.
async fn send_turn(
    target: &Target,
    base: &str,
    turn: &Turn,
    salt: u64,
    headers: &[(String, String)],
) -> RequestResult {
    let (route, body) = request_body(&target.model, turn, salt, target.text.as_deref());
    let call = stream_request(&target.client, base, route, body, headers);
    match tokio::time::timeout(target.request_timeout, call).await {
        Ok(Ok(outcome)) => RequestResult::from_outcome(&outcome),
        Ok(Err(e)) => RequestResult::failed(format!("transport: {e:#}")),
        Err(_) => RequestResult::failed(format!(
            "timed out after {:.0} s",
            target.request_timeout.as_secs_f64()
        )),
    }
}

/// Run one session: its turns one after another; after a failure the rest are skipped (and
/// counted as failed).
async fn run_session(
    target: &Target,
    base: &str,
    (index, session): (usize, &Session),
    plan: &RunPlan,
    progress: &Progress,
    start: Instant,
) -> Vec<RequestResult> {
    let mut out = Vec::with_capacity(session.turns.len());
    let mut headers = plan.headers.clone();
    if let Some(c) = super::metrics::class_of(&plan.classes, index) {
        headers.push((
            crate::request_plane::priority::CLASS_HEADER.to_owned(),
            c.to_owned(),
        ));
    }
    // A keyed session sends its key with every turn, as an agent client does.
    if let Some(k) = &session.key {
        headers.push(("x-session-id".to_owned(), k.clone()));
    }
    for turn in &session.turns {
        if out.last().is_some_and(|r: &RequestResult| !r.ok) {
            let skipped = RequestResult::failed("skipped: an earlier turn of the session failed");
            progress.finish(&skipped);
            out.push(skipped);
            continue;
        }
        progress.in_flight.fetch_add(1, Ordering::Relaxed);
        let sent_s = start.elapsed().as_secs_f64();
        let mut r = send_turn(target, base, turn, plan.salt, &headers).await;
        r.sent_s = sent_s;
        progress.in_flight.fetch_sub(1, Ordering::Relaxed);
        progress.finish(&r);
        out.push(r);
    }
    out
}

/// Everything a spawned session task needs.
#[derive(Clone)]
struct Shared {
    target: Arc<Target>,
    workload: Arc<Workload>,
    plan: Arc<RunPlan>,
    progress: Arc<Progress>,
    /// Per session, per turn: ideal cached tokens (`Workload::ideal_cached`).
    ideal: Arc<Vec<Vec<(u64, u64)>>>,
    start: Instant,
}

impl Shared {
    /// Session `i`'s results, each labelled with its session, turn and ideal cached tokens.
    async fn session(&self, i: usize) -> Vec<RequestResult> {
        let bases = &self.target.bases;
        let mut out = run_session(
            &self.target,
            &bases[i % bases.len()],
            (i, &self.workload.sessions[i]),
            &self.plan,
            &self.progress,
            self.start,
        )
        .await;
        for (k, r) in out.iter_mut().enumerate() {
            r.session = i;
            r.turn = k;
            r.ideal_cached_tokens = self.ideal.get(i).and_then(|t| t.get(k)).map_or(0, |x| x.0);
        }
        out
    }
}

/// Send every session of `workload` as `plan` says; returns every request's result and the
/// wall time (s) from the start to the last completion.
///
/// `ideal` labels each result with its ideal cached tokens (per session, per turn:
/// [`Workload::ideal_cached_in`] in the order the sessions are sent).
pub async fn execute(
    target: Arc<Target>,
    workload: Arc<Workload>,
    plan: RunPlan,
    ideal: Arc<Vec<Vec<(u64, u64)>>>,
) -> (Vec<RequestResult>, f64) {
    let total = workload.requests();
    let start = Instant::now();
    let shared = Shared {
        target,
        ideal,
        workload,
        plan: Arc::new(plan),
        progress: Arc::new(Progress::default()),
        start,
    };
    let bar = progress_bar(&shared.plan.label, total);
    let ticker = spawn_progress(Arc::clone(&shared.progress), bar.clone(), start);
    let handles = match shared.plan.offsets.clone() {
        Some(offsets) => open_loop(&shared, &offsets, start).await,
        None => closed_loop(&shared),
    };
    let mut results = Vec::with_capacity(total);
    for h in handles {
        match h.await {
            Ok(r) => results.extend(r),
            Err(e) => results.push(RequestResult::failed(format!("task failed: {e}"))),
        }
    }
    let wall = start.elapsed();
    ticker.abort();
    bar.finish_and_clear();
    eprintln!("{}", shared.progress.line(&shared.plan.label, total, wall));
    (results, wall.as_secs_f64())
}

type Handles = Vec<tokio::task::JoinHandle<Vec<RequestResult>>>;

/// Start each session at its offset, without waiting for earlier ones.
async fn open_loop(shared: &Shared, offsets: &[f64], start: Instant) -> Handles {
    let mut order: Vec<usize> = (0..offsets.len().min(shared.workload.sessions.len())).collect();
    order.sort_by(|&a, &b| offsets[a].total_cmp(&offsets[b]));
    let mut handles = Vec::with_capacity(order.len());
    for i in order {
        let at = start + Duration::from_secs_f64(offsets[i].max(0.0));
        tokio::time::sleep_until(at.into()).await;
        let s = shared.clone();
        handles.push(tokio::spawn(async move { s.session(i).await }));
    }
    handles
}

/// `plan.concurrency` workers, each taking the next session as soon as its last one ended.
fn closed_loop(shared: &Shared) -> Handles {
    let next = Arc::new(AtomicUsize::new(0));
    let n = shared.workload.sessions.len();
    (0..shared.plan.concurrency.max(1))
        .map(|_| {
            let (s, next) = (shared.clone(), Arc::clone(&next));
            tokio::spawn(async move {
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break out;
                    }
                    out.extend(s.session(i).await);
                }
            })
        })
        .collect()
}

/// The workers of every node whose state is `up` in a `/v1/fleet` body (`{"nodes":
/// [{"state", "workers": [...]}]}`); `None` when the body has no `nodes` array.
fn up_workers(body: &Value) -> Option<impl Iterator<Item = &Value>> {
    let nodes = body["nodes"].as_array()?;
    Some(
        nodes
            .iter()
            .filter(|n| n["state"].as_str().is_none_or(|s| s == "up"))
            .flat_map(|n| n["workers"].as_array().into_iter().flatten()),
    )
}

/// Requests in flight on the fleet: Σ `in_flight` over [`up_workers`].
pub fn fleet_in_flight(body: &Value) -> Option<u64> {
    Some(
        up_workers(body)?
            .map(|w| w["in_flight"].as_u64().unwrap_or(0))
            .sum(),
    )
}

/// Worker replicas a `/v1/fleet` body shows held: [`up_workers`] but the unreachable
/// (starting, ready, draining and unhealthy ones all cost).
pub fn fleet_replicas(body: &Value) -> Option<u64> {
    Some(
        up_workers(body)?
            .filter(|w| w["health"].as_str() != Some("unreachable"))
            .count() as u64,
    )
}

/// Counts the fleet's worker replicas from `GET {base}/v1/fleet` every second while a run
/// goes, for its replica-seconds (and so its cost).
pub struct FleetMeter {
    cancel: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Option<f64>>,
}

impl FleetMeter {
    /// How often the fleet is read.
    pub const EVERY: Duration = Duration::from_secs(1);

    /// Start counting.
    pub fn start(client: reqwest::Client, base: String) -> Self {
        let cancel = tokio_util::sync::CancellationToken::new();
        let stop = cancel.clone();
        let task = tokio::spawn(async move {
            let url = format!("{base}/v1/fleet");
            let read = || async {
                let r = client.get(&url).send().await.ok()?;
                fleet_replicas(&r.json::<Value>().await.ok()?)
            };
            let (mut total, mut any) = (0.0, false);
            // Each reading holds until the next one (the last until the stop); a failed
            // read keeps the count before it.
            let mut last: Option<(Instant, u64)> = None;
            loop {
                let n = tokio::select! {
                    n = read() => n,
                    _ = stop.cancelled() => break,
                };
                let now = Instant::now();
                if let Some((t, held)) = last {
                    total += now.duration_since(t).as_secs_f64() * held as f64;
                }
                last = match (n, last) {
                    (Some(n), _) => {
                        any = true;
                        Some((now, n))
                    }
                    (None, held) => held.map(|(_, h)| (now, h)),
                };
                tokio::select! {
                    _ = tokio::time::sleep(Self::EVERY) => {}
                    _ = stop.cancelled() => break,
                }
            }
            if let Some((t, held)) = last {
                total += t.elapsed().as_secs_f64() * held as f64;
            }
            any.then_some(total)
        });
        Self { cancel, task }
    }

    /// Stop; the replica-seconds counted (`None`: the gateway showed no fleet).
    pub async fn stop(self) -> Option<f64> {
        self.cancel.cancel();
        self.task.await.ok().flatten()
    }
}

/// Poll `GET {base}/v1/fleet` every 500 ms until no worker has a request in flight; gives up
/// (with a warning) after `timeout`, or at once when the gateway has no usable fleet view.
pub async fn wait_idle(client: &reqwest::Client, base: &str, timeout: Duration) {
    let start = Instant::now();
    loop {
        let body = match client.get(format!("{base}/v1/fleet")).send().await {
            Ok(r) => r.json::<Value>().await.ok(),
            Err(_) => None,
        };
        match body.as_ref().and_then(fleet_in_flight) {
            None => {
                eprintln!("warning: no fleet view at {base}/v1/fleet; not waiting for idle");
                return;
            }
            Some(0) => return,
            Some(n) if start.elapsed() >= timeout => {
                eprintln!(
                    "warning: the fleet still has {n} requests in flight after {:.0} s; going on",
                    timeout.as_secs_f64()
                );
                return;
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// The first model `GET {base}/v1/models` lists.
///
/// # Errors
/// The gateway cannot be reached, its answer is not JSON, or it lists no model.
pub async fn first_model(client: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let url = format!("{base}/v1/models");
    let resp = client
        .get(&url)
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the gateway at {base}: {e}"))?;
    let body: Value = resp.json().await?;
    body["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("{url} lists no model: {body}; pass --model"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::bench::synth::Segment;
    use crate::cli::bench::workload::ChatConv;

    #[test]
    fn bodies() {
        let turn = Turn {
            prompt: Prompt::Tokens(vec![Segment { seed: 1, len: 20 }]),
            max_tokens: 7,
        };
        let (route, b) = request_body("m", &turn, 0, None);
        assert_eq!(route, Route::Completions);
        assert_eq!(b["prompt"].as_array().unwrap().len(), 20);
        assert_eq!(
            (b["max_tokens"].as_u64(), b["ignore_eos"].as_bool()),
            (Some(7), Some(true))
        );
        let (_, other) = request_body("m", &turn, 1, None);
        assert_ne!(b["prompt"], other["prompt"], "salt changes the ids");
        let conv = Arc::new(ChatConv {
            system: String::new(),
            exchanges: vec![("q".into(), "a".into()), ("q2".into(), "a2".into())],
        });
        let chat = Turn {
            prompt: Prompt::Chat { conv, turn: 1 },
            max_tokens: 3,
        };
        let (route, b) = request_body("m", &chat, 0xab, None);
        assert_eq!(route, Route::Chat);
        let roles: Vec<&str> = b["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(b["messages"][0]["content"], "Run 00000000000000ab.");
    }

    #[test]
    fn fleet_idle() {
        let busy = json!({"nodes": [
            {"state": "up", "workers": [{"in_flight": 2}, {"in_flight": 1}]},
            {"state": "down", "workers": [{"in_flight": 5}]},
            {"state": "up", "workers": []}]});
        assert_eq!(fleet_in_flight(&busy), Some(3));
        assert_eq!(fleet_in_flight(&json!({"nodes": []})), Some(0));
        assert_eq!(fleet_in_flight(&json!({"error": {}})), None);
    }

    /// The live numbers: the median of the latest TTFTs (failures not counted), output
    /// tokens over the elapsed time; the bar itself is hidden off a terminal (as here).
    #[test]
    fn progress_message() {
        let p = Progress::default();
        assert_eq!(
            p.message(Duration::ZERO),
            "TTFT p50 – ms | 0 out tok/s | 0 errors | 0 in flight"
        );
        for t in [30.0, 10.0, 20.0] {
            p.finish(&RequestResult {
                ok: true,
                ttft_ms: Some(t),
                output_tokens: 50,
                ..Default::default()
            });
        }
        p.finish(&RequestResult::failed("x"));
        assert_eq!(
            p.message(Duration::from_secs(3)),
            "TTFT p50 20 ms (last 3) | 50 out tok/s | 1 errors | 0 in flight"
        );
        for i in 0..2 * RECENT_TTFTS {
            p.finish(&RequestResult {
                ok: true,
                ttft_ms: Some(1000.0 + i as f64),
                ..Default::default()
            });
        }
        let m = p.message(Duration::from_secs(1));
        assert!(
            m.starts_with(&format!("TTFT p50 1149 ms (last {RECENT_TTFTS})")),
            "{m}"
        );
        if !std::io::stderr().is_terminal() {
            assert!(progress_bar("x", 10).is_hidden());
        }
    }

    #[test]
    fn progress_line() {
        let p = Progress::default();
        p.finish(&RequestResult::failed("x"));
        p.in_flight.fetch_add(2, Ordering::Relaxed);
        assert_eq!(
            p.line("policy=a", 10, Duration::from_millis(1500)),
            "[policy=a] 1/10 done, 1 errors, 2 in flight, 1.5 s"
        );
    }
}
