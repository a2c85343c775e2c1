//! The value product of the sparse attention on AMX-BF16 tiles (`tdpbf16ps`, 16 × 16 × 32 per
//! instruction): `out[h, c] = Σ_j P[h, j] V[j, c]` over all of a token's rows at once; and the
//! rows' pair layout it shares with the head-lane engine's `vdpbf16ps` value product
//! (`lanes.rs`).
//!
//! # Orientation
//! The tile unit computes `C[m, n] += Σ_k A[m, k] B[k, n]` with `A` rows contiguous along `k`
//! and `B` in the VNNI layout (a line holds, for 16 columns, a pair of neighbouring `k`). Here
//! `m` is the head, `k` the candidate, `n` the column: `A` is `P` as bf16 `[heads, n32]` (the
//! softmax weights are bf16 values already, so this rounds nothing), `B` is the rows
//! interleaved in pairs (line `i`, column block `cb`: rows `2i` and `2i + 1` over columns
//! `16 cb ..`; the lines of one column block are contiguous, so a `B` tile is 1 KiB in one
//! piece), made once per row with two permutes per 64 bytes (no transpose). `C` stays in the
//! tile unit over every candidate of the token: blocks of 2 × 2 tiles (32 heads × 32 columns)
//! start from zero tiles, accumulate over all `n32` candidates and are stored into `out` once,
//! so `out` is written once per call and never read back.

use std::arch::asm;
use std::arch::x86_64::*;

use half::bf16;

use crate::gemm::amx_tile_config;
use crate::isa::Isa;

/// Candidates per `K` step of `tdpbf16ps` (the kernel pads a call's rows to whole steps).
const KSTEP: usize = super::ROW_STEP;

/// Lines per column block of the pair layout of `pairs` pairs: the count made odd. A pair's
/// stores go to one line of every column block, a block's length apart; where that length is
/// a multiple of 64 lines (4 KiB: 128 or 640 candidates, padded to 32, are 64 or 320 pairs)
/// all of those lines fall in one L1 set and evict one another and the `prefetchw`s issued
/// ahead of them. An odd length spreads them over 32 sets.
pub(super) fn block_lines(pairs: usize) -> usize {
    pairs | 1
}

/// Elements of the pair layout of `n32` rows of `d` ([`block_lines`] lines of 32 per column
/// block).
pub(super) fn layout_len(n32: usize, d: usize) -> usize {
    d / 16 * block_lines(n32 / 2) * 32
}

/// The rows of a call in the value product's pair layout (sized on first use).
#[derive(Debug, Default)]
pub(super) struct PvScratch {
    /// The rows in pairs, column block by column block: line `(cb, i)` at `(cb · ld + i) · 32`
    /// (`ld` = [`block_lines`]`(pairs)`), element `2 (c mod 16) + r` = row `2i + r`, column `c` of block `cb = c / 16`.
    pub(super) vnni: Vec<u16>,
}

/// Whether the AMX path handles `heads` heads of `d` (whole 16-head blocks, whole 32-column
/// pairs of column blocks).
pub(super) fn supports(heads: usize, d: usize) -> bool {
    heads > 0 && heads.is_multiple_of(16) && d > 0 && d.is_multiple_of(32)
}

/// `out = P · V` for `pb` `[heads, n32]` (bf16 bits, zero past the call's `n`), `vnni`
/// [`layout_len`]`(n32, d)` long in [`interleave`]'s layout (the rows past the call's `n` zero: they meet zero
/// weights, and a zero row keeps a NaN out), `out` `[heads, d]` (only written).
///
/// # Panics
/// If the CPU has no AMX-BF16 (or the tile state was not granted), [`supports`] is false, or
/// the lengths disagree.
pub(super) fn pv_store(
    pb: &[u16],
    heads: usize,
    n32: usize,
    vnni: &[u16],
    d: usize,
    out: &mut [f32],
) {
    assert!(
        Isa::AmxBf16.is_supported(),
        "dsv4 attention: the AMX path runs only where AMX-BF16 is granted"
    );
    assert!(
        supports(heads, d),
        "dsv4 attention: AMX with {heads} heads of {d}"
    );
    assert!(n32.is_multiple_of(KSTEP), "dsv4 value product: n32 {n32}");
    assert_eq!(pb.len(), heads * n32, "dsv4 value product: p len");
    assert_eq!(
        vnni.len(),
        layout_len(n32, d),
        "dsv4 value product: vnni len"
    );
    assert_eq!(out.len(), heads * d, "dsv4 value product: out len");
    if n32 == 0 {
        out.fill(0.0);
        return;
    }
    // SAFETY: the configuration is the crate's palette-1 layout (eight 16 × 64-byte tiles), the
    // tile state was granted (asserted above); released below.
    unsafe { asm!("ldtilecfg [{}]", in(reg) amx_tile_config(), options(nostack, readonly)) };
    let (steps, ld) = (n32 / KSTEP, block_lines(n32 / 2));
    // Head blocks outer: a pair of head blocks' `A` rows (32 × 2 n32 bytes) stay near for every
    // column block; each `A` and `B` tile loaded serves two products.
    let mut hb = 0;
    while hb < heads / 16 {
        let two = hb + 2 <= heads / 16;
        for cb in (0..d / 16).step_by(2) {
            let c = out[hb * 16 * d + cb * 16..].as_mut_ptr();
            let a = pb[hb * 16 * n32..].as_ptr();
            let b = vnni[cb * ld * 32..].as_ptr();
            if two {
                // SAFETY: C: tiles (r, s) for r, s in {0, 1}: 16 rows of `out` at a stride of
                // 4d bytes from row (hb + r) · 16 (hb + 2 <= heads / 16), column 16 (cb + s)
                // (cb + 2 <= d / 16), inside `out` ([heads, d]). A: 16 rows of `pb` at a
                // stride of 2 n32 bytes from row (hb + r) · 16, 64 bytes per step, `steps`
                // steps inside a row. B0: block cb's lines, 16 (1 KiB) per step, `steps`
                // steps = `n32 / 2` lines; B1: block cb + 1's, `ld · 64` bytes further,
                // inside `vnni` (d / 16 blocks).
                unsafe {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        "2:",
                        "tileloadd tmm4, [{a} + {sa}*1]",
                        "tileloadd tmm6, [{b} + {s64}*1]",
                        "tileloadd tmm7, [{bh} + {s64}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a2} + {sa}*1]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        "add {a}, 64",
                        "add {a2}, 64",
                        "add {b}, 1024",
                        "add {bh}, 1024",
                        "sub {n}, 1",
                        "jnz 2b",
                        "tilestored [{c} + {sc}*1], tmm0",
                        "tilestored [{c} + {sc}*1 + 64], tmm1",
                        "tilestored [{c2} + {sc}*1], tmm2",
                        "tilestored [{c2} + {sc}*1 + 64], tmm3",
                        c = in(reg) c,
                        c2 = in(reg) c.add(16 * d),
                        sc = in(reg) 4 * d,
                        a = inout(reg) a => _,
                        a2 = inout(reg) a.add(16 * n32) => _,
                        sa = in(reg) 2 * n32,
                        b = inout(reg) b => _,
                        s64 = in(reg) 64usize,
                        bh = inout(reg) b.add(ld * 32) => _,
                        n = inout(reg) steps => _,
                        options(nostack),
                    );
                }
            } else {
                // SAFETY: as above with one head block (hb + 1 <= heads / 16): tiles 0 and 1
                // of C, A from row hb · 16.
                unsafe {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "2:",
                        "tileloadd tmm4, [{a} + {sa}*1]",
                        "tileloadd tmm6, [{b} + {s64}*1]",
                        "tileloadd tmm7, [{bh} + {s64}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "add {a}, 64",
                        "add {b}, 1024",
                        "add {bh}, 1024",
                        "sub {n}, 1",
                        "jnz 2b",
                        "tilestored [{c} + {sc}*1], tmm0",
                        "tilestored [{c} + {sc}*1 + 64], tmm1",
                        c = in(reg) c,
                        sc = in(reg) 4 * d,
                        a = inout(reg) a => _,
                        sa = in(reg) 2 * n32,
                        b = inout(reg) b => _,
                        s64 = in(reg) 64usize,
                        bh = inout(reg) b.add(ld * 32) => _,
                        n = inout(reg) steps => _,
                        options(nostack),
                    );
                }
            }
        }
        hb += if two { 2 } else { 1 };
    }
    // SAFETY: releases the tile state configured above.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Lines `i0 ..` of the pair layout of `pairs` pairs (`ld` lines per column block, the first
/// `pairs` of them used) in `vnni` from `rows`
/// (an even number of rows of `d`, a multiple of 32; they become rows `2 i0 ..` of the call):
/// `vnni[(c / 16 · ld + i0 + i) · 32 + 2 (c mod 16) + r] = rows[(2i + r) · d + c]` (`ld` =
/// [`block_lines`]`(pairs)`).
///
/// # Panics
/// If the CPU has no AVX-512 BF16 (the paths that take the pair layout have it), `d` is not a
/// multiple of 32, the rows are not whole pairs or the lines fall outside `vnni`
/// ([`layout_len`]`(2 pairs, d)` long).
pub(super) fn interleave(rows: &[bf16], d: usize, vnni: &mut [u16], pairs: usize, i0: usize) {
    assert!(
        Isa::Avx512Bf16.is_supported(),
        "dsv4 value product: the pair layout needs AVX-512"
    );
    assert!(d.is_multiple_of(32) && rows.len().is_multiple_of(2 * d));
    assert_eq!(
        vnni.len(),
        layout_len(2 * pairs, d),
        "dsv4 value product: vnni len"
    );
    assert!(
        i0 + rows.len() / (2 * d) <= pairs,
        "dsv4 value product: lines past the layout"
    );
    // SAFETY: AVX-512 BF16 implies AVX-512 F/BW; the bounds were checked above.
    unsafe { interleave_pairs(rows, d, vnni, pairs, i0) };
}

/// Zeroes lines `from .. pairs` of every column block of the pair layout of `pairs` pairs in
/// `vnni` (rows `2 from ..` of the call: the padding past its last row).
///
/// # Panics
/// If `vnni` is not [`layout_len`]`(2 pairs, d)` long, `d` not a multiple of 16 or `from >
/// pairs`.
pub(super) fn zero_lines(vnni: &mut [u16], d: usize, pairs: usize, from: usize) {
    assert!(d.is_multiple_of(16) && from <= pairs);
    assert_eq!(
        vnni.len(),
        layout_len(2 * pairs, d),
        "dsv4 value product: vnni len"
    );
    for block in vnni.chunks_exact_mut(block_lines(pairs) * 32) {
        block[from * 32..pairs * 32].fill(0);
    }
}

/// Pairs ahead of its stores that [`interleave_pairs`] asks for each column block's line with
/// intent to write (`prefetchw`). The pair layout of a call (640 KiB at CSA's 640 candidates)
/// is out of cache when a step starts, and each store's line was first read from memory in
/// turn: the eight CSA attention tasks' core time fell ~9% (means of seven cold single-step
/// swimlanes each, 2089 → 1909 µs), 16 pairs ahead ~7%.
const PW_AHEAD: usize = 8;

/// The two word permutations of [`interleave_pair`]: lane `2k + r` from row `r`'s column `k`
/// (`lo`) or `16 + k` (`hi`) of a 32-column load.
pub(super) struct PairPerm {
    lo: __m512i,
    hi: __m512i,
}

impl PairPerm {
    #[target_feature(enable = "avx512f")]
    pub(super) fn new() -> PairPerm {
        let lo: [u16; 32] =
            std::array::from_fn(|k| (k / 2 + if k % 2 == 1 { 32 } else { 0 }) as u16);
        let hi: [u16; 32] =
            std::array::from_fn(|k| (16 + k / 2 + if k % 2 == 1 { 32 } else { 0 }) as u16);
        // SAFETY: 64-byte arrays.
        unsafe {
            PairPerm {
                lo: _mm512_loadu_si512(lo.as_ptr().cast()),
                hi: _mm512_loadu_si512(hi.as_ptr().cast()),
            }
        }
    }
}

/// The body of [`interleave`] (arguments checked there).
#[target_feature(enable = "avx512f,avx512bw")]
fn interleave_pairs(rows: &[bf16], d: usize, vnni: &mut [u16], pairs: usize, i0: usize) {
    let (ld, perm) = (block_lines(pairs), PairPerm::new());
    for (i, pair) in rows.chunks_exact(2 * d).enumerate() {
        let (r0, r1) = pair.split_at(d);
        // SAFETY: both rows are `d` long; line `i0 + i < pairs` of every column block is inside
        // `vnni` (`layout_len(2 pairs, d)` long, checked by `interleave`).
        unsafe {
            interleave_pair(
                r0.as_ptr(),
                r1.as_ptr(),
                d,
                vnni.as_mut_ptr(),
                ld,
                i0 + i,
                &perm,
            )
        };
    }
}

/// Line `i` of every column block of the pair layout (`ld` lines per block) at `vnni` from the
/// rows `r0` and `r1` (`d` columns, a multiple of 16): `vnni[(c / 16 · ld + i) · 32 + 2 (c mod
/// 16) + r] = r_r[c]`.
///
/// # Safety
/// AVX-512 F/BW; `r0` and `r1` point at `d` readable bf16 each, and the `d / 16` lines
/// `(cb · ld + i) · 32 .. + 32` are writable from `vnni`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn interleave_pair(
    r0: *const bf16,
    r1: *const bf16,
    d: usize,
    vnni: *mut u16,
    ld: usize,
    i: usize,
    perm: &PairPerm,
) {
    let mut c = 0;
    while c < d {
        let cb = c / 16;
        let (l0, l1) = ((cb * ld + i) * 32, ((cb + 1) * ld + i) * 32);
        // SAFETY: columns `c .. c + 32` (or the last 16) of both rows, lines `l0` (and `l1`)
        // of column blocks `cb < d / 16` (and `cb + 1`): the caller's bounds. The `prefetchw`s
        // read and write nothing (below).
        unsafe {
            // `prefetchw` of the lines this column block's stream writes `PW_AHEAD` pairs on:
            // a hint that never faults and writes nothing (past the layout it names other
            // memory, only prefetched), present on every CPU with AVX-512.
            std::arch::asm!(
                "prefetchw [{0}]",
                in(reg) vnni.wrapping_add(l0 + PW_AHEAD * 32),
                options(nostack, readonly, preserves_flags)
            );
            if c + 32 <= d {
                std::arch::asm!(
                    "prefetchw [{0}]",
                    in(reg) vnni.wrapping_add(l1 + PW_AHEAD * 32),
                    options(nostack, readonly, preserves_flags)
                );
                let a = _mm512_loadu_si512(r0.add(c).cast());
                let b = _mm512_loadu_si512(r1.add(c).cast());
                _mm512_storeu_si512(
                    vnni.add(l0).cast(),
                    _mm512_permutex2var_epi16(a, perm.lo, b),
                );
                _mm512_storeu_si512(
                    vnni.add(l1).cast(),
                    _mm512_permutex2var_epi16(a, perm.hi, b),
                );
                c += 32;
            } else {
                // The last 16 columns: both halves' low lanes, so `lo` interleaves them.
                let a = _mm512_maskz_loadu_epi16(0xFFFF, r0.add(c).cast());
                let b = _mm512_maskz_loadu_epi16(0xFFFF, r1.add(c).cast());
                _mm512_storeu_si512(
                    vnni.add(l0).cast(),
                    _mm512_permutex2var_epi16(a, perm.lo, b),
                );
                c += 16;
            }
        }
    }
}
