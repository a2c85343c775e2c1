//! 256-bit int8 paths: AVX2 (`vpmaddubsw` with the sign trick for small batches, `vpmaddwd`
//! on widened values for larger ones), AVX-VNNI `vpdpbusd` (weights offset by +128, removed
//! with the activation rows' sums), and the wide product (int8 widened to fp32, FMA). Each
//! computes blocks of weight rows × batch rows with every accumulator in a register; the
//! activation rows of a block stay in L1 while the weight rows stream.
//!
//! The AVX2 W8A8 path has two shapes. Small batches (bandwidth bound) walk a tile's rows as
//! far-apart streams, one row of each per block over the whole slice against the whole batch,
//! with no software prefetch (each stream reads consecutive rows, which the hardware
//! prefetchers follow): 4 streams at 1–2 batch rows, 3 at 3 rows, 2 at 4 (so
//! that each `|w|` serves the whole batch and the weights are read once); blocks of adjacent
//! rows streamed at about half the speed on Zen 3. Batches of [`MIN_SETS_BATCH`] rows or more
//! (compute bound: the decode batch of 8, the CSA indexer's query heads) run sets of up to
//! [`G`] batch rows against [`SET_STREAMS`] far-apart weight rows per block, `k` in chunks of
//! [`KC`] bytes so that the chunk's activations stay in L1 through the block's rows, the
//! accumulators kept in memory between chunks and reduced eight at a time by a tree of
//! horizontal adds.
//!
//! The sets multiply 16-bit values: the activations widened once per call (step-major, so a
//! step's rows are adjacent lines), each 32-byte weight vector widened once per step
//! (`vpmovsxbw`) and multiplied against every batch row by `vpmaddwd`. Per batch row and 32
//! weight bytes that is two `vpmaddwd` and two adds, where the sign trick takes `vpsignb`,
//! `vpmaddubsw` and `vpmaddwd` — three instructions on the two multiply pipes of Zen 3 (which
//! also run `vpsignb`/`vpabsb`) — and an add. On Zen 3 (`docs/benchmarks.md`, session 37):
//! 1.17–1.21× the rate of the sign-trick sets with the weights in cache, 1.08–1.10× streamed
//! from memory; whole DeepSeek-V4 steps 1.07× (SWA, HCA) and 1.04× (CSA) faster. The sums are
//! the same exact integers either way. The small batches keep the sign trick: with 1–4 rows
//! a widened weight vector serves too few rows to pay for its widening.

use std::arch::x86_64::*;

use super::{Lowered, LoweredWide, WithActSums};
use crate::gemm::OutMode;
use crate::simd::prefetch_l2;
use crate::simd::{fma_3x4_asm, hsum256};

/// Weight rows per block.
const R: usize = 4;
/// Most batch rows per block (`R * B` accumulators plus the loads fit 16 registers).
const B: usize = 2;
/// Bytes of `k` per step.
const STEP: usize = 32;
/// Smallest batch that takes one pass over the weights per block with every batch row (a
/// batch of 3 in [`R3`] × 3 blocks, 4 in [`R_WIDE`] × [`B_WIDE`]), each `|w|` serving the
/// whole batch, where the [`R`] × [`B`] blocks ran a second pass (from L1) for the third and
/// fourth batch rows and took `|w|` once per pass: on Zen 3, 3 rows per FLASH expert
/// (`[2048, 4096]`) took 0.72–0.86× the thread CPU time and 4 rows 0.80–0.91×
/// (`docs/benchmarks.md`).
const MIN_WIDE_BATCH: usize = 3;
/// Weight rows per block of the batches of 4 rows (and of the wide product from batch 2).
const R_WIDE: usize = 2;
/// Weight rows per block of a batch of 3: three row streams (the 4-row batches' blocks have
/// two) and `3 · 3` accumulators.
const R3: usize = 3;
/// Most batch rows per block of the batches of 4 rows and of the wide product (`R_WIDE *
/// B_WIDE` accumulators, the `B_WIDE` activation vectors, `|w|`, a product and the constant
/// fit 16 registers).
const B_WIDE: usize = 4;
/// Smallest batch of the wide product's assembly blocks ([`wide_streams3x4`], 3 rows × 4
/// batch rows): on Zen 3 (one thread, the 0.6B projections from memory, thread CPU time,
/// alternating) 0.69× the time of the compiled 2 × 4 blocks at batch 16, 0.71× at 8, 0.82× at
/// 4, but 1.11× at 2 and 3 (padded to 4).
const WIDE_ASM_MIN_BATCH: usize = 4;
/// Smallest batch that takes the chunked sets of [`rows_madd16`]: smaller batches stream
/// the weights bandwidth bound, where row blocks over the whole slice prefetching the next
/// block's rows measured 1.2–1.6× faster than the (sign-trick) sets (1–4 rows, `[2048, 4096]`
/// streamed from memory, Zen 3), and the far-apart streams of [`streams`] faster again.
const MIN_SETS_BATCH: usize = 5;
/// Batch rows whose accumulators a block of weight rows keeps between chunks (the decode
/// batch of 8 in one set): with the set's 8 accumulators and the two widened weight halves in
/// registers, a weight row takes one pass per chunk against the whole set.
const G: usize = 8;
/// Far-apart weight rows per block of the sets: each chunk of the set's activations (16 KiB
/// widened) is read from L1 by 8 rows. On Zen 3 (one thread, `[344, 8192]` in cache, rates
/// of alternating runs) 8 streams took 0.92× the time of 4.
const SET_STREAMS: usize = 8;
/// Bytes of `k` per chunk of the sets: the [`G`] batch rows' widened slices of a chunk (16
/// KiB) stay in the 32 KiB L1 through the block's rows. Over whole rows, 8 rows of `K = 4096`
/// (64 KiB widened) would be re-read from L2 for every weight row: 0.61–0.68× the rate in a
/// prototype; chunks of 512 bytes measured 0.96× the rate of 1024.
const KC: usize = 1024;

/// Sum of the eight i32 lanes (wrapping, like the lanes).
#[target_feature(enable = "avx2")]
#[inline]
fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// The sums of eight vectors' lanes, `[sum(v[0]), .., sum(v[7])]` (wrapping, like the lanes):
/// a tree of horizontal adds, seven instructions for eight sums.
#[target_feature(enable = "avx2")]
#[inline]
fn hsum8(v: &[__m256i; 8]) -> __m256i {
    let t0 = _mm256_hadd_epi32(v[0], v[1]);
    let t1 = _mm256_hadd_epi32(v[2], v[3]);
    let t2 = _mm256_hadd_epi32(v[4], v[5]);
    let t3 = _mm256_hadd_epi32(v[6], v[7]);
    // Each 128-bit half of u0 holds a partial sum of each of v[0..4] in order; of u1, of
    // v[4..8].
    let u0 = _mm256_hadd_epi32(t0, t1);
    let u1 = _mm256_hadd_epi32(t2, t3);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(u0, u1),
        _mm256_permute2x128_si256::<0x31>(u0, u1),
    )
}

/// Pointers to `k.start` of `lw`'s weight rows `n0 + rstride * r` (`r < RR`, row-major) and
/// batch rows `b0..b0 + BB`.
#[inline(always)]
fn starts<const RR: usize, const BB: usize>(
    lw: &Lowered<'_>,
    n0: usize,
    rstride: usize,
    b0: usize,
) -> ([*const i8; RR], [*const i8; BB]) {
    let (ldw, k0) = (lw.wa.ldw, lw.k.start);
    (
        std::array::from_fn(|r| lw.w[(n0 + rstride * r) * ldw + k0..].as_ptr()),
        std::array::from_fn(|b| lw.a[(b0 + b) * lw.lda + k0..].as_ptr()),
    )
}

/// W8A8 over a tile's `k` segments (row-major weights). Batches of fewer than
/// [`MIN_SETS_BATCH`] rows stream the weights over the whole slice (bandwidth bound) with
/// `vpmaddubsw` as far-apart row streams: 1 row as [`R`] streams ([`gemv_quarters`]), 2 as
/// [`R`] streams × [`B`] batch rows, 3 as [`R3`] × 3, 4 as [`R_WIDE`] × [`B_WIDE`]
/// ([`streams`]); larger batches take the chunked sets of [`rows_madd16`] (compute bound).
///
/// # Safety
/// AVX2 available; `segs` (at least one) checked by `gemm_i8_w8a8`, weights row-major.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    let first = &segs[0];
    if first.batch < MIN_SETS_BATCH {
        if first.batch == 1 {
            // SAFETY: forwarded contract; batch 1 as checked.
            unsafe { gemv_quarters(segs, out, ld_out) };
            return;
        }
        if first.batch == 3 {
            // SAFETY: forwarded contract; batch 3 as checked.
            unsafe { streams::<R3, 3>(segs, out, ld_out) };
        } else if first.batch >= MIN_WIDE_BATCH {
            // SAFETY: forwarded contract; batch 4 (between 3 and `MIN_SETS_BATCH`).
            unsafe { streams::<R_WIDE, B_WIDE>(segs, out, ld_out) };
        } else {
            // SAFETY: forwarded contract; batch 2 (under `MIN_WIDE_BATCH`, not 1).
            unsafe { streams::<R, B>(segs, out, ld_out) };
        }
        return;
    }
    // Far-apart row streams, as the small batches take them (`streams`), though compute
    // bound: on Zen 3 the sign-trick sets of four streams took 5–7% less time than blocks of
    // adjacent rows at batches 8 and 16, and these 16-bit sets 0.92× the time with eight
    // streams as with four.
    let len = first.n.len() / SET_STREAMS;
    with_wide_acts(segs, |acts| {
        with_staged_out(first, out, ld_out, |out, ld_out| {
            for i in 0..len {
                let n0 = first.n.start + i;
                // SAFETY: rows `n0 + len * r` (r < SET_STREAMS) lie inside the tile; the
                // caller's contract covers the features and the slices; the staged output
                // holds the tile; `acts` holds the segments' activations.
                unsafe { rows_madd16::<SET_STREAMS>(segs, &acts, n0, len, out, ld_out) };
            }
            for n0 in first.n.start + SET_STREAMS * len..first.n.end {
                // SAFETY: row `n0` lies inside the tile; as above.
                unsafe { rows_madd16::<1>(segs, &acts, n0, 1, out, ld_out) };
            }
        });
    });
}

thread_local! {
    /// This thread's staged outputs ([`with_staged_out`]): kept between calls up to
    /// [`STAGED_KEEP`] values, so a step's tiles reuse one buffer and a rare huge tile does not
    /// hold its memory for the thread's life.
    static STAGED_OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Most staged values a thread keeps after a call (2 MiB: a runtime tile of int8 weights at
/// the decode batches stages ~40 KiB, a whole FLASH `Wq_b` at 8 rows ~1 MiB).
const STAGED_KEEP: usize = 1 << 19;

/// Runs `f` on a copy of the tile's outputs (`lw.batch` rows of `lw.n.len()` values) whose row
/// stride is an odd number of 64-byte lines, then copies them into `out`; with `Add`, the
/// copy starts from `out`'s values, so every element sees the same operations in the same
/// order as in place (the same bits). With `Store` the copy starts with whatever an earlier
/// call left: `f` writes every element of the tile, as the sets do.
///
/// Why: a block of [`rows_madd16`] finishes [`SET_STREAMS`] far-apart rows for every batch
/// row, one scalar store each. With `ld_out` a multiple of 1024 values (a whole FLASH matrix
/// in one call) and streams a multiple of 1024 rows apart, all the stores of a block (32 with
/// the four streams this was measured with, 64 now) fall into one set of the 8-way L1 and
/// evict each other. At `K = 1024` (`Wq_b`, and each group of the grouped `Wo_b`)
/// that cost a sixth of the product's time on Zen 3 (`examples/gemm_i8_batch8`, one thread,
/// alternating rounds: 0.83–0.89× the time with the staging at `[8192 | 32768, 1024]`, 0.98×
/// at `K` 4096 and 8192; `docs/benchmarks.md`, session 35).
fn with_staged_out(
    lw: &Lowered<'_>,
    out: &mut [f32],
    ld_out: usize,
    f: impl FnOnce(&mut [f32], usize),
) {
    let n = lw.n.len();
    // Rows in place do not overlap (checked for every call of more than one row), so the
    // copy computes what writing in place would.
    debug_assert!(lw.batch == 1 || ld_out >= n);
    // An odd number of 64-byte lines: the batch rows start in different L1 sets.
    let ld = (n.div_ceil(16) | 1) * 16;
    STAGED_OUT.with_borrow_mut(|staged| {
        if staged.len() < lw.batch * ld {
            staged.resize(lw.batch * ld, 0.0);
        }
        let rows = |stride| (0..lw.batch).map(move |b| b * stride..b * stride + n);
        if lw.mode == OutMode::Add {
            for (t, o) in rows(ld).zip(rows(ld_out)) {
                staged[t].copy_from_slice(&out[o]);
            }
        }
        f(staged, ld);
        for (t, o) in rows(ld).zip(rows(ld_out)) {
            out[o].copy_from_slice(&staged[t]);
        }
        if staged.len() > STAGED_KEEP {
            *staged = Vec::new();
        }
    });
}

/// `sums[r][b]` = the body of rows `n0 + rstride * r` × batch rows `b0 + b` (`r < RR`, `b <
/// BB`), the whole slice in one pass. `MEM_W`: the weight vector as a memory operand
/// ([`step_row`]), which leaves a register free for a fourth batch row's activations.
///
/// No software prefetch: the streams' rows are consecutive memory, which the hardware
/// prefetchers follow. A prefetch of each stream's next row, a line every other step, cost
/// issue slots in these co-bound loops: on Zen 3 whole DeepSeek-V4 MoE steps (3-row experts)
/// took 0.978–0.984× the time without it (three runs of 20–30 paired steps, `docs/benchmarks.md`,
/// session 37), Qwen3 int8 steps 0.998× at 1 × 256 and 0.991× at 4 × 1024 (session 36).
///
/// # Safety
/// AVX2 available; the rows lie inside the tile of a checked `lw`; `RR <= RM`, `BB <= BM`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block_into<
    const RR: usize,
    const BB: usize,
    const RM: usize,
    const BM: usize,
    const MEM_W: bool,
>(
    lw: &Lowered<'_>,
    n0: usize,
    rstride: usize,
    b0: usize,
    sums: &mut [[i32; BM]; RM],
) {
    let steps = lw.k.len() / STEP;
    let (wp, ap) = starts::<RR, BB>(lw, n0, rstride, b0);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_si256(); BB]; RR];
    for s in 0..steps {
        // SAFETY: `s * STEP + STEP <= k.len()`, and each row holds `k.end - k.start` values
        // from its start pointer (rows lie inside their slices: checked by the caller).
        let a: [__m256i; BB] =
            std::array::from_fn(|b| unsafe { _mm256_loadu_si256(ap[b].add(s * STEP).cast()) });
        for r in 0..RR {
            if MEM_W {
                // SAFETY: as above: 32 bytes of row `r` at step `s`.
                unsafe { step_row(wp[r], s * STEP, &a, ones, &mut acc[r]) };
                continue;
            }
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

/// The segments' activations widened to i16 ([`with_wide_acts`]).
struct WideActs {
    /// The first segment's values; each segment's follow the one before.
    base: *const i16,
}

/// Values a segment of `batch` rows takes in the widened layout: per set of up to [`G`] batch
/// rows, its rows' 32 values of each whole step of the body next to each other.
fn wide_len(lw: &Lowered<'_>) -> usize {
    lw.batch * (lw.k.len() / STEP) * STEP
}

thread_local! {
    /// This thread's widened activations ([`with_wide_acts`]), kept between calls up to
    /// [`WIDE_KEEP`] values.
    static WIDE_ACTS: std::cell::RefCell<Vec<i16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Most widened values a thread keeps after a call (1 MiB).
const WIDE_KEEP: usize = 1 << 19;

/// Runs `f` with the segments' activations widened to i16, step-major: segment after segment
/// ([`wide_len`] values each), in a segment set after set of up to [`G`] batch rows, in a set
/// step after step (`STEP` values of `k`), in a step the set's rows one after the other; 64-byte
/// aligned, so that each row's step is one cache line and a step's rows are adjacent lines.
#[target_feature(enable = "avx2")]
fn with_wide_acts(segs: &[Lowered<'_>], f: impl FnOnce(WideActs)) {
    let need: usize = segs.iter().map(wide_len).sum::<usize>() + 32;
    WIDE_ACTS.with_borrow_mut(|buf| {
        if buf.len() < need {
            buf.resize(need, 0);
        }
        let skip = buf.as_ptr().align_offset(64).min(31);
        let mut o = skip;
        for lw in segs {
            let steps = lw.k.len() / STEP;
            let mut g0 = 0;
            while g0 < lw.batch {
                let gb = (lw.batch - g0).min(G);
                for s in 0..steps {
                    for b in 0..gb {
                        let src = &lw.a[(g0 + b) * lw.lda + lw.k.start + s * STEP..][..STEP];
                        let dst = &mut buf[o + (s * gb + b) * STEP..][..STEP];
                        // SAFETY: `src` holds 32 bytes, `dst` room for 32 values (sliced just
                        // above).
                        unsafe {
                            let p = src.as_ptr();
                            let lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast()));
                            let hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(16).cast()));
                            _mm256_storeu_si256(dst.as_mut_ptr().cast(), lo);
                            _mm256_storeu_si256(dst.as_mut_ptr().add(16).cast(), hi);
                        }
                    }
                }
                o += gb * steps * STEP;
                g0 += gb;
            }
        }
        f(WideActs {
            base: buf[skip..].as_ptr(),
        });
        if buf.len() > WIDE_KEEP {
            buf.truncate(WIDE_KEEP);
            buf.shrink_to_fit();
        }
    });
}

/// Weight rows `n0 + rs * r` (`r < RR`) against every batch row, finished into `out`: per
/// segment, the batch in sets of up to [`G`] rows; per set, `k` in chunks of [`KC`] bytes,
/// each weight row in one pass over the chunk against the whole set ([`chunk_madd16`]) while
/// the chunk's widened activations stay in L1; the vector accumulators of the set wait in
/// memory between chunks, so the integer sums are those of one pass over the whole slice.
///
/// Each row's pass prefetches (into L2) the row a chunk ahead: during a segment's last chunk
/// the same row's first chunk of the next segment (grouped activations cut `k` into segments
/// of one chunk each, so without this every segment began on demand misses), and during the
/// last segment's last chunk the next block's first chunk (the streams' next rows, or the
/// rows after the streams, or the caller's next rows, [`super::NextRows`]). AMD fills L1 on
/// every prefetch level, and prefetching the next block's rows at the step's own offset (the
/// small-batch blocks' way) evicted the chunk in use (measured 10–16% slower at batch 8 with
/// the sign-trick sets). One prefetch per 64-byte line.
///
/// # Safety
/// AVX2 available; rows `n0 + rs * r` (`r < RR`) lie inside the tile of checked, row-major
/// segments; `acts` holds the segments' activations ([`with_wide_acts`]).
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_madd16<const RR: usize>(
    segs: &[Lowered<'_>],
    acts: &WideActs,
    n0: usize,
    rs: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    let k_first = segs[0].k.start;
    let mut seg_base = acts.base;
    for (si, lw) in segs.iter().enumerate() {
        let body = lw.k.len() / STEP * STEP;
        let tail = lw.k.start + body..lw.k.end;
        // The first chunk streamed after this segment: with a segment after it (grouped
        // activations), this block's rows from that segment's start; after the last, the
        // next block's first chunk, past the tile's end the caller's next rows (row-major
        // ones; else this block's own).
        let next: [*const i8; RR] = std::array::from_fn(|r| {
            if let Some(s) = segs.get(si + 1) {
                return lw.w_ptr(n0 + r * rs, s.k.start);
            }
            let n = if rs == 1 {
                n0 + RR + r
            } else if n0 + 1 == lw.n.start + rs {
                // The streams' last block: the rows after them (or the caller's next rows).
                lw.n.start + RR * rs + r
            } else {
                n0 + 1 + r * rs
            };
            if n < lw.n.end {
                lw.w_ptr(n, k_first)
            } else {
                lw.next
                    .and_then(|nx| nx.row(n - lw.n.end, k_first))
                    .filter(|&(_, stride)| stride == 64)
                    .map_or(lw.w_ptr(n0 + r * rs, k_first), |(p, _)| p)
            }
        });
        let mut g0 = 0;
        while g0 < lw.batch {
            let gb = (lw.batch - g0).min(G);
            let set_base = seg_base.wrapping_add(g0 * body);
            let mut acc = [[_mm256_setzero_si256(); G]; RR];
            let mut kc = 0;
            while kc < body {
                let len = KC.min(body - kc);
                let k0 = lw.k.start + kc;
                let steps = len / STEP;
                let a = set_base.wrapping_add(kc * gb);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let pf = if kc + KC < body {
                        lw.w_ptr(n0 + r * rs, k0).wrapping_add(KC)
                    } else {
                        next[r]
                    };
                    let w = lw.w_ptr(n0 + r * rs, k0);
                    // SAFETY: row `n0 + rs * r` holds `len` bytes from `k0` (inside the tile's
                    // `k`); `a` holds the set's `steps` steps widened.
                    unsafe {
                        match gb {
                            1 => chunk_madd16::<1>(w, a, steps, pf, acc),
                            2 => chunk_madd16::<2>(w, a, steps, pf, acc),
                            3 => chunk_madd16::<3>(w, a, steps, pf, acc),
                            4 => chunk_madd16::<4>(w, a, steps, pf, acc),
                            5 => chunk_madd16::<5>(w, a, steps, pf, acc),
                            6 => chunk_madd16::<6>(w, a, steps, pf, acc),
                            7 => chunk_madd16::<7>(w, a, steps, pf, acc),
                            _ => chunk_madd16::<G>(w, a, steps, pf, acc),
                        }
                    }
                }
                kc += len;
            }
            finish_set(lw, &acc, n0, rs, g0, gb, &tail, out, ld_out);
            g0 += gb;
        }
        seg_base = seg_base.wrapping_add(wide_len(lw));
    }
}

/// One chunk of `steps` steps of one weight row `w` against `BB` batch rows widened
/// step-major at `a` ([`with_wide_acts`]), added to `acc[..BB]`, with an L2 prefetch at `pf`
/// every other step.
///
/// # Safety
/// AVX2 available; `w` holds `steps * STEP` bytes, `a` `steps * BB * STEP` values.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn chunk_madd16<const BB: usize>(
    w: *const i8,
    a: *const i16,
    steps: usize,
    pf: *const i8,
    acc: &mut [__m256i; G],
) {
    let mut v: [__m256i; BB] = std::array::from_fn(|b| acc[b]);
    for s in 0..steps {
        if s.is_multiple_of(2) {
            prefetch_l2(pf.wrapping_add(s * STEP));
        }
        // SAFETY: 32 bytes of the row at step `s` (contract).
        let (w0, w1) = unsafe {
            let p = w.add(s * STEP);
            (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast())),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(16).cast())),
            )
        };
        for (b, v) in v.iter_mut().enumerate() {
            // SAFETY: 32 values of batch row `b` at step `s` (contract).
            let (a0, a1) = unsafe {
                let p = a.add((s * BB + b) * STEP);
                (
                    _mm256_loadu_si256(p.cast()),
                    _mm256_loadu_si256(p.add(16).cast()),
                )
            };
            let x = _mm256_add_epi32(_mm256_madd_epi16(w0, a0), _mm256_madd_epi16(w1, a1));
            *v = _mm256_add_epi32(*v, x);
        }
    }
    acc[..BB].copy_from_slice(&v);
}

/// Finishes a set's sums (`acc[r][b]`: weight row `n0 + rs * r`, batch row `g0 + b`, `b <
/// gb`; the rest zero) into `out`, adding each slice's scalar `tail`. Without a tail, eight
/// batch rows at a time whether the set is whole or not: at 6 rows (a FLASH expert from
/// memory, one thread) 0.98–0.99× the time of finishing a partial set row by row.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn finish_set<const RR: usize>(
    lw: &Lowered<'_>,
    acc: &[[__m256i; G]; RR],
    n0: usize,
    rs: usize,
    g0: usize,
    gb: usize,
    tail: &std::ops::Range<usize>,
    out: &mut [f32],
    ld_out: usize,
) {
    if tail.is_empty() {
        // A partial set's missing rows (`b >= gb`) sum to zero in `acc` and are not stored.
        let sa: [f32; G] = std::array::from_fn(|b| {
            if b < gb {
                lw.sa[(g0 + b) * lw.groups + lw.group]
            } else {
                0.0
            }
        });
        // SAFETY: eight f32 in `sa`.
        let sa = unsafe { _mm256_loadu_ps(sa.as_ptr()) };
        for (r, acc) in acc.iter().enumerate() {
            // The same expression as `Lowered::finish`, eight batch rows at a time.
            let sw = _mm256_set1_ps(lw.sw[n0 + r * rs]);
            let v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hsum8(acc)), sw), sa);
            let mut vs = [0.0f32; G];
            // SAFETY: room for eight f32 in `vs`.
            unsafe { _mm256_storeu_ps(vs.as_mut_ptr(), v) };
            for (b, &v) in vs.iter().enumerate().take(gb) {
                let o = &mut out[(g0 + b) * ld_out + (n0 + r * rs - lw.n.start)];
                match lw.mode {
                    OutMode::Store => *o = v,
                    OutMode::Add => *o += v,
                }
            }
        }
    } else {
        for (r, acc) in acc.iter().enumerate() {
            for (b, &v) in acc.iter().enumerate().take(gb) {
                let t = lw.dot(n0 + r * rs, g0 + b, tail.clone());
                lw.finish(
                    out,
                    ld_out,
                    n0 + r * rs,
                    g0 + b,
                    hsum_epi32(v).wrapping_add(t),
                );
            }
        }
    }
}

/// `acc[b] += w · a[b]` (pairs of products summed to i16, then to i32 lanes) for the 32
/// weight bytes at `w + off` and each batch vector: `|w| · sign(a, w) = w · a`, pairs at most
/// `2 · 128 · 127` in i16 (`a != -128`).
///
/// The weight vector is read as a memory operand of `vpabsb` and of each `vpsignb` instead of
/// being loaded into a register once (the compiler merges reads of one address, hence the
/// assembly): Zen 3 issues at most 6 macro-ops per cycle, and a step of 4 rows × 2 batch
/// rows counts 45 of them this way against 49 with the loads (with the prefetches the
/// blocks then issued, and the loop), while the vector pipes see the same work either way.
///
/// # Safety
/// AVX2 available; 32 bytes readable at `w + off`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn step_row<const BB: usize>(
    w: *const i8,
    off: usize,
    a: &[__m256i; BB],
    ones: __m256i,
    acc: &mut [__m256i; BB],
) {
    let w_abs: __m256i;
    // SAFETY: 32 bytes are readable at `w + off` (contract); AVX2 is available; the block
    // reads memory only, writes only its register operands and leaves the flags alone.
    unsafe {
        std::arch::asm!(
            "vpabsb {wa}, ymmword ptr [{w} + {o}]",
            w = in(reg) w,
            o = in(reg) off,
            wa = out(ymm_reg) w_abs,
            options(pure, readonly, nostack, preserves_flags),
        );
    }
    for b in 0..BB {
        let t: __m256i;
        // SAFETY: as above.
        unsafe {
            std::arch::asm!(
                "vpsignb {t}, {a}, ymmword ptr [{w} + {o}]",
                w = in(reg) w,
                o = in(reg) off,
                a = in(ymm_reg) a[b],
                t = out(ymm_reg) t,
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        let p = _mm256_maddubs_epi16(w_abs, t);
        acc[b] = _mm256_add_epi32(acc[b], _mm256_madd_epi16(p, ones));
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

/// `sums[r][b]` as [`block_into`], with `vpdpbusd` of `w + 128` against the activations
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
    let (wp, ap) = starts::<RR, BB>(lw, n0, 1, b0);
    let flip = _mm256_set1_epi8(i8::MIN);
    let mut acc = [[_mm256_setzero_si256(); BB]; RR];
    for s in 0..steps {
        let w: [__m256i; RR] = std::array::from_fn(|r| {
            // The same row of the next block, one block ahead (module docs of `gemm_i8`).
            prefetch_l2(wp[r].wrapping_add(RR * lw.wa.ldw + s * STEP));
            // SAFETY: as in `block_into`.
            _mm256_xor_si256(
                unsafe { _mm256_loadu_si256(wp[r].add(s * STEP).cast()) },
                flip,
            )
        });
        for b in 0..BB {
            // SAFETY: as in `block_into`.
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

/// Wide product: int8 widened to fp32 (`vpmovsxbd`, `vcvtdq2ps`), FMA against fp32 rows; the
/// tile's rows as far-apart streams: four at batch 1 and two against groups of up to four
/// batch rows at 2–3 ([`wide_streams`]), three in an assembly loop against groups of four
/// from batch [`WIDE_ASM_MIN_BATCH`] ([`wide_streams3x4`]); each widened weight vector feeds
/// every batch row of its group. On Zen 3 (one thread, the 0.6B projections from memory,
/// thread CPU time, alternating) the far-apart compiled blocks took 0.70× the time of the
/// blocks of 4 adjacent rows × 2 batch rows at batch 1, 0.86× at 4 and 0.94× at 16; compiled
/// 3 × 4 or 2 × 6 blocks spill (1.2× slower), hence the assembly (`docs/benchmarks.md`).
///
/// # Safety
/// AVX2 and FMA available; `lw` checked by `gemm_i8_wide`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn gemm_wide(lw: &LoweredWide<'_>, out: &mut [f32], ld_out: usize) {
    // SAFETY: forwarded contract.
    unsafe {
        if lw.batch == 1 {
            wide_streams::<R, 1>(lw, out, ld_out);
        } else if lw.batch >= WIDE_ASM_MIN_BATCH {
            wide_streams3x4(lw, out, ld_out);
        } else {
            wide_streams::<R_WIDE, B_WIDE>(lw, out, ld_out);
        }
    }
}

/// Batch 1: the tile's rows as [`R`] contiguous ranges walked side by side, one row of each
/// per block (each stream reads consecutive rows), every
/// segment of a block's rows before the next block; the `rows % R` rows left over one at a
/// time. On Zen 3 (one thread, `[3072, 1024]` from memory, alternating) blocks of four
/// adjacent rows streamed 5.8–6.1 GB/s, the four far-apart streams 12.3–13.7 GB/s, as fast
/// as the bf16 pass (so int8 halves the time); prefetch distances and hints on the adjacent
/// rows had changed nothing.
///
/// # Safety
/// AVX2 available; `segs` (at least one) checked by `gemm_i8_w8a8`, weights row-major, batch 1.
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_quarters(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    let first = &segs[0];
    let len = first.n.len() / R;
    let mut run = |n0: usize, nr: usize, rstride: usize| {
        for lw in segs {
            let tail = lw.k.start + lw.k.len() / STEP * STEP..lw.k.end;
            let mut sums = [[0i32; B]; R];
            if nr == R {
                // SAFETY: rows n0 + rstride * r (r < R) lie inside the tile; the caller's
                // contract covers the rest.
                unsafe { block_into::<R, 1, R, B, false>(lw, n0, rstride, 0, &mut sums) };
            } else {
                // SAFETY: row n0 lies inside the tile; as above.
                unsafe { block_into::<1, 1, R, B, false>(lw, n0, 1, 0, &mut sums) };
            }
            for (r, row) in sums.iter().enumerate().take(nr) {
                let n = n0 + rstride * r;
                let t = if tail.is_empty() {
                    0
                } else {
                    lw.dot(n, 0, tail.clone())
                };
                lw.finish(out, ld_out, n, 0, row[0] + t);
            }
        }
    };
    for i in 0..len {
        run(first.n.start + i, R, len);
    }
    for n in first.n.start + R * len..first.n.end {
        run(n, 1, 1);
    }
}

/// Batches of 2–4 (`BM` rows): the tile's rows as `RR` contiguous ranges walked side by side,
/// one row of each per block against the whole batch (each stream reads consecutive rows), as
/// [`gemv_quarters`] does for one batch row; the `rows % RR` rows
/// left over one at a time. On Zen 3 (one thread, the 0.6B projections from memory, thread
/// CPU time, alternating) this took 0.51× the time of blocks of adjacent rows at batch 2,
/// 0.64× at 3 and 0.71× at 4 (`docs/benchmarks.md`).
///
/// # Safety
/// AVX2 available; `segs` (at least one) checked by `gemm_i8_w8a8`, weights row-major,
/// batch `BM`.
#[target_feature(enable = "avx2,fma")]
unsafe fn streams<const RR: usize, const BM: usize>(
    segs: &[Lowered<'_>],
    out: &mut [f32],
    ld_out: usize,
) {
    let first = &segs[0];
    debug_assert_eq!(first.batch, BM);
    let len = first.n.len() / RR;
    let mut run = |n0: usize, nr: usize, rstride: usize| {
        for lw in segs {
            let tail = lw.k.start + lw.k.len() / STEP * STEP..lw.k.end;
            let mut sums = [[0i32; BM]; RR];
            if nr == RR {
                // SAFETY: rows n0 + rstride * r (r < RR) lie inside the tile, the batch is
                // `BM` rows; the caller's contract covers the rest.
                unsafe { block_into::<RR, BM, RR, BM, true>(lw, n0, rstride, 0, &mut sums) };
            } else {
                // SAFETY: row n0 lies inside the tile; as above.
                unsafe { block_into::<1, BM, RR, BM, true>(lw, n0, 1, 0, &mut sums) };
            }
            for (r, row) in sums.iter().enumerate().take(nr) {
                let n = n0 + rstride * r;
                for (b, &v) in row.iter().enumerate() {
                    let t = if tail.is_empty() {
                        0
                    } else {
                        lw.dot(n, b, tail.clone())
                    };
                    lw.finish(out, ld_out, n, b, v.wrapping_add(t));
                }
            }
        }
    };
    for i in 0..len {
        run(first.n.start + i, RR, len);
    }
    for n in first.n.start + RR * len..first.n.end {
        run(n, 1, 1);
    }
}

/// The wide product over a tile's rows as `RR` far-apart streams (contiguous ranges walked
/// side by side, each prefetching its next row), one row of each per block
/// against the batch in groups of up to `BM` rows (each widened weight vector feeding `BM`
/// FMAs); the `rows % RR` rows left over one at a time.
///
/// # Safety
/// AVX2 and FMA available; `lw` checked by `gemm_i8_wide`.
#[target_feature(enable = "avx2,fma")]
unsafe fn wide_streams<const RR: usize, const BM: usize>(
    lw: &LoweredWide<'_>,
    out: &mut [f32],
    ld_out: usize,
) {
    let len = lw.n.len() / RR;
    let tail = lw.k.start + lw.k.len() / 8 * 8..lw.k.end;
    let mut run = |n0: usize, nr: usize, rstride: usize| {
        let mut b0 = 0;
        while b0 < lw.batch {
            let bb = (lw.batch - b0).min(BM);
            let mut sums = [[0.0f32; BM]; RR];
            macro_rules! go {
                ($($b:literal),*) => {
                    match (nr == RR, bb) {
                        $(
                            // SAFETY: rows n0 + rstride * r (r < nr) and batch rows b0..b0+bb
                            // lie inside the tile; the caller's contract covers the rest.
                            (true, $b) if $b <= BM => unsafe {
                                block_wide_s::<RR, $b, RR, BM>(lw, n0, rstride, b0, &mut sums)
                            },
                            // SAFETY: as above, one row.
                            (false, $b) if $b <= BM => unsafe {
                                block_wide_s::<1, $b, RR, BM>(lw, n0, 1, b0, &mut sums)
                            },
                        )*
                        _ => unreachable!("wide block {nr} x {bb}"),
                    }
                };
            }
            go!(1, 2, 3, 4, 5, 6);
            for (r, row) in sums.iter().enumerate().take(nr) {
                let n = n0 + rstride * r;
                for (b, &v) in row.iter().enumerate().take(bb) {
                    let t = if tail.is_empty() {
                        0.0
                    } else {
                        lw.dot(n, b0 + b, tail.clone())
                    };
                    lw.finish(out, ld_out, n, b0 + b, v + t);
                }
            }
            b0 += bb;
        }
    };
    for i in 0..len {
        run(lw.n.start + i, RR, len);
    }
    for n in lw.n.start + RR * len..lw.n.end {
        run(n, 1, 1);
    }
}

/// `sums[r][b]` of the body in steps of 8 for rows `n0 + rstride * r` (`r < RR`) and batch
/// rows `b0 + b` (`b < BB`); each step prefetches the stream's next row (adjacent rows: the
/// next block's), a line per 64 bytes.
///
/// # Safety
/// AVX2 and FMA available; the rows and batch rows lie inside the tile of a checked `lw`;
/// `RR <= RM`, `BB <= BM`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block_wide_s<const RR: usize, const BB: usize, const RM: usize, const BM: usize>(
    lw: &LoweredWide<'_>,
    n0: usize,
    rstride: usize,
    b0: usize,
    sums: &mut [[f32; BM]; RM],
) {
    let steps = lw.k.len() / 8;
    let k0 = lw.k.start;
    let wp: [*const i8; RR] =
        std::array::from_fn(|r| lw.w[(n0 + rstride * r) * lw.ldw + k0..].as_ptr());
    let xp: [*const f32; BB] = std::array::from_fn(|b| lw.x[(b0 + b) * lw.ldx + k0..].as_ptr());
    let ahead = if rstride == 1 { RR } else { 1 } * lw.ldw;
    let mut acc = [[_mm256_setzero_ps(); BB]; RR];
    for s in 0..steps {
        for r in 0..RR {
            if s % 8 == 0 {
                prefetch_l2(wp[r].wrapping_add(ahead + s * 8));
            }
            // SAFETY: `s * 8 + 8 <= k.len()` bytes lie after each row's start pointer.
            let w8 = unsafe { _mm_loadl_epi64(wp[r].add(s * 8).cast()) };
            let wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8));
            for b in 0..BB {
                // SAFETY: as above, 8 values of batch row b0 + b.
                let x = unsafe { _mm256_loadu_ps(xp[b].add(s * 8)) };
                acc[r][b] = _mm256_fmadd_ps(wf, x, acc[r][b]);
            }
        }
    }
    for r in 0..RR {
        for b in 0..BB {
            sums[r][b] = hsum256(acc[r][b]);
        }
    }
}

/// One 8-element step of [`wide_acc`] at byte displacements `$wd` (weights) and `$xd`
/// (activations) from the loop position: three weight rows widened (`vpmovsxbd`,
/// `vcvtdq2ps`), each fed to four batch rows' FMAs (accumulator `ymm(4 r + b)`).
macro_rules! wide_step {
    ($wd:literal, $xd:literal) => {
        concat!(
            "vpmovsxbd ymm12, qword ptr [{w0} + {k} + ",
            $wd,
            "]\n",
            "vpmovsxbd ymm13, qword ptr [{w1} + {k} + ",
            $wd,
            "]\n",
            "vpmovsxbd ymm14, qword ptr [{w2} + {k} + ",
            $wd,
            "]\n",
            "vcvtdq2ps ymm12, ymm12\n",
            "vcvtdq2ps ymm13, ymm13\n",
            "vcvtdq2ps ymm14, ymm14\n",
            fma_3x4_asm!($xd),
        )
    };
}

/// `acc[4 r + b]` += the lane-wise products of weight row `w[r]` (int8, widened) and batch
/// row `x[b]` over the `len` elements before each pointer (`len` a multiple of 8), three rows
/// × four batch rows with all twelve accumulators in registers (the compiled loop spilled
/// them); each stream prefetches the line at `pf[r] - len + 64 i` per 64 elements.
///
/// # Safety
/// AVX2 and FMA available; the `len` bytes before each `w[r]` and the `len` f32 before each
/// `x[b]` are readable; `len` is a multiple of 8. `pf` may point anywhere.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn wide_acc(
    acc: &mut [__m256; 12],
    w: [*const i8; 3],
    pf: [*const i8; 3],
    x: [*const f32; 4],
    len: usize,
) {
    let [
        mut a0,
        mut a1,
        mut a2,
        mut a3,
        mut a4,
        mut a5,
        mut a6,
        mut a7,
        mut a8,
        mut a9,
        mut a10,
        mut a11,
    ] = *acc;
    // The loop covers the first `len / 64 * 64` elements counting up from minus that to 0
    // (one register indexes every stream, the loop ends on its own increment's flags); the
    // rest, 8 at a time, from pointers moved back by it.
    let main = len / 64 * 64;
    let rest = len - main;
    // SAFETY: every load is at `p + k*scale + d` for a stream end `p` moved back by `rest`,
    // with the element offset in `[-main, 0)` in the loop and `[0, rest)` in the tail,
    // relative to `end - rest`: inside the `len` elements before the stream end, readable by
    // the contract. Prefetches may point anywhere. Only ymm0–15 and the two counters are
    // written, all declared; no stack, no memory writes.
    unsafe {
        std::arch::asm!(
            "test {k}, {k}",
            "jz 3f",
            "2:",
            "prefetcht0 [{p0} + {k}]",
            "prefetcht0 [{p1} + {k}]",
            "prefetcht0 [{p2} + {k}]",
            wide_step!("0", "0"),
            wide_step!("8", "32"),
            wide_step!("16", "64"),
            wide_step!("24", "96"),
            wide_step!("32", "128"),
            wide_step!("40", "160"),
            wide_step!("48", "192"),
            wide_step!("56", "224"),
            "add {k}, 64",
            "jnz 2b",
            "3:",
            "test {t}, {t}",
            "jz 5f",
            "4:",
            wide_step!("0", "0"),
            "add {k}, 8",
            "cmp {k}, {t}",
            "jb 4b",
            "5:",
            k = inout(reg) -(main as isize) => _,
            t = in(reg) rest,
            w0 = in(reg) w[0].wrapping_sub(rest),
            w1 = in(reg) w[1].wrapping_sub(rest),
            w2 = in(reg) w[2].wrapping_sub(rest),
            p0 = in(reg) pf[0].wrapping_sub(rest),
            p1 = in(reg) pf[1].wrapping_sub(rest),
            p2 = in(reg) pf[2].wrapping_sub(rest),
            x0 = in(reg) x[0].wrapping_sub(rest),
            x1 = in(reg) x[1].wrapping_sub(rest),
            x2 = in(reg) x[2].wrapping_sub(rest),
            x3 = in(reg) x[3].wrapping_sub(rest),
            inout("ymm0") a0, inout("ymm1") a1, inout("ymm2") a2, inout("ymm3") a3,
            inout("ymm4") a4, inout("ymm5") a5, inout("ymm6") a6, inout("ymm7") a7,
            inout("ymm8") a8, inout("ymm9") a9, inout("ymm10") a10, inout("ymm11") a11,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack, readonly),
        );
    }
    *acc = [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11];
}

/// The wide product from batch [`WIDE_ASM_MIN_BATCH`]: the tile's rows as three far-apart
/// streams, one row of each per pass against the batch in groups of four (a last group of
/// three repeats its last row and drops those sums) in the assembly loop of [`wide_acc`]; a
/// last group of one or two batch rows, and the rows left over after whole streams, take
/// [`block_wide_s`].
///
/// # Safety
/// AVX2 and FMA available; `lw` checked by `gemm_i8_wide`.
#[target_feature(enable = "avx2,fma")]
unsafe fn wide_streams3x4(lw: &LoweredWide<'_>, out: &mut [f32], ld_out: usize) {
    let len = lw.n.len() / 3;
    let body = lw.k.len() / 8 * 8;
    let tail = lw.k.start + body..lw.k.end;
    let k0 = lw.k.start;
    for i in 0..len {
        let rows: [usize; 3] = std::array::from_fn(|r| lw.n.start + i + r * len);
        let w: [&[i8]; 3] = rows.map(|n| &lw.w[n * lw.ldw + k0..n * lw.ldw + k0 + body]);
        // Each stream's next row (the rows of a stream lie back to back).
        let pf = w.map(|row| row.as_ptr_range().end.wrapping_add(lw.ldw));
        let mut b0 = 0;
        while b0 < lw.batch {
            let bv = (lw.batch - b0).min(4);
            if bv < 3 {
                // One or two batch rows left: the compiled blocks (padding them to four in
                // the loop costs more than it saves).
                let mut sums = [[0.0f32; B_WIDE]; 3];
                // SAFETY: rows `rows` and batch rows b0..b0+bv lie inside the tile.
                unsafe {
                    if bv == 1 {
                        block_wide_s::<3, 1, 3, B_WIDE>(lw, rows[0], len, b0, &mut sums);
                    } else {
                        block_wide_s::<3, 2, 3, B_WIDE>(lw, rows[0], len, b0, &mut sums);
                    }
                }
                for (&n, row) in rows.iter().zip(&sums) {
                    for (b, &v) in row.iter().enumerate().take(bv) {
                        let t = if tail.is_empty() {
                            0.0
                        } else {
                            lw.dot(n, b0 + b, tail.clone())
                        };
                        lw.finish(out, ld_out, n, b0 + b, v + t);
                    }
                }
                b0 += bv;
                continue;
            }
            let x: [*const f32; 4] = std::array::from_fn(|b| {
                let at = (b0 + b.min(bv - 1)) * lw.ldx + k0;
                lw.x[at..at + body].as_ptr_range().end
            });
            let mut acc = [_mm256_setzero_ps(); 12];
            // SAFETY: the `body` elements before each stream end are the rows' and batch
            // rows' slices above; `body` is a multiple of 8; AVX2/FMA by the contract.
            unsafe { wide_acc(&mut acc, w.map(|row| row.as_ptr_range().end), pf, x, body) };
            for (r, &n) in rows.iter().enumerate() {
                for b in 0..bv {
                    let t = if tail.is_empty() {
                        0.0
                    } else {
                        lw.dot(n, b0 + b, tail.clone())
                    };
                    lw.finish(out, ld_out, n, b0 + b, hsum256(acc[4 * r + b]) + t);
                }
            }
            b0 += bv;
        }
    }
    for n in lw.n.start + 3 * len..lw.n.end {
        let mut b0 = 0;
        while b0 < lw.batch {
            let bb = (lw.batch - b0).min(B_WIDE);
            let mut sums = [[0.0f32; B_WIDE]; 1];
            // SAFETY: row n and batch rows b0..b0+bb lie inside the tile.
            unsafe {
                match bb {
                    1 => block_wide_s::<1, 1, 1, B_WIDE>(lw, n, 1, b0, &mut sums),
                    2 => block_wide_s::<1, 2, 1, B_WIDE>(lw, n, 1, b0, &mut sums),
                    3 => block_wide_s::<1, 3, 1, B_WIDE>(lw, n, 1, b0, &mut sums),
                    _ => block_wide_s::<1, B_WIDE, 1, B_WIDE>(lw, n, 1, b0, &mut sums),
                }
            }
            for (b, &v) in sums[0].iter().enumerate().take(bb) {
                let t = if tail.is_empty() {
                    0.0
                } else {
                    lw.dot(n, b0 + b, tail.clone())
                };
                lw.finish(out, ld_out, n, b0 + b, v + t);
            }
            b0 += bb;
        }
    }
}
