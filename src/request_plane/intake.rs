//! The gateway's intake, pure: what a parsed generation request becomes before any actor
//! sees it.
//!
//! A request goes through five named stages; the HTTP side of each is in
//! `actors/gateway/serve/intake.rs`:
//! 1. **parse** — the body, read within its limits, into the neutral [`GenerationRequest`] by
//!    the API's adapter (`openai::request` for chat and completions, `anthropic::request` for
//!    Messages);
//! 2. **admit** — the priority class (400 when unknown), then admission control on the
//!    published fleet view (`admission.rs`: 429/503), before anything else is spent on the
//!    request (a class named by header was judged before the body was even read);
//! 3. **validate** — the model (404), the routing-policy header, the session key (400
//!    naming the field or header);
//! 4. **tokenize** — [`tokenize`]: every prompt's ids, each checked against the context
//!    before any choice starts (a refusal names `prompt[i]` in a batch);
//! 5. **place** — [`submissions`]: one [`SubmitRequest`] per choice, prompt-major, which the
//!    gateway hands to one Request actor each.

use crate::openai::error::ApiError;
use crate::openai::request::GenerationRequest;
use crate::request_plane::frontend::Frontend;
use crate::request_plane::priority::ClassTag;
use crate::request_plane::protocol::{SamplingParams, SubmitRequest};
use crate::runtime::ids::{NodeId, RequestId};

/// The tokenize stage's result: each prompt's token ids and the `max_tokens` its choices
/// run with, in the request's order.
#[derive(Clone, Debug, PartialEq)]
pub struct Tokenized {
    pub prompts: Vec<Vec<u32>>,
    pub max_tokens: Vec<u32>,
}

impl Tokenized {
    /// Each prompt's length in tokens.
    pub fn prompt_tokens(&self) -> Vec<u32> {
        self.prompts.iter().map(|p| p.len() as u32).collect()
    }
}

/// Tokenize every prompt of `req` and check each against the context of `fe`'s model.
///
/// # Errors
/// 400 for a prompt that cannot be tokenized or does not fit (with `max_tokens`) in the
/// context; in a batch of prompts the message starts with `prompt[i]: `.
pub fn tokenize(fe: &Frontend, req: &GenerationRequest) -> Result<Tokenized, ApiError> {
    let prompts = fe.prompts_ids(req)?;
    let max_tokens = fit_context(req, &prompts, fe.context_len)?;
    Ok(Tokenized {
        prompts,
        max_tokens,
    })
}

/// Each prompt's `max_tokens` within a context of `context_len` tokens.
fn fit_context(
    req: &GenerationRequest,
    prompts: &[Vec<u32>],
    context_len: usize,
) -> Result<Vec<u32>, ApiError> {
    let batch = prompts.len() > 1;
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            req.check_context(p.len(), context_len).map_err(|mut e| {
                if batch {
                    e.message = format!("prompt[{i}]: {}", e.message);
                }
                e
            })
        })
        .collect()
}

/// What every choice's submission shares: who owns it, its ids, its arrival (one for all the
/// choices of a request), its trace, class and session.
#[derive(Clone, Debug)]
pub struct Placement {
    /// The gateway node and its incarnation (the sequences' owner).
    pub reply_to: NodeId,
    pub owner_incarnation: u64,
    /// When the client's wait began (ms since the Unix epoch): the batch former's FCFS order.
    pub waiting_since_ms: u64,
    /// The first choice's request id; choice `i` gets `first_id + i`.
    pub first_id: u64,
    /// The client's request id (`x-request-id`).
    pub trace_id: Option<String>,
    /// The gateway's `request` span as W3C trace context, when an OTLP export runs.
    pub traceparent: Option<String>,
    pub class: Option<ClassTag>,
    pub session: Option<String>,
}

/// One choice to place.
#[derive(Clone, Debug)]
pub struct ChoicePlan {
    /// Its index in the response: prompt `p`'s choice `j` is `p × n + j`.
    pub index: u32,
    /// Its prompt's index in the request.
    pub prompt: usize,
    pub submit: SubmitRequest,
}

/// The choices of `req`, prompt-major, each with its submission. Choice `j` of every prompt
/// samples with `seed + j` (as it would alone); with `echo` and `logprobs` its worker scores
/// the prompt.
pub fn submissions(req: &GenerationRequest, tok: &Tokenized, at: &Placement) -> Vec<ChoicePlan> {
    let sp = &req.sampling;
    let mut plans = Vec::with_capacity(tok.prompts.len() * req.n as usize);
    for (p, prompt) in tok.prompts.iter().enumerate() {
        for j in 0..req.n {
            let index = p as u32 * req.n + j;
            let submit = SubmitRequest {
                reply_to: at.reply_to.clone(),
                owner_incarnation: at.owner_incarnation,
                waiting_since_ms: at.waiting_since_ms,
                request: RequestId(at.first_id + u64::from(index)),
                prompt: prompt.clone(),
                max_tokens: tok.max_tokens[p],
                sampling: SamplingParams {
                    temperature: sp.temperature,
                    top_p: sp.top_p,
                    top_k: sp.top_k.unwrap_or(0) as usize,
                    seed: sp.seed.map(|x| x.wrapping_add(u64::from(j))),
                    offset: 0,
                    logprobs: req.logprobs.is_some(),
                    top_logprobs: req.logprobs.unwrap_or(0),
                    // Echo with logprobs: the worker scores the prompt.
                    echo_tokens: if req.echo && req.logprobs.is_some() {
                        u32::try_from(prompt.len()).unwrap_or(u32::MAX)
                    } else {
                        0
                    },
                },
                stop_token_ids: vec![],
                ignore_eos: req.ignore_eos,
                trace_id: at.trace_id.clone(),
                traceparent: at.traceparent.clone(),
                hand_off: false,
                remote_kv: None,
                fetch: None,
                class: at.class.clone(),
                session: at.session.clone(),
            };
            plans.push(ChoicePlan {
                index,
                prompt: p,
                submit,
            });
        }
    }
    plans
}

#[cfg(test)]
mod tests;
