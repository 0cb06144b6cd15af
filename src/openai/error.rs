//! The gateway's one error type, rendered as the OpenAI error object:
//! `{"error": {"message", "type", "param", "code"}}`.
//!
//! Internal detail is logged once where the error is made and never sent to the client.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Closed classification used for HTTP status, metric labels and retry decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: the request is malformed or out of range.
    InvalidRequest,
    /// 401: missing or wrong credentials.
    Unauthorized,
    /// 403: the request comes from a place this route does not serve (a foreign `Host` or
    /// `Origin` on the control API).
    Forbidden,
    /// 404: unknown model or route.
    NotFound,
    /// 408: the request body did not arrive within `gateway.request_body_timeout_ms`.
    RequestTimeout,
    /// 413: body too large.
    PayloadTooLarge,
    /// 415: a body that is not `application/json` (or not UTF-8), or a `Content-Encoding` the
    /// gateway does not decode.
    UnsupportedMediaType,
    /// 429: a client exceeded its rate.
    RateLimited,
    /// 503: the fleet cannot take the request now.
    Unavailable,
    /// 500: a bug or an unexpected failure.
    Internal,
    /// 501: the request uses an HTTP feature the server does not implement (a
    /// `Transfer-Encoding` other than `chunked`).
    NotImplemented,
}

/// An error answered to an HTTP client.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// Classification.
    pub kind: ErrorKind,
    /// Client-facing message.
    pub message: String,
    /// The offending request field, if any.
    pub param: Option<String>,
    /// Machine-readable code, if any.
    pub code: Option<String>,
    /// Seconds the client should wait before retrying (429/503).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// A new error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// Name the offending parameter.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Set the code.
    pub fn code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self.kind {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::NotImplemented => StatusCode::NOT_IMPLEMENTED,
        }
    }

    /// OpenAI `type` string.
    pub fn type_str(&self) -> &'static str {
        match self.kind {
            ErrorKind::InvalidRequest
            | ErrorKind::PayloadTooLarge
            | ErrorKind::UnsupportedMediaType
            | ErrorKind::RequestTimeout
            | ErrorKind::NotImplemented
            | ErrorKind::NotFound => "invalid_request_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::Unavailable => "service_unavailable",
            ErrorKind::Internal => "internal_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.type_str(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s
            && let Ok(v) = s.to_string().parse()
        {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, v);
        }
        resp
    }
}
