//! The model input of a request: chat `messages` or a completions `prompt` (shapes in the
//! parent module's doc).

use serde_json::Value;

use super::super::json::{
    Obj, as_int, as_str, clip, describe, field, invalid, is_unset, type_name,
};
use super::{ChatMessage, Input, MAX_PROMPT_CHOICES, Role};
use crate::openai::error::ApiError;

pub(super) fn parse_messages(obj: &Obj) -> Result<Vec<ChatMessage>, ApiError> {
    let v = field(obj, "messages").ok_or_else(|| invalid("messages", "messages is required"))?;
    let arr = v.as_array().ok_or_else(|| {
        let got = describe(v);
        invalid(
            "messages",
            format!("messages must be an array of message objects, got {got}"),
        )
    })?;
    if arr.is_empty() {
        return Err(invalid(
            "messages",
            "messages must contain at least one message",
        ));
    }
    arr.iter()
        .enumerate()
        .map(|(i, m)| parse_message(&format!("messages[{i}]"), m))
        .collect()
}

fn parse_message(p: &str, m: &Value) -> Result<ChatMessage, ApiError> {
    let mo = m
        .as_object()
        .ok_or_else(|| invalid(p, format!("{p} must be an object, got {}", describe(m))))?;
    let role_param = format!("{p}.role");
    let role_v = field(mo, "role")
        .ok_or_else(|| invalid(&role_param, format!("{role_param} is required")))?;
    let role = match as_str(role_v, &role_param)? {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        r @ ("tool" | "function") => {
            let msg =
                format!("{role_param} '{r}' is not supported: this server has no tool calling");
            return Err(invalid(&role_param, msg));
        }
        r => {
            let msg = format!(
                "{role_param} must be one of 'system', 'developer', 'user', 'assistant', got '{}'",
                clip(r)
            );
            return Err(invalid(&role_param, msg));
        }
    };
    for key in ["tool_calls", "function_call"] {
        if let Some(v) = mo.get(key)
            && !is_unset(v)
        {
            let param = format!("{p}.{key}");
            return Err(invalid(
                &param,
                format!("{param} is not supported: this server has no tool calling"),
            ));
        }
    }
    let content_param = format!("{p}.content");
    let content = match field(mo, "content") {
        None if role == Role::Assistant => String::new(),
        None => {
            return Err(invalid(
                &content_param,
                format!("{content_param} is required"),
            ));
        }
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parse_parts(&content_param, parts)?,
        Some(other) => {
            let msg = format!(
                "{content_param} must be a string or an array of text parts, got {}",
                describe(other)
            );
            return Err(invalid(&content_param, msg));
        }
    };
    Ok(ChatMessage { role, content })
}

fn parse_parts(p: &str, parts: &[Value]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let pp = format!("{p}[{j}]");
        let po = part.as_object().ok_or_else(|| {
            invalid(
                &pp,
                format!("{pp} must be an object, got {}", describe(part)),
            )
        })?;
        let type_param = format!("{pp}.type");
        let ty = field(po, "type")
            .ok_or_else(|| invalid(&type_param, format!("{type_param} is required")))?;
        match as_str(ty, &type_param)? {
            "text" => {}
            other => {
                let msg = format!(
                    "{type_param} '{}' is not supported: only text content parts are",
                    clip(other)
                );
                return Err(invalid(&type_param, msg));
            }
        }
        let text_param = format!("{pp}.text");
        let text = field(po, "text")
            .ok_or_else(|| invalid(&text_param, format!("{text_param} is required")))?;
        texts.push(as_str(text, &text_param)?);
    }
    Ok(texts.join("\n"))
}

const PROMPT_SHAPES: &str = "prompt must be a string, an array of strings, an array of token ids \
                             or an array of arrays of token ids";

/// A `prompt`: one (a string, `[string]`, `[id…]`, `[[id…]]`) or a list of several (`[string…]`
/// or `[[id…]…]`, one kind only), each non-empty; at most [`MAX_PROMPT_CHOICES`] prompts (the
/// cap on prompts × `n` is checked once `n` is known).
pub(super) fn parse_prompt(obj: &Obj) -> Result<Input, ApiError> {
    let v = field(obj, "prompt").ok_or_else(|| invalid("prompt", "prompt is required"))?;
    let input = match v {
        Value::String(s) => Input::Text(s.clone()),
        Value::Array(items) => match items.first() {
            None => return Err(invalid("prompt", "prompt must not be empty")),
            Some(Value::Number(_)) => Input::Tokens(token_ids("prompt", items)?),
            Some(Value::String(_) | Value::Array(_)) => {
                let prompts = prompt_list(items)?;
                match <[Input; 1]>::try_from(prompts) {
                    Ok([one]) => one,
                    Err(several) => Input::Batch(several),
                }
            }
            Some(other) => {
                return Err(invalid(
                    "prompt",
                    format!("{PROMPT_SHAPES}, got array of {}", type_name(other)),
                ));
            }
        },
        other => {
            return Err(invalid(
                "prompt",
                format!("{PROMPT_SHAPES}, got {}", describe(other)),
            ));
        }
    };
    if input.is_empty_prompt() {
        return Err(invalid("prompt", "prompt must not be empty"));
    }
    Ok(input)
}

/// The items of a list of strings or of token-id lists, each non-empty.
fn prompt_list(items: &[Value]) -> Result<Vec<Input>, ApiError> {
    if items.len() > MAX_PROMPT_CHOICES as usize {
        return Err(invalid(
            "prompt",
            format!(
                "prompt may list at most {MAX_PROMPT_CHOICES} prompts, got {}",
                items.len()
            ),
        ));
    }
    let strings = items[0].is_string();
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let p = format!("prompt[{i}]");
            let input = match v {
                Value::String(s) if strings => Input::Text(s.clone()),
                Value::Array(ids) if !strings => Input::Tokens(token_ids(&p, ids)?),
                Value::String(_) | Value::Array(_) => {
                    return Err(invalid(
                        "prompt",
                        format!(
                            "prompt mixes strings and token-id lists ({p} is {}); a list of \
                             prompts must be all strings or all token-id lists",
                            describe(v)
                        ),
                    ));
                }
                other => {
                    return Err(invalid(
                        "prompt",
                        format!("{PROMPT_SHAPES}, got {p} that is {}", describe(other)),
                    ));
                }
            };
            if input.is_empty_prompt() {
                return Err(invalid("prompt", format!("{p} must not be empty")));
            }
            Ok(input)
        })
        .collect()
}

/// Token ids, each an integer 0..=`u32::MAX` (the vocabulary is checked by the frontend);
/// `p` names the prompt in messages.
fn token_ids(p: &str, items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            if !v.is_number() {
                let got = describe(v);
                return Err(invalid(
                    "prompt",
                    format!("{PROMPT_SHAPES}, got a token id in {p} that is {got}"),
                ));
            }
            let id = as_int(v, "prompt", 0, i128::from(u32::MAX)).map_err(|mut e| {
                if p != "prompt" {
                    e.message = format!("{p}: {}", e.message);
                }
                e
            })?;
            Ok(u32::try_from(id).unwrap_or(u32::MAX))
        })
        .collect()
}
