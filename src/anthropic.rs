//! Anthropic's Messages API (`POST /v1/messages`) as wire shapes over the gateway's one
//! generation pipeline: pure functions, no actors, no tokio, no clock reads. Shapes follow
//! Anthropic's API reference (<https://docs.anthropic.com/en/api/messages>, streaming:
//! <https://docs.anthropic.com/en/docs/build-with-claude/streaming>, errors:
//! <https://docs.anthropic.com/en/api/errors>).
//!
//! A Messages body is parsed into the same [`GenerationRequest`](crate::openai::request::GenerationRequest)
//! as a chat completion (`system` first, then the turns), so the Frontend renders it through
//! the same chat template into the same token ids: a conversation's prefix is cached once for
//! both APIs, and the greedy text equals the chat route's.
//!
//! Layout (unit tests in each module's sibling `tests.rs`):
//! - `request.rs` — parse and validate a Messages body; what is refused and why.
//! - `response.rs` — the message object, `stop_reason`, `usage`, and the streaming event
//!   sequence (`MessageStream`).
//! - `error.rs` — the error object `{"type":"error","error":{"type","message"}}` and the status
//!   of each error kind.

pub mod error;
pub mod request;
pub mod response;
