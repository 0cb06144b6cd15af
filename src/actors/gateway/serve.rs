//! The generation routes: `POST /v1/chat/completions`, `POST /v1/completions` and Anthropic's
//! `POST /v1/messages`, streaming (SSE) and not, plus `GET /v1/models[/{id}]`.
//!
//! The three routes share one pipeline; only the wire shapes differ ([`Api`]): the Messages
//! body is parsed by `anthropic::request` into the same `GenerationRequest` as a chat
//! completion, and its message, events and errors are rendered by `anthropic::response` and
//! `anthropic::error`.
//!
//! Order of work for one request, the intake's named stages (`request_plane/intake.rs` lists
//! them; the HTTP ones are `serve/intake.rs`): **parse** (admission on a class named by header
//! first, then the body: 413 past `gateway.max_body_bytes`, without buffering more; the API's
//! adapter) → **admit** (the class; admission control, `admission.rs`, on the published fleet
//! view) → **validate** (model 404, routing header, session) → **tokenize** (`frontend.rs`;
//! the context, 400) → **place** (one Request actor per choice) → wait for each choice's first
//! event, so that a refusal (no worker: 503; can never fit: 400) is an HTTP status before any
//! stream header → stream or collect.
//!
//! A list of prompts on `/v1/completions` is one request of prompts × `n` choices,
//! prompt-major (`index = prompt_index × n + j`): every prompt is tokenized and checked against
//! the context before any choice starts (a refusal names `prompt[i]`, and nothing reaches a
//! worker), then each choice is its own Request actor, placed on its own, so the prompts of one
//! request may run on different workers. Choice `j` of every prompt samples with `seed + j`,
//! as it would alone. `usage` sums the prompts (each once, whatever `n`), the choices'
//! completion tokens, and each prompt's first choice's cached tokens (each at most its prompt);
//! `/metrics` counts the request once with those sums.
//!
//! Per choice, tokens go through the incremental detokenizer, then the stop-string matcher
//! (text that might start a stop string is held back, never sent: `request_plane/choice.rs`,
//! pure); a stop-string match cancels the request at its worker. Documented choices: `completion_tokens` counts every token the
//! model generated for the choice, including the end-of-sequence token and the token that
//! completed a stop string; `logprobs` carry the chosen token's logprob and, with
//! `top_logprobs` (chat) / `logprobs: N` (completions), its worker's N most likely tokens at
//! that step under the same distribution (the simulated engine lists its token alone, an
//! external engine none). `echo` (completions): the choice's text starts with its prompt (a
//! string prompt as sent, a token-id prompt decoded), sent before the first token's text —
//! with `logprobs`, once the worker's Prompt events have scored every prompt token (the first
//! `null`); `max_tokens: 0` submits 1 and drops the sampled token (`finish_reason: "length"`,
//! no completion tokens), as vLLM does. A failure after the stream started is one SSE error
//! record, then the stream ends without `[DONE]`; keep-alive comments are sent every
//! `gateway.keep_alive_ms` (10 s) while a stream waits for tokens.

use super::state::{GatewayShared, Serving};
use crate::anthropic;
use wire::{Api, StreamOut};

mod intake;
mod wire;

use crate::actors::request::{Job, Request, RequestArgs, RequestMsg};
use crate::openai::error::ApiError;
use crate::openai::request::{Input, RequestKind, check_model, model_not_found};
use crate::openai::response::{
    self, ChoiceOutput, FinishReason, ResponseMeta, TokenLogprob, Usage,
};
use crate::openai::sse;
use crate::request_plane::choice::{ChoiceSpec, ChoiceText, Produced};
use crate::request_plane::error::RequestError;
use crate::request_plane::frontend::TokRef;
use crate::request_plane::intake::{Placement, submissions};
use crate::request_plane::protocol::TokenEventKind;
use crate::request_plane::router::policy::Policy;
use crate::runtime::resilience::NodeStats;
use crate::runtime::supervision::{ChildSpec, Restart, Shutdown, SupervisorMsg};
use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response, Sse};
pub(super) use intake::read_body;
use ractor::ActorRef;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Cancels every choice still running when dropped (client gone, error, or done).
struct CancelGuard(Vec<ActorRef<RequestMsg>>);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        for r in &self.0 {
            let _ = r.cast(RequestMsg::Cancel);
        }
    }
}

/// One choice: its output (the request plane's [`ChoiceText`]) and its timing.
struct Choice {
    text: ChoiceText,
    /// When the request was received.
    t0: Instant,
    /// When the previous token arrived.
    last: Option<Instant>,
    /// This node's counters (the planner's signals: TTFT, ITL).
    stats: Arc<NodeStats>,
    /// Its priority class, if classes are configured (per-class metrics).
    class: Option<Arc<str>>,
}

impl Choice {
    /// One token event: the choice's output, with each counted token timed (TTFT for the
    /// first, ITL after).
    fn on_event(&mut self, ev: TokenEventKind) -> Result<Produced, ApiError> {
        let out = self.text.on_event(ev)?;
        if out.counted {
            let now = Instant::now();
            match self.last {
                None => {
                    let d = now - self.t0;
                    metrics::histogram!("flotilla_ttft_seconds").record(d.as_secs_f64());
                    if let Some(c) = &self.class {
                        metrics::histogram!("flotilla_class_ttft_seconds", "class" => c.to_string())
                            .record(d.as_secs_f64());
                    }
                    self.stats.signals().first_token(d.as_secs_f64() * 1000.0);
                }
                Some(prev) => {
                    let d = now - prev;
                    metrics::histogram!("flotilla_itl_seconds").record(d.as_secs_f64());
                    self.stats.signals().next_token(d.as_secs_f64() * 1000.0);
                }
            }
            self.last = Some(now);
        }
        Ok(out)
    }
}

struct Started {
    api: Api,
    kind: RequestKind,
    stream: bool,
    include_usage: bool,
    meta: ResponseMeta,
    /// Each prompt's length in tokens, in the request's order.
    prompt_tokens: Vec<u32>,
    choices: Vec<Choice>,
    rx: mpsc::UnboundedReceiver<(u32, TokenEventKind)>,
    pending: Vec<(u32, TokenEventKind)>,
    guard: CancelGuard,
    t0: Instant,
    /// Counted in `/metrics` already ([`Started::record`]); until then, dropping it counts
    /// the request as `cancelled` (its client went away).
    recorded: bool,
    /// Its priority class, if classes are configured.
    class: Option<Arc<str>>,
}

async fn spawn_choice(
    serving: &Serving,
    stats: &Arc<NodeStats>,
    policy: Option<Policy>,
    job: Job,
    index: u32,
    merged: mpsc::UnboundedSender<(u32, TokenEventKind)>,
) -> Result<ActorRef<RequestMsg>, ApiError> {
    let sup: ActorRef<SupervisorMsg> = ractor::registry::where_is(serving.request_sup.clone())
        .ok_or(RequestError::GatewayRestarting)?
        .into();
    let name = format!("{}/request-{}", serving.node, job.request);
    let args = RequestArgs {
        job: job.clone(),
        registry: serving.registry.clone(),
        // Straight into the handler's channel: no relay task between.
        events: merged,
        choice: index,
        ids: serving.next_id.clone(),
        migration: serving.migration,
        clock: serving.clock.clone(),
        block_size: serving.block_size,
        salt: serving.frontend.salt,
        policy,
        stats: stats.clone(),
        pin: serving.pin.clone(),
        bus: serving.bus.clone(),
        span: tracing::Span::current(),
    };
    let spec = ChildSpec::actor(format!("request-{}", job.request), Some(name), move || {
        (Request, args.clone())
    })
    .restart(Restart::Temporary)
    .shutdown(Shutdown::Timeout(Duration::from_secs(1)));
    let cell = ractor::call!(sup, SupervisorMsg::StartChild, spec)
        .map_err(|_| RequestError::GatewayRestarting)?
        .map_err(|e| {
            tracing::error!(error = %e, "request actor failed to start");
            RequestError::StartFailed
        })?;
    Ok(cell.into())
}

/// The intake, stage by stage (`request_plane/intake.rs` lists them): parse → admit →
/// validate → tokenize → place, then each choice's first event.
async fn start(
    s: &GatewayShared,
    api: Api,
    headers: &HeaderMap,
    body: Body,
) -> Result<Started, ApiError> {
    let kind = api.kind();
    let t0 = Instant::now();
    let serving = s.serving.as_ref().ok_or(RequestError::NoModel)?;
    let parsed = intake::parse(s, serving, api, headers, body).await?;
    let admitted = intake::admit(s, serving, parsed)?;
    let valid = intake::validate(serving, api, headers, admitted)?;
    let fe = &serving.frontend;
    let tok = crate::request_plane::intake::tokenize(fe, &valid.req)?;
    intake::wait_for_capacity(s, serving).await?;
    let intake::Valid {
        req,
        class,
        policy,
        session,
        ..
    } = valid;
    let total = tok.prompts.len() as u64 * u64::from(req.n);
    let first_id = serving.next_id.fetch_add(total, Ordering::Relaxed);
    let placement = Placement {
        reply_to: serving.node.clone(),
        owner_incarnation: serving.incarnation,
        waiting_since_ms: serving.clock.wall_ms(),
        first_id,
        trace_id: super::edge::request_id(headers),
        // The `request` span (current here) as the trace the router and workers join.
        traceparent: crate::runtime::otlp::current_traceparent(),
        class: class.as_ref().map(|c| c.tag.clone()),
        session,
    };
    let (merged_tx, rx) = mpsc::unbounded_channel();
    let mut guard = CancelGuard(Vec::new());
    let mut choices = Vec::new();
    let class_name: Option<Arc<str>> = class.as_ref().map(|c| Arc::from(c.tag.name.as_str()));
    for plan in submissions(&req, &tok, &placement) {
        let p = plan.prompt;
        let prompt_len = plan.submit.prompt.len() as u64;
        let tx = merged_tx.clone();
        guard
            .0
            .push(spawn_choice(serving, &s.stats, policy, plan.submit, plan.index, tx).await?);
        let echo_text = match req.input.prompts().get(p) {
            Some(Input::Text(t)) => Some(t.as_str()),
            _ => None,
        };
        let text = ChoiceText::new(
            TokRef(fe.tokenizer.clone()),
            ChoiceSpec {
                prompt_ids: &tok.prompts[p],
                prompt: p,
                echo: req.echo.then_some(echo_text),
                stop: &req.stop,
                logprobs: req.logprobs.is_some(),
                token_ids: req.return_token_ids,
                prompt_only: req.prompt_only(),
            },
        );
        choices.push(Choice {
            text,
            t0,
            last: None,
            stats: s.stats.clone(),
            class: class_name.clone(),
        });
        s.stats.signals().arrived(prompt_len);
    }
    drop(merged_tx);
    let unique = format!("{}-{first_id}", serving.node);
    let mut started = Started {
        api,
        kind,
        stream: req.stream,
        include_usage: req.include_usage,
        meta: ResponseMeta {
            id: match api {
                Api::Messages => anthropic::response::message_id(unique),
                _ => response::response_id(kind, unique),
            },
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default(),
            model: fe.model_id.clone(),
        },
        prompt_tokens: tok.prompt_tokens(),
        choices,
        rx,
        pending: Vec::new(),
        guard,
        t0,
        recorded: false,
        class: class_name,
    };
    // Each choice's first event decides between an HTTP error and a response (a refusal
    // here is counted as `rejected` by `generate`, not by `Started`'s drop).
    let mut heard = vec![false; started.choices.len()];
    while heard.iter().any(|h| !h) {
        let (i, ev) = started
            .rx
            .recv()
            .await
            .ok_or(RequestError::EndedUnexpectedly)
            .inspect_err(|_| started.recorded = true)?;
        match ev {
            TokenEventKind::Failed { message, status } => {
                started.recorded = true;
                return Err(RequestError::from_failed(message, status).into());
            }
            TokenEventKind::Lost { reason } => {
                started.recorded = true;
                return Err(RequestError::Lost(reason).into());
            }
            _ => {}
        }
        heard[i as usize] = true;
        started.pending.push((i, ev));
    }
    Ok(started)
}

fn usage_of(st: &Started) -> Usage {
    Usage {
        prompt_tokens: st.prompt_tokens.iter().sum(),
        completion_tokens: st.choices.iter().map(|c| c.text.completion_tokens).sum(),
        cached_tokens: cached_per_prompt(st).iter().map(|(_, c)| c).sum(),
    }
}

/// Each prompt's cached tokens with the worker that reported them: its first choice's first
/// admission (every choice of a prompt has the same prompt), never more than the prompt, so
/// that a hit rate built from the two counters stays within 100 %.
fn cached_per_prompt(st: &Started) -> Vec<(&str, u32)> {
    st.prompt_tokens
        .iter()
        .enumerate()
        .map(|(p, &len)| {
            let first = st.choices.iter().find(|c| c.text.prompt == p);
            let worker = first
                .and_then(|c| c.text.workers.first())
                .map_or("-", String::as_str);
            (worker, first.map_or(0, |c| c.text.cached_tokens).min(len))
        })
        .collect()
}

/// The workers of every choice, comma-separated, each once, in order (`-`: none).
fn workers_of(st: &Started) -> String {
    let mut all: Vec<&str> = Vec::new();
    for w in st.choices.iter().flat_map(|c| &c.text.workers) {
        if !all.contains(&w.as_str()) {
            all.push(w);
        }
    }
    if all.is_empty() {
        "-".to_owned()
    } else {
        all.join(",")
    }
}

impl Started {
    fn route(&self) -> &'static str {
        self.api.route()
    }

    /// Counts a request that reached its workers, once, at its end: `outcome` `ok`, `error`
    /// (failed after it was admitted) or `cancelled` (its client went away), `status` the HTTP
    /// status its response carried (a stream's is 200 whatever its outcome). The token
    /// counters count `ok` requests only, exactly the `usage` the API returned (or, for a
    /// stream without `include_usage`, would have returned): per request, each prompt once
    /// whatever `n`, completion tokens summed over the choices, cached tokens as `usage`
    /// reports them (counted per prompt under the worker that admitted its first choice). A
    /// streamed request also gets its access line here (`edge.rs`
    /// [`access_log`](super::edge::access_log) logs every other request when its response is
    /// ready).
    fn record(&mut self, outcome: &'static str, status: u16) {
        if std::mem::replace(&mut self.recorded, true) {
            return;
        }
        let usage = usage_of(self);
        if self.stream {
            tracing::info!(
                target: super::edge::ACCESS_TARGET,
                status,
                duration_ms = self.t0.elapsed().as_secs_f64() * 1e3,
                outcome,
                workers = %workers_of(self),
                prompt_tokens = usage.prompt_tokens,
                completion_tokens = usage.completion_tokens,
                "request done"
            );
        }
        metrics::counter!("flotilla_requests_total", "route" => self.route(), "outcome" => outcome, "status" => status.to_string())
            .increment(1);
        metrics::histogram!("flotilla_e2e_latency_seconds").record(self.t0.elapsed().as_secs_f64());
        if let Some(c) = &self.class {
            metrics::counter!("flotilla_class_requests_total", "class" => c.to_string(), "outcome" => outcome)
                .increment(1);
            if outcome == "ok" {
                metrics::counter!("flotilla_class_prompt_tokens_total", "class" => c.to_string())
                    .increment(u64::from(usage.prompt_tokens));
                metrics::counter!("flotilla_class_completion_tokens_total", "class" => c.to_string())
                    .increment(u64::from(usage.completion_tokens));
            }
        }
        if outcome == "ok" {
            metrics::counter!("flotilla_prompt_tokens_total")
                .increment(u64::from(usage.prompt_tokens));
            metrics::counter!("flotilla_completion_tokens_total")
                .increment(u64::from(usage.completion_tokens));
            // Each prompt's, under the worker that reported them (its first choice's first).
            for (worker, cached) in cached_per_prompt(self) {
                metrics::counter!("flotilla_prefix_hit_tokens_total", "worker" => worker.to_owned())
                    .increment(u64::from(cached));
            }
        }
        for c in &self.choices {
            c.stats.signals().finished(
                u64::from(c.text.completion_tokens),
                u64::from(c.text.cached_tokens),
            );
        }
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        // The client went away before the end: no response (499, as proxies log it) or a
        // stream cut short (200).
        let status = if self.stream { 200 } else { 499 };
        self.record("cancelled", status);
    }
}

/// A non-streamed request to its end, counted once: `ok`, or `error` with the status of the
/// error response (a request already admitted is never counted as `rejected`).
async fn collect(mut st: Started) -> Response {
    match collect_choices(&mut st).await {
        Ok(outputs) => {
            let usage = usage_of(&st);
            st.record("ok", 200);
            let body = match (st.api, outputs.first()) {
                (Api::Messages, Some(out)) => {
                    let stop = st
                        .choices
                        .first()
                        .and_then(|c| c.text.stop_sequence.as_deref());
                    anthropic::response::message_body(
                        &st.meta.id,
                        &st.meta.model,
                        &out.text,
                        &anthropic::response::Ending::of(out.finish_reason, stop),
                        (&usage).into(),
                    )
                }
                _ => response::completion_body(st.kind, &st.meta, &outputs, &usage),
            };
            let mut res = Json(body).into_response();
            res.extensions_mut()
                .insert(super::edge::AccessWorkers(workers_of(&st)));
            res
        }
        Err(e) => {
            st.record("error", st.api.status(&e));
            st.api.error_response(&e)
        }
    }
}

/// Every choice's output, once each has finished.
async fn collect_choices(st: &mut Started) -> Result<Vec<ChoiceOutput>, ApiError> {
    let n = st.choices.len();
    let mut texts = vec![String::new(); n];
    let mut lps: Vec<Vec<TokenLogprob>> = vec![Vec::new(); n];
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut queue = std::mem::take(&mut st.pending);
    loop {
        if st.choices.iter().all(|c| c.text.finish.is_some()) {
            break;
        }
        let (i, ev) = if queue.is_empty() {
            st.rx.recv().await.ok_or(RequestError::EndedUnexpectedly)?
        } else {
            queue.remove(0)
        };
        let p = st.choices[i as usize].on_event(ev)?;
        let c = &st.choices[i as usize];
        if c.text.finish.is_some()
            && let Some(r) = st.guard.0.get(i as usize)
        {
            let _ = r.cast(RequestMsg::Cancel); // a stop string may have ended it early
        }
        texts[i as usize].push_str(&p.text);
        lps[i as usize].extend(p.logprobs);
        ids[i as usize].extend(p.token_ids);
    }
    let outputs: Vec<ChoiceOutput> = st
        .choices
        .iter()
        .enumerate()
        .map(|(i, c)| ChoiceOutput {
            text: std::mem::take(&mut texts[i]),
            finish_reason: c.text.finish.unwrap_or(FinishReason::Stop),
            logprobs: c.text.want_logprobs.then(|| std::mem::take(&mut lps[i])),
            token_ids: c.text.want_ids.then(|| std::mem::take(&mut ids[i])),
        })
        .collect();
    Ok(outputs)
}

fn stream(st: Started, keep_alive: Duration) -> Response {
    let events = async_stream::stream! {
        let mut st = st;
        let mut out = StreamOut::new(&st);
        let mut queue = std::mem::take(&mut st.pending);
        // Admissions first (they carry no text), so that an opening record (Anthropic's
        // `message_start`) carries the cached tokens.
        let admitted = queue
            .iter()
            .take_while(|(_, ev)| matches!(ev, TokenEventKind::Admitted { .. }))
            .count();
        for (i, ev) in queue.drain(..admitted) {
            if let Err(e) = st.choices[i as usize].on_event(ev) {
                yield Ok::<_, std::convert::Infallible>(st.api.error_event(&e));
                st.record("error", 200);
                return;
            }
        }
        for record in out.open(&usage_of(&st)) {
            yield Ok(record);
        }
        loop {
            if st.choices.iter().all(|c| c.text.finish.is_some()) {
                break;
            }
            let next = if queue.is_empty() {
                st.rx.recv().await
            } else {
                Some(queue.remove(0))
            };
            let Some((i, ev)) = next else {
                yield Ok(st.api.error_event(&RequestError::EndedUnexpectedly.into()));
                st.record("error", 200);
                return;
            };
            let p = match st.choices[i as usize].on_event(ev) {
                Ok(p) => p,
                Err(e) => {
                    yield Ok(st.api.error_event(&e));
                    st.record("error", 200);
                    return;
                }
            };
            if let Some(record) = out.produced(i, &p) {
                yield Ok(record);
            }
            if st.choices[i as usize].text.finish.is_some() {
                if let Some(r) = st.guard.0.get(i as usize) {
                    let _ = r.cast(RequestMsg::Cancel);
                }
                if let Some(record) = out.finished(i, &st.choices[i as usize]) {
                    yield Ok(record);
                }
            }
        }
        let usage = usage_of(&st);
        st.record("ok", 200);
        for record in out.close(&usage) {
            yield Ok(record);
        }
    };
    Sse::new(events)
        .keep_alive(sse::keep_alive(keep_alive))
        .into_response()
}

async fn generate(s: Arc<GatewayShared>, api: Api, headers: HeaderMap, body: Body) -> Response {
    let route = api.route();
    // Refused before any worker saw it (400, 404, 413, 415, 503, …): `rejected`, with its
    // status. From here on `Started` counts the request, once.
    let started = async {
        super::edge::require_json(&headers)?;
        start(&s, api, &headers, body).await
    }
    .await;
    let st = match started {
        Ok(st) => st,
        Err(e) => {
            let status = api.status(&e);
            metrics::counter!("flotilla_requests_total", "route" => route, "outcome" => "rejected", "status" => status.to_string())
                .increment(1);
            tracing::debug!(status, error = %e.message, "request refused");
            return api.error_response(&e);
        }
    };
    tracing::debug!(
        choices = st.choices.len(),
        stream = st.stream,
        "request admitted"
    );
    if st.stream {
        let keep_alive = s
            .serving
            .as_ref()
            .map(|v| v.keep_alive)
            .unwrap_or(Duration::from_secs(10));
        stream(st, keep_alive)
    } else {
        collect(st).await
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(s): State<Arc<GatewayShared>>, headers: HeaderMap, body: Body) -> Response {
    generate(s, Api::Chat, headers, body).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(s, Api::Completions, headers, body).await
}

/// `POST /v1/messages` (Anthropic's Messages API; shapes in `crate::anthropic`).
pub async fn messages(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(s, Api::Messages, headers, body).await
}

/// `POST /v1/messages/count_tokens` (Anthropic's token counting): `{"input_tokens": N}`, the
/// prompt tokens a Messages request with these `model`, `system` and `messages` would run
/// (the same chat template; body rules in `anthropic::request::parse_count_tokens_request`).
/// Only this gateway's tokenizer is used: no worker is asked, nothing is admitted or counted
/// as a request. Errors in Anthropic's shape (400 naming the field, 404 unknown model, 413,
/// 415, 408 as on `/v1/messages`).
pub async fn messages_count_tokens(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let counted = async {
        super::edge::require_json(&headers)?;
        let serving = s.serving.as_ref().ok_or(RequestError::NoModel)?;
        let bytes = read_body(&headers, body, s.max_body_bytes, s.request_body_timeout).await?;
        let req = anthropic::request::parse_count_tokens_request(&bytes)?;
        let fe = &serving.frontend;
        check_model(&req.model, &[fe.model_id.as_str()])?;
        let ids = fe.prompts_ids(&req)?;
        Ok::<usize, ApiError>(ids.iter().map(Vec::len).sum())
    }
    .await;
    match counted {
        Ok(n) => Json(serde_json::json!({ "input_tokens": n })).into_response(),
        Err(e) => anthropic::error::response(&e),
    }
}

/// `GET /v1/models`.
pub async fn models(State(s): State<Arc<GatewayShared>>) -> Response {
    let data: Vec<_> = s
        .serving
        .iter()
        .map(|v| v.frontend.model_object())
        .collect();
    Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}`.
pub async fn model(State(s): State<Arc<GatewayShared>>, Path(id): Path<String>) -> Response {
    match s.serving.as_ref().filter(|v| v.frontend.model_id == id) {
        Some(v) => Json(v.frontend.model_object()).into_response(),
        None => model_not_found(&id).into_response(),
    }
}

/// Requests in flight on this gateway.
pub fn in_flight(serving: &Serving) -> usize {
    serving.registry.len()
}
