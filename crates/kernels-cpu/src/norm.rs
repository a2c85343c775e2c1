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

/// [`rms_norm_deferred_bf16`] writing `n = bf16(x * g)` straight into packed GEMM
/// activations (`crate::gemm` layout, [`crate::packed_len`]`(rows, g.len())` floats).
///
/// A decode step runs this between a layer's projections, every core waiting on it: as
/// plain loops (the packing's even/odd split kept them scalar) 16 rows of 1024 took ~9–12 µs
/// on Zen 4, now 3.5–3.8 µs (`pack_row`, `inv_rms_rows`).
///
/// # Panics
/// If `x` is not `r.len() * g.len()` long or `packed` not `packed_len(r.len(), g.len())`.
pub fn rms_norm_deferred_packed(x: &[f32], g: &[f32], eps: f32, packed: &mut [f32], r: &mut [f32]) {
    let h = g.len();
    let ld = packed_ld(h);
    assert_eq!(x.len(), r.len() * h, "rms_norm_deferred_packed: x len");
    assert_eq!(
        packed.len(),
        r.len() * ld,
        "rms_norm_deferred_packed: packed len"
    );
    inv_rms_rows(x, h, eps, r);
    for (xr, pr) in x.chunks_exact(h.max(1)).zip(packed.chunks_exact_mut(ld)) {
        pack_row(xr, g, None, pr);
    }
}

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
    assert_eq!(
        packed.len(),
        x.len() / h * ld,
        "rms_norm_packed: packed len"
    );
    // Rows in groups, so the scales' buffer stays on the stack.
    const GROUP: usize = 16;
    let mut r = [0.0f32; GROUP];
    for (xs, ps) in x.chunks(GROUP * h).zip(packed.chunks_mut(GROUP * ld)) {
        let n = xs.len() / h;
        if g.is_empty() {
            ps.fill(0.0);
            continue;
        }
        inv_rms_rows(xs, h, eps, &mut r[..n]);
        for ((xr, pr), &s) in xs.chunks_exact(h).zip(ps.chunks_exact_mut(ld)).zip(&r[..n]) {
            pack_row(xr, g, Some(s), pr);
        }
    }
}

/// `r[row] = inv_rms(x's row)` for the rows of `h` in `x`, four rows at a time: each row's
/// sum keeps [`inv_rms`]'s eight lanes and order (the same bits), and the four rows' sums are
/// independent chains, so the adds do not wait on each other. (As a plain loop over four rows
/// the compiler split the lanes into 128-bit halves and shuffles, at half the speed.)
fn inv_rms_rows(x: &[f32], h: usize, eps: f32, r: &mut [f32]) {
    if h == 0 {
        // No rows to norm (`x` is empty): the scales are left as they are, as before.
        return;
    }
    let mut rows = x.chunks_exact(h);
    let mut out = r.chunks_exact_mut(4);
    let full = h / 8 * 8;
    for o in &mut out {
        let xs: [&[f32]; 4] = std::array::from_fn(|_| rows.next().unwrap_or(&[]));
        let mut acc = [[0.0f32; 8]; 4];
        #[cfg(target_arch = "x86_64")]
        let done = if crate::isa::Isa::current() >= crate::isa::Isa::Avx2 {
            // SAFETY: `Isa::current` is Avx2 or wider only on a CPU with AVX2.
            unsafe { x86::sum_squares4_avx2(xs, full, &mut acc) };
            true
        } else {
            false
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = false;
        if !done {
            for (a, xr) in acc.iter_mut().zip(&xs) {
                for c in xr[..full].chunks_exact(8) {
                    for i in 0..8 {
                        a[i] += c[i] * c[i];
                    }
                }
            }
        }
        for ((o, a), xr) in o.iter_mut().zip(&acc).zip(&xs) {
            *o = finish_rms(a, &xr[full..], h, eps);
        }
    }
    for (o, xr) in out.into_remainder().iter_mut().zip(rows) {
        *o = inv_rms(xr, eps);
    }
}

/// [`inv_rms`]'s last steps from its eight lane sums and the elements past them.
#[inline(always)]
fn finish_rms(acc: &[f32; 8], rest: &[f32], len: usize, eps: f32) -> f32 {
    let mut tail = 0.0f32;
    for &v in rest {
        tail += v * v;
    }
    let sum =
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
    1.0 / (sum / len as f32 + eps).sqrt()
}

/// One row's packed activations: `bf16(x * s * g)` with a scale, `bf16(x * g)` without, its
/// whole 16-blocks as even then odd elements (`crate::gemm` layout), the rest in order, the
/// padding zeroed.
fn pack_row(xr: &[f32], g: &[f32], s: Option<f32>, pr: &mut [f32]) {
    let h = g.len();
    let full = h / PACK_BLOCK * PACK_BLOCK;
    let (xb, gb, pb) = (&xr[..full], &g[..full], &mut pr[..full]);
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Isa;
        let isa = Isa::current();
        if isa >= Isa::Avx512Bf16 {
            // SAFETY: `Isa::current` is Avx512Bf16 or wider only on a CPU with AVX-512 F.
            unsafe { x86::pack_blocks_avx512(xb, gb, s, pb) };
        } else if isa >= Isa::Avx2 {
            // SAFETY: `Isa::current` is Avx2 or wider only on a CPU with AVX2.
            unsafe { x86::pack_blocks_avx2(xb, gb, s, pb) };
        } else {
            pack_blocks(xb, gb, s, pb);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    pack_blocks(xb, gb, s, pb);
    let scaled = |k: usize| match s {
        Some(s) => xr[k] * s * g[k],
        None => xr[k] * g[k],
    };
    for k in full..h {
        pr[pack_index(k, h)] = round_bf16_f32(scaled(k));
    }
    pr[h..].fill(0.0);
}

/// The portable form of [`pack_row`]'s whole blocks (`x`, `g`, `out` of equal lengths, a
/// multiple of 16).
fn pack_blocks(x: &[f32], g: &[f32], s: Option<f32>, out: &mut [f32]) {
    for ((xb, gb), pb) in x
        .chunks_exact(PACK_BLOCK)
        .zip(g.chunks_exact(PACK_BLOCK))
        .zip(out.chunks_exact_mut(PACK_BLOCK))
    {
        for i in 0..PACK_BLOCK {
            let v = match s {
                Some(s) => xb[i] * s * gb[i],
                None => xb[i] * gb[i],
            };
            pb[pack_index(i, PACK_BLOCK)] = round_bf16_f32(v);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::PACK_BLOCK;

    /// `(v + 0x7fff + lsb) & !0xffff` per lane (ties to even), a NaN made quiet instead: the
    /// bits of [`crate::convert::round_bf16_f32`].
    #[target_feature(enable = "avx512f")]
    fn round_bf16_512(v: __m512) -> __m512i {
        let bits = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
        let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
        _mm512_and_si512(r, _mm512_set1_epi32(0xffff_0000_u32 as i32))
    }

    /// [`super::pack_blocks`] with one 16-lane vector a block: the products, rounded, then
    /// the even lanes before the odd ones (`vpermps`).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_blocks_avx512(x: &[f32], g: &[f32], s: Option<f32>, out: &mut [f32]) {
        assert!(x.len() == g.len() && x.len() == out.len() && x.len().is_multiple_of(PACK_BLOCK));
        let idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        for b in (0..x.len()).step_by(PACK_BLOCK) {
            // SAFETY: `b + 16 <= len` for all three slices (asserted above); unaligned loads
            // and stores.
            unsafe {
                let mut v = _mm512_loadu_ps(x.as_ptr().add(b));
                if let Some(s) = s {
                    v = _mm512_mul_ps(v, _mm512_set1_ps(s));
                }
                v = _mm512_mul_ps(v, _mm512_loadu_ps(g.as_ptr().add(b)));
                let r = _mm512_castsi512_ps(round_bf16_512(v));
                _mm512_storeu_ps(out.as_mut_ptr().add(b), _mm512_permutexvar_ps(idx, r));
            }
        }
    }

    /// The eight lane sums of squares of four rows' first `full` elements (a multiple of 8),
    /// lane `i` of row `r` summing elements `i`, `8 + i`, .. in order, each square rounded
    /// before its add (no fused multiply-add), as the portable loop does.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_squares4_avx2(xs: [&[f32]; 4], full: usize, acc: &mut [[f32; 8]; 4]) {
        assert!(full.is_multiple_of(8) && xs.iter().all(|x| x.len() >= full));
        let mut a = [_mm256_setzero_ps(); 4];
        for k in (0..full).step_by(8) {
            for (a, x) in a.iter_mut().zip(&xs) {
                // SAFETY: `k + 8 <= full <= x.len()` (asserted above); unaligned loads.
                let c = unsafe { _mm256_loadu_ps(x.as_ptr().add(k)) };
                *a = _mm256_add_ps(*a, _mm256_mul_ps(c, c));
            }
        }
        for (dst, v) in acc.iter_mut().zip(a) {
            // SAFETY: `dst` is eight floats; unaligned store.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) };
        }
    }

    /// [`round_bf16_512`] on eight lanes.
    #[target_feature(enable = "avx2")]
    fn round_bf16_256(v: __m256) -> __m256 {
        let bits = _mm256_castps_si256(v);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
        let quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x0040_0000));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
        let r = _mm256_blendv_ps(
            _mm256_castsi256_ps(rounded),
            _mm256_castsi256_ps(quiet),
            nan,
        );
        _mm256_and_ps(
            r,
            _mm256_castsi256_ps(_mm256_set1_epi32(0xffff_0000_u32 as i32)),
        )
    }

    /// [`super::pack_blocks`] on two 8-lane halves a block: the products, rounded, then the
    /// even and the odd lanes gathered across the halves (`shufps`, then the 64-bit lanes put
    /// in order).
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn pack_blocks_avx2(x: &[f32], g: &[f32], s: Option<f32>, out: &mut [f32]) {
        assert!(x.len() == g.len() && x.len() == out.len() && x.len().is_multiple_of(PACK_BLOCK));
        for b in (0..x.len()).step_by(PACK_BLOCK) {
            // SAFETY: `b + 16 <= len` for all three slices (asserted above); unaligned loads
            // and stores.
            unsafe {
                let (px, pg, po) = (
                    x.as_ptr().add(b),
                    g.as_ptr().add(b),
                    out.as_mut_ptr().add(b),
                );
                let (mut lo, mut hi) = (_mm256_loadu_ps(px), _mm256_loadu_ps(px.add(8)));
                if let Some(s) = s {
                    let s = _mm256_set1_ps(s);
                    (lo, hi) = (_mm256_mul_ps(lo, s), _mm256_mul_ps(hi, s));
                }
                let lo = round_bf16_256(_mm256_mul_ps(lo, _mm256_loadu_ps(pg)));
                let hi = round_bf16_256(_mm256_mul_ps(hi, _mm256_loadu_ps(pg.add(8))));
                // Per 128-bit lane: lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6, then 64-bit lanes 0 2 1 3.
                let even = _mm256_shuffle_ps::<0b10_00_10_00>(lo, hi);
                let odd = _mm256_shuffle_ps::<0b11_01_11_01>(lo, hi);
                let order = |v: __m256| {
                    _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)))
                };
                _mm256_storeu_ps(po, order(even));
                _mm256_storeu_ps(po.add(8), order(odd));
            }
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
