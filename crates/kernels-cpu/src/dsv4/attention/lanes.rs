//! The sparse attention on AVX-512 BF16 with the heads in the vector lanes (machines without
//! AMX, rows a multiple of 16 wide): every product is `vdpbf16ps`, and no row is copied or
//! transposed for the scores.
//!
//! # Orientation
//! One KV row serves every head, so a vector holds 16 heads:
//! 1. **Queries** are laid out once per call as pairs `Q'[k, h]` (`hp` heads, padded with zero
//!    heads to a multiple of 16; a 32-bit lane holds `q[h, 2k]` low and `q[h, 2k + 1]` high),
//!    sixteen heads' runs of sixteen pairs transposed in registers into sixteen lines.
//! 2. **Scores** `s[j, h] = Σ_c q[h, c] K[j, c]`: each row's pairs are broadcast from where the
//!    row lies (its cache: the scattered top-k rows are read in place, prefetched
//!    [`super::COPY_AHEAD`] rows ahead), and one `vdpbf16ps` of a broadcast row pair against
//!    a line of `Q'` adds two of `d`'s products to 16 heads' scores. Blocks of `R` rows × `G`
//!    head vectors (`R · G` = [`ACC`] accumulators) run over all of `d` and are stored as
//!    `[n, hp]`, each head's maximum of the scaled scores kept on the way (a NaN score is
//!    ignored, as in `softmax_rows`).
//! 3. Right after a block's scores, its rows (in L1 now) are interleaved in pairs into the
//!    value product's layout (`amx::interleave_pair`): the rows' only copy. An odd last row
//!    pairs with a zero row.
//! 4. **Softmax** with the heads in the lanes: `e = exp(s · scale − m)` (the same power-of-two
//!    form and rounding as `softmax_rows`), the sums in row order, `bf16(e)` of rows `2i` and
//!    `2i + 1` packed as one 32-bit pair per head, `P'[i, h]`.
//! 5. **Value product** `out[h, c] = inv[h] · Σ_i P'[i, h] · V(i, c)`: a broadcast weight pair
//!    against a line of the pair layout (16 columns of two rows) adds both rows' products to
//!    16 columns of one head; blocks of [`PV_HEADS`] heads × [`PV_BLOCKS`] column blocks stay
//!    in registers over every pair and are stored once, scaled by `inv[h] = 1 / (Σ p + e^(sink
//!    − m))`: `out` is only written.
//!
//! Against the row-major form this replaces (rows copied into a block, paired by a transpose
//! for the scores' GEMM kernel, the queries converted per block, `out` zeroed, added to and
//! scaled in three passes), a FLASH CSA token (64 heads × 512 over 640 rows) drops ~20% of its
//! work that was not products (`docs/benchmarks.md`, session 47).

use std::arch::x86_64::*;

use half::bf16;

use super::amx::{PairPerm, block_lines, interleave_pair, layout_len};
use super::{COPY_AHEAD, Queries, aligned64, prefetch_row};
use crate::isa::Isa;
use crate::simd::as_pbh;

/// Heads per vector.
const LANES: usize = 16;

/// Accumulators of a scores block: rows × head vectors.
const ACC: usize = 24;

/// Head vectors per scores block (the rest of [`ACC`] are rows).
const SCORE_VECTORS: usize = 4;

/// Heads per register block of the value product.
const PV_HEADS: usize = 4;

/// 16-column blocks per register block of the value product.
const PV_BLOCKS: usize = 4;

/// Reusable buffers of [`attend`] (sized on first use, kept between calls).
#[derive(Debug, Default)]
pub(super) struct LanesScratch {
    /// The queries as bf16 `[heads, d]`, where they came in fp32 slots.
    q16: Vec<bf16>,
    /// `Q'` `[d / 2, hp]`.
    q: Vec<u32>,
    /// The addresses of the call's rows, in order.
    rows: Vec<usize>,
    /// The scores `[n, hp]`, unscaled.
    scores: Vec<f32>,
    /// Per head: the maximum of the scaled scores, `Σ e`, `1 / (Σ e + e^(sink − m))`.
    m: Vec<f32>,
    l: Vec<f32>,
    inv: Vec<f32>,
    /// `P'` `[pairs, hp]`.
    p: Vec<u32>,
    /// The rows in the value product's pair layout (`amx::layout_len`).
    vnni: Vec<u16>,
    /// One zero row, the partner of an odd call's last row.
    zero: Vec<bf16>,
}

/// Whether this engine takes rows of `d` (whole 16-column blocks).
pub(super) fn supports(d: usize) -> bool {
    d > 0 && d.is_multiple_of(LANES)
}

/// The attention of `heads = sinks.len()` heads over the `n` rows of `cands` (`n > 0`, every
/// candidate whole rows of `d`: checked by the caller), as [`super::sparse_attention`].
///
/// # Panics
/// If the CPU has no AVX-512 BF16, [`supports`] is false or the lengths disagree.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    q: Queries<'_>,
    d: usize,
    cands: &[Option<&[bf16]>],
    n: usize,
    scale: f32,
    sinks: &[f32],
    out: &mut [f32],
    s: &mut LanesScratch,
) {
    assert!(
        Isa::Avx512Bf16.is_supported(),
        "dsv4 attention: the head-lane engine runs only where AVX-512 BF16 is"
    );
    assert!(supports(d), "dsv4 attention: head lanes with rows of {d}");
    let heads = sinks.len();
    assert!(heads > 0 && n > 0);
    assert_eq!(out.len(), heads * d, "dsv4 attention: out len");
    let hp = heads.next_multiple_of(LANES);
    let qb: &[bf16] = match q {
        Queries::Bf16(q) => q,
        Queries::F32(q) => {
            s.q16.resize(q.len(), bf16::ZERO);
            crate::convert::cast_f32_bf16(q, &mut s.q16);
            &s.q16
        }
    };
    assert_eq!(qb.len(), heads * d, "dsv4 attention: q len");
    let q_at = aligned64(&mut s.q, d / 2 * hp);
    // SAFETY: AVX-512 BF16 (asserted) implies AVX-512 F; `qb` is `[heads, d]` with `d` even and
    // the output `[d / 2, hp]` (the function checks both).
    unsafe { pack_queries(qb, heads, d, hp, &mut s.q[q_at.clone()]) };
    s.rows.clear();
    for c in cands.iter().flatten() {
        s.rows
            .extend(c.chunks_exact(d).map(|row| row.as_ptr() as usize));
    }
    assert_eq!(s.rows.len(), n, "dsv4 attention: rows");
    let pairs = n.div_ceil(2);
    s.zero.clear();
    s.zero.resize(d, bf16::ZERO);
    let vnni_at = aligned64(&mut s.vnni, layout_len(2 * pairs, d));
    let scores_at = aligned64(&mut s.scores, n * hp);
    s.m.clear();
    s.m.resize(hp, f32::NEG_INFINITY);
    // SAFETY: AVX-512 BF16 (asserted above); every row address is of `d` readable bf16 (a
    // chunk of a candidate slice, borrowed for this call), `zero` is `d` long, and the
    // function checks the other lengths.
    unsafe {
        scores_and_pairs(
            &s.q[q_at],
            hp,
            d,
            &s.rows,
            &s.zero,
            scale,
            &mut s.scores[scores_at.clone()],
            &mut s.m,
            &mut s.vnni[vnni_at.clone()],
        )
    };
    s.l.clear();
    s.l.resize(hp, 0.0);
    let p_at = aligned64(&mut s.p, pairs * hp);
    // SAFETY: AVX-512 F (implied by AVX-512 BF16, asserted above); the function checks the
    // lengths.
    unsafe {
        softmax_pairs(
            &s.scores[scores_at],
            n,
            hp,
            scale,
            &s.m,
            &mut s.l,
            &mut s.p[p_at.clone()],
        )
    };
    s.inv.clear();
    s.inv.extend(
        s.m.iter()
            .zip(&s.l)
            .zip(sinks)
            .map(|((&m, &l), &sink)| 1.0 / (l + (sink - m).exp())),
    );
    // SAFETY: AVX-512 BF16 (asserted above); the function checks the lengths.
    unsafe { value_product(&s.p[p_at], hp, pairs, &s.vnni[vnni_at], d, &s.inv, out) };
}

/// `Q'[k, h] = q[h, 2k] | q[h, 2k + 1] << 16` (bf16 bits) for `q` `[heads, d]`, zero for the
/// padding heads `heads .. hp`.
///
/// Sixteen heads' runs of sixteen pairs (one 64-byte load each) are transposed in registers
/// into sixteen lines of `Q'`. It replaced one gather of sixteen heads' pairs per line: on
/// Zen 4 a gather took ~27 cycles, 8% of a SWA token's attention (64 heads × 512 over 128
/// rows; `docs/benchmarks.md`, session 52).
///
/// # Panics
/// If `d` is odd, `hp` not a multiple of 16 below `heads`, or the lengths disagree.
#[target_feature(enable = "avx512f")]
pub(super) fn pack_queries(q: &[bf16], heads: usize, d: usize, hp: usize, out: &mut [u32]) {
    assert!(d.is_multiple_of(2) && hp.is_multiple_of(LANES) && hp >= heads);
    assert!(q.len() == heads * d && out.len() == d / 2 * hp);
    let kp = d / 2;
    for g in 0..hp / LANES {
        let valid = heads.saturating_sub(g * LANES).min(LANES);
        for k0 in (0..kp).step_by(LANES) {
            let kn = (kp - k0).min(LANES);
            let kmask: __mmask16 = ((1u32 << kn) - 1) as u16;
            let rows: [__m512i; LANES] = std::array::from_fn(|h| {
                if h < valid {
                    // SAFETY: lanes `< kn` read pairs `k0 .. k0 + kn <= d / 2` of head
                    // `g · 16 + h < heads`, inside `q` (checked above); masked lanes read
                    // nothing.
                    unsafe {
                        _mm512_maskz_loadu_epi32(
                            kmask,
                            q.as_ptr().add((g * LANES + h) * d + 2 * k0).cast(),
                        )
                    }
                } else {
                    _mm512_setzero_si512()
                }
            });
            for (c, line) in transpose_16x16(rows).iter().enumerate().take(kn) {
                // SAFETY: line `k0 + c < d / 2` of head group `g` is 16 `u32` inside `out`
                // (checked above).
                unsafe {
                    _mm512_storeu_si512(
                        out.as_mut_ptr().add((k0 + c) * hp + g * LANES).cast(),
                        *line,
                    )
                };
            }
        }
    }
}

/// The transpose of a 16 × 16 matrix of 32-bit lanes (`r[i]` lane `j` becomes lane `i` of
/// the result's vector `j`): pairs of lanes, then pairs of pairs within each 128-bit lane,
/// then the 128-bit lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose_16x16(r: [__m512i; 16]) -> [__m512i; 16] {
    // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved (low and high pairs of each 128-bit
    // lane).
    let t: [__m512i; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // u[4i + j], 128-bit lane l: rows 4i .. 4i + 4 of column 4l + j.
    let u: [__m512i; 16] = std::array::from_fn(|i| {
        let (base, j) = (i & !3, i % 4);
        let (a, b) = (t[base + j / 2], t[base + 2 + j / 2]);
        if j % 2 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    // Column 4l + j: 128-bit lane l of u[j], u[4 + j], u[8 + j], u[12 + j], in that order.
    let mut out = [_mm512_setzero_si512(); 16];
    for j in 0..4 {
        let even01 = _mm512_shuffle_i32x4::<0x88>(u[j], u[4 + j]);
        let odd01 = _mm512_shuffle_i32x4::<0xDD>(u[j], u[4 + j]);
        let even23 = _mm512_shuffle_i32x4::<0x88>(u[8 + j], u[12 + j]);
        let odd23 = _mm512_shuffle_i32x4::<0xDD>(u[8 + j], u[12 + j]);
        out[j] = _mm512_shuffle_i32x4::<0x88>(even01, even23);
        out[8 + j] = _mm512_shuffle_i32x4::<0xDD>(even01, even23);
        out[4 + j] = _mm512_shuffle_i32x4::<0x88>(odd01, odd23);
        out[12 + j] = _mm512_shuffle_i32x4::<0xDD>(odd01, odd23);
    }
    out
}

/// The scores of every row against every head into `scores` `[n, hp]` (unscaled), `m[h]` the
/// largest scaled score of head `h` (from `-inf`), and the rows' pair layout in `vnni`
/// ([`layout_len`]`(2 · pairs, d)`, `pairs = ⌈n / 2⌉`), block by block.
///
/// # Safety
/// The CPU has AVX-512 BF16, and each of `rows` (`n` addresses) is of `d` readable bf16 for the
/// call.
///
/// # Panics
/// If the lengths disagree.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn scores_and_pairs(
    q: &[u32],
    hp: usize,
    d: usize,
    rows: &[usize],
    zero: &[bf16],
    scale: f32,
    scores: &mut [f32],
    m: &mut [f32],
    vnni: &mut [u16],
) {
    let n = rows.len();
    let pairs = n.div_ceil(2);
    let hv = hp / LANES;
    assert!(hp.is_multiple_of(LANES) && hv > 0 && d.is_multiple_of(LANES));
    assert!(q.len() == d / 2 * hp && scores.len() == n * hp && m.len() == hp);
    assert!(zero.len() == d && vnni.len() == layout_len(2 * pairs, d));
    // Rows per block: four head vectors take 6 (24 accumulators); fewer take more. Even, so a
    // block is whole pairs but at the call's end.
    let r = ACC / hv.min(SCORE_VECTORS);
    let (ld, perm) = (block_lines(pairs), PairPerm::new());
    for &row in rows.iter().take(COPY_AHEAD) {
        prefetch_row(row, d);
    }
    let mut j0 = 0;
    while j0 < n {
        let k = r.min(n - j0);
        for &row in rows.iter().skip(j0 + COPY_AHEAD).take(k) {
            prefetch_row(row, d);
        }
        // The block's rows, the last valid one repeated past `k` (computed, not stored).
        let at: [*const u32; ACC] = std::array::from_fn(|i| rows[j0 + i.min(k - 1)] as *const u32);
        for g0 in (0..hv).step_by(SCORE_VECTORS) {
            let g = (hv - g0).min(SCORE_VECTORS);
            let args = Block {
                q: q[g0 * LANES..].as_ptr(),
                hp,
                kp: d / 2,
                rows: &at,
                valid: k,
                out: scores[j0 * hp + g0 * LANES..].as_mut_ptr(),
                m: m[g0 * LANES..].as_mut_ptr(),
                scale,
            };
            // SAFETY: `q` from head vector `g0` holds `g` vectors at each of `d / 2` lines of
            // `hp`; each address of `at` is a row of `d` (`d / 2` pairs) by this function's
            // contract; `out` from row `j0`, head `16 g0`: `valid = k` rows of `hp` with `g`
            // vectors inside `scores` (j0 + k <= n); `m` from `16 g0` holds `g` vectors.
            unsafe {
                match (r, g) {
                    (6, 4) => scores_block::<6, 4>(&args),
                    (6, 3) => scores_block::<6, 3>(&args),
                    (6, 2) => scores_block::<6, 2>(&args),
                    (6, 1) => scores_block::<6, 1>(&args),
                    (8, 3) => scores_block::<8, 3>(&args),
                    (12, 2) => scores_block::<12, 2>(&args),
                    (24, 1) => scores_block::<24, 1>(&args),
                    _ => unreachable!("rows {r} with {g} head vectors"),
                }
            }
        }
        // The block's pairs into the layout (j0 is even: every block but the last is).
        for i in j0 / 2..(j0 + k).div_ceil(2) {
            let r0 = rows[2 * i] as *const bf16;
            let r1 = rows
                .get(2 * i + 1)
                .map_or(zero.as_ptr(), |&a| a as *const bf16);
            // SAFETY: both rows are `d` readable bf16 (the contract; `zero` is `d` long), line
            // `i < pairs` of every column block is inside `vnni` (its length checked above).
            unsafe { interleave_pair(r0, r1, d, vnni.as_mut_ptr(), ld, i, &perm) };
        }
        j0 += k;
    }
}

/// The operands of one [`scores_block`].
struct Block<'a> {
    /// `Q'` from the block's first head vector (line stride `hp`).
    q: *const u32,
    hp: usize,
    /// Pairs per row (`d / 2`).
    kp: usize,
    /// The rows (the first `R` used), read as pairs.
    rows: &'a [*const u32; ACC],
    /// Rows stored (the first `valid`).
    valid: usize,
    /// `scores` at the block's first row and head (row stride `hp`).
    out: *mut f32,
    /// The running maxima from the block's first head.
    m: *mut f32,
    scale: f32,
}

/// `R` rows × `G` head vectors of the scores, over all `d`, stored for the first `valid` rows,
/// with their scaled maxima folded into `m`.
///
/// # Safety
/// AVX-512 BF16; the pointers of `b` as [`Block`] describes them, in bounds.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn scores_block<const R: usize, const G: usize>(b: &Block<'_>) {
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    for k in 0..b.kp {
        // SAFETY: line `k < d / 2` of `Q'`, `G` vectors from the block's first head; pair `k`
        // of each row (the caller's contract).
        unsafe {
            let qv: [__m512bh; G] = std::array::from_fn(|g| {
                as_pbh(_mm512_loadu_si512(b.q.add(k * b.hp + g * LANES).cast()))
            });
            for (r, a) in acc.iter_mut().enumerate() {
                let pair = as_pbh(_mm512_set1_epi32(b.rows[r].add(k).read_unaligned() as i32));
                for (a, &q) in a.iter_mut().zip(&qv) {
                    *a = _mm512_dpbf16_ps(*a, q, pair);
                }
            }
        }
    }
    let scale = _mm512_set1_ps(b.scale);
    // SAFETY: `G` vectors of maxima from `b.m`; rows `r < valid` of the block's scores.
    unsafe {
        let mut mx: [__m512; G] = std::array::from_fn(|g| _mm512_loadu_ps(b.m.add(g * LANES)));
        for (r, a) in acc.iter().enumerate().take(b.valid) {
            for (g, (&a, mx)) in a.iter().zip(&mut mx).enumerate() {
                _mm512_storeu_ps(b.out.add(r * b.hp + g * LANES), a);
                // `max(x, m)` gives `m` where `x` is NaN: such a score is ignored.
                *mx = _mm512_max_ps(_mm512_mul_ps(a, scale), *mx);
            }
        }
        for (g, &mx) in mx.iter().enumerate() {
            _mm512_storeu_ps(b.m.add(g * LANES), mx);
        }
    }
}

/// `exp2_approx` on 16 lanes, the same operations in the same order (so the same bits).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn exp2_16(x: __m512) -> __m512 {
    use crate::math::{EXP2_COEFFS, EXP2_ROUNDER};
    // `max(-126, x)` keeps a NaN `x` (the second operand is returned where one is NaN).
    let x = _mm512_max_ps(_mm512_set1_ps(-126.0), x);
    let t = _mm512_add_ps(x, _mm512_set1_ps(EXP2_ROUNDER));
    let n = _mm512_sub_ps(t, _mm512_set1_ps(EXP2_ROUNDER));
    let f = _mm512_sub_ps(x, n);
    let [c5, rest @ ..] = EXP2_COEFFS;
    let mut p = _mm512_set1_ps(c5);
    for c in rest {
        p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(c));
    }
    let e = _mm512_slli_epi32::<23>(_mm512_sub_epi32(
        _mm512_castps_si512(t),
        _mm512_set1_epi32((EXP2_ROUNDER.to_bits() - 127) as i32),
    ));
    _mm512_mul_ps(p, _mm512_castsi512_ps(e))
}

/// `x` rounded to bf16 (nearest, ties to even) in the high 16 bits of each lane, zero low.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn round_bf16_16(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd);
    _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF_0000u32 as i32))
}

/// The softmax with the heads in the lanes: for `scores` `[n, hp]` (unscaled) and `m` (each
/// head's largest scaled score), `e = exp(s · scale − m)`, `l[h] = Σ e` in row order, and
/// `p[i, h]` the pair `bf16(e[2i, h]) | bf16(e[2i + 1, h]) << 16` (zero past the last row).
///
/// # Safety
/// AVX-512 F.
///
/// # Panics
/// If the lengths disagree.
#[target_feature(enable = "avx512f")]
unsafe fn softmax_pairs(
    scores: &[f32],
    n: usize,
    hp: usize,
    scale: f32,
    m: &[f32],
    l: &mut [f32],
    p: &mut [u32],
) {
    let pairs = n.div_ceil(2);
    assert!(hp.is_multiple_of(LANES) && scores.len() == n * hp);
    assert!(m.len() == hp && l.len() == hp && p.len() == pairs * hp);
    let c = _mm512_set1_ps(scale * std::f32::consts::LOG2_E);
    let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
    for g in (0..hp).step_by(LANES) {
        // SAFETY: 16 lanes from head `g < hp` of `m` and `l` and of rows `< n` of `scores`
        // (lengths checked above); `p` line `i < pairs` at head `g`.
        unsafe {
            let mc = _mm512_mul_ps(_mm512_loadu_ps(m[g..].as_ptr()), log2e);
            let e = |j: usize| {
                let s = _mm512_loadu_ps(scores[j * hp + g..].as_ptr());
                exp2_16(_mm512_sub_ps(_mm512_mul_ps(s, c), mc))
            };
            let mut sum = _mm512_setzero_ps();
            for i in 0..pairs {
                let e0 = e(2 * i);
                sum = _mm512_add_ps(sum, e0);
                let lo = _mm512_srli_epi32::<16>(round_bf16_16(e0));
                let pair = if 2 * i + 1 < n {
                    let e1 = e(2 * i + 1);
                    sum = _mm512_add_ps(sum, e1);
                    _mm512_or_si512(lo, round_bf16_16(e1))
                } else {
                    lo
                };
                _mm512_storeu_si512(p[i * hp + g..].as_mut_ptr().cast(), pair);
            }
            _mm512_storeu_ps(l[g..].as_mut_ptr(), sum);
        }
    }
}

/// `out[h, c] = inv[h] · Σ_i P'[i, h] · V(i, c)` for the `heads = out.len() / d` real heads:
/// `p` `[pairs, hp]`, `vnni` the rows' pair layout ([`layout_len`]`(2 · pairs, d)`).
///
/// # Safety
/// AVX-512 BF16.
///
/// # Panics
/// If the lengths disagree.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn value_product(
    p: &[u32],
    hp: usize,
    pairs: usize,
    vnni: &[u16],
    d: usize,
    inv: &[f32],
    out: &mut [f32],
) {
    let heads = out.len() / d;
    assert!(d.is_multiple_of(LANES) && heads <= hp && out.len() == heads * d);
    assert!(p.len() == pairs * hp && inv.len() >= heads);
    assert_eq!(vnni.len(), layout_len(2 * pairs, d));
    let (ld, blocks) = (block_lines(pairs), d / LANES);
    let mut h0 = 0;
    while h0 < heads {
        let hb = if heads - h0 >= PV_HEADS { PV_HEADS } else { 1 };
        let mut cb = 0;
        while cb < blocks {
            let nb = if blocks - cb >= PV_BLOCKS {
                PV_BLOCKS
            } else {
                1
            };
            let args = Pv {
                p: p[h0..].as_ptr(),
                hp,
                pairs,
                lines: vnni[cb * ld * 32..].as_ptr(),
                ld,
                out: out[h0 * d + cb * LANES..].as_mut_ptr(),
                d,
                inv: &inv[h0..h0 + hb],
            };
            // SAFETY: heads `h0 .. h0 + hb <= heads` and column blocks `cb .. cb + nb <=
            // blocks`: `P'` columns inside each of `pairs` lines, layout lines `(cb + c) · ld +
            // i` inside `vnni`, `out` rows `h0 ..` columns `16 cb ..` inside `out`.
            unsafe {
                match (hb, nb) {
                    (PV_HEADS, PV_BLOCKS) => pv_block::<PV_HEADS, PV_BLOCKS>(&args),
                    (PV_HEADS, 1) => pv_block::<PV_HEADS, 1>(&args),
                    (1, PV_BLOCKS) => pv_block::<1, PV_BLOCKS>(&args),
                    _ => pv_block::<1, 1>(&args),
                }
            }
            cb += nb;
        }
        h0 += hb;
    }
}

/// The operands of one [`pv_block`].
struct Pv<'a> {
    /// `P'` from the block's first head (line stride `hp`).
    p: *const u32,
    hp: usize,
    pairs: usize,
    /// Line 0 of the block's first column block (`ld` lines per column block).
    lines: *const u16,
    ld: usize,
    /// `out` at the block's first head and column (row stride `d`).
    out: *mut f32,
    d: usize,
    /// The block's heads' final scales.
    inv: &'a [f32],
}

/// `H` heads × `C` 16-column blocks of the value product, over every pair, stored scaled.
///
/// # Safety
/// AVX-512 BF16; the pointers of `v` as [`Pv`] describes them, in bounds; `v.inv` has `H`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pv_block<const H: usize, const C: usize>(v: &Pv<'_>) {
    let mut acc = [[_mm512_setzero_ps(); C]; H];
    for i in 0..v.pairs {
        // SAFETY: line `i < pairs` of column blocks `0 .. C` and `P'` line `i`, heads `0 .. H`
        // (the caller's bounds).
        unsafe {
            let b: [__m512bh; C] = std::array::from_fn(|c| {
                as_pbh(_mm512_loadu_si512(v.lines.add((c * v.ld + i) * 32).cast()))
            });
            for (h, a) in acc.iter_mut().enumerate() {
                let w = as_pbh(_mm512_set1_epi32(v.p.add(i * v.hp + h).read() as i32));
                for (a, &b) in a.iter_mut().zip(&b) {
                    *a = _mm512_dpbf16_ps(*a, w, b);
                }
            }
        }
    }
    for (h, a) in acc.iter().enumerate() {
        let s = _mm512_set1_ps(v.inv[h]);
        for (c, &a) in a.iter().enumerate() {
            // SAFETY: row `h`, columns `16 c ..` of the block inside `out`.
            unsafe { _mm512_storeu_ps(v.out.add(h * v.d + c * LANES), _mm512_mul_ps(a, s)) };
        }
    }
}
