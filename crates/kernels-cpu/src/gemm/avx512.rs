//! AVX-512 BF16 GEMM path: `vdpbf16ps` multiplies 32 bf16 weights by 32 bf16 activations and
//! adds each adjacent pair's products into one of 16 fp32 lanes, so a weight row is used as it
//! lies in memory (no widening) and one instruction does 32 multiply-adds.
//!
//! The instruction pairs neighbouring `K` elements, so the activations must be bf16 in natural
//! order: each call first converts the tile's `[batch, k body]` of packed fp32 activations into
//! a per-thread scratch (exact for the model's activations, which are bf16 values already;
//! other fp32 values are rounded to nearest even). That costs `batch * k` conversions against
//! the tile's `rows * batch * k` products.
//!
//! Passes take `R = 4` weight rows (up to `ROW_STRIDE` rows apart, as the AVX2 path: concurrent
//! streams far apart share DRAM pages less) against up to `BB = 4` batch rows; larger batches
//! run the same rows once per group of four batch rows while the rows sit in L1. Row-major
//! tiles of one or two batch rows do not come here: the AVX2 four-stream passes streamed them
//! ~10% faster on the Xeon this path was measured on (`AVX2_STREAMS_MAX_BATCH` in the parent).
//!
//! Tiled weights (`WeightLayout::Tiled`; on AMX machines the tile path takes them at every
//! batch, so this runs them only on AVX-512 BF16 machines without AMX, or for a body shorter
//! than one 32-element step) take a whole 16-row group per pass, one batch row at a time:
//! sixteen accumulators, each step one 1 KiB block read in order, the first batch row
//! prefetching whole blocks ahead, the others finding the group in L1/L2. Each output sums
//! the same products in the same order as the row-major passes. Measured on an AMX host it
//! streams level with the row-major passes at batch 1 and ~20% slower at batch 4 (each weight
//! load feeds one batch row), so models tile only where the AMX path runs
//! (`tiled_weights_pay`).

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::{Lowered, PACK_BLOCK, edge_sum, finish};
use crate::simd::as_pbh;

/// Weight rows per pass.
const R: usize = 4;
/// Batch rows per pass.
const BB: usize = 4;
/// Most rows between the concurrent row streams of a pass (as in the AVX2 path).
const ROW_STRIDE: usize = 32;
/// Prefetch distance along a row, in bf16 elements (2 KiB). On the 2-core Xeon with AMX of
/// session 21 (`examples/gemm_step_bw`, the decode plan's blocks of the 0.6B projections from
/// memory, 2 threads, processes alternated) 2 KiB instead of 512 B raised the rate 7–9% at
/// batch 4 (26.9–29.6 to 29.7–32.6 GB/s) and 2–4% at batch 3; 4 KiB fell between the two.
const PF_ELEMS: usize = 1024;
/// Prefetch distance along a tiled group, in 1 KiB blocks.
const PF_TILED_BLOCKS: usize = 4;

thread_local! {
    /// Natural-order bf16 activations of the current call (see the module docs).
    static NATURAL: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// Row stride of the natural scratch for a body of `klen` elements: a multiple of 32 (whole
/// `vdpbf16ps` steps; the padding is zero) plus 32, so rows are never 4 KiB apart.
pub(super) fn natural_ld(klen: usize) -> usize {
    klen.div_ceil(32) * 32 + 32
}

/// Computes the tile described by `lw` into `out`, on `natural` where given (the whole body's
/// rows converted once, [`convert_natural`]) and otherwise converting the tile's body first.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL and AVX-512 BF16, and `lw` must describe a tile inside
/// its matrices with `out` long enough (as checked by `gemm_dispatch`); `natural`, where given,
/// was converted from `lw`'s activations over `lw`'s body.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn gemm(
    lw: &Lowered<'_>,
    natural: Option<&[u16]>,
    out: &mut [f32],
    ld_out: usize,
) {
    // SAFETY: AVX-512 F/BW/VL + BF16 by this function's contract.
    unsafe {
        with_natural(lw, natural, |xn, ldb| {
            gemm_natural(lw, xn, ldb, out, ld_out)
        })
    }
}

/// Runs `f` on the tile's activation body (`kb0..kb1` of every batch row) in natural-order
/// bf16: `batch` rows of stride `ldb` (the [`natural_ld`] of the body), each zero past the
/// body. `made` holds them when they were converted once for every tile over this body
/// ([`convert_natural`]; used when its length is `batch` rows of that stride); otherwise they
/// are converted into this thread's scratch.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available; `lw` checked by `gemm_dispatch`; `made`, where given, was
/// converted from `lw`'s activations over `lw`'s body (the bits matter, not the memory: any
/// slice of the right length is read in bounds).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn with_natural<R>(
    lw: &Lowered<'_>,
    made: Option<&[u16]>,
    f: impl FnOnce(&[u16], usize) -> R,
) -> R {
    let ldb = natural_ld(lw.kb1 - lw.kb0);
    if let Some(xn) = made.filter(|m| m.len() == lw.batch * ldb) {
        return f(xn, ldb);
    }
    NATURAL.with(|cell| {
        let mut xn = cell.borrow_mut();
        // Grown, never shrunk: `to_natural` writes every element of each row (the body and
        // the zeros past it), so a `resize` down and back up between calls of different `K`
        // would only zero megabytes that are overwritten next (prefill's `o` and `down` after
        // `K` = 1024 products: ~1.4% of their time).
        let len = lw.batch * ldb;
        if xn.len() < len {
            xn.resize(len, 0);
        }
        let xn = &mut xn[..len];
        // SAFETY: AVX-512 F/BW/VL + BF16 by this function's contract.
        unsafe { fill_natural(lw, xn, ldb) };
        f(xn, ldb)
    })
}

/// The natural-order bf16 rows of `lw`'s body (every batch row, stride [`natural_ld`] of the
/// body) into the first elements of `dst`, as [`with_natural`] converts them per call: made
/// once for the products of many tiles over the same activations (`ActsConversion`). Returns
/// how many elements they take. `dst` only grows, as the per-call scratch does: the conversion
/// writes every element it uses, so zeroing a prefill input's megabytes first is waste.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available; `lw`'s activations hold `batch` rows of stride `ldx`
/// covering the body (only they are read).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn convert_natural(lw: &Lowered<'_>, dst: &mut Vec<u16>) -> usize {
    let ldb = natural_ld(lw.kb1 - lw.kb0);
    let len = lw.batch * ldb;
    if dst.len() < len {
        dst.resize(len, 0);
    }
    // SAFETY: AVX-512 F/BW/VL + BF16 by this function's contract.
    unsafe { fill_natural(lw, &mut dst[..len], ldb) };
    len
}

/// Converts the body of every batch row of `lw` into `xn` (`batch` rows of stride `ldb`).
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available; `ldb >= kb1 - kb0`, `xn.len() >= batch * ldb` and the
/// activations cover the body (slices, so a violation panics rather than strays).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn fill_natural(lw: &Lowered<'_>, xn: &mut [u16], ldb: usize) {
    for b in 0..lw.batch {
        let src = &lw.x[b * lw.ldx + lw.kb0..b * lw.ldx + lw.kb1];
        // SAFETY: AVX-512 F/BW/VL + BF16 by this function's contract.
        unsafe { to_natural(src, &mut xn[b * ldb..(b + 1) * ldb]) };
    }
}

/// [`gemm`] on the converted activations.
///
/// # Safety
/// As [`gemm`]; `xn` holds `lw.batch` rows of stride `ldb` (at least `lw.batch * ldb` long).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn gemm_natural(lw: &Lowered<'_>, xn: &[u16], ldb: usize, out: &mut [f32], ld_out: usize) {
    {
        let mut n0 = lw.n.start;
        if lw.tiled {
            // n0 starts a group (gemm_dispatch checks tiled tiles start on one).
            while n0 < lw.n.end {
                let r = super::TILE_ROWS.min(lw.n.end - n0);
                for b in 0..lw.batch {
                    // SAFETY: n0 starts a group of the weights; rows n0..n0 + r lie inside the
                    // tile; b < batch.
                    unsafe { tiled_group(lw, xn, ldb, n0, r, b, out, ld_out) };
                }
                n0 += r;
            }
            return;
        }
        while n0 + R <= lw.n.end {
            let rs = ((lw.n.end - n0) / R).min(ROW_STRIDE);
            for h in 0..rs {
                // SAFETY: rows n0 + h + rs * r (r < R) lie inside the tile (n0 + rs * R <=
                // n.end); the caller's contract covers the rest.
                unsafe { rows_dyn(lw, xn, ldb, n0 + h, R, rs, out, ld_out) };
            }
            n0 += rs * R;
        }
        if n0 < lw.n.end {
            // SAFETY: the rows n0..n.end (fewer than R, adjacent) lie inside the tile.
            unsafe { rows_dyn(lw, xn, ldb, n0, lw.n.end - n0, 1, out, ld_out) };
        }
    }
}

/// Converts one row's body of packed fp32 activations (whole packing blocks) into natural
/// order bf16 (`dst`, zero beyond the body).
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available. `src.len()` is a multiple of 16 and `dst` is at least as
/// long (checked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn to_natural(src: &[f32], dst: &mut [u16]) {
    assert!(src.len().is_multiple_of(PACK_BLOCK) && dst.len() >= src.len());
    for (s, d) in src
        .chunks_exact(PACK_BLOCK)
        .zip(dst.chunks_exact_mut(PACK_BLOCK))
    {
        // SAFETY: `s` is 16 fp32 and `d` 16 u16 (chunks_exact), the sizes of the load and the
        // two 128-bit stores.
        unsafe {
            let v = _mm512_loadu_ps(s.as_ptr());
            let h = pbh256_bits(_mm512_cvtneps_pbh(v));
            // The packed block is [x0, x2, .., x14, x1, x3, .., x15]: interleave its halves.
            let (e, o) = (_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            _mm_storeu_si128(d.as_mut_ptr().cast(), _mm_unpacklo_epi16(e, o));
            _mm_storeu_si128(d.as_mut_ptr().add(8).cast(), _mm_unpackhi_epi16(e, o));
        }
    }
    dst[src.len()..].fill(0);
}

/// The bits of 16 bf16 values.
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
fn pbh256_bits(v: __m256bh) -> __m256i {
    // SAFETY: both are plain 256-bit vectors with no invalid bit patterns.
    unsafe { std::mem::transmute::<__m256bh, __m256i>(v) }
}

/// `r` weight rows `n0 + rstride * i` against every batch row, `BB` at a time.
///
/// # Safety
/// As [`rows`]; `1 <= r <= R`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_dyn(
    lw: &Lowered<'_>,
    xn: &[u16],
    ldb: usize,
    n0: usize,
    r: usize,
    rstride: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    let mut b0 = 0;
    while b0 < lw.batch {
        let bb = BB.min(lw.batch - b0);
        macro_rules! go {
            ($($r:literal, $b:literal);*) => {
                match (r, bb) {
                    $(($r, $b) => {
                        // SAFETY: forwarded contract; b0 + bb <= batch by the loop bound.
                        unsafe { rows::<$r, $b>(lw, xn, ldb, n0, rstride, b0, out, ld_out) }
                    })*
                    _ => unreachable!("pass shape {r}x{bb}"),
                }
            };
        }
        go!(1,1; 1,2; 1,3; 1,4; 2,1; 2,2; 2,3; 2,4; 3,1; 3,2; 3,3; 3,4; 4,1; 4,2; 4,3; 4,4);
        b0 += bb;
    }
}

/// `RR` weight rows `n0 + rstride * r` against batch rows `b0..b0 + BN` over the body.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available; `n0 + rstride * (RR - 1) < lw.n.end`, `b0 + BN <=
/// lw.batch`; `lw` checked by `gemm_dispatch`; `xn` holds `lw.batch` rows of stride `ldb =
/// natural_ld(kb1 - kb0)` written by [`to_natural`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn rows<const RR: usize, const BN: usize>(
    lw: &Lowered<'_>,
    xn: &[u16],
    ldb: usize,
    n0: usize,
    rstride: usize,
    b0: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    let klen = lw.kb1 - lw.kb0;
    // Each row's body: 32-element lines `step` elements apart (the last line may hold 16).
    let (_, step) = lw.body_start(n0);
    let lines = klen.div_ceil(32);
    let span = if lines == 0 {
        0
    } else {
        (lines - 1) * step + (klen - (lines - 1) * 32)
    };
    let w: [&[u16]; RR] = std::array::from_fn(|r| {
        let (start, _) = lw.body_start(n0 + r * rstride);
        &lw.w[start..start + span]
    });
    let x: [&[u16]; BN] = std::array::from_fn(|b| &xn[(b0 + b) * ldb..(b0 + b + 1) * ldb]);
    let mut acc = [[_mm512_setzero_ps(); BN]; RR];
    let mut kk = 0;
    // The weight offset of step `kk / 32` within each row's body.
    let mut wo = 0;
    while kk + 32 <= klen {
        for row in &w {
            // Prefetch never faults; `wrapping_add` keeps the address arithmetic defined past
            // the row's end.
            _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(wo + PF_ELEMS).cast::<i8>());
        }
        // SAFETY: a whole line remains (kk + 32 <= klen), so wo + 32 <= span = every row
        // slice's length; the scratch rows are ldb >= klen long.
        let wv: [__m512i; RR] =
            std::array::from_fn(|r| unsafe { _mm512_loadu_si512(w[r].as_ptr().add(wo).cast()) });
        for b in 0..BN {
            // SAFETY: as above.
            let xv = as_pbh(unsafe { _mm512_loadu_si512(x[b].as_ptr().add(kk).cast()) });
            for r in 0..RR {
                acc[r][b] = _mm512_dpbf16_ps(acc[r][b], as_pbh(wv[r]), xv);
            }
        }
        kk += 32;
        wo += step;
    }
    if kk < klen {
        // The last 16 elements (klen is a multiple of 16): a masked load reads only them and
        // never faults on the masked-off half; the scratch is zero there.
        let wv: [__m512i; RR] = std::array::from_fn(|r| {
            // SAFETY: the 16 unmasked elements at wo are the last of the row slice
            // (kk + 16 == klen, so wo + 16 == span).
            unsafe { _mm512_maskz_loadu_epi16(0xFFFF, w[r].as_ptr().add(wo).cast()) }
        });
        for b in 0..BN {
            // SAFETY: kk + 32 <= ldb (ldb is klen rounded up to 32, plus 32).
            let xv = as_pbh(unsafe { _mm512_loadu_si512(x[b].as_ptr().add(kk).cast()) });
            for r in 0..RR {
                acc[r][b] = _mm512_dpbf16_ps(acc[r][b], as_pbh(wv[r]), xv);
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        let n = n0 + r * rstride;
        for (b, &a) in accr.iter().enumerate() {
            let sum = _mm512_reduce_add_ps(a) + edge_sum(lw, n, b0 + b);
            finish(lw, out, ld_out, n, b0 + b, sum);
        }
    }
}

/// Rows `n0..n0 + r` of a tiled group (`n0` its first row) against batch row `b` over the body:
/// all 16 rows of the group are summed (the rows past `r` are other rows of the buffer or its
/// zero padding, read but not stored). The first batch row prefetches whole blocks ahead.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available; `lw` is tiled and checked by `gemm_dispatch`; `n0` is a
/// multiple of 16, `1 <= r <= 16`, `n0 + r <= lw.n.end`, `b < lw.batch`; `xn` as for [`rows`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn tiled_group(
    lw: &Lowered<'_>,
    xn: &[u16],
    ldb: usize,
    n0: usize,
    r: usize,
    b: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    const G: usize = super::TILE_ROWS;
    let klen = lw.kb1 - lw.kb0;
    let (start, step) = lw.body_start(n0);
    let lines = klen.div_ceil(32);
    // The group's blocks of the body (the last may be read only in part).
    let w = &lw.w[start..start + lines * step];
    let x = &xn[b * ldb..(b + 1) * ldb];
    let mut acc = [_mm512_setzero_ps(); G];
    let pf = b == 0;
    let mut kk = 0;
    let mut wo = 0;
    while kk < klen {
        if pf {
            let ahead = w.as_ptr().wrapping_add(wo + PF_TILED_BLOCKS * step);
            for line in 0..G {
                // Prefetch never faults; `wrapping_add` keeps the arithmetic defined.
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(32 * line).cast::<i8>());
            }
        }
        // The last step may hold 16 elements: the mask reads only those (the scratch is zero
        // past the body).
        let mask: __mmask32 = if kk + 32 <= klen { !0 } else { 0xFFFF };
        // SAFETY: kk + 32 <= ldb (ldb is klen rounded up to 32, plus 32).
        let xv = as_pbh(unsafe { _mm512_loadu_si512(x.as_ptr().add(kk).cast()) });
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: line i of block kk / 32 lies in `w`; the mask covers only the body.
            let wv = unsafe { _mm512_maskz_loadu_epi16(mask, w.as_ptr().add(wo + 32 * i).cast()) };
            *a = _mm512_dpbf16_ps(*a, as_pbh(wv), xv);
        }
        kk += 32;
        wo += step;
    }
    for (i, a) in acc.iter().enumerate().take(r) {
        let n = n0 + i;
        let sum = _mm512_reduce_add_ps(*a) + edge_sum(lw, n, b);
        finish(lw, out, ld_out, n, b, sum);
    }
}
