//! The external engine's actor: a scheduler-shaped proxy of one engine outside the fleet
//! (`router.external_workers`). It speaks [`SchedulerMsg`] to the cluster and HTTP to the
//! engine; what it does, and what goes wrong, is described in [`crate::worker::external`].

use crate::actors::kv_publisher::KvPublisherMsg;
use crate::actors::scheduler::SchedulerMsg;
use crate::kv::vllm::{Translator, VllmEvent};
use crate::kv::zmq::ZmqSubscriber;
use crate::request_plane::protocol::{self, Owner, TokenEvent, TokenEventKind};
use crate::runtime::ids::{NodeId, RequestId, WorkerId};
use crate::runtime::wire::Wire;
use crate::worker::external::{
    CONNECT_TIMEOUT, EngineLoad, ExternalArgs, HEALTH_INTERVAL, HEALTH_TIMEOUT, KV_USAGE_SCALE,
    StreamDecoder, UNHEALTHY_AFTER, completion_body, parse_metrics,
};
use crate::worker::scheduler::{Health, ROUTABLE_GROUP, SCHEDULER_GROUP, SchedulerStats};
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;
use tokio::task::JoinHandle;

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
        state.args.board.remove(&state.args.worker);
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
        let changes = msg.may_change_stats();
        let out = handle_msg(myself, msg, state).await;
        if changes {
            let stats = state.stats();
            state.args.board.publish(stats);
        }
        out
    }
}

/// One message (see [`ExternalEngine`]'s `handle`, which publishes the stats after it).
async fn handle_msg(
    myself: ActorRef<SchedulerMsg>,
    msg: SchedulerMsg,
    state: &mut ExternalState,
) -> Result<(), ActorProcessingErr> {
    match msg {
        SchedulerMsg::Submit(wire) => {
            let Ok(job) = wire.decode() else {
                return Ok(());
            };
            let owner = job.owner();
            if job.sampling.echo_tokens > 0 {
                // Prompt log-probabilities are not read from an external engine's stream.
                let ev = TokenEventKind::Failed {
                    message: "echo is not supported by this worker's engine (an external \
                              engine): prompt log-probabilities are computed by Flotilla's \
                              own workers only"
                        .into(),
                    status: 400,
                };
                deliver(&owner, job.request, vec![ev]);
                return Ok(());
            }
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
        SchedulerMsg::Export(_, reply) => {
            // Its KV lives in the external engine: nothing a peer can read.
            let answer: Result<crate::request_plane::protocol::RemoteKv, String> = Err(format!(
                "{} is an external engine: it exports no KV",
                state.args.worker
            ));
            let _ = reply.send(Wire::encode(&answer));
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
        SchedulerMsg::StepDone(_)
        | SchedulerMsg::CanaryDone(_)
        | SchedulerMsg::Kick(_)
        | SchedulerMsg::PullDone(_)
        | SchedulerMsg::CopiesDone(_)
        | SchedulerMsg::FetchDone(_) => {}
    }
    Ok(())
}
