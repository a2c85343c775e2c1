//! The AVX-512 BF16 path on paired weights (`WeightLayout::Pairs`): one 256-bit load is eight
//! output rows' pair of `K` elements, exactly the operand `vdpbf16ps` wants, and each batch
//! row's pair of activations is broadcast to the eight lanes, so the sums build up lane by lane
//! with no widening and no horizontal sum.
//!
//! Why: the row-major passes (`avx512.rs`) take one activation vector per weight vector and
//! end every output with a horizontal sum of 16 lanes; on an AVX-512 BF16 machine without AMX
//! (AMD Zen 4: two 256-bit `vdpbf16ps` a cycle, a 512-bit one taking both pipes) they ran the
//! 0.6B projections at 47% of the `vdpbf16ps` peak at 16 batch rows and 55% at 512, and
//! streamed `Wo_a` (8 rows) at 57% of bandwidth (`docs/benchmarks.md`, session 44). Here a
//! pass of `S` row groups × `B` batch rows keeps `S × B` accumulators in `ymm` registers
//! (AVX-512 VL gives 32 of them): per pair of `K`, `S` weight loads and `B` 4-byte broadcasts
//! feed `S × B` instructions of 16 multiply-adds each.
//!
//! - Batch 2–4 (batch 1 takes the AVX2 passes, `AVX512_PAIRS_MIN_BATCH` in the parent):
//!   passes of six row groups (six streams a sixth of the tile apart, each walking
//!   consecutive groups) × the whole batch: 24 accumulators at 4 rows.
//! - Batch 5 and up: passes of three row groups × runs of eight batch rows (24 accumulators);
//!   a pass runs once per eight batch rows while its three groups sit in L1/L2.
//! - A pass of one run (up to 8 batch rows) prefetches each stream [`PF_BYTES`] ahead into L2,
//!   into the stream's next group past the end of its current one (a stream's groups are
//!   adjacent), from 3 batch rows; with several runs each run prefetches its share of the
//!   next pass's groups, so the weights stream through every run ([`pass`]): into L1 at 2–4
//!   full runs ([`L1_PREFETCH_RUNS`]: 16, 24 or 32 batch rows), else into L2.
//! - The `K` range a call sums is its whole packing blocks (16 elements, 8 pairs: one loop
//!   step), converted once per call to natural-order bf16 (`avx512::with_natural`); the
//!   elements outside them are added per output by `edge_sum`.

use std::arch::x86_64::*;

use super::avx2::store_rows8;
use super::avx512::with_natural;
use super::{Lowered, PAIR_ROWS, pass_groups};

/// Row groups per pass at 1–4 batch rows.
const NV_SMALL: usize = 6;
/// Row groups per pass from 5 batch rows.
const NV: usize = 3;
/// Batch rows per run from 5 batch rows.
const MB: usize = 8;
/// bf16 elements of one group's pair (eight rows × two `k`).
const PAIR_ELEMS: usize = 2 * PAIR_ROWS;
/// How far ahead of its loads the first run of a pass prefetches each stream, in bytes (into
/// L2: on Zen 4 at 8 rows, one thread, 2 KiB into L1 streamed 14–15 GB/s, 4 KiB into L2
/// 17–18; `examples/gemm_step_bw`, session 44).
const PF_BYTES: usize = 4096;
/// The runs per pass (of [`MB`] batch rows each, every run full) whose prefetch of the next
/// pass's groups goes into L1 (`prefetcht0`) rather than L2. On Zen 4, 2 threads streaming
/// weights from memory, interleaved in one process (`docs/benchmarks.md`, session 45):
/// - 512-row tiles of one `[65536, 1024]` matrix: into L1 took 0.88–0.89× the time at 16
///   batch rows, 0.88× at 24 and 0.89× at 32; 0.96× at 12, and 1.02× at 64 and 512;
/// - the decode plan's blocks of the 0.6B projections (`examples/gemm_step_bw
///   --versus-l2-prefetch`): rate 1.03–1.06× at 16, 1.00–1.03× at 24, 1.01–1.02× at 32, but
///   0.96–0.98× at 12, whose short last run must prefetch as much as the full one.
///
/// A single run's prefetch [`PF_BYTES`] ahead stays in L2: into L1 it took 1.16× the time at
/// 8 rows and 1.27× at 4.
const L1_PREFETCH_RUNS: std::ops::RangeInclusive<usize> = 2..=4;
/// The largest batch whose single run leaves its six streams to the hardware prefetchers: at
/// 2 × 1024 on Zen 4 the step with them alone took 0.93× the time of the AVX2 pair passes,
/// with the prefetch 1.03× (`bench qwen3-decode --versus-isa avx2`, 20 interleaved pairs);
/// from 4 rows the prefetch was faster (1.08× against 1.06× without it).
const HW_PREFETCH_MAX_BATCH: usize = 2;

/// Computes the tile described by `lw` (paired weights) into `out`.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL and AVX-512 BF16; `lw` must describe a tile of paired
/// weights inside its matrices, its first row on a group of 8, with `out` long enough (as
/// `gemm_dispatch` checks); `natural`, where given, was converted from `lw`'s activations over
/// `lw`'s body (`avx512::convert_natural`; its length is checked).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn gemm(
    lw: &Lowered<'_>,
    natural: Option<&[u16]>,
    out: &mut [f32],
    ld_out: usize,
) {
    debug_assert!(lw.pairs && lw.n.start.is_multiple_of(PAIR_ROWS));
    // SAFETY: AVX-512 F/BW/VL + BF16 by this function's contract.
    unsafe {
        with_natural(lw, natural, |xn, ldb| {
            let g0 = lw.n.start / PAIR_ROWS;
            let g1 = lw.n.end.div_ceil(PAIR_ROWS);
            let nv = if lw.batch <= 4 { NV_SMALL } else { NV };
            let mut len = (g1 - g0) / nv;
            // One group left over would run alone (one stream, `B` accumulators: about half
            // the peak); with the last pass it makes passes of two instead.
            if (g1 - g0) % nv == 1 && len > 0 {
                len -= 1;
            }
            for i in 0..len {
                // SAFETY: the groups lie inside the tile (`s * len + i < nv * len <= g1 -
                // g0`); forwarded contract.
                if nv == NV_SMALL {
                    let (groups, next) = pass_groups::<NV_SMALL>(g0, len, i);
                    pass::<NV_SMALL>(lw, xn, ldb, groups, next, out, ld_out);
                } else {
                    let (groups, next) = pass_groups::<NV>(g0, len, i);
                    pass::<NV>(lw, xn, ldb, groups, next, out, ld_out);
                }
            }
            // The groups past the streams, in passes of three, two or (a tile of one group)
            // one. At 512 batch rows on Zen 4 (`examples/gemm_prefill_pairs`, one thread per
            // tile), 256-row tiles (two groups left over) took ~0.98x the time with one pass
            // of two than with two passes of one, and 128-row tiles of `K` = 3072 (one left)
            // ~0.99x with two passes of two than with a pass of three and one of one.
            let mut gg = g0 + nv * len;
            while gg < g1 {
                // SAFETY (each arm): the pass's groups lie in the tile (`gg + S <= g1`);
                // forwarded contract.
                match g1 - gg {
                    1 => {
                        pass::<1>(lw, xn, ldb, [gg], [gg + 1], out, ld_out);
                        gg += 1;
                    }
                    2 | 4 => {
                        pass::<2>(lw, xn, ldb, [gg, gg + 1], [gg + 2, gg + 3], out, ld_out);
                        gg += 2;
                    }
                    _ => {
                        let (groups, next) = ([gg, gg + 1, gg + 2], [gg + 3, gg + 4, gg + 5]);
                        pass::<3>(lw, xn, ldb, groups, next, out, ld_out);
                        gg += 3;
                    }
                }
            }
        })
    }
}

/// Where group `gg`'s body (`K` elements `kb0..kb1`) starts.
#[inline]
fn group_start(lw: &Lowered<'_>, gg: usize) -> *const u16 {
    let group = lw.ldw.next_multiple_of(2) * PAIR_ROWS;
    lw.w.as_ptr()
        .wrapping_add(gg * group + lw.kb0 / 2 * PAIR_ELEMS)
}

/// One pass of `S` row groups over every batch row, in runs of up to [`MB`] rows.
///
/// A pass of one run prefetches each stream [`PF_BYTES`] ahead of its loads (into the
/// stream's next group as the run nears its end). With two runs or more, the first run would
/// wait on memory while the later ones compute from cache, so instead run `r` prefetches its
/// share of the groups `next` (the pass after this one): the weights then stream through
/// every run of the pass (into L1 at 2–4 full runs, [`L1_PREFETCH_RUNS`]).
///
/// # Safety
/// As [`gemm`], with every group in `groups` inside the tile (`next` may name any group);
/// `xn` holds `lw.batch` natural rows of stride `ldb >= kb1 - kb0`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pass<const S: usize>(
    lw: &Lowered<'_>,
    xn: &[u16],
    ldb: usize,
    groups: [usize; S],
    next: [usize; S],
    out: &mut [f32],
    ld_out: usize,
) {
    let pairs = (lw.kb1 - lw.kb0) / 2;
    let g = groups.map(|gg| group_start(lw, gg));
    let runs = lw.batch.div_ceil(MB);
    // 64-byte lines prefetched per stream and 8-pair step (256 bytes of each stream).
    let lines = match runs {
        1 => 4,
        2 | 3 => 2,
        _ => 1,
    };
    // Bytes of a group's body, and the share of the next groups' bodies a run covers.
    let body = pairs * 2 * PAIR_ELEMS;
    let share = body / 4 * lines;
    let into_l1 = L1_PREFETCH_RUNS.contains(&runs)
        && lw.batch.is_multiple_of(MB)
        && super::paired_l1_prefetch();
    let mut b0 = 0;
    for r in 0..runs {
        let bv = MB.min(lw.batch - b0);
        let (pf, lines) = if runs == 1 {
            let lines = if lw.batch <= HW_PREFETCH_MAX_BATCH {
                0
            } else {
                lines
            };
            (g.map(|p| p.cast::<u8>().wrapping_add(PF_BYTES)), lines)
        } else if (r + 1) * share <= body {
            (
                next.map(|gg| group_start(lw, gg).cast::<u8>().wrapping_add(r * share)),
                lines,
            )
        } else {
            (g.map(|p| p.cast::<u8>()), 0)
        };
        macro_rules! go {
            ($($b:literal)*) => {
                match bv {
                    $(
                        $b => {
                            // SAFETY: the groups' bodies (`pairs` pairs from `g[s]`) lie in
                            // `lw.w`, the batch rows' `2 pairs` elements in `xn`; prefetches
                            // never fault.
                            let acc = unsafe {
                                run::<S, $b>(g, xrows::<$b>(xn, ldb, b0), pf, lines, into_l1, pairs)
                            };
                            store(lw, &acc, &groups, b0, out, ld_out);
                        }
                    )*
                    _ => unreachable!("run of {bv} rows"),
                }
            };
        }
        if S == NV_SMALL {
            go!(1 2 3 4);
        } else {
            go!(1 2 3 4 5 6 7 8);
        }
        b0 += bv;
    }
}

/// The natural rows `b0..b0 + B` of the scratch.
#[inline]
fn xrows<const B: usize>(xn: &[u16], ldb: usize, b0: usize) -> [*const u16; B] {
    std::array::from_fn(|b| xn[(b0 + b) * ldb..].as_ptr())
}

/// Accumulates `S` groups × `B` batch rows over `pairs` pairs of `K` (a multiple of 8): lane
/// `i` of `acc[s][b]` is row `i` of group `s` against batch row `b`. Each 8-pair step also
/// prefetches `lines` consecutive 64-byte lines of each stream's region `pf[s]`, into L1 if
/// `into_l1`, else into L2.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16; the `pairs * 16` elements from each `g[s]` and the `2 * pairs` from
/// each `x[b]` are readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn run<const S: usize, const B: usize>(
    g: [*const u16; S],
    x: [*const u16; B],
    pf: [*const u8; S],
    lines: usize,
    into_l1: bool,
    pairs: usize,
) -> [[__m256; B]; S] {
    let mut acc = [[_mm256_setzero_ps(); B]; S];
    let mut p = 0;
    let mut t = 0;
    while p < pairs {
        for ps in pf {
            for line in 0..lines {
                // Prefetch never faults; `wrapping_add` keeps the address arithmetic defined
                // past the region's end.
                let a = ps.wrapping_add(64 * (t * lines + line)).cast::<i8>();
                if into_l1 {
                    _mm_prefetch::<_MM_HINT_T0>(a);
                } else {
                    _mm_prefetch::<_MM_HINT_T2>(a);
                }
            }
        }
        for j in 0..8 {
            // SAFETY: pair p + j < pairs (pairs is a multiple of 8) lies in each group's
            // readable body; unaligned loads.
            let w: [__m256bh; S] = std::array::from_fn(|s| unsafe {
                pbh(_mm256_loadu_si256(g[s].add((p + j) * PAIR_ELEMS).cast()))
            });
            for b in 0..B {
                // SAFETY: elements 2 (p + j) and 2 (p + j) + 1 of row b are readable.
                let xb = pbh(_mm256_set1_epi32(unsafe {
                    x[b].add(2 * (p + j)).cast::<i32>().read_unaligned()
                }));
                for s in 0..S {
                    acc[s][b] = _mm256_dpbf16_ps(acc[s][b], w[s], xb);
                }
            }
        }
        p += 8;
        t += 1;
    }
    acc
}

/// The bits of 16 bf16 values as the `vdpbf16ps` operand.
#[target_feature(enable = "avx512f,avx512vl,avx512bf16")]
#[inline]
fn pbh(v: __m256i) -> __m256bh {
    // SAFETY: both are plain 256-bit vectors with no invalid bit patterns.
    unsafe { std::mem::transmute::<__m256i, __m256bh>(v) }
}

/// Writes the finished run: group `groups[s]`, batch row `b0 + b` from `acc[s][b]`
/// (`avx2::store_rows8` each).
#[target_feature(enable = "avx2,fma")]
fn store<const S: usize, const B: usize>(
    lw: &Lowered<'_>,
    acc: &[[__m256; B]; S],
    groups: &[usize; S],
    b0: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    for (s, &gg) in groups.iter().enumerate() {
        for (b, &v) in acc[s].iter().enumerate() {
            store_rows8(lw, v, gg * PAIR_ROWS, b0 + b, out, ld_out);
        }
    }
}
