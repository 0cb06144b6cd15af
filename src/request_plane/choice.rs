//! One choice's output, pure: the token events of its Request turned into what the client
//! sees — text through the incremental detokenizer (`openai/detok.rs`), then the stop-string
//! matcher (`openai/stop.rs`: text that might start a stop string is held back, never sent),
//! each token's logprob sent with its text (not while the text is held back, never for the
//! tokens of a stop match), token ids with `return_token_ids`, and `echo`'s prompt before the
//! first token's text (with its logprobs, once the worker's Prompt events have scored every
//! prompt token). The gateway's handlers drive one [`ChoiceText`] per choice and time the
//! tokens it counts ([`Produced::counted`]: TTFT, ITL); the wire shapes are the API's.

use crate::openai::detok::IncrementalDetokenizer;
use crate::openai::error::ApiError;
use crate::openai::response::{FinishReason, TokenLogprob};
use crate::openai::stop::StopMatcher;
use crate::request_plane::error::RequestError;
use crate::request_plane::frontend::TokRef;
use crate::request_plane::protocol::TokenEventKind;

/// One choice's output state.
pub struct ChoiceText {
    detok: IncrementalDetokenizer<TokRef>,
    stop: StopMatcher,
    tokenizer: TokRef,
    /// `logprobs` / `top_logprobs`: each token's logprob goes out with its text.
    pub want_logprobs: bool,
    /// `return_token_ids`: the ids go out with the text.
    pub want_ids: bool,
    /// Tokens the model generated for the choice (the end-of-sequence token and the one
    /// that completed a stop string included).
    pub completion_tokens: u32,
    /// Prompt tokens its first worker found cached.
    pub cached_tokens: u32,
    /// How it ended, once it has.
    pub finish: Option<FinishReason>,
    /// The stop string that ended it, if one did.
    pub stop_sequence: Option<String>,
    /// Logprobs of tokens whose text the stop matcher still holds back.
    held_logprobs: Vec<TokenLogprob>,
    /// The workers that admitted it, in order (more than one after a migration).
    pub workers: Vec<String>,
    /// The prompt it answers (its index in the request's list; 0 for a single prompt).
    pub prompt: usize,
    /// `echo`: the prompt, sent before the first token's text (with its logprobs once they
    /// have all come); `None` without echo or once sent.
    echo: Option<Echo>,
    /// `echo` with `max_tokens: 0`: the one token the worker samples is dropped, and the
    /// choice ends with `length`.
    prompt_only: bool,
}

/// What a choice answers, and how ([`ChoiceText::new`]).
pub struct ChoiceSpec<'a> {
    /// The prompt's token ids (the detokenizer's context, and what `echo` sends).
    pub prompt_ids: &'a [u32],
    /// The prompt's index in the request's list.
    pub prompt: usize,
    /// `echo`: the prompt's text as received (a token-id prompt: `None`, its ids decoded).
    pub echo: Option<Option<&'a str>>,
    /// Stop strings.
    pub stop: &'a [String],
    /// Whether logprobs are wanted.
    pub logprobs: bool,
    /// `return_token_ids`.
    pub token_ids: bool,
    /// `echo` with `max_tokens: 0`.
    pub prompt_only: bool,
}

/// An echoed prompt waiting to be sent.
#[derive(Debug)]
struct Echo {
    /// Its text: the prompt string as received (a token-id prompt: its decoded ids).
    text: String,
    /// Its token ids.
    ids: Vec<u32>,
    /// Its tokens' logprobs so far (the first one `None`), when the request wants logprobs.
    logprobs: Option<Vec<TokenLogprob>>,
}

impl Echo {
    /// The prompt `ids` (text `text`) to echo; with `logprobs`, its first token listed
    /// already (it has no logprob).
    fn new(text: String, ids: Vec<u32>, logprobs: bool, tok: &TokRef) -> Self {
        let logprobs = logprobs.then(|| {
            ids.first()
                .map(|&t| TokenLogprob {
                    token: tok.0.decode(&[t], false).unwrap_or_default(),
                    logprob: None,
                    top: Vec::new(),
                })
                .into_iter()
                .collect()
        });
        Self {
            text,
            ids,
            logprobs,
        }
    }

    /// Whether every prompt token's logprob has come (or none are wanted).
    fn complete(&self) -> bool {
        self.logprobs
            .as_ref()
            .is_none_or(|l| l.len() >= self.ids.len())
    }
}

/// What one event produced for the client.
#[derive(Debug, Default, PartialEq)]
pub struct Produced {
    /// Text to send (possibly empty: held back by the stop matcher, or no text yet).
    pub text: String,
    /// Logprobs of the tokens whose text this is.
    pub logprobs: Vec<TokenLogprob>,
    /// The event's token id (with `return_token_ids`).
    pub token_ids: Vec<u32>,
    /// The event counted a generated token (the driver times it: TTFT for the first, ITL
    /// after).
    pub counted: bool,
}

impl ChoiceText {
    /// A choice that has produced nothing yet.
    pub fn new(tokenizer: TokRef, spec: ChoiceSpec<'_>) -> Self {
        let echo = spec.echo.map(|text| {
            let text = match text {
                Some(t) => t.to_owned(),
                None => tokenizer
                    .0
                    .decode(spec.prompt_ids, false)
                    .unwrap_or_default(),
            };
            Echo::new(text, spec.prompt_ids.to_vec(), spec.logprobs, &tokenizer)
        });
        Self {
            detok: IncrementalDetokenizer::with_context(tokenizer.clone(), spec.prompt_ids),
            stop: StopMatcher::new(spec.stop),
            tokenizer,
            want_logprobs: spec.logprobs,
            want_ids: spec.token_ids,
            completion_tokens: 0,
            cached_tokens: 0,
            finish: None,
            stop_sequence: None,
            held_logprobs: Vec::new(),
            workers: Vec::new(),
            prompt: spec.prompt,
            echo,
            prompt_only: spec.prompt_only,
        }
    }

    /// One token event of the choice's Request.
    ///
    /// # Errors
    /// The request failed or was lost (the event says so), or a token cannot be decoded.
    pub fn on_event(&mut self, ev: TokenEventKind) -> Result<Produced, ApiError> {
        let mut out = Produced::default();
        match ev {
            TokenEventKind::Admitted {
                cached_tokens,
                worker,
            } => {
                // Counted in `flotilla_prefix_hit_tokens_total` at the request's end, once per
                // request as `usage` reports it (not here, once per choice). A migrated choice
                // is admitted again elsewhere: its usage keeps the first admission's.
                if self.workers.is_empty() {
                    self.cached_tokens = cached_tokens;
                }
                if self.workers.last().is_none_or(|w| *w != worker.as_str()) {
                    self.workers.push(worker.to_string());
                }
            }
            TokenEventKind::Failed { message, status } => {
                return Err(RequestError::from_failed(message, status).into());
            }
            TokenEventKind::Lost { reason } => {
                return Err(RequestError::Lost(reason).into());
            }
            // Consumed by the Request actor; never reaches a handler.
            TokenEventKind::HandOff(_) => {}
            TokenEventKind::Prompt { first, logprobs } => {
                let text = |id: u32| self.tokenizer.0.decode(&[id], false).unwrap_or_default();
                if let Some(echo) = self.echo.as_mut()
                    && let Some(have) = echo.logprobs.as_mut()
                {
                    // The Request passes each position once, in order.
                    for (i, (lp, top)) in logprobs.into_iter().enumerate() {
                        let pos = first as usize + i;
                        if pos != have.len() {
                            continue;
                        }
                        let Some(&id) = echo.ids.get(pos) else { break };
                        have.push(TokenLogprob {
                            token: text(id),
                            logprob: Some(lp),
                            top: top.into_iter().map(|(t, lp)| (text(t), lp)).collect(),
                        });
                    }
                }
                if self.echo.as_ref().is_some_and(Echo::complete) {
                    self.echo_into(&mut out);
                }
            }
            TokenEventKind::Token {
                id,
                logprob,
                finish,
                top,
                ..
            } => {
                if self.finish.is_some() {
                    return Ok(out);
                }
                // The echoed prompt goes first (its logprobs are all here: the worker sends
                // them before the first token).
                self.echo_into(&mut out);
                if self.prompt_only {
                    self.finish = Some(FinishReason::Length);
                    return Ok(out);
                }
                let echoed = std::mem::take(&mut out);
                out.counted = true;
                self.completion_tokens += 1;
                if self.want_ids {
                    out.token_ids.push(id);
                }
                let mut piece = self.detok.step(id)?;
                if finish.is_some() {
                    piece.push_str(&self.detok.finish()?);
                }
                if self.want_logprobs {
                    let text = |id: u32| self.tokenizer.0.decode(&[id], false).unwrap_or_default();
                    self.held_logprobs.push(TokenLogprob {
                        token: text(id),
                        logprob: Some(logprob),
                        top: top.into_iter().map(|(t, lp)| (text(t), lp)).collect(),
                    });
                }
                let step = self.stop.feed(&piece);
                out.text = step.release;
                if step.stopped.is_some() {
                    self.finish = Some(FinishReason::Stop);
                    self.stop_sequence = step.stopped;
                    // Tokens whose text is (part of) the stop match are never shown.
                    self.held_logprobs.clear();
                } else if let Some(f) = finish {
                    out.text.push_str(&self.stop.finish());
                    self.finish = Some(f);
                }
                // A token's logprob goes out with its text: not while the text is held back.
                if self.finish.is_some() || self.stop.held().is_empty() {
                    out.logprobs.append(&mut self.held_logprobs);
                }
                out.prepend(echoed);
            }
        }
        Ok(out)
    }

    /// The echoed prompt (its text and logprobs), once, into `out`.
    fn echo_into(&mut self, out: &mut Produced) {
        if let Some(echo) = self.echo.take() {
            out.text.push_str(&echo.text);
            out.logprobs.extend(echo.logprobs.unwrap_or_default());
        }
    }
}

impl Produced {
    /// `first`'s text, logprobs and ids before this one's.
    fn prepend(&mut self, mut first: Produced) {
        first.text.push_str(&self.text);
        first.logprobs.append(&mut self.logprobs);
        first.token_ids.append(&mut self.token_ids);
        first.counted |= self.counted;
        *self = first;
    }
}

#[cfg(test)]
mod tests;
