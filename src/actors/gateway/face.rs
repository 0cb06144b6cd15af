//! A worker's own HTTP face (`worker.http`): one replica seen as a single OpenAI-compatible
//! server, so that routers built for vLLM or SGLang servers (`sglang-router`, `vllm-router`,
//! Dynamo's frontend in HTTP mode) can route over Flotilla workers, and be measured against
//! Flotilla's own router on the same engines.
//!
//! It is the gateway's code with one difference: every request is *pinned* to this replica
//! (`RequestArgs::pin`), no router is asked. The replica's supervision still holds: a request
//! whose replica restarts waits for it (within `gateway.migration_deadline_ms`) and resumes
//! there; a draining node answers 503. Admission sheds only on draining and
//! `gateway.max_in_flight` (an engine queues what it cannot run yet, as vLLM does).
//!
//! Routes (besides the gateway's `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models[/{id}]`, `/live`):
//! - `GET /health`: 200 `{"status":"ready"}` while the replica is routable (alive, healthy,
//!   not draining), else 503 with `not_ready`, `draining` or `unhealthy`.
//! - `GET /metrics`: Prometheus text with vLLM's names for this replica
//!   (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
//!   and its older name `vllm:gpu_cache_usage_perc`, a fraction 0–1, labelled `model_name`),
//!   as of the node's last heartbeat (≤ `cluster.heartbeat_interval_ms` old).
//! - `GET /get_load`: `{"load", "num_reqs", "num_waiting_reqs", "num_tokens"}` (requests in
//!   flight, running + waiting, waiting, KV tokens in use).
//! - `GET /server_info` and `/get_server_info` (SGLang's): model name and path, `page_size`
//!   (tokens per block), `max_total_num_tokens` (the KV pool), `dp_size`/`tp_size` 1, and
//!   `kv_events_endpoint` when the replica publishes vLLM-format KV events.
//! - `GET /model_info` and `/get_model_info` (SGLang's): `model_path`, `is_generation`.
//! - `POST /tokenize` (vLLM's): `{"prompt"}` or `{"messages"}` → `{"tokens", "count",
//!   "max_model_len"}`.
//! - `POST /v1/chat/completions/render`, `POST /v1/completions/render` (what `vllm-router`'s
//!   `cache_aware` and `kv_aware` policies call on every worker to learn a request's prompt
//!   tokens): the request body → `{"token_ids": [...]}` (the chat template applied).
//!
//! Errors are the gateway's: the OpenAI error shape, 400 for a body that is not a valid
//! request, 404 for another model, 413 past `gateway.max_body_bytes`, 503 while the replica
//! is away.

use super::serve;
use super::state::{FaceInfo, GatewayShared};
use crate::control::discovery::membership::{NodeState, WorkerHealth, WorkerView};
use crate::openai::error::{ApiError, ErrorKind};
use crate::openai::request::{RequestKind, check_model, parse_request};
use crate::runtime::ids::WorkerId;
use crate::worker::scheduler::ROUTABLE_GROUP;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::sync::Arc;

impl FaceInfo {
    fn kv_events_endpoint(&self) -> Option<String> {
        self.kv_events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|a| format!("tcp://{a}"))
    }
}

/// The face's routes (see the module doc).
pub fn app(shared: Arc<GatewayShared>) -> Router {
    let app = Router::new()
        .route("/v1/chat/completions", post(serve::chat))
        .route("/v1/completions", post(serve::completions))
        .route("/v1/models", get(serve::models))
        .route("/v1/models/{id}", get(serve::model))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/completions/render", post(render_completion))
        .route("/tokenize", post(tokenize))
        .route("/live", get(super::edge::live))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/get_load", get(load))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .fallback(super::edge::not_found)
        .method_not_allowed_fallback(super::edge::method_not_allowed)
        .with_state(shared);
    super::edge::with_request_ids(app)
}

fn face(s: &GatewayShared) -> Result<&FaceInfo, ApiError> {
    s.face
        .as_deref()
        .ok_or_else(|| ApiError::new(ErrorKind::Internal, "not a worker face"))
}

/// This replica as of the node's last heartbeat.
fn view(s: &GatewayShared, worker: &WorkerId) -> Option<WorkerView> {
    let fleet = s.fleet.latest()?;
    fleet
        .iter()
        .filter(|n| n.state == NodeState::Up)
        .flat_map(|n| &n.workers)
        .find(|w| w.id == worker.as_str())
        .cloned()
}

async fn health(State(s): State<Arc<GatewayShared>>) -> Response {
    let Ok(f) = face(&s) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let routable =
        crate::runtime::cluster::member_named(ROUTABLE_GROUP, &format!("{}/scheduler", f.worker))
            .is_some();
    let word = if s.stats.draining() {
        "draining"
    } else if routable {
        "ready"
    } else if view(&s, &f.worker).is_some_and(|w| w.health == WorkerHealth::Unhealthy) {
        "unhealthy"
    } else {
        "not_ready"
    };
    super::edge::readiness(word, json!({"worker": f.worker.as_str()}))
}

fn model_id(s: &GatewayShared) -> String {
    s.serving
        .as_ref()
        .map(|v| v.frontend.model_id.clone())
        .unwrap_or_default()
}

/// Prometheus label value escaping (backslash, quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

async fn metrics(State(s): State<Arc<GatewayShared>>) -> Response {
    let Ok(f) = face(&s) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let w = view(&s, &f.worker).unwrap_or_default();
    let usage = if w.kv_blocks_total > 0 {
        w.kv_blocks_used as f64 / w.kv_blocks_total as f64
    } else {
        0.0
    };
    let l = format!("model_name=\"{}\"", label(&model_id(&s)));
    let mut out = String::new();
    for (name, help, kind, value) in [
        (
            "vllm:num_requests_running",
            "Requests in the running batch.",
            "gauge",
            w.running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Requests waiting to be admitted.",
            "gauge",
            w.waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 = full.",
            "gauge",
            usage,
        ),
        (
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage, 1 = full (the older name).",
            "gauge",
            usage,
        ),
    ] {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{l}}} {value}\n"
        ));
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        out,
    )
        .into_response()
}

async fn load(State(s): State<Arc<GatewayShared>>) -> Result<Json<serde_json::Value>, ApiError> {
    let f = face(&s)?;
    let w = view(&s, &f.worker).unwrap_or_default();
    Ok(Json(json!({
        "load": w.in_flight,
        "num_reqs": w.running + w.waiting,
        "num_waiting_reqs": w.waiting,
        "num_tokens": w.kv_blocks_used * f.block_size,
    })))
}

async fn server_info(
    State(s): State<Arc<GatewayShared>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let f = face(&s)?;
    let w = view(&s, &f.worker).unwrap_or_default();
    Ok(Json(json!({
        "served_model_name": model_id(&s),
        "model_path": f.model_path,
        // The tokenizer is inside the model file (GGUF); a path other routers would try to
        // load as a Hugging Face tokenizer is not given.
        "tokenizer_path": serde_json::Value::Null,
        "worker": f.worker.as_str(),
        "dp_size": 1,
        "tp_size": 1,
        "page_size": f.block_size,
        "disaggregation_mode": "null",
        "max_total_num_tokens": w.kv_blocks_total * f.block_size,
        "kv_events_endpoint": f.kv_events_endpoint(),
    })))
}

async fn model_info(
    State(s): State<Arc<GatewayShared>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let f = face(&s)?;
    Ok(Json(json!({
        "model_path": f.model_path,
        "served_model_name": model_id(&s),
        "is_generation": true,
    })))
}

/// The prompt token ids of a request body (chat template applied), after the gateway's
/// checks: size, JSON, a valid request, the served model.
async fn prompt_of(
    s: &GatewayShared,
    kind: RequestKind,
    headers: &HeaderMap,
    body: Body,
) -> Result<Vec<u32>, ApiError> {
    super::edge::require_json(headers)?;
    let serving = s
        .serving
        .as_ref()
        .ok_or(crate::request_plane::error::RequestError::NoModel)?;
    let bytes = serve::read_body(headers, body, s.max_body_bytes, s.request_body_timeout).await?;
    let req = parse_request(kind, &bytes)?;
    check_model(&req.model, &[serving.frontend.model_id.as_str()])?;
    serving.frontend.prompt_ids(&req)
}

async fn render_chat(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let ids = prompt_of(&s, RequestKind::Chat, &headers, body).await?;
    Ok(Json(json!({ "token_ids": ids })))
}

async fn render_completion(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let ids = prompt_of(&s, RequestKind::Completion, &headers, body).await?;
    Ok(Json(json!({ "token_ids": ids })))
}

/// vLLM's `/tokenize`: `{"prompt"}` or `{"messages"}` (the model may be left out).
async fn tokenize(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    super::edge::require_json(&headers)?;
    let serving = s
        .serving
        .as_ref()
        .ok_or(crate::request_plane::error::RequestError::NoModel)?;
    let bytes = serve::read_body(&headers, body, s.max_body_bytes, s.request_body_timeout).await?;
    let mut v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    let Some(obj) = v.as_object_mut() else {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            "the body must be a JSON object",
        ));
    };
    let kind = if obj.contains_key("messages") {
        RequestKind::Chat
    } else {
        RequestKind::Completion
    };
    obj.entry("model")
        .or_insert_with(|| serving.frontend.model_id.clone().into());
    let req = parse_request(kind, &serde_json::to_vec(&v).unwrap_or_default())?;
    check_model(&req.model, &[serving.frontend.model_id.as_str()])?;
    let ids = serving.frontend.prompt_ids(&req)?;
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": serving.frontend.context_len,
        "tokens": ids,
    })))
}
