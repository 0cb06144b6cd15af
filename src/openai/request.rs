//! Parse and validate `POST /v1/chat/completions` and `POST /v1/completions` bodies into one
//! normalized [`GenerationRequest`]. Field semantics follow the OpenAI API reference
//! (<https://platform.openai.com/docs/api-reference/chat/create> and
//! <https://platform.openai.com/docs/api-reference/completions/create>).
//!
//! Every failure is an [`ApiError`] in the OpenAI error shape, never axum's plain-text
//! rejection, so handlers take the body as `Bytes` and call [`parse_request`]:
//! - body that is not JSON: 400 `invalid_request_error`, `param: null`;
//! - body that is JSON but not an object: 400, `param: null`;
//! - missing or mistyped field: 400, `param` names it (`"messages"`, `"max_tokens"`; nested
//!   fields as `messages[2].content`, `stream_options.include_usage`).
//!
//! `null` is read as "absent" for every field. When several fields are wrong, the first one in
//! the order of [`GenerationRequest`]'s fields is reported.
//!
//! | field | accepted | default |
//! |---|---|---|
//! | `model` | string, required | — |
//! | `messages` (chat) | non-empty array of `{role, content}`; roles `system`, `developer` (read as system), `user`, `assistant`; `tool`/`function` → 400 "not supported"; `content` a string or an array of `{"type":"text","text":…}` parts, joined with `"\n"`; assistant `content` may be null (→ `""`) | required |
//! | `prompt` (completions) | string, `[token id]`, or a list of prompts: `[string, …]` or `[[token id, …], …]` (one kind per list; a list of one is a single prompt). Each prompt gets `n` choices, ordered prompt-major (`index = prompt_index × n + j`), and each prompt is placed on its own. An empty list or prompt (`prompt[i]` named), a mixed list, a token id that is not an integer in `0..=u32::MAX` (or, at the frontend, outside the vocabulary), or prompts × `n` over [`MAX_PROMPT_CHOICES`] → 400 `param: "prompt"` | required |
//! | `max_completion_tokens`, `max_tokens` | integer ≥ 1, or ≥ 0 with `echo: true` (each checked, each names itself; 0 without echo → 400 as vLLM answers); `max_completion_tokens` wins when both are set (OpenAI's current API) | none = up to the context limit ([`check_context`]); note OpenAI's legacy completions default is 16, Flotilla's is not |
//! | `echo` (completions) | boolean: each choice's `text` is its prompt followed by the completion, and with `logprobs` the logprobs cover the prompt's tokens first (the first one `null`, each later one log P(token \| the tokens before it), with its alternatives), then the generated ones; streamed, the prompt comes in the first chunk of each choice. With `max_tokens: 0` the answer is the prompt alone, `finish_reason: "length"`. Token-id and batch prompts too. A worker computes every prompt position for it (its prefix cache is bypassed) | false |
//! | `temperature` | 0..=2 | 1.0 |
//! | `top_p` | 0 < p ≤ 1 | 1.0 |
//! | `top_k` (extension) | integer ≥ -1; 0 and -1 mean off | off |
//! | `seed` | any 64-bit integer (negative seeds are kept as their two's-complement `u64`) | none |
//! | `stop` | string or array of ≤ 4 non-empty strings | none |
//! | `stream` | boolean | false |
//! | `stream_options` | object `{include_usage: bool}`, only with `stream: true`, else 400 `param: "stream_options"` | include_usage false |
//! | `n` | integer 1..=[`MAX_N`] | 1 |
//! | `presence_penalty`, `frequency_penalty` | 0 only (penalties are not implemented); other values in -2..=2 → 400 "not supported", outside → 400 range | 0 |
//! | `logprobs` | chat: boolean; completions: integer 0..=5, the alternatives per token (0: the chosen token's logprob only) | off |
//! | `top_logprobs` (chat) | integer 0..=20, requires `logprobs: true`: the alternatives per token | 0 |
//! | `user` | string (an end-user id; not used) | none |
//! | `ignore_eos` (extension) | boolean | false |
//! | `priority_class` (extension) | string: the request's priority class (`request_plane/priority.rs`; the `x-priority-class` header wins, and they must agree); an unknown class → 400 at the gateway | `priority.default` |
//! | `return_token_ids` (extension, vLLM's) | boolean: each choice also carries its generated `token_ids` | false |
//! | `response_format` | `{"type":"text"}`; `json_object` / `json_schema` → 400 "not supported" | text |
//! | `tool_choice`, `function_call` (chat) | `"none"` or `"auto"` (a plain answer: there are no tools); `"required"` or a named function → 400 `param` = the field | none |
//! | `modalities` (chat) | `["text"]` | text |
//! | `service_tier` (chat) | `"auto"` or `"default"` | auto |
//! | `tools`, `functions`, `parallel_tool_calls`, `store`, `metadata`, `audio`, `prediction`, `reasoning_effort`, `web_search_options` (chat); `suffix`, `best_of` (completions); `logit_bias` | only their unset value (null, false, "", [], {}, best_of 1); anything else → 400 "not supported" | — |
//! | any other field (or a chat-only field on completions and back) | 400 `Unrecognized request argument supplied: X`, `param` = X, as OpenAI answers | — |
//!
//! The audit of unknown and unsupported fields is in [`fields`].

use serde::Serialize;
use serde_json::Value;

use super::json::{
    Obj, as_str, clip, describe, field, get_bool, get_int, get_number, get_str, invalid, type_name,
};
use crate::openai::error::{ApiError, ErrorKind};

pub mod fields;
mod input;
mod limits;
#[cfg(test)]
mod tests;

use input::{parse_messages, parse_prompt};
pub use limits::{check_context, check_model, model_not_found};

/// Largest accepted `n`.
pub const MAX_N: u32 = 8;
/// Most choices one `/v1/completions` request may ask for over a list of prompts (prompts ×
/// `n`). Admission decides once per request, before any choice is placed, and each choice is
/// one sequence on a worker: the cap bounds what one admission decision may add to the fleet
/// to one replica's default running batch (`worker.max_num_seqs`, 64). A larger list is a 400
/// naming `prompt`; send several requests instead.
pub const MAX_PROMPT_CHOICES: u32 = 64;
/// Most stop sequences per request (as in OpenAI).
pub const MAX_STOP: usize = 4;
/// Largest chat `top_logprobs` (as in OpenAI).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Largest completions `logprobs` (as in OpenAI).
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// Which route the request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completion,
}

impl RequestKind {
    /// The field that carries the input: `"messages"` or `"prompt"`.
    pub fn input_param(self) -> &'static str {
        match self {
            RequestKind::Chat => "messages",
            RequestKind::Completion => "prompt",
        }
    }
}

/// A chat role after normalization (`developer` becomes `System`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// `system` or `developer`.
    System,
    /// `user`.
    User,
    /// `assistant`.
    Assistant,
}

/// One chat message with its content flattened to text; serializes as `{"role","content"}` for
/// chat templates.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// Text content (text parts joined with `"\n"`).
    pub content: String,
}

/// The model input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Chat messages, to be rendered by the model's chat template.
    Chat(Vec<ChatMessage>),
    /// A completions prompt string, to be tokenized.
    Text(String),
    /// A completions prompt given as token ids (not yet checked against the vocabulary).
    Tokens(Vec<u32>),
    /// Two or more completions prompts, each a [`Input::Text`] or each a [`Input::Tokens`],
    /// in the request's order; at most [`MAX_PROMPT_CHOICES`] / `n` of them.
    Batch(Vec<Input>),
}

impl Input {
    /// Whether a completions prompt is empty (never true of chat messages or a batch).
    pub fn is_empty_prompt(&self) -> bool {
        match self {
            Input::Text(s) => s.is_empty(),
            Input::Tokens(t) => t.is_empty(),
            Input::Chat(_) | Input::Batch(_) => false,
        }
    }

    /// The prompts answered separately: the items of a batch, else the input itself.
    pub fn prompts(&self) -> &[Input] {
        match self {
            Input::Batch(items) => items,
            one => std::slice::from_ref(one),
        }
    }
}

/// Sampling parameters, normalized.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// 0..=2; 0 means greedy. Default 1.0.
    pub temperature: f32,
    /// 0 < p ≤ 1. Default 1.0.
    pub top_p: f32,
    /// `None` = off (the request said 0, -1 or nothing).
    pub top_k: Option<u32>,
    /// Fixed seed, if any.
    pub seed: Option<u64>,
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            seed: None,
        }
    }
}

/// A validated request of either route.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationRequest {
    /// The route.
    pub kind: RequestKind,
    /// Requested model name (check it with [`check_model`]).
    pub model: String,
    /// Messages, prompt text or prompt tokens.
    pub input: Input,
    /// Most tokens to generate; `None` = up to the context limit.
    pub max_tokens: Option<u32>,
    /// The field `max_tokens` came from (`"max_completion_tokens"` or `"max_tokens"`, the latter
    /// when neither was given), for error messages.
    pub max_tokens_param: &'static str,
    /// `echo` (completions): each choice's text starts with its prompt, and with `logprobs`
    /// its logprobs cover the prompt's tokens first (the first one `null`); with it
    /// `max_tokens` may be 0 (the prompt alone, [`GenerationRequest::prompt_only`]).
    pub echo: bool,
    /// Sampling parameters.
    pub sampling: Sampling,
    /// Stop strings (≤ [`MAX_STOP`], none empty).
    pub stop: Vec<String>,
    /// Whether to stream (SSE).
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Choices to generate, 1..=[`MAX_N`].
    pub n: u32,
    /// `None` = no logprobs; `Some(k)` = logprobs with `k` alternatives per token.
    pub logprobs: Option<u32>,
    /// Extension: keep generating past end-of-sequence.
    pub ignore_eos: bool,
    /// Extension (vLLM's): each choice carries the ids it generated.
    pub return_token_ids: bool,
    /// End-user id, passed through.
    pub user: Option<String>,
    /// Extension: the priority class named in the body (resolved against the configured
    /// classes at the gateway, `request_plane/priority.rs`).
    pub priority_class: Option<String>,
}

impl GenerationRequest {
    /// `echo` with `max_tokens` (or `max_completion_tokens`) 0: the answer is the prompt alone
    /// (with its logprobs), `finish_reason` `"length"`, no completion tokens — what evaluation
    /// harnesses send to score a text.
    pub fn prompt_only(&self) -> bool {
        self.echo && self.max_tokens == Some(0)
    }

    /// [`check_context`] with this request's `max_tokens` and field names: a prompt that alone
    /// fills the context gets `param` = `"messages"` / `"prompt"`, an overflow caused by the
    /// requested count gets the max-tokens field actually used.
    ///
    /// # Errors
    /// See [`check_context`].
    ///
    /// `echo` with `max_tokens` 0 ([`GenerationRequest::prompt_only`]) returns 1: the worker
    /// runs the prompt and samples one token, which the gateway drops (as vLLM does).
    pub fn check_context(&self, prompt_tokens: usize, context_len: usize) -> Result<u32, ApiError> {
        let max_tokens = if self.prompt_only() {
            Some(1)
        } else {
            self.max_tokens
        };
        check_context(
            prompt_tokens,
            max_tokens,
            context_len,
            self.max_tokens_param,
        )
        .map_err(|mut e| {
            if e.param.is_none() {
                e.param = Some(self.kind.input_param().to_owned());
            }
            e
        })
    }
}

/// Parse a `POST /v1/chat/completions` body.
///
/// # Errors
/// See [`parse_request`].
pub fn parse_chat(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    parse_request(RequestKind::Chat, body)
}

/// Parse a `POST /v1/completions` body.
///
/// # Errors
/// See [`parse_request`].
pub fn parse_completion(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    parse_request(RequestKind::Completion, body)
}

/// Parse and validate a body of route `kind`; see the module doc for every field.
///
/// # Errors
/// A 400 [`ApiError`] naming the field (`param`) when the body is not a JSON
/// object, a field is unknown, of the wrong type or out of range, or asks for something
/// this server does not do.
pub fn parse_request(kind: RequestKind, body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "We could not parse the JSON body of your request ({e}); expected a JSON object."
            ),
        )
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "The request body must be a JSON object, got {}.",
                type_name(&value)
            ),
        ));
    };
    from_object(kind, &obj)
}

fn from_object(kind: RequestKind, obj: &Obj) -> Result<GenerationRequest, ApiError> {
    let model = get_str(obj, "model")?
        .ok_or_else(|| invalid("model", "you must provide a model parameter"))?
        .to_owned();
    let input = match kind {
        RequestKind::Chat => Input::Chat(parse_messages(obj)?),
        RequestKind::Completion => parse_prompt(obj)?,
    };
    let u32_max = i128::from(u32::MAX);
    // `echo` (completions only; chat refuses it as unknown in the audit below): the prompt is
    // returned with the completion, and 0 tokens may be asked for (the prompt alone).
    let echo = match kind {
        RequestKind::Completion => get_bool(obj, "echo")?.unwrap_or(false),
        RequestKind::Chat => false,
    };
    let least = i128::from(!echo);
    let max_tokens = get_int(obj, "max_tokens", least, u32_max)?;
    let max_completion_tokens = get_int(obj, "max_completion_tokens", least, u32_max)?;
    let (max_tokens, max_tokens_param) = match (max_completion_tokens, max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    let sampling = parse_sampling(obj)?;
    let stop = parse_stop(obj)?;
    let stream = get_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = parse_stream_options(obj, stream)?;
    let n = get_int(obj, "n", 1, i128::from(MAX_N))?.unwrap_or(1);
    let prompts = input.prompts().len() as i128;
    if prompts > 1 && prompts * n > i128::from(MAX_PROMPT_CHOICES) {
        return Err(invalid(
            "prompt",
            format!(
                "{prompts} prompts with n = {n} ask for {} choices; at most {MAX_PROMPT_CHOICES} \
                 per request",
                prompts * n
            ),
        ));
    }
    let logprobs = parse_logprobs(kind, obj)?;
    let ignore_eos = get_bool(obj, "ignore_eos")?.unwrap_or(false);
    let return_token_ids = get_bool(obj, "return_token_ids")?.unwrap_or(false);
    let user = get_str(obj, "user")?.map(str::to_owned);
    let priority_class = get_str(obj, "priority_class")?.map(str::to_owned);
    check_response_format(obj)?;
    fields::audit(kind, obj)?;
    Ok(GenerationRequest {
        kind,
        model,
        input,
        // In range by the checks above.
        max_tokens: max_tokens.and_then(|m| u32::try_from(m).ok()),
        max_tokens_param,
        echo,
        sampling,
        stop,
        stream,
        include_usage,
        n: u32::try_from(n).unwrap_or(1),
        logprobs,
        ignore_eos,
        return_token_ids,
        user,
        priority_class,
    })
}

fn parse_sampling(obj: &Obj) -> Result<Sampling, ApiError> {
    let d = Sampling::default();
    let temperature = get_number(obj, "temperature", 0.0, 2.0)?.map_or(d.temperature, |x| x as f32);
    let top_p = match get_number(obj, "top_p", 0.0, 1.0)? {
        Some(p) if p <= 0.0 => {
            return Err(invalid(
                "top_p",
                format!("top_p must be greater than 0 and at most 1, got {p}"),
            ));
        }
        Some(p) => p as f32,
        None => d.top_p,
    };
    let top_k = get_int(obj, "top_k", -1, i128::from(u32::MAX))?
        .filter(|&k| k > 0)
        .and_then(|k| u32::try_from(k).ok());
    let seed = get_int(obj, "seed", i128::from(i64::MIN), i128::from(u64::MAX))?.map(|s| {
        // Negative seeds keep their two's-complement bits; `as` does exactly that here.
        u64::try_from(s).unwrap_or(s as i64 as u64)
    });
    for key in ["presence_penalty", "frequency_penalty"] {
        if let Some(x) = get_number(obj, key, -2.0, 2.0)?
            && x != 0.0
        {
            return Err(invalid(
                key,
                format!("{key} {x} is not supported by this server; only 0 is"),
            ));
        }
    }
    Ok(Sampling {
        temperature,
        top_p,
        top_k,
        seed,
    })
}

fn parse_stop(obj: &Obj) -> Result<Vec<String>, ApiError> {
    const SHAPE: &str = "stop must be a string or an array of at most 4 non-empty strings";
    match field(obj, "stop") {
        None => Ok(Vec::new()),
        Some(Value::String(s)) if s.is_empty() => {
            Err(invalid("stop", "stop must not be an empty string"))
        }
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                let msg = format!(
                    "stop may contain at most {MAX_STOP} sequences, got {}",
                    items.len()
                );
                return Err(invalid("stop", msg));
            }
            items
                .iter()
                .map(|v| match v {
                    Value::String(s) if !s.is_empty() => Ok(s.clone()),
                    Value::String(_) => Err(invalid("stop", "stop sequences must not be empty")),
                    other => Err(invalid(
                        "stop",
                        format!("{SHAPE}, got an item that is {}", describe(other)),
                    )),
                })
                .collect()
        }
        Some(other) => Err(invalid("stop", format!("{SHAPE}, got {}", describe(other)))),
    }
}

/// `stream_options.include_usage`; `stream_options` without `stream: true` is a 400.
fn parse_stream_options(obj: &Obj, stream: bool) -> Result<bool, ApiError> {
    let Some(so) = field(obj, "stream_options") else {
        return Ok(false);
    };
    if !stream {
        return Err(invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    let so = so.as_object().ok_or_else(|| {
        invalid(
            "stream_options",
            format!("stream_options must be an object, got {}", describe(so)),
        )
    })?;
    field(so, "include_usage")
        .map(|v| super::json::as_bool(v, "stream_options.include_usage"))
        .transpose()
        .map(|b| b.unwrap_or(false))
}

fn parse_logprobs(kind: RequestKind, obj: &Obj) -> Result<Option<u32>, ApiError> {
    let k = match kind {
        RequestKind::Chat => {
            let on = get_bool(obj, "logprobs")?.unwrap_or(false);
            let top = get_int(obj, "top_logprobs", 0, i128::from(MAX_TOP_LOGPROBS))?;
            match (on, top) {
                (false, Some(_)) => {
                    return Err(invalid(
                        "top_logprobs",
                        "top_logprobs requires logprobs to be true",
                    ));
                }
                (false, None) => None,
                (true, top) => Some(top.unwrap_or(0)),
            }
        }
        RequestKind::Completion => {
            get_int(obj, "logprobs", 0, i128::from(MAX_COMPLETION_LOGPROBS))?
        }
    };
    Ok(k.and_then(|k| u32::try_from(k).ok()))
}

fn check_response_format(obj: &Obj) -> Result<(), ApiError> {
    const P: &str = "response_format";
    let Some(rf) = field(obj, P) else {
        return Ok(());
    };
    let rfo = rf.as_object().ok_or_else(|| {
        invalid(
            P,
            format!("response_format must be an object, got {}", describe(rf)),
        )
    })?;
    let ty = field(rfo, "type")
        .ok_or_else(|| invalid("response_format.type", "response_format.type is required"))?;
    match as_str(ty, "response_format.type")? {
        "text" => Ok(()),
        t @ ("json_object" | "json_schema") => Err(invalid(
            P,
            format!("response_format type '{t}' is not supported; only 'text' is"),
        )),
        t => Err(invalid(
            "response_format.type",
            format!(
                "response_format.type must be one of 'text', 'json_object', 'json_schema', got '{}'",
                clip(t)
            ),
        )),
    }
}
