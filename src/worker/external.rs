//! External workers (`router.external_workers`): engines outside Flotilla — a vLLM server, or
//! another fleet's `worker.http` faces — that this node's router places requests on as if
//! they were replicas of its own.
//!
//! Each external engine `name` becomes worker `<node>/<name>`, a one_for_all supervisor of
//! two actors, registered under the names a replica's use:
//! - `<node>/<name>/kv_manager`: an ordinary [`KvEventPublisher`]: it mirrors the engine's
//!   blocks, broadcasts them to every router as KV events, and answers the routers' resync
//!   calls from its mirror;
//! - `<node>/<name>/scheduler`: [`ExternalEngine`], which speaks [`SchedulerMsg`] to the rest
//!   of the cluster, so that routers, Request actors, Discovery and drains see a scheduler,
//!   and HTTP to the engine.
//!
//! # Requests
//! A `Submit` becomes one `POST {url}/v1/completions` with the prompt as token ids, `stream:
//! true` and vLLM's `return_token_ids: true` (vLLM ≥ 0.10.2; Flotilla's own faces answer it
//! too), the job's sampling (`temperature`, `top_p`, `top_k`, `seed`, `ignore_eos`) and
//! `max_tokens`. Each streamed chunk's `choices[0].token_ids` become token events for the
//! request's gateway ([`TokenEventKind::Token`], the chunk's `logprobs.token_logprobs` when
//! the job asked for logprobs). The last token's finish is known here without waiting for the
//! engine's finish chunk: the `max_tokens`-th token is `length`, an end-of-sequence token of
//! the model (unless `ignore_eos`) or a stop token id is `stop`; a chunk's `finish_reason`
//! also finishes its last token. So it works with both layouts: vLLM's (the finish rides on
//! the last token's chunk) and OpenAI's (an empty finish chunk after it).
//!
//! What goes wrong, and what the request sees:
//! - the engine refuses with 400/404/413/422: `Failed` (400), passed to the client;
//! - the engine refuses with another status, cannot be reached, or its stream breaks before
//!   the end: `Lost`, so the Request **migrates** (to another worker, with what it has);
//! - the engine ends a sequence without a last token this side can finish (a token-less
//!   finish chunk, e.g. its `max_model_len` is smaller than the gateway's): `Failed` (500)
//!   naming it; no stream is ever left open;
//! - `GET {url}/health` fails [`UNHEALTHY_AFTER`] times in a row (polled every
//!   [`HEALTH_INTERVAL`], each with a [`HEALTH_TIMEOUT`]): the worker leaves routing, and its
//!   requests are handed back (`Lost`, they migrate); it is routable again at the first
//!   answer. A `Cancel` (client gone) drops the HTTP stream, which an engine reads as an
//!   abort.
//!
//! Load: `Stats` (so `/v1/fleet` and admission) report the engine's own
//! `vllm:num_requests_running` / `…_waiting` and its KV use as per-mille of
//! [`KV_USAGE_SCALE`] "blocks", read with each health poll.
//!
//! Not carried over: a seeded sequence that migrates to or from an external engine does not
//! resume its draws at the same index (`SamplingParams::offset` has no OpenAI field); greedy
//! sequences are unaffected. `cached_tokens` in the response is 0 (an engine reports its
//! prefix hits only in the final usage).
//!
//! # KV events
//! With `kv_events`, a ZMQ SUB socket reads the engine's vLLM-format `KVEventBatch`es
//! (`kv::zmq`); [`Translator`] turns each stored block into Flotilla's sequence hash from its
//! token ids (so the engine must use the gateway's block size and model), and the
//! publisher passes them on. A gap in the ZMQ sequence numbers (messages dropped while
//! unsubscribed or on a slow link) clears the engine's blocks from the index, conservatively:
//! the router learns them again as the engine stores new blocks (vLLM's replay socket is not
//! used). A translation error (a chain under an unknown parent, another block size) drops that
//! event and is counted (`flotilla_external_kv_events_dropped_total`).

use crate::kv::KvPublisherMsg;
use crate::kv::vllm::{Translator, VllmEvent};
use crate::kv::zmq::ZmqSubscriber;
use crate::request_plane::protocol::{
    self, FinishReason, Owner, SubmitRequest, TokenEvent, TokenEventKind,
};
use crate::runtime::config::ExternalWorkerConfig;
use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::wire::Wire;
use crate::worker::scheduler::{
    Health, ROUTABLE_GROUP, SCHEDULER_GROUP, SchedulerMsg, SchedulerStats,
};
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Duration;
use tokio::task::JoinHandle;

/// How often the engine's `/health` (and `/metrics`) is read.
pub const HEALTH_INTERVAL: Duration = Duration::from_millis(500);
/// How long one health read may take.
pub const HEALTH_TIMEOUT: Duration = Duration::from_millis(1_000);
/// Failed health reads in a row that take the worker out of routing.
pub const UNHEALTHY_AFTER: u32 = 2;
/// An engine publishes its KV use as a fraction (`vllm:kv_cache_usage_perc`), not its pool
/// size: `/v1/fleet` and admission see it as `kv_blocks_used` out of this many
/// `kv_blocks_total` (so `gateway.busy_kv_ratio` applies to it as to a replica).
pub const KV_USAGE_SCALE: usize = 1_000;
/// How long connecting to the engine may take before a request is handed back.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// What an [`ExternalEngine`] is started with.
#[derive(Clone, Debug)]
pub struct ExternalArgs {
    /// The worker id, `<node>/<name>`.
    pub worker: WorkerId,
    /// The engine.
    pub config: ExternalWorkerConfig,
    /// Registered name of the worker's KV event publisher.
    pub kv_publisher_name: String,
    /// Tokens per block (the gateway's, `worker.block_size`).
    pub block_size: u32,
    /// Block-hash salt of the model.
    pub salt: u64,
    /// The model's end-of-sequence token ids.
    pub eos_ids: Vec<u32>,
}

/// The engine's side of one request, pure: streamed chunks in, token events out.
#[derive(Debug)]
pub struct StreamDecoder {
    worker: WorkerId,
    max_tokens: u32,
    stop_ids: Vec<u32>,
    want_logprobs: bool,
    /// Tokens passed on so far.
    sent: u32,
    admitted: bool,
    done: bool,
}

impl StreamDecoder {
    /// The decoder of `job` on `worker`; `eos_ids` end it unless the job ignores EOS.
    pub fn new(worker: WorkerId, job: &SubmitRequest, eos_ids: &[u32]) -> Self {
        let mut stop_ids = job.stop_token_ids.clone();
        if !job.ignore_eos {
            stop_ids.extend_from_slice(eos_ids);
        }
        Self {
            worker,
            max_tokens: job.max_tokens.max(1),
            stop_ids,
            want_logprobs: job.sampling.logprobs,
            sent: 0,
            admitted: false,
            done: false,
        }
    }

    /// Whether the request's last token has been passed on (or it failed).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The events for one streamed chunk (a `text_completion` object).
    pub fn on_chunk(&mut self, chunk: &Value) -> Vec<TokenEventKind> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if !self.admitted {
            self.admitted = true;
            out.push(TokenEventKind::Admitted {
                worker: self.worker.clone(),
                cached_tokens: 0,
            });
        }
        let Some(choice) = chunk["choices"].as_array().and_then(|c| c.first()) else {
            return out; // the usage chunk, or a keep-alive
        };
        let ids: Vec<u32> = choice["token_ids"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect()
            })
            .unwrap_or_default();
        let logprobs = choice["logprobs"]["token_logprobs"].as_array();
        let engine_finish = choice["finish_reason"].as_str();
        for (k, id) in ids.iter().enumerate() {
            let index = self.sent;
            self.sent += 1;
            let last_of_chunk = k + 1 == ids.len();
            let finish = if self.sent >= self.max_tokens {
                Some(FinishReason::Length)
            } else if self.stop_ids.contains(id) {
                Some(FinishReason::Stop)
            } else if last_of_chunk {
                engine_finish.map(|f| match f {
                    "stop" => FinishReason::Stop,
                    _ => FinishReason::ContextLimit,
                })
            } else {
                None
            };
            let logprob = logprobs
                .and_then(|l| l.get(k))
                .and_then(Value::as_f64)
                .filter(|_| self.want_logprobs)
                .unwrap_or(0.0) as f32;
            out.push(TokenEventKind::Token {
                id: *id,
                logprob,
                finish,
                index,
            });
            if finish.is_some() {
                self.done = true;
                return out;
            }
        }
        if ids.is_empty()
            && let Some(f) = engine_finish
        {
            self.done = true;
            out.push(TokenEventKind::Failed {
                message: format!(
                    "the external engine {} ended the sequence (finish_reason {f:?}) after {} \
                     tokens without a final token; is its max_model_len smaller than the \
                     gateway's?",
                    self.worker, self.sent
                ),
                status: 500,
            });
        }
        out
    }

    /// The stream ended (or broke) before the request's last token: hand it back.
    pub fn on_end(&mut self, why: &str) -> Option<TokenEventKind> {
        if self.done {
            return None;
        }
        self.done = true;
        Some(TokenEventKind::Lost {
            reason: format!("external engine {}: {why}", self.worker),
        })
    }
}

/// The `POST /v1/completions` body for `job`.
pub fn completion_body(job: &SubmitRequest, model: &str) -> Value {
    let s = &job.sampling;
    let mut body = json!({
        "model": model,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens.max(1),
        "temperature": s.temperature.max(0.0),
        "top_p": if s.top_p > 0.0 { s.top_p.min(1.0) } else { 1.0 },
        "stream": true,
        "return_token_ids": true,
        "ignore_eos": job.ignore_eos,
    });
    if s.top_k > 0 {
        body["top_k"] = json!(s.top_k);
    }
    if let Some(seed) = s.seed {
        // OpenAI's seed is a signed 64-bit integer.
        body["seed"] = json!(seed as i64);
    }
    if s.logprobs {
        body["logprobs"] = json!(0);
    }
    if !job.stop_token_ids.is_empty() {
        body["stop_token_ids"] = json!(job.stop_token_ids);
    }
    body
}

/// Load the engine reports on `/metrics` (vLLM's names).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct EngineLoad {
    running: usize,
    waiting: usize,
    kv_usage: f64,
}

fn parse_metrics(text: &str) -> EngineLoad {
    let mut load = EngineLoad::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = match (line.split(['{', ' ']).next(), line.rsplit(' ').next()) {
            (Some(n), Some(v)) => (n, v.parse::<f64>().unwrap_or(0.0)),
            _ => continue,
        };
        match name {
            "vllm:num_requests_running" => load.running += value as usize,
            "vllm:num_requests_waiting" => load.waiting += value as usize,
            "vllm:kv_cache_usage_perc" => load.kv_usage = load.kv_usage.max(value),
            _ => {}
        }
    }
    load
}

/// The scheduler-shaped proxy of one external engine.
#[derive(Debug, Default, Clone, Copy)]
pub struct ExternalEngine;

/// Its state.
pub struct ExternalState {
    args: ExternalArgs,
    http: reqwest::Client,
    /// The model name sent (configured, or read from `/v1/models`).
    model: Option<String>,
    /// Requests streaming from the engine: their owner and their task.
    running: HashMap<(NodeId, RequestId), (Owner, JoinHandle<()>)>,
    /// The health task's latest report, read on the `Tick` it casts after writing it.
    health: HealthSlot,
    /// Failed health reads in a row.
    failures: u32,
    routable: bool,
    draining: bool,
    load: EngineLoad,
    kv_task: Option<JoinHandle<()>>,
    health_task: Option<JoinHandle<()>>,
}

type HealthSlot = std::sync::Arc<std::sync::Mutex<Option<HealthReport>>>;

/// What the health task reports (written to the actor's [`HealthSlot`], then a `Tick`).
#[derive(Clone, Debug, Default)]
struct HealthReport {
    ok: bool,
    model: Option<String>,
    load: Option<EngineLoad>,
}

impl ExternalState {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.args.config.url.trim_end_matches('/'))
    }

    fn set_routable(&mut self, me: &ActorRef<SchedulerMsg>, on: bool) {
        let on = on && !self.draining;
        if on == self.routable {
            return;
        }
        self.routable = on;
        if on {
            ractor::pg::join(ROUTABLE_GROUP.to_owned(), vec![me.get_cell()]);
            tracing::info!(worker = %self.args.worker, url = %self.args.config.url, "external engine is routable");
        } else {
            ractor::pg::leave(ROUTABLE_GROUP.to_owned(), vec![me.get_cell()]);
            tracing::warn!(worker = %self.args.worker, url = %self.args.config.url, "external engine left routing");
        }
    }

    /// Hand every running request back (`Lost`): they migrate.
    fn hand_back_all(&mut self, why: &str) {
        self.prune();
        let n = self.running.len();
        for ((_, request), (owner, task)) in self.running.drain() {
            task.abort();
            let reason = format!("external engine {}: {why}", self.args.worker);
            deliver(&owner, request, vec![TokenEventKind::Lost { reason }]);
        }
        if n > 0 {
            tracing::warn!(worker = %self.args.worker, %why, requests = n, "external engine: requests handed back");
        }
    }

    fn prune(&mut self) {
        self.running.retain(|_, (_, t)| !t.is_finished());
    }

    fn stats(&mut self) -> SchedulerStats {
        self.prune();
        let health = if self.draining {
            Health::Draining
        } else if self.routable {
            Health::Ready
        } else {
            Health::Unhealthy
        };
        let total = KV_USAGE_SCALE;
        SchedulerStats {
            worker: self.args.worker.clone(),
            waiting: self.load.waiting,
            running: self.running.len().max(self.load.running),
            kv_blocks_total: total,
            kv_blocks_used: (self.load.kv_usage.clamp(0.0, 1.0) * total as f64).round() as usize,
            health,
            ..SchedulerStats::default()
        }
    }
}

/// Send `events` for `request` to its owner's token sink; false when it cannot be reached
/// (the request's task then ends: a Request that hears nothing asks `Has` and resumes).
fn deliver(owner: &Owner, request: RequestId, events: Vec<TokenEventKind>) -> bool {
    events.is_empty()
        || protocol::deliver(
            owner,
            events
                .into_iter()
                .map(|kind| TokenEvent { request, kind })
                .collect(),
        )
        .is_ok()
}

/// One request's HTTP exchange with the engine.
async fn run_request(
    http: reqwest::Client,
    url: String,
    body: Value,
    mut decoder: StreamDecoder,
    owner: Owner,
    request: RequestId,
) {
    use eventsource_stream::Eventsource;
    let resp = match http.post(&url).json(&body).send().await {
        Ok(r) => r,
        Err(e) => {
            let ev = decoder.on_end(&format!("cannot reach {url}: {e}"));
            deliver(&owner, request, ev.into_iter().collect());
            return;
        }
    };
    let status = resp.status().as_u16();
    if status != 200 {
        let text = resp.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or(text);
        let ev = if matches!(status, 400 | 404 | 413 | 422) {
            TokenEventKind::Failed {
                message: format!("the external engine refused the request ({status}): {message}"),
                status: 400,
            }
        } else {
            match decoder.on_end(&format!("answered {status}: {message}")) {
                Some(ev) => ev,
                None => return,
            }
        };
        deliver(&owner, request, vec![ev]);
        return;
    }
    let mut events = std::pin::pin!(resp.bytes_stream().eventsource());
    while let Some(event) = events.next().await {
        let data = match event {
            Ok(e) => e.data,
            Err(e) => {
                let ev = decoder.on_end(&format!("stream broke: {e}"));
                deliver(&owner, request, ev.into_iter().collect());
                return;
            }
        };
        if data.trim() == "[DONE]" {
            break;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
            continue;
        };
        if chunk.get("error").is_some() {
            let why = chunk["error"]["message"]
                .as_str()
                .unwrap_or("an error record");
            let ev = decoder.on_end(&format!("stream ended with an error: {why}"));
            deliver(&owner, request, ev.into_iter().collect());
            return;
        }
        let out = decoder.on_chunk(&chunk);
        if !deliver(&owner, request, out) {
            return; // the owner is gone: dropping the stream aborts the request there
        }
        if decoder.is_done() {
            return;
        }
    }
    let ev = decoder.on_end("the stream ended before the last token");
    deliver(&owner, request, ev.into_iter().collect());
}

/// Poll `/health` (and `/metrics`, and `/v1/models` until a model name is known) once.
async fn check_health(http: &reqwest::Client, base: &str, need_model: bool) -> HealthReport {
    let get = |path: &str| {
        http.get(format!("{base}{path}"))
            .timeout(HEALTH_TIMEOUT)
            .send()
    };
    let ok = matches!(get("/health").await, Ok(r) if r.status().is_success());
    if !ok {
        return HealthReport::default();
    }
    let model = if need_model {
        match get("/v1/models").await {
            Ok(r) => r.json::<Value>().await.ok().and_then(|v| {
                v["data"]
                    .as_array()
                    .and_then(|d| d.first())
                    .and_then(|m| m["id"].as_str())
                    .map(str::to_owned)
            }),
            Err(_) => None,
        }
    } else {
        None
    };
    let load = match get("/metrics").await {
        Ok(r) if r.status().is_success() => r.text().await.ok().map(|t| parse_metrics(&t)),
        _ => None,
    };
    HealthReport { ok, model, load }
}

/// Follow the engine's vLLM-format KV events and hand them, translated, to its publisher.
async fn follow_kv_events(
    endpoint: String,
    mut translator: Translator,
    publisher: ActorRef<KvPublisherMsg>,
    worker: WorkerId,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut sub = match ZmqSubscriber::connect(&endpoint).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(%worker, %endpoint, error = %e, "external KV events: cannot connect yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        tracing::info!(%worker, %endpoint, "following the external engine's KV events");
        let mut expected: Option<u64> = None;
        loop {
            let (seq, batch) = match sub.next().await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(%worker, error = %e, "external KV events: bad message");
                    continue;
                }
            };
            let mut events = Vec::new();
            if expected.is_some_and(|x| x != seq) {
                // Messages were lost: what the index holds for this engine may be wrong.
                metrics::counter!("flotilla_external_kv_gaps_total", "worker" => worker.to_string())
                    .increment(1);
                tracing::warn!(%worker, expected = ?expected, got = seq, "external KV events: gap; clearing the engine's blocks");
                if let Ok(Some(ev)) = translator.apply(&VllmEvent::AllBlocksCleared) {
                    events.push(ev);
                }
            }
            expected = Some(seq.wrapping_add(1));
            for ev in &batch.events {
                match translator.apply(ev) {
                    Ok(Some(e)) => events.push(e),
                    Ok(None) => {}
                    Err(e) => {
                        metrics::counter!("flotilla_external_kv_events_dropped_total", "worker" => worker.to_string())
                            .increment(1);
                        tracing::debug!(%worker, error = %e, "external KV event dropped");
                    }
                }
            }
            if !events.is_empty()
                && publisher
                    .cast(KvPublisherMsg::Events(Wire::encode(&events)))
                    .is_err()
            {
                return; // the publisher stopped: so does the supervisor's pair
            }
        }
    }
}

impl Actor for ExternalEngine {
    type Msg = SchedulerMsg;
    type State = ExternalState;
    type Arguments = ExternalArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: ExternalArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("external engine {}: HTTP client: {e}", args.worker))?;
        let kv_task = match &args.config.kv_events {
            Some(endpoint) => {
                let publisher: ActorRef<KvPublisherMsg> =
                    ractor::registry::where_is(args.kv_publisher_name.clone())
                        .ok_or_else(|| {
                            format!("KV publisher {} is not running", args.kv_publisher_name)
                        })?
                        .into();
                let translator = Translator::new(args.worker.clone(), args.block_size, args.salt);
                Some(tokio::spawn(follow_kv_events(
                    endpoint.clone(),
                    translator,
                    publisher,
                    args.worker.clone(),
                )))
            }
            None => None,
        };
        ractor::pg::join(SCHEDULER_GROUP.to_owned(), vec![myself.get_cell()]);
        // The health task reports through Ticks: one read in flight at a time.
        let slot = HealthSlot::default();
        let (h, base, me, s) = (
            http.clone(),
            args.config.url.trim_end_matches('/').to_owned(),
            myself.clone(),
            slot.clone(),
        );
        let need_model = args.config.model.is_none();
        let health_task = tokio::spawn(async move {
            let mut known_model = !need_model;
            loop {
                let report = check_health(&h, &base, !known_model).await;
                known_model |= report.model.is_some();
                *s.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
                if me.cast(SchedulerMsg::Tick(Wire::encode(&()))).is_err() {
                    return;
                }
                tokio::time::sleep(HEALTH_INTERVAL).await;
            }
        });
        Ok(ExternalState {
            health: slot,
            model: args.config.model.clone(),
            args,
            http,
            running: HashMap::new(),
            failures: 0,
            routable: false,
            draining: false,
            load: EngineLoad::default(),
            kv_task,
            health_task: Some(health_task),
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        ractor::pg::leave(ROUTABLE_GROUP.to_owned(), vec![myself.get_cell()]);
        ractor::pg::leave(SCHEDULER_GROUP.to_owned(), vec![myself.get_cell()]);
        for t in state
            .kv_task
            .take()
            .into_iter()
            .chain(state.health_task.take())
        {
            t.abort();
        }
        // Requests still here are handed back (they migrate), not left waiting.
        state.hand_back_all("its proxy stopped");
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Submit(wire) => {
                let Ok(job) = wire.decode() else {
                    return Ok(());
                };
                let owner = job.owner();
                let mut decoder =
                    StreamDecoder::new(state.args.worker.clone(), &job, &state.args.eos_ids);
                let owner_of = owner.clone();
                let Some(model) = state.model.clone() else {
                    let ev = decoder.on_end("its model name is not known yet (GET /v1/models)");
                    deliver(&owner, job.request, ev.into_iter().collect());
                    return Ok(());
                };
                let body = completion_body(&job, &model);
                let task = tokio::spawn(run_request(
                    state.http.clone(),
                    state.url("/v1/completions"),
                    body,
                    decoder,
                    owner,
                    job.request,
                ));
                state.prune();
                if let Some((_, old)) = state
                    .running
                    .insert((job.reply_to.clone(), job.request), (owner_of, task))
                {
                    old.abort();
                }
            }
            SchedulerMsg::Cancel(wire) => {
                if let Ok(key) = wire.decode()
                    && let Some((_, t)) = state.running.remove(&key)
                {
                    t.abort();
                }
            }
            SchedulerMsg::Stats(reply) => {
                let _ = reply.send(Wire::encode(&state.stats()));
            }
            SchedulerMsg::Has(wire, reply) => {
                state.prune();
                let has = wire
                    .decode()
                    .is_ok_and(|key: (NodeId, RequestId)| state.running.contains_key(&key));
                let _ = reply.send(Wire::encode(&has));
            }
            SchedulerMsg::Tick(_) => {
                state.prune();
                let report = state
                    .health
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                let Some(report) = report else {
                    return Ok(());
                };
                if report.ok {
                    state.failures = 0;
                    if state.model.is_none() {
                        state.model = report.model;
                    }
                    if let Some(load) = report.load {
                        state.load = load;
                    }
                    let ready = state.model.is_some();
                    state.set_routable(&myself, ready);
                } else {
                    state.failures += 1;
                    if state.failures >= UNHEALTHY_AFTER && state.routable {
                        state.set_routable(&myself, false);
                        // Streams of an engine that stopped answering may hang: hand them
                        // back rather than wait (those already broken have ended).
                        state.hand_back_all("its /health stopped answering");
                    }
                }
            }
            SchedulerMsg::Drain(_) => {
                state.set_routable(&myself, false);
                state.draining = true;
            }
            SchedulerMsg::HandOffAll(wire) => {
                let why = wire.decode().unwrap_or_else(|_| "handed off".into());
                state.hand_back_all(&why);
            }
            SchedulerMsg::SetRole(_) => {
                tracing::warn!(worker = %state.args.worker, "an external engine has no disaggregated role; ignored");
            }
            SchedulerMsg::StepDone(_) | SchedulerMsg::CanaryDone(_) | SchedulerMsg::PullDone(_) => {
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
