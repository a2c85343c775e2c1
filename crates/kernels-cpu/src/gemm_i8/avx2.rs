//! 256-bit int8 paths: AVX2 `vpmaddubsw` (sign trick, no offset), AVX-VNNI `vpdpbusd` (weights
//! offset by +128, removed with the activation rows' sums), and the wide product (int8 widened to fp32,
//! FMA). Each computes blocks of `R` weight rows × up to `B` batch rows with every
//! accumulator in a register; the activation rows of a block stay in L1 while the weight
//! rows stream.

use std::arch::x86_64::*;

use super::{Lowered, LoweredWide, WithActSums};
use crate::simd::hsum256;
use crate::simd::prefetch_l2;

/// Weight rows per block.
const R: usize = 4;
/// Most batch rows per block (`R * B` accumulators plus the loads fit 16 registers).
const B: usize = 2;
/// Bytes of `k` per step.
const STEP: usize = 32;

/// Sum of the eight i32 lanes (wrapping, like the lanes).
#[target_feature(enable = "avx2")]
#[inline]
fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Pointers to `k.start` of weight rows `n0..n0 + RR` and batch rows `b0..b0 + BB`.
#[inline(always)]
fn starts<const RR: usize, const BB: usize>(
    w: &[i8],
    ldw: usize,
    a: &[i8],
    lda: usize,
    k0: usize,
    n0: usize,
    b0: usize,
) -> ([*const i8; RR], [*const i8; BB]) {
    (
        std::array::from_fn(|r| w[(n0 + r) * ldw + k0..].as_ptr()),
        std::array::from_fn(|b| a[(b0 + b) * lda + k0..].as_ptr()),
    )
}

/// W8A8 with `vpmaddubsw` over a tile's `k` segments.
///
/// # Safety
/// AVX2 available; `segs` (at least one) checked by `gemm_i8_w8a8`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    drive!(segs, out, ld_out, R, B, STEP, block_maddubs, 0i32);
}

/// `sums[r][b]` = the body of rows `n0 + r` × batch rows `b0 + b` (`r < RR`, `b < BB`).
///
/// # Safety
/// AVX2 available; the rows lie inside the tile of a checked `lw`.
#[target_feature(enable = "avx2,fma")]
unsafe fn block_maddubs<const RR: usize, const BB: usize>(
    lw: &Lowered<'_>,
    n0: usize,
    b0: usize,
    sums: &mut [[i32; B]; R],
) {
    let steps = lw.k.len() / STEP;
    let (wp, ap) = starts::<RR, BB>(lw.w, lw.wa.ldw, lw.a, lw.lda, lw.k.start, n0, b0);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_si256(); BB]; RR];
    for s in 0..steps {
        // SAFETY: `s * STEP + STEP <= k.len()`, and each row holds `k.end - k.start` values
        // from its start pointer (rows lie inside their slices: checked by the caller).
        let a: [__m256i; BB] =
            std::array::from_fn(|b| unsafe { _mm256_loadu_si256(ap[b].add(s * STEP).cast()) });
        for r in 0..RR {
            // The same row of the next block, one block ahead (see `PREFETCH`).
            prefetch_l2(wp[r].wrapping_add(RR * lw.wa.ldw + s * STEP));
            // SAFETY: as above.
            let w = unsafe { _mm256_loadu_si256(wp[r].add(s * STEP).cast()) };
            let w_abs = _mm256_sign_epi8(w, w);
            for b in 0..BB {
                // |w| * sign(a, w) = w * a, pairs at most 2 * 128 * 127 in i16 (a != -128).
                let p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a[b], w));
                acc[r][b] = _mm256_add_epi32(acc[r][b], _mm256_madd_epi16(p, ones));
            }
        }
    }
    for r in 0..RR {
        for b in 0..BB {
            sums[r][b] = hsum_epi32(acc[r][b]);
        }
    }
}

/// Weight rows per AVX-VNNI block: 8 accumulators, 2 offset weight vectors, an activation
/// vector and the offset constant stay well inside the 16 registers (3 rows, 12
/// accumulators, measured ~15% slower at batch 8: the block no longer fits without spills);
/// the decode batch of 8 takes two passes over rows held in L1.
const R_VNNI: usize = 2;
/// Most batch rows per AVX-VNNI block.
const B_VNNI: usize = 4;

/// W8A8 with 256-bit `vpdpbusd` (AVX-VNNI) over a tile's `k` segments.
///
/// # Safety
/// AVX2 and AVX-VNNI available; `segs` (at least one) checked by `gemm_i8_w8a8`.
#[target_feature(enable = "avx2,fma,avxvnni")]
pub(super) unsafe fn gemm_vnni(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    let lo: Vec<WithActSums<'_, '_>> = segs.iter().map(|s| WithActSums::new(s, STEP)).collect();
    drive!(&lo, out, ld_out, R_VNNI, B_VNNI, STEP, block_vnni, 0i32);
}

/// `sums[r][b]` as [`block_maddubs`], with `vpdpbusd` of `w + 128` against the activations
/// and the offset (`128 ·` the activation row's sum) removed.
///
/// # Safety
/// AVX2 and AVX-VNNI available; the rows lie inside the tile of a checked `lw`.
#[target_feature(enable = "avx2,fma,avxvnni")]
unsafe fn block_vnni<const RR: usize, const BB: usize>(
    lo: &WithActSums<'_, '_>,
    n0: usize,
    b0: usize,
    sums: &mut [[i32; B_VNNI]; R_VNNI],
) {
    let lw = lo.lw;
    let steps = lw.k.len() / STEP;
    let (wp, ap) = starts::<RR, BB>(lw.w, lw.wa.ldw, lw.a, lw.lda, lw.k.start, n0, b0);
    let flip = _mm256_set1_epi8(i8::MIN);
    let mut acc = [[_mm256_setzero_si256(); BB]; RR];
    for s in 0..steps {
        let w: [__m256i; RR] = std::array::from_fn(|r| {
            // The same row of the next block, one block ahead (module docs of `gemm_i8`).
            prefetch_l2(wp[r].wrapping_add(RR * lw.wa.ldw + s * STEP));
            // SAFETY: as in `block_maddubs`.
            _mm256_xor_si256(
                unsafe { _mm256_loadu_si256(wp[r].add(s * STEP).cast()) },
                flip,
            )
        });
        for b in 0..BB {
            // SAFETY: as in `block_maddubs`.
            let a = unsafe { _mm256_loadu_si256(ap[b].add(s * STEP).cast()) };
            for r in 0..RR {
                acc[r][b] = _mm256_dpbusd_avx_epi32(acc[r][b], w[r], a);
            }
        }
    }
    for r in 0..RR {
        for b in 0..BB {
            sums[r][b] = hsum_epi32(acc[r][b]).wrapping_sub(lo.offset(b0 + b));
        }
    }
}

/// Wide product: int8 widened to fp32 (`vpmovsxbd`, `vcvtdq2ps`), FMA against fp32 rows.
///
/// # Safety
/// AVX2 and FMA available; `lw` checked by `gemm_i8_wide`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm_wide(lw: &LoweredWide<'_>, out: &mut [f32], ld_out: usize) {
    drive!(
        std::slice::from_ref(lw),
        out,
        ld_out,
        R,
        B,
        8,
        block_wide,
        0.0f32
    );
}

/// `sums[r][b]` of the body in steps of 8.
///
/// # Safety
/// AVX2 and FMA available; the rows lie inside the tile of a checked `lw`.
#[target_feature(enable = "avx2,fma")]
unsafe fn block_wide<const RR: usize, const BB: usize>(
    lw: &LoweredWide<'_>,
    n0: usize,
    b0: usize,
    sums: &mut [[f32; B]; R],
) {
    let steps = lw.k.len() / 8;
    let k0 = lw.k.start;
    let wp: [*const i8; RR] = std::array::from_fn(|r| lw.w[(n0 + r) * lw.ldw + k0..].as_ptr());
    let xp: [*const f32; BB] = std::array::from_fn(|b| lw.x[(b0 + b) * lw.ldx + k0..].as_ptr());
    let mut acc = [[_mm256_setzero_ps(); BB]; RR];
    for s in 0..steps {
        // SAFETY: `s * 8 + 8 <= k.len()` values lie after each start pointer.
        let x: [__m256; BB] = std::array::from_fn(|b| unsafe { _mm256_loadu_ps(xp[b].add(s * 8)) });
        for r in 0..RR {
            if s % 8 == 0 {
                // As in the W8A8 blocks: the next block's rows, a cache line per 64 bytes.
                prefetch_l2(wp[r].wrapping_add(RR * lw.ldw + s * 8));
            }
            // SAFETY: as above (8 bytes of the weight row).
            let w8 = unsafe { _mm_loadl_epi64(wp[r].add(s * 8).cast()) };
            let wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8));
            for b in 0..BB {
                acc[r][b] = _mm256_fmadd_ps(wf, x[b], acc[r][b]);
            }
        }
    }
    for r in 0..RR {
        for b in 0..BB {
            sums[r][b] = hsum256(acc[r][b]);
        }
    }
}
