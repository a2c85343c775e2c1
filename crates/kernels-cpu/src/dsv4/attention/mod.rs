//! Sparse attention with an attention sink over a candidate list (`docs/dsv4.md`, "SWA layer"
//! step 3): every head of a token attends to the same candidate rows (one row is K and V of
//! every head), the list taken in tiles of [`ATTN_TILE`] entries with an online softmax in
//! fp32, `o += bf16(p) @ kv`, and the sink as a logit with a zero value row:
//! `out = o / (Σ p + exp(sink − m))`.
//!
//! A candidate is `None` when masked (padding, an invalid index): it is skipped, so it changes
//! nothing; a tile with no valid row is skipped whole before anything is read; a list with no
//! valid row gives zeros.
//!
//! # One tile
//! The KV row is shared by every head (MQA-like), so a tile is read once for all the heads of
//! the call:
//! 1. its valid rows are copied once into a contiguous `[n, d]` block (a row copy per
//!    candidate: the compressed candidates are scattered cache rows); nothing is transposed;
//! 2. the scores of every head against the tile are one [`crate::gemm_bf16_prepared`] product
//!    with the rows as the weights and the heads' queries as the activations (AMX tiles from 16
//!    heads, AVX-512 BF16, AVX2, portable); the queries are packed and, on AMX, converted to
//!    the tile unit's layout once per call, not once per tile;
//! 3. the online softmax of all heads (`softmax_tile`: scale, max, `exp`, sum, `bf16(p)`)
//!    is one lane-blocked body compiled portable, for AVX2 and for AVX-512, chosen at run
//!    time; the builds agree bit for bit;
//! 4. the value product `out[h] += Σ_j bf16(p[h, j]) · row_j` reads the rows as they lie
//!    (`[n, d]`, the `B` operand's natural layout): on AMX (`amx.rs`, heads a multiple of 16,
//!    `d` of 32) the rows are interleaved in pairs into the tile unit's VNNI layout and the
//!    heads' weights are the `A` operand; on AVX-512 BF16 without AMX (rows a multiple of 64
//!    wide) the same pair layout meets broadcast weight pairs in `vdpbf16ps`
//!    (`amx::pv_add_dpbf16`); elsewhere `pv_add` is a register-blocked body (4 heads × 16
//!    columns) built like the softmax.

use half::bf16;

use crate::gemm::{
    GemmTile, PackedActs, PreparedActs, WeightsBf16, gemm_bf16_prepared, pack_acts_f32, packed_len,
};
use crate::isa::Isa;
use crate::math::exp_approx;

#[cfg(target_arch = "x86_64")]
mod amx;

/// Candidates per tile.
pub const ATTN_TILE: usize = 128;

/// Reusable buffers of [`sparse_attention`] (sized on first use, kept between calls).
#[derive(Debug, Default)]
pub struct AttnScratch {
    /// The tile's valid rows `[n, d]`, zero rows after them up to a multiple of 32.
    rows: Vec<bf16>,
    q_packed: Vec<f32>,
    /// The queries as the scores' product takes them (converted once per call).
    q: PreparedActs,
    /// The tile's scores `[heads, n]`.
    scores: Vec<f32>,
    /// `bf16(p)` as fp32 `[heads, n]`.
    p: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    /// The AMX value product's operands.
    #[cfg(target_arch = "x86_64")]
    amx: amx::PvScratch,
}

/// Which value-product path [`sparse_attention`] takes for `heads` heads of `d` on `isa`.
pub fn pv_path(isa: Isa, heads: usize, d: usize) -> Isa {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::AmxBf16 && amx::supports(heads, d) {
        return Isa::AmxBf16;
    }
    let _ = (heads, d);
    isa.min(Isa::Avx512Bf16)
}

/// Attention of `heads = sinks.len()` heads over `cands`.
///
/// `q` is `[heads, d]` (bf16 values), every present candidate `d` long, `out` `[heads, d]`.
/// Scores are `q · row · scale`.
///
/// # Panics
/// If `q` or `out` is not `heads · d` long or a candidate is not `d` long.
pub fn sparse_attention(
    q: &[f32],
    d: usize,
    cands: &[Option<&[bf16]>],
    scale: f32,
    sinks: &[f32],
    out: &mut [f32],
    s: &mut AttnScratch,
) {
    let heads = sinks.len();
    assert_eq!(q.len(), heads * d, "sparse_attention: q len");
    assert_eq!(out.len(), heads * d, "sparse_attention: out len");
    out.fill(0.0);
    if heads == 0 || d == 0 {
        return;
    }
    let path = pv_path(Isa::current(), heads, d);
    s.q_packed.resize(packed_len(heads, d), 0.0);
    pack_acts_f32(q, heads, d, &mut s.q_packed);
    s.q.prepare(PackedActs::new(&s.q_packed, heads, d));
    s.m.clear();
    s.m.resize(heads, f32::NEG_INFINITY);
    s.l.clear();
    s.l.resize(heads, 0.0);
    s.alpha.resize(heads, 0.0);
    let mut first = true;
    for tile in cands.chunks(ATTN_TILE) {
        let n = tile.iter().flatten().count();
        if n == 0 {
            continue;
        }
        // 1. The valid rows, contiguous, zero-padded to whole 32-row steps.
        let n32 = n.div_ceil(32) * 32;
        s.rows.clear();
        for r in tile.iter().flatten() {
            assert_eq!(r.len(), d, "sparse_attention: candidate row len");
            s.rows.extend_from_slice(r);
        }
        s.rows.resize(n32 * d, bf16::ZERO);
        // 2. scores[h, j] = q[h] · row[j]
        s.scores.resize(heads * n, 0.0);
        let rows = WeightsBf16::new(&s.rows[..n * d], n, d);
        gemm_bf16_prepared(rows, &s.q, &GemmTile::full(&rows), &mut s.scores, n);
        // 3. Online softmax; what the earlier tiles left is rescaled by exp(m_old − m_new).
        s.p.resize(heads * n, 0.0);
        softmax_tile(
            &s.scores,
            n,
            scale,
            &mut s.m,
            &mut s.l,
            &mut s.alpha,
            &mut s.p,
        );
        // The heads' first tile (every head sees the same rows) has alpha 0 over an `out` of
        // zeros: nothing to scale.
        if !first {
            for (o, &a) in out.chunks_exact_mut(d).zip(&s.alpha) {
                if a != 1.0 {
                    o.iter_mut().for_each(|v| *v *= a);
                }
            }
        }
        // 4. out[h] += bf16(p[h]) @ rows (on AMX the first tile's sums start from zero
        // tiles rather than reading the zeros back)
        match path {
            #[cfg(target_arch = "x86_64")]
            Isa::AmxBf16 => amx::pv_add(&s.p, heads, n, &s.rows, d, out, &mut s.amx, first),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 if amx::dpbf16_supports(d) => {
                amx::pv_add_dpbf16(&s.p, heads, n, &s.rows, d, out, &mut s.amx)
            }
            _ => pv_add(&s.p, heads, n, &s.rows[..n * d], d, out),
        }
        first = false;
    }
    for ((o, &m), (&l, &sink)) in out.chunks_exact_mut(d).zip(&s.m).zip(s.l.iter().zip(sinks)) {
        if m == f32::NEG_INFINITY {
            continue; // no valid candidate: zeros
        }
        let denom = l + (sink - m).exp();
        o.iter_mut().for_each(|v| *v /= denom);
    }
}

/// Lanes of the softmax's partial maxima and sums.
const LANES: usize = 16;

/// Rounds a finite `x` to the nearest bf16 value (ties to even), as fp32.
#[inline(always)]
fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000)
}

/// One body compiled three times (portable, AVX2+FMA, AVX-512) and chosen on
/// [`Isa::current`]: no `mul_add` is written and the compiler contracts none, so the builds
/// compute the same operations in the same order and agree bit for bit.
macro_rules! three_builds {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn generic($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2($($arg: $ty),*) {
                generic($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            fn avx512($($arg: $ty),*) {
                generic($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            {
                let isa = Isa::current();
                if isa >= Isa::Avx512Bf16 {
                    // SAFETY: `Isa::current` is Avx512Bf16 or wider only on a CPU with
                    // AVX-512 F/BW/VL (and AVX2, FMA, F16C), the features `avx512` uses.
                    return unsafe { avx512($($arg),*) };
                }
                if isa >= Isa::Avx2 {
                    // SAFETY: `Isa::current` is Avx2 or wider only on a CPU with AVX2, FMA and
                    // F16C, the features `avx2` uses.
                    return unsafe { avx2($($arg),*) };
                }
            }
            generic($($arg),*)
        }
    };
}

three_builds! {
    /// The online softmax of one tile for every head: `scores` `[heads, n]` (unscaled, heads
    /// = `m.len()`) are scaled; per head the new max `m' = max(m, scores)`, `alpha =
    /// exp(m − m')` (written to `alpha`, 0 for a head's first tile), `e = exp(score − m')`,
    /// `l = l · alpha + Σ e` and `p = bf16(e)` (`[heads, n]`). The maxima and sums run in
    /// [`LANES`] lanes reduced in a fixed order.
    ///
    /// # Panics
    /// If `scores` or `p` is not `heads · n` long or `l`, `alpha` not `heads` long.
    pub(crate) fn softmax_tile(
        scores: &[f32],
        n: usize,
        scale: f32,
        m: &mut [f32],
        l: &mut [f32],
        alpha: &mut [f32],
        p: &mut [f32],
    ) {
        let heads = m.len();
        assert_eq!(scores.len(), heads * n, "softmax_tile: scores len");
        assert_eq!(p.len(), heads * n, "softmax_tile: p len");
        assert!(l.len() == heads && alpha.len() == heads, "softmax_tile: state len");
        if n == 0 {
            alpha.fill(1.0);
            return;
        }
        let body = n / LANES * LANES;
        for h in 0..heads {
            let sc = &scores[h * n..(h + 1) * n];
            let ph = &mut p[h * n..(h + 1) * n];
            // Scaled scores into `p`, and their max.
            let mut mx = [f32::NEG_INFINITY; LANES];
            for (s, o) in sc[..body].chunks_exact(LANES).zip(ph[..body].chunks_exact_mut(LANES)) {
                for i in 0..LANES {
                    o[i] = s[i] * scale;
                    mx[i] = mx[i].max(o[i]);
                }
            }
            for (i, (s, o)) in sc[body..].iter().zip(&mut ph[body..]).enumerate() {
                *o = s * scale;
                mx[i] = mx[i].max(*o);
            }
            let mt = mx.iter().fold(m[h], |a, &b| a.max(b));
            alpha[h] = if m[h] == f32::NEG_INFINITY { 0.0 } else { (m[h] - mt).exp() };
            m[h] = mt;
            let mut sum = [0.0f32; LANES];
            for o in ph[..body].chunks_exact_mut(LANES) {
                for i in 0..LANES {
                    let e = exp_approx(o[i] - mt);
                    sum[i] += e;
                    o[i] = round_bf16(e);
                }
            }
            for (i, o) in ph[body..].iter_mut().enumerate() {
                let e = exp_approx(*o - mt);
                sum[i] += e;
                *o = round_bf16(e);
            }
            // Pairwise, in a fixed order.
            let mut w = LANES;
            while w > 1 {
                w /= 2;
                for i in 0..w {
                    sum[i] += sum[i + w];
                }
            }
            l[h] = l[h] * alpha[h] + sum[0];
        }
    }
}

/// Heads per block of [`pv_add`].
const PV_HEADS: usize = 4;
/// Columns per block of [`pv_add`].
const PV_COLS: usize = 16;

three_builds! {
    /// `out[h, c] += Σ_j p[h, j] · rows[j, c]` for `p` `[heads, n]`, `rows` `[n, d]` bf16 read
    /// in place, `out` `[heads, d]` (heads = `out.len() / d`): blocks of [`PV_HEADS`] heads ×
    /// [`PV_COLS`] columns accumulate over `j` in registers (products then sums, in `j`
    /// order) and are added to `out` once.
    ///
    /// # Panics
    /// If the lengths disagree.
    pub(crate) fn pv_add(
        p: &[f32],
        heads: usize,
        n: usize,
        rows: &[bf16],
        d: usize,
        out: &mut [f32],
    ) {
        assert_eq!(p.len(), heads * n, "pv_add: p len");
        assert_eq!(rows.len(), n * d, "pv_add: rows len");
        assert_eq!(out.len(), heads * d, "pv_add: out len");
        let widen = |v: bf16| f32::from_bits(u32::from(v.to_bits()) << 16);
        let mut h0 = 0;
        while h0 < heads {
            let hb = PV_HEADS.min(heads - h0);
            let mut c0 = 0;
            while c0 < d {
                let cw = PV_COLS.min(d - c0);
                let mut acc = [[0.0f32; PV_COLS]; PV_HEADS];
                if hb == PV_HEADS && cw == PV_COLS {
                    for j in 0..n {
                        let src = &rows[j * d + c0..j * d + c0 + PV_COLS];
                        let r: [f32; PV_COLS] = std::array::from_fn(|c| widen(src[c]));
                        for (hh, a) in acc.iter_mut().enumerate() {
                            let pj = p[(h0 + hh) * n + j];
                            for c in 0..PV_COLS {
                                a[c] += pj * r[c];
                            }
                        }
                    }
                } else {
                    for j in 0..n {
                        let src = &rows[j * d + c0..j * d + c0 + cw];
                        for (hh, a) in acc.iter_mut().enumerate().take(hb) {
                            let pj = p[(h0 + hh) * n + j];
                            for (a, &v) in a.iter_mut().zip(src) {
                                *a += pj * widen(v);
                            }
                        }
                    }
                }
                for (hh, a) in acc.iter().enumerate().take(hb) {
                    let o = &mut out[(h0 + hh) * d + c0..(h0 + hh) * d + c0 + cw];
                    for (o, &a) in o.iter_mut().zip(a) {
                        *o += a;
                    }
                }
                c0 += cw;
            }
            h0 += hb;
        }
    }
}

#[cfg(test)]
mod tests;
