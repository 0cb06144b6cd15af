//! Model loading: weights, tokenizer, chat template, KV memory and the forward pass.
//!
//! Layout:
//! - `mod.rs`: [`load_model`] (GGUF file or Hugging Face directory), [`resolve_model_path`], [`ModelError`].
//! - `gguf.rs`: GGUF container parser (metadata, tensor infos, mmap'd data).
//! - `hf.rs`: Hugging Face `config.json` + `*.safetensors` loader.
//! - `dequant.rs`: load-time f32 expansion of Q4_0 / Q5_0 / Q5_1 / Q4_K / Q6_K tensors.
//! - `config.rs`: [`config::ModelConfig`] hyper-parameters from either source.
//! - `weights.rs`: [`weights::ModelWeights`] (shared read-only via `Arc`) and the GGUF tensor loader.
//! - `tokenizer.rs`: [`tokenizer::Tokenizer`] from `tokenizer.json` or GGUF metadata.
//! - `chat_template.rs`: [`chat_template::ChatTemplate`] rendered with minijinja.
//! - `kv_cache.rs`: [`kv_cache::KvCache`], paged K/V pools `[num_blocks, block_size, n_kv_heads, head_dim]`.
//! - `forward.rs`: the batched forward pass over a [`crate::kernels::Backend`].

pub mod chat_template;
pub mod config;
pub mod dequant;
pub mod device_forward;
pub mod forward;
pub mod gguf;
pub mod hf;
pub mod kv_cache;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use chat_template::{ChatTemplate, TemplateError};
use config::{ModelConfig, ModelConfigError};
use gguf::{GgufError, GgufFile};
use hf::HfError;
use tokenizer::{Tokenizer, TokenizerError};
use weights::ModelWeights;

/// Default model location, relative to the working directory or the crate root.
pub const DEFAULT_MODEL_PATH: &str = "models/smollm2-135m-instruct-q4_1.gguf";
/// Environment variable naming the model.
pub const MODEL_ENV: &str = "FLOTILLA_MODEL";

/// Errors while locating or loading a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// No model file or folder at this path. For the default path the message says to run
    /// `make model`; for any other path it only names the path.
    #[error("model not found: {} does not exist{}", .0.display(), fetch_hint(.0))]
    NotFound(PathBuf),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error(transparent)]
    Config(#[from] ModelConfigError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// What to run when the missing model is the default one (`make model` fetches it).
fn fetch_hint(path: &Path) -> &'static str {
    if path.ends_with(DEFAULT_MODEL_PATH) {
        " (run `make model` in the flotilla repository to fetch the default model, or pass \
         --model PATH / set FLOTILLA_MODEL)"
    } else {
        ""
    }
}

/// Finds the model: `explicit`, else `$FLOTILLA_MODEL`, else [`DEFAULT_MODEL_PATH`] relative
/// to the current directory, then to this crate's manifest directory.
///
/// # Errors
/// [`ModelError::NotFound`] naming the path that was tried (for the default, the one relative
/// to the current directory, made absolute).
pub fn resolve_model_path(explicit: Option<&Path>) -> Result<PathBuf, ModelError> {
    let check = |p: PathBuf| {
        if p.exists() {
            Ok(p)
        } else {
            Err(ModelError::NotFound(p))
        }
    };
    if let Some(p) = explicit {
        return check(p.to_owned());
    }
    if let Some(p) = std::env::var_os(MODEL_ENV).filter(|v| !v.is_empty()) {
        return check(PathBuf::from(p));
    }
    let cands = [
        PathBuf::from(DEFAULT_MODEL_PATH),
        Path::new(env!("CARGO_MANIFEST_DIR")).join(DEFAULT_MODEL_PATH),
    ];
    cands.iter().find(|p| p.exists()).cloned().ok_or_else(|| {
        let cwd = std::env::current_dir().unwrap_or_default();
        ModelError::NotFound(cwd.join(DEFAULT_MODEL_PATH))
    })
}

/// Everything loaded from one model source.
#[derive(Debug)]
pub struct LoadedModel {
    /// Shared by every engine replica of the process.
    pub weights: Arc<ModelWeights>,
    pub tokenizer: Tokenizer,
    /// `None` when the model ships no template.
    pub chat_template: Option<ChatTemplate>,
}

impl LoadedModel {
    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    /// Renders one user message with the generation prompt appended.
    ///
    /// # Errors
    /// [`ModelError::Template`] when the model has no chat template or rendering fails.
    pub fn render_user_prompt(&self, text: &str) -> Result<String, ModelError> {
        let t = self.chat_template.as_ref().ok_or(TemplateError::Missing)?;
        Ok(t.render(&[chat_template::ChatMessage::user(text)], true)?)
    }
}

/// What a model says about itself without its weights: configuration, tokenizer and chat
/// template. A gateway needs only this ([`load_face`]); an engine loads the weights too
/// ([`load_model`]).
#[derive(Debug)]
pub struct ModelFace {
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// `None` when the model ships no template.
    pub chat_template: Option<ChatTemplate>,
}

/// Reads a model's [`ModelFace`] without touching its weights: a GGUF file's metadata, or a
/// Hugging Face directory's `config.json`, `tokenizer.json` and `tokenizer_config.json` (no
/// `*.safetensors` is opened).
///
/// # Errors
/// [`ModelError::NotFound`] when `path` does not exist; otherwise the loader's error
/// ([`ModelError::Gguf`], [`ModelError::Hf`], [`ModelError::Config`],
/// [`ModelError::Tokenizer`], [`ModelError::Template`]).
pub fn load_face(path: &Path) -> Result<ModelFace, ModelError> {
    if path.is_dir() {
        hf_face(path)
    } else if path.exists() {
        gguf_face(&GgufFile::open(path)?)
    } else {
        Err(ModelError::NotFound(path.to_owned()))
    }
}

/// Loads a GGUF file, or a Hugging Face directory (`config.json`, `*.safetensors`,
/// `tokenizer.json`, `tokenizer_config.json`).
///
/// # Errors
/// As [`load_face`], and the weights' own errors ([`ModelError::Gguf`], [`ModelError::Hf`]).
pub fn load_model(path: &Path) -> Result<LoadedModel, ModelError> {
    if path.is_dir() {
        let face = hf_face(path)?;
        let weights = Arc::new(hf::load_weights(path)?);
        Ok(LoadedModel {
            weights,
            tokenizer: face.tokenizer,
            chat_template: face.chat_template,
        })
    } else if path.exists() {
        let f = GgufFile::open(path)?;
        let face = gguf_face(&f)?;
        let weights = Arc::new(ModelWeights::from_gguf(&f, face.config)?);
        Ok(LoadedModel {
            weights,
            tokenizer: face.tokenizer,
            chat_template: face.chat_template,
        })
    } else {
        Err(ModelError::NotFound(path.to_owned()))
    }
}

fn gguf_face(f: &GgufFile) -> Result<ModelFace, ModelError> {
    let config = ModelConfig::from_gguf(f)?;
    let tokenizer = Tokenizer::from_gguf(f)?;
    let tok_str = |id: Option<u32>| {
        id.and_then(|i| tokenizer.id_to_token(i))
            .unwrap_or_default()
    };
    let chat_template = match f.get_str("tokenizer.chat_template") {
        Ok(src) => Some(ChatTemplate::new(
            src,
            &tok_str(tokenizer.bos_id),
            &tok_str(tokenizer.eos_ids.first().copied()),
        )?),
        Err(_) => None,
    };
    Ok(ModelFace {
        config,
        tokenizer,
        chat_template,
    })
}

/// Loads each model once and hands out shared references: replicas of one process that ask
/// for the same path get the same `Arc` (weights are read-only). Entries are weak, so a model
/// nobody uses any more is freed. Owned by whoever spawns replicas (no global state).
#[derive(Debug, Default)]
pub struct ModelCache {
    entries: std::sync::Mutex<std::collections::HashMap<PathBuf, std::sync::Weak<LoadedModel>>>,
}

impl ModelCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The model at `path`, loading it only if no live copy exists. Loading happens under the
    /// cache lock, so concurrent callers for the same path wait instead of loading twice.
    ///
    /// # Errors
    /// As [`load_model`], when no live copy exists and loading fails.
    pub fn get_or_load(&self, path: &Path) -> Result<Arc<LoadedModel>, ModelError> {
        let key = path.canonicalize().unwrap_or_else(|_| path.to_owned());
        let mut map = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(m) = map.get(&key).and_then(std::sync::Weak::upgrade) {
            return Ok(m);
        }
        let m = Arc::new(load_model(path)?);
        map.insert(key, Arc::downgrade(&m));
        Ok(m)
    }
}

/// A special-token entry of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_str(v: &serde_json::Value) -> Option<String> {
    v.as_str()
        .or_else(|| v["content"].as_str())
        .map(str::to_owned)
}

fn hf_face(dir: &Path) -> Result<ModelFace, ModelError> {
    let cfg = hf::read_json(&dir.join("config.json"))?;
    let config = ModelConfig::from_hf_json(&cfg)?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc = if tc_path.exists() {
        hf::read_json(&tc_path)?
    } else {
        serde_json::Value::Null
    };
    let bos = token_str(&tc["bos_token"]);
    let eos = token_str(&tc["eos_token"]);
    let add_bos = tc["add_bos_token"].as_bool().unwrap_or(false);
    let mut tokenizer = Tokenizer::from_file(
        &dir.join("tokenizer.json"),
        bos.as_deref(),
        &eos.iter().cloned().collect::<Vec<_>>(),
        add_bos,
    )?;
    // config.json's eos_token_id may list more end ids (int or list).
    let extra: Vec<u32> = match &cfg["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_u64().into_iter().map(|v| v as u32).collect(),
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    };
    for id in extra {
        if !tokenizer.eos_ids.contains(&id) {
            tokenizer.eos_ids.push(id);
        }
    }
    let source = match &tc["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .or_else(|| list.first())
            .and_then(|t| t["template"].as_str())
            .map(str::to_owned),
        _ => None,
    };
    let chat_template = source
        .map(|s| {
            ChatTemplate::new(
                &s,
                bos.as_deref().unwrap_or(""),
                eos.as_deref().unwrap_or(""),
            )
        })
        .transpose()?;
    Ok(ModelFace {
        config,
        tokenizer,
        chat_template,
    })
}
