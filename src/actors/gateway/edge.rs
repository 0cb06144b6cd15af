//! The HTTP edge: what every request meets before a route runs. The connection limits are in
//! `conn.rs`.
//!
//! - **Request ids.** Every response carries `x-request-id`: the client's value when it is 1 to
//!   [`MAX_REQUEST_ID_LEN`] visible ASCII characters, else (absent, longer, other bytes) a
//!   generated UUID v4 that replaces it — never a 4xx for a bad id. The id is a field of the
//!   `request` tracing span around the whole request (so of every log line it emits, the
//!   streamed body included) and travels to the worker as `SubmitRequest::trace_id`.
//!   (tower-http `SetRequestIdLayer` / `PropagateRequestIdLayer` / `TraceLayer`.)
//! - **Access lines.** One `info` line per API request (`POST`; other routes at `debug`),
//!   message `request done`, inside the `request` span (so with its `request_id`, `method`,
//!   `path`): `status`, `duration_ms`, `workers` (those that admitted it, comma-separated,
//!   `-` when none did). A streamed response logs it at the stream's end instead (`serve.rs`,
//!   with `outcome` and token counts), when the whole answer has gone out ([`access_log`]).
//!   Their target is `flotilla::access` ([`ACCESS_TARGET`]), to filter them on their own.
//! - **JSON bodies.** The POST routes (`/v1/chat/completions`, `/v1/completions`,
//!   `/v1/messages`, `/chaos/faults`) need `Content-Type: application/json` (or
//!   `application/*+json`, any parameters, but a `charset` other than UTF-8 is refused):
//!   otherwise, or with none, 415 in the route's error shape (OpenAI's; Anthropic's on
//!   `/v1/messages`) before any work ([`require_json`]). A cross-site HTML form cannot send
//!   that type without a CORS preflight.
//! - **Encoded bodies** (`encoding.rs`): `Content-Encoding` gzip, deflate, br, zstd decoded on
//!   every route, the size limit on the decoded bytes; other codings 415, other transfer
//!   codings than chunked 501, each named.
//! - **The control API** (`/chaos/*`, and any admin route added to [`control_routes`](super::routes::control_routes)'s
//!   router): a foreign `Origin` is refused (403), and when no `chaos.token` is set the `Host`
//!   must be a loopback name — `localhost`, `127.0.0.0/8`, `[::1]` — or the configured
//!   `gateway.http_addr` IP, any port (403 otherwise: a DNS-rebinding page's requests carry
//!   its own host name). A request with no `Host` is refused too ([`check_control`]).

use super::state::GatewayShared;
use crate::openai::error::{ApiError, ErrorKind};
use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnFailure, TraceLayer};

pub mod encoding;
#[cfg(test)]
mod tests;

/// The request-id header.
pub const REQUEST_ID: &str = "x-request-id";
/// Longest client-chosen request id kept (characters); longer ones are replaced.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Whether a client's request id is kept: 1..=[`MAX_REQUEST_ID_LEN`] bytes of visible ASCII.
pub fn request_id_ok(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty() && b.len() <= MAX_REQUEST_ID_LEN && b.iter().all(|c| c.is_ascii_graphic())
}

/// Drop a request id that is not kept, so that `SetRequestIdLayer` makes a new one.
async fn bound_request_id(mut req: Request, next: Next) -> Response {
    if req
        .headers()
        .get(REQUEST_ID)
        .is_some_and(|v| !request_id_ok(v))
    {
        req.headers_mut().remove(REQUEST_ID);
    }
    next.run(req).await
}

/// The request id of a request that went through [`with_request_ids`].
pub fn request_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// The tracing target of the access lines: `FLOTILLA_LOG=info,flotilla::access=off` turns
/// them off (they cost ~4 % of the 1-token request rate on a 2-core machine,
/// `docs/benchmarks.md`).
pub const ACCESS_TARGET: &str = "flotilla::access";

/// The workers of a non-streamed answer, for its access line (a response extension set by
/// the route).
#[derive(Clone, Debug)]
pub struct AccessWorkers(pub String);

/// Logs the access line of a request whose response is ready, unless it is an event stream
/// (that one logs its own at its end): `info` for `POST`, `debug` for the rest.
pub async fn access_log(req: Request, next: Next) -> Response {
    let api = req.method() == axum::http::Method::POST;
    let t0 = std::time::Instant::now();
    let res = next.run(req).await;
    let streamed = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if streamed {
        return res;
    }
    let status = res.status().as_u16();
    let duration_ms = t0.elapsed().as_secs_f64() * 1e3;
    let workers = res
        .extensions()
        .get::<AccessWorkers>()
        .map_or("-", |w| w.0.as_str());
    if api {
        tracing::info!(target: ACCESS_TARGET, status, duration_ms, workers, "request done");
    } else {
        tracing::debug!(target: ACCESS_TARGET, status, duration_ms, workers, "request done");
    }
    res
}

/// Wrap `app` in the request-id and tracing layers (outermost first: bound the client's id,
/// set one when missing, open the `request` span, copy the id onto the response, log the
/// access line inside the span), and inside them the body-decoding layers
/// ([`encoding::with_body_decoding`]), so that a refused encoding has its id and access line.
pub fn with_request_ids(app: axum::Router) -> axum::Router {
    let app = encoding::with_body_decoding(app);
    let trace = TraceLayer::new_for_http().make_span_with(|req: &Request| {
        let id = req
            .headers()
            .get(REQUEST_ID)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-");
        // The API's POSTs at info; reads (`/metrics` scrapes, `/health`, `/v1/fleet` polls, the
        // page) at debug, so that they neither fill the logs nor become one trace each.
        if req.method() == axum::http::Method::POST {
            tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.uri().path())
        } else {
            tracing::debug_span!("request", request_id = %id, method = %req.method(), path = %req.uri().path())
        }
    })
    // A 5xx (load shedding's 503 included) is the route's to log, not one ERROR line each.
    .on_failure(DefaultOnFailure::new().level(tracing::Level::DEBUG));
    app.layer(axum::middleware::from_fn(access_log))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(trace)
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(axum::middleware::from_fn(bound_request_id))
}

/// 415 unless the body is declared `application/json` (or `application/*+json`) in UTF-8.
///
/// # Errors
/// An [`ErrorKind::UnsupportedMediaType`] error when `Content-Type` is missing or another type,
/// or names a `charset` other than `utf-8` (JSON is UTF-8, RFC 8259 §8.1): the message names it.
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let refuse = |got: &str| {
        Err(ApiError::new(
            ErrorKind::UnsupportedMediaType,
            format!("Content-Type must be application/json, got {got}"),
        )
        .code("unsupported_media_type"))
    };
    let Some(v) = headers.get(header::CONTENT_TYPE) else {
        return refuse("none");
    };
    let Ok(v) = v.to_str() else {
        return refuse("a non-ASCII value");
    };
    let mime = v.split(';').next().unwrap_or_default().trim();
    let mime = mime.to_ascii_lowercase();
    let json = mime == "application/json"
        || mime
            .strip_prefix("application/")
            .is_some_and(|s| s.ends_with("+json"));
    if json {
        check_charset(v)
    } else {
        let shown: String = mime.chars().take(64).collect();
        refuse(&format!("'{shown}'"))
    }
}

/// A `charset` parameter of a JSON `Content-Type` other than UTF-8 is a 415 naming it.
fn check_charset(content_type: &str) -> Result<(), ApiError> {
    for param in content_type.split(';').skip(1) {
        let Some((k, v)) = param.split_once('=') else {
            continue;
        };
        if !k.trim().eq_ignore_ascii_case("charset") {
            continue;
        }
        let cs = v.trim().trim_matches('"').to_ascii_lowercase();
        if cs != "utf-8" && cs != "utf8" {
            let shown: String = cs.chars().take(64).collect();
            return Err(ApiError::new(
                ErrorKind::UnsupportedMediaType,
                format!(
                    "Content-Type charset '{shown}' is not supported; JSON bodies must be UTF-8"
                ),
            )
            .code("unsupported_media_type"));
        }
    }
    Ok(())
}

/// Who may call the control API.
#[derive(Clone, Copy, Debug)]
pub struct ControlPolicy {
    /// The configured listen address (`gateway.http_addr`); its IP is an allowed `Host`.
    pub http_addr: SocketAddr,
    /// Whether a bearer token guards the control API (then any `Host` is accepted).
    pub token_set: bool,
}

/// The host part of a `Host` value or an origin's authority, without the port, lower-cased.
fn host_of(authority: &str) -> String {
    let a = authority.trim().to_ascii_lowercase();
    if a.starts_with('[') {
        return match a.find(']') {
            Some(end) => a[..=end].to_owned(),
            None => a,
        };
    }
    match a.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h.to_owned(),
        _ => a,
    }
}

/// Whether `host` (no port) names this machine's loopback or the configured address.
pub fn host_allowed(host: &str, configured: IpAddr) -> bool {
    let host = host.trim_end_matches('.');
    if host == "localhost" {
        return true;
    }
    let ip = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<IpAddr>().ok(),
        None => host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4),
    };
    ip.is_some_and(|ip| ip.is_loopback() || (!configured.is_unspecified() && ip == configured))
}

/// Whether an `Origin` value is this gateway's own kind of origin (an allowed host).
pub fn origin_allowed(origin: &str, configured: IpAddr) -> bool {
    let Some((scheme, rest)) = origin.split_once("://") else {
        return false; // "null" and anything that is not an origin
    };
    if !matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https") {
        return false;
    }
    host_allowed(&host_of(rest.trim_end_matches('/')), configured)
}

/// Refuse a control-API request from a foreign origin or, without a token, a foreign host.
///
/// # Errors
/// [`ErrorKind::Forbidden`] with code `forbidden_origin` for an `Origin` that is not this
/// gateway's address or loopback, or — when no `chaos.token` is set — `forbidden_host` for a
/// missing or foreign `Host`.
pub fn check_control(headers: &HeaderMap, policy: ControlPolicy) -> Result<(), ApiError> {
    let ip = policy.http_addr.ip();
    if let Some(origin) = headers.get(header::ORIGIN) {
        let ok = origin.to_str().is_ok_and(|o| origin_allowed(o, ip));
        if !ok {
            return Err(ApiError::new(
                ErrorKind::Forbidden,
                "cross-origin requests to the control API are refused",
            )
            .code("forbidden_origin"));
        }
    }
    if !policy.token_set {
        let ok = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .is_some_and(|h| host_allowed(&host_of(h), ip));
        if !ok {
            return Err(ApiError::new(
                ErrorKind::Forbidden,
                "the control API answers only a loopback Host or the configured address \
                 (set chaos.token to serve other names)",
            )
            .code("forbidden_host"));
        }
    }
    Ok(())
}

/// Middleware of the control routes: [`check_control`].
pub async fn control_guard(
    State(s): State<Arc<GatewayShared>>,
    req: Request,
    next: Next,
) -> Response {
    use axum::response::IntoResponse;
    let policy = ControlPolicy {
        http_addr: s.http_addr,
        token_set: s.chaos.as_ref().is_some_and(|c| c.has_token()),
    };
    match check_control(req.headers(), policy) {
        Ok(()) => next.run(req).await,
        Err(e) => {
            tracing::warn!(error = %e.message, "control API request refused");
            e.into_response()
        }
    }
}

/// `GET /live`: the process answers.
pub async fn live() -> Json<serde_json::Value> {
    Json(json!({"status": "alive"}))
}

/// A readiness answer: 200 when `word` is `ready`, else 503; the body is `fields` with
/// `status: word` (shared with the workers' faces).
pub fn readiness(word: &str, mut fields: serde_json::Value) -> Response {
    let status = if word == "ready" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    fields["status"] = word.into();
    (status, Json(fields)).into_response()
}

/// 405 in the OpenAI error shape.
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let e = ApiError::new(
        ErrorKind::InvalidRequest,
        format!("method {method} is not allowed on {}", uri.path()),
    )
    .code("method_not_allowed");
    let mut r = if is_messages_path(uri.path()) {
        crate::anthropic::error::response(&e)
    } else {
        e.into_response()
    };
    *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    r
}

/// 404: in Anthropic's error shape under `/v1/messages` (`not_found_error`), else OpenAI's.
pub async fn not_found(uri: axum::http::Uri) -> Response {
    let e = ApiError::new(ErrorKind::NotFound, format!("no route for {}", uri.path()))
        .code("not_found");
    if is_messages_path(uri.path()) {
        crate::anthropic::error::response(&e)
    } else {
        e.into_response()
    }
}

/// Whether `path` is Anthropic's Messages API (`/v1/messages` and below): its clients read
/// Anthropic's error shape.
fn is_messages_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}
