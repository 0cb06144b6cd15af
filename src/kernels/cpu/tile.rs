//! The register tile of the quantised matrix products, shared by the driver (`matmul.rs`) and
//! its SIMD kernels (`simd.rs`, `simd_avx2.rs`), which are written for exactly this shape.

/// Rows of `W` handled per register tile.
pub const R: usize = 4;
/// Activation rows handled per register tile.
pub const C: usize = 4;
