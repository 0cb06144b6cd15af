//! The field audit: every top-level field of a request body is either read and honoured,
//! accepted only at a value that asks for nothing this server cannot do, or refused with a 400
//! naming it. Nothing is silently ignored.
//!
//! - Fields not in [`known`] for the route: 400 `Unrecognized request argument supplied: X`
//!   (OpenAI's own answer), `param` = the field.
//! - [`ONLY_UNSET`]: features this server does not have; accepted only as null, `false`, `""`,
//!   `[]` or `{}` (`best_of` also as 1).
//! - `tool_choice` / `function_call`: `"none"` and `"auto"` are accepted (with no tools, both
//!   mean a plain answer); `"required"` or a named function forces a tool call this server cannot
//!   make: 400, `param` = the field.
//! - `modalities`: only `["text"]`; `service_tier`: only `"auto"` or `"default"`.
//! - [`ROUTER_EXTRAS`]: fields SGLang's and vLLM's routers add to every request they forward
//!   (`sglang-router` 0.3.2, `vllm-router` 0.1.17, read off their forwarded bodies), accepted on
//!   both routes at the value that asks for what this server does anyway, refused at any
//!   other.

use serde_json::Value;

use super::super::json::{Obj, clip, describe, field, invalid, is_unset};
use super::RequestKind;
use crate::openai::error::ApiError;

/// Fields both routes read.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "user",
    "ignore_eos",
    "return_token_ids",
    "priority_class",
    "response_format",
    "logit_bias",
];

/// Fields only `POST /v1/chat/completions` knows.
const CHAT: &[&str] = &[
    "messages",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "store",
    "metadata",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "service_tier",
];

/// Fields only `POST /v1/completions` knows.
const COMPLETION: &[&str] = &["prompt", "echo", "suffix", "best_of"];

/// Known OpenAI features this server does not implement: accepted only when unset.
pub const ONLY_UNSET: &[&str] = &[
    "tools",
    "functions",
    "parallel_tool_calls",
    "logit_bias",
    "suffix",
    "best_of",
    "store",
    "metadata",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
];

/// SGLang and vLLM extensions that routers add to every request, each with the only value
/// accepted (`None`: any boolean — the reasoning switches, a no-op for a model served without
/// a reasoning parser):
/// - `no_stop_trim: false` — a matched stop string is trimmed (as here);
/// - `continue_final_message: false` — the template opens a new assistant turn (as here);
/// - `skip_special_tokens: true` — special tokens are left out of the text (as here);
/// - `return_hidden_states: false`;
/// - `separate_reasoning`, `stream_reasoning`, `include_reasoning`: booleans.
pub const ROUTER_EXTRAS: &[(&str, Option<bool>)] = &[
    ("no_stop_trim", Some(false)),
    ("continue_final_message", Some(false)),
    ("skip_special_tokens", Some(true)),
    ("return_hidden_states", Some(false)),
    ("separate_reasoning", None),
    ("stream_reasoning", None),
    ("include_reasoning", None),
];

/// Whether route `kind` knows top-level field `key`.
pub fn known(kind: RequestKind, key: &str) -> bool {
    let own = match kind {
        RequestKind::Chat => CHAT,
        RequestKind::Completion => COMPLETION,
    };
    COMMON.contains(&key) || own.contains(&key) || ROUTER_EXTRAS.iter().any(|(k, _)| *k == key)
}

/// Refuse unknown fields, and known ones at a value this server cannot honour.
pub(super) fn audit(kind: RequestKind, obj: &Obj) -> Result<(), ApiError> {
    if let Some(key) = obj.keys().find(|k| !known(kind, k)) {
        return Err(invalid(
            key,
            format!("Unrecognized request argument supplied: {}", clip(key)),
        ));
    }
    for key in ["tool_choice", "function_call"] {
        check_choice(obj, key)?;
    }
    for &(key, only) in ROUTER_EXTRAS {
        let Some(v) = obj.get(key) else { continue };
        let ok = match (v.as_bool(), only) {
            (Some(b), Some(want)) => b == want,
            (Some(_), None) => true,
            (None, _) => v.is_null(),
        };
        if !ok {
            let what = match only {
                Some(want) => format!("{key} is only supported as {want}"),
                None => format!("{key} must be a boolean, got {}", describe(v)),
            };
            return Err(invalid(key, what));
        }
    }
    for &key in ONLY_UNSET {
        let Some(v) = obj.get(key) else { continue };
        let default_best_of = key == "best_of" && v.as_f64() == Some(1.0);
        if !is_unset(v) && !default_best_of {
            return Err(invalid(
                key,
                format!("{key} is not supported by this server"),
            ));
        }
    }
    if let Some(m) = field(obj, "modalities") {
        let text_only = m
            .as_array()
            .is_some_and(|a| a.iter().all(|x| x.as_str() == Some("text")));
        if !text_only {
            return Err(invalid(
                "modalities",
                "modalities: only [\"text\"] is supported by this server",
            ));
        }
    }
    if let Some(t) = field(obj, "service_tier") {
        match t.as_str() {
            Some("auto" | "default") => {}
            Some(other) => {
                return Err(invalid(
                    "service_tier",
                    format!(
                        "service_tier '{}' is not supported; only 'auto' and 'default' are",
                        clip(other)
                    ),
                ));
            }
            None => {
                return Err(invalid(
                    "service_tier",
                    format!("service_tier must be a string, got {}", describe(t)),
                ));
            }
        }
    }
    Ok(())
}

/// `tool_choice` (or the legacy `function_call`): only the values that need no tool.
fn check_choice(obj: &Obj, key: &str) -> Result<(), ApiError> {
    match field(obj, key) {
        None => Ok(()),
        Some(Value::String(s)) if s == "none" || s == "auto" => Ok(()),
        Some(Value::String(s)) if s == "required" => Err(invalid(
            key,
            format!("{key} 'required' forces a tool call, but this server has no tool calling"),
        )),
        Some(Value::Object(_)) => Err(invalid(
            key,
            format!("{key} names a function to call, but this server has no tool calling"),
        )),
        Some(Value::String(s)) => Err(invalid(
            key,
            format!(
                "{key} must be 'none', 'auto', 'required' or an object, got '{}'",
                clip(s)
            ),
        )),
        Some(other) => Err(invalid(
            key,
            format!(
                "{key} must be a string or an object, got {}",
                describe(other)
            ),
        )),
    }
}
