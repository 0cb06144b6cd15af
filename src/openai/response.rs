//! Response bodies for both routes, non-streaming and streaming, in the shapes of the OpenAI
//! API reference (<https://platform.openai.com/docs/api-reference/chat/object>,
//! <https://platform.openai.com/docs/api-reference/chat/streaming>,
//! <https://platform.openai.com/docs/api-reference/completions/object>).
//! `created` is passed in (Unix seconds); nothing here reads a clock.
//!
//! Non-streaming:
//! ```text
//! chat: {"id":"chatcmpl-…","object":"chat.completion","created","model",
//!        "choices":[{"index","message":{"role":"assistant","content"},"logprobs","finish_reason"}],
//!        "usage":{"prompt_tokens","completion_tokens","total_tokens",
//!                 "prompt_tokens_details":{"cached_tokens"}}}
//! completions: {"id":"cmpl-…","object":"text_completion","created","model",
//!        "choices":[{"index","text","logprobs","finish_reason"}],"usage":{…}}
//! ```
//! `logprobs` is `null` unless the request asked for it: chat `{"content":[{"token","logprob",
//! "bytes","top_logprobs":[{"token","logprob","bytes"}]}]}`, completions `{"tokens",
//! "token_logprobs","top_logprobs":[{token: logprob}],"text_offset"}`. A non-finite logprob is
//! written as -9999.0, as OpenAI does. With `echo` (completions) the list starts with the
//! prompt's tokens, the first with `null` in `token_logprobs` and in `top_logprobs`.
//!
//! Streaming ([`StreamState`]):
//! - every chunk has the same `id`, `created` and `model`; `object` is `"chat.completion.chunk"`
//!   (chat) or `"text_completion"` (completions);
//! - a content chunk is `choices:[{"index","delta":{…},"logprobs","finish_reason":null}]`
//!   (completions: `"text"` instead of `"delta"`); every choice object has the key
//!   `finish_reason`, `null` until that index's finish chunk, never `""`;
//! - chat `delta.role = "assistant"` appears only in the first chunk of each index, together
//!   with that chunk's content (or alone, via [`StreamState::role_chunk`]);
//! - **finish chunk choice**: the finishing chunk always has an empty delta (`{}` for chat,
//!   `"text": ""` for completions), as OpenAI's API does; all text goes out in content chunks
//!   before it. A choice whose finish chunk is its first chunk gets
//!   `{"role":"assistant","content":""}` there;
//! - **`token_ids`** (vLLM's `return_token_ids` extension, asked per request): every choice
//!   object, streamed or not, carries the ids of the tokens it generated (streamed: since the
//!   previous chunk of that choice; the finish chunk's list is empty), the end-of-sequence or
//!   stop token included; a token whose text is empty still gets its chunk. vLLM's
//!   `prompt_token_ids` is not returned;
//! - **usage key choice**: chunks other than the usage chunk carry **no `usage` key at all**;
//!   with `include_usage`, one extra chunk `{"choices":[],"usage":{…}}` comes after every
//!   choice has finished, and only then ([`StreamState::usage`] returns `None` before that).

use std::fmt::Display;

use serde_json::{Map, Value, json};

use super::request::RequestKind;
use serde::{Deserialize, Serialize};

#[cfg(test)]
mod tests;

/// Why a sequence (one choice) finished: one type from the batch former through the wire to
/// the HTTP answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop token was sampled (reported as the update's token, never shown as text),
    /// or the gateway matched a stop string.
    Stop,
    /// `max_tokens` generated.
    Length,
    /// The context limit (`max_model_len`, or the KV pool's capacity if smaller) was reached.
    ContextLimit,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string: the context limit reads `"length"`, as in OpenAI's
    /// API and vLLM.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::ContextLimit => "length",
        }
    }
}

/// Token counts of a request, summed over its choices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens (once, not per choice).
    pub prompt_tokens: u32,
    /// Generated tokens, all choices together.
    pub completion_tokens: u32,
    /// Prompt tokens served from a prefix cache.
    pub cached_tokens: u32,
}

impl Usage {
    /// The `usage` object; `total_tokens` is the sum of the two counts.
    pub fn to_json(&self) -> Value {
        let total = u64::from(self.prompt_tokens) + u64::from(self.completion_tokens);
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// One token (generated, or of an echoed prompt) with its log-probability and the top
/// alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability; `None` for the first token of an echoed prompt (nothing before it
    /// to condition on): written `null`, and its `top_logprobs` entry `null`, as OpenAI and
    /// vLLM answer.
    pub logprob: Option<f32>,
    /// The most likely alternatives, best first.
    pub top: Vec<(String, f32)>,
}

/// What every body of one request shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResponseMeta {
    /// `chatcmpl-…` or `cmpl-…`, see [`response_id`].
    pub id: String,
    /// Unix seconds, passed in by the caller.
    pub created: u64,
    /// The served model's name (never a name the request made up that no worker serves).
    pub model: String,
}

/// A finished choice of a non-streaming response.
#[derive(Clone, Debug, PartialEq)]
pub struct ChoiceOutput {
    /// The generated text (stop strings already cut).
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Per-token logprobs when the request asked for them.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The generated token ids, when the request asked for them (`return_token_ids`).
    pub token_ids: Option<Vec<u32>>,
}

/// `chatcmpl-{unique}` for chat, `cmpl-{unique}` for completions.
pub fn response_id(kind: RequestKind, unique: impl Display) -> String {
    match kind {
        RequestKind::Chat => format!("chatcmpl-{unique}"),
        RequestKind::Completion => format!("cmpl-{unique}"),
    }
}

fn logprob_json(x: f32) -> f64 {
    if x.is_finite() { f64::from(x) } else { -9999.0 }
}

/// A token's logprob: [`logprob_json`], or `null` when it has none.
fn opt_logprob_json(x: Option<f32>) -> Value {
    x.map_or(Value::Null, |x| json!(logprob_json(x)))
}

/// Chat `logprobs` object for `tokens`.
pub fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    let entry = |token: &str, lp: Option<f32>| json!({"token": token, "logprob": opt_logprob_json(lp), "bytes": token.as_bytes()});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.token, t.logprob);
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|(tok, lp)| entry(tok, Some(*lp)))
                .collect();
            e["top_logprobs"] = Value::Array(top);
            e
        })
        .collect();
    json!({"content": content})
}

/// Completions `logprobs` object for `tokens`, whose text starts at char `offset` of the
/// choice's text.
pub fn completion_logprobs(tokens: &[TokenLogprob], offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    let mut at = offset;
    for t in tokens {
        text_offset.push(at);
        at += t.token.chars().count();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            if t.logprob.is_none() {
                return Value::Null; // an echoed prompt's first token
            }
            let m: Map<String, Value> = t
                .top
                .iter()
                .map(|(tok, lp)| (tok.clone(), json!(logprob_json(*lp))))
                .collect();
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| opt_logprob_json(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

fn object_name(kind: RequestKind, stream: bool) -> &'static str {
    match (kind, stream) {
        (RequestKind::Chat, false) => "chat.completion",
        (RequestKind::Chat, true) => "chat.completion.chunk",
        (RequestKind::Completion, _) => "text_completion",
    }
}

/// The non-streaming body of route `kind`.
pub fn completion_body(
    kind: RequestKind,
    meta: &ResponseMeta,
    choices: &[ChoiceOutput],
    usage: &Usage,
) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut choice = match kind {
                RequestKind::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": c.logprobs.as_deref().map(chat_logprobs),
                    "finish_reason": c.finish_reason.as_str(),
                }),
                RequestKind::Completion => json!({
                    "index": i,
                    "text": c.text,
                    "logprobs": c.logprobs.as_deref().map(|t| completion_logprobs(t, 0)),
                    "finish_reason": c.finish_reason.as_str(),
                }),
            };
            if let Some(ids) = &c.token_ids {
                choice["token_ids"] = json!(ids);
            }
            choice
        })
        .collect();
    json!({
        "id": meta.id,
        "object": object_name(kind, false),
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage.to_json(),
    })
}

/// Non-streaming `chat.completion` body.
pub fn chat_completion(meta: &ResponseMeta, choices: &[ChoiceOutput], usage: &Usage) -> Value {
    completion_body(RequestKind::Chat, meta, choices, usage)
}

/// Non-streaming `text_completion` body.
pub fn text_completion(meta: &ResponseMeta, choices: &[ChoiceOutput], usage: &Usage) -> Value {
    completion_body(RequestKind::Completion, meta, choices, usage)
}

#[derive(Clone, Debug, Default)]
struct ChoiceStream {
    role_sent: bool,
    finished: bool,
    /// Chars of text sent so far (completions `text_offset`).
    chars_sent: usize,
}

/// Per-request streaming state: produces the chunk objects of one stream in order and enforces
/// the rules in the module doc. Calls that would break a rule (content after a choice's finish,
/// a second finish, an index ≥ `n`, usage before every choice finished or twice) return `None`
/// and change nothing.
#[derive(Clone, Debug)]
pub struct StreamState {
    kind: RequestKind,
    meta: ResponseMeta,
    include_usage: bool,
    choices: Vec<ChoiceStream>,
    usage_sent: bool,
    /// Every choice object carries `token_ids` (`return_token_ids`).
    token_ids: bool,
}

impl StreamState {
    /// State for a stream of `n` choices (at least 1).
    pub fn new(kind: RequestKind, meta: ResponseMeta, n: u32, include_usage: bool) -> Self {
        let n = usize::try_from(n.max(1)).unwrap_or(1);
        Self {
            kind,
            meta,
            include_usage,
            choices: vec![ChoiceStream::default(); n],
            usage_sent: false,
            token_ids: false,
        }
    }

    /// Every content and finish chunk's choice carries `token_ids`: the ids generated since
    /// the previous chunk of that choice (vLLM's `return_token_ids`).
    pub fn with_token_ids(mut self) -> Self {
        self.token_ids = true;
        self
    }

    /// The id all chunks share.
    pub fn id(&self) -> &str {
        &self.meta.id
    }

    /// Whether every choice has sent its finish chunk.
    pub fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finished)
    }

    fn open(&mut self, index: u32) -> Option<&mut ChoiceStream> {
        let c = self.choices.get_mut(usize::try_from(index).ok()?)?;
        (!c.finished).then_some(c)
    }

    /// Render one chunk around `choice`: the shared fields borrowed, written straight into
    /// the JSON text (no intermediate `Value` tree: this runs once per streamed token).
    fn chunk<C: Serialize>(&self, choice: C) -> Chunk {
        Chunk::render(&ChunkOut {
            id: &self.meta.id,
            object: object_name(self.kind, true),
            created: self.meta.created,
            model: &self.meta.model,
            choices: [choice],
        })
    }

    /// A role-only first chunk (`{"role":"assistant","content":""}`) for a chat choice that has
    /// sent nothing yet, e.g. to start the stream before the first token. `None` on
    /// completions or when the role was already sent.
    pub fn role_chunk(&mut self, index: u32) -> Option<Chunk> {
        if self.kind != RequestKind::Chat {
            return None;
        }
        let c = self.open(index)?;
        if c.role_sent {
            return None;
        }
        c.role_sent = true;
        Some(self.chunk(ChoiceOut {
            index,
            delta: Some(Delta {
                role: Some("assistant"),
                content: Some(""),
            }),
            text: None,
            logprobs: None,
            finish_reason: None,
            token_ids: None,
        }))
    }

    /// A content chunk carrying `text` (and `logprobs`, when the request asked for them) for
    /// choice `index`. `None` when there is nothing to send (empty text and no logprobs).
    pub fn delta(
        &mut self,
        index: u32,
        text: &str,
        logprobs: Option<&[TokenLogprob]>,
    ) -> Option<Chunk> {
        self.delta_with_ids(index, text, logprobs, &[])
    }

    /// [`StreamState::delta`] that also carries `token_ids` (with
    /// [`StreamState::with_token_ids`]): a chunk is sent for ids alone too (an end-of-sequence
    /// token has no text).
    pub fn delta_with_ids(
        &mut self,
        index: u32,
        text: &str,
        logprobs: Option<&[TokenLogprob]>,
        token_ids: &[u32],
    ) -> Option<Chunk> {
        let kind = self.kind;
        let with_ids = self.token_ids;
        let logprobs = logprobs.filter(|l| !l.is_empty());
        if text.is_empty() && logprobs.is_none() && (token_ids.is_empty() || !with_ids) {
            return None;
        }
        let c = self.open(index)?;
        let offset = c.chars_sent;
        c.chars_sent += text.chars().count();
        let choice = match kind {
            RequestKind::Chat => {
                let role = (!c.role_sent).then_some("assistant");
                c.role_sent = true;
                ChoiceOut {
                    index,
                    delta: Some(Delta {
                        role,
                        content: Some(text),
                    }),
                    text: None,
                    logprobs: logprobs.map(chat_logprobs),
                    finish_reason: None,
                    token_ids: with_ids.then_some(token_ids),
                }
            }
            RequestKind::Completion => ChoiceOut {
                index,
                delta: None,
                text: Some(text),
                logprobs: logprobs.map(|l| completion_logprobs(l, offset)),
                finish_reason: None,
                token_ids: with_ids.then_some(token_ids),
            },
        };
        Some(self.chunk(choice))
    }

    /// The finish chunk of choice `index`: empty delta, `finish_reason` set.
    pub fn finish(&mut self, index: u32, reason: FinishReason) -> Option<Chunk> {
        let kind = self.kind;
        let c = self.open(index)?;
        c.finished = true;
        let (delta, text) = match kind {
            RequestKind::Chat => {
                let delta = if c.role_sent {
                    Delta::default()
                } else {
                    Delta {
                        role: Some("assistant"),
                        content: Some(""),
                    }
                };
                c.role_sent = true;
                (Some(delta), None)
            }
            RequestKind::Completion => (None, Some("")),
        };
        Some(self.chunk(ChoiceOut {
            index,
            delta,
            text,
            logprobs: None,
            finish_reason: Some(reason.as_str()),
            token_ids: self.token_ids.then_some(&[]),
        }))
    }

    /// The usage chunk (`choices: []`), once, only with `include_usage` and only after every
    /// choice has finished.
    pub fn usage(&mut self, usage: &Usage) -> Option<Chunk> {
        if !self.include_usage || self.usage_sent || !self.all_finished() {
            return None;
        }
        self.usage_sent = true;
        Some(Chunk::render(&json!({
            "id": self.meta.id,
            "object": object_name(self.kind, true),
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [],
            "usage": usage.to_json(),
        })))
    }
}

/// One streamed chunk, rendered: a compact JSON object on one line (compact JSON escapes
/// every newline inside strings, so it fits one SSE `data:` line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk(String);

impl Chunk {
    fn render<T: Serialize>(body: &T) -> Self {
        // Serializing these structs and `Value`s cannot fail: every map key is a string.
        Self(serde_json::to_string(body).unwrap_or_else(|_| String::from("{}")))
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The chunk parsed back into a `Value` (for tests and tools).
    pub fn to_value(&self) -> Value {
        serde_json::from_str(&self.0).unwrap_or(Value::Null)
    }
}

/// A streamed chunk's envelope, in the key order of the OpenAI reference.
#[derive(Serialize)]
struct ChunkOut<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [C; 1],
}

/// One choice of a streamed chunk: chat chunks carry `delta`, completions `text`; `logprobs`
/// and `finish_reason` are always present (`null` until set); `token_ids` only when asked.
#[derive(Serialize)]
struct ChoiceOut<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    logprobs: Option<Value>,
    finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
}

/// A chat chunk's `delta`: `{}` on a finish chunk, `role` only in a choice's first chunk.
#[derive(Default, Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}
