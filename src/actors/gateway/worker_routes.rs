//! `POST /v1/workers/role`: change a replica's role at run time (control API, behind the same
//! guard as `/chaos`).
//!
//! Body: `{"worker": "<node>/replica-<k>", "role": "aggregated" | "prefill" | "decode"}`.
//! The replica's scheduler leaves routing, finishes what it runs and holds (a drain), then
//! switches and is routable again; `/v1/fleet` shows the new role once it has switched.
//! Answers 202 `{"worker", "role", "status": "switching"}`; 400 for a bad body or role, 404
//! for a worker whose scheduler is not in the cluster, 415 for a body that is not JSON.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::state::GatewayShared;
use crate::actors::scheduler::SchedulerMsg;
use crate::openai::error::{ApiError, ErrorKind};
use crate::runtime::role::Role;
use crate::runtime::wire::Wire;
use crate::worker::scheduler::SCHEDULER_GROUP;

/// Largest body accepted (bytes).
const MAX_ROLE_BYTES: usize = 4096;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RoleChange {
    worker: String,
    role: String,
}

/// `POST /v1/workers/role` (see the module doc).
pub async fn set_role(
    State(s): State<Arc<GatewayShared>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let result = async {
        super::edge::require_json(&headers)?;
        let body =
            super::serve::read_body(&headers, body, MAX_ROLE_BYTES, s.request_body_timeout)
                .await?;
        let change: RoleChange = serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                ErrorKind::InvalidRequest,
                format!("invalid role change ({e}); expected {{\"worker\": ID, \"role\": \"aggregated\"|\"prefill\"|\"decode\"}}"),
            )
        })?;
        let role: Role = change
            .role
            .parse()
            .map_err(|e: String| ApiError::new(ErrorKind::InvalidRequest, e).param("role"))?;
        let name = format!("{}/scheduler", change.worker);
        let scheduler: ractor::ActorRef<SchedulerMsg> =
            crate::runtime::cluster::member_named(SCHEDULER_GROUP, &name)
                .ok_or_else(|| {
                    ApiError::new(
                        ErrorKind::NotFound,
                        format!("no worker {:?} in the cluster", change.worker),
                    )
                    .param("worker")
                })?
                .into();
        scheduler
            .cast(SchedulerMsg::SetRole(Wire::encode(&role)))
            .map_err(|_| {
                ApiError::new(
                    ErrorKind::Unavailable,
                    format!("worker {:?} went away", change.worker),
                )
            })?;
        tracing::info!(worker = %change.worker, %role, "role change asked");
        Ok::<_, ApiError>((change.worker, role))
    }
    .await;
    match result {
        Ok((worker, role)) => (
            StatusCode::ACCEPTED,
            Json(serde_json::json!({"worker": worker, "role": role, "status": "switching"})),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}
