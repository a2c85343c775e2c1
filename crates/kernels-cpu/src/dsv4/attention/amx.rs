//! AMX-BF16 value product of the sparse attention: `out[h, c] += Σ_j P[h, j] V[j, c]` for one
//! tile, on `tdpbf16ps` (16 × 16 × 32 per instruction).
//!
//! # Orientation
//! The tile unit computes `C[m, n] += Σ_k A[m, k] B[k, n]` with `A` rows contiguous along `k`
//! and `B` in the VNNI layout (a line holds, for 16 columns, a pair of neighbouring `k`). Here
//! `m` is the head, `k` the candidate, `n` the column: `A` is `P` as bf16 `[heads, n32]` (the
//! softmax weights are bf16 values already, so this rounds nothing), `B` is the rows
//! interleaved in pairs (line `i`, column block `cb`: rows `2i` and `2i + 1` over columns
//! `16 cb ..`; the lines of one column block are contiguous, so a `B` tile is 1 KiB in one
//! piece), built once per tile with two permutes per 64 bytes (no transpose), and `C` is
//! a 16 × 16 block of `out` itself (`out` is `[heads, d]` fp32, so a block is 16 rows of 64
//! bytes at a stride of `4 d` bytes): loaded (zero tiles instead for a call's first tile, whose
//! `out` is all zeros), accumulated over the tile, stored back.

use std::arch::asm;
use std::arch::x86_64::*;

use half::bf16;

use crate::gemm::amx_tile_config;
use crate::isa::Isa;

/// Candidates per `K` step of `tdpbf16ps`.
const KSTEP: usize = 32;

/// The operands of one tile's product (sized on first use).
#[derive(Debug, Default)]
pub(super) struct PvScratch {
    /// `P` as bf16 bits `[heads, n32]`, zero past `n`.
    p: Vec<u16>,
    /// The rows in pairs, column block by column block: line `(cb, i)` at `(cb · pairs + i) ·
    /// 32`, element `2 (c mod 16) + r` = row `2i + r`, column `c` of block `cb = c / 16`.
    vnni: Vec<u16>,
}

/// Whether this path handles `heads` heads of `d` (whole 16-head blocks, whole 32-column
/// pairs of column blocks).
pub(super) fn supports(heads: usize, d: usize) -> bool {
    heads > 0 && heads.is_multiple_of(16) && d > 0 && d.is_multiple_of(32)
}

/// `out[h] += Σ_j p[h, j] · rows[j]` for `p` `[heads, n]` (bf16 values), `rows` at least
/// `n32 · d` long (`n32 = n` rounded up to 32; the rows past `n` must be zero: they meet zero
/// weights, and a zero row keeps a NaN out), `out` `[heads, d]`. With `fresh` the sums start
/// from zero tiles instead of `out` (which is then only written): the first tile of a call,
/// whose `out` is all zeros, skips reading it back.
///
/// # Panics
/// If the CPU has no AMX-BF16 (or the tile state was not granted), [`supports`] is false, or
/// the lengths disagree.
#[allow(clippy::too_many_arguments)]
pub(super) fn pv_add(
    p: &[f32],
    heads: usize,
    n: usize,
    rows: &[bf16],
    d: usize,
    out: &mut [f32],
    s: &mut PvScratch,
    fresh: bool,
) {
    assert!(
        Isa::AmxBf16.is_supported(),
        "dsv4 attention: the AMX path runs only where AMX-BF16 is granted"
    );
    assert!(
        supports(heads, d),
        "dsv4 attention: AMX with {heads} heads of {d}"
    );
    let Some(n32) = operands(p, heads, n, rows, d, out, s) else {
        return;
    };
    // SAFETY: the configuration is the crate's palette-1 layout (eight 16 × 64-byte tiles), the
    // tile state was granted (asserted above); released below.
    unsafe { asm!("ldtilecfg [{}]", in(reg) amx_tile_config(), options(nostack, readonly)) };
    let (steps, pairs) = (n32 / KSTEP, n32 / 2);
    // Column blocks outer, heads inner: a pair of column blocks' B lines (2 × pairs × 64
    // bytes) stay in L1 for every head block.
    for cb in (0..d / 16).step_by(2) {
        for hb in 0..heads / 16 {
            let c = out[hb * 16 * d + cb * 16..].as_mut_ptr();
            let a = s.p[hb * 16 * n32..].as_ptr();
            let b = s.vnni[cb * pairs * 32..].as_ptr();
            // SAFETY: C: 16 rows of `out` at a stride of 4d bytes, 128 bytes from column 16 cb
            // (cb + 2 <= d / 16), inside `out` ([heads, d], hb · 16 + 16 <= heads). A: 16 rows
            // of `s.p` at a stride of 2 n32 bytes, 64 bytes per step, `steps` steps inside a
            // row. B0: block cb's lines, 16 (1 KiB) per step, `steps` steps = `pairs` lines;
            // B1: block cb + 1's, `pairs · 64` bytes further, inside `s.vnni` (d / 16 blocks).
            unsafe {
                if fresh {
                    asm!("tilezero tmm0", "tilezero tmm1", options(nostack, nomem));
                } else {
                    asm!(
                        "tileloadd tmm0, [{c} + {sc}*1]",
                        "tileloadd tmm1, [{c} + {sc}*1 + 64]",
                        c = in(reg) c,
                        sc = in(reg) 4 * d,
                        options(nostack, readonly),
                    );
                }
                asm!(
                    "2:",
                    "tileloadd tmm4, [{a} + {sa}*1]",
                    "tileloadd tmm5, [{b} + {s64}*1]",
                    "tileloadd tmm6, [{bh} + {s64}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm5",
                    "tdpbf16ps tmm1, tmm4, tmm6",
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
                    bh = inout(reg) b.add(pairs * 32) => _,
                    n = inout(reg) steps => _,
                    options(nostack),
                );
            }
        }
    }
    // SAFETY: releases the tile state configured above.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Whether [`pv_add_dpbf16`] handles rows of `d` (whole 64-column groups of four column
/// blocks).
pub(super) fn dpbf16_supports(d: usize) -> bool {
    d > 0 && d.is_multiple_of(DP_COLS)
}

/// Columns per register block of [`pv_add_dpbf16`] (four 16-column blocks).
const DP_COLS: usize = 64;

/// Heads per register block of [`pv_add_dpbf16`].
const DP_HEADS: usize = 4;

/// The value product on AVX-512 BF16 (machines without AMX): the same operands as
/// [`pv_add`] — `P` as bf16 pairs, the rows interleaved in pairs into the VNNI layout — and
/// `vdpbf16ps` of a broadcast weight pair `(p[h, 2i], p[h, 2i + 1])` against line `i` of a
/// 16-column block adds both rows' products to 16 columns of one head; blocks of 4 heads × 64
/// columns (16 accumulators, each broadcast used four times) accumulate over the tile in
/// registers and are added to `out` once. Same bf16
/// products as the other paths, fp32 sums in another order. Same arguments as [`pv_add`].
///
/// # Panics
/// If the CPU has no AVX-512 BF16, [`dpbf16_supports`] is false, or the lengths disagree.
pub(super) fn pv_add_dpbf16(
    p: &[f32],
    heads: usize,
    n: usize,
    rows: &[bf16],
    d: usize,
    out: &mut [f32],
    s: &mut PvScratch,
) {
    assert!(
        Isa::Avx512Bf16.is_supported(),
        "dsv4 attention: the AVX-512 BF16 value product runs only where AVX-512 BF16 is"
    );
    assert!(
        dpbf16_supports(d),
        "dsv4 attention: dpbf16 with rows of {d}"
    );
    let Some(n32) = operands(p, heads, n, rows, d, out, s) else {
        return;
    };
    // SAFETY: as above; the operands' lengths were checked.
    unsafe { dpbf16_blocks(&s.p, heads, n32, &s.vnni, d, out) };
}

/// The value product's operands in `s`, after checking the lengths (`p` `[heads, n]`, `rows` at
/// least `n32 · d`, `out` `[heads, d]`): `P` as bf16 bits `[heads, n32]`, zero past `n` (its
/// values are bf16 values: the upper half of each is exact), and the rows interleaved in
/// pairs. `None` for an empty tile; else `n32`.
///
/// # Panics
/// If the lengths disagree, `d` is not a multiple of 32, or the CPU has no AVX-512 F/BW.
fn operands(
    p: &[f32],
    heads: usize,
    n: usize,
    rows: &[bf16],
    d: usize,
    out: &[f32],
    s: &mut PvScratch,
) -> Option<usize> {
    let n32 = n.div_ceil(KSTEP) * KSTEP;
    assert_eq!(p.len(), heads * n, "dsv4 value product: p len");
    assert!(rows.len() >= n32 * d, "dsv4 value product: rows len");
    assert_eq!(out.len(), heads * d, "dsv4 value product: out len");
    assert!(
        Isa::Avx512Bf16.is_supported(),
        "dsv4 value product: needs AVX-512"
    );
    if n == 0 || heads == 0 {
        return None;
    }
    s.p.clear();
    s.p.resize(heads * n32, 0);
    for (dst, src) in s.p.chunks_exact_mut(n32).zip(p.chunks_exact(n)) {
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = (v.to_bits() >> 16) as u16;
        }
    }
    s.vnni.resize(n32 * d, 0);
    // SAFETY: AVX-512 BF16 is supported (asserted), which implies AVX-512 F/BW.
    unsafe { interleave_pairs(&rows[..n32 * d], d, &mut s.vnni) };
    Some(n32)
}

/// The register blocks of [`pv_add_dpbf16`] over `pb` (`[heads, n32]` bf16 bits) and `vnni`
/// (`n32 · d`, [`interleave_pairs`]' layout).
///
/// # Panics
/// If the lengths disagree.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
fn dpbf16_blocks(pb: &[u16], heads: usize, n32: usize, vnni: &[u16], d: usize, out: &mut [f32]) {
    use crate::simd::as_pbh;
    const CB: usize = DP_COLS / 16;
    let pairs = n32 / 2;
    assert!(d.is_multiple_of(DP_COLS) && n32.is_multiple_of(2));
    assert!(pb.len() == heads * n32 && vnni.len() == n32 * d && out.len() == heads * d);
    let mut h0 = 0;
    while h0 < heads {
        let hb = DP_HEADS.min(heads - h0);
        // Head `h0 + hh`'s weight pairs, one `i32` per pair (little-endian: `p[2i]` low).
        let rows: [*const u16; DP_HEADS] =
            std::array::from_fn(|hh| pb[(h0 + hh.min(hb - 1)) * n32..].as_ptr());
        for cg in (0..d / 16).step_by(CB) {
            let mut acc = [[_mm512_setzero_ps(); CB]; DP_HEADS];
            let lines: [*const u16; CB] =
                std::array::from_fn(|c| vnni[(cg + c) * pairs * 32..].as_ptr());
            for i in 0..pairs {
                // SAFETY: line `i < pairs` of column blocks `cg .. cg + CB` (< d / 16) is 32
                // elements inside `vnni` (lengths checked above).
                let b: [__m512bh; CB] = std::array::from_fn(|c| unsafe {
                    as_pbh(_mm512_loadu_si512(lines[c].add(i * 32).cast()))
                });
                for (hh, a) in acc.iter_mut().enumerate().take(hb) {
                    // SAFETY: elements `2i, 2i + 1 < n32` of the head's row of `pb`.
                    let pair = unsafe { rows[hh].add(2 * i).cast::<i32>().read_unaligned() };
                    let pv = as_pbh(_mm512_set1_epi32(pair));
                    for (a, &b) in a.iter_mut().zip(&b) {
                        *a = _mm512_dpbf16_ps(*a, pv, b);
                    }
                }
            }
            for (hh, a) in acc.iter().enumerate().take(hb) {
                let o = &mut out[(h0 + hh) * d + cg * 16..(h0 + hh) * d + cg * 16 + DP_COLS];
                for (c, &a) in a.iter().enumerate() {
                    // SAFETY: `o` is `DP_COLS` fp32; block `c` is 16 of them.
                    unsafe {
                        let p = o.as_mut_ptr().add(16 * c);
                        _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), a));
                    }
                }
            }
        }
        h0 += hb;
    }
}

/// `vnni[(c / 16 · pairs + i) · 32 + 2 (c mod 16) + r] = rows[(2i + r) · d + c]` for the
/// `2 · pairs = rows.len() / d` rows (`d` a multiple of 32).
#[target_feature(enable = "avx512f,avx512bw")]
fn interleave_pairs(rows: &[bf16], d: usize, vnni: &mut [u16]) {
    assert!(d.is_multiple_of(32) && rows.len().is_multiple_of(2 * d));
    assert_eq!(vnni.len(), rows.len(), "interleave_pairs: vnni len");
    let lo: [u16; 32] = std::array::from_fn(|k| (k / 2 + if k % 2 == 1 { 32 } else { 0 }) as u16);
    let hi: [u16; 32] =
        std::array::from_fn(|k| (16 + k / 2 + if k % 2 == 1 { 32 } else { 0 }) as u16);
    // SAFETY: 64-byte arrays.
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_si512(lo.as_ptr().cast()),
            _mm512_loadu_si512(hi.as_ptr().cast()),
        )
    };
    let pairs = rows.len() / (2 * d);
    for (i, pair) in rows.chunks_exact(2 * d).enumerate() {
        let (r0, r1) = pair.split_at(d);
        for c in (0..d).step_by(32) {
            let cb = c / 16;
            let (l0, l1) = ((cb * pairs + i) * 32, ((cb + 1) * pairs + i) * 32);
            assert!(l0 + 32 <= vnni.len() && l1 + 32 <= vnni.len());
            // SAFETY: columns c..c + 32 of both rows (c + 32 <= d); lines l0 and l1 (32
            // elements each) are inside `vnni` (asserted).
            unsafe {
                let a = _mm512_loadu_si512(r0[c..].as_ptr().cast());
                let b = _mm512_loadu_si512(r1[c..].as_ptr().cast());
                let out = vnni.as_mut_ptr();
                _mm512_storeu_si512(out.add(l0).cast(), _mm512_permutex2var_epi16(a, lo, b));
                _mm512_storeu_si512(out.add(l1).cast(), _mm512_permutex2var_epi16(a, hi, b));
            }
        }
    }
}
