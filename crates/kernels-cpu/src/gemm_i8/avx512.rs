//! 512-bit int8 paths: AVX-512 VNNI `vpdpbusd` (weights offset by +128, removed with the
//! activation rows' sums taken once per call) and the wide product in 512-bit registers.
//! Blocks of weight rows × batch rows, every accumulator in one of the 32 registers.

use std::arch::x86_64::*;

use super::{Lowered, LoweredWide, WithActSums};
use crate::simd::prefetch_l2;

/// Weight rows per W8A8 block: 24 accumulators at 8 batch rows (more independent
/// `vpdpbusd` chains than the instruction's latency needs), 3 offset weight vectors and the
/// offset constant within 32 registers; each activation vector is used three times.
const R: usize = 3;
/// Most batch rows per W8A8 block: the decode batch of 8 in one pass over the weights.
const B: usize = 8;
/// Weight rows and batch rows per wide block.
const R_WIDE: usize = 4;
const B_WIDE: usize = 4;
/// Bytes of `k` per step.
const STEP: usize = 64;

/// W8A8 with 512-bit `vpdpbusd` over a tile's `k` segments.
///
/// # Safety
/// AVX-512 F/BW/VNNI available; `segs` (at least one) checked by `gemm_i8_w8a8`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn gemm(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    let lo: Vec<WithActSums<'_, '_>> = segs.iter().map(|s| WithActSums::new(s, STEP)).collect();
    drive!(&lo, out, ld_out, R, B, STEP, block_vnni, 0i32);
}

/// `sums[r][b]` = the body of rows `n0 + r` × batch rows `b0 + b`: `sum (w + 128) a` minus
/// `128 sum a`, wrapping in i32 (the true value is in range, so the wrap cancels).
///
/// # Safety
/// AVX-512 F/BW/VNNI available; the rows lie inside the tile of a checked `lw`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
unsafe fn block_vnni<const RR: usize, const BB: usize>(
    lo: &WithActSums<'_, '_>,
    n0: usize,
    b0: usize,
    sums: &mut [[i32; B]; R],
) {
    let lw = lo.lw;
    let steps = lw.k.len() / STEP;
    let k0 = lw.k.start;
    // Row-major: each row's steps follow one another; packed: a row's 64-byte chunks lie a
    // block (its group's rows × 64) apart, and `k0` is a multiple of 64 (`gemm_i8_w8a8`).
    let wp: [*const i8; RR] = std::array::from_fn(|r| lw.w_ptr(n0 + r, k0));
    let ws: [usize; RR] = std::array::from_fn(|r| lw.wa.chunk_stride(n0 + r));
    // The same rows of the next block; past the tile's end, the rows the caller streams next
    // (counted as if every block were whole, so the single-row blocks at the end continue
    // where the last whole block stopped), else this block's own.
    let pf: [(*const i8, usize); RR] = std::array::from_fn(|r| {
        if n0 + RR + r < lw.n.end {
            (lw.w_ptr(n0 + RR + r, k0), lw.wa.chunk_stride(n0 + RR + r))
        } else {
            lw.next
                .and_then(|nx| nx.row(n0 + R + r - lw.n.end, k0))
                .unwrap_or((wp[r], ws[r]))
        }
    });
    let ap: [*const i8; BB] = std::array::from_fn(|b| lw.a[(b0 + b) * lw.lda + k0..].as_ptr());
    let flip = _mm512_set1_epi8(i8::MIN);
    let mut acc = [[_mm512_setzero_si512(); BB]; RR];
    for s in 0..steps {
        let w: [__m512i; RR] = std::array::from_fn(|r| {
            // The same row of the next block, one block ahead (module docs of `gemm_i8`).
            prefetch_l2(pf[r].0.wrapping_add(s * pf[r].1));
            // SAFETY: `s * STEP + STEP <= k.len()` values of row `n0 + r` lie from each start
            // pointer, step `s` at `s * ws[r]` (contiguous when row-major; in whole chunks
            // of the row's group when packed), inside the weights (rows checked by the
            // caller).
            _mm512_xor_si512(
                unsafe { _mm512_loadu_si512(wp[r].add(s * ws[r]).cast()) },
                flip,
            )
        });
        for b in 0..BB {
            // SAFETY: as above.
            let a = unsafe { _mm512_loadu_si512(ap[b].add(s * STEP).cast()) };
            for r in 0..RR {
                acc[r][b] = _mm512_dpbusd_epi32(acc[r][b], w[r], a);
            }
        }
    }
    for r in 0..RR {
        for b in 0..BB {
            sums[r][b] = _mm512_reduce_add_epi32(acc[r][b]).wrapping_sub(lo.offset(b0 + b));
        }
    }
}

/// Wide product: 16 int8 widened to fp32 per step, FMA against fp32 rows.
///
/// # Safety
/// AVX-512 F available; `lw` checked by `gemm_i8_wide`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
pub(super) unsafe fn gemm_wide(lw: &LoweredWide<'_>, out: &mut [f32], ld_out: usize) {
    drive!(
        std::slice::from_ref(lw),
        out,
        ld_out,
        R_WIDE,
        B_WIDE,
        16,
        block_wide,
        0.0f32
    );
}

/// `sums[r][b]` of the body in steps of 16.
///
/// # Safety
/// AVX-512 F available; the rows lie inside the tile of a checked `lw`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
unsafe fn block_wide<const RR: usize, const BB: usize>(
    lw: &LoweredWide<'_>,
    n0: usize,
    b0: usize,
    sums: &mut [[f32; B_WIDE]; R_WIDE],
) {
    let steps = lw.k.len() / 16;
    let k0 = lw.k.start;
    let wp: [*const i8; RR] = std::array::from_fn(|r| lw.w[(n0 + r) * lw.ldw + k0..].as_ptr());
    let xp: [*const f32; BB] = std::array::from_fn(|b| lw.x[(b0 + b) * lw.ldx + k0..].as_ptr());
    let mut acc = [[_mm512_setzero_ps(); BB]; RR];
    for s in 0..steps {
        // SAFETY: `s * 16 + 16 <= k.len()` values lie after each start pointer.
        let x: [__m512; BB] =
            std::array::from_fn(|b| unsafe { _mm512_loadu_ps(xp[b].add(s * 16)) });
        for r in 0..RR {
            if s % 4 == 0 {
                // As in the W8A8 blocks: the next block's rows, a cache line per 64 bytes.
                prefetch_l2(wp[r].wrapping_add(RR * lw.ldw + s * 16));
            }
            // SAFETY: as above (16 bytes of the weight row).
            let w16 = unsafe { _mm_loadu_si128(wp[r].add(s * 16).cast()) };
            let wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(w16));
            for b in 0..BB {
                acc[r][b] = _mm512_fmadd_ps(wf, x[b], acc[r][b]);
            }
        }
    }
    for r in 0..RR {
        for b in 0..BB {
            sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
        }
    }
}
