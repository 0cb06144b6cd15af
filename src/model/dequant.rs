//! Load-time dequantisation of ggml block types the kernels do not run natively
//! (Q4_0, Q5_0, Q5_1, Q4_K, Q6_K): such tensors are expanded to f32 once, at load. Correct
//! but 4–8× larger in memory than the file; Q8_0 and Q4_1 stay quantised.
//!
//! Formulas follow ggml's reference `dequantize_row_*` (`ggml-quants.c`).

use half::f16;

use crate::model::gguf::GgmlType;

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantises `bytes` of type `dtype`; `None` if the type is not handled here. `bytes` must
/// hold whole blocks (the GGUF parser checked the length).
pub fn dequantize(dtype: GgmlType, bytes: &[u8]) -> Option<Vec<f32>> {
    let (be, bb) = dtype.block_layout();
    let mut out = vec![0f32; bytes.len() / bb * be];
    let blocks = bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be));
    match dtype {
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| {
            let d = h(b, 0);
            for j in 0..16 {
                y[j] = (f32::from(b[2 + j] & 0x0f) - 8.0) * d;
                y[j + 16] = (f32::from(b[2 + j] >> 4) - 8.0) * d;
            }
        }),
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let q51 = dtype == GgmlType::Q5_1;
            blocks.for_each(|(b, y)| {
                let d = h(b, 0);
                let (m, o) = if q51 { (h(b, 2), 4) } else { (0.0, 2) };
                let qh = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
                let qs = &b[o + 4..o + 20];
                let off = if q51 { 0.0 } else { 16.0 };
                for j in 0..16 {
                    let xh0 = ((qh >> j) << 4) & 0x10;
                    let xh1 = (qh >> (j + 12)) & 0x10;
                    let x0 = (u32::from(qs[j] & 0x0f) | xh0) as f32 - off;
                    let x1 = (u32::from(qs[j] >> 4) | xh1) as f32 - off;
                    y[j] = x0 * d + m;
                    y[j + 16] = x1 * d + m;
                }
            })
        }
        GgmlType::Q4K => blocks.for_each(|(b, y)| {
            // d, dmin, scales[12], qs[128]
            let (d, dmin) = (h(b, 0), h(b, 2));
            let sc = &b[4..16];
            let qs = &b[16..144];
            let scale_min = |j: usize| -> (f32, f32) {
                if j < 4 {
                    (f32::from(sc[j] & 63), f32::from(sc[j + 4] & 63))
                } else {
                    (
                        f32::from((sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4)),
                        f32::from((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)),
                    )
                }
            };
            for c in 0..4 {
                let (s1, m1) = scale_min(2 * c);
                let (s2, m2) = scale_min(2 * c + 1);
                let q = &qs[32 * c..32 * c + 32];
                for l in 0..32 {
                    y[64 * c + l] = d * s1 * f32::from(q[l] & 0x0f) - dmin * m1;
                    y[64 * c + 32 + l] = d * s2 * f32::from(q[l] >> 4) - dmin * m2;
                }
            }
        }),
        GgmlType::Q6K => blocks.for_each(|(b, y)| {
            // ql[128], qh[64], scales[16] (i8), d
            let d = h(b, 208);
            for half in 0..2 {
                let ql = &b[64 * half..64 * half + 64];
                let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                let sc = &b[192 + 8 * half..192 + 8 * half + 8];
                let yy = &mut y[128 * half..128 * half + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
                    let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    let s = |k: usize| d * f32::from(sc[is + k] as i8);
                    yy[l] = s(0) * q1 as f32;
                    yy[l + 32] = s(2) * q2 as f32;
                    yy[l + 64] = s(4) * q3 as f32;
                    yy[l + 96] = s(6) * q4 as f32;
                }
            }
        }),
        _ => return None,
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn q4_0_and_q5_blocks() {
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16b(0.5));
        b[2] = 0x9f; // low nibble 15 -> (15-8)*0.5, high nibble 9 -> (9-8)*0.5
        let y = dequantize(GgmlType::Q4_0, &b).expect("q4_0");
        assert_eq!((y[0], y[16], y[1]), (3.5, 0.5, -4.0));
        // Q5_1: d = 1, m = -1, qh bit 0 set -> value 0 gets +16
        let mut b = vec![0u8; 24];
        b[..2].copy_from_slice(&f16b(1.0));
        b[2..4].copy_from_slice(&f16b(-1.0));
        b[4] = 1;
        b[8] = 0x23;
        let y = dequantize(GgmlType::Q5_1, &b).expect("q5_1");
        assert_eq!((y[0], y[16], y[1]), (3.0 + 16.0 - 1.0, 2.0 - 1.0, -1.0));
    }

    #[test]
    fn q4_k_block() {
        let mut b = vec![0u8; 144];
        b[..2].copy_from_slice(&f16b(2.0)); // d
        b[2..4].copy_from_slice(&f16b(1.0)); // dmin
        b[4] = 3; // scale of sub-block 0
        b[8] = 5; // min of sub-block 0
        b[5] = 1; // scale of sub-block 1 (min 0)
        b[16] = 0x74; // q[0]: low 4 (sub-block 0), high 7 (sub-block 1)
        let y = dequantize(GgmlType::Q4K, &b).expect("q4k");
        assert_eq!(y[0], 2.0 * 3.0 * 4.0 - 5.0);
        assert_eq!(y[32], 2.0 * 1.0 * 7.0);
        assert_eq!(y.len(), 256);
    }

    #[test]
    fn q6_k_block() {
        let mut b = vec![0u8; 210];
        b[208..210].copy_from_slice(&f16b(0.5));
        b[192] = 2; // scale for elements 0..16
        b[194] = 0xfe; // scale -2 for elements 32..48
        b[0] = 0x01; // ql[0] low -> element 0
        b[128] = 0x03; // qh[0] bits 0..1 -> element 0 gets +48
        b[32] = 0x0f; // ql[32] low -> element 32
        let y = dequantize(GgmlType::Q6K, &b).expect("q6k");
        assert_eq!(y[0], 0.5 * 2.0 * (1 + 48 - 32) as f32);
        assert_eq!(y[32], 0.5 * -2.0 * (15 - 32) as f32);
        assert_eq!(y[1], 0.5 * 2.0 * -32.0);
    }
}
