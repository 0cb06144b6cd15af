//! Architecture hyper-parameters of a Llama-family model, read from GGUF metadata
//! (`<arch>.block_count`, ...) or a Hugging Face `config.json`.

use crate::kernels::RopeLayout;
use crate::model::gguf::GgufFile;

/// Errors while reading a model configuration.
#[derive(Debug, thiserror::Error)]
pub enum ModelConfigError {
    #[error(
        "unsupported architecture {0:?} (supported: llama, mistral, qwen2 / LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"
    )]
    UnsupportedArchitecture(String),
    #[error("model config: missing or invalid field {0}")]
    Missing(String),
    #[error("model config: {0}")]
    Invalid(String),
}

/// Model family (decides RoPE layout defaults and attention biases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3, SmolLM, and Mistral (same graph, no biases).
    Llama,
    /// Qwen2: Llama graph plus q/k/v biases.
    Qwen2,
}

/// Hyper-parameters of the transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub n_layers: usize,
    /// Residual width `d_model`.
    pub hidden_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// SwiGLU inner width.
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_eps: f32,
    pub rope_base: f64,
    /// Leading dims of each head that RoPE rotates (normally `head_dim`).
    pub rope_dim: usize,
    pub rope_layout: RopeLayout,
    /// Trained context length in tokens.
    pub max_context: usize,
    /// Output projection shares the token embedding.
    pub tie_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2).
    pub attn_bias: bool,
}

/// Tag of the salt recipe; change it (and the pinned test value) only on purpose: a fleet whose
/// nodes disagree on the salt sees no prefix hits across them.
pub const SALT_RECIPE: &str = "flotilla.salt.v1";

impl ModelConfig {
    /// The model identity salted into every block hash, so that blocks of different models
    /// never match. The recipe is an explicit field list (`kv/hash.rs` writes it out); it does
    /// not depend on how the struct is printed or laid out, so two builds always agree.
    pub fn block_hash_salt(&self) -> u64 {
        let mut b: Vec<u8> = Vec::with_capacity(128);
        fn text(b: &mut Vec<u8>, s: &str) {
            b.push(s.len() as u8);
            b.extend_from_slice(s.as_bytes());
        }
        b.extend_from_slice(SALT_RECIPE.as_bytes());
        text(
            &mut b,
            match self.arch {
                Architecture::Llama => "llama",
                Architecture::Qwen2 => "qwen2",
            },
        );
        for n in [
            self.n_layers,
            self.hidden_size,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
        ] {
            b.extend_from_slice(&(n as u64).to_le_bytes());
        }
        b.extend_from_slice(&self.rms_eps.to_bits().to_le_bytes());
        b.extend_from_slice(&self.rope_base.to_bits().to_le_bytes());
        b.extend_from_slice(&(self.rope_dim as u64).to_le_bytes());
        text(
            &mut b,
            match self.rope_layout {
                RopeLayout::Interleaved => "interleaved",
                RopeLayout::HalfSplit => "half_split",
            },
        );
        b.extend_from_slice(&(self.max_context as u64).to_le_bytes());
        b.push(u8::from(self.tie_embeddings));
        b.push(u8::from(self.attn_bias));
        xxhash_rust::xxh3::xxh3_64(&b)
    }

    /// Checks the invariants the kernels rely on.
    ///
    /// # Errors
    /// [`ModelConfigError::Invalid`] naming the broken invariant (a zero dimension, heads not a
    /// multiple of KV heads, an odd RoPE dimension, a head size over 512).
    pub fn validate(&self) -> Result<(), ModelConfigError> {
        let bad = |m: &str| Err(ModelConfigError::Invalid(m.to_owned()));
        if self.n_layers == 0 || self.hidden_size == 0 || self.n_heads == 0 || self.n_kv_heads == 0
        {
            return bad("zero-sized dimension");
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad("n_heads is not a multiple of n_kv_heads");
        }
        if !self.head_dim.is_multiple_of(2)
            || self.rope_dim > self.head_dim
            || !self.rope_dim.is_multiple_of(2)
        {
            return bad("head_dim / rope_dim must be even and rope_dim <= head_dim");
        }
        if self.head_dim > 512 {
            return bad("head_dim > 512 is not supported");
        }
        Ok(())
    }

    /// Reads `general.architecture` and the `<arch>.*` keys of a GGUF file.
    ///
    /// # Errors
    /// [`ModelConfigError::Missing`] for an absent key, [`ModelConfigError::UnsupportedArchitecture`]
    /// for an architecture other than Llama / Mistral / Qwen2, and whatever [`Self::validate`] finds.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, ModelConfigError> {
        let arch_name = f
            .get_str("general.architecture")
            .map_err(|_| ModelConfigError::Missing("general.architecture".into()))?
            .to_owned();
        let (arch, layout) = match arch_name.as_str() {
            "llama" | "mistral" => (Architecture::Llama, RopeLayout::Interleaved),
            "qwen2" => (Architecture::Qwen2, RopeLayout::HalfSplit),
            _ => return Err(ModelConfigError::UnsupportedArchitecture(arch_name)),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let u = |k: &str| -> Result<usize, ModelConfigError> {
            f.get_u64(&key(k))
                .map(|v| v as usize)
                .map_err(|_| ModelConfigError::Missing(key(k)))
        };
        let hidden_size = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = u("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = u("attention.key_length").unwrap_or(hidden_size / n_heads.max(1));
        let vocab_size = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => f
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.as_array())
                .map(|a| a.len())
                .ok_or_else(|| ModelConfigError::Missing(key("vocab_size")))?,
        };
        let cfg = Self {
            arch,
            n_layers: u("block_count")?,
            hidden_size,
            n_heads,
            n_kv_heads,
            head_dim,
            intermediate_size: u("feed_forward_length")?,
            vocab_size,
            rms_eps: f
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .map_err(|_| ModelConfigError::Missing(key("attention.layer_norm_rms_epsilon")))?
                as f32,
            rope_base: f.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_dim: u("rope.dimension_count").unwrap_or(head_dim),
            rope_layout: layout,
            max_context: u("context_length").unwrap_or(4096),
            tie_embeddings: !f.tensors.contains_key("output.weight"),
            attn_bias: f.tensors.contains_key("blk.0.attn_q.bias"),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a Hugging Face `config.json` (already parsed). HF checkpoints use half-split RoPE.
    ///
    /// # Errors
    /// As [`Self::from_gguf`], for the fields of `config.json`.
    pub fn from_hf_json(j: &serde_json::Value) -> Result<Self, ModelConfigError> {
        let archs = j["architectures"]
            .as_array()
            .and_then(|a| a.first())
            .and_then(|v| v.as_str())
            .or_else(|| j["model_type"].as_str())
            .unwrap_or("")
            .to_owned();
        let arch = match archs.as_str() {
            "LlamaForCausalLM" | "MistralForCausalLM" | "llama" | "mistral" => Architecture::Llama,
            "Qwen2ForCausalLM" | "qwen2" => Architecture::Qwen2,
            _ => return Err(ModelConfigError::UnsupportedArchitecture(archs)),
        };
        let u = |k: &str| -> Result<usize, ModelConfigError> {
            j[k].as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| ModelConfigError::Missing(k.into()))
        };
        let hidden_size = u("hidden_size")?;
        let n_heads = u("num_attention_heads")?;
        let head_dim = u("head_dim").unwrap_or(hidden_size / n_heads.max(1));
        if !j["rope_scaling"].is_null() {
            return Err(ModelConfigError::Invalid(
                "rope_scaling is not supported".into(),
            ));
        }
        let cfg = Self {
            arch,
            n_layers: u("num_hidden_layers")?,
            hidden_size,
            n_heads,
            n_kv_heads: u("num_key_value_heads").unwrap_or(n_heads),
            head_dim,
            intermediate_size: u("intermediate_size")?,
            vocab_size: u("vocab_size")?,
            rms_eps: j["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            rope_base: j["rope_theta"].as_f64().unwrap_or(10_000.0),
            rope_dim: head_dim,
            rope_layout: RopeLayout::HalfSplit,
            max_context: u("max_position_embeddings").unwrap_or(4096),
            tie_embeddings: j["tie_word_embeddings"].as_bool().unwrap_or(false),
            attn_bias: arch == Architecture::Qwen2
                || j["attention_bias"].as_bool().unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Writes the matching Hugging Face `config.json` (used by tools and tests).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let arch = match self.arch {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
        };
        serde_json::json!({
            "architectures": [arch],
            "model_type": if self.arch == Architecture::Qwen2 { "qwen2" } else { "llama" },
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "num_hidden_layers": self.n_layers,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_base,
            "max_position_embeddings": self.max_context,
            "tie_word_embeddings": self.tie_embeddings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M's shapes (the embedded default model).
    fn smollm2() -> ModelConfig {
        ModelConfig {
            arch: Architecture::Llama,
            n_layers: 30,
            hidden_size: 576,
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
            intermediate_size: 1536,
            vocab_size: 49152,
            rms_eps: 1e-5,
            rope_base: 100_000.0,
            rope_dim: 64,
            rope_layout: RopeLayout::Interleaved,
            max_context: 8192,
            tie_embeddings: true,
            attn_bias: false,
        }
    }

    /// The salt recipe is pinned: a change to it (or to a field's encoding) changes every block
    /// hash, and a fleet of mixed versions would then see no prefix hits across its nodes.
    #[test]
    fn the_block_hash_salt_recipe_is_pinned() {
        assert_eq!(smollm2().block_hash_salt(), 0x99bb_54f7_e72c_0a06);
    }

    #[test]
    fn every_field_is_in_the_salt() {
        let base = smollm2().block_hash_salt();
        let changes: [fn(&mut ModelConfig); 15] = [
            |c| c.arch = Architecture::Qwen2,
            |c| c.n_layers += 1,
            |c| c.hidden_size += 1,
            |c| c.n_heads += 1,
            |c| c.n_kv_heads += 1,
            |c| c.head_dim += 1,
            |c| c.intermediate_size += 1,
            |c| c.vocab_size += 1,
            |c| c.rms_eps = 1e-6,
            |c| c.rope_base = 10_000.0,
            |c| c.rope_dim = 32,
            |c| c.rope_layout = RopeLayout::HalfSplit,
            |c| c.max_context += 1,
            |c| c.tie_embeddings = false,
            |c| c.attn_bias = true,
        ];
        for (i, change) in changes.iter().enumerate() {
            let mut c = smollm2();
            change(&mut c);
            assert_ne!(c.block_hash_salt(), base, "field change {i}");
        }
    }
}
