//! AVX2+FMA GEMM path: bf16 widened in registers by an even/odd split (shift left 16 / mask
//! the high half) against packed activations, with software prefetch that runs ahead of each
//! row stream and on into the next row group.
//!
//! - Batch 1 (bandwidth-bound): the tile's rows as four contiguous quarters walked side by
//!   side, one row of each per pass, the activations loaded once per step for all four.
//! - Batch 2 (bandwidth-bound): `4` weight rows × the whole batch per pass.
//! - Batch 3 and up: the assembly pass of [`quad`], `3` weight rows × `4` batch rows, once per
//!   group of four batch rows while the three rows sit in L1. A last group of three batch
//!   rows runs it too with one row repeated (its sums dropped: 3 of 4 rows' FMAs at the
//!   assembly loop's rate beat the intrinsics pass); one or two left over take a
//!   `3 × (batch % 4)` intrinsics pass. The rows left at a tile's end (fewer than three) run
//!   the assembly pass with a row repeated too. Activations are taken in blocks that fit in
//!   L2, so a prefill's many rows re-stream the weights once per block.
//! - Memory: from batch 7 (two groups of batch rows) each of the first two groups prefetches
//!   half of the next pass's rows at half the rate, so the weight stream runs through the whole
//!   pass and overlaps FMAs that do not wait on it (with the second group alone prefetching
//!   them, it asked for the rows at twice a core's share of the bandwidth and left memory idle
//!   during the first group: `set_avx2_spread_prefetch` alternates the two). A single group
//!   prefetches ahead in its own rows and on into the next pass's.
//! - Batch 64 and up (prefill; `set_avx2_panel_min_batch` moves the threshold): the packed
//!   GEMM of [`panel`], each weight widened once per call into fp32 panels.
//!
//! The concurrent row streams of a pass are up to `ROW_STRIDE` rows apart.

use std::arch::x86_64::*;

use super::{Lowered, edge_sum, finish};
use crate::simd::hsum256;

mod pairs;
mod panel;
mod quad;

pub(super) use pairs::gemm as gemm_pairs;
pub(super) use pairs::store_rows8;

/// Prefetch distance along a row of the bandwidth-bound passes (batch 1–2), in bf16 elements
/// (512 B). On Zen 3 (one core, the 0.6B projections, passes of each distance alternating in
/// one process) 1 KiB took 17% more time at batch 1 and 2 KiB 27% more; for the four-quarter
/// batch-1 pass on two cores 256 B was level and 1 KiB slower.
const PF_ELEMS: usize = 256;

/// The bandwidth-bound passes' prefetch distance on hosts with AVX-512, in bf16 elements (2
/// KiB). On the 2-core Xeon with AMX of session 21 (its memory takes more bytes in flight per
/// core than Zen 3's), with the decode plan's blocks of the 0.6B projections streamed from
/// memory (`examples/gemm_step_bw`, 2 threads, processes alternated): 2 KiB instead of 512 B
/// raised the rate 10% at batch 1 (31.5–33.7 to 35.2–37.6 GB/s) and at batch 2 (30.7–32.5 to
/// 34.8–37.1 GB/s); 4 KiB was level with 2 KiB at batch 2 and a little slower at batch 1. A
/// four-stream GEMV written outside the library, over 945 MB of projections (twice the L3),
/// read its tiles in 1.04× a plain read's time at 512 B and 0.985× at 2 KiB
/// (`examples/gemv_b1.rs`).
const FAR_PF_ELEMS: usize = 1024;

/// The prefetch distance of the bandwidth-bound passes on this host: [`FAR_PF_ELEMS`] where
/// the processor has AVX-512 (the Xeons these kernels were measured on), else [`PF_ELEMS`]
/// (Zen 3). Keyed on the hardware, not on `SIMPLER_ISA`: it is the memory system's property.
fn narrow_pf_elems() -> usize {
    if crate::Isa::hardware() >= crate::Isa::Avx512Bf16 {
        FAR_PF_ELEMS
    } else {
        PF_ELEMS
    }
}

/// Prefetch distance along a row of the assembly pass, in bf16 elements (2 KiB): the pass
/// spends ~24 cycles per 64-byte line of each row on Zen 3 (two 256-bit FMAs a cycle), so 512
/// B ahead was ~200 cycles, short of a DRAM miss. Against 512 B, on one core with the 0.6B
/// projections: 5% less time at batch 4 with 1 or 2 KiB (the same at 16, where the
/// next-pass prefetch feeds the rows), and 4 KiB 9% more at batch 16.
const QUAD_PF_ELEMS: usize = 1024;

/// Most rows between the concurrent row streams of a pass: passes over `n0 + h + rs * r` for
/// `h in 0..rs` cover `rs * R` consecutive rows (`rs` is this, or less near a tile's end).
/// Measured on two cores of the development machine with the 0.6B projections in 128-row
/// tiles, each configuration's passes alternating with the others' in one process (the
/// median of paired ratios, so host load drifts cancel): 32 rows apart against 4 took 6.9%
/// less time at batch 1, 5.9% at batch 2, 3.1% at batch 4 and the same at batch 16; 2 rows
/// apart took 7% more, and adjacent rows ~25% more (`docs/performance.md`).
const ROW_STRIDE: usize = 32;

/// Bytes of packed activations one batch block may hold (half of a 512 KiB L2, leaving room
/// for the weight streams).
const ACT_BLOCK_BYTES: usize = 256 * 1024;

/// The least count of batch rows left over (`batch % QB`) that the assembly pass takes with
/// its missing batch rows repeated. Measured on Zen 3 against the intrinsics passes (one core,
/// the 0.6B projections, alternating in one process): 3 left over took 4-6% less time
/// (batch 3 and 7); 2 left over level to 11% more, 1 left over 6-12% more.
const PADDED_MIN: usize = 3;

/// Weight rows per pass of the bandwidth-bound batches (1–2).
const NARROW_ROWS: usize = 4;

/// Computes the tile described by `lw` into `out`.
///
/// # Safety
/// The CPU must support AVX2 and FMA, and `lw` must describe a tile inside its matrices with
/// `out` long enough (as checked by `gemm_dispatch`).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) {
    if lw.batch >= super::avx2_panel_min_batch(panel::MIN_BATCH) && lw.kb1 > lw.kb0 {
        // SAFETY: forwarded contract (the dispatch sends only row-major weights here), and the
        // body is non-empty (checked).
        unsafe { panel::gemm(lw, out, ld_out) };
        return;
    }
    if lw.batch == 1 {
        // SAFETY: forwarded contract; batch 1 as checked.
        unsafe { gemv(lw, out, ld_out) };
        return;
    }
    let wide = lw.batch >= quad::QB || lw.batch >= PADDED_MIN;
    let (r_main, mut n0) = if wide {
        // SAFETY: forwarded contract.
        (quad::QR, unsafe { gemm_quad(lw, out, ld_out) })
    } else {
        // SAFETY: forwarded contract; batch < PADDED_MIN as checked.
        (NARROW_ROWS, unsafe { gemm_narrow(lw, out, ld_out) })
    };
    // The last rows (fewer than a row group) in the assembly pass with the missing rows
    // repeated: the intrinsics pass ran these rows ~3.5× slower per row than the loop (`perf`
    // at batch 16), so the padded pass costs no more.
    if wide && n0 < lw.n.end {
        let pass = Pass::adjacent(n0, lw.n.end - n0);
        let (full, rest) = quad_groups(lw.batch);
        for b0 in (0..full).step_by(quad::QB) {
            let bv = quad::QB.min(lw.batch - b0);
            // SAFETY: rows n0..n.end (fewer than QR) and batch rows b0..b0+bv lie inside the
            // tile; the caller's contract covers the rest.
            unsafe { quad_block(lw, pass, b0, bv, Prefetch::Ahead, out, ld_out) };
        }
        if rest > 0 {
            // SAFETY: as above, for the batch rows left over.
            unsafe { block_dyn(lw, pass, full, rest, out, ld_out) };
        }
        n0 = lw.n.end;
    }
    // The last rows (fewer than a row group), adjacent, `r_main` at a time.
    while n0 < lw.n.end {
        let r = r_main.min(lw.n.end - n0);
        let mut b0 = 0;
        while b0 < lw.batch {
            let bb = quad::QB.min(lw.batch - b0);
            // SAFETY: rows n0..n0+r and batch rows b0..b0+bb lie inside the tile (loop
            // bounds), and the caller's contract covers the rest.
            unsafe { block_dyn(lw, Pass::adjacent(n0, r), b0, bb, out, ld_out) };
            b0 += bb;
        }
        n0 += r;
    }
}

/// The tile's rows in groups of `NARROW_ROWS` streams (up to `ROW_STRIDE` rows apart, closer
/// for the last rows so that fewer than `NARROW_ROWS` are left over) for a batch of 2, the
/// whole batch per pass; returns the first row not done.
///
/// # Safety
/// AVX2 and FMA available; `lw.batch < PADDED_MIN`; `lw` checked by `gemm_dispatch`.
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_narrow(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) -> usize {
    let r = NARROW_ROWS;
    let mut n0 = lw.n.start;
    while n0 + r <= lw.n.end {
        let rs = ((lw.n.end - n0) / r).min(ROW_STRIDE);
        for h in 0..rs {
            // SAFETY: rows n0 + h + rs * i (i < r) lie inside the tile (loop bound), the batch
            // rows inside the batch, and the caller's contract covers the rest.
            unsafe { block_dyn(lw, Pass::streams(n0, h, rs, r), 0, lw.batch, out, ld_out) };
        }
        n0 += rs * r;
    }
    n0
}

/// Concurrent row streams of the batch-1 pass. On Zen 3 (2 threads, the decode plan's ~1 MiB
/// tiles of the 0.6B projections from memory, thread CPU time, paired, one run each): 8
/// streams took ~5% more time, 2 ~15% more and 16 ~50% more; a plain read of the same tiles
/// is ~25% faster as four concurrent streams than as one (`examples/gemv_b1.rs`).
const GEMV_STREAMS: usize = 4;

/// Batch 1: the tile's rows as `GEMV_STREAMS` contiguous ranges walked side by side, one row
/// of each per pass (a tile's rows lie back to back, so each stream reads consecutive bytes
/// and its prefetch runs on into the stream's next row); the `rows % GEMV_STREAMS` rows left
/// over one at a time.
///
/// # Safety
/// AVX2 and FMA available; `lw.batch == 1`; `lw` checked by `gemm_dispatch` (row-major).
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) {
    let len = lw.n.len() / GEMV_STREAMS;
    for i in 0..len {
        // SAFETY: rows n.start + i + len * j (j < GEMV_STREAMS) lie inside the tile, and the
        // caller's contract covers the rest.
        unsafe { gemv_pass::<GEMV_STREAMS>(lw, lw.n.start + i, len, out, ld_out) };
    }
    for n in lw.n.start + GEMV_STREAMS * len..lw.n.end {
        // SAFETY: row n lies inside the tile.
        unsafe { gemv_pass::<1>(lw, n, 0, out, ld_out) };
    }
}

/// Batch 1, `S` weight rows `n0 + rstride * j` over the whole `k` range: each 16-element step
/// loads the packed activations once for every row.
///
/// # Safety
/// AVX2 and FMA available; `lw.batch == 1`; `n0 + rstride * (S - 1) < lw.n.end`; `lw`
/// checked by `gemm_dispatch` (row-major, so every element read in `[kb0, kb1)` is inside
/// `lw.w` / `lw.x`).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn gemv_pass<const S: usize>(
    lw: &Lowered<'_>,
    n0: usize,
    rstride: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    let ldw = lw.ldw;
    let klen = lw.kb1 - lw.kb0;
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let x = lw.x[lw.kb0..lw.kb1].as_ptr();
    let wrow: [*const u16; S] =
        std::array::from_fn(|j| lw.w[(n0 + j * rstride) * ldw + lw.kb0..].as_ptr());
    let mut acc = [_mm256_setzero_ps(); S];
    let mut acc_odd = [_mm256_setzero_ps(); S];
    let step = |acc: &mut [__m256; S], acc_odd: &mut [__m256; S], kk: usize| {
        // SAFETY: kk + 16 <= klen: the 16 packed activations at kk lie in [kb0, kb1) of
        // batch row 0.
        let (xe, xo) = unsafe { (_mm256_loadu_ps(x.add(kk)), _mm256_loadu_ps(x.add(kk + 8))) };
        for j in 0..S {
            // SAFETY: the 16 elements at wrow[j] + kk lie in row n0 + rstride * j's body.
            let raw = unsafe { _mm256_loadu_si256(wrow[j].add(kk).cast::<__m256i>()) };
            let we = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
            let wo = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
            acc[j] = _mm256_fmadd_ps(we, xe, acc[j]);
            acc_odd[j] = _mm256_fmadd_ps(wo, xo, acc_odd[j]);
        }
    };
    let pf = narrow_pf_elems();
    let mut kk = 0;
    while kk + 32 <= klen {
        for p in wrow {
            // Past the row's end this is the next row of the same stream (rows lie back to
            // back); prefetch never faults, and `wrapping_add` keeps the address computation
            // defined past the matrix.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(kk + pf).cast::<i8>());
        }
        step(&mut acc, &mut acc_odd, kk);
        step(&mut acc, &mut acc_odd, kk + 16);
        kk += 32;
    }
    if kk + 16 <= klen {
        step(&mut acc, &mut acc_odd, kk);
    }
    // Every row's sum before any edge sum: an `edge_sum` call with accumulators still live
    // spilled them all to the stack, once per row.
    let sums: [f32; S] = std::array::from_fn(|j| hsum256(_mm256_add_ps(acc[j], acc_odd[j])));
    let edges = lw.has_edges();
    for (j, &sum) in sums.iter().enumerate() {
        let n = n0 + j * rstride;
        let sum = if edges { sum + edge_sum(lw, n, 0) } else { sum };
        finish(lw, out, ld_out, n, 0, sum);
    }
}

/// The weight rows of one pass of [`quad_block`] or [`block_dyn`]: `rows` rows
/// `n0 + rstride * r`, whose prefetches past a row's end continue `next` rows on (the same
/// stream of the next pass).
#[derive(Clone, Copy)]
struct Pass {
    n0: usize,
    rows: usize,
    rstride: usize,
    next: usize,
}

impl Pass {
    /// `rows` adjacent rows from `n0`, the next pass right after them.
    fn adjacent(n0: usize, rows: usize) -> Pass {
        Pass {
            n0,
            rows,
            rstride: 1,
            next: rows,
        }
    }

    /// Pass `h` of a group of `r` streams `rs` rows apart from `n0` (rows `n0 + h + rs * i`;
    /// the next group starts `rs * r` rows on).
    fn streams(n0: usize, h: usize, rs: usize, r: usize) -> Pass {
        Pass {
            n0: n0 + h,
            rows: r,
            rstride: rs,
            next: if h + 1 < rs { 1 } else { rs * r - (rs - 1) },
        }
    }
}

/// The tile's rows in groups of `QR` streams (up to `ROW_STRIDE` rows apart, closer for the
/// last rows so that fewer than `QR` are left over) for a batch of `PADDED_MIN` or more,
/// batch block by batch block; returns the first row not done (fewer than `QR` remain after
/// it).
///
/// # Safety
/// AVX2 and FMA available; `lw.batch >= PADDED_MIN.min(QB)`; `lw` checked by
/// `gemm_dispatch`.
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_quad(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) -> usize {
    let (full, rest) = quad_groups(lw.batch);
    let block = (ACT_BLOCK_BYTES / (lw.ldx * 4) / quad::QB * quad::QB).max(quad::QB);
    let mut bo = 0;
    let mut n0 = lw.n.start;
    while bo < full {
        let bend = (bo + block).min(full);
        // Every batch block covers the same rows; the last leaves `n0` at the first row left.
        n0 = lw.n.start;
        let spread = super::avx2_spread_prefetch() && bend - bo > quad::QB;
        while n0 + quad::QR <= lw.n.end {
            let rs = ((lw.n.end - n0) / quad::QR).min(ROW_STRIDE);
            for h in 0..rs {
                let pass = Pass::streams(n0, h, rs, quad::QR);
                for b0 in (bo..bend).step_by(quad::QB) {
                    // The first two groups of a block each fetch half of the next pass's
                    // rows, at half the rate, so the weight stream runs through the whole
                    // pass (`spread`); else the second group fetches all of them: the first
                    // group's loads brought this pass's rows into L1.
                    let pf = match b0 - bo {
                        0 if spread => Prefetch::NextHalf(0),
                        quad::QB if spread => Prefetch::NextHalf(1),
                        quad::QB => Prefetch::NextPass,
                        _ => Prefetch::Ahead,
                    };
                    let bv = quad::QB.min(lw.batch - b0);
                    // SAFETY: rows n0 + h + rs * r (r < QR) lie inside the tile
                    // (n0 + rs * QR <= n.end), batch rows b0..b0+bv inside the batch; the
                    // caller's contract covers the rest.
                    unsafe { quad_block(lw, pass, b0, bv, pf, out, ld_out) };
                }
                if bend == full && rest > 0 {
                    // SAFETY: as above, for the batch rows full..batch.
                    unsafe { block_dyn(lw, pass, full, rest, out, ld_out) };
                }
            }
            n0 += rs * quad::QR;
        }
        bo = bend;
    }
    n0
}

/// The batch rows the assembly pass takes (whole groups of `QB`, and a last partial group of
/// at least `PADDED_MIN` rows), and the count left over for the intrinsics passes.
fn quad_groups(batch: usize) -> (usize, usize) {
    let quads = batch / quad::QB * quad::QB;
    let rest = batch - quads;
    if rest >= PADDED_MIN {
        (batch, 0)
    } else {
        (quads, rest)
    }
}

/// What the prefetches of a [`quad_block`] pass fetch.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Prefetch {
    /// `QUAD_PF_ELEMS` ahead in the pass's own rows, then on into the next pass's.
    Ahead,
    /// The next pass's rows at the same positions (a pass whose own rows are already in L1,
    /// so the next pass's memory stream overlaps this pass's FMAs).
    NextPass,
    /// Half `h` (0: `K`'s first half, 1: its second) of the next pass's rows, at half the
    /// rate, over the whole pass: two groups of batch rows fetch the next pass between them at
    /// the pace the pair of them spends on a pass (one group alone asks for the rows twice as
    /// fast as a core's share of the bandwidth, then leaves memory idle for the other).
    NextHalf(usize),
}

/// The weight rows of `pass` (at most `QR`) against batch rows `b0..b0 + bv` (`bv <= QB`) in
/// one pass of the assembly loop; prefetches follow `pf`, on into the next pass's rows.
/// Missing rows of either kind repeat the last one and their sums are dropped.
///
/// # Safety
/// AVX2 and FMA available; `1 <= pass.rows <= QR`, `1 <= bv <= QB`,
/// `n0 + rstride * (rows - 1) < lw.n.end` (of `pass`), `b0 + bv <= lw.batch`; `lw` checked
/// by `gemm_dispatch`.
#[target_feature(enable = "avx2,fma")]
unsafe fn quad_block(
    lw: &Lowered<'_>,
    pass: Pass,
    b0: usize,
    bv: usize,
    pf: Prefetch,
    out: &mut [f32],
    ld_out: usize,
) {
    let Pass {
        n0,
        rows,
        rstride,
        next,
    } = pass;
    let ldw = lw.ldw;
    let klen = lw.kb1 - lw.kb0;
    let w: [&[u16]; quad::QR] = std::array::from_fn(|r| {
        let row = (n0 + r.min(rows - 1) * rstride) * ldw;
        &lw.w[row + lw.kb0..row + lw.kb1]
    });
    let x: [&[f32]; quad::QB] = std::array::from_fn(|b| {
        let at = (b0 + b.min(bv - 1)) * lw.ldx;
        &lw.x[at + lw.kb0..at + lw.kb1]
    });
    let mut acc = [_mm256_setzero_ps(); quad::QR * quad::QB];
    // Ahead: two runs, prefetching `QUAD_PF_ELEMS` ahead in the same rows while that stays inside
    // them, then on into the same streams of the next pass (`next` rows on). NextPass: one
    // run, prefetching the next pass's rows at the loads' positions.
    let (split, ahead, wrap) = match pf {
        Prefetch::Ahead => (
            klen.saturating_sub(QUAD_PF_ELEMS) / 32 * 32,
            QUAD_PF_ELEMS,
            (next * ldw).wrapping_sub(klen),
        ),
        Prefetch::NextPass => (0, 0, next * ldw),
        // One run ending `(h + 1) · klen / 2` elements into the next pass's rows.
        Prefetch::NextHalf(h) => (0, 0, (next * ldw + (h + 1) * klen / 2).wrapping_sub(klen)),
    };
    let half_pf = matches!(pf, Prefetch::NextHalf(_));
    for (end, pf_shift) in [(split, 0), (klen, wrap)] {
        let start = if end == split { 0 } else { split };
        let run = quad::Run {
            w: w.map(|row| row[..end].as_ptr_range().end),
            pf: w.map(|row| {
                row.as_ptr()
                    .wrapping_add(end + ahead)
                    .wrapping_add(pf_shift)
            }),
            x: x.map(|row| row[..end].as_ptr_range().end),
            len: end - start,
            half_pf,
        };
        // SAFETY: the `len` elements before each stream end are `row[start..end]`, inside the
        // slices above; `len` is a multiple of 16 (klen is, and `split` of 32); AVX2/FMA by
        // this function's contract.
        unsafe { quad::accumulate(&mut acc, &run) };
    }
    let edges = lw.has_edges();
    for r in 0..rows {
        let n = n0 + r * rstride;
        let sums = hsum4(&acc[r * quad::QB..(r + 1) * quad::QB]);
        for (b, &sum) in sums.iter().enumerate().take(bv) {
            let sum = if edges {
                sum + edge_sum(lw, n, b0 + b)
            } else {
                sum
            };
            finish(lw, out, ld_out, n, b0 + b, sum);
        }
    }
}

/// The lane sums of four vectors.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum4(v: &[__m256]) -> [f32; 4] {
    let s01 = _mm256_hadd_ps(v[0], v[1]);
    let s23 = _mm256_hadd_ps(v[2], v[3]);
    let s = _mm256_hadd_ps(s01, s23);
    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let mut sums = [0.0f32; 4];
    // SAFETY: `sums` holds four f32.
    unsafe { _mm_storeu_ps(sums.as_mut_ptr(), s) };
    sums
}

/// Dispatches runtime `(pass.rows, bb)` to a const instantiation of [`block`].
///
/// # Safety
/// As [`block`], with `R = pass.rows`.
#[target_feature(enable = "avx2,fma")]
unsafe fn block_dyn(
    lw: &Lowered<'_>,
    pass: Pass,
    b0: usize,
    bb: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    let r = pass.rows;
    macro_rules! go {
        ($($r:literal, $b:literal);*) => {
            match (r, bb) {
                $(($r, $b) => {
                    // SAFETY: forwarded contract.
                    unsafe { block::<$r, $b>(lw, pass, b0, out, ld_out) }
                })*
                _ => unreachable!("block shape {r}x{bb}"),
            }
        };
    }
    go!(1,1; 1,2; 1,3; 1,4; 2,1; 2,2; 2,3; 2,4; 3,1; 3,2; 3,3; 3,4; 4,1; 4,2; 4,3; 4,4);
}

/// The `R` weight rows of `pass` (`R == pass.rows`) against `BB` batch rows from `b0`, over
/// the whole k range.
///
/// # Safety
/// AVX2 and FMA available; `n0 + rstride * (R - 1) < lw.n.end` (of `pass`), `b0 + BB <=
/// lw.batch`; `lw` checked by `gemm_dispatch` (so every row read in `[kb0, kb1)` is inside
/// `lw.w` / `lw.x`).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block<const R: usize, const BB: usize>(
    lw: &Lowered<'_>,
    pass: Pass,
    b0: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    let Pass {
        n0, rstride, next, ..
    } = pass;
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

    let pf = narrow_pf_elems();
    let mut kk = 0;
    while kk + 32 <= klen {
        for p in wrow {
            let off = kk + pf;
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
