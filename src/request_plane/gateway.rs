//! The `[gateway]` section: what a gateway's request path is configured with — its HTTP
//! edge (address, body and connection limits, deadlines), admission, migration bounds, the
//! wait for capacity and where session keys come from. Read by the gateway actor
//! (`actors/gateway/`, through the composition root) and by `flotilla sim` (admission,
//! migration, the cold-start wait), which is why it lives in the request plane.

use crate::runtime::config::ConfigError;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::time::Duration;

/// Headers read for a session key unless configured (`gateway.session_headers`), in order:
/// - `x-session-id`: the generic one (vLLM's router `consistent_hash` policy reads it first;
///   OpenCode sends it, `packages/opencode/src/session/llm/request.ts`);
/// - `x-session-affinity`: OpenCode sends it beside `x-session-id` with the same value;
/// - `x-claude-code-session-id`: Claude Code's session UUID, sent on every API request;
/// - `session_id`: the OpenAI Codex CLI's conversation id (`codex-rs`, sent on every
///   Responses request; an underscore is a legal header-name character).
pub const DEFAULT_SESSION_HEADERS: [&str; 4] = [
    "x-session-id",
    "x-session-affinity",
    "x-claude-code-session-id",
    "session_id",
];

/// HTTP gateway.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// HTTP listen address (port 0 picks a free port, reported in the node's ready line).
    pub http_addr: SocketAddr,
    /// Largest accepted request body; larger bodies get 413 without being buffered.
    pub max_body_bytes: usize,
    /// Interval of SSE keep-alive comments while a stream waits for tokens.
    pub keep_alive_ms: u64,
    /// Admission: a worker is busy when this fraction of its KV blocks is in use…
    #[schemars(extend("x-unit" = "fraction"))]
    pub busy_kv_ratio: f64,
    /// …or when this many sequences wait for admission on it. When every live worker is
    /// busy, new requests get 503 with `Retry-After` before any work is done.
    #[schemars(extend("x-unit" = "sequences"))]
    pub busy_waiting: usize,
    /// Admission: most choices in flight on this gateway; beyond, 503.
    #[schemars(extend("x-unit" = "choices"))]
    pub max_in_flight: usize,
    /// Admission that predicts (`request_plane/admission.rs`): a TTFT target (ms). When every
    /// worker's predicted wait before a new request's prefill starts (its queued prompt
    /// tokens through its measured step-time model, or the wait of its oldest request not yet
    /// admitted, whichever is longer, as of the last heartbeat) exceeds it, the
    /// request gets 503 with the prediction in the body and `Retry-After`. `None`: off.
    pub ttft_target_ms: Option<u64>,
    /// Losses in a row **without progress** (no new token since the previous loss) that
    /// never give a request up; beyond them, a stall of `migration_deadline_ms` does. Losses
    /// after progress do not count. See `request_plane::request::migration`.
    pub migration_limit: u32,
    /// How long one migration keeps looking for a worker, from the loss, and how long a stall
    /// of more than `migration_limit` losses may last, before the request fails (ms).
    pub migration_deadline_ms: u64,
    /// First wait between placement tries while no worker is routable (ms); doubles per try,
    /// with jitter, up to `migration_backoff_max_ms`.
    pub migration_backoff_base_ms: u64,
    /// Longest wait between placement tries (ms).
    pub migration_backoff_max_ms: u64,
    /// A request's head (request line and headers) must be complete within this many ms of
    /// the connection being ready for it: from its first byte on a new connection, from the
    /// end of the previous response on a kept-alive one (so it also closes a kept-alive
    /// connection idle this long). Else the connection is closed (hyper's
    /// `header_read_timeout`).
    pub request_header_timeout_ms: u64,
    /// A request body must be complete within this many ms of the handler starting to read
    /// it; else 408 in the OpenAI error shape and the connection is closed.
    pub request_body_timeout_ms: u64,
    /// A new connection that sends no byte for this many ms is closed.
    pub idle_timeout_ms: u64,
    /// Most open client connections; beyond, a new connection gets a 503 and is closed
    /// (`flotilla_http_connections_open`, `flotilla_http_connections_refused_total`).
    #[schemars(extend("x-unit" = "connections"))]
    pub max_connections: usize,
    /// A request that finds no worker serving the model while a planner in mode `act` is in
    /// the fleet (a pool scaled to zero) waits up to this many ms for one to come up — the
    /// planner sees it waiting and starts a replica — then gets a 503 with `Retry-After`
    /// (0: no wait). Without such a planner it is refused at once.
    pub cold_start_timeout_ms: u64,
    /// Headers that carry a request's session key, first present wins (lower case; default
    /// [`DEFAULT_SESSION_HEADERS`]: `x-session-id`,
    /// `x-session-affinity`, `x-claude-code-session-id`, `session_id`). Under the kv policies
    /// the router keeps a session's turns on one worker until it saturates
    /// (`router.session_max_queued_tokens`). A key is 1..=256 visible ASCII bytes, else 400.
    /// Empty: no header is read.
    pub session_headers: Vec<String>,
    /// Without a session header, take the body's `user` (OpenAI routes) or
    /// `metadata.user_id` (`/v1/messages`) as the session key (default false: one user may
    /// run many unrelated sessions). Bounded as the headers are.
    pub session_from_user: bool,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            http_addr: "127.0.0.1:8080".parse().expect("static address"),
            max_body_bytes: 4 * 1024 * 1024,
            keep_alive_ms: 10_000,
            busy_kv_ratio: 0.95,
            busy_waiting: 64,
            max_in_flight: 4096,
            ttft_target_ms: None,
            migration_limit: 3,
            migration_deadline_ms: 30_000,
            migration_backoff_base_ms: 50,
            migration_backoff_max_ms: 1_000,
            request_header_timeout_ms: 30_000,
            request_body_timeout_ms: 30_000,
            idle_timeout_ms: 30_000,
            max_connections: 1024,
            cold_start_timeout_ms: 120_000,
            session_headers: DEFAULT_SESSION_HEADERS
                .iter()
                .map(|h| (*h).to_owned())
                .collect(),
            session_from_user: false,
        }
    }
}

impl GatewayConfig {
    /// Gateway admission (`gateway.busy_kv_ratio`, `busy_waiting`, `max_in_flight`,
    /// `ttft_target_ms`): what a live gateway and `flotilla sim` both judge requests by.
    pub fn admission(&self) -> crate::request_plane::admission::Admission {
        crate::request_plane::admission::Admission {
            busy_kv_ratio: self.busy_kv_ratio,
            busy_waiting: self.busy_waiting,
            max_in_flight: self.max_in_flight,
            ttft_target_ms: self.ttft_target_ms,
        }
    }

    /// Migration bounds of a request (`gateway.migration_*`).
    pub fn migration_policy(&self) -> crate::request_plane::migration::MigrationPolicy {
        crate::request_plane::migration::MigrationPolicy {
            limit: self.migration_limit,
            deadline: Duration::from_millis(self.migration_deadline_ms),
            backoff_base: Duration::from_millis(self.migration_backoff_base_ms),
            backoff_max: Duration::from_millis(self.migration_backoff_max_ms),
        }
    }

    /// Check ranges: admission bounds, deadlines, session header names, body size.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first field (`gateway.<field>`) out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.busy_kv_ratio > 0.0 && self.busy_kv_ratio <= 1.0) {
            return Err(ConfigError::invalid(
                "gateway.busy_kv_ratio",
                "must be in (0, 1]",
            ));
        }
        if self.max_in_flight == 0 || self.busy_waiting == 0 {
            return Err(ConfigError::invalid(
                "gateway.max_in_flight",
                "admission bounds must be at least 1",
            ));
        }
        if self.keep_alive_ms == 0 {
            return Err(ConfigError::invalid(
                "gateway.keep_alive_ms",
                "must be at least 1",
            ));
        }
        for (field, ms) in [
            (
                "gateway.request_header_timeout_ms",
                self.request_header_timeout_ms,
            ),
            (
                "gateway.request_body_timeout_ms",
                self.request_body_timeout_ms,
            ),
            ("gateway.idle_timeout_ms", self.idle_timeout_ms),
        ] {
            if !(1..=600_000).contains(&ms) {
                return Err(ConfigError::invalid(
                    field,
                    "must be within 1..=600000 (ms)",
                ));
            }
        }
        for h in &self.session_headers {
            if axum::http::HeaderName::from_lowercase(h.as_bytes()).is_err() {
                return Err(ConfigError::invalid(
                    "gateway.session_headers",
                    format!("{h:?} is not a lower-case HTTP header name"),
                ));
            }
        }
        if self.cold_start_timeout_ms > 3_600_000 {
            return Err(ConfigError::invalid(
                "gateway.cold_start_timeout_ms",
                "must be within 0..=3600000 (ms)",
            ));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::invalid(
                "gateway.max_connections",
                "must be at least 1",
            ));
        }
        if self.max_body_bytes < 1024 {
            return Err(ConfigError::invalid(
                "gateway.max_body_bytes",
                "must be at least 1024",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_field() {
        GatewayConfig::default().validate().unwrap();
        for (edit, field) in [
            (
                (|g: &mut GatewayConfig| g.busy_kv_ratio = 0.0) as fn(&mut GatewayConfig),
                "gateway.busy_kv_ratio",
            ),
            (|g| g.idle_timeout_ms = 0, "gateway.idle_timeout_ms"),
            (
                |g| g.session_headers = vec!["X-Session".into()],
                "gateway.session_headers",
            ),
            (|g| g.max_body_bytes = 10, "gateway.max_body_bytes"),
        ] {
            let mut g = GatewayConfig::default();
            edit(&mut g);
            let err = g.validate().unwrap_err();
            assert_eq!(err.field(), Some(field), "{err}");
        }
    }
}
