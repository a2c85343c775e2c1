//! The FMA-bound path for larger batches: each group of weight rows is widened once per
//! k-chunk into an L1-resident fp32 scratch (already in the packed order), then a register
//! micro-kernel runs every batch row against it: two weight vectors feed `2 * BB` FMAs per
//! activation load pair, so loads stay well under the FMA rate.

use std::arch::x86_64::*;

use super::super::{Lowered, edge_sum, finish};
use crate::simd::hsum256;

/// Weight rows per group.
const RW: usize = 3;
/// Batch rows per micro-kernel pass.
const BW: usize = 4;
/// k-chunk widened at a time (multiple of 16).
const KC: usize = 256;
/// Rows ahead (same columns) the weight prefetch reaches: the next group's rows, about one
/// group's compute time ahead.
const PF_AHEAD: usize = RW;
/// Batch rows whose accumulators stay resident across k-chunks.
const BMAX: usize = 48;

#[repr(align(4096))]
struct Scratch([[f32; KC]; RW]);

/// Computes whole `RW`-row groups of the tile from `lw.n.start`; returns the first row not
/// done (the caller finishes the remaining `< RW` rows).
///
/// # Safety
/// AVX2 and FMA available; `lw` checked by `gemm_dispatch`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm_wide(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) -> usize {
    let ldw = lw.ldw;
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let mut scratch = Scratch([[0.0; KC]; RW]);
    let mut accm = [[_mm256_setzero_ps(); BMAX]; RW];
    // Batch blocks outermost: one block's activations (`BMAX` rows) stay in L2 while every
    // weight row group streams past them; a prefill's many rows then re-stream the weights
    // once per block (cheap: each weight feeds `BMAX` rows) instead of re-reading every
    // activation row from L3 for each row group.
    let groups_end = lw.n.start + (lw.n.end - lw.n.start) / RW * RW;
    let mut bo = 0;
    while bo < lw.batch {
        let bend = (bo + BMAX).min(lw.batch);
        let mut n0 = lw.n.start;
        while n0 < groups_end {
            for row in accm.iter_mut() {
                row[..bend - bo].fill(_mm256_setzero_ps());
            }
            let mut c0 = lw.kb0;
            while c0 < lw.kb1 {
                let clen = KC.min(lw.kb1 - c0);
                for (r, srow) in scratch.0.iter_mut().enumerate() {
                    let wrow = lw.w[(n0 + r) * ldw + c0..(n0 + r) * ldw + c0 + clen].as_ptr();
                    let mut j = 0;
                    while j < clen {
                        // SAFETY: j + 16 <= clen (clen is a multiple of 16), inside the row
                        // slice just taken; the scratch row holds KC >= clen floats.
                        unsafe {
                            if j % 32 == 0 {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    wrow.wrapping_add(j + PF_AHEAD * ldw).cast::<i8>(),
                                );
                            }
                            let raw = _mm256_loadu_si256(wrow.add(j).cast::<__m256i>());
                            let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
                            let wo = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                            _mm256_store_ps(srow.as_mut_ptr().add(j), we);
                            _mm256_store_ps(srow.as_mut_ptr().add(j + 8), wo);
                        }
                        j += 16;
                    }
                }
                let mut b0 = bo;
                while b0 < bend {
                    let bb = BW.min(bend - b0);
                    // SAFETY: batch rows b0..b0+bb < batch; chunk [c0, c0+clen) inside the body.
                    unsafe { micro_dyn(lw, &scratch, &mut accm, c0, clen, b0, bo, bb) };
                    b0 += bb;
                }
                c0 += clen;
            }
            for (r, row) in accm.iter().enumerate() {
                let live = &row[..bend - bo];
                let mut i = 0;
                // Eight batch rows' sums at once: a horizontal sum each costs about as much
                // as a short K chunk's FMAs.
                while i + 8 <= live.len() {
                    let mut sums = [0.0f32; 8];
                    // SAFETY: `sums` holds eight floats; AVX2 is enabled here.
                    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), hsum8(&live[i..i + 8])) };
                    for (j, &sum) in sums.iter().enumerate() {
                        let sum = sum + edge_sum(lw, n0 + r, bo + i + j);
                        finish(lw, out, ld_out, n0 + r, bo + i + j, sum);
                    }
                    i += 8;
                }
                for (j, &v) in live[i..].iter().enumerate() {
                    let sum = hsum256(v) + edge_sum(lw, n0 + r, bo + i + j);
                    finish(lw, out, ld_out, n0 + r, bo + i + j, sum);
                }
            }
            n0 += RW;
        }
        bo = bend;
    }
    groups_end
}

/// Dispatches a runtime batch-block width to [`micro`].
///
/// # Safety
/// As [`micro`].
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_dyn(
    lw: &Lowered<'_>,
    s: &Scratch,
    accm: &mut [[__m256; BMAX]; RW],
    c0: usize,
    clen: usize,
    b0: usize,
    bo: usize,
    bb: usize,
) {
    macro_rules! go {
        ($($b:literal)*) => {
            match bb {
                // SAFETY: forwarded contract.
                $($b => unsafe { micro::<$b>(lw, s, accm, c0, clen, b0, bo) },)*
                _ => unreachable!("micro width {bb}"),
            }
        };
    }
    go!(1 2 3 4);
}

/// `RW` widened rows × `BB` batch rows over one k-chunk, accumulating into `accm`.
///
/// # Safety
/// AVX2 and FMA available; `b0 + BB <= lw.batch`, `b0 - bo + BB <= BMAX`;
/// `[c0, c0 + clen)` inside the body `[kb0, kb1)`; `clen <= KC`, a multiple of 8.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn micro<const BB: usize>(
    lw: &Lowered<'_>,
    s: &Scratch,
    accm: &mut [[__m256; BMAX]; RW],
    c0: usize,
    clen: usize,
    b0: usize,
    bo: usize,
) {
    let xrow: [*const f32; BB] = std::array::from_fn(|b| {
        lw.x[(b0 + b) * lw.ldx + c0..(b0 + b) * lw.ldx + c0 + clen].as_ptr()
    });
    let mut acc: [[__m256; BB]; RW] =
        std::array::from_fn(|r| std::array::from_fn(|b| accm[r][b0 - bo + b]));
    let mut j = 0;
    while j < clen {
        // SAFETY: j + 8 <= clen <= KC: inside every scratch row and each activation chunk.
        unsafe {
            let wv: [__m256; RW] = std::array::from_fn(|r| _mm256_load_ps(s.0[r].as_ptr().add(j)));
            for b in 0..BB {
                let xv = _mm256_loadu_ps(xrow[b].add(j));
                for r in 0..RW {
                    acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
                }
            }
        }
        j += 8;
    }
    for r in 0..RW {
        for b in 0..BB {
            accm[r][b0 - bo + b] = acc[r][b];
        }
    }
}

/// The lane sums of eight vectors, as one vector (`[sum v[0], .., sum v[7]]`).
///
/// # Panics
/// If `v.len() != 8`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum8(v: &[__m256]) -> __m256 {
    assert_eq!(v.len(), 8);
    let t0 = _mm256_hadd_ps(v[0], v[1]);
    let t1 = _mm256_hadd_ps(v[2], v[3]);
    let t2 = _mm256_hadd_ps(v[4], v[5]);
    let t3 = _mm256_hadd_ps(v[6], v[7]);
    // Lanes: u0 = [v0 v1 v2 v3 (low halves) | v0 v1 v2 v3 (high halves)], u1 likewise.
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
    let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
    _mm256_add_ps(lo, hi)
}
