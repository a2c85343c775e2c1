//! AVX2+FMA GEMM path: bf16 widened in registers by an even/odd split (shift left 16 / mask
//! the high half) against packed activations, `R` weight rows × `BB` batch rows per pass (rows
//! `ROW_STRIDE` apart when bandwidth-bound),
//! software prefetch that runs ahead of each row stream and on into the next row group.

use std::arch::x86_64::*;

use super::{Lowered, edge_sum, finish};
use crate::simd::hsum256;

mod wide;

/// Prefetch distance along a row, in bf16 elements (512 B).
const PF_ELEMS: usize = 256;

/// Rows between the concurrent row streams of a bandwidth-bound pass.
const ROW_STRIDE: usize = 4;
/// Smallest batch taken by the widened-scratch path.
const WIDE_MIN_BATCH: usize = 8;

/// Rows and batch rows per pass for a batch of `batch` rows.
fn plan(batch: usize) -> (usize, usize) {
    match batch {
        1 => (4, 1),
        2 => (4, 2),
        3 => (4, 3),
        _ => (4, 2),
    }
}

/// Computes the tile described by `lw` into `out`.
///
/// # Safety
/// The CPU must support AVX2 and FMA, and `lw` must describe a tile inside its matrices with
/// `out` long enough (as checked by `gemm_dispatch`).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) {
    let mut n0 = lw.n.start;
    if lw.batch >= WIDE_MIN_BATCH {
        // SAFETY: forwarded contract.
        n0 = unsafe { wide::gemm_wide(lw, out, ld_out) };
    }
    let (r_main, bb_main) = plan(lw.batch);
    // Bandwidth-bound batches: the R concurrent row streams of a pass are ROW_STRIDE rows
    // apart (passes over n0 + h + ROW_STRIDE * r for h in 0..ROW_STRIDE cover
    // ROW_STRIDE * R consecutive rows); streams of adjacent rows ran ~25% slower on two cores
    // of the development machine (`06-performance.md`: streams ~4 KB apart).
    let rs = ROW_STRIDE;
    if lw.batch < WIDE_MIN_BATCH {
        while n0 + rs * r_main <= lw.n.end {
            for h in 0..rs {
                let next = if h + 1 < rs {
                    1
                } else {
                    rs * r_main - (rs - 1)
                };
                let mut b0 = 0;
                while b0 < lw.batch {
                    let bb = bb_main.min(lw.batch - b0);
                    // SAFETY: rows n0 + h + rs * r (r < R) lie inside the tile (loop
                    // bound), and the caller's contract covers the rest.
                    unsafe { block_dyn(lw, n0 + h, r_main, b0, bb, out, ld_out, rs, next) };
                    b0 += bb;
                }
            }
            n0 += rs * r_main;
        }
    }
    while n0 < lw.n.end {
        let r = r_main.min(lw.n.end - n0);
        let mut b0 = 0;
        while b0 < lw.batch {
            let bb = bb_main.min(lw.batch - b0);
            // SAFETY: rows n0..n0+r and batch rows b0..b0+bb lie inside the tile (loop
            // bounds), and the caller's contract covers the rest.
            unsafe { block_dyn(lw, n0, r, b0, bb, out, ld_out, 1, r) };
            b0 += bb;
        }
        n0 += r;
    }
}

/// Dispatches runtime `(r, bb)` to a const instantiation of [`block`].
///
/// # Safety
/// As [`block`].
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_dyn(
    lw: &Lowered<'_>,
    n0: usize,
    r: usize,
    b0: usize,
    bb: usize,
    out: &mut [f32],
    ld_out: usize,
    rstride: usize,
    next: usize,
) {
    macro_rules! go {
        ($($r:literal, $b:literal);*) => {
            match (r, bb) {
                $(($r, $b) => {
                    // SAFETY: forwarded contract.
                    unsafe { block::<$r, $b>(lw, n0, b0, out, ld_out, rstride, next) }
                })*
                _ => unreachable!("block shape {r}x{bb}"),
            }
        };
    }
    go!(1,1; 1,2; 1,3; 1,4; 2,1; 2,2; 2,3; 2,4; 3,1; 3,2; 3,3; 3,4; 4,1; 4,2; 4,3; 4,4);
}

/// `R` weight rows `n0 + rstride * r` against `BB` batch rows from `b0`, over the whole k
/// range; prefetches that run past a row's end continue `next` rows on (the same stream of
/// the next pass).
///
/// # Safety
/// AVX2 and FMA available; `n0 + rstride * (R - 1) < lw.n.end`, `b0 + BB <= lw.batch`; `lw`
/// checked by `gemm_dispatch` (so every row read in `[kb0, kb1)` is inside `lw.w` / `lw.x`).
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn block<const R: usize, const BB: usize>(
    lw: &Lowered<'_>,
    n0: usize,
    b0: usize,
    out: &mut [f32],
    ld_out: usize,
    rstride: usize,
    next: usize,
) {
    let ldw = lw.ldw;
    let klen = lw.kb1 - lw.kb0;
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let wrow: [*const u16; R] =
        std::array::from_fn(|r| lw.w[(n0 + r * rstride) * ldw + lw.kb0..].as_ptr());
    let xrow: [*const f32; BB] =
        std::array::from_fn(|b| lw.x[(b0 + b) * lw.ldx + lw.kb0..].as_ptr());
    // Prefetches past a row's end land in the same stream of the next pass, `next` rows on.
    let pf_wrap = (next * ldw).wrapping_sub(klen);
    let mut acc = [[_mm256_setzero_ps(); BB]; R];
    let mut acc_odd = [[_mm256_setzero_ps(); BB]; R];

    let step = |acc: &mut [[__m256; BB]; R], acc_odd: &mut [[__m256; BB]; R], kk: usize| {
        for r in 0..R {
            // SAFETY: kk + 16 <= klen, so the 16 elements at wrow[r] + kk are inside row
            // n0 + r's body range [kb0, kb1).
            let raw = unsafe { _mm256_loadu_si256(wrow[r].add(kk).cast::<__m256i>()) };
            let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
            let wo = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
            for b in 0..BB {
                // SAFETY: the same 16 packed activations of batch row b0 + b are inside `lw.x`.
                let (xe, xo) = unsafe {
                    (
                        _mm256_loadu_ps(xrow[b].add(kk)),
                        _mm256_loadu_ps(xrow[b].add(kk + 8)),
                    )
                };
                acc[r][b] = _mm256_fmadd_ps(we, xe, acc[r][b]);
                if BB == 1 {
                    acc_odd[r][b] = _mm256_fmadd_ps(wo, xo, acc_odd[r][b]);
                } else {
                    acc[r][b] = _mm256_fmadd_ps(wo, xo, acc[r][b]);
                }
            }
        }
    };

    let mut kk = 0;
    while kk + 32 <= klen {
        for p in wrow {
            let off = kk + PF_ELEMS;
            let off = if off < klen {
                off
            } else {
                off.wrapping_add(pf_wrap)
            };
            // Prefetch never faults, and `wrapping_add` keeps the address computation defined
            // even when it points past the matrix.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off).cast::<i8>());
        }
        step(&mut acc, &mut acc_odd, kk);
        step(&mut acc, &mut acc_odd, kk + 16);
        kk += 32;
    }
    if kk + 16 <= klen {
        step(&mut acc, &mut acc_odd, kk);
    }
    for r in 0..R {
        for b in 0..BB {
            let body = if BB == 1 {
                _mm256_add_ps(acc[r][b], acc_odd[r][b])
            } else {
                acc[r][b]
            };
            let sum = hsum256(body) + edge_sum(lw, n0 + r * rstride, b0 + b);
            finish(lw, out, ld_out, n0 + r * rstride, b0 + b, sum);
        }
    }
}
