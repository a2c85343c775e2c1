//! bf16 causal prefill attention, flash-attention style: a block of 16 queries against the
//! prefix 32 tokens at a time, both products on bf16 pairs with fp32 sums, on one of two
//! engines: the AMX tile unit (`tdpbf16ps`, 16 × 16 × 32 per instruction; `TILES = true`) or
//! AVX-512 BF16 vectors (`vdpbf16ps`, 16 × 2 per instruction; `TILES = false`, the path of
//! AVX-512 BF16 CPUs without AMX, e.g. Zen 4). Everything but the two products is shared:
//! the prefix's gathered K rows and V pairs, the query pairs, the online softmax and the
//! bf16 weights it hands to `P · V`, so the two engines differ only in how the same fp32 sums
//! are ordered.
//!
//! The AVX2 path widens every K and V element to fp32 once per run of tokens and runs both
//! products as fp32 FMAs, 8 lanes each; here the pairs feed the multiply-adds as stored.
//!
//! # Orientation
//! - Scores are computed transposed, `Sᵀ[t, q] = sum_d K[t, d] Q[q, d]`. The queries are laid
//!   out in the VNNI layout (line `j` of step `s` holds, for the 16 queries, the pair
//!   `d = 2p, 2p + 1`, `p = 16 s + j`), built once per query block; the K rows stay contiguous
//!   along `d`. A row of `Sᵀ` is then one token for 16 queries, so the online softmax (max,
//!   `exp`, sums, causal mask) runs across queries, one 16-lane vector per token, without any
//!   horizontal reduction. Tiles: K rows are the `A` operand as they are, the query lines the
//!   `B` operand. Vectors: each query line is multiplied with 16 tokens' broadcast K pair.
//! - `O[q, d] += sum_t P[q, t] V[t, d]`: `P` holds the softmax weights rounded to bf16, paired
//!   along `t`; V is in VNNI layout (line `j` interleaves tokens `2j` and `2j + 1` over 16
//!   columns). Tiles: `P` transposed into query rows is the `A` operand, V the `B` operand.
//!   Vectors: each V line is multiplied with a query's broadcast `P` pair, 16 columns of that
//!   query's outputs per accumulator. The fp32 outputs live in memory between token blocks.
//!
//! The prefix's K rows (gathered out of the pages) and V pairs are prepared once per call and
//! shared by the call's query blocks (the model calls this for 32 rows per task on the tiles,
//! 64 on vectors: 64 or 128 queries of Qwen3's group of 2).
//!
//! # Numerics
//! Queries, K and V are bf16 values already (the queries are widened bf16); both engines
//! accumulate their products in fp32. The scores are scaled in fp32 and the softmax is the
//! AVX2 path's (same `exp` polynomial); the one extra rounding is `P` to bf16 before `P · V`
//! (relative 2⁻⁹ per weight, as the GEMM's activations on this path).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

use super::prefill::Outputs;
use super::{PrefillQueries, PrefillRows};
use crate::gemm::{amx_tile_config, amx_transpose16};
use crate::math::{EXP_COEFFS, EXP_LN2_HI, EXP_LN2_LO};
use crate::simd::as_pbh;

/// Queries per block (the width of a `B` tile).
const QB: usize = 16;
/// Tokens per block (two 16-row score tiles; one 32-element `K` step of `P · V`).
const KB: usize = 32;
/// Largest head dimension handled here.
const MAX_HD: usize = 256;

/// Whether this path handles the head dimension.
pub(super) fn supports(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(32) && head_dim <= MAX_HD
}

/// One 64-byte tile row, 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; 16]);

const ZERO_LINE: Line = Line([0; 16]);

#[derive(Default)]
struct Scratch {
    /// K rows of tokens `0..nt` (zero past the prefix): token `t`, 32-element step `s` at
    /// `t * nks + s`.
    k: Vec<Line>,
    /// V in VNNI tiles: token block `b`, 16-column block `c`, line `j` at
    /// `(b * ncb + c) * 16 + j` (tokens `32 b + 2j`, `32 b + 2j + 1`).
    v: Vec<Line>,
    /// Query VNNI tiles of the current block: step `s`, line `j` at `s * 16 + j`.
    q: Vec<Line>,
    /// Unnormalised outputs of the current block: query `q`, column block `c` at `q * ncb + c`.
    o: Vec<Line>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Causal prefill rows of one KV head (see `prefill_attention_rows_f32`): row `i` of
/// `rows.queries` (`group` queries, fp32 or bf16) attends to tokens `0..=first_pos + i`; `out`
/// gets the normalised outputs, fp32 or rounded to bf16 and packed. The products run on the
/// tile unit with `TILES`, on AVX-512 BF16 vectors without.
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VL/BF16; with `TILES` also AMX-BF16, and Linux granted the
/// tile state ([`crate::amx::request_tile_permission`]); `supports(rows.kv.head_dim)`; `rows`
/// passed `PrefillRows::check` with `out`'s values (`Packed`: one slice of `group ×
/// head_dim` per row).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn prefill_rows<const TILES: bool>(
    rows: &PrefillRows<'_>,
    mut out: Outputs<'_, '_>,
) {
    let (hd, group, first_pos) = (rows.kv.head_dim, rows.group, rows.first_pos);
    let nks = hd / 32;
    let ncb = hd / 16;
    let nq = rows.n_rows() * group;
    let end = rows.tokens().end;
    let nt = end.div_ceil(KB) * KB;
    SCRATCH.with(|cell| {
        let mut s = cell.borrow_mut();
        let s = &mut *s;
        gather(rows, nt, &mut s.k, &mut s.v);
        s.q.resize(nks * 16, ZERO_LINE);
        s.o.resize(QB * ncb, ZERO_LINE);
        if TILES {
            // SAFETY: the configuration is the crate's valid palette-1 layout (eight 16 ×
            // 64-byte tiles); the tile state was granted (contract). Released below before
            // returning.
            unsafe {
                asm!("ldtilecfg [{}]", in(reg) amx_tile_config(), options(nostack, readonly))
            };
        }
        let mut qb0 = 0;
        while qb0 < nq {
            let nqb = QB.min(nq - qb0);
            match rows.queries {
                PrefillQueries::F32(q) => {
                    pack_queries(&q[qb0 * hd..(qb0 + nqb) * hd], hd, &mut s.q)
                }
                PrefillQueries::Bf16 {
                    rows: q,
                    stride,
                    offset,
                    ..
                } => {
                    // Query `qb0 + i` is head `(qb0 + i) % group` of row `(qb0 + i) / group`.
                    let at = |i: usize| {
                        let qi = qb0 + i;
                        (qi / group) * stride + offset + (qi % group) * hd
                    };
                    pack_queries_bf16(q, at, nqb, hd, &mut s.q);
                }
            }
            // Query `qb0 + i` sees tokens below `first_pos + (qb0 + i) / group + 1`; padding
            // lanes see token 0 only (finite, and never written out).
            let lim: [i32; QB] = std::array::from_fn(|i| {
                if i < nqb {
                    (first_pos + (qb0 + i) / group + 1) as i32
                } else {
                    1
                }
            });
            let block_end = first_pos + (qb0 + nqb - 1) / group + 1;
            // SAFETY: with TILES the tiles are configured; the scratch holds every token block
            // below `nt >= block_end` and this block's query tiles.
            let inv = unsafe { block::<TILES>(s, &lim, block_end, nks, ncb, rows.scale) };
            match &mut out {
                Outputs::F32(out) => {
                    write_outputs(&s.o, inv, &mut out[qb0 * hd..(qb0 + nqb) * hd], ncb)
                }
                Outputs::Packed(rows_out) => {
                    let mut f = [0.0f32; QB];
                    // SAFETY: 16 floats.
                    unsafe { _mm512_storeu_ps(f.as_mut_ptr(), inv) };
                    for (i, &fq) in f.iter().enumerate().take(nqb) {
                        let qi = qb0 + i;
                        let dst = &mut rows_out[qi / group][(qi % group) * hd..][..hd];
                        write_packed(&s.o[i * ncb..(i + 1) * ncb], fq, dst);
                    }
                }
            }
            qb0 += nqb;
        }
        if TILES {
            // SAFETY: releases the tile state configured above.
            unsafe { asm!("tilerelease", options(nostack, nomem)) };
        }
    });
}

/// Gathers the K rows and V pairs of the tokens `rows` sees (`0..end`, zero up to `nt`) of
/// its KV head. A K line is 32 consecutive bf16 of a row, so the K rows are copied as they
/// are; each V line interleaves two tokens' 16 columns (one word permutation per line). Every
/// task re-gathers its sequence's prefix, so this runs at copy speed: written with lane-wise
/// loops over pairs it took a third of the vector engine's time at 1024 tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn gather(rows: &PrefillRows<'_>, nt: usize, k: &mut Vec<Line>, v: &mut Vec<Line>) {
    let (kv, block_table, kv_head) = (&rows.kv, rows.block_table, rows.kv_head);
    let end = rows.tokens().end;
    let hd = kv.head_dim;
    let (nks, ncb) = (hd / 32, hd / 16);
    let row = kv.row();
    // Only the lines past the prefix are zeroed: the rest are overwritten below (zeroing the
    // whole scratch first took a tenth of the gather).
    k.resize(nt * nks, ZERO_LINE);
    k[end * nks..].fill(ZERO_LINE);
    v.resize(nt / 2 * ncb, ZERO_LINE);
    // The token pairs past the prefix (`P` is zero there, but stale lines could hold NaN).
    for tp in end.div_ceil(2)..nt / 2 {
        let (b, j) = (2 * tp / KB, tp % (KB / 2));
        for c in 0..ncb {
            v[(b * ncb + c) * 16 + j] = ZERO_LINE;
        }
    }
    let at = |t: usize| kv.slot(block_table, t) * row + kv_head * hd;
    for t in 0..end {
        let src = &kv.k[at(t)..at(t) + hd];
        for (line, chunk) in k[t * nks..(t + 1) * nks]
            .iter_mut()
            .zip(src.chunks_exact(32))
        {
            // SAFETY: 32 bf16 (64 bytes) from the row's chunk into one 64-byte line: a line's
            // word 2j + h is element 2j + h of the chunk, little-endian pairs as stored.
            unsafe {
                let w = _mm512_loadu_si512(chunk.as_ptr().cast());
                _mm512_store_si512(line.0.as_mut_ptr().cast(), w);
            }
        }
    }
    // Word 2i of a V line: column i of the even token; word 2i + 1: column i of the odd one.
    let idx = pair_index();
    let zero = [half::bf16::ZERO; MAX_HD];
    for t in (0..end).step_by(2) {
        let v0 = &kv.v[at(t)..at(t) + hd];
        let v1 = if t + 1 < end {
            &kv.v[at(t + 1)..at(t + 1) + hd]
        } else {
            &zero[..hd]
        };
        let (b, j) = (t / KB, (t % KB) / 2);
        for (c, (c0, c1)) in v0.chunks_exact(16).zip(v1.chunks_exact(16)).enumerate() {
            // SAFETY: 16 bf16 (32 bytes) read from each token's chunk; the line is 64 bytes,
            // 64-byte aligned.
            unsafe {
                let lo = _mm512_castsi256_si512(_mm256_loadu_si256(c0.as_ptr().cast()));
                let hi = _mm512_castsi256_si512(_mm256_loadu_si256(c1.as_ptr().cast()));
                // Words 0..16 of `lo` and of the upper source `hi` (indices 32..48 of the
                // pair): `pair_index` takes word q then word 16 + q of one register, so `hi`
                // is moved up first.
                let both = _mm512_inserti64x4::<1>(lo, _mm512_castsi512_si256(hi));
                let line = _mm512_permutexvar_epi16(idx, both);
                _mm512_store_si512(v[(b * ncb + c) * 16 + j].0.as_mut_ptr().cast(), line);
            }
        }
    }
}

/// Packs up to 16 fp32 queries (`q`, `[n, hd]`, `hd` a multiple of 32) as bf16 VNNI tiles
/// (zero past `n`): for each 16 pairs of the head dimension, each query's 32 values are
/// rounded to 16 pair words in one register (the round-to-nearest-even of
/// `convert::f32_to_bf16`), and a 16 × 16 transpose turns the 16 queries' registers into the
/// 16 lines of those pairs. A scalar loop over every pair took ~5% of the vector engine's time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn pack_queries(q: &[f32], hd: usize, tiles: &mut [Line]) {
    assert!(hd.is_multiple_of(32) && q.len() <= QB * hd && tiles.len() >= hd / 2);
    for g in 0..hd / 32 {
        let mut r = [_mm512_setzero_si512(); QB];
        for (ri, qi) in r.iter_mut().zip(q.chunks_exact(hd)) {
            let x = &qi[32 * g..32 * (g + 1)];
            // SAFETY: `x` is 32 floats, read as two 16-float vectors.
            let (lo, hi) = unsafe {
                (
                    _mm512_loadu_ps(x.as_ptr()),
                    _mm512_loadu_ps(x.as_ptr().add(16)),
                )
            };
            // Words 0..16 round `lo`, words 16..32 `hi`: word w is element 32 g + w, so
            // 32-bit lane k is the pair (32 g + 2k, 32 g + 2k + 1), low element in the low half.
            // SAFETY: plain 512-bit vectors with no invalid bit patterns.
            *ri = unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) };
        }
        amx_transpose16(&mut r);
        // Pair `p = 16 g + k` is line `k` of step `g`.
        for (line, v) in tiles[16 * g..16 * (g + 1)].iter_mut().zip(r) {
            // SAFETY: a line is 64 bytes, 64-byte aligned.
            unsafe { _mm512_store_si512(line.0.as_mut_ptr().cast(), v) };
        }
    }
}

/// Packs `n` (at most 16) bf16 queries, query `i`'s `hd` values at `q[at(i)..]` (`hd` a
/// multiple of 32), as [`pack_queries`] packs their widened values: each query's 32 values of a
/// step are already its 16 pair words, so one load per query and step, and the 16 × 16
/// transpose.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn pack_queries_bf16(
    q: &[half::bf16],
    at: impl Fn(usize) -> usize,
    n: usize,
    hd: usize,
    tiles: &mut [Line],
) {
    assert!(hd.is_multiple_of(32) && n <= QB && tiles.len() >= hd / 2);
    for g in 0..hd / 32 {
        let mut r = [_mm512_setzero_si512(); QB];
        for (i, ri) in r.iter_mut().take(n).enumerate() {
            let x = &q[at(i) + 32 * g..][..32];
            // SAFETY: `x` is 32 bf16 (64 bytes): word w is element 32 g + w, so 32-bit lane k is
            // the pair (32 g + 2k, 32 g + 2k + 1), low element in the low half.
            *ri = unsafe { _mm512_loadu_si512(x.as_ptr().cast()) };
        }
        amx_transpose16(&mut r);
        for (line, v) in tiles[16 * g..16 * (g + 1)].iter_mut().zip(r) {
            // SAFETY: a line is 64 bytes, 64-byte aligned.
            unsafe { _mm512_store_si512(line.0.as_mut_ptr().cast(), v) };
        }
    }
}

/// One query block (its VNNI tiles in `s.q`) over the token blocks below `block_end`, leaving
/// the unnormalised outputs in `s.o` and returning each query's normalising factor (`1 / l`,
/// zero where `l` is); the products on the tile unit with `TILES`, on vectors without.
///
/// # Safety
/// AVX-512 F/BW/VL/BF16; with `TILES` the crate's tile configuration is loaded; `s.k`/`s.v`
/// hold every token block below `block_end` for `nks`/`ncb` steps/column blocks; `s.q` has
/// `nks` tiles, `s.o` 16 × `ncb` lines.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn block<const TILES: bool>(
    s: &mut Scratch,
    lim: &[i32; QB],
    block_end: usize,
    nks: usize,
    ncb: usize,
    scale: f32,
) -> __m512 {
    // The tiles accumulate onto `s.o` from the first block on; the vectors start their
    // register tiles at zero there instead (`Onto::Zero`).
    if TILES {
        s.o.fill(ZERO_LINE);
    }
    // SAFETY: 16 i32.
    let limv = unsafe { _mm512_loadu_si512(lim.as_ptr().cast()) };
    let scalev = _mm512_set1_ps(scale);
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut l = _mm512_setzero_ps();
    let mut st = [ZERO_LINE; KB];
    let mut pt = [ZERO_LINE; QB];
    let pair_idx = pair_index();
    for b in 0..block_end.div_ceil(KB) {
        let t0 = b * KB;
        if !TILES {
            // SAFETY: tokens t0..t0 + 32 of `s.k` exist (below `nt`), `s.q` holds `nks` tiles.
            unsafe { scores_vec(s, t0, nks, &mut st) };
        } else {
            // SAFETY: K tiles of tokens t0..t0 + 32 (two 16-row tiles, `nks` 64-byte steps at a
            // row stride of `nks * 64` bytes) are inside `s.k`; `s.q` holds `nks` 1 KiB tiles; the
            // stores write the 2 KiB of `st`.
            unsafe {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "2:",
                    "tileloadd tmm2, [{k0} + {sk}*1]",
                    "tileloadd tmm3, [{k1} + {sk}*1]",
                    "tileloadd tmm4, [{qp} + {s64}*1]",
                    "tdpbf16ps tmm0, tmm2, tmm4",
                    "tdpbf16ps tmm1, tmm3, tmm4",
                    "add {k0}, 64",
                    "add {k1}, 64",
                    "add {qp}, 1024",
                    "dec {n}",
                    "jnz 2b",
                    "tilestored [{st} + {s64}*1], tmm0",
                    "tilestored [{st} + {s64}*1 + 1024], tmm1",
                    k0 = inout(reg) s.k.as_ptr().add(t0 * nks) => _,
                    k1 = inout(reg) s.k.as_ptr().add((t0 + 16) * nks) => _,
                    sk = in(reg) nks * 64,
                    qp = inout(reg) s.q.as_ptr() => _,
                    s64 = in(reg) 64usize,
                    n = inout(reg) nks => _,
                    st = in(reg) st.as_mut_ptr(),
                    options(nostack),
                );
            }
        }
        // Scaled, masked scores (one token per vector, 16 queries) and their max.
        let mut x = [_mm512_setzero_ps(); KB];
        let mut valid: [__mmask16; KB] = [0; KB];
        let mut mx = m;
        for (r, line) in st.iter().enumerate() {
            // SAFETY: a line is 64 bytes, 64-byte aligned.
            let v = _mm512_mul_ps(unsafe { _mm512_load_ps(line.0.as_ptr().cast()) }, scalev);
            valid[r] = _mm512_cmplt_epi32_mask(_mm512_set1_epi32((t0 + r) as i32), limv);
            x[r] = _mm512_mask_blend_ps(valid[r], _mm512_set1_ps(f32::NEG_INFINITY), v);
            mx = _mm512_max_ps(mx, x[r]);
        }
        // Every query sees token 0, so `mx` is finite from the first block on.
        let corr = exp512(_mm512_sub_ps(m, mx));
        let mut sum = _mm512_setzero_ps();
        let mut pairs = [_mm512_setzero_si512(); 16];
        for j in 0..16 {
            let p0 = _mm512_maskz_mov_ps(valid[2 * j], exp512(_mm512_sub_ps(x[2 * j], mx)));
            let p1 = _mm512_maskz_mov_ps(valid[2 * j + 1], exp512(_mm512_sub_ps(x[2 * j + 1], mx)));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            // SAFETY: plain 512-bit vectors with no invalid bit patterns.
            let words =
                unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(p1, p0)) };
            // Lane q: (P[q, 2j], P[q, 2j + 1]).
            pairs[j] = _mm512_permutexvar_epi16(pair_idx, words);
        }
        l = _mm512_fmadd_ps(l, corr, sum);
        m = mx;
        // Tiles: line q holds the 16 token pairs of query q (the `A` tile of `P · V`).
        // Vectors: line j holds token pair j of the 16 queries, each broadcast in turn.
        if TILES {
            amx_transpose16(&mut pairs);
        }
        for (line, v) in pt.iter_mut().zip(pairs) {
            // SAFETY: a line is 64 bytes, 64-byte aligned.
            unsafe { _mm512_store_si512(line.0.as_mut_ptr().cast(), v) };
        }
        let moved = _mm512_cmpneq_ps_mask(corr, _mm512_set1_ps(1.0)) != 0;
        if !TILES {
            // The outputs so far: none in the first block; rescaled where the max moved, as
            // each register tile loads them (a separate pass over them took ~5% of this
            // path's time at 512 tokens).
            let onto = if b == 0 {
                Onto::Zero
            } else if moved {
                Onto::Rescaled(corr)
            } else {
                Onto::Loaded
            };
            // SAFETY: `pt` holds the block's 16 token pairs of 16 queries; the V lines of block
            // `b` (`ncb` column blocks of 16 lines) are inside `s.v`; `s.o` holds 16 × `ncb`.
            unsafe {
                pv_vec(
                    &pt,
                    &s.v[b * ncb * 16..(b + 1) * ncb * 16],
                    &mut s.o,
                    ncb,
                    onto,
                )
            };
            continue;
        }
        // Rescale the outputs where the max moved.
        if moved {
            scale_outputs(&mut s.o, corr, ncb);
        }
        // SAFETY: `pt` is one 1 KiB tile; the V tiles of block `b` (`ncb` of 1 KiB, an even
        // number since hd is a multiple of 32) are inside `s.v`; the output tiles are the 16
        // rows of `s.o` at a stride of `ncb * 64` bytes, 64 bytes per column block.
        unsafe {
            asm!(
                "tileloadd tmm4, [{pt} + {s64}*1]",
                "2:",
                "tileloadd tmm0, [{o} + {so}*1]",
                "tileloadd tmm1, [{o} + {so}*1 + 64]",
                "tileloadd tmm5, [{v} + {s64}*1]",
                "tileloadd tmm6, [{v} + {s64}*1 + 1024]",
                "tdpbf16ps tmm0, tmm4, tmm5",
                "tdpbf16ps tmm1, tmm4, tmm6",
                "tilestored [{o} + {so}*1], tmm0",
                "tilestored [{o} + {so}*1 + 64], tmm1",
                "add {o}, 128",
                "add {v}, 2048",
                "sub {n}, 2",
                "jnz 2b",
                pt = in(reg) pt.as_ptr(),
                s64 = in(reg) 64usize,
                o = inout(reg) s.o.as_mut_ptr() => _,
                so = in(reg) ncb * 64,
                v = inout(reg) s.v.as_ptr().add(b * ncb * 16) => _,
                n = inout(reg) ncb => _,
                options(nostack),
            );
        }
    }
    _mm512_maskz_div_ps(
        _mm512_cmp_ps_mask::<_CMP_GT_OQ>(l, _mm512_setzero_ps()),
        _mm512_set1_ps(1.0),
        l,
    )
}

/// Writes a block's outputs (query `q`, column block `c` at `o[q * ncb + c]`) times their
/// query's lane of `factor` (the normalisation) into its queries' rows of `out` (`ncb * 16`
/// floats each, as many rows as `out` holds). A line at a time: the element-wise loop this
/// replaced ran as scalar moves, ~5% of the vector engine's time at 512 tokens.
#[target_feature(enable = "avx512f")]
fn write_outputs(o: &[Line], factor: __m512, out: &mut [f32], ncb: usize) {
    let mut f = [0.0f32; QB];
    // SAFETY: 16 floats.
    unsafe { _mm512_storeu_ps(f.as_mut_ptr(), factor) };
    for ((row, lines), &fq) in out
        .chunks_exact_mut(ncb * 16)
        .zip(o.chunks_exact(ncb))
        .zip(&f)
    {
        let fv = _mm512_set1_ps(fq);
        for (dst, line) in row.chunks_exact_mut(16).zip(lines) {
            // SAFETY: `dst` is 16 floats (unaligned store); a line is 64 bytes, 64-byte
            // aligned, its bits those of 16 floats.
            unsafe {
                let v = _mm512_mul_ps(_mm512_load_ps(line.0.as_ptr().cast()), fv);
                _mm512_storeu_ps(dst.as_mut_ptr(), v);
            }
        }
    }
}

/// Writes one query's outputs (`o`: its column blocks' lines) times `factor` (its
/// normalisation), rounded to bf16 as `convert::f32_to_bf16` rounds (ties to even, a NaN
/// quietened) and widened back, into `dst` in the packed order of whole packing blocks (each
/// 16 values' even ones, then its odd ones: `gemm::pack_index`).
#[target_feature(enable = "avx512f")]
fn write_packed(o: &[Line], factor: f32, dst: &mut [f32]) {
    assert_eq!(dst.len(), o.len() * 16, "write_packed: row length");
    let fv = _mm512_set1_ps(factor);
    // Packed position p holds element 2p (p < 8) or 2(p - 8) + 1.
    const IDX: [i32; 16] = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15];
    // SAFETY: 16 i32.
    let idx = unsafe { _mm512_loadu_si512(IDX.as_ptr().cast()) };
    let high = _mm512_set1_epi32(0xFFFF_0000_u32 as i32);
    for (d, line) in dst.chunks_exact_mut(16).zip(o) {
        // SAFETY: a line is 64 bytes, 64-byte aligned.
        let v = _mm512_mul_ps(unsafe { _mm512_load_ps(line.0.as_ptr().cast()) }, fv);
        let bits = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_and_si512(
            _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
            high,
        );
        let quiet = _mm512_or_si512(_mm512_and_si512(bits, high), _mm512_set1_epi32(0x0040_0000));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
        let packed = _mm512_permutexvar_epi32(idx, r);
        // SAFETY: `d` is 16 floats (unaligned store).
        unsafe { _mm512_storeu_si512(d.as_mut_ptr().cast(), packed) };
    }
}

/// Multiplies each query's outputs (`o`: query `q`, column block `c` at `q * ncb + c`) by its
/// lane of `factor`: the tiles' rescale where the running max moved.
#[target_feature(enable = "avx512f")]
fn scale_outputs(o: &mut [Line], factor: __m512, ncb: usize) {
    let mut f = [0.0f32; QB];
    // SAFETY: 16 floats.
    unsafe { _mm512_storeu_ps(f.as_mut_ptr(), factor) };
    for (lines, &fq) in o.chunks_exact_mut(ncb).zip(&f) {
        let fv = _mm512_set1_ps(fq);
        for line in lines {
            // SAFETY: a line is 64 bytes, 64-byte aligned.
            unsafe {
                let p = line.0.as_mut_ptr().cast::<f32>();
                _mm512_store_ps(p, _mm512_mul_ps(_mm512_load_ps(p), fv));
            }
        }
    }
}

/// `st[r]` = the unscaled scores of token `t0 + r` (`r < 32`) for the block's 16 queries:
/// for each pair `p` of the head dimension, query line `p` times each of 16 tokens' K pair
/// `p` broadcast, 16 accumulators (one per token) so no multiply-add waits on the one before.
///
/// # Safety
/// AVX-512 F/BW/VL/BF16; `s.k` holds tokens `t0..t0 + 32` of `nks` lines each, `s.q` `nks`
/// tiles of 16 lines; `nks` at most `MAX_HD / 32`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn scores_vec(s: &Scratch, t0: usize, nks: usize, st: &mut [Line; KB]) {
    assert!(s.k.len() >= (t0 + KB) * nks && s.q.len() >= nks * 16);
    let k = &s.k[t0 * nks..(t0 + KB) * nks];
    let q = &s.q[..nks * 16];
    // The token stride as a constant: the broadcasts then address the 16 rows as one base
    // plus fixed offsets (with a run-time stride each row took an add of its own).
    // SAFETY: `k` is 32 tokens of `nks` lines, `q` `nks * 16` lines (just sliced).
    unsafe {
        match nks {
            1 => scores_16x2::<1>(k, q, st),
            2 => scores_16x2::<2>(k, q, st),
            3 => scores_16x2::<3>(k, q, st),
            4 => scores_16x2::<4>(k, q, st),
            5 => scores_16x2::<5>(k, q, st),
            6 => scores_16x2::<6>(k, q, st),
            7 => scores_16x2::<7>(k, q, st),
            8 => scores_16x2::<8>(k, q, st),
            _ => unreachable!("scores_vec: {nks} K steps past MAX_HD"),
        }
    }
}

/// [`scores_vec`] for `NKS` 32-element steps per token: `k` the block's 32 token rows, `q` the
/// query lines.
///
/// # Safety
/// AVX-512 F/BW/VL/BF16; `k.len() == 32 * NKS`, `q.len() == 16 * NKS`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn scores_16x2<const NKS: usize>(k: &[Line], q: &[Line], st: &mut [Line; KB]) {
    assert!(k.len() == KB * NKS && q.len() == 16 * NKS);
    let pairs = NKS * 16;
    for half in 0..KB / 16 {
        // Token `r` of this half: its pair `p` at `r * pairs + p` (a line is 16 pairs).
        let kh = k[16 * half * NKS..].as_ptr().cast::<u32>();
        let mut acc = [_mm512_setzero_ps(); 16];
        for (p, line) in q.iter().enumerate() {
            // SAFETY: a line is 64 bytes, 64-byte aligned.
            let qv = as_pbh(unsafe { _mm512_load_si512(line.0.as_ptr().cast()) });
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: r < 16 tokens of `pairs` u32 from `kh` (asserted above).
                let kp = unsafe { kh.add(r * pairs + p).read() };
                *a = _mm512_dpbf16_ps(*a, qv, as_pbh(_mm512_set1_epi32(kp as i32)));
            }
        }
        for (line, a) in st[16 * half..16 * (half + 1)].iter_mut().zip(acc) {
            // SAFETY: a line is 64 bytes, 64-byte aligned.
            unsafe { _mm512_store_ps(line.0.as_mut_ptr().cast(), a) };
        }
    }
}

/// What a register tile of `P · V` starts from: the query block's outputs so far, as they are
/// or rescaled.
#[derive(Clone, Copy)]
enum Onto {
    /// Nothing yet (the first token block): zero, `o` not read.
    Zero,
    /// `o` as it is.
    Loaded,
    /// `o` times its query's lane of the vector (the running max moved).
    Rescaled(__m512),
}

/// `o[q] = onto(o[q]) + Σ_j P[q, 2j..2j + 2] · V[2j..2j + 2]` for the block's 16 queries over
/// one token block: `pt` line `j` holds token pair `j` of every query, `v` the block's V lines
/// (column block `c`, pair `j` at `c * 16 + j`), `o` the running outputs (query `q`, column
/// block `c` at `q * ncb + c`). Register tiles of 4 queries × 4 column blocks (8 × 2 where
/// `ncb` is not a multiple of 4): each V line loaded once per tile feeds 4 (8) queries.
///
/// # Safety
/// AVX-512 F/BW/VL/BF16; `ncb` even; `v.len() >= ncb * 16`, `o.len() >= QB * ncb`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pv_vec(pt: &[Line; QB], v: &[Line], o: &mut [Line], ncb: usize, onto: Onto) {
    assert!(ncb.is_multiple_of(2) && v.len() >= ncb * 16 && o.len() >= QB * ncb);
    if ncb.is_multiple_of(4) {
        // SAFETY: as this function's (asserted above), 4 divides ncb.
        unsafe { pv_tiles::<4, 4>(pt, v, o, ncb, onto) }
    } else {
        // SAFETY: as this function's (asserted above), 2 divides ncb.
        unsafe { pv_tiles::<8, 2>(pt, v, o, ncb, onto) }
    }
}

/// [`pv_vec`] in register tiles of `QT` queries × `CT` column blocks.
///
/// # Safety
/// As [`pv_vec`]'s; `QT` divides [`QB`] and `CT` divides `ncb`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
#[allow(clippy::needless_range_loop)] // register tiles indexed by query and column block
unsafe fn pv_tiles<const QT: usize, const CT: usize>(
    pt: &[Line; QB],
    v: &[Line],
    o: &mut [Line],
    ncb: usize,
    onto: Onto,
) {
    assert!(QB.is_multiple_of(QT) && ncb.is_multiple_of(CT));
    assert!(v.len() >= ncb * 16 && o.len() >= QB * ncb);
    let mut f = [1.0f32; QB];
    if let Onto::Rescaled(factor) = onto {
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(f.as_mut_ptr(), factor) };
    }
    for q0 in (0..QB).step_by(QT) {
        for c0 in (0..ncb).step_by(CT) {
            let mut acc = [[_mm512_setzero_ps(); CT]; QT];
            if !matches!(onto, Onto::Zero) {
                for i in 0..QT {
                    let fv = _mm512_set1_ps(f[q0 + i]);
                    for c in 0..CT {
                        // SAFETY: a line is 64 bytes, 64-byte aligned; (q0 + i) * ncb + c0 + c
                        // < QB * ncb <= o.len().
                        let a =
                            unsafe { _mm512_load_ps(o[(q0 + i) * ncb + c0 + c].0.as_ptr().cast()) };
                        acc[i][c] = match onto {
                            Onto::Rescaled(_) => _mm512_mul_ps(a, fv),
                            _ => a,
                        };
                    }
                }
            }
            for (j, pj) in pt.iter().enumerate() {
                let vv: [__m512bh; CT] = std::array::from_fn(|c| {
                    // SAFETY: a line is 64 bytes, 64-byte aligned; (c0 + c) * 16 + j <
                    // ncb * 16 <= v.len().
                    as_pbh(unsafe { _mm512_load_si512(v[(c0 + c) * 16 + j].0.as_ptr().cast()) })
                });
                for i in 0..QT {
                    let p = as_pbh(_mm512_set1_epi32(pj.0[q0 + i] as i32));
                    for c in 0..CT {
                        acc[i][c] = _mm512_dpbf16_ps(acc[i][c], vv[c], p);
                    }
                }
            }
            for i in 0..QT {
                for c in 0..CT {
                    // SAFETY: as the loads above.
                    unsafe {
                        _mm512_store_ps(o[(q0 + i) * ncb + c0 + c].0.as_mut_ptr().cast(), acc[i][c])
                    };
                }
            }
        }
    }
}

/// The word permutation that interleaves the two halves of a `cvtne2ps` result: word `2q`
/// takes word `q` (first source), word `2q + 1` takes word `16 + q` (second source).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn pair_index() -> __m512i {
    const IDX: [u16; 32] = {
        let mut idx = [0u16; 32];
        let mut q = 0;
        while q < 16 {
            idx[2 * q] = q as u16;
            idx[2 * q + 1] = 16 + q as u16;
            q += 1;
        }
        idx
    };
    // SAFETY: IDX is 64 bytes.
    unsafe { _mm512_loadu_si512(IDX.as_ptr().cast()) }
}

/// Sixteen-lane `e^x`, the polynomial of the AVX2 path (`crate::math::exp_approx`), clamped to
/// `[-87, 88]`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn exp512(x: __m512) -> __m512 {
    // `max`/`min` return their second operand when either is NaN: `x` goes second so a NaN
    // score stays NaN (as `exp_approx`'s clamp keeps it) instead of becoming e^-87.
    let x = _mm512_min_ps(
        _mm512_set1_ps(88.0),
        _mm512_max_ps(_mm512_set1_ps(-87.0), x),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let f = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    let f = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), f);
    let [c6, rest @ ..] = EXP_COEFFS;
    let mut p = _mm512_set1_ps(c6);
    for c in rest {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    // `p · 2^n` in one instruction where building the power's bits took three (convert, add
    // the bias, shift) and a multiply: `n` is a whole number in [-126, 127] after the clamp,
    // so both are the one correctly rounded product `p · 2^n`, bit for bit.
    _mm512_scalef_ps(p, n)
}

#[cfg(test)]
mod tests {
    use std::arch::x86_64::*;

    use super::exp512;
    use crate::isa::Isa;

    /// The vector query packing against a plain loop over every pair: any fp32 values
    /// (rounded to nearest even), 1–16 queries, every head dimension the path takes, the lines
    /// past the last query zero.
    #[test]
    fn packed_queries_are_each_pair_in_its_line_and_lane() {
        if !Isa::Avx512Bf16.is_supported() {
            eprintln!("skipped: the CPU lacks Avx512Bf16");
            return;
        }
        let mut state = 0x5EED_u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Values across many exponents, with low mantissa bits set (rounding matters).
            f32::from_bits(
                ((state >> 33) as u32 & 0x807F_FFFF) | (((state >> 20) as u32 % 40 + 107) << 23),
            )
        };
        for hd in [32usize, 64, 128, 256] {
            for n in [1usize, 5, 15, 16] {
                let q: Vec<f32> = (0..n * hd).map(|_| next()).collect();
                let mut got = vec![super::Line([0xDEAD_BEEF; 16]); hd / 2];
                // SAFETY: AVX-512 F/BW/VL/BF16 (checked above).
                unsafe { super::pack_queries(&q, hd, &mut got) };
                for p in 0..hd / 2 {
                    for i in 0..16 {
                        let want = if i < n {
                            let lo = crate::convert::f32_to_bf16(q[i * hd + 2 * p]).to_bits();
                            let hi = crate::convert::f32_to_bf16(q[i * hd + 2 * p + 1]).to_bits();
                            u32::from(lo) | (u32::from(hi) << 16)
                        } else {
                            0
                        };
                        assert_eq!(got[p].0[i], want, "hd {hd} n {n} pair {p} query {i}");
                    }
                }
            }
        }
    }

    /// The vector `e^x` against `f64::exp` and the scalar `exp_approx`
    /// (`math::check_exp_form`).
    #[test]
    fn exp512_matches_the_scalar_form() {
        if !Isa::Avx512Bf16.is_supported() {
            eprintln!("skipped: the CPU lacks Avx512Bf16");
            return;
        }
        crate::math::check_exp_form("exp512", 16, |v| {
            // SAFETY: AVX-512 F (implied by AVX-512 BF16, checked above); `v` is sixteen floats.
            unsafe { _mm512_storeu_ps(v.as_mut_ptr(), exp512(_mm512_loadu_ps(v.as_ptr()))) }
        });
    }
}
