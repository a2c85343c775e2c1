//! RMSNorm in the forms the Qwen3 step uses: deferred-inverse (`r = 1/sqrt(mean(x²)+eps)` per
//! row, `n = bf16(x*g)`, the `r` applied after the projection), ordinary (`bf16(x*r*g)`), and
//! per-head q/k norm (fp32 in place).

use half::bf16;

use crate::convert::{f32_to_bf16, round_bf16_f32};
use crate::gemm::{PACK_BLOCK, pack_index, packed_ld};
use crate::multiversion::multiversion;

/// `1/sqrt(mean(x²) + eps)`, summed in eight fp32 lanes.
#[inline(always)]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] += c[i] * c[i];
        }
    }
    let mut tail = 0.0f32;
    for &v in chunks.remainder() {
        tail += v * v;
    }
    let sum =
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
    1.0 / (sum / x.len() as f32 + eps).sqrt()
}

multiversion! {
    /// Deferred-inverse RMSNorm over rows of `g.len()`: `r[row] = 1/sqrt(mean(x²)+eps)` and
    /// `out = bf16(x * g)` (the caller multiplies projection outputs by `r`).
    ///
    /// # Panics
    /// If `x` and `out` are not `r.len() * g.len()` long.
    pub fn rms_norm_deferred_bf16(x: &[f32], g: &[f32], eps: f32, out: &mut [bf16], r: &mut [f32]) {
        let h = g.len();
        assert_eq!(x.len(), r.len() * h, "rms_norm_deferred_bf16: x len");
        assert_eq!(out.len(), x.len(), "rms_norm_deferred_bf16: out len");
        for ((xr, or), rr) in x.chunks_exact(h.max(1)).zip(out.chunks_exact_mut(h.max(1))).zip(r.iter_mut()) {
            *rr = inv_rms(xr, eps);
            for ((o, &v), &gw) in or.iter_mut().zip(xr).zip(g) {
                *o = f32_to_bf16(v * gw);
            }
        }
    }
}

multiversion! {
    /// [`rms_norm_deferred_bf16`] writing `n = bf16(x * g)` straight into packed GEMM
    /// activations (`crate::gemm` layout, [`crate::packed_len`]`(rows, g.len())` floats).
    ///
    /// # Panics
    /// If `x` is not `r.len() * g.len()` long or `packed` not `packed_len(r.len(), g.len())`.
    pub fn rms_norm_deferred_packed(x: &[f32], g: &[f32], eps: f32, packed: &mut [f32], r: &mut [f32]) {
        let h = g.len();
        let ld = packed_ld(h);
        assert_eq!(x.len(), r.len() * h, "rms_norm_deferred_packed: x len");
        assert_eq!(packed.len(), r.len() * ld, "rms_norm_deferred_packed: packed len");
        let full = h / PACK_BLOCK * PACK_BLOCK;
        for ((xr, pr), rr) in x.chunks_exact(h.max(1)).zip(packed.chunks_exact_mut(ld)).zip(r.iter_mut()) {
            *rr = inv_rms(xr, eps);
            for (blk, (xb, gb)) in xr[..full].chunks_exact(PACK_BLOCK).zip(g[..full].chunks_exact(PACK_BLOCK)).enumerate() {
                let pb = &mut pr[blk * PACK_BLOCK..(blk + 1) * PACK_BLOCK];
                for i in 0..PACK_BLOCK / 2 {
                    pb[i] = round_bf16_f32(xb[2 * i] * gb[2 * i]);
                    pb[PACK_BLOCK / 2 + i] = round_bf16_f32(xb[2 * i + 1] * gb[2 * i + 1]);
                }
            }
            for k in full..h {
                pr[pack_index(k, h)] = round_bf16_f32(xr[k] * g[k]);
            }
            pr[h..].fill(0.0);
        }
    }
}

multiversion! {
    /// Ordinary RMSNorm written straight into packed GEMM activations: `bf16(x * r * g)` per
    /// element (the prefill and final-norm form), in the `crate::gemm` packed layout
    /// ([`crate::packed_len`]`(rows, g.len())` floats; padding zeroed).
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of `g.len()` or `packed` is not `packed_len(rows, g.len())`.
    pub fn rms_norm_packed(x: &[f32], g: &[f32], eps: f32, packed: &mut [f32]) {
        let h = g.len().max(1);
        let ld = packed_ld(g.len());
        assert_eq!(x.len() % h, 0, "rms_norm_packed: x len");
        assert_eq!(packed.len(), x.len() / h * ld, "rms_norm_packed: packed len");
        let full = g.len() / PACK_BLOCK * PACK_BLOCK;
        for (xr, pr) in x.chunks_exact(h).zip(packed.chunks_exact_mut(ld)) {
            let r = inv_rms(xr, eps);
            for (blk, (xb, gb)) in xr[..full].chunks_exact(PACK_BLOCK).zip(g[..full].chunks_exact(PACK_BLOCK)).enumerate() {
                let pb = &mut pr[blk * PACK_BLOCK..(blk + 1) * PACK_BLOCK];
                for i in 0..PACK_BLOCK / 2 {
                    pb[i] = round_bf16_f32(xb[2 * i] * r * gb[2 * i]);
                    pb[PACK_BLOCK / 2 + i] = round_bf16_f32(xb[2 * i + 1] * r * gb[2 * i + 1]);
                }
            }
            for k in full..g.len() {
                pr[pack_index(k, g.len())] = round_bf16_f32(xr[k] * r * g[k]);
            }
            pr[g.len()..].fill(0.0);
        }
    }
}

multiversion! {
    /// Ordinary RMSNorm over rows of `g.len()`: `out = bf16(x * r * g)`.
    ///
    /// # Panics
    /// If `out.len() != x.len()` or `x.len()` is not a multiple of `g.len()`.
    pub fn rms_norm_bf16(x: &[f32], g: &[f32], eps: f32, out: &mut [bf16]) {
        let h = g.len().max(1);
        assert_eq!(x.len() % h, 0, "rms_norm_bf16: x len");
        assert_eq!(out.len(), x.len(), "rms_norm_bf16: out len");
        for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            let r = inv_rms(xr, eps);
            for ((o, &v), &gw) in or.iter_mut().zip(xr).zip(g) {
                *o = f32_to_bf16(v * r * gw);
            }
        }
    }
}

multiversion! {
    /// Per-head RMSNorm in place: each `w.len()`-long head `h` of `x` becomes
    /// `h / sqrt(mean(h²) + eps) * w` (fp32).
    ///
    /// # Panics
    /// If `x.len()` is not a multiple of `w.len()`.
    pub fn head_rms_norm_f32(x: &mut [f32], w: &[f32], eps: f32) {
        let d = w.len().max(1);
        assert_eq!(x.len() % d, 0, "head_rms_norm_f32: x len");
        for head in x.chunks_exact_mut(d) {
            let r = inv_rms(head, eps);
            for (v, &wv) in head.iter_mut().zip(w) {
                *v = *v * r * wv;
            }
        }
    }
}
