//! Rotary position embeddings (Su et al. 2021) in both weight layouts.
//!
//! - [`RopeLayout::Interleaved`]: rotates adjacent pairs `(x[2i], x[2i+1])`; GGUF Llama files
//!   (the converter permutes the rows of `attn_q`/`attn_k` so this is the right rotation).
//! - [`RopeLayout::HalfSplit`]: rotates `(x[i], x[i + d/2])`; Hugging Face checkpoints (and GGUF
//!   `qwen2`, which llama.cpp runs in NeoX mode).
//!
//! `inv_freq[i] = base^(-2i/d)`, angle `= pos · inv_freq[i]` (computed in f64).

/// Which pairs of a head vector are rotated together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    Interleaved,
    HalfSplit,
}

/// Precomputed inverse frequencies for one head size.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
    layout: RopeLayout,
    head_dim: usize,
}

impl Rope {
    /// `rot_dim` leading dimensions of each head are rotated (`rot_dim <= head_dim`, even).
    pub fn new(head_dim: usize, rot_dim: usize, base: f64, layout: RopeLayout) -> Self {
        let inv_freq = (0..rot_dim / 2)
            .map(|i| base.powf(-2.0 * i as f64 / rot_dim as f64))
            .collect();
        Self {
            inv_freq,
            layout,
            head_dim,
        }
    }

    /// `inv_freq[i]` for the rotated pairs (`rot_dim / 2` of them); the CUDA kernel reads these.
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// Which elements form the rotated pairs.
    pub fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// Rotates every head of `x` (`[n_heads, head_dim]` f32, one token) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        let mut cs = [(0f32, 0f32); 256];
        for (i, f) in self.inv_freq.iter().enumerate().take(256) {
            let a = pos as f64 * f;
            cs[i] = (a.cos() as f32, a.sin() as f32);
        }
        for h in x.chunks_exact_mut(self.head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate().take(half) {
                let (a, b) = match self.layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::HalfSplit => (i, i + half),
                };
                let (x0, x1) = (h[a], h[b]);
                h[a] = x0 * c - x1 * s;
                h[b] = x0 * s + x1 * c;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_agree_under_permutation() {
        let d = 8;
        let x: Vec<f32> = (0..d).map(|i| i as f32 + 1.0).collect();
        // interleaved position 2i+j  <->  half-split position j*d/2 + i
        let perm = |v: &[f32]| -> Vec<f32> {
            let mut o = vec![0.0; d];
            for i in 0..d / 2 {
                for j in 0..2 {
                    o[j * d / 2 + i] = v[2 * i + j];
                }
            }
            o
        };
        let mut a = x.clone();
        Rope::new(d, d, 10000.0, RopeLayout::Interleaved).apply(&mut a, 5);
        let mut b = perm(&x);
        Rope::new(d, d, 10000.0, RopeLayout::HalfSplit).apply(&mut b, 5);
        for (p, q) in perm(&a).iter().zip(&b) {
            assert!((p - q).abs() < 1e-5);
        }
    }
}
