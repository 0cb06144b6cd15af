//! Weight matrices as they live in memory: f32, or ggml quantised blocks kept quantised
//! (decode is memory-bound, so reading 20 bytes per 32 weights instead of 128 is the speed).
//!
//! Block layouts follow ggml (`ggml-common.h`):
//! - Q8_0: 32 values in 34 bytes: f16 scale `d`, 32 × i8 `q`; `x = d·q`.
//! - Q4_1: 32 values in 20 bytes: f16 `d`, f16 `m`, 16 bytes of nibbles; low nibbles are values
//!   0..15, high nibbles values 16..31; `x = d·q + m`.

use half::f16;

/// One Q8_0 block (32 weights).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}

/// One Q4_1 block (32 weights).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}

/// Elements per quantisation block (ggml `QK8_0` / `QK4_1`).
pub const QK: usize = 32;

/// Storage of a row-major weight matrix `W[rows][cols]` (`rows` = output features).
#[derive(Clone, Debug)]
pub enum MatrixData {
    /// `rows * cols` f32 values.
    F32(Vec<f32>),
    /// `rows * cols / 32` blocks; each row is `cols / 32` consecutive blocks.
    Q8_0(Vec<BlockQ8_0>),
    /// `rows * cols / 32` blocks; each row is `cols / 32` consecutive blocks.
    Q4_1(Vec<BlockQ4_1>),
}

/// A weight matrix `W[rows][cols]`: `y = x·Wᵀ` maps `[m, cols]` to `[m, rows]`.
#[derive(Clone, Debug)]
pub struct WeightMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatrixData,
}

impl WeightMatrix {
    /// Bytes of weight data read by one full pass over the matrix.
    pub fn bytes(&self) -> usize {
        match &self.data {
            MatrixData::F32(v) => v.len() * 4,
            MatrixData::Q8_0(v) => v.len() * 34,
            MatrixData::Q4_1(v) => v.len() * 20,
        }
    }

    /// Writes row `r` (length `cols`) dequantised into `out`.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.data {
            MatrixData::F32(v) => out.copy_from_slice(&v[r * c..(r + 1) * c]),
            MatrixData::Q8_0(b) => {
                let nb = c / QK;
                for (blk, o) in b[r * nb..(r + 1) * nb].iter().zip(out.chunks_exact_mut(QK)) {
                    dequant_q8_0(blk, o);
                }
            }
            MatrixData::Q4_1(b) => {
                let nb = c / QK;
                for (blk, o) in b[r * nb..(r + 1) * nb].iter().zip(out.chunks_exact_mut(QK)) {
                    dequant_q4_1(blk, o);
                }
            }
        }
    }

    /// Dequantises rows `r0..r0 + n` into `out` (`[n, cols]` f32).
    pub fn dequant_rows(&self, r0: usize, n: usize, out: &mut [f32]) {
        for (i, o) in out.chunks_exact_mut(self.cols).take(n).enumerate() {
            self.dequant_row(r0 + i, o);
        }
    }

    /// The whole matrix as f32 `[rows, cols]`.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.rows * self.cols];
        self.dequant_rows(0, self.rows, &mut v);
        v
    }
}

/// Dequantises one Q8_0 block into `out[0..32]`.
#[inline]
pub fn dequant_q8_0(b: &BlockQ8_0, out: &mut [f32]) {
    let d = b.d.to_f32();
    for (o, &q) in out.iter_mut().zip(b.qs.iter()) {
        *o = d * f32::from(q);
    }
}

/// Dequantises one Q4_1 block into `out[0..32]`.
#[inline]
pub fn dequant_q4_1(b: &BlockQ4_1, out: &mut [f32]) {
    let d = b.d.to_f32();
    let m = b.m.to_f32();
    for (j, &q) in b.qs.iter().enumerate() {
        out[j] = d * f32::from(q & 0x0f) + m;
        out[j + 16] = d * f32::from(q >> 4) + m;
    }
}

/// Parses little-endian Q8_0 blocks from raw bytes (length must be a multiple of 34).
pub fn parse_q8_0(bytes: &[u8]) -> Vec<BlockQ8_0> {
    bytes
        .chunks_exact(34)
        .map(|c| {
            let mut qs = [0i8; 32];
            for (q, &b) in qs.iter_mut().zip(&c[2..]) {
                *q = b as i8;
            }
            BlockQ8_0 {
                d: f16::from_le_bytes([c[0], c[1]]),
                qs,
            }
        })
        .collect()
}

/// Parses little-endian Q4_1 blocks from raw bytes (length must be a multiple of 20).
pub fn parse_q4_1(bytes: &[u8]) -> Vec<BlockQ4_1> {
    bytes
        .chunks_exact(20)
        .map(|c| {
            let mut qs = [0u8; 16];
            qs.copy_from_slice(&c[4..20]);
            BlockQ4_1 {
                d: f16::from_le_bytes([c[0], c[1]]),
                m: f16::from_le_bytes([c[2], c[3]]),
                qs,
            }
        })
        .collect()
}

/// Quantises f32 values to Q8_0 blocks (round to nearest, `d = max|x| / 127`), as ggml does.
/// Used by tests and tools; `x.len()` must be a multiple of 32.
pub fn quantize_q8_0(x: &[f32]) -> Vec<BlockQ8_0> {
    x.chunks_exact(QK)
        .map(|c| {
            let amax = c.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut qs = [0i8; 32];
            for (q, &v) in qs.iter_mut().zip(c) {
                *q = (v * id).round() as i8;
            }
            BlockQ8_0 {
                d: f16::from_f32(d),
                qs,
            }
        })
        .collect()
}

/// Quantises f32 values to Q4_1 blocks (`d = (max-min)/15`, `m = min`), as ggml does.
pub fn quantize_q4_1(x: &[f32]) -> Vec<BlockQ4_1> {
    x.chunks_exact(QK)
        .map(|c| {
            let mn = c.iter().fold(f32::INFINITY, |a, &v| a.min(v));
            let mx = c.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            let d = (mx - mn) / 15.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut qs = [0u8; 16];
            for j in 0..16 {
                let lo = ((c[j] - mn) * id).round().clamp(0.0, 15.0) as u8;
                let hi = ((c[j + 16] - mn) * id).round().clamp(0.0, 15.0) as u8;
                qs[j] = lo | (hi << 4);
            }
            BlockQ4_1 {
                d: f16::from_f32(d),
                m: f16::from_f32(mn),
                qs,
            }
        })
        .collect()
}
