//! The OpenAI-compatible wire protocol of the gateway: pure, synchronous functions and small
//! state machines that the HTTP handlers drive (no actors, no tokio, no clock reads).
//!
//! Layout (unit tests in each module's sibling `tests.rs`):
//! - `request.rs` — parse and validate chat / completions bodies into a `GenerationRequest`; context and model checks.
//! - `request/input.rs` — `messages` / `prompt` parsing.
//! - `request/limits.rs` — `check_context` and `check_model` / `model_not_found`.
//! - `json.rs` — typed reads of JSON fields that fail with an `ApiError` naming the field.
//! - `response.rs` — non-streaming response bodies and the per-request streaming chunk state (`StreamState`).
//! - `stop.rs` — incremental stop-string matcher that holds back possible stop prefixes.
//! - `detok.rs` — incremental detokenizer that never emits broken UTF-8 or special tokens.
//! - `sse.rs` — the SSE records as axum events: data records, `[DONE]`, error records,
//!   keep-alives.
//!
//! A streaming request flows: tokens → `detok::IncrementalDetokenizer` → `stop::StopMatcher`
//! → `response::StreamState` → `sse::data`. Errors before the stream are answered as
//! `ApiError` JSON bodies; after the headers are out, as one `sse::error` record.

pub mod detok;
pub mod error;
pub(crate) mod json;
pub mod request;
pub mod response;
pub mod sse;
pub mod stop;
