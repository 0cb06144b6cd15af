//! External workers (`router.external_workers`): engines outside Flotilla — a vLLM server, or
//! another fleet's `worker.http` faces — that this node's router places requests on as if
//! they were replicas of its own.
//!
//! Each external engine `name` becomes worker `<node>/<name>`, a one_for_all supervisor of
//! two actors, registered under the names a replica's use:
//! - `<node>/<name>/kv_publisher`: an ordinary
//!   [`KvEventPublisher`](crate::actors::kv_publisher::KvEventPublisher): it mirrors the engine's
//!   blocks, broadcasts them to every router as KV events, and answers the routers' resync
//!   calls from its mirror;
//! - `<node>/<name>/scheduler`: [`ExternalEngine`](crate::actors::external_engine::ExternalEngine),
//!   which speaks [`SchedulerMsg`](crate::actors::scheduler::SchedulerMsg) to the rest
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
//! A job that asks for prompt log-probabilities (`echo`, `SamplingParams::echo_tokens`) is
//! refused with `Failed` (400) before any HTTP: they are not read from an engine's stream.
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
//!
//! This module is the pure part (the stream decoder, the request body, the metrics reader);
//! the actor and its HTTP tasks are [`crate::actors::external_engine`].

#[cfg(doc)]
use crate::kv::vllm::Translator;
use crate::request_plane::protocol::{FinishReason, SubmitRequest, TokenEventKind};
use crate::runtime::ids::WorkerId;
use serde_json::{Value, json};
use std::time::Duration;

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

/// One external engine (`[[router.external_workers]]`): part of the router's section, so
/// defined with it in the request plane.
pub use crate::request_plane::router::config::ExternalWorkerConfig;

/// What an external engine's actor is started with.
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
    /// Where the actor publishes the engine's load (the node's board).
    pub board: crate::worker::scheduler::StatsBoard,
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
            // Alternatives are not read from an external engine's stream (yet): none.
            out.push(TokenEventKind::Token {
                id: *id,
                logprob,
                finish,
                index,
                top: Vec::new(),
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
pub struct EngineLoad {
    /// `vllm:num_requests_running`.
    pub running: usize,
    /// `vllm:num_requests_waiting`.
    pub waiting: usize,
    /// `vllm:kv_cache_usage_perc`, a fraction.
    pub kv_usage: f64,
}

pub fn parse_metrics(text: &str) -> EngineLoad {
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

#[cfg(test)]
mod tests;
