//! NeoX "half split" rotary embedding from cos/sin tables `[max_seq, head_dim]` whose two halves
//! repeat: for a head `t = [lo, hi]`, `t' = [lo*cos - hi*sin, hi*cos + lo*sin]`.

use half::bf16;

use crate::convert::cast_f32_bf16;
use crate::multiversion::multiversion;
use crate::norm::head_rms_norm_f32;

multiversion! {
    /// Rotates every `cos.len()`-long head of `x` in place with one position's table rows.
    ///
    /// # Panics
    /// If `cos`/`sin` differ in length, the head size is odd, or `x.len()` is not a multiple.
    pub fn rope_neox_f32(x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let d = cos.len();
        assert_eq!(sin.len(), d, "rope_neox_f32: sin len");
        assert!(d.is_multiple_of(2) && d > 0 && x.len().is_multiple_of(d), "rope_neox_f32: head size {d}, x len {}", x.len());
        let half = d / 2;
        for head in x.chunks_exact_mut(d) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (l, h) = (lo[i], hi[i]);
                lo[i] = l * cos[i] - h * sin[i];
                hi[i] = h * cos[half + i] + l * sin[half + i];
            }
        }
    }
}

/// The decode/prefill q/k epilogue for one token: per-head RMSNorm (`w`, `eps`), RoPE with the
/// position's table rows, then `out = bf16(x)`. `x` is used as scratch.
///
/// # Panics
/// As [`head_rms_norm_f32`] and [`rope_neox_f32`], and if `out.len() != x.len()`.
pub fn qk_norm_rope_bf16(
    x: &mut [f32],
    w: &[f32],
    eps: f32,
    cos: &[f32],
    sin: &[f32],
    out: &mut [bf16],
) {
    assert_eq!(out.len(), x.len(), "qk_norm_rope_bf16: out len");
    head_rms_norm_f32(x, w, eps);
    rope_neox_f32(x, cos, sin);
    // The vector narrowing (same bits as `f32_to_bf16`): a scalar loop here was about half
    // of a decode row's q/k epilogue.
    cast_f32_bf16(x, out);
}
