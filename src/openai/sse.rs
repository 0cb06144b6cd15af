//! The SSE wire format of streaming responses (case B01), in one place
//! (<https://html.spec.whatwg.org/multipage/server-sent-events.html>, OpenAI streaming:
//! <https://platform.openai.com/docs/api-reference/chat/streaming>).
//!
//! - a data record is `data: ` (colon, one space), one compact JSON object on one line, and a
//!   blank line: `data: {"id":…}\n\n`. Compact JSON never contains a raw newline (newlines in
//!   strings are escaped), so one record is always one `data:` line;
//! - the stream ends with [`DONE`] (`data: [DONE]\n\n`) exactly once, after which the
//!   response body ends;
//! - an error after the headers are out is one record `data: {"error":{…}}\n\n` ([`error`]),
//!   the same object as the JSON error body; `[DONE]` may follow it;
//! - a keep-alive is the comment record [`KEEP_ALIVE`] (`: keep-alive\n\n`), which SSE clients
//!   ignore.
//!
//! Handlers that use axum's `Sse` type instead must produce the same bytes.

use serde_json::Value;

use crate::openai::error::ApiError;

#[cfg(test)]
mod tests;

/// `Content-Type` of a stream.
pub const CONTENT_TYPE: &str = "text/event-stream";

/// The closing record.
pub const DONE: &str = "data: [DONE]\n\n";

/// The keep-alive comment record.
pub const KEEP_ALIVE: &str = ": keep-alive\n\n";

/// One data record carrying `json` on a single line.
pub fn data(json: &Value) -> String {
    format!("data: {json}\n\n")
}

/// One data record carrying the OpenAI error object of `err`.
pub fn error(err: &ApiError) -> String {
    data(&err.body())
}
