//! The wire shapes of the generation routes over their one pipeline: which API a request came
//! in through ([`Api`]: its parser, error shape and `route` label) and a stream's records in
//! that API's shape ([`StreamOut`]: OpenAI's chunks and `[DONE]`, or Anthropic's events).

use super::{Choice, Produced, Started};
use crate::anthropic;
use crate::openai::error::ApiError;
use crate::openai::request::{RequestKind, parse_request};
use crate::openai::response::{StreamState, Usage};
use crate::openai::sse;
use axum::response::{IntoResponse, Response};

/// Which API a generation request came in through: its parser, its wire shapes and its
/// `route` label in `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/messages` (Anthropic's Messages API).
    Messages,
}

impl Api {
    /// The request kind the pipeline runs (a Messages request is a chat).
    pub(super) fn kind(self) -> RequestKind {
        match self {
            Api::Chat | Api::Messages => RequestKind::Chat,
            Api::Completions => RequestKind::Completion,
        }
    }

    /// The `route` label of `flotilla_requests_total`.
    pub(super) fn route(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Messages => "messages",
        }
    }

    /// Parse and validate a body of this API.
    pub(super) fn parse(
        self,
        body: &[u8],
    ) -> Result<crate::openai::request::GenerationRequest, ApiError> {
        match self {
            Api::Messages => Ok(anthropic::request::parse_messages_request(body)?.generation),
            api => parse_request(api.kind(), body),
        }
    }

    /// The HTTP status `e` is answered with.
    pub(super) fn status(self, e: &ApiError) -> u16 {
        match self {
            Api::Messages => anthropic::error::status(e).as_u16(),
            _ => e.status().as_u16(),
        }
    }

    /// `e` in this API's error shape.
    pub(super) fn error_response(self, e: &ApiError) -> Response {
        match self {
            Api::Messages => anthropic::error::response(e),
            _ => e.clone().into_response(),
        }
    }

    /// A failure after a stream's headers are out, in this API's shape.
    pub(super) fn error_event(self, e: &ApiError) -> axum::response::sse::Event {
        match self {
            Api::Messages => anthropic::error::sse(e),
            _ => sse::error(e),
        }
    }
}

/// A stream's records in its API's shape: OpenAI's chunks, or Anthropic's events.
pub(super) enum StreamOut {
    OpenAi(StreamState),
    Anthropic {
        events: anthropic::response::MessageStream,
        ending: Option<anthropic::response::Ending>,
    },
}

impl StreamOut {
    pub(super) fn new(st: &Started) -> Self {
        match st.api {
            Api::Messages => StreamOut::Anthropic {
                events: anthropic::response::MessageStream::new(
                    st.meta.id.clone(),
                    st.meta.model.clone(),
                ),
                ending: None,
            },
            _ => {
                let state = StreamState::new(
                    st.kind,
                    st.meta.clone(),
                    st.choices.len() as u32,
                    st.include_usage,
                );
                if st.choices.first().is_some_and(|c| c.text.want_ids) {
                    StreamOut::OpenAi(state.with_token_ids())
                } else {
                    StreamOut::OpenAi(state)
                }
            }
        }
    }

    /// The records before any text: Anthropic's `message_start` (with the prompt's usage),
    /// `content_block_start`, `ping`; none for OpenAI.
    pub(super) fn open(&mut self, usage: &Usage) -> Vec<axum::response::sse::Event> {
        match self {
            StreamOut::OpenAi(_) => Vec::new(),
            StreamOut::Anthropic { events, .. } => events
                .start(usage.into())
                .iter()
                .map(|e| e.to_sse())
                .collect(),
        }
    }

    /// The records of what one event of choice `i` produced.
    pub(super) fn produced(&mut self, i: u32, p: &Produced) -> Option<axum::response::sse::Event> {
        match self {
            StreamOut::OpenAi(state) => {
                let lp = (!p.logprobs.is_empty()).then_some(p.logprobs.as_slice());
                state
                    .delta_with_ids(i, &p.text, lp, &p.token_ids)
                    .map(|c| sse::chunk(&c))
            }
            StreamOut::Anthropic { events, .. } => events.delta(&p.text).map(|e| e.to_sse()),
        }
    }

    /// Choice `i` finished: OpenAI's finish chunk; Anthropic's ending is kept for `close`.
    pub(super) fn finished(&mut self, i: u32, c: &Choice) -> Option<axum::response::sse::Event> {
        let reason = c.text.finish?;
        match self {
            StreamOut::OpenAi(state) => state.finish(i, reason).map(|c| sse::chunk(&c)),
            StreamOut::Anthropic { ending, .. } => {
                *ending = Some(anthropic::response::Ending::of(
                    reason,
                    c.text.stop_sequence.as_deref(),
                ));
                None
            }
        }
    }

    /// The closing records: OpenAI's usage chunk (if asked for) and `[DONE]`; Anthropic's
    /// `content_block_stop`, `message_delta`, `message_stop`.
    pub(super) fn close(&mut self, usage: &Usage) -> Vec<axum::response::sse::Event> {
        match self {
            StreamOut::OpenAi(state) => state
                .usage(usage)
                .map(|c| sse::chunk(&c))
                .into_iter()
                .chain([sse::done()])
                .collect(),
            StreamOut::Anthropic { events, ending } => {
                let ending = ending.take().unwrap_or(anthropic::response::Ending {
                    reason: anthropic::response::StopReason::EndTurn,
                    stop_sequence: None,
                });
                events
                    .finish(&ending, usage.completion_tokens)
                    .iter()
                    .map(|e| e.to_sse())
                    .collect()
            }
        }
    }
}
