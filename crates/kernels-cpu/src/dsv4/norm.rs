//! RMSNorm to bf16 values with or without a weight (`docs/dsv4.md`, "RMSNorm"):
//! `bf16(x / sqrt(mean x² + eps) · w)`, `w = 1` for the weightless per-head norm. The result
//! stays in fp32 slots (bf16-representable values) because every consumer in the layer (RoPE,
//! int8 quantisation, packing for the bf16 GEMM) reads fp32; [`crate::rms_norm_bf16`] is the
//! weighted form that stores bf16.

use crate::convert::f32_to_bf16;
use crate::multiversion::multiversion;

/// `1/sqrt(mean(x²) + eps)` with the mean taken in f64 (four lanes) and rounded to f32 once:
/// every value of the row is rounded to bf16 right after, and the error of an fp32 mean over
/// thousands of values (~1e-7) is enough to flip some of those roundings.
#[inline(always)]
pub(crate) fn inv_rms_f64(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f64; 4];
    let c = x.chunks_exact(4);
    let tail: f64 = c
        .remainder()
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    for v in c {
        for i in 0..4 {
            acc[i] += f64::from(v[i]) * f64::from(v[i]);
        }
    }
    let ms = (((acc[0] + acc[2]) + (acc[1] + acc[3]) + tail) / x.len() as f64) as f32;
    1.0 / (ms + eps).sqrt()
}

multiversion! {
    /// RMSNorm in place over rows of `row` values: `x = bf16(x · r · w)` with
    /// `r = 1/sqrt(mean(x²) + eps)` per row (the mean in f64, see [`inv_rms_f64`]); `w = None`
    /// is the weightless norm.
    ///
    /// # Panics
    /// If `row` is zero or does not divide `x.len()`, or `w` is not `row` long.
    pub fn rms_norm_round(x: &mut [f32], row: usize, w: Option<&[f32]>, eps: f32) {
        assert!(row > 0 && x.len().is_multiple_of(row), "rms_norm_round: x len {} for rows of {row}", x.len());
        if let Some(w) = w {
            assert_eq!(w.len(), row, "rms_norm_round: weight len");
        }
        for xr in x.chunks_exact_mut(row) {
            let r = inv_rms_f64(xr, eps);
            match w {
                Some(w) => {
                    for (v, &g) in xr.iter_mut().zip(w) {
                        *v = f32_to_bf16(*v * r * g).to_f32();
                    }
                }
                None => {
                    for v in xr.iter_mut() {
                        *v = f32_to_bf16(*v * r).to_f32();
                    }
                }
            }
        }
    }
}

multiversion! {
    /// Rounds every value to bf16 (nearest even) in place, keeping fp32 slots.
    pub fn round_bf16(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = f32_to_bf16(*v).to_f32();
        }
    }
}
