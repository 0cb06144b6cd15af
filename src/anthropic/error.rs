//! The gateway's [`ApiError`] rendered in Anthropic's error shape,
//! `{"type":"error","error":{"type":…,"message":…}}`, with the status Anthropic's API
//! reference gives each error type (<https://docs.anthropic.com/en/api/errors>):
//!
//! | [`ErrorKind`] | status | `error.type` |
//! |---|---|---|
//! | InvalidRequest | 400 | `invalid_request_error` |
//! | Unauthorized | 401 | `authentication_error` |
//! | Forbidden | 403 | `permission_error` |
//! | NotFound | 404 | `not_found_error` |
//! | RequestTimeout | 408 | `invalid_request_error` (Anthropic: "other 4XX status codes") |
//! | PayloadTooLarge | 413 | `request_too_large` |
//! | UnsupportedMediaType | 415 | `invalid_request_error` |
//! | RateLimited | 429 | `rate_limit_error` |
//! | Unavailable (shed, no worker, draining) | 529 | `overloaded_error` |
//! | Internal | 500 | `api_error` |
//!
//! `Retry-After` goes out as on the OpenAI routes. The message is the same client-facing text
//! the OpenAI shape carries (it names the offending field); nothing internal.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::openai::error::{ApiError, ErrorKind};

#[cfg(test)]
mod tests;

/// Anthropic's "API is temporarily overloaded" status.
pub const OVERLOADED: u16 = 529;

/// The HTTP status of `e` on the Messages route.
pub fn status(e: &ApiError) -> StatusCode {
    match e.kind {
        ErrorKind::Unavailable => StatusCode::from_u16(OVERLOADED).unwrap_or(e.status()),
        _ => e.status(),
    }
}

/// The `error.type` string of `e`.
pub fn error_type(e: &ApiError) -> &'static str {
    match e.kind {
        ErrorKind::InvalidRequest
        | ErrorKind::RequestTimeout
        | ErrorKind::UnsupportedMediaType
        | ErrorKind::NotImplemented => "invalid_request_error",
        ErrorKind::Unauthorized => "authentication_error",
        ErrorKind::Forbidden => "permission_error",
        ErrorKind::NotFound => "not_found_error",
        ErrorKind::PayloadTooLarge => "request_too_large",
        ErrorKind::RateLimited => "rate_limit_error",
        ErrorKind::Unavailable => "overloaded_error",
        ErrorKind::Internal => "api_error",
    }
}

/// The error object.
pub fn body(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": error_type(e), "message": e.message}})
}

/// The error response: [`status`], [`body`], and `Retry-After` when the error carries one.
pub fn response(e: &ApiError) -> Response {
    let mut resp = (status(e), Json(body(e))).into_response();
    if let Some(s) = e.retry_after_s
        && let Ok(v) = s.to_string().parse()
    {
        resp.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, v);
    }
    resp
}

/// A failure after a stream's headers are out: one `event: error` record with [`body`].
pub fn sse(e: &ApiError) -> axum::response::sse::Event {
    axum::response::sse::Event::default()
        .event("error")
        .data(body(e).to_string())
}
