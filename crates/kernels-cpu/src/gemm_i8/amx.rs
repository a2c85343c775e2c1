//! AMX-INT8 path (`tdpbssd`, through `asm!`: the tile intrinsics are not stable Rust).
//!
//! The product is computed transposed, `C[n, b] = sum_k W[n, k] * X[b, k]`, so the weights are
//! the A operand as they lie in memory: 16 rows at the weight row stride, 64 bytes of `k`, when
//! row-major; one contiguous 1 KiB block (rows 64 bytes apart) of a whole 16-row group when
//! packed (`gemm_i8` module docs, "Layouts"; rows outside whole groups go to AVX-512 VNNI).
//! Nothing is repacked per call. The activations (a few rows) are repacked per call into
//! the B operand's layout, one 1 KiB block per 64 bytes of `k`: row `j` of a block holds, for
//! each batch row `b`, the four values `x[b, 4j..4j + 4]`. Two accumulator tiles (32 weight
//! rows) share each B tile. With grouped activations every block of 32 (or 16) rows runs through the
//! groups' `k` segments in order, the accumulators zeroed, stored and finished with the
//! group's scale per segment, so the rows stream once. Weight rows left over (fewer than 16) and the `k` values after the
//! last whole 64 go to the AVX-512 VNNI path and a scalar loop.
//!
//! The tile registers are configured per batch group of up to 16 rows and released at the end
//! of every call, so no tile state outlives a call.

use std::arch::asm;
use std::cell::RefCell;

use super::{Lowered, avx512};
use crate::simd::prefetch_l2;

/// Rows of a tile (weight rows per accumulator, `k` quads per B block).
const TILE_ROWS: usize = 16;
/// Bytes of `k` per tile step.
const KSTEP: usize = 64;
/// Batch rows per tile group (the B tile's 16 four-byte columns).
const BATCH: usize = 16;

thread_local! {
    /// Repacked activations of the current call, reused across calls.
    static PACK: RefCell<Vec<i8>> = const { RefCell::new(Vec::new()) };
}

/// The 64-byte tile configuration (`ldtilecfg` operand), palette 1.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Palette 1 with tiles `(register, rows, bytes per row)`, the others unused.
    fn with(tiles: [(usize, usize, usize); 5]) -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (t, rows, bytes) in tiles {
            c.rows[t] = rows as u8;
            c.colsb[t] = bytes as u16;
        }
        c
    }

    /// tmm0/tmm1: accumulators `[16 weight rows, bb i32]`; tmm4/tmm5: weights `[16, 64 B]`;
    /// tmm6: activations `[16 quads, bb * 4 B]`.
    fn new(bb: usize) -> TileConfig {
        let (r, cb) = (TILE_ROWS, bb * 4);
        TileConfig::with([
            (0, r, cb),
            (1, r, cb),
            (4, r, KSTEP),
            (5, r, KSTEP),
            (6, r, cb),
        ])
    }
}

/// Computes the W8A8 tile described by its `k` segments (at least one, batch of at least 1)
/// into `out`: every block of 16 or 32 weight rows runs through all segments before the next.
///
/// # Safety
/// AMX-TILE/AMX-INT8 and AVX-512 F/BW/VNNI available, tile state granted by Linux
/// (`request_tile_permission`); `segs` checked by `gemm_i8_w8a8`.
pub(super) unsafe fn gemm(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    let lw = &segs[0];
    // Rows in whole tiles of 16 (the rows before and after go to AVX-512 VNNI).
    let groups = whole_groups(segs);
    let (groups_start, groups_end) = (groups.start, groups.end);
    if groups_end > groups_start {
        PACK.with(|p| {
            let mut pack = p.borrow_mut();
            let mut b0 = 0;
            while b0 < lw.batch {
                let bb = (lw.batch - b0).min(BATCH);
                repack(segs, b0, bb, &mut pack);
                // SAFETY: forwarded contract; rows `groups_start..groups_end` in whole groups
                // of 16 (whole packed groups when packed), batch rows `b0..b0 + bb` inside the
                // batch, `pack` holds every segment's blocks one after another.
                unsafe { tiles(segs, b0, bb, groups_start..groups_end, &pack, out, ld_out) };
                b0 += bb;
            }
        });
    }
    // SAFETY: forwarded contract (AVX-512 VNNI available).
    unsafe { outside_groups(segs, groups, out, ld_out, avx512::gemm) };
}

/// The rows of the tile in whole groups of 16 (row-major: from its first row; packed or
/// interleaved: its whole groups), empty when no segment has a whole 64-byte step.
fn whole_groups(segs: &[Lowered<'_>]) -> std::ops::Range<usize> {
    let lw = &segs[0];
    let mut a = lw.n.start;
    while a < lw.n.end && !lw.wa.whole_group_at(a) {
        a += 1;
    }
    let mut e = a;
    while e + TILE_ROWS <= lw.n.end && lw.wa.whole_group_at(e) {
        e += TILE_ROWS;
    }
    if segs.iter().any(|s| s.k.len() >= KSTEP) {
        a..e
    } else {
        lw.n.start..lw.n.start
    }
}

/// Runs `kernel` on the tile's rows before and after `groups` (every row when `groups` is
/// empty), each run the same segments restricted to those rows.
///
/// # Safety
/// `kernel`'s contract holds for `segs` and for any of its rows (the same checked tile
/// restricted to some rows, writing the same output elements).
unsafe fn outside_groups(
    segs: &[Lowered<'_>],
    groups: std::ops::Range<usize>,
    out: &mut [f32],
    ld_out: usize,
    kernel: unsafe fn(&[Lowered<'_>], &mut [f32], usize),
) {
    let lw = &segs[0];
    for rows in [lw.n.start..groups.start, groups.end..lw.n.end] {
        if rows.is_empty() {
            continue;
        }
        let sub: Vec<Lowered<'_>> = segs
            .iter()
            .map(|s| Lowered {
                n: rows.clone(),
                // Only rows that end the tile lead into the caller's next rows.
                next: s.next.filter(|_| rows.end == lw.n.end),
                ..s.clone()
            })
            .collect();
        // SAFETY: the same checked tile restricted to some of its rows, writing the same
        // output elements (the output slice starts at those rows' column): the caller's
        // contract.
        unsafe { kernel(&sub, &mut out[rows.start - lw.n.start..], ld_out) };
    }
}

/// Writes batch rows `b0..b0 + bb` of each segment's body into `pack`, the segments one
/// after another, each as its `k.len() / 64` B blocks of `16 × 64` bytes (unused columns
/// zero).
fn repack(segs: &[Lowered<'_>], b0: usize, bb: usize, pack: &mut Vec<i8>) {
    let blocks: usize = segs.iter().map(|s| s.k.len() / KSTEP).sum();
    pack.clear();
    pack.resize(blocks * TILE_ROWS * KSTEP, 0);
    let mut first = 0;
    for lw in segs {
        let chunks = lw.k.len() / KSTEP;
        for b in 0..bb {
            let row = &lw.a[(b0 + b) * lw.lda + lw.k.start..];
            for c in 0..chunks {
                for j in 0..TILE_ROWS {
                    let src = &row[c * KSTEP + 4 * j..c * KSTEP + 4 * j + 4];
                    let at = (first + c) * TILE_ROWS * KSTEP + j * KSTEP + b * 4;
                    pack[at..at + 4].copy_from_slice(src);
                }
            }
        }
        first += chunks;
    }
}

/// Rows `groups` (whole groups of 16, whole packed groups when packed) against batch rows
/// `b0..b0 + bb`, each block of rows through every segment in order.
///
/// # Safety
/// As [`gemm`]; `groups` inside the tile, its length a multiple of 16 (and its start a
/// packed group's when packed), `pack` holding every segment's blocks of batch rows
/// `b0..b0 + bb` (as [`repack`] writes them).
unsafe fn tiles(
    segs: &[Lowered<'_>],
    b0: usize,
    bb: usize,
    groups: std::ops::Range<usize>,
    pack: &[i8],
    out: &mut [f32],
    ld_out: usize,
) {
    let cfg = TileConfig::new(bb);
    let mut c = [[0i32; BATCH]; 2 * TILE_ROWS];
    let groups_end = groups.end;
    // SAFETY: `cfg` is a valid palette-1 configuration (rows <= 16, colsb <= 64) and the tile
    // state is granted (caller's contract).
    unsafe { asm!("ldtilecfg [{}]", in(reg) &raw const cfg, options(nostack, readonly)) };
    let mut n0 = groups.start;
    while n0 < groups_end {
        let pair = groups_end - n0 >= 2 * TILE_ROWS;
        let mut block0 = 0;
        for lw in segs {
            let chunks = lw.k.len() / KSTEP;
            // SAFETY: as below, for this segment's rows and blocks.
            unsafe {
                segment(
                    lw,
                    b0,
                    bb,
                    n0,
                    pair,
                    &pack[block0 * TILE_ROWS * KSTEP..],
                    chunks,
                    &mut c,
                    out,
                    ld_out,
                )
            };
            block0 += chunks;
        }
        n0 += if pair { 2 * TILE_ROWS } else { TILE_ROWS };
    }
    // SAFETY: releasing the tile state touches no memory; later calls configure again.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// One segment of the rows `n0..n0 + 16` (or `+ 32` when `pair`) against batch rows
/// `b0..b0 + bb`, finished into `out` (its body on the tiles, its tail by a scalar loop).
///
/// # Safety
/// Tiles configured for `bb` batch columns (caller); the rows lie inside the checked tile of
/// `lw`, and `pack` starts at this segment's `chunks` blocks of batch rows `b0..b0 + bb`.
#[allow(clippy::too_many_arguments)]
unsafe fn segment(
    lw: &Lowered<'_>,
    b0: usize,
    bb: usize,
    n0: usize,
    pair: bool,
    pack: &[i8],
    chunks: usize,
    c: &mut [[i32; BATCH]; 2 * TILE_ROWS],
    out: &mut [f32],
    ld_out: usize,
) {
    let tail = lw.k.start + chunks * KSTEP..lw.k.end;
    // Row-major: a tile's rows lie `ldw` apart, its 64-byte steps 64 apart, the next 16 rows
    // `16 ldw` on. Packed: a tile is one 1 KiB block (rows 64 apart), the blocks of a group
    // follow one another, the next group starts `16 K` on (`k.start` a multiple of 64).
    let (wstride, cstride, gstride) = match lw.wa.packed {
        None => (lw.wa.ldw, KSTEP, TILE_ROWS * lw.wa.ldw),
        Some(_) => (KSTEP, TILE_ROWS * KSTEP, TILE_ROWS * lw.wa.cols),
    };
    {
        let w0 = lw.w_ptr(n0, lw.k.start);
        // SAFETY: zeroing tile registers touches no memory.
        unsafe { asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem)) };
        for ch in 0..chunks {
            let bp = pack[ch * TILE_ROWS * KSTEP..].as_ptr();
            let wa = w0.wrapping_add(ch * cstride);
            let wb = wa.wrapping_add(gstride);
            // The same 64 bytes of the next two groups' rows: 32 row streams at a large stride
            // are more than the hardware prefetcher follows.
            for g in [wa, wb] {
                let next = g.wrapping_add(2 * gstride);
                for r in 0..TILE_ROWS {
                    prefetch_l2(next.wrapping_add(r * wstride));
                }
            }
            if pair {
                // SAFETY: tmm6 reads 16 rows of `bb * 4` bytes at stride 64 inside block `ch`
                // of `pack`; tmm4/tmm5 read 16 rows of 64 bytes at the weight stride from rows
                // n0..n0 + 32 at `k.start + 64 ch` (row-major), or the 1 KiB blocks of chunk
                // `k.start / 64 + ch` of the two whole groups n0.. and n0 + 16.. (packed),
                // inside the tile's rows and body (the caller checked the rows lie in `lw.w`).
                unsafe {
                    asm!(
                        "tileloadd tmm6, [{b} + {bs}*1]",
                        "tileloadd tmm4, [{wa} + {ws}*1]",
                        "tdpbssd tmm0, tmm4, tmm6",
                        "tileloadd tmm5, [{wb} + {ws}*1]",
                        "tdpbssd tmm1, tmm5, tmm6",
                        b = in(reg) bp,
                        bs = in(reg) KSTEP,
                        wa = in(reg) wa,
                        wb = in(reg) wb,
                        ws = in(reg) wstride,
                        options(nostack, readonly),
                    )
                };
            } else {
                // SAFETY: as above, with rows n0..n0 + 16 only.
                unsafe {
                    asm!(
                        "tileloadd tmm6, [{b} + {bs}*1]",
                        "tileloadd tmm4, [{wa} + {ws}*1]",
                        "tdpbssd tmm0, tmm4, tmm6",
                        b = in(reg) bp,
                        bs = in(reg) KSTEP,
                        wa = in(reg) wa,
                        ws = in(reg) wstride,
                        options(nostack, readonly),
                    )
                };
            }
        }
        let cp = c.as_mut_ptr();
        // SAFETY: tmm0/tmm1 hold 16 rows of `bb * 4` bytes; `c` has 16 rows of 64 bytes each
        // (BATCH i32) per tile, rows 0..16 and 16..32.
        unsafe {
            asm!(
                "tilestored [{c0} + {cs}*1], tmm0",
                "tilestored [{c1} + {cs}*1], tmm1",
                c0 = in(reg) cp,
                c1 = in(reg) cp.wrapping_add(TILE_ROWS),
                cs = in(reg) BATCH * 4,
                options(nostack),
            )
        };
        let rows = if pair { 2 * TILE_ROWS } else { TILE_ROWS };
        for (r, crow) in c.iter().enumerate().take(rows) {
            for (b, &v) in crow.iter().enumerate().take(bb) {
                let s = v + lw.dot(n0 + r, b0 + b, tail.clone());
                lw.finish(out, ld_out, n0 + r, b0 + b, s);
            }
        }
    }
}

/// Tile configuration of [`gemm_interleaved`]: tmm0/tmm1 accumulators `[bb batch rows, 16
/// i32]`, tmm4/tmm5 weights `[16 quads, 64 B]` (a whole group's 16 quads of `k`), tmm6
/// activations `[bb batch rows, 64 B]`.
fn interleaved_config(bb: usize) -> TileConfig {
    let r = TILE_ROWS;
    TileConfig::with([
        (0, bb, KSTEP),
        (1, bb, KSTEP),
        (4, r, KSTEP),
        (5, r, KSTEP),
        (6, bb, KSTEP),
    ])
}

/// The W8A8 tile over interleaved weights ([`super::I8Layout::Interleaved`]) on AMX-INT8: the
/// product is computed as it reads, `C[b, n] = sum_k X[b, k] W[n, k]`, with the activation
/// rows as the A operand where they lie (64 bytes of `k` of up to 16 batch rows at their row
/// stride) and the weights as the B operand, which is what the interleaved layout is: 64
/// bytes of `k` of a whole 16-row group are 16 consecutive lines, line `j` holding the quad
/// `4j..4j + 4` of each of the group's rows — one contiguous 1 KiB block, loaded as it lies
/// from any quad-aligned `k` (nothing is repacked). Two groups (32 rows) share each
/// activation tile. Rows outside whole groups go to the lane-wise AVX-512 VNNI kernel, and
/// the `k` values after the last whole 64 of a segment to a scalar loop.
///
/// # Safety
/// AMX-TILE/AMX-INT8 and AVX-512 F/BW/VNNI available, tile state granted by Linux; `segs`
/// (at least one) checked by `gemm_i8_w8a8` over interleaved weights, every segment starting
/// on a whole quad.
pub(super) unsafe fn gemm_interleaved(segs: &[Lowered<'_>], out: &mut [f32], ld_out: usize) {
    let lw = &segs[0];
    let groups = whole_groups(segs);
    let (groups_start, groups_end) = (groups.start, groups.end);
    if groups_end > groups_start {
        let mut b0 = 0;
        while b0 < lw.batch {
            let bb = (lw.batch - b0).min(BATCH);
            // SAFETY: forwarded contract; rows `groups_start..groups_end` are whole groups of
            // the view, batch rows `b0..b0 + bb` inside the batch.
            unsafe { interleaved_tiles(segs, b0, bb, groups_start..groups_end, out, ld_out) };
            b0 += bb;
        }
    }
    // SAFETY: forwarded contract (AVX-512 VNNI available; the segments start on whole quads).
    unsafe { outside_groups(segs, groups, out, ld_out, avx512::gemm_lanes) };
}

/// Whole groups `groups` against batch rows `b0..b0 + bb`, each pair of groups (or a last
/// single one) through every segment in order.
///
/// # Safety
/// As [`gemm_interleaved`]; `groups` whole interleaved groups of the view, `bb <= 16`.
unsafe fn interleaved_tiles(
    segs: &[Lowered<'_>],
    b0: usize,
    bb: usize,
    groups: std::ops::Range<usize>,
    out: &mut [f32],
    ld_out: usize,
) {
    let cfg = interleaved_config(bb);
    // Rows: batch rows of the first group (0..16), then of the second (16..32).
    let mut c = [[0i32; TILE_ROWS]; 2 * BATCH];
    // SAFETY: `cfg` is a valid palette-1 configuration (rows <= 16, colsb 64) and the tile
    // state is granted (caller's contract).
    unsafe { asm!("ldtilecfg [{}]", in(reg) &raw const cfg, options(nostack, readonly)) };
    let mut n0 = groups.start;
    while n0 < groups.end {
        let pair = groups.end - n0 >= 2 * TILE_ROWS;
        for lw in segs {
            let chunks = lw.k.len() / KSTEP;
            let tail = lw.k.start + chunks * KSTEP..lw.k.end;
            let wa0 = lw.w_ptr(n0, lw.k.start);
            let wb0 = if pair {
                lw.w_ptr(n0 + TILE_ROWS, lw.k.start)
            } else {
                wa0
            };
            let a0 = lw.a[b0 * lw.lda + lw.k.start..].as_ptr();
            // SAFETY: zeroing tile registers touches no memory.
            unsafe { asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem)) };
            for ch in 0..chunks {
                // 64 bytes of `k` are 16 quads: 16 consecutive lines of the group.
                let wa = wa0.wrapping_add(ch * TILE_ROWS * KSTEP);
                let wb = wb0.wrapping_add(ch * TILE_ROWS * KSTEP);
                let a = a0.wrapping_add(ch * KSTEP);
                // The groups' blocks four chunks on (4 KiB ahead in each group's stream),
                // one line of each per step.
                for g in [wa, wb] {
                    prefetch_l2(g.wrapping_add(4 * TILE_ROWS * KSTEP));
                }
                if pair {
                    // SAFETY: tmm6 reads `bb` rows of 64 bytes at the activations' row stride
                    // from batch row `b0`, `k` in this segment's body; tmm4/tmm5 read 16
                    // lines (1 KiB) of the whole groups n0.. and n0 + 16.. from the quad of
                    // `k.start + 64 ch`, inside the weights (the caller checked the rows and
                    // the segment lies in the tile).
                    unsafe {
                        asm!(
                            "tileloadd tmm6, [{a} + {lda}*1]",
                            "tileloadd tmm4, [{wa} + {ws}*1]",
                            "tdpbssd tmm0, tmm6, tmm4",
                            "tileloadd tmm5, [{wb} + {ws}*1]",
                            "tdpbssd tmm1, tmm6, tmm5",
                            a = in(reg) a,
                            lda = in(reg) lw.lda,
                            wa = in(reg) wa,
                            wb = in(reg) wb,
                            ws = in(reg) KSTEP,
                            options(nostack, readonly),
                        )
                    };
                } else {
                    // SAFETY: as above, with the group n0.. only.
                    unsafe {
                        asm!(
                            "tileloadd tmm6, [{a} + {lda}*1]",
                            "tileloadd tmm4, [{wa} + {ws}*1]",
                            "tdpbssd tmm0, tmm6, tmm4",
                            a = in(reg) a,
                            lda = in(reg) lw.lda,
                            wa = in(reg) wa,
                            ws = in(reg) KSTEP,
                            options(nostack, readonly),
                        )
                    };
                }
            }
            let cp = c.as_mut_ptr();
            // SAFETY: tmm0/tmm1 hold `bb` rows of 64 bytes; `c` has 16 rows of 64 bytes per
            // tile (rows 0..16 and 16..32).
            unsafe {
                asm!(
                    "tilestored [{c0} + {cs}*1], tmm0",
                    "tilestored [{c1} + {cs}*1], tmm1",
                    c0 = in(reg) cp,
                    c1 = in(reg) cp.wrapping_add(BATCH),
                    cs = in(reg) TILE_ROWS * 4,
                    options(nostack),
                )
            };
            let groups_here = if pair { 2 } else { 1 };
            for g in 0..groups_here {
                for b in 0..bb {
                    for (r, &v) in c[g * BATCH + b].iter().enumerate() {
                        let n = n0 + g * TILE_ROWS + r;
                        let s = v + lw.dot(n, b0 + b, tail.clone());
                        lw.finish(out, ld_out, n, b0 + b, s);
                    }
                }
            }
        }
        n0 += if pair { 2 * TILE_ROWS } else { TILE_ROWS };
    }
    // SAFETY: releasing the tile state touches no memory; later calls configure again.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}
