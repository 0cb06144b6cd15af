//! The SSE records of streaming responses, as axum [`Event`]s
//! (<https://html.spec.whatwg.org/multipage/server-sent-events.html>, OpenAI streaming:
//! <https://platform.openai.com/docs/api-reference/chat/streaming>). axum's `Sse` writes them
//! and sets `Content-Type: text/event-stream` and `Cache-Control: no-cache`.
//!
//! - a data record is `data: ` (colon, one space), one compact JSON object on one line, and a
//!   blank line: `data: {"id":…}\n\n`. Compact JSON never contains a raw newline (newlines in
//!   strings are escaped), so one record is always one `data:` line;
//! - the stream ends with [`done`] (`data: [DONE]\n\n`) exactly once, after which the
//!   response body ends;
//! - an error after the headers are out is one record `data: {"error":{…}}\n\n` ([`error`]),
//!   the same object as the JSON error body; `[DONE]` may follow it;
//! - a keep-alive is the comment record `: keep-alive\n\n` ([`keep_alive`]), which SSE clients
//!   ignore, sent after each interval in which no record went out.

use std::time::Duration;

use axum::response::sse::{Event, KeepAlive};
use serde_json::Value;

use crate::openai::error::ApiError;
use crate::openai::response::Chunk;

#[cfg(test)]
mod tests;

/// One data record carrying `json` on a single line.
pub fn data(json: &Value) -> Event {
    Event::default().data(json.to_string())
}

/// One data record carrying a rendered streaming chunk.
pub fn chunk(chunk: &Chunk) -> Event {
    Event::default().data(chunk.as_str())
}

/// One data record carrying the OpenAI error object of `err`.
pub fn error(err: &ApiError) -> Event {
    data(&err.body())
}

/// The closing record, `data: [DONE]`.
pub fn done() -> Event {
    Event::default().data("[DONE]")
}

/// A `: keep-alive` comment after every `interval` without a record.
pub fn keep_alive(interval: Duration) -> KeepAlive {
    KeepAlive::new().interval(interval).text("keep-alive")
}
