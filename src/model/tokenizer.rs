//! Tokenizer from a Hugging Face `tokenizer.json` or rebuilt from GGUF metadata
//! (`tokenizer.ggml.*`), both through the `tokenizers` crate.
//!
//! GGUF `gpt2`-style BPE: vocabulary = `tokenizer.ggml.tokens`, merges =
//! `tokenizer.ggml.merges`, byte-level pre-tokenizer/decoder; tokens of type 3 (control) and
//! 4 (user-defined) become added special tokens. The pre-tokenizer regex follows
//! `tokenizer.ggml.pre` as llama.cpp does (`llama-vocab.cpp`): `smollm` (and `starcoder`,
//! `refact`, ...) split digits individually before the GPT-2 regex.

use std::path::Path;

use crate::model::gguf::{GgufFile, MetaValue};

/// Errors while building or running the tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer from {what}: {msg}")]
    Load { what: String, msg: String },
    #[error("tokenizer metadata missing: {0}")]
    Missing(String),
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    #[error("tokenizer failed: {0}")]
    Run(String),
}

/// Llama-3 pre-tokenizer regex (`tokenizer.json` of Meta-Llama-3).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 pre-tokenizer regex (single digits).
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A text ↔ token-id codec plus the model's special ids.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence id, if the model has one.
    pub bos_id: Option<u32>,
    /// Ids that end generation (EOS, end-of-turn).
    pub eos_ids: Vec<u32>,
    /// Whether `encode` prepends BOS (GGUF `tokenizer.ggml.add_bos_token`, HF `add_bos_token`).
    pub add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

fn run_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Run(e.to_string())
}

impl Tokenizer {
    /// Wraps a `tokenizers` tokenizer.
    pub fn new(
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        eos_ids: Vec<u32>,
        add_bos: bool,
    ) -> Self {
        Self {
            inner,
            bos_id,
            eos_ids,
            add_bos,
        }
    }

    /// The underlying `tokenizers` object (e.g. to save a `tokenizer.json`).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encodes `text` as-is: special tokens written in the text (e.g. `<|im_start|>`) map to
    /// their ids; BOS is prepended only when the model asks for it and the text lacks it.
    ///
    /// # Errors
    /// [`TokenizerError::Run`] when the tokenizer fails on the text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.inner.encode(text, false).map_err(run_err)?;
        let mut ids = enc.get_ids().to_vec();
        if let (true, Some(b)) = (self.add_bos, self.bos_id)
            && ids.first() != Some(&b)
        {
            ids.insert(0, b);
        }
        Ok(ids)
    }

    /// Decodes ids to text; special tokens are kept unless `skip_special`.
    ///
    /// # Errors
    /// [`TokenizerError::Run`] when an id is outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner.decode(ids, skip_special).map_err(run_err)
    }

    /// True when `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// Text of one token id (special tokens included), if it exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Id of a token string, if it exists.
    pub fn token_to_id(&self, tok: &str) -> Option<u32> {
        self.inner.token_to_id(tok)
    }

    /// Loads `tokenizer.json`; special ids come from the caller (see `tokenizer_config.json`).
    ///
    /// # Errors
    /// [`TokenizerError::Load`] when the file cannot be read or parsed.
    pub fn from_file(
        path: &Path,
        bos: Option<&str>,
        eos: &[String],
        add_bos: bool,
    ) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
            what: path.display().to_string(),
            msg: e.to_string(),
        })?;
        let bos_id = bos.and_then(|b| inner.token_to_id(b));
        let eos_ids: Vec<u32> = eos.iter().filter_map(|e| inner.token_to_id(e)).collect();
        Ok(Self::new(inner, bos_id, eos_ids, add_bos))
    }

    /// Rebuilds the tokenizer from GGUF metadata.
    ///
    /// # Errors
    /// [`TokenizerError::Missing`] when a `tokenizer.ggml.*` key is absent,
    /// [`TokenizerError::Unsupported`] for a tokenizer model other than BPE, and
    /// [`TokenizerError::Load`] when the vocabulary or merges do not build a tokenizer.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, TokenizerError> {
        let model = f
            .get_str("tokenizer.ggml.model")
            .map_err(|_| TokenizerError::Missing("tokenizer.ggml.model".into()))?;
        if model != "gpt2" {
            return Err(TokenizerError::Unsupported(format!(
                "tokenizer.ggml.model = {model:?} (only byte-level BPE \"gpt2\" is supported)"
            )));
        }
        let pre = f.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let pre_tokenizer = match pre {
            "default" | "gpt2" | "gpt-2" => byte_level(true),
            "smollm" | "starcoder" | "refact" | "codeshell" => serde_json::json!({
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    byte_level(true)
                ]
            }),
            "llama-bpe" | "llama3" => split_then_bytes(LLAMA3_REGEX),
            "qwen2" => split_then_bytes(QWEN2_REGEX),
            other => {
                return Err(TokenizerError::Unsupported(format!(
                    "tokenizer.ggml.pre = {other:?}"
                )));
            }
        };
        let strings = |key: &str| -> Result<Vec<String>, TokenizerError> {
            f.get(key)
                .and_then(MetaValue::as_array)
                .ok_or_else(|| TokenizerError::Missing(key.into()))?
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| TokenizerError::Missing(format!("{key} (non-string entry)")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = f
            .get("tokenizer.ggml.token_type")
            .and_then(MetaValue::as_array)
            .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
            .unwrap_or_default();
        let mut vocab = serde_json::Map::new();
        let mut added = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert(t.clone(), serde_json::json!(i));
            if matches!(types.get(i), Some(3 | 4)) {
                added.push(serde_json::json!({
                    "id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true
                }));
            }
        }
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges
            }
        });
        let inner = <tokenizers::Tokenizer as std::str::FromStr>::from_str(&json.to_string())
            .map_err(|e| TokenizerError::Load {
                what: "GGUF tokenizer.ggml.* metadata".into(),
                msg: e.to_string(),
            })?;
        let id = |k: &str| f.get(k).and_then(MetaValue::as_u64).map(|v| v as u32);
        let mut eos_ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .iter()
            .filter_map(|k| id(k))
            .collect();
        eos_ids.dedup();
        let add_bos = f
            .get("tokenizer.ggml.add_bos_token")
            .and_then(MetaValue::as_bool)
            .unwrap_or(false);
        Ok(Self::new(
            inner,
            id("tokenizer.ggml.bos_token_id"),
            eos_ids,
            add_bos,
        ))
    }
}

fn byte_level(use_regex: bool) -> serde_json::Value {
    serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(regex: &str) -> serde_json::Value {
    serde_json::json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false)
        ]
    })
}
