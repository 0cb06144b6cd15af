//! The Messages API's answers: the message object of a non-streamed request and the event
//! sequence of a streamed one.
//!
//! A message: `{"id":"msg_…","type":"message","role":"assistant","model",
//! "content":[{"type":"text","text":…}],"stop_reason","stop_sequence","usage"}` — always
//! exactly one text block (possibly empty), so a streamed and a non-streamed answer have the
//! same blocks.
//!
//! `usage` ([`MessageUsage`]) follows Anthropic's split of the prompt: `input_tokens` are the
//! prompt tokens *not* read from the cache, `cache_read_input_tokens` those the prefix cache
//! served (their sum is the whole prompt, the chat route's `prompt_tokens`);
//! `cache_creation_input_tokens` is 0 (caching here is automatic; nothing is billed for
//! writing it). `output_tokens` counts every generated token, as the chat route's
//! `completion_tokens` does (the end-of-sequence token and a stop sequence's tokens included).
//!
//! A stream ([`MessageStream`]), each record `event: <type>` then `data: <json>` with the same
//! `type` inside: `message_start` (the message with empty `content`, null `stop_reason`, the
//! prompt's usage and `output_tokens` 0), `content_block_start` (index 0, an empty text block),
//! `ping`, `content_block_delta` (`text_delta`) per piece of text, `content_block_stop`,
//! `message_delta` (`stop_reason`, `stop_sequence`, `usage.output_tokens`), `message_stop`. A
//! failure after the headers are out is one `error` event with the error object
//! (`anthropic::error`), and the stream ends there.

use serde_json::{Value, json};

use crate::openai::response::{FinishReason, Usage};

#[cfg(test)]
mod tests;

/// Why generation stopped, in Anthropic's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model ended its turn (end-of-sequence token).
    EndTurn,
    /// `max_tokens` generated.
    MaxTokens,
    /// A `stop_sequences` entry matched (named in `stop_sequence`).
    StopSequence,
    /// The context window (or the KV pool's capacity) was full.
    ContextWindowExceeded,
}

impl StopReason {
    /// From the gateway's finish reason and the stop sequence that matched, if any.
    pub fn of(finish: FinishReason, stop_sequence: Option<&str>) -> Self {
        match (finish, stop_sequence) {
            (FinishReason::Stop, Some(_)) => StopReason::StopSequence,
            (FinishReason::Stop, None) => StopReason::EndTurn,
            (FinishReason::Length, _) => StopReason::MaxTokens,
            (FinishReason::ContextLimit, _) => StopReason::ContextWindowExceeded,
        }
    }

    /// The `stop_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopSequence => "stop_sequence",
            StopReason::ContextWindowExceeded => "model_context_window_exceeded",
        }
    }
}

/// `msg_{unique}`.
pub fn message_id(unique: impl std::fmt::Display) -> String {
    format!("msg_{unique}")
}

/// A message's `usage`, in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MessageUsage {
    /// Prompt tokens not served from the prefix cache.
    pub input_tokens: u32,
    /// Prompt tokens the prefix cache served.
    pub cache_read_input_tokens: u32,
    /// Generated tokens.
    pub output_tokens: u32,
}

impl From<&Usage> for MessageUsage {
    fn from(u: &Usage) -> Self {
        let cached = u.cached_tokens.min(u.prompt_tokens);
        Self {
            input_tokens: u.prompt_tokens - cached,
            cache_read_input_tokens: cached,
            output_tokens: u.completion_tokens,
        }
    }
}

impl MessageUsage {
    /// The `usage` object.
    pub fn to_json(self) -> Value {
        json!({
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "output_tokens": self.output_tokens,
        })
    }
}

/// How a message ended: its reason and the stop sequence that matched (with
/// [`StopReason::StopSequence`] only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    /// `stop_reason`.
    pub reason: StopReason,
    /// `stop_sequence`.
    pub stop_sequence: Option<String>,
}

impl Ending {
    /// From the gateway's finish reason and the stop string that matched.
    pub fn of(finish: FinishReason, stop_sequence: Option<&str>) -> Self {
        let reason = StopReason::of(finish, stop_sequence);
        Self {
            reason,
            stop_sequence: stop_sequence
                .filter(|_| reason == StopReason::StopSequence)
                .map(str::to_owned),
        }
    }
}

fn message(id: &str, model: &str, content: Value, ending: Option<&Ending>, usage: Value) -> Value {
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": ending.map(|e| e.reason.as_str()),
        "stop_sequence": ending.and_then(|e| e.stop_sequence.as_deref()),
        "usage": usage,
    })
}

/// The message object of a non-streamed request.
pub fn message_body(
    id: &str,
    model: &str,
    text: &str,
    ending: &Ending,
    usage: MessageUsage,
) -> Value {
    message(
        id,
        model,
        json!([{"type": "text", "text": text}]),
        Some(ending),
        usage.to_json(),
    )
}

/// One streamed event: its name (the SSE `event:` field) and its data (whose `type` is the
/// same name).
#[derive(Clone, Debug, PartialEq)]
pub struct StreamEvent {
    /// `message_start`, `content_block_delta`, …
    pub name: &'static str,
    /// The JSON object, `{"type": name, …}`.
    pub data: Value,
}

impl StreamEvent {
    fn new(name: &'static str, mut data: Value) -> Self {
        data["type"] = json!(name);
        Self { name, data }
    }

    /// As an axum SSE event: `event: <name>` and one `data:` line.
    pub fn to_sse(&self) -> axum::response::sse::Event {
        axum::response::sse::Event::default()
            .event(self.name)
            .data(self.data.to_string())
    }
}

/// The event sequence of one streamed message (one text block at index 0).
#[derive(Clone, Debug)]
pub struct MessageStream {
    id: String,
    model: String,
    started: bool,
}

impl MessageStream {
    /// A stream for message `id` of `model`.
    pub fn new(id: String, model: String) -> Self {
        Self {
            id,
            model,
            started: false,
        }
    }

    /// `message_start` (with the prompt's usage, `output_tokens` 0), `content_block_start`
    /// and a `ping`; empty when called again.
    pub fn start(&mut self, prompt: MessageUsage) -> Vec<StreamEvent> {
        if std::mem::replace(&mut self.started, true) {
            return Vec::new();
        }
        let usage = MessageUsage {
            output_tokens: 0,
            ..prompt
        };
        vec![
            StreamEvent::new(
                "message_start",
                json!({"message": message(&self.id, &self.model, json!([]), None, usage.to_json())}),
            ),
            StreamEvent::new(
                "content_block_start",
                json!({"index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
            StreamEvent::new("ping", json!({})),
        ]
    }

    /// A `content_block_delta` carrying `text`; none for empty text.
    pub fn delta(&self, text: &str) -> Option<StreamEvent> {
        (!text.is_empty()).then(|| {
            StreamEvent::new(
                "content_block_delta",
                json!({"index": 0, "delta": {"type": "text_delta", "text": text}}),
            )
        })
    }

    /// `content_block_stop`, `message_delta` (the ending, `usage.output_tokens`) and
    /// `message_stop`.
    pub fn finish(&self, ending: &Ending, output_tokens: u32) -> Vec<StreamEvent> {
        vec![
            StreamEvent::new("content_block_stop", json!({"index": 0})),
            StreamEvent::new(
                "message_delta",
                json!({
                    "delta": {
                        "stop_reason": ending.reason.as_str(),
                        "stop_sequence": ending.stop_sequence,
                    },
                    "usage": {"output_tokens": output_tokens},
                }),
            ),
            StreamEvent::new("message_stop", json!({})),
        ]
    }
}
