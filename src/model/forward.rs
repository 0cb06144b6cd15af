//! One forward pass of a Llama-family decoder over a batch that mixes prefill chunks and
//! decode tokens. All tokens of the batch go through each weight matrix together, so every
//! weight is read once per step however many sequences run.
//!
//! Per layer: `h = RMSNorm(x)`, `q,k,v = h·Wqᵀ, h·Wkᵀ, h·Wvᵀ (+bias)`, RoPE on q and k, write k/v
//! into the paged cache, paged GQA attention, `x += attn·Woᵀ`, `h = RMSNorm(x)`,
//! `x += (silu(h·Wgᵀ) ⊙ h·Wuᵀ)·Wdᵀ`. Final RMSNorm and the output projection run only for the
//! rows whose logits are wanted (a sequence's last token, or all its tokens for prompt
//! log-probabilities).

use crate::kernels::{AttnGeometry, AttnToken, Backend, Rope};
use crate::model::kv_cache::KvCache;
use crate::model::weights::ModelWeights;
use crate::runtime::ids::BlockId;

/// Errors for a malformed batch (checked before any KV write).
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum ForwardError {
    #[error("sequence {seq}: token id {token} is outside the vocabulary ({vocab})")]
    BadToken {
        seq: usize,
        token: u32,
        vocab: usize,
    },
    #[error(
        "sequence {seq}: block table has {have} blocks, positions up to {last_pos} need {need}"
    )]
    ShortBlockTable {
        seq: usize,
        have: usize,
        need: usize,
        last_pos: usize,
    },
    #[error("sequence {seq}: block {block} is outside the pool ({num_blocks} blocks)")]
    BadBlock {
        seq: usize,
        block: BlockId,
        num_blocks: usize,
    },
    #[error("sequence {seq}: no tokens to run")]
    Empty { seq: usize },
    #[error("the KV cache has {have} layers, the model {need}")]
    CacheLayers { have: usize, need: usize },
    #[error("sequence {seq}: start_pos {start_pos} + {len} tokens overflows")]
    PositionOverflow {
        seq: usize,
        start_pos: usize,
        len: usize,
    },
}

#[doc(no_inline)]
pub use crate::kernels::ForwardSeq;

/// Checks a batch against the model and the cache. Sequences of one batch must not write the
/// same KV slots (distinct blocks for the new positions); that is the caller's contract.
///
/// # Errors
/// [`ForwardError`] naming the first offending sequence: no tokens, a token id outside the
/// vocabulary, a block table too short for its positions, or a block id outside the cache.
pub fn validate(
    w: &ModelWeights,
    kv: &KvCache,
    seqs: &[ForwardSeq<'_>],
) -> Result<(), ForwardError> {
    validate_for(w, kv.num_blocks, kv.block_size, seqs)
}

/// [`validate`] for a KV pool of `num_blocks` blocks of `block_size` tokens held anywhere
/// (e.g. on a GPU).
///
/// # Errors
/// As [`validate`].
pub fn validate_for(
    w: &ModelWeights,
    num_blocks: usize,
    block_size: usize,
    seqs: &[ForwardSeq<'_>],
) -> Result<(), ForwardError> {
    let vocab = w.config.vocab_size;
    for (i, s) in seqs.iter().enumerate() {
        if s.tokens.is_empty() {
            return Err(ForwardError::Empty { seq: i });
        }
        if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ForwardError::BadToken {
                seq: i,
                token: t,
                vocab,
            });
        }
        let last_pos = s
            .start_pos
            .checked_add(s.tokens.len() - 1)
            .filter(|p| p.checked_add(block_size).is_some() && *p <= i32::MAX as usize)
            .ok_or(ForwardError::PositionOverflow {
                seq: i,
                start_pos: s.start_pos,
                len: s.tokens.len(),
            })?;
        let need = last_pos / block_size + 1;
        if s.block_table.len() < need {
            return Err(ForwardError::ShortBlockTable {
                seq: i,
                have: s.block_table.len(),
                need,
                last_pos,
            });
        }
        if let Some(&b) = s.block_table[..need]
            .iter()
            .find(|b| b.0 as usize >= num_blocks)
        {
            return Err(ForwardError::BadBlock {
                seq: i,
                block: b,
                num_blocks,
            });
        }
    }
    Ok(())
}

/// Runs the batch; returns the logits (`[n_wanted, vocab]` f32, in batch order) of the last
/// token of every sequence with `want_logits`, and of every token (in position order) of
/// every sequence with `all_logits`.
///
/// # Errors
/// Whatever [`validate`] finds; nothing is computed or written then.
pub fn forward(
    w: &ModelWeights,
    be: &dyn Backend,
    rope: &Rope,
    kv: &mut KvCache,
    seqs: &[ForwardSeq<'_>],
) -> Result<Vec<f32>, ForwardError> {
    validate(w, kv, seqs)?;
    let c = &w.config;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (qd, kvd, ffn) = (c.n_heads * hd, c.n_kv_heads * hd, c.intermediate_size);
    let mut positions = Vec::new();
    let mut attn_tokens = Vec::new();
    let mut slots = Vec::new();
    for s in seqs {
        for i in 0..s.tokens.len() {
            let p = s.start_pos + i;
            positions.push(p);
            attn_tokens.push(AttnToken {
                pos: p,
                block_table: s.block_table,
            });
            slots.push(kv.slot_offset(s.block_table[p / kv.block_size], p % kv.block_size));
        }
    }
    let n = positions.len();
    let mut x = vec![0f32; n * h];
    for (row, &t) in x
        .chunks_exact_mut(h)
        .zip(seqs.iter().flat_map(|s| s.tokens.iter()))
    {
        w.embed.dequant_row(t as usize, row);
    }
    let geo = AttnGeometry {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: hd,
        block_size: kv.block_size,
    };
    let mut hbuf = vec![0f32; n * h];
    let mut q = vec![0f32; n * qd];
    let mut k = vec![0f32; n * kvd];
    let mut v = vec![0f32; n * kvd];
    let mut att = vec![0f32; n * qd];
    let mut o = vec![0f32; n * h];
    let mut gate = vec![0f32; n * ffn];
    let mut up = vec![0f32; n * ffn];
    for (l, lw) in w.layers.iter().enumerate() {
        be.rms_norm(&x, &lw.attn_norm, c.rms_eps, &mut hbuf);
        be.matmul_many(
            &hbuf,
            n,
            &[&lw.wq, &lw.wk, &lw.wv],
            &mut [&mut q, &mut k, &mut v],
        );
        for (buf, bias) in [(&mut q, &lw.bq), (&mut k, &lw.bk), (&mut v, &lw.bv)] {
            if let Some(b) = bias {
                for row in buf.chunks_exact_mut(b.len()) {
                    row.iter_mut().zip(b).for_each(|(a, &bb)| *a += bb);
                }
            }
        }
        be.rope(rope, &mut q, &positions);
        be.rope(rope, &mut k, &positions);
        let (lk, lv) = kv.layer_mut(l).ok_or(ForwardError::CacheLayers {
            have: l,
            need: w.layers.len(),
        })?;
        for (i, &off) in slots.iter().enumerate() {
            lk[off..off + kvd].copy_from_slice(&k[i * kvd..(i + 1) * kvd]);
            lv[off..off + kvd].copy_from_slice(&v[i * kvd..(i + 1) * kvd]);
        }
        be.paged_attention(&q, &attn_tokens, lk, lv, geo, &mut att);
        be.matmul(&att, n, &lw.wo, &mut o);
        x.iter_mut().zip(&o).for_each(|(a, &b)| *a += b);
        be.rms_norm(&x, &lw.ffn_norm, c.rms_eps, &mut hbuf);
        be.matmul_many(&hbuf, n, &[&lw.w_gate, &lw.w_up], &mut [&mut gate, &mut up]);
        be.swiglu(&mut gate, &up);
        be.matmul(&gate, n, &lw.w_down, &mut o);
        x.iter_mut().zip(&o).for_each(|(a, &b)| *a += b);
    }
    // Rows whose logits are wanted: the last token of each flagged sequence, every token of
    // a sequence that wants them all.
    let mut sel = Vec::new();
    let mut end = 0;
    for s in seqs {
        let start = end;
        end += s.tokens.len();
        if s.all_logits {
            sel.extend_from_slice(&x[start * h..end * h]);
        } else if s.want_logits {
            sel.extend_from_slice(&x[(end - 1) * h..end * h]);
        }
    }
    let m = sel.len() / h;
    let mut normed = vec![0f32; sel.len()];
    be.rms_norm(&sel, &w.norm, c.rms_eps, &mut normed);
    let head = w.lm_head();
    let mut logits = vec![0f32; m * head.rows];
    be.matmul(&normed, m, head, &mut logits);
    Ok(logits)
}
