//! Block hash and sequence hash: the exact recipe the router recomputes bit for bit.
//!
//! Both hashes are XXH3-64 (`xxhash_rust::xxh3::xxh3_64_with_seed`), seeded with the model
//! salt (a `u64` that names the model and adapter; two pools share prefixes only when their
//! salts are equal).
//!
//! ```text
//! block_hash(b)  = xxh3_64_with_seed(le_bytes(t_0) ++ le_bytes(t_1) ++ … ++ le_bytes(t_{bs-1}), salt)
//!                  where t_i are the block's token ids as u32, 4 little-endian bytes each
//! seq_hash(b_0)  = xxh3_64_with_seed(le_bytes(ROOT_PARENT_SEQ_HASH) ++ le_bytes(block_hash(b_0)), salt)
//! seq_hash(b_k)  = xxh3_64_with_seed(le_bytes(seq_hash(b_{k-1})) ++ le_bytes(block_hash(b_k)), salt)
//!                  (16 bytes of input: parent u64 LE, then block hash u64 LE)
//! ROOT_PARENT_SEQ_HASH = 0
//! ```
//!
//! The model salt ([`crate::model::config::ModelConfig::block_hash_salt`]) is XXH3-64 (seed 0)
//! of an explicit field list, so every build of every version that keeps the recipe agrees:
//!
//! ```text
//! salt = xxh3_64("flotilla.salt.v1" ++ arch ++ u64(n_layers) ++ u64(hidden_size) ++ u64(n_heads)
//!                ++ u64(n_kv_heads) ++ u64(head_dim) ++ u64(intermediate_size) ++ u64(vocab_size)
//!                ++ u32(rms_eps as f32 bits) ++ u64(rope_base as f64 bits) ++ u64(rope_dim)
//!                ++ rope_layout ++ u64(max_context) ++ u8(tie_embeddings) ++ u8(attn_bias))
//!        u64/u32 little-endian; arch = "llama" | "qwen2" and rope_layout = "interleaved" |
//!        "half_split" as UTF-8, each preceded by its length as one byte
//! ```
//!
//! Only *full* blocks are hashed: a trailing partial block has no hash. Equal sequence
//! hashes mean equal prefixes (all tokens from position 0 to the block's end), which is what
//! prefix reuse needs (vLLM automatic prefix caching; SGLang RadixAttention keys the same
//! information by a radix tree of token ids).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::runtime::ids::{BlockHash, SequenceHash};

/// The parent value used for the first block of every sequence.
pub const ROOT_PARENT_SEQ_HASH: u64 = 0;

/// XXH3-64 of one block's token ids (u32 little-endian bytes), seeded with `salt`.
pub fn block_hash(tokens: &[u32], salt: u64) -> BlockHash {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    BlockHash(xxh3_64_with_seed(&bytes, salt))
}

/// Chains `block` onto `parent` (`None` = the root, [`ROOT_PARENT_SEQ_HASH`]).
pub fn sequence_hash(parent: Option<SequenceHash>, block: BlockHash, salt: u64) -> SequenceHash {
    let parent = parent.map_or(ROOT_PARENT_SEQ_HASH, |p| p.0);
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&block.0.to_le_bytes());
    SequenceHash(xxh3_64_with_seed(&buf, salt))
}

/// `(block hash, sequence hash)` of every *full* block of `tokens`, in order.
///
/// A trailing partial block is ignored; `block_size == 0` yields an empty list.
pub fn block_hashes(
    tokens: &[u32],
    block_size: usize,
    salt: u64,
) -> Vec<(BlockHash, SequenceHash)> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for chunk in tokens.chunks_exact(block_size) {
        let bh = block_hash(chunk, salt);
        let sh = sequence_hash(parent, bh, salt);
        out.push((bh, sh));
        parent = Some(sh);
    }
    out
}
