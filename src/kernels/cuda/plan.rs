//! The host side of one GPU step: a batch ([`ForwardSeq`]s) flattened into the index arrays
//! the kernels read, uploaded once per step.
//!
//! The arrays follow [`crate::model::forward::forward`]'s conventions exactly (tokens in batch
//! order, a token's KV slot at [`KvCache::slot_offset`](crate::model::kv_cache::KvCache::slot_offset),
//! the logits of each flagged sequence's last token — or of all its tokens — in batch order), so the GPU pass and the
//! CPU pass compute the same thing.

use crate::kernels::ForwardSeq;

/// One step's index arrays (the integer types are the kernels' parameter types).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Token ids, `[n]` (`embed_*`).
    pub tokens: Vec<u32>,
    /// Each token's position, `[n]` (`rope`, `paged_attention`).
    pub positions: Vec<i32>,
    /// Each token's KV slot: the element offset of its `[n_kv_heads, head_dim]` row inside
    /// any one layer's K or V pool, `[n]` (`kv_write`).
    pub slots: Vec<i64>,
    /// Where token `t`'s block table starts in [`StepPlan::block_tables`], `[n]`.
    pub table_start: Vec<i32>,
    /// Every sequence's block table (the blocks its positions use), concatenated.
    pub block_tables: Vec<i32>,
    /// Rows of the residual stream whose logits are wanted, in batch order (`copy_runs`).
    pub logit_rows: Vec<usize>,
}

impl StepPlan {
    /// Flattens a batch that [`crate::model::forward::validate`] accepted, for pools of
    /// `block_size`-token blocks whose slots are `row` values wide (`n_kv_heads · head_dim`).
    pub fn new(block_size: usize, row: usize, seqs: &[ForwardSeq<'_>]) -> Self {
        let mut p = Self::default();
        let bs = block_size;
        for s in seqs {
            let start = p.block_tables.len() as i32;
            let last = s.start_pos + s.tokens.len() - 1;
            p.block_tables
                .extend(s.block_table[..last / bs + 1].iter().map(|b| b.0 as i32));
            for (i, &t) in s.tokens.iter().enumerate() {
                let pos = s.start_pos + i;
                p.tokens.push(t);
                p.positions.push(pos as i32);
                let block = s.block_table[pos / bs].0 as usize;
                p.slots.push(((block * bs + pos % bs) * row) as i64);
                p.table_start.push(start);
            }
            if s.all_logits {
                let n = p.tokens.len();
                p.logit_rows.extend(n - s.tokens.len()..n);
            } else if s.want_logits {
                p.logit_rows.push(p.tokens.len() - 1);
            }
        }
        p
    }

    /// Tokens in the step.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// No tokens.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kv_cache::KvCache;
    use crate::runtime::ids::BlockId;

    #[test]
    fn flattens_a_mixed_batch_like_the_cpu_pass() {
        let kv = KvCache::new(1, 2, 4, 8, 4);
        let t0 = [BlockId(5), BlockId(2)];
        let t1 = [BlockId(7), BlockId(1), BlockId(3)];
        let seqs = [
            // prefill chunk of 3 at positions 2..5 (crosses into the second block)
            ForwardSeq {
                tokens: &[10, 11, 12],
                start_pos: 2,
                block_table: &t0,
                want_logits: false,
                all_logits: false,
            },
            // one decode token at position 8 (third block)
            ForwardSeq {
                tokens: &[20],
                start_pos: 8,
                block_table: &t1,
                want_logits: true,
                all_logits: false,
            },
        ];
        let p = StepPlan::new(kv.block_size, 2 * 4, &seqs);
        assert_eq!(p.tokens, [10, 11, 12, 20]);
        assert_eq!(p.positions, [2, 3, 4, 8]);
        let row = 2 * 4; // n_kv_heads · head_dim
        let slot = |b: u32, s: usize| kv.slot_offset(BlockId(b), s) as i64;
        assert_eq!(slot(1, 1), ((4 + 1) * row) as i64);
        assert_eq!(p.slots, [slot(5, 2), slot(5, 3), slot(2, 0), slot(3, 0)]);
        assert_eq!(p.block_tables, [5, 2, 7, 1, 3]);
        assert_eq!(p.table_start, [0, 0, 0, 2]);
        assert_eq!(p.logit_rows, [3]);
    }

    #[test]
    fn a_sequence_that_wants_every_row_lists_them_in_order() {
        let t = [BlockId(1), BlockId(2)];
        let seqs = [
            ForwardSeq {
                tokens: &[1],
                start_pos: 4,
                block_table: &t,
                want_logits: true,
                all_logits: false,
            },
            ForwardSeq {
                tokens: &[5, 6, 7],
                start_pos: 0,
                block_table: &t,
                want_logits: false,
                all_logits: true,
            },
        ];
        let p = StepPlan::new(4, 2, &seqs);
        assert_eq!(p.logit_rows, [0, 1, 2, 3]);
    }

    #[test]
    fn only_the_blocks_in_use_are_listed() {
        let kv = KvCache::new(1, 1, 2, 8, 4);
        let t = [BlockId(1), BlockId(2), BlockId(3)];
        let s = [ForwardSeq {
            tokens: &[1],
            start_pos: 3,
            block_table: &t,
            want_logits: true,
            all_logits: false,
        }];
        let p = StepPlan::new(kv.block_size, 2, &s);
        assert_eq!(p.block_tables, [1]);
        assert_eq!(p.logit_rows, [0]);
    }
}
