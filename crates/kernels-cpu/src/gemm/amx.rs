//! AMX-BF16 GEMM path for batched products (batched decode, prefill): `tdpbf16ps` multiplies a
//! 16 × 32 bf16 tile by a 32 × 16 bf16 tile into a 16 × 16 fp32 tile, 8192 multiply-adds per
//! instruction.
//!
//! # Orientation
//! The tile unit computes `C[m, n] += sum_k A[m, k] B[k, n]` with `A` rows contiguous along `k`
//! and `B` in the "VNNI" layout (each row holds, for 16 columns, a pair of neighbouring `k`).
//! Weights are stored `[N, K]`, rows contiguous along `K`, which is exactly an `A` operand: so
//! this path computes the transposed product `C[n, b] = sum_k W[n, k] X[b, k]` with the weights
//! as `A`, read in place from the resident matrix (no weight repacking, the other paths' layout
//! is unchanged), and the activations as `B`. The activations are converted per call from the
//! packed fp32 layout into VNNI tiles (one 16 × 16 transpose of bf16 pairs per tile, in
//! registers) and reused by every weight row of the call; the fp32 results are transposed back
//! on the way out so the output keeps its `[b, n]` layout.
//!
//! # Blocking
//! Four accumulator tiles (`tmm0`–`tmm3`) hold 32 weight rows × 32 batch rows; `tmm4`/`tmm5`
//! take two 16-row weight tiles and `tmm6`/`tmm7` two 16-column activation tiles per 32-element
//! `K` step. A last single 16-column activation tile (batch 16, or an odd count of 16s) runs
//! with two accumulators instead of multiplying a tile of zeros; likewise a group of 16 weight
//! rows or fewer loads and multiplies one weight tile, not a second one of zeros or repeats.
//! That group is common: the runtime's tapered SPMD shares (`write_block_cols`) leave most
//! projection blocks an odd number of 16-row groups; at a prefill's 512 batch rows, where the
//! pass is bound by the tile unit, the wasted half passes were 2–9% of the Qwen3-0.6B
//! projections' tile products (counted over their shares; `docs/benchmarks.md`). Batch rows are
//! taken in blocks whose VNNI copy fits in about half the L2. While a group of 32 weight rows
//! is multiplied, the next group is prefetched into L2 one line per row per step: a tile load
//! gathers a line from each of 16 rows a row stride apart, a pattern the hardware prefetchers
//! follow poorly, and at batch 16 the product is bound by that weight stream. The first group
//! has no pass before it: its lines are prefetched step by step while the activations are
//! converted, so the weight stream starts with the call instead of after the conversion (the
//! decode plan's blocks are 128–512 rows, and the conversion was a stretch of each with no
//! weight traffic: +3.5–8% weights per second of thread CPU time on the AMX paths at batches 4
//! and 16, `docs/benchmarks.md`).
//!
//! # Tiled weights
//! With the tiled layout (`WeightLayout::Tiled`) a weight tile is one 1 KiB block, so the
//! 32-row pass reads two sequential streams (the two 16-row groups) instead of 32 row streams.
//! Each step prefetches each stream's next block into L1 (`TILED_STEP`) rather than the next
//! pair of groups into L2 as the row-major pass does: a probe of bare tile loads on the
//! tiled stream (2 threads, 1.5 GiB) read 31–32 GB/s with the next-groups prefetch, as a plain
//! read of the buffer did, and 34–37 GB/s with the next block in L1. Rows past a group's last
//! row are the layout's zero padding: a short last group is read in place.
//!
//! One batch row on tiled weights takes a pass of its own (`tiled_single_row`): a
//! one-column product needs no VNNI tiles (the row in natural-order bf16, read at a 4-byte
//! stride, is the `B` tile) and its accumulators are single columns, so four of them walk
//! four regions of the tile's groups side by side. That keeps four sequential streams in
//! flight per thread, each prefetched two blocks ahead, as the row-major vector pass keeps
//! four row streams; the two-group pass above, with a VNNI conversion per call and one
//! stream pair, streamed 6–11% slower than the row-major vector pass on the Qwen3 decode
//! plan's ~1 MiB blocks (`docs/performance.md`).
//!
//! # Edges
//! Batch rows past the batch are zero columns of the activation tiles; a last row-major group
//! of other than 16 or 32 weight rows is copied into a zero-padded scratch (16 rows are read in
//! place as one tile; a tiled group is always read in place); a body whose length is an odd
//! multiple of 16 leaves a 16-element strip that is added per output with `vdpbf16ps`; `K`
//! elements outside whole packing blocks go through the shared `edge_sum`.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::{Lowered, PACK_BLOCK, TILE_COLS, TILE_ROWS, edge_sum, finish, tiled_index};

/// Elements of one tiled weight block (16 rows × 32; one tile).
const TILED_BLOCK: usize = TILE_ROWS * TILE_COLS;

/// Bytes a tiled group's stream moves per 32-element step (one block). The tiled passes
/// prefetch each stream's next block into L1 (`prefetcht0`) while multiplying this one; the
/// row-major passes prefetch the next group of rows into L2 (`prefetcht1`). On tiled weights
/// the near L1 prefetch streamed 4–14% faster than the next-group L2 prefetch at batches 8 and
/// 16 (`docs/benchmarks.md`, session 26); on row-major weights it was 5% slower at `K = 1024`.
const TILED_STEP: usize = TILED_BLOCK * 2;

/// Smallest batch that takes this path; smaller batches take the AVX-512 BF16 path. Below
/// it both paths stream the weights at the same rate (a tile is 16 batch columns wide, so the
/// tiles' spare columns cost nothing but the VNNI conversion). From 5 rows on the AVX-512 BF16
/// path runs out of `vdpbf16ps` throughput on this class of host (at 8 rows, 2 threads, it
/// streams at ~14 GB/s against ~22 for the tiles; docs/benchmarks.md), so the tiles take over.
pub(super) const MIN_BATCH: usize = 5;

/// Bytes of VNNI activations one batch block may hold (about half of a 2 MiB L2).
const VNNI_BLOCK_BYTES: usize = 1 << 20;

/// One 64-byte tile row, 64-byte aligned (tile loads and stores are fastest on whole lines).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line([u32; 16]);

const ZERO_LINE: Line = Line([0; 16]);

#[derive(Default)]
struct Scratch {
    /// VNNI activation tiles of the current batch block: tile `(bt, i)` (16 batch columns
    /// `bt`, 32-element `K` step `i`) is the 16 lines at `(bt * nk + i) * 16`.
    vnni: Vec<Line>,
    /// A last group of fewer than 32 weight rows, zero-padded to 32 rows of `k32` elements.
    wtail: Vec<Line>,
    /// The single activation row in natural-order bf16 (the batch-1 pass on tiled weights).
    natural: Vec<u16>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The tile configuration: palette 1, eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

static CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        // colsb (u16, little-endian) of tile t at 16 + 2t; rows of tile t at 48 + t.
        c[16 + 2 * t] = 64;
        c[48 + t] = 16;
        t += 1;
    }
    TileConfig(c)
};

/// The tile configuration every AMX kernel of the crate loads (for the peak measurement).
pub(crate) fn tile_config() -> *const u8 {
    CONFIG.0.as_ptr()
}

/// Whether [`convert`] makes tiles for `batch` rows over a body of `nk` 32-element steps.
pub(super) fn converts(batch: usize, nk: usize) -> bool {
    nk > 0 && batch <= batch_block(nk)
}

/// Batch rows of one batch block (whose VNNI copy is converted at once) for a body of `nk`
/// 32-element steps.
fn batch_block(nk: usize) -> usize {
    (VNNI_BLOCK_BYTES / (nk * 32 * 2) / 32 * 32).max(32)
}

/// The VNNI tiles of every batch row of `lw` over its body, as [`gemm_with`] converts them, into
/// `dst`; false (and `dst` cleared) when the body has no whole 32-element step or the batch
/// does not fit one batch block (then [`gemm_with`] converts per call).
///
/// # Safety
/// As [`gemm_with`] (only the activations of `lw` are read).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn convert(lw: &Lowered<'_>, dst: &mut Vec<Line>) -> bool {
    dst.clear();
    let nk = (lw.kb1 - lw.kb0) / 32;
    if !converts(lw.batch, nk) {
        return false;
    }
    let nbt = lw.batch.div_ceil(16);
    dst.resize(nbt * nk * 16, ZERO_LINE);
    for bt in 0..nbt {
        for i in 0..nk {
            let tile = &mut dst[(bt * nk + i) * 16..(bt * nk + i + 1) * 16];
            // SAFETY: AVX-512 by contract; rows and columns inside the activations.
            unsafe { vnni_tile(lw, bt * 16, lw.batch, lw.kb0 + 32 * i, tile) };
        }
    }
    true
}

/// [`convert`] of fp32 rows in their natural order (`x` `[rows, cols]`) over the whole of
/// `cols`: the same tiles `convert` makes from the packed copy of the same rows (one
/// conversion of the same values, without the packing's permutation), with no packed copy.
/// False (and `dst` cleared) where the rows have no whole 32-element step, `cols` is not made
/// of whole steps, or the batch does not fit one batch block.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL and BF16.
///
/// # Panics
/// If `x` is not `rows · cols` long.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn convert_rows(
    x: &[f32],
    rows: usize,
    cols: usize,
    dst: &mut Vec<Line>,
) -> bool {
    assert_eq!(Some(x.len()), rows.checked_mul(cols), "convert_rows: x len");
    rows_to_tiles(rows, cols, dst, |row, i| {
        let src = &x[row * cols + 32 * i..][..32];
        // SAFETY: `src` is 32 fp32; AVX-512 BF16 by contract (the closure takes this
        // function's features). Words 0-15 are the bf16 of the first 16, 16-31 of the next:
        // the pairs in `K` order.
        unsafe {
            let (v0, v1) = (
                _mm512_loadu_ps(src.as_ptr()),
                _mm512_loadu_ps(src.as_ptr().add(16)),
            );
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(v1, v0))
        }
    })
}

/// [`convert_rows`] of bf16 rows (`x` `[rows, cols]`): 32 bf16 values of a row are already
/// its 16 pairs in `K` order, so each line is one load (no conversion); the same tiles
/// `convert_rows` makes from the same values widened to fp32.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL and BF16.
///
/// # Panics
/// If `x` is not `rows · cols` long.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn convert_rows_bf16(
    x: &[half::bf16],
    rows: usize,
    cols: usize,
    dst: &mut Vec<Line>,
) -> bool {
    assert_eq!(
        Some(x.len()),
        rows.checked_mul(cols),
        "convert_rows_bf16: x len"
    );
    rows_to_tiles(rows, cols, dst, |row, i| {
        let src = &x[row * cols + 32 * i..][..32];
        // SAFETY: `src` is 32 bf16 (64 bytes); AVX-512 F by contract.
        unsafe { _mm512_loadu_si512(src.as_ptr().cast()) }
    })
}

/// The body of [`convert_rows`] and [`convert_rows_bf16`]: `line(row, i)` gives step `i` (32
/// values) of batch row `row` as 16 bf16 pairs; rows past the batch are zero.
///
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn rows_to_tiles(
    rows: usize,
    cols: usize,
    dst: &mut Vec<Line>,
    line: impl Fn(usize, usize) -> __m512i,
) -> bool {
    let nk = cols / 32;
    if nk == 0 || !cols.is_multiple_of(32) || rows > batch_block(nk) {
        dst.clear();
        return false;
    }
    let nbt = rows.div_ceil(16);
    // Every line is written below (rows past the batch as zeros), so what a longer call left
    // is not cleared first.
    dst.resize(nbt * nk * 16, ZERO_LINE);
    for bt in 0..nbt {
        for i in 0..nk {
            let mut r = [_mm512_setzero_si512(); 16];
            for (j, rj) in r.iter_mut().enumerate().take(rows - bt * 16) {
                *rj = line(bt * 16 + j, i);
            }
            transpose16(&mut r);
            let tile = &mut dst[(bt * nk + i) * 16..(bt * nk + i + 1) * 16];
            for (line, v) in tile.iter_mut().zip(r) {
                // SAFETY: a line is 64 bytes, 64-byte aligned.
                unsafe { _mm512_store_si512(line.0.as_mut_ptr().cast(), v) };
            }
        }
    }
    true
}

/// Computes the tile described by `lw` into `out`, with the activations' VNNI tiles taken from
/// `pre` when given (made by [`convert`] for the same activations and body) instead of
/// converted here.
///
/// # Safety
/// The CPU must support AMX-BF16 and AVX-512 F/BW/VL/BF16, Linux must have granted this
/// process the tile state ([`crate::amx::request_tile_permission`]), and `lw` must describe a
/// tile inside its matrices with `out` long enough (as checked by `gemm_dispatch`).
/// `pre`, when given, holds what [`convert`] wrote for `lw`'s activations, batch
/// and body (its length is checked; its values are used as they are).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn gemm_with(
    lw: &Lowered<'_>,
    pre: Option<&[Line]>,
    out: &mut [f32],
    ld_out: usize,
) {
    let klen = lw.kb1 - lw.kb0;
    let nk = klen / 32;
    if nk == 0 {
        // SAFETY: the AVX-512 BF16 path needs a subset of this function's features.
        unsafe { super::avx512::gemm(lw, None, out, ld_out) };
        return;
    }
    if lw.tiled && lw.batch == 1 {
        // SAFETY: forwarded contract; the body holds a whole 32-element step (nk >= 1).
        unsafe { tiled_single_row(lw, out, ld_out) };
        return;
    }
    let k32 = nk * 32;
    let bblock = batch_block(nk);
    let pre = pre.filter(|p| lw.batch <= bblock && p.len() == lw.batch.div_ceil(16) * nk * 16);
    SCRATCH.with(|cell| {
        let mut s = cell.borrow_mut();
        let s = &mut *s;
        // SAFETY: the configuration is a valid palette-1 layout; the tile state was granted
        // (contract). Released below before returning; nothing between uses tiles otherwise.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
        let mut bo = 0;
        while bo < lw.batch {
            let bend = (bo + bblock).min(lw.batch);
            // 16-column activation tiles (the last one zero-padded past the batch).
            let nbt = (bend - bo).div_ceil(16);
            let vnni: &[Line] = match pre {
                // One batch block (checked above): the caller's tiles of the whole batch.
                Some(p) => p,
                None => {
                    s.vnni.resize(nbt * nk * 16, ZERO_LINE);
                    for bt in 0..nbt {
                        for i in 0..nk {
                            if bt == 0 {
                                prefetch_first_group_step(lw, i);
                            }
                            let tile = &mut s.vnni[(bt * nk + i) * 16..(bt * nk + i + 1) * 16];
                            // SAFETY: AVX-512 by contract; rows and columns inside the
                            // activations.
                            unsafe { vnni_tile(lw, bo + bt * 16, bend, lw.kb0 + 32 * i, tile) };
                        }
                    }
                    &s.vnni
                }
            };
            let mut n0 = lw.n.start;
            while n0 < lw.n.end {
                let nr = (lw.n.end - n0).min(32);
                let next = n0 + 32;
                let has_next = next + 32 <= lw.n.end;
                // The step's two weight tiles (rows n0.. and n0 + 16..) and the next group of
                // 32 rows, fetched into L2 while this one is multiplied (tile loads gather 16
                // rows a line apiece, which the hardware prefetchers follow poorly); a shorter
                // last group, or none, fetches this group again (already cached, so nothing
                // moves).
                let t = if lw.tiled {
                    // The blocks of the groups at n0 and n0 + 16 (when that group holds rows of
                    // the tile; else group n0 again, whose products `store_block` leaves
                    // unwritten), `nk` each.
                    let blocks = |n: usize| {
                        let at = tiled_index(n, lw.kb0, lw.ldw);
                        lw.w[at..at + nk * TILED_BLOCK].as_ptr()
                    };
                    let a0 = blocks(n0);
                    let a1 = if nr > 16 { blocks(n0 + 16) } else { a0 };
                    // The next block of each group, into L1 (see `TILED_STEP`).
                    let (p0, p1) = (
                        a0.wrapping_byte_add(TILED_STEP),
                        a1.wrapping_byte_add(TILED_STEP),
                    );
                    WeightTiles {
                        a0,
                        a1,
                        stride: 64,
                        p0,
                        p1,
                        both: nr > 16,
                    }
                } else {
                    let (a, sa) = if nr == 32 || nr == 16 {
                        (lw.w[n0 * lw.ldw + lw.kb0..].as_ptr(), lw.ldw * 2)
                    } else {
                        copy_tail_rows(lw, n0, nr, k32, &mut s.wtail);
                        (s.wtail.as_ptr().cast::<u16>(), k32 * 2)
                    };
                    let pf = if has_next {
                        lw.w[next * lw.ldw + lw.kb0..].as_ptr()
                    } else {
                        a
                    };
                    WeightTiles {
                        a0: a,
                        a1: a.wrapping_byte_add(16 * sa),
                        stride: sa,
                        p0: pf,
                        p1: pf.wrapping_byte_add(16 * sa),
                        both: nr > 16,
                    }
                };
                for bp in (0..nbt).step_by(2) {
                    let mut c = [ZERO_LINE; 64];
                    let tiles = vnni[bp * nk * 16..].as_ptr();
                    // SAFETY: tiled, `a0`, `a1`, `p0` and `p1` each point at `nk` consecutive
                    // 1 KiB blocks inside the weights (sliced above); row-major, `a0` points at
                    // 32 rows (16 when `nr` is 16, and then `both` is false and `a1` is not
                    // loaded) of at least k32 elements at stride `sa` bytes (the weight rows
                    // n0..n0+nr from kb0, inside the matrix since kb0 + k32 <= kb1 <= ldw, or
                    // the padded copy) and `a1` at its row 16, and `p0`/`p1` are only
                    // prefetched (the next rows, or `a0`/`a1` themselves); the VNNI tiles (bp,
                    // 0..nk), and (bp + 1, 0..nk) when bp + 1 < nbt, exist. Only the first pass
                    // over the group prefetches (wider batches reuse the group from cache for
                    // their later column tiles).
                    unsafe {
                        let c = &mut c;
                        match (bp + 1 < nbt, bp == 0, lw.tiled) {
                            (true, true, true) => {
                                tile_pass::<2, true, TILED_STEP>(&t, tiles, nk, c)
                            }
                            (true, false, true) => {
                                tile_pass::<2, false, TILED_STEP>(&t, tiles, nk, c)
                            }
                            (false, true, true) => {
                                tile_pass::<1, true, TILED_STEP>(&t, tiles, nk, c)
                            }
                            (false, false, true) => {
                                tile_pass::<1, false, TILED_STEP>(&t, tiles, nk, c)
                            }
                            (true, true, false) => tile_pass::<2, true, 64>(&t, tiles, nk, c),
                            (true, false, false) => tile_pass::<2, false, 64>(&t, tiles, nk, c),
                            (false, true, false) => tile_pass::<1, true, 64>(&t, tiles, nk, c),
                            (false, false, false) => tile_pass::<1, false, 64>(&t, tiles, nk, c),
                        }
                    }
                    // SAFETY: AVX-512 by contract; the rows and batch columns are inside the
                    // tile and the batch.
                    unsafe { store_block(lw, &c, n0, nr, bo + bp * 16, bend, k32, out, ld_out) };
                }
                n0 += nr;
            }
            bo = bend;
        }
        // SAFETY: releases the tile state configured above.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    });
}

/// The tile configuration of the batch-1 pass on tiled weights: `tmm0`–`tmm3` are 16 rows
/// × 4 bytes (one fp32 output column each), `tmm4`, `tmm5` and `tmm7` 16 × 64 bytes (weight
/// blocks), `tmm6` 16 rows × 4 bytes (the activation row's bf16 pairs, read in place).
static SINGLE_ROW_CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = if t < 4 || t == 6 { 4 } else { 64 };
        c[48 + t] = 16;
        t += 1;
    }
    TileConfig(c)
};

/// Weight streams of the batch-1 pass: the tile's groups are cut into this many contiguous
/// regions, walked side by side one group at a time.
const SINGLE_ROW_STREAMS: usize = 4;

/// How far ahead of its tile loads each stream of the batch-1 pass prefetches into L1, in
/// bytes (two blocks).
const SINGLE_ROW_PREFETCH: usize = 2 * TILED_BLOCK * 2;

/// One batch row against tiled weights (see the module docs): the row is converted once to
/// natural-order bf16, which is already the `B` operand of a one-column product (row `j` of
/// the tile is the pair `x[2j], x[2j + 1]`, 4 bytes apart), so no VNNI tiles are made; each
/// 1 KiB weight block meets it in one `tdpbf16ps` into a one-column accumulator. The tile's
/// 16-row groups are cut into [`SINGLE_ROW_STREAMS`] contiguous regions walked side by side,
/// so several sequential streams are in flight per thread as on the row-major vector path,
/// each prefetched [`SINGLE_ROW_PREFETCH`] bytes ahead. Each output sums the same products in
/// the same order as the wider tile passes (one `tdpbf16ps` per 32-element step).
///
/// # Safety
/// As [`gemm_with`], with `lw` tiled, one batch row and a body of at least one 32-element step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn tiled_single_row(lw: &Lowered<'_>, out: &mut [f32], ld_out: usize) {
    let nk = (lw.kb1 - lw.kb0) / 32;
    assert!(lw.tiled && lw.batch == 1 && nk >= 1);
    let k32 = nk * 32;
    let strip = lw.kb0 + k32 < lw.kb1;
    let groups = lw.n.len().div_ceil(TILE_ROWS);
    let region = |r: usize| groups * r / SINGLE_ROW_STREAMS..groups * (r + 1) / SINGLE_ROW_STREAMS;
    let blocks = |g: usize| {
        let at = tiled_index(lw.n.start + g * TILE_ROWS, lw.kb0, lw.ldw);
        lw.w[at..at + nk * TILED_BLOCK].as_ptr()
    };
    SCRATCH.with(|cell| {
        let mut s = cell.borrow_mut();
        let xn = &mut s.natural;
        xn.resize(k32, 0);
        // SAFETY: AVX-512 by contract; the slice is the body's whole steps of the one row
        // (k32 is a multiple of 16, `xn` exactly as long).
        unsafe { super::avx512::to_natural(&lw.x[lw.kb0..lw.kb0 + k32], xn) };
        // SAFETY: the configuration is a valid palette-1 layout; the tile state was granted
        // (contract). Released below; nothing between uses tiles otherwise.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &SINGLE_ROW_CONFIG, options(nostack, readonly)) };
        for j in 0..groups.div_ceil(SINGLE_ROW_STREAMS) {
            // Step j of each region that still has a group. The last region is a longest one
            // (`groups.div_ceil(4)` groups), so it always has; a region already done repeats
            // its group, whose products are not stored.
            let live: [Option<usize>; SINGLE_ROW_STREAMS] = std::array::from_fn(|r| {
                let g = region(r).start + j;
                (g < region(r).end).then_some(g)
            });
            let longest = region(SINGLE_ROW_STREAMS - 1).start + j;
            let a: [*const u16; SINGLE_ROW_STREAMS] =
                std::array::from_fn(|r| blocks(live[r].unwrap_or(longest)));
            let mut c = [0f32; 16 * SINGLE_ROW_STREAMS];
            // SAFETY: every `a[r]` points at `nk` consecutive 1 KiB blocks inside the weights
            // (sliced above) and `xn` holds `nk` steps of 32 bf16; `c` takes four 16-lane
            // columns.
            unsafe { single_row_pass(a, xn.as_ptr(), nk, &mut c) };
            for (r, g) in live.iter().enumerate() {
                let Some(g) = *g else { continue };
                let n0 = lw.n.start + g * TILE_ROWS;
                for (i, &v) in c[r * 16..r * 16 + TILE_ROWS.min(lw.n.end - n0)]
                    .iter()
                    .enumerate()
                {
                    let n = n0 + i;
                    let mut sum = v + edge_sum(lw, n, 0);
                    if strip {
                        sum += strip_dot(lw, n, 0, lw.kb0 + k32);
                    }
                    finish(lw, out, ld_out, n, 0, sum);
                }
            }
        }
        // SAFETY: releases the tile state configured above.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    });
}

/// Four groups' blocks (`a[r]`, moving one block per step) against the one activation row `x`
/// (natural-order bf16, 32 per step) over `nk` steps; group `r`'s 16 sums land in
/// `c[16 r..16 r + 16]`. Each stream prefetches [`SINGLE_ROW_PREFETCH`] bytes ahead (past a
/// stream's end that is the next region, or memory after the tile, only prefetched).
///
/// # Safety
/// [`SINGLE_ROW_CONFIG`] is loaded; each `a[r]` points at `nk >= 1` readable consecutive
/// blocks and `x` at `32 nk` readable bf16.
unsafe fn single_row_pass(
    a: [*const u16; SINGLE_ROW_STREAMS],
    x: *const u16,
    nk: usize,
    c: &mut [f32; 16 * SINGLE_ROW_STREAMS],
) {
    // SAFETY: per step, the `B` tile load reads 16 rows of 4 bytes at a 4-byte stride (64
    // consecutive bytes of `x`) and each weight tile load one 1 KiB block, `nk` steps,
    // readable by the contract; the stores write 16 rows of 4 bytes at a 4-byte stride, the
    // four 64-byte quarters of `c`. Prefetches touch no state. Only tile registers and the
    // declared operands change.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm6, [{x} + {s4}*1]",
            "tileloadd tmm4, [{a0} + {s64}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a1} + {s64}*1]",
            "tdpbf16ps tmm1, tmm5, tmm6",
            "tileloadd tmm7, [{a2} + {s64}*1]",
            "tdpbf16ps tmm2, tmm7, tmm6",
            "tileloadd tmm4, [{a3} + {s64}*1]",
            "tdpbf16ps tmm3, tmm4, tmm6",
            "xor {t:e}, {t:e}",
            "3:",
            "prefetcht0 [{a0} + {t} + {pf}]",
            "prefetcht0 [{a1} + {t} + {pf}]",
            "prefetcht0 [{a2} + {t} + {pf}]",
            "prefetcht0 [{a3} + {t} + {pf}]",
            "add {t}, 64",
            "cmp {t}, 1024",
            "jne 3b",
            "add {x}, 64",
            "add {a0}, 1024",
            "add {a1}, 1024",
            "add {a2}, 1024",
            "add {a3}, 1024",
            "dec {n}",
            "jnz 2b",
            "tilestored [{c} + {s4}*1], tmm0",
            "tilestored [{c} + {s4}*1 + 64], tmm1",
            "tilestored [{c} + {s4}*1 + 128], tmm2",
            "tilestored [{c} + {s4}*1 + 192], tmm3",
            a0 = inout(reg) a[0] => _,
            a1 = inout(reg) a[1] => _,
            a2 = inout(reg) a[2] => _,
            a3 = inout(reg) a[3] => _,
            x = inout(reg) x => _,
            s4 = in(reg) 4usize,
            s64 = in(reg) 64usize,
            n = inout(reg) nk => _,
            t = out(reg) _,
            pf = const SINGLE_ROW_PREFETCH,
            c = in(reg) c.as_mut_ptr(),
            options(nostack),
        );
    }
}

/// Prefetches into L2 the weight lines of 32-element step `i` of the tile's first 32-row group
/// (the lines the first `tile_pass` loads at that step), so the weight stream starts while the
/// activations are converted instead of after. Nothing for a row-major group of other than 16
/// or 32 rows (it is copied into scratch first).
#[inline(always)]
fn prefetch_first_group_step(lw: &Lowered<'_>, i: usize) {
    let n0 = lw.n.start;
    let nr = (lw.n.end - n0).min(32);
    // Element offsets of the two 16-row tiles' first lines, elements between a tile's lines,
    // and between steps.
    let (at0, at1, line, step) = if lw.tiled {
        let at0 = tiled_index(n0, lw.kb0, lw.ldw);
        let at1 = if nr > 16 {
            tiled_index(n0 + 16, lw.kb0, lw.ldw)
        } else {
            at0
        };
        (at0, at1, TILE_COLS, TILED_BLOCK)
    } else if nr == 32 || nr == 16 {
        let at0 = n0 * lw.ldw + lw.kb0;
        let at1 = if nr > 16 { at0 + 16 * lw.ldw } else { at0 };
        (at0, at1, lw.ldw, 32)
    } else {
        return;
    };
    let base = lw.w.as_ptr();
    for r in 0..16 {
        for at in [at0, at1] {
            let p = base.wrapping_add(at + i * step + r * line);
            // SAFETY: a prefetch never faults and changes no program state, whatever the
            // address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
        }
    }
}

/// Copies weight rows `n0..n0 + nr` (`nr < 32`), `k32` elements each from `kb0`, into `dst` as
/// 32 rows zero-padded.
fn copy_tail_rows(lw: &Lowered<'_>, n0: usize, nr: usize, k32: usize, dst: &mut Vec<Line>) {
    let lines_per_row = k32 / 32;
    dst.clear();
    dst.resize(32 * lines_per_row, ZERO_LINE);
    for r in 0..nr {
        let src = &lw.w[(n0 + r) * lw.ldw + lw.kb0..][..k32];
        for (l, chunk) in src.chunks_exact(32).enumerate() {
            let line = &mut dst[r * lines_per_row + l].0;
            for (j, pair) in chunk.chunks_exact(2).enumerate() {
                line[j] = u32::from(pair[0]) | (u32::from(pair[1]) << 16);
            }
        }
    }
}

/// Where the two weight tiles of a 32-row pass lie: tile `i` of step `s` is 16 rows of 64
/// bytes at `a_i + s * STEP`, `stride` bytes apart (row-major: `a1` is 16 rows below `a0`,
/// `stride` the row stride, the step one 64-byte line; tiled: `a0`, `a1` the two groups'
/// blocks, `stride` 64, the step one 1 KiB block). `p0`, `p1` are the same for the lines
/// prefetched meanwhile (row-major: the next group's rows; tiled: each stream's next block).
/// Without `both` the group has 16 rows or fewer: only the tile at `a0` is loaded and
/// multiplied (`a1` is neither read nor needed to point at readable memory).
struct WeightTiles {
    a0: *const u16,
    a1: *const u16,
    stride: usize,
    p0: *const u16,
    p1: *const u16,
    both: bool,
}

/// `2 * COLS` accumulator tiles over `nk` 32-element steps: the weight tiles of `w` (moving
/// `STEP` bytes per step), activation tiles `vnni[0..nk]` (and `vnni[nk..2nk]` when
/// `COLS == 2`, 16 lines each); the fp32 results land in `c` as 16 × 16 tiles at
/// `(rt * 2 + ct) * 16` lines (rows `16 rt..`, batch `16 ct..`; `ct == 1` is left alone when
/// `COLS == 1`). Without `w.both` the second weight tile is skipped (a group of 16 rows or
/// fewer, which the tapered SPMD shares leave at the end of most blocks: it costs half a
/// pass, not a pass over a repeated or zero tile) and `rt == 1` of `c` holds zeros. With
/// `PREFETCH`, each step also prefetches the 16 lines of each of `w.p0` and `w.p1` at the
/// step's offset (stride `w.stride`): into L1 on tiled weights (`STEP == TILED_STEP`, where
/// they are the streams' next blocks), into L2 on row-major ones (the next group's rows).
///
/// # Safety
/// The tile configuration of this module is loaded; the weight tiles of `w.a0`, `w.a1` (when
/// `w.both`) and `vnni` are readable as described for `nk >= 1` steps; `COLS` is 1 or 2.
/// `w.p0`, `w.p1` are only prefetched (never fault).
unsafe fn tile_pass<const COLS: usize, const PREFETCH: bool, const STEP: usize>(
    w: &WeightTiles,
    vnni: *const Line,
    nk: usize,
    c: &mut [Line; 64],
) {
    if COLS == 2 {
        let b1 = vnni.wrapping_add(nk * 16);
        // SAFETY: every tile load reads 16 rows of 64 bytes: the weight tiles at `a0`/`a1`
        // (`a1` only when `both`; stride `stride`, moving STEP bytes per step) and the
        // activation tiles (1 KiB each, `nk` consecutive per column), `nk` steps, readable by
        // the contract. The stores write
        // the four 1 KiB tiles of `c`. Prefetches touch no state. Only tile registers and the
        // declared operands change.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "test {both:e}, {both:e}",
                "jz 5f",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "5:",
                "mov {t:e}, {on}",
                "test {t:e}, {t:e}",
                "jz 4f",
                "xor {t:e}, {t:e}",
                "mov {r:e}, 16",
                "3:",
                "prefetcht{hint} [{p0} + {t}]",
                "prefetcht{hint} [{p1} + {t}]",
                "add {t}, {sa}",
                "dec {r:e}",
                "jnz 3b",
                "4:",
                "add {p0}, {step}",
                "add {p1}, {step}",
                "add {a0}, {step}",
                "add {a1}, {step}",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {sb}*1], tmm0",
                "tilestored [{c} + {sb}*1 + 1024], tmm1",
                "tilestored [{c} + {sb}*1 + 2048], tmm2",
                "tilestored [{c} + {sb}*1 + 3072], tmm3",
                a0 = inout(reg) w.a0 => _,
                a1 = inout(reg) w.a1 => _,
                sa = in(reg) w.stride,
                b0 = inout(reg) vnni => _,
                b1 = inout(reg) b1 => _,
                sb = in(reg) 64usize,
                n = inout(reg) nk => _,
                p0 = inout(reg) w.p0 => _,
                p1 = inout(reg) w.p1 => _,
                t = out(reg) _,
                r = out(reg) _,
                on = const PREFETCH as u32,
                hint = const (STEP != TILED_STEP) as u32,
                both = in(reg) u32::from(w.both),
                step = const STEP,
                c = in(reg) c.as_mut_ptr(),
                options(nostack),
            );
        }
    } else {
        // SAFETY: as above with one activation tile: the stores write tiles 0 and 2 of `c`.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm2",
                "2:",
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "test {both:e}, {both:e}",
                "jz 5f",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "5:",
                "mov {t:e}, {on}",
                "test {t:e}, {t:e}",
                "jz 4f",
                "xor {t:e}, {t:e}",
                "mov {r:e}, 16",
                "3:",
                "prefetcht{hint} [{p0} + {t}]",
                "prefetcht{hint} [{p1} + {t}]",
                "add {t}, {sa}",
                "dec {r:e}",
                "jnz 3b",
                "4:",
                "add {p0}, {step}",
                "add {p1}, {step}",
                "add {a0}, {step}",
                "add {a1}, {step}",
                "add {b0}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {sb}*1], tmm0",
                "tilestored [{c} + {sb}*1 + 2048], tmm2",
                a0 = inout(reg) w.a0 => _,
                a1 = inout(reg) w.a1 => _,
                sa = in(reg) w.stride,
                b0 = inout(reg) vnni => _,
                sb = in(reg) 64usize,
                n = inout(reg) nk => _,
                p0 = inout(reg) w.p0 => _,
                p1 = inout(reg) w.p1 => _,
                t = out(reg) _,
                r = out(reg) _,
                on = const PREFETCH as u32,
                hint = const (STEP != TILED_STEP) as u32,
                both = in(reg) u32::from(w.both),
                step = const STEP,
                c = in(reg) c.as_mut_ptr(),
                options(nostack),
            );
        }
    }
}

/// Converts the activations of batch rows `b0..b0 + 16` (those below `bend`; the rest are
/// zero) at `K` offset `k0..k0 + 32` (two whole packing blocks) into one VNNI tile: line `j`
/// holds, for each of the 16 batch rows, the bf16 pair `(x[b, k0 + 2j], x[b, k0 + 2j + 1])`.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available; `k0 + 32 <= lw.kb1` and `k0` on a packing block;
/// `bend <= lw.batch`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn vnni_tile(lw: &Lowered<'_>, b0: usize, bend: usize, k0: usize, tile: &mut [Line]) {
    let mut r = [_mm512_setzero_si512(); 16];
    for (j, rj) in r.iter_mut().enumerate() {
        let b = b0 + j;
        if b < bend {
            let src = &lw.x[b * lw.ldx + k0..b * lw.ldx + k0 + 2 * PACK_BLOCK];
            // SAFETY: `src` is 32 fp32; AVX-512 by contract.
            *rj = unsafe { pairs32(src) };
        }
    }
    transpose16(&mut r);
    for (line, v) in tile.iter_mut().zip(r) {
        // SAFETY: a line is 64 bytes, 64-byte aligned.
        unsafe { _mm512_store_si512(line.0.as_mut_ptr().cast(), v) };
    }
}

/// Two packed blocks (32 fp32, each `[x0, x2, .., x14, x1, x3, .., x15]`) as 16 bf16 pairs in
/// `K` order (round to nearest even): one two-source conversion and one word permutation.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available; `src.len() >= 32`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn pairs32(src: &[f32]) -> __m512i {
    assert!(src.len() >= 32);
    // SAFETY: 32 fp32 at `src` (checked above).
    let (v0, v1) = unsafe {
        (
            _mm512_loadu_ps(src.as_ptr()),
            _mm512_loadu_ps(src.as_ptr().add(16)),
        )
    };
    // Words 0-15: bf16 of the first block, 16-31 of the second.
    // SAFETY: plain 512-bit vectors with no invalid bit patterns.
    let words = unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(v1, v0)) };
    _mm512_permutexvar_epi16(unpack_index(), words)
}

/// The word permutation of [`pairs32`]: natural position `m` of a 16-element block takes the
/// block's even half at `m / 2` (even `m`) or its odd half at `8 + m / 2` (odd `m`).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn unpack_index() -> __m512i {
    const IDX: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut m = 0;
        while m < 32 {
            let (block, i) = (m / 16 * 16, m % 16);
            idx[m] = (block + if i % 2 == 0 { i / 2 } else { 8 + i / 2 }) as u16;
            m += 1;
        }
        idx
    };
    // SAFETY: IDX is 64 bytes.
    unsafe { _mm512_loadu_si512(IDX.as_ptr().cast()) }
}

/// Transposes a 16 × 16 matrix of 32-bit elements held one row per register.
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn transpose16(r: &mut [__m512i; 16]) {
    let z = _mm512_setzero_si512();
    // Within each 128-bit lane: 2 × 2 blocks of 32-bit, then of 64-bit elements, so `u[4 i + c]`
    // lane `l` holds column `4 l + c` of rows `4 i .. 4 i + 4`.
    let mut t = [z; 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    let mut u = [z; 16];
    for i in 0..4 {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // Across lanes: row `4 l + c` gathers lane `l` of `u[c]`, `u[4 + c]`, `u[8 + c]`, `u[12 + c]`.
    for c in 0..4 {
        let s0 = _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]);
        let s1 = _mm512_shuffle_i32x4::<0xDD>(u[c], u[4 + c]);
        let s2 = _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]);
        let s3 = _mm512_shuffle_i32x4::<0xDD>(u[8 + c], u[12 + c]);
        r[c] = _mm512_shuffle_i32x4::<0x88>(s0, s2);
        r[4 + c] = _mm512_shuffle_i32x4::<0x88>(s1, s3);
        r[8 + c] = _mm512_shuffle_i32x4::<0xDD>(s0, s2);
        r[12 + c] = _mm512_shuffle_i32x4::<0xDD>(s1, s3);
    }
}

/// Writes the four result tiles of weight rows `n0..n0 + nr` × batch rows `b0..b0 + 32` (those
/// below `bend`), adding the body's last 16-element strip when `k32` stops short of it and the
/// edges.
///
/// # Safety
/// AVX-512 F/BW/VL + BF16 available; `n0 + nr <= lw.n.end`, `bend <= lw.batch`; `lw` checked by
/// `gemm_dispatch`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn store_block(
    lw: &Lowered<'_>,
    c: &[Line; 64],
    n0: usize,
    nr: usize,
    b0: usize,
    bend: usize,
    k32: usize,
    out: &mut [f32],
    ld_out: usize,
) {
    let strip = lw.kb0 + k32 < lw.kb1;
    let simple = !strip && !lw.has_edges();
    for rt in 0..2 {
        let rows = nr.saturating_sub(rt * 16).min(16);
        if rows == 0 {
            continue;
        }
        for ct in 0..2 {
            let bt0 = b0 + ct * 16;
            let cols = bend.saturating_sub(bt0).min(16);
            if cols == 0 {
                continue;
            }
            let tile = &c[(rt * 2 + ct) * 16..(rt * 2 + ct + 1) * 16];
            let n_first = n0 + rt * 16;
            if simple {
                // Transposed: register `j` holds batch row `bt0 + j` for the 16 weight rows.
                // SAFETY: each line is 64 bytes, 64-byte aligned.
                let mut r: [__m512i; 16] = std::array::from_fn(|i| unsafe {
                    _mm512_load_si512(tile[i].0.as_ptr().cast())
                });
                transpose16(&mut r);
                let mask: __mmask16 = if rows == 16 {
                    0xFFFF
                } else {
                    (1u16 << rows) - 1
                };
                for (j, v) in r.iter().take(cols).enumerate() {
                    let b = bt0 + j;
                    let mut v = _mm512_castsi512_ps(*v);
                    if let Some(s) = lw.scale {
                        v = _mm512_mul_ps(v, _mm512_set1_ps(s[b]));
                    }
                    let at = b * ld_out + (n_first - lw.n.start);
                    let dst = &mut out[at..at + rows];
                    // SAFETY: the masked lanes are the `rows` elements of `dst`; masked-off
                    // lanes are neither read nor written (and never fault).
                    unsafe {
                        if lw.mode == super::OutMode::Add {
                            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, dst.as_ptr()));
                        }
                        _mm512_mask_storeu_ps(dst.as_mut_ptr(), mask, v);
                    }
                }
            } else {
                for (r, line) in tile.iter().take(rows).enumerate() {
                    let n = n_first + r;
                    for (j, &bits) in line.0.iter().take(cols).enumerate() {
                        let b = bt0 + j;
                        let mut sum = f32::from_bits(bits) + edge_sum(lw, n, b);
                        if strip {
                            sum += strip_dot(lw, n, b, lw.kb0 + k32);
                        }
                        finish(lw, out, ld_out, n, b, sum);
                    }
                }
            }
        }
    }
}

/// The 16-element strip at `k` (one packing block) of weight row `n` against batch row `b`.
fn strip_dot(lw: &Lowered<'_>, n: usize, b: usize, k: usize) -> f32 {
    let x = &lw.x[b * lw.ldx + k..][..PACK_BLOCK];
    let w = |i: usize| f32::from_bits(u32::from(lw.w_at(n, k + i)) << 16);
    let half = PACK_BLOCK / 2;
    let mut s = 0.0f32;
    for i in 0..half {
        s += w(2 * i) * x[i] + w(2 * i + 1) * x[half + i];
    }
    s
}
