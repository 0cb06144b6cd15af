//! Elementwise activations: SwiGLU (Shazeer 2020) and softmax.

/// `gate[i] = silu(gate[i]) · up[i]` with `silu(g) = g / (1 + e^-g)`; both `[n, ffn]` f32.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// In-place numerically stable softmax over `x` (f32).
pub fn softmax(x: &mut [f32]) {
    let mx = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - mx).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0f32, 2.0, 3.0, 1000.0];
        super::softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6 && x[3] > 0.99);
    }
}
