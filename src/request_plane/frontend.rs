//! What the gateway needs of the model to accept requests: its name, tokenizer, chat template
//! and context length. Loaded without the weights (a GGUF file's metadata, or a Hugging Face
//! directory's configuration and tokenizer files: [`crate::model::load_face`]) — routing needs
//! token ids, so the gateway tokenizes.

use crate::model::ModelError;
use crate::model::chat_template::{ChatMessage, ChatTemplate};
use crate::model::tokenizer::Tokenizer;
use crate::openai::error::{ApiError, ErrorKind};
use crate::openai::request::{GenerationRequest, Input};
use std::borrow::Borrow;
use std::path::Path;
use std::sync::Arc;

/// The served model as the gateway sees it.
pub struct Frontend {
    /// Name clients use in `model` (the file stem of the model path).
    pub model_id: String,
    /// Tokenizer (shared with the streaming detokenizers).
    pub tokenizer: Arc<Tokenizer>,
    /// Chat template, if the model has one.
    pub template: Option<ChatTemplate>,
    /// Context window in tokens (prompt + generated), capped by the workers' limit.
    pub context_len: usize,
    /// Vocabulary size (prompt token ids must be below it).
    pub vocab_size: usize,
    /// The block-hash salt the workers' pools use for this model
    /// ([`ModelConfig::block_hash_salt`](crate::model::config::ModelConfig::block_hash_salt)),
    /// so the gateway computes the same sequence hashes.
    pub salt: u64,
}

/// A cheap handle on the tokenizer that detokenizers can own.
#[derive(Clone)]
pub struct TokRef(pub Arc<Tokenizer>);

impl Borrow<tokenizers::Tokenizer> for TokRef {
    fn borrow(&self) -> &tokenizers::Tokenizer {
        self.0.inner()
    }
}

impl Frontend {
    /// Load from a GGUF file (metadata only) or a Hugging Face directory (no weights read);
    /// `max_context` caps the model's own context length.
    ///
    /// # Errors
    /// The model's files cannot be read or parsed (tokenizer, template or metadata).
    pub fn load(path: &Path, max_context: usize) -> Result<Self, ModelError> {
        let model_id = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let face = crate::model::load_face(path)?;
        Ok(Self {
            model_id,
            salt: face.config.block_hash_salt(),
            tokenizer: Arc::new(face.tokenizer),
            template: face.chat_template,
            context_len: face.config.max_context.min(max_context),
            vocab_size: face.config.vocab_size,
        })
    }

    /// The prompt's token ids: chat messages through the template (its own special tokens,
    /// one BOS if the template writes one, no extra), text tokenized as-is (BOS added only when
    /// the model asks for one and the text lacks it), token ids checked against the vocabulary.
    ///
    /// # Errors
    /// 400 ([`ErrorKind::InvalidRequest`]) for a chat request to a model without a chat
    /// template, messages its template rejects, a token id outside the vocabulary, or a list of
    /// prompts (routes that answer one prompt; [`Self::prompts_ids`] answers lists); 500 when
    /// the tokenizer fails.
    pub fn prompt_ids(&self, req: &GenerationRequest) -> Result<Vec<u32>, ApiError> {
        if let Input::Batch(_) = req.input {
            return Err(ApiError::new(
                ErrorKind::InvalidRequest,
                "this route takes one prompt, not a list of prompts",
            )
            .param("prompt"));
        }
        self.input_ids(&req.input, "prompt")
    }

    /// The token ids of each prompt of a request, in order: one for a chat or a single
    /// prompt, one per item of a list of prompts (`/v1/completions`).
    ///
    /// # Errors
    /// As [`Self::prompt_ids`]; an out-of-vocabulary id in a list names its prompt
    /// (`prompt[i]`).
    pub fn prompts_ids(&self, req: &GenerationRequest) -> Result<Vec<Vec<u32>>, ApiError> {
        match &req.input {
            Input::Batch(items) => items
                .iter()
                .enumerate()
                .map(|(i, p)| self.input_ids(p, &format!("prompt[{i}]")))
                .collect(),
            one => Ok(vec![self.input_ids(one, "prompt")?]),
        }
    }

    /// One input's ids; `name` names a token-id prompt in errors.
    fn input_ids(&self, input: &Input, name: &str) -> Result<Vec<u32>, ApiError> {
        let internal = |e: String| {
            tracing::error!(error = %e, "tokenization failed");
            ApiError::new(
                ErrorKind::Internal,
                "internal error while tokenizing the prompt",
            )
        };
        match input {
            Input::Chat(messages) => {
                let msgs: Vec<ChatMessage> = messages
                    .iter()
                    .map(|m| ChatMessage {
                        role: serde_json::to_value(m.role)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_owned))
                            .unwrap_or_else(|| "user".into()),
                        content: m.content.clone(),
                    })
                    .collect();
                self.chat_ids(&msgs)
            }
            Input::Text(text) => self
                .tokenizer
                .encode(text)
                .map_err(|e| internal(e.to_string())),
            Input::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
                    return Err(ApiError::new(
                        ErrorKind::InvalidRequest,
                        format!(
                            "{name} token id {bad} is out of range (vocabulary size {})",
                            self.vocab_size
                        ),
                    )
                    .param("prompt"));
                }
                Ok(ids.clone())
            }
            Input::Batch(_) => Err(ApiError::new(
                ErrorKind::InvalidRequest,
                "a list of prompts cannot nest another list",
            )
            .param("prompt")),
        }
    }

    /// A chat's token ids: the messages through the model's chat template (with the
    /// generation prompt), then the tokenizer — what the gateway places and the workers
    /// prefill for `/v1/chat/completions` (the simulator reads chat workloads through it too).
    ///
    /// # Errors
    /// As [`Self::prompt_ids`] for chat messages.
    pub fn chat_ids(&self, msgs: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        let template = self.template.as_ref().ok_or_else(|| {
            ApiError::new(
                ErrorKind::InvalidRequest,
                "this model has no chat template; use /v1/completions",
            )
            .param("messages")
        })?;
        let text = template.render(msgs, true).map_err(|e| {
            ApiError::new(
                ErrorKind::InvalidRequest,
                format!("the chat template rejected the messages: {e}"),
            )
            .param("messages")
        })?;
        self.tokenizer.encode(&text).map_err(|e| {
            tracing::error!(error = %e, "tokenization failed");
            ApiError::new(
                ErrorKind::Internal,
                "internal error while tokenizing the prompt",
            )
        })
    }

    /// `GET /v1/models` entry of the served model.
    pub fn model_object(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "flotilla",
            "max_model_len": self.context_len,
        })
    }
}
