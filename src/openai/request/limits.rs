//! Checks that need more than the body: the context window and the served models.

use super::super::json::{clip, invalid};
use crate::openai::error::{ApiError, ErrorKind};

#[cfg(test)]
mod tests;

/// Check that the prompt and the requested completion fit the context window, and return
/// the effective `max_tokens`. `param` names the max-tokens field in use.
///
/// Exact messages (`C` context length, `P` prompt tokens, `R` requested tokens), all 400
/// `invalid_request_error` with `code: "context_length_exceeded"`:
/// - `P ≥ C`, whatever `max_tokens` is (`param: null`; [`GenerationRequest::check_context`]
///   fills in `"messages"`/`"prompt"`):
///   `This model's maximum context length is {C} tokens, but the prompt has {P} tokens, which
///   leaves no room for a completion. Please shorten the prompt.`
/// - `P + R > C` (`param` = `param`):
///   `This model's maximum context length is {C} tokens. However, you requested {P+R} tokens ({P}
///   in the prompt, {R} for {param}). Please reduce the prompt or {param}, which can be at most
///   {C-P} with this prompt.`
///
/// `P + R == C` is accepted and returns `R`; `None` returns `C − P` (capped at `u32::MAX`).
/// `Some(0)` is a 400 `"{param} must be at least 1, got 0"` (parsing already rejects it).
///
/// # Errors
/// A 400 `context_length_exceeded` in the two cases above; a 400 for `Some(0)`.
pub fn check_context(
    prompt_tokens: usize,
    max_tokens: Option<u32>,
    context_len: usize,
    param: &str,
) -> Result<u32, ApiError> {
    let (c, p) = (context_len as u128, prompt_tokens as u128);
    if p >= c {
        return Err(ApiError::new(
            ErrorKind::InvalidRequest,
            format!(
                "This model's maximum context length is {c} tokens, but the prompt has {p} tokens, \
                 which leaves no room for a completion. Please shorten the prompt."
            ),
        )
        .code("context_length_exceeded"));
    }
    let room = c - p;
    match max_tokens {
        None => Ok(u32::try_from(room).unwrap_or(u32::MAX)),
        Some(0) => Err(invalid(param, format!("{param} must be at least 1, got 0"))),
        Some(r) if u128::from(r) <= room => Ok(r),
        Some(r) => Err(invalid(
            param,
            format!(
                "This model's maximum context length is {c} tokens. However, you requested {} \
                 tokens ({p} in the prompt, {r} for {param}). Please reduce the prompt or {param}, \
                 which can be at most {room} with this prompt.",
                p + u128::from(r)
            ),
        )
        .code("context_length_exceeded")),
    }
}

/// 404 for a model no worker serves: `code: "model_not_found"`, `param: "model"`, message
/// `The model '{requested}' does not exist or is not served here.` (the name clipped to 256
/// chars). Also the answer for `GET /v1/models/{requested}`.
pub fn model_not_found(requested: &str) -> ApiError {
    ApiError::new(
        ErrorKind::NotFound,
        format!(
            "The model '{}' does not exist or is not served here.",
            clip(requested)
        ),
    )
    .param("model")
    .code("model_not_found")
}

/// `Ok` when `requested` is exactly (case-sensitively) one of `served`, else [`model_not_found`].
///
/// # Errors
/// A 404 `model_not_found` naming `requested`.
pub fn check_model<S: AsRef<str>>(requested: &str, served: &[S]) -> Result<(), ApiError> {
    if served.iter().any(|s| s.as_ref() == requested) {
        Ok(())
    } else {
        Err(model_not_found(requested))
    }
}
