//! Request headers that change how a body must be read, honoured or refused by name
//! on every route of the gateway and of a worker's face, before any route runs:
//!
//! - **`Content-Encoding`**: `gzip` (and its alias `x-gzip`), `deflate` (zlib, as HTTP means
//!   it), `br`, `zstd` are decoded as the body is read (tower-http's
//!   `RequestDecompressionLayer`); `identity`, or no header, is read as it is. Names are
//!   case-insensitive (RFC 9110 §8.4.1). Any other coding, or more than one stacked coding, is a
//!   415 in the OpenAI error shape whose message names it (code `unsupported_content_encoding`),
//!   with an `Accept-Encoding` header listing the supported ones (RFC 9110 §15.5.16). A body that
//!   does not decode is a 400 naming its encoding (code `invalid_content_encoding`), answered by
//!   `read_body` from the [`DecodeError`] tagged here.
//! - **The size limit counts decoded bytes**: `read_body`'s limit (`gateway.max_body_bytes`)
//!   reads the decoded stream, so a decompression bomb stops inflating at the limit (413) and at
//!   most the limit plus one decoded chunk is ever held.
//! - **`Transfer-Encoding`**: hyper decodes `chunked` and refuses a message whose last coding is
//!   not `chunked`; any other coding before it (`gzip, chunked`) would reach the route still
//!   encoded, so it is a 501 naming it (RFC 9112 §6.1: a transfer coding the server does not
//!   understand).
//! - **`Content-Type`'s charset** is checked with the media type by
//!   [`require_json`](super::require_json): JSON bodies are UTF-8 (RFC 8259 §8.1).
//!
//! Layers, outermost first: [`check_encoding`] (refuse, or normalize the header and record the
//! coding as a [`BodyEncoding`] extension), tower-http's decompression (removes
//! `Content-Encoding` and `Content-Length` of a decoded body), [`tag_decode_errors`].

use crate::openai::error::{ApiError, ErrorKind};
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;

/// The content codings the gateway decodes, as `Accept-Encoding` lists them.
pub const ACCEPTED_ENCODINGS: &str = "gzip, deflate, br, zstd, identity";

/// A content coding the gateway decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coding {
    /// `gzip` (RFC 1952), also named `x-gzip`.
    Gzip,
    /// `deflate`: the zlib format (RFC 1950) around deflate data, as HTTP defines it.
    Deflate,
    /// `br`: Brotli (RFC 7932).
    Br,
    /// `zstd`: Zstandard (RFC 8878).
    Zstd,
}

impl Coding {
    /// The coding's token, as tower-http matches it.
    pub fn as_str(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
            Coding::Br => "br",
            Coding::Zstd => "zstd",
        }
    }
}

/// The coding of a request's body, recorded by [`check_encoding`] for [`tag_decode_errors`].
#[derive(Clone, Copy, Debug)]
pub struct BodyEncoding(pub Coding);

/// A read error of a decoded body: the body was not valid data of its `Content-Encoding` (or
/// its connection failed while it was being decoded).
#[derive(Debug, thiserror::Error)]
#[error("the request body could not be decoded as {} ({source})", coding.as_str())]
pub struct DecodeError {
    /// The body's coding.
    pub coding: Coding,
    /// What the decoder said.
    pub source: axum::Error,
}

/// A value shown in a message: at most 64 characters.
fn shown(v: &str) -> String {
    v.chars().take(64).collect()
}

fn unsupported(message: String) -> ApiError {
    ApiError::new(ErrorKind::UnsupportedMediaType, message).code("unsupported_content_encoding")
}

/// The coding a request's `Content-Encoding` headers ask for: `None` for none or `identity`.
///
/// # Errors
/// A 415 naming the value for an unknown coding, several stacked codings, or a non-ASCII value.
pub fn content_coding(headers: &HeaderMap) -> Result<Option<Coding>, ApiError> {
    let mut codings = Vec::new();
    for v in headers.get_all(header::CONTENT_ENCODING) {
        let v = v
            .to_str()
            .map_err(|_| unsupported("Content-Encoding has a non-ASCII value".into()))?;
        codings.extend(
            v.split(',')
                .map(|c| c.trim().to_ascii_lowercase())
                .filter(|c| !c.is_empty() && c != "identity"),
        );
    }
    let coding = match codings.as_slice() {
        [] => return Ok(None),
        [one] => one.as_str(),
        several => {
            return Err(unsupported(format!(
                "Content-Encoding '{}' stacks several codings; this server decodes one of \
                 {ACCEPTED_ENCODINGS}",
                shown(&several.join(", "))
            )));
        }
    };
    match coding {
        "gzip" | "x-gzip" => Ok(Some(Coding::Gzip)),
        "deflate" => Ok(Some(Coding::Deflate)),
        "br" => Ok(Some(Coding::Br)),
        "zstd" => Ok(Some(Coding::Zstd)),
        other => Err(unsupported(format!(
            "Content-Encoding '{}' is not supported; this server decodes {ACCEPTED_ENCODINGS}",
            shown(other)
        ))),
    }
}

/// Refuse a `Transfer-Encoding` other than `chunked` (which hyper has decoded).
///
/// # Errors
/// A 501 ([`ErrorKind::NotImplemented`]) naming the first other coding.
pub fn check_transfer_coding(headers: &HeaderMap) -> Result<(), ApiError> {
    for v in headers.get_all(header::TRANSFER_ENCODING) {
        let other = match v.to_str() {
            Err(_) => Some("a non-ASCII value".to_owned()),
            Ok(v) => v
                .split(',')
                .map(|c| c.trim().to_ascii_lowercase())
                .find(|c| !c.is_empty() && c != "chunked")
                .map(|c| format!("'{}'", shown(&c))),
        };
        if let Some(other) = other {
            return Err(ApiError::new(
                ErrorKind::NotImplemented,
                format!(
                    "Transfer-Encoding {other} is not supported; only chunked is (send the body \
                     compressed with Content-Encoding instead)"
                ),
            )
            .code("unsupported_transfer_encoding"));
        }
    }
    Ok(())
}

/// Counts a generation request refused here as `rejected` in `flotilla_requests_total`, with
/// its status, as the generation routes count the refusals they make themselves (other paths
/// are not counted there).
fn count_refusal(path: &str, e: &ApiError) {
    let route = match path {
        "/v1/chat/completions" => "chat",
        "/v1/completions" => "completions",
        "/v1/messages" => "messages",
        _ => return,
    };
    let status = e.status().as_u16().to_string();
    metrics::counter!("flotilla_requests_total", "route" => route, "outcome" => "rejected", "status" => status)
        .increment(1);
}

/// `e` in the error shape of the route at `path`: Anthropic's on `/v1/messages`, else OpenAI's.
fn refusal(path: &str, e: ApiError) -> Response {
    count_refusal(path, &e);
    if path == "/v1/messages" {
        crate::anthropic::error::response(&e)
    } else {
        e.into_response()
    }
}

/// Middleware: refuse what cannot be read (see the module doc); give tower-http's decoder the
/// coding's lower-case token, or no header for `identity`.
pub async fn check_encoding(mut req: Request, next: Next) -> Response {
    if let Err(e) = check_transfer_coding(req.headers()) {
        return refusal(req.uri().path(), e);
    }
    match content_coding(req.headers()) {
        Err(e) => {
            let mut res = refusal(req.uri().path(), e);
            res.headers_mut().insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static(ACCEPTED_ENCODINGS),
            );
            res
        }
        Ok(None) => {
            req.headers_mut().remove(header::CONTENT_ENCODING);
            next.run(req).await
        }
        Ok(Some(c)) => {
            req.headers_mut().insert(
                header::CONTENT_ENCODING,
                HeaderValue::from_static(c.as_str()),
            );
            req.extensions_mut().insert(BodyEncoding(c));
            next.run(req).await
        }
    }
}

/// Middleware, inside the decoder: a read error of a decoded body becomes a [`DecodeError`].
pub async fn tag_decode_errors(req: Request, next: Next) -> Response {
    let Some(BodyEncoding(coding)) = req.extensions().get::<BodyEncoding>().copied() else {
        return next.run(req).await;
    };
    let req = req.map(|b| Body::new(b.map_err(move |source| DecodeError { coding, source })));
    next.run(req).await
}

/// Wrap `app` in the three layers of the module doc.
pub fn with_body_decoding(app: axum::Router) -> axum::Router {
    app.layer(axum::middleware::from_fn(tag_decode_errors))
        .layer(tower_http::decompression::RequestDecompressionLayer::new())
        .layer(axum::middleware::from_fn(check_encoding))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(name: header::HeaderName, values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(name.clone(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn content_codings_are_read_case_insensitively_and_identity_is_none() {
        let ce = |v: &[&str]| content_coding(&with(header::CONTENT_ENCODING, v));
        assert_eq!(ce(&[]).unwrap(), None);
        assert_eq!(ce(&["identity"]).unwrap(), None);
        assert_eq!(ce(&["Identity, identity"]).unwrap(), None);
        assert_eq!(ce(&["gzip"]).unwrap(), Some(Coding::Gzip));
        assert_eq!(ce(&["GZIP"]).unwrap(), Some(Coding::Gzip));
        assert_eq!(ce(&["x-gzip"]).unwrap(), Some(Coding::Gzip));
        assert_eq!(ce(&[" deflate "]).unwrap(), Some(Coding::Deflate));
        assert_eq!(ce(&["br"]).unwrap(), Some(Coding::Br));
        assert_eq!(ce(&["identity", "zstd"]).unwrap(), Some(Coding::Zstd));
    }

    #[test]
    fn unknown_or_stacked_codings_are_415_naming_them() {
        let ce = |v: &[&str]| content_coding(&with(header::CONTENT_ENCODING, v)).unwrap_err();
        let e = ce(&["x-unknown"]);
        assert_eq!(e.status().as_u16(), 415);
        assert!(e.message.contains("'x-unknown'"), "{}", e.message);
        assert_eq!(e.code.as_deref(), Some("unsupported_content_encoding"));
        let e = ce(&["gzip, br"]);
        assert!(e.message.contains("'gzip, br'"), "{}", e.message);
        let e = ce(&["gzip", "gzip"]);
        assert!(e.message.contains("stacks"), "{}", e.message);
        assert!(ce(&["compress"]).message.contains("'compress'"));
    }

    #[test]
    fn transfer_codings_other_than_chunked_are_501_naming_them() {
        let te = |v: &[&str]| check_transfer_coding(&with(header::TRANSFER_ENCODING, v));
        assert!(te(&[]).is_ok());
        assert!(te(&["chunked"]).is_ok());
        assert!(te(&["Chunked"]).is_ok());
        let e = te(&["gzip, chunked"]).unwrap_err();
        assert_eq!(e.status().as_u16(), 501);
        assert!(e.message.contains("'gzip'"), "{}", e.message);
    }
}
