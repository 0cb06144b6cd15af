//! RMSNorm (Zhang & Sennrich 2019), as in Llama: `y = x / sqrt(mean(x²) + eps) · w`.

use rayon::prelude::*;

/// `out[i, :] = x[i, :] / sqrt(mean(x[i, :]²) + eps) · w` for `x`, `out`: `[n, d]` f32 and
/// `w`: `[d]` f32 (`d = w.len()`); the mean is accumulated in f64.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert_eq!(x.len(), out.len(), "rms_norm: x/out length mismatch");
    let row = |(xr, or): (&[f32], &mut [f32])| {
        let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let inv = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    };
    if x.len() >= 64 * d {
        x.par_chunks(d).zip(out.par_chunks_mut(d)).for_each(row);
    } else {
        x.chunks(d).zip(out.chunks_mut(d)).for_each(row);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn unit_rms() {
        let x = [3.0f32, -4.0];
        let mut y = [0.0; 2];
        super::rms_norm(&x, &[1.0, 2.0], 0.0, &mut y);
        let r = (12.5f32).sqrt();
        assert!((y[0] - 3.0 / r).abs() < 1e-6 && (y[1] + 8.0 / r).abs() < 1e-6);
    }
}
