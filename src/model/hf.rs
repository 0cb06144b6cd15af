//! Hugging Face model directories: `config.json` + `*.safetensors` (F32 / F16 / BF16, loaded
//! as f32) for the Llama family. Tensor names follow `transformers`' `LlamaForCausalLM`:
//! `model.embed_tokens`, `model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
//! post_attention_layernorm, mlp.{gate,up,down}_proj}`, `model.norm`, `lm_head`.
//! q/k rows are in HF's half-split RoPE order (no GGUF permutation).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::kernels::{MatrixData, WeightMatrix};
use crate::model::config::{ModelConfig, ModelConfigError};
use crate::model::weights::{LayerWeights, ModelWeights};

/// Errors while loading a Hugging Face directory.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid JSON in {path}: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error(transparent)]
    Config(#[from] ModelConfigError),
    #[error("no *.safetensors files in {0}")]
    NoWeights(PathBuf),
    #[error("corrupt safetensors file {path}: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    #[error("tensor {0} not found in the safetensors files")]
    MissingTensor(String),
    #[error("tensor {tensor} has unsupported dtype {dtype} (supported: F32, F16, BF16)")]
    UnsupportedDtype { tensor: String, dtype: String },
    #[error("tensor {tensor} has shape {shape:?}, expected {expected:?}")]
    BadShape {
        tensor: String,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
}

/// Reads and parses a JSON file.
///
/// # Errors
/// [`HfError::Io`] when the file cannot be read, [`HfError::Json`] when it is not JSON.
pub fn read_json(path: &Path) -> Result<serde_json::Value, HfError> {
    let text = std::fs::read_to_string(path).map_err(|source| HfError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| HfError::Json {
        path: path.to_owned(),
        source,
    })
}

struct Shards {
    maps: Vec<(PathBuf, Mmap)>,
    /// tensor name -> shard index
    index: HashMap<String, usize>,
}

impl Shards {
    fn open(dir: &Path) -> Result<Self, HfError> {
        let io = |source| HfError::Io {
            path: dir.to_owned(),
            source,
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(HfError::NoWeights(dir.to_owned()));
        }
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = std::fs::File::open(&path).map_err(|source| HfError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: read-only map of a file nobody modifies while we run.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| HfError::Io {
                path: path.clone(),
                source,
            })?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| HfError::Safetensors {
                path: path.clone(),
                msg: e.to_string(),
            })?;
            for name in st.names() {
                index.insert(name.to_string(), i);
            }
            maps.push((path, mmap));
        }
        Ok(Self { maps, index })
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Tensor `name` as f32 with the expected shape.
    fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, HfError> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| HfError::MissingTensor(name.to_owned()))?;
        let (path, mmap) = &self.maps[i];
        let st = SafeTensors::deserialize(mmap).map_err(|e| HfError::Safetensors {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        let t = st
            .tensor(name)
            .map_err(|_| HfError::MissingTensor(name.to_owned()))?;
        if t.shape() != shape {
            return Err(HfError::BadShape {
                tensor: name.to_owned(),
                shape: t.shape().to_vec(),
                expected: shape.to_vec(),
            });
        }
        // Data is not guaranteed aligned: decode from bytes.
        let d = t.data();
        Ok(match t.dtype() {
            Dtype::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => d
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => d
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(HfError::UnsupportedDtype {
                    tensor: name.to_owned(),
                    dtype: format!("{other:?}"),
                });
            }
        })
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<WeightMatrix, HfError> {
        Ok(WeightMatrix {
            rows,
            cols,
            data: MatrixData::F32(self.load(name, &[rows, cols])?),
        })
    }
}

/// Loads `config.json` and the weights of a Hugging Face directory.
///
/// # Errors
/// [`HfError`] when `config.json` is missing or invalid, no `*.safetensors` shard exists,
/// or a tensor is missing or has the wrong shape.
pub fn load_weights(dir: &Path) -> Result<ModelWeights, HfError> {
    let config = ModelConfig::from_hf_json(&read_json(&dir.join("config.json"))?)?;
    let s = Shards::open(dir)?;
    let c = &config;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let opt = |name: &str, n: usize| -> Result<Option<Vec<f32>>, HfError> {
        if s.has(name) {
            s.load(name, &[n]).map(Some)
        } else {
            Ok(None)
        }
    };
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let p = |x: &str| format!("model.layers.{i}.{x}");
        layers.push(LayerWeights {
            attn_norm: s.load(&p("input_layernorm.weight"), &[h])?,
            wq: s.matrix(&p("self_attn.q_proj.weight"), c.n_heads * hd, h)?,
            wk: s.matrix(&p("self_attn.k_proj.weight"), c.n_kv_heads * hd, h)?,
            wv: s.matrix(&p("self_attn.v_proj.weight"), c.n_kv_heads * hd, h)?,
            bq: opt(&p("self_attn.q_proj.bias"), c.n_heads * hd)?,
            bk: opt(&p("self_attn.k_proj.bias"), c.n_kv_heads * hd)?,
            bv: opt(&p("self_attn.v_proj.bias"), c.n_kv_heads * hd)?,
            wo: s.matrix(&p("self_attn.o_proj.weight"), h, c.n_heads * hd)?,
            ffn_norm: s.load(&p("post_attention_layernorm.weight"), &[h])?,
            w_gate: s.matrix(&p("mlp.gate_proj.weight"), c.intermediate_size, h)?,
            w_up: s.matrix(&p("mlp.up_proj.weight"), c.intermediate_size, h)?,
            w_down: s.matrix(&p("mlp.down_proj.weight"), h, c.intermediate_size)?,
        });
    }
    let lm_head = if c.tie_embeddings || !s.has("lm_head.weight") {
        None
    } else {
        Some(s.matrix("lm_head.weight", c.vocab_size, h)?)
    };
    Ok(ModelWeights {
        embed: s.matrix("model.embed_tokens.weight", c.vocab_size, h)?,
        layers,
        norm: s.load("model.norm.weight", &[h])?,
        lm_head,
        config,
    })
}
