//! The model's weights in memory (loaded once, shared read-only through `Arc` by every
//! replica), and the GGUF → weights loader.
//!
//! GGUF tensor names (llama.cpp `gguf-py/gguf/constants.py`): `token_embd`, `blk.N.attn_norm`,
//! `blk.N.attn_{q,k,v,output}`, `blk.N.ffn_norm`, `blk.N.ffn_{gate,up,down}`, `output_norm`,
//! `output` (absent when tied). A matrix with GGUF dims `[in, out]` is `W[out][in]` row-major.
//!
//! Storage by GGUF type: Q8_0 and Q4_1 stay quantised (the kernels run them natively); F32,
//! F16 and BF16 become f32; Q4_0, Q5_0, Q5_1, Q4_K and Q6_K are expanded to f32 at load
//! ([`crate::model::dequant`]); any other type is [`GgufError::UnsupportedDtype`].

use half::{bf16, f16};

use crate::kernels::quant::{parse_q4_1, parse_q8_0};
use crate::kernels::{MatrixData, WeightMatrix};
use crate::model::config::ModelConfig;
use crate::model::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};

/// Weights of one transformer block. Matrix shapes are `[out, in]`.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `[hidden]`
    pub attn_norm: Vec<f32>,
    /// `[n_heads·head_dim, hidden]`
    pub wq: WeightMatrix,
    /// `[n_kv_heads·head_dim, hidden]`
    pub wk: WeightMatrix,
    /// `[n_kv_heads·head_dim, hidden]`
    pub wv: WeightMatrix,
    /// Optional q/k/v biases (Qwen2), `[out]`.
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// `[hidden, n_heads·head_dim]`
    pub wo: WeightMatrix,
    /// `[hidden]`
    pub ffn_norm: Vec<f32>,
    /// `[ffn, hidden]`
    pub w_gate: WeightMatrix,
    /// `[ffn, hidden]`
    pub w_up: WeightMatrix,
    /// `[hidden, ffn]`
    pub w_down: WeightMatrix,
}

/// All weights of a model plus its configuration.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub config: ModelConfig,
    /// Token embedding `[vocab, hidden]`.
    pub embed: WeightMatrix,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm gain `[hidden]`.
    pub norm: Vec<f32>,
    /// Output projection `[vocab, hidden]`; `None` when tied to `embed`.
    pub lm_head: Option<WeightMatrix>,
}

impl ModelWeights {
    /// The output projection (`embed` when tied).
    pub fn lm_head(&self) -> &WeightMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of weights read by one decode step (all matrices + the output projection; the
    /// embedding lookup reads one row and is not counted unless tied as the output).
    pub fn bytes_per_decode_step(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|m| m.bytes())
                    .sum::<usize>()
            })
            .sum();
        layers + self.lm_head().bytes()
    }

    /// Loads every tensor of a GGUF file (quantised matrices stay quantised).
    ///
    /// # Errors
    /// [`GgufError`] when a tensor is missing, has the wrong shape, or has a type the kernels
    /// do not read.
    pub fn from_gguf(f: &GgufFile, config: ModelConfig) -> Result<Self, GgufError> {
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let mat = |name: &str, rows: usize, cols: usize| gguf_matrix(f, name, rows, cols);
        let vec = |name: &str, n: usize| gguf_vector(f, name, n);
        let opt_vec = |name: &str, n: usize| -> Result<Option<Vec<f32>>, GgufError> {
            if f.tensors.contains_key(name) {
                vec(name, n).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            layers.push(LayerWeights {
                attn_norm: vec(&p("attn_norm.weight"), h)?,
                wq: mat(&p("attn_q.weight"), c.n_heads * hd, h)?,
                wk: mat(&p("attn_k.weight"), c.n_kv_heads * hd, h)?,
                wv: mat(&p("attn_v.weight"), c.n_kv_heads * hd, h)?,
                bq: opt_vec(&p("attn_q.bias"), c.n_heads * hd)?,
                bk: opt_vec(&p("attn_k.bias"), c.n_kv_heads * hd)?,
                bv: opt_vec(&p("attn_v.bias"), c.n_kv_heads * hd)?,
                wo: mat(&p("attn_output.weight"), h, c.n_heads * hd)?,
                ffn_norm: vec(&p("ffn_norm.weight"), h)?,
                w_gate: mat(&p("ffn_gate.weight"), c.intermediate_size, h)?,
                w_up: mat(&p("ffn_up.weight"), c.intermediate_size, h)?,
                w_down: mat(&p("ffn_down.weight"), h, c.intermediate_size)?,
            });
        }
        let lm_head = if c.tie_embeddings {
            None
        } else {
            Some(mat("output.weight", c.vocab_size, h)?)
        };
        Ok(Self {
            embed: mat("token_embd.weight", c.vocab_size, h)?,
            layers,
            norm: vec("output_norm.weight", h)?,
            lm_head,
            config,
        })
    }
}

fn check_shape(info: &TensorInfo, expected: &[usize]) -> Result<(), GgufError> {
    // GGUF dims are fastest-first: a [rows, cols] matrix is stored as dims [cols, rows].
    let want: Vec<usize> = expected.iter().rev().copied().collect();
    let mut got = info.dims.clone();
    while got.len() > want.len() && got.last() == Some(&1) {
        got.pop();
    }
    if got != want {
        return Err(GgufError::BadShape {
            tensor: info.name.clone(),
            shape: info.dims.clone(),
            expected: want,
        });
    }
    Ok(())
}

/// Converts F32/F16/BF16 bytes (little endian) and the block types of
/// [`crate::model::dequant`] to f32.
fn float_data(info: &TensorInfo, bytes: &[u8]) -> Result<Vec<f32>, GgufError> {
    Ok(match info.dtype {
        GgmlType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        GgmlType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        GgmlType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        dtype => {
            if let Some(v) = crate::model::dequant::dequantize(dtype, bytes) {
                return Ok(v);
            }
            return Err(GgufError::UnsupportedDtype {
                tensor: info.name.clone(),
                dtype,
            });
        }
    })
}

fn gguf_vector(f: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, GgufError> {
    let info = f.tensor(name)?;
    check_shape(info, &[n])?;
    float_data(info, f.tensor_bytes(info))
}

fn gguf_matrix(
    f: &GgufFile,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<WeightMatrix, GgufError> {
    let info = f.tensor(name)?;
    check_shape(info, &[rows, cols])?;
    let bytes = f.tensor_bytes(info);
    let quantised = matches!(info.dtype, GgmlType::Q8_0 | GgmlType::Q4_1);
    if quantised && !cols.is_multiple_of(crate::kernels::quant::QK) {
        // Rows must be whole blocks for the kernels (ggml requires the same).
        return Err(GgufError::BadShape {
            tensor: name.to_owned(),
            shape: info.dims.clone(),
            expected: vec![cols.div_ceil(32) * 32, rows],
        });
    }
    let data = match info.dtype {
        GgmlType::Q8_0 => MatrixData::Q8_0(parse_q8_0(bytes)),
        GgmlType::Q4_1 => MatrixData::Q4_1(parse_q4_1(bytes)),
        _ => MatrixData::F32(float_data(info, bytes)?),
    };
    Ok(WeightMatrix { rows, cols, data })
}
