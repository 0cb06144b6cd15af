//! Parse and validate a `POST /v1/messages` body into the gateway's normalized
//! [`GenerationRequest`] (route kind [`RequestKind::Chat`], one choice).
//!
//! Every failure is a 400 [`ApiError`] whose message starts with the offending field
//! (`max_tokens`, `messages[1].content[0].type`, `metadata.user_id`); the gateway renders it
//! in Anthropic's error shape (`anthropic::error`). `null` is read as "absent" for every
//! optional field. When several fields are wrong, the first in the order below is reported.
//!
//! | field | accepted | default |
//! |---|---|---|
//! | `model` | string, required | — |
//! | `max_tokens` | integer ≥ 1, required (as in Anthropic's API) | — |
//! | `messages` | non-empty array of `{role, content}`; `role` `user` or `assistant`; consecutive turns of one role are combined into one turn, as Anthropic does (their texts joined with `"\n"`, as a turn's text blocks are); the last message must be `user` (a final `assistant` message asks to continue it — "prefill" — which this server does not do: 400) | required |
//! | `messages[i].content` | a string, or a non-empty array of text blocks `{"type":"text","text":…}` (joined with `"\n"`, as the chat route joins text parts); any other block type (`image`, `document`, `tool_use`, `tool_result`, `thinking`, `redacted_thinking`, …) → 400 naming it | required |
//! | `system` | a string, or an array of text blocks; rendered as a first `system` message | none |
//! | text block extras | `cache_control` (an object; the prefix cache caches every prompt anyway), `citations` (null or `[]` only) | — |
//! | `stop_sequences` | array of ≤ [`MAX_STOP_SEQUENCES`] non-empty strings | none |
//! | `stream` | boolean | false |
//! | `temperature` | 0..=1 (Anthropic's range) | 1.0 |
//! | `top_p` | 0 < p ≤ 1 | 1.0 |
//! | `top_k` | integer ≥ 0; 0 means off | off |
//! | `metadata` | object with optional `user_id` (string); other keys → 400 | none |
//! | `service_tier` | `"auto"` or `"standard_only"` (one tier here) | auto |
//! | `speed` | `"standard"`; `"fast"` → 400 (one speed here) | standard |
//! | `cache_control` (top level, and on text blocks) | an object: accepted, the prefix cache caches every prompt anyway | none |
//! | `user_profile_id`, `workspace_id` | strings (identities; not used) | none |
//! | `tools`, `tool_choice`, `thinking` | only the values that ask for nothing: `tools` `[]`; `tool_choice` `{"type":"auto"}` or `{"type":"none"}` (with no tools both mean a plain answer); `thinking` `{"type":"disabled"}`; anything else (`enabled`, `adaptive`) → 400 naming the field | none |
//! | `output_config`, `inference_geo`, `diagnostics`, `mcp_servers`, `container`, `context_management` | unset only (null, `""`, `[]`, `{}`) | — |
//!
//! `temperature`, `top_p` and `top_k` are read although the `anthropic` Python client 2.17
//! no longer offers them as arguments (it sends them through `extra_body`): raw HTTP clients
//! and older SDKs send them. `max_tokens: 0` (Anthropic's cache pre-warming) is refused: at
//! least one token is generated here.
//! | any other field | 400 `X: Extra inputs are not permitted`, as Anthropic answers | — |

use serde_json::Value;

use crate::openai::error::{ApiError, ErrorKind};
use crate::openai::json::{
    Obj, as_str, clip, describe, field, get_bool, get_int, get_number, get_str, invalid, is_unset,
    type_name,
};
use crate::openai::request::{ChatMessage, GenerationRequest, Input, RequestKind, Role, Sampling};

#[cfg(test)]
mod tests;

/// Most `stop_sequences` per request: Flotilla's cap (Anthropic documents none); each one is
/// matched against every streamed delta.
pub const MAX_STOP_SEQUENCES: usize = 16;

/// Top-level fields a Messages body may carry (besides [`ONLY_UNSET`]'s).
const KNOWN: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "service_tier",
    "tools",
    "tool_choice",
    "thinking",
    "speed",
    "cache_control",
    "user_profile_id",
    "workspace_id",
    // Flotilla's extension (`request_plane/priority.rs`).
    "priority_class",
];

/// Anthropic features this server does not have, accepted only unset.
const ONLY_UNSET: &[&str] = &[
    "output_config",
    "inference_geo",
    "diagnostics",
    "mcp_servers",
    "container",
    "context_management",
];

/// A validated Messages request.
#[derive(Clone, Debug, PartialEq)]
pub struct MessagesRequest {
    /// The normalized request the gateway runs: `kind` Chat, `n` 1, the `system` prompt as a
    /// first system message, `stop_sequences` as `stop`.
    pub generation: GenerationRequest,
    /// `metadata.user_id`, if given.
    pub user_id: Option<String>,
}

/// Top-level fields a `POST /v1/messages/count_tokens` body may carry (besides
/// [`ONLY_UNSET`]'s): Anthropic's count_tokens parameters — a Messages body without
/// `max_tokens`, `stream`, `stop_sequences`, sampling or `metadata`.
const COUNT_KNOWN: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "cache_control",
];

/// Parse and validate a `POST /v1/messages/count_tokens` body (Anthropic's token counting:
/// <https://docs.anthropic.com/en/api/messages-count-tokens>): `model`, `messages` and
/// `system` as for [`parse_messages_request`] (so the prompt counted is the one a Messages
/// request would run, through the same chat template), `tools` / `tool_choice` / `thinking`
/// only at the values that ask for nothing; `max_tokens` and the generation fields are not
/// part of it (400 `Extra inputs are not permitted`, as Anthropic answers). The result has
/// `max_tokens` `None`; only its `model` and `input` matter.
///
/// # Errors
/// As [`parse_messages_request`].
pub fn parse_count_tokens_request(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let obj = json_object(body)?;
    if let Some(key) = obj
        .keys()
        .find(|k| !COUNT_KNOWN.contains(&k.as_str()) && !ONLY_UNSET.contains(&k.as_str()))
    {
        return Err(invalid(
            key,
            format!("{}: Extra inputs are not permitted", clip(key)),
        ));
    }
    let model = get_str(&obj, "model")?
        .ok_or_else(|| invalid("model", "model: Field required"))?
        .to_owned();
    let mut messages = parse_system(&obj)?;
    messages.extend(parse_turns(&obj)?);
    check_unsupported(&obj)?;
    Ok(GenerationRequest {
        kind: RequestKind::Chat,
        model,
        input: Input::Chat(messages),
        max_tokens: None,
        max_tokens_param: "max_tokens",
        echo: false,
        sampling: Sampling::default(),
        stop: Vec::new(),
        stream: false,
        include_usage: false,
        n: 1,
        logprobs: None,
        ignore_eos: false,
        return_token_ids: false,
        user: None,
        priority_class: None,
    })
}

/// The body as a JSON object, or a 400 saying what it is.
fn json_object(body: &[u8]) -> Result<Obj, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("the request body is not valid JSON ({e}); expected a JSON object"),
        )
    })?;
    match value {
        Value::Object(obj) => Ok(obj),
        other => Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "the request body must be a JSON object, got {}",
                type_name(&other)
            ),
        )),
    }
}

/// Parse and validate a `POST /v1/messages` body; see the module doc for every field.
///
/// # Errors
/// A 400 [`ApiError`] (`param` = the field, and the message names it) when the body is not a
/// JSON object, a field is missing, unknown, of the wrong type or out of range, or asks for
/// something this server cannot do (non-text content, tools, extended thinking, prefill).
pub fn parse_messages_request(body: &[u8]) -> Result<MessagesRequest, ApiError> {
    from_object(&json_object(body)?)
}

fn from_object(obj: &Obj) -> Result<MessagesRequest, ApiError> {
    if let Some(key) = obj
        .keys()
        .find(|k| !KNOWN.contains(&k.as_str()) && !ONLY_UNSET.contains(&k.as_str()))
    {
        return Err(invalid(
            key,
            format!("{}: Extra inputs are not permitted", clip(key)),
        ));
    }
    let model = get_str(obj, "model")?
        .ok_or_else(|| invalid("model", "model: Field required"))?
        .to_owned();
    let max_tokens = get_int(obj, "max_tokens", 1, i128::from(u32::MAX))?
        .ok_or_else(|| invalid("max_tokens", "max_tokens: Field required"))?;
    let mut messages = parse_system(obj)?;
    messages.extend(parse_turns(obj)?);
    let stop = parse_stop_sequences(obj)?;
    let stream = get_bool(obj, "stream")?.unwrap_or(false);
    let sampling = parse_sampling(obj)?;
    let user_id = parse_metadata(obj)?;
    check_unsupported(obj)?;
    Ok(MessagesRequest {
        generation: GenerationRequest {
            kind: RequestKind::Chat,
            model,
            input: Input::Chat(messages),
            // In range by the check above.
            max_tokens: u32::try_from(max_tokens).ok(),
            max_tokens_param: "max_tokens",
            echo: false,
            sampling,
            stop,
            stream,
            include_usage: false,
            n: 1,
            logprobs: None,
            ignore_eos: false,
            return_token_ids: false,
            user: user_id.clone(),
            priority_class: get_str(obj, "priority_class")?.map(str::to_owned),
        },
        user_id,
    })
}

/// `system`: a string or an array of text blocks, as one system message (none when absent).
fn parse_system(obj: &Obj) -> Result<Vec<ChatMessage>, ApiError> {
    let content = match field(obj, "system") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => text_blocks("system", blocks)?,
        Some(other) => {
            return Err(invalid(
                "system",
                format!(
                    "system must be a string or an array of text blocks, got {}",
                    describe(other)
                ),
            ));
        }
    };
    Ok(vec![ChatMessage {
        role: Role::System,
        content,
    }])
}

fn parse_turns(obj: &Obj) -> Result<Vec<ChatMessage>, ApiError> {
    let v =
        field(obj, "messages").ok_or_else(|| invalid("messages", "messages: Field required"))?;
    let arr = v.as_array().ok_or_else(|| {
        invalid(
            "messages",
            format!("messages must be an array of messages, got {}", describe(v)),
        )
    })?;
    if arr.is_empty() {
        return Err(invalid(
            "messages",
            "messages must contain at least one message",
        ));
    }
    let parsed: Vec<ChatMessage> = arr
        .iter()
        .enumerate()
        .map(|(i, m)| parse_turn(&format!("messages[{i}]"), m))
        .collect::<Result<_, _>>()?;
    let turns = merge_turns(parsed);
    if turns.last().is_some_and(|m| m.role == Role::Assistant) {
        let p = format!("messages[{}].role", arr.len() - 1);
        return Err(invalid(
            &p,
            format!(
                "{p}: a final assistant message asks to continue it (prefill), which this \
                 server does not support; end with a user message"
            ),
        ));
    }
    Ok(turns)
}

/// Consecutive turns of one role become one turn, as Anthropic's API combines them ("consecutive
/// user or assistant turns in your request will be combined into a single turn"): the merged
/// turn holds both turns' content blocks in order, and its text is theirs joined with `"\n"`,
/// as the text blocks of one turn are joined ([`text_blocks`]). So `user, user` reaches the
/// chat template as one user message (a template would otherwise render two user turns in a
/// row, which the model never saw in training).
fn merge_turns(turns: Vec<ChatMessage>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(turns.len());
    for t in turns {
        match out.last_mut() {
            Some(last) if last.role == t.role => {
                last.content.push('\n');
                last.content.push_str(&t.content);
            }
            _ => out.push(t),
        }
    }
    out
}

fn parse_turn(p: &str, m: &Value) -> Result<ChatMessage, ApiError> {
    let mo = m
        .as_object()
        .ok_or_else(|| invalid(p, format!("{p} must be an object, got {}", describe(m))))?;
    if let Some(key) = mo.keys().find(|k| *k != "role" && *k != "content") {
        let param = format!("{p}.{}", clip(key));
        return Err(invalid(
            &param,
            format!("{param}: Extra inputs are not permitted"),
        ));
    }
    let role_param = format!("{p}.role");
    let role_v = field(mo, "role")
        .ok_or_else(|| invalid(&role_param, format!("{role_param}: Field required")))?;
    let role = match as_str(role_v, &role_param)? {
        "user" => Role::User,
        "assistant" => Role::Assistant,
        r => {
            let msg = format!(
                "{role_param} must be 'user' or 'assistant', got '{}' (the system prompt goes \
                 in the top-level system field)",
                clip(r)
            );
            return Err(invalid(&role_param, msg));
        }
    };
    let content_param = format!("{p}.content");
    let content = match field(mo, "content") {
        None => {
            return Err(invalid(
                &content_param,
                format!("{content_param}: Field required"),
            ));
        }
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) if blocks.is_empty() => {
            return Err(invalid(
                &content_param,
                format!("{content_param} must contain at least one content block"),
            ));
        }
        Some(Value::Array(blocks)) => text_blocks(&content_param, blocks)?,
        Some(other) => {
            let msg = format!(
                "{content_param} must be a string or an array of content blocks, got {}",
                describe(other)
            );
            return Err(invalid(&content_param, msg));
        }
    };
    Ok(ChatMessage { role, content })
}

/// Text blocks' texts joined with `"\n"` (the chat route's join of text parts); any other
/// block type is refused by name.
fn text_blocks(p: &str, blocks: &[Value]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(blocks.len());
    for (j, block) in blocks.iter().enumerate() {
        let bp = format!("{p}[{j}]");
        let bo = block.as_object().ok_or_else(|| {
            invalid(
                &bp,
                format!(
                    "{bp} must be a content block object, got {}",
                    describe(block)
                ),
            )
        })?;
        let type_param = format!("{bp}.type");
        let ty = field(bo, "type")
            .ok_or_else(|| invalid(&type_param, format!("{type_param}: Field required")))?;
        match as_str(ty, &type_param)? {
            "text" => {}
            other => {
                let msg = format!(
                    "{type_param}: content blocks of type '{}' are not supported by this \
                     server; only 'text' blocks are",
                    clip(other)
                );
                return Err(invalid(&type_param, msg));
            }
        }
        for (key, v) in bo {
            match key.as_str() {
                "type" | "text" => {}
                "cache_control" if v.is_null() || v.is_object() => {}
                "citations" if is_unset(v) => {}
                "citations" => {
                    let param = format!("{bp}.citations");
                    return Err(invalid(
                        &param,
                        format!("{param}: citations are not supported by this server"),
                    ));
                }
                _ => {
                    let param = format!("{bp}.{}", clip(key));
                    let msg = if key == "cache_control" {
                        format!("{param} must be an object, got {}", describe(v))
                    } else {
                        format!("{param}: Extra inputs are not permitted")
                    };
                    return Err(invalid(&param, msg));
                }
            }
        }
        let text_param = format!("{bp}.text");
        let text = field(bo, "text")
            .ok_or_else(|| invalid(&text_param, format!("{text_param}: Field required")))?;
        texts.push(as_str(text, &text_param)?);
    }
    Ok(texts.join("\n"))
}

fn parse_stop_sequences(obj: &Obj) -> Result<Vec<String>, ApiError> {
    const P: &str = "stop_sequences";
    let Some(v) = field(obj, P) else {
        return Ok(Vec::new());
    };
    let items = v.as_array().ok_or_else(|| {
        invalid(
            P,
            format!("{P} must be an array of strings, got {}", describe(v)),
        )
    })?;
    if items.len() > MAX_STOP_SEQUENCES {
        return Err(invalid(
            P,
            format!(
                "{P} may contain at most {MAX_STOP_SEQUENCES} sequences, got {}",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let param = format!("{P}[{i}]");
            match as_str(s, &param)? {
                "" => Err(invalid(&param, format!("{param} must not be empty"))),
                s => Ok(s.to_owned()),
            }
        })
        .collect()
}

fn parse_sampling(obj: &Obj) -> Result<Sampling, ApiError> {
    let d = Sampling::default();
    let temperature = get_number(obj, "temperature", 0.0, 1.0)?.map_or(d.temperature, |x| x as f32);
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
    let top_k = get_int(obj, "top_k", 0, i128::from(u32::MAX))?
        .filter(|&k| k > 0)
        .and_then(|k| u32::try_from(k).ok());
    Ok(Sampling {
        temperature,
        top_p,
        top_k,
        seed: None,
    })
}

/// `metadata`: an object whose only key is `user_id` (a string); returns it.
fn parse_metadata(obj: &Obj) -> Result<Option<String>, ApiError> {
    let Some(v) = field(obj, "metadata") else {
        return Ok(None);
    };
    let mo = v.as_object().ok_or_else(|| {
        invalid(
            "metadata",
            format!("metadata must be an object, got {}", describe(v)),
        )
    })?;
    if let Some(key) = mo.keys().find(|k| *k != "user_id") {
        let param = format!("metadata.{}", clip(key));
        return Err(invalid(
            &param,
            format!("{param}: Extra inputs are not permitted"),
        ));
    }
    Ok(get_str(mo, "user_id")
        .map_err(|mut e| {
            e.message = format!("metadata.{}", e.message);
            e.param = Some("metadata.user_id".into());
            e
        })?
        .map(str::to_owned))
}

/// `tools`, `tool_choice`, `thinking`, `service_tier` and the features accepted unset only.
fn check_unsupported(obj: &Obj) -> Result<(), ApiError> {
    let no_tools = "this server has no tool use";
    if let Some(v) = field(obj, "tools")
        && !(v.as_array().is_some_and(Vec::is_empty))
    {
        return Err(invalid(
            "tools",
            format!("tools: {no_tools}; send no tools"),
        ));
    }
    if let Some(v) = field(obj, "tool_choice") {
        let ty = v.get("type").and_then(Value::as_str);
        if !matches!(ty, Some("auto" | "none")) {
            return Err(invalid(
                "tool_choice",
                format!(
                    "tool_choice: {no_tools}; only {{\"type\":\"auto\"}} and {{\"type\":\"none\"}} \
                     are accepted"
                ),
            ));
        }
    }
    if let Some(v) = field(obj, "thinking")
        && v.get("type").and_then(Value::as_str) != Some("disabled")
    {
        return Err(invalid(
            "thinking",
            "thinking: extended thinking is not supported by this server; only \
             {\"type\":\"disabled\"} is accepted",
        ));
    }
    if let Some(v) = field(obj, "service_tier") {
        match v.as_str() {
            Some("auto" | "standard_only") => {}
            _ => {
                return Err(invalid(
                    "service_tier",
                    format!(
                        "service_tier must be 'auto' or 'standard_only', got {}",
                        match v.as_str() {
                            Some(s) => format!("'{}'", clip(s)),
                            None => describe(v),
                        }
                    ),
                ));
            }
        }
    }
    match field(obj, "speed") {
        None => {}
        Some(Value::String(s)) if s == "standard" => {}
        Some(v) => {
            return Err(invalid(
                "speed",
                format!(
                    "speed: only 'standard' is supported by this server, got {}",
                    match v.as_str() {
                        Some(s) => format!("'{}'", clip(s)),
                        None => describe(v),
                    }
                ),
            ));
        }
    }
    if let Some(v) = field(obj, "cache_control")
        && !v.is_object()
    {
        return Err(invalid(
            "cache_control",
            format!("cache_control must be an object, got {}", describe(v)),
        ));
    }
    for key in ["user_profile_id", "workspace_id"] {
        get_str(obj, key)?;
    }
    for &key in ONLY_UNSET {
        if let Some(v) = obj.get(key)
            && !is_unset(v)
        {
            return Err(invalid(key, format!("{key}: not supported by this server")));
        }
    }
    Ok(())
}
