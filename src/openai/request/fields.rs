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
    "echo",
    "suffix",
    "best_of",
    "store",
    "metadata",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
];

/// Whether route `kind` knows top-level field `key`.
pub fn known(kind: RequestKind, key: &str) -> bool {
    let own = match kind {
        RequestKind::Chat => CHAT,
        RequestKind::Completion => COMPLETION,
    };
    COMMON.contains(&key) || own.contains(&key)
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
