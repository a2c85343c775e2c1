//! RMSNorm to bf16 values with or without a weight (`docs/dsv4.md`, "RMSNorm"):
//! `bf16(x / sqrt(mean x² + eps) · w)`, `w = 1` for the weightless per-head norm. The result
//! stays in fp32 slots (bf16-representable values) because every consumer in the layer (RoPE,
//! int8 quantisation, packing for the bf16 GEMM) reads fp32; [`crate::rms_norm_bf16`] is the
//! weighted form that stores bf16, and [`norm_rope_heads_bf16`] the queries' weightless norm,
//! RoPE and rounding stored as bf16.

use half::bf16;

use crate::convert::{f32_to_bf16, round_bf16_f32};
use crate::multiversion::multiversion;

/// `1/sqrt(mean(x²) + eps)` with the mean taken in f64 (four lanes) and rounded to f32 once:
/// every value of the row is rounded to bf16 right after, and the error of an fp32 mean over
/// thousands of values (~1e-7) is enough to flip some of those roundings.
#[inline(always)]
pub(crate) fn inv_rms_f64(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f64; 4];
    let c = x.chunks_exact(4);
    let tail = c.remainder();
    for v in c {
        for i in 0..4 {
            acc[i] += f64::from(v[i]) * f64::from(v[i]);
        }
    }
    inv_rms_finish(&acc, tail, x.len(), eps)
}

/// Rows per block of [`inv_rms_rows_f64`]: eight chains of fused multiply-adds in flight
/// cover the latency of each (four left half the two units' slots idle).
const RMS_ROWS: usize = 8;

/// [`inv_rms_f64`] of each of the `out.len()` rows of `x` (`row` values each), bit for bit:
/// rows are taken [`RMS_ROWS`] at a time with their lanes interleaved (on AVX2 one register
/// per row), so the rows' independent chains of adds overlap where one row's chain of
/// `row / 4` adds would wait on each add's latency.
///
/// # Panics
/// If `x` is not `out.len()` rows of `row`.
#[inline(always)]
pub(crate) fn inv_rms_rows_f64(x: &[f32], row: usize, eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), out.len() * row, "inv_rms_rows_f64: x len");
    let body = row / 4 * 4;
    let mut r0 = 0;
    while r0 + RMS_ROWS <= out.len() {
        let xs: [&[f32]; RMS_ROWS] =
            std::array::from_fn(|i| &x[(r0 + i) * row..(r0 + i + 1) * row]);
        #[cfg(target_arch = "x86_64")]
        let acc = if crate::isa::Isa::current() >= crate::isa::Isa::Avx2 {
            // SAFETY: `Isa::current` is Avx2 or wider only on a CPU with AVX2 and FMA.
            unsafe { sums_avx2(xs, body) }
        } else {
            sums(xs, body)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let acc = sums(xs, body);
        for (i, (a, xr)) in acc.iter().zip(&xs).enumerate() {
            out[r0 + i] = inv_rms_finish(a, &xr[body..], row, eps);
        }
        r0 += RMS_ROWS;
    }
    for (r, o) in out.iter_mut().enumerate().skip(r0) {
        *o = inv_rms_f64(&x[r * row..(r + 1) * row], eps);
    }
}

/// The four lane sums of squares of each row over `body` values (a multiple of 4), in order.
#[inline(always)]
fn sums(xs: [&[f32]; RMS_ROWS], body: usize) -> [[f64; 4]; RMS_ROWS] {
    let mut acc = [[0.0f64; 4]; RMS_ROWS];
    for (a, xr) in acc.iter_mut().zip(&xs) {
        for v in xr[..body].chunks_exact(4) {
            for i in 0..4 {
                a[i] += f64::from(v[i]) * f64::from(v[i]);
            }
        }
    }
    acc
}

/// [`sums`] with the rows interleaved, one 256-bit register of four lanes per row: a fused
/// multiply-add of an exact f64 square (a product of two f32 fits in f64) gives the bits of
/// the multiply then add.
///
/// # Safety
/// The CPU has AVX2 and FMA.
///
/// # Panics
/// If a row is shorter than `body`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sums_avx2(xs: [&[f32]; RMS_ROWS], body: usize) -> [[f64; 4]; RMS_ROWS] {
    use std::arch::x86_64::*;
    assert!(xs.iter().all(|r| r.len() >= body) && body.is_multiple_of(4));
    let mut acc = [_mm256_setzero_pd(); RMS_ROWS];
    for c in (0..body).step_by(4) {
        for (a, xr) in acc.iter_mut().zip(&xs) {
            // SAFETY: `c + 4 <= body <= xr.len()`.
            let v = _mm256_cvtps_pd(unsafe { _mm_loadu_ps(xr.as_ptr().add(c)) });
            *a = _mm256_fmadd_pd(v, v, *a);
        }
    }
    acc.map(|a| {
        let mut out = [0.0f64; 4];
        // SAFETY: `out` holds four f64.
        unsafe { _mm256_storeu_pd(out.as_mut_ptr(), a) };
        out
    })
}

/// The end of [`inv_rms_f64`]: its four lanes combined, the tail added in order, the mean over
/// `len` values rounded to f32, then `1/sqrt(mean + eps)`.
#[inline(always)]
fn inv_rms_finish(acc: &[f64; 4], tail: &[f32], len: usize, eps: f32) -> f32 {
    let tail: f64 = tail.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let ms = (((acc[0] + acc[2]) + (acc[1] + acc[3]) + tail) / len as f64) as f32;
    1.0 / (ms + eps).sqrt()
}

multiversion! {
    avx512;
    /// RMSNorm in place over rows of `row` values: `x = bf16(x · r · w)` with
    /// `r = 1/sqrt(mean(x²) + eps)` per row (the mean in f64); `w = None`
    /// is the weightless norm.
    ///
    /// # Panics
    /// If `row` is zero or does not divide `x.len()`, or `w` is not `row` long.
    pub fn rms_norm_round(x: &mut [f32], row: usize, w: Option<&[f32]>, eps: f32) {
        assert!(row > 0 && x.len().is_multiple_of(row), "rms_norm_round: x len {} for rows of {row}", x.len());
        if let Some(w) = w {
            assert_eq!(w.len(), row, "rms_norm_round: weight len");
        }
        // The factors of a block of rows first (their sums overlap), then the rows scaled.
        let mut inv = [0.0f32; RMS_ROWS];
        for xb in x.chunks_mut(RMS_ROWS * row) {
            let rows = xb.len() / row;
            inv_rms_rows_f64(xb, row, eps, &mut inv[..rows]);
            for (xr, &r) in xb.chunks_exact_mut(row).zip(&inv) {
                match w {
                    Some(w) => {
                        for (v, &g) in xr.iter_mut().zip(w) {
                            *v = round_bf16_f32(*v * r * g);
                        }
                    }
                    None => {
                        for v in xr.iter_mut() {
                            *v = round_bf16_f32(*v * r);
                        }
                    }
                }
            }
        }
    }
}

multiversion! {
    avx512;
    /// Rounds every value to bf16 (nearest even) in place, keeping fp32 slots.
    pub fn round_bf16(x: &mut [f32]) {
        for v in x.iter_mut() {
            *v = round_bf16_f32(*v);
        }
    }
}

/// `1/sqrt(mean(x²) + eps)` of each of the `out.len()` rows of `x` (`row` values each), the
/// factor [`rms_norm_round`] scales each row by, bit for bit (the mean in f64).
///
/// # Panics
/// If `x` is not `out.len()` rows of `row`.
pub fn rms_inv_rows(x: &[f32], row: usize, eps: f32, out: &mut [f32]) {
    inv_rms_rows_f64(x, row, eps, out)
}

multiversion! {
    avx512;
    /// The queries' finish in one pass, stored as bf16: every `head`-long head `i` of `x`
    /// scaled by `inv[i]` (its [`rms_inv_rows`] factor) to bf16 values, as the weightless
    /// [`rms_norm_round`] makes them, then the last `2 · cos.len()` values turned forward by
    /// interleaved RoPE ([`rope_interleaved`](super::rope_interleaved)) and rounded again,
    /// written to `out`. Bit for bit those passes and the narrowing: the values before the
    /// rotated part are bf16 after the norm, so their second rounding changes nothing and is
    /// not made, and the rotation's products and sums are the same expressions in the same
    /// order.
    ///
    /// One pass over `x` and one write of half its bytes, where the passes took ~2.6 cycles
    /// a value in the FLASH step's `q_b` tasks (a norm pass, a rounding pass and a copy into
    /// the step's fp32 queries, whose lines came from memory) (`docs/benchmarks.md`,
    /// session 34).
    ///
    /// # Panics
    /// If `head` is zero or does not divide `x.len()`, `inv` is not one per head, `out` is
    /// not `x.len()` long, `cos` and `sin` differ in length, or the rotated part is longer
    /// than a head.
    pub fn norm_rope_heads_bf16(x: &[f32], head: usize, inv: &[f32], cos: &[f32], sin: &[f32], out: &mut [bf16]) {
        let pairs = cos.len();
        assert_eq!(sin.len(), pairs, "norm_rope_heads_bf16: sin len");
        assert!(head > 0 && 2 * pairs <= head && x.len().is_multiple_of(head), "norm_rope_heads_bf16: head {head}, {pairs} pairs, x len {}", x.len());
        assert_eq!(inv.len() * head, x.len(), "norm_rope_heads_bf16: inv len");
        assert_eq!(out.len(), x.len(), "norm_rope_heads_bf16: out len");
        let plain = head - 2 * pairs;
        for ((xr, or), &r) in x.chunks_exact(head).zip(out.chunks_exact_mut(head)).zip(inv) {
            for (o, &v) in or[..plain].iter_mut().zip(&xr[..plain]) {
                *o = f32_to_bf16(v * r);
            }
            let (xr, or) = (&xr[plain..], &mut or[plain..]);
            for j in 0..pairs {
                let e = round_bf16_f32(xr[2 * j] * r);
                let o = round_bf16_f32(xr[2 * j + 1] * r);
                let (c, s) = (cos[j], sin[j]);
                or[2 * j] = f32_to_bf16(e * c - o * s);
                or[2 * j + 1] = f32_to_bf16(e * s + o * c);
            }
        }
    }
}
