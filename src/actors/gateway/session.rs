//! A request's **session key**, read at the door: the router keeps a session's turns on the
//! worker that served its last one until that worker saturates (`router/policy.rs`, "Sessions
//! that stick").
//!
//! Where the key comes from, first found wins:
//! 1. the first of `gateway.session_headers` the request carries (default
//!    [`DEFAULT_SESSION_HEADERS`]);
//! 2. with `gateway.session_from_user` (default off), the body's `user` (OpenAI routes) or
//!    `metadata.user_id` (`/v1/messages`).
//!
//! A key is 1..=[`MAX_SESSION_KEY_LEN`] bytes of visible ASCII (`x-request-id`'s rule,
//! `edge.rs`, with a longer bound: Claude Code's `metadata.user_id`,
//! `user_<64 hex>_account_<uuid>_session_<uuid>`, is ~160 bytes). Anything else is refused
//! with a 400 in the route's error shape naming the header or field, before any worker sees
//! the request (unlike `x-request-id`, which is replaced: a session key the router cannot use
//! silently would scatter the session).

use axum::http::{HeaderMap, HeaderName};

use crate::openai::error::{ApiError, ErrorKind};

/// Headers read for a session key unless configured (`gateway.session_headers`): the
/// `[gateway]` section's default, defined with it in the request plane.
pub use crate::request_plane::gateway::DEFAULT_SESSION_HEADERS;

/// Longest session key (bytes).
pub const MAX_SESSION_KEY_LEN: usize = 256;

/// Where a gateway reads session keys (`gateway.session_headers`, `session_from_user`).
#[derive(Clone, Debug, Default)]
pub struct SessionKeys {
    /// Headers, in order (checked lower-case names).
    pub headers: Vec<HeaderName>,
    /// Fall back to the body's `user` / `metadata.user_id`.
    pub from_user: bool,
}

impl SessionKeys {
    /// From the configuration's names; a name that is not a lower-case header name is
    /// skipped (the configuration's validation refuses it first).
    pub fn new(headers: &[String], from_user: bool) -> Self {
        Self {
            headers: headers
                .iter()
                .filter_map(|h| HeaderName::from_lowercase(h.as_bytes()).ok())
                .collect(),
            from_user,
        }
    }

    /// The request's session key: the first configured header present, else (with
    /// `from_user`) `user`, whose field name in errors is `user_field` (`user` or
    /// `metadata.user_id`). `None` when there is none.
    ///
    /// # Errors
    /// 400 (`invalid_request_error`, `param` the header or field) when the key found is
    /// empty, longer than [`MAX_SESSION_KEY_LEN`] or not visible ASCII.
    pub fn key(
        &self,
        headers: &HeaderMap,
        user: Option<&str>,
        user_field: &str,
    ) -> Result<Option<String>, ApiError> {
        for name in &self.headers {
            if let Some(v) = headers.get(name) {
                return check(v.as_bytes(), &format!("header {name}"), name.as_str()).map(Some);
            }
        }
        match user {
            Some(u) if self.from_user => check(u.as_bytes(), user_field, user_field).map(Some),
            _ => Ok(None),
        }
    }
}

/// `bytes` as a session key, or the 400 naming `what` (`param` = `param`).
fn check(bytes: &[u8], what: &str, param: &str) -> Result<String, ApiError> {
    let bad = |why: String| {
        Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!("{what}: a session key must be 1 to {MAX_SESSION_KEY_LEN} visible ASCII characters; {why}"),
        )
        .param(param)
        .code("invalid_session_key"))
    };
    if bytes.is_empty() {
        return bad("it is empty".into());
    }
    if bytes.len() > MAX_SESSION_KEY_LEN {
        return bad(format!("it has {} bytes", bytes.len()));
    }
    if let Some(i) = bytes.iter().position(|c| !c.is_ascii_graphic()) {
        return bad(format!("byte {i} is not visible ASCII"));
    }
    // Visible ASCII is UTF-8.
    Ok(String::from_utf8_lossy(bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn keys(from_user: bool) -> SessionKeys {
        let h: Vec<String> = DEFAULT_SESSION_HEADERS
            .iter()
            .map(|s| s.to_string())
            .collect();
        SessionKeys::new(&h, from_user)
    }

    fn hm(pairs: &[(&'static str, &[u8])]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, HeaderValue::from_bytes(v).unwrap());
        }
        m
    }

    #[test]
    fn the_first_configured_header_wins_then_the_user_when_asked() {
        let k = keys(false);
        assert_eq!(k.key(&HeaderMap::new(), Some("u"), "user").unwrap(), None);
        let h = hm(&[("session_id", b"codex-1"), ("x-session-id", b"s-1")]);
        assert_eq!(k.key(&h, None, "user").unwrap().as_deref(), Some("s-1"));
        let h = hm(&[("x-claude-code-session-id", b"c-1")]);
        assert_eq!(
            k.key(&h, Some("u"), "user").unwrap().as_deref(),
            Some("c-1")
        );
        let k = keys(true);
        assert_eq!(
            k.key(&HeaderMap::new(), Some("u-9"), "user")
                .unwrap()
                .as_deref(),
            Some("u-9")
        );
        assert_eq!(k.key(&HeaderMap::new(), None, "user").unwrap(), None);
    }

    #[test]
    fn bad_keys_are_refused_naming_the_header_or_field() {
        let k = keys(true);
        let long = vec![b'a'; MAX_SESSION_KEY_LEN + 1];
        for v in [&b""[..], &long[..], &b"a b"[..], &b"\xff"[..]] {
            let e = k
                .key(&hm(&[("x-session-id", v)]), None, "user")
                .unwrap_err();
            assert_eq!(e.param.as_deref(), Some("x-session-id"), "{}", e.message);
            assert!(e.message.contains("header x-session-id"), "{}", e.message);
        }
        let ok = vec![b'a'; MAX_SESSION_KEY_LEN];
        assert!(k.key(&hm(&[("x-session-id", &ok)]), None, "user").is_ok());
        let e = k
            .key(&HeaderMap::new(), Some("é"), "metadata.user_id")
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("metadata.user_id"));
        // Not configured: the user is not a key, so it is not checked as one.
        assert_eq!(
            keys(false)
                .key(&HeaderMap::new(), Some(""), "user")
                .unwrap(),
            None
        );
    }
}
