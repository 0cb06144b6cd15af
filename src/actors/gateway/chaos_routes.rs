//! The chaos API on the gateway: `POST /chaos/faults`, `GET /chaos/faults`,
//! `DELETE /chaos/faults/{id}` (see `control/chaos.rs` for what faults do). Present only when
//! `chaos.enabled`; when `chaos.token` is set every call needs `Authorization: Bearer <token>`
//! (configuration refuses a gateway beyond loopback with chaos on and no token). The routes sit
//! behind `edge::control_guard` (foreign `Origin`/`Host`: 403); a POST needs
//! `Content-Type: application/json` (415).

use super::state::{ChaosController, FaultRecord, GatewayShared};
use crate::actors::chaos::{ChaosMsg, find_chaos};
use crate::control::chaos::{ActorKind, FaultKind, FaultSpec, Injection, Target};
use crate::control::discovery::membership::{NodeState, NodeView};
use crate::openai::error::{ApiError, ErrorKind};
use crate::runtime::ids::WorkerId;
use crate::runtime::role::NodeRole;
use crate::runtime::wire::Wire;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The `[chaos]` section: the chaos API (fault injection), off by default. Whether a gateway
/// beyond loopback may serve it without a token is a rule across sections, checked by the
/// node's configuration (`chaos.token`).
#[derive(
    Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct ChaosConfig {
    /// Serve `/chaos/faults` on the gateway.
    pub enabled: bool,
    /// Bearer token the chaos routes require; mandatory when the gateway listens beyond
    /// loopback.
    pub token: Option<String>,
}

/// How long the API waits for a node to confirm a fault installed or cleared (ms).
pub const ACK_TIMEOUT_MS: u64 = 2_000;
/// Largest fault description accepted (bytes); beyond, 413 in the OpenAI error shape.
pub const MAX_FAULT_BYTES: usize = 64 * 1024;
/// Largest accepted `slow` delay (ms): 10 minutes.
pub const MAX_DELAY_MS: u64 = 600_000;
/// Longest partition (ms): 10 minutes. The far side of a cut cannot be reached to heal it
/// early, so every partition must end by itself.
pub const MAX_PARTITION_MS: u64 = 600_000;

impl ChaosController {
    /// A controller; `token`: the bearer token every call must present, if any.
    pub fn new(token: Option<String>) -> Self {
        Self {
            // Ids never repeat across restarts: they start at the start time (ms since the
            // Unix epoch) × 1000, below 2^53 so JSON clients read them exactly.
            next_id: AtomicU64::new(crate::runtime::clock::unix_ms().saturating_mul(1000).max(1)),
            faults: Mutex::new(Vec::new()),
            token,
        }
    }

    /// Whether a bearer token guards the API.
    pub fn has_token(&self) -> bool {
        self.token.as_deref().is_some_and(|t| !t.is_empty())
    }

    /// The records, timed faults past their end marked inactive (their nodes ended them).
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<FaultRecord>> {
        let mut faults = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        for f in faults.iter_mut().filter(|f| f.active) {
            if f.ends_at.is_some_and(|t| t <= now) {
                f.active = false;
            }
        }
        faults
    }

    /// Clear fault `id` on every node it hit; false when unknown or already cleared.
    /// Returns once every node it reaches has removed it (at most [`ACK_TIMEOUT_MS`] each).
    pub async fn clear(&self, id: u64) -> bool {
        let hit = {
            let mut faults = self.lock();
            match faults.iter_mut().find(|f| f.id == id && f.active) {
                Some(f) => {
                    f.active = false;
                    f.nodes.clone()
                }
                None => return false,
            }
        };
        for node in &hit {
            if let Some(c) = find_chaos(node) {
                let _ = ractor::call_t!(c, ChaosMsg::ClearAck, ACK_TIMEOUT_MS, Wire::encode(&id));
            }
        }
        true
    }
}

fn nodes_of(workers: &[WorkerId]) -> BTreeMap<String, Vec<WorkerId>> {
    let mut by_node: BTreeMap<String, Vec<WorkerId>> = BTreeMap::new();
    for w in workers {
        let node = w.as_str().split('/').next().unwrap_or_default().to_owned();
        by_node.entry(node).or_default().push(w.clone());
    }
    by_node
}

/// A partition's side: known nodes, without repeats, neither empty nor everyone.
fn check_partition(nodes: &mut Vec<String>, fleet: &[NodeView]) -> Result<(), ApiError> {
    nodes.sort();
    nodes.dedup();
    let bad = |m: String| Err(ApiError::new(ErrorKind::InvalidRequest, m).param("nodes"));
    if let Some(n) = nodes
        .iter()
        .find(|n| !fleet.iter().any(|v| v.id.as_str() == n.as_str()))
    {
        return bad(format!("unknown node {n:?}"));
    }
    let up = fleet.iter().filter(|v| v.state == NodeState::Up).count();
    if nodes.is_empty() || nodes.len() >= fleet.len().max(up) {
        return bad("`nodes` must name one side of the cut: at least one node, not all".into());
    }
    Ok(())
}

/// A node-wide `kill_actor` must name an actor that every node it hits runs (by the node's
/// roles), whatever the target: a worker target or `any_busy` hits the worker's node, and a
/// worker node runs no `http_gateway`, `token_sink` or `router`.
fn check_kill_actor(
    kind: &FaultKind,
    hit: &BTreeMap<String, Vec<WorkerId>>,
    fleet: &[NodeView],
) -> Result<(), ApiError> {
    let FaultKind::KillActor { actor } = kind else {
        return Ok(());
    };
    let role = match actor {
        ActorKind::Router => NodeRole::Router,
        ActorKind::HttpGateway | ActorKind::TokenSink => NodeRole::Gateway,
        ActorKind::WorkerPool => NodeRole::Worker,
        _ => return Ok(()),
    };
    for node in hit.keys() {
        if let Some(v) = fleet.iter().find(|v| v.id.as_str() == node)
            && !v.roles.contains(&role)
        {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                format!("node {node} runs no {actor} (roles {:?})", v.roles),
            )
            .param("actor"));
        }
    }
    Ok(())
}

/// The nodes a fault acts on, each with the workers it hits there. Node-wide kinds
/// (`kill_node`, `kill_actor` of a node actor) also reach a node without workers when the
/// target names it.
fn resolve_nodes(
    kind: &FaultKind,
    target: &Target,
    fleet: &[NodeView],
) -> BTreeMap<String, Vec<WorkerId>> {
    if matches!(kind, FaultKind::Partition { .. }) {
        // Every node filters its side of the cut.
        return fleet
            .iter()
            .filter(|n| n.state == NodeState::Up)
            .map(|n| {
                let ws = n
                    .workers
                    .iter()
                    .map(|w| WorkerId::new(w.id.clone()))
                    .collect();
                (n.id.to_string(), ws)
            })
            .collect();
    }
    let mut by_node = nodes_of(&resolve(target, fleet));
    let node_wide = match kind {
        FaultKind::KillNode | FaultKind::PanicTask => true,
        FaultKind::KillActor { actor } => actor.is_node_wide(),
        _ => false,
    };
    if node_wide
        && let Target::Node(n) = target
        && fleet.iter().any(|v| v.id == *n && v.state == NodeState::Up)
    {
        by_node.entry(n.to_string()).or_default();
    }
    by_node
}

fn resolve(target: &Target, fleet: &[NodeView]) -> Vec<WorkerId> {
    let live = fleet.iter().filter(|n| n.state == NodeState::Up);
    match target {
        Target::Worker(w) => live
            .flat_map(|n| &n.workers)
            .filter(|x| x.id == w.as_str())
            .map(|x| WorkerId::new(x.id.clone()))
            .collect(),
        Target::Node(node) => live
            .filter(|n| n.id == *node)
            .flat_map(|n| &n.workers)
            .map(|x| WorkerId::new(x.id.clone()))
            .collect(),
        Target::AnyBusy => live
            .flat_map(|n| &n.workers)
            .filter(|x| x.running + x.waiting > 0)
            .max_by_key(|x| x.running + x.waiting)
            .map(|x| vec![WorkerId::new(x.id.clone())])
            .unwrap_or_default(),
    }
}

fn controller(s: &GatewayShared, headers: &HeaderMap) -> Result<Arc<ChaosController>, ApiError> {
    let c = s.chaos.clone().ok_or_else(|| {
        ApiError::new(
            ErrorKind::NotFound,
            "the chaos API is disabled (start with `flotilla up --chaos` or set chaos.enabled)",
        )
        .code("chaos_disabled")
    })?;
    if let Some(token) = &c.token {
        let ok = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| t == token);
        if !ok {
            return Err(ApiError::new(
                ErrorKind::Unauthorized,
                "the chaos API needs `Authorization: Bearer <chaos.token>`",
            ));
        }
    }
    Ok(c)
}

/// `POST /chaos/faults`.
pub async fn create(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let result = async {
        let c = controller(&s, &headers)?;
        super::edge::require_json(&headers)?;
        let body =
            super::serve::read_body(&headers, body, MAX_FAULT_BYTES, s.request_body_timeout)
                .await?;
        let mut spec: FaultSpec = serde_json::from_slice(&body).map_err(|e| {
            unknown_actor(&body).unwrap_or_else(|| ApiError::new(
                ErrorKind::InvalidRequest,
                format!("invalid fault ({e}); expected {{\"kind\": \"slow\"|\"fail_engine\"|\"hang\"|\"kill_actor\"|\"kill_node\"|\"panic\"|\"panic_task\"|\"drop_kv_events\"|\"fill_kv\"|\"partition\"|\"delay_kv_transfer\"|\"drop_kv_transfer\", …, \"target\": {{\"worker\": ID}} | {{\"node\": ID}} | \"any_busy\"}}"),
            ))
        })?;
        if let FaultKind::Slow { delay_ms } | FaultKind::DelayKvTransfer { delay_ms } = spec.kind
            && delay_ms > MAX_DELAY_MS
        {
            return Err(ApiError::new(ErrorKind::InvalidRequest, format!("delay_ms must be at most {MAX_DELAY_MS}")).param("delay_ms"));
        }
        if let FaultKind::DropKvEvents { rate } | FaultKind::DropKvTransfer { rate } = spec.kind
            && !(0.0..=1.0).contains(&rate)
        {
            return Err(ApiError::new(ErrorKind::InvalidRequest, "rate must be within [0, 1]").param("rate"));
        }
        if let FaultKind::FillKv { fraction } = spec.kind
            && !(0.0..=1.0).contains(&fraction)
        {
            return Err(ApiError::new(ErrorKind::InvalidRequest, "fraction must be within [0, 1]").param("fraction"));
        }
        if let FaultKind::Partition { .. } = &spec.kind
            && !spec.duration_ms.is_some_and(|d| d > 0 && d <= MAX_PARTITION_MS)
        {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                format!("a partition needs `duration_ms` in 1..={MAX_PARTITION_MS} (it heals itself then)"),
            )
            .param("duration_ms"));
        }
        let fleet = s.fresh_fleet().await?;
        if let FaultKind::Partition { nodes } = &mut spec.kind {
            check_partition(nodes, &fleet)?;
        }
        let by_node = resolve_nodes(&spec.kind, &spec.target, &fleet);
        check_kill_actor(&spec.kind, &by_node, &fleet)?;
        let hit: Vec<WorkerId> = by_node.values().flatten().cloned().collect();
        if by_node.is_empty() {
            let what = match spec.target {
                Target::AnyBusy => "no worker has requests in flight (any_busy)",
                _ => "the target matches no live worker",
            };
            return Err(ApiError::new(ErrorKind::InvalidRequest, what).param("target"));
        }
        let id = c.next_id.fetch_add(1, Ordering::Relaxed);
        let nodes: Vec<String> = by_node.keys().cloned().collect();
        // Find every node's Chaos actor before telling any (a partition or a node kill acts
        // at once), and tell this node's last, so that no fault cuts the path to the rest.
        let mut sends = Vec::new();
        for (node, workers) in by_node {
            let chaos = find_chaos(&node).ok_or_else(|| {
                ApiError::new(
                    ErrorKind::Unavailable,
                    format!("node {node} runs no chaos actor"),
                )
            })?;
            sends.push((node, workers, chaos));
        }
        sends.sort_by_key(|(_, _, chaos)| chaos.get_id().is_local());
        let sent_at = std::time::Instant::now();
        let mut told: Vec<ractor::ActorRef<ChaosMsg>> = Vec::new();
        for (node, workers, chaos) in sends {
            let inj = Injection {
                id,
                seed: spec.seed,
                duration_ms: spec.duration_ms,
                node: node.clone(),
                kind: spec.kind.clone(),
                workers,
            };
            let unreachable = || {
                ApiError::new(
                    ErrorKind::Unavailable,
                    format!("node {node} is unreachable"),
                )
            };
            // Confirmed before the answer, so a request sent after it meets the fault — except
            // kinds whose node may not answer: a node killing itself, a cut.
            let sent = if matches!(spec.kind, FaultKind::KillNode | FaultKind::Partition { .. }) {
                chaos
                    .cast(ChaosMsg::Apply(Wire::encode(&inj)))
                    .map_err(|_| unreachable())
            } else {
                ractor::call_t!(chaos, ChaosMsg::ApplyAck, ACK_TIMEOUT_MS, Wire::encode(&inj))
                    .map(|_| ())
                    .map_err(|_| unreachable())
            };
            if let Err(e) = sent {
                // Not listed, so not left in force: the nodes already told drop it again.
                for c in &told {
                    let _ = c.cast(ChaosMsg::Clear(Wire::encode(&id)));
                }
                return Err(e);
            }
            told.push(chaos);
        }
        let one_shot = spec.kind.is_one_shot();
        c.lock().push(FaultRecord {
            id,
            spec: spec.clone(),
            hit: hit.clone(),
            nodes: nodes.clone(),
            active: !one_shot,
            ends_at: spec
                .duration_ms
                .map(|ms| sent_at + Duration::from_millis(ms)),
        });
        Ok((
            StatusCode::CREATED,
            Json(serde_json::json!({"id": id, "hit": hit, "nodes": nodes})),
        )
            .into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// A fault that did not parse because `kill_actor` names no known actor: that error, with the
/// parameter at fault (read only on the error path).
fn unknown_actor(body: &[u8]) -> Option<ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let actor = v["actor"].as_str()?;
    if v["kind"] != "kill_actor" || ActorKind::ALL.iter().any(|k| k.as_str() == actor) {
        return None;
    }
    let known: Vec<&str> = ActorKind::ALL.iter().map(|k| k.as_str()).collect();
    Some(
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("unknown actor {actor:?}; expected one of {known:?}"),
        )
        .param("actor"),
    )
}

/// `GET /chaos/faults`.
pub async fn list(State(s): State<Arc<GatewayShared>>, headers: HeaderMap) -> Response {
    match controller(&s, &headers) {
        Ok(c) => Json(serde_json::json!({"faults": *c.lock()})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `DELETE /chaos/faults/{id}`: 200 when it was active, 404 when unknown or already cleared
/// (expired and cleared faults stay listed by `GET`, with `active: false`).
pub async fn delete(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let c = match controller(&s, &headers) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    match id.parse::<u64>() {
        Ok(n) if c.clear(n).await => {
            Json(serde_json::json!({"id": n, "cleared": true})).into_response()
        }
        Ok(_) => {
            ApiError::new(ErrorKind::NotFound, format!("no active fault {id}")).into_response()
        }
        Err(_) => ApiError::new(
            ErrorKind::InvalidRequest,
            format!("fault ids are numbers, got {id:?}"),
        )
        .into_response(),
    }
}
